"""CUDA graph buckets: the ladder, the choice of bucket, padding into static buffers, the eager
fallback, the memory cap, the per-bucket fallback of a failed capture, the start-up check of
replays against eager, and the capture's stream and pool on the worker's GPU (which GPU that is:
tests/unit/execution/test_placement.py).

These run on a CPU. A stand-in replays eagerly on the same static buffers, so everything but the
capture itself is exercised; a stand-in cannot prove that a real capture records the pass, that
a failed capture leaves its stream out of capture mode, or that streams and pools really land on
the worker's GPU: that needs a GPU. Where torch.cuda is mocked, it is only to see which device
the code names."""

import contextlib
import logging
from pathlib import Path
from unittest import mock

import pytest
import torch

from embedserve.handler.backends.cuda_graphs import (REPLAY_TOLERANCE, Bucket, GraphRunner, StaticGraph, choose,
                                 forward_synchronizes, ladder, relative_error)
from tests.support.engines import TEXTS, make_engine
from tests.support.graphs import BYTES_PER_TOKEN, EagerReplay, StaleReplay
from tests.support.model_families import FAMILIES
from tests.support.parts import replaying, torch_model
from embedserve.handler.model.inputs import plain_inputs


class EagerStandIn(EagerReplay, StaticGraph):
    captured: list[Bucket] = []


def runner_for(encoder, buckets, graph_type=EagerStandIn, **kwargs):
    settings = {"max_bytes": 1 << 40, "tolerance": 1e-4, **kwargs}
    return GraphRunner.capture(encoder.backend.pooled, buckets, pad_id=encoder.pad_id, device=torch.device("cpu"),
                               vocab_size=torch_model(encoder).config.vocab_size, graph_type=graph_type, **settings)


def test_ladder_keeps_pairs_within_the_budget_largest_first():
    buckets = ladder([1, 4, 16], [16, 64, 256], max_tokens=1024)
    assert Bucket(16, 256) not in buckets and Bucket(4, 256) in buckets and Bucket(16, 64) in buckets
    assert [b.tokens for b in buckets] == sorted((b.tokens for b in buckets), reverse=True)
    assert len(set(buckets)) == len(buckets)


def test_choose_picks_the_fitting_bucket_with_fewest_tokens():
    buckets = ladder([1, 2, 4, 8], [16, 32, 64], max_tokens=10**6)
    assert choose(buckets, 1, 10) == Bucket(1, 16)
    assert choose(buckets, 3, 17) == Bucket(4, 32)
    assert choose(buckets, 8, 64) == Bucket(8, 64)
    assert choose(buckets, 9, 8) is None and choose(buckets, 1, 65) is None


def test_replay_through_static_buffers_equals_eager(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_batch_tokens=256, max_batch_size=8)
    encoder = engine.encoder
    ids = engine.text.token_ids(TEXTS * 3)
    eager = encoder.embed(plain_inputs(ids)).vectors
    with torch.inference_mode():
        graphs = runner_for(encoder, ladder([1, 2, 4, 8], [8, 16, 32, 64], max_tokens=10**6))
    graphs.replays = 0  # the start-up check replayed too
    replayed = replaying(encoder, graphs).embed(plain_inputs(ids))
    torch.testing.assert_close(replayed.vectors, eager, atol=1e-5, rtol=1e-4)
    assert replayed.passes > 1 and graphs.replays == replayed.passes and graphs.eager == 0

    # Passes larger than every bucket run eagerly, with the same results.
    with torch.inference_mode():
        graphs = runner_for(encoder, [Bucket(8, 16)])
    torch.testing.assert_close(replaying(encoder, graphs).embed(plain_inputs(ids)).vectors, eager, atol=1e-5, rtol=1e-4)
    assert graphs.eager > 0 and graphs.replays > 0  # only the short passes fit


def test_padded_tokens_count_the_bucket_a_pass_replays_in(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_batch_tokens=512, max_batch_size=8)
    encoder = engine.encoder
    ids = engine.text.token_ids(TEXTS)
    with torch.inference_mode():
        embedded = replaying(encoder, runner_for(encoder, [Bucket(8, 64)])).embed(plain_inputs(ids))
    assert embedded.padded_tokens == embedded.passes * 8 * 64  # every pass computed the whole bucket
    # Eager computes only its own padding.
    assert embedded.padded_tokens > encoder.embed(plain_inputs(ids)).padded_tokens


def test_the_planner_fills_the_buckets(tiny_model_dir):
    # 9 inputs of 3-4 tokens: blind to the buckets, one pass of 9 rows runs eagerly (no bucket
    # holds 9 rows); priced at the buckets, an 8x8 replay and a 1x8 one cost less.
    engine = make_engine(tiny_model_dir, max_batch_size=16)
    encoder = engine.encoder
    ids = engine.text.token_ids(["cat"] * 9)
    with torch.inference_mode():
        graphs = runner_for(encoder, [Bucket(1, 8), Bucket(8, 8)])
    graphs.replays = 0
    embedded = replaying(encoder, graphs, pass_overhead_tokens=200, replay_overhead_tokens=4).embed(plain_inputs(ids))
    assert (embedded.passes, graphs.replays, graphs.eager) == (2, 2, 0)
    torch.testing.assert_close(embedded.vectors, encoder.embed(plain_inputs(ids)).vectors, atol=1e-5, rtol=1e-4)


def test_the_memory_cap_drops_the_largest_buckets_and_captures_largest_first(tiny_model_dir):
    encoder = make_engine(tiny_model_dir).encoder
    buckets = ladder([1, 2, 4, 8], [16, 32], max_tokens=10**6)  # 16 to 256 tokens
    EagerStandIn.captured = []
    with torch.inference_mode():
        runner = runner_for(encoder, buckets, max_bytes=64 * BYTES_PER_TOKEN)
    assert set(runner.graphs) == {b for b in buckets if b.tokens <= 64}  # the small ones stay
    assert EagerStandIn.captured == sorted(runner.graphs, key=lambda b: (b.tokens, b), reverse=True)


class FailingCapture(EagerStandIn):
    """A capture that fails as a real one does for some buckets: an operation the capturing
    stream refuses (a host synchronization in the model's code), or out of memory."""

    failures = {
        Bucket(2, 16): RuntimeError("CUDA error: operation not permitted when stream is capturing"),
        Bucket(4, 32): torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    }

    def capture(self, pool: object) -> None:
        if self.bucket in self.failures:
            raise self.failures[self.bucket]
        super().capture(pool)


class FailingWarmUp(EagerStandIn):
    def warm_up(self) -> int:
        if self.bucket == Bucket(8, 32):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
        return super().warm_up()


def _eight_buckets(tiny_model_dir):
    """An encoder, a batch's ids with their eager vectors, and eight buckets of 16 to 256 tokens."""
    engine = make_engine(tiny_model_dir, max_batch_tokens=256, max_batch_size=8)
    ids = engine.text.token_ids(TEXTS * 3)
    eager = engine.encoder.embed(plain_inputs(ids)).vectors
    return engine.encoder, ids, eager, ladder([1, 2, 4, 8], [16, 32], max_tokens=10**6)


def test_a_failed_capture_leaves_every_pass_to_eager(tiny_model_dir, caplog):
    # After one failed capture the allocator may still record into the shared pool: no later
    # capture is tried, and the graphs already captured are dropped too.
    encoder, ids, eager, buckets = _eight_buckets(tiny_model_dir)
    FailingCapture.captured = []
    with torch.inference_mode(), caplog.at_level(logging.WARNING, logger="embedserve.handler.backends.cuda_graphs"):
        graphs = runner_for(encoder, buckets, graph_type=FailingCapture)
    assert graphs.graphs == {} and graphs.buckets == []
    assert graphs.graphs.why_none.startswith("the capture of bucket 4x32 failed (OutOfMemoryError")  # for /info
    assert FailingCapture.captured == [Bucket(8, 32), Bucket(8, 16)]  # largest first, none after 4x32 failed
    assert any("none for this worker: the capture of bucket 4x32 failed" in line and "OutOfMemoryError" in line
               for line in caplog.messages)
    torch.testing.assert_close(replaying(encoder, graphs).embed(plain_inputs(ids)).vectors, eager, atol=1e-5, rtol=1e-4)


def test_a_failed_warm_up_leaves_its_bucket_to_eager(tiny_model_dir, caplog):
    encoder, ids, eager, buckets = _eight_buckets(tiny_model_dir)
    with torch.inference_mode(), caplog.at_level(logging.WARNING, logger="embedserve.handler.backends.cuda_graphs"):
        graphs = runner_for(encoder, buckets, graph_type=FailingWarmUp)
    assert set(graphs.graphs) == set(buckets) - {Bucket(8, 32)}  # the rest are captured
    assert any("bucket 8x32 runs eagerly" in line and "Error" in line for line in caplog.messages)
    torch.testing.assert_close(replaying(encoder, graphs).embed(plain_inputs(ids)).vectors, eager, atol=1e-5, rtol=1e-4)


class CapturedGraph:
    """torch.cuda.CUDAGraph after a legal capture (replay is not called by the capture path)."""

    def __init__(self, allocator: "Allocator"):
        self.allocator = allocator

    def capture_begin(self, pool=None):
        pass

    def capture_end(self):
        pass


class InvalidatedGraph(CapturedGraph):
    """torch.cuda.CUDAGraph after its stream met an operation a capture refuses: `capture_end`
    raises, and the allocator may be left recording into the pool."""

    def capture_end(self):
        self.allocator.recording = True
        raise RuntimeError("CUDA error: operation failed due to a previous error during capture")


class Allocator:
    """torch.cuda's caching allocator as seen by the capture code: `empty_cache` trips its
    internal assert once a capture has ended in error (captures_underway is not empty)."""

    def __init__(self):
        self.recording = False
        self.emptied = 0

    def empty_cache(self):
        if self.recording:
            raise RuntimeError("INTERNAL ASSERT FAILED at CUDACachingAllocator.cpp: captures_underway.empty()")
        self.emptied += 1


@contextlib.contextmanager
def fake_cuda(named: list | None = None, graph_type: type = CapturedGraph, allocator: Allocator | None = None):
    """torch.cuda's entry points the capture code calls, on a machine without a GPU: `named`
    records which device each names; `graph_type` stands in for torch.cuda.CUDAGraph; the
    sync-debug mode is accepted (a CPU has nothing to synchronize with)."""
    named = [] if named is None else named
    allocator = allocator or Allocator()

    @contextlib.contextmanager
    def current_device(device):
        named.append(("current device", device))
        yield

    class Stream:
        def __init__(self, device=None):
            named.append(("new stream", device))

        def wait_stream(self, other):
            pass

    def current_stream(device=None):
        named.append(("current stream", device))
        return Stream.__new__(Stream)

    modes = []
    with mock.patch("torch.cuda.device", current_device), mock.patch("torch.cuda.Stream", Stream), \
            mock.patch("torch.cuda.current_stream", current_stream), \
            mock.patch("torch.cuda.stream", lambda stream: contextlib.nullcontext()), \
            mock.patch("torch.cuda.graph_pool_handle", lambda: named.append(("pool", None))), \
            mock.patch("torch.cuda.CUDAGraph", lambda: graph_type(allocator)), mock.patch("torch.cuda.synchronize"), \
            mock.patch("torch.cuda.get_sync_debug_mode", lambda: 0), \
            mock.patch("torch.cuda.set_sync_debug_mode", modes.append), \
            mock.patch("torch.cuda.empty_cache", allocator.empty_cache):
        yield modes


class CapturedOnCpuBuffers(StaticGraph):
    """The real capture path (StaticPass.capture) on buffers kept on the CPU; the warm-up's
    memory reading is the stand-in's."""

    warm_up = EagerReplay.warm_up

    def __init__(self, bucket, forward, pad_id, device):
        super().__init__(bucket, forward, pad_id, torch.device("cpu"))
        self.device = device  # what the capture code names: the worker's GPU

    def replay(self) -> None:
        self.output = self.compute()


def test_an_invalidated_capture_drops_the_graphs_and_never_empties_the_cache(tiny_model_dir, caplog, monkeypatch):
    import embedserve.handler.backends.cuda_graphs as cuda_graphs

    monkeypatch.setattr(cuda_graphs, "capture_failed", False)  # process state this test changes
    encoder = make_engine(tiny_model_dir).encoder
    device, allocator = torch.device("cuda:0"), Allocator()
    with fake_cuda(graph_type=InvalidatedGraph, allocator=allocator), torch.inference_mode(), \
            caplog.at_level(logging.WARNING, logger="embedserve.handler.backends.cuda_graphs"):
        runner = GraphRunner.capture(encoder.backend.pooled, [Bucket(2, 8), Bucket(4, 8)], pad_id=encoder.pad_id,
                                     device=device, vocab_size=torch_model(encoder).config.vocab_size, max_bytes=1 << 40,
                                     tolerance=1e-4, graph_type=CapturedOnCpuBuffers)
        assert allocator.recording and allocator.emptied == 1  # once, after the warm-ups; never after the capture
        cuda_graphs.release_memory(device)  # what an out-of-memory retry calls later: no assert
    assert runner.graphs == {} and runner.buckets == []
    assert any("none for this worker: the capture of bucket 4x8 failed" in line for line in caplog.messages)


def test_a_legal_capture_on_the_same_path_keeps_its_graphs(tiny_model_dir):
    encoder = make_engine(tiny_model_dir).encoder
    with fake_cuda() as sync_modes, torch.inference_mode():
        runner = GraphRunner.capture(encoder.backend.pooled, [Bucket(2, 8), Bucket(4, 8)], pad_id=encoder.pad_id,
                                     device=torch.device("cuda:0"), vocab_size=torch_model(encoder).config.vocab_size,
                                     max_bytes=1 << 40, tolerance=1e-4, graph_type=CapturedOnCpuBuffers)
    assert runner.buckets == [Bucket(2, 8), Bucket(4, 8)]
    assert sync_modes == ["error", 0]  # the forward was checked with synchronizations made errors, then restored


def test_a_forward_that_reads_the_device_gets_no_graphs(tiny_model_dir, caplog):
    # MPNet's position bias copies a host tensor in; any `.item()` or `if tensor:` reads the device.
    encoder = make_engine(tiny_model_dir).encoder

    def reads(ids, mask):
        if mask.sum() > 0:  # a host read, as transformers' `padding_mask.all()` check is
            return encoder.backend.pooled(ids, mask)
        return encoder.backend.pooled(ids, mask)

    with fake_cuda(), torch.inference_mode(), caplog.at_level(logging.WARNING, logger="embedserve.handler.backends.cuda_graphs"):
        runner = GraphRunner.capture(reads, [Bucket(2, 8)], pad_id=encoder.pad_id, device=torch.device("cuda:0"),
                                     vocab_size=torch_model(encoder).config.vocab_size, max_bytes=1 << 40,
                                     tolerance=1e-4, graph_type=CapturedOnCpuBuffers)
    assert runner.graphs == {}
    why = "this model's forward pass reads the device from the host (is_nonzero), which a capture refuses"
    assert runner.graphs.why_none == why  # /info's reason, as the log says it
    assert any(f"none: {why}" in line for line in caplog.messages)


def test_forward_synchronizes_names_what_read_the_device():
    cpu = torch.device("cpu")
    x = torch.ones(4)
    assert forward_synchronizes(lambda: x * 2, cpu) is None
    for read in (lambda: (x * 2).sum().item(), lambda: bool(x.all()), lambda: x.nonzero()):
        for mode in (torch.inference_mode(), contextlib.nullcontext()):  # torch dispatches them differently
            with mode:
                assert forward_synchronizes(read, cpu).startswith("reads the device from the host (")


@pytest.fixture(scope="module")
def native_ports(tmp_path_factory) -> dict[str, Path]:
    """Staged folders of the native ports whose masks the encoder builds: nomic and GTE from
    their original layout, EuroBERT, EmbeddingGemma (a bidirectional Gemma3)."""
    from embedserve.archive.stage import stage_model
    from tests.support.native_models import make_embeddinggemma, make_eurobert, make_native_and_original

    root = tmp_path_factory.mktemp("ports")
    sources = {family: make_native_and_original(family, root)[1] for family in ("nomic", "gte")}
    sources["eurobert"] = make_eurobert(root / "eurobert")
    sources["embeddinggemma"] = make_embeddinggemma(root / "embeddinggemma")
    for family, source in sources.items():
        stage_model(source, root / f"{family}-staged")
    return {family: root / f"{family}-staged" for family in sources}


@pytest.mark.parametrize("family", ["bert_dense", "xlmr", "mpnet", "qwen3", "modernbert", "nomic", "gte", "eurobert",
                                    "embeddinggemma"])
def test_an_eager_padded_pass_reads_nothing_from_the_device(families, native_ports, family):
    # transformers asks `padding_mask.all()` of a 2D mask (a host synchronization per pass, which
    # a CUDA graph capture refuses: on an H100 nomic, GTE and EuroBERT got no graphs for it); the
    # encoder hands these encoders their 4D mask built without it (embedserve/handler/model/attention_mask.py).
    encoder = make_engine({**families, **native_ports}[family]).encoder
    ids = torch.randint(5, 60, (3, 12))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    with torch.inference_mode():
        assert forward_synchronizes(lambda: encoder.backend.pooled(ids, mask), torch.device("cpu")) is None
        own = torch_model(encoder)(input_ids=ids, attention_mask=mask).last_hidden_state  # the model's own mask
        torch.testing.assert_close(encoder.backend.transformer(ids, mask), own, atol=0, rtol=0)


def test_the_bfloat16_replay_tolerance_refuses_a_two_percent_error_and_passes_padding(tiny_model_dir):
    # What padding alone does to a bfloat16 pass: the same rows padded into a larger shape.
    engine = make_engine(tiny_model_dir, dtype="bfloat16")
    encoder = engine.encoder
    ids = torch.randint(5, 60, (3, 12))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    padded_ids = torch.full((8, 32), encoder.pad_id)
    padded_mask = torch.zeros_like(padded_ids)
    padded_mask[:, 0] = 1
    padded_ids[:3, :12], padded_mask[:3, :12] = ids, mask
    with torch.inference_mode():
        alone, padded = encoder.backend.pooled(ids, mask), encoder.backend.pooled(padded_ids, padded_mask)[:3]
    tolerance = REPLAY_TOLERANCE[torch.bfloat16]
    assert relative_error(padded, alone) <= tolerance
    strayed = alone + 0.02 * alone.norm(dim=-1, keepdim=True) * torch.nn.functional.normalize(torch.randn_like(alone), dim=-1)
    assert relative_error(strayed, alone) > tolerance


class MaskIgnoringReplay(EagerStandIn):
    """A replay that attends to its padding: wrong for every padded pass."""

    def replay(self) -> None:
        self.output = self.forward(self.ids, torch.ones_like(self.mask))


class StaleGraph(StaleReplay, StaticGraph):
    captured: list[Bucket] = []


@pytest.mark.parametrize("graph_type", [MaskIgnoringReplay, StaleGraph])
def test_graphs_that_replay_unlike_eager_are_all_dropped(tiny_model_dir, caplog, graph_type):
    encoder = make_engine(tiny_model_dir).encoder
    with torch.inference_mode(), caplog.at_level(logging.ERROR, logger="embedserve.handler.backends.cuda_graphs"):
        runner = runner_for(encoder, ladder([1, 2, 4], [8, 16], max_tokens=10**6), graph_type=graph_type)
    assert runner.graphs == {} and runner.buckets == []
    assert runner.graphs.why_none.startswith("dropped: bucket ") and "unlike the eager pass" in runner.graphs.why_none
    assert any("every graph is dropped" in line and "unlike the eager pass" in line for line in caplog.messages)


def test_graphs_that_give_distinct_inputs_one_output_are_dropped(caplog):
    # A forward pass blind to its input: replay and eager agree, but prove nothing.
    constant = lambda ids, mask: torch.ones((ids.shape[0], 4))  # noqa: E731
    with caplog.at_level(logging.ERROR, logger="embedserve.handler.backends.cuda_graphs"):
        runner = GraphRunner.capture(constant, [Bucket(2, 8)], pad_id=0, vocab_size=100, device=torch.device("cpu"),
                                     max_bytes=1 << 40, tolerance=1e-3, graph_type=EagerStandIn)
    assert runner.graphs == {}
    assert any("two distinct inputs to the same output" in line for line in caplog.messages)


def test_measure_speed_prices_a_replay(tiny_model_dir):
    encoder = make_engine(tiny_model_dir).encoder
    with torch.inference_mode():
        encoder = replaying(encoder, runner_for(encoder, [Bucket(1, 16), Bucket(8, 64)]))
    speed = encoder.measure_speed()
    assert speed.tokens_per_second > 0 and speed.pass_overhead_tokens >= 1
    assert 1 <= encoder.cost.replay_overhead_tokens <= encoder.placement.max_batch_tokens


@contextlib.contextmanager
def pretend_capture():
    """While a real capture runs, a host synchronization (a tensor read into Python) is an error;
    here any such read raises, and torch says a stream is capturing."""

    def refuse(*args, **kwargs):
        raise AssertionError("a host synchronization while a stream captures")

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch("torch.cuda.is_current_stream_capturing", lambda: True))
        for name in ("__bool__", "item", "tolist", "nonzero", "__int__", "__float__", "__index__"):
            stack.enter_context(mock.patch.object(torch.Tensor, name, refuse))
        yield


@pytest.mark.parametrize("family", FAMILIES)
def test_the_forward_pass_reads_no_tensor_while_a_stream_captures(families, family):
    # transformers 4.x builds the SDPA masks of BERT and XLM-R after `if torch.all(mask == 1)`,
    # and Qwen3's after `padding_mask.all()`: host synchronizations a capture refuses. From 5.0
    # they skip those checks while a stream captures (setup.cfg's floor). A CPU cannot capture:
    # this checks only for reads into Python.
    encoder = make_engine(families[family]).encoder
    ids = torch.randint(5, 60, (3, 12))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    with torch.inference_mode(), pretend_capture():
        encoder.backend.pooled(ids, mask)


class CpuBuffers(EagerStandIn):
    """The stand-in's buffers stay on the CPU whatever device it is given."""

    def __init__(self, bucket, forward, pad_id, device):
        super().__init__(bucket, forward, pad_id, torch.device("cpu"))


def test_capture_makes_its_stream_and_pool_on_the_worker_gpu(tiny_model_dir):
    encoder = make_engine(tiny_model_dir).encoder
    device = torch.device("cuda:1")
    named: list[tuple[str, object]] = []
    with fake_cuda(named, graph_type=CapturedGraph), torch.inference_mode():
        runner = GraphRunner.capture(encoder.backend.pooled, [Bucket(2, 8)], pad_id=encoder.pad_id, device=device,
                                     vocab_size=torch_model(encoder).config.vocab_size, max_bytes=1 << 40,
                                     tolerance=1e-4, graph_type=CpuBuffers)
    assert runner.buckets == [Bucket(2, 8)]
    assert named[0] == ("current device", device) and ("new stream", device) in named
    assert {device for what, device in named if what == "current stream"} == {device}
    assert named.index(("current device", device)) < named.index(("pool", None))


def test_torch_compile_gives_the_eager_results(tiny_model_dir):
    eager, compiled = make_engine(tiny_model_dir), make_engine(tiny_model_dir, compile=True)
    for texts in (TEXTS, ["another shape", "x"]):  # dynamic shapes: no recompile per length
        ids = eager.text.token_ids(texts)
        torch.testing.assert_close(compiled.encoder.embed(plain_inputs(ids)).vectors, eager.encoder.embed(plain_inputs(ids)).vectors,
                                   atol=1e-5, rtol=1e-4)


def test_inputs_go_to_the_gpu_through_pinned_memory_without_waiting():
    """On a CPU the array is used as it is; for a GPU it is pinned, then copied asynchronously (a
    stand-in for the device: the real copy runs only in `make bench-gpu`)."""
    import numpy as np

    from embedserve.handler.worker.transfer import to_device

    array = np.arange(6, dtype=np.int64)
    assert to_device(array, torch.device("cpu")).data_ptr() == array.ctypes.data
    calls = []
    pinned = mock.Mock()
    pinned.to.side_effect = lambda device, non_blocking: calls.append((device, non_blocking)) or "on the gpu"
    with mock.patch.object(torch.Tensor, "pin_memory", lambda self: pinned):
        assert to_device(array, torch.device("cuda", 1)) == "on the gpu"
    assert calls == [(torch.device("cuda", 1), True)]


def test_a_cuda_error_met_reading_the_batch_back_is_a_device_failure():
    from embedserve.handler.execution.encoder import Encoder
    from embedserve.handler.execution.device_errors import DeviceFailure

    vectors = mock.Mock()
    vectors.device = torch.device("cuda", 0)
    vectors.cpu.side_effect = RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(DeviceFailure):
        Encoder.to_host(vectors)
    vectors.cpu.side_effect = RuntimeError("something else")
    with pytest.raises(RuntimeError, match="something else"):
        Encoder.to_host(vectors)
    on_cpu = torch.zeros(2, 3)
    assert Encoder.to_host(on_cpu) is on_cpu
