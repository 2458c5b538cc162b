"""Start TorchServe, wait until it really embeds, and stop it.

    python -m embedserve.scripts.serverctl start [--config config.properties] [--timeout 600]
    python -m embedserve.scripts.serverctl stop  [--config config.properties]

`/ping` answers Healthy even while every worker crashes in `initialize`, and `torchserve
--start` exits 0 at once whatever happens, so readiness here means a real embedding request
answered 200 for every model in `models=`. A worker that keeps dying, or a frontend that
exits, ends the wait early with the log lines that say why.

Stopping drains first: `torchserve --stop` closes every connection at once, so requests queued
or in a batch would get no answer. Until no request is queued (the management API's
pendingRequests) and no worker runs a batch (embedserve/handler/worker/busy.py), for at most DRAIN_S, the server
keeps answering; then it stops.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import requests

from embedserve.archive.ts_config import read_properties, update_properties
from embedserve.handler.worker.busy import any_busy

WORKER_DEATHS_BEFORE_GIVING_UP = 3
# How long a stop waits for accepted requests to be answered: well past a batch of the default
# model, short enough for a pod's termination grace period (30 s by default on Kubernetes).
DRAIN_S = 25.0
DRAIN_POLL_S = 0.25
READINESS_TEXT = "readiness check"
WILDCARD_HOSTS = {"0.0.0.0", "::", "[::]"}
GRPC_DEFAULT_PORTS = {"inference": 7070, "management": 7071}  # TorchServe's, when not configured
# The frontend's logging: TorchServe's files without its lines for every request and batch
# (the file says what it leaves out and what that saves).
LOG_CONFIG = Path(__file__).with_name("log4j2.xml")
LOG_CONFIG_VMARG = "-Dlog4j.configurationFile="


class ServerError(RuntimeError):
    pass


@dataclass
class TorchServe:
    config: Path
    workdir: Path  # holds key_file.json, logs/ and the pid file; one folder per server
    log_config: Path | None = LOG_CONFIG  # None: TorchServe's own

    def __post_init__(self) -> None:
        self.config = self.config.resolve()
        self.workdir = self.workdir.resolve()
        self.properties = read_properties(self.config)
        self.models = json.loads(self.properties.get("models") or "{}")

    @property
    def logs(self) -> Path:
        return self.workdir / "logs"

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        # TMPDIR holds the pid file and TEMP the worker sockets: per server, so that two
        # servers on one machine never share either.
        tmp = self.workdir / ".run"
        env.update(TMPDIR=str(tmp), TEMP=str(tmp), LOG_LOCATION=str(self.logs), METRICS_LOCATION=str(self.logs))
        return env

    def url(self, api: str) -> str:
        return self.properties[f"{api}_address"].rstrip("/")

    def listeners(self) -> dict[str, tuple[str, int]]:
        """Every address the server binds: the three REST APIs and TorchServe's two gRPC APIs."""
        found = {}
        for api in ("inference", "management", "metrics"):
            parts = urlsplit(self.url(api))
            found[api] = (parts.hostname, parts.port)
        for api, default_port in GRPC_DEFAULT_PORTS.items():
            found[f"grpc_{api}"] = (self.properties.get(f"grpc_{api}_address", "127.0.0.1"),
                                    int(self.properties.get(f"grpc_{api}_port", default_port)))
        return found

    def keys(self) -> dict[str, str]:
        data = json.loads((self.workdir / "key_file.json").read_text())
        return {"inference": data["inference"]["key"], "management": data["management"]["key"]}

    def auth(self, api: str = "inference") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys()[api]}"}

    def auth_if_on(self, api: str = "inference") -> dict[str, str]:
        """The key's header where TorchServe wrote a key file (token authorization on), else none."""
        return self.auth(api) if (self.workdir / "key_file.json").is_file() else {}

    def start(self) -> None:
        if self.pid() is not None:
            raise ServerError(f"a server is already running from {self.workdir} (pid {self.pid()}); stop it first")
        for name, (host, port) in self.listeners().items():
            _require_free_port(name, host, port)
        (self.workdir / ".run").mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        (self.workdir / "key_file.json").unlink(missing_ok=True)
        model_store = Path(self.properties.get("model_store", "model_store"))
        if not model_store.is_absolute():
            model_store = self.config.parent / model_store
        command = [_torchserve(), "--start", "--ncs", "--ts-config", str(self.config), "--model-store", str(model_store),
                   *self.log_config_arguments()]
        # The JVM keeps its stdout open: write it to a file, never to a pipe.
        with (self.logs / "torchserve.out").open("ab") as out:
            subprocess.run(command, cwd=self.workdir, env=self.env, stdout=out, stderr=subprocess.STDOUT, check=True)

    def log_config_arguments(self) -> list[str]:
        """The project's log configuration, unless config.properties' `vmargs` names one of its own
        (TorchServe's `--log-config` would replace it)."""
        if self.log_config is None or named_log_config(self.properties) is not None:
            return []
        return ["--log-config", str(self.log_config)]

    def pid(self) -> int | None:
        pid_file = self.workdir / ".run" / ".model_server.pid"
        try:
            pid = int(pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if _alive(pid) else None

    def wait_ready(self, timeout: float = 600.0, progress: bool = False) -> None:
        """Return once every configured model answers a real embedding request."""
        deadline = time.monotonic() + timeout
        pending = {name: default_version(versions) for name, versions in self.models.items()}
        time.sleep(1.0)  # the launcher writes the pid file a moment after it returns
        while pending:
            if self.pid() is None:
                raise ServerError(f"TorchServe exited during start-up:\n{self._log_tail('torchserve.out')}")
            deaths = self._count_in_log("ts_log.log", "Backend worker process died")
            if deaths >= WORKER_DEATHS_BEFORE_GIVING_UP:
                raise ServerError(
                    f"model workers died {deaths} times during start-up; the model cannot load:\n"
                    f"{self._log_tail('model_log.log', only_errors=True)}"
                )
            for name in list(pending):
                if self.embeds(name):
                    pending.pop(name)
                    if progress:
                        print(f"model {name} is ready", file=sys.stderr)
            if pending and time.monotonic() > deadline:
                raise ServerError(f"models {sorted(pending)} not ready after {timeout:.0f} s; see {self.logs}")
            if pending:
                time.sleep(1.0)

    def client_url(self, api: str) -> str:
        """The API's address as a client on the same host reaches it: a wildcard bind (the
        container's configuration) through loopback."""
        parts = urlsplit(self.url(api))
        if parts.hostname in WILDCARD_HOSTS:
            parts = parts._replace(netloc=f"127.0.0.1:{parts.port}")
        return urlunsplit(parts)

    def embedding_problem(self, model: str, timeout: float = 30.0) -> str | None:
        """None when `model` answers one finite, non-empty embedding (a reranker or classifier:
        finite scores); otherwise why not. The inference key is sent when TorchServe wrote a key
        file (token authorization on)."""
        try:
            headers = self.auth_if_on()
            response = requests.post(f"{self.client_url('inference')}/predictions/{model}",
                                     json={"input": [READINESS_TEXT]}, headers=headers, timeout=timeout)
        except requests.RequestException as err:
            return f"model {model}: no answer ({type(err).__name__})"
        except (OSError, ValueError, KeyError) as err:  # an unreadable or half-written key file
            return f"cannot read the inference key: {err}"
        if response.status_code == 404 and "'predict'" in response.text:  # a reranker or classifier: it scores
            return self._scoring_problem(model, headers, timeout)
        if response.status_code != 200:
            return f"model {model}: HTTP {response.status_code}: {response.text[:200]}"
        try:
            data = response.json()["data"]
            vector = data[0]["embedding"]
            if isinstance(vector, dict):  # a sparse model's {"indices", "values"}
                vector = vector["values"]
            elif vector and isinstance(vector[0], list):  # a multi-vector model's token vectors
                vector = [x for row in vector for x in row]
            real = len(data) == 1 and len(vector) > 0 and all(math.isfinite(float(x)) for x in vector)
        except (ValueError, KeyError, IndexError, TypeError):
            return f"model {model}: the answer is not an embedding: {response.text[:200]}"
        return None if real else f"model {model}: empty or non-finite embedding"

    def _scoring_problem(self, model: str, headers: dict[str, str], timeout: float) -> str | None:
        """None when a scoring model answers finite scores for one pair on /predict (every scorer
        takes a pair; a causal reranker takes nothing else)."""
        version = default_version(self.models[model])
        try:
            response = requests.post(f"{self.client_url('inference')}/predictions/{model}/{version}/predict",
                                     json={"inputs": [READINESS_TEXT, READINESS_TEXT]}, headers=headers,
                                     timeout=timeout)
            scores = [float(item["score"]) for item in response.json()] if response.status_code == 200 else []
        except requests.RequestException as err:
            return f"model {model}: no answer ({type(err).__name__})"
        except (ValueError, KeyError, TypeError):
            return f"model {model}: the answer is not a list of scores: {response.text[:200]}"
        if response.status_code != 200:
            return f"model {model}: HTTP {response.status_code}: {response.text[:200]}"
        return None if scores and all(math.isfinite(x) for x in scores) else f"model {model}: no finite score"

    def embeds(self, model: str) -> bool:
        return self.embedding_problem(model) is None

    @contextmanager
    def running(self, timeout: float = 600.0) -> Iterator["TorchServe"]:
        """Start, wait until every model embeds, and always stop afterwards."""
        self.start()
        try:
            self.wait_ready(timeout=timeout)
            yield self
        finally:
            self.stop()

    def stop(self, timeout: float = 60.0, drain_s: float = DRAIN_S) -> None:
        """Answer what was accepted, then stop: wait up to `drain_s` until no request is queued
        and no batch runs (TorchServe's own stop closes the connections of requests in flight,
        unanswered), then stop the server and wait for it to exit."""
        pid = self.pid()
        if pid is None:
            return
        if drain_s > 0 and not self.drain(drain_s):
            print(f"serverctl: requests still in flight after {drain_s:.0f} s; stopping anyway (their clients "
                  "see the connection close)", file=sys.stderr)
        subprocess.run([_torchserve(), "--stop"], cwd=self.workdir, env=self.env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        # `--stop` removes the pid file at once; wait for the process itself to exit.
        while _alive(pid):
            if time.monotonic() > deadline:
                raise ServerError(f"TorchServe (pid {pid}) did not stop within {timeout:.0f} s")
            time.sleep(0.2)

    def drain(self, seconds: float) -> bool:
        """Wait until no request is queued and no batch runs, seen twice in a row; False on timeout."""
        deadline = time.monotonic() + seconds
        quiet = 0
        while quiet < 2:
            if time.monotonic() > deadline:
                return False
            quiet = quiet + 1 if self.pending_requests() == 0 and not any_busy(self.workdir / ".run") else 0
            time.sleep(DRAIN_POLL_S)
        return True

    def pending_requests(self) -> int:
        """Requests queued for any model and not yet in a batch, that a READY worker will take
        (0 when the API cannot say). A model with no READY worker (one that cannot load, dying at
        each start) answers none of its queue however long a drain waits for it."""
        pending = 0
        for name in self.models:
            try:
                described = requests.get(f"{self.url('management')}/models/{name}",
                                         headers=self.auth_if_on("management"), timeout=10).json()
            except (requests.RequestException, OSError, ValueError, KeyError):
                return 0
            pending += sum(int((entry.get("jobQueueStatus") or {}).get("pendingRequests", 0)) for entry in described
                           if isinstance(entry, dict) and _has_a_ready_worker(entry))
        return pending

    def _count_in_log(self, name: str, needle: str) -> int:
        path = self.logs / name
        return path.read_text(errors="replace").count(needle) if path.is_file() else 0

    def _log_tail(self, name: str, lines: int = 25, only_errors: bool = False) -> str:
        path = self.logs / name
        if not path.is_file():
            return f"({path} is missing)"
        text = path.read_text(errors="replace").splitlines()
        if only_errors:
            text = [line for line in text if "Error" in line or "error" in line or "Traceback" in line] or text
        return "\n".join(text[-lines:])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A child that exited but was not yet reaped is a zombie: gone for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def default_version(versions: dict) -> str:
    return next((v for v, entry in versions.items() if entry.get("defaultVersion")), next(iter(versions)))


def _torchserve() -> str:
    local = Path(sys.executable).parent / "torchserve"
    found = str(local) if local.exists() else shutil.which("torchserve")
    if not found:
        raise ServerError("torchserve is not installed in this environment; run `make serve` or `pip install -e .`")
    return found


def _require_free_port(name: str, host: str, port: int) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            raise ServerError(f"{name} address {host}:{port} is already in use; stop what listens there "
                              "or change config.properties") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _has_a_ready_worker(described: dict) -> bool:
    return any(isinstance(worker, dict) and worker.get("status") == "READY" for worker in described.get("workers") or [])


def named_log_config(properties: dict[str, str]) -> str | None:
    """The log configuration config.properties' `vmargs` names, if any."""
    return next((arg.removeprefix(LOG_CONFIG_VMARG) for arg in properties.get("vmargs", "").split()
                 if arg.startswith(LOG_CONFIG_VMARG)), None)


def isolated_config(root: Path, base: Path, name: str = "config.properties", **properties: str) -> Path:
    """A copy of `base` in `root` on free loopback ports with its own model store and no models,
    for a server that shares nothing with another one on this machine (tests, benchmarks)."""
    config = root / name
    config.write_text(base.read_text())
    update_properties(config, {
        "inference_address": f"http://127.0.0.1:{free_port()}",
        "management_address": f"http://127.0.0.1:{free_port()}",
        "metrics_address": f"http://127.0.0.1:{free_port()}",
        "grpc_inference_port": str(free_port()),
        "grpc_management_port": str(free_port()),
        "model_store": str(root / "model_store"),
        "models": "{}",
        "load_models": "",
        **properties,
    })
    return config


def usage_text(server: TorchServe) -> str:
    name = next(iter(server.models))
    version = default_version(server.models[name])
    key = server.keys()["inference"]
    base = server.url("inference")
    return f"""
TorchServe is up; model '{name}' answers real embeddings.

  curl -s {base}/predictions/{name} \\
    -H 'Authorization: Bearer {key}' \\
    -H 'Content-Type: application/json' \\
    -d '{{"input": ["The quick brown fox", "Embeddings in one call"]}}'

  # with the OpenAI client (pip install openai):
  python - <<'EOF'
from openai import OpenAI
client = OpenAI(base_url="{base}/predictions/{name}/{version}/v1", api_key="{key}")
print(client.embeddings.create(model="{name}", input=["hello world"]).data[0].embedding[:4])
EOF

Keys: {server.workdir / 'key_file.json'} (they expire after 60 minutes; see docs/operations.md, Keys). Logs: {server.logs}. Stop: make stop
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="serverctl", description="start or stop TorchServe")
    parser.add_argument("action", choices=("start", "stop"))
    parser.add_argument("--config", type=Path, default=Path("config.properties"))
    parser.add_argument("--workdir", type=Path, default=Path("."))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for readiness")
    args = parser.parse_args(argv)
    server = TorchServe(args.config, args.workdir)
    try:
        if args.action == "stop":
            if server.pid() is None:
                print(f"serverctl: no TorchServe of {args.workdir.resolve()} is running; nothing to stop")
                return 0
            server.stop()
            print("TorchServe stopped")
            return 0
        if not server.models:
            raise ServerError(f"{args.config} configures no models; run ./build_mar.sh first")
        server.start()
        print("TorchServe started; waiting until the model really embeds ...", file=sys.stderr)
        try:
            server.wait_ready(args.timeout, progress=True)
        except ServerError:
            server.stop()
            raise
        print(usage_text(server))
        return 0
    except ServerError as err:
        print(f"serverctl: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
