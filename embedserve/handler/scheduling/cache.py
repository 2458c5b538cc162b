"""Embedding cache: an in-process LRU in front of an optional shared Redis.

What is cached is the model's output for one exact model input: a row of the kind the model
gives (its row codec, `RowCodec`: a pooled float32 vector, a sparse model's entries, a
multi-vector model's token vectors, bge-m3's three), keyed by a hash of that kind, the model's
identity (name, weights revision, dtype and int8 layers, the pipeline after the transformer) and
every field of the input: the token ids the model sees, the prompt tokens pooling leaves out, where
a pair's second text starts, a query's unattended expansion tokens. Every request option that
changes what the model computes (prompt, input type, truncation side, truncate on or off,
max_length, query expansion) is therefore part of the key by construction, because it changes
those fields. The options applied after the model (normalize, dimensions, output dtype, encoding,
a sparse threshold, max_active_dims and format, bge-m3's outputs, a skiplist) run on the cached
row per request, so one entry serves them all and the answer is the same as uncached.

Redis is a shared, best-effort tier: any Redis error is counted and the batch goes on uncached;
after an error Redis is left alone for `retry_s`, so an outage costs one timeout per interval,
not one per batch. `embed_cached` is the bookkeeping around the model: look up, embed the misses
once each, store, count.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from embedserve.handler.model.inputs import ModelInput
from embedserve.handler.settings import Settings, check_redis_url
from embedserve.handler.worker.failures import log_failure
from embedserve.handler.worker.metrics import BatchReport

log = logging.getLogger(__name__)

# Bookkeeping per array kept in memory beyond its data (key, dict slot, array header), so the
# byte bound holds roughly for tiny rows too.
ENTRY_OVERHEAD_BYTES = 200
# The stored value's format: this tag, then the row's kind and each part's shape, then the parts.
ROW_FORMAT = b"esr1"


@dataclass(frozen=True)
class RowCodec:
    """One kind of model output row, as the cache keeps it: float32 arrays ("parts") whose shapes
    follow `shapes` (None: any length on that axis). A one-part row is the array itself, a row of
    several a tuple of them. `split` cuts a batch's outputs (what the encoder gives) into a row per
    item; `join` puts rows back together as the tasks read them.

    A stored value says what it holds (the format, the kind, each part's shape) before the parts'
    little-endian float32 bytes: a value of another kind or shape is a miss, never misread."""
    kind: str
    shapes: tuple[tuple[int | None, ...], ...]
    split: Callable[[Any], list] = list
    join: Callable[[list], Any] = list

    def parts(self, row: Any) -> tuple[np.ndarray, ...]:
        return tuple(row) if len(self.shapes) > 1 else (row,)

    def _row(self, parts: Sequence[np.ndarray]) -> Any:
        return tuple(parts) if len(self.shapes) > 1 else parts[0]

    def owned(self, row: Any) -> Any:
        """The row as its own float32 arrays, not views of a batch's block (which memory would keep
        whole, uncounted)."""
        return self._row([np.array(part, dtype=np.float32) for part in self.parts(row)])

    def nbytes(self, row: Any) -> int:
        """What the row takes in memory, each of its arrays counted by its real size."""
        return sum(part.nbytes + ENTRY_OVERHEAD_BYTES for part in self.parts(row))

    def finite(self, row: Any) -> bool:
        return all(bool(np.isfinite(part).all()) for part in self.parts(row))

    def to_bytes(self, row: Any) -> bytes:
        parts = self.parts(row)
        kind = self.kind.encode()
        header = [ROW_FORMAT, struct.pack("<B", len(kind)), kind, struct.pack("<B", len(parts))]
        for part in parts:
            header.append(struct.pack(f"<B{part.ndim}I", part.ndim, *part.shape))
        return b"".join(header + [np.ascontiguousarray(part, dtype="<f4").tobytes() for part in parts])

    def from_bytes(self, data: bytes) -> Any | None:
        """The row a value holds, or None where it is not a row of this kind (another format or
        writer, a changed model) or is cut short."""
        try:
            if not data.startswith(ROW_FORMAT):
                return None
            at = len(ROW_FORMAT)
            length = data[at]
            kind, at = data[at + 1:at + 1 + length], at + 1 + length
            if kind != self.kind.encode() or data[at] != len(self.shapes):
                return None
            at += 1
            shapes = []
            for expected in self.shapes:
                ndim = data[at]
                shape = struct.unpack_from(f"<{ndim}I", data, at + 1)
                at += 1 + 4 * ndim
                if len(shape) != len(expected) or any(want is not None and got != want
                                                      for got, want in zip(shape, expected)):
                    return None
                shapes.append(shape)
            sizes = [4 * int(np.prod(shape)) for shape in shapes]
            if len(data) - at != sum(sizes):
                return None
            parts = []
            for shape, size in zip(shapes, sizes):
                parts.append(np.frombuffer(data, dtype="<f4", count=size // 4, offset=at).astype(np.float32)
                             .reshape(shape))  # a copy: the row owns its memory
                at += size
            return self._row(parts)
        except (IndexError, struct.error):
            return None


# Pooled vectors of any width: the dense kind where no model says its width.
VECTORS = RowCodec("dense", ((None,),))


@dataclass
class Lookup:
    """The rows found for some keys, and what the lookup cost."""
    found: dict[bytes, Any] = field(default_factory=dict)
    from_redis: set[bytes] = field(default_factory=set)  # found in Redis, not in memory
    errors: int = 0


class MemoryCache:
    """Least-recently-used, bounded both in entries and in bytes (each row by its real size)."""

    def __init__(self, max_entries: int, max_bytes: int, codec: RowCodec = VECTORS):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.codec = codec
        self.bytes = 0
        self._entries: OrderedDict[bytes, tuple[Any, int]] = OrderedDict()  # row, its size

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> Any | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: bytes, row: Any) -> None:
        size = self.codec.nbytes(row)
        if size > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        self._entries[key] = (row, size)
        self.bytes += size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.bytes -= evicted


class RedisCache:
    """Rows as their codec's bytes under `<prefix><key hex>`, each with a TTL."""

    def __init__(self, url: str, ttl_s: int, timeout_ms: int, retry_s: float, prefix: str,
                 codec: RowCodec = VECTORS):
        import redis  # only needed when Redis is configured

        self._errors = (redis.RedisError, OSError)
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_ms / 1000,
                                           socket_connect_timeout=timeout_ms / 1000)
        self.ttl_s = ttl_s
        self.retry_s = retry_s
        self.prefix = prefix.encode()
        self.codec = codec
        self._down_until = 0.0

    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def get_many(self, keys: Sequence[bytes]) -> list[Any | None] | None:
        """The rows (None where absent or unreadable), or None if Redis failed."""
        try:
            values = self.client.mget([self.prefix + key.hex().encode() for key in keys])
        except self._errors as err:
            self._failed("read", err)
            return None
        # A value of another kind or shape (another writer, a changed model under the same name) is a miss.
        return [self.codec.from_bytes(value) if value is not None else None for value in values]

    def put_many(self, items: dict[bytes, Any]) -> bool:
        try:
            pipe = self.client.pipeline(transaction=False)
            for key, row in items.items():
                pipe.set(self.prefix + key.hex().encode(), self.codec.to_bytes(row), ex=self.ttl_s)
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

    def __init__(self, namespace: str, memory: MemoryCache | None, redis: RedisCache | None,
                 codec: RowCodec = VECTORS):
        # The row's kind is in every key: rows of one kind are never looked up as another's.
        self._namespace = hashlib.sha256(f"{codec.kind}|{namespace}".encode()).digest()
        self.memory = memory
        self.redis = redis
        self.codec = codec

    def key(self, item: ModelInput) -> bytes:
        """Every field of the input: the same ids give another vector when pooling leaves out
        their first tokens, another score when a pair's second text starts elsewhere, other token
        vectors when a query's expansion tokens are not attended to."""
        digest = hashlib.blake2b(self._namespace, digest_size=20)
        digest.update(np.asarray(item.ids, dtype=np.int64).tobytes())
        for other in dataclasses.fields(item):
            value = getattr(item, other.name)
            if other.name == "image" and value is not None:  # an image's key is its pixel values
                digest.update(b"|image:" + np.asarray(value).tobytes())
            elif other.name not in ("ids", "image") and value:
                digest.update(f"|{other.name}:{value}".encode())
        return digest.digest()

    def lookup(self, keys: Sequence[bytes]) -> Lookup:
        result = Lookup()
        wanted = list(dict.fromkeys(keys))  # each distinct key once
        if self.memory is not None:
            for key in wanted:
                row = self.memory.get(key)
                if row is not None:
                    result.found[key] = row
            wanted = [key for key in wanted if key not in result.found]
        if wanted and self.redis is not None and self.redis.available():
            rows = self.redis.get_many(wanted)
            if rows is None:
                result.errors += 1
            else:
                for key, row in zip(wanted, rows):
                    # An entry that is not finite, whoever wrote it, is a miss: never served.
                    if row is not None and self.codec.finite(row):
                        result.found[key] = row
                        result.from_redis.add(key)
                        if self.memory is not None:
                            self.memory.put(key, row)
        return result

    def store(self, items: dict[bytes, Any]) -> int:
        """Keep freshly computed rows in both tiers, the finite ones only; the number of Redis
        errors."""
        items = {key: row for key, row in items.items() if self.codec.finite(row)}
        if self.memory is not None:
            for key, row in items.items():
                self.memory.put(key, row)
        if items and self.redis is not None and self.redis.available():
            return 0 if self.redis.put_many(items) else 1
        return 0


REDIS_URL_ENV = "EMBEDSERVE_REDIS_URL"


def open_cache(settings: Settings, *, model_name: str, identity: str, codec: RowCodec) -> EmbeddingCache | None:
    """The cache the settings ask for, or None. `identity` names the weights and how they run
    (revision, dtype, pooling): rows of another model never match; `codec` is the kind of row the
    model gives (its encoder's row class says, execution/encoder.py)."""
    from_env = os.environ.get(REDIS_URL_ENV)
    redis_url = from_env or settings.redis_url
    check_redis_url(REDIS_URL_ENV if from_env else "redis_url", redis_url)
    memory = MemoryCache(settings.cache_entries, settings.cache_max_mb * 2**20, codec) \
        if settings.cache_entries else None
    redis = RedisCache(redis_url, settings.redis_ttl_s, settings.redis_timeout_ms, settings.redis_retry_s,
                       prefix=f"embedserve:{model_name}:", codec=codec) if redis_url else None
    if memory is None and redis is None:
        return None
    return EmbeddingCache(f"{model_name}|{identity}", memory, redis, codec)


# Embeds model inputs: a row per input in input order (the codec's `split` of the encoder's
# outputs), and the inputs that did not fit in memory even alone.
Embed = Callable[[list[ModelInput]], tuple[list, frozenset[int]]]


def embed_cached(cache: EmbeddingCache, inputs: list[ModelInput], embed: Embed, report: BatchReport
                 ) -> tuple[list, frozenset[int]]:
    """Rows from the cache where present; `embed` runs once per distinct missing input and what
    it computes is stored. Rows in input order (the encoder's empty row for inputs that did not
    fit), and the inputs that did not fit."""
    keys = [cache.key(item) for item in inputs]
    try:
        lookup = cache.lookup(keys)
    except Exception as err:  # the cache is best effort: a bug in it costs hits, not answers
        log_failure("the cache lookup", err)
        lookup = Lookup(errors=1)
    missing = {key: i for i, key in enumerate(keys) if key not in lookup.found}  # first index per key
    fresh: dict[bytes, Any] = {}
    failed_keys: set[bytes] = set()
    if missing:
        rows, unfit = embed([inputs[i] for i in missing.values()])
        for position, (key, row) in enumerate(zip(missing, rows)):
            fresh[key] = cache.codec.owned(row)
            if position in unfit:
                failed_keys.add(key)
        try:
            report.cache_errors += cache.store({key: row for key, row in fresh.items() if key not in failed_keys})
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
    rows = [lookup.found[key] if key in lookup.found else fresh[key] for key in keys]
    return rows, frozenset(i for i, key in enumerate(keys) if key in failed_keys)
