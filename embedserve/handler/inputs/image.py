"""The image kind: an image item of a request's body read, checked and decoded, guarded.

Reading: an item is a data URI, `data:<media type>[;...];base64,<data>`, of a media type in
MEDIA_TYPES; where the item says itself that it is an image (Jina's `{"image": ...}`), bare
base64 of an image file too, its format read from its bytes. An http(s) URL is fetched only from
the hosts the server's `image_url_hosts` names (inputs/image_urls.py); by default from none, so
that the server is never a way into the network it sits in. Other URL schemes are refused.

Limits (ImageLimits, the handler settings of those names, checked where the model is known:
reading an item checks its form only), each refused with the item and the limit named, before the
work it bounds:
- bytes an image, from the data URI's length, before its base64 is decoded (413);
- pixels an image, from the file's header, before a pixel is decoded: a decompression bomb (a
  few kilobytes of PNG that claim 10,000 x 10,000 pixels) is refused at its header (413);
- the ratio of its sides: a 1 x 50,000 strip resized for a vision tower is noise (400);
- images a request, and the bytes of those the request's body carries (413).

Decoding: Pillow, held to the format the media type names (a PNG sent as image/jpeg is refused,
saying what the bytes are); truncated files refused (Pillow's LOAD_TRUNCATED_IMAGES stays off,
so a cut file is an error, not an image filled with grey); an animation's first frame; RGB out,
as the image processors of CLIP, SigLIP, ColPali and ColQwen2 take it.

Preparation (ImagePreparation): the model folder's own image processor, the one
sentence-transformers and transformers run on the same images (resize, crop, rescale, normalize),
into pixel values; a prepared image costs a pass the positions its vision tower computes, a patch
each. Where the processor keeps an image's own shape (Qwen2-VL's, for ColQwen2; SigLIP 2's
NaFlex), its grid of patches comes with them.

Every failure is the item's own RequestError: the batch's other requests go on, and nothing an
image holds can fail the worker.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from PIL import Image, UnidentifiedImageError

from embedserve.handler.api.codec import json_type, short
from embedserve.handler.api.errors import RequestError, empty, malformed, too_large, unprocessable
from embedserve.handler.inputs.image_urls import ImageUrls
from embedserve.handler.model.image_processor import image_processor
from embedserve.handler.model.inputs import ModelInput
from embedserve.handler.settings import Settings

# The media types an image item may have, and the Pillow format each must decode as.
MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP", "image/gif": "GIF",
               "image/bmp": "BMP"}
URL_SCHEMES = ("http://", "https://")  # fetched from the hosts image_url_hosts names
OTHER_SCHEMES = ("ftp://", "file:", "s3://", "gs://")  # never fetched


@dataclass(frozen=True)
class ImageLimits:
    """The handler settings of the same names (settings.py says why each default), and the ratio of
    an image's sides, fixed: a 1 x 50,000 strip resized for a vision tower is noise."""
    max_image_bytes: int = Settings.max_image_bytes  # an image's file, decoded from base64
    max_image_pixels: int = Settings.max_image_pixels
    max_aspect_ratio: float = 100.0  # the longer side over the shorter
    max_images_per_request: int = Settings.max_images_per_request
    max_image_request_bytes: int = Settings.max_image_request_bytes  # a request's files its body carries

    @classmethod
    def of(cls, settings: Settings) -> "ImageLimits":
        return cls(settings.max_image_bytes, settings.max_image_pixels, cls.max_aspect_ratio,
                   settings.max_images_per_request, settings.max_image_request_bytes)


@dataclass(frozen=True)
class EncodedImage:
    """An image item as sent: its media type ("": the format its bytes are) and its base64 text
    (decoded under the limits); `key`: the item object's key that held it ("image"), for errors."""
    media_type: str
    base64: str
    key: str = ""


@dataclass(frozen=True)
class ImageUrl:
    """An image item that names an http(s) URL, fetched only where image_url_hosts names its host."""
    url: str
    key: str = ""


def read_image(value: Any, param: str, bare_base64: bool = False) -> EncodedImage | ImageUrl:
    """An image item: a data URI of an image media type, base64-encoded, or an http(s) URL; with
    `bare_base64` (an item that says it is an image), base64 of an image file alone too."""
    if not isinstance(value, str):
        raise malformed(f"'{param}' must be an image as a data URI string (data:image/png;base64,...), got "
                        f"{json_type(value)}", param=param)
    lowered = value.lower()
    if lowered.startswith(URL_SCHEMES):
        return ImageUrl(value)
    if lowered.startswith(OTHER_SCHEMES):
        raise unprocessable(f"'{param}' is a {value.split(':', 1)[0]} URL; the server fetches http and https URLs "
                            "alone, of the hosts its image_url_hosts setting names: send the image itself as a data "
                            "URI (data:image/png;base64,...)", param=param)
    if bare_base64 and not lowered.startswith("data:"):
        if not value:
            raise empty(f"'{param}' holds no image bytes", param=param)
        return EncodedImage("", value)
    header, comma, payload = value.partition(",")
    if not header.lower().startswith("data:") or not comma:
        raise malformed(f"'{param}' must be a data URI (data:image/png;base64,...), got {short(value[:64])}",
                        param=param)
    parameters = [part.lower() for part in header[5:].split(";")]
    media_type = parameters[0]
    if media_type not in MEDIA_TYPES:
        raise unprocessable(f"'{param}' is a data URI of {short(media_type or 'no media type')}; an image item is "
                            f"one of {', '.join(MEDIA_TYPES)}", param=param)
    if len(parameters) < 2 or parameters[-1] != "base64":
        raise malformed(f"'{param}' must be base64-encoded (data:{media_type};base64,...)", param=param)
    if not payload:
        raise empty(f"'{param}' holds no image bytes", param=param)
    return EncodedImage(media_type, payload)


def image_bytes(image: EncodedImage, param: str, limits: ImageLimits) -> bytes:
    """The image's file, its size checked from the base64 text's length before decoding it."""
    encoded_bytes = len(image.base64) * 3 // 4  # 3 bytes per 4 characters
    if encoded_bytes > limits.max_image_bytes:
        raise too_large(f"'{param}' holds about {encoded_bytes} bytes of image; the limit is "
                        f"max_image_bytes={limits.max_image_bytes}", param=param)
    try:
        data = base64.b64decode(image.base64, validate=True)
    except (binascii.Error, ValueError):
        raise malformed(f"'{param}' is not valid base64 after 'base64,'", param=param) from None
    if not data:
        raise empty(f"'{param}' holds no image bytes", param=param)
    return data


def check_count(images: Sequence[EncodedImage | ImageUrl], field: str, limits: ImageLimits) -> None:
    """A request's images: how many, and the bytes of those its body carries (from their base64's
    length, before any is decoded)."""
    if len(images) > limits.max_images_per_request:
        raise too_large(f"'{field}' has {len(images)} images; the limit is max_images_per_request="
                        f"{limits.max_images_per_request}", param=field)
    carried = sum(len(image.base64) * 3 // 4 for image in images if isinstance(image, EncodedImage))
    if carried > limits.max_image_request_bytes:
        raise too_large(f"'{field}' holds about {carried} bytes of images; the limit is max_image_request_bytes="
                        f"{limits.max_image_request_bytes} a request: send fewer or smaller images a request",
                        param=field)


def decode_image(image: EncodedImage, param: str, limits: ImageLimits) -> Image.Image:
    """The image's pixels as RGB, after its header passed the limits."""
    return decode_bytes(image_bytes(image, param, limits), image.media_type, param, limits)


def decode_bytes(data: bytes, media_type: str, param: str, limits: ImageLimits) -> Image.Image:
    """An image file's pixels as RGB, held to its media type's format ("": any of MEDIA_TYPES'),
    after its header passed the limits. Decode and prepare one image at a time: a decoded image
    takes width x height x 3 bytes (120 MB at the pixel limit), its prepared pixel values a vision
    tower's input (224 x 224 x 3 floats for CLIP)."""
    formats = [MEDIA_TYPES[media_type]] if media_type else list(MEDIA_TYPES.values())
    with warnings.catch_warnings():
        # Pillow warns past its own threshold; the pixel limit below refuses such images first.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            opened = Image.open(io.BytesIO(data), formats=formats)
        except Image.DecompressionBombError:
            raise _too_many_pixels(param, None, limits) from None
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
            what = (f"a readable {media_type} image{_what_it_is(data)}" if media_type else
                    f"a readable image of a format served ({', '.join(MEDIA_TYPES)})")
            raise unprocessable(f"'{param}' is not {what}", param=param) from None
        width, height = opened.size
        if width * height > limits.max_image_pixels:
            raise _too_many_pixels(param, (width, height), limits)
        if width < 1 or height < 1 or max(width, height) / min(width, height) > limits.max_aspect_ratio:
            raise unprocessable(f"'{param}' is {width} x {height} pixels; the longer side may be at most "
                                f"max_aspect_ratio={limits.max_aspect_ratio:g} times the shorter", param=param)
        try:
            opened.seek(0)  # an animation's first frame
            opened.load()
            return opened.convert("RGB")
        except Image.DecompressionBombError:
            raise _too_many_pixels(param, (width, height), limits) from None
        except (OSError, ValueError, SyntaxError, EOFError) as err:
            raise unprocessable(f"'{param}' is a truncated or corrupt {media_type or opened.format} image "
                                f"({short(str(err))})", param=param) from None


def _too_many_pixels(param: str, size: tuple[int, int] | None, limits: ImageLimits) -> RequestError:
    stated = f"{size[0]} x {size[1]} = {size[0] * size[1]} pixels" if size else "more pixels than Pillow decodes"
    return too_large(f"'{param}' is {stated}; the limit is max_image_pixels={limits.max_image_pixels}", param=param)


def _what_it_is(data: bytes) -> str:
    """What the bytes are where they are another image format, for the error: ', the bytes are a PNG'."""
    try:
        with Image.open(io.BytesIO(data), formats=list(MEDIA_TYPES.values())) as other:
            return f"; the bytes are a {other.format} image (send it as {_media_type(other.format)})"
    except Exception:  # not an image Pillow knows at all
        return ""


def _media_type(image_format: str) -> str:
    return next(media for media, name in MEDIA_TYPES.items() if name == image_format)


class ImagePreparation:
    """Decoded images into a vision tower's pixel values, by the model folder's own image processor."""

    def __init__(self, model_dir: str | Path, positions: int):
        """`positions`: what an image costs the planner, the patches its vision tower computes
        (`Towers.image_positions`, read off the model's config by model/towers.py)."""
        self.processor = image_processor(model_dir)  # the one the description read
        self.positions = positions

    def model_input(self, image: Image.Image) -> ModelInput:
        """One image's model input: its pixel values, and where the processor keeps the image's own
        shape, its grid of patches, the pixel values then its patches' (Qwen2-VL's: the image's
        patches alone; SigLIP 2's: padded to max_num_patches, the real ones first)."""
        prepared = self.processor(images=[image], return_tensors="pt")
        if "image_grid_thw" in prepared:
            return ModelInput((), image=prepared["pixel_values"], positions=self.positions,
                              grid=tuple(prepared["image_grid_thw"][0].tolist()))
        grid = tuple(prepared["spatial_shapes"][0].tolist()) if "spatial_shapes" in prepared else ()
        return ModelInput((), image=prepared["pixel_values"][0], positions=self.positions, grid=grid)


class ImageReader:
    """The image kind of a model that reads images: an item's limits, fetching where it is a URL of
    an allowed host (inputs/image_urls.py), decoding and preparation into its model input, one
    image at a time."""

    def __init__(self, preparation: ImagePreparation, limits: ImageLimits | None = None,
                 url_hosts: Sequence[str] = (), url_timeout_s: float = 10.0):
        """`url_hosts`: the hosts image URLs are fetched from (none by default), within
        `url_timeout_s` for all of a request's URLs."""
        self.preparation = preparation
        self.limits = limits or ImageLimits()
        self.urls = ImageUrls(url_hosts, url_timeout_s, self.limits.max_image_bytes, tuple(MEDIA_TYPES))

    def model_inputs(self, images: Sequence[tuple[EncodedImage | ImageUrl, str]]) -> list[ModelInput]:
        """Each (item, its name) prepared, in order: a request's URLs fetched side by side first."""
        urls = [(image, param) for image, param in images if isinstance(image, ImageUrl)]
        fetched = iter(self.urls.fetch([(image.url, param) for image, param in urls]))
        inputs = []
        for image, param in images:
            if isinstance(image, ImageUrl):
                file = next(fetched)
                decoded = decode_bytes(file.data, file.media_type, param, self.limits)
            else:
                decoded = decode_image(image, param, self.limits)
            inputs.append(self.preparation.model_input(decoded))
        return inputs
