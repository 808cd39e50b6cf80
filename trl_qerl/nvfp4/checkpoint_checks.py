"""Checks of NVFP4 checkpoint files before and after loading: safetensors only, tensor names, dtypes and shapes
from the headers (no data read), finite scales in what was loaded."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .format import GROUP_SIZE, check_packed
from .linear import QUANTIZED_TENSOR_NAMES, NVFP4A16Linear


SAFETENSORS_DTYPES = {
    "weight_packed": ("U8", torch.uint8),
    "weight_scale": ("F8_E4M3", torch.float8_e4m3fn),
    "weight_global_scale": ("F32", torch.float32),
}


def check_safetensors_only(checkpoint_files: Sequence[str] | None) -> None:
    """Refuse pickled weight files, and name any safetensors file whose header is unreadable or promises more
    bytes than the file holds (a truncated download or copy)."""
    from safetensors import SafetensorError, safe_open

    pickled = [f for f in checkpoint_files or [] if not str(f).endswith(".safetensors")]
    if pickled:
        raise ValueError(
            f"trl-qerl reads weights from safetensors only and will not unpickle {pickled}. Convert the checkpoint "
            "with `model.save_pretrained(path, safe_serialization=True)` in a trusted environment first."
        )
    for path in checkpoint_files or []:
        try:
            with safe_open(path, framework="pt"):
                pass
        except SafetensorError as error:  # a missing file raises FileNotFoundError, which names it
            raise ValueError(
                f"{path} is not a complete safetensors file ({error}); it was probably truncated while downloading "
                "or copying. Fetch or copy it again."
            ) from None


def check_checkpoint_tensors(checkpoint_files: Sequence[str], layers: dict[str, NVFP4A16Linear]) -> None:
    """Check names, dtypes and shapes of every NVFP4 tensor from the safetensors headers (no data is read)."""
    from safetensors import safe_open

    found: dict[str, tuple[str, list[int]]] = {}
    for path in checkpoint_files:
        with safe_open(path, framework="pt") as handle:
            for key in handle.keys():
                if key.endswith(tuple(SAFETENSORS_DTYPES)) or key.endswith("input_global_scale"):
                    tensor_slice = handle.get_slice(key)
                    found[key] = (tensor_slice.get_dtype(), list(tensor_slice.get_shape()))
    problems = []
    for name, layer in layers.items():
        expected_shapes = {
            "weight_packed": [layer.out_features, layer.in_features // 2],
            "weight_scale": [layer.out_features, layer.in_features // GROUP_SIZE],
            "weight_global_scale": [1],
        }
        for tensor_name, (dtype, _) in SAFETENSORS_DTYPES.items():
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


def check_loaded_layer(name: str, layer: NVFP4A16Linear) -> None:
    for tensor_name in QUANTIZED_TENSOR_NAMES:
        getattr(layer, tensor_name).requires_grad_(False)
    check_packed(*layer.quantized_weight, name=name, shape=(layer.out_features, layer.in_features))
    global_scale = layer.weight_global_scale.float()
    if not bool(torch.isfinite(global_scale).all()) or not bool((global_scale > 0).all()):
        raise ValueError(f"{name}: weight_global_scale is {global_scale.tolist()}, expected a finite positive value.")
    if not bool(torch.isfinite(layer.weight_scale.float()).all()):
        raise ValueError(f"{name}: weight_scale holds NaN/Inf values; the checkpoint is corrupt.")
