"""`NVFP4Linear`: a frozen linear layer whose weight lives in NVFP4 (4.5 bits per weight).

The layer keeps the three compressed-tensors tensors (``weight_packed``, ``weight_scale``,
``weight_global_scale``) and never stores a dense weight. Its autograd function saves only those packed
tensors for backward and dequantises again there, so training with LoRA on top does not keep a bf16 copy
of every base weight alive between forward and backward.

Matrix products go through a small per-device kernel registry: the pure-torch reference (dequantise, then
`F.linear`) serves every device; `trl_qerl.nvfp4.kernels` registers fused Triton kernels for CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .format import GROUP_SIZE, NVFP4Weight, check_packed, dequantize, quantize


QUANTIZED_TENSOR_NAMES = ("weight_packed", "weight_scale", "weight_global_scale")

# Integer dtypes of the same width: a module-wide `.to(dtype)` casts floating-point tensors, and casting the
# fp8 scales or the fp32 global scale to bf16 would silently corrupt them. Viewing them as integers while
# the cast runs lets device moves through and keeps the bits.
_BIT_VIEW_DTYPE = {torch.float8_e4m3fn: torch.uint8, torch.float32: torch.int32}

LinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class NVFP4Kernels:
    """The two products an NVFP4 layer needs, for activations ``x[M, in]`` and the weight ``W[out, in]``.

    Attributes:
        linear: ``(x, weight_packed, weight_scale, weight_global_scale) -> x @ W.T`` (no bias).
        grad_input: ``(grad_out, weight_packed, weight_scale, weight_global_scale) -> grad_out @ W``.
        name: shown in logs and benchmarks.
    """

    linear: LinearFn
    grad_input: LinearFn
    name: str


def _reference_linear(x, weight_packed, weight_scale, weight_global_scale):
    return F.linear(x, dequantize(weight_packed, weight_scale, weight_global_scale, dtype=x.dtype))


def _reference_grad_input(grad_out, weight_packed, weight_scale, weight_global_scale):
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
    # The Triton module registers itself on import; importing it only when CUDA activations first appear keeps
    # `import trl_qerl` free of Triton and CUDA initialisation.
    try:
        from . import kernels  # noqa: F401
    except ImportError:
        register_kernels("cuda", REFERENCE_KERNELS)


class NVFP4LinearFunction(torch.autograd.Function):
    """``y = x @ dequant(W).T + b`` that saves only the packed weight tensors for backward."""

    @staticmethod
    def forward(ctx, x, weight_packed, weight_scale, weight_global_scale, bias):
        kernels = kernels_for(x.device)
        flat = x.reshape(-1, x.shape[-1])
        out = kernels.linear(flat, weight_packed, weight_scale, weight_global_scale)
        if bias is not None:
            out = out + bias.to(out.dtype)
        ctx.save_for_backward(weight_packed, weight_scale, weight_global_scale)
        ctx.input_shape = x.shape
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        weight_packed, weight_scale, weight_global_scale = ctx.saved_tensors
        flat_grad = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            kernels = kernels_for(grad_out.device)
            grad_x = kernels.grad_input(flat_grad, weight_packed, weight_scale, weight_global_scale)
            grad_x = grad_x.reshape(ctx.input_shape)
        if ctx.needs_input_grad[4]:
            grad_bias = flat_grad.sum(dim=0)
        return grad_x, None, None, None, grad_bias


def nvfp4_linear(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Functional form of `NVFP4Linear.forward`; differentiable w.r.t. ``x`` and ``bias``."""
    return NVFP4LinearFunction.apply(x, weight_packed, weight_scale, weight_global_scale, bias)


class NVFP4Linear(nn.Module):
    """A linear layer with frozen NVFP4 weights and an optional 16-bit bias.

    Args:
        in_features: size of each input sample; must be a multiple of 16.
        out_features: size of each output sample.
        bias: whether the layer has a (trainable-capable) bias.
        device: where to allocate the (empty) tensors.
        dtype: dtype of the bias.
        compute_dtype: dtype of the activations this layer normally sees (what LoRA adapters on top use);
            defaults to ``dtype`` or bf16.

    The quantised tensors are frozen ``nn.Parameter`` s (PEFT requires a layer to own a parameter), typed as in
    compressed-tensors checkpoints: ``weight_packed`` uint8 ``[out, in/2]``, ``weight_scale`` float8_e4m3fn
    ``[out, in/16]``, ``weight_global_scale`` float32 ``[1]``. Module casts such as ``model.to(torch.bfloat16)``
    move them between devices but never change their dtype.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if in_features % GROUP_SIZE != 0:
            raise ValueError(
                f"NVFP4Linear needs in_features to be a multiple of {GROUP_SIZE}, got {in_features}; keep this "
                "layer in 16-bit."
            )
        self.in_features = in_features
        self.out_features = out_features
        self.compute_dtype = compute_dtype or dtype or torch.bfloat16
        self.weight_packed = _frozen(torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.weight_scale = _frozen(
            torch.empty(out_features, in_features // GROUP_SIZE, dtype=torch.float8_e4m3fn, device=device)
        )
        self.weight_global_scale = _frozen(torch.empty(1, dtype=torch.float32, device=device))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, global_scale: torch.Tensor | None = None, name: str = "linear"
    ) -> NVFP4Linear:
        """Quantise an `nn.Linear` (RTN); ``global_scale`` lets q/k/v or gate/up share one scale."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device=linear.weight.device,
            dtype=linear.bias.dtype if linear.bias is not None else None,
            compute_dtype=linear.weight.dtype,
        )
        layer.load_quantized(quantize(linear.weight, global_scale, name=name))
        if linear.bias is not None:
            layer.bias.data.copy_(linear.bias.detach())
            layer.bias.requires_grad_(linear.bias.requires_grad)
        return layer

    @torch.no_grad()
    def load_quantized(self, quantized: NVFP4Weight) -> None:
        """Copy already-quantised tensors in (validated against this layer's shape)."""
        check_packed(*quantized, name=type(self).__name__, shape=(self.out_features, self.in_features))
        for name, value in zip(QUANTIZED_TENSOR_NAMES, quantized):
            setattr(self, name, _frozen(value.detach().to(getattr(self, name).device)))

    @property
    def quantized_weight(self) -> NVFP4Weight:
        return NVFP4Weight(self.weight_packed, self.weight_scale, self.weight_global_scale)

    def dequantize_weight(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Dense ``[out, in]`` weight (a new tensor; the layer keeps only its packed form)."""
        return dequantize(*self.quantized_weight, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"NVFP4Linear expected inputs with last dimension {self.in_features}, got shape {tuple(x.shape)}."
            )
        return nvfp4_linear(x, self.weight_packed, self.weight_scale, self.weight_global_scale, self.bias)

    def _apply(self, fn, recurse=True):
        # Apply `fn` to the quantised tensors through same-width integer views, so that dtype casts
        # (`model.to(torch.bfloat16)`, `.half()`) cannot touch them while device moves still do.
        order = list(self._parameters)
        quantized = {name: self._parameters.pop(name) for name in order if name in QUANTIZED_TENSOR_NAMES}
        try:
            super()._apply(fn, recurse)
        finally:
            for name, param in quantized.items():
                if param is not None:
                    quantized[name] = _apply_keeping_dtype(fn, param)
            others = self._parameters
            self._parameters = {name: quantized[name] if name in quantized else others[name] for name in order}
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def _apply_keeping_dtype(fn, param: nn.Parameter) -> nn.Parameter:
    view_dtype = _BIT_VIEW_DTYPE.get(param.dtype)
    data = param.data
    moved = fn(data) if view_dtype is None else fn(data.view(view_dtype)).view(param.dtype)
    if moved is data:
        return param
    if torch._has_compatible_shallow_copy_type(data, moved):
        param.data = moved
        return param
    # e.g. meta <-> real device: nn.Module._apply replaces the Parameter in this case too
    return _frozen(moved)


def exclude_packed_tensors_from_ddp(model: nn.Module) -> list[str]:
    """Tell DistributedDataParallel not to broadcast the frozen NVFP4 tensors of ``model`` (every rank loads the
    same ones; NCCL/gloo may not even support fp8 broadcasts). Returns the names it set."""
    names = [
        name for name, _ in model.named_parameters() if name.rpartition(".")[2] in QUANTIZED_TENSOR_NAMES
    ]
    existing = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    model._ddp_params_and_buffers_to_ignore = sorted(set(existing + names))
    return names


def nvfp4_modules(model: nn.Module) -> dict[str, NVFP4Linear]:
    """All `NVFP4Linear` layers of ``model`` by qualified name."""
    return {name: module for name, module in model.named_modules() if isinstance(module, NVFP4Linear)}
