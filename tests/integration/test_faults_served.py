"""Out-of-memory and device failures in a real TorchServe worker that injects them: its archive
starts it through tests/support/fault_entry.py, which reads EMBEDSERVE_TEST_FAULTS (in-process:
tests/unit/execution/test_faults.py)."""

import time

import numpy as np
import pytest
import requests

from tests.support.client import concurrently, predict, vectors
from tests.support.engines import matrix
from tests.support.faults import LONG, OOM_ABOVE, POISON_TOKEN, SHORT, answers
from tests.support.serving import FLOAT32, serving


@pytest.fixture(scope="module")
def faulty_server(tmp_path_factory, tiny_model_dir):
    tiny = [*FLOAT32, "--model", str(tiny_model_dir), "--name", "tiny", "--workers", "1", "--batch-size", "8",
            "--max-batch-delay", "150", "--set", "max_batch_tokens=4096"]
    faults = f"oom_above_tokens={OOM_ABOVE},device_error_token={POISON_TOKEN}"
    with serving(tmp_path_factory.mktemp("faults"), tiny, faults=faults) as ts:
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
