"""What an earlier run of the same job wrote, so that a rerun continues after it.

JSONL outputs (batch results, table rows) are written in input order, one line a row, flushed
after every request: the complete lines are the rows done. A run killed mid-write leaves a torn
last line, cut away here. Parquet outputs are written as part files, `part-<first row>.parquet`,
each renamed into place only once complete: the parts, contiguous from row 0, are the rows done
(a `.tmp` left by a kill is removed). Either way the rerun also checks that the last row written
is the input's row at that position (its custom_id or id), so another input, or an edited one,
is refused instead of being appended to."""

from __future__ import annotations

import os
from pathlib import Path

CHUNK = 1 << 20
PART_PREFIX, PART_SUFFIX = "part-", ".parquet"


def complete_lines(path: Path) -> tuple[int, bytes | None]:
    """(complete lines, the last of them) of `path`, after cutting a torn last line away; (0, None)
    when there is no file."""
    if not path.exists():
        return 0, None
    count, end = 0, 0  # end: the offset just after the last newline
    with path.open("rb") as f:
        offset = 0
        while chunk := f.read(CHUNK):
            newlines = chunk.count(b"\n")
            if newlines:
                count += newlines
                end = offset + chunk.rindex(b"\n") + 1
            offset += len(chunk)
    if end < offset:
        os.truncate(path, end)  # a torn line: the run was killed while writing it
    return count, _last_line(path, end) if count else None


def _last_line(path: Path, end: int) -> bytes:
    with path.open("rb") as f:
        start = end - 1
        while start > 0:
            step = min(CHUNK, start)
            f.seek(start - step)
            block = f.read(step)
            found = block.rfind(b"\n")
            if found >= 0:
                start = start - step + found + 1
                break
            start -= step
        f.seek(start)
        return f.read(end - start).rstrip(b"\n")


def part_name(first_row: int) -> str:
    return f"{PART_PREFIX}{first_row:012d}{PART_SUFFIX}"


def complete_parts(folder: Path) -> list[tuple[Path, int]]:
    """The complete parts in `folder` contiguous from row 0, as (path, rows); leftovers of a kill
    (`.tmp` files) and parts after a gap are removed."""
    import pyarrow.parquet as pq

    if not folder.is_dir():
        return []
    for leftover in folder.glob("*.tmp"):
        leftover.unlink()
    parts, expected = [], 0
    for path in sorted(folder.glob(f"{PART_PREFIX}*{PART_SUFFIX}")):
        first = int(path.name[len(PART_PREFIX):-len(PART_SUFFIX)])
        if first != expected:
            path.unlink()  # cannot happen when parts are written in order; never trust it
            continue
        rows = pq.ParquetFile(path).metadata.num_rows
        parts.append((path, rows))
        expected += rows
    return parts
