"""glibc allocator settings for a long-running worker.

glibc serves large blocks with mmap and returns them on free, but after the first large free it
raises its mmap threshold to that size (up to 32 MiB): from then on a worker's activations come
from the heap, which fragments and seldom shrinks, and RSS climbs in steps with each new batch
shape (+13% in a ten-minute MiniLM soak). A fixed 4 MiB threshold kept most blocks on mmap at a
cost within noise (docs/operations.md). Set at worker start with mallopt, so it holds however
the server was launched; an operator's own MALLOC_MMAP_THRESHOLD_ wins.

What still comes from the heap leaves freed pages behind as batch shapes change; glibc gives
them back only when asked (malloc_trim). Asked after a batch at most once a second (about 3 ms,
5 ms at most, for MiniLM), a worker's RSS stays at what it uses: over 300 mixed batches in
process, +43 MiB and flat after the first half, against +104 MiB and still climbing. The trim
runs on a thread of its own (ctypes lets go of the GIL), so that the batch's answers leave
without waiting for it (on the request path, one client's request in about 35 waited for it:
two workers, a trim a second each, some 70 requests a second).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
import time

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # mallopt parameter, from glibc's malloc.h
MMAP_THRESHOLD_BYTES = 4 * 1024 * 1024
TRIM_INTERVAL_S = 1.0


def _glibc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):  # no C library found
        return None


class FreedMemory:
    """Gives the heap's free pages back to the system after a batch, at most once an interval."""

    def __init__(self, interval_s: float = TRIM_INTERVAL_S):
        libc = _glibc()
        self._trim = getattr(libc, "malloc_trim", None)  # glibc only
        self.interval_s = interval_s
        self._last = 0.0

    def release(self, wait: bool = False) -> bool:
        """Start a trim in the background if the interval is over (`wait`: and wait for it);
        whether one started."""
        now = time.monotonic()
        if self._trim is None or now - self._last < self.interval_s:
            return False
        self._last = now
        trim = threading.Thread(target=self._trim, args=(0,), name="malloc-trim", daemon=True)
        trim.start()
        if wait:
            trim.join()
        return True


def pin_mmap_threshold(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold; False where it is not glibc or the environment already sets it."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return False
    mallopt = getattr(_glibc(), "mallopt", None)
    if mallopt is None:  # no C library found, or not glibc (musl, macOS)
        return False
    pinned = mallopt(M_MMAP_THRESHOLD, threshold) == 1
    if not pinned:
        log.warning("could not set glibc's mmap threshold; worker memory may grow in steps")
    return pinned
