"""`scripts/bench_grpo_step.py` with a length spread (``--eos-rate``), a padding setting and ``--profile-train``, on the
tiny shape on CPU: completions end early at different lengths, the trainer gets the EOS ids and the padding asked for,
the JSON keeps every measured step's length, and one extra step's training half is profiled, not averaged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


SCRIPTS = Path(__file__).parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))


def test_eos_ids_spread_over_the_vocabulary_and_keep_the_tokenizers_own():
    from bench_grpo_step import eos_ids, pad_setting
    from model_shapes import synthetic_tokenizer

    tokenizer = synthetic_tokenizer(1000)
    ids = eos_ids(tokenizer, 0.05)
    assert tokenizer.eos_token_id in ids and tokenizer.pad_token_id not in ids
    assert 45 <= len(ids) <= 51 and len(set(ids)) == len(ids) and max(ids) < 1000
    assert eos_ids(tokenizer, 0.05) == ids  # seeded: every mode of a run ends on the same ids
    assert (pad_setting("auto"), pad_setting("none"), pad_setting("64")) == ("auto", None, 64)


def test_grpo_bench_refuses_a_run_without_a_measured_step():
    """``--steps 1`` is only the warm-up: refused up front by name, not a StatisticsError after the model is built."""
    command = [sys.executable, str(SCRIPTS / "bench_grpo_step.py"), "--model", "tiny", "--steps", "1"]
    done = subprocess.run(command, cwd=SCRIPTS, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "--steps 1 leaves no measured step" in done.stderr


@pytest.mark.slow
def test_grpo_bench_with_a_length_spread_on_cpu(tmp_path):
    out = tmp_path / "rows.json"
    command = [
        sys.executable, str(SCRIPTS / "bench_grpo_step.py"), "--model", "tiny", "--in-memory", "--modes", "nvfp4",
        "--batch", "4", "--prompt-tokens", "8", "--completion-tokens", "32", "--rollout-backend", "fast",
        "--steps", "3", "--eos-rate", "0.2", "--pad-to-multiple-of", "16", "--profile-train", "--json", str(out),
        "--choices", str(tmp_path / "choices.json"),
    ]  # fmt: skip
    cpu_only = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the GPU machine's run must take the CPU path too
    subprocess.run(command, check=True, cwd=SCRIPTS, capture_output=True, text=True, timeout=600, env=cpu_only)
    written = json.loads(out.read_text())
    assert written["device"] == "cpu"  # the card is recorded: ratios compare only within one
    # on the CPU no kernel is chosen, and the shipped GPU tables loaded at import are not this device's
    assert json.loads((tmp_path / "choices.json").read_text()) == {}
    row = written["results"][0]
    assert row["eos_rate"] == 0.2 and row["pad_to_multiple_of"] == 16 and row["attention_plans_warmed"] is True
    lengths = [row["warmup"]["completions/mean_length"], *row["completion_length_each"]]
    assert len(lengths) == 3 and all(0 < length < 32 for length in lengths)  # rows ended early, at ~1/0.2 tokens
    # one probe per optimizer step; the fourth step is the profiled one, which is not averaged
    assert [probe["step"] for probe in row["probe_each"]] == [1, 2, 3, 4]
    assert row["steps_averaged"] == 2
    profile = row["training_half_profile"]
    assert profile["label"] == "nvfp4, step 3" and profile["wall_ms"] > 0
    assert profile["host_by_op"] and profile["kernels"] == 0  # CPU: host operators only, no CUDA kernels


def test_training_length_pads_the_prompt_and_the_completion_each():
    from bench_grpo_step import training_length

    assert training_length(256, 512, 64) == 768 and training_length(250, 500, 64) == 256 + 512
    assert training_length(8, 32, None) == training_length(8, 32, "auto") == 40  # "auto" pads nothing off CUDA


@pytest.mark.parametrize(
    "device, dtype",
    [
        ("cpu", torch.float32),
        pytest.param(
            "cuda", torch.bfloat16, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
        ),
    ],
)
def test_attention_plans_are_built_with_and_without_a_padding_mask(device, dtype):
    """`warm_attention_plans` runs the trainer's model at the training shape twice, under the trainer's loss context and
    with gradient checkpointing on: an all-ones mask, then one with the first row padded at its end; it leaves no
    gradients for the first optimizer step. On CUDA in bf16, the path the benchmark takes there."""
    import contextlib
    from types import SimpleNamespace

    from _tiny import tiny_nvfp4_lora_model
    from bench_grpo_step import warm_attention_plans

    model = tiny_nvfp4_lora_model(dtype, device)
    masks, contexts = [], []
    model.get_base_model().register_forward_pre_hook(
        lambda module, args, kwargs: masks.append(kwargs["attention_mask"].clone()), with_kwargs=True
    )

    @contextlib.contextmanager
    def loss_context():
        contexts.append(True)
        yield

    args = SimpleNamespace(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    model.eval()
    warm_attention_plans(
        SimpleNamespace(model=model, args=args, compute_loss_context_manager=loss_context), 3, 12, 128
    )
    assert len(masks) == len(contexts) == 2 and [tuple(mask.shape) for mask in masks] == [(3, 12), (3, 12)]
    full, padded = masks
    assert bool(full.all()) and bool(padded[1:].all()) and bool(padded[0, :6].all()) and not padded[0, 6:].any()
    assert model.training and any(getattr(layer, "gradient_checkpointing", False) for layer in model.modules())
    trainable = [param for param in model.parameters() if param.requires_grad]
    assert trainable and all(param.grad is None for param in trainable)


def test_host_profile_names_the_functions_that_took_the_host_time(capsys):
    import cProfile

    from bench_grpo_step import summarise_host_profile

    def slow_python(n: int) -> int:
        return sum(i * i for i in range(n))

    with cProfile.Profile() as host:
        for _ in range(20):
            slow_python(20_000)
    summary = summarise_host_profile(host, wall_ms=1.0, label="nvfp4, step 3", top=5)
    assert summary["label"] == "nvfp4, step 3" and summary["profiled_ms"] > 0
    functions = [row["function"] for row in summary["by_function"]]
    assert len(functions) == 5 and any("slow_python" in name for name in functions)
    ranked = [row["own_ms"] for row in summary["by_function"]]
    assert ranked == sorted(ranked, reverse=True)
    assert "slow_python" in capsys.readouterr().out


def test_comparison_gives_the_fastest_steps_ratio_and_flags_uneven_steps():
    """A stall adds ~1.8 s to one step now and then: the line gives the fastest steps' ratio beside the means' and
    names the mode whose steps were uneven (the nineteenth session's 14B run: bf16 13.74 / 15.53 s)."""
    from bench_grpo_step import comparison

    qerl = {"mode": "nvfp4", "step_s": 8.69, "step_s_each": [8.70, 8.67], "rollout_s": 6.55, "peak_allocated_gb": 22.7}
    bf16 = {"mode": "bf16", "step_s": 14.63, "step_s_each": [13.74, 15.53], "rollout_s": 11.32,
            "peak_allocated_gb": 43.0}  # fmt: skip
    line = comparison(qerl, bf16)
    assert line.startswith("nvfp4 vs bf16: step 1.68x faster (fastest steps 1.58x)")
    assert line.endswith("; uneven steps: bf16 slowest step 1.13x its fastest")
    steady = comparison(qerl, dict(bf16, step_s=13.74, step_s_each=[13.74, 13.75]))
    assert "uneven" not in steady and "(fastest steps 1.58x)" in steady
