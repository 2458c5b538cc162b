"""Embedding cache: an in-process LRU in front of an optional shared Redis.

What is cached is the model's pooled float32 vector for one exact model input, keyed by a hash
of the model's identity (name, weights revision, dtype and int8 layers, the pipeline after the
transformer) and the token ids the model sees, plus the prompt tokens pooling leaves out where a
Pooling module excludes the prompt. Every request option that changes what the model computes
(prompt, truncation side, truncate on or off, max_length) is therefore part of the key by
construction, because it changes those ids. The options applied after the model (normalize,
dimensions, output dtype, encoding) run on the cached vector per request, so one entry serves
them all and the answer is the same as uncached.

Redis is a shared, best-effort tier: any Redis error is counted and the batch goes on uncached;
after an error Redis is left alone for `retry_s`, so an outage costs one timeout per interval,
not one per batch. `embed_cached` is the bookkeeping around the model: look up, embed the misses
once each, store, count.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from embedserve.handler.model.inputs import ModelInput
from embedserve.handler.settings import Settings, check_redis_url
from embedserve.handler.worker.failures import log_failure
from embedserve.handler.worker.metrics import BatchReport

log = logging.getLogger(__name__)

# Bookkeeping per memory entry beyond the vector itself (key, dict slot, array header), so the
# byte bound holds roughly for tiny vectors too.
ENTRY_OVERHEAD_BYTES = 200


@dataclass
class Lookup:
    """The vectors found for some keys, and what the lookup cost."""
    found: dict[bytes, np.ndarray] = field(default_factory=dict)
    from_redis: set[bytes] = field(default_factory=set)  # found in Redis, not in memory
    errors: int = 0


class MemoryCache:
    """Least-recently-used, bounded both in entries and in bytes."""

    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[bytes, np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> np.ndarray | None:
        vector = self._entries.get(key)
        if vector is not None:
            self._entries.move_to_end(key)
        return vector

    def put(self, key: bytes, vector: np.ndarray) -> None:
        size = vector.nbytes + ENTRY_OVERHEAD_BYTES
        if size > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.nbytes + ENTRY_OVERHEAD_BYTES
        self._entries[key] = vector
        self.bytes += size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= evicted.nbytes + ENTRY_OVERHEAD_BYTES


class RedisCache:
    """Vectors as raw float32 bytes under `<prefix><key hex>`, each with a TTL."""

    def __init__(self, url: str, ttl_s: int, timeout_ms: int, retry_s: float, prefix: str, dimension: int):
        import redis  # only needed when Redis is configured

        self._errors = (redis.RedisError, OSError)
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_ms / 1000,
                                           socket_connect_timeout=timeout_ms / 1000)
        self.ttl_s = ttl_s
        self.retry_s = retry_s
        self.prefix = prefix.encode()
        self.dimension = dimension
        self._down_until = 0.0

    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def get_many(self, keys: Sequence[bytes]) -> list[np.ndarray | None] | None:
        """The vectors (None where absent), or None if Redis failed."""
        try:
            values = self.client.mget([self.prefix + key.hex().encode() for key in keys])
        except self._errors as err:
            self._failed("read", err)
            return None
        expected = self.dimension * 4
        # A value of another size (another writer, a changed model under the same name) is a miss.
        return [np.frombuffer(v, dtype=np.float32) if v is not None and len(v) == expected else None
                for v in values]

    def put_many(self, items: dict[bytes, np.ndarray]) -> bool:
        try:
            pipe = self.client.pipeline(transaction=False)
            for key, vector in items.items():
                pipe.set(self.prefix + key.hex().encode(), vector.astype(np.float32).tobytes(), ex=self.ttl_s)
            pipe.execute()
            return True
        except self._errors as err:
            self._failed("write", err)
            return False

    def _failed(self, what: str, err: Exception) -> None:
        self._down_until = time.monotonic() + self.retry_s
        log.warning("embedding cache: Redis %s failed (%s); serving uncached for %.0f s",
                    what, type(err).__name__, self.retry_s)


class EmbeddingCache:
    """Key derivation and the two tiers: memory first, then Redis, filling memory from Redis."""

    def __init__(self, namespace: str, memory: MemoryCache | None, redis: RedisCache | None):
        self._namespace = hashlib.sha256(namespace.encode()).digest()
        self.memory = memory
        self.redis = redis

    def key(self, item: ModelInput) -> bytes:
        """Every field of the input: the same ids give another vector when pooling leaves out
        their first tokens, and another score when a pair's second text starts elsewhere."""
        digest = hashlib.blake2b(self._namespace, digest_size=20)
        digest.update(np.asarray(item.ids, dtype=np.int64).tobytes())
        if item.unpooled:
            digest.update(b"|unpooled:%d" % item.unpooled)
        if item.second:
            digest.update(b"|second:%d" % item.second)
        if item.expansion:
            digest.update(b"|expansion:%d" % item.expansion)
        return digest.digest()

    def lookup(self, keys: Sequence[bytes]) -> Lookup:
        result = Lookup()
        wanted = list(dict.fromkeys(keys))  # each distinct key once
        if self.memory is not None:
            for key in wanted:
                vector = self.memory.get(key)
                if vector is not None:
                    result.found[key] = vector
            wanted = [key for key in wanted if key not in result.found]
        if wanted and self.redis is not None and self.redis.available():
            vectors = self.redis.get_many(wanted)
            if vectors is None:
                result.errors += 1
            else:
                for key, vector in zip(wanted, vectors):
                    # An entry that is not finite, whoever wrote it, is a miss: never served.
                    if vector is not None and np.isfinite(vector).all():
                        result.found[key] = vector
                        result.from_redis.add(key)
                        if self.memory is not None:
                            self.memory.put(key, vector)
        return result

    def store(self, items: dict[bytes, np.ndarray]) -> int:
        """Keep freshly computed vectors in both tiers, the finite ones only; the number of Redis
        errors."""
        items = {key: vector for key, vector in items.items() if np.isfinite(vector).all()}
        if self.memory is not None:
            for key, vector in items.items():
                self.memory.put(key, vector)
        if items and self.redis is not None and self.redis.available():
            return 0 if self.redis.put_many(items) else 1
        return 0


REDIS_URL_ENV = "EMBEDSERVE_REDIS_URL"


def open_cache(settings: Settings, *, model_name: str, identity: str, dimension: int) -> EmbeddingCache | None:
    """The cache the settings ask for, or None. `identity` names the weights and how they run
    (revision, dtype, pooling): vectors of another model never match."""
    from_env = os.environ.get(REDIS_URL_ENV)
    redis_url = from_env or settings.redis_url
    check_redis_url(REDIS_URL_ENV if from_env else "redis_url", redis_url)
    memory = MemoryCache(settings.cache_entries, settings.cache_max_mb * 2**20) if settings.cache_entries else None
    redis = RedisCache(redis_url, settings.redis_ttl_s, settings.redis_timeout_ms, settings.redis_retry_s,
                       prefix=f"embedserve:{model_name}:", dimension=dimension) if redis_url else None
    if memory is None and redis is None:
        return None
    return EmbeddingCache(f"{model_name}|{identity}", memory, redis)


# Embeds model inputs: float32 rows in input order, and the inputs that did not fit in memory even alone.
Embed = Callable[[list[ModelInput]], tuple[np.ndarray, frozenset[int]]]


def embed_cached(cache: EmbeddingCache, inputs: list[ModelInput], embed: Embed, report: BatchReport,
                 dimension: int) -> tuple[np.ndarray, frozenset[int]]:
    """Vectors from the cache where present; `embed` runs once per distinct missing input and
    what it computes is stored. Rows in input order (zeros for inputs that did not fit), and the
    inputs that did not fit."""
    keys = [cache.key(item) for item in inputs]
    try:
        lookup = cache.lookup(keys)
    except Exception as err:  # the cache is best effort: a bug in it costs hits, not answers
        log_failure("the cache lookup", err)
        lookup = Lookup(errors=1)
    missing = {key: i for i, key in enumerate(keys) if key not in lookup.found}  # first index per key
    computed: dict[bytes, np.ndarray] = {}
    failed_keys: set[bytes] = set()
    if missing:
        fresh, unfit = embed([inputs[i] for i in missing.values()])
        for position, (key, row) in enumerate(zip(missing, fresh)):
            if position in unfit:
                failed_keys.add(key)
            else:
                computed[key] = row.copy()  # rows, not views of one block
        try:
            report.cache_errors += cache.store(computed)
        except Exception as err:
            log_failure("storing in the cache", err)
            report.cache_errors += 1
    report.cache_errors += lookup.errors
    for key in keys:
        if key in lookup.found:
            tier = "redis" if key in lookup.from_redis else "memory"
            report.cache_hits[tier] = report.cache_hits.get(tier, 0) + 1
        else:
            report.cache_misses += 1
    zeros = np.zeros(dimension, dtype=np.float32)
    rows = [lookup.found.get(key, computed.get(key, zeros)) for key in keys]
    return np.stack(rows), frozenset(i for i, key in enumerate(keys) if key in failed_keys)
