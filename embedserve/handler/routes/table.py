"""Every route the handler answers, gathered from the route families, and the ones a task serves.

A path has one spec for most tasks (ROUTES); a task whose answers differ in kind (a sparse
model's native route) has its own spec of the same path (TASK_ROUTES), found first."""

from __future__ import annotations

from embedserve.handler.api.errors import not_found
from embedserve.handler.api.route import Route, split_path
from embedserve.handler.model.description import Task
from embedserve.handler.routes import cohere, hybrid, multi_vector, native, openai, sparse, tei
from embedserve.handler.routes.base import RouteSpec, describing
from embedserve.handler.routes.describe import docs_operations, openapi_operations

ROUTES: dict[Route, RouteSpec] = {spec.route: spec for spec in (
    *native.ROUTES, *openai.ROUTES, *tei.ROUTES, *cohere.ROUTES, describing(Route.OPENAPI, openapi_operations),
    describing(Route.DOCS, docs_operations))}
TASK_ROUTES: dict[tuple[Route, Task], RouteSpec] = {(spec.route, task): spec for spec in (*sparse.ROUTES, *hybrid.ROUTES,
                                                                                *multi_vector.ROUTES)
                                                    for task in spec.tasks}
assert set(ROUTES) | {route for route, _ in TASK_ROUTES} == set(Route), "every path has its family"


def spec_for(route: Route, task: Task) -> RouteSpec | None:
    """The spec that answers `route` for `task`'s models; None where no family declares the path
    for it (then ROUTES' spec, of another task, is what a 404 names)."""
    spec = TASK_ROUTES.get((route, task)) or ROUTES.get(route)
    return spec if spec is not None and (not spec.tasks or task in spec.tasks) else None


def task_routes(task: Task) -> tuple[Route, ...]:
    """The routes of `task`'s models, besides those every model answers (info, tokenize, ...)."""
    return tuple(route for route in Route if (spec := spec_for(route, task)) is not None and spec.tasks)


def find(url_path: str | None, task: Task) -> tuple[RouteSpec, str]:
    """The route of a URL path after the version, and what follows it (a docs asset's name); 404
    for an unknown path, or a route of another task (an embedding route on a reranker, or the
    reverse), naming the routes this model serves."""
    route, rest = split_path(url_path)
    spec = spec_for(route, task)
    if spec is None:
        served = ", ".join(f"'{r.value}'" for r in task_routes(task))
        err = not_found(f"this model is a {task.value} model: '{route.value}' is not served here; its routes are "
                        f"{served} (and 'info', 'tokenize', 'openapi.json', 'docs')")
        err.tei = route.tei
        raise err
    return spec, rest
