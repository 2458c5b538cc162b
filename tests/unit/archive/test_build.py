"""The .mar build: contents, safetensors only, config.properties kept consistent, refusals."""

import io
import json
import pickle
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
import yaml

from embedserve.archive.build import main as build_main
from embedserve.archive.build import pickled_members
from embedserve.archive.default_model import SHA256, _mismatches
from embedserve.archive.ts_config import read_properties
from embedserve.handler.backends.onnx_runtime import INT8_ONNX_FILE, ONNX_FILE
from embedserve.handler.backends.openvino_runtime import openvino_available
from embedserve.handler.worker.cpu_features import bf16_units
from tests.support import REPO
from tests.support.engines import TEXTS, make_engine
from tests.support.tiny_model import make_tiny_model
from embedserve.handler.model.inputs import plain_inputs


@pytest.fixture
def config(tmp_path) -> Path:
    path = tmp_path / "config.properties"
    path.write_text((REPO / "config.properties").read_text())
    return path


def run_build(config: Path, *args: str) -> int:
    return build_main([*args, "--export-path", str(config.parent / "store"), "--config", str(config)])


def models_of(config: Path) -> dict:
    return json.loads(read_properties(config)["models"])


def test_tiny_mar_contents_and_config(tiny_model_dir, config):
    assert run_build(config, "--model", str(tiny_model_dir), "--name", "tiny", "--version", "2.0",
                     "--batch-size", "4", "--max-batch-delay", "25", "--workers", "3") == 0
    mar = config.parent / "store" / "tiny.mar"
    with zipfile.ZipFile(mar) as archive:
        names = set(archive.namelist())
        model_config = yaml.safe_load(archive.read("model-config.yaml"))
        manifest = json.loads(archive.read("MAR-INF/MANIFEST.json"))
    assert {"entry.py", "embedserve/handler/service.py", "embedserve/handler/torchserve/entry.py", "model/model.safetensors",
            "model/tokenizer.json", "model/config.json", "model/modules.json", "model/1_Pooling/config.json"} <= names
    assert not any("__pycache__" in n for n in names)
    assert manifest["model"]["handler"] == "entry.py"
    assert pickled_members(mar) == []

    # The handler's metrics are declared for TorchServe, beside the archive and inside it.
    assert "metrics.yaml" in names
    assert read_properties(config)["metrics_config"] == "store/metrics.yaml"
    declared = yaml.safe_load((config.parent / "store" / "metrics.yaml").read_text())
    counters = {m["name"]: m for m in declared["model_metrics"]["counter"]}
    assert counters["EmbedResponses"]["dimensions"] == ["Status", "ModelName", "Level"]
    assert {"EmbedRequests", "EmbedRealTokens", "EmbedPaddedTokens"} <= set(counters)
    assert "ts_inference_requests_total" in {m["name"] for m in declared["ts_metrics"]["counter"]}

    # config.properties and model-config.yaml agree; the other models and lines are kept.
    assert (model_config["batchSize"], model_config["maxBatchDelay"], model_config["minWorkers"]) == (4, 25, 3)
    assert model_config["handler"]["normalize"] is True
    models = models_of(config)
    entry = models["tiny"]["2.0"]
    assert entry["marName"] == "tiny.mar" and entry["defaultVersion"] is True
    assert (entry["batchSize"], entry["maxBatchDelay"], entry["minWorkers"], entry["maxWorkers"]) == (4, 25, 3, 3)
    assert "minilm" in models
    properties = read_properties(config)
    assert properties["load_models"] == "minilm.mar,tiny.mar"
    assert int(properties["job_queue_size"]) >= 32 * 2 * 8
    assert properties["inference_address"] == "http://127.0.0.1:8080"
    assert "# Token authorization stays on" in config.read_text()


def test_rebuilding_a_version_replaces_it(tiny_model_dir, config):
    assert run_build(config, "--model", str(tiny_model_dir), "--name", "tiny", "--batch-size", "4") == 0
    assert run_build(config, "--model", str(tiny_model_dir), "--name", "tiny", "--batch-size", "9") == 0
    assert models_of(config)["tiny"]["1.0"]["batchSize"] == 9


def test_models_answering_a_vector_per_token_batch_fewer_requests(tiny_model_dir, tmp_path, config):
    """TorchServe's frontend parses a batch's answers again at every chunk that arrives: the build
    keeps batches of token vectors small unless told (embedserve/archive/build.py)."""
    from tests.support.multi_vector_models import make_colbert

    assert run_build(config, "--model", str(make_colbert(tmp_path / "colbert")), "--name", "colbert") == 0
    assert run_build(config, "--model", str(tiny_model_dir), "--name", "tiny") == 0
    assert models_of(config)["colbert"]["1.0"]["batchSize"] == 8 and models_of(config)["tiny"]["1.0"]["batchSize"] == 32
    assert run_build(config, "--model", str(tmp_path / "colbert"), "--name", "colbert", "--batch-size", "16") == 0
    assert models_of(config)["colbert"]["1.0"]["batchSize"] == 16


def test_pickled_weights_are_converted_to_safetensors(tmp_path, config):
    source = make_tiny_model(tmp_path / "bin_model", weights="bin", seed=3)
    reference = make_tiny_model(tmp_path / "st_model", seed=3)
    assert (source / "pytorch_model.bin").exists() and not (source / "model.safetensors").exists()
    assert run_build(config, "--model", str(source), "--name", "converted") == 0
    mar = config.parent / "store" / "converted.mar"
    with zipfile.ZipFile(mar) as archive:
        names = archive.namelist()
        archive.extractall(tmp_path / "unpacked")
    assert "model/model.safetensors" in names
    assert not any(n.endswith(".bin") for n in names)
    texts = {"input": ["the cat sat", "hello world"]}
    assert "model/transformer.onnx" in names  # the CPU engine's export; torch compares the weights below
    converted = make_engine(tmp_path / "unpacked" / "model", engine="torch").handle([_raw(texts)])[0]
    original = make_engine(reference).handle([_raw(texts)])[0]
    assert json.loads(converted.body)["data"] == json.loads(original.body)["data"]


def _raw(body):
    from embedserve.handler.api.exchange import RawRequest

    return RawRequest(body)


class Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_checkpoint_with_arbitrary_objects_is_refused(tmp_path, config, capsys):
    source = make_tiny_model(tmp_path / "evil", weights="bin")
    torch.save({"weight": torch.zeros(2), "payload": Evil()}, source / "pytorch_model.bin")
    assert run_build(config, "--model", str(source), "--name", "evil") == 1
    captured = capsys.readouterr()
    assert "cannot convert pytorch_model.bin safely" in captured.err
    assert "this must never run" not in captured.out
    assert not (config.parent / "store" / "evil.mar").exists()
    assert "evil" not in models_of(config)


def test_module_path_escaping_the_folder_is_refused(tmp_path, config, capsys):
    source = make_tiny_model(tmp_path / "escape")
    modules = json.loads((source / "modules.json").read_text())
    modules[1]["path"] = "../../etc"
    (source / "modules.json").write_text(json.dumps(modules))
    assert run_build(config, "--model", str(source), "--name", "escape") == 1
    assert "escapes the model folder" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dtype", "float64"], "'dtype'"),
        (["--pooling", "median"], "'pooling'"),
        (["--batch-size", "0"], "--batch-size"),
        (["--name", "bad name!"], "--name"),
        (["--max-batch-delay", "0"], "--max-batch-delay must be >= 1: TorchServe reads an archive's 0 as unset"),
        (["--set", "engine=tensorrt"], "'engine'"),
    ],
)
def test_bad_options_fail_the_build_with_their_name(tiny_model_dir, config, capsys, args, message):
    assert run_build(config, "--model", str(tiny_model_dir), *args) == 1
    assert message in capsys.readouterr().err


def test_missing_folder_is_reported(config, capsys):
    assert run_build(config, "--model", "./no/such/folder") == 1
    assert "no such folder" in capsys.readouterr().err


def test_hub_id_offline_fails_with_a_clear_message(config, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert run_build(config, "--model", "sentence-transformers/all-mpnet-base-v2") == 1
    err = capsys.readouterr().err
    assert "could not download 'sentence-transformers/all-mpnet-base-v2'" in err and "--model PATH" in err


def test_qwen3_reranker_as_published_is_refused_not_served_as_an_embedder(tmp_path, config, capsys):
    """Qwen3-Reranker-0.6B as published: a Qwen3ForCausalLM and its tokenizer, no
    sentence-transformers files. sentence-transformers would take the mean of its token states,
    and the build's check against it would pass: the build says what to build instead. An explicit
    --pooling is the user's choice, and describes."""
    from embedserve.handler.model.files import describe_model
    from tests.support.published import make_published

    folder = make_published("qwen3-reranker-0.6b", tmp_path / "Qwen3-Reranker-0.6B")
    assert run_build(config, "--model", str(folder)) == 1
    err = capsys.readouterr().err
    assert "Qwen3ForCausalLM, a causal language model" in err and "--pooling" in err and "LogitScore" in err
    assert not (config.parent / "store").exists() or not list((config.parent / "store").iterdir())
    assert describe_model(folder).served_with("last_token").pooling.modes == ("last_token",)


def test_a_clip_folder_resaved_by_sentence_transformers_builds_checked_on_texts_and_images(tmp_path, config,
                                                                                           capsys):
    """A CLIP folder as sentence-transformers re-saves it (one multimodal Transformer module, its
    image processor in processor_config.json): built with its image processor and its vision tower's
    towers' ONNX exports, and checked against sentence-transformers on texts and on images, both
    through the exports. (The folder as transformers saves
    it is the session catalog's build, tests/support/catalog.py, and docs/models.md's.)"""
    from sentence_transformers import SentenceTransformer
    from tests.support.image_models import make_clip

    resaved = tmp_path / "clip-st"
    SentenceTransformer(str(make_clip(tmp_path / "clip")), device="cpu").save(str(resaved))
    assert not (resaved / "preprocessor_config.json").exists()
    assert run_build(config, "--model", str(resaved), "--name", "clip") == 0
    err = capsys.readouterr().err
    assert "an image-text model (CLIPModel: texts and images into one 16-wide space)" in err, err
    assert "sentence-transformers: min cosine" in err and "sentence-transformers, images: min cosine" in err
    assert "ONNX Runtime (the CPU engine of its towers): vision tower exported (max difference to torch" in err, err
    assert "; text tower exported (max difference to torch" in err, err
    assert "(engine: onnxruntime; images: onnxruntime)" in err
    # Its vision tower in bfloat16, checked against float32 (texts stay float32): shipped where this
    # CPU computes bfloat16, else not verified.
    shipped = bf16_units() is not None and openvino_available()
    said = "bfloat16 (openvino, vision tower): min cosine" if shipped else \
        "bfloat16 (openvino, vision tower): not verified" if openvino_available() else \
        "bfloat16 CPU engines: none for this build"
    assert said in err and (": ships" in err) == shipped, err
    with zipfile.ZipFile(config.parent / "store" / "clip.mar") as archive:
        names = archive.namelist()
        handler = yaml.safe_load(archive.read("model-config.yaml"))["handler"]
    assert handler["cpu_bf16_engines"] == (["openvino"] if shipped else [])
    assert "model/processor_config.json" in names and sorted(name for name in names if name.endswith(".onnx")) == [
        "model/text_tower.onnx", "model/vision.onnx"]


def test_a_siglip_folder_builds_checked_on_texts_padded_as_its_model_card_pads_them(tmp_path, config, capsys):
    """SigLIP's text tower pools the last of 64 padded positions: the build checks the served texts
    against sentence-transformers told to pad so (its default pads to the batch's longest text)."""
    from tests.support.image_models import make_siglip

    assert run_build(config, "--model", str(make_siglip(tmp_path / "siglip")), "--name", "siglip",
                     "--set", "engine=torch") == 0
    err = capsys.readouterr().err
    assert "an image-text model (SiglipModel: texts and images into one 32-wide space)" in err, err
    assert "TextTower(last of 64 padded positions, head) -> ImageTower(attention pooling head)" in err
    assert "sentence-transformers (texts padded to 64 tokens, as the model card pads them): min cosine" in err
    assert "sentence-transformers, images: min cosine" in err
    assert "(engine: torch; images: torch)" in err and "vision tower" not in err  # engine=torch: no export


def test_towers_that_do_not_export_are_served_by_torch(tmp_path, config, capsys, monkeypatch):
    """The exporter failing (here made to fail) costs the ONNX engine, not the build: texts and
    images then run on torch's towers, checked against sentence-transformers all the same."""
    from tests.support.image_models import make_clip

    def failing_export(*args, **kwargs):
        raise RuntimeError("an operator the exporter does not know")

    monkeypatch.setattr(torch.onnx, "export", failing_export)
    assert run_build(config, "--model", str(make_clip(tmp_path / "clip")), "--name", "clip") == 0
    err = capsys.readouterr().err
    assert "vision tower not exported (RuntimeError: an operator the exporter does not know), run by torch; " \
           "text tower not exported (RuntimeError" in err, err
    assert "(engine: torch; images: torch)" in err and "sentence-transformers, images: min cosine" in err
    with zipfile.ZipFile(config.parent / "store" / "clip.mar") as archive:
        assert not any(name.endswith(".onnx") for name in archive.namelist())


@pytest.mark.parametrize("tokenizer_setting", [{"model_input_names": ["input_ids"]}, {"padding_side": "left"}],
                         ids=["no-mask", "left-padding"])
def test_a_siglip_tokenizer_is_served_as_transformers_runs_it(tmp_path, tokenizer_setting):
    """A tokenizer whose model inputs are the ids alone (as SigLIP's were before transformers 5):
    the text tower attends to the padding, as get_text_features on those ids does. One that pads
    on the left (SigLIP 2's fixed-resolution models are SiglipModel folders with a Gemma tokenizer,
    which does): the last position the text tower pools is the text's own last token."""
    import numpy as np

    from embedserve.archive.smoke import _answer
    from transformers import AutoModel, AutoTokenizer
    from tests.support.image_models import make_siglip

    folder = make_siglip(tmp_path / "siglip")
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**settings, **tokenizer_setting}))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert all(getattr(tokenizer, name) == value for name, value in tokenizer_setting.items())
    texts = ["two dogs", "a red cat on a mat"]
    with torch.no_grad():
        ids = tokenizer(texts, padding="max_length", max_length=64, return_tensors="pt")
        want = AutoModel.from_pretrained(folder).eval().get_text_features(**ids).pooler_output.numpy()
    got = np.array([row["embedding"] for row in _answer(make_engine(folder), {"input": texts, "normalize": False})["data"]])
    assert np.abs(got - want).max() < 1e-5


def test_a_siglip2_naflex_folder_builds_checked_against_transformers(tmp_path, config, capsys):
    """SigLIP 2's variable-resolution model: images of three shapes checked against transformers'
    own processor and get_image_features (sentence-transformers 5 resizes to its own default patch
    count); texts against sentence-transformers padding to 64 on the tokenizer's side (the left:
    transformers' Siglip2Tokenizer). Its text tower exports; its vision tower stays on torch."""
    from tests.support.image_models import make_siglip2

    assert run_build(config, "--model", str(make_siglip2(tmp_path / "siglip2")), "--name", "siglip2") == 0
    err = capsys.readouterr().err
    assert "an image-text model (Siglip2Model: texts and images into one 32-wide space)" in err, err
    assert "ImageTower(aspect ratio kept, up to 256 patches, attention pooling head)" in err
    assert "vision tower not exported (a variable-resolution tower" in err and "text tower exported" in err
    assert "sentence-transformers (texts padded to 64 tokens, as the model card pads them): min cosine" in err
    assert "transformers Siglip2Model, images: min cosine 1.0000" in err, err
    with zipfile.ZipFile(config.parent / "store" / "siglip2.mar") as archive:
        assert sorted(name for name in archive.namelist() if name.endswith(".onnx")) == ["model/text_tower.onnx"]


def test_an_image_text_model_of_another_architecture_and_a_clip_in_a_subfolder_are_refused(tmp_path, config,
                                                                                           capsys):
    import json

    from tests.support.image_models import make_clip

    other = make_clip(tmp_path / "altclip")
    settings = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**settings, "model_type": "altclip",
                                                   "architectures": ["AltCLIPModel"]}))
    assert run_build(config, "--model", str(other)) == 1
    err = capsys.readouterr().err
    assert "'altclip' (AltCLIPModel) is an image-text model that is not served: CLIPModel, SiglipModel, " \
           "Siglip2Model are" in err, err
    layered = make_clip(tmp_path / "layered")
    (layered / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "0_CLIPModel",
                                                      "type": "sentence_transformers.models.CLIPModel"}]))
    assert run_build(config, "--model", str(layered)) == 1
    assert "build that subfolder itself" in capsys.readouterr().err


def test_colpali_and_colqwen2_folders_build_checked_against_transformers(tmp_path, config, capsys):
    """ColPali and ColQwen2 folders as transformers saves them build, their served vectors and
    MaxSim scores compared with transformers' by the build; another page retriever's config as
    transformers writes it (ColModernVBERT) is refused saying why (not for a missing hidden_size:
    these configs nest it)."""
    from transformers import ColModernVBertConfig

    from embedserve.handler.model.description import ModelFilesError
    from embedserve.handler.model.files import describe_model
    from tests.support.page_models import make_colpali, make_colqwen2

    assert run_build(config, "--model", str(make_colpali(tmp_path / "colpali")), "--name", "colpali") == 0
    err = capsys.readouterr().err
    assert "a page retriever (ColPaliForRetrieval: a 16-wide vector per position" in err and "no ONNX export" in err
    assert "16 image tokens a page" in err and "transformers ColPaliForRetrieval: min cosine 1.000000" in err, err
    assert run_build(config, "--model", str(make_colqwen2(tmp_path / "colqwen2")), "--name", "colqwen2") == 0
    err = capsys.readouterr().err
    assert "a page retriever (ColQwen2ForRetrieval: a 16-wide vector per position" in err
    assert "image tokens by a page's size, 16 at its pixel bound" in err, err
    assert "transformers ColQwen2ForRetrieval: min cosine 1.000000" in err, err
    ColModernVBertConfig(architectures=["ColModernVBertForRetrieval"]).save_pretrained(tmp_path / "colmodernvbert")
    with pytest.raises(ModelFilesError, match=r"'colmodernvbert' \(ColModernVBertForRetrieval\) is a page retriever "
                                              r".* not served: ColPaliForRetrieval and ColQwen2ForRetrieval are"):
        describe_model(tmp_path / "colmodernvbert")


def test_folder_that_is_not_a_model_is_refused(tmp_path, config, capsys):
    (tmp_path / "empty").mkdir()
    assert run_build(config, "--model", str(tmp_path / "empty")) == 1
    assert "config.json is missing" in capsys.readouterr().err


def test_pickle_scanner_finds_pickles_by_name_and_by_content(tmp_path):
    mar = tmp_path / "x.mar"
    with zipfile.ZipFile(mar, "w") as archive:
        archive.writestr("model/model.safetensors", b"\x80\x02 safetensors header may start like this")
        archive.writestr("model/weights.pt", b"anything")
        archive.writestr("model/disguised.json", pickle.dumps({"a": 1}, protocol=4))
        buffer = io.BytesIO()
        torch.save({"w": torch.zeros(1)}, buffer)
        archive.writestr("model/zipped.dat", buffer.getvalue())
        archive.writestr("model/config.json", b"{}")
    assert sorted(pickled_members(mar)) == ["model/disguised.json", "model/weights.pt", "model/zipped.dat"]


def test_default_model_hash_check_detects_tampering(tmp_path):
    for name in SHA256:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("not the real file")
    assert sorted(_mismatches(tmp_path)) == sorted(SHA256)


def test_int8_build_ships_onnx_runtime_s_calibrated_quantization(tiny_model_dir, config, tmp_path, capsys):
    assert run_build(config, "--model", str(tiny_model_dir), "--name", "tiny8", "--dtype", "int8") == 0
    with zipfile.ZipFile(config.parent / "store" / "tiny8.mar") as archive:
        handler = yaml.safe_load(archive.read("model-config.yaml"))["handler"]
        archive.extractall(tmp_path / "unpacked", [name for name in archive.namelist() if name.startswith("model/")])
    assert "int8 (onnxruntime):" in capsys.readouterr().err
    model_dir = tmp_path / "unpacked" / "model"
    assert (model_dir / INT8_ONNX_FILE).is_file() and not (model_dir / ONNX_FILE).exists()  # only what is served
    assert handler["dtype"] == "int8" and not handler.get("int8_fp32_layers")
    engine = make_engine(model_dir, **handler | {"cpu_threads": 1, "device": "cpu"})
    assert engine.info()["model_dtype"] == "int8" and engine.info()["engine"] == "onnxruntime"
    fp32 = make_engine(tiny_model_dir)
    ids = fp32.text.token_ids(TEXTS)
    cosine = torch.nn.functional.cosine_similarity(engine.encoder.embed(plain_inputs(ids)).vectors, fp32.encoder.embed(plain_inputs(ids)).vectors)
    assert cosine.mean() >= 0.99 and cosine.min() >= 0.97


def test_int8_build_on_torch_records_its_kept_layers(tiny_model_dir, config):
    assert run_build(config, "--model", str(tiny_model_dir), "--name", "tiny8t", "--dtype", "int8",
                     "--set", "engine=torch") == 0
    with zipfile.ZipFile(config.parent / "store" / "tiny8t.mar") as archive:
        handler = yaml.safe_load(archive.read("model-config.yaml"))["handler"]
        assert not any(name.endswith(".onnx") for name in archive.namelist())
    assert handler["dtype"] == "int8"
    kept = handler["int8_fp32_layers"]
    assert isinstance(kept, list) and all(name.startswith("encoder.layer.") for name in kept)
    engine = make_engine(tiny_model_dir, dtype="int8", int8_fp32_layers=kept)
    assert engine.info()["model_dtype"] == "int8" and engine.info()["engine"] == "torch"


def test_build_reports_the_pipeline_and_ships_module_weights(tmp_path, config, capsys):
    """LaBSE's shape from a pickled Dense checkpoint: the Dense weights are converted and shipped,
    the report names what was found, and the vectors were compared with sentence-transformers."""
    from tests.support.model_families import make_family

    source = make_family("bert_dense", tmp_path / "labse")
    dense = load_file(str(source / "2_Dense" / "model.safetensors"))
    (source / "2_Dense" / "model.safetensors").unlink()
    torch.save(dense, source / "2_Dense" / "pytorch_model.bin")
    assert run_build(config, "--model", str(source), "--name", "labse") == 0
    err = capsys.readouterr().err
    for line in ("ONNX Runtime (the CPU engine): exported (fused:", "architecture: bert (engine: onnxruntime)", "pipeline: Transformer -> Pooling(cls) -> Dense(32->24, Tanh) -> "
                 "Normalize", "max length: 64 tokens", "dimension: 24", "sentence-transformers: min cosine 1.0000"):
        assert line in err, err
    mar = config.parent / "store" / "labse.mar"
    with zipfile.ZipFile(mar) as archive:
        assert "model/2_Dense/model.safetensors" in archive.namelist()
    assert pickled_members(mar) == []


def test_unsupported_pipeline_module_fails_the_build_naming_it(tmp_path, config, capsys):
    source = make_tiny_model(tmp_path / "wlp")
    modules = json.loads((source / "modules.json").read_text())
    modules.insert(1, {"idx": 1, "name": "1", "path": "1_WeightedLayerPooling",
                       "type": "sentence_transformers.models.WeightedLayerPooling"})
    (source / "modules.json").write_text(json.dumps(modules))
    assert run_build(config, "--model", str(source), "--name", "wlp") == 1
    assert "WeightedLayerPooling" in capsys.readouterr().err
    assert not (config.parent / "store" / "wlp.mar").exists()


def test_vectors_that_differ_from_sentence_transformers_fail_the_build(tiny_model_dir, config, capsys, monkeypatch):
    from sentence_transformers import SentenceTransformer

    # sentence-transformers reads the model otherwise than the engine: its vectors, reversed.
    encode = SentenceTransformer.encode
    monkeypatch.setattr(SentenceTransformer, "encode", lambda self, *args, **kwargs:
                        encode(self, *args, **kwargs)[:, ::-1].copy())
    assert run_build(config, "--model", str(tiny_model_dir), "--name", "wrong") == 1
    assert "differ from sentence-transformers" in capsys.readouterr().err
    assert not (config.parent / "store" / "wrong.mar").exists()


def test_max_length_past_the_usable_positions_fails_the_build(tmp_path, config, capsys):
    from tests.support.model_families import make_family

    source = make_family("xlmr", tmp_path / "e5")  # 66 position embeddings, 64 usable
    assert run_build(config, "--model", str(source), "--name", "e5", "--max-length", "65") == 1
    assert "65 exceeds the 64 positions" in capsys.readouterr().err


def test_build_mar_without_the_project_s_packages_says_what_to_run(tmp_path):
    # A Python without torch, transformers and torchserve, given explicitly: one line saying what to
    # run, not a traceback (without PYTHON and without .venv, the script sets .venv up itself).
    import subprocess
    import sys

    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    result = subprocess.run([str(REPO / "build_mar.sh"), "--help"], capture_output=True, text=True,
                            env={"PATH": "/usr/bin:/bin", "PYTHON": str(bare / "bin" / "python")})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "lacks the project's packages" in result.stderr and "make mar" in result.stderr


def test_build_mar_help_lists_every_option():
    import subprocess

    result = subprocess.run([str(REPO / "build_mar.sh"), "--help"], capture_output=True, text=True, check=True)
    for option in ("--version", "--response-timeout", "--startup-timeout", "--skip-check", "--set"):
        assert option in result.stdout
    # The build options are documented with the models, not in the README.
    models_doc = (REPO / "docs" / "models.md").read_text()
    for option in ("--response-timeout", "--startup-timeout", "--skip-check", "--version"):
        assert f"`{option}`" in models_doc


def test_a_cpu_build_runs_a_worker_a_core_up_to_two(monkeypatch):
    from embedserve.archive import build

    monkeypatch.setattr(build.os, "cpu_count", lambda: 8)
    assert build._cpu_workers() == 2
    monkeypatch.setattr(build.os, "cpu_count", lambda: 1)
    assert build._cpu_workers() == 1


def test_the_archiver_works_in_a_folder_of_its_own_build(tiny_model_dir, tmp_path, monkeypatch):
    """torch-model-archiver copies an archive's files through $TMPDIR/<model name>: two builds of one
    name on one machine (two CI jobs, two test workers) would delete each other's files there."""
    from embedserve.archive.build import parse_args, run_archiver, stage_handler
    from embedserve.archive.stage import stage_model

    shared = tmp_path / "shared-tmp"
    (shared / "same").mkdir(parents=True)
    (shared / "same" / "another-build.txt").write_text("another build's file")
    monkeypatch.setenv("TMPDIR", str(shared))
    stage = tmp_path / "build" / "stage"
    stage_model(tiny_model_dir, stage / "model")
    stage_handler(stage)
    config_file = tmp_path / "model-config.yaml"
    config_file.write_text(yaml.safe_dump({"minWorkers": 1, "maxWorkers": 1}))
    mar = run_archiver(parse_args(["--name", "same", "--export-path", str(tmp_path / "store")]), stage, config_file)
    assert (shared / "same" / "another-build.txt").read_text() == "another build's file"
    with zipfile.ZipFile(mar) as archive:
        names = archive.namelist()
    assert "another-build.txt" not in names and "model/config.json" in names
