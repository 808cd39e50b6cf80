"""The "last program to arrive" step that the rollout's Triton kernels share (kept apart: Triton is optional).

Programs that each leave a partial result in scratch count their arrivals in a per-slot counter (zero between
launches, `nvfp4.cuda_mma.arrival_counters`); the last program of a slot to arrive sees every other one's partial,
combines them, and resets the counter, so CUDA-graph replays need no memset. `_split_kv_kernel` merges attention
partials this way, `_fused_shrink_kernel` adds the split LoRA shrinks.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def last_to_arrive(count_ptr, slot, arrivals):
    """Whether this program is the last of ``arrivals`` programs to arrive at counter ``slot``. Every thread's stores
    come before the count moves (the barrier), and the count's acquire-release makes the other programs' stores
    visible to the last one."""
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + slot, 1, sem="acq_rel", scope="gpu")
    return arrived == arrivals - 1


@triton.jit
def reset_arrivals(count_ptr, slot):
    """Zero counter ``slot`` for the next launch (called by the last program to arrive, after it has combined)."""
    tl.atomic_xchg(count_ptr + slot, 0, sem="relaxed", scope="gpu")
