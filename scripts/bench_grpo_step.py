"""One GRPO step, QeRL (NVFP4 + LoRA) against 16-bit LoRA, measured in the same run.

Random weights at real Qwen2.5 shapes (written once as a bf16 checkpoint), a synthetic word-level tokenizer with
the model's vocabulary, prompts of exactly ``--prompt-tokens`` tokens, and a reward that varies per completion
(so the step does real gradient work). Each mode trains ``--steps`` optimizer steps with `QeRLGRPOTrainer`; the
first is warm-up, the rest are averaged (each measured step is kept in the JSON too, with its mean completion
length: a step whose padded length differs from the warm-up's may pay one-off kernel builds; cuDNN's attention plans
for the full-length shape, with and without a padding mask, are built before the first step): step time split into
rollout / reward / log-prob / inputs (the rest of building the loss inputs: decoding, padding, advantages; counted
in forward+backward before 2026-12-08) / forward+backward, rollout tokens/s, and peak allocated device memory.
``--batch`` takes several sizes (the paper's Table 3: 2 4 8); each mode and batch trains its own trainer in the same
process.

Random weights rarely emit the EOS token (the 7B batch-64 warm-up step drew it once in 32k draws), so completions are
full length but for an occasional early end. ``--eos-rate R`` adds R of the
vocabulary as EOS ids (lengths then spread geometrically, mean ~1/R), which is what real data's length spread costs:
padded lengths that change every step, rows that finish early. ``--pad-to-multiple-of`` sets
`QeRLConfig.pad_to_multiple_of` ("auto": 64 on CUDA; "none"), to compare what padding saves on such steps.

Usage:
    python scripts/bench_grpo_step.py --model qwen2.5-7b --modes nvfp4 bf16 --batch 8 --prompt-tokens 256 \
        --completion-tokens 256 --rollout-backend transformers
    python scripts/bench_grpo_step.py --model qwen2.5-7b --in-memory --modes nvfp4 --batch 8 --completion-tokens 1024 \
        --rollout-backend fast --steps 7 --eos-rate 0.002 --pad-to-multiple-of none   # then 64
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import random
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
from datasets import Dataset
from model_shapes import NAMES, build_nvfp4_streamed, qwen25_config, spread_eos, synthetic_tokenizer, write_checkpoint
from transformers import AutoModelForCausalLM, GenerationConfig, TrainerCallback

from trl_qerl.config import QeRLConfig
from trl_qerl.lora import nvfp4_lora_config
from trl_qerl.trainer import QeRLGRPOTrainer


def varied_reward(completion_ids, **kwargs):
    """Distinct-token count per completion: different for every sample, so advantages are non-zero."""
    return [len(set(ids)) / max(1, len(ids)) for ids in completion_ids]


def prompts(batch: int, tokens: int, vocab: int, seed: int = 0) -> Dataset:
    rng = random.Random(seed)
    rows = [" ".join(f"w{rng.randrange(3, vocab)}" for _ in range(tokens)) for _ in range(batch * 4)]
    return Dataset.from_dict({"prompt": rows})


def eos_ids(tokenizer, rate: float) -> list[int]:
    """The tokenizer's EOS and ``rate`` of the vocabulary besides (`spread_eos`)."""
    return sorted({tokenizer.eos_token_id, *spread_eos(tokenizer.vocab_size, rate)})


def pad_setting(value: str) -> int | str | None:
    """``--pad-to-multiple-of``: "auto", "none" or a number, as `QeRLConfig.pad_to_multiple_of` takes it."""
    if value == "auto":
        return value
    return None if value == "none" else int(value)


def training_length(prompt_tokens: int, completion_tokens: int, pad_to_multiple_of: int | str | None) -> int:
    """The length of a training row whose completion runs the full ``completion_tokens``: TRL pads the prompts and the
    completions each to a multiple of ``pad_to_multiple_of`` (an int; anything else pads nothing here)."""
    if not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of <= 1:
        return prompt_tokens + completion_tokens
    return sum(-(-part // pad_to_multiple_of) * pad_to_multiple_of for part in (prompt_tokens, completion_tokens))


def warm_attention_plans(trainer, batch: int, length: int, vocab: int) -> None:
    """One forward and backward of the trainer's model on ``[batch, length]`` random tokens with an all-ones attention
    mask, and one with the first row padded at its end (a completion that ended early), before the timed steps.

    cuDNN's fused attention builds a plan the first time it sees a shape with or without a mask: 1.8–3.1 s per shape on
    the H200 (BENCHMARKS.md, "The +2.1 s of early-ended steps is cuDNN attention building plans"). Random weights do
    draw the EOS token now and then (one of the 32k draws of a 7B batch-64 warm-up step did), and then the first
    measured step whose rows are all full length paid that build in its training half: 7.01 s against 5.20 s for the
    step after it (2026-12-05). Both variants are built here, so the timed steps see none. Gradient checkpointing is
    switched on first, as the trainer would, so the warm-up takes no more memory than a training step."""
    model = trainer.model
    if trainer.args.gradient_checkpointing:  # transformers >= 5.25 renames it, and keeps the old name as an alias
        kwargs = trainer.args.gradient_checkpointing_kwargs
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    device = next(model.parameters()).device
    ids = torch.randint(3, vocab, (batch, length), device=device)
    full = torch.ones_like(ids)
    padded = full.clone()
    padded[0, length // 2 :] = 0
    for mask in (full, padded):
        with trainer.compute_loss_context_manager():
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1).logits
        logits.float().sum().backward()
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepProbe(TrainerCallback):
    """Per optimizer step, what can make one step slower than the others: the caching allocator's retries (it freed
    its cache and asked the driver again), the NVFP4 kernel-choice keys timed so far (a new shape tunes candidates),
    and the garbage collector's passes so far."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_step_end(self, args, state, control, **kwargs):
        row = {"step": state.global_step, "gc_collections": sum(g["collections"] for g in gc.get_stats())}
        if torch.cuda.is_available():
            stats = torch.cuda.memory_stats()
            row["alloc_retries"] = stats.get("num_alloc_retries", 0)
            row["malloc_calls"] = stats.get("segment.all.allocated", 0)
        try:
            from trl_qerl.nvfp4 import kernels

            row["kernel_keys_timed"] = len(kernels.CHOOSER.timings)
        except ImportError:  # no Triton: no kernel choices
            pass
        self.steps.append(row)


def training_kind(kernel: str) -> str:
    """Coarse kind of a CUDA kernel of the training half (loss forward, recomputation and backward), by name."""
    name = kernel.lower()
    if "nvfp4" in name or "dequant" in name:
        return "NVFP4 matmul / dequantise"
    if "splitk_reduce" in name:
        return "NVFP4 split-K reduce"
    if any(key in name for key in ("fmha", "attention", "flash", "attn")):
        return "attention"
    if any(key in name for key in ("gemv", "gemm", "cutlass", "xmma", "sm90_", "splitkreduce", "cublas")):
        return "cuBLAS GEMM"
    if any(key in name for key in ("softmax", "nll", "cross_entropy", "gather")):
        return "log-softmax / loss"
    if any(key in name for key in ("rms", "norm")):
        return "norms"
    return "elementwise / other"


def summarise_profile(prof, wall_ms: float, label: str) -> dict:
    """Kernel time by kind and by name for one profiled training half; ``wall_ms`` against kernel time tells whether
    the host (launches, Python) or the device is the limit."""
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kinds: dict[str, list] = {}
    names: dict[str, list] = {}
    for event in kernels:
        for table, key in ((kinds, training_kind(event.name)), (names, event.name)):
            entry = table.setdefault(key, [0, 0.0])
            entry[0] += 1
            entry[1] += event.device_time_total / 1e3
    kernel_ms = sum(ms for _, ms in kinds.values())
    print(f"\nprofile of the training half, {label}: {wall_ms:.0f} ms wall (under the profiler), "
          f"{len(kernels)} kernels, {kernel_ms:.0f} ms of kernel time")  # fmt: skip
    print("| kind | kernels | ms |\n|---|---|---|")
    for kind, (count, ms) in sorted(kinds.items(), key=lambda item: -item[1][1]):
        print(f"| {kind} | {count} | {ms:.1f} |")
    by_name = sorted(names.items(), key=lambda item: -item[1][1])
    for name, (count, ms) in by_name[:15]:
        print(f"  {ms:8.1f} ms {count:6d}x {name[:110]}")
    host = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:10]
    for event in host:
        print(f"  host {event.self_cpu_time_total / 1e3:8.1f} ms {event.count:6d}x {event.key[:100]}")
    # Which operator (and on which shapes) launched the kernel time: the elementwise kinds above name no caller
    ops = [e for e in prof.key_averages(group_by_input_shape=True) if e.self_device_time_total > 0]
    ops = sorted(ops, key=lambda e: -e.self_device_time_total)[:25]
    for event in ops:
        shapes = str(event.input_shapes)[:90]
        print(f"  op {event.self_device_time_total / 1e3:8.1f} ms {event.count:6d}x {event.key[:40]} {shapes}")
    return {"label": label, "wall_ms": wall_ms, "kernels": len(kernels), "kernel_ms": kernel_ms,
            "by_kind": {k: {"kernels": c, "ms": ms} for k, (c, ms) in kinds.items()},
            "by_name": [{"name": n, "kernels": c, "ms": ms} for n, (c, ms) in by_name[:40]],
            "host_by_op": [{"op": e.key, "calls": e.count, "self_host_ms": e.self_cpu_time_total / 1e3}
                           for e in host],
            "device_by_op": [{"op": e.key, "shapes": str(e.input_shapes), "calls": e.count,
                              "self_device_ms": e.self_device_time_total / 1e3} for e in ops]}  # fmt: skip


UNEVEN = 1.1
"""A mode whose slowest measured step took more than this times its fastest is flagged: on the H200 a training half
now and then stalls for ~1.8 s in either arm (BENCHMARKS.md, nineteenth session), which moves a mean of few steps."""


def comparison(row: dict, base: dict) -> str:
    """``row`` against ``base``: step ratio of the means and of the fastest steps (a stall only adds time, so the
    fastest steps are the comparison a stall cannot move), rollout and peak-memory ratios, and which modes had
    uneven steps."""

    def fastest(r: dict) -> float:
        return min(r["step_s_each"])

    uneven = [f"{r['mode']} slowest step {max(r['step_s_each']) / fastest(r):.2f}x its fastest"
              for r in (row, base) if max(r["step_s_each"]) > UNEVEN * fastest(r)]  # fmt: skip
    return (f"{row['mode']} vs {base['mode']}: step {base['step_s'] / row['step_s']:.2f}x faster (fastest steps "
            f"{fastest(base) / fastest(row):.2f}x), rollout {base['rollout_s'] / row['rollout_s']:.2f}x, "
            f"peak memory {row['peak_allocated_gb'] / base['peak_allocated_gb']:.2f}x"
            + (f"; uneven steps: {', '.join(uneven)}" if uneven else ""))  # fmt: skip


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def summarise_host_profile(host: cProfile.Profile, wall_ms: float, label: str, top: int = 30) -> dict:
    """Python functions by their own host time (cProfile's tottime) for one training half: where the host spends a
    step that the device would finish sooner."""
    stats = pstats.Stats(host)
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:top]
    total_ms = 1e3 * stats.total_tt
    print(f"\nhost profile of the training half, {label}: {wall_ms:.0f} ms wall (under cProfile), {total_ms:.0f} ms "
          f"of profiled Python time")  # fmt: skip
    print("| own ms | cumulative ms | calls | function |\n|---|---|---|---|")
    table = []
    for (filename, line, function), (_, calls, own, cumulative, _) in rows:
        where = f"{Path(filename).name}:{line}({function})"
        print(f"| {1e3 * own:.1f} | {1e3 * cumulative:.1f} | {calls} | {where} |")
        table.append({"function": where, "calls": calls, "own_ms": 1e3 * own, "cumulative_ms": 1e3 * cumulative})
    return {"label": label, "wall_ms": wall_ms, "profiled_ms": total_ms, "by_function": table}


def profiled_trainer(step: int, host: bool = False):
    """`QeRLGRPOTrainer` that profiles the training half of optimizer step ``step`` (0-based): from the moment its
    inputs are ready (rollout, rewards and log-probs done) to the end of the backward, CPU and CUDA activity (the
    torch profiler), or with ``host`` the Python functions' own host time (cProfile)."""
    from torch.profiler import ProfilerActivity, profile

    class ProfiledTrainer(QeRLGRPOTrainer):
        training_half_profile: dict | None = None
        _profiler = None

        def _prepare_inputs(self, generation_batch):
            inputs = super()._prepare_inputs(generation_batch)
            if self.state.global_step == step and self._profiler is None and self.training_half_profile is None:
                _synchronize()
                self._profiler = (
                    cProfile.Profile()
                    if host
                    else profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True)
                )
                self._profiler.__enter__()
                self._profile_start = time.perf_counter()
            return inputs

        def training_step(self, model, inputs, num_items_in_batch):
            loss = super().training_step(model, inputs, num_items_in_batch)
            if self._profiler is not None and self.accelerator.sync_gradients:
                _synchronize()
                wall_ms = 1e3 * (time.perf_counter() - self._profile_start)
                self._profiler.__exit__(None, None, None)
                label = f"{self.args.quantization}, step {step}"
                summarise = summarise_host_profile if host else summarise_profile
                self.training_half_profile = summarise(self._profiler, wall_ms, label)
                self._profiler = None
            return loss

    return ProfiledTrainer


def run_mode(mode: str, batch: int, checkpoint: Path | None, tokenizer, args) -> dict:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model, build = str(checkpoint), {}
    if args.streamed:  # NVFP4 tensor by tensor: the 16-bit model never exists (72B: ~145 GB)
        if mode != "nvfp4":
            raise SystemExit("--streamed builds NVFP4 models only; run the 16-bit modes with --in-memory")
        model = build_nvfp4_streamed(qwen25_config(args.model), "cuda" if cuda else "cpu")
        size = sum(t.numel() * t.element_size() for t in model.parameters())
        build = {"build_peak_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else float("nan"),
                 "model_gb": size / 1e9}  # fmt: skip
        print(
            f"streamed NVFP4 build: model {build['model_gb']:.2f} GB, peak allocated while building "
            f"{build['build_peak_gb']:.2f} GB ({build['build_peak_gb'] / build['model_gb']:.2f}x)",
            flush=True,
        )
    elif checkpoint is None:  # build the 16-bit model in device memory; the trainer quantises it in place
        with torch.device("cuda" if cuda else "cpu"):
            model = AutoModelForCausalLM.from_config(qwen25_config(args.model), dtype=torch.bfloat16)
    if not isinstance(model, str) and args.eos_rate > 0:  # TRL reads the EOS ids from the generation config
        model.generation_config.eos_token_id = eos_ids(tokenizer, args.eos_rate)
    profiled = args.profile_train or args.profile_host
    config = QeRLConfig(
        output_dir=tempfile.mkdtemp(prefix=f"grpo-{mode}-"),
        pad_to_multiple_of=pad_setting(args.pad_to_multiple_of),
        quantization=mode,
        max_steps=args.steps + profiled,  # the profiled step is extra, and not averaged
        per_device_train_batch_size=batch,
        num_generations=args.num_generations or batch,
        max_completion_length=args.completion_tokens,
        learning_rate=1e-5,
        bf16=cuda,
        use_cpu=not cuda,
        gradient_checkpointing=True,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        rollout_backend=args.rollout_backend,
        temperature=1.0,
        seed=0,
    )
    probe = StepProbe()
    trainer_class = profiled_trainer(args.steps, host=args.profile_host) if profiled else QeRLGRPOTrainer
    trainer = trainer_class(
        model,
        callbacks=[probe],
        reward_funcs=varied_reward,
        args=config,
        train_dataset=prompts(batch, args.prompt_tokens, tokenizer.vocab_size),
        processing_class=tokenizer,
        peft_config=None if mode == "none" else nvfp4_lora_config(r=args.lora_r),
    )
    base = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    weight_bytes = sum(t.numel() * t.element_size() for t in base.parameters() if not t.requires_grad)
    trainable_bytes = sum(t.numel() * t.element_size() for t in trainer.model.parameters() if t.requires_grad)
    del model
    warmed = False
    if args.warm_attention:
        length = training_length(args.prompt_tokens, args.completion_tokens, trainer.args.pad_to_multiple_of)
        try:
            warm_attention_plans(trainer, batch, length, tokenizer.vocab_size)
            warmed = True
            print(f"{mode}: attention plans built for [{batch}, {length}] with and without a padding mask", flush=True)
        except (RuntimeError, ValueError, TypeError) as error:  # the timed steps still run; the JSON says it
            trainer.model.zero_grad(set_to_none=True)
            print(f"{mode}: building the attention plans first failed ({error!r}); a measured step may pay them")
    if cuda and checkpoint is None and not args.streamed:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()  # the 16-bit model existed only to be quantised: not part of training
    trainer.train()
    optimizer_bytes = sum(
        t.numel() * t.element_size()
        for state in trainer.optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t)
    )
    warmup, *steps = [e for e in trainer.state.log_history if "time/step_s" in e]  # the warm-up is not averaged
    steps = steps[: args.steps - 1]  # without the profiled step, if any
    mean = lambda key: statistics.mean(e[key] for e in steps)  # noqa: E731
    result = {
        "mode": mode,
        "batch": batch,
        "step_s": mean("time/step_s"),
        "rollout_s": mean("time/rollout_s"),
        "reward_s": mean("time/reward_s"),
        "logprob_s": mean("time/logprob_s"),
        "inputs_s": mean("time/inputs_s"),
        "forward_backward_s": mean("time/forward_backward_s"),
        "rollout_tokens_per_s": mean("rollout/tokens_per_second"),
        "completion_length": mean("completions/mean_length"),
        "peak_allocated_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else float("nan"),
        "frozen_weight_gb": weight_bytes / 1e9,
        "trainable_gb": trainable_bytes / 1e9,
        "optimizer_state_gb": optimizer_bytes / 1e9,
        "steps_averaged": len(steps),
        "step_s_each": [e["time/step_s"] for e in steps],
        "completion_length_each": [e["completions/mean_length"] for e in steps],
        "forward_backward_s_each": [e["time/forward_backward_s"] for e in steps],
        "inputs_s_each": [e["time/inputs_s"] for e in steps],
        "probe_each": probe.steps,
        "warmup": {key: warmup[key] for key in ("time/step_s", "time/forward_backward_s", "completions/mean_length")},
        "training_half_profile": getattr(trainer, "training_half_profile", None),
        "eos_rate": args.eos_rate,
        "pad_to_multiple_of": trainer.args.pad_to_multiple_of,
        "attention_plans_warmed": warmed,
        **build,
    }
    del trainer, base
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def device_name() -> str:
    """The card the steps ran on: a run may land on an H100 or an H200, and ratios compare only within one card."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-7b", choices=NAMES)
    parser.add_argument("--modes", nargs="+", default=["nvfp4", "bf16"])
    parser.add_argument(
        "--batch",
        type=int,
        nargs="+",
        default=[8],
        help="completions per step (per_device_train_batch_size); several sizes run one after another",
    )
    parser.add_argument("--num-generations", type=int, default=None, help="completions per prompt (default: batch)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--completion-tokens", type=int, default=256)
    parser.add_argument("--lora-r", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per mode; the first is warm-up")
    parser.add_argument("--rollout-backend", default="transformers")
    parser.add_argument("--workdir", default=None, help="where the random bf16 checkpoint is written")
    parser.add_argument("--in-memory", action="store_true",
                        help="build the 16-bit model on the device instead of writing a checkpoint (32B: the disk is "
                        "too small); peak memory is then counted from after quantisation")  # fmt: skip
    parser.add_argument("--streamed", action="store_true",
                        help="NVFP4 only: build the quantised model tensor by tensor (`build_nvfp4_streamed`), never "
                        "holding the 16-bit model (72B); peak memory includes the build")  # fmt: skip
    parser.add_argument("--eos-rate", type=float, default=0.0,
                        help="also end completions at this share of the vocabulary (extra EOS ids): random weights "
                        "then give geometric completion lengths, mean ~1/rate, as real data's spread would")  # fmt: skip
    parser.add_argument("--pad-to-multiple-of", default="auto",
                        help="QeRLConfig.pad_to_multiple_of: 'auto' (64 on CUDA), 'none' or a number")  # fmt: skip
    parser.add_argument("--profile-train", action="store_true",
                        help="after the timed steps, one more step whose training half (loss forward, recomputation, "
                        "backward) is profiled: kernel time by kind and name, against its wall time")  # fmt: skip
    parser.add_argument("--profile-host", action="store_true",
                        help="like --profile-train, but the extra step's training half runs under cProfile: Python "
                        "functions by their own host time, against its wall time")  # fmt: skip
    parser.add_argument("--no-warm-attention", dest="warm_attention", action="store_false",
                        help="skip the forward + backward at the training shape, with and without a padding mask, "
                        "that builds cuDNN's attention plans before the timed steps (`warm_attention_plans`); without "
                        "it a measured step can pay a ~2 s one-off build")  # fmt: skip
    parser.add_argument("--choices", default=None,
                        help="save this GPU's NVFP4 kernel choices after the run (timed in it or loaded from a table) here, "
                        "merged into the file if it exists: runs of several model shapes fill one table for "
                        "`trl_qerl/nvfp4/tuned/`")  # fmt: skip
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.steps < 2:  # the warm-up step is not averaged: one step would leave no row to report
        parser.error(f"--steps {args.steps} leaves no measured step (the first is warm-up); give 2 or more")
    if args.profile_train and args.profile_host:
        parser.error("--profile-train and --profile-host each add a profiled step; give one of them")
    warnings.filterwarnings("ignore")

    config = qwen25_config(args.model)
    checkpoint = (
        None if args.in_memory or args.streamed else Path(args.workdir or tempfile.mkdtemp(prefix="grpo-ckpt-"))
    )
    if checkpoint is not None and not (checkpoint / "config.json").exists():
        write_checkpoint(config, checkpoint, "cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = synthetic_tokenizer(config.vocab_size)
    if checkpoint is not None and args.eos_rate > 0:  # loaded by the trainer: the EOS ids go with the checkpoint
        GenerationConfig(eos_token_id=eos_ids(tokenizer, args.eos_rate), pad_token_id=0).save_pretrained(checkpoint)
    results = []
    for batch in args.batch:
        for mode in args.modes:
            results.append(run_mode(mode, batch, checkpoint, tokenizer, args))
            print(json.dumps(results[-1]), flush=True)  # a later failure must not lose this row

    card = device_name()
    print(f"\nOne GRPO step, {args.model} shapes, completions x ({args.prompt_tokens} prompt + "
          f"{args.completion_tokens} completion tokens), LoRA r{args.lora_r}, gradient checkpointing, rollouts: "
          f"{args.rollout_backend}; mean of {results[0]['steps_averaged']} steps after one warm-up step; {card}")  # fmt: skip
    print("| batch | mode | step s | each step s | rollout s | reward s | log-prob s | inputs s | fwd+bwd s | rollout tok/s | "
          "peak GB | frozen weights GB | trainable GB | optimizer GB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        each = " / ".join(f"{s:.2f}" for s in r["step_s_each"])
        print(f"| {r['batch']} | {r['mode']} | {r['step_s']:.2f} | {each} | {r['rollout_s']:.2f} | {r['reward_s']:.3f} | "
              f"{r['logprob_s']:.2f} | {r['inputs_s']:.2f} | {r['forward_backward_s']:.2f} | {r['rollout_tokens_per_s']:.0f} | "
              f"{r['peak_allocated_gb']:.1f} | {r['frozen_weight_gb']:.2f} | {r['trainable_gb']:.3f} | "
              f"{r['optimizer_state_gb']:.3f} |")  # fmt: skip
    for batch in args.batch:
        rows = [r for r in results if r["batch"] == batch]
        for r in rows[:-1]:
            print(f"batch {batch}: {comparison(r, rows[-1])}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "device": card, "results": results}, indent=2))
    if args.choices:
        from trl_qerl.nvfp4.kernels import CHOOSER

        saved = CHOOSER.save(args.choices, device=card, merge=True)
        print(f"{saved} kernel choices for {card} in {args.choices}")


if __name__ == "__main__":
    main()
