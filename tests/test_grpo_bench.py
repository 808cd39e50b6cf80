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


@pytest.mark.slow
def test_grpo_bench_with_a_length_spread_on_cpu(tmp_path):
    out = tmp_path / "rows.json"
    command = [
        sys.executable, str(SCRIPTS / "bench_grpo_step.py"), "--model", "tiny", "--in-memory", "--modes", "nvfp4",
        "--batch", "4", "--prompt-tokens", "8", "--completion-tokens", "32", "--rollout-backend", "fast",
        "--steps", "3", "--eos-rate", "0.2", "--pad-to-multiple-of", "16", "--profile-train", "--json", str(out),
    ]  # fmt: skip
    cpu_only = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the GPU machine's run must take the CPU path too
    subprocess.run(command, check=True, cwd=SCRIPTS, capture_output=True, text=True, timeout=600, env=cpu_only)
    row = json.loads(out.read_text())["results"][0]
    assert row["eos_rate"] == 0.2 and row["pad_to_multiple_of"] == 16
    lengths = [row["warmup"]["completions/mean_length"], *row["completion_length_each"]]
    assert len(lengths) == 3 and all(0 < length < 32 for length in lengths)  # rows ended early, at ~1/0.2 tokens
    # one probe per optimizer step; the fourth step is the profiled one, which is not averaged
    assert [probe["step"] for probe in row["probe_each"]] == [1, 2, 3, 4]
    assert row["steps_averaged"] == 2
    profile = row["training_half_profile"]
    assert profile["label"] == "nvfp4, step 3" and profile["wall_ms"] > 0
    assert profile["host_by_op"] and profile["kernels"] == 0  # CPU: host operators only, no CUDA kernels


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
