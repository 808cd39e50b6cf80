// NVFP4 W4A16 matmul on Hopper's warpgroup MMA (wgmma, sm_90a): 64 to a few hundred activation rows.
//
// Appended to nvfp4_mma.cu by the launcher (trl_qerl/nvfp4/cuda_wgmma.py): it uses that file's decode helpers,
// `Segments`, `row_tile`, the cp.async wrappers and the tiled kernels' epilogue `store_tile`.
//
// Why. The mma.sync kernels give every warp its own activation fragments: at 64+ tokens each warp loads and
// permutes the whole activation tile from shared memory for its 16-32 weight rows, and the tensor cores wait on
// those loads. wgmma reads the activations (its B operand) from shared memory itself, once per warpgroup
// instruction, through a matrix descriptor; the weights (A) come from registers, decoded from the staged codes.
//
// Work split. A warpgroup (4 warps, 128 threads) owns 64*MW weight rows, a CTA WG warpgroups and N tokens
// (accumulators: MW * N / 2 fp32 per thread, in the m16n8 C layout per warp and n8 column). Each 128-column block
// of codes and activations comes in by the Tensor Memory Accelerator (one thread issues three boxes per block,
// completion counted on the slot's mbarrier; per-thread cp.async copies took twice as long on 7B gate_up at 256
// rows: the load/store unit queue was full), the scales by cp.async. STAGES blocks in the ring, STAGES - 2 of them ahead of the one being
// multiplied: the slot refilled at block i was last read by block i - 2's wgmmas, which have retired (at most
// wgmma_depth() <= 8 wgmma groups, all of block i - 1, are in flight when a block starts). Every block is 8 k16
// steps; a step decodes the thread's weights into A registers, issues one wgmma per m64 tile and waits until at most
// wgmma_depth() groups are in flight (so the registers of the groups before may be reused).
//
// Shared memory of one stage (1024-byte aligned), for ROWS weight rows and N tokens:
//   x      [2 halves][N][128 B]    the block's 128 columns as two 64-column halves, each token's 128 bytes swizzled
//                                  in 16-byte chunks by TMA's 128-byte pattern: wgmma's K-major SWIZZLE_128B layout
//   codes  [ROWS][64 B]            TMA's 64-byte swizzle: chunk c of row r at c ^ ((r >> 1) & 3), so the 16-byte
//                                  reads of rows g = 0..7 of a warp fall in different banks
//   scales [ROWS][8 B]             one FP8 scale per row and k16 step (the NVFP4 group is 16 columns)
//
// A operand in natural column order. Lane (g, t) of warp w holds rows 16w + g and 16w + g + 8 of its m64 tile and
// columns 2t, 2t + 1 (a0, a1) and 2t + 8, 2t + 9 (a2, a3) of the step: bytes t and 4 + t of the step's 8 code bytes
// (low nibble first). One PRMT gathers them, a shift and a second PRMT place the four codes where the Marlin decode
// (decode_word's pairs 0 and 2) turns them into the bf16 / fp16 pairs, times the step's scale pair.
//
// Built with NVFP4_TWIDDLED=2, the kernel reads codes in the lane order (trl_qerl/nvfp4/twiddle.py, to_lane_order):
// each 16-byte chunk's bytes transposed, so that its word t holds lane t's codes of both steps, and each word
// twiddled. A lane reads that one word and decode_word (twiddled) gives its four pairs for the chunk: 9 instructions
// and a 4-byte read per row and two steps, where the natural order takes ~2 x 11 and a 16-byte read.

// wgmma groups (one per k16 step) left in flight after each step's commit: 1 keeps two A-register sets live, so a
// step's MMAs overlap the next step's decode; more overlap the MMAs' latency with further steps' decodes (ptxas keeps
// each group's A registers until its wait). At most 8 (one block), so that a block's start has no group of the block
// before last in flight (the ring's refill below relies on it). 0 (the default) chooses by the CTA's token width:
// 3 for 128 and 256 tokens, 1 for 64 (H100, 7B shapes at 64-256 rows, BENCHMARKS.md "The wgmma kernel with three
// groups in flight": 1-9 % faster with 128+ tokens, 64-token CTAs no faster and up to 10 % slower).
#ifndef NVFP4_WGMMA_DEPTH
#define NVFP4_WGMMA_DEPTH 0
#endif
static_assert(NVFP4_WGMMA_DEPTH >= 0 && NVFP4_WGMMA_DEPTH <= 8, "NVFP4_WGMMA_DEPTH: 1 to 8 groups in flight, 0 by tile");

// 1: each chunk's code reads are issued one chunk ahead (see the main loop). Off: measured no faster (H100, 7B at 64
// and 256 rows, within 2 %, BENCHMARKS.md "More and shorter wgmma CTAs"); its build with 0 is the SASS of the kernel
// before (compare_sass.py).
#ifndef NVFP4_WGMMA_PREFETCH
#define NVFP4_WGMMA_PREFETCH 0
#endif

template <int TOKENS>
__host__ __device__ constexpr int wgmma_depth() {
  return NVFP4_WGMMA_DEPTH > 0 ? NVFP4_WGMMA_DEPTH : (TOKENS >= 128 ? 3 : 1);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define NVFP4_WGMMA 1
#else
#define NVFP4_WGMMA 0
#endif

template <int ROWS, int TOKENS>
struct WgmmaLayout {
  static constexpr int X = TOKENS * 256;
  static constexpr int CODES = ROWS * 64;
  static constexpr int SCALES = ROWS * 8;
  static constexpr int STAGE = (X + CODES + SCALES + 1023) / 1024 * 1024;
};

// Shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format") of a K-major operand in the 128-byte
// swizzle: start address >> 4, leading byte offset unused (1), stride byte offset 1024 (8 rows of 128 bytes) >> 4,
// layout type 1 (SWIZZLE_128B) in bits 62-63. A k16 step inside the 128-byte rows adds its 32-byte offset to the
// start address (the swizzle is applied to the address bits).
__device__ __forceinline__ u64 swizzled_descriptor(u32 address) {
  return (u64)((address & 0x3FFFFu) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(PENDING) : "memory");
}

// Keeps the compiler from moving reads or writes of an accumulator across the asynchronous MMAs.
__device__ __forceinline__ void pin(float& v) { asm volatile("" : "+f"(v)::"memory"); }

// D[64 x N] += A[64 x 16] (registers) * B[16 x N] (shared memory, descriptor b), fp32 accumulators.
#define WGMMA_N64(T)                                                                                \
  asm volatile(                                                                                 \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." #T "." #T " {"                               \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "  \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "  \
      "{%32, %33, %34, %35}, %36, 1, 1, 1, 0;"  \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b))

#define WGMMA_N128(T)                                                                                \
  asm volatile(                                                                                 \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." #T "." #T " {"                               \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "  \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "  \
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "  \
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "  \
      "{%64, %65, %66, %67}, %68, 1, 1, 1, 0;"  \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b))

#define WGMMA_N256(T)                                                                                \
  asm volatile(                                                                                 \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." #T "." #T " {"                               \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "  \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "  \
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "  \
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "  \
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "  \
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "  \
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "  \
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "  \
      "{%128, %129, %130, %131}, %132, 1, 1, 1, 0;"  \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b))


#ifndef NVFP4_WGMMA_PROFILE  // benchmarks only (wrong products): 1 multiplies the undecoded codes
#define NVFP4_WGMMA_PROFILE 0
#endif

template <int N, bool BF16>
__device__ __forceinline__ void wgmma(float (&d)[N / 2], u32 a0, u32 a1, u32 a2, u32 a3, u64 b) {
#if NVFP4_WGMMA
  if constexpr (N == 64) {
    if (BF16) WGMMA_N64(bf16); else WGMMA_N64(f16);
  } else if constexpr (N == 128) {
    if (BF16) WGMMA_N128(bf16); else WGMMA_N128(f16);
  } else {
    static_assert(N == 256, "wgmma: N is 64, 128 or 256");
    if (BF16) WGMMA_N256(bf16); else WGMMA_N256(f16);
  }
#endif
}

// The A registers of one row pair and step: codes of columns (2t, 2t+1) and (2t+8, 2t+9) of rows g (w0/w1: the
// step's two code words of row g) -> pairs 0 and 2 of decode_word, times the step's scale pair.
template <bool BF16>
__device__ __forceinline__ void decode_step(u32 w0, u32 w1, int t, u32 scale, u32& p0, u32& p2) {
  const u32 lo = prmt(w0, w1, (u32)t | ((u32)(4 + t) << 4));  // byte 0: columns 2t, 2t+1; byte 1: 2t+8, 2t+9
  const u32 q = prmt(lo, lo >> 4, 0x5410u);                   // nibbles 0, 4 and 2, 6 hold those four codes
  const u32 sign = 0x80008000u;
  if (BF16) {
    const u32 magnitude = 0x01C001C0u;
    p0 = ((q << 12) & sign) | ((q << 6) & magnitude);
    p2 = ((q << 4) & sign) | ((q >> 2) & magnitude);
  } else {
    const u32 magnitude = 0x0E000E00u;
    p0 = ((q << 12) & sign) | ((q << 9) & magnitude);
    p2 = ((q << 4) & sign) | ((q << 1) & magnitude);
  }
  p0 = mul2<BF16>(p0, scale);
  p2 = mul2<BF16>(p2, scale);
}

// One row's codes of a 16-byte chunk (two k16 steps) as the lane reads them from shared memory: the chunk's 16
// bytes, or in the lane order its word t (in .x).
__device__ __forceinline__ uint4 chunk_bytes(const unsigned char* chunk, int t) {
#if NVFP4_TWIDDLED == 2
  return make_uint4(*reinterpret_cast<const u32*>(chunk + 4 * t), 0u, 0u, 0u);
#else
  return *reinterpret_cast<const uint4*>(chunk);
#endif
}

// `chunk_bytes` as the lane keeps them between the steps: the chunk's 16 bytes, or in the lane order the four pairs
// of word t, decoded and not yet scaled.
template <bool BF16>
__device__ __forceinline__ uint4 chunk_codes(const uint4& bytes) {
#if NVFP4_TWIDDLED == 2
  u32 p[4];
  decode_word<BF16>(bytes.x, p);
  return make_uint4(p[0], p[1], p[2], p[3]);
#else
  return bytes;
#endif
}

// The A registers of one row for step 2c + half of its chunk (`chunk_codes`), times the step's scale pair.
template <bool BF16>
__device__ __forceinline__ void step_operands(const uint4& v, int half, int t, u32 scale, u32& p0, u32& p2) {
#if NVFP4_TWIDDLED == 2
  p0 = mul2<BF16>(half ? v.z : v.x, scale);
  p2 = mul2<BF16>(half ? v.w : v.y, scale);
#else
  decode_step<BF16>(half ? v.z : v.x, half ? v.w : v.y, t, scale, p0, p2);
#endif
}

// Tensor maps for the Tensor Memory Accelerator (cuda.h's CUtensorMap, encoded on the host by
// cuTensorMapEncodeTiled): the codes of each weight of the launch ([rows][K / 2] bytes, boxes of 64 bytes x ROWS
// rows, 64-byte swizzle) and the activations ([M][K] 16-bit, boxes of 64 columns x N tokens, 128-byte swizzle).
struct __align__(64) TensorMap {
  u64 opaque[16];
};
struct TensorMaps {
  TensorMap codes[MAX_SEGMENTS];
  TensorMap x;
};

__device__ __forceinline__ void barrier_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void barrier_expect_bytes(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void barrier_wait(u32 bar, u32 parity) {
  asm volatile(
      "{\n .reg .pred done;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT;\n}" ::"r"(bar), "r"(parity) : "memory");
}

// One box of a 2-D tensor map into shared memory; its bytes count towards `bar`'s expected transaction.
__device__ __forceinline__ void tensor_load_2d(u32 dst, const TensorMap* map, int c0, int c1, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
      ::"r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(bar) : "memory");
}

template <int WG, int MW, int N, int STAGES, bool BF16>
__global__ void __launch_bounds__(128 * WG) nvfp4_wgmma_kernel(const u16* __restrict__ x, int M, int K, int ldx,
                                                                 u16* __restrict__ out, int ldo,
                                                                 float* __restrict__ partial, Segments seg,
                                                                 const __grid_constant__ TensorMaps maps) {
#if NVFP4_WGMMA
  constexpr int ROWS = 64 * MW * WG, THREADS = 128 * WG;
  static_assert(STAGES >= 3, "the ring keeps STAGES - 2 blocks ahead");
  using L = WgmmaLayout<ROWS, N>;
  extern __shared__ __align__(128) unsigned char smem_unaligned[];
  // swizzled boxes want their 1024-byte pattern aligned (the launcher asks for 1 KB more)
  unsigned char* smem = smem_unaligned + ((1024 - (shared_address(smem_unaligned) & 1023)) & 1023);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const auto [s, rows, row0] = row_tile(seg, ROWS);
  const int tok0 = blockIdx.x * N;
  const int blocks = K >> 7;
  const int per_split = (blocks + gridDim.z - 1) / gridDim.z;
  const int kb_begin = min(blocks, (int)blockIdx.z * per_split);
  const int count = min(blocks, kb_begin + per_split) - kb_begin;

  // Codes and activations come by TMA (one thread issues a stage's three boxes; rows past the weight and tokens
  // past M are zeros), the scales (8 bytes per row: below TMA's 16-byte box minimum) by cp.async, one per thread.
  const u32 base = shared_address(smem);
  const u32 bars = base + STAGES * L::STAGE;
  if (threadIdx.x == 0) {
    #pragma unroll
    for (int i = 0; i < STAGES; ++i) barrier_init(bars + 8 * i, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const unsigned char* scales = reinterpret_cast<const unsigned char*>(seg.scales[s]);
  const u32 scale_src = (u32)min(row0 + (int)threadIdx.x, rows - 1) * (u32)(K >> 4);
  const TensorMap* code_map = &maps.codes[s];
  const int first_row = row0;  // (a lambda cannot capture a structured binding)
  auto issue_stage = [&](int slot, int kb) {
    const u32 stage = base + slot * L::STAGE, bar = bars + 8 * slot;
    if (threadIdx.x == 0) {
      barrier_expect_bytes(bar, L::X + L::CODES);
      tensor_load_2d(stage, &maps.x, kb * 128, tok0, bar);
      tensor_load_2d(stage + L::X / 2, &maps.x, kb * 128 + 64, tok0, bar);
      tensor_load_2d(stage + L::X, code_map, kb * 64, first_row, bar);
    }
    if (ROWS == THREADS || (int)threadIdx.x < ROWS) {
      copy_async_8(stage + L::X + L::CODES + threadIdx.x * 8, scales + scale_src + kb * 8);
    }
  };

  float acc[MW][N / 2];
  #pragma unroll
  for (int mw = 0; mw < MW; ++mw)
    #pragma unroll
    for (int i = 0; i < N / 2; ++i) acc[mw][i] = 0.0f;

  // This thread's weight rows in the CTA tile: m64 tile mw, rows g and g + 8 of its warp's 16.
  const int warp_row = (warp >> 2) * 64 * MW + (warp & 3) * 16 + g;
  const int code_swizzle = (g >> 1) & 3;  // (r >> 1) & 3 of both rows

  #pragma unroll
  for (int i = 0; i < STAGES - 2; ++i) {
    if (i < count) issue_stage(i, kb_begin + i);
    copy_async_commit();
  }
  for (int i = 0; i < count; ++i) {
    copy_async_wait<STAGES - 3>();
    barrier_wait(bars + 8 * (i % STAGES), (i / STAGES) & 1);
    __syncthreads();  // stage i is in (scales: every thread's copy); block i - 2's wgmmas have retired
    if (i + STAGES - 2 < count) issue_stage((i + STAGES - 2) % STAGES, kb_begin + i + STAGES - 2);
    copy_async_commit();

    const int slot = i % STAGES;
    const unsigned char* stage = smem + slot * L::STAGE;
    const unsigned char* codes_of_stage = stage + L::X;
    const unsigned char* scales_of_stage = stage + L::X + L::CODES;
    const u64 x_descriptor = swizzled_descriptor(base + slot * L::STAGE);
    u32 scale_words[MW][2][2];  // [m64 tile][row half][word]: the row's 8 scales
    #pragma unroll
    for (int mw = 0; mw < MW; ++mw)
      #pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint2 v = *reinterpret_cast<const uint2*>(scales_of_stage + (warp_row + mw * 64 + h * 8) * 8);
        scale_words[mw][h][0] = v.x;
        scale_words[mw][h][1] = v.y;
      }
    // With NVFP4_WGMMA_PREFETCH the chunks' shared-memory reads run one chunk ahead of their decode: the wgmma fences
    // and waits are `asm volatile` with memory clobbers, which the compiler does not move loads across, so without it
    // each chunk's decode waits for its own reads (Nsight Compute, 7B gate/up at 64 rows: 8 % of the warps' stall
    // samples, short scoreboard at the PRMTs right after the reads).
    auto read_row = [&](int mw, int h, int c) {
      return chunk_bytes(codes_of_stage + (warp_row + mw * 64 + h * 8) * 64 + ((c ^ code_swizzle) * 16), t);
    };
    uint4 ahead[MW][2];
    if (NVFP4_WGMMA_PREFETCH) {
      #pragma unroll
      for (int mw = 0; mw < MW; ++mw)
        #pragma unroll
        for (int h = 0; h < 2; ++h) ahead[mw][h] = read_row(mw, h, 0);
    }
    #pragma unroll
    for (int c = 0; c < 4; ++c) {  // 16-byte chunk c of every row: steps 2c and 2c + 1
      uint4 bytes[MW][2];
      if (NVFP4_WGMMA_PREFETCH) {
        #pragma unroll
        for (int mw = 0; mw < MW; ++mw)
          #pragma unroll
          for (int h = 0; h < 2; ++h) {
            bytes[mw][h] = ahead[mw][h];
            if (c < 3) ahead[mw][h] = read_row(mw, h, c + 1);
          }
      }
      uint4 codes[MW][2];
      u32 scale[MW][2][2];  // [m64 tile][row half][step parity]
      #pragma unroll
      for (int mw = 0; mw < MW; ++mw)
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
          codes[mw][h] = chunk_codes<BF16>(NVFP4_WGMMA_PREFETCH ? bytes[mw][h] : read_row(mw, h, c));
          float lo, hi;
          e4m3x2_to_float(scale_words[mw][h][c >> 1] >> ((c & 1) * 16), lo, hi);
          scale[mw][h][0] = scale_pair<BF16>(lo);
          scale[mw][h][1] = scale_pair<BF16>(hi);
        }
      #pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int step = 2 * c + half;
        u32 a[MW][4];
        #pragma unroll
        for (int mw = 0; mw < MW; ++mw)
          #pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint4 v = codes[mw][h];
            if (NVFP4_WGMMA_PROFILE == 1) {  // the weights' codes as A, undecoded
              a[mw][h] = half ? v.z : v.x;
              a[mw][2 + h] = half ? v.w : v.y;
            } else {
              step_operands<BF16>(v, half, t, scale[mw][h][half], a[mw][h], a[mw][2 + h]);
            }
          }
        wgmma_fence();
        #pragma unroll
        for (int mw = 0; mw < MW; ++mw) {
          // step s: 32 bytes of each token's 128-byte row of the half (step >> 2) of the block
          wgmma<N, BF16>(acc[mw], a[mw][0], a[mw][1], a[mw][2], a[mw][3],
                         x_descriptor + ((u64)((step >> 2) * (L::X / 2) + (step & 3) * 32) >> 4));
        }
        wgmma_commit();
        wgmma_wait<wgmma_depth<N>()>();
      }
    }
  }
  wgmma_wait<0>();
  #pragma unroll
  for (int mw = 0; mw < MW; ++mw)
    #pragma unroll
    for (int i = 0; i < N / 2; ++i) pin(acc[mw][i]);
  copy_async_wait<0>();
  __syncthreads();  // the stages are free: the epilogue tile reuses them

  const float factor = (BF16 ? 9223372036854775808.0f : 16384.0f) / *seg.global_scale[s];
  const u16* bias = blockIdx.z == 0 ? seg.bias[s] : nullptr;
  float bias_of[MW][2];
  #pragma unroll
  for (int mw = 0; mw < MW; ++mw)
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + warp_row + mw * 64 + h * 8;
      bias_of[mw][h] = (bias != nullptr && row < rows) ? input_to_float<BF16>(bias[row]) : 0.0f;
    }
  store_tile<ROWS, N, THREADS, MW * N / 2, BF16>(
      smem, out, ldo, partial, seg, s, rows, row0, tok0, M, [&](int e, int& r, int& token) {
        const int mw = e / (N / 2), i = e % 4, j = (e % (N / 2)) / 4;  // acc[mw][4 j + i]: n8 column j
        r = warp_row + mw * 64 + (i >> 1) * 8;
        token = 8 * j + 2 * t + (i & 1);
        return acc[mw][e % (N / 2)] * factor + bias_of[mw][i >> 1];
      });
#else
  __trap();  // built for a target without wgmma: the launcher compiles this kernel for sm_90a only
#endif
}
