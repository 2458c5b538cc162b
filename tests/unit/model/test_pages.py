"""The page retriever's room (embedserve/handler/model/pages.py, backends/pages.py) against
transformers' own processors and models, ColPali's and ColQwen2's, on the tiny ones
(tests/support/page_models.py)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

from embedserve.handler.backends.pages import PageBackend
from embedserve.handler.inputs.image import ImagePreparation
from embedserve.handler.model.description import ModelFilesError
from embedserve.handler.model.pages import PageEncoder, PageIds, image_tokens, query_text, read_pages
from embedserve.handler.model.tokenization import TextTokenizer
from embedserve.handler.tasks.multi_vector import maxsim
from tests.support.page_models import make_colpali, make_colqwen2

QUERIES = ["two dogs", "a cat on the mat", "what is here"]
MAKERS = {"colpali": make_colpali, "colqwen2": make_colqwen2}
BOS = {"colpali": "<bos>", "colqwen2": ""}


@pytest.fixture(scope="module", params=list(MAKERS))
def family(request):
    return request.param


@pytest.fixture(scope="module")
def folder(family, tmp_path_factory):
    return MAKERS[family](tmp_path_factory.mktemp("pages") / family)


@pytest.fixture(scope="module")
def reference(folder):
    import transformers

    architecture = json.loads((folder / "config.json").read_text())["architectures"][0]
    return (transformers.AutoProcessor.from_pretrained(folder),
            getattr(transformers, architecture).from_pretrained(folder).eval())


def pages_of(count: int) -> list[Image.Image]:
    """Pages of several sizes and shapes: ColQwen2 gives each its own image tokens."""
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (40 + 37 * i, 200 - 30 * i, 3), dtype=np.uint8)) for i in range(count)]


def read(folder):
    return read_pages(folder, json.loads((folder / "config.json").read_text()))


def prepared_pages(folder, images):
    """The pages as the task prepares them: pixel values (and grid) by the folder's image
    processor, ids by their image tokens."""
    pages, tokenizer = read(folder), TextTokenizer(folder)
    ids_of = PageIds.of(pages, tokenizer)
    preparation = ImagePreparation(folder, 0)
    rows = []
    for image in images:
        prepared = preparation.model_input(image)
        ids = ids_of(image_tokens(pages, prepared.grid))
        rows.append(replace(prepared, ids=ids, positions=len(ids)))
    return rows


def test_the_folder_says_its_width_image_tokens_and_prompts(folder, family):
    pages = read(folder)
    assert (pages.family, pages.dimension, pages.image_tokens) == (family, 16, 16)
    if family == "colpali":
        assert (pages.architecture, pages.merge, pages.visual_prompt, pages.query_prefix) == \
            ("ColPaliForRetrieval", 0, "Describe the image.", "Question: ")
    else:  # at most 16 image tokens: the fixture's pixel bound, 16 x 28 x 28
        assert (pages.architecture, pages.merge, pages.query_prefix, pages.image_token) == \
            ("ColQwen2ForRetrieval", 2, "Query: ", "<|image_pad|>")
        assert pages.visual_prompt.startswith("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>")


def test_ids_are_the_processors(folder, family, reference):
    processor, _ = reference
    pages, tokenizer = read(folder), TextTokenizer(folder)
    queries = processor.process_queries(QUERIES)
    ours = tokenizer.body_ids([query_text(pages, BOS[family], tokenizer.token("pad"), text) for text in QUERIES])
    for row, mask, ids in zip(queries["input_ids"], queries["attention_mask"], ours):
        assert row[mask.bool()].tolist() == ids
    images = pages_of(3)
    theirs = processor.process_images(images)
    rows = prepared_pages(folder, images)
    for row, mask, ours in zip(theirs["input_ids"], theirs["attention_mask"], rows, strict=True):
        assert row[mask.bool()].tolist() == list(ours.ids)
    sizes = {len(row.ids) for row in rows}
    assert len(sizes) == (3 if family == "colqwen2" else 1)  # ColQwen2's pages keep their own sizes


def test_vectors_and_maxsim_scores_are_the_references(folder, family, reference):
    """A pass of pages of several sizes (right-padded for ColQwen2) gives each page the vectors
    transformers gives it, and MaxSim the processor's score_retrieval, a page at a time."""
    processor, model = reference
    images = pages_of(3)
    batch_images, batch_queries = processor.process_images(images), processor.process_queries(QUERIES)
    backend = PageBackend(PageEncoder(model, family), dtype=torch.float32, device=torch.device("cpu"),
                          pad_id=TextTokenizer(folder).pad_id)
    with torch.inference_mode():
        expected = model(**batch_images).embeddings
        expected_queries = model(**batch_queries).embeddings
        got = backend.run(backend.prepare(prepared_pages(folder, images)))
    want_pages = [row[mask.bool()] for row, mask in zip(expected, batch_images["attention_mask"])]
    got_pages = [row[:length] for row, length in zip(got.vectors, got.lengths.tolist())]
    for ours, theirs in zip(got_pages, want_pages, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    queries = [q[m.bool()] for q, m in zip(expected_queries, batch_queries["attention_mask"])]
    scores = [[float(processor.score_retrieval([q], [p])[0, 0]) for p in want_pages] for q in queries]
    ours = [[maxsim(q.numpy(), p.numpy()) for p in got_pages] for q in queries]
    np.testing.assert_allclose(np.array(ours), np.array(scores), rtol=1e-5)


def test_a_colpali_processor_whose_image_tokens_are_not_the_patches_is_refused(tmp_path_factory, tmp_path):
    copy = tmp_path / "colpali"
    shutil.copytree(make_colpali(tmp_path_factory.mktemp("pages") / "colpali"), copy)
    settings = json.loads((copy / "processor_config.json").read_text())
    settings["image_processor"]["image_seq_length"] = 1024
    (copy / "processor_config.json").write_text(json.dumps(settings))
    with pytest.raises(ModelFilesError, match="image_seq_length is 1024, the vision tower computes 16 patches"):
        read(copy)


def test_a_colqwen2_processor_whose_patches_are_not_the_towers_is_refused(tmp_path):
    folder = make_colqwen2(tmp_path / "colqwen2")
    settings = json.loads((folder / "processor_config.json").read_text())
    settings["image_processor"]["merge_size"] = 4
    (folder / "processor_config.json").write_text(json.dumps(settings))
    with pytest.raises(ModelFilesError, match="merged 4 x 4, the vision tower takes 14 px merged 2 x 2"):
        read(folder)


def test_a_colqwen2_pages_tokens_follow_the_processors_pixel_bound(tmp_path):
    """An older folder writes the bound as max_pixels: read as the image processor reads it."""
    folder = make_colqwen2(tmp_path / "colqwen2", most_tokens=64)
    assert read(folder).image_tokens == 64
    settings = json.loads((folder / "processor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(json.dumps(
        {**{k: v for k, v in settings.pop("image_processor").items() if k != "size"}, "max_pixels": 768 * 28 * 28}))
    (folder / "processor_config.json").write_text(json.dumps(settings))
    assert read(folder).image_tokens == 768
