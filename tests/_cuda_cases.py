"""Inputs and float64 references shared by the CUDA NVFP4 kernel tests (`test_cuda_mma.py`, `test_cuda_tile.py`)."""

from __future__ import annotations

import torch

from trl_qerl.nvfp4.format import dequantize, quantize


def quantized(n: int, k: int, generator: torch.Generator, device: str = "cuda"):
    """An NVFP4 weight ``[n, k]`` of random values (never zeros), on ``device``."""
    return quantize((torch.randn(n, k, generator=generator) * 0.05).to(device))


def reference(x: torch.Tensor, weights, biases) -> torch.Tensor:
    """``cat([x @ W_i.T + b_i], dim=1)`` in float64."""
    outs = [x.double() @ dequantize(*w, dtype=torch.float64).T for w in weights]
    outs = [o + b.double() if b is not None else o for o, b in zip(outs, biases)]
    return torch.cat(outs, dim=1)


def poisoned_out(m: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """An output buffer full of NaN, so an element a kernel forgets to write shows up."""
    return torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
