"""What a vLLM engine loads from a training model: the frozen base checkpoint, LoRA-only adapters, and norm weights.

vLLM serves the NVFP4 base as a compressed-tensors checkpoint and applies the adapter on top; nothing is merged
(merging into 4-bit weights loses the update). vLLM's LoRA loader accepts only LoRA matrices, so the trained
RMSNorms (PEFT ``modules_to_save``) travel separately, as plain tensors written into vLLM's model
(`norm_state`), together with the AQN noise drawn for the rollout.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
from peft import PeftModel
from peft.utils import get_peft_model_state_dict
from safetensors.torch import save_file
from torch import nn

from ..norms import active_module, rms_norms


# The LoRA ranks vLLM accepts for ``max_lora_rank`` (vllm.config.lora.MaxLoRARanks, vLLM 0.32).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_PEFT_PREFIX = "base_model.model."


def tmpfs_dir() -> str | None:
    """/dev/shm when it is a writable directory (adapters written there never touch the disk), else None."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def checkpoint_key(name: str) -> str:
    """The name a parameter has in the base checkpoint (PEFT prefixes and wrappers removed)."""
    name = name.removeprefix(_PEFT_PREFIX)
    return name.replace(".base_layer.", ".").replace(".original_module.", ".")


def base_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights of the base model as its checkpoint had them: LoRA matrices and trained copies dropped."""
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    state = {}
    for name, tensor in base.state_dict().items():
        if ".lora_" in name or ".modules_to_save." in name:
            continue
        state[checkpoint_key(name)] = tensor
    return state


def save_base_checkpoint(model: nn.Module, directory: str | os.PathLike, tokenizer=None) -> Path:
    """Write the frozen base (NVFP4 as compressed-tensors W4A16, or 16-bit) without adapters, for vLLM to load.

    The safetensors shards are written from `base_state_dict` directly: ``save_pretrained`` of a PEFT-wrapped base
    would keep the wrapped names (transformers 5.24 ignores a ``state_dict`` argument there).
    """
    from huggingface_hub import save_torch_state_dict

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    state = base_state_dict(model)
    if getattr(base.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_torch_state_dict({k: v.contiguous() for k, v in state.items()}, directory, max_shard_size="5GB")
    base.config.save_pretrained(directory)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return directory


def lora_rank(model: nn.Module, adapter_name: str = "default") -> int:
    """The largest rank of the adapter (``rank_pattern`` included)."""
    config = model.peft_config[adapter_name]
    return max([config.r, *(config.rank_pattern or {}).values()])


def choose_max_lora_rank(rank: int, requested: int | None = None) -> int:
    """``max_lora_rank`` for vLLM: ``requested`` if set (checked), else the smallest value vLLM accepts >= ``rank``."""
    if requested is not None:
        if requested not in VLLM_LORA_RANKS:
            raise ValueError(
                f"vllm_max_lora_rank={requested} is not one vLLM accepts; choose one of {VLLM_LORA_RANKS}."
            )
        if rank > requested:
            raise ValueError(
                f"The LoRA rank ({rank}) is above vllm_max_lora_rank={requested}: vLLM would refuse the adapter. "
                f"Raise vllm_max_lora_rank to at least {rank} or lower lora_r."
            )
        return requested
    fitting = [value for value in VLLM_LORA_RANKS if value >= rank]
    if not fitting:
        raise ValueError(f"The LoRA rank ({rank}) is above vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]}).")
    return fitting[0]


def save_vllm_adapter(model: PeftModel, directory: str | os.PathLike, adapter_name: str = "default") -> Path:
    """Save the adapter's LoRA matrices in PEFT format, without ``modules_to_save`` (vLLM refuses them).

    Writes ``adapter_model.safetensors`` and ``adapter_config.json`` into ``directory``; returns it.
    """
    config = copy.deepcopy(model.peft_config[adapter_name])
    if getattr(config, "use_dora", False):
        raise ValueError("vLLM does not serve DoRA adapters; train with use_dora=False to roll out in vLLM.")
    state = get_peft_model_state_dict(model, adapter_name=adapter_name)
    lora = {
        key: tensor.detach().contiguous() for key, tensor in state.items() if ".lora_A." in key or ".lora_B." in key
    }
    if not lora:
        raise ValueError(f"Adapter {adapter_name!r} has no LoRA matrices to send to vLLM.")
    config.modules_to_save = None
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(lora, directory / "adapter_model.safetensors")
    with open(directory / "adapter_config.json", "w") as handle:
        json.dump(config.to_dict(), handle, indent=2, default=_json_default)
    return directory


def _json_default(value):
    if isinstance(value, set):
        return sorted(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def norm_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weight every RMSNorm has right now (trained values, plus AQN noise inside a rollout), by checkpoint key."""
    return {
        f"{checkpoint_key(name)}.weight": active_module(module).weight.detach()
        for name, module in rms_norms(model).items()
    }


def check_vllm_shapes(config, tensor_parallel_size: int = 1, quantized: bool = True) -> None:
    """Raise a `ValueError` naming every dimension vLLM cannot shard over ``tensor_parallel_size`` GPUs.

    Attention heads must split evenly, key/value heads must split or replicate evenly, and, for NVFP4 weights,
    each GPU's slice of a row-parallel input (``o_proj``, ``down_proj``) must hold whole groups of 16.
    """
    config = getattr(config, "text_config", None) or config
    tp = tensor_parallel_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    problems = []
    if heads % tp:
        problems.append(f"num_attention_heads={heads} is not divisible by tensor_parallel_size={tp}")
    if kv_heads % tp and tp % kv_heads:
        problems.append(
            f"num_key_value_heads={kv_heads} neither divides nor is divisible by tensor_parallel_size={tp}"
        )
    if quantized:
        for layer, width in (("o_proj", heads * head_dim), ("down_proj", config.intermediate_size)):
            if width % tp or (width // tp) % 16:
                problems.append(
                    f"{layer} input width {width} split over {tp} GPUs is not a multiple of the NVFP4 group size 16"
                )
    if problems:
        raise ValueError(
            "vLLM cannot shard this checkpoint: " + "; ".join(problems) + ". Use a tensor_parallel_size that divides "
            "these dimensions (1 always works)."
        )
