"""A bit order of the packed E2M1 codes that the CUDA decode kernel turns into bf16 pairs with fewer instructions
(an experiment: the kernel reads it only when built with ``-DNVFP4_TWIDDLED=1``; nothing stores it yet).

In the standard compressed-tensors layout a 32-bit word holds the codes c0..c7 of 8 consecutive columns, code i in
bits 4i..4i+3 (sign, then two exponent bits and one mantissa bit). The kernel builds each bf16 pair by moving a
code's sign to bit 15 and its three magnitude bits to bits 8..6 of a 16-bit half (E2M1 * 2^-126): two shifts and two
masks per pair, ~15 instructions per word. `twiddle` permutes the 32 bits of every word so that pair i = (c_{2i},
c_{2i+1}) is one rotation and one mask of the word (the last pair two of each): 9 instructions per word, and the
pairs are in column order, so the activations need no permutation either. The permutation was found by a search over
rotation sets (`POSITIONS`); `untwiddle` restores the standard order.
"""

from __future__ import annotations

import torch


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


def _words(packed: torch.Tensor) -> torch.Tensor:
    if packed.dtype != torch.uint8 or packed.shape[-1] % 4:
        raise ValueError(f"expected uint8 codes with a multiple of 4 bytes per row, got {packed.dtype} {packed.shape}")
    return packed.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _permute(packed: torch.Tensor, source_of: list[int]) -> torch.Tensor:
    """Bit b of each output word is bit ``source_of[b]`` of the input word (grouped by distance: one pass each)."""
    words = _words(packed)
    out = torch.zeros_like(words)
    by_distance: dict[int, int] = {}
    for target, source in enumerate(source_of):
        by_distance[target - source] = by_distance.get(target - source, 0) | (1 << source)
    for distance, mask in by_distance.items():
        moved = words & mask
        out |= moved << distance if distance >= 0 else moved >> -distance
    out = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)
    return out.view(torch.uint8).view(packed.shape)


def twiddle(packed: torch.Tensor) -> torch.Tensor:
    """Standard ``uint8 [rows, K/2]`` codes -> the same codes in the twiddled bit order (a new tensor)."""
    return _permute(packed, [4 * code + bit for code, bit in POSITIONS])


def untwiddle(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `twiddle`."""
    source_of = [0] * 32
    for target, (code, bit) in enumerate(POSITIONS):
        source_of[4 * code + bit] = target
    return _permute(packed, source_of)
