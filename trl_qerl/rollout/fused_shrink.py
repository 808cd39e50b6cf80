"""LoRA shrinks fused into the kernel that makes their input, for the decode step's NVFP4 + LoRA-epilogue path.

With the LoRA expand in the NVFP4 kernel's epilogue, what is left of LoRA in a decode layer is the shrink
``t = h @ A.T`` of each projection group's input ``h``. Compiled, inductor writes each shrink as a reduction of its
own: ``h`` comes from a norm or from SiLU·up, which the NVFP4 product also reads, so inductor stores ``h`` in one
kernel and recomputes it in another that reduces against ``A`` (the down projection's shrink, 18,944 long on 7B,
even in two). That is five launches per layer for three small products (H200, 7B, 2026-12-02: 16 launches per
layer, ~2 µs of gap after each). These ops make each ``h`` and its shrink in one launch:

* `rms_norm_shrink` / `add_rms_norm_shrink`: ``s = x + residual`` (the second), ``h = rms_norm(s)`` and ``t``;
* `silu_mul_shrink`: ``y = silu(gate) * up`` and ``t``;
* `plain_shrink`: ``t`` alone, for an input no kernel of ours makes (the o projection's, from the attention), so that
  the shrink is a launch of ours (Programmatic Dependent Launch, `_pdl_kernel`) rather than inductor's reduction.

Numbers: the formulas and roundings of `fused_decode.rms_norm` (normalise in fp32, round, multiply by the weight,
round once) and of ``F.silu(gate) * up`` (each op rounded to the input dtype), ``t`` in fp32 from the rounded ``h``,
as `fused_decode` computes it unfused; only the summation order of the norm's mean and of ``t`` differs. On CUDA a
Triton kernel (`_fused_shrink_kernel`) runs; elsewhere the torch formulas (`*_reference`), which are the tests'
reference. ``lora_a`` is a list of one to three fp32 A matrices whose products sit side by side in ``t``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .decode_attention import triton_available


__all__ = [
    "add_rms_norm_shrink",
    "fused_shrink_applies",
    "plain_shrink",
    "rms_norm_reference",
    "rms_norm_shrink",
    "shrink_reference",
    "silu_mul_shrink",
]


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm: normalise in fp32, round to the input dtype, multiply by the weight (an fp32
    weight's product is rounded to the input dtype once, as `trl_qerl.norms` does)."""
    dtype = x.dtype
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed.to(dtype)).to(dtype)


def shrink_reference(h: torch.Tensor, lora_a: list[torch.Tensor]) -> torch.Tensor:
    """``h @ A.T`` of each A in fp32, side by side ``[M, Σ ranks]``."""
    return torch.cat([F.linear(h.float(), a) for a in lora_a], dim=-1)


def fused_shrink_applies(x: torch.Tensor, lora_a: list[torch.Tensor]) -> bool:
    """Whether the ops take ``x[M, K]`` (or each of gate and up of that shape) with these A matrices: one to three
    fp32 ``[r, K]`` matrices, contiguous, on ``x``'s device; ``x`` bf16 or fp16 with a contiguous last dim."""
    return (
        1 <= len(lora_a) <= 3
        and x.dim() == 2
        and x.stride(-1) == 1
        and x.dtype in (torch.bfloat16, torch.float16)
        and all(
            a.dtype == torch.float32 and a.dim() == 2 and a.shape[1] == x.shape[1] and a.is_contiguous()
            and a.device == x.device
            for a in lora_a
        )
    )  # fmt: skip


def _runs_triton(x: torch.Tensor) -> bool:
    return x.device.type == "cuda" and triton_available()


def _new_t(x: torch.Tensor, lora_a: list[torch.Tensor]) -> torch.Tensor:
    return x.new_empty(x.shape[0], sum(a.shape[0] for a in lora_a), dtype=torch.float32)


@torch.library.custom_op("trl_qerl::rms_norm_shrink", mutates_args=())
def rms_norm_shrink(
    x: torch.Tensor, weight: torch.Tensor, eps: float, lora_a: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, t)``: ``h = rms_norm(x)`` in ``x``'s dtype and ``t = h @ A.T`` (fp32) for ``x[M, K]``."""
    if not _runs_triton(x):
        h = rms_norm_reference(x, weight, eps)
        return h, shrink_reference(h, lora_a)
    from ._fused_shrink_kernel import norm_shrink

    h, t = torch.empty_like(x), _new_t(x, lora_a)
    norm_shrink(x, None, weight, eps, lora_a, None, h, t)
    return h, t


@rms_norm_shrink.register_fake
def _(x, weight, eps, lora_a):
    return torch.empty_like(x), _new_t(x, lora_a)


@torch.library.custom_op("trl_qerl::add_rms_norm_shrink", mutates_args=())
def add_rms_norm_shrink(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, lora_a: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(s, h, t)``: ``s = x + residual``, ``h = rms_norm(s)`` (both in ``x``'s dtype), ``t = h @ A.T`` (fp32)."""
    if not _runs_triton(x):
        s = x + residual
        h = rms_norm_reference(s, weight, eps)
        return s, h, shrink_reference(h, lora_a)
    from ._fused_shrink_kernel import norm_shrink

    s, h, t = torch.empty_like(x), torch.empty_like(x), _new_t(x, lora_a)
    norm_shrink(x, residual, weight, eps, lora_a, s, h, t)
    return s, h, t


@add_rms_norm_shrink.register_fake
def _(x, residual, weight, eps, lora_a):
    return torch.empty_like(x), torch.empty_like(x), _new_t(x, lora_a)


@torch.library.custom_op("trl_qerl::silu_mul_shrink", mutates_args=())
def silu_mul_shrink(
    gate: torch.Tensor, up: torch.Tensor, lora_a: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, t)``: ``y = silu(gate) * up`` in ``gate``'s dtype and ``t = y @ A.T`` (fp32), for ``[M, K]`` inputs
    (rows may be strided, e.g. the halves of a fused gate/up output)."""
    if not _runs_triton(gate):
        y = F.silu(gate) * up
        return y, shrink_reference(y, lora_a)
    from ._fused_shrink_kernel import silu_mul_shrink as launch

    y, t = gate.new_empty(gate.shape), _new_t(gate, lora_a)
    launch(gate, up, lora_a, y, t)
    return y, t


@silu_mul_shrink.register_fake
def _(gate, up, lora_a):
    return gate.new_empty(gate.shape), _new_t(gate, lora_a)


@torch.library.custom_op("trl_qerl::plain_shrink", mutates_args=())
def plain_shrink(x: torch.Tensor, lora_a: list[torch.Tensor]) -> torch.Tensor:
    """``t = x @ A.T`` (fp32, the A matrices' products side by side) for ``x[M, K]``."""
    if not _runs_triton(x):
        return shrink_reference(x, lora_a)
    from ._fused_shrink_kernel import shrink as launch

    t = _new_t(x, lora_a)
    launch(x, lora_a, t)
    return t


@plain_shrink.register_fake
def _(x, lora_a):
    return _new_t(x, lora_a)
