"""`from_pretrained`: one call that loads any checkpoint as an NVFP4 model, ready for training.

* a 16-bit checkpoint is quantised on load (`NVFP4A16Config`), exactly as
  ``AutoModelForCausalLM.from_pretrained(path, quantization_config=NVFP4A16Config())`` does;
* a compressed-tensors W4A16 NVFP4 checkpoint (ours, or one made by llm-compressor with scheme "NVFP4A16") is
  loaded as it is, without requantising, and without compressed-tensors decompressing it to bf16;
* anything else quantised (W4A4 NVFP4, GPTQ, bitsandbytes, ...) is refused with an explanation.

This is the documented way to train from a compressed-tensors NVFP4 checkpoint: plain
``AutoModelForCausalLM.from_pretrained`` hands such a checkpoint to transformers' compressed-tensors integration,
which decompresses every layer to bf16 on the first forward (no memory saving, and a dtype mismatch when the
model is loaded in float32), and transformers refuses a ``quantization_config`` argument that differs from the
checkpoint's before any quantizer runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from transformers import AutoConfig, AutoModelForCausalLM

from .quantizer import QUANT_METHOD, NVFP4A16Config


if TYPE_CHECKING:
    from transformers import PreTrainedModel


_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "trust_remote_code")


def nvfp4_config_for(
    model_id_or_path: str, quantization_config: NVFP4A16Config | None = None, **hub_kwargs: Any
) -> tuple[Any, NVFP4A16Config, bool]:
    """The model config, the `NVFP4A16Config` to load it with, and whether the checkpoint is pre-quantised."""
    config = AutoConfig.from_pretrained(model_id_or_path, **hub_kwargs)
    existing = getattr(config, "quantization_config", None)
    if existing is None:
        return config, quantization_config or NVFP4A16Config(), False
    existing = existing if isinstance(existing, dict) else existing.to_dict()
    if existing.get("quant_method") == QUANT_METHOD:
        return config, NVFP4A16Config.from_dict(existing), True
    overrides = {}
    if quantization_config is not None:
        overrides = {
            "modules_to_not_convert": quantization_config.modules_to_not_convert,
            "shared_scale_groups": quantization_config.shared_scale_groups,
        }
    return config, NVFP4A16Config.from_compressed_tensors(existing, **overrides), True


def from_pretrained(
    model_id_or_path: str,
    quantization_config: NVFP4A16Config | None = None,
    model_class: type = AutoModelForCausalLM,
    **kwargs: Any,
) -> "PreTrainedModel":
    """Load a causal LM with NVFP4 base weights from a 16-bit or a compressed-tensors NVFP4 checkpoint.

    Args:
        model_id_or_path: Hub id or local directory.
        quantization_config: options for quantising a 16-bit checkpoint (defaults to `NVFP4A16Config()`); for a
            pre-quantised one only ``modules_to_not_convert`` and ``shared_scale_groups`` are used.
        model_class: the auto class to load with.
        **kwargs: passed to ``model_class.from_pretrained`` (``device_map``, ``dtype``, ...). Weights are read
            from safetensors only.

    Example:
        ```python
        model = trl_qerl.from_pretrained("Qwen/Qwen2.5-7B-Instruct", device_map="cuda", dtype=torch.bfloat16)
        model.save_pretrained("qwen-7b-nvfp4")          # compressed-tensors checkpoint, loads in vLLM
        model = trl_qerl.from_pretrained("qwen-7b-nvfp4", device_map="cuda")  # no requantisation
        ```
    """
    if kwargs.get("use_safetensors") is False:
        raise ValueError("trl-qerl reads weights from safetensors only; drop use_safetensors=False.")
    kwargs["use_safetensors"] = True
    hub_kwargs = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
    config, nvfp4_config, pre_quantized = nvfp4_config_for(model_id_or_path, quantization_config, **hub_kwargs)
    if pre_quantized:
        config.quantization_config = nvfp4_config.to_loading_dict()
        return model_class.from_pretrained(model_id_or_path, config=config, **kwargs)
    return model_class.from_pretrained(model_id_or_path, config=config, quantization_config=nvfp4_config, **kwargs)
