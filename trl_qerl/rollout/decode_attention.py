"""Decode attention that reads only the filled part of a static KV cache, split over the cache length.

One decode token per row attends to a static cache ``[B, KVH, L, D]`` whose positions beyond the current one are
masked. `F.scaled_dot_product_attention` reads all ``L`` positions in one tile per (row, key/value head): at
batch 8 that is few CTAs of mostly masked work (cuDNN: ~14.7 µs per 7B layer on the H200 over a 512-token cache,
~9 % of a decode step). This kernel ("flash-decoding") gives each (row, key/value head, chunk of the cache) its
own program, folds the key/value head's query heads into one ``tl.dot``, and skips every chunk past the current
cache position (a device tensor, so the launch is CUDA-graph capturable). Each program writes its partial softmax
statistics, and a second kernel (`launch_merge`, one program per row and key/value head) merges them exactly into
the output, or (opt-in, `MERGE_IN_PARTIALS`) the last program of each row and key/value head to finish does. Left
to inductor, the merge (`combine_partials`, plain torch: the tests' reference) became three reduction kernels costing
more than the partials kernel (H200, 2026-12-02).

The result equals SDPA's up to summation order and the bf16 rounding of the probabilities before ``P @ V`` (as in
flash attention). `split_kv_attention` runs the Triton kernels (`_split_kv_kernel`, imported when first launched;
on CPU machines in Triton's interpreter, as the tests do); `partials_reference` is the partials in torch.
"""

from __future__ import annotations

import importlib.util

import torch


__all__ = [
    "MIN_STAT",
    "chunk_size",
    "combine_partials",
    "launch_merge",
    "launch_partials",
    "partials_reference",
    "rotary_in_attention_applies",
    "split_kv_applies",
    "split_kv_attention",
    "split_kv_attention_rotary",
    "split_kv_partials",
    "triton_available",
]

BLOCK = 64
"""Cache positions per inner step of a program (and the least per chunk). 64, with `MERGE_SPLITS` 4 and
`MERGE_DIM_BLOCK` 32, was the fastest of the settings timed (H200, 2026-12-03, `scripts/bench_decode_attention.py`,
cache of 1,280 positions, µs per layer summed over 5 positions, against 32 / 1 / all dims before, same run): 14B
batch 8 61.1 against 76.3, batch 1 37.7 against 44.7; 7B batch 8 47.5 against 54.6, batch 1 36.0 against 56.6."""

MAX_CHUNK: int | None = None
"""At most this many cache positions per program (rounded up to `BLOCK`); None: only `chunk_size`'s rule. The launch
is captured once for the whole static cache, so its chunks are sized for the full cache: early in a rollout only the
first of them hold positions, and each of those runs its chunk's steps one after another. A cap gives more, shorter
programs there, at the cost of more (empty) programs later and more partials to merge. With `BLOCK` 64, caps of 64
and 128 were slower over five positions (14B batch 8 on the H200: 81.5 and 65.2 against 59.7 µs summed; 128 was
faster only below position ~600), so it stays off."""

PARTIALS_WARPS = 4
"""Warps per program of the partials kernel (8 was slower with `BLOCK` 64 at 14B batch 8 on the H200)."""

MERGE_SPLITS = 4
"""Chunks the merge kernel reads per step (a power of two). Its steps are a chain (each adds to the sums), so with
many chunks (batch 1, where `chunk_size` makes dozens) one chunk per step is a row of dependent loads. 4 chunks of
all 128 head dims per step spilled (3x slower on the H200); with `MERGE_DIM_BLOCK` 32 it is the fastest form."""

MERGE_DIM_BLOCK = 32
"""Head dims per merge program (a power of two dividing the head dim; 0 or more than the head dim: all of them).
Fewer give more programs: at batch 1 the merge otherwise runs one program per key/value head (4 for Qwen2.5-7B)."""

MERGE_IN_PARTIALS = False
"""True: `split_kv_attention` in one launch, the last chunk of each (row, key/value head) to finish merging (an arrival
counter per (row, key/value head) that resets itself, so graph replays need no memset). False (default): a second
kernel merges. Both forms give the same tokens and log-probs bit for bit (Triton's interpreter and a compiled,
captured step on the H200). Off because it saved nothing (H200, 7B, 2026-12-03, interleaved A/B, `bench_rollout.py
--engines fused+compile+split_kv fused+compile+split_kv+one_launch_attention ...`): the partials launch grew by about
what the merge kernel took (batch 1: 0.087 + 0.137 ms -> 0.241 ms per step; batch 8: 0.148 + 0.095 -> 0.248), and
the decode step stayed at 3.01-3.08 / 3.44-3.47 ms at batch 1 / 8 either way."""

MIN_STAT = torch.finfo(torch.float32).min
"""The running max before any position (finite, so that ``exp(max - max)`` is 1, never NaN, and below any masked
score ``s + finfo(bf16/fp16).min``: a row whose positions are all masked averages them, as SDPA does)."""


def split_kv_applies(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether `split_kv_attention` handles this call: one query token, a power-of-two head dim of 16-256 (a
    ``tl.dot`` operand), 16-bit or fp32 tensors with contiguous last dims, and an additive ``[B, 1, 1, L]`` mask."""
    head_dim = q.shape[-1]
    return (
        q.shape[2] == 1
        and 16 <= head_dim <= 256
        and head_dim & (head_dim - 1) == 0
        and q.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and keys.dtype == q.dtype
        and mask.dtype != torch.bool
        and mask.shape[1:3] == (1, 1)
        and q.stride(-1) == 1
        and keys.stride(-1) == 1
        and mask.stride(-1) == 1
    )


def chunk_size(cache_len: int, row_heads: int, device: torch.device) -> int:
    """Cache positions per program: enough programs (``row_heads`` x chunks) to fill the GPU twice over, each at
    least one `BLOCK`."""
    processors = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    chunk = _cdiv(cache_len * row_heads, 2 * processors)
    if MAX_CHUNK is not None:
        chunk = min(chunk, MAX_CHUNK)
    return max(BLOCK, _cdiv(chunk, BLOCK) * BLOCK)


def launch_partials(q, keys, values, mask, scaling, cache_position, acc, maxima, sums, out=None,
                    rotary: tuple | None = None) -> None:  # fmt: skip
    """Run the kernel into ``acc[B*KVH, S, G, D]``, ``maxima`` / ``sums[B*KVH, S, G]`` (fp32). The ``S`` chunks
    are ``cdiv(cache_len, S)`` positions rounded up to `BLOCK`. With ``out[B, H, 1, D]`` the same launch also
    merges them into it (as `launch_merge` would). With ``rotary = (k, v, cos, sin)``, ``q`` and ``k`` come before
    the rotary embedding as ``[B, H * D]`` / ``[B, KVH * D]`` rows (``cos``, ``sin``: ``[B, D]``): the kernel
    rotates them and writes this step's key and value into the cache at ``cache_position``. Needs Triton (imported
    here: the package imports without it)."""
    from ._split_kv_kernel import launch

    launch(q, keys, values, mask, scaling, cache_position, acc, maxima, sums, block=BLOCK, min_stat=MIN_STAT, out=out,
           num_warps=PARTIALS_WARPS, merge_dim_block=MERGE_DIM_BLOCK, merge_split_block=MERGE_SPLITS,
           rotary=rotary)  # fmt: skip


def launch_merge(acc, maxima, sums, out, cache_position: torch.Tensor | None = None, cache_len: int = 0) -> None:
    """Merge the partials of `launch_partials` into ``out[B, H, 1, D]`` (any float dtype), in one Triton launch:
    `combine_partials` in a kernel (in a compiled step inductor writes it as three reductions, ~7 µs per 7B layer at
    batch 8 on the H200, more than the partials kernel itself). With ``cache_position`` and the cache length the
    partials were made for, it reads only the chunks that hold a position up to ``cache_position``."""
    from ._split_kv_kernel import chunk_of, merge

    chunk = chunk_of(cache_len, acc.shape[1], BLOCK) if cache_position is not None and cache_len > 0 else 0
    merge(acc, maxima, sums, out, min_stat=MIN_STAT, cache_position=cache_position, chunk=chunk,
          dim_block=MERGE_DIM_BLOCK, split_block=MERGE_SPLITS)  # fmt: skip


def triton_available() -> bool:
    """Whether Triton can be imported (it is optional: CPU-only environments may lack it)."""
    return importlib.util.find_spec("triton") is not None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _partials_shape(q: torch.Tensor, keys: torch.Tensor) -> tuple[int, int, int, int]:
    batch, heads, _, head_dim = q.shape
    kv_heads, cache_len = keys.shape[1], keys.shape[2]
    splits = _cdiv(cache_len, chunk_size(cache_len, batch * kv_heads, q.device))
    return batch * kv_heads, splits, heads // kv_heads, head_dim


def _partials_buffers(q: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty fp32 ``(acc, maxima, sums)`` for the kernel's partials."""
    shape = _partials_shape(q, keys)
    acc = torch.empty(shape, dtype=torch.float32, device=q.device)
    maxima = torch.empty(shape[:3], dtype=torch.float32, device=q.device)
    return acc, maxima, torch.empty_like(maxima)


@torch.library.custom_op("trl_qerl::split_kv_partials", mutates_args=())
def split_kv_partials(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scaling: float,
    cache_position: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The kernel's partials ``(acc, maxima, sums)``; an opaque op, so a compiled layer calls it as one launch."""
    acc, maxima, sums = _partials_buffers(q, keys)
    launch_partials(q, keys, values, mask, scaling, cache_position, acc, maxima, sums)
    return acc, maxima, sums


@split_kv_partials.register_fake
def _(q, keys, values, mask, scaling, cache_position):
    shape = _partials_shape(q, keys)
    maxima = q.new_empty(shape[:3], dtype=torch.float32)
    return q.new_empty(shape, dtype=torch.float32), maxima, torch.empty_like(maxima)


@torch.library.custom_op("trl_qerl::split_kv_attention", mutates_args=())
def split_kv_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scaling: float,
    cache_position: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """``softmax(q·Kᵀ·scaling + mask) @ V`` for ``q[B, H, 1, D]`` over the cache ``[B, KVH, L, D]``, reading only
    positions ``≤ cache_position[0]``. Returns ``[B, H, 1, D]`` in ``q``'s dtype. Two launches (partials, merge), or
    one with `MERGE_IN_PARTIALS`; an opaque op, so a compiled layer calls it as it is."""
    out = torch.empty_like(q)
    if MERGE_IN_PARTIALS:
        launch_partials(q, keys, values, mask, scaling, cache_position, *_partials_buffers(q, keys), out)
        return out
    acc, maxima, sums = split_kv_partials(q, keys, values, mask, scaling, cache_position)
    launch_merge(acc, maxima, sums, out, cache_position, keys.shape[2])
    return out


@split_kv_attention.register_fake
def _(q, keys, values, mask, scaling, cache_position):
    return torch.empty_like(q)


def rotary_in_attention_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                                sin: torch.Tensor, keys: torch.Tensor) -> bool:  # fmt: skip
    """Whether `split_kv_attention_rotary` takes these: one token per row, ``q`` / ``k`` / ``v`` ``[B, width]`` rows
    with contiguous last dims (the fused q/k/v output's views), ``cos`` / ``sin`` ``[B, 1, D]`` in their dtype with
    contiguous last dims, a cache ``[B, KVH, L, D]`` of that dtype, all bf16. (fp16 and fp32 are refused: there the
    GPU compiler contracts the rotary's products and sum into FMAs, so its bits differ from the eager ops'; on an
    H100, 2026-12-06. The bf16 rounding goes through integer ops, which nothing contracts.)"""
    batch, kv_heads, _, head_dim = keys.shape
    return (
        q.dim() == k.dim() == v.dim() == 2
        and q.shape[0] == k.shape[0] == v.shape[0] == batch
        and q.shape[1] % head_dim == 0
        and k.shape[1] == v.shape[1] == kv_heads * head_dim
        and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        and cos.shape == sin.shape == (batch, 1, head_dim)
        and cos.stride(-1) == sin.stride(-1) == 1
        and q.dtype == k.dtype == v.dtype == cos.dtype == sin.dtype == keys.dtype == torch.bfloat16
    )


@torch.library.custom_op("trl_qerl::split_kv_attention_rotary", mutates_args=("keys", "values"))
def split_kv_attention_rotary(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
    values: torch.Tensor, mask: torch.Tensor, scaling: float, cache_position: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """One decode token's attention from the q/k/v projections' rows ``[B, H * D]`` / ``[B, KVH * D]``, before the
    rotary embedding: the partials launch rotates ``q`` and ``k`` (``cos`` / ``sin`` ``[B, 1, D]``, the eager
    roundings) and writes this step's key and value into ``keys`` / ``values`` at ``cache_position``, where the
    compiled step would otherwise launch a kernel of its own for that; then the merge. Returns ``[B, H, 1, D]``.
    Callers check `rotary_in_attention_applies`."""
    batch, head_dim = q.shape[0], keys.shape[3]
    out = q.new_empty(batch, q.shape[1] // head_dim, 1, head_dim)
    acc, maxima, sums = _partials_buffers(out, keys)
    rotary = (k, v, cos.reshape(batch, head_dim), sin.reshape(batch, head_dim))
    launch_partials(q, keys, values, mask, scaling, cache_position, acc, maxima, sums, rotary=rotary)
    launch_merge(acc, maxima, sums, out, cache_position, keys.shape[2])
    return out


@split_kv_attention_rotary.register_fake
def _(q, k, v, cos, sin, keys, values, mask, scaling, cache_position):
    return q.new_empty(q.shape[0], q.shape[1] // keys.shape[3], 1, keys.shape[3])


def combine_partials(acc: torch.Tensor, maxima: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """Merge per-chunk softmax partials ``acc[N, S, G, D]`` (unnormalised), ``maxima/sums[N, S, G]`` into
    ``[N, G, D]`` in fp32. Chunks that saw no position have max `MIN_STAT` and weigh exactly zero."""
    overall = maxima.amax(dim=1, keepdim=True)
    weights = torch.exp(maxima - overall)
    return (acc * weights[..., None]).sum(1) / (sums * weights).sum(1)[..., None]


def partials_reference(q, keys, values, mask, scaling, cache_position, chunk: int):
    """The kernel's partials in torch (fp32), chunk by chunk: ``(acc, maxima, sums)``."""
    batch, heads, _, head_dim = q.shape
    kv_heads, cache_len = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    splits = _cdiv(cache_len, chunk)
    last = int(cache_position[0])
    qg = q.float().reshape(batch, kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,bhld->bhgl", qg, keys.float()) * scaling + mask.float().reshape(batch, 1, 1, -1)
    scores[..., last + 1 :] = float("-inf")
    acc = torch.zeros(batch * kv_heads, splits, group, head_dim)
    maxima = torch.full((batch * kv_heads, splits, group), MIN_STAT)
    sums = torch.zeros(batch * kv_heads, splits, group)
    for split in range(splits):
        block = scores[..., split * chunk : (split + 1) * chunk].reshape(batch * kv_heads, group, -1)
        block_max = torch.maximum(block.amax(-1), torch.tensor(MIN_STAT))
        probs = torch.exp(block - block_max[..., None])
        part_values = values.float()[:, :, split * chunk : (split + 1) * chunk].reshape(batch * kv_heads, -1, head_dim)
        acc[:, split] = probs @ part_values
        maxima[:, split], sums[:, split] = block_max, probs.sum(-1)
    return acc, maxima, sums
