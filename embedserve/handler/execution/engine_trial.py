"""Which engine a CPU worker serves, measured on the machine it landed on.

The CPUs these servers run on differ: on an AVX2-only CPU bfloat16 is emulated and slower than
float32, on one with AVX512-BF16 or AMX units it is 1.4x to 3.6x faster (docs/performance.md).
No single default is right for both, so under `dtype: auto` a CPU worker with bf16 units times
the float32 default against the bfloat16 engines its archive carries (those the build verified
against float32: embedserve/archive/bf16_check.py) and serves the fastest, but leaves float32
only by a clear margin, so noise cannot flip the choice:

- the same passes for every candidate, in turns, the fastest of ROUNDS kept (a busy neighbour
  only ever adds time): a pass of TRIAL_ROWS x TRIAL_LENGTH tokens, and one text of
  TRIAL_LENGTH tokens;
- a challenger wins if its tokens/s on the full pass are at least MARGIN times the default's
  and one text takes it no more than MARGIN times as long.

The workers of one server make one choice: the first to get here measures, under a file lock,
and writes the outcome where the others read it (per model, worker threads and server
process). A restarted worker reads it too, and starts without measuring again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Mapping

import torch

from embedserve.handler.backends.base import Backend
from embedserve.handler.execution.placement import Placement
from embedserve.handler.model.inputs import ModelInput
from embedserve.handler.settings import Settings
from embedserve.handler.worker.cpu_features import bf16_units, cpu_model_name
from embedserve.handler.worker.cpu_lending import lock_directory

log = logging.getLogger(__name__)

MARGIN = 1.2
TRIAL_ROWS, TRIAL_LENGTH = 8, 64  # a full pass: 512 tokens, as the warm-up's calibration times
ROUNDS = 3


@dataclass(frozen=True)
class Candidate:
    engine: str  # onnxruntime, torch, openvino
    dtype: torch.dtype

    @property
    def name(self) -> str:
        return f"{self.engine} {str(self.dtype).removeprefix('torch.')}"


@dataclass(frozen=True)
class Timing:
    tokens_per_s: float  # a TRIAL_ROWS x TRIAL_LENGTH pass, on the worker's own threads
    one_text_ms: float  # one text of TRIAL_LENGTH tokens


def bf16_challengers(settings: Settings, placement: Placement,
                     flags: frozenset[str] | None = None) -> tuple[list[str], str]:
    """The bfloat16 engines to time against the float32 default on this worker (whose CPU has
    `flags`, by default read from it), and why there are none, for /info's selected_by.dtype."""
    units = bf16_units(flags)
    if settings.dtype != "auto":
        return [], "the dtype setting"
    if placement.device.type != "cpu":
        return [], "auto: half precision on a GPU"
    if not units:
        return [], "auto: float32, as this CPU has no bfloat16 units (amx_bf16, avx512_bf16)"
    if settings.engine != "auto" or placement.compile or placement.packed:
        return [], "auto: float32 (bfloat16 is timed only with the engine, compile and packed settings at " \
                   "their defaults)"
    if not settings.cpu_bf16_engines:
        return [], f"auto: float32; this CPU has {units}, but the archive carries no bfloat16 engine its build " \
                   "verified (rebuild it with this version's build_mar.sh)"
    return list(settings.cpu_bf16_engines), ""


def time_candidates(backends: Mapping[str, Backend], pad_id: int, max_positions: int | None) -> dict[str, Timing]:
    """Each backend's speed on the same passes, timed in turns (see the module's docstring)."""
    length = min(TRIAL_LENGTH, max_positions or TRIAL_LENGTH)
    shapes = {"full": (TRIAL_ROWS, length), "one": (1, length)}
    inputs = {name: {shape: backend.prepare([ModelInput([pad_id] * cols)] * rows)
                     for shape, (rows, cols) in shapes.items()} for name, backend in backends.items()}
    best = {name: {shape: float("inf") for shape in shapes} for name in backends}
    with torch.inference_mode():
        for round_ in range(ROUNDS + 1):  # round 0 warms each shape up and is not counted
            for name, backend in backends.items():
                for shape in shapes:
                    started = time.perf_counter()
                    backend.run(inputs[name][shape], eager=True)
                    if round_:
                        best[name][shape] = min(best[name][shape], time.perf_counter() - started)
    return {name: Timing(round(TRIAL_ROWS * length / seconds["full"], 1), round(seconds["one"] * 1000, 3))
            for name, seconds in best.items()}


def choose(timings: Mapping[str, Timing], default: str) -> tuple[str, str]:
    """The candidate to serve, and why: the fastest challenger by tokens/s where it clears the
    margin (module docstring), else the default."""
    base = timings[default]
    challengers = sorted((name for name in timings if name != default), key=lambda n: -timings[n].tokens_per_s)
    for name in challengers:
        timing = timings[name]
        speedup, latency = timing.tokens_per_s / base.tokens_per_s, timing.one_text_ms / base.one_text_ms
        if speedup >= MARGIN and latency <= MARGIN:
            return name, f"measured: {name} ran {speedup:.2f}x {default}'s tokens/s (one text: {latency:.2f}x " \
                         f"its time)"
    if not challengers:
        return default, f"measured: {default}, the only candidate"
    best = challengers[0]
    ratio = timings[best].tokens_per_s / base.tokens_per_s
    return default, f"measured: {default}; the fastest challenger ({best}) ran {ratio:.2f}x its tokens/s, short " \
                    f"of the {MARGIN}x margin, or slower on one text"


def trial_key(model_dir: Path, settings: Settings, placement: Placement, names: list[str]) -> str:
    """What makes two workers' trials the same: the model, its candidates, the worker's threads,
    the CPU and the server process (the server starts every worker, restarts included, from
    its frontend process)."""
    facts = [str(Path(model_dir).resolve()), settings.revision, *names, placement.cpu_threads, placement.lend_cpus,
             cpu_model_name(), torch.__version__, os.getppid()]
    return hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:16]


class SharedTrial:
    """The trial's outcome in a file beside the CPU-lending locks: `recorded` holds what the
    first worker wrote, or None, in which case this worker measures and `record`s."""

    def __init__(self, path: Path | None):
        self.path = path  # None: not shared
        self.recorded: dict | None = None

    def record(self, choice: str, reason: str, timings: Mapping[str, Timing]) -> None:
        if self.path is None:
            return
        outcome = {"choice": choice, "reason": reason, "timings": {n: asdict(t) for n, t in timings.items()},
                   "pid": os.getpid()}
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(outcome))
        temporary.replace(self.path)  # readers never see half a file


@contextmanager
def shared_trial(key: str, directory: Path | None = None) -> Iterator[SharedTrial]:
    """Hold the trial's lock while the caller measures or reads (a second worker waits here for
    the first's outcome). Without a usable lock directory every worker measures for itself."""
    directory = directory or lock_directory()
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        lock = open(directory / f"engine-trial-{key}.lock", "ab")
    except OSError as err:
        log.warning("engine trial not shared with the other workers: %s", err)
        yield SharedTrial(None)
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        trial = SharedTrial(directory / f"engine-trial-{key}.json")
        try:
            trial.recorded = json.loads(trial.path.read_text())
        except (OSError, ValueError):
            trial.recorded = None
        yield trial
