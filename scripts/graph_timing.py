"""Per-call timing for the benchmarks: CUDA-graph replays (no launch overhead from Python), median."""

from __future__ import annotations

import triton


def time_us(call) -> float:
    """Median µs of ``call`` replayed in a CUDA graph, after one eager call (compilation, kernel choices)."""
    call()
    return triton.testing.do_bench_cudagraph(call, rep=20, return_mode="median") * 1e3
