"""The NVFP4 kernels build on every GPU generation the dispatcher sends them to, checked without a GPU.

Each target (sm_75 T4, sm_80 A100, sm_89 L4/RTX 40xx, sm_90 H100/H200) is cross-compiled with Triton's bundled
toolchain (front end, LLVM, ptxas) for every kernel that `kernels.triton_path` would launch there, one
representative launch configuration each, and for the fused decode step's Triton kernels: the LoRA shrinks made
with their input (`rollout._fused_shrink_kernel`, wherever the NVFP4 decode kernel takes the LoRA terms: sm_80 on)
and the split-KV decode attention (`rollout._split_kv_kernel`, on any target when asked for). Compilation runs in a subprocess per target, because the CPU test
session runs Triton's interpreter (conftest.py), under which `@triton.jit` functions cannot be compiled. As a
control, the Hopper variant must fail on the older targets, as it did before dispatch existed (fp8e4nv below
sm_89, `mul.bf16x2` below sm_90): otherwise these compiles would not be testing anything.

The dispatch decision itself (capability -> variant, one warning per fallback) is tested in-process.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch


pytest.importorskip("triton")

from trl_qerl.nvfp4 import kernels as K  # noqa: E402


TARGETS = {75: "T4", 80: "A100", 89: "L4", 90: "H200"}
# Targets compiled by one subprocess: two processes for two cores, each paying torch's import once
_GROUPS = ((75, 89), (80, 90))
_TRITON_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


# -- what the dispatcher launches ------------------------------------------------------------------------------
def kernel_specs(path: K.TritonPath) -> dict[str, tuple[str, dict, dict, dict]]:
    """label -> (kernel name, signature, constexprs, options) of every kernel `path` launches, mirroring the
    launchers' arguments: the fused matmul and GEMV and the split-K reduction for each activation dtype it serves,
    the dequantisation for each output dtype."""
    scale = "fp8e4nv" if path.fp8_scales else "u8"
    specs = {}
    for dtype in path.matmul_dtypes:
        t = _TRITON_DTYPE[dtype]
        pointers = _types(f"x_ptr=*{t} words_ptr=*i32 scale_ptr=*{scale} global_scale_ptr=*fp32 out_ptr=*{t}")
        specs[f"matmul {t}"] = _spec(
            "_nvfp4_matmul_kernel",
            pointers | _types("M N K stride_xm stride_xk stride_wn stride_sn stride_om stride_split"),
            {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 2, "EVEN_K": False, "USE_ASM": path.use_asm},
            {"num_warps": 4, "num_stages": 4},
        )
        specs[f"gemv {t}"] = _spec(
            "_nvfp4_gemv_kernel",
            pointers | _types("N K stride_xk stride_wn stride_sn stride_split"),
            {"BLOCK_N": 32, "BLOCK_K": 256, "SPLIT_K": 2, "USE_ASM": path.use_asm},
            {"num_warps": 4, "num_stages": 1},
        )
        specs[f"splitk-reduce {t}"] = _spec(
            "_splitk_reduce_kernel",
            _types(f"partial_ptr=*fp32 out_ptr=*{t} numel"),
            {"SPLIT_K": 2, "BLOCK": 1024},
            {"num_warps": 4},
        )
    for dtype in path.dequantize_dtypes:
        t = _TRITON_DTYPE[dtype]
        specs[f"dequantize {t}"] = _spec(
            "_dequantize_kernel",
            _types(f"words_ptr=*i32 scale_ptr=*{scale} global_scale_ptr=*fp32 out_ptr=*{t} N K"),
            {"BLOCK_N": 16, "BLOCK_K": 256, "USE_ASM": path.use_asm},
            {"num_warps": 4},
        )
    return specs


def rollout_specs(capability: int) -> dict[str, tuple[str, dict, dict, dict]]:
    """label -> spec of the fused decode step's Triton kernels at 7B decode shapes, in the widest 16-bit dtype
    ``capability`` multiplies in (bf16 from sm_80, else fp16): the norm shrink in one step and in two passes, the
    SiLU·up shrink over 8 rows in split spans, the split-KV partials (merging in the launch or not; rotating q and k
    and writing the cache) and merge."""
    from _sass import rollout_argument_types, triton_signature

    from trl_qerl.rollout import _fused_shrink_kernel as shrink

    t = "bf16" if capability >= 80 else "fp16"
    types = rollout_argument_types(t)

    def rollout(kernel: str, constexprs: dict, num_warps: int) -> tuple[str, dict, dict, dict]:
        signature = triton_signature(_kernel(kernel), constexprs, types)
        return _spec(kernel, signature, constexprs, {"num_warps": num_warps})

    specs = {}
    if capability >= 80:
        for one_step in (True, False):
            constexprs = {"HAS_RESIDUAL": True, "OUT": _tl(t), "BLOCK_R": 2, "BLOCK_K": 4096, "ROWS": 1,
                          "ONE_STEP": one_step, "PASSES": 1, "PDL": False}  # fmt: skip
            specs[f"norm shrink {'one step' if one_step else 'two passes'} {t}"] = rollout(
                "shrink._norm_shrink_kernel", constexprs, shrink._warps(4096)
            )
        specs[f"plain shrink {t}"] = rollout(
            "shrink._shrink_kernel",
            {"BLOCK_R": 2, "BLOCK_K": 4096, "ONE_STEP": True, "PDL": False},
            shrink._warps(4096),
        )
        padded, block, columns, _ = shrink.rows_layout(8, 18944, [32])
        specs[f"silu shrink over 8 rows, 4 spans {t}"] = rollout(
            "shrink._silu_mul_shrink_rows_kernel",
            {"OUT": _tl(t), "ROWS": padded, "BLOCK_R": block, "BLOCK_K": columns, "SPLITS": 4, "PDL": False},
            shrink.ROWS_WARPS,
        )
    shape = {"KV_HEADS": 4, "GROUP": 7, "GROUP_PAD": 16, "HEAD_DIM": 128, "SPLITS": 8, "SPLITS_PAD": 8,
             "MIN_STAT": float(torch.finfo(torch.float32).min), "PDL": False}  # fmt: skip
    from trl_qerl.rollout import decode_attention as attention

    block = attention.BLOCK
    merge_tiles = {"DIM_BLOCK": attention.MERGE_DIM_BLOCK, "SPLIT_BLOCK": attention.MERGE_SPLITS}
    for merge, rotary in ((False, False), (True, False), (False, True)):
        constexprs = {**shape, "CHUNK": 2 * block, "BLOCK": block, "DOT_DTYPE": _tl(t), "DOT_PRECISION": "tf32",
                      "MERGE": merge, **{f"MERGE_{k}": v for k, v in merge_tiles.items()}, "ROTARY": rotary,
                      "IO": _tl(t)}  # fmt: skip
        label = "split-KV partials" + (" + merge" if merge else "") + (" + rotary" if rotary else "")
        specs[f"{label} {t}"] = rollout("split_kv._partials_kernel", constexprs, attention.PARTIALS_WARPS)
    specs[f"split-KV merge {t}"] = rollout("split_kv._merge_kernel", {**shape, "CHUNK": 2 * block, **merge_tiles}, 4)
    return specs


def _tl(name: str):
    import triton.language as tl

    return {"bf16": tl.bfloat16, "fp16": tl.float16}[name]


def _kernel(name: str):
    """A kernel by name: ``"shrink.<name>"`` / ``"split_kv.<name>"`` in the rollout's kernel modules, else in
    `nvfp4._matmul_kernel`."""
    from trl_qerl.nvfp4 import _matmul_kernel
    from trl_qerl.rollout import _fused_shrink_kernel, _split_kv_kernel

    module, _, kernel = name.rpartition(".")
    return getattr({"": _matmul_kernel, "shrink": _fused_shrink_kernel, "split_kv": _split_kv_kernel}[module], kernel)


def _types(arguments: str) -> dict[str, str]:
    """Triton signature types, i32 where none is given: ``"a=*fp32 n"`` -> ``{"a": "*fp32", "n": "i32"}``."""
    return dict((*argument.split("="), "i32")[:2] for argument in arguments.split())


def _spec(kernel: str, signature: dict, constexprs: dict, options: dict) -> tuple[str, dict, dict, dict]:
    return kernel, {**signature, **dict.fromkeys(constexprs, "constexpr")}, constexprs, options


def _control_specs(capability: int) -> dict[str, tuple[str, dict, dict, dict]]:
    """The Hopper dequantisation kernel where the dispatcher does not use Hopper's variant: it must fail."""
    if K.triton_path(divmod(capability, 10)) is K.HOPPER:
        return {}
    return {"control: sm90 dequantize bf16": kernel_specs(K.HOPPER)["dequantize bf16"]}


def compile_for(capability: int) -> dict[str, str]:
    """label -> "" if it compiled for sm_<capability>, else the error's telling line."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    path = K.triton_path(divmod(capability, 10))
    specs = {**kernel_specs(path), **rollout_specs(capability), **_control_specs(capability)}
    target = GPUTarget("cuda", capability, 32)
    results = {}
    for label, (kernel, signature, constexprs, options) in specs.items():
        source = ASTSource(fn=_kernel(kernel), signature=signature, constexprs=constexprs)
        try:
            triton.compile(source, target=target, options=options)
            results[label] = ""
        except K.TRITON_ERRORS as error:
            results[label] = f"{type(error).__name__}: {K._first_error_line(error)}"
    return results


# -- cross-compilation ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Callable[[int], dict[str, str]]:
    """capability -> `compile_for`'s results, from subprocesses all started at once (compilation is
    single-threaded)."""
    directory = tmp_path_factory.mktemp("kernel-targets")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(directory / "cache")  # compile for real, not from an earlier run's cache
    processes: dict[int, subprocess.Popen] = {}
    for group in _GROUPS:
        name = "sm" + "-".join(map(str, group))
        # Output to a file, not a pipe: Triton prints whole PTX listings when ptxas fails (the controls)
        with open(directory / f"{name}.log", "w") as log:
            process = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), str(directory / f"{name}.json"), *map(str, group)],
                stdout=log, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        processes.update(dict.fromkeys(group, (process, directory / name)))
    return lambda capability: _results(*processes[capability])[str(capability)]


@functools.cache
def _results(process: subprocess.Popen, stem: Path) -> dict[str, dict[str, str]]:
    process.wait(timeout=300)
    log = stem.with_suffix(".log").read_text()
    assert process.returncode == 0, f"compiling subprocess failed:\n{log[-3000:]}"
    return json.loads(stem.with_suffix(".json").read_text())


@pytest.mark.parametrize("capability", sorted(TARGETS), ids=lambda c: f"sm{c}-{TARGETS[c]}")
def test_dispatched_kernels_compile_for_target(compiled, capability):
    results = compiled(capability)
    path = K.triton_path(divmod(capability, 10))
    assert path is not None
    assert set(kernel_specs(path)) | set(rollout_specs(capability)) <= set(results)
    failures = {label: error for label, error in results.items() if error and not label.startswith("control")}
    assert not failures, f"sm_{capability} ({path.name}): {failures}"
    for label, error in results.items():
        if label.startswith("control"):
            assert error, f"{label} compiled for sm_{capability}; the control no longer tests anything"


# -- dispatch decision ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "capability, expected",
    [((6, 1), None), ((7, 0), None), ((7, 5), K.TURING), ((8, 0), K.AMPERE), ((8, 6), K.AMPERE), ((8, 9), K.AMPERE),
     ((9, 0), K.HOPPER), ((10, 0), K.HOPPER), ((12, 0), K.HOPPER)],
)  # fmt: skip
def test_triton_path_by_capability(capability, expected):
    assert K.triton_path(capability) is expected


def test_only_hopper_uses_its_instructions():
    assert K.HOPPER.use_asm and K.HOPPER.fp8_scales
    for path in (K.AMPERE, K.TURING):
        assert not path.use_asm and not path.fp8_scales
    assert torch.bfloat16 not in K.TURING.matmul_dtypes  # sm_75 has no bf16 MMA: dequantise + torch instead


@pytest.fixture
def fresh_dispatch(monkeypatch):
    """Empty per-device caches, restored afterwards."""
    monkeypatch.setattr(K, "_PATH_BY_DEVICE", {})
    monkeypatch.setattr(K, "_BROKEN", set())


def test_device_path_is_decided_once_per_device_with_one_warning(monkeypatch, caplog, fresh_dispatch):
    capabilities = {0: (9, 0), 1: (7, 0), 2: (7, 5)}  # one host, three GPU generations
    asked = []
    monkeypatch.setattr(K, "device_capability", lambda index: asked.append(index) or capabilities[index])
    with caplog.at_level(logging.WARNING, logger=K.logger.name):
        for _ in range(3):
            assert K.device_path(torch.device("cuda", 0)) is K.HOPPER
            assert K.device_path(torch.device("cuda", 1)) is None
            assert K.device_path(torch.device("cuda", 2)) is K.TURING
    assert sorted(asked) == [0, 1, 2]
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1 and "cuda:1" in warnings[0] and "sm_70" in warnings[0]
    assert K.device_path(torch.device("cpu")) is K.INTERPRETER


def _triton_error() -> Exception:
    error_type = getattr(K.triton.runtime.errors, "PTXASError", None)
    if error_type is None:
        return K.triton.runtime.errors.OutOfResources(1 << 17, 1 << 16, "shared memory")
    return error_type("ptxas x.ptx, line 1; error   : Feature 'mul.bf16x2' requires .target sm_90 or higher\n" * 3)


def test_compile_error_falls_back_once_with_one_warning(caplog, fresh_dispatch):
    device = torch.device("cuda", 3)
    launches = []

    def broken():
        launches.append(1)
        raise _triton_error()

    with caplog.at_level(logging.WARNING, logger=K.logger.name):
        for _ in range(3):
            assert K.guarded("matmul", device, torch.bfloat16, broken, lambda: "reference") == "reference"
    assert len(launches) == 1  # never retried
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1 and "cuda:3" in warnings[0] and "mul.bf16x2" in warnings[0]
    assert len(warnings[0]) < 600  # the error's telling line, not ptxas' whole listing
    # other dtypes, kernels and devices are not affected
    assert K.guarded("matmul", device, torch.float16, lambda: "triton", lambda: "reference") == "triton"
    assert K.guarded("dequantize", device, torch.bfloat16, lambda: "triton", lambda: "reference") == "triton"
    assert K.guarded("matmul", torch.device("cuda", 0), torch.bfloat16, lambda: "triton", lambda: "ref") == "triton"


def test_other_errors_are_not_swallowed(fresh_dispatch):
    def failing():
        raise ValueError("a real bug")

    with pytest.raises(ValueError, match="a real bug"):
        K.guarded("matmul", torch.device("cuda", 0), torch.bfloat16, failing, lambda: "reference")


if __name__ == "__main__":  # the compiling subprocess: python test_kernel_targets.py <results.json> <capability>...
    results = {capability: compile_for(int(capability)) for capability in sys.argv[2:]}
    Path(sys.argv[1]).write_text(json.dumps(results))
