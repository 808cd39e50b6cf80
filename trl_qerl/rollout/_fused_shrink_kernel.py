"""The Triton kernels of `fused_shrink` (kept apart: Triton is optional, and only launching needs it).

Each program takes one row and ``BLOCK_R`` rows of the concatenated LoRA A matrices (all in one adapter: ``BLOCK_R``
divides every rank). It recomputes the row's elementwise part (cheap: the row is a few KB, read from L2), stores it
only from the programs of the first rank block, and reduces ``part · A[j]`` over the row in fp32.

For SiLU·up launches of `ROWS_FROM` rows and more, `_silu_mul_shrink_rows_kernel` takes every row of the launch in
each program (``ROWS``, a power of two, the rest masked), ``BLOCK_R`` A rows and one span of columns: per step it
loads the A tile once for all rows and accumulates ``y[m, k] * A[j, k]`` elementwise into a ``[ROWS, BLOCK_R,
BLOCK_K]`` register tile (independent FMAs), reducing over the columns once, at the end of the span. The spans'
``[ROWS, BLOCK_R]`` partials go to scratch and the last program of a rank block to arrive adds them in span order (the
same sum on every launch) and resets its counter.

Measured on the H200 (7B, rank 32, 2026-12-02; `scripts/bench_fused_shrink.py`, raw data in
`benchmarks/fused_decode/row_shrink_2026-12-02/`), µs per call: SiLU·up (18,944 long, one program per row re-reads A
per row) 4.9 / 7.2 / 11.4 / 16.4 per row at 2 / 4 / 8 / 16 rows, 4.3 / 6.2 / 7.8 / 11.3 over every row. The norms
(3,584 long) stay per row: a norm kernel over every row, whose programs each read all rows' whole width once more for
the statistics, took 5.0-17.1 µs at 2-16 rows against 3.1-8.2. A draft that multiplied ``[16, 64]`` tiles on the
tensor cores (3xTF32 ``tl.dot``, commit 4bef487) took 12-20 µs at 1-16 rows (not profiled).

`_shrink_kernel` is the norm shrinks' layout without the norm, for an input no kernel of ours makes (`shrink`).

A norm row that fits one step (`NORM_MAX_BLOCK_K`: 7B's 3,584 columns, 14B's and 32B's 5,120, 72B's 8,192) is
loaded once, and the program's A tile is loaded before the row's statistics, so that its latency overlaps them
(`NORM_ONE_STEP`). Measured on the H200 (7B, rank 32,
2026-12-03, `benchmarks/fused_decode/norm_shrink_2026-12-03/`): q/k/v and gate/up norm shrinks 2.5 / 2.5 µs at one
row (two passes, A loaded after the statistics: 3.3 / 3.2), 4.1 / 4.5 at 8 (5.0 / 5.7); in the decode step at batch
8, 0.228 against 0.282 ms per step for the 56 launches. Programs of several rows (`NORM_ROWS` 2-8: A read once for
them) were slower at 2-8 rows (4.0-11.7 µs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..nvfp4.cuda_mma import arrival_counters
from ._arrival_kernel import last_to_arrive, reset_arrivals
from ._pdl_kernel import allow_next_kernel, launch_options, wait_for_previous_kernel


_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
MAX_BLOCK_K = 4096
"""Columns per step: a 7B row (3,584) in one, so the norm's second pass reads x again from L1, not after a loop.
Measured on the H200 (7B, 2026-12-02): steps of 512 made each program a chain of dependent loads (18,944-long
SiLU·up shrink: 27 µs per call at one row)."""
TILE = 8192
"""A-tile elements per program and step (``BLOCK_R x BLOCK_K``): bounds the registers (32 per thread at 8 warps)."""
TARGET_PROGRAMS = 264
"""Two waves of a 132-multiprocessor GPU: below this many (row, rank block) programs the rank block shrinks, and
`silu_mul_shrink` splits rows."""
MIN_SPAN = 1024
"""Fewest columns per split program of `silu_mul_shrink`."""
SPAN_ALIGN = 256
ROWS_FROM = 2
"""SiLU·up launches of this many rows and more take `_silu_mul_shrink_rows_kernel` (fewer: one program per row and
rank block)."""
ROWS_MAX = 16
"""Most rows that kernel takes (``ROWS`` lives in registers); more take the per-row kernel."""
ROWS_BLOCK_K = 1024
"""Most columns per step of that kernel."""
ROWS_WARPS = 4
"""Measured on the H200 (7B SiLU·up, 2026-12-02): 4 warps 7.8 / 11.3 µs at 8 / 16 rows, 8 warps 11.3 / 16.6."""
ROWS_REGISTERS = 64
"""Bound on the accumulator's registers per thread: ``ROWS x BLOCK_R x BLOCK_K / (32 x ROWS_WARPS)``."""
ROWS_PROGRAMS = 264
"""Programs a launch over every row aims at (rank blocks x spans)."""
NORM_ROWS = 1
"""Rows per program of the norm shrinks (each program reads its A tile once for them)."""
NORM_ONE_STEP = 1
"""Rows that fit one ``BLOCK_K`` step (7B: 3,584 of 4,096) load ``x`` once and the A tile before the statistics."""
NORM_MAX_BLOCK_K = 8192
"""Columns per step of the norm shrinks: a 14B or 32B row (5,120) and 72B's (8,192) in one step. With 4,096 such a row
took two passes of two steps, the second three-quarters masked. Measured on the H200 (14B, rank 32, 2026-12-03,
`benchmarks/fourteenth_2026-12-03/`), q/k/v and gate/up norm shrinks, µs per call: 4.7 / 4.7 -> 3.1 / 3.0 at one row,
8.2 / 9.4 -> 6.5 / 7.4 at eight (with `NORM_TILE` 16,384 and `TARGET_PROGRAMS` 264; with a tile of 8,192 the q/k/v
shrink at eight rows lost its rank block of 2 and took 10.2)."""
NORM_TILE = 32768
"""`TILE` of the norm shrinks: the A tile's elements per program (``BLOCK_R x BLOCK_K``): steps of 8,192 columns (14B,
32B) may take rank blocks of 4. With `NORM_TARGET_PROGRAMS` 264 a tile of 32,768 was slower than 16,384 (H200, 14B,
2026-12-03, the same run as `NORM_MAX_BLOCK_K`; 16 warps too); with 66 it is faster (see there)."""
NORM_TARGET_PROGRAMS = 66
"""`TARGET_PROGRAMS` of the norm shrinks' rank block: the widest block (of 4, 2, 1) whose launch still has this many
programs. Fewer programs reread the row and the A tiles, and the launch needs fewer waves: a 14B program of rank block
2 takes 214 registers a thread (cross-compiled for sm_90 with Triton 3.6; 176 with 3.9), so one fits a
multiprocessor and 264 or more of them run in two waves or more. Rank block 4 takes 255 and keeps 48 bytes on the
stack with Triton 3.6 (none with 3.9); measured so, it was still the faster layout. 16 warps (`NORM_MAX_WARPS`) would
need no stack (128 registers); not measured. Measured on an H100 (2026-12-06, `benchmarks/thirtyseventh_2026-12-06/`,
`scripts/bench_fused_shrink.py --variants`), µs per call, rank 32, 264 and tiles of 16,384 (before) -> 66 and 32,768:
14B q/k/v and gate/up 6.4 / 7.3 -> 6.4 / 3.9 at 8 rows, 11.5 / 8.2 -> 9.2 / 6.6 at 16; 7B 4.1 / 4.4 -> 3.9 / 3.1 at 8,
6.3 / 5.9 -> 6.3 / 4.0 at 16; one row unchanged (96 and 64 programs of rank block 1 either way); 132 was as fast or slower. In
the decode step at batch 8 (A-B-A-B, one process), the norm shrinks' kernel time per step went from 0.662 / 0.672 to
0.496 ms (14B) and from 0.245 / 0.242 to 0.197 ms (7B); the step from 6.84 / 6.84 to 6.70 / 6.75 ms and from 3.56 /
3.58 to 3.53 / 3.53 ms. Holding a row as its exact powers of two (5,120 = 4,096 + 1,024: 121 registers instead of
176) was slower wherever the rank block did not change (14B q/k/v at 8 rows 6.4 -> 7.4, 7B 4.1 -> 5.1): each part
adds its own block-wide sums; dropped."""
NORM_MAX_WARPS = 8
"""Most warps per norm-shrink program (``BLOCK_K / 512``, at least one)."""
NORM_PASSES = 1
"""Whether one-step norm-shrink launches of one row per program that would need more than one wave take several rank
blocks per program in turn, as `norm_passes` gives (0: one rank block per program). Such a program normalises its row
once and loads one A tile after another (the first before the statistics, as ever). Measured on an H100 (2026-12-07,
`benchmarks/thirtyeighth_2026-12-07/`), µs per call, rank 32, one block a program -> passes: 14B q/k/v 6.4 -> 5.1 at
8 rows (192 programs -> 96), 9.1 -> 6.5 at 16; 14B gate/up at 16 rows 6.4 -> 5.2; 7B q/k/v at 16 rows 6.4 -> 5.0; in
the 14B decode step at batch 8 the norm shrinks' kernel time 0.505-0.508 -> 0.463-0.464 ms. Where the launch fits one
wave it loses (7B q/k/v at 8 rows, 192 programs two a multiprocessor: 3.8 -> 4.0), hence the wave bound."""
NORM_WIDE_COLUMNS = 8192
"""Steps at least this wide (14B, 32B and 72B rows) make norm-shrink programs that fill a multiprocessor's registers
alone at rank blocks of 2 and 4 (214 and 255 registers a thread over 8 warps, Triton 3.6; 176 and 230 with 3.9);
narrower ones (7B: 4,096 columns, rank block 4, 128 registers) fit two. `norm_passes` counts a wave so."""
NORM_WAVE_PROGRAMS = 0
"""Multiprocessors `norm_passes` counts a wave by (0: the GPU's; on the CPU interpreter, no passes unless set)."""


@triton.jit
def _round(x, OUT: tl.constexpr):
    """fp32 -> OUT, round to nearest even. bf16 by its bits: Triton's interpreter (the CPU tests) truncates a
    ``.to(tl.bfloat16)`` (Triton 3.6-3.9), the GPU rounds; this is the same on both (finite values)."""
    if OUT == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(OUT)


@triton.jit
def _adapter_rows(a0, a1, a2, first, width, rank0, rank1):
    """Pointer to row ``first`` of the concatenated A matrices (``first`` and the block after it lie in one)."""
    if first < rank0:
        base = a0 + first * width
    elif first < rank0 + rank1:
        base = a1 + (first - rank0) * width
    else:
        base = a2 + (first - rank0 - rank1) * width
    return base


@triton.jit
def _a_tile(base, ranks, width, offsets, inside):
    """The A rows ``ranks`` from ``base`` (rows of ``width``) at columns ``offsets``, zero outside ``inside``."""
    return tl.load(base + ranks[:, None] * width + offsets[None, :], mask=inside[None, :], other=0.0)


@triton.jit
def _norm_input(x_row, res_row, offsets, inside, HAS_RESIDUAL: tl.constexpr, OUT: tl.constexpr):
    """The norm's input in fp32: ``x``, or ``x + residual`` rounded to OUT as the eager add rounds it."""
    x = tl.load(x_row + offsets, mask=inside, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = _round(x + tl.load(res_row + offsets, mask=inside, other=0.0).to(tl.float32), OUT).to(tl.float32)
    return x


@triton.jit
def _store_splits(value, targets, mask, partial_ptr, count_ptr, slot, split, offsets,
                  SIZE: tl.constexpr, SPLITS: tl.constexpr):  # fmt: skip
    """Store ``value`` at ``targets``, or, where the columns are split over ``SPLITS`` programs, leave it as split
    ``split`` of scratch slot ``slot`` (``SIZE`` elements, ``value`` at ``offsets``): the slot's last program to
    arrive adds the partials in split order (the same sum on every launch), stores them and resets the slot's counter
    for the next launch (so graph replays need no memset)."""
    if SPLITS == 1:
        tl.store(targets, value, mask=mask)
    else:
        tl.store(partial_ptr + (slot * SPLITS + split) * SIZE + offsets, value)
        if last_to_arrive(count_ptr, slot, SPLITS):
            total = tl.zeros_like(value)
            for other in range(SPLITS):
                total += tl.load(partial_ptr + (slot * SPLITS + other) * SIZE + offsets, cache_modifier=".cg")
            tl.store(targets, total, mask=mask)
            reset_arrivals(count_ptr, slot)


@triton.jit
def _norm_shrink_row(x_ptr, res_ptr, w_ptr, s_ptr, h_ptr, a, base, row, width, eps, columns, ranks,
                     stride_x, stride_res, stride_s, stride_h,
                     HAS_RESIDUAL: tl.constexpr, OUT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                     ONE_STEP: tl.constexpr):  # fmt: skip
    """One row's ``h`` (and ``s``, stored by the rank block 0 programs) and its ``BLOCK_R`` shrink sums. With
    ``ONE_STEP`` the row fits one ``BLOCK_K`` step: ``x`` is loaded once and ``a``, the A tile, was loaded before.
    Returns the sums and, with ``ONE_STEP``, the row's ``h`` in fp32 (for further rank blocks; else the sums again)."""
    x_row, res_row = x_ptr + row * stride_x, res_ptr + row * stride_res
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    if ONE_STEP:
        inside = columns < width
        x = _norm_input(x_row, res_row, columns, inside, HAS_RESIDUAL, OUT)
        inverse = tl.rsqrt(tl.sum(x * x, axis=0) / width + eps)  # torch.rsqrt, as the eager and inductor norms
        h = _norm_output(x, inverse, w_ptr, s_ptr + row * stride_s, h_ptr + row * stride_h, columns, inside,
                         HAS_RESIDUAL, OUT)  # fmt: skip
        normed = h.to(tl.float32)
        acc += tl.sum(a * normed[None, :], axis=1)
    else:
        squares = tl.zeros([BLOCK_K], dtype=tl.float32)
        for start in range(0, width, BLOCK_K):
            offsets = start + columns
            inside = offsets < width
            x = _norm_input(x_row, res_row, offsets, inside, HAS_RESIDUAL, OUT)
            squares += x * x
        inverse = tl.rsqrt(tl.sum(squares, axis=0) / width + eps)
        for start in range(0, width, BLOCK_K):
            offsets = start + columns
            inside = offsets < width
            x = _norm_input(x_row, res_row, offsets, inside, HAS_RESIDUAL, OUT)
            h = _norm_output(x, inverse, w_ptr, s_ptr + row * stride_s, h_ptr + row * stride_h, offsets, inside,
                             HAS_RESIDUAL, OUT)  # fmt: skip
            tile = _a_tile(base, ranks, width, offsets, inside)
            acc += tl.sum(tile * h.to(tl.float32)[None, :], axis=1)
        normed = acc
    return acc, normed


@triton.jit
def _norm_output(x, inverse, w_ptr, s_row, h_row, offsets, inside, HAS_RESIDUAL: tl.constexpr, OUT: tl.constexpr):
    """``h = round(weight * round(x * inverse))``, stored (with ``s = x``, exact: x holds a rounded sum) by the
    programs of rank block 0."""
    if HAS_RESIDUAL and tl.program_id(1) == 0:
        tl.store(s_row + offsets, x.to(OUT), mask=inside)
    normed = _round(x * inverse, OUT).to(tl.float32)
    weight = tl.load(w_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    h = _round(weight * normed, OUT)
    if tl.program_id(1) == 0:
        tl.store(h_row + offsets, h, mask=inside)
    return h


@triton.jit
def _norm_shrink_kernel(
    x_ptr, res_ptr, w_ptr, a0, a1, a2, s_ptr, h_ptr, t_ptr,
    rows, width, rank0, rank1, eps, stride_x, stride_res, stride_s, stride_h, stride_t,
    HAS_RESIDUAL: tl.constexpr, OUT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    ROWS: tl.constexpr, ONE_STEP: tl.constexpr, PASSES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    tl.static_assert(PASSES == 1 or (ONE_STEP and ROWS == 1), "rank blocks in passes need one row in one step")
    first = tl.program_id(1) * PASSES * BLOCK_R
    columns = tl.arange(0, BLOCK_K)
    base = _adapter_rows(a0, a1, a2, first, width, rank0, rank1)
    ranks = tl.arange(0, BLOCK_R)
    a = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)  # (unused in two passes, which load A per step)
    if ONE_STEP:  # issued first: its latency overlaps the statistics of the rows (and, launched with PDL, the
        a = _a_tile(base, ranks, width, columns, columns < width)  # kernel before this one: no kernel writes A)
    wait_for_previous_kernel(PDL)
    allow_next_kernel(PDL)
    for i in tl.static_range(ROWS):
        row = tl.program_id(0) * ROWS + i
        if row < rows:
            acc, h = _norm_shrink_row(x_ptr, res_ptr, w_ptr, s_ptr, h_ptr, a, base, row, width, eps, columns, ranks,
                                      stride_x, stride_res, stride_s, stride_h,
                                      HAS_RESIDUAL, OUT, BLOCK_R, BLOCK_K, ONE_STEP)  # fmt: skip
            tl.store(t_ptr + row * stride_t + first + ranks, acc)
            for p in tl.static_range(1, PASSES):  # the program's further rank blocks, for the row's h
                block_first = first + p * BLOCK_R
                block_base = _adapter_rows(a0, a1, a2, block_first, width, rank0, rank1)
                tile = _a_tile(block_base, ranks, width, columns, columns < width)
                tl.store(t_ptr + row * stride_t + block_first + ranks, tl.sum(tile * h[None, :], axis=1))


@triton.jit
def _silu_mul_shrink_kernel(
    gate_ptr, up_ptr, a0, a1, a2, y_ptr, t_ptr, partial_ptr, count_ptr,
    width, span, rank0, rank1, stride_gate, stride_up, stride_y, stride_t,
    OUT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(PDL)
    allow_next_kernel(PDL)
    row = tl.program_id(0)
    block = tl.program_id(1)
    first = block * BLOCK_R
    low = tl.program_id(2) * span
    high = tl.minimum(low + span, width)
    columns = tl.arange(0, BLOCK_K)
    base = _adapter_rows(a0, a1, a2, first, width, rank0, rank1)
    ranks = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for start in range(low, high, BLOCK_K):
        offsets = start + columns
        inside = offsets < high
        gate = tl.load(gate_ptr + row * stride_gate + offsets, mask=inside, other=0.0).to(tl.float32)
        up = tl.load(up_ptr + row * stride_up + offsets, mask=inside, other=0.0).to(tl.float32)
        activated = _round(gate / (1.0 + tl.exp(-gate)), OUT).to(tl.float32)
        y = _round(activated * up, OUT)
        if block == 0:
            tl.store(y_ptr + row * stride_y + offsets, y, mask=inside)
        a = _a_tile(base, ranks, width, offsets, inside)
        acc += tl.sum(a * y.to(tl.float32)[None, :], axis=1)
    slot = row * tl.num_programs(1) + block
    targets = t_ptr + row * stride_t + first + ranks
    _store_splits(acc, targets, None, partial_ptr, count_ptr, slot, tl.program_id(2), ranks, BLOCK_R, SPLITS)


@triton.jit
def _silu_mul_shrink_rows_kernel(
    gate_ptr, up_ptr, a0, a1, a2, y_ptr, t_ptr, partial_ptr, count_ptr,
    rows, width, span, rank0, rank1, stride_gate, stride_up, stride_y, stride_t,
    OUT: tl.constexpr, ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(PDL)
    allow_next_kernel(PDL)
    row_ids = tl.arange(0, ROWS)
    live = row_ids < rows
    first = tl.program_id(0) * BLOCK_R
    base = _adapter_rows(a0, a1, a2, first, width, rank0, rank1)
    ranks = tl.arange(0, BLOCK_R)
    low = tl.program_id(1) * span
    high = tl.minimum(low + span, width)
    acc = tl.zeros([ROWS, BLOCK_R, BLOCK_K], dtype=tl.float32)
    for start in range(low, high, BLOCK_K):
        offsets = start + tl.arange(0, BLOCK_K)
        inside = offsets < high
        mask = live[:, None] & inside[None, :]
        gate = tl.load(gate_ptr + row_ids[:, None] * stride_gate + offsets[None, :], mask=mask, other=0.0)
        up = tl.load(up_ptr + row_ids[:, None] * stride_up + offsets[None, :], mask=mask, other=0.0)
        gate = gate.to(tl.float32)
        activated = _round(gate / (1.0 + tl.exp(-gate)), OUT).to(tl.float32)
        y = _round(activated * up.to(tl.float32), OUT)
        if tl.program_id(0) == 0:
            tl.store(y_ptr + row_ids[:, None] * stride_y + offsets[None, :], y, mask=mask)
        a = _a_tile(base, ranks, width, offsets, inside)
        acc += y.to(tl.float32)[:, None, :] * a[None, :, :]
    tile = row_ids[:, None] * BLOCK_R + ranks[None, :]
    targets = t_ptr + row_ids[:, None] * stride_t + first + ranks[None, :]
    part = tl.sum(acc, axis=2)
    slot, split = tl.program_id(0), tl.program_id(1)
    _store_splits(part, targets, live[:, None], partial_ptr, count_ptr, slot, split, tile, ROWS * BLOCK_R, SPLITS)


@triton.jit
def _shrink_kernel(
    x_ptr, a0, a1, a2, t_ptr, width, rank0, rank1, stride_x, stride_t,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ONE_STEP: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """``t[row, first : first + BLOCK_R] = x[row] @ A[first : first + BLOCK_R].T``: one row and one rank block a
    program, the row in steps of ``BLOCK_K`` (with ``ONE_STEP`` in one, its A tile loaded before the wait)."""
    row = tl.program_id(0)
    first = tl.program_id(1) * BLOCK_R
    columns = tl.arange(0, BLOCK_K)
    base = _adapter_rows(a0, a1, a2, first, width, rank0, rank1)
    ranks = tl.arange(0, BLOCK_R)
    if ONE_STEP:  # no kernel of the step writes A: launched with PDL, its load overlaps the kernel before
        a = _a_tile(base, ranks, width, columns, columns < width)
    wait_for_previous_kernel(PDL)
    allow_next_kernel(PDL)
    x_row = x_ptr + row * stride_x
    if ONE_STEP:
        x = tl.load(x_row + columns, mask=columns < width, other=0.0).to(tl.float32)
        acc = tl.sum(a * x[None, :], axis=1)
    else:
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for start in range(0, width, BLOCK_K):
            offsets = start + columns
            inside = offsets < width
            x = tl.load(x_row + offsets, mask=inside, other=0.0).to(tl.float32)
            acc += tl.sum(_a_tile(base, ranks, width, offsets, inside) * x[None, :], axis=1)
    tl.store(t_ptr + row * stride_t + first + ranks, acc)


def block_k(width: int, limit: int = MAX_BLOCK_K) -> int:
    return min(triton.next_power_of_2(width), limit)


def rank_block(
    rows: int, ranks: list[int], columns: int = MAX_BLOCK_K, tile: int | None = None, programs: int | None = None
) -> int:
    """Rows of A per program: the largest of 4, 2, 1 that divides every rank, keeps the A tile within ``tile``
    elements (`TILE` unless given) for steps of ``columns``, and still gives ``programs`` programs (`TARGET_PROGRAMS`
    unless given)."""
    total, tile = sum(ranks), TILE if tile is None else tile
    programs = TARGET_PROGRAMS if programs is None else programs
    for block in (4, 2):
        fits = block * columns <= tile and all(r % block == 0 for r in ranks)
        if fits and rows * total // block >= programs:
            return block
    return 1


def _warps(columns: int, most: int = 8) -> int:
    return max(1, min(most, columns // 512))


def _adapter_args(lora_a: list[torch.Tensor]) -> tuple:
    padded = list(lora_a) + [lora_a[0]] * (3 - len(lora_a))
    ranks = [a.shape[0] for a in lora_a] + [0] * (3 - len(lora_a))
    return padded, ranks[0], ranks[1]


def takes_rows(rows: int) -> bool:
    """Whether a SiLU·up launch of ``rows`` rows takes the kernel over every row (`ROWS_FROM` to `ROWS_MAX` rows)."""
    return ROWS_FROM <= rows <= ROWS_MAX


def rows_layout(rows: int, width: int, ranks: list[int], programs: int = ROWS_PROGRAMS) -> tuple[int, int, int, int]:
    """(ROWS, BLOCK_R, BLOCK_K, span) of a launch over every row: steps whose ``[ROWS, BLOCK_K]`` input tile takes at
    most half of `ROWS_REGISTERS` per thread (16 rows of 1,024 columns spilled on sm_90), the widest rank block (of 8,
    4, 2, 1) that divides every rank and keeps the accumulator within `ROWS_REGISTERS`, and spans of whole steps, as
    many as keep the launch at about ``programs`` programs."""
    padded = triton.next_power_of_2(rows)
    budget = ROWS_REGISTERS * 32 * ROWS_WARPS
    columns = min(ROWS_BLOCK_K, triton.next_power_of_2(width), budget // 2 // padded)
    block = next(
        b for b in (8, 4, 2, 1) if b == 1 or (padded * b * columns <= budget and all(r % b == 0 for r in ranks))
    )
    steps = triton.cdiv(width, columns)
    splits = max(1, min(steps, programs // (sum(ranks) // block)))
    return padded, block, columns, triton.cdiv(steps, splits) * columns


def _rows_args(rows: int, width: int, lora_a: list[torch.Tensor], t: torch.Tensor) -> tuple:
    """(grid, span, scratch partials, counters, constexprs) of a launch over every row."""
    padded, block, columns, span = rows_layout(rows, width, [a.shape[0] for a in lora_a])
    blocks, splits = t.shape[1] // block, triton.cdiv(width, span)
    partials = t.new_empty(blocks * splits * padded * block) if splits > 1 else t
    counters = arrival_counters(t.device, blocks) if splits > 1 else t
    meta = dict(ROWS=padded, BLOCK_R=block, BLOCK_K=columns, SPLITS=splits, num_warps=ROWS_WARPS)
    return (blocks, splits), span, partials, counters, meta


def norm_passes(rows: int, blocks: int, columns: int, multiprocessors: int) -> int:
    """Rank blocks each program of a one-step norm-shrink launch of ``rows x blocks`` programs takes in turn: one where
    the launch fits one wave (``multiprocessors`` programs, twice as many for steps narrower than
    `NORM_WIDE_COLUMNS`); else the fewest that divide ``blocks`` and bring the launch within ``multiprocessors``
    programs (a program of several passes fills a multiprocessor's registers), or all ``blocks`` where none does."""
    per_multiprocessor = 1 if columns >= NORM_WIDE_COLUMNS else 2
    if not NORM_PASSES or multiprocessors <= 0 or rows * blocks <= per_multiprocessor * multiprocessors:
        return 1
    fits = (p for p in range(1, blocks + 1) if blocks % p == 0 and rows * blocks // p <= multiprocessors)
    return next(fits, blocks)


def _multiprocessors(device: torch.device) -> int:
    """`NORM_WAVE_PROGRAMS`, else the GPU's multiprocessors (0 off a GPU: no passes on the CPU interpreter)."""
    if NORM_WAVE_PROGRAMS or device.type != "cuda":
        return NORM_WAVE_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _norm_layout(groups: int, width: int, lora_a: list[torch.Tensor]) -> tuple[int, int]:
    """(columns a step, A rows a program) of the norm shrinks' layout for ``groups`` programs along the rows: steps
    of up to `NORM_MAX_BLOCK_K` columns, rank blocks within `NORM_TILE` for `NORM_TARGET_PROGRAMS` programs."""
    columns = block_k(width, NORM_MAX_BLOCK_K)
    return columns, rank_block(groups, [a.shape[0] for a in lora_a], columns, NORM_TILE, NORM_TARGET_PROGRAMS)


def norm_shrink(x, residual, weight, eps, lora_a, s, h, t) -> None:
    """Fill ``h`` (and ``s = x + residual`` where ``residual`` is given) and ``t`` (see `fused_shrink`)."""
    rows, width = x.shape
    per_program = min(NORM_ROWS, rows)
    groups = triton.cdiv(rows, per_program)
    columns, block = _norm_layout(groups, width, lora_a)
    (a0, a1, a2), rank0, rank1 = _adapter_args(lora_a)
    has_residual = residual is not None
    residual = residual if has_residual else x
    s = s if has_residual else h
    one_step = bool(NORM_ONE_STEP) and width <= columns
    blocks = t.shape[1] // block
    passes = norm_passes(groups, blocks, columns, _multiprocessors(x.device)) if one_step and per_program == 1 else 1
    _norm_shrink_kernel[(groups, blocks // passes)](
        x, residual, weight, a0, a1, a2, s, h, t, rows, width, rank0, rank1, eps,
        x.stride(0), residual.stride(0), s.stride(0), h.stride(0), t.stride(0),
        HAS_RESIDUAL=has_residual, OUT=_DTYPES[h.dtype], BLOCK_R=block, BLOCK_K=columns,
        ROWS=per_program, ONE_STEP=one_step, PASSES=passes, num_warps=_warps(columns, NORM_MAX_WARPS),
        **launch_options(x.device, rows),
    )  # fmt: skip


def silu_mul_shrink(gate, up, lora_a, y, t) -> None:
    """Fill ``y = silu(gate) * up`` and ``t`` (see `fused_shrink`). Few (row, rank block) programs split the row
    (7B down at one row: 32 programs of 18,944 columns each would be chains of dependent loads)."""
    rows, width = gate.shape
    (a0, a1, a2), rank0, rank1 = _adapter_args(lora_a)
    if takes_rows(rows):
        grid, span, partials, counters, meta = _rows_args(rows, width, lora_a, t)
        _silu_mul_shrink_rows_kernel[grid](
            gate, up, a0, a1, a2, y, t, partials, counters, rows, width, span, rank0, rank1,
            gate.stride(0), up.stride(0), y.stride(0), t.stride(0), OUT=_DTYPES[y.dtype], **meta,
            **launch_options(gate.device, rows),
        )  # fmt: skip
        return
    block = rank_block(rows, [a.shape[0] for a in lora_a], block_k(width))
    blocks = t.shape[1] // block
    splits = max(1, min(triton.cdiv(TARGET_PROGRAMS, rows * blocks), triton.cdiv(width, MIN_SPAN)))
    span = triton.cdiv(triton.cdiv(width, splits), SPAN_ALIGN) * SPAN_ALIGN
    splits = triton.cdiv(width, span)
    columns = block_k(span)
    partials = t.new_empty(rows * blocks * splits * block) if splits > 1 else t
    counters = arrival_counters(t.device, rows * blocks) if splits > 1 else t
    _silu_mul_shrink_kernel[(rows, blocks, splits)](
        gate, up, a0, a1, a2, y, t, partials, counters, width, span, rank0, rank1,
        gate.stride(0), up.stride(0), y.stride(0), t.stride(0),
        OUT=_DTYPES[y.dtype], BLOCK_R=block, BLOCK_K=columns, SPLITS=splits, num_warps=_warps(columns),
        **launch_options(gate.device, rows),
    )  # fmt: skip


def shrink(x, lora_a, t) -> None:
    """Fill ``t = x @ A.T`` (fp32, the A matrices' products side by side) for ``x[M, K]`` whose rows no fused kernel
    makes (the o projection's input, from the attention): the norm shrinks' layout (`_norm_layout`) without the
    norm."""
    rows, width = x.shape
    columns, block = _norm_layout(rows, width, lora_a)
    (a0, a1, a2), rank0, rank1 = _adapter_args(lora_a)
    _shrink_kernel[(rows, t.shape[1] // block)](
        x, a0, a1, a2, t, width, rank0, rank1, x.stride(0), t.stride(0),
        BLOCK_R=block, BLOCK_K=columns, ONE_STEP=width <= columns, num_warps=_warps(columns, NORM_MAX_WARPS),
        **launch_options(x.device, rows),
    )  # fmt: skip
