"""A real Ray cluster of two nodes on this machine, on loopback: a head (`ray start --head`) and a
second node (`ray start --address ...`), each its own raylet, object store and workers, as two
machines would run them, with token authentication on (Ray's default for a new cluster) from a
token of its own; stopped with `ray stop`. The head notices a lost node within seconds
instead of the default half minute, so a test that kills one waits less."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

from embedserve.scripts.serverctl import free_port

RAY = Path(sys.executable).parent / "ray"
OBJECT_STORE_BYTES = 300 * 2**20  # per node: the tests' blocks are small, and the CI machine's memory is shared
QUICK_HEALTH_CHECKS = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
                       "RAY_health_check_failure_threshold": "3"}


class RayCluster:
    def __init__(self, cpus_per_node: int = 2):
        self.cpus_per_node = cpus_per_node
        # Short: Ray's Unix sockets live under it, and a socket path holds at most 107 bytes.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
        self.port = free_port()
        self.second_node_port = free_port()
        token = self.temp_dir / "auth_token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        # What each node and each driver (the job) needs to join the cluster.
        self.env = {"RAY_ADDRESS": self.address, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "RayCluster":
        head = ["--head", "--port", str(self.port), "--include-dashboard", "false", "--temp-dir", str(self.temp_dir)]
        second = ["--address", self.address, "--node-manager-port", str(self.second_node_port)]
        for args in (head, second):
            self._ray("start", *args, "--node-ip-address", "127.0.0.1", "--num-cpus", str(self.cpus_per_node),
                      "--object-store-memory", str(OBJECT_STORE_BYTES), "--disable-usage-stats",
                      "--dashboard-agent-listen-port", str(free_port()), "--dashboard-agent-grpc-port",
                      str(free_port()), "--metrics-export-port", str(free_port()))
        return self

    def stop(self) -> None:
        self._ray("stop", "--force", check=False)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def second_node_raylet(self) -> psutil.Process:
        """The second node's raylet: killing it takes the node down, its workers with it."""
        mark = f"--node_manager_port={self.second_node_port}"
        for process in psutil.process_iter(["name", "cmdline"]):
            if process.info["name"] == "raylet" and mark in (process.info["cmdline"] or []):
                return process
        raise LookupError("the second node's raylet is not running")

    def actor_processes(self, name: str) -> list[psutil.Process]:
        """The worker processes of actors whose title holds `name` (Ray titles them `ray::<actor>`)."""
        found = []
        for process in psutil.process_iter(["cmdline"]):
            cmdline = process.info["cmdline"] or []
            if cmdline and cmdline[0].startswith("ray::") and name in cmdline[0]:
                found.append(process)
        return found

    def logs(self) -> str:
        """Every worker's log of the cluster's session, joined: those still there when read (Ray
        removes a lost node's worker logs, which a read after the listing would not find)."""
        texts = []
        for path in sorted((self.temp_dir / "session_latest" / "logs").glob("worker-*")):
            try:
                texts.append(path.read_text(errors="replace"))
            except FileNotFoundError:
                continue
        return "\n".join(texts)

    def _ray(self, *args: str, check: bool = True) -> None:
        env = {**os.environ, **QUICK_HEALTH_CHECKS, **self.env}
        if "--head" in args:
            del env["RAY_ADDRESS"]  # the head starts the cluster at that address
        done = subprocess.run([str(RAY), *args], env=env, capture_output=True, text=True, timeout=120)
        if check and done.returncode != 0:
            raise RuntimeError(f"ray {' '.join(args)} failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
