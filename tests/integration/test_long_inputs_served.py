"""Long inputs through the real TorchServe of the session (the tiny model): "long_input": "chunk"
and "late_chunk" from the official `openai` client (`extra_body`), the native and TEI routes,
against the references of tests/support/long_inputs.py; a bad option is the request's own 400, and
a chunked request shares its batch with plain ones."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from tests.support.client import concurrently, predict
from tests.support.long_inputs import LONG, cosine, late_reference, reference

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def st_model(tiny_model_dir):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(tiny_model_dir), device="cpu")


def test_the_openai_client_gets_each_long_input_whole(server, st_model):
    client = openai.OpenAI(base_url=f"{server.url('inference')}/predictions/tiny/1.0/v1",
                           api_key=server.keys()["inference"], max_retries=0)
    result = client.embeddings.create(model="tiny", input=[LONG, "a short text"],
                                      extra_body={"long_input": "chunk", "chunk_overlap": 8})
    expected, windows = reference(st_model, LONG, 48, overlap=8)
    long, short = result.data
    assert cosine(long.embedding, expected) >= 0.99999
    assert (long.model_extra["windows"], short.model_extra["windows"]) == (windows, 1) and windows >= 5
    plain = client.embeddings.create(model="tiny", input=["a short text"])
    assert np.array_equal(np.float32(short.embedding), np.float32(plain.data[0].embedding))


def test_native_and_tei_routes_and_a_bad_option(server, st_model):
    expected, windows = reference(st_model, LONG, 48, prompt="document: ")
    native = predict(server, {"input": LONG, "long_input": "chunk", "prompt_name": "document"})
    assert native.status_code == 200 and native.json()["data"][0]["windows"] == windows
    assert cosine(native.json()["data"][0]["embedding"], expected) >= 0.99999
    tei = predict(server, {"inputs": [LONG], "long_input": "chunk", "prompt_name": "document"}, path="embed")
    assert tei.status_code == 200 and cosine(tei.json()[0], expected) >= 0.99999

    bad = predict(server, {"input": LONG, "long_input": "chunk", "chunk_overlap": 1000}, path="v1/embeddings")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chunk_overlap"


def test_a_chunked_request_shares_its_batch(server):
    bodies = [{"input": LONG, "long_input": "chunk"}, {"input": ["plain"]}, {"input": LONG, "long_input": "split"}]
    answers = concurrently([lambda b=b: predict(server, b, path="v1/embeddings") for b in bodies])
    assert [a.status_code for a in answers] == [200, 200, 400]
    assert answers[0].json()["data"][0]["windows"] >= 5


def test_late_chunks_from_the_openai_client_and_the_native_route(server, st_model):
    client = openai.OpenAI(base_url=f"{server.url('inference')}/predictions/tiny/1.0/v1",
                           api_key=server.keys()["inference"], max_retries=0)
    result = client.embeddings.create(model="tiny", input=[LONG, "a short text"],
                                      extra_body={"long_input": "late_chunk", "chunk_size": 12, "chunk_overlap": 6})
    expected = late_reference(st_model, LONG, 48, size=12, context=6)
    spans = [item for item in result.data if item.model_extra["input"] == 0]
    assert len(spans) == len(expected) >= 20 and result.data[-1].model_extra["input"] == 1
    for item, (vector, tokens, chars) in zip(spans, expected):
        assert cosine(item.embedding, vector) >= 0.99999
        assert (tuple(item.model_extra["tokens"]), tuple(item.model_extra["chars"])) == (tokens, chars)

    text = "The cat sat on the mat. It was warm there, and it slept."
    spans = [[0, 23], [24, 56]]
    native = predict(server, {"input": text, "long_input": "late_chunk", "chunk_spans": [spans],
                              "prompt_name": "document"})
    assert native.status_code == 200, native.text
    for item, (vector, _, chars) in zip(native.json()["data"], late_reference(st_model, text, 48, spans=spans,
                                                                              prompt="document: ")):
        assert cosine(item["embedding"], vector) >= 0.99999 and tuple(item["chars"]) == chars
    tei = predict(server, {"inputs": [text], "long_input": "late_chunk"}, path="embed")
    assert tei.status_code == 422 and "TEI's answer" in tei.json()["error"]
