"""The command line: `embedserve batch INPUT OUTPUT [--url URL] [--model NAME] [options]`
(also `python -m embedserve.batch INPUT OUTPUT ...`). Without flags it uses the server `make
serve` runs from the working directory (embedserve/batch/target.py). docs/bulk.md has examples.

Exit status: 0 when every row has its result line or row (rows the service refused included),
1 when the job stopped (server unreachable after retries, key refused, bad input; a rerun
continues), 2 for a usage error, 130 when interrupted (Ctrl-C, SIGTERM; a rerun continues)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import orjson

from embedserve.batch.client import Client, Credentials, Stopped
from embedserve.batch.grouping import DEFAULT_ROWS_PER_REQUEST, Budget, groups
from embedserve.batch.inputs import TABLE_FORMATS, BatchFile, InputError, Table, detect_format
from embedserve.batch.outputs import JsonlOutput, ParquetOutput
from embedserve.batch.progress import Progress, Tally
from embedserve.batch.retry import Backoff
from embedserve.batch.runner import Runner
from embedserve.batch.server import Capacity, Endpoint, JobError, Limits, concurrency
from embedserve.batch.target import DEFAULT_URLS, Management, choose_model, default_key_file, default_url

RERANK_URLS = {"/v1/rerank", "/v2/rerank", "/rerank"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="embedserve batch", description="Embed a whole corpus through a running "
                                "embedserve server: an OpenAI batch file or a table in, results in input order out.")
    p.add_argument("input", type=Path, help="an OpenAI batch file (.jsonl) or a table (.parquet, .jsonl, .csv)")
    p.add_argument("output", type=Path, help="batch results (.jsonl), or for a table .parquet or .jsonl; "
                   "an existing output is continued (see --restart)")
    p.add_argument("--url", help="the server's base URL (default: ./config.properties' inference_address, "
                   f"else {DEFAULT_URLS['inference']})")
    p.add_argument("--model", help="the model's name on the server, e.g. minilm (default: the one the batch "
                   "file's lines name in body.model, else the only model the management API lists)")
    p.add_argument("--model-version", default="1.0", help="its version (default: 1.0)")
    p.add_argument("--key", help="the inference key (default: $EMBEDSERVE_KEY, else $KEY, as the README exports it, "
                   "else --key-file)")
    p.add_argument("--key-file", type=Path, help="TorchServe's key_file.json: the key is read from it, and read "
                   "again when the server refuses it (keys expire and rotate); default: ./key_file.json when there")
    p.add_argument("--input-format", choices=("batch", *TABLE_FORMATS), help="default: from the file")
    p.add_argument("--text-column", default="text", help="a table's text column (default: text)")
    p.add_argument("--id-column", help="a table's id column (default: the row number, from 0)")
    p.add_argument("--options", default="{}", help="a table's request options as JSON, e.g. "
                   "'{\"prompt_name\": \"document\", \"dimensions\": 256}' (docs/requests.md)")
    p.add_argument("--concurrency", type=int, help="requests in flight (default: from the server, see docs/bulk.md)")
    p.add_argument("--rows-per-request", type=int, default=DEFAULT_ROWS_PER_REQUEST,
                   help=f"a table's rows per request at most (default: {DEFAULT_ROWS_PER_REQUEST}; "
                   "the server's limits may ask for fewer)")
    p.add_argument("--management-url", help="TorchServe's management API (e.g. http://127.0.0.1:8081), to find the "
                   "model and size the concurrency by its workers and batch size (default: ./config.properties' "
                   "management_address when --url is not given)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for one answer (default: 180)")
    p.add_argument("--retries", type=int, default=Backoff.retries,
                   help=f"retries of one request before the job stops (default: {Backoff.retries})")
    p.add_argument("--restart", action="store_true", help="start over instead of continuing an existing output")
    p.add_argument("--progress", choices=("auto", "bar", "log", "none"), default="auto",
                   help="a bar on a terminal, else a log line every --log-every seconds")
    p.add_argument("--log-every", type=float, default=15.0, help="seconds between log lines (default: 15)")
    return p


def main(argv: list[str] | None = None) -> int:
    """The `embedserve` console script: `embedserve batch ...`."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "batch":
        print("usage: embedserve batch INPUT OUTPUT [--url URL] [--model NAME] [options]\n"
              "       (embedserve batch --help for every option)", file=sys.stderr)
        return 2
    return run(argv[1:])


def run(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    stop = threading.Event()
    try:
        job = Job(args, stop)
        return job.run()
    except JobError as err:
        print(f"embedserve batch: error: {err}", file=sys.stderr)
        return 1


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def comparable(value: Any) -> Any:
    """A row's id as JSON gives it back, so that ids read from the input and the output compare."""
    return orjson.loads(orjson.dumps(value, default=str))


class Job:
    def __init__(self, args: argparse.Namespace, stop: threading.Event):
        self.args, self.stop = args, stop
        if not args.input.is_file():
            raise InputError(f"{args.input}: no such file")
        self.format = detect_format(args.input, args.input_format)
        if self.format == "batch":
            self.source = BatchFile(args.input)
        else:
            self.source = Table(args.input, self.format, args.text_column, args.id_column)
        suffix = args.output.suffix.lower()
        if suffix not in (".jsonl", ".parquet") or (self.format == "batch" and suffix != ".jsonl"):
            raise JobError(f"{args.output}: write batch results to a .jsonl file, a table's vectors to .parquet "
                           "or .jsonl")
        self.options = self._options()
        key = args.key or (None if args.key_file else os.environ.get("EMBEDSERVE_KEY") or os.environ.get("KEY"))
        self.key_file = default_key_file(args.key_file, key is not None)
        self.credentials = Credentials(key, self.key_file)
        self.client = Client(self.credentials, Backoff(retries=args.retries), args.timeout, stop)
        self.url = args.url or default_url("inference")
        # The management API of the same server: given, or the working directory's beside its default --url.
        management = args.management_url or (None if args.url else default_url("management"))
        self.management = Management(management, self.key_file) if management else None
        self.endpoint: Endpoint | None = None  # once the input names its model (run)

    def _endpoint(self) -> Endpoint:
        if self.args.model:
            return Endpoint(self.url, self.args.model, self.args.model_version)
        model, note = choose_model(set(self.source.models), self.management)
        if note:
            print(f"embedserve batch: {note}", file=sys.stderr)
        return Endpoint(self.url, model, self.args.model_version)

    def _options(self) -> dict[str, Any]:
        try:
            options = json.loads(self.args.options)
        except ValueError as err:
            raise JobError(f"--options is not JSON: {err}") from None
        if not isinstance(options, dict) or "input" in options:
            raise JobError("--options must be a JSON object of request options, without 'input'")
        return options

    def _concurrency(self) -> int:
        if self.args.concurrency:
            return max(1, self.args.concurrency)
        capacity = None
        if self.management:
            path = f"models/{self.endpoint.model}/{self.endpoint.version}"
            try:
                capacity = Capacity.from_management(self.management.get(path))
            except (OSError, ValueError, KeyError, TypeError, IndexError) as err:
                print(f"embedserve batch: cannot read the workers from {self.management.url}/{path} ({err}); "
                      "using the default concurrency", file=sys.stderr)
        return concurrency(capacity, self.source.grouped)

    def _unserved(self, limits: Limits) -> dict[str, str]:
        """The batch file's urls the model does not serve, and why: those lines get that error. A
        table goes to /v1/embeddings, which a model of another task does not serve: the job stops."""
        if self.format == "batch":
            urls = self.source.urls
            wrong = urls - RERANK_URLS if limits.task == "rerank" else urls & RERANK_URLS if limits.task == "embed" else urls
        else:
            wrong = {"/v1/embeddings"} if limits.task != "embed" else set()
        why = {url: f"model {self.endpoint.model} (task: {limits.task}) does not serve {url}" for url in wrong}
        if why and self.format != "batch":
            raise JobError(why["/v1/embeddings"])
        return why

    def _values(self, limits: Limits) -> int:
        """Values a vector has in the answer: `dimensions`, or 1 bit a dimension packed 8 to a byte."""
        dimensions = int(self.options.get("dimensions") or limits.dimension)
        return -(-dimensions // 8) if self.options.get("output_dtype") in ("binary", "ubinary") else dimensions

    def _output(self, values: int):
        if self.args.output.suffix.lower() == ".parquet":
            return ParquetOutput(self.args.output, values)
        return JsonlOutput(self.args.output, "custom_id" if self.format == "batch" else "id")

    def _resume(self, output, total: int) -> int:
        """Rows an earlier run wrote (checked against the input), or 0 when starting over."""
        if self.args.restart:
            return 0
        done, last = output.resume()
        if done > total:
            raise JobError(f"{self.args.output} holds {done} rows, more than the {total} of {self.args.input}: "
                           "another job's output? (--restart starts over)")
        if done:
            entry = next(self.source.entries(done - 1))
            expected = entry.custom_id if self.format == "batch" else entry.id
            if comparable(expected) != comparable(last):
                raise JobError(f"{self.args.output} ends with row {done} named {last!r}, but row {done} of "
                               f"{self.args.input} is {expected!r}: another input? (--restart starts over)")
        return done

    def run(self) -> int:
        args = self.args
        total = self.source.scan()
        self.endpoint = self._endpoint()
        limits = Limits.from_info(self.client.get_json(self.endpoint.route("info"), "the model's /info"))
        unserved = self._unserved(limits)
        values = self._values(limits)
        output = self._output(values)
        if isinstance(output, ParquetOutput) and args.output.exists() and not output.parts.exists() \
                and not args.restart:
            print(f"embedserve batch: {args.output} is complete; --restart embeds again", file=sys.stderr)
            return 0
        done = self._resume(output, total)
        width = self._concurrency()
        tally = Tally(total=total, skipped=done)
        progress = Progress(tally, "log" if args.progress == "none" else args.progress,
                            float("inf") if args.progress == "none" else args.log_every)
        print(f"embedserve batch: {total} rows from {args.input} ({self.format}), "
              f"{'continuing after row ' + str(done) if done else 'starting'}; {width} requests in flight",
              file=sys.stderr, flush=True)
        runner = Runner(self.client, self.endpoint, output, tally, progress, width, self.stop)
        previous = signal.signal(signal.SIGTERM, _interrupt) if threading.current_thread() is threading.main_thread() \
            else None
        output.start(args.restart)
        outcome, code, complete = "done", 0, False
        try:
            if self.format == "batch":
                runner.run_lines(self.source.entries(done), unserved)
            else:
                budget = Budget.of(limits, width, values, self.endpoint.model, args.rows_per_request)
                runner.run_groups(groups(self.source.entries(done), budget), self.options, values)
            complete = True
        except KeyboardInterrupt:
            self.stop.set()
            outcome, code = "interrupted (a rerun continues)", 130
        except (JobError, Stopped) as err:
            self.stop.set()
            reason = runner.pool.failure or err
            outcome, code = f"stopped: {reason} (a rerun continues)", 1
        finally:
            output.close(complete)
            progress.close()
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        print(tally.summary(self.client.retries, outcome), file=sys.stderr, flush=True)
        return code
