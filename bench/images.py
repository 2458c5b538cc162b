"""Images served end to end against sentence-transformers' `encode` of the same images in-process.

    python -m bench.images [--seconds 10] [--out bench/results]

No CLIP checkpoint ships on PyPI, so the model is openai/clip-vit-base-patch32's published
architecture (tests/fixtures/published/clip-vit-base-patch32: ViT-B/32 at 224 pixels, 12 layers
768 wide, the 512-wide shared space) with random weights: its vectors mean nothing, its cost is the
real model's.

1. The machine: the CPU's model and flags, threads, torch.
2. Images: 64 JPEG photographs' worth (640 x 480, smooth gradients and noise: 40-60 KB each), the
   same files for both sides.
3. In-process: SentenceTransformer.encode on the PIL images opened from those files, batches of
   32, all the machine's threads, the best of 2 runs: images/s (decoding included: PIL decodes
   lazily, in encode).
4. Served: the model built by build_mar with no option but the model (`make serve`'s defaults:
   its check verifies the bfloat16 vision tower, which a worker on a CPU with bf16 units serves
   where its engine trial finds it faster; `/info`'s choice is recorded), the OpenAI route
   with `"modality": "image"`, 4 images a request at 16 clients, the median of 2 runs: images/s and
   latency, and TorchServe's CPU time an image.
5. Its vectors against encode's on 8 of the images: the least cosine.
6. A mixed load on the same server: requests of Jina's item objects, 2 images and 6 captions each
   (the 64 images and 192 captions), 16 clients: items/s and latency, against encode of the same
   images and captions in-process (each kind in its own batches of 32, their times added).
Results go to `<out>/images.json`, the target (served >= 1.3x in-process) checked at the end.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import requests
import torch
from PIL import Image

from bench.image_corpus import IMAGES, SIZE, photographs
from bench.load import run_load
from bench.serving import measured_runs, median_run, serve_model
from embedserve.handler.worker.cpu_features import describe_cpu
from tests.support.image_models import make_clip

NAME = "clip"
CLIENTS = 16
IMAGES_PER_REQUEST = 4
REPEATS = 2
CHECKED = 8
SPEEDUP_GOAL = 1.3
CAPTIONS_PER_IMAGE = 3  # the mixed load: 2 images and 6 captions a request
MIXED_ITEMS_PER_REQUEST = 2 * (1 + CAPTIONS_PER_IMAGE)


def captions() -> list[str]:
    """Captions of photographs, CAPTIONS_PER_IMAGE an image, of 6 to 20 words."""
    rng = np.random.default_rng(1)
    words = ("a red cat sleeping on a wooden table near the window in soft morning light with "
             "two dogs running across green field under cloudy sky beside old stone bridge").split()
    return [" ".join(rng.choice(words, int(rng.integers(6, 21)))) for _ in range(IMAGES * CAPTIONS_PER_IMAGE)]


def mixed_items(uris: list[str], texts: list[str]) -> list[dict[str, str]]:
    """Each image followed by its captions, as Jina's item objects."""
    items = []
    for i, uri in enumerate(uris):
        items.append({"image": uri})
        items += [{"text": text} for text in texts[i * CAPTIONS_PER_IMAGE:(i + 1) * CAPTIONS_PER_IMAGE]]
    return items


def in_process(model_dir: Path, files: list[bytes], texts: list[str]) -> dict:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu")
    model.encode([Image.open(io.BytesIO(data)) for data in files[:8]], batch_size=32)  # warm
    model.encode(texts[:32], batch_size=32)
    rates, text_seconds = [], []
    for _ in range(2):
        images = [Image.open(io.BytesIO(data)) for data in files]
        began = time.perf_counter()
        model.encode(images, batch_size=32)
        rates.append(len(files) / (time.perf_counter() - began))
        began = time.perf_counter()
        model.encode(texts, batch_size=32)
        text_seconds.append(time.perf_counter() - began)
    mixed = (len(files) + len(texts)) / (len(files) / max(rates) + min(text_seconds))
    return {"images_per_s": round(max(rates), 2), "texts_per_s": round(len(texts) / min(text_seconds), 2),
            "mixed_items_per_s": round(mixed, 2), "batch_size": 32, "threads": torch.get_num_threads()}


def served(model_dir: Path, files: list[bytes], texts: list[str], seconds: float) -> dict:
    uris = ["data:image/jpeg;base64," + base64.b64encode(data).decode() for data in files]
    with serve_model(model_dir, NAME, "the CLIP archive") as server:
        url = f"{server.url('inference')}/predictions/{NAME}/1.0/v1/embeddings"
        info = requests.get(f"{server.url('inference')}/predictions/{NAME}/1.0/info", headers=server.auth(),
                            timeout=60).json()
        runs = measured_runs(server, url, uris, [49] * len(uris), clients=CLIENTS, per_request=IMAGES_PER_REQUEST,
                             seconds=seconds, repeats=REPEATS, body=lambda batch: {"input": batch, "modality": "image"})
        vectors = requests.post(url, headers=server.auth(), timeout=300,
                                json={"input": uris[:CHECKED], "modality": "image"}).json()["data"]
        items = mixed_items(uris, texts)
        mixed = run_load(url, server.auth(), items, [1] * len(items), concurrency=CLIENTS,
                         texts_per_request=MIXED_ITEMS_PER_REQUEST, seconds=seconds).summary()
    median = median_run(runs)
    return {"images_per_s": median["texts_per_s"], "p50_ms": median["p50_ms"], "p99_ms": median["p99_ms"],
            "errors": median["errors"], "server_cpu_ms_per_image": round(median["server_cpu_ms_per_item"], 2),
            "runs": [run["texts_per_s"] for run in runs], "clients": CLIENTS,
            "images_per_request": IMAGES_PER_REQUEST, "vectors": [row["embedding"] for row in vectors],
            "image_engine": info.get("image_engine"),
            "image_engine_by": {key: info["selected_by"].get(key) for key in ("image_dtype", "image_speeds")},
            "mixed": {"items_per_s": mixed["texts_per_s"], "p50_ms": mixed["p50_ms"], "p99_ms": mixed["p99_ms"],
                      "errors": mixed["errors"], "items_per_request": MIXED_ITEMS_PER_REQUEST,
                      "images_per_request": MIXED_ITEMS_PER_REQUEST // (1 + CAPTIONS_PER_IMAGE)}}


def least_cosine(model_dir: Path, files: list[bytes], got: list[list[float]]) -> float:
    from sentence_transformers import SentenceTransformer

    want = SentenceTransformer(str(model_dir), device="cpu").encode(
        [Image.open(io.BytesIO(data)) for data in files[:CHECKED]])
    got_ = np.asarray(got, dtype=np.float64)
    return float(((got_ * want).sum(1) / np.linalg.norm(got_, axis=1) / np.linalg.norm(want, axis=1)).min())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.images", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=None, help="write images.json here")
    args = parser.parse_args(argv)
    files, texts = photographs(), captions()
    with tempfile.TemporaryDirectory(prefix="bench-images-") as tmp:
        model_dir = make_clip(Path(tmp) / "clip-vit-base-patch32", full_size=True)
        reference = in_process(model_dir, files, texts)
        print(json.dumps({"in_process": reference}), file=sys.stderr, flush=True)
        serving = served(model_dir, files, texts, args.seconds)
        cosine = least_cosine(model_dir, files, serving.pop("vectors"))
    result = {
        "cpu": describe_cpu(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "model": "openai/clip-vit-base-patch32's architecture, random weights",
        "images": {"count": IMAGES, "size": list(SIZE), "format": "JPEG",
                   "median_bytes": int(statistics.median(map(len, files)))},
        "in_process": reference, "served": serving, "least_cosine": round(cosine, 7),
        "served_over_in_process": round(serving["images_per_s"] / reference["images_per_s"], 3),
        "mixed_served_over_in_process": round(serving["mixed"]["items_per_s"] / reference["mixed_items_per_s"], 3),
        "goal": SPEEDUP_GOAL,
    }
    result["met"] = result["served_over_in_process"] >= SPEEDUP_GOAL
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "images.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
