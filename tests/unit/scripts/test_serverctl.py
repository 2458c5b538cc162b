"""serverctl against a stand-in of TorchServe's management API: what it reads of the queue, with
token authorization on (a key file) and off (none)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

from embedserve.archive.ts_config import update_properties
from embedserve.scripts.serverctl import TorchServe


def management(pending: int, seen: list, worker_status: str = "READY"):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802  (the stdlib's name)
            seen.append(self.headers.get("Authorization"))
            body = json.dumps([{"modelName": "m", "jobQueueStatus": {"pendingRequests": pending},
                                "workers": [{"id": "9000", "status": worker_status}]}]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def served_by(server, tmp_path) -> TorchServe:
    config = tmp_path / "config.properties"
    config.write_text("")
    update_properties(config, {"management_address": f"http://127.0.0.1:{server.server_port}",
                               "inference_address": "http://127.0.0.1:1", "metrics_address": "http://127.0.0.1:2",
                               "models": json.dumps({"m": {"1.0": {"defaultVersion": True}}})})
    return TorchServe(config, tmp_path)


def test_pending_requests_are_read_with_and_without_token_authorization(tmp_path):
    seen: list = []
    server = management(3, seen)
    try:
        ts = served_by(server, tmp_path)
        assert ts.pending_requests() == 3 and seen == [None]  # authorization off: no key file, no header
        (tmp_path / "key_file.json").write_text(json.dumps({"inference": {"key": "i"}, "management": {"key": "k"}}))
        assert ts.pending_requests() == 3 and seen[-1] == "Bearer k"
    finally:
        server.shutdown()


def test_a_queue_no_ready_worker_will_take_is_not_waited_for(tmp_path):
    """A model whose worker dies at each start (LOADING, then gone): its queued requests are never
    answered, so a drain does not wait for them."""
    server = management(3, [], worker_status="UNLOADING")
    try:
        ts = served_by(server, tmp_path)
        assert ts.pending_requests() == 0 and ts.drain(5.0)
    finally:
        server.shutdown()
