// NVFP4 W4A16 decode matmul: out[M, N] = x[M, K] @ dequant(W[N, K]).T for few rows (M <= 64 per CTA column),
// weights read once in the standard compressed-tensors layout, dequantised in registers, multiplied on the tensor
// cores with mma.sync (sm_80+), one launch per projection (or per group of projections: q/k/v, gate/up).
//
// Compiled at run time by NVRTC (trl_qerl/nvfp4/nvrtc.py) without any header, so it needs no CUDA toolkit.
//
// Work split. The MMA is m16n8k16 with the operands swapped ("swap-AB"): weights are the 16-row A operand, the
// activation rows (tokens) the 8-column B operand. A warp owns 16*MT weight rows and walks a slice of K in blocks
// of 128 columns; the KW warps of a CTA split K between them and add their partial sums in shared memory at the end
// (no second launch, deterministic order). CTAs along grid.x take successive groups of 8*NT tokens of the same rows
// (adjacent in launch order, so the second reads the weights from L2); grid.y walks the row tiles.
//
// Register-only weight path. The MMA sums over its 16 k slots, so which physical column sits in which slot is free
// as long as A and B agree. Lane (g, t) (g = lane / 4, t = lane % 4) takes physical columns 32t..32t+31 of each
// 128-column block: for its two rows g and g+8 those are 16 contiguous bytes of packed codes (one 16-byte load per
// row, a warp reads 16 rows x 64 contiguous bytes), two FP8 block scales (the 32 columns are two whole groups of
// 16), and for its token g the 32 contiguous activations (four 16-byte loads). No shared memory, no shuffles.
//
// Dequantisation (Marlin's trick): one 32-bit word holds codes c0..c7 of 8 consecutive columns (low nibble first).
// Masking each code's sign to bit 15 and its 3 magnitude bits to bits 6..8 of a 16-bit half gives the bf16 bit
// pattern of E2M1 * 2^-126 (fp16: bits 9..11, E2M1 * 2^-14); one shift serves the two halves, so a word yields the
// pairs (c0,c4), (c1,c5), (c2,c6), (c3,c7). The activations are permuted the same way (PRMT), then each pair is
// multiplied by its block scale (bf16: scale * 2^63, so that products are normal bf16 numbers; exact, since E2M1
// has 2 significant bits and E4M3 4). The epilogue multiplies the fp32 sums by 2^63 (fp16: 2^14) / global_scale,
// adds the bias and rounds once.
//
// Programmatic Dependent Launch (built with -DNVFP4_PDL=1, launched with the PDL attribute, sm_90+): a CTA loads its
// first blocks of weights, which no kernel of the step writes, before `griddepcontrol.wait` (the previous kernel's
// outputs, our activations, are visible only after it), and lets the next kernel start its own prologue once the
// main loop is done. Every global write and every activation load happens after the wait; the activations come
// through coherent loads (see `load_cached`). The default build has neither instruction.

#ifndef NVFP4_LORA_SINGLE_TOKEN
#define NVFP4_LORA_SINGLE_TOKEN 1  // a one-token CTA computes one token's LoRA terms, not TOKENS copies of them
#endif

#ifndef NVFP4_DEPTH
#define NVFP4_DEPTH 1  // 128-column blocks loaded ahead of the one being multiplied (2 and 3 measured no faster;
                       // 2 in the PDL build neither)
#endif

#ifndef NVFP4_TWIDDLED
#define NVFP4_TWIDDLED 0  // 1: each code word in the bit order of `trl_qerl.nvfp4.twiddle` (decode and tiled kernels);
                          // 2: the lane order (`twiddle.to_lane_order`: every kernel here and the wgmma kernel)
#endif

#ifndef NVFP4_PDL_L2_BLOCKS
#define NVFP4_PDL_L2_BLOCKS 0  // PDL builds: blocks of weights past the loaded ones asked into L2 before the wait
                               // (2 and 6 measured slower at 7B, 2026-12-07)
#endif

#ifndef NVFP4_ASYNC_STAGES
#define NVFP4_ASYNC_STAGES 0  // >= 2: codes and scales come through a per-warp cp.async ring of this many blocks
#endif
#define ASYNC_RING (NVFP4_ASYNC_STAGES >= 2)

#ifndef NVFP4_MIN_WARPS
#define NVFP4_MIN_WARPS 0  // > 0: registers capped so that this many warps of the decode kernel fit a multiprocessor
#endif
#if NVFP4_MIN_WARPS > 0
#define DECODE_BOUNDS(KW) __launch_bounds__(32 * (KW), NVFP4_MIN_WARPS / (KW) > 1 ? NVFP4_MIN_WARPS / (KW) : 1)
#else
#define DECODE_BOUNDS(KW) __launch_bounds__(32 * (KW))  // (a second argument, even 1, changes ptxas' register choice)
#endif

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

#define MAX_SEGMENTS 3

// Up to three weight matrices that read the same activations (q/k/v, gate/up) in one launch; their outputs sit
// side by side in `out` (columns col_start[s] ..). Row tiles of segment s are blockIdx.y in
// [tile_start[s], tile_start[s + 1]).
struct Segments {
  const uint4* packed[MAX_SEGMENTS];   // uint8 [rows, K/2] viewed as 16-byte vectors
  const u16* scales[MAX_SEGMENTS];     // float8_e4m3fn [rows, K/16] viewed as byte pairs
  const float* global_scale[MAX_SEGMENTS];
  const u16* bias[MAX_SEGMENTS];       // [rows] in the activation dtype, or null
  int rows[MAX_SEGMENTS];
  int col_start[MAX_SEGMENTS];
  int tile_start[MAX_SEGMENTS + 1];
  int count;
};

// LoRA on top of the decode kernel's products (built with LORA_RANK > 0): segment s's output becomes
//   round(round(x @ W.T * factor + bias) + scaling[s] * t[:, t_col[s] : t_col[s] + LORA_RANK] @ B[s].T),
// where t = x @ A.T of every adapter (fp32, computed before the launch: a reduction the step fuses into the kernel
// that makes x) and B[s] the fp32 [rows, LORA_RANK] matrix as stored. The base is rounded first, as `base(x) +
// lora(x)` of the layer's code rounds it, so the numbers are those of the unfused step up to the order of fp32 sums.
// What this saves is the kernel that would read the base output back, expand t and add it (one per projection).
// The rank is a template parameter: with a run-time rank the compiler allocated the main loop's registers
// differently (+9 % instructions there; tests/test_lora_epilogue.py checks the sm_90 SASS).
struct LoraTerms {
  const float* t;                   // [M, ld_t], 16-byte aligned rows
  const float* b[MAX_SEGMENTS];     // [rows, LORA_RANK] row-major, 16-byte aligned, or null: no adapter on segment s
  float scaling[MAX_SEGMENTS];
  int t_col[MAX_SEGMENTS];          // multiples of 4
  int ld_t;                         // multiple of 4
};

// K split across the CTAs of one tile (built with SPLIT_K, grid.z CTAs per tile): for products whose row tiles are
// fewer than the GPU holds at once (7B down and o at one row: 224 tiles of 16 rows, 0.85 waves). Each CTA adds its
// warps' sums as usual and leaves them in `partial` [tile][z][TOKENS][ROWS]; the last CTA of the tile to arrive
// (`counters[tile]`, zero between launches: that CTA resets it) adds the grid.z partials in z order and runs the
// epilogue (bias, LoRA terms, rounding). One launch, the same sums on every launch.
struct SplitK {
  float* partial;
  unsigned* counters;
};

// The launchers pass these structures from Python (ctypes mirrors in cuda_mma.py, whose test checks the same sizes;
// NVRTC 13.0 has no offsetof).
static_assert(sizeof(Segments) == 144, "struct Segments no longer matches cuda_mma._Segments");
static_assert(sizeof(LoraTerms) == 64, "struct LoraTerms no longer matches cuda_mma._LoraTerms");
static_assert(sizeof(SplitK) == 16, "struct SplitK no longer matches cuda_mma._SplitK");

// a[s] with constant indices: a run-time index into a kernel parameter's array makes the compiler copy the whole
// parameter to the stack (local memory).
template <typename T>
__device__ __forceinline__ T pick(const T (&a)[MAX_SEGMENTS], int s) {
  return s == 0 ? a[0] : (s == 1 ? a[1] : a[2]);
}

// How the threads of `lora_terms` share the rows of B: LANES lanes per row, PASSES rows per thread.
template <int RANK, int ROWS, int THREADS>
struct LoraLanes {
  static constexpr int LANES = RANK / 4 < 32 ? RANK / 4 : 32;
  static constexpr int CHUNKS = RANK / 4 / LANES;  // 16-byte chunks per lane (rank 128: one)
  static constexpr int ROWS_PER_PASS = THREADS / LANES;
  static constexpr int PASSES = (ROWS + ROWS_PER_PASS - 1) / ROWS_PER_PASS;
};

// The LoRA terms of GROUP tokens (from `first`) into terms[token][row]: lane c of a row's LANES lanes multiplies
// its chunk(s) of B (b4, loaded by `lora_terms`) with chunk c of each token's t row; the LANES lanes add their sums
// by shuffles (every lane takes part in every shuffle). The tokens' loads are unrolled so that they issue together.
template <int RANK, int ROWS, int TOKENS, int THREADS, int GROUP, typename L = LoraLanes<RANK, ROWS, THREADS>>
__device__ __forceinline__ void lora_token_group(float (&terms)[TOKENS][ROWS],
                                                 const float4 (&b4)[L::PASSES][L::CHUNKS], const float* t, int ld_t,
                                                 float scaling, int first, int tok0, int M) {
  constexpr int LANES = L::LANES, CHUNKS = L::CHUNKS, ROWS_PER_PASS = L::ROWS_PER_PASS, PASSES = L::PASSES;
  const int c = threadIdx.x % LANES;
  float4 t4[GROUP][CHUNKS];
  #pragma unroll
  for (int i = 0; i < GROUP; ++i) {
    const int token = min(tok0 + first + i, M - 1);  // tokens past M repeat a real row, never stored
    #pragma unroll
    for (int j = 0; j < CHUNKS; ++j) t4[i][j] = reinterpret_cast<const float4*>(t + (u64)token * ld_t)[c + j * LANES];
  }
  #pragma unroll
  for (int pass = 0; pass < PASSES; ++pass) {
    const int r = pass * ROWS_PER_PASS + (int)threadIdx.x / LANES;
    #pragma unroll
    for (int i = 0; i < GROUP; ++i) {
      float sum = 0.0f;
      #pragma unroll
      for (int j = 0; j < CHUNKS; ++j) {
        const float4 a = t4[i][j], w = b4[pass][j];
        sum = fmaf(a.x, w.x, fmaf(a.y, w.y, fmaf(a.z, w.z, fmaf(a.w, w.w, sum))));
      }
      #pragma unroll
      for (int offset = LANES / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
      if (c == 0 && r < ROWS) terms[first + i][r] = scaling * sum;
    }
  }
}

// The LoRA terms of a CTA's TOKENS x ROWS outputs into terms[token][row] (shared memory), by all THREADS threads.
// LANES = RANK / 4 lanes (at most 32) share a row: lane c holds the row's 16-byte chunk c of B (one coalesced
// load: a warp reads 32 / LANES whole rows) and `lora_token_group` multiplies it with the tokens' t rows. B is read
// once per CTA; rows past the segment give zeros. Passes and groups of 8 tokens are unrolled so that their loads
// issue together: this runs after the main loop, where its latency is exposed (a loop over tokens, one load at a
// time, measured 13 us more per 7B gate_up call at 8 rows on the H200; an L2 prefetch of B before the main loop made
// no difference, and skipping the tokens past M cost 2-7 us at 8-16 rows for 0.5-1 us saved at one row). A CTA with
// a single token (decode at batch 1: uniform over the CTA, so no divergence) computes that token's terms only.
template <int RANK, int ROWS, int TOKENS, int THREADS>
__device__ __forceinline__ void lora_terms(float (&terms)[TOKENS][ROWS], const LoraTerms& lora, int s, int rows,
                                           int row0, int tok0, int M) {
  using L = LoraLanes<RANK, ROWS, THREADS>;
  constexpr int LANES = L::LANES, CHUNKS = L::CHUNKS, ROWS_PER_PASS = L::ROWS_PER_PASS, PASSES = L::PASSES;
  constexpr int GROUP = TOKENS < 8 ? TOKENS : 8;
  const float* b = pick(lora.b, s);
  const float* t = lora.t + pick(lora.t_col, s);
  const float scaling = pick(lora.scaling, s);
  const int c = threadIdx.x % LANES;
  float4 b4[PASSES][CHUNKS];
  #pragma unroll
  for (int pass = 0; pass < PASSES; ++pass) {
    const int r = pass * ROWS_PER_PASS + (int)threadIdx.x / LANES;
    #pragma unroll
    for (int j = 0; j < CHUNKS; ++j) {
      b4[pass][j] = r < ROWS && row0 + r < rows
                        ? reinterpret_cast<const float4*>(b + (u64)(row0 + r) * RANK)[c + j * LANES]
                        : float4{0.0f, 0.0f, 0.0f, 0.0f};
    }
  }
  if (NVFP4_LORA_SINGLE_TOKEN && M - tok0 == 1) {
    lora_token_group<RANK, ROWS, TOKENS, THREADS, 1>(terms, b4, t, lora.ld_t, scaling, 0, tok0, M);
    return;
  }
  #pragma unroll 1
  for (int first = 0; first < TOKENS; first += GROUP) {
    lora_token_group<RANK, ROWS, TOKENS, THREADS, GROUP>(terms, b4, t, lora.ld_t, scaling, first, tok0, M);
  }
}

__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  // Weights are read once: keep them out of L1 so the activations (re-read by every warp) stay there.
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

#ifndef NVFP4_PDL
#define NVFP4_PDL 0
#endif
#ifndef NVFP4_NC_ACTIVATIONS
#define NVFP4_NC_ACTIVATIONS (!NVFP4_PDL)
#endif
#ifndef NVFP4_ACTIVATIONS_EVICT_LAST
#define NVFP4_ACTIVATIONS_EVICT_LAST 0
#endif

// Activations: re-read by every warp, so through L1. The non-coherent path (`.nc`) promises that nothing writes the
// data while the kernel runs, which is not so under PDL: the kernel before ours may still be writing our activations
// until `griddepcontrol.wait` returns, and ptxas, trusting `.nc`, may move the loads above the wait. It did (sm_90
// SASS, 2026-12-07): NVRTC 13.5 in the build with two blocks loaded ahead, NVRTC 13.0 in the 16-token build with LoRA
// terms. So PDL builds load coherently, which measured ~0.1 ms a step slower at batch 8 and the same at batch 1 (7B,
// H100, 2026-12-07; BENCHMARKS.md); tests/test_cuda_mma.py checks the SASS. NVFP4_ACTIVATIONS_EVICT_LAST (off; the
// `+pdl_evict_last` bench engine) marks those coherent loads to stay in L1 longest, the main loop otherwise the same:
// measured no faster at batch 1 and 8 (7B, H100, 2026-12-07).
__device__ __forceinline__ uint4 load_cached(const uint4* p) {
  uint4 v;
#if NVFP4_NC_ACTIVATIONS
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#elif NVFP4_ACTIVATIONS_EVICT_LAST
  asm volatile("ld.global.L1::evict_last.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#else
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#endif
  return v;
}

// cp.async (sm_80+): the tiled kernel's stages and the decode kernel's optional ring (NVFP4_ASYNC_STAGES).
__device__ __forceinline__ u32 shared_address(const void* p) {
  u32 address;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(address) : "l"(p));
  return address;
}

__device__ __forceinline__ void copy_async_16(u32 dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void copy_async_8(u32 dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int PENDING>
__device__ __forceinline__ void copy_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 selector) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
}

__device__ __forceinline__ u32 rotate_right(u32 q, int r) {
  u32 d;
  asm("shf.r.wrap.b32 %0, %1, %1, %2;" : "=r"(d) : "r"(q), "r"(r));
  return d;
}

// Pair i (0..3, known at compile time) of a word in the twiddled bit order (`trl_qerl.nvfp4.twiddle`): the codes
// (c_{2i}, c_{2i+1}) as a bf16 (E2M1 * 2^-126) or fp16 (E2M1 * 2^-14) pair, one rotation and one mask each in bf16
// (two for the last pair).
template <bool BF16>
__device__ __forceinline__ u32 twiddled_pair(u32 q, int i) {
  if (BF16) {
    const u32 m = 0x81C081C0u;
    if (i == 0) return q & m;
    if (i == 1) return rotate_right(q, 4) & m;
    if (i == 2) return rotate_right(q, 10) & m;
    return (rotate_right(q, 14) & 0x80C080C0u) | (rotate_right(q, 22) & 0x01000100u);
  }
  const u32 s = 0x80008000u, g = 0x0E000E00u;  // the same bit order; fp16's magnitude sits 3 bits higher
  if (i == 0) return (q & s) | (rotate_right(q, 29) & g);
  if (i == 1) return (rotate_right(q, 4) & s) | (rotate_right(q, 1) & g);
  if (i == 2) return (rotate_right(q, 10) & s) | (rotate_right(q, 7) & g);
  return (rotate_right(q, 14) & s) | (rotate_right(q, 11) & 0x06000600u) | (rotate_right(q, 19) & 0x08000800u);
}

// E2M1 codes of one word -> four 16-bit pairs (c_i, c_{i+4}), i = 0..3, as bf16 (E2M1 * 2^-126) or fp16
// (E2M1 * 2^-14) bit patterns. With NVFP4_TWIDDLED: the word's bits are permuted (`trl_qerl.nvfp4.twiddle`) so that
// a rotation and a mask give each bf16 pair, (c_{2i}, c_{2i+1}): 9 instructions per word instead of ~15, and the
// activations need no permutation.
template <bool BF16>
__device__ __forceinline__ void decode_word(u32 q, u32 (&p)[4]) {
#if NVFP4_TWIDDLED
  #pragma unroll
  for (int i = 0; i < 4; ++i) p[i] = twiddled_pair<BF16>(q, i);
#else
  const u32 sign = 0x80008000u;
  if (BF16) {
    const u32 magnitude = 0x01C001C0u;
    p[3] = (q & sign) | ((q >> 6) & magnitude);
    p[2] = ((q << 4) & sign) | ((q >> 2) & magnitude);
    p[1] = ((q << 8) & sign) | ((q << 2) & magnitude);
    p[0] = ((q << 12) & sign) | ((q << 6) & magnitude);
  } else {
    const u32 magnitude = 0x0E000E00u;
    p[3] = (q & sign) | ((q >> 3) & magnitude);
    p[2] = ((q << 4) & sign) | ((q << 1) & magnitude);
    p[1] = ((q << 8) & sign) | ((q << 5) & magnitude);
    p[0] = ((q << 12) & sign) | ((q << 9) & magnitude);
  }
#endif
}

// Two FP8 E4M3 block scales (low byte first) -> their fp32 values.
__device__ __forceinline__ void e4m3x2_to_float(u32 pair, float& lo, float& hi) {
#if __CUDA_ARCH__ >= 890
  u32 halves;
  asm("{ .reg .b16 s; cvt.u16.u32 s, %1; cvt.rn.f16x2.e4m3x2 %0, s; }" : "=r"(halves) : "r"(pair));
  asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }"
      : "=f"(lo), "=f"(hi) : "r"(halves));
#else
  // E4M3's 7 exponent/mantissa bits placed in an fp16 (bias 15 instead of 7) are the value times 2^-8, subnormals
  // included. (The NaN codes 0x7F/0xFF decode as 480; quantisation never writes them.)
  u32 spread = (pair & 0xFFu) | ((pair & 0xFF00u) << 8);
  u32 halves = ((spread & 0x00800080u) << 8) | ((spread & 0x007F007Fu) << 7);
  asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }"
      : "=f"(lo), "=f"(hi) : "r"(halves));
  lo *= 256.0f;
  hi *= 256.0f;
#endif
}

// A scale as the pair (s, s) that multiplies decoded pairs: bf16 s * 2^63, fp16 s (both exact).
template <bool BF16>
__device__ __forceinline__ u32 scale_pair(float s) {
  u32 d;
  if (BF16) {
    s *= 9223372036854775808.0f;  // 2^63
    asm("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(d) : "f"(s));
  } else {
    asm("{ .reg .b16 h; cvt.rn.f16.f32 h, %1; mov.b32 %0, {h, h}; }" : "=r"(d) : "f"(s));
  }
  return d;
}

template <bool BF16>
__device__ __forceinline__ u32 mul2(u32 a, u32 b) {
  // fma with -0 is an exact product that keeps the sign of zero (mul.bf16x2 exists only from sm_90)
  u32 d;
  if (BF16) {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  } else {
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  }
  return d;
}

template <bool BF16>
__device__ __forceinline__ void mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  if (BF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

template <bool BF16>
__device__ __forceinline__ u16 round_to_output(float v) {
  u16 h;
  if (BF16) {
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
  } else {
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
  }
  return h;
}

template <bool BF16>
__device__ __forceinline__ float input_to_float(u16 h) {
  float v;
  if (BF16) {
    v = __int_as_float(((u32)h) << 16);
  } else {
    asm("{ .reg .b16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(v) : "h"(h));
  }
  return v;
}

// What one warp loads for one 128-column block: codes and scales of its rows, activations of its tokens.
template <int MT, int NT, bool PREFETCH_X>
struct Stage {
  uint4 w[MT][2];                        // [m tile][row g, row g + 8]: 32 codes each
  u32 s[MT][2];                          // the two block scales of those 32 columns
  uint4 x[PREFETCH_X ? NT : 1][4];       // token g of each n tile: 32 activations
};

// Pointers of one lane, at its first 128-column block.
template <int MT, int NT>
struct LanePointers {
  const uint4* w[MT][2];
  const u16* s[MT][2];
  const uint4* x[NT];
};

#define PDL (NVFP4_PDL && __CUDA_ARCH__ >= 900)

__device__ __forceinline__ void wait_for_previous_kernel() {
#if PDL
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_next_kernel() {
#if PDL
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Under PDL the kernel before ours may still run: its bandwidth is ours to take if the weights' bytes start moving
// before the wait. A prefetch into L2 needs no registers, unlike the blocks loaded ahead (NVFP4_DEPTH), so it can ask
// for more of this warp's blocks: [first, end).
template <int MT, int NT>
__device__ __forceinline__ void prefetch_weights_to_l2(const LanePointers<MT, NT>& p, int first, int end) {
  for (int kb = first; kb < end; ++kb) {
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      #pragma unroll
      for (int h = 0; h < 2; ++h) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p.w[mt][h] + kb * 4));
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p.s[mt][h] + kb * 4));
      }
    }
  }
}

// `live` is false only for a lane whose 32 columns of the last (partial) block lie past K: it reads zeros there.
// WEIGHTS / ACTIVATIONS select what is loaded (the prologue loads the weights before waiting for the activations).
template <int MT, int NT, bool PREFETCH_X, bool TAIL, bool WEIGHTS = true, bool ACTIVATIONS = true>
__device__ __forceinline__ void load_stage(Stage<MT, NT, PREFETCH_X>& st, const LanePointers<MT, NT>& p, int kb,
                                           bool live) {
  #pragma unroll
  for (int mt = 0; mt < (WEIGHTS ? MT : 0); ++mt) {
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (!TAIL || live) {
        st.w[mt][h] = load_stream(p.w[mt][h] + kb * 4);
        st.s[mt][h] = p.s[mt][h][kb * 4];
      } else {
        st.w[mt][h] = make_uint4(0u, 0u, 0u, 0u);  // codes 0 are the value 0
        st.s[mt][h] = 0u;
      }
    }
  }
  if (PREFETCH_X && ACTIVATIONS) {
    #pragma unroll
    for (int nt = 0; nt < (PREFETCH_X ? NT : 1); ++nt) {
      #pragma unroll
      for (int w = 0; w < 4; ++w) {
        // (lanes of tokens past M load a clamped row: their columns are never stored, and skipping the loads
        // measured slower)
        st.x[nt][w] = (!TAIL || live) ? load_cached(p.x[nt] + kb * 16 + w) : make_uint4(0u, 0u, 0u, 0u);
      }
    }
  }
}

__device__ __forceinline__ u32 component(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// The MMAs of one 128-column block, shared by both kernels. Lane (g, t) holds, for rows g and g + 8 of each m tile,
// its 16 bytes of codes `w` (columns 32t..32t+31) and their two FP8 block scales `scales` (low byte first);
// `activations(nt, word)` returns token g of n tile nt's 8 activations of columns 32t + 8 word ... (16 bytes).
// In the lane order (NVFP4_TWIDDLED 2, the wgmma kernel's: the 16 bytes transposed as 4 x 4, each word twiddled)
// column pair 4 word + c of the lane is pair `word` of code word c, so step `word` decodes that pair of each code word
// (the same instructions in all, spread over the steps) and meets the activations as loaded.
template <int MT, int NT, bool BF16, typename Activations>
__device__ __forceinline__ void multiply_block(const uint4 (&w)[MT][2], const u32 (&scales)[MT][2],
                                               float (&acc)[MT][NT][4], Activations activations) {
  u32 scale[MT][2][2];  // [m tile][row half][group]
  #pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      float lo, hi;
      e4m3x2_to_float(scales[mt][h], lo, hi);
      scale[mt][h][0] = scale_pair<BF16>(lo);
      scale[mt][h][1] = scale_pair<BF16>(hi);
    }
  }
  #pragma unroll
  for (int word = 0; word < 4; ++word) {
    u32 a[MT][2][4];  // [m tile][row half][pair]
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      #pragma unroll
      for (int h = 0; h < 2; ++h) {
#if NVFP4_TWIDDLED == 2
        #pragma unroll
        for (int c = 0; c < 4; ++c) a[mt][h][c] = twiddled_pair<BF16>(component(w[mt][h], c), word);
#else
        const uint4 v = w[mt][h];
        const u32 q = word == 0 ? v.x : word == 1 ? v.y : word == 2 ? v.z : v.w;
        decode_word<BF16>(q, a[mt][h]);
#endif
        #pragma unroll
        for (int i = 0; i < 4; ++i) a[mt][h][i] = mul2<BF16>(a[mt][h][i], scale[mt][h][word >> 1]);
      }
    }
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const uint4 xv = activations(nt, word);
      // activations in the order of the decoded pairs: (x0,x4), (x1,x5), (x2,x6), (x3,x7); twiddled: as loaded
      const u32 b0 = NVFP4_TWIDDLED ? xv.x : prmt(xv.x, xv.z, 0x5410u);
      const u32 b1 = NVFP4_TWIDDLED ? xv.y : prmt(xv.x, xv.z, 0x7632u);
      const u32 b2 = NVFP4_TWIDDLED ? xv.z : prmt(xv.y, xv.w, 0x5410u);
      const u32 b3 = NVFP4_TWIDDLED ? xv.w : prmt(xv.y, xv.w, 0x7632u);
      #pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma<BF16>(acc[mt][nt], a[mt][0][0], a[mt][1][0], a[mt][0][1], a[mt][1][1], b0, b1);
        mma<BF16>(acc[mt][nt], a[mt][0][2], a[mt][1][2], a[mt][0][3], a[mt][1][3], b2, b3);
      }
    }
  }
}

template <int MT, int NT, bool BF16, bool PREFETCH_X, bool TAIL>
__device__ __forceinline__ void compute_stage(const Stage<MT, NT, PREFETCH_X>& st, float (&acc)[MT][NT][4],
                                              const LanePointers<MT, NT>& p, int kb, bool live) {
  multiply_block<MT, NT, BF16>(st.w, st.s, acc, [&](int nt, int word) {
    if (PREFETCH_X) return st.x[PREFETCH_X ? nt : 0][word];
    return (!TAIL || live) ? load_cached(p.x[nt] + kb * 16 + word) : make_uint4(0u, 0u, 0u, 0u);
  });
}

// The cp.async ring (built with NVFP4_ASYNC_STAGES = S >= 2). The register path keeps one block of codes in flight
// per warp (NVFP4_DEPTH, limited by registers), and Nsight Compute found the 14B products at 8 rows waiting on those
// loads half of the time with ~10 warps per multiprocessor. Here each lane copies its own 16 bytes of codes
// per row (and a row's first lane its 8 bytes of scales) S - 1 blocks ahead into the warp's slice of dynamic shared
// memory, so S - 1 blocks are in flight without registers. A lane reads back its own codes (no bank conflicts: a
// warp's 16-byte reads of 8 rows x 64 bytes are contiguous) and the scales of its row's first lane (after a
// __syncwarp). Activations come straight from global memory (L2/L1 hits), loaded before the wait. Needs K % 128 ==
// 0 (8-byte aligned scale rows) and KW * S * AsyncRing<MT>::STAGE bytes of dynamic shared memory (cuda_mma.
// decode_ring_bytes).
template <int MT>
struct AsyncRing {
  static constexpr int ROWS = 16 * MT;
  static constexpr int CODES = ROWS * 64;         // [row][64 bytes]: lane (g, t)'s 16 bytes at row * 64 + 16 t
  static constexpr int STAGE = CODES + ROWS * 8;  // then [row][8 bytes]: the row's four pairs of block scales
  static constexpr int WARP = (NVFP4_ASYNC_STAGES > 0 ? NVFP4_ASYNC_STAGES : 1) * STAGE;
};
static_assert(AsyncRing<1>::STAGE == 16 * 72, "AsyncRing no longer matches cuda_mma.RING_BYTES_PER_ROW");

#if ASYNC_RING
// Multiplies this warp's full blocks [kb_begin, full_end) into `acc` through the ring; returns the next block.
template <int MT, int NT, bool BF16>
__device__ __forceinline__ int multiply_blocks_async(unsigned char* ring, const LanePointers<MT, NT>& p, int kb_begin,
                                                     int full_end, float (&acc)[MT][NT][4]) {
  using R = AsyncRing<MT>;
  constexpr int S = NVFP4_ASYNC_STAGES;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const u32 base = shared_address(ring);
  auto issue = [&](int kb, int slot) {
    if (kb < full_end) {
      #pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = mt * 16 + h * 8 + g;
          copy_async_16(base + slot * R::STAGE + row * 64 + t * 16, p.w[mt][h] + kb * 4);
          if (t == 0) copy_async_8(base + slot * R::STAGE + R::CODES + row * 8, p.s[mt][h] + kb * 4);
        }
      }
    }
    copy_async_commit();  // (an empty group past the end keeps one group per block for the wait below)
  };
  __syncwarp();  // (a stream-K CTA's next part refills slots the previous part's lanes read)
  #pragma unroll
  for (int i = 0; i < S - 1; ++i) issue(kb_begin + i, i);
  wait_for_previous_kernel();  // (PDL build: the weights are requested before the activations are ready)
  int slot = 0;
  for (int kb = kb_begin; kb < full_end; ++kb) {
    __syncwarp();  // every lane has read the slot of block kb - 1, which is refilled now
    issue(kb + S - 1, slot == 0 ? S - 1 : slot - 1);
    uint4 xv[NT][4];
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      #pragma unroll
      for (int w = 0; w < 4; ++w) xv[nt][w] = load_cached(p.x[nt] + kb * 16 + w);
    }
    copy_async_wait<S - 1>();
    __syncwarp();  // the scales that a row's first lane copied are visible to the others
    uint4 w[MT][2];
    u32 scales[MT][2];
    const unsigned char* stage = ring + slot * R::STAGE;
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      #pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = mt * 16 + h * 8 + g;
        w[mt][h] = *reinterpret_cast<const uint4*>(stage + row * 64 + t * 16);
        scales[mt][h] = *reinterpret_cast<const u16*>(stage + R::CODES + row * 8 + t * 2);
      }
    }
    multiply_block<MT, NT, BF16>(w, scales, acc, [&](int nt, int word) { return xv[nt][word]; });
    slot = slot == S - 1 ? 0 : slot + 1;
  }
  copy_async_wait<0>();
  return max(kb_begin, full_end);
}
#endif

// The weight segment (one matrix of a q/k/v or gate/up launch) that row tile blockIdx.y belongs to, its row count and
// the tile's first row in it.
struct RowTile {
  int segment, rows, row0;
};

__device__ __forceinline__ RowTile row_tile(const Segments& seg, int rows_per_tile, int tile_y) {
  int s = 0;
  #pragma unroll
  for (int i = 1; i < MAX_SEGMENTS; ++i) s += (i < seg.count && tile_y >= seg.tile_start[i]) ? 1 : 0;
  return {s, seg.rows[s], (tile_y - seg.tile_start[s]) * rows_per_tile};
}

__device__ __forceinline__ RowTile row_tile(const Segments& seg, int rows_per_tile) {
  return row_tile(seg, rows_per_tile, (int)blockIdx.y);
}

// Row tiles of all segments together (seg.tile_start[seg.count] without a run-time index into the parameter).
__device__ __forceinline__ int row_tiles(const Segments& seg) {
  return seg.count == 1 ? seg.tile_start[1] : (seg.count == 2 ? seg.tile_start[2] : seg.tile_start[3]);
}

// SPLIT_K: leave this CTA's sums (over its KW warps, in `partial` [KW][TOKENS][ROWS]) in the tile's slot z; true in
// the last CTA of the tile to arrive, which then holds the tile's total, summed in z order, in partial[0].
template <int KW, int TOKENS, int ROWS>
__device__ __forceinline__ bool last_of_split(float (&partial)[KW][TOKENS][ROWS], const SplitK& split) {
  constexpr int THREADS = 32 * KW, SIZE = TOKENS * ROWS;
  const unsigned tile = blockIdx.y * gridDim.x + blockIdx.x;
  float* slots = split.partial + (u64)tile * gridDim.z * SIZE;
  __syncthreads();
  for (int e = threadIdx.x; e < SIZE; e += THREADS) {
    float sum = 0.0f;
    #pragma unroll
    for (int w = 0; w < KW; ++w) sum += (&partial[w][0][0])[e];
    slots[blockIdx.z * SIZE + e] = sum;
  }
  __threadfence();  // this CTA's slot is visible before its arrival is counted
  __syncthreads();
  __shared__ bool last;
  if (threadIdx.x == 0) last = atomicAdd(&split.counters[tile], 1u) == gridDim.z - 1;
  __syncthreads();
  if (!last) return false;
  __threadfence();
  for (int e = threadIdx.x; e < SIZE; e += THREADS) {
    float sum = 0.0f;
    for (unsigned z = 0; z < gridDim.z; ++z) sum += __ldcg(slots + z * SIZE + e);
    (&partial[0][0][0])[e] = sum;
  }
  if (threadIdx.x == 0) split.counters[tile] = 0u;  // every CTA of the tile has arrived: ready for the next launch
  __syncthreads();
  return true;
}

// Stream-K (built with STREAM_K): the launch's units, (row tile x token group) x 128-column block, numbered tile by
// tile, are dealt out evenly to the grid's CTAs (as many as the GPU holds at once), CTA c taking units
// [c * U / C, (c + 1) * U / C). A CTA's range covers whole tiles, which it finishes as usual, and at its ends parts
// of at most two tiles. It leaves a part's sums (over its KW warps) in partial[c][slot] (slot 0: the CTA's first
// part, 1: its last); the last CTA of a tile to arrive (counters[tile], reset by that CTA) adds the tile's parts in
// CTA order and runs the epilogue. One launch, no last partial wave (BENCHMARKS.md, "Decode attention re-tuned; the
// decode kernel's last wave measured"), the same sums on every launch.
struct StreamK {
  int cta, ctas;        // this CTA and the grid's CTAs
  int units;            // tiles x blocks (a launch has far fewer than 2^31)
  int blocks;           // 128-column blocks per tile
  int groups;           // token groups per row tile: tile number = row tile * groups + token group
};

// The CTA whose units include `unit`, and the first unit of CTA `cta` (64-bit products: units x CTAs may not fit 32).
__device__ __forceinline__ int stream_cta_of(int unit, const StreamK& sk) {
  return (int)(((long long)(unit + 1) * sk.ctas - 1) / sk.units);
}

__device__ __forceinline__ int stream_start(int cta, const StreamK& sk) {
  return (int)((long long)cta * sk.units / sk.ctas);
}

// STREAM_K: leave this CTA's part of `tile` (its KW warps' sums) in slot `slot`; true in the last CTA of the tile to
// arrive, which then holds the tile's total, summed in CTA order, in partial[0].
template <int KW, int TOKENS, int ROWS>
__device__ __forceinline__ bool last_of_stream(float (&partial)[KW][TOKENS][ROWS], const SplitK& split,
                                               const StreamK& sk, int tile, int slot) {
  constexpr int THREADS = 32 * KW, SIZE = TOKENS * ROWS;
  const int first_unit = tile * sk.blocks;
  const int first = stream_cta_of(first_unit, sk), last_cta = stream_cta_of(first_unit + sk.blocks - 1, sk);
  __syncthreads();
  for (int e = threadIdx.x; e < SIZE; e += THREADS) {
    float sum = 0.0f;
    #pragma unroll
    for (int w = 0; w < KW; ++w) sum += (&partial[w][0][0])[e];
    split.partial[((u64)sk.cta * 2 + slot) * SIZE + e] = sum;
  }
  __threadfence();
  __syncthreads();
  __shared__ bool last;
  if (threadIdx.x == 0) last = atomicAdd(&split.counters[tile], 1u) == (unsigned)(last_cta - first);
  __syncthreads();
  if (!last) return false;
  __threadfence();
  // the first CTA's part is its last slot unless its range starts at this tile
  const int first_slot = stream_start(first, sk) < first_unit ? 1 : 0;
  for (int e = threadIdx.x; e < SIZE; e += THREADS) {
    float sum = 0.0f;
    for (int c = first; c <= last_cta; ++c) {
      sum += __ldcg(split.partial + ((u64)c * 2 + (c == first ? first_slot : 0)) * SIZE + e);
    }
    (&partial[0][0][0])[e] = sum;
  }
  if (threadIdx.x == 0) split.counters[tile] = 0u;
  __syncthreads();
  return true;
}

// One CTA's work on row tile `tile_y`, token group `tile_x`, 128-column blocks [kb_lo, kb_hi) (all of them unless
// SPLIT_K or STREAM_K): the main loop, the KW warps' sums, the fix-up of a split tile, the epilogue.
template <int MT, int NT, int KW, bool BF16, int LORA_RANK, bool SPLIT_K, bool STREAM_K>
__device__ __forceinline__ void decode_tile(const u16* __restrict__ x, int M, int K, int ldx, u16* __restrict__ out,
                                            int ldo, const Segments& seg, const LoraTerms& lora,
                                            const SplitK& split, int tile_y, int tile_x, int kb_lo, int kb_hi,
                                            const StreamK& sk, int slot) {
  constexpr bool PREFETCH_X = NT <= 2;
  constexpr int ROWS = 16 * MT, TOKENS = 8 * NT;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;

  const auto [s, rows, row0] = row_tile(seg, ROWS, tile_y);
  const int tok0 = tile_x * TOKENS;
  const int k_vectors = K >> 5;  // 16-byte vectors (32 codes) per weight row, also byte pairs per scale row

  // Rows past the end of the segment and tokens past M read a real row and are never stored.
  LanePointers<MT, NT> p;
  #pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = min(row0 + mt * 16 + h * 8 + g, rows - 1);
      p.w[mt][h] = seg.packed[s] + (u64)row * k_vectors + t;
      p.s[mt][h] = seg.scales[s] + (u64)row * k_vectors + t;
    }
  }
  #pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    p.x[nt] = reinterpret_cast<const uint4*>(x + (u64)min(tok0 + nt * 8 + g, M - 1) * ldx) + t * 4;
  }

  float acc[MT][NT][4];
  #pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      #pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;

  // This warp's 128-column blocks: the full ones two at a time, the next block's loads in flight while one
  // computes; then the last block if K % 128 != 0 (K % 32 == 0, so each lane's 32 columns are in or out).
  const int split_begin = kb_lo, blocks = kb_hi;
  const int per_warp = (blocks - split_begin + KW - 1) / KW;
  const int kb_begin = split_begin + warp * per_warp;
  const int kb_end = min(blocks, kb_begin + per_warp);
  const int full_end = min(kb_end, K >> 7);
#if ASYNC_RING
  extern __shared__ __align__(16) unsigned char decode_ring[];
  int kb = multiply_blocks_async<MT, NT, BF16>(decode_ring + warp * AsyncRing<MT>::WARP, p, kb_begin, full_end, acc);
  Stage<MT, NT, PREFETCH_X> a{};  // (for a last block of K % 128 columns, which the launcher refuses for this build)
#else
  constexpr int STAGES = NVFP4_DEPTH + 1;
  Stage<MT, NT, PREFETCH_X> st[STAGES];
  #pragma unroll
  for (int i = 0; i < STAGES; ++i) st[i] = Stage<MT, NT, PREFETCH_X>{};
  int kb = kb_begin;
  #pragma unroll
  for (int d = 0; d < NVFP4_DEPTH; ++d) {
    if (kb + d < full_end) load_stage<MT, NT, PREFETCH_X, false, true, !PDL>(st[d], p, kb + d, true);
  }
#if PDL
  if (NVFP4_PDL_L2_BLOCKS > 0) {
    prefetch_weights_to_l2(p, kb + NVFP4_DEPTH, min(full_end, kb + NVFP4_DEPTH + NVFP4_PDL_L2_BLOCKS));
  }
  wait_for_previous_kernel();
  #pragma unroll
  for (int d = 0; d < NVFP4_DEPTH; ++d) {
    if (kb + d < full_end) load_stage<MT, NT, PREFETCH_X, false, false, true>(st[d], p, kb + d, true);
  }
#endif
  for (; kb + STAGES + NVFP4_DEPTH <= full_end; kb += STAGES) {  // steady state: every load in range
    #pragma unroll
    for (int j = 0; j < STAGES; ++j) {
      load_stage<MT, NT, PREFETCH_X, false>(st[(j + NVFP4_DEPTH) % STAGES], p, kb + j + NVFP4_DEPTH, true);
      compute_stage<MT, NT, BF16, PREFETCH_X, false>(st[j], acc, p, kb + j, true);
    }
  }
  for (; kb < full_end; kb += STAGES) {  // the last few blocks
    #pragma unroll
    for (int j = 0; j < STAGES; ++j) {
      if (kb + j < full_end) {
        if (kb + j + NVFP4_DEPTH < full_end) {
          load_stage<MT, NT, PREFETCH_X, false>(st[(j + NVFP4_DEPTH) % STAGES], p, kb + j + NVFP4_DEPTH, true);
        }
        compute_stage<MT, NT, BF16, PREFETCH_X, false>(st[j], acc, p, kb + j, true);
      }
    }
  }
  kb = max(kb_begin, full_end);  // (a warp with no blocks keeps kb_begin >= kb_end)
  Stage<MT, NT, PREFETCH_X>& a = st[0];
#endif
  if (kb < kb_end) {
    const bool live = kb * 128 + t * 32 < K;
    load_stage<MT, NT, PREFETCH_X, true>(a, p, kb, live);
    compute_stage<MT, NT, BF16, PREFETCH_X, true>(a, acc, p, kb, live);
  }

  allow_next_kernel();

  // Partial sums of the KW warps -> shared memory [warp][token][row] -> one fixed-order sum per output.
  __shared__ float partial[KW][TOKENS][ROWS];
  #pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      partial[warp][nt * 8 + 2 * t][mt * 16 + g] = acc[mt][nt][0];
      partial[warp][nt * 8 + 2 * t + 1][mt * 16 + g] = acc[mt][nt][1];
      partial[warp][nt * 8 + 2 * t][mt * 16 + g + 8] = acc[mt][nt][2];
      partial[warp][nt * 8 + 2 * t + 1][mt * 16 + g + 8] = acc[mt][nt][3];
    }
  }
  if constexpr (SPLIT_K) {
    if (!last_of_split(partial, split)) return;
  }
  // (stream-K: a whole tile needs no fix-up; a part does, and then the total is in partial[0])
  const bool fixed_up = STREAM_K && (kb_lo != 0 || kb_hi != sk.blocks);
  if constexpr (STREAM_K) {
    if (fixed_up && !last_of_stream(partial, split, sk, tile_y * sk.groups + tile_x, slot)) return;
  }
  // (a LoRA-free build keeps a one-element array the compiler drops)
  __shared__ float terms[LORA_RANK > 0 ? TOKENS : 1][LORA_RANK > 0 ? ROWS : 1];
  const bool lora_here = LORA_RANK > 0 && pick(lora.b, s) != nullptr;
  if (LORA_RANK > 0 && lora_here) {
    lora_terms<(LORA_RANK > 0 ? LORA_RANK : 4), ROWS, TOKENS, 32 * KW>(
        reinterpret_cast<float(&)[TOKENS][ROWS]>(terms), lora, s, rows, row0, tok0, M);
  }
  __syncthreads();
  const float factor = (BF16 ? 9223372036854775808.0f : 16384.0f) / *seg.global_scale[s];
  const u16* bias = seg.bias[s];
  for (int e = threadIdx.x; e < TOKENS * ROWS; e += 32 * KW) {
    const int r = e % ROWS, tok = e / ROWS;
    const int row = row0 + r;
    if (row >= rows || tok0 + tok >= M) continue;
    float sum = 0.0f;
    #pragma unroll
    for (int w = 0; w < (SPLIT_K ? 1 : KW); ++w) {
      if (!STREAM_K || !fixed_up || w == 0) sum += partial[w][tok][r];
    }
    sum *= factor;
    if (bias != nullptr) sum += input_to_float<BF16>(bias[row]);
    if (lora_here) sum = input_to_float<BF16>(round_to_output<BF16>(sum)) + (&terms[0][0])[tok * ROWS + r];
    out[(u64)(tok0 + tok) * ldo + seg.col_start[s] + row] = round_to_output<BF16>(sum);
  }
}

template <int MT, int NT, int KW, bool BF16, int LORA_RANK = 0, bool SPLIT_K = false>
__global__ void DECODE_BOUNDS(KW) nvfp4_mma_kernel(const u16* __restrict__ x, int M, int K, int ldx,
                                                            u16* __restrict__ out, int ldo, Segments seg,
                                                            LoraTerms lora, SplitK split) {
  const int all_blocks = (K + 127) >> 7;
  const int per_split = SPLIT_K ? (all_blocks + gridDim.z - 1) / gridDim.z : all_blocks;
  const int split_begin = SPLIT_K ? min(all_blocks, (int)blockIdx.z * per_split) : 0;
  const int blocks = SPLIT_K ? min(all_blocks, split_begin + per_split) : all_blocks;
  decode_tile<MT, NT, KW, BF16, LORA_RANK, SPLIT_K, false>(x, M, K, ldx, out, ldo, seg, lora, split, (int)blockIdx.y,
                                                           (int)blockIdx.x, split_begin, blocks, StreamK{}, 0);
}

// The stream-K launch of the same instance: grid (CTAs, 1, 1), CTAs = what the GPU holds at once. For 8 tokens per
// CTA its registers are capped at what lets 16 warps share a multiprocessor (128 per thread, the plain builds'
// count): the loop over parts made the compiler take 136-160 and so halve the resident CTAs of the 8-warp
// instances. 16 tokens need more than 128 (the plain builds take 120-172), so those are left uncapped.
#define STREAM_MIN_BLOCKS(MT, NT, KW) ((MT) * (NT) <= 2 && 16 / (KW) > 1 ? 16 / (KW) : 1)
template <int MT, int NT, int KW, bool BF16, int LORA_RANK = 0>
__global__ void __launch_bounds__(32 * KW, STREAM_MIN_BLOCKS(MT, NT, KW))
    nvfp4_mma_stream_kernel(const u16* __restrict__ x, int M, int K, int ldx, u16* __restrict__ out, int ldo,
                            Segments seg, LoraTerms lora, SplitK split) {
  constexpr int TOKENS = 8 * NT;
  const int all_blocks = (K + 127) >> 7;
  const int groups = (M + TOKENS - 1) / TOKENS;
  const StreamK sk{(int)blockIdx.x, (int)gridDim.x, row_tiles(seg) * groups * all_blocks, all_blocks, groups};
  int unit = stream_start(sk.cta, sk);
  const int end = stream_start(sk.cta + 1, sk);
  for (int part = 0; unit < end; ++part) {
    const int tile = unit / all_blocks, kb_lo = unit - tile * all_blocks;
    const int kb_hi = min(all_blocks, kb_lo + (end - unit));
    if (part > 0) __syncthreads();  // the previous tile's epilogue has read the shared sums
    decode_tile<MT, NT, KW, BF16, LORA_RANK, false, true>(x, M, K, ldx, out, ldo, seg, lora, split, tile / groups,
                                                          tile % groups, kb_lo, kb_hi, sk, part == 0 ? 0 : 1);
    unit += kb_hi - kb_lo;
  }
}

// ---- The tiled kernel: 16 to a few hundred activation rows ----------------------------------------------------
//
// The decode kernel above loads every token's activations from global memory in every warp, so from ~32 rows on it
// reads ~16x more activation bytes (through L1) than weight bytes and stops being limited by the weights. This
// kernel stages each 128-column block of the activations in shared memory once per CTA and lets WARPS warps, each
// owning 16*MT weight rows, read it from there: every activation fragment a lane loads feeds MT m-tiles of MMAs.
// Weights, scales and activations of a block come in by cp.async, STAGES blocks in flight (sm_80+), so nothing
// waits on a register prefetch. The MMA and its register layout are the decode kernel's (swap-AB, lane (g, t) takes
// columns 32t..32t+31 of a block, Marlin decode, activations permuted with PRMT), so both kernels give the same
// products for the same inputs.
//
// Shared memory of one stage, for ROWS weight rows and TOKENS tokens:
//   codes  [ROWS][64 bytes]            a lane reads 16 bytes (its 32 columns) of rows g and g + 8: conflict-free
//   scales [ROWS][8 bytes]             the 8 block scales of a row's 128 columns
//   x      [TOKENS][16 chunks of 16 B] chunk c of token r sits at c ^ (((c >> 3) & 1) << 1) ^ (r & 1), so the 8 lanes
//                                      of a 16-byte load phase (tokens r, r+1; t = 0..3) hit 8 different bank groups
// The epilogue reuses the same memory for the output tile, so every global store is 16 bytes wide and coalesced.
//
// K may be split over grid.z (small layers at a few dozen rows would leave most multiprocessors idle): each split
// then writes fp32 partial sums (already scaled, bias in split 0) and nvfp4_split_reduce_kernel adds them in fixed
// order. Requires K % 128 == 0 (every Qwen/Llama width is) and 8-byte aligned scale rows.

__device__ __forceinline__ int x_chunk_slot(int chunk, int token) {
  return chunk ^ (((chunk >> 3) & 1) << 1) ^ (token & 1);
}

// Byte sizes shared with the launcher (cuda_mma.TileConfig mirrors them).
template <int ROWS, int TOKENS>
struct TileLayout {
  static constexpr int CODES = ROWS * 64;
  static constexpr int SCALES = ROWS * 8;
  static constexpr int X = TOKENS * 256;
  static constexpr int STAGE = CODES + SCALES + X;
  static constexpr int OUT_STRIDE = ROWS + 8;  // 16-bit outputs per token row of the epilogue tile (padded)
  static constexpr int PARTIAL_STRIDE = ROWS + 4;  // fp32 partial sums per token row
};

// The epilogue of the tiled kernels. `output(e, r, token)` returns this thread's e-th output (e < COUNT; scaled,
// with its bias) and sets its row r in the CTA's tile and its token. They go through shared memory (free by then:
// the caller waited for its copies and synchronised) so that every global store is 16 bytes wide and coalesced; with
// `partial` (split-K) they are fp32 sums written to this split's slice [blockIdx.z][M][ldo] instead.
// (`output` is a plain lambda: NVRTC 13.0 rejects generic lambdas passed to device functions as host functions.)
template <int ROWS, int TOKENS, int THREADS, int COUNT, bool BF16, typename Output>
__device__ __forceinline__ void store_tile(unsigned char* smem, u16* __restrict__ out, int ldo,
                                           float* __restrict__ partial, const Segments& seg, int s, int rows,
                                           int row0, int tok0, int M, Output output) {
  using L = TileLayout<ROWS, TOKENS>;
  const int valid_rows = min(ROWS, rows - row0);
  if (partial == nullptr) {
    u16* tile = reinterpret_cast<u16*>(smem);
    #pragma unroll
    for (int e = 0; e < COUNT; ++e) {
      int r, token;
      const float v = output(e, r, token);
      tile[token * L::OUT_STRIDE + r] = round_to_output<BF16>(v);
    }
    __syncthreads();
    u16* dst = out + seg.col_start[s] + row0;
    const bool vector = ((seg.col_start[s] + row0) % 8 == 0) && (ldo % 8 == 0) &&
                        (reinterpret_cast<u64>(out) % 16 == 0);
    for (int e = threadIdx.x; e < TOKENS * (ROWS / 8); e += THREADS) {
      const int token = e / (ROWS / 8), r = (e % (ROWS / 8)) * 8;
      if (tok0 + token >= M || r >= valid_rows) continue;
      const u16* src = tile + token * L::OUT_STRIDE + r;
      u16* o = dst + (u64)(tok0 + token) * ldo + r;
      if (vector && r + 8 <= valid_rows) {
        *reinterpret_cast<uint4*>(o) = *reinterpret_cast<const uint4*>(src);
      } else {
        for (int j = 0; j < 8 && r + j < valid_rows; ++j) o[j] = src[j];
      }
    }
  } else {
    float* tile = reinterpret_cast<float*>(smem);
    #pragma unroll
    for (int e = 0; e < COUNT; ++e) {
      int r, token;
      const float v = output(e, r, token);
      tile[token * L::PARTIAL_STRIDE + r] = v;
    }
    __syncthreads();
    float* dst = partial + (u64)blockIdx.z * M * ldo + seg.col_start[s] + row0;
    for (int e = threadIdx.x; e < TOKENS * ROWS; e += THREADS) {
      const int token = e / ROWS, r = e % ROWS;
      if (tok0 + token < M && r < valid_rows) dst[(u64)(tok0 + token) * ldo + r] = tile[token * L::PARTIAL_STRIDE + r];
    }
  }
}

template <int MT, int NT, int WARPS, int STAGES, bool BF16>
__global__ void __launch_bounds__(32 * WARPS) nvfp4_tile_kernel(const u16* __restrict__ x, int M, int K, int ldx,
                                                                u16* __restrict__ out, int ldo,
                                                                float* __restrict__ partial, Segments seg) {
  constexpr int ROWS = 16 * MT * WARPS, TOKENS = 8 * NT, THREADS = 32 * WARPS;
  using L = TileLayout<ROWS, TOKENS>;
  extern __shared__ __align__(16) unsigned char smem[];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const auto [s, rows, row0] = row_tile(seg, ROWS);
  const int tok0 = blockIdx.x * TOKENS;
  const int blocks = K >> 7;
  const int per_split = (blocks + gridDim.z - 1) / gridDim.z;
  const int kb_begin = min(blocks, (int)blockIdx.z * per_split);
  const int count = min(blocks, kb_begin + per_split) - kb_begin;

  // What this thread copies into each stage: byte offsets (32-bit: a weight has < 4 GB) of its 16-byte code chunks,
  // 8-byte scale rows and 16-byte activation chunks at block 0. Clamped rows and tokens read real memory and are
  // never stored. THREADS is a multiple of 16, so a thread's activation chunk index (and its slot) never changes.
  constexpr int CODE_COPIES = ROWS * 4 / THREADS, SCALE_COPIES = (ROWS + THREADS - 1) / THREADS;
  constexpr int X_COPIES = (TOKENS * 16 + THREADS - 1) / THREADS;
  const unsigned char* packed = reinterpret_cast<const unsigned char*>(seg.packed[s]);
  const unsigned char* scales = reinterpret_cast<const unsigned char*>(seg.scales[s]);
  const unsigned char* xb = reinterpret_cast<const unsigned char*>(x);
  u32 code_src[CODE_COPIES], scale_src[SCALE_COPIES], x_src[X_COPIES];
  #pragma unroll
  for (int j = 0; j < CODE_COPIES; ++j) {
    const int i = threadIdx.x + j * THREADS;
    code_src[j] = (u32)min(row0 + (i >> 2), rows - 1) * (u32)(K >> 1) + (i & 3) * 16;
  }
  #pragma unroll
  for (int j = 0; j < SCALE_COPIES; ++j) {
    scale_src[j] = (u32)min(row0 + (int)threadIdx.x + j * THREADS, rows - 1) * (u32)(K >> 4);
  }
  const int x_chunk = threadIdx.x & 15;
  #pragma unroll
  for (int j = 0; j < X_COPIES; ++j) {
    const int r = (threadIdx.x >> 4) + j * (THREADS / 16);
    x_src[j] = (u32)min(tok0 + r, M - 1) * (u32)ldx * 2u + x_chunk * 16;
  }
  const int x_dst = (threadIdx.x >> 4) * 256 + x_chunk_slot(x_chunk, threadIdx.x >> 4) * 16;
  const u32 base = shared_address(smem);
  auto issue_stage = [&](int slot, int kb) {
    const u32 stage = base + slot * L::STAGE;
    #pragma unroll
    for (int j = 0; j < CODE_COPIES; ++j) {
      copy_async_16(stage + (threadIdx.x + j * THREADS) * 16, packed + code_src[j] + kb * 64);
    }
    #pragma unroll
    for (int j = 0; j < SCALE_COPIES; ++j) {
      const int i = threadIdx.x + j * THREADS;
      if (SCALE_COPIES * THREADS == ROWS || i < ROWS) copy_async_8(stage + L::CODES + i * 8, scales + scale_src[j] + kb * 8);
    }
    #pragma unroll
    for (int j = 0; j < X_COPIES; ++j) {
      if (X_COPIES * THREADS == TOKENS * 16 || (int)threadIdx.x + j * THREADS < TOKENS * 16) {
        copy_async_16(stage + L::CODES + L::SCALES + x_dst + j * (THREADS / 16) * 256, xb + x_src[j] + kb * 256);
      }
    }
  };

  float acc[MT][NT][4] = {};

  // Per-lane offsets inside a stage: its weight rows, and the slots of its four 16-byte activation chunks.
  const int warp_row = warp * 16 * MT;
  const int swizzle = ((t >> 1) << 1) ^ (g & 1);
  int x_offset[4];
  #pragma unroll
  for (int w = 0; w < 4; ++w) x_offset[w] = g * 256 + (4 * t + (w ^ swizzle)) * 16;

  #pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < count) issue_stage(i, kb_begin + i);
    copy_async_commit();
  }
  for (int i = 0; i < count; ++i) {
    copy_async_wait<STAGES - 2>();
    __syncthreads();  // stage i is in; every warp is done with the slot refilled next
    if (i + STAGES - 1 < count) issue_stage((i + STAGES - 1) % STAGES, kb_begin + i + STAGES - 1);
    copy_async_commit();

    const unsigned char* stage = smem + (i % STAGES) * L::STAGE;
    uint4 w[MT][2];
    u32 scales[MT][2];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      #pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = warp_row + mt * 16 + h * 8 + g;
        w[mt][h] = *reinterpret_cast<const uint4*>(stage + r * 64 + t * 16);
        scales[mt][h] = *reinterpret_cast<const u16*>(stage + L::CODES + r * 8 + t * 2);
      }
    }
    const unsigned char* xs = stage + L::CODES + L::SCALES;
    multiply_block<MT, NT, BF16>(w, scales, acc, [&](int nt, int word) {
      return *reinterpret_cast<const uint4*>(xs + nt * 8 * 256 + x_offset[word]);
    });
  }
  copy_async_wait<0>();
  __syncthreads();  // the stages are free: the epilogue tile reuses them

  const float factor = (BF16 ? 9223372036854775808.0f : 16384.0f) / *seg.global_scale[s];
  const u16* bias = blockIdx.z == 0 ? seg.bias[s] : nullptr;
  float bias_of[MT][2];
  #pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + warp_row + mt * 16 + h * 8 + g;
      bias_of[mt][h] = (bias != nullptr && row < rows) ? input_to_float<BF16>(bias[row]) : 0.0f;
    }

  store_tile<ROWS, TOKENS, THREADS, MT * NT * 4, BF16>(
      smem, out, ldo, partial, seg, s, rows, row0, tok0, M, [&](int e, int& r, int& token) {
        const int mt = e / (NT * 4), nt = (e / 4) % NT, i = e % 4;  // acc[mt][nt][i]
        r = warp_row + mt * 16 + g + (i >> 1) * 8;
        token = nt * 8 + 2 * t + (i & 1);
        return acc[mt][nt][i] * factor + bias_of[mt][i >> 1];
      });
}

// out[m][n] = sum over splits of partial[split][m][n], in split order, rounded once (n < N, out row stride ldo;
// partial rows are ldo wide too).
template <bool BF16>
__global__ void nvfp4_split_reduce_kernel(const float* __restrict__ partial, int splits, int M, int N, int ldo,
                                          u16* __restrict__ out) {
  const u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= (u64)M * N) return;
  const u64 m = e / N, n = e % N;
  float sum = 0.0f;
  for (int z = 0; z < splits; ++z) sum += partial[((u64)z * M + m) * ldo + n];
  out[m * ldo + n] = round_to_output<BF16>(sum);
}
