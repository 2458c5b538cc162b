"""The CPU engine trial: which engines are tried on which CPU, the choice with its margin, one
choice per model on a machine, and the whole selection on a real model with its real backends."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
import torch

from embedserve.handler.backends.openvino_runtime import openvino_available
from embedserve.handler.execution import engine_trial, select
from embedserve.handler.execution.engine_trial import MARGIN, Timing, bf16_challengers, choose, shared_trial
from embedserve.handler.execution.placement import resolve_placement
from embedserve.handler.settings import Settings
from embedserve.handler.worker.cpu_features import bf16_units, cpu_flags, cpu_model_name
from tests.support.engines import TEXTS, make_engine
from embedserve.handler.model.inputs import ModelInput, plain_inputs

VERIFIED = {"cpu_bf16_engines": ["torch", "openvino"]}


def cpu_placement(**settings):
    return resolve_placement(Settings.from_mapping({"device": "cpu", **settings}), gpu_id=None, workers=1,
                             cuda_available=False)


def test_cpu_flags_and_model_are_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
                       "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16\n\nprocessor\t: 1\n")
    flags = cpu_flags(cpuinfo)
    assert bf16_units(flags) == "amx_bf16" and cpu_model_name(cpuinfo) == "Intel(R) Xeon(R) Platinum 8480+"
    assert bf16_units(frozenset({"avx2", "avx512f", "avx512_bf16"})) == "avx512_bf16"
    assert bf16_units(frozenset({"avx2", "fma"})) is None  # an AVX2-only CPU
    assert cpu_flags(tmp_path / "missing") == frozenset() and cpu_model_name(tmp_path / "missing") == "unknown"


AVX2 = frozenset({"avx2", "fma"})
AMX = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16"})


@pytest.mark.parametrize("settings, flags, why", [
    ({}, AVX2, "no bfloat16 units"),
    ({"dtype": "float32"}, AMX, "the dtype setting"),
    ({"dtype": "bfloat16"}, AMX, "the dtype setting"),
    ({"engine": "onnxruntime"}, AMX, "engine, compile and packed settings"),
    ({"packed": True}, AMX, "engine, compile and packed settings"),
    ({"cpu_bf16_engines": []}, AMX, "no bfloat16 engine its build verified"),
])
def test_no_bf16_engine_is_tried_where_the_cpu_settings_or_archive_rule_it_out(settings, flags, why):
    merged = {**VERIFIED, **settings}
    challengers, reason = bf16_challengers(Settings.from_mapping(merged), cpu_placement(**merged), flags=flags)
    assert challengers == [] and why in reason


def test_verified_engines_are_tried_on_a_cpu_with_bf16_units():
    for flags in (AMX, AMX - {"amx_bf16"}):
        assert bf16_challengers(Settings.from_mapping(VERIFIED), cpu_placement(**VERIFIED), flags=flags)[0] == \
            ["torch", "openvino"]


def test_the_cpu_engine_settings_are_validated():
    with pytest.raises(ValueError, match="cpu_bf16_engines"):
        Settings.from_mapping({"cpu_bf16_engines": ["onnxruntime"]})
    with pytest.raises(ValueError, match="engine"):
        Settings.from_mapping({"engine": "tensorrt"})


def timings(**speeds):
    """name=(tokens/s, one-text ms) -> Timing per candidate."""
    return {name.replace("_", " "): Timing(*values) for name, values in speeds.items()}


def test_a_challenger_wins_only_by_the_margin_and_never_slower_on_one_text():
    default = "onnxruntime float32"
    assert choose(timings(onnxruntime_float32=(1000, 10), torch_bfloat16=(1500, 9)), default)[0] == "torch bfloat16"
    # Faster, but within the margin: noise could have made it so.
    near = timings(onnxruntime_float32=(1000, 10), torch_bfloat16=(1000 * MARGIN * 0.99, 5))
    assert choose(near, default) == (default, pytest.approx(choose(near, default)[1]))
    assert "short of the 1.2x margin" in choose(near, default)[1]
    # Much faster on full passes, but one text takes far longer: latency would regress.
    assert choose(timings(onnxruntime_float32=(1000, 10), torch_bfloat16=(3000, 13)), default)[0] == default
    # The fastest challenger that clears the margin.
    three = timings(onnxruntime_float32=(1000, 10), torch_bfloat16=(1600, 9), openvino_bfloat16=(2400, 5))
    engine, reason = choose(three, default)
    assert engine == "openvino bfloat16" and "2.40x" in reason
    assert choose(timings(onnxruntime_float32=(1000, 10)), default)[0] == default


def _one_worker(directory: str, results) -> None:
    """A worker's part of the trial: read the outcome, or measure (slowly) and record it."""
    with shared_trial("key", Path(directory)) as trial:
        if trial.recorded is None:
            time.sleep(0.5)  # measuring: the other worker must wait, not measure too
            trial.record(f"choice of {multiprocessing.current_process().pid}", "measured",
                         timings(torch_bfloat16=(1, 1)))
            results.put(("measured", multiprocessing.current_process().pid))
        else:
            results.put(("read", trial.recorded["choice"]))


def test_the_workers_of_a_server_make_one_choice(tmp_path):
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    workers = [context.Process(target=_one_worker, args=(str(tmp_path), results)) for _ in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
    outcomes = sorted(results.get(timeout=5) for _ in workers)
    measured = [pid for kind, pid in outcomes if kind == "measured"]
    assert len(measured) == 1, outcomes  # one worker measured; the others read its choice
    assert [choice for kind, choice in outcomes if kind == "read"] == [f"choice of {measured[0]}"] * 2


def test_an_unusable_lock_directory_means_every_worker_measures(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    with shared_trial("key", blocked / "sub") as trial:
        assert trial.recorded is None
        trial.record("torch bfloat16", "measured", {})  # nowhere to write: nothing raised


def test_without_a_writable_cache_folder_the_servers_own_folder_shares_the_trial(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("EMBEDSERVE_CACHE_DIR", str(blocked / "cache"))
    monkeypatch.setattr(engine_trial, "lock_directory", lambda: tmp_path / "server-tmp")
    with shared_trial("key") as trial:
        trial.record("torch bfloat16", "measured", {})
    assert (tmp_path / "server-tmp" / "engine-trial-key.json").is_file()


def test_the_cache_folder_is_the_settings_then_the_users(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBEDSERVE_CACHE_DIR", str(tmp_path / "mine"))
    assert engine_trial.trial_directory() == tmp_path / "mine" / "engine-trials"
    monkeypatch.delenv("EMBEDSERVE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert engine_trial.trial_directory() == tmp_path / "xdg" / "embedserve" / "engine-trials"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert engine_trial.trial_directory() == tmp_path / "home" / ".cache" / "embedserve" / "engine-trials"

    def homeless():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(engine_trial.Path, "home", homeless)  # a container's arbitrary user id
    assert engine_trial.trial_directory() is None
    monkeypatch.setattr(engine_trial, "lock_directory", lambda: tmp_path / "server-tmp")
    with shared_trial("key") as trial:
        trial.record("torch bfloat16", "measured", {})
    assert (tmp_path / "server-tmp" / "engine-trial-key.json").is_file()


def test_servers_of_one_archive_share_a_trial_and_what_changes_the_passes_does_not(tmp_path, monkeypatch):
    """An archive is keyed by its revision, wherever TorchServe unpacks it and whichever server
    process starts the worker; a folder without a revision by its path and server process."""
    placement = cpu_placement(cpu_threads=1)
    archive = Settings.from_mapping({"device": "cpu", "revision": "sha256:abc"})
    names = ["onnxruntime float32", "torch bfloat16"]
    key = engine_trial.trial_key(tmp_path / "one", archive, placement, names)
    monkeypatch.setattr(engine_trial.os, "getppid", lambda: 1)  # another server process
    assert engine_trial.trial_key(tmp_path / "two", archive, placement, names) == key
    changed = [
        engine_trial.trial_key(tmp_path / "one", Settings.from_mapping({"device": "cpu", "revision": "sha256:abd"}),
                               placement, names),
        engine_trial.trial_key(tmp_path / "one", archive, cpu_placement(cpu_threads=2), names),
        engine_trial.trial_key(tmp_path / "one", archive, placement, names[:1]),
    ]
    monkeypatch.setattr(engine_trial, "_boot_id", lambda: "another boot")
    changed.append(engine_trial.trial_key(tmp_path / "one", archive, placement, names))
    assert key not in changed and len(set(changed)) == len(changed)
    folder = Settings.from_mapping({"device": "cpu"})
    first = engine_trial.trial_key(tmp_path / "one", folder, placement, names)
    assert engine_trial.trial_key(tmp_path / "two", folder, placement, names) != first
    monkeypatch.setattr(engine_trial.os, "getppid", lambda: 2)
    assert engine_trial.trial_key(tmp_path / "one", folder, placement, names) != first


@pytest.fixture
def trial_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_trial, "trial_directory", lambda: tmp_path / "locks")
    monkeypatch.setattr(engine_trial, "bf16_units", lambda flags=None: "amx_bf16")  # any CPU runs bf16, if slowly
    return tmp_path / "locks"


def stand_in_timings(winner: str):
    """Timings that make `winner` the fastest by far, whatever this CPU measures."""
    def timed(backends, pad_id, max_positions):
        assert len(backends) >= 2
        return {name: Timing(10_000.0 if name == winner else 1_000.0, 1.0) for name in backends}
    return timed


def test_the_selected_bf16_engine_serves_with_its_dtype_in_info_and_cache_identity(onnx_model_dir, trial_directory,
                                                                                  monkeypatch):
    monkeypatch.setattr(select, "time_candidates", stand_in_timings("torch bfloat16"))
    engine = make_engine(onnx_model_dir, **VERIFIED, cache_entries=16)
    info = engine.info()
    assert (info["model_dtype"], info["engine"]) == ("bfloat16", "torch")
    assert info["selected_by"]["dtype"].startswith("measured: torch bfloat16 ran 10.00x onnxruntime float32")
    assert info["selected_by"]["engine"] == info["selected_by"]["dtype"]
    expected = {"onnxruntime float32", "torch bfloat16"} | ({"openvino bfloat16"} if openvino_available() else set())
    assert set(info["selected_by"]["speeds"]) == expected
    # Cached vectors are keyed by the dtype and engine that computed them: the forced bf16 torch
    # engine's, not float32's.
    ids = engine.text.token_ids(TEXTS[:1])[0]
    forced = {dtype: make_engine(onnx_model_dir, dtype=dtype, engine="torch",
                                 cache_entries=16).cache.key(ModelInput(ids)) for dtype in ("bfloat16", "float32")}
    assert engine.cache.key(ModelInput(ids)) == forced["bfloat16"] != forced["float32"]
    assert next(engine.encoder.backend.transformer.model.parameters()).dtype == torch.bfloat16


def test_a_second_worker_reads_the_choice_instead_of_measuring(onnx_model_dir, trial_directory, monkeypatch):
    monkeypatch.setattr(select, "time_candidates", stand_in_timings("onnxruntime float32"))
    first = make_engine(onnx_model_dir, **VERIFIED).info()
    assert (first["model_dtype"], first["engine"]) == ("float32", "onnxruntime")
    assert "short of the 1.2x margin" in first["selected_by"]["dtype"]

    def no_measuring(*args):
        raise AssertionError("the second worker measured again")

    monkeypatch.setattr(select, "time_candidates", no_measuring)
    second = make_engine(onnx_model_dir, **VERIFIED).info()
    assert (second["model_dtype"], second["engine"]) == ("float32", "onnxruntime")
    assert second["selected_by"]["dtype"].endswith("by an earlier worker on this machine")
    assert second["selected_by"]["speeds"] == first["selected_by"]["speeds"]


def test_a_challenger_that_cannot_load_is_left_out(onnx_model_dir, trial_directory, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("this model's graph is not supported")

    monkeypatch.setattr(select, "OpenVinoTransformer", broken)
    monkeypatch.setattr(select, "openvino_available", lambda: True)
    monkeypatch.setattr(select, "time_candidates", stand_in_timings("torch bfloat16"))
    info = make_engine(onnx_model_dir, **VERIFIED).info()
    assert set(info["selected_by"]["speeds"]) == {"onnxruntime float32", "torch bfloat16"}
    assert info["model_dtype"] == "bfloat16"


def test_the_real_trial_times_every_candidate_and_serves_its_choice(onnx_model_dir, trial_directory):
    """No stand-in: the real passes timed on this CPU. Whatever wins, /info and the served
    vectors agree with it."""
    engine = make_engine(onnx_model_dir, **VERIFIED)
    info = engine.info()
    speeds = info["selected_by"]["speeds"]
    assert all(s["tokens_per_s"] > 0 and s["one_text_ms"] > 0 for s in speeds.values())
    chosen = f"{info['engine']} {info['model_dtype']}"
    assert chosen in speeds and chosen == choose({n: Timing(**s) for n, s in speeds.items()},
                                                 "onnxruntime float32")[0]
    assert engine.encoder.embed(plain_inputs(engine.text.token_ids(TEXTS))).vectors.isfinite().all()


def test_forced_settings_skip_the_trial(onnx_model_dir, trial_directory, monkeypatch):
    def no_measuring(*args):
        raise AssertionError("a forced choice measured")

    monkeypatch.setattr(select, "time_candidates", no_measuring)
    assert make_engine(onnx_model_dir, **VERIFIED, dtype="float32").info()["engine"] == "onnxruntime"
    forced = make_engine(onnx_model_dir, **VERIFIED, dtype="bfloat16").info()
    assert (forced["model_dtype"], forced["engine"], forced["selected_by"]["dtype"]) == \
        ("bfloat16", "torch", "the dtype setting")
    if openvino_available():
        forced = make_engine(onnx_model_dir, dtype="bfloat16", engine="openvino").info()
        assert (forced["model_dtype"], forced["engine"]) == ("bfloat16", "openvino")


def test_a_cpu_without_bf16_units_serves_float32_without_measuring(onnx_model_dir, trial_directory, monkeypatch):
    monkeypatch.setattr(engine_trial, "bf16_units", lambda flags=None: None)
    monkeypatch.setattr(select, "time_candidates", stand_in_timings("torch bfloat16"))
    info = make_engine(onnx_model_dir, **VERIFIED).info()
    assert (info["model_dtype"], info["engine"]) == ("float32", "onnxruntime")
    assert "no bfloat16 units" in info["selected_by"]["dtype"] and "speeds" not in info["selected_by"]


def test_openvino_refuses_what_it_cannot_run(tiny_model_dir, onnx_model_dir):
    with pytest.raises(ValueError, match="openvino needs the build's transformer.onnx"):
        make_engine(tiny_model_dir, engine="openvino")
    with pytest.raises(ValueError, match="openvino runs float32 or bfloat16 on a CPU"):
        make_engine(onnx_model_dir, engine="openvino", dtype="int8")


@pytest.mark.skipif(not openvino_available(), reason="the openvino package is not installed")
def test_openvino_passes_are_padded_to_few_shapes_and_match_float32(onnx_model_dir):
    from embedserve.handler.backends.openvino_runtime import PAD_MULTIPLE

    engine = make_engine(onnx_model_dir, dtype="float32", engine="openvino")
    inputs = engine.encoder.backend.prepare(plain_inputs([[5] * 13, [6] * 3]))
    assert inputs.ids.shape == (2, 16) and PAD_MULTIPLE == 8
    got = engine.encoder.embed(plain_inputs(engine.text.token_ids(TEXTS))).vectors
    want = make_engine(onnx_model_dir, dtype="float32").encoder.embed(plain_inputs(engine.text.token_ids(TEXTS))).vectors
    assert torch.nn.functional.cosine_similarity(got, want).min() > 0.9999


def test_vision_towers_are_timed_in_turns_on_the_same_pixels():
    calls = []

    def tower(name: str, seconds: float):
        def run(pixels):
            calls.append((name, tuple(pixels.shape)))
            time.sleep(seconds)
            return pixels[:, 0, 0, :2]
        return run

    timings = engine_trial.time_image_towers({"slow": tower("slow", 0.004), "fast": tower("fast", 0.001)}, size=8,
                                             positions=5)
    assert timings["fast"].tokens_per_s > timings["slow"].tokens_per_s  # patches a second: 4 images of 5
    assert timings["fast"].one_text_ms < timings["slow"].one_text_ms
    # A warm-up round and ROUNDS timed ones, each tower on a full pass and on one image, in turns.
    assert calls[:4] == [("slow", (4, 3, 8, 8)), ("slow", (1, 3, 8, 8)), ("fast", (4, 3, 8, 8)), ("fast", (1, 3, 8, 8))]
    assert len(calls) == 4 * (engine_trial.ROUNDS + 1)
    assert engine_trial.choose(timings, "slow", one="image")[1].startswith("measured: fast ran")
