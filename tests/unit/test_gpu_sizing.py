"""The sizing rule's figures from a worker sweep (bench/gpu_serve.py `sizing`): GPU memory a
worker holds, fitted over the worker counts measured, and how many workers fit within the share."""

import pytest

from bench.gpu_serve import MEMORY_SHARE, sizing

GPU = {"name": "a GPU", "memory_total_mib": 100_000}


def test_memory_per_worker_is_fitted_over_the_counts_and_gives_the_workers_within_the_share():
    points = [{"workers": 2, "gpu_mem_idle_mib": 3_000}, {"workers": 4, "gpu_mem_idle_mib": 5_000},
              {"workers": 8, "gpu_mem_idle_mib": 9_000}]  # 1,000 MiB a worker over a 1,000 MiB base
    shapes = [{"workers": 2, "gpu_mem_used_mib_max": 5_000}, {"workers": 2, "gpu_mem_used_mib_max": 6_000},
              {"workers": 4, "gpu_mem_used_mib_max": 11_000}, {"workers": 8, "gpu_mem_used_mib_max": 21_000},
              {"workers": 8, "error": "a load process died"}]  # at load: 2,500 MiB a worker, the largest of each count
    found = sizing(points, shapes, GPU)
    assert found["per_worker_idle_mib"] == 1_000 and found["per_worker_at_load_mib"] == 2_500
    assert found["base_mib"] == 1_000 and found["share"] == MEMORY_SHARE
    assert found["workers_within_share"] == int((MEMORY_SHARE * 100_000 - 1_000) // 2_500) == 31


@pytest.mark.parametrize("gpu, points, why", [
    (None, [{"workers": 2, "gpu_mem_idle_mib": None}], "no GPU"),
    (GPU, [{"workers": 2, "gpu_mem_idle_mib": 3_000}], "fewer than two worker counts"),
])
def test_without_a_gpu_or_a_second_count_it_says_why(gpu, points, why):
    shapes = [{"workers": 2, "gpu_mem_used_mib_max": 5_000}]
    assert sizing(points, shapes, gpu)["why"].startswith(why)
