"""The ``trl-qerl`` command.

Subcommands:
    train      GRPO/DAPO with QeRL from a YAML recipe (``--config recipes/...yaml``) plus flag overrides
    eval       accuracy of a model (or base + adapter) on GSM8K / MATH-500-style data
    quantize   quantise a 16-bit checkpoint to a compressed-tensors NVFP4 checkpoint (vLLM-loadable)
    demo       the embedded default: runs offline on CPU
    vllm-serve a vLLM rollout server for multi-GPU training (``vllm_mode="server"``)

``train`` works under ``accelerate launch`` too (one process per GPU).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass
class QeRLScriptArguments:
    """What to train on: model, data and rewards (the rest is `QeRLConfig`)."""

    model_name_or_path: str = field(
        default="", metadata={"help": "Hub id or path of the base model (16-bit, or compressed-tensors NVFP4)."}
    )
    dataset_name: str = field(
        default="tiny",
        metadata={"help": "Hub dataset ('openai/gsm8k', ...), a local json/jsonl/parquet file, or 'tiny' for the "
                  "shipped arithmetic task."},  # fmt: skip
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Hub dataset configuration ('main' for GSM8K)."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_kind: str = field(
        default="auto",
        metadata={"help": "How answers are written: 'gsm8k' (#### 42), 'math' (\\\\boxed{} in solution), 'tiny', 'auto'.",
                  "choices": ["auto", "gsm8k", "math", "tiny"]},  # fmt: skip
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only the first N training rows."})
    system_prompt: str | None = field(default=None, metadata={"help": "System prompt (default: the R1-style one)."})
    reward_funcs: list[str] = field(
        default_factory=lambda: ["accuracy", "format"],
        metadata={"help": "Reward functions by name: 'accuracy', 'format', 'length' (DAPO overlong penalty)."},
    )


def _train(argv: Sequence[str]) -> int:
    from trl import TrlParser

    from .config import QeRLConfig
    from .data import SYSTEM_PROMPT, build_math_dataset, tiny_arithmetic_dataset
    from .rewards import REWARDS, make_length_penalty
    from .trainer import QeRLGRPOTrainer

    parser = TrlParser((QeRLScriptArguments, QeRLConfig), prog="trl-qerl train")
    script_args, training_args = parser.parse_args_and_config(list(argv))
    if not script_args.model_name_or_path:
        parser.error("--model_name_or_path is required (in the recipe or on the command line)")
    if script_args.dataset_name == "tiny":
        dataset = tiny_arithmetic_dataset(script_args.dataset_train_split, limit=script_args.max_train_samples)
    else:
        dataset = build_math_dataset(
            script_args.dataset_name,
            split=script_args.dataset_train_split,
            kind=script_args.dataset_kind,
            system_prompt=script_args.system_prompt or SYSTEM_PROMPT,
            subset=script_args.dataset_config,
            limit=script_args.max_train_samples,
        )
    rewards = []
    for name in script_args.reward_funcs:
        if name == "length":
            rewards.append(make_length_penalty(training_args.max_completion_length))
        elif name in REWARDS:
            rewards.append(REWARDS[name])
        else:
            parser.error(f"unknown reward {name!r}; choose from {sorted(REWARDS) + ['length']}")
    trainer = QeRLGRPOTrainer(
        script_args.model_name_or_path, reward_funcs=rewards, args=training_args, train_dataset=dataset
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    return 0


def _eval(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="trl-qerl eval", description="Accuracy on GSM8K / MATH-500-style data.")
    parser.add_argument("--model", required=True, help="base model (Hub id or path)")
    parser.add_argument("--adapter", default=None, help="LoRA adapter directory to apply")
    parser.add_argument("--quantization", default="nvfp4", choices=["nvfp4", "bf16"], help="how to load the base")
    parser.add_argument("--dataset", default="tiny", help="Hub dataset, local file, or 'tiny'")
    parser.add_argument("--dataset-config", default=None)
    parser.add_argument("--split", default="test")
    parser.add_argument("--kind", default="auto", choices=["auto", "gsm8k", "math", "tiny"])
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first N problems")
    parser.add_argument("--temperature", type=float, default=0.6, help="paper: 0.6 (0 = greedy)")
    parser.add_argument("--top-p", type=float, default=0.95, help="paper: 0.95")
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=1, help="samples per problem")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .data import build_math_dataset, tiny_arithmetic_dataset
    from .evaluation import evaluate_accuracy
    from .loading import from_pretrained
    from .lora import load_adapter

    device_map = "cuda" if torch.cuda.is_available() else None
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if args.quantization == "nvfp4":
        model = from_pretrained(args.model, device_map=device_map, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, device_map=device_map, dtype=dtype)
    if args.adapter:
        model = load_adapter(model, args.adapter)
    tokenizer = AutoTokenizer.from_pretrained(args.adapter or args.model, padding_side="left")
    if args.dataset == "tiny":
        dataset = tiny_arithmetic_dataset(args.split, limit=args.limit)
    else:
        dataset = build_math_dataset(args.dataset, split=args.split, kind=args.kind, subset=args.dataset_config,
                                     limit=args.limit)  # fmt: skip
    result = evaluate_accuracy(
        model, tokenizer, dataset, temperature=args.temperature, top_p=args.top_p,
        max_new_tokens=args.max_new_tokens, samples_per_problem=args.samples, batch_size=args.batch_size, seed=args.seed,
    )  # fmt: skip
    print(json.dumps(result.as_dict(), indent=2))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result.as_dict(), handle, indent=2)
    return 0


def _quantize(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="trl-qerl quantize",
        description="Quantise a 16-bit causal LM to NVFP4 (W4A16) and save it as a compressed-tensors checkpoint.",
    )
    parser.add_argument("model", help="Hub id or local directory of a 16-bit checkpoint")
    parser.add_argument("output_dir", help="where to write the NVFP4 checkpoint")
    parser.add_argument("--device", default=None, help="device to quantise on (default: cuda if available, else cpu)")
    parser.add_argument("--keep", nargs="*", default=None, metavar="MODULE", help="extra Linear modules kept in 16-bit")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from .loading import from_pretrained
    from .quantizer import NVFP4Config

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = from_pretrained(
        args.model, quantization_config=NVFP4Config(modules_to_not_convert=args.keep), device_map=device
    )
    model.save_pretrained(args.output_dir)
    try:
        AutoTokenizer.from_pretrained(args.model).save_pretrained(args.output_dir)
    except (OSError, ValueError):
        print(f"note: no tokenizer found next to {args.model}; copy it to {args.output_dir} yourself")
    print(f"wrote NVFP4 checkpoint to {args.output_dir}")
    return 0


def _demo(argv: Sequence[str]) -> int:
    from .demo import main as demo_main

    return demo_main(argv)


def _vllm_serve(argv: Sequence[str]) -> int:
    from .rollout.vllm_server import serve

    return serve(argv)


COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "train": (_train, "GRPO/DAPO with NVFP4 + LoRA + AQN from a YAML recipe and flags"),
    "eval": (_eval, "accuracy of a model or base + adapter on GSM8K/MATH-style data"),
    "quantize": (_quantize, "quantise a 16-bit checkpoint to NVFP4 (compressed-tensors)"),
    "demo": (_demo, "offline demo on an embedded model (no GPU, no network)"),
    "vllm-serve": (_vllm_serve, "vLLM rollout server: base checkpoint + pushed adapters and AQN norms"),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {name:<11} {help_}" for name, (_, help_) in COMMANDS.items()]
        print("usage: trl-qerl <command> [options]\n\ncommands:\n" + "\n".join(lines))
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    command, _ = COMMANDS[argv[0]]
    return command(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
