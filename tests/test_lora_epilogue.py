"""LoRA terms added by the NVFP4 decode kernel's epilogue (`cuda_mma.LoraInputs`, the op
``trl_qerl::nvfp4_linear_grouped_lora``, `fused_decode.LORA_EPILOGUE`).

Without a GPU: the pure-torch reference (`lora_terms.add_lora_terms`) is the formula the step used before, in fp32
and bf16; the fused step's projections give the same outputs with and without the epilogue path; what the kernel
accepts; the LoRA builds compile for every target, and on Hopper their main loop is the plain build's, instruction
for instruction. On a GPU: every decode-kernel instance with LoRA terms against a float64 reference (q/k/v with
biases and one weight without an adapter, written into a wider NaN-poisoned output, bf16 and fp16), the op with the
chooser's kernel and with any other choice, and CUDA-graph replays that read new activations and new ``B`` values
in place (an optimizer step needs no re-capture).
"""

from __future__ import annotations

import pytest
import torch
from _cuda_cases import TOLERANCE, needs_nvrtc, poisoned_out, reference_with_lora
from _sass import cuobjdump, main_loop, resources_of, sass_of

from trl_qerl.nvfp4 import cuda_mma, kernels, nvrtc  # `kernels` also defines the custom ops
from trl_qerl.nvfp4.dispatch import kernels_for
from trl_qerl.nvfp4.format import dequantize, quantize, relative_error
from trl_qerl.nvfp4.lora_terms import add_lora_terms


CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")

ROWS = (320, 40, 40)  # q, k, v: rows not multiples of a tile
RANKS = (16, None, 16)  # k has no adapter
SCALING = (2.0, 0.0, 0.5)


def _case(m: int, k: int, dtype: torch.dtype, device: str, seed: int = 0):
    """x, q/k/v weights, biases (k without), hidden = x @ A.T of q and v (fp32, side by side), B matrices."""
    generator = torch.Generator().manual_seed(seed)
    weights = [tuple(t.to(device) for t in quantize(torch.randn(n, k, generator=generator) * 0.05)) for n in ROWS]
    biases = [torch.randn(n, generator=generator).to(device, dtype) for n in ROWS]
    biases[1] = None
    x = torch.randn(m, k, generator=generator).to(device, dtype)
    lora_a = [torch.randn(r, k, generator=generator) / k**0.5 if r else None for r in RANKS]
    lora_b = [(torch.randn(n, r, generator=generator) * 0.1).to(device) if r else None for n, r in zip(ROWS, RANKS)]
    hidden = torch.cat([x.float() @ a.to(device).T for a in lora_a if a is not None], dim=1)
    return x, weights, biases, hidden, lora_b


# -- without a GPU --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_adds_each_term_to_its_own_columns_and_rounds_once(dtype):
    x, weights, biases, hidden, lora_b = _case(5, 256, dtype, "cpu")
    base = kernels_for(x.device).grouped(x, *(list(t) for t in zip(*weights)), biases)
    out = add_lora_terms(base, list(ROWS), hidden, lora_b, list(SCALING))
    assert out.dtype == dtype and out.shape == base.shape
    q, k, v = base.split(ROWS, dim=1)
    expected_q = (q + torch.nn.functional.linear(hidden[:, :16], lora_b[0]) * 2.0).to(dtype)
    expected_v = (v + torch.nn.functional.linear(hidden[:, 16:], lora_b[2]) * 0.5).to(dtype)
    assert torch.equal(out, torch.cat([expected_q, k, expected_v], dim=1))
    assert not torch.equal(out[:, :320], q)  # the adapter is not a no-op
    # the grouped op's reference is the same composition
    ours = kernels_for(x.device).grouped_lora(
        x, *(list(t) for t in zip(*weights)), biases, hidden, lora_b, list(SCALING)
    )
    assert torch.equal(ours, out)
    assert relative_error(reference_with_lora(x, weights, biases, hidden, lora_b, SCALING), ours) < (
        1e-5 if dtype == torch.float32 else TOLERANCE
    )


def test_the_kernel_takes_only_what_its_epilogue_reads():
    x, weights, _, hidden, lora_b = _case(4, 256, torch.bfloat16, "cpu")
    good = cuda_mma.LoraInputs(hidden, lora_b, SCALING)
    assert good.columns() == [0, 16, 16] and good.rank == 16
    assert cuda_mma.lora_supported(x, weights, good)
    mixed = [lora_b[0], None, lora_b[2][:, :8].contiguous()]  # one launch, one rank (a template parameter)
    assert cuda_mma.LoraInputs(hidden[:, :24], mixed, SCALING).rank == 0
    assert not cuda_mma.lora_supported(x, weights, cuda_mma.LoraInputs(hidden[:, :24].contiguous(), mixed, SCALING))
    odd = [lora_b[0][:, :12].contiguous(), None, lora_b[2][:, :12].contiguous()]  # 12 is not in LORA_RANKS
    assert not cuda_mma.lora_supported(x, weights, cuda_mma.LoraInputs(hidden[:, :24].contiguous(), odd, SCALING))
    assert not cuda_mma.lora_supported(x, weights, cuda_mma.LoraInputs(hidden.half(), lora_b, SCALING))
    half_b = [lora_b[0].half(), None, lora_b[2]]
    assert not cuda_mma.lora_supported(x, weights, cuda_mma.LoraInputs(hidden, half_b, SCALING))
    assert not cuda_mma.lora_supported(x, weights, cuda_mma.LoraInputs(hidden[:, :20], lora_b, SCALING))
    wrong_rows = [lora_b[0][:300].contiguous(), None, lora_b[2]]
    assert not cuda_mma.lora_supported(x, weights, cuda_mma.LoraInputs(hidden, wrong_rows, SCALING))
    padded = torch.zeros(4, 33)
    padded[:, 1:] = hidden  # rows not 16-byte aligned
    assert not cuda_mma.lora_supported(x, weights, cuda_mma.LoraInputs(padded[:, 1:], lora_b, SCALING))
    assert not cuda_mma.lora_supported(x, weights, cuda_mma.LoraInputs(hidden, lora_b[:2], SCALING[:2]))


def test_terms_the_kernel_cannot_take_are_added_after_the_product_with_one_log_line(monkeypatch, caplog):
    import logging

    monkeypatch.setattr(kernels, "_LORA_NOTED", set())
    x, weights, _, hidden, lora_b = _case(2, 256, torch.bfloat16, "cpu")
    odd = cuda_mma.LoraInputs(hidden[:, :24].contiguous(), [lora_b[0][:, :12].contiguous(), None,
                                                            lora_b[2][:, :12].contiguous()], SCALING)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="trl_qerl.nvfp4.kernels"):
        for _ in range(3):
            kernels._note_lora_after_product(odd)
    notes = [r.message for r in caplog.records if "added after the product" in r.message]
    assert len(notes) == 1 and "rank 12" in notes[0] and "float32" in notes[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj", "down_proj"]], ids=["all", "some"])
def test_fused_step_projections_equal_the_unfused_lora_path(monkeypatch, dtype, targets):
    from _tiny import randomize_lora_b, tiny_model

    from trl_qerl.lora import get_peft_model, nvfp4_lora_config
    from trl_qerl.quantizer import quantize_model
    from trl_qerl.rollout import fused_decode
    from trl_qerl.rollout.decoder_spec import read_decoder

    model = quantize_model(tiny_model("qwen2", dtype=dtype))
    model = randomize_lora_b(get_peft_model(model, nvfp4_lora_config(model, r=4, target_modules=targets))).eval()
    layer = read_decoder(model).layers[0]
    calls = []
    reference_kernels = kernels_for(torch.device("cpu"))
    spy = reference_kernels.__class__(
        reference_kernels.linear, reference_kernels.grad_input, "spy", reference_kernels.grouped,
        lambda *args: calls.append(len(args[1])) or reference_kernels.grouped_lora(*args),
    )  # fmt: skip
    monkeypatch.setattr(fused_decode, "kernels_for", lambda device: spy)
    for m in (1, 7, fused_decode.LORA_REDUCTION_ROWS, fused_decode.LORA_REDUCTION_ROWS + 1):
        x = torch.randn(m, layer.qkv[0].packed.shape[1] * 2).to(dtype)
        h = torch.randn(m, layer.down.packed.shape[1] * 2).to(dtype)
        for group, inputs in ((layer.qkv, x), (layer.gate_up, x), ((layer.o,), x), ((layer.down,), h)):
            calls.clear()
            monkeypatch.setattr(fused_decode, "LORA_EPILOGUE", True)
            fused = fused_decode.project(inputs, group)
            took_epilogue = bool(calls)
            monkeypatch.setattr(fused_decode, "LORA_EPILOGUE", False)
            unfused = fused_decode.project(inputs, group)
            for ours, theirs in zip(fused, unfused):
                assert ours.dtype == dtype
                if dtype == torch.float32:
                    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
                else:  # the same roundings; fp32 sums in another order may move a value by one bf16 step
                    assert relative_error(theirs.double(), ours) < 4e-3
            has_lora = any(p.lora for p in group)
            assert took_epilogue == (has_lora and m <= fused_decode.LORA_REDUCTION_ROWS)


def test_kernel_argument_structures_match_the_source():
    """The ctypes mirrors have the sizes the source's static_asserts pin (a build fails if the CUDA side changes;
    this fails if the Python side does), and the offsets of the fields as the CUDA compiler lays them out."""
    import ctypes

    assert ctypes.sizeof(cuda_mma._Segments) == 144
    assert cuda_mma._Segments.rows.offset == 96 and cuda_mma._Segments.count.offset == 136
    assert ctypes.sizeof(cuda_mma._LoraTerms) == 64
    assert cuda_mma._LoraTerms.scaling.offset == 32 and cuda_mma._LoraTerms.ld_t.offset == 56
    assert "sizeof(LoraTerms) == 64" in cuda_mma.source() and "sizeof(Segments) == 144" in cuda_mma.source()


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_90"])
def test_lora_builds_compile_for_each_target(arch):
    for config, rank in ((cuda_mma.MMAConfig(1, 1, 4), 32), (cuda_mma.MMAConfig(2, 2, 4), 128)):
        for dtype in (torch.bfloat16, torch.float16):
            name = config.name_expression(dtype, lora_rank=rank)
            assert name.endswith(f", {rank}>")
            cubin, lowered = nvrtc.compile_cubin(cuda_mma.source(), name, arch)
            assert cubin[:4] == b"\x7fELF" and lowered.startswith("_Z16nvfp4_mma_kernel")


@needs_nvrtc
@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump (Triton bundles one)")
@pytest.mark.parametrize("config", [cuda_mma.MMAConfig(1, 1, 4), cuda_mma.MMAConfig(2, 1, 4)], ids=str)
@pytest.mark.parametrize("rank", [8, 32, 128])
def test_lora_lives_in_the_epilogue_only(tmp_path, config, rank):
    """On Hopper the LoRA build's main loop is the plain build's: as many instructions (padding NOPs aside, at most
    two more), the same MMAs and loads, nothing from shared or local memory; the register allocator may pick other
    integer instructions for the same address arithmetic (IMAD.SHL / SHF.L). Nothing goes to the stack."""
    plain, lora = (
        nvrtc.compile_cubin(cuda_mma.source(), config.name_expression(torch.bfloat16, lora_rank=r), "sm_90")[0]
        for r in (0, rank)
    )
    plain_loop, lora_loop = (
        [op for op in main_loop(sass_of(cubin, tmp_path)) if op != "NOP"] for cubin in (plain, lora)
    )
    assert len(lora_loop) <= len(plain_loop) + 2, f"{len(lora_loop)} vs {len(plain_loop)} instructions"
    memory = ("HMMA", "LDG", "LDS", "STS", "BAR", "LDL", "STL", "SHFL")
    for kind in memory:
        assert sum(op.startswith(kind) for op in lora_loop) == sum(op.startswith(kind) for op in plain_loop), kind
    assert resources_of(lora, tmp_path)["STACK"] == 0 and resources_of(lora, tmp_path)["LOCAL"] == 0


def test_shipped_lora_choices_are_decode_instances_whose_epilogue_fits():
    """`KernelChooser.lora_key` entries of the shipped tables (timed with the epilogue, `bench_lora_epilogue.py
    --sweep --choices`): decode-kernel instances with room for the terms, under a key of `KernelChooser.key`'s form
    (`choose_with_lora` reads them whether or not the table has the plain key: 14B gate/up and down at 8 rows have
    only the LoRA-keyed entry, their plain choice is timed at run time)."""
    import json
    import re
    from pathlib import Path

    tables = sorted((Path(kernels.__file__).parent / "tuned").glob("*.json"))
    found = 0
    for table in tables:
        entries = json.loads(table.read_text())
        for key, value in entries.items():
            plain, lora, rank = key.rpartition("|lora")
            if not lora:
                continue
            found += 1
            config = kernels._choice_from_json(value)
            assert isinstance(config, cuda_mma.MMAConfig) and cuda_mma.lora_fits(config), key
            assert int(rank) in cuda_mma.LORA_RANKS, key
            assert re.fullmatch(r"[^|]+\|(bfloat16|float16)\|\d+\|\d+\|\d+(\|x\d+)?", plain), key
    assert found >= 2


def test_lora_choices_are_swept_in_the_build_the_engine_runs():
    """`bench_lora_epilogue.py --sweep --choices` picks instances by the twiddled build's times where the fast engine
    decodes in that order (up to `fast.TWIDDLE_MAX_ROWS` rows), by the standard build's above, or as asked."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    from bench_lora_epilogue import TWIDDLED_BUILD, sweep_build

    from trl_qerl.rollout.fast import TWIDDLE_MAX_ROWS

    assert TWIDDLED_BUILD == "NVFP4_TWIDDLED=1"
    assert sweep_build("engine", 8) == sweep_build("engine", TWIDDLE_MAX_ROWS) == TWIDDLED_BUILD
    assert sweep_build("engine", TWIDDLE_MAX_ROWS + 1) == ""
    assert sweep_build("twiddled", 64) == TWIDDLED_BUILD and sweep_build("standard", 1) == ""
    with pytest.raises(ValueError, match="build must be one of"):
        sweep_build("fast", 8)


# -- on a GPU -------------------------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])  # 1 and 9: CTAs of one token (the single-token branch)
def test_every_decode_instance_adds_the_terms(dtype, m):
    k = 768
    x, weights, biases, hidden, lora_b = _case(m, k, dtype, "cuda", seed=m)
    lora = cuda_mma.LoraInputs(hidden, lora_b, SCALING)
    assert cuda_mma.supports(x, weights) and cuda_mma.lora_supported(x, weights, lora)
    expected = reference_with_lora(x, weights, biases, hidden, lora_b, SCALING)
    width = sum(ROWS)
    configs = cuda_mma.candidate_configs(m, width, k) + [cuda_mma.heuristic_config(m, width, k, 132)]
    for config in configs:
        wide = poisoned_out(m, width + 24, dtype)
        out = cuda_mma.matmul(x, weights, config, biases, out=wide[:, :width], lora=lora)
        assert torch.isfinite(out).all(), f"{config}: unwritten or non-finite outputs"
        assert relative_error(expected, out) < TOLERANCE, str(config)
        assert wide[:, width:].isnan().all(), f"{config} wrote outside its columns"
        unfused = add_lora_terms(
            cuda_mma.matmul(x, weights, config, biases), list(ROWS), hidden, lora_b, list(SCALING)
        )
        assert relative_error(unfused.double(), out) < 4e-3, f"{config}: not the unfused step's numbers"


@needs_cuda
def test_op_adds_the_terms_with_any_kernel_choice(monkeypatch):
    from trl_qerl.nvfp4 import kernels as K

    x, weights, biases, hidden, lora_b = _case(8, 1024, torch.bfloat16, "cuda", seed=5)
    packed, scale, gs = (list(t) for t in zip(*weights))
    expected = reference_with_lora(x, weights, biases, hidden, lora_b, SCALING)
    chosen = torch.ops.trl_qerl.nvfp4_linear_grouped_lora(x, packed, scale, gs, biases, hidden, lora_b, list(SCALING))
    assert relative_error(expected, chosen) < TOLERANCE
    chooser = K.KernelChooser(autotune=False)
    chooser.choices[K.KernelChooser.key(x, sum(ROWS), 1024, 3)] = K.SEPARATE  # not the decode kernel
    monkeypatch.setattr(K, "CHOOSER", chooser)
    other = torch.ops.trl_qerl.nvfp4_linear_grouped_lora(x, packed, scale, gs, biases, hidden, lora_b, list(SCALING))
    assert relative_error(expected, other) < TOLERANCE
    # one weight (o, down): the single-weight choice
    single = torch.ops.trl_qerl.nvfp4_linear_grouped_lora(
        x, packed[:1], scale[:1], gs[:1], [None], hidden[:, :16].contiguous(), lora_b[:1], [2.0]
    )
    dense = dequantize(*weights[0], dtype=torch.float64)
    expected_q = x.double() @ dense.T + 2.0 * hidden[:, :16].double() @ lora_b[0].double().T
    assert relative_error(expected_q, single) < TOLERANCE
    with pytest.raises(ValueError, match="hidden has shape"):
        torch.ops.trl_qerl.nvfp4_linear_grouped_lora(
            x, packed, scale, gs, biases, hidden[:, :8], lora_b, list(SCALING)
        )


@needs_cuda
def test_a_lora_keyed_choice_is_taken_for_launches_with_the_epilogue(monkeypatch):
    from trl_qerl.nvfp4 import kernels as K

    x, weights, biases, hidden, lora_b = _case(1, 1024, torch.bfloat16, "cuda", seed=6)
    packed, scale, gs = (list(t) for t in zip(*weights))
    chooser = K.KernelChooser(autotune=False)
    plain, with_lora = cuda_mma.MMAConfig(1, 1, 2), cuda_mma.MMAConfig(2, 1, 4)
    chooser.choices[K.KernelChooser.key(x, sum(ROWS), 1024, 3)] = plain
    monkeypatch.setattr(K, "CHOOSER", chooser)
    assert chooser.choose_with_lora(x, weights, 16) == plain  # no LoRA-keyed entry: the plain choice
    chooser.choices[K.KernelChooser.lora_key(x, sum(ROWS), 1024, 3, 16)] = with_lora
    assert chooser.choose_with_lora(x, weights, 16) == with_lora
    assert chooser.choose_with_lora(x, weights, 32) == plain  # another rank
    launched = []
    monkeypatch.setattr(cuda_mma, "matmul", lambda *args, **kw: launched.append(args[2]) or x.new_zeros(1, 400))
    torch.ops.trl_qerl.nvfp4_linear_grouped_lora(x, packed, scale, gs, biases, hidden, lora_b, list(SCALING))
    assert launched == [with_lora]


@needs_cuda
def test_a_plain_choice_without_the_epilogue_is_timed_against_it_and_either_path_adds_the_terms(monkeypatch):
    """`KernelChooser.choose_with_lora` on the GPU: the plain choice `SEPARATE` (no epilogue) is timed against the
    decode kernel's instances with the terms in it; the winner is kept under the `lora_key`, and the op's output
    matches the float64 reference whichever won, and along the other path too."""
    from trl_qerl.nvfp4 import kernels as K

    x, weights, biases, hidden, lora_b = _case(16, 1024, torch.bfloat16, "cuda", seed=11)
    packed, scale, gs = (list(t) for t in zip(*weights))
    expected = reference_with_lora(x, weights, biases, hidden, lora_b, SCALING)
    chooser = K.KernelChooser(autotune=True)
    chooser.choices[K.KernelChooser.key(x, sum(ROWS), 1024, 3)] = K.SEPARATE
    monkeypatch.setattr(K, "CHOOSER", chooser)
    monkeypatch.setattr(K, "TIME_WITH_LORA", True)

    def op():
        return torch.ops.trl_qerl.nvfp4_linear_grouped_lora(
            x, packed, scale, gs, biases, hidden, lora_b, list(SCALING)
        )

    assert relative_error(expected, op()) < TOLERANCE
    key = K.KernelChooser.lora_key(x, sum(ROWS), 1024, 3, 16)
    won = chooser.choices[key]
    assert isinstance(won, cuda_mma.MMAConfig) or won == K.PLAIN_WITH_TERMS_AFTER
    assert K.PLAIN_WITH_TERMS_AFTER in chooser.timings[key] and len(chooser.timings[key]) > 1
    fastest = min(chooser.timings[key], key=chooser.timings[key].get)
    assert fastest == str(won)
    other_path = K.PLAIN_WITH_TERMS_AFTER if isinstance(won, cuda_mma.MMAConfig) else cuda_mma.MMAConfig(1, 2, 4)
    chooser.choices[key] = other_path
    assert relative_error(expected, op()) < TOLERANCE


@needs_cuda
def test_graph_replays_read_new_activations_and_new_b_in_place():
    x, weights, biases, hidden, lora_b = _case(4, 512, torch.bfloat16, "cuda", seed=9)
    packed, scale, gs = (list(t) for t in zip(*weights))

    def call():
        return torch.ops.trl_qerl.nvfp4_linear_grouped_lora(
            x, packed, scale, gs, biases, hidden, lora_b, list(SCALING)
        )

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for seed in range(3):
        generator = torch.Generator().manual_seed(100 + seed)
        x.copy_(torch.randn(x.shape, generator=generator).cuda())
        hidden.copy_(torch.randn(hidden.shape, generator=generator).cuda())
        lora_b[0].mul_(-1.5)  # an optimizer step writes B in place
        graph.replay()
        assert relative_error(reference_with_lora(x, weights, biases, hidden, lora_b, SCALING), out) < TOLERANCE
