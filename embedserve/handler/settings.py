"""Handler settings: the `handler:` section of model-config.yaml, validated once at start-up.

A bad value raises SettingsError naming the key, so the worker stops with a message an
operator can act on instead of failing later on the first request.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from embedserve.handler.model.description import POOLING_MODES

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "float16", "bfloat16", "int8")
ENGINES = ("auto", "torch", "onnxruntime", "openvino")
BF16_ENGINES = ("torch", "openvino")
POOLINGS = ("auto", *POOLING_MODES)
AUTO_SWITCHES = ("cuda_graphs", "packed")  # true, false, or auto: on a GPU, off elsewhere


class SettingsError(ValueError):
    """A setting in the `handler:` section is unknown or has an invalid value."""

    def __init__(self, key: str, problem: str):
        super().__init__(f"handler setting '{key}': {problem}")
        self.key = key


@dataclass(frozen=True)
class Settings:
    # Where the model files live, relative to the unpacked .mar.
    model_path: str = "model"
    # "auto": the GPU the server assigned to this worker when CUDA is available, else CPU.
    device: str = "auto"
    # "auto": float16 on CUDA (bfloat16 for checkpoints saved in it); on a CPU float32, or
    # bfloat16 where the CPU has bf16 units and a bfloat16 engine of cpu_bf16_engines measures
    # clearly faster at start-up (embedserve/handler/execution/engine_trial.py). "int8" (CPU only): dynamic int8 quantization of
    # the matrix multiplications, calibrated at build time: ONNX Runtime's on the build's
    # transformer.int8.onnx, else torch's, of every Linear but those in int8_fp32_layers.
    dtype: str = "auto"
    # Under torch int8: the Linear layers kept in float32, chosen by the build's calibration (the
    # ones whose quantization costs the most accuracy).
    int8_fp32_layers: tuple[str, ...] = ()
    # What runs the transformer. "auto": ONNX Runtime on a CPU, for float32 or int8, where the
    # archive holds the build's export (transformer.onnx, transformer.int8.onnx), else PyTorch.
    # "torch" always; "onnxruntime" requires the export and a CPU (embedserve/handler/backends/onnx_runtime.py);
    # "openvino" the export, a CPU, float32 or bfloat16, and the openvino package
    # (embedserve/handler/backends/openvino_runtime.py).
    engine: str = "auto"
    # The bfloat16 engines (torch, openvino) a CPU worker under dtype auto may time against
    # float32: written by the build, those whose vectors it verified against float32 (min cosine
    # 0.999 on its corpus, embedserve/archive/bf16_check.py). Empty: float32 only.
    cpu_bf16_engines: tuple[str, ...] = ()
    # "auto": read from the model's sentence-transformers files, else mean; or one of
    # POOLING_MODES, which replaces the modes of the model's own Pooling module.
    pooling: str = "auto"
    normalize: bool = True
    # Token limit per input; 0 means the model's own (sentence-transformers max_seq_length,
    # else the tokenizer's limit capped by the position embeddings).
    max_length: int = 0
    # Each forward pass holds at most this many padded tokens (longest x count); 0 picks per
    # device: small passes stay in cache on a CPU, large ones fill a GPU ...
    max_batch_tokens: int = 0
    # ... and at most this many sequences.
    max_batch_size: int = 256
    # What one more forward pass costs, in padded tokens, when the planner weighs fewer passes
    # against less padding; 0 means measured at warm-up (32 when warm-up is off).
    pass_overhead_tokens: int = 0
    # Torch intra-op threads per worker; 0 means CPU cores divided by the worker count.
    cpu_threads: int = 0
    # With automatic cpu_threads, a CPU worker runs each forward pass of up to 1024 tokens on
    # every CPU no other worker is using or waiting for (embedserve/handler/worker/cpu_lending.py).
    lend_idle_cpus: bool = True
    # Run one embedding in initialize so a READY worker has really embedded.
    warmup: bool = True
    # From its first batch on, a worker reads batches from the server's socket and answers them
    # itself, in large reads and one write a batch (the adapter's wire.py), instead of through
    # the server's own Python loop; false keeps the server's loop.
    own_worker_loop: bool = True
    # Truncate inputs longer than max_length (a request may override it with `truncate`);
    # when off, a longer input is refused with 413.
    truncate: bool = True
    # A prompt prepended to every text whose request names no `prompt_name`; empty means the
    # model's default prompt (sentence-transformers `default_prompt_name`), if any.
    prompt: str = ""
    # Per-request limits, each refused with 413 naming it.
    max_inputs_per_request: int = 4096
    max_input_chars: int = 100_000  # checked before tokenizing
    max_tokens_per_request: int = 1_048_576  # after truncation, prompts included
    # The largest answer the server passes on (the build sets the server's own limit so the limits
    # above fit at the model's dimension): a request whose answer could be larger is refused with
    # 413 before anything is computed, instead of the frontend dropping the worker.
    max_response_bytes: int = 6_553_600
    # GPU only: capture a CUDA graph per (batch, length) bucket of these ladders at start-up
    # (pairs over max_batch_tokens or the position embeddings are skipped) and replay it for
    # passes that fit a bucket; a bucket whose pass needs more than cuda_graph_max_mb runs eagerly,
    # and a model whose forward synchronizes, or a failed capture, leaves every pass eager
    # (embedserve/handler/backends/cuda_graphs.py). Packed passes are captured per size
    # in total tokens instead (embedserve/handler/backends/packed_graphs.py). auto: on a GPU (an
    # H100 measured batch-1 latency 6x lower, docs/gpu.md), off elsewhere; ignored on a CPU.
    cuda_graphs: bool | str = "auto"
    cuda_graph_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    cuda_graph_lengths: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
    cuda_graph_max_mb: int = 2048
    # torch.compile the model (dynamic shapes); start-up takes longer.
    compile: bool = False
    # Run passes packed (embedserve/handler/backends/packed.py): the real tokens of a pass concatenated, no padding
    # computed, on the torch engine; used where the architecture is supported (BERT, RoBERTa,
    # XLM-R, MPNet) and a start-up check agrees with the padded pass, else passes are padded.
    # With cuda_graphs on a GPU, packed passes replay graphs over total tokens
    # (embedserve/handler/backends/packed_graphs.py). auto: on a GPU (an H100 measured packed passes
    # with graphs 4.2x padded ones with graphs, docs/gpu.md); off on a CPU, where ONNX Runtime's
    # padded passes measured faster end to end (docs/performance.md).
    packed: bool | str = "auto"
    # Embedding cache, off by default. An in-process LRU of this many entries (0: off), bounded
    # also in memory ...
    cache_entries: int = 0
    cache_max_mb: int = 256
    # ... and/or a Redis shared by workers and replicas ("": off; redis://, rediss:// or
    # unix:// URL; the environment variable EMBEDSERVE_REDIS_URL overrides it). Entries expire
    # after redis_ttl_s. A Redis call slower than redis_timeout_ms counts as a failure; after
    # one, the worker serves uncached for redis_retry_s before trying Redis again.
    redis_url: str = ""
    redis_ttl_s: int = 86_400
    redis_timeout_ms: int = 100
    redis_retry_s: int = 10
    # An image-text model's limits on images (embedserve/handler/inputs/image.py), each refused
    # with 413 naming it: an image's file; its pixels, read from its header before any is decoded
    # (40 million is a 7,300 x 5,500 photograph, past any vision tower's input, and below Pillow's
    # own bomb threshold of 89 million, so this check decides); images a request; and the bytes of
    # a request's images its body carries, which the build lets through the server's
    # max_request_size (in base64, 4/3 of it), so that one large image is the handler's 413
    # naming the limit and not the frontend's empty one.
    max_image_bytes: int = 10 * 2**20
    max_image_pixels: int = 40_000_000
    max_images_per_request: int = 64
    max_image_request_bytes: int = 16 * 2**20
    # An image-text model's image items that are http(s) URLs are fetched from these hosts alone
    # ("images.internal", or "images.internal:8080" for that port alone); none by default, so that
    # no request makes the server reach into its network. All of a request's URLs are fetched
    # within image_url_timeout_s (embedserve/handler/inputs/image_urls.py).
    image_url_hosts: tuple[str, ...] = ()
    image_url_timeout_s: int = 10
    # What /info reports; written by the build.
    model_id: str = ""
    revision: str = ""
    workers_sizing: str = ""  # how a GPU build chose its workers per GPU (embedserve/archive/gpu_workers.py)

    @classmethod
    def from_mapping(cls, section: Mapping[str, Any] | None) -> "Settings":
        section = dict(section or {})
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(section) - set(fields))
        if unknown:
            raise SettingsError(unknown[0], f"unknown setting; known: {', '.join(sorted(fields))}")
        values = {name: _coerce(name, value, type(fields[name].default)) for name, value in section.items()}
        settings = cls(**values)
        settings._validate()
        return settings

    def _validate(self) -> None:
        if not self.model_path:
            raise SettingsError("model_path", "must not be empty")
        if not (self.device in DEVICES or self.device.startswith("cuda:")):
            raise SettingsError("device", f"'{self.device}' is not one of {', '.join(DEVICES)} or cuda:N")
        _require_choice("dtype", self.dtype, DTYPES)
        _require_choice("pooling", self.pooling, POOLINGS)
        _require_choice("engine", self.engine, ENGINES)
        if self.max_length < 0:
            raise SettingsError("max_length", "must be >= 0 (0 means the model's limit)")
        if self.max_batch_tokens < 0:
            raise SettingsError("max_batch_tokens", "must be >= 0 (0 means automatic)")
        for key in ("max_batch_size", "max_inputs_per_request", "max_input_chars", "max_tokens_per_request",
                    "max_response_bytes", "cuda_graph_max_mb", "cache_max_mb", "redis_ttl_s", "redis_timeout_ms",
                    "max_image_bytes", "max_image_pixels", "max_images_per_request", "max_image_request_bytes"):
            if getattr(self, key) < 1:
                raise SettingsError(key, "must be >= 1")
        if self.cpu_threads < 0:
            raise SettingsError("cpu_threads", "must be >= 0 (0 means automatic)")
        if self.pass_overhead_tokens < 0:
            raise SettingsError("pass_overhead_tokens", "must be >= 0 (0 means measured at warm-up)")
        if any(name not in BF16_ENGINES for name in self.cpu_bf16_engines):
            raise SettingsError("cpu_bf16_engines", f"must list only {', '.join(BF16_ENGINES)}")
        if not all(isinstance(name, str) for name in self.int8_fp32_layers):
            raise SettingsError("int8_fp32_layers", "must be a list of layer names")
        for key in ("cuda_graph_batches", "cuda_graph_lengths"):
            if not getattr(self, key) or any(not isinstance(v, int) or v < 1 for v in getattr(self, key)):
                raise SettingsError(key, "must be a non-empty list of positive integers")
        if self.cache_entries < 0:
            raise SettingsError("cache_entries", "must be >= 0 (0 turns the in-process cache off)")
        if self.redis_retry_s < 0:
            raise SettingsError("redis_retry_s", "must be >= 0")
        check_redis_url("redis_url", self.redis_url)
        for host in self.image_url_hosts:
            if not isinstance(host, str) or not host or any(mark in host for mark in ("/", "@", " ", "*")):
                raise SettingsError("image_url_hosts", f"{host!r} is not a host name, or host:port (no scheme, "
                                    "path or wildcard)")
        if self.max_image_bytes > self.max_image_request_bytes:
            raise SettingsError("max_image_bytes", f"must be at most max_image_request_bytes="
                                f"{self.max_image_request_bytes}: a request of one image that large would be refused")
        if self.image_url_timeout_s < 1:
            raise SettingsError("image_url_timeout_s", "must be >= 1")


REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def switch(value: bool | str, on_gpu: bool) -> bool:
    """A setting of true, false or auto (on a GPU, off elsewhere), resolved for a worker."""
    return on_gpu if value == "auto" else bool(value)


def check_redis_url(key: str, url: str) -> None:
    if url and not url.startswith(REDIS_SCHEMES):
        raise SettingsError(key, f"must start with {', '.join(REDIS_SCHEMES)} (or be empty to turn Redis off)")


def _require_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise SettingsError(key, f"'{value}' is not one of {', '.join(choices)}")


def _coerce(key: str, value: Any, kind: type) -> Any:
    # YAML already types most values; accept the obvious string spellings too.
    if key in AUTO_SWITCHES and isinstance(value, str) and value.lower() == "auto":
        return "auto"
    if kind is bool or key in AUTO_SWITCHES:  # otherwise true or false
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise SettingsError(key, f"expected true or false, got {value!r}")
    if kind is tuple:  # a list of strings, or of integers
        if isinstance(value, (list, tuple)) and (all(isinstance(v, str) for v in value) or all(
                isinstance(v, int) and not isinstance(v, bool) for v in value)):
            return tuple(value)
        raise SettingsError(key, f"expected a list of strings or of integers, got {value!r}")
    if kind is int:
        if isinstance(value, bool):
            raise SettingsError(key, f"expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)
        raise SettingsError(key, f"expected an integer, got {value!r}")
    if not isinstance(value, str):
        raise SettingsError(key, f"expected a string, got {value!r}")
    return value
