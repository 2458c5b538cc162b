"""Choose which Linear layers stay in float32 under int8 mode, by measuring, once, at build time.

Quantizing every Linear of a small encoder costs too much accuracy (all-MiniLM-L6-v2: mean
cosine 0.96 to fp32), but the cost is concentrated: the FFN projections of the first layers
carry activation outliers that int8 cannot represent. So: quantize one layer at a time and
record how far the embeddings move (its sensitivity); then keep the most sensitive layers in
float32, one by one, until the whole model stays within the accuracy floor on the calibration
texts. The result is written into the archive's model-config.yaml; workers do not recalibrate.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from archive.corpus import mixed_corpus
from handler.encoder import quantize_int8, quantizable_layers, resolve_placement
from handler.engine import EmbeddingEngine
from handler.pooling import l2_normalize
from handler.settings import Settings

# Calibration floor, above the promise made for int8 (mean >= 0.99, min >= 0.97 on other texts).
MEAN_COSINE_FLOOR = 0.993
MIN_COSINE_FLOOR = 0.98
CALIBRATION_TEXTS = 128
CALIBRATION_SEED = 9  # the benchmark's corpora use other seeds: calibration is not test data


@dataclass(frozen=True)
class Calibration:
    keep_fp32: list[str]
    mean_cosine: float
    min_cosine: float
    quantized_layers: int


def calibrate(model_dir: Path, handler_section: dict) -> Calibration:
    settings = Settings.from_mapping({**handler_section, "device": "cpu", "dtype": "float32", "cpu_threads": 0})
    engine = EmbeddingEngine.load(model_dir, settings, resolve_placement(settings, None, 1, False), "calibration")
    texts = mixed_corpus(model_dir / "tokenizer.json", CALIBRATION_TEXTS, seed=CALIBRATION_SEED)
    ids = engine.token_ids(texts)
    fp32 = engine.encoder.model
    reference = _embed(engine, fp32, ids)

    def cosines(keep: list[str]) -> torch.Tensor:
        return (_embed(engine, quantize_int8(copy.deepcopy(fp32), keep), ids) * reference).sum(1)

    layers = quantizable_layers(fp32)
    sensitivity = {}
    for layer in layers:  # quantize this layer alone
        sensitivity[layer] = 1.0 - float(cosines([name for name in layers if name != layer]).mean())
    keep: list[str] = []
    for layer in [None] + sorted(layers, key=sensitivity.get, reverse=True):
        if layer is not None:
            keep.append(layer)
        measured = cosines(keep)
        print(f"int8 calibration: {len(keep)} layers kept in float32: mean cosine {measured.mean():.4f}, "
              f"min {measured.min():.4f}", file=sys.stderr)
        if measured.mean() >= MEAN_COSINE_FLOOR and measured.min() >= MIN_COSINE_FLOOR:
            break
    return Calibration(keep, round(float(measured.mean()), 5), round(float(measured.min()), 5),
                       len(layers) - len(keep))


def _embed(engine: EmbeddingEngine, model: torch.nn.Module, ids: list[list[int]]) -> torch.Tensor:
    engine.encoder.model = model
    return l2_normalize(engine.encoder.embed(ids).vectors)
