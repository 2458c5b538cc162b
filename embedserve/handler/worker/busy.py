"""A worker's busy mark: a file lock held while a batch runs, so that a server being stopped can
wait for the batches in flight to be answered (embedserve/scripts/serverctl.py) instead of cutting them off.

One file per worker process in the server's temporary folder (per server: TMPDIR); the kernel
drops the lock when the process dies, so a dead worker never looks busy.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator

PREFIX = "embedserve-busy-"


class BusyMark:
    def __init__(self, directory: Path | None = None):
        directory = directory or Path(tempfile.gettempdir())
        self.path = directory / f"{PREFIX}{os.getpid()}"
        self._file: IO[bytes] = open(self.path, "ab")

    @contextmanager
    def held(self) -> Iterator[None]:
        fcntl.flock(self._file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._file, fcntl.LOCK_UN)


def any_busy(directory: Path) -> bool:
    """Whether a worker of the server whose temporary folder this is runs a batch now."""
    for path in directory.glob(f"{PREFIX}*"):
        with open(path, "ab") as file:
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(file, fcntl.LOCK_UN)
    return False
