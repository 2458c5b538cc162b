"""A 100,000-token input in one request ("long_input": "chunk") against the same tokens sent as
separate texts, served end to end.

    python -m bench.long_inputs [--tokens 100000] [--rounds 2] [--out bench/results/long_inputs.json]

The default model built as `make serve` builds it, with max_input_chars raised so that one text
can hold the tokens (`--set max_input_chars=1000000`). The long text is `--tokens` tokens of the
model's vocabulary words (text_of_length, as the benchmark's corpora). In turns, `--rounds` times:

- one request: the whole text with "long_input": "chunk"; TorchServe hands it to one worker,
  whose batch holds all its windows;
- the same tokens as separate texts: the text cut where the server cuts it (the text tokens a
  window holds), in requests of 32 texts, 2 in flight (one a worker).

Cost per token: TorchServe's CPU seconds (frontend and workers) over the tokens the model
computed (`usage.prompt_tokens`), each side alone on the server; the wall time too, though one
request is one worker's (TorchServe gives a request to one worker), so the long request takes one
worker's time while separate requests spread over both. Then the long request again beside a
client sending one short text at a time: the short texts' latency against the same client's on
the idle server says how the long request shares the workers. The median of the rounds is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests

from bench.batch import cpu_model
from bench.serving import serve_model
from bench.serving import server_cpu_seconds
from embedserve.archive.corpus import load_tokenizer, text_of_length, vocabulary_words
from embedserve.archive.default_model import fetch_default_model

REPO = Path(__file__).resolve().parent.parent
NAME = "minilm"
TARGET = 1.2
GROUP = 32
SHORT = "what is an embedding?"


def windows_of(text: str, tokenizer, room: int) -> list[str]:
    """`text` cut into pieces of `room` tokens, at the tokens' character offsets."""
    offsets = tokenizer.encode(text, add_special_tokens=False).offsets
    cuts = [offsets[i][0] for i in range(0, len(offsets), room)] + [len(text)]
    return [text[a:b].strip() for a, b in zip(cuts, cuts[1:]) if text[a:b].strip()]


def post(url: str, auth: dict, body: dict) -> dict:
    answer = requests.post(url, json=body, headers=auth, timeout=900)
    if answer.status_code != 200:
        raise SystemExit(f"HTTP {answer.status_code}: {answer.text[:500]}")
    return answer.json()


def short_latencies(url: str, auth: dict, stop: threading.Event, seconds: float | None = None) -> list[float]:
    latencies, ends = [], time.monotonic() + (seconds or 1e9)
    while not stop.is_set() and time.monotonic() < ends:
        started = time.perf_counter()
        post(url, auth, {"input": SHORT})
        latencies.append((time.perf_counter() - started) * 1000)
    return latencies


def measured(server, work) -> tuple[float, float, Any]:
    """`work()`: its wall seconds, TorchServe's CPU seconds during it, its result."""
    cpu, started = sum(server_cpu_seconds(server)), time.perf_counter()
    result = work()
    return time.perf_counter() - started, sum(server_cpu_seconds(server)) - cpu, result


def one_round(server, url: str, auth: dict, text: str, pieces: list[str]) -> dict:
    """Each side alone on the server, then the long request again beside a client of short texts."""
    long_s, long_cpu, whole = measured(
        server, lambda: post(url, auth, {"input": text, "long_input": "chunk", "encoding_format": "base64"}))
    groups = [pieces[i:i + GROUP] for i in range(0, len(pieces), GROUP)]

    def separately():
        with ThreadPoolExecutor(2) as pool:
            return list(pool.map(lambda g: post(url, auth, {"input": g, "encoding_format": "base64"}), groups))

    separate_s, separate_cpu, answers = measured(server, separately)
    stop = threading.Event()
    with ThreadPoolExecutor(1) as side:
        shorts = side.submit(short_latencies, url, auth, stop)
        post(url, auth, {"input": text, "long_input": "chunk", "encoding_format": "base64"})
        stop.set()
        beside = shorts.result()
    tokens = whole["usage"]["prompt_tokens"]
    separate_tokens = sum(a["usage"]["prompt_tokens"] for a in answers)
    return {"long": {"seconds": round(long_s, 2), "cpu_s": round(long_cpu, 2), "tokens": tokens,
                     "windows": whole["data"][0]["windows"],
                     "cpu_us_per_token": round(long_cpu / tokens * 1e6, 1)},
            "separate": {"seconds": round(separate_s, 2), "cpu_s": round(separate_cpu, 2), "tokens": separate_tokens,
                         "texts": len(pieces), "requests": len(groups),
                         "cpu_us_per_token": round(separate_cpu / separate_tokens * 1e6, 1)},
            "cpu_ratio": round(long_cpu / tokens / (separate_cpu / separate_tokens), 3),
            "wall_ratio": round(long_s / tokens / (separate_s / separate_tokens), 3),
            "short_beside_long_ms": latency(beside)}


def latency(values: list[float]) -> dict:
    return {"count": len(values), "p50": round(statistics.median(values), 1) if values else None,
            "max": round(max(values), 1) if values else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "long_inputs.json")
    args = parser.parse_args()
    model_dir = fetch_default_model()
    tokenizer = load_tokenizer(model_dir / "tokenizer.json")
    text = text_of_length(tokenizer, vocabulary_words(tokenizer), random.Random(0), args.tokens + 2)
    with serve_model(model_dir, NAME, "the default model", ("--set", "max_input_chars=1000000")) as server:
        base = f"{server.url('inference')}/predictions/{NAME}/1.0"
        auth = server.auth()
        info = requests.get(f"{base}/info", headers=auth, timeout=30).json()
        pieces = windows_of(text, tokenizer, info["max_input_length"] - 2)
        idle = short_latencies(f"{base}/v1/embeddings", auth, threading.Event(), seconds=5)
        rounds = [one_round(server, f"{base}/v1/embeddings", auth, text, pieces) for _ in range(args.rounds)]
        info = requests.get(f"{base}/info", headers=auth, timeout=30).json()
    ratio = statistics.median(r["cpu_ratio"] for r in rounds)
    result = {"cpu": cpu_model(), "cores": os.cpu_count(), "load_average": os.getloadavg(),
              "model": f"all-MiniLM-L6-v2, {info['model_dtype']} {info['engine']}, 2 workers", "tokens": args.tokens,
              "max_input_length": info["max_input_length"], "short_idle_ms_p50": round(statistics.median(idle), 1),
              "rounds": rounds, "cpu_ratio_median": ratio,
              "wall_ratio_median": statistics.median(r["wall_ratio"] for r in rounds), "target": TARGET,
              "met": ratio <= TARGET}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
