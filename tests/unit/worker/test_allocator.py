"""The worker's allocator setting, in a fresh process each time (it is process-wide)."""

import os
import subprocess
import sys

from tests.support import REPO

PIN = "from embedserve.handler.worker.allocator import pin_mmap_threshold; print(pin_mmap_threshold())"


def run(env):
    result = subprocess.run([sys.executable, "-c", PIN], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    return result.stdout.strip()


def test_the_threshold_is_pinned_on_glibc():
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    assert run(env) == "True"


def test_an_operator_setting_wins():
    assert run({**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}) == "False"


RELEASE = """
import ctypes, time
from embedserve.handler.worker.allocator import FreedMemory

def rss_mib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) // 1024

libc = ctypes.CDLL(None)
libc.mallopt(-3, 1 << 30)  # everything below 1 GiB from the heap, as after glibc raised its threshold
blocks = [ctypes.create_string_buffer(64 * 1024) for _ in range(3000)]  # ~190 MiB of heap
keep = blocks[-1]
del blocks  # freed, but the heap's top is still in use: glibc keeps the pages
held = rss_mib()
freed = FreedMemory(interval_s=60.0)
assert freed.release(wait=True)
released = rss_mib()
assert not freed.release()  # within the interval: nothing more
print(held, released)
"""


def test_freed_heap_pages_go_back_to_the_system():
    result = subprocess.run([sys.executable, "-c", RELEASE], cwd=REPO, capture_output=True, text=True, check=True)
    held, released = map(int, result.stdout.split())
    assert held - released > 150, (held, released)
