"""The decode kernel's stream-K launch (`cuda_mma.MMAConfig.stream_k`, ``nvfp4_mma_stream_kernel``): the launch's
(tile x 128-column block) units dealt out evenly to as many CTAs as the GPU holds at once, the last CTA of a split
tile adding its parts in CTA order and running the epilogue, in one launch.

Without a GPU: the config's checks and names, builds for every target, on Hopper no stack, at most 128 registers
for 8 tokens per CTA (the plain builds' count), and the plain build's MMAs and weight loads in the main loop. On a GPU: instances against
float64 into NaN-poisoned outputs, for q/k/v-like groups with biases (every CTA a part of a tile) and for a single
wide matrix (CTAs with whole tiles between two parts), with LoRA terms, launches back to back with the same bits
(the counters reset themselves) and CUDA-graph replays.
"""

from __future__ import annotations

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
GROUP_ROWS, GROUP_K = (200, 40, 40), 4096  # 11 tiles of 32 rows x 32 blocks: fewer units than CTA slots
WIDE_ROWS, WIDE_K = (4100,), 1184  # 129 tiles x 10 blocks (the last a quarter): 2-3 units per CTA
STREAM_CONFIGS = [cuda_mma.MMAConfig(2, 1, 4, stream_k=True), cuda_mma.MMAConfig(1, 1, 8, stream_k=True),
                  cuda_mma.MMAConfig(2, 2, 2, stream_k=True), cuda_mma.MMAConfig(2, 1, 8, stream_k=True)]  # fmt: skip


def test_config_names_the_stream_build_and_refuses_what_it_cannot_run():
    config = cuda_mma.MMAConfig(2, 1, 8, stream_k=True)
    assert config.name_expression(torch.bfloat16) == "nvfp4_mma_stream_kernel<2, 1, 8, true>"
    assert config.name_expression(torch.float16, lora_rank=32) == "nvfp4_mma_stream_kernel<2, 1, 8, false, 32>"
    assert str(config) == "mma 32r x 8t kw8 streamk"
    assert cuda_mma.MMAConfig(2, 1, 8).name_expression(torch.bfloat16) == "nvfp4_mma_kernel<2, 1, 8, true>"
    with pytest.raises(ValueError, match="stream_k takes k_splits 1 and n_tiles 1 or 2"):
        cuda_mma.MMAConfig(2, 1, 8, 2, stream_k=True)
    with pytest.raises(ValueError, match="stream_k takes"):
        cuda_mma.MMAConfig(1, 4, 4, stream_k=True)


def test_chooser_offers_stream_launches_only_when_asked(monkeypatch):
    """Off by default (measured slower on the H200); when asked, the stream launch of every plain instance of up to
    16 tokens per CTA, and the saved-choices form keeps the flag."""
    from trl_qerl.nvfp4 import kernels

    shape = (8, 5120, 13824)  # 14B down at 8 rows
    plain = cuda_mma.candidate_configs(*shape)
    assert not any(c.stream_k for c in plain)
    monkeypatch.setattr(cuda_mma, "STREAM_K_CANDIDATES", True)
    streamed = [c for c in cuda_mma.candidate_configs(*shape) if c.stream_k]
    assert {(c.m_tiles, c.n_tiles, c.k_warps) for c in streamed} == {(c.m_tiles, c.n_tiles, c.k_warps) for c in plain}
    assert not any(c.stream_k for c in cuda_mma.candidate_configs(64, 5120, 13824))  # 64 tokens per CTA
    assert kernels._choice_from_json(kernels._choice_to_json(streamed[0])) == streamed[0]
    assert kernels._choice_from_json({"kernel": "mma", "m_tiles": 2, "n_tiles": 1, "k_warps": 8, "k_splits": 1}) == (
        cuda_mma.MMAConfig(2, 1, 8)
    )  # tables saved before stream_k existed still load


def test_nvfp4_stream_k_launches_the_chosen_decode_instances_as_stream_k(monkeypatch):
    """``NVFP4_STREAM_K=1`` (for A/B runs of whole steps): plain instances of up to 16 tokens per CTA launch as
    stream-K, split-K and wider instances as chosen; unset, every instance as chosen."""
    plain, split, wide = cuda_mma.MMAConfig(2, 1, 8), cuda_mma.MMAConfig(1, 1, 8, 2), cuda_mma.MMAConfig(1, 4, 4)
    monkeypatch.delenv("NVFP4_STREAM_K", raising=False)
    assert [cuda_mma.launch_config(c) for c in (plain, split, wide)] == [plain, split, wide]
    monkeypatch.setenv("NVFP4_STREAM_K", "1")
    assert cuda_mma.launch_config(plain) == cuda_mma.MMAConfig(2, 1, 8, stream_k=True)
    assert cuda_mma.launch_config(split) == split and cuda_mma.launch_config(wide) == wide


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_90"])
def test_stream_builds_compile_for_each_target(arch):
    for config, rank in ((STREAM_CONFIGS[0], 0), (STREAM_CONFIGS[2], 32)):
        for dtype in (torch.bfloat16, torch.float16):
            cubin, lowered = nvrtc.compile_cubin(cuda_mma.source(), config.name_expression(dtype, rank), arch)
            assert cubin[:4] == b"\x7fELF" and lowered.startswith("_Z23nvfp4_mma_stream_kernel")


@needs_nvrtc
@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump (Triton bundles one)")
@pytest.mark.parametrize("config", STREAM_CONFIGS, ids=str)
@pytest.mark.parametrize("rank", [0, 32])
def test_stream_build_keeps_the_plain_main_loop_in_128_registers(tmp_path, config, rank):
    """The twiddled build the engine runs: no spills, 8-token instances within 128 registers (the plain builds'
    count), and the main loop holds the plain build's MMAs and weight loads, nothing from shared or local memory (the
    cap costs a few more instructions)."""
    plain_config = cuda_mma.MMAConfig(config.m_tiles, config.n_tiles, config.k_warps)
    options = ("-DNVFP4_TWIDDLED=1",)
    plain, stream = (
        nvrtc.compile_cubin(cuda_mma.source(), c.name_expression(torch.bfloat16, rank), "sm_90", options)[0]
        for c in (plain_config, config)
    )
    resources = resources_of(stream, tmp_path)
    assert resources["STACK"] == 0 and resources["LOCAL"] == 0, resources
    assert config.n_tiles * config.m_tiles > 2 or resources["REG"] <= 128, resources
    plain_loop, stream_loop = ([op for op in main_loop(sass_of(c, tmp_path)) if op != "NOP"] for c in (plain, stream))
    assert len(stream_loop) <= 1.1 * len(plain_loop), f"{len(stream_loop)} vs {len(plain_loop)} instructions"
    for kind in ("HMMA", "LDG"):
        assert sum(op.startswith(kind) for op in stream_loop) == sum(op.startswith(kind) for op in plain_loop), kind
    for kind in ("LDS", "STS", "LDL", "STL", "SHFL"):
        assert not any(op.startswith(kind) for op in stream_loop), kind


# -- on a GPU -------------------------------------------------------------------------------------------------
def _inputs(rows, k: int, m: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    weights = [quantized(n, k, generator) for n in rows]
    biases = [torch.randn(n, generator=generator).to("cuda", dtype) for n in rows]
    if len(rows) > 1:
        biases[1] = None
    return torch.randn(m, k, generator=generator).to("cuda", dtype), weights, biases


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("shape", [(GROUP_ROWS, GROUP_K), (WIDE_ROWS, WIDE_K)], ids=["qkv-group", "wide"])
def test_every_stream_instance_matches_float64_with_the_same_bits_twice(dtype, m, shape):
    rows, k = shape
    x, weights, biases = _inputs(rows, k, m, dtype, seed=m)
    expected = reference(x, weights, biases)
    for config in STREAM_CONFIGS:
        # the second launch finds the counters the first left at zero
        outs = [checked_wider_launch(cuda_mma.matmul, x, weights, biases, config, expected, f"{config} #{launch}")
                for launch in range(2)]  # fmt: skip
        out = outs[-1]
        assert torch.equal(*outs), f"{config}: the parts are added in CTA order, so every launch gives the same bits"
        plain = cuda_mma.MMAConfig(config.m_tiles, config.n_tiles, config.k_warps)
        assert relative_error(cuda_mma.matmul(x, weights, plain, biases).double(), out) < 4e-3, str(config)


@needs_cuda
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("twiddled", [False, True])
def test_stream_instances_add_lora_terms(m, twiddled):
    """With the LoRA epilogue, also in the twiddled build the engine runs (codes permuted in place for the call)."""
    from trl_qerl.nvfp4 import twiddle

    x, weights, biases = _inputs(GROUP_ROWS, GROUP_K, m, torch.bfloat16, seed=20 + m)
    generator = torch.Generator().manual_seed(5)
    lora_b = [torch.randn(n, 16, generator=generator).cuda() * 0.05 for n in GROUP_ROWS]
    lora_b[1] = None
    hidden = torch.randn(m, 32, generator=generator).cuda()
    scaling = [2.0, 0.0, 0.5]
    lora = cuda_mma.LoraInputs(hidden, lora_b, scaling)
    expected = reference_with_lora(x, weights, biases, hidden, lora_b, scaling)
    codes = [w[0] for w in weights]
    for config in STREAM_CONFIGS:
        out = poisoned_out(m, sum(GROUP_ROWS), torch.bfloat16)
        if twiddled:
            with twiddle.twiddled_codes(codes):
                cuda_mma.matmul(x, weights, config, biases, out=out, lora=lora)
        else:
            cuda_mma.matmul(x, weights, config, biases, out=out, lora=lora)
        assert torch.isfinite(out).all() and relative_error(expected, out) < TOLERANCE, str(config)


@needs_cuda
def test_graph_replays_of_a_stream_launch_read_new_activations():
    x, weights, biases = _inputs(WIDE_ROWS, WIDE_K, 8, torch.bfloat16, seed=40)
    check_graph_replays(cuda_mma.matmul, x, weights, biases, STREAM_CONFIGS[0])
