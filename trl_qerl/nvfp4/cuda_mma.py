"""Launcher of the CUDA NVFP4 decode kernel (`csrc/nvfp4_mma.cu`): few activation rows, one launch per projection
or per group of projections that read the same input (q/k/v, gate/up), weights in place.

The kernel is compiled per template instance (`MMAConfig`) by NVRTC (`trl_qerl.nvfp4.nvrtc`) the first time a
device uses it. It needs compute capability 8.0 (``mma.sync`` m16n8k16 in bf16 and fp16), ``K % 32 == 0`` and
16-byte aligned rows (`supports`); `trl_qerl.nvfp4.kernels` chooses it, or the Triton kernels where it does not
apply or fails to build.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from . import nvrtc


SOURCE_PATH = Path(__file__).parent / "csrc" / "nvfp4_mma.cu"
MAX_SEGMENTS = 3
TOKENS_PER_N_TILE = 8
ROWS_PER_M_TILE = 16
_MAX_GRID_Y = 65535  # row tiles are grid.y
_SHARED_MEMORY_LIMIT = 48 * 1024  # static shared memory of one CTA: KW x tokens x rows fp32 partial sums


@functools.cache
def source() -> str:
    return SOURCE_PATH.read_text()


@dataclass(frozen=True)
class MMAConfig:
    """One instance of the kernel: ``m_tiles`` x 16 weight rows per warp, ``n_tiles`` x 8 tokens per CTA,
    ``k_warps`` warps per CTA that split K (and add their sums in shared memory)."""

    m_tiles: int
    n_tiles: int
    k_warps: int

    def __post_init__(self) -> None:
        if self.m_tiles not in (1, 2) or self.n_tiles not in (1, 2, 4, 8) or self.k_warps not in (1, 2, 4, 8):
            raise ValueError(f"unsupported MMAConfig {self}")
        if self.shared_memory_bytes > _SHARED_MEMORY_LIMIT:
            raise ValueError(f"MMAConfig {self} needs {self.shared_memory_bytes} bytes of shared memory")

    @property
    def rows(self) -> int:
        return ROWS_PER_M_TILE * self.m_tiles

    @property
    def tokens(self) -> int:
        return TOKENS_PER_N_TILE * self.n_tiles

    @property
    def shared_memory_bytes(self) -> int:
        return _partial_sums_bytes(self.m_tiles, self.n_tiles, self.k_warps)

    def name_expression(self, dtype: torch.dtype) -> str:
        bf16 = "true" if dtype == torch.bfloat16 else "false"
        return f"nvfp4_mma_kernel<{self.m_tiles}, {self.n_tiles}, {self.k_warps}, {bf16}>"

    def __str__(self) -> str:
        return f"mma {self.rows}r x {self.tokens}t kw{self.k_warps}"


def _partial_sums_bytes(m_tiles: int, n_tiles: int, k_warps: int) -> int:
    """Shared memory of the K-split sums: ``float partial[KW][TOKENS][ROWS]`` in csrc/nvfp4_mma.cu."""
    return 4 * k_warps * ROWS_PER_M_TILE * m_tiles * TOKENS_PER_N_TILE * n_tiles


def valid_config(m_tiles: int, n_tiles: int, k_warps: int) -> bool:
    return _partial_sums_bytes(m_tiles, n_tiles, k_warps) <= _SHARED_MEMORY_LIMIT


class _Segments(ctypes.Structure):
    # mirrors `struct Segments` in csrc/nvfp4_mma.cu
    _fields_ = [
        ("packed", ctypes.c_void_p * MAX_SEGMENTS),
        ("scales", ctypes.c_void_p * MAX_SEGMENTS),
        ("global_scale", ctypes.c_void_p * MAX_SEGMENTS),
        ("bias", ctypes.c_void_p * MAX_SEGMENTS),
        ("rows", ctypes.c_int * MAX_SEGMENTS),
        ("col_start", ctypes.c_int * MAX_SEGMENTS),
        ("tile_start", ctypes.c_int * (MAX_SEGMENTS + 1)),
        ("count", ctypes.c_int),
    ]


Weight = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""(weight_packed uint8 [N, K/2], weight_scale float8_e4m3fn [N, K/16], weight_global_scale float32 [1])"""


def _aligned(tensor: torch.Tensor) -> bool:
    return tensor.data_ptr() % 16 == 0


def supports(x: torch.Tensor, weights: Sequence[Weight]) -> bool:
    """Whether the kernel can compute ``x @ W.T`` for these weights: CUDA sm_80+, bf16/fp16 activations in
    16-byte aligned rows, ``K % 32 == 0``, contiguous 16-byte aligned weights, at most three of them."""
    if x.device.type != "cuda" or x.dtype not in (torch.bfloat16, torch.float16) or x.dim() != 2:
        return False
    if not 1 <= len(weights) <= MAX_SEGMENTS or torch.cuda.get_device_capability(x.device) < (8, 0):
        return False
    k = x.shape[1]
    if k % 32 or x.stride(1) != 1 or x.stride(0) % 8 or not _aligned(x):
        return False
    if sum(packed.shape[0] for packed, _, _ in weights) > _MAX_GRID_Y * ROWS_PER_M_TILE:
        return False
    for packed, scale, _ in weights:
        if packed.shape[1] * 2 != k or not (packed.is_contiguous() and scale.is_contiguous()):
            return False
        if not (_aligned(packed) and scale.data_ptr() % 2 == 0):
            return False
    return True


def kernel(config: MMAConfig, dtype: torch.dtype, device: torch.device, options: tuple[str, ...] = ()):
    """The compiled instance for ``device`` (raises `nvrtc.NVRTCError` if it cannot be built or loaded).
    ``options`` are extra NVRTC flags, e.g. the source's ``-DNVFP4_DEPTH=2`` switches (for benchmarks)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return nvrtc.CudaKernel.get(source(), config.name_expression(dtype), index, tuple(options))


def matmul(
    x: torch.Tensor,
    weights: Sequence[Weight],
    config: MMAConfig,
    biases: Sequence[torch.Tensor | None] | None = None,
    out: torch.Tensor | None = None,
    options: tuple[str, ...] = (),
) -> torch.Tensor:
    """``[x @ W_0.T + b_0, x @ W_1.T + b_1, ...]`` side by side in one ``[M, sum N_i]`` tensor, one launch.

    Callers check `supports` first. ``biases`` (one per weight, or None) are in ``x.dtype``."""
    m, k = x.shape
    biases = list(biases) if biases is not None else [None] * len(weights)
    total = sum(packed.shape[0] for packed, _, _ in weights)
    if out is None:
        out = torch.empty(m, total, device=x.device, dtype=x.dtype)
    segments = _Segments()
    tiles = col = 0
    for i, ((packed, scale, global_scale), bias) in enumerate(zip(weights, biases)):
        rows = packed.shape[0]
        segments.packed[i], segments.scales[i] = packed.data_ptr(), scale.data_ptr()
        segments.global_scale[i] = global_scale.data_ptr()
        segments.bias[i] = bias.data_ptr() if bias is not None else None
        segments.rows[i], segments.col_start[i], segments.tile_start[i] = rows, col, tiles
        tiles += -(-rows // config.rows)
        col += rows
    segments.tile_start[len(weights)] = tiles
    segments.count = len(weights)
    grid = (-(-m // config.tokens), tiles, 1)
    args = [
        ctypes.c_void_p(x.data_ptr()), ctypes.c_int(m), ctypes.c_int(k), ctypes.c_int(x.stride(0)),
        ctypes.c_void_p(out.data_ptr()), ctypes.c_int(out.stride(0)), segments,
    ]  # fmt: skip
    programmatic = programmatic_launch(x.device)
    build = kernel(config, x.dtype, x.device, options + PDL_BUILD if programmatic else options)
    build.launch(grid, (32 * config.k_warps, 1, 1), args, programmatic=programmatic)
    return out


PDL_BUILD = ("-DNVFP4_PDL=1",)
"""NVRTC flags of the build that waits for the previous kernel itself (csrc/nvfp4_mma.cu, "Programmatic Dependent
Launch"); the default build has no PDL instructions."""


def programmatic_launch(device: torch.device) -> bool:
    """Whether launches use Programmatic Dependent Launch (and the `PDL_BUILD`): ``NVFP4_PDL=1`` on sm_90+; off by
    default until it is measured in a decode step."""
    return os.environ.get("NVFP4_PDL", "0") == "1" and torch.cuda.get_device_capability(device) >= (9, 0)


def candidate_configs(m: int, n: int, k: int) -> list[MMAConfig]:
    """Instances worth timing for ``m`` rows (at most 64 per CTA column), ``n`` weight rows, ``k`` columns."""
    tokens = min(max(m, 1), 64)
    n_tiles = [nt for nt in (1, 2, 4, 8) if 8 * nt >= tokens][:1]
    if tokens > 8:
        n_tiles.append(n_tiles[0] // 2)  # half the tokens per CTA, two CTA columns (weights re-read from L2)
    blocks = -(-k // 128)
    configs = []
    for nt in n_tiles:
        for mt in (1, 2):
            for kw in (1, 2, 4, 8):
                if valid_config(mt, nt, kw) and (kw == 1 or blocks >= 2 * kw):
                    configs.append(MMAConfig(mt, nt, kw))
    return configs


def heuristic_config(m: int, n: int, k: int, num_sms: int) -> MMAConfig:
    """Without timing: enough warps to keep ~16 per multiprocessor streaming, each over at least 4 blocks."""
    tokens = min(max(m, 1), 64)
    nt = next(nt for nt in (1, 2, 4, 8) if 8 * nt >= tokens)
    mt = 2 if n >= 8192 and nt <= 2 else 1
    tiles = -(-n // (16 * mt)) * -(-m // (8 * nt))
    blocks = -(-k // 128)
    kw = 1
    while kw < 8 and tiles * kw < 16 * num_sms and blocks >= 8 * kw and valid_config(mt, nt, 2 * kw):
        kw *= 2
    return MMAConfig(mt, nt, kw)
