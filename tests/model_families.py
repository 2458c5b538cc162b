"""Moved to tests/support/model_families.py. This module stays while bench/ (bench.gpu_families)
imports `tests.model_families` and scripts/gpu_run.sh reads FAMILIES from this file; remove it
once both name tests/support/model_families.py."""

from tests.support.model_families import FAMILIES as _FAMILIES
from tests.support.model_families import corpus, make_family

__all__ = ["FAMILIES", "corpus", "make_family"]

# scripts/gpu_run.sh reads this literal with ast, without importing anything: the same tuple.
FAMILIES = ("bert_dense", "xlmr", "mpnet", "qwen3", "modernbert")
assert FAMILIES == _FAMILIES, "tests/support/model_families.py changed FAMILIES: change it here too"
