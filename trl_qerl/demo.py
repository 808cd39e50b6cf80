"""``trl-qerl demo``: the embedded default, offline and CPU-only.

Builds a small seeded Qwen2-architecture model, saves it as a 16-bit checkpoint, loads it back with NVFP4
quantisation on load, saves the compressed-tensors NVFP4 checkpoint, reloads it, and reports sizes, errors
and that the round trip is bit-identical.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch


def _demo_model(seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config).to(torch.bfloat16).eval()


def _weight_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trl-qerl demo", description=__doc__)
    parser.add_argument("--output-dir", default=None, help="keep the checkpoints here (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from .loading import from_pretrained
    from .nvfp4.format import relative_error
    from .nvfp4.linear import nvfp4_modules
    from .quantizer import NVFP4Config

    root = Path(args.output_dir or tempfile.mkdtemp(prefix="trl-qerl-demo-"))
    reference = _demo_model(args.seed)
    reference.save_pretrained(root / "bf16")
    model = AutoModelForCausalLM.from_pretrained(root / "bf16", quantization_config=NVFP4Config())
    model.save_pretrained(root / "nvfp4")
    reloaded = from_pretrained(root / "nvfp4")

    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(args.seed))
    with torch.no_grad():
        logits_ref, logits_q, logits_reloaded = (m(tokens).logits for m in (reference, model, reloaded))
    layers = nvfp4_modules(model)
    weight_error = sum(
        relative_error(reference.get_submodule(name).weight, layer.dequantize_weight(torch.float32))
        for name, layer in layers.items()
    ) / len(layers)

    print(f"trl-qerl demo: NVFP4 quantise-on-load of a {sum(p.numel() for p in reference.parameters()) / 1e6:.1f}M")
    print(f"parameter Qwen2-architecture model ({len(layers)} Linear layers quantised), checkpoints in {root}\n")
    print("| quantity | value |\n|---|---|")
    print(f"| weight bytes bf16 -> NVFP4 | {_weight_bytes(reference) / 1e6:.2f} MB -> {_weight_bytes(model) / 1e6:.2f} MB |")
    print(f"| mean relative weight error | {weight_error:.4f} |")
    print(f"| relative logit error vs bf16 | {relative_error(logits_ref, logits_q):.4f} |")
    print(f"| save -> reload bit-identical | {torch.equal(logits_q, logits_reloaded)} |")
    return 0 if torch.equal(logits_q, logits_reloaded) else 1
