"""The page retriever's room (embedserve/handler/model/pages.py) against transformers' own
ColPaliProcessor and ColPaliForRetrieval on the tiny ColPali (tests/support/page_models.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from embedserve.handler.inputs.image import ImagePreparation
from embedserve.handler.model.description import ModelFilesError
from embedserve.handler.model.pages import PageEncoder, page_text, query_text, read_pages
from embedserve.handler.model.tokenization import TextTokenizer
from embedserve.handler.tasks.multi_vector import maxsim
from tests.support.page_models import make_colpali

QUERIES = ["two dogs", "a cat on the mat", "what is here"]


@pytest.fixture(scope="module")
def colpali(tmp_path_factory):
    return make_colpali(tmp_path_factory.mktemp("pages") / "colpali")


@pytest.fixture(scope="module")
def reference(colpali):
    from transformers import ColPaliForRetrieval, ColPaliProcessor

    return ColPaliProcessor.from_pretrained(colpali), ColPaliForRetrieval.from_pretrained(colpali).eval()


def pages_of(count: int) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (40 + 17 * i, 90 - 9 * i, 3), dtype=np.uint8)) for i in range(count)]


def test_the_folder_says_its_width_image_tokens_and_prompts(colpali):
    pages = read_pages(colpali, json.loads((colpali / "config.json").read_text()))
    assert (pages.architecture, pages.dimension, pages.image_tokens) == ("ColPaliForRetrieval", 16, 16)
    assert (pages.visual_prompt, pages.query_prefix) == ("Describe the image.", "Question: ")


def test_ids_are_the_processors(colpali, reference):
    processor, _ = reference
    pages = read_pages(colpali, json.loads((colpali / "config.json").read_text()))
    tokenizer = TextTokenizer(colpali)
    queries = processor.process_queries(QUERIES)
    ours = tokenizer.body_ids([query_text(pages, "<bos>", "<pad>", text) for text in QUERIES])
    for row, mask, ids in zip(queries["input_ids"], queries["attention_mask"], ours):
        assert row[mask.bool()].tolist() == ids
    [image_ids] = tokenizer.body_ids([page_text(pages, "<bos>")])
    assert processor.process_images(pages_of(1))["input_ids"][0].tolist() == image_ids


def test_vectors_and_maxsim_scores_are_the_references(colpali, reference):
    processor, model = reference
    pages = read_pages(colpali, json.loads((colpali / "config.json").read_text()))
    images = pages_of(3)
    batch_images, batch_queries = processor.process_images(images), processor.process_queries(QUERIES)
    with torch.inference_mode():
        expected_pages = model(**batch_images).embeddings
        expected_queries = model(**batch_queries).embeddings
        tokenizer, encoder = TextTokenizer(colpali), PageEncoder(model)
        pixels = ImagePreparation(colpali, pages.image_tokens).pixel_values(images)
        [image_ids] = tokenizer.body_ids([page_text(pages, "<bos>")])
        ids = torch.tensor([image_ids] * len(images))
        got_pages = encoder(ids, torch.ones_like(ids), pixels)
    torch.testing.assert_close(got_pages, expected_pages, rtol=0, atol=1e-6)
    scores = processor.score_retrieval(expected_queries, expected_pages)
    ours = [[maxsim(q[m.bool()].numpy(), p.numpy()) for p in got_pages]
            for q, m in zip(expected_queries, batch_queries["attention_mask"])]
    np.testing.assert_allclose(np.array(ours), scores.numpy(), rtol=1e-5)


def test_a_processor_whose_image_tokens_are_not_the_patches_is_refused(colpali, tmp_path):
    import shutil

    copy = tmp_path / "colpali"
    shutil.copytree(colpali, copy)
    settings = json.loads((copy / "processor_config.json").read_text())
    settings["image_processor"]["image_seq_length"] = 1024
    (copy / "processor_config.json").write_text(json.dumps(settings))
    with pytest.raises(ModelFilesError, match="image_seq_length is 1024, the vision tower computes 16 patches"):
        read_pages(copy, json.loads((copy / "config.json").read_text()))
