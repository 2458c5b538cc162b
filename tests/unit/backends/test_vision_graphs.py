"""CUDA graphs of a fixed-size vision tower (backends/vision_graphs.py) on the tests' tiny CLIP:
the smallest graph that holds a pass replays it, a pass larger than every graph runs eagerly,
the planner's padded positions count the graph's rows, and graphs that replay unlike the eager
pass are all dropped.

These run on a CPU with a stand-in that replays eagerly on the same static buffers
(tests/support/graphs.py): everything but the capture itself is exercised. That a real capture
records the tower's pass, and what it saves, needs a GPU (scripts/gpu_run.sh's `images` step
reports `image_cuda_graphs` and the speed); no GPU has run it yet."""

import logging

import pytest
import torch

from embedserve.handler.backends.vision import ImageInputs, VisionBackend
from embedserve.handler.backends.vision_graphs import ImageBucket, ImageGraphs, StaticImages
from embedserve.handler.model.towers import ImageTower
from tests.support.graphs import EagerReplay, StaleReplay
from tests.support.image_models import make_clip

SHAPE = (3, 224, 224)
POSITIONS = 49  # (224 / 32) ** 2 patches


class EagerImages(EagerReplay, StaticImages):
    captured: list[ImageBucket] = []


class StaleImages(StaleReplay, StaticImages):
    captured: list[ImageBucket] = []


class CountingTower:
    def __init__(self, tower: ImageTower):
        self.tower, self.calls = tower, 0

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.tower(pixels)


@pytest.fixture(scope="module")
def tower(tmp_path_factory):
    from transformers import CLIPModel

    folder = make_clip(tmp_path_factory.mktemp("vision-graphs") / "clip")
    return ImageTower(CLIPModel.from_pretrained(folder, dtype=torch.float32).eval())


def capture(tower, batches, graph_type=EagerImages, **kwargs):
    settings = {"max_bytes": 1 << 40, "tolerance": 1e-4, **kwargs}
    with torch.inference_mode():
        return ImageGraphs.capture(tower, batches, shape=SHAPE, positions=POSITIONS, dtype=torch.float32,
                                   device=torch.device("cpu"), graph_type=graph_type, **settings)


def pixels(rows: int, seed: int) -> torch.Tensor:
    return torch.randn((rows, *SHAPE), generator=torch.Generator().manual_seed(seed))


def test_a_pass_replays_the_smallest_graph_that_holds_it_and_equals_eager(tower):
    counting = CountingTower(tower)
    graphs = capture(counting, [1, 2, 4, 8])
    assert sorted(bucket.batch for bucket in graphs.graphs) == [1, 2, 4, 8]
    backend = VisionBackend(tower, dtype=torch.float32, device=torch.device("cpu"), graphs=graphs)
    assert backend.describe()["cuda_graphs"] == 4
    with torch.inference_mode():
        for rows, seed in ((1, 1), (3, 2), (8, 3), (3, 4)):
            inputs = ImageInputs(pixels(rows, seed), POSITIONS)
            counting.calls = 0
            replayed = backend.run(inputs)
            assert counting.calls == 1  # the stand-in's replay: one pass of the graph's own rows
            torch.testing.assert_close(replayed, tower(inputs.pixels), atol=1e-5, rtol=0)
            bucket_rows = next(batch for batch in (1, 2, 4, 8) if batch >= rows)
            assert backend.computed_tokens(inputs) == bucket_rows * POSITIONS


def test_a_pass_larger_than_every_graph_runs_eagerly(tower):
    counting = CountingTower(tower)
    graphs = capture(counting, [1, 2])
    backend = VisionBackend(counting, dtype=torch.float32, device=torch.device("cpu"), graphs=graphs)
    inputs = ImageInputs(pixels(3, 5), POSITIONS)
    with torch.inference_mode():
        counting.calls = 0
        out = backend.run(inputs)
    assert counting.calls == 1 and out.shape[0] == 3
    assert backend.computed_tokens(inputs) == 3 * POSITIONS


def test_graphs_that_replay_stale_output_are_all_dropped(tower, caplog):
    with caplog.at_level(logging.ERROR, logger="embedserve.handler.backends.cuda_graphs"):
        graphs = capture(tower, [1, 2, 4], graph_type=StaleImages)
    assert graphs.graphs == {} and graphs.graphs.why_none.startswith("dropped: bucket ")
    assert any("every graph is dropped" in line for line in caplog.messages)


def test_the_memory_cap_leaves_the_larger_batches_eager(tower):
    from tests.support.graphs import BYTES_PER_TOKEN

    graphs = capture(tower, [1, 2, 4, 8], max_bytes=2 * POSITIONS * BYTES_PER_TOKEN)
    assert sorted(bucket.batch for bucket in graphs.graphs) == [1, 2]


def test_a_gpu_worker_s_selection_captures_the_batch_sizes_a_pass_can_hold(tower, monkeypatch):
    """The selection's choice of graphs (execution/select.py), with the stand-in for the capture:
    the ladder's batch sizes within the pass bounds; none for a NaFlex tower."""
    from dataclasses import replace
    from types import SimpleNamespace

    from embedserve.handler.backends.cuda_graphs import ladder
    from embedserve.handler.execution import select
    from embedserve.handler.model.description import Towers

    real = ImageGraphs.capture
    monkeypatch.setattr(select.ImageGraphs, "capture",
                        lambda *args, **kwargs: real(*args, **{**kwargs, "graph_type": EagerImages}))
    model = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(num_channels=3, image_size=224)))
    placement = SimpleNamespace(cuda_graph_buckets=tuple(ladder([1, 2, 4, 8, 16, 64], [16], 10**6)),
                                max_batch_tokens=8 * POSITIONS, dtype=torch.float32, device=torch.device("cpu"),
                                cuda_graph_max_bytes=1 << 40)
    towers = Towers("CLIPModel", 16, 77, POSITIONS)
    parts = SimpleNamespace(towers=towers, max_batch_size=256)
    graphs, why = select._vision_graphs(tower, model, placement, parts)
    assert why == "captured 4" and sorted(bucket.batch for bucket in graphs.graphs) == [1, 2, 4, 8]
    naflex = SimpleNamespace(towers=replace(towers, own_grid=True), max_batch_size=256)
    assert select._vision_graphs(tower, model, placement, naflex) == \
        (None, "none: a variable-resolution tower resizes its position table per image on the host")
