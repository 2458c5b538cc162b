"""The route families' reading and writing, called the way the service calls them: a request's
route looked up in the table, then its family's parse or encode."""

from embedserve.handler.api.route import split_path
from embedserve.handler.routes.table import ROUTES
from embedserve.handler.tasks.embed import Embeddings


def parse_route(url_path):
    return split_path(url_path)[0]


def parse_request(body, content_type, url_path, method=None):
    return ROUTES[parse_route(url_path)].parse(body, content_type, method)


def encode_embeddings(request, vectors, *, model_name, prompt_tokens):
    return ROUTES[request.route].encode(request, Embeddings(vectors, prompt_tokens), model_name)
