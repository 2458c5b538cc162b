"""A TorchServe handler that answers every request with one fixed embedding body, computing
nothing: the floor of TorchServe's own per-request cost, which bench/request_path.py serves
beside the real handler in the same TorchServe."""

from __future__ import annotations

import orjson


class NoopHandler:
    def __init__(self) -> None:
        self.body = b""

    def initialize(self, context) -> None:
        dimension = int((context.model_yaml_config or {}).get("handler", {}).get("dimension", 32))
        self.body = orjson.dumps({"object": "list", "model": context.model_name,
                                  "data": [{"object": "embedding", "index": 0, "embedding": [0.125] * dimension}],
                                  "usage": {"prompt_tokens": 8, "total_tokens": 8}})

    def handle(self, data, context) -> list[bytes]:
        for idx in range(len(data)):
            context.set_response_content_type(idx, "application/json")
        return [self.body] * len(data)


_service = NoopHandler()


def handle(data, context):
    if data is None:
        return None
    if not _service.body:
        _service.initialize(context)
    return _service.handle(data, context)
