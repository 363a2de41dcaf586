"""Transitional: ``tests/test_aot.py`` loads this file by its path
(``helpers.load_benchmark_module("implementations")``). The code is in
``benchmarks/peers.py``; remove this file once that test imports it from there."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks is a package

from benchmarks.peers import IMPLEMENTATIONS, forward_backward

__all__ = ["IMPLEMENTATIONS", "forward_backward"]
