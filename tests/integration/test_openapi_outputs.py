"""The new outputs' OpenAPI documents fuzzed against the live server, as tests/integration/
test_openapi.py fuzzes the embedding and scoring models' (same configuration, every check on but
the three TorchServe's design fails): a sparse (SPLADE) model, a hybrid (bge-m3) model and a
multi-vector (ColBERT) model, each its own document and operations. No 5xx, every answer as its
document says, and the same worker at the end."""

from __future__ import annotations

import pytest
from openapi_spec_validator import validate

from tests.integration.test_openapi import _document, _identities, _schema, fuzz, summary
from tests.support.m3_models import make_m3
from tests.support.multi_vector_models import make_colbert
from tests.support.serving import serving
from tests.support.sparse_models import make_splade

pytestmark = pytest.mark.integration

MAKERS = {"splade": make_splade, "m3": make_m3, "colbert": make_colbert}
OPERATIONS = {"splade": ("", "v1/embeddings", "embed_sparse"), "m3": ("", "v1/embeddings", "embed", "embed_sparse"),
              "colbert": ("", "v1/embeddings", "embed_all", "rerank", "v1/rerank", "v2/rerank")}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    builds = [["--model", str(make(tmp_path_factory.mktemp(f"openapi-{name}") / name)), "--name", name,
               "--workers", "1", "--batch-size", "8", "--max-batch-delay", "1"] for name, make in MAKERS.items()]
    with serving(tmp_path_factory.mktemp("openapi-outputs"), *builds) as ts:
        yield ts


@pytest.mark.parametrize("name", MAKERS)
def test_every_operation_holds_to_its_document(served, name):
    before = _identities(served, name)
    document = _document(served, name)
    validate(document)
    tally, failures, seconds = fuzz(_schema(served, document))
    print("\n" + summary(tally, failures, seconds))
    assert not failures, "\n\n".join(dict.fromkeys(failures))
    assert {operation for operation, _ in tally} >= {
        f"POST /predictions/{name}" + (f"/1.0/{route}" if route else "") for route in OPERATIONS[name]}
    assert _identities(served, name) == before  # no worker died or was replaced
