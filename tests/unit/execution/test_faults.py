"""Out-of-memory and device failures, provoked through the test-only fault hook: in-process, and
in a real TorchServe worker started with EMBEDSERVE_TEST_FAULTS."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import requests

from embedserve.handler.execution.faults import FAULTS_ENV, DeviceFailure, FaultInjection
from embedserve.handler.service import RawRequest
from tests.conftest import REPO, make_engine, serving
from tests.test_engine import TEXTS
from tests.parts import poisoned, with_faults
from tests.test_server import concurrently, predict, vectors

# The tiny model truncates at 48 tokens. Passes over 40 padded tokens "run out of memory": short
# texts fit after splitting, a 48-token input never fits, even alone.
OOM_ABOVE = 40
LONG = TEXTS[3]
SHORT = ["hello world", "the cat sat on the mat", "one two three", "a", "b c d", "hello", "cat mat", "world"]
POISON_TOKEN = 7
ERROR_TOKEN = 9


@pytest.fixture()
def faulty_engine(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_batch_tokens=4096)
    return with_faults(engine, FaultInjection(oom_above_tokens=OOM_ABOVE, device_error_token=POISON_TOKEN))


def answers(engine, bodies, url_path=""):
    responses, report = engine.handle_with_report([RawRequest(json.dumps(b).encode(), None, url_path) for b in bodies])
    return [(r.status, json.loads(r.body)) for r in responses], report


def matrix(body):
    return np.array([d["embedding"] for d in body["data"]])


def test_an_out_of_memory_pass_is_split_and_retried(faulty_engine, tiny_engine):
    [(status, body)], report = answers(faulty_engine, [{"input": SHORT}])
    assert status == 200
    assert report.forward_passes > 1 and report.padded_tokens <= report.forward_passes * OOM_ABOVE
    [(_, expected)], _ = answers(tiny_engine, [{"input": SHORT}])
    np.testing.assert_allclose(matrix(body), matrix(expected), atol=1e-5)


def test_only_an_input_that_cannot_fit_alone_fails_with_507(faulty_engine, tiny_engine):
    bodies = [{"input": SHORT[:3]}, {"input": [SHORT[3], LONG]}, {"input": SHORT[4:]}]
    results, report = answers(faulty_engine, bodies)
    assert [status for status, _ in results] == [200, 507, 200]
    error = results[1][1]["error"]
    assert error["param"] == "input[1]" and error["code"] == "out_of_memory" and "48 tokens" in error["message"]
    for (_, body), request in zip([results[0], results[2]], [bodies[0], bodies[2]]):
        [(_, expected)], _ = answers(tiny_engine, [request])
        np.testing.assert_allclose(matrix(body), matrix(expected), atol=1e-5)
    assert report.statuses == {200: 2, 507: 1}

    [(status, body)], _ = answers(faulty_engine, [{"inputs": [LONG]}], url_path="embed")
    assert status == 507 and body["error_type"] == "Backend"


def test_an_input_that_cannot_fit_is_not_cached(tiny_model_dir):
    engine = with_faults(make_engine(tiny_model_dir, max_batch_tokens=4096, cache_entries=100),
                         FaultInjection(oom_above_tokens=OOM_ABOVE))
    for _ in range(2):
        [(status, _)], report = answers(engine, [{"input": [LONG, "hello world"]}])
        assert status == 507
    assert report.cache_hits == {"memory": 1} and report.cache_misses == 1


def test_a_device_error_is_raised_as_device_failure(faulty_engine):
    with pytest.raises(DeviceFailure, match="device-side assert"):
        answers(faulty_engine, [{"input": "fine"}, {"input": [[5, POISON_TOKEN, 9]]}])


def test_another_forward_failure_fails_only_the_request_that_causes_it(tiny_model_dir, tiny_engine):
    engine = poisoned(make_engine(tiny_model_dir, cache_entries=100), token=ERROR_TOKEN)
    bodies = [{"input": SHORT[:3]}, {"input": ["fine", [5, ERROR_TOKEN, 9]]}, {"input": SHORT[3:]},
              {"input": [[ERROR_TOKEN]]}]
    results, report = answers(engine, bodies)
    assert [status for status, _ in results] == [200, 500, 200, 500]
    assert results[1][1]["error"]["code"] == "internal_error" and "failure is logged" in results[1][1]["error"]["message"]
    for (_, body), request in zip([results[0], results[2]], [bodies[0], bodies[2]]):
        [(_, expected)], _ = answers(tiny_engine, [request])
        np.testing.assert_allclose(matrix(body), matrix(expected), atol=1e-5)
    assert report.statuses == {200: 2, 500: 2} and report.inputs == 11 and report.forward_passes >= 2


def test_the_cpu_allocator_s_own_out_of_memory_is_split(tmp_path, tiny_model_dir):
    """A real allocation failure, not an injected one: in a child process whose address space is
    capped just above what single inputs need, a wide pass fails in PyTorch's CPU allocator."""
    outcome = run_child(tmp_path, CPU_OOM_SCRIPT, tiny_model_dir)
    assert outcome["allocator_error"] and "DefaultCPUAllocator" in outcome["allocator_error"]
    assert outcome["status"] == 200 and outcome["passes"] > 1 and outcome["max_abs_diff"] < 1e-5


def run_child(tmp_path, script: str, model_dir) -> dict:
    """Run `script` with `model_dir` in a child Python (whose limits it may cap) and return the
    JSON object its last output line holds."""
    path = tmp_path / "child.py"
    path.write_text(script)
    result = subprocess.run([sys.executable, str(path), str(model_dir)], capture_output=True, text=True,
                            timeout=300, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


CPU_OOM_SCRIPT = """
import json, resource, sys
import numpy as np, torch
from tests.conftest import make_engine
from embedserve.handler.service import RawRequest

engine = make_engine(sys.argv[1], max_batch_tokens=1 << 20, max_batch_size=4096, warmup=False)
texts = ["the cat sat on the mat with a hat and a bat " + str(i) for i in range(1024)]
body = json.dumps({"input": texts}).encode()
expected = np.array([d["embedding"] for d in json.loads(engine.handle([RawRequest(body)])[0].body)["data"]])
torch.zeros(1 << 22)  # warm the allocator's small paths
with open("/proc/self/status") as status:
    used = next(int(line.split()[1]) for line in status if line.startswith("VmSize")) * 1024
# One 1024-input pass needs ~90 MB of attention scores; single inputs need kilobytes.
resource.setrlimit(resource.RLIMIT_AS, (used + (48 << 20), resource.RLIM_INFINITY))
error = None
try:
    torch.empty(64 << 20, dtype=torch.uint8)
except RuntimeError as err:
    error = str(err)[:200]
responses, report = engine.handle_with_report([RawRequest(body)])
got = np.array([d["embedding"] for d in json.loads(responses[0].body)["data"]]) if responses[0].status == 200 else None
print(json.dumps({"allocator_error": error, "status": responses[0].status, "passes": report.forward_passes,
                  "max_abs_diff": float(np.abs(got - expected).max()) if got is not None else None}))
"""


def test_faults_come_only_from_the_environment(monkeypatch):
    monkeypatch.delenv(FAULTS_ENV, raising=False)
    assert FaultInjection.from_env() is None
    monkeypatch.setenv(FAULTS_ENV, "oom_above_tokens=40,device_error_token=7")
    assert FaultInjection.from_env() == FaultInjection(oom_above_tokens=40, device_error_token=7)


# Through the real TorchServe.

@pytest.fixture(scope="module")
def faulty_server(tmp_path_factory, tiny_model_dir):
    tiny = ["--model", str(tiny_model_dir), "--name", "tiny", "--workers", "1", "--batch-size", "8",
            "--max-batch-delay", "150", "--set", "max_batch_tokens=4096"]
    faults = {FAULTS_ENV: f"oom_above_tokens={OOM_ABOVE},device_error_token={POISON_TOKEN}"}
    with serving(tmp_path_factory.mktemp("faults"), tiny, env=faults) as ts:  # the workers inherit it
        yield ts


def worker(server):
    headers = server.auth("management")
    [model] = requests.get(f"{server.url('management')}/models/tiny", headers=headers, timeout=30).json()
    [only] = model["workers"]
    return only


@pytest.mark.integration
def test_out_of_memory_through_torchserve(faulty_server, tiny_engine):
    before = worker(faulty_server)
    bodies = [{"input": SHORT}, {"input": ["hello", LONG]}, {"input": SHORT[:2]}]
    responses = concurrently([lambda b=b: predict(faulty_server, b) for b in bodies])
    assert [r.status_code for r in responses] == [200, 507, 200]
    assert responses[1].json()["error"]["param"] == "input[1]"
    for response, body in zip([responses[0], responses[2]], [bodies[0], bodies[2]]):
        [(_, expected)], _ = answers(tiny_engine, [body])
        np.testing.assert_allclose(vectors(response), matrix(expected), atol=1e-5)
    after = worker(faulty_server)
    assert (after["pid"], after["startTime"]) == (before["pid"], before["startTime"])  # no restart


@pytest.mark.integration
def test_a_device_failure_replaces_the_worker(faulty_server):
    before = worker(faulty_server)
    bodies = [{"input": "an innocent neighbour"}, {"input": [[5, POISON_TOKEN, 9]]}]
    responses = concurrently([lambda b=b: predict(faulty_server, b) for b in bodies])
    # The poisoned batch is answered (503, retryable, JSON) before the worker exits; the
    # neighbour shares its fate when it shares its batch.
    assert responses[1].status_code == 503 and responses[1].json()["error"]["code"] == "unavailable"
    assert responses[0].status_code in (200, 503)

    failed_at = time.monotonic()
    while time.monotonic() - failed_at < 120:
        current = worker(faulty_server)
        if current["pid"] != before["pid"] and current["status"] == "READY":
            response = predict(faulty_server, {"input": "after the restart"})
            if response.status_code == 200:
                break
        time.sleep(0.5)
    else:
        pytest.fail(f"the worker was not replaced: {worker(faulty_server)}")
    assert len(vectors(response)) == 1
