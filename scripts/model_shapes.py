"""Real model shapes for benchmarks: Qwen2.5 configs (random weights; no Hub access on the benchmark machines)."""

from __future__ import annotations

from transformers import Qwen2Config


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
