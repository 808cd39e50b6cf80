"""The Triton kernels of `lora_rows` (kept apart: Triton is optional, and only launching needs it).

`_shrink_rows_kernel`: ``t = x @ A.T`` for every row of the launch. A program takes ``BLOCK_M`` rows, ``BLOCK_R`` rows of
the concatenated A matrices (``BLOCK_R`` divides every rank, so a block lies in one adapter) and one span of columns;
each step multiplies an ``[BLOCK_M, BLOCK_K]`` input tile by the A tile (`SHRINK_MODE`: 3xTF32 on the tensor cores, or
FMAs), and the spans' ``[BLOCK_M, BLOCK_R]`` partials are added in a fixed order by the last programs to arrive: in
two levels, groups of `GROUP_SPLITS` spans and then the groups (`_store_splits_in_groups`, the default), or in one
(`_fused_shrink_kernel._store_splits`, where there are no more spans than a group); the same sum on every launch,
counters reset for graph replays.

`_expand_add_kernel`: ``out = round(base + scaling * t @ B.T)`` for up to three projections side by side (their
outputs' column blocks numbered one after another), one ``[BLOCK_M, BLOCK_N]`` output tile per program (`EXPAND_MODE`:
3xTF32 over steps of `RANK_STEP` ranks, the rank padded with zeros, or one FMA outer product per rank).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..nvfp4.cuda_mma import arrival_counters
from ._arrival_kernel import last_to_arrive, reset_arrivals
from ._fused_shrink_kernel import _DTYPES, _a_tile, _adapter_args, _adapter_rows, _round, _store_splits


BLOCK_K = 64
"""Columns per step of the shrink (an fp32 ``[BLOCK_R, BLOCK_K]`` A tile and a ``[BLOCK_M, BLOCK_K]`` input tile)."""
TARGET_PROGRAMS = 528
"""Programs a shrink launch aims at (four per multiprocessor of a 132-multiprocessor GPU), by splitting the columns:
each program's A rows come from HBM, so many short spans keep more loads in flight (same run as `SHRINK_MODE`: 264
programs and 16 spans took 2.22 / 2.41 ms per step at 32 / 64 rows with FMAs in the shrink, 528 and 64 spans 1.43 /
1.80)."""
MAX_SPLITS = 64
"""Most column spans of a shrink: the last program of a tile adds this many partial tiles one after another."""
BLOCK_N = 64
"""Output columns per expand program."""
RANK_STEP = 16
"""Ranks per product step of the expand (``tl.dot``'s least)."""
WARPS = 4
SHRINK_MODE = 1
"""How the shrink multiplies: 1 ``tl.dot`` in 3xTF32 (tensor cores; each fp32 operand split into two TF32 parts, the
products summed in fp32: within ~1e-6 of fp32), 2 FMAs into a ``[BLOCK_M, FMA_BLOCK_R, FMA_BLOCK_K]`` register tile
(fp32). Measured on the H200 (7B, rank 32, each layer's adapters read from HBM, 2026-12-04,
`scripts/bench_lora_rows.py`): 1.30 / 1.69 ms per decode step at 32 / 64 rows with 3xTF32 in both kernels, 1.42 /
1.80 with FMAs in the shrink, 3.19 / 3.54 with FMAs in both and 16 splits, 4.14 / 4.73 for the cuBLAS path; ``tl.dot``
in IEEE fp32 (Triton's FMA lowering) was slower still (3.51 / 5.76 with the adapters in L2)."""
EXPAND_MODE = 1
"""How the expand multiplies: 1 ``tl.dot`` in 3xTF32, 2 one outer product per rank (FMAs, fp32)."""
STAGES = 3
"""Software-pipelined steps in flight (``num_stages``) of the shrink's column loop."""
FMA_BLOCK_R = 4
"""A rows per shrink program in mode 2."""
FMA_BLOCK_K = 32
"""Columns per step of the shrink in mode 2 (the tile: ``BLOCK_M x FMA_BLOCK_R x FMA_BLOCK_K`` fp32)."""
GROUP_SPLITS = 8
"""Spans per group of a two-level sum over the spans' partials (0: one level). With up to `MAX_SPLITS` spans, the last
program of a tile to arrive reads every span's ``[BLOCK_M, BLOCK_R]`` partial (at 64 rows and rank blocks of 32, up to
64 tiles of 8 KB) from one multiprocessor. In groups, the last program of each group sums that group's partials and
leaves one group sum, and the last group to finish sums those: the reads spread over as many programs, in a fixed order
(the same sum on every launch, rounded differently from one level). Measured on the H100 (7B, rank 32, 2026-12-05,
`scripts/bench_lora_rows.py --rows 64 32 --variants GROUP_SPLITS=8 GROUP_SPLITS=4 GROUP_SPLITS=16 ...`): the row
shrinks of a decode step took 1.433 / 1.297 ms at 64 / 32 rows in groups of 8 against 1.716 / 1.327 in one level (4:
1.451 / 1.290, 16: 1.479 / 1.357); fewer spans (`MAX_SPLITS` 16 or 32) or more programs were slower."""


@triton.jit
def _shrink_rows_kernel(
    x_ptr, a0, a1, a2, t_ptr, partial_ptr, count_ptr,
    rows, width, span, rank0, rank1, stride_x, stride_t,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
    MODE: tl.constexpr, GROUPS: tl.constexpr, PER_GROUP: tl.constexpr,
):  # fmt: skip
    first = tl.program_id(0) * BLOCK_R
    base = _adapter_rows(a0, a1, a2, first, width, rank0, rank1)
    ranks = tl.arange(0, BLOCK_R)
    row_ids = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = row_ids < rows
    low = tl.program_id(2) * span
    high = tl.minimum(low + span, width)
    if MODE == 2:  # FMAs into a [rows, ranks, columns] tile, reduced over the columns once
        wide = tl.zeros([BLOCK_M, BLOCK_R, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for start in range(low, high, BLOCK_K):
        offsets = start + tl.arange(0, BLOCK_K)
        inside = offsets < high
        x = tl.load(x_ptr + row_ids[:, None] * stride_x + offsets[None, :], mask=live[:, None] & inside[None, :],
                    other=0.0).to(tl.float32)  # fmt: skip
        a = _a_tile(base, ranks, width, offsets, inside)
        if MODE == 2:
            wide += x[:, None, :] * a[None, :, :]
        else:
            acc += tl.dot(x, tl.trans(a), input_precision="tf32x3")
    if MODE == 2:
        acc = tl.sum(wide, axis=2)
    slot = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_R + ranks[None, :]
    targets = t_ptr + row_ids[:, None] * stride_t + first + ranks[None, :]
    if GROUPS == 1:
        _store_splits(acc, targets, live[:, None], partial_ptr, count_ptr, slot, tl.program_id(2), tile,
                      BLOCK_M * BLOCK_R, SPLITS)  # fmt: skip
    else:
        _store_splits_in_groups(acc, targets, live[:, None], partial_ptr, count_ptr, slot, tl.program_id(2), tile,
                                tl.num_programs(0) * tl.num_programs(1), BLOCK_M * BLOCK_R, SPLITS, GROUPS, PER_GROUP)  # fmt: skip


@triton.jit
def _store_splits_in_groups(value, targets, mask, partial_ptr, count_ptr, slot, split, offsets, slots_count,
                            SIZE: tl.constexpr, SPLITS: tl.constexpr, GROUPS: tl.constexpr, PER_GROUP: tl.constexpr):  # fmt: skip
    """`_store_splits` in two levels (`GROUP_SPLITS`): this program's partial goes to span ``split`` of slot ``slot``;
    the last of its group (``PER_GROUP`` spans, the last group fewer) to arrive adds the group's partials in span order
    into the slot's group sum, and the last group to finish adds the group sums in group order and stores them. Scratch:
    ``slots_count x SPLITS`` partials, then ``slots_count x GROUPS`` group sums; counters: ``GROUPS + 1`` per slot, each
    reset by its last arrival (graph replays need no memset)."""
    partials = partial_ptr + slot * SPLITS * SIZE + offsets
    sums = partial_ptr + (slots_count * SPLITS + slot * GROUPS) * SIZE + offsets
    counters = count_ptr + slot * (GROUPS + 1)
    tl.store(partials + split * SIZE, value)
    group = split // PER_GROUP
    first = group * PER_GROUP
    last = tl.minimum(first + PER_GROUP, SPLITS)
    if last_to_arrive(counters, group, last - first):
        total = tl.zeros_like(value)
        for other in range(first, last):
            total += tl.load(partials + other * SIZE, cache_modifier=".cg")
        tl.store(sums + group * SIZE, total)
        reset_arrivals(counters, group)
        if last_to_arrive(counters, GROUPS, GROUPS):
            total = tl.zeros_like(value)
            for other in range(GROUPS):
                total += tl.load(sums + other * SIZE, cache_modifier=".cg")
            tl.store(targets, total, mask=mask)
            reset_arrivals(counters, GROUPS)


@triton.jit
def _pick(segment, v0, v1, v2):
    """``v0``, ``v1`` or ``v2`` by ``segment`` (selects, not branches: the values may be specialised constants)."""
    return tl.where(segment == 0, v0, tl.where(segment == 1, v1, v2))


@triton.jit
def _expand_add_kernel(
    base0, base1, base2, out0, out1, out2, b0, b1, b2, t_ptr,
    rows, n0, n1, n2, blocks0, blocks1, rank0, rank1, rank2, first1, first2, scale0, scale1, scale2,
    stride_base0, stride_base1, stride_base2, stride_out0, stride_out1, stride_out2, stride_t,
    OUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RANK: tl.constexpr, RANK_STEP: tl.constexpr,
    MODE: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    segment = tl.where(block < blocks0, 0, tl.where(block < blocks0 + blocks1, 1, 2))
    block -= tl.where(segment >= 1, blocks0, 0) + tl.where(segment == 2, blocks1, 0)
    first = _pick(segment, 0, first1, first2)
    base_ptr, out_ptr, b_ptr = (
        _pick(segment, base0, base1, base2),
        _pick(segment, out0, out1, out2),
        _pick(segment, b0, b1, b2),
    )
    n, rank, scale = (
        _pick(segment, n0, n1, n2),
        _pick(segment, rank0, rank1, rank2),
        _pick(segment, scale0, scale1, scale2),
    )
    stride_base = _pick(segment, stride_base0, stride_base1, stride_base2)
    stride_out = _pick(segment, stride_out0, stride_out1, stride_out2)
    columns = block * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ids = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    live, inside = row_ids < rows, columns < n
    update = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if MODE == 2:  # one outer product per rank (columns of t and B, from L1 after the first)
        for j in range(0, rank):
            t = tl.load(t_ptr + row_ids * stride_t + first + j, mask=live, other=0.0)
            b = tl.load(b_ptr + columns * rank + j, mask=inside, other=0.0)
            update += t[:, None] * b[None, :]
    else:
        for low in tl.static_range(0, RANK, RANK_STEP):
            ranks = low + tl.arange(0, RANK_STEP)
            ranked = ranks < rank
            t = tl.load(t_ptr + row_ids[:, None] * stride_t + first + ranks[None, :],
                        mask=live[:, None] & ranked[None, :], other=0.0)  # fmt: skip
            b = tl.load(b_ptr + columns[:, None] * rank + ranks[None, :], mask=inside[:, None] & ranked[None, :],
                        other=0.0)  # fmt: skip
            update += tl.dot(t, tl.trans(b), input_precision="tf32x3")
    mask = live[:, None] & inside[None, :]
    base = tl.load(base_ptr + row_ids[:, None] * stride_base + columns[None, :], mask=mask, other=0.0)
    out = _round(base.to(tl.float32) + update * scale, OUT)
    tl.store(out_ptr + row_ids[:, None] * stride_out + columns[None, :], out, mask=mask)


def block_m(rows: int) -> int:
    """Rows per program: the launch's rows up to 64 (``tl.dot`` needs at least 16)."""
    return max(16, min(64, triton.next_power_of_2(rows)))


def shrink_mode(ranks: list[int]) -> int:
    """`SHRINK_MODE`, or FMAs (2) where a rank is not a multiple of 16 (a ``tl.dot`` rank block would straddle two
    adapters)."""
    return SHRINK_MODE if all(r % 16 == 0 for r in ranks) else 2


def rank_block(ranks: list[int], mode: int) -> int:
    """A rows per shrink program, dividing every rank (callers check that 4 does): `FMA_BLOCK_R` (else 4) in mode 2,
    else 32 or 16."""
    if mode == 2:
        return FMA_BLOCK_R if all(r % FMA_BLOCK_R == 0 for r in ranks) else 4
    return 32 if all(r % 32 == 0 for r in ranks) else 16


def step_columns(mode: int) -> int:
    """Columns per step of the shrink."""
    return FMA_BLOCK_K if mode == 2 else BLOCK_K


def shrink_layout(rows: int, width: int, ranks: list[int]) -> tuple[int, int, int, int, int]:
    """(mode, BLOCK_M, BLOCK_R, span, splits) of a shrink launch: column spans of whole steps, as many (up to
    `MAX_SPLITS`) as bring the launch to about `TARGET_PROGRAMS` programs."""
    mode = shrink_mode(ranks)
    m, r = block_m(rows), rank_block(ranks, mode)
    tiles = triton.cdiv(rows, m) * (sum(ranks) // r)
    columns = step_columns(mode)
    steps = triton.cdiv(width, columns)
    splits = max(1, min(steps, MAX_SPLITS, TARGET_PROGRAMS // tiles))
    span = triton.cdiv(steps, splits) * columns
    return mode, m, r, span, triton.cdiv(width, span)


def split_groups(splits: int) -> tuple[int, int]:
    """(spans per group, groups) of the sum over ``splits`` spans' partials: `GROUP_SPLITS` per group (the last group
    fewer), or one group of all, where `GROUP_SPLITS` is 0 or at least ``splits``."""
    if GROUP_SPLITS <= 0 or GROUP_SPLITS >= splits:
        return splits, 1
    return GROUP_SPLITS, triton.cdiv(splits, GROUP_SPLITS)


def shrink_rows(x: torch.Tensor, lora_a: list[torch.Tensor], t: torch.Tensor, lane: int = 0) -> None:
    """Fill ``t[M, Σ ranks]`` (fp32) with ``x @ A.T`` of each A side by side. ``lane``: the arrival counters'
    (`arrival_counters`; a launch that may overlap other launches takes a lane of its own)."""
    rows, width = x.shape
    ranks = [a.shape[0] for a in lora_a]
    mode, m, r, span, splits = shrink_layout(rows, width, ranks)
    grid = (sum(ranks) // r, triton.cdiv(rows, m), splits)
    tiles = grid[0] * grid[1]
    per_group, groups = split_groups(splits)
    sums = groups if groups > 1 else 0  # the group sums follow the partials
    partials = t.new_empty(tiles * (splits + sums) * m * r) if splits > 1 else t
    counters = arrival_counters(t.device, tiles * (groups + 1), lane) if splits > 1 else t
    (a0, a1, a2), rank0, rank1 = _adapter_args(lora_a)
    _shrink_rows_kernel[grid](
        x, a0, a1, a2, t, partials, counters, rows, width, span, rank0, rank1, x.stride(0), t.stride(0),
        BLOCK_M=m, BLOCK_R=r, BLOCK_K=step_columns(mode), SPLITS=splits, MODE=mode, GROUPS=groups,
        PER_GROUP=per_group, num_warps=WARPS, num_stages=STAGES,
    )  # fmt: skip


def expand_add(
    bases: list[torch.Tensor], t: torch.Tensor, lora_b: list[torch.Tensor], scalings: list[float],
    outs: list[torch.Tensor],
) -> None:  # fmt: skip
    """Fill ``outs[i] = round(bases[i] + scalings[i] * t_i @ B_i.T)``, ``t_i`` the columns of ``t`` that follow the
    ranks before it."""
    rows = t.shape[0]
    ranks = [b.shape[1] for b in lora_b]
    widths = [b.shape[0] for b in lora_b]
    blocks = [triton.cdiv(n, BLOCK_N) for n in widths]
    firsts = [sum(ranks[:i]) for i in range(len(ranks))]
    m = block_m(rows)

    def three(values, fill):
        return (list(values) + [fill] * 3)[:3]

    base0, base1, base2 = three(bases, bases[0])
    out0, out1, out2 = three(outs, outs[0])
    b0, b1, b2 = three(lora_b, lora_b[0])
    n0, n1, n2 = three(widths, 0)
    rank0, rank1, rank2 = three(ranks, 0)
    _, first1, first2 = three(firsts, 0)
    scale0, scale1, scale2 = three([float(s) for s in scalings], 0.0)
    blocks0, blocks1, _ = three(blocks, 0)
    sb0, sb1, sb2 = three([b.stride(0) for b in bases], 0)
    so0, so1, so2 = three([o.stride(0) for o in outs], 0)
    grid = (sum(blocks), triton.cdiv(rows, m))
    _expand_add_kernel[grid](
        base0, base1, base2, out0, out1, out2, b0, b1, b2, t,
        rows, n0, n1, n2, blocks0, blocks1, rank0, rank1, rank2, first1, first2, scale0, scale1, scale2,
        sb0, sb1, sb2, so0, so1, so2, t.stride(0),
        OUT=_DTYPES[outs[0].dtype], BLOCK_M=m, BLOCK_N=BLOCK_N, RANK=triton.cdiv(max(ranks), RANK_STEP) * RANK_STEP,
        RANK_STEP=RANK_STEP, MODE=EXPAND_MODE, num_warps=WARPS,
    )  # fmt: skip
