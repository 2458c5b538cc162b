"""Late chunking ("long_input": "late_chunk") in process: a vector per span, each pooled from the
token states of its whole input (windows of the model's length for a longer one), against the
reference of tests/support/long_inputs.py (sentence-transformers' token vectors); caller spans,
prompts, token ids, bad options, limits, the cache, and spans of one window sharing one pass."""

from __future__ import annotations

import json

import numpy as np
import pytest

from embedserve.handler.api.exchange import RawRequest
from embedserve.handler.assembly import assemble
from embedserve.handler.settings import Settings
from tests.support.long_inputs import LONG, call, cosine, late_reference
from tests.support.tiny_model import make_tiny_model

SHORT = "The cat sat on the mat. It was warm there, and it slept."


def check(answer, expected, owner=0):
    items = [item for item in answer["data"] if item["input"] == owner]
    assert len(items) == len(expected)
    for item, (vector, tokens, chars) in zip(items, expected):
        assert cosine(item["embedding"], vector) >= 0.99999
        assert tuple(item["tokens"]) == tokens and (item["chars"] is None or tuple(item["chars"]) == chars)
    return items


def test_fixed_spans_of_one_pass(service, st_model):
    status, answer = call(service, "v1/embeddings", {"input": [SHORT, "short"], "long_input": "late_chunk",
                                                     "chunk_size": 4})
    assert status == 200, answer
    items = check(answer, late_reference(st_model, SHORT, service.text.max_length, size=4))
    assert len(items) >= 3 and [item["index"] for item in answer["data"]] == list(range(len(answer["data"])))
    assert SHORT[slice(*items[0]["chars"])].startswith("The")
    check(answer, late_reference(st_model, "short", service.text.max_length, size=4), owner=1)
    # A span's vector is not its text embedded alone: its context changed it.
    _, alone = call(service, "v1/embeddings", {"input": SHORT[slice(*items[1]["chars"])]})
    assert cosine(alone["data"][0]["embedding"], items[1]["embedding"]) < 0.9999
    # usage: the one pass's tokens, not a pass per span
    assert answer["usage"]["prompt_tokens"] == len(st_model.tokenizer(SHORT)["input_ids"]) + 3


@pytest.mark.parametrize("context", [0, 9])
def test_a_long_input_is_windows_holding_whole_spans(service, st_model, context):
    max_length = service.text.max_length
    expected = late_reference(st_model, LONG, max_length, size=10, context=context)
    status, answer = call(service, "", {"input": LONG, "long_input": "late_chunk", "chunk_size": 10,
                                        "chunk_overlap": context})
    assert status == 200, answer
    check(answer, expected)
    assert len(expected) >= 20


def test_caller_spans_and_a_prompt(service, st_model):
    spans = [[0, 23], [24, 56], [4, 30]]  # sentences, and one across them
    expected = late_reference(st_model, SHORT, service.text.max_length, spans=spans, prompt="query: ")
    status, answer = call(service, "v1/embeddings", {"input": [SHORT], "long_input": "late_chunk",
                                                     "chunk_spans": [spans], "prompt_name": "query"})
    assert status == 200, answer
    check(answer, expected)


def test_token_ids_dimensions_and_dtypes(service, st_model):
    ids = st_model.tokenizer(SHORT, add_special_tokens=False)["input_ids"]
    status, answer = call(service, "v1/embeddings", {"input": [ids], "long_input": "late_chunk", "chunk_size": 5,
                                                     "dimensions": 8})
    assert status == 200, answer
    assert all(item["chars"] is None and len(item["embedding"]) == 8 for item in answer["data"])
    status, answer = call(service, "", {"input": SHORT, "long_input": "late_chunk", "output_dtype": "int8"})
    assert status == 200 and len(answer["data"]) == 1


@pytest.mark.parametrize("body, status, param, words", [
    ({"chunk_size": 0}, 400, "chunk_size", "positive integer"),
    ({"chunk_size": 47}, 400, "chunk_size", "at most 44"),
    ({"chunk_spans": [[[0, 4]]]}, 400, "chunk_spans", "applies to"),
    ({"long_input": "late_chunk", "chunk_spans": [[[5, 2]]]}, 400, "chunk_spans[0][0]", "start < end"),
    ({"long_input": "late_chunk", "chunk_spans": [[[-1, 2]]]}, 400, "chunk_spans[0][0]", "non-negative"),
    ({"long_input": "late_chunk", "chunk_spans": [[[0, 4]], [[0, 1]]]}, 400, "chunk_spans", "one per input"),
    ({"long_input": "late_chunk", "chunk_spans": "x"}, 400, "chunk_spans", "non-empty list"),
    ({"long_input": "late_chunk", "chunk_spans": [[[0, 100000]]]}, 400, "chunk_spans[0][0]", "past the end"),
    ({"long_input": "late_chunk", "chunk_spans": [[[0, 200]]]}, 400, "chunk_spans[0][0]", "must fit one window"),
])
def test_bad_options_are_refused_naming_the_field(service, body, status, param, words):
    got, answer = call(service, "v1/embeddings", {"input": LONG, **body})
    assert got == status, answer
    assert answer["error"]["param"] == param and words in answer["error"]["message"], answer


def test_tei_routes_refuse_late_chunking_and_others_of_the_batch_succeed(service):
    bodies = [({"inputs": [SHORT], "long_input": "late_chunk"}, "embed"),
              ({"input": SHORT, "long_input": "late_chunk"}, "v1/embeddings"), ({"input": "plain"}, "v1/embeddings")]
    raws = [RawRequest(json.dumps(b).encode(), "application/json", r) for b, r in bodies]
    answers = service.handle(raws)
    assert [a.status for a in answers] == [422, 200, 200]
    assert "TEI's answer" in json.loads(answers[0].body)["error"]


def test_cls_pooling_is_refused_with_the_reason(tmp_path):
    svc = assemble(make_tiny_model(tmp_path / "cls", pooling="cls"), Settings(dtype="float32"), model_name="cls",
                   warm=False)
    status, answer = call(svc, "v1/embeddings", {"input": SHORT, "long_input": "late_chunk"})
    assert status == 400 and answer["error"]["param"] == "long_input" and "pools cls" in answer["error"]["message"]


def test_spans_count_in_the_limits_and_are_cached_apart(tiny_model_dir):
    small = assemble(tiny_model_dir, Settings(dtype="float32", max_tokens_per_request=200), model_name="tiny",
                     warm=False)
    status, answer = call(small, "v1/embeddings", {"input": LONG, "long_input": "late_chunk", "chunk_size": 40})
    assert status == 413 and "max_tokens_per_request=200" in answer["error"]["message"]
    cached = assemble(tiny_model_dir, Settings(dtype="float32", cache_entries=1000), model_name="tiny", warm=False)
    raw = RawRequest(json.dumps({"input": SHORT, "long_input": "late_chunk", "chunk_size": 3}).encode(),
                     "application/json", "v1/embeddings")
    [first], _ = cached.handle_with_report([raw])
    [second], report = cached.handle_with_report([raw])
    vectors = [item["embedding"] for item in json.loads(first.body)["data"]]
    assert second.body == first.body and report.cache_misses == 0
    assert len({tuple(np.round(v, 6)) for v in vectors}) == len(vectors) >= 5  # spans of one window, each its own


def test_the_document_says_where_late_chunking_applies(service, tmp_path):
    import jsonschema

    schemas = service.openapi()["components"]["schemas"]
    embed = {"$defs": schemas, **schemas["EmbeddingRequest"]}
    embed = json.loads(json.dumps(embed).replace("#/components/schemas/", "#/$defs/"))
    valid = jsonschema.Draft202012Validator(embed).is_valid
    assert valid({"input": "a", "long_input": "late_chunk", "chunk_spans": [[[0, 1]]], "chunk_size": 44})
    assert not valid({"input": "a", "chunk_spans": [[[0, 1]]]}) and not valid({"input": "a", "chunk_size": 45})
    tei = schemas["TEIEmbedRequest"]["properties"]
    assert "late_chunk" not in tei["long_input"]["enum"] and tei["chunk_spans"] == {
        "type": "null", "description": "late chunking's: not on this route"}
    cls = assemble(make_tiny_model(tmp_path / "cls", pooling="cls"), Settings(dtype="float32"), model_name="cls",
                   warm=False)
    assert cls.openapi()["components"]["schemas"]["EmbeddingRequest"]["properties"]["long_input"]["enum"] == [
        "truncate", "chunk", None]


@pytest.mark.parametrize("engine", ["onnxruntime", "openvino"])
def test_the_cpu_engines_late_chunk_as_torch_does(onnx_model_dir, st_model, engine):
    """The default build's CPU engines run the shared passes too: the same spans, the same vectors."""
    pytest.importorskip(engine)
    svc = assemble(onnx_model_dir, Settings(dtype="float32", engine=engine), model_name="tiny", warm=False)
    assert svc.info()["engine"] == engine
    status, answer = call(svc, "v1/embeddings", {"input": [SHORT, LONG[:400]], "long_input": "late_chunk",
                                                 "chunk_size": 6})
    assert status == 200, answer
    check(answer, late_reference(st_model, SHORT, svc.text.max_length, size=6))
    check(answer, late_reference(st_model, LONG[:400], svc.text.max_length, size=6), owner=1)


def test_packed_passes_late_chunk_as_padded_ones_do(tiny_model_dir, st_model):
    """Packed passes (a GPU worker's default, run here on the CPU) pack each window once and pool
    its spans from it, as padded passes do."""
    svc = assemble(tiny_model_dir, Settings(dtype="float32", packed=True), model_name="tiny", warm=False)
    assert svc.info()["layout"] == "packed"
    status, answer = call(svc, "v1/embeddings", {"input": [SHORT, LONG[:400], "plain"], "long_input": "late_chunk",
                                                 "chunk_size": 5, "chunk_overlap": 4})
    assert status == 200, answer
    for owner, text in enumerate([SHORT, LONG[:400], "plain"]):
        check(answer, late_reference(st_model, text, svc.text.max_length, size=5, context=4), owner=owner)


def test_many_ranges_are_refused_by_the_answer_size_before_any_work(service):
    """A body's worth of ranges costs binary searches, and its answer's size is checked first."""
    text = LONG[:5000]
    ranges = [[i, i + 40] for i in range(0, 4960, 20)]  # 248 overlapping ranges, each holding tokens
    status, answer = call(service, "v1/embeddings", {"input": text, "long_input": "late_chunk",
                                                     "chunk_spans": [ranges * 400]})  # far over the answer's bound
    assert status == 413 and "max_response_bytes" in answer["error"]["message"], answer
    status, answer = call(service, "v1/embeddings", {"input": text, "long_input": "late_chunk",
                                                     "chunk_spans": [ranges], "encoding_format": "base64"})
    assert status == 200 and len(answer["data"]) == 248
