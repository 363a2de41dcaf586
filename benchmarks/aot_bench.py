"""Transitional: ``tests/test_aot.py`` loads this file by its path
(``helpers.load_benchmark_module("aot_bench")``). The code is in ``benchmarks/estimates.py``
(``python -m benchmarks estimates``); remove this file once that test imports it from there."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks is a package

from benchmarks.estimates import MEMORY_FLOOR, train_step_cost, train_step_memory

__all__ = ["MEMORY_FLOOR", "train_step_cost", "train_step_memory"]
