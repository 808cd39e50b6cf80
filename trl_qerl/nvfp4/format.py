"""Pure-torch NVFP4 (weight-only) math: the reference every kernel is tested against.

Layout (compressed-tensors "nvfp4-pack-quantized", as llm-compressor writes it and vLLM reads it):

* a weight ``W[out, in]`` is cut into blocks of 16 along ``in``;
* each value is an E2M1 code (bit 3 = sign, bits 0-2 index ``E2M1_VALUES``), two codes per byte,
  the low nibble holding the even column: ``packed[r, k] = code[r, 2k] | code[r, 2k + 1] << 4``;
* each block has one FP8 E4M3 scale, each tensor one FP32 *global scale* that is stored as a divisor:
  ``W ≈ E2M1[q] * float(block_scale) / global_scale``.

Quantisation is round-to-nearest with ties to even (RTN), exactly as compressed-tensors does it:
``global_scale = 448 * 6 / amax(|W|)``, ``block_scale = fp8(global_scale * amax(block) / 6)``,
``q = E2M1(clamp(W / (block_scale / global_scale), -6, 6))``.
Statistics (amax, ``amax / 6``) are computed in float32 whatever the weight dtype, so a bf16 weight and
its float32 upcast quantise identically.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


GROUP_SIZE = 16
"""Number of consecutive input columns that share one FP8 block scale."""

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Magnitudes of the eight E2M1 codes 0..7; codes 8..15 are their negatives."""

# Round-half-to-even decision points between consecutive E2M1 magnitudes. A magnitude counts past a
# point when it is strictly greater (ties go down to the even code) or, for `>=` points, when it is equal
# (ties go up to the even code). This is compressed-tensors' `cast_to_fp4` table.
_STRICT_POINTS = (0.25, 1.25, 2.5, 5.0)
_INCLUSIVE_POINTS = (0.75, 1.75, 3.5)

# compressed-tensors replaces a zero block scale with the smallest step it trusts in FP8 (0.125), so that
# dequantisation never divides by zero; we do the same to stay bit-compatible.
_ZERO_BLOCK_SCALE = 0.125

# Rows quantised at once: bounds the float32 temporaries to a few tens of MB whatever the weight's size,
# so quantise-on-load never needs much more memory than the quantised model itself.
_QUANTIZE_CHUNK_ELEMENTS = 1 << 22


class NVFP4Weight(NamedTuple):
    """The three tensors of one NVFP4 weight, named and typed as in compressed-tensors checkpoints."""

    weight_packed: torch.Tensor
    """uint8 ``[out, in // 2]``: two E2M1 codes per byte, low nibble = even column."""
    weight_scale: torch.Tensor
    """float8_e4m3fn ``[out, in // 16]``: one scale per block of 16 columns."""
    weight_global_scale: torch.Tensor
    """float32 ``[1]``: the tensor's global scale, a divisor."""


def check_quantizable(weight: torch.Tensor, name: str = "weight") -> None:
    """Raise a `ValueError` naming ``name`` if ``weight`` cannot be quantised to NVFP4.

    A weight is quantisable when it is a 2-D floating-point tensor whose last dimension is a multiple of 16
    and whose values are all finite.
    """
    if weight.ndim != 2:
        raise ValueError(f"{name}: NVFP4 quantises 2-D weights, got shape {tuple(weight.shape)}.")
    if not weight.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point weight, got dtype {weight.dtype}.")
    if weight.shape[1] % GROUP_SIZE != 0:
        raise ValueError(
            f"{name}: in_features={weight.shape[1]} is not a multiple of {GROUP_SIZE}; keep this layer in 16-bit "
            "(add it to `modules_to_not_convert`)."
        )
    if not torch.isfinite(weight).all():
        bad = (~torch.isfinite(weight)).sum().item()
        raise ValueError(
            f"{name}: weight holds {bad} NaN/Inf value(s); NVFP4 cannot represent them. The checkpoint is "
            "corrupt or was saved from a diverged run."
        )


def global_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """Global scale ``448 * 6 / amax`` as float32 ``[1]``; an all-zero (or denormal-tiny) tensor gets 1.0."""
    amax = amax.float().clamp(min=torch.finfo(torch.float32).tiny)
    scale = (E4M3_MAX * E2M1_MAX) / amax
    return torch.nan_to_num(scale, nan=1.0, posinf=1.0, neginf=1.0).reshape(1)


def shared_global_scale(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """One global scale for a group of weights (q/k/v or gate/up) that inference engines fuse into one matrix.

    vLLM loads q/k/v (and gate/up) as one layer with a single global scale, so every member must be quantised
    with the same one: the smallest member scale, i.e. the scale of the largest magnitude in the group.
    """
    if not weights:
        raise ValueError("shared_global_scale needs at least one weight.")
    amax = torch.stack([w.detach().abs().amax().float().to(weights[0].device) for w in weights]).amax()
    return global_scale_from_amax(amax)


def block_scales(weight: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 scale of every block of 16 columns: ``fp8(global_scale * amax(block) / 6)``."""
    out_features, in_features = weight.shape
    block_amax = weight.float().reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE).abs().amax(dim=-1)
    scale = global_scale.float() * (block_amax / E2M1_MAX)
    scale = scale.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    zero = scale.float() == 0
    if zero.any():
        scale = torch.where(zero, torch.tensor(_ZERO_BLOCK_SCALE, device=scale.device), scale.float())
        scale = scale.to(torch.float8_e4m3fn)
    return scale


def round_to_e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) of values already divided by their scale, round-half-to-even.

    Values beyond ±6 saturate to ±6; the sign bit follows `torch.signbit`, so negative values that round to
    zero keep code 8 (negative zero), as compressed-tensors writes them.
    """
    magnitude = scaled.abs().clamp(max=E2M1_MAX)
    index = torch.zeros(scaled.shape, dtype=torch.uint8, device=scaled.device)
    for point in _STRICT_POINTS:
        index += (magnitude > point).to(torch.uint8)
    for point in _INCLUSIVE_POINTS:
        index += (magnitude >= point).to(torch.uint8)
    return index | (torch.signbit(scaled).to(torch.uint8) << 3)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes ``[..., 2k]`` into bytes ``[..., k]``, the even column in the low nibble."""
    if codes.shape[-1] % 2 != 0:
        raise ValueError(f"pack_codes needs an even number of columns, got {codes.shape[-1]}.")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_codes`: bytes ``[..., k]`` to codes ``[..., 2k]``."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed NVFP4 weights must be uint8, got {packed.dtype}.")
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(start_dim=-2)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """Float32 values of E2M1 codes."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    magnitude = table[(codes & 0x7).long()]
    return torch.where((codes & 0x8).bool(), -magnitude, magnitude)


def quantize(weight: torch.Tensor, global_scale: torch.Tensor | None = None, name: str = "weight") -> NVFP4Weight:
    """Quantise a ``[out, in]`` weight to NVFP4 by RTN.

    Args:
        weight: bf16/fp16/fp32 weight; ``in`` must be a multiple of 16 and every value finite.
        global_scale: float32 ``[1]`` global scale to use, e.g. one shared by q/k/v from
            `shared_global_scale`; computed from ``weight`` when omitted.
        name: name used in error messages (the layer's full name).

    Returns:
        `NVFP4Weight` on the weight's device. Work is done in row chunks, so temporary memory stays bounded.
    """
    check_quantizable(weight, name)
    weight = weight.detach()
    if global_scale is None:
        global_scale = global_scale_from_amax(weight.abs().amax())
    global_scale = global_scale.to(device=weight.device, dtype=torch.float32).reshape(1)
    out_features, in_features = weight.shape
    packed = torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=weight.device)
    scales = torch.empty(out_features, in_features // GROUP_SIZE, dtype=torch.float8_e4m3fn, device=weight.device)
    rows_per_chunk = max(1, _QUANTIZE_CHUNK_ELEMENTS // in_features)
    for start in range(0, out_features, rows_per_chunk):
        rows = slice(start, min(start + rows_per_chunk, out_features))
        chunk = weight[rows].float()
        chunk_scales = block_scales(chunk, global_scale)
        # Same operation order as compressed-tensors: (scale / global_scale) first, then divide.
        step = (chunk_scales.float() / global_scale).repeat_interleave(GROUP_SIZE, dim=1)
        codes = round_to_e2m1_codes(chunk / step)
        packed[rows] = pack_codes(codes)
        scales[rows] = chunk_scales
    return NVFP4Weight(packed, scales, global_scale.clone())


def dequantize(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Dense ``[out, in]`` weight of an NVFP4 weight: ``E2M1[q] * (block_scale / global_scale)``.

    Computed in float32 and rounded once to ``dtype``; bit-identical to compressed-tensors' decompression.
    """
    check_packed(weight_packed, weight_scale, weight_global_scale)
    values = e2m1_values(unpack_codes(weight_packed))
    step = (weight_scale.float() / weight_global_scale.float().reshape(1, 1)).repeat_interleave(GROUP_SIZE, dim=1)
    return (values * step).to(dtype)


def check_packed(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    name: str = "weight",
    shape: tuple[int, int] | None = None,
) -> None:
    """Raise a `ValueError` naming ``name`` if the three NVFP4 tensors do not fit together.

    Checks dtypes (uint8, float8_e4m3fn, float32), shapes (``[out, in/2]``, ``[out, in/16]``, one element) and,
    when ``shape = (out, in)`` is given, that they describe a weight of that shape.
    """
    problems = []
    if weight_packed.dtype != torch.uint8:
        problems.append(f"weight_packed has dtype {weight_packed.dtype}, expected torch.uint8")
    if weight_scale.dtype != torch.float8_e4m3fn:
        problems.append(f"weight_scale has dtype {weight_scale.dtype}, expected torch.float8_e4m3fn")
    if weight_global_scale.dtype != torch.float32:
        problems.append(f"weight_global_scale has dtype {weight_global_scale.dtype}, expected torch.float32")
    if weight_global_scale.numel() != 1:
        problems.append(f"weight_global_scale has {weight_global_scale.numel()} elements, expected 1")
    if weight_packed.ndim != 2 or weight_scale.ndim != 2:
        problems.append(
            f"weight_packed {tuple(weight_packed.shape)} and weight_scale {tuple(weight_scale.shape)} must be 2-D"
        )
    else:
        rows, half_columns = weight_packed.shape
        if tuple(weight_scale.shape) != (rows, 2 * half_columns // GROUP_SIZE) or (2 * half_columns) % GROUP_SIZE:
            problems.append(
                f"weight_scale has shape {tuple(weight_scale.shape)}, expected {(rows, 2 * half_columns // GROUP_SIZE)}"
                f" for weight_packed of shape {tuple(weight_packed.shape)}"
            )
        if shape is not None and (rows, 2 * half_columns) != tuple(shape):
            problems.append(
                f"weight_packed has shape {tuple(weight_packed.shape)}, expected {(shape[0], shape[1] // 2)} "
                f"for a [{shape[0]}, {shape[1]}] weight"
            )
    if problems:
        raise ValueError(f"{name}: invalid NVFP4 tensors: " + "; ".join(problems) + ".")


def relative_error(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """``‖approximation - reference‖ / ‖reference‖`` in float64."""
    reference = reference.double()
    return ((approximation.double() - reference).norm() / reference.norm().clamp_min(1e-300)).item()
