"""The CPU engine: the build's ONNX export run by ONNX Runtime, against the torch engine and
sentence-transformers, its selection, its thread sessions and its failure paths."""

import json
import shutil

import numpy as np
import pytest
import torch

from embedserve.handler.backends.onnx_runtime import INT8_ONNX_FILE, ONNX_FILE, OnnxTransformer, is_out_of_memory, load_session
from embedserve.handler.execution.placement import resolve_placement
from embedserve.handler.execution.select import choose_engine
from embedserve.handler.api.exchange import RawRequest
from embedserve.handler.settings import Settings, SettingsError
import embedserve.archive.onnx_export as onnx_export
from tests.support.child import run_child
from tests.support.engines import TEXTS, make_engine
from tests.support.tiny_model import PROMPTS


def embeddings(engine, body):
    [response] = engine.handle([RawRequest(json.dumps(body).encode())])
    assert response.status == 200, response.body
    return np.array([row["embedding"] for row in json.loads(response.body)["data"]])


def test_a_build_export_is_served_by_onnx_runtime_and_matches_torch(onnx_model_dir, tiny_model_dir):
    served = make_engine(onnx_model_dir)
    assert served.info()["engine"] == "onnxruntime" and isinstance(served.encoder.backend.transformer, OnnxTransformer)
    torch_engine = make_engine(tiny_model_dir)
    assert torch_engine.info()["engine"] == "torch"
    texts = [*TEXTS, "a", "hello " * 60]  # one input over max_length: truncated alike
    for body in ({"input": texts}, {"input": texts, "prompt_name": "query"}, {"input": texts, "dimensions": 8}):
        ours, reference = embeddings(served, body), embeddings(torch_engine, body)
        cosine = (ours * reference).sum(axis=1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)
        assert cosine.min() >= 0.99999, body


def test_onnx_runtime_matches_sentence_transformers(onnx_model_dir):
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(onnx_model_dir), device="cpu")
    texts = [*TEXTS, "a"]
    ours = embeddings(make_engine(onnx_model_dir), {"input": texts})
    expected = reference.encode(texts, normalize_embeddings=True)
    assert (ours * expected).sum(axis=1).min() >= 0.9999
    query = embeddings(make_engine(onnx_model_dir), {"input": texts, "prompt_name": "query"})
    expected = reference.encode(texts, prompt=PROMPTS["query"], normalize_embeddings=True)
    assert (query * expected).sum(axis=1).min() >= 0.9999


def test_the_engine_is_chosen_by_device_dtype_and_files(onnx_model_dir, tiny_model_dir, tmp_path):
    def engine(settings, model_dir=onnx_model_dir, cuda=False):
        settings = Settings(**settings)
        placement = resolve_placement(settings, gpu_id=0 if cuda else None, workers=1, cuda_available=cuda,
                                      model_dir=model_dir)
        return choose_engine(settings, placement, model_dir)[0]

    assert engine({}) == "onnxruntime"
    assert engine({}, model_dir=tiny_model_dir) == "torch"  # no export in the archive
    assert engine({}, model_dir=None) == "torch"
    assert engine({"engine": "torch"}) == "torch"
    assert engine({}, cuda=True) == "torch"  # PyTorch stays the GPU engine
    assert engine({"dtype": "int8"}) == "torch"  # the float32 export is no int8 one
    (tmp_path / INT8_ONNX_FILE).touch()  # what an int8 build ships (embedserve/archive/int8_calibration.py)
    assert engine({"dtype": "int8"}, model_dir=tmp_path) == "onnxruntime"
    assert engine({"dtype": "int8", "engine": "torch"}, model_dir=tmp_path) == "torch"
    assert engine({}, model_dir=tmp_path) == "torch"
    assert engine({"dtype": "bfloat16"}) == "torch"
    assert engine({"compile": True}) == "torch"
    assert engine({"engine": "onnxruntime"}) == "onnxruntime"
    with pytest.raises(ValueError, match="'engine': onnxruntime needs the build's transformer.onnx"):
        engine({"engine": "onnxruntime"}, model_dir=tiny_model_dir)
    with pytest.raises(ValueError, match="'engine': onnxruntime needs the build's transformer.int8.onnx"):
        engine({"engine": "onnxruntime", "dtype": "int8"})
    with pytest.raises(ValueError, match="'engine': onnxruntime runs float32 or int8 on a CPU"):
        engine({"engine": "onnxruntime", "compile": True})
    with pytest.raises(ValueError, match="'engine': onnxruntime runs float32 or int8 on a CPU"):
        engine({"engine": "onnxruntime", "dtype": "bfloat16"})
    with pytest.raises(SettingsError, match="'engine'"):
        Settings.from_mapping({"engine": "tensorrt"})


def test_one_session_per_thread_count_follows_torch_threads(onnx_model_dir):
    transformer = OnnxTransformer(onnx_model_dir / ONNX_FILE, threads=1, lend_threads=2)
    assert sorted(transformer.sessions) == [1, 2]
    ids = torch.randint(5, 60, (3, 12))
    mask = torch.ones_like(ids)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 4):  # 4: more than any session has, so the widest one runs
            torch.set_num_threads(threads)
            results.append(transformer(ids, mask))
    finally:
        torch.set_num_threads(before)
    for result in results[1:]:
        torch.testing.assert_close(result, results[0], atol=1e-5, rtol=0)


def test_a_failed_or_mismatched_export_leaves_torch_serving(tiny_model_dir, tmp_path, monkeypatch):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)

    def broken_export(*args, **kwargs):
        raise RuntimeError("unsupported operator")

    with monkeypatch.context() as patch:
        patch.setattr(onnx_export.torch.onnx, "export", broken_export)
        outcome = onnx_export.export_onnx(model_dir, max_positions=64)
    assert outcome.startswith("not exported (RuntimeError: unsupported operator)")
    assert not (model_dir / ONNX_FILE).exists()

    monkeypatch.setattr(onnx_export, "MAX_ABS_DIFFERENCE", -1.0)  # any difference is too much
    outcome = onnx_export.export_onnx(model_dir, max_positions=64)
    assert outcome.startswith("not used: its hidden states differ from torch")
    assert not (model_dir / ONNX_FILE).exists()
    assert make_engine(model_dir).info()["engine"] == "torch"


def test_onnx_runtime_s_own_out_of_memory_is_split(tmp_path, onnx_model_dir):
    """A real allocation failure in ONNX Runtime (std::bad_alloc under a capped address space), not
    an injected one: the pass is split and retried, and the answer equals the uncapped one."""
    outcome = run_child(tmp_path, ONNX_OOM_SCRIPT, onnx_model_dir)
    assert outcome["engine"] == "onnxruntime"
    # Raised inside ONNX Runtime (its arena, or operator new), not torch; its status is FAIL or RUNTIME_EXCEPTION
    error = outcome["transformer_error"]
    assert "[ONNXRuntimeError]" in error and ("Failed to allocate memory" in error or "std::bad_alloc" in error)
    assert outcome["status"] == 200 and outcome["passes"] > 1 and outcome["max_abs_diff"] < 1e-5


def test_only_onnx_runtime_allocation_failures_count_as_out_of_memory():
    class RuntimeException(Exception):  # the name onnxruntime's bindings give their errors
        pass

    assert is_out_of_memory(RuntimeException("Non-zero status code ... Status Message: std::bad_alloc"))
    assert is_out_of_memory(RuntimeException("Failed to allocate memory for requested buffer of size 123"))
    assert not is_out_of_memory(RuntimeException("Invalid input name: token_type_ids"))
    assert not is_out_of_memory(ValueError("std::bad_alloc"))


ONNX_OOM_SCRIPT = """
import json, resource, sys
import numpy as np
from tests.support.engines import make_engine
from tests.support.parts import backed_by
from embedserve.handler.api.exchange import RawRequest

engine = make_engine(sys.argv[1], max_batch_tokens=1 << 20, max_batch_size=4096, warmup=False)
# 1024 inputs cut to the 48-token limit: one pass of 1024 x 48 tokens, ~40 MB of attention scores.
texts = [str(i) + " the cat sat on the mat with a hat and a bat" * 6 for i in range(1024)]
body = json.dumps({"input": texts}).encode()
# The reference in small requests: ONNX Runtime's memory arena keeps what a pass took, so the
# whole request must not run before the cap.
expected = np.concatenate([[d["embedding"] for d in json.loads(
    engine.handle([RawRequest(json.dumps({"input": texts[i : i + 32]}).encode())])[0].body)["data"]]
    for i in range(0, len(texts), 32)])
with open("/proc/self/status") as status:
    used = next(int(line.split()[1]) for line in status if line.startswith("VmSize")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (used + (48 << 20), resource.RLIM_INFINITY))
errors = []
transformer = engine.encoder.backend.transformer
def observed(ids, mask, segments=None):  # records what the real session raises; changes nothing
    try:
        return transformer(ids, mask, segments)
    except Exception as err:
        errors.append(str(err)[:300])
        raise
padded = engine.encoder.backend  # its twin, on the observed session:
engine = backed_by(engine, padded.with_transformer(observed))
responses, report = engine.handle_with_report([RawRequest(body)])
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))  # to read the answer
got = np.array([d["embedding"] for d in json.loads(responses[0].body)["data"]]) if responses[0].status == 200 else None
print(json.dumps({"engine": engine.info()["engine"], "status": responses[0].status, "passes": report.forward_passes,
                  "transformer_error": errors[0] if errors else "",
                  "max_abs_diff": float(np.abs(got - expected).max()) if got is not None else None}))
"""


def test_residual_add_and_layer_norm_stay_apart_in_the_export_and_the_session(onnx_model_dir, tmp_path):
    """ONNX Runtime's SkipLayerNormalization is slower on CPU than the add and LayerNorm it
    fuses (embedserve/handler/backends/onnx_runtime.py): neither the build nor a worker's session makes one."""
    import onnx
    import onnxruntime

    exported = {node.op_type for node in onnx.load(str(onnx_model_dir / ONNX_FILE)).graph.node}
    assert {"Attention", "LayerNormalization", "Add"} <= exported and "SkipLayerNormalization" not in exported

    def loaded(load) -> set[str]:
        """The operators of the graph `load(path, options)` runs, after load-time optimization."""
        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.optimized_model_filepath = str(tmp_path / "loaded.onnx")
        load(onnx_model_dir / ONNX_FILE, options)
        return {node.op_type for node in onnx.load(str(tmp_path / "loaded.onnx")).graph.node}

    # What a plain session would do, against how workers load it.
    assert "SkipLayerNormalization" in loaded(lambda path, options: onnxruntime.InferenceSession(
        str(path), options, providers=["CPUExecutionProvider"]))
    served = loaded(load_session)
    assert "SkipLayerNormalization" not in served and "LayerNormalization" in served
