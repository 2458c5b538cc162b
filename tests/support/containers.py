"""The image (make image) run as deploy/k8s/deployment.yaml runs it, with podman (or docker), its
ports published on loopback only; Debian's nginx in front of replicas; a bounded load that
checks every answer. The engine and its flags are scripts/image/engine.sh's, so the tests run
the image as `make image` built it."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import requests
import yaml

from embedserve.scripts.serverctl import free_port
from tests.support import REPO

IMAGE = os.environ.get("IMAGE", "embedserve:0.1.0")
DEPLOYMENT = REPO / "deploy" / "k8s" / "deployment.yaml"
MODEL = "minilm"


def engine() -> list[str]:
    name = os.environ.get("EMBEDSERVE_ENGINE") or ("podman" if shutil.which("podman") else "docker")
    flags = os.environ.get("EMBEDSERVE_ENGINE_FLAGS")
    if flags is None:  # crun refuses hybrid cgroups on some hosts: runc and cgroupfs work everywhere
        flags = "--runtime runc --cgroup-manager=cgroupfs" if name == "podman" and shutil.which("runc") else ""
    return [name, *shlex.split(flags)]


# Lowered rlimits: some sandboxes refuse the engine's defaults ("setrlimit: operation not permitted").
RUN_FLAGS = shlex.split(os.environ.get("EMBEDSERVE_RUN_FLAGS", "--ulimit nofile=1024:1024 --ulimit nproc=1024:1024"))


def run_engine(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([*engine(), *args], capture_output=True, text=True, timeout=timeout, check=check)


def why_not_runnable() -> str | None:
    """Why the image cannot be tested here, or None."""
    if not shutil.which(engine()[0]):
        return f"{engine()[0]} is not installed (make test-image installs podman with apt)"
    if run_engine("image", "inspect", IMAGE, check=False, timeout=60).returncode != 0:
        return f"the image {IMAGE} is not built here: run make image"
    tried = run_engine("run", *RUN_FLAGS, "--rm", "--network=none", "--entrypoint", "true", IMAGE,
                       check=False, timeout=120)
    if tried.returncode != 0:
        return f"{engine()[0]} cannot run containers here: {(tried.stderr.strip().splitlines() or ['?'])[-1]}"
    return None


def pod_spec() -> dict:
    return yaml.safe_load(DEPLOYMENT.read_text())["spec"]["template"]["spec"]


def deployment_flags(spec: dict, volumes_root: Path) -> tuple[list[str], list[str]]:
    """The engine's run flags and the container's args for the Deployment's pod spec, its volumes
    made as folders under `volumes_root`. Only the fields this knows how to reproduce may be
    there: a new one fails here until it is taught."""
    (container,) = spec["containers"]
    pod_security, security = spec["securityContext"], container["securityContext"]
    assert pod_security["runAsNonRoot"] and pod_security["runAsUser"] != 0
    assert set(pod_security) <= {"runAsNonRoot", "runAsUser", "runAsGroup", "fsGroup", "seccompProfile"}
    assert pod_security["seccompProfile"] == {"type": "RuntimeDefault"}  # the engine's default profile
    flags = ["--user", f"{pod_security['runAsUser']}:{pod_security['runAsGroup']}",
             "--group-add", str(pod_security["fsGroup"])]
    assert set(security) <= {"allowPrivilegeEscalation", "readOnlyRootFilesystem", "capabilities"}
    assert security["capabilities"] == {"drop": ["ALL"]}  # nothing added
    flags += ["--cap-drop", "ALL"]
    if security["allowPrivilegeEscalation"] is False:
        flags += ["--security-opt", "no-new-privileges"]
    if security["readOnlyRootFilesystem"]:
        # Only the pod's volumes are writable: no tmpfs of the engine's own on /tmp or /run.
        flags += ["--read-only", "--read-only-tmpfs=false"] if engine()[0] == "podman" else ["--read-only"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    for mount in container["volumeMounts"]:
        volume = volumes[mount["name"]]
        assert set(volume) == {"name", "emptyDir"}, volume
        # An emptyDir: an empty folder on the node, per pod, that every user may write (mode
        # 0777). (The engine's tmpfs mounts here ignore their mode: root's 0755, unwritable.)
        folder = volumes_root / volume["name"]
        folder.mkdir(parents=True)
        folder.chmod(0o777)
        flags += ["--volume", f"{folder}:{mount['mountPath']}:rw"]
    limits = container["resources"]["limits"]
    flags += ["--cpus", str(limits["cpu"]), "--memory", limits["memory"].replace("Gi", "g").replace("Mi", "m")]
    for variable in container.get("env", []):
        flags += ["--env", f"{variable['name']}={variable['value']}"]
    return flags, list(container.get("args", []))


@dataclass
class Container:
    name: str
    ports: dict[int, int]  # container port -> loopback port on the host
    started: float = field(default_factory=time.monotonic)

    def url(self, port: int = 8080) -> str:
        return f"http://127.0.0.1:{self.ports[port]}"

    def exec(self, *command: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return run_engine("exec", self.name, *command, timeout=timeout, check=False)

    def running(self) -> bool:
        state = run_engine("inspect", "--format", "{{.State.Running}}", self.name, check=False, timeout=30)
        return state.stdout.strip() == "true"

    def exit_code(self) -> int:
        return int(run_engine("inspect", "--format", "{{.State.ExitCode}}", self.name, timeout=30).stdout)

    def logs(self) -> str:
        got = run_engine("logs", self.name, check=False, timeout=30)
        return (got.stdout + got.stderr)[-4000:]

    def wait_ready(self, timeout: float = 300) -> float:
        """Seconds from `run` until the Deployment's readiness probe passes, run as the kubelet does."""
        probe = pod_spec()["containers"][0]["readinessProbe"]["exec"]["command"]
        deadline = self.started + timeout
        while self.exec(*probe, timeout=60).returncode != 0:
            assert self.running(), f"{self.name} exited:\n{self.logs()}"
            assert time.monotonic() < deadline, f"{self.name} was not ready after {timeout:.0f} s:\n{self.logs()}"
            time.sleep(0.5)
        return time.monotonic() - self.started

    def remove(self) -> None:
        run_engine("rm", "--force", "--time", "0", self.name, check=False, timeout=60)


def start(name: str, root: Path, ports: tuple[int, ...] = (8080, 8082)) -> Container:
    """The image as the Deployment runs it, its volumes in `root`, each port in `ports` published
    on a free loopback port."""
    flags, args = deployment_flags(pod_spec(), root)
    published = {port: free_port() for port in ports}
    run_engine("rm", "--force", "--time", "0", name, check=False)  # a leftover of an interrupted run
    publish = [f"--publish=127.0.0.1:{host}:{port}" for port, host in published.items()]
    container = Container(name, published)
    run_engine("run", "--detach", "--name", name, *RUN_FLAGS, *flags, *publish, IMAGE, *args)
    return container


@dataclass
class Nginx:
    """Debian's nginx on a free loopback port, round robin over `upstreams` (host:port)."""
    root: Path
    upstreams: list[str]
    retry: bool = False  # the gateway setting docs/deployment.md recommends: retry POST elsewhere
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    def config(self) -> str:
        servers = "\n".join(f"    server {u} max_fails=1 fail_timeout=10s;" for u in self.upstreams)
        temp = " ".join(f"{kind}_temp_path {self.root}/{kind};" for kind in
                        ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        # Passive health checks (open-source nginx has no active ones): a replica that refuses a
        # connection or times out is left out for fail_timeout. POST is not idempotent to nginx:
        # once sent, a request is not retried elsewhere (proxy_next_upstream's default), so the
        # failures a killed replica causes reach the client, where they are counted; with
        # `retry`, nginx sends them to the other replica (an embedding is a pure function).
        retry = ("proxy_next_upstream error timeout http_502 http_503 http_504 non_idempotent;\n"
                 "      proxy_next_upstream_tries 3;") if self.retry else ""
        return f"""
pid {self.root}/nginx.pid;
error_log {self.root}/error.log warn;
worker_processes 1;
events {{ worker_connections 512; }}
http {{
  access_log off;
  {temp}
  upstream embedserve {{
{servers}
    keepalive 16;
  }}
  server {{
    listen 127.0.0.1:{self.port};
    location / {{
      proxy_pass http://embedserve;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_connect_timeout 2s;
      proxy_read_timeout 60s;
      add_header X-Upstream $upstream_addr always;
      {retry}
    }}
  }}
}}
"""

    def __enter__(self) -> "Nginx":
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "nginx.conf").write_text(self.config())
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        self.process = subprocess.Popen([nginx, "-p", str(self.root), "-c", str(self.root / "nginx.conf"),
                                         "-e", str(self.root / "error.log"), "-g", "daemon off;"])
        deadline = time.monotonic() + 30
        while True:
            try:
                requests.get(f"http://127.0.0.1:{self.port}/ping", timeout=5)
                return self
            except requests.ConnectionError:
                assert self.process.poll() is None, (self.root / "error.log").read_text()
                assert time.monotonic() < deadline, "nginx did not listen"
                time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


@dataclass
class Outcome:
    start: float
    end: float
    kind: str  # "ok", "wrong", "status <n>" or the connection error's class
    upstream: str = ""


class Load:
    """`clients` threads, each sending one request after another (a bounded, closed-loop load)
    of TEXTS[i] and checking the answer against `expected` (cosine >= 0.9999: a wrong vector is
    a failure of its own kind, never confused with an error status)."""

    def __init__(self, url: str, texts: list[str], expected: np.ndarray, clients: int = 4, copies: int = 1):
        self.url, self.texts, self.expected, self.clients = url, texts, expected, clients
        self.copies = copies  # inputs per request: the text repeated, for requests that take a while
        self.outcomes: list[Outcome] = []
        self.in_flight: dict[int, float] = {}
        self.sending = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> "Load":
        self.sending.set()
        for thread in self.threads:
            thread.start()
        return self

    def stop_sending(self) -> int:
        """No new requests from now on (a Service that dropped the endpoint); the in-flight count."""
        with self.lock:
            self.sending.clear()
            return len(self.in_flight)

    def __exit__(self, *exc) -> None:
        self.sending.clear()
        for thread in self.threads:
            thread.join(timeout=120)

    def _client(self, index: int) -> None:
        session = requests.Session()
        n = index
        while True:
            with self.lock:
                if not self.sending.is_set():
                    return
                start = time.monotonic()
                self.in_flight[index] = start
            i = n % len(self.texts)
            n += 1
            kind, upstream = "ok", ""
            try:
                response = session.post(f"{self.url}/predictions/{MODEL}", json={"input": [self.texts[i]] * self.copies},
                                        timeout=90)
                upstream = response.headers.get("X-Upstream", "")
                if response.status_code != 200:
                    kind = f"status {response.status_code}"
                else:
                    data = response.json()["data"]
                    vectors = [np.array(d["embedding"]) for d in data]
                    if len(vectors) != self.copies or min(cosine(v, self.expected[i]) for v in vectors) < 0.9999:
                        kind = "wrong"
            except requests.RequestException as err:
                kind = type(err).__name__
                session = requests.Session()  # a broken connection is not reused
            with self.lock:
                del self.in_flight[index]
                self.outcomes.append(Outcome(start, time.monotonic(), kind, upstream))


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))
