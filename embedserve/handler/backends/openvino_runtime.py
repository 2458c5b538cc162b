"""A CPU engine for bfloat16: the build's ONNX export compiled by OpenVINO.

ONNX Runtime has no bfloat16 path on x86 CPUs; OpenVINO compiles the same export for the CPU's
bf16 units (AMX, AVX512-BF16) and fuses the layers itself. On a 2-core AMD EPYC with
avx512_bf16, all-MiniLM-L6-v2 in batches of 32 mixed texts ran 240 texts/s against ONNX Runtime
float32's 125, and one 64-token text in 5.0 against 9.5 ms (docs/performance.md). It is an
optional install (`pip install embedserve[openvino]`, about 180 MB): a worker without it simply
does not try it (embedserve/handler/execution/engine_trial.py).

Like ONNX Runtime, OpenVINO fixes a compiled model's threads, while CPU lending changes the
threads per pass: one compiled model per thread count used, picked per pass by torch's thread
count, which lending sets. Threads are never pinned to cores: the workers of one server share
the cores, and each would otherwise pin its threads to the same first ones.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from embedserve.handler.backends.onnx_runtime import graph_feed
from embedserve.handler.worker.cpu_lending import for_threads

PRECISIONS = {torch.float32: "f32", torch.bfloat16: "bf16"}
# OpenVINO keeps memory for every input shape it has run (all-MiniLM-L6-v2: a worker grew from
# 626 to 894 MB over 2,048 mixed texts in batches of 32, ONNX Runtime's stayed at 559). Passes
# padded to a multiple of 8 tokens run fewer shapes: 683 MB, at the same texts/s.
PAD_MULTIPLE = 8


def openvino_available() -> bool:
    try:
        import openvino  # noqa: F401
    except ImportError:
        return False
    return True


class _Compiled:
    """An export compiled once per thread count a pass may run with (the worker's own, and all
    the CPUs lending may give it), with an infer request each."""

    def __init__(self, path: Path, threads: int, lend_threads: int = 0, dtype: torch.dtype = torch.bfloat16):
        import openvino

        if dtype not in PRECISIONS:
            raise ValueError(f"OpenVINO runs float32 or bfloat16 on a CPU, not {dtype}")
        core = openvino.Core()
        model = core.read_model(str(path))
        self.compiled = {count: core.compile_model(model, "CPU", {
            "INFERENCE_NUM_THREADS": count,
            "INFERENCE_PRECISION_HINT": PRECISIONS[dtype],
            "PERFORMANCE_HINT": "LATENCY",  # one stream: a pass is one request
            "ENABLE_CPU_PINNING": False,
        }) for count in sorted({threads, lend_threads} - {0})}
        self.requests = {count: compiled.create_infer_request() for count, compiled in self.compiled.items()}

    @property
    def thread_counts(self) -> tuple[int, ...]:
        return tuple(self.requests)

    @property
    def dtype(self) -> torch.dtype:
        """What OpenVINO really computes in: bfloat16 asked for on a CPU without bf16 units
        compiles to float32."""
        import openvino

        hints = {compiled.get_property("INFERENCE_PRECISION_HINT") for compiled in self.compiled.values()}
        return torch.bfloat16 if hints == {openvino.Type.bf16} else torch.float32

    def _infer(self, feed: dict[str, np.ndarray]) -> torch.Tensor:
        request = for_threads(self.requests, torch.get_num_threads())  # lending sets torch's count
        outputs = request.infer(feed)
        # The request's output buffer is reused by its next pass: copy it out.
        return torch.from_numpy(np.array(outputs[0], dtype=np.float32, copy=True))


class OpenVinoTransformer(_Compiled):
    """(batch, sequence) ids and attention mask in, (batch, sequence, hidden) float32 states out."""

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self._infer(graph_feed(input_ids, attention_mask, token_type_ids))


class OpenVinoImageTower(_Compiled):
    """An image-text model's vision tower (the build's export, archive/onnx_export.py) in bfloat16:
    (batch, channels, height, width) float32 pixel values in, (batch, dimension) float32 projected
    image features out. A ViT's passes are large matrix products, which a CPU's bf16 units run
    about twice as fast as ONNX Runtime's float32: CLIP ViT-B/32 23.2 against 45.7 ms an image on a
    2-core AMD EPYC with avx512_bf16 (docs/performance.md). A worker serves it where its engine
    trial says so (embedserve/handler/execution/select.py)."""

    engine = "openvino"

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        return self._infer({"pixel_values": np.ascontiguousarray(pixels.numpy(), dtype=np.float32)})
