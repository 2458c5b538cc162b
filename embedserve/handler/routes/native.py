"""The native route: POST /<model> (and /<model>/<version>).

{"input": ...} JSON, as OpenAI's route takes it and answered in OpenAI's list shape; or a text/plain
body, one text. Hugging Face clients post TEI bodies to the bare model URL: a body with `inputs`
and no `input` is TEI's /embed, answered in TEI's shape.
"""

from __future__ import annotations

from functools import partial

from embedserve.handler.api.route import Route
from embedserve.handler.model.description import Task
from embedserve.handler.routes.base import RouteSpec, embedding_request
from embedserve.handler.routes.openai import encode_list

ROUTES = (
    RouteSpec(Route.NATIVE, frozenset({Task.EMBED}),
              partial(embedding_request, Route.NATIVE, allow_token_ids=True, tei_body=True), encode_list),
)
