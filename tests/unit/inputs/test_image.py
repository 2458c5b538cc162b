"""The image kind's reading and decoding (embedserve/handler/inputs/image.py) against real files
Pillow writes and real malformed ones: a decompression bomb (a complete PNG of 10,000 x 10,000
pixels in kilobytes), truncated files, a PNG sent as JPEG, bare base64.  URLs: test_image_urls.py."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from embedserve.handler.api.errors import RequestError
from embedserve.handler.inputs.image import ImageLimits, ImageUrl, check_count, decode_image, read_image
from tests.support.images import data_uri, image_file, photo, png_of_zeros

LIMITS = ImageLimits()


def decoded(value: str, limits: ImageLimits = LIMITS) -> Image.Image:
    return decode_image(read_image(value, "input[0]"), "input[0]", limits)


def refusal(value, limits: ImageLimits = LIMITS) -> RequestError:
    with pytest.raises(RequestError) as caught:
        decoded(value, limits)
    assert caught.value.param == "input[0]" and "'input[0]'" in caught.value.message
    return caught.value


@pytest.mark.parametrize("file_format, media_type", [("PNG", "image/png"), ("JPEG", "image/jpeg"),
                                                     ("WEBP", "image/webp"), ("GIF", "image/gif"),
                                                     ("BMP", "image/bmp")])
def test_each_media_type_decodes_to_the_rgb_pixels_pillow_reads(file_format, media_type):
    data = image_file(photo(), file_format)
    got = decoded(data_uri(data, media_type))
    assert got.mode == "RGB" and got.size == (64, 48)
    assert np.array_equal(np.asarray(got), np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))


def test_palette_alpha_and_greyscale_images_come_out_rgb():
    for mode in ("P", "RGBA", "L", "LA", "1"):
        assert decoded(data_uri(image_file(photo().convert(mode), "PNG"))).mode == "RGB"
    assert decoded(data_uri(image_file(photo().convert("CMYK"), "JPEG"), "image/jpeg")).mode == "RGB"


def test_an_animation_gives_its_first_frame():
    frames = [Image.new("RGB", (8, 8), color) for color in ((255, 0, 0), (0, 0, 255))]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:])
    assert decoded(data_uri(buffer.getvalue(), "image/gif")).getpixel((0, 0)) == (255, 0, 0)


def test_a_data_uri_with_parameters_and_upper_case_is_read():
    data = image_file(photo(), "PNG")
    value = f"DATA:Image/PNG;name=cat.png;base64,{base64.b64encode(data).decode()}"
    assert decoded(value).size == (64, 48)


def test_an_http_url_is_read_as_a_url_and_bare_base64_only_where_the_item_says_image():
    assert read_image("https://example.com/cat.png", "input[0]") == ImageUrl("https://example.com/cat.png")
    data = image_file(photo(), "JPEG")
    bare = read_image(base64.b64encode(data).decode(), "input[0].image", bare_base64=True)
    assert bare.media_type == "" and decode_image(bare, "input[0].image", LIMITS).size == (64, 48)


@pytest.mark.parametrize("value, status, words", [
    (123, 400, "must be an image as a data URI string"),
    ("a cat on a mat", 400, "must be a data URI"),
    ("data:image/png,rawbytes", 400, "base64-encoded"),
    ("data:text/plain;base64,aGVsbG8=", 400, "'text/plain'; an image item is one of image/png"),
    ("data:image/svg+xml;base64,PHN2Zz4=", 400, "image/svg+xml"),
    ("data:;base64,aGVsbG8=", 400, "no media type"),
    ("data:image/png;base64,not base64!", 400, "not valid base64"),
    ("data:image/png;base64,", 400, "no image bytes"),
])
def test_an_item_that_is_not_an_image_data_uri_is_a_400_naming_it(value, status, words):
    error = refusal(value)
    assert error.status == status and words in error.message, error.message


def test_bytes_that_are_no_image_are_a_400():
    error = refusal(data_uri(b"\x00\x01 this is not an image at all" * 10))
    assert error.status == 400 and "is not a readable image/png image" in error.message


def test_a_png_sent_as_jpeg_is_refused_saying_what_it_is():
    error = refusal(data_uri(image_file(photo(), "PNG"), "image/jpeg"))
    assert error.status == 400 and "the bytes are a PNG image (send it as image/png)" in error.message


@pytest.mark.parametrize("file_format, media_type", [("PNG", "image/png"), ("JPEG", "image/jpeg")])
def test_a_truncated_file_is_refused_not_filled_in(file_format, media_type):
    data = image_file(photo(256, 256), file_format)
    error = refusal(data_uri(data[: len(data) // 2], media_type))
    assert error.status == 400 and "truncated or corrupt" in error.message, error.message


def test_bytes_over_the_limit_are_refused_before_decoding():
    data = image_file(photo(), "PNG")
    error = refusal(data_uri(data), ImageLimits(max_image_bytes=len(data) // 2))
    assert error.status == 413 and f"max_image_bytes={len(data) // 2}" in error.message


def test_a_decompression_bomb_is_refused_at_its_header():
    bomb = png_of_zeros(10_000, 10_000)  # 100 million pixels in about 20 KB
    assert len(bomb) < 100_000
    error = refusal(data_uri(bomb))
    assert error.status == 413 and "10000 x 10000 = 100000000 pixels" in error.message
    assert "max_image_pixels=40000000" in error.message


def test_a_header_past_pillow_s_own_threshold_is_refused_too():
    # 30,000 x 30,000: Pillow itself refuses to open it (past twice its MAX_IMAGE_PIXELS); the
    # answer is the same 413, and only the header is there to read.
    error = refusal(data_uri(png_of_zeros(30_000, 30_000, rows=1)))
    assert error.status == 413 and "max_image_pixels" in error.message


def test_absurd_sides_are_refused():
    error = refusal(data_uri(png_of_zeros(5_000, 1)))
    assert error.status == 400 and "5000 x 1 pixels" in error.message and "max_aspect_ratio=100" in error.message
    assert decoded(data_uri(png_of_zeros(100, 1))).size == (100, 1)  # at the limit


def test_too_many_images_in_a_request():
    url = ImageUrl("https://img.example/a.png")
    check_count([url] * 64, "input", LIMITS)
    with pytest.raises(RequestError) as caught:
        check_count([url] * 65, "input", LIMITS)
    assert caught.value.status == 413 and "max_images_per_request=64" in caught.value.message


def test_a_request_s_images_are_counted_and_their_carried_bytes_bounded():
    small = read_image(data_uri(image_file(photo(), "PNG")), "input[0]")
    limits = ImageLimits(max_images_per_request=2, max_image_request_bytes=3 * len(small.base64) * 3 // 4)
    check_count([small, small], "input", limits)
    with pytest.raises(RequestError) as caught:
        check_count([small] * 3, "input", limits)
    assert caught.value.status == 413 and "max_images_per_request=2" in caught.value.message
    with pytest.raises(RequestError) as caught:
        check_count([small, read_image(data_uri(image_file(photo(256, 256), "PNG")), "input[1]")], "input", limits)
    assert caught.value.status == 413 and "max_image_request_bytes=" in caught.value.message
    assert caught.value.param == "input"
