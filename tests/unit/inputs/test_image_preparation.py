"""The image kind's chain, data URI to pixel values, against sentence-transformers' own `encode` of
the same PIL images through a tiny CLIP: what the server will feed the vision tower is what the
reference feeds it."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from embedserve.handler.inputs.image import ImageLimits, ImagePreparation, decode_image, read_image
from embedserve.handler.model.files import describe_model
from tests.support.image_models import CLIP_PUBLISHED, TINY_TOWER, make_clip
from tests.support.images import data_uri, image_file, photo


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return make_clip(tmp_path_factory.mktemp("clip") / "clip")


def test_data_uris_give_the_vectors_sentence_transformers_gives_their_images(clip_dir):
    from sentence_transformers import SentenceTransformer
    from transformers import CLIPModel

    pictures = [photo(300, 200), photo(64, 48).convert("L"), photo(500, 500).convert("P")]
    files = [image_file(pictures[0], "PNG"), image_file(pictures[1], "PNG"), image_file(pictures[2], "GIF")]
    uris = [data_uri(files[0]), data_uri(files[1]), data_uri(files[2], "image/gif")]
    decoded = [decode_image(read_image(uri, f"input[{i}]"), f"input[{i}]", ImageLimits())
               for i, uri in enumerate(uris)]
    preparation = ImagePreparation(clip_dir, describe_model(clip_dir).towers.image_positions)
    pixels = torch.stack([preparation.model_input(image).image for image in decoded])
    assert pixels.shape == (3, 3, 224, 224) and pixels.dtype == torch.float32
    assert preparation.positions == 49  # (224 / 32) ** 2 patches

    model = CLIPModel.from_pretrained(clip_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        ours = model.get_image_features(pixel_values=pixels)
        ours = getattr(ours, "pooler_output", ours).numpy()
    reference = SentenceTransformer(str(clip_dir), device="cpu")
    # The reference reads the files as a user's code does: PIL images opened from the same bytes.
    theirs = reference.encode([Image.open(io.BytesIO(data)) for data in files])
    cosine = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    assert cosine.min() >= 0.99999, cosine


def test_the_tiny_clip_keeps_every_published_value_but_its_size(clip_dir):
    published, made = (json.loads((folder / "config.json").read_text()) for folder in (CLIP_PUBLISHED, clip_dir))
    sized = {*TINY_TOWER, "vocab_size"}
    for tower in ("text_config", "vision_config"):
        assert {k: v for k, v in made[tower].items() if k not in sized} == \
            {k: v for k, v in published[tower].items() if k not in sized}
    assert {k: v for k, v in made.items() if k not in ("text_config", "vision_config", "projection_dim")} == \
        {k: v for k, v in published.items() if k not in ("text_config", "vision_config", "projection_dim")}
    assert (clip_dir / "preprocessor_config.json").read_bytes() == (CLIP_PUBLISHED / "preprocessor_config.json").read_bytes()
