"""A request's inputs where a route takes either kind: texts and token ids as the text kind reads
them, and item objects that say their kind, as Jina's embeddings API takes them, so that one
request may hold texts and images together (for an image-text model):
- {"text": "..."};
- {"image": ...}: a data URI, bare base64 of an image file, or an http(s) URL (fetched only from
  the hosts image_url_hosts names, inputs/image_urls.py);
- {"bytes": base64} and {"url": "..."}: the older names Jina's clients still send (LlamaIndex's).
An object holds one of those keys and nothing else; "modality" applies to plain strings, so a
request of item objects leaves it out.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Union

from embedserve.handler.api.codec import json_type
from embedserve.handler.api.errors import malformed
from embedserve.handler.inputs.image import EncodedImage, ImageUrl, read_image
from embedserve.handler.inputs.text import Input, read_inputs, read_item, read_text

Item = Union[Input, EncodedImage, ImageUrl]
OBJECT_KEYS = ("text", "image", "bytes", "url")


def has_objects(value: Any) -> bool:
    return isinstance(value, list) and any(isinstance(item, dict) for item in value)


def read_items(value: Any, name: str, allow_token_ids: bool) -> tuple[Item, ...]:
    """The text kind's inputs (read_inputs), or a list where item objects may stand beside them."""
    if not has_objects(value):
        return read_inputs(value, name, allow_token_ids)
    return tuple(_read_object(item, f"{name}[{i}]") if isinstance(item, dict) else
                 read_item(item, f"{name}[{i}]", allow_token_ids) for i, item in enumerate(value))


def _read_object(item: dict[str, Any], param: str) -> Item:
    keys = list(item)
    if len(keys) != 1 or keys[0] not in OBJECT_KEYS:
        raise malformed(f"'{param}' must be an object with one key of {', '.join(map(repr, OBJECT_KEYS))}, got keys "
                        f"{keys}", param=param)
    key = keys[0]
    value, param = item[key], f"{param}.{key}"
    if key == "text":
        if not isinstance(value, str):
            raise malformed(f"'{param}' must be a string, got {json_type(value)}", param=param)
        return read_text(value, param)
    image = read_image(value, param, bare_base64=key != "url")
    if key == "url" and not isinstance(image, ImageUrl):
        raise malformed(f"'{param}' must be an http or https URL", param=param)
    if key == "bytes" and isinstance(image, ImageUrl):
        raise malformed(f"'{param}' must be an image's bytes in base64, got a URL (send it as 'url')", param=param)
    return replace(image, key=key)  # its errors name the key: input[1].image
