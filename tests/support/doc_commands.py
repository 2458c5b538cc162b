"""The commands of the README and docs/*.md, found and run as written.

The convention (docs/testing.md): every fenced block whose language is bash, sh, shell or python
is a command to run, unless NOT_RUN below names it with the reason. Blocks in any other language
(json, properties, mermaid, none) are output or configuration, not commands. A doc's shell blocks
run in order in one bash session, in the root of a fresh copy of the repository where `make serve`
has started the server; its python blocks run afterwards. The only changes to their text: the
loopback ports 8080, 8081 and 8082 become the test server's, and the placeholder model folders
(an embedding model's, a cross-encoder's, a SPLADE model's, a bge-m3 model's) become small models
made offline."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.support import REPO

RUN_LANGUAGES = {"bash", "sh", "shell", "python"}
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PLACEHOLDER_MODEL = "/path/to/hf-model-folder"
# A reranker's folder, made offline beside the placeholder model (same parent folder).
PLACEHOLDER_RERANKER = "/path/to/cross-encoder-folder"
# A sparse (SPLADE) model's folder, made offline beside the placeholder model.
PLACEHOLDER_SPLADE = "/path/to/splade-folder"
# A hybrid (bge-m3) model's folder, made offline beside the placeholder model.
PLACEHOLDER_M3 = "/path/to/bge-m3-folder"
PLACEHOLDER_COLBERT = "/path/to/colbert-folder"
# An image-text (CLIP) model's folder, made offline beside the placeholder model.
PLACEHOLDER_CLIP = "/path/to/clip-folder"
# A page retriever's (ColPali) folder, made offline beside the placeholder model.
PLACEHOLDER_PAGES = "/path/to/colpali-folder"


@dataclass(frozen=True)
class NotRun:
    doc: str  # relative to the repository root
    pattern: str  # a regular expression found in the block's text
    reason: str


# Blocks the test does not run, each with why; keep this list short. A new block in a run
# language is run unless it matches one of these.
NOT_RUN = [
    NotRun("README.md", r"(?m)^make serve", "`make serve` is how the test starts its server (it runs that line); "
           "`make test` is the suite this test belongs to"),
    NotRun("README.md", r"make (test-)?image",
           "builds the container image for minutes; .ci/run runs `make image`, and tests/integration/test_image.py "
           "runs the image as `make test-image` does"),
    NotRun("docs/models.md", r"BAAI/", "a hub id needs the Hugging Face hub; the default build is `make serve`'s"),
    NotRun("docs/deployment.md", r"\b(docker|podman|kubectl|helm|aws)\b|\$P\b|make (test-)?image",
           "needs a container runtime, a registry, a cluster or cloud storage, or builds the image for minutes; "
           "tests/integration/test_image.py builds the image with `make image` and runs it with podman, and "
           "tests/integration/test_deploy.py checks the manifests and the entry point offline"),
    NotRun("docs/gpu.md", r"make bench-gpu|gpu_run\.sh|/tmp/jre|gpu_host_probe",
           "needs a GPU machine, or runs the GPU benchmark for minutes; tests/integration/test_bench_gpu.py, "
           "test_gpu_run.py and test_gpu_host_probe.py run their CPU mode"),
    NotRun("docs/performance.md", r"make (bench|bench-gpu|loadtest)\b|locust|bench\.overlap",
           "benchmarks and load tests take 1 to 35 minutes of full load; tests/integration/test_bench.py, "
           "test_bench_overlap.py and test_loadtest.py run short ones"),
    NotRun("docs/operations.md", r"make soak|bench\.soak|test_resilience",
           "the soak and recovery runs take about 20 minutes; their tests are part of `make test`"),
    NotRun("docs/operations.md", r"apt install redis-server",
           "installs a system package and starts redis on the fixed port 6379; "
           "tests/integration/test_cache_served.py serves these settings with its own redis-server"),
    NotRun("docs/architecture.md", r"class Backend\(Protocol\)",
           "an excerpt of embedserve/handler/backends/base.py, not a program"),
]

_FENCE = re.compile(r"^(```|~~~)\s*([A-Za-z0-9_+-]*)")


@dataclass(frozen=True)
class Block:
    doc: str
    line: int  # the fence's line, 1-based
    language: str
    text: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a markdown file."""
    found, fence, start, language, body = [], None, 0, "", []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        match = _FENCE.match(line.strip())
        if fence is None and match:
            fence, start, language, body = match.group(1), number, match.group(2).lower(), []
        elif fence is not None and line.strip() == fence:
            found.append(Block(str(path.relative_to(REPO)), start, language, "\n".join(body) + "\n"))
            fence = None
        elif fence is not None:
            body.append(line)
    return found


def not_run_reason(block: Block) -> str | None:
    for entry in NOT_RUN:
        if entry.doc == block.doc and re.search(entry.pattern, block.text):
            return entry.reason
    return None


def runnable(path: Path) -> list[Block]:
    return [b for b in blocks(path) if b.language in RUN_LANGUAGES and not_run_reason(b) is None]


def substitute(text: str, ports: dict[str, int], model_dir: Path | None = None) -> str:
    """The block as the test runs it: the documented ports become the server's."""
    for documented, api in ((8080, "inference"), (8081, "management"), (8082, "metrics")):
        text = re.sub(rf"(127\.0\.0\.1|localhost):{documented}\b", rf"\g<1>:{ports[api]}", text)
    if model_dir is not None:
        text = text.replace(PLACEHOLDER_MODEL, str(model_dir))
        for placeholder in (PLACEHOLDER_RERANKER, PLACEHOLDER_SPLADE, PLACEHOLDER_M3, PLACEHOLDER_COLBERT,
                            PLACEHOLDER_CLIP, PLACEHOLDER_PAGES):
            text = text.replace(placeholder, str(model_dir.parent / placeholder.rsplit("/", 1)[1]))
    return text


def fresh_copy(destination: Path) -> Path:
    """The repository's files as a clone would have them (tracked or new, not ignored), taken from
    the working tree, with the environment `make serve` installed (.venv) linked in."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, names):
        source = REPO / name
        if source.is_file():  # a tracked file deleted in the working tree is gone
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)  # keeps times, so make sees .venv as up to date
    (destination / ".venv").symlink_to(REPO / ".venv")
    return destination


# Every curl call of a shell block fails on an HTTP error status and leaves its arguments and
# answer in $DOC_CALLS for the checks; otherwise it is curl as written.
SHELL_PRELUDE = r"""
set -Eeo pipefail
trap 'echo "command failed with status $?: $BASH_COMMAND" >&2' ERR
curl() {
  local call
  call=$(mktemp -d "$DOC_CALLS/$(date +%s%N).XXXX")
  printf '%s\0' "$@" > "$call/args"
  command curl --fail-with-body "$@" | tee "$call/answer"
}
"""


def shell_script(doc_blocks: list[Block], ports: dict[str, int], model_dir: Path | None) -> str:
    parts = [SHELL_PRELUDE]
    for block in doc_blocks:
        parts.append(f"echo '>>> {block}' >&2\n{substitute(block.text, ports, model_dir)}")
    return "\n".join(parts)


@dataclass
class Call:
    args: list[str]
    answer: bytes

    @property
    def url(self) -> str:
        return next((a for a in self.args if re.match(r"https?://", a)), "")

    @property
    def body(self) -> str | None:
        for flag, value in zip(self.args, self.args[1:]):
            if flag in ("-d", "--data", "--data-binary", "--data-raw"):
                return value
        return None

    @property
    def content_type(self) -> str | None:
        for flag, value in zip(self.args, self.args[1:]):
            if flag in ("-H", "--header") and value.lower().startswith("content-type:"):
                return value.split(":", 1)[1].strip()
        return None


def calls(folder: Path) -> list[Call]:
    return [Call([a for a in (call / "args").read_bytes().decode().split("\0")[:-1]], (call / "answer").read_bytes())
            for call in sorted(folder.iterdir())]
