"""The Hopper wgmma NVFP4 kernel (`nvfp4_wgmma_kernel` in `csrc/nvfp4_wgmma.cu`, launched by `cuda_wgmma`).

Without a GPU: configurations are validated and sized as the source lays out its shared memory, the candidates fit
the shared memory and the accumulators fit the registers, every candidate builds for sm_90a without local memory
or serialised wgmma, its main loop is one 128-column block of register-A HGMMAs within an instruction budget, and
builds for other targets carry no wgmma. On an H100/H200: every candidate and extra instance against a float64
reference on random inputs (row counts that are not multiples of a tile, tokens past a CTA column, K split over
CTAs, bf16 and fp16), q/k/v in one launch with biases into a wider output, deterministic split-K sums, CUDA-graph
replays, and the chooser offering it through the custom ops. Tolerance (METHOD.md): 16-bit operands with fp32
accumulation, relative error below 1e-2.
"""

from __future__ import annotations

import functools
import logging
import re
from types import SimpleNamespace

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

from trl_qerl.nvfp4 import cuda_mma, cuda_wgmma, kernels, nvrtc
from trl_qerl.nvfp4.cuda_wgmma import WgmmaConfig
from trl_qerl.nvfp4.format import relative_error
from trl_qerl.nvfp4.nvrtc import NVRTCError


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs a compute capability 9.0 GPU (H100/H200)")
SHAPES = [(4608, 3584), (3584, 18944), (37888, 3584), (3584, 3584)]


def _all_candidates() -> list[WgmmaConfig]:
    """Every instance (without its K split) the chooser may time for 7B/32B-like shapes."""
    found = {}
    for m in (64, 128, 256, 512):
        for n, k in SHAPES:
            for c in cuda_wgmma.wgmma_candidate_configs(m, n, k):
                unsplit = WgmmaConfig(c.warpgroups, c.m64_tiles, c.tokens, c.stages)
                found[str(unsplit)] = unsplit
    return list(found.values())


# -- without a GPU --------------------------------------------------------------------------------------------
def test_configs_are_validated_and_sized_as_the_source_lays_them_out():
    for bad in ((3, 1, 64, 4), (2, 3, 64, 4), (2, 1, 32, 4), (2, 1, 64, 2), (2, 2, 256, 3)):
        with pytest.raises(ValueError):
            WgmmaConfig(*bad)
    config = WgmmaConfig(2, 1, 128, 4)
    assert (config.rows, config.threads) == (128, 256)
    # per stage: 256 bytes of activations per token, 64 bytes of codes and 8 of scales per row, in whole KB
    assert config.stage_bytes == 128 * 256 + 128 * 72 == 41 * 1024
    assert config.shared_memory_bytes == 4 * (config.stage_bytes + 8) + 1024  # mbarriers, 1 KB to align the ring
    small = WgmmaConfig(1, 1, 64, 3, split_k=2)  # the fp32 split-K epilogue tile is larger than the ring
    assert small.stage_bytes == 21 * 1024 > 64 * 256 + 64 * 72  # rounded up
    assert small.shared_memory_bytes == max(3 * (small.stage_bytes + 8), 64 * (64 + 4) * 4) + 1024
    assert config.name_expression(torch.bfloat16) == "nvfp4_wgmma_kernel<2, 1, 128, 4, true>"
    assert config.name_expression(torch.float16).endswith("false>")
    assert str(WgmmaConfig(2, 2, 64, 3, split_k=2)) == "wgmma 256r x 64t wg2 s3 split2"


@pytest.mark.parametrize("spread", [False, True], ids=["plain", "spread"])
@pytest.mark.parametrize("m", [64, 100, 128, 256, 512])
@pytest.mark.parametrize("n,k", SHAPES)
def test_candidates_fit_and_split_only_small_grids(monkeypatch, m, n, k, spread):
    """Every candidate fits; a K split only where the CTAs before it were fewer than the multiprocessors and each
    keeps 8 blocks (`SPREAD_CANDIDATES`: up to `SPREAD_MAX_WAVES` CTAs per multiprocessor, 4 blocks each)."""
    monkeypatch.setattr(cuda_wgmma, "SPREAD_CANDIDATES", spread)
    limit = 227 * 1024
    candidates = cuda_wgmma.wgmma_candidate_configs(m, n, k, num_sms=132, shared_memory_limit=limit)
    assert candidates and len(candidates) == len(set(candidates))
    for config in candidates:
        assert config.tokens < 2 * max(m, 64)
        assert config.m64_tiles * config.tokens // 2 <= cuda_wgmma.MAX_ACCUMULATORS
        assert config.shared_memory_bytes <= limit
        ctas = -(-n // config.rows) * -(-m // config.tokens)
        if config.split_k > 1 and not spread:
            assert ctas * config.split_k // 2 < 132 and k // 128 >= 16 * (config.split_k // 2)
        elif config.split_k > 1:
            assert ctas * config.split_k <= 4 * 132 or ctas * config.split_k // 2 < 132, config
            assert k // 128 >= 4 * config.split_k, config


def test_chooser_offers_it_for_64_to_512_rows_and_saves_it():
    def wgmma(bucket, n=4608, k=3584):
        return [c for c in kernels.tile_candidates(bucket, n, k, None, 132) if isinstance(c, WgmmaConfig)]

    assert not wgmma(16) and not wgmma(1024) and not wgmma(64, k=3584 + 32)
    assert wgmma(64) and wgmma(512)
    assert not any(isinstance(c, WgmmaConfig) for c in kernels.candidate_configs(1024, 4608, 3584, mma=True))
    chooser = kernels.KernelChooser(autotune=False)
    chooser.choices = {"a": WgmmaConfig(2, 2, 128, 4, split_k=2), "b": cuda_mma.TileConfig(2, 8, 4, 3)}
    table = {key: kernels._choice_to_json(c) for key, c in chooser.choices.items()}
    assert table["a"]["kernel"] == "wgmma"
    assert {key: kernels._choice_from_json(entry) for key, entry in table.items()} == chooser.choices


def test_architecture_specific_target_only_on_hopper_and_later(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    assert nvrtc._arch(0, arch_specific=True) == "sm_90a" and nvrtc._arch(0) == "sm_90"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 9))
    assert nvrtc._arch(0, arch_specific=True) == "sm_89"


@needs_nvrtc
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_every_candidate_builds_for_sm90a_without_spills_or_serialised_wgmma(dtype, tmp_path):
    """No local memory in any candidate; where NVRTC passes on ptxas' report (13.5 does, 13.0 not), no spills and
    no "wgmma ... serialized" warning."""
    for config in _all_candidates():
        logs = []
        verbose = ("-Xptxas=-v", "-Xptxas=--warn-on-spills")
        cubin, _ = nvrtc.compile_cubin(cuda_mma.source(), config.name_expression(dtype), "sm_90a", verbose, logs)
        resources = resources_of(cubin, tmp_path) if cuobjdump() else {"STACK": 0, "LOCAL": 0}
        assert resources["STACK"] == 0 and resources["LOCAL"] == 0, (str(config), resources)
        log = logs[0]
        assert "serializ" not in log.lower(), (str(config), log[-600:])  # ptxas: "wgmma ... serialized"
        if "ptxas info" in log:
            assert "0 bytes spill stores" in log and "0 bytes stack frame" in log, (str(config), log[-600:])


@needs_nvrtc
@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump (Triton bundles one)")
@pytest.mark.parametrize("config", [WgmmaConfig(2, 1, 64, 4), WgmmaConfig(2, 1, 128, 5), WgmmaConfig(2, 2, 128, 4)],
                         ids=str)  # fmt: skip
def test_hopper_main_loop_is_register_a_wgmma_within_budget(tmp_path, config):
    """One 128-column block per iteration: 8 k16 steps x m64 tiles of HGMMA with the weights in registers and the
    activations through a descriptor, the next block's boxes issued by TMA (UTMALDG) and its scales by cp.async
    (LDGSTS), codes and scales read from shared memory (LDS), no local memory, no shuffles, and at most 60
    instructions per HGMMA (the decode: ~3 per weight)."""
    cubin, _ = nvrtc.compile_cubin(cuda_mma.source(), config.name_expression(torch.bfloat16), "sm_90a")
    resources = resources_of(cubin, tmp_path)
    assert resources["STACK"] == 0 and resources["LOCAL"] == 0, resources
    sass = sass_of(cubin, tmp_path)
    loop = main_loop(sass, mma="HGMMA")
    hgmma = [op for op in loop if op.startswith("HGMMA")]
    assert len(hgmma) == 8 * config.m64_tiles
    assert all(op.startswith(f"HGMMA.64x{config.tokens}x16.F32.BF16") for op in hgmma), hgmma[:2]
    assert any(op.startswith("LDS") for op in loop) and any(op.startswith("LDGSTS") for op in loop)
    assert any(op.startswith("UTMALDG") for op in loop)
    assert not [op for op in loop if op.split(".")[0] in ("LDL", "STL", "SHFL", "LDG")]
    assert len(loop) / len(hgmma) < 60, f"{len(loop)} instructions for {len(hgmma)} HGMMAs"


def _wgmma_waits(cubin: bytes, folder) -> list[str]:
    """The pending-group bounds of every ``wgmma.wait_group`` in the SASS (``WARPGROUP.DEPBAR.LE gsb0, 0x..``),
    sorted."""
    return sorted(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass_of(cubin, folder)))


@needs_nvrtc
@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump (Triton bundles one)")
@pytest.mark.parametrize("depth", [2, 3])
def test_deeper_builds_keep_more_groups_in_flight_without_serialising(tmp_path, depth):
    """``-DNVFP4_WGMMA_DEPTH=d``: the main loop waits for all but ``d`` wgmma groups after each step (SASS:
    ``WARPGROUP.DEPBAR.LE gsb0, d``), ptxas keeps the in-flight groups' A registers (more registers than depth 1, no
    local memory) and serialises nothing."""
    config = WgmmaConfig(2, 1, 64, 4)
    name = config.name_expression(torch.bfloat16)
    used = {}
    for d in (1, depth):
        logs: list[str] = []
        options = ("-Xptxas=-v", f"-DNVFP4_WGMMA_DEPTH={d}")
        cubin, _ = nvrtc.compile_cubin(cuda_mma.source(), name, "sm_90a", options, logs)
        assert "serializ" not in logs[0].lower(), logs[0][-600:]
        resources = resources_of(cubin, tmp_path)
        assert resources["STACK"] == 0 and resources["LOCAL"] == 0, resources
        used[d] = resources["REG"]
        waits = _wgmma_waits(cubin, tmp_path)
        assert waits == ["0x0"] + [f"0x{d}"] * 8, waits  # one per k16 step of the loop, all of them at the end
    assert used[depth] > used[1]


@needs_nvrtc
@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump (Triton bundles one)")
@pytest.mark.parametrize("config,depth", [(WgmmaConfig(2, 1, 64, 4), 1), (WgmmaConfig(2, 1, 128, 5), 3),
                                          (WgmmaConfig(2, 1, 256, 3), 3)], ids=str)  # fmt: skip
def test_the_default_build_keeps_three_groups_in_flight_from_128_tokens(tmp_path, config, depth):
    cubin, _ = nvrtc.compile_cubin(cuda_mma.source(), config.name_expression(torch.bfloat16), "sm_90a")
    waits = _wgmma_waits(cubin, tmp_path)
    assert waits == ["0x0"] + [f"0x{depth}"] * 8, waits


def test_deep_candidates_add_deeper_rings_and_wave_filling_splits(monkeypatch):
    """`DEEP_CANDIDATES` keeps every shipped candidate and adds, per CTA shape, the deepest ring that fits once and
    K splits for grids whose last wave is under half full (7B gate/up at 64 rows: 296 CTAs of 128 rows on 264 slots);
    every instance still fits the shared memory."""
    monkeypatch.setattr(cuda_wgmma, "SPREAD_CANDIDATES", False)
    shipped = cuda_wgmma.wgmma_candidate_configs(64, 37888, 3584)
    monkeypatch.setattr(cuda_wgmma, "DEEP_CANDIDATES", True)
    deep = cuda_wgmma.wgmma_candidate_configs(64, 37888, 3584)
    assert set(shipped) < set(deep) and len(deep) == len(set(deep))
    assert WgmmaConfig(2, 1, 64, 8) in deep and WgmmaConfig(2, 1, 64, 4, split_k=2) in deep
    assert all(c.shared_memory_bytes <= 227 * 1024 for c in deep)
    # a grid that fills its waves gets no split: 4608 rows at 128 per CTA are 36 CTAs (split to fill the SMs as before)
    small = cuda_wgmma.wgmma_candidate_configs(64, 4608, 3584)
    assert WgmmaConfig(2, 1, 64, 8, split_k=2) in small and WgmmaConfig(2, 1, 64, 4, split_k=4) not in small


def test_spread_candidates_add_more_and_shorter_ctas(monkeypatch):
    """`SPREAD_CANDIDATES` keeps every shipped candidate and adds, for 7B q/k/v at 64 rows (28 blocks, 72 CTAs of 64
    rows after the shipped split of 2), the ring that fits three times per multiprocessor and splits of 4 (7 blocks
    per CTA), never fewer than `SPREAD_MIN_BLOCKS` blocks per CTA or more than `SPREAD_MAX_WAVES` CTAs per
    multiprocessor; nothing above `SPREAD_MAX_ROWS`."""
    monkeypatch.setattr(cuda_wgmma, "SPREAD_CANDIDATES", False)
    shipped = cuda_wgmma.wgmma_candidate_configs(64, 4608, 3584)
    monkeypatch.setattr(cuda_wgmma, "SPREAD_CANDIDATES", True)
    spread = cuda_wgmma.wgmma_candidate_configs(64, 4608, 3584)
    assert set(shipped) < set(spread) and len(spread) == len(set(spread))
    assert WgmmaConfig(1, 1, 64, 3, split_k=2) in spread and WgmmaConfig(1, 1, 64, 3, split_k=4) in spread
    assert WgmmaConfig(2, 1, 64, 4, split_k=4) in spread and WgmmaConfig(2, 1, 64, 4, split_k=8) not in spread
    assert all(3 * (WgmmaConfig(1, 1, 64, c.stages).shared_memory_bytes + 1024) <= 228 * 1024
               for c in spread if c not in shipped and c.stages == 3 and c.rows == 64)  # fmt: skip
    for c in set(spread) - set(shipped):
        tiles = -(-4608 // c.rows)
        assert 28 // c.split_k >= cuda_wgmma.SPREAD_MIN_BLOCKS and tiles * c.split_k <= 4 * 132, c
    # above SPREAD_MAX_ROWS nothing is added
    above = cuda_wgmma.SPREAD_MAX_ROWS + 1
    with_spread = cuda_wgmma.wgmma_candidate_configs(above, 4608, 3584)
    monkeypatch.setattr(cuda_wgmma, "SPREAD_CANDIDATES", False)
    assert cuda_wgmma.wgmma_candidate_configs(above, 4608, 3584) == with_spread


@needs_hopper
def test_spread_candidates_match_the_reference(monkeypatch):
    """The spread candidates (short CTAs of a few blocks, shallow rings) of a q/k/v-like shape at 64, 100 and 128
    rows (up to `SPREAD_MAX_ROWS`, 128 since 2026-12-06)."""
    monkeypatch.setattr(cuda_wgmma, "SPREAD_CANDIDATES", True)
    monkeypatch.setattr(cuda_wgmma, "SPREAD_MAX_ROWS", 128)
    for m in (64, 100, 128):
        configs = cuda_wgmma.wgmma_candidate_configs(max(m, 64), 1152, 3584)
        check_every_instance(
            cuda_wgmma.wgmma_matmul, configs, m, 1152, 3584, torch.bfloat16, cuda_wgmma.supports_wgmma
        )


@needs_nvrtc
@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump (Triton bundles one)")
@pytest.mark.parametrize("lanes", [False, True], ids=["natural", "lanes"])
def test_the_prefetch_build_reads_each_chunk_before_the_chunk_before_multiplies(tmp_path, lanes):
    """``-DNVFP4_WGMMA_PREFETCH=1``: a block's main loop reads chunk c + 1's codes (LDS) before chunk c's HGMMAs (one
    per k16 step, two steps per chunk), so the last two chunks' HGMMAs follow each other with no read between; the
    default build reads each chunk just before decoding it."""
    config = WgmmaConfig(2, 1, 64, 4)
    order = {}
    for prefetch in (0, 1):
        options = (f"-DNVFP4_WGMMA_PREFETCH={prefetch}",) + (("-DNVFP4_TWIDDLED=2",) if lanes else ())
        cubin, _ = nvrtc.compile_cubin(cuda_mma.source(), config.name_expression(torch.bfloat16), "sm_90a", options)
        loop = main_loop(sass_of(cubin, tmp_path), mma="HGMMA")
        order[prefetch] = "".join(
            "H" if op.startswith("HGMMA") else "L" for op in loop if op.startswith(("HGMMA", "LDS"))
        )
    # chunk c: two steps of one HGMMA each; reads: two rows' codes per chunk (and the block's scales first)
    assert order[0].endswith("LLHH" * 4) and order[1].endswith("HH" + "LLHH" * 2 + "HH"), order
    assert order[1].count("L") == order[0].count("L") and order[1].index("H") == order[0].index("H") + 2, order


@needs_nvrtc
def test_a_depth_past_one_block_does_not_build():
    """More than 8 groups in flight would let a block start with the block before last still being read from the
    slot the ring refills: the source refuses such a build."""
    with pytest.raises(NVRTCError, match="NVFP4_WGMMA_DEPTH"):
        nvrtc.compile_cubin(cuda_mma.source(), WgmmaConfig(2, 1, 64, 4).name_expression(torch.bfloat16), "sm_90a",
                            ("-DNVFP4_WGMMA_DEPTH=9",))  # fmt: skip


@needs_nvrtc
@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump (Triton bundles one)")
def test_builds_for_other_targets_carry_no_wgmma(tmp_path):
    """The source (one file with the mma.sync kernels) still builds for every target; outside sm_90a the wgmma
    kernel is a trap, which the launcher never reaches (`supports_wgmma`)."""
    name = WgmmaConfig(2, 1, 64, 4).name_expression(torch.bfloat16)
    for arch in ("sm_80", "sm_89", "sm_90"):
        cubin, _ = nvrtc.compile_cubin(cuda_mma.source(), name, arch)
        sass = sass_of(cubin, tmp_path)
        assert "HGMMA" not in sass and "BPT.TRAP" in sass, arch


# -- on an H100/H200 ------------------------------------------------------------------------------------------
def _configs(m, n, k):
    """The candidates plus instances they may not include: one warpgroup, every token width, split K, shallow and
    deep rings."""
    extra = [WgmmaConfig(1, 1, 64, 3), WgmmaConfig(2, 2, 64, 3, split_k=3), WgmmaConfig(1, 2, 128, 3, split_k=2),
             WgmmaConfig(2, 1, 256, 3), WgmmaConfig(1, 1, 256, 3, split_k=2), WgmmaConfig(2, 1, 64, 6),
             WgmmaConfig(2, 1, 64, 8), WgmmaConfig(1, 1, 64, 8, split_k=2)]  # fmt: skip
    return cuda_wgmma.wgmma_candidate_configs(max(m, 64), n, k) + extra


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m", [1, 64, 100, 257, 512])
@pytest.mark.parametrize("n,k", [(200, 384), (512, 3584), (1000, 1024)])
def test_every_instance_matches_the_reference(dtype, m, n, k):
    check_every_instance(cuda_wgmma.wgmma_matmul, _configs(m, n, k), m, n, k, dtype, cuda_wgmma.supports_wgmma)


@needs_hopper
@pytest.mark.parametrize("build", ["NVFP4_WGMMA_DEPTH=2", "NVFP4_WGMMA_DEPTH=3", "NVFP4_WGMMA_PREFETCH=1"])
@pytest.mark.parametrize("m", [64, 200])
def test_deeper_builds_match_the_reference(build, m):
    """The ``NVFP4_WGMMA_DEPTH`` builds (more wgmma groups in flight) and the ``NVFP4_WGMMA_PREFETCH`` build (code
    reads a chunk ahead) on every candidate, odd rows and K split."""
    matmul = functools.partial(cuda_wgmma.wgmma_matmul, options=nvrtc.define_flags(build))
    check_every_instance(matmul, _configs(m, 1000, 1024), m, 1000, 1024, torch.bfloat16, cuda_wgmma.supports_wgmma)


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_grouped_launch_with_biases_into_a_wider_output(dtype):
    """q/k/v in one launch (rows not multiples of a tile, one weight without bias), written into columns of a wider
    tensor, with and without split K; columns outside are left alone."""
    configs = (WgmmaConfig(2, 1, 64, 4), WgmmaConfig(2, 2, 128, 4, split_k=2))
    check_grouped_launch_into_a_wider_output(cuda_wgmma.wgmma_matmul, configs, (64, 150), dtype)


@needs_hopper
def test_a_ring_larger_than_the_shared_memory_is_refused_by_name():
    weights = [quantized(128, 1024, torch.Generator().manual_seed(1))]
    x = torch.randn(128, 1024, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="shared memory"):
        cuda_wgmma.wgmma_matmul(x, weights, WgmmaConfig(2, 1, 128, 6))  # 6 x 43 KB


@needs_hopper
def test_split_k_sums_are_deterministic_and_match_one_split():
    split, whole = WgmmaConfig(2, 1, 128, 4, split_k=4), WgmmaConfig(2, 1, 128, 4)
    check_split_k_is_deterministic(cuda_wgmma.wgmma_matmul, split, whole, m=96)


@needs_hopper
def test_cuda_graph_replays_read_new_inputs_in_place():
    check_cuda_graph_replays(cuda_wgmma.wgmma_matmul, WgmmaConfig(2, 1, 64, 4, split_k=2), m=80)


@needs_hopper
def test_chooser_offers_the_wgmma_kernel_through_the_ops():
    generator = torch.Generator().manual_seed(5)
    weights = [quantized(n, 1024, generator) for n in (1024, 256, 256)]
    packed, scale, gs = (list(t) for t in zip(*weights))
    chooser = kernels.KernelChooser(autotune=True)
    for m in (64, 200):
        x = torch.randn(m, 1024, generator=generator).to("cuda", torch.bfloat16)
        candidates = kernels.candidate_configs(m, 1024, 1024, mma=True, device=x.device)
        assert any(isinstance(c, WgmmaConfig) for c in candidates)
        chooser.choose(x, *weights[0])
        chooser.choose_group(x, weights)
        assert any(key.startswith("wgmma") for timings in chooser.timings.values() for key in timings)
        assert (
            relative_error(reference(x, weights[:1], [None]), torch.ops.trl_qerl.nvfp4_linear(x, *weights[0]))
            < TOLERANCE
        )
        out = torch.ops.trl_qerl.nvfp4_linear_grouped(x, packed, scale, gs, [None] * 3)
        assert relative_error(reference(x, weights, [None] * 3), out) < TOLERANCE


def test_a_wgmma_build_failure_retires_only_the_wgmma_kernel(monkeypatch, caplog):
    """A failed wgmma build (its sm_90a target, its tensor maps) logs once and leaves the decode and tiled kernels
    in service on that device; any other CUDA kernel's failure retires the CUDA kernels as before."""
    monkeypatch.setattr(kernels, "_WGMMA_BROKEN", set())
    monkeypatch.setattr(kernels, "_MMA_BROKEN", set())
    x = SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16)  # no GPU needed: only the key
    error = NVRTCError("CUDA driver: encoding a tensor map failed\nmore")
    with caplog.at_level(logging.WARNING, logger="trl_qerl.nvfp4.kernels"):
        for _ in range(2):
            kernels._cuda_kernel_failed(x, WgmmaConfig(2, 1, 64, 4), error)
    assert kernels._WGMMA_BROKEN == {(0, torch.bfloat16)} and not kernels._MMA_BROKEN
    assert sum("wgmma kernel cannot run" in r.message for r in caplog.records) == 1
    with caplog.at_level(logging.WARNING, logger="trl_qerl.nvfp4.kernels"):
        kernels._cuda_kernel_failed(x, cuda_mma.TileConfig(2, 8, 4, 3), error)
    assert kernels._MMA_BROKEN == {(0, torch.bfloat16)}
    assert sum("CUDA decode kernel cannot run" in r.message for r in caplog.records) == 1
