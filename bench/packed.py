"""Packed against padded forward passes on a CPU: all-MiniLM-L6-v2, 2 threads, the mixed corpus.

    python -m bench.packed [--texts 256] [--rounds 4] [--out bench/results/packed.json]
    python -m bench.packed --end-to-end   # packed and default builds through TorchServe, in turns

1. Attention kernels for a packed pass (embedserve/handler/backends/packed.py), on the model's attention shape (12
   heads of 32) and random q, k, v: one SDPA call per input, SDPA over jagged nested tensors,
   one padded SDPA over the pass, a block-diagonal mask over the pass, the length-grouped padded
   SDPA, and torch.nn.attention.varlen (flash attention, CUDA only). Each is checked against the
   per-input SDPA and timed on the corpus's length-sorted passes, on one long input among many
   short ones, and on passes of the corpus unsorted.
2. The corpus embedded in-process, in requests of 64 texts, three ways: packed torch (passes of
   at most 1024 real tokens, cut in length-sorted order), the encoder's padded torch path
   (passes of at most 1024 padded tokens, its least-cost planner) and the ONNX Runtime engine on
   the build's export (the same planner). Real tokens/s, real / computed tokens, and each one's
   cosine to the padded torch vectors.

The machine may be shared: candidates take turns (engines request by request), each keeps its
best round, and the load average is recorded beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F

from embedserve.archive.corpus import load_tokenizer, mixed_corpus
from embedserve.archive.default_model import MODEL_ID, fetch_default_model
from bench import serving
from bench.cpu_kernels import exported_copy
from bench.inprocess import cosine_stats, load_engine
from embedserve.handler.model.packed_forward import GROUPED_SDPA, grouped_attention, length_groups, pack
from embedserve.handler.model.pooling import l2_normalize
from embedserve.handler.scheduling.planner import plan_packed
from embedserve.handler.service import EmbeddingService
from embedserve.handler.model.inputs import plain_inputs

REPO = Path(__file__).resolve().parent.parent
THREADS = 2
PASS_TOKENS = 1024  # real tokens per packed pass; the padded engines' budget of padded tokens
HEADS, HEAD_DIM = 12, 32  # all-MiniLM-L6-v2's attention
CORRECT = 1e-4  # a kernel's largest difference to per-input SDPA that still counts as correct
# Engines take turns request by request, so a busy moment on a shared machine slows all alike.
REQUEST_TEXTS = 64


class Run(NamedTuple):
    vectors: torch.Tensor  # (texts, dimension) float32
    computed_tokens: int  # tokens the passes ran, padding included
    passes: int


def packed_passes(lengths: Sequence[int]) -> list[list[int]]:
    """Indices, longest first, cut into passes of at most PASS_TOKENS real tokens each."""
    return plan_packed(lengths, PASS_TOKENS, max_batch_size=max(1, len(lengths)))


def arrival_passes(lengths: Sequence[int], order: Sequence[int]) -> list[list[int]]:
    """The indices in `order`, as they come, cut into passes of at most PASS_TOKENS real tokens each."""
    passes: list[list[int]] = [[]]
    tokens = 0
    for index in order:
        if passes[-1] and tokens + lengths[index] > PASS_TOKENS:
            passes.append([])
            tokens = 0
        passes[-1].append(index)
        tokens += lengths[index]
    return passes


# --- attention kernels: (total, heads, head_dim) q, k, v and (n + 1,) offsets -> (total, heads, head_dim)

def per_input_sdpa(q, k, v, cu_seqlens, max_len):
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        out[start:end] = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)).transpose(0, 1)
    return out


def nested_jagged_sdpa(q, k, v, cu_seqlens, max_len):
    # Jagged views of inference tensors are refused, so under the encoder's inference_mode this
    # kernel could not run at all; here q, k, v are ordinary tensors.
    offsets = cu_seqlens.long()
    q, k, v = (torch.nested.nested_tensor_from_jagged(x, offsets, max_seqlen=max_len).transpose(1, 2)
               for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).values()


def one_padded_sdpa(q, k, v, cu_seqlens, max_len):
    return grouped_attention(q, k, v, length_groups(cu_seqlens, ratio=0.0), scale=HEAD_DIM ** -0.5)


def block_diagonal_sdpa(q, k, v, cu_seqlens, max_len):
    lengths = cu_seqlens.long().diff()
    owner = torch.repeat_interleave(torch.arange(len(lengths)), lengths)  # (total,)
    mask = owner[:, None] == owner[None, :]  # (total, total)
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          attn_mask=mask).transpose(0, 1)


def grouped_sdpa(q, k, v, cu_seqlens, max_len):
    return grouped_attention(q, k, v, length_groups(cu_seqlens), scale=HEAD_DIM ** -0.5)


def varlen_flash(q, k, v, cu_seqlens, max_len):
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len)


KERNELS: dict[str, Callable] = {
    "per_input_sdpa": per_input_sdpa, "nested_jagged_sdpa": nested_jagged_sdpa, "one_padded_sdpa": one_padded_sdpa,
    "block_diagonal_sdpa": block_diagonal_sdpa, GROUPED_SDPA: grouped_sdpa, "varlen_flash": varlen_flash,
}


def _timed(kernel: Callable, inputs: list[tuple]) -> tuple[float, list[torch.Tensor]]:
    """Milliseconds to run `kernel` on every pass of `inputs`, and its outputs."""
    with warnings.catch_warnings():  # nested tensors warn that their API is a prototype
        warnings.simplefilter("ignore")
        started = time.perf_counter()
        outputs = [kernel(*args) for args in inputs]
        return (time.perf_counter() - started) * 1000, outputs


def compare_attention_kernels(corpus_lengths: list[int], rounds: int) -> dict:
    """Each kernel on the shapes of a few kinds of pass: -> {case: {kernel: ms, error}}. Offsets are
    regrouped at every call, where a forward pass groups them once for all its layers."""
    arrival = random.Random(0).sample(range(len(corpus_lengths)), len(corpus_lengths))
    cases = {
        "length_sorted_passes": [[corpus_lengths[i] for i in p] for p in packed_passes(corpus_lengths)],
        "one_long_many_short": [[256] + [8] * 96],
        "unsorted_passes": [[corpus_lengths[i] for i in p] for p in arrival_passes(corpus_lengths, arrival)][:6],
    }
    results = {}
    for case, passes in cases.items():
        inputs = []
        for lengths in passes:
            packed = pack([[0] * n for n in lengths])
            total = packed.ids.numel()
            q, k, v = (torch.randn(total, HEADS, HEAD_DIM) for _ in range(3))
            inputs.append((q, k, v, packed.cu_seqlens, packed.max_len))
        reference = [per_input_sdpa(*args) for args in inputs]
        rows = {}
        for name in KERNELS:  # the first round also checks each kernel against the reference
            try:
                milliseconds, outputs = _timed(KERNELS[name], inputs)
                error = max(float((got - want).abs().max()) for got, want in zip(outputs, reference))
                rows[name] = {"ms": milliseconds, "max_abs_err": error, "correct": error < CORRECT}
            except Exception as err:  # a kernel this device lacks is reported, not fatal
                rows[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}
        fastest = min(row["ms"] for row in rows.values() if "ms" in row)
        for _ in range(rounds - 1):  # a kernel over 10x the fastest is out of the race: not timed again
            for name, row in rows.items():
                if "ms" in row and row["ms"] < 10 * fastest:
                    row["ms"] = min(row["ms"], _timed(KERNELS[name], inputs)[0])
        for row in rows.values():
            if "ms" in row:
                row["ms"] = round(row["ms"], 2)
        results[case] = {"passes": len(passes), "tokens": sum(map(sum, passes)), "kernels": rows}
        print(f"  attention, {case}: " + ", ".join(f"{name} {row.get('ms', 'n/a')} ms" for name, row in rows.items()),
              file=sys.stderr, flush=True)
    return results


def compare_engines(model_dir: Path, texts: list[str], rounds: int) -> dict:
    """The corpus in requests of REQUEST_TEXTS texts, each embedded by every engine in turn, round
    after round; each engine's time is the sum over requests of its best round."""
    with tempfile.TemporaryDirectory(prefix="bench-packed-") as tmp:
        padded = load_engine(model_dir, THREADS, engine="torch", lend_idle_cpus=False)
        onnx = load_engine(exported_copy(model_dir, Path(tmp)), THREADS, engine="auto", lend_idle_cpus=False)
        assert onnx.encoder.describe()["engine"] == "onnxruntime", onnx.encoder.describe()
        packed = load_engine(model_dir, THREADS, engine="torch", packed=True, lend_idle_cpus=False)
        assert packed.info()["layout"] == "packed", packed.info()
        rows = padded.text.token_ids(texts)

        def run_engine(engine: EmbeddingService) -> Callable[[list[list[int]]], Run]:
            def run(request: list[list[int]]) -> Run:
                embedded = engine.encoder.embed(plain_inputs(request))
                return Run(embedded.vectors, embedded.padded_tokens, embedded.passes)
            return run

        candidates = {"packed_torch": run_engine(packed), "padded_torch": run_engine(padded),
                      "onnxruntime": run_engine(onnx)}
        requests = [rows[start:start + REQUEST_TEXTS] for start in range(0, len(rows), REQUEST_TEXTS)]
        best = {name: [float("inf")] * len(requests) for name in candidates}
        runs: dict[str, list[Run]] = {name: [] for name in candidates}
        for round_ in range(rounds):
            for index, request in enumerate(requests):
                for name, run in candidates.items():
                    started = time.perf_counter()
                    result = run(request)
                    best[name][index] = min(best[name][index], time.perf_counter() - started)
                    if round_ == 0:
                        runs[name].append(result)
        real = sum(map(len, rows))
        reference = l2_normalize(torch.cat([run.vectors for run in runs["padded_torch"]])).numpy()
        engines = {}
        for name, results in runs.items():
            seconds = sum(best[name])
            vectors = l2_normalize(torch.cat([run.vectors for run in results])).numpy()
            engines[name] = {
                "real_tokens_per_s": round(real / seconds, 1),
                "texts_per_s": round(len(texts) / seconds, 1),
                "seconds": round(seconds, 3),
                "real_over_computed_tokens": round(real / sum(run.computed_tokens for run in results), 3),
                "forward_passes": sum(run.passes for run in results),
                **cosine_stats(vectors, reference),
            }
            print(f"  {name}: {engines[name]}", file=sys.stderr, flush=True)
        packed_speed = engines["packed_torch"]["real_tokens_per_s"]
        return {
            "real_tokens": real,
            "texts_per_request": REQUEST_TEXTS,
            "attention_kernel": packed.info()["attention"],
            "engines": engines,
            "packed_over_padded_torch": round(packed_speed / engines["padded_torch"]["real_tokens_per_s"], 3),
            "packed_over_onnxruntime": round(packed_speed / engines["onnxruntime"]["real_tokens_per_s"], 3),
        }


def end_to_end(seconds: float, pairs: int = 2) -> list[dict]:
    """Packed and default (ONNX Runtime, padded) builds served by the real TorchServe in turns,
    `pairs` times: the mixed corpus, one text per request, at 1 and 64 clients."""
    model_dir = fetch_default_model()
    tokenizer = load_tokenizer(model_dir / "tokenizer.json")
    corpora = {"mixed": mixed_corpus(model_dir / "tokenizer.json", 2048)}
    tokens = {"mixed": [len(tokenizer.encode(text).ids) for text in corpora["mixed"]]}
    runs = []
    for settings in (["packed=true"], []) * pairs:
        rows = serving.end_to_end("float32", corpora, tokens, [("mixed", 1, 1), ("mixed", 64, 1)], seconds,
                                  settings=settings)
        runs.append({"build": settings[0] if settings else "default",
                     "rows": [{key: row[key] for key in ("concurrency", "texts_per_s", "p50_ms", "p99_ms")} for row in rows]})
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.packed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=256, help="mixed-corpus texts embedded per engine")
    parser.add_argument("--rounds", type=int, default=4, help="rounds; each candidate keeps its best")
    parser.add_argument("--end-to-end", action="store_true",
                        help="instead: packed and default builds through TorchServe in turns (needs Java; ~10 min)")
    parser.add_argument("--out", type=Path, help="default: bench/results/packed.json, or packed_e2e.json")
    args = parser.parse_args(argv)
    if args.end_to_end:
        out = args.out or REPO / "bench" / "results" / "packed_e2e.json"
        out.write_text(json.dumps(end_to_end(seconds=10.0), indent=2))
        print(f"wrote {out}", file=sys.stderr)
        return 0
    args.out = args.out or REPO / "bench" / "results" / "packed.json"

    torch.set_num_threads(THREADS)
    model_dir = fetch_default_model()
    texts = mixed_corpus(model_dir / "tokenizer.json", args.texts)
    load_before = os.getloadavg()
    results = {"model": MODEL_ID, "threads": THREADS, "texts": args.texts, "rounds": args.rounds,
               "machine": {"platform": platform.platform(), "torch": torch.__version__,
                           "date": time.strftime("%Y-%m-%d %H:%M:%S")}}
    print("attention kernels ...", file=sys.stderr)
    tokenizer = load_tokenizer(model_dir / "tokenizer.json")
    lengths = [len(tokenizer.encode(text).ids) for text in texts]  # the corpus stays within 256 tokens
    results["attention_kernels"] = compare_attention_kernels(lengths, args.rounds)
    print(f"engines: {args.texts} mixed texts, {THREADS} threads ...", file=sys.stderr)
    results.update(compare_engines(model_dir, texts, args.rounds))
    results["load_average_1min"] = {"start": round(load_before[0], 2), "end": round(os.getloadavg()[0], 2)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
