"""Each pytest process's memory, printed at the end of a run: its peak and the modules after which
it held the most. The suite runs on 24 GiB beside its servers; a run that comes near says where."""

from __future__ import annotations

import resource

import psutil

GIB = 2**30


class WorkerMemory:
    def __init__(self):
        self.by_module: dict[str, int] = {}  # the most resident bytes after any of the module's tests

    def note(self, nodeid: str) -> None:
        module = nodeid.split("::", 1)[0]
        self.by_module[module] = max(self.by_module.get(module, 0), psutil.Process().memory_info().rss)

    def summary(self) -> dict:
        """What a worker sends back (plain values: xdist carries them to the controller)."""
        largest = sorted(self.by_module.items(), key=lambda item: -item[1])[:3]
        return {"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "largest": largest}


def describe(name: str, summary: dict | None) -> str:
    if summary is None:
        return f"{name}: no figure (the process died)"
    after = ", ".join(f"{module} {rss / GIB:.1f} GiB" for module, rss in summary["largest"])
    return f"{name}: peak {summary['peak'] / GIB:.1f} GiB; held the most after {after}"
