"""The API page of the default model, served by the real TorchServe from its .mar, in a real
headless browser: Debian's Chromium (scripts/require_chromium.sh), driven by Playwright over the
DevTools protocol.

TorchServe reads the inference key only from a request's Authorization header, which a browser
sends for no load of its own (embedserve/handler/api/docs_page.py). The browser here adds it to
exactly those loads, the page and its script and style sheet, as a header-setting extension
would; the page's own requests, openapi.json and "Try it out", carry the key typed into it."""

import shutil
import zipfile

import numpy as np
import pytest
import requests

from embedserve.handler.api.docs_page import ASSETS, ASSETS_FOLDER
from tests.support.client import predict, vectors

pytestmark = pytest.mark.integration

MODEL, VERSION = "minilm", "1.0"
EMBEDDINGS = f"/predictions/{MODEL}/{VERSION}/v1/embeddings"
# What the browser loads by itself: TorchServe lets these through only with the key's header.
BROWSER_LOADS = ("document", "script", "stylesheet")
METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")
# As root, without a sandbox; no connections of Chromium's own (this machine may have no route out).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]


@pytest.fixture(scope="module")
def base(server):
    return f"{server.client_url('inference')}/predictions/{MODEL}/{VERSION}"


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("Debian's chromium is not installed: bash scripts/require_chromium.sh (make test runs it)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, server):
    """A fresh tab that sends the key with the browser's own loads only, and records every
    console error and uncaught exception in `page.errors`."""
    context = browser.new_context()

    def browser_load(route):
        headers = route.request.headers
        if route.request.resource_type in BROWSER_LOADS:
            headers = {**headers, **server.auth()}
        route.continue_(headers=headers)

    context.route("**/*", browser_load)
    page = context.new_page()
    page.errors = []
    page.on("console", lambda message: message.type == "error" and page.errors.append(message.text))
    page.on("pageerror", lambda error: page.errors.append(f"uncaught: {error}"))
    yield page
    context.close()


def opened_with_key(page, base, server):
    """The page on a first visit, asking for the key, then given it; the errors it logged before."""
    with page.expect_response(lambda r: r.url == f"{base}/openapi.json") as refused:
        page.goto(f"{base}/docs")
    assert refused.value.status == 400  # TorchServe's, for a request without the key
    page.wait_for_selector("#key-note:has-text('enter it here')")
    before = list(page.errors)
    page.errors.clear()
    page.fill("#key", server.keys()["inference"])
    with page.expect_response(lambda r: r.url == f"{base}/openapi.json") as loaded:
        page.click("#use-key")
    assert loaded.value.status == 200
    page.wait_for_selector(".opblock")
    return before


def test_the_archive_carries_only_the_page_files(server):
    with zipfile.ZipFile(server.config.parent / "model_store" / f"{MODEL}.mar") as mar:
        members = {info.filename: info for info in mar.infolist() if info.filename.startswith(f"{ASSETS_FOLDER}/")}
    assert sorted(members) == sorted(f"{ASSETS_FOLDER}/{name}" for name in ASSETS)
    assert sum(info.compress_size for info in members.values()) < 800_000  # what the page adds to the .mar


def test_the_page_and_its_files_come_with_their_content_types(server, base):
    for path, content_type in [("docs", "text/html"), ("docs/swagger-ui.css", "text/css"),
                               ("docs/swagger-ui-bundle.js", "text/javascript"), ("docs/LICENSE", "text/plain")]:
        response = requests.get(f"{base}/{path}", headers=server.auth(), timeout=30)
        assert response.status_code == 200, (path, response.text[:300])
        assert response.headers["content-type"].startswith(content_type), path
    response = requests.get(f"{base}/docs/swagger-ui.js.map", headers=server.auth(), timeout=30)
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"


def test_without_the_key_torchserve_refuses_the_page_itself(base):
    """Why a plain browser cannot open it while token authorization is on (docs/api.md)."""
    assert requests.get(f"{base}/docs", timeout=30).status_code == 400


def test_the_page_asks_for_the_key_then_loads_without_an_error(page, base, server):
    before = opened_with_key(page, base, server)
    # The first visit's one error: TorchServe's 400 for openapi.json, fetched before the key was given.
    assert len(before) == 1 and "400" in before[0], before
    page.wait_for_timeout(500)
    assert page.errors == []
    assert page.locator(".auth-wrapper .authorize.locked").count() == 1  # the Authorize dialog holds the key


def test_the_page_lists_every_operation_of_the_document(page, base, server):
    opened_with_key(page, base, server)
    document = requests.get(f"{base}/openapi.json", headers=server.auth(), timeout=30).json()
    expected = sorted((method.upper(), path) for path, item in document["paths"].items()
                      for method in item if method in METHODS)
    shown = page.eval_on_selector_all(".opblock", """blocks => blocks.map(block => [
        block.querySelector('.opblock-summary-method').innerText,
        block.querySelector('.opblock-summary-path').getAttribute('data-path')])""")
    assert sorted(map(tuple, shown)) == expected
    assert (("POST", EMBEDDINGS) in expected) and len(expected) >= 7


def test_try_it_out_embeds_through_the_page_with_the_key(page, base, server):
    opened_with_key(page, base, server)
    operation = page.locator(".opblock", has=page.locator(f'.opblock-summary-path[data-path="{EMBEDDINGS}"]'))
    operation.locator(".opblock-summary").click()
    operation.locator(".try-out__btn").click()
    texts = ["a browsable API page", "vectors from the page"]
    operation.locator("textarea.body-param__text").fill(f'{{"input": ["{texts[0]}", "{texts[1]}"]}}')
    with page.expect_response(lambda r: r.url.endswith(EMBEDDINGS)) as answer:
        operation.locator("button.execute").click()
    response = answer.value
    assert response.request.headers["authorization"] == server.auth()["Authorization"]
    assert response.status == 200, response.text()
    served = np.array([item["embedding"] for item in response.json()["data"]])
    assert served.shape == (2, 384)
    direct = vectors(predict(server, {"input": texts}, model=MODEL, path="v1/embeddings"))  # as any client sends
    assert np.all(np.sum(served * direct, axis=1) > 0.999)
    # and the page shows the answer
    assert operation.locator(".live-responses-table tr.response .response-col_status").inner_text().strip() == "200"
    assert page.errors == [], page.errors
