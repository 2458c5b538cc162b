"""What a deliberately invalidated CUDA graph capture does to the process, read on a real GPU.

    python -m bench.gpu_capture_probe --out DIR [--device auto|cuda|cpu]

Each step runs in a process of its own (an internal assert of the allocator, or a sticky CUDA
error, ends the process) under a time limit, and DIR/capture_probe.json is rewritten after each,
so a step that dies or hangs still leaves the others' rows:

- `raw`: torch alone. A capture whose pass copies a host tensor to the device (what MPNet's eager
  attention does, and any `.item()`): does the pass raise, does `capture_end`, does a later
  `empty_cache`, does a second, legal capture into the same pool then work, and one into a new
  pool, and eager work after all that?
- `handler`: embedserve/handler/backends/cuda_graphs.py's `capture_checked` on three buckets, the smallest or the
  largest of which invalidates its capture: what is kept, the handler's warnings, and whether
  eager passes still work afterwards.
- `sync_check`: `forward_synchronizes` on a pass that reads the device from the host and on one
  that does not.
- `padded_forward`: does an eager fp16 BERT pass with a padding mask synchronize with the host
  (torch's sync debug mode set to error)?

Without CUDA (CI) only `sync_check` runs, on the CPU (where the check sees the host reads too);
the other rows say they were skipped.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch

STEP_SECONDS = 60


def _step_raw(device: torch.device) -> dict:
    row: dict = {}
    x = torch.randn(64, 64, device=device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    pool = torch.cuda.graph_pool_handle()
    with torch.cuda.stream(stream):
        x @ x  # cuBLAS sets itself up outside the capture, as capture requires
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=pool)
        row["pass_raised"] = _attempt(lambda: (x @ x) + torch.tensor(1.0, device=device))  # a host copy
        row["capture_end_raised"] = _attempt(graph.capture_end)
        row["empty_cache_raised"] = _attempt(torch.cuda.empty_cache)

        def capture_into(graph_pool) -> bool:
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=graph_pool)
            out = x @ x
            graph.capture_end()
            graph.replay()
            torch.cuda.synchronize()
            return bool(torch.allclose(out, x @ x, atol=1e-2))

        row["second_capture_same_pool"] = _outcome(lambda: capture_into(pool))
        row["capture_new_pool"] = _outcome(lambda: capture_into(torch.cuda.graph_pool_handle()))
    row["eager_after"] = _outcome(lambda: bool(torch.isfinite(x @ x).all().item()))
    return row


def _step_handler(device: torch.device) -> dict:
    import logging

    from embedserve.handler.backends.cuda_graphs import Bucket, StaticPass, capture_checked

    weight = torch.randn(32, 32, device=device)

    class Probe(StaticPass):
        def __init__(self, bucket: Bucket, poisoned: bool):
            super().__init__(bucket, device)
            self.poisoned = poisoned
            self.x = torch.randn(bucket.batch, 32, device=device)

        def compute(self) -> torch.Tensor:
            y = self.x @ weight
            if self.poisoned:  # the host copy MPNet's eager attention makes
                y = y + torch.tensor(0.0, device=device)
            return y

    def random_pass(graph: Probe) -> tuple[torch.Tensor, torch.Tensor]:
        graph.x.copy_(torch.randn_like(graph.x))
        graph.replay()
        return graph.output.clone(), graph.x @ weight

    class Collect(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage()[:500])

    row: dict = {}
    # The smallest bucket poisoned first: the sync check refuses it before anything is captured.
    # Then the largest: captured first, its capture fails, on the real allocator.
    for case, poisoned in (("smallest_poisoned", 4), ("largest_poisoned", 16)):
        graphs = [Probe(Bucket(batch, 1), poisoned=batch == poisoned) for batch in (4, 8, 16)]
        collect = Collect()
        logging.getLogger("embedserve.handler").addHandler(collect)
        try:
            kept = capture_checked(graphs, device, 2**30, random_pass, 1e-2)
            row[case] = {"kept": sorted(map(str, kept)), "warnings": collect.lines}
        except Exception as err:
            row[case] = {"raised": _name(err), "warnings": collect.lines}
        finally:
            logging.getLogger("embedserve.handler").removeHandler(collect)
        row[case]["eager_after"] = _outcome(lambda: bool(torch.isfinite(graphs[0].compute()).all().item()))
    row["expected"] = "kept [] in both cases, each with a warning saying why, and eager_after true"
    return row


def _step_sync_check(device: torch.device) -> dict:
    try:
        from embedserve.handler.backends.cuda_graphs import forward_synchronizes
    except ImportError as err:
        return {"skipped": f"embedserve.handler.backends.cuda_graphs has no forward_synchronizes ({err})"}
    x = torch.randn(8, device=device)
    return {"reading_pass": _outcome(lambda: forward_synchronizes(lambda: x + float(x.sum()), device)),
            "quiet_pass": _outcome(lambda: forward_synchronizes(lambda: x * 2, device)),
            "expected": "reading_pass: a reason; quiet_pass: null"}


def _step_padded_forward(device: torch.device) -> dict:
    from transformers import AutoModel

    from tests.support.tiny_model import make_tiny_model

    path = make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", max_seq_length=64)
    model = AutoModel.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float16).to(device).eval()
    ids = torch.randint(5, 50, (4, 16), device=device)
    lengths = torch.tensor([16, 3, 9, 1], device=device)
    row = {}
    for label, mask in (("all_ones", torch.ones_like(ids)),
                        ("padded", (torch.arange(16, device=device) < lengths[:, None]).long())):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.inference_mode():
                model(input_ids=ids, attention_mask=mask)
            row[label] = "no synchronization"
        except Exception as err:
            row[label] = _name(err)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return row


STEPS = {"raw": _step_raw, "handler": _step_handler, "sync_check": _step_sync_check,
         "padded_forward": _step_padded_forward}
CPU_STEPS = ("sync_check",)


def _attempt(action) -> str | None:
    """None if `action()` returned, else its exception, named."""
    try:
        action()
    except Exception as err:
        return _name(err)
    return None


def _outcome(action):
    """What `action()` returned, or its exception, named."""
    try:
        return action()
    except Exception as err:
        return _name(err)


def _name(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:300] if text else ''}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.gpu_capture_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--step", choices=sorted(STEPS))
    args = parser.parse_args(argv)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if args.step:  # the child: one step, its row as JSON on stdout's last line
        try:
            row = STEPS[args.step](device)
        except Exception as err:
            row = {"error": _name(err), "traceback": traceback.format_exc()[-3000:]}
        print(json.dumps(row, default=str))
        return 0
    rows: dict = {"device": str(device)}
    for step in STEPS:
        if not cuda and step not in CPU_STEPS:
            rows[step] = {"skipped": "no CUDA device"}
        else:
            rows[step] = _child(step, device)
        print(step, json.dumps(rows[step])[:1500], flush=True)
        if args.out:  # after every step: a later one may hang past the caller's time limit
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "capture_probe.json").write_text(json.dumps(rows, indent=2))
    return 0


def _child(step: str, device: torch.device) -> dict:
    command = [sys.executable, "-m", "bench.gpu_capture_probe", "--step", step,
               "--device", "cuda" if device.type == "cuda" else "cpu"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=STEP_SECONDS)
    except subprocess.TimeoutExpired as err:
        return {"timed_out_s": STEP_SECONDS, "stderr": (err.stderr or b"")[-3000:].decode(errors="replace")
                if isinstance(err.stderr, bytes) else (err.stderr or "")[-3000:]}
    last = done.stdout.strip().splitlines()[-1:] or [""]
    try:
        row = json.loads(last[0])
    except json.JSONDecodeError:  # the process died before its row: the stderr says how
        row = {"process_died": True, "stderr": done.stderr[-3000:]}
    row["exit_code"] = done.returncode
    return row


if __name__ == "__main__":
    sys.exit(main())
