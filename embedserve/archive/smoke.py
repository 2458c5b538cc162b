"""The build's smoke check: load the staged model as a worker would (on a CPU), report what was
found, embed, and compare with sentence-transformers when it is installed: vectors with
SentenceTransformer.encode, a reranker's or classifier's scores with CrossEncoder.predict.

A model whose vectors differ from sentence-transformers' fails the build: an index built on
wrong vectors has to be rebuilt, so the mismatch must surface before anything is served.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

# The comparison's bar, fp32 on a CPU: the engine's own batching and padding move the last
# digits only.
MIN_COSINE = 0.9999
MAX_SCORE_DIFFERENCE = 1e-4  # scores, after the model's activation (logits where it has none)
PAIRS = (
    ("what is the capital of Japan?", "東京は日本の首都です。"),
    ("a", "The quick brown fox jumps over the lazy dog."),
    ("fox", "Embeddings map text to vectors; similar meanings land close together. " * 80),  # cut longest first
    ("¿Dónde está la biblioteca? " * 40, "la biblioteca"),
)
INSTRUCTION = "Given a question, retrieve passages that answer it"
TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "a",
    "Embeddings map text to vectors; similar meanings land close together. " * 80,  # past most limits
    "¿Dónde está la biblioteca? 東京は日本の首都です。",
)


OWN_HEAD = "none (the model's own head)"


def _reference_options() -> dict[str, Any]:
    """How the references load a model: on the CPU, offline, in float32 -- the dtype the build's own
    pass runs in, whatever the checkpoint was saved in (Qwen3-Embedding and Qwen3-Reranker publish
    bfloat16 weights, which sentence-transformers would otherwise compute in)."""
    import torch

    return dict(device="cpu", local_files_only=True, model_kwargs={"dtype": torch.float32})


class SmokeError(RuntimeError):
    """The staged model does not embed, or embeds differently from sentence-transformers."""


def check_model(model_dir: Path, handler_section: dict[str, Any]) -> list[str]:
    """Load and embed as a worker would; return the report's lines. Raises SmokeError."""
    from embedserve.handler.assembly import assemble
    from embedserve.handler.model.description import Task
    from embedserve.handler.settings import Settings

    dtype = "int8" if handler_section["dtype"] == "int8" else "float32"  # GPU dtypes are checked as float32
    settings = Settings.from_mapping({**handler_section, "device": "cpu", "dtype": dtype, "cpu_threads": 1})
    engine = assemble(model_dir, settings, model_name="check", cuda_available=False, warm=True)
    info = engine.info()
    text_task = engine.text
    prompts = ", ".join(f"{name}={text!r}" for name, text in text_task.prompts.items()) or "none"
    lines = [
        f"architecture: {info['architecture']} (engine: {info['engine']}"
        + (f"; images: {info['image_engine']})" if "image_engine" in info else ")"),
        f"pipeline: {' -> '.join(info['modules'])}",
        f"pooling: {info['pooling'] or OWN_HEAD}",
        f"prompts: {prompts}; default: {text_task.default_prompt!r}",
        f"max length: {text_task.max_length} tokens"
        + (f" (the architecture allows {engine.encoder.max_positions})" if engine.encoder.max_positions else ""),
        f"dimension: {engine.encoder.dimension}" if engine.task is not Task.RERANK and engine.task is not Task.CLASSIFY
        else
        f"task: {engine.task}, labels: {', '.join(engine.work.scoring.labels)}",
    ]
    if settings.pooling != "auto" or settings.prompt:
        return lines + ["sentence-transformers: not compared (pooling or prompt set by the build overrides the "
                        "model's own)"]
    if engine.task is Task.MULTI_VECTOR and engine.encoder.images is not None:  # a page retriever: transformers'
        return lines + [_compare_pages(engine, model_dir)]
    try:
        import sentence_transformers  # noqa: F401  (optional: the test extras install it)
    except ImportError:
        return lines + ["sentence-transformers: not installed, not compared"]
    if engine.task is Task.SPARSE:
        return lines + [_compare_sparse(engine, model_dir)]
    if engine.task is Task.MULTI_VECTOR:
        return lines + [_compare_multi_vector(engine, model_dir)]
    if engine.task is Task.HYBRID:
        return lines + [_compare(engine, model_dir, int8=False), _compare_m3(engine, model_dir)]
    if engine.task is not Task.EMBED:
        return lines + [_compare_scores(engine, model_dir)]
    if engine.text.images is not None:
        from embedserve.handler.model.files import describe_model

        padded_to = describe_model(model_dir).towers.text_length
        return lines + [_compare(engine, model_dir, int8=False, padded_to=padded_to), _compare_images(engine, model_dir)]
    return lines + [_compare(engine, model_dir, int8=dtype == "int8")]


def _compare_scores(engine, model_dir: Path) -> str:
    """The served scores (/predict: each label's, through the activation) against
    CrossEncoder.predict with the same activation, on pairs and on single texts; a causal
    reranker's on pairs (its template renders pairs), also with an instruction (v1/rerank)."""
    from sentence_transformers import CrossEncoder

    try:
        reference = CrossEncoder(str(model_dir), max_length=engine.text.max_length, **_reference_options())
    except Exception as err:
        return f"sentence-transformers: could not load the model ({type(err).__name__}: {err}), not compared"
    import torch

    causal = engine.work.scoring.chat is not None
    inputs = [*PAIRS] if causal else [*PAIRS, *TEXTS]  # pairs go out as JSON lists, [query, document]
    # /predict answers the softmax of a classifier's logits, as TEI does; one label, its activation.
    options = dict(activation_fn=torch.nn.Identity(), apply_softmax=True) if len(engine.work.scoring.labels) > 1 else {}
    want = np.asarray(reference.predict(inputs, **options), dtype=np.float64).reshape(len(inputs), -1)
    labels = engine.work.scoring.labels
    got = np.array([[dict((item["label"], item["score"]) for item in row)[label] for label in labels]
                    for row in _answer(engine, {"inputs": inputs}, "predict")])
    if causal:  # the instruction rides in the chat template's system message
        query, documents = PAIRS[0][0], [document for _, document in PAIRS]
        want = np.concatenate([want.ravel(), reference.predict([(query, d) for d in documents], prompt=INSTRUCTION)])
        ranked = _answer(engine, {"query": query, "documents": documents, "instruction": INSTRUCTION}, "v1/rerank")
        by_index = {item["index"]: item["relevance_score"] for item in ranked["results"]}
        got = np.concatenate([got.ravel(), [by_index[i] for i in range(len(documents))]])
    worst = float(np.abs(got - want).max())
    line = f"sentence-transformers CrossEncoder: max score difference {worst:.1e} over {got.size} scores"
    if not worst <= MAX_SCORE_DIFFERENCE:
        raise SmokeError(f"the served scores differ from CrossEncoder.predict's by {worst:.1e} (> "
                         f"{MAX_SCORE_DIFFERENCE}); refusing to build a model that would be served wrong")
    return line


def _compare_multi_vector(engine, model_dir: Path) -> str:
    """The served token vectors (queries, documents, neither) against MultiVectorEncoder's
    encode_query, encode_document and encode, and the served MaxSim ranking against its similarity."""
    from sentence_transformers import MultiVectorEncoder

    try:
        reference = MultiVectorEncoder(str(model_dir), **_reference_options())
    except Exception as err:
        return f"sentence-transformers: could not load the model ({type(err).__name__}: {err}), not compared"
    cosines = []
    for kind, encode in (("query", reference.encode_query), ("document", reference.encode_document),
                         (None, reference.encode)):
        want = encode(list(TEXTS), convert_to_numpy=True)
        answer = _answer(engine, {"input": list(TEXTS), **({"input_type": kind} if kind else {})})["data"]
        for item, expected in zip(answer, want):
            got = np.asarray(item["embedding"], dtype=np.float64).reshape(-1, expected.shape[1])
            if got.shape != expected.shape:
                raise SmokeError(f"the served token vectors ({kind or 'no input type'}) have {len(got)} tokens where "
                                 f"MultiVectorEncoder gives {len(expected)}; refusing to build a model that would be "
                                 "served wrong")
            cosines.extend((got * expected).sum(1) / np.linalg.norm(got, axis=1).clip(1e-12)
                           / np.linalg.norm(expected, axis=1).clip(1e-12))
    query, documents = TEXTS[0], list(TEXTS)
    scores = reference.similarity(reference.encode_query([query]), reference.encode_document(documents))[0]
    ranked = _answer(engine, {"query": query, "texts": documents}, "rerank")
    worst = max(abs(item["score"] - float(scores[item["index"]])) for item in ranked)
    least = float(min(cosines))
    if not (least >= MIN_COSINE and worst <= 1e-3):
        raise SmokeError(f"the served token vectors or MaxSim scores differ from MultiVectorEncoder's (min cosine "
                         f"{least:.6f}, score difference {worst:.1e}); refusing to build a model that would be served "
                         "wrong")
    return f"sentence-transformers MultiVectorEncoder: min cosine {least:.6f} over {len(cosines)} token vectors, " \
           f"MaxSim max difference {worst:.1e}"


def _sparse_difference(answer: list, want: np.ndarray, reference: str) -> float:
    """The largest weight difference of TEI's /embed_sparse answer from the reference's dense rows;
    SmokeError where a row's non-zero token ids differ."""
    worst = 0.0
    for row, expected in zip(answer, want):
        ids = [entry["index"] for entry in row]
        if ids != np.flatnonzero(expected).tolist():
            raise SmokeError(f"the served sparse vectors have other non-zero token ids than {reference}; refusing to "
                             "build a model that would be served wrong")
        got = np.array([entry["value"] for entry in row])
        worst = max(worst, float(np.abs(got - expected[ids]).max()) if ids else 0.0)
    return worst


def _compare_sparse(engine, model_dir: Path) -> str:
    """The served sparse vectors (TEI's /embed_sparse) against SparseEncoder.encode's, with each
    of the model's prompts: the same non-zero token ids, weights within MAX_SCORE_DIFFERENCE."""
    from sentence_transformers import SparseEncoder

    try:
        reference = SparseEncoder(str(model_dir), **_reference_options())
    except Exception as err:
        return f"sentence-transformers: could not load the model ({type(err).__name__}: {err}), not compared"
    reference.max_seq_length = engine.text.max_length
    worst, vectors = 0.0, 0
    for name in [None, *engine.text.prompts]:
        want = reference.encode(list(TEXTS), prompt_name=name, convert_to_tensor=True).to_dense().numpy()
        answer = _answer(engine, {"inputs": list(TEXTS), **({"prompt_name": name} if name else {})}, "embed_sparse")
        worst = max(worst, _sparse_difference(answer, want, "SparseEncoder.encode"))
        vectors += len(answer)
    if (model_dir / "query_static").is_dir():  # an inference-free model: its queries are looked up
        from sentence_transformers.sparse_encoder.models import SparseStaticEmbedding

        static = SparseEncoder(modules=[SparseStaticEmbedding.load(str(model_dir / "query_static"))], device="cpu")
        want = static.encode(list(TEXTS), convert_to_tensor=True).to_dense().numpy()
        answer = _answer(engine, {"inputs": list(TEXTS), "input_type": "query"}, "embed_sparse")
        worst = max(worst, _sparse_difference(answer, want, "SparseStaticEmbedding's queries"))
        vectors += len(answer)
    if not worst <= MAX_SCORE_DIFFERENCE:
        raise SmokeError(f"the served sparse weights differ from SparseEncoder.encode's by {worst:.1e} (> "
                         f"{MAX_SCORE_DIFFERENCE}); refusing to build a model that would be served wrong")
    return f"sentence-transformers SparseEncoder: same token ids, max weight difference {worst:.1e} over {vectors} " \
           "vectors"


def m3_embedder_class():
    """FlagEmbedding's M3Embedder (the reference for bge-m3), or ImportError. Its package's __init__
    imports every model family, one of which fails on transformers 5; the m3 module itself imports
    once its parent packages are bare modules."""
    import importlib.machinery
    import sys
    import types

    # The path finder, not sys.modules: a second call finds the bare module the first one left there.
    spec = importlib.machinery.PathFinder.find_spec("FlagEmbedding")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("FlagEmbedding is not installed")
    root = Path(spec.submodule_search_locations[0])
    for name, sub in (("FlagEmbedding", ""), ("FlagEmbedding.inference", "inference")):
        if not hasattr(sys.modules.get(name), "__path__"):
            module = types.ModuleType(name)
            module.__path__ = [str(root / sub)]
            sys.modules[name] = module
    from FlagEmbedding.inference.embedder.encoder_only.m3 import M3Embedder

    return M3Embedder


def _with_pickled_heads(model_dir: Path, folder: Path) -> Path:
    """The staged model as FlagEmbedding reads it, in `folder`: its files linked, its heads back in
    the `.pt` state dicts FlagEmbedding loads (a reference copy, never archived)."""
    import torch
    from safetensors.torch import load_file

    for item in model_dir.iterdir():
        (folder / item.name).symlink_to(item)
    for head in ("sparse_linear", "colbert_linear"):
        torch.save(load_file(str(model_dir / f"{head}.safetensors")), folder / f"{head}.pt")
    return folder


def _compare_m3(engine, model_dir: Path) -> str:
    """bge-m3's three outputs, from one request, against FlagEmbedding's BGEM3 (its M3Embedder):
    dense and ColBERT vectors by cosine, sparse weights by token id within MAX_SCORE_DIFFERENCE."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="m3-reference-") as tmp:
        try:
            reference = _with_pickled_heads(model_dir, Path(tmp))
            embedder = m3_embedder_class()(str(reference), use_fp16=False, devices="cpu", normalize_embeddings=True)
        except Exception as err:
            return f"FlagEmbedding BGEM3: not compared ({type(err).__name__}: {str(err)[:200]})"
        want = embedder.encode(list(TEXTS), max_length=engine.text.max_length, return_dense=True,
                               return_sparse=True, return_colbert_vecs=True)
    data = _answer(engine, {"input": list(TEXTS), "outputs": ["dense", "sparse", "colbert"]})["data"]
    cosines, worst = [], 0.0
    for item, dense, weights, colbert in zip(data, want["dense_vecs"], want["lexical_weights"], want["colbert_vecs"]):
        got = dict(zip(item["sparse_embedding"]["indices"], item["sparse_embedding"]["values"]))
        expected = {int(k): float(v) for k, v in weights.items()}
        served_colbert = np.asarray(item["colbert_embedding"], dtype=np.float64).reshape(len(colbert), -1) \
            if len(item["colbert_embedding"]) == len(colbert) else None
        if sorted(got) != sorted(expected) or served_colbert is None:
            raise SmokeError("the served sparse token ids or ColBERT token count differ from FlagEmbedding's BGEM3; "
                             "refusing to build a model that would be served wrong")
        worst = max([worst, *(abs(got[k] - expected[k]) for k in got)])
        vectors = np.vstack([np.asarray(item["embedding"])[None], served_colbert])
        reference = np.vstack([np.asarray(dense)[None], np.asarray(colbert)])
        cosines.extend((vectors * reference).sum(1) / np.linalg.norm(vectors, axis=1).clip(1e-12)
                       / np.linalg.norm(reference, axis=1).clip(1e-12))
    least = float(min(cosines))
    if not (least >= MIN_COSINE and worst <= MAX_SCORE_DIFFERENCE):
        raise SmokeError(f"the served bge-m3 outputs differ from FlagEmbedding's BGEM3 (min cosine {least:.6f}, "
                         f"sparse difference {worst:.1e}); refusing to build a model that would be served wrong")
    return f"FlagEmbedding BGEM3: dense and ColBERT min cosine {least:.6f}, sparse max difference {worst:.1e}"


def _compare(engine, model_dir: Path, int8: bool, padded_to: int | None = None) -> str:
    """The served text vectors against sentence-transformers' `encode`; `padded_to`: a SigLIP's
    fixed text length, which its model card pads every text to (model/towers.py) and
    sentence-transformers does only where told (its `processing_kwargs`)."""
    from sentence_transformers import SentenceTransformer

    try:
        reference = SentenceTransformer(str(model_dir), **_reference_options())
    except Exception as err:  # its own limits are not the model's fault; say so, do not fail
        return f"sentence-transformers: could not load the model ({type(err).__name__}: {err}), not compared"
    reference.max_seq_length = engine.text.max_length
    if padded_to:
        reference[0].processing_kwargs = {"text": {"padding": "max_length", "max_length": padded_to}}
    cosines = []
    for name in [None, *engine.text.prompts]:
        want = reference.encode(list(TEXTS), prompt_name=name, convert_to_numpy=True)
        got = _served(engine, {"input": list(TEXTS), **({"prompt_name": name} if name else {})})
        cosines.extend((got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1))
    worst = float(min(cosines))
    padding = f" (texts padded to {padded_to} tokens, as the model card pads them)" if padded_to else ""
    line = f"sentence-transformers{padding}: min cosine {worst:.6f} over {len(cosines)} embeddings"
    if int8:
        return line + " (int8 against fp32; the calibration above is the int8 check)"
    if not worst >= MIN_COSINE:
        raise SmokeError(f"the served vectors differ from sentence-transformers' (min cosine {worst:.6f} < "
                         f"{MIN_COSINE}); refusing to build a model that would be served wrong")
    return line


def _compare_pages(engine, model_dir: Path) -> str:
    """A page retriever's served vectors of queries and of page images against transformers' own
    processor and model (ColPali's or ColQwen2's), and the served MaxSim scores against the
    processor's score_retrieval (model/pages.py)."""
    import torch
    import transformers

    architecture = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    model = getattr(transformers, architecture).from_pretrained(model_dir, dtype=torch.float32).eval()
    images, uris = _sample_images()
    pages, queries = processor.process_images(images), processor.process_queries(list(TEXTS))
    with torch.inference_mode():
        want_pages = [row[mask.bool()] for row, mask in zip(model(**pages).embeddings, pages["attention_mask"])]
        want_queries = [row[mask.bool()] for row, mask in zip(model(**queries).embeddings, queries["attention_mask"])]
    answers = _answer(engine, {"input": uris, "modality": "image"})["data"] + _answer(engine, {"input": list(TEXTS)})["data"]
    cosines = []
    for item, expected in zip(answers, [vectors.numpy() for vectors in want_pages + want_queries], strict=True):
        got = np.asarray(item["embedding"], dtype=np.float64).reshape(-1, expected.shape[1])
        if got.shape != expected.shape:
            raise SmokeError(f"the served vectors have {len(got)} positions where {architecture} gives "
                             f"{len(expected)}; refusing to build a model that would be served wrong")
        cosines.extend((got * expected).sum(1) / np.linalg.norm(got, axis=1).clip(1e-12)
                       / np.linalg.norm(expected, axis=1).clip(1e-12))
    # A page at a time: score_retrieval pads pages of other lengths with zero vectors, which would
    # count as a similarity of 0 where every one of a query token's is below it.
    scores = [float(processor.score_retrieval(want_queries[:1], [page])[0, 0]) for page in want_pages]
    ranked = _answer(engine, {"query": TEXTS[0], "texts": uris, "modality": "image"}, "rerank")
    worst = max(abs(item["score"] - scores[item["index"]]) for item in ranked)
    least = float(min(cosines))
    if not (least >= MIN_COSINE and worst <= 1e-3):
        raise SmokeError(f"the served page retriever differs from {architecture} (min cosine {least:.6f}, "
                         f"MaxSim score difference {worst:.1e}); refusing to build a model that would be served wrong")
    return (f"transformers {architecture}: min cosine {least:.6f} over {len(cosines)} vectors of "
            f"{len(images)} page images and {len(TEXTS)} queries; MaxSim scores within {worst:.1e} of score_retrieval")


def _sample_images() -> tuple[list, list[str]]:
    """Three random RGB images of different sizes, and each as a PNG data URI."""
    import base64
    import io

    from PIL import Image

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
              for width, height in ((320, 240), (64, 96), (500, 500))]
    uris = []
    for image in images:
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        uris.append("data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode())
    return images, uris


def _compare_images(engine, model_dir: Path) -> str:
    """An image-text model's image vectors, served from PNG data URIs, against sentence-transformers'
    `encode` of the same images; a SigLIP 2 NaFlex model's against transformers' own image processor
    and `get_image_features` (sentence-transformers 5 resizes to its processor's default patch
    count, not the folder's `max_num_patches`)."""
    images, uris = _sample_images()
    if json.loads((model_dir / "config.json").read_text()).get("model_type") == "siglip2":
        reference, want = "transformers Siglip2Model", _transformers_image_features(model_dir, images)
    else:
        from sentence_transformers import SentenceTransformer

        reference = "sentence-transformers"
        want = SentenceTransformer(str(model_dir), **_reference_options()).encode(images, convert_to_numpy=True)
    got = _served(engine, {"input": uris, "modality": "image"})
    worst = float(((got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)).min())
    if not worst >= MIN_COSINE:
        raise SmokeError(f"the served image vectors differ from {reference}'s (min cosine {worst:.6f} < "
                         f"{MIN_COSINE}); refusing to build a model that would be served wrong")
    return f"{reference}, images: min cosine {worst:.6f} over {len(images)} images"


def _transformers_image_features(model_dir: Path, images: list) -> np.ndarray:
    """transformers' own image features of the images, one at a time, by the folder's processor, in float32."""
    import torch
    from transformers import AutoImageProcessor, AutoModel

    processor = AutoImageProcessor.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        features = [model.get_image_features(**processor(images=[image], return_tensors="pt")) for image in images]
    return np.concatenate([(out if isinstance(out, torch.Tensor) else out.pooler_output).numpy() for out in features])


def _served(engine, body: dict[str, Any]) -> np.ndarray:
    """The vectors the engine answers a client, through the whole request path."""
    return np.array([row["embedding"] for row in _answer(engine, body)["data"]])


def _answer(engine, body: dict[str, Any], route: str = "") -> Any:
    """The engine's JSON answer to `body` on `route`, through the whole request path."""
    from embedserve.handler.api.exchange import RawRequest

    [response] = engine.handle([RawRequest(json.dumps(body).encode(), "application/json", route)])
    if response.status != 200:
        raise SmokeError(f"the smoke request failed with {response.status}: {response.body.decode()}")
    return json.loads(response.body)
