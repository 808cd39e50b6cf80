"""LoRA shrinks fused with the kernel that makes their input (`trl_qerl.rollout.fused_shrink`).

The Triton kernels run on CPU in Triton's interpreter and on CUDA, against the torch formulas the fused step used
before (`rms_norm_reference`, ``F.silu(gate) * up``, ``h @ A.T``): outputs written into NaN-poisoned buffers, rows of
any width (not a multiple of the kernel's block), one to three adapters, ranks that are not multiples of 4, bf16 and
fp16 inputs with fp32 or 16-bit norm weights. The custom ops pass `torch.library.opcheck`, and the fused decode step
gives the same logits with and without them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _sass import compiled_in_subprocess, cuobjdump

from trl_qerl.rollout import fused_decode
from trl_qerl.rollout.fused_shrink import (
    add_rms_norm_shrink,
    fused_shrink_applies,
    plain_shrink,
    rms_norm_reference,
    rms_norm_shrink,
    silu_mul_shrink,
)


CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.usefixtures("quiet_warnings")
RANKS = {"qkv": (8, 4, 16), "one": (32,), "odd": (5, 3)}


def _case(m, k, ranks, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=generator) * 3).to(DEVICE, dtype)
    residual = torch.randn(m, k, generator=generator).to(DEVICE, dtype)
    lora_a = [(torch.randn(r, k, generator=generator) / k**0.5).to(DEVICE) for r in ranks]
    return x, residual, lora_a


def _poisoned(like, dtype=None, columns=None):
    shape = (like.shape[0], columns if columns is not None else like.shape[1])
    return torch.full(shape, float("nan"), dtype=dtype or like.dtype, device=like.device)


def _assert_rounded_alike(ours, reference):
    """Equal but for a few elements one rounding step apart: the norm's mean summed in another order may move its
    rsqrt by an fp32 ulp, and so a rounding of ``x * rsqrt`` (then of the weight's product) by one step."""
    assert not ours.isnan().any()
    step = torch.finfo(reference.dtype).eps * reference.float().abs().clamp_min(torch.finfo(reference.dtype).tiny)
    apart = (ours.float() - reference.float()).abs()
    assert (apart <= 2 * step).all()
    assert (apart > 0).float().mean() <= 0.01


def _assert_shrink(t, h, lora_a):
    reference = torch.cat([h.double() @ a.double().T for a in lora_a], dim=-1)
    assert not t.isnan().any()
    assert ((t.double() - reference).norm() / reference.norm()).item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add_norm"])
@pytest.mark.parametrize("ranks", list(RANKS.values()), ids=list(RANKS))
@pytest.mark.parametrize(
    "shape", [(1, 200), (3, 1100), (2, 5120), (1, 9000)], ids=["1x200", "3x1100", "2x5120", "1x9000"]
)
def test_norm_shrink_kernel_matches_the_torch_formulas(dtype, residual, ranks, shape):
    _check_norm_shrink(dtype, residual, ranks, shape)


NORM_LAYOUTS = {"rows4": dict(NORM_ROWS=4), "rows2_two_pass": dict(NORM_ROWS=2, NORM_ONE_STEP=0),
                "steps_of_4096": dict(NORM_MAX_BLOCK_K=4096, NORM_TILE=8192),
                "blocks_of_264": dict(NORM_TARGET_PROGRAMS=264, NORM_TILE=16384),
                "widest_blocks": dict(NORM_TARGET_PROGRAMS=1),
                "all_blocks_in_one_program": dict(NORM_WAVE_PROGRAMS=1),
                "blocks_in_passes": dict(NORM_WAVE_PROGRAMS=8)}  # fmt: skip


@pytest.mark.parametrize(
    "shape", [(3, 1100), (6, 300), (2, 5120), (2, 9000)], ids=["3x1100", "6x300", "2x5120", "2x9000"]
)
@pytest.mark.parametrize("layout", list(NORM_LAYOUTS))
def test_norm_shrink_layouts_compute_the_same(monkeypatch, shape, layout):
    """The norm shrink's other layouts: several rows per program (the last program's rows partly past the launch's),
    the row in two passes (rows wider than a step always take those), the steps of 4,096 columns of before (a 14B
    row in two passes), the rank blocks of before (at least 264 programs, tiles of 16,384), the widest rank
    blocks (4 where they divide every rank), and programs that take several rank blocks in turn (`norm_passes`:
    every block of the row in one program; or, with a wave of 8 programs, passes of 2, 4 or 8 of the 8 blocks of
    ranks 5 + 3; rows wider than a step keep one block a program)."""
    from trl_qerl.rollout import _fused_shrink_kernel as kernel

    for name, value in NORM_LAYOUTS[layout].items():
        monkeypatch.setattr(kernel, name, value)
    _check_norm_shrink(torch.bfloat16, True, RANKS["odd"], shape)


def _check_norm_shrink(dtype, residual, ranks, shape):
    from trl_qerl.rollout._fused_shrink_kernel import norm_shrink

    x, res, lora_a = _case(*shape, ranks, dtype)
    for weight in (torch.rand(shape[1], device=DEVICE) + 0.5, (torch.rand(shape[1]) + 0.5).to(DEVICE, dtype)):
        s, h, t = _poisoned(x), _poisoned(x), _poisoned(x, torch.float32, sum(ranks))
        norm_shrink(x, res if residual else None, weight, 1e-6, lora_a, s if residual else None, h, t)
        summed = x + res if residual else x
        if residual:
            assert torch.equal(s, summed)
        _assert_rounded_alike(h, rms_norm_reference(summed, weight, 1e-6))
        _assert_shrink(t, h, lora_a)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ranks", list(RANKS.values()), ids=list(RANKS))
@pytest.mark.parametrize("shape", [(1, 200), (3, 1100), (1, 9000)], ids=["1x200", "3x1100", "1x9000"])
def test_silu_mul_shrink_kernel_reads_strided_halves(dtype, ranks, shape):
    from trl_qerl.rollout._fused_shrink_kernel import silu_mul_shrink as launch

    m, k = shape
    fused, _, lora_a = _case(m, 2 * k, (), dtype)
    gate, up = fused.split(k, dim=1)  # the halves of a gate/up output: rows strided by 2k
    lora_a = _case(m, k, ranks, dtype, seed=1)[2]
    y, t = _poisoned(gate), _poisoned(gate, torch.float32, sum(ranks))
    launch(gate, up, lora_a, y, t)
    _assert_rounded_alike(y, F.silu(gate) * up)
    _assert_shrink(t, y, lora_a)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ranks", list(RANKS.values()), ids=list(RANKS))
@pytest.mark.parametrize(
    "shape", [(1, 200), (3, 1100), (2, 5120), (1, 9000)], ids=["1x200", "3x1100", "2x5120", "1x9000"]
)
def test_plain_shrink_kernel_matches_the_products(dtype, ranks, shape):
    """`_fused_shrink_kernel.shrink` (the o projection's input): rows in one step and, past `NORM_MAX_BLOCK_K`
    columns (9,000), in several."""
    from trl_qerl.rollout._fused_shrink_kernel import shrink

    x, _, lora_a = _case(*shape, ranks, dtype)
    t = _poisoned(x, torch.float32, sum(ranks))
    shrink(x, lora_a, t)
    _assert_shrink(t, x, lora_a)


def test_split_rows_leave_their_counters_at_zero_for_the_next_launch():
    """One row of 9,000: the programs split it and the last to arrive adds the partials; a second launch (a graph
    replay, say) must find every counter back at zero."""
    from trl_qerl.nvfp4.cuda_mma import arrival_counters
    from trl_qerl.rollout import _fused_shrink_kernel as kernel

    for seed in (0, 1):
        fused = _case(1, 18000, (), torch.bfloat16, seed=seed)[0]
        gate, up = fused.split(9000, dim=1)
        lora_a = _case(1, 9000, (32,), torch.bfloat16, seed=seed + 10)[2]
        y, t = _poisoned(gate), _poisoned(gate, torch.float32, 32)
        kernel.silu_mul_shrink(gate, up, lora_a, y, t)
        _assert_shrink(t, y, lora_a)
        assert int(arrival_counters(gate.device, 1).abs().sum()) == 0


def test_rank_block_divides_every_rank_fits_the_tile_and_fills_the_gpu():
    from trl_qerl.rollout._fused_shrink_kernel import TILE, block_k, rank_block

    assert block_k(200) == 256 and block_k(3584) == 4096 and block_k(18944) == 4096
    assert rank_block(1, [32, 32, 32]) == 1  # 96 programs: as many as there are
    assert rank_block(16, [32, 32, 32], columns=2048) == 4
    assert rank_block(16, [32, 32, 32], columns=4096) == 2  # 4 x 4096 would exceed the tile
    assert rank_block(16, [32, 6], columns=1024) == 2  # 4 does not divide 6
    assert rank_block(64, [5]) == 1
    assert all(b * 4096 <= TILE for b in {rank_block(m, [32], 4096) for m in (1, 8, 16, 64)})
    assert rank_block(8, [32, 32], 4096, 16384, programs=264) == 1  # 512 programs; 2 would give 256
    assert rank_block(8, [32, 32], 4096, 16384, programs=66) == 4  # 128 programs


@pytest.mark.parametrize("shape", [(2, 5120), (3, 1100)], ids=["2x5120", "3x1100"])
def test_norm_shrink_passes_cross_from_one_adapter_to_the_next(monkeypatch, shape):
    """Blocks of 4 ranks of adapters of 8, 8 and 16 (8 blocks), 4 blocks a program: a program's passes leave the
    first adapter for the second."""
    from trl_qerl.rollout import _fused_shrink_kernel as kernel

    rows, width = shape
    columns = kernel.block_k(width, kernel.NORM_MAX_BLOCK_K)
    monkeypatch.setattr(kernel, "NORM_TARGET_PROGRAMS", 1)
    monkeypatch.setattr(kernel, "NORM_PASSES", 1)
    monkeypatch.setattr(kernel, "NORM_WAVE_PROGRAMS", 2 * rows)
    assert kernel.rank_block(rows, [8, 8, 16], columns, kernel.NORM_TILE, 1) == 4
    assert kernel.norm_passes(rows, 8, columns, 2 * rows) == 4
    _check_norm_shrink(torch.bfloat16, True, (8, 8, 16), shape)


def test_norm_passes_split_only_launches_of_more_than_one_wave(monkeypatch):
    """`norm_passes` on 132 multiprocessors: one block a program where the launch fits one wave (one program a
    multiprocessor for steps of `NORM_WIDE_COLUMNS`, two for narrower ones), else the fewest passes that bring it
    within 132 programs. 14B q/k/v at 8 rows: 24 blocks of 4, 192 programs -> 96; 7B's 192 fit one wave."""
    from trl_qerl.rollout import _fused_shrink_kernel as kernel

    monkeypatch.setattr(kernel, "NORM_PASSES", 1)
    monkeypatch.setattr(kernel, "NORM_WIDE_COLUMNS", 8192)
    wide, narrow = 8192, 4096
    assert kernel.norm_passes(8, 24, wide, 132) == 2  # 14B q/k/v at 8 rows
    assert kernel.norm_passes(8, 16, wide, 132) == 1  # 14B gate/up: 128 programs
    assert kernel.norm_passes(16, 24, wide, 132) == 3  # 384 -> 128
    assert kernel.norm_passes(16, 16, wide, 132) == 2  # 256 -> 128
    assert kernel.norm_passes(8, 24, narrow, 132) == 1  # 7B q/k/v at 8 rows: 192 programs, two a multiprocessor
    assert kernel.norm_passes(16, 24, narrow, 132) == 3  # 384: more than a wave
    assert kernel.norm_passes(16, 16, narrow, 132) == 1  # 7B gate/up at 16 rows: 256
    assert kernel.norm_passes(1, 96, wide, 132) == 1
    assert kernel.norm_passes(4, 5, wide, 3) == 5  # none within: every block in one program
    assert kernel.norm_passes(8, 24, wide, 0) == 1  # no multiprocessors known (the CPU interpreter)
    monkeypatch.setattr(kernel, "NORM_PASSES", 0)
    assert kernel.norm_passes(8, 24, wide, 132) == 1


def test_norm_shrinks_take_a_14b_row_in_one_step_in_wide_rank_blocks():
    """A 5,120-column row in one step. At 8 rows the launcher (`NORM_TARGET_PROGRAMS`, `NORM_TILE`) takes the widest
    rank block that leaves at least 66 programs, within the tile: 4 for 7B and 14B q/k/v and gate/up (rank 32); one row
    keeps blocks of 1 (96 and 64 programs: as many as there are). With the target of before (264 programs) the 14B
    q/k/v launch took blocks of 2, and with the general `TILE` it fell to blocks of 1 and took 10.2 against 6.5 µs per
    call (H200, 14B)."""
    from trl_qerl.rollout import _fused_shrink_kernel as K

    def block(width, adapters, rows=8):
        columns = K.block_k(width, K.NORM_MAX_BLOCK_K)
        return K.rank_block(rows, [32] * adapters, columns, K.NORM_TILE, K.NORM_TARGET_PROGRAMS)

    columns = K.block_k(5120, K.NORM_MAX_BLOCK_K)
    assert columns == 8192 and K.block_k(8192, K.NORM_MAX_BLOCK_K) == 8192
    assert K.NORM_TARGET_PROGRAMS <= 132 and K.NORM_TILE >= 4 * 8192
    assert [block(3584, 3), block(3584, 2), block(5120, 3), block(5120, 2)] == [4, 4, 4, 4]
    assert [block(3584, 3, rows=1), block(5120, 2, rows=1)] == [1, 1]
    assert K.rank_block(8, [32] * 3, columns, K.NORM_TILE) == 2
    assert K.rank_block(8, [32] * 3, columns) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 200), (5, 3000), (16, 1100)], ids=["2x200", "5x3000", "16x1100"])
def test_silu_mul_row_kernel_takes_every_row_of_the_launch(dtype, shape):
    """From `ROWS_FROM` rows each SiLU·up program takes every row (padded to a power of two: 5 -> 8): one to three
    adapters, rank blocks of 8 / 2 / 1 rows (ranks 16, 8, 24; 6, 2; 5), widths that are not multiples of a step."""
    from trl_qerl.rollout import _fused_shrink_kernel as kernel

    m, k = shape
    assert kernel.takes_rows(m)
    for ranks in ((16, 8, 24), (6, 2), (5,)):
        lora_a = _case(m, k, ranks, dtype, seed=m)[2]
        gate, up = _case(m, 2 * k, (), dtype, seed=m + 1)[0].split(k, dim=1)
        y, t = _poisoned(gate), _poisoned(gate, torch.float32, sum(ranks))
        kernel.silu_mul_shrink(gate, up, lora_a, y, t)
        _assert_rounded_alike(y, F.silu(gate) * up)
        _assert_shrink(t, y, lora_a)


def test_row_layout_fits_the_registers_and_spans_whole_steps():
    from trl_qerl.rollout import _fused_shrink_kernel as kernel

    assert kernel.ROWS_WARPS == 4 and kernel.ROWS_REGISTERS == 64 and kernel.ROWS_PROGRAMS == 264
    assert kernel.rows_layout(8, 18944, [32]) == (8, 2, 512, 1536)  # 7B down: 16 rank blocks x 13 spans
    assert kernel.rows_layout(16, 18944, [32]) == (16, 2, 256, 1280)  # 16 x 15
    assert kernel.rows_layout(3, 18944, [32]) == (4, 2, 1024, 2048)  # 16 x 10
    assert kernel.rows_layout(2, 200, [5, 3]) == (2, 1, 256, 256)
    budget = kernel.ROWS_REGISTERS * 32 * kernel.ROWS_WARPS
    for rows, width, ranks in ((2, 3584, [64, 64]), (16, 27648, [16]), (9, 5120, [8, 8, 8]), (4, 100, [6])):
        padded, block, columns, span = kernel.rows_layout(rows, width, ranks)
        assert padded >= rows and padded * block * columns <= budget and all(r % block == 0 for r in ranks)
        assert padded * columns <= budget // 2
        assert span % columns == 0


def test_row_spans_leave_their_counters_at_zero_for_the_next_launch():
    from trl_qerl.nvfp4.cuda_mma import arrival_counters
    from trl_qerl.rollout import _fused_shrink_kernel as kernel

    for seed in (0, 1):
        gate, up = _case(4, 9000, (), torch.bfloat16, seed=seed)[0].split(4500, dim=1)
        lora_a = _case(4, 4500, (32,), torch.bfloat16, seed=seed + 10)[2]
        y, t = _poisoned(gate), _poisoned(gate, torch.float32, 32)
        kernel.silu_mul_shrink(gate, up, lora_a, y, t)  # 5 spans per rank block
        _assert_shrink(t, y, lora_a)
        assert int(arrival_counters(gate.device, 8).abs().sum()) == 0


WIDE_NORM_TILE_STACK = 64
"""Bytes of stack the norm shrink's widest tile may keep (see below)."""


@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump (Triton bundles one)")
def test_row_kernels_need_no_stack_on_hopper(tmp_path):
    """Compiled for sm_90 (Triton's bundled toolchain, in a subprocess: this session runs the interpreter) at its
    largest register tiles, `_silu_mul_shrink_rows_kernel` keeps its accumulator in registers (a spilling draft of the
    tensor-core shrinks took 228 µs per call on the H200), and so does `_norm_shrink_kernel` with its A tile loaded
    first, at 1 to 8 rows per program, and with steps of 8,192 columns (a 14B or 72B row in one, in the rank blocks the
    launcher takes at 8 rows: 4). That last tile (4 x 8,192 fp32 over 8 warps) may keep a few words on the stack:
    48 bytes with Triton 3.3 and 3.6, none with 3.9; built so (Triton 3.6, H100, 2026-12-06) it was the faster layout,
    14B gate/up at 8 rows 7.3 -> 3.9 µs (`_fused_shrink_kernel.NORM_TARGET_PROGRAMS`). The same tile taking two rank
    blocks in turn (`norm_passes`) keeps none (Triton 3.3.1, 3.6 and 3.9), nor does the plain shrink (`_shrink_kernel`,
    the o projection's) of such a row at 8 rows (108 / 114 registers with Triton 3.9 / 3.6)."""
    resources = compiled_in_subprocess(__file__, tmp_path)
    assert len(resources) == 11
    for kernel, usage in resources.items():
        stack = WIDE_NORM_TILE_STACK if kernel.endswith("row, rank block 4") else 0
        assert usage["STACK"] <= stack and usage["LOCAL"] == 0, f"{kernel}: {usage}"


def _row_kernel_resources(folder: Path) -> dict[str, dict[str, int]]:
    """``cuobjdump -res-usage`` of `_silu_mul_shrink_rows_kernel` compiled for sm_90 as `_fused_shrink_kernel` launches
    it at 16 and 8 rows (7B width), with and without spans, and of `_norm_shrink_kernel` at 1 to 8 rows per program."""
    import triton
    from _sass import resources_of, rollout_argument_types, triton_signature
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from trl_qerl.rollout import _fused_shrink_kernel as K

    def compile_for_hopper(kernel, constexprs, num_warps):
        signature = triton_signature(kernel, constexprs, rollout_argument_types("bf16"))
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))

    results = {}
    for rows, splits in ((16, 2), (8, 1), (8, 4)):
        padded, block, columns, _ = K.rows_layout(rows, 18944, [32])
        constexprs = dict(OUT=triton.language.bfloat16, ROWS=padded, BLOCK_R=block, BLOCK_K=columns, SPLITS=splits,
                          PDL=False)  # fmt: skip
        compiled = compile_for_hopper(K._silu_mul_shrink_rows_kernel, constexprs, K.ROWS_WARPS)
        results[f"silu {rows} {splits}"] = resources_of(compiled.asm["cubin"], folder)
    for rows, block in ((1, 2), (2, 2), (4, 1), (8, 1)):  # the widest A tile `rank_block` gives at 7B width
        constexprs = dict(HAS_RESIDUAL=True, OUT=triton.language.bfloat16, BLOCK_R=block, BLOCK_K=K.block_k(3584),
                          ROWS=rows, ONE_STEP=True, PASSES=1, PDL=False)  # fmt: skip
        compiled = compile_for_hopper(K._norm_shrink_kernel, constexprs, K._warps(4096))
        results[f"norm {rows} rows"] = resources_of(compiled.asm["cubin"], folder)
    for name, width in (("14B", 5120), ("72B", 8192)):  # one step of `NORM_MAX_BLOCK_K`, the widest A tile
        columns = K.block_k(width, K.NORM_MAX_BLOCK_K)
        block = K.rank_block(8, [32] * 3, columns, K.NORM_TILE, K.NORM_TARGET_PROGRAMS)
        constexprs = dict(HAS_RESIDUAL=True, OUT=triton.language.bfloat16, BLOCK_R=block, BLOCK_K=columns, ROWS=1,
                          ONE_STEP=True, PASSES=1, PDL=False)  # fmt: skip
        compiled = compile_for_hopper(K._norm_shrink_kernel, constexprs, K._warps(columns, K.NORM_MAX_WARPS))
        results[f"norm {name} row, rank block {block}"] = resources_of(compiled.asm["cubin"], folder)
    plain = K.rank_block(8, [32], columns, K.NORM_TILE, K.NORM_TARGET_PROGRAMS)  # the o shrink of 72B at 8 rows
    compiled = compile_for_hopper(K._shrink_kernel, dict(BLOCK_R=plain, BLOCK_K=columns, ONE_STEP=True, PDL=False),
                                  K._warps(columns, K.NORM_MAX_WARPS))  # fmt: skip
    results[f"plain shrink of a 72B row at 8 rows, rank block {plain}"] = resources_of(compiled.asm["cubin"], folder)
    constexprs = dict(constexprs, BLOCK_R=4, PASSES=2)  # 72B's row; 14B q/k/v at 8 rows in passes (`norm_passes`)
    compiled = compile_for_hopper(K._norm_shrink_kernel, constexprs, K._warps(8192, K.NORM_MAX_WARPS))
    results["norm row of 8,192 in rank blocks of 4, two passes"] = resources_of(compiled.asm["cubin"], folder)
    return results


def test_shrink_benchmark_takes_only_settings_the_kernel_module_has():
    """`scripts/bench_fused_shrink.py --variants`: integer settings of `_fused_shrink_kernel`, else a clear exit."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    from bench_fused_shrink import parse_settings

    assert parse_settings("ROWS_FROM=99,ROWS_WARPS=8") == {"ROWS_FROM": 99, "ROWS_WARPS": 8}
    for bad in ("NO_SUCH_SETTING=1", "ROWS_WARPS=four", "ROWS_WARPS"):
        with pytest.raises(SystemExit, match="NAME=INTEGER"):
            parse_settings(bad)


def test_rollout_benchmark_engines_set_the_shrink_settings_and_restore_them():
    """`bench_rollout.py`'s ``+norm_shrink_before``, ``+shrink_settings`` and ``+add_in_layer`` engines: settings
    of `_fused_shrink_kernel` and `fused_decode` while the engine runs, the shipped ones after; the twiddled
    ``+alt_choices`` engine refuses to run without its table."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    from bench_rollout import ENGINES, engine_environment

    from trl_qerl.rollout import _fused_shrink_kernel as kernel

    shipped = kernel.NORM_ONE_STEP, kernel.NORM_ROWS
    with engine_environment("fused+compile+split_kv+norm_shrink_before"):
        assert (kernel.NORM_ONE_STEP, kernel.NORM_ROWS) == (0, 1)
    with engine_environment("fused+compile+split_kv+shrink_settings", shrink_settings="NORM_ROWS=4"):
        assert kernel.NORM_ROWS == 4
    with engine_environment("default+shrink_settings", shrink_settings="NORM_ROWS=2"):
        assert kernel.NORM_ROWS == 2 and fused_decode.ADD_IN_NEXT_NORM  # the generator's defaults otherwise
    assert (kernel.NORM_ONE_STEP, kernel.NORM_ROWS) == shipped
    assert ENGINES["fused+compile+split_kv+twiddle+alt_choices"]["twiddled_decode"]
    with engine_environment("fused+compile+split_kv+twiddle+add_in_layer"):
        assert not fused_decode.ADD_IN_NEXT_NORM
    assert fused_decode.ADD_IN_NEXT_NORM
    with pytest.raises(SystemExit, match="--shrink-settings"):
        with engine_environment("fused+compile+split_kv+shrink_settings"):
            pass
    with pytest.raises(SystemExit, match="--alt-choices FILE"):
        with engine_environment("fused+compile+split_kv+twiddle+alt_choices"):
            pass


def test_ops_pass_opcheck():
    x, res, lora_a = _case(2, 64, (8, 4), torch.bfloat16)
    weight = torch.rand(64, device=DEVICE)
    torch.library.opcheck(rms_norm_shrink, (x, weight, 1e-6, lora_a))
    torch.library.opcheck(add_rms_norm_shrink, (x, res, weight, 1e-6, lora_a))
    gate, up = torch.randn(2, 128, device=DEVICE, dtype=torch.bfloat16).split(64, dim=1)
    torch.library.opcheck(silu_mul_shrink, (gate, up, lora_a))
    torch.library.opcheck(plain_shrink, (x, lora_a))


def test_applies_only_to_what_the_kernels_read():
    x, _, lora_a = _case(2, 64, (8,), torch.bfloat16)
    assert fused_shrink_applies(x, lora_a)
    assert not fused_shrink_applies(x, [a.to(torch.bfloat16) for a in lora_a])  # fp32 masters only
    assert not fused_shrink_applies(x, lora_a * 4)  # at most three adapters
    assert not fused_shrink_applies(x.T, [torch.randn(8, 2, device=DEVICE)])  # strided last dim
    assert not fused_shrink_applies(x, [torch.randn(8, 32, device=DEVICE)])  # width mismatch


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_fused_step_samples_do_not_change_with_the_fused_shrinks(monkeypatch, arch):
    """On CPU the ops run the torch formulas the step ran before: the same samples, bit for bit."""
    samples, calls = _samples_with_and_without(monkeypatch, arch, "cpu")
    assert samples[True] == samples[False]
    plain_norm = set() if fused_decode.ADD_IN_NEXT_NORM else {"rms_norm_shrink"}  # the first layer adds zeros
    assert set(calls) == {"add_rms_norm_shrink", "silu_mul_shrink"} | plain_norm


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_the_o_projection_shrink_in_our_launch_gives_the_same_samples(monkeypatch, arch):
    """`fused_decode.PLAIN_SHRINK`: the o projection's shrink through `plain_shrink` (on CPU the torch formula the step
    ran before): the same samples, bit for bit."""
    from _tiny import fused_samples_with_and_without

    samples, calls = fused_samples_with_and_without(monkeypatch, "PLAIN_SHRINK", ("plain_shrink",), "cpu", False, arch,
                                                    rank=4, prompts=[[5, 6, 7], [8, 9]])  # fmt: skip
    assert samples[True] == samples[False] and set(calls) == {"plain_shrink"}


def test_adding_in_the_next_norm_gives_the_same_samples(monkeypatch):
    """`fused_decode.ADD_IN_NEXT_NORM`: each layer's last residual add made by the next layer's input norm (zeros
    for the first) gives the same samples bit for bit, with and without the fused shrinks, and then every norm of
    the step is an adding one."""
    monkeypatch.setattr(fused_decode, "ADD_IN_NEXT_NORM", False)
    before, _ = _samples_with_and_without(monkeypatch, "qwen2", "cpu")
    monkeypatch.setattr(fused_decode, "ADD_IN_NEXT_NORM", True)
    after, calls = _samples_with_and_without(monkeypatch, "qwen2", "cpu")
    assert after[True] == after[False] == before[True]
    assert set(calls) == {"add_rms_norm_shrink", "silu_mul_shrink"}


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("add_in_next_norm", [False, True])
def test_captured_compiled_step_with_the_fused_shrinks_on_cuda(monkeypatch, add_in_next_norm):
    from _tiny import assert_first_draws_agree

    monkeypatch.setattr(fused_decode, "ADD_IN_NEXT_NORM", add_in_next_norm)
    samples, calls = _samples_with_and_without(monkeypatch, "qwen2", "cuda", compile=True)
    norms = {"add_rms_norm_shrink"} if add_in_next_norm else {"rms_norm_shrink", "add_rms_norm_shrink"}
    assert set(calls) == norms | {"silu_mul_shrink"}
    assert_first_draws_agree(samples[True], samples[False])


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_captured_compiled_step_with_the_o_projection_shrink_on_cuda(monkeypatch):
    from _tiny import assert_first_draws_agree, fused_samples_with_and_without

    samples, calls = fused_samples_with_and_without(monkeypatch, "PLAIN_SHRINK", ("plain_shrink",), "cuda", True,
                                                    rank=4, prompts=[[5, 6, 7], [8, 9]])  # fmt: skip
    assert set(calls) == {"plain_shrink"}
    assert_first_draws_agree(samples[True], samples[False])


def _samples_with_and_without(monkeypatch, arch, device, compile=False):
    from _tiny import fused_samples_with_and_without

    names = ("rms_norm_shrink", "add_rms_norm_shrink", "silu_mul_shrink")
    return fused_samples_with_and_without(monkeypatch, "FUSED_SHRINK", names, device, compile, arch, rank=4,
                                          prompts=[[5, 6, 7], [8, 9]])  # fmt: skip


def test_steps_above_the_row_limit_leave_the_shrinks_to_the_projections():
    from _tiny import randomize_lora_b, tiny_model

    from trl_qerl.lora import get_peft_model, nvfp4_lora_config
    from trl_qerl.quantizer import quantize_model
    from trl_qerl.rollout.decoder_spec import read_decoder

    model = quantize_model(tiny_model("qwen2", dtype=torch.bfloat16))
    layer = read_decoder(randomize_lora_b(get_peft_model(model, nvfp4_lora_config(model, r=4)))).layers[0]
    width = layer.qkv[0].packed.shape[1] * 2
    limit = fused_decode.FUSED_SHRINK_ROWS
    for rows, fused in ((1, True), (limit, True), (limit + 1, False)):
        x = torch.randn(rows, width, dtype=torch.bfloat16)
        summed, h, hidden = fused_decode.normed_input(x, layer.post_attention_norm, layer.gate_up, residual=x)
        assert (hidden is not None) == fused
        assert torch.equal(summed, x + x)
        assert torch.equal(h, fused_decode.rms_norm(x + x, layer.post_attention_norm))


if __name__ == "__main__":  # the compiling subprocess: python test_fused_shrink.py <results.json>
    Path(sys.argv[1]).write_text(json.dumps(_row_kernel_resources(Path(sys.argv[1]).parent)))
