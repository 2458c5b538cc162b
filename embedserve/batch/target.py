"""Which server, model and key a job uses where the command line does not say: those of the
server `make serve` runs from the working directory.

    --url             ./config.properties' inference_address, else http://127.0.0.1:8080
    --management-url  ./config.properties' management_address (only with the default --url: the
                      same server), else none; used to find the model and size the concurrency
    --model           the one model the batch file's lines name in body.model, else the only
                      model the management API lists
    --key             $EMBEDSERVE_KEY or $KEY, else ./key_file.json (read again when refused)
"""

from __future__ import annotations

import json
from pathlib import Path

from embedserve.archive.ts_config import read_properties
from embedserve.batch.server import JobError

DEFAULT_URLS = {"inference": "http://127.0.0.1:8080", "management": "http://127.0.0.1:8081"}
CONFIG = Path("config.properties")
KEY_FILE = Path("key_file.json")


def default_url(api: str, config: Path = CONFIG) -> str:
    """The `api` address the working directory's config.properties gives TorchServe, as a client
    reaches it (a server listening on every interface is reached on loopback)."""
    address = read_properties(config).get(f"{api}_address") if config.is_file() else None
    return (address or DEFAULT_URLS[api]).rstrip("/").replace("://0.0.0.0", "://127.0.0.1", 1)


def default_key_file(given: Path | None, key_known: bool) -> Path | None:
    """--key-file, else ./key_file.json where no key was given or exported and the file is there."""
    if given is not None or key_known:
        return given
    return KEY_FILE if KEY_FILE.is_file() else None


class Management:
    """TorchServe's management API, read with the management key of the key file (if any)."""

    def __init__(self, url: str, key_file: Path | None):
        self.url, self.key_file = url.rstrip("/"), key_file

    def get(self, path: str):
        """The answer's JSON; raises OSError or ValueError (requests' errors are both) when none."""
        import requests

        headers = {}
        if self.key_file:
            try:
                headers = {"Authorization": f"Bearer {json.loads(self.key_file.read_text())['management']['key']}"}
            except (OSError, ValueError, KeyError, TypeError):
                pass
        response = requests.get(f"{self.url}/{path.lstrip('/')}", headers=headers, timeout=30)
        response.raise_for_status()
        return response.json()

    def models(self) -> list[str]:
        return [str(entry["modelName"]) for entry in self.get("models?limit=1000")["models"]]


def choose_model(named: set[str], management: Management | None) -> tuple[str, str | None]:
    """(the model a job without --model sends to, a note for stderr or None).

    `named`: the models the batch file's lines name in body.model. The server answers a request by
    the model of its URL and ignores body.model (as a one-model OpenAI endpoint does), so a name
    the server does not have is sent to its only model, said on stderr; with several, the job stops."""
    if len(named) > 1:
        raise JobError(f"the batch file's lines name {len(named)} models in body.model ({', '.join(sorted(named))}); "
                       "a job sends to one model: give --model, or split the file")
    registered, why = None, "no --management-url to list them"
    if management is not None:
        try:
            registered = management.models()
        except (OSError, ValueError, KeyError, TypeError) as err:
            why = f"the management API at {management.url} could not list them ({err})"
    if named and (registered is None or named <= set(registered)):
        return next(iter(named)), None
    if registered is None:
        raise JobError(f"no --model, and the input names none (body.model) while {why}: give --model")
    if len(registered) != 1:
        listed = ", ".join(registered) or "none"
        raise JobError(f"no --model, {'body.model ' + repr(next(iter(named))) + ' is not one of' if named else 'and'} "
                       f"the {len(registered)} models registered at {management.url} ({listed}): give --model")
    note = (f"body.model {next(iter(named))!r} is not a model of this server; sending to its only model "
            f"{registered[0]!r}") if named else None
    return registered[0], note
