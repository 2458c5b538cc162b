"""The CPU engine: the transformer as an ONNX Runtime session.

On a CPU, ONNX Runtime's fused transformer kernels (attention, bias + GELU, embeddings + LayerNorm)
run all-MiniLM-L6-v2 about twice as fast as PyTorch eager at batch 1 and faster at every shape
measured (docs/performance.md), with no Python between the layers. The model is exported at
build time (embedserve/archive/onnx_export.py); pooling and the head stay in torch, shared with the other
engines.

ONNX Runtime fixes a session's threads when it is created, while CPU lending
(embedserve/handler/worker/cpu_lending.py) changes the threads per pass: so one session is kept per thread count
used, chosen per pass by torch's current thread count, which lending sets.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime
import torch

from embedserve.handler.model.towers import TextFeed
from embedserve.handler.worker.cpu_lending import for_threads

ONNX_FILE = "transformer.onnx"
# The same graph with ONNX Runtime's dynamic int8 quantization, calibrated by the build
# (embedserve/archive/int8_calibration.py).
INT8_ONNX_FILE = "transformer.int8.onnx"
# An image-text model's towers: pixel values to projected image features, ids and mask to
# projected text features.
VISION_ONNX_FILE = "vision.onnx"
TEXT_TOWER_ONNX_FILE = "text_tower.onnx"


# ONNX Runtime's fused residual add + LayerNorm (SkipLayerNormalization) is slower on CPU than
# the two operators it replaces: 1.54 against 0.39 ms on (32, 40, 384) float32, 2 threads. The
# export leaves them apart, and sessions do not fuse them back at load. Measured on the whole
# all-MiniLM-L6-v2 in turns, fused / apart: 1 x 64 tokens 11.97 / 11.33 ms, 1 x 256 49.1 / 44.9,
# 32 x 40 203.6 / 188.5; the tiny request-path model at 13 x 12, 471 / 416 us.
UNFUSED = ["SkipLayerNormFusion"]


def onnx_file(int8: bool) -> str:
    return INT8_ONNX_FILE if int8 else ONNX_FILE


class _ThreadSessions:
    """A graph's ONNX Runtime sessions, one per thread count a pass may run with (`cpu_sessions`),
    and the one for the pass now: lending sets torch's thread count."""

    def __init__(self, path: Path, threads: int, lend_threads: int = 0):
        self.sessions = cpu_sessions(Path(path), threads, lend_threads)

    @property
    def thread_counts(self) -> tuple[int, ...]:
        return tuple(self.sessions)

    def _session_now(self) -> onnxruntime.InferenceSession:
        return for_threads(self.sessions, torch.get_num_threads())


class OnnxTransformer(_ThreadSessions):
    """(batch, sequence) ids and attention mask in (token types too where exported), (batch,
    sequence, hidden) float32 states out, or a scoring model's (batch, labels) logits."""

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        # The one output: last hidden states, or a scoring model's logits.
        return torch.from_numpy(self._session_now().run(None, graph_feed(input_ids, attention_mask, token_type_ids))[0])


class OnnxTextTower(_ThreadSessions):
    """An image-text model's text tower (its export by the build, archive/onnx_export.py), fed as
    torch's TextTower feeds it (model/towers.py: SigLIP's re-padding): (batch, seq) ids and mask in,
    (batch, dimension) projected text features out. On a 2-core CPU it runs CLIP ViT-B/32's text
    tower about 1.4x as fast as torch eager (docs/performance.md)."""

    def __init__(self, path: Path, threads: int, lend_threads: int = 0, feed: TextFeed = TextFeed()):
        super().__init__(path, threads, lend_threads)
        self.feed = feed

    def __call__(self, ids: torch.Tensor, attention: torch.Tensor, segments: torch.Tensor | None = None
                 ) -> torch.Tensor:
        fed_ids, mask = self.feed.graph_inputs(ids, attention)
        return torch.from_numpy(self._session_now().run(None, graph_feed(fed_ids, mask, None))[0])


class OnnxImageTower(_ThreadSessions):
    """An image-text model's vision tower (its export by the build, archive/onnx_export.py):
    (batch, channels, height, width) float32 pixel values in, (batch, dimension) projected image
    features out. On a 2-core CPU it runs CLIP ViT-B/32 about 1.4x as fast as torch eager
    (docs/performance.md)."""

    engine = "onnxruntime"

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        feed = {"pixel_values": np.ascontiguousarray(pixels.numpy(), dtype=np.float32)}
        return torch.from_numpy(self._session_now().run(None, feed)[0])


def cpu_sessions(path: Path, threads: int, lend_threads: int) -> dict[int, onnxruntime.InferenceSession]:
    """One session per thread count a pass may run with: its own threads always, all the CPUs a
    worker may borrow when lending is on."""
    return {count: _session(path, count, borrowed=count > threads) for count in sorted({threads, lend_threads} - {0})}


def _session(path: Path, threads: int, borrowed: bool) -> onnxruntime.InferenceSession:
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    # On its own CPUs a worker's threads sleep between operators: the other worker, the
    # frontend and the tokenizer need those cores. A pass on borrowed CPUs runs only while
    # nobody else uses them, so there its threads spin from one operator to the next, and
    # stop when the pass ends (spinning on after it slowed one client's requests 1.7x):
    # one 16-token text took 5.2-5.7 instead of 6.6-7.0 ms, for the same CPU time.
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if borrowed else "0")
    options.add_session_config_entry("session.force_spinning_stop", "1")
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    return load_session(path, options)


def graph_feed(input_ids: torch.Tensor, attention_mask: torch.Tensor,
               token_type_ids: torch.Tensor | None) -> dict[str, np.ndarray]:
    """The exported graph's inputs by name, as both runtimes that run it take them: int64 arrays;
    token types only where given (exported only for a scoring model that takes them)."""
    feed = {"input_ids": input_ids, "attention_mask": attention_mask}
    if token_type_ids is not None:
        feed["token_type_ids"] = token_type_ids
    return {name: np.ascontiguousarray(tensor.numpy(), dtype=np.int64) for name, tensor in feed.items()}


def load_session(path: Path, options: onnxruntime.SessionOptions) -> onnxruntime.InferenceSession:
    """A CPU session of the model at `path`, optimized at load as workers run it (UNFUSED left apart)."""
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"],
                                        disabled_optimizers=UNFUSED)


def is_out_of_memory(err: BaseException) -> bool:
    """ONNX Runtime's own allocation failure (a RuntimeException, not MemoryError)."""
    text = str(err)
    return type(err).__name__ in ("RuntimeException", "Fail") and (
        "Failed to allocate memory" in text or "bad allocation" in text or "std::bad_alloc" in text)
