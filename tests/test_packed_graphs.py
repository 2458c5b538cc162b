"""CUDA graphs over total tokens for packed passes (handler/packed_graphs.py): the ladder, the
static layout (padding as inputs of its own, zero-length inputs in the unused slots), the
choice of graph, the counted tokens, the memory cap, the per-size fallback, the start-up check,
and the encoder's choice to capture.

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

from handler.model_files import POOLING_MODES
from handler.packed import PackedInputs, PackedPasses, PackedTransformer
from handler.packed_graphs import (
    RESOLUTION, TOKEN_STEP, PackedGraph, PackedGraphRunner, TokenBucket, _random_pass, token_ladder,
)
from tests.conftest import make_engine
from tests.test_cuda_graphs import BYTES_PER_TOKEN, EagerReplay
from tests.test_packed import random_rows
from tests.test_engine import TEXTS

class EagerStandIn(EagerReplay, PackedGraph):
    captured: list[TokenBucket] = []


class StaleReplay(EagerStandIn):
    """Recomputes nothing after capture, as an empty capture does."""

    def replay(self) -> None:
        if self.output is None:
            super().replay()


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


def passes_for(model, modes=("mean",), max_batch_tokens=256, max_batch_size=16):
    return PackedPasses(PackedTransformer(model), modes, None, max_batch_tokens=max_batch_tokens,
                        max_batch_size=max_batch_size)


def capture(passes, sizes, *, max_len=64, graph_type=EagerStandIn, **kwargs):
    settings = dict(max_inputs=passes.max_batch_size, max_len=max_len, pad_id=1, vocab_size=100,
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


@pytest.mark.parametrize("family", ["bert_dense", "xlmr"])
def test_replays_in_static_buffers_equal_the_unpadded_pass(models, family):
    model = models[family]
    passes = passes_for(model, modes=tuple(POOLING_MODES))
    runner = capture(passes, token_ladder(256))
    assert len(runner.graphs) == len(token_ladder(256))  # every size passed the start-up check
    for seed, lengths in enumerate([[1], [5, 3, 9], [64, 1, 1, 30, 2], [40] * 6, [64, 64, 64, 60]]):
        rows = random_rows(model, lengths, seed)
        unpooled = [seed % 3] * len(rows)
        inputs = passes.prepare(rows, unpooled)
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
    inputs = passes.prepare(random_rows(models["bert_dense"], [10, 6]), None)
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
        return graph.holds(passes.prepare(random_rows(model, lengths), None))

    assert graph.slots == 5  # 4 inputs, and one of padding for the 16 spare tokens
    assert holds([32, 20]) and holds([30, 30, 2, 1]) and holds([16, 16, 16])
    assert holds([10, 10, 10])  # 34 tokens of padding: two padding inputs, 3 + 2 slots
    assert not holds([8, 8, 8, 6])  # the same padding, but 4 + 2 slots
    assert not holds([1] * 5)  # inputs
    assert not holds([33]) and not holds([32, 32, 1])  # length, tokens


def test_passes_no_graph_holds_run_eagerly_and_count_their_own_tokens(models):
    model = models["bert_dense"]
    passes = passes_for(model, max_batch_tokens=512)
    passes.graphs = capture(passes, [16, 32, 48])
    small = passes.prepare(random_rows(model, [20, 7]), None)
    large = passes.prepare(random_rows(model, [40, 30]), None)
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


def test_a_failed_capture_leaves_its_size_to_eager(models, caplog):
    model = models["bert_dense"]
    passes = passes_for(model)
    with caplog.at_level(logging.WARNING, logger="handler.cuda_graphs"):
        passes.graphs = capture(passes, [16, 32, 48, 64], graph_type=FailingCapture)
    assert set(passes.graphs.graphs) == {TokenBucket(16), TokenBucket(32), TokenBucket(64)}
    assert any("bucket 48 tokens runs eagerly" in line and "RuntimeError" in line for line in caplog.messages)
    inputs = passes.prepare(random_rows(model, [30, 10]), None)  # 40 tokens: replayed in 64
    with torch.inference_mode():
        torch.testing.assert_close(passes.run(inputs).clone(), passes.run_eager(inputs), atol=1e-5, rtol=1e-4)
    assert passes.computed_tokens(inputs) == 64


@pytest.mark.parametrize("graph_type", [StaleReplay, LayoutIgnoringReplay])
def test_graphs_that_replay_unlike_eager_are_all_dropped(models, caplog, graph_type):
    passes = passes_for(models["bert_dense"])
    with caplog.at_level(logging.ERROR, logger="handler.packed_graphs"):
        runner = capture(passes, [16, 32, 64], graph_type=graph_type)
    assert runner.graphs == {} and runner.ladder == []
    assert any("every graph is dropped" in line and "unlike the eager pass" in line for line in caplog.messages)


def test_graphs_that_give_distinct_inputs_one_output_are_dropped(caplog):
    # A pass blind to its input: replay and eager agree, but prove nothing.
    constant = lambda inputs: torch.ones((inputs.cu_seqlens.numel() - 1, 4))  # noqa: E731
    with caplog.at_level(logging.ERROR, logger="handler.packed_graphs"):
        runner = PackedGraphRunner.capture(constant, [16, 32], max_inputs=8, max_len=16, pad_id=0, vocab_size=100,
                                           device=torch.device("cpu"), max_bytes=1 << 40, tolerance=1e-3,
                                           graph_type=EagerStandIn)
    assert runner.graphs == {}
    assert any("two distinct inputs to the same output" in line for line in caplog.messages)


def test_an_encoder_serves_the_same_vectors_with_packed_graphs(tiny_model_dir, monkeypatch):
    # The encoder's own capture, as on a GPU whose packed attention is varlen flash, but with the
    # grouped SDPA (the CPU's kernel) standing in for flash and the stand-in graphs.
    engine = make_engine(tiny_model_dir, packed=True, max_batch_tokens=256, max_batch_size=16)
    encoder = engine.encoder
    ids = engine.token_ids(TEXTS * 3)
    eager = encoder.embed(ids)
    assert engine.info()["cuda_graphs"] == 0
    real_capture = PackedGraphRunner.capture
    monkeypatch.setattr(PackedGraphRunner, "capture", classmethod(
        lambda cls, *args, **kwargs: real_capture(*args, **kwargs, graph_type=EagerStandIn)))
    monkeypatch.setattr("handler.encoder.VARLEN_FLASH", encoder.passes.transformer.attention_kernel)
    encoder.placement = dataclasses.replace(encoder.placement, cuda_graphs=True, cuda_graph_max_bytes=1 << 40)
    with torch.inference_mode():
        encoder._capture_graphs()
    assert engine.info()["cuda_graphs"] == len(token_ladder(256))  # 16 inputs of 64 tokens hold 256
    replayed = encoder.embed(ids)
    torch.testing.assert_close(replayed.vectors, eager.vectors, atol=1e-5, rtol=1e-4)
    assert encoder.passes.graphs.replays == replayed.passes and encoder.passes.graphs.eager == 0
    assert eager.padded_tokens == eager.real_tokens < replayed.padded_tokens  # each pass counts its graph's size
    sizes = [bucket.tokens for bucket in encoder.passes.graphs.graphs]
    assert replayed.padded_tokens <= eager.real_tokens + replayed.passes * TOKEN_STEP
    assert set(sizes) == set(token_ladder(256))


def test_packed_graphs_need_the_flash_kernel(tiny_model_dir, caplog):
    # On a CPU the packed passes' attention is the grouped SDPA, which reads its offsets on the
    # host: a capture would refuse it, so the encoder does not try.
    encoder = make_engine(tiny_model_dir, packed=True).encoder
    encoder.placement = dataclasses.replace(encoder.placement, cuda_graphs=True)
    with caplog.at_level(logging.WARNING, logger="handler.encoder"):
        encoder._capture_graphs()
    assert encoder.passes.graphs is None
    assert any("need the varlen_flash attention kernel" in line and "grouped_sdpa" in line
               for line in caplog.messages)


def test_the_start_up_check_passes_leave_padding_and_fit_their_graph(models):
    passes = passes_for(models["bert_dense"])
    generator = np.random.default_rng(1)
    for size, inputs, max_len, spare in [(16, 16, 16, 16), (256, 4, 64, 16), (1040, 4, 512, 32), (64, 64, 8, 64)]:
        graph = PackedGraph(size, passes.run_eager, inputs=inputs, max_len=max_len, spare=spare, pad_id=0,
                            device=torch.device("cpu"))
        for _ in range(20):
            inputs = _random_pass(graph, 100, generator)
            total = inputs.ids.numel()
            assert size - spare <= total < size and inputs.max_len == min(max_len, total)
            assert graph.holds(inputs)
