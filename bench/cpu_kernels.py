"""The default model's forward pass on CPU, engine by engine, in one run: what chose the CPU
engine (embedserve/handler/backends/onnx_runtime.py).

For each engine: the median time of a pass at a few (batch, length) shapes, and the cosine of
the served vectors (pooled, normalized) to sentence-transformers on the given texts. Engines:
PyTorch eager and torch.compile in float32, ONNX Runtime on the build's export, and the two
calibrated dynamic int8 quantizations `--dtype int8` may build (embedserve/archive/int8_calibration.py):
ONNX Runtime's of the same export, which the build ships, and PyTorch's (`--set engine=torch`).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from embedserve.archive.int8_calibration import Calibration, calibrate_onnx
from embedserve.archive.onnx_export import export_onnx
from bench.inprocess import bench_engine, cosine_stats, load_engine
from embedserve.handler.backends.padded import PaddedInputs
from embedserve.handler.model.files import describe_model

SHAPES = ((1, 16), (1, 64), (1, 256), (16, 64))


def exported_copy(model_dir: Path, root: Path, name: str = "exported") -> Path:
    """The model with the build's ONNX export beside it, as an archive holds it."""
    target = root / name
    shutil.copytree(model_dir, target)
    outcome = export_onnx(target, describe_model(target).usable_positions)
    if not outcome.startswith("exported"):
        raise RuntimeError(f"the ONNX export failed: {outcome}")
    return target


def int8_copy(model_dir: Path, root: Path) -> tuple[Path, Calibration]:
    """The model as `build_mar.sh --dtype int8` ships it: ONNX Runtime's calibrated int8 export."""
    target = exported_copy(model_dir, root, "int8")
    return target, calibrate_onnx(target, {})


def pass_ms(engine, batch: int, length: int, repeats: int) -> float:
    """Median milliseconds of one forward pass (transformer, pooling, head) of random ids."""
    ids = torch.randint(1000, 20000, (batch, length))
    inputs = PaddedInputs(ids, torch.ones_like(ids))
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 2):
            started = time.perf_counter()
            engine.encoder.backend.run(inputs)
            times.append(time.perf_counter() - started)
    return round(float(np.median(times[2:])) * 1000, 2)


def compare_engines(model_dir: Path, texts: Sequence[str], reference: np.ndarray, threads: int,
                    torch_int8_fp32_layers: Sequence[str], onnx_int8_dir: Path) -> dict:
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-kernels-") as tmp:
        root = Path(tmp)
        candidates = {
            "torch eager fp32": (model_dir, {"engine": "torch"}),
            "torch.compile fp32": (model_dir, {"engine": "torch", "compile": True}),
            "onnxruntime fp32": (exported_copy(model_dir, root), {"engine": "onnxruntime"}),
            "torch int8 (calibrated)": (model_dir, {"engine": "torch", "dtype": "int8",
                                                   "int8_fp32_layers": list(torch_int8_fp32_layers)}),
            "onnxruntime int8 (calibrated)": (onnx_int8_dir, {"engine": "onnxruntime", "dtype": "int8"}),
        }
        for name, (folder, settings) in candidates.items():
            started = time.perf_counter()
            try:
                engine = load_engine(folder, threads, lend_idle_cpus=False, **settings)
                row = {"start_s": round(time.perf_counter() - started, 1)}
                for batch, length in SHAPES:
                    row[f"{batch}x{length}_ms"] = pass_ms(engine, batch, length, repeats=30 if batch == 1 else 8)
                speed, vectors = bench_engine(engine, texts, repeats=1)
                row.update(texts_per_s=speed["texts_per_s"], **cosine_stats(vectors, reference))
            except Exception as err:  # an engine that cannot run here is reported, not fatal
                row = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
            results[name] = row
            print(f"  {name}: {row}", flush=True)
    return results
