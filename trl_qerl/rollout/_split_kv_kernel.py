"""The Triton kernels of `decode_attention` (kept apart: Triton is optional, and only launching needs it)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..nvfp4.cuda_mma import arrival_counters
from ._arrival_kernel import last_to_arrive, reset_arrivals
from ._fused_shrink_kernel import _DTYPES, _round
from ._pdl_kernel import allow_next_kernel, launch_options, wait_for_previous_kernel


_IO_DTYPES = {**_DTYPES, torch.float32: tl.float32}  # a strict lookup: another dtype is a KeyError, not fp32 reads


@triton.jit
def _rotated(ptr, offsets, dims, cos, sin, mask, HEAD_DIM: tl.constexpr, IO: tl.constexpr):
    """transformers' ``x * cos + rotate_half(x) * sin`` of the heads at ``ptr + offsets`` (broadcast against
    ``dims``), each product and the sum rounded to ``IO`` as the eager ops round them; fp32 values."""
    half: tl.constexpr = HEAD_DIM // 2
    x = tl.load(ptr + offsets + dims, mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(ptr + offsets + (dims + half) % HEAD_DIM, mask=mask, other=0.0).to(tl.float32)
    partner = tl.where(dims < half, -partner, partner)
    return _round(_round(x * cos, IO).to(tl.float32) + _round(partner * sin, IO).to(tl.float32), IO).to(tl.float32)


@triton.jit
def _partials_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, position_ptr, acc_ptr, max_ptr, sum_ptr, out_ptr, count_ptr,
    new_k_ptr, new_v_ptr, cos_ptr, sin_ptr,
    scaling, cache_len,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl, stride_mb,
    stride_ob, stride_oh, stride_nk, stride_nv, stride_cos, stride_sin,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, MIN_STAT: tl.constexpr, MERGE: tl.constexpr,
    MERGE_DIM_BLOCK: tl.constexpr, MERGE_SPLIT_BLOCK: tl.constexpr, ROTARY: tl.constexpr, IO: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(PDL)
    allow_next_kernel(PDL)
    row_head = tl.program_id(0)
    split = tl.program_id(1)
    row = row_head // KV_HEADS
    kv_head = row_head % KV_HEADS
    heads = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    last = tl.load(position_ptr)  # the position written this step; later ones are masked anyway
    start = split * CHUNK
    k_base = k_ptr + row * stride_kb + kv_head * stride_kh
    v_base = v_ptr + row * stride_vb + kv_head * stride_vh
    q_offsets = row * stride_qb + (kv_head * GROUP + heads)[:, None] * stride_qh
    if ROTARY:  # q, k before rotary: rotate them here; the chunk holding `last` writes k and v into the cache
        cos = tl.load(cos_ptr + row * stride_cos + dims).to(tl.float32)
        sin = tl.load(sin_ptr + row * stride_sin + dims).to(tl.float32)
        q = _rotated(q_ptr, q_offsets, dims[None, :], cos[None, :], sin[None, :], (heads < GROUP)[:, None], HEAD_DIM,
                     IO).to(DOT_DTYPE)  # fmt: skip
        new_k = _rotated(new_k_ptr, row * stride_nk + kv_head * HEAD_DIM, dims, cos, sin, dims < HEAD_DIM, HEAD_DIM,
                         IO).to(k_ptr.dtype.element_ty)  # fmt: skip
        new_v = tl.load(new_v_ptr + row * stride_nv + kv_head * HEAD_DIM + dims)
        written = dims * 0 + last  # (a vector: the stores' mask)
        holds_last = (written >= start) & (written < start + CHUNK)
        tl.store(k_base + last * stride_kl + dims, new_k, mask=holds_last)
        tl.store(v_base + last * stride_vl + dims, new_v, mask=holds_last)
    else:
        q = tl.load(q_ptr + q_offsets + dims[None, :], mask=(heads < GROUP)[:, None], other=0.0).to(DOT_DTYPE)
    end = tl.minimum(tl.minimum(start + CHUNK, last + 1), cache_len)
    running_max = tl.full([GROUP_PAD], MIN_STAT, dtype=tl.float32)
    running_sum = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    for offset in range(start, end, BLOCK):
        positions = offset + tl.arange(0, BLOCK)
        inside = positions < end
        keys = tl.load(k_base + positions[:, None] * stride_kl + dims[None, :], mask=inside[:, None], other=0.0)
        if ROTARY:  # this step's key and value from registers: the store above need not be visible to the load
            keys = tl.where((positions == last)[:, None], new_k[None, :], keys)
        scores = tl.dot(q, tl.trans(keys.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * scaling
        additive = tl.load(mask_ptr + row * stride_mb + positions, mask=inside, other=0.0).to(tl.float32)
        scores = tl.where(inside[None, :], scores + additive[None, :], float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        rescale = tl.exp(running_max - new_max)
        probs = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, 1)
        values = tl.load(v_base + positions[:, None] * stride_vl + dims[None, :], mask=inside[:, None], other=0.0)
        if ROTARY:
            values = tl.where((positions == last)[:, None], new_v[None, :], values)
        acc = acc * rescale[:, None] + tl.dot(probs.to(DOT_DTYPE), values.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        running_max = new_max
    out = (row_head * SPLITS + split) * GROUP
    tl.store(acc_ptr + (out + heads)[:, None] * HEAD_DIM + dims[None, :], acc, mask=(heads < GROUP)[:, None])
    tl.store(max_ptr + out + heads, running_max, mask=heads < GROUP)
    tl.store(sum_ptr + out + heads, running_sum, mask=heads < GROUP)
    if MERGE:  # the last of the row's chunks to arrive merges them all
        if last_to_arrive(count_ptr, row_head, SPLITS):
            used = _chunks_used(last, CHUNK, SPLITS)
            # slice by slice, in the merge kernel's tiles: the same sums in the same order, so the same bits
            for dim_start in tl.static_range(0, HEAD_DIM, MERGE_DIM_BLOCK):
                _merge_row_head(acc_ptr, max_ptr, sum_ptr, out_ptr, row_head, used, dim_start, stride_ob, stride_oh,
                                KV_HEADS, GROUP, GROUP_PAD, HEAD_DIM, MERGE_DIM_BLOCK, SPLITS, SPLITS_PAD,
                                MERGE_SPLIT_BLOCK, MIN_STAT, ".cg")  # fmt: skip
            reset_arrivals(count_ptr, row_head)


@triton.jit
def _chunks_used(last, CHUNK: tl.constexpr, SPLITS: tl.constexpr):
    """How many chunks hold a position ``<= last`` (the later ones read nothing and weigh exactly zero)."""
    return tl.minimum(last // CHUNK + 1, SPLITS).to(tl.int32)


@triton.jit
def _merge_kernel(
    acc_ptr, max_ptr, sum_ptr, out_ptr, position_ptr, stride_ob, stride_oh,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    CHUNK: tl.constexpr, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, DIM_BLOCK: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr, MIN_STAT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(PDL)
    allow_next_kernel(PDL)
    if CHUNK > 0:
        used = _chunks_used(tl.load(position_ptr), CHUNK, SPLITS)
    else:
        used = SPLITS
    _merge_row_head(acc_ptr, max_ptr, sum_ptr, out_ptr, tl.program_id(0), used, tl.program_id(1) * DIM_BLOCK,
                    stride_ob, stride_oh, KV_HEADS, GROUP, GROUP_PAD, HEAD_DIM, DIM_BLOCK, SPLITS, SPLITS_PAD,
                    SPLIT_BLOCK, MIN_STAT, "")  # fmt: skip


@triton.jit
def _merge_row_head(
    acc_ptr, max_ptr, sum_ptr, out_ptr, row_head, used, dim_start, stride_ob, stride_oh,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_BLOCK: tl.constexpr, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
    MIN_STAT: tl.constexpr, LOAD: tl.constexpr,
):  # fmt: skip
    """Merge one (row, key/value head)'s chunk partials into ``out``, head dims ``dim_start`` to ``dim_start +
    DIM_BLOCK``: the first ``used`` chunks (the others saw no position: their weight is exactly zero, so they are not
    read), ``SPLIT_BLOCK`` chunks per step (independent loads; the sum over chunks is the only chain). ``LOAD``: the
    loads' cache modifier, ``".cg"`` (bypass L1) where other programs of the same launch wrote the partials."""
    row = row_head // KV_HEADS
    kv_head = row_head % KV_HEADS
    heads = tl.arange(0, GROUP_PAD)
    real = heads < GROUP
    dims = dim_start + tl.arange(0, DIM_BLOCK)
    first = row_head * SPLITS * GROUP
    splits = tl.arange(0, SPLITS_PAD)
    stats = first + splits[:, None] * GROUP + heads[None, :]
    overall = tl.max(tl.load(max_ptr + stats, mask=(splits[:, None] < used) & real[None, :], other=MIN_STAT,
                             cache_modifier=LOAD), 0)  # fmt: skip
    numerator = tl.zeros([GROUP_PAD, DIM_BLOCK], dtype=tl.float32)
    denominator = tl.zeros([GROUP_PAD], dtype=tl.float32)
    steps = tl.arange(0, SPLIT_BLOCK)
    for start in range(0, used, SPLIT_BLOCK):  # all chunks at once would not fit in registers
        split = start + steps
        inside = (split[:, None] < used) & real[None, :]
        offsets = first + split[:, None] * GROUP + heads[None, :]
        maxima = tl.load(max_ptr + offsets, mask=inside, other=MIN_STAT, cache_modifier=LOAD)
        weight = tl.where(inside, tl.exp(maxima - overall[None, :]), 0.0)
        denominator += tl.sum(weight * tl.load(sum_ptr + offsets, mask=inside, other=0.0, cache_modifier=LOAD), 0)
        chunk = tl.load(acc_ptr + offsets[:, :, None] * HEAD_DIM + dims[None, None, :], mask=inside[:, :, None],
                        other=0.0, cache_modifier=LOAD)  # fmt: skip
        numerator += tl.sum(weight[:, :, None] * chunk, 0)
    out = numerator / tl.where(real, denominator, 1.0)[:, None]
    tl.store(
        out_ptr + row * stride_ob + (kv_head * GROUP + heads)[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty), mask=real[:, None],
    )  # fmt: skip


def merge(acc, maxima, sums, out, min_stat: float, cache_position=None, chunk: int = 0, dim_block: int = 0,
          split_block: int = 1) -> None:  # fmt: skip
    """`decode_attention.launch_merge`: one program per (row x KV head, ``dim_block`` head dims; 0: all of them),
    writing ``out[B, H, 1, D]``, ``split_block`` chunks per step. With ``cache_position`` and the partials' ``chunk``
    it reads only the chunks up to that position."""
    row_heads, splits, group, head_dim = acc.shape
    heads = out.shape[1]
    bounded = cache_position is not None and chunk > 0
    dim_block, split_block = merge_tiles(head_dim, dim_block, split_block)
    _merge_kernel[(row_heads, head_dim // dim_block)](
        acc, maxima, sums, out, cache_position if bounded else acc, out.stride(0), out.stride(1),
        KV_HEADS=heads // group, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        CHUNK=chunk if bounded else 0, SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), DIM_BLOCK=dim_block,
        SPLIT_BLOCK=split_block, MIN_STAT=min_stat, **launch_options(acc.device, out.shape[0]),
    )  # fmt: skip


def merge_tiles(head_dim: int, dim_block: int, split_block: int) -> tuple[int, int]:
    """The merge's ``(dim_block, split_block)``: ``dim_block`` 0 or above ``head_dim`` means all of them; both must be
    powers of two, ``dim_block`` dividing ``head_dim``."""
    dim_block = min(dim_block or head_dim, head_dim)
    if head_dim % dim_block or dim_block & (dim_block - 1) or split_block < 1 or split_block & (split_block - 1):
        raise ValueError(f"merge: dim_block {dim_block} must be a power of two dividing head_dim {head_dim}, and "
                         f"split_block {split_block} a power of two")  # fmt: skip
    return dim_block, split_block


def chunk_of(cache_len: int, splits: int, block: int) -> int:
    """Cache positions per chunk of a launch with ``splits`` chunks: ``cdiv(cache_len, splits)`` rounded up to
    ``block``."""
    return triton.cdiv(triton.cdiv(cache_len, splits), block) * block


def launch(q, keys, values, mask, scaling, cache_position, acc, maxima, sums, block: int, min_stat: float,
           out: torch.Tensor | None = None, num_warps: int = 4, merge_dim_block: int = 0,
           merge_split_block: int = 1, rotary: tuple | None = None) -> None:  # fmt: skip
    """`decode_attention.launch_partials`: one program per (row x KV head, chunk). With ``out`` the last chunk of
    each (row, KV head) to finish merges the partials into it (one launch instead of two, `merge`). With ``rotary =
    (new_k, new_v, cos, sin)``, ``q`` is ``[B, H * D]`` before the rotary embedding (rows may be strided), rotated
    here, and the key (rotated) and value ``[B, KVH * D]`` of this step are written into the cache at
    ``cache_position`` by the program whose chunk holds it; ``cos`` / ``sin`` are ``[B, D]``."""
    batch, head_dim = q.shape[0], keys.shape[3]
    heads = q.shape[1] if rotary is None else q.shape[1] // head_dim
    kv_heads, cache_len = keys.shape[1], keys.shape[2]
    splits = acc.shape[1]
    chunk = chunk_of(cache_len, splits, block)
    q3 = q.reshape(batch, heads, head_dim)  # from [B, H, 1, D], or from [B, H * D] rows before rotary
    new_k, new_v, cos, sin = rotary if rotary is not None else (q3, q3, q3, q3)
    mask2 = mask.reshape(batch, cache_len)
    group = heads // kv_heads
    merged = out is not None
    dim_block, split_block = merge_tiles(head_dim, merge_dim_block, merge_split_block)
    counters = arrival_counters(q.device, batch * kv_heads) if merged else acc
    out = out if merged else acc
    # fp32 inputs get fp32 products ("ieee"): tl.dot's CUDA default is tf32 (10-bit mantissa), not what an fp32
    # caller asked for; the fp32 tests failed with it on the H200. 16-bit operands ignore the argument.
    _partials_kernel[(batch * kv_heads, splits)](
        q3, keys, values, mask2, cache_position, acc, maxima, sums, out, counters,
        new_k, new_v, cos, sin,
        scaling, cache_len,
        q3.stride(0), q3.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), mask2.stride(0),
        out.stride(0) if merged else 0, out.stride(1) if merged else 0,
        new_k.stride(0), new_v.stride(0), cos.stride(0), sin.stride(0),
        KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        CHUNK=chunk, BLOCK=block, SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits),
        DOT_DTYPE=_dot_dtype(q.dtype), DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        MIN_STAT=min_stat, MERGE=merged, MERGE_DIM_BLOCK=dim_block, MERGE_SPLIT_BLOCK=split_block,
        ROTARY=rotary is not None, IO=_IO_DTYPES[q.dtype], num_warps=num_warps, **launch_options(q.device, batch),
    )  # fmt: skip


def _dot_dtype(dtype: torch.dtype):
    # Triton's interpreter multiplies bf16 tiles in tl.dot as their integer bits: it gets fp32 operands (the CPU tests
    # check the algorithm there; the bf16 tensor-core products are checked on CUDA).
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or dtype == torch.float32:
        return tl.float32
    return tl.float16 if dtype == torch.float16 else tl.bfloat16
