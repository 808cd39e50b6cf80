"""The decode kernel's cp.async ring (built with ``-DNVFP4_ASYNC_STAGES=S``, `cuda_mma.ASYNC_STAGES_FLAG`): codes and
block scales reach each warp through S blocks of dynamic shared memory instead of a register prefetch of one block.

Without a GPU: the flag's parsing and the launch's shared memory, the refusal of K that is not a multiple of 128,
builds for sm_80-sm_90, and on Hopper a main loop that copies the weights with cp.async and reads them back from
shared memory, with no stack and fewer registers than the register path. The default build is untouched
(`scripts/compare_sass.py --against <revision>`: 192 of 192 instances identical). On a GPU: plain, LoRA and split-K
instances with rings of 2-4 blocks give the register path's bits (the MMAs run in the same order; stream-K within
rounding, its parts depend on the occupancy), against float64 into NaN-poisoned outputs, also captured in a CUDA
graph.
"""

from __future__ import annotations

import pytest
import torch
from _cuda_cases import (
    TOLERANCE,
    check_graph_replays,
    checked_wider_launch,
    needs_nvrtc,
    quantized,
    reference,
    reference_with_lora,
)
from _sass import cuobjdump, main_loop, resources_of, sass_of

from trl_qerl.nvfp4 import cuda_mma, nvrtc
from trl_qerl.nvfp4.format import relative_error


CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
RING = cuda_mma.ASYNC_STAGES_FLAG
CONFIGS = [cuda_mma.MMAConfig(2, 1, 8), cuda_mma.MMAConfig(1, 1, 4), cuda_mma.MMAConfig(2, 1, 2),
           cuda_mma.MMAConfig(2, 2, 2), cuda_mma.MMAConfig(1, 1, 4, 2), cuda_mma.MMAConfig(2, 1, 4, stream_k=True)]  # fmt: skip
GROUP_ROWS, K = (200, 40, 40), 2048  # q/k/v-like, rows not multiples of a tile; 16 blocks of 128 columns


def test_flags_and_shared_memory_of_a_launch():
    assert cuda_mma.async_stages(("-DNVFP4_TWIDDLED=1",)) == 0
    assert cuda_mma.async_stages((f"{RING}3", "-DNVFP4_TWIDDLED=1", f"{RING}4")) == 4  # the last one wins, as in C
    # 14B down's instance: 8 warps x 4 blocks x 32 rows x (64 bytes of codes + 8 of scales)
    assert cuda_mma.decode_ring_bytes(cuda_mma.MMAConfig(2, 1, 8), 4) == 8 * 4 * 32 * 72 == 73728
    assert cuda_mma.decode_ring_bytes(cuda_mma.MMAConfig(1, 1, 4), 2) == 4 * 2 * 16 * 72
    assert cuda_mma.decode_ring_bytes(cuda_mma.MMAConfig(2, 1, 8), 0) == 0  # the register path
    assert cuda_mma.decode_ring_bytes(cuda_mma.MMAConfig(2, 1, 8), 1) == 0


def test_ring_refuses_k_it_cannot_copy():
    generator = torch.Generator().manual_seed(0)
    config, flags = cuda_mma.MMAConfig(1, 1, 4), (f"{RING}4",)
    weights = [quantized(64, 1024, generator, device="cpu")]
    assert cuda_mma._ring_bytes(flags, config, weights, 1024) == 4 * 4 * 16 * 72
    assert cuda_mma._ring_bytes((), config, weights, 1024) == 0
    odd = [quantized(64, 1056, generator, device="cpu")]  # K % 32 == 0: the decode kernel's own condition
    with pytest.raises(ValueError, match=r"K % 128 == 0 .*K = 1056.*default build"):
        cuda_mma._ring_bytes(flags, config, odd, 1056)
    assert cuda_mma._ring_bytes((), config, odd, 1056) == 0


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_90"])
def test_ring_builds_compile_for_each_target(tmp_path, arch):
    for config, rank in ((CONFIGS[0], 32), (CONFIGS[4], 0), (CONFIGS[5], 32)):
        for dtype in (torch.bfloat16, torch.float16):
            cubin, _ = nvrtc.compile_cubin(cuda_mma.source(), config.name_expression(dtype, rank), arch, (f"{RING}3",))
            assert cubin[:4] == b"\x7fELF"
            if cuobjdump() is not None:
                assert "LDGSTS" in sass_of(cubin, tmp_path), (arch, str(config))


@needs_nvrtc
@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump (Triton bundles one)")
@pytest.mark.parametrize("config", CONFIGS[:4], ids=str)
def test_ring_main_loop_copies_weights_with_cp_async_in_fewer_registers(tmp_path, config):
    """The twiddled build the engine runs, with the LoRA epilogue: weights come in by LDGSTS and go to the MMAs
    through LDS, never through a global load in the loop; no stack; fewer registers than the register path."""
    options = ("-DNVFP4_TWIDDLED=1",)
    name = config.name_expression(torch.bfloat16, 32 if cuda_mma.lora_fits(config) else 0)
    plain, ring = (nvrtc.compile_cubin(cuda_mma.source(), name, "sm_90", options + extra)[0]
                   for extra in ((), (f"{RING}4",)))  # fmt: skip
    resources, plain_resources = resources_of(ring, tmp_path), resources_of(plain, tmp_path)
    assert resources["STACK"] == 0 and resources["LOCAL"] == 0, resources
    assert resources["REG"] < plain_resources["REG"], (resources, plain_resources)
    loop = [op for op in main_loop(sass_of(ring, tmp_path)) if op != "NOP"]
    assert any(op.startswith("LDGSTS") for op in loop) and any(op.startswith("LDS.128") for op in loop)
    assert not any(op.startswith("LDG.E.NA") for op in loop), "weights still loaded into registers"
    for kind in ("LDL", "STL", "BAR"):
        assert not any(op.startswith(kind) for op in loop), kind
    plain_loop = [op for op in main_loop(sass_of(plain, tmp_path)) if op != "NOP"]
    per_block = sum(op.startswith("HMMA") for op in loop)  # (the register path's loop holds two blocks)
    assert 2 * per_block == sum(op.startswith("HMMA") for op in plain_loop)


# -- on a GPU -------------------------------------------------------------------------------------------------
def _inputs(m: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    weights = [quantized(n, K, generator) for n in GROUP_ROWS]
    biases = [torch.randn(n, generator=generator).to("cuda", dtype) for n in GROUP_ROWS]
    biases[1] = None
    return torch.randn(m, K, generator=generator).to("cuda", dtype), weights, biases


def _assert_same_sums(ring: torch.Tensor, plain: torch.Tensor, config, label: str) -> None:
    """The register path's bits: the MMAs run in the same order. Except stream-K, whose CTA count comes from the
    occupancy, which the ring's shared memory changes, and with it where K is cut into parts."""
    if config.stream_k:
        assert relative_error(plain.double(), ring) < 4e-3, f"{config} {label}"
    else:
        assert torch.equal(ring, plain), f"{config} {label}: the MMAs run in the same order"


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_ring_gives_the_register_paths_bits(dtype, m):
    x, weights, biases = _inputs(m, dtype, seed=m)
    expected = reference(x, weights, biases)
    for config in CONFIGS:
        plain = cuda_mma.matmul(x, weights, config, biases)
        for stages in (2, 3, 4):
            options = (f"{RING}{stages}",)
            out = checked_wider_launch(lambda *a, **kw: cuda_mma.matmul(*a, **kw, options=options),
                                       x, weights, biases, config, expected, f"{config} ring {stages}")  # fmt: skip
            _assert_same_sums(out, plain, config, f"ring {stages}")


@needs_cuda
@pytest.mark.parametrize("m", [1, 8])
def test_ring_adds_lora_terms_in_the_twiddled_build(m):
    from trl_qerl.nvfp4 import twiddle

    x, weights, biases = _inputs(m, torch.bfloat16, seed=30 + m)
    generator = torch.Generator().manual_seed(3)
    lora_b = [torch.randn(n, 32, generator=generator).cuda() * 0.05 for n in GROUP_ROWS]
    hidden = torch.randn(m, 96, generator=generator).cuda()
    lora = cuda_mma.LoraInputs(hidden, lora_b, [2.0, 1.0, 0.5])
    codes = [w[0] for w in weights]
    for config in (c for c in CONFIGS if cuda_mma.lora_fits(c)):
        with twiddle.twiddled_codes(codes):
            plain = cuda_mma.matmul(x, weights, config, biases, lora=lora)
            ring = cuda_mma.matmul(x, weights, config, biases, lora=lora, options=(f"{RING}4",))
        _assert_same_sums(ring, plain, config, "ring 4, LoRA")
    expected = reference_with_lora(x, weights, biases, hidden, lora_b, lora.scaling)
    assert relative_error(expected, ring) < TOLERANCE


@needs_cuda
def test_graph_replays_of_a_ring_launch_read_new_activations():
    x, weights, biases = _inputs(8, torch.bfloat16, seed=40)

    def ring(*args, **kwargs):
        return cuda_mma.matmul(*args, **kwargs, options=(f"{RING}3",))

    check_graph_replays(ring, x, weights, biases, CONFIGS[0])


@needs_cuda
def test_ring_refuses_k_not_a_multiple_of_128_on_the_gpu():
    generator = torch.Generator().manual_seed(5)
    weights = [quantized(64, 1056, generator)]
    x = torch.randn(4, 1056, generator=generator).to("cuda", torch.bfloat16)
    with pytest.raises(ValueError, match="K % 128 == 0"):
        cuda_mma.matmul(x, weights, CONFIGS[1], options=(f"{RING}4",))
