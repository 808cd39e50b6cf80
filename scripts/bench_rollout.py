"""Rollout throughput: TRL's default generate vs transformers' compiled static-cache generate vs our CUDA-graph
backend (bf16 + LoRA, and NVFP4 + LoRA + AQN), all in one run on one GPU.

Random weights at real Qwen2.5 shapes are built directly on the GPU (no checkpoint). Prompts of exactly
``--prompt-tokens`` random tokens, sampling at temperature 1 (random weights practically never emit EOS, so every
row decodes the full length). Reported: decode throughput (tokens/s over the timed call), ms per decode step, and
the one-off cost (compilation / graph capture + kernel choice) of the first call, separately.

Usage:
    python scripts/bench_rollout.py --model qwen2.5-7b --batches 1 8 32 --new-tokens 512 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import torch
from model_shapes import NAMES, qwen25_config
from transformers import AutoModelForCausalLM, GenerationConfig

from trl_qerl.lora import get_peft_model, nvfp4_lora_config
from trl_qerl.noise import NormNoise
from trl_qerl.quantizer import quantize_model
from trl_qerl.rollout.fast import SamplingParams, StaticCacheGenerator


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, result


def hf_generate(model, batch, prompt_tokens, new_tokens, vocab, static: bool):
    ids = torch.randint(3, vocab, (batch, prompt_tokens), device="cuda")
    config = GenerationConfig(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
        pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    kwargs = {"cache_implementation": "static"} if static else {"disable_compile": True}
    return lambda: model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config, **kwargs
    )


def ours(generator, batch, prompt_tokens, new_tokens, vocab):
    prompts = torch.randint(3, vocab, (batch, prompt_tokens)).tolist()
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
    return lambda: generator.generate(prompts, params, eos_token_ids=[1], pad_token_id=0)


def measure(name, make_call, batch, new_tokens, rows, repeat_first=True):
    try:
        first, _ = timed(make_call)
        seconds, _ = timed(make_call) if repeat_first else (first, None)
    except Exception as error:  # noqa: BLE001 - one failing configuration must not hide the others
        print(f"{name} batch {batch}: FAILED {type(error).__name__}: {str(error)[:200]}", flush=True)
        return
    tokens = batch * new_tokens
    row = {"backend": name, "batch": batch, "new_tokens": new_tokens, "seconds": seconds,
           "tokens_per_s": tokens / seconds, "ms_per_step": 1e3 * seconds / new_tokens,
           "first_call_extra_s": first - seconds}  # fmt: skip
    rows.append(row)
    print(f"| {name} | {batch} | {row['tokens_per_s']:.0f} | {row['ms_per_step']:.2f} | {row['first_call_extra_s']:.1f} |",
          flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-7b", choices=NAMES)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--trl-new-tokens", type=int, default=64, help="TRL's default path is slow: fewer steps")
    parser.add_argument("--compiled-batches", nargs="*", type=int, default=[8], help="batches for the compiled HF run")
    parser.add_argument("--lora-r", type=int, default=32)
    parser.add_argument("--sigma", type=float, default=1e-2, help="AQN noise on the NVFP4 run")
    parser.add_argument("--json", default=None)
    parser.add_argument("--choices", default=None, help="save the kernel choices made during the run")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)

    config = qwen25_config(args.model)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    vocab, rows = config.vocab_size, []
    print(f"Rollouts, {args.model} shapes (random weights), {args.prompt_tokens}-token prompts, temperature 1; "
          f"{torch.cuda.get_device_name()}")  # fmt: skip
    print("| backend | batch | tokens/s | ms/step | first-call extra s |\n|---|---|---|---|---|")
    for batch in args.batches:
        measure("TRL default generate, bf16", hf_generate(model, batch, args.prompt_tokens, args.trl_new_tokens, vocab, False),
                batch, args.trl_new_tokens, rows, repeat_first=False)  # fmt: skip
    for batch in args.compiled_batches:
        measure("transformers static-cache compiled, bf16",
                hf_generate(model, batch, args.prompt_tokens, args.new_tokens, vocab, True), batch, args.new_tokens, rows)  # fmt: skip

    peft_model = get_peft_model(model, nvfp4_lora_config(model, r=args.lora_r, train_norms=False))
    generator = StaticCacheGenerator(peft_model)
    for batch in args.batches:
        measure(f"ours, bf16 + LoRA r{args.lora_r}", ours(generator, batch, args.prompt_tokens, args.new_tokens, vocab),
                batch, args.new_tokens, rows)  # fmt: skip
    del generator
    model = quantize_model(peft_model.unload())  # drop the bf16 adapters, then NVFP4 in place
    del peft_model
    torch.cuda.empty_cache()
    peft_model = get_peft_model(model, nvfp4_lora_config(model, r=args.lora_r, train_norms=False))
    noise = NormNoise(peft_model, seed=0)
    noise.set_step(1, args.sigma)
    generator = StaticCacheGenerator(peft_model)
    with noise.rollout():
        for batch in args.batches:
            measure(f"ours, NVFP4 + LoRA r{args.lora_r} + AQN", ours(generator, batch, args.prompt_tokens,
                    args.new_tokens, vocab), batch, args.new_tokens, rows)  # fmt: skip
    print(f"graph captures: {generator.captures}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    if args.choices:
        from trl_qerl.nvfp4 import kernels

        kernels.CHOOSER.save(args.choices)


if __name__ == "__main__":
    main()
