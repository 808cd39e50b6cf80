"""The CUDA NVFP4 tiled kernel (`nvfp4_tile_kernel` in `csrc/nvfp4_mma.cu`, launched by `cuda_mma.tile_matmul`).

Without a GPU: configurations are validated and sized as the source lays out its shared memory, the candidates fit
a multiprocessor twice and split K only where the tiles alone would not fill the GPU, the source cross-compiles for
every target the dispatcher sends it to, and on Hopper its main loop multiplies from shared memory without local
memory and within an instruction budget per MMA. On a GPU: every candidate against a float64 reference on random
inputs (row counts that are not multiples of a tile, tokens past a CTA column, one to three weights with biases,
K split over CTAs), every output element written, deterministic split-K sums, CUDA-graph replays, and the chooser
offering it through the custom op. Tolerance (METHOD.md): 16-bit operands with fp32 accumulation, relative error
below 1e-2.
"""

from __future__ import annotations

import pytest
import torch
from _cuda_cases import (
    TOLERANCE,
    check_cuda_graph_replays,
    check_every_instance,
    check_grouped_launch_into_a_wider_output,
    check_split_k_is_deterministic,
    needs_nvrtc,
    quantized,
    reference,
)
from _sass import cuobjdump, main_loop, resources_of, sass_of

from trl_qerl.nvfp4 import cuda_mma, kernels, nvrtc  # noqa: F401 - `kernels` defines the custom ops
from trl_qerl.nvfp4.format import quantize, relative_error


CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
TARGETS = ("sm_80", "sm_86", "sm_89", "sm_90")
BUILD_CONFIGS = (
    cuda_mma.TileConfig(2, 8, 4, 3), cuda_mma.TileConfig(1, 2, 4, 2), cuda_mma.TileConfig(4, 4, 2, 4),
    cuda_mma.TileConfig(2, 8, 8, 3),
)  # fmt: skip


# -- without a GPU --------------------------------------------------------------------------------------------
def test_configs_are_validated_and_sized_as_the_source_lays_them_out():
    with pytest.raises(ValueError, match="unsupported"):
        cuda_mma.TileConfig(3, 8, 4, 3)
    with pytest.raises(ValueError, match="unsupported"):
        cuda_mma.TileConfig(2, 8, 4, 1)
    config = cuda_mma.TileConfig(2, 8, 4, 3)
    assert (config.rows, config.tokens) == (128, 64)
    # per stage: 64 bytes of codes and 8 of scales per row, 128 activations (256 bytes) per token
    assert config.stage_bytes == 128 * 72 + 64 * 256
    assert config.shared_memory_bytes == 3 * config.stage_bytes
    # a small pipeline whose split-K epilogue tile (fp32) is larger than its stages
    small = cuda_mma.TileConfig(1, 8, 1, 2, split_k=4)
    assert small.shared_memory_bytes == max(2 * small.stage_bytes, 64 * (16 + 4) * 4)
    assert config.name_expression(torch.bfloat16) == "nvfp4_tile_kernel<2, 8, 4, 3, true>"
    assert config.name_expression(torch.float16).endswith("false>")
    assert str(cuda_mma.TileConfig(1, 4, 4, 2, split_k=2)) == "tile 64r x 32t w4 s2 split2"


@pytest.mark.parametrize("m", [16, 24, 64, 100, 512])
@pytest.mark.parametrize("n,k", [(4608, 3584), (3584, 18944), (37888, 3584)])
def test_candidates_cover_the_rows_fit_twice_and_split_only_small_grids(m, n, k):
    limit = 227 * 1024
    candidates = cuda_mma.tile_candidate_configs(m, n, k, num_sms=132, shared_memory_limit=limit)
    assert candidates
    for config in candidates:
        assert config.tokens >= min(m, 64) and config.tokens < 2 * max(min(m, 64), 8)
        assert config.m_tiles * config.n_tiles <= 16  # 64 fp32 accumulators per lane: no spills
        assert 2 * config.shared_memory_bytes <= limit
        ctas = -(-n // config.rows) * -(-m // config.tokens)
        if config.split_k > 1:
            assert ctas * config.split_k // 2 < 132 and k // 128 >= 16 * (config.split_k // 2)
    # on GPUs with less shared memory per CTA (sm_86/89: 99 KB) the pipelines get shorter, never over the limit
    for config in cuda_mma.tile_candidate_configs(m, n, k, 84, shared_memory_limit=99 * 1024):
        assert 2 * config.shared_memory_bytes <= 99 * 1024


@pytest.mark.parametrize("m", [16, 32, 64])
@pytest.mark.parametrize("n,k", [(4608, 3584), (3584, 18944), (37888, 3584)])
def test_spread_candidates_add_more_and_shorter_ctas_up_to_32_rows(monkeypatch, m, n, k):
    """`TILE_SPREAD_CANDIDATES` keeps every other candidate and adds pipelines that fit four times per
    multiprocessor and K splits of at least 4 blocks per CTA, for at most 4 CTAs per multiprocessor; nothing from
    64 rows."""
    plain = cuda_mma.tile_candidate_configs(m, n, k, num_sms=132)
    monkeypatch.setattr(cuda_mma, "TILE_SPREAD_CANDIDATES", True)
    spread = cuda_mma.tile_candidate_configs(m, n, k, num_sms=132)
    assert [c for c in spread if c in plain] == plain and len(spread) == len(set(spread))
    added = [c for c in spread if c not in plain]
    assert bool(added) == (m <= 32)
    for config in added:
        ctas = -(-n // config.rows) * -(-m // config.tokens)
        assert 4 * config.shared_memory_bytes <= 227 * 1024 or config.split_k > 1, config
        assert k // 128 >= 4 * config.split_k and (ctas * config.split_k <= 4 * 132 or config.split_k == 1), config
    if (m, n, k) == (32, 4608, 3584):  # 7B q/k/v: 72 CTAs of 64 rows split 2 -> 4, with the 4-per-SM pipeline
        assert cuda_mma.TileConfig(2, 4, 2, 4, split_k=4) in added


def test_candidates_only_where_the_tiled_kernel_applies():
    assert kernels.tile_candidates(8, 4608, 3584, None, 132) == []  # decode rows: the decode kernel's
    assert kernels.tile_candidates(1024, 4608, 3584, None, 132) == []  # from 1024 rows: dequantise + cuBLAS
    assert kernels.tile_candidates(64, 4608, 3584 + 32, None, 132) == []  # K % 128 != 0
    assert kernels.tile_candidates(64, 4608, 3584, None, 132)
    weight = quantize(torch.randn(32, 256))
    assert not cuda_mma.supports_tile(torch.randn(16, 256, dtype=torch.bfloat16), [weight])  # CPU tensors


def test_chooser_saves_tiled_kernel_choices(tmp_path):
    chooser = kernels.KernelChooser(autotune=False)
    chooser.choices = {
        "H100|bfloat16|64|3584|3584": cuda_mma.TileConfig(2, 8, 4, 3, 2),
        "H100|bfloat16|1|3584|3584": cuda_mma.MMAConfig(1, 1, 4),
        "H100|bfloat16|1024|4608|3584|x3": kernels.SEPARATE,  # a group's choice, under a group's key (`load` checks)
    }
    chooser.save(tmp_path / "c.json")
    loaded = kernels.KernelChooser(autotune=False)
    loaded.load(tmp_path / "c.json")
    assert loaded.choices == chooser.choices


@needs_nvrtc
@pytest.mark.parametrize("arch", TARGETS)
def test_kernel_cross_compiles_for_each_target(arch):
    for dtype in (torch.bfloat16, torch.float16):
        for config in BUILD_CONFIGS:
            cubin, name = nvrtc.compile_cubin(cuda_mma.source(), config.name_expression(dtype), arch)
            assert cubin[:4] == b"\x7fELF" and name.startswith("_Z17nvfp4_tile_kernel")
        cubin, name = nvrtc.compile_cubin(cuda_mma.source(), cuda_mma.reduce_name(dtype), arch)
        assert name.startswith("_Z25nvfp4_split_reduce_kernel")


@needs_nvrtc
@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump (Triton bundles one)")
@pytest.mark.parametrize("config", BUILD_CONFIGS[:2], ids=str)
def test_hopper_main_loop_multiplies_from_shared_memory_within_budget(tmp_path, config):
    """One 128-column block per iteration: 8 k16 steps per (m tile, n tile) of a warp, activations and weights read
    from shared memory (LDS), the next block's copies issued (LDGSTS), no local memory anywhere, and at most ~6
    instructions per MMA for the 64-token instance (the decode kernel needs ~27 per MMA at one token tile)."""
    cubin, _ = nvrtc.compile_cubin(cuda_mma.source(), config.name_expression(torch.bfloat16), "sm_90")
    resources = resources_of(cubin, tmp_path)
    assert resources["STACK"] == 0 and resources["LOCAL"] == 0, resources
    loop = main_loop(sass_of(cubin, tmp_path))
    mmas = sum(op.startswith("HMMA") for op in loop)
    assert mmas == 8 * config.m_tiles * config.n_tiles
    assert any(op.startswith("LDS") for op in loop) and any(op.startswith("LDGSTS") for op in loop)
    assert not [op for op in loop if op.split(".")[0] in ("LDL", "STL", "SHFL", "LDG")]
    if config.n_tiles == 8:
        assert len(loop) / mmas < 6.0, f"{len(loop)} instructions for {mmas} MMAs"


# -- on a GPU -------------------------------------------------------------------------------------------------
def _configs(m, n, k):
    """The candidates plus instances the candidates may not include: every warp shape, split K, short pipelines."""
    extra = [cuda_mma.TileConfig(1, 1, 1, 2), cuda_mma.TileConfig(2, 2, 2, 3, split_k=3),
             cuda_mma.TileConfig(1, 8, 8, 2, split_k=2), cuda_mma.TileConfig(4, 4, 2, 4),
             cuda_mma.TileConfig(1, 8, 16, 3)]  # fmt: skip
    return cuda_mma.tile_candidate_configs(m, n, k) + extra


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [16, 17, 40, 64, 100, 257])
@pytest.mark.parametrize("n,k", [(200, 384), (512, 3584), (1000, 1024)])
def test_every_instance_matches_the_reference(dtype, m, n, k):
    check_every_instance(cuda_mma.tile_matmul, _configs(m, n, k), m, n, k, dtype, cuda_mma.supports_tile)


@needs_cuda
def test_spread_candidates_match_the_reference(monkeypatch):
    """The spread candidates (short CTAs of a few blocks, shallow pipelines) of a q/k/v-like shape at 17 and 32
    rows."""
    monkeypatch.setattr(cuda_mma, "TILE_SPREAD_CANDIDATES", True)
    for m in (17, 32):
        configs = cuda_mma.tile_candidate_configs(m, 1152, 3584)
        check_every_instance(cuda_mma.tile_matmul, configs, m, 1152, 3584, torch.bfloat16, cuda_mma.supports_tile)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_launch_with_biases_into_a_wider_output(dtype):
    """q/k/v in one launch (rows not multiples of a tile, one weight without bias), written into columns of a wider
    tensor (row stride > the outputs' width), with and without split K; columns outside are left alone."""
    configs = (cuda_mma.TileConfig(2, 8, 4, 3), cuda_mma.TileConfig(1, 2, 2, 2, split_k=2))
    check_grouped_launch_into_a_wider_output(cuda_mma.tile_matmul, configs, (16, 50), dtype)


@needs_cuda
def test_split_k_sums_are_deterministic_and_match_one_split():
    split, whole = cuda_mma.TileConfig(1, 8, 4, 3, split_k=4), cuda_mma.TileConfig(1, 8, 4, 3)
    check_split_k_is_deterministic(cuda_mma.tile_matmul, split, whole, m=48)


@needs_cuda
def test_the_tiled_kernel_gives_the_decode_kernels_products():
    """Same MMA, same register layout, same rounding: only the order of fp32 sums over K may differ."""
    generator = torch.Generator().manual_seed(12)
    weights = [quantized(384, 1024, generator)]
    x = torch.randn(32, 1024, generator=generator).to("cuda", torch.bfloat16)
    tiled = cuda_mma.tile_matmul(x, weights, cuda_mma.TileConfig(2, 4, 4, 2))
    decoded = cuda_mma.matmul(x, weights, cuda_mma.MMAConfig(1, 4, 1))
    assert (tiled.float() - decoded.float()).abs().max() <= 2 * 2**-7 * decoded.float().abs().max()


@needs_cuda
def test_cuda_graph_replays_read_new_inputs_in_place():
    check_cuda_graph_replays(cuda_mma.tile_matmul, cuda_mma.TileConfig(1, 8, 4, 3, split_k=2), m=40)


@needs_cuda
def test_chooser_offers_the_tiled_kernel_through_the_ops():
    generator = torch.Generator().manual_seed(5)
    weights = [quantized(n, 1024, generator) for n in (1024, 256, 256)]
    packed, scale, gs = (list(t) for t in zip(*weights))
    chooser = kernels.KernelChooser(autotune=True)
    for m in (16, 64, 200):
        x = torch.randn(m, 1024, generator=generator).to("cuda", torch.bfloat16)
        assert any(isinstance(c, cuda_mma.TileConfig) for c in kernels.candidate_configs(m, 1024, 1024, mma=True))
        chooser.choose(x, *weights[0])
        chooser.choose_group(x, weights)
        assert (
            relative_error(reference(x, weights[:1], [None]), torch.ops.trl_qerl.nvfp4_linear(x, *weights[0]))
            < TOLERANCE
        )
        out = torch.ops.trl_qerl.nvfp4_linear_grouped(x, packed, scale, gs, [None] * 3)
        assert relative_error(reference(x, weights, [None] * 3), out) < TOLERANCE
