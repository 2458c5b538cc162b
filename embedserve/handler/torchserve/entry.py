"""TorchServe's entry point: the archive names this file as its handler (archive/build.py).

It reads settings from the model's model-config.yaml, assembles the service, and in `handle`
moves each request's body and headers in and each response's status, headers and body out.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from ts.context import Context
from ts.metrics.dimension import Dimension
from ts.metrics.metric_type_enum import MetricTypes
from ts.service import PREDICTION_METRIC

from embedserve.handler.assembly import assemble
from embedserve.handler.execution.device_errors import DeviceFailure
from embedserve.handler.api.exchange import RawRequest, Response, failed, unavailable_answers
from embedserve.handler.service import EmbeddingService
from embedserve.handler.settings import Settings
from embedserve.handler.torchserve.frontend import answer_limit, frontend_max_response_size
from embedserve.handler.torchserve.profile import TORCHSERVE
from embedserve.handler.torchserve.wire import (FrameReader, FrontendGone, UnexpectedCommand, WireRequest, answer_frame,
                                                reason_phrase)
from embedserve.handler.worker.allocator import FreedMemory, pin_mmap_threshold
from embedserve.handler.worker.busy import BusyMark
from embedserve.handler.worker.failures import log_failure
from embedserve.handler.worker.metrics import BatchReport, MetricBuffer, Row

log = logging.getLogger(__name__)

# After a device failure the worker answers its batch, then exits this long after, so that the
# answers leave first and TorchServe starts a fresh worker (a fresh CUDA context).
EXIT_AFTER_DEVICE_FAILURE_S = 0.5

# TorchServe's own default when model-config.yaml sets none.
DEFAULT_RESPONSE_TIMEOUT_S = 120

# The format of the line TorchServe's backend logs as each batch arrives (ts/protocol/otf_message_handler.py).
RECEIVED_LINE = "Backend received inference at: %d"

# Logged once, as a worker leaves TorchServe's loop for its own.
OWN_LOOP_LINE = "the worker reads and answers its batches itself from here on (own_worker_loop)"

METRIC_TYPES = {"counter": MetricTypes.COUNTER, "histogram": MetricTypes.HISTOGRAM}


class EmbeddingHandler:
    def __init__(self) -> None:
        self.service: EmbeddingService | None = None
        self.initialized = False
        self.device_failure: str | None = None
        self.busy: BusyMark | None = None
        self.freed_memory = FreedMemory()
        self.metrics = MetricBuffer(self._send_metrics)
        self.context: Context | None = None  # the latest batch's, which metric lines are sent through
        self.own_loop = False

    def initialize(self, context: Context) -> None:
        started = time.perf_counter()
        logging.getLogger().addFilter(drop_per_batch_lines)
        pin_mmap_threshold()  # before the model's memory is allocated
        config = context.model_yaml_config or {}
        settings = Settings.from_mapping(config.get("handler"))
        # The frontend drops a worker whose answer exceeds its max_response_size: refuse such requests with 413.
        settings = replace(settings, max_response_bytes=answer_limit(settings.max_response_bytes,
                                                                     frontend_max_response_size()))
        properties = context.system_properties
        self.service = assemble(
            Path(properties["model_dir"]) / settings.model_path,
            settings,
            model_name=context.model_name,
            gpu_id=properties.get("gpu_id"),
            workers=int(config.get("minWorkers") or 1),
            response_timeout_s=float(config.get("responseTimeout") or DEFAULT_RESPONSE_TIMEOUT_S),
            server=TORCHSERVE,
            # The URL's version segment, which the OpenAPI document's paths hold.
            model_version=str((context.manifest or {}).get("model", {}).get("modelVersion") or "1.0"),
        )
        self.busy = BusyMark()
        # Not under torchrun's ranks: there only rank 0 answers, in TorchServe's loop.
        self.own_loop = settings.own_worker_loop and str(os.environ.get("LOCAL_RANK", 0)) == "0"
        self.initialized = True
        info = self.service.info()
        log.info(
            "model %s ready: device=%s dtype=%s engine=%s threads=%d pooling=%s max_length=%d dimension=%d (%.1f s)",
            context.model_name, info["device"], info["model_dtype"], info["engine"],
            self.service.encoder.placement.torch_threads, info["pooling"], info["max_input_length"],
            info["embedding_dimension"], time.perf_counter() - started,
        )

    def handle(self, data: list[dict[str, Any]], context: Context) -> list[bytes]:
        started = time.perf_counter()
        raw = [_raw_request(row, idx, context) for idx, row in enumerate(data)]
        sock = getattr(context, "cl_socket", None)
        if self.own_loop and sock is not None:
            self._serve(sock, context, [context.request_ids[idx] for idx in range(len(raw))], raw, started)
        with self.busy.held():  # a stopping server waits for this batch's answers
            responses = self._handle(raw, context)
        _close_timing(responses, started)
        self._reply(responses, context)
        self.freed_memory.release()  # in the background, while TorchServe sends the answers
        return [response.body for response in responses]

    def _serve(self, sock: socket.socket, context: Context, request_ids: list[str], raw: list[RawRequest],
               started: float) -> NoReturn:
        """TorchServe's worker loop, leaner, from the first batch on: answer the batch, then read the
        next from the frontend's socket (wire.py). The worker never returns to TorchServe's loop; it
        ends as that loop does, when the frontend closes the socket."""
        reader = FrameReader(sock)
        log.info("%s", OWN_LOOP_LINE)
        try:
            while True:
                with self.busy.held():  # a stopping server waits for this batch's answers
                    responses = self._handle(raw, context)
                    _close_timing(responses, started)
                    try:
                        sock.sendall(_answer_frame(request_ids, responses, raw))
                    except OSError as err:
                        log.info("the frontend's socket failed (%s); this worker exits", err)
                        raise SystemExit(0) from None
                # TorchServe's own metric of the batch, as its loop records it.
                context.metrics.add_time(PREDICTION_METRIC, round((time.perf_counter() - started) * 1000, 2))
                self.freed_memory.release()  # in the background, while the next batch is read
                batch = _next_batch(reader)
                started = time.perf_counter()
                request_ids = [request.request_id for request in batch]
                context.metrics.request_ids = dict(enumerate(request_ids))  # what its metric lines are tagged with
                raw = [_raw_from_wire(request) for request in batch]
        except Exception as err:
            # Never back into TorchServe's loop, whose batch this is not: the frontend answers the
            # batch in hand "Worker died." (500) and starts a fresh worker.
            log_failure("the worker's own loop (this worker exits and TorchServe replaces it)", err)
            os._exit(1)

    def _handle(self, raw: list[RawRequest], context: Context) -> list[Response]:
        if self.device_failure is None:
            try:
                responses, report = self.service.handle_with_report(raw)
            except DeviceFailure as err:
                self.device_failure = "the worker's device failed"
                log.critical("device failure (%s); this worker exits and TorchServe replaces it", err)
                threading.Timer(EXIT_AFTER_DEVICE_FAILURE_S, os._exit, args=(3,)).start()
            except Exception as err:  # the service answers per request; this is the last line, never TorchServe's 503
                log_failure("the batch (every request of it is answered 500)", err)
                responses = failed(raw)
                report = BatchReport(requests=len(raw), statuses={500: len(raw)}, task=self.service.task)
        if self.device_failure is not None:
            responses = unavailable_answers(raw, self.device_failure)
            report = BatchReport(requests=len(raw), statuses={503: len(raw)}, task=self.service.task)
        self.context = context
        self.metrics.add(report)
        return responses

    @staticmethod
    def _reply(responses: list[Response], context: Context) -> None:
        for idx, response in enumerate(responses):
            context.set_response_content_type(idx, response.content_type)
            if response.status != 200:
                context.set_response_status(response.status, reason_phrase(response.status), idx)
            for key, value in response.headers.items():
                context.set_response_header(idx, key, value)

    def _send_metrics(self, rows: list[Row]) -> None:
        """One TorchServe metric line per row (it tags them with the latest batch's request ids)."""
        for spec, value, dimension_values in rows:
            # A fresh list each call: TorchServe appends its default dimensions to the one given.
            dimensions = [Dimension(name, label) for name, label in zip(spec.dimensions, dimension_values)]
            self.context.metrics.add_metric(spec.name, value, spec.unit, dimensions=dimensions,
                                            metric_type=METRIC_TYPES[spec.kind])


def drop_per_batch_lines(record: logging.LogRecord) -> bool:
    """TorchServe's backend logs "Backend received inference at: <time>" for every batch, and its
    frontend reads and writes each such line while the batch's forward pass runs, on the cores the
    pass uses. The line says nothing its metrics do not, so the worker drops it."""
    return not (record.msg == RECEIVED_LINE and record.levelno == logging.INFO)


def _close_timing(responses: list[Response], started: float) -> None:
    """The handler's whole time closes each answer's Server-Timing: what it leaves out of a
    request's latency is TorchServe's (bench/latency.py splits it)."""
    timing = f"handler;dur={(time.perf_counter() - started) * 1000:.3f}"
    for response in responses:
        stages = response.headers.get("server-timing")
        response.headers["server-timing"] = f"{stages}, {timing}" if stages else timing


def _answer_frame(request_ids: list[str], responses: list[Response], raw: list[RawRequest]) -> bytes:
    try:
        return answer_frame(request_ids, responses)
    except Exception as err:  # a bug in one answer must not leave its batch unanswered
        log_failure("writing the batch's answers (every request of it is answered 500)", err)
        return answer_frame(request_ids, failed(raw))


def _next_batch(reader: FrameReader) -> list[WireRequest]:
    try:
        return reader.next_batch()
    except FrontendGone:
        log.info("Frontend disconnected.")  # TorchServe's words for the same end
        raise SystemExit(0) from None
    except (UnexpectedCommand, OSError) as err:
        log.critical("reading the next batch failed (%s); this worker exits and TorchServe replaces it", err)
        raise SystemExit(1) from None


def _raw_request(row: dict[str, Any], idx: int, context: Context) -> RawRequest:
    """A request as TorchServe's loop hands it over, its JSON body already decoded."""
    # A plain POST body arrives as the parameter "body" (or "data" from some clients).
    body = row.get("body", row.get("data"))
    content_type = _content_type(idx, context)
    if isinstance(body, str) and content_type == "application/json":
        # TorchServe decoded the JSON body, a JSON string: give the codec what was sent, so that
        # it is refused as JSON that is not an object instead of taken for a text/plain body.
        body = json.dumps(body)
    return _request(body, content_type, _header(context.get_all_request_header(idx), "url_path"))


def _raw_from_wire(request: WireRequest) -> RawRequest:
    """A request as the frontend sent it, its body bytes, read as TorchServe's loop reads it: the
    last parameter of a name wins, the body is "body" or else "data", and the content type is the
    body parameter's or else the request's header."""
    parameters = {parameter.name: parameter for parameter in request.parameters}
    parameter = parameters.get("body", parameters.get("data"))
    content_type = next((parameters[name].content_type for name in ("body", "data")
                         if name in parameters and parameters[name].content_type), None)
    return _request(parameter.value if parameter else None, content_type or _header(request.headers, "content-type"),
                    _header(request.headers, "url_path"))


def _request(body: Any, content_type: str | None, url_path: str | None) -> RawRequest:
    # TorchServe passes the headers and the body but not the HTTP method (TORCHSERVE.note): a request
    # with neither a body nor a content type is what a GET sends, any other is taken for a POST.
    method = "GET" if not body and not content_type else "POST"
    return RawRequest(body=body, content_type=content_type, url_path=url_path, method=method)


def _content_type(idx: int, context: Context) -> str | None:
    # TorchServe records the body parameter's content type under the parameter's name.
    for name in ("body", "data"):
        parameter = context.get_request_header(idx, name)
        if isinstance(parameter, dict) and parameter.get("content-type"):
            return parameter["content-type"]
    return _header(context.get_all_request_header(idx), "content-type")


def _header(headers: dict[str, Any], name: str) -> str | None:
    for key, value in headers.items():
        if key.lower() == name and isinstance(value, str):
            return value
    return None
