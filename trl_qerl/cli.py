"""The ``trl-qerl`` command.

Subcommands:
    train      GRPO/DAPO with QeRL from a YAML recipe (``--config recipes/...yaml``) plus flag overrides
    eval       accuracy of a model (or base + adapter) on GSM8K / MATH-500-style data
    quantize   quantise a 16-bit checkpoint to a compressed-tensors NVFP4 checkpoint (vLLM-loadable)
    demo       the embedded default: runs offline on CPU
    vllm-serve a vLLM rollout server for multi-GPU training (``vllm_mode="server"``)

Options follow TRL's scripts: one parser per command built by `trl.TrlParser` from dataclasses, underscored long
options (``--dataset_name``; the dashed spelling ``--dataset-name`` works too), defaults shown in ``--help``, and a
YAML ``--config`` whose values the flags override. ``train`` parses ``(QeRLScriptArguments, QeRLConfig,
QeRLModelConfig)``, the same triple as ``trl grpo`` with TRL's ``ModelConfig`` carrying the model and LoRA options.

This module imports nothing heavy: torch, transformers and the trainer load inside the command that needs them, so
``trl-qerl --help``, ``--version`` and ``trl-qerl eval --help`` answer at once. ``train`` works under
``accelerate launch`` too (one process per GPU).
"""

from __future__ import annotations

import difflib
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path


DATASET_KINDS = ["auto", "gsm8k", "math", "tiny"]


DEFAULT_REWARDS = ["accuracy", "format"]


@dataclass
class QeRLScriptArguments:
    """What `trl-qerl train` trains on: data and rewards. The model and LoRA options are TRL's `ModelConfig`
    (`QeRLModelConfig`), the training options `QeRLConfig`.

    Parameters:
        dataset_name (`str`, *optional*):
            Hub dataset (`"openai/gsm8k"`, ...), a local json/jsonl/parquet file, `"reasoning-gym:<task>"` (a
            procedural reasoning-gym task, offline), or `"tiny"` for the shipped arithmetic task. Required, except
            with the shipped tiny model, which defaults to `"tiny"`.
        dataset_config (`str`, *optional*):
            Hub dataset configuration (`"main"` for GSM8K); for reasoning-gym, the task's options as JSON.
        dataset_train_split (`str`, *optional*, defaults to `"train"`):
            Split to train on.
        dataset_kind (`str`, *optional*, defaults to `"auto"`):
            How answers are written: `"gsm8k"` (`#### 42`), `"math"` (`\\boxed{}` in the solution), `"tiny"`, or
            `"auto"` to detect it.
        max_train_samples (`int`, *optional*):
            Use only the first N training rows.
        system_prompt (`str`, *optional*):
            System prompt. If `None`, the R1-style one (`trl_qerl.data.SYSTEM_PROMPT`).
        reward_funcs (`list[str]`, *optional*, defaults to `["accuracy", "format"]`):
            Reward functions by name: `"accuracy"`, `"format"`, `"length"` (DAPO's overlong penalty),
            `"reasoning_gym"` (the task's own scorer, the default for reasoning-gym datasets).
    """

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Hub dataset ('openai/gsm8k', ...), a local json/jsonl/parquet file, 'reasoning-gym:<task>' "
            "(procedural, offline), or 'tiny' for the shipped arithmetic task. Required, except with the shipped "
            "tiny model."
        },  # fmt: skip
    )
    dataset_config: str | None = field(
        default=None,
        metadata={
            "help": "Hub dataset configuration ('main' for GSM8K); for reasoning-gym, the task's options as JSON"
        },
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_kind: str = field(
        default="auto",
        metadata={
            "help": "How answers are written: 'gsm8k' (#### 42), 'math' (\\\\boxed{} in the solution), 'tiny', "
            "or 'auto' to detect it.",
            "choices": DATASET_KINDS,
        },  # fmt: skip
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only the first N training rows."})
    system_prompt: str | None = field(default=None, metadata={"help": "System prompt (default: the R1-style one)."})
    reward_funcs: list[str] = field(
        default_factory=lambda: list(DEFAULT_REWARDS),
        metadata={
            "help": "Reward functions by name: 'accuracy', 'format', 'length' (DAPO overlong penalty), "
            "'reasoning_gym' (the task's own scorer; the default for reasoning-gym:<task> datasets)."
        },
    )


@dataclass
class EvalArguments:
    """What `trl-qerl eval` measures. Each option also has its earlier spelling (`--model`, `--dataset`, `--split`,
    `--kind`, `--limit`, `--samples`, `--json`, dashed forms)."""

    model_name_or_path: str = field(
        metadata={"help": "Base model: Hub id or path (16-bit, or compressed-tensors NVFP4).", "aliases": ["--model"]}
    )
    adapter: str | None = field(default=None, metadata={"help": "LoRA adapter directory to apply."})
    quantization: str = field(
        default="nvfp4",
        metadata={"help": "Base weights: 'nvfp4' (quantised on load) or 'bf16'.", "choices": ["nvfp4", "bf16"]},
    )
    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Hub dataset, local json/jsonl/parquet file, or 'tiny'. Required, except with the shipped "
            "tiny model.",
            "aliases": ["--dataset"],
        },  # fmt: skip
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Hub dataset configuration ('main' for GSM8K)"})
    dataset_test_split: str = field(default="test", metadata={"help": "Split to evaluate.", "aliases": ["--split"]})
    dataset_kind: str = field(
        default="auto",
        metadata={
            "help": "How answers are written (see `trl-qerl train --help`).",
            "choices": DATASET_KINDS,
            "aliases": ["--kind"],
        },  # fmt: skip
    )
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Evaluate the first N problems.", "aliases": ["--limit"]}
    )
    temperature: float = field(default=0.6, metadata={"help": "Sampling temperature (paper: 0.6; 0 = greedy)."})
    top_p: float = field(default=0.95, metadata={"help": "Nucleus sampling (paper: 0.95)."})
    max_new_tokens: int = field(default=1024, metadata={"help": "Longest completion, in tokens."})
    samples_per_problem: int = field(
        default=1, metadata={"help": "Completions sampled per problem.", "aliases": ["--samples"]}
    )
    batch_size: int = field(default=16, metadata={"help": "Problems per generation batch."})
    seed: int = field(default=0, metadata={"help": "Random seed for sampling."})
    output_json: str | None = field(
        default=None, metadata={"help": "Also write the result to this JSON file.", "aliases": ["--json"]}
    )


@dataclass
class QuantizeArguments:
    """What `trl-qerl quantize` converts. The model and output directory may also be given as two positional
    arguments (`trl-qerl quantize MODEL OUTPUT_DIR`)."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Hub id or local directory of a 16-bit checkpoint (or the first positional)."}
    )
    output_dir: str | None = field(
        default=None, metadata={"help": "Where to write the NVFP4 checkpoint (or the second positional)."}
    )
    device: str | None = field(
        default=None, metadata={"help": "Device to quantise on; default: cuda if available, else cpu."}
    )
    modules_to_not_convert: list[str] | None = field(
        default=None,
        metadata={"help": "Extra Linear layers kept in 16-bit (names, suffixes, 're:' regex)", "aliases": ["--keep"]},
    )
    overwrite: bool = field(
        default=False,
        metadata={"help": "Replace a non-empty output directory (its whole content: stale shards never linger)."},
    )


def make_parser(command: str):
    """The `trl.TrlParser` of ``train``, ``eval`` or ``quantize`` (as TRL's scripts' ``make_parser``)."""
    from trl import TrlParser

    if command == "train":
        from .config import QeRLConfig, QeRLModelConfig

        return TrlParser(
            (QeRLScriptArguments, QeRLConfig, QeRLModelConfig),
            prog="trl-qerl train",
            description="GRPO/DAPO with QeRL (NVFP4 base + LoRA + AQN). Start from a recipe: trl-qerl train --config "
            "recipes/qwen2.5-7b-gsm8k-dapo.yaml [--flag value ...]",
        )
    if command == "eval":
        return TrlParser((EvalArguments,), prog="trl-qerl eval", description="Accuracy on GSM8K/MATH-500-style data.")
    if command == "quantize":
        parser = TrlParser(
            (QuantizeArguments,),
            prog="trl-qerl quantize",
            description="Quantise a 16-bit causal LM to NVFP4 (W4A16) and save it as a compressed-tensors checkpoint.",
        )
        parser.add_argument("model", nargs="?", help="same as --model_name_or_path")
        parser.add_argument("output", nargs="?", help="same as --output_dir")
        return parser
    raise ValueError(f"no parser for {command!r}; choose 'train', 'eval' or 'quantize'.")


def parse_quantize_arguments(argv: Sequence[str]) -> QuantizeArguments:
    """`QuantizeArguments` from options or the two positionals (``trl-qerl quantize MODEL OUTPUT_DIR``)."""
    parser = make_parser("quantize")
    args, positional = parser.parse_args_and_config(list(argv))
    for name, value in (("model_name_or_path", positional.model), ("output_dir", positional.output)):
        if value is not None and getattr(args, name) not in (None, value):
            parser.error(f"--{name} {getattr(args, name)} and the positional {value} disagree; give one of them")
        setattr(args, name, getattr(args, name) or value)
    if not args.model_name_or_path or not args.output_dir:
        parser.error("give the 16-bit model and the output directory: trl-qerl quantize MODEL OUTPUT_DIR (or "
                     "--model_name_or_path MODEL --output_dir OUTPUT_DIR)")  # fmt: skip
    return args


def _train(argv: Sequence[str]) -> int:
    from .config import apply_model_config

    parser = make_parser("train")
    script_args, training_args, model_args = parser.parse_args_and_config(list(argv))
    if not model_args.model_name_or_path:
        parser.error("--model_name_or_path is required (in the recipe or on the command line)")
    dataset_name = _dataset_or_error(parser, script_args.dataset_name, model_args.model_name_or_path)
    try:
        apply_model_config(training_args, model_args)
    except ValueError as error:
        parser.error(str(error))

    from .data import SYSTEM_PROMPT, build_math_dataset, tiny_arithmetic_dataset
    from .reasoning_gym import is_reasoning_gym, reasoning_gym_reward
    from .rewards import REWARDS, make_length_penalty
    from .trainer import QeRLGRPOTrainer

    if isinstance(script_args.reward_funcs, str):  # a YAML scalar: one reward, never its characters
        script_args.reward_funcs = [script_args.reward_funcs]
    available = {**REWARDS, "reasoning_gym": reasoning_gym_reward}
    if is_reasoning_gym(dataset_name) and list(script_args.reward_funcs) == DEFAULT_REWARDS:
        print("note: reasoning-gym dataset: rewarding with the task's own scorer (--reward_funcs reasoning_gym)")
        script_args.reward_funcs = ["reasoning_gym"]
    unknown = [name for name in script_args.reward_funcs if name != "length" and name not in available]
    if unknown:
        parser.error(f"unknown reward {unknown[0]!r}; choose from {sorted(available) + ['length']}")
    rewards = [
        make_length_penalty(training_args.max_completion_length) if name == "length" else available[name]
        for name in script_args.reward_funcs
    ]
    if dataset_name == "tiny":
        dataset = tiny_arithmetic_dataset(script_args.dataset_train_split, limit=script_args.max_train_samples)
    else:
        dataset = build_math_dataset(
            dataset_name,
            split=script_args.dataset_train_split,
            kind=script_args.dataset_kind,
            system_prompt=script_args.system_prompt or SYSTEM_PROMPT,
            subset=script_args.dataset_config,
            limit=script_args.max_train_samples,
        )
    trainer = QeRLGRPOTrainer(
        model_args.model_name_or_path, reward_funcs=rewards, args=training_args, train_dataset=dataset
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=dataset_name)
    return 0


def _eval(argv: Sequence[str]) -> int:
    parser = make_parser("eval")
    (args,) = parser.parse_args_and_config(list(argv))
    dataset_name = _dataset_or_error(parser, args.dataset_name, args.model_name_or_path)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .data import build_math_dataset, tiny_arithmetic_dataset
    from .evaluation import evaluate_accuracy
    from .loading import from_pretrained
    from .lora import load_adapter

    device_map = "cuda" if torch.cuda.is_available() else None
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if args.quantization == "nvfp4":
        model = from_pretrained(args.model_name_or_path, device_map=device_map, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, device_map=device_map, dtype=dtype)
    if args.adapter:
        model = load_adapter(model, args.adapter)
    tokenizer = AutoTokenizer.from_pretrained(_tokenizer_source(args), padding_side="left")
    if dataset_name == "tiny":
        dataset = tiny_arithmetic_dataset(args.dataset_test_split, limit=args.max_eval_samples)
    else:
        dataset = build_math_dataset(dataset_name, split=args.dataset_test_split, kind=args.dataset_kind,
                                     subset=args.dataset_config, limit=args.max_eval_samples)  # fmt: skip
    result = evaluate_accuracy(
        model, tokenizer, dataset, temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
        samples_per_problem=args.samples_per_problem, batch_size=args.batch_size, seed=args.seed,
    )  # fmt: skip
    print(json.dumps(result.as_dict(), indent=2))
    if args.output_json:
        with open(args.output_json, "w") as handle:
            json.dump(result.as_dict(), handle, indent=2)
    return 0


def _tokenizer_source(args: EvalArguments) -> str:
    """The adapter's tokenizer when it ships one (chat template included), else the base model's."""
    from pathlib import Path

    if args.adapter and (Path(args.adapter) / "tokenizer_config.json").is_file():
        return args.adapter
    if args.adapter and not Path(args.adapter).is_dir():  # a Hub id: it may ship one
        from huggingface_hub import file_exists

        try:
            if file_exists(args.adapter, "tokenizer_config.json"):
                return args.adapter
        except Exception as error:  # offline, private, ...: the base's tokenizer is a safe choice
            print(f"note: cannot check {args.adapter} for a tokenizer ({error}); using the base model's")
    return args.model_name_or_path


def _quantize(argv: Sequence[str]) -> int:
    args = parse_quantize_arguments(argv)

    import torch
    from transformers import AutoTokenizer

    from .checkpoints import atomic_directory, check_output_dir
    from .loading import from_pretrained
    from .quantizer import NVFP4A16Config

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"error: --device {device}, but no CUDA GPU is visible here; use --device cpu (slower).")
    try:  # before any work: a refused output costs nothing
        check_output_dir(args.output_dir, inputs=[args.model_name_or_path], overwrite=args.overwrite)
    except (ValueError, PermissionError) as error:
        raise SystemExit(f"error: {error}") from None
    config = NVFP4A16Config(modules_to_not_convert=args.modules_to_not_convert)
    model = from_pretrained(args.model_name_or_path, quantization_config=config, device_map=device)
    with atomic_directory(args.output_dir) as staging:  # the output appears only once complete
        model.save_pretrained(staging)
        try:
            AutoTokenizer.from_pretrained(args.model_name_or_path).save_pretrained(staging)
        except (OSError, ValueError):
            print(f"note: no tokenizer found next to {args.model_name_or_path}; copy it to {args.output_dir} yourself")
    kept = ", ".join(config.ignore) or "none"
    print(f"wrote NVFP4 checkpoint to {args.output_dir} (kept in 16-bit: {kept})")
    return 0


def _demo(argv: Sequence[str]) -> int:
    from .demo import main as demo_main

    return demo_main(argv)


def _vllm_serve(argv: Sequence[str]) -> int:
    from .rollout.vllm_server import serve

    return serve(argv)


def _dataset_or_error(parser, dataset_name: str | None, model: str) -> str:
    """The dataset to use: the one given, the toy task for the shipped tiny model, else a parser error saying what
    to pass (a Qwen run must not train or evaluate on the toy task by default)."""
    if dataset_name:
        return dataset_name
    from .data import tiny_assets

    try:
        if Path(model).expanduser().resolve() == tiny_assets().resolve():
            return "tiny"
    except OSError:
        pass
    parser.error(
        f"--dataset_name is required with --model_name_or_path {model}: a Hub dataset (e.g. --dataset_name "
        "openai/gsm8k --dataset_config main --dataset_kind gsm8k), a local .json/.jsonl/.parquet file, or "
        "--dataset_name tiny for the shipped arithmetic toy task. Only the shipped tiny model defaults to the toy "
        "task; `trl-qerl demo` runs it offline."
    )


COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "train": (_train, "GRPO/DAPO with NVFP4 + LoRA + AQN from a YAML recipe and flags"),
    "eval": (_eval, "accuracy of a model or base + adapter on GSM8K/MATH-style data"),
    "quantize": (_quantize, "quantise a 16-bit checkpoint to NVFP4 (compressed-tensors)"),
    "demo": (_demo, "offline demo on an embedded model (no GPU, no network)"),
    "vllm-serve": (_vllm_serve, "vLLM rollout server: base checkpoint + pushed adapters and AQN norms"),
}


def version() -> str:
    """``trl-qerl X (trl Y, transformers Z, peft W, torch V)`` from the installed distributions' metadata."""
    from importlib import metadata

    def installed(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    from . import __version__

    stack = [f"{name} {found}" for name in ("trl", "transformers", "peft", "torch") if (found := installed(name))]
    return f"trl-qerl {installed('trl-qerl') or __version__} ({', '.join(stack)})"


def usage() -> str:
    lines = [f"  {name:<11} {help_}" for name, (_, help_) in COMMANDS.items()]
    return (
        "usage: trl-qerl <command> [options]\n\n"
        "QeRL: GRPO/DAPO on NVFP4 4-bit base weights + LoRA + Adaptive Quantization Noise, with TRL.\n\n"
        "commands:\n" + "\n".join(lines) + "\n\n"
        "options:\n  -h, --help     show this help and exit\n  -V, --version  show the version and exit\n\n"
        "`trl-qerl <command> --help` lists a command's options."
    )


def _unknown(name: str) -> str:
    if name.startswith("-"):
        return (f"trl-qerl: unknown option {name!r}. Options go after the command, e.g. `trl-qerl train --config "
                "recipe.yaml`; see `trl-qerl --help`.")  # fmt: skip
    close = difflib.get_close_matches(name, COMMANDS, n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"trl-qerl: {name!r} is not a command.{hint} Commands: {', '.join(COMMANDS)}; see `trl-qerl --help`."


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version", "version"):
        print(version())
        return 0
    if argv[0] not in COMMANDS:
        print(_unknown(argv[0]), file=sys.stderr)
        return 2
    command, _ = COMMANDS[argv[0]]
    return command(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
