"""The encoder: a transformer loaded from safetensors, run under inference_mode, and pooled.

`embed` takes token ids in any order and returns pooled float32 vectors in the same order;
internally it sorts by length and cuts forward passes under a padded-token budget, at the
least cost (handler/batching.py). On a CPU, small passes also borrow the CPUs other workers
leave idle (handler/cpu_lending.py).

Memory: a forward pass that runs out of memory (CUDA OOM; on a CPU, the allocator's
RuntimeError or MemoryError) is split in two and retried, down to single inputs; only an input
that does not fit alone fails, and the caller answers its request alone with 507. Any other CUDA error may have poisoned the process's
CUDA context, so it is raised as DeviceFailure for the worker to exit and be replaced.
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Iterator, NoReturn, Sequence

import numpy as np
import torch
from transformers import AutoConfig, AutoModel
from transformers.utils import logging as transformers_logging

from handler.batching import Replay, padded_length, plan_sub_batches
from handler.cpu_lending import CpuLending
from handler.attention_mask import mask_builder
from handler.cuda_graphs import REPLAY_TOLERANCE, Bucket, GraphRunner, ladder, release_memory
from handler.head import load_head
from handler.model_files import HeadModule, Pooling
from handler.onnx_runtime import OnnxTransformer, onnx_file
from handler.packed import VARLEN_FLASH, PackedPasses, PackedTransformer, packed_support
from handler.packed_graphs import PackedGraphRunner, token_ladder
from handler.onnx_runtime import is_out_of_memory as _onnx_out_of_memory
from handler.pooling import PROMPT, pool
from handler.settings import Settings
from handler.transfer import to_device

log = logging.getLogger(__name__)

# Loading progress bars are noise in a server's log.
transformers_logging.disable_progress_bar()

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# Padded tokens per forward pass when the setting is 0. Measured on a 2-core CPU with
# all-MiniLM-L6-v2 (bench/): per token, passes of 256-2048 run at the same speed, 4096 about
# 15% slower and 16384 up to 2x slower, as activations fall out of cache; 1024 keeps every
# pass short enough to borrow idle CPUs (below). A GPU needs large passes to fill its cores.
CPU_BATCH_TOKENS = 1024
GPU_BATCH_TOKENS = 16384
# A pass of at most this many padded tokens borrows idle CPUs: it ends within about 150 ms on
# two CPU cores, the longest an owner then waits to get its CPU back.
LEND_MAX_TOKENS = 1024
# A pass expected to take less than this on the worker's own threads does not borrow: handing
# work between threads then costs more than a second core saves (a tiny BERT's 1x12 pass took
# 81 us on one ONNX Runtime thread, 151 us on two). The speed measured at warm-up sets the bar.
LEND_MIN_S = 0.002
# The timing passes behind the planner's pass cost: one short input, and this many tokens ...
CALIBRATION_TOKENS = 512
# ... or on a GPU, half and all of max_batch_tokens, in inputs of this length.
GPU_CALIBRATION_LENGTH = 128
# The least cosine, per input, between the packed and the padded pass at start-up: float
# rounding apart in float32, half precision's in float16 / bfloat16.
PACKED_MIN_COSINE = {torch.float32: 0.9999, torch.float16: 0.999, torch.bfloat16: 0.995}
# GPU passes pad to a multiple of this (tensor-core tiles, fewer distinct shapes); CPU passes
# pad only to their longest input.
GPU_PAD_MULTIPLE = 8


@dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: torch.dtype
    cpu_threads: int  # 0 on GPU: torch's default is left alone
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
    engine: str = "torch"  # or "onnxruntime" (CPU, float32 or int8)
    packed: bool = False  # packed passes asked for (the encoder verifies them; torch engine)

    @property
    def int8(self) -> bool:
        return self.int8_fp32_layers is not None


def resolve_placement(settings: Settings, gpu_id: int | None, workers: int, cuda_available: bool,
                      model_dir: Path | None = None) -> Placement:
    """Pick device, dtype, threads, engine and forward-pass shape from the settings, the model's
    files and this worker's lot."""
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
    threads = 0 if on_gpu else settings.cpu_threads or max(1, cpus // max(1, workers))
    lend = not on_gpu and settings.lend_idle_cpus and not settings.cpu_threads and cpus > threads
    max_batch_tokens = settings.max_batch_tokens or (GPU_BATCH_TOKENS if on_gpu else CPU_BATCH_TOKENS)
    if settings.cuda_graphs and not on_gpu:
        log.warning("handler setting 'cuda_graphs' needs a CUDA device; this %s worker runs eagerly", device)
    graphs = settings.cuda_graphs and on_gpu
    buckets = ladder(settings.cuda_graph_batches, settings.cuda_graph_lengths, max_batch_tokens) if graphs else []
    engine = _resolve_engine(settings, on_gpu, dtype, int8, model_dir)
    return Placement(
        device, dtype, threads, lend_cpus=cpus if lend else 0,
        max_batch_tokens=max_batch_tokens,
        pad_multiple=GPU_PAD_MULTIPLE if on_gpu else 1,
        int8_fp32_layers=settings.int8_fp32_layers if int8 else None,
        cuda_graphs=graphs,
        cuda_graph_buckets=tuple(buckets),
        cuda_graph_max_bytes=settings.cuda_graph_max_mb * 2**20,
        compile=settings.compile,
        engine=engine,
        packed=settings.packed,
    )


def _gpu_dtype(model_dir: Path | None) -> torch.dtype:
    """Half precision on a GPU: float16, unless the checkpoint was saved in bfloat16. Models
    trained in bfloat16 (the Qwen family) can hold activations beyond float16's range (65504),
    which overflow to inf in float16; bfloat16 has float32's range."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text()) if model_dir else {}
    except (OSError, ValueError):
        config = {}
    saved = config.get("dtype") or config.get("torch_dtype")  # transformers 5 writes "dtype"
    return torch.bfloat16 if saved == "bfloat16" else torch.float16


def worker_device(setting: str, gpu_id: int | None, cuda_available: bool) -> torch.device:
    """The device of the `device` setting: "auto" and "cuda" mean the GPU TorchServe assigned this
    worker (gpu_id; GPU 0 without one), "auto" without CUDA the CPU; an explicit "cuda:N" is kept."""
    if setting == "cpu" or (setting == "auto" and not cuda_available):
        return torch.device("cpu")
    if setting in ("auto", "cuda"):
        return torch.device("cuda", gpu_id or 0)
    return torch.device(setting)


def make_current(device: torch.device) -> None:
    """Make a GPU this process's current device: streams, graph pools and kernels that name no
    device of their own land there, not on GPU 0."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _resolve_engine(settings: Settings, on_gpu: bool, dtype: torch.dtype, int8: bool, model_dir: Path | None) -> str:
    exported = model_dir is not None and (Path(model_dir) / onnx_file(int8)).is_file()
    # int8 loads float32; packed passes run the torch model's own modules.
    onnx_fits = not on_gpu and dtype == torch.float32 and not settings.compile and not settings.packed
    if settings.engine == "onnxruntime":
        if not onnx_fits:
            raise ValueError("handler setting 'engine': onnxruntime runs float32 or int8 on a CPU (no compile, "
                             "no packed)")
        if not exported:
            raise ValueError(f"handler setting 'engine': onnxruntime needs the build's {onnx_file(int8)}, which "
                             "the archive does not hold (rebuild it with --set engine=auto)")
    if settings.engine == "torch":
        return "torch"
    return "onnxruntime" if onnx_fits and exported else "torch"


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


@dataclass(frozen=True)
class Embedded:
    vectors: torch.Tensor  # (items, dimension) float32, in input order
    real_tokens: int
    padded_tokens: int  # what the forward passes computed; real / padded is the padding efficiency
    passes: int
    too_large: frozenset[int] = frozenset()  # items that ran out of memory alone (their rows are zeros)


@dataclass(frozen=True)
class Speed:
    pass_overhead_tokens: int
    tokens_per_second: float  # full passes, this worker's own threads


class DeviceFailure(RuntimeError):
    """A CUDA error other than out-of-memory: the device state can no longer be trusted."""


FAULTS_ENV = "EMBEDSERVE_TEST_FAULTS"


@dataclass(frozen=True)
class FaultInjection:
    """Failures the tests provoke in a real worker, enabled only through EMBEDSERVE_TEST_FAULTS,
    e.g. "oom_above_tokens=64,device_error_token=7": a pass over 64 padded tokens raises
    MemoryError; a pass holding token id 7 raises a CUDA-style device error."""
    oom_above_tokens: int = 0
    device_error_token: int = -1

    @classmethod
    def from_env(cls) -> "FaultInjection | None":
        spec = os.environ.get(FAULTS_ENV, "")
        if not spec:
            return None
        values = dict(item.split("=", 1) for item in spec.split(","))
        log.warning("%s is set: failures will be injected (%s); never set it in production", FAULTS_ENV, spec)
        return cls(**{key: int(value) for key, value in values.items()})

    def check(self, ids: torch.Tensor) -> None:
        if self.oom_above_tokens and ids.numel() > self.oom_above_tokens:
            raise MemoryError(f"injected: {ids.numel()} padded tokens > {self.oom_above_tokens}")
        if self.device_error_token >= 0 and bool((ids == self.device_error_token).any()):
            raise RuntimeError("CUDA error: device-side assert triggered (injected)")


def _is_out_of_memory(err: BaseException) -> bool:
    # PyTorch's CPU allocator raises a RuntimeError of its own, not MemoryError.
    return isinstance(err, (MemoryError, torch.cuda.OutOfMemoryError)) or _onnx_out_of_memory(err) or (
        isinstance(err, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(err))


def _is_device_failure(err: BaseException) -> bool:
    text = str(err)
    return "CUDA error" in text or "device-side assert" in text or type(err).__name__ == "AcceleratorError"


def _raise_classified(err: Exception) -> NoReturn:
    """Raise `err` again: a CUDA error (other than out of memory) as DeviceFailure."""
    if _is_device_failure(err):
        raise DeviceFailure(str(err)) from err
    raise err


class Encoder:
    """A transformer plus its pipeline (pooling, then Dense / LayerNorm / Normalize): token ids in,
    one float32 vector per input out."""

    def __init__(self, model_dir: str | Path, placement: Placement, *, pooling: Pooling,
                 head: Sequence[HeadModule] = (), pad_id: int, max_batch_size: int, pass_overhead_tokens: int,
                 max_positions: int | None = None, max_length: int | None = None):
        self.model_dir = Path(model_dir)
        self.placement = placement
        self.pooling = pooling
        self.pad_id = pad_id
        self.max_batch_size = max_batch_size
        self.pass_overhead_tokens = pass_overhead_tokens
        # ... and what a CUDA graph replay costs beyond its tokens (measure_speed prices it).
        self.replay_overhead_tokens = pass_overhead_tokens
        # Tokens per input the position embeddings allow; None for rotary models.
        self.max_positions = max_positions
        # The longest input the engine ever passes (truncated, special tokens included), the
        # longest packed graphs take; None: max_positions.
        self.max_length = max_length
        make_current(placement.device)  # before the model, streams and graphs take GPU memory
        if placement.cpu_threads:
            torch.set_num_threads(placement.cpu_threads)
        self.lending = CpuLending.join(placement.lend_cpus, placement.cpu_threads) if placement.lend_cpus else None
        self.lend_min_tokens = 0  # padded tokens a pass needs to borrow CPUs (measure_speed sets it)
        # The torch model (None under ONNX Runtime) and what runs the transformer: (batch, seq)
        # ids and attention mask -> (batch, seq, hidden) states.
        self.model: torch.nn.Module | None = None
        if placement.engine == "onnxruntime":
            self.transformer = OnnxTransformer(self.model_dir / onnx_file(placement.int8), placement.cpu_threads or 1,
                                               lend_threads=placement.lend_cpus)
        else:
            self.model = self._load_model()
            self.transformer = self._torch_transformer
        # The model's 4D attention mask, built without reading the device (None: the model builds its own).
        self._attention_mask = None if self.model is None else mask_builder(self.model)
        self.faults = FaultInjection.from_env()
        pooled_width = int(AutoConfig.from_pretrained(self.model_dir).hidden_size) * len(pooling.modes)
        self.head, self.dimension = load_head(self.model_dir, head, pooled_width, placement.device)
        self.graphs: GraphRunner | None = None
        # How passes are laid out and run: packed where asked for and verified, else padded.
        self.passes: PaddedPasses | PackedPasses = self._packed_passes() if placement.packed else PaddedPasses(self)
        if placement.cuda_graphs:
            with torch.inference_mode():
                self._capture_graphs()

    def _capture_graphs(self) -> None:
        """CUDA graphs for this encoder's passes: by (batch, length) bucket for padded passes
        (handler/cuda_graphs.py), by total tokens for packed ones (handler/packed_graphs.py).
        Where none is left, every pass runs eagerly."""
        placement, vocab_size = self.placement, self.model.config.vocab_size
        common = dict(pad_id=self.pad_id, vocab_size=vocab_size, device=placement.device,
                      max_bytes=placement.cuda_graph_max_bytes, tolerance=REPLAY_TOLERANCE[placement.dtype])
        if isinstance(self.passes, PackedPasses):
            kernel = self.passes.transformer.attention_kernel
            if kernel != VARLEN_FLASH:  # the grouped SDPA reads the offsets on the host: not capturable
                log.warning("packed passes run eagerly: CUDA graphs need the %s attention kernel; this worker's "
                            "is %s", VARLEN_FLASH, kernel)
                return
            # Flash attention launches blocks for max_len tokens in every slot: the engine's limit,
            # which no input exceeds, not the position table's (a longer input's pass runs eagerly).
            max_len = self.max_length or self.max_positions or placement.max_batch_tokens
            largest = min(placement.max_batch_tokens, self.max_batch_size * max_len)
            packed = PackedGraphRunner.capture(self.passes.run_eager, token_ladder(largest),
                                               max_inputs=self.max_batch_size, max_len=max_len, **common)
            self.passes.graphs = packed if packed.graphs else None
            return
        # No bucket longer than the position embeddings: its warm-up would index past them.
        buckets = [b for b in placement.cuda_graph_buckets if b.length <= (self.max_positions or b.length)]
        if not buckets:
            return
        runner = GraphRunner.capture(self._pooled, buckets, **common)
        self.graphs = runner if runner.buckets else None

    def _packed_passes(self) -> "PaddedPasses | PackedPasses":
        """The packed layout if this model supports it and agrees with the padded one on a few
        inputs of mixed lengths; otherwise, with a log line saying why, the padded layout."""
        reason = packed_support(self.model)
        if reason is None:
            transformer = PackedTransformer(self.model)
            packed = PackedPasses(transformer, self.pooling.modes, self.head, self.placement.max_batch_tokens,
                                  self.max_batch_size)
            rows = _probe_rows(self.pad_id, self.model.config.vocab_size, self.max_positions or 512)
            floor = PACKED_MIN_COSINE[self.placement.dtype]
            try:
                with torch.inference_mode():
                    cosine = float(torch.nn.functional.cosine_similarity(
                        packed.run(packed.prepare(rows, None)), self._pooled(*self._pad(rows, None))).min())
            except Exception as err:  # e.g. an attention kernel this device or torch build lacks
                reason = f"its check failed ({type(err).__name__}: {str(err)[:200]})"
            else:
                if cosine >= floor:
                    log.info("packed passes (attention: %s), verified against padded: min cosine %.6f",
                             transformer.attention_kernel, cosine)
                    return packed
                reason = f"its vectors differ from the padded pass's (min cosine {cosine:.6f} < {floor})"
        log.warning("packed passes unavailable for this model: %s; passes are padded", reason)
        return PaddedPasses(self)

    def layout(self) -> dict[str, str | int]:
        """How this encoder runs its passes, for /info: padded or packed, the attention kernel,
        and how many CUDA graphs it replays (0: every pass runs eagerly)."""
        if isinstance(self.passes, PackedPasses):
            layout = {"layout": "packed", "attention": self.passes.transformer.attention_kernel}
        else:
            layout = {"layout": "padded", "attention": "onnxruntime" if self.model is None else
                      getattr(self.model.config, "_attn_implementation", None) or "eager"}
        graphs = self.graph_runner
        return {**layout, "cuda_graphs": 0 if graphs is None else len(graphs.graphs)}

    @property
    def graph_runner(self) -> GraphRunner | PackedGraphRunner | None:
        """The CUDA graphs this encoder's passes replay, or None."""
        return self.passes.graphs if isinstance(self.passes, PackedPasses) else self.graphs

    def _load_model(self) -> torch.nn.Module:
        kwargs = dict(dtype=self.placement.dtype, use_safetensors=True)
        try:
            model = AutoModel.from_pretrained(self.model_dir, attn_implementation="sdpa", **kwargs)
        except (ValueError, ImportError) as err:  # architectures without SDPA support
            log.warning("SDPA attention unavailable (%s); using eager attention", err)
            model = AutoModel.from_pretrained(self.model_dir, **kwargs)
        model = model.to(self.placement.device).eval()
        # An embedding pass never decodes further: a key/value cache (Qwen3 and other decoders
        # build one by default) would only hold every layer's keys and values to the pass's end.
        model.config.use_cache = False
        if self.placement.int8:
            model = quantize_int8(model, keep_fp32=self.placement.int8_fp32_layers)
        if self.placement.compile:
            model = torch.compile(model, dynamic=True)
        return model

    def embed(self, token_ids: Sequence[Sequence[int]], unpooled: Sequence[int] | None = None) -> Embedded:
        """Token ids per item -> (items, dimension) float32 pooled vectors on the CPU, in input order.
        `unpooled[i]`: how many of item i's first tokens pooling leaves out (an excluded prompt)."""
        lengths = [len(ids) for ids in token_ids]
        device = self.placement.device
        out = torch.zeros((len(token_ids), self.dimension), dtype=torch.float32, device=device)
        pending = self.passes.plan(lengths)
        padded = passes = 0
        too_large: set[int] = set()
        with torch.inference_mode(), self.lending.batch() if self.lending else nullcontext():
            while pending:
                indices = pending.pop(0)
                inputs = self.passes.prepare([token_ids[i] for i in indices],
                                             [unpooled[i] for i in indices] if unpooled else None)
                try:
                    with self._cpus_for_pass(inputs[0]):
                        # A copy on the device: a replayed graph's output buffer is overwritten by the next.
                        out[to_device(np.asarray(indices, dtype=np.int64), device)] = self._forward(inputs)
                except Exception as err:
                    if not _is_out_of_memory(err):
                        _raise_classified(err)
                    del inputs  # free this pass's inputs before retrying smaller
                    self._release_memory()
                    if len(indices) == 1:
                        too_large.add(indices[0])
                    else:
                        half = len(indices) // 2
                        log.warning("forward pass of %d inputs ran out of memory; retrying as %d + %d",
                                    len(indices), half, len(indices) - half)
                        pending[:0] = [indices[:half], indices[half:]]
                    continue
                padded += self.passes.computed_tokens(inputs)
                passes += 1
        return Embedded(self._to_host(out), real_tokens=sum(lengths), padded_tokens=padded, passes=passes,
                        too_large=frozenset(too_large))

    @staticmethod
    def _to_host(vectors: torch.Tensor) -> torch.Tensor:
        """The batch's vectors on the CPU: on a GPU the one copy, and the one wait, of the batch."""
        if vectors.device.type == "cpu":
            return vectors
        try:
            return vectors.cpu()
        except Exception as err:  # an asynchronous CUDA error of any pass surfaces here
            _raise_classified(err)

    @contextmanager
    def _cpus_for_pass(self, ids: torch.Tensor) -> Iterator[None]:
        """Run one pass on this worker's CPUs, plus every idle one unless the pass is long or
        too short to gain from them."""
        if self.lending is None or not self.lend_min_tokens <= ids.numel() <= LEND_MAX_TOKENS:
            yield
            return
        with self.lending.borrowing() as borrowed:
            torch.set_num_threads(self.placement.cpu_threads + borrowed)
            try:
                yield
            finally:
                torch.set_num_threads(self.placement.cpu_threads)

    def measure_speed(self) -> Speed:
        """Time passes on this device, its own threads (none borrowed) and dtype: the tokens per
        second of a full pass, and what a pass costs beyond its tokens, in tokens (the planner's
        price of one more pass). With CUDA graphs it also prices a replay, and keeps that price
        as `replay_overhead_tokens`; it sets `lend_min_tokens` from the time of a token.

        The time of a token comes from two passes that differ in size: on a CPU a one-input pass
        and a CALIBRATION_TOKENS one; on a GPU, where both would only be launching kernels, half
        and all of max_batch_tokens, which keep it computing. A one-input pass run eagerly then
        gives the cost of a pass beyond its tokens; replayed, that of a replay."""
        short_length = min(64, self.max_positions or 64) // 4
        short = self._time_pass(1, short_length, eager=True)
        if self.placement.device.type == "cuda":
            length = min(GPU_CALIBRATION_LENGTH, self.max_positions or GPU_CALIBRATION_LENGTH)
            rows = max(2, self.placement.max_batch_tokens // length)
            half, full = self._time_pass(rows // 2, length, eager=True), self._time_pass(rows, length, eager=True)
            per_token = (full - half) / ((rows - rows // 2) * length)
        else:
            length = min(64, self.max_positions or 64)
            rows = max(2, CALIBRATION_TOKENS // length)
            full = self._time_pass(rows, length)
            per_token = (full - short) / (rows * length - short_length)
        tokens_per_second = rows * length / full
        if per_token <= 0:  # a noisy neighbour swamped the measurement; keep what we had
            return Speed(self.pass_overhead_tokens, tokens_per_second)
        overhead_tokens = self._tokens_beyond(short, short_length, per_token)
        self.lend_min_tokens = max(0, round(LEND_MIN_S / per_token) - overhead_tokens)
        if self.graphs is not None:
            replayed = self._time_pass(1, short_length)
            self.replay_overhead_tokens = self._tokens_beyond(replayed, self.graphs.computed_tokens(1, short_length),
                                                              per_token)
            log.info("a CUDA graph replay costs as much as %d tokens here", self.replay_overhead_tokens)
        return Speed(overhead_tokens, tokens_per_second)

    def _tokens_beyond(self, seconds: float, tokens: int, per_token: float) -> int:
        """What a pass of `tokens` that took `seconds` cost beyond its tokens, in tokens."""
        return int(min(self.placement.max_batch_tokens, max(1, round(seconds / per_token - tokens))))

    def _time_pass(self, rows: int, length: int, *, eager: bool = False, repeats: int = 5) -> float:
        """The fastest of `repeats` runs of a (rows, length) pass, as passes run (replayed where a
        graph holds it) or `eager`: a busy neighbour only ever adds time."""
        run = self._pooled if eager else self._run_pass
        ids = torch.full((rows, length), self.pad_id, dtype=torch.long, device=self.placement.device)
        mask = torch.ones_like(ids)
        seconds = []
        with torch.inference_mode():
            for _ in range(repeats + 1):  # the first run warms this shape up and is not counted
                self._synchronize()
                started = time.perf_counter()
                run(ids, mask)
                self._synchronize()
                seconds.append(time.perf_counter() - started)
        return min(seconds[1:])

    def _synchronize(self) -> None:
        """Wait for the GPU: kernels run asynchronously, a timer must see them finish."""
        if self.placement.device.type == "cuda":
            torch.cuda.synchronize(self.placement.device)

    def _forward(self, inputs: tuple) -> torch.Tensor:
        if self.faults is not None:
            self.faults.check(inputs[0])
        return self.passes.run(inputs)

    def _run_pass(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.graphs.run(ids, mask) if self.graphs is not None else self._pooled(ids, mask)

    def _pooled(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(batch, seq) ids and pooling mask (handler/pooling.py) -> (batch, dimension) float32."""
        attention = mask.clamp(max=1)  # prompt tokens left out of pooling are still attended to
        hidden = self.transformer(ids, attention)  # (batch, seq, hidden)
        pooled = pool(hidden, mask, self.pooling.modes)  # (batch, hidden * modes)
        return pooled if self.head is None else self.head(pooled)

    def _torch_transformer(self, ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        if self._attention_mask is not None:
            attention = self._attention_mask(attention)  # (batch, 1, seq, seq): no host read
        return self.model(input_ids=ids, attention_mask=attention).last_hidden_state

    def _release_memory(self) -> None:
        release_memory(self.placement.device)

    def _pad(self, rows: list[Sequence[int]], unpooled: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-pad to the longest row, rounded up to the placement's multiple; the mask marks
        padding, pooled tokens and prompt tokens pooling leaves out (handler/pooling.py)."""
        sizes = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        length = padded_length(int(sizes.max()), self.placement.pad_multiple)
        positions = np.arange(length)
        real = positions < sizes[:, None]  # (rows, length): True on each row's own tokens
        ids = np.full((len(rows), length), self.pad_id, dtype=np.int64)
        ids[real] = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=int(sizes.sum()))  # row by row
        mask = real.astype(np.int64)
        if unpooled:
            mask[positions < np.minimum(np.asarray(unpooled, dtype=np.int64), sizes)[:, None]] = PROMPT
        return to_device(ids, self.placement.device), to_device(mask, self.placement.device)


class PaddedPasses:
    """Passes as right-padded (batch, seq) rectangles, cut at the least padding plus pass cost:
    every engine, and CUDA graphs replayed by bucket. Inputs of a pass: (ids, pooling mask)."""

    def __init__(self, encoder: Encoder):
        self.encoder = encoder

    def plan(self, lengths: list[int]) -> list[list[int]]:
        encoder = self.encoder
        replay = None if encoder.graphs is None else Replay(encoder.graphs.table, encoder.replay_overhead_tokens)
        return plan_sub_batches(lengths, encoder.placement.max_batch_tokens, encoder.max_batch_size,
                                encoder.placement.pad_multiple, encoder.pass_overhead_tokens, replay)

    def prepare(self, rows: list[Sequence[int]], unpooled: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.encoder._pad(rows, unpooled)

    def run(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.encoder._run_pass(*inputs)

    def computed_tokens(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> int:
        """What the device computed: all of its bucket's tokens where a graph replayed the pass."""
        graphs = self.encoder.graphs
        return inputs[0].numel() if graphs is None else graphs.computed_tokens(*inputs[0].shape)


def _probe_rows(pad_id: int, vocab_size: int, max_positions: int) -> list[list[int]]:
    """A few inputs of mixed lengths, random ids: one token, short, long, equal lengths."""
    generator = torch.Generator().manual_seed(0)
    lengths = [min(length, max_positions) for length in (1, 7, 7, 33, 130, 3)]
    return [[token if token != pad_id else pad_id + 1 for token in
             torch.randint(0, vocab_size, (length,), generator=generator).tolist()] for length in lengths]


def quantizable_layers(model: torch.nn.Module) -> list[str]:
    """The Linear layers int8 mode may quantize (the unused BERT pooler is left alone)."""
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and not name.startswith("pooler")]


def quantize_int8(model: torch.nn.Module, keep_fp32: Sequence[str] = ()) -> torch.nn.Module:
    """Dynamic int8 quantization (per-channel weights, activations quantized per call) of every
    quantizable Linear but those in keep_fp32. Weights shrink 4x and matmuls run on int8 kernels."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    unknown = set(keep_fp32) - set(quantizable_layers(model))
    if unknown:
        raise ValueError(f"handler setting 'int8_fp32_layers': no such Linear layer(s): {', '.join(sorted(unknown))}")
    chosen = {name: per_channel_dynamic_qconfig for name in quantizable_layers(model) if name not in keep_fp32}
    with warnings.catch_warnings():  # torch points eager quantization users at torchao on every call
        warnings.simplefilter("ignore")
        return quantize_dynamic(model, chosen, dtype=torch.qint8)


def resolve_max_length(setting: int, st_max_seq_length: int | None, tokenizer_limit: int | None,
                       max_positions: int | None) -> int:
    """The token limit per input: the setting, else sentence-transformers' max_seq_length (which
    it applies over the tokenizer's own limit), else the tokenizer's; never beyond the positions
    the architecture can use (XLM-R: 512 of its 514 position embeddings)."""
    positions = max_positions or 10**9
    if setting:
        if setting > positions:
            raise ValueError(f"handler setting 'max_length': {setting} exceeds the {positions} positions this "
                             "model can use")
        return setting
    if not tokenizer_limit or tokenizer_limit > 10**6:  # transformers' "no limit" sentinel
        tokenizer_limit = positions
    return min(st_max_seq_length or tokenizer_limit, positions)
