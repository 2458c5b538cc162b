"""The embedding cache through the real TorchServe: a model built with both tiers on, against the
real Redis (in-process: tests/unit/scheduling/test_cache.py)."""

import numpy as np
import pytest

from tests.support.cache import TTL_S, embed
from tests.support.client import (concurrently, metric_growth, metric_samples_after, predict,
                                  settled_metric_samples, vectors)
from tests.support.engines import TEXTS, matrix
from tests.support.serving import FLOAT32, build, make_server_config, serving


@pytest.fixture(scope="module")
def cached_server(tmp_path_factory, tiny_model_dir, redis_server):
    redis_server.client().flushdb()
    tiny = [*FLOAT32, "--model", str(tiny_model_dir), "--name", "tiny", "--workers", "1", "--batch-size", "8",
            "--max-batch-delay", "100", "--set", "cache_entries=10000", "--set", f"redis_url={redis_server.url}",
            "--set", f"redis_ttl_s={TTL_S}"]
    with serving(tmp_path_factory.mktemp("cached"), tiny) as ts:
        yield ts


@pytest.mark.integration
def test_cache_through_torchserve(cached_server, redis_server, tiny_engine):
    bodies = [{"input": [f"cached text {i % 3}", TEXTS[i % len(TEXTS)]]} for i in range(8)]
    first = concurrently([lambda b=b: predict(cached_server, b) for b in bodies])
    expected = [matrix(embed(tiny_engine, b)[1]) for b in bodies]
    for response, reference in zip(first, expected):
        np.testing.assert_allclose(vectors(response), reference, atol=1e-5)
    before = settled_metric_samples(cached_server)  # the first round's counters all in
    second = concurrently([lambda b=b: predict(cached_server, b) for b in bodies])
    for response, reference in zip(second, expected):
        np.testing.assert_allclose(vectors(response), reference, atol=1e-5)
    after = metric_samples_after(cached_server, before, requests=len(bodies))

    def grown(name, label=""):
        return metric_growth(before, after, name, label)

    assert grown("EmbedCacheHits", 'Tier="memory"') == 16
    assert grown("EmbedCacheMisses") == 0 and grown("EmbedCacheErrors") == 0
    assert grown("EmbedForwardPasses") == 0
    distinct = {text for body in bodies for text in body["input"]}
    readiness_probe = 1  # serverctl's readiness check embedded one text too
    assert len(redis_server.client().keys("embedserve:tiny:*")) == len(distinct) + readiness_probe


@pytest.mark.integration
def test_build_refuses_a_bad_setting(tmp_path, tiny_model_dir):
    config = make_server_config(tmp_path)
    with pytest.raises(AssertionError):
        build(config, "--model", str(tiny_model_dir), "--name", "bad", "--set", "redis_url=localhost")
    with pytest.raises(AssertionError):
        build(config, "--model", str(tiny_model_dir), "--name", "bad", "--set", "no_equals_sign")
    assert not (tmp_path / "model_store" / "bad.mar").exists()
