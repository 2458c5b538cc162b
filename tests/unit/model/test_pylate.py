"""PyLate's ColBERT layout (embedserve/handler/model/pylate.py), read from answerai-colbert-small-v1's
published files as sentence-transformers 6's MultiVectorEncoder reads them; the vectors against it
in process and through TorchServe: tests/integration/test_published_served.py."""

from __future__ import annotations

import json
import string

import pytest

from embedserve.handler.model.description import ModelFilesError, MultiVector, QueryExpansion
from embedserve.handler.model.files import describe_model
from tests.support.published import PUBLISHED, make_published

SLUG = "answerai-colbert-small-v1"


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    return make_published(SLUG, tmp_path_factory.mktemp("pylate") / SLUG)


def edited(folder, tmp_path, **changes):
    import shutil

    copy = shutil.copytree(folder, tmp_path / "edited")
    config = json.loads((copy / "config_sentence_transformers.json").read_text())
    config.update(changes)
    (copy / "config_sentence_transformers.json").write_text(json.dumps({k: v for k, v in config.items()
                                                                        if v is not None or k not in changes}))
    return copy


def test_the_published_layout_reads_as_sentence_transformers_reads_it(published):
    model = describe_model(published)
    saved = json.loads((PUBLISHED / SLUG / "config_sentence_transformers.json").read_text())
    vectors = model.multi_vector
    assert model.task.value == "multi_vector" and model.prompts == {"query": "[unused0]", "document": "[unused1]"}
    assert vectors.expansion == QueryExpansion("fixed", 32, False) and vectors.query_length is None
    assert vectors.document_length == 300 and model.max_seq_length == 299  # per type, over max_seq_length
    assert vectors.skiplist_words == tuple(saved["skiplist_words"]) and vectors.skiplist_tasks == ("document",)
    assert vectors.similarity == "maxsim"  # its "MaxSim"
    assert [module.kind for module in model.head] == ["Dense", "Normalize"]


@pytest.mark.parametrize("changes, check", [
    ({"do_query_expansion": False}, lambda m, p: m.expansion is None and m.query_length == 32),
    ({"attend_to_expansion_tokens": True, "query_length": None}, lambda m, p: m.expansion == QueryExpansion(
        "fixed", 32, True)),
    ({"skiplist_words": None}, lambda m, p: m.skiplist_words == tuple(string.punctuation)),
    ({"prompts": {"query": "search: "}}, lambda m, p: p["query"] == "[unused0]search: "),
    ({"prompts": {"document": "[unused1]passage: "}}, lambda m, p: p["document"] == "[unused1]passage: "),
    ({"similarity_fn_name": None}, lambda m, p: m.similarity == "maxsim"),
])
def test_each_pylate_key_as_sentence_transformers_applies_it(published, tmp_path, changes, check):
    model = describe_model(edited(published, tmp_path, **changes))
    assert check(model.multi_vector, model.prompts)


def test_modules_beyond_the_transformer_and_dense_are_refused(published, tmp_path):
    folder = edited(published, tmp_path)
    modules = json.loads((folder / "modules.json").read_text())
    modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelFilesError, match=r"a PyLate ColBERT folder with modules \['Transformer', 'Dense', "
                                              r"'Normalize'\]"):
        describe_model(folder)


def test_the_longest_input_of_any_type():
    model = MultiVector(query_length=None, document_length=300, expansion=QueryExpansion("fixed", 32, False),
                        skiplist_words=(), skiplist_tasks=("document",), similarity="maxsim")
    assert model.longest(299) == 300 and model.longest(512) == 512
