"""The twiddled bit order of the packed codes (`trl_qerl.nvfp4.twiddle`, an experiment) and the CUDA decode kernel
built to read it (``-DNVFP4_TWIDDLED=1``).

Without a GPU: the permutation round-trips; the kernel's decode formulas, emulated here and read from its source,
turn twiddled words into the bf16 and fp16 bit patterns of the pairs (c_{2i}, c_{2i+1}); the sm_90 build's main
loop has fewer instructions and no activation permutes. On a GPU: the twiddled build with twiddled codes against the
float64 reference of the standard codes, with and without LoRA terms, bf16 and fp16.

The lane order (`twiddle.to_lane_order`, kernels built with ``-DNVFP4_TWIDDLED=2``): round trips, what each lane
decodes from its word (emulated with the kernel's formulas), the Triton pass, the window in that order, the sm_90a main
loops (wgmma shorter, decode kernel as long as in the twiddled order); on a GPU the decode and tiled kernels against
the reference and, on an H100/H200, the wgmma build's outputs equal to the shipped build's bit for bit, and the
engine's greedy tokens.

The window (`twiddle.twiddled_codes`): the in-place pass (Triton, against the torch permutation), restoring on
leaving and on errors, standard-order readers refusing twiddled codes; the fast rollout engine's use of it, its
fallback, and on a GPU its greedy tokens against the standard order.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _cuda_cases import TOLERANCE, needs_nvrtc, poisoned_out, quantized, reference
from _sass import cuobjdump, main_loop, resources_of, sass_of

from trl_qerl.nvfp4 import cuda_mma, nvrtc, twiddle
from trl_qerl.nvfp4.cuda_wgmma import WgmmaConfig
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
    """The (rotation, mask) pairs of the kernel's ``twiddled_pair`` (what the twiddled ``decode_word`` and the lane
    order's decode compute), read from its source."""
    source = cuda_mma.SOURCE_PATHS[0].read_text()
    body = source.split("u32 twiddled_pair(u32 q, int i) {")[1].split("\n}\n")[0]
    bf16_branch, fp16_branch = body.split("if (BF16) {")[1].split("\n  }\n")
    branch = bf16_branch if bf16 else fp16_branch
    constants = dict(re.findall(r"\b(\w) = (0x[0-9A-F]+)u", branch))

    def value(mask: str) -> int:
        return int(constants.get(mask, mask.rstrip("u")), 16)

    tables = []
    for line in re.findall(r"return ([^;]+);", branch):
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
def _twiddled(weights, lanes: bool = False):
    """``weights`` with their codes in the twiddled order (``lanes``: the lane order)."""
    reorder = twiddle.to_lane_order if lanes else twiddle.twiddle
    return [(reorder(packed), scale, global_scale) for packed, scale, global_scale in weights]


ORDERS = pytest.mark.parametrize("lanes", [False, True], ids=["twiddled", "lane_order"])


@needs_cuda
@ORDERS
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m", [1, 5, 8, 16, 32])
def test_twiddled_build_matches_the_reference(dtype, m, lanes):
    """Inside the window (here with no codes of its own, only the switch) every decode-kernel instance on reordered
    codes gives the float64 reference of the standard codes, in either order; K = 352 leaves a partial last block."""
    generator = torch.Generator().manual_seed(m)
    weights = [quantized(n, 352, generator) for n in (48, 16, 16)]
    x = torch.randn(m, 352, generator=generator).to("cuda", dtype)
    expected = reference(x, weights, [None] * 3)
    with twiddle.twiddled_codes([], lanes=lanes):
        for config in cuda_mma.candidate_configs(m, 80, 352):
            out = cuda_mma.matmul(x, _twiddled(weights, lanes), config, out=poisoned_out(m, 80, dtype))
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


@needs_cuda
@ORDERS
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m", [16, 32])
def test_twiddled_tiled_kernel_matches_the_reference(m, dtype, lanes):
    """The tiled kernel shares the decode kernel's decode: inside the window (here with no codes of its own, only the
    switch) its builds read twiddled (or lane-ordered) codes, also with K split."""
    generator = torch.Generator().manual_seed(20 + m)
    weights = [quantized(n, 512, generator) for n in (128, 64)]
    x = torch.randn(m, 512, generator=generator).to("cuda", dtype)
    expected = reference(x, weights, [None] * 2)
    twiddled = _twiddled(weights, lanes)
    configs = cuda_mma.tile_candidate_configs(m, 192, 512, 132, 227 * 1024)[:6]
    configs.append(cuda_mma.TileConfig(1, 2, 4, 2, split_k=2))
    with twiddle.twiddled_codes([], lanes=lanes):
        for config in configs:
            out = cuda_mma.tile_matmul(x, twiddled, config, out=poisoned_out(m, 192, dtype))
            assert relative_error(expected, out) < TOLERANCE, str(config)


# -- the lane order (the wgmma kernel, ``-DNVFP4_TWIDDLED=2``) -------------------------------------------------------
LANE_CONFIGS = [WgmmaConfig(2, 1, 64, 4), WgmmaConfig(2, 2, 64, 4), WgmmaConfig(2, 1, 128, 5)]
needs_hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="needs a compute capability 9.0 GPU (H100/H200)",
)


@pytest.mark.parametrize("shape", [(1, 16), (3, 48), (17, 1792)])
def test_lane_order_round_trips(shape):
    packed = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    transposed = twiddle.transpose_chunks(packed)
    assert not torch.equal(transposed, packed) and torch.equal(twiddle.transpose_chunks(transposed), packed)
    lane = twiddle.to_lane_order(packed)
    assert lane.shape == packed.shape and lane.dtype == torch.uint8
    assert torch.equal(twiddle.from_lane_order(lane), packed)
    with pytest.raises(ValueError, match="multiple of 16"):
        twiddle.to_lane_order(torch.zeros(2, 8, dtype=torch.uint8))


def test_lane_order_gives_each_lane_its_fragment_pairs():
    """What the wgmma build's lane t does with chunk c of a row (its 4-byte word t, decoded by the kernel's
    ``twiddled_pair``, read from its source) gives the bf16 pairs of columns (2t, 2t+1), (2t+8, 2t+9) of step 2c and
    the same of step 2c + 1 (wgmma's A fragment), for every lane, chunk and byte value. In the chunk's pair numbering:
    position i of word t is pair 4i + t, which is how the decode and tiled kernels pair it with the activations."""
    packed = torch.randint(0, 256, (512, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    words = twiddle.to_lane_order(packed).view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [row, chunk * 4 + t]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(1).to(torch.int64)  # [row, column]

    def half(code):
        return ((code & 8) << 12) | ((code & 7) << 6)

    tables = _kernel_tables(bf16=True)
    for c in range(packed.shape[1] // 16):
        for t in range(4):
            word = words[:, 4 * c + t]
            columns = [32 * c + 2 * t, 32 * c + 2 * t + 8, 32 * c + 16 + 2 * t, 32 * c + 24 + 2 * t]
            for pair, (table, first) in enumerate(zip(tables, columns)):
                expected = half(codes[:, first]) | (half(codes[:, first + 1]) << 16)
                assert torch.equal(_decode(word, table), expected), (c, t, pair)


def test_the_lane_window_holds_the_lane_order_and_restores():
    """``twiddled_codes(..., lanes=True)``: the codes in the lane order inside, the wgmma kernel among the readers and
    the lane build for every CUDA kernel; standard codes, no flags and no lane order after."""
    from trl_qerl.nvfp4 import kernels

    codes = [_random_codes(columns=32, seed=seed) for seed in range(2)]
    standard = [packed.clone() for packed in codes]
    with twiddle.twiddled_codes(codes, lanes=True):
        assert twiddle.active() and twiddle.lane_order()
        assert twiddle.window_build() == twiddle.LANE_ORDER_BUILD
        assert kernels.window_readers() == kernels.LANE_ORDER_READERS
        assert all(torch.equal(packed, twiddle.to_lane_order(before)) for packed, before in zip(codes, standard))
    assert not twiddle.lane_order() and twiddle.window_build() == ()
    assert all(torch.equal(packed, before) for packed, before in zip(codes, standard))
    with twiddle.twiddled_codes(codes):
        assert not twiddle.lane_order() and twiddle.window_build() == twiddle.TWIDDLED_BUILD
        assert kernels.window_readers() == kernels.TWIDDLED_READERS
    with pytest.raises(ValueError, match="multiple of 16"):
        with twiddle.twiddled_codes([_random_codes(columns=24)], lanes=True):
            pass
    assert not twiddle.active()


def test_the_wgmma_kernel_refuses_the_twiddled_order():
    """Inside a twiddled-order window the wgmma kernel refuses before launching (its decode takes the natural or the
    lane order only); `kernels.run` routes a wgmma choice to it."""
    from trl_qerl.nvfp4 import cuda_wgmma

    generator = torch.Generator().manual_seed(5)
    weights = [quantized(64, 128, generator, device="cpu")]
    x = torch.randn(64, 128, generator=generator)
    with twiddle.twiddled_codes([]):
        with pytest.raises(twiddle.TwiddledCodesError, match="the wgmma kernel reads .* twiddled order now"):
            cuda_wgmma.wgmma_matmul(x, weights, WgmmaConfig(2, 1, 64, 4))


@pytest.mark.parametrize(
    "engine, lanes",
    [("fused+compile+split_kv+twiddle+lane_order", True), ("fused+compile+split_kv+twiddle+lane_order+shrink_beside", True),
     ("fused+compile+split_kv+twiddle", False), ("default", True)],
)  # fmt: skip
def test_rollout_benchmark_engines_name_the_code_order(engine, lanes):
    """`bench_rollout.py`'s named engines set `fast.LANE_ORDER` themselves (``+lane_order`` on, ``+twiddle`` alone
    the twiddled order it measured before the lane order became the default), ``default`` keeps the shipped setting
    (on); the shrink beside likewise (on only in ``+shrink_beside`` engines and ``default``); the shipped settings are
    back after each."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    from bench_rollout import ENGINES, engine_environment

    from trl_qerl.rollout import fast, fused_decode

    assert fast.LANE_ORDER is True and fused_decode.LORA_SHRINK_BESIDE
    assert engine == "default" or ENGINES[engine]["twiddled_decode"]
    with engine_environment(engine):
        assert fast.LANE_ORDER is lanes
        assert fused_decode.LORA_SHRINK_BESIDE is (engine == "default" or engine.endswith("+shrink_beside"))
    assert fast.LANE_ORDER is True and fused_decode.LORA_SHRINK_BESIDE


def test_permute_in_place_to_the_lane_order_round_trips():
    packed = _random_codes(columns=32)
    before = packed.clone()
    assert twiddle.permute_(packed, lanes=True) is packed
    assert torch.equal(packed, twiddle.to_lane_order(before))
    twiddle.permute_(packed, inverse=True, lanes=True)
    assert torch.equal(packed, before)
    with pytest.raises(ValueError, match="multiple of 16"):
        twiddle.permute_(_random_codes(columns=24), lanes=True)


@needs_nvrtc
@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump (Triton bundles one)")
@pytest.mark.parametrize("config", LANE_CONFIGS, ids=str)
def test_lane_order_wgmma_main_loop_is_shorter(tmp_path, config):
    """sm_90a SASS of the wgmma kernel's main loop in the lane order: the same HGMMAs and shared-memory reads, no PRMT,
    no local memory, no more registers, and at least 15 % fewer instructions (2026-12-05, NVRTC 13.5 / the GPU image's
    13.0: 423 -> 307 / 328 for ``128r x 64t``, 679 / 686 -> 471 / 478 for ``256r x 64t``)."""

    def build(options):
        cubin, _ = nvrtc.compile_cubin(cuda_mma.source(), config.name_expression(torch.bfloat16), "sm_90a", options)
        return main_loop(sass_of(cubin, tmp_path), mma="HGMMA"), resources_of(cubin, tmp_path)

    (natural, natural_resources), (lane, resources) = build(()), build(twiddle.LANE_ORDER_BUILD)
    for opcode in ("HGMMA", "LDS"):
        assert sum(op.startswith(opcode) for op in lane) == sum(op.startswith(opcode) for op in natural), opcode
    assert not any(op.startswith("PRMT") for op in lane)
    assert resources["STACK"] == 0 and resources["LOCAL"] == 0
    assert resources["REG"] <= natural_resources["REG"]
    assert len(lane) <= 0.85 * len(natural), (len(natural), len(lane))


@needs_nvrtc
@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump (Triton bundles one)")
@pytest.mark.parametrize("config", [cuda_mma.MMAConfig(1, 1, 4), cuda_mma.MMAConfig(2, 1, 4)], ids=str)
def test_decode_kernel_main_loop_in_the_lane_order_is_the_twiddled_ones(tmp_path, config):
    """The decode kernel's LoRA build (what the engine launches) reads the lane order with the twiddled order's main
    loop: the same MMAs, no PRMT, within 2 % of its instructions and 8 registers (2026-12-05: equal counts)."""

    def build(options):
        name = config.name_expression(torch.bfloat16, lora_rank=32)
        cubin, _ = nvrtc.compile_cubin(cuda_mma.source(), name, "sm_90", options)
        return main_loop(sass_of(cubin, tmp_path)), resources_of(cubin, tmp_path)

    (twiddled, twiddled_resources), (lane, resources) = build(TWIDDLED), build(twiddle.LANE_ORDER_BUILD)
    assert sum(op.startswith("HMMA") for op in lane) == sum(op.startswith("HMMA") for op in twiddled)
    assert not any(op.startswith("PRMT") for op in lane)
    assert abs(len(lane) - len(twiddled)) <= 0.02 * len(twiddled), (len(twiddled), len(lane))
    assert resources["LOCAL"] == 0 and resources["REG"] <= twiddled_resources["REG"] + 8


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m", [64, 100, 257])
def test_lane_order_wgmma_gives_the_natural_orders_bits(dtype, m):
    """Every wgmma candidate and a few more instances (K split, one warpgroup, 256 tokens): the lane-order build on
    lane-ordered codes multiplies the same A values in the same order as the shipped build on standard codes, so the
    outputs are equal bit for bit (and within tolerance of the float64 reference); q/k/v-like weights in one launch,
    rows not multiples of a tile, one bias missing."""
    from trl_qerl.nvfp4 import cuda_wgmma

    generator = torch.Generator().manual_seed(30 + m)
    rows, k = (200, 64, 64), 1024
    weights = [quantized(n, k, generator) for n in rows]
    biases = [(torch.randn(n, generator=generator) * 0.1).to("cuda", dtype) for n in rows[:2]] + [None]
    x = torch.randn(m, k, generator=generator).to("cuda", dtype)
    expected = reference(x, weights, biases)
    lane = _twiddled(weights, lanes=True)
    configs = cuda_wgmma.wgmma_candidate_configs(m, sum(rows), k) + [
        WgmmaConfig(1, 1, 64, 3), WgmmaConfig(2, 2, 64, 3, split_k=3), WgmmaConfig(1, 1, 256, 3, split_k=2),
    ]  # fmt: skip
    for config in configs:
        natural = cuda_wgmma.wgmma_matmul(x, weights, config, biases, out=poisoned_out(m, sum(rows), dtype))
        ours = cuda_wgmma.wgmma_matmul(x, lane, config, biases, out=poisoned_out(m, sum(rows), dtype),
                                       options=twiddle.LANE_ORDER_BUILD)  # fmt: skip
        assert torch.equal(ours, natural), str(config)
        assert relative_error(expected, ours) < TOLERANCE, str(config)


# -- the in-place pass and the window ----------------------------------------------------------------------------
def _random_codes(rows=33, columns=24, seed=0):
    return torch.randint(0, 256, (rows, columns), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@ORDERS
@pytest.mark.parametrize("inverse", [False, True], ids=["in", "out"])
def test_the_triton_pass_permutes_as_the_reference(inverse, lanes):
    """Triton's pass (the interpreter here, compiled on a GPU) over 12 rotation groups equals `twiddle`/`untwiddle`
    (with ``lanes``: `to_lane_order` / `from_lane_order`), in place; more words than one program's block, and a ragged
    last block."""
    from trl_qerl.nvfp4._twiddle_kernel import BLOCK, permute_bits_, permute_lanes_

    device = "cuda" if torch.cuda.is_available() else "cpu"
    packed = _random_codes(rows=BLOCK // 4 + 3, columns=48 if lanes else 20).to(device)
    if lanes:
        expected = (twiddle.from_lane_order if inverse else twiddle.to_lane_order)(packed.cpu())
    else:
        expected = (twiddle.untwiddle if inverse else twiddle.twiddle)(packed.cpu())
    pointer = packed.data_ptr()
    sources = twiddle._untwiddle_sources() if inverse else twiddle._twiddle_sources()
    assert len(twiddle._rotation_groups(sources)) == 12
    if lanes:
        permute_lanes_(packed.view(torch.int32), twiddle._rotation_groups(sources), inverse)
    else:
        permute_bits_(packed.view(torch.int32), twiddle._rotation_groups(sources))
    assert packed.data_ptr() == pointer
    assert torch.equal(packed.cpu(), expected)
    with pytest.raises(ValueError, match="16-byte chunks"):
        permute_lanes_(torch.zeros(6, dtype=torch.int32), twiddle._rotation_groups(sources), inverse)


def test_permute_in_place_round_trips():
    packed = _random_codes()
    before, pointer = packed.clone(), packed.data_ptr()
    assert twiddle.permute_(packed) is packed and packed.data_ptr() == pointer
    assert torch.equal(packed, twiddle.twiddle(before))
    twiddle.permute_(packed, inverse=True)
    assert torch.equal(packed, before)
    with pytest.raises(ValueError, match="contiguous"):
        twiddle.permute_(_random_codes(columns=8).t())
    with pytest.raises(ValueError, match="multiple of 4"):
        twiddle.permute_(torch.zeros(2, 6, dtype=torch.uint8))


def test_the_window_twiddles_in_place_and_restores_on_leaving_and_on_errors():
    codes = [_random_codes(seed=seed) for seed in range(3)]
    standard = [packed.clone() for packed in codes]
    assert not twiddle.active()
    with twiddle.twiddled_codes(codes):
        assert twiddle.active()
        assert all(torch.equal(packed, twiddle.twiddle(before)) for packed, before in zip(codes, standard))
        with pytest.raises(RuntimeError, match="reentrant"):
            with twiddle.twiddled_codes(codes):
                pass
        assert twiddle.active()  # (the refused inner window changed nothing)
    assert not twiddle.active()
    assert all(torch.equal(packed, before) for packed, before in zip(codes, standard))
    with pytest.raises(KeyError, match="inside"):
        with twiddle.twiddled_codes(codes):
            raise KeyError("inside")
    assert not twiddle.active()
    assert all(torch.equal(packed, before) for packed, before in zip(codes, standard))


def test_the_window_restores_the_codes_it_twiddled_when_twiddling_fails(monkeypatch):
    codes = [_random_codes(seed=seed) for seed in range(3)]
    standard = [packed.clone() for packed in codes]
    real, calls = twiddle.permute_, []

    def fails_on_the_second(packed, inverse=False, lanes=False):
        calls.append(inverse)
        if calls.count(False) == 2 and not inverse:
            raise RuntimeError("out of memory")
        return real(packed, inverse, lanes)

    monkeypatch.setattr(twiddle, "permute_", fails_on_the_second)
    with pytest.raises(RuntimeError, match="out of memory"):
        with twiddle.twiddled_codes(codes):
            pass
    assert calls == [False, False, True]  # the first restored, the second never changed, the third never reached
    assert not twiddle.active()
    assert all(torch.equal(packed, before) for packed, before in zip(codes, standard))


def test_standard_order_readers_refuse_twiddled_codes():
    """Inside the window, dequantisation (Triton or torch), the reference kernels and any product the CUDA decode
    kernel does not serve raise instead of reading permuted bits as if they were standard."""
    from trl_qerl.nvfp4 import dispatch, kernels

    generator = torch.Generator().manual_seed(3)
    packed, scale, global_scale = quantized(32, 64, generator, device="cpu")
    x = torch.randn(2, 64, generator=generator)
    with twiddle.twiddled_codes([packed]):
        for read in (
            lambda: kernels._dense(packed, scale, global_scale, torch.float32),
            lambda: dispatch.REFERENCE_KERNELS.linear(x, packed, scale, global_scale),
            lambda: dispatch.REFERENCE_KERNELS.grad_input(x[:, :32], packed, scale, global_scale),
            lambda: kernels.CHOOSER._twiddled_choice(x, [(packed, scale, global_scale)], "key"),  # (no decode kernel)
            lambda: kernels.run(x, packed, scale, global_scale, kernels.DEQUANT_CUBLAS),
        ):
            with pytest.raises(twiddle.TwiddledCodesError, match="standard order"):
                read()
    kernels._dense(packed, scale, global_scale, torch.float32)  # outside: reads as before


def test_captured_passes_apply_only_on_one_cuda_device():
    """`CAPTURE_PASSES` on CPU tensors (or fewer than two) changes nothing: the launches one by one."""
    assert twiddle._captured_passes([_random_codes(), _random_codes(seed=1)], inverse=False) is None


@needs_cuda
def test_captured_passes_permute_and_restore_as_the_launches_do(monkeypatch):
    """With `CAPTURE_PASSES`, each direction is one graph replay (captured on the first window, replayed by the next)
    and gives what `twiddle` gives; the codes are standard again after each window."""
    monkeypatch.setattr(twiddle, "CAPTURE_PASSES", True)
    monkeypatch.setattr(twiddle, "_GRAPHS", {})
    codes = [_random_codes(rows=rows, columns=40, seed=rows).cuda() for rows in (3, 700, 2049)]
    standard = [packed.clone() for packed in codes]
    for _ in range(2):
        with twiddle.twiddled_codes(codes):
            assert all(torch.equal(p.cpu(), twiddle.twiddle(s.cpu())) for p, s in zip(codes, standard))
        assert all(torch.equal(p, s) for p, s in zip(codes, standard))
    assert len(twiddle._GRAPHS) == 2


def test_a_failing_twiddled_build_retires_nothing():
    """A decode-kernel build that fails inside the window is the twiddled one: the kernels stay for the standard order
    (nothing retired), and the caller gets `TwiddledCodesError`, on which the engine falls back."""
    from trl_qerl.nvfp4 import kernels, nvrtc

    x, config = torch.zeros(1, 32), cuda_mma.MMAConfig(1, 1, 4)
    broken = set(kernels._MMA_BROKEN)
    with twiddle.twiddled_codes([]):
        with pytest.raises(twiddle.TwiddledCodesError, match="twiddled build .* failed \\(ptxas exploded\\)"):
            kernels._cuda_kernel_failed(x, config, nvrtc.NVRTCError("ptxas exploded\nline two"))
    assert kernels._MMA_BROKEN == broken


# -- the fast rollout engine's decode window ----------------------------------------------------------------------
def _nvfp4_model(dtype=torch.float32):
    from _tiny import tiny_model

    from trl_qerl.quantizer import quantize_model

    return quantize_model(tiny_model("qwen2", dtype=dtype))


GREEDY_16 = dict(max_new_tokens=16, temperature=0.0)


@pytest.mark.parametrize("blocker", ["odd rows", "not Hopper"])
def test_engine_holds_the_twiddled_order_where_the_lane_order_cannot_serve(caplog, blocker):
    """The lane order (the default) needs code rows of whole 16-byte chunks and a Hopper GPU (its wgmma kernel); a
    model whose K is not a multiple of 32, or another GPU, gets the twiddled order instead (its window up to
    `fast.TWIDDLE_MAX_ROWS` rows), said once, not the standard one."""
    from trl_qerl.rollout import fast
    from trl_qerl.rollout.fast import StaticCacheGenerator

    generator = StaticCacheGenerator(_nvfp4_model(), cuda_graph=False, engine="fused")
    generator._hopper = lambda: True
    assert fast.LANE_ORDER and generator._lane_order()
    if blocker == "odd rows":
        odd = torch.zeros(4, 24, dtype=torch.uint8)  # rows of 48 codes: words, not chunks
        generator.nvfp4_codes = lambda: [*StaticCacheGenerator.nvfp4_codes(generator), odd]
    else:
        generator._hopper = lambda: False
    with caplog.at_level(logging.INFO, logger="trl_qerl.rollout.fast"):
        assert not generator._lane_order() and not generator._lane_order()
    notes = [
        r.message for r in caplog.records if "twiddled order (up to 32 rows) instead of the lane order" in r.message
    ]
    assert len(notes) == 1 and ("16-byte chunks" if blocker == "odd rows" else "Hopper") in notes[0]
    assert not StaticCacheGenerator(_nvfp4_model(), cuda_graph=False, engine="fused")._hopper()  # (a CPU model)


def test_engine_on_cpu_keeps_the_standard_order(caplog):
    """``twiddled_decode`` needs CUDA: by default nothing is said; asked for, one warning, then standard decoding."""
    from trl_qerl.rollout.fast import SamplingParams, StaticCacheGenerator

    model = _nvfp4_model()
    prompts, params = [[3, 4, 5], [6, 7]], SamplingParams(**GREEDY_16)
    standard = StaticCacheGenerator(model, cuda_graph=False, engine="fused").generate(prompts, params, [1], 0)
    with caplog.at_level(logging.WARNING, logger="trl_qerl.rollout.fast"):
        asked = StaticCacheGenerator(model, cuda_graph=False, engine="fused", twiddled_decode=True)
        assert asked.generate(prompts, params, [1], 0) == standard
        assert asked.generate(prompts, params, [1], 0) == standard
    warnings = [r.message for r in caplog.records if "twiddled_decode" in r.message]
    assert len(warnings) == 1 and "needs CUDA" in warnings[0]


def test_engine_keeps_non_contiguous_codes_in_the_standard_order(caplog):
    """Codes the pass cannot rewrite in place are checked before any is touched: one warning, standard decoding."""
    from trl_qerl.rollout.fast import SamplingParams, StaticCacheGenerator

    model = _nvfp4_model()
    module = next(m for m in model.modules() if hasattr(m, "weight_packed"))
    packed = module.weight_packed
    strided = torch.empty(packed.shape[1], packed.shape[0], dtype=packed.dtype).t().copy_(packed)
    module.weight_packed.data = strided
    assert not module.weight_packed.is_contiguous()
    generator = StaticCacheGenerator(model, cuda_graph=False, engine="fused", twiddled_decode=True)
    with caplog.at_level(logging.WARNING, logger="trl_qerl.rollout.fast"):
        generator.generate([[3, 4, 5]], SamplingParams(**GREEDY_16), [1], 0)
    warnings = [r.message for r in caplog.records if "twiddled_decode" in r.message]
    assert len(warnings) == 1 and "contiguous" in warnings[0]


@ORDERS
def test_engine_falls_back_to_the_standard_order_when_a_product_cannot_read_the_twiddled_one(
    monkeypatch, caplog, lanes
):
    """A decode window whose step meets a standard-order reader (here every product: CPU reference kernels) raises
    inside; the generator restores the codes, logs once, and returns what standard decoding returns. With
    `fast.LANE_ORDER` the window holds the lane order."""
    from trl_qerl.rollout import fast
    from trl_qerl.rollout.fast import SamplingParams, StaticCacheGenerator

    model = _nvfp4_model()
    prompts, params = [[3, 4, 5], [6, 7]], SamplingParams(**GREEDY_16)
    standard = StaticCacheGenerator(model, cuda_graph=False, engine="fused").generate(prompts, params, [1], 0)
    generator = StaticCacheGenerator(model, cuda_graph=False, engine="fused")
    codes = [packed.clone() for packed in generator.nvfp4_codes()]

    def window_order(self, batch):  # a window on the CPU too, in the order `_lane_order` gives
        on = self._twiddle_off is None
        return on, on and self._lane_order()

    monkeypatch.setattr(StaticCacheGenerator, "_window_order", window_order)
    monkeypatch.setattr(StaticCacheGenerator, "_hopper", lambda self: True)
    monkeypatch.setattr(fast, "LANE_ORDER", lanes)
    windows, real_window = [], twiddle.twiddled_codes

    def recorded_window(codes, lanes=False):
        windows.append(lanes)
        return real_window(codes, lanes)

    monkeypatch.setattr(twiddle, "twiddled_codes", recorded_window)
    with caplog.at_level(logging.WARNING, logger="trl_qerl.rollout.fast"):
        assert generator.generate(prompts, params, [1], 0) == standard
        assert generator.generate(prompts, params, [1], 0) == standard
    assert windows and set(windows) == {lanes}
    warnings = [r.message for r in caplog.records if "standard order from now on" in r.message]
    assert len(warnings) == 1 and ("lane order now" if lanes else "twiddled order now") in warnings[0]
    assert not twiddle.active()
    assert all(torch.equal(packed, before) for packed, before in zip(generator.nvfp4_codes(), codes))


@needs_cuda
@ORDERS
@pytest.mark.parametrize("rows", [1, 8, 32, 64])
def test_engine_decodes_twiddled_codes_as_the_standard_order(rows, lanes, monkeypatch):
    """On a GPU, bf16: the captured, compiled step with the codes twiddled (its state says so, nothing fell back)
    draws the same greedy tokens as with the standard order, with log-probs equal up to the order of fp32 sums; the
    codes are standard again after each rollout. The LM head is scaled so that greedy choices are not near-ties. With
    `fast.LANE_ORDER` in the lane order, also at 64 rows (the twiddled order stops at `fast.TWIDDLE_MAX_ROWS`)."""
    from trl_qerl.rollout import fast
    from trl_qerl.rollout.fast import SamplingParams, StaticCacheGenerator

    if rows > fast.TWIDDLE_MAX_ROWS and not lanes:
        pytest.skip("the twiddled order stops at fast.TWIDDLE_MAX_ROWS rows")
    monkeypatch.setattr(fast, "LANE_ORDER", lanes)

    model = _nvfp4_model(torch.bfloat16).cuda()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    prompts = torch.randint(3, 128, (rows, 7), generator=torch.Generator().manual_seed(rows)).tolist()
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    standard_engine = StaticCacheGenerator(model, twiddled_decode=False)
    twiddled_engine = StaticCacheGenerator(model)  # the default: on for bf16 NVFP4 models on CUDA
    codes = [packed.clone() for packed in twiddled_engine.nvfp4_codes()]
    standard = standard_engine.sample(prompts, params, [1], 0)
    for _ in range(2):  # the second replays the captured step
        ours = twiddled_engine.sample(prompts, params, [1], 0)
        state = next(iter(twiddled_engine._states.values()))
        assert state.twiddled and state.lanes == lanes and twiddled_engine._twiddle_off is None
        assert ours.completion_ids == standard.completion_ids
        gaps = [abs(a - b) for row, theirs in zip(ours.logprobs, standard.logprobs) for a, b in zip(row, theirs)]
        assert max(gaps) < 0.05, max(gaps)
        assert all(torch.equal(packed, before) for packed, before in zip(twiddled_engine.nvfp4_codes(), codes))
    assert not next(iter(standard_engine._states.values())).twiddled


def test_short_calls_count_the_median_of_their_repeats(monkeypatch):
    """`bench_rollout.measure` with ``repeats``: the first call is the warm-up, the median of the next ``repeats``
    counts (one slow or fast timing of a short call no longer moves the decode step it is subtracted from)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    import bench_rollout

    timings = iter([0.500, 0.061, 0.049, 0.052, 0.070, 0.050])
    monkeypatch.setattr(bench_rollout, "timed", lambda call: (next(timings), ["completion"]))
    rows = []
    row = bench_rollout.measure("ours, prefill only", None, 1, 1, rows, repeats=5)
    assert row["seconds"] == pytest.approx(0.052) and row["first_call_extra_s"] == pytest.approx(0.448)
    assert rows == [row] and next(timings, None) is None
    timings = iter([0.5, 0.3])
    assert bench_rollout.measure("ours", None, 1, 64, [])["seconds"] == pytest.approx(0.3)  # (one repeat: as before)


def test_decode_alone_splits_what_a_rollout_pays_once_from_the_steps(capsys):
    """`bench_rollout.decode_alone`: with a two-token call besides the one-token call, the step from the second on and
    the once-per-rollout part (the decode window's reordering) come apart; without it, the old figure alone."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    from bench_rollout import decode_alone

    prefill, window, step = 0.050, 0.008, 0.003  # seconds: what the calls below are made of

    def call(tokens):
        return {"backend": "ours", "batch": 1, "new_tokens": tokens,
                "seconds": prefill + (window + (tokens - 1) * step if tokens > 1 else 0.0)}  # fmt: skip

    full = call(10)
    decode_alone(full, call(1), call(2))
    assert full["decode_ms_per_step"] == pytest.approx(1e3 * (window + 9 * step) / 9)
    assert full["decode_ms_per_step_after_first"] == pytest.approx(1e3 * step)
    assert full["once_per_rollout_ms"] == pytest.approx(1e3 * window)
    assert "3.00 ms from the second step on; once per rollout 8.0 ms" in capsys.readouterr().out
    without = call(10)
    decode_alone(without, call(1))
    assert "decode_ms_per_step_after_first" not in without
    assert without["decode_ms_per_step"] == pytest.approx(full["decode_ms_per_step"])
