"""The fixtures that stand for published models are the published files (tests/fixtures/published/,
tests/support/published.py): each file's source is recorded, and a model made from them changes
only the size fields, the module widths and the tokenizer's vocabulary ids."""

from __future__ import annotations

import hashlib
import json

import pytest

from tests.support.published import (EMBEDDERS, MULTI_VECTOR, PUBLISHED, REFUSED, RERANKERS, SIZES,
                                     make_published, published_files)

SLUGS = sorted(p.name for p in PUBLISHED.iterdir() if p.is_dir())


@pytest.mark.parametrize("slug", SLUGS)
def test_every_published_file_names_where_it_came_from(slug):
    sources = json.loads((PUBLISHED / slug / "SOURCES.json").read_text())
    assert sources["model"]
    for file in published_files(slug):
        relative = str(file.relative_to(PUBLISHED / slug))
        entry = sources["files"][relative]
        # A copy names its repository and path; a file rebuilt from the published facts names the
        # published sha256, which it must have.
        assert (entry["repo"] and entry["path"]) or hashlib.sha256(file.read_bytes()).hexdigest() in entry["note"], \
            relative
        json.loads(file.read_text())  # each is the JSON its model ships


@pytest.mark.parametrize("slug", (*EMBEDDERS, *RERANKERS, *MULTI_VECTOR, *REFUSED))
def test_a_model_made_from_published_files_keeps_every_published_value_but_its_size(slug, tmp_path):
    made = make_published(slug, tmp_path / slug)
    published, config = (json.loads((folder / "config.json").read_text()) for folder in (PUBLISHED / slug, made))
    changed = {key for key in published if published[key] != config[key]}
    assert changed <= {*SIZES[slug], "layer_types"} and set(config) == set(published) | set(SIZES[slug])
    for name in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json",
                 "special_tokens_map.json"):
        if (PUBLISHED / slug / name).is_file():
            assert (made / name).read_bytes() == (PUBLISHED / slug / name).read_bytes(), name
    tokenizer = json.loads((PUBLISHED / slug / "tokenizer_config.json").read_text())
    tokenizer.pop("added_tokens_decoder", None)  # ids into the published vocabulary, not the one made here
    assert json.loads((made / "tokenizer_config.json").read_text()) == tokenizer
