// fused_triplet's kernels and the plan that picks them.
//
// Forward: each row i gives d(a_i, p_i), d(a_i, n_i) (and with swap d(p_i, n_i)), where
// d(x, y) = ||x - y + eps||_p, then loss_i = max(margin + d_ap - min(d_an, d_pn), 0). One pass
// over the inputs writes the per-row distances (what the backward needs: B values each, never
// B x D) and the losses ('none') or one sum per block; a one-block finishing kernel adds the block
// sums in a fixed order ('mean' / 'sum') and, for rows split into column slices, first combines
// the slices. No atomics: the same inputs always give the same bits.
//   forward_rows_kernel   register loads; teams of 8, 32 or 256 threads per row; any layout.
//   forward_ring_kernel   sm_90: the copy engine streams the rows through shared memory (rows of
//                         >= 8 KiB; float32 inputs of >= 256 MiB in tiles of row groups).
//   forward_finish_kernel slices -> distances and losses; block sums -> 'mean' / 'sum'.
//   forward_one_pass_kernel training: the rows kernel's loads kept in registers, then the
//                         gradients for an upstream gradient of 1 (see "One pass" below).
// The main kernels give a thread the same elements in the same order and reduce in the same
// tree, so where two can take an input they give the same bits (tests/test_families.py).
//
// Backward: nothing B x D was saved. Per row the gradient is
//   dL/da = c_ap f(u_ap) + c_an f(u_an),  dL/dp = -c_ap f(u_ap) + c_pn f(u_pn),
//   dL/dn = -c_an f(u_an) - c_pn f(u_pn),      u_xy = x - y + eps (recomputed as forward did),
// with f the p-norm's element derivative and c_xy a per-row scale built from the upstream
// gradient, the hinge, the swap choice and d_xy, following torch's autograd formulas:
//   clamp_min: gradient where margin + d_ap - d_neg > 0 (and at exactly 0 as the installed torch
//   does: hinge_at_zero); minimum (swap): to the smaller distance, half each on a tie, both when
//   NaN; norms: p = 2 u / d (0 where d = 0); p = 1 sgn(u); p = +-inf sgn(u) / #ties on the
//   entries equal to the norm (or NaN); p = 0 none; p < 1 sgn(u) |u|^(p-1) (0 at u = 0) d^(1-p);
//   1 < p < 2 sgn(u) |u|^(p-1) / d^(p-1); p >= 2 u |u|^(p-2) / d^(p-1) (0 where d = 0).
//   backward_pointwise_kernel p = 1 or 2, 16-byte aligned rows: elementwise, as Triton's.
//   backward_rows_kernel      the rest (any p: inf-norm ties need a pass over the row first).
//
// One pass: under autograd with 'mean' or 'sum', a row's gradient needs only the row and its
// distances, so forward_one_pass_kernel writes it as if the upstream gradient were 1 while it
// still holds the row (6.44 GB at (32768, 8192) fp32 instead of 9.66). The backward then only
// applies the upstream gradient, in place (backward_rows_kernel's in_place mode; nothing when it
// is 1). Float and bfloat16 'mean' / 'sum' gradients are therefore upstream x (the local
// gradient, rounded) in every path, so that every path gives the same bits. Each backward notes
// whether its upstream gradient was 1 (upstream_flag, host memory); the next forward reads it.
#include "triplet_launch.h"
#include "triplet_device.cuh"

#include <cudaTypedefs.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <climits>
#include <string>
#include <type_traits>

namespace fused_triplet {

// ==== The launch table: every threshold the plans use, with its reason. =========================
// Measured on the H200 (docs/performance.md has the numbers and the method).
// Rows of <= 64 packs (1 KiB) get teams of 8 threads, <= 8 packs each: at 16 packs, (65536, 1024)
// bf16 ran 0.1164 ms against 0.1088 with a warp per row.
constexpr int64_t kTeam8MaxPacks = 64;
// Rows of <= 512 packs (8 KiB) get a warp, <= 16 packs each: capping a warp at 8 packs (longer
// rows to whole blocks) was far slower, (65536, 2048) fp32 0.5814 ms against 0.3910.
constexpr int64_t kWarpMaxPacks = 512;
// Blocks that fill an H100/H200-class GPU (132 SMs x up to 8 blocks) with a tail to balance. A
// constant of the shape, not of the GPU: a shape gets the same teams, slices and bits everywhere.
// Fewer row groups than this: the next bigger team ((128, 4096) bf16 ran 16 blocks of warps,
// 0.0172 ms against torch.compile's 0.0086). Fewer rows than half of it: rows split in slices
// (16 rows of 4M fp32 ran at 0.5 TB/s unsplit).
constexpr int64_t kFillBlocks = 1024;
// Split rows aim at this many slices, each of at least 32 KiB per input (shorter ones are not
// worth a second pass): (4, 16777216) bf16 0.1122 ms against 0.1177 aiming at 1024.
constexpr int64_t kSplitBlocks = 512;
constexpr int64_t kMinSliceBytes = 32 * 1024;
// Past this many blocks a kernel's blocks loop over units; bounds the block-sum buffer too.
constexpr int64_t kMaxGrid = int64_t(1) << 20;
// The forward ring for whole-block teams from rows of 8 KiB (sm_90, 16-byte aligned): (32768,
// 8192) fp32 0.7146 ms against 0.7456 with register loads, bf16 0.3699 against 0.3856.
constexpr int64_t kRingMinRowBytes = 8192;
// Teams of 8 and 32 (float32) from 256 MiB per input, rows a whole number of stages: (65536, 1024)
// 0.1941 ms against 0.2002, (262144, 256) 0.1979 against 0.2023, (32768, 2048) 0.1944 against
// 0.2042; at 128 MiB even, at 64 MiB 7% slower, rows ending mid-stage ((131072, 384)) 31% slower.
constexpr int64_t kRingTilesMinInputBytes = int64_t(256) << 20;
// 4 stages x 3 inputs x 8 KiB = 96 KiB: 2 blocks per SM (rings of 1 block per SM: 13-50% slower).
// 2-byte whole rows take 4 KiB chunks: a bf16 row of 8192 is only 2 chunks of 8 KiB, and each
// block's ring ran dry at each row's end ((32768, 8192) bf16 0.3700 ms against 0.4005).
constexpr int kRingStages = 4;
constexpr int kRingChunkBytes = 8192;
constexpr int kRingChunkBytesShortElems = 4096;
// Smaller teams take each stage as one tile (rows x columns) of each input; a tile's row is at
// most 256 elements (the copy engine's limit).
constexpr int64_t kTileMaxCols = 256;
// The pointwise backward as Triton's: 128-thread blocks, 2 packs of each input per thread, all
// loads first ((4096, 512) bf16 fwd+bwd 0.0208 ms against 0.0221 with 1 pack).
constexpr int kPointwiseThreads = 128;
constexpr int kPointwisePacks = 2;
// Without swap it fits 64 registers: 8 blocks per SM (at 67, 7 blocks: weighted bf16 fwd+bwd
// ran 3-8% slower); with swap it needs more (64 spills).
constexpr int kPointwiseMinBlocks = 8;
// Its pack indices are 32-bit: larger inputs take the rows kernel.
constexpr int64_t kPointwiseMaxPacks = int64_t(1) << 31;
// The finishing kernel: one block; its input is at most kMaxGrid block sums or 512 split rows.
constexpr int kFinishThreads = 1024;
// One pass: a thread keeps its packs of each input (in shared memory, 12 KiB per block per
// pack) until its row's distances are known. At most 16, where the GPU's shared memory per block
// holds them (16 on an H100/H200: 192 KiB, 1 block per SM; (32768, 2048) fp32 fwd+bwd 0.692x
// the two passes' time, as 8 packs at 2 blocks per SM gave at (32768, 8192)); longer rows take
// two passes. A block's own static shared memory stays under kOnePassStaticSmem.
constexpr int64_t kOnePassPacks = 16;
constexpr int64_t kOnePassStaticSmem = 1024;
// Its registers: 64 (4 blocks' worth), no spills; shared memory holds 1-2 blocks per SM anyway, so
// the cap only keeps the compiler from spending more (not timed against other caps).
constexpr int kOnePassMinBlocks = 4;
// The one pass's backward loops over the gradients with this many blocks: when the upstream
// gradient is 1 they only read it and exit.
constexpr int kUpstreamBlocks = 1024;

// ==== Forward ======================================================================================

template <typename T>
struct ForwardArgs {
  const T* a;
  const T* p;
  const T* n;
  int64_t stride_a, stride_p, stride_n;  // row strides, elements (0: a broadcast row)
  int64_t rows, dim;
  int64_t splits, split_elems;  // column slices per row (1: whole rows), elements per slice
  int64_t units;                // row groups (or slices) the blocks share
  int tpr;                      // threads per row
  int chunk_bytes;              // ring: bytes of each input per stage
  bool vectorized;              // every row start 16-byte aligned
  bool swap;
  acc_t<T> eps;
  sum_t<T> margin;
  NormParams norm;
  T* loss_rows;          // [rows] ('none'), or null
  acc_t<T>* dists;       // [2 or 3, rows]: d_ap, d_an (, d_pn with swap)
  sum_t<T>* block_sums;  // [gridDim.x] each block's sum of losses ('mean' / 'sum'), or null
  sum_t<T>* partials;    // split rows: [3, rows * splits] each slice's partial sums
};

// The row (or row group) of a unit. Split rows are fewer than kFillBlocks / 2 with at most
// kSplitBlocks slices: 32-bit division, inline (a 64-bit one is a call, whose saved registers spill).
__device__ __forceinline__ int64_t split_group(int64_t unit, int64_t splits) {
  return splits == 1 ? unit : int64_t(uint32_t(unit) / uint32_t(splits));
}

// One element of each difference, x - y + eps, as torch computes it.
template <typename T, NormKind K>
__device__ __forceinline__ void accumulate3(const Norm<T, K>& norm, RowSums<sum_t<T>>& s,
                                            acc_t<T> xa, acc_t<T> xp, acc_t<T> xn, acc_t<T> eps,
                                            bool swap) {
  norm.add(s.ap, xa - xp + eps);
  norm.add(s.an, xa - xn + eps);
  if (swap) norm.add(s.pn, xp - xn + eps);
}

template <typename T, NormKind K>
__device__ __forceinline__ void accumulate_packs(const Norm<T, K>& norm, RowSums<sum_t<T>>& s,
                                                 const Pack<T>& a, const Pack<T>& p,
                                                 const Pack<T>& n, acc_t<T> eps, bool swap) {
#pragma unroll
  for (int j = 0; j < Pack<T>::kN; ++j) {
    accumulate3(norm, s, to_acc(a.v[j]), to_acc(p.v[j]), to_acc(n.v[j]), eps, swap);
  }
}

// A row's (or slice's) distances and loss, once its sums are reduced.
template <typename T, typename N>
__device__ __forceinline__ void finish_row(const ForwardArgs<T>& args, const N& norm,
                                           const RowSums<sum_t<T>>& s, int64_t row,
                                           sum_t<T>& loss_sum) {
  using S = sum_t<T>;
  using A = acc_t<T>;
  const S d_ap = norm.finish(s.ap);
  const S d_an = norm.finish(s.an);
  S d_neg = d_an;
  args.dists[row] = static_cast<A>(d_ap);
  args.dists[args.rows + row] = static_cast<A>(d_an);
  if (args.swap) {
    const S d_pn = norm.finish(s.pn);
    args.dists[2 * args.rows + row] = static_cast<A>(d_pn);
    d_neg = min_nan(d_an, d_pn);
  }
  const S loss = hinge(args.margin + d_ap - d_neg);
  if (args.loss_rows != nullptr) args.loss_rows[row] = from_acc<T>(loss);
  loss_sum += loss;
}

// What a unit (a row, or one slice of a split row) leaves once reduced. kWholeRows: the launch
// never splits rows (the code for slices compiles away).
template <bool kWholeRows = false, typename T, typename N>
__device__ __forceinline__ void write_unit(const ForwardArgs<T>& args, const N& norm,
                                           const RowSums<sum_t<T>>& s, int64_t row, int64_t slice,
                                           sum_t<T>& loss_sum) {
  if (kWholeRows || args.splits == 1) {
    finish_row(args, norm, s, row, loss_sum);
    return;
  }
  const int64_t count = args.rows * args.splits;
  const int64_t at = row * args.splits + slice;
  args.partials[at] = s.ap;
  args.partials[count + at] = s.an;
  args.partials[2 * count + at] = s.pn;
}

// The end of a forward block: lane 0 of each team holds its rows' loss sum; their sum in a fixed
// order is the block's (kTPR: the team size when compiled in; a whole-block team's thread 0
// holds it).
template <int kTPR, typename T>
__device__ __forceinline__ void write_block_sum(const ForwardArgs<T>& args, int lane,
                                                sum_t<T> loss_sum) {
  __shared__ sum_t<T> smem_sum[kBlockThreads / 32];
  if (args.block_sums == nullptr) return;  // uniform
  if (kTPR == kBlockThreads) {
    if (threadIdx.x == 0) args.block_sums[blockIdx.x] = loss_sum;
    return;
  }
  const sum_t<T> total = block_sum<kBlockThreads>(lane == 0 ? loss_sum : sum_t<T>(0), smem_sum);
  if (threadIdx.x == 0) args.block_sums[blockIdx.x] = total;
}

// One thread's share of columns [first, first + len) of a row: packs lane, lane + tpr, ... in
// order (so a team's loads are coalesced), elements one by one where rows are not aligned.
// kTPR: the team size as a compile-time constant (0: args.tpr), so that the unrolled loads'
// offsets are immediates rather than a register each.
template <int kTPR, typename T, NormKind K, bool kSwap>
__device__ __forceinline__ void accumulate_slice(const ForwardArgs<T>& args, const Norm<T, K>& norm,
                                                 int64_t row, int64_t first, int64_t len,
                                                 int lane, RowSums<sum_t<T>>& s) {
  using A = acc_t<T>;
  constexpr int kVec = Pack<T>::kN;
  // 4 packs per input in flight per thread: enough to cover DRAM latency at the occupancy the
  // registers allow. General p calls pow (a subroutine): unrolled, it spills, and gains nothing.
  constexpr int kUnroll = K == NormKind::kOther ? 1 : 4;
  const int tpr = kTPR != 0 ? kTPR : args.tpr;
  const T* a = args.a + row * args.stride_a + first;
  const T* p = args.p + row * args.stride_p + first;
  const T* n = args.n + row * args.stride_n + first;
  const A eps = args.eps;
  int64_t i = lane;  // element index of the tail / unaligned loop
  if (args.vectorized) {
    const int64_t packs = len / kVec;
    int64_t v = lane;
    for (; v + (kUnroll - 1) * tpr < packs; v += kUnroll * tpr) {
      Pack<T> pa[kUnroll], pp[kUnroll], pn[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        pa[u] = load_stream(a + (v + u * tpr) * kVec);
        pp[u] = load_stream(p + (v + u * tpr) * kVec);
        pn[u] = load_stream(n + (v + u * tpr) * kVec);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) accumulate_packs(norm, s, pa[u], pp[u], pn[u], eps, kSwap);
    }
    for (; v < packs; v += tpr) {
      accumulate_packs(norm, s, load_stream(a + v * kVec), load_stream(p + v * kVec),
                       load_stream(n + v * kVec), eps, kSwap);
    }
    i = packs * kVec + lane;
  } else {
    for (; i + (kUnroll - 1) * tpr < len; i += kUnroll * tpr) {  // several loads in flight
      A xa[kUnroll], xp[kUnroll], xn[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        xa[u] = to_acc(a[i + u * tpr]);
        xp[u] = to_acc(p[i + u * tpr]);
        xn[u] = to_acc(n[i + u * tpr]);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) accumulate3(norm, s, xa[u], xp[u], xn[u], eps, kSwap);
    }
  }
  for (; i < len; i += tpr) accumulate3(norm, s, to_acc(a[i]), to_acc(p[i]), to_acc(n[i]), eps, kSwap);
}

// Units are groups of kBlockThreads / tpr rows, or (tpr = the block) slices of rows; block b takes
// units b, b + grid, ...
// kTPR: 8 or 32 (a team's loads at immediate offsets; such teams never split rows), or 0 for
// the team size of the launch (general p, double, and whole-block teams).
// kSwap: whether d(p, n) is summed, a template parameter in the main kernels: at run time the
// compiler keeps its instructions in every loop, predicated off (a third more instructions in
// the bf16 pointwise backward, 5% slower at (32768, 8192) fwd+bwd; H200).
// Blocks per SM the registers must allow: the most without spills. Fixed teams on sm_90 at 4
// (64 registers; half at 3), as many warps as the kernels this one replaced; other targets at 3.
// ptxas's own target spills a few bytes in some, and at 3 (80 registers) (4096, 512) bf16 ran 10%
// and (131072, 384) fp32 8% slower on the H200. Run-time teams at 2.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ != 900
template <typename T, int kTPR>
constexpr int kRowsMinBlocks = kTPR == 0 ? 2 : 3;
#else
template <typename T, int kTPR>
constexpr int kRowsMinBlocks = kTPR == 0 ? 2 : std::is_same<T, __half>::value ? 3 : 4;
#endif

template <typename T, NormKind K, bool kSwap, int kTPR>
__global__ void __launch_bounds__(kBlockThreads, kRowsMinBlocks<T, kTPR>)
    forward_rows_kernel(const ForwardArgs<T> args) {
  allow_follow_up();
  using S = sum_t<T>;
  __shared__ RowSums<S> smem_rows[kBlockThreads / 32];
  const Norm<T, K> norm(args.norm);
  const int tpr = kTPR != 0 ? kTPR : args.tpr;
  const int team = threadIdx.x / tpr;
  const int lane = threadIdx.x % tpr;
  const int rows_per_unit = kBlockThreads / tpr;
  const int64_t splits = kTPR != 0 ? 1 : args.splits;
  S loss_sum = S(0);
  for (int64_t unit = blockIdx.x; unit < args.units; unit += gridDim.x) {  // block-uniform bounds
    const int64_t group = split_group(unit, splits);
    const int64_t slice = unit - group * splits;
    const int64_t row = group * rows_per_unit + team;
    const int64_t first = slice * args.split_elems;
    RowSums<S> s{norm.identity(), norm.identity(), norm.identity()};
    if (row < args.rows) {
      accumulate_slice<kTPR, T, K, kSwap>(args, norm, row, first,
                                          min(args.split_elems, args.dim - first), lane, s);
    }
    s = team_reduce(s, tpr, norm, smem_rows);
    if (row < args.rows && lane == 0) write_unit<kTPR != 0>(args, norm, s, row, slice, loss_sum);
  }
  write_block_sum<kTPR>(args, lane, loss_sum);
}

// Tensor maps of a, p and n for the ring's row groups: one copy per input and stage brings each
// row's next segment (a box of rows x segment elements).
struct RingTiles {
  CUtensorMap a, p, n;
};

// Aligned rows (sm_90): the copy engine streams each unit (a row group, or one slice of a row)
// through a ring of kRingStages shared-memory stages, so memory sees few large requests and no
// registers hold data in flight. A stage holds, for each row of the group, the next
// chunk_bytes / rows-per-group bytes of each input (whole-block teams: one copy of each input;
// smaller teams: one tile of each, `tiles`). Every thread takes its next packs of its row there,
// at lane, lane + tpr, ...: the rows kernel's packs in the rows kernel's order.
// kTiles: teams of 8 or 32, float32 only (a bf16 warp's stage segment is over the copy engine's
// 256 elements, and (262144, 256) bf16 in teams of 8 ran 0.1236 ms against 0.1078 with register
// loads); else whole-block teams (tpr = the block), one row or slice per unit.
template <typename T, NormKind K, bool kSwap, bool kTiles>
__global__ void __launch_bounds__(kBlockThreads)
    forward_ring_kernel(const ForwardArgs<T> args, const __grid_constant__ RingTiles tiles) {
#ifndef FUSED_TRIPLET_HAS_BULK_COPY
  __trap();  // the plan takes this kernel only on sm_90+
#else
  allow_follow_up();
  using S = sum_t<T>;
  constexpr int kVec = Pack<T>::kN;
  extern __shared__ __align__(128) unsigned char stage_mem[];  // [stage][input][chunk_bytes]
  __shared__ __align__(8) uint64_t full[kRingStages];          // a stage's copies have landed
  __shared__ RowSums<S> smem_rows[kBlockThreads / 32];
  const Norm<T, K> norm(args.norm);
  const int tpr = kTiles ? args.tpr : kBlockThreads;
  const int team = threadIdx.x / tpr;
  const int lane = threadIdx.x % tpr;
  const int rows_per_unit = kBlockThreads / tpr;
  const int chunk_packs = args.chunk_bytes / kVecBytes;
  const int segment_packs = chunk_packs / rows_per_unit;  // of each row per stage
  const int segment_elems = segment_packs * kVec;
  const int64_t per_unit = (args.split_elems + segment_elems - 1) / segment_elems;  // stages

  // Thread 0 starts the copies of the block's stages in order, segment k of unit `unit` next. A
  // slice's short last segment can be empty: its stage completes on the arrival alone.
  int64_t next_unit = blockIdx.x, next_k = 0, issued = 0;
  auto issue_next = [&]() {
    if (next_unit >= args.units) return;
    const int stage = static_cast<int>(issued % kRingStages);
    const RingBarrier bar{&full[stage]};
    const int64_t group = split_group(next_unit, args.splits);
    const int64_t first = (next_unit - group * args.splits) * args.split_elems;
    const int64_t col = first + next_k * segment_elems;
    ++issued;
    if (++next_k == per_unit) {
      next_k = 0;
      next_unit += gridDim.x;
    }
    unsigned char* dst = stage_mem + stage * 3 * args.chunk_bytes;
    if (kTiles) {  // whole boxes, zeros past the last row or column
      bar.expect(3 * args.chunk_bytes);
      const int32_t row = static_cast<int32_t>(group * rows_per_unit);
      copy_tile(bar, dst, &tiles.a, static_cast<int32_t>(col), row);
      copy_tile(bar, dst + args.chunk_bytes, &tiles.p, static_cast<int32_t>(col), row);
      copy_tile(bar, dst + 2 * args.chunk_bytes, &tiles.n, static_cast<int32_t>(col), row);
      return;
    }
    const int64_t end = min(first + args.split_elems, args.dim);
    const uint32_t bytes =
        static_cast<uint32_t>(max(int64_t(0), min(int64_t(segment_elems), end - col)) * sizeof(T));
    if (bytes == 0) {
      bar.arrive();
      return;
    }
    bar.expect(3 * bytes);
    bar.copy(dst, args.a + group * args.stride_a + col, bytes);
    bar.copy(dst + args.chunk_bytes, args.p + group * args.stride_p + col, bytes);
    bar.copy(dst + 2 * args.chunk_bytes, args.n + group * args.stride_n + col, bytes);
  };
  if (threadIdx.x == 0) {
    for (int st = 0; st < kRingStages; ++st) RingBarrier{&full[st]}.init();
    for (int st = 0; st < kRingStages; ++st) issue_next();
  }
  __syncthreads();  // the barriers are initialised

  S loss_sum = S(0);
  int64_t c = 0;  // the block's stages, unit by unit
  for (int64_t unit = blockIdx.x; unit < args.units; unit += gridDim.x) {
    const int64_t group = split_group(unit, args.splits);
    const int64_t slice = unit - group * args.splits;
    const int64_t row = group * rows_per_unit + team;
    const int64_t first = slice * args.split_elems;
    const int64_t end = min(first + args.split_elems, args.dim);
    RowSums<S> s{norm.identity(), norm.identity(), norm.identity()};
    for (int64_t k = 0; k < per_unit; ++k, ++c) {
      const int stage = static_cast<int>(c % kRingStages);
      RingBarrier{&full[stage]}.wait(static_cast<uint32_t>((c / kRingStages) & 1));
      // As 16-byte words: a byte pointer at a run-time offset would be read byte by byte.
      const uint4* in = reinterpret_cast<const uint4*>(stage_mem) + stage * 3 * chunk_packs +
                        team * segment_packs;
      const int64_t col = first + k * segment_elems;
      const int packs = row < args.rows
                            ? static_cast<int>(max(int64_t(0), min(int64_t(segment_elems), end - col)) / kVec)
                            : 0;
      for (int v = lane; v < packs; v += tpr) {
        accumulate_packs(norm, s, as_pack<T>(in[v]), as_pack<T>(in[chunk_packs + v]),
                         as_pack<T>(in[2 * chunk_packs + v]), args.eps, kSwap);
      }
      __syncthreads();  // every thread is done with the stage: it takes stage c + kRingStages
      if (threadIdx.x == 0) issue_next();
    }
    s = team_reduce(s, tpr, norm, smem_rows);
    if (row < args.rows && lane == 0) write_unit(args, norm, s, row, slice, loss_sum);
  }
  write_block_sum<kTiles ? 0 : kBlockThreads>(args, lane, loss_sum);
#endif
}

// Split rows: a warp combines each row's slices in a fixed tree (a row's 128 slices one after
// another took 5% of (4, 16777216)), then its distances and loss. Then, for 'mean' / 'sum' (out
// not null), the sum of the row losses or of the main kernel's block sums in double, in a fixed
// order, divided by `divisor` (rows for 'mean').
template <typename T>
__global__ void __launch_bounds__(kFinishThreads)
    forward_finish_kernel(const ForwardArgs<T> args, int64_t block_sums, double divisor, T* out) {
  using S = sum_t<T>;
  constexpr int kWarps = kFinishThreads / 32;
  __shared__ double smem[kWarps];
  const Norm<T, NormKind::kOther> norm(args.norm);
  wait_for_main_grid();  // the main kernel's partials or block sums
  double total = 0.0;
  if (args.splits > 1) {
    const int64_t count = args.rows * args.splits;
    const int lane = threadIdx.x % 32;
    for (int64_t row = threadIdx.x / 32; row < args.rows; row += kWarps) {  // warp-uniform
      RowSums<S> s{norm.identity(), norm.identity(), norm.identity()};
      for (int64_t at = row * args.splits + lane; at < (row + 1) * args.splits; at += 32) {
        s = combine3(norm, s, RowSums<S>{args.partials[at], args.partials[count + at],
                                         args.partials[2 * count + at]});
      }
      s = team_reduce(s, 32, norm, static_cast<RowSums<S>*>(nullptr));
      if (lane == 0) {
        S loss = S(0);
        finish_row(args, norm, s, row, loss);
        total += static_cast<double>(loss);
      }
    }
  } else {
    for (int64_t i = threadIdx.x; i < block_sums; i += kFinishThreads) {
      total += static_cast<double>(args.block_sums[i]);
    }
  }
  if (out != nullptr) {  // uniform: every thread reaches block_sum's barrier
    total = block_sum<kFinishThreads>(total, smem);
    if (threadIdx.x == 0) out[0] = from_acc<T>(total / divisor);
  }
}

// ==== Backward =====================================================================================

template <typename T>
struct BackwardArgs {
  const T* a;
  const T* p;
  const T* n;
  int64_t stride_a, stride_p, stride_n;
  int64_t rows, dim;
  int64_t splits, split_elems;
  int64_t units;
  int tpr;
  bool vectorized;  // input and gradient rows 16-byte aligned
  bool swap;
  bool hinge_at_zero;
  acc_t<T> eps, margin;
  NormParams norm;
  const acc_t<T>* dists;  // [2 or 3, rows] from the forward
  const T* grad;          // upstream gradient: [rows] ('none') or one value
  int64_t grad_stride;    // 1 or 0
  acc_t<T> grad_scale;    // 1 / rows for 'mean', else 1
  T* grad_a;              // [rows, dim] contiguous, or null when not needed
  T* grad_p;
  T* grad_n;
  int* upstream_flag;     // 'mean' / 'sum': set to whether the upstream gradient is 1, or null
  bool in_place;          // grad_a/p/n hold the one pass's gradients: apply the upstream one
};

// The types the one-pass forward takes. Their 'mean' / 'sum' gradients are upstream x (the
// local gradient, rounded to T) in every path, so that the paths give the same bits. fp16 stays
// upstream-first: a 'mean' gradient can lie below fp16's normal range until GradScaler's scale
// reaches it.
template <typename T>
constexpr bool kUpstreamLast = std::is_same<T, float>::value || std::is_same<T, __nv_bfloat16>::value;

// The backward notes for the next forward whether its upstream gradient was exactly 1.
template <typename T>
__device__ __forceinline__ void note_upstream(const BackwardArgs<T>& args) {
  if (args.upstream_flag != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    *static_cast<volatile int*>(args.upstream_flag) = to_acc(args.grad[0]) == acc_t<T>(1);
  }
}

template <typename A>
__device__ __forceinline__ A sgn(A x) {
  return A(x > A(0)) - A(x < A(0));  // 0 for 0 and NaN, as torch's sign
}

// The p-norm's element derivative f(u), without the per-row scale.
template <typename A, NormKind K>
__device__ __forceinline__ A norm_grad_elem(NormMode mode, A p, A u, A d) {
  if constexpr (K == NormKind::kTwo) {
    return u;
  } else if constexpr (K == NormKind::kOne) {
    return sgn(u);
  } else {
    switch (mode) {
      case NormMode::kZero: return A(0);
      case NormMode::kInf:
      case NormMode::kNegInf: return (abs_acc(u) == d || u != u) ? sgn(u) : A(0);
      default:
        if (p < A(1)) return u == A(0) ? A(0) : sgn(u) * pow_acc(abs_acc(u), p - A(1));
        if (p < A(2)) return sgn(u) * pow_acc(abs_acc(u), p - A(1));
        return u * pow_acc(abs_acc(u), p - A(2));
    }
  }
}

// g / x for the per-row scales. A zero g (an inactive hinge; under swap, the distance not chosen)
// with x > 0 returns g itself: IEEE division sends a zero numerator to its slow path. x = 0 or NaN
// still divides (0 / 0 and 0 / NaN are NaN).
template <typename A>
__device__ __forceinline__ A scale_div(A g, A x) {
  return (g == A(0) && x > A(0)) ? g : g / x;
}

// The per-row scale of f for a distance d receiving upstream gradient g (ties: the number of
// entries equal to an inf-norm).
template <typename A, NormKind K>
__device__ __forceinline__ A norm_grad_scale(NormMode mode, A p, A g, A d, A ties) {
  if constexpr (K == NormKind::kTwo) {
    return d == A(0) ? A(0) : scale_div(g, d);
  } else if constexpr (K == NormKind::kOne) {
    return g;
  } else {
    switch (mode) {
      case NormMode::kZero: return A(0);
      case NormMode::kInf:
      case NormMode::kNegInf: return scale_div(g, ties);
      default:
        if (p < A(1)) return g * pow_acc(d, A(1) - p);
        return d == A(0) ? A(0) : scale_div(g, pow_acc(d, p - A(1)));
    }
  }
}

// One row's gradient: its distances and the per-row scale of each distance's f.
template <typename T, NormKind K>
struct RowGrad {
  using A = acc_t<T>;
  NormMode mode;
  A p, eps;
  bool swap;
  A d_ap, d_an, d_pn;  // distances
  A g_ap, g_an, g_pn;  // upstream gradient reaching each distance
  A c_ap, c_an, c_pn;  // scales of f (set by scale())
  A last;              // upstream gradient applied to the rounded gradient (1: none)

  // A row's distances as the forward stored them; `first`, the upstream gradient folded into
  // the scales, and `last`, the one applied to the rounded gradient (kUpstreamLast types; 1
  // otherwise). Then the hinge and the swap choice. An inactive row gets neither.
  __device__ __forceinline__ RowGrad(const NormParams& norm, A eps_, A margin, bool swap_,
                                     bool hinge_at_zero, A d_ap_, A d_an_, A d_pn_, A first,
                                     A last_)
      : mode(norm.mode), p(static_cast<A>(norm.p)), eps(eps_), swap(swap_), d_ap(d_ap_),
        d_an(d_an_), d_pn(swap_ ? d_pn_ : A(0)) {
    const A d_neg = swap ? min_nan(d_an, d_pn) : d_an;
    const A hinge_in = margin + d_ap - d_neg;
    const bool active = hinge_in > A(0) || (hinge_in == A(0) && hinge_at_zero);
    const A g = active ? first : A(0);
    last = active ? last_ : A(1);
    A w_an = A(1), w_pn = A(0);
    if (swap) {
      w_an = d_an > d_pn ? A(0) : (d_an == d_pn ? A(0.5) : A(1));
      w_pn = d_an < d_pn ? A(0) : (d_an == d_pn ? A(0.5) : A(1));
    }
    g_ap = g;
    g_an = -g * w_an;
    g_pn = -g * w_pn;
  }
  // ties: for inf-norms, the number of entries equal to each norm (1 otherwise).
  __device__ __forceinline__ void scale(A ties_ap, A ties_an, A ties_pn) {
    c_ap = norm_grad_scale<A, K>(mode, p, g_ap, d_ap, ties_ap);
    c_an = norm_grad_scale<A, K>(mode, p, g_an, d_an, ties_an);
    c_pn = swap ? norm_grad_scale<A, K>(mode, p, g_pn, d_pn, ties_pn) : A(0);
  }
  // Gradients of one element of each input. Products and sums rounded one by one, as torch's
  // autograd does: left to the compiler, a product may or may not fuse into the next add, and
  // the families would differ in the last bit.
  __device__ __forceinline__ void operator()(A xa, A xp, A xn, A& ga, A& gp, A& gn) const {
    const A f_ap = mul_rn(c_ap, norm_grad_elem<A, K>(mode, p, xa - xp + eps, d_ap));
    const A f_an = mul_rn(c_an, norm_grad_elem<A, K>(mode, p, xa - xn + eps, d_an));
    const A f_pn = swap ? mul_rn(c_pn, norm_grad_elem<A, K>(mode, p, xp - xn + eps, d_pn)) : A(0);
    ga = add_rn(f_ap, f_an);
    gp = add_rn(f_pn, -f_ap);
    gn = add_rn(-f_an, -f_pn);
  }
  // Rounded gradients times the upstream gradient `last`: the one-pass gradients get it in
  // backward_rows_kernel's in_place mode, the others as they are written, with the same
  // rounding. `last` is a T value, so the product is exact before its one rounding: bfloat16
  // pairs multiply as bfloat16x2 (one instruction; through float, weighted bf16 backwards ran
  // 5-8% slower).
  __device__ __forceinline__ void times_last(uint4& words) const {  // a pack, as stored
    if constexpr (kUpstreamLast<T>) {
      if (last == A(1)) return;
      uint32_t w[4] = {words.x, words.y, words.z, words.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if constexpr (std::is_same<T, __nv_bfloat16>::value) {
          __nv_bfloat162 pair;
          memcpy(&pair, &w[k], 4);
          pair = __hmul2(pair, __float2bfloat162_rn(last));
          memcpy(&w[k], &pair, 4);
        } else {
          w[k] = __float_as_uint(mul_rn(__uint_as_float(w[k]), last));
        }
      }
      words = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
  __device__ __forceinline__ T times_last(T x) const {
    if constexpr (kUpstreamLast<T>) {
      if (last == A(1)) return x;
      if constexpr (std::is_same<T, __nv_bfloat16>::value) return __hmul(x, __float2bfloat16_rn(last));
      else return mul_rn(x, last);
    }
    return x;
  }
  __device__ __forceinline__ void store_times_last(T* out, int64_t at, const Pack<T>& x) const {
    if (out == nullptr) return;
    uint4 words;
    memcpy(&words, &x, sizeof(words));
    times_last(words);
    *reinterpret_cast<uint4*>(out + at) = words;
  }
  __device__ __forceinline__ void write(T* out, int64_t at, A g) const {
    if (out != nullptr) out[at] = times_last(from_acc<T>(g));
  }
  // The same for one 16-byte pack of each input, written where needed at element `at`.
  __device__ __forceinline__ void write_pack(T* out_a, T* out_p, T* out_n, int64_t at,
                                             const Pack<T>& a, const Pack<T>& p_,
                                             const Pack<T>& n) const {
    Pack<T> oa, op, on;
#pragma unroll
    for (int j = 0; j < Pack<T>::kN; ++j) {
      A ga, gp, gn;
      (*this)(to_acc(a.v[j]), to_acc(p_.v[j]), to_acc(n.v[j]), ga, gp, gn);
      oa.v[j] = from_acc<T>(ga);
      op.v[j] = from_acc<T>(gp);
      on.v[j] = from_acc<T>(gn);
    }
    store_times_last(out_a, at, oa);
    store_times_last(out_p, at, op);
    store_times_last(out_n, at, on);
  }
  __device__ __forceinline__ void write_elem(const BackwardArgs<T>& args, int64_t at, T a, T p_,
                                             T n) const {
    A ga, gp, gn;
    (*this)(to_acc(a), to_acc(p_), to_acc(n), ga, gp, gn);
    write(args.grad_a, at, ga);
    write(args.grad_p, at, gp);
    write(args.grad_n, at, gn);
  }
};

// A row's RowGrad in the backward: distances from the forward, the upstream gradient given.
// Last for the types and reductions the one pass takes ('mean' / 'sum': grad_stride 0), first
// otherwise (one rounding: per-row upstream gradients of 'none' in bf16 were less accurate
// than torch's, applied last).
template <typename T, NormKind K>
__device__ __forceinline__ RowGrad<T, K> backward_row_grad(const BackwardArgs<T>& args,
                                                           int64_t row, bool swap) {
  using A = acc_t<T>;
  const A upstream = to_acc(args.grad[row * args.grad_stride]);
  const A d_pn = swap ? args.dists[2 * args.rows + row] : A(0);
  const bool last = kUpstreamLast<T> && args.grad_stride == 0;
  return RowGrad<T, K>(args.norm, args.eps, args.margin, swap, args.hinge_at_zero,
                       args.dists[row], args.dists[args.rows + row], d_pn,
                       last ? args.grad_scale : upstream * args.grad_scale,
                       last ? upstream : A(1));
}

// The backward of the one pass ('mean' / 'sum', gradients as forward_one_pass_kernel wrote
// them): the upstream gradient applied in place, as RowGrad::times_last applies it, over a grid
// of at most kUpstreamBlocks. Nothing when it is 1 (the common loss.backward()). Inactive rows
// keep their gradients (torch's clamp_min passes none of a NaN or inf upstream gradient to them).
template <typename T>
__device__ __forceinline__ void apply_upstream_in_place(const BackwardArgs<T>& args) {
  using A = acc_t<T>;
  constexpr int kVec = Pack<T>::kN;
  if (to_acc(args.grad[0]) == A(1)) return;
  const int64_t row_packs = args.dim / kVec;
  const int64_t packs = args.rows * row_packs;
  T* outs[3] = {args.grad_a, args.grad_p, args.grad_n};
  for (int64_t v = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; v < packs;
       v += int64_t(gridDim.x) * blockDim.x) {
    const RowGrad<T, NormKind::kTwo> rg =
        backward_row_grad<T, NormKind::kTwo>(args, v / row_packs, args.swap);
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      if (outs[k] == nullptr) continue;
      uint4 words = *reinterpret_cast<const uint4*>(outs[k] + v * kVec);
      rg.times_last(words);
      *reinterpret_cast<uint4*>(outs[k] + v * kVec) = words;
    }
  }
}

struct PlainSum {  // combine for counting inf-norm ties with team_reduce
  template <typename S>
  __device__ __forceinline__ S combine(S a, S b) const { return a + b; }
};

// Units as the forward's rows kernel (groups of rows, or slices of split rows). An explicit 1
// block per SM: ptxas's own target spills a few bytes on sm_100. With args.in_place, the one
// pass's backward instead (apply_upstream_in_place).
template <typename T, NormKind K>
__global__ void __launch_bounds__(kBlockThreads, 1) backward_rows_kernel(const BackwardArgs<T> args) {
  using A = acc_t<T>;
  constexpr int kVec = Pack<T>::kN;
  // Packs per input in flight: 4 (fp32: 16 elements); 2 for 16-bit types (the same 16 elements;
  // 4 took 170 registers), 1 for general p (pow calls would spill).
  constexpr int kUnroll = K == NormKind::kOther ? 1 : sizeof(T) == 2 ? 2 : 4;
  __shared__ RowSums<A> smem_rows[kBlockThreads / 32];
  note_upstream(args);
  if (args.in_place) {  // the one pass's backward
    if constexpr (kUpstreamLast<T>) apply_upstream_in_place(args);
    return;
  }
  const int tpr = args.tpr;
  const int team = threadIdx.x / tpr;
  const int lane = threadIdx.x % tpr;
  const bool inf_norm = K == NormKind::kOther &&
                        (args.norm.mode == NormMode::kInf || args.norm.mode == NormMode::kNegInf);
  const int rows_per_unit = kBlockThreads / tpr;
  for (int64_t unit = blockIdx.x; unit < args.units; unit += gridDim.x) {  // block-uniform bounds
    const int64_t group = split_group(unit, args.splits);
    const int64_t first = (unit - group * args.splits) * args.split_elems;
    const int64_t len = min(args.split_elems, args.dim - first);
    const int64_t row = group * rows_per_unit + team;
    const bool live = row < args.rows;
    const int64_t r = live ? row : 0;
    RowGrad<T, K> rg = backward_row_grad<T, K>(args, r, args.swap);
    const T* a = args.a + r * args.stride_a;
    const T* p = args.p + r * args.stride_p;
    const T* n = args.n + r * args.stride_n;
    RowSums<A> ties{A(1), A(1), A(1)};
    if (inf_norm) {  // block-uniform: every thread reaches team_reduce's barriers
      // The whole row, also when this unit is one slice of it: ties are a row property.
      RowSums<A> c{A(0), A(0), A(0)};
      for (int64_t i = lane; live && i < args.dim; i += tpr) {
        const A xa = to_acc(a[i]), xp = to_acc(p[i]), xn = to_acc(n[i]);
        const A u_ap = xa - xp + args.eps, u_an = xa - xn + args.eps, u_pn = xp - xn + args.eps;
        c.ap += A(abs_acc(u_ap) == rg.d_ap || u_ap != u_ap);
        c.an += A(abs_acc(u_an) == rg.d_an || u_an != u_an);
        if (args.swap) c.pn += A(abs_acc(u_pn) == rg.d_pn || u_pn != u_pn);
      }
      c = team_reduce(c, tpr, PlainSum{}, smem_rows);
      if (tpr <= 32) {
        ties = c;  // the xor-shuffle leaves the counts in every lane of the team
      } else {     // only lane 0 holds them
        if (lane == 0) smem_rows[team] = c;
        __syncthreads();
        ties = smem_rows[team];
        __syncthreads();
      }
    }
    if (!live) continue;
    rg.scale(ties.ap, ties.an, ties.pn);
    const int64_t out = row * args.dim + first;
    a += first;
    p += first;
    n += first;
    int64_t i = lane;  // element index of the tail / unaligned loop
    // General p with 2-byte types goes element by element: a pack's 8 elements live across 24
    // pow calls and spill (pow, not loads, bounds that kernel).
    if (args.vectorized && (K != NormKind::kOther || sizeof(T) > 2)) {
      const int64_t packs = len / kVec;
      for (int64_t v0 = lane; v0 < packs; v0 += int64_t(kUnroll) * tpr) {
        Pack<T> pa[kUnroll], pp[kUnroll], pn[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t v = v0 + int64_t(u) * tpr;
          if (v < packs) {
            pa[u] = load_stream(a + v * kVec);
            pp[u] = load_stream(p + v * kVec);
            pn[u] = load_stream(n + v * kVec);
          }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t v = v0 + int64_t(u) * tpr;
          if (v >= packs) break;
          rg.write_pack(args.grad_a, args.grad_p, args.grad_n, out + v * kVec, pa[u], pp[u],
                        pn[u]);
        }
      }
      i = packs * kVec + lane;
    }
    for (; i < len; i += tpr) rg.write_elem(args, out + i, a[i], p[i], n[i]);
  }
}

// Aligned rows, p = 2 or 1: given the per-row scales the gradient is elementwise, so each thread
// loads packs of each input into registers (all loads first, plain loads), as Triton's pointwise
// backward does. The threads of a row load the same distances, from L1.
template <typename T, NormKind K, bool kSwap>
__global__ void __launch_bounds__(kPointwiseThreads, kSwap ? 1 : kPointwiseMinBlocks)
    backward_pointwise_kernel(const BackwardArgs<T> args, uint32_t packs, uint32_t row_packs) {
  static_assert(K != NormKind::kOther, "no inf-norm tie counting here");
  using A = acc_t<T>;
  constexpr int kVec = Pack<T>::kN;
  note_upstream(args);
  const uint32_t first = blockIdx.x * uint32_t(kPointwiseThreads * kPointwisePacks) + threadIdx.x;
  Pack<T> pa[kPointwisePacks], pp[kPointwisePacks], pn[kPointwisePacks];
  uint32_t row[kPointwisePacks];
#pragma unroll
  for (int j = 0; j < kPointwisePacks; ++j) {
    const uint32_t v = first + uint32_t(j * kPointwiseThreads);
    if (v < packs) {
      row[j] = v / row_packs;
      const int64_t col = int64_t(v - row[j] * row_packs) * kVec;
      pa[j] = load_plain(args.a + row[j] * args.stride_a + col);
      pp[j] = load_plain(args.p + row[j] * args.stride_p + col);
      pn[j] = load_plain(args.n + row[j] * args.stride_n + col);
    }
  }
#pragma unroll
  for (int j = 0; j < kPointwisePacks; ++j) {
    const uint32_t v = first + uint32_t(j * kPointwiseThreads);
    if (v >= packs) break;
    RowGrad<T, K> rg = backward_row_grad<T, K>(args, row[j], kSwap);
    rg.scale(A(1), A(1), A(1));
    rg.write_pack(args.grad_a, args.grad_p, args.grad_n, int64_t(v) * kVec, pa[j], pp[j], pn[j]);
  }
}

// ==== One pass ======================================================================================

template <typename T>
struct OnePassArgs {
  T* grad_a;  // [rows, dim] contiguous, or null when not needed
  T* grad_p;
  T* grad_n;
  acc_t<T> margin;
  acc_t<T> grad_scale;  // 1 / rows for 'mean', else 1
  bool hinge_at_zero;
  int packs_per_thread;  // of each input, in shared memory: ceil(row packs / team)
};

// Training, p = 1 or 2, aligned rows of whole packs that the rows kernel's teams cover with at
// most kOnePassPacks packs per thread: the rows kernel (same teams, packs, order and reduction
// tree: the same loss and distances) with every pack kept in shared memory until the row's
// distances are known, then the backward's RowGrad on them for an upstream gradient of 1 (the
// same bits as the backward kernels given 1). Copied straight to shared memory: held in
// registers, 8 packs of each input took 170 registers (1 block per SM) or spilled at 128.
// Each thread reads back only its own packs: no barrier between copy and use.
template <typename T, NormKind K, bool kSwap>
__global__ void __launch_bounds__(kBlockThreads, kOnePassMinBlocks)
    forward_one_pass_kernel(const ForwardArgs<T> args, const OnePassArgs<T> out) {
  allow_follow_up();
  using S = sum_t<T>;
  using A = acc_t<T>;
  constexpr int kVec = Pack<T>::kN;
  extern __shared__ uint4 held[];  // [input][pack j][thread]: conflict-free 16-byte slots
  __shared__ RowSums<S> smem_rows[kBlockThreads / 32];
  const Norm<T, K> norm(args.norm);
  const int tpr = args.tpr;
  const int team = threadIdx.x / tpr;
  const int lane = threadIdx.x % tpr;
  const int rows_per_unit = kBlockThreads / tpr;
  const int per_thread = out.packs_per_thread;
  const int64_t packs = args.dim / kVec;
  uint4* held_a = held + threadIdx.x;
  uint4* held_p = held_a + per_thread * kBlockThreads;
  uint4* held_n = held_p + per_thread * kBlockThreads;
  S loss_sum = S(0);
  for (int64_t unit = blockIdx.x; unit < args.units; unit += gridDim.x) {  // block-uniform bounds
    const int64_t row = unit * rows_per_unit + team;
    const bool live = row < args.rows;
    // this thread's packs of the row: lane, lane + tpr, ... (mine <= per_thread)
    const int mine = live ? static_cast<int>(min(int64_t(per_thread), (packs - lane + tpr - 1) / tpr)) : 0;
    const T* a = args.a + row * args.stride_a + lane * kVec;
    const T* p = args.p + row * args.stride_p + lane * kVec;
    const T* n = args.n + row * args.stride_n + lane * kVec;
    for (int j = 0; j < mine; ++j) {
      const int64_t at = int64_t(j) * tpr * kVec;
      copy_to_shared(held_a + j * kBlockThreads, a + at);
      copy_to_shared(held_p + j * kBlockThreads, p + at);
      copy_to_shared(held_n + j * kBlockThreads, n + at);
    }
    wait_copies_to_shared();
    RowSums<S> s{norm.identity(), norm.identity(), norm.identity()};
    for (int j = 0; j < mine; ++j) {
      accumulate_packs(norm, s, as_pack<T>(held_a[j * kBlockThreads]),
                       as_pack<T>(held_p[j * kBlockThreads]), as_pack<T>(held_n[j * kBlockThreads]),
                       args.eps, kSwap);
    }
    s = team_reduce(s, tpr, norm, smem_rows);
    if (tpr > 32) {  // block-uniform: lane 0 holds the sums; the whole team needs them
      if (lane == 0) smem_rows[team] = s;
      __syncthreads();
      s = smem_rows[team];
      __syncthreads();
    }
    if (!live) continue;
    if (lane == 0) finish_row(args, norm, s, row, loss_sum);
    // The distances as finish_row stores them, which the backward kernels read.
    const A d_ap = static_cast<A>(norm.finish(s.ap));
    const A d_an = static_cast<A>(norm.finish(s.an));
    const A d_pn = kSwap ? static_cast<A>(norm.finish(s.pn)) : A(0);
    RowGrad<T, K> rg(args.norm, args.eps, out.margin, kSwap, out.hinge_at_zero, d_ap, d_an, d_pn,
                     out.grad_scale, A(1));
    rg.scale(A(1), A(1), A(1));
    const int64_t first = row * args.dim + lane * kVec;
    for (int j = 0; j < mine; ++j) {
      rg.write_pack(out.grad_a, out.grad_p, out.grad_n, first + int64_t(j) * tpr * kVec,
                    as_pack<T>(held_a[j * kBlockThreads]), as_pack<T>(held_p[j * kBlockThreads]),
                    as_pack<T>(held_n[j * kBlockThreads]));
    }
  }
  write_block_sum<0>(args, lane, loss_sum);
}

// ==== The plans ====================================================================================

namespace {

int element_size(DType dtype) {
  return dtype == DType::kDouble ? 8 : dtype == DType::kFloat ? 4 : 2;
}

NormKind norm_kind(double p) {
  return p == 2.0 ? NormKind::kTwo : p == 1.0 ? NormKind::kOne : NormKind::kOther;
}

NormParams norm_params(double p) {
  NormParams prm;
  prm.p = p;
  prm.inv_p = 1.0 / p;
  if (p == 2.0) {
    prm.mode = NormMode::kTwo;
  } else if (p == 1.0) {
    prm.mode = NormMode::kOne;
  } else if (p == 0.0) {
    prm.mode = NormMode::kZero;
  } else if (std::isinf(p)) {
    prm.mode = p > 0 ? NormMode::kInf : NormMode::kNegInf;
  } else {
    prm.mode = NormMode::kPow;
  }
  return prm;
}

bool rows_aligned(const void* ptr, int64_t stride, int64_t rows, int size) {
  return reinterpret_cast<std::uintptr_t>(ptr) % kVecBytes == 0 &&
         (rows <= 1 || (stride * size) % kVecBytes == 0);
}

bool inputs_aligned(const TripletProblem& pr) {
  const int size = element_size(pr.dtype);
  return rows_aligned(pr.a, pr.stride_a, pr.rows, size) &&
         rows_aligned(pr.p, pr.stride_p, pr.rows, size) &&
         rows_aligned(pr.n, pr.stride_n, pr.rows, size);
}

int one_pass_smem(int64_t packs_per_thread) {  // a, p, n: packs_per_thread each per thread
  return static_cast<int>(3 * packs_per_thread * kBlockThreads * kVecBytes);
}

bool rows_are_packs(const TripletProblem& pr) {  // every row a whole number of 16-byte packs
  return (pr.dim * element_size(pr.dtype)) % kVecBytes == 0;
}

// Teams, slices and units of the row kernels, from the shape alone: both directions and every
// family share them, so a thread's elements and the reduction tree do not depend on the family.
LaunchPlan row_geometry(const TripletProblem& pr) {
  const int64_t size = element_size(pr.dtype);
  const int64_t packs = (pr.dim * size + kVecBytes - 1) / kVecBytes;
  LaunchPlan plan{};
  plan.threads_per_row = packs <= kTeam8MaxPacks ? 8 : packs <= kWarpMaxPacks ? 32 : kBlockThreads;
  auto groups = [&](int tpr) {
    return (pr.rows + kBlockThreads / tpr - 1) / (kBlockThreads / tpr);
  };
  while (plan.threads_per_row < kBlockThreads && groups(plan.threads_per_row) < kFillBlocks) {
    const int bigger = plan.threads_per_row == 8 ? 32 : kBlockThreads;
    if (packs < bigger) break;  // every thread of the team still gets a pack
    plan.threads_per_row = bigger;
  }
  plan.splits = 1;
  plan.split_elems = pr.dim;
  if (plan.threads_per_row == kBlockThreads && pr.rows < kFillBlocks / 2) {
    const int64_t row_bytes = pr.dim * size;
    const int64_t want = (kSplitBlocks + pr.rows - 1) / pr.rows;  // slices per row
    int64_t slice_bytes = std::max(kMinSliceBytes, (row_bytes + want - 1) / want);
    slice_bytes = (slice_bytes + kVecBytes - 1) / kVecBytes * kVecBytes;  // slices stay aligned
    const int64_t splits = (row_bytes + slice_bytes - 1) / slice_bytes;
    if (splits > 1) {
      plan.splits = splits;
      plan.split_elems = slice_bytes / size;
    }
  }
  plan.units = groups(plan.threads_per_row) * plan.splits;
  plan.grid = std::min(plan.units, kMaxGrid);
  return plan;
}

// Bytes of each input per ring stage.
int ring_chunk_bytes(const TripletProblem& pr, const LaunchPlan& geometry) {
  const bool whole_long_rows = geometry.splits == 1 && geometry.threads_per_row == kBlockThreads;
  return element_size(pr.dtype) == 2 && whole_long_rows ? kRingChunkBytesShortElems
                                                        : kRingChunkBytes;
}

// Where the ring beats register loads (the table's thresholds; forward_family_unfit says where
// it can run).
bool ring_pays(const TripletProblem& pr, const LaunchPlan& geometry) {
  const int64_t row_bytes = pr.dim * element_size(pr.dtype);
  if (geometry.threads_per_row == kBlockThreads) return row_bytes >= kRingMinRowBytes;
  const int64_t segment_bytes =
      ring_chunk_bytes(pr, geometry) / (kBlockThreads / geometry.threads_per_row);
  return pr.rows * row_bytes >= kRingTilesMinInputBytes && row_bytes % segment_bytes == 0;
}

}  // namespace

const char* forward_family_unfit(const TripletProblem& pr, ForwardFamily family) {
  if (family == ForwardFamily::kRing) {
    if (pr.cc_major < 9) return "the ring needs sm_90's bulk copies";
    if (norm_kind(pr.p_norm) == NormKind::kOther) return "the ring takes p = 1 or 2 (pow, not memory, bounds the rest)";
    if (pr.dtype == DType::kDouble) return "the ring takes 2- and 4-byte elements (float64 takes register loads)";
    if (!inputs_aligned(pr) || !rows_are_packs(pr)) return "the ring needs 16-byte aligned rows";
    const LaunchPlan rows = row_geometry(pr);
    if (rows.threads_per_row < kBlockThreads) {
      if (pr.dtype != DType::kFloat) return "the ring takes teams of 8 or 32 for float32 only";
      if (pr.dim == 0) return "the ring's tiles need elements";
      if (ring_chunk_bytes(pr, rows) / (kBlockThreads / rows.threads_per_row) /
              element_size(pr.dtype) > kTileMaxCols) {
        return "the ring's tiles take rows of at most 256 elements per stage";
      }
      const int64_t strides[3] = {pr.stride_a, pr.stride_p, pr.stride_n};
      for (int64_t stride : strides) {
        if (stride < pr.dim) return "the ring's tiles need rows that do not overlap";
      }
      if (pr.rows > INT32_MAX || pr.dim > INT32_MAX) return "the ring's tiles take 32-bit coordinates";
    }
  }
  if (family == ForwardFamily::kOnePass) {
    if (pr.dtype != DType::kFloat && pr.dtype != DType::kBFloat16) return "the onepass forward takes float32 and bfloat16";
    if (norm_kind(pr.p_norm) == NormKind::kOther) return "the onepass forward takes p = 1 or 2";
    if (!inputs_aligned(pr) || !rows_are_packs(pr)) return "the onepass forward needs 16-byte aligned rows";
    const LaunchPlan rows = row_geometry(pr);
    const int64_t packs = pr.dim * element_size(pr.dtype) / kVecBytes;
    const int64_t per_thread = (packs + rows.threads_per_row - 1) / rows.threads_per_row;
    if (rows.splits > 1 || per_thread > kOnePassPacks ||
        one_pass_smem(per_thread) + kOnePassStaticSmem > pr.smem_per_block) {
      return "the onepass forward holds at most 16 packs of each input per thread, within the "
             "GPU's shared memory per block";
    }
  }
  return nullptr;
}

const char* backward_family_unfit(const TripletProblem& pr, BackwardFamily family) {
  if (family != BackwardFamily::kPointwise) return nullptr;
  if (norm_kind(pr.p_norm) == NormKind::kOther) return "the pointwise backward takes p = 1 or 2";
  if (pr.dtype == DType::kDouble) return "the pointwise backward takes 2- and 4-byte elements";
  if (!inputs_aligned(pr) || !rows_are_packs(pr)) return "the pointwise backward needs 16-byte aligned rows";
  if (pr.rows * pr.dim * element_size(pr.dtype) / kVecBytes >= kPointwiseMaxPacks) {
    return "the pointwise backward takes fewer than 2^31 packs";
  }
  return nullptr;
}

LaunchPlan plan_forward(const TripletProblem& pr, ForwardFamily forced, bool write_grads) {
  LaunchPlan plan = row_geometry(pr);
  plan.vectorized = inputs_aligned(pr);
  ForwardFamily family = forced;
  plan.reason = "forced";
  if (family == ForwardFamily::kAuto) {
    if (write_grads && !forward_family_unfit(pr, ForwardFamily::kOnePass)) {
      family = ForwardFamily::kOnePass;
      plan.reason = "training: each thread holds its packs of the row";
    } else if (ring_pays(pr, plan) && !forward_family_unfit(pr, ForwardFamily::kRing)) {
      family = ForwardFamily::kRing;
      plan.reason = plan.threads_per_row == kBlockThreads
                        ? "aligned rows of >= 8 KiB on sm_90"
                        : "float32 rows of whole stages, >= 256 MiB per input, on sm_90";
    } else {
      family = ForwardFamily::kRows;
      plan.reason = "register loads: every other input";
    }
  }
  plan.family = static_cast<int>(family);
  if (family == ForwardFamily::kRing) plan.ring_chunk_bytes = ring_chunk_bytes(pr, plan);
  return plan;
}

LaunchPlan plan_backward(const TripletProblem& pr, BackwardFamily forced) {
  LaunchPlan plan = row_geometry(pr);
  plan.vectorized = inputs_aligned(pr) && (pr.rows <= 1 || rows_are_packs(pr));
  BackwardFamily family = forced;
  plan.reason = "forced";
  if (family == BackwardFamily::kAuto) {
    family = backward_family_unfit(pr, BackwardFamily::kPointwise) ? BackwardFamily::kRows
                                                                     : BackwardFamily::kPointwise;
    plan.reason = family == BackwardFamily::kPointwise ? "aligned rows, p = 1 or 2"
                                                       : "register loads: every other input";
  }
  plan.family = static_cast<int>(family);
  if (family == BackwardFamily::kPointwise) {
    constexpr int64_t kPerBlock = kPointwiseThreads * kPointwisePacks;
    const int64_t packs = pr.rows * pr.dim * element_size(pr.dtype) / kVecBytes;
    plan.grid = (packs + kPerBlock - 1) / kPerBlock;
  }
  return plan;
}

std::string describe_plan(const LaunchPlan& plan, bool forward) {
  const char* names[2][3] = {{"rows", "pointwise", ""}, {"rows", "ring", "onepass"}};
  std::string s = names[forward ? 1 : 0][plan.family];
  s += ": threads_per_row=" + std::to_string(plan.threads_per_row) +
       " splits=" + std::to_string(plan.splits) + " grid=" + std::to_string(plan.grid) +
       " vectorized=" + (plan.vectorized ? "1" : "0");
  if (plan.ring_chunk_bytes) s += " chunk_bytes=" + std::to_string(plan.ring_chunk_bytes);
  return s + " (" + plan.reason + ")";
}

size_t forward_workspace_bytes(const TripletProblem& pr, const LaunchPlan& plan,
                               int64_t reduction) {
  const size_t sum_size = pr.dtype == DType::kHalf || pr.dtype == DType::kBFloat16 ? 4 : 8;
  if (plan.splits > 1) return 3 * static_cast<size_t>(pr.rows * plan.splits) * sum_size;
  return reduction == kNone ? 0 : static_cast<size_t>(plan.grid) * sum_size;
}

// ==== Launches =====================================================================================

namespace {

template <typename T> struct Tag { using type = T; };

template <typename F>
void with_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kHalf: f(Tag<__half>{}); break;
    case DType::kBFloat16: f(Tag<__nv_bfloat16>{}); break;
    case DType::kFloat: f(Tag<float>{}); break;
    default: f(Tag<double>{}); break;
  }
}

template <typename F>
void with_swap(bool swap, F&& f) {
  if (swap) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

template <typename F>
void with_kind(double p, F&& f) {
  switch (norm_kind(p)) {
    case NormKind::kTwo: f(std::integral_constant<NormKind, NormKind::kTwo>{}); break;
    case NormKind::kOne: f(std::integral_constant<NormKind, NormKind::kOne>{}); break;
    default: f(std::integral_constant<NormKind, NormKind::kOther>{}); break;
  }
}

// Lets kKernel take `bytes` of dynamic shared memory on the current device, once per kernel and
// device (a call each launch cost the small cases a microsecond).
template <auto kKernel>
cudaError_t allow_shared_memory(int bytes) {
  constexpr int kDevices = 64;
  static std::atomic<int> allowed[kDevices] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess || (device < kDevices && allowed[device].load() >= bytes)) return err;
  err = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess && device < kDevices) allowed[device].store(bytes);
  return err;
}

// The driver's tensor-map encoder, looked up once (so the library does not link libcuda).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encoder = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      fn = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encoder;
}

// The ring's tiles: each input as (rows, dim) elements, boxes of a row group's rows x one stage's
// segment of each row.
cudaError_t encode_ring_tiles(RingTiles& tiles, const TripletProblem& pr, const LaunchPlan& plan) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const int size = element_size(pr.dtype);
  const int rows_per_unit = kBlockThreads / plan.threads_per_row;
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(plan.ring_chunk_bytes / rows_per_unit / size),
                             static_cast<cuuint32_t>(rows_per_unit)};
  const cuuint32_t element_strides[2] = {1, 1};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(pr.dim), static_cast<cuuint64_t>(pr.rows)};
  const struct { CUtensorMap* map; const void* base; int64_t stride; } inputs[3] = {
      {&tiles.a, pr.a, pr.stride_a}, {&tiles.p, pr.p, pr.stride_p}, {&tiles.n, pr.n, pr.stride_n}};
  for (const auto& in : inputs) {
    const cuuint64_t stride_bytes[1] = {static_cast<cuuint64_t>(std::max(in.stride, pr.dim) * size)};
    const CUresult r = encode(in.map, size == 2 ? CU_TENSOR_MAP_DATA_TYPE_UINT16 : CU_TENSOR_MAP_DATA_TYPE_UINT32,
                              2, const_cast<void*>(in.base), dims, stride_bytes, box, element_strides,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                              CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

template <typename Args>
void fill_rows(Args& args, const TripletProblem& pr, const LaunchPlan& plan) {
  using T = typename std::remove_const<typename std::remove_pointer<decltype(args.a)>::type>::type;
  args.a = static_cast<const T*>(pr.a);
  args.p = static_cast<const T*>(pr.p);
  args.n = static_cast<const T*>(pr.n);
  args.stride_a = pr.stride_a;
  args.stride_p = pr.stride_p;
  args.stride_n = pr.stride_n;
  args.rows = pr.rows;
  args.dim = pr.dim;
  args.splits = plan.splits;
  args.split_elems = plan.split_elems;
  args.units = plan.units;
  args.tpr = plan.threads_per_row;
  args.vectorized = plan.vectorized;
  args.swap = pr.swap;
  args.eps = static_cast<acc_t<T>>(pr.eps);
  args.norm = norm_params(pr.p_norm);
}

}  // namespace

cudaError_t launch_forward(const TripletProblem& pr, const LaunchPlan& plan, int64_t reduction,
                           void* loss, void* dists, void* workspace, const GradOutputs& grads,
                           cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  with_type(pr.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using S = sum_t<T>;
    ForwardArgs<T> args{};
    fill_rows(args, pr, plan);
    args.chunk_bytes = plan.ring_chunk_bytes;
    args.margin = static_cast<S>(pr.margin);
    args.loss_rows = reduction == kNone ? static_cast<T*>(loss) : nullptr;
    args.dists = static_cast<acc_t<T>*>(dists);
    args.block_sums = plan.splits == 1 && reduction != kNone ? static_cast<S*>(workspace) : nullptr;
    args.partials = plan.splits > 1 ? static_cast<S*>(workspace) : nullptr;
    with_kind(pr.p_norm, [&](auto kind) {
      with_swap(pr.swap, [&](auto swap) {
        constexpr NormKind K = decltype(kind)::value;
        constexpr bool kSwap = decltype(swap)::value;
        if constexpr (K != NormKind::kOther && kUpstreamLast<T>) {
          if (plan.family == static_cast<int>(ForwardFamily::kOnePass)) {
            OnePassArgs<T> out{};
            out.grad_a = static_cast<T*>(grads.grad_a);
            out.grad_p = static_cast<T*>(grads.grad_p);
            out.grad_n = static_cast<T*>(grads.grad_n);
            out.margin = static_cast<acc_t<T>>(pr.margin);
            out.grad_scale = reduction == kMean ? acc_t<T>(1) / static_cast<acc_t<T>>(pr.rows)
                                                : acc_t<T>(1);
            out.hinge_at_zero = grads.hinge_at_zero;
            out.packs_per_thread = static_cast<int>(
                (pr.dim / Pack<T>::kN + plan.threads_per_row - 1) / plan.threads_per_row);
            const int smem = one_pass_smem(out.packs_per_thread);
            err = allow_shared_memory<forward_one_pass_kernel<T, K, kSwap>>(smem);
            if (err == cudaSuccess) {
              forward_one_pass_kernel<T, K, kSwap><<<plan.grid, kBlockThreads, smem, stream>>>(args, out);
            }
            return;
          }
        }
        if constexpr (K != NormKind::kOther && !std::is_same<T, double>::value) {
          if (plan.family == static_cast<int>(ForwardFamily::kRing)) {
            const int smem = kRingStages * 3 * plan.ring_chunk_bytes;  // above the 48 KiB default
            RingTiles tiles{};
            if constexpr (std::is_same<T, float>::value) {
              if (plan.threads_per_row < kBlockThreads) {
                err = encode_ring_tiles(tiles, pr, plan);
                if (err == cudaSuccess) err = allow_shared_memory<forward_ring_kernel<T, K, kSwap, true>>(smem);
                if (err == cudaSuccess) {
                  forward_ring_kernel<T, K, kSwap, true><<<plan.grid, kBlockThreads, smem, stream>>>(args, tiles);
                }
                return;
              }
            }
            err = allow_shared_memory<forward_ring_kernel<T, K, kSwap, false>>(smem);
            if (err == cudaSuccess) {
              forward_ring_kernel<T, K, kSwap, false><<<plan.grid, kBlockThreads, smem, stream>>>(args, tiles);
            }
            return;
          }
        }
        // Teams of 8 and 32 with their size compiled in (not general p: pow bounds it; not
        // double: its speed matters less than the kernels' count).
        constexpr bool kFixedTeams = K != NormKind::kOther && !std::is_same<T, double>::value;
        if constexpr (kFixedTeams) {
          if (plan.threads_per_row == 8) {
            forward_rows_kernel<T, K, kSwap, 8><<<plan.grid, kBlockThreads, 0, stream>>>(args);
            return;
          }
          if (plan.threads_per_row == 32) {
            forward_rows_kernel<T, K, kSwap, 32><<<plan.grid, kBlockThreads, 0, stream>>>(args);
            return;
          }
        }
        forward_rows_kernel<T, K, kSwap, 0><<<plan.grid, kBlockThreads, 0, stream>>>(args);
      });
    });
    if (err == cudaSuccess) err = cudaGetLastError();
    if (err != cudaSuccess || (plan.splits == 1 && reduction == kNone)) return;
    // The finishing kernel, chained to the main grid on sm_90+.
    cudaLaunchAttribute chain[1];
    chain[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    chain[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(1);
    config.blockDim = dim3(kFinishThreads);
    config.stream = stream;
    config.attrs = chain;
    config.numAttrs = pr.cc_major >= 9 ? 1 : 0;
    const double divisor = reduction == kMean ? static_cast<double>(pr.rows) : 1.0;
    T* out = reduction == kNone ? nullptr : static_cast<T*>(loss);
    err = cudaLaunchKernelEx(&config, forward_finish_kernel<T>, args, plan.grid, divisor, out);
  });
  return err;
}

namespace {

template <typename T>
BackwardArgs<T> backward_args(const TripletProblem& pr, const LaunchPlan& plan, int64_t reduction,
                              const BackwardInputs& in) {
  using A = acc_t<T>;
  BackwardArgs<T> args{};
  fill_rows(args, pr, plan);
  args.margin = static_cast<A>(pr.margin);
  args.hinge_at_zero = in.hinge_at_zero;
  args.dists = static_cast<const A*>(in.dists);
  args.grad = static_cast<const T*>(in.grad);
  args.grad_stride = reduction == kNone ? 1 : 0;
  args.grad_scale = reduction == kMean ? A(1) / static_cast<A>(pr.rows) : A(1);
  args.grad_a = static_cast<T*>(in.grad_a);
  args.grad_p = static_cast<T*>(in.grad_p);
  args.grad_n = static_cast<T*>(in.grad_n);
  args.upstream_flag = reduction == kNone ? nullptr : in.upstream_flag;
  return args;
}

}  // namespace

cudaError_t launch_backward(const TripletProblem& pr, const LaunchPlan& plan, int64_t reduction,
                            const BackwardInputs& in, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  with_type(pr.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const BackwardArgs<T> args = backward_args<T>(pr, plan, reduction, in);
    with_kind(pr.p_norm, [&](auto kind) {
      constexpr NormKind K = decltype(kind)::value;
      if constexpr (K != NormKind::kOther && !std::is_same<T, double>::value) {
        if (plan.family == static_cast<int>(BackwardFamily::kPointwise)) {
          constexpr int64_t kVec = kVecBytes / sizeof(T);
          const auto packs = static_cast<uint32_t>(pr.rows * pr.dim / kVec);
          const auto row_packs = static_cast<uint32_t>(pr.dim / kVec);
          with_swap(pr.swap, [&](auto swap) {
            backward_pointwise_kernel<T, K, decltype(swap)::value>
                <<<plan.grid, kPointwiseThreads, 0, stream>>>(args, packs, row_packs);
          });
          return;
        }
      }
      backward_rows_kernel<T, K><<<plan.grid, kBlockThreads, 0, stream>>>(args);
    });
    err = cudaGetLastError();
  });
  return err;
}

cudaError_t launch_upstream(const TripletProblem& pr, int64_t reduction, const BackwardInputs& in,
                            cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  with_type(pr.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (kUpstreamLast<T>) {
      BackwardArgs<T> args = backward_args<T>(pr, row_geometry(pr), reduction, in);
      args.in_place = true;
      const int64_t packs = pr.rows * pr.dim / (kVecBytes / static_cast<int64_t>(sizeof(T)));
      const int64_t grid = std::max<int64_t>(
          1, std::min<int64_t>(kUpstreamBlocks, (packs + kBlockThreads - 1) / kBlockThreads));
      with_kind(pr.p_norm, [&](auto kind) {
        backward_rows_kernel<T, decltype(kind)::value><<<grid, kBlockThreads, 0, stream>>>(args);
      });
      err = cudaGetLastError();
    } else {
      err = cudaErrorInvalidValue;  // forward_family_unfit keeps other types off the one pass
    }
  });
  return err;
}

}  // namespace fused_triplet
