"""The worker's allocator setting, in a fresh process each time (it is process-wide)."""

import os
import subprocess
import sys

from tests.conftest import REPO

PIN = "from handler.allocator import pin_mmap_threshold; print(pin_mmap_threshold())"


def run(env):
    result = subprocess.run([sys.executable, "-c", PIN], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    return result.stdout.strip()


def test_the_threshold_is_pinned_on_glibc():
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    assert run(env) == "True"


def test_an_operator_setting_wins():
    assert run({**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}) == "False"
