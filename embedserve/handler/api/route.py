"""The paths a model answers, after `<model>/<version>/` in its URL: the names every layer shares.

Which family parses and answers each path, and for which task, is declared by the route families
(embedserve/handler/routes/); this is only their vocabulary, and the error shape each path answers in.
"""

from __future__ import annotations

from enum import Enum

from embedserve.handler.api.errors import not_found


class Route(Enum):
    NATIVE = ""
    OPENAI = "v1/embeddings"
    TEI_EMBED = "embed"
    TEI_EMBED_SPARSE = "embed_sparse"
    TEI_EMBED_ALL = "embed_all"
    TEI_SIMILARITY = "similarity"
    TEI_TOKENIZE = "tokenize"
    TEI_INFO = "info"
    OPENAPI = "openapi.json"
    DOCS = "docs"  # the API page; "docs/<asset>" its files
    TEI_RERANK = "rerank"
    TEI_PREDICT = "predict"
    RERANK_V1 = "v1/rerank"
    RERANK_V2 = "v2/rerank"
    EMBED_V2 = "v2/embed"  # Cohere's ClientV2.embed: texts or images

    @property
    def tei(self) -> bool:
        """TEI's routes answer errors in TEI's shape and statuses."""
        return self in _TEI_ROUTES


_TEI_ROUTES = frozenset((Route.TEI_EMBED, Route.TEI_EMBED_SPARSE, Route.TEI_EMBED_ALL, Route.TEI_SIMILARITY, Route.TEI_TOKENIZE, Route.TEI_INFO, Route.TEI_RERANK,
                         Route.TEI_PREDICT))
_BY_PATH = {route.value: route for route in Route}


def split_path(url_path: str | None) -> tuple[Route, str]:
    """The route of a URL path after the version, and what follows it (a docs asset's name)."""
    path = (url_path or "").strip("/")
    route = _BY_PATH.get(path)
    if route is not None:
        return route, ""
    head, _, rest = path.partition("/")
    if head == Route.DOCS.value and rest:
        return Route.DOCS, rest
    known = ", ".join(f"'{r.value}'" for r in Route)
    raise not_found(f"unknown route '{path}' after /<model>/<version>/; known: {known}")
