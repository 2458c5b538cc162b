"""A real TorchServe on free loopback ports, serving what build_mar builds."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path

from embedserve.archive.ts_config import update_properties
from embedserve.scripts.serverctl import TorchServe, isolated_config
from tests.support import REPO
from tests.support.archives import MANIFEST, ArchiveCache, rewritten
from tests.support.faults import FAULTS_ENV

# Builds whose vectors tests hold to float32's precision (atol 1e-5, min cosine 0.9999) pin it: under
# the default dtype, a CPU with bf16 units may serve bfloat16 (embedserve/handler/execution/engine_trial.py),
# whose own bar (0.999) the default build's tests check (test_default_build.py, test_minilm.py).
FLOAT32 = ["--dtype", "float32"]

# The tiny model's TorchServe batching in the session's server (conftest): one worker and a long
# delay, so concurrent requests share batches.
TINY_BATCH_SIZE = 8
TINY_BATCH_DELAY_MS = 150

# The entry of a worker that injects faults, and what it imports beside the archive's embedserve/.
FAULT_ENTRY = "fault_entry.py"
FAULT_MODULES = ("tests/__init__.py", "tests/support/__init__.py", "tests/support/faults.py")


def make_server_config(root: Path, **properties: str) -> Path:
    """The repository's config.properties on free loopback ports, with no models yet."""
    return isolated_config(root, REPO / "config.properties", **properties)


# The session's archives, each built once (tests/support/archives.py); removed when the session ends.
ARCHIVES = ArchiveCache.for_session()


def build(config: Path, *args: str) -> Path:
    """build_mar `args` into the model store beside `config` and register it there; the .mar."""
    return ARCHIVES.build(config, *args)


def with_fault_entry(mar: Path) -> None:
    """Make the built archive `mar` start its workers through tests/support/fault_entry.py, which
    injects the faults EMBEDSERVE_TEST_FAULTS names: the entry goes to the archive's root, where the
    build puts the real one, and into the manifest; the test modules it imports go beside embedserve/,
    where the worker imports them from."""
    def entered(name: str, data: bytes) -> bytes:
        if name != MANIFEST:
            return data
        manifest = json.loads(data)
        manifest["model"]["handler"] = FAULT_ENTRY
        return json.dumps(manifest, indent=2).encode()

    part = mar.with_name(f"{mar.name}.part")
    with rewritten(mar, part, entered) as archive:
        archive.write(REPO / "tests" / "support" / FAULT_ENTRY, FAULT_ENTRY)
        for path in FAULT_MODULES:
            archive.write(REPO / path, path)
    part.replace(mar)


@contextmanager
def serving(root: Path, *builds: list[str], env: dict[str, str] | None = None, faults: str = "",
            **properties: str):
    """A real TorchServe in `root` serving the archives `builds` makes (build_mar.sh arguments
    each), on free loopback ports; `env` is set while it starts and until it embeds. `faults`
    (e.g. "oom_above_tokens=40"): the workers inject them (with_fault_entry)."""
    config = make_server_config(root)
    for args in builds:
        build(config, *args)
    if faults:
        for mar in (config.parent / "model_store").glob("*.mar"):
            with_fault_entry(mar)
        env = {**(env or {}), FAULTS_ENV: faults}  # the workers inherit it from the frontend
    update_properties(config, properties)  # after the builds, which rewrite job_queue_size
    ts = TorchServe(config, root)
    try:
        with environment(env or {}):
            ts.start()
            ts.wait_ready(timeout=600)
        yield ts
    finally:
        ts.stop()


@contextmanager
def environment(variables: dict[str, str]):
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
