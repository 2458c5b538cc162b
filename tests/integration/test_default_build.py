"""The configuration users run: `./build_mar.sh` with no arguments (all-MiniLM-L6-v2, two workers
on two cores, CPU lending on) under the real TorchServe. The largest requests the limits allow are
answered or refused with a 413 naming the limit, never a dead worker; small requests sent
meanwhile are answered; workers scale through the management API while under load, where only
the batch of the worker TorchServe removes can fail."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import pytest
import requests

from embedserve.handler.backends.openvino_runtime import openvino_available
from embedserve.handler.execution.engine_trial import Timing, choose
from embedserve.handler.execution.placement import available_cpus
from embedserve.handler.worker.cpu_features import bf16_units
from tests.support.client import concurrently
from tests.support.fuzz import Served, run_volume
from tests.support.serving import serving

pytestmark = pytest.mark.integration

MODEL = "minilm"
LONG_TEXT = "a " * 300  # 300 tokens: cut at MiniLM's 256, and 4096 of them stay inside the body limit


@pytest.fixture(scope="module")
def trials(tmp_path_factory):
    """The module's own engine-trial cache: its server measures rather than reading another's."""
    return {"EMBEDSERVE_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))}


@pytest.fixture(scope="module")
def server(tmp_path_factory, trials):
    with serving(tmp_path_factory.mktemp("default-build"), [], env=trials) as ts:  # no arguments: the default build
        wait_all_ready(ts)
        yield ts


def wait_all_ready(server, timeout: float = 300) -> None:
    """serving() returns once one worker embeds; the other may still be loading."""
    deadline = time.monotonic() + timeout
    while not all(w["status"] == "READY" for w in workers(server)):
        assert time.monotonic() < deadline, workers(server)
        time.sleep(0.5)


def post(server, body, timeout=300):
    return requests.post(f"{server.url('inference')}/predictions/{MODEL}", json=body, headers=server.auth(),
                         timeout=timeout)


def workers(server) -> list[dict]:
    [model] = requests.get(f"{server.url('management')}/models/{MODEL}", headers=server.auth("management"),
                           timeout=30).json()
    return model["workers"]


def identities(server) -> set[tuple]:
    return {(w["pid"], w["startTime"]) for w in workers(server)}


def test_the_default_build_serves_two_workers_with_sized_limits(server):
    assert len(workers(server)) == 2 and all(w["status"] == "READY" for w in workers(server))
    assert int(server.properties["max_response_size"]) >= 4096 * 384 * 17  # 4096 vectors as float JSON
    info = requests.get(f"{server.url('inference')}/predictions/{MODEL}/1.0/info", headers=server.auth(),
                        timeout=30).json()
    assert info["max_response_bytes"] >= 4096 * 384 * 17 and info["tokens_per_second"] > 0
    # The work a batch may hold comes from the measured speed and the 120 s response timeout.
    assert info["max_tokens_per_request"] == min(1_048_576, info["max_batch_work_tokens"])


def test_the_workers_serve_the_engine_measured_fastest_here_and_agree_on_it(server):
    """dtype auto: on a CPU with bf16 units the first worker times float32 against the bf16
    engines the build verified and the other reads its choice; without them, float32 untimed."""
    infos = [requests.get(f"{server.url('inference')}/predictions/{MODEL}/1.0/info", headers=server.auth(),
                          timeout=30).json() for _ in range(8)]
    assert len({(info["engine"], info["model_dtype"]) for info in infos}) == 1, infos
    info, reasons = infos[0], infos[0]["selected_by"]
    log = (server.logs / "model_log.log").read_text()
    if bf16_units() is None:
        assert (info["engine"], info["model_dtype"]) == ("onnxruntime", "float32") and "speeds" not in reasons
        assert "no bfloat16 units" in reasons["dtype"] and "engine trial" not in log
        return
    speeds = {name: Timing(**timing) for name, timing in reasons["speeds"].items()}
    assert {"onnxruntime float32", "torch bfloat16"} | ({"openvino bfloat16"} if openvino_available() else set()) \
        == set(speeds)
    assert f"{info['engine']} {info['model_dtype']}" == choose(speeds, "onnxruntime float32")[0]
    assert log.count("engine trial: measured") == 1, log  # one worker measured ...
    assert "by an earlier worker on this machine" in log  # ... the other read its choice


@pytest.mark.skipif(bf16_units() is None, reason="no engine trial on a CPU without bfloat16 units")
def test_a_second_server_of_the_archive_reads_the_trial_instead_of_timing_again(server, trials, tmp_path):
    """The trial is remembered on the machine: a restarted server, or another of the same
    archive, serves the same choice from the record without loading the models it times."""
    wait_all_ready(server)
    first = requests.get(f"{server.url('inference')}/predictions/{MODEL}/1.0/info", headers=server.auth(),
                         timeout=30).json()
    with serving(tmp_path, [], env=trials) as second:
        wait_all_ready(second)
        info = requests.get(f"{second.url('inference')}/predictions/{MODEL}/1.0/info", headers=second.auth(),
                            timeout=30).json()
        log = (second.logs / "model_log.log").read_text()
    assert (info["engine"], info["model_dtype"]) == (first["engine"], first["model_dtype"])
    assert info["selected_by"]["speeds"] == first["selected_by"]["speeds"]
    assert "engine trial: measured" not in log and log.count("by an earlier worker on this machine") >= 2, log


def test_a_lone_request_runs_on_every_cpu_and_says_where_its_time_went(server):
    """One client, one text at a time: the other worker idles, so each pass borrows its CPU
    (whichever engine the trial chose), and Server-Timing splits the handler's time."""
    text = "embedding server batch request token text vector search query document " * 6  # about 60 tokens
    for _ in range(5):
        response = post(server, {"input": text})
        assert response.status_code == 200
        stages = {}
        for entry in response.headers["server-timing"].split(", "):
            name, duration, *desc = entry.split(";")
            stages[name] = (float(duration.removeprefix("dur=")), *desc)
        assert {"parse", "tokenize", "model", "encode", "handler"} <= set(stages), stages
        assert sum(stages[name][0] for name in ("parse", "tokenize", "model", "encode")) <= stages["handler"][0]
        assert stages["model"][1] == f'desc="{available_cpus()} CPU threads"', stages
    # TorchServe's backend logs a line as each batch arrives, which its frontend then writes during the pass.
    assert "Backend received inference" not in (server.logs / "model_log.log").read_text()


def test_the_default_build_serves_a_valid_document_with_minilm_s_values(server):
    from openapi_spec_validator import validate

    base = f"{server.url('inference')}/predictions/{MODEL}/1.0"
    document = requests.get(f"{base}/openapi.json", headers=server.auth(), timeout=60).json()
    validate(document)
    limits = document["info"]["x-limits"]
    assert (limits["dimension"], limits["max_input_length"], limits["max_inputs_per_request"]) == (384, 256, 4096)


def test_the_largest_requests_are_answered_or_refused_never_fatal(server):
    before = identities(server)
    short = [f"short text number {i}" for i in range(4096)]
    calls = [
        lambda: post(server, {"input": [f"text {i}" for i in range(2000)]}),  # ~9.5 MB of JSON
        lambda: post(server, {"input": short}),  # the most inputs: ~19 MB of JSON
        lambda: post(server, {"input": [LONG_TEXT] * 4096}),  # the most tokens the limits name
        lambda: (time.sleep(1.0), post(server, {"input": "a small request sent meanwhile"}, timeout=120))[1],
    ]
    two_thousand, most_inputs, most_tokens, small = concurrently(calls)
    assert two_thousand.status_code == 200 and len(two_thousand.json()["data"]) == 2000
    assert most_inputs.status_code == 200, most_inputs.text[:300]
    assert [d["index"] for d in most_inputs.json()["data"]] == list(range(4096))
    assert len(most_inputs.json()["data"][0]["embedding"]) == 384
    assert most_tokens.status_code in (200, 413), most_tokens.text[:300]
    if most_tokens.status_code == 413:
        error = most_tokens.json()["error"]
        assert error["param"] == "input" and "tokens" in error["message"] and "response timeout" in error["message"]
    assert small.status_code == 200
    assert identities(server) == before  # no worker died or was replaced


def test_workers_scale_under_load_and_only_the_removed_worker_s_batch_fails(server):
    stop = threading.Event()
    statuses: Counter = Counter()

    def client(i: int) -> None:
        while not stop.is_set():
            try:
                # An answer takes well under a second; 30 s tells a lost request from a slow one.
                statuses[post(server, {"input": f"steady load from client {i}"}, timeout=30).status_code] += 1
            except requests.RequestException as err:
                statuses[type(err).__name__] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    url = f"{server.url('management')}/models/{MODEL}"
    try:
        time.sleep(2)
        for count in (1, 2):
            # TorchServe 0.12's management API sometimes answers a scale request under load with
            # 500 ConcurrentModificationException (a race in its own frontend, seen once in three
            # fresh-clone runs); the same request again succeeds. Only that answer is retried.
            for _ in range(3):
                response = requests.put(f"{url}?min_worker={count}&max_worker={count}&synchronous=true",
                                        headers=server.auth("management"), timeout=300)
                if not (response.status_code == 500 and "ConcurrentModificationException" in response.text):
                    break
                time.sleep(1)
            assert response.status_code == 200, response.text
            assert len(workers(server)) == count
            time.sleep(3)
    finally:
        stop.set()
        for thread in threads:
            thread.join(130)
    assert all(w["status"] == "READY" for w in workers(server))
    # TorchServe 0.12 disconnects the worker it scales down whatever it holds (WORKER_SCALED_DOWN):
    # a batch it is running is answered 500, and requests it has taken into a batch still filling
    # are never answered (its known loss, docs/operations.md): the client times out. Both stay
    # within the one batch of these 4 clients; everything else is answered 200.
    failed = statuses[500] + statuses["ReadTimeout"]
    assert statuses[200] > 0 and set(statuses) <= {200, 500, "ReadTimeout"} and failed <= 4, statuses


def test_ten_thousand_fuzzed_and_oversized_requests_on_the_default_build(server, record_property):
    summary = run_volume(server, Served(MODEL, 384, 30522, ()))
    print(f"\nfuzz at volume, default build: {json.dumps(summary)}")
    record_property("fuzz_volume_default_build", summary)
    assert summary["requests"] >= 10_000 and summary["good_answered_200"] >= 0.45 * summary["requests"]
