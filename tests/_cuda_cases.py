"""Inputs, float64 references and the checks shared by the CUDA NVFP4 kernel tests (`test_cuda_mma.py`,
`test_cuda_tile.py`, `test_cuda_wgmma.py`). A ``matmul`` below is a launcher with the signature of
`cuda_mma.matmul`: ``(x, weights, config, biases=None, out=None)``."""

from __future__ import annotations

import pytest
import torch

from trl_qerl.nvfp4 import nvrtc
from trl_qerl.nvfp4.format import dequantize, quantize, relative_error


DEVICE = "cuda"
TOLERANCE = 1e-2
"""METHOD.md: 16-bit operands with fp32 accumulation, relative error below 1e-2."""


def _nvrtc_loads() -> bool:
    try:
        nvrtc.nvrtc()
    except nvrtc.NVRTCError:
        return False
    return True


needs_nvrtc = pytest.mark.skipif(not _nvrtc_loads(), reason="needs NVRTC (pip install nvidia-cuda-nvrtc)")
"""Offline builds (CPU tests of the kernels' sources) need NVRTC, not a GPU."""


def quantized(n: int, k: int, generator: torch.Generator, device: str | None = None):
    """An NVFP4 weight ``[n, k]`` of random values (never zeros), on ``device`` (default `DEVICE`)."""
    return quantize((torch.randn(n, k, generator=generator) * 0.05).to(device or DEVICE))


def reference(x: torch.Tensor, weights, biases) -> torch.Tensor:
    """``cat([x @ W_i.T + b_i], dim=1)`` in float64."""
    outs = [x.double() @ dequantize(*w, dtype=torch.float64).T for w in weights]
    outs = [o + b.double() if b is not None else o for o, b in zip(outs, biases)]
    return torch.cat(outs, dim=1)


def reference_with_lora(x: torch.Tensor, weights, biases, hidden: torch.Tensor, lora_b, scaling) -> torch.Tensor:
    """`reference` plus each adapter's ``scaling_i * hidden_i @ B_i.T`` in float64: ``hidden`` holds ``x @ A_i.T`` of
    the weights that have an adapter (``lora_b[i]`` not None), side by side in weight order, as
    `cuda_mma.LoraInputs` does."""
    outs, col = [], 0
    for weight, bias, b, s in zip(weights, biases, lora_b, scaling):
        out = reference(x, [weight], [bias])
        if b is not None:
            out = out + s * hidden[:, col : col + b.shape[1]].double() @ b.double().T
            col += b.shape[1]
        outs.append(out)
    return torch.cat(outs, dim=1)


def poisoned_out(m: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """An output buffer full of NaN, so an element a kernel forgets to write shows up."""
    return torch.full((m, n), float("nan"), device=DEVICE, dtype=dtype)


def check_every_instance(matmul, configs, m: int, n: int, k: int, dtype: torch.dtype, supports=None) -> None:
    """Every config against float64 on random inputs seeded by the shape, each into a NaN-poisoned output: every
    element written and finite, within `TOLERANCE`. ``supports(x, weights)``, if given, must accept the inputs."""
    generator = torch.Generator().manual_seed(m * 7 + n + k)
    weights = [quantized(n, k, generator)]
    x = torch.randn(m, k, generator=generator).to(DEVICE, dtype)
    if supports is not None:
        assert supports(x, weights)
    expected = reference(x, weights, [None])
    for config in configs:
        out = matmul(x, weights, config, out=poisoned_out(m, n, dtype))
        assert torch.isfinite(out).all(), f"{config}: unwritten or non-finite outputs"
        assert relative_error(expected, out) < TOLERANCE, str(config)


def check_grouped_launch_into_a_wider_output(matmul, configs, row_counts, dtype: torch.dtype) -> None:
    """q/k/v in one launch (rows not multiples of a tile, one weight without bias), written into columns of a wider
    tensor (row stride > the outputs' width): within `TOLERANCE`, and the columns outside left alone."""
    generator = torch.Generator().manual_seed(3)
    k = 768
    rows = (320, 40, 40)
    weights = [quantized(n, k, generator) for n in rows]
    biases = [torch.randn(n, generator=generator).to(DEVICE, dtype) for n in rows]
    biases[1] = None
    for m in row_counts:
        x = torch.randn(m, k, generator=generator).to(DEVICE, dtype)
        expected = reference(x, weights, biases)
        for config in configs:
            wide = torch.full((m, 512), 7.0, device=DEVICE, dtype=dtype)
            out = matmul(x, weights, config, biases, out=wide[:, :400])
            assert relative_error(expected, out) < TOLERANCE, str(config)
            assert torch.equal(wide[:, 400:], torch.full_like(wide[:, 400:], 7.0)), str(config)


def check_split_k_is_deterministic(matmul, split, whole, m: int) -> None:
    """``split`` (K over CTAs) gives the same bits on every call and, against ``whole`` (one split), differs only by
    the order of its fp32 sums."""
    generator = torch.Generator().manual_seed(8)
    weights = [quantized(256, 4096, generator)]
    x = torch.randn(m, 4096, generator=generator).to(DEVICE, torch.bfloat16)
    first = matmul(x, weights, split)
    assert all(torch.equal(first, matmul(x, weights, split)) for _ in range(3))
    assert relative_error(matmul(x, weights, whole).double(), first) < 4e-3


def check_cuda_graph_replays(matmul, config, m: int) -> None:
    """A launch captured in a CUDA graph reads new inputs written in place into its input buffer."""
    generator = torch.Generator().manual_seed(9)
    weights = [quantized(n, 512, generator) for n in (384, 64, 64)]
    x = torch.randn(m, 512, device=DEVICE, dtype=torch.bfloat16)
    matmul(x, weights, config)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = matmul(x, weights, config)
    for seed in range(3):
        x.copy_(torch.randn(m, 512, generator=torch.Generator().manual_seed(seed)).to(DEVICE))
        graph.replay()
        assert relative_error(reference(x, weights, [None] * 3), out) < TOLERANCE


def check_graph_replays(matmul, x: torch.Tensor, weights, biases, config) -> None:
    """One launch of ``config`` captured in a CUDA graph (after an eager warm-up) and replayed on new activations
    written into ``x``: each replay within `TOLERANCE` of float64 (kernels whose CTAs meet through counters or
    scratch buffers must leave them ready for the next replay)."""
    matmul(x, weights, config, biases)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = matmul(x, weights, config, biases)
    for seed in range(3):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x))
        graph.replay()
        assert relative_error(reference(x, weights, biases), out) < TOLERANCE, f"{config}, replay {seed}"


def checked_wider_launch(matmul, x: torch.Tensor, weights, biases, config, expected, label: str) -> torch.Tensor:
    """One launch of ``config`` into the first columns of a wider, NaN-poisoned output: every element written, finite
    and within `TOLERANCE` of ``expected``, the columns past the launch's left alone. Returns the launch's columns."""
    width = expected.shape[1]
    wide = poisoned_out(x.shape[0], width + 24, x.dtype)
    out = matmul(x, weights, config, biases, out=wide[:, :width])
    assert torch.isfinite(out).all(), f"{label}: unwritten or non-finite outputs"
    assert relative_error(expected, out) < TOLERANCE, label
    assert wide[:, width:].isnan().all(), f"{label} wrote outside its columns"
    return out
