"""`NVFP4A16Linear`: a frozen `nn.Linear` whose weight lives in NVFP4 (4.5 bits per weight, W4A16).

The layer keeps the three compressed-tensors tensors (``weight_packed``, ``weight_scale``,
``weight_global_scale``) as frozen parameters and never stores a dense weight. Its autograd function saves only
those packed tensors for backward and dequantises again there, so training with LoRA on top does not keep a
16-bit copy of every base weight alive between forward and backward. Products run in the dtype of the activations
they receive (fp32 activations dequantise to fp32, bf16 to bf16).

Why an ``nn.Linear`` subclass with a storage-less ``weight`` handle, and not a torchao-style quantised tensor
subclass as ``nn.Linear.weight``:

* PEFT, TRL and transformers recognise linear layers by ``isinstance(module, nn.Linear)``: PEFT's default dispatch
  wraps the layer with its own ``lora.Linear``, ``target_modules="all-linear"`` selects it, ``PeftModel.from_pretrained``
  and ``GRPOTrainer(peft_config=LoraConfig(...))`` work with no registration (PEFT's ``_register_custom_module``
  is private and not saved with the adapter). A quantised-tensor weight gains nothing there: PEFT special-cases
  only torchao's own classes (``dispatch_torchao``, ``dequantize_module_weight``), so a foreign subclass would be
  wrapped by the same default ``lora.Linear``.
* The checkpoint format is compressed-tensors': three separately named tensors per layer, which transformers loads
  by name into typed placeholders and vLLM reads as they are. A single ``weight`` subclass would need flatten and
  unflatten conversion ops for loading and saving (an API that changed between transformers 5.17 and 5.24) and a
  custom state dict for the vLLM export.
* Plain uint8/fp8/fp32 parameters already work with everything that touches parameters (DDP broadcast exclusion by
  name, ``deepcopy``, ``torch.save``, device moves, CUDA graphs and ``torch.compile`` through the custom ops); a
  parameter subclass would need a dispatch rule for each of those, and subclass tracing under ``torch.compile``.

``weight`` is therefore a property returning a `NVFP4WeightHandle`: a tensor subclass with the layer's shape
``[out, in]``, compute dtype and device but no storage. It is what PEFT reads to place and type adapters; it is
not a parameter or buffer (not in ``state_dict``, optimizers or DDP); ``F.linear(x, layer.weight, layer.bias)``
computes the NVFP4 product; transformers' weight initialisation skips it; every other operation on it (PEFT's merge,
DoRA/PiSSA/LoftQ initialisations, in-place edits) raises `NVFP4WeightError`, which points at
``trl_qerl.merge_and_export``: merging LoRA into 4-bit weights rounds the update away.

Matrix products go through the per-device kernel registry in `trl_qerl.nvfp4.dispatch`: the pure-torch reference
(dequantise, then `F.linear`) serves every device; the fused Triton kernels of `trl_qerl.nvfp4.kernels` serve CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._deprecation import deprecated_names
from .dispatch import kernels_for
from .format import GROUP_SIZE, NVFP4Weight, check_packed, dequantize, quantize


QUANTIZED_TENSOR_NAMES = ("weight_packed", "weight_scale", "weight_global_scale")

# Integer dtypes of the same width: a module-wide `.to(dtype)` casts floating-point tensors, and casting the
# fp8 scales or the fp32 global scale to bf16 would silently corrupt them. Viewing them as integers while
# the cast runs lets device moves through and keeps the bits.
_BIT_VIEW_DTYPE = {torch.float8_e4m3fn: torch.uint8, torch.float32: torch.int32}

MERGE_REFUSAL = (
    "Merging a LoRA adapter into NVFP4 weights would dequantise, add and requantise, rounding away every update "
    "smaller than one E2M1 step. Keep the adapter separate (vLLM and trl-qerl apply it unmerged), or call "
    "`trl_qerl.merge_and_export(model, output_dir, base_model=<16-bit checkpoint>)` to merge into the 16-bit "
    "master weights and optionally quantise the result afresh."
)


class NVFP4WeightError(ValueError):
    """Dense arithmetic on the packed weight of an NVFP4 layer (a LoRA merge, an initialisation from the base
    weight, an in-place edit) was refused."""


class NVFP4LinearFunction(torch.autograd.Function):
    """``y = x @ dequant(W).T + b`` on 2-D ``x``, saving only the packed weight tensors for backward.

    Its output is a fresh tensor, not a view (reshaping happens in `nvfp4_linear`, outside the Function), so callers
    may accumulate into it in place: `LoraNVFP4Linear` adds its LoRA product with one in-place ``addmm_``."""

    @staticmethod
    def forward(ctx, x, weight_packed, weight_scale, weight_global_scale, bias):
        out = kernels_for(x.device).linear(x, weight_packed, weight_scale, weight_global_scale)
        if bias is not None:
            out = out + bias.to(out.dtype)
        ctx.save_for_backward(weight_packed, weight_scale, weight_global_scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        weight_packed, weight_scale, weight_global_scale = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            kernels = kernels_for(grad_out.device)
            grad_x = kernels.grad_input(grad_out, weight_packed, weight_scale, weight_global_scale)
        if ctx.needs_input_grad[4]:
            grad_bias = grad_out.sum(dim=0)
        return grad_x, None, None, None, grad_bias


def nvfp4_linear(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Functional form of `NVFP4A16Linear.forward`; differentiable w.r.t. ``x`` and ``bias``; in ``x.dtype``. A 2-D
    ``x`` gives the autograd Function's own (non-view) output."""
    flat = x.reshape(-1, x.shape[-1])
    out = NVFP4LinearFunction.apply(flat, weight_packed, weight_scale, weight_global_scale, bias)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])


_aten = torch.ops.aten
_HANDLE_ALIASES = (_aten.detach.default, _aten.alias.default)


class NVFP4WeightHandle(torch.Tensor):
    """What `NVFP4A16Linear.weight` returns: the ``[out, in]`` weight's shape, compute dtype and device, no storage.

    ``F.linear(x, handle, bias)`` computes the NVFP4 product, `dequantize` gives a dense copy, ``detach()`` and
    ``.data`` give another handle; every other operation raises `NVFP4WeightError`.
    """

    _is_hf_initialized = True  # transformers' weight initialisation leaves it alone (it was loaded, not created)

    @staticmethod
    def __new__(cls, quantized: NVFP4Weight, dtype: torch.dtype):
        packed = quantized.weight_packed
        shape = (packed.shape[0], packed.shape[1] * 2)
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=packed.device, requires_grad=False)

    def __init__(self, quantized: NVFP4Weight, dtype: torch.dtype) -> None:
        self.quantized = NVFP4Weight(*quantized)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dense ``[out, in]`` weight in ``dtype`` (default: the layer's compute dtype), a new tensor."""
        return dequantize(*self.quantized, dtype=dtype or self.dtype)

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"NVFP4WeightHandle(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"

    def __reduce_ex__(self, protocol):
        raise NVFP4WeightError(
            "NVFP4A16Linear.weight is a handle without data and cannot be pickled; save the layer's state_dict "
            "(weight_packed, weight_scale, weight_global_scale) instead."
        )

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, bias = _linear_arguments(*args, **kwargs)
            if isinstance(weight, cls) and not isinstance(x, cls) and not isinstance(bias, cls):
                return nvfp4_linear(x, *weight.quantized, bias)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in _HANDLE_ALIASES:
            handle = args[0]
            return cls(handle.quantized, handle.dtype)
        raise NVFP4WeightError(
            f"NVFP4A16Linear keeps its weight packed in 4 bits; its `weight` is a handle without data and refuses "
            f"dense arithmetic ({func}). {MERGE_REFUSAL} LoRA variants and initialisations that need the dense base "
            "weight (DoRA, PiSSA, OLoRA, LoftQ, CorDA, ...) are not supported on NVFP4 layers. For a dense copy of "
            "the weight call `layer.dequantize_weight()`."
        )


def _linear_arguments(input, weight, bias=None):
    return input, weight, bias


class NVFP4A16Linear(nn.Linear):
    """A linear layer with frozen NVFP4 weights and an optional 16-bit bias (an `nn.Linear` without a dense weight).

    Args:
        in_features: size of each input sample; must be a multiple of 16.
        out_features: size of each output sample.
        bias: whether the layer has a (trainable-capable) bias.
        device: where to allocate the (empty) tensors.
        dtype: dtype of the bias.
        compute_dtype: dtype of the activations this layer normally sees (the dtype ``weight`` reports, which LoRA
            adapters on top are created in); defaults to ``dtype`` or bf16. Module casts (``model.to(dtype)``)
            update it.

    The quantised tensors are frozen ``nn.Parameter`` s, typed as in compressed-tensors checkpoints:
    ``weight_packed`` uint8 ``[out, in/2]``, ``weight_scale`` float8_e4m3fn ``[out, in/16]``,
    ``weight_global_scale`` float32 ``[1]``. Module casts such as ``model.to(torch.bfloat16)`` move them between
    devices but never change their dtype. ``weight`` is a `NVFP4WeightHandle` (see the module docstring); while a
    quantise-on-load placeholder holds its 16-bit checkpoint weight, ``weight`` is that parameter.
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
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would allocate the dense weight
        if in_features % GROUP_SIZE != 0:
            raise ValueError(
                f"NVFP4A16Linear needs in_features to be a multiple of {GROUP_SIZE}, got {in_features}; keep this "
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

    @property
    def weight(self) -> torch.Tensor:
        dense = self._parameters.get("weight")
        if dense is not None:  # a quantise-on-load placeholder, until its checkpoint weight is quantised
            return dense
        return NVFP4WeightHandle(self.quantized_weight, self.compute_dtype)

    @weight.setter
    def weight(self, value) -> None:
        # nn.Module.__setattr__ registers Parameters itself (see `register_parameter`); anything else lands here.
        raise NVFP4WeightError(
            f"NVFP4A16Linear.weight cannot be assigned a {type(value).__name__}: the layer's weight is its packed "
            f"tensors (use `load_quantized`). {MERGE_REFUSAL}"
        )

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        # `weight` is a property, so nn.Module would refuse a parameter of that name ("attribute already exists");
        # the quantise-on-load placeholder needs one for the 16-bit checkpoint weight.
        if name == "weight":
            self._parameters.setdefault("weight", None)
        super().register_parameter(name, param)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, global_scale: torch.Tensor | None = None, name: str = "linear"
    ) -> NVFP4A16Linear:
        """Quantise an `nn.Linear` (RTN); ``global_scale`` lets q/k/v or gate/up share one scale."""
        if isinstance(linear, NVFP4A16Linear):
            raise TypeError(f"{name} is already an NVFP4A16Linear.")
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

    def dequantize_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dense ``[out, in]`` weight in ``dtype`` (default: the compute dtype); a new tensor, the layer keeps only
        its packed form."""
        return dequantize(*self.quantized_weight, dtype=dtype or self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"NVFP4A16Linear expected inputs with last dimension {self.in_features}, got shape {tuple(x.shape)}."
            )
        return nvfp4_linear(x, self.weight_packed, self.weight_scale, self.weight_global_scale, self.bias)

    def reset_parameters(self) -> None:
        # nn.Linear's would initialise a dense weight; the packed tensors are loaded, never initialised.
        return None

    def _apply(self, fn, recurse=True):
        # Apply `fn` to the quantised tensors through same-width integer views, so that dtype casts
        # (`model.to(torch.bfloat16)`, `.half()`) cannot touch them while device moves still do. A floating-point
        # cast moves the compute dtype along (what `weight` reports, and what LoRA adapters are created in).
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
        self.compute_dtype = _cast_dtype(fn, self.compute_dtype)
        return self

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"compute_dtype={self.compute_dtype}"
        )


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def _cast_dtype(fn, dtype: torch.dtype) -> torch.dtype:
    """The floating-point dtype ``fn`` (an ``nn.Module._apply`` function) casts ``dtype`` to."""
    try:
        probe = fn(torch.empty(0, dtype=dtype))
    except (RuntimeError, TypeError):  # e.g. a function that only accepts the module's own tensors
        return dtype
    return probe.dtype if isinstance(probe, torch.Tensor) and probe.is_floating_point() else dtype


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
    names = [name for name, _ in model.named_parameters() if name.rpartition(".")[2] in QUANTIZED_TENSOR_NAMES]
    existing = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    model._ddp_params_and_buffers_to_ignore = sorted(set(existing + names))
    return names


def nvfp4_modules(model: nn.Module) -> dict[str, NVFP4A16Linear]:
    """All `NVFP4A16Linear` layers of ``model`` by qualified name."""
    return {name: module for name, module in model.named_modules() if isinstance(module, NVFP4A16Linear)}


__getattr__ = deprecated_names(__name__, {"NVFP4Linear": "NVFP4A16Linear"}, lambda name: globals()[name])
