"""The embedding cache for sparse (SPLADE), hybrid (bge-m3) and multi-vector (ColBERT) models, in
process: a repeated request answered byte for byte from the cache without a forward pass, every
option applied after the model answered from one entry as uncached, query and document inputs
kept apart where the model computes them apart, the memory bound counting rows by their real size,
and a real redis-server shared by two services."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from embedserve.archive.stage import stage_model
from embedserve.handler.api.exchange import RawRequest
from embedserve.handler.assembly import assemble
from embedserve.handler.execution.encoder import DenseRows, HybridRows, SparseRows, TokenRows
from embedserve.handler.scheduling.cache import ENTRY_OVERHEAD_BYTES, EmbeddingCache, MemoryCache, RedisCache
from embedserve.handler.settings import Settings
from tests.support.cache import TTL_S
from tests.support.m3_models import make_m3
from tests.support.model_families import corpus
from tests.support.multi_vector_models import DIMENSION, make_colbert
from tests.support.sparse_models import make_inference_free, make_splade

TEXTS = corpus(10, seed=3) + ["a", "hello, world!", "hello world " * 40]  # the last one is truncated
QUERIES = ["a", "hello world", "what is the relevant passage?"]
# A request per kind whose answer holds every output the model has.
BODIES = {"sparse": {"input": TEXTS},
          "hybrid": {"input": TEXTS, "outputs": ["dense", "sparse", "colbert"]},
          "multi_vector": {"input": TEXTS, "input_type": "document"}}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache-outputs")
    make_m3(root / "m3-raw")
    stage_model(root / "m3-raw", root / "m3")  # the heads as the archive holds them
    return {"sparse": make_splade(root / "splade"), "hybrid": root / "m3",
            "multi_vector": make_colbert(root / "colbert")}


def service(folder, **settings):
    # Not warmed up: both services plan passes at the same default prices, so the same request runs
    # the same passes on each, and a cached answer can be compared byte for byte with an uncached one.
    return assemble(folder, Settings(dtype="float32", **settings), model_name="m", warm=False)


@pytest.fixture(scope="module")
def uncached(folders):
    return {kind: service(folder) for kind, folder in folders.items()}


@pytest.fixture(scope="module")
def cached(folders):
    return {kind: service(folder, cache_entries=1000) for kind, folder in folders.items()}


def ask(svc, body, route=""):
    """(status, raw body, report) of one request."""
    [response], report = svc.handle_with_report([RawRequest(json.dumps(body).encode(), "application/json", route)])
    return response.status, response.body, report


def assert_from_cache(report, inputs, tier="memory"):
    assert report.cache_hits == {tier: inputs} and report.cache_misses == 0, report
    assert report.forward_passes == 0 and report.padded_tokens == 0


@pytest.mark.parametrize("kind", sorted(BODIES))
def test_a_repeated_request_is_answered_byte_for_byte_from_the_cache(cached, uncached, kind):
    svc, body = cached[kind], BODIES[kind]
    assert svc.info()["cache"] == {"memory_entries": 1000, "redis": False}
    status, first, report = ask(svc, body)
    assert status == 200 and report.cache_misses == len(TEXTS) and report.forward_passes > 0
    assert first == ask(uncached[kind], body)[1]
    status, second, report = ask(svc, body)
    assert status == 200 and second == first
    assert_from_cache(report, len(TEXTS))


# Options applied after the model, on the route that takes them (TEI's bodies, with "inputs", as
# they are): each answered from the entries of BODIES[kind]'s inputs.
AFTER_THE_MODEL = {
    "sparse": [("", {"threshold": 0.5}), ("", {"max_active_dims": 3}), ("", {"sparse_format": "tokens"}),
               ("", {"max_active_dims": 2, "threshold": 0.1, "sparse_format": "tokens"}),
               ("embed_sparse", {"inputs": TEXTS}), ("embed_sparse", {"inputs": TEXTS, "max_active_dims": 5})],
    "hybrid": [("", {"outputs": ["dense"]}), ("", {"outputs": ["sparse"], "threshold": 0.2}),
               ("", {"outputs": ["colbert"], "encoding_format": "base64"}),
               ("", {"outputs": ["dense", "colbert"], "output_dtype": "int8"}),
               ("", {"outputs": ["dense", "sparse"], "dimensions": 8, "normalize": False, "max_active_dims": 4}),
               ("", {"outputs": ["sparse", "colbert"], "sparse_format": "tokens", "output_dtype": "ubinary"}),
               ("embed", {"inputs": TEXTS}), ("embed_sparse", {"inputs": TEXTS})],
    "multi_vector": [("", {"encoding_format": "base64"}), ("", {"output_dtype": "int8"}),
                     ("", {"output_dtype": "binary", "encoding_format": "base64"}),
                     ("embed_all", {"inputs": TEXTS, "input_type": "document"})],
}


@pytest.mark.parametrize("kind", sorted(AFTER_THE_MODEL))
def test_options_after_the_model_are_answered_from_one_entry_as_uncached(cached, uncached, kind):
    svc = cached[kind]
    ask(svc, BODIES[kind])
    for route, options in AFTER_THE_MODEL[kind]:
        body = options if "inputs" in options else {**BODIES[kind], **options}
        status, answer, report = ask(svc, body, route)
        assert status == 200, (route, options, answer)
        assert_from_cache(report, len(TEXTS))
        assert answer == ask(uncached[kind], body, route)[1], (route, options)


def test_a_maxsim_ranking_reads_the_token_vectors_embedded_before(cached, uncached):
    svc = cached["multi_vector"]
    ask(svc, {"input": TEXTS, "input_type": "document"})
    ask(svc, {"input": QUERIES[2], "input_type": "query"})
    body = {"query": QUERIES[2], "texts": TEXTS, "return_text": True}
    status, ranked, report = ask(svc, body, "rerank")
    assert status == 200
    assert_from_cache(report, 1 + len(TEXTS))
    # The uncached ranking computes the query in another pass than the one that cached it: float32
    # rounding apart, the same ranking.
    got, want = json.loads(ranked), json.loads(ask(uncached["multi_vector"], body, "rerank")[1])
    assert [(item["index"], item["text"]) for item in got] == [(item["index"], item["text"]) for item in want]
    np.testing.assert_allclose([item["score"] for item in got], [item["score"] for item in want], rtol=1e-5)


def test_queries_and_documents_do_not_share_token_vectors(folders, uncached):
    svc = service(folders["multi_vector"], cache_entries=1000)
    ask(svc, {"input": QUERIES, "input_type": "document"})
    for kind in ("query", None):  # another prompt, length and expansion; or none of them
        body = {"input": QUERIES, **({"input_type": kind} if kind else {})}
        status, answer, report = ask(svc, body)
        assert status == 200 and report.cache_misses == len(QUERIES) and not report.cache_hits, kind
        assert answer == ask(uncached["multi_vector"], body)[1]
        assert_from_cache(ask(svc, body)[2], len(QUERIES))


def test_sparse_queries_and_documents_share_entries_only_where_the_model_computes_them_alike(folders, tmp_path):
    plain = service(folders["sparse"], cache_entries=1000)
    ask(plain, {"input": QUERIES, "input_type": "query"})
    # No prompt of either name: a document is the same token ids through the same model.
    assert_from_cache(ask(plain, {"input": QUERIES, "input_type": "document"})[2], len(QUERIES))

    prompted = shutil.copytree(folders["sparse"], tmp_path / "prompted")
    config_file = prompted / "config_sentence_transformers.json"
    config = json.loads(config_file.read_text())
    config["prompts"] = {"query": "query: ", "document": "passage: "}
    config_file.write_text(json.dumps(config))
    svc, reference = service(prompted, cache_entries=1000), service(prompted)
    ask(svc, {"input": QUERIES, "input_type": "query"})
    for kind in ("document", None):
        body = {"input": QUERIES, **({"input_type": kind} if kind else {})}
        status, answer, report = ask(svc, body)
        assert status == 200 and report.cache_misses == len(QUERIES) and not report.cache_hits, kind
        assert answer == ask(reference, body)[1]
    # A prompt named in the request is the same ids as the input type of that prompt: one entry.
    assert_from_cache(ask(svc, {"input": QUERIES, "prompt_name": "query"})[2], len(QUERIES))


def test_inference_free_queries_are_looked_up_and_documents_cached(tmp_path):
    make_inference_free(tmp_path / "inference-free")
    stage_model(tmp_path / "inference-free", tmp_path / "staged")
    svc = service(tmp_path / "staged", cache_entries=100)
    status, _, report = ask(svc, {"input": QUERIES, "input_type": "query"})
    assert status == 200 and report.forward_passes == 0 and report.cache_misses == 0 and not report.cache_hits
    documents = {"input": QUERIES, "input_type": "document"}
    _, first, _ = ask(svc, documents)
    # One batch of a query request (a lookup) and a document request (the cache).
    raws = [RawRequest(json.dumps(body).encode(), "application/json", "")
            for body in ({"input": QUERIES, "input_type": "query"}, documents)]
    responses, report = svc.handle_with_report(raws)
    assert [r.status for r in responses] == [200, 200] and responses[1].body == first
    assert_from_cache(report, len(QUERIES))


def test_the_memory_bound_counts_each_row_by_its_real_size(folders):
    svc = service(folders["sparse"], cache_entries=1000)
    _, answer, _ = ask(svc, {"input": TEXTS, "sparse_format": "indices"})
    entries = [len(item["embedding"]["indices"]) for item in json.loads(answer)["data"]]
    assert len(set(entries)) > 1  # rows of several sizes
    assert svc.cache.memory.bytes == sum(2 * 4 * n + ENTRY_OVERHEAD_BYTES for n in entries)

    tokens = service(folders["multi_vector"], cache_entries=1000)
    ask(tokens, {"input": QUERIES, "input_type": "query"})  # expanded to exactly 12 tokens each
    assert tokens.cache.memory.bytes == len(QUERIES) * (12 * DIMENSION * 4 + ENTRY_OVERHEAD_BYTES)

    codec = SparseRows.codec(100)
    small, large = np.zeros((2, 10), dtype=np.float32), np.zeros((2, 1000), dtype=np.float32)
    memory = MemoryCache(max_entries=100, max_bytes=codec.nbytes(large) + 2 * codec.nbytes(small) - 1, codec=codec)
    for key in (b"a", b"b"):
        memory.put(key, small)
    memory.put(b"c", large)  # over the bound by bytes, not by entries: the oldest goes
    memory.put(b"d", small)  # and the next oldest
    assert memory.get(b"a") is None and memory.get(b"b") is None and memory.get(b"c") is not None
    assert memory.bytes == codec.nbytes(large) + codec.nbytes(small)


def test_each_kind_round_trips_exactly_and_reads_no_other_kind():
    rng = np.random.default_rng(0)
    dense = rng.standard_normal(8).astype(np.float32)
    sparse = np.stack((np.array([3, 7, 40], dtype=np.float32), rng.random(3, dtype=np.float32)))
    tokens = rng.standard_normal((5, 8)).astype(np.float32)
    codecs = {"dense": (DenseRows.codec(8), dense), "sparse": (SparseRows.codec(8), sparse),
              "tokens": (TokenRows.codec(8), tokens),
              "hybrid": (HybridRows.codec(8), (dense, sparse, tokens[1:]))}
    for kind, (codec, row) in codecs.items():
        value = codec.to_bytes(row)
        back = codec.from_bytes(value)
        for got, want in zip(codec.parts(back), codec.parts(row), strict=True):
            assert got.dtype == np.float32 and got.tobytes() == want.tobytes(), kind
        for other, (other_codec, _) in codecs.items():
            if other != kind:
                assert other_codec.from_bytes(value) is None, (kind, other)
        assert codec.from_bytes(value[:-1]) is None and codec.from_bytes(value[:6]) is None
        assert codec.from_bytes(dense.tobytes()) is None  # raw float32, as an older version wrote them
    assert DenseRows.codec(16).from_bytes(DenseRows.codec(8).to_bytes(dense)) is None  # another width
    assert TokenRows.codec(8).from_bytes(TokenRows.codec(8).to_bytes(tokens[:0])).shape == (0, 8)


@pytest.mark.parametrize("kind", sorted(BODIES))
def test_redis_shares_each_kind_between_services(folders, redis_server, kind):
    client = redis_server.client()
    client.flushdb()
    settings = dict(redis_url=redis_server.url, redis_ttl_s=TTL_S)
    first = service(folders[kind], **settings)
    status, computed, report = ask(first, BODIES[kind])
    assert status == 200 and report.cache_misses == len(TEXTS) and report.cache_errors == 0
    keys = client.keys("embedserve:m:*")
    assert len(keys) == len(TEXTS) and all(0 < client.ttl(key) <= TTL_S for key in keys)
    assert all(client.get(key).startswith(b"esr1") for key in keys)  # self-describing values

    second = service(folders[kind], cache_entries=100, **settings)  # another worker or replica
    status, answer, report = ask(second, BODIES[kind])
    assert status == 200 and answer == computed
    assert_from_cache(report, len(TEXTS), tier="redis")
    assert_from_cache(ask(second, BODIES[kind])[2], len(TEXTS))
    options = {"sparse": {"max_active_dims": 2}, "hybrid": {"outputs": ["colbert"], "output_dtype": "int8"},
               "multi_vector": {"encoding_format": "base64"}}[kind]
    status, answer, report = ask(first, {**BODIES[kind], **options})  # no memory tier: Redis again
    assert status == 200 and answer == ask(service(folders[kind]), {**BODIES[kind], **options})[1]
    assert_from_cache(report, len(TEXTS), tier="redis")


def test_a_row_that_is_not_finite_is_never_stored_or_served(redis_server):
    codec = SparseRows.codec(100)
    redis = RedisCache(redis_server.url, TTL_S, 1000, 0, prefix="embedserve:finite:", codec=codec)
    cache = EmbeddingCache("finite", MemoryCache(10, 10**6, codec), redis, codec)
    broken = np.array([[1.0, 2.0], [0.5, np.nan]], dtype=np.float32)
    good = np.array([[1.0, 2.0], [0.5, 0.25]], dtype=np.float32)
    assert cache.store({b"broken": broken, b"good": good}) == 0
    assert len(cache.memory) == 1
    assert redis_server.client().get(b"embedserve:finite:" + b"broken".hex().encode()) is None
    redis.put_many({b"written": broken})  # as another writer could have
    found = EmbeddingCache("finite", None, redis, codec).lookup([b"written", b"good"]).found
    assert list(found) == [b"good"] and found[b"good"].tobytes() == good.tobytes()
