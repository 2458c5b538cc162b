"""Shared fixtures: a tiny random BERT made offline, an in-process engine on it, one real
TorchServe per test session serving the tiny model and the real all-MiniLM-L6-v2, and one serving
the catalog of sparse, hybrid and multi-vector models. The helpers
behind them are in tests/support/."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from embedserve.archive.onnx_export import export_onnx
from embedserve.handler.service import EmbeddingService
from embedserve.scripts.serverctl import TorchServe
from tests.support.catalog import catalog_builds, make_catalog_models
from tests.support.engines import make_engine
from tests.support.model_families import FAMILIES, make_family
from tests.support.redis_server import RedisServer
from tests.support.serving import ARCHIVES, FLOAT32, TINY_BATCH_DELAY_MS, TINY_BATCH_SIZE, serving
from tests.support.tiny_model import PROMPTS, make_tiny_model
from tests.support.worker_memory import WorkerMemory, describe

# The session's servers share their engine trials (embedserve/handler/execution/engine_trial.py),
# as a user's servers on one machine do, but not with earlier runs or the user's own servers. The
# first process sets it; the pytest workers and the servers inherit it.
if "EMBEDSERVE_CACHE_DIR" not in os.environ:
    os.environ["EMBEDSERVE_CACHE_DIR"] = tempfile.mkdtemp(prefix="embedserve-cache-")
    atexit.register(shutil.rmtree, os.environ["EMBEDSERVE_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", prompts=PROMPTS)


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
    """A tiny random model of each family users deploy (tests/support/model_families.py)."""
    root = tmp_path_factory.mktemp("families")
    return {family: make_family(family, root / family) for family in FAMILIES}


@pytest.fixture(scope="session")
def references(families):
    """sentence-transformers on each family: the reference for the vectors."""
    from sentence_transformers import SentenceTransformer

    return {family: SentenceTransformer(str(path), device="cpu") for family, path in families.items()}


@pytest.fixture(scope="session")
def server(tmp_path_factory, tiny_model_dir) -> TorchServe:
    tiny = [*FLOAT32, "--model", str(tiny_model_dir), "--name", "tiny", "--workers", "1",
            "--batch-size", str(TINY_BATCH_SIZE), "--max-batch-delay", str(TINY_BATCH_DELAY_MS)]
    # The default model, exactly as `./build_mar.sh` with no model argument builds it.
    minilm = ["--workers", "1", "--batch-size", "16"]
    # tinypacked also keeps TorchServe's own worker loop, which tiny and minilm leave after their first batch.
    packed = ["--model", str(tiny_model_dir), "--name", "tinypacked", "--workers", "1", "--set", "packed=true",
              "--set", "own_worker_loop=false"]
    with serving(tmp_path_factory.mktemp("torchserve"), tiny, minilm, packed) as ts:
        yield ts


@pytest.fixture(scope="session")
def catalog_models(tmp_path_factory) -> dict[str, Path]:
    return make_catalog_models(tmp_path_factory.mktemp("catalog-models"))


@pytest.fixture(scope="session")
def catalog(tmp_path_factory, catalog_models) -> TorchServe:
    """The sparse, hybrid and multi-vector models on one server (tests/support/catalog.py)."""
    with serving(tmp_path_factory.mktemp("catalog"), *catalog_builds(catalog_models)) as ts:
        yield ts


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A real redis-server on a free loopback port, one for each test module that asks for it."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


INTEGRATION = Path(__file__).parent / "integration"


# The modules that use each session-scoped server, by its fixture: `make test`'s pytest-xdist
# workers run each group on one worker, which starts that server once (every other module is a
# unit of its own). A module that uses one and is not listed fails the collection.
SHARED_SERVER_MODULES = {
    "catalog": ("tests/integration/test_hybrid_served.py", "tests/integration/test_images_served.py",
                "tests/integration/test_multi_vector_served.py", "tests/integration/test_openapi_outputs.py",
                "tests/integration/test_pages_served.py", "tests/integration/test_sparse_served.py"),
    "server": ("tests/integration/test_batch_served.py", "tests/integration/test_bench.py",
               "tests/integration/test_docs_page.py", "tests/integration/test_fuzz.py",
               "tests/integration/test_image.py",  # asks for it by getfixturevalue, which the check cannot see
               "tests/integration/test_loadtest.py", "tests/integration/test_long_inputs_served.py",
               "tests/integration/test_minilm.py", "tests/integration/test_ray_data.py",
               "tests/integration/test_server.py"),
}
GROUP_OF_MODULE = {module: group for group, modules in SHARED_SERVER_MODULES.items() for module in modules}


def pytest_collection_modifyitems(items):
    """Every test under tests/integration carries the `integration` marker (`-m "not integration"`:
    the unit tests), whether or not its module says so; a module that uses a session server is
    listed with it in SHARED_SERVER_MODULES."""
    for item in items:
        if item.path.is_relative_to(INTEGRATION):
            item.add_marker(pytest.mark.integration)
    for fixture, modules in SHARED_SERVER_MODULES.items():
        users = {item.nodeid.split("::")[0] for item in items if _uses_the_session_fixture(item, fixture)}
        if users - set(modules):
            raise pytest.UsageError(f"{sorted(users - set(modules))} use the session's `{fixture}`: add them to "
                                    f"SHARED_SERVER_MODULES['{fixture}'] (tests/conftest.py)")


def _uses_the_session_fixture(item, name: str) -> bool:
    """Whether `item` gets this conftest's session fixture `name` (a module may define its own)."""
    definitions = item._fixtureinfo.name2fixturedefs.get(name) or ()
    return bool(definitions) and definitions[-1].scope == "session"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist (`make test`: -n 2) hands a worker whole modules, so that a module's servers
    start once, and each group of SHARED_SERVER_MODULES to one worker. They go in the order
    collected: the long integration modules first, the short unit modules last, so that no long
    module starts when the other worker is nearly done (xdist's own order, the most tests first,
    puts unit modules first)."""
    from tests.support.scheduling import ModuleScheduling

    config.option.loadscopereorder = False
    return ModuleScheduling(config, log, groups=GROUP_OF_MODULE)


MEMORY = WorkerMemory()
WORKERS_MEMORY: dict[str, dict | None] = {}  # the controller's: each xdist worker's summary


def pytest_runtest_logfinish(nodeid, location):
    MEMORY.note(nodeid)


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: its figures go to the controller
        session.config.workeroutput["memory"] = MEMORY.summary()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    WORKERS_MEMORY[node.gateway.id] = getattr(node, "workeroutput", {}).get("memory")


def pytest_terminal_summary(terminalreporter):
    if ARCHIVES.built or ARCHIVES.reused:
        terminalreporter.write_line(f"archives: {ARCHIVES.built} built, {ARCHIVES.reused} reused (tests/support/archives.py)")
    for name, summary in sorted(WORKERS_MEMORY.items()) or [("pytest", MEMORY.summary())]:
        terminalreporter.write_line(f"memory of {describe(name, summary)}")
