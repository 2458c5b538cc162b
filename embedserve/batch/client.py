"""One request through the service as a well-behaved client sends it: the inference key as a
bearer token, a session per thread, retries with backoff on what retry.py calls transient, and
the key file read again when TorchServe refuses the key (keys expire and rotate, docs/operations.md)."""

from __future__ import annotations

import json
import threading
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import requests

from embedserve.batch.retry import Backoff, Verdict, verdict
from embedserve.batch.server import JobError

JSON_HEADERS = {"Content-Type": "application/json"}
CONNECTION_ERRORS = (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError)


class Stopped(Exception):
    """The job is stopping (another request failed for good, or Ctrl-C): this request is dropped."""


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    request_id: str


class Credentials:
    """The inference key: given, or read from TorchServe's key_file.json (again whenever it is refused)."""

    def __init__(self, key: str | None, key_file: Path | None):
        self.key_file = key_file
        self._lock = threading.Lock()
        self.key = key if key is not None else self._read()

    def _read(self) -> str | None:
        if self.key_file is None:
            return None
        try:
            return json.loads(self.key_file.read_text())["inference"]["key"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise JobError(f"cannot read the inference key from {self.key_file}: {err}") from None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def renewed(self, refused: str | None) -> bool:
        """After `refused` was refused: whether another key is now at hand (the file was rewritten)."""
        with self._lock:
            if self.key != refused:
                return True  # another thread already read the new one
            fresh = self._read() if self.key_file else None
            if fresh and fresh != refused:
                self.key = fresh
                return True
            return False


class Client:
    def __init__(self, credentials: Credentials, backoff: Backoff, timeout_s: float, stop: threading.Event):
        self.credentials = credentials
        self.backoff = backoff
        self.timeout_s = timeout_s
        self.stop = stop
        self.retries: Counter[str] = Counter()  # retried answers by status (or "connection")
        self._count_lock = threading.Lock()
        self._local = threading.local()

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        return session

    def send(self, method: str, url: str, body: bytes | None = None) -> Answer:
        """The request's final answer (any status); JobError once retries run out or the key is refused."""
        retry = 0
        while True:
            if self.stop.is_set():
                raise Stopped
            key = self.credentials.key
            try:
                response = self._session().request(method, url, data=body, timeout=self.timeout_s,
                                                   headers={**JSON_HEADERS, **self.credentials.headers()})
                answer = Answer(response.status_code, response.content,
                                response.headers.get("x-request-id") or f"req_{uuid.uuid4().hex}")
                outcome, retry_after, reason = verdict(answer.status, answer.body, retry), \
                    response.headers.get("retry-after"), str(answer.status)
            except CONNECTION_ERRORS as err:
                answer, outcome, retry_after, reason = None, Verdict.RETRY, None, "connection"
                last_error = f"{type(err).__name__}: {err}"
            if outcome is Verdict.FINAL:
                return answer
            if outcome is Verdict.KEY_REFUSED:
                if self.credentials.renewed(key):
                    continue
                where = f"; {self.credentials.key_file} holds no newer one" if self.credentials.key_file else \
                    " (give --key-file key_file.json to read rotated keys)"
                raise JobError(f"the server refused the inference key{where}")
            if retry >= self.backoff.retries:
                said = last_error if answer is None else f"HTTP {answer.status}: {answer.body[:300]!r}"
                raise JobError(f"{url} failed {retry + 1} times, the last with {said}")
            with self._count_lock:
                self.retries[reason] += 1
            if self.stop.wait(self.backoff.wait(retry, retry_after)):
                raise Stopped
            retry += 1

    def post(self, url: str, body: bytes) -> Answer:
        return self.send("POST", url, body)

    def get_json(self, url: str, what: str) -> dict | list:
        answer = self.send("GET", url)
        if answer.status != 200:
            raise JobError(f"{what} ({url}) answered HTTP {answer.status}: {answer.body[:300].decode(errors='replace')}")
        try:
            return json.loads(answer.body)
        except ValueError:
            raise JobError(f"{what} ({url}) answered something that is not JSON: {answer.body[:200]!r}") from None
