"""Programmatic Dependent Launch of the decode step's own kernels: the switch (`cuda_mma.PROGRAMMATIC`), the contract
the rollout's Triton kernels keep in their PDL builds (`rollout._pdl_kernel`), and, on an sm_90 GPU, a decode step
whose kernels launch so giving the tokens of one whose kernels do not."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _sass import compiled_in_subprocess, cuobjdump

from trl_qerl.nvfp4 import cuda_mma, nvrtc


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
STORES = ("STG", "ST.", "RED", "ATOM")


@pytest.fixture
def hopper_capability(monkeypatch):
    """``torch.cuda.get_device_capability`` answering ``(9, 0)`` (set ``value`` to change it), a CUDA 13.0 driver
    (set ``driver``) and no ``NVFP4_PDL``."""
    capability = {"value": (9, 0), "driver": 13000}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])
    monkeypatch.setattr(nvrtc, "driver_version", lambda: capability["driver"])
    monkeypatch.delenv("NVFP4_PDL", raising=False)
    cuda_mma.driver_takes_pdl.cache_clear()
    yield capability
    cuda_mma.driver_takes_pdl.cache_clear()


def test_programmatic_launch_follows_the_setting_then_the_environment_then_the_rows(monkeypatch, hopper_capability):
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    most = cuda_mma.PDL_MAX_ROWS
    monkeypatch.setattr(cuda_mma, "PROGRAMMATIC", None)  # neither forced on nor off: steps of few rows
    assert cuda_mma.programmatic_launch(gpu, 1) and cuda_mma.programmatic_launch(gpu, most)
    assert not cuda_mma.programmatic_launch(gpu, most + 1) and not cuda_mma.programmatic_launch(cpu, 1)
    monkeypatch.setenv("NVFP4_PDL", "0")
    assert not cuda_mma.programmatic_launch(gpu, 1)
    monkeypatch.setenv("NVFP4_PDL", "1")
    assert cuda_mma.programmatic_launch(gpu, 64) and not cuda_mma.programmatic_launch(cpu, 64)
    monkeypatch.setattr(cuda_mma, "PROGRAMMATIC", False)  # the module setting wins over the environment
    assert not cuda_mma.programmatic_launch(gpu, 1)
    monkeypatch.setattr(cuda_mma, "PROGRAMMATIC", True)
    monkeypatch.delenv("NVFP4_PDL")
    assert cuda_mma.programmatic_launch(gpu, 64) and not cuda_mma.programmatic_launch(cpu, 64)
    hopper_capability["value"] = (8, 9)  # no griddepcontrol before sm_90
    assert not cuda_mma.programmatic_launch(gpu, 1)


def test_a_driver_older_than_12_3_launches_without_pdl_and_says_so_once(hopper_capability, caplog):
    hopper_capability["driver"] = 12020  # graphs capture PDL launches as programmatic edges from CUDA 12.3
    with caplog.at_level(logging.INFO, logger="trl_qerl.nvfp4.cuda_mma"):
        assert not cuda_mma.programmatic_launch(torch.device("cuda", 0), 1)
        assert not cuda_mma.programmatic_launch(torch.device("cuda", 0), 1)
    lines = [r.getMessage() for r in caplog.records if "Programmatic Dependent Launch" in r.getMessage()]
    assert len(lines) == 1 and "12.2 is older than 12.3" in lines[0]


def test_triton_launches_ask_for_pdl_only_where_it_runs(monkeypatch, hopper_capability):
    from trl_qerl.rollout._pdl_kernel import launch_options

    gpu, rows = torch.device("cuda", 0), cuda_mma.PDL_MAX_ROWS
    monkeypatch.setattr(cuda_mma, "PROGRAMMATIC", None)
    assert launch_options(gpu, rows) == {"PDL": True, "launch_pdl": True}
    assert launch_options(gpu, rows + 1) == {"PDL": False}
    assert launch_options(torch.device("cpu"), 1) == {"PDL": False}  # (the interpreter: no launch option, no wait)
    monkeypatch.setattr(cuda_mma, "PROGRAMMATIC", False)
    assert launch_options(gpu, 1) == {"PDL": False}


@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump (Triton bundles one)")
def test_pdl_builds_read_and_write_nothing_of_other_kernels_before_waiting(tmp_path):
    """Compiled for sm_90 (Triton's toolchain, in a subprocess: this session runs the interpreter): each of the step's
    Triton kernels built with ``PDL`` waits (``griddepcontrol.wait``, SASS ``ACQBULK``) before any store or atomic,
    and lets the next launch start (``PREEXIT``); none but the norm and plain shrinks loads anything before the wait
    (they load their LoRA A tile, which no kernel of the step writes). Built without, they hold neither instruction."""
    builds = compiled_in_subprocess(__file__, tmp_path)
    assert len(builds) == 12
    for label, ops in builds.items():
        kernel, pdl = label.rsplit(" ", 1)
        if pdl == "plain":
            assert "ACQBULK" not in ops and "PREEXIT" not in ops, label
            continue
        assert "PREEXIT" in ops and "ACQBULK" in ops, label
        wait = ops.index("ACQBULK")
        assert not any(op.startswith(STORES) for op in ops[:wait]), (label, ops[:wait])
        if kernel not in ("norm shrink", "plain shrink"):
            assert not any(op.startswith("LDG") for op in ops[:wait]), (label, ops[:wait])


def _pdl_builds(folder: Path) -> dict[str, list[str]]:
    """Opcodes of the step's Triton kernels at 7B decode shapes (rank 32), compiled for sm_90 with and without PDL."""
    import triton.language as tl
    from _sass import opcodes, rollout_argument_types, sass_of, triton_signature
    from triton import compile as compile_source
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from trl_qerl.rollout import _fused_shrink_kernel as shrink
    from trl_qerl.rollout import _split_kv_kernel as split_kv
    from trl_qerl.rollout import decode_attention as attention

    padded, block, columns, _ = shrink.rows_layout(8, 18944, [32])
    shape = dict(KV_HEADS=4, GROUP=7, GROUP_PAD=16, HEAD_DIM=128, SPLITS=8, SPLITS_PAD=8, CHUNK=128,
                 MIN_STAT=float(torch.finfo(torch.float32).min))  # fmt: skip
    tiles = dict(DIM_BLOCK=attention.MERGE_DIM_BLOCK, SPLIT_BLOCK=attention.MERGE_SPLITS)
    kernels = {
        "norm shrink": (
            shrink._norm_shrink_kernel,
            dict(HAS_RESIDUAL=True, OUT=tl.bfloat16, BLOCK_R=2, BLOCK_K=4096, ROWS=1, ONE_STEP=True, PASSES=1),
            shrink._warps(4096),
        ),
        "silu shrink per row": (
            shrink._silu_mul_shrink_kernel,
            dict(OUT=tl.bfloat16, BLOCK_R=1, BLOCK_K=4096, SPLITS=4),
            shrink._warps(4096),
        ),
        "silu shrink over rows": (
            shrink._silu_mul_shrink_rows_kernel,
            dict(OUT=tl.bfloat16, ROWS=padded, BLOCK_R=block, BLOCK_K=columns, SPLITS=4),
            shrink.ROWS_WARPS,
        ),
        "partials": (
            split_kv._partials_kernel,
            dict(
                shape,
                BLOCK=attention.BLOCK,
                DOT_DTYPE=tl.bfloat16,
                DOT_PRECISION="tf32",
                MERGE=False,
                MERGE_DIM_BLOCK=tiles["DIM_BLOCK"],
                MERGE_SPLIT_BLOCK=tiles["SPLIT_BLOCK"],
                ROTARY=False,
                IO=tl.bfloat16,
            ),
            attention.PARTIALS_WARPS,
        ),
        "merge": (split_kv._merge_kernel, dict(shape, **tiles), 4),
        "plain shrink": (shrink._shrink_kernel, dict(BLOCK_R=2, BLOCK_K=4096, ONE_STEP=True), shrink._warps(4096)),
    }
    builds = {}
    for label, (kernel, constexprs, warps) in kernels.items():
        for pdl in (False, True):
            fixed = dict(constexprs, PDL=pdl)
            source = ASTSource(fn=kernel, constexprs=fixed,
                               signature=triton_signature(kernel, fixed, rollout_argument_types("bf16")))  # fmt: skip
            compiled = compile_source(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
            builds[f"{label} {'pdl' if pdl else 'plain'}"] = opcodes(sass_of(compiled.asm["cubin"], folder))
    return builds


@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("batch", [1, 4])
def test_a_decode_step_launched_with_pdl_draws_the_same_tokens(monkeypatch, batch):
    """4 layers at Qwen2.5-7B widths, NVFP4 + LoRA r32, bf16, the generator's defaults (compiled, captured): greedy
    tokens and their log-probs with every kernel of ours launched with PDL equal those launched without, bit for bit
    (the same kernels in the same order; only when each may start differs). Batch 1 takes the per-row SiLU·up shrink,
    batch 4 the one over every row."""
    from _tiny import randomize_lora_b
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trl_qerl.lora import get_peft_model, nvfp4_lora_config
    from trl_qerl.quantizer import quantize_model
    from trl_qerl.rollout.fast import SamplingParams, StaticCacheGenerator

    config = Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=4, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064, max_position_embeddings=4096)  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    model = quantize_model(model)
    model = randomize_lora_b(get_peft_model(model, nvfp4_lora_config(model, r=32)), std=0.01).eval()
    prompts = torch.randint(3, config.vocab_size, (batch, 40)).tolist()
    params = SamplingParams(max_new_tokens=32, temperature=0)
    samples = []
    for programmatic in (False, True):  # (the first run times the kernel choices; the second reuses them)
        monkeypatch.setattr(cuda_mma, "PROGRAMMATIC", programmatic)
        samples.append(StaticCacheGenerator(model).sample(prompts, params, [1], 0))
    plain, pdl = samples
    assert all(len(row) == 32 for row in pdl.completion_ids)
    assert pdl.completion_ids == plain.completion_ids
    assert pdl.logprobs == plain.logprobs


def test_replay_gaps_split_idle_and_overlapped_time_by_kernel_pair():
    """`bench_rollout.kernel_gaps`, which tells PDL's overlap from idle time between a captured step's kernels: each
    kernel's start against the latest end before it in its step, summed per step by the pair of names, the median
    over the steps, so that one step's hiccup does not count as every step's cost (it shows as the pair's widest)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    from bench_rollout import kernel_gaps

    steps = [("a", 0.0, 10.0), ("b", 12.0, 20.0), ("c", 19.0, 30.0),
             ("a", 100.0, 110.0), ("b", 113.0, 121.0), ("c", 118.0, 125.0),
             ("a", 200.0, 210.0), ("b", 611.0, 619.0), ("c", 617.0, 630.0)]  # fmt: skip
    found = kernel_gaps(steps, replays=3)
    assert found["kernels"] == 3
    assert found["gaps"] == {("a", "b"): 3.0, ("b", "c"): -2.0}  # the third step's 401 µs wait is not typical
    assert found["widest"] == {("a", "b"): 401.0, ("b", "c"): -1.0}
    assert (found["idle"], found["overlap"]) == (3.0, 2.0)
    assert found["span"] == 30.0  # the median of 30, 25 and 430 µs
    assert found["times"] == {("b", "c", ""): 11.0, ("a", "b", "c"): 8.0}
    assert found["calls"] == {("a", "b", "c"): 1, ("b", "c", ""): 1}
    # A kernel that ends before one that started earlier does not hide that earlier one's end.
    nested = kernel_gaps([("long", 0.0, 50.0), ("short", 5.0, 10.0), ("next", 52.0, 60.0)], replays=1)
    assert nested["gaps"] == {("long", "short"): -45.0, ("short", "next"): 2.0}
    # Kernels of the same start may sort either way: a pair one step lacks counts 0 there.
    swapped = kernel_gaps([("a", 0.0, 5.0), ("b", 6.0, 9.0), ("b", 20.0, 23.0), ("a", 20.0, 25.0)], replays=2)
    assert swapped["gaps"] == {("a", "b"): 1.0, ("b", "a"): 0.0}
    assert kernel_gaps(steps[:5], replays=2) is None


def test_replay_step_ends_show_a_typical_step_and_the_idle_time_between_steps(capsys):
    """`bench_rollout._print_step_ends`: the second step's first and last kernels against its start, and each step's
    first start against the latest end of the step before it."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    from bench_rollout import _print_step_ends

    def event(name, start, end):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))

    events = [event("embed", 0, 2), event("matmul", 1, 9), event("draw", 9, 10),
              event("embed", 15, 17), event("matmul", 16, 30), event("draw", 30, 31)]  # fmt: skip
    _print_step_ends(events, per_step=3, shown=1)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["at", "0.0", "µs", "for", "2.0", "µs:", "embed"]
    assert lines[1].split() == ["at", "15.0", "µs", "for", "1.0", "µs:", "draw"]
    assert lines[2] == "  between steps: 5.0 µs idle"


if __name__ == "__main__":  # the compiling subprocess: python test_pdl.py <results.json>
    Path(sys.argv[1]).write_text(json.dumps(_pdl_builds(Path(sys.argv[1]).parent)))
