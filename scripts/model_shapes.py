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
