"""CUDA graph buckets: the ladder, the choice of bucket, padding into static buffers, the eager
fallback and the memory cap. A GPU runs the real capture; here a stand-in replays eagerly on the
same static buffers, so everything but the capture itself is exercised on a CPU."""

import torch

from handler.cuda_graphs import Bucket, GraphRunner, StaticGraph, choose, ladder
from handler.encoder import resolve_placement
from handler.settings import Settings
from tests.conftest import make_engine
from tests.test_engine import TEXTS


class EagerStandIn(StaticGraph):
    """Replays by running the forward pass on the static buffers, as the captured graph would."""

    def capture(self) -> None:
        self.replay()

    def replay(self) -> None:
        self.output = self.forward(self.ids, self.mask)


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


def runner_for(encoder, buckets, **kwargs):
    return GraphRunner.capture(encoder._pooled, buckets, pad_id=encoder.pad_id, device=torch.device("cpu"),
                               graph_type=EagerStandIn, **{"max_bytes": 1 << 40, "memory_in_use": lambda: 0, **kwargs})


def test_replay_through_static_buffers_equals_eager(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_batch_tokens=256, max_batch_size=8)
    encoder = engine.encoder
    ids = engine.token_ids(TEXTS * 3)
    eager = encoder.embed(ids).vectors
    with torch.inference_mode():
        encoder.graphs = runner_for(encoder, ladder([1, 2, 4, 8], [8, 16, 32, 64], max_tokens=10**6))
    replayed = encoder.embed(ids)
    torch.testing.assert_close(replayed.vectors, eager, atol=1e-5, rtol=1e-4)
    assert replayed.passes > 1 and encoder.graphs.replays == replayed.passes and encoder.graphs.eager == 0

    # Passes larger than every bucket run eagerly, with the same results.
    with torch.inference_mode():
        encoder.graphs = runner_for(encoder, [Bucket(8, 16)])
    torch.testing.assert_close(encoder.embed(ids).vectors, eager, atol=1e-5, rtol=1e-4)
    assert encoder.graphs.eager > 0 and encoder.graphs.replays > 0  # only the short passes fit
    encoder.graphs = None


def test_capture_stops_at_the_memory_cap(tiny_model_dir):
    encoder = make_engine(tiny_model_dir).encoder
    used = iter(range(0, 10**6, 100))  # each capture holds 100 more bytes
    buckets = ladder([1, 2, 4, 8], [16, 32], max_tokens=10**6)
    with torch.inference_mode():
        runner = runner_for(encoder, buckets, max_bytes=250, memory_in_use=lambda: next(used))
    assert len(runner.graphs) == 3  # the third capture crossed the cap
    assert set(runner.graphs) == set(buckets[:3])  # the largest are captured first


def test_cuda_graphs_are_ignored_on_a_cpu():
    settings = Settings.from_mapping({"device": "cpu", "cuda_graphs": True})
    placement = resolve_placement(settings, gpu_id=None, workers=1, cuda_available=False)
    assert placement.cuda_graph_buckets == ()


def test_torch_compile_gives_the_eager_results(tiny_model_dir):
    eager, compiled = make_engine(tiny_model_dir), make_engine(tiny_model_dir, compile=True)
    for texts in (TEXTS, ["another shape", "x"]):  # dynamic shapes: no recompile per length
        ids = eager.token_ids(texts)
        torch.testing.assert_close(compiled.encoder.embed(ids).vectors, eager.encoder.embed(ids).vectors,
                                   atol=1e-5, rtol=1e-4)
