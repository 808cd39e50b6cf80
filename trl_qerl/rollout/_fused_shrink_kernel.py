"""The Triton kernels of `fused_shrink` (kept apart: Triton is optional, and only launching needs it).

Each program takes every row of the step (at most `ROWS`, padded with masked rows), ``BLOCK_R`` rows of one LoRA A
matrix and one span of ``BLOCK_K`` columns. It makes the rows' elementwise part of that span as one ``[ROWS,
BLOCK_K]`` tile (stored by the programs of the first rank block only) and multiplies it with its A tile on the tensor
cores in 3xTF32 (``tl.dot(..., input_precision="tf32x3")``: each fp32 operand split into two TF32 parts, three
products, fp32-accurate to ~1e-6), so that A is read once per step and no row needs a reduction of its own. The spans'
``[ROWS, BLOCK_R]`` partial sums go to a scratch buffer; the last program of a rank block to arrive adds them in span
order (the same sum on every launch) and resets its arrival counter, so graph replays need no memset. The norm's
statistics need whole rows: every program reads its rows' full width once for them (a few KB per row, from L2).

Measured on the H200 (7B, 2026-12-02; `benchmarks/fused_decode/multi_row_shrink_2026-12-02/`): one program per (row,
rank block) re-read A for every row (SiLU·up shrink 12 µs and norm shrinks 4.8 µs per call at 8 rows, against 5.0
and 3.5 at one row); programs over every row that reduced each row on its own (``tl.sum`` across warps, one row
after another) were slower still at 8 and 16 rows (norm shrinks 13.1 / 29.8 µs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..nvfp4.cuda_mma import arrival_counters


_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
ROWS = 16
"""Rows of every launch's tile (the tensor cores' smallest M): steps of fewer rows mask the rest, more are refused
(`fused_decode.FUSED_SHRINK_ROWS` stays at or below it)."""
BLOCK_R = 16
"""A rows per program (the tensor cores' smallest N): an adapter of another rank masks the rest of its last block."""
MAX_BLOCK_K = 512
"""Columns per program (one span, loaded in one step: no chain of dependent loads within a program)."""
NORM_BLOCK = 512
"""Columns per step of the norm statistics' pass over whole rows (``[ROWS, NORM_BLOCK]`` at a time)."""


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
def _a_tile(a0, a1, a2, offsets, inside, width, rank0, rank1, rank2, blocks0, blocks1, BLOCK_R: tl.constexpr):
    """This program's ``[BLOCK_R, BLOCK_K]`` tile of A (rows past its adapter's rank read as zeros) and the column
    of ``t`` where its first row's products go."""
    block = tl.program_id(0)
    if block < blocks0:
        local = block * BLOCK_R
        base, rank, column = a0, rank0, local
    elif block < blocks0 + blocks1:
        local = (block - blocks0) * BLOCK_R
        base, rank, column = a1, rank1, rank0 + local
    else:
        local = (block - blocks0 - blocks1) * BLOCK_R
        base, rank, column = a2, rank2, rank0 + rank1 + local
    ranks = tl.arange(0, BLOCK_R)
    mask = (ranks < rank - local)[:, None] & inside[None, :]
    tile = tl.load(base + (local + ranks)[:, None] * width + offsets[None, :], mask=mask, other=0.0)
    return tile, column, rank - local


@triton.jit
def _norm_input(x_ptr, res_ptr, rows_x, rows_res, offsets, mask, HAS_RESIDUAL: tl.constexpr, OUT: tl.constexpr):
    """The norm's input in fp32 for a ``[ROWS, columns]`` tile: ``x``, or ``x + residual`` rounded to OUT as the
    eager add rounds it."""
    x = tl.load(x_ptr + rows_x + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = _round(x + tl.load(res_ptr + rows_res + offsets, mask=mask, other=0.0).to(tl.float32), OUT)
        x = x.to(tl.float32)
    return x


@triton.jit
def _finish(acc, t_ptr, partial_ptr, count_ptr, rows, stride_t, column, valid,
            ROWS: tl.constexpr, BLOCK_R: tl.constexpr, SPLITS: tl.constexpr):  # fmt: skip
    """Store this program's ``acc[ROWS, BLOCK_R]`` into ``t`` (one span), or leave it as the span's partial and, in the
    last program of the rank block to arrive, add the partials in span order into ``t`` and reset the counter."""
    row_ids = tl.arange(0, ROWS)
    ranks = tl.arange(0, BLOCK_R)
    targets = t_ptr + row_ids[:, None] * stride_t + column + ranks[None, :]
    live = (row_ids < rows)[:, None] & (ranks < valid)[None, :]
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
    rows, width, rank0, rank1, rank2, blocks0, blocks1, eps, stride_x, stride_res, stride_s, stride_h, stride_t,
    HAS_RESIDUAL: tl.constexpr, OUT: tl.constexpr, ROWS: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, NORM_K: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    row_ids = tl.arange(0, ROWS)
    live = row_ids < rows
    rows_x, rows_res = row_ids[:, None] * stride_x, row_ids[:, None] * stride_res
    # the rows' inverse RMS over their whole width (torch.rsqrt, as the eager and inductor norms)
    squares = tl.zeros([ROWS, NORM_K], dtype=tl.float32)
    for start in range(0, width, NORM_K):
        columns = start + tl.arange(0, NORM_K)
        mask = live[:, None] & (columns < width)[None, :]
        x = _norm_input(x_ptr, res_ptr, rows_x, rows_res, columns[None, :], mask, HAS_RESIDUAL, OUT)
        squares += x * x
    inverse = tl.rsqrt(tl.sum(squares, axis=1) / width + eps)
    offsets = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    inside = offsets < width
    a, column, valid = _a_tile(a0, a1, a2, offsets, inside, width, rank0, rank1, rank2, blocks0, blocks1, BLOCK_R)
    mask = live[:, None] & inside[None, :]
    x = _norm_input(x_ptr, res_ptr, rows_x, rows_res, offsets[None, :], mask, HAS_RESIDUAL, OUT)
    if HAS_RESIDUAL and tl.program_id(0) == 0:
        tl.store(s_ptr + row_ids[:, None] * stride_s + offsets[None, :], x.to(OUT), mask=mask)  # exact: rounded sum
    weight = tl.load(w_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    h = _round(weight[None, :] * _round(x * inverse[:, None], OUT).to(tl.float32), OUT)
    if tl.program_id(0) == 0:  # the first rank block's programs write the elementwise part
        tl.store(h_ptr + row_ids[:, None] * stride_h + offsets[None, :], h, mask=mask)
    acc = tl.dot(h.to(tl.float32), tl.trans(a), input_precision="tf32x3")
    _finish(acc, t_ptr, partial_ptr, count_ptr, rows, stride_t, column, valid, ROWS, BLOCK_R, SPLITS)


@triton.jit
def _silu_mul_shrink_kernel(
    gate_ptr, up_ptr, a0, a1, a2, y_ptr, t_ptr, partial_ptr, count_ptr,
    rows, width, rank0, rank1, rank2, blocks0, blocks1, stride_gate, stride_up, stride_y, stride_t,
    OUT: tl.constexpr, ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    row_ids = tl.arange(0, ROWS)
    offsets = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    inside = offsets < width
    a, column, valid = _a_tile(a0, a1, a2, offsets, inside, width, rank0, rank1, rank2, blocks0, blocks1, BLOCK_R)
    mask = (row_ids < rows)[:, None] & inside[None, :]
    gate = tl.load(gate_ptr + row_ids[:, None] * stride_gate + offsets[None, :], mask=mask, other=0.0)
    up = tl.load(up_ptr + row_ids[:, None] * stride_up + offsets[None, :], mask=mask, other=0.0)
    gate = gate.to(tl.float32)
    activated = _round(gate / (1.0 + tl.exp(-gate)), OUT).to(tl.float32)
    y = _round(activated * up.to(tl.float32), OUT)
    if tl.program_id(0) == 0:
        tl.store(y_ptr + row_ids[:, None] * stride_y + offsets[None, :], y, mask=mask)
    acc = tl.dot(y.to(tl.float32), tl.trans(a), input_precision="tf32x3")
    _finish(acc, t_ptr, partial_ptr, count_ptr, rows, stride_t, column, valid, ROWS, BLOCK_R, SPLITS)


def block_k(width: int) -> int:
    """Columns per program for rows of ``width`` (at least 16, the tensor cores' K)."""
    return max(16, min(triton.next_power_of_2(width), MAX_BLOCK_K))


def _launch_args(rows: int, width: int, lora_a: list[torch.Tensor], t: torch.Tensor) -> tuple:
    """(grid, adapter arguments: the three A matrices, their ranks and the first two's block counts; scratch
    partials, counters, constexprs) shared by both launchers. Fewer than three adapters repeat the first with rank 0."""
    if not 1 <= rows <= ROWS:
        raise ValueError(f"the fused shrinks take 1 to {ROWS} rows per launch, not {rows}")
    columns = block_k(width)
    splits = triton.cdiv(width, columns)
    ranks = [a.shape[0] for a in lora_a] + [0] * (3 - len(lora_a))
    counts = [triton.cdiv(r, BLOCK_R) for r in ranks]
    blocks = sum(counts)
    matrices = list(lora_a) + [lora_a[0]] * (3 - len(lora_a))
    adapters = (*matrices, *ranks, counts[0], counts[1])
    partials = t.new_empty(blocks * splits * ROWS * BLOCK_R) if splits > 1 else t
    counters = arrival_counters(t.device, blocks) if splits > 1 else t
    meta = dict(ROWS=ROWS, BLOCK_R=BLOCK_R, BLOCK_K=columns, SPLITS=splits, num_warps=4)
    return (blocks, splits), adapters, partials, counters, meta


def norm_shrink(x, residual, weight, eps, lora_a, s, h, t) -> None:
    """Fill ``h`` (and ``s = x + residual`` where ``residual`` is given) and ``t`` (see `fused_shrink`)."""
    rows, width = x.shape
    grid, adapters, partials, counters, meta = _launch_args(rows, width, lora_a, t)
    has_residual = residual is not None
    residual = residual if has_residual else x
    s = s if has_residual else h
    _norm_shrink_kernel[grid](
        x, residual, weight, *adapters[:3], s, h, t, partials, counters, rows, width, *adapters[3:], eps,
        x.stride(0), residual.stride(0), s.stride(0), h.stride(0), t.stride(0),
        HAS_RESIDUAL=has_residual, OUT=_DTYPES[h.dtype], NORM_K=min(triton.next_power_of_2(width), NORM_BLOCK),
        **meta,
    )  # fmt: skip


def silu_mul_shrink(gate, up, lora_a, y, t) -> None:
    """Fill ``y = silu(gate) * up`` and ``t`` (see `fused_shrink`); ``gate`` and ``up`` rows may be strided (the
    halves of a fused gate/up output)."""
    rows, width = gate.shape
    grid, adapters, partials, counters, meta = _launch_args(rows, width, lora_a, t)
    _silu_mul_shrink_kernel[grid](
        gate, up, *adapters[:3], y, t, partials, counters, rows, width, *adapters[3:],
        gate.stride(0), up.stride(0), y.stride(0), t.stride(0), OUT=_DTYPES[y.dtype], **meta,
    )  # fmt: skip
