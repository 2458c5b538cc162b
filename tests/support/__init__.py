"""What the test modules share and that is no test: tiny models made offline, in-process services,
real servers (TorchServe, redis-server) and clients for them, stand-ins, inputs.

tests/conftest.py turns some of these into the session's fixtures."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
