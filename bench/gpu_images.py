"""Image models through the handler on the GPU machine, against the libraries' own paths on the
same device.

    python -m bench.gpu_images --out DIR [--device auto|cuda|cpu]

Writes DIR/images.json, rewritten after each model (`complete`: false until the end; a model
that fails is recorded under `errors` and the next one runs):
- clip: openai/clip-vit-base-patch32's architecture with random weights
  (tests/fixtures/published/clip-vit-base-patch32): the handler's `handle` on TorchServe batches
  of image requests (BATCH requests of IMAGES_PER_REQUEST JPEG photographs, 640 x 480, from
  bench/images.py) in the device's default dtype (float16 on a GPU), its vision tower replaying
  CUDA graphs there (`image_cuda_graphs`: how many were captured): images/s and each batch's
  time split (parse; tokenize, which for images is decoding and the image processor; model;
  encode), the host's stages over the model's; sentence-transformers' `encode` of the same
  decoded images on the same device, in float16 on a GPU, images/s; the handler's vectors
  against `encode`'s in float32 (min cosine).
- colpali, colqwen2: bench/pages.py's models (384 wide, 4 layers, 256 image tokens a page,
  random weights) on its document pages, 2 pages a request: the same, against transformers'
  processor and model (min cosine over every position's vector).
The host's share is what issue 52 asks of a GPU worker: image decoding and preprocessing must not
leave the device idle. With --device cpu (CI) the same steps run on the tiny models, few images.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from PIL import Image

from bench.gpu.common import library_threads, progress
from bench.gpu.correctness import compare
from bench.image_corpus import document_pages, photographs
from embedserve.handler.api.exchange import RawRequest
from embedserve.handler.assembly import assemble
from embedserve.handler.settings import Settings
from tests.support.image_models import make_clip
from tests.support.page_models import make_colpali, make_colqwen2

BATCH = 8  # requests per TorchServe batch: the image models' build default
IMAGES_PER_REQUEST = {"clip": 4, "colpali": 2, "colqwen2": 2}
HOST_STAGES = ("parse", "tokenize", "encode")


def models(cuda: bool) -> dict[str, Callable[[Path], Path]]:
    """Each model's maker: the benchmark sizes on a GPU, the tests' tiny ones on a CPU."""
    if not cuda:
        return {"clip": make_clip, "colpali": make_colpali, "colqwen2": make_colqwen2}
    return {"clip": lambda path: make_clip(path, full_size=True),
            "colpali": lambda path: make_colpali(path, image_size=224, width=384, layers=4),
            "colqwen2": lambda path: make_colqwen2(path, most_tokens=256, width=384, layers=4)}


def data_uri(data: bytes) -> str:
    kind = "png" if data.startswith(b"\x89PNG") else "jpeg"
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def served(model_dir: Path, name: str, files: list[bytes], device: str) -> tuple[dict, list[list[float]]]:
    """The handler's `handle` on TorchServe batches of image requests: figures, and the vectors of
    the first batch's images, as answered (each a flat list of its positions' vectors)."""
    engine = assemble(model_dir, Settings.from_mapping({"device": device}), model_name=name,
                      cuda_available=torch.cuda.is_available(), warm=True)
    per = IMAGES_PER_REQUEST[name]
    bodies = [{"input": [data_uri(data) for data in files[i:i + per]], "modality": "image"}
              for i in range(0, len(files) - per + 1, per)]
    requests = [RawRequest(bytearray(json.dumps(body).encode()), "application/json", "") for body in bodies]
    first, _ = engine.handle_with_report(requests[:BATCH])  # warm up, and the vectors checked
    vectors = [item["embedding"] for answer in first for item in json.loads(answer.body)["data"]]
    stages: dict[str, float] = {}
    statuses: dict[int, int] = {}
    wall, batches = 0.0, 0
    for start in range(0, len(requests), BATCH):
        began = time.perf_counter()
        answers, report = engine.handle_with_report(requests[start:start + BATCH])
        wall += time.perf_counter() - began
        batches += 1
        for key, value in vars(report).items():
            if key.endswith("_ms") and isinstance(value, (int, float)):
                stages[key.removesuffix("_ms")] = stages.get(key.removesuffix("_ms"), 0.0) + value
        for answer in answers:
            statuses[answer.status] = statuses.get(answer.status, 0) + 1
    images = len(requests) * per
    info = engine.info()
    result = {"images_per_s": round(images / wall, 2), "batches": batches, "images_per_request": per,
              "statuses": {str(k): v for k, v in statuses.items()},
              "ms_per_batch": {key: round(value / batches, 3) for key, value in stages.items()},
              "dtype": info.get("model_dtype"), "device": info.get("device"), "engine": info.get("engine"),
              "image_engine": info.get("image_engine"), "cuda_graphs": info.get("cuda_graphs"),
              "image_cuda_graphs": info.get("image_cuda_graphs")}
    if stages.get("model"):
        result["host_over_model"] = round(sum(stages.get(s, 0.0) for s in HOST_STAGES) / stages["model"], 3)
    return result, vectors


def clip_reference(model_dir: Path, files: list[bytes], device: str, checked: int) -> tuple[dict, list[np.ndarray]]:
    """sentence-transformers' encode on the device: images/s in the device's half precision (float32
    on a CPU), and float32 vectors of the first `checked` images."""
    from sentence_transformers import SentenceTransformer

    images = [Image.open(io.BytesIO(data)).convert("RGB") for data in files]
    model = SentenceTransformer(str(model_dir), device=device)
    want = model.encode(images[:checked], batch_size=32)
    # float16 matmuls on a GPU, as the handler's default dtype computes them
    half = torch.autocast("cuda", dtype=torch.float16) if device == "cuda" else contextlib.nullcontext()
    with half:
        model.encode(images[:32], batch_size=32)  # warm
        began = time.perf_counter()
        model.encode(images, batch_size=32)
    rate = len(images) / (time.perf_counter() - began)
    return {"images_per_s": round(rate, 2), "batch_size": 32,
            "dtype": "float16" if device == "cuda" else "float32"}, [row[None, :] for row in want]


def pages_reference(model_dir: Path, files: list[bytes], device: str, checked: int) -> tuple[dict, list[np.ndarray]]:
    """transformers' processor and model on the device: pages/s in half precision on a GPU, and
    float32 vectors of the first `checked` pages."""
    import transformers

    architecture = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    model = getattr(transformers, architecture).from_pretrained(model_dir, dtype=torch.float32).to(device).eval()

    def embed(data: list[bytes], batch: int = 8) -> list[np.ndarray]:
        rows = []
        with torch.inference_mode():
            for start in range(0, len(data), batch):
                inputs = processor.process_images([Image.open(io.BytesIO(d)) for d in data[start:start + batch]])
                inputs = {k: (v.to(device, model.dtype) if v.is_floating_point() else v.to(device))
                          for k, v in inputs.items()}
                out = model(**inputs).embeddings
                rows += [r[m.bool()].float().cpu().numpy() for r, m in zip(out, inputs["attention_mask"])]
        return rows

    want = embed(files[:checked])
    if device == "cuda":
        model.half()
    embed(files[:8])  # warm
    began = time.perf_counter()
    embed(files)
    if device == "cuda":
        torch.cuda.synchronize()
    rate = len(files) / (time.perf_counter() - began)
    return {"images_per_s": round(rate, 2), "batch_size": 8,
            "dtype": "float16" if device == "cuda" else "float32"}, want


def least_cosine(got: list, want: list[np.ndarray]) -> float:
    """The least cosine over every vector of every item (each (positions, dimension); a served
    item's flat list is shaped as its reference's): 0.0 where an item's count of vectors differs."""
    ours = [np.asarray(item, dtype=np.float64).reshape(-1, theirs.shape[1])
            for item, theirs in zip(got, want, strict=True)]
    if any(a.shape != b.shape for a, b in zip(ours, want)):
        return 0.0
    return compare(np.concatenate(ours), np.concatenate(want))["min_cosine"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.gpu_images", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = "cuda" if cuda else "cpu"
    count = 64 if cuda else 8
    corpora = {"clip": photographs()[:count], "pages": document_pages()[:count // 2]}
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": device, "torch": torch.__version__, "complete": False, "models": {},
                    "gpu": torch.cuda.get_device_name(0) if cuda else None}

    def write() -> None:
        (args.out / "images.json").write_text(json.dumps(report, indent=2))

    with tempfile.TemporaryDirectory(prefix="gpu-images-") as tmp:
        for name, make in models(cuda).items():
            progress(f"images: {name}")
            try:
                model_dir = make(Path(tmp) / name)
                files = corpora["clip" if name == "clip" else "pages"]
                ours, vectors = served(model_dir, name, files, device)
                reference = clip_reference if name == "clip" else pages_reference
                with library_threads():  # the library at torch's default threads, as its users run it
                    theirs, want = reference(model_dir, files, device, len(vectors))
                report["models"][name] = {"handler": ours, "reference": theirs,
                                          "min_cosine_to_float32": least_cosine(vectors, want),
                                          "handler_over_reference": round(ours["images_per_s"]
                                                                          / theirs["images_per_s"], 3)}
                progress(f"images: {name}: {json.dumps(report['models'][name])}")
            except Exception as err:  # one model's failure is a finding; the next one runs
                report.setdefault("errors", {})[name] = f"{type(err).__name__}: {err}"[:2000]
                report.setdefault("tracebacks", {})[name] = traceback.format_exc()[-4000:]
                progress(f"images: {name} FAILED: {err}")
            finally:
                if cuda:
                    torch.cuda.empty_cache()
            write()
    report["complete"] = True
    write()
    return 1 if report.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
