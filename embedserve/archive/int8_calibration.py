"""Choose what stays in float32 under int8 mode, by measuring, once, at build time.

Quantizing every matrix multiplication of a small encoder costs too much accuracy
(all-MiniLM-L6-v2: mean cosine 0.96 to fp32 under torch), but the cost is concentrated: the FFN
projections of the first layers carry activation outliers that int8 cannot represent. So:
quantize one unit at a time and record how far the embeddings move (its sensitivity); then keep
the most sensitive units in float32, one by one, until the whole model stays within the
accuracy floor on the calibration texts.

Two quantizers, one procedure:
- ONNX Runtime (the CPU engine, where the build exported the model): the units are the MatMul and
  fused Attention nodes of transformer.onnx; the result is written as transformer.int8.onnx, and
  the float32 export is dropped from the archive.
- torch (where there is no export, or `--set engine=torch`): the units are the Linear layers; the
  kept ones are written into the archive's model-config.yaml (int8_fp32_layers).
Workers do not recalibrate.
"""

from __future__ import annotations

import copy
import logging
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from embedserve.archive.corpus import mixed_corpus
from embedserve.handler.assembly import assemble
from embedserve.handler.backends.onnx_runtime import INT8_ONNX_FILE, ONNX_FILE, OnnxTransformer
from embedserve.handler.execution.encoder import Encoder
from embedserve.handler.model.loading import TorchTransformer, quantizable_layers, quantize_int8
from embedserve.handler.model.pooling import l2_normalize
from embedserve.handler.service import EmbeddingService
from embedserve.handler.settings import Settings
from embedserve.handler.model.inputs import plain_inputs

# Calibration floor, above the promise made for int8 (mean >= 0.99, min >= 0.97 on other texts).
MEAN_COSINE_FLOOR = 0.993
MIN_COSINE_FLOOR = 0.98
CALIBRATION_TEXTS = 128
CALIBRATION_SEED = 9  # the benchmark's corpora use other seeds: calibration is not test data
# ONNX Runtime's dynamic quantization handles these operators (Attention: its Q/K/V projection).
ONNX_QUANTIZABLE = ("MatMul", "Attention")


@dataclass(frozen=True)
class Calibration:
    keep_fp32: list[str]
    mean_cosine: float
    min_cosine: float
    quantized: int  # units quantized
    engine: str  # "onnxruntime" or "torch"

    def summary(self) -> str:
        unit = "MatMul/Attention nodes" if self.engine == "onnxruntime" else "Linear layers"
        return (f"int8 ({self.engine}): {self.quantized} {unit} quantized, {len(self.keep_fp32)} kept in float32; "
                f"calibration cosine to fp32: mean {self.mean_cosine}, min {self.min_cosine}")


def calibrate(model_dir: Path, handler_section: dict) -> Calibration:
    """Calibrate torch's int8 (dynamic, per-channel, Linear layers) of the model in model_dir."""
    engine, ids = _calibration_engine(model_dir, handler_section, "torch")
    encoder = engine.encoder
    fp32 = encoder.backend.transformer.model
    reference = _embed(encoder, ids)

    def cosines(keep: list[str]) -> torch.Tensor:
        trial = TorchTransformer(quantize_int8(copy.deepcopy(fp32), keep))
        return (_embed(encoder.with_backend(encoder.backend.with_transformer(trial)), ids) * reference).sum(1)

    return _keep_until_within_floor(quantizable_layers(fp32), cosines, "torch")


def calibrate_onnx(model_dir: Path, handler_section: dict) -> Calibration:
    """Calibrate ONNX Runtime's int8 of model_dir/transformer.onnx, write transformer.int8.onnx
    and remove the float32 export (an int8 archive does not serve it)."""
    engine, ids = _calibration_engine(model_dir, handler_section, "onnxruntime")
    source, target = model_dir / ONNX_FILE, model_dir / INT8_ONNX_FILE
    encoder = engine.encoder
    reference = _embed(encoder, ids)
    with tempfile.TemporaryDirectory(prefix="int8-") as tmp:
        trial = Path(tmp) / INT8_ONNX_FILE

        def cosines(keep: list[str]) -> torch.Tensor:
            quantize_onnx(source, trial, keep)
            session = OnnxTransformer(trial, threads=torch.get_num_threads())
            return (_embed(encoder.with_backend(encoder.backend.with_transformer(session)), ids) * reference).sum(1)

        calibration = _keep_until_within_floor(onnx_quantizable_nodes(source), cosines, "onnxruntime")
    quantize_onnx(source, target, calibration.keep_fp32)
    source.unlink()
    return calibration


def onnx_quantizable_nodes(path: Path) -> list[str]:
    import onnx

    return [node.name for node in onnx.load(str(path), load_external_data=False).graph.node
            if node.op_type in ONNX_QUANTIZABLE]


def quantize_onnx(source: Path, target: Path, keep_fp32: Sequence[str] = ()) -> None:
    """ONNX Runtime's dynamic int8: per-channel int8 weights, activations quantized per call."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger().setLevel(logging.ERROR)  # the quantizer logs advice on the root logger
        quantize_dynamic(str(source), str(target), weight_type=QuantType.QInt8, per_channel=True,
                         op_types_to_quantize=list(ONNX_QUANTIZABLE), nodes_to_exclude=list(keep_fp32),
                         # The fused contrib operators carry no inferred output types.
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})


def _calibration_engine(model_dir: Path, handler_section: dict, engine: str) -> tuple[EmbeddingService, list[list[int]]]:
    settings = Settings.from_mapping({**handler_section, "device": "cpu", "dtype": "float32", "cpu_threads": 0,
                                      "engine": engine, "cache_entries": 0, "redis_url": ""})
    loaded = assemble(model_dir, settings, model_name="calibration", cuda_available=False, warm=False)
    texts = mixed_corpus(model_dir / "tokenizer.json", CALIBRATION_TEXTS, seed=CALIBRATION_SEED)
    return loaded, loaded.text.token_ids(texts)


def _keep_until_within_floor(units: list[str], cosines: Callable[[list[str]], torch.Tensor],
                             engine: str) -> Calibration:
    """Keep the most sensitive units in float32, one by one, until the floor holds.
    `cosines(keep)`: per text, the cosine to fp32 with every unit but `keep` quantized."""
    sensitivity = {unit: 1.0 - float(cosines([other for other in units if other != unit]).mean())
                   for unit in units}  # this unit quantized alone
    keep: list[str] = []
    for unit in [None] + sorted(units, key=sensitivity.get, reverse=True):
        if unit is not None:
            keep.append(unit)
        measured = cosines(keep)
        print(f"int8 calibration: {len(keep)} kept in float32: mean cosine {measured.mean():.4f}, "
              f"min {measured.min():.4f}", file=sys.stderr)
        if measured.mean() >= MEAN_COSINE_FLOOR and measured.min() >= MIN_COSINE_FLOOR:
            break
    return Calibration(keep, round(float(measured.mean()), 5), round(float(measured.min()), 5),
                       len(units) - len(keep), engine)


def _embed(encoder: Encoder, ids: list[list[int]]) -> torch.Tensor:
    return l2_normalize(encoder.embed(plain_inputs(ids)).vectors)
