"""The decode kernel's ``SPLIT_K`` build (`cuda_mma.MMAConfig.k_splits`): K split over the CTAs of a tile, the last
CTA to arrive adding their sums in a fixed order and running the epilogue, in one launch.

Without a GPU: the argument structure's mirror, builds for every target, on Hopper the same main loop as the plain
build and no stack, the chooser offers the split builds only when `SPLIT_K_CANDIDATES` says so and only for grids
that leave the GPU half empty. On a GPU: every split instance (plain and with LoRA terms) against float64 into
NaN-poisoned outputs of q/k/v-like groups with biases, launches back to back (the counters reset themselves) and
CUDA-graph replays.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from _cuda_cases import (
    TOLERANCE,
    check_graph_replays,
    checked_wider_launch,
    needs_nvrtc,
    poisoned_out,
    quantized,
    reference,
    reference_with_lora,
)
from _sass import cuobjdump, main_loop, resources_of, sass_of

from trl_qerl.nvfp4 import cuda_mma, nvrtc
from trl_qerl.nvfp4.format import relative_error


CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
ROWS = (200, 40, 40)  # three segments, row counts not multiples of a tile
K = 4096  # 32 blocks of 128 columns: 8 warps x 4 splits still get one each


def test_split_argument_structure_matches_the_source():
    assert ctypes.sizeof(cuda_mma._SplitK) == 16 and cuda_mma._SplitK.counters.offset == 8
    assert "sizeof(SplitK) == 16" in cuda_mma.source()


def test_config_names_the_split_build():
    plain, split = cuda_mma.MMAConfig(1, 1, 8), cuda_mma.MMAConfig(1, 1, 8, 2)
    assert plain.name_expression(torch.bfloat16) == "nvfp4_mma_kernel<1, 1, 8, true>"  # unchanged: same builds
    assert split.name_expression(torch.bfloat16) == "nvfp4_mma_kernel<1, 1, 8, true, 0, true>"
    assert split.name_expression(torch.float16, lora_rank=32) == "nvfp4_mma_kernel<1, 1, 8, false, 32, true>"
    assert str(split) == "mma 16r x 8t kw8 split2"
    with pytest.raises(ValueError, match="k_splits"):
        cuda_mma.MMAConfig(1, 1, 8, 3)


def test_chooser_offers_splits_only_when_asked_and_only_for_small_grids(monkeypatch):
    down_one_row, gate_up_one_row = (1, 3584, 18944), (1, 37888, 3584)
    assert not any(c.k_splits > 1 for c in cuda_mma.candidate_configs(*down_one_row))
    monkeypatch.setattr(cuda_mma, "SPLIT_K_CANDIDATES", True)
    splits = [c for c in cuda_mma.candidate_configs(*down_one_row) if c.k_splits > 1]
    assert splits and all(-(-3584 // c.rows) < 2 * 132 for c in splits)
    assert not any(c.k_splits > 1 for c in cuda_mma.candidate_configs(*gate_up_one_row))  # 2,368 tiles: full


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_90"])
def test_split_builds_compile_for_each_target(arch):
    for config, rank in ((cuda_mma.MMAConfig(1, 1, 8, 2), 0), (cuda_mma.MMAConfig(2, 2, 4, 4), 32)):
        for dtype in (torch.bfloat16, torch.float16):
            cubin, lowered = nvrtc.compile_cubin(cuda_mma.source(), config.name_expression(dtype, rank), arch)
            assert cubin[:4] == b"\x7fELF" and lowered.startswith("_Z16nvfp4_mma_kernel")


@needs_nvrtc
@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump (Triton bundles one)")
@pytest.mark.parametrize("config", [cuda_mma.MMAConfig(1, 1, 8, 2), cuda_mma.MMAConfig(2, 1, 4, 4)], ids=str)
def test_split_build_keeps_the_main_loop(tmp_path, config):
    """Only the K range moves: the main loop holds the plain build's MMAs and loads, nothing from shared or local
    memory, and nothing goes to the stack."""
    plain_config = cuda_mma.MMAConfig(config.m_tiles, config.n_tiles, config.k_warps)
    plain, split = (
        nvrtc.compile_cubin(cuda_mma.source(), c.name_expression(torch.bfloat16), "sm_90")[0]
        for c in (plain_config, config)
    )
    plain_loop, split_loop = ([op for op in main_loop(sass_of(c, tmp_path)) if op != "NOP"] for c in (plain, split))
    assert abs(len(split_loop) - len(plain_loop)) <= 2, f"{len(split_loop)} vs {len(plain_loop)} instructions"
    for kind in ("HMMA", "LDG", "LDS", "STS", "BAR", "LDL", "STL", "SHFL"):
        assert sum(op.startswith(kind) for op in split_loop) == sum(op.startswith(kind) for op in plain_loop), kind
    assert resources_of(split, tmp_path)["STACK"] == 0 and resources_of(split, tmp_path)["LOCAL"] == 0


# -- on a GPU -------------------------------------------------------------------------------------------------
def _group(m: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    weights = [quantized(n, K, generator) for n in ROWS]
    biases = [torch.randn(n, generator=generator).to("cuda", dtype) for n in ROWS]
    biases[1] = None
    x = torch.randn(m, K, generator=generator).to("cuda", dtype)
    return x, weights, biases


def _split_configs(m: int) -> list[cuda_mma.MMAConfig]:
    plain = cuda_mma.candidate_configs(m, sum(ROWS), K)
    return [cuda_mma.MMAConfig(c.m_tiles, c.n_tiles, c.k_warps, s) for c in plain for s in (2, 4)]


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_every_split_instance_matches_float64_twice_in_a_row(dtype, m):
    x, weights, biases = _group(m, dtype, seed=m)
    expected = reference(x, weights, biases)
    for config in _split_configs(m):
        for launch in range(2):  # the second finds the counters the first left at zero
            out = checked_wider_launch(cuda_mma.matmul, x, weights, biases, config, expected, f"{config} #{launch}")
        plain = cuda_mma.MMAConfig(config.m_tiles, config.n_tiles, config.k_warps)
        assert relative_error(cuda_mma.matmul(x, weights, plain, biases).double(), out) < 4e-3, str(config)


@needs_cuda
@pytest.mark.parametrize("m", [1, 8])
def test_split_instances_add_lora_terms(m):
    x, weights, biases = _group(m, torch.bfloat16, seed=20 + m)
    generator = torch.Generator().manual_seed(5)
    lora_b = [torch.randn(n, 16, generator=generator).cuda() * 0.05 for n in ROWS]
    lora_b[1] = None
    hidden = torch.randn(m, 32, generator=generator).cuda()
    scaling = [2.0, 0.0, 0.5]
    lora = cuda_mma.LoraInputs(hidden, lora_b, scaling)
    assert cuda_mma.lora_supported(x, weights, lora)
    expected = reference_with_lora(x, weights, biases, hidden, lora_b, scaling)
    for config in _split_configs(m):
        out = cuda_mma.matmul(x, weights, config, biases, out=poisoned_out(m, sum(ROWS), torch.bfloat16), lora=lora)
        assert torch.isfinite(out).all() and relative_error(expected, out) < TOLERANCE, str(config)


@needs_cuda
def test_graph_replays_of_a_split_launch_read_new_activations():
    x, weights, biases = _group(2, torch.bfloat16, seed=40)
    check_graph_replays(cuda_mma.matmul, x, weights, biases, cuda_mma.MMAConfig(1, 1, 8, 4))
