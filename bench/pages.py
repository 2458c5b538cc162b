"""Page images served end to end against transformers' own processor and model in-process, for
both page retrievers (ColPali, ColQwen2).

    python -m bench.pages [--seconds 10] [--out bench/results]

No page retriever ships on PyPI, and the published ones (3B parameters for ColPali, 2B for
ColQwen2) take seconds a page on a 2-core CPU, so the models are transformers' ColPaliConfig and
ColQwen2Config at a smaller size with random weights (tests/support/page_models.py): 384 wide, 4
layers in each of the vision and language models, 256 image tokens a page (ColPali's 224 px pages
in 14 px patches; ColQwen2's pixel bound 256 x 28 x 28). Their vectors mean nothing; the
measure is what serving adds to (or saves from) transformers' own path on the same model, pages
and cores, not the published models' speed.

1. The machine: the CPU's model and flags, threads, torch.
2. Pages: 32 PNG document pages (850 x 1100, a white page of dark text lines: 20-40 KB each), the
   same files for both sides.
3. In-process: the processor's `process_images` on the PIL pages opened from those files and the
   model's forward under inference mode, batches of 8, all the machine's threads, the best of 2
   runs: pages/s (decoding included).
4. Served: each model built by build_mar with no option but the model (`make serve`'s defaults),
   the native route with `"modality": "image"`, 2 pages a request at 8 clients, the median of 3
   runs: pages/s, latency and TorchServe's CPU time a page.
5. The served vectors of 4 pages against the in-process ones: the least cosine over positions.
Results go to `<out>/pages.json`, with served over in-process for each model.
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

from bench.gpu_images import least_cosine
from bench.image_corpus import PAGE_SIZE, PAGES, document_pages
from bench.serving import measured_runs, median_run, serve_model
from embedserve.handler.worker.cpu_features import describe_cpu
from tests.support.page_models import make_colpali, make_colqwen2

WIDTH, LAYERS, IMAGE_TOKENS = 384, 4, 256
BATCH = 8
CLIENTS = 8
PAGES_PER_REQUEST = 2
REPEATS = 3
CHECKED = 4
MODELS = {"colpali": lambda path: make_colpali(path, image_size=224, width=WIDTH, layers=LAYERS),
          "colqwen2": lambda path: make_colqwen2(path, most_tokens=IMAGE_TOKENS, width=WIDTH, layers=LAYERS)}


def reference(model_dir: Path):
    import transformers

    architecture = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    return (transformers.AutoProcessor.from_pretrained(model_dir),
            getattr(transformers, architecture).from_pretrained(model_dir, dtype=torch.float32).eval())


def embed(processor, model, files: list[bytes]) -> list[np.ndarray]:
    """Each page's vectors where the mask attends, in batches of BATCH."""
    vectors = []
    with torch.inference_mode():
        for start in range(0, len(files), BATCH):
            batch = processor.process_images([Image.open(io.BytesIO(data)) for data in files[start:start + BATCH]])
            out = model(**batch).embeddings
            vectors += [row[mask.bool()].numpy() for row, mask in zip(out, batch["attention_mask"])]
    return vectors


def in_process(model_dir: Path, files: list[bytes], threads: int) -> dict:
    torch.set_num_threads(threads)  # building a model in this process leaves the count it ran at
    processor, model = reference(model_dir)
    embed(processor, model, files[:BATCH])  # warm
    rates = []
    for _ in range(2):
        began = time.perf_counter()
        embed(processor, model, files)
        rates.append(len(files) / (time.perf_counter() - began))
    return {"pages_per_s": round(max(rates), 3), "batch_size": BATCH, "threads": torch.get_num_threads()}


def served(model_dir: Path, name: str, files: list[bytes], seconds: float) -> dict:
    uris = ["data:image/png;base64," + base64.b64encode(data).decode() for data in files]
    with serve_model(model_dir, name, f"the {name} archive") as server:
        url = f"{server.url('inference')}/predictions/{name}"
        info = requests.get(f"{url}/1.0/info", headers=server.auth(), timeout=60).json()
        runs = measured_runs(server, url, uris, [IMAGE_TOKENS] * len(uris), clients=CLIENTS,
                             per_request=PAGES_PER_REQUEST, seconds=seconds, repeats=REPEATS,
                             body=lambda batch: {"input": batch, "modality": "image"})
        answer = requests.post(url, headers=server.auth(), timeout=300,
                               json={"input": uris[:CHECKED], "modality": "image"}).json()["data"]
    median = median_run(runs)
    return {"pages_per_s": median["texts_per_s"], "p50_ms": median["p50_ms"], "p99_ms": median["p99_ms"],
            "errors": median["errors"], "server_cpu_ms_per_page": round(median["server_cpu_ms_per_item"], 1),
            "runs": [run["texts_per_s"] for run in runs], "clients": CLIENTS, "pages_per_request": PAGES_PER_REQUEST,
            "workers": info.get("workers"), "engine": info.get("engine"),
            "vectors": [row["embedding"] for row in answer]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.pages", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=None, help="write pages.json here")
    args = parser.parse_args(argv)
    files = document_pages()
    threads = torch.get_num_threads()
    result = {"cpu": describe_cpu(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
              "pages": {"count": PAGES, "size": list(PAGE_SIZE), "format": "PNG",
                        "median_bytes": int(statistics.median(map(len, files)))},
              "models": {}}
    with tempfile.TemporaryDirectory(prefix="bench-pages-") as tmp:
        for name, make in MODELS.items():
            model_dir = make(Path(tmp) / name)
            reference_run = in_process(model_dir, files, threads)
            print(json.dumps({name: {"in_process": reference_run}}), file=sys.stderr, flush=True)
            serving = served(model_dir, name, files, args.seconds)
            cosine = least_cosine(serving.pop("vectors"), embed(*reference(model_dir), files[:CHECKED]))
            result["models"][name] = {
                "model": f"{name}'s architecture at {WIDTH} wide, {LAYERS} layers each, random weights",
                "image_tokens": IMAGE_TOKENS, "in_process": reference_run, "served": serving,
                "least_cosine": cosine,
                "served_over_in_process": round(serving["pages_per_s"] / reference_run["pages_per_s"], 3)}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "pages.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
