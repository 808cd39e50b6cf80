"""LoRA products of decode steps above the NVFP4 epilogue's row limit, in two launches per projection group.

Up to `fused_decode.LORA_REDUCTION_ROWS` rows the NVFP4 kernel adds the LoRA terms in its epilogue. Above it, each
group of projections that read one input took fp32 cuBLAS products: the shrink ``x @ A.T`` over the group's stacked A
matrices and one expand ``t @ B.T`` per projection, then an add and a rounding, each its own launch. With TF32 off (the
default, and the rollout's numbers must stay fp32) cuBLAS runs these on CUDA cores with split-K and a separate
reduction: on the H200 (7B, batch 32, 2026-12-04) 422 kernels and 2.2 ms of a 6.1 ms decode step, in the bf16 + LoRA
arm as well. These ops make the same products in two Triton launches per group:

* `lora_shrink_rows`: ``t = x @ A.T`` of one to three fp32 A matrices side by side ``[M, Σ ranks]``, fp32;
* `lora_expand_add`: ``round(base_i + scaling_i * t_i @ B_i.T)`` for the group's projections in one launch.

Numbers: products of the rounded input with the fp32 adapters in 3xTF32 (tensor cores, each fp32 operand split into
two TF32 parts: within ~1e-6 of fp32, tested against float64), summed in fp32, the sum with the base output rounded
once, as the cuBLAS path computes them; an output differs from it by at most a rounding step where the fp32 sums land
on either side of one. On CUDA the Triton kernels (`_lora_rows_kernel`) run; elsewhere the torch formulas
(`*_reference`), which are the tests' reference. Measured on the H200 (7B, rank 32, 2026-12-04): the LoRA products of a
decode step 1.3 ms instead of 2.2 at batch 32; the step 6.56 -> 5.53 ms (NVFP4 + LoRA + AQN) and 8.23 -> 7.02 ms
(bf16 + LoRA) at batch 32, 8.28 -> 7.40 and 8.64 -> 7.62 ms at batch 64 (BENCHMARKS.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .decode_attention import triton_available
from .fused_shrink import shrink_reference


__all__ = [
    "adapter_refusal",
    "adapters_apply",
    "expand_add_reference",
    "expanded",
    "lora_expand_add",
    "lora_rows_applies",
    "lora_shrink_rows",
    "rank_supported",
    "runs_triton",
]


MAX_RANK = 64
"""Largest rank the expand kernel takes (its ``[rows, rank]`` and ``[columns, rank]`` tiles live in registers)."""


def rank_supported(rank: int) -> bool:
    """Whether the kernels take adapters of this rank: a multiple of 4 (the shrink's smallest rank block; ranks that
    are not multiples of 16 take its FMA mode) up to `MAX_RANK`."""
    return rank % 4 == 0 and 0 < rank <= MAX_RANK


def adapter_refusal(lora_a: torch.Tensor, lora_b: torch.Tensor) -> str | None:
    """Why the kernels cannot take this adapter (None: they can, given shapes that match the group)."""
    if not lora_a.dtype == lora_b.dtype == torch.float32:
        return f"{lora_a.dtype} adapters (it takes fp32 masters)"
    if not rank_supported(lora_a.shape[0]):
        return f"rank {lora_a.shape[0]} (it takes multiples of 4 up to {MAX_RANK})"
    return None


def adapters_apply(x: torch.Tensor, widths: list[int], lora_a: list[torch.Tensor], lora_b: list[torch.Tensor]) -> bool:
    """Whether the ops take ``x[M, K]`` (bf16 or fp16, contiguous last dim) with one to three projections of
    ``widths`` output features, each with one adapter `adapter_refusal` passes (``A[r, K]``, ``B[n, r]``, contiguous),
    all on ``x``'s device. (`lora_rows_applies` checks the base outputs too.)"""
    if not (x.dim() == 2 and x.stride(-1) == 1 and x.dtype in (torch.bfloat16, torch.float16)):
        return False
    if not 1 <= len(lora_a) == len(lora_b) == len(widths) <= 3:
        return False
    for width, a, b in zip(widths, lora_a, lora_b):
        rank = a.shape[0]
        if not (
            adapter_refusal(a, b) is None and a.is_contiguous() and b.is_contiguous()
            and a.shape == (rank, x.shape[1]) and b.shape == (width, rank) and a.device == b.device == x.device
        ):  # fmt: skip
            return False
    return True


def lora_rows_applies(
    x: torch.Tensor, bases: list[torch.Tensor], lora_a: list[torch.Tensor], lora_b: list[torch.Tensor]
) -> bool:
    """`adapters_apply`, and each base output ``[M, n]`` in ``x``'s dtype with a contiguous last dim, on ``x``'s
    device."""
    if not adapters_apply(x, [base.shape[-1] for base in bases], lora_a, lora_b):
        return False
    for base in bases:  # a loop, not all(...): this runs while dynamo traces the decode layer
        if not (
            base.dim() == 2 and base.shape[0] == x.shape[0] and base.stride(-1) == 1 and base.dtype == x.dtype
            and base.device == x.device
        ):  # fmt: skip
            return False
    return True


# Once: `runs_triton` also runs while the decode layer compiles, and dynamo stops at importlib.
_TRITON = triton_available()


def runs_triton(x: torch.Tensor) -> bool:
    """Whether the ops launch their Triton kernels for ``x`` (CUDA with Triton installed)."""
    return x.device.type == "cuda" and _TRITON


def expand_add_reference(
    bases: list[torch.Tensor], t: torch.Tensor, lora_b: list[torch.Tensor], scalings: list[float]
) -> list[torch.Tensor]:
    """``round(base_i + scaling_i * t_i @ B_i.T)``, ``t_i`` the columns of ``t`` after the ranks before it."""
    parts = t.split([b.shape[1] for b in lora_b], dim=-1)
    return [(base + F.linear(part, b) * scaling).to(base.dtype)
            for base, part, b, scaling in zip(bases, parts, lora_b, scalings)]  # fmt: skip


@torch.library.custom_op("trl_qerl::lora_shrink_rows", mutates_args=())
def lora_shrink_rows(x: torch.Tensor, lora_a: list[torch.Tensor]) -> torch.Tensor:
    """``x @ A.T`` (fp32) of each A side by side, ``[M, Σ ranks]``, for ``x[M, K]``."""
    if not runs_triton(x):
        return shrink_reference(x, lora_a)
    from ._lora_rows_kernel import shrink_rows

    t = x.new_empty(x.shape[0], sum(a.shape[0] for a in lora_a), dtype=torch.float32)
    shrink_rows(x, lora_a, t)
    return t


@lora_shrink_rows.register_fake
def _(x, lora_a):
    return x.new_empty(x.shape[0], sum(a.shape[0] for a in lora_a), dtype=torch.float32)


def expanded(
    bases: list[torch.Tensor], t: torch.Tensor, lora_b: list[torch.Tensor], scalings: list[float]
) -> list[torch.Tensor]:
    """``base_i + scaling_i * t_i @ B_i.T`` rounded once to the base's dtype, new tensors (see the module): the
    expand kernel where `runs_triton`, else `expand_add_reference`. The body of ``trl_qerl::lora_expand_add``, also
    called inside `lora_beside.products_lora_beside`."""
    if not runs_triton(t):
        return expand_add_reference(bases, t, lora_b, scalings)
    from ._lora_rows_kernel import expand_add

    outs = [torch.empty(base.shape, dtype=base.dtype, device=base.device) for base in bases]
    expand_add(bases, t, lora_b, scalings, outs)
    return outs


lora_expand_add = torch.library.custom_op("trl_qerl::lora_expand_add", expanded, mutates_args=())


@lora_expand_add.register_fake
def _(bases, t, lora_b, scalings):
    return [torch.empty(base.shape, dtype=base.dtype, device=base.device) for base in bases]
