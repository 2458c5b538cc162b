"""What docs/production.md tells an operator, against the real TorchServe 0.12: a lowered
max_response_size is the handler's bound (413 naming it, the worker lives on); key rotation as
TorchServe does it (the new key only in key_file.json, the old one refused at once); what answers
a health check without a key; and `"normalize": false` through the server."""

from __future__ import annotations

import json
import stat

import numpy as np
import pytest
import requests

from embedserve.handler.tasks.embed import max_answer_bytes
from tests.support.model_families import MIN_COSINE, TEXTS, min_cosine
from tests.support.pipelines import without_normalize
from tests.support.serving import FLOAT32, serving

pytestmark = pytest.mark.integration

# Well below what the tiny model's archive allows (4096 vectors): 256 vectors of 32 floats.
LIMIT = max_answer_bytes(256, 32, "float", "float", "tiny")


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir, families):
    tiny = [*FLOAT32, "--model", str(tiny_model_dir), "--name", "tiny", "--workers", "1"]
    dense = [*FLOAT32, "--model", str(families["bert_dense"]), "--name", "dense", "--workers", "1"]
    with serving(tmp_path_factory.mktemp("production-server"), tiny, dense, max_response_size=str(LIMIT)) as ts:
        yield ts


def url(server, api, path) -> str:
    return f"{server.url(api)}{path}"


def post(server, model, body, headers=None):
    return requests.post(url(server, "inference", f"/predictions/{model}"), json=body,
                         headers=server.auth() if headers is None else headers, timeout=120)


def worker_identities(server, model) -> set[tuple]:
    [described] = requests.get(url(server, "management", f"/models/{model}"), headers=server.auth("management"),
                               timeout=30).json()
    return {(w["pid"], w["startTime"]) for w in described["workers"]}


def key_file(server) -> dict:
    return json.loads((server.workdir / "key_file.json").read_text())


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# --- max_response_size -----------------------------------------------------------------------

def test_a_lowered_max_response_size_is_the_handlers_bound(server):
    before = worker_identities(server, "tiny")
    info = requests.get(url(server, "inference", "/predictions/tiny/1.0/info"), headers=server.auth(), timeout=30)
    assert info.json()["max_response_bytes"] == LIMIT < max_answer_bytes(4096, 32, "float", "float", "tiny")
    assert "is below the archive's max_response_bytes" in (server.logs / "model_log.log").read_text()

    large = post(server, "tiny", {"input": [f"text {i}" for i in range(2000)]})
    assert large.status_code == 413, large.text[:300]
    error = large.json()["error"]
    assert error["param"] == "input" and f"max_response_bytes={LIMIT}" in error["message"]
    assert "max_response_size" in error["message"]
    small = post(server, "tiny", {"input": [f"text {i}" for i in range(200)]})
    assert small.status_code == 200 and len(small.json()["data"]) == 200
    assert worker_identities(server, "tiny") == before  # the worker answered; none was replaced


# --- "normalize": false ----------------------------------------------------------------------

def test_normalize_false_serves_the_vector_before_normalize(server, families, tmp_path):
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(without_normalize(families["bert_dense"], tmp_path / "dense")), device="cpu")
    want = reference.encode(TEXTS, normalize_embeddings=False).astype(np.float64)
    answer = post(server, "dense", {"input": TEXTS, "normalize": False})
    assert answer.status_code == 200, answer.text[:300]
    got = np.array([row["embedding"] for row in answer.json()["data"]])
    assert min_cosine(got, want) >= MIN_COSINE
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(want, axis=1), rtol=2e-4)
    refused = post(server, "dense", {"input": TEXTS, "normalize": False, "output_dtype": "int8"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "output_dtype"
    assert post(server, "dense", {"input": TEXTS, "output_dtype": "int8"}).status_code == 200


# --- health checks and keys ------------------------------------------------------------------

def test_what_answers_a_health_check_without_a_key(server):
    no_key = requests.get(url(server, "inference", "/ping"), timeout=30)
    assert no_key.status_code == 400  # /ping needs the inference key too
    assert requests.get(url(server, "inference", "/ping"), headers=server.auth(), timeout=30).json() == \
        {"status": "Healthy"}
    assert requests.get(url(server, "management", "/models"), timeout=30).status_code == 400
    metrics = requests.get(url(server, "metrics", "/metrics"), timeout=30)
    assert metrics.status_code == 200  # the metrics port has no authorization


def test_key_rotation_as_torchserve_does_it(server):
    before = key_file(server)
    api_key = before["API"]["key"]
    assert requests.get(url(server, "management", "/token?type=inference"), headers=server.auth(),
                        timeout=30).status_code == 400  # only the API key rotates keys

    rotated = requests.get(url(server, "management", "/token?type=inference"), headers=bearer(api_key), timeout=30)
    after = key_file(server)
    new_key, old_key = after["inference"]["key"], before["inference"]["key"]
    assert rotated.status_code == 200 and new_key != old_key
    assert new_key not in rotated.text  # the answer does not carry the key: read key_file.json
    assert after["management"] == before["management"] and after["API"] == before["API"]
    assert post(server, "tiny", {"input": "x"}, headers=bearer(old_key)).status_code == 400  # no overlap
    assert post(server, "tiny", {"input": "x"}, headers=bearer(new_key)).status_code == 200

    old_management = after["management"]["key"]
    requests.get(url(server, "management", "/token?type=management"), headers=bearer(api_key),
                 timeout=30).raise_for_status()
    assert requests.get(url(server, "management", "/models"), headers=bearer(old_management),
                        timeout=30).status_code == 400
    assert requests.get(url(server, "management", "/models"), headers=server.auth("management"),
                        timeout=30).status_code == 200
    assert stat.S_IMODE((server.workdir / "key_file.json").stat().st_mode) & 0o077 == 0  # still private
    # Only inference and management keys rotate; the API key stays what TorchServe started with.
    assert requests.get(url(server, "management", "/token?type=api"), headers=bearer(api_key),
                        timeout=30).status_code != 200
    assert key_file(server)["API"] == before["API"]
    assert set(after["inference"]) == {"key", "expiration time"}  # the file records when a key expires
