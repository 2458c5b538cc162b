"""Locust load test of the embedding routes (native, OpenAI, TEI) with realistic text lengths.

    python -m locust -f bench/locustfile.py --headless --host http://127.0.0.1:8080 \\
        --users 16 --spawn-rate 4 --run-time 60s --model minilm --key-file key_file.json

`python -m embedserve.scripts.loadtest` (what `make loadtest` runs) starts the server when needed and passes
all of this. Texts come from the long-tailed mixed corpus of embedserve/archive/corpus.py (4-256 tokens,
median about 40); most requests carry one text, the others a handful. Every answer is checked:
HTTP 200, one embedding per text, each of the model's dimension (read once per user from
/info). Anything else is a failure in Locust's statistics, with the reason.

Options (each also an environment variable): --model (EMBEDSERVE_MODEL), --model-version
(EMBEDSERVE_MODEL_VERSION), --key-file (EMBEDSERVE_KEY_FILE: the server's key_file.json, whose
inference key every request sends), --tokenizer (EMBEDSERVE_TOKENIZER: the tokenizer.json the
texts are made from; all-MiniLM-L6-v2's by default). The host is Locust's --host (LOCUST_HOST).

Only loopback hosts are accepted, and a run given no --run-time stops after 60 s.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import json
import logging
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import gevent
from locust import FastHttpUser, events, task
from locust.exception import StopUser
from locust.stats import CSV_STATS_INTERVAL_SEC

from embedserve.archive.corpus import mixed_corpus
from embedserve.archive.default_model import fetch_default_model

DEFAULT_RUN_TIME_S = 60
CORPUS_SIZE = 1024
SINGLE_TEXT_SHARE = 0.7  # share of requests carrying one text; the others carry a handful
HANDFUL = (2, 8)

logger = logging.getLogger("embedserve.loadtest")


@dataclass
class Target:
    """The model, key and texts that every user sends with; set once per process by `_prepare`."""
    model: str = ""
    version: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    texts: list[str] = field(default_factory=list)


target = Target()


def is_loopback(url: str | None) -> bool:
    # Names other than localhost are refused rather than resolved: what a name resolves to can change.
    host = urlsplit(url or "").hostname
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def inference_key(key_file: Path) -> str:
    return json.loads(key_file.read_text())["inference"]["key"]


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    group = parser.add_argument_group("embedserve")
    group.add_argument("--model", env_var="EMBEDSERVE_MODEL", default="minilm", help="served model name")
    group.add_argument("--model-version", env_var="EMBEDSERVE_MODEL_VERSION", default="1.0",
                       help="the model version in the OpenAI and TEI routes' URLs")
    group.add_argument("--key-file", env_var="EMBEDSERVE_KEY_FILE", default="key_file.json",
                       help="the server's key_file.json; requests send its inference key")
    group.add_argument("--tokenizer", env_var="EMBEDSERVE_TOKENIZER", default="",
                       help="tokenizer.json to make the texts from (default: all-MiniLM-L6-v2's)")


@events.init.add_listener
def _prepare(environment, **_kwargs) -> None:
    options = environment.parsed_options
    if not is_loopback(environment.host):
        logger.error("refusing host %r: this load test targets loopback only (127.0.0.0/8, ::1, localhost); "
                     "pass --host http://127.0.0.1:PORT", environment.host)
        sys.exit(2)  # before any user starts: no request leaves the machine
    if options.run_time is None:
        options.run_time = DEFAULT_RUN_TIME_S  # a forgotten --run-time must not load the server forever
        logger.info("no --run-time given: stopping after %d s", DEFAULT_RUN_TIME_S)
    key_file = Path(options.key_file)
    try:
        key = inference_key(key_file)
    except (OSError, ValueError, KeyError) as err:
        logger.error("cannot read the inference key from %s (%s); the server writes it when it starts",
                     key_file, err)
        sys.exit(2)
    tokenizer = Path(options.tokenizer) if options.tokenizer else fetch_default_model() / "tokenizer.json"
    target.model, target.version = options.model, options.model_version
    target.headers = {"Authorization": f"Bearer {key}"}
    target.texts = mixed_corpus(tokenizer, CORPUS_SIZE)
    # The event loop has not run since Locust started; its clock, which times --run-time, would
    # otherwise still read the start-up time and end the run early by however long that took.
    gevent.get_hub().loop.update_now()


@events.quitting.add_listener
def _let_the_csv_catch_up(environment, **_kwargs) -> None:
    # Locust rewrites its --csv files once a second and not again at exit; one more pass makes
    # them hold the final numbers rather than those of up to a second before.
    if environment.parsed_options and environment.parsed_options.csv_prefix:
        gevent.sleep(CSV_STATS_INTERVAL_SEC + 0.2)


# How many values each embedding of an answer has, per answer shape.
def openai_float_dimensions(body) -> list[int]:
    return [len(item["embedding"]) for item in body["data"]]


def openai_base64_dimensions(body) -> list[float]:
    # little-endian float32: 4 bytes per value
    return [len(base64.b64decode(item["embedding"], validate=True)) / 4 for item in body["data"]]


def tei_dimensions(body) -> list[int]:
    return [len(vector) for vector in body]


class EmbeddingClient(FastHttpUser):
    """A client that sends its next request as soon as the previous one is answered.

    FastHttpUser rather than HttpUser: the load generator shares the machine with the server,
    and geventhttpclient costs a fraction of requests' CPU per request."""

    dimension: int | None = None

    def on_start(self) -> None:
        if not is_loopback(self.host):  # a host typed into the web UI after start-up
            logger.error("refusing host %r: loopback only", self.host)
            raise StopUser()
        self.dimension = self._fetch_dimension()

    @task(3)
    def native(self) -> None:
        texts = self._pick_texts()
        self._post("native", f"/predictions/{target.model}", {"input": _one_or_list(texts)}, len(texts),
                   openai_float_dimensions)

    @task(2)
    def openai(self) -> None:
        texts = self._pick_texts()
        # base64 is what the official openai client asks for unless told otherwise.
        body = {"input": _one_or_list(texts), "model": target.model, "encoding_format": "base64"}
        self._post("openai", f"{self._versioned()}/v1/embeddings", body, len(texts), openai_base64_dimensions)

    @task(1)
    def tei(self) -> None:
        texts = self._pick_texts()
        self._post("tei", f"{self._versioned()}/embed", {"inputs": _one_or_list(texts)}, len(texts),
                   tei_dimensions)

    def _versioned(self) -> str:
        return f"/predictions/{target.model}/{target.version}"

    def _pick_texts(self) -> list[str]:
        count = 1 if random.random() < SINGLE_TEXT_SHARE else random.randint(*HANDFUL)
        return random.sample(target.texts, count)

    def _fetch_dimension(self) -> int | None:
        with self.client.get(f"{self._versioned()}/info", headers=target.headers, name="info",
                             catch_response=True) as response:
            if response.status_code != 200:
                response.failure(_status_problem(response))
                return None
            try:
                dimension = int(response.json()["embedding_dimension"])
            except (ValueError, KeyError, TypeError):
                response.failure("malformed /info answer")
                return None
            response.success()
            return dimension

    def _post(self, route: str, path: str, body: dict, count: int, dimensions_of) -> None:
        name = f"{route} 1 text" if count == 1 else f"{route} {HANDFUL[0]}-{HANDFUL[1]} texts"
        with self.client.post(path, json=body, headers=target.headers, name=name,
                              catch_response=True) as response:
            problem = self._problem(response, count, dimensions_of)
            if problem:
                response.failure(problem)
            else:
                response.success()

    def _problem(self, response, count: int, dimensions_of) -> str | None:
        if response.status_code != 200:
            return _status_problem(response)
        try:
            dimensions = dimensions_of(response.json())
        except (ValueError, KeyError, TypeError, binascii.Error):
            return "malformed answer"
        if len(dimensions) != count:
            return f"{len(dimensions)} embeddings for {count} texts"
        if self.dimension is None:
            return "the model's dimension is unknown: /info failed"
        wrong = [d for d in dimensions if d != self.dimension]
        if wrong:
            return f"dimension {wrong[0]:g}, expected {self.dimension}"
        return None


def _one_or_list(texts: list[str]) -> str | list[str]:
    # A single text goes as a bare string, as many callers send it.
    return texts[0] if len(texts) == 1 else texts


def _status_problem(response) -> str:
    if response.status_code == 0:  # no HTTP answer at all: refused, reset, timed out
        return f"no answer: {getattr(response, 'error', None) or 'connection failed'}"
    # One short line, so that Locust's failure table groups alike errors together.
    return f"HTTP {response.status_code}: {' '.join((response.text or '').split())[:120]}"
