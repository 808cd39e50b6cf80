"""What the vLLM rollout backend costs and gains on a CPU machine, with the shipped tiny model (float32).

Run in the vLLM environment (``make test-vllm`` builds it):

    .venv-vllm/bin/python scripts/bench_vllm_cpu.py [--batch 32] [--tokens 48] [--repeats 3]

Prints one table: engine start-up, the per-step adapter sync (save the LoRA matrices + load them under a new id),
the per-rollout norm push (trained norms + AQN noise), and sampled rollout throughput of vLLM against transformers
``generate`` on the same PEFT model (the baseline, measured in the same run). The NVFP4 rows need vLLM's W4A16
NVFP4 kernel, which exists only on GPUs (Marlin); on CPU they use the tests' dequantise-then-matmul stand-in
(tests/vllm_cpu/nvfp4_cpu_kernel.py), so they measure correctness plumbing, not kernel speed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch


os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
ROOT = Path(__file__).resolve().parents[1]


def _peft(nvfp4: bool):
    from transformers import AutoModelForCausalLM

    from trl_qerl import from_pretrained
    from trl_qerl.data import tiny_assets
    from trl_qerl.lora import get_peft_model, nvfp4_lora_config

    model = (from_pretrained if nvfp4 else AutoModelForCausalLM.from_pretrained)(tiny_assets(), dtype=torch.float32)
    peft = get_peft_model(model, nvfp4_lora_config(model, r=16, train_norms=True))
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(0))
    return peft.eval()


def _prompts(batch: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from trl_qerl.data import tiny_arithmetic_dataset, tiny_assets

    tokenizer = AutoTokenizer.from_pretrained(tiny_assets())
    rows = tiny_arithmetic_dataset("test", limit=batch)
    return [tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True)["input_ids"] for row in rows]


def _hf_rollout(peft, prompts, tokens: int, eos: int, pad: int) -> tuple[float, int]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    start = time.perf_counter()
    with torch.no_grad():
        out = peft.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, max_new_tokens=tokens,
                            eos_token_id=eos, pad_token_id=pad)  # fmt: skip
    elapsed = time.perf_counter() - start
    return elapsed, int((out[:, width:] != pad).sum())  # generate pads finished rows with `pad`


def measure(nvfp4: bool, batch: int, tokens: int, repeats: int) -> dict[str, float]:
    from transformers import AutoTokenizer

    from trl_qerl.data import tiny_assets
    from trl_qerl.noise import NormNoise
    from trl_qerl.rollout.vllm_checkpoint import norm_state, save_base_checkpoint, save_vllm_adapter
    from trl_qerl.rollout.vllm_engine import VLLMEngine

    tokenizer = AutoTokenizer.from_pretrained(tiny_assets())
    peft, prompts = _peft(nvfp4), _prompts(batch)
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    save_base_checkpoint(peft, work / "base")
    start = time.perf_counter()
    engine = VLLMEngine(
        work / "base", max_lora_rank=16, dtype="float32", max_model_len=256, max_num_seqs=batch, seed=0
    )
    startup = time.perf_counter() - start
    sync, push, rollout, produced = [], [], [], 0
    noise = NormNoise(peft, seed=0)
    sampling = dict(temperature=1.0, max_tokens=tokens, stop_token_ids=[tokenizer.eos_token_id])
    for step in range(repeats + 1):  # the first round warms up
        start = time.perf_counter()
        engine.load_adapter(str(save_vllm_adapter(peft, work / f"step-{step}")))
        sync.append(time.perf_counter() - start)
        with noise.rollout(1e-2):
            start = time.perf_counter()
            engine.set_norms(norm_state(peft))
            push.append(time.perf_counter() - start)
            start = time.perf_counter()
            completions, _ = engine.generate(prompts, sampling)
            rollout.append(time.perf_counter() - start)
        if step:
            produced += sum(map(len, completions))
    hf_time, hf_tokens = 0.0, 0
    for _ in range(repeats):
        with noise.rollout(1e-2):
            elapsed, count = _hf_rollout(peft, prompts, tokens, tokenizer.eos_token_id, tokenizer.pad_token_id)
        hf_time, hf_tokens = hf_time + elapsed, hf_tokens + count
    return {
        "startup_s": startup,
        "sync_ms": 1e3 * sum(sync[1:]) / repeats,
        "norms_ms": 1e3 * sum(push[1:]) / repeats,
        "vllm_tok_s": produced / sum(rollout[1:]),
        "hf_tok_s": hf_tokens / hf_time,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    sys.path.insert(0, str(ROOT / "tests" / "vllm_cpu"))
    import nvfp4_cpu_kernel

    nvfp4_cpu_kernel.install()
    print(f"tiny model (1.7M parameters), float32, batch {args.batch}, up to {args.tokens} new tokens, LoRA r=16, "
          f"{torch.get_num_threads()} threads, mean of {args.repeats} rounds after one warm-up\n")  # fmt: skip
    print("| base | engine start (s) | adapter sync (ms) | norm push (ms) | vLLM tok/s | transformers tok/s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for nvfp4 in (False, True):
        r = measure(nvfp4, args.batch, args.tokens, args.repeats)
        label = "NVFP4 (CPU stand-in kernel)" if nvfp4 else "16-bit (fp32)"
        print(f"| {label} | {r['startup_s']:.1f} | {r['sync_ms']:.0f} | {r['norms_ms']:.1f} | {r['vllm_tok_s']:.0f} "
              f"| {r['hf_tok_s']:.0f} | {r['vllm_tok_s'] / r['hf_tok_s']:.2f}x |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
