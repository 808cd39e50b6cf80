"""`from_pretrained`: one call that loads any checkpoint as an NVFP4 model, ready for training.

* a 16-bit checkpoint is quantised on load (`NVFP4A16Config`), exactly as
  ``AutoModelForCausalLM.from_pretrained(path, quantization_config=NVFP4A16Config())`` does;
* a compressed-tensors W4A16 NVFP4 checkpoint (ours, or one made by llm-compressor with scheme "NVFP4A16") is
  loaded as it is, without requantising, and without compressed-tensors decompressing it to bf16;
* anything else quantised (W4A4 NVFP4, GPTQ, bitsandbytes, ...) is refused with an explanation.

`load_policy` loads the base model for each of `QeRLGRPOTrainer`'s four modes (NVFP4, the 16-bit LoRA baseline,
QLoRA's NF4, full fine-tuning) from a path or checks and quantises a model instance.

This is the documented way to train from a compressed-tensors NVFP4 checkpoint: plain
``AutoModelForCausalLM.from_pretrained`` hands such a checkpoint to transformers' compressed-tensors integration,
which decompresses every layer to bf16 on the first forward (no memory saving, and a dtype mismatch when the
model is loaded in float32), and transformers refuses a ``quantization_config`` argument that differs from the
checkpoint's before any quantizer runs.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from accelerate import PartialState
from peft import PeftModel
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from .quantizer import QUANT_METHOD, NVFP4A16Config, quantize_model


if TYPE_CHECKING:
    from .config import QeRLConfig


_HUB_KWARGS = (
    "cache_dir",
    "force_download",
    "local_files_only",
    "token",
    "revision",
    "subfolder",
    "trust_remote_code",
)


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


# -- the four training modes ----------------------------------------------------------------------------------
def _model_init_kwargs(args: QeRLConfig) -> dict[str, Any]:
    kwargs = dict(args.model_init_kwargs or {})
    kwargs.setdefault("dtype", torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32)
    if "device_map" not in kwargs and torch.cuda.is_available() and not args.use_cpu:
        kwargs["device_map"] = {"": PartialState().local_process_index}  # quantise on the device, one rank per GPU
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    return kwargs


def _bnb_nf4_config():
    if not torch.cuda.is_available():
        raise ValueError(
            "quantization='nf4' (the QLoRA baseline) needs a CUDA GPU: bitsandbytes NF4 has no CPU kernels."
        )
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as error:
        raise ImportError("quantization='nf4' needs bitsandbytes: pip install bitsandbytes") from error
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_use_double_quant=True,
    )


def load_policy(model: str | os.PathLike | PreTrainedModel, args: QeRLConfig) -> PreTrainedModel:
    """The base model for ``args.quantization``: loaded from a path/id, or checked/quantised if given as an instance."""
    mode = args.quantization
    if isinstance(model, (str, os.PathLike)):
        _check_checkpoint_matches_mode(str(model), mode, args.trust_remote_code)
        kwargs = _model_init_kwargs(args)
        if mode == "nvfp4":
            config = NVFP4A16Config(modules_to_not_convert=args.nvfp4_modules_to_not_convert)
            return from_pretrained(str(model), quantization_config=config, **kwargs)
        if mode == "nf4":
            kwargs["quantization_config"] = _bnb_nf4_config()
        return AutoModelForCausalLM.from_pretrained(str(model), **kwargs)

    base = model.get_base_model() if isinstance(model, PeftModel) else model
    method = getattr(base, "quantization_method", None) if getattr(base, "is_quantized", False) else None
    if mode == "nvfp4":
        if method is None:  # a PeftModel keeps its adapters in 16-bit: only the base's own layers are quantised
            quantize_model(base, NVFP4A16Config(modules_to_not_convert=args.nvfp4_modules_to_not_convert))
            return model
        if method != QUANT_METHOD:
            raise ValueError(f"quantization='nvfp4' but the model is quantised with {method!r}; pass a 16-bit model.")
        return model
    if mode == "nf4":
        if not getattr(base, "is_loaded_in_4bit", False):
            raise ValueError("quantization='nf4' needs a model loaded with bitsandbytes 4-bit (or pass a model id).")
        return model
    if method is not None:
        raise ValueError(f"quantization={mode!r} needs a 16-bit model, but this one is quantised with {method!r}.")
    return model


def _check_checkpoint_matches_mode(path: str, mode: str, trust_remote_code: bool) -> None:
    """A quantised checkpoint cannot serve a 16-bit mode (LoRA baseline, full fine-tuning): say so up front."""
    if mode == "nvfp4":
        return
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return
    method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization.quant_method
    if mode in ("bf16", "none") or (mode == "nf4" and method != "bitsandbytes"):
        raise ValueError(
            f"{path} is a quantised checkpoint ({method}), but quantization={mode!r} needs the 16-bit weights. Pass "
            "the 16-bit model it was made from, or use quantization='nvfp4' to train on this checkpoint."
        )
