"""What the command says while it runs and when it ends: on a terminal a progress bar (rows,
rows/s, ETA), otherwise a plain line every few seconds; then a summary."""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Tally:
    """What the run did, for the summary."""

    total: int  # rows in the input
    skipped: int  # rows an earlier run had written
    rows: int = 0  # rows written by this run
    failed: Counter = field(default_factory=Counter)  # failed rows by status ("not sent" when refused here)
    requests: int = 0
    started: float = field(default_factory=time.monotonic)

    def summary(self, retries: Counter, outcome: str) -> str:
        elapsed = time.monotonic() - self.started
        rate = self.rows / elapsed if elapsed > 0 else 0.0
        failed = sum(self.failed.values())
        by_status = ", ".join(f"{status}: {n}" for status, n in sorted(self.failed.items(), key=str))
        retried = ", ".join(f"{status}: {n}" for status, n in sorted(retries.items()))
        done = self.skipped + self.rows
        return (f"embedserve batch {outcome}: {done} of {self.total} rows written"
                + (f" ({self.skipped} by an earlier run)" if self.skipped else "")
                + f"; this run {self.rows} rows in {elapsed:.1f} s ({rate:.1f} rows/s), {self.requests} requests"
                + f"; {self.rows - failed} succeeded, {failed} failed" + (f" ({by_status})" if failed else "")
                + (f"; retried {retried}" if retried else ""))


class Progress:
    def __init__(self, tally: Tally, mode: str = "auto", every_s: float = 15.0, stream=None):
        self.tally, self.every_s = tally, every_s
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "log"
        self.mode = mode
        self._bar = None
        self._logged = time.monotonic()
        if mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=tally.total, initial=tally.skipped, unit="row", file=self.stream,
                             dynamic_ncols=True, smoothing=0.1)

    def advance(self, rows: int) -> None:
        if self._bar is not None:
            self._bar.update(rows)
        elif self.mode == "log" and time.monotonic() - self._logged >= self.every_s:
            self._logged = time.monotonic()
            self.line()

    def line(self) -> None:
        t = self.tally
        elapsed = time.monotonic() - t.started
        rate = t.rows / elapsed if elapsed > 0 else 0.0
        left = t.total - t.skipped - t.rows
        eta = f"{left / rate:.0f} s" if rate > 0 else "?"
        failed = sum(t.failed.values())
        print(f"embedserve batch: {t.skipped + t.rows}/{t.total} rows, {rate:.1f} rows/s, {failed} failed, "
              f"ETA {eta}", file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
