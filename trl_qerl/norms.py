"""RMSNorm discovery, and fp32 master weights for the norms that are trained or receive AQN noise.

A norm weight near 1.0 stored in bf16 has a spacing of 2^-7 ≈ 7.8e-3: an AdamW update of 1e-5 or an AQN draw of
σ = 1e-3 rounds away. So the norms QeRL trains or perturbs keep their weight in fp32 (`use_fp32_weight`). The
norm then computes ``weight_fp32 * normalised`` in fp32 and a forward hook rounds that product to the input's
dtype once, so the activations that reach the next (NVFP4 or 16-bit) projection stay in the compute dtype: no
fp32 activations in the matmul kernels, and no bf16 copy of the weight in between.

Checked against transformers 5.17-5.24: Llama/Qwen2/Qwen3/Mistral RMSNorms return ``weight * x.to(input_dtype)``
(an fp32 product for an fp32 weight), Gemma's ``(1 + weight.float()) * x`` cast back to the input dtype.
"""

from __future__ import annotations

import torch
from torch import nn


def is_rms_norm_like(module: nn.Module) -> bool:
    """A module with a 1-D weight, an epsilon, and no bias: Llama/Qwen/Mistral/Gemma RMSNorms and look-alikes."""
    weight = getattr(module, "weight", None)
    has_eps = any(hasattr(module, attr) for attr in ("eps", "variance_epsilon", "epsilon"))
    return isinstance(weight, torch.Tensor) and weight.ndim == 1 and has_eps and getattr(module, "bias", None) is None


def active_module(module: nn.Module) -> nn.Module:
    """The module that runs: for a PEFT ``modules_to_save`` wrapper, its trained copy (noise goes on top of it)."""
    copies = getattr(module, "modules_to_save", None)
    if isinstance(copies, nn.ModuleDict) and not getattr(module, "disable_adapters", False):
        active = getattr(module, "active_adapter", None)
        if isinstance(active, (list, tuple)):  # empty when the active adapter trains no copy of this module
            active = active[0] if active else None
        if active in copies:
            return copies[active]
    return getattr(module, "original_module", module)


def rms_norms(model: nn.Module) -> dict[str, nn.Module]:
    """Every RMSNorm-like module by qualified name; PEFT ``modules_to_save`` wrappers are kept whole (resolve the
    module that runs with `active_module`)."""
    found = {}
    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        if leaf in ("original_module", "modules_to_save") or ".modules_to_save." in name:
            continue
        if is_rms_norm_like(active_module(module)):
            found[name] = module
    return found


def _round_output_to_input_dtype(module: nn.Module, args: tuple, kwargs: dict, output):
    hidden = args[0] if args else next(iter(kwargs.values()), None)
    if isinstance(output, torch.Tensor) and isinstance(hidden, torch.Tensor) and output.dtype != hidden.dtype:
        return output.to(hidden.dtype)
    return output


def use_fp32_weight(module: nn.Module) -> bool:
    """Keep the weight of norm ``module`` in fp32 and round its output to the input dtype once.

    Idempotent; the `nn.Parameter` object is kept (``param.data`` is replaced), so optimizers and other holders
    of the parameter stay valid. Returns True if the weight was upcast now.
    """
    weight = module.weight
    upcast = weight.dtype != torch.float32
    if upcast:
        weight.data = weight.data.float()
    if not getattr(module, "_qerl_rounds_output", False):
        module.register_forward_hook(_round_output_to_input_dtype, with_kwargs=True)
        module._qerl_rounds_output = True
    return upcast


def keep_fp32_trainable_norms(model: nn.Module) -> list[str]:
    """`use_fp32_weight` on every norm whose running weight is trainable; returns their names."""
    names = []
    for name, module in rms_norms(model).items():
        active = active_module(module)
        if active.weight.requires_grad:
            use_fp32_weight(active)
            names.append(name)
    return names
