"""NVFP4A16Linear: forward/backward against the dense reference, frozen dtypes, and what autograd keeps alive."""

import copy
import io

import pytest
import torch
import torch.nn.functional as F

from trl_qerl.nvfp4.format import relative_error
from trl_qerl.nvfp4.linear import NVFP4A16Linear, kernels_for, nvfp4_linear


def _layer(in_features=64, out_features=48, bias=True, seed=0):
    torch.manual_seed(seed)
    return NVFP4A16Linear.from_linear(torch.nn.Linear(in_features, out_features, bias=bias))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 64)])
def test_forward_equals_dense_reference(bias, dtype, shape):
    layer = _layer(bias=bias).to(dtype)
    x = torch.randn(*shape, dtype=dtype)
    expected = F.linear(
        x.double(), layer.dequantize_weight(torch.float64), None if layer.bias is None else layer.bias.double()
    )
    assert relative_error(expected, layer(x)) < (1e-6 if dtype == torch.float32 else 1e-2)


def test_backward_matches_dense_autograd():
    layer = _layer()
    dense_weight = layer.dequantize_weight(torch.float32)
    x = torch.randn(3, 4, 64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    bias_ref = layer.bias.detach().clone().requires_grad_(True)
    grad = torch.randn(3, 4, 48)
    layer(x).backward(grad)
    F.linear(x_ref, dense_weight, bias_ref).backward(grad)
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-6)
    assert torch.allclose(layer.bias.grad, bias_ref.grad, atol=1e-5)
    assert all(getattr(layer, n).grad is None for n in ("weight_packed", "weight_scale", "weight_global_scale"))


@pytest.mark.parametrize("bias", [True, False])
def test_two_dimensional_output_is_the_functions_own_and_takes_in_place_sums(bias):
    """A 2-D input gives the autograd Function's own output, not a view (`LoraNVFP4Linear` adds its LoRA product into
    it in place, which autograd forbids on a view made inside a custom Function); summing into it in place keeps the
    input gradient right. A 3-D input gives a view of that output, with the same values."""
    layer = _layer(bias=bias)
    x = torch.randn(6, 64, requires_grad=True)
    out = layer(x)
    assert not out._is_view() and out.grad_fn is not None
    extra = torch.randn(6, 48)
    out.add_(extra)
    upstream = torch.randn(6, 48)
    out.backward(upstream)
    x_ref = x.detach().clone().requires_grad_(True)
    (F.linear(x_ref, layer.dequantize_weight(torch.float32), layer.bias) + extra).backward(upstream)
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-5)
    batched = layer(x.detach().view(2, 3, 64))
    assert batched.shape == (2, 3, 48) and torch.equal(batched.reshape(6, 48), layer(x.detach()))


def test_gradcheck_in_float64():
    layer = _layer(in_features=32, out_features=8)
    x = torch.randn(3, 32, dtype=torch.float64, requires_grad=True)
    bias = layer.bias.detach().double().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda inp, b: nvfp4_linear(inp, layer.weight_packed, layer.weight_scale, layer.weight_global_scale, b),
        (x, bias),
    )


def test_backward_saves_only_packed_weights():
    """Training memory: autograd must not keep a dense copy of the weight between forward and backward."""
    layer = _layer(in_features=256, out_features=512, bias=False).to(torch.bfloat16)
    x = torch.randn(4, 256, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = layer(x)
    dense_bytes = 512 * 256 * 2
    packed_bytes = sum(t.numel() * t.element_size() for t in layer.quantized_weight)
    saved_bytes = sum(t.numel() * t.element_size() for t in saved)
    assert not any(t.numel() >= 512 * 256 and t.is_floating_point() for t in saved)
    assert saved_bytes == packed_bytes  # exactly the packed tensors: 4.5 bits per weight
    assert saved_bytes < dense_bytes / 3.5
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_naive_dequantise_would_save_dense_weight():
    """The trap the autograd Function avoids, measured the same way."""
    layer = _layer(in_features=256, out_features=512, bias=False)
    x = torch.randn(4, 256, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        F.linear(x, layer.dequantize_weight(torch.float32))
    assert any(t.numel() == 512 * 256 and t.is_floating_point() for t in saved)


def test_module_casts_keep_quantized_dtypes_and_bits():
    layer = _layer()
    before = {n: getattr(layer, n).detach().clone() for n in ("weight_packed", "weight_scale", "weight_global_scale")}
    layer.to(torch.bfloat16)
    layer.half()
    layer.float()
    assert layer.bias.dtype == torch.float32
    for name, value in before.items():
        after = getattr(layer, name)
        assert after.dtype == value.dtype and not after.requires_grad
        assert torch.equal(after.view(torch.uint8), value.view(torch.uint8))
    assert [n for n, _ in layer.named_parameters()] == ["weight_packed", "weight_scale", "weight_global_scale", "bias"]


def test_to_empty_and_meta_keep_dtypes():
    layer = _layer().to("meta")
    assert layer.weight_scale.is_meta and layer.weight_scale.dtype == torch.float8_e4m3fn
    layer.to_empty(device="cpu")
    assert layer.weight_global_scale.dtype == torch.float32 and layer.weight_global_scale.device.type == "cpu"


def test_deepcopy_and_weights_only_serialisation_round_trip():
    layer = _layer()
    x = torch.randn(2, 64)
    clone = copy.deepcopy(layer)
    assert torch.equal(clone(x), layer(x))
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    fresh = NVFP4A16Linear(64, 48)
    fresh.load_state_dict(state)
    assert torch.equal(fresh(x), layer(x))


def test_bad_construction_and_inputs():
    with pytest.raises(ValueError, match="multiple of 16"):
        NVFP4A16Linear(40, 8)
    layer = _layer()
    with pytest.raises(ValueError, match="last dimension 64"):
        layer(torch.randn(2, 32))


def test_cpu_uses_reference_kernels():
    assert kernels_for(torch.device("cpu")).name == "reference"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_move_is_bit_identical():
    layer = _layer()
    moved = copy.deepcopy(layer).cuda().cpu()
    for name in ("weight_packed", "weight_scale", "weight_global_scale"):
        assert torch.equal(getattr(moved, name).view(torch.uint8), getattr(layer, name).view(torch.uint8))
