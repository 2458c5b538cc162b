"""The encoder: token ids in any order in, pooled float32 vectors in the same order out, through
the one backend the worker runs (embedserve/handler/backends/base.py; chosen by embedserve/handler/execution/select.py).

It keeps only what every backend shares:
- Passes: the backend plans them at the least cost (embedserve/handler/scheduling/planner.py), then each is prepared
  and run; the vectors gather on the device and are read back once per batch.
- Memory: a pass that runs out of memory (CUDA OOM; on a CPU, the allocator's RuntimeError or
  MemoryError) is split in two and retried, down to single inputs; only an input that does not
  fit alone fails, and the caller answers its request alone with 507.
- Device failures: any other CUDA error may have poisoned the process's CUDA context, so it is
  raised as DeviceFailure for the worker to exit and be replaced (embedserve/handler/execution/device_errors.py).
- CPU lending: on a CPU, small passes also borrow the CPUs other workers leave idle
  (embedserve/handler/worker/cpu_lending.py).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import numpy as np
import torch

from embedserve.handler.backends.base import Backend, PassCost
from embedserve.handler.backends.cuda_graphs import release_memory
from embedserve.handler.execution.calibration import Speed, measure_speed
from embedserve.handler.execution.device_errors import is_out_of_memory, raise_classified
from embedserve.handler.execution.placement import Placement
from embedserve.handler.model.description import Pooling
from embedserve.handler.model.inputs import ModelInput, distinct_tokens
from embedserve.handler.scheduling.cache import RowCodec
from embedserve.handler.worker.cpu_lending import CpuLending
from embedserve.handler.worker.transfer import to_device

log = logging.getLogger(__name__)

# A pass of at most this many padded tokens borrows idle CPUs: it ends within about 150 ms on
# two CPU cores, the longest an owner then waits to get its CPU back.
LEND_MAX_TOKENS = 1024


class DenseRows:
    """A batch's pass outputs gathered on the device into one (items, dimension) float32 block,
    read back once."""

    def __init__(self, items: int, dimension: int, device: torch.device):
        self.items = items
        self.dimension = dimension
        self.device = device
        self.block: torch.Tensor | None = None  # made at the first put, or taken from it

    def put(self, indices: Sequence[int], rows: torch.Tensor) -> None:
        if self.block is None:
            if self.device.type == "cpu" and rows.shape == (self.items, self.dimension) \
                    and rows.dtype == torch.float32 and rows.is_contiguous() and list(indices) == list(range(self.items)):
                # One CPU pass of every item in order (a small batch's usual case): its rows are
                # the block. A CPU pass's output is its own; the zeros and the copy would cost more
                # than the pass's pooling.
                self.block = rows
                return
            self.block = torch.zeros((self.items, self.dimension), dtype=torch.float32, device=self.device)
        # A copy on the device: a replayed graph's output buffer is overwritten by the next.
        self.block[to_device(np.asarray(indices, dtype=np.int64), self.block.device)] = rows

    def result(self) -> torch.Tensor:
        if self.block is None:  # no pass ran (no inputs, or none fitted in memory)
            self.block = torch.zeros((self.items, self.dimension), dtype=torch.float32, device=self.device)
        return Encoder.to_host(self.block)

    @staticmethod
    def codec(dimension: int) -> RowCodec:
        """How the cache keeps these rows (scheduling/cache.py): a vector an item."""
        return RowCodec("dense", ((dimension,),), split=lambda block: list(block.numpy()),
                        join=lambda rows: torch.from_numpy(np.stack(rows)))


class SparseRows:
    """A batch's vocabulary-wide rows (SPLADE) kept as their non-zero entries only, pass by pass:
    a (2, entries) float32 array per item, token ids (ascending) over weights. Ids are below 2**24,
    exact in float32. An item that did not fit keeps no entry."""

    def __init__(self, items: int, dimension: int, device: torch.device):
        self.rows = [np.zeros((2, 0), dtype=np.float32)] * items

    def put(self, indices: Sequence[int], rows: torch.Tensor) -> None:
        where = rows.nonzero()  # (entries, 2): row, id; row-major, so ids ascend within a row
        entries = torch.stack((where[:, 1].to(torch.float32), rows[where[:, 0], where[:, 1]]))
        counts = torch.bincount(where[:, 0], minlength=rows.shape[0])
        host = Encoder.to_host(entries).numpy()  # one read back a pass, of its entries only
        for index, part in zip(indices, np.split(host, np.cumsum(Encoder.to_host(counts).numpy())[:-1], axis=1)):
            self.rows[index] = part

    def result(self) -> list[np.ndarray]:
        return self.rows

    @staticmethod
    def codec(dimension: int) -> RowCodec:
        """How the cache keeps these rows (scheduling/cache.py): an item's ids over its weights."""
        return RowCodec("sparse", ((2, None),))


class TokenRows:
    """A batch's per-token outputs (a multi-vector model, model/multi_vector.py): a (tokens,
    dimension) float32 array per item, its tokens in order."""

    def __init__(self, items: int, dimension: int, device: torch.device):
        self.rows = [np.zeros((0, dimension), dtype=np.float32)] * items

    def put(self, indices: Sequence[int], rows: Any) -> None:
        vectors, lengths = Encoder.to_host(rows.vectors).numpy(), Encoder.to_host(rows.lengths).numpy()
        for index, row, length in zip(indices, vectors, lengths):
            self.rows[index] = row[:int(length)].copy()

    def result(self) -> list[np.ndarray]:
        return self.rows

    @staticmethod
    def codec(dimension: int) -> RowCodec:
        """How the cache keeps these rows (scheduling/cache.py): an item's token vectors."""
        return RowCodec("tokens", ((None, dimension),))


class HybridVectors(NamedTuple):
    """A batch's bge-m3 outputs, item by item: dense rows, sparse entries ((2, entries) float32:
    token ids over weights, merged by id) and ColBERT vectors ((tokens - 1, dimension) float32)."""
    dense: torch.Tensor
    sparse: list[np.ndarray]
    colbert: list[np.ndarray]

    def __getitem__(self, items: slice) -> "HybridVectors":  # type: ignore[override]
        return HybridVectors(self.dense[items], self.sparse[items], self.colbert[items])

    def __len__(self) -> int:
        return len(self.dense)

    def finite(self) -> list[bool]:
        dense = torch.isfinite(self.dense).all(dim=1).tolist()
        return [ok and bool(np.isfinite(sparse).all() and np.isfinite(colbert).all())
                for ok, sparse, colbert in zip(dense, self.sparse, self.colbert)]


class HybridRows:
    """A batch's bge-m3 outputs (model/m3.py), kept item by item: the dense rows in one block, each
    item's token weights merged by token id (the largest; `unused` ids, the tokenizer's cls, eos,
    pad and unk, left out; zero weights dropped), its ColBERT vectors of the tokens after the first."""

    def __init__(self, items: int, dimension: int, device: torch.device, *, unused: frozenset[int]):
        self.dense = DenseRows(items, dimension, device)
        self.sparse = [np.zeros((2, 0), dtype=np.float32)] * items
        self.colbert = [np.zeros((0, 0), dtype=np.float32)] * items
        self.unused = np.fromiter(unused, dtype=np.int64)

    def put(self, indices: Sequence[int], rows: Any) -> None:
        self.dense.put(indices, rows.dense)
        ids, weights, colbert, lengths = (Encoder.to_host(t).numpy() for t in (
            rows.ids, rows.token_weights, rows.colbert, rows.lengths))
        for index, row_ids, row_weights, row_colbert, length in zip(indices, ids, weights, colbert, lengths):
            kept = (row_weights > 0) & ~np.isin(row_ids, self.unused)  # padding weighs 0
            self.sparse[index] = _merged_by_id(row_ids[kept], row_weights[kept])
            self.colbert[index] = row_colbert[:max(int(length) - 1, 0)].copy()

    def result(self) -> HybridVectors:
        return HybridVectors(self.dense.result(), self.sparse, self.colbert)

    @staticmethod
    def codec(dimension: int) -> RowCodec:
        """How the cache keeps these rows (scheduling/cache.py): an item's dense vector, sparse
        entries and ColBERT vectors, together."""
        return RowCodec("hybrid", ((dimension,), (2, None), (None, None)),
                        split=lambda out: list(zip(out.dense.numpy(), out.sparse, out.colbert)),
                        join=lambda rows: HybridVectors(torch.from_numpy(np.stack([row[0] for row in rows])),
                                                        [row[1] for row in rows], [row[2] for row in rows]))


def _merged_by_id(ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """(2, entries): each distinct id (ascending) over its largest weight."""
    if not len(ids):
        return np.zeros((2, 0), dtype=np.float32)
    order = np.argsort(ids, kind="stable")
    ids, weights = ids[order], weights[order]
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    return np.stack((ids[starts].astype(np.float32), np.maximum.reduceat(weights, starts))).astype(np.float32)


@dataclass(frozen=True)
class Embedded:
    vectors: torch.Tensor | list[np.ndarray]  # (items, dimension) float32 in input order; SparseRows' rows
    real_tokens: int
    padded_tokens: int  # what the forward passes computed; real / padded is the padding efficiency
    passes: int
    too_large: frozenset[int] = frozenset()  # items that ran out of memory alone (their rows are zeros)
    cpu_threads: int = 0  # the most threads a CPU pass ran on, borrowed ones included (0: no CPU pass)


def finite_rows(vectors: torch.Tensor | list[np.ndarray]) -> list[bool]:
    """Whether each item's output is finite, whichever way the batch keeps its rows."""
    if isinstance(vectors, HybridVectors):
        return vectors.finite()
    if isinstance(vectors, torch.Tensor):
        if vectors.device.type == "cpu" and vectors.dtype == torch.float32:  # numpy's calls cost less than torch's
            return np.isfinite(vectors.numpy()).all(axis=1).tolist()
        return torch.isfinite(vectors).all(dim=1).tolist()
    return [bool(np.isfinite(row).all()) for row in vectors]


class Encoder:
    """Passes of one backend, with the model's pipeline facts the service reads (`pooling`,
    `dimension`) and how the worker was placed (`placement`)."""

    def __init__(self, backend: Backend, cost: PassCost, placement: Placement, *, dimension: int, pooling: Pooling,
                 pad_id: int, max_positions: int | None = None, lending: CpuLending | None = None,
                 reasons: dict[str, Any] | None = None, rows: Callable[..., Any] = DenseRows,
                 images: Backend | None = None):
        """`images`: an image-text model's vision tower (backends/vision.py), which runs the image
        inputs while `backend` runs the texts; both write rows of the same space."""
        self.backend = backend
        self.images = images
        self.cost = cost
        self.placement = placement
        self.dimension = dimension
        self.pooling = pooling
        self.pad_id = pad_id  # for the calibration passes
        self.max_positions = max_positions  # tokens per input the position embeddings allow; None for rotary models
        self.lending = lending
        self.lend_min_tokens = 0  # padded tokens a pass needs to borrow CPUs (measure_speed sets it)
        self.reasons = dict(reasons or {})
        self.rows = rows  # how a batch's outputs are kept (DenseRows, SparseRows, HybridRows): (items, dimension, device)

    def with_backend(self, backend: Backend, *, placement: Placement | None = None, lending: CpuLending | None = None,
                     cost: PassCost | None = None) -> "Encoder":
        """This encoder's twin on another backend (a trial quantization, a test's stand-in), with
        its placement, lending and prices unless others are given."""
        return Encoder(backend, cost or self.cost, placement or self.placement, dimension=self.dimension,
                       pooling=self.pooling, pad_id=self.pad_id, max_positions=self.max_positions,
                       lending=lending or self.lending, reasons=self.reasons, rows=self.rows, images=self.images)

    @property
    def pass_overhead_tokens(self) -> int:
        return self.cost.pass_overhead_tokens

    @pass_overhead_tokens.setter
    def pass_overhead_tokens(self, tokens: int) -> None:
        self.cost = replace(self.cost, pass_overhead_tokens=tokens)

    def describe(self) -> dict[str, Any]:
        """How this encoder runs its passes, for /info: engine, padded or packed, the attention
        kernel, how many CUDA graphs it replays (0: every pass runs eagerly); an image-text
        model's image engine beside its text one."""
        if self.images is None:
            return self.backend.describe()
        images = self.images.describe()
        return {**self.backend.describe(), "image_engine": images["engine"], "image_cuda_graphs": images["cuda_graphs"]}

    def embed(self, inputs: Sequence[ModelInput]) -> Embedded:
        """Model inputs (model/inputs.py) -> (items, dimension) float32 pooled vectors on the CPU,
        in input order (a scoring model's logits; a sparse model's non-zero entries)."""
        device = self.backend.device
        out = self.rows(len(inputs), self.dimension, device)
        pending = [(backend, [items[i] for i in part]) for backend, items in self._by_backend(inputs)
                   for part in backend.plan([len(inputs[i]) for i in items], self.cost)]
        padded = passes = threads = 0
        too_large: set[int] = set()
        with torch.inference_mode(), self.lending.batch() if self.lending else nullcontext():
            while pending:
                backend, indices = pending.pop(0)
                prepared = backend.prepare([inputs[i] for i in indices])
                try:
                    with self._cpus_for_pass(backend.computed_tokens(prepared), backend) as pass_threads:
                        out.put(indices, backend.run(prepared))
                    threads = max(threads, pass_threads)
                except Exception as err:
                    if not is_out_of_memory(err):
                        raise_classified(err)
                    del prepared  # free this pass's inputs before retrying smaller
                    release_memory(device)
                    if len(indices) == 1:
                        too_large.add(indices[0])
                    else:
                        half = len(indices) // 2
                        log.warning("forward pass of %d inputs ran out of memory; retrying as %d + %d",
                                    len(indices), half, len(indices) - half)
                        pending[:0] = [(backend, indices[:half]), (backend, indices[half:])]
                    continue
                padded += backend.computed_tokens(prepared)
                passes += 1
        return Embedded(out.result(), real_tokens=distinct_tokens(inputs), padded_tokens=padded, passes=passes,
                        too_large=frozenset(too_large), cpu_threads=threads)

    def _by_backend(self, inputs: Sequence[ModelInput]) -> list[tuple[Backend, list[int]]]:
        """The items each backend runs: images on the vision tower's, the rest on the main one."""
        if self.images is None:
            return [(self.backend, list(range(len(inputs))))]
        images = [i for i, item in enumerate(inputs) if item.image is not None]
        texts = [i for i, item in enumerate(inputs) if item.image is None]
        return [(backend, items) for backend, items in ((self.backend, texts), (self.images, images)) if items]

    def measure_speed(self) -> Speed:
        """Time this worker's passes (embedserve/handler/execution/calibration.py) and keep the prices the encoder
        applies itself: a replay's, for the planner, and the smallest pass worth lending CPUs to.
        The pass price is the caller's to adopt: a setting may fix it."""
        speed = measure_speed(self.backend, self.cost, pad_id=self.pad_id, max_positions=self.max_positions)
        self.cost = replace(self.cost, replay_overhead_tokens=speed.replay_overhead_tokens)
        self.lend_min_tokens = speed.lend_min_tokens
        return speed

    @staticmethod
    def to_host(vectors: torch.Tensor) -> torch.Tensor:
        """The batch's vectors on the CPU: on a GPU the one copy, and the one wait, of the batch."""
        if vectors.device.type == "cpu":
            return vectors
        try:
            return vectors.cpu()
        except Exception as err:  # an asynchronous CUDA error of any pass surfaces here
            raise_classified(err)

    @contextmanager
    def _cpus_for_pass(self, tokens: int, backend: Backend) -> Iterator[int]:
        """Run one pass of `tokens` computed tokens on `backend` on this worker's CPUs, plus idle
        ones unless the pass is long or too short to gain from them: one more for each
        lend_min_tokens of the pass, as many as the backend's runtime can use. Yields the pass's CPU
        threads (0 on a GPU)."""
        own = self.placement.cpu_threads
        if self.lending is None or not self.lend_min_tokens <= tokens <= LEND_MAX_TOKENS:
            yield own
            return
        at_most = tokens // self.lend_min_tokens if self.lend_min_tokens else None
        counts = backend.thread_counts  # None: any count

        def usable(free: int) -> int:
            return max(count for count in counts if count <= own + free) - own if counts else free

        with self.lending.borrowing(at_most=at_most, usable=usable) as borrowed:
            torch.set_num_threads(own + borrowed)
            try:
                yield own + borrowed
            finally:
                torch.set_num_threads(own)
