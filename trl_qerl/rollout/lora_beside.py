"""A projection group's base products with its LoRA shrink beside them, on a second CUDA stream.

Above `fused_decode.LORA_REDUCTION_ROWS` rows a group's LoRA terms take two launches after its base products
(`lora_rows`): the shrink ``t = x @ A.T`` and the expand added to the base outputs. The shrink reads only ``x`` and the
adapters, so it need not wait for the products. `products_lora_beside` launches it on a second stream, forked from the
current one before the products and joined before the expand. Measured on the H200 before this existed (7B, rank 32,
2026-12-04): the shrinks took 0.89 / 1.14 ms of a 5.6 / 7.4 ms decode step at batch 32 / 64, 112 launches of 8-10 µs
whose programs mostly wait on HBM for their rows of A, in the NVFP4 and the bf16 arm alike; beside products that run
one or two CTAs per multiprocessor, most of that time could hide. Measured with it on an H100 (2026-12-05, lane
order): the 7B step 7.27 -> 7.09 ms at 64 rows and 9.90 -> 9.30 at 128, kernel time unchanged (an overlap); slower at
32 rows and fewer, so `fused_decode.LORA_SHRINK_BESIDE` is on from `fused_decode.LORA_BESIDE_MIN_ROWS` (33) rows.

Why one op for the whole group (products, shrink, expand) and not a shrink op that forks and an expand op that joins:
the side stream's writes to ``t`` are ordered only by the join, so every reader of ``t`` must come after it. Inside one
op nothing that torch.compile does around it (a copy of ``t``, a reordering) can read ``t`` early, and ``x``, which the
shrink reads on the side stream, stays referenced until the join, so the caching allocator cannot hand its memory to
the current stream while the shrink still reads it.

CUDA graphs: the fork (the side stream waits on an event of the current one) and the join (the reverse) are torch's
documented pattern for capturing more than one stream; captured, they become edges of the graph, so a replay runs the
shrink beside the products with no host work. ``t`` is allocated on the current stream before the fork and freed there
after the join. The shrink's partial sums are allocated on the side stream, and the caching allocator keeps free blocks
per stream, so only later side launches reuse them. Its arrival counters are a lane of their own (`SIDE_LANE`): the
products' split-K counters may be in use at the same time. (A side stream's priority does not carry into a captured
graph: torch instantiates graphs without ``cudaGraphInstantiateFlagUseNodePriority``, so the stream is a plain one.)

Numbers: the kernels and sums of `lora_rows`, so the outputs equal the two-launch path's bit for bit. Off CUDA, or
without Triton, the torch formulas in the same order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..nvfp4.dispatch import kernels_for
from .fused_shrink import shrink_reference
from .lora_rows import expanded, runs_triton


__all__ = ["SIDE_LANE", "base_products", "products_lora_beside", "side_stream"]


SIDE_LANE = 1
"""The arrival-counter lane (`nvfp4.cuda_mma.arrival_counters`) of shrinks launched on the side stream."""

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The second stream of ``device`` (one per device, made on first use: the first call is an eager warm-up, before
    any capture)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


OptionalTensors = list[torch.Tensor | None]


def base_products(
    x: torch.Tensor, packed: OptionalTensors, scale: OptionalTensors, global_scale: OptionalTensors,
    weight: OptionalTensors, bias: OptionalTensors,
) -> list[torch.Tensor]:  # fmt: skip
    """``x @ W_i.T + b_i`` for projections that read the same ``x``, each NVFP4 (``packed[i]``, ``scale[i]``,
    ``global_scale[i]``) or 16-bit (``weight[i]``; the others None); two or three NVFP4 weights run as one grouped
    launch (`NVFP4Kernels.grouped`; the outputs are column views of its result)."""
    if len(packed) > 1 and all(p is not None for p in packed):
        fused = kernels_for(x.device).grouped(x, packed, scale, global_scale, bias)
        return list(fused.split([p.shape[0] for p in packed], dim=-1))
    outputs = []
    for p, s, g, w, b in zip(packed, scale, global_scale, weight, bias):
        if p is None:
            outputs.append(F.linear(x, w, b))
            continue
        out = kernels_for(x.device).linear(x, p, s, g)
        outputs.append(out + b.to(out.dtype) if b is not None else out)
    return outputs


@torch.library.custom_op("trl_qerl::products_lora_beside", mutates_args=())
def products_lora_beside(
    x: torch.Tensor,
    packed: list[torch.Tensor | None],
    scale: list[torch.Tensor | None],
    global_scale: list[torch.Tensor | None],
    weight: list[torch.Tensor | None],
    bias: list[torch.Tensor | None],
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    scalings: list[float],
) -> list[torch.Tensor]:
    """``round(x @ W_i.T + b_i + scaling_i * (x @ A_i.T) @ B_i.T)`` for one to three projections that read ``x[M, K]``,
    each with one adapter (`lora_rows.adapters_apply`): `base_products`, with the shrink on the side stream meanwhile
    (see the module), then `lora_rows`' expand. New tensors, one per projection."""
    if not runs_triton(x):
        return expanded(base_products(x, packed, scale, global_scale, weight, bias), shrink_reference(x, lora_a),
                        lora_b, scalings)  # fmt: skip
    from ._lora_rows_kernel import shrink_rows

    t = x.new_empty(x.shape[0], sum(a.shape[0] for a in lora_a), dtype=torch.float32)
    current, side = torch.cuda.current_stream(x.device), side_stream(x.device)
    side.wait_stream(current)  # fork: the side stream starts after what ``x`` and ``t`` were made by
    with torch.cuda.stream(side):
        shrink_rows(x, lora_a, t, lane=SIDE_LANE)
    bases = base_products(x, packed, scale, global_scale, weight, bias)
    current.wait_stream(side)  # join: nothing after this op runs before the shrink is done
    return expanded(bases, t, lora_b, scalings)


@products_lora_beside.register_fake
def _(x, packed, scale, global_scale, weight, bias, lora_a, lora_b, scalings):
    return [x.new_empty(x.shape[0], b.shape[0]) for b in lora_b]
