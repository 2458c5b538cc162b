"""Every request option and limit, through the engine in-process (the server tests repeat the key ones)."""

import base64
import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from embedserve.handler.api.quantize import quantize
from embedserve.handler.api.exchange import RawRequest
from tests.support.engines import TEXTS, float64_reference, make_engine
from tests.support.tiny_model import PROMPTS, make_tiny_model


def call(engine, body, url_path=""):
    [response] = engine.handle([RawRequest(json.dumps(body).encode(), "application/json", url_path)])
    return response.status, json.loads(response.body)


def ok(engine, body, url_path=""):
    status, answer = call(engine, body, url_path)
    assert status == 200, answer
    return answer


def vectors_of(answer) -> np.ndarray:
    rows = answer if isinstance(answer, list) else [d["embedding"] for d in answer["data"]]
    return np.array(rows)


# --- TEI shape -------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["embed", ""])
def test_tei_body_answers_a_bare_list(tiny_engine, tiny_model_dir, path):
    answer = ok(tiny_engine, {"inputs": TEXTS}, path)
    assert isinstance(answer, list) and len(answer) == len(TEXTS)
    np.testing.assert_allclose(vectors_of(answer), float64_reference(tiny_model_dir, TEXTS), atol=2e-5)


def test_tei_single_string_and_normalize_false(tiny_engine, tiny_model_dir):
    answer = ok(tiny_engine, {"inputs": "hello world", "normalize": False}, "embed")
    want = float64_reference(tiny_model_dir, ["hello world"], normalize=False)
    np.testing.assert_allclose(vectors_of(answer), want, atol=2e-5)


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        ({"inputs": "x", "dimensions": 33}, 422, "dimension 32"),
        ({"inputs": "x", "prompt_name": "passage"}, 422, "known: document, query"),
        ({"inputs": "x", "normalize": False, "output_dtype": "int8"}, 422, "normalized"),
        ({"inputs": [], "truncate": True}, 400, "empty list"),
        ({"inputs": ["x"] * 5000}, 413, "max_inputs_per_request=4096"),
    ],
)
def test_tei_error_statuses_and_shape(tiny_engine, body, status, fragment):
    got, answer = call(tiny_engine, body, "embed")
    assert got == status
    assert set(answer) == {"error", "error_type"} and fragment in answer["error"]


def test_same_problems_are_400_on_openai_routes(tiny_engine):
    status, answer = call(tiny_engine, {"input": "x", "prompt_name": "passage"}, "v1/embeddings")
    assert status == 400 and answer["error"]["param"] == "prompt_name"


# --- /tokenize and /info -----------------------------------------------------------------------

def test_tokenize_gives_ids_and_character_offsets(tiny_engine, tiny_model_dir):
    text = "Hello 漢字 world"
    [tokens] = ok(tiny_engine, {"inputs": [text]}, "tokenize")
    expected = AutoTokenizer.from_pretrained(tiny_model_dir)(text)["input_ids"]
    assert [t["id"] for t in tokens] == expected
    assert tokens[0]["special"] and tokens[-1]["special"] and tokens[0]["start"] is None
    for token in tokens[1:-1]:
        assert not token["special"]
        assert text[token["start"] : token["stop"]].lower() == token["text"].removeprefix("##")


def test_tokenize_without_special_tokens_and_with_a_prompt(tiny_engine):
    [tokens] = ok(tiny_engine, {"inputs": "hello", "add_special_tokens": False, "prompt_name": "query"},
                  "tokenize")
    assert [t["text"] for t in tokens] == ["query", ":", "hello"]


def test_info_reports_model_and_limits(tiny_engine):
    [response] = tiny_engine.handle([RawRequest(None, None, "info")])  # a GET: no body
    assert response.status == 200
    info = json.loads(response.body)
    assert info["embedding_dimension"] == 32 and info["max_input_length"] == 48
    assert info["pooling"] == "mean" and info["model_dtype"] == "float32" and info["device"] == "cpu"
    assert info["prompts"] == PROMPTS
    assert info["max_client_batch_size"] == 4096 and info["max_input_chars"] == 100_000
    assert info["max_tokens_per_request"] == 1_048_576
    assert "binary" in info["output_dtypes"] and info["auto_truncate"] is True


# --- OpenAI options ---------------------------------------------------------------------------

def test_pre_tokenized_input_equals_the_text(tiny_engine, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS[:3]]
    from_ids = vectors_of(ok(tiny_engine, {"input": ids}, "v1/embeddings"))
    from_text = vectors_of(ok(tiny_engine, {"input": TEXTS[:3]}, "v1/embeddings"))
    np.testing.assert_allclose(from_ids, from_text, atol=1e-6)
    single = vectors_of(ok(tiny_engine, {"input": ids[0]}, "v1/embeddings"))
    np.testing.assert_allclose(single[0], from_text[0], atol=1e-6)


def test_token_ids_outside_the_vocabulary_are_refused(tiny_engine):
    status, answer = call(tiny_engine, {"input": [[5, 6], [7, 10**6]]}, "v1/embeddings")
    assert status == 400 and answer["error"]["param"] == "input[1][1]"
    assert "outside the vocabulary" in answer["error"]["message"]


@pytest.mark.parametrize("dimensions", [None, 8, 17])
@pytest.mark.parametrize("output_dtype", ["float", "int8", "uint8", "binary", "ubinary"])
@pytest.mark.parametrize("encoding_format", ["float", "base64"])
@pytest.mark.parametrize("path", ["v1/embeddings", ""])
def test_output_dtypes_with_dimensions_and_base64(tiny_engine, tiny_model_dir, dimensions, output_dtype,
                                                   encoding_format, path):
    body = {"input": TEXTS, "output_dtype": output_dtype, "encoding_format": encoding_format}
    if dimensions:
        body["dimensions"] = dimensions
    answer = ok(tiny_engine, body, path)
    full = float64_reference(tiny_model_dir, TEXTS, normalize=False)[:, : dimensions or 32]
    reference = (full / np.linalg.norm(full, axis=1, keepdims=True)).astype(np.float32)
    want = quantize(reference, output_dtype)
    rows = [d["embedding"] for d in answer["data"]]
    if encoding_format == "base64":
        # The OpenAI route sends every value as float32, as OpenAI clients decode it; the native
        # route sends codes compactly, one byte each.
        dtype = {"float": "<f4", "int8": np.int8, "uint8": np.uint8, "binary": np.int8, "ubinary": np.uint8}
        dtype = "<f4" if path == "v1/embeddings" else dtype[output_dtype]
        got = np.stack([np.frombuffer(base64.b64decode(r), dtype) for r in rows])
    else:
        got = np.array(rows)
    assert got.shape == want.shape
    if output_dtype == "float":
        np.testing.assert_allclose(got, want, atol=2e-5)
    elif output_dtype in ("int8", "uint8"):  # a value on a bin edge may land one step over
        assert np.abs(got.astype(int) - want.astype(int)).max() <= 1
    else:
        np.testing.assert_array_equal(got, want)


def test_quantized_outputs_on_the_tei_route(tiny_engine):
    answer = ok(tiny_engine, {"inputs": TEXTS[:2], "output_dtype": "ubinary"}, "embed")
    assert np.array(answer).shape == (2, 4)


# --- prompts ----------------------------------------------------------------------------------

def test_prompt_name_prepends_the_prompt_and_counts_its_tokens(tiny_engine, tiny_model_dir):
    prompted = ok(tiny_engine, {"input": ["the cat sat"], "prompt_name": "query"})
    manual = ok(tiny_engine, {"input": ["query: the cat sat"]})
    np.testing.assert_allclose(vectors_of(prompted), vectors_of(manual), atol=1e-6)
    plain = ok(tiny_engine, {"input": ["the cat sat"]})
    assert prompted["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] + 2  # "query", ":"


def test_default_prompt_name_and_the_prompt_setting(tmp_path, tiny_engine):
    # Same weights as the shared tiny model (same seed), but "query" is the default prompt.
    model = make_tiny_model(tmp_path / "m", prompts=PROMPTS, default_prompt_name="query")
    by_default = ok(make_engine(model), {"input": ["the cat"]})
    written_out = ok(tiny_engine, {"input": ["query: the cat"]})
    np.testing.assert_allclose(vectors_of(by_default), vectors_of(written_out), atol=1e-6)
    with_setting = ok(make_engine(model, prompt="document: "), {"input": ["the cat"]})
    as_document = ok(tiny_engine, {"input": ["document: the cat"]})
    np.testing.assert_allclose(vectors_of(with_setting), vectors_of(as_document), atol=1e-6)
    named = ok(make_engine(model, prompt="document: "), {"input": ["the cat"], "prompt_name": "query"})
    np.testing.assert_allclose(vectors_of(named), vectors_of(written_out), atol=1e-6)


# --- truncation and limits --------------------------------------------------------------------

LONG = " ".join(["token"] * 100)  # 102 tokens with [CLS]/[SEP]; the tiny model's limit is 48


def test_truncation_on_by_default_and_refusable(tiny_engine):
    assert ok(tiny_engine, {"input": ["short", LONG]})["usage"]["prompt_tokens"] == 3 + 48
    status, answer = call(tiny_engine, {"input": ["short", LONG], "truncate": False})
    assert status == 413
    assert answer["error"]["param"] == "input[1]"
    assert "102 tokens" in answer["error"]["message"] and "limit is 48" in answer["error"]["message"]


def test_truncation_off_by_setting(tiny_model_dir):
    engine = make_engine(tiny_model_dir, truncate=False)
    assert call(engine, {"input": LONG})[0] == 413
    assert call(engine, {"input": LONG, "truncate": True})[0] == 200


def test_left_truncation_keeps_the_end(tiny_engine, tiny_model_dir):
    text = "hello " * 30 + "red green blue " * 10
    left = ok(tiny_engine, {"input": text, "truncation_direction": "left"})
    assert left["usage"]["prompt_tokens"] == 48
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, truncation_side="left")
    kept = tokenizer(text, truncation=True, max_length=48)["input_ids"]  # [CLS] ...last 46... [SEP]
    assert kept[1:-1] == tokenizer(text, add_special_tokens=False)["input_ids"][-46:]
    from_ids = ok(tiny_engine, {"input": kept[1:-1]})
    np.testing.assert_allclose(vectors_of(left), vectors_of(from_ids), atol=1e-6)
    right = ok(tiny_engine, {"input": text})
    assert not np.allclose(vectors_of(left), vectors_of(right))


@pytest.mark.parametrize(
    "settings, body, param, fragment",
    [
        ({"max_inputs_per_request": 3}, {"input": ["a"] * 4}, "input", "max_inputs_per_request=3"),
        ({"max_input_chars": 10}, {"input": ["short", "x" * 11]}, "input[1]", "max_input_chars=10"),
        ({"max_tokens_per_request": 10}, {"input": ["hello world"] * 3}, "input", "max_tokens_per_request=10"),
    ],
)
def test_limits_are_413_naming_the_limit(tiny_model_dir, settings, body, param, fragment):
    status, answer = call(make_engine(tiny_model_dir, **settings), body)
    assert status == 413
    assert answer["error"]["param"] == param and fragment in answer["error"]["message"]


def test_two_thousand_texts_come_back_in_order(tiny_engine, tiny_model_dir):
    texts = [f"{TEXTS[i % len(TEXTS)]} {i}" for i in range(2000)]
    got = vectors_of(ok(tiny_engine, {"input": texts}))
    assert got.shape == (2000, 32)
    sample = list(range(0, 2000, 97))
    np.testing.assert_allclose(got[sample], float64_reference(tiny_model_dir, [texts[i] for i in sample]),
                               atol=2e-5)


# --- Jina's item objects ------------------------------------------------------------------------

def test_text_objects_are_the_plain_texts_vectors_on_a_text_model(tiny_engine):
    """A text model takes Jina's {"text": ...} objects beside plain texts: the same vectors, in
    order; an image object, or "modality" beside objects, is refused naming the field."""
    plain = vectors_of(ok(tiny_engine, {"input": TEXTS}, "v1/embeddings"))
    items = [{"text": text} if i % 2 else text for i, text in enumerate(TEXTS)]
    np.testing.assert_array_equal(vectors_of(ok(tiny_engine, {"input": items}, "v1/embeddings")), plain)
    np.testing.assert_array_equal(vectors_of(ok(tiny_engine, {"input": items})), plain)  # the native route
    status, answer = call(tiny_engine, {"input": [{"text": "a"}, {"image": "iVBORw0KGgo="}]}, "v1/embeddings")
    assert status == 400 and answer["error"]["param"] == "input[1].image" and "reads texts" in answer["error"]["message"]
    status, answer = call(tiny_engine, {"input": [{"text": "a"}], "modality": "text"}, "v1/embeddings")
    assert status == 400 and answer["error"]["param"] == "modality"
    status, answer = call(tiny_engine, {"inputs": [{"text": "a"}]}, "embed")  # TEI's routes take strings
    assert status in (400, 422) and "input" in json.dumps(answer)
