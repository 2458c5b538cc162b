"""Readiness check: exit 0 when every configured model answers a real embedding, else 1.

    python -m embedserve.scripts.probe [--config PATH] [--workdir DIR] [--timeout SECONDS]

`/ping` answers Healthy even while every worker crashes, so a pod is ready only when each model
in `models=` embeds one text into a finite, non-empty vector. The inference key is read from
`key_file.json` in the server's working directory when TorchServe wrote one (token
authorization on); without that file the request goes unauthenticated (authorization off).
The config defaults to $EMBEDSERVE_CONFIG, else ./config.properties.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from embedserve.scripts.serverctl import TorchServe


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
    problems = [p for p in (server.embedding_problem(m, args.timeout) for m in server.models) if p]
    for problem in problems:
        print(f"probe: {problem}", file=sys.stderr)
    if not problems:
        print(f"probe: {', '.join(server.models)} embed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
