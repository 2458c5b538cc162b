"""Shared fixtures: a tiny random BERT made offline, an in-process engine on it, and one real
TorchServe per test session serving the tiny model and the real all-MiniLM-L6-v2."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest

from embedserve.archive.build import main as build_main
from embedserve.archive.onnx_export import export_onnx
from embedserve.archive.ts_config import update_properties
from embedserve.handler.assembly import assemble
from embedserve.handler.service import EmbeddingService
from embedserve.handler.settings import Settings
from embedserve.scripts.serverctl import TorchServe, isolated_config
from tests.model_families import FAMILIES, make_family
from tests.tiny_model import make_tiny_model

REPO = Path(__file__).resolve().parent.parent

# The tiny model's TorchServe batching: one worker and a long delay, so concurrent
# requests share batches.
TINY_BATCH_SIZE = 8
TINY_BATCH_DELAY_MS = 150
PROMPTS = {"query": "query: ", "document": "document: "}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", prompts=PROMPTS)


def make_engine(model_dir: Path, **settings) -> EmbeddingService:
    """A service on one CPU thread, cold: tests that need the measured speed warm it up themselves."""
    config = Settings.from_mapping({"device": "cpu", "cpu_threads": 1, **settings})
    return assemble(model_dir, config, model_name="tiny", cuda_available=False, warm=False)


@pytest.fixture(scope="session")
def onnx_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with the build's ONNX export beside its weights."""
    path = tmp_path_factory.mktemp("tiny-onnx") / "model"
    shutil.copytree(tiny_model_dir, path)
    outcome = export_onnx(path, max_positions=64)
    assert outcome.startswith("exported"), outcome
    return path


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir) -> EmbeddingService:
    return make_engine(tiny_model_dir)


@pytest.fixture(scope="session")
def families(tmp_path_factory) -> dict[str, Path]:
    """A tiny random model of each family users deploy (tests/model_families.py)."""
    root = tmp_path_factory.mktemp("families")
    return {family: make_family(family, root / family) for family in FAMILIES}


@pytest.fixture(scope="session")
def references(families):
    """sentence-transformers on each family: the reference for the vectors."""
    from sentence_transformers import SentenceTransformer

    return {family: SentenceTransformer(str(path), device="cpu") for family, path in families.items()}


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


@pytest.fixture(scope="session")
def server(tmp_path_factory, tiny_model_dir) -> TorchServe:
    tiny = ["--model", str(tiny_model_dir), "--name", "tiny", "--workers", "1",
            "--batch-size", str(TINY_BATCH_SIZE), "--max-batch-delay", str(TINY_BATCH_DELAY_MS)]
    # The default model, exactly as `./build_mar.sh` with no model argument builds it.
    minilm = ["--workers", "1", "--batch-size", "16"]
    packed = ["--model", str(tiny_model_dir), "--name", "tinypacked", "--workers", "1", "--set", "packed=true"]
    with serving(tmp_path_factory.mktemp("torchserve"), tiny, minilm, packed) as ts:
        yield ts
