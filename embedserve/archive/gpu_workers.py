"""Workers per GPU for a GPU build: as many as the host's cores keep busy and the GPU's memory
holds, each loaded at its largest pass.

- **Cores.** A served GPU worker's host path, not the GPU, is the bound: on an H200 at 256
  clients two workers served 7,212 texts/s using 3.03 cores and the frontend 0.98 more, the GPU
  14% busy (docs/gpu.md). So a worker costs the host about CORES_PER_WORKER cores, its share of
  the frontend's included, and a GPU gets one worker per CORES_PER_WORKER of its share of the
  machine's cores: 8 on a 16-core single-GPU machine. At least MIN_PER_GPU: within one worker
  host work and passes follow each other, and a second overlaps them wherever the device's time
  is not negligible (two workers served 2.09x one on the H200, and 1.69-2.03x on a 2-core CPU
  with a stand-in device of 5-20 ms passes, docs/performance.md's `bench.overlap`).
- **Memory.** Every worker holds a CUDA context, the weights, its CUDA graphs' pools and, at its
  largest pass (the work bound, `max_batch_tokens`), that pass's activations. A probe process
  loads the model as a worker does and runs that pass, and the GPU's used memory with the probe
  at its peak, less before it started, is one worker's footprint (read by this process, so
  everything the probe holds counts, its context included). The workers together may hold
  MEMORY_SHARE of the GPU's memory: the sizing rule's 75-85%, at its middle.

The count is the smaller of the two, and at least one. A build with `--workers N` keeps N. The build
prints the figures and records them in the handler section (`workers_sizing`), which `/info` says.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embedserve.handler.execution.placement import available_cpus

CORES_PER_WORKER = 2.0  # the H200 run's (3.03 + 0.98) cores over its 2 workers
MIN_PER_GPU = 2  # host work of one beside the other's passes
MEMORY_SHARE = 0.8
PROBE_TIMEOUT_S = 600  # loading, capturing every CUDA graph, one largest pass
PEAK = "peak"  # the probe's line once its largest pass has run; it then waits for a line back


@dataclass(frozen=True)
class Sizing:
    per_gpu: int  # the workers each GPU gets
    gpus: int
    cores: int
    by_cores: int
    footprint_mib: int | None = None  # one worker at its largest pass; None: not measured (why_not says)
    memory_mib: int | None = None
    by_memory: int | None = None
    why_not: str = ""

    @property
    def workers(self) -> int:
        return self.per_gpu * self.gpus

    def describe(self) -> str:
        cores = f"{self.cores} cores for {self.gpus} GPU(s) at {CORES_PER_WORKER:g} a worker: {self.by_cores}"
        if self.by_memory is None:
            memory = f"memory not measured ({self.why_not})"
        else:
            memory = (f"{self.footprint_mib} MiB a worker at its largest pass, {self.by_memory} within "
                      f"{MEMORY_SHARE:.0%} of {self.memory_mib} MiB")
        return f"{self.per_gpu} workers per GPU ({cores}; {memory})"


def size_workers(cores: int, gpus: int, footprint_mib: int | None = None, memory_mib: int | None = None,
                 why_not: str = "") -> Sizing:
    """The rule above, from the machine's figures."""
    by_cores = max(MIN_PER_GPU, int(cores / max(gpus, 1) / CORES_PER_WORKER))
    by_memory = max(1, int(MEMORY_SHARE * memory_mib // footprint_mib)) if footprint_mib and memory_mib else None
    per_gpu = min(by_cores, by_memory) if by_memory else by_cores
    return Sizing(per_gpu, gpus, cores, by_cores, footprint_mib, memory_mib, by_memory, why_not)


def size_for_gpus(model_dir: Path, handler: dict[str, Any], gpus: int) -> Sizing:
    """This machine's sizing for the staged model: its cores, and the probe's footprint on GPU 0."""
    cores = available_cpus()  # as each worker counts them (its tokenizer's share; a container's CPU limit)
    try:
        footprint, memory = measure_footprint(model_dir, handler)
    except ProbeError as err:
        return size_workers(cores, gpus, why_not=str(err))
    return size_workers(cores, gpus, footprint, memory)


class ProbeError(RuntimeError):
    """The probe did not reach its peak: the memory term is left out, saying why."""


def measure_footprint(model_dir: Path, handler: dict[str, Any], command: list[str] | None = None,
                      used_mib=None) -> tuple[int, int]:
    """(one worker's GPU memory at its largest pass, the GPU's memory), MiB: the device's used
    memory with the probe at its peak less before it. `command` and `used_mib` (a function giving
    (used, total) MiB) are the probe process and the reading, for a test on a CPU."""
    used_mib = used_mib or _cuda_used_mib
    before, total = used_mib()
    command = command or [sys.executable, "-m", "embedserve.archive.gpu_workers", str(model_dir), json.dumps(handler)]
    # Its log goes to a file: a pipe nobody reads while the probe loads would fill and stop it.
    with tempfile.TemporaryFile("w+") as log, \
            subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True) as probe:
        try:
            if _read_line(probe) != PEAK:
                probe.wait(timeout=60)
                log.seek(0)
                raise ProbeError(f"the probe ended before its largest pass: {log.read().strip()[-300:]}")
            at_peak, _ = used_mib()
            probe.communicate("\n", timeout=60)
        finally:
            if probe.poll() is None:
                probe.kill()
    return max(1, at_peak - before), total


def _read_line(probe: subprocess.Popen) -> str:
    from concurrent.futures import ThreadPoolExecutor, TimeoutError

    with ThreadPoolExecutor(1) as pool:
        try:
            return pool.submit(probe.stdout.readline).result(timeout=PROBE_TIMEOUT_S).strip()
        except TimeoutError:
            probe.kill()
            raise ProbeError(f"the probe took over {PROBE_TIMEOUT_S} s") from None


def _cuda_used_mib() -> tuple[int, int]:
    import torch

    free, total = torch.cuda.mem_get_info(0)
    return (total - free) >> 20, total >> 20


def probe(model_dir: Path, handler: dict[str, Any], device: str = "cuda:0") -> None:
    """A worker's engine on GPU 0, warmed up as a worker's is (its CUDA graphs captured), then its
    largest text pass: as many inputs of the longest length as the work bound holds. Says PEAK, and
    holds everything until a line comes back."""
    import torch

    from embedserve.handler.assembly import assemble
    from embedserve.handler.model.inputs import plain_inputs
    from embedserve.handler.settings import Settings

    settings = Settings.from_mapping({**handler, "device": device})
    engine = assemble(model_dir, settings, model_name="sizing", cuda_available=device != "cpu", warm=True)
    encoder = engine.encoder
    length = engine.text.max_length
    rows = max(1, min(encoder.cost.max_batch_size, encoder.cost.max_batch_tokens // length))
    token = 2 if encoder.pad_id == 1 else 1  # any id of the vocabulary but padding
    with torch.inference_mode():
        encoder.embed(plain_inputs([[token] * length] * rows))
    if device != "cpu":
        torch.cuda.synchronize()
    print(PEAK, flush=True)
    sys.stdin.readline()


if __name__ == "__main__":  # MODEL_DIR HANDLER_JSON [DEVICE]: the probe process (cpu: its plumbing, in the tests)
    probe(Path(sys.argv[1]), json.loads(sys.argv[2]), *sys.argv[3:4])
