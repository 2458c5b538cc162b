"""Every route the handler answers, gathered from the route families, and the ones a task serves."""

from __future__ import annotations

from embedserve.handler.api.errors import not_found
from embedserve.handler.api.route import Route, split_path
from embedserve.handler.model.description import Task
from embedserve.handler.routes import cohere, native, openai, tei
from embedserve.handler.routes.base import RouteSpec, describing
from embedserve.handler.routes.describe import docs_operations, openapi_operations

ROUTES: dict[Route, RouteSpec] = {spec.route: spec for spec in (
    *native.ROUTES, *openai.ROUTES, *tei.ROUTES, *cohere.ROUTES, describing(Route.OPENAPI, openapi_operations),
    describing(Route.DOCS, docs_operations))}
assert set(ROUTES) == set(Route), "every path has its family"


def task_routes(task: Task) -> tuple[Route, ...]:
    """The routes of `task`'s models, besides those every model answers (info, tokenize, ...)."""
    return tuple(route for route, spec in ROUTES.items() if task in spec.tasks)


def find(url_path: str | None, task: Task) -> tuple[RouteSpec, str]:
    """The route of a URL path after the version, and what follows it (a docs asset's name); 404
    for an unknown path, or a route of another task (an embedding route on a reranker, or the
    reverse), naming the routes this model serves."""
    route, rest = split_path(url_path)
    spec = ROUTES[route]
    if spec.tasks and task not in spec.tasks:
        served = ", ".join(f"'{r.value}'" for r in task_routes(task))
        err = not_found(f"this model is a {task.value} model: '{route.value}' is not served here; its routes are "
                        f"{served} (and 'info', 'tokenize', 'openapi.json', 'docs')")
        err.tei = route.tei
        raise err
    return spec, rest
