"""The suite's xdist scheduler (tests/support/scheduling.py) on a small suite run by real
pytest-xdist workers, two of which die mid-module as a worker killed for memory would."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import pytest

from tests.support import REPO

CONFTEST = """
import pytest

@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from tests.support.scheduling import ModuleScheduling
    config.option.loadscopereorder = False
    return ModuleScheduling(config, log, groups={"test_c.py": "c-and-d", "test_d.py": "c-and-d"})
"""

MODULES = {
    "test_a.py": "def test_1(): time.sleep(1)\ndef test_2(): os._exit(1)\n",
    "test_b.py": "def test_1(): pass\ndef test_2(): os._exit(1)\ndef test_3(): pass\n",
    "test_c.py": "def test_1(): time.sleep(1)\ndef test_2(): pass\n",
    "test_d.py": "def test_1(): pass\n",
    "test_e.py": "def test_1(): time.sleep(2)\ndef test_2(): pass\n",
}


@pytest.fixture(scope="module")
def done(tmp_path_factory) -> subprocess.CompletedProcess:
    """The small suite's run: before the scheduler's remove_node, it hung (the timeout)."""
    folder = tmp_path_factory.mktemp("suite")
    (folder / "conftest.py").write_text(CONFTEST)
    for name, tests in MODULES.items():
        (folder / name).write_text("import os, time\n" + tests)
    # A clean environment and configuration: none of the outer run's (its own xdist worker's) settings.
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTEST", "PY_"))}
    return subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-v", "-p", "no:cacheprovider", "--rootdir",
                           str(folder), "-o", "addopts=", "--max-worker-restart", "8"], cwd=folder,
                          env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=90)


def test_a_dead_worker_fails_its_test_once_and_the_run_ends_with_every_other_test_run_once(done):
    print(done.stdout[-6000:], done.stderr[-2000:])  # shown where it fails
    outcomes = re.findall(r"\[gw\d+\] \[\s*\d+%\] (PASSED|FAILED) (\S+)", done.stdout)
    ran = sorted(nodeid for _, nodeid in outcomes)
    assert ran == sorted({nodeid for _, nodeid in outcomes}), done.stdout  # none twice
    assert ran == sorted(f"{module}::test_{n}" for module, tests in MODULES.items()
                         for n in range(1, tests.count("def ") + 1)), done.stdout  # none lost
    assert sorted(nodeid for outcome, nodeid in outcomes if outcome == "FAILED") == ["test_a.py::test_2",
                                                                                     "test_b.py::test_2"]
    assert "crashed while running 'test_a.py::test_2'" in done.stdout and done.returncode == 1, done.stdout


def test_a_group_of_modules_goes_to_one_worker(done):
    workers = {module: set(re.findall(rf"\[(gw\d+)\] \[\s*\d+%\] \w+ {module}", done.stdout))
               for module in ("test_c.py", "test_d.py")}
    assert len(workers["test_c.py"] | workers["test_d.py"]) == 1, done.stdout


class DeadNode:
    """A worker that died since its last report: sending it work fails as execnet's channel does."""
    shutting_down = False

    def send_runtest_some(self, indices):
        raise OSError("cannot send (already closed?)")


def test_work_that_cannot_be_sent_to_a_dead_worker_goes_back_to_the_front_of_the_queue():
    from types import SimpleNamespace

    from tests.support.scheduling import ModuleScheduling

    config = SimpleNamespace(getvalue=lambda name: {"tx": ["popen"] * 2, "numprocesses": 2}.get(name),
                             option=SimpleNamespace(loadscopereorder=False, numprocesses=2, tx=["popen"] * 2,
                                                    dist="loadscope"))
    scheduler = ModuleScheduling(config)
    node = DeadNode()
    scheduler.assigned_work[node] = {}
    scheduler.registered_collections[node] = ["a.py::t1", "b.py::t1"]
    scheduler.workqueue.update({"a.py": {"a.py::t1": False}, "b.py": {"b.py::t1": False}})
    scheduler._reschedule(node)  # no error: the unit is kept for another worker
    assert list(scheduler.workqueue) == ["a.py", "b.py"] and scheduler.assigned_work[node] == {}
