"""NVFP4 matmul kernels for CUDA, registered as `torch.library` custom ops, and the per-shape choice among them.

A leaf: `trl_qerl.nvfp4.dispatch` imports it the first time CUDA activations reach an NVFP4 layer and registers
``nvfp4_linear_op`` / ``nvfp4_grad_input_op`` as the CUDA kernels of `NVFP4A16Linear`;
``nvfp4_linear_grouped_op`` computes q/k/v (or gate/up) in one launch from their separate weights. These ops are made
from plain functions (`eager_linear`, `eager_grad_input`, `eager_grouped`, `eager_grouped_lora`), which `dispatch`
calls directly where nothing traces.

Kernels:

* the CUDA decode kernel (`cuda_mma`, source `csrc/nvfp4_mma.cu`, compiled at run time by NVRTC, sm_80+): few
  activation rows, weights read once and dequantised in registers, ``mma.sync`` tensor-core products, split-K
  inside the CTA (one launch), up to three weights per launch;
* the CUDA tiled kernel (same source and launcher, `cuda_mma.TileConfig`): 16 to a few hundred rows, activations
  staged in shared memory once per CTA through a cp.async pipeline and reused by every warp's weight rows;
* the Hopper wgmma kernel (`cuda_wgmma`, source `csrc/nvfp4_wgmma.cu`, sm_90a): 64 to a few hundred rows, the same
  staging, activations read by the tensor cores from shared memory once per warpgroup;
* the Triton kernels (`_matmul_kernel`): `_nvfp4_matmul_kernel`, ``out = x @ dequant(W).T`` with the packed
  E2M1 weights and FP8 block scales read once and dequantised in registers, fp32 accumulation, the global scale
  applied in the epilogue. It computes the transposed product ``W_tile @ x_tile.T`` so that the weight tile is the
  register-side MMA operand and a handful of activation rows fill the MMA's narrow dimension; split-K spreads
  small-N shapes over all multiprocessors, its partial sums reduced by `_splitk_reduce_kernel`. And
  `_dequantize_kernel`: the dense weight, bit-identical to `format.dequantize`, used for large M (dequantise into a
  temporary, then cuBLAS) and for the backward pass ``grad_out @ dequant(W)``.

Each (shape, M bucket, dtype) picks among these by timing them as CUDA-graph replays the first time it is seen
outside CUDA-graph capture (`NVFP4_AUTOTUNE=0` disables this and uses the heuristic; choices timed on known GPUs
ship in ``tuned/``).

Which variant runs depends on the GPU: the CUDA decode kernel from sm_80 wherever NVRTC and the driver library are
there (``NVFP4_CUDA_KERNELS=0`` turns it off); Triton (`triton_path`) sm_90+ the inline-PTX kernels, sm_75-sm_89 the
pure-Triton dequantisation with byte-decoded scales (fused bf16 kernels from sm_80, fp16 from sm_75); older GPUs,
and any kernel that fails to build, PyTorch (dequantise, then matmul) after one logged warning. A build error
never stops training: the CUDA kernel falls back to Triton, Triton to PyTorch.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple, TypeVar

import torch
import triton

from . import cuda_mma, cuda_wgmma, nvrtc, twiddle
from ._files import write_atomically
from ._matmul_kernel import _dequantize_kernel, _nvfp4_gemv_kernel, _nvfp4_matmul_kernel, _splitk_reduce_kernel
from .cuda_mma import MMAConfig, TileConfig
from .cuda_wgmma import WgmmaConfig
from .format import dequantize
from .lora_terms import add_lora_terms


logger = logging.getLogger(__name__)

# -- which variant a GPU runs ----------------------------------------------------------------------------------
_16_BIT = (torch.bfloat16, torch.float16)
_ALL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class TritonPath:
    """The kernel variant that compiles on one range of GPU architectures (`tests/test_kernel_targets.py`
    cross-compiles each for its targets).

    Attributes:
        name: shown in logs.
        use_asm: dequantise with the inline PTX (its `mul.bf16x2` needs sm_90).
        fp8_scales: load block scales as fp8e4nv (Triton has that type only from sm_89); otherwise as bytes,
            decoded with integer operations.
        matmul_dtypes: activation dtypes the fused kernels serve; others dequantise and multiply with torch.
        dequantize_dtypes: output dtypes `_dequantize_kernel` serves; others use the pure-torch dequantisation.
    """

    name: str
    use_asm: bool
    fp8_scales: bool
    matmul_dtypes: tuple[torch.dtype, ...]
    dequantize_dtypes: tuple[torch.dtype, ...]


HOPPER = TritonPath("sm90", use_asm=True, fp8_scales=True, matmul_dtypes=_16_BIT, dequantize_dtypes=_ALL_DTYPES)
# One portable variant for all of sm_80-sm_89: decoding a byte costs ~4 integer instructions per 16 weights, so
# fp8e4nv loads on sm_89 would not be worth a third variant.
AMPERE = TritonPath("sm80", use_asm=False, fp8_scales=False, matmul_dtypes=_16_BIT, dequantize_dtypes=_ALL_DTYPES)
# sm_75 has no bf16 arithmetic (Triton emulates it and its dots become FMAs): bf16 activations there dequantise
# with Triton and multiply with torch.
TURING = TritonPath(
    "sm75", use_asm=False, fp8_scales=False, matmul_dtypes=(torch.float16,), dequantize_dtypes=_ALL_DTYPES
)
# Triton's interpreter (CPU tests) runs everything but the inline PTX
INTERPRETER = TritonPath("interpreter", use_asm=False, fp8_scales=True, matmul_dtypes=_16_BIT,
                         dequantize_dtypes=_ALL_DTYPES)  # fmt: skip


def triton_path(capability: tuple[int, int]) -> TritonPath | None:
    """The variant for a GPU of this compute capability; None where none compiles (before sm_75)."""
    if capability >= (9, 0):
        return HOPPER
    if capability >= (8, 0):
        return AMPERE
    if capability >= (7, 5):
        return TURING
    return None


def device_capability(index: int) -> tuple[int, int]:
    """Compute capability of CUDA device ``index`` (a seam for tests)."""
    return torch.cuda.get_device_capability(index)


_PATH_BY_DEVICE: dict[int, TritonPath | None] = {}


def device_path(device: torch.device) -> TritonPath | None:
    """The variant ``device`` runs, decided once per CUDA device (a host may mix GPU generations); None means the
    pure-torch reference, announced by one warning. Non-CUDA tensors reach Triton only through its interpreter."""
    if device.type != "cuda":
        return INTERPRETER
    index = nvrtc.device_index(device)
    if index not in _PATH_BY_DEVICE:
        capability = device_capability(index)
        _PATH_BY_DEVICE[index] = triton_path(capability)
        if _PATH_BY_DEVICE[index] is None:
            logger.warning(
                "NVFP4: no Triton kernels compile for cuda:%d (sm_%d%d, Triton needs sm_75 or newer); NVFP4 layers "
                "there use the pure-torch reference (dequantise, then matmul): correct, but slower.",
                index, *capability,
            )  # fmt: skip
    return _PATH_BY_DEVICE[index]


def _triton_errors() -> tuple[type[Exception], ...]:
    # Errors Triton raises while compiling or loading a kernel: the front end (unsupported type), ptxas
    # (unsupported instruction) and the loader (too much shared memory). CUDA errors are not among them.
    names = (("compiler.errors", "CompilationError"), ("runtime.errors", "OutOfResources"),
             ("runtime.errors", "PTXASError"), ("errors", "TritonError"))  # fmt: skip
    found = []
    for module, name in names:
        value = triton
        for part in (*module.split("."), name):
            value = getattr(value, part, None)
        if isinstance(value, type):
            found.append(value)
    return tuple(found)


TRITON_ERRORS = _triton_errors()
_BROKEN: set[tuple[int, str, torch.dtype]] = set()
T = TypeVar("T")


def guarded(kernel: str, device: torch.device, dtype: torch.dtype, launch: Callable[[], T],
            fallback: Callable[[], T]) -> T:  # fmt: skip
    """``launch()``, or ``fallback()`` from the first Triton compile error on (device, kernel, dtype) on, with one
    warning: a kernel that does not build on some GPU must cost speed, never the training run."""
    key = (nvrtc.device_index(device) if device.type == "cuda" else -1, kernel, dtype)
    if key in _BROKEN:
        return fallback()
    try:
        return launch()
    except TRITON_ERRORS as error:
        _BROKEN.add(key)
        logger.warning(
            "NVFP4: the Triton %s kernel (%s) failed to build on %s; it falls back to dequantising and multiplying "
            "in PyTorch there (correct, but slower). %s: %s", kernel, str(dtype).removeprefix("torch."), device,
            type(error).__name__, _first_error_line(error),
        )  # fmt: skip
        return fallback()


def _first_error_line(error: Exception) -> str:
    # ptxas errors carry the whole PTX listing; the line that names the problem is enough for a log
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    useful = [line for line in lines if re.match(r"ptxas .*error\s*:", line)]  # "ptxas x.ptx, line 9; error   : ..."
    useful += [line for line in lines if "error" in line.lower()] + lines + [""]
    return useful[0][:300]


# -- launchers ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FusedConfig:
    """One launch configuration of `_nvfp4_matmul_kernel`."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    gemv: bool = False
    """Use the one-row FMA kernel (M == 1, K a multiple of block_k * split_k) instead of the MMA kernel."""

    def __str__(self) -> str:
        split = f" split{self.split_k}" if self.split_k > 1 else ""
        kind = "gemv" if self.gemv else "fused"
        return f"{kind} {self.block_m}x{self.block_n}x{self.block_k}{split} w{self.num_warps}s{self.num_stages}"


DEQUANT_CUBLAS = "dequantize+cublas"


def _use_asm() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") != "1" and os.environ.get("NVFP4_TRITON_ASM", "1") != "0"


def _launch_settings(device: torch.device, weight_scale: torch.Tensor, use_asm: bool | None):
    """(scales as the kernels should load them, use_asm) for ``device``'s variant; an explicit ``use_asm`` wins.
    Direct calls on a GPU without a variant try the portable settings (the ops never launch there)."""
    path = device_path(device) or AMPERE
    scales = weight_scale if path.fp8_scales else weight_scale.view(torch.uint8)
    return scales, (path.use_asm and _use_asm()) if use_asm is None else use_asm


def fused_matmul(x: torch.Tensor, weight_packed, weight_scale, weight_global_scale, config: FusedConfig, use_asm=None):
    """``x[M, K] @ dequant(W).T`` with one fused kernel (plus a reduction when split-K).

    ``weight_scale`` may also be passed as its uint8 view: the kernels then decode the bytes themselves."""
    m, k = x.shape
    n = weight_packed.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    split = config.split_k
    target = out if split == 1 else torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), split)
    weight_scale, use_asm = _launch_settings(x.device, weight_scale, use_asm)
    if config.gemv:
        if m != 1 or k % (config.block_k * split):
            raise ValueError(f"{config} needs one row and K divisible by {config.block_k * split}; got M={m}, K={k}.")
        _nvfp4_gemv_kernel[grid](
            x, weight_packed.view(torch.int32), weight_scale, weight_global_scale, target,
            n, k, x.stride(1), k // 8, k // 16, m * n,
            BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=split, USE_ASM=use_asm,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )  # fmt: skip
    else:
        _launch_matmul(x, weight_packed, weight_scale, weight_global_scale, target, config, use_asm)
    if split > 1:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](target, out, m * n, SPLIT_K=split, BLOCK=block)
    return out


def _launch_matmul(x, weight_packed, weight_scale, weight_global_scale, target, config, use_asm):
    m, k = x.shape
    n = weight_packed.shape[0]
    split = config.split_k
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), split)
    _nvfp4_matmul_kernel[grid](
        x, weight_packed.view(torch.int32), weight_scale, weight_global_scale, target,
        m, n, k,
        x.stride(0), x.stride(1), k // 8, k // 16, n, m * n,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=split,
        EVEN_K=k % (config.block_k * split) == 0, USE_ASM=use_asm,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


def dequantize_cuda(weight_packed, weight_scale, weight_global_scale, dtype=torch.bfloat16, use_asm=None, out=None):
    """Dense ``[N, K]`` weight on the GPU, bit-identical to `format.dequantize` (``weight_scale`` as in
    `fused_matmul`), written into ``out`` (contiguous ``[N, K]``) if given."""
    n, k = weight_packed.shape[0], weight_packed.shape[1] * 2
    out = torch.empty(n, k, device=weight_packed.device, dtype=dtype) if out is None else out
    block_n, block_k = 16, 256
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    weight_scale, use_asm = _launch_settings(weight_packed.device, weight_scale, use_asm)
    _dequantize_kernel[grid](
        weight_packed.view(torch.int32), weight_scale, weight_global_scale, out, n, k,
        BLOCK_N=block_n, BLOCK_K=block_k, USE_ASM=use_asm, num_warps=4,
    )  # fmt: skip
    return out


def _dequantize_then_linear(x, weight_packed, weight_scale, weight_global_scale):
    return torch.nn.functional.linear(x, dequantize_cuda(weight_packed, weight_scale, weight_global_scale, x.dtype))


@dataclass(frozen=True)
class DequantChunks:
    """Dequantise the rows of one weight, or of a group read by the same activations (q/k/v, gate/up), ``chunk_mb``
    MB of 16-bit rows at a time into one reused buffer and multiply each chunk with cuBLAS straight into its columns
    of the output: the temporary stays bounded instead of a 16-bit copy of the whole layer. ``chunk_mb=0``
    dequantises all rows at once (for a group: one cuBLAS call instead of one per weight)."""

    chunk_mb: int

    def chunk_rows(self, total_rows: int, k: int) -> int:
        if self.chunk_mb == 0:
            return total_rows
        return max(128, (self.chunk_mb << 20) // (2 * k) // 128 * 128)

    def __str__(self) -> str:
        return f"dequantize+cublas {self.chunk_mb} MB chunks" if self.chunk_mb else "dequantize all+cublas"


def dequantize_in_chunks(x: torch.Tensor, weights: Sequence[cuda_mma.Weight], biases: Sequence[torch.Tensor | None],
                         chunk: DequantChunks) -> torch.Tensor:  # fmt: skip
    """``cat([x @ dequant(W_i).T + b_i], dim=1)`` by `DequantChunks`: a chunk may span two weights of a group."""
    m, k = x.shape
    sizes = [packed.shape[0] for packed, _, _ in weights]
    total = sum(sizes)
    rows = min(total, chunk.chunk_rows(total, k))
    out = torch.empty(m, total, device=x.device, dtype=x.dtype)
    buffer = torch.empty(rows, k, device=x.device, dtype=x.dtype)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    for begin in range(0, total, rows):
        end = min(total, begin + rows)
        for start, size, (packed, scale, global_scale) in zip(starts, sizes, weights):
            lo, hi = max(begin, start), min(end, start + size)
            if lo < hi:  # rows lo..hi of the group are rows lo - start.. of this weight
                part = slice(lo - start, hi - start)
                dequantize_cuda(packed[part], scale[part], global_scale, x.dtype, out=buffer[lo - begin : hi - begin])
        torch.mm(x, buffer[: end - begin].T, out=out[:, begin:end])
    for start, size, bias in zip(starts, sizes, biases):
        if bias is not None:
            out[:, start : start + size] += bias.to(out.dtype)
    return out


# -- choosing a kernel ----------------------------------------------------------------------------------------
Choice = FusedConfig | MMAConfig | TileConfig | WgmmaConfig | DequantChunks | str
"""A Triton tile (`FusedConfig`), an instance of the CUDA decode kernel (`MMAConfig`), of the CUDA tiled kernel
(`TileConfig`) or of the Hopper wgmma kernel (`WgmmaConfig`), a chunked dequantise+cuBLAS (`DequantChunks`), or
`DEQUANT_CUBLAS`."""

MMA_MAX_ROWS = 512
"""Row counts up to which the CUDA decode kernel is a candidate (it re-reads the weights for every 64 rows)."""
TILE_ROWS = (16, 512)
"""Row counts (buckets) for which the CUDA tiled kernel is a candidate (at 1024 rows it took 2-2.5x dequantise +
cuBLAS on the H200, 7B shapes)."""


WGMMA_ROWS = (64, 512)
"""Row counts (buckets) for which the wgmma kernel is a candidate (Hopper only)."""


def tile_candidates(bucket: int, n: int, k: int, device: torch.device | None,
                    num_sms: int) -> list[TileConfig | WgmmaConfig]:  # fmt: skip
    """The tiled kernel's instances for this bucket, and on Hopper (or on a CPU, for tests) the wgmma kernel's,
    sized to ``device``'s shared memory (CPU: Hopper's)."""
    if k % 128:
        return []
    limit, hopper = 227 * 1024, True
    if device is not None and device.type == "cuda":
        limit = nvrtc.max_shared_memory_per_block(nvrtc.device_index(device))
        hopper = cuda_wgmma.runs_on(device)
    configs: list[TileConfig | WgmmaConfig] = []
    if TILE_ROWS[0] <= bucket <= TILE_ROWS[1]:
        configs += cuda_mma.tile_candidate_configs(bucket, n, k, num_sms, limit)
    if hopper and WGMMA_ROWS[0] <= bucket <= WGMMA_ROWS[1]:
        configs += cuda_wgmma.wgmma_candidate_configs(bucket, n, k, num_sms, limit)
    return configs


def m_bucket(m: int) -> int:
    """Row-count bucket that shares one kernel choice: 1 (a GEMV may win), 8 for 2-8 rows (one MMA column of the
    CUDA decode kernel), 16 for 9-16 (the Triton MMA tile is 16 rows anyway), then powers of two up to 8192."""
    if m <= 8:
        return 1 if m == 1 else 8
    return min(max(16, 1 << max(0, (m - 1).bit_length())), 8192)


def candidate_configs(m: int, n: int, k: int, num_sms: int = 132, mma: bool = False,
                      device: torch.device | None = None) -> list[Choice]:  # fmt: skip
    """Configurations worth timing for this shape: the CUDA kernels' instances (``mma``: where they apply; the
    tiled kernel from 16 rows), fused Triton tiles (with split-K for decode), GEMVs for one row, and, above 16
    rows, dequantise+cuBLAS."""
    bucket = m_bucket(m)
    decode = cuda_mma.candidate_configs(bucket, n, k, num_sms) if mma and bucket <= MMA_MAX_ROWS else []
    decode += tile_candidates(bucket, n, k, device, num_sms) if mma else []
    if bucket > 64:
        tiles = [(64, 128, 64, 4), (128, 128, 64, 8), (128, 256, 64, 8), (256, 128, 64, 8)]
        fused = [FusedConfig(bm, bn, bk, 1, warps, 3) for bm, bn, bk, warps in tiles if bm <= bucket]
        return [*decode, *fused, DEQUANT_CUBLAS, *chunked_candidates(bucket, n, k)]

    def splits(block_n, block_k, exact):
        for split in (1, 2, 4, 8):
            too_many = split > 1 and triton.cdiv(n, block_n) * split > 8 * num_sms
            if k >= block_k * split and not too_many and not (exact and k % (block_k * split)):
                yield split

    candidates: list[Choice] = list(decode)
    stages = 4 if bucket <= 16 else 3
    for block_n, block_k, warps in ((32, 128, 4), (32, 256, 4), (64, 128, 4), (64, 256, 4), (128, 128, 4),
                                    (128, 128, 8), (128, 256, 8), (256, 128, 8)):  # fmt: skip
        for split in splits(block_n, block_k, exact=False):
            candidates.append(FusedConfig(max(16, bucket), block_n, block_k, split, warps, stages))
    if bucket == 1:
        for block_n, block_k in ((32, 256), (64, 256), (32, 512)):  # larger tiles spill registers
            for split in splits(block_n, block_k, exact=True):
                candidates.append(FusedConfig(1, block_n, block_k, split, 4, 1, gemv=True))
    return candidates + ([DEQUANT_CUBLAS] if bucket > 16 else [])


CHUNK_MB = 32
"""Rows dequantised per cuBLAS call by the bounded `DequantChunks` (measured on the H200, 7B shapes, 2026-12-02:
32 MB chunks cost 0-7 % against one dequantised copy of the whole weight, 16 MB up to 1.4x and 8 MB up to 2.2x:
cuBLAS products with few output columns written into a wider output are slow)."""


def chunked_candidates(bucket: int, n: int, k: int, group: bool = False) -> list[DequantChunks]:
    """`DequantChunks` worth timing from 256 rows on: a group dequantised into one buffer (one cuBLAS call instead
    of one per weight) while that buffer is at most 64 MB, and `CHUNK_MB` chunks for weights over twice that size
    (a bounded temporary instead of a 16-bit copy of the whole layer)."""
    if bucket < 256:
        return []
    whole = [DequantChunks(0)] if group and 2 * n * k <= 64 << 20 else []
    return whole + ([DequantChunks(CHUNK_MB)] if 2 * n * k >= 2 * (CHUNK_MB << 20) else [])


def heuristic_config(m: int, n: int, k: int, num_sms: int, mma: bool = False) -> Choice:
    """A reasonable choice without timing: the CUDA decode kernel up to 64 rows where it applies, else fill the GPU
    with (N blocks x split-K) Triton programs, and dequantise+cuBLAS above 64 rows."""
    if mma and m <= 64:
        return cuda_mma.heuristic_config(m, n, k, num_sms)
    if m > 64:
        return DEQUANT_CUBLAS
    block_n, block_k = 64, 256 if k >= 512 else 128
    programs = triton.cdiv(n, block_n)
    split = 1
    while programs * split < 2 * num_sms and k >= block_k * split * 2:
        split *= 2
    return FusedConfig(max(16, m_bucket(m)), block_n, block_k, split, 4, 4)


_MMA_BROKEN: set[tuple[int, torch.dtype]] = set()


def mma_usable(x: torch.Tensor, weights: Sequence[cuda_mma.Weight]) -> bool:
    """Whether the CUDA decode kernel serves this call: it applies (`cuda_mma.supports`), NVRTC and the driver
    are there (``NVFP4_CUDA_KERNELS=0`` turns it off) and it has not failed to build on this device before."""
    if os.environ.get("NVFP4_CUDA_KERNELS", "1") == "0" or not cuda_mma.supports(x, weights):
        return False
    if (nvrtc.device_index(x.device), x.dtype) in _MMA_BROKEN:
        return False
    if not nvrtc.available():
        _mma_failed(x, "NVRTC or the CUDA driver library is not available")
        return False
    return True


def _mma_failed(x: torch.Tensor, reason: str) -> None:
    instead = "NVFP4 layers there use the Triton kernels (correct, slower at decode)"
    _retire_once(_MMA_BROKEN, x, "the CUDA decode kernel", reason, instead)


_WGMMA_BROKEN: set[tuple[int, torch.dtype]] = set()


def _cuda_kernel_failed(x: torch.Tensor, choice: Choice, error: Exception) -> None:
    """A CUDA kernel did not build or load: a wgmma instance retires only the wgmma kernel on this device and dtype
    (its sm_90a build and tensor maps are its own), any other the CUDA kernels there (`_mma_failed`). Inside
    `twiddle.twiddled_codes` the failed build is the twiddled one: nothing retires, and `twiddle.TwiddledCodesError`
    sends its caller back to the standard order (whose builds may well be fine)."""
    reason = str(error).splitlines()[0][:300]
    if twiddle.active():
        raise twiddle.TwiddledCodesError(f"the twiddled build of {choice} failed ({reason})") from error
    if not isinstance(choice, WgmmaConfig):
        _mma_failed(x, reason)
        return
    instead = "the other CUDA kernels serve 64-512 rows there (correct, slower)"
    _retire_once(_WGMMA_BROKEN, x, "the wgmma kernel", reason, instead)


def _retire_once(
    broken: set[tuple[int, torch.dtype]], x: torch.Tensor, kernel: str, reason: str, instead: str
) -> None:
    """Adds ``x``'s (device, dtype) to a kernel's ``broken`` set, with one warning the first time."""
    key = (nvrtc.device_index(x.device), x.dtype)
    if key not in broken:
        broken.add(key)
        logger.warning(
            "NVFP4: %s cannot run on %s (%s): %s; %s.", kernel, x.device, str(x.dtype).removeprefix("torch."), reason,
            instead,
        )  # fmt: skip


SEPARATE = "separate products"
"""A grouped product computed one weight at a time (each with its own chosen kernel)."""


class ChoiceKey(NamedTuple):
    """The fields of a `KernelChooser.key` or `KernelChooser.lora_key` string, read back by the tables' device
    filter, ``bench_kernels --retune`` and tests (so that none of them splits the string by position)."""

    device: str
    """``torch.cuda.get_device_name()`` of the GPU the choice was timed on."""
    dtype: str
    """Activation dtype without ``torch.``: ``bfloat16`` or ``float16``."""
    rows: int
    """The row bucket (`m_bucket`)."""
    n: int
    k: int
    group: int = 1
    """Weights in one launch (``key``'s ``group``)."""
    lora_rank: int = 0
    """The LoRA rank of a `lora_key`'s fused launch; 0 for a plain product."""
    window: str = ""
    """The codes' order inside `twiddle.twiddled_codes` (``twiddled`` or ``lanes``, `KernelChooser._twiddled_choice`);
    empty for the standard order."""

    @classmethod
    def parse(cls, key: str) -> ChoiceKey:
        """The fields of ``key``, or a ValueError that names it."""
        match = _CHOICE_KEY.fullmatch(key)
        if match is None:
            raise ValueError(
                f"{key!r} is not a kernel-choice key (device|dtype|rows|n|k[|x<group>][|lora<rank>][|twiddled|lanes])"
            )
        device, dtype, rows, n, k, group, rank, window = match.groups()
        return cls(device, dtype, int(rows), int(n), int(k), int(group or 1), int(rank or 0), window or "")


_CHOICE_KEY = re.compile(r"([^|]+)\|([^|]+)\|(\d+)\|(\d+)\|(\d+)(?:\|x(\d+))?(?:\|lora(\d+))?(?:\|(twiddled|lanes))?")


class KernelChooser:
    """Caches the fastest kernel per (device name, dtype, M bucket, N, K), timing the candidates the first time
    a key is seen outside CUDA-graph capture. ``NVFP4_AUTOTUNE=0`` uses `heuristic_config` instead; `save`/`load`
    keep the choices across runs (``NVFP4_KERNEL_CHOICES=<json>`` loads a file at import)."""

    def __init__(self, autotune: bool | None = None) -> None:
        self.autotune = os.environ.get("NVFP4_AUTOTUNE", "1") != "0" if autotune is None else autotune
        self.choices: dict[str, Choice] = {}
        self.timings: dict[str, dict[str, float]] = {}
        """Milliseconds of every candidate timed in this process, per key (for benchmarks and notes)."""
        self._timing_noted = False

    @staticmethod
    def key(x: torch.Tensor, n: int, k: int, group: int = 1) -> str:
        """Choice key; ``group`` > 1 for one launch over several weights (their rows ``n`` in total)."""
        kind = f"|x{group}" if group > 1 else ""
        return (f"{_device_name(nvrtc.device_index(x.device))}|{str(x.dtype).removeprefix('torch.')}|"
                f"{m_bucket(x.shape[0])}|{n}|{k}{kind}")  # fmt: skip

    def choose(self, x, weight_packed, weight_scale, weight_global_scale) -> Choice:
        m, k = x.shape
        n = weight_packed.shape[0]
        key = self.key(x, n, k)
        weights = [(weight_packed, weight_scale, weight_global_scale)]
        if twiddle.active():
            return self._twiddled_choice(x, weights, key)
        known = self.choices.get(key)
        if known is not None and not isinstance(known, _CUDA_KERNEL_CHOICES):
            return known  # applies to every call (`_applies`): skip `mma_usable`, which only the CUDA kernels need
        mma = mma_usable(x, weights)
        if known is not None and _applies(known, x, weights, mma):
            return known
        num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        # (a CUDA-kernel choice that this call cannot use, e.g. misaligned rows, stays for the calls that can)
        if not self.autotune or torch.cuda.is_current_stream_capturing() or known is not None:
            return heuristic_config(m, n, k, num_sms, mma)
        self._note_timing(key)
        timings = self.timings.setdefault(key, {})
        self.choices[key] = self._fastest(x, weight_packed, weight_scale, weight_global_scale, num_sms, mma, timings)
        return self.choices[key]

    def choose_group(self, x, weights: Sequence[cuda_mma.Weight]) -> Choice:
        """One launch of a CUDA kernel over ``weights`` (an `MMAConfig`, `TileConfig` or `WgmmaConfig`), the group
        dequantised into one buffer (`DequantChunks`) or `SEPARATE` products, whichever is faster (callers check
        `mma_usable`). One weight is `choose`'s call: its key is the single product's, which must never hold a
        group-only choice such as `SEPARATE` (the product would then have no kernel to run)."""
        if len(weights) == 1:
            return self.choose(x, *weights[0])
        m, k = x.shape
        n = sum(w[0].shape[0] for w in weights)
        key = self.key(x, n, k, len(weights))
        if twiddle.active():
            return self._twiddled_choice(x, weights, key)
        if key in self.choices:
            return self.choices[key]
        num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        if not self.autotune or torch.cuda.is_current_stream_capturing():
            return cuda_mma.heuristic_config(m, n, k, num_sms) if m <= 64 else SEPARATE
        self._note_timing(key)
        rows = min(x.shape[0], 8192) if x.shape[0] > 64 else m_bucket(x.shape[0])
        probe = torch.randn(rows, k, device=x.device, dtype=x.dtype)
        configs = cuda_mma.candidate_configs(rows, n, k, num_sms) if rows <= MMA_MAX_ROWS else []
        calls = {c: functools.partial(cuda_mma.matmul, probe, weights, c) for c in configs}
        for config in tile_candidates(m_bucket(rows), n, k, x.device, num_sms):
            if _applies(config, probe, weights, mma=True):
                calls[config] = functools.partial(_run_on_weights, probe, weights, [None] * len(weights), config)
        for chunk in chunked_candidates(m_bucket(rows), n, k, group=True):
            calls[chunk] = functools.partial(dequantize_in_chunks, probe, weights, [None] * len(weights), chunk)
        calls[SEPARATE] = functools.partial(_separate_products, probe, weights, [None] * len(weights))
        self.choices[key] = _fastest_call(calls, self.timings.setdefault(key, {})) or SEPARATE
        return self.choices[key]

    def choose_with_lora(
        self,
        x: torch.Tensor,
        weights: Sequence[cuda_mma.Weight],
        rank: int,
        lora: cuda_mma.LoraInputs | None = None,
    ) -> Choice:
        """The choice for a launch that adds LoRA terms of ``rank`` in its epilogue: the table's `lora_key` entry
        where it has one (a decode-kernel instance timed with the epilogue), else the plain choice (`chosen`), which
        is timed without it (callers check `mma_usable`, as for `choose_group`). Measured on the H200 (7B, rank 32,
        2026-12-03): at one row the epilogue makes other instances the fastest for o and gate/up (5.3 vs 5.8 and
        29.4 vs 30.8 µs per call).

        Where the plain choice cannot take the epilogue (a tiled, wgmma or dequantising choice) and ``lora`` (this
        call's inputs) is given, the decode kernel's instances with the epilogue are timed against the plain choice
        followed by the terms added after it (outside CUDA-graph capture; `TIME_WITH_LORA`), and the faster kept
        under the `lora_key` (with the window's suffix inside `twiddle.twiddled_codes`, as `_twiddled_choice` keys
        its choices; `PLAIN_WITH_TERMS_AFTER` where the plain choice won). The plain choice alone is timed without
        its LoRA terms: at 14B and 16 rows (H100, 2026-12-07) the tiled kernel and the decode kernel took alike for
        q/k/v and gate/up, so the pick flipped between runs, and with the tiled kernel the terms after the product
        (fp32 cuBLAS, adds, casts) made the decode step 10.9-11.0 instead of 8.2 ms."""
        n = sum(w[0].shape[0] for w in weights)
        key = self.lora_key(x, n, x.shape[1], len(weights), rank)
        tuned = self.choices.get(key)
        if isinstance(tuned, MMAConfig):
            return tuned
        plain = chosen(x, weights)
        if lora is None or isinstance(plain, MMAConfig) or not TIME_WITH_LORA:
            return plain
        if twiddle.active():
            key = _window_key(key)
        known = self.choices.get(key)
        if known is None and self.autotune and not torch.cuda.is_current_stream_capturing():
            fastest = self._fastest_with_lora(x, weights, lora, key)
            known = self.choices[key] = fastest if isinstance(fastest, MMAConfig) else PLAIN_WITH_TERMS_AFTER
        return known if isinstance(known, MMAConfig) else plain

    def _fastest_with_lora(
        self, x: torch.Tensor, weights: Sequence[cuda_mma.Weight], lora: cuda_mma.LoraInputs, key: str
    ) -> Choice | None:
        """The fastest of the decode kernel's instances that fit the epilogue (`cuda_mma.lora_fits`), each timed
        with ``lora``'s terms in it, and of the plain choice with the terms added after it (`product_then_lora`,
        recorded as ``"plain + terms after"``)."""
        self._note_timing(key)
        n, k = sum(w[0].shape[0] for w in weights), x.shape[1]
        num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        no_bias = [None] * len(weights)
        calls: dict[Choice, Callable[[], torch.Tensor]] = {
            config: functools.partial(cuda_mma.matmul, x, weights, config, no_bias, lora=lora)
            for config in cuda_mma.candidate_configs(x.shape[0], n, k, num_sms)
            if cuda_mma.lora_fits(config)
        }
        calls[PLAIN_WITH_TERMS_AFTER] = functools.partial(product_then_lora, x, weights, no_bias, lora)
        return _fastest_call(calls, self.timings.setdefault(key, {}))

    def _twiddled_choice(self, x: torch.Tensor, weights: Sequence[cuda_mma.Weight], key: str) -> Choice:
        """Inside `twiddle.twiddled_codes` only the window order's readers read the codes (`window_readers`: the
        CUDA decode and tiled kernels, and in the lane order the wgmma kernel): the table's choice for ``key`` where
        it is one of theirs (the twiddled build of a decode instance is as fast or faster, measured per call on the
        H200), else the fastest reader timed with the window's build (``key|twiddled``: decode instances;
        ``key|lanes``: decode, tiled and wgmma instances), or `cuda_mma.heuristic_config` where timing cannot run.
        `twiddle.TwiddledCodesError` where the decode kernel does not serve the call."""
        if not mma_usable(x, weights):
            twiddle.check_standard_order(f"this product ({x.shape[0]} rows; the CUDA decode kernel does not serve it)")
        known = self.choices.get(key)
        if isinstance(known, window_readers()) and _applies(known, x, weights, mma=True):
            return known
        m, k = x.shape
        n = sum(w[0].shape[0] for w in weights)
        num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        window_key = _window_key(key)
        if window_key not in self.choices:
            if not self.autotune or torch.cuda.is_current_stream_capturing():
                return cuda_mma.heuristic_config(m, n, k, num_sms)
            self._note_timing(window_key)
            probe = torch.randn(m_bucket(m), k, device=x.device, dtype=x.dtype)
            configs: list[Choice] = list(cuda_mma.candidate_configs(m_bucket(m), n, k, num_sms))
            if twiddle.lane_order():
                tiles = tile_candidates(m_bucket(m), n, k, x.device, num_sms)
                configs += [c for c in tiles if _applies(c, probe, weights, mma=True)]
            calls = {config: functools.partial(_run_on_weights, probe, weights, [None] * len(weights), config)
                     for config in configs}  # fmt: skip
            fastest = _fastest_call(calls, self.timings.setdefault(window_key, {}))
            self.choices[window_key] = fastest or cuda_mma.heuristic_config(m, n, k, num_sms)
        return self.choices[window_key]

    @classmethod
    def lora_key(cls, x: torch.Tensor, n: int, k: int, group: int, rank: int) -> str:
        """`key` of a launch with LoRA terms of ``rank`` in the decode kernel's epilogue."""
        return f"{cls.key(x, n, k, group)}|lora{rank}"

    @staticmethod
    def _fastest(x, weight_packed, weight_scale, weight_global_scale, num_sms, mma, timings=None):
        n, k = weight_packed.shape[0], x.shape[1]
        rows = min(x.shape[0], 8192) if x.shape[0] > 64 else m_bucket(x.shape[0])
        probe = torch.randn(rows, k, device=x.device, dtype=x.dtype)
        weights = [(weight_packed, weight_scale, weight_global_scale)]
        calls = {
            candidate: functools.partial(run, probe, weight_packed, weight_scale, weight_global_scale, candidate)
            for candidate in candidate_configs(rows, n, k, num_sms, mma, x.device)
            if _applies(candidate, x, weights, mma)
        }
        return _fastest_call(calls, timings) or heuristic_config(x.shape[0], n, k, num_sms, mma)

    def _note_timing(self, key: str) -> None:
        """Before timing the candidates of a key the table does not hold: one info line per process (the first steps
        of a model shape or GPU the shipped table lacks can spend a minute or more here, e.g. 80 s at 3B on the H200,
        and nothing else would say why), then a debug line per key."""
        if not self._timing_noted:
            self._timing_noted = True
            logger.info(
                "NVFP4: timing kernel candidates for shapes the kernel table does not hold (first: %s). The first "
                "steps of a new model shape or GPU spend up to a minute or two on this; later calls reuse the "
                "choices. KernelChooser.save / NVFP4_KERNEL_CHOICES=<json> keep them across runs; NVFP4_AUTOTUNE=0 "
                "skips timing (heuristic choices).", key,
            )  # fmt: skip
        logger.debug("NVFP4: timing kernel candidates for %s", key)

    def save(self, path: str | os.PathLike, device: str | None = None, merge: bool = False) -> int:
        """Writes the choices as JSON (`load` reads them) and returns how many it wrote.

        Args:
            path: the JSON file.
            device: write only this chooser's keys of this device name (`torch.cuda.get_device_name()`): the
                choices also hold the shipped tables of other GPUs, loaded at import.
            merge: keep the entries already in ``path`` that this chooser does not hold, so runs of several model
                shapes can fill one table (this chooser's entries win where both have a key).
        """
        ours = {key: _choice_to_json(c) for key, c in self.choices.items()}
        if device is not None:
            ours = {key: choice for key, choice in ours.items() if ChoiceKey.parse(key).device == device}
        table = _read_choice_table(path) if merge and Path(path).exists() else {}
        table.update(ours)
        write_atomically(path, json.dumps(dict(sorted(table.items())), indent=1))
        return len(table)

    def load(self, path: str | os.PathLike) -> None:
        """Adds the choices of a table written by `save`; a ValueError names the file and the key of an entry that
        no call could run (`SEPARATE` under a single product's key, as tables saved before 2026-12-06 could hold)."""
        table = {key: _choice_from_json(c) for key, c in _read_choice_table(path).items()}
        for key, choice in table.items():
            if choice == SEPARATE and ChoiceKey.parse(key).group == 1:
                raise ValueError(
                    f"{path}: {key!r} holds {SEPARATE!r}, a choice for a group of weights, under one weight's key; "
                    "delete that entry (the product is timed again on first use)"
                )
        self.choices.update(table)


def _read_choice_table(path: str | os.PathLike) -> dict:
    """A table written by `KernelChooser.save`, or a ValueError that names the file."""
    try:
        table = json.loads(Path(path).read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not a kernel-choice table ({error}); give KernelChooser.save's file") from error
    if not isinstance(table, dict):
        raise ValueError(f"{path} is not a kernel-choice table (a JSON object of key -> choice)")
    return table


def _window_key(key: str) -> str:
    """``key`` inside `twiddle.twiddled_codes`: with the window's order (`ChoiceKey.window`), whose readers differ."""
    return f"{key}|lanes" if twiddle.lane_order() else f"{key}|twiddled"


_CUDA_KERNEL_CHOICES = (MMAConfig, TileConfig, WgmmaConfig)
"""Choices that only some calls can run (`_applies`); the others (Triton, dequantise+cuBLAS) run on any."""


@functools.cache
def _device_name(index: int) -> str:
    # Part of every choice key, asked on every call: torch's lookup costs a few µs of host time each time
    return torch.cuda.get_device_name(index)


def _applies(choice: Choice, x: torch.Tensor, weights: Sequence[cuda_mma.Weight], mma: bool) -> bool:
    """Whether this call can run ``choice``: the CUDA kernels only where `mma_usable` (``mma``) holds, the tiled one
    also needs `cuda_mma.supports_tile`, the wgmma one `cuda_wgmma.supports_wgmma`; any other choice always."""
    if not isinstance(choice, _CUDA_KERNEL_CHOICES):
        return True
    if isinstance(choice, TileConfig):
        return mma and cuda_mma.supports_tile(x, weights)
    if isinstance(choice, WgmmaConfig):
        broken = (nvrtc.device_index(x.device), x.dtype) in _WGMMA_BROKEN
        return mma and not broken and cuda_wgmma.supports_wgmma(x, weights)
    return mma


def _fastest_call(
    calls: dict[Choice, Callable[[], torch.Tensor]], record: dict[str, float] | None = None
) -> Choice | None:
    """The choice whose call runs fastest as CUDA-graph replays (how decode runs: host launch overhead would swamp
    small kernels); choices that fail to build are skipped. ``record`` receives each choice's milliseconds."""
    timings = {}
    for choice, call in calls.items():
        try:
            call()  # compile outside the graph
            timings[choice] = triton.testing.do_bench_cudagraph(call, rep=10, return_mode="median")
        except (triton.runtime.errors.OutOfResources, RuntimeError):  # NVRTCError is a RuntimeError
            continue
    if record is not None:
        record.update({str(choice): ms for choice, ms in timings.items()})
    return min(timings, key=timings.get) if timings else None


_TAGGED_CHOICES = {"mma": MMAConfig, "tile": TileConfig, "wgmma": WgmmaConfig, "dequant_chunks": DequantChunks}


def _choice_to_json(choice: Choice):
    if isinstance(choice, str):
        return choice
    kind = next((name for name, cls in _TAGGED_CHOICES.items() if isinstance(choice, cls)), None)
    return {"kernel": kind, **asdict(choice)} if kind else asdict(choice)


def _choice_from_json(entry) -> Choice:
    if isinstance(entry, str):
        return entry
    if entry.get("kernel") in _TAGGED_CHOICES:
        return _TAGGED_CHOICES[entry["kernel"]](**{key: value for key, value in entry.items() if key != "kernel"})
    return FusedConfig(**entry)


TWIDDLED_READERS = (MMAConfig, TileConfig)
"""The choices whose builds read the twiddled code order inside `twiddle.twiddled_codes` (they share the decode)."""
LANE_ORDER_READERS = (MMAConfig, TileConfig, WgmmaConfig)
"""The choices whose builds read the lane order (``twiddle.twiddled_codes(..., lanes=True)``)."""


def window_readers() -> tuple[type, ...]:
    """The choices that may read the codes now: inside `twiddle.twiddled_codes` the window order's readers."""
    return LANE_ORDER_READERS if twiddle.lane_order() else TWIDDLED_READERS


def run(x, weight_packed, weight_scale, weight_global_scale, choice: Choice) -> torch.Tensor:
    if not isinstance(choice, window_readers()):
        twiddle.check_standard_order(f"the NVFP4 kernel choice {choice}")
    if choice == DEQUANT_CUBLAS:
        return _dequantize_then_linear(x, weight_packed, weight_scale, weight_global_scale)
    out = _run_on_weights(x, [(weight_packed, weight_scale, weight_global_scale)], [None], choice)
    return out if out is not None else fused_matmul(x, weight_packed, weight_scale, weight_global_scale, choice)


def _run_on_weights(x, weights: Sequence[cuda_mma.Weight], biases: Sequence[torch.Tensor | None], choice: Choice):
    """``cat([x @ W_i.T + b_i], dim=1)`` by a choice that takes a list of weights (one weight, or a q/k/v or gate/up
    group in one launch): the CUDA kernels and `DequantChunks`; None for any other choice."""
    if isinstance(choice, MMAConfig):
        return cuda_mma.matmul(x, weights, choice, biases)
    if isinstance(choice, TileConfig):
        return cuda_mma.tile_matmul(x, weights, choice, biases)
    if isinstance(choice, WgmmaConfig):  # (refuses the twiddled order itself; reads the lane order)
        return cuda_wgmma.wgmma_matmul(x, weights, choice, biases)
    twiddle.check_standard_order(f"the NVFP4 kernel choice {choice}")
    if isinstance(choice, DequantChunks):
        return dequantize_in_chunks(x, weights, biases, choice)
    return None


CHOOSER = KernelChooser()
# Choices timed on known GPUs ship with the package (keys carry the device name), so those skip tuning
for _table in sorted((Path(__file__).parent / "tuned").glob("*.json")):
    CHOOSER.load(str(_table))
if os.environ.get("NVFP4_KERNEL_CHOICES"):
    CHOOSER.load(os.environ["NVFP4_KERNEL_CHOICES"])


# -- custom ops -----------------------------------------------------------------------------------------------
def _dense(weight_packed, weight_scale, weight_global_scale, dtype):
    """Dense weight: `_dequantize_kernel` where the device's variant serves ``dtype``, else pure torch."""
    twiddle.check_standard_order("NVFP4 dequantisation")
    reference = functools.partial(dequantize, weight_packed, weight_scale, weight_global_scale, dtype=dtype)
    device = weight_packed.device
    path = device_path(device) if device.type == "cuda" else None
    if path is None or dtype not in path.dequantize_dtypes:
        return reference()
    launch = functools.partial(dequantize_cuda, weight_packed, weight_scale, weight_global_scale, dtype)
    return guarded("dequantize", device, dtype, launch, reference)


def _fused(x, weight_packed, weight_scale, weight_global_scale):
    """``x @ dequant(W).T`` with the chosen kernel (CUDA decode, Triton or dequantise+cuBLAS), falling back to
    Triton where the CUDA kernel does not build and to the dense weight and torch where Triton does not."""

    def launch():
        choice = CHOOSER.choose(x, weight_packed, weight_scale, weight_global_scale)
        try:
            return run(x, weight_packed, weight_scale, weight_global_scale, choice)
        except nvrtc.NVRTCError as error:  # the CUDA kernels only; the chooser skips the failed one from now on
            _cuda_kernel_failed(x, choice, error)
            choice = CHOOSER.choose(x, weight_packed, weight_scale, weight_global_scale)
            return run(x, weight_packed, weight_scale, weight_global_scale, choice)

    def fallback():
        return torch.nn.functional.linear(x, _dense(weight_packed, weight_scale, weight_global_scale, x.dtype))

    return guarded("matmul", x.device, x.dtype, launch, fallback)


def _separate_products(x, weights: Sequence[cuda_mma.Weight], biases: Sequence[torch.Tensor | None]):
    outs = []
    for weight, bias in zip(weights, biases):
        out = eager_linear(x, *weight)
        outs.append(out + bias.to(out.dtype) if bias is not None else out)
    return torch.cat(outs, dim=1)


def grouped_linear(x, weights: Sequence[cuda_mma.Weight], biases: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """``torch.cat([x @ W_i.T + b_i], dim=1)`` for weights that read the same activations (q/k/v, gate/up): one
    launch of a CUDA kernel or one dequantised buffer where that is fastest, else one product per weight."""
    if mma_usable(x, weights):
        choice = None
        try:
            choice = CHOOSER.choose_group(x, weights)
            if _applies(choice, x, weights, mma=True):
                bias = [b.to(x.dtype) if b is not None else None for b in biases]
                out = _run_on_weights(x, weights, bias, choice)
                if out is not None:
                    return out
        except nvrtc.NVRTCError as error:
            _cuda_kernel_failed(x, choice, error)
    return _separate_products(x, weights, biases)


def chosen(x: torch.Tensor, weights: Sequence[cuda_mma.Weight]) -> Choice:
    """The chooser's kernel for ``x`` and one weight (its single-weight key, as `nvfp4_linear_op` asks) or a group
    of weights in one launch (`KernelChooser.choose_group`)."""
    return CHOOSER.choose(x, *weights[0]) if len(weights) == 1 else CHOOSER.choose_group(x, weights)


def grouped_linear_lora(
    x: torch.Tensor,
    weights: Sequence[cuda_mma.Weight],
    biases: Sequence[torch.Tensor | None],
    lora: cuda_mma.LoraInputs,
) -> torch.Tensor:
    """`grouped_linear` plus one LoRA term per weight (`lora_terms.add_lora_terms`). Where the chooser picks the
    decode kernel (decode sizes) it adds the terms in its epilogue, one launch in all; with any other choice the
    terms are added after the product (the same numbers up to the order of fp32 sums)."""
    usable = mma_usable(x, weights)
    if usable and not cuda_mma.lora_supported(x, weights, lora):
        _note_lora_after_product(lora)
    elif usable:
        choice = None
        try:
            choice = CHOOSER.choose_with_lora(x, weights, lora.rank, lora)
            if isinstance(choice, MMAConfig) and cuda_mma.lora_fits(choice) and _applies(choice, x, weights, True):
                bias = [b.to(x.dtype) if b is not None else None for b in biases]
                return cuda_mma.matmul(x, weights, choice, bias, lora=lora)
        except nvrtc.NVRTCError as error:
            _cuda_kernel_failed(x, choice, error)
    return product_then_lora(x, weights, biases, lora)


PLAIN_WITH_TERMS_AFTER = "plain + terms after"
"""A `lora_key`'s entry where the plain choice with the LoRA terms added after the product timed faster than the
decode kernel with the terms in its epilogue (`KernelChooser.choose_with_lora`)."""
TIME_WITH_LORA = True
"""Whether `KernelChooser.choose_with_lora` times the epilogue against a plain choice that cannot take it. Measured on
the H100 (2026-12-07, `scripts/bench_rollout.py` ``default+own_choices`` against ``default+untimed_lora``): the 14B
decode step at 16 rows 10.42 -> 8.41 ms (the untimed choice had put a tiled product with the terms after it), 7B at 16
rows 6.55 -> 6.21 ms; 7B at 1, 8, 32 and 64 rows and 14B at 8 and 32 unchanged."""


def product_then_lora(
    x: torch.Tensor,
    weights: Sequence[cuda_mma.Weight],
    biases: Sequence[torch.Tensor | None],
    lora: cuda_mma.LoraInputs,
) -> torch.Tensor:
    """The chooser's plain product of ``weights`` (with biases), then each weight's LoRA term added after it."""
    if len(weights) == 1:
        out = eager_linear(x, *weights[0])
        out = out + biases[0].to(out.dtype) if biases[0] is not None else out
    else:
        out = grouped_linear(x, weights, biases)
    widths = [packed.shape[0] for packed, _, _ in weights]
    return add_lora_terms(out, widths, lora.hidden, list(lora.lora_b), list(lora.scaling))


_LORA_NOTED: set[int] = set()


def _note_lora_after_product(lora: cuda_mma.LoraInputs) -> None:
    """One log line per rank: these LoRA terms cannot go into the decode kernel's epilogue (`cuda_mma.lora_supported`:
    fp32, aligned, one rank per launch in `cuda_mma.LORA_RANKS`), so they are added after the product."""
    if lora.rank not in _LORA_NOTED:
        _LORA_NOTED.add(lora.rank)
        logger.info(
            "NVFP4: LoRA terms (rank %s, B %s) are added after the product, not in the decode kernel's epilogue, "
            "which takes fp32 adapters of one rank in %s per launch.",
            lora.rank or "mixed", next((str(b.dtype) for b in lora.lora_b if b is not None), "-"), cuda_mma.LORA_RANKS,
        )  # fmt: skip


KERNELS_NAME = "triton"
"""How the CUDA kernels are named in logs and benchmarks."""


# Each custom op below but the dequantisation is made from a plain function of the same computation: `dispatch` calls
# the plain function where nothing traces (eager training and prefill: the op's dispatch costs 31-82 µs of host time
# per call, `dispatch.op_when_traced`), and the op where torch.compile or export traces, which needs its fake one.
def eager_linear(
    x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_global_scale: torch.Tensor
) -> torch.Tensor:
    """``x[M, K] @ dequant(W[N, K]).T`` (no bias): the body of ``trl_qerl::nvfp4_linear``."""
    if x.shape[-1] != weight_packed.shape[1] * 2:
        raise ValueError(
            f"nvfp4_linear: x has {x.shape[-1]} features, the weight expects {weight_packed.shape[1] * 2}."
        )
    path = device_path(x.device) if x.device.type == "cuda" else None
    if path is None or x.dtype not in path.matmul_dtypes or x.shape[0] == 0:
        # fp32 activations keep full precision (tl.dot would round them to tf32); bf16 on sm_75 has no MMA
        return torch.nn.functional.linear(x, _dense(weight_packed, weight_scale, weight_global_scale, x.dtype))
    return _fused(x, weight_packed, weight_scale, weight_global_scale)


nvfp4_linear_op = torch.library.custom_op("trl_qerl::nvfp4_linear", eager_linear, mutates_args=())


@nvfp4_linear_op.register_fake
def _(x, weight_packed, weight_scale, weight_global_scale):
    return x.new_empty(x.shape[0], weight_packed.shape[0])


def eager_grad_input(
    grad_out: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_global_scale: torch.Tensor
) -> torch.Tensor:
    """``grad_out[M, N] @ dequant(W[N, K])``: the input gradient LoRA needs (frozen base weights get none).

    The dense weight is a temporary that the caching allocator hands to the next layer; nothing dense outlives
    the call. The body of ``trl_qerl::nvfp4_grad_input``."""
    return grad_out @ _dense(weight_packed, weight_scale, weight_global_scale, grad_out.dtype)


nvfp4_grad_input_op = torch.library.custom_op("trl_qerl::nvfp4_grad_input", eager_grad_input, mutates_args=())


@nvfp4_grad_input_op.register_fake
def _(grad_out, weight_packed, weight_scale, weight_global_scale):
    return grad_out.new_empty(grad_out.shape[0], weight_packed.shape[1] * 2)


@torch.library.custom_op("trl_qerl::nvfp4_dequantize", mutates_args=())
def nvfp4_dequantize_op(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_global_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Dense weight, bit-identical to `format.dequantize` (Triton on CUDA)."""
    return _dense(weight_packed, weight_scale, weight_global_scale, dtype)


@nvfp4_dequantize_op.register_fake
def _(weight_packed, weight_scale, weight_global_scale, dtype):
    return weight_packed.new_empty(weight_packed.shape[0], weight_packed.shape[1] * 2, dtype=dtype)


def eager_grouped(
    x: torch.Tensor,
    weight_packed: list[torch.Tensor],
    weight_scale: list[torch.Tensor],
    weight_global_scale: list[torch.Tensor],
    bias: list[torch.Tensor | None],
) -> torch.Tensor:
    """``cat([x @ dequant(W_i).T + bias_i], dim=1)`` for up to three weights that read the same ``x[M, K]`` (q/k/v,
    gate/up): one launch on CUDA where the decode kernel applies, read in place (no concatenated copy). The body of
    ``trl_qerl::nvfp4_linear_grouped``."""
    if not weight_packed or not len(weight_packed) == len(weight_scale) == len(weight_global_scale) == len(bias):
        raise ValueError("nvfp4_linear_grouped: give one packed tensor, scale, global scale and bias per weight.")
    # (off CUDA, or with more weights than one launch takes, `grouped_linear` computes one product per weight)
    return grouped_linear(x, list(zip(weight_packed, weight_scale, weight_global_scale)), bias)


nvfp4_linear_grouped_op = torch.library.custom_op("trl_qerl::nvfp4_linear_grouped", eager_grouped, mutates_args=())


@nvfp4_linear_grouped_op.register_fake
def _(x, weight_packed, weight_scale, weight_global_scale, bias):
    return x.new_empty(x.shape[0], sum(p.shape[0] for p in weight_packed))


def eager_grouped_lora(
    x: torch.Tensor,
    weight_packed: list[torch.Tensor],
    weight_scale: list[torch.Tensor],
    weight_global_scale: list[torch.Tensor],
    bias: list[torch.Tensor | None],
    hidden: torch.Tensor,
    lora_b: list[torch.Tensor | None],
    scaling: list[float],
) -> torch.Tensor:
    """`eager_grouped` (one to three weights) plus each weight's LoRA term ``scaling_i * hidden_i @
    B_i.T``, ``hidden`` = ``x @ A_i.T`` of the weights with an adapter side by side (`grouped_linear_lora`). The
    body of ``trl_qerl::nvfp4_linear_grouped_lora``."""
    counts = {len(weight_packed), len(weight_scale), len(weight_global_scale), len(bias), len(lora_b), len(scaling)}
    if not weight_packed or len(counts) != 1:
        raise ValueError(
            "nvfp4_linear_grouped_lora: give one packed tensor, scale, global scale, bias, lora_b and scaling per "
            "weight (None / any scaling for a weight without an adapter)."
        )
    ranks = sum(b.shape[1] for b in lora_b if b is not None)
    if hidden.dim() != 2 or hidden.shape[0] != x.shape[0] or hidden.shape[1] != ranks:
        raise ValueError(
            f"nvfp4_linear_grouped_lora: hidden has shape {tuple(hidden.shape)}, expected ({x.shape[0]}, {ranks}): "
            "x @ A.T of every adapter, side by side in weight order."
        )
    weights = list(zip(weight_packed, weight_scale, weight_global_scale))
    return grouped_linear_lora(x, weights, bias, cuda_mma.LoraInputs(hidden, lora_b, scaling))


nvfp4_linear_grouped_lora_op = torch.library.custom_op(
    "trl_qerl::nvfp4_linear_grouped_lora", eager_grouped_lora, mutates_args=()
)


@nvfp4_linear_grouped_lora_op.register_fake
def _(x, weight_packed, weight_scale, weight_global_scale, bias, hidden, lora_b, scaling):
    return x.new_empty(x.shape[0], sum(p.shape[0] for p in weight_packed))


__all__ = [
    "AMPERE",
    "MMA_MAX_ROWS",
    "PLAIN_WITH_TERMS_AFTER",
    "SEPARATE",
    "CHOOSER",
    "DEQUANT_CUBLAS",
    "HOPPER",
    "TURING",
    "FusedConfig",
    "KernelChooser",
    "TritonPath",
    "candidate_configs",
    "chosen",
    "grouped_linear",
    "grouped_linear_lora",
    "mma_usable",
    "product_then_lora",
    "dequantize_cuda",
    "device_path",
    "eager_grad_input",
    "eager_grouped",
    "eager_grouped_lora",
    "eager_linear",
    "fused_matmul",
    "guarded",
    "heuristic_config",
    "m_bucket",
    "triton_path",
]
