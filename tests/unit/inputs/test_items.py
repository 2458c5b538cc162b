"""Inputs as Jina's item objects (embedserve/handler/inputs/items.py) beside plain texts and token
ids: each object read as its kind says, and every malformed one refused naming it."""

from __future__ import annotations

import pytest

from embedserve.handler.api.errors import RequestError
from embedserve.handler.inputs.image import EncodedImage, ImageUrl
from embedserve.handler.inputs.items import read_items


def test_plain_inputs_read_as_the_text_kind_reads_them():
    assert read_items("one text", "input", allow_token_ids=True) == ("one text",)
    assert read_items(["a", [101, 7]], "input", allow_token_ids=True) == ("a", (101, 7))


def test_objects_are_read_as_their_kind_beside_plain_items():
    items = read_items([{"text": "a cat"}, "plain", [5, 6], {"image": "data:image/png;base64,iVBO"},
                        {"image": "iVBORw0KGgo="}, {"bytes": "R0lGOD"}, {"url": "https://img.example/a.png"},
                        {"image": "http://img.example/b.png"}], "input", allow_token_ids=True)
    assert items == ("a cat", "plain", (5, 6), EncodedImage("image/png", "iVBO", "image"),
                     EncodedImage("", "iVBORw0KGgo=", "image"), EncodedImage("", "R0lGOD", "bytes"),
                     ImageUrl("https://img.example/a.png", "url"), ImageUrl("http://img.example/b.png", "image"))


@pytest.mark.parametrize("item, param, words", [
    ({}, "input[1]", "one key of 'text', 'image', 'bytes', 'url'"),
    ({"text": "a", "image": "b"}, "input[1]", "one key"),
    ({"audio": "x"}, "input[1]", "one key"),
    ({"text": 3}, "input[1].text", "must be a string"),
    ({"text": ""}, "input[1].text", "must not be an empty string"),
    ({"image": None}, "input[1].image", "must be an image"),
    ({"image": ""}, "input[1].image", "no image bytes"),
    ({"image": "file:///etc/passwd"}, "input[1].image", "http and https URLs alone"),
    ({"url": "data:image/png;base64,iVBO"}, "input[1].url", "must be an http or https URL"),
    ({"bytes": "https://img.example/a.png"}, "input[1].bytes", "got a URL"),
    (3.5, "input[1]", "must be a string or a list of token ids"),
])
def test_a_malformed_object_is_a_400_naming_it(item, param, words):
    with pytest.raises(RequestError) as caught:
        read_items([{"text": "fine"}, item], "input", allow_token_ids=True)
    assert caught.value.status == 400 and caught.value.param == param and words in caught.value.message, \
        caught.value.message
