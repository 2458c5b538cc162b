"""What this machine's CPU is and which matrix units it has, read from /proc/cpuinfo.

bfloat16 runs fast on a CPU only with units that compute it: AMX (`amx_bf16`) or AVX-512's
bf16 dot products (`avx512_bf16`). Without them (an AVX2-only CPU) torch and OpenVINO emulate
it, slower than float32, so no bfloat16 engine is even tried there
(embedserve/handler/execution/engine_trial.py).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
# Strongest first: the first present names the class of the machine.
BF16_UNITS = ("amx_bf16", "avx512_bf16")
# The flags a benchmark records beside its figures.
REPORTED_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


@lru_cache(maxsize=None)
def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The flags of the first processor listed; empty where /proc/cpuinfo is unreadable."""
    return frozenset(_field(cpuinfo, "flags").split())


@lru_cache(maxsize=None)
def cpu_model_name(cpuinfo: Path = CPUINFO) -> str:
    return _field(cpuinfo, "model name") or "unknown"


def bf16_units(flags: frozenset[str] | None = None) -> str | None:
    """The CPU's bfloat16 matrix units (the strongest flag), or None where it has none."""
    flags = cpu_flags() if flags is None else flags
    return next((unit for unit in BF16_UNITS if unit in flags), None)


def describe_cpu() -> dict[str, object]:
    """The CPU, as benchmarks and /info record it."""
    flags = cpu_flags()
    return {"model_name": cpu_model_name(), "bf16_units": bf16_units(flags),
            "flags": [flag for flag in REPORTED_FLAGS if flag in flags]}


def _field(cpuinfo: Path, name: str) -> str:
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as lines:
            for line in lines:
                key, sep, value = line.partition(":")
                if sep and key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return ""
