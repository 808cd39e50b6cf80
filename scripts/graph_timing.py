"""Per-call timing for the benchmarks: CUDA-graph replays (no launch overhead from Python), median."""

from __future__ import annotations

import triton
from bench_settings import module_settings

from trl_qerl.nvfp4 import cuda_mma


def time_us(call, programmatic: bool = False) -> float:
    """Median µs of ``call`` replayed in a CUDA graph, after one eager call (compilation, kernel choices). Launched
    without Programmatic Dependent Launch unless ``programmatic`` (`cuda_mma.PROGRAMMATIC`): one call's repeats are not
    a decode step's neighbours, and so the numbers compare with those measured before PDL was the default
    (2026-12-07)."""
    with module_settings(cuda_mma, {"PROGRAMMATIC": programmatic}):
        call()
        return triton.testing.do_bench_cudagraph(call, rep=20, return_mode="median") * 1e3
