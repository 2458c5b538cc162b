"""The build's fidelity check of the CPU's bfloat16 engines: each is compared with float32 on
the build's corpus, and only those within BF16_MIN_COSINE ship.

A worker under `dtype: auto` on a CPU with bf16 units times the float32 default against the
bfloat16 engines its archive lists (`cpu_bf16_engines`) and may serve one
(embedserve/handler/execution/engine_trial.py); this check is what lets an engine into that list.
The bar is the one half precision meets on a GPU. A model whose bfloat16 vectors fall below it
(activations that need float32's precision) ships float32 only, and says so. A build forced to
`--dtype bfloat16` on a CPU is refused below the bar instead.

The corpus is the int8 calibration's: mixed lengths from the model's own vocabulary, a seed the
benchmarks do not use.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from embedserve.archive.corpus import mixed_corpus
from embedserve.archive.int8_calibration import CALIBRATION_SEED, CALIBRATION_TEXTS
from embedserve.handler.assembly import assemble
from embedserve.handler.backends.onnx_runtime import ONNX_FILE, VISION_ONNX_FILE, OnnxImageTower
from embedserve.handler.backends.openvino_runtime import OpenVinoImageTower, openvino_available
from embedserve.handler.model.pooling import l2_normalize
from embedserve.handler.settings import Settings
from embedserve.handler.model.inputs import plain_inputs

BF16_MIN_COSINE = 0.999
CHECK_IMAGES = 8  # half smooth colour gradients, half noise, at several sizes


class Bf16Refused(ValueError):
    """A build forced to bfloat16 whose vectors fall below the bar."""


def times_bf16(handler: dict) -> bool:
    """Whether a CPU worker of this build times bfloat16 engines: dtype and engine auto, a
    placement that may be a CPU, neither compile nor packed passes (engine_trial.bf16_challengers)."""
    return handler["dtype"] == "auto" and handler["device"] in ("auto", "cpu") and \
        handler.get("engine", "auto") == "auto" and not handler.get("compile") and handler.get("packed") is not True


def candidate_engines(handler: dict, model_dir: Path) -> list[str]:
    """The bfloat16 engines a CPU worker of this build could time under dtype auto."""
    if not times_bf16(handler):
        return []
    exported = (model_dir / ONNX_FILE).is_file()
    return ["torch"] + (["openvino"] if exported and openvino_available() else [])


def check_bf16(model_dir: Path, handler: dict, engines: list[str]) -> tuple[dict[str, float], list[str]]:
    """Each engine's least cosine to float32 on the build's corpus, where it was measured, and a
    report line per engine."""
    texts = mixed_corpus(model_dir / "tokenizer.json", CALIBRATION_TEXTS, seed=CALIBRATION_SEED)
    reference = _embed(model_dir, handler, texts, engine="torch", dtype="float32")
    cosines, lines = {}, []
    for engine in engines:
        vectors = _embed(model_dir, handler, texts, engine=engine, dtype="bfloat16")
        if vectors is None:
            lines.append(f"bfloat16 ({engine}): not verified, this CPU computes it in float32 (no bf16 units); "
                         "build on a CPU with amx_bf16 or avx512_bf16 to ship it")
            continue
        cosines[engine] = round(float((vectors * reference).sum(1).min()), 6)
        verdict = "ships" if cosines[engine] >= BF16_MIN_COSINE else "refused, below the bar"
        lines.append(f"bfloat16 ({engine}): min cosine {cosines[engine]:.6f} to float32 over {len(texts)} texts "
                     f"(bar {BF16_MIN_COSINE}): {verdict}")
    return cosines, lines


def verified_engines(model_dir: Path, handler: dict) -> tuple[list[str], list[str]]:
    """For an auto build: the bfloat16 engines within the bar, and the report."""
    engines = candidate_engines(handler, model_dir)
    if not engines:
        return [], []
    cosines, lines = check_bf16(model_dir, handler, engines)
    return [engine for engine, cosine in cosines.items() if cosine >= BF16_MIN_COSINE], lines


def require_bf16(model_dir: Path, handler: dict) -> list[str]:
    """For a build forced to bfloat16 on a CPU: its engine's report, or Bf16Refused."""
    engine = "openvino" if handler.get("engine") == "openvino" else "torch"
    cosines, lines = check_bf16(model_dir, handler, [engine])
    if engine in cosines and cosines[engine] < BF16_MIN_COSINE:
        raise Bf16Refused(f"--dtype bfloat16: the model's bfloat16 vectors differ from float32's (min cosine "
                          f"{cosines[engine]:.6f} < {BF16_MIN_COSINE}); build it in float32")
    return lines


def _embed(model_dir: Path, handler: dict, texts: list[str], *, engine: str, dtype: str) -> torch.Tensor | None:
    """The corpus's normalized vectors on a CPU worker of this engine and dtype; None where the
    engine would compute bfloat16 in float32 here."""
    settings = Settings.from_mapping({**handler, "device": "cpu", "dtype": dtype, "engine": engine,
                                      "cpu_bf16_engines": [], "cache_entries": 0, "redis_url": ""})
    service = assemble(model_dir, settings, model_name="bf16-check", cuda_available=False, warm=False)
    transformer = getattr(service.encoder.backend, "transformer", None)
    if dtype == "bfloat16" and getattr(transformer, "dtype", torch.bfloat16) != torch.bfloat16:
        return None
    return l2_normalize(service.encoder.embed(plain_inputs(service.text.token_ids(texts))).vectors)


def verified_vision_engines(model_dir: Path, handler: dict) -> tuple[list[str], list[str]]:
    """For an auto build of an image-text model whose vision tower exported: OpenVINO's bfloat16
    tower where its image vectors are within the bar of ONNX Runtime's float32 ones on the check's
    images, prepared by the folder's own image processor; and the report. Its texts stay float32."""
    path = model_dir / VISION_ONNX_FILE
    if not times_bf16(handler) or not path.is_file() or not openvino_available():
        return [], []
    tower = OpenVinoImageTower(path, threads=1)
    if tower.dtype != torch.bfloat16:
        return [], ["bfloat16 (openvino, vision tower): not verified, this CPU computes it in float32 (no bf16 "
                    "units); build on a CPU with amx_bf16 or avx512_bf16 to ship it"]
    pixels = _check_pixels(model_dir)
    reference = l2_normalize(OnnxImageTower(path, threads=1)(pixels))
    cosine = round(float((l2_normalize(tower(pixels)) * reference).sum(1).min()), 6)
    verdict = "ships" if cosine >= BF16_MIN_COSINE else "refused, below the bar"
    return (["openvino"] if cosine >= BF16_MIN_COSINE else []), [
        f"bfloat16 (openvino, vision tower): min cosine {cosine:.6f} to float32 over {len(pixels)} images "
        f"(bar {BF16_MIN_COSINE}): {verdict}"]


def _check_pixels(model_dir: Path) -> torch.Tensor:
    from PIL import Image
    from transformers import AutoImageProcessor

    rng = np.random.default_rng(CALIBRATION_SEED)
    images = []
    for index in range(CHECK_IMAGES):
        width, height = int(rng.integers(64, 640)), int(rng.integers(64, 480))
        if index % 2:
            pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        else:  # a smooth gradient between two random colours
            ramp = np.linspace(0.0, 1.0, width)[None, :, None]
            start, end = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
            pixels = np.broadcast_to(start + (end - start) * ramp, (height, width, 3)).astype(np.uint8)
        images.append(Image.fromarray(np.ascontiguousarray(pixels), "RGB"))
    return AutoImageProcessor.from_pretrained(model_dir)(images=images, return_tensors="pt")["pixel_values"]
