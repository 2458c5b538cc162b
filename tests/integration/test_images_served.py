"""Images beside texts through the real TorchServe: the session catalog's tiny CLIP (made from
openai/clip-vit-base-patch32's published config and image processor, tests/support/image_models.py),
built as a user builds the folder, against sentence-transformers' `encode` of the same texts and PIL
images; the real `openai` client sending image items as Infinity's clients do (`modality`); and bad
images answered alone, the rest of their batch served; texts and images in one request as Jina's
item objects; image URLs fetched from the hosts the build names alone."""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import requests
from PIL import Image

from embedserve.archive.bf16_check import BF16_MIN_COSINE
from tests.support.catalog import IMAGE_TEXT, NAFLEX, SIGLIP
from tests.support.client import worker_identities
from tests.support.image_host import image_host
from tests.support.images import data_uri, image_file, photo, png_of_zeros

pytestmark = pytest.mark.integration

MIN_COSINE = 0.99999
TEXTS = ["a red cat on a mat", "two dogs", "hello world"]


@pytest.fixture(scope="module")
def reference(catalog_models):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(catalog_models[IMAGE_TEXT]), device="cpu")


def pictures() -> list[tuple[Image.Image, bytes, str]]:
    """Images of several sizes and modes, each with its file and data URI."""
    images = [(photo(320, 240), "PNG", "image/png"), (photo(64, 96).convert("L"), "JPEG", "image/jpeg"),
              (photo(500, 500).convert("RGBA"), "WEBP", "image/webp")]
    made = []
    for image, file_format, media_type in images:
        data = image_file(image, file_format)
        made.append((Image.open(io.BytesIO(data)), data, data_uri(data, media_type)))
    return made


def post(catalog, body, route="v1/embeddings", model=IMAGE_TEXT):
    return requests.post(f"{catalog.url('inference')}/predictions/{model}/1.0/{route}", json=body,
                         headers=catalog.auth(), timeout=120)


def image_bar(catalog, model=IMAGE_TEXT) -> float:
    """The least cosine of the served image vectors to sentence-transformers': float32's, or the
    build's bfloat16 bar where the worker's engine trial chose the bfloat16 vision tower (on a
    CPU with bf16 units; the tiny towers here run faster in float32, so float32 is what is expected)."""
    info = requests.get(f"{catalog.url('inference')}/predictions/{model}/1.0/info", headers=catalog.auth(),
                        timeout=60).json()
    assert info["image_engine"] in ("onnxruntime", "openvino bfloat16"), info
    return MIN_COSINE if info["image_engine"] == "onnxruntime" else BF16_MIN_COSINE


def cosines(got, want):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)


def test_images_and_texts_are_sentence_transformers_vectors_in_one_space(catalog, reference):
    images = pictures()
    answer = post(catalog, {"input": [uri for _, _, uri in images], "modality": "image"})
    assert answer.status_code == 200, answer.text
    got = [row["embedding"] for row in answer.json()["data"]]
    assert cosines(got, reference.encode([image for image, _, _ in images])).min() >= image_bar(catalog)
    texts = post(catalog, {"input": TEXTS})
    assert cosines([row["embedding"] for row in texts.json()["data"]], reference.encode(TEXTS)).min() >= MIN_COSINE
    # The native route, unnormalized and with fewer dimensions, as for texts.
    native = requests.post(f"{catalog.url('inference')}/predictions/{IMAGE_TEXT}", headers=catalog.auth(),
                           json={"input": images[0][2], "modality": "image", "normalize": False}, timeout=120)
    assert native.status_code == 200, native.text
    got, want = native.json()["data"][0]["embedding"], reference.encode([images[0][0]])[0]
    close = 1e-5 if image_bar(catalog) == MIN_COSINE else 1e-2  # bfloat16's rounding
    assert cosines([got], [want])[0] >= image_bar(catalog) and np.allclose(got, want, atol=close, rtol=close)
    info = requests.get(f"{catalog.url('inference')}/predictions/{IMAGE_TEXT}/1.0/info", headers=catalog.auth(),
                        timeout=60).json()
    assert info["embedding_dimension"] == reference.get_embedding_dimension() == 16
    assert info["modalities"] == ["text", "image"] and info["image_limits"]["max_image_pixels"] == 40_000_000
    assert info["engine"] == "onnxruntime" and info["image_engine"] in ("onnxruntime", "openvino bfloat16")


def test_siglip_texts_are_its_model_card_s_vectors_whatever_their_batch(catalog, catalog_models):
    """SigLIP pools the last of 64 padded positions: each text's vector is transformers'
    get_text_features on the text padded to 64 (the model card's call), alone or beside a long
    text; images are sentence-transformers' encode of the same PIL images."""
    import torch
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    folder = catalog_models[SIGLIP]
    model, tokenizer = AutoModel.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    texts = [*TEXTS, "a long caption of a photograph taken at dawn over a quiet harbour " * 4]
    with torch.no_grad():
        want = model.get_text_features(**tokenizer(texts, padding="max_length", max_length=64, truncation=True,
                                                   return_tensors="pt")).pooler_output.numpy()
    batched = post(catalog, {"input": texts}, model=SIGLIP)
    assert batched.status_code == 200, batched.text
    assert cosines([row["embedding"] for row in batched.json()["data"]], want).min() >= MIN_COSINE
    alone = post(catalog, {"input": TEXTS[1]}, model=SIGLIP).json()["data"][0]["embedding"]
    assert cosines([alone], want[1:2]).min() >= MIN_COSINE
    images = pictures()
    answer = post(catalog, {"input": [uri for _, _, uri in images], "modality": "image"}, model=SIGLIP)
    assert answer.status_code == 200, answer.text
    reference = SentenceTransformer(str(folder), device="cpu").encode([image for image, _, _ in images])
    assert cosines([row["embedding"] for row in answer.json()["data"]], reference).min() >= image_bar(catalog, SIGLIP)
    info = requests.get(f"{catalog.url('inference')}/predictions/{SIGLIP}/1.0/info", headers=catalog.auth(),
                        timeout=60).json()
    assert info["modalities"] == ["text", "image"] and info["embedding_dimension"] == 32
    assert info["engine"] == "onnxruntime" and info["image_engine"] in ("onnxruntime", "openvino bfloat16")


def test_siglip2_naflex_images_keep_their_shape_and_texts_are_transformers_vectors(catalog, catalog_models):
    """SigLIP 2's variable-resolution model, built as a user builds its folder: images of three
    aspect ratios in one request, each transformers' get_image_features of that image alone by the
    folder's processor; texts transformers' get_text_features as its Siglip2Tokenizer gives them
    (lowercased, padded to 64 on the left)."""
    import torch
    from transformers import AutoImageProcessor, AutoModel, AutoTokenizer

    folder = catalog_models[NAFLEX]
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    processor, tokenizer = AutoImageProcessor.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    images = [photo(600, 90), photo(64, 96).convert("L"), photo(300, 300)]
    texts = ["A Red Cat on a Mat", "two dogs"]
    with torch.no_grad():
        want_images = torch.cat([model.get_image_features(**processor(images=[image.convert("RGB")],
                                                                      return_tensors="pt")).pooler_output
                                 for image in images]).numpy()
        want_texts = model.get_text_features(**tokenizer(texts, padding="max_length", max_length=64,
                                                         return_tensors="pt")).pooler_output.numpy()
    answer = post(catalog, {"input": [data_uri(image_file(image, "PNG")) for image in images], "modality": "image"},
                  model=NAFLEX)
    assert answer.status_code == 200, answer.text
    assert cosines([row["embedding"] for row in answer.json()["data"]], want_images).min() >= MIN_COSINE
    answer = post(catalog, {"input": texts}, model=NAFLEX)
    assert answer.status_code == 200, answer.text
    assert cosines([row["embedding"] for row in answer.json()["data"]], want_texts).min() >= MIN_COSINE
    info = requests.get(f"{catalog.url('inference')}/predictions/{NAFLEX}/1.0/info", headers=catalog.auth(),
                        timeout=60).json()
    assert info["modalities"] == ["text", "image"] and info["image_engine"] == "torch", info
    assert "up to 256 patches" in str(info["modules"]), info


def test_the_openai_client_sends_images_as_infinity_s_clients_do(catalog, reference):
    client = openai.OpenAI(base_url=f"{catalog.url('inference')}/predictions/{IMAGE_TEXT}/1.0/v1",
                           api_key=catalog.keys()["inference"], max_retries=0)
    images = pictures()
    result = client.embeddings.create(model=IMAGE_TEXT, input=[uri for _, _, uri in images],
                                      extra_body={"modality": "image"})  # the client asks for base64
    assert cosines([d.embedding for d in result.data],
                   reference.encode([image for image, _, _ in images])).min() >= image_bar(catalog)
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=IMAGE_TEXT, input=["https://example.com/cat.png"],
                                 extra_body={"modality": "image"})
    assert "does not fetch from" in str(refused.value)  # the host is not one image_url_hosts names


def test_cohere_s_client_embeds_images_and_texts_unchanged(catalog, reference):
    """ClientV2.embed as Cohere's users call it: images as data URIs with input_type "image", texts
    with a search input type, several embedding types in one answer."""
    import cohere

    client = cohere.ClientV2(api_key=catalog.auth()["Authorization"].split()[-1],
                             base_url=f"{catalog.url('inference')}/predictions/{IMAGE_TEXT}/1.0")
    images = pictures()
    answer = client.embed(model=IMAGE_TEXT, images=[uri for _, _, uri in images], input_type="image",
                          embedding_types=["float", "int8", "base64"])
    want = reference.encode([image for image, _, _ in images])
    assert cosines(answer.embeddings.float_, want).min() >= image_bar(catalog)
    floats = np.asarray([np.frombuffer(base64.b64decode(row), "<f4") for row in answer.embeddings.base64])
    assert np.array_equal(floats, np.asarray(answer.embeddings.float_, dtype=np.float32))
    assert cosines(answer.embeddings.int8, want).min() >= 0.99  # int8 codes of the same unit vectors
    texts = client.embed(model=IMAGE_TEXT, texts=TEXTS, input_type="search_query", embedding_types=["float"],
                         output_dimension=8)
    assert np.asarray(texts.embeddings.float_).shape == (3, 8) and texts.texts == TEXTS
    with pytest.raises(cohere.BadRequestError):
        client.embed(model=IMAGE_TEXT, images=["https://example.com/cat.png"], input_type="image")


BAD_IMAGES = {
    "not an image": (data_uri(b"not an image at all" * 20), 400, "is not a readable image/png image"),
    "a PNG sent as JPEG": (data_uri(image_file(photo(), "PNG"), "image/jpeg"), 400, "the bytes are a PNG image"),
    "truncated": (data_uri(image_file(photo(256, 256), "PNG")[:2000]), 400, "truncated or corrupt"),
    "a decompression bomb": (data_uri(png_of_zeros(10_000, 10_000)), 413, "max_image_pixels=40000000"),
    "absurd sides": (data_uri(png_of_zeros(5_000, 1)), 400, "max_aspect_ratio=100"),
    "a text media type": ("data:text/plain;base64,aGVsbG8=", 400, "an image item is one of image/png"),
    "a URL of a host not named": ("http://169.254.169.254/latest/meta-data", 400, "image_url_hosts setting names"),
}


def test_each_bad_image_is_refused_alone_and_its_batch_is_served(catalog, reference):
    pids = worker_identities(catalog, IMAGE_TEXT)
    good = pictures()[0]
    want = reference.encode([good[0]])
    bodies = [{"input": [good[2], value], "modality": "image"} for value, _, _ in BAD_IMAGES.values()]
    bodies += [{"input": good[2], "modality": "image"}] * 4
    with ThreadPoolExecutor(len(bodies)) as pool:  # concurrent: the bad and the good share batches
        answers = list(pool.map(lambda body: post(catalog, body), bodies))
    for (name, (_, status, words)), answer in zip(BAD_IMAGES.items(), answers):
        assert answer.status_code == status and words in answer.text, (name, answer.text)
        assert answer.json()["error"]["param"] == "input[1]", name
    for answer in answers[len(BAD_IMAGES):]:
        assert answer.status_code == 200
        assert cosines([answer.json()["data"][0]["embedding"]], want)[0] >= image_bar(catalog)
    assert worker_identities(catalog, IMAGE_TEXT) == pids  # no worker died of any of them


def test_options_that_do_not_apply_to_images_are_refused(catalog):
    image = pictures()[0][2]
    for body, field in (({"input": image, "modality": "image", "long_input": "chunk"}, "long_input"),
                        ({"input": [[101, 2023]], "modality": "image"}, "input[0]"),
                        ({"input": image, "modality": "video"}, "modality")):
        answer = post(catalog, body)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == field, answer.text
    # Text models refuse image items, naming the field, whatever options their task reads.
    for model in ("colbert", "splade", "m3"):
        answer = requests.post(f"{catalog.url('inference')}/predictions/{model}", headers=catalog.auth(), timeout=60,
                               json={"input": image, "modality": "image"})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "modality", (model, answer.text)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_texts_and_images_in_one_request_as_jina_s_item_objects(catalog, reference):
    """Jina's embeddings API shape: {"text"} and {"image"} objects (a data URI, or bare base64) and
    the older {"bytes"} in one request, a plain string beside them a text; each vector the
    reference's for its item, in order, on the OpenAI and native routes."""
    (first, _, first_uri), (second, second_file, _), (third, third_file, _) = pictures()
    items = [{"text": TEXTS[0]}, {"image": first_uri}, {"image": b64(second_file)}, TEXTS[1], {"bytes": b64(third_file)}]
    texts, images = reference.encode([TEXTS[0], TEXTS[1]]), reference.encode([first, second, third])
    want = [texts[0], images[0], images[1], texts[1], images[2]]
    for route in ("v1/embeddings", ""):
        answer = requests.post(f"{catalog.url('inference')}/predictions/{IMAGE_TEXT}/1.0/{route}".rstrip("/"),
                               json={"model": IMAGE_TEXT, "input": items}, headers=catalog.auth(), timeout=120)
        assert answer.status_code == 200, answer.text
        rows = answer.json()["data"]
        assert [row["index"] for row in rows] == list(range(5))
        assert cosines([row["embedding"] for row in rows], want).min() >= image_bar(catalog), route


BAD_OBJECTS = {
    "an image that is a number": ({"image": 123}, 400, "input[1].image"),
    "two kinds in one object": ({"text": "a", "image": "b"}, 400, "input[1]"),
    "a kind not served": ({"video": "data:video/mp4;base64,AAAA"}, 400, "input[1]"),
    "bare base64 that is no image": ({"image": b64(b"plain bytes, no image" * 8)}, 400, "input[1].image"),
    "a URL under bytes": ({"bytes": "http://127.0.0.1/cat.png"}, 400, "input[1].bytes"),
    "an empty text": ({"text": ""}, 400, "input[1].text"),
}


def test_each_bad_item_object_is_refused_naming_it_and_its_batch_is_served(catalog, reference):
    pids = worker_identities(catalog, IMAGE_TEXT)
    good = pictures()[0]
    bodies = [{"input": [{"image": good[2]}, item]} for item, _, _ in BAD_OBJECTS.values()]
    bodies += [{"input": [{"image": good[2]}], "modality": "image"},  # objects say their kind: no modality
               *[{"input": [{"image": good[2]}, {"text": TEXTS[0]}]}] * 3]
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda body: post(catalog, body), bodies))
    for (name, (_, status, param)), answer in zip(BAD_OBJECTS.items(), answers):
        assert answer.status_code == status and answer.json()["error"]["param"] == param, (name, answer.text)
    assert answers[len(BAD_OBJECTS)].json()["error"]["param"] == "modality"
    want = [reference.encode([good[0]])[0], reference.encode([TEXTS[0]])[0]]
    for answer in answers[len(BAD_OBJECTS) + 1:]:
        assert answer.status_code == 200 and cosines([row["embedding"] for row in answer.json()["data"]],
                                                     want).min() >= image_bar(catalog)
    # A model that reads texts alone refuses an image object, naming it.
    answer = requests.post(f"{catalog.url('inference')}/predictions/m3", headers=catalog.auth(), timeout=60,
                           json={"input": [{"text": "a"}, {"image": good[2]}]})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "input[1].image", answer.text
    assert worker_identities(catalog, IMAGE_TEXT) == pids


def test_image_urls_are_fetched_from_the_hosts_the_build_names_and_no_others(catalog, reference):
    """The catalog's CLIP is built with image_url_hosts=[127.0.0.1]: its worker fetches images
    from a real HTTP server there, as item objects or under "modality": "image"; a redirect and a
    404 are refused naming the item. SigLIP, built with the default, fetches nothing."""
    picture, data, _ = pictures()[0]
    with image_host({"/cat.png": ("image/png", data), "/cat.bin": ("application/octet-stream", data)}) as host:
        items = [{"image": host.url("/cat.png")}, {"url": host.url("/cat.bin")}, {"text": TEXTS[0]}]
        answer = post(catalog, {"input": items})
        assert answer.status_code == 200, answer.text
        want = [*reference.encode([picture, picture]), reference.encode([TEXTS[0]])[0]]
        assert cosines([row["embedding"] for row in answer.json()["data"]], want).min() >= image_bar(catalog)
        infinity = post(catalog, {"input": [host.url("/cat.png")], "modality": "image"})
        assert cosines([infinity.json()["data"][0]["embedding"]], want[:1])[0] >= image_bar(catalog)
        for path, words in (("/moved", "redirects to"), ("/missing.png", "HTTP 404")):
            refused = post(catalog, {"input": [{"image": data_uri(data)}, {"image": host.url(path)}]})
            assert refused.status_code == 400 and words in refused.text, refused.text
            assert refused.json()["error"]["param"] == "input[1].image"
        fetched = len(host.requests)
        refused = post(catalog, {"input": [host.url("/cat.png")], "modality": "image"}, model=SIGLIP)
        assert refused.status_code == 400 and "fetches no URL" in refused.text, refused.text
        assert len(host.requests) == fetched  # nothing reached the host


def test_a_large_image_reaches_the_handler_and_a_request_over_its_image_bytes_is_its_413(catalog, reference):
    """The build lets a request of max_image_request_bytes (16 MiB) of images through TorchServe, in
    base64: a 9 MiB image (a PNG with bytes after its end, which Pillow reads as the PNG) is embedded,
    where TorchServe's own limit would have answered an empty 413; two of 8.2 MiB are the handler's
    413 naming the limit."""
    picture, png, _ = pictures()[0]
    big = data_uri(png + b"\0" * (9 * 2**20 - len(png)))
    answer = post(catalog, {"input": [{"image": big}, {"text": TEXTS[0]}]})
    assert answer.status_code == 200, answer.text[:300]
    want = [reference.encode([picture])[0], reference.encode([TEXTS[0]])[0]]
    assert cosines([row["embedding"] for row in answer.json()["data"]], want).min() >= image_bar(catalog)
    two = data_uri(png + b"\0" * (int(8.2 * 2**20) - len(png)))
    refused = post(catalog, {"input": [two, two], "modality": "image"})
    assert refused.status_code == 413 and "max_image_request_bytes=16777216" in refused.text, refused.text[:300]
    assert refused.json()["error"]["param"] == "input"
