"""A group's base products with its LoRA shrink on a second stream (`trl_qerl.rollout.lora_beside`).

On CPU the op computes the torch formulas; its outputs must be the two-launch path's (`lora_rows`) bit for bit, the
fused step must take it only where it applies, and the benchmark engine must switch it. On CUDA the shrink runs on
the side stream: outputs equal the serial launches' bit for bit, eagerly, in a captured graph replayed over changing
inputs (a missing fork or join would read ``t`` or ``x`` half-written), and in a captured compiled decode step.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from trl_qerl.nvfp4.format import quantize, shared_global_scale
from trl_qerl.rollout import fused_decode
from trl_qerl.rollout.lora_beside import SIDE_LANE, base_products, products_lora_beside
from trl_qerl.rollout.lora_rows import lora_expand_add, lora_shrink_rows


CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.usefixtures("quiet_warnings")

GROUPS = {
    "qkv_nvfp4_bias": dict(widths=(96, 32, 32), ranks=(16, 16, 16), nvfp4=True, bias=True),
    "gate_up_nvfp4": dict(widths=(160, 160), ranks=(32, 32), nvfp4=True, bias=False),
    "down_nvfp4": dict(widths=(64,), ranks=(32,), nvfp4=True, bias=False),
    "qkv_16bit_bias": dict(widths=(96, 32, 32), ranks=(8, 8, 8), nvfp4=False, bias=True),
}


def _group(spec: dict | str, rows: int, width: int, dtype: torch.dtype, seed: int = 0):
    """``x[rows, width]`` and the op's arguments after it for a group of `GROUPS` (or a spec of that form), random
    (never zeros), on `DEVICE`."""
    spec = GROUPS[spec] if isinstance(spec, str) else spec
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, width, generator=generator) * 2).to(DEVICE, dtype)
    dense = [torch.randn(n, width, generator=generator) * 0.05 for n in spec["widths"]]
    count = len(dense)
    if spec["nvfp4"]:
        shared = shared_global_scale(dense)
        weights = [quantize(w.to(DEVICE), shared) for w in dense]
        packed, scale, global_scale = ([w[i] for w in weights] for i in range(3))
        weight = [None] * count
    else:
        packed = scale = global_scale = [None] * count
        weight = [w.to(DEVICE, dtype) for w in dense]
    bias = [torch.randn(n, generator=generator).to(DEVICE, dtype) if spec["bias"] else None for n in spec["widths"]]
    lora_a = [(torch.randn(r, width, generator=generator) / width**0.5).to(DEVICE) for r in spec["ranks"]]
    lora_b = [(torch.randn(n, r, generator=generator) * 0.1).to(DEVICE) for n, r in zip(spec["widths"], spec["ranks"])]
    scalings = [2.0, 0.5, 1.0][:count]
    return x, [packed, scale, global_scale, weight, bias, lora_a, lora_b, scalings]


def _serial(x, packed, scale, global_scale, weight, bias, lora_a, lora_b, scalings):
    """The two-launch path: products, then the shrink and the expand on the current stream."""
    bases = base_products(x, packed, scale, global_scale, weight, bias)
    return lora_expand_add(bases, lora_shrink_rows(x, lora_a), lora_b, scalings)


@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("rows, dtype", [(17, torch.bfloat16), (40, torch.float16), (70, torch.bfloat16)])
def test_outputs_equal_the_two_launch_path_bit_for_bit(group, rows, dtype):
    """On CUDA the shrink runs beside the products (a 4,096-wide input: its columns split over programs, so the side
    lane's counters are used); on CPU both are the torch formulas."""
    if not GROUPS[group]["nvfp4"] and dtype == torch.float16:
        dtype = torch.bfloat16  # (the 16-bit weights take x's dtype either way)
    x, args = _group(group, rows, 4096 if CUDA else 256, dtype)
    ours, theirs = products_lora_beside(x, *args), _serial(x, *args)
    assert len(ours) == len(theirs) == len(GROUPS[group]["widths"])
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape and a.is_contiguous()
        assert not a.isnan().any()
        assert torch.equal(a, b)


def test_op_passes_opcheck():
    x, args = _group("qkv_nvfp4_bias", 20, 64, torch.bfloat16)
    # (opcheck's schema test cannot compare the fp8 scales on CPU, so NVFP4 groups leave it out, as test_kernels does)
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(products_lora_beside, (x, *args), test_utils=utils)
    x, args = _group("qkv_16bit_bias", 20, 64, torch.bfloat16)
    torch.library.opcheck(products_lora_beside, (x, *args))


def test_side_lane_has_counters_of_its_own():
    """Launches on the side stream may overlap split-K launches of the products: one counter buffer each."""
    from trl_qerl.nvfp4.cuda_mma import arrival_counters
    from trl_qerl.rollout._lora_rows_kernel import shrink_layout, shrink_rows

    main, side = arrival_counters(torch.device(DEVICE), 8), arrival_counters(torch.device(DEVICE), 8, SIDE_LANE)
    assert main.data_ptr() != side.data_ptr()
    x, args = _group("down_nvfp4", 20, 9000 // 16 * 16, torch.bfloat16)
    lora_a = args[5]
    assert shrink_layout(20, x.shape[1], [32])[4] > 1  # columns split: the counters are used
    t = torch.full((20, 32), float("nan"), device=DEVICE)
    shrink_rows(x, lora_a, t, lane=SIDE_LANE)
    exact = x.double() @ lora_a[0].double().T
    assert ((t.double() - exact).norm() / exact.norm()).item() < 1e-6
    assert int(side.abs().sum()) == 0 and int(main.abs().sum()) == 0


def _tiny_layer(rank: int = 16, target_modules=None):
    from _tiny import randomize_lora_b, tiny_model

    from trl_qerl.lora import get_peft_model, nvfp4_lora_config
    from trl_qerl.quantizer import quantize_model
    from trl_qerl.rollout.decoder_spec import read_decoder

    torch.manual_seed(0)
    model = quantize_model(tiny_model("qwen2", dtype=torch.bfloat16))
    config = nvfp4_lora_config(model, r=rank)
    if target_modules is not None:
        config.target_modules = set(target_modules)
    return read_decoder(randomize_lora_b(get_peft_model(model, config))).layers[0]


def test_the_step_takes_the_op_only_where_it_applies(monkeypatch):
    """Switched on, from `LORA_BESIDE_MIN_ROWS` rows up to `LORA_ROW_KERNELS_MAX` (where the row kernels run: here, on
    CPU, as torch formulas) every group whose projections all have one adapter goes through the op, with the two-launch
    path's outputs bit for bit; outside those rows (between the epilogue's limit and the least rows, the two-launch
    path), switched off, or with the row kernels off, it does not."""
    from _tiny import record_calls

    layer = _tiny_layer()
    width = layer.qkv[0].packed.shape[1] * 2
    calls = record_calls(monkeypatch, fused_decode, ("products_lora_beside",))
    monkeypatch.setattr(fused_decode, "runs_triton", lambda x: True)
    monkeypatch.setattr(fused_decode, "LORA_EPILOGUE", False)
    least, most = fused_decode.LORA_BESIDE_MIN_ROWS, fused_decode.LORA_ROW_KERNELS_MAX
    assert fused_decode.LORA_REDUCTION_ROWS < least - 1
    cases = [(least - 1, True, True, False), (least, True, True, True), (most, True, True, True),
             (most + 1, True, True, False), (least, False, True, False), (least, True, False, False)]  # fmt: skip
    for rows, beside, row_kernels, taken in cases:
        x = torch.randn(rows, width, dtype=torch.bfloat16)
        for group in (layer.qkv, layer.gate_up, (layer.o,)):
            monkeypatch.setattr(fused_decode, "LORA_SHRINK_BESIDE", False)
            serial = fused_decode.project(x, group)
            assert not calls
            monkeypatch.setattr(fused_decode, "LORA_SHRINK_BESIDE", beside)
            monkeypatch.setattr(fused_decode, "LORA_ROW_KERNELS", row_kernels)
            ours = fused_decode.project(x, group)
            monkeypatch.setattr(fused_decode, "LORA_ROW_KERNELS", True)
            assert bool(calls) == taken, (rows, beside, row_kernels)
            calls.clear()
            for a, b in zip(ours, serial):
                assert a.dtype == b.dtype and a.shape == b.shape
                assert torch.equal(a, b)


def test_the_gate_and_the_op_trace_in_one_graph(monkeypatch):
    """What dynamo sees of the step: `project` with the op, traced whole (``fullgraph``; ``aot_eager`` runs the op's
    fake through AOT autograd), computes the eager outputs. (A gate dynamo cannot trace makes the GPU step fall back to
    eager layers; the GPU image's torch is older than CI's, so `.device/compile_probe.py` runs there too.)"""
    from _tiny import record_calls

    layer = _tiny_layer()
    calls = record_calls(monkeypatch, fused_decode, ("products_lora_beside",))
    monkeypatch.setattr(fused_decode, "runs_triton", lambda x: True)
    monkeypatch.setattr(fused_decode, "LORA_SHRINK_BESIDE", True)
    x = torch.randn(fused_decode.LORA_BESIDE_MIN_ROWS + 4, layer.qkv[0].packed.shape[1] * 2, dtype=torch.bfloat16)
    torch._dynamo.reset()
    traced = torch.compile(fused_decode.project, fullgraph=True, backend="aot_eager")
    with torch.no_grad():  # as rollouts run
        for a, b in zip(traced(x, layer.qkv), fused_decode.project(x, layer.qkv)):
            assert torch.equal(a, b)
    assert calls


@pytest.mark.parametrize("beside, rows", [(False, 20), (True, 20), (True, 8)], ids=["serial", "beside", "all_rows"])
def test_the_decode_layer_traces_whole_above_the_epilogue_rows(monkeypatch, caplog, beside, rows):
    """The whole decode layer at 20 rows, the row kernels' path (here the ops' torch formulas; and at 8 rows with
    `LORA_BESIDE_MIN_ROWS` 1, the op in place of the norm shrinks and the epilogue), traced by dynamo in one
    graph (``fullgraph``, ``aot_eager``: no code generation, so it runs on CPU): no fallback to eager layers, and the
    greedy tokens of the eager step. CI's lowest-version run has the GPU image's torch (`Makefile`'s ``LOWEST_TORCH``),
    so this catches trace-time code that only its older dynamo rejects (a ``bool(list)`` in a gate does: the
    twenty-first session lost a device call to one)."""
    from _tiny import randomize_lora_b, record_calls, tiny_model

    from trl_qerl.lora import get_peft_model, nvfp4_lora_config
    from trl_qerl.quantizer import quantize_model
    from trl_qerl.rollout.fast import SamplingParams, StaticCacheGenerator

    torch.manual_seed(0)
    model = quantize_model(tiny_model("qwen2", dtype=torch.bfloat16))
    model = randomize_lora_b(get_peft_model(model, nvfp4_lora_config(model, r=16))).eval()
    calls = record_calls(monkeypatch, fused_decode, ("products_lora_beside", "lora_shrink_rows"))
    monkeypatch.setattr(fused_decode, "runs_triton", lambda x: True)
    monkeypatch.setattr(fused_decode, "LORA_SHRINK_BESIDE", beside)
    monkeypatch.setattr(fused_decode, "LORA_BESIDE_MIN_ROWS", min(rows, fused_decode.LORA_BESIDE_MIN_ROWS))
    traced = lambda: torch.compile(fused_decode.decoder_layer, fullgraph=True, backend="aot_eager")  # noqa: E731
    monkeypatch.setattr(fused_decode, "_compiled_layer", traced)
    torch._dynamo.reset()
    prompts = [[5 + i % 7, 6, 7 + i % 3] for i in range(rows)]
    params = SamplingParams(max_new_tokens=3, temperature=0.0)
    samples = []
    for compile in (True, False):
        generator = StaticCacheGenerator(model, engine="fused", cuda_graph=False, compile=compile)
        with caplog.at_level("WARNING", logger="trl_qerl.rollout.fused_decode"):
            samples.append(generator.sample(prompts, params, eos_token_ids=[], pad_token_id=0).completion_ids)
        assert calls == {"products_lora_beside" if beside else "lora_shrink_rows": True}
        calls.clear()
    assert not [r for r in caplog.records if "compiling the fused decode step failed" in r.getMessage()]
    assert samples[0] == samples[1]


def test_groups_with_a_projection_without_its_adapter_keep_the_two_launch_path(monkeypatch):
    """LoRA on q and v only: the q/k/v group keeps the two-launch path (the op takes groups whose every projection has
    one adapter); o, with its adapter, takes the op."""
    from _tiny import record_calls

    layer = _tiny_layer(target_modules=("q_proj", "v_proj", "o_proj"))
    assert not layer.qkv[1].lora and layer.qkv[0].lora
    calls = record_calls(monkeypatch, fused_decode, ("products_lora_beside", "lora_shrink_rows"))
    monkeypatch.setattr(fused_decode, "runs_triton", lambda x: True)
    monkeypatch.setattr(fused_decode, "LORA_SHRINK_BESIDE", True)
    x = torch.randn(fused_decode.LORA_BESIDE_MIN_ROWS, layer.qkv[0].packed.shape[1] * 2, dtype=torch.bfloat16)
    fused_decode.project(x, layer.qkv)
    assert calls == {"lora_shrink_rows": True}
    calls.clear()
    fused_decode.project(x, (layer.o,))
    assert calls == {"products_lora_beside": True}


def test_the_decoder_names_groups_that_keep_the_serial_path(monkeypatch):
    """What `FusedDecoder` logs when the op is on: the groups where some projection has no adapter, for decoders of
    `LORA_BESIDE_MIN_ROWS` rows and more on CUDA only (smaller steps do not take the op)."""
    from types import SimpleNamespace

    assert fused_decode._groups_without_beside(_tiny_layer()) == ""
    some = _tiny_layer(target_modules=("q_proj", "v_proj", "o_proj", "gate_proj"))
    assert fused_decode._groups_without_beside(some) == "q/k/v, gate/up"
    spec, cuda = SimpleNamespace(layers=[some]), torch.device("cuda")
    least = fused_decode.LORA_BESIDE_MIN_ROWS
    note = fused_decode._lora_path_note(spec, least, cuda)
    assert note is not None and "q/k/v, gate/up" in note and "not beside them" in note
    assert fused_decode._lora_path_note(spec, least - 1, cuda) is None
    assert fused_decode._lora_path_note(spec, fused_decode.LORA_ROW_KERNELS_MAX + 1, cuda) is None
    assert fused_decode._lora_path_note(spec, least, torch.device("cpu")) is None
    assert fused_decode._lora_path_note(SimpleNamespace(layers=[_tiny_layer()]), least, cuda) is None
    monkeypatch.setattr(fused_decode, "LORA_SHRINK_BESIDE", False)
    assert fused_decode._lora_path_note(spec, least, cuda) is None


def test_the_decoder_says_each_lora_path_note_once(monkeypatch, caplog):
    """A rollout makes a decoder per batch and length: a note is logged by the first one only."""
    from _tiny import tiny_model

    from trl_qerl.lora import get_peft_model, nvfp4_lora_config
    from trl_qerl.quantizer import quantize_model
    from trl_qerl.rollout.decoder_spec import read_decoder

    model = quantize_model(tiny_model("qwen2", dtype=torch.bfloat16))
    spec = read_decoder(get_peft_model(model, nvfp4_lora_config(model, r=16)))
    monkeypatch.setattr(fused_decode, "_NOTED", set())
    monkeypatch.setattr(fused_decode, "_lora_path_note", lambda spec, batch, device: f"a note ({batch > 2})")
    with caplog.at_level("INFO", logger="trl_qerl.rollout.fused_decode"):
        for batch in (4, 3, 4, 2):
            fused_decode.FusedDecoder(spec, batch, 16, "cpu", compile=False)
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("a note")] == [
        "a note (True)",
        "a note (False)",
    ]


def test_rollout_benchmark_engine_turns_it_on_and_back_off():
    """`bench_rollout.py`'s ``+shrink_beside`` engine: the op from the row kernels' first row (17, as measured before it
    became the default from 33) while it runs, the other named engines without it, ``default`` with the shipped
    setting, and the shipped setting after each."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    from bench_rollout import ENGINES, engine_environment

    shipped = fused_decode.LORA_SHRINK_BESIDE, fused_decode.LORA_BESIDE_MIN_ROWS
    assert ENGINES["fused+compile+split_kv+twiddle+shrink_beside"]["twiddled_decode"]
    assert shipped == (True, 33)
    with engine_environment("fused+compile+split_kv+twiddle+shrink_beside"):
        assert fused_decode.LORA_SHRINK_BESIDE and fused_decode.LORA_BESIDE_MIN_ROWS == 17
    with engine_environment("fused+compile+split_kv+twiddle+shrink_beside_all_rows"):
        assert fused_decode.LORA_SHRINK_BESIDE and fused_decode.LORA_BESIDE_MIN_ROWS == 1
    with engine_environment("fused+compile+split_kv+twiddle"):
        assert not fused_decode.LORA_SHRINK_BESIDE
    with engine_environment("default"):
        assert (fused_decode.LORA_SHRINK_BESIDE, fused_decode.LORA_BESIDE_MIN_ROWS) == shipped
    assert (fused_decode.LORA_SHRINK_BESIDE, fused_decode.LORA_BESIDE_MIN_ROWS) == shipped


def test_rollout_benchmark_group_sums_engine_sets_the_row_shrinks_sum():
    """`bench_rollout.py`'s ``+group_sums`` engine: the row shrink sums in groups of `GROUP_SUMS` while it runs, with
    the shrink beside as its ``+shrink_beside`` part says; the other named engines sum in one level (as measured);
    ``default`` keeps the shipped groups; the shipped setting after each."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    from bench_rollout import ENGINES, GROUP_SUMS, engine_environment

    from trl_qerl.rollout import _lora_rows_kernel as row_kernels

    shipped = row_kernels.GROUP_SPLITS
    grouped = "fused+compile+split_kv+twiddle+lane_order+shrink_beside+group_sums"
    assert shipped == GROUP_SUMS == 8 and ENGINES[grouped]["twiddled_decode"]
    with engine_environment(grouped):
        assert row_kernels.GROUP_SPLITS == GROUP_SUMS
        assert fused_decode.LORA_SHRINK_BESIDE and fused_decode.LORA_BESIDE_MIN_ROWS == 17
    with engine_environment("fused+compile+split_kv+twiddle+lane_order+shrink_beside"):
        assert row_kernels.GROUP_SPLITS == 0 and fused_decode.LORA_SHRINK_BESIDE
    with engine_environment("default"):
        assert row_kernels.GROUP_SPLITS == shipped
    assert row_kernels.GROUP_SPLITS == shipped


def test_rollout_benchmark_own_choice_engines_keep_the_defaults_and_their_choices_apart(tmp_path):
    """`bench_rollout.py`'s ``default+...`` engines (`OWN_CHOICE_ENGINES`) run the generator's defaults (lane order,
    shrink beside, row-shrink groups: not the named engines' older settings) with their own settings and kernel
    choices: the chooser starts from the table the process began with, and what it timed inside is forgotten."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    from bench_rollout import ENGINES, OWN_CHOICE_ENGINES, SHIPPED_CHOICES, engine_environment

    from trl_qerl.nvfp4 import cuda_mma, cuda_wgmma, kernels
    from trl_qerl.rollout import _lora_rows_kernel as row_kernels
    from trl_qerl.rollout import fast

    def defaults():
        return (fused_decode.LORA_SHRINK_BESIDE, fused_decode.LORA_BESIDE_MIN_ROWS, row_kernels.GROUP_SPLITS,
                fast.LANE_ORDER)  # fmt: skip

    shipped, before = defaults(), dict(kernels.CHOOSER.choices)
    assert set(OWN_CHOICE_ENGINES) >= {"+narrow_wgmma", "+tile_spread", "+spread_64", "+own_choices"}
    assert all(f"default{suffix}" in ENGINES for suffix in OWN_CHOICE_ENGINES)
    with engine_environment("default+narrow_wgmma"):
        assert defaults() == shipped and not cuda_wgmma.SPREAD_CANDIDATES
        assert kernels.CHOOSER.choices == SHIPPED_CHOICES
        kernels.CHOOSER.choices["timed inside"] = kernels.DEQUANT_CUBLAS
    assert cuda_wgmma.SPREAD_CANDIDATES and kernels.CHOOSER.choices == before
    with engine_environment("default+tile_spread"):
        assert defaults() == shipped and cuda_mma.TILE_SPREAD_CANDIDATES
    assert not cuda_mma.TILE_SPREAD_CANDIDATES and defaults() == shipped
    compile_ends = fused_decode.COMPILE_ENDS
    with engine_environment("default+eager_ends"):
        assert defaults() == shipped and not fused_decode.COMPILE_ENDS
    assert fused_decode.COMPILE_ENDS == compile_ends
    rotary_in_attention = fused_decode.ROTARY_IN_ATTENTION
    with engine_environment("default+rotary_in_attention"):
        assert defaults() == shipped and fused_decode.ROTARY_IN_ATTENTION
    assert fused_decode.ROTARY_IN_ATTENTION == rotary_in_attention
    fused_rows = fused_decode.FUSED_SHRINK_ROWS
    with engine_environment("default+fused_shrink_16"):
        assert defaults() == shipped and fused_decode.FUSED_SHRINK_ROWS == 16
    assert fused_decode.FUSED_SHRINK_ROWS == fused_rows
    time_with_lora = kernels.TIME_WITH_LORA
    with engine_environment("default+untimed_lora"):
        assert defaults() == shipped and kernels.TIME_WITH_LORA is False
    assert kernels.TIME_WITH_LORA == time_with_lora
    programmatic = cuda_mma.PROGRAMMATIC
    with engine_environment("default+pdl"):
        assert defaults() == shipped and cuda_mma.PROGRAMMATIC is True
    with engine_environment("default+pdl_rotary"):  # two modules' settings
        assert defaults() == shipped and cuda_mma.PROGRAMMATIC is True and fused_decode.ROTARY_IN_ATTENTION
    with engine_environment("default+no_pdl"):
        assert defaults() == shipped and cuda_mma.PROGRAMMATIC is False
    plain_shrink = fused_decode.PLAIN_SHRINK
    with engine_environment("default+plain_shrink"):
        assert defaults() == shipped and fused_decode.PLAIN_SHRINK
    assert fused_decode.PLAIN_SHRINK == plain_shrink
    assert cuda_mma.PROGRAMMATIC == programmatic and fused_decode.ROTARY_IN_ATTENTION == rotary_in_attention
    (tmp_path / "table.json").write_text("{}")
    with engine_environment("default+alt_choices", str(tmp_path / "table.json")):
        assert defaults() == shipped
    assert kernels.CHOOSER.choices == before
    with engine_environment("fused+compile+split_kv+twiddle"):  # a named engine: the settings it was measured with
        assert not fused_decode.LORA_SHRINK_BESIDE and not fast.LANE_ORDER and not fused_decode.ROTARY_IN_ATTENTION
        assert cuda_mma.PROGRAMMATIC is False  # (PDL only in its ``+pdl`` engines)


def test_small_steps_take_it_in_place_of_the_norm_shrinks_when_asked(monkeypatch):
    """`LORA_BESIDE_MIN_ROWS` 1 (the ``+shrink_beside_all_rows`` engines): at 8 rows the input norm makes no shrinks
    and the q/k/v group goes through the op, not the NVFP4 epilogue; the outputs agree with the epilogue path's up to
    the order of fp32 sums (one rounding step)."""
    from _tiny import record_calls

    layer = _tiny_layer()
    x = torch.randn(8, layer.qkv[0].packed.shape[1] * 2, dtype=torch.bfloat16)
    monkeypatch.setattr(fused_decode, "runs_triton", lambda x: True)
    monkeypatch.setattr(fused_decode, "LORA_SHRINK_BESIDE", True)
    _, h, hidden = fused_decode.normed_input(x, layer.input_norm, layer.qkv)
    assert hidden is not None  # the default rows: the norm makes the shrinks, the epilogue adds the terms
    epilogue = fused_decode.project(h, layer.qkv, hidden)
    monkeypatch.setattr(fused_decode, "LORA_BESIDE_MIN_ROWS", 1)
    calls = record_calls(monkeypatch, fused_decode, ("products_lora_beside",))
    _, h_beside, hidden = fused_decode.normed_input(x, layer.input_norm, layer.qkv)
    assert hidden is None and torch.equal(h_beside, h)
    beside = fused_decode.project(h, layer.qkv, hidden)
    assert calls
    for a, b in zip(beside, epilogue):
        torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-3)


def test_benchmark_paths_agree_on_the_tiny_shape():
    """`bench_lora_beside.py`'s three paths on every group of the CPU-sized shape, both arms: the products' shapes,
    and beside equal to serial bit for bit (what its ``largest gap`` column reports on the GPU)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    from bench_lora_beside import groups, largest_gap, layer_arguments, run_path

    for name, (width, outs, bias) in groups("tiny").items():
        for nvfp4 in (True, False):
            arguments = layer_arguments(width, outs, bias, nvfp4, rank=8, device=DEVICE)
            x = torch.randn(20, width, device=DEVICE, dtype=torch.bfloat16)
            assert [tuple(p.shape) for p in run_path("products", x, arguments)] == [(20, n) for n in outs], name
            assert largest_gap(x, arguments) == 0.0


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_captured_graph_replays_over_new_inputs_on_cuda():
    """Three groups in a row, each reading the last one's output (as a decode layer's groups do), captured once and
    replayed over new inputs: each replay equals the serial launches on the same input bit for bit."""
    x, qkv = _group(dict(widths=(1024, 256, 256), ranks=(16,) * 3, nvfp4=True, bias=True), 40, 1024, torch.bfloat16)
    _, gate_up = _group(dict(widths=(2048, 2048), ranks=(32, 32), nvfp4=True, bias=False), 40, 1024, torch.bfloat16)
    _, down = _group(dict(widths=(1024,), ranks=(32,), nvfp4=True, bias=False), 40, 2048, torch.bfloat16)

    def chain(op, inputs):
        q = op(inputs, *qkv)[0]
        gate, up = op(q, *gate_up)
        return op(gate * up, *down)[0]

    inputs = x.clone()
    for _ in range(2):  # warm-up: builds, counters, the side stream
        chain(products_lora_beside, inputs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(products_lora_beside, inputs)
    for seed in range(5):
        inputs.copy_(torch.randn(inputs.shape, generator=torch.Generator().manual_seed(seed)).to(inputs))
        graph.replay()
        expected = chain(_serial, inputs.clone())
        torch.cuda.synchronize()
        assert not captured.isnan().any()
        assert torch.equal(captured, expected)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_captured_compiled_step_with_the_shrink_beside_on_cuda(monkeypatch):
    """40 rows (the op's shipped rows start at `LORA_BESIDE_MIN_ROWS`, 33): a captured step compiled with the op
    (conftest fails the test if it fell back to eager layers) samples what the two-launch path samples, with the same
    log-probs (the same kernels and sums)."""
    from _tiny import fused_samples_with_and_without

    prompts = [[5 + i % 7, 6, 7 + i % 3] for i in range(40)]
    samples, _ = fused_samples_with_and_without(
        monkeypatch, "LORA_SHRINK_BESIDE", ("products_lora_beside",), prompts=prompts
    )
    ours, theirs = samples[True], samples[False]
    assert ours.completion_ids == theirs.completion_ids
    for a_lp, b_lp in zip(ours.logprobs, theirs.logprobs):
        torch.testing.assert_close(torch.tensor(a_lp), torch.tensor(b_lp), rtol=0, atol=1e-5)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_captured_compiled_small_step_with_the_shrink_beside_on_cuda(monkeypatch):
    """8 rows with `LORA_BESIDE_MIN_ROWS` 1: a captured compiled step with the op in place of the norm shrinks and the
    NVFP4 epilogue samples the first tokens as the shipped step does (other sums: a near-tie may flip later tokens)."""
    from _tiny import assert_first_draws_agree, fused_samples_with_and_without

    monkeypatch.setattr(fused_decode, "LORA_BESIDE_MIN_ROWS", 1)
    prompts = [[5 + i % 7, 6, 7 + i % 3] for i in range(8)]
    samples, _ = fused_samples_with_and_without(
        monkeypatch, "LORA_SHRINK_BESIDE", ("products_lora_beside",), prompts=prompts
    )
    assert_first_draws_agree(samples[True], samples[False])
