"""A page retriever served in-process (tasks/pages.py) on the tiny ColPali (tests/support/
page_models.py): page images and queries answered as transformers' ColPaliForRetrieval embeds
them, MaxSim scores as ColPaliProcessor.score_retrieval gives them, and bad requests refused
alone in their batch."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch
from openapi_spec_validator import validate
from PIL import Image

from embedserve.handler.api.exchange import RawRequest
from embedserve.handler.assembly import assemble
from embedserve.handler.settings import Settings
from tests.support.page_models import make_colpali

QUERIES = ["two dogs", "a cat on the mat", "what is on the page"]


@pytest.fixture(scope="module")
def colpali(tmp_path_factory):
    return make_colpali(tmp_path_factory.mktemp("pages-api") / "colpali")


@pytest.fixture(scope="module")
def service(colpali):
    return assemble(colpali, Settings(dtype="float32"), model_name="colpali", warm=True)


@pytest.fixture(scope="module")
def reference(colpali):
    from transformers import ColPaliForRetrieval, ColPaliProcessor

    return ColPaliProcessor.from_pretrained(colpali), ColPaliForRetrieval.from_pretrained(colpali).eval()


def page_images(count: int) -> list[Image.Image]:
    rng = np.random.default_rng(1)
    return [Image.fromarray(rng.integers(0, 256, (50 + 31 * i, 120 - 17 * i, 3), dtype=np.uint8)) for i in range(count)]


def data_uri(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def call(service, route: str, *bodies: dict) -> list[tuple[int, object]]:
    """The bodies as one batch."""
    answers = service.handle([RawRequest(json.dumps(body).encode(), "application/json", route) for body in bodies])
    return [(answer.status, json.loads(answer.body)) for answer in answers]


def test_page_images_and_queries_are_colpalis_vectors(service, reference):
    processor, model = reference
    images = page_images(3)
    queries = processor.process_queries(QUERIES)
    with torch.inference_mode():
        want_pages = model(**processor.process_images(images)).embeddings.numpy()
        want_queries = [row[mask.bool()].numpy() for row, mask in
                        zip(model(**queries).embeddings, queries["attention_mask"])]
    [(status, pages), (query_status, answered)] = call(
        service, "", {"input": [data_uri(image) for image in images], "modality": "image"}, {"input": QUERIES})
    assert status == 200 and query_status == 200, (pages, answered)
    for item, want in zip(pages["data"], want_pages, strict=True):
        np.testing.assert_allclose(np.array(item["embedding"]), want, atol=1e-5)
    for item, want in zip(answered["data"], want_queries, strict=True):
        np.testing.assert_allclose(np.array(item["embedding"]), want, atol=1e-5)


def test_maxsim_ranks_pages_as_score_retrieval_scores_them(service, reference):
    processor, model = reference
    images = page_images(4)
    with torch.inference_mode():
        scores = processor.score_retrieval(model(**processor.process_queries(QUERIES[:1])).embeddings,
                                           model(**processor.process_images(images)).embeddings)[0]
    [(status, ranked)] = call(service, "rerank", {"query": QUERIES[0], "texts": [data_uri(image) for image in images],
                                                  "modality": "image"})
    assert status == 200, ranked
    assert [item["index"] for item in ranked] == scores.argsort(descending=True).tolist()
    np.testing.assert_allclose([item["score"] for item in ranked], scores.sort(descending=True).values, rtol=1e-5)


def test_a_bad_page_fails_its_request_alone_naming_the_item(service):
    good = data_uri(page_images(1)[0])
    answers = call(service, "v1/embeddings",
                   {"input": [good, "data:image/png;base64,aGVsbG8="], "modality": "image"},
                   {"input": [good], "modality": "image"},
                   {"input": "a query", "input_type": "document"})
    (bad_status, bad), (status, answer), (document_status, document) = answers
    assert bad_status == 400 and "'input[1]'" in bad["error"]["message"], bad
    assert status == 200 and len(answer["data"]) == 1
    assert document_status == 400 and document["error"]["code"] == "invalid_value"
    assert "a page retriever's documents are page images" in document["error"]["message"]


def test_too_many_pages_is_413_naming_the_limit(colpali):
    service = assemble(colpali, Settings(dtype="float32", max_images_per_request=2), model_name="colpali", warm=False)
    page = data_uri(page_images(1)[0])
    [(status, answer)] = call(service, "", {"input": [page] * 3, "modality": "image"})
    assert status == 413 and "max_images_per_request=2" in answer["error"]["message"], answer


def test_its_openapi_document_is_valid_and_offers_page_images(service):
    [(status, document)] = call(service, "openapi.json", {})
    assert status == 200
    validate(document)
    request = document["components"]["schemas"]["MultiVectorRequest"]
    assert request["properties"]["modality"]["enum"] == ["text", "image", None]
    assert request["then"]["properties"]["input"] == {"$ref": "#/components/schemas/ImageInputs"}


def test_through_the_cache_each_page_keeps_its_own_vectors(colpali, service):
    """Every page has the same ids: the cache keys its pixels too, so a cached page never answers
    for another."""
    cached = assemble(colpali, Settings(dtype="float32", cache_entries=64), model_name="colpali", warm=False)
    uris = [data_uri(image) for image in page_images(3)]
    [(_, want)] = call(service, "", {"input": uris, "modality": "image"})
    for _ in range(2):  # filled, then answered from the cache
        [(status, got)] = call(cached, "", {"input": uris, "modality": "image"})
        assert status == 200
        for item, expected in zip(got["data"], want["data"], strict=True):
            np.testing.assert_allclose(item["embedding"], expected["embedding"], atol=1e-6)
