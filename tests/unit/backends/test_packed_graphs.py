"""CUDA graphs over total tokens for packed passes (embedserve/handler/backends/packed_graphs.py): the ladder of
sizes and input tiers, the static layout (padding as inputs of its own, zero-length inputs in
the unused slots), the choice of graph, the counted tokens, the memory cap, the fallback to
eager, the start-up check, and the encoder's choice to capture and its max_length.

These run on a CPU. A stand-in replays by running the eager packed pass on the graph's static
buffers, with the grouped SDPA for attention, so the layout a graph runs is checked against the
unpadded pass; a stand-in cannot prove that a real capture records the pass, nor that the varlen
flash kernel reads the static offsets as the grouped SDPA does: that needs a GPU
(`make bench-gpu`)."""

import dataclasses
import logging

import numpy as np
import pytest
import torch
from transformers import AutoModel

from embedserve.handler.backends.packed import PackedBackend
from embedserve.handler.execution.select import with_graphs
from embedserve.handler.model.description import POOLING_MODES
from embedserve.handler.model.inputs import ModelInput, plain_inputs
from embedserve.handler.model.packed_forward import PackedInputs, PackedTransformer, pack
from embedserve.handler.backends.packed_graphs import (
    RESOLUTION, TOKEN_STEP, GraphShape, PackedGraph, PackedGraphRunner, TokenBucket, _random_pass, packed_ladder,
    slot_tiers, token_ladder,
)
from tests.support.engines import TEXTS, make_engine
from tests.support.graphs import BYTES_PER_TOKEN, EagerReplay, StaleReplay
from tests.support.inputs import random_rows
from tests.support.parts import on_backend, parts_of, torch_model

class EagerStandIn(EagerReplay, PackedGraph):
    captured: list[TokenBucket] = []


class StalePacked(StaleReplay, PackedGraph):
    captured: list[TokenBucket] = []


class LayoutIgnoringReplay(EagerStandIn):
    """Ignores the offsets: the whole graph attends as one input, whose vector every slot gets."""

    def replay(self) -> None:
        whole = PackedInputs(self.ids, torch.tensor([0, self.tokens], dtype=torch.int32), self.tokens, None)
        self.output = self.forward(whole).expand(self.slots, -1).clone()


class FailingCapture(EagerStandIn):
    def capture(self, pool: object) -> None:
        if self.tokens == 48:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        super().capture(pool)


@pytest.fixture(scope="module")
def models(families):
    return {family: AutoModel.from_pretrained(families[family]).eval() for family in ("bert_dense", "xlmr")}


def passes_for(model, modes=("mean",)):
    return PackedBackend(PackedTransformer(model), modes, None)


def capture(passes, sizes, *, max_len=64, max_inputs=16, graph_type=EagerStandIn, **kwargs):
    settings = dict(max_inputs=max_inputs, max_len=max_len, pad_id=1, vocab_size=100,
                    device=torch.device("cpu"), max_bytes=1 << 40, tolerance=1e-4, graph_type=graph_type)
    with torch.inference_mode():
        return PackedGraphRunner.capture(passes.run_eager, sizes, **{**settings, **kwargs})


def test_the_ladder_steps_by_under_a_sixty_fourth_past_the_fine_steps():
    sizes = token_ladder(16384)
    assert sizes[0] == TOKEN_STEP and sizes[-1] == 16384 and sizes == sorted(set(sizes))
    assert all(size % TOKEN_STEP == 0 for size in sizes)
    for smaller, size in zip(sizes, sizes[1:]):  # a pass padded up to `size` is over `smaller` tokens
        assert size - smaller <= max(TOKEN_STEP, size / RESOLUTION)
    assert len(sizes) == 278
    assert token_ladder(100) == [16, 32, 48, 64, 80, 96, 100]


def test_input_tiers_double_from_32_up_to_the_batch_size():
    assert slot_tiers(256) == [32, 64, 128, 256]
    assert slot_tiers(100) == [32, 64, 100] and slot_tiers(32) == [32] and slot_tiers(16) == [16]


def test_each_size_takes_the_tiers_its_passes_can_need():
    # all-MiniLM-L6-v2 on a GPU: 16384 tokens a pass, 256 inputs, max_length 256.
    sizes = token_ladder(16384)
    shapes = packed_ladder(sizes, 256, 256)
    assert len(shapes) == 1051  # the module docstring's count
    assert shapes == sorted(shapes, key=lambda shape: (shape.tokens, shape.inputs))
    tiers: dict[int, list[int]] = {}
    for shape in shapes:
        tiers.setdefault(shape.tokens, []).append(shape.inputs)
    assert list(tiers) == sizes
    assert tiers[16] == [16] and tiers[32] == [32]  # a pass of 16 tokens holds at most 16 inputs
    assert tiers[48] == [32, 48] and tiers[128] == [32, 64, 128] and tiers[144] == [32, 64, 128, 144]
    assert tiers[1024] == [32, 64, 128, 256]
    assert tiers[16384] == [64, 128, 256]  # 32 inputs of at most 256 tokens carry no more than 8192
    below = dict(zip(sizes, [0, *sizes[:-1]]))
    assert all(shape.spare == shape.tokens - below[shape.tokens] and shape.max_len == min(256, shape.tokens)
               for shape in shapes)
    # Every tier left holds a pass too long for the size below; a smaller one could not.
    assert all(shape.inputs * shape.max_len > below[shape.tokens] for shape in shapes)
    with pytest.raises(ValueError, match="hold no pass"):
        PackedGraph(16384, None, inputs=32, max_len=256, spare=256, pad_id=0, device=torch.device("cpu"))


def uncaptured_runner(shapes):
    """A runner over graphs of `shapes` that were never captured: enough to choose among them."""
    graphs = [PackedGraph(shape.tokens, None, inputs=shape.inputs, max_len=shape.max_len, spare=shape.spare,
                          pad_id=0, device=torch.device("cpu")) for shape in shapes]
    return PackedGraphRunner({graph.bucket: graph for graph in graphs}, None)


def a_pass(lengths):
    packed = pack([[1] * length for length in lengths])
    return PackedInputs(packed.ids, packed.cu_seqlens, packed.max_len, None)


def test_a_pass_replays_in_the_cheapest_graph_that_holds_it():
    sizes = token_ladder(16384)
    runner = uncaptured_runner(packed_ladder(sizes, 256, 256))
    # A batch of 32 short texts: 33 slots (one of padding) of 256 tokens, not 257 of 512.
    graph = runner.choose(a_pass([10] * 32))
    assert (graph.tokens, graph.inputs, graph.slots, graph.max_len) == (320, 32, 33, 256)
    assert runner.choose(a_pass([10] * 33)).inputs == 64
    assert runner.choose(a_pass([256] * 64)).bucket == TokenBucket(16384, 64)
    assert runner.choose(a_pass([64] * 256)).bucket == TokenBucket(16384, 256)
    assert runner.choose(a_pass([257])) is None and runner.choose(a_pass([1] * 257)) is None
    assert runner.choose(a_pass([256] * 64 + [1])) is None  # over the largest size
    generator = np.random.default_rng(0)
    for _ in range(100):
        count = int(2 ** generator.uniform(0, 8))  # 1 to 256 inputs, as many of each order
        lengths = generator.integers(1, int(generator.integers(1, 257)) + 1, size=count)
        lengths = lengths[lengths.cumsum() <= 16384]  # within the planner's budget
        count = len(lengths)
        inputs = a_pass(lengths)
        graph = runner.choose(inputs)
        assert graph is min((g for g in runner.ladder if g.holds(inputs)), key=lambda g: (g.tokens, g.inputs))
        tier = min(tier for tier in slot_tiers(256) if tier >= count)
        assert (graph.tokens, graph.inputs) == (min(s for s in sizes if s >= sum(lengths)), min(tier, graph.tokens))


def test_replays_in_input_tiers_equal_the_unpadded_pass(models):
    model = models["bert_dense"]
    passes = passes_for(model)
    sizes = token_ladder(256)
    runner = capture(passes, sizes, max_len=64, max_inputs=80)
    shapes = packed_ladder(sizes, 80, 64)
    assert {GraphShape(g.tokens, g.inputs, g.max_len, g.spare) for g in runner.ladder} == set(shapes)  # all checked
    for seed, lengths in enumerate([[3] * 20, [2] * 40, [1] * 80, [64, 64, 1, 1], [5] * 33]):
        inputs = passes.prepare([ModelInput(row, seed % 3) for row in random_rows(model, lengths, seed)])
        with torch.inference_mode():
            eager = passes.run_eager(inputs)
            graph = runner.choose(inputs)
            replayed = runner.run(inputs)
        tier = min(tier for tier in slot_tiers(80) if tier >= len(lengths))
        assert (graph.tokens, graph.inputs) == (min(s for s in sizes if s >= sum(lengths)), min(tier, graph.tokens))
        torch.testing.assert_close(replayed, eager, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["bert_dense", "xlmr"])
def test_replays_in_static_buffers_equal_the_unpadded_pass(models, family):
    model = models[family]
    passes = passes_for(model, modes=tuple(POOLING_MODES))
    runner = capture(passes, token_ladder(256))
    assert len(runner.graphs) == len(token_ladder(256))  # every size passed the start-up check
    for seed, lengths in enumerate([[1], [5, 3, 9], [64, 1, 1, 30, 2], [40] * 6, [64, 64, 64, 60]]):
        rows = random_rows(model, lengths, seed)
        unpooled = [seed % 3] * len(rows)
        inputs = passes.prepare([ModelInput(row, skip) for row, skip in zip(rows, unpooled)])
        with torch.inference_mode():
            eager = passes.run_eager(inputs)
            graph = runner.choose(inputs)
            replayed = runner.run(inputs)
        assert graph.tokens == min(size for size in token_ladder(256) if size >= sum(lengths))
        assert replayed.shape == eager.shape
        torch.testing.assert_close(replayed, eager, atol=1e-5, rtol=1e-4)


def test_the_static_layout_gives_padding_inputs_of_their_own(models):
    passes = passes_for(models["bert_dense"])
    graph = EagerStandIn(96, passes.run_eager, inputs=16, max_len=32, spare=80, pad_id=0, device=torch.device("cpu"))
    assert graph.slots == 16 + 3  # 80 tokens of padding take three inputs of at most 32
    inputs = passes.prepare(plain_inputs(random_rows(models["bert_dense"], [10, 6])))
    with torch.inference_mode():
        graph.run(inputs)
    offsets = graph.cu_seqlens.tolist()
    assert offsets[:3] == [0, 10, 16]  # the pass's inputs
    assert offsets[3:6] == [48, 80, 96]  # padding: 32, 32, 16 tokens
    assert offsets[6:] == [96] * (graph.slots - 5)  # zero-length inputs in the unused slots
    assert graph.ids[16:].eq(0).all() and graph.unpooled.eq(0).all()


def test_a_graph_holds_what_fits_its_tokens_inputs_length_and_padding_slots(models):
    model = models["bert_dense"]
    passes = passes_for(model)
    graph = PackedGraph(64, passes.run_eager, inputs=4, max_len=32, spare=16, pad_id=0, device=torch.device("cpu"))

    def holds(lengths):
        return graph.holds(passes.prepare(plain_inputs(random_rows(model, lengths))))

    assert graph.slots == 5  # 4 inputs, and one of padding for the 16 spare tokens
    assert holds([32, 20]) and holds([30, 30, 2, 1]) and holds([16, 16, 16])
    assert holds([10, 10, 10])  # 34 tokens of padding: two padding inputs, 3 + 2 slots
    assert not holds([8, 8, 8, 6])  # the same padding, but 4 + 2 slots
    assert not holds([1] * 5)  # inputs
    assert not holds([33]) and not holds([32, 32, 1])  # length, tokens


def test_passes_no_graph_holds_run_eagerly_and_count_their_own_tokens(models):
    model = models["bert_dense"]
    passes = passes_for(model)
    passes = passes.with_graphs(capture(passes, [16, 32, 48]))
    small = passes.prepare(plain_inputs(random_rows(model, [20, 7])))
    large = passes.prepare(plain_inputs(random_rows(model, [40, 30])))
    with torch.inference_mode():
        torch.testing.assert_close(passes.run(large), passes.run_eager(large))
    assert passes.computed_tokens(small) == 32 and passes.computed_tokens(large) == 70
    assert (passes.graphs.replays, passes.graphs.eager) == (0, 1)


def test_the_memory_cap_drops_the_largest_sizes_and_captures_largest_first(models):
    passes = passes_for(models["bert_dense"])
    EagerStandIn.captured.clear()
    runner = capture(passes, token_ladder(256), max_bytes=128 * BYTES_PER_TOKEN)
    assert sorted(bucket.tokens for bucket in runner.graphs) == [s for s in token_ladder(256) if s <= 128]
    assert EagerStandIn.captured == sorted(EagerStandIn.captured, reverse=True)


def test_a_failed_capture_leaves_every_pass_to_eager(models, caplog, monkeypatch):
    # As for padded graphs (embedserve/handler/backends/cuda_graphs.py): after a failed capture nothing more is
    # captured, and the graphs captured before it are dropped too.
    monkeypatch.setattr("embedserve.handler.backends.cuda_graphs.capture_failed", False)  # process state this test changes
    model = models["bert_dense"]
    passes = passes_for(model)
    FailingCapture.captured = []
    with caplog.at_level(logging.WARNING, logger="embedserve.handler.backends.cuda_graphs"):
        passes = passes.with_graphs(capture(passes, [16, 32, 48, 64], graph_type=FailingCapture))
    assert passes.graphs.graphs == {} and passes.graphs.ladder == []
    assert FailingCapture.captured == [TokenBucket(64, 16)]  # largest first, none after 48 failed
    assert any("the capture of bucket 48 tokens x 16 inputs failed" in line and "RuntimeError" in line
               for line in caplog.messages)
    inputs = passes.prepare(plain_inputs(random_rows(model, [30, 10])))
    with torch.inference_mode():
        torch.testing.assert_close(passes.run(inputs), passes.run_eager(inputs), atol=1e-5, rtol=1e-4)
    assert passes.computed_tokens(inputs) == 40 and (passes.graphs.replays, passes.graphs.eager) == (0, 1)


@pytest.mark.parametrize("graph_type", [StalePacked, LayoutIgnoringReplay])
def test_graphs_that_replay_unlike_eager_are_all_dropped(models, caplog, graph_type):
    passes = passes_for(models["bert_dense"])
    with caplog.at_level(logging.ERROR, logger="embedserve.handler.backends.packed_graphs"):
        runner = capture(passes, [16, 32, 64], graph_type=graph_type)
    assert runner.graphs == {} and runner.ladder == []
    assert any("every graph is dropped" in line and "unlike the eager pass" in line for line in caplog.messages)


def test_graphs_that_give_distinct_inputs_one_output_are_dropped(caplog):
    # A pass blind to its input: replay and eager agree, but prove nothing.
    constant = lambda inputs: torch.ones((inputs.cu_seqlens.numel() - 1, 4))  # noqa: E731
    with caplog.at_level(logging.ERROR, logger="embedserve.handler.backends.packed_graphs"):
        runner = PackedGraphRunner.capture(constant, [16, 32], max_inputs=8, max_len=16, pad_id=0, vocab_size=100,
                                           device=torch.device("cpu"), max_bytes=1 << 40, tolerance=1e-3,
                                           graph_type=EagerStandIn)
    assert runner.graphs == {}
    assert any("two distinct inputs to the same output" in line for line in caplog.messages)


def test_an_encoder_serves_the_same_vectors_with_packed_graphs(tiny_model_dir, monkeypatch):
    # The selection's own capture, as on a GPU whose packed attention is varlen flash, but with the
    # grouped SDPA (the CPU's kernel) standing in for flash and the stand-in graphs.
    engine = make_engine(tiny_model_dir, packed=True, max_batch_tokens=256, max_batch_size=16)
    encoder = engine.encoder
    ids = engine.text.token_ids(TEXTS * 3)
    eager = encoder.embed(plain_inputs(ids))
    assert engine.info()["cuda_graphs"] == 0
    real_capture = PackedGraphRunner.capture
    monkeypatch.setattr(PackedGraphRunner, "capture", classmethod(
        lambda cls, *args, **kwargs: real_capture(*args, **kwargs, graph_type=EagerStandIn)))
    monkeypatch.setattr("embedserve.handler.execution.select.VARLEN_FLASH", encoder.backend.transformer.attention_kernel)
    placement = dataclasses.replace(encoder.placement, cuda_graphs=True, cuda_graph_max_bytes=1 << 40)
    with torch.inference_mode():
        backend, reason = with_graphs(encoder.backend, torch_model(encoder), placement, parts_of(engine))
    encoder = on_backend(encoder, backend)
    assert encoder.describe()["cuda_graphs"] == len(token_ladder(256)) and reason.startswith("captured")
    # The engine's max_length (the tiny model's max_seq_length), not the 64 positions.
    graphs = backend.graphs.ladder
    assert graphs[-1].max_len == engine.text.max_length == 48 < encoder.max_positions
    assert all(graph.max_len == min(48, graph.tokens) for graph in graphs)
    replayed = encoder.embed(plain_inputs(ids))
    torch.testing.assert_close(replayed.vectors, eager.vectors, atol=1e-5, rtol=1e-4)
    assert backend.graphs.replays == replayed.passes and backend.graphs.eager == 0
    assert eager.padded_tokens == eager.real_tokens < replayed.padded_tokens  # each pass counts its graph's size
    sizes = [bucket.tokens for bucket in backend.graphs.graphs]
    assert replayed.padded_tokens <= eager.real_tokens + replayed.passes * TOKEN_STEP
    assert set(sizes) == set(token_ladder(256))


def test_packed_graphs_need_the_flash_kernel(tiny_model_dir, caplog):
    # On a CPU the packed passes' attention is the grouped SDPA, which reads its offsets on the
    # host: a capture would refuse it, so the selection does not try.
    engine = make_engine(tiny_model_dir, packed=True)
    encoder = engine.encoder
    placement = dataclasses.replace(encoder.placement, cuda_graphs=True)
    with caplog.at_level(logging.WARNING, logger="embedserve.handler.execution.select"):
        backend, reason = with_graphs(encoder.backend, torch_model(encoder), placement, parts_of(engine))
    assert backend is encoder.backend and backend.graphs is None and "grouped_sdpa" in reason
    assert any("need the varlen_flash attention kernel" in line and "grouped_sdpa" in line
               for line in caplog.messages)


def test_the_start_up_check_passes_leave_padding_and_fit_their_graph(models):
    passes = passes_for(models["bert_dense"])
    generator = np.random.default_rng(1)
    # The last: 4 inputs carry at most 1000 of the 1024 tokens, so every pass leaves 24 or more.
    for size, inputs, max_len, spare in [(16, 16, 16, 16), (256, 4, 64, 16), (1040, 4, 512, 32), (64, 64, 8, 64),
                                         (1024, 4, 250, 64)]:
        graph = PackedGraph(size, passes.run_eager, inputs=inputs, max_len=max_len, spare=spare, pad_id=0,
                            device=torch.device("cpu"))
        for _ in range(20):
            inputs = _random_pass(graph, 100, generator)
            total = inputs.ids.numel()
            assert size - spare <= total < size and inputs.max_len == min(max_len, total)
            assert graph.holds(inputs)
