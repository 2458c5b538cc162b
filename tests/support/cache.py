"""What the cache tests share: the Redis entries' time to live, and one request through an engine
with its batch report."""

import json

from embedserve.handler.api.exchange import RawRequest

TTL_S = 600


def embed(engine, body):
    """(status, parsed body, report) for one request through the engine."""
    [response], report = engine.handle_with_report([RawRequest(body)])
    return response.status, json.loads(response.body), report
