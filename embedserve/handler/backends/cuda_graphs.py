"""CUDA graph capture and replay of the encoder's forward pass and pooling, per shape bucket.

A short forward pass on a GPU is dominated by kernel launches from Python; a captured graph
replays all of them at once. Graphs have fixed shapes, so one graph is captured per (batch,
sequence) bucket of a ladder, on static input and output buffers. A pass is padded up to the
smallest bucket that holds it: extra rows and columns are masked out, so the real rows equal the
eager result, and the device computes every token of the bucket (the planner, embedserve/handler/scheduling/planner.py,
prices passes at their bucket's tokens, and the padded-token count includes them). A pass that
no bucket holds runs eagerly.

At start-up, on the worker's own GPU (the current device, a side stream and a memory pool of
it), in three steps:

1. Warm-up, smallest bucket first: each bucket's pass runs eagerly, measuring the memory it
   needs. The graphs share one pool and are captured largest first, so together they hold about
   what the largest one needs: a bucket that needs more than the memory cap runs eagerly, so the
   cap drops the largest buckets and keeps the small ones.
   Before any capture, the smallest pass runs once more with host synchronizations made errors
   (`forward_synchronizes`): a forward that reads the device from the host or copies host memory
   in (MPNet's position bias, a data-dependent check of a mask) cannot be captured, so such a
   model gets no graphs, with a warning naming what synchronized.
2. Capture, largest first. If a capture fails anyway (an operation a capturing stream refuses,
   or out of memory), no graph is kept and every pass runs eagerly, with a warning naming the
   bucket and the error. The allocator may still be recording into the failed capture's pool
   then (`capture_end` raises before it stops), so nothing is captured after it, and the cache
   is never emptied again in this process (`release_memory`): `empty_cache` can trip the
   allocator's internal assert in that state and kill the worker.
3. Check: every graph replays two distinct random passes padded into it; each must equal the
   eager pass, and the two must differ (an empty capture replays stale output). If any graph
   fails, every graph is dropped and the worker runs eagerly, with an error in the log.

The three steps (`StaticPass`, `capture_checked`) know nothing of the pass's layout: packed
passes use them for their graphs over total tokens (embedserve/handler/backends/packed_graphs.py).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from embedserve.handler.scheduling.planner import BucketTable

log = logging.getLogger(__name__)

# Pooled output of one forward pass: (ids, mask) -> (batch, hidden).
Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# How far a replayed vector may lie from the eager one, relative to its norm: padding changes the
# shapes the kernels run at, hence their rounding, the more so in half precision. bfloat16 keeps
# 3 fewer mantissa bits than float16, so its rounding is up to 8x coarser; 1.5e-2 still refuses
# a replay that strays by 2% (a cosine of 0.9998 to eager), which rounding alone does not do
# (tests/unit/backends/test_cuda_graphs.py measures padding's effect on CPU).
REPLAY_TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 1.5e-2}

# Set once a capture has failed in this process, for the rest of its life: see release_memory.
capture_failed = False


@dataclass(frozen=True, order=True)
class Bucket:
    batch: int
    length: int

    @property
    def tokens(self) -> int:
        return self.batch * self.length

    def __str__(self) -> str:
        return f"{self.batch}x{self.length}"


def ladder(batches: Sequence[int], lengths: Sequence[int], max_tokens: int) -> list[Bucket]:
    """Every (batch, length) pair within the padded-token budget, largest first."""
    buckets = {Bucket(b, n) for b in batches for n in lengths if b * n <= max_tokens}
    return sorted(buckets, key=lambda bucket: (bucket.tokens, bucket), reverse=True)


def choose(buckets: Sequence[Bucket], batch: int, length: int) -> Bucket | None:
    """The bucket that holds (batch, length) with the fewest padded tokens, or None."""
    fitting = [b for b in buckets if b.batch >= batch and b.length >= length]
    return min(fitting, key=lambda b: (b.tokens, b.length), default=None)


class StaticPass:
    """One captured shape: static input buffers on `device`, and a replay that leaves the pass's
    output in `output`. A subclass makes the buffers and says what `compute` runs on them;
    `bucket` names the shape and its `tokens`."""

    def __init__(self, bucket: object, device: torch.device):
        self.bucket = bucket
        self.device = device
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: torch.Tensor | None = None

    def compute(self) -> torch.Tensor:
        """The eager pass over the static buffers: what the graph records."""
        raise NotImplementedError

    def warm_up(self) -> int:
        """Run the pass eagerly on the current stream, as capture requires (lazy initialization
        happens outside it); return the most memory the pass held at once, in bytes."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        for _ in range(2):
            self.compute()
        return torch.cuda.max_memory_allocated(self.device) - before

    def capture(self, pool: object) -> None:
        """Capture the pass on the current stream into the memory pool `pool`. On failure the
        pass's own error is raised, with the stream out of capture mode again."""
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=pool)
        try:
            output = self.compute()
        except BaseException:
            with suppress(RuntimeError):  # ending an invalidated capture raises an error of its own
                graph.capture_end()
            raise
        graph.capture_end()
        self.graph, self.output = graph, output

    def replay(self) -> None:
        self.graph.replay()


class StaticGraph(StaticPass):
    """One (batch, length) bucket of padded passes: static ids and mask, the pooled output."""

    def __init__(self, bucket: Bucket, forward: Forward, pad_id: int, device: torch.device):
        super().__init__(bucket, device)
        self.pad_id = pad_id
        self.ids = torch.full((bucket.batch, bucket.length), pad_id, dtype=torch.long, device=device)
        self.mask = torch.zeros_like(self.ids)
        self.mask[:, 0] = 1  # rows that carry no input still attend to one token: no NaNs
        self.forward = forward

    def compute(self) -> torch.Tensor:
        return self.forward(self.ids, self.mask)

    def run(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Copy the pass into the static buffers, replay, and return the real rows."""
        rows, length = ids.shape
        self.ids.fill_(self.pad_id)
        self.mask.zero_()
        self.mask[:, 0] = 1
        self.ids[:rows, :length].copy_(ids)
        self.mask[:rows, :length].copy_(mask)
        self.replay()
        return self.output[:rows]


class Captured(dict):
    """The graphs captured and trusted, by bucket; where there are none, `why_none` says why (for
    /info: a user asks why a worker runs eagerly)."""

    def __init__(self, graphs: dict | None = None, why_none: str | None = None):
        super().__init__(graphs or {})
        self.why_none = why_none


class GraphRunner:
    """The captured buckets of one encoder, and the choice between replay and eager."""

    def __init__(self, graphs: Captured, forward: Forward):
        self.graphs = graphs
        self.forward = forward  # the eager path, for passes that fit no bucket
        self.buckets = sorted(graphs)
        self.table = BucketTable((b.batch, b.length) for b in self.buckets)  # for the planner
        self.replays = 0
        self.eager = 0

    @classmethod
    def capture(cls, forward: Forward, buckets: Sequence[Bucket], *, pad_id: int, vocab_size: int,
                device: torch.device, max_bytes: int, tolerance: float,
                graph_type: type[StaticGraph] = StaticGraph) -> "GraphRunner":
        """The graphs of the buckets whose pass needs at most max_bytes and whose capture works,
        on `device`; none at all if a replay strays from eager by more than `tolerance`."""
        generator = torch.Generator().manual_seed(0)

        def random_pass(graph: StaticGraph) -> tuple[torch.Tensor, torch.Tensor]:
            """A pass leaving some of the bucket's rows and columns as padding: replayed, eager."""
            ids, mask = _random_pass(graph.bucket, vocab_size, pad_id, generator, graph.ids.device)
            return graph.run(ids, mask).clone(), forward(ids, mask)

        graphs = (graph_type(bucket, forward, pad_id, device) for bucket in buckets)
        return cls(capture_checked(graphs, device, max_bytes, random_pass, tolerance), forward)

    def computed_tokens(self, rows: int, length: int) -> int:
        """Tokens the device computes for a (rows, length) pass: its bucket's if one holds it (the
        planner's own table), else its own."""
        return self.table.bucket_tokens(rows, length) or rows * length

    def run(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Pooled output of the pass: a view of a static buffer, valid until the next replay."""
        bucket = choose(self.buckets, *ids.shape)
        if bucket is None:
            self.eager += 1
            return self.forward(ids, mask)
        self.replays += 1
        return self.graphs[bucket].run(ids, mask)


def _capture_all(graphs: Sequence[StaticPass], device: torch.device, max_bytes: int) -> Captured:
    """Warm up, then capture, the static passes of `device` (steps 1 and 2 above): their
    buckets -> the graphs captured; none, with a warning and the reason, if the forward
    synchronizes or a capture fails."""
    smallest_first = sorted(graphs, key=lambda graph: (graph.bucket.tokens, graph.bucket))
    captured: dict = {}
    with _side_stream(device):
        affordable = [graph for graph in smallest_first if _warmed_up_within(graph, max_bytes)]
        release_memory(device)  # what the warm-ups cached, for the graphs' pool to take
        # Only a real capture needs the check: the tests' CPU stand-ins replay eagerly.
        synchronizes = forward_synchronizes(affordable[0].compute, device) \
            if affordable and device.type == "cuda" else None
        if synchronizes is not None:
            why = f"this model's forward pass {synchronizes}, which a capture refuses"
            log.warning("CUDA graphs: none: %s; every pass runs eagerly", why)
            return Captured(why_none=why)
        if not affordable:
            return Captured(why_none="every bucket's warm-up failed or needed more than cuda_graph_max_mb")
        pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        # Largest first: the first graph sizes the shared pool, the later ones fit inside it.
        for graph in reversed(affordable):
            failure = _capture_failure(graph, pool)
            if failure is not None:  # the graphs captured so far go with this dict; their pool stays cached
                return Captured(why_none=f"the capture of bucket {graph.bucket} failed ({failure})")
            captured[graph.bucket] = graph
    shown = sorted(captured)
    if len(shown) > 12:  # packed ladders hold about a thousand sizes: the ends say enough
        shown = [*shown[:3], "...", *shown[-3:]]
    log.info("CUDA graphs: captured %d of %d buckets: %s", len(captured), len(graphs),
             ", ".join(map(str, shown)) or "none")
    return Captured(captured)


def capture_checked(graphs: Iterable[StaticPass], device: torch.device, max_bytes: int,
                    random_pass: Callable[[StaticPass], tuple[torch.Tensor, torch.Tensor]], tolerance: float
                    ) -> Captured:
    """Steps 1 to 3 on `device`, made current first: the graphs captured and trusted, by bucket;
    none, with an error in the log, if any of them fails the check. `graphs` is made lazily, so
    on that device and held by nothing else. `random_pass(graph)` replays a random pass that
    leaves the graph padding and returns (a copy of the replayed output, the eager output)."""
    with _current(device):
        captured = _capture_all(list(graphs), device, max_bytes)
        failure = _replay_failure(captured.values(), random_pass, tolerance)
    if failure is None:
        return captured
    log.error("CUDA graphs: %s; every graph is dropped and these passes run eagerly", failure)
    del captured  # nothing holds the graphs' memory any more: release it
    release_memory(device)
    return Captured(why_none=f"dropped: {failure}")


def _replay_failure(graphs: Iterable[StaticPass], random_pass: Callable[[StaticPass], tuple[torch.Tensor, torch.Tensor]],
                    tolerance: float) -> str | None:
    """Why the graphs cannot be trusted, or None: each replays two random passes; both must equal
    the eager pass, and differ from each other (an empty capture replays stale output)."""
    for graph in graphs:
        replayed = []
        for _ in range(2):
            output, eager = random_pass(graph)
            error = relative_error(output, eager)
            if not error <= tolerance:
                return f"bucket {graph.bucket} replays a pass unlike the eager pass (error {error:.3g})"
            replayed.append(output)
        rows = min(len(output) for output in replayed)  # packed passes may differ in inputs
        if relative_error(replayed[0][:rows], replayed[1][:rows]) <= tolerance:
            return f"bucket {graph.bucket} replays two distinct inputs to the same output"
    return None


def _warmed_up_within(graph: StaticGraph, max_bytes: int) -> bool:
    try:
        needed = graph.warm_up()
    except Exception as err:  # out of memory, most likely; whatever the cause, this bucket runs eagerly
        log.warning("CUDA graphs: bucket %s runs eagerly: warm-up failed (%s)", graph.bucket, _one_line(err))
        release_memory(graph.device)
        return False
    if needed > max_bytes:
        log.warning("CUDA graphs: bucket %s runs eagerly: its pass needs %d MiB, over the %d MiB cap",
                    graph.bucket, needed >> 20, max_bytes >> 20)
        return False
    return True


def _capture_failure(graph: StaticPass, pool: object) -> str | None:
    """None once `graph` is captured; else why not."""
    global capture_failed
    try:
        graph.capture(pool)
    except Exception as err:  # whatever the cause: no graphs for this worker
        capture_failed = True
        log.warning("CUDA graphs: none for this worker: the capture of bucket %s failed (%s); every pass "
                    "runs eagerly", graph.bucket, _one_line(err))
        return _one_line(err)
    return None


def forward_synchronizes(run: Callable[[], object], device: torch.device) -> str | None:
    """Run `run()` once; None if it made the host wait for the device, else what did, in a few
    words. On CUDA, torch's sync-debug mode turns every synchronizing call into an error; on any
    device, the operators that read a tensor into Python or copy between host and `device` are
    recorded (a CPU has no stream to capture, but the same reads show there)."""
    reads = _HostReads(device)
    on_cuda = device.type == "cuda"
    previous = torch.cuda.get_sync_debug_mode() if on_cuda else 0
    try:
        with reads:
            if on_cuda:
                torch.cuda.set_sync_debug_mode("error")
            try:
                run()
            finally:
                if on_cuda:
                    torch.cuda.set_sync_debug_mode(previous)
    except RuntimeError as err:
        if "synchroniz" not in str(err):
            raise
        return f"synchronizes with the host ({_one_line(err)})"
    return None if not reads.found else f"reads the device from the host ({', '.join(sorted(reads.found))})"


class _HostReads(TorchDispatchMode):
    """Records the operators of a pass that make the host wait: a tensor read into Python
    (`.item()`, `bool()`, `.all()` in an `if`), an output sized by the data, and copies between
    the host and `device` (a host tensor made inside the forward and moved to the GPU)."""

    READS = {"aten::item", "aten::is_nonzero", "aten::_local_scalar_dense", "aten::equal", "aten::nonzero",
             "aten::masked_select", "aten::unique_consecutive", "aten::_unique2"}
    COPIES = {"aten::_to_copy", "aten::copy_"}

    def __init__(self, device: torch.device):
        super().__init__()
        self.device_type = device.type
        self.found: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        if name in self.READS:
            self.found.add(name.removeprefix("aten::"))
        elif name in self.COPIES and self.device_type != "cpu":
            devices = {t.device.type for t in (*args[:2], out) if isinstance(t, torch.Tensor)}
            if "cpu" in devices and self.device_type in devices:
                self.found.add("a copy between host and device")
        return out


def _random_pass(bucket: Bucket, vocab_size: int, pad_id: int, generator: torch.Generator,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids, (rows, length) one short of the bucket in each dimension it has to spare, each
    row of a random length (the first one full): padding everywhere the bucket allows."""
    rows, length = max(1, bucket.batch - 1), max(1, bucket.length - 1)
    sizes = torch.randint(1, length + 1, (rows, 1), generator=generator)
    sizes[0] = length
    real = torch.arange(length) < sizes  # (rows, length)
    ids = torch.randint(vocab_size, (rows, length), generator=generator).masked_fill(~real, pad_id)
    return ids.to(device), real.long().to(device)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest distance between a row of `a` and the same row of `b`, relative to the latter's norm."""
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1).clamp(min=1e-12)).max())


@contextmanager
def _current(device: torch.device) -> Iterator[None]:
    """`device` current for the block: new streams and kernels without a device of their own land
    on it, not on GPU 0. Nothing for the tests' CPU stand-ins."""
    with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
        yield


@contextmanager
def _side_stream(device: torch.device) -> Iterator[None]:
    """A fresh stream of `device`, current for the block: warm-up and capture must run off the
    default stream, and all captures that share a pool on the same one."""
    if device.type != "cuda":
        yield
        return
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # the static buffers were filled there
    with torch.cuda.stream(stream):
        yield
    torch.cuda.current_stream(device).wait_stream(stream)


def release_memory(device: torch.device) -> None:
    """Hand the allocator's cached blocks of `device` back to the driver; never after a capture
    has failed in this process (see step 2 above): then what is cached stays cached."""
    if device.type == "cuda" and not capture_failed:
        torch.cuda.empty_cache()


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"
