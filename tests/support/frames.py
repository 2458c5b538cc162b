"""Batch frames as TorchServe's frontend writes them to a worker: `I`, then per request its id, its
headers and its parameters, each list ended by -1 (the frame the worker's loops read,
embedserve/handler/torchserve/wire.py)."""

import struct

END = struct.pack("!i", -1)


def field(value: bytes) -> bytes:
    return struct.pack("!i", len(value)) + value


def batch_frame(requests: list[dict]) -> bytes:
    """Each request a dict: "id", "headers" (name to value) and "parameters" ((name, content type,
    value) each)."""
    out = [b"I"]
    for request in requests:
        out.append(field(request["id"].encode()))
        out += [field(name.encode()) + field(value.encode()) for name, value in request.get("headers", {}).items()]
        out.append(END)
        out += [field(name.encode()) + field(content_type.encode()) + field(value)
                for name, content_type, value in request.get("parameters", [])]
        out.append(END)
    out.append(END)
    return b"".join(out)
