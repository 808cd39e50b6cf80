"""The Triton pass of `twiddle.permute_`: each 32-bit word's bits permuted in place, as an OR of masked rotations
(the twiddled order and its inverse have 12 distinct rotations each). Kept apart so that `twiddle` imports without
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
def _permute_bits_kernel(words_ptr, count,
                         R0: tl.constexpr, M0: tl.constexpr, R1: tl.constexpr, M1: tl.constexpr,
                         R2: tl.constexpr, M2: tl.constexpr, R3: tl.constexpr, M3: tl.constexpr,
                         R4: tl.constexpr, M4: tl.constexpr, R5: tl.constexpr, M5: tl.constexpr,
                         R6: tl.constexpr, M6: tl.constexpr, R7: tl.constexpr, M7: tl.constexpr,
                         R8: tl.constexpr, M8: tl.constexpr, R9: tl.constexpr, M9: tl.constexpr,
                         R10: tl.constexpr, M10: tl.constexpr, R11: tl.constexpr, M11: tl.constexpr,
                         BLOCK: tl.constexpr):  # fmt: skip
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offsets < count
    words = tl.load(words_ptr + offsets, mask=valid, other=0).to(tl.uint32, bitcast=True)
    out = _rotated(words, M0, R0) | _rotated(words, M1, R1) | _rotated(words, M2, R2) | _rotated(words, M3, R3)
    out |= _rotated(words, M4, R4) | _rotated(words, M5, R5) | _rotated(words, M6, R6) | _rotated(words, M7, R7)
    out |= _rotated(words, M8, R8) | _rotated(words, M9, R9) | _rotated(words, M10, R10) | _rotated(words, M11, R11)
    tl.store(words_ptr + offsets, out.to(tl.int32, bitcast=True), mask=valid)


def permute_bits_(words: torch.Tensor, groups: Sequence[tuple[int, int]]) -> None:
    """Rewrite every int32 of ``words`` as the OR over (r, mask) in ``groups`` (at most `GROUPS`) of
    ``rotate_left(word & mask, r)``."""
    if len(groups) > GROUPS:
        raise ValueError(f"the kernel takes at most {GROUPS} rotation groups, got {len(groups)}")
    constants = {}
    for index, (rotation, mask) in enumerate([*groups, *[(0, 0)] * (GROUPS - len(groups))]):
        constants[f"R{index}"] = rotation % 32
        constants[f"M{index}"] = mask
    count = words.numel()
    if count:
        _permute_bits_kernel[(triton.cdiv(count, BLOCK),)](words, count, **constants, BLOCK=BLOCK)
