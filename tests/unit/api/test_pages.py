"""A page retriever served in-process (tasks/pages.py) on the tiny ColPali and ColQwen2 (tests/
support/page_models.py): page images and queries answered as transformers' ColPaliForRetrieval and
ColQwen2ForRetrieval embed them, MaxSim scores as their processors' score_retrieval gives them, and
bad requests refused alone in their batch."""

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
from tests.support.page_models import make_colpali, make_colqwen2

QUERIES = ["two dogs", "a cat on the mat", "what is on the page"]


MAKERS = {"colpali": make_colpali, "colqwen2": make_colqwen2}


@pytest.fixture(scope="module", params=list(MAKERS))
def folder(request, tmp_path_factory):
    return MAKERS[request.param](tmp_path_factory.mktemp("pages-api") / request.param)


@pytest.fixture(scope="module")
def service(folder):
    return assemble(folder, Settings(dtype="float32"), model_name="pages", warm=True)


@pytest.fixture(scope="module")
def reference(folder):
    import transformers

    architecture = json.loads((folder / "config.json").read_text())["architectures"][0]
    return (transformers.AutoProcessor.from_pretrained(folder),
            getattr(transformers, architecture).from_pretrained(folder).eval())


def embedded(model, batch) -> list[torch.Tensor]:
    """Each row's vectors where the mask attends: ColQwen2's pages of other sizes are padded."""
    with torch.inference_mode():
        return [row[mask.bool()] for row, mask in zip(model(**batch).embeddings, batch["attention_mask"])]


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


def test_page_images_and_queries_are_the_references_vectors(service, reference):
    processor, model = reference
    images = page_images(3)
    want_pages = embedded(model, processor.process_images(images))
    want_queries = embedded(model, processor.process_queries(QUERIES))
    [(status, pages), (query_status, answered)] = call(
        service, "", {"input": [data_uri(image) for image in images], "modality": "image"}, {"input": QUERIES})
    assert status == 200 and query_status == 200, (pages, answered)
    for item, want in zip(pages["data"] + answered["data"], want_pages + want_queries, strict=True):
        np.testing.assert_allclose(np.array(item["embedding"]), want.numpy(), atol=1e-5)


def test_maxsim_ranks_pages_as_score_retrieval_scores_them(service, reference):
    """score_retrieval a page at a time: over pages of several lengths it pads them with zero
    vectors, which count where a query token's every similarity is below 0."""
    processor, model = reference
    images = page_images(4)
    [query] = embedded(model, processor.process_queries(QUERIES[:1]))
    scores = torch.tensor([float(processor.score_retrieval([query], [page])[0, 0])
                           for page in embedded(model, processor.process_images(images))])
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


def test_too_many_pages_is_413_naming_the_limit(folder):
    service = assemble(folder, Settings(dtype="float32", max_images_per_request=2), model_name="pages", warm=False)
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


def test_through_the_cache_each_page_keeps_its_own_vectors(folder, service):
    """ColPali's pages have the same ids, ColQwen2's of one size too: the cache keys their pixels
    (and grid) as well, so a cached page never answers for another."""
    cached = assemble(folder, Settings(dtype="float32", cache_entries=64), model_name="pages", warm=False)
    rng = np.random.default_rng(7)
    same_size = [Image.fromarray(rng.integers(0, 256, (60, 90, 3), dtype=np.uint8)) for _ in range(2)]
    uris = [data_uri(image) for image in page_images(3) + same_size]
    [(_, want)] = call(service, "", {"input": uris, "modality": "image"})
    for _ in range(2):  # filled, then answered from the cache
        [(status, got)] = call(cached, "", {"input": uris, "modality": "image"})
        assert status == 200
        for item, expected in zip(got["data"], want["data"], strict=True):
            np.testing.assert_allclose(item["embedding"], expected["embedding"], atol=1e-6)
