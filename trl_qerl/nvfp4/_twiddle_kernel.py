"""The Triton pass of `twiddle.permute_`: each 32-bit word's bits permuted in place, as an OR of masked rotations
(the twiddled order has 12 distinct rotations). Kept apart so that `twiddle` imports without Triton."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


BLOCK = 4096


@triton.jit
def _permute_bits_kernel(words_ptr, count, rotations_ptr, masks_ptr, GROUPS: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offsets < count
    words = tl.load(words_ptr + offsets, mask=valid, other=0).to(tl.uint32, bitcast=True)
    out = tl.zeros([BLOCK], dtype=tl.uint32)
    for group in tl.static_range(GROUPS):
        rotation = tl.load(rotations_ptr + group).to(tl.uint32, bitcast=True)
        mask = tl.load(masks_ptr + group).to(tl.uint32, bitcast=True)
        moved = words & mask
        # left rotation; the right shift by (32 - r) & 31 is 0 for r = 0, where both halves are `moved`
        out |= (moved << rotation) | (moved >> ((32 - rotation) & 31))
    tl.store(words_ptr + offsets, out.to(tl.int32, bitcast=True), mask=valid)


_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def permute_bits_(words: torch.Tensor, groups: list[tuple[int, int]]) -> None:
    """Rewrite every int32 of ``words`` as the OR over (r, mask) in ``groups`` of ``rotate_left(word & mask, r)``."""
    key = (words.device, tuple(groups))
    if key not in _TABLES:
        as_int32 = [mask - (1 << 32) if mask >= 1 << 31 else mask for _, mask in groups]
        _TABLES[key] = (torch.tensor([r for r, _ in groups], dtype=torch.int32, device=words.device),
                        torch.tensor(as_int32, dtype=torch.int32, device=words.device))  # fmt: skip
    rotations, masks = _TABLES[key]
    count = words.numel()
    if count:
        grid = (triton.cdiv(count, BLOCK),)
        _permute_bits_kernel[grid](words, count, rotations, masks, GROUPS=len(groups), BLOCK=BLOCK)
