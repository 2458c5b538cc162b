"""The engine end to end in-process: tokenize, sub-batch, forward, pool, split, encode."""

import json

import numpy as np
import pytest
import torch

from embedserve.handler.assembly import warm_up
from embedserve.handler.model.inputs import plain_inputs
from embedserve.handler.api.exchange import RawRequest
from tests.support.engines import TEXTS, float64_reference, make_engine
from tests.support.faults import FaultInjection
from tests.support.parts import torch_model, with_faults


def embed(engine, body, url_path="", content_type="application/json"):
    [response] = engine.handle([RawRequest(json.dumps(body).encode(), content_type, url_path)])
    assert response.status == 200, response.body
    return json.loads(response.body)


def vectors_of(body) -> np.ndarray:
    return np.array([d["embedding"] for d in body["data"]])


def test_matches_float64_reference(tiny_engine, tiny_model_dir):
    got = vectors_of(embed(tiny_engine, {"input": TEXTS}))
    want = float64_reference(tiny_model_dir, TEXTS)
    np.testing.assert_allclose(got, want, atol=2e-5)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_usage_counts_tokens_after_truncation(tiny_engine):
    body = embed(tiny_engine, {"input": [TEXTS[3], "hello world"]})
    # 48 (truncated, with [CLS]/[SEP]) + 4 ([CLS] hello world [SEP])
    assert body["usage"] == {"prompt_tokens": 52, "total_tokens": 52}


def test_split_restores_each_request_in_order(tiny_engine, tiny_model_dir):
    requests = [RawRequest({"input": TEXTS[:2]}), RawRequest({"input": TEXTS[2]}), RawRequest({"input": TEXTS[3:]})]
    responses = tiny_engine.handle(requests)
    assert [r.status for r in responses] == [200, 200, 200]
    got = np.concatenate([vectors_of(json.loads(r.body)) for r in responses])
    np.testing.assert_allclose(got, float64_reference(tiny_model_dir, TEXTS), atol=2e-5)


def test_many_texts_across_sub_batches_equal_one_at_a_time(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_batch_tokens=64, max_batch_size=4)
    texts = [" ".join(["token"] * (i % 37 + 1)) + f" {i}" for i in range(300)]
    body = embed(engine, {"input": texts})
    assert [d["index"] for d in body["data"]] == list(range(300))
    singles = np.concatenate([vectors_of(embed(engine, {"input": t})) for t in texts[:20]])
    np.testing.assert_allclose(vectors_of(body)[:20], singles, atol=1e-5)


def test_encoder_counts_real_and_padded_tokens(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_batch_tokens=64, max_batch_size=4, pass_overhead_tokens=32)
    ids = [[2] * n for n in (3, 10, 4, 9, 30)]
    embedded = engine.encoder.embed(plain_inputs(ids))
    assert embedded.real_tokens == 56
    # Sorted 30, 10, 9, 4, 3: [30] alone, then [10, 9, 4, 3] padded to 10. Cutting after 10
    # instead ([30, 10] padded to 30, [9, 4, 3] to 9) is also two passes but pads 87 tokens.
    assert embedded.passes == 2 and embedded.padded_tokens == 30 + 40
    assert embedded.vectors.shape == (5, 32)


def test_bad_requests_fail_alone(tiny_engine, tiny_model_dir):
    requests = [
        RawRequest({"input": TEXTS[0]}),
        RawRequest(b'{"input": [1, 2', "application/json"),
        RawRequest({"input": []}),
        RawRequest({"input": TEXTS[1]}, url_path="v1/embeddings"),
        RawRequest({"input": "x"}, url_path="nope"),
        RawRequest({"input": "x", "dimensions": 33}),
    ]
    responses = tiny_engine.handle(requests)
    assert [r.status for r in responses] == [200, 400, 400, 200, 404, 400]
    want = float64_reference(tiny_model_dir, TEXTS[:2])
    np.testing.assert_allclose(vectors_of(json.loads(responses[0].body))[0], want[0], atol=2e-5)
    np.testing.assert_allclose(vectors_of(json.loads(responses[3].body))[0], want[1], atol=2e-5)
    assert json.loads(responses[5].body)["error"]["param"] == "dimensions"
    assert all(r.headers["x-batch-size"] == "6" for r in responses)


def test_only_bad_requests(tiny_engine):
    responses = tiny_engine.handle([RawRequest(None), RawRequest(b"{")])
    assert [r.status for r in responses] == [400, 400]


def test_matryoshka_dimensions_are_renormalized(tiny_engine, tiny_model_dir):
    body = embed(tiny_engine, {"input": TEXTS[:3], "dimensions": 8})
    got = vectors_of(body)
    full = float64_reference(tiny_model_dir, TEXTS[:3], normalize=False)[:, :8]
    np.testing.assert_allclose(got, full / np.linalg.norm(full, axis=1, keepdims=True), atol=2e-5)


def test_text_plain_and_base64(tiny_engine, tiny_model_dir):
    [plain] = tiny_engine.handle([RawRequest("the cat sat on the mat".encode(), "text/plain")])
    b64 = embed(tiny_engine, {"input": "the cat sat on the mat", "encoding_format": "base64"}, "v1/embeddings")
    decoded = np.frombuffer(__import__("base64").b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vectors_of(json.loads(plain.body))[0], decoded, atol=1e-6)


@pytest.mark.parametrize("pooling", ["cls", "last_token"])
def test_pooling_setting_overrides_the_model_files(tiny_model_dir, pooling):
    engine = make_engine(tiny_model_dir, pooling=pooling)
    got = vectors_of(embed(engine, {"input": TEXTS}))
    np.testing.assert_allclose(got, float64_reference(tiny_model_dir, TEXTS, pooling=pooling), atol=2e-5)


def test_normalize_off_and_max_length_setting(tiny_model_dir):
    engine = make_engine(tiny_model_dir, normalize=False, max_length=8)
    got = vectors_of(embed(engine, {"input": TEXTS}))
    want = float64_reference(tiny_model_dir, TEXTS, max_length=8, normalize=False)
    np.testing.assert_allclose(got, want, atol=2e-5)
    assert not np.allclose(np.linalg.norm(got, axis=1), 1.0)


def test_max_length_beyond_position_embeddings_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="'max_length'"):
        make_engine(tiny_model_dir, max_length=4096)


def test_int8_mode_quantizes_all_but_the_kept_layers(tiny_model_dir):
    keep = ["encoder.layer.0.output.dense"]
    engine = make_engine(tiny_model_dir, dtype="int8", int8_fp32_layers=keep)
    modules = dict(torch_model(engine.encoder).named_modules())
    assert isinstance(modules[keep[0]], torch.nn.Linear)
    assert not isinstance(modules["encoder.layer.1.output.dense"], torch.nn.Linear)  # a dynamic int8 Linear
    got = vectors_of(embed(engine, {"input": TEXTS}))
    want = float64_reference(tiny_model_dir, TEXTS)
    assert ((got * want).sum(1) > 0.97).all()


def test_int8_refuses_unknown_layers(tiny_model_dir):
    with pytest.raises(ValueError, match="no such Linear layer"):
        make_engine(tiny_model_dir, dtype="int8", int8_fp32_layers=["encoder.layer.9.nope"])


@pytest.mark.parametrize("body, param", [
    (b'{"input": ["fine", "a\\ud800b"]}', "input[1]"),
    (b'{"input": "x", "prompt_name": "\\udfff"}', "prompt_name"),
    (b'{"input": "x", "\\ud800": 1}', "body"),
])
def test_unpaired_surrogates_are_refused_naming_where(tiny_engine, body, param):
    [response] = tiny_engine.handle([RawRequest(body, "application/json", "")])
    assert response.status == 400 and json.loads(response.body)["error"]["param"] == param
    assert embed(tiny_engine, {"input": "\U0001f600 paired surrogates are fine"})["data"]


def test_an_unexpected_failure_fails_only_its_request(tiny_model_dir, monkeypatch):
    engine = make_engine(tiny_model_dir)

    def broken(texts, add_special_tokens):
        raise KeyError("a bug")

    monkeypatch.setattr(engine.text.tokenizer, "tokens", broken)
    responses = engine.handle([RawRequest(b'{"inputs": "x"}', "application/json", "tokenize"),
                               RawRequest(b'{"input": "y"}', "application/json", "")])
    assert [r.status for r in responses] == [500, 200]
    assert json.loads(responses[0].body) == {"error": "the server failed to prepare this request; the failure is "
                                                      "logged", "error_type": "Backend"}



def test_a_bug_in_an_embedding_request_s_checks_fails_only_its_request(tiny_model_dir, monkeypatch):
    engine = make_engine(tiny_model_dir)
    prompt = engine.text.prompt

    def broken(name):
        if name == "query":
            raise KeyError("a bug")
        return prompt(name)

    monkeypatch.setattr(engine.text, "prompt", broken)
    responses = engine.handle([RawRequest(b'{"input": "x", "prompt_name": "query"}', "application/json", ""),
                               RawRequest(b'{"input": "y"}', "application/json", "")])
    assert [r.status for r in responses] == [500, 200]
    assert json.loads(responses[0].body)["error"]["code"] == "internal_error"


def test_warmup_measures_what_a_forward_pass_costs(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_batch_tokens=512)
    assert engine.info()["pass_overhead_tokens"] == 32  # the default until measured
    warm_up(engine.encoder, engine.text)
    measured = engine.info()["pass_overhead_tokens"]
    assert 1 <= measured <= 512
    assert engine.encoder.pass_overhead_tokens == measured


def test_a_set_pass_cost_is_kept_through_warmup(tiny_model_dir):
    engine = make_engine(tiny_model_dir, pass_overhead_tokens=5000)
    warm_up(engine.encoder, engine.text)
    assert engine.encoder.pass_overhead_tokens == 5000
    # At that price the planner fills passes to the budget: 40 texts of up to 8 tokens in one.
    assert engine.encoder.embed(plain_inputs([[2] * (1 + i % 8) for i in range(40)])).passes == 1


def test_requests_that_differ_in_dimensions_and_normalize_share_a_batch(tiny_engine):
    bodies = [{"input": TEXTS[:3], "dimensions": 8}, {"input": TEXTS[3:]}, {"input": TEXTS[:2], "normalize": False},
              {"input": TEXTS[2:4], "dimensions": 8, "normalize": False}, {"input": TEXTS, "dimensions": 16},
              {"input": TEXTS[4:], "dimensions": 8}]
    responses = tiny_engine.handle([RawRequest(json.dumps(b).encode(), "application/json") for b in bodies])
    for body, response in zip(bodies, responses):
        got = vectors_of(json.loads(response.body))
        np.testing.assert_allclose(got, vectors_of(embed(tiny_engine, body)), atol=1e-6)  # as if alone
        assert got.shape[1] == body.get("dimensions", 32)
        norms = np.linalg.norm(got, axis=1)
        if body.get("normalize", True):
            np.testing.assert_allclose(norms, 1.0, atol=1e-5)
        else:
            assert not np.allclose(norms, 1.0, atol=1e-3)


# --- packed passes (embedserve/handler/backends/packed.py through the encoder) ---------------------------------------

def test_packed_passes_give_the_padded_vectors_and_compute_no_padding(tiny_model_dir):
    padded, packed = make_engine(tiny_model_dir), make_engine(tiny_model_dir, packed=True)
    assert packed.info()["layout"] == "packed" and padded.info()["layout"] == "padded"
    texts = [*TEXTS, "a", "hello " * 60]  # one input over max_length: truncated alike
    for body in ({"input": texts}, {"input": texts, "prompt_name": "query"}, {"input": texts, "dimensions": 8}):
        [ours], [expected] = packed.handle([RawRequest(body)]), padded.handle([RawRequest(body)])
        ours, expected = (np.array([d["embedding"] for d in json.loads(r.body)["data"]]) for r in (ours, expected))
        assert (ours * expected).sum(axis=1).min() >= 0.9999, body
    embedded = packed.encoder.embed(plain_inputs(packed.text.token_ids(texts)))
    assert embedded.padded_tokens == embedded.real_tokens


def test_packed_passes_fall_back_to_padded_where_unsupported_or_unverified(families, tiny_model_dir, monkeypatch,
                                                                         caplog):
    with caplog.at_level("WARNING"):
        assert make_engine(families["qwen3"], packed=True).info()["layout"] == "padded"
    assert "packed passes unavailable for this model: Qwen3Model is not one of" in caplog.text
    caplog.clear()
    from embedserve.handler.model.packed_forward import PackedTransformer

    real = PackedTransformer.__call__
    monkeypatch.setattr(PackedTransformer, "__call__", lambda self, *args: real(self, *args).flip(0))  # wrong rows
    with caplog.at_level("WARNING"):
        assert make_engine(tiny_model_dir, packed=True).info()["layout"] == "padded"
    assert "its vectors differ from the padded pass's" in caplog.text

    def no_kernel(self, *args):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(PackedTransformer, "__call__", no_kernel)
    with caplog.at_level("WARNING"):
        assert make_engine(tiny_model_dir, packed=True).info()["layout"] == "padded"
    assert "its check failed (RuntimeError: no kernel image" in caplog.text


def test_packed_out_of_memory_splits_the_pass(tiny_model_dir):
    reference = make_engine(tiny_model_dir, packed=True)
    ids = reference.text.token_ids(TEXTS)
    engine = with_faults(make_engine(tiny_model_dir, packed=True), FaultInjection(oom_above_tokens=24))
    embedded, expected = engine.encoder.embed(plain_inputs(ids)), reference.encoder.embed(plain_inputs(ids))
    fits = [i for i, row in enumerate(ids) if len(row) <= 24]
    assert embedded.passes > expected.passes and 0 < len(fits) < len(ids)
    assert embedded.too_large == frozenset(range(len(ids))) - set(fits)  # over the limit alone: 507 for its request
    assert torch.allclose(embedded.vectors[fits], expected.vectors[fits], atol=1e-5)


def test_packed_needs_the_torch_engine(onnx_model_dir):
    assert make_engine(onnx_model_dir, packed=True).info()["engine"] == "torch"
    with pytest.raises(ValueError, match="'engine': onnxruntime runs float32 or int8 on a CPU"):
        make_engine(onnx_model_dir, packed=True, engine="onnxruntime")
