"""LoRA on NVFP4 layers through PEFT: an activation-dtype LoRA layer, adapter loading, and merged export.

`NVFP4A16Linear` is an ``nn.Linear``, so plain PEFT needs nothing from this module: ``peft.get_peft_model(model,
LoraConfig(target_modules="all-linear"))``, ``PeftModel.from_pretrained`` and TRL's ``peft_config=`` wrap NVFP4
layers with PEFT's own ``lora.Linear``. That layer casts the activations to the adapter dtype, so with fp32 adapter
masters (PEFT's default ``autocast_adapter_dtype=True``) its LoRA products run in fp32, and the fp32 copy of each
input is what autograd keeps for the LoRA backward.

`nvfp4_lora_config` / `get_peft_model` here (what `QeRLGRPOTrainer` uses) register `LoraNVFP4Linear` instead
(PEFT's experimental ``LoraConfig._register_custom_module``): the same adapters, but the products run in the
activation dtype (the fp32 masters are cast to it, as autocast would), so a bf16 model keeps bf16 activations for
backward. The registration is not saved with the adapter; `load_adapter` re-registers it, and plain PEFT loading
falls back to ``lora.Linear``. Saved adapters are plain PEFT adapters either way (standard key names): they load
onto the 16-bit base model with PEFT alone.

Merging LoRA into 4-bit weights (dequantise, add, requantise) rounds away every update smaller than one E2M1
step, so merging refuses (`NVFP4WeightError`, from either layer); `merge_and_export` merges into the 16-bit master
weights instead and can quantise the result afresh.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel
from peft import get_peft_model as peft_get_peft_model
from peft.tuners.lora.layer import Linear as LoraLinear
from torch import nn

from .checkpoints import atomic_directory, check_base_fingerprint, check_output_dir
from .nvfp4.linear import MERGE_REFUSAL, NVFP4A16Linear, NVFP4WeightError
from .quantizer import NVFP4A16Config


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The seven projections of a Llama/Qwen/Mistral decoder layer, the paper's LoRA targets."""
TRAINED_NORMS = ("input_layernorm", "post_attention_layernorm")
"""The RMSNorms that QeRL's reference scripts train alongside LoRA (and that AQN perturbs)."""


class LoraNVFP4Linear(LoraLinear):
    """PEFT's ``lora.Linear`` on a frozen `NVFP4A16Linear`, with the LoRA products in the activation dtype:
    ``y = base(x) + B(A(dropout(x))) * scaling``.

    Adapters are created in the base layer's compute dtype on its device; ``get_peft_model`` (PEFT's default
    ``autocast_adapter_dtype=True``) and `QeRLGRPOTrainer` keep them as fp32 masters, so that small optimizer
    updates are not rounded away. The products run in the activation dtype (the weights are cast to it, as
    autocast does), so a bf16 model computes LoRA in bf16. Options that need the dense base weight (DoRA, LoRA
    bias, PiSSA/OLoRA/LoftQ-style initialisations) and other LoRA variants are refused.
    """

    def __init__(
        self, base_layer: nn.Module, adapter_name: str, config: LoraConfig, r: int = 0, lora_alpha: int = 1, **kwargs
    ) -> None:
        for option, unsupported in (
            ("lora_bias", config.lora_bias),
            ("use_dora", config.use_dora),
            (
                "init_lora_weights",
                isinstance(config.init_lora_weights, str) and config.init_lora_weights != "gaussian",
            ),
        ):
            if unsupported:
                raise ValueError(
                    f"{type(self).__name__} does not support {option}={getattr(config, option)!r} (it needs the "
                    f"dense base weight); use the default LoRA settings for NVFP4 layers."
                )
        super().__init__(base_layer, adapter_name, config=config, r=r, lora_alpha=lora_alpha, **kwargs)
        self.fan_in_fan_out = False  # an nn.Linear weight is [out, in], whatever the config says
        if self.lora_variant:
            variant = type(self.lora_variant[adapter_name]).__name__
            raise ValueError(f"{type(self).__name__} does not support the LoRA variant {variant}; use plain LoRA.")

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        raise NVFP4WeightError(MERGE_REFUSAL)

    def unmerge(self) -> None:
        # Nothing is ever merged into the packed weights, so there is nothing to undo.
        return None

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._check_forward_args(x, *args, **kwargs)
        adapter_names = kwargs.pop("adapter_names", None)
        if self.disable_adapters:
            return self.base_layer(x, *args, **kwargs)
        if adapter_names is not None:
            return self._mixed_batch_forward(x, *args, adapter_names=adapter_names, **kwargs)
        flat = x.reshape(-1, x.shape[-1])  # 2-D: the base layer's output is then its Function's own, not a view
        result = self.base_layer(flat, *args, **kwargs)
        for active_adapter in self.active_adapters:
            if active_adapter not in self.lora_A:
                continue
            lora_a, lora_b = self.lora_A[active_adapter], self.lora_B[active_adapter]
            dropout, scaling = self.lora_dropout[active_adapter], self.scaling[active_adapter]
            result = _add_lora_product(result, dropout(flat), lora_a.weight, lora_b.weight, scaling)
        return result.view(*x.shape[:-1], result.shape[-1])


def _add_lora_product(
    result: torch.Tensor, hidden: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor, scaling: float
) -> torch.Tensor:
    """``result + scaling * B(A(hidden))`` for 2-D ``result`` and ``hidden``, with the products in the activation
    dtype (the fp32 masters cast to it, as autocast does in the loss forward).

    The expand, the scaling and the sum are one GEMM accumulating into the base layer's output in place (``addmm_``,
    alpha = ``scaling``): no elementwise pass and no copy of the ``[tokens, out_features]`` output, forward or
    backward (the scaling lands on the small ``[tokens, r]`` and ``[r, out]`` gradients). In place is safe because
    ``result`` is the base layer's fresh output (`NVFP4LinearFunction` returns no view), which its backward does not
    read (it saves only the packed weights). Elsewhere (a view, another dtype, or traced by ``torch.compile``) the sum
    is out of place.
    """
    device = hidden.device.type
    compute = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    shrunk = F.linear(hidden.to(compute), weight_a.to(compute))
    expand = weight_b.to(compute).t()
    if result.dtype != compute:
        return result + (shrunk @ expand * scaling).to(result.dtype)
    if torch.compiler.is_compiling() or result._is_view() or not result.is_contiguous():
        # (traced: `_is_view` would break the graph, and inductor chooses in place for itself)
        return torch.addmm(result, shrunk, expand, alpha=scaling)
    return result.addmm_(shrunk, expand, alpha=scaling)


def register_nvfp4_lora(config: LoraConfig) -> LoraConfig:
    """Teach ``config`` (in place, and return it) to put `LoraNVFP4Linear` on `NVFP4A16Linear` layers (without
    this, PEFT uses its own ``lora.Linear``, which works too; see the module docstring for the difference)."""
    config._register_custom_module({NVFP4A16Linear: LoraNVFP4Linear})
    return config


def _linear_leaf_names(model: nn.Module) -> list[str]:
    """Leaf names of the Linear-like layers a LoRA can target, output embedding excluded."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {
        name.rpartition(".")[2]
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and module is not output
    }
    return sorted(names)


def resolve_target_modules(model: nn.Module, target_modules: str | Sequence[str] | None) -> list[str]:
    """The projections to put LoRA on: the seven decoder projections by default, every Linear layer (NVFP4 or
    16-bit) but the output embedding for ``"all-linear"`` (as PEFT's own "all-linear", but as leaf names), or an
    explicit list checked against the model."""
    available = _linear_leaf_names(model)
    if target_modules is None:
        chosen = [name for name in PROJECTIONS if name in available]
        if not chosen:
            raise ValueError(
                f"None of the default LoRA targets {list(PROJECTIONS)} is a Linear layer of this model; pass "
                f"target_modules explicitly. Linear layers found: {available}."
            )
        return chosen
    if target_modules == "all-linear":
        return available
    chosen = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    missing = [name for name in chosen if name not in available]
    if missing:
        raise ValueError(f"LoRA target_modules {missing} are not Linear layers of this model; found {available}.")
    return chosen


def nvfp4_lora_config(
    model: nn.Module | None = None,
    r: int = 32,
    lora_alpha: int | None = None,
    lora_dropout: float = 0.0,
    target_modules: str | Sequence[str] | None = None,
    train_norms: bool = True,
    **kwargs: Any,
) -> LoraConfig:
    """The paper's LoRA setting as a registered `LoraConfig`.

    Args:
        model: used to resolve and check ``target_modules`` (recommended).
        r: LoRA rank (paper's main tables: 32).
        lora_alpha: scaling numerator; defaults to ``2 * r``.
        lora_dropout: dropout on the adapter input (0 in the paper).
        target_modules: None for the seven decoder projections, ``"all-linear"``, or a list of leaf names.
        train_norms: also train ``input_layernorm`` and ``post_attention_layernorm`` (PEFT ``modules_to_save``), as
            QeRL's reference scripts do; saved adapters stay loadable by plain PEFT.
        **kwargs: any other `LoraConfig` field.
    """
    if not isinstance(r, int) or r <= 0:
        raise ValueError(f"LoRA rank must be a positive integer, got r={r!r}.")
    if lora_dropout < 0 or lora_dropout >= 1:
        raise ValueError(f"lora_dropout must be in [0, 1), got {lora_dropout}.")
    if model is not None:
        targets = resolve_target_modules(model, target_modules)
    elif target_modules == "all-linear":
        raise ValueError("target_modules='all-linear' needs the model to resolve NVFP4 layers: pass model=...")
    else:
        targets = list(PROJECTIONS) if target_modules is None else target_modules
    modules_to_save = list(kwargs.pop("modules_to_save", None) or [])
    if train_norms:
        modules_to_save += [name for name in TRAINED_NORMS if name not in modules_to_save]
    config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha if lora_alpha is not None else 2 * r,
        lora_dropout=lora_dropout,
        target_modules=targets,
        modules_to_save=modules_to_save or None,
        task_type=kwargs.pop("task_type", "CAUSAL_LM"),
        **kwargs,
    )
    return register_nvfp4_lora(config)


def get_peft_model(model: nn.Module, config: LoraConfig | None = None, **kwargs: Any) -> PeftModel:
    """`peft.get_peft_model` with `LoraNVFP4Linear` on NVFP4 layers (LoRA products in the activation dtype) and
    ``"all-linear"`` resolved to leaf names. Plain ``peft.get_peft_model`` works on NVFP4 models too."""
    if config is None:
        config = nvfp4_lora_config(model)
    if config.target_modules == "all-linear":
        config.target_modules = resolve_target_modules(model, "all-linear")
    if isinstance(config, LoraConfig):
        if config.r <= 0:
            raise ValueError(f"LoRA rank must be a positive integer, got r={config.r}.")
        register_nvfp4_lora(config)
    return peft_get_peft_model(model, config, **kwargs)


def load_adapter(
    model: nn.Module, adapter_path: str | os.PathLike, is_trainable: bool = False, **kwargs: Any
) -> PeftModel:
    """Load a saved LoRA adapter onto an NVFP4 (or 16-bit) base model with `LoraNVFP4Linear` on NVFP4 layers.
    (Plain ``PeftModel.from_pretrained`` works too, with PEFT's ``lora.Linear``.) An adapter saved by trl-qerl
    records its base model's fingerprint; loading it onto a different base logs a warning."""
    config = register_nvfp4_lora(LoraConfig.from_pretrained(str(adapter_path)))
    if Path(adapter_path).is_dir():
        check_base_fingerprint(adapter_path, model, strict=False)
    return PeftModel.from_pretrained(model, str(adapter_path), config=config, is_trainable=is_trainable, **kwargs)


def merge_and_export(
    model: PeftModel,
    output_dir: str | os.PathLike,
    base_model: str | os.PathLike | None = None,
    export_format: Literal["bf16", "nvfp4"] = "bf16",
    dtype: torch.dtype = torch.bfloat16,
    quantization_config: NVFP4A16Config | None = None,
    overwrite: bool = False,
    **load_kwargs: Any,
) -> str:
    """Merge LoRA adapters (and trained norms) into the 16-bit master weights and save a checkpoint.

    Args:
        model: a trained `PeftModel` (on an NVFP4 or 16-bit base).
        output_dir: where to write the merged checkpoint.
        base_model: the 16-bit checkpoint whose weights the adapter is merged into; defaults to the adapter's
            ``base_model_name_or_path``. It must not be an NVFP4 checkpoint: its rounding is already baked in.
        export_format: ``"bf16"`` for a 16-bit checkpoint, ``"nvfp4"`` for a fresh compressed-tensors NVFP4 one.
        dtype: dtype of the 16-bit master weights.
        quantization_config: options for the NVFP4 export.
        overwrite: replace a non-empty ``output_dir`` (otherwise refused before any work). The checkpoint is
            written beside it and renamed into place once complete (`trl_qerl.checkpoints.atomic_directory`).
        **load_kwargs: passed to ``from_pretrained`` of the base (``device_map``, ``trust_remote_code``, ...).

    Returns:
        ``output_dir`` as a string.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from .loading import from_pretrained

    if export_format not in ("bf16", "nvfp4"):
        raise ValueError(f"export_format must be 'bf16' or 'nvfp4', got {export_format!r}.")
    adapter_name = model.active_adapter
    source = base_model or model.peft_config[adapter_name].base_model_name_or_path
    if not source:
        raise ValueError("The adapter does not record its base model; pass base_model=<16-bit checkpoint>.")
    if getattr(AutoConfig.from_pretrained(source), "quantization_config", None) is not None:
        raise ValueError(
            f"{source} is a quantised checkpoint; merging needs the 16-bit master weights (base_model=...)."
        )
    check_output_dir(output_dir, inputs=[source], overwrite=overwrite)
    with tempfile.TemporaryDirectory() as adapter_dir:
        model.save_pretrained(adapter_dir, selected_adapters=[adapter_name])
        dense = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **load_kwargs)
        merged = PeftModel.from_pretrained(
            dense, os.path.join(adapter_dir, *([] if adapter_name == "default" else [adapter_name]))
        )
        merged = merged.merge_and_unload()
    if export_format == "bf16":
        with atomic_directory(output_dir) as staging:
            merged.save_pretrained(staging)
        return str(output_dir)
    with tempfile.TemporaryDirectory() as dense_dir:
        merged.save_pretrained(dense_dir)
        del merged
        quantized = from_pretrained(dense_dir, quantization_config=quantization_config, dtype=dtype, **load_kwargs)
        with atomic_directory(output_dir) as staging:
            quantized.save_pretrained(staging)
    return str(output_dir)
