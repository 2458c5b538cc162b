"""The worker's own reading and writing of TorchServe's frames, against TorchServe 0.12's codec
(ts/protocol/otf_message_handler.py): the same frames read the same, the same answers written
byte for byte, over a real socket pair."""

import json
import multiprocessing
import os
import socket
import struct
import threading

import pytest
from ts.context import Context, RequestProcessor
from ts.protocol.otf_message_handler import create_predict_response, retrieve_msg
from ts.service import Service

from embedserve.handler.api.codec import decode_body
from embedserve.handler.api.exchange import Response
from embedserve.handler.torchserve import entry
from embedserve.handler.torchserve.wire import FrameReader, FrontendGone, MalformedFrame, UnexpectedCommand, answer_frame
from embedserve.handler.worker.busy import BusyMark
from tests.support.frames import batch_frame as frame, field as _field


BATCH = [
    {"id": "a1", "headers": {"Host": "127.0.0.1:8080", "content-type": "application/json"},
     "parameters": [("body", "application/json", b'{"input": "hello \xc3\xa9t\xc3\xa9"}')]},
    {"id": "b2", "headers": {"Content-Type": "text/plain", "url_path": "v1/embeddings"},
     "parameters": [("body", "text/plain", b"one text")]},
    {"id": "c3", "headers": {"Accept": "*/*"}, "parameters": []},  # a GET: no body, no content type
    {"id": "d4", "headers": {"content-type": "application/octet-stream"},
     "parameters": [("data", "", b"\x00\x01raw"), ("data", "application/json", b'{"input": ["last", "wins"]}')]},
    {"id": "e5", "headers": {"url_path": "embed"}, "parameters": [("body", "application/json", b'"a json string"')]},
    {"id": "f6", "headers": {}, "parameters": [("body", "application/json", b"{not json")]},
]


def _send(data: bytes, *, close: bool = True):
    ours, theirs = socket.socketpair()
    ours.sendall(data)
    if close:
        ours.shutdown(socket.SHUT_WR)
    return ours, theirs


def test_a_batch_reads_as_torchserve_reads_it():
    _, sock = _send(frame(BATCH))
    wire = FrameReader(sock).next_batch()
    _, ts_sock = _send(frame(BATCH))
    command, ts_batch = retrieve_msg(ts_sock)
    assert command == b"I"
    assert [r.request_id for r in wire] == [r["requestId"].decode() for r in ts_batch]
    assert [r.headers for r in wire] == [{h["name"].decode(): h["value"].decode() for h in r["headers"]}
                                         for r in ts_batch]
    # What the handler makes of each: the same request, the body decoded the same by the codec.
    processors, rows, ids = Service.retrieve_data_for_inference(ts_batch)
    context = Context("tiny", "/tmp", {}, 8, None, "0.12.0")
    context.request_processor = processors
    for idx, (row, request) in enumerate(zip(rows, wire)):
        theirs, ours = entry._raw_request(row, idx, context), entry._raw_from_wire(request)
        assert (ours.content_type, ours.url_path, ours.method) == (theirs.content_type, theirs.url_path, theirs.method)
        assert _decoded(ours) == _decoded(theirs), request.request_id


def _decoded(raw):
    try:
        return decode_body(raw.body, raw.content_type)
    except Exception as err:  # a refusal: the same status and field
        return type(err).__name__, getattr(err, "http_status", None), getattr(err, "param", None)


def test_the_answer_frame_is_torchserve_s_byte_for_byte():
    responses = [Response.of(200, b'{"data": []}', **{"x-batch-size": "3", "server-timing": "handler;dur=1.000"}),
                 Response.of(503, b'{"error": "busy"}'),  # retry-after
                 Response(404, "{\"error\": \"n\u00e9\"}".encode(), {"x": "\u00e9"}, "text/plain; charset=utf-8")]
    ids = {0: "a1", 1: "b2", 2: "c3"}
    context = Context("tiny", "/tmp", {}, 8, None, "0.12.0")
    context.request_processor = [RequestProcessor({}) for _ in ids]
    entry.EmbeddingHandler._reply(responses, context)
    theirs = create_predict_response([r.body for r in responses], ids, "Prediction success", 200, context=context)
    assert answer_frame(list(ids.values()), responses) == bytes(theirs)


@pytest.mark.parametrize("chunk", [1, 3, 64, 1 << 20])
def test_frames_split_or_joined_anywhere_read_the_same(chunk):
    big = {"id": "big", "parameters": [("body", "application/json", json.dumps({"input": "x" * 300_000}).encode())]}
    frames = [frame(BATCH), frame([big]), frame(BATCH[:1])]
    ours, sock = socket.socketpair()
    writer = threading.Thread(target=lambda: (ours.sendall(b"".join(frames)), ours.shutdown(socket.SHUT_WR)))
    writer.start()
    reader = FrameReader(sock, chunk_bytes=chunk)
    batches = [reader.next_batch() for _ in frames]
    writer.join()
    assert [[r.request_id for r in batch] for batch in batches] == [[r["id"] for r in BATCH], ["big"], ["a1"]]
    assert len(batches[1][0].parameters[0].value) == len(big["parameters"][0][2])
    with pytest.raises(FrontendGone):
        reader.next_batch()


def test_a_frontend_gone_mid_frame_ends_the_read():
    _, sock = _send(frame(BATCH)[:-9])
    with pytest.raises(FrontendGone):
        FrameReader(sock).next_batch()


def test_a_command_other_than_a_batch_is_refused():
    _, sock = _send(b"L" + frame(BATCH)[1:])
    with pytest.raises(UnexpectedCommand, match="b'L'"):
        FrameReader(sock).next_batch()


def test_a_negative_length_is_a_malformed_frame_not_a_loop():
    bad = b"I" + _field(b"a1") + struct.pack("!i", -1) + _field(b"body") + struct.pack("!i", -7)
    _, sock = _send(bad)
    with pytest.raises(MalformedFrame, match="length -7"):
        FrameReader(sock).next_batch()


def test_the_worker_loop_benchmark_reads_its_frames_with_both_loops():
    """bench.worker_loop's frames are batches both readers read whole (its figures would be
    of errors otherwise), and it reports each side's CPU a request."""
    from bench.worker_loop import batch_frame, measure

    data = batch_frame(["one text", "another text"], 7)
    _, sock = _send(data)
    [first, second] = FrameReader(sock).next_batch()
    _, ts_sock = _send(data)
    assert [r["requestId"].decode() for r in retrieve_msg(ts_sock)[1]] == [first.request_id, second.request_id]
    assert json.loads(second.parameters[0].value) == {"input": "another text"}
    result = measure(batches=5, sizes=[1, 3])
    assert [row["batch"] for row in result["rows"]] == [1, 3]
    assert all(value > 0 for row in result["rows"] for side in ("read_us", "write_us") for value in row[side].values())


def test_an_error_no_part_of_the_own_loop_answers_ends_the_worker(tmp_path):
    """The loop's last guard. The fault is injected (the handler's batch step replaced by one that
    raises, as a bug past every per-request answer would): the worker process exits with status 1,
    which TorchServe answers "Worker died." and replaces, having sent nothing and without returning
    into TorchServe's loop, whose batch this is not. A forked process, so that the real exit runs."""
    worker_end, frontend_end = socket.socketpair()

    def worker():
        handler = entry.EmbeddingHandler()
        handler.own_loop, handler.busy = True, BusyMark(tmp_path)

        def broken(raw, context):
            raise RuntimeError("a bug")

        handler._handle = broken
        context = Context("tiny", "/tmp", {}, 8, None, "0.12.0")
        context.request_processor, context.request_ids = [RequestProcessor({})], {0: "a1"}
        context.cl_socket = worker_end
        try:
            handler.handle([{"body": b'{"input": "x"}'}], context)
        except BaseException:
            os._exit(6)  # raised into TorchServe's loop
        os._exit(5)  # returned into TorchServe's loop

    child = multiprocessing.get_context("fork").Process(target=worker)
    child.start()
    child.join(60)
    assert child.exitcode == 1
    frontend_end.setblocking(False)
    with pytest.raises(BlockingIOError):  # open, and nothing was sent on it
        frontend_end.recv(1)
