"""AQN measurements: sampling entropy of bf16 vs NVFP4 vs NVFP4 + noise, and the cost of injecting noise.

1. Entropy (the paper's Fig. 5 observation that quantisation raises sampling entropy): mean entropy of the
   next-token distribution over every position of random prompts, for the model in bf16, quantised to NVFP4, and
   NVFP4 with AQN at several σ (averaged over noise draws). ``--model`` takes a checkpoint (e.g. the shipped
   tiny model); by default a seeded random Qwen2-architecture model with peaked outputs is built.
2. Cost: time of one noise injection (perturb + restore of every input/post-attention norm) at Qwen2.5-7B shapes
   (28 layers x 2 norms x 3584), against the NVFP4 decode-step memory floor of that model (1.11 ms on an H200).

Usage:
    python scripts/bench_aqn.py [--model PATH] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from trl_qerl.noise import NormNoise
from trl_qerl.quantizer import quantize_model


SIGMAS = (1e-3, 1e-2, 5e-2)
NVFP4_7B_DECODE_FLOOR_S = 1.11e-3


def _random_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # larger weights than the default init, so that next-token distributions are peaked
        for name, param in model.named_parameters():
            if param.ndim == 2:
                param.normal_(0.0, 0.15)
    return model.to(torch.bfloat16).eval()


@torch.no_grad()
def mean_entropy(model: nn.Module, tokens: torch.Tensor) -> float:
    logits = model(tokens).logits.float()
    log_probs = torch.log_softmax(logits, dim=-1)
    return -(log_probs.exp() * log_probs).sum(-1).mean().item()


def entropy_table(model_path: str | None, device: str, draws: int = 8) -> None:
    if model_path:
        bf16 = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).to(device).eval()
        reload = lambda: AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).to(device).eval()  # noqa: E731
    else:
        bf16 = _random_model(0).to(device)
        reload = lambda: _random_model(0).to(device)  # noqa: E731
    vocab = bf16.config.vocab_size
    tokens = torch.randint(0, vocab, (16, 64), generator=torch.Generator().manual_seed(1)).to(device)
    nvfp4 = quantize_model(reload())
    rows = [("bf16", mean_entropy(bf16, tokens), 0.0), ("NVFP4", mean_entropy(nvfp4, tokens), 0.0)]
    noise = NormNoise(nvfp4, seed=0)
    for sigma in SIGMAS:
        values = []
        for draw in range(draws):
            noise.set_step(draw, sigma)
            with noise.rollout():
                values.append(mean_entropy(nvfp4, tokens))
        rows.append((f"NVFP4 + AQN σ={sigma:g}", statistics.mean(values), statistics.stdev(values)))
    print(f"\nNext-token entropy (nats; max log V = {torch.log(torch.tensor(float(vocab))).item():.2f}), "
          f"{tokens.numel()} positions, model: {model_path or 'seeded random Qwen2 4x256'}")  # fmt: skip
    print("| model | mean entropy | spread over draws |\n|---|---|---|")
    for name, value, spread in rows:
        print(f"| {name} | {value:.4f} | {spread:.4f} |")


def injection_cost(device: str, repeats: int = 50) -> None:
    layers = nn.ModuleList()
    for _ in range(28):
        layer = nn.Module()
        layer.input_layernorm = Qwen2RMSNorm(3584)
        layer.post_attention_layernorm = Qwen2RMSNorm(3584)
        layers.append(layer)
    model = nn.Module()
    model.layers = layers
    model = model.to(device=device, dtype=torch.bfloat16)
    noise = NormNoise(model, seed=0)
    noise.set_step(0, 1e-2)
    times = []
    for index in range(repeats + 5):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        noise.perturb()
        noise.restore()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if index >= 5:
            times.append(time.perf_counter() - start)
    cost = statistics.median(times)
    print(f"\nNoise injection at Qwen2.5-7B shapes (56 norms x 3584, bf16) on {device}: perturb + restore "
          f"{cost * 1e6:.0f} µs (median of {repeats}, host-timed incl. launches) = "
          f"{100 * cost / NVFP4_7B_DECODE_FLOOR_S:.1f}% of the 1.11 ms NVFP4 decode-step floor; "
          "it runs once per rollout batch, not per decode step")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint to measure entropy on (default: random model)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--skip-entropy", action="store_true")
    args = parser.parse_args()
    if not args.skip_entropy:
        entropy_table(args.model, args.device)
    injection_cost(args.device)


if __name__ == "__main__":
    main()
