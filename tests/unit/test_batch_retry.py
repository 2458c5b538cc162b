"""embedserve batch's retry policy: which answers are sent again (with TorchServe's and the
handler's real error bodies), the backoff's bounds, and the client's loop against a real HTTP
server that answers 503 with Retry-After before it answers 200."""

from __future__ import annotations

import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from embedserve.batch.client import Client, Credentials
from embedserve.batch.retry import Backoff, Verdict, retry_after_seconds, verdict
from embedserve.batch.server import JobError
from embedserve.scripts.serverctl import free_port

# Bodies as TorchServe 0.12 and the handler answer them (docs/api.md, docs/operations.md).
TS_KEY = b'{\n  "code": 400,\n  "type": "InvalidKeyException",\n  "message": "Token Authorization failed."\n}'
TS_QUEUE_FULL = b'{\n  "code": 503,\n  "type": "ServiceUnavailableException",\n  "message": "Model \\"m\\" has no worker"\n}'
TS_WORKER_DIED = b'{\n  "code": 507,\n  "type": "InternalServerException",\n  "message": "Worker died."\n}'
TS_WORKER_DIED_500 = TS_WORKER_DIED.replace(b"507", b"500")


def handler_error(code: str) -> bytes:
    return json.dumps({"error": {"message": "m", "type": "t", "param": None, "code": code}}).encode()


@pytest.mark.parametrize("status, body, attempt, expected", [
    (200, b"{}", 0, Verdict.FINAL),
    (429, handler_error("overloaded"), 5, Verdict.RETRY),
    (503, handler_error("overloaded"), 0, Verdict.RETRY),
    (503, TS_QUEUE_FULL, 3, Verdict.RETRY),
    (502, b"bad gateway", 0, Verdict.RETRY),
    (504, b"", 0, Verdict.RETRY),
    (507, TS_WORKER_DIED, 2, Verdict.RETRY),
    (500, TS_WORKER_DIED_500, 2, Verdict.RETRY),
    (500, handler_error("internal_error"), 0, Verdict.RETRY),  # sent once more ...
    (500, handler_error("internal_error"), 1, Verdict.FINAL),  # ... then it is this request's answer
    (507, handler_error("out_of_memory"), 0, Verdict.FINAL),
    (400, handler_error("invalid_request"), 0, Verdict.FINAL),
    (413, handler_error("too_large"), 0, Verdict.FINAL),
    (413, b"", 0, Verdict.FINAL),  # TorchServe's own 413 to a body over max_request_size
    (422, b'{"error": "x", "error_type": "Validation"}', 0, Verdict.FINAL),
    (400, TS_KEY, 0, Verdict.KEY_REFUSED),
])
def test_verdicts(status, body, attempt, expected):
    assert verdict(status, body, attempt) is expected


def test_backoff_grows_with_jitter_within_bounds():
    backoff, rng = Backoff(retries=10, base_s=0.5, most_s=30.0), random.Random(0)
    for retry in range(12):
        cap = min(30.0, 0.5 * 2 ** retry)
        waits = [backoff.wait(retry, rng=rng) for _ in range(200)]
        assert all(cap / 2 <= w <= cap for w in waits)
        assert len(set(waits)) > 150  # jittered: clients that failed together spread out
    least, most = backoff.total_bounds()
    assert (least, most) == (75.75, 151.5)


def test_retry_after_is_honoured_but_bounded():
    backoff = Backoff(base_s=0.01, most_s=30.0)
    assert backoff.wait(0, "7") >= 7.0
    assert backoff.wait(0, "3600") == 30.0
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0
    assert retry_after_seconds(None) == 0.0


class Scripted(BaseHTTPRequestHandler):
    """Answers the scripted (status, headers, body) in turn, then 200; records each call's key."""

    script: list = []
    seen: list = []

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        type(self).seen.append((time.monotonic(), self.headers.get("authorization")))
        status, headers, body = type(self).script.pop(0) if type(self).script else (200, {}, b'{"ok": true}')
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def http_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    Scripted.script, Scripted.seen = [], []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


def test_the_client_retries_until_served_and_honours_retry_after(http_server):
    Scripted.script = [(503, {"retry-after": "1"}, handler_error("overloaded")), (507, {}, TS_WORKER_DIED)]
    client = Client(Credentials("k1", None), Backoff(retries=3, base_s=0.01), 10, threading.Event())
    answer = client.post(http_server, b"{}")
    assert answer.status == 200 and answer.body == b'{"ok": true}'
    times = [t for t, _ in Scripted.seen]
    assert len(times) == 3 and times[1] - times[0] >= 0.95  # the server asked for a second
    assert client.retries == {"503": 1, "507": 1}
    assert Scripted.seen[0][1] == "Bearer k1"


def test_a_final_answer_is_returned_not_retried(http_server):
    Scripted.script = [(413, {}, handler_error("too_large"))]
    client = Client(Credentials(None, None), Backoff(retries=3, base_s=0.01), 10, threading.Event())
    assert client.post(http_server, b"{}").status == 413
    assert len(Scripted.seen) == 1 and Scripted.seen[0][1] is None


def test_out_of_retries_stops_the_job(http_server):
    Scripted.script = [(503, {}, TS_QUEUE_FULL)] * 5
    client = Client(Credentials("k", None), Backoff(retries=2, base_s=0.01), 10, threading.Event())
    with pytest.raises(JobError, match="failed 3 times, the last with HTTP 503"):
        client.post(http_server, b"{}")


def test_an_unreachable_server_stops_the_job_after_its_retries():
    client = Client(Credentials("k", None), Backoff(retries=2, base_s=0.01), 5, threading.Event())
    with pytest.raises(JobError, match="failed 3 times, the last with ConnectionError"):
        client.post(f"http://127.0.0.1:{free_port()}/", b"{}")
    assert client.retries == {"connection": 2}


def test_a_refused_key_is_read_again_from_the_key_file(http_server, tmp_path):
    key_file = tmp_path / "key_file.json"
    key_file.write_text(json.dumps({"inference": {"key": "old"}}))
    credentials = Credentials(None, key_file)
    client = Client(credentials, Backoff(retries=3, base_s=0.01), 10, threading.Event())
    key_file.write_text(json.dumps({"inference": {"key": "new"}}))  # rotated after it was read
    Scripted.script = [(400, {}, TS_KEY)]
    assert client.post(http_server, b"{}").status == 200
    assert [key for _, key in Scripted.seen] == ["Bearer old", "Bearer new"]
    Scripted.script = [(400, {}, TS_KEY)]  # refused again, and the file holds nothing newer
    with pytest.raises(JobError, match="refused the inference key"):
        client.post(http_server, b"{}")
