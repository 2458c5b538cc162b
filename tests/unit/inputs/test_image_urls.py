"""Image URLs (embedserve/handler/inputs/image_urls.py) against a real HTTP server on loopback:
nothing fetched unless image_url_hosts names the host, and then the image fetched under the limits,
redirects, error answers, slow hosts and oversized bodies refused naming the item."""

from __future__ import annotations

import io
import time

import numpy as np
import pytest
from PIL import Image

from embedserve.handler.api.errors import RequestError
from embedserve.handler.inputs.image import MEDIA_TYPES, ImageLimits, decode_bytes, read_image
from embedserve.handler.inputs.image_urls import ImageUrls, host_allowed
from tests.support.image_host import image_host
from tests.support.images import image_file, photo

PNG, JPEG = image_file(photo(), "PNG"), image_file(photo(80, 60), "JPEG")
FILES = {"/cat.png": ("image/png", PNG), "/cat.jpg": ("application/octet-stream", JPEG),
         "/page.html": ("text/html", b"<html>not an image</html>"), "/big.png": ("image/png", PNG + b"\0" * 4096)}


@pytest.fixture(scope="module")
def host():
    with image_host(FILES, slow_s=3.0) as served:
        yield served


def urls(hosts=("127.0.0.1",), timeout_s=10.0, max_bytes=10 * 2**20) -> ImageUrls:
    return ImageUrls(hosts, timeout_s, max_bytes, tuple(MEDIA_TYPES))


def refusal(fetcher: ImageUrls, url: str) -> RequestError:
    with pytest.raises(RequestError) as caught:
        fetcher.fetch([(url, "input[0].image")])
    assert caught.value.param == "input[0].image" and "'input[0].image'" in caught.value.message
    return caught.value


def test_by_default_no_url_is_fetched_and_the_host_sees_no_request(host):
    before = len(host.requests)
    for url in (host.url("/cat.png"), "http://169.254.169.254/latest/meta-data"):
        error = refusal(urls(hosts=()), url)
        assert error.status == 400 and "fetches no URL" in error.message and "image_url_hosts" in error.message
    assert len(host.requests) == before


def test_an_allowed_host_s_image_is_fetched_and_decodes_to_its_pixels(host):
    png, jpeg = urls().fetch([(host.url("/cat.png"), "input[0]"), (host.url("/cat.jpg"), "input[1]")])
    assert (png.media_type, png.data) == ("image/png", PNG)
    assert (jpeg.media_type, jpeg.data) == ("", JPEG)  # not an image media type: its bytes say what it is
    decoded = decode_bytes(jpeg.data, jpeg.media_type, "input[1]", ImageLimits())
    assert np.array_equal(np.asarray(decoded), np.asarray(Image.open(io.BytesIO(JPEG)).convert("RGB")))


def test_hosts_and_ports_are_matched_as_written():
    assert host_allowed("http://Images.Example.com/a.png", ("images.example.com",))
    assert host_allowed("https://images.example.com:8443/a.png", ("images.example.com",))  # any port
    assert host_allowed("http://127.0.0.1:9000/a.png", ("127.0.0.1:9000",))
    assert not host_allowed("http://127.0.0.1:9001/a.png", ("127.0.0.1:9000",))
    assert not host_allowed("http://images.example.com.evil.net/a.png", ("images.example.com",))
    assert not host_allowed("http://evil.net/?images.example.com", ("images.example.com",))
    assert not host_allowed("http://images.example.com@evil.net/a.png", ("images.example.com",))
    assert not host_allowed("http://127.0.0.1:notaport/a.png", ("127.0.0.1",))


def test_a_host_not_named_is_refused_even_where_others_are(host):
    error = refusal(urls(hosts=("images.example.com",)), host.url("/cat.png"))
    assert "does not fetch from" in error.message and "images.example.com" in error.message


def test_a_redirect_is_refused_not_followed(host):
    before = host.requests.count("/cat.png")
    error = refusal(urls(), host.url("/moved"))
    assert error.status == 400 and "redirects to" in error.message
    assert host.requests.count("/cat.png") == before


def test_an_error_answer_is_refused_with_its_status(host):
    error = refusal(urls(), host.url("/missing.png"))
    assert error.status == 400 and "HTTP 404" in error.message


@pytest.mark.parametrize("path", ["/?a\x1ab", "/\u00b5 space", "/%zz"])
def test_a_url_urllib_cannot_send_is_the_item_s_400(host, path):
    error = refusal(urls(), host.url("") + path)
    assert error.status == 400 and "fetching" in error.message


def test_a_body_over_the_byte_limit_is_a_413(host):
    error = refusal(urls(max_bytes=len(PNG) + 100), host.url("/big.png"))
    assert error.status == 413 and f"max_image_bytes={len(PNG) + 100}" in error.message


def test_a_slow_host_is_cut_at_the_deadline_of_the_request(host):
    started = time.monotonic()
    error = refusal(urls(timeout_s=1), host.url("/slow"))
    assert time.monotonic() - started < 2.5
    assert error.status == 400 and "image_url_timeout_s=1" in error.message


def test_a_request_s_urls_are_fetched_side_by_side_within_one_deadline(host):
    fetcher = urls(timeout_s=5)
    started = time.monotonic()
    fetched = fetcher.fetch([(host.url("/slow"), f"input[{i}]") for i in range(4)])
    assert len(fetched) == 4 and time.monotonic() - started < 4.5  # 4 x 3 s one after another would be 12


def test_a_page_that_is_no_image_fails_at_decoding_naming_the_item(host):
    (page,) = urls().fetch([(host.url("/page.html"), "input[0]")])
    with pytest.raises(RequestError) as caught:
        decode_bytes(page.data, page.media_type, "input[0]", ImageLimits())
    assert caught.value.status == 400 and "is not a readable image" in caught.value.message


@pytest.mark.parametrize("url", ["file:///etc/passwd", "s3://bucket/cat.png", "ftp://host/cat.png",
                                 "gs://bucket/cat.png"])
def test_other_schemes_are_refused_when_read(url):
    with pytest.raises(RequestError) as caught:
        read_image(url, "input[0]")
    assert caught.value.status == 400 and "http and https URLs alone" in caught.value.message
