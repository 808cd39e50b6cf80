"""Real model shapes for benchmarks: Qwen2.5 configs (random weights; no Hub access on the benchmark machines)."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config


WEIGHT_STD = 0.02


_QWEN25 = {
    # name: (hidden, intermediate, layers, heads, kv_heads, vocab, tied embeddings)
    "qwen2.5-3b": (2048, 11008, 36, 16, 2, 151936, True),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, 152064, False),
    "qwen2.5-14b": (5120, 13824, 48, 40, 8, 152064, False),
    "qwen2.5-32b": (5120, 27648, 64, 40, 8, 152064, False),
    "qwen2.5-72b": (8192, 29568, 80, 64, 8, 152064, False),
    # a CPU-sized stand-in with the same structure, for smoke runs of the scripts
    "tiny": (256, 512, 2, 4, 2, 1024, False),
}
NAMES = tuple(_QWEN25)


def qwen25_config(name: str, num_hidden_layers: int | None = None) -> Qwen2Config:
    """A `Qwen2Config` with the shapes of a Qwen2.5 model; ``num_hidden_layers`` truncates it."""
    try:
        hidden, intermediate, layers, heads, kv_heads, vocab, tied = _QWEN25[name]
    except KeyError:
        raise SystemExit(f"unknown model shape {name!r}; choose one of {', '.join(NAMES)}") from None
    return Qwen2Config(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=num_hidden_layers or layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        dtype="bfloat16",
    )


def linear_shapes(name: str) -> dict[str, tuple[int, int]]:
    """``{projection: (out_features, in_features)}`` of one decoder layer, fused q/k/v and gate/up included."""
    config = qwen25_config(name)
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    return {
        "q_proj": (hidden, hidden),
        "kv_proj": (kv, hidden),
        "qkv_proj": (hidden + 2 * kv, hidden),
        "o_proj": (hidden, hidden),
        "gate_up_proj": (2 * inter, hidden),
        "down_proj": (hidden, inter),
    }


def random_tensor(name: str, shape, device, std=WEIGHT_STD) -> torch.Tensor:
    """Deterministic per name, so the original can be regenerated after loading."""
    generator = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
    return (torch.randn(shape, generator=generator, device=device) * std).to(torch.bfloat16)


def write_checkpoint(config, path: Path, device: str) -> int:
    """Random bf16 checkpoint, one shard per layer; returns its tensor bytes."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(t.shape) for name, t in skeleton.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    shards: dict[str, list[str]] = {}
    for name in shapes:
        key = f"layer{name.split('.')[2]}" if name.startswith("model.layers.") else "other"
        shards.setdefault(key, []).append(name)
    weight_map, total = {}, 0
    for index, (key, names) in enumerate(sorted(shards.items())):
        filename = f"model-{index:05d}.safetensors"
        tensors = {}
        for name in names:
            is_norm = "norm" in name
            tensor = (
                torch.ones(shapes[name], dtype=torch.bfloat16)
                if is_norm
                else random_tensor(name, shapes[name], device)
            )
            tensors[name] = tensor.cpu()
            total += tensor.numel() * tensor.element_size()
        save_file(tensors, path / filename, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, filename))
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    config.save_pretrained(path)
    return total


def build_nvfp4_streamed(config, device, std: float = WEIGHT_STD):
    """An NVFP4 model at ``config``'s shapes that never holds more than one shared-scale group of 16-bit weights.

    The model is created on the meta device and its placeholders set up by the quantizer (`preprocess_model`);
    then every tensor is drawn at random (per name, `random_tensor`; norms are ones) on ``device`` in checkpoint
    order and handed to the quantizer's quantise-on-load conversion (`quantize_loaded_weight`: the per-tensor step
    that ``from_pretrained(..., quantization_config=NVFP4A16Config())`` runs for each tensor of a sharded
    checkpoint, holding q/k/v and gate/up until their shared global scale is known), and `postprocess_model` checks
    the result. A 72B model in bf16 (~145 GB) fits neither the GPU nor the disk; this path needs its NVFP4 size
    plus one 16-bit group. Returns the model (eval mode)."""
    from torch import nn

    from trl_qerl.nvfp4.linear import QUANTIZED_TENSOR_NAMES
    from trl_qerl.quantizer import NVFP4A16Config, NVFP4A16HfQuantizer, assign_quantized_tensors

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    quantizer = NVFP4A16HfQuantizer(NVFP4A16Config(), pre_quantized=False)
    quantizer.preprocess_model(model)
    with torch.no_grad():
        for name, param in list(model.named_parameters(remove_duplicate=True)):
            module_name, _, leaf = name.rpartition(".")
            if leaf in QUANTIZED_TENSOR_NAMES:
                continue  # written by the conversion of the layer's 16-bit weight
            if quantizer.param_needs_quantization(model, name):
                tensor = random_tensor(name, param.shape, device, std)
                assign_quantized_tensors(model, quantizer.quantize_loaded_weight(model, name, tensor, None))
                del tensor
                continue
            if "norm" in name:
                tensor = torch.ones(param.shape, dtype=torch.bfloat16, device=device)
            else:
                tensor = random_tensor(name, param.shape, device, std)
            setattr(model.get_submodule(module_name), leaf, nn.Parameter(tensor, requires_grad=param.requires_grad))
    if config.tie_word_embeddings:
        model.tie_weights()
    for module_name, module in model.named_modules():  # non-persistent buffers (rotary inv_freq): rebuild them
        if any(buffer.is_meta for buffer in module.buffers(recurse=False)):
            if not module_name.endswith("rotary_emb"):
                raise RuntimeError(f"{module_name} has buffers on the meta device that this builder cannot rebuild")
            model.get_submodule(module_name.rpartition(".")[0]).rotary_emb = type(module)(config=config).to(device)
    model.hf_quantizer = quantizer
    quantizer.postprocess_model(model)
    return model.eval()


def synthetic_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer with ``vocab_size`` tokens ("<pad>", "<eos>", "<unk>", "w3", "w4", ...): one
    whitespace-separated word per token, so prompts of exactly N tokens are easy to write."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>", padding_side="left"
    )


def spread_eos(vocab: int, rate: float) -> list[int]:
    """Token ids that end a completion, ``rate`` of the vocabulary (never 0, the pad id): random weights sample close
    to uniformly, so each step stops a row with probability ~``rate`` (geometric lengths, mean ~1 / rate, capped by
    the completion length) — a length spread like real data's, without a trained model."""
    ids = torch.randperm(vocab - 1, generator=torch.Generator().manual_seed(0))[: max(1, round(rate * vocab))] + 1
    return ids.tolist()
