"""The largest answer the TorchServe frontend that started this worker passes on.

The frontend drops a worker whose answer is longer than its `max_response_size` (the client gets
500 "Worker died."), and it tells the worker nothing of it. So the worker reads it where the
frontend did: the properties file it was started with (TS_CONFIG_FILE, else its `-f` argument,
else config.properties in its working directory), a TS_MAX_RESPONSE_SIZE variable where that
file sets enable_envvars_config=true, else TorchServe's default; `$$NAME$$` in a value is the
variable NAME, as TorchServe substitutes it. The frontend is the first ancestor process running
org.pytorch.serve.ModelServer; only Linux's /proc is read.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Mapping

log = logging.getLogger(__name__)

TS_DEFAULT_MAX_RESPONSE_SIZE = 6_553_600  # what TorchServe uses when its properties set none
FRONTEND_CLASS = "org.pytorch.serve.ModelServer"
ENV_REFERENCE = re.compile(r"\$\$([^$]+[^$])\$\$")  # TorchServe's own pattern
ANCESTORS = 4  # worker -> (a CPU launcher) -> frontend: a few levels at most


def answer_limit(archive_bytes: int, found: tuple[int, str] | None) -> int:
    """The largest answer this worker may send: the archive's max_response_bytes, lowered to the
    frontend's max_response_size where that is lower (`found`: frontend_max_response_size()), so
    that a request whose answer would not fit gets 413 instead of a dropped worker."""
    if found is None:
        log.warning("TorchServe's max_response_size could not be read; answers are held to the archive's "
                    "max_response_bytes=%d, and a lower max_response_size drops the worker on a larger answer",
                    archive_bytes)
        return archive_bytes
    frontend_bytes, source = found
    if frontend_bytes < archive_bytes:
        log.warning("TorchServe's max_response_size=%d (%s) is below the archive's max_response_bytes=%d: requests "
                    "whose answer could be larger are refused with 413; set max_response_size=%d to serve every "
                    "request the limits allow", frontend_bytes, source, archive_bytes, archive_bytes)
        return frontend_bytes
    log.info("answers up to max_response_bytes=%d; TorchServe's max_response_size=%d (%s)",
             archive_bytes, frontend_bytes, source)
    return archive_bytes


def frontend_max_response_size(environ: Mapping[str, str] = os.environ, pid: int | None = None
                               ) -> tuple[int, str] | None:
    """(max_response_size, where it was read) for the frontend above process `pid` (this one by
    default); None where no frontend is found or its value cannot be told (it started from a
    configuration snapshot, the file is unreadable)."""
    frontend = _frontend(os.getpid() if pid is None else pid)
    if frontend is None:
        return None
    args, cwd = frontend
    path = environ.get("TS_CONFIG_FILE") or _option(args, "-f", "--ts-config-file")
    if path is None:
        if "-ncs" not in args and "--no-config-snapshots" not in args:
            return None  # TorchServe would start from its latest snapshot, which this does not read
        path = "config.properties"
    path = cwd / path  # an absolute path stays itself
    try:
        properties = read_properties(path.read_text())
    except FileNotFoundError:
        properties = {}
    except OSError:
        return None
    value, source = properties.get("max_response_size"), str(path)
    if properties.get("enable_envvars_config", "").strip().lower() == "true" and "TS_MAX_RESPONSE_SIZE" in environ:
        value, source = environ["TS_MAX_RESPONSE_SIZE"], "the TS_MAX_RESPONSE_SIZE variable"
    if value is None:
        return TS_DEFAULT_MAX_RESPONSE_SIZE, f"TorchServe's default ({path} sets none)"
    try:
        return int(ENV_REFERENCE.sub(lambda name: environ[name.group(1)], value).strip()), source
    except (KeyError, ValueError):
        return None


def read_properties(text: str) -> dict[str, str]:
    """A Java properties file's keys and values: `key=value`, `key: value` or `key value`,
    comments (# or !), and lines continued with a trailing backslash."""
    properties: dict[str, str] = {}
    logical = ""
    for line in text.splitlines():
        line = line.lstrip()
        if not logical and (not line or line[0] in "#!"):
            continue
        if (len(line) - len(line.rstrip("\\"))) % 2:  # an odd number of backslashes continues the line
            logical += line[:-1]
            continue
        logical += line
        key, value = _split(logical)
        properties[key] = value
        logical = ""
    return properties


def _split(line: str) -> tuple[str, str]:
    """A logical line's key and value: the key ends at the first =, : or blank; one = or : and
    the blanks around it separate it from the value."""
    for i, char in enumerate(line):
        if char in "=: \t\f":
            rest = line[i:].lstrip(" \t\f")
            if rest[:1] in ("=", ":"):
                rest = rest[1:]
            return line[:i], rest.lstrip(" \t\f")
    return line, ""


def _frontend(pid: int) -> tuple[list[str], Path] | None:
    """The frontend's command line and working directory, or None."""
    for _ in range(ANCESTORS):
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])  # the parent
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            if FRONTEND_CLASS in args:
                return args, Path(os.readlink(f"/proc/{pid}/cwd"))
        except (OSError, IndexError, ValueError):
            return None
    return None


def _option(args: list[str], *names: str) -> str | None:
    for i, arg in enumerate(args):
        if arg in names and i + 1 < len(args):
            return args[i + 1]
        for name in names:
            if arg.startswith(f"{name}="):
                return arg.split("=", 1)[1]
    return None
