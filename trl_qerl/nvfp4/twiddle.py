"""A bit order of the packed E2M1 codes that the CUDA decode kernel turns into bf16 pairs with fewer instructions,
and the window in which a model's codes are held in it.

In the standard compressed-tensors layout a 32-bit word holds the codes c0..c7 of 8 consecutive columns, code i in
bits 4i..4i+3 (sign, then two exponent bits and one mantissa bit). The kernel builds each bf16 pair by moving a
code's sign to bit 15 and its three magnitude bits to bits 8..6 of a 16-bit half (E2M1 * 2^-126): two shifts and two
masks per pair, ~15 instructions per word. `twiddle` permutes the 32 bits of every word so that pair i = (c_{2i},
c_{2i+1}) is one rotation and one mask of the word (the last pair two of each): 9 instructions per word, and the
pairs are in column order, so the activations need no permutation either. The permutation was found by a search over
rotation sets (`POSITIONS`); `untwiddle` restores the standard order.

**The lane order** (`to_lane_order`, built for with `LANE_ORDER_BUILD`; the fast engine holds it with
`rollout.fast.LANE_ORDER`, on by default since it measured faster on Hopper). The wgmma kernel's lane t of a quad
needs, per row and k16 step, the codes of columns 2t, 2t + 1, 2t + 8 and 2t + 9 (its A fragment): bytes t and 4 + t of
the step's 8, which it gathers from a 16-byte chunk (two steps) with two PRMTs and a shift before decoding, ~11
instructions per row and step. In the lane order the bytes of each 16-byte chunk of a row (4 words x 4 bytes) are
transposed, so that word t holds exactly lane t's codes of the chunk's two steps (columns 2t, 2t + 1, 2t + 8, 2t + 9,
then the same 16 columns on), and each word is then twiddled: one 4-byte read and the 9-instruction `decode_word` give
the lane its four pairs for both steps. Chunks are the TMA boxes' swizzle units, so the staging is unchanged. The
decode and tiled kernels read it too: their lane owns a whole chunk, and only which of its own columns meet which
activations changes (no extra instructions). So a window in the lane order serves batches the wgmma kernel computes as
well. `from_lane_order` restores the standard order.

Nothing stores either order: every other reader of the codes (the Triton kernels, dequantisation, checkpoints, vLLM)
knows only the standard one. `twiddled_codes` permutes a model's codes in place (no second copy) for a stretch of
decode steps and restores them on leaving, also on an error; inside it the CUDA decode and tiled kernels build with
``-DNVFP4_TWIDDLED=1`` (the lane order: ``=2``, the wgmma kernel too; `window_build`) and every other reader refuses
to run (`TwiddledCodesError`, see `check_standard_order`), so a wrong read cannot pass silently. The fast rollout
engine opens it around its decode loop
(`rollout.fast.StaticCacheGenerator`, ``twiddled_decode``). Measured on the H200 (7B, NVFP4 + LoRA r32 + AQN,
2026-12-03): decode step 2.95-2.97 -> 2.80-2.81 ms at batch 1, 3.39-3.47 -> 3.26-3.33 ms at batch 8.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Sequence

import torch


logger = logging.getLogger(__name__)


POSITIONS: tuple[tuple[int, int], ...] = (
    (5, 0), (5, 1), (5, 2), (3, 3), (7, 0), (7, 1), (0, 0), (0, 1), (0, 2), (5, 3), (2, 0), (2, 1), (2, 2), (7, 3),
    (7, 2), (0, 3), (4, 0), (4, 1), (4, 2), (2, 3), (6, 0), (6, 1), (1, 0), (1, 1), (1, 2), (4, 3), (3, 0), (3, 1),
    (3, 2), (6, 3), (6, 2), (1, 3),
)  # fmt: skip
"""Bit b of a twiddled word is bit ``POSITIONS[b][1]`` of code ``POSITIONS[b][0]`` (0: mantissa .. 3: sign)."""

BF16_DECODE: tuple[tuple[tuple[int, int], ...], ...] = (
    ((0, 0x81C081C0),),
    ((4, 0x81C081C0),),
    ((10, 0x81C081C0),),
    ((14, 0x80C080C0), (22, 0x01000100)),
)
"""Pair i of a twiddled word as bf16 bits: the OR over (r, mask) of ``rotate_right(word, r) & mask`` (what the
kernel's ``decode_word`` computes; `tests/test_twiddle.py` checks the two agree with `POSITIONS`)."""


def _check_codes(packed: torch.Tensor, row_bytes: int = 4) -> None:
    """uint8 codes in rows of whole ``row_bytes`` units (words, or the lane order's 16-byte chunks)."""
    if packed.dtype != torch.uint8 or packed.shape[-1] % row_bytes:
        raise ValueError(
            f"expected uint8 codes with a multiple of {row_bytes} bytes per row (K a multiple of {2 * row_bytes}), "
            f"got {packed.dtype} {tuple(packed.shape)}"
        )


def _check_in_place(packed: torch.Tensor, lanes: bool = False) -> None:
    """What rewriting ``packed`` in place needs: contiguous whole words of codes (``lanes``: whole chunks)."""
    if not packed.is_contiguous():
        raise ValueError("permute_ needs contiguous codes (it rewrites them in place)")
    _check_codes(packed, CHUNK_BYTES if lanes else 4)


def _words(packed: torch.Tensor) -> torch.Tensor:
    _check_codes(packed)
    return packed.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _rotation_groups(source_of: Sequence[int]) -> list[tuple[int, int]]:
    """(left rotation, mask of source bits) per distinct rotation of a permutation: one pass each."""
    groups: dict[int, int] = {}
    for target, source in enumerate(source_of):
        groups[(target - source) % 32] = groups.get((target - source) % 32, 0) | (1 << source)
    return sorted(groups.items())


def _twiddle_sources() -> list[int]:
    return [4 * code + bit for code, bit in POSITIONS]


def _untwiddle_sources() -> list[int]:
    source_of = [0] * 32
    for target, (code, bit) in enumerate(POSITIONS):
        source_of[4 * code + bit] = target
    return source_of


@functools.cache
def _pass_groups(inverse: bool) -> tuple[tuple[int, int], ...]:
    """The rotation groups of the Triton pass in one direction (`twiddle`, or `untwiddle` with ``inverse``)."""
    return tuple(_rotation_groups(_untwiddle_sources() if inverse else _twiddle_sources()))


def _permute(packed: torch.Tensor, source_of: list[int]) -> torch.Tensor:
    """Bit b of each output word is bit ``source_of[b]`` of the input word (`_rotation_groups`: one pass each, the
    words widened to int64 so that a left rotation is two shifts and a mask)."""
    words = _words(packed)
    out = torch.zeros_like(words)
    for rotation, mask in _rotation_groups(source_of):
        moved = words & mask
        out |= ((moved << rotation) | (moved >> (32 - rotation))) & 0xFFFFFFFF
    out = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)
    return out.view(torch.uint8).view(packed.shape)


def twiddle(packed: torch.Tensor) -> torch.Tensor:
    """Standard ``uint8 [rows, K/2]`` codes -> the same codes in the twiddled bit order (a new tensor)."""
    return _permute(packed, _twiddle_sources())


def untwiddle(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `twiddle`."""
    return _permute(packed, _untwiddle_sources())


CHUNK_BYTES = 16
"""Bytes of a row that `transpose_chunks` permutes among themselves (two k16 steps of codes: the wgmma kernel's
staging unit)."""


def transpose_chunks(packed: torch.Tensor) -> torch.Tensor:
    """Byte j of word i of every 16-byte chunk of a row moved to byte i of word j (a new tensor; its own inverse)."""
    _check_codes(packed, CHUNK_BYTES)
    chunks = packed.contiguous().view(*packed.shape[:-1], -1, 4, 4)
    return chunks.transpose(-1, -2).contiguous().view(packed.shape)


def to_lane_order(packed: torch.Tensor) -> torch.Tensor:
    """Standard ``uint8 [rows, K/2]`` codes -> the lane order (see the module): `transpose_chunks`, then `twiddle`."""
    return twiddle(transpose_chunks(packed))


def from_lane_order(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `to_lane_order`."""
    return transpose_chunks(untwiddle(packed))


TWIDDLED_BUILD = ("-DNVFP4_TWIDDLED=1",)
"""NVRTC flags of the decode and tiled kernels' builds that read the twiddled order (`cuda_mma.matmul` and
`cuda_mma.tile_matmul` add them inside `twiddled_codes`)."""

LANE_ORDER_BUILD = ("-DNVFP4_TWIDDLED=2",)
"""NVRTC flags of the builds that read codes in the lane order (`to_lane_order`): the wgmma kernel, and the decode and
tiled kernels (their lane owns a whole chunk, so only the pairing of its own columns changes). Inside
``twiddled_codes(..., lanes=True)`` `window_build` gives them."""

_active = False
_lanes = False


class TwiddledCodesError(Exception):
    """A reader that knows only the standard order met codes held in the twiddled one (inside `twiddled_codes`).
    Not a RuntimeError, so that handlers of kernel build failures do not take it for one."""


def active() -> bool:
    """Whether the codes of the model being decoded are in the twiddled order now, or in the lane order (inside
    `twiddled_codes`)."""
    return _active


def lane_order() -> bool:
    """Whether they are in the lane order now (inside ``twiddled_codes(..., lanes=True)``), where the wgmma kernel
    reads them too."""
    return _active and _lanes


def window_build() -> tuple[str, ...]:
    """The NVRTC flags a CUDA kernel reading the codes needs now: `LANE_ORDER_BUILD` or `TWIDDLED_BUILD` inside the
    window, none outside."""
    if not _active:
        return ()
    return LANE_ORDER_BUILD if _lanes else TWIDDLED_BUILD


def check_standard_order(reader: str) -> None:
    """Raise `TwiddledCodesError` inside `twiddled_codes`: ``reader`` (named in the message) reads the standard order
    only."""
    if _active:
        order, readers = ("lane", "CUDA decode, tiled and wgmma") if _lanes else ("twiddled", "CUDA decode and tiled")
        raise TwiddledCodesError(
            f"{reader} reads NVFP4 codes in the standard order, but they are in the {order} order now (inside "
            f"trl_qerl.nvfp4.twiddle.twiddled_codes, where only the {readers} kernels may read them)."
        )


def permute_(packed: torch.Tensor, inverse: bool = False, lanes: bool = False) -> torch.Tensor:
    """`twiddle` (or, with ``inverse``, `untwiddle`) in place, ``packed`` returned: one Triton pass on CUDA (a few ms
    for a 7B model's codes), `twiddle` / `untwiddle` and a copy elsewhere. ``lanes``: `to_lane_order` (or
    `from_lane_order`) instead."""
    _check_in_place(packed, lanes)
    if packed.device.type == "cuda":
        _launch_pass(packed, inverse, lanes)
        return packed
    if lanes:
        return packed.copy_(from_lane_order(packed) if inverse else to_lane_order(packed))
    return packed.copy_(untwiddle(packed) if inverse else twiddle(packed))


def _launch_pass(packed: torch.Tensor, inverse: bool, lanes: bool) -> None:
    """The Triton pass of `permute_` over CUDA codes (checked by the caller)."""
    from ._twiddle_kernel import permute_bits_, permute_lanes_  # Triton is needed on CUDA only

    if lanes:
        permute_lanes_(packed.view(torch.int32), _pass_groups(inverse), inverse)
    else:
        permute_bits_(packed.view(torch.int32), _pass_groups(inverse))


CAPTURE_PASSES = True
"""Run each direction of a window's passes as one CUDA-graph replay (captured on the first window over the same
tensors, `_captured_passes`) instead of one Triton launch per tensor. Measured at 7B shapes (196 code tensors, 3.26 GB,
H200, 2026-12-03, `bench_twiddle.py --window`): 4.72 ms per window against 26.70 ms launching per tensor and 2.35 ms
for cloning the same bytes. Set it to False to launch per tensor (what a failed capture falls back to)."""

_GRAPHS: dict[tuple, torch.cuda.CUDAGraph] = {}
_GRAPHS_KEPT = 4


def _captured_passes(codes: Sequence[torch.Tensor], inverse: bool, lanes: bool = False) -> torch.cuda.CUDAGraph | None:
    """The passes of `permute_` over ``codes`` as one CUDA graph (captured once per order, direction and list of
    (address, size): the launches read nothing else), or None where capture does not apply (not all on one CUDA
    device, fewer than two tensors, or inside another capture)."""
    devices = {packed.device for packed in codes}
    if len(codes) < 2 or len(devices) != 1 or next(iter(devices)).type != "cuda":
        return None
    if torch.cuda.is_current_stream_capturing():
        return None
    key = (inverse, lanes, tuple((packed.data_ptr(), packed.numel()) for packed in codes))
    if key not in _GRAPHS:
        for packed in codes:
            _check_in_place(packed, lanes)
        _launch_pass(torch.zeros(16, dtype=torch.uint8, device=codes[0].device), inverse, lanes)  # (compiles first)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):  # (records the launches; nothing runs until a replay)
                for packed in codes:
                    _launch_pass(packed, inverse, lanes)
        except Exception as error:  # noqa: BLE001 - the launches one by one do the same
            logger.warning("capturing the twiddle passes failed (%s: %s); launching them one by one",
                           type(error).__name__, str(error)[:200])  # fmt: skip
            return None
        if len(_GRAPHS) >= _GRAPHS_KEPT:
            _GRAPHS.pop(next(iter(_GRAPHS)))
        _GRAPHS[key] = graph
    return _GRAPHS[key]


def _permute_all(codes: Sequence[torch.Tensor], inverse: bool, done: list[torch.Tensor], lanes: bool = False) -> None:
    """`permute_` over ``codes``, appending each tensor to ``done`` once it is permuted (one graph replay for all of
    them with `CAPTURE_PASSES`)."""
    graph = _captured_passes(codes, inverse, lanes) if CAPTURE_PASSES else None
    if graph is not None:
        graph.replay()
        done.extend(codes)
        return
    for packed in codes:
        permute_(packed, inverse=inverse, lanes=lanes)
        done.append(packed)


@contextlib.contextmanager
def twiddled_codes(codes: Sequence[torch.Tensor], lanes: bool = False) -> Iterator[None]:
    """``codes`` (uint8, contiguous) permuted in place to the twiddled order (``lanes``: the lane order, which needs
    rows of whole 16-byte chunks) while inside, and back to the standard order on leaving, also on an error (those
    already permuted, if permuting a later one fails). Inside, the CUDA decode and tiled kernels (and in the lane order
    the wgmma kernel) build for that order (`window_build`) and every other reader of codes raises
    `TwiddledCodesError`. Not reentrant."""
    global _active, _lanes
    if _active:
        raise RuntimeError("twiddled_codes is not reentrant: the codes are twiddled already")
    permuted: list[torch.Tensor] = []
    try:
        with torch.no_grad():
            _permute_all(codes, inverse=False, done=permuted, lanes=lanes)
        _active, _lanes = True, lanes
        yield
    finally:
        _active, _lanes = False, False
        with torch.no_grad():
            _permute_all(permuted, inverse=True, done=[], lanes=lanes)
