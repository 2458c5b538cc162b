"""Start-up and shutdown of a dedicated TorchServe: clean stop, and a broken model reported."""

import socket
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import yaml

from embedserve.archive.build import parse_args, run_archiver, stage_handler
from embedserve.archive.metrics_config import write_metrics_config
from embedserve.archive.stage import stage_model
from embedserve.archive.ts_config import register_model
from embedserve.scripts.serverctl import DRAIN_S, ServerError, TorchServe
from tests.support import REPO
from tests.support.serving import build, make_server_config

pytestmark = pytest.mark.integration


def port_is_free(host, port):
    with socket.socket() as s:
        return s.connect_ex((host, port)) != 0


def test_server_starts_embeds_and_stops_cleanly(tmp_path, tiny_model_dir):
    config = make_server_config(tmp_path)
    build(config, "--model", str(tiny_model_dir), "--name", "tiny", "--workers", "1")
    server = TorchServe(config, tmp_path)
    server.start()
    try:
        server.wait_ready(timeout=300)
        pid = server.pid()
        assert pid is not None
    finally:
        server.stop()
    assert server.pid() is None
    for name, (host, port) in server.listeners().items():
        assert port_is_free(host, port), f"{name} port still open after stop"
    assert "model tiny ready" in (tmp_path / "logs" / "model_log.log").read_text()


def test_a_model_that_cannot_load_is_reported_not_waited_for(tmp_path, tiny_model_dir):
    """A bad handler setting kills the worker at start-up; the readiness check says why."""
    config = make_server_config(tmp_path)
    stage = tmp_path / "stage"
    stage_model(tiny_model_dir, stage / "model")
    stage_handler(stage)
    model_config = tmp_path / "model-config.yaml"
    model_config.write_text(yaml.safe_dump({"minWorkers": 1, "maxWorkers": 1, "handler": {"dtype": "float64"}}))
    args = parse_args(["--name", "broken", "--export-path", str(tmp_path / "model_store")])
    run_archiver(args, stage, model_config)
    write_metrics_config(tmp_path / "model_store" / "metrics.yaml")
    register_model(config, "broken", "1.0", {"defaultVersion": True, "marName": "broken.mar", "minWorkers": 1,
                                            "maxWorkers": 1, "batchSize": 1, "maxBatchDelay": 5,
                                            "responseTimeout": 60, "startupTimeout": 60})
    server = TorchServe(config, tmp_path)
    server.start()
    try:
        with pytest.raises(ServerError) as caught:
            server.wait_ready(timeout=240)
    finally:
        stopping = time.monotonic()
        server.stop()
    message = str(caught.value)
    assert "died" in message
    assert "handler setting 'dtype'" in message
    # The readiness check's request stays queued for a worker that never comes: the stop does not
    # drain for it (DRAIN_S), as `make stop` after such a start would.
    assert time.monotonic() - stopping < DRAIN_S / 2


def test_start_refuses_a_taken_port(tmp_path):
    config = make_server_config(tmp_path)
    server = TorchServe(config, tmp_path)
    host, port = server.listeners()["grpc_inference"]
    with socket.socket() as taken:
        taken.bind((host, port))
        taken.listen()
        with pytest.raises(ServerError, match=f"grpc_inference address {host}:{port} is already in use"):
            server.start()
    assert server.pid() is None


@pytest.mark.parametrize("drain_s", [25.0, 0.0])
def test_stop_answers_the_requests_it_accepted(tmp_path, tiny_model_dir, drain_s):
    """A burst is accepted, then the server is stopped: with the drain every request is answered
    200; TorchServe's own stop (no drain) closes the connections of those still queued. Either way
    none hangs."""
    config = make_server_config(tmp_path)
    build(config, "--model", str(tiny_model_dir), "--name", "tiny", "--workers", "1", "--batch-size", "4",
          "--max-batch-delay", "20")
    server = TorchServe(config, tmp_path)
    server.start()
    try:
        server.wait_ready(timeout=300)
        url, headers = f"{server.url('inference')}/predictions/tiny", server.auth()

        def one(i):
            started = time.monotonic()
            try:
                # 512 texts at the 48-token limit: about 1.2M tokens in all, seconds of work, so
                # that a stop after 0.5 s finds requests still queued however fast the engine.
                status = requests.post(url, json={"input": [f"request {i} " + "embedding " * 40] * 512},
                                       headers=headers, timeout=60).status_code
            except requests.RequestException as err:
                status = type(err).__name__
            return status, time.monotonic() - started

        with ThreadPoolExecutor(48) as pool:
            futures = [pool.submit(one, i) for i in range(48)]
            time.sleep(0.5)  # every request is sent and accepted: TorchServe queues them
            stopping = time.monotonic()
            server.stop(drain_s=drain_s)
            stop_s = time.monotonic() - stopping
            outcomes = [future.result() for future in futures]
    finally:
        server.stop()
    statuses = Counter(status for status, _ in outcomes)
    print(f"drain {drain_s} s: stop took {stop_s:.1f} s; {dict(statuses)}")
    assert max(seconds for _, seconds in outcomes) < 60  # nothing hangs
    if drain_s:
        assert statuses == {200: 48}, statuses
    else:
        # A connection TorchServe closes while it writes an answer reads as a cut body (ChunkedEncodingError).
        assert statuses[200] < 48 and set(statuses) <= {200, "ConnectionError", "ChunkedEncodingError"}, statuses


def test_stop_with_nothing_running_says_so(tmp_path):
    import subprocess
    import sys

    config = make_server_config(tmp_path)
    result = subprocess.run([sys.executable, "-m", "embedserve.scripts.serverctl", "stop", "--config", str(config),
                             "--workdir", str(tmp_path)], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0 and "nothing to stop" in result.stdout and "TorchServe stopped" not in result.stdout
