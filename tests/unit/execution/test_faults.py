"""Out-of-memory and device failures, provoked through the tests' fault injection, in-process (in a
real TorchServe worker started through tests/support/fault_entry.py: tests/integration/test_faults_served.py)."""

import numpy as np
import pytest

from embedserve.handler.execution.device_errors import DeviceFailure
from tests.support import REPO
from tests.support.child import run_child
from tests.support.engines import make_engine, matrix
from tests.support.faults import FAULTS_ENV, LONG, OOM_ABOVE, POISON_TOKEN, SHORT, FaultInjection, answers
from tests.support.parts import poisoned, with_faults

ERROR_TOKEN = 9


@pytest.fixture()
def faulty_engine(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_batch_tokens=4096)
    return with_faults(engine, FaultInjection(oom_above_tokens=OOM_ABOVE, device_error_token=POISON_TOKEN))


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


CPU_OOM_SCRIPT = """
import json, resource, sys
import numpy as np, torch
from tests.support.engines import make_engine
from embedserve.handler.api.exchange import RawRequest

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


def test_the_package_never_reads_the_fault_variable():
    # Only the tests' own entry (tests/support/fault_entry.py) injects faults into a worker.
    readers = [path for path in (REPO / "embedserve").rglob("*.py") if FAULTS_ENV in path.read_text()]
    assert readers == []
