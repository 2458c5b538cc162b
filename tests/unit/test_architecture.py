"""The package's shape, held against its imports and its text (docs/architecture.md): imports run
down the wings, never up; no import circle; only the server adapter (embedserve/handler/torchserve/)
imports or names TorchServe; only the task slices tell a task's requests and results apart; every
handler module has its line in docs/architecture.md."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

HANDLER = Path(__file__).resolve().parents[2] / "embedserve" / "handler"
# Bottom to top: a module may import from its own level or below.
ORDER = ["worker", "model", "settings", "scheduling", "api", "inputs", "tasks", "routes", "backends", "execution", "service",
         "assembly", "torchserve"]
ARCHITECTURE_DOC = HANDLER.parents[1] / "docs" / "architecture.md"


def _level(module: str) -> int:
    return ORDER.index(module.split(".")[0])


def _imports() -> dict[str, set[str]]:
    """Each handler module (dotted, under embedserve.handler) -> the handler modules it imports."""
    graph = {}
    for path in HANDLER.rglob("*.py"):
        if path.name == "__init__.py":
            continue
        name = ".".join(path.relative_to(HANDLER).with_suffix("").parts)
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("embedserve.handler."):
                found.add(node.module.removeprefix("embedserve.handler."))
            elif isinstance(node, ast.ImportFrom) and node.module == "embedserve.handler":
                found.update(alias.name for alias in node.names)
        graph[name] = found
    return graph


def test_every_module_has_a_level():
    assert {module.split(".")[0] for module in _imports()} <= set(ORDER)


@pytest.mark.parametrize("module", sorted(_imports()))
def test_no_module_imports_from_a_wing_above_it(module):
    above = sorted(dep for dep in _imports()[module] if _level(dep) > _level(module))
    assert not above, f"{module} imports {above}, above it in {ORDER}"


def test_no_import_circle():
    graph = _imports()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in graph.get(node, ()):
            if state.get(dep) == 1:
                raise AssertionError(f"import circle: {' -> '.join(path + [dep])}")
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for module in graph:
        if module not in state:
            visit(module, [module])


def test_only_the_adapter_imports_torchserve():
    importers = set()
    for path in HANDLER.parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if any(name == "ts" or name.startswith("ts.") for name in names):
                importers.add(path.relative_to(HANDLER.parent).as_posix())
    assert importers and all(path.startswith("handler/torchserve/") for path in importers), importers


def _modules() -> list[Path]:
    return sorted(path for path in HANDLER.rglob("*.py") if path.name != "__init__.py")


def test_no_module_outside_the_adapter_names_torchserve():
    """Code, comments and docstrings: the engine speaks of "the server"; TorchServe's paths,
    files, limits and answers are the adapter's (its ServerProfile tells the rest)."""
    naming = [path.relative_to(HANDLER).as_posix() for path in HANDLER.rglob("*.py")
              if "torchserve" not in path.relative_to(HANDLER).parts
              and any(word in path.read_text() for word in ("TorchServe", "/predictions"))]
    assert not naming, naming


# The task slices' own types: telling them apart is the slices' job, not the service's or a route's.
TASK_TYPES = {"EmbeddingRequest", "ScoringRequest", "Embeddings", "Scores", "EmbedTask", "ScoreTask", "Task"}


def test_only_the_task_slices_dispatch_on_task_types():
    found = []
    for path in _modules():
        if path.relative_to(HANDLER).parts[0] == "tasks":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
                kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                names = {getattr(kind, "id", getattr(kind, "attr", None)) for kind in kinds}
                if names & TASK_TYPES:
                    found.append(f"{path.relative_to(HANDLER)}:{node.lineno}")
    assert not found, found


def test_the_service_stays_small():
    assert len((HANDLER / "service.py").read_text().splitlines()) <= 160


def test_every_handler_module_is_in_the_architecture_doc():
    """The doc lists the package once: every module by its path under embedserve/handler/."""
    text = ARCHITECTURE_DOC.read_text()
    missing = [path.relative_to(HANDLER).as_posix() for path in _modules()
               if f"`{path.relative_to(HANDLER).as_posix()}`" not in text]
    assert not missing, f"docs/architecture.md does not list {missing}"
