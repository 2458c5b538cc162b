"""The README and docs/ stay small, linked, and true to the code they describe."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from embedserve.handler.api.route import Route
from embedserve.handler.settings import Settings
from tests.support.doc_commands import NOT_RUN, RUN_LANGUAGES, blocks

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
MARKDOWN = [README, *DOCS]

# [text](target) and ![alt](target); the target ends at whitespace or ')'.
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^\s*(```|~~~)")


def _prose_and_code(text: str) -> tuple[list[str], list[str]]:
    """The lines outside fenced blocks, and those inside them."""
    prose, code, inside = [], [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            inside = not inside
            continue
        (code if inside else prose).append(line)
    return prose, code


def _ids(paths):
    return [str(p.relative_to(REPO)) for p in paths]


def test_readme_is_under_10_kib():
    size = len(README.read_bytes())
    assert size < 10_240, f"README.md is {size} bytes; move details into docs/"


@pytest.mark.parametrize("doc", MARKDOWN, ids=_ids(MARKDOWN))
def test_relative_links_resolve(doc: Path):
    prose, _ = _prose_and_code(doc.read_text())
    broken = []
    for line in prose:
        for target in _LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
                continue  # a URL, a mail address, or an anchor in the same file
            path = target.split("#", 1)[0].split("?", 1)[0]
            if not (doc.parent / path).exists():
                broken.append(target)
    assert not broken, f"{doc.relative_to(REPO)} links to missing files: {broken}"


def _make_targets() -> set[str]:
    targets = set()
    for line in (REPO / "Makefile").read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+(?:\s+[A-Za-z0-9_.-]+)*)\s*::?(?!=)", line)
        if match:
            targets.update(match.group(1).split())
    return targets


@pytest.mark.parametrize("doc", MARKDOWN, ids=_ids(MARKDOWN))
def test_named_make_targets_exist(doc: Path):
    prose, code = _prose_and_code(doc.read_text())
    named = set()
    for line in prose:
        named.update(re.findall(r"`make ([A-Za-z0-9_-]+)", line))
    for line in code:
        named.update(re.findall(r"(?:^|[;&|]\s*)make ([A-Za-z0-9_-]+)", line.strip()))
    missing = named - _make_targets()
    assert not missing, f"{doc.relative_to(REPO)} names make targets the Makefile lacks: {sorted(missing)}"


def _settings_table_names() -> set[str]:
    text = (REPO / "docs" / "models.md").read_text()
    section = text.split("\n## Handler settings", 1)[1].split("\n## ", 1)[0]
    names = set()
    for line in section.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            first = line.split("|")[1]
            names.update(re.findall(r"`([a-z0-9_]+)`", first))
    return names


def test_every_handler_setting_is_in_the_settings_table():
    documented = _settings_table_names()
    missing = [f.name for f in dataclasses.fields(Settings) if f.name not in documented]
    assert not missing, f"docs/models.md's settings table lacks: {missing}"


def _readme_curl_routes() -> list[str]:
    """The route part (after /predictions/<model>[/<version>]) of every curl URL in the README."""
    _, code = _prose_and_code(README.read_text())
    joined = "\n".join(code).replace("\\\n", " ")
    base = None
    for line in joined.splitlines():
        match = re.search(r"\bB=(\S+?);", line)
        if match:
            base = match.group(1)
    routes = []
    for line in joined.splitlines():
        if not re.search(r"\bcurl\b", line):
            continue
        for url in re.findall(r"(https?://\S+|\$B\S*)", line):
            url = url.strip("'\"")
            if url.startswith("$B"):
                assert base, "the README uses $B without setting it"
                url = base + url[2:]
            assert "/predictions/" in url, f"a README curl call outside /predictions: {url}"
            routes.append(_route_of(url))
    return routes


def _route_of(url: str) -> str:
    path = url.split("/predictions/", 1)[1].split("?", 1)[0]
    parts = path.split("/")  # model, [version, route...]
    return "/".join(parts[2:]) if len(parts) > 1 else ""


def test_readme_curl_calls_use_known_routes():
    routes = _readme_curl_routes()
    assert routes, "no curl call found in README.md"
    known = {route.value for route in Route}
    unknown = sorted(set(routes) - known)
    assert not unknown, f"README.md calls routes the codec does not know: {unknown}"
    # every embedding route has at least one example
    for route in (Route.NATIVE, Route.OPENAI, Route.TEI_EMBED, Route.TEI_TOKENIZE, Route.TEI_INFO):
        assert route.value in routes, f"README.md has no curl call for {route.name}"


def test_every_docs_command_not_run_still_names_a_block_and_says_why():
    """tests/integration/test_docs_commands.py runs every command block but these: a stale entry
    would silently excuse a block written later."""
    for entry in NOT_RUN:
        matched = [b for b in blocks(REPO / entry.doc)
                   if b.language in RUN_LANGUAGES and re.search(entry.pattern, b.text)]
        assert matched, f"NOT_RUN's entry for {entry.doc} ({entry.pattern}) matches no command block"
        assert len(entry.reason) > 20, f"NOT_RUN's entry for {entry.doc} ({entry.pattern}) needs its reason"
