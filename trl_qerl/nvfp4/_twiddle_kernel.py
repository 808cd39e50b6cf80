"""The Triton passes of `twiddle.permute_`: each 32-bit word's bits permuted in place, as an OR of masked rotations
(the twiddled order and its inverse have 12 distinct rotations each), and for the lane order the bytes of each
16-byte chunk transposed as well. Kept apart so that `twiddle` imports without
Triton.

The rotations and masks are compile-time constants: with shift amounts known to be below 32 the compiler emits
plain shifts (a shift by a run-time amount also needs a select for amounts >= 32); the first form, with the table
in device memory, took 21-32 ms to permute a 7B model's codes in and out (H200, 2026-12-03)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl


BLOCK = 4096
GROUPS = 12
"""Rotation groups the kernel takes (fewer are padded with empty masks)."""


@triton.jit
def _rotated(words, MASK: tl.constexpr, ROTATION: tl.constexpr):
    moved = words & MASK
    if ROTATION != 0:  # (a compile-time branch; a shift by 32 would be undefined)
        moved = (moved << ROTATION) | (moved >> (32 - ROTATION))
    return moved


@triton.jit
def _permuted(words,
              R0: tl.constexpr, M0: tl.constexpr, R1: tl.constexpr, M1: tl.constexpr,
              R2: tl.constexpr, M2: tl.constexpr, R3: tl.constexpr, M3: tl.constexpr,
              R4: tl.constexpr, M4: tl.constexpr, R5: tl.constexpr, M5: tl.constexpr,
              R6: tl.constexpr, M6: tl.constexpr, R7: tl.constexpr, M7: tl.constexpr,
              R8: tl.constexpr, M8: tl.constexpr, R9: tl.constexpr, M9: tl.constexpr,
              R10: tl.constexpr, M10: tl.constexpr, R11: tl.constexpr, M11: tl.constexpr):  # fmt: skip
    """The OR of the 12 masked rotations of ``words`` (uint32)."""
    out = _rotated(words, M0, R0) | _rotated(words, M1, R1) | _rotated(words, M2, R2) | _rotated(words, M3, R3)
    out |= _rotated(words, M4, R4) | _rotated(words, M5, R5) | _rotated(words, M6, R6) | _rotated(words, M7, R7)
    out |= _rotated(words, M8, R8) | _rotated(words, M9, R9) | _rotated(words, M10, R10) | _rotated(words, M11, R11)
    return out


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _transposed(words, lanes):
    """``[chunks, 4]`` words with byte j of word i moved to byte i of word j (``lanes``: ``tl.arange(0, 4)``)."""
    shifts = (8 * lanes).to(tl.uint32)
    moved = ((words[:, :, None] >> shifts[None, None, :]) & 0xFF) << shifts[None, :, None]  # [chunk, i, j]
    return tl.reduce(moved, 1, _or)


@triton.jit
def _permute_kernel(words_ptr, count,
                    R0: tl.constexpr, M0: tl.constexpr, R1: tl.constexpr, M1: tl.constexpr,
                    R2: tl.constexpr, M2: tl.constexpr, R3: tl.constexpr, M3: tl.constexpr,
                    R4: tl.constexpr, M4: tl.constexpr, R5: tl.constexpr, M5: tl.constexpr,
                    R6: tl.constexpr, M6: tl.constexpr, R7: tl.constexpr, M7: tl.constexpr,
                    R8: tl.constexpr, M8: tl.constexpr, R9: tl.constexpr, M9: tl.constexpr,
                    R10: tl.constexpr, M10: tl.constexpr, R11: tl.constexpr, M11: tl.constexpr,
                    TRANSPOSE: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Each of ``count`` words rewritten as the OR of its 12 masked rotations; ``TRANSPOSE`` 1: each 4-word (16-byte)
    chunk's bytes transposed before (`twiddle.to_lane_order`), 2: after (`from_lane_order`), in tiles of chunks."""
    lanes = tl.arange(0, 4)
    if TRANSPOSE == 0:  # (the first form of the pass, measured in the window: flat tiles)
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    else:
        first = tl.program_id(0).to(tl.int64) * (BLOCK // 4) + tl.arange(0, BLOCK // 4)
        offsets = first[:, None] * 4 + lanes[None, :]
    valid = offsets < count
    words = tl.load(words_ptr + offsets, mask=valid, other=0).to(tl.uint32, bitcast=True)
    if TRANSPOSE == 1:
        words = _transposed(words, lanes)
    words = _permuted(words, R0, M0, R1, M1, R2, M2, R3, M3, R4, M4, R5, M5, R6, M6, R7, M7, R8, M8, R9, M9, R10, M10,
                      R11, M11)  # fmt: skip
    if TRANSPOSE == 2:
        words = _transposed(words, lanes)
    tl.store(words_ptr + offsets, words.to(tl.int32, bitcast=True), mask=valid)


def _constants(groups: Sequence[tuple[int, int]]) -> dict[str, int]:
    """The kernels' ``R<i>`` / ``M<i>`` arguments for ``groups`` (at most `GROUPS`, padded with empty masks)."""
    if len(groups) > GROUPS:
        raise ValueError(f"the kernel takes at most {GROUPS} rotation groups, got {len(groups)}")
    constants = {}
    for index, (rotation, mask) in enumerate([*groups, *[(0, 0)] * (GROUPS - len(groups))]):
        constants[f"R{index}"] = rotation % 32
        constants[f"M{index}"] = mask
    return constants


def permute_bits_(words: torch.Tensor, groups: Sequence[tuple[int, int]]) -> None:
    """Rewrite every int32 of ``words`` as the OR over (r, mask) in ``groups`` (at most `GROUPS`) of
    ``rotate_left(word & mask, r)``."""
    _launch(words, groups, transpose=0)


def permute_lanes_(words: torch.Tensor, groups: Sequence[tuple[int, int]], inverse: bool) -> None:
    """`permute_bits_` with the bytes of each 4-word chunk of ``words`` transposed first (``inverse``: after)."""
    if words.numel() % 4:
        raise ValueError(f"expected whole 16-byte chunks, got {words.numel()} words")
    _launch(words, groups, transpose=2 if inverse else 1)


def _launch(words: torch.Tensor, groups: Sequence[tuple[int, int]], transpose: int) -> None:
    count = words.numel()
    if count:
        _permute_kernel[(triton.cdiv(count, BLOCK),)](words, count, **_constants(groups), TRANSPOSE=transpose,
                                                      BLOCK=BLOCK)  # fmt: skip
