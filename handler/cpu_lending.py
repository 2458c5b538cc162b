"""Idle CPUs lent between the CPU workers of one machine, for small batches.

Workers are processes, each with its share of the CPUs as torch threads: on 2 cores, two
1-thread workers embed about 1.2x more under load than one 2-thread worker (bench/). At idle,
though, a lone request then runs on one core while the other sleeps. So each worker owns home
CPUs and, for a batch small enough to finish in a few milliseconds, also borrows every CPU no
other worker is using, and runs with that many threads.

Coordination is by POSIX file locks, one pair of files per CPU in a per-user directory:
- `cpu-N.owner` is locked by the worker that owns CPU N for as long as it lives (the kernel
  drops the lock when the process dies, even under kill -9);
- `cpu-N.run` is locked while a batch runs on CPU N, by its owner or by a borrower.
A worker takes its home run locks before each batch (waiting, at most one small batch, if a
borrower has them) and borrows only with non-blocking tries, so no two threads ever share a
CPU and no worker waits on another's large batch. A worker that finds no free home CPUs (more
workers than CPUs, or other servers on the machine) stays out of the scheme and runs as before.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator

log = logging.getLogger(__name__)

# How long a worker waits for its home CPUs to come back from a borrower before running
# anyway: a borrowed batch is small, so this only matters if the borrower is stuck.
HOME_WAIT_S = 1.0


def lock_directory() -> Path:
    return Path(tempfile.gettempdir()) / f"embedserve-cpus-{os.getuid()}"


class CpuLending:
    def __init__(self, home: list[int], runs: dict[int, IO[bytes]], owners: list[IO[bytes]]):
        self.home = home
        self._runs = runs
        self._owners = owners  # held open: closing a file drops its lock

    @classmethod
    def join(cls, cpus: int, threads: int, directory: Path | None = None) -> "CpuLending | None":
        """Claim `threads` home CPUs among `cpus`; None when not enough are free, or when the
        lock files cannot be made (lending is an optimization, never a reason not to start)."""
        try:
            return cls._join(cpus, threads, directory or lock_directory())
        except OSError as err:
            log.warning("CPU lending is off for this worker: %s", err)
            return None

    @classmethod
    def _join(cls, cpus: int, threads: int, directory: Path) -> "CpuLending | None":
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        owners: list[IO[bytes]] = []
        home: list[int] = []
        for cpu in range(cpus):
            if len(home) == threads:
                break
            owner = open(directory / f"cpu-{cpu}.owner", "ab")
            if _try_lock(owner):
                owners.append(owner)
                home.append(cpu)
            else:
                owner.close()
        if len(home) < threads:
            for owner in owners:
                owner.close()
            log.info("no free home CPUs among %d; this worker does not lend or borrow CPUs", cpus)
            return None
        runs = {cpu: open(directory / f"cpu-{cpu}.run", "ab") for cpu in range(cpus)}
        log.info("worker owns CPU slot(s) %s of %d; small batches borrow idle ones", home, cpus)
        return cls(home, runs, owners)

    @contextmanager
    def running(self, borrow: bool) -> Iterator[int]:
        """Hold this worker's CPUs (and, if `borrow`, every idle one) for one batch; yields
        the number of threads to run with."""
        held = [cpu for cpu in self.home if _lock_within(self._runs[cpu], HOME_WAIT_S)]
        borrowed = [cpu for cpu, run in self._runs.items()
                    if borrow and cpu not in self.home and _try_lock(run)]
        try:
            yield len(self.home) + len(borrowed)
        finally:
            for cpu in held + borrowed:
                fcntl.flock(self._runs[cpu], fcntl.LOCK_UN)

    def close(self) -> None:
        for file in [*self._runs.values(), *self._owners]:
            file.close()


def _try_lock(file: IO[bytes]) -> bool:
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _lock_within(file: IO[bytes], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not _try_lock(file):
        if time.monotonic() > deadline:
            log.warning("a CPU lent to another worker did not come back within %.1f s; running anyway", seconds)
            return False
        time.sleep(0.0005)
    return True
