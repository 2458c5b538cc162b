"""The embedding cache: the in-process LRU, a real Redis, and Redis failures (the cache through the
real TorchServe: tests/integration/test_cache_served.py)."""

import json
import socket
import time

import numpy as np
import pytest

from embedserve.handler.scheduling.cache import ENTRY_OVERHEAD_BYTES, REDIS_URL_ENV, MemoryCache
from embedserve.handler.api.exchange import RawRequest
from embedserve.handler.settings import SettingsError
from tests.support.cache import TTL_S, embed
from tests.support.engines import TEXTS, make_engine, matrix
from tests.support.redis_server import RedisServer


def test_memory_cache_is_bounded_in_entries_and_bytes():
    vector = np.zeros(4, dtype=np.float32)
    by_count = MemoryCache(max_entries=3, max_bytes=10**6)
    for key in (b"a", b"b", b"c"):
        by_count.put(key, vector)
    by_count.get(b"a")  # recently used: b is now the oldest
    by_count.put(b"d", vector)
    assert len(by_count) == 3 and by_count.get(b"b") is None and by_count.get(b"a") is not None

    entry = vector.nbytes + ENTRY_OVERHEAD_BYTES
    by_bytes = MemoryCache(max_entries=100, max_bytes=2 * entry + 1)
    for key in (b"a", b"b", b"c"):
        by_bytes.put(key, vector)
    assert len(by_bytes) == 2 and by_bytes.bytes <= 2 * entry and by_bytes.get(b"a") is None
    by_bytes.put(b"c", vector)  # replacing an entry does not count it twice
    assert by_bytes.bytes == 2 * entry


def test_hits_skip_the_model_and_match_uncached(tiny_model_dir, tiny_engine):
    cached = make_engine(tiny_model_dir, cache_entries=1000)
    texts = TEXTS[:4] + [TEXTS[0]]  # a repeat inside one request is computed once
    status, first, report = embed(cached, {"input": texts})
    assert status == 200
    assert report.cache_misses == 5 and report.cache_hits == {} and report.real_tokens > 0
    reference = matrix(embed(tiny_engine, {"input": texts})[1])
    np.testing.assert_allclose(matrix(first), reference, atol=1e-6)

    assert cached.info()["cache"] == {"memory_entries": 1000, "redis": False}
    assert tiny_engine.info()["cache"] == {"memory_entries": 0, "redis": False}

    status, second, report = embed(cached, {"input": texts})
    assert report.cache_hits == {"memory": 5} and report.cache_misses == 0
    assert report.forward_passes == 0 and report.padded_tokens == 0
    np.testing.assert_array_equal(matrix(second), matrix(first))


def test_mixed_batches_keep_their_order(tiny_model_dir, tiny_engine):
    cached = make_engine(tiny_model_dir, cache_entries=1000)
    embed(cached, {"input": TEXTS[::2]})  # half of the texts are now cached
    bodies = [{"input": [TEXTS[i], f"fresh {i}", TEXTS[-1 - i]]} for i in range(4)] + [{"input": []}]
    responses, report = cached.handle_with_report([RawRequest(body) for body in bodies])
    assert [r.status for r in responses] == [200] * 4 + [400]
    assert report.cache_hits["memory"] > 0 and report.cache_misses > 0
    for body, response in zip(bodies[:4], responses):
        expected = matrix(embed(tiny_engine, body)[1])
        np.testing.assert_allclose(matrix(json.loads(response.body)), expected, atol=1e-6)


def test_options_after_the_model_share_an_entry_and_options_before_it_do_not(tiny_model_dir, tiny_engine):
    cached = make_engine(tiny_model_dir, cache_entries=1000)
    long_text = " ".join(TEXTS * 20)
    embed(cached, {"input": ["hello world", long_text]})

    for options in ({"dimensions": 8}, {"normalize": False}, {"encoding_format": "base64"},
                    {"output_dtype": "int8"}, {"output_dtype": "ubinary", "dimensions": 16}):
        body = {"input": ["hello world", long_text], **options}
        status, answer, report = embed(cached, body)
        assert status == 200 and report.cache_hits == {"memory": 2}, options
        assert answer == embed(tiny_engine, body)[1], options

    for options in ({"prompt_name": "query"}, {"truncation_direction": "left"}):
        body = {"input": [long_text], **options}
        status, answer, report = embed(cached, body)
        assert status == 200 and report.cache_misses == 1, options
        np.testing.assert_allclose(matrix(answer), matrix(embed(tiny_engine, body)[1]), atol=1e-6)


def test_redis_is_shared_between_workers_with_a_ttl(tiny_model_dir, redis_server):
    settings = dict(redis_url=redis_server.url, redis_ttl_s=TTL_S)
    first = make_engine(tiny_model_dir, **settings)
    texts = [f"shared between workers {i}" for i in range(3)]
    status, computed, report = embed(first, {"input": texts})
    assert report.cache_misses == 3 and report.cache_errors == 0

    client = redis_server.client()
    keys = client.keys("embedserve:tiny:*")
    assert len(keys) >= 3
    assert all(0 < client.ttl(key) <= TTL_S for key in keys)

    # Another worker: an empty memory tier, filled from Redis.
    second = make_engine(tiny_model_dir, cache_entries=100, **settings)
    status, answer, report = embed(second, {"input": texts})
    assert report.cache_hits == {"redis": 3} and report.forward_passes == 0
    np.testing.assert_allclose(matrix(answer), matrix(computed), atol=1e-6)
    _, _, report = embed(second, {"input": texts})
    assert report.cache_hits == {"memory": 3}


def test_a_redis_outage_is_served_uncached_and_counted(tiny_model_dir, tiny_engine, tmp_path):
    redis_server = RedisServer(tmp_path / "redis")
    redis_server.start()
    engine = make_engine(tiny_model_dir, redis_url=redis_server.url, redis_retry_s=0)
    embed(engine, {"input": ["before the outage"]})
    redis_server.stop()

    body = {"input": ["before the outage", "during the outage"]}
    status, answer, report = embed(engine, body)
    assert status == 200 and report.cache_errors == 2  # the lookup and the store both failed
    np.testing.assert_allclose(matrix(answer), matrix(embed(tiny_engine, body)[1]), atol=1e-6)

    redis_server.start()  # same port, empty: the cache fills again
    status, answer, report = embed(engine, body)
    assert status == 200 and report.cache_errors == 0 and report.cache_misses == 2
    assert len(redis_server.client().keys("embedserve:tiny:*")) == 2
    redis_server.stop()


def test_a_hanging_redis_costs_one_timeout_per_retry_interval(tiny_model_dir):
    # A listener that never answers: every Redis call runs into the timeout.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"
        engine = make_engine(tiny_model_dir, redis_url=url, redis_timeout_ms=200, redis_retry_s=60)
        started = time.perf_counter()
        status, _, report = embed(engine, {"input": ["redis hangs"]})
        assert status == 200 and report.cache_errors == 1
        assert time.perf_counter() - started < 5
        started = time.perf_counter()
        status, _, report = embed(engine, {"input": ["redis still hangs"]})
        assert status == 200 and report.cache_errors == 0  # Redis is not asked again yet
        assert time.perf_counter() - started < 1


@pytest.mark.parametrize("settings, key", [
    ({"cache_entries": -1}, "cache_entries"),
    ({"cache_max_mb": 0}, "cache_max_mb"),
    ({"redis_url": "http://127.0.0.1:6379"}, "redis_url"),
    ({"redis_ttl_s": 0}, "redis_ttl_s"),
    ({"redis_timeout_ms": 0}, "redis_timeout_ms"),
])
def test_bad_cache_settings_name_the_key(tiny_model_dir, settings, key):
    with pytest.raises(SettingsError, match=f"'{key}'"):
        make_engine(tiny_model_dir, **settings)


def test_the_environment_overrides_the_redis_url(tiny_model_dir, redis_server, monkeypatch):
    monkeypatch.setenv(REDIS_URL_ENV, redis_server.url)
    engine = make_engine(tiny_model_dir)  # no cache in the settings, Redis from the environment
    _, _, report = embed(engine, {"input": ["configured by the environment"]})
    assert report.cache_enabled and report.cache_misses == 1 and report.cache_errors == 0
    monkeypatch.setenv(REDIS_URL_ENV, "localhost:6379")
    with pytest.raises(SettingsError, match=REDIS_URL_ENV):
        make_engine(tiny_model_dir)
