"""SigLIP's text tower pads every pass to its fixed length itself (model/towers.py): what the
planner cut, padded to fewer positions (or past the table by a pad multiple), is re-padded to
exactly the model card's sequence."""

from __future__ import annotations

import json

import pytest
import torch

from embedserve.handler.model.towers import padded_to

PAD = 0


def test_a_short_pass_is_padded_to_the_fixed_length_with_the_pad_id_and_masked():
    ids = torch.tensor([[5, 6, 7], [5, 9, PAD]])
    attention = torch.tensor([[1, 1, 1], [1, 1, 0]])
    full, mask = padded_to(6, ids, attention, PAD)
    assert full.tolist() == [[5, 6, 7, 0, 0, 0], [5, 9, 0, 0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]]


def test_padding_of_another_id_is_replaced_by_the_pad_id():
    full, _ = padded_to(4, torch.tensor([[5, 3]]), torch.tensor([[1, 0]]), pad_id=1)
    assert full.tolist() == [[5, 1, 1, 1]]


def test_a_pass_padded_past_the_table_is_cut_to_it():
    """A pad multiple can round a pass of full-length texts past the position table: only padding lies beyond."""
    ids = torch.tensor([[5, 6, 7, 8, PAD, PAD]])
    attention = torch.tensor([[1, 1, 1, 1, 0, 0]])
    full, mask = padded_to(4, ids, attention, PAD)
    assert full.tolist() == [[5, 6, 7, 8]] and mask.tolist() == [[1, 1, 1, 1]]


# SigLIP 2 NaFlex (Siglip2Model): an image keeps its aspect ratio, its patches padded to the
# processor's max_num_patches; served in-process as transformers computes it.

def _naflex_images():
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(3)
    return [Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
            for width, height in ((300, 40), (224, 224), (90, 500), (1, 1))]


def _uri(image) -> str:
    import base64
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def siglip2(tmp_path_factory):
    from tests.support.image_models import make_siglip2

    return make_siglip2(tmp_path_factory.mktemp("naflex") / "siglip2")


def test_a_naflex_folder_is_described_by_its_processor_s_patch_count(siglip2, tmp_path):
    from embedserve.handler.model.files import describe_model
    from tests.support.image_models import make_siglip2

    towers = describe_model(siglip2).towers
    assert (towers.architecture, towers.image_positions, towers.own_grid, towers.text_length) == \
        ("Siglip2Model", 256, True, 64)
    assert "up to 256 patches" in towers.modules[1]
    assert describe_model(make_siglip2(tmp_path / "64", max_num_patches=64)).towers.image_positions == 64


def test_a_naflex_processor_of_another_patch_size_is_refused(siglip2, tmp_path):
    import shutil

    from embedserve.handler.model.description import ModelFilesError
    from embedserve.handler.model.files import describe_model

    folder = tmp_path / "other"
    shutil.copytree(siglip2, folder)
    processor = json.loads((folder / "preprocessor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(json.dumps({**processor, "patch_size": 14}))
    with pytest.raises(ModelFilesError, match="14-pixel patches, the vision tower takes 16-pixel"):
        describe_model(folder)


def test_naflex_images_of_every_shape_in_one_pass_are_transformers_vectors(siglip2):
    """Four images of other aspect ratios in one request (one stacked pass) and texts: each vector
    is transformers' get_image_features of that image alone, by the folder's processor, and its
    get_text_features of the text padded to 64 positions, as the model card pads it."""
    from transformers import AutoImageProcessor, AutoTokenizer, Siglip2Model

    from embedserve.handler.api.exchange import RawRequest
    from embedserve.handler.assembly import assemble
    from embedserve.handler.settings import Settings

    service = assemble(siglip2, Settings(dtype="float32"), model_name="siglip2", warm=True)
    images, texts = _naflex_images(), ["two dogs", "a cat on a red mat by the window"]
    bodies = [{"input": [_uri(image) for image in images], "modality": "image"}, {"input": texts}]
    answers = service.handle([RawRequest(json.dumps(body).encode(), "application/json", "") for body in bodies])
    assert [answer.status for answer in answers] == [200, 200], [answer.body for answer in answers]
    got_images, got_texts = ([row["embedding"] for row in json.loads(answer.body)["data"]] for answer in answers)

    model = Siglip2Model.from_pretrained(siglip2, dtype=torch.float32).eval()
    processor, tokenizer = AutoImageProcessor.from_pretrained(siglip2), AutoTokenizer.from_pretrained(siglip2)
    with torch.inference_mode():
        for got, image in zip(got_images, images, strict=True):
            want = model.get_image_features(**processor(images=[image], return_tensors="pt"))
            want = torch.nn.functional.normalize(getattr(want, "pooler_output", want), dim=-1)[0]
            torch.testing.assert_close(torch.tensor(got), want, atol=1e-5, rtol=0)
        encoded = tokenizer(texts, padding="max_length", max_length=64, return_tensors="pt")
        want = model.get_text_features(**encoded)
        want = torch.nn.functional.normalize(getattr(want, "pooler_output", want), dim=-1)
        torch.testing.assert_close(torch.tensor(got_texts), want, atol=1e-5, rtol=0)
    [described] = service.handle([RawRequest(None, None, "info")])
    info = json.loads(described.body)
    assert "each its own grid of patches" in json.dumps(info) and "up to 256 patches" in json.dumps(info), info


def test_a_left_padding_feed_ends_every_row_at_the_last_position():
    """SigLIP 2's Gemma tokenizers pad on the left (transformers' Siglip2Tokenizer): the feed pads so too."""
    from embedserve.handler.model.towers import TextFeed

    ids = torch.tensor([[5, 6, 7], [5, 9, PAD]])
    attention = torch.tensor([[1, 1, 1], [1, 1, 0]])
    full, mask = TextFeed(length=5, pad_id=PAD, left=True)(ids, attention)
    assert full.tolist() == [[0, 0, 5, 6, 7], [0, 0, 0, 5, 9]]
    assert mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]]


def test_a_pass_padded_past_the_table_is_moved_left_within_it():
    ids = torch.tensor([[5, 6, 7, 8, 3, 3], [5, 9, 3, 3, 3, 3]])
    attention = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]])
    full, mask = padded_to(4, ids, attention, pad_id=1, left=True)
    assert full.tolist() == [[5, 6, 7, 8], [1, 1, 5, 9]] and mask.tolist() == [[1, 1, 1, 1], [0, 0, 1, 1]]


def test_the_image_processor_is_loaded_once_and_afresh_when_its_file_changes(siglip2, tmp_path):
    """The description reads the processor's figures and the preparation runs it: one load a worker."""
    import os
    import shutil

    from embedserve.handler.inputs.image import ImagePreparation
    from embedserve.handler.model.files import describe_model
    from embedserve.handler.model.image_processor import image_processor

    folder = tmp_path / "again"
    shutil.copytree(siglip2, folder)
    positions = describe_model(folder).towers.image_positions
    assert ImagePreparation(folder, positions).processor is image_processor(folder)
    config = folder / "preprocessor_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "max_num_patches": 64}))
    os.utime(config, ns=(config.stat().st_atime_ns, config.stat().st_mtime_ns + 1_000_000))
    assert image_processor(folder).max_num_patches == 64 == describe_model(folder).towers.image_positions
