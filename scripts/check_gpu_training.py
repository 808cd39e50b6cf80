"""A short bf16 GRPO run of a Qwen2.5-shaped model on the GPU: do LoRA and the trained norms move, and does AQN's
realised σ follow the schedule down to σ_end?

The configuration every GPU recipe uses (bf16 model, NVFP4 base, LoRA, trained norms, AQN, lr 1e-5), with random
weights at real shapes built on the device and quantised in place. Per step it prints the scheduled σ
(``aqn/sigma``), the RMS change the last noise draw made to the norm weights as stored (``aqn/realised_sigma``),
and the share of LoRA-A, LoRA-B and trained-norm elements that differ from their initial values.

Usage:
    python scripts/check_gpu_training.py --model qwen2.5-7b --steps 20 --json out.json
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import warnings
from pathlib import Path

import torch
from datasets import Dataset
from model_shapes import NAMES, qwen25_config, synthetic_tokenizer
from transformers import AutoModelForCausalLM, TrainerCallback

from trl_qerl.config import QeRLConfig
from trl_qerl.lora import nvfp4_lora_config
from trl_qerl.trainer import QeRLGRPOTrainer


GROUPS = ("lora_A", "lora_B", "layernorm")


def varied_reward(completion_ids, **kwargs):
    """A different value for (almost) every completion, so that advantages are non-zero even when a random model
    never repeats a token."""
    return [(sum(ids) % 101) / 100 for ids in completion_ids]


class ShareChanged(TrainerCallback):
    """After every optimizer step: the share of elements of each trainable group that left their initial value."""

    def __init__(self, model) -> None:
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.initial = {n: p.detach().clone() for n, p in self.params.items()}
        self.rows: list[dict] = []

    def on_step_end(self, args, state, control, **kwargs):
        changed = dict.fromkeys(GROUPS, 0)
        total = dict.fromkeys(GROUPS, 0)
        for name, param in self.params.items():
            group = next((g for g in GROUPS if g in name), None)
            if group:
                changed[group] += int((param.detach() != self.initial[name]).sum())
                total[group] += param.numel()
        self.rows.append({"step": state.global_step, **{g: changed[g] / max(1, total[g]) for g in GROUPS}})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-7b", choices=NAMES)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quantization", default="nvfp4", choices=["nvfp4", "bf16"])
    parser.add_argument("--rollout-backend", default="fast")
    parser.add_argument("--layers", type=int, default=None, help="fewer decoder layers (a quick check)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    config = qwen25_config(args.model, num_hidden_layers=args.layers)
    cuda = torch.cuda.is_available()
    tokenizer = synthetic_tokenizer(config.vocab_size)
    rng = random.Random(0)
    rows = [" ".join(f"w{rng.randrange(3, config.vocab_size)}" for _ in range(32)) for _ in range(4 * args.steps)]
    with torch.device("cuda" if cuda else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    trainer = QeRLGRPOTrainer(
        model,
        reward_funcs=varied_reward,
        args=QeRLConfig(
            output_dir=tempfile.mkdtemp(prefix="gpu-check-"),
            quantization=args.quantization,
            max_steps=args.steps,
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=32,
            learning_rate=1e-5,
            bf16=True,
            use_cpu=not cuda,
            gradient_checkpointing=True,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            rollout_backend=args.rollout_backend,
            aqn_sigma_start=1e-2,
            aqn_sigma_end=1e-4,
            aqn_num_stages=10,
            seed=0,
        ),  # fmt: skip
        train_dataset=Dataset.from_dict({"prompt": rows}),
        processing_class=tokenizer,
        peft_config=nvfp4_lora_config(r=32),
    )
    del model
    dtypes = sorted({str(p.dtype) for p in trainer.model.parameters() if p.requires_grad})
    tracker = ShareChanged(trainer.model)
    trainer.add_callback(tracker)
    trainer.train()
    logs = {e["step"]: e for e in trainer.state.log_history if "aqn/sigma" in e and "loss" in e}
    print(f"\n{args.model} shapes, {args.quantization} + LoRA r32 + trained norms, bf16, lr 1e-5, "
          f"{args.steps} steps; trainable dtypes {dtypes}")  # fmt: skip
    print("| step | stage | aqn/sigma | aqn/realised_sigma | realised / scheduled | LoRA-A changed | LoRA-B changed | "
          "norms changed |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    table = []
    for row in tracker.rows:
        log = logs.get(row["step"], {})
        sigma, realised = log.get("aqn/sigma", float("nan")), log.get("aqn/realised_sigma", float("nan"))
        ratio = realised / sigma if sigma else float("nan")
        table.append({**row, "stage": log.get("aqn/stage"), "sigma": sigma, "realised_sigma": realised})
        print(f"| {row['step']} | {log.get('aqn/stage')} | {sigma:.2e} | {realised:.2e} | {ratio:.3f} | "
              f"{row['lora_A']:.3f} | {row['lora_B']:.3f} | {row['layernorm']:.3f} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "dtypes": dtypes, "rows": table}, indent=2))


if __name__ == "__main__":
    main()
