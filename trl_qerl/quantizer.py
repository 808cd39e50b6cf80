"""`NVFP4A16Config` and its transformers quantizer: NVFP4 base weights through the ordinary `from_pretrained`.

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

import json
import re
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
from transformers.utils.quantization_config import QuantizationConfigMixin

from .nvfp4._deprecation import deprecated_names
from .nvfp4.format import GROUP_SIZE, check_packed, check_quantizable, quantize, shared_global_scale
from .nvfp4.linear import QUANTIZED_TENSOR_NAMES, NVFP4A16Linear, nvfp4_modules


QUANT_METHOD = "qerl_nvfp4"
COMPRESSED_TENSORS_FORMAT = "nvfp4-pack-quantized"
DEFAULT_SHARED_SCALE_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

# The weight arguments of compressed-tensors' "NVFP4A16" preset, as llm-compressor writes them and vLLM's
# W4A16 NVFP4 detection (`_is_fp4a16_nvfp4`) expects them.
_WEIGHT_ARGS = {
    "num_bits": 4,
    "type": "float",
    "symmetric": True,
    "group_size": GROUP_SIZE,
    "strategy": "tensor_group",
    "dynamic": False,
    "scale_dtype": "torch.float8_e4m3fn",
}
_SAFETENSORS_DTYPES = {
    "weight_packed": ("U8", torch.uint8),
    "weight_scale": ("F8_E4M3", torch.float8_e4m3fn),
    "weight_global_scale": ("F32", torch.float32),
}


class NVFP4A16Config(QuantizationConfigMixin):
    """Weight-only NVFP4 quantisation (W4A16) for QeRL: E2M1 values, FP8 block scales per 16, FP32 global scale.

    Args:
        modules_to_not_convert: extra Linear modules to keep in 16-bit (names, suffixes such as ``"o_proj"``, or
            ``"re:<regex>"``). ``lm_head``/tied embeddings are always kept, as are Linears whose ``in_features``
            is not a multiple of 16.
        shared_scale_groups: sibling Linears (by leaf name) that share one global scale because inference engines
            fuse them (vLLM requires it for q/k/v and gate/up).
        targets: compressed-tensors targets of a pre-quantised checkpoint (``"Linear"``, names or ``"re:"``).
        ignore: Linear modules left unquantised; filled in when a model is converted, saved as compressed-tensors'
            ``ignore`` list.

    ``to_dict()`` is the compressed-tensors config that ``save_pretrained`` writes; ``from_dict()`` reads it (or
    the `to_loading_dict` form) back. ``modules_to_not_convert`` and ``shared_scale_groups`` act when quantising:
    afterwards they live on in ``ignore`` and in the stored scales, which is all a saved checkpoint needs.
    """

    def __init__(
        self,
        modules_to_not_convert: Sequence[str] | None = None,
        shared_scale_groups: Sequence[Sequence[str]] | None = None,
        targets: Sequence[str] | None = None,
        ignore: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> None:
        quant_method = kwargs.pop("quant_method", QUANT_METHOD)
        if quant_method != QUANT_METHOD:
            raise ValueError(f"{type(self).__name__} got quant_method={quant_method!r}, expected {QUANT_METHOD!r}.")
        self.quant_method = QUANT_METHOD
        self.modules_to_not_convert = list(modules_to_not_convert) if modules_to_not_convert is not None else None
        groups = DEFAULT_SHARED_SCALE_GROUPS if shared_scale_groups is None else shared_scale_groups
        self.shared_scale_groups = [list(group) for group in groups]
        self.targets = list(targets) if targets is not None else ["Linear"]
        self.ignore = list(ignore) if ignore is not None else []
        if kwargs:
            raise ValueError(f"{type(self).__name__} got unknown arguments {sorted(kwargs)}.")
        self._check()

    def _check(self) -> None:
        for name in ("modules_to_not_convert", "targets", "ignore"):
            value = getattr(self, name)
            if value is not None and not all(isinstance(item, str) for item in value):
                raise ValueError(f"{type(self).__name__}.{name} must be a list of strings, got {value!r}.")
        if not all(isinstance(m, str) for group in self.shared_scale_groups for m in group):
            raise ValueError(
                f"{type(self).__name__}.shared_scale_groups must be lists of names, got {self.shared_scale_groups}."
            )

    def to_dict(self) -> dict[str, Any]:
        """The compressed-tensors config that `save_pretrained` writes to config.json."""
        return {
            "quant_method": "compressed-tensors",
            "format": COMPRESSED_TENSORS_FORMAT,
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": list(self.targets),
                    "weights": dict(_WEIGHT_ARGS),
                    "input_activations": None,
                    "output_activations": None,
                    "format": None,
                }
            },
            "ignore": sorted(self.ignore),
            "kv_cache_scheme": None,
            "global_compression_ratio": None,
        }

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], return_unused_kwargs: bool = False, **kwargs: Any):
        """Read `to_dict`'s compressed-tensors form (as saved in config.json) or the `to_loading_dict` form;
        ``kwargs`` naming attributes override them (as in transformers' configs)."""
        config_dict = dict(config_dict)
        if config_dict.get("quant_method") == "compressed-tensors":
            config = cls.from_compressed_tensors(config_dict)
        else:
            config = cls(**config_dict)
        unused = {}
        for key, value in kwargs.items():
            if hasattr(config, key):
                setattr(config, key, value)
            else:
                unused[key] = value
        config._check()
        return (config, unused) if return_unused_kwargs else config

    def to_loading_dict(self) -> dict[str, Any]:
        """A dict that routes `from_pretrained` of a pre-quantised checkpoint to this package's quantizer."""
        return {
            "quant_method": QUANT_METHOD,
            "modules_to_not_convert": self.modules_to_not_convert,
            "shared_scale_groups": self.shared_scale_groups,
            "targets": self.targets,
            "ignore": self.ignore,
        }

    def to_json_string(self, use_diff: bool = True) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def __repr__(self) -> str:
        return f"{type(self).__name__} {json.dumps(self.to_loading_dict(), sort_keys=True)}"

    @classmethod
    def from_compressed_tensors(cls, config: dict[str, Any], **overrides: Any) -> NVFP4A16Config:
        """Read a compressed-tensors quantization config; refuses anything but W4A16 NVFP4 with a clear error."""
        check_compressed_tensors_config(config)
        group = next(iter(config["config_groups"].values()))
        return cls(targets=group.get("targets", ["Linear"]), ignore=config.get("ignore") or [], **overrides)


def check_compressed_tensors_config(config: dict[str, Any]) -> None:
    """Raise a `ValueError` unless ``config`` describes a W4A16 NVFP4 "nvfp4-pack-quantized" checkpoint."""
    fmt = config.get("format")
    hint = (
        "trl-qerl loads 16-bit checkpoints (quantised on load) and compressed-tensors W4A16 NVFP4 checkpoints "
        "(llm-compressor scheme 'NVFP4A16')."
    )
    if config.get("quant_method") != "compressed-tensors":
        raise ValueError(f"Checkpoint is quantised with {config.get('quant_method')!r}. {hint}")
    if fmt != COMPRESSED_TENSORS_FORMAT:
        raise ValueError(f"compressed-tensors format {fmt!r} is not {COMPRESSED_TENSORS_FORMAT!r}. {hint}")
    if config.get("quantization_status", "compressed") != "compressed":
        raise ValueError(f"quantization_status is {config.get('quantization_status')!r}, expected 'compressed'.")
    groups = config.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"Expected one compressed-tensors config group, found {len(groups)}. {hint}")
    group = next(iter(groups.values()))
    if group.get("input_activations") is not None:
        raise ValueError(
            "This is a W4A4 NVFP4 checkpoint (activations are quantised too, scheme 'NVFP4'); trl-qerl trains with "
            f"16-bit activations. Re-quantise the 16-bit model with scheme 'NVFP4A16', or load the 16-bit model. {hint}"
        )
    weights = group.get("weights") or {}
    expected = {k: v for k, v in _WEIGHT_ARGS.items() if k not in ("dynamic", "scale_dtype")}
    mismatched = {k: weights.get(k) for k, v in expected.items() if weights.get(k) != v}
    if mismatched:
        raise ValueError(f"Weight quantisation {mismatched} differs from NVFP4 {expected}. {hint}")


def _matches(name: str, module: nn.Module, patterns: Iterable[str]) -> bool:
    """compressed-tensors/transformers-style module matching: class name, exact name, suffix, or ``re:`` regex."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif pattern in (name, type(module).__name__) or name.endswith("." + pattern):
            return True
    return False


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
        _check_safetensors_only(checkpoint_files)
        converted = self.select_linears(model)
        for name in converted:
            model.set_submodule(name, self._nvfp4_placeholder(model.get_submodule(name)))
        self._group_of = _shared_scale_groups(converted, self.quantization_config.shared_scale_groups)
        if self.pre_quantized and checkpoint_files:
            _check_checkpoint_tensors(checkpoint_files, {n: model.get_submodule(n) for n in converted})
        return model

    def select_linears(self, model) -> list[str]:
        """Names of the Linear layers to quantise; records the rest in ``quantization_config.ignore`` and warns
        once about layers kept in 16-bit because ``in_features`` is not a multiple of 16."""
        config: NVFP4A16Config = self.quantization_config
        keep = self.get_modules_to_not_convert(model, config.modules_to_not_convert, add_default_skips=True)
        ignored, unaligned, converted = [], [], []
        adapters = _adapter_subtrees(model)
        for name, module in model.named_modules():
            if not isinstance(module, nn.Linear) or isinstance(module, NVFP4A16Linear) or name.startswith(adapters):
                continue
            if _matches(name, module, keep) or (self.pre_quantized and _matches(name, module, config.ignore)):
                ignored.append(name)
            elif self.pre_quantized and not _matches(name, module, config.targets):
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
        for group, pending in self._pending.items():
            for name in group:
                if name not in pending and name not in problems:
                    problems[name] = f"{name}: no weight in the checkpoint (missing tensor or shard)."
        for name, layer in nvfp4_modules(model).items():
            if name in problems:
                continue
            if "weight" in layer._parameters:
                problems[name] = f"{name}: no weight in the checkpoint (missing tensor or shard)."
                continue
            try:
                _check_loaded_layer(name, layer)
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


def _shared_scale_groups(converted: list[str], groups: list[list[str]]) -> dict[str, tuple[str, ...]]:
    """Map each converted module to the converted siblings it shares a global scale with."""
    present = set(converted)
    group_of = {}
    for name in converted:
        parent, _, leaf = name.rpartition(".")
        for group in groups:
            if leaf in group:
                members = tuple(f"{parent}.{m}" if parent else m for m in group)
                group_of[name] = tuple(m for m in members if m in present)
    return group_of


def _check_safetensors_only(checkpoint_files: Sequence[str] | None) -> None:
    pickled = [f for f in checkpoint_files or [] if not str(f).endswith(".safetensors")]
    if pickled:
        raise ValueError(
            f"trl-qerl reads weights from safetensors only and will not unpickle {pickled}. Convert the checkpoint "
            "with `model.save_pretrained(path, safe_serialization=True)` in a trusted environment first."
        )


def _check_checkpoint_tensors(checkpoint_files: Sequence[str], layers: dict[str, NVFP4A16Linear]) -> None:
    """Check names, dtypes and shapes of every NVFP4 tensor from the safetensors headers (no data is read)."""
    from safetensors import safe_open

    found: dict[str, tuple[str, list[int]]] = {}
    for path in checkpoint_files:
        with safe_open(path, framework="pt") as handle:
            for key in handle.keys():
                if key.endswith(tuple(_SAFETENSORS_DTYPES)) or key.endswith("input_global_scale"):
                    tensor_slice = handle.get_slice(key)
                    found[key] = (tensor_slice.get_dtype(), list(tensor_slice.get_shape()))
    problems = []
    for name, layer in layers.items():
        expected_shapes = {
            "weight_packed": [layer.out_features, layer.in_features // 2],
            "weight_scale": [layer.out_features, layer.in_features // GROUP_SIZE],
            "weight_global_scale": [1],
        }
        for tensor_name, (dtype, _) in _SAFETENSORS_DTYPES.items():
            key = f"{name}.{tensor_name}"
            if key not in found:
                problems.append(f"{key}: missing from the checkpoint (missing shard?)")
                continue
            got_dtype, got_shape = found[key]
            if got_dtype != dtype or got_shape != expected_shapes[tensor_name]:
                problems.append(
                    f"{key}: dtype {got_dtype} shape {got_shape}, expected dtype {dtype} shape "
                    f"{expected_shapes[tensor_name]}"
                )
        if f"{name}.input_global_scale" in found:
            problems.append(f"{name}.input_global_scale: W4A4 activation scales are not supported (use NVFP4A16)")
    if problems:
        raise ValueError("The NVFP4 checkpoint does not match the model:\n  " + "\n  ".join(problems))


def _check_loaded_layer(name: str, layer: NVFP4A16Linear) -> None:
    for tensor_name in QUANTIZED_TENSOR_NAMES:
        getattr(layer, tensor_name).requires_grad_(False)
    check_packed(*layer.quantized_weight, name=name, shape=(layer.out_features, layer.in_features))
    global_scale = layer.weight_global_scale.float()
    if not bool(torch.isfinite(global_scale).all()) or not bool((global_scale > 0).all()):
        raise ValueError(f"{name}: weight_global_scale is {global_scale.tolist()}, expected a finite positive value.")
    if not bool(torch.isfinite(layer.weight_scale.float()).all()):
        raise ValueError(f"{name}: weight_scale holds NaN/Inf values; the checkpoint is corrupt.")


def _adapter_subtrees(model: nn.Module) -> tuple[str, ...]:
    """Name prefixes of PEFT adapter sub-trees (LoRA matrices, ``modules_to_save`` copies and originals): trainable
    or adapter-owned layers are never quantised. Duck-typed on PEFT's layer attributes (checked with peft 0.21)."""
    prefixes = []
    for name, module in model.named_modules():
        for attr in getattr(module, "adapter_layer_names", ()) + getattr(module, "other_param_names", ()):
            if isinstance(getattr(module, attr, None), nn.Module):
                prefixes.append(f"{name}.{attr}." if name else f"{attr}.")
        if isinstance(getattr(module, "modules_to_save", None), nn.ModuleDict):
            prefixes += [f"{name}.modules_to_save.", f"{name}.original_module."]
    return tuple(prefixes)


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
    quantizer.preprocess_model(model)
    converted = {name: linear for name, linear in dense.items() if model.get_submodule(name) is not linear}
    del dense
    with torch.no_grad():
        for name in list(converted):
            linear = converted.pop(name)  # dropped once its group is quantised: one 16-bit group at a time
            if linear.bias is not None:
                model.get_submodule(name).bias = linear.bias
            tensors = quantizer.quantize_loaded_weight(model, f"{name}.weight", linear.weight.detach(), None)
            for key, tensor in tensors.items():  # what transformers' loader does with a conversion's output
                module_name, _, leaf = key.rpartition(".")
                setattr(model.get_submodule(module_name), leaf, nn.Parameter(tensor, requires_grad=False))
    model.hf_quantizer = quantizer  # set by from_pretrained itself, outside the quantizer's hooks
    quantizer.postprocess_model(model)
    return model


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
    "NVFP4A16Config",
    "NVFP4A16HfQuantizer",
    "QUANT_METHOD",
    "check_compressed_tensors_config",
    "quantize_model",
    "register",
]
