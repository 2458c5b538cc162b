"""Late chunking on the device, as a worker serves it: `python -m bench.gpu_late_chunk MODEL_DIR --out DIR`.

The model's late chunked answers ("long_input": "late_chunk": fixed spans, caller spans and a text
longer than the model) from the service assembled as a worker assembles it on the device (CUDA:
float16, CUDA graphs and packed passes where the worker's defaults take them), then with packed
passes off (padded passes: spans of one window share one eager pass), against the reference of
tests/support/long_inputs.py: sentence-transformers' own token vectors in float32. Writes
late_chunk.json: the min cosine per layout and case, the spans, each layout's time.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from embedserve.handler.api.exchange import RawRequest
from embedserve.handler.assembly import assemble
from embedserve.handler.settings import Settings
from tests.support.long_inputs import LONG, cosine, late_reference

SHORT = "The cat sat on the mat. It was warm there, and it slept."
CASES = {
    "fixed": ({"input": [SHORT, LONG[:600]], "chunk_size": 8}, [(SHORT, {"size": 8}), (LONG[:600], {"size": 8})]),
    "caller_spans": ({"input": [SHORT], "chunk_spans": [[[0, 23], [24, 56], [4, 30]]]},
                     [(SHORT, {"spans": [(0, 23), (24, 56), (4, 30)]})]),
    "longer_than_the_model": ({"input": [LONG], "chunk_size": 64, "chunk_overlap": 32},
                              [(LONG, {"size": 64, "context": 32})]),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    from sentence_transformers import SentenceTransformer

    reference_model = SentenceTransformer(str(args.model), device="cpu").float()
    found: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "layouts": {}}
    for layout, settings in (("default", {}), ("padded", {"packed": False})):
        service = assemble(args.model, Settings.from_mapping({"device": args.device, **settings}), model_name="late",
                           cuda_available=args.device == "cuda", warm=True)
        record = {"runs": service.encoder.describe(), "cases": {}}
        for name, (body, expected) in CASES.items():
            raw = RawRequest(json.dumps({**body, "long_input": "late_chunk"}).encode(), "application/json",
                             "v1/embeddings")
            started = time.perf_counter()
            [response] = service.handle([raw])
            elapsed = time.perf_counter() - started
            answer = json.loads(response.body)
            if response.status != 200:
                record["cases"][name] = {"status": response.status, "answer": answer}
                continue
            cosines = []
            for owner, (text, options) in enumerate(expected):
                items = [item for item in answer["data"] if item["input"] == owner]
                reference = late_reference(reference_model, text, service.text.max_length, **options)
                assert len(items) == len(reference), (name, len(items), len(reference))
                cosines += [cosine(item["embedding"], vector) for item, (vector, _, _) in zip(items, reference)]
            record["cases"][name] = {"spans": len(cosines), "min_cosine": round(float(np.min(cosines)), 6),
                                     "ms": round(1000 * elapsed, 2), "usage": answer["usage"]["prompt_tokens"]}
        found["layouts"][layout] = record
        print(layout, json.dumps(record))
        del service
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "late_chunk.json").write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
