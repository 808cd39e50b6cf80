"""`NVFP4A16Config`: the quantisation config of QeRL's NVFP4 base weights (W4A16) and its compressed-tensors form.

``to_dict()`` is the compressed-tensors "nvfp4-pack-quantized" config that ``save_pretrained`` writes (vLLM and
transformers + compressed-tensors read it without this package); ``from_dict()`` reads it back. The quantizer that
acts on it is `trl_qerl.quantizer.NVFP4A16HfQuantizer`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from transformers.utils.quantization_config import QuantizationConfigMixin

from .nvfp4.format import GROUP_SIZE


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
        self.modules_to_not_convert = modules_to_not_convert
        self.shared_scale_groups = DEFAULT_SHARED_SCALE_GROUPS if shared_scale_groups is None else shared_scale_groups
        self.targets = targets if targets is not None else ["Linear"]
        self.ignore = ignore
        if kwargs:
            raise ValueError(f"{type(self).__name__} got unknown arguments {sorted(kwargs)}.")
        self._check()

    def _check(self) -> None:
        """Normalise the list fields (also after `from_dict` overrides): a bare string is one name."""
        for name in ("modules_to_not_convert", "targets", "ignore"):
            setattr(self, name, _names(getattr(self, name), name))
        self.ignore = self.ignore or []
        self.shared_scale_groups = _groups(self.shared_scale_groups)

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


def _names(value: str | Sequence[str] | None, field: str) -> list[str] | None:
    """A list of module names; a bare string is one name (never split into characters)."""
    if value is None or isinstance(value, str):
        return None if value is None else [value]
    if not all(isinstance(item, str) for item in value):
        raise ValueError(f"NVFP4A16Config.{field} must be a list of strings, got {value!r}.")
    return list(value)


def _groups(value: Sequence[Sequence[str]]) -> list[list[str]]:
    """Groups of sibling names; a flat list of names is refused (is it one group or several?)."""
    if isinstance(value, str) or any(isinstance(group, str) for group in value):
        raise ValueError(
            f"NVFP4A16Config.shared_scale_groups is a list of groups, e.g. [['q_proj', 'k_proj', 'v_proj'], "
            f"['gate_proj', 'up_proj']]; got {value!r}. Wrap names that share one global scale in their own list."
        )
    return [_names(group, "shared_scale_groups") for group in value]


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
