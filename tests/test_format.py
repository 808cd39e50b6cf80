"""The pure-torch NVFP4 reference: E2M1 rounding, packing, scales, and bit-exactness with compressed-tensors."""

import pytest
import torch

from trl_qerl.nvfp4 import format as nvfp4


def test_e2m1_codes_round_half_to_even_at_every_decision_point():
    # value -> expected magnitude; ties go to the code with an even mantissa
    cases = {
        0.0: 0.0, 0.1: 0.0, 0.25: 0.0, 0.26: 0.5, 0.5: 0.5, 0.74: 0.5, 0.75: 1.0, 1.0: 1.0, 1.25: 1.0,
        1.26: 1.5, 1.5: 1.5, 1.74: 1.5, 1.75: 2.0, 2.5: 2.0, 2.51: 3.0, 3.0: 3.0, 3.49: 3.0, 3.5: 4.0,
        5.0: 4.0, 5.01: 6.0, 6.0: 6.0, 100.0: 6.0,
    }  # fmt: skip
    values = torch.tensor(list(cases), dtype=torch.float32)
    expected = torch.tensor(list(cases.values()))
    for sign in (1.0, -1.0):
        codes = nvfp4.round_to_e2m1_codes(sign * values)
        assert torch.equal(nvfp4.e2m1_values(codes), sign * expected)
        assert bool(((codes >> 3) == (1 if sign < 0 else 0)).all())


def test_e2m1_table_matches_bit_layout():
    codes = torch.arange(16, dtype=torch.uint8)
    values = nvfp4.e2m1_values(codes)
    assert values[:8].tolist() == list(nvfp4.E2M1_VALUES)
    assert values[8:].tolist() == [-v for v in nvfp4.E2M1_VALUES]
    assert torch.equal(nvfp4.round_to_e2m1_codes(values[1:8]), codes[1:8])


def test_pack_puts_even_column_in_low_nibble_and_round_trips():
    codes = torch.randint(0, 16, (7, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = nvfp4.pack_codes(codes)
    assert packed.shape == (7, 16) and packed.dtype == torch.uint8
    assert torch.equal(packed[:, 0] & 0xF, codes[:, 0]) and torch.equal(packed[:, 0] >> 4, codes[:, 1])
    assert torch.equal(nvfp4.unpack_codes(packed), codes)


def test_quantize_shapes_dtypes_and_gaussian_error():
    weight = torch.randn(96, 160, generator=torch.Generator().manual_seed(0))
    q = nvfp4.quantize(weight)
    assert q.weight_packed.shape == (96, 80) and q.weight_packed.dtype == torch.uint8
    assert q.weight_scale.shape == (96, 10) and q.weight_scale.dtype == torch.float8_e4m3fn
    assert q.weight_global_scale.shape == (1,) and q.weight_global_scale.dtype == torch.float32
    error = nvfp4.relative_error(weight, nvfp4.dequantize(*q, dtype=torch.float32))
    assert 0.07 < error < 0.11  # NVFP4 RTN on Gaussian weights: about 9.5%


def test_block_amax_is_exact_and_scale_saturates_fp8_range():
    weight = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    q = nvfp4.quantize(weight)
    dense = nvfp4.dequantize(*q, dtype=torch.float32)
    # the largest magnitude of the tensor maps to E2M1 6 x FP8 448 exactly, so it is reproduced exactly
    index = weight.abs().argmax()
    assert dense.flatten()[index] == pytest.approx(weight.flatten()[index].item(), rel=1e-6)
    assert q.weight_scale.float().max().item() == 448.0


def test_zero_weight_and_zero_block_follow_compressed_tensors_conventions():
    zero = nvfp4.quantize(torch.zeros(2, 16))
    assert zero.weight_global_scale.item() == 1.0
    assert torch.all(zero.weight_scale.float() == 0.125)
    assert torch.all(nvfp4.dequantize(*zero, dtype=torch.float32) == 0)
    weight = torch.randn(2, 32, generator=torch.Generator().manual_seed(2))
    weight[0, :16] = 0
    q = nvfp4.quantize(weight)
    assert q.weight_scale.float()[0, 0].item() == 0.125
    assert torch.all(nvfp4.dequantize(*q, dtype=torch.float32)[0, :16] == 0)


def test_shared_global_scale_is_the_smallest_member_scale():
    generator = torch.Generator().manual_seed(3)
    weights = [torch.randn(16, 32, generator=generator) * s for s in (0.5, 2.0, 1.0)]
    shared = nvfp4.shared_global_scale(weights)
    members = torch.cat([nvfp4.global_scale_from_amax(w.abs().amax()) for w in weights])
    assert shared.item() == members.min().item()
    q = nvfp4.quantize(weights[0], shared)
    assert q.weight_global_scale.item() == shared.item()


def test_chunked_quantisation_equals_one_shot(monkeypatch):
    weight = torch.randn(50, 64, generator=torch.Generator().manual_seed(4), dtype=torch.bfloat16)
    whole = nvfp4.quantize(weight)
    monkeypatch.setattr(nvfp4, "_QUANTIZE_CHUNK_ELEMENTS", 64 * 7)  # 7 rows per chunk, last chunk ragged
    chunked = nvfp4.quantize(weight)
    assert torch.equal(whole.weight_packed, chunked.weight_packed)
    assert torch.equal(whole.weight_scale.view(torch.uint8), chunked.weight_scale.view(torch.uint8))


@pytest.mark.parametrize(
    "weight, message",
    [
        (torch.randn(4, 20), "multiple of 16"),
        (torch.randn(16), "2-D"),
        (torch.randint(0, 3, (4, 16)), "floating-point"),
        (torch.tensor([[float("nan")] + [1.0] * 15]), "NaN/Inf"),
        (torch.tensor([[float("inf")] + [1.0] * 15]), "NaN/Inf"),
    ],
)
def test_bad_weights_get_clear_errors(weight, message):
    with pytest.raises(ValueError, match=message) as info:
        nvfp4.quantize(weight, name="model.layers.3.mlp.up_proj")
    assert "model.layers.3.mlp.up_proj" in str(info.value)


def test_check_packed_names_dtype_and_shape_problems():
    q = nvfp4.quantize(torch.randn(8, 32))
    with pytest.raises(ValueError, match="weight_packed has dtype torch.int8"):
        nvfp4.check_packed(q.weight_packed.view(torch.int8), q.weight_scale, q.weight_global_scale)
    with pytest.raises(ValueError, match="weight_scale has dtype torch.bfloat16"):
        nvfp4.check_packed(q.weight_packed, q.weight_scale.to(torch.bfloat16), q.weight_global_scale)
    with pytest.raises(ValueError, match="weight_scale has shape"):
        nvfp4.check_packed(q.weight_packed, q.weight_scale[:, :1], q.weight_global_scale)
    with pytest.raises(ValueError, match="expected \\(8, 32\\)"):
        nvfp4.check_packed(*q, shape=(8, 64))


# -- bit-exact agreement with compressed-tensors ------------------------------------------------------------
ct = pytest.importorskip("compressed_tensors")


def _compressed_tensors_quantize(weight):
    from compressed_tensors.compressors.nvfp4.helpers import quantize_and_pack_fp4
    from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy, QuantizationType
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    args = QuantizationArgs(
        num_bits=4,
        type=QuantizationType.FLOAT,
        strategy=QuantizationStrategy.TENSOR_GROUP,
        group_size=16,
        symmetric=True,
        scale_dtype=torch.float8_e4m3fn,
    )
    stats = weight.float()  # observer statistics in float32, as our reference computes them
    global_scale = generate_gparam(stats.amin(), stats.amax())
    blocks = stats.reshape(weight.shape[0], -1, 16)
    scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args, global_scale=global_scale)
    packed = quantize_and_pack_fp4(weight, scale, global_scale=global_scale)
    return args, packed, scale.to(torch.float8_e4m3fn), global_scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", range(4))
def test_bit_exact_with_compressed_tensors(dtype, seed):
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    generator = torch.Generator().manual_seed(seed)
    rows, columns = 48 + 16 * seed, 160
    weight = (torch.randn(rows, columns, generator=generator) * 10.0 ** (seed - 2)).to(dtype)
    weight[1, 16:32] = 0  # one all-zero block
    args, packed, scale, global_scale = _compressed_tensors_quantize(weight)
    ours = nvfp4.quantize(weight)
    assert torch.equal(ours.weight_global_scale, global_scale)
    assert torch.equal(ours.weight_scale.view(torch.uint8), scale.view(torch.uint8))
    assert torch.equal(ours.weight_packed, packed)
    theirs = dequantize(
        unpack_fp4_from_uint8(packed, rows, columns),
        scale.to(torch.bfloat16),
        args=args,
        global_scale=global_scale,
        dtype=torch.bfloat16,
    )
    assert torch.equal(nvfp4.dequantize(*ours, dtype=torch.bfloat16), theirs)
