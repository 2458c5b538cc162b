"""How a worker learns the max_response_size of the TorchServe frontend above it: a stand-in
frontend process (its command line as TorchServe's launcher writes it) with a child, read through
/proc as a worker reads its own ancestors. The real server: tests/integration/test_production_server.py."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

import pytest

from embedserve.handler.torchserve.frontend import (TS_DEFAULT_MAX_RESPONSE_SIZE, answer_limit,
                                                    frontend_max_response_size, read_properties)

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads Linux's /proc")

# A parent that starts a child, prints its pid and waits: the frontend and its worker.
FRONTEND = ("import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(60)\n")


@pytest.fixture
def frontend(tmp_path):
    """Start a stand-in frontend in tmp_path with the given arguments; yield its child's pid."""
    started = []

    def start(*args: str) -> int:
        process = subprocess.Popen([sys.executable, "-c", FRONTEND, "org.pytorch.serve.ModelServer", *args],
                                   cwd=tmp_path, stdout=subprocess.PIPE, text=True)
        child = int(process.stdout.readline())
        started.append((process, child))
        return child

    yield start
    for process, child in started:
        os.kill(child, signal.SIGKILL)
        process.kill()
        process.wait()


def test_the_file_named_on_the_command_line(frontend, tmp_path):
    (tmp_path / "ts.properties").write_text("inference_address=http://127.0.0.1:8080\nmax_response_size = 200000\n")
    worker = frontend("--python", sys.executable, "-f", "ts.properties", "-s", "model_store")
    assert frontend_max_response_size({}, pid=worker) == (200000, str(tmp_path / "ts.properties"))


def test_ts_config_file_wins_and_variables_are_read_as_torchserve_reads_them(frontend, tmp_path):
    (tmp_path / "named.properties").write_text("max_response_size=1\n")
    (tmp_path / "env.properties").write_text("enable_envvars_config=true\nmax_response_size=$$LIMIT$$\n")
    worker = frontend("-f", "named.properties")
    environ = {"TS_CONFIG_FILE": str(tmp_path / "env.properties"), "LIMIT": "300000"}
    assert frontend_max_response_size(environ, pid=worker)[0] == 300000
    # With enable_envvars_config=true, TS_MAX_RESPONSE_SIZE overrides the file.
    found = frontend_max_response_size({**environ, "TS_MAX_RESPONSE_SIZE": "400000"}, pid=worker)
    assert found == (400000, "the TS_MAX_RESPONSE_SIZE variable")
    assert frontend_max_response_size({"TS_CONFIG_FILE": str(tmp_path / "env.properties")}, pid=worker) is None


def test_without_a_file_torchserve_s_default_or_unknown(frontend, tmp_path):
    worker = frontend("-ncs")  # no -f: config.properties in its working directory, here none
    value, source = frontend_max_response_size({}, pid=worker)
    assert value == TS_DEFAULT_MAX_RESPONSE_SIZE and "default" in source
    (tmp_path / "config.properties").write_text("max_response_size=500000\n")
    assert frontend_max_response_size({}, pid=worker)[0] == 500000
    # Snapshots on: TorchServe may have started from its latest snapshot, which is not read.
    assert frontend_max_response_size({}, pid=frontend()) is None


def test_no_frontend_above_this_process():
    assert frontend_max_response_size({}) is None


def test_properties_are_read_as_java_reads_them():
    text = ("# a comment\n! another\n  max_response_size : 123\nkey value with spaces\n"
            "models={\\\n  \"a\": 1\\\n}\nempty=\nenable_envvars_config=true\n")
    assert read_properties(text) == {"max_response_size": "123", "key": "value with spaces",
                                     "models": '{"a": 1}', "empty": "", "enable_envvars_config": "true"}


def test_the_bound_is_the_lower_of_the_two(caplog):
    with caplog.at_level(logging.INFO):
        assert answer_limit(27_001_094, (6_553_600, "config.properties")) == 6_553_600
        assert answer_limit(27_001_094, (30_000_000, "config.properties")) == 27_001_094
        assert answer_limit(27_001_094, None) == 27_001_094
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "max_response_size=6553600 (config.properties) is below the archive's max_response_bytes=27001094" \
        in warnings[0] and "could not be read" in warnings[1]
