"""bench/plot_workers.py: a worker sweep's rows as lines, texts/s and GPU busy against workers."""

from bench.plot_workers import plot, sweep

SERVING = {"device": "cuda", "gpu": {"name": "H200"}, "shapes": [
    {"clients": 256, "texts_per_request": 1, "workers": 8, "texts_per_s": 20000.0, "gpu_util_mean": 40.0},
    {"clients": 256, "texts_per_request": 1, "workers": 2, "texts_per_s": 7000.0, "gpu_util_mean": 14.0},
    {"clients": 256, "texts_per_request": 1, "workers": 2, "texts_per_s": 7200.0, "gpu_util_mean": 15.0},
    {"clients": 64, "texts_per_request": 32, "workers": 2, "texts_per_s": 30000.0},
    {"clients": 64, "texts_per_request": 32, "workers": 4, "error": "TimeoutError: ..."},
    {"clients": 1, "texts_per_request": 1, "workers": 2, "skipped": "out of budget"},
]}
PEER = {"peer": "infinity", "shapes": [{"clients": 256, "texts_per_request": 1, "texts_per_s": 9000.0,
                                        "gpu_util_mean": 30.0}]}


def test_each_shape_is_a_line_by_workers_with_its_best_row_at_a_count():
    assert sweep(SERVING) == {(64, 32): [(2, 30000.0, None)],
                              (256, 1): [(2, 7200.0, 15.0), (8, 20000.0, 40.0)]}


def test_the_plot_is_written_with_the_peer_beside_it(tmp_path):
    out = tmp_path / "workers.png"
    plot(SERVING, out, PEER)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
