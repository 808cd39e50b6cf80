"""Which Linear layers become NVFP4, and which share a global scale: module matching for the quantizer."""

from __future__ import annotations

import re
from collections.abc import Iterable

from torch import nn


def matches(name: str, module: nn.Module, patterns: Iterable[str]) -> bool:
    """compressed-tensors/transformers-style module matching: class name, exact name, suffix, or ``re:`` regex."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif pattern in (name, type(module).__name__) or name.endswith("." + pattern):
            return True
    return False


def shared_scale_groups(converted: list[str], groups: list[list[str]]) -> dict[str, tuple[str, ...]]:
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


def adapter_subtrees(model: nn.Module) -> tuple[str, ...]:
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
