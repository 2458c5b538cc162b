"""Texts in, one float32 vector or one error each out, through any way of posting a request body to
the model's OpenAI route: over HTTP (the batch command) or to a service in the same process (the
Ray Data path). Vectors are asked for in base64 (exact, and a third the size of JSON numbers). A
request the service refuses as a whole (400, 413, 422, 500, 507) is split in halves until the
texts at fault are alone, so one bad text fails alone, as a bad request fails alone in the service."""

from __future__ import annotations

import base64
from typing import Any, Callable

import numpy as np
import orjson

from embedserve.batch.client import Answer
from embedserve.batch.grouping import Group
from embedserve.batch.outputs import error_message
from embedserve.batch.server import JobError

# A request refused with one of these is split, to find the texts at fault; another status fails all its texts.
SPLIT_STATUSES = frozenset({400, 413, 422, 500, 507})
NOT_SENT = "not sent"  # the status of a row grouping.py keeps back, as the service would refuse it

# Posts one JSON body to the model's /v1/embeddings and returns the answer.
Post = Callable[[bytes], Answer]
# (vector, None, 200) for an embedded text, (None, the error, the status) for a refused one.
Outcome = tuple[np.ndarray | None, str | None, int | str]


def group_outcomes(post: Post, group: Group, options: dict[str, Any], model: str, values: int) -> list[Outcome]:
    """Each row's outcome, in order: the rows grouping.py kept back are not sent."""
    texts = group.texts
    sent = iter(embed_texts(post, texts, options, model, values) if texts else [])
    return [(None, f"{NOT_SENT}: {group.refused[i]}", NOT_SENT) if i in group.refused else next(sent)
            for i in range(len(group.rows))]


def embed_texts(post: Post, texts: list[str], options: dict[str, Any], model: str, values: int) -> list[Outcome]:
    """Each text's outcome, in order."""
    body = orjson.dumps({**options, "model": model, "input": texts, "encoding_format": "base64"})
    answer = post(body)
    if answer.status == 200:
        return [(v, None, 200) for v in decode_vectors(answer.body, len(texts), values)]
    if answer.status in SPLIT_STATUSES and len(texts) > 1:
        half = len(texts) // 2
        return embed_texts(post, texts[:half], options, model, values) + \
            embed_texts(post, texts[half:], options, model, values)
    return [(None, error_message(answer), answer.status)] * len(texts)


def decode_vectors(body: bytes, count: int, values: int) -> list[np.ndarray]:
    """The float32 vectors of an OpenAI-shape answer in base64, in input order."""
    try:
        data = sorted(orjson.loads(body)["data"], key=lambda d: d["index"])
        vectors = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in data]
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise JobError(f"the service answered 200 with a body this command cannot read ({err}): {body[:200]!r}")
    if len(vectors) != count or any(len(v) != values for v in vectors):
        raise JobError(f"the service answered {len(vectors)} vectors of {sorted({len(v) for v in vectors})} values "
                       f"for {count} texts of {values}")
    return vectors
