"""Archives made once a test session: a build is the suite's costliest step (staging, the ONNX
export, the engine trials, the smoke check against sentence-transformers), and the served tests
ask for the same archive again and again under other TorchServe settings.

A build is keyed by its build_mar arguments without the REGISTRATION flags and by the model
folder's name and files: a later build of the same key copies the archive, writes the asked
TorchServe settings into its model-config.yaml (which TorchServe reads before config.properties'
`models=`) and registers it, as `./build_mar.sh` would have. What the build printed on standard
error is printed again: tests read its notes.

The cache is a folder the session's processes share (pytest-xdist's workers inherit its path
from the process that made it): a build runs under the lock of its key, so a worker that asks for an
archive another is building waits for it instead of building it again.

tests/unit/archive builds without the cache: those tests check the build itself."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

import yaml

from embedserve.archive.build import BUILD_ERRORS, REGISTRATION, Archive, make_archive, parse_args, register
from embedserve.archive.digest import sha256_files
from embedserve.scripts.serverctl import isolated_config
from tests.support import REPO

# build_mar flags that only set TorchServe's settings of the model, and the settings each sets.
REGISTRATION_FLAGS = {"--workers": ("minWorkers", "maxWorkers"), "--batch-size": ("batchSize",),
                      "--max-batch-delay": ("maxBatchDelay",), "--response-timeout": ("responseTimeout",),
                      "--startup-timeout": ("startupTimeout",)}
assert {key for keys in REGISTRATION_FLAGS.values() for key in keys} == set(REGISTRATION)
CONFIG_FILE = "model-config.yaml"
MANIFEST = "MAR-INF/MANIFEST.json"


@dataclass(frozen=True)
class Built:
    archive: Archive
    name: str  # the served name and version the build resolved
    version: str
    stderr: str

    def to_json(self) -> str:
        archive = {"mar": str(self.archive.mar), "frontend": self.archive.frontend,
                   "registration": self.archive.registration}
        return json.dumps({"archive": archive, "name": self.name, "version": self.version, "stderr": self.stderr})

    @classmethod
    def from_json(cls, text: str) -> "Built":
        record = json.loads(text)
        archive = record.pop("archive")
        return cls(Archive(Path(archive["mar"]), archive["frontend"], archive["registration"]), **record)


class ArchiveCache:
    """Builds in `root`, each once across the processes that share `root`: a build's folder holds
    its archive and its record (RECORD), written under the key's lock."""

    ROOT_ENV = "EMBEDSERVE_TEST_ARCHIVES"
    RECORD = "built.json"
    REUSED = "reused.log"  # a line for each reuse, by any process

    def __init__(self, root: Path):
        self.root = root

    @classmethod
    def for_session(cls) -> "ArchiveCache":
        """The folder the session's first process made and named in ROOT_ENV, which the processes
        it starts inherit; removed when that first process exits."""
        root = os.environ.get(cls.ROOT_ENV)
        if root is None:
            root = os.environ[cls.ROOT_ENV] = tempfile.mkdtemp(prefix="embedserve-archives-")
            atexit.register(shutil.rmtree, root, ignore_errors=True)
        return cls(Path(root))

    @property
    def built(self) -> int:
        return len(list(self.root.glob(f"*/{self.RECORD}")))

    @property
    def reused(self) -> int:
        log = self.root / self.REUSED
        return len(log.read_text().splitlines()) if log.is_file() else 0

    def build(self, config: Path, *args: str) -> Path:
        """build_mar `args` into the model store beside `config`, registered in it; the .mar."""
        archive_args, settings = split_registration(list(args))
        folder = self.root / hashlib.sha256(repr(archive_key(archive_args)).encode()).hexdigest()[:16]
        record = folder / self.RECORD
        with _locked(folder.with_suffix(".lock")):
            if record.is_file():
                built = Built.from_json(record.read_text())
                with (self.root / self.REUSED).open("a") as log:
                    log.write(f"{built.name}\n")
                sys.stderr.write(built.stderr)
            else:
                built = self._make(archive_args, folder)
                record.write_text(built.to_json())
        return install(built, config, settings)

    def _make(self, archive_args: list[str], folder: Path) -> Built:
        shutil.rmtree(folder, ignore_errors=True)  # what a build that failed left
        folder.mkdir()
        scratch = isolated_config(folder, REPO / "config.properties")  # only read by the build
        args = parse_args([*archive_args, "--export-path", str(folder / "model_store"), "--config", str(scratch)])
        printed = Tee(sys.stderr)
        with contextlib.redirect_stderr(printed):
            try:
                archive = make_archive(args)
            except BUILD_ERRORS as err:
                raise AssertionError(f"build_mar failed for {archive_args}: {err}") from err
        return Built(archive, args.name, args.version, printed.getvalue())


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (made if missing) among the machine's processes."""
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        yield


def split_registration(args: list[str]) -> tuple[list[str], dict[str, int]]:
    """`args` without the REGISTRATION_FLAGS, and the settings those flags asked for."""
    archive_args, settings = [], {}
    words = iter(args)
    for word in words:
        flag, sep, value = word.partition("=")
        if flag in REGISTRATION_FLAGS:
            value = value if sep else next(words)
            settings.update(dict.fromkeys(REGISTRATION_FLAGS[flag], int(value)))
        else:
            archive_args.append(word)
    return archive_args, settings


def archive_key(args: list[str]) -> tuple:
    """`args` with the model folder's path replaced by its name (the served model_id) and its
    files' names and contents: folders made alike in two test modules share one build, and a test
    that rewrites a file builds again."""
    if "--model" not in args or not Path(args[args.index("--model") + 1]).is_dir():
        return tuple(args)
    at = args.index("--model") + 1
    folder = Path(args[at]).resolve()
    files = sorted(path for path in folder.rglob("*") if path.is_file())
    names = "\n".join(str(path.relative_to(folder)) for path in files)
    return (*args[:at], folder.name, names, sha256_files(files), *args[at + 1:])


def install(built: Built, config: Path, settings: dict[str, int]) -> Path:
    """A copy of the built archive in `config`'s model store with `settings`, registered in `config`."""
    archive = built.archive
    store = config.parent / "model_store"
    store.mkdir(exist_ok=True)
    mar = store / archive.mar.name
    registration = {**archive.registration, **settings}
    if registration == archive.registration:
        shutil.copyfile(archive.mar, mar)
    else:
        with_settings(archive.mar, mar, registration)
    register(replace(archive, mar=mar, registration=registration), config, built.name, built.version)
    return mar


def with_settings(source: Path, target: Path, registration: dict[str, int]) -> None:
    """`source` copied to `target`, its model-config.yaml saying `registration`."""
    with zipfile.ZipFile(source) as built:
        config_file = json.loads(built.read(MANIFEST))["model"].get("configFile", CONFIG_FILE)

    def settled(name: str, data: bytes) -> bytes:
        if name != config_file:
            return data
        return yaml.safe_dump({**yaml.safe_load(data), **registration}, sort_keys=False).encode()

    with rewritten(source, target, settled):
        pass


@contextlib.contextmanager
def rewritten(source: Path, target: Path, change: Callable[[str, bytes], bytes]) -> Iterator[zipfile.ZipFile]:
    """`source` copied to `target` member by member, each member's bytes through `change(name,
    data)`; the target is yielded open, for members to add."""
    with zipfile.ZipFile(source) as built, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as archive:
        for member in built.infolist():
            archive.writestr(member, change(member.filename, built.read(member)))
        yield archive


class Tee(io.StringIO):
    """Keeps what is written and passes it on to `stream`."""

    def __init__(self, stream):
        super().__init__()
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(text)
        return super().write(text)
