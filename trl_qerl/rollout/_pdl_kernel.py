"""Programmatic Dependent Launch for the rollout's Triton kernels (kept apart: Triton is optional).

Launched with PDL (`launch_options`), a kernel may start while the kernel before it in the stream is still running, so
that its launch and its first loads overlap that kernel's last programs (a decode step at batch 1 is ~320 kernels,
each a few microseconds, and the NVFP4 decode kernel already does this: `nvfp4.cuda_mma.PDL_BUILD`). The contract,
the one the NVFP4 kernel keeps:

* before `wait_for_previous_kernel` a program may read only what no kernel of the step writes (the LoRA A matrices),
  and write nothing; after it, everything the kernels before it wrote is visible;
* every program calls it, so a kernel completes only after the kernel before it has, and the guarantee carries down
  a chain of PDL launches;
* `allow_next_kernel` lets the next PDL launch start once every program of this one has called it (every program is
  then resident, so the next kernel's programs take no place this one needs).

Without the launch attribute both calls are no-ops, and with ``PDL`` False they are not compiled at all (the CPU
interpreter and GPUs before sm_90 never see them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..nvfp4.cuda_mma import programmatic_launch


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """``griddepcontrol.wait`` in a PDL build: what the kernels before this one wrote is visible after it."""
    if PDL:
        gdc_wait()


@triton.jit
def allow_next_kernel(PDL: tl.constexpr):
    """``griddepcontrol.launch_dependents`` in a PDL build: the next PDL launch may start."""
    if PDL:
        gdc_launch_dependents()


def launch_options(device: torch.device, rows: int) -> dict:
    """The ``PDL`` constexpr of a launch of ``rows`` rows on ``device`` and, where `programmatic_launch` says so, the
    launch option that asks for Programmatic Dependent Launch."""
    return {"PDL": True, "launch_pdl": True} if programmatic_launch(device, rows) else {"PDL": False}
