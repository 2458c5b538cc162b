"""The build's bfloat16 check: each CPU bf16 engine against float32 on the build's corpus, the
engines within the bar listed in the archive, a forced bfloat16 build refused below it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
import zipfile
from safetensors.torch import load_file, save_file

from embedserve.archive.bf16_check import BF16_MIN_COSINE, Bf16Refused, check_bf16, require_bf16
from embedserve.archive.default_model import fetch_default_model
from embedserve.archive.onnx_export import export_onnx
from embedserve.handler.backends.openvino_runtime import openvino_available
from tests.support.model_families import NORMALIZE_MODULE, _layer_norm, _pooling, _st_files
from tests.unit.archive.test_build import run_build


def test_minilm_in_bf16_stays_within_the_bar_on_every_engine(tmp_path):
    model_dir = tmp_path / "minilm"
    shutil.copytree(fetch_default_model(), model_dir)
    assert export_onnx(model_dir, 512).startswith("exported")
    engines = ["torch"] + (["openvino"] if openvino_available() else [])
    cosines, lines = check_bf16(model_dir, {}, engines)
    assert len(lines) == len(engines)
    assert cosines["torch"] >= BF16_MIN_COSINE, lines
    # OpenVINO computes bf16 only where the CPU has bf16 units; elsewhere the check says so.
    if "openvino" in cosines:
        assert cosines["openvino"] >= BF16_MIN_COSINE, lines
    elif openvino_available():
        assert "not verified" in lines[1]


@pytest.fixture(scope="module")
def fragile_model(tmp_path_factory, tiny_model_dir) -> Path:
    """A model bfloat16 cannot carry: its last layer's states ride on an offset of 1000, which a
    LayerNorm after pooling (float32, in every engine) takes off again. bfloat16 keeps 8 bits of
    a state near 1000 (steps of 4 or 8): what remains of the signal once the offset is gone is
    its rounding."""
    path = tmp_path_factory.mktemp("fragile") / "model"
    shutil.copytree(tiny_model_dir, path)
    weights = load_file(path / "model.safetensors")
    bias = next(name for name in weights if name.endswith("layer.1.output.LayerNorm.bias"))
    weights[bias] = weights[bias] + 1000.0
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(path / "1_Pooling")
    _st_files(path, [_pooling(32, "mean"), _layer_norm(32), NORMALIZE_MODULE], max_seq_length=48)
    return path


def test_a_model_bf16_cannot_carry_is_measured_below_the_bar(fragile_model):
    cosines, lines = check_bf16(fragile_model, {}, ["torch"])
    assert cosines["torch"] < BF16_MIN_COSINE and "refused, below the bar" in lines[0]
    with pytest.raises(Bf16Refused, match=r"min cosine .* < 0.999\); build it in float32"):
        require_bf16(fragile_model, {"device": "cpu", "dtype": "bfloat16"})


@pytest.fixture
def config(tmp_path) -> Path:
    from tests.support import REPO

    path = tmp_path / "config.properties"
    path.write_text((REPO / "config.properties").read_text())
    return path


def handler_of(config: Path, name: str) -> dict:
    with zipfile.ZipFile(config.parent / "store" / f"{name}.mar") as archive:
        return yaml.safe_load(archive.read("model-config.yaml"))["handler"]


def ships(report: str, engine: str) -> bool:
    """Whether the build's report says `engine` ships."""
    return any(line.startswith(f"bfloat16 ({engine})") and line.endswith(": ships") for line in report.splitlines())


def test_the_build_ships_no_bf16_engine_below_the_bar_and_refuses_a_forced_one(fragile_model, config, capsys):
    assert run_build(config, "--model", str(fragile_model), "--name", "fragile") == 0
    shipped, report = handler_of(config, "fragile")["cpu_bf16_engines"], capsys.readouterr().err
    assert "torch" not in shipped and "bfloat16 (torch): min cosine" in report
    # Each engine is judged on its own vectors: OpenVINO keeps this model's last layer in float32.
    assert ("openvino" in shipped) == ships(report, "openvino"), report
    assert run_build(config, "--model", str(fragile_model), "--name", "forced", "--dtype", "bfloat16",
                     "--device", "cpu") == 1
    assert "build it in float32" in capsys.readouterr().err
    assert not (config.parent / "store" / "forced.mar").exists()


def test_the_build_lists_the_bf16_engines_it_verified(tiny_model_dir, config, capsys):
    assert run_build(config, "--model", str(tiny_model_dir), "--name", "tiny") == 0
    report = capsys.readouterr().err
    shipped = handler_of(config, "tiny")["cpu_bf16_engines"]
    for engine in ("torch", "openvino"):
        assert (engine in shipped) == ships(report, engine), report
    assert "torch" in shipped  # a random tiny BERT carries bf16 well
    # Forced choices are not timed against anything: the list stays empty.
    assert run_build(config, "--model", str(tiny_model_dir), "--name", "fp32", "--dtype", "float32") == 0
    assert handler_of(config, "fp32").get("cpu_bf16_engines", []) == []


def test_skip_check_ships_no_bf16_engine_and_says_so(tiny_model_dir, config, capsys):
    assert run_build(config, "--model", str(tiny_model_dir), "--name", "unchecked", "--skip-check") == 0
    assert handler_of(config, "unchecked").get("cpu_bf16_engines", []) == []
    assert "bfloat16 CPU engines: not checked (--skip-check)" in capsys.readouterr().err
