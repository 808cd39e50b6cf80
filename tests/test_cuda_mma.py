"""The CUDA NVFP4 decode kernel (`csrc/nvfp4_mma.cu`, launched by `trl_qerl.nvfp4.cuda_mma`).

Without a GPU: the source cross-compiles with NVRTC for every target the dispatcher sends it to (sm_80, sm_86,
sm_89, sm_90), and on Hopper its main loop keeps the weights in registers (no shared memory, barrier or shuffle on
the weight path, the MMAs there). On a GPU: every instance against the pure-torch reference on random inputs (odd
row counts, K not a multiple of 128, rows not a multiple of 16, one to three weights in one launch, with and
without bias, bf16 and fp16), every output element written, CUDA-graph capture and torch.compile through the
custom ops, and the fall-back to Triton when the kernel cannot be built. Tolerance (METHOD.md): 16-bit operands
with fp32 accumulation, relative error below 1e-2 against a float64 reference.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess

import pytest
import torch
from _cuda_cases import TOLERANCE, check_every_instance, needs_nvrtc, poisoned_out, quantized, reference
from _sass import cuobjdump, main_loop, opcodes, resources_of, sass_of

from trl_qerl.nvfp4 import cuda_mma, kernels, nvrtc, twiddle  # noqa: F401 - `kernels` defines the custom ops
from trl_qerl.nvfp4.format import dequantize, quantize, relative_error


CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


TARGETS = ("sm_80", "sm_86", "sm_89", "sm_90")
BUILD_CONFIGS = (cuda_mma.MMAConfig(1, 1, 4), cuda_mma.MMAConfig(2, 2, 4), cuda_mma.MMAConfig(1, 8, 2))
WEIGHT_LOADS = ("LDG.E.NA.128.CONSTANT", "LDG.E.U16")
"""SASS loads of packed codes (no-allocate 16-byte) and scales (16-bit): all a PDL build may load before its wait."""


# -- without a GPU --------------------------------------------------------------------------------------------
def test_configs_are_validated_and_sized():
    with pytest.raises(ValueError, match="unsupported"):
        cuda_mma.MMAConfig(3, 1, 1)
    with pytest.raises(ValueError, match="shared memory"):
        cuda_mma.MMAConfig(2, 8, 8)
    config = cuda_mma.MMAConfig(2, 4, 2)
    assert (config.rows, config.tokens, config.shared_memory_bytes) == (32, 32, 2 * 32 * 32 * 4)
    assert config.name_expression(torch.bfloat16) == "nvfp4_mma_kernel<2, 4, 2, true>"
    assert config.name_expression(torch.float16).endswith("false>")


@pytest.mark.parametrize("m", [1, 5, 16, 17, 64, 200])
def test_candidates_cover_the_rows_and_fit_shared_memory(m):
    candidates = cuda_mma.candidate_configs(m, 4608, 3584)
    assert candidates
    assert any(config.tokens >= min(m, 64) for config in candidates)
    assert all(config.shared_memory_bytes <= 48 * 1024 for config in candidates)
    heuristic = cuda_mma.heuristic_config(m, 4608, 3584, 132)
    assert heuristic.tokens >= min(m, 64) and heuristic.k_warps * 2 <= 3584 // 128


def test_supports_only_cuda_16_bit_activations():
    weight = quantize(torch.randn(32, 64))
    assert not cuda_mma.supports(torch.randn(2, 64, dtype=torch.bfloat16), [weight])


def test_define_flags_read_comma_separated_switches():
    """The benchmarks' ``--variants`` form: comma-separated defines, ``""`` the default build."""
    assert nvrtc.define_flags("") == ()
    assert nvrtc.define_flags("NVFP4_DEPTH=2,NVFP4_L2_PREFETCH=1") == ("-DNVFP4_DEPTH=2", "-DNVFP4_L2_PREFETCH=1")


@needs_nvrtc
@pytest.mark.parametrize("arch", TARGETS)
def test_kernel_cross_compiles_for_each_target(arch):
    for config in BUILD_CONFIGS:
        for dtype in (torch.bfloat16, torch.float16):
            cubin, name = nvrtc.compile_cubin(cuda_mma.source(), config.name_expression(dtype), arch)
            assert cubin[:4] == b"\x7fELF" and name.startswith("_Z16nvfp4_mma_kernel")


@needs_nvrtc
def test_the_cubin_cache_writes_whole_files_and_reads_them_back(tmp_path, monkeypatch):
    """`nvrtc.cached_cubin` stores the cubin and its lowered name through `_files.write_atomically`: the second call
    reads the same bytes from disk and no temporary file is left in the cache."""
    monkeypatch.setenv("TRL_QERL_CACHE", str(tmp_path))
    name_expression = BUILD_CONFIGS[0].name_expression(torch.bfloat16)
    first = nvrtc.cached_cubin(cuda_mma.source(), name_expression, "sm_80")
    monkeypatch.setattr(nvrtc, "compile_cubin", lambda *args: pytest.fail("the cache was not read"))
    assert nvrtc.cached_cubin(cuda_mma.source(), name_expression, "sm_80") == first
    assert sorted(path.suffix for path in (tmp_path / "nvrtc").iterdir()) == [".cubin", ".name"]


@needs_nvrtc
def test_cubin_cache_benchmark_times_each_write_and_leaves_no_files(tmp_path):
    """`scripts/bench_cubin_cache.py` (no GPU): its table has the four timed columns, and its scratch directory
    beside the cache is removed."""
    import sys
    from pathlib import Path

    scripts = Path(__file__).parents[1] / "scripts"
    command = [sys.executable, str(scripts / "bench_cubin_cache.py"), "--instances", "1", "--arch", "sm_80"]
    env = {**os.environ, "TRL_QERL_CACHE": str(tmp_path / "cache")}
    out = subprocess.run(command, check=True, capture_output=True, text=True, timeout=300, env=env).stdout
    assert "1 decode-kernel instances" in out
    for column in ("compile", "write (before)", "write (now)", "read"):
        assert f"| {column} | " in out, out
    assert "write now / before:" in out
    assert list((tmp_path / "cache").iterdir()) == []  # the scratch directory is gone; nothing else was written
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.run([*command[:2], "--instances", "0"], check=True, capture_output=True, env=env)


@needs_nvrtc
@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump (Triton bundles one)")
@pytest.mark.parametrize("config", BUILD_CONFIGS[:2], ids=str)
def test_hopper_main_loop_keeps_weights_in_registers(tmp_path, config):
    cubin, _ = nvrtc.compile_cubin(cuda_mma.source(), config.name_expression(torch.bfloat16), "sm_90")
    loop = main_loop(sass_of(cubin, tmp_path))
    forbidden = [op for op in loop if op.split(".")[0] in ("LDS", "STS", "LDSM", "BAR", "SHFL", "LDL", "STL")]
    assert not forbidden, f"shared/local memory or shuffles on the weight path: {forbidden}"
    mmas = sum(op.startswith("HMMA") for op in loop)
    # two 128-column blocks per iteration, 8 k16 steps each, per (m tile, n tile)
    assert mmas == 2 * 8 * config.m_tiles * config.n_tiles
    weights_per_lane = 2 * 16 * config.m_tiles * 128 // 32  # two blocks of 16 * m_tiles rows x 128 columns
    assert len(loop) / weights_per_lane < 4.0, f"{len(loop)} instructions for {weights_per_lane} weights per lane"


@needs_nvrtc
@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump (Triton bundles one)")
@pytest.mark.parametrize(
    ("rank", "build"),
    [
        (0, ()),
        (0, ("-DNVFP4_DEPTH=2",)),
        (0, ("-DNVFP4_PDL_L2_BLOCKS=6",)),
        (32, twiddle.LANE_ORDER_BUILD),
        (32, (*twiddle.LANE_ORDER_BUILD, "-DNVFP4_ACTIVATIONS_EVICT_LAST=1")),
    ],
    ids=["depth1", "depth2", "l2-prefetch", "lora32-lane-order", "lora32-evict-last"],
)
@pytest.mark.parametrize("config", BUILD_CONFIGS[:2], ids=str)  # (the second: the 16-token build NVRTC 13.0 hoisted)
def test_hopper_build_reads_only_weights_before_waiting_for_the_previous_kernel(tmp_path, config, rank, build):
    """Programmatic Dependent Launch: before ``griddepcontrol.wait`` (SASS ``ACQBULK``) a CTA may load only what no
    kernel of the step writes — packed codes (the no-allocate 16-byte loads) and scales (16-bit loads); every
    activation load and every store comes after it, and ``launch_dependents`` (``PREEXIT``) after the main loop.
    The default build (no PDL) has neither instruction. The PDL build loads activations with the coherent load
    (``LDG.E.128``): the non-coherent one (``LDG.E.128.CONSTANT``, the default build's) promises that nothing writes
    them while the kernel runs, and ptxas moved it above the wait (NVRTC 13.5 with two blocks loaded ahead, 13.0 in a
    16-token build with LoRA terms). Checked for those builds too, for the build that asks for more weights into L2
    before the wait (``CCTL.E.PF2``; ``bench_rollout.py``'s ``+pdl_l2`` engines), for the build the decode step
    launches (LoRA terms, lane order) and for that build with the activations marked to stay in L1 longest
    (``LDG.E.EL.128``, coherent; ``+pdl_evict_last``)."""
    name = config.name_expression(torch.bfloat16, lora_rank=rank)
    plain = sass_of(nvrtc.compile_cubin(cuda_mma.source(), name, "sm_90", build)[0], tmp_path)
    assert "ACQBULK" not in plain and "PREEXIT" not in plain and "HMMA" in plain
    assert "LDG.E.128.CONSTANT" in plain  # (without PDL, the activations take the non-coherent path)
    cubin, _ = nvrtc.compile_cubin(cuda_mma.source(), name, "sm_90", build + cuda_mma.PDL_BUILD)
    ops = opcodes(sass_of(cubin, tmp_path))
    assert ops.count("ACQBULK") == 1 and ops.count("PREEXIT") == 1
    wait, release = ops.index("ACQBULK"), ops.index("PREEXIT")
    early_loads = [op for op in ops[:wait] if op.startswith("LDG")]
    assert early_loads and all(op in WEIGHT_LOADS for op in early_loads), early_loads
    assert not any(op.startswith(("STG", "ST.", "RED", "ATOM")) for op in ops[:wait])
    assert "LDG.E.128.CONSTANT" not in ops
    assert ("CCTL.E.PF2" in ops[:wait]) == any("PDL_L2_BLOCKS" in flag for flag in build)
    assert ("LDG.E.EL.128" in ops[wait:]) == any("EVICT_LAST" in flag for flag in build)
    last_mma = max(i for i, op in enumerate(ops) if op.startswith("HMMA"))
    assert last_mma < release < min(i for i, op in enumerate(ops) if op.startswith("STG"))


@needs_nvrtc
@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump (Triton bundles one)")
def test_no_instance_a_pdl_launch_may_take_loads_activations_before_waiting(tmp_path):
    """Every instance the chooser times for a launch of up to 16 rows (PDL by default up to `cuda_mma.PDL_MAX_ROWS`,
    forced with ``NVFP4_PDL=1`` beyond), as the decode step builds it with PDL (lane order; with and without LoRA
    terms): no load but of codes and scales before ``ACQBULK``, and activations through coherent loads only."""
    configs = {
        *cuda_mma.candidate_configs(cuda_mma.PDL_MAX_ROWS, 4608, 3584),
        *cuda_mma.candidate_configs(16, 4608, 3584),
    }
    assert len(configs) >= 12
    for config in configs:
        for rank in (0, 32):
            name = config.name_expression(torch.bfloat16, lora_rank=rank)
            cubin, _ = nvrtc.compile_cubin(
                cuda_mma.source(), name, "sm_90", twiddle.LANE_ORDER_BUILD + cuda_mma.PDL_BUILD
            )
            ops = opcodes(sass_of(cubin, tmp_path))
            early = [op for op in ops[: ops.index("ACQBULK")] if op.startswith("LD") and not op.startswith("LDC")]
            assert all(op in WEIGHT_LOADS for op in early), (name, early)
            assert "LDG.E.128.CONSTANT" not in ops and "LDG.E.128" in ops, name


def test_programmatic_launch_structures_match_cuda_h():
    """``cuLaunchKernelEx``'s structures as cuda.h lays them out (x86-64): a wrong size would pass garbage."""
    assert ctypes.sizeof(nvrtc.LaunchAttribute) == 72 and ctypes.alignment(nvrtc.LaunchAttribute) == 8
    assert ctypes.sizeof(nvrtc.LaunchConfig) == 56
    assert nvrtc.LaunchConfig.hStream.offset == 32 and nvrtc.LaunchConfig.numAttrs.offset == 48


def test_chooser_saves_decode_kernel_choices(tmp_path):
    from trl_qerl.nvfp4 import kernels as K

    chooser = K.KernelChooser(autotune=False)
    chooser.choices = {"a": cuda_mma.MMAConfig(2, 1, 4), "b": K.FusedConfig(16, 64, 128, 2), "c": K.DEQUANT_CUBLAS}
    chooser.save(tmp_path / "c.json")
    loaded = K.KernelChooser(autotune=False)
    loaded.load(tmp_path / "c.json")
    assert loaded.choices == chooser.choices


# -- on a GPU -------------------------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 8, 13, 16, 33, 64, 130])
@pytest.mark.parametrize("n,k", [(200, 96), (512, 3584 + 32), (1000, 1024)])
def test_every_instance_matches_the_reference(dtype, m, n, k):
    configs = cuda_mma.candidate_configs(m, n, k) + [cuda_mma.heuristic_config(m, n, k, 132)]
    check_every_instance(cuda_mma.matmul, configs, m, n, k, dtype)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_launch_with_biases_matches_the_reference(dtype):
    generator = torch.Generator().manual_seed(3)
    k = 640
    weights = [quantized(n, k, generator) for n in (256, 48, 48)]  # q, k, v: rows not multiples of 32
    biases = [torch.randn(n, generator=generator).to("cuda", dtype) for n in (256, 48, 48)]
    biases[1] = None
    for m in (1, 7, 24):
        x = torch.randn(m, k, generator=generator).to("cuda", dtype)
        expected = reference(x, weights, biases)
        for config in (cuda_mma.MMAConfig(1, 1, 1), cuda_mma.MMAConfig(2, 2, 2), cuda_mma.MMAConfig(1, 4, 4)):
            out = cuda_mma.matmul(x, weights, config, biases, out=poisoned_out(m, 352, dtype))
            assert relative_error(expected, out) < TOLERANCE, str(config)
        packed, scale, gs = (list(t) for t in zip(*weights))
        out = torch.ops.trl_qerl.nvfp4_linear_grouped(x, packed, scale, gs, biases)
        assert relative_error(expected, out) < TOLERANCE


@needs_cuda
def test_edge_weights_decode_exactly():
    # every E2M1 code, tiny (subnormal E4M3) block scales and the largest scale, against the reference
    k = 256
    codes = torch.arange(16, dtype=torch.uint8).repeat(64, k // 16)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous().cuda()
    scale_values = torch.tensor([2**-9, 2**-7, 0.125, 1.0, 448.0, 3.5, 0.0625, 240.0]).repeat(64, 2)[:, : k // 16]
    weight = (packed, scale_values.to(torch.float8_e4m3fn).cuda(), torch.tensor([3.7], device="cuda"))
    x = torch.randn(4, k, device="cuda", dtype=torch.bfloat16)
    expected = reference(x, [weight], [None])
    for dtype in (torch.bfloat16, torch.float16):
        out = cuda_mma.matmul(x.to(dtype), [weight], cuda_mma.MMAConfig(1, 1, 2))
        assert relative_error(expected, out) < TOLERANCE


@needs_cuda
def test_linear_op_offers_the_decode_kernel_and_is_correct():
    from trl_qerl.nvfp4 import kernels as K

    generator = torch.Generator().manual_seed(5)
    weight = quantized(4608, 3584, generator)
    untimed = K.KernelChooser(autotune=False)
    for m in (1, 16, 64, 300):
        x = torch.randn(m, 3584, generator=generator).to("cuda", torch.bfloat16)
        out = torch.ops.trl_qerl.nvfp4_linear(x, *weight)  # whatever the (timed) chooser picked
        assert relative_error(reference(x, [weight], [None]), out) < TOLERANCE
        assert K.mma_usable(x, [weight])
        # without timing, decode rows take the decode kernel; larger M keeps the Triton / cuBLAS paths
        assert isinstance(untimed.choose(x, *weight), cuda_mma.MMAConfig) == (m <= 64)


@needs_cuda
def test_cuda_graph_replays_read_new_inputs_in_place():
    generator = torch.Generator().manual_seed(9)
    weights = [quantized(n, 512, generator) for n in (384, 64, 64)]
    packed, scale, gs = (list(t) for t in zip(*weights))
    x = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)
    graph, out = _captured(lambda: torch.ops.trl_qerl.nvfp4_linear_grouped(x, packed, scale, gs, [None] * 3))
    for seed in range(3):
        x.copy_(torch.randn(8, 512, generator=torch.Generator().manual_seed(seed)).cuda())
        graph.replay()
        assert relative_error(reference(x, weights, [None] * 3), out) < TOLERANCE


@needs_cuda
@pytest.mark.skipif(CUDA and torch.cuda.get_device_capability() < (9, 0), reason="PDL needs sm_90")
@pytest.mark.parametrize(
    "build",
    [(), ("-DNVFP4_DEPTH=2",), ("-DNVFP4_PDL_L2_BLOCKS=6",), ("-DNVFP4_ACTIVATIONS_EVICT_LAST=1",)],
    ids=["depth1", "depth2", "l2-prefetch", "evict-last"],
)
def test_programmatic_launches_wait_for_the_kernel_they_read(monkeypatch, build):
    """``NVFP4_PDL=1``: a captured chain of products, each reading the previous one's output (directly, or through
    an elementwise kernel), equals the reference on every replay: no product reads its input early. The same for the
    PDL builds of ``bench_rollout.py``'s ``+pdl_depth2``, ``+pdl_l2`` and ``+pdl_evict_last`` engines (``build``:
    their flags added to `cuda_mma.PDL_BUILD`)."""
    monkeypatch.setenv("NVFP4_PDL", "1")
    monkeypatch.setattr(cuda_mma, "PDL_BUILD", cuda_mma.PDL_BUILD + build)
    generator = torch.Generator().manual_seed(11)
    weights = [quantized(1024, 1024, generator) for _ in range(4)]
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    config = cuda_mma.MMAConfig(1, 1, 4)

    def chain():
        h = x
        for i, weight in enumerate(weights):
            h = cuda_mma.matmul(h, [weight], config)
            h = _between(h, i)
        return h

    graph, out = _captured(chain)
    for seed in range(3):
        x.copy_(torch.randn(8, 1024, generator=torch.Generator().manual_seed(seed)).cuda())
        graph.replay()
        expected = x.double()
        for i, weight in enumerate(weights):
            expected = _between(expected.to(torch.bfloat16).double() @ dequantize(*weight, dtype=torch.float64).T, i)
        assert relative_error(expected, out) < TOLERANCE


def _captured(call):
    """``call`` run once outside capture (kernel builds, choices), then recorded: the graph and its output."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph, out


def _between(h, i):
    # product 1 feeds product 2 directly; the others go through an elementwise kernel
    return h if i == 1 else h / h.norm(dim=1, keepdim=True)


@needs_cuda
def test_torch_compile_of_the_grouped_op_matches_eager():
    generator = torch.Generator().manual_seed(4)
    weights = [quantized(n, 256, generator) for n in (128, 128)]
    packed, scale, gs = (list(t) for t in zip(*weights))

    def gate_up(x):
        gate, up = torch.ops.trl_qerl.nvfp4_linear_grouped(x, packed, scale, gs, [None, None]).chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(gate_up, fullgraph=True)
    assert torch.allclose(compiled(x), gate_up(x), atol=1e-2, rtol=1e-2)


def test_wave_benchmark_sizes_its_launches_and_refuses_bad_instances():
    """`scripts/bench_waves.py`: row counts that make whole and partial waves of the GPU's CTA slots."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    from bench_waves import nvfp4_megabytes, parse_instance, rows_for_waves, tail_start

    assert rows_for_waves(2.25, 528, 32) == 1188 * 32 and rows_for_waves(1.0, 264, 16) == 264 * 16
    assert rows_for_waves(0.001, 10, 16) == 16  # at least one CTA
    with pytest.raises(ValueError, match="positive"):
        rows_for_waves(1.0, 0, 32)
    assert parse_instance("2,1,4") == cuda_mma.MMAConfig(2, 1, 4)
    for bad in ("2,1", "a,b,c", "3,1,4"):
        with pytest.raises(SystemExit, match="--instance"):
            parse_instance(bad)
    assert nvfp4_megabytes(37888, 3584) == pytest.approx(37888 * (1792 + 224) / 1e6)
    assert tail_start(37888, 528, 32) == 1056 * 32  # 7B gate/up: 1,184 CTAs, the last 128 are the tail
    assert tail_start(528 * 32, 528, 32) == 528 * 32  # whole waves: no tail
    assert tail_start(100 * 32, 528, 32) == 0  # less than one wave: all tail
    assert tail_start(1000, 10, 16) == 960  # 63 CTAs of 16 rows, the last one short


def test_wave_benchmark_tail_split_covers_every_row_once(monkeypatch):
    """The tail-split form of `bench_waves.py`: the head and the tail launches, each over its row slice of the
    weight, scales and B (a float64 stand-in for the kernel here), write the whole output as one launch would."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    from bench_waves import _head_and_split_tail

    def stand_in(x, weights, config, biases=None, out=None, options=(), lora=None):
        ((packed, scale, global_scale),) = weights
        result = x.double() @ dequantize(packed, scale, global_scale, dtype=torch.float64).T
        if lora is not None:
            result = result + lora.scaling[0] * lora.hidden.double() @ lora.lora_b[0].double().T
        out.copy_(result)
        calls.append((packed.shape[0], config.k_splits))
        return out

    calls = []
    monkeypatch.setattr(cuda_mma, "matmul", stand_in)
    torch.manual_seed(0)
    weight = tuple(quantize(torch.randn(80, 64)))
    x, hidden, b = torch.randn(3, 64), torch.randn(3, 8), torch.randn(80, 8)
    lora = cuda_mma.LoraInputs(hidden, [b], [2.0])
    out = _head_and_split_tail(x.double(), weight, lora, cuda_mma.MMAConfig(2, 1, 4), 4, 64)
    expected = x.double() @ dequantize(*weight, dtype=torch.float64).T + 2.0 * hidden.double() @ b.double().T
    assert torch.allclose(out, expected) and calls == [(64, 1), (16, 4)]
    calls.clear()
    _head_and_split_tail(x.double(), weight, None, cuda_mma.MMAConfig(2, 1, 4), 2, 0)  # all tail: one launch
    assert calls == [(80, 2)]


@needs_cuda
def test_occupancy_of_a_decode_instance_counts_its_registers():
    """`CudaKernel.resident_blocks`: at least one CTA per multiprocessor, and at most what the warp limit allows."""
    config = cuda_mma.MMAConfig(2, 1, 4)
    build = cuda_mma.kernel(config.name_expression(torch.bfloat16), torch.bfloat16, torch.device("cuda"))
    per_sm = build.resident_blocks(32 * config.k_warps)
    warps = torch.cuda.get_device_properties(0).max_threads_per_multi_processor // 32
    assert 1 <= per_sm <= warps // config.k_warps
    # CTAs asking for more dynamic shared memory than the driver's default 48 KB still fit where the GPU has it
    # (the count once came back 0 before the kernel's first such launch had raised its limit)
    big = 64 * 1024
    if nvrtc.max_shared_memory_per_block(0) >= big:
        with_big = build.resident_blocks(32 * config.k_warps, big)
        assert 1 <= with_big <= per_sm


@needs_cuda
def test_build_failure_falls_back_to_triton_with_one_warning(monkeypatch, caplog):
    from trl_qerl.nvfp4 import kernels as K

    def broken(*args, **kwargs):
        raise nvrtc.NVRTCError("NVRTC: simulated failure")

    monkeypatch.setattr(cuda_mma, "kernel", broken)
    monkeypatch.setattr(K, "_MMA_BROKEN", set())
    monkeypatch.setattr(K, "CHOOSER", K.KernelChooser(autotune=False))
    weight = quantized(256, 512, torch.Generator().manual_seed(1))
    x = torch.randn(2, 512, device="cuda", dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="trl_qerl.nvfp4.kernels"):
        first = torch.ops.trl_qerl.nvfp4_linear(x, *weight)
        second = torch.ops.trl_qerl.nvfp4_linear(x, *weight)
    assert relative_error(reference(x, [weight], [None]), first) < TOLERANCE
    assert torch.equal(first, second)
    assert sum("CUDA decode kernel cannot run" in r.message for r in caplog.records) == 1


@needs_nvrtc
@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump (Triton bundles one)")
def test_min_warps_switch_caps_registers(tmp_path):
    """``-DNVFP4_MIN_WARPS=N`` (a benchmark switch) caps the registers so that N warps fit a multiprocessor: 32 warps
    (four 8-warp CTAs) leave 65536 / (32 * 32) = 64 registers per thread; the default build (96) is not capped."""
    name = cuda_mma.MMAConfig(1, 1, 8).name_expression(torch.bfloat16)
    capped, _ = nvrtc.compile_cubin(cuda_mma.source(), name, "sm_90", ("-DNVFP4_MIN_WARPS=32",))
    default, _ = nvrtc.compile_cubin(cuda_mma.source(), name, "sm_90")
    assert resources_of(capped, tmp_path)["REG"] <= 65536 // (32 * 32)
    assert resources_of(default, tmp_path)["REG"] > 65536 // (32 * 32)
