"""The Triton kernels of `fused_shrink` (kept apart: Triton is optional, and only launching needs it).

Each program takes one row and ``BLOCK_R`` rows of the concatenated LoRA A matrices (all in one adapter: ``BLOCK_R``
divides every rank). It recomputes the row's elementwise part (cheap: the row is a few KB, read from L2), stores it
only from the programs of the first rank block, and reduces ``part · A[j]`` over the row in fp32.

From `TILE_FROM_ROWS` rows a second pair of kernels takes every row of the launch at once (at most `TILE_ROWS`, the
rest masked): each program owns `TILE_RANKS` rows of one A matrix and one span of columns, and walks the span in
steps of `TILE_STEP` columns, making the rows' elementwise part of the step as a ``[TILE_ROWS, TILE_STEP]`` tile and
multiplying it with the step's A tile on the tensor cores in 3xTF32 (``input_precision="tf32x3"``: fp32-accurate to
~1e-6; the bf16 parts are exact in TF32), accumulating in registers. So A is read once per launch, not once per row.
The spans' partial sums go to scratch and the last program of a rank block to arrive adds them in span order.
Measured on the H200 (7B, 2026-12-02): one 512-column step per program spilled (7,960 bytes of stack per thread,
228 µs per SiLU·up call); 64-column steps need no stack (checked offline, `tests/test_fused_shrink.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..nvfp4.cuda_mma import arrival_counters


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
TILE_ROWS = 16
"""Rows of the tile kernels' launches (the tensor cores' smallest M): fewer are masked, more are refused."""
TILE_RANKS = 16
"""A rows per tile-kernel program (the tensor cores' smallest N); a rank that is not a multiple masks its last block."""
TILE_STEP = 64
"""Columns per step of the tile kernels: the widest with no stack (compiled for sm_90: 512 spills 7,960 bytes)."""
TILE_NORM_STEP = 128
"""Columns per step of the tile norm's statistics pass over whole rows."""
TILE_FROM_ROWS = 2
"""Launches of this many rows and more take the tile kernels (fewer: one program per row and rank block)."""
TILE_PROGRAMS = 132
"""Programs a tile-kernel launch aims at (one wave of a 132-multiprocessor GPU): rank blocks x spans."""
TILE_WARPS = 4
"""Warps per tile-kernel program."""


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
def _norm_shrink_kernel(
    x_ptr, res_ptr, w_ptr, a0, a1, a2, s_ptr, h_ptr, t_ptr,
    width, rank0, rank1, eps, stride_x, stride_res, stride_s, stride_h, stride_t,
    HAS_RESIDUAL: tl.constexpr, OUT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    first = tl.program_id(1) * BLOCK_R
    columns = tl.arange(0, BLOCK_K)
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)
    for start in range(0, width, BLOCK_K):
        offsets = start + columns
        inside = offsets < width
        x = _norm_input(x_ptr + row * stride_x, res_ptr + row * stride_res, offsets, inside, HAS_RESIDUAL, OUT)
        squares += x * x
    inverse = tl.rsqrt(tl.sum(squares, axis=0) / width + eps)  # torch.rsqrt, as the eager and inductor norms
    base = _adapter_rows(a0, a1, a2, first, width, rank0, rank1)
    ranks = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for start in range(0, width, BLOCK_K):
        offsets = start + columns
        inside = offsets < width
        x = _norm_input(x_ptr + row * stride_x, res_ptr + row * stride_res, offsets, inside, HAS_RESIDUAL, OUT)
        if HAS_RESIDUAL and tl.program_id(1) == 0:
            tl.store(s_ptr + row * stride_s + offsets, x.to(OUT), mask=inside)  # exact: x holds a rounded sum
        normed = _round(x * inverse, OUT).to(tl.float32)
        weight = tl.load(w_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        h = _round(weight * normed, OUT)
        if tl.program_id(1) == 0:  # one program per row writes the elementwise part
            tl.store(h_ptr + row * stride_h + offsets, h, mask=inside)
        a = tl.load(base + ranks[:, None] * width + offsets[None, :], mask=inside[None, :], other=0.0)
        acc += tl.sum(a * h.to(tl.float32)[None, :], axis=1)
    tl.store(t_ptr + row * stride_t + first + ranks, acc)


@triton.jit
def _silu_mul_shrink_kernel(
    gate_ptr, up_ptr, a0, a1, a2, y_ptr, t_ptr, partial_ptr, count_ptr,
    width, span, rank0, rank1, stride_gate, stride_up, stride_y, stride_t,
    OUT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
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
        a = tl.load(base + ranks[:, None] * width + offsets[None, :], mask=inside[None, :], other=0.0)
        acc += tl.sum(a * y.to(tl.float32)[None, :], axis=1)
    if SPLITS == 1:
        tl.store(t_ptr + row * stride_t + first + ranks, acc)
    else:
        # Split over the row: each program leaves its partial, the last to arrive adds them in split order (the
        # same sum on every launch) and resets the counter for the next launch (so graph replays need no memset).
        slot = row * tl.num_programs(1) + block
        tl.store(partial_ptr + (slot * SPLITS + tl.program_id(2)) * BLOCK_R + ranks, acc)
        tl.debug_barrier()  # every thread's partial is written before the counter moves
        arrived = tl.atomic_add(count_ptr + slot, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            total = tl.zeros([BLOCK_R], dtype=tl.float32)
            for split in range(SPLITS):
                total += tl.load(partial_ptr + (slot * SPLITS + split) * BLOCK_R + ranks, cache_modifier=".cg")
            tl.store(t_ptr + row * stride_t + first + ranks, total)
            tl.atomic_xchg(count_ptr + slot, 0, sem="relaxed", scope="gpu")


@triton.jit
def _tile_adapter(a0, a1, a2, width, rank0, rank1, rank2, blocks0, blocks1, BLOCK_R: tl.constexpr):
    """This program's rank block of the concatenated A matrices (each rank counted in blocks of BLOCK_R, the last
    one masked): (pointer to its first row, how many of its BLOCK_R rows exist, its first column in ``t``)."""
    block = tl.program_id(0)
    if block < blocks0:
        local = block * BLOCK_R
        base, valid, column = a0 + local * width, rank0 - local, local
    elif block < blocks0 + blocks1:
        local = (block - blocks0) * BLOCK_R
        base, valid, column = a1 + local * width, rank1 - local, rank0 + local
    else:
        local = (block - blocks0 - blocks1) * BLOCK_R
        base, valid, column = a2 + local * width, rank2 - local, rank0 + rank1 + local
    return base, valid, column


@triton.jit
def _tile_a(base, valid, width, offsets, inside, BLOCK_R: tl.constexpr):
    """The ``[BLOCK_R, columns]`` A tile of one step (rows past the adapter's rank read as zeros)."""
    ranks = tl.arange(0, BLOCK_R)
    mask = (ranks < valid)[:, None] & inside[None, :]
    return tl.load(base + ranks[:, None] * width + offsets[None, :], mask=mask, other=0.0)


@triton.jit
def _tile_finish(acc, t_ptr, partial_ptr, count_ptr, rows, stride_t, column, valid,
                 ROWS: tl.constexpr, BLOCK_R: tl.constexpr, SPLITS: tl.constexpr):  # fmt: skip
    """Store ``acc[ROWS, BLOCK_R]`` into ``t``, or leave it as this span's partial and, in the last program of the
    rank block to arrive, add the partials in span order into ``t`` (the same sum on every launch) and reset the
    counter (graph replays need no memset)."""
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
def _norm_shrink_tile_kernel(
    x_ptr, res_ptr, w_ptr, a0, a1, a2, s_ptr, h_ptr, t_ptr, partial_ptr, count_ptr,
    rows, width, span, rank0, rank1, rank2, blocks0, blocks1, eps, stride_x, stride_res, stride_s, stride_h, stride_t,
    HAS_RESIDUAL: tl.constexpr, OUT: tl.constexpr, ROWS: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, NORM_K: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    row_ids = tl.arange(0, ROWS)
    live = row_ids < rows
    x_rows, res_rows = x_ptr + row_ids[:, None] * stride_x, res_ptr + row_ids[:, None] * stride_res
    # the rows' inverse RMS over their whole width (torch.rsqrt, as the eager and inductor norms)
    squares = tl.zeros([ROWS, NORM_K], dtype=tl.float32)
    for start in range(0, width, NORM_K):
        columns = (start + tl.arange(0, NORM_K))[None, :]
        x = _norm_input(x_rows, res_rows, columns, live[:, None] & (columns < width), HAS_RESIDUAL, OUT)
        squares += x * x
    inverse = tl.rsqrt(tl.sum(squares, axis=1) / width + eps)
    first_block = tl.program_id(0) == 0
    base, valid, column = _tile_adapter(a0, a1, a2, width, rank0, rank1, rank2, blocks0, blocks1, BLOCK_R)
    low = tl.program_id(1) * span
    high = tl.minimum(low + span, width)
    acc = tl.zeros([ROWS, BLOCK_R], dtype=tl.float32)
    for start in range(low, high, BLOCK_K):
        offsets = start + tl.arange(0, BLOCK_K)
        inside = offsets < high
        mask = live[:, None] & inside[None, :]
        x = _norm_input(x_rows, res_rows, offsets[None, :], mask, HAS_RESIDUAL, OUT)
        if HAS_RESIDUAL and first_block:
            tl.store(s_ptr + row_ids[:, None] * stride_s + offsets[None, :], x.to(OUT), mask=mask)  # a rounded sum
        weight = tl.load(w_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        h = _round(weight[None, :] * _round(x * inverse[:, None], OUT).to(tl.float32), OUT)
        if first_block:  # the first rank block's programs write the elementwise part
            tl.store(h_ptr + row_ids[:, None] * stride_h + offsets[None, :], h, mask=mask)
        a = _tile_a(base, valid, width, offsets, inside, BLOCK_R)
        acc = tl.dot(h.to(tl.float32), tl.trans(a), acc, input_precision="tf32x3")
    _tile_finish(acc, t_ptr, partial_ptr, count_ptr, rows, stride_t, column, valid, ROWS, BLOCK_R, SPLITS)


@triton.jit
def _silu_mul_shrink_tile_kernel(
    gate_ptr, up_ptr, a0, a1, a2, y_ptr, t_ptr, partial_ptr, count_ptr,
    rows, width, span, rank0, rank1, rank2, blocks0, blocks1, stride_gate, stride_up, stride_y, stride_t,
    OUT: tl.constexpr, ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    row_ids = tl.arange(0, ROWS)
    live = row_ids < rows
    first_block = tl.program_id(0) == 0
    base, valid, column = _tile_adapter(a0, a1, a2, width, rank0, rank1, rank2, blocks0, blocks1, BLOCK_R)
    low = tl.program_id(1) * span
    high = tl.minimum(low + span, width)
    acc = tl.zeros([ROWS, BLOCK_R], dtype=tl.float32)
    for start in range(low, high, BLOCK_K):
        offsets = start + tl.arange(0, BLOCK_K)
        inside = offsets < high
        mask = live[:, None] & inside[None, :]
        gate = tl.load(gate_ptr + row_ids[:, None] * stride_gate + offsets[None, :], mask=mask, other=0.0)
        up = tl.load(up_ptr + row_ids[:, None] * stride_up + offsets[None, :], mask=mask, other=0.0)
        gate = gate.to(tl.float32)
        activated = _round(gate / (1.0 + tl.exp(-gate)), OUT).to(tl.float32)
        y = _round(activated * up.to(tl.float32), OUT)
        if first_block:
            tl.store(y_ptr + row_ids[:, None] * stride_y + offsets[None, :], y, mask=mask)
        a = _tile_a(base, valid, width, offsets, inside, BLOCK_R)
        acc = tl.dot(y.to(tl.float32), tl.trans(a), acc, input_precision="tf32x3")
    _tile_finish(acc, t_ptr, partial_ptr, count_ptr, rows, stride_t, column, valid, ROWS, BLOCK_R, SPLITS)


def block_k(width: int) -> int:
    return min(triton.next_power_of_2(width), MAX_BLOCK_K)


def rank_block(rows: int, ranks: list[int], columns: int = MAX_BLOCK_K) -> int:
    """Rows of A per program: the largest of 4, 2, 1 that divides every rank, keeps the A tile within `TILE` for
    steps of ``columns``, and still gives `TARGET_PROGRAMS`."""
    total = sum(ranks)
    for block in (4, 2):
        fits = block * columns <= TILE and all(r % block == 0 for r in ranks)
        if fits and rows * total // block >= TARGET_PROGRAMS:
            return block
    return 1


def _warps(columns: int) -> int:
    return max(1, min(8, columns // 512))


def _adapter_args(lora_a: list[torch.Tensor]) -> tuple:
    padded = list(lora_a) + [lora_a[0]] * (3 - len(lora_a))
    ranks = [a.shape[0] for a in lora_a] + [0] * (3 - len(lora_a))
    return padded, ranks[0], ranks[1]


def takes_tile(rows: int) -> bool:
    """Whether a launch of ``rows`` rows takes the tile kernels (`TILE_FROM_ROWS` to `TILE_ROWS` rows)."""
    return TILE_FROM_ROWS <= rows <= TILE_ROWS


def tile_spans(width: int, lora_a: list[torch.Tensor]) -> tuple[int, int]:
    """(rank blocks, columns per span) of a tile launch: spans of whole steps, as many as keep the launch at about
    `TILE_PROGRAMS` programs (at least one step each)."""
    blocks = sum(triton.cdiv(a.shape[0], TILE_RANKS) for a in lora_a)
    steps = triton.cdiv(width, TILE_STEP)
    splits = max(1, min(steps, TILE_PROGRAMS // blocks))
    return blocks, triton.cdiv(steps, splits) * TILE_STEP


def _tile_args(width: int, lora_a: list[torch.Tensor], t: torch.Tensor) -> tuple:
    """(grid, A matrices, their ranks and the first two's block counts, scratch partials, counters, constexprs)."""
    blocks, span = tile_spans(width, lora_a)
    splits = triton.cdiv(width, span)
    ranks = [a.shape[0] for a in lora_a] + [0] * (3 - len(lora_a))
    counts = [triton.cdiv(r, TILE_RANKS) for r in ranks]
    matrices = list(lora_a) + [lora_a[0]] * (3 - len(lora_a))
    partials = t.new_empty(blocks * splits * TILE_ROWS * TILE_RANKS) if splits > 1 else t
    counters = arrival_counters(t.device, blocks) if splits > 1 else t
    meta = dict(ROWS=TILE_ROWS, BLOCK_R=TILE_RANKS, BLOCK_K=TILE_STEP, SPLITS=splits, num_warps=TILE_WARPS)
    return (blocks, splits), matrices, (span, *ranks, counts[0], counts[1]), partials, counters, meta


def norm_shrink(x, residual, weight, eps, lora_a, s, h, t) -> None:
    """Fill ``h`` (and ``s = x + residual`` where ``residual`` is given) and ``t`` (see `fused_shrink`)."""
    rows, width = x.shape
    has_residual = residual is not None
    residual = residual if has_residual else x
    s = s if has_residual else h
    if takes_tile(rows):
        grid, matrices, sizes, partials, counters, meta = _tile_args(width, lora_a, t)
        _norm_shrink_tile_kernel[grid](
            x, residual, weight, *matrices, s, h, t, partials, counters, rows, width, *sizes, eps,
            x.stride(0), residual.stride(0), s.stride(0), h.stride(0), t.stride(0),
            HAS_RESIDUAL=has_residual, OUT=_DTYPES[h.dtype], NORM_K=min(triton.next_power_of_2(width), TILE_NORM_STEP),
            **meta,
        )  # fmt: skip
        return
    columns = block_k(width)
    block = rank_block(rows, [a.shape[0] for a in lora_a], columns)
    (a0, a1, a2), rank0, rank1 = _adapter_args(lora_a)
    grid = (rows, t.shape[1] // block)
    _norm_shrink_kernel[grid](
        x, residual, weight, a0, a1, a2, s, h, t, width, rank0, rank1, eps,
        x.stride(0), residual.stride(0), s.stride(0), h.stride(0), t.stride(0),
        HAS_RESIDUAL=has_residual, OUT=_DTYPES[h.dtype], BLOCK_R=block, BLOCK_K=columns, num_warps=_warps(columns),
    )  # fmt: skip


def silu_mul_shrink(gate, up, lora_a, y, t) -> None:
    """Fill ``y = silu(gate) * up`` and ``t`` (see `fused_shrink`). Few (row, rank block) programs split the row
    (7B down at one row: 32 programs of 18,944 columns each would be chains of dependent loads)."""
    rows, width = gate.shape
    if takes_tile(rows):
        grid, matrices, sizes, partials, counters, meta = _tile_args(width, lora_a, t)
        _silu_mul_shrink_tile_kernel[grid](
            gate, up, *matrices, y, t, partials, counters, rows, width, *sizes,
            gate.stride(0), up.stride(0), y.stride(0), t.stride(0), OUT=_DTYPES[y.dtype], **meta,
        )  # fmt: skip
        return
    block = rank_block(rows, [a.shape[0] for a in lora_a], block_k(width))
    blocks = t.shape[1] // block
    splits = max(1, min(triton.cdiv(TARGET_PROGRAMS, rows * blocks), triton.cdiv(width, MIN_SPAN)))
    span = triton.cdiv(triton.cdiv(width, splits), SPAN_ALIGN) * SPAN_ALIGN
    splits = triton.cdiv(width, span)
    columns = block_k(span)
    (a0, a1, a2), rank0, rank1 = _adapter_args(lora_a)
    partials = t.new_empty(rows * blocks * splits * block) if splits > 1 else t
    counters = arrival_counters(t.device, rows * blocks) if splits > 1 else t
    _silu_mul_shrink_kernel[(rows, blocks, splits)](
        gate, up, a0, a1, a2, y, t, partials, counters, width, span, rank0, rank1,
        gate.stride(0), up.stride(0), y.stride(0), t.stride(0),
        OUT=_DTYPES[y.dtype], BLOCK_R=block, BLOCK_K=columns, SPLITS=splits, num_warps=_warps(columns),
    )  # fmt: skip
