"""Archives made once a test session: a build is the suite's costliest step (staging, the ONNX
export, the engine trials, the smoke check against sentence-transformers), and the served tests
ask for the same archive again and again under other TorchServe settings.

A build is keyed by its build_mar arguments without the REGISTRATION flags and by the model
folder's name and files: a later build of the same key copies the archive, writes the asked
TorchServe settings into its model-config.yaml (which TorchServe reads before config.properties'
`models=`) and registers it, as `./build_mar.sh` would have. What the build printed on standard
error is printed again: tests read its notes.

tests/unit/archive builds without the cache: those tests check the build itself."""

from __future__ import annotations

import contextlib
import io
import json
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


class ArchiveCache:
    """Builds in `root`, each once; `reused` and `built` count what it saved."""

    def __init__(self, root: Path):
        self.root, self.built, self.reused = root, 0, 0
        self._archives: dict[tuple, Built] = {}

    def build(self, config: Path, *args: str) -> Path:
        """build_mar `args` into the model store beside `config`, registered in it; the .mar."""
        archive_args, settings = split_registration(list(args))
        key = archive_key(archive_args)
        built = self._archives.get(key)
        if built is None:
            built = self._archives[key] = self._make(archive_args)
            self.built += 1
        else:
            self.reused += 1
            sys.stderr.write(built.stderr)
        return install(built, config, settings)

    def _make(self, archive_args: list[str]) -> Built:
        folder = Path(tempfile.mkdtemp(prefix="build-", dir=self.root))
        scratch = isolated_config(folder, REPO / "config.properties")  # only read by the build
        args = parse_args([*archive_args, "--export-path", str(folder / "model_store"), "--config", str(scratch)])
        printed = Tee(sys.stderr)
        with contextlib.redirect_stderr(printed):
            try:
                archive = make_archive(args)
            except BUILD_ERRORS as err:
                raise AssertionError(f"build_mar failed for {archive_args}: {err}") from err
        return Built(archive, args.name, args.version, printed.getvalue())


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
