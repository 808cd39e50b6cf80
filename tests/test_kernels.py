"""Triton NVFP4 kernels against the pure-torch reference.

On a CPU machine the kernels run in Triton's interpreter (the pure-Triton dequantisation path, fp16 activations:
the interpreter mishandles bf16 dots); on a GPU they run compiled, both with and without the inline-PTX path,
for every shape class and kernel configuration. Tolerance: relative error 1e-2 (16-bit operands, fp32
accumulation), never NaN; dequantisation is bit-exact.
"""

import json
import os
from pathlib import Path

import pytest
import torch


CUDA = torch.cuda.is_available()
assert CUDA or os.environ.get("TRITON_INTERPRET") == "1", "conftest.py sets TRITON_INTERPRET=1 on CPU machines"
pytest.importorskip("triton")

from trl_qerl.nvfp4 import kernels as K  # noqa: E402
from trl_qerl.nvfp4.format import dequantize, quantize, relative_error  # noqa: E402
from trl_qerl.nvfp4.linear import NVFP4A16Linear, kernels_for  # noqa: E402


DEVICE = "cuda" if CUDA else "cpu"
TOLERANCE = 1e-2
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def _weight(n, k, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return quantize((torch.randn(n, k, generator=generator) * 0.05).to(DEVICE))


def _reference(x, quantized):
    return x.double() @ dequantize(*quantized, dtype=torch.float64).T


def _poison_allocator():
    """Fill freed device memory with NaN so that an output element the kernel forgets to write shows up."""
    if CUDA:
        torch.empty(256 << 20, device="cuda", dtype=torch.uint8).fill_(0xFF)


def _check(out, expected):
    assert torch.isfinite(out).all()
    assert relative_error(expected, out) < TOLERANCE


# -- interpreter / any device ---------------------------------------------------------------------------------
SMALL_CONFIGS = [
    K.FusedConfig(16, 32, 128, 1),
    K.FusedConfig(16, 64, 128, 2),
    K.FusedConfig(32, 32, 256, 1),
    K.FusedConfig(16, 16, 64, 3),
]


def test_gemv_matches_reference():
    n, k = 100, 512
    quantized = _weight(n, k, seed=11)
    x = torch.randn(1, k, device=DEVICE).to(torch.float16)
    for config in (K.FusedConfig(1, 32, 256, 2, gemv=True), K.FusedConfig(1, 64, 512, 1, gemv=True)):
        _poison_allocator()
        _check(K.fused_matmul(x, *quantized, config), _reference(x, quantized))
    with pytest.raises(ValueError, match="needs one row"):
        K.fused_matmul(x.repeat(2, 1), *quantized, K.FusedConfig(1, 32, 256, 1, gemv=True))


@pytest.mark.parametrize("m", [1, 3, 17, 40])
@pytest.mark.parametrize("config", SMALL_CONFIGS, ids=lambda c: f"m{c.block_m}n{c.block_n}k{c.block_k}s{c.split_k}")
def test_fused_matmul_matches_reference(m, config):
    n, k = 100, 384  # N not a multiple of any block; K not a multiple of 256
    quantized = _weight(n, k, seed=m)
    x = torch.randn(m, k, device=DEVICE).to(torch.float16)
    _poison_allocator()
    _check(K.fused_matmul(x, *quantized, config), _reference(x, quantized))


def test_fused_matmul_accepts_non_contiguous_inputs():
    quantized = _weight(64, 256)
    wide = torch.randn(5, 512, device=DEVICE).to(torch.float16)
    x = wide[:, ::2]
    assert not x.is_contiguous()
    config = K.FusedConfig(16, 32, 128, 2)
    assert torch.equal(K.fused_matmul(x, *quantized, config), K.fused_matmul(x.contiguous(), *quantized, config))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else []))
def test_dequantize_kernel_is_bit_exact(dtype):
    quantized = _weight(48, 384, seed=3)
    _poison_allocator()
    assert torch.equal(K.dequantize_cuda(*quantized, dtype=dtype), dequantize(*quantized, dtype=dtype))


def test_byte_scales_decode_like_fp8():
    """GPUs before sm_89 load the block scales as bytes and decode them in the kernel (`_scale_value`): every one
    of the 256 E4M3 bytes, subnormals and NaN included, must give the same weight as the fp8 reference."""
    quantized = _weight(32, 128)
    every_byte = torch.arange(256, dtype=torch.uint8, device=DEVICE).reshape(32, 8).view(torch.float8_e4m3fn)
    packed, _, global_scale = quantized
    # (the interpreter rounds bf16 outputs differently, on the fp8 path too: bf16 is checked on GPUs)
    for dtype in [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else []):
        expected = dequantize(packed, every_byte, global_scale, dtype=dtype)
        out = K.dequantize_cuda(packed, every_byte.view(torch.uint8), global_scale, dtype=dtype)
        assert torch.equal(out.isnan(), expected.isnan()) and torch.equal(out.nan_to_num(), expected.nan_to_num())
    x = torch.randn(3, 128, device=DEVICE).to(torch.float16)
    for config in (K.FusedConfig(16, 32, 128, 2), K.FusedConfig(1, 32, 64, 2, gemv=True)):
        rows = x[:1] if config.gemv else x
        as_bytes = K.fused_matmul(rows, packed, quantized[1].view(torch.uint8), global_scale, config)
        assert torch.equal(as_bytes, K.fused_matmul(rows, *quantized, config))


def test_custom_ops_pass_opcheck():
    quantized = _weight(64, 128)
    x = torch.randn(5, 128, device=DEVICE)
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    # (opcheck's schema test cannot compare fp8 tensors on CPU, so it is left out)
    torch.library.opcheck(torch.ops.trl_qerl.nvfp4_linear.default, (x, *quantized), test_utils=utils)
    torch.library.opcheck(
        torch.ops.trl_qerl.nvfp4_grad_input.default, (torch.randn(5, 64, device=DEVICE), *quantized), test_utils=utils
    )
    torch.library.opcheck(torch.ops.trl_qerl.nvfp4_dequantize.default, (*quantized, torch.bfloat16), test_utils=utils)
    others = _weight(32, 128, seed=1)
    grouped = ([quantized[0], others[0]], [quantized[1], others[1]], [quantized[2], others[2]])
    bias = [torch.randn(64, device=DEVICE), None]
    torch.library.opcheck(torch.ops.trl_qerl.nvfp4_linear_grouped.default, (x, *grouped, bias), test_utils=utils)


def test_grouped_op_equals_separate_products_and_checks_its_lists():
    weights = [quantize(torch.randn(n, 128)) for n in (64, 16, 16)]
    x = torch.randn(3, 128)
    bias = [torch.randn(64), None, torch.randn(16)]
    packed, scale, gs = (list(t) for t in zip(*weights))
    out = torch.ops.trl_qerl.nvfp4_linear_grouped(x, packed, scale, gs, bias)
    parts = [x @ dequantize(*w, dtype=x.dtype).T + (b if b is not None else 0) for w, b in zip(weights, bias)]
    assert torch.allclose(out, torch.cat(parts, dim=1))
    with pytest.raises(ValueError, match="one packed tensor, scale, global scale and bias per weight"):
        torch.ops.trl_qerl.nvfp4_linear_grouped(x, packed, scale[:2], gs, bias)


def test_eager_calls_skip_the_op_and_traced_calls_keep_it(monkeypatch):
    """`dispatch.op_when_traced`: plain tensors outside tracing take the op's body directly (no custom-op dispatch on
    the host), torch.compile and tensor subclasses (other tracers' fake tensors) the op, with equal results."""
    from trl_qerl.nvfp4.dispatch import op_when_traced

    calls = []
    eager = lambda *args: calls.append("eager") or K.eager_linear(*args)  # noqa: E731
    op = lambda *args: calls.append("op") or torch.ops.trl_qerl.nvfp4_linear(*args)  # noqa: E731
    linear = op_when_traced(eager, op)
    quantized = _weight(64, 128)
    x = torch.randn(5, 128, device=DEVICE)
    direct = linear(x, *quantized)

    class Marked(torch.Tensor):
        pass

    through_op = linear(x.as_subclass(Marked), *quantized)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    while_compiling = linear(x, *quantized)
    assert calls == ["eager", "op", "op"]
    assert torch.equal(direct, through_op.as_subclass(torch.Tensor)) and torch.equal(direct, while_compiling)
    named = op_when_traced(K.eager_linear, torch.ops.trl_qerl.nvfp4_linear)
    assert named.__name__ == "eager_linear" and named.__doc__ == K.eager_linear.__doc__


def test_ops_on_cpu_equal_the_reference():
    quantized = quantize(torch.randn(64, 128))
    x = torch.randn(3, 128)
    assert torch.equal(torch.ops.trl_qerl.nvfp4_linear(x, *quantized), x @ dequantize(*quantized, dtype=x.dtype).T)
    with pytest.raises(ValueError, match="x has 64 features"):
        torch.ops.trl_qerl.nvfp4_linear(torch.randn(3, 64), *quantized)


def test_kernel_choice_helpers(tmp_path):
    rows = (1, 2, 8, 9, 16, 17, 64, 65, 1000, 10**6)
    assert [K.m_bucket(m) for m in rows] == [1, 8, 8, 16, 16, 32, 64, 128, 1024, 8192]
    decode = K.candidate_configs(1, 37888, 3584)
    assert decode and all(isinstance(c, K.FusedConfig) and c.block_m in (1, 16) for c in decode)
    assert any(c.gemv for c in decode) and not any(c.gemv for c in K.candidate_configs(2, 37888, 3584))
    assert K.DEQUANT_CUBLAS in K.candidate_configs(4096, 3584, 3584)
    # from 256 rows: small groups (q/k/v) dequantised into one buffer, big weights in bounded 32 MB chunks
    assert K.chunked_candidates(128, 37888, 3584) == []
    assert K.chunked_candidates(256, 37888, 3584) == [K.DequantChunks(32)]
    assert K.chunked_candidates(1024, 4608, 3584, group=True) == [K.DequantChunks(0)]
    assert K.chunked_candidates(1024, 37888, 3584, group=True) == [K.DequantChunks(32)]
    assert K.DequantChunks(32).chunk_rows(37888, 3584) == 4608 and K.DequantChunks(0).chunk_rows(4608, 3584) == 4608
    narrow = K.heuristic_config(1, 3584, 18944, num_sms=132)
    assert narrow.split_k > 1  # few output blocks: split K to fill the GPU
    assert K.heuristic_config(1, 37888, 3584, num_sms=132).split_k == 1
    chooser = K.KernelChooser(autotune=False)
    chooser.choices = {
        "H200|bfloat16|16|4608|3584": K.FusedConfig(16, 64, 256, 2),
        "H200|bfloat16|4096|3584|3584": K.DEQUANT_CUBLAS,
    }
    assert chooser.save(tmp_path / "choices.json") == 2
    again = K.KernelChooser(autotune=False)
    again.load(tmp_path / "choices.json")
    assert again.choices == chooser.choices


def test_kernel_choices_saved_for_one_device_merge_into_an_existing_table(tmp_path):
    table = tmp_path / "H100.json"
    first = K.KernelChooser(autotune=False)
    first.choices = {
        "H100|bfloat16|1|4608|3584|x3": K.FusedConfig(16, 64, 256, 2),  # from a 7B run
        "H100|bfloat16|8|3584|3584": K.DEQUANT_CUBLAS,
        "H200|bfloat16|1|4608|3584|x3": K.DequantChunks(32),  # a shipped table of another GPU, loaded at import
    }
    assert first.save(table, device="H100") == 2
    second = K.KernelChooser(autotune=False)
    second.choices = {
        "H100|bfloat16|8|3584|3584": K.DequantChunks(0),  # timed again in a later run: the later run wins
        "H100|bfloat16|1|7168|5120|x3": K.FusedConfig(1, 64, 128, 1),  # from a 32B run
        "H100|bfloat16|1|7168|5120|x3|lanes": K.DEQUANT_CUBLAS,  # the decode window's key (`_twiddled_choice`)
    }
    assert second.save(table, device="H100", merge=True) == 4
    merged = K.KernelChooser(autotune=False)
    merged.load(table)
    assert merged.choices == {
        "H100|bfloat16|1|4608|3584|x3": K.FusedConfig(16, 64, 256, 2),
        "H100|bfloat16|8|3584|3584": K.DequantChunks(0),
        "H100|bfloat16|1|7168|5120|x3": K.FusedConfig(1, 64, 128, 1),
        "H100|bfloat16|1|7168|5120|x3|lanes": K.DEQUANT_CUBLAS,
    }
    assert sorted(path.name for path in tmp_path.iterdir()) == ["H100.json"]  # no partial file left behind
    assert second.save(table, device="H100") == 3  # without merge the file holds this chooser's choices only
    (tmp_path / "notes.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="notes.json is not a kernel-choice table"):
        second.save(tmp_path / "notes.json", merge=True)
    (tmp_path / "broken.json").write_text('{"H100|bf')  # e.g. a copy cut short
    with pytest.raises(ValueError, match="broken.json is not a kernel-choice table"):
        merged.load(tmp_path / "broken.json")


def test_a_one_weight_group_takes_the_single_product_choice(monkeypatch, tmp_path):
    """`choose_group` of one weight shares `choose`'s key: it must ask `choose` and never store a group-only choice
    there (the H100 sweep of 2026-12-06 stored `SEPARATE` under down's key and the next single product crashed), and a
    table that holds one is refused by name."""
    chooser = K.KernelChooser(autotune=False)
    picked = K.FusedConfig(16, 64, 256, 2)
    monkeypatch.setattr(chooser, "choose", lambda x, *weight: picked)
    weight = (torch.empty(8, 16, dtype=torch.uint8), torch.empty(8, 2), torch.ones(()))
    assert chooser.choose_group(torch.empty(1, 32, dtype=torch.bfloat16), [weight]) is picked
    assert chooser.choices == {}
    bad = tmp_path / "old.json"
    bad.write_text(json.dumps({"H100|bfloat16|1|3584|18944": K.SEPARATE, "H100|bfloat16|1|4608|3584|x3": K.SEPARATE}))
    with pytest.raises(ValueError, match=r"old.json: 'H100\|bfloat16\|1\|3584\|18944' holds 'separate products'"):
        K.KernelChooser(autotune=False).load(bad)
    bad.write_text(json.dumps({"H100|bfloat16|1|4608|3584|x3": K.SEPARATE}))  # a group's key may hold it
    group_only = K.KernelChooser(autotune=False)
    group_only.load(bad)
    assert group_only.choices == {"H100|bfloat16|1|4608|3584|x3": K.SEPARATE}


def test_choice_keys_read_back_into_their_fields(monkeypatch):
    """`KernelChooser.key` -> `ChoiceKey.parse` keeps every field (the tables' device filter and
    ``bench_kernels --retune`` read them), and a malformed key is refused by name."""
    monkeypatch.setattr(K, "_device_name", lambda index: "NVIDIA H100 80GB HBM3")  # no GPU asked on CPU
    monkeypatch.setattr(K.nvrtc, "device_index", lambda device: 0)
    rows = torch.empty(5, 3584, dtype=torch.bfloat16, device="meta")
    assert K.ChoiceKey.parse(K.KernelChooser.key(rows, 4608, 3584, group=3)) == K.ChoiceKey(
        "NVIDIA H100 80GB HBM3", "bfloat16", 8, 4608, 3584, 3
    )
    assert K.ChoiceKey.parse(K.KernelChooser.key(rows[:1].half(), 3584, 18944)) == K.ChoiceKey(
        "NVIDIA H100 80GB HBM3", "float16", 1, 3584, 18944, 1
    )
    lora = K.KernelChooser.lora_key(rows, 37888, 3584, group=2, rank=32)
    assert K.ChoiceKey.parse(lora) == K.ChoiceKey("NVIDIA H100 80GB HBM3", "bfloat16", 8, 37888, 3584, 2, 32)
    for window in ("twiddled", "lanes"):  # `_twiddled_choice`'s keys, saved by `bench_rollout --choices`
        windowed = K.ChoiceKey.parse(f"{K.KernelChooser.key(rows, 4608, 3584, group=3)}|{window}")
        assert windowed == K.ChoiceKey("NVIDIA H100 80GB HBM3", "bfloat16", 8, 4608, 3584, 3, 0, window)
    for bad in ("H100|bfloat16|8|4608", "H100|bfloat16|eight|4608|3584", "H100|bfloat16|8|4608|3584|3",
                "H100|bfloat16|8|4608|3584|lora32|x2", "H100|bfloat16|8|4608|3584|lanes|x3",
                "H100|bfloat16|8|4608|3584|swizzled"):  # fmt: skip
        with pytest.raises(ValueError, match="is not a kernel-choice key"):
            K.ChoiceKey.parse(bad)


def test_each_shipped_table_holds_the_choices_of_the_gpu_it_is_named_after():
    """`nvfp4/tuned/<device name, spaces as underscores>.json`: every key names that GPU (a table saved without
    ``device=`` would carry the other shipped tables too) and every entry reads back as a choice."""
    tables = sorted((Path(K.__file__).parent / "tuned").glob("*.json"))
    assert tables
    for table in tables:
        device = table.stem.replace("_", " ")
        entries = json.loads(table.read_text())
        assert entries, table.name
        for key, entry in entries.items():
            assert K.ChoiceKey.parse(key).device == device, (table.name, key)
            K._choice_from_json(entry)
        K.KernelChooser(autotune=False).load(table)  # what import does: no entry `load` refuses


# -- GPU --------------------------------------------------------------------------------------------------------
SHAPES = {  # (N, K) of Qwen2.5-7B projections, fused as vLLM fuses them
    "qkv": (4608, 3584),
    "o": (3584, 3584),
    "gate_up": (37888, 3584),
    "down": (3584, 18944),
}


@needs_cuda
@pytest.mark.parametrize(
    "shape, dtype",
    [(name, torch.bfloat16) for name in sorted(SHAPES)] + [("o", torch.float16), ("down", torch.float16)],
)
@pytest.mark.parametrize("m", [1, 17, 100])
def test_every_candidate_kernel_is_correct(shape, dtype, m):
    n, k = SHAPES[shape]
    quantized = _weight(n, k, seed=m)
    x = torch.randn(m, k, device="cuda").to(dtype)
    expected = _reference(x, quantized)
    for candidate in K.candidate_configs(m, n, k):
        _poison_allocator()
        _check(K.run(x, *quantized, candidate), expected)


@needs_cuda
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("m", [1, 3, 4, 16, 64, 256, 1024])
def test_chosen_kernel_is_correct(shape, m):
    n, k = SHAPES[shape]
    quantized = _weight(n, k, seed=m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    _poison_allocator()
    _check(torch.ops.trl_qerl.nvfp4_linear(x, *quantized), _reference(x, quantized))


@needs_cuda
@pytest.mark.parametrize("m", [1, 8])
def test_a_one_weight_group_then_its_single_product_with_fresh_timing(monkeypatch, m):
    """Timed from scratch, a one-weight `grouped_linear` and then the plain product of the same weight both run and
    match the reference (the sweep of 2026-12-06 crashed on the second: the group had stored `SEPARATE` there)."""
    monkeypatch.setattr(K, "CHOOSER", K.KernelChooser(autotune=True))
    n, k = SHAPES["down"]
    quantized = _weight(n, k, seed=m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    expected = _reference(x, quantized)
    _check(K.grouped_linear(x, [quantized], [None]), expected)
    _check(K.eager_linear(x, *quantized), expected)
    assert K.SEPARATE not in K.CHOOSER.choices.values()


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantize_in_chunks_matches_the_reference(dtype):
    """One weight, and a group whose chunks span two weights (q/k/v-like, biases on two of three), chunk sizes that
    do and do not divide the rows, and one buffer for the whole group."""
    single = [_weight(1000, 1024, seed=1)]
    group = [_weight(n, 1024, seed=n) for n in (700, 200, 200)]
    biases = [torch.randn(700, device="cuda"), None, torch.randn(200, device="cuda")]
    x = torch.randn(300, 1024, device="cuda").to(dtype)
    for chunk in (K.DequantChunks(1), K.DequantChunks(0)):  # 1 MB: 512 rows a chunk
        _poison_allocator()
        _check(K.dequantize_in_chunks(x, single, [None], chunk), _reference(x, single[0]))
        expected = torch.cat(
            [_reference(x, w) + (b.double() if b is not None else 0) for w, b in zip(group, biases)], 1
        )
        _poison_allocator()
        _check(K.dequantize_in_chunks(x, group, biases, chunk), expected)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_inline_ptx_path_equals_pure_triton_path(dtype):
    quantized = _weight(256, 1024, seed=7)
    x = torch.randn(9, 1024, device="cuda").to(dtype)
    config = K.FusedConfig(16, 64, 256, 2)
    fast = K.fused_matmul(x, *quantized, config, use_asm=True)
    plain = K.fused_matmul(x, *quantized, config, use_asm=False)
    assert torch.equal(fast, plain)
    for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert torch.equal(
            K.dequantize_cuda(*quantized, dtype=out_dtype, use_asm=True),
            K.dequantize_cuda(*quantized, dtype=out_dtype, use_asm=False),
        )


@needs_cuda
@pytest.mark.parametrize("m", [1, 100, 2048])
def test_grad_input_matches_reference(m):
    quantized = _weight(4608, 3584, seed=m)
    grad = torch.randn(m, 4608, device="cuda", dtype=torch.bfloat16)
    expected = grad.double() @ dequantize(*quantized, dtype=torch.float64)
    _poison_allocator()
    _check(torch.ops.trl_qerl.nvfp4_grad_input(grad, *quantized), expected)


@needs_cuda
def test_linear_layer_uses_triton_on_cuda_and_trains():
    layer = NVFP4A16Linear.from_linear(torch.nn.Linear(512, 384).cuda()).to(torch.bfloat16)
    assert kernels_for(torch.device("cuda")).name == "triton"
    x = torch.randn(4, 7, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = layer(x)
    out.float().pow(2).sum().backward()
    dense = layer.dequantize_weight(torch.float64)
    _check(out, x.double() @ dense.T + layer.bias.double())
    x_ref = x.detach().double().requires_grad_(True)
    (x_ref @ dense.T + layer.bias.double()).pow(2).sum().backward()
    _check(x.grad, x_ref.grad)


def _mlp():
    torch.manual_seed(0)
    dense = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.SiLU(), torch.nn.Linear(1024, 512))
    return (
        torch.nn.Sequential(NVFP4A16Linear.from_linear(dense[0]), dense[1], NVFP4A16Linear.from_linear(dense[2]))
        .cuda()
        .to(torch.bfloat16)
    )


@needs_cuda
def test_torch_compile_reduce_overhead_matches_eager():
    model = _mlp()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for _ in range(4):
        x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
        # inductor fuses bias + SiLU in fp32 and rounds once, eager rounds after each op: close, not equal
        _check(compiled(x).clone(), model(x).double())


@needs_cuda
def test_cuda_graph_capture_of_a_decode_step():
    model = _mlp()
    static_x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            model(static_x)  # warm-up: picks and caches the kernels
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = model(static_x)
    for _ in range(3):
        static_x.copy_(torch.randn(1, 512, device="cuda", dtype=torch.bfloat16))
        graph.replay()
        assert torch.equal(static_out, model(static_x))


@needs_cuda
def test_compiled_backward_matches_eager():
    model = _mlp()
    compiled = torch.compile(model)
    x = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    model(x).float().sum().backward()
    compiled(x2).float().sum().backward()
    _check(x2.grad, x.grad.double())


@pytest.fixture
def gpu_generation(monkeypatch):
    """Makes the dispatcher see this GPU as another generation: `gpu_generation((8, 0))`. Heuristic kernel choices
    (no timing) keep the tests short."""
    monkeypatch.setattr(K, "_PATH_BY_DEVICE", {})
    monkeypatch.setattr(K, "_BROKEN", set())
    monkeypatch.setattr(K, "CHOOSER", K.KernelChooser(autotune=False))
    return lambda capability: monkeypatch.setattr(K, "device_capability", lambda index: capability)


@needs_cuda
@pytest.mark.parametrize("capability", [(8, 9), (7, 5)], ids=["sm89", "sm75"])
def test_older_gpu_variants_are_correct(gpu_generation, capability):
    """The variants for older GPUs use no Hopper-only instruction, so this GPU runs them too: their results through
    the ops, every fused candidate included, must match the reference with nothing falling back."""
    gpu_generation(capability)
    path = K.device_path(torch.device("cuda"))
    assert path is K.triton_path(capability) and not path.use_asm and not path.fp8_scales
    n, k = 512, 1024
    quantized = _weight(n, k, seed=5)
    for dtype in (torch.bfloat16, torch.float16):
        for m in (1, 9, 100):
            x = torch.randn(m, k, device="cuda").to(dtype)
            _check(torch.ops.trl_qerl.nvfp4_linear(x, *quantized), _reference(x, quantized))
        grad = torch.randn(7, n, device="cuda").to(dtype)
        expected = grad.double() @ dequantize(*quantized, dtype=torch.float64)
        _check(torch.ops.trl_qerl.nvfp4_grad_input(grad, *quantized), expected)
    for m in (1, 17):
        x = torch.randn(m, k, device="cuda", dtype=path.matmul_dtypes[-1])
        for candidate in K.candidate_configs(m, n, k):
            _check(K.run(x, *quantized, candidate), _reference(x, quantized))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert torch.equal(torch.ops.trl_qerl.nvfp4_dequantize(*quantized, dtype), dequantize(*quantized, dtype=dtype))
    assert not K._BROKEN


@needs_cuda
def test_gpu_without_kernels_uses_the_reference(gpu_generation, caplog):
    gpu_generation((7, 0))
    quantized = _weight(64, 256)
    x = torch.randn(5, 256, device="cuda", dtype=torch.bfloat16)
    with caplog.at_level("WARNING", logger=K.logger.name):
        for _ in range(2):
            out = torch.ops.trl_qerl.nvfp4_linear(x, *quantized)
    assert torch.equal(out, torch.nn.functional.linear(x, dequantize(*quantized, dtype=x.dtype)))
    assert len(caplog.records) == 1 and "sm_70" in caplog.records[0].getMessage()


@needs_cuda
def test_compile_error_on_gpu_falls_back_to_the_reference(gpu_generation, monkeypatch, caplog):
    gpu_generation((9, 0))

    def broken(*args, **kwargs):
        raise K.triton.runtime.errors.OutOfResources(1 << 18, 1 << 16, "shared memory")

    monkeypatch.setattr(K, "run", broken)
    quantized = _weight(64, 256)
    x = torch.randn(5, 256, device="cuda", dtype=torch.bfloat16)
    with caplog.at_level("WARNING", logger=K.logger.name):
        for _ in range(2):
            _check(torch.ops.trl_qerl.nvfp4_linear(x, *quantized), _reference(x, quantized))
    assert len(caplog.records) == 1 and "OutOfResources" in caplog.records[0].getMessage()


def test_the_chooser_says_once_why_the_first_steps_of_a_new_shape_are_slow(caplog):
    """Timing the candidates of keys the table lacks can take a minute or more (80 s at 3B on the H200): one info line
    per process names the first key and the settings that keep or skip the timing, then a debug line per key."""
    import logging

    chooser = K.KernelChooser(autotune=True)
    keys = ("NVIDIA H200|bfloat16|8|4608|3584|x3", "NVIDIA H200|bfloat16|8|3584|3584")
    with caplog.at_level(logging.DEBUG, logger=K.logger.name):
        for key in keys:
            chooser._note_timing(key)
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1 and keys[0] in infos[0]
    assert "NVFP4_KERNEL_CHOICES" in infos[0] and "NVFP4_AUTOTUNE=0" in infos[0]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG] == [
        f"NVFP4: timing kernel candidates for {key}" for key in keys
    ]


def test_choose_with_lora_times_the_epilogue_where_the_plain_choice_cannot_take_it(monkeypatch):
    """`KernelChooser.choose_with_lora` with this call's LoRA inputs: a plain choice that cannot take the epilogue
    (here the tiled kernel) is timed against the decode kernel with the terms in it (`_fastest_with_lora`, stubbed:
    no GPU here); the winner is kept under the `lora_key` (`PLAIN_WITH_TERMS_AFTER` for the plain one), so the key
    is not timed again. Without the inputs, while capturing or with autotuning off: the plain
    choice, untimed; a plain decode-kernel choice is returned as before. In the decode window (`twiddle.active`) the
    timed choice has the window's key, as the plain choices there."""
    monkeypatch.setattr(K, "_device_name", lambda index: "NVIDIA H100 80GB HBM3")  # no GPU asked on CPU
    monkeypatch.setattr(K.nvrtc, "device_index", lambda device: 0)
    monkeypatch.setattr(K.torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(K.twiddle, "active", lambda: False)
    x = torch.empty(16, 5120, dtype=torch.bfloat16, device="meta")
    weights = [(torch.empty(n, 2560, dtype=torch.uint8, device="meta"), None, None) for n in (5120, 1024, 1024)]
    tiled, decode = K.TileConfig(2, 2, 4, 6), K.MMAConfig(2, 1, 4)
    plain = {"choice": tiled}
    monkeypatch.setattr(K, "chosen", lambda x, weights: plain["choice"])
    timed = []

    def fastest(self, x, weights, lora, key):
        timed.append(key)
        return winner

    monkeypatch.setattr(K.KernelChooser, "_fastest_with_lora", fastest)
    lora = object()  # only passed through to the stubbed timing
    key = K.KernelChooser.lora_key(x, 7168, 5120, 3, 32)

    chooser, winner = K.KernelChooser(autotune=True), decode
    assert chooser.choose_with_lora(x, weights, 32) == tiled  # no inputs: nothing timed
    assert chooser.choose_with_lora(x, weights, 32, lora) == decode and chooser.choices[key] == decode
    assert chooser.choose_with_lora(x, weights, 32, lora) == decode and timed == [key]

    chooser, winner = K.KernelChooser(autotune=True), K.PLAIN_WITH_TERMS_AFTER
    assert chooser.choose_with_lora(x, weights, 32, lora) == tiled
    assert chooser.choose_with_lora(x, weights, 32, lora) == tiled and timed == [key, key]
    assert chooser.choices[key] == K.PLAIN_WITH_TERMS_AFTER

    chooser, winner = K.KernelChooser(autotune=False), decode
    assert chooser.choose_with_lora(x, weights, 32, lora) == tiled and timed == [key, key]
    chooser = K.KernelChooser(autotune=True)
    monkeypatch.setattr(K.twiddle, "active", lambda: True)  # the decode window: keys of its own, as plain choices
    monkeypatch.setattr(K.twiddle, "lane_order", lambda: True)
    assert chooser.choose_with_lora(x, weights, 32, lora) == decode and timed == [key, key, f"{key}|lanes"]
    assert chooser.choices[f"{key}|lanes"] == decode and key not in chooser.choices
    assert K.ChoiceKey.parse(f"{key}|lanes").window == "lanes"
    monkeypatch.setattr(K.twiddle, "active", lambda: False)
    chooser = K.KernelChooser(autotune=True)
    monkeypatch.setattr(K.torch.cuda, "is_current_stream_capturing", lambda: True)
    assert chooser.choose_with_lora(x, weights, 32, lora) == tiled and len(timed) == 3
    plain["choice"] = K.MMAConfig(1, 1, 4)
    assert chooser.choose_with_lora(x, weights, 32, lora) == K.MMAConfig(1, 1, 4) and len(timed) == 3
    plain["choice"] = tiled
    monkeypatch.setattr(K.torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(K, "TIME_WITH_LORA", False)
    assert chooser.choose_with_lora(x, weights, 32, lora) == tiled and len(timed) == 3
