"""bench.overlap: the real TorchServe with a stand-in device whose passes hold one lock the
server's workers share and wait without a CPU (how the overlap of host and device work is
measured without a GPU); a short run, for its figures' shape, not their size."""

import fcntl
import os
import tempfile
import threading
import time

import pytest

from bench.overlap import measure
from tests.support.faults import FaultInjection


def test_the_stand_in_device_serializes_passes_without_a_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the lock's folder, as a server's TMPDIR is
    device = FaultInjection(device_pass_ms=50)
    began_cpu, began = time.process_time(), time.perf_counter()
    workers = [threading.Thread(target=device.occupy_device) for _ in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    # One device: three passes of 50 ms one after another, and waiting costs no CPU.
    assert time.perf_counter() - began >= 0.15 and time.process_time() - began_cpu < 0.05
    with open(tmp_path / "embedserve-standin-device.lock") as lock:  # released: free to take
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    FaultInjection().occupy_device()  # no delay set: returns at once, touches nothing
    assert os.listdir(tmp_path) == ["embedserve-standin-device.lock"]


@pytest.mark.integration
def test_overlap_runs_through_the_real_torchserve():
    # Two servers (a free device, then 5 ms passes), two workers each: the figures' shape only.
    result = measure(delays=[5], workers=[2], clients=16, seconds=2.0)
    assert result["host_ms_per_batch"] > 0 and result["host_us_per_text"] > 0
    runs = {(row["workers"], row["device_ms"]): row for row in result["runs"]}
    assert set(runs) == {(2, 0), (2, 5)}
    for row in runs.values():
        assert row["errors"] == {} and row["texts_per_s"] > 0 and row["passes_per_batch"] == 1.0, row
    delayed = runs[(2, 5)]
    assert delayed["ideal_texts_per_s"] >= delayed["series_texts_per_s"] > 0 and delayed["of_ideal"] > 0
