"""Where and how a worker computes: device, dtype, threads, pass sizes, CUDA graph ladder.

Resolved once per worker from the settings, the model's files and the worker's lot (the server's
gpu_id, the worker count, the CPUs this process may use), before anything is loaded. It decides
nothing about which backend runs the passes: embedserve/handler/execution/select.py does, from this placement.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from embedserve.handler.backends.cuda_graphs import Bucket, ladder
from embedserve.handler.settings import Settings, switch

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# Padded tokens per forward pass when the setting is 0. Measured on a 2-core CPU with
# all-MiniLM-L6-v2 (bench/): per token, passes of 256-2048 run at the same speed, 4096 about
# 15% slower and 16384 up to 2x slower, as activations fall out of cache; 1024 keeps every
# pass short enough to borrow idle CPUs (embedserve/handler/execution/encoder.py). A GPU needs large passes to fill
# its cores.
CPU_BATCH_TOKENS = 1024
GPU_BATCH_TOKENS = 16384
# GPU passes pad to a multiple of this (tensor-core tiles, fewer distinct shapes); CPU passes
# pad only to their longest input.
GPU_PAD_MULTIPLE = 8
# torch's threads in a GPU worker unless `cpu_threads` says otherwise. torch's default is every core
# of the host, in every worker: on an H200 with 16 cores, 4 engines in 4 processes each serving
# batches of 8 requests of 32 texts made 10,709 texts/s together at 1,386 us of CPU a text, no more
# than one alone (10,827), their idle OpenMP threads spinning on the cores the others needed; with
# one thread each, 41,536 texts/s at 201 us (with 4, each one's share: 39,704 at 285 us).
# bench/gpu_host_probe.py; bench/results/gpu_h200_run5/.
GPU_TORCH_THREADS = 1


@dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: torch.dtype
    cpu_threads: int  # the threads of a CPU pass; 0 on GPU, where no pass runs on the CPU
    max_batch_tokens: int
    pad_multiple: int
    # CPUs among which this worker may borrow idle ones for small passes; 0: no lending.
    lend_cpus: int = 0
    # Under int8: the Linear layers torch keeps in float32 (the rest are quantized). None: no int8.
    int8_fp32_layers: tuple[str, ...] | None = None
    # CUDA graphs: on or off; the buckets of padded passes, largest first; their memory cap.
    cuda_graphs: bool = False
    cuda_graph_buckets: tuple[Bucket, ...] = ()
    cuda_graph_max_bytes: int = 0
    compile: bool = False
    packed: bool = False  # packed passes asked for (embedserve/handler/execution/select.py verifies them; torch engine)
    # The Rust tokenizer's thread pool, on GPU workers: the worker's share of the host's cores (its
    # workers share them); 0 on CPU, where the tokenizer runs on the calling thread.
    tokenizer_threads: int = 0
    # torch's intra-op threads in this process: cpu_threads on a CPU; on a GPU, where torch's CPU
    # work is the host's small steps (a batch's normalization, index arrays), one (GPU_TORCH_THREADS).
    torch_threads: int = 0

    @property
    def int8(self) -> bool:
        return self.int8_fp32_layers is not None


def resolve_placement(settings: Settings, gpu_id: int | None, workers: int, cuda_available: bool,
                      model_dir: Path | None = None) -> Placement:
    """Pick device, dtype, threads and forward-pass shape from the settings, the model's files and
    this worker's lot."""
    device = worker_device(settings.device, gpu_id, cuda_available)
    if device.type == "cuda" and not cuda_available:
        raise ValueError(f"handler setting 'device': {settings.device} requested but CUDA is not available")
    on_gpu = device.type == "cuda"
    int8 = settings.dtype == "int8"
    if int8 and on_gpu:
        raise ValueError("handler setting 'dtype': int8 is a CPU mode; use float16 or bfloat16 on CUDA")
    if settings.dtype == "auto":
        dtype = _gpu_dtype(model_dir) if on_gpu else torch.float32
    else:
        dtype = torch.float32 if int8 else _DTYPES[settings.dtype]  # int8 loads fp32, then quantizes
    if not on_gpu and dtype == torch.float16:
        raise ValueError("handler setting 'dtype': float16 is not supported on CPU; use float32 or bfloat16")
    # Workers are separate processes; split the cores between them instead of oversubscribing.
    cpus = available_cpus()
    share = max(1, cpus // max(1, workers))  # this worker's cores
    threads = 0 if on_gpu else settings.cpu_threads or share
    lend = not on_gpu and settings.lend_idle_cpus and not settings.cpu_threads and cpus > threads
    max_batch_tokens = settings.max_batch_tokens or (GPU_BATCH_TOKENS if on_gpu else CPU_BATCH_TOKENS)
    if settings.cuda_graphs is True and not on_gpu:
        log.warning("handler setting 'cuda_graphs' needs a CUDA device; this %s worker runs eagerly", device)
    graphs = switch(settings.cuda_graphs, on_gpu) and on_gpu
    buckets = ladder(settings.cuda_graph_batches, settings.cuda_graph_lengths, max_batch_tokens) if graphs else []
    return Placement(
        device, dtype, threads, lend_cpus=cpus if lend else 0,
        max_batch_tokens=max_batch_tokens,
        pad_multiple=GPU_PAD_MULTIPLE if on_gpu else 1,
        int8_fp32_layers=settings.int8_fp32_layers if int8 else None,
        cuda_graphs=graphs,
        cuda_graph_buckets=tuple(buckets),
        cuda_graph_max_bytes=settings.cuda_graph_max_mb * 2**20,
        compile=settings.compile,
        packed=switch(settings.packed, on_gpu),
        tokenizer_threads=share if on_gpu else 0,
        torch_threads=(settings.cpu_threads or GPU_TORCH_THREADS) if on_gpu else threads,
    )


# Architectures whose activations exceed float16's range whatever dtype the checkpoint was saved
# in: Gemma's (EmbeddingGemma's card: "activations do not support float16").
BFLOAT16_ONLY = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text"})


def _gpu_dtype(model_dir: Path | None) -> torch.dtype:
    """Half precision on a GPU: float16, unless the checkpoint was saved in bfloat16 or the
    architecture is in BFLOAT16_ONLY. Models trained in bfloat16 (the Qwen family) can hold
    activations beyond float16's range (65504), which overflow to inf in float16; bfloat16 has
    float32's range."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text()) if model_dir else {}
    except (OSError, ValueError):
        config = {}
    saved = config.get("dtype") or config.get("torch_dtype")  # transformers 5 writes "dtype"
    return torch.bfloat16 if saved == "bfloat16" or config.get("model_type") in BFLOAT16_ONLY else torch.float16


def worker_device(setting: str, gpu_id: int | None, cuda_available: bool) -> torch.device:
    """The device of the `device` setting: "auto" and "cuda" mean the GPU the server assigned this
    worker (gpu_id; GPU 0 without one), "auto" without CUDA the CPU; an explicit "cuda:N" is kept."""
    if setting == "cpu" or (setting == "auto" and not cuda_available):
        return torch.device("cpu")
    if setting in ("auto", "cuda"):
        return torch.device("cuda", gpu_id or 0)
    return torch.device(setting)


def apply_placement(placement: Placement) -> None:
    """Make this process what `placement` says, before anything is loaded: its GPU current (the
    model, streams and graphs then land there, not on GPU 0), its torch threads."""
    make_current(placement.device)
    if placement.torch_threads:
        torch.set_num_threads(placement.torch_threads)


def make_current(device: torch.device) -> None:
    """Make a GPU this process's current device: streams, graph pools and kernels that name no
    device of their own land there, not on GPU 0."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def available_cpus(cgroup_cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU limit (a
    container's limit is not its host's core count)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = cgroup_cpu_max.read_text().split()
        if quota != "max":
            cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 limit
    return cpus
