"""The worker's loop in-process: reading a batch frame and writing its answers, TorchServe's Python
loop against the worker's own (embedserve/handler/torchserve/wire.py).

    python -m bench.worker_loop [--batches 2000] [--sizes 1,16] [--out DIR]

Batch frames as the frontend writes them (one short text a request, five HTTP headers) go through
a real socket pair; each side reads them as its loop does: TorchServe's `retrieve_msg` and
`Service.retrieve_data_for_inference` (which decode the JSON bodies), or `FrameReader` (which
leaves them bytes for the handler's codec). Then each writes the same answers: TorchServe's
`create_predict_response` from a context holding them, or `answer_frame`. Figures are the reading
thread's CPU time a request. Writes DIR/worker_loop.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
import threading
import time
from pathlib import Path

from ts.context import Context, RequestProcessor
from ts.protocol.otf_message_handler import create_predict_response, retrieve_msg
from ts.service import Service

from bench.request_path import short_texts
from embedserve.handler.api.exchange import Response
from embedserve.handler.torchserve.entry import EmbeddingHandler
from embedserve.handler.torchserve.wire import FrameReader, answer_frame
from embedserve.handler.worker.cpu_features import describe_cpu
from tests.support import frames

# What a Python client's request carries (the frontend passes every HTTP header on).
HEADERS = (("Host", "127.0.0.1:8080"), ("User-Agent", "python-requests/2.32"), ("Accept", "*/*"),
           ("Content-Type", "application/json"), ("Content-Length", "48"))


def batch_frame(texts: list[str], first_id: int) -> bytes:
    """One short-text request a text, each with the headers a Python client sends."""
    return frames.batch_frame([{"id": f"{first_id + offset:08d}-0000-4000-8000-000000000000", "headers": dict(HEADERS),
                                "parameters": [("body", "application/json", json.dumps({"input": text}).encode())]}
                               for offset, text in enumerate(texts)])


def _read_cpu_us(frames: bytes, batches: int, size: int, read) -> float:
    """The reading thread's CPU a request, the frames sent from another thread."""
    sender, receiver = socket.socketpair()
    with sender, receiver:
        feeder = threading.Thread(target=lambda: (sender.sendall(frames), sender.shutdown(socket.SHUT_WR)))
        feeder.start()
        started = time.thread_time()
        read(receiver, batches)
        spent = time.thread_time() - started
        feeder.join()
    return round(spent / (batches * size) * 1e6, 2)


def _torchserve_read(sock: socket.socket, batches: int) -> None:
    for _ in range(batches):
        _, batch = retrieve_msg(sock)
        Service.retrieve_data_for_inference(batch)


def _own_read(sock: socket.socket, batches: int) -> None:
    reader = FrameReader(sock)
    for _ in range(batches):
        reader.next_batch()


def _write_cpu_us(size: int, batches: int) -> dict[str, float]:
    body = json.dumps({"object": "list", "data": [{"object": "embedding", "index": 0,
                                                   "embedding": [0.125] * 32}]}).encode()
    responses = [Response.of(200, body, **{"x-batch-size": str(size),
                                           "server-timing": "parse;dur=0.067, handler;dur=1.200"})
                 for _ in range(size)]
    ids = {idx: f"{idx:08d}-0000-4000-8000-000000000000" for idx in range(size)}
    context = Context("tiny", "/tmp", {}, size, None, "0.12.0")

    def torchserve() -> None:  # the handler's reply through the context, then TorchServe's frame
        context.request_processor = [RequestProcessor({}) for _ in ids]
        EmbeddingHandler._reply(responses, context)
        create_predict_response([r.body for r in responses], ids, "Prediction success", 200, context=context)

    figures = {}
    for name, write in (("torchserve", torchserve), ("own", lambda: answer_frame(list(ids.values()), responses))):
        started = time.thread_time()
        for _ in range(batches):
            write()
        figures[name] = round((time.thread_time() - started) / (batches * size) * 1e6, 2)
    return figures


def measure(batches: int, sizes: list[int]) -> dict:
    logging.getLogger().setLevel(logging.WARNING)  # TorchServe's read logs a line a batch
    texts = short_texts()
    rows = []
    for size in sizes:
        frames = b"".join(batch_frame([texts[(k * size + i) % len(texts)] for i in range(size)], k * size)
                          for k in range(batches))
        rows.append({"batch": size,
                     "read_us": {"torchserve": _read_cpu_us(frames, batches, size, _torchserve_read),
                                 "own": _read_cpu_us(frames, batches, size, _own_read)},
                     "write_us": _write_cpu_us(size, batches)})
    return {"batches": batches, "cpu": describe_cpu(), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.worker_loop", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--sizes", default="1,16", help="requests a batch, comma-separated")
    parser.add_argument("--out", type=Path, default=None, help="write worker_loop.json here")
    args = parser.parse_args(argv)
    result = measure(args.batches, [int(size) for size in args.sizes.split(",")])
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "worker_loop.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
