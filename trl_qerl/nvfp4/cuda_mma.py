"""Launchers of the CUDA NVFP4 kernels (`csrc/nvfp4_mma.cu`), one launch per projection or per group of projections
that read the same input (q/k/v, gate/up), weights read in place:

* the decode kernel (`MMAConfig`, `matmul`): few activation rows, each warp loads its tokens' activations itself;
* the tiled kernel (`TileConfig`, `tile_matmul`): 16 to a few hundred rows, a CTA stages each block of activations
  in shared memory once (cp.async pipeline) and its warps, each with its own weight rows, reuse it.

Each kernel is compiled per template instance by NVRTC (`trl_qerl.nvfp4.nvrtc`) the first time a device uses it.
Both need compute capability 8.0 (``mma.sync`` m16n8k16 in bf16 and fp16), ``K % 32 == 0`` and 16-byte aligned
rows (`supports`; the tiled kernel also ``K % 128 == 0``, `supports_tile`); `trl_qerl.nvfp4.kernels` chooses among
them and the Triton kernels, which serve where they do not apply or fail to build.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import nvrtc, twiddle


logger = logging.getLogger(__name__)

SOURCE_PATHS = (Path(__file__).parent / "csrc" / "nvfp4_mma.cu", Path(__file__).parent / "csrc" / "nvfp4_wgmma.cu")
"""The kernels' source: the mma.sync kernels and their helpers, then the wgmma kernel that uses them."""
MAX_SEGMENTS = 3
TOKENS_PER_N_TILE = 8
ROWS_PER_M_TILE = 16
_MAX_GRID_Y = 65535  # row tiles are grid.y
_SHARED_MEMORY_LIMIT = 48 * 1024  # static shared memory of one CTA: KW x tokens x rows fp32 partial sums


@functools.cache
def source() -> str:
    return "\n".join(path.read_text() for path in SOURCE_PATHS)


@dataclass(frozen=True)
class MMAConfig:
    """One instance of the kernel: ``m_tiles`` x 16 weight rows per warp, ``n_tiles`` x 8 tokens per CTA,
    ``k_warps`` warps per CTA that split K (and add their sums in shared memory); ``k_splits`` > 1: that many CTAs
    per tile split K further (the ``SPLIT_K`` build: the last CTA of a tile adds their sums, one launch);
    ``stream_k``: the launch's (tile x 128-column block) units dealt out evenly to as many CTAs as the GPU holds at
    once (``nvfp4_mma_stream_kernel``: no last partial wave; the last CTA of a split tile adds its parts), up to 16
    tokens per CTA."""

    m_tiles: int
    n_tiles: int
    k_warps: int
    k_splits: int = 1
    stream_k: bool = False

    def __post_init__(self) -> None:
        if self.m_tiles not in (1, 2) or self.n_tiles not in (1, 2, 4, 8) or self.k_warps not in (1, 2, 4, 8):
            raise ValueError(f"unsupported MMAConfig {self}")
        if self.k_splits not in K_SPLITS:
            raise ValueError(f"unsupported MMAConfig {self}: k_splits must be one of {K_SPLITS}")
        if self.stream_k and (self.k_splits > 1 or self.n_tiles > 2):
            raise ValueError(f"unsupported MMAConfig {self}: stream_k takes k_splits 1 and n_tiles 1 or 2 (its "
                             "registers are capped at 128, which more tokens per CTA would spill)")  # fmt: skip
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

    def name_expression(self, dtype: torch.dtype, lora_rank: int = 0) -> str:
        """The instance's name; ``lora_rank`` > 0: the build that adds LoRA terms of that rank in its epilogue
        (`LoraInputs`, one of `LORA_RANKS`)."""
        bf16 = "true" if dtype == torch.bfloat16 else "false"
        if self.stream_k:
            rank = f", {lora_rank}" if lora_rank else ""
            return f"nvfp4_mma_stream_kernel<{self.m_tiles}, {self.n_tiles}, {self.k_warps}, {bf16}{rank}>"
        suffix = f", {lora_rank}" if lora_rank or self.k_splits > 1 else ""
        suffix += ", true" if self.k_splits > 1 else ""
        return f"nvfp4_mma_kernel<{self.m_tiles}, {self.n_tiles}, {self.k_warps}, {bf16}{suffix}>"

    def __str__(self) -> str:
        split = f" split{self.k_splits}" if self.k_splits > 1 else ""
        return f"mma {self.rows}r x {self.tokens}t kw{self.k_warps}{split}{' streamk' if self.stream_k else ''}"


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


LORA_RANKS = (4, 8, 16, 32, 64, 128)
"""LoRA ranks the decode kernel's epilogue takes (a template parameter, so the dot product unrolls)."""


class _LoraTerms(ctypes.Structure):
    # mirrors `struct LoraTerms` in csrc/nvfp4_mma.cu
    _fields_ = [
        ("t", ctypes.c_void_p),
        ("b", ctypes.c_void_p * MAX_SEGMENTS),
        ("scaling", ctypes.c_float * MAX_SEGMENTS),
        ("t_col", ctypes.c_int * MAX_SEGMENTS),
        ("ld_t", ctypes.c_int),
    ]


K_SPLITS = (1, 2, 4)
"""CTAs per tile that `MMAConfig.k_splits` may name."""

SPLIT_K_CANDIDATES = False
"""Whether `candidate_configs` offers ``k_splits`` > 1 to the chooser. Off, by measurement (H200, 2026-12-02,
BENCHMARKS.md "NVFP4 kernels v5"): the split builds pass the GPU tests, but at 7B shapes the best split instance took
1.04-1.50x the best plain one at 1-16 rows (~2 µs more per launch for the partials, the arrival and the second pass,
more than the fuller grid gains); only 32B down at 8-16 rows gained 2-4 %. ``bench_kernels.py --split-k`` times them."""


STREAM_K_CANDIDATES = False
"""Whether `candidate_configs` also offers the stream-K launch of each decode instance (`MMAConfig.stream_k`). Off:
measured on the H200 (2026-12-03, BENCHMARKS.md "The stream-K launch measured, ..."), it is flat at 2.4-2.5 TB/s over
0.5-5 waves, slower than the plain launch below one wave and at whole waves (14B down at 0.5 waves: 15.4 against
12.6 us), and the 14B rollout with every plain launch as stream-K took 7.51 against 6.73 s. ``bench_waves.py
--stream-k`` times it against the plain launch; ``bench_lora_epilogue.py --sweep`` with this set times it among the
engine's instances."""


class _SplitK(ctypes.Structure):
    # mirrors `struct SplitK` in csrc/nvfp4_mma.cu
    _fields_ = [("partial", ctypes.c_void_p), ("counters", ctypes.c_void_p)]


_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def arrival_counters(device: torch.device, count: int, lane: int = 0) -> torch.Tensor:
    """At least ``count`` int32 arrival counters on ``device``, zero between launches: kernels whose last program
    (CTA) to arrive resets its counter share this one buffer per device and ``lane`` (the decode kernel's ``SPLIT_K``
    build, `rollout._fused_shrink_kernel`). Made on first use, outside any graph capture (a capture is preceded by an
    eager warm-up). Launches that use one lane's buffer run one after another on one stream, never concurrently: a
    launch that may overlap others (on a second stream, `rollout.lora_beside`) takes a lane of its own. (CPU:
    Triton's interpreter, in tests.)"""
    device = torch.device("cuda", nvrtc.device_index(device)) if device.type == "cuda" else device
    counters = _COUNTERS.get((device, lane))
    if counters is None or counters.numel() < count:
        counters = torch.zeros(max(count, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[(device, lane)] = counters
    return counters


def _split_k(config: MMAConfig, tiles: int, m: int, device: torch.device) -> _SplitK:
    """The ``SPLIT_K`` build's buffers: partial sums (new per launch; a captured graph keeps its own) and the tiles'
    arrival counters (`arrival_counters`)."""
    if config.k_splits == 1:
        return _SplitK()
    tile_count = tiles * -(-m // config.tokens)
    return _partials_and_counters(tile_count * config.k_splits * config.rows * config.tokens, tile_count, device)


def _partials_and_counters(floats: int, tile_count: int, device: torch.device) -> _SplitK:
    """A new fp32 buffer of ``floats`` partial sums (a captured graph keeps its own) and ``tile_count`` arrival
    counters (`arrival_counters`), as the kernel's `SplitK` argument."""
    split = _SplitK()
    partial = torch.empty(floats, device=device)
    split.partial, split.counters = partial.data_ptr(), arrival_counters(device, tile_count).data_ptr()
    split._keep = partial  # alive until the launch is queued (the caching allocator orders reuse on the stream)
    return split


def _stream_k(config: MMAConfig, ctas: int, tile_count: int, device: torch.device) -> _SplitK:
    """The stream-K launch's buffers: two parts' sums per CTA (new per launch; a captured graph keeps its own) and the
    tiles' arrival counters (`arrival_counters`)."""
    return _partials_and_counters(ctas * 2 * config.rows * config.tokens, tile_count, device)


def resident_ctas(build: nvrtc.CudaKernel, config: MMAConfig, device: torch.device, shared_memory: int = 0) -> int:
    """CTAs of ``build`` the GPU holds at once (with ``shared_memory`` bytes of dynamic shared memory each): the
    occupancy calculator's count per multiprocessor times the multiprocessors."""
    per_multiprocessor = build.resident_blocks(32 * config.k_warps, shared_memory)
    return per_multiprocessor * torch.cuda.get_device_properties(device).multi_processor_count


def stream_ctas(
    build: nvrtc.CudaKernel, config: MMAConfig, device: torch.device, units: int, shared_memory: int = 0
) -> int:
    """CTAs of a stream-K launch: as many as the GPU holds at once (`resident_ctas`), at most one per unit."""
    return max(1, min(units, resident_ctas(build, config, device, shared_memory)))


ASYNC_STAGES_FLAG = "-DNVFP4_ASYNC_STAGES="
"""The NVRTC flag of the decode kernel's cp.async ring (csrc/nvfp4_mma.cu, `AsyncRing`): codes and scales come
through a per-warp ring of this many 128-column blocks in dynamic shared memory instead of a register prefetch of one
block. A build for benchmarks (``bench_lora_epilogue.py --variants NVFP4_ASYNC_STAGES=4``), never chosen: measured
on the H200 (2026-12-04, BENCHMARKS.md "The cp.async ring measured"), rings of 2-4 blocks were slower than the
register path at 86 of 90 launch sizes (7B gate/up's and 14B down's instances, 0.5-5 waves), and rings of 3 and 4 in
all 24 of the 7B and 14B decode products timed with the LoRA epilogue (gate/up up to 1.64x the time)."""

RING_BYTES_PER_ROW = 72
"""Bytes one weight row takes in one block of the ring: 64 of codes and 8 of block scales."""


def async_stages(flags: Sequence[str]) -> int:
    """The ring's blocks in a build's NVRTC ``flags`` (the last `ASYNC_STAGES_FLAG`), 0 without one."""
    stages = [flag.removeprefix(ASYNC_STAGES_FLAG) for flag in flags if flag.startswith(ASYNC_STAGES_FLAG)]
    return int(stages[-1]) if stages else 0


def decode_ring_bytes(config: MMAConfig, stages: int) -> int:
    """Dynamic shared memory of a decode launch whose build has a ring of ``stages`` blocks: each of the CTA's
    ``k_warps`` warps holds ``stages`` blocks of its ``16 * m_tiles`` rows. 0 below 2 stages (the register path)."""
    return config.k_warps * stages * config.rows * RING_BYTES_PER_ROW if stages >= 2 else 0


def _ring_bytes(flags: Sequence[str], config: MMAConfig, weights: Sequence[Weight], k: int) -> int:
    """`decode_ring_bytes` of a launch built with ``flags``, after checking what the ring's 8-byte scale copies
    need."""
    ring = decode_ring_bytes(config, async_stages(flags))
    if ring and (k % 128 or any(scale.data_ptr() % 8 for _, scale, _ in weights)):
        raise ValueError(
            f"The {ASYNC_STAGES_FLAG}N build of the NVFP4 decode kernel needs K % 128 == 0 and 8-byte aligned block "
            f"scales (K = {k}); launch this product with the default build."
        )
    return ring


@dataclass(frozen=True)
class LoraInputs:
    """LoRA terms the decode kernel adds in its epilogue, one optional term per weight of the launch.

    Attributes:
        hidden: ``x @ A_i.T`` of every weight that has an adapter, side by side in weight order: fp32 ``[M, sum r_i]``.
        lora_b: per weight, its fp32 ``B [N_i, r_i]`` (as stored), or None for a weight without an adapter.
        scaling: per weight, the adapter's scaling (ignored where ``lora_b`` is None).
    """

    hidden: torch.Tensor
    lora_b: Sequence[torch.Tensor | None]
    scaling: Sequence[float]

    @property
    def rank(self) -> int:
        """The adapters' rank (0 if they differ, or if no weight has one)."""
        ranks = {b.shape[1] for b in self.lora_b if b is not None}
        return ranks.pop() if len(ranks) == 1 else 0

    def columns(self) -> list[int]:
        """First column of each weight's block of ``hidden`` (weights without an adapter take none)."""
        starts, col = [], 0
        for b in self.lora_b:
            starts.append(col)
            col += b.shape[1] if b is not None else 0
        return starts


def lora_supported(x: torch.Tensor, weights: Sequence[Weight], lora: LoraInputs) -> bool:
    """Whether the decode kernel's epilogue can add these LoRA terms: fp32 ``hidden`` with 16-byte aligned rows and
    fp32 row-major ``B`` matrices matching the weights' rows, 16-byte aligned, all of one rank in `LORA_RANKS`."""
    hidden = lora.hidden
    if len(lora.lora_b) != len(weights) or len(lora.scaling) != len(weights) or lora.rank not in LORA_RANKS:
        return False
    if hidden.dtype != torch.float32 or hidden.dim() != 2 or hidden.shape[0] != x.shape[0] or hidden.stride(1) != 1:
        return False
    if hidden.stride(0) % 4 or not _aligned(hidden) or hidden.device != x.device:
        return False
    if hidden.shape[1] != sum(b.shape[1] for b in lora.lora_b if b is not None):
        return False
    for (packed, _, _), b in zip(weights, lora.lora_b):
        if b is None:
            continue
        if b.dtype != torch.float32 or b.dim() != 2 or b.shape[0] != packed.shape[0]:
            return False
        if not (b.is_contiguous() and _aligned(b)) or b.device != x.device:
            return False
    return True


def lora_fits(config: MMAConfig) -> bool:
    """Whether ``config``'s LoRA build fits the static shared memory: its K-split sums plus the CTA's
    ``float terms[tokens][rows]``."""
    return config.shared_memory_bytes + 4 * config.rows * config.tokens <= _SHARED_MEMORY_LIMIT


def _lora_terms(lora: LoraInputs | None) -> _LoraTerms:
    terms = _LoraTerms()
    if lora is None:
        return terms
    terms.t, terms.ld_t = lora.hidden.data_ptr(), lora.hidden.stride(0)
    for i, (b, scaling, col) in enumerate(zip(lora.lora_b, lora.scaling, lora.columns())):
        terms.b[i] = b.data_ptr() if b is not None else None
        terms.scaling[i], terms.t_col[i] = float(scaling), col
    return terms


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


def kernel(config, dtype: torch.dtype, device: torch.device, options: tuple[str, ...] = ()):
    """The compiled instance for ``device`` (raises `nvrtc.NVRTCError` if it cannot be built or loaded): a config's
    kernel (anything with ``name_expression(dtype)``; an ``arch_specific`` attribute asks for the ``sm_XYa``
    target), or a name expression of the source. ``options`` are extra NVRTC flags, e.g. the source's
    ``-DNVFP4_DEPTH=2`` switches (for benchmarks)."""
    index = nvrtc.device_index(device)
    name = config if isinstance(config, str) else config.name_expression(dtype)
    arch_specific = getattr(config, "arch_specific", False)
    return nvrtc.CudaKernel.get(source(), name, index, tuple(options), arch_specific=arch_specific)


def segments_of(weights: Sequence[Weight], biases: Sequence[torch.Tensor | None], rows_per_tile: int):
    """(`_Segments` of the weights, number of row tiles of ``rows_per_tile``, total rows)."""
    segments = _Segments()
    tiles = col = 0
    for i, ((packed, scale, global_scale), bias) in enumerate(zip(weights, biases)):
        rows = packed.shape[0]
        segments.packed[i], segments.scales[i] = packed.data_ptr(), scale.data_ptr()
        segments.global_scale[i] = global_scale.data_ptr()
        segments.bias[i] = bias.data_ptr() if bias is not None else None
        segments.rows[i], segments.col_start[i], segments.tile_start[i] = rows, col, tiles
        tiles += -(-rows // rows_per_tile)
        col += rows
    segments.tile_start[len(weights)] = tiles
    segments.count = len(weights)
    return segments, tiles, col


def matmul(
    x: torch.Tensor,
    weights: Sequence[Weight],
    config: MMAConfig,
    biases: Sequence[torch.Tensor | None] | None = None,
    out: torch.Tensor | None = None,
    options: tuple[str, ...] = (),
    lora: LoraInputs | None = None,
) -> torch.Tensor:
    """``[x @ W_0.T + b_0, x @ W_1.T + b_1, ...]`` side by side in one ``[M, sum N_i]`` tensor, one launch; with
    ``lora``, each output plus its adapter's ``scaling * hidden_i @ B_i.T`` (the base rounded first, then the sum).

    Callers check `supports` (and `lora_supported`) first. ``biases`` (one per weight, or None) are in ``x.dtype``.
    Inside `twiddle.twiddled_codes` the build reads the window's order (`twiddle.window_build`)."""
    m, k = x.shape
    config = launch_config(config)
    biases = list(biases) if biases is not None else [None] * len(weights)
    segments, tiles, total = segments_of(weights, biases, config.rows)
    if out is None:
        out = torch.empty(m, total, device=x.device, dtype=x.dtype)
    programmatic = programmatic_launch(x.device, m)
    name = config.name_expression(x.dtype, lora_rank=lora.rank if lora is not None else 0)
    flags = options + twiddle.window_build()  # (captured graphs keep their build)
    build = kernel(name, x.dtype, x.device, flags + PDL_BUILD if programmatic else flags)
    ring = _ring_bytes(flags, config, weights, k)
    groups = -(-m // config.tokens)
    if config.stream_k:
        ctas = stream_ctas(build, config, x.device, tiles * groups * -(-k // 128), ring)
        grid, split = (ctas, 1, 1), _stream_k(config, ctas, tiles * groups, x.device)
    else:
        grid, split = (groups, tiles, config.k_splits), _split_k(config, tiles, m, x.device)
    args = [
        ctypes.c_void_p(x.data_ptr()), ctypes.c_int(m), ctypes.c_int(k), ctypes.c_int(x.stride(0)),
        ctypes.c_void_p(out.data_ptr()), ctypes.c_int(out.stride(0)), segments, _lora_terms(lora), split,
    ]  # fmt: skip
    build.launch(grid, (32 * config.k_warps, 1, 1), args, programmatic=programmatic, shared_memory=ring)
    return out


def launch_config(config: MMAConfig) -> MMAConfig:
    """The instance a launch runs: ``config``, or with ``NVFP4_STREAM_K=1`` the stream-K launch of a plain instance
    of up to 16 tokens per CTA (`MMAConfig.stream_k`), so that whole steps can be timed with the same kernel choices
    launched both ways. Read at each launch (captured graphs keep what they captured); off by default (measured
    slower, `STREAM_K_CANDIDATES`)."""
    if os.environ.get("NVFP4_STREAM_K", "0") != "1" or config.stream_k or config.k_splits > 1 or config.n_tiles > 2:
        return config
    return dataclasses.replace(config, stream_k=True)


PDL_BUILD = ("-DNVFP4_PDL=1",)
"""NVRTC flags of the build that waits for the previous kernel itself (csrc/nvfp4_mma.cu, "Programmatic Dependent
Launch"; its activations come through coherent loads, which ptxas keeps after the wait); the default build has no
PDL instructions."""


PROGRAMMATIC: bool | None = None
"""Programmatic Dependent Launch of the decode step's own kernels: the NVFP4 decode products here and the rollout's
Triton kernels (`trl_qerl.rollout._pdl_kernel`), each free to start while the kernel before it finishes. ``True`` /
``False``: at every row count / never; ``None``: the ``NVFP4_PDL`` environment variable (``1`` / ``0``) or, unset,
launches of up to `PDL_MAX_ROWS` rows. Read at each launch: a captured CUDA graph keeps the launches it recorded."""

PDL_MAX_ROWS = 8
"""Most rows of a launch that takes PDL by default (`PROGRAMMATIC` None). Measured on an H100 (7B, NVFP4 + LoRA r32 +
AQN, 2026-12-07, `scripts/bench_rollout.py --prefill`, A-B-C-A-B-C in one process), the decode step alone without ->
with PDL: 3.11 / 2.99 -> 2.79 / 2.91 ms at batch 1 (with the rotary in the attention launch 2.90 / 2.77), 3.43 / 3.44
-> 3.37 / 3.46 at 8 (3.35 / 3.36), 5.59 / 5.58 -> 5.88 / 5.67 at 32 (5.72 / 5.71), 6.34 / 6.31 -> 6.32 / 6.30 at 64.
The gain is in the gaps between kernels (the kernels' own time per step did not move: 2.85-2.88 ms at batch 1)."""


PDL_MIN_DRIVER = 12030
"""CUDA driver version from which stream capture records PDL launches as programmatic graph edges (CUDA 12.3)."""


def programmatic_launch(device: torch.device, rows: int = 1) -> bool:
    """Whether a launch of ``rows`` rows on ``device`` uses Programmatic Dependent Launch (and the `PDL_BUILD`): as
    `PROGRAMMATIC` says, on an sm_90+ GPU with a CUDA driver of at least 12.3 only."""
    asked = PROGRAMMATIC if PROGRAMMATIC is not None else {"1": True, "0": False}.get(os.environ.get("NVFP4_PDL", ""))
    if asked is None:
        asked = rows <= PDL_MAX_ROWS
    return (
        asked and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0) and driver_takes_pdl()
    )


@functools.cache
def driver_takes_pdl() -> bool:
    """Whether the CUDA driver is at least `PDL_MIN_DRIVER`; if not, one log line, and launches go without PDL."""
    version = nvrtc.driver_version()
    if version < PDL_MIN_DRIVER:
        logger.info("the decode step's kernels launch without Programmatic Dependent Launch: CUDA driver %d.%d is "
                    "older than %d.%d", version // 1000, version % 1000 // 10, PDL_MIN_DRIVER // 1000,
                    PDL_MIN_DRIVER % 1000 // 10)  # fmt: skip
        return False
    return True


def candidate_configs(m: int, n: int, k: int, num_sms: int = 132) -> list[MMAConfig]:
    """Instances worth timing for ``m`` rows (at most 64 per CTA column), ``n`` weight rows, ``k`` columns (with
    `SPLIT_K_CANDIDATES`, also K split over 2 or 4 CTAs where the row tiles alone would not fill two waves of
    ``num_sms`` multiprocessors; with `STREAM_K_CANDIDATES`, also the stream-K launch of each instance of up to 16
    tokens per CTA)."""
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
    if SPLIT_K_CANDIDATES:
        configs += _split_candidates(configs, m, n, k, num_sms)
    if STREAM_K_CANDIDATES:
        configs += [MMAConfig(c.m_tiles, c.n_tiles, c.k_warps, stream_k=True) for c in configs
                    if c.k_splits == 1 and c.n_tiles <= 2]  # fmt: skip
    return configs


def _split_candidates(configs: list[MMAConfig], m: int, n: int, k: int, num_sms: int) -> list[MMAConfig]:
    blocks = -(-k // 128)
    split = []
    for config in configs:
        tiles = -(-n // config.rows) * -(-m // config.tokens)
        for k_splits in K_SPLITS[1:]:
            if tiles < 2 * num_sms and blocks >= 2 * config.k_warps * k_splits:
                split.append(MMAConfig(config.m_tiles, config.n_tiles, config.k_warps, k_splits))
    return split


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


# -- the tiled kernel -----------------------------------------------------------------------------------------
_REDUCE_THREADS = 256


@dataclass(frozen=True)
class TileConfig:
    """One instance of the tiled kernel: ``warps`` warps per CTA, each owning ``m_tiles`` x 16 weight rows,
    ``n_tiles`` x 8 tokens per CTA staged in shared memory, ``stages`` 128-column blocks in flight, and K split
    over ``split_k`` CTAs (their fp32 partial sums added by a second launch)."""

    m_tiles: int
    n_tiles: int
    warps: int
    stages: int
    split_k: int = 1

    def __post_init__(self) -> None:
        if (
            self.m_tiles not in (1, 2, 4)
            or self.n_tiles not in (1, 2, 4, 8)
            or self.warps not in (1, 2, 4, 8, 16)
            or self.stages not in (2, 3, 4, 5, 6)
            or self.split_k < 1
        ):
            raise ValueError(f"unsupported TileConfig {self}")

    @property
    def rows(self) -> int:
        return ROWS_PER_M_TILE * self.m_tiles * self.warps

    @property
    def tokens(self) -> int:
        return TOKENS_PER_N_TILE * self.n_tiles

    @property
    def stage_bytes(self) -> int:
        """``TileLayout::STAGE`` in csrc/nvfp4_mma.cu: codes (64 B), scales (8 B) per row, 256 B per token."""
        return self.rows * 72 + self.tokens * 256

    @property
    def shared_memory_bytes(self) -> int:
        """Dynamic shared memory of one CTA: the stages, or the epilogue's output tile if that is larger."""
        epilogue = self.tokens * (self.rows + 8) * 2 if self.split_k == 1 else self.tokens * (self.rows + 4) * 4
        return max(self.stages * self.stage_bytes, epilogue)

    def name_expression(self, dtype: torch.dtype) -> str:
        bf16 = "true" if dtype == torch.bfloat16 else "false"
        return f"nvfp4_tile_kernel<{self.m_tiles}, {self.n_tiles}, {self.warps}, {self.stages}, {bf16}>"

    def __str__(self) -> str:
        split = f" split{self.split_k}" if self.split_k > 1 else ""
        return f"tile {self.rows}r x {self.tokens}t w{self.warps} s{self.stages}{split}"


def supports_tile(x: torch.Tensor, weights: Sequence[Weight]) -> bool:
    """`supports` and what the tiled kernel's 128-column cp.async blocks need: ``K % 128 == 0`` and scale rows
    aligned to 8 bytes."""
    return supports(x, weights) and x.shape[1] % 128 == 0 and all(scale.data_ptr() % 8 == 0 for _, scale, _ in weights)


def tile_matmul(
    x: torch.Tensor,
    weights: Sequence[Weight],
    config: TileConfig,
    biases: Sequence[torch.Tensor | None] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`matmul` with the tiled kernel (plus, when ``config.split_k > 1``, one launch that adds the partial sums).
    Inside `twiddle.twiddled_codes` the build reads the window's order (it decodes with `matmul`'s code).

    Callers check `supports_tile` first."""
    return launch_tiled(x, weights, config, 32 * config.warps, biases, out, options=twiddle.window_build())


def launch_tiled(
    x: torch.Tensor,
    weights: Sequence[Weight],
    config,
    threads: int,
    biases: Sequence[torch.Tensor | None] | None = None,
    out: torch.Tensor | None = None,
    extra_args: tuple = (),
    options: tuple[str, ...] = (),
) -> torch.Tensor:
    """The launch of a tiled kernel (`TileConfig`, `cuda_wgmma.WgmmaConfig`: anything with ``rows``, ``tokens``,
    ``split_k``, ``shared_memory_bytes`` and a name expression) with ``threads`` per CTA: kernel arguments
    ``(x, M, K, ldx, out, ldo, partial, segments, *extra_args)``, a CTA per (token tile, row tile, K split), and,
    when K is split, the launch that adds the fp32 partial sums in split order."""
    m, k = x.shape
    biases = list(biases) if biases is not None else [None] * len(weights)
    segments, tiles, total = segments_of(weights, biases, config.rows)
    if out is None:
        out = torch.empty(m, total, device=x.device, dtype=x.dtype)
    split = min(config.split_k, k // 128)
    partial = torch.empty(split, m, out.stride(0), device=x.device, dtype=torch.float32) if split > 1 else None
    args = [
        ctypes.c_void_p(x.data_ptr()), ctypes.c_int(m), ctypes.c_int(k), ctypes.c_int(x.stride(0)),
        ctypes.c_void_p(out.data_ptr()), ctypes.c_int(out.stride(0)),
        ctypes.c_void_p(partial.data_ptr() if partial is not None else None), segments, *extra_args,
    ]  # fmt: skip
    build = kernel(config, x.dtype, x.device, options)
    grid = (-(-m // config.tokens), tiles, split)
    build.launch(grid, (threads, 1, 1), args, shared_memory=config.shared_memory_bytes)
    if partial is not None:
        reduce = kernel(reduce_name(x.dtype), x.dtype, x.device)
        reduce_args = [
            ctypes.c_void_p(partial.data_ptr()), ctypes.c_int(split), ctypes.c_int(m), ctypes.c_int(total),
            ctypes.c_int(out.stride(0)), ctypes.c_void_p(out.data_ptr()),
        ]  # fmt: skip
        reduce.launch((-(-m * total // _REDUCE_THREADS), 1, 1), (_REDUCE_THREADS, 1, 1), reduce_args)
    return out


def reduce_name(dtype: torch.dtype) -> str:
    """Name expression of the split-K reduction kernel for ``dtype`` outputs."""
    return f"nvfp4_split_reduce_kernel<{'true' if dtype == torch.bfloat16 else 'false'}>"


def tile_candidate_configs(m: int, n: int, k: int, num_sms: int = 132,
                           shared_memory_limit: int = 227 * 1024) -> list[TileConfig]:  # fmt: skip
    """Instances worth timing for ``m`` rows (a CTA column takes at most 64 tokens), ``n`` weight rows and ``k``
    columns: 64 or 128 weight rows per CTA, two or four m tiles per warp, accumulators in registers (at most 16 m x
    n tiles per warp: 64 fp32 registers), the deepest pipeline that fits twice in a multiprocessor's shared memory,
    and a K split where the row and token tiles alone would not fill the GPU. Measured on the H200 (7B shapes,
    2026-12-02) and left out, never the fastest candidate: one m tile per warp (each activation fragment then feeds
    a single MMA pair; a median 1.13x its two-tile twin) and 256-row CTAs (one CTA per multiprocessor; 1.2-2.5x the
    best candidate)."""
    tokens = min(max(m, 1), 64)
    nt = next(nt for nt in (1, 2, 4, 8) if 8 * nt >= tokens)
    blocks = k // 128
    configs = []
    for mt, warps in ((2, 2), (2, 4), (4, 2)):
        if mt * nt > 16:
            continue
        fitting = [
            s for s in (6, 4, 3, 2) if 2 * TileConfig(mt, nt, warps, s).shared_memory_bytes <= shared_memory_limit
        ]
        if not fitting:
            continue
        probe = TileConfig(mt, nt, warps, fitting[0])
        ctas = -(-n // probe.rows) * -(-m // probe.tokens)
        split = 1
        while ctas * split < num_sms and blocks >= 16 * split:
            split *= 2
        configs += [probe] + ([TileConfig(mt, nt, warps, fitting[0], split)] if split > 1 else [])
        if TILE_SPREAD_CANDIDATES and m <= TILE_SPREAD_MAX_ROWS:
            configs += _tile_spread_configs(probe, ctas, split, blocks, num_sms, shared_memory_limit)
    return configs


TILE_SPREAD_CANDIDATES = False
"""Whether `tile_candidate_configs` also offers, per CTA shape and for up to `TILE_SPREAD_MAX_ROWS` rows, more and
shorter CTAs: the deepest pipeline that fits `TILE_SPREAD_RESIDENT` times in a multiprocessor, and K splits down to
`TILE_SPREAD_MIN_BLOCKS` 128-column blocks per CTA for grids of at most `TILE_SPREAD_RESIDENT` CTAs per
multiprocessor (the other candidates fit twice and stop at 8 blocks and one CTA per multiprocessor). Why: the
wgmma kernel's candidates of that form are faster per call at 64 rows (H100, 2026-12-06), and at
16-32 rows the tiled kernel's CTAs have 2-8 warps, e.g. 7B q/k/v at 32 rows 144 CTAs of 2 warps. Off: not yet
measured (H100, 2026-12-06: the one step comparison, 6.31 against 5.72 ms at 32 rows, ran this engine with the named
engines' older settings and its baseline with the defaults, so it does not count; ``bench_rollout.py --engines
default+own_choices default+tile_spread`` compares them like for like)."""

TILE_SPREAD_MAX_ROWS = 32
"""Most rows for which `TILE_SPREAD_CANDIDATES` adds instances (from 64 rows the wgmma kernel is the product)."""

TILE_SPREAD_MIN_BLOCKS = 4
"""Fewest 128-column blocks per CTA of `TILE_SPREAD_CANDIDATES`' splits."""

TILE_SPREAD_RESIDENT = 4
"""CTAs per multiprocessor that `TILE_SPREAD_CANDIDATES`' pipelines fit, and the most its splits' grids ask for."""


def _tile_spread_configs(probe: TileConfig, ctas: int, split: int, blocks: int, num_sms: int,
                         shared_memory_limit: int) -> list[TileConfig]:  # fmt: skip
    """`TILE_SPREAD_CANDIDATES`' extra instances of one CTA shape (``probe``, K split ``split`` among the others)."""
    shape = (probe.m_tiles, probe.n_tiles, probe.warps)
    resident = [s for s in (4, 3, 2) if TILE_SPREAD_RESIDENT * TileConfig(*shape, s).shared_memory_bytes
                <= shared_memory_limit]  # fmt: skip
    return spread_configs(lambda stages, k_split: TileConfig(*shape, stages, k_split), probe.stages, resident[:1],
                          split, blocks, TILE_SPREAD_MIN_BLOCKS, TILE_SPREAD_RESIDENT * num_sms // ctas)  # fmt: skip


def spread_configs(make: Callable[[int, int], Any], stages: int, resident: list[int], split: int, blocks: int,
                   min_blocks: int, max_split: int) -> list:  # fmt: skip
    """More and shorter CTAs of one CTA shape (``make(stages, split)``, offered with ``stages`` and K split
    ``split``): that split with the shallower pipeline ``resident`` (zero or one depth, one that fits more CTAs per
    multiprocessor), then each doubled split with both depths while a CTA keeps ``min_blocks`` 128-column blocks and
    the split stays within ``max_split``."""
    depths = [stages] + [d for d in resident if d != stages]
    extra = [make(d, split) for d in depths[1:]]
    split *= 2
    while blocks >= min_blocks * split and split <= max_split:
        extra += [make(d, split) for d in depths]
        split *= 2
    return extra
