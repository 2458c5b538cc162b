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

The workers of one machine make one choice a model: the first to get here measures, under a file
lock, and writes the outcome where the others read it (trial_key: the archive's revision, the
candidates, worker threads, the CPU, the engines' versions and the machine's boot). A restarted
worker, a restarted server and a second server of the same archive read it too, and start without
measuring again: a trial costs a worker start about 3 s of CPU (MiniLM: 5 s), the torch model
it loads only to time it. The outcome lives in the user's cache folder (trial_directory), until
the machine restarts or the file is deleted; where that folder cannot be written, in the
server's temporary folder, for its own workers.
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
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import IO, Callable, Iterator, Mapping

import torch

from embedserve.handler.backends.base import Backend
from embedserve.handler.execution.placement import Placement
from embedserve.handler.model.inputs import ModelInput
from embedserve.handler.settings import Settings
from embedserve.handler.worker.cpu_features import bf16_units, cpu_model_name
from embedserve.handler.worker.cpu_lending import lock_directory

log = logging.getLogger(__name__)

MARGIN = 1.2
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
ENGINE_PACKAGES = ("onnxruntime", "openvino")  # torch's own version is torch.__version__
TRIAL_ROWS, TRIAL_LENGTH = 8, 64  # a full pass: 512 tokens, as the warm-up's calibration times
TRIAL_IMAGES = 4  # a vision tower's full pass
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
    best = _best_of_rounds({name: {shape: partial(backend.run, inputs[name][shape], eager=True) for shape in shapes}
                            for name, backend in backends.items()})
    return {name: Timing(round(TRIAL_ROWS * length / seconds["full"], 1), round(seconds["one"] * 1000, 3))
            for name, seconds in best.items()}


def time_image_towers(towers: Mapping[str, Callable[[torch.Tensor], torch.Tensor]], size: int,
                      positions: int) -> dict[str, Timing]:
    """Each vision tower's speed on the same pixels, timed in turns as the text backends are: a
    pass of TRIAL_IMAGES images and one image (`size` pixels square, `positions` patches each:
    a ViT's tokens)."""
    pixels = torch.randn((TRIAL_IMAGES, 3, size, size), generator=torch.Generator().manual_seed(0))
    shapes = {"full": pixels, "one": pixels[:1]}
    best = _best_of_rounds({name: {shape: partial(tower, batch) for shape, batch in shapes.items()}
                            for name, tower in towers.items()})
    return {name: Timing(round(TRIAL_IMAGES * positions / seconds["full"], 1), round(seconds["one"] * 1000, 3))
            for name, seconds in best.items()}


def _best_of_rounds(passes: Mapping[str, Mapping[str, Callable[[], object]]]) -> dict[str, dict[str, float]]:
    """Each candidate's passes run in turns, ROUNDS times after a warm-up round that is not
    counted: the fastest seconds of each (a busy neighbour only ever adds time)."""
    best = {name: {shape: float("inf") for shape in shapes} for name, shapes in passes.items()}
    with torch.inference_mode():
        for round_ in range(ROUNDS + 1):
            for name, shapes in passes.items():
                for shape, run in shapes.items():
                    started = time.perf_counter()
                    run()
                    if round_:
                        best[name][shape] = min(best[name][shape], time.perf_counter() - started)
    return best


def choose(timings: Mapping[str, Timing], default: str, one: str = "text") -> tuple[str, str]:
    """The candidate to serve, and why: the fastest challenger by tokens/s where it clears the
    margin (module docstring), else the default."""
    base = timings[default]
    challengers = sorted((name for name in timings if name != default), key=lambda n: -timings[n].tokens_per_s)
    for name in challengers:
        timing = timings[name]
        speedup, latency = timing.tokens_per_s / base.tokens_per_s, timing.one_text_ms / base.one_text_ms
        if speedup >= MARGIN and latency <= MARGIN:
            return name, f"measured: {name} ran {speedup:.2f}x {default}'s tokens/s (one {one}: {latency:.2f}x " \
                         f"its time)"
    if not challengers:
        return default, f"measured: {default}, the only candidate"
    best = challengers[0]
    ratio = timings[best].tokens_per_s / base.tokens_per_s
    return default, f"measured: {default}; the fastest challenger ({best}) ran {ratio:.2f}x its tokens/s, short " \
                    f"of the {MARGIN}x margin, or slower on one {one}"


def trial_key(model_dir: Path, settings: Settings, placement: Placement, names: list[str]) -> str:
    """What makes two workers' trials the same: the model, its candidates, the worker's threads,
    the CPU, the engines' versions and the machine's boot. An archive's revision names its
    files wherever it is unpacked; a folder without one is keyed by its path and the server
    process (its files may change under the same path)."""
    model = [settings.revision] if settings.revision else [str(Path(model_dir).resolve()), os.getppid()]
    facts = [*model, *names, placement.cpu_threads, placement.lend_cpus, cpu_model_name(), torch.__version__,
             *map(_version, ENGINE_PACKAGES), _boot_id()]
    return hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:16]


def trial_directory() -> Path | None:
    """The cache folder every server of this user on this machine shares: EMBEDSERVE_CACHE_DIR,
    else the user's cache folder (XDG_CACHE_HOME, else ~/.cache); None for a user without a home
    (a container's arbitrary user id)."""
    cache = os.environ.get("EMBEDSERVE_CACHE_DIR")
    if not cache:
        try:
            cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "embedserve"
        except (RuntimeError, KeyError):
            return None
    return Path(cache) / "engine-trials"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""


def _boot_id() -> str:
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


# Ends the reason of a choice read from the record rather than measured.
READ_FROM_RECORD = "by an earlier worker on this machine"


class SharedTrial:
    """The trial's outcome in a file beside its lock: `recorded` holds what the first worker
    wrote, or None, in which case this worker measures and `record`s."""

    def __init__(self, path: Path | None):
        self.path = path  # None: not shared
        self.recorded: dict | None = None

    def recorded_choice(self, names: list[str]) -> str | None:
        """The recorded choice where it is one of `names` (a record of other candidates is not one)."""
        choice = (self.recorded or {}).get("choice")
        return choice if choice in names else None

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
    the first's outcome). In the user's cache folder, else the server's temporary folder;
    without either every worker measures for itself."""
    lock, directory = _open_lock(key, [directory] if directory else [trial_directory(), lock_directory()])
    if lock is None:
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


def _open_lock(key: str, directories: list[Path | None]) -> tuple[IO[bytes] | None, Path | None]:
    """The trial's lock file in the first of `directories` that can hold it."""
    problem: OSError | str = "no folder"
    for directory in filter(None, directories):
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            return open(directory / f"engine-trial-{key}.lock", "ab"), directory
        except OSError as err:
            problem = err
    log.warning("engine trial not shared with the other workers: %s", problem)
    return None, None
