"""CPU lending between workers, on real file locks: separate CpuLending objects hold separate
open files, so within one process they lock against each other as two workers would."""

import subprocess
import sys
import threading
import time

import torch

from handler.cpu_lending import CpuLending
from handler.encoder import resolve_placement
from handler.settings import Settings
from tests.conftest import make_engine


def test_workers_claim_distinct_home_cpus_until_none_is_left(tmp_path):
    first, second = CpuLending.join(2, 1, tmp_path), CpuLending.join(2, 1, tmp_path)
    assert first.home == [0] and second.home == [1]
    assert CpuLending.join(2, 1, tmp_path) is None  # a third worker stays out of the scheme
    first.close()
    third = CpuLending.join(2, 1, tmp_path)
    assert third.home == [0]  # a departed worker's CPU is free again
    second.close()
    third.close()


def test_a_killed_worker_frees_its_home_cpu(tmp_path):
    script = ("import pathlib, time\n"
              "from handler.cpu_lending import CpuLending\n"
              f"lending = CpuLending.join(1, 1, pathlib.Path({str(tmp_path)!r}))\n"
              "print(lending.home, flush=True)\n"
              "time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "[0]"
        assert CpuLending.join(1, 1, tmp_path) is None
    finally:
        holder.kill()
        holder.wait()
    assert CpuLending.join(1, 1, tmp_path).home == [0]


def test_a_small_batch_borrows_only_idle_cpus(tmp_path):
    mine, other = CpuLending.join(4, 2, tmp_path), CpuLending.join(4, 2, tmp_path)
    with mine.running(borrow=True) as threads:
        assert threads == 4
    with mine.running(borrow=False) as threads:
        assert threads == 2
    with other.running(borrow=False), mine.running(borrow=True) as threads:
        assert threads == 2  # the other worker is busy on its own CPUs


def test_an_owner_waits_for_a_lent_cpu_and_gets_it_back(tmp_path):
    borrower, owner = CpuLending.join(2, 1, tmp_path), CpuLending.join(2, 1, tmp_path)
    entered: list[float] = []

    def owner_batch():
        with owner.running(borrow=False) as threads:
            entered.append(time.monotonic())
            entered.append(threads)

    with borrower.running(borrow=True) as threads:
        assert threads == 2
        waiting = threading.Thread(target=owner_batch)
        waiting.start()
        time.sleep(0.2)
        assert not entered  # its CPU is lent out: the owner waits, it does not oversubscribe
        returned = time.monotonic()
    waiting.join(5)
    assert entered[0] >= returned and entered[1] == 1  # ran once its CPU came back


def test_the_encoder_runs_small_batches_on_borrowed_cpus(tiny_model_dir, monkeypatch, tmp_path):
    monkeypatch.setattr("handler.encoder.available_cpus", lambda: 2)
    monkeypatch.setattr("handler.cpu_lending.lock_directory", lambda: tmp_path)
    placement = resolve_placement(Settings(), gpu_id=None, workers=2, cuda_available=False)
    assert (placement.cpu_threads, placement.lend_cpus) == (1, 2)
    engine = make_engine(tiny_model_dir, pass_overhead_tokens=32)
    engine.encoder.placement = placement
    engine.encoder.lending = CpuLending.join(2, 1, tmp_path)
    seen = []
    run_pass = engine.encoder._run_pass
    monkeypatch.setattr(engine.encoder, "_run_pass", lambda ids, mask: (seen.append(torch.get_num_threads()),
                                                                        run_pass(ids, mask))[1])
    engine.encoder.embed([[2] * 20])  # one small pass: both CPUs
    engine.encoder.embed([[2] * 60] * 5)  # 300 padded tokens: its own CPU only
    assert seen == [2, 1]
    assert torch.get_num_threads() == 1  # back to its share after the batch


def test_lending_is_off_with_explicit_threads_or_opted_out():
    assert resolve_placement(Settings(cpu_threads=1), None, 2, False).lend_cpus == 0
    assert resolve_placement(Settings(lend_idle_cpus=False), None, 1, False).lend_cpus == 0
    assert resolve_placement(Settings(device="cuda"), 0, 1, True).lend_cpus == 0


def test_an_unusable_lock_directory_turns_lending_off(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert CpuLending.join(2, 1, blocker / "locks") is None
