"""Whether kernels compile to the same SASS from a git revision's source and from the working tree: a source change
that leaves every instance identical changes no timing, so the numbers measured on the revision stand. Offline (NVRTC,
Triton's compiler and the cuobjdump Triton bundles; no GPU).

``--kernels cuda-mma`` (default): the CUDA decode kernel's instances, 1-2 m tiles x 1-2 n tiles x 2/4/8 K warps, plain
and LoRA builds (ranks 8, 32, 128), bf16 and fp16, sm_80 and sm_90. ``--kernels wgmma``: the Hopper wgmma kernel's
instances (every candidate shape, 3-6 stages, bf16 and fp16, sm_90a). ``--kernels split-kv``: the split-KV decode
attention's Triton kernels (`rollout._split_kv_kernel`) at 7B decode shapes for sm_90 (bf16 merge; partials for a bf16
and an fp32 model), compared by opcodes (kernel parameters added or reordered change operands, not instructions),
with registers and stack; a kernel only the working tree has is listed with its resources. ``--kernels fused-shrink``:
the LoRA shrinks' Triton kernels (`rollout._fused_shrink_kernel`) for sm_90 at 7B widths, rank 32 (the norm shrink
at one row in one step and in two passes; SiLU·up per row and over every row, whole and split into 4 spans), compared
the same way. ``--kernels lora-rows``: the row shrinks of `rollout._lora_rows_kernel` for sm_90 at 64 rows, rank 32
(3xTF32 and FMAs; the spans' sum in one level and in groups), compared the same way. Exit status 1 if any instance
differs.

Usage:
    python scripts/compare_sass.py --against 258ccad
    python scripts/compare_sass.py --kernels wgmma --against HEAD
    python scripts/compare_sass.py --kernels split-kv --against 025d468
    python scripts/compare_sass.py --kernels fused-shrink --against HEAD
    python scripts/compare_sass.py --kernels lora-rows --against HEAD
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton


ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from _sass import opcodes, resources_of, rollout_argument_types, sass_of, triton_signature  # noqa: E402

from trl_qerl.nvfp4 import cuda_mma, nvrtc  # noqa: E402


def file_at(revision: str, path: Path) -> str:
    return subprocess.run(["git", "show", f"{revision}:{path.relative_to(ROOT)}"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout  # fmt: skip


def source_at(revision: str) -> str:
    """The kernels' source (`cuda_mma.SOURCE_PATHS`, joined as `cuda_mma.source` joins them) at ``revision``."""
    return "\n".join(file_at(revision, path) for path in cuda_mma.SOURCE_PATHS)


def instructions(cubin: bytes, folder: Path) -> list[str]:
    return [re.sub(r"/\*[0-9a-f]{4,}\*/", "", line).split(";")[0].strip()
            for line in sass_of(cubin, folder).splitlines() if ";" in line]  # fmt: skip


def _compare_instances(revision: str, builds: list[tuple[str, str]]) -> int:
    """Differing builds (name expression, arch) between ``revision``'s source and the working tree's."""
    before, now = source_at(revision), cuda_mma.source()
    folder = Path(tempfile.mkdtemp())
    differing = 0
    for name, arch in builds:
        a, b = (instructions(nvrtc.compile_cubin(src, name, arch)[0], folder) for src in (before, now))
        if a != b:
            differing += 1
            print(f"differs: {name} {arch} ({len(a)} vs {len(b)} instructions)")
    print(f"{len(builds) - differing} of {len(builds)} instances identical to {revision}")
    return differing


def compare_cuda_mma(revision: str) -> int:
    """Differing instances of the CUDA decode kernel."""
    configs = [cuda_mma.MMAConfig(m, n, k) for m in (1, 2) for n in (1, 2) for k in (2, 4, 8)]
    builds = [(config.name_expression(dtype, lora_rank=rank), arch) for config in configs for rank in (0, 8, 32, 128)
              for dtype in (torch.bfloat16, torch.float16) for arch in ("sm_80", "sm_90")]  # fmt: skip
    return _compare_instances(revision, builds)


def compare_wgmma(revision: str) -> int:
    """Differing instances of the wgmma kernel (every shape of `cuda_wgmma.SHAPES`, 3-6 stages, bf16 and fp16,
    sm_90a)."""
    from trl_qerl.nvfp4.cuda_wgmma import SHAPES, WgmmaConfig

    builds = [(WgmmaConfig(*shape, stages).name_expression(dtype), "sm_90a") for shape in SHAPES
              for stages in (3, 4, 5, 6) for dtype in (torch.bfloat16, torch.float16)]  # fmt: skip
    return _compare_instances(revision, builds)


def _module_at(revision: str, module, folder: Path):
    """A Triton kernel module of `trl_qerl.rollout` as it was at ``revision`` (a file of its own: Triton reads a
    kernel's source; its relative imports resolve against today's package)."""
    name = module.__name__.rpartition(".")[2]
    path = folder / f"{name}_{revision}.py"
    path.write_text(file_at(revision, Path(module.__file__)))
    spec = importlib.util.spec_from_file_location(f"trl_qerl.rollout.{name}_{revision}", path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def _build(kernel, constexprs: dict, model: str, folder: Path, num_warps: int = 4):
    """(opcodes, resources) of ``kernel`` compiled for sm_90: arguments typed as the launchers pass them for a
    ``model`` ("bf16", "fp32") model (`rollout_argument_types`), those in ``constexprs`` (and present in this
    kernel's signature) fixed; ``PDL`` False unless given (the build launched without Programmatic Dependent Launch,
    `rollout._pdl_kernel`, which revisions before it do not take)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = {name: value for name, value in {"PDL": False, **constexprs}.items() if name in kernel.arg_names}
    signature = triton_signature(kernel, constexprs, rollout_argument_types(model))
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))  # fmt: skip
    cubin = compiled.asm["cubin"]
    return opcodes(sass_of(cubin, folder)), resources_of(cubin, folder)


def _compare_builds(before: dict, now: dict) -> int:
    """Differing builds (by opcodes); builds new in the working tree are listed, not counted."""
    differing = 0
    for name, (ops, resources) in now.items():
        if name not in before:
            print(f"new: {name}: {len(ops)} instructions, {resources}")
            continue
        same = ops == before[name][0]
        differing += not same
        print(f"{'same' if same else 'differs'}: {name} ({len(before[name][0])} vs {len(ops)} instructions; "
              f"{before[name][1]} vs {resources})")  # fmt: skip
    return differing


def _compare_rollout_module(revision: str, name: str, builds) -> int:
    """Differing builds (by opcodes) of the Triton kernel module ``trl_qerl.rollout.<name>`` between ``revision`` and
    the working tree; ``builds(module, folder)`` compiles a module's instances."""
    module = importlib.import_module(f"trl_qerl.rollout.{name}")
    folder = Path(tempfile.mkdtemp())
    return _compare_builds(builds(_module_at(revision, module, folder), folder), builds(module, folder))


def _split_kv_builds(module, folder: Path) -> dict[str, tuple[list[str], dict[str, int]]]:
    """Opcodes and resources of the split-KV kernels compiled for sm_90 at 7B decode shapes (28 query heads over 4
    key/value heads, head dim 128, 8 chunks), with the arguments ``module``'s kernels take."""
    import triton.language as tl

    from trl_qerl.rollout import decode_attention as attention

    shape = dict(KV_HEADS=4, GROUP=7, GROUP_PAD=16, HEAD_DIM=128, SPLITS=8, SPLITS_PAD=8,
                 MIN_STAT=float(torch.finfo(torch.float32).min))  # fmt: skip
    tiles = dict(DIM_BLOCK=attention.MERGE_DIM_BLOCK, SPLIT_BLOCK=attention.MERGE_SPLITS)
    builds = {"merge": _build(module._merge_kernel, dict(shape, CHUNK=64, **tiles), "bf16", folder)}
    merges = (False, True) if "MERGE" in module._partials_kernel.arg_names else (False,)
    for dtype, name in ((tl.bfloat16, "bf16"), (tl.float32, "fp32")):
        for merge in merges:
            precision = "ieee" if name == "fp32" else "tf32"
            merge_tiles = {f"MERGE_{key}": value for key, value in tiles.items()}
            constexprs = dict(shape, CHUNK=64, BLOCK=32, DOT_DTYPE=dtype, DOT_PRECISION=precision, MERGE=merge,
                              ROTARY=False, IO=dtype, **merge_tiles)  # fmt: skip
            label = f"partials {name}" + (" + merge" if merge else "")
            builds[label] = _build(module._partials_kernel, constexprs, name, folder, attention.PARTIALS_WARPS)
    return builds


def compare_split_kv(revision: str) -> int:
    """Differing split-KV kernels (by opcodes); kernels new in the working tree are listed, not counted."""
    return _compare_rollout_module(revision, "_split_kv_kernel", _split_kv_builds)


def _fused_shrink_builds(module, folder: Path) -> dict[str, tuple[list[str], dict[str, int]]]:
    """Opcodes and resources of the fused shrinks compiled for sm_90 at 7B widths, rank 32, as ``module`` launches
    them (its own `block_k`, `rows_layout` and warp counts)."""
    import triton.language as tl

    builds = {}
    norm = dict(HAS_RESIDUAL=True, OUT=tl.bfloat16, BLOCK_R=2, BLOCK_K=module.block_k(3584))
    for one_step in (True, False):
        constexprs = dict(norm, ROWS=1, ONE_STEP=one_step, PASSES=1)
        builds[f"norm, {'one step' if one_step else 'two passes'}"] = _build(
            module._norm_shrink_kernel, constexprs, "bf16", folder, module._warps(norm["BLOCK_K"])
        )
    if hasattr(module, "_shrink_kernel"):  # (the o projection's plain shrink, since 2026-12-07)
        builds["plain, one step"] = _build(module._shrink_kernel, dict(BLOCK_R=2, BLOCK_K=module.block_k(3584),
                                           ONE_STEP=True), "bf16", folder, module._warps(4096))  # fmt: skip
    for splits in (1, 4):
        constexprs = dict(OUT=tl.bfloat16, BLOCK_R=1, BLOCK_K=module.block_k(18944 // splits), SPLITS=splits)
        builds[f"silu per row, {splits} spans"] = _build(
            module._silu_mul_shrink_kernel, constexprs, "bf16", folder, module._warps(constexprs["BLOCK_K"])
        )
        padded, block, columns, _ = module.rows_layout(8, 18944, [32])
        constexprs = dict(OUT=tl.bfloat16, ROWS=padded, BLOCK_R=block, BLOCK_K=columns, SPLITS=splits)
        builds[f"silu over 8 rows, {splits} spans"] = _build(
            module._silu_mul_shrink_rows_kernel, constexprs, "bf16", folder, module.ROWS_WARPS
        )
    return builds


def compare_fused_shrink(revision: str) -> int:
    """Differing fused-shrink kernels (by opcodes); kernels new in the working tree are listed, not counted."""
    return _compare_rollout_module(revision, "_fused_shrink_kernel", _fused_shrink_builds)


def _lora_rows_builds(module, folder: Path) -> dict[str, tuple[list[str], dict[str, int]]]:
    """Opcodes and resources of the row shrinks compiled for sm_90 as ``module`` launches them at 64 rows, rank 32:
    3xTF32 and FMAs (`SHRINK_MODE` 1, 2), the spans' sum in one level and in groups."""
    builds = {}
    for mode in (1, 2):
        for splits in (4, 64):
            per_group, groups = module.split_groups(splits)
            constexprs = dict(BLOCK_M=module.block_m(64), BLOCK_R=module.rank_block([32], mode),
                              BLOCK_K=module.step_columns(mode), SPLITS=splits, MODE=mode, GROUPS=groups,
                              PER_GROUP=per_group)  # fmt: skip
            builds[f"shrink mode {mode}, {splits} spans in {groups} groups"] = _build(
                module._shrink_rows_kernel, constexprs, "bf16", folder, module.WARPS
            )
    return builds


def compare_lora_rows(revision: str) -> int:
    """Differing row-shrink kernels (by opcodes); kernels new in the working tree are listed, not counted."""
    return _compare_rollout_module(revision, "_lora_rows_kernel", _lora_rows_builds)


COMPARISONS = {
    "cuda-mma": compare_cuda_mma, "wgmma": compare_wgmma, "split-kv": compare_split_kv,
    "fused-shrink": compare_fused_shrink, "lora-rows": compare_lora_rows,
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", required=True, help="git revision whose source to compare with")
    parser.add_argument("--kernels", choices=list(COMPARISONS), default="cuda-mma")
    args = parser.parse_args()
    sys.exit(1 if COMPARISONS[args.kernels](args.against) else 0)


if __name__ == "__main__":
    main()
