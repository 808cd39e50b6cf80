"""The paper's comparison at small scale, on the shipped arithmetic task, over several seeds.

Runs `trl_qerl.demo.run_demo` (DAPO on the shipped tiny model) for

* 16-bit LoRA, NVFP4 LoRA, NVFP4 LoRA + AQN (exponential schedule) and full fine-tuning, over ``--seeds``;
* the noise-schedule ablation: NVFP4 LoRA + AQN with exponential / linear / cosine / logarithmic decay;

and reports the reward and entropy curves (mean over seeds, PNG) and the held-out greedy accuracy before and after
training (mean ± standard deviation over seeds). Everything runs on a CPU (minutes per run) or faster on a GPU.

Usage:
    python scripts/reproduce_small.py --seeds 0 1 2 --steps 60 --output reproduce-small
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import time
from pathlib import Path

from trl_qerl.demo import DEMO_DEFAULTS, run_demo


MAIN = {
    "16-bit LoRA": dict(quantization="bf16", aqn_schedule="off"),
    "NVFP4 LoRA": dict(quantization="nvfp4", aqn_schedule="off"),
    "NVFP4 LoRA + AQN": dict(quantization="nvfp4", aqn_schedule="exponential"),
    "full fine-tuning": dict(quantization="none", aqn_schedule="off"),
}
SCHEDULES = ("exponential", "linear", "cosine", "logarithmic")
ABLATION = {name: dict(quantization="nvfp4", aqn_schedule=name) for name in SCHEDULES}


def run(name: str, settings: dict, seed: int, args, root: Path) -> dict:
    learning_rate = args.learning_rate / 10 if settings["quantization"] == "none" else args.learning_rate
    directory = root / f"{name.replace(' ', '_').replace('+', 'plus')}-seed{seed}"
    summary_path = directory / "summary.json"
    if summary_path.exists():  # resumable: finished runs are kept
        summary = json.loads(summary_path.read_text())
    else:
        summary = run_demo(directory, steps=args.steps, seed=seed, eval_problems=args.eval_problems,
                           learning_rate=learning_rate, verbose=False, **settings)  # fmt: skip
    with open(directory / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    curve = lambda key: [float(r[key]) if r[key] not in ("", "None") else float("nan") for r in rows]  # noqa: E731
    result = {"name": name, "seed": seed, "learning_rate": learning_rate, **settings, **summary,
              "reward": curve("reward"), "entropy": curve("entropy"), "sigma": curve("sigma")}  # fmt: skip
    print(f"{name:>22} seed {seed}: accuracy {summary['accuracy_before']:.3f} -> {summary['accuracy_after']:.3f} "
          f"({summary['train_seconds']:.0f} s)", flush=True)  # fmt: skip
    return result


def mean_curve(results: list[dict], key: str) -> list[float]:
    return [statistics.mean(values) for values in zip(*(r[key] for r in results))]


def smooth(values: list[float], window: int = 5) -> list[float]:
    return [statistics.mean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def plot(groups: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, results in groups.items():
        for axis, key in zip(axes, ("reward", "entropy")):
            axis.plot(smooth(mean_curve(results, key)), label=name)
    for axis, label in zip(axes, ("reward (accuracy), 5-step mean", "entropy, 5-step mean")):
        axis.set_xlabel("training step")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def table(groups: dict[str, list[dict]]) -> str:
    columns = ["run", "seeds", "held-out accuracy before", "after (mean ± std)", "mean reward, last 10 steps",
               "mean entropy"]  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for name, results in groups.items():
        after = [r["accuracy_after"] for r in results]
        before = statistics.mean(r["accuracy_before"] for r in results)
        spread = statistics.stdev(after) if len(after) > 1 else 0.0
        last = statistics.mean(statistics.mean(r["reward"][-10:]) for r in results)
        entropy = statistics.mean(statistics.mean(r["entropy"]) for r in results)
        lines.append(f"| {name} | {len(results)} | {before:.3f} | {statistics.mean(after):.3f} ± {spread:.3f} | "
                     f"{last:.3f} | {entropy:.3f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--ablation-seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, default=DEMO_DEFAULTS["steps"])
    parser.add_argument("--learning-rate", type=float, default=DEMO_DEFAULTS["learning_rate"],
                        help="LoRA learning rate (full fine-tuning uses a tenth of it)")  # fmt: skip
    parser.add_argument("--eval-problems", type=int, default=DEMO_DEFAULTS["eval_problems"])
    parser.add_argument("--output", type=Path, default=Path("reproduce-small"))
    parser.add_argument("--skip-ablation", action="store_true")
    args = parser.parse_args()
    if not args.skip_ablation and not set(args.ablation_seeds) <= set(args.seeds):
        parser.error("--ablation-seeds must be a subset of --seeds (the exponential schedule reuses those runs)")
    args.output.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    main_runs = {name: [run(name, s, seed, args, args.output) for seed in args.seeds] for name, s in MAIN.items()}
    plot(main_runs, args.output / "comparison.png", f"QeRL at small scale ({args.steps} steps, seeds {args.seeds})")
    report = ["## Comparison", "", table(main_runs)]
    all_runs = [r for results in main_runs.values() for r in results]
    if not args.skip_ablation:
        # The exponential schedule is the main comparison's NVFP4 LoRA + AQN: reuse those runs, seed for seed.
        ablation = {
            name: [r for r in main_runs["NVFP4 LoRA + AQN"] if r["seed"] in args.ablation_seeds]
            if name == "exponential"
            else [run(f"AQN {name}", s, seed, args, args.output) for seed in args.ablation_seeds]
            for name, s in ABLATION.items()
        }
        plot(ablation, args.output / "schedules.png", "AQN schedule ablation (NVFP4 LoRA + AQN)")
        report += ["", "## AQN schedule ablation", "", table(ablation)]
        all_runs += [r for results in ablation.values() for r in results]
    report.append(f"\n{len(all_runs)} runs in {time.perf_counter() - start:.0f} s")
    (args.output / "report.md").write_text("\n".join(report) + "\n")
    (args.output / "runs.json").write_text(json.dumps(all_runs, indent=1))
    print("\n".join(report))


if __name__ == "__main__":
    main()
