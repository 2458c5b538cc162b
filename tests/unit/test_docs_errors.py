"""docs/api.md's error table is the one for people, and it says what errors.KINDS says: every
kind, its status on the native and OpenAI routes and on the TEI routes, its code and TEI type."""

from __future__ import annotations

import re
from pathlib import Path

from embedserve.handler.api import errors
from embedserve.handler.api.errors import KINDS
from embedserve.handler.routes import schema

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _section(doc: str, heading: str) -> str:
    text = (DOCS / doc).read_text()
    assert f"\n## {heading}\n" in text, f"docs/{doc} has no '## {heading}' section"
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def _error_table() -> list[list[str]]:
    """The rows of the table under docs/api.md's "Errors", as lists of stripped cells."""
    lines = [line for line in _section("api.md", "Errors").splitlines() if line.startswith("|")]
    assert lines, "docs/api.md's Errors section has no table"
    header, rule, *rows = lines
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "`code`", "native and OpenAI routes", "TEI routes", "when"], header
    assert set(rule) <= set("|-: "), rule
    # a cell may hold a pipe only inside backticks; none does, so a plain split is safe
    return [[cell.strip() for cell in row.strip().strip("|").split("|")] for row in rows]


def _batch_only_kinds() -> set[errors.ErrorKind]:
    """Kinds no route raises for one request, only for a whole batch: those are always answered
    in OpenAI's shape, TEI routes included (service.failed, service.unavailable)."""
    per_request = {*schema.EMBED_ERRORS, *schema.TOKENIZE_ERRORS, *schema.DESCRIBE_ERRORS}
    return set(schema.BATCH_ERRORS) - per_request


def test_the_docs_error_table_is_errors_kinds():
    documented = []
    for row in _error_table():
        assert len(row) == 4, f"a row of docs/api.md's error table has {len(row)} cells: {row}"
        code, status, tei, when = row
        code_match = re.fullmatch(r"`([a-z_]+)`", code)
        tei_match = re.fullmatch(r"(\d{3})(?: `([A-Za-z]+)`|, in OpenAI's shape)", tei)
        assert code_match and status.isdigit() and tei_match and when, f"unreadable row: {row}"
        documented.append((code_match.group(1), int(status), int(tei_match.group(1)), tei_match.group(2)))

    batch_only = _batch_only_kinds()
    expected = [(kind.code, kind.status, kind.tei_status, None if kind in batch_only else kind.tei_type)
                for kind in KINDS]
    # the same kinds, in KINDS' order, with the same statuses and TEI types
    assert documented == expected, (
        "docs/api.md's error table differs from errors.KINDS\n"
        f"  documented: {documented}\n  KINDS:      {expected}")


def test_the_openai_type_follows_the_rule_the_docs_state():
    section = _section("api.md", "Errors")
    assert "`type` is `server_error` at status 500 and above,\n`invalid_request_error` below" in section
    for kind in KINDS:
        assert kind.error_type == ("server_error" if kind.status >= 500 else "invalid_request_error"), kind


def test_the_batch_failures_the_docs_name_are_the_batch_kinds():
    section = _section("api.md", "Errors")
    named = re.search(r"A failure of a whole batch \(([^)]*)\)", section)
    assert named, "docs/api.md's Errors section no longer says how a whole batch's failure is answered"
    assert re.findall(r"`([a-z_]+)`", named.group(1)) == [kind.code for kind in schema.BATCH_ERRORS]


def test_requests_md_links_to_the_table_and_keeps_none_of_its_own():
    section = _section("requests.md", "Errors")
    assert "(api.md#errors)" in section
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert not rows, f"docs/requests.md's Errors section has a table again: {rows[:2]}"


def test_the_module_says_where_the_table_is():
    assert "docs/api.md" in errors.__doc__ and "test_docs_errors" in errors.__doc__
