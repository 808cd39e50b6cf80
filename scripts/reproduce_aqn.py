"""Does AQN help? The paper's comparison on a task where sampling explores: five arms, several seeds, 95 % CIs.

Model: `scripts/pretrain_explore.py`'s small model (``benchmarks/aqn_study/model``) on reasoning-gym ``chain_sum``
(3-4 one-digit terms), whose samples at temperature 1 carry several solution styles and uncertain digits. Reward:
the task's own scorer (`trl_qerl.reasoning_gym.reasoning_gym_reward`). Arms, same budget and settings:

* 16-bit LoRA; NVFP4 LoRA; NVFP4 LoRA + AQN (exponential); 16-bit LoRA + AQN (noise without quantisation);
  full fine-tuning (learning rate / 10);
* optionally (``--ablation``) the AQN schedules: exponential / linear / cosine / logarithmic on NVFP4 LoRA.

No importance-sampling correction (``rollout_importance_sampling=False``, the reference's choice): rollouts sampled
under noise are trained on as on-policy. Each run reports held-out greedy accuracy (200 test problems, never trained
on by the pretraining; RL draws its problems from reasoning-gym's train seed) before and after, and logs per step the
reward, TRL's entropy (clean policy, loss forward) and ``rollout/sampling_entropy`` (the policy that sampled, noise
included). The table gives means with 95 % confidence intervals (Student t over seeds); runs are resumable
(finished ones are read back).

Usage:
    python scripts/reproduce_aqn.py --seeds 0 1 2 3 4 --steps 40 --output reproduce-aqn
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch


MODEL = Path(__file__).resolve().parents[1] / "benchmarks" / "aqn_study" / "model"
ARMS = {
    "16-bit LoRA": dict(quantization="bf16", aqn_schedule="off"),
    "NVFP4 LoRA": dict(quantization="nvfp4", aqn_schedule="off"),
    "NVFP4 LoRA + AQN": dict(quantization="nvfp4", aqn_schedule="exponential"),
    "16-bit LoRA + AQN": dict(quantization="bf16", aqn_schedule="exponential"),
    "full fine-tuning": dict(quantization="none", aqn_schedule="off"),
}
ABLATION = {f"NVFP4 + AQN {name}": dict(quantization="nvfp4", aqn_schedule=name)
            for name in ("exponential", "linear", "cosine", "logarithmic")}  # fmt: skip
# two-sided 95 % Student t quantiles by degrees of freedom
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def interval(values: list[float]) -> tuple[float, float]:
    """Mean and half-width of the 95 % confidence interval (Student t; 0 for one value)."""
    mean = statistics.mean(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))


def task(model_dir: Path) -> dict:
    """The reasoning-gym task and options the model was pretrained for (written by pretrain_explore.py)."""
    return json.loads((Path(model_dir) / "task.json").read_text())


def held_out_accuracy(model, tokenizer, problems: int, spec: dict) -> float:
    """Greedy accuracy on the first ``problems`` held-out problems (the reward's own check)."""
    from trl_qerl.reasoning_gym import build_reasoning_gym_dataset, reasoning_gym_reward

    test = build_reasoning_gym_dataset(spec["task"], split="test", size=problems, **spec["options"])
    model.eval()
    scores = []
    for start in range(0, problems, 50):
        rows = test.select(range(start, min(start + 50, problems)))
        texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in rows["prompt"]]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=48, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        completions = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        scores += reasoning_gym_reward(completions, reasoning_gym=rows["reasoning_gym"])
    return statistics.mean(scores)


def run(name: str, settings: dict, seed: int, args, root: Path) -> dict:
    directory = root / f"{name.replace(' ', '_').replace('+', 'plus')}-seed{seed}"
    summary_path = directory / "summary.json"
    if summary_path.exists():
        return json.loads(summary_path.read_text())
    from transformers import AutoTokenizer

    from trl_qerl.config import QeRLConfig
    from trl_qerl.lora import nvfp4_lora_config
    from trl_qerl.reasoning_gym import build_reasoning_gym_dataset, reasoning_gym_reward
    from trl_qerl.trainer import QeRLGRPOTrainer

    torch.manual_seed(seed)
    spec = task(args.model)
    full = settings["quantization"] == "none"
    learning_rate = args.learning_rate / 10 if full else args.learning_rate
    prompts = args.steps * args.batch // args.generations
    config = QeRLConfig(
        output_dir=str(directory), max_steps=args.steps, per_device_train_batch_size=args.batch,
        num_generations=args.generations, max_completion_length=48, learning_rate=learning_rate,
        lr_scheduler_type="constant", temperature=1.0, logging_steps=1, save_strategy="no", report_to="none",
        seed=seed, use_cpu=not torch.cuda.is_available(), bf16=torch.cuda.is_available(),
        gradient_checkpointing=False, disable_tqdm=True, aqn_schedule=settings["aqn_schedule"],
        aqn_sigma_start=args.sigma_start, aqn_sigma_end=args.sigma_end, quantization=settings["quantization"],
        model_init_kwargs={"dtype": torch.bfloat16 if torch.cuda.is_available() else torch.float32},
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    trainer = QeRLGRPOTrainer(
        str(args.model), reward_funcs=reasoning_gym_reward, args=config, processing_class=tokenizer,
        train_dataset=build_reasoning_gym_dataset(spec["task"], size=prompts, seed=seed, **spec["options"]),
        peft_config=None if full else nvfp4_lora_config(r=16, train_norms=True),
    )  # fmt: skip
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    curve = lambda key: [float(entry.get(key, float("nan"))) for entry in logs]  # noqa: E731
    summary = {
        "name": name, "seed": seed, **settings, "learning_rate": learning_rate, "train_seconds": round(seconds, 1),
        "accuracy_after": held_out_accuracy(trainer.model, tokenizer, args.eval_problems, spec),
        "reward": curve("reward"), "entropy": curve("entropy"), "sampling_entropy": curve("rollout/sampling_entropy"),
        "sigma": curve("aqn/sigma"),
    }  # fmt: skip
    summary_path.write_text(json.dumps(summary))
    print(f"{name:>22} seed {seed}: accuracy after {summary['accuracy_after']:.3f} ({seconds:.0f} s)", flush=True)
    return summary


def table(groups: dict[str, list[dict]], before: float) -> str:
    columns = ["arm", "seeds", "held-out accuracy after (mean ± 95 % CI)", "change vs. before",
               "reward, last 10 steps", "sampling entropy", "clean entropy (TRL)"]  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for name, results in groups.items():
        after, half = interval([r["accuracy_after"] for r in results])
        last, last_half = interval([statistics.mean(r["reward"][-10:]) for r in results])
        sampling = statistics.mean(statistics.mean(r["sampling_entropy"]) for r in results)
        clean = statistics.mean(statistics.mean(r["entropy"]) for r in results)
        lines.append(f"| {name} | {len(results)} | {after:.3f} ± {half:.3f} | {after - before:+.3f} | "
                     f"{last:.3f} ± {last_half:.3f} | {sampling:.3f} | {clean:.3f} |")  # fmt: skip
    return "\n".join(lines)


def plot(groups: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(15, 4))
    keys = (("reward", "reward (task score)"), ("sampling_entropy", "sampling entropy (noisy policy)"),
            ("entropy", "clean entropy (TRL)"))  # fmt: skip
    for name, results in groups.items():
        for axis, (key, _) in zip(axes, keys):
            mean = [statistics.mean(values) for values in zip(*(r[key] for r in results))]
            smooth = [statistics.mean(mean[max(0, i - 4) : i + 1]) for i in range(len(mean))]
            axis.plot(smooth, label=name)
    for axis, (_, label) in zip(axes, keys):
        axis.set_xlabel("training step")
        axis.set_ylabel(label + ", 5-step mean")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32, help="completions per step")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt")
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--sigma-start", type=float, default=1e-2)
    parser.add_argument("--sigma-end", type=float, default=1e-4)
    parser.add_argument("--eval-problems", type=int, default=200)
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS) + list(ABLATION))
    parser.add_argument("--ablation", action="store_true", help="also the four AQN schedules on NVFP4 LoRA")
    parser.add_argument("--output", type=Path, default=Path("reproduce-aqn"))
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    before_path = args.output / "before.json"
    if before_path.exists():
        before = json.loads(before_path.read_text())["accuracy"]
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
        before = held_out_accuracy(model, tokenizer, args.eval_problems, task(args.model))
        before_path.write_text(json.dumps({"accuracy": before}))
    print(f"held-out greedy accuracy before RL: {before:.3f}", flush=True)
    arms = {name: {**ARMS, **ABLATION}[name] for name in args.arms}
    if args.ablation:
        arms.update(ABLATION)
    groups = {name: [run(name, settings, seed, args, args.output) for seed in args.seeds]
              for name, settings in arms.items()}  # fmt: skip
    text = table(groups, before)
    print(f"\nbefore RL: {before:.3f}\n{text}")
    (args.output / "table.md").write_text(f"held-out greedy accuracy before RL: {before:.3f}\n\n{text}\n")
    options = task(args.model)["options"]
    title = f"AQN study: chain_sum ({options['max_digits']}-digit terms), {len(args.seeds)} seeds, {args.steps} steps"
    plot(groups, args.output / "curves.png", title)


if __name__ == "__main__":
    main()
