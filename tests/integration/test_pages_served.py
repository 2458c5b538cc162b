"""Page images through the real TorchServe: the session catalog's tiny ColPali and ColQwen2
(tests/support/page_models.py), built as a user builds the folders. Page images and queries
answered as transformers' ColPaliForRetrieval and ColQwen2ForRetrieval embed them (ColQwen2's pages
of several sizes in one request), a query's pages ranked by MaxSim as the processor's
score_retrieval scores them (TEI's rerank route), base64 on the OpenAI route, and a bad page
answered alone, the rest of its batch served, the worker unchanged."""

from __future__ import annotations

import base64
import io
import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import torch
from PIL import Image

from tests.support.catalog import PAGES, PAGES_BY_SIZE
from tests.support.client import worker_identities
from tests.support.images import data_uri, image_file, photo

pytestmark = pytest.mark.integration

QUERIES = ["two dogs", "a cat on the mat"]


@pytest.fixture(scope="module", params=[PAGES, PAGES_BY_SIZE])
def served(request, catalog_models):
    """A served page retriever's name, with transformers' processor and model of its folder."""
    import transformers

    folder = catalog_models[request.param]
    architecture = json.loads((folder / "config.json").read_text())["architectures"][0]
    return (request.param, transformers.AutoProcessor.from_pretrained(folder),
            getattr(transformers, architecture).from_pretrained(folder).eval())


def embedded(model, batch) -> list[np.ndarray]:
    """Each row's vectors where the mask attends (ColQwen2's pages of other sizes are padded)."""
    with torch.inference_mode():
        return [row[mask.bool()].numpy() for row, mask in zip(model(**batch).embeddings, batch["attention_mask"])]


def pages() -> list[tuple[Image.Image, str]]:
    """Page images of several sizes and formats, each with its data URI."""
    made = []
    for image, file_format, media_type in ((photo(320, 240), "PNG", "image/png"),
                                           (photo(90, 160).convert("L"), "JPEG", "image/jpeg")):
        data = image_file(image, file_format)
        made.append((Image.open(io.BytesIO(data)).convert("RGB"), data_uri(data, media_type)))
    return made


def post(catalog, body, route="", name=PAGES):
    url = f"{catalog.url('inference')}/predictions/{name}" + (f"/1.0/{route}" if route else "")
    return requests.post(url, json=body, headers=catalog.auth(), timeout=120)


def test_pages_and_queries_are_the_references_vectors_and_ranked_by_its_maxsim(catalog, served):
    name, processor, model = served
    images, uris = zip(*pages())
    want_pages = embedded(model, processor.process_images(list(images)))
    want_queries = embedded(model, processor.process_queries(QUERIES))
    answer = post(catalog, {"input": list(uris), "modality": "image"}, name=name)
    assert answer.status_code == 200, answer.text
    for item, want in zip(answer.json()["data"], want_pages, strict=True):
        np.testing.assert_allclose(np.array(item["embedding"]), want, atol=1e-5)
    answer = post(catalog, {"input": QUERIES, "encoding_format": "base64"}, "v1/embeddings", name=name)
    assert answer.status_code == 200, answer.text
    for item, want in zip(answer.json()["data"], want_queries, strict=True):
        got = np.frombuffer(base64.b64decode(item["embedding"]), "<f4").reshape(-1, want.shape[1])
        np.testing.assert_allclose(got, want, atol=1e-5)
    # A page at a time: score_retrieval pads pages of other lengths with zero vectors.
    query = torch.from_numpy(want_queries[0])
    scores = torch.tensor([float(processor.score_retrieval([query], [torch.from_numpy(page)])[0, 0])
                           for page in want_pages])
    ranked = post(catalog, {"query": QUERIES[0], "texts": list(uris), "modality": "image"}, "rerank", name=name)
    assert ranked.status_code == 200, ranked.text
    assert [item["index"] for item in ranked.json()] == scores.argsort(descending=True).tolist()
    np.testing.assert_allclose([item["score"] for item in ranked.json()], scores.sort(descending=True).values,
                               rtol=1e-5)


def test_a_bad_page_fails_alone_and_the_worker_stays(catalog):
    before = worker_identities(catalog, PAGES)
    good = pages()[0][1]
    bodies = [{"input": [good, "data:image/png;base64,aGVsbG8="], "modality": "image"},
              {"input": [good], "modality": "image"}, {"input": ["a query"]},
              {"input": ["a query"], "input_type": "document"}]
    with ThreadPoolExecutor(len(bodies)) as pool:  # together, so that they can share a batch
        bad, page, query, document = pool.map(lambda body: post(catalog, body), bodies)
    assert bad.status_code == 400 and "'input[1]'" in bad.json()["error"]["message"], bad.text
    assert page.status_code == 200 and query.status_code == 200
    assert document.status_code == 400 and "documents are page images" in document.json()["error"]["message"]
    assert worker_identities(catalog, PAGES) == before


def test_the_colbert_model_refuses_page_images(catalog):
    answer = requests.post(f"{catalog.url('inference')}/predictions/colbert", headers=catalog.auth(), timeout=60,
                           json={"input": [pages()[0][1]], "modality": "image"})
    assert answer.status_code == 400 and "page images need a page retriever" in answer.json()["error"]["message"]
