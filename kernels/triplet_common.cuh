// Shared device helpers and host declarations for fused_triplet.
//
// fused_triplet.py concatenates this header and every kernels/*.cu file into ONE translation unit
// (it drops the local #include lines), so everything here is visible to every .cu file.
#ifndef FUSED_TRIPLET_COMMON_CUH
#define FUSED_TRIPLET_COMMON_CUH

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cstdint>
#include <cstring>
#include <limits>
#include <array>
#include <tuple>
#include <type_traits>

namespace fused_triplet {

// Every kernel runs 256-thread blocks: enough warps per block to hide the row-end reduction,
// small enough that several blocks share an SM.
constexpr int kBlockThreads = 256;
constexpr int kVecBytes = 16;  // one 128-bit load per thread per input

// torch's norms accumulate fp16/bf16/fp32 in fp32 and fp64 in fp64; so do we.
template <typename T> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };
template <typename T> using acc_t = typename AccOf<T>::type;

// Reduction enum, the values torch uses (at::Reduction).
enum Reduction : int64_t { kNone = 0, kMean = 1, kSum = 2 };

// ---- loads ---------------------------------------------------------------------------------

template <typename T>
struct alignas(kVecBytes) Pack {
  static constexpr int kN = kVecBytes / sizeof(T);
  T v[kN];
};

// Every input byte is read exactly once: bypass L1 (no reuse) and use the read-only path.
__device__ __forceinline__ uint4 load_stream16(const void* ptr) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(ptr));
  return r;
}

// A plain global load (default L1 and L2 policy), as Triton emits for a pointwise kernel's
// inputs. The pointwise backward takes these: through the read-only no-allocate path above it
// measured 2% slower (kPointwisePlainLoads in triplet_backward.cu).
__device__ __forceinline__ uint4 load_plain16(const void* ptr) {
  uint4 r;
  asm("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(ptr));
  return r;
}

template <typename T, bool kPlain = false>
__device__ __forceinline__ Pack<T> load_pack(const T* ptr) {
  uint4 raw;
  if constexpr (kPlain) {
    raw = load_plain16(ptr);
  } else {
    raw = load_stream16(ptr);
  }
  Pack<T> out;
  memcpy(&out, &raw, sizeof(out));
  return out;
}

// ---- bulk async copies (sm_90 copy engine) and mbarriers ---------------------------------

__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(arrivals));
}
// Makes the barrier initialisation visible to the copy engine (the async proxy).
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  } while (!done);
}
// Global -> shared copy of `bytes` (a multiple of 16, both addresses 16-byte aligned) that
// signals `bar` when it lands.
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes,
                                              uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}

// Gradient stores. Plain stores measured 0.35% faster forward + backward than evict-first ones
// (st.global.cs) at (32768, 8192) fp32 on the H200 (2.3009 vs 2.3089 ms, 4 x 8 KiB backward
// ring), but made ptxas spill in the fp64 general-p backward kernel: fp64 keeps evict-first.
constexpr bool kPlainStores = true;  // false: evict-first for every type (A/B)
template <typename T>
__device__ __forceinline__ void store_pack(T* ptr, const Pack<T>& v) {
  uint4 raw;
  memcpy(&raw, &v, sizeof(raw));
  if constexpr (kPlainStores && sizeof(T) < 8) {
    *reinterpret_cast<uint4*>(ptr) = raw;
  } else {
    __stcs(reinterpret_cast<uint4*>(ptr), raw);
  }
}

template <typename A, typename T>
__device__ __forceinline__ A to_acc(T x) {
  return static_cast<A>(x);
}

// ---- NaN-propagating helpers (torch's max/min/clamp_min propagate NaN) --------------------

template <typename A>
__device__ __forceinline__ A max_nan(A a, A b) {
  return (a != a || a > b) ? a : b;
}
template <typename A>
__device__ __forceinline__ A min_nan(A a, A b) {
  return (a != a || a < b) ? a : b;
}
// clamp_min(v, 0) keeping NaN.
template <typename A>
__device__ __forceinline__ A hinge(A v) {
  return v < A(0) ? A(0) : v;
}

// Precision-exact math: the float overloads must not silently promote to double.
__device__ __forceinline__ float abs_acc(float a) { return fabsf(a); }
__device__ __forceinline__ double abs_acc(double a) { return fabs(a); }
__device__ __forceinline__ float sqrt_acc(float a) { return sqrtf(a); }
__device__ __forceinline__ double sqrt_acc(double a) { return sqrt(a); }
__device__ __forceinline__ float pow_acc(float a, float b) { return powf(a, b); }
__device__ __forceinline__ double pow_acc(double a, double b) { return pow(a, b); }

// ---- p-norms -------------------------------------------------------------------------------
// ||x||_p over a row, split in add (per element), combine (two partial states) and finish.
// p = 2 and p = 1 are compile-time fast paths; every other p (0, +-inf, any real) is one
// runtime-described kind, exactly as torch's norm kernels define them:
//   p = 0: number of non-zeros; p = +inf: max |x|; p = -inf: min |x|; else (sum |x|^p)^(1/p).

enum class NormKind : int { kTwo = 0, kOne = 1, kOther = 2 };
enum class OtherMode : int { kZero = 0, kInf = 1, kNegInf = 2, kPow = 3 };

template <typename A>
struct NormParams {
  OtherMode mode;
  A p;
  A inv_p;
};

template <typename A, NormKind K>
struct Norm {
  NormParams<A> prm;

  __device__ __forceinline__ A identity() const {
    if constexpr (K == NormKind::kOther) {
      return prm.mode == OtherMode::kNegInf ? std::numeric_limits<A>::infinity() : A(0);
    }
    return A(0);
  }
  __device__ __forceinline__ void add(A& s, A x) const {
    if constexpr (K == NormKind::kTwo) {
      s += x * x;
    } else if constexpr (K == NormKind::kOne) {
      s += abs_acc(x);
    } else {
      switch (prm.mode) {
        case OtherMode::kZero: s += (x == A(0)) ? A(0) : A(1); break;
        case OtherMode::kInf: s = max_nan(s, abs_acc(x)); break;
        case OtherMode::kNegInf: s = min_nan(s, abs_acc(x)); break;
        default: s += pow_acc(abs_acc(x), prm.p); break;
      }
    }
  }
  __device__ __forceinline__ A combine(A a, A b) const {
    if constexpr (K == NormKind::kOther) {
      if (prm.mode == OtherMode::kInf) return max_nan(a, b);
      if (prm.mode == OtherMode::kNegInf) return min_nan(a, b);
    }
    return a + b;
  }
  __device__ __forceinline__ A finish(A s) const {
    if constexpr (K == NormKind::kTwo) {
      return sqrt_acc(s);
    } else if constexpr (K == NormKind::kOther) {
      return prm.mode == OtherMode::kPow ? pow_acc(s, prm.inv_p) : s;
    }
    return s;
  }
};

// The three per-row partial states: d(a, p), d(a, n) and, with swap, d(p, n).
template <typename A>
struct RowSums {
  A ap, an, pn;
};

// Deterministic reduction of a RowSums over the TPR threads of one team (a team is TPR
// consecutive threads of the block, one team per row). Fixed shuffle/shared-memory order: the
// same inputs always give the same bits. All threads of the block must call it (it may hold a
// __syncthreads). The result is valid in the team's lane 0.
template <int TPR, typename A, NormKind K>
__device__ __forceinline__ RowSums<A> team_reduce(RowSums<A> s, const Norm<A, K>& norm,
                                                  RowSums<A>* smem) {
  constexpr int kWarpWidth = TPR < 32 ? TPR : 32;
#pragma unroll
  for (int offset = kWarpWidth / 2; offset > 0; offset /= 2) {
    s.ap = norm.combine(s.ap, __shfl_xor_sync(0xffffffffu, s.ap, offset));
    s.an = norm.combine(s.an, __shfl_xor_sync(0xffffffffu, s.an, offset));
    s.pn = norm.combine(s.pn, __shfl_xor_sync(0xffffffffu, s.pn, offset));
  }
  if constexpr (TPR > 32) {
    constexpr int kWarpsPerTeam = TPR / 32;
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) smem[warp] = s;
    __syncthreads();
    if (threadIdx.x % TPR == 0) {
      s = smem[warp];
#pragma unroll
      for (int w = 1; w < kWarpsPerTeam; ++w) {
        const RowSums<A> o = smem[warp + w];
        s.ap = norm.combine(s.ap, o.ap);
        s.an = norm.combine(s.an, o.an);
        s.pn = norm.combine(s.pn, o.pn);
      }
    }
    __syncthreads();  // smem is reused by the next row
  }
  return s;
}

// Deterministic block-wide sum in a fixed order; the result is valid in thread 0.
template <int kThreads, typename A>
__device__ __forceinline__ A block_sum(A v, A* smem) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  if (threadIdx.x % 32 == 0) smem[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    v = smem[0];
#pragma unroll
    for (int w = 1; w < kThreads / 32; ++w) v += smem[w];
  }
  return v;
}

// ---- launch heuristic (forward and backward) -----------------------------------------------

struct RowConfig {
  int threads_per_row;  // TPR: threads cooperating on one row
  int64_t grid;         // blocks
  int64_t splits;       // column slices per row, one block each (1: whole rows)
  int64_t split_elems;  // elements per slice
};

// Splitting rows: a whole-row block per row leaves the GPU idle when rows are few (16 rows of
// 4M fp32 ran at 0.5 TB/s), so rows fewer than kFillBlocks / 2 are cut into column slices.
//   kFillBlocks = 1024 blocks of 256 threads fill an H100/H200-class GPU (132 SMs x up to 8
//   resident blocks) with a tail to balance. A constant of the shape, not of the SM count: a
//   shape gets the same slices, so the same bits, on every GPU.
//   Slices of at least kMinSliceBytes = 32 KiB per input (8 x 16-byte packs per thread of each
//   input, two trips of the 4-deep unrolled loop): shorter rows are not worth a second pass.
//   Both constants began as guesses (scripts/variants.py has split_* variants).
//   kSplitBlocks = 512: the slices per row aim at half of kFillBlocks, fewer and longer slices
//   whose bulk-copy rings stream longer per block: (4, 16777216) bf16 forward 0.1122 ms against
//   0.1177 at 1024 (2048: 0.1324, 4096: 0.1521; torch.compile 0.1162; H200).
constexpr int64_t kFillBlocks = 1024;
constexpr int64_t kSplitBlocks = 512;
constexpr int64_t kMinSliceBytes = 32 * 1024;
constexpr int64_t kTeamFillBlocks = kFillBlocks;  // 0: team size from the row length alone

inline RowConfig choose_row_config(int64_t rows, int64_t dim, int64_t elem_size) {
  const int64_t packs = (dim * elem_size + kVecBytes - 1) / kVecBytes;
  // Threads per row: the smallest team that leaves each thread few packs per input, so short
  // rows do not leave most of a block idle and long rows get a whole block.
  //   <= 64 packs (1 KiB of fp32): 8 threads; <= 512 packs (8 KiB): a warp; else the block.
  // A team of 8 takes at most 8 packs per thread: at 16, (65536, 1024) bf16 (128 packs, 2048
  // blocks of 32 rows) ran its forward at 0.1164 ms against 0.1088 with a warp per row
  // (torch.compile 0.1084; H200).
  // A warp still takes up to 16: capping it at 8 (4-8 KiB rows to whole blocks, variant
  // tpr_8packs_warp) was far slower, (65536, 2048) fp32 0.5814 ms against 0.3910.
  RowConfig cfg;
  cfg.threads_per_row = packs <= 8 * 8 ? 8 : (packs <= 32 * 16 ? 32 : kBlockThreads);
  auto groups = [&](int tpr) { return (rows + kBlockThreads / tpr - 1) / (kBlockThreads / tpr); };
  // Few rows: the next bigger team while the grid has fewer than kTeamFillBlocks blocks and
  // each of its threads still gets a pack: (128, 4096) bf16 took a warp per row, 16 blocks for
  // 132 SMs (forward 0.0172 ms vs torch.compile's 0.0086); (1024, 128) fp32 8 threads, 32.
  while (cfg.threads_per_row < kBlockThreads && groups(cfg.threads_per_row) < kTeamFillBlocks) {
    const int bigger = cfg.threads_per_row == 8 ? 32 : kBlockThreads;
    if (packs < bigger) break;
    cfg.threads_per_row = bigger;
  }
  const int64_t row_groups = groups(cfg.threads_per_row);
  // One block per row group (the hardware balances the tail); past 2^20 blocks the grid-stride
  // loop takes over, which also bounds the per-block partial-sum buffer.
  cfg.grid = std::min<int64_t>(row_groups, int64_t(1) << 20);
  cfg.splits = 1;
  cfg.split_elems = dim;
  if (cfg.threads_per_row == kBlockThreads && rows < kFillBlocks / 2) {
    const int64_t row_bytes = dim * elem_size;
    const int64_t want = (kSplitBlocks + rows - 1) / rows;  // slices per row
    int64_t slice_bytes = std::max(kMinSliceBytes, (row_bytes + want - 1) / want);
    slice_bytes = (slice_bytes + kVecBytes - 1) / kVecBytes * kVecBytes;  // slices stay aligned
    const int64_t splits = (row_bytes + slice_bytes - 1) / slice_bytes;
    if (splits > 1) {
      cfg.splits = splits;
      cfg.split_elems = slice_bytes / elem_size;
      cfg.grid = std::min<int64_t>(rows * splits, int64_t(1) << 20);
    }
  }
  return cfg;
}

// The three inputs as (rows, dim) arrays plus the loss parameters: the part of the forward and
// backward kernels' arguments that is the same.
template <typename T>
struct TripletRows {
  const T* a;
  const T* p;
  const T* n;
  int64_t stride_a, stride_p, stride_n;  // row strides, elements (0: a broadcast row)
  int64_t rows, dim;
  bool vectorized;  // every row start 16-byte aligned: use 128-bit loads
  acc_t<T> margin, eps;
  NormParams<acc_t<T>> norm;
  int64_t splits;       // column slices per row, one block each (1: rows are not split)
  int64_t split_elems;  // elements per slice (a multiple of 16 bytes)
};

// ---- bulk-copy ring (sm_90): long aligned rows streamed through shared memory ------------------
// The copy engine streams each of a block's rows through a ring of kStages shared-memory stages
// (cp.async.bulk: one chunk of up to kChunkBytes per input per stage), so memory sees few, large
// requests and no registers hold data in flight; the whole block works on each stage from shared
// memory. One team (the block) per row or row slice (RowChunks), or per range of a flat
// contiguous array (FlatChunks), chunk after chunk.
//   Forward, 4-byte and wider elements: 4 stages x 3 inputs x 8 KiB = 96 KiB, 2 blocks per SM.
//   Measured at (32768, 8192) fp32 on the H200 (scripts/variants.py): 0.717 ms against 0.747 ms
//   for register loads; 2 x 16 KiB tied; 8 x 4 KiB and any 1-block-per-SM ring (6 x 8 KiB,
//   4 x 16 KiB) were 13-50% slower; a persistent grid 0.8% slower.
//   Forward, 2-byte elements: 4 x 4 KiB = 48 KiB, 4 blocks per SM. A bf16 row of 8192 is 2
//   chunks of 8 KiB per input, so each block's ring ran dry at each row's end; at (32768, 8192)
//   bf16: 4 x 4 KiB 0.3700 ms, 2 x 16 KiB 0.3879, register loads 0.3865, 2 persistent blocks
//   per SM 0.3748, 4 x 8 KiB 0.4005 (torch.compile 0.3845). Split rows (slices of >= 32 KiB,
//   so no ring runs dry) keep 4 x 8 KiB in every dtype: bf16 (4, 16777216) 0.1188 ms against
//   0.1216 / 0.1218 for 4 x 4 KiB, (16, 4194304) 0.1117 against 0.1148 / 0.1144.
//   Backward: 4 stages x 3 x 4 KiB = 48 KiB, 4 blocks per SM (more blocks keep more gradient
//   stores going while others wait on copies). Forward + backward at (32768, 8192) fp32:
//   4 x 4 KiB 2.281 ms, 6 x 4 KiB 2.281, 4 x 8 KiB 2.309, 3 x 8 KiB 2.317, 2 x 8 KiB 2.321;
//   register loads (no ring) 2.397-2.403.
constexpr int kForwardStages = 4;
template <typename T, bool kSplitRows>
constexpr int kForwardChunkBytes = sizeof(T) < 4 && !kSplitRows ? 4096 : 8192;
constexpr int kBackwardStages = 4;
constexpr int kBackwardChunkBytes = 4096;
constexpr int kBulkMinRowBytes = 8192;  // shorter rows: too few copies to be worth a ring
// The forward's ring for many short contiguous rows (triplet_forward_rows_ring_kernel): 8 KiB
// chunks of whole rows, for rows of 1 KiB (8 per chunk, a warp each) or 4 KiB (2 per chunk, 4
// warps each), from kRowsRingMinBytes per input (smaller inputs keep the team kernel's plain
// loads: each block would fill its ring for one or two chunks). Rows of 1-4 KiB ran at 3.99-4.06
// TB/s with plain loads (H200, fp32 forward) against the long-row ring's 4.58. This
// ring vs the team kernel (H200, forward ms): (262144, 256) fp32 0.1943 vs 0.2016,
// (65536, 1024) fp32 0.1909 vs 0.1985, (131072, 512) bf16 0.1082 vs 0.1097 (torch.compile
// 0.1968 / 0.1936 / 0.1094). But slower at 16 and 64 MiB per input, (16384, 256)
// fp32 0.0236 vs 0.0211, (65536, 256) fp32 0.0601 vs 0.0587, (16384, 1024) fp32 0.0603 vs
// 0.0586: the ring starts from 128 MiB per input (won at 128 MiB bf16, lost at 64 MiB fp32).
constexpr bool kRowsRing = true;  // false: the team kernel (A/B)
constexpr int kRowsRingChunkBytes = 8192;
constexpr int64_t kRowsRingMinBytes = int64_t(128) << 20;

// Where chunk c of a block's sequence lies: element offsets in a, p, n and in the contiguous
// (rows, dim) gradients / flat view, and its length.
struct ChunkAt {
  int64_t off_a, off_p, off_n;
  int64_t flat;             // row * dim + first column: the offset in a contiguous layout
  int64_t elems;            // <= the chunk's capacity; 0 for none
};

// Units b, b + grid, ... of block b, each cut into chunks (rows of any stride). A unit is
// slice u % splits of row u / splits: columns [slice * split_elems, + split_elems), the whole
// row when splits = 1. A row's last slice may be shorter: its missing chunks are empty.
// kFromEnd: the same units counted from the last one down (BackwardRowChunks, the backward's:
// kBackwardFromEnd); a compile-time choice, so the in-order walk costs nothing more.
template <typename T, int64_t kChunkElems, bool kFromEnd>
struct RowChunksOf {
  int64_t per_unit, units, total;  // chunks per unit; this block's units; their chunks
  int64_t last_unit;               // the last unit of all (kFromEnd only)
  __device__ __forceinline__ explicit RowChunksOf(const TripletRows<T>& args) {
    per_unit = (args.split_elems + kChunkElems - 1) / kChunkElems;
    const int64_t all_units = args.rows * args.splits;
    units = all_units > blockIdx.x ? (all_units - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
    total = units * per_unit;
    last_unit = all_units - 1;
  }
  // The block's i-th unit.
  __device__ __forceinline__ int64_t unit(int64_t i) const {
    const int64_t j = blockIdx.x + i * int64_t(gridDim.x);
    return kFromEnd ? last_unit - j : j;
  }
  // A unit's row and column range [first, end). No division for unsplit rows.
  struct Span {
    int64_t row, first, end;
  };
  __device__ __forceinline__ Span span(const TripletRows<T>& args, int64_t u) const {
    if (args.splits == 1) return {u, 0, args.dim};
    const int64_t row = u / args.splits;
    const int64_t first = (u - row * args.splits) * args.split_elems;
    return {row, first, min(first + args.split_elems, args.dim)};
  }
  // Chunk k of a unit: elements [col, col + chunk_elems(...)) of the row.
  __device__ __forceinline__ static int64_t chunk_elems(const Span& sp, int64_t col) {
    return max(int64_t(0), min(kChunkElems, sp.end - col));
  }
  __device__ __forceinline__ ChunkAt at(const TripletRows<T>& args, int64_t c) const {
    const int64_t i = c / per_unit;
    const int64_t u = unit(i);
    const Span sp = span(args, u);
    const int64_t col = sp.first + (c - i * per_unit) * kChunkElems;
    return {sp.row * args.stride_a + col, sp.row * args.stride_p + col,
            sp.row * args.stride_n + col, sp.row * args.dim + col, chunk_elems(sp, col)};
  }
};

template <typename T, int64_t kChunkElems>
using RowChunks = RowChunksOf<T, kChunkElems, false>;

// Contiguous inputs seen as one flat array of rows * dim elements: block b streams chunks
// [b * per_block, (b + 1) * per_block) of it, across row boundaries.
template <typename T, int64_t kChunkElems>
struct FlatChunks {
  int64_t first, total;
  __device__ __forceinline__ FlatChunks(const TripletRows<T>& args, int64_t per_block) {
    const int64_t chunks = (args.rows * args.dim + kChunkElems - 1) / kChunkElems;
    first = int64_t(blockIdx.x) * per_block;
    total = max(int64_t(0), min(per_block, chunks - first));
  }
  __device__ __forceinline__ ChunkAt at(const TripletRows<T>& args, int64_t c) const {
    const int64_t flat = (first + c) * kChunkElems;
    return {flat, flat, flat, flat, min(kChunkElems, args.rows * args.dim - flat)};
  }
};

template <typename T, int kStages, int kChunkBytes, template <typename, int64_t> class Chunks>
struct BulkRing {
  static constexpr int kSmemBytes = kStages * 3 * kChunkBytes;  // dynamic shared memory
  static constexpr int64_t kChunkElems = kChunkBytes / sizeof(T);
  unsigned char* stages;  // [kStages][3][kChunkBytes]: a, p, n of one chunk per stage
  uint64_t* full;         // [kStages] mbarriers: the stage's copies have landed
  using Order = Chunks<T, kChunkElems>;
  Order chunks;  // which chunks, in order (chunks.total of them)

  // Every thread of the block constructs it (it holds a barrier); thread 0 starts the copies.
  __device__ __forceinline__ BulkRing(const TripletRows<T>& args, unsigned char* stage_mem,
                                      uint64_t* barriers, const Order& order)
      : stages(stage_mem), full(barriers), chunks(order) {
    if (threadIdx.x == 0) {
      for (int st = 0; st < kStages; ++st) mbarrier_init(&full[st], 1);
      fence_barrier_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int64_t c = 0; c < min(int64_t(kStages), chunks.total); ++c) issue(args, c);
    }
  }
  __device__ __forceinline__ void issue(const TripletRows<T>& args, int64_t c) {
    const int stage = c % kStages;
    const ChunkAt at = chunks.at(args, c);
    const uint32_t bytes = static_cast<uint32_t>(at.elems * sizeof(T));
    unsigned char* dst = stages + stage * 3 * kChunkBytes;
    if (bytes == 0) {  // an empty chunk (a row's short last slice): the arrival completes it
      mbarrier_arrive(&full[stage]);
      return;
    }
    mbarrier_arrive_expect_tx(&full[stage], 3 * bytes);
    bulk_copy_g2s(dst, args.a + at.off_a, bytes, &full[stage]);
    bulk_copy_g2s(dst + kChunkBytes, args.p + at.off_p, bytes, &full[stage]);
    bulk_copy_g2s(dst + 2 * kChunkBytes, args.n + at.off_n, bytes, &full[stage]);
  }
  // Waits until chunk c is in shared memory; returns its stage.
  __device__ __forceinline__ const unsigned char* wait(int64_t c) {
    const int stage = c % kStages;
    mbarrier_wait(&full[stage], static_cast<uint32_t>((c / kStages) & 1));
    return stages + stage * 3 * kChunkBytes;
  }
  // The 16-byte pack v of input k (0: a, 1: p, 2: n) in a stage.
  __device__ __forceinline__ Pack<T> pack(const unsigned char* stage, int k, int v) const {
    Pack<T> out;
    memcpy(&out, stage + k * kChunkBytes + v * kVecBytes, kVecBytes);
    return out;
  }
  // Every thread is done with chunk c: its stage takes chunk c + kStages.
  __device__ __forceinline__ void release(const TripletRows<T>& args, int64_t c) {
    __syncthreads();
    if (threadIdx.x == 0 && c + kStages < chunks.total) issue(args, c + kStages);
  }
};

inline int compute_capability_major(const at::Tensor& on) {
  int major = 0;
  C10_CUDA_CHECK(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, on.get_device()));
  return major;
}

// Rows of at least one full chunk per input, 16-byte aligned and a 16-byte multiple long, on
// sm_90+, whose rows (or row slices) get a whole block: the copy engine needs the alignments.
inline bool use_bulk_kernel(const RowConfig& cfg, int64_t dim, int64_t elem_size,
                            bool vectorized, const at::Tensor& on) {
  return vectorized && cfg.threads_per_row == kBlockThreads &&
         (dim * elem_size) % kVecBytes == 0 && dim * elem_size >= kBulkMinRowBytes &&
         compute_capability_major(on) >= 9;
}

// ---- chained launches (sm_90 programmatic dependent launch) -------------------------------------
// A reduction's one-block follow-up kernel (the forward's sum of block sums, or its combining of
// split rows) normally starts only after the main grid has finished and the launch gap has
// passed; at (128, 4096) the whole forward is ~10 us, so that gap counts. With programmatic
// dependent launch the follow-up is scheduled once every block of the main grid has started
// (allow_follow_up, at each main kernel's start) and waits in wait_for_main_grid until the main
// grid has finished and its writes are visible: same order, same results, less gap. Both are
// no-ops when the launch did not ask for it and compile to nothing before sm_90.
// kChainFollowUps: H200 forward 'mean', chained vs not: (128, 4096) fp32 0.0093 vs 0.0108 ms,
// bf16 0.0091 vs 0.0100, (1024, 128) fp32 0.0069 vs 0.0084 (variant unchain_follow_ups).
constexpr bool kChainFollowUps = true;

__device__ __forceinline__ void allow_follow_up() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kChainFollowUps) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_main_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kChainFollowUps) asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Launches a one-block follow-up kernel after the main grid on `stream`: chained on sm_90+ when
// kChainFollowUps, a plain launch otherwise.
template <typename... Params, typename... Args>
void launch_follow_up(void (*kernel)(Params...), int threads, cudaStream_t stream,
                      const at::Tensor& on, const Args&... args) {
  if (kChainFollowUps && compute_capability_major(on) >= 9) {
    cudaLaunchAttribute chain[1];
    chain[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    chain[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(1);
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = 0;
    config.stream = stream;
    config.attrs = chain;
    config.numAttrs = 1;
    C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...));
  } else {
    kernel<<<1, threads, 0, stream>>>(args...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// Launches a bulk-copy kernel with its ring's shared memory (above the 48 KiB default).
template <typename... Params, typename... Args>
void launch_bulk(void (*kernel)(Params...), int smem_bytes, int64_t grid, cudaStream_t stream,
                 const Args&... args) {
  C10_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  kernel<<<grid, kBlockThreads, smem_bytes, stream>>>(args...);
}

// Calls launch(kind, threads_per_row, swap) with each runtime choice as a compile-time constant
// (std::integral_constant), so one switch serves every kernel family.
template <typename Launch>
void dispatch_row_kernel(NormKind kind, int threads_per_row, bool swap, const Launch& launch) {
  auto with_swap = [&](auto k, auto tpr) {
    if (swap) {
      launch(k, tpr, std::true_type{});
    } else {
      launch(k, tpr, std::false_type{});
    }
  };
  auto with_tpr = [&](auto k) {
    switch (threads_per_row) {
      case 8: with_swap(k, std::integral_constant<int, 8>{}); break;
      case 32: with_swap(k, std::integral_constant<int, 32>{}); break;
      default: with_swap(k, std::integral_constant<int, kBlockThreads>{}); break;
    }
  };
  switch (kind) {
    case NormKind::kTwo: with_tpr(std::integral_constant<NormKind, NormKind::kTwo>{}); break;
    case NormKind::kOne: with_tpr(std::integral_constant<NormKind, NormKind::kOne>{}); break;
    default: with_tpr(std::integral_constant<NormKind, NormKind::kOther>{}); break;
  }
}

// ---- host helpers ----------------------------------------------------------------------------

// (rows, dim) view with unit element stride; a view whenever the batch dims collapse to one
// row stride (contiguous, x[:, :D] of a wider tensor, a broadcast row), a copy otherwise.
inline at::Tensor as_rows(const at::Tensor& x, int64_t rows, int64_t dim) {
  at::Tensor r = x.reshape({rows, dim});
  if (dim > 1 && r.stride(1) != 1) r = r.contiguous();
  return r;
}

inline bool rows_aligned(const at::Tensor& r) {
  const auto addr = reinterpret_cast<std::uintptr_t>(r.data_ptr());
  const bool stride_ok = r.size(0) <= 1 || (r.stride(0) * r.element_size()) % kVecBytes == 0;
  return addr % kVecBytes == 0 && stride_ok;
}

template <typename A>
inline NormParams<A> norm_params(double p) {
  NormParams<A> prm;
  prm.p = static_cast<A>(p);
  prm.inv_p = static_cast<A>(1.0 / p);
  if (p == 0.0) {
    prm.mode = OtherMode::kZero;
  } else if (std::isinf(p)) {
    prm.mode = p > 0 ? OtherMode::kInf : OtherMode::kNegInf;
  } else {
    prm.mode = OtherMode::kPow;
  }
  return prm;
}

inline NormKind norm_kind(double p) {
  if (p == 2.0) return NormKind::kTwo;
  if (p == 1.0) return NormKind::kOne;
  return NormKind::kOther;
}

template <typename T>
TripletRows<T> make_triplet_rows(const at::Tensor& a, const at::Tensor& p, const at::Tensor& n,
                                 bool vectorized, const RowConfig& cfg, double margin, double eps,
                                 double pnorm) {
  TripletRows<T> r;
  r.a = a.const_data_ptr<T>();
  r.p = p.const_data_ptr<T>();
  r.n = n.const_data_ptr<T>();
  r.stride_a = a.stride(0);
  r.stride_p = p.stride(0);
  r.stride_n = n.stride(0);
  r.rows = a.size(0);
  r.dim = a.size(1);
  r.vectorized = vectorized;
  r.margin = static_cast<acc_t<T>>(margin);
  r.eps = static_cast<acc_t<T>>(eps);
  r.norm = norm_params<acc_t<T>>(pnorm);
  r.splits = cfg.splits;
  r.split_elems = cfg.split_elems;
  return r;
}

inline void check_triplet_inputs(const at::Tensor& a, const at::Tensor& p, const at::Tensor& n,
                                 double pnorm, int64_t reduction) {
  TORCH_CHECK(reduction >= kNone && reduction <= kSum, "fused_triplet: unknown reduction ",
              reduction);
  TORCH_CHECK(a.is_cuda() && p.device() == a.device() && n.device() == a.device(),
              "fused_triplet: anchor, positive and negative must be on one CUDA device, got ",
              a.device(), ", ", p.device(), ", ", n.device());
  TORCH_CHECK(p.scalar_type() == a.scalar_type() && n.scalar_type() == a.scalar_type(),
              "fused_triplet: anchor, positive and negative must have one dtype, got ",
              a.scalar_type(), ", ", p.scalar_type(), ", ", n.scalar_type());
  TORCH_CHECK(at::isFloatingType(a.scalar_type()),
              "fused_triplet: expected a floating point dtype, got ", a.scalar_type());
  TORCH_CHECK(a.dim() >= 1, "fused_triplet: expected inputs with at least 1 dimension");
  TORCH_CHECK(p.sizes() == a.sizes() && n.sizes() == a.sizes(),
              "fused_triplet: anchor, positive and negative must have one shape (broadcast "
              "them first), got ", a.sizes(), ", ", p.sizes(), ", ", n.sizes());
  TORCH_CHECK(!(a.size(-1) == 0 && std::isinf(pnorm)),
              "linalg.vector_norm cannot compute the inf norm on an empty tensor because the "
              "operation does not have an identity");
}


// ---- host entry points (defined in the .cu files, registered in register_ops.cu) -----------

std::tuple<at::Tensor, at::Tensor> triplet_margin_loss_cuda(const at::Tensor& anchor,
                                                            const at::Tensor& positive,
                                                            const at::Tensor& negative,
                                                            double margin, double p, double eps,
                                                            bool swap, int64_t reduction);

std::tuple<at::Tensor, at::Tensor, at::Tensor> triplet_margin_loss_backward_cuda(
    const at::Tensor& grad, const at::Tensor& anchor, const at::Tensor& positive,
    const at::Tensor& negative, const at::Tensor& dists, double margin, double p, double eps,
    bool swap, int64_t reduction, bool hinge_at_zero, std::array<bool, 3> output_mask);

// The Autograd-key kernel of triplet_margin_loss, and the clamp_min convention its backward
// follows (triplet_autograd.cu).
std::tuple<at::Tensor, at::Tensor> triplet_margin_loss_autograd(
    const at::Tensor& anchor, const at::Tensor& positive, const at::Tensor& negative,
    double margin, double p, double eps, bool swap, int64_t reduction);
void set_hinge_at_zero(bool value);

}  // namespace fused_triplet

#endif  // FUSED_TRIPLET_COMMON_CUH
