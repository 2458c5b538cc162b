"""Image items that name a URL, fetched only from the hosts the server's `image_url_hosts` names.

By default it names none and no URL is fetched: a server that fetched what a request names would
be a way into the network it sits in (cloud metadata endpoints, internal services). An operator
who wants URLs names the hosts that serve the images, and nothing else is reached:
- http and https alone; the URL's host compared as written (no resolution first), case aside;
  an entry with a port ("images.internal:8080") allows that port alone, one without it any port;
- a redirect is not followed (it could lead anywhere) but refused, naming where it leads;
- the body read up to max_image_bytes, refused past it (413) before the rest is read;
- a request's URLs fetched side by side (FETCHES_AT_ONCE), all within one deadline of
  image_url_timeout_s, so that a slow host holds a worker for that long at most;
- an answer other than 200, a failed connection, or the deadline passed: 422 naming the item.
The image's format: the answer's Content-Type where it is an image kind's media type, else what its bytes are.
"""

from __future__ import annotations

import http.client
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence
from urllib.parse import urlsplit

from embedserve.handler.api.codec import short
from embedserve.handler.api.errors import RequestError, too_large, unprocessable

FETCHES_AT_ONCE = 8


@dataclass(frozen=True)
class FetchedImage:
    media_type: str  # "": the format its bytes are
    data: bytes


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 (urllib's signature)
        raise urllib.error.HTTPError(newurl, code, f"redirects to {newurl}", headers, fp)


def host_allowed(url: str, hosts: Sequence[str]) -> bool:
    """Whether `url`'s host (and port) is one an entry of `hosts` names."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    try:
        port = parts.port
    except ValueError:  # a port that is not a number
        return False
    return any(entry == host or (port is not None and entry == f"{host}:{port}") for entry in hosts)


class ImageUrls:
    def __init__(self, hosts: Sequence[str], timeout_s: float, max_bytes: int, media_types: Sequence[str]):
        """`max_bytes`: an image's limit (max_image_bytes); `media_types`: the image kind's."""
        self.hosts = tuple(host.lower() for host in hosts)
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.media_types = tuple(media_types)
        # Direct, whatever proxy the environment names: the allowlist is of the hosts reached.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirects())

    def fetch(self, urls: Sequence[tuple[str, str]]) -> list[FetchedImage]:
        """Each (URL, its item's name) fetched, in order; the first failure raised, naming its item."""
        for url, param in urls:
            if not host_allowed(url, self.hosts):
                why = (f"of a host the server does not fetch from (its image_url_hosts setting names "
                       f"{', '.join(self.hosts)})" if self.hosts else
                       "and the server fetches no URL (its image_url_hosts setting names no host)")
                raise unprocessable(f"'{param}' is a URL {why}: send the image itself as a data URI "
                                    "(data:image/png;base64,...)", param=param)
        if not urls:
            return []
        deadline = time.monotonic() + self.timeout_s
        pool = ThreadPoolExecutor(max_workers=min(FETCHES_AT_ONCE, len(urls)), thread_name_prefix="image-url")
        try:
            futures = [pool.submit(self._fetch_one, url, param, deadline) for url, param in urls]
            fetched = []
            for future, (_, param) in zip(futures, urls):
                try:
                    fetched.append(future.result(timeout=max(0.0, deadline - time.monotonic())))
                except TimeoutError:
                    raise self._late(param) from None
            return fetched
        finally:
            pool.shutdown(wait=False, cancel_futures=True)  # a fetch past the deadline ends at its socket timeout

    def _late(self, param: str) -> RequestError:
        return unprocessable(f"'{param}': fetching the image took longer than image_url_timeout_s="
                             f"{self.timeout_s:g}", param=param)

    def _fetch_one(self, url: str, param: str, deadline: float) -> FetchedImage:
        left = deadline - time.monotonic()
        if left <= 0:
            raise self._late(param)
        request = urllib.request.Request(url, headers={"Accept": ", ".join(self.media_types)})
        try:
            with self._opener.open(request, timeout=left) as answer:
                data = answer.read(self.max_bytes + 1)
                media_type = (answer.headers.get_content_type() or "").lower()
        except urllib.error.HTTPError as err:
            what = err.msg if 300 <= err.code < 400 else f"HTTP {err.code}"
            raise unprocessable(f"'{param}': fetching {short(url)} answered {what}", param=param) from None
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as err:
            if time.monotonic() >= deadline:
                raise self._late(param) from None
            reason = getattr(err, "reason", err)
            raise unprocessable(f"'{param}': fetching {short(url)} failed ({short(str(reason))})",
                                param=param) from None
        if len(data) > self.max_bytes:
            raise too_large(f"'{param}': the image at {short(url)} is over the limit max_image_bytes="
                            f"{self.max_bytes}", param=param)
        return FetchedImage(media_type if media_type in self.media_types else "", data)
