"""What TorchServe decides in front of the handler, for the parts that describe the API
(api/server.py): its URL paths, its authentication, and the answers it gives on its own."""

from __future__ import annotations

from embedserve.handler.api.server import ServerAnswer, ServerProfile

TORCHSERVE = ServerProfile(
    name="TorchServe",
    model_path="/predictions/{model}",
    versioned_path="/predictions/{model}/{version}",
    auth="TorchServe's inference key, from key_file.json, as a bearer token; a missing or wrong key is refused "
         "with TorchServe's 400",
    answers=(
        ServerAnswer(400, "TorchServe: a missing or wrong inference key", "TorchServeError"),
        ServerAnswer(413, "TorchServe: a body over max_request_size (config.properties), with an empty body"),
        ServerAnswer(500, "TorchServe: \"Worker died.\": the worker running the batch died; retry", "TorchServeError"),
        ServerAnswer(503, "TorchServe: the job queue is full; retry", "TorchServeError"),
        ServerAnswer(507, "TorchServe: the worker running the batch was killed; retry", "TorchServeError"),
    ),
    error_schemas={"TorchServeError": {
        "type": "object", "required": ["code", "type", "message"],
        "properties": {"code": {"type": "integer"}, "type": {"type": "string"}, "message": {"type": "string"}}}},
    note="OPTIONS is answered by TorchServe itself. TorchServe does not pass the HTTP method on: a request with "
         "neither a body nor a content type (what a GET sends) is taken for a GET, any other for a POST.",
)
