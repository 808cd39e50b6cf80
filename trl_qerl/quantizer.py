"""The transformers quantizer for `NVFP4A16Config`: NVFP4 base weights through the ordinary `from_pretrained`.

The config lives in `trl_qerl.quantization_config`, the choice of layers and shared-scale groups in
`trl_qerl.nvfp4.replace`, the checkpoint checks in `trl_qerl.nvfp4.checkpoint_checks`, the layer in
`trl_qerl.nvfp4.linear`; this module wires them into transformers' loading hooks and registers them.

* ``AutoModelForCausalLM.from_pretrained(bf16_checkpoint, quantization_config=NVFP4A16Config())`` quantises while
  loading: each Linear weight is quantised as soon as it (and the other members of its shared-scale group,
  q/k/v or gate/up) has been read, so the whole 16-bit model never sits on the device.
* Pre-quantised compressed-tensors NVFP4 checkpoints load for training through `trl_qerl.from_pretrained` (see
  `trl_qerl.loading`), which routes them to this quantizer instead of compressed-tensors' decompressing one.
  (transformers picks the quantizer from the checkpoint's ``quant_method``, "compressed-tensors", and refuses a
  different ``quantization_config`` argument before any quantizer code runs, so plain
  ``AutoModelForCausalLM.from_pretrained`` cannot be redirected without patching transformers.)
* ``save_pretrained`` writes a compressed-tensors "nvfp4-pack-quantized" checkpoint: `NVFP4A16Config.to_dict`
  emits compressed-tensors' own config (and `NVFP4A16Config.from_dict` reads it back), so vLLM and
  transformers + compressed-tensors read our checkpoints without this package, and nothing falls into
  transformers' "unknown quant_method: load as random bf16" trap.
* `quantize_model` converts a model already in memory through the same quantizer hooks as loading
  (``preprocess_model``, the per-weight quantise op, ``postprocess_model``).

The names say W4A16 ("NVFP4A16", llm-compressor's name for the scheme): transformers has its own, unrelated
``NVFP4Config``/``NVFP4HfQuantizer`` (W4A4 for Blackwell, inference only). The old names remain as deprecated
aliases for one release.

Checked against transformers 5.17 and 5.24 (quantizer API: `param_needs_quantization`, `get_quantize_ops`,
`ConversionOps.convert(..., full_layer_name=, missing_keys=)`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

from .nvfp4._deprecation import deprecated_names
from .nvfp4.checkpoint_checks import check_checkpoint_tensors, check_loaded_layer, check_safetensors_only
from .nvfp4.format import GROUP_SIZE, check_quantizable, quantize, shared_global_scale
from .nvfp4.linear import QUANTIZED_TENSOR_NAMES, NVFP4A16Linear, nvfp4_modules
from .nvfp4.replace import adapter_subtrees, matches, shared_scale_groups
from .quantization_config import (
    COMPRESSED_TENSORS_FORMAT,
    DEFAULT_SHARED_SCALE_GROUPS,
    QUANT_METHOD,
    NVFP4A16Config,
    check_compressed_tensors_config,
)


class NVFP4QuantizeOp(ConversionOps):
    """Quantises one checkpoint weight while it loads (transformers' on-the-fly conversion hook)."""

    def __init__(self, quantizer: NVFP4A16HfQuantizer) -> None:
        self.quantizer = quantizer

    def convert(self, input_dict, *args, full_layer_name=None, model=None, missing_keys=None, **kwargs):
        value = next(iter(input_dict.values()))
        tensor = value[0] if isinstance(value, list) else value
        return self.quantizer.quantize_loaded_weight(model, full_layer_name, tensor, missing_keys)


class NVFP4A16HfQuantizer(HfQuantizer):
    """transformers quantizer for `NVFP4A16Config` (quantise on load, or load pre-quantised tensors by name)."""

    requires_calibration = False

    def __init__(self, quantization_config: NVFP4A16Config, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self._group_of: dict[str, tuple[str, ...]] = {}
        self._pending: dict[tuple[str, ...], dict[str, torch.Tensor]] = {}
        self._errors: dict[str, str] = {}

    # -- environment -----------------------------------------------------------------------------------------
    def validate_environment(self, device_map=None, weights_only=True, **kwargs) -> None:
        if isinstance(device_map, dict):
            devices = {str(d) for d in device_map.values()}
            if "disk" in devices or ("cpu" in devices and len(devices) > 1):
                raise ValueError(
                    f"NVFP4 models cannot be offloaded to CPU or disk (device_map uses {sorted(devices)}); load the "
                    "whole model on one kind of device, e.g. device_map='cuda' or device_map='cpu'."
                )

    @property
    def is_trainable(self) -> bool:
        return True

    def is_serializable(self, safe_serialization=None) -> bool:
        return True

    @property
    def is_compileable(self) -> bool:
        return True

    # -- conversion ------------------------------------------------------------------------------------------
    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        check_safetensors_only(checkpoint_files)
        converted = self.select_linears(model)
        for name in converted:
            model.set_submodule(name, self._nvfp4_placeholder(model.get_submodule(name)))
        self._group_of = shared_scale_groups(converted, self.quantization_config.shared_scale_groups)
        if self.pre_quantized and checkpoint_files:
            check_checkpoint_tensors(checkpoint_files, {n: model.get_submodule(n) for n in converted})
        return model

    def select_linears(self, model) -> list[str]:
        """Names of the Linear layers to quantise; records the rest in ``quantization_config.ignore`` and warns
        once about layers kept in 16-bit because ``in_features`` is not a multiple of 16."""
        config: NVFP4A16Config = self.quantization_config
        keep = self.get_modules_to_not_convert(model, config.modules_to_not_convert, add_default_skips=True)
        ignored, unaligned, converted = [], [], []
        adapters = adapter_subtrees(model)
        for name, module in model.named_modules():
            if not isinstance(module, nn.Linear) or isinstance(module, NVFP4A16Linear) or name.startswith(adapters):
                continue
            if matches(name, module, keep) or (self.pre_quantized and matches(name, module, config.ignore)):
                ignored.append(name)
            elif self.pre_quantized and not matches(name, module, config.targets):
                ignored.append(name)
            elif module.in_features % GROUP_SIZE != 0:
                if self.pre_quantized:
                    raise ValueError(
                        f"{name}: in_features={module.in_features} is not a multiple of {GROUP_SIZE}, yet the "
                        "checkpoint does not list it in `ignore`; the checkpoint is inconsistent."
                    )
                unaligned.append(name)
            else:
                converted.append(name)
        if unaligned:
            warnings.warn(
                f"Keeping {len(unaligned)} Linear layer(s) in 16-bit because in_features is not a multiple of "
                f"{GROUP_SIZE}: {', '.join(unaligned)}.",
                stacklevel=3,
            )
        config.ignore = sorted(set(ignored + unaligned))
        _warn_unmatched(model, config.modules_to_not_convert or ())
        if not converted:
            raise ValueError(
                f"No Linear layer of this {type(model).__name__} can be quantised to NVFP4 (kept in 16-bit: "
                f"{len(config.ignore)} by modules_to_not_convert/ignore or in_features not a multiple of "
                f"{GROUP_SIZE}); the model would be 16-bit while calling itself NVFP4. Load it without "
                "NVFP4A16Config, or keep fewer layers."
            )
        return converted

    def _nvfp4_placeholder(self, linear: nn.Linear) -> NVFP4A16Linear:
        bias = linear.bias
        with torch.device("meta"):
            layer = NVFP4A16Linear(
                linear.in_features,
                linear.out_features,
                bias=bias is not None,
                dtype=bias.dtype if bias is not None else None,
                compute_dtype=linear.weight.dtype,
            )
            if not self.pre_quantized:
                # The 16-bit checkpoint weight loads into this placeholder's name and is converted at once.
                layer.weight = nn.Parameter(torch.empty_like(linear.weight, device="meta"), requires_grad=False)
        return layer

    def param_element_size(self, model, param_name: str, param: torch.Tensor) -> float:
        # transformers pre-allocates device memory for the whole model before loading; the 16-bit placeholder
        # of a layer quantised on load never exists at full size (its packed tensors are counted themselves).
        if self.param_needs_quantization(model, param_name):
            return 0
        return param.element_size()

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        if self.pre_quantized:
            return False
        module_name, _, leaf = param_name.rpartition(".")
        return leaf == "weight" and isinstance(model.get_submodule(module_name), NVFP4A16Linear)

    def get_quantize_ops(self) -> NVFP4QuantizeOp:
        return NVFP4QuantizeOp(self)

    def quantize_loaded_weight(self, model, param_name, tensor, missing_keys) -> dict[str, torch.Tensor]:
        """Hold the weight until its shared-scale group is complete, then quantise the whole group."""
        module_name = param_name.rpartition(".")[0]
        try:
            check_quantizable(tensor, module_name)
        except ValueError as error:
            # Raising here would only be logged by transformers; report it after loading instead.
            self._errors[module_name] = str(error)
            return {}
        group = self._group_of.get(module_name, (module_name,))
        pending = self._pending.setdefault(group, {})
        pending[module_name] = tensor
        if len(pending) < len(group):
            return {}
        del self._pending[group]
        global_scale = shared_global_scale(list(pending.values()))
        converted = {}
        for name, weight in pending.items():
            quantized = quantize(weight, global_scale, name=name)
            converted.update({f"{name}.{k}": v for k, v in zip(QUANTIZED_TENSOR_NAMES, quantized)})
            layer = model.get_submodule(name)
            del layer.weight
            if missing_keys is not None:
                missing_keys.discard(f"{name}.weight")
        return converted

    def _process_model_after_weight_loading(self, model, **kwargs):
        problems = dict(self._errors)
        waiting = {}  # loaded, but a sibling sharing its global scale never completed the group
        for group, pending in self._pending.items():
            for name in group:
                if name in pending:
                    waiting[name] = [sibling for sibling in group if sibling not in pending]
                elif name not in problems:
                    problems[name] = f"{name}: no weight in the checkpoint (missing tensor or shard)."
        for name, siblings in waiting.items():
            failed = [sibling for sibling in siblings if sibling in self._errors]
            problems[name] = (
                f"{name}: not quantised because {', '.join(failed or siblings)}, which "
                f"{'shares' if len(failed or siblings) == 1 else 'share'} its global scale, "
                f"{'could not be quantised (above)' if failed else 'has no weight in the checkpoint'}."
            )
        for name, layer in nvfp4_modules(model).items():
            if name in problems:
                continue
            if "weight" in layer._parameters:
                problems[name] = f"{name}: no weight in the checkpoint (missing tensor or shard)."
                continue
            try:
                check_loaded_layer(name, layer)
            except ValueError as error:
                problems[name] = str(error)
        self._pending.clear()
        self._errors.clear()
        if problems:
            raise ValueError(
                f"Could not load {len(problems)} NVFP4 layer(s):\n  "
                + "\n  ".join(problems[n] for n in sorted(problems))
            )
        return model

    def _dequantize(self, model, dtype=None):
        dtype = dtype or torch.bfloat16
        for name, layer in nvfp4_modules(model).items():
            linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
            linear.weight = nn.Parameter(layer.dequantize_weight(dtype), requires_grad=False)
            if layer.bias is not None:
                linear.bias = nn.Parameter(layer.bias.detach().to(dtype), requires_grad=False)
            model.set_submodule(name, linear)
        return model


def _warn_unmatched(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """Warn about (and return) ``modules_to_not_convert`` patterns that match no Linear layer: a typo would
    otherwise quantise the layer the user meant to keep."""
    linears = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    unmatched = [pattern for pattern in patterns if not any(matches(n, m, [pattern]) for n, m in linears)]
    if unmatched:
        examples = ", ".join(name for name, _ in linears[:3])
        warnings.warn(
            f"modules_to_not_convert pattern(s) {unmatched} match no Linear layer (names look like {examples}; a "
            "pattern is a name, a suffix such as 'o_proj', a class name, or 're:<regex>').",
            stacklevel=4,
        )
    return unmatched


def quantize_model(model, config: NVFP4A16Config | None = None):
    """Quantise an already-loaded 16-bit transformers model to NVFP4 in place and return it.

    For model instances built in memory (``from_pretrained(..., quantization_config=NVFP4A16Config())`` is the
    memory-frugal path for checkpoints: this one needs the 16-bit model in memory first). It runs the quantizer's
    own hooks, as ``from_pretrained`` does: ``preprocess_model`` swaps the selected Linears for NVFP4 placeholders,
    each 16-bit weight goes through the quantise-on-load conversion (shared-scale groups included), and
    ``postprocess_model`` checks the result and records the config. Skipped layers and the saved format are the
    same as on load.
    """
    if getattr(model, "is_quantized", False):
        if getattr(model, "quantization_method", None) == QUANT_METHOD:
            return model
        raise ValueError(
            f"The model is already quantised with {getattr(model, 'quantization_method', 'another method')!r}; "
            "load it in 16-bit to quantise it to NVFP4."
        )
    config = config or NVFP4A16Config()
    dense = {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    quantizer = NVFP4A16HfQuantizer(config, pre_quantized=False)
    # Every weight is checked before the first layer is swapped: a bad layer found half-way would leave a model
    # that is partly NVFP4 and partly 16-bit.
    problems = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # `preprocess_model` selects again, and warns then
        selected = quantizer.select_linears(model)
    for name in selected:
        try:
            check_quantizable(dense[name].weight.detach(), name)
        except ValueError as error:
            problems.append(str(error))
    if problems:
        raise ValueError(
            f"Cannot quantise {len(problems)} layer(s); the model is unchanged:\n  " + "\n  ".join(problems)
        )
    quantizer.preprocess_model(model)
    converted = {name: linear for name, linear in dense.items() if model.get_submodule(name) is not linear}
    del dense
    with torch.no_grad():
        for name in list(converted):
            linear = converted.pop(name)  # dropped once its group is quantised: one 16-bit group at a time
            if linear.bias is not None:
                model.get_submodule(name).bias = linear.bias
            tensors = quantizer.quantize_loaded_weight(model, f"{name}.weight", linear.weight.detach(), None)
            assign_quantized_tensors(model, tensors)
    model.hf_quantizer = quantizer  # set by from_pretrained itself, outside the quantizer's hooks
    quantizer.postprocess_model(model)
    return model


def assign_quantized_tensors(model, tensors: dict[str, torch.Tensor]) -> None:
    """Set the output of `NVFP4A16HfQuantizer.quantize_loaded_weight` (tensors by full name) on ``model`` as frozen
    parameters: what transformers' loader does with a conversion's output."""
    for key, tensor in tensors.items():
        module_name, _, leaf = key.rpartition(".")
        setattr(model.get_submodule(module_name), leaf, nn.Parameter(tensor, requires_grad=False))


def register() -> None:
    """Register `NVFP4A16Config` and `NVFP4A16HfQuantizer` with transformers (idempotent)."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(NVFP4A16Config)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(NVFP4A16HfQuantizer)


register()

__getattr__ = deprecated_names(
    __name__,
    {"NVFP4Config": "NVFP4A16Config", "NVFP4HfQuantizer": "NVFP4A16HfQuantizer"},
    lambda name: globals()[name],
)


__all__ = [
    "COMPRESSED_TENSORS_FORMAT",
    "assign_quantized_tensors",
    "DEFAULT_SHARED_SCALE_GROUPS",
    "NVFP4A16Config",
    "NVFP4A16HfQuantizer",
    "QUANT_METHOD",
    "check_compressed_tensors_config",
    "quantize_model",
    "register",
]
