"""LoRA products above the epilogue's row limit in two launches per group (`trl_qerl.rollout.lora_rows`).

The Triton kernels run on CPU in Triton's interpreter and on CUDA, against float64 products and the torch formulas of
the cuBLAS path they replace: outputs written into NaN-poisoned buffers, row counts above and below a row block,
widths that are not a multiple of a step, one to three adapters of mixed ranks, bf16 and fp16, bases that are column
views of one grouped output. The custom ops pass `torch.library.opcheck`, the fused step takes them only where they
apply, and (CUDA) a captured compiled step samples as the cuBLAS path does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from _sass import compiled_in_subprocess, cuobjdump

from trl_qerl.rollout import fused_decode
from trl_qerl.rollout.fused_shrink import shrink_reference
from trl_qerl.rollout.lora_rows import expand_add_reference, lora_expand_add, lora_rows_applies, lora_shrink_rows


CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.usefixtures("quiet_warnings")
GROUPS = {"qkv": ((32, 16, 16), (96, 40, 40)), "one": ((32,), (200,)), "gate_up": ((64, 64), (130, 130)),
          "rank8": ((8, 8, 4), (96, 40, 40))}  # fmt: skip


def _case(rows, width, ranks, widths, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, width, generator=generator) * 3).to(DEVICE, dtype)
    lora_a = [(torch.randn(r, width, generator=generator) / width**0.5).to(DEVICE) for r in ranks]
    lora_b = [(torch.randn(n, r, generator=generator) * 0.1).to(DEVICE) for n, r in zip(widths, ranks)]
    grouped = torch.randn(rows, sum(widths), generator=generator).to(DEVICE, dtype)
    bases = list(grouped.split(list(widths), dim=1))  # column views, rows strided by the group's width
    return x, lora_a, lora_b, bases


def _poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


MODES = {"dot_tf32x3": 1, "fma": 2}


@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("shape", [(17, 200), (40, 1000), (70, 330)], ids=["17x200", "40x1000", "70x330"])
@pytest.mark.parametrize("mode", list(MODES))
def test_kernels_match_float64_products_and_the_cublas_path(monkeypatch, mode, group, shape):
    """Every multiplying mode of both kernels (`SHRINK_MODE`, `EXPAND_MODE`); 3xTF32 is within 1e-6 of fp32. fp16
    inputs and outputs at 40 rows, bf16 at the others."""
    dtype = torch.float16 if shape[0] == 40 else torch.bfloat16
    from trl_qerl.rollout import _lora_rows_kernel as kernel
    from trl_qerl.rollout._lora_rows_kernel import expand_add, shrink_rows

    monkeypatch.setattr(kernel, "SHRINK_MODE", MODES[mode])
    monkeypatch.setattr(kernel, "EXPAND_MODE", MODES[mode])
    ranks, widths = GROUPS[group]
    x, lora_a, lora_b, bases = _case(*shape, ranks, widths, dtype)
    t = _poisoned((shape[0], sum(ranks)), torch.float32)
    shrink_rows(x, lora_a, t)
    exact = torch.cat([x.double() @ a.double().T for a in lora_a], dim=-1)
    assert not t.isnan().any()
    assert ((t.double() - exact).norm() / exact.norm()).item() < 1e-6
    scalings = [2.0, 0.5, 1.0][: len(ranks)]
    outs = [_poisoned(base.shape, dtype) for base in bases]
    expand_add(bases, t, lora_b, scalings, outs)
    parts = t.double().split(list(ranks), dim=-1)
    for out, reference, base, part, b, scaling in zip(
        outs, expand_add_reference(bases, t, lora_b, scalings), bases, parts, lora_b, scalings
    ):
        update = scaling * part @ b.double().T
        exact = base.double() + update
        # one rounding of the sum, after fp32 sums whose error scales with the terms (which may cancel)
        terms = scaling * part.abs() @ b.double().abs().T
        bound = torch.finfo(dtype).eps * exact.abs() + 2**-20 * (base.double().abs() + terms)
        assert not out.isnan().any()
        assert ((out.double() - exact).abs() <= bound).all() and ((reference.double() - exact).abs() <= bound).all()
        assert (out != reference).float().mean() <= 0.01


def test_split_columns_leave_their_counters_at_zero_for_the_next_launch():
    """Columns split over programs (a 9,000-wide input): the last program of each tile adds the partials; a second
    launch (a graph replay, say) must find every counter back at zero and compute the same sums."""
    from trl_qerl.nvfp4.cuda_mma import arrival_counters
    from trl_qerl.rollout._lora_rows_kernel import shrink_layout, shrink_rows

    x, lora_a, _, _ = _case(20, 9000, (32,), (8,), torch.bfloat16)
    assert shrink_layout(20, 9000, [32])[4] > 1
    sums = []
    for _ in range(2):
        t = _poisoned((20, 32), torch.float32)
        shrink_rows(x, lora_a, t)
        sums.append(t)
        assert int(arrival_counters(x.device, 4).abs().sum()) == 0
    assert torch.equal(sums[0], sums[1])


@pytest.mark.parametrize("per_group", [5, 8, 16])
def test_sums_in_groups_match_float64_and_repeat_exactly(monkeypatch, per_group):
    """`GROUP_SPLITS`: 47 column spans summed in groups of 5, 8 or 16 (the last group fewer), then the group sums: within
    3xTF32's error of float64, the same bits on a second launch (a graph replay), every counter back at zero; groups as
    wide as the spans are the one-level sum, bit for bit."""
    from trl_qerl.nvfp4.cuda_mma import arrival_counters
    from trl_qerl.rollout import _lora_rows_kernel as kernel

    x, lora_a, _, _ = _case(20, 9000, (32, 16), (8, 8), torch.bfloat16, seed=4)
    assert kernel.shrink_layout(20, 9000, [32, 16])[4] == 47
    exact = torch.cat([x.double() @ a.double().T for a in lora_a], dim=-1)
    sums = []
    for setting in (per_group, per_group, 0, 47):
        monkeypatch.setattr(kernel, "GROUP_SPLITS", setting)
        sums.append(_poisoned((20, 48), torch.float32))
        kernel.shrink_rows(x, lora_a, sums[-1])
        assert int(arrival_counters(x.device, 64).abs().sum()) == 0
    assert kernel.split_groups(47) == (47, 1) and kernel.split_groups(1) == (1, 1)
    monkeypatch.setattr(kernel, "GROUP_SPLITS", per_group)
    assert kernel.split_groups(47) == (per_group, -(-47 // per_group))
    grouped, again, flat, wide = sums
    assert not grouped.isnan().any()
    assert ((grouped.double() - exact).norm() / exact.norm()).item() < 1e-6
    assert torch.equal(grouped, again) and torch.equal(flat, wide)


def test_shrink_layout_splits_columns_into_whole_steps_up_to_the_program_target():
    from trl_qerl.rollout import _lora_rows_kernel as kernel

    for rows, width, ranks in ((32, 3584, [32, 32, 32]), (64, 18944, [32]), (17, 100, [16]), (128, 5120, [64, 64]),
                               (40, 3584, [8, 8, 4])):  # fmt: skip
        mode, block_m, block_r, span, splits = kernel.shrink_layout(rows, width, ranks)
        assert mode == (kernel.SHRINK_MODE if all(r % 16 == 0 for r in ranks) else 2)
        tiles = -(-rows // block_m) * (sum(ranks) // block_r)
        assert span % kernel.step_columns(mode) == 0 and (splits - 1) * span < width <= splits * span
        assert splits <= kernel.MAX_SPLITS and (splits == 1 or tiles * splits <= kernel.TARGET_PROGRAMS)
        assert all(r % block_r == 0 for r in ranks) and block_m >= min(rows, 64)


def test_ops_pass_opcheck():
    x, lora_a, lora_b, bases = _case(20, 64, (16, 32), (24, 16), torch.bfloat16)
    torch.library.opcheck(lora_shrink_rows, (x, lora_a))
    t = shrink_reference(x, lora_a)
    torch.library.opcheck(lora_expand_add, ([b.contiguous() for b in bases], t, lora_b, [2.0, 0.5]))


def test_applies_only_to_what_the_kernels_read():
    x, lora_a, lora_b, bases = _case(20, 64, (32,), (24,), torch.bfloat16)
    assert lora_rows_applies(x, bases, lora_a, lora_b)
    assert lora_rows_applies(x, bases, [lora_a[0][:8]], [lora_b[0][:, :8].contiguous()])  # rank 8: the FMA shrink
    assert not lora_rows_applies(x, bases, [lora_a[0][:6]], [lora_b[0][:, :6].contiguous()])  # not a multiple of 4
    assert not lora_rows_applies(x, bases, [lora_a[0].bfloat16()], lora_b)  # fp32 masters only
    assert not lora_rows_applies(x, bases * 4, lora_a * 4, lora_b * 4)  # at most three projections
    assert not lora_rows_applies(x, bases, [lora_a[0][:, :32].contiguous()], lora_b)  # width mismatch
    assert not lora_rows_applies(x.float(), bases, lora_a, lora_b)  # 16-bit inputs
    wide = torch.randn(128, 128, device=DEVICE)
    over_64 = [wide[:, :64].contiguous()], [torch.randn(24, 128, device=DEVICE)]  # contiguous: only the rank is wrong
    assert not lora_rows_applies(x, bases, *over_64)  # rank over 64


def test_the_step_takes_the_ops_only_above_the_epilogue_rows(monkeypatch):
    """Above `LORA_REDUCTION_ROWS` rows (where the ops run: here on CPU, as torch formulas) a projection group's LoRA
    terms go through the two ops and give the cuBLAS path's outputs; at the limit, or switched off, they do not."""
    from _tiny import randomize_lora_b, record_calls, tiny_model

    from trl_qerl.lora import get_peft_model, nvfp4_lora_config
    from trl_qerl.quantizer import quantize_model
    from trl_qerl.rollout.decoder_spec import read_decoder

    torch.manual_seed(0)
    model = quantize_model(tiny_model("qwen2", dtype=torch.bfloat16))
    layer = read_decoder(randomize_lora_b(get_peft_model(model, nvfp4_lora_config(model, r=16)))).layers[0]
    width = layer.qkv[0].packed.shape[1] * 2
    calls = record_calls(monkeypatch, fused_decode, ("lora_shrink_rows", "lora_expand_add"))
    monkeypatch.setattr(fused_decode, "runs_triton", lambda x: True)
    monkeypatch.setattr(fused_decode, "LORA_EPILOGUE", False)
    limit = fused_decode.LORA_REDUCTION_ROWS
    for rows, taken in ((limit, False), (limit + 1, True), (fused_decode.LORA_ROW_KERNELS_MAX + 1, False)):
        x = torch.randn(rows, width, dtype=torch.bfloat16)
        for group in (layer.qkv, layer.gate_up):
            with_ops = fused_decode.project(x, group)
            assert bool(calls) == taken
            calls.clear()
            monkeypatch.setattr(fused_decode, "LORA_ROW_KERNELS", False)
            with_cublas = fused_decode.project(x, group)
            monkeypatch.setattr(fused_decode, "LORA_ROW_KERNELS", True)
            assert not calls
            for ours, theirs in zip(with_ops, with_cublas):
                assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
                torch.testing.assert_close(ours, theirs, rtol=2**-7, atol=1e-3)


def test_the_decoder_names_adapters_the_ops_do_not_take():
    """`FusedDecoder` logs why larger steps keep the cuBLAS path: the first layer's refusal, else nothing; only for
    decoders of more than `LORA_REDUCTION_ROWS` rows on CUDA."""
    from _tiny import tiny_model

    from trl_qerl.lora import get_peft_model, nvfp4_lora_config
    from trl_qerl.quantizer import quantize_model
    from trl_qerl.rollout.decoder_spec import read_decoder

    for rank, refusal in ((16, None), (8, None), (6, "rank 6 (it takes multiples of 4 up to 64)")):
        torch.manual_seed(0)
        model = quantize_model(tiny_model("qwen2", dtype=torch.bfloat16))
        spec = read_decoder(get_peft_model(model, nvfp4_lora_config(model, r=rank)))
        assert fused_decode._lora_rows_refusal(spec) == refusal
        rows, cuda = fused_decode.LORA_REDUCTION_ROWS, torch.device("cuda")
        note = fused_decode._lora_path_note(spec, rows + 1, cuda)
        assert note is None if refusal is None else (refusal in note and "cuBLAS" in note)
        assert fused_decode._lora_path_note(spec, rows, cuda) is None
        assert fused_decode._lora_path_note(spec, rows + 1, torch.device("cpu")) is None


def test_rollout_benchmark_engine_turns_the_ops_off_and_back_on():
    """`bench_rollout.py`'s ``+lora_cublas`` engine: the cuBLAS path while it runs, the ops after."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    from bench_rollout import ENGINES, engine_environment

    assert ENGINES["fused+compile+split_kv+twiddle+lora_cublas"]["twiddled_decode"]
    with engine_environment("fused+compile+split_kv+twiddle+lora_cublas"):
        assert not fused_decode.LORA_ROW_KERNELS
    assert fused_decode.LORA_ROW_KERNELS


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_captured_compiled_step_above_the_epilogue_rows_on_cuda(monkeypatch):
    """20 rows: a captured step compiled with the ops (conftest fails the test if it fell back to eager layers)
    samples the first tokens as the cuBLAS path does (greedy: a near-tie may flip later tokens), with close
    log-probs."""
    from _tiny import assert_first_draws_agree, fused_samples_with_and_without

    samples, _ = fused_samples_with_and_without(monkeypatch, "LORA_ROW_KERNELS", ("lora_shrink_rows",))
    assert_first_draws_agree(samples[True], samples[False])


@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump (Triton bundles one)")
def test_kernels_need_no_stack_on_hopper(tmp_path):
    """Compiled for sm_90 (Triton's bundled toolchain, in a subprocess: this session runs the interpreter) at their
    largest tiles (64 rows, rank blocks of 32 or the FMA tile, rank 64), both kernels keep their tiles in registers in
    every multiplying mode, and so does the shrink summing 64 spans in groups of 8 (`GROUP_SPLITS`)."""
    resources = compiled_in_subprocess(__file__, tmp_path)
    assert len(resources) == 5
    for kernel, usage in resources.items():
        assert usage["STACK"] == 0 and usage["LOCAL"] == 0, f"{kernel}: {usage}"


def _kernel_resources(folder: Path) -> dict[str, dict[str, int]]:
    import triton
    from _sass import resources_of, rollout_argument_types, triton_signature
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from trl_qerl.rollout import _lora_rows_kernel as K

    types = {
        **rollout_argument_types("bf16"),
        **dict.fromkeys(["base0", "base1", "base2", "out0", "out1", "out2"], "*bf16"),
        **dict.fromkeys(["b0", "b1", "b2"], "*fp32"),
        **dict.fromkeys(["scale0", "scale1", "scale2"], "fp32"),
    }

    def compile_for_hopper(kernel, constexprs):
        signature = triton_signature(kernel, constexprs, types)
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=K.WARPS))

    results = {}
    for mode in (1, 2):
        block_r, block_k = (K.FMA_BLOCK_R, K.FMA_BLOCK_K) if mode == 2 else (32, K.BLOCK_K)
        shrink = dict(BLOCK_M=64, BLOCK_R=block_r, BLOCK_K=block_k, SPLITS=4, MODE=mode, GROUPS=1, PER_GROUP=4)
        expand = dict(OUT=triton.language.bfloat16, BLOCK_M=64, BLOCK_N=K.BLOCK_N, RANK=64, RANK_STEP=K.RANK_STEP,
                      MODE=mode)  # fmt: skip
        for name, kernel, constexprs in (("shrink", K._shrink_rows_kernel, shrink),
                                         ("expand", K._expand_add_kernel, expand)):  # fmt: skip
            results[f"{name} mode {mode}"] = resources_of(compile_for_hopper(kernel, constexprs).asm["cubin"], folder)
    grouped = dict(BLOCK_M=64, BLOCK_R=32, BLOCK_K=K.BLOCK_K, SPLITS=64, MODE=1, GROUPS=8, PER_GROUP=8)
    results["shrink in groups"] = resources_of(compile_for_hopper(K._shrink_rows_kernel, grouped).asm["cubin"], folder)
    return results


if __name__ == "__main__":  # the compiling subprocess: python test_lora_rows.py <results.json>
    Path(sys.argv[1]).write_text(json.dumps(_kernel_resources(Path(sys.argv[1]).parent)))
