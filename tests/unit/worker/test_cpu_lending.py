"""CPU lending between workers, on real file locks: separate CpuLending objects hold separate
open files, so within one process they lock against each other as two workers would."""

import subprocess
import sys
import threading
import time

import torch

from embedserve.handler.execution.placement import resolve_placement
from embedserve.handler.worker.cpu_lending import CpuLending
from embedserve.handler.settings import Settings
from tests.support.engines import make_engine
from tests.support.parts import ObservedBackend, on_backend
from embedserve.handler.model.inputs import plain_inputs


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
              "from embedserve.handler.worker.cpu_lending import CpuLending\n"
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


def test_a_pass_borrows_only_cpus_nobody_uses_or_wants(tmp_path):
    mine, other = CpuLending.join(4, 2, tmp_path), CpuLending.join(4, 2, tmp_path)
    with mine.batch():
        with mine.borrowing() as borrowed:
            assert borrowed == 2  # the other worker is idle
        with other.batch(), mine.borrowing() as borrowed:
            assert borrowed == 0  # the other worker is busy on its own CPUs
        with mine.borrowing() as borrowed:
            assert borrowed == 2  # and done again


def test_a_pass_borrows_at_most_what_it_asks_and_keeps_only_what_its_runtime_uses(tmp_path):
    mine, second, third, fourth = (CpuLending.join(4, 1, tmp_path) for _ in range(4))
    with mine.borrowing(at_most=2) as borrowed:
        assert borrowed == 2  # three idle, two asked for
        with third.borrowing() as theirs:
            assert theirs == 2  # the one left, and mine (not in a batch)
    only_all = lambda free: 3 if free == 3 else 0  # a runtime built for 1 or 4 threads  # noqa: E731
    with second.batch(), mine.borrowing(usable=only_all) as borrowed:
        assert borrowed == 0  # two idle are of no use to it: given back at once ...
        with fourth.borrowing() as theirs:
            assert theirs == 2  # ... for another worker to borrow (its own CPU and mine)
    with mine.borrowing(usable=only_all) as borrowed:
        assert borrowed == 3


def test_the_encoder_sizes_a_pass_s_threads_and_fits_them_to_its_runtime(tiny_model_dir, monkeypatch, tmp_path):
    monkeypatch.setattr("embedserve.handler.execution.placement.available_cpus", lambda: 4)
    placement = resolve_placement(Settings(), gpu_id=None, workers=4, cuda_available=False)
    assert (placement.cpu_threads, placement.lend_cpus) == (1, 4)
    engine = make_engine(tiny_model_dir, pass_overhead_tokens=32)
    seen = []
    counted = ObservedBackend(engine.encoder.backend, observe=lambda inputs: seen.append(torch.get_num_threads()))
    lending = CpuLending.join(4, 1, tmp_path)
    others = [CpuLending.join(4, 1, tmp_path) for _ in range(3)]
    encoder = on_backend(engine.encoder, counted, placement=placement, lending=lending)
    encoder.lend_min_tokens = 20  # a pass of 20 tokens is worth one more CPU, of 40 two, ...
    for rows, length in ((1, 19), (1, 20), (3, 15), (5, 20)):  # passes of 19, 20, 45 and 100 tokens
        encoder.embed(plain_inputs([[2] * length] * rows))
    assert seen == [1, 2, 3, 4]  # torch runs on any count: one more CPU per 20 tokens, three idle at most
    seen.clear()
    monkeypatch.setattr(ObservedBackend, "thread_counts", (1, 4))  # as an ONNX Runtime or OpenVINO worker's
    for rows, length in ((3, 15), (5, 20)):
        encoder.embed(plain_inputs([[2] * length] * rows))
    with others[0].batch():
        encoder.embed(plain_inputs([[2] * 20] * 5))
    assert seen == [1, 4, 1]  # 3 threads it cannot run; 2 CPUs idle of the 3 it needs: its own alone
    assert torch.get_num_threads() == 1


def test_an_owner_waits_one_pass_for_a_lent_cpu_and_keeps_it_from_then_on(tmp_path):
    borrower, owner = CpuLending.join(2, 1, tmp_path), CpuLending.join(2, 1, tmp_path)
    entered = threading.Event()
    finish = threading.Event()

    def owner_batch():
        with owner.batch():
            entered.set()
            finish.wait(5)

    with borrower.batch():
        with borrower.borrowing() as borrowed:
            assert borrowed == 1
            waiting = threading.Thread(target=owner_batch)
            waiting.start()
            time.sleep(0.2)
            assert not entered.is_set()  # its CPU is lent out: the owner waits, never oversubscribes
        assert entered.wait(5)  # the pass ended: the owner has its CPU back
        with borrower.borrowing() as borrowed:
            assert borrowed == 0  # and the next pass does not take it again
        finish.set()
        waiting.join(5)


def test_the_encoder_runs_small_passes_on_borrowed_cpus(tiny_model_dir, monkeypatch, tmp_path):
    monkeypatch.setattr("embedserve.handler.execution.placement.available_cpus", lambda: 2)
    placement = resolve_placement(Settings(max_batch_tokens=2048), gpu_id=None, workers=2, cuda_available=False)
    assert (placement.cpu_threads, placement.lend_cpus) == (1, 2)
    engine = make_engine(tiny_model_dir, pass_overhead_tokens=32)
    seen = []
    counted = ObservedBackend(engine.encoder.backend, observe=lambda inputs: seen.append(torch.get_num_threads()))
    lending, other_worker = CpuLending.join(2, 1, tmp_path), CpuLending.join(2, 1, tmp_path)
    encoder = on_backend(engine.encoder, counted, placement=placement, lending=lending,
                         max_batch_tokens=placement.max_batch_tokens)
    encoder.embed(plain_inputs([[2] * 20]))  # a small pass, the other worker idle: both CPUs
    encoder.embed(plain_inputs([[2] * 60] * 20))  # one pass of 1200 padded tokens, over 1024: its own CPU only
    with other_worker.batch():
        encoder.embed(plain_inputs([[2] * 20]))  # the other worker busy: its own CPU only
    encoder.lend_min_tokens = 21  # as measure_speed sets it for a model whose short passes are quick
    encoder.embed(plain_inputs([[2] * 20]))  # too short a pass to gain from a second CPU: its own only
    encoder.embed(plain_inputs([[2] * 21]))
    assert seen == [2, 1, 1, 1, 2]
    assert torch.get_num_threads() == 1  # back to its share after each pass


def test_lending_is_off_with_explicit_threads_or_opted_out():
    assert resolve_placement(Settings(cpu_threads=1), None, 2, False).lend_cpus == 0
    assert resolve_placement(Settings(lend_idle_cpus=False), None, 1, False).lend_cpus == 0
    assert resolve_placement(Settings(device="cuda"), 0, 1, True).lend_cpus == 0


def test_an_unusable_lock_directory_turns_lending_off(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert CpuLending.join(2, 1, blocker / "locks") is None
