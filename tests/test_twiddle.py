"""The twiddled bit order of the packed codes (`trl_qerl.nvfp4.twiddle`, an experiment) and the CUDA decode kernel
built to read it (``-DNVFP4_TWIDDLED=1``).

Without a GPU: the permutation round-trips; the kernel's decode formulas, emulated here and read from its source,
turn twiddled words into the bf16 and fp16 bit patterns of the pairs (c_{2i}, c_{2i+1}); the sm_90 build's main
loop has fewer instructions and no activation permutes. On a GPU: the twiddled build with twiddled codes against the
float64 reference of the standard codes, with and without LoRA terms, bf16 and fp16.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _cuda_cases import TOLERANCE, needs_nvrtc, poisoned_out, quantized, reference
from _sass import cuobjdump, main_loop

from trl_qerl.nvfp4 import cuda_mma, nvrtc, twiddle
from trl_qerl.nvfp4.format import relative_error


TWIDDLED = ("-DNVFP4_TWIDDLED=1",)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _rotate_right(words: torch.Tensor, r: int) -> torch.Tensor:
    return ((words >> r) | (words << (32 - r))) & 0xFFFFFFFF if r else words


def _decode(words: torch.Tensor, table) -> torch.Tensor:
    out = torch.zeros_like(words)
    for r, mask in table:
        out |= _rotate_right(words, r) & mask
    return out


def _kernel_tables(bf16: bool) -> list[list[tuple[int, int]]]:
    """The (rotation, mask) pairs of the kernel's twiddled ``decode_word``, read from its source."""
    source = cuda_mma.SOURCE_PATHS[0].read_text()
    block = source.split("#if NVFP4_TWIDDLED\n  if (BF16) {")[1].split("#else")[0]
    branch = block.split("} else {")[0 if bf16 else 1]
    constants = dict(re.findall(r"\b(\w) = (0x[0-9A-F]+)u", branch))

    def value(mask: str) -> int:
        return int(constants.get(mask, mask.rstrip("u")), 16)

    tables = []
    for line in re.findall(r"p\[\d\] = ([^;]+);", branch):
        rotated = [(int(r), value(mask)) for r, mask in re.findall(r"rotate_right\(q, (\d+)\) & (\w+)", line)]
        tables.append([(0, value(mask)) for mask in re.findall(r"\bq & (\w+)", line)] + rotated)
    return tables


def _codes(words: torch.Tensor, column: int) -> torch.Tensor:
    return (words >> (4 * column)) & 0xF


@pytest.mark.parametrize("shape", [(1, 4), (3, 16), (17, 1792)])
def test_twiddle_round_trips(shape):
    packed = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    twiddled = twiddle.twiddle(packed)
    assert twiddled.shape == packed.shape and twiddled.dtype == torch.uint8
    assert not torch.equal(twiddled, packed)
    assert torch.equal(twiddle.untwiddle(twiddled), packed)


def test_positions_are_a_permutation():
    assert sorted(4 * code + bit for code, bit in twiddle.POSITIONS) == list(range(32))


def test_twiddle_rejects_what_is_not_whole_words():
    with pytest.raises(ValueError, match="multiple of 4"):
        twiddle.twiddle(torch.zeros(2, 6, dtype=torch.uint8))


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp16"])
def test_kernel_decode_gives_the_column_pairs(bf16):
    """Every byte pattern in every position: the kernel's formulas on twiddled words give (c_{2i}, c_{2i+1}) with
    the sign at bit 15 and the magnitude at bits 8..6 (bf16) or 11..9 (fp16) of each half."""
    packed = torch.randint(0, 256, (4096, 4), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    standard = packed.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    twiddled = twiddle.twiddle(packed).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    shift = 6 if bf16 else 9
    tables = _kernel_tables(bf16)
    assert len(tables) == 4
    if bf16:
        assert [tuple(t) for t in tables] == list(twiddle.BF16_DECODE)
    for i, table in enumerate(tables):

        def half(code):
            return ((code & 8) << 12) | ((code & 7) << shift)

        expected = half(_codes(standard, 2 * i)) | (half(_codes(standard, 2 * i + 1)) << 16)
        assert torch.equal(_decode(twiddled, table), expected), f"pair {i}"


@needs_nvrtc
@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump (Triton bundles one)")
@pytest.mark.parametrize("config", [cuda_mma.MMAConfig(1, 1, 4), cuda_mma.MMAConfig(2, 1, 4)], ids=str)
def test_twiddled_main_loop_is_shorter(tmp_path, config):
    """sm_90 SASS of the main loop: ~6 instructions fewer per word decoded, and no PRMT for the activations."""

    def loop(options):
        cubin, _ = nvrtc.compile_cubin(cuda_mma.source(), config.name_expression(torch.bfloat16), "sm_90", options)
        (tmp_path / "k.cubin").write_bytes(cubin)
        sass = subprocess.run([cuobjdump(), "-sass", str(tmp_path / "k.cubin")], capture_output=True, text=True)
        return main_loop(sass.stdout)

    standard, twiddled = loop(()), loop(TWIDDLED)
    words = 2 * 4 * 2 * config.m_tiles  # two blocks per iteration, 4 words per row, rows g and g + 8
    assert sum(op.startswith("HMMA") for op in twiddled) == sum(op.startswith("HMMA") for op in standard)
    assert not any(op.startswith("PRMT") for op in twiddled)
    assert len(standard) - len(twiddled) >= 4 * words, (len(standard), len(twiddled))


# -- on a GPU -----------------------------------------------------------------------------------------------------
def _twiddled(weights):
    return [(twiddle.twiddle(packed), scale, global_scale) for packed, scale, global_scale in weights]


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m", [1, 5, 8, 16])
def test_twiddled_build_matches_the_reference(dtype, m):
    generator = torch.Generator().manual_seed(m)
    weights = [quantized(n, 352, generator) for n in (48, 16, 16)]
    x = torch.randn(m, 352, generator=generator).to("cuda", dtype)
    expected = reference(x, weights, [None] * 3)
    for config in cuda_mma.candidate_configs(m, 80, 352):
        out = cuda_mma.matmul(x, _twiddled(weights), config, out=poisoned_out(m, 80, dtype), options=TWIDDLED)
        assert torch.isfinite(out).all(), str(config)
        assert relative_error(expected, out) < TOLERANCE, str(config)


@needs_cuda
@pytest.mark.parametrize("m", [1, 8])
def test_twiddled_build_adds_lora_terms(m):
    generator = torch.Generator().manual_seed(10 + m)
    weights = [quantized(n, 512, generator) for n in (64, 32)]
    lora_b = [(torch.randn(n, 32, generator=generator) * 0.1).cuda() for n in (64, 32)]
    x = torch.randn(m, 512, generator=generator).to("cuda", torch.bfloat16)
    hidden = torch.randn(m, 64, generator=generator).cuda()
    lora = cuda_mma.LoraInputs(hidden, lora_b, [2.0, 0.5])
    config = cuda_mma.MMAConfig(1, 1, 4)
    standard = cuda_mma.matmul(x, weights, config, lora=lora).double()
    ours = cuda_mma.matmul(x, _twiddled(weights), config, lora=lora, options=TWIDDLED)
    assert relative_error(standard, ours) < TOLERANCE


# -- the +twiddle engine of bench_rollout.py ---------------------------------------------------------------------
def _twiddled_engine(model):
    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    from bench_rollout import TwiddledDecode

    return TwiddledDecode(model, cuda_graph=False, engine="model", compile=False)


def _nvfp4_model():
    from _tiny import tiny_model

    from trl_qerl.quantizer import quantize_model

    return quantize_model(tiny_model("qwen2", dtype=torch.float32))


def test_engine_twiddles_codes_only_inside_its_decode_window():
    """In place (same storage), restored on leaving, also on an error; the decode kernel's builds take the twiddled
    switch only inside."""
    model = _nvfp4_model()
    engine = _twiddled_engine(model)
    codes = engine.codes()
    assert codes
    standard = [packed.clone() for packed in codes]
    pointers = [packed.data_ptr() for packed in codes]
    with engine.decode_window():
        assert all(torch.equal(packed, twiddle.twiddle(before)) for packed, before in zip(codes, standard))
        assert cuda_mma.EXTRA_BUILD_OPTIONS == TWIDDLED
    assert cuda_mma.EXTRA_BUILD_OPTIONS == ()
    with pytest.raises(RuntimeError, match="inside"):
        with engine.decode_window():
            raise RuntimeError("inside")
    assert [packed.data_ptr() for packed in codes] == pointers
    assert all(torch.equal(packed, before) for packed, before in zip(codes, standard))
    assert cuda_mma.EXTRA_BUILD_OPTIONS == ()


def test_engine_leaves_the_standard_codes_after_a_rollout_and_refuses_wide_batches():
    from trl_qerl.rollout.fast import SamplingParams

    model = _nvfp4_model()
    engine = _twiddled_engine(model)
    standard = [packed.clone() for packed in engine.codes()]
    engine.generate([[3, 4, 5], [6, 7]], SamplingParams(max_new_tokens=3), eos_token_ids=[1], pad_token_id=0)
    assert all(torch.equal(packed, before) for packed, before in zip(engine.codes(), standard))
    with pytest.raises(SystemExit, match="at most"):
        engine.generate([[3]] * (engine.MAX_ROWS + 1), SamplingParams(max_new_tokens=2), [1], 0)
    engine.set_twiddled(False)  # the standard arm of the engine's A/B takes any batch
    engine.generate([[3]] * (engine.MAX_ROWS + 1), SamplingParams(max_new_tokens=2), [1], 0)


def test_engine_restores_the_codes_it_twiddled_when_twiddling_fails(monkeypatch):
    model = _nvfp4_model()
    engine = _twiddled_engine(model)
    standard = [packed.clone() for packed in engine.codes()]
    calls = []

    def fails_on_the_second(packed):
        calls.append(packed)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return real(packed)

    real = twiddle.twiddle
    monkeypatch.setattr(twiddle, "twiddle", fails_on_the_second)
    with pytest.raises(RuntimeError, match="out of memory"):
        with engine.decode_window():
            pass
    assert all(torch.equal(packed, before) for packed, before in zip(engine.codes(), standard))
