"""An image-text model's vision tower in bfloat16 on OpenVINO: served where the build verified it
and the worker's engine trial finds it faster by the margin, its image vectors within the
bfloat16 bar of float32's, its texts on their float32 tower, and its cache rows apart from
float32's. The trial's timings are stand-ins here (what a CPU measures is the trial's own
business, tests/unit/execution/test_engine_trial.py); the towers and OpenVINO are real."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image

from embedserve.archive.bf16_check import BF16_MIN_COSINE, verified_vision_engines
from embedserve.archive.onnx_export import export_towers_onnx
from embedserve.handler.api.exchange import RawRequest
from embedserve.handler.backends.openvino_runtime import openvino_available
from embedserve.handler.execution import engine_trial, select
from embedserve.handler.execution.engine_trial import Timing
from embedserve.handler.model.inputs import ModelInput
from embedserve.handler.worker.cpu_features import bf16_units
from tests.support.engines import make_engine
from tests.support.image_models import make_clip

pytestmark = pytest.mark.skipif(bf16_units() is None or not openvino_available(),
                                reason="OpenVINO computes bfloat16 only on a CPU with bf16 units")

AUTO = {"dtype": "auto", "cpu_bf16_engines": ["openvino"], "cache_entries": 64}


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    folder = make_clip(tmp_path_factory.mktemp("clip") / "clip")
    assert export_towers_onnx(folder, None).startswith("vision tower exported")
    return folder


@pytest.fixture(autouse=True)
def trial_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_trial, "trial_directory", lambda: tmp_path / "trials")


def timings_won_by(winner: str):
    def timed(towers, size, positions):
        assert set(towers) == {"onnxruntime float32", "openvino bfloat16"} and size > 0 and positions > 0
        return {name: Timing(10_000.0 if name == winner else 1_000.0, 1.0) for name in towers}
    return timed


def data_uris(count: int = 4) -> list[str]:
    rng = np.random.default_rng(3)
    uris = []
    for index in range(count):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (64 + 40 * index, 96, 3), dtype=np.uint8), "RGB").save(buffer, "PNG")
        uris.append("data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode())
    return uris


def embeddings(service, body: dict) -> np.ndarray:
    [response] = service.handle([RawRequest(body=body, content_type="application/json", url_path="v1/embeddings")])
    assert response.status == 200, response.body
    return np.asarray([row["embedding"] for row in json.loads(response.body)["data"]])


def test_the_build_ships_the_bf16_vision_tower_within_the_bar(clip_dir):
    engines, lines = verified_vision_engines(clip_dir, {"dtype": "auto", "device": "auto", "engine": "auto"})
    assert engines == ["openvino"], lines
    assert lines[0].startswith("bfloat16 (openvino, vision tower): min cosine") and "over 8 images" in lines[0]
    # Forced settings, and a GPU build, ship none.
    for forced in ({"dtype": "float32"}, {"device": "cuda"}, {"engine": "torch"}):
        assert verified_vision_engines(clip_dir, {"dtype": "auto", "device": "auto", "engine": "auto", **forced}) \
            == ([], [])


def test_a_faster_bf16_tower_serves_images_and_texts_stay_float32(clip_dir, monkeypatch):
    monkeypatch.setattr(select, "time_image_towers", timings_won_by("openvino bfloat16"))
    served = make_engine(clip_dir, **AUTO)
    info = served.info()
    assert (info["engine"], info["image_engine"], info["model_dtype"]) == ("onnxruntime", "openvino bfloat16",
                                                                           "float32")
    assert info["selected_by"]["image_dtype"].startswith("measured: openvino bfloat16 ran 10.00x onnxruntime "
                                                         "float32's tokens/s (one image: 1.00x")
    assert set(info["selected_by"]["image_speeds"]) == {"onnxruntime float32", "openvino bfloat16"}
    float32 = make_engine(clip_dir, **{**AUTO, "dtype": "float32"})
    assert float32.info()["image_engine"] == "onnxruntime"
    uris = data_uris()
    got, want = (embeddings(service, {"input": uris, "modality": "image"}) for service in (served, float32))
    assert (got * want).sum(1).min() >= BF16_MIN_COSINE and not np.array_equal(got, want)
    texts = ["a photograph of a harbour", "two cats"]
    assert np.array_equal(embeddings(served, {"input": texts}), embeddings(float32, {"input": texts}))
    # Cached rows of the bfloat16 tower's model are never float32's (a shared Redis, another worker).
    assert served.cache.key(ModelInput([1, 2, 3])) != float32.cache.key(ModelInput([1, 2, 3]))


def test_a_second_worker_reads_the_choice_and_a_slower_tower_is_not_served(clip_dir, monkeypatch):
    monkeypatch.setattr(select, "time_image_towers", timings_won_by("onnxruntime float32"))
    first = make_engine(clip_dir, **AUTO).info()
    assert first["image_engine"] == "onnxruntime"
    assert "short of the 1.2x margin, or slower on one image" in first["selected_by"]["image_dtype"]

    def no_timing(*args):
        raise AssertionError("the second worker timed the towers again")

    monkeypatch.setattr(select, "time_image_towers", no_timing)
    second = make_engine(clip_dir, **AUTO).info()
    assert second["image_engine"] == "onnxruntime"
    assert second["selected_by"]["image_dtype"].endswith("by an earlier worker on this machine")


def test_without_a_verified_tower_nothing_is_timed(clip_dir, monkeypatch):
    def no_timing(*args):
        raise AssertionError("timed a tower the build did not verify")

    monkeypatch.setattr(select, "time_image_towers", no_timing)
    info = make_engine(clip_dir, **{**AUTO, "cpu_bf16_engines": []}).info()
    assert info["image_engine"] == "onnxruntime"
    assert "no bfloat16 engine its build verified" in info["selected_by"]["image_dtype"]
