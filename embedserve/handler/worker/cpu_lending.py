"""Idle CPUs lent between the CPU workers of one server, one forward pass at a time.

Workers are processes, each with its share of the CPUs as torch threads: on 2 cores, two
1-thread workers embed about 1.2x more under load than one 2-thread worker (bench/). But
whenever one worker has nothing to do (at idle, or while the other holds every queued request
in its batch), its core sleeps. So each worker owns home CPUs and, for each forward pass of
a batch, also borrows every CPU whose owner is neither using nor waiting for it, and runs
that pass with that many threads.

How many it borrows goes by the pass's size: one more CPU for each `lend_min_tokens` of the
pass (the tokens that take a worker's own threads about 2 ms, calibration.py), so a small pass
is not spread thinner than a thread hand-off is worth; and only as many as its runtime can use
(ONNX Runtime and OpenVINO run on the thread counts they were built for: the worker's own, or
every CPU).

Coordination is by POSIX file locks, three files per CPU in a per-user temporary directory:
- `cpu-N.owner` is locked by the worker that owns CPU N for as long as it lives (the kernel
  drops the lock when the process dies, even under kill -9);
- `cpu-N.want` is locked by the owner from the moment it has a batch until the batch is done;
- `cpu-N.run` is locked while a pass runs on CPU N, by its owner or by a borrower.
A borrower takes a CPU only if its `want` and `run` locks are both free, and gives it back
after the pass, so an owner waits at most one (small) pass for its CPU and no two threads
share a CPU. A worker that finds no free home CPUs (more workers than CPUs) stays out.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Callable, Iterator, Mapping, TypeVar

log = logging.getLogger(__name__)

# How long a worker waits for its home CPUs to come back from a borrower before running
# anyway: a borrowed pass is small, so this only matters if the borrower is stuck.
HOME_WAIT_S = 1.0


T = TypeVar("T")


def for_threads(by_threads: Mapping[int, T], threads: int) -> T:
    """Of runtimes built per thread count (ONNX Runtime sessions, OpenVINO compiled models fix
    their threads when made), the one for a pass on `threads`: the largest that fits, else the
    smallest."""
    return by_threads[max((count for count in by_threads if count <= threads), default=min(by_threads))]


def lock_directory() -> Path:
    return Path(tempfile.gettempdir()) / f"embedserve-cpus-{os.getuid()}"


class CpuLending:
    def __init__(self, home: list[int], wants: dict[int, IO[bytes]], runs: dict[int, IO[bytes]],
                 owners: list[IO[bytes]]):
        self.home = home
        self._wants = wants
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
        wants = {cpu: open(directory / f"cpu-{cpu}.want", "ab") for cpu in range(cpus)}
        runs = {cpu: open(directory / f"cpu-{cpu}.run", "ab") for cpu in range(cpus)}
        log.info("worker owns CPU slot(s) %s of %d; its passes borrow idle ones", home, cpus)
        return cls(home, wants, runs, owners)

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Hold this worker's own CPUs for one batch, taking them back from a borrower first."""
        for cpu in self.home:
            fcntl.flock(self._wants[cpu], fcntl.LOCK_EX)  # borrowers hold it only to look
        held = [cpu for cpu in self.home if _lock_within(self._runs[cpu], HOME_WAIT_S)]
        try:
            yield
        finally:
            for cpu in held:
                fcntl.flock(self._runs[cpu], fcntl.LOCK_UN)
            for cpu in self.home:
                fcntl.flock(self._wants[cpu], fcntl.LOCK_UN)

    @contextmanager
    def borrowing(self, at_most: int | None = None, usable: Callable[[int], int] = lambda free: free
                  ) -> Iterator[int]:
        """Borrow, for one pass, up to `at_most` other CPUs that nobody uses or wants, and keep
        `usable(found)` of them (a runtime built for fixed thread counts uses only those); yields how
        many it kept."""
        borrowed: list[int] = []
        for cpu, run in self._runs.items():
            if at_most is not None and len(borrowed) >= at_most:
                break
            if cpu in self.home or not _try_lock(self._wants[cpu]):
                continue
            if _try_lock(run):
                borrowed.append(cpu)
            fcntl.flock(self._wants[cpu], fcntl.LOCK_UN)
        kept = usable(len(borrowed))
        for cpu in borrowed[kept:]:  # found but of no use to this pass: back at once
            fcntl.flock(self._runs[cpu], fcntl.LOCK_UN)
        borrowed = borrowed[:kept]
        try:
            yield len(borrowed)
        finally:
            for cpu in borrowed:
                fcntl.flock(self._runs[cpu], fcntl.LOCK_UN)

    def close(self) -> None:
        for file in [*self._wants.values(), *self._runs.values(), *self._owners]:
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
