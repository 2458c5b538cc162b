"""The browsable API page of a model: Swagger UI over its OpenAPI document, from the archive.

Served at <model>/<version>/docs, and its files at <version>/docs/<name>: `docs_answer` gives the
status, body and content type of each. No CDN: swagger-ui-dist (Apache-2.0, pinned in
embedserve/archive/swagger_ui.py) travels in the .mar, in the folder swagger-ui/ beside the
handler package; an archive built without it answers 404 saying how to build it in.

The key. Where the server reads it only from each request's `Authorization: Bearer` header, as
ours does (docs/api.md, "The API page"), a browser cannot open the page by itself: it sends no
such header for a page it opens or the scripts the page loads. The page opens where the browser
sends the header (a header-setting extension, a browser driven over DevTools as
tests/integration/test_docs_page.py does), or where the server asks for no key. The page's own
requests, openapi.json and every "Try it out" call, carry the key typed into its key field (kept
for the tab in sessionStorage, sent to this server only), and Swagger UI's Authorize dialog
shows it authorized.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from embedserve.handler.api.errors import not_found

ASSETS_FOLDER = "swagger-ui"
# Where the build puts the files: the archive's root, which holds this package.
ASSETS_DIR = Path(__file__).resolve().parents[3] / ASSETS_FOLDER
# The only files served, by name, with their content types: no other name reaches the disk.
ASSETS = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "favicon-32x32.png": "image/png",
    "LICENSE": "text/plain; charset=utf-8",
    "NOTICE": "text/plain; charset=utf-8",
    "swagger-ui-bundle.js.LICENSE.txt": "text/plain; charset=utf-8",
}
PAGE_NAMES = ("", "index.html")
HTML = "text/html; charset=utf-8"
JSON = "application/json"

Answer = tuple[int, bytes, str]


def docs_answer(subpath: str, openapi_url: str, assets: Path = ASSETS_DIR) -> Answer:
    """The answer to <version>/docs/<subpath>: "" the page, else a file of ASSETS by name.
    `openapi_url`: the document's absolute path, ending <version>/openapi.json; the page fetches
    its files from the sibling <version>/docs/."""
    name = subpath.strip("/")
    if name not in PAGE_NAMES and name not in ASSETS:
        return _error(f"no file '{name}' in the API page; its files: {', '.join(ASSETS)}")
    missing = [asset for asset in ASSETS if not (assets / asset).is_file()]
    if missing:
        return _error(f"this archive holds no API page ({assets.name}/ lacks {', '.join(missing)}): the build could "
                      "not fetch swagger-ui-dist from the npm registry and said so; run ./build_mar.sh where npm "
                      "reaches the registry (python -m embedserve.archive.swagger_ui fetches it alone into "
                      "build/swagger-ui/, which later builds use offline)")
    if name in PAGE_NAMES:
        return 200, page(openapi_url, assets).encode(), HTML
    return 200, (assets / name).read_bytes(), ASSETS[name]


def assets_present(assets: Path = ASSETS_DIR) -> bool:
    """Whether this archive carries the page's files (for /info)."""
    return all((assets / asset).is_file() for asset in ASSETS)


def _error(message: str) -> Answer:
    return 404, json.dumps(not_found(message).body()).encode(), JSON


def page(openapi_url: str, assets: Path = ASSETS_DIR) -> str:
    base = openapi_url.rsplit("/", 1)[0] + "/docs/"
    # Into the script as a JSON string, '<' escaped so no value can end the script element.
    url = json.dumps(openapi_url).replace("<", "\\u003c")
    # The icon in the page: a browser fetches a linked icon without the key, which the server refuses.
    icon = "data:image/png;base64," + base64.b64encode((assets / "favicon-32x32.png").read_bytes()).decode()
    return (_PAGE.replace("{{BASE}}", _attribute(base)).replace("{{TITLE}}", _attribute(openapi_url))
            .replace("{{ICON}}", icon).replace("{{OPENAPI_URL}}", url))


def _attribute(text: str) -> str:
    return text.replace("&", "&amp;").replace('"', "&quot;").replace("<", "&lt;").replace(">", "&gt;")


_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>API: {{TITLE}}</title>
<link rel="icon" type="image/png" href="{{ICON}}">
<link rel="stylesheet" href="{{BASE}}swagger-ui.css">
<style>
  body { margin: 0; }
  #key-bar { display: flex; flex-wrap: wrap; gap: .6em; align-items: center; padding: .7em 1.5em;
             font-family: sans-serif; font-size: 14px; background: #1f2933; color: #fff; }
  #key-bar input { width: 24em; padding: .3em; }
  #key-note { color: #fbd38d; }
</style>
</head>
<body>
<form id="key-bar">
  <label for="key">Inference key</label>
  <input id="key" name="key" type="password" autocomplete="off" placeholder="sent as Authorization: Bearer">
  <button id="use-key" type="submit">Use key</button>
  <span id="key-note"></span>
</form>
<div id="swagger-ui"></div>
<script src="{{BASE}}swagger-ui-bundle.js"></script>
<script>
"use strict";
(function () {
  var OPENAPI_URL = {{OPENAPI_URL}};
  var STORE = "embedserve.inferenceKey";  // this tab's, in sessionStorage
  var key = sessionStorage.getItem(STORE) || "";
  var field = document.getElementById("key");
  var note = document.getElementById("key-note");
  field.value = key;

  document.getElementById("key-bar").addEventListener("submit", function (event) {
    event.preventDefault();
    sessionStorage.setItem(STORE, field.value.trim());
    location.reload();  // openapi.json again, with the key
  });

  function sameOrigin(url) {
    return new URL(url, location.href).origin === location.origin;
  }
  function authorized(headers) {
    return Object.keys(headers || {}).some(function (name) { return name.toLowerCase() === "authorization"; });
  }

  var ui = SwaggerUIBundle({
    url: OPENAPI_URL,
    dom_id: "#swagger-ui",
    deepLinking: true,
    // The key on every request of the page to this server that has none yet: openapi.json, and
    // each "Try it out" call (the Authorize dialog's key, where one is set there, comes first).
    requestInterceptor: function (request) {
      if (key && sameOrigin(request.url) && !authorized(request.headers)) {
        request.headers = request.headers || {};
        request.headers.Authorization = "Bearer " + key;
      }
      return request;
    },
    responseInterceptor: function (response) {
      var refused = response.status === 400 || response.status === 401 || response.status === 403;
      if (refused && new URL(response.url, location.href).pathname === new URL(OPENAPI_URL, location.href).pathname) {
        note.textContent = key
          ? "the server refused this key (HTTP " + response.status + "): keys expire, enter the current one"
          : "the server asks for the inference key (HTTP " + response.status + "): enter it here";
        field.focus();
      }
      return response;
    },
    onComplete: function () {
      if (key) {
        ui.preauthorizeApiKey("bearerAuth", key);
      }
    }
  });
})();
</script>
</body>
</html>
"""
