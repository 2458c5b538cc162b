"""TorchServe's worker wire format (its "OTF" frames), read and written with one buffer.

The frontend sends a worker each batch over a local socket as one frame: `I`, then per request
its id, its headers and its parameters, each field a 4-byte big-endian length and its bytes, each
list ended by -1. TorchServe's own Python worker reads that frame with a `recv` per field, about
forty system calls and as many Python calls for a one-text request, and decodes JSON bodies that
the handler decodes again: on a served tiny model that was most of the no-op handler's 80-90 us of
worker CPU a request (docs/performance.md). Here a frame is read in large chunks and parsed from
memory, and bodies stay bytes; the answer frame is built in one list and sent with one call.

The format is TorchServe 0.12's `ts/protocol/otf_message_handler.py`; tests/unit/torchserve
checks this codec against that one, frame for frame. No TorchServe import here.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from http import HTTPStatus
from typing import Sequence

from embedserve.handler.api.exchange import Response

PREDICT = b"I"
END = -1
CHUNK_BYTES = 256 * 1024

_INT = struct.Struct("!i")
SUCCESS = b"Prediction success"


class FrontendGone(Exception):
    """The frontend closed the socket: the worker's life is over (TorchServe's worker exits then too)."""


class UnexpectedCommand(Exception):
    """A frame that is not a batch: a loaded worker gets nothing else from TorchServe 0.12."""


class MalformedFrame(UnexpectedCommand):
    """A field's length that no frontend writes: the stream cannot be read on."""


@dataclass(frozen=True)
class Parameter:
    name: str
    content_type: str
    value: bytes


@dataclass(frozen=True)
class WireRequest:
    request_id: str
    headers: dict[str, str]  # as sent; names keep their case
    parameters: tuple[Parameter, ...]


class _Incomplete(Exception):
    """The buffer ends inside the frame: read more, then parse the frame again."""


class FrameReader:
    """Batches from the frontend's socket, read ahead in large chunks."""

    def __init__(self, sock: socket.socket, chunk_bytes: int = CHUNK_BYTES):
        self._sock = sock
        self._chunk = chunk_bytes
        self._buffer = bytearray()

    def next_batch(self) -> list[WireRequest]:
        """The next batch; blocks until the frontend sends one."""
        while True:
            try:
                batch, end = _parse_batch(self._buffer)
            except _Incomplete:
                self._fill()
                continue
            del self._buffer[:end]  # keep what arrived of the next frame
            return batch

    def _fill(self) -> None:
        # At least as much again as is buffered: a large frame is parsed again a few times, not once a chunk.
        chunk = self._sock.recv(max(self._chunk, len(self._buffer)))
        if not chunk:
            raise FrontendGone("the frontend closed the worker's socket")
        self._buffer += chunk


def _parse_batch(buffer: bytearray) -> tuple[list[WireRequest], int]:
    """The batch frame at the buffer's start and where it ends; _Incomplete if it ends past the buffer.

    A read past the end shows as a short field (a slice stops at the end) or struct.error
    (unpack_from does not), and is checked once a request is read."""
    size = len(buffer)
    if not size:
        raise _Incomplete
    if buffer[0] != PREDICT[0]:
        raise UnexpectedCommand(f"the frontend sent command {bytes(buffer[:1])!r}; this worker only serves batches")
    pos, batch = 1, []
    try:
        while (entry := _fields(buffer, pos, 1))[0]:
            [request_id], pos = entry
            headers, parameters = {}, []
            while (entry := _fields(buffer, pos, 2))[0]:
                (name, value), pos = entry
                headers[name.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
            pos = entry[1]
            while (entry := _fields(buffer, pos, 3))[0]:
                (name, content_type, value), pos = entry
                parameters.append(Parameter(name.decode("utf-8", "replace"), content_type.decode("utf-8", "replace"),
                                            bytes(value)))
            pos = entry[1]
            if pos > size:
                raise _Incomplete
            batch.append(WireRequest(request_id.decode("utf-8", "replace"), headers, tuple(parameters)))
    except struct.error:
        raise _Incomplete from None
    return batch, entry[1]


def _fields(buffer: bytearray, pos: int, count: int) -> tuple[list[bytearray], int]:
    """`count` length-prefixed fields from `pos`, and the position after them; no fields and the
    position after the list's end mark (-1) when the list ends there."""
    unpack, fields = _INT.unpack_from, []
    for _ in range(count):
        (length,) = unpack(buffer, pos)
        if length < 0:
            if length == END and not fields:
                return fields, pos + 4
            raise MalformedFrame(f"a field of length {length} at byte {pos} of the frame")
        fields.append(buffer[pos + 4:pos + 4 + length])
        pos += 4 + length
    return fields, pos


def reason_phrase(status: int) -> str:
    """The reason phrase an answer carries: none for 200, else the status's (fixed ASCII; the
    detail is in the JSON body)."""
    return "" if status == 200 else HTTPStatus(status).phrase


def answer_frame(request_ids: Sequence[str], responses: Sequence[Response]) -> bytes:
    """One batch's answer frame: per request its id, content type, status, reason, headers and body."""
    pack = _INT.pack
    parts = [pack(200), pack(len(SUCCESS)), SUCCESS]
    append = parts.append
    for request_id, response in zip(request_ids, responses, strict=True):
        # TorchServe's context keeps the content type among the headers too, first.
        headers = {"content-type": response.content_type, **response.headers}
        request_id = request_id.encode("utf-8")
        content_type = response.content_type.encode("utf-8")
        phrase = reason_phrase(response.status).encode("ascii")
        parts += (pack(len(request_id)), request_id, pack(len(content_type)), content_type, pack(response.status),
                  pack(len(phrase)), phrase, pack(len(headers)))
        for name, value in headers.items():
            name, value = name.encode("utf-8"), value.encode("utf-8")
            parts += (pack(len(name)), name, pack(len(value)), value)
        append(pack(len(response.body)))
        append(response.body)
    append(pack(END))
    return b"".join(parts)
