"""The API page's answers: the page, its files by name and nothing else, a clear 404 where the
archive holds no page. The page in a real browser: tests/integration/test_docs_page.py."""

import base64
import json
from pathlib import Path

import pytest

from embedserve.handler.api.docs_page import ASSETS, ASSETS_FOLDER, HTML, JSON, assets_present, docs_answer

OPENAPI_URL = "/predictions/tiny/2.0/openapi.json"


@pytest.fixture
def assets(tmp_path) -> Path:
    """A swagger-ui/ folder as the build leaves it, each file holding its own name."""
    folder = tmp_path / ASSETS_FOLDER
    folder.mkdir()
    for name in ASSETS:
        (folder / name).write_bytes(f"contents of {name}".encode())
    return folder


def error_message(body: bytes) -> str:
    return json.loads(body)["error"]["message"]


@pytest.mark.parametrize("subpath", ["", "/", "index.html"])
def test_the_page_loads_its_files_and_the_document_by_absolute_paths(assets, subpath):
    status, body, content_type = docs_answer(subpath, OPENAPI_URL, assets)
    assert (status, content_type) == (200, HTML)
    html = body.decode()
    for name in ("swagger-ui-bundle.js", "swagger-ui.css"):
        assert f'"/predictions/tiny/2.0/docs/{name}"' in html
    # The icon inline: a browser would fetch a linked one without the key.
    icon = base64.b64encode((assets / "favicon-32x32.png").read_bytes()).decode()
    assert f'<link rel="icon" type="image/png" href="data:image/png;base64,{icon}">' in html
    assert 'var OPENAPI_URL = "/predictions/tiny/2.0/openapi.json";' in html
    assert "requestInterceptor" in html and 'preauthorizeApiKey("bearerAuth", key)' in html


@pytest.mark.parametrize("name", ASSETS)
def test_each_file_is_answered_with_its_content_type(assets, name):
    status, body, content_type = docs_answer(name, OPENAPI_URL, assets)
    assert (status, body, content_type) == (200, (assets / name).read_bytes(), ASSETS[name])


def test_content_types_fit_the_files():
    assert ASSETS["swagger-ui-bundle.js"].startswith("text/javascript")
    assert ASSETS["swagger-ui.css"].startswith("text/css")
    assert ASSETS["favicon-32x32.png"] == "image/png"


@pytest.mark.parametrize("subpath", [
    "../model/config.json", "..%2Fmodel%2Fconfig.json", "/etc/passwd", "swagger-ui.css/../../x", "package.json",
    "index.js", "swagger-ui-bundle.js.map", "docs/swagger-ui.css", ".", "..",
])
def test_no_other_name_is_served(assets, subpath):
    (assets.parent / "model").mkdir()
    (assets.parent / "model" / "config.json").write_text("{}")
    status, body, content_type = docs_answer(subpath, OPENAPI_URL, assets)
    assert (status, content_type) == (404, JSON)
    error = json.loads(body)["error"]
    assert error["code"] == "not_found" and "swagger-ui-bundle.js" in error["message"]


def test_an_archive_without_the_page_answers_404_saying_how_to_build_it_in(tmp_path):
    for subpath in ("", "swagger-ui.css"):
        status, body, content_type = docs_answer(subpath, OPENAPI_URL, tmp_path / ASSETS_FOLDER)
        assert (status, content_type) == (404, JSON)
        message = error_message(body)
        assert "no API page" in message and "./build_mar.sh" in message and "npm" in message
    assert not assets_present(tmp_path / ASSETS_FOLDER)


def test_a_partial_folder_names_what_it_lacks(assets):
    (assets / "swagger-ui.css").unlink()
    status, body, _ = docs_answer("", OPENAPI_URL, assets)
    assert status == 404 and "lacks swagger-ui.css" in error_message(body)
    assert not assets_present(assets)


def test_a_url_cannot_end_the_script_or_an_attribute(assets):
    _, body, _ = docs_answer("", '/predictions/a"</script><b>/1.0/openapi.json', assets)
    html = body.decode()
    assert "</script><b>" not in html and '"</script>' not in html
    assert '"/predictions/a\\"\\u003c/script>\\u003cb>/1.0/openapi.json"' in html
    assert 'href="/predictions/a&quot;&lt;/script&gt;&lt;b&gt;/1.0/docs/swagger-ui.css"' in html
