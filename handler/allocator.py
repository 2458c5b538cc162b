"""glibc allocator setting for a long-running worker.

glibc serves large blocks with mmap and returns them on free, but after the first large free it
raises its mmap threshold to that size (up to 32 MiB): from then on a worker's activations come
from the heap, which fragments and seldom shrinks, and RSS climbs in steps with each new batch
shape (+13% in a ten-minute MiniLM soak). A fixed 4 MiB threshold kept most blocks on mmap at a
cost within noise (docs/operations.md). Set at worker start with mallopt, so it holds however
TorchServe was launched; an operator's own MALLOC_MMAP_THRESHOLD_ wins.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # mallopt parameter, from glibc's malloc.h
MMAP_THRESHOLD_BYTES = 4 * 1024 * 1024


def pin_mmap_threshold(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold; False where it is not glibc or the environment already sets it."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return False
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, TypeError, AttributeError):  # no C library found, or not glibc (musl, macOS)
        return False
    pinned = mallopt(M_MMAP_THRESHOLD, threshold) == 1
    if not pinned:
        log.warning("could not set glibc's mmap threshold; worker memory may grow in steps")
    return pinned
