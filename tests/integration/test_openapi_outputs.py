"""The new outputs' OpenAPI documents fuzzed against the live server, as tests/integration/
test_openapi.py fuzzes the embedding and scoring models' (same configuration, every check on but
the three TorchServe's design fails): a sparse (SPLADE) model, a hybrid (bge-m3) model, a
multi-vector (ColBERT) model, image-text models (CLIP, SigLIP 2 NaFlex) and page retrievers (ColPali, ColQwen2), each its own document and operations. No 5xx, every answer as its
document says, and the same worker at the end."""

from __future__ import annotations

import pytest
from openapi_spec_validator import validate

from tests.integration.test_openapi import _document, _identities, _schema, fuzz, summary

pytestmark = pytest.mark.integration

OPERATIONS = {"splade": ("", "v1/embeddings", "embed_sparse"), "m3": ("", "v1/embeddings", "embed", "embed_sparse"),
              "colbert": ("", "v1/embeddings", "embed_all", "rerank", "v1/rerank", "v2/rerank"),
              "clip": ("", "v1/embeddings", "v2/embed"), "siglip2": ("", "v1/embeddings"),
              "colpali": ("", "rerank"), "colqwen2": ("", "rerank")}
# The operations fuzzed of a model whose others are a text model's, fuzzed in test_openapi.py: the
# image-text models' routes that take images (their TEI routes take texts, as every embedding model's
# do); the page retrievers' routes that take page images (their others are the ColBERT's).
ONLY = {name: OPERATIONS[name] for name in ("clip", "siglip2", "colpali", "colqwen2")}


@pytest.fixture(scope="module")
def served(catalog):
    """The session's catalog server (tests/support/catalog.py); the fuzzer sends one request at a
    time, which the build's default delay (1 ms) serves at once."""
    return catalog


@pytest.mark.parametrize("name", OPERATIONS)
def test_every_operation_holds_to_its_document(served, name):
    before = _identities(served, name)
    document = _document(served, name)
    validate(document)
    if name in ONLY:
        wanted = {f"/{name}" + (f"/1.0/{route}" if route else "") for route in ONLY[name]}
        document = {**document, "paths": {path: item for path, item in document["paths"].items()
                                          if path.removeprefix("/predictions") in wanted}}
    tally, failures, seconds = fuzz(_schema(served, document))
    print("\n" + summary(tally, failures, seconds))
    assert not failures, "\n\n".join(dict.fromkeys(failures))
    assert {operation for operation, _ in tally} >= {
        f"POST /predictions/{name}" + (f"/1.0/{route}" if route else "") for route in OPERATIONS[name]}
    assert _identities(served, name) == before  # no worker died or was replaced
