"""A real TorchServe on free loopback ports, serving what build_mar builds."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from embedserve.archive.build import main as build_main
from embedserve.archive.ts_config import update_properties
from embedserve.scripts.serverctl import TorchServe, isolated_config
from tests.support import REPO

# Builds whose vectors tests hold to float32's precision (atol 1e-5, min cosine 0.9999) pin it: under
# the default dtype, a CPU with bf16 units may serve bfloat16 (embedserve/handler/execution/engine_trial.py),
# whose own bar (0.999) the default build's tests check (test_default_build.py, test_minilm.py).
FLOAT32 = ["--dtype", "float32"]

# The tiny model's TorchServe batching in the session's server (conftest): one worker and a long
# delay, so concurrent requests share batches.
TINY_BATCH_SIZE = 8
TINY_BATCH_DELAY_MS = 150


def make_server_config(root: Path, **properties: str) -> Path:
    """The repository's config.properties on free loopback ports, with no models yet."""
    return isolated_config(root, REPO / "config.properties", **properties)


def build(config: Path, *args: str) -> None:
    code = build_main([*args, "--export-path", str(config.parent / "model_store"), "--config", str(config)])
    assert code == 0, f"build_mar failed for {args}"


@contextmanager
def serving(root: Path, *builds: list[str], env: dict[str, str] | None = None, **properties: str):
    """A real TorchServe in `root` serving the archives `builds` makes (build_mar.sh arguments
    each), on free loopback ports; `env` is set while it starts and until it embeds."""
    config = make_server_config(root)
    for args in builds:
        build(config, *args)
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
