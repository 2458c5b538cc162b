"""Readiness check: exit 0 when every configured model answers a real embedding, else 1.

    python -m scripts.probe [--config PATH] [--workdir DIR] [--timeout SECONDS]

`/ping` answers Healthy even while every worker crashes, so a pod is ready only when each model
in `models=` embeds one text into a finite, non-empty vector. The inference key is read from
`key_file.json` in the server's working directory when TorchServe wrote one (token
authorization on); without that file the request goes unauthenticated (authorization off).
The config defaults to $EMBEDSERVE_CONFIG, else ./config.properties.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import requests

from scripts.serverctl import TorchServe

PROBE_TEXT = "readiness probe"
WILDCARD_HOSTS = {"0.0.0.0", "::", "[::]"}


def inference_url(server: TorchServe) -> str:
    """The inference address as a client inside the same host or container reaches it."""
    parts = urlsplit(server.url("inference"))
    if parts.hostname in WILDCARD_HOSTS:  # a wildcard bind is reached through loopback
        parts = parts._replace(netloc=f"127.0.0.1:{parts.port}")
    return urlunsplit(parts)


def auth_headers(server: TorchServe) -> dict[str, str]:
    if not (server.workdir / "key_file.json").is_file():
        return {}
    return server.auth("inference")


def check_model(server: TorchServe, model: str, timeout: float) -> str | None:
    """None when `model` returns one finite, non-empty embedding; otherwise why not."""
    try:
        response = requests.post(f"{inference_url(server)}/predictions/{model}",
                                 json={"input": [PROBE_TEXT]}, headers=auth_headers(server), timeout=timeout)
    except requests.RequestException as err:
        return f"model {model}: no answer ({type(err).__name__})"
    if response.status_code != 200:
        return f"model {model}: HTTP {response.status_code}: {response.text[:200]}"
    try:
        vector = response.json()["data"][0]["embedding"]
        finite = len(vector) > 0 and all(math.isfinite(float(x)) for x in vector)
    except (ValueError, KeyError, IndexError, TypeError):
        return f"model {model}: the answer is not an embedding: {response.text[:200]}"
    return None if finite else f"model {model}: empty or non-finite embedding"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path,
                        default=Path(os.environ.get("EMBEDSERVE_CONFIG", "config.properties")))
    parser.add_argument("--workdir", type=Path, default=Path("."), help="where TorchServe writes key_file.json")
    parser.add_argument("--timeout", type=float, default=8.0, help="seconds per request")
    args = parser.parse_args(argv)
    try:
        server = TorchServe(args.config, args.workdir)
    except (OSError, ValueError, KeyError) as err:
        print(f"probe: cannot read {args.config}: {err}", file=sys.stderr)
        return 1
    if not server.models:
        print(f"probe: {args.config} configures no models", file=sys.stderr)
        return 1
    try:
        problems = [p for p in (check_model(server, m, args.timeout) for m in server.models) if p]
    except (OSError, ValueError, KeyError) as err:  # an unreadable or half-written key file
        problems = [f"cannot read the inference key: {err}"]
    for problem in problems:
        print(f"probe: {problem}", file=sys.stderr)
    if not problems:
        print(f"probe: {', '.join(server.models)} embed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
