"""The Triton kernels of `fused_shrink` (kept apart: Triton is optional, and only launching needs it).

Each program takes every row of the step (at most `MAX_ROWS`), ``BLOCK_R`` rows of the concatenated LoRA A matrices
(all in one adapter: ``BLOCK_R`` divides every rank) and one span of ``BLOCK_K`` columns. It loads its A tile once and,
row after row, makes the rows' elementwise part of that span (cheap: a few KB from L2), stores it from the programs
of the first rank block only, and reduces ``part · A[j]`` over the span in fp32. The spans' partial sums go to a
scratch buffer; the last program of a rank block to arrive adds them in span order (the same sum on every launch)
and resets its arrival counter, so graph replays need no memset. The norm's statistics need whole rows: each program
reads its rows' full width once for them (rows of a few KB, from L2).

Measured on the H200 (7B, 2026-12-02) before this layout, with one program per (row, rank block): every row's
program re-read the A rows, so at 8 rows the SiLU·up shrink took 12 µs and the norm shrinks 4.8 µs per call
(2.4 MB and 1.4 MB of A read eight times), against 5.0 and 3.5 µs at one row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..nvfp4.cuda_mma import arrival_counters


_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
MAX_ROWS = 16
"""Most rows one launch takes (`fused_decode.FUSED_SHRINK_ROWS` stays at or below it): the row loop is unrolled."""
MAX_BLOCK_K = 1024
"""Columns per program: one span, loaded in one step (no chain of dependent loads within a program)."""
TILE = 8192
"""A-tile elements per program (``BLOCK_R x BLOCK_K``): bounds the registers (32 per thread at 8 warps)."""
MIN_PROGRAMS = 64
"""Fewest programs a launch should make (by smaller rank blocks) to spread over the GPU's multiprocessors."""
NORM_BLOCK = 4096
"""Columns per step of the norm statistics' pass over a whole row (a 7B row, 3,584, in one)."""


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
def _norm_input(x_row, res_row, offsets, inside, HAS_RESIDUAL: tl.constexpr, OUT: tl.constexpr):
    """The norm's input in fp32: ``x``, or ``x + residual`` rounded to OUT as the eager add rounds it."""
    x = tl.load(x_row + offsets, mask=inside, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = _round(x + tl.load(res_row + offsets, mask=inside, other=0.0).to(tl.float32), OUT).to(tl.float32)
    return x


@triton.jit
def _row_width(width, rows, m):
    """``width`` for a real row ``m`` (< ``rows``), else 0 (no column in range): an integer mask bound."""
    return tl.minimum(width, (rows - m) * width)


@triton.jit
def _finish(acc, t_ptr, partial_ptr, count_ptr, rows, stride_t, first,
            ROWS: tl.constexpr, BLOCK_R: tl.constexpr, SPLITS: tl.constexpr):  # fmt: skip
    """Store this program's ``acc[ROWS, BLOCK_R]`` into ``t`` (one span), or leave it as the span's partial and, in the
    last program of the rank block to arrive, add the partials in span order into ``t`` and reset the counter."""
    row_ids = tl.arange(0, ROWS)
    ranks = tl.arange(0, BLOCK_R)
    targets = t_ptr + row_ids[:, None] * stride_t + first + ranks[None, :]
    live = (row_ids < rows)[:, None]
    if SPLITS == 1:
        tl.store(targets, acc, mask=live)
    else:
        block = tl.program_id(0)
        tile = row_ids[:, None] * BLOCK_R + ranks[None, :]
        tl.store(partial_ptr + (block * SPLITS + tl.program_id(1)) * ROWS * BLOCK_R + tile, acc)
        tl.debug_barrier()  # every thread's partial is written before the counter moves
        arrived = tl.atomic_add(count_ptr + block, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            total = tl.zeros([ROWS, BLOCK_R], dtype=tl.float32)
            for split in range(SPLITS):
                total += tl.load(partial_ptr + (block * SPLITS + split) * ROWS * BLOCK_R + tile, cache_modifier=".cg")
            tl.store(targets, total, mask=live)
            tl.atomic_xchg(count_ptr + block, 0, sem="relaxed", scope="gpu")


@triton.jit
def _norm_shrink_kernel(
    x_ptr, res_ptr, w_ptr, a0, a1, a2, s_ptr, h_ptr, t_ptr, partial_ptr, count_ptr,
    rows, width, rank0, rank1, eps, stride_x, stride_res, stride_s, stride_h, stride_t,
    HAS_RESIDUAL: tl.constexpr, OUT: tl.constexpr, ROWS: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, NORM_K: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    first = tl.program_id(0) * BLOCK_R
    offsets = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    inside = offsets < width
    row_ids = tl.arange(0, ROWS)
    # the rows' inverse RMS over their whole width (torch.rsqrt, as the eager and inductor norms)
    inverses = tl.zeros([ROWS], dtype=tl.float32)
    for m in tl.static_range(ROWS):
        squares = tl.zeros([NORM_K], dtype=tl.float32)
        for start in range(0, width, NORM_K):
            columns = start + tl.arange(0, NORM_K)
            ok = columns < _row_width(width, rows, m)
            x = _norm_input(x_ptr + m * stride_x, res_ptr + m * stride_res, columns, ok, HAS_RESIDUAL, OUT)
            squares += x * x
        inverses = tl.where(row_ids == m, tl.rsqrt(tl.sum(squares, axis=0) / width + eps), inverses)
    a = tl.load(_adapter_rows(a0, a1, a2, first, width, rank0, rank1) + tl.arange(0, BLOCK_R)[:, None] * width
                + offsets[None, :], mask=inside[None, :], other=0.0)  # fmt: skip
    weight = tl.load(w_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    acc = tl.zeros([ROWS, BLOCK_R], dtype=tl.float32)
    for m in tl.static_range(ROWS):
        ok = offsets < _row_width(width, rows, m)
        x = _norm_input(x_ptr + m * stride_x, res_ptr + m * stride_res, offsets, ok, HAS_RESIDUAL, OUT)
        if HAS_RESIDUAL and tl.program_id(0) == 0:
            tl.store(s_ptr + m * stride_s + offsets, x.to(OUT), mask=ok)  # exact: x holds a rounded sum
        inverse = tl.sum(tl.where(row_ids == m, inverses, 0.0), axis=0)
        h = _round(weight * _round(x * inverse, OUT).to(tl.float32), OUT)
        if tl.program_id(0) == 0:  # the first rank block's programs write the elementwise part
            tl.store(h_ptr + m * stride_h + offsets, h, mask=ok)
        part = tl.sum(a * h.to(tl.float32)[None, :], axis=1)
        acc = tl.where(row_ids[:, None] == m, part[None, :], acc)
    _finish(acc, t_ptr, partial_ptr, count_ptr, rows, stride_t, first, ROWS, BLOCK_R, SPLITS)


@triton.jit
def _silu_mul_shrink_kernel(
    gate_ptr, up_ptr, a0, a1, a2, y_ptr, t_ptr, partial_ptr, count_ptr,
    rows, width, rank0, rank1, stride_gate, stride_up, stride_y, stride_t,
    OUT: tl.constexpr, ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    first = tl.program_id(0) * BLOCK_R
    offsets = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    inside = offsets < width
    row_ids = tl.arange(0, ROWS)
    a = tl.load(_adapter_rows(a0, a1, a2, first, width, rank0, rank1) + tl.arange(0, BLOCK_R)[:, None] * width
                + offsets[None, :], mask=inside[None, :], other=0.0)  # fmt: skip
    acc = tl.zeros([ROWS, BLOCK_R], dtype=tl.float32)
    for m in tl.static_range(ROWS):
        ok = offsets < _row_width(width, rows, m)
        gate = tl.load(gate_ptr + m * stride_gate + offsets, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(up_ptr + m * stride_up + offsets, mask=ok, other=0.0).to(tl.float32)
        activated = _round(gate / (1.0 + tl.exp(-gate)), OUT).to(tl.float32)
        y = _round(activated * up, OUT)
        if tl.program_id(0) == 0:
            tl.store(y_ptr + m * stride_y + offsets, y, mask=ok)
        part = tl.sum(a * y.to(tl.float32)[None, :], axis=1)
        acc = tl.where(row_ids[:, None] == m, part[None, :], acc)
    _finish(acc, t_ptr, partial_ptr, count_ptr, rows, stride_t, first, ROWS, BLOCK_R, SPLITS)


def block_k(width: int) -> int:
    """Columns per program for rows of ``width``."""
    return min(triton.next_power_of_2(width), MAX_BLOCK_K)


def rank_block(ranks: list[int], columns: int = MAX_BLOCK_K, spans: int = 1) -> int:
    """Rows of A per program: of 8, 4, 2, 1 those that divide every rank and keep the A tile of ``columns`` within
    `TILE`, the largest that still makes `MIN_PROGRAMS` programs with ``spans`` spans per row (else the smallest)."""
    fitting = [b for b in (8, 4, 2, 1) if b * columns <= TILE and all(r % b == 0 for r in ranks)]
    return next((b for b in fitting if sum(ranks) // b * spans >= MIN_PROGRAMS), fitting[-1])


def _padded_rows(rows: int) -> int:
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"the fused shrinks take 1 to {MAX_ROWS} rows per launch, not {rows}")
    return triton.next_power_of_2(rows)


def _warps(columns: int) -> int:
    return max(1, min(8, columns // 128))


def _adapter_args(lora_a: list[torch.Tensor]) -> tuple:
    padded = list(lora_a) + [lora_a[0]] * (3 - len(lora_a))
    ranks = [a.shape[0] for a in lora_a] + [0] * (3 - len(lora_a))
    return padded, ranks[0], ranks[1]


def _grid(rows: int, width: int, lora_a: list[torch.Tensor], t: torch.Tensor) -> tuple:
    """(launch grid, constexprs, scratch partials, counters) shared by both launchers."""
    columns = block_k(width)
    splits = triton.cdiv(width, columns)
    block = rank_block([a.shape[0] for a in lora_a], columns, splits)
    blocks, padded = t.shape[1] // block, _padded_rows(rows)
    partials = t.new_empty(blocks * splits * padded * block) if splits > 1 else t
    counters = arrival_counters(t.device, blocks) if splits > 1 else t
    meta = dict(ROWS=padded, BLOCK_R=block, BLOCK_K=columns, SPLITS=splits, num_warps=_warps(columns))
    return (blocks, splits), meta, partials, counters


def norm_shrink(x, residual, weight, eps, lora_a, s, h, t) -> None:
    """Fill ``h`` (and ``s = x + residual`` where ``residual`` is given) and ``t`` (see `fused_shrink`)."""
    rows, width = x.shape
    grid, meta, partials, counters = _grid(rows, width, lora_a, t)
    (a0, a1, a2), rank0, rank1 = _adapter_args(lora_a)
    has_residual = residual is not None
    residual = residual if has_residual else x
    s = s if has_residual else h
    _norm_shrink_kernel[grid](
        x, residual, weight, a0, a1, a2, s, h, t, partials, counters, rows, width, rank0, rank1, eps,
        x.stride(0), residual.stride(0), s.stride(0), h.stride(0), t.stride(0),
        HAS_RESIDUAL=has_residual, OUT=_DTYPES[h.dtype], NORM_K=min(triton.next_power_of_2(width), NORM_BLOCK),
        **meta,
    )  # fmt: skip


def silu_mul_shrink(gate, up, lora_a, y, t) -> None:
    """Fill ``y = silu(gate) * up`` and ``t`` (see `fused_shrink`); ``gate`` and ``up`` rows may be strided (the
    halves of a fused gate/up output)."""
    rows, width = gate.shape
    grid, meta, partials, counters = _grid(rows, width, lora_a, t)
    (a0, a1, a2), rank0, rank1 = _adapter_args(lora_a)
    _silu_mul_shrink_kernel[grid](
        gate, up, a0, a1, a2, y, t, partials, counters, rows, width, rank0, rank1,
        gate.stride(0), up.stride(0), y.stride(0), t.stride(0), OUT=_DTYPES[y.dtype], **meta,
    )  # fmt: skip
