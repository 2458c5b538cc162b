"""A real HTTP server on loopback that serves image files, for the tests of image URLs: an image
with its media type, one sent as application/octet-stream, a redirect, a 404, a slow answer and an
oversized body; it counts the requests it was sent, so a test can say that nothing was fetched."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator


class ImageHost:
    def __init__(self, files: dict[str, tuple[str, bytes]], slow_s: float = 3.0):
        """`files`: path -> (media type, body). Also served: /moved (a 302 to /cat.png), /slow
        (the first file, after `slow_s`); any other path is a 404."""
        self.files, self.slow_s = files, slow_s
        self.requests: list[str] = []
        host = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                host.requests.append(self.path)
                if self.path == "/moved":
                    self.send_response(302)
                    self.send_header("Location", f"http://127.0.0.1:{host.port}/cat.png")
                    self.end_headers()
                    return
                if self.path == "/slow":
                    time.sleep(host.slow_s)
                    media_type, body = next(iter(host.files.values()))
                elif self.path in host.files:
                    media_type, body = host.files[self.path]
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", media_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):  # a client that read what it needed
                    pass

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


@contextmanager
def image_host(files: dict[str, tuple[str, bytes]], slow_s: float = 3.0) -> Iterator[ImageHost]:
    host = ImageHost(files, slow_s)
    thread = threading.Thread(target=host.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield host
    finally:
        host.server.shutdown()
        host.server.server_close()
