"""Launcher of the Hopper wgmma NVFP4 kernel (`nvfp4_wgmma_kernel` in `csrc/nvfp4_wgmma.cu`): 64 to a few hundred
activation rows, where the mma.sync kernels of `cuda_mma` spend their time loading activation fragments.

A CTA of one or two warpgroups owns 64 x ``m64_tiles`` weight rows per warpgroup and ``tokens`` activation rows;
the tensor cores read the activations from shared memory (wgmma's B operand) and the weights from registers,
decoded from the staged NVFP4 codes. It needs compute capability 9.0 exactly (the ``sm_90a`` target: wgmma is not
in sm_100+'s portable instruction set) and what the tiled kernel needs (`cuda_mma.supports_tile`); its weights,
biases, grouped launches (q/k/v, gate/up) and split-K reduction are the tiled kernel's.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import nvrtc, twiddle
from .cuda_mma import MAX_SEGMENTS, Weight, launch_tiled, spread_configs, supports_tile


ROWS_PER_WARPGROUP_TILE = 64
MAX_ACCUMULATORS = 128
"""fp32 accumulators per thread (``m64_tiles * tokens / 2``): more spill registers."""
MAX_STAGES = 8
"""Deepest shared-memory ring: 128-row x 64-token stages (25 KB) fit eight times in a Hopper CTA's 227 KB."""

DEEP_CANDIDATES = False
"""Whether `wgmma_candidate_configs` also offers, per CTA shape, the deepest ring that fits once in a multiprocessor
(more bytes in flight for a CTA alone on its multiprocessor) and K splits of 2 and 4 for grids past one wave whose
last wave is mostly empty. Off, by measurement (H100, 7B shapes at 64-256 rows, 2026-12-06, BENCHMARKS.md "The wgmma
kernel with three groups in flight"): never the fastest instance; 8-stage rings and the splits of 7B gate/up at 64
rows took 81-87 µs against 70 for the shipped candidates. ``bench_kernels.py --wgmma-deep`` times them."""


SPREAD_CANDIDATES = True
"""Whether `wgmma_candidate_configs` also offers, per CTA shape and for up to `SPREAD_MAX_ROWS` rows, more and shorter
CTAs: the deepest ring that fits three times in a multiprocessor, and K splits down to `SPREAD_MIN_BLOCKS` 128-column
blocks per CTA (the other candidates stop at 8) for grids of at most `SPREAD_MAX_WAVES` CTAs per multiprocessor.
Why: at 64 rows each warp's decode chain limits the 64-token CTAs (Nsight Compute, H100, 2026-12-06), and 7B q/k/v
ran 72 CTAs of 8 warps on 132 multiprocessors; more CTAs put more warps on each scheduler.

Measured on an H100 (2026-12-06, BENCHMARKS.md "More and shorter wgmma CTAs at 64 rows"): best instance with against
without, same run (``bench_kernels.py --sweep --wgmma-spread``), 7B q/k/v at 64 rows 17.3 against 20.2 µs (`64r x
64t wg1 s3 split4`), gate/up 65.1 against 70.7 (`64r x 64t wg1 s3`), 14B o 21.4 against 24.5; never the best for 7B
down or 14B q/k/v. The 7B decode step at 64 rows, both engines with their own choices in one process: 7.51 against
7.67 ms (with the older engine settings of `bench_rollout.py`'s named engines; not yet with the generator's
defaults). The chooser times them with the others, so a key takes one only where it is faster; False restores the
candidates before. Shipped tables keep the choices timed before (the H200's 64-row keys)."""

SPREAD_MAX_ROWS = 128
"""Most rows for which `SPREAD_CANDIDATES` adds instances. At 128 rows some won alone (7B o: 17.6 against 20.5 µs), and
the 7B decode step at 128 rows on an H100 (2026-12-06, BENCHMARKS.md "The decode step's ends and sampling compiled",
each engine with its own kernel choices, two processes) took 8.39 / 8.39 / 8.30 ms with them up to 128 rows against
8.54 / 8.58 with them up to 64. At 64 rows the step showed no difference beyond the spread between engines (6.37
without them against 6.42 / 6.31 with). Shipped tables keep the choices timed before (the H200's 128-row keys)."""

SPREAD_MIN_BLOCKS = 4
"""Fewest 128-column blocks per CTA of `SPREAD_CANDIDATES`' splits."""

SPREAD_MAX_WAVES = 4
"""Most CTAs per multiprocessor in the grid of `SPREAD_CANDIDATES`' splits."""


@dataclass(frozen=True)
class WgmmaConfig:
    """One instance: ``warpgroups`` (1 or 2) per CTA, each owning ``m64_tiles`` x 64 weight rows, ``tokens`` (64,
    128 or 256) activation rows per CTA, ``stages`` 128-column blocks in the shared-memory ring (3-8) and K split
    over ``split_k`` CTAs."""

    warpgroups: int
    m64_tiles: int
    tokens: int
    stages: int
    split_k: int = 1
    arch_specific = True  # built for sm_90a (`cuda_mma.kernel`)

    def __post_init__(self) -> None:
        if (
            self.warpgroups not in (1, 2)
            or self.m64_tiles not in (1, 2)
            or self.tokens not in (64, 128, 256)
            or self.stages not in range(3, MAX_STAGES + 1)
            or self.split_k < 1
        ):
            raise ValueError(f"unsupported WgmmaConfig {self}")
        if self.m64_tiles * self.tokens // 2 > MAX_ACCUMULATORS:
            raise ValueError(f"WgmmaConfig {self} needs more than {MAX_ACCUMULATORS} accumulators per thread")

    @property
    def rows(self) -> int:
        return ROWS_PER_WARPGROUP_TILE * self.m64_tiles * self.warpgroups

    @property
    def threads(self) -> int:
        return 128 * self.warpgroups

    @property
    def stage_bytes(self) -> int:
        """``WgmmaLayout::STAGE`` in csrc/nvfp4_wgmma.cu: 256 B of activations per token, codes (64 B) and scales
        (8 B) per row, rounded up to 1 KB (the swizzled boxes' alignment)."""
        return -(-(self.tokens * 256 + self.rows * 72) // 1024) * 1024

    @property
    def shared_memory_bytes(self) -> int:
        """Dynamic shared memory of one CTA: the ring and its mbarriers (or the epilogue's output tile if that is
        larger), plus 1 KB to align the ring."""
        epilogue = self.tokens * (self.rows + 8) * 2 if self.split_k == 1 else self.tokens * (self.rows + 4) * 4
        return max(self.stages * (self.stage_bytes + 8), epilogue) + 1024

    def name_expression(self, dtype: torch.dtype) -> str:
        bf16 = "true" if dtype == torch.bfloat16 else "false"
        return f"nvfp4_wgmma_kernel<{self.warpgroups}, {self.m64_tiles}, {self.tokens}, {self.stages}, {bf16}>"

    def __str__(self) -> str:
        split = f" split{self.split_k}" if self.split_k > 1 else ""
        return f"wgmma {self.rows}r x {self.tokens}t wg{self.warpgroups} s{self.stages}{split}"


class _TensorMaps(ctypes.Structure):
    # mirrors `struct TensorMaps` in csrc/nvfp4_wgmma.cu
    _fields_ = [("codes", nvrtc.TensorMap * MAX_SEGMENTS), ("x", nvrtc.TensorMap)]


@functools.lru_cache(maxsize=4096)
def _codes_map(address: int, rows: int, k: int, box_rows: int) -> nvrtc.TensorMap:
    """The TMA map of a weight's codes ([rows, k / 2] bytes), boxes of ``box_rows`` x 64 bytes in the 64-byte
    swizzle. (A map holds only the address and the geometry, so a cached one is right for whatever tensor sits
    there later.)"""
    return nvrtc.tensor_map_2d(address, nvrtc.TENSOR_MAP_UINT8, (rows, k // 2), k // 2, (box_rows, 64), 64)


@functools.lru_cache(maxsize=4096)
def _activations_map(address: int, m: int, k: int, row_stride: int, tokens: int) -> nvrtc.TensorMap:
    """The TMA map of the activations ([m, k] 16-bit, rows ``row_stride`` elements apart), boxes of ``tokens`` x 64
    columns in the 128-byte swizzle."""
    return nvrtc.tensor_map_2d(address, nvrtc.TENSOR_MAP_UINT16, (m, k), row_stride * 2, (tokens, 64), 128)


def _tensor_maps(x: torch.Tensor, weights: Sequence[Weight], config: WgmmaConfig) -> _TensorMaps:
    maps = _TensorMaps()
    k = x.shape[1]
    for i, (packed, _, _) in enumerate(weights):
        maps.codes[i] = _codes_map(packed.data_ptr(), packed.shape[0], k, config.rows)
    maps.x = _activations_map(x.data_ptr(), x.shape[0], k, x.stride(0), config.tokens)
    return maps


def runs_on(device: torch.device) -> bool:
    """Whether ``device`` runs the kernel: a CUDA device of compute capability 9.0 (Hopper; the ``sm_90a`` target)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def supports_wgmma(x: torch.Tensor, weights: Sequence[Weight]) -> bool:
    """`cuda_mma.supports_tile` on a device the kernel `runs_on`."""
    return supports_tile(x, weights) and runs_on(x.device)


def wgmma_matmul(
    x: torch.Tensor,
    weights: Sequence[Weight],
    config: WgmmaConfig,
    biases: Sequence[torch.Tensor | None] | None = None,
    out: torch.Tensor | None = None,
    options: tuple[str, ...] = (),
) -> torch.Tensor:
    """``[x @ W_0.T + b_0, x @ W_1.T + b_1, ...]`` side by side in one ``[M, sum N_i]`` tensor: one launch (plus,
    when ``config.split_k > 1``, one that adds the fp32 partial sums in split order). Callers check
    `supports_wgmma` first; ``biases`` are in ``x.dtype``; ``options``: extra NVRTC flags (benchmarks). Inside
    ``twiddle.twiddled_codes(..., lanes=True)`` the build reads the lane order; inside a twiddled-order window it
    refuses (`twiddle.TwiddledCodesError`: its decode takes the natural or the lane order only)."""
    if twiddle.active() and not twiddle.lane_order():
        twiddle.check_standard_order("the wgmma kernel")
    options = options + twiddle.window_build()
    limit = nvrtc.max_shared_memory_per_block(nvrtc.device_index(x.device))
    if config.shared_memory_bytes > limit:
        raise ValueError(
            f"{config} needs {config.shared_memory_bytes} bytes of shared memory, more than this GPU gives a CTA "
            f"({limit}); use fewer stages (`wgmma_candidate_configs` fits them)"
        )
    maps = _tensor_maps(x, weights, config)
    return launch_tiled(x, weights, config, config.threads, biases, out, extra_args=(maps,), options=options)


SHAPES = (
    (2, 1, 64), (2, 2, 64), (1, 2, 64), (1, 1, 64), (2, 1, 128), (2, 2, 128), (1, 2, 128), (2, 1, 256), (1, 1, 256),
)  # fmt: skip
"""(warpgroups, m64 tiles, tokens) of the candidates: 64-256 weight rows x 64-256 tokens per CTA. ``(1, 1, 64)`` (added
2026-12-05, not yet timed): 64-row CTAs for small layers at 64 rows, where 128-row tiles leave most multiprocessors
idle (7B q/k/v: 36 CTAs; the shipped choice there is 1.7x bf16)."""


def wgmma_candidate_configs(m: int, n: int, k: int, num_sms: int = 132,
                            shared_memory_limit: int = 227 * 1024) -> list[WgmmaConfig]:  # fmt: skip
    """Instances worth timing for ``m`` rows (64-512), ``n`` weight rows and ``k`` columns: CTAs of at most
    ``2 m`` tokens, the deepest ring that fits twice in a multiprocessor's shared memory (else once), and a K
    split where the tiles alone would not fill the GPU."""
    blocks = k // 128
    configs = []
    for warpgroups, m64_tiles, tokens in SHAPES:
        if tokens >= 2 * max(m, 64):
            continue
        depths = (6, 5, 4, 3) if not DEEP_CANDIDATES else tuple(range(MAX_STAGES, 2, -1))
        sizes = {s: WgmmaConfig(warpgroups, m64_tiles, tokens, s).shared_memory_bytes for s in depths}
        twice = [s for s, size in sizes.items() if 2 * size <= shared_memory_limit]
        once = [s for s, size in sizes.items() if size <= shared_memory_limit]
        if not (twice or once):
            continue
        probe = WgmmaConfig(warpgroups, m64_tiles, tokens, (twice or once)[0])
        ctas = -(-n // probe.rows) * -(-m // probe.tokens)
        split = 1
        while ctas * split < num_sms and blocks >= 16 * split:
            split *= 2
        configs += [probe] + ([WgmmaConfig(warpgroups, m64_tiles, tokens, probe.stages, split)] if split > 1 else [])
        if DEEP_CANDIDATES:
            configs += _deep_configs(probe, once[0] if once else probe.stages, ctas, split, blocks, num_sms,
                                     resident=2 if twice else 1)  # fmt: skip
        if SPREAD_CANDIDATES and m <= SPREAD_MAX_ROWS:
            # a multiprocessor holds 1 KB more than one CTA may ask for, and each resident CTA takes 1 KB of it
            thrice = [s for s, size in sizes.items() if 3 * (size + 1024) <= shared_memory_limit + 1024]
            configs += _spread_configs(probe, thrice, ctas, split, blocks, num_sms)
    return configs


def _spread_configs(probe: WgmmaConfig, thrice: list[int], ctas: int, split: int, blocks: int,
                    num_sms: int) -> list[WgmmaConfig]:  # fmt: skip
    """`SPREAD_CANDIDATES`' extra instances of one CTA shape: its shipped K split ``split`` with the deepest ring
    that fits three times in a multiprocessor, and larger splits down to `SPREAD_MIN_BLOCKS` blocks per CTA while
    the grid stays within `SPREAD_MAX_WAVES` CTAs per multiprocessor, with either ring."""
    shape = (probe.warpgroups, probe.m64_tiles, probe.tokens)
    return spread_configs(lambda stages, k_split: WgmmaConfig(*shape, stages, k_split), probe.stages, thrice[:1],
                          split, blocks, SPREAD_MIN_BLOCKS, SPREAD_MAX_WAVES * num_sms // ctas)  # fmt: skip


def _deep_configs(probe: WgmmaConfig, deepest: int, ctas: int, split: int, blocks: int, num_sms: int,
                  resident: int) -> list[WgmmaConfig]:  # fmt: skip
    """`DEEP_CANDIDATES`' extra instances of one CTA shape: the deepest ring that fits once, with the K split that
    fills the multiprocessors; and for grids past one wave of ``resident`` CTAs per multiprocessor whose last wave
    is under half full, K split 2 and 4 (more, shorter CTAs even out the waves)."""
    shape = (probe.warpgroups, probe.m64_tiles, probe.tokens)
    extra = []
    if deepest > probe.stages:
        extra.append(WgmmaConfig(*shape, deepest, split))
    slots = num_sms * resident
    if ctas > slots and 0 < ctas % slots <= slots // 2:
        extra += [WgmmaConfig(*shape, probe.stages, s) for s in (2, 4) if blocks >= 4 * s]
    return extra
