"""What the figures were measured on: versions, the GPU, which SDPA kernels run a padded
attention, and the peak FLOPS that MFU is a fraction of."""

from __future__ import annotations

import os
import platform
import time
import warnings

import torch

from bench.inprocess import matmul_gflops
from embedserve.handler.execution.placement import available_cpus

# Dense fp16/bf16 tensor-core peaks from NVIDIA's datasheets (the sparse figures halved), matched
# on the device name in this order; other GPUs are measured with a large matmul.
PEAK_TFLOPS = (
    ("h200 nvl", 835.5, "H200 NVL"),
    ("h200", 989.4, "H200 SXM"),
    ("h100 nvl", 835.5, "H100 NVL"),
    ("h100 pcie", 756.5, "H100 PCIe"),
    ("h100", 989.4, "H100 SXM"),
)


def environment(cuda: bool) -> dict:
    import sentence_transformers
    import transformers

    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "python": platform.python_version(),
           "platform": platform.platform(), "cpus": available_cpus(), "torch": torch.__version__,
           "transformers": transformers.__version__, "sentence_transformers": sentence_transformers.__version__,
           "hub_offline": {key: os.environ.get(key) for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}}
    if not cuda:
        return {**env, "gpu": None, "cpu": platform.processor() or platform.machine(), "torch_threads":
                torch.get_num_threads()}
    props = torch.cuda.get_device_properties(0)
    backends = torch.backends.cuda
    return {
        **env,
        "gpu": props.name,
        "capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "matmul_allow_tf32": backends.matmul.allow_tf32,
        "sdpa_enabled": {"flash": backends.flash_sdp_enabled(), "mem_efficient": backends.mem_efficient_sdp_enabled(),
                         "math": backends.math_sdp_enabled(),
                         "cudnn": getattr(backends, "cudnn_sdp_enabled", lambda: None)()},
    }


def tokenizer_threads() -> dict:
    """The tokenizer's thread pool as the engines run it: read after one has started, since the
    handler sets TOKENIZERS_PARALLELISM (on for a GPU worker, whose host cores idle while it
    computes) where the environment does not."""
    return {"TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM"),
            "RAYON_NUM_THREADS": os.environ.get("RAYON_NUM_THREADS"), "cpus": available_cpus()}


def sdpa_runs(head_dim: int = 32) -> dict:
    """Which SDPA kernels accept an fp16 attention with and without a padding mask (a BERT batch
    of mixed lengths carries one; a kernel that refuses it is never used for such a batch)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(8, 12, 128, head_dim, device="cuda", dtype=torch.float16)
    lengths = torch.randint(8, 129, (8,), device="cuda")
    mask = (torch.arange(128, device="cuda") < lengths[:, None])[:, None, None, :]  # (batch, 1, 1, keys)
    runs = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.MATH):
        row = {}
        for label, attn_mask in (("no_mask", None), ("padding_mask", mask)):
            try:
                with warnings.catch_warnings(), sdpa_kernel(backend):
                    warnings.simplefilter("ignore")
                    torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=attn_mask)
                torch.cuda.synchronize()
                row[label] = True
            except Exception:  # a kernel that refuses the shape, mask or build, whatever the error
                row[label] = False
        runs[backend.name.lower()] = row
    return runs


def peak_flops(cuda: bool) -> dict:
    """The MFU denominator: the datasheet's dense fp16 tensor-core peak where the GPU is in the
    table, else the measured matmul rate; the measured rate is reported either way."""
    if not cuda:
        measured = matmul_gflops(available_cpus(), seconds=0.5) / 1e3
        return {"source": "measured: 1024^3 fp32 matmul (CPU)", "tflops": round(measured, 3),
                "measured_matmul_tflops": round(measured, 3)}
    measured = matmul_tflops()
    name = torch.cuda.get_device_name(0).lower()
    for key, tflops, label in PEAK_TFLOPS:
        if key in name:
            return {"source": f"datasheet: {label}, dense fp16/bf16 tensor core", "tflops": tflops,
                    "measured_matmul_tflops": round(measured, 1)}
    return {"source": "measured: 8192^3 fp16 matmul", "tflops": round(measured, 1),
            "measured_matmul_tflops": round(measured, 1)}


def matmul_tflops(size: int = 8192, repeats: int = 20) -> float:
    a, b = (torch.randn(size, size, device="cuda", dtype=torch.float16) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    end.synchronize()
    return 2 * size**3 * repeats / (start.elapsed_time(end) / 1e3) / 1e12
