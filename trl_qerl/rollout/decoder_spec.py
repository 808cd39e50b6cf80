"""What the fused decode step reads from a model: its tensors, in place, grouped the way the step uses them.

`read_decoder` walks a Llama/Mistral/Qwen2/Qwen3 causal LM (NVFP4 or 16-bit, PEFT-wrapped or not) and returns a
`DecoderSpec`: plain tensors and numbers, no modules. Nothing is copied, so optimizer steps on LoRA or norm weights
and AQN draws (which write the fp32 norm weights in place, see `trl_qerl.noise`) reach the next decode step without
reading the model again. A model it does not understand raises `UnsupportedDecoder` with the reason; the generator
then decodes through the model's own forward (one log line).

Checked against transformers 5.17-5.24 (Llama, Mistral, Qwen2, Qwen3 decoder layers and RMSNorms) and PEFT
0.21 (``LoraLayer`` attributes ``lora_A``, ``lora_B``, ``scaling``, ``use_dora``, ``lora_bias``, ``lora_variant``,
``merged``, ``disable_adapters``, ``active_adapters``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..norms import active_module
from ..nvfp4.linear import NVFP4A16Linear


__all__ = ["SUPPORTED_MODEL_TYPES", "DecoderSpec", "LayerSpec", "NormSpec", "Projection", "UnsupportedDecoder",
           "read_decoder"]  # fmt: skip


SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""Decoder-only models whose layers are ``x + attn(norm(x))`` then ``x + down(silu(gate) * up)`` with RMSNorms of the
Llama form, rotary embeddings and grouped-query attention."""

_RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
"""Norm classes computing ``weight * (x32 * rsqrt(mean(x32²) + eps)).to(input_dtype)`` (Gemma's ``1 + weight`` form
is not among them)."""


class UnsupportedDecoder(ValueError):
    """The fused decode step cannot run this model (the message says why); decode through its forward instead."""


@dataclass(frozen=True)
class LoraTerm:
    """``scaling * B(A(x))`` of one active adapter (weights as stored: fp32 masters in training)."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float


@dataclass(frozen=True)
class Projection:
    """A linear layer's tensors: NVFP4 (``packed``, ``scale``, ``global_scale``) or dense (``weight``), an optional
    bias, and the LoRA terms on top."""

    out_features: int
    bias: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    packed: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None
    lora: tuple[LoraTerm, ...] = ()

    @property
    def is_nvfp4(self) -> bool:
        return self.packed is not None


@dataclass(frozen=True)
class NormSpec:
    weight: torch.Tensor
    eps: float


@dataclass(frozen=True)
class LayerSpec:
    input_norm: NormSpec
    post_attention_norm: NormSpec
    qkv: tuple[Projection, Projection, Projection]
    o: Projection
    gate_up: tuple[Projection, Projection]
    down: Projection
    q_norm: NormSpec | None = None
    k_norm: NormSpec | None = None


@dataclass(frozen=True)
class DecoderSpec:
    embed: torch.Tensor
    layers: tuple[LayerSpec, ...]
    final_norm: NormSpec
    lm_head: Projection
    rotary: nn.Module = field(repr=False)
    """The model's rotary-embedding module (``cos, sin = rotary(x, position_ids)``, scaling variants included)."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    dtype: torch.dtype
    sliding_window: int | None
    """Smallest sliding window of any layer (None: all layers attend to the whole cache)."""


def read_decoder(model: nn.Module) -> DecoderSpec:
    """The tensors of ``model`` the fused step reads (in place); raises `UnsupportedDecoder` with the reason."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedDecoder(f"model_type {model_type!r} (the fused step knows {list(SUPPORTED_MODEL_TYPES)})")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedDecoder(f"hidden_act={config.hidden_act!r} (the fused step computes silu(gate) * up)")
    inner = getattr(base, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(inner, name):
            raise UnsupportedDecoder(f"{type(base).__name__}.model has no {name!r}")
    embed = active_module(inner.embed_tokens)
    if type(embed) is not nn.Embedding:
        raise UnsupportedDecoder(f"embed_tokens is a {type(embed).__name__}, not an nn.Embedding")
    lm_head = base.get_output_embeddings()
    if lm_head is None:
        raise UnsupportedDecoder("the model has no output embedding (lm_head)")
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return DecoderSpec(
        embed=embed.weight,
        layers=tuple(_layer(layer, index) for index, layer in enumerate(inner.layers)),
        final_norm=_norm(inner.norm, "model.norm"),
        lm_head=_projection(lm_head, "lm_head"),
        rotary=inner.rotary_emb,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        scaling=head_dim**-0.5,
        dtype=embed.weight.dtype,
        sliding_window=_sliding_window(config),
    )


def _sliding_window(config) -> int | None:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    if config.model_type in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
        return None
    return window


def _layer(layer: nn.Module, index: int) -> LayerSpec:
    where = f"layers.{index}"
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attention is None or mlp is None:
        raise UnsupportedDecoder(f"{where} has no self_attn/mlp")

    def projection(parent, name, owner):
        return _projection(getattr(parent, name, None), f"{where}.{owner}.{name}")

    q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
    return LayerSpec(
        input_norm=_norm(layer.input_layernorm, f"{where}.input_layernorm"),
        post_attention_norm=_norm(layer.post_attention_layernorm, f"{where}.post_attention_layernorm"),
        qkv=tuple(projection(attention, name, "self_attn") for name in ("q_proj", "k_proj", "v_proj")),
        o=projection(attention, "o_proj", "self_attn"),
        gate_up=tuple(projection(mlp, name, "mlp") for name in ("gate_proj", "up_proj")),
        down=projection(mlp, "down_proj", "mlp"),
        q_norm=_norm(q_norm, f"{where}.self_attn.q_norm") if q_norm is not None else None,
        k_norm=_norm(k_norm, f"{where}.self_attn.k_norm") if k_norm is not None else None,
    )


def _norm(module: nn.Module, where: str) -> NormSpec:
    running = active_module(module)
    if type(running).__name__ not in _RMS_NORMS:
        raise UnsupportedDecoder(f"{where} is a {type(running).__name__} (the fused step knows {list(_RMS_NORMS)})")
    eps = getattr(running, "variance_epsilon", None) or getattr(running, "eps", None)
    return NormSpec(weight=running.weight, eps=float(eps))


def _projection(module: nn.Module | None, where: str) -> Projection:
    if module is None:
        raise UnsupportedDecoder(f"{where} is missing")
    lora: tuple[LoraTerm, ...] = ()
    if hasattr(module, "base_layer") and hasattr(module, "lora_A"):
        lora = _lora_terms(module, where)
        module = module.get_base_layer()
    if isinstance(module, NVFP4A16Linear):
        if module._parameters.get("weight") is not None:
            raise UnsupportedDecoder(f"{where} still holds its 16-bit checkpoint weight (quantise-on-load unfinished)")
        return Projection(
            out_features=module.out_features, bias=module.bias, packed=module.weight_packed,
            scale=module.weight_scale, global_scale=module.weight_global_scale, lora=lora,
        )  # fmt: skip
    if type(module) is nn.Linear:
        return Projection(out_features=module.out_features, bias=module.bias, weight=module.weight, lora=lora)
    raise UnsupportedDecoder(f"{where} is a {type(module).__name__} (the fused step reads nn.Linear and NVFP4 layers)")


def _lora_terms(layer: nn.Module, where: str) -> tuple[LoraTerm, ...]:
    """The active, unmerged adapters of a PEFT LoRA layer (none while adapters are disabled or merged: a merged
    adapter lives in the dense base weight)."""
    if layer.disable_adapters or getattr(layer, "merged", False):
        return ()
    terms = []
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A:
            continue
        for option in ("use_dora", "lora_bias"):
            if getattr(layer, option, {}).get(adapter, False):
                raise UnsupportedDecoder(f"{where} uses {option} (the fused step adds plain LoRA terms)")
        if adapter in getattr(layer, "lora_variant", {}):
            raise UnsupportedDecoder(f"{where} uses the LoRA variant {type(layer.lora_variant[adapter]).__name__}")
        lora_a, lora_b = layer.lora_A[adapter], layer.lora_B[adapter]
        if type(lora_a) is not nn.Linear or type(lora_b) is not nn.Linear:
            raise UnsupportedDecoder(f"{where} has {type(lora_a).__name__} adapters (the fused step reads nn.Linear)")
        terms.append(LoraTerm(lora_a.weight, lora_b.weight, float(layer.scaling[adapter])))
    return tuple(terms)
