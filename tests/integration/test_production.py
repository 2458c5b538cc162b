"""The production profile of docs/production.md, started as written (with this test's ports and a
self-signed certificate): HTTPS embeds, plain HTTP does not, and the guards stay on."""

import re
import stat
import subprocess

import pytest
import requests

from embedserve.scripts.serverctl import free_port
from tests.support import REPO
from tests.support.serving import serving

pytestmark = pytest.mark.integration


def documented_profile() -> dict[str, str]:
    text = (REPO / "docs" / "production.md").read_text()
    [block] = re.findall(r"```properties\n(.*?)```", text, re.S)
    return dict(line.split("=", 1) for line in block.splitlines() if line and not line.startswith("#"))


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("production")
    key, cert = root / "key.pem", root / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    profile = documented_profile()
    profile.update(inference_address=f"https://127.0.0.1:{free_port()}",
                   management_address=f"https://127.0.0.1:{free_port()}",
                   metrics_address=f"http://127.0.0.1:{free_port()}",
                   private_key_file=str(key), certificate_file=str(cert))
    tiny = ["--model", str(tiny_model_dir), "--name", "tiny", "--workers", "1"]
    # REQUESTS_CA_BUNDLE: how serverctl's readiness check, a real embedding over HTTPS, trusts it.
    with serving(root, tiny, env={"REQUESTS_CA_BUNDLE": str(cert)}, **profile) as ts:
        yield ts, cert


def test_the_documented_profile_is_the_locked_down_one():
    profile = documented_profile()
    assert profile["inference_address"].startswith("https://")
    assert profile["management_address"].startswith("https://")
    assert profile["enable_model_api"] == "false" and profile["allowed_urls"] == "file://.*"
    assert {"private_key_file", "certificate_file", "token_expiration_min", "max_request_size"} <= set(profile)


def test_https_embeds_and_plain_http_does_not(tls_server):
    ts, cert = tls_server
    url = f"{ts.url('inference')}/predictions/tiny"
    response = requests.post(url, json={"input": ["over TLS"]}, headers=ts.auth(), verify=str(cert), timeout=30)
    assert response.status_code == 200 and len(response.json()["data"]) == 1
    with pytest.raises(requests.exceptions.SSLError):  # a client that does not trust the certificate
        requests.post(url, json={"input": "x"}, headers=ts.auth(), timeout=30)
    plain = requests.post(url.replace("https://", "http://"), json={"input": "x"}, headers=ts.auth(), timeout=30)
    assert plain.status_code == 403 and "only accepts HTTPS" in plain.text
    refused = requests.post(url, json={"input": "x"}, verify=str(cert), timeout=30)
    assert refused.status_code in (400, 401)  # no key


def test_registration_is_refused_and_keys_are_private(tls_server):
    ts, cert = tls_server
    response = requests.post(f"{ts.url('management')}/models?url=https://example.com/m.mar",
                             headers=ts.auth("management"), verify=str(cert), timeout=30)
    assert response.status_code == 405
    mode = stat.S_IMODE((ts.workdir / "key_file.json").stat().st_mode)
    assert mode & 0o077 == 0, oct(mode)
