"""Which kernels an NVFP4 layer runs on a device: a small registry keyed by device type.

The pure-torch reference (dequantise, then `F.linear`) serves every device; the Triton kernels in
`trl_qerl.nvfp4.kernels` are registered for CUDA the first time CUDA activations reach an NVFP4 layer (they pick
their variant per GPU themselves, see `kernels.device_path`). Lower than `linear.py`, which asks `kernels_for`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F

from . import twiddle
from .format import dequantize
from .lora_terms import add_lora_terms


EagerFn = TypeVar("EagerFn", bound=Callable[..., torch.Tensor])
LinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Tensors = list[torch.Tensor]
OptionalTensors = list[torch.Tensor | None]
GroupedFn = Callable[[torch.Tensor, Tensors, Tensors, Tensors, OptionalTensors], torch.Tensor]
GroupedLoraFn = Callable[
    [torch.Tensor, Tensors, Tensors, Tensors, OptionalTensors, torch.Tensor, OptionalTensors, list[float]],
    torch.Tensor,
]


def _reference_grouped(x, weight_packed, weight_scale, weight_global_scale, bias):
    outs = [_reference_linear(x, *weight) for weight in zip(weight_packed, weight_scale, weight_global_scale)]
    return torch.cat([out + b.to(out.dtype) if b is not None else out for out, b in zip(outs, bias)], dim=1)


def _reference_grouped_lora(x, weight_packed, weight_scale, weight_global_scale, bias, hidden, lora_b, scaling):
    out = _reference_grouped(x, weight_packed, weight_scale, weight_global_scale, bias)
    return add_lora_terms(out, [p.shape[0] for p in weight_packed], hidden, lora_b, scaling)


@dataclass(frozen=True)
class NVFP4Kernels:
    """The two products an NVFP4 layer needs, for activations ``x[M, in]`` and the weight ``W[out, in]``.

    Attributes:
        linear: ``(x, weight_packed, weight_scale, weight_global_scale) -> x @ W.T`` (no bias), in ``x.dtype``.
        grad_input: ``(grad_out, weight_packed, weight_scale, weight_global_scale) -> grad_out @ W``.
        name: shown in logs and benchmarks.
        grouped: ``(x, packed[], scale[], global_scale[], bias[]) -> cat([x @ W_i.T + b_i], dim=1)`` for weights
            that read the same activations (q/k/v, gate/up); the reference computes one product per weight.
        grouped_lora: ``grouped`` plus one LoRA term per weight, ``(..., hidden, lora_b[], scaling[])``: each output
            ``round(round(x @ W_i.T + b_i) + scaling_i * hidden_i @ B_i.T)`` (see `add_lora_terms`); on CUDA the
            decode kernel adds the terms in its epilogue.
    """

    linear: LinearFn
    grad_input: LinearFn
    name: str
    grouped: GroupedFn = _reference_grouped
    grouped_lora: GroupedLoraFn = _reference_grouped_lora


def _reference_linear(x, weight_packed, weight_scale, weight_global_scale):
    twiddle.check_standard_order("the reference NVFP4 product")
    return F.linear(x, dequantize(weight_packed, weight_scale, weight_global_scale, dtype=x.dtype))


def _reference_grad_input(grad_out, weight_packed, weight_scale, weight_global_scale):
    twiddle.check_standard_order("the reference NVFP4 input gradient")
    return grad_out @ dequantize(weight_packed, weight_scale, weight_global_scale, dtype=grad_out.dtype)


REFERENCE_KERNELS = NVFP4Kernels(_reference_linear, _reference_grad_input, name="reference")
_KERNELS_BY_DEVICE_TYPE: dict[str, NVFP4Kernels] = {}


def register_kernels(device_type: str, kernels: NVFP4Kernels) -> None:
    """Use ``kernels`` for activations on ``device_type`` ("cuda", "cpu", ...); replaces any earlier entry."""
    _KERNELS_BY_DEVICE_TYPE[device_type] = kernels


def kernels_for(device: torch.device) -> NVFP4Kernels:
    """The kernels registered for ``device``'s type, else the pure-torch reference. (The CUDA kernels choose
    their variant per GPU themselves, see `kernels.device_path`, so one host may mix GPU generations.)"""
    if device.type == "cuda" and "cuda" not in _KERNELS_BY_DEVICE_TYPE:
        _load_cuda_kernels()
    return _KERNELS_BY_DEVICE_TYPE.get(device.type, REFERENCE_KERNELS)


def _load_cuda_kernels() -> None:
    # Imported only when CUDA activations first appear, which keeps `import trl_qerl` free of Triton and CUDA
    # initialisation. `kernels` is a leaf: it defines the custom ops and knows nothing of this registry.
    try:
        from . import kernels
    except ImportError:
        register_kernels("cuda", REFERENCE_KERNELS)
        return
    ops = torch.ops.trl_qerl  # the custom ops `kernels` defined (CUDA-graph and torch.compile safe)
    register_kernels(
        "cuda",
        NVFP4Kernels(
            op_when_traced(kernels.eager_linear, ops.nvfp4_linear),
            op_when_traced(kernels.eager_grad_input, ops.nvfp4_grad_input),
            name=kernels.KERNELS_NAME,
            grouped=op_when_traced(kernels.eager_grouped, ops.nvfp4_linear_grouped),
            grouped_lora=op_when_traced(kernels.eager_grouped_lora, ops.nvfp4_linear_grouped_lora),
        ),
    )


def op_when_traced(eager: EagerFn, op: Callable[..., torch.Tensor]) -> EagerFn:
    """``op`` (a custom op) while torch.compile or export traces, or where the first argument is a tensor subclass
    (fake and functional tensors of other tracers), else ``eager``, the op's own body, called directly.

    The two compute the same thing; the op's dispatch alone costs host time, which a training step pays once per
    product (a 3B step ~760 times, its device waiting on the host). Measured on the H200 (2026-12-04, 3B shapes at
    10,240 rows, `benchmarks/seventeenth_2026-12-04/`, ``host_probe.py``): 31-82 µs per call in three runs."""

    @functools.wraps(eager)
    def call(*args):
        if torch.compiler.is_compiling() or type(args[0]) is not torch.Tensor:
            return op(*args)
        return eager(*args)

    return call  # type: ignore[return-value]
