"""The Triton NVFP4 kernels that `kernels` launches: `_nvfp4_matmul_kernel` (``x @ dequant(W).T``, weights
dequantised in registers), `_nvfp4_gemv_kernel` (one row), `_splitk_reduce_kernel` (their split-K partial sums) and
`_dequantize_kernel` (the dense weight, bit-identical to `format.dequantize`). Kept apart from the launchers and the
per-shape choice in `kernels`; `tests/test_kernel_targets.py` cross-compiles them for every GPU target."""

from __future__ import annotations

import triton
import triton.language as tl


# Dequantisation works on int32 words of 8 codes (code j in bits 4j..4j+3, i.e. columns 8w..8w+7) and returns
# eight tensors, code j times the block scale. Products of an E2M1 value (2 significant bits) and an FP8 scale
# (4 significant bits) are exact in bf16/fp16, so both paths below give identical bits.
#
# bf16: the inline PTX moves each code's sign and magnitude into a bf16 bit pattern (two codes per 32-bit
# register, Marlin's trick), which is E2M1 * 2^-126, then multiplies by the scale with one `mul.bf16x2`. The
# caller passes the scale times 2^63 so the products stay normal bf16 numbers (E2M1 * scale * 2^-63) and
# multiplies the accumulator back by 2^63 in the epilogue. fp16: the same with the fp16 bit layout (E2M1 *
# 2^-14), one extra `mul.f16x2` by 2^14, and no boost.
_BF16_BOOST = tl.constexpr(2.0**63)
_TWO_POW_MINUS_126 = tl.constexpr(2.0**-126)


@triton.jit
def _scale_value(scale):
    """fp32 value of FP8 E4M3 block scales loaded as fp8e4nv or, on GPUs before sm_89 (where Triton has no
    fp8e4nv type), as raw bytes: E4M3's seven exponent/mantissa bits shifted into an fp16 (bias 15, not 7) are
    the value times 2^-8, subnormals included, so one bitcast and one exact product decode every byte."""
    if scale.dtype == tl.uint8:
        bits = scale.to(tl.int32)
        half = (((bits & 0x80) << 8) | ((bits & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)
        return tl.where((bits & 0x7F) == 0x7F, float("nan"), half.to(tl.float32) * 256.0)  # 0x7F/0xFF: NaN
    else:
        return scale.to(tl.float32)


@triton.jit
def _e2m1x8_pure(words, scale, OUT_DTYPE: tl.constexpr):
    """Reference Triton path of `_e2m1x8` (runs in the interpreter)."""
    if OUT_DTYPE == tl.bfloat16:
        factor = scale.to(tl.float32) * _TWO_POW_MINUS_126
    else:
        factor = scale.to(tl.float32)
    o0 = (_code_value(words, 0) * factor).to(OUT_DTYPE)
    o1 = (_code_value(words, 1) * factor).to(OUT_DTYPE)
    o2 = (_code_value(words, 2) * factor).to(OUT_DTYPE)
    o3 = (_code_value(words, 3) * factor).to(OUT_DTYPE)
    o4 = (_code_value(words, 4) * factor).to(OUT_DTYPE)
    o5 = (_code_value(words, 5) * factor).to(OUT_DTYPE)
    o6 = (_code_value(words, 6) * factor).to(OUT_DTYPE)
    o7 = (_code_value(words, 7) * factor).to(OUT_DTYPE)
    return o0, o1, o2, o3, o4, o5, o6, o7


@triton.jit
def _code_value(words, j: tl.constexpr):
    """fp32 E2M1 value of code j of each word: fp16 bit trick (sign -> bit 15, magnitude -> bits 9-11) x 2^14."""
    code = (words >> (4 * j)) & 0xF
    bits = ((code & 0x8) << 12) | ((code & 0x7) << 9)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def _e2m1x8_asm(words, scale, OUT_DTYPE: tl.constexpr):
    if OUT_DTYPE == tl.bfloat16:
        return tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 q, t, r0, r1, r2, r3, s2;
            mov.b32 s2, {$9, $9};
            and.b32 t, $8, 0x70007000;
            shr.b32 t, t, 6;
            lop3.b32 r3, $8, 0x80008000, t, 0xEA;
            shl.b32 q, $8, 4;
            and.b32 t, q, 0x70007000;
            shr.b32 t, t, 6;
            lop3.b32 r2, q, 0x80008000, t, 0xEA;
            shl.b32 q, $8, 8;
            and.b32 t, q, 0x70007000;
            shr.b32 t, t, 6;
            lop3.b32 r1, q, 0x80008000, t, 0xEA;
            shl.b32 q, $8, 12;
            and.b32 t, q, 0x70007000;
            shr.b32 t, t, 6;
            lop3.b32 r0, q, 0x80008000, t, 0xEA;
            mul.rn.bf16x2 r0, r0, s2;
            mul.rn.bf16x2 r1, r1, s2;
            mul.rn.bf16x2 r2, r2, s2;
            mul.rn.bf16x2 r3, r3, s2;
            mov.b32 {$0, $4}, r0;
            mov.b32 {$1, $5}, r1;
            mov.b32 {$2, $6}, r2;
            mov.b32 {$3, $7}, r3;
            }
            """,
            constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,h",
            args=[words, scale],
            dtype=(tl.bfloat16,) * 8,
            is_pure=True,
            pack=1,
        )
    else:
        return tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 q, t, r0, r1, r2, r3, s2, c;
            mov.b32 s2, {$9, $9};
            mov.b32 c, 0x74007400;
            and.b32 t, $8, 0x70007000;
            shr.b32 t, t, 3;
            lop3.b32 r3, $8, 0x80008000, t, 0xEA;
            shl.b32 q, $8, 4;
            and.b32 t, q, 0x70007000;
            shr.b32 t, t, 3;
            lop3.b32 r2, q, 0x80008000, t, 0xEA;
            shl.b32 q, $8, 8;
            and.b32 t, q, 0x70007000;
            shr.b32 t, t, 3;
            lop3.b32 r1, q, 0x80008000, t, 0xEA;
            shl.b32 q, $8, 12;
            and.b32 t, q, 0x70007000;
            shr.b32 t, t, 3;
            lop3.b32 r0, q, 0x80008000, t, 0xEA;
            mul.rn.f16x2 r0, r0, c;
            mul.rn.f16x2 r1, r1, c;
            mul.rn.f16x2 r2, r2, c;
            mul.rn.f16x2 r3, r3, c;
            mul.rn.f16x2 r0, r0, s2;
            mul.rn.f16x2 r1, r1, s2;
            mul.rn.f16x2 r2, r2, s2;
            mul.rn.f16x2 r3, r3, s2;
            mov.b32 {$0, $4}, r0;
            mov.b32 {$1, $5}, r1;
            mov.b32 {$2, $6}, r2;
            mov.b32 {$3, $7}, r3;
            }
            """,
            constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,h",
            args=[words, scale],
            dtype=(tl.float16,) * 8,
            is_pure=True,
            pack=1,
        )


@triton.jit
def _e2m1x8(words, scale, OUT_DTYPE: tl.constexpr, USE_ASM: tl.constexpr):
    if USE_ASM:
        return _e2m1x8_asm(words, scale, OUT_DTYPE)
    else:
        return _e2m1x8_pure(words, scale, OUT_DTYPE)


@triton.jit
def _interleave8(o0, o1, o2, o3, o4, o5, o6, o7, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Eight [ROWS, COLS // 8] tensors (code j of each word) -> [ROWS, COLS] in column order."""
    even = tl.join(tl.join(o0, o4), tl.join(o2, o6))
    odd = tl.join(tl.join(o1, o5), tl.join(o3, o7))
    return tl.join(even, odd).reshape(ROWS, COLS)


@triton.jit
def _load_step(word_ptrs, scale_ptrs, x_ptrs, k_left, m_mask, WORDS: tl.constexpr, BLOCK_K: tl.constexpr,
               EVEN_K: tl.constexpr):  # fmt: skip
    """One K step of packed words, FP8 scales and activations, masked where fewer than BLOCK_K columns are left."""
    if EVEN_K:
        words = tl.load(word_ptrs, eviction_policy="evict_first")
        scale = tl.load(scale_ptrs, eviction_policy="evict_first")
        x_t = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
    else:
        words = tl.load(word_ptrs, mask=(tl.arange(0, WORDS) < k_left // 8)[None, :], other=0,
                        eviction_policy="evict_first")  # fmt: skip
        scale = tl.load(scale_ptrs, mask=(tl.arange(0, WORDS // 2) < k_left // 16)[None, :], other=0.0,
                        eviction_policy="evict_first")  # fmt: skip
        x_t = tl.load(x_ptrs, mask=m_mask[None, :] & (tl.arange(0, BLOCK_K) < k_left)[:, None], other=0.0)
    return words, scale, x_t


@triton.jit
def _nvfp4_matmul_kernel(
    x_ptr, words_ptr, scale_ptr, global_scale_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_sn, stride_om, stride_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, USE_ASM: tl.constexpr,
):  # fmt: skip
    """Tile of ``out^T = W @ x^T``: weight rows on the MMA's wide side, activation rows on its narrow side."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    compute_dtype: tl.constexpr = x_ptr.dtype.element_ty
    boost: tl.constexpr = _BF16_BOOST if compute_dtype == tl.bfloat16 else 1.0
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    rows = tl.where(n_mask, offs_n, 0).to(tl.int64)  # clamped rows keep unmasked weight loads in bounds
    WORDS: tl.constexpr = BLOCK_K // 8
    offs_w = pid_k * WORDS + tl.arange(0, WORDS)
    offs_s = pid_k * (WORDS // 2) + tl.arange(0, WORDS // 2)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    word_ptrs = words_ptr + rows[:, None] * stride_wn + offs_w[None, :]
    scale_ptrs = scale_ptr + rows[:, None] * stride_sn + offs_s[None, :]
    x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None] * stride_xk

    # (Issuing the next step's loads before this step's dequantisation was measured slower on the H200: it doubles
    # the registers held per thread and halves occupancy; see notes/nvfp4-kernels.md.)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        words, scale, x_t = _load_step(word_ptrs, scale_ptrs, x_ptrs, K - k0, m_mask, WORDS, BLOCK_K, EVEN_K)
        scale = (_scale_value(scale) * boost).to(compute_dtype)
        scale = tl.join(scale, scale).reshape(BLOCK_N, WORDS)  # one scale per 2 words
        o0, o1, o2, o3, o4, o5, o6, o7 = _e2m1x8(words, scale, compute_dtype, USE_ASM)
        weight = _interleave8(o0, o1, o2, o3, o4, o5, o6, o7, BLOCK_N, BLOCK_K)
        acc += tl.dot(weight, x_t)
        word_ptrs += SPLIT_K * WORDS
        scale_ptrs += SPLIT_K * (WORDS // 2)
        x_ptrs += SPLIT_K * BLOCK_K * stride_xk

    acc = acc * (boost / tl.load(global_scale_ptr))
    out = out_ptr + pid_k * stride_split + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


@triton.jit
def _nvfp4_gemv_kernel(
    x_ptr, words_ptr, scale_ptr, global_scale_ptr, out_ptr,
    N, K, stride_xk, stride_wn, stride_sn, stride_split,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, USE_ASM: tl.constexpr,
):  # fmt: skip
    """One activation row (decode, batch 1): fp32 FMAs instead of an MMA, so the dequantised weights never
    leave registers. Requires K % (BLOCK_K * SPLIT_K) == 0."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(2)
    compute_dtype: tl.constexpr = x_ptr.dtype.element_ty
    boost: tl.constexpr = _BF16_BOOST if compute_dtype == tl.bfloat16 else 1.0
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = tl.where(n_mask, offs_n, 0).to(tl.int64)
    WORDS: tl.constexpr = BLOCK_K // 8
    STEP: tl.constexpr = BLOCK_K * SPLIT_K
    offs_w = pid_k * WORDS + tl.arange(0, WORDS)
    word_ptrs = words_ptr + rows[:, None] * stride_wn + offs_w[None, :]
    scale_ptrs = scale_ptr + rows[:, None] * stride_sn + (offs_w // 2)[None, :]
    x_ptrs = x_ptr + offs_w * 8 * stride_xk

    words = tl.load(word_ptrs, eviction_policy="evict_first")
    scale = tl.load(scale_ptrs, eviction_policy="evict_first")
    acc = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, STEP):
        live = tl.full((1, 1), 1, tl.int1) & (k0 + STEP < K)
        next_words = tl.load(word_ptrs + SPLIT_K * WORDS, mask=live, other=0, eviction_policy="evict_first")
        next_scale = tl.load(scale_ptrs + SPLIT_K * (WORDS // 2), mask=live, other=0.0, eviction_policy="evict_first")
        o0, o1, o2, o3, o4, o5, o6, o7 = _e2m1x8(words, (_scale_value(scale) * boost).to(compute_dtype),
                                                 compute_dtype, USE_ASM)  # fmt: skip
        acc += o0.to(tl.float32) * tl.load(x_ptrs + 0 * stride_xk).to(tl.float32)[None, :]
        acc += o1.to(tl.float32) * tl.load(x_ptrs + 1 * stride_xk).to(tl.float32)[None, :]
        acc += o2.to(tl.float32) * tl.load(x_ptrs + 2 * stride_xk).to(tl.float32)[None, :]
        acc += o3.to(tl.float32) * tl.load(x_ptrs + 3 * stride_xk).to(tl.float32)[None, :]
        acc += o4.to(tl.float32) * tl.load(x_ptrs + 4 * stride_xk).to(tl.float32)[None, :]
        acc += o5.to(tl.float32) * tl.load(x_ptrs + 5 * stride_xk).to(tl.float32)[None, :]
        acc += o6.to(tl.float32) * tl.load(x_ptrs + 6 * stride_xk).to(tl.float32)[None, :]
        acc += o7.to(tl.float32) * tl.load(x_ptrs + 7 * stride_xk).to(tl.float32)[None, :]
        word_ptrs += SPLIT_K * WORDS
        scale_ptrs += SPLIT_K * (WORDS // 2)
        x_ptrs += STEP * stride_xk
        words, scale = next_words, next_scale
    out = tl.sum(acc, axis=1) * (boost / tl.load(global_scale_ptr))
    tl.store(out_ptr + pid_k * stride_split + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _splitk_reduce_kernel(partial_ptr, out_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(partial_ptr + offs, mask=mask, other=0.0)
    for split in tl.static_range(1, SPLIT_K):
        acc += tl.load(partial_ptr + split * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize_kernel(
    words_ptr, scale_ptr, global_scale_ptr, out_ptr, N, K,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr,
):  # fmt: skip
    """Dense weight, bit-identical to `format.dequantize`: E2M1 * fl(scale / global_scale), rounded once."""
    WORDS: tl.constexpr = BLOCK_K // 8
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.program_id(1) * WORDS + tl.arange(0, WORDS)
    offs_s = tl.program_id(1) * (WORDS // 2) + tl.arange(0, WORDS // 2)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rows = offs_n[:, None].to(tl.int64)
    n_mask = offs_n[:, None] < N
    words = tl.load(words_ptr + rows * (K // 8) + offs_w[None, :], mask=n_mask & (offs_w[None, :] < K // 8), other=0)
    scale = _scale_value(tl.load(scale_ptr + rows * (K // 16) + offs_s[None, :],
                                 mask=n_mask & (offs_s[None, :] < K // 16), other=0.0))  # fmt: skip
    step = tl.math.div_rn(scale, tl.load(global_scale_ptr))  # IEEE division, as torch does
    # exact E2M1 * 2^-63 in bf16 (scale argument 1 * boost), then one fp32 product with the step
    unit = tl.full((BLOCK_N, WORDS), _BF16_BOOST, tl.float32).to(tl.bfloat16)
    o0, o1, o2, o3, o4, o5, o6, o7 = _e2m1x8(words, unit, tl.bfloat16, USE_ASM)
    values = _interleave8(o0, o1, o2, o3, o4, o5, o6, o7, BLOCK_N, BLOCK_K).to(tl.float32)
    step = tl.broadcast_to(step[:, :, None], (BLOCK_N, WORDS // 2, 16)).reshape(BLOCK_N, BLOCK_K)
    dense = values * (step * _BF16_BOOST)
    tl.store(out_ptr + rows * K + offs_k[None, :], dense.to(out_ptr.dtype.element_ty),
             mask=n_mask & (offs_k[None, :] < K))  # fmt: skip
