"""The Locust load test: every route loaded without a failure, a wrong key counted as failures,
and hosts off loopback refused.

Locust runs under gevent, which patches the standard library, so it only ever runs in a
subprocess here, never imported into the test process."""

import csv
import json
import subprocess
import sys

import pytest

from embedserve.scripts import loadtest
from tests.support import REPO

ROUTES = ("native", "openai", "tei")


def run_locust(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "locust", "-f", str(loadtest.LOCUSTFILE), "--headless", "--only-summary", *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)


def stats_by_name(stats_csv) -> dict[str, dict]:
    with open(stats_csv) as f:
        return {row["Name"]: row for row in csv.DictReader(f)}


def route_rows(rows: dict[str, dict], route: str) -> list[dict]:
    return [row for name, row in rows.items() if name.startswith(f"{route} ")]


@pytest.mark.parametrize("host", ["http://example.com:8080", "http://0.0.0.0:8080", "http://localhost.example.com"])
def test_the_locustfile_refuses_hosts_off_loopback(host, tmp_path):
    result = run_locust("--host", host, "--run-time", "5s", "--key-file", str(tmp_path / "none.json"))
    assert result.returncode == 2
    assert "loopback only" in result.stderr
    assert "users spawned" not in result.stderr


def test_loadtest_bounds_its_arguments(tmp_path, capsys):
    config = ["--config", str(REPO / "config.properties")]
    assert loadtest.parse_args(config).users == 16
    for bad in (["--users", "0"], ["--run-time", "0"], ["--run-time", "100000"], ["--spawn-rate", "0"],
                ["--config", str(tmp_path / "missing.properties")]):
        with pytest.raises(SystemExit):
            loadtest.parse_args(config + bad)
    assert "no server configuration" in capsys.readouterr().err


@pytest.mark.integration
def test_every_route_under_load_without_a_failure(server, tiny_model_dir, tmp_path, capsys):
    code = loadtest.main(["--config", str(server.config), "--workdir", str(server.workdir), "--model", "tiny",
                          "--users", "8", "--spawn-rate", "8", "--run-time", "10",
                          "--tokenizer", str(tiny_model_dir / "tokenizer.json"), "--out", str(tmp_path)])
    summary = capsys.readouterr().out
    assert code == 0, summary + (tmp_path / "loadtest.log").read_text()
    rows = stats_by_name(tmp_path / "loadtest_stats.csv")
    for route in ROUTES:
        assert sum(int(row["Request Count"]) for row in route_rows(rows, route)) > 0, route
    assert {name: row["Failure Count"] for name, row in rows.items()} == {name: "0" for name in rows}
    assert int(rows["info"]["Request Count"]) == 8  # one per user
    assert "native 1 text" in summary and "Aggregated" in summary
    assert (tmp_path / "loadtest.html").stat().st_size > 0
    assert server.pid() is not None  # it was already answering, so the load test left it running


@pytest.mark.integration
def test_a_wrong_key_fails_every_request(server, tiny_model_dir, tmp_path):
    key_file = tmp_path / "key_file.json"
    key_file.write_text(json.dumps({"inference": {"key": "wrong"}}))
    result = run_locust("--host", server.url("inference"), "--users", "2", "--spawn-rate", "2", "--run-time", "3s",
                        "--model", "tiny", "--key-file", str(key_file),
                        "--tokenizer", str(tiny_model_dir / "tokenizer.json"), "--csv", str(tmp_path / "lt"))
    assert result.returncode == 1, result.stderr
    rows = stats_by_name(tmp_path / "lt_stats.csv")
    for route in ROUTES:
        assert sum(int(row["Request Count"]) for row in route_rows(rows, route)) > 0, route
    assert all(row["Failure Count"] == row["Request Count"] for row in rows.values())
    assert "Token Authorization failed" in (tmp_path / "lt_failures.csv").read_text()
