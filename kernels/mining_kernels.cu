// library-only {
// In-batch mining for mined_triplet_margin_loss (p = 2) on float embeddings (batch_hard's kernels
// read 2-byte ones as given, cast exactly; the others a float copy). No atomics: the same inputs
// give the same bits.
//   distances_kernel      exact distances of (anchor, candidate) tiles, torch's formula: the
//                         whole batch x batch (small batches) or one chunk of anchors.
//   column_sums_kernel, column_means_kernel
//                         larger batches: the rows' mean, the Gram products' centre.
//   centred_rows_kernel, gram_distances_kernel
//                         batch_all, larger batches: the rows less their mean, and distances from
//                         their float Gram products, exact where those are not accurate enough.
//   label_ranks_kernel, label_order_kernel, or label_tiles_kernel, label_merge_kernel
//                         batch_hard, large batches: the rows' order sorted by label (stable),
//                         by counting or by sorted tiles.
//   hard_loss_kernel      batch_hard: per anchor its hardest positive and negative (from the
//                         distances, or as hardest_kernel chose them), their distances in
//                         double sums, the hinge.
//   gram_rows_kernel      batch_hard, large batches: the sorted, centred rows rounded to bfloat16
//                         for the Gram products, and each row's error bounds.
//   hardest_kernel        batch_hard, large batches: from the bfloat16 Gram matrix's approximate
//                         squared distances and their error bounds, the candidates that can be
//                         the hardest positive or negative, decided by their exact distance.
//   hard_gradient_kernel, hard_gradient_sorted_kernel
//                         batch_hard's gradient: every row written once, no gathers (the
//                         anchors' choices scanned, or sorted by row for large batches).
//   batch_all_kernel      batch_all: per anchor, the sum and count of relu(margin + d_ap - d_an)
//                         over its (positive, negative) pairs; the weights d loss / d d(i, c) / d.
//   sparse_rows_gradient_kernel, sparse_columns_gradient_kernel
//                         semi_hard's gradient past the whole batch from a chunk's weights,
//                         their few nonzeros a row read as they are.
//   all_gradient_kernel, all_gradient_mma_kernel, gradient_parts_kernel
//                         batch_all's gradient from the whole batch's weights, tiled: exact
//                         differences in float (few tiles: the columns in parts, then their
//                         sum), or (more tiles) double tensor-core products.
//   mined_total_kernel    'mean' / 'sum' and the count, one block.
//   unit_rows_kernel, unit_rows_backward_kernel
//                         the rows scaled to unit length (the libraries' normalised
//                         embeddings) and the gradient through that scaling.
#include "mining_launch.h"
#include "triplet_device.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cmath>

namespace fused_triplet {

// ==== The mining table ====
// Small batches keep the batch x batch exact distances whole: two kernels pick every anchor's
// triplets (the step is a handful of launches), and batch_all keeps its weights for the
// backward. batch_hard up to 1024 rows (above, the bfloat16 Gram products cost less than every
// exact distance; up to it the whole batch's step is fewer launches), with a reference set up to
// 2048 (16 MiB; references run on the whole batch's kernels only); batch_all up to 4096 (its
// saved weights, 64 MiB, are the memory bound's allowance beyond the embeddings).
constexpr int64_t kWholeHardRows = 1024;
constexpr int64_t kWholeHardReferenceRows = 2048;
constexpr int64_t kWholeAllRows = 4096;
// Larger batches: a chunk x batch float buffer of at most 2^26 floats (256 MiB): the Gram
// products stay large enough for the tensor cores, the memory bounded at any batch.
constexpr int64_t kChunkFloats = int64_t(1) << 26;
// batch_hard's chunks of Gram products, bfloat16: up to 2^27 (256 MiB; then up to whole waves of
// the mining kernel where the budget below holds them, plan_mining), float's rows at half the
// bytes (against float products: (16384, 512) 0.96x the step, (32768, 128) 0.86x, (65536, 512)
// 0.95x). Each chunk's last wave leaves SMs idle (at (65536, 512) in 2 waves, the SMs active 64%
// of the kernel): 2^27 against 2^26 (65536, 512) 0.857x, bf16 0.973x; 2^25 took 1.04x at (16384,
// 512) and 1.19x at (65536, 512) against 2^26 (more, smaller chunks).
constexpr int64_t kHardChunkProducts = int64_t(1) << 27;
// ... fewer where the memory bound asks ((32768, 128) 94 MiB against 123 at 1.07x the time,
// (16384, 512) bf16 95 against 162 at 1.11x): a call's scratch within twice the embeddings' bytes
// + 64 MiB, plus the gradient's bytes (not yet allocated during the forward); beside the products,
// the rounded rows and under kRowScratchBytes a row (labels' order, bounds, classes, picks,
// state). Not below 2^24: there the chunks' launches cost 1.2-1.7x the time. Where the call
// copies the embeddings (unit rows), the backward holds as many float gradients as copies;
// where those alone pass the bound, full chunks: smaller ones would cost time and not meet it.
constexpr int64_t kMemoryAllowance = int64_t(64) << 20;
constexpr int64_t kRowScratchBytes = 160;
constexpr int64_t kHardChunkMinProducts = int64_t(1) << 24;
// batch_all (and semi_hard) from 2048 rows: distances from the float Gram products of the centred
// rows (cuBLAS, about 3x the exact kernel's rate).
constexpr int64_t kGramAllRows = 2048;
// A Gram distance is kept where d^2 >= (|x~_i|^2 + |x~_c|^2) / 4: its error, about sqrt(D) 2^-24
// (|x~_i|^2 + |x~_c|^2), is then within 4x the exact sum's; closer pairs get the exact distance.
constexpr float kGramKeepRatio = 4.f;
// Past the whole batch, batch_all's gradient takes its double products 512 rows of weights at a
// time: 64 MiB at 16384 rows, and as fast as 2049 (about 55 TFLOP/s).
constexpr int64_t kGradientPartRows = 512;
constexpr int kRowThreads = 256;  // a block per anchor row: 8 warps, loads in flight across it
constexpr int kRowUnroll = 16;    // batch_hard's bounds pass: columns each thread loads at once,
constexpr int kRowUnrollScalar = 8;  // ... or one by one (unaligned rows: 16 took 83 registers)
constexpr int kRowVector = 4;     // in 16-byte loads of 4 where rows are (batch % 4 == 0)
// Exact distances: elements of each row a lane loads at once (8 took batch_hard's mining kernel
// past 48 registers: 4 blocks an SM, not 5).
constexpr int kDistanceUnroll = 4;
constexpr int kTile = 64;         // tiled kernels: 64 x 64 outputs per block, 4 x 4 per thread
constexpr int kTileDepth = 16;    // elements of each row staged in shared memory per step
constexpr int kTileThreads = (kTile / 4) * (kTile / 4);
constexpr int kPositiveSlots = 2048;  // batch_all: positives staged per pass over the negatives,
constexpr int kPositiveGroup = 8;     // ... taken 8 at a time (a register each per thread)
constexpr int kColumnUnroll = 4;      // ... its row loop loading each thread's next 4 columns'
                                      // labels and distances before it looks at any
// batch_hard's gradient: each block scans every anchor's choices for its rows, a warp per row
// where that fills the GPU; from 8192 rows 8 rows a warp, so one scan of the anchors serves 64
// rows (the scans' reads grow as batch^2 / rows per block). From 16384 rows the choices sorted
// by the row chosen first and each row reads its own run; the sort's launches (at::sort of
// int32 keys, about 10) hide behind the forward's kernels there, not at 8192 rows.
constexpr int64_t kGradientSharedScanRows = 8192;
constexpr int kGradientRowsPerWarp = 8;
constexpr int64_t kGradientSortedRows = 16384;
constexpr int kGradientSlice = 8;     // ... each lane holding 8 elements of a row at a time
constexpr int kHitSlots = 1024;       // ... (anchor, row) pairs collected per scan round
// batch_all's whole-batch gradient on the double tensor cores (sm_90, where it was measured) where
// its 64 x 128 tiles make a wave (about the H200's 132 SMs): (2048, 512) 0.88x, (4096, 512)
// 0.73x the float kernel's step; fewer tiles leave SMs idle (1024 x 512: 1.10x), there the float
// kernel's 64 x 64 tiles.
constexpr int64_t kGradientMmaTiles = 128;
// The float gradient kernel's columns c split over up to 4 blocks a tile where its tiles are
// fewer than about a block an SM (dim 128: 32 tiles at 1024 rows), a second kernel adding the
// parts' sums; from 512 rows (below, a step is the host's: no launch is added there).
constexpr int64_t kGradientColumnBlocks = 128;
constexpr int64_t kGradientColumnPartsMax = 4;
constexpr int64_t kGradientColumnPartsFromRows = 512;
// semi_hard past the whole batch: its chunks' weights read for their few nonzeros (two a pair)
// instead of multiplied out in double (B x B x D products for 2 x pairs x D terms).
constexpr int kSparseUnroll = 8;    // ... each lane's loads in flight while it scans
constexpr int kSparseSlots = 512;   // ... a row's nonzeros listed per round (a warp's list)
constexpr int kColumnSlots = 8;     // ... a column's nonzeros listed per round and warp
// The Gram products' centre, the rows' mean, summed in 64 slices of rows apart (a block per 32
// columns and slice fills the GPU at every batch), then the slices in order: deterministic, and
// no scratch beyond [64, dim] doubles (torch's mean took 16 MiB at (4096, 512)).
constexpr int kMeanSlices = 64;
// batch_hard's label order on the device, two launches. Up to 4096 rows by counting, for each
// row, the labels before it (batch^2 compares: (4096, 512) 0.94x the step's GPU time of the
// tiles below; 117 us at 16384 rows). Above, tiles of 2048 rows sorted by a block of 1024
// threads (in registers; shared memory for far partners), then each row's place by binary
// searches of the other tiles ((16384, 512) 0.94x the step of counting, (32768, 128) 0.99x that
// of at::sort, whose 8 radix passes on int64 labels are about 20 launches of host work).
constexpr int64_t kCountLabelRows = 4096;
constexpr int kRankSlices = 32;       // ... counting: the columns split 32 ways (blocks an SM)
constexpr int kRankRowsPerThread = 4;  // ... each staged label compared with 4 rows'
constexpr int kLabelTile = 2048;
constexpr int kLabelThreads = 1024;
constexpr int kGradientRows = 64, kGradientCols = 128;  // all_gradient_mma_kernel's tile
// The Gram matrix's error on a squared distance d(i, c)^2, with x~ = x + r the centred rows
// rounded to bfloat16: 2 (x~_i . r_c + r_i . x_c) + accumulation, at most
// 2 (|x~_i| |r_c| + |r_i| |x_c|) + 2 gram_bound |x~_i| |x~_c|. 2ab <= w a^2 + b^2 / w splits it into
// a term per row; the weight w = 2^-10 sits near bfloat16's typical |r| / |x|, where the split
// loses least. Float accumulation of D products: 2^-23 each if tensor-core adds truncate, 2^-21
// per element leaves room for the float row terms and the exact distances.
constexpr float kGramRoundingWeight = 1.0f / (1 << 10);
constexpr float kGramPerElementBound = 1.0f / (1 << 21);
// The products are stored as bfloat16 (half the bytes written and read back as float): under
// 2^-7 |g| in any rounding mode, |g| <= |x~_i| |x~_c|, so 2^-6 |x~_i| |x~_c| on 2 g, which
// 2ab <= a^2 + b^2 splits into 2^-7 n^2 a row: 2^-8 more of gram_bound.
constexpr float kGramOutputBound = 1.0f / (1 << 8);

int64_t whole_batch_rows(Mining mining, bool references) {  // semi_hard: batch_all's
  if (mining != Mining::kBatchHard) return kWholeAllRows;
  return references ? kWholeHardReferenceRows : kWholeHardRows;
}

// hardest_kernel's blocks resident on one SM (defined with the launchers).
int hardest_blocks_per_sm(int vector, DType dtype);

MiningPlan plan_mining(Mining mining, int64_t batch, int64_t dim, int cc_major, int sm_count,
                       DType dtype, int64_t input_bytes, int64_t copy_bytes, bool references,
                       bool allow_whole) {
  MiningPlan plan;
  plan.whole = allow_whole && batch <= whole_batch_rows(mining, references);
  plan.gram_bound = float(dim + 16) * kGramPerElementBound + kGramOutputBound;
  plan.rounding_weight = kGramRoundingWeight;
  const int64_t hard_budget = 3 * input_bytes + kMemoryAllowance - copy_bytes -
                              batch * (dim * int64_t(sizeof(__nv_bfloat16)) + kRowScratchBytes);
  const bool bound_reachable = 2 * copy_bytes <= 2 * input_bytes + kMemoryAllowance;
  const int64_t chunk =
      mining != Mining::kBatchHard ? kChunkFloats
      : bound_reachable ? std::clamp<int64_t>(hard_budget / int64_t(sizeof(__nv_bfloat16)),
                                              kHardChunkMinProducts, kHardChunkProducts)
                        : kHardChunkProducts;
  plan.chunk_rows = plan.whole ? std::max<int64_t>(batch, 1)
                               : std::clamp<int64_t>(chunk / std::max<int64_t>(batch, 1), 1,
                                                     std::max<int64_t>(batch, 1));
  plan.row_block = kRowThreads;
  // 16-byte groups only where every thread gets one: below, most warps would get no columns.
  plan.vector = batch % kRowVector == 0 && batch >= kRowVector * kRowThreads ? kRowVector : 1;
  // batch_hard's chunks up to whole waves of the mining kernel (a block per anchor) where the
  // memory budget holds their products: with chunks of 2^26, (65536, 512) 1320 rows against 1024,
  // 0.945x the step (with 2^27, 2640 against 2048; not timed apart from the larger chunks).
  const int64_t wave = mining == Mining::kBatchHard && !plan.whole && sm_count > 0
                           ? int64_t(sm_count) * hardest_blocks_per_sm(plan.vector, dtype)
                           : 0;
  if (wave > 0 && plan.chunk_rows < batch) {
    const int64_t up = std::min(batch, (plan.chunk_rows + wave - 1) / wave * wave);
    if (bound_reachable && up * batch * int64_t(sizeof(__nv_bfloat16)) <= hard_budget) {
      plan.chunk_rows = up;
    }
  }
  plan.tile = kTile;
  plan.gram_distances = mining != Mining::kBatchHard && batch >= kGramAllRows;
  plan.gram_keep_ratio = kGramKeepRatio;
  plan.gradient_part_rows = std::min(kGradientPartRows, plan.chunk_rows);
  plan.gradient_rows_per_warp = batch >= kGradientSharedScanRows ? kGradientRowsPerWarp : 1;
  plan.gradient_sorted_choices = batch >= kGradientSortedRows;
  plan.sparse_gradient = mining == Mining::kSemiHard;
  plan.gradient_tensor_cores = cc_major >= 9 && (batch + kGradientRows - 1) / kGradientRows *
                                                     ((dim + kGradientCols - 1) / kGradientCols) >=
                                                 kGradientMmaTiles;
  const int64_t float_tiles =
      std::max<int64_t>(((batch + kTile - 1) / kTile) * ((dim + kTile - 1) / kTile), 1);
  plan.gradient_column_parts =
      plan.gradient_tensor_cores || batch < kGradientColumnPartsFromRows
          ? 1
          : int(std::clamp<int64_t>((kGradientColumnBlocks + float_tiles - 1) / float_tiles, 1,
                                    kGradientColumnPartsMax));
  plan.mean_slices = kMeanSlices;
  plan.count_labels = batch <= kCountLabelRows;
  plan.rank_slices = kRankSlices;
  return plan;
}

namespace {

// The chunk's rows as T: the launchers pick T from chunk.dtype.
template <typename T>
__device__ __forceinline__ const T* rows_of(const MiningChunk& chunk) {
  return static_cast<const T*>(chunk.embeddings);
}

// torch's pairwise_distance squared, sum(((a - b) + eps)^2) in float, lanes striding the row; the
// butterfly leaves the same bits in every lane.
template <typename T>
__device__ float exact_sq_distance(const T* a, const T* b, int64_t dim, float eps, int lane) {
  float acc = 0.f;
  int64_t k = lane;
  for (; k + 32 * (kDistanceUnroll - 1) < dim; k += 32 * kDistanceUnroll) {
    float x[kDistanceUnroll], y[kDistanceUnroll];
#pragma unroll
    for (int u = 0; u < kDistanceUnroll; ++u) {
      x[u] = to_acc(a[k + 32 * u]);
      y[u] = to_acc(b[k + 32 * u]);
    }
#pragma unroll
    for (int u = 0; u < kDistanceUnroll; ++u) {
      const float v = (x[u] - y[u]) + eps;
      acc = fmaf(v, v, acc);
    }
  }
  for (; k < dim; k += 32) {
    const float v = (to_acc(a[k]) - to_acc(b[k])) + eps;
    acc = fmaf(v, v, acc);
  }
  return warp_all_reduce(acc, Plus());
}

// A chosen candidate: NaN beats numbers (torch's max and min propagate NaN), then the larger
// (positives) or smaller (negatives) value, then the smaller index. index -1: none yet.
struct Pick {
  float value;
  int64_t index;
};

template <bool kLargest>
__device__ bool beats(const Pick& x, const Pick& y) {
  if (x.index < 0) return false;
  if (y.index < 0) return true;
  const bool x_nan = x.value != x.value, y_nan = y.value != y.value;
  if (x_nan != y_nan) return x_nan;
  if (!x_nan && x.value != y.value) return kLargest ? x.value > y.value : x.value < y.value;
  return x.index < y.index;
}

__device__ __forceinline__ Pick shfl_xor(Pick pick, int offset) {
  return {fused_triplet::shfl_xor(pick.value, offset), fused_triplet::shfl_xor(pick.index, offset)};
}

// The first column that can be an anchor's positive or negative: the reference set's first row
// (an anchor must lie before it; a reference row has none: the batch's end), else 0.
__device__ __forceinline__ int64_t first_candidate(const MiningChunk& chunk, int64_t anchor) {
  const int64_t from = chunk.batch - chunk.references;
  return chunk.references == 0 ? 0 : anchor < from ? from : chunk.batch;
}

// The row of the kernels that give each warp of a kRowThreads block its own row, and the
// blocks they launch for `rows` rows.
__device__ __forceinline__ int64_t warp_row() {
  return int64_t(blockIdx.x) * (kRowThreads / 32) + threadIdx.x / 32;
}
constexpr int64_t warp_row_blocks(int64_t rows) {
  return (rows + kRowThreads / 32 - 1) / (kRowThreads / 32);
}

// The rule's distance from a float squared distance: d or d^2 / 2.
__device__ __forceinline__ float rule_distance(const LossRule& rule, float square) {
  return rule.half_square ? square / 2 : sqrtf(square);
}

// batch_hard's bounds by sorted position: a column c's t = centre_c - 2 gram (d(s, c)^2's term
// from c and the product) is within spread_c of the exact one, so d(s, c)^2 lies within
// [lower_s + t - spread_c, upper_s + t + spread_c], (lower_s, upper_s) the anchor's terms;
// thread_spreads: each hardest_kernel thread's widest spread among its negative pass's columns
// (inf where one is not finite), so that pass reads no spreads. launch_gram_rows writes them.
struct GramBounds {
  float* centres;
  float* spreads;
  float2* anchors;
  float* thread_spreads;
};

GramBounds gram_bounds(float* floats, int64_t batch) {  // floats: gram_bounds_floats(batch)
  return {floats, floats + batch, reinterpret_cast<float2*>(floats + 2 * batch),
          floats + 4 * batch};
}

// batch_hard's Gram inputs, a warp per sorted position s: the embedding order[s] less the batch
// mean, x, rounded to bfloat16 (x~ = x + r), and its bounds' terms, by the spreads of the table:
// w n^2 + |r|^2 / w + 2 gram_bound n^2 (n = max(|x|, |x~|); (n + eps sqrt(D))^2 in the last term
// for an anchor) around |x|^2 - 2 eps sum(x) as a candidate (centre and spread), |x|^2 + 2 eps
// sum(x) + D eps^2 as an anchor (lower and upper).
template <typename T>
__global__ void __launch_bounds__(kRowThreads)
    gram_rows_kernel(MiningChunk chunk, MiningPlan plan, const int64_t* order, const float* mean,
                     __nv_bfloat16* rounded, GramBounds bounds, int64_t* classes) {
  const int lane = threadIdx.x % 32;
  const int64_t s = warp_row();
  if (s >= chunk.batch) return;
  const int64_t dim = chunk.dim;
  if (lane < 2) {  // s's class range [first, last) in the sorted labels: lane 1 its end, lane 0 its start
    const bool last = lane == 1;
    const int64_t* labels = chunk.ids;
    const int64_t my_id = labels[s];
    int64_t lo = last ? s + 1 : 0, hi = last ? chunk.batch : s;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (last ? labels[mid] <= my_id : labels[mid] < my_id) lo = mid + 1; else hi = mid;
    }
    classes[2 * s + last] = lo;
  }
  const T* row = rows_of<T>(chunk) + order[s] * dim;
  __nv_bfloat16* out = rounded + s * dim;
  float sq = 0.f, sum = 0.f, rounded_sq = 0.f, residual_sq = 0.f;
  for (int64_t k = lane; k < dim; k += 32) {
    const float x = to_acc(row[k]) - mean[k];
    const __nv_bfloat16 b = __float2bfloat16_rn(x);
    const float w = __bfloat162float(b), r = x - w;
    out[k] = b;
    sq = fmaf(x, x, sq);
    sum += x;
    rounded_sq = fmaf(w, w, rounded_sq);
    residual_sq = fmaf(r, r, residual_sq);
  }
  sq = warp_all_reduce(sq, Plus());
  sum = warp_all_reduce(sum, Plus());
  rounded_sq = warp_all_reduce(rounded_sq, Plus());
  residual_sq = warp_all_reduce(residual_sq, Plus());
  if (lane != 0) return;
  const float eps = chunk.eps, n2 = fmaxf(sq, rounded_sq), w = plan.rounding_weight;
  const float rounding = w * n2 + residual_sq / w;
  const float anchor_norm = sqrtf(n2) + eps * sqrtf(float(dim));
  const float as_anchor = sq + 2.f * eps * sum + float(dim) * eps * eps;
  const float anchor_spread = rounding + 2.f * plan.gram_bound * anchor_norm * anchor_norm;
  // A row whose t could pass float's range (|t| <= 3 n^2 + ...), or not finite, gets no bounds:
  // every interval with it is NaN or infinite, a candidate decided by its exact distance.
  const bool bounded = n2 < FLT_MAX / 8;
  bounds.centres[s] = sq - 2.f * eps * sum;
  bounds.spreads[s] = bounded ? rounding + 2.f * plan.gram_bound * n2 : INFINITY;
  bounds.anchors[s] = bounded ? make_float2(as_anchor - anchor_spread, as_anchor + anchor_spread)
                              : make_float2(NAN, NAN);
}

// hardest_kernel's negative pass gives each thread groups of `vector` columns: the first from
// vector x thread, the next every vector x kRowThreads (its walk and thread_spreads_kernel read
// the same ones).
__device__ __forceinline__ int64_t first_negative_group(int64_t thread, int vector) {
  return thread * vector;
}
constexpr int64_t negative_group_stride(int vector) { return int64_t(vector) * kRowThreads; }

// A warp per hardest_kernel thread: the widest spread among its negative pass's columns, inf
// past float's.
__global__ void __launch_bounds__(kRowThreads)
    thread_spreads_kernel(GramBounds bounds, int64_t batch, int vector) {
  const int64_t thread = warp_row();
  const int lane = threadIdx.x % 32;
  if (thread >= kRowThreads) return;
  float widest = 0.f;
  for (int64_t first = first_negative_group(thread, vector) + lane * negative_group_stride(vector);
       first < batch; first += 32 * negative_group_stride(vector)) {
    for (int64_t c = first; c < std::min(first + vector, batch); ++c) {
      const float spread = bounds.spreads[c];
      widest = spread <= widest ? widest : spread < INFINITY ? spread : INFINITY;  // NaN: inf
    }
  }
  widest = warp_all_reduce(widest, [](float a, float b) { return fmaxf(a, b); });
  if (lane == 0) bounds.thread_spreads[thread] = widest;
}

// One thread's pass over a row of hardest_kernel, in t = centre - 2 gram: the negatives in
// 16-byte groups where rows are aligned (first_negative_group's), the class's columns strided
// over the block.
struct RowScan {
  // Negatives: the two smallest t and their columns, and the third smallest (t alone: the
  // spreads wait for the few columns that can matter).
  float bottom = INFINITY, next_bottom = INFINITY, third_bottom = INFINITY;
  int bottom_column = -1, next_bottom_column = -1;
  // Positives: the largest lower t, and the largest upper t, its column and the runner-up.
  float floor = -INFINITY, top = -INFINITY, next_top = -INFINITY;
  int top_column = -1;
  float positive_spans = 0.f;  // sum of upper - lower: not finite where a bound is not
};

template <int kVector>
__device__ __forceinline__ RowScan scan_row_bounds(const MiningChunk& chunk,
                                                   const __nv_bfloat16* gram_row,
                                                   const GramBounds& bounds, int64_t me,
                                                   int64_t class_first, int64_t class_last) {
  constexpr int kColumns = kVector == 4 ? kRowUnroll : kRowUnrollScalar;
  constexpr int kGroups = kColumns / kVector;  // groups of columns loaded at once
  const int64_t batch = chunk.batch;
  const auto in_class = [&](int64_t c) {
    return uint64_t(c - class_first) < uint64_t(class_last - class_first);
  };
  RowScan scan;
  constexpr int64_t kStride = negative_group_stride(kVector);
  for (int64_t base = first_negative_group(threadIdx.x, kVector); base < batch;
       base += kGroups * kStride) {
    float products[kColumns], centres[kColumns];
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const int64_t c = base + g * kStride;
      if constexpr (kVector == 4) {  // batch % 4 == 0: the group is whole and 16-byte aligned
        const uint2 p = c < batch ? *reinterpret_cast<const uint2*>(gram_row + c)  // 4 products
                                  : make_uint2(0u, 0u);
        const float2 p01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&p.x));
        const float2 p23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&p.y));
        const float4 t = c < batch ? *reinterpret_cast<const float4*>(bounds.centres + c)
                                   : make_float4(0.f, 0.f, 0.f, 0.f);
        products[g * 4] = p01.x, products[g * 4 + 1] = p01.y;
        products[g * 4 + 2] = p23.x, products[g * 4 + 3] = p23.y;
        centres[g * 4] = t.x, centres[g * 4 + 1] = t.y, centres[g * 4 + 2] = t.z;
        centres[g * 4 + 3] = t.w;
      } else {
        products[g] = c < batch ? __bfloat162float(gram_row[c]) : 0.f;
        centres[g] = c < batch ? bounds.centres[c] : 0.f;
      }
    }
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const int64_t first = base + g * kStride;
      if (first >= batch) continue;
      const auto negative = [&](int j) {
        const float t = fmaf(-2.f, products[g * kVector + j], centres[g * kVector + j]);
        const bool below_bottom = t < scan.bottom, below_next = t < scan.next_bottom;
        // a NaN t leaves the columns and pulls the third down to the second: more walks
        scan.third_bottom = fminf(scan.third_bottom, fmaxf(scan.next_bottom, t));
        scan.next_bottom_column = below_bottom ? scan.bottom_column
                                  : below_next ? int(first) + j
                                               : scan.next_bottom_column;
        scan.next_bottom = below_bottom ? scan.bottom : fminf(scan.next_bottom, t);
        scan.bottom_column = below_bottom ? int(first) + j : scan.bottom_column;
        scan.bottom = fminf(scan.bottom, t);
      };
      // Only a group that meets the anchor's class tests each column: the others (nearly all)
      // run without the per-column compares and branches.
      if (first < class_last && first + kVector > class_first) {
#pragma unroll
        for (int j = 0; j < kVector; ++j) {
          if (!in_class(first + j)) negative(j);
        }
      } else {
#pragma unroll
        for (int j = 0; j < kVector; ++j) negative(j);
      }
    }
  }
  for (int64_t c = class_first + threadIdx.x; c < class_last; c += kRowThreads) {
    if (c == me) continue;
    const float t = fmaf(-2.f, __bfloat162float(gram_row[c]), bounds.centres[c]);
    const float spread = bounds.spreads[c];
    const float lower = t - spread, upper = t + spread;
    scan.positive_spans += upper - lower;
    scan.floor = fmaxf(scan.floor, lower);
    scan.top_column = upper > scan.top ? int(c) : scan.top_column;
    scan.next_top = fmaxf(scan.next_top, fminf(scan.top, upper));
    scan.top = fmaxf(scan.top, upper);
  }
  return scan;
}

// A block per anchor row, the batch sorted by label: the anchor's positives are the columns of its
// class's range (gram_rows_kernel's classes), the negatives every other column. Each pass works
// on t = centre - 2 gram (d^2's interval is the anchor's term + t +- the column's spread, rounding
// monotone in t). First the bounds (scan_row_bounds): a lower bound of the row's largest positive
// squared distance; an upper bound of its smallest negative one, the least upper end of the
// threads' best negatives; each thread's most promising positive column and two negative ones,
// and the bound of the next (for negatives with the thread's widest spread). A column whose
// interval can beat the row's bound is a candidate and gets its exact distance from the whole
// warp: the true extreme always is one, so it is always decided exactly. Threads whose next can
// be a candidate too (or that saw a bound that is not finite) walk those columns again. The warps
// then combine picks. One body past 100 lines: its passes share the row's bounds and each
// thread's picks in registers, which a split would send through memory.
template <int kVector, typename T>
__global__ void __launch_bounds__(kRowThreads)
    hardest_kernel(MiningChunk chunk, const __nv_bfloat16* gram, GramBounds bounds,
                   const int64_t* classes, const int64_t* order, int64_t* positive,
                   int64_t* negative, bool* valid) {
  constexpr int kWarps = kRowThreads / 32;
  __shared__ float warp_floors[kWarps], warp_ceilings[kWarps];
  __shared__ Pick warp_positives[kWarps], warp_negatives[kWarps];
  __shared__ int listed_counts[3][kWarps], listed[3 * kRowThreads];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t row = blockIdx.x, me = chunk.first + row, batch = chunk.batch;
  const int64_t class_first = classes[2 * me], class_last = classes[2 * me + 1];
  const __nv_bfloat16* gram_row = gram + row * batch;
  const float2 mine = bounds.anchors[me];
  const auto in_class = [&](int64_t c) {
    return uint64_t(c - class_first) < uint64_t(class_last - class_first);
  };
  const RowScan scan =
      scan_row_bounds<kVector>(chunk, gram_row, bounds, me, class_first, class_last);
  float floor = scan.floor, top = scan.top, next_top = scan.next_top;
  const int64_t top_column = scan.top_column, bottom_column = scan.bottom_column;
  const float positive_spans = scan.positive_spans;
  // The best negative's interval in t; an upper end that is not finite bounds nothing.
  const float bottom_spread = bottom_column >= 0 ? bounds.spreads[bottom_column] : 0.f;
  float ceiling = scan.bottom + bottom_spread;
  ceiling = ceiling < INFINITY ? ceiling : INFINITY;
  floor = warp_all_reduce(floor, [](float a, float b) { return fmaxf(a, b); });
  ceiling = warp_all_reduce(ceiling, [](float a, float b) { return fminf(a, b); });
  if (lane == 0) warp_floors[warp] = floor, warp_ceilings[warp] = ceiling;
  __syncthreads();
  for (int w = 0; w < kWarps; ++w) {
    floor = fmaxf(floor, warp_floors[w]);
    ceiling = fminf(ceiling, warp_ceilings[w]);
  }
  // From t to d^2: the row's bounds, and this thread's best and runner-up.
  const bool odd_anchor = !(fabsf(mine.x) < INFINITY && fabsf(mine.y) < INFINITY);
  floor = floor > -INFINITY ? mine.x + floor : -INFINITY;
  ceiling = ceiling < INFINITY ? mine.y + ceiling : INFINITY;
  const auto as_upper = [&](float t) { return t > -INFINITY ? mine.y + t : -INFINITY; };
  top = as_upper(top), next_top = as_upper(next_top);
  const float bottom = mine.x + (scan.bottom - bottom_spread);
  // the least lower end any of the thread's negatives past its two smallest can have
  // (NaN, so a walk, where the thread's spreads are not finite)
  const float beyond = mine.x + (scan.third_bottom - bounds.thread_spreads[threadIdx.x]);
  const bool walks_positives = odd_anchor || !(fabsf(positive_spans) < INFINITY) ||
                               (next_top > -INFINITY && next_top >= floor);
  const bool walks_negatives = odd_anchor || !(beyond > ceiling);
  const T* embeddings = rows_of<T>(chunk);
  const T* anchor_row = embeddings + order[me] * chunk.dim;
  Pick best_positive{0.f, -1}, best_negative{0.f, -1};
  // The exact distance of sorted column c, kept where it beats the pick so far.
  const auto decide = [&](int64_t c, bool is_positive) {
    const int64_t column = order[c];
    const Pick exact{exact_sq_distance(anchor_row, embeddings + column * chunk.dim, chunk.dim,
                                       chunk.eps, lane),
                     column};
    if (is_positive) {
      if (beats<true>(exact, best_positive)) best_positive = exact;
    } else if (beats<false>(exact, best_negative)) {
      best_negative = exact;
    }
  };
  // The warp decides the lanes' candidates of one step, c at each lane.
  const auto decide_lanes = [&](bool is_candidate, int64_t c, bool is_positive) {
    for (unsigned found = __ballot_sync(0xffffffffu, is_candidate); found != 0;
         found &= found - 1) {
      decide(__shfl_sync(0xffffffffu, c, __ffs(found) - 1), is_positive);
    }
  };
  // The threads that do not walk: their one positive and two negative candidates at most,
  // listed for the block, each warp deciding every kWarps-th (the class's columns, all in the
  // first warps, would queue their decisions there).
  const bool lists_positive = !walks_positives && top_column >= 0 && top >= floor;
  const bool lists_negative =
      !walks_negatives && bottom_column >= 0 && !(bottom > ceiling);
  const int next_column = scan.next_bottom_column;
  const bool lists_next_negative =
      !walks_negatives && next_column >= 0 &&
      !(mine.x + (scan.next_bottom - bounds.spreads[next_column]) > ceiling);
  const BlockPlaces<3> places = block_places<kRowThreads>(
      {lists_positive, lists_negative, lists_next_negative}, listed_counts);
  if (lists_positive) listed[places.at[0]] = int(top_column);
  if (lists_negative) listed[places.at[1]] = int(bottom_column);
  if (lists_next_negative) listed[places.at[2]] = next_column;
  __syncthreads();
  for (int k = warp; k < places.starts[3]; k += kWarps) decide(listed[k], k < places.starts[1]);
  // The walking threads' columns again; a NaN interval is always a candidate.
  const auto interval = [&](int64_t c) {
    const float t = fmaf(-2.f, __bfloat162float(gram_row[c]), bounds.centres[c]);
    const float spread = bounds.spreads[c];
    return make_float2(mine.x + (t - spread), mine.y + (t + spread));
  };
  if (__any_sync(0xffffffffu, walks_positives)) {
    for (int64_t first = class_first + int64_t(warp) * 32; first < class_last;
         first += kRowThreads) {
      const int64_t c = first + lane;
      bool is_candidate = false;
      if (walks_positives && c < class_last && c != me) {
        const float2 d2 = interval(c);
        is_candidate = d2.x != d2.x || d2.y != d2.y || d2.y >= floor;
      }
      decide_lanes(is_candidate, c, true);
    }
  }
  // Each walking lane's columns in turn, the warp's lanes taking 32 of its groups at once.
  for (unsigned walkers = __ballot_sync(0xffffffffu, walks_negatives); walkers != 0;
       walkers &= walkers - 1) {
    const int walker = __ffs(walkers) - 1;
    // 32-bit columns (batch < 2^31, so below 2^32 here): fewer registers than 64-bit ones
    constexpr unsigned kStride = unsigned(negative_group_stride(kVector));
    const unsigned start = unsigned(first_negative_group(warp * 32 + walker, kVector));
    for (unsigned round = start; round < batch; round += 32 * kStride) {
      const unsigned first = round + lane * kStride;
      for (int j = 0; j < kVector; ++j) {
        const unsigned c = first + j;
        bool is_candidate = false;
        if (c < batch && !in_class(c)) {
          const float2 d2 = interval(c);
          is_candidate = d2.x != d2.x || d2.y != d2.y || d2.x <= ceiling;
        }
        decide_lanes(is_candidate, c, false);
      }
    }
  }
  if (lane == 0) warp_positives[warp] = best_positive, warp_negatives[warp] = best_negative;
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < kWarps; ++w) {
    if (beats<true>(warp_positives[w], best_positive)) best_positive = warp_positives[w];
    if (beats<false>(warp_negatives[w], best_negative)) best_negative = warp_negatives[w];
  }
  const int64_t anchor = order[me];
  positive[anchor] = best_positive.index >= 0 ? best_positive.index : anchor;
  negative[anchor] = best_negative.index >= 0 ? best_negative.index : anchor;
  valid[anchor] = best_positive.index >= 0 && best_negative.index >= 0;
}

template <typename T>
__global__ void __launch_bounds__(kTileThreads) distances_kernel(MiningChunk chunk, float* dists) {
  // Rows staged as float, (depth, row); past the row's end the anchor holds 0 and the candidate
  // eps, so (0 - eps) + eps adds exactly 0.
  __shared__ __align__(16) float anchors[kTileDepth][kTile + 4];
  __shared__ __align__(16) float candidates[kTileDepth][kTile + 4];
  const T* embeddings = rows_of<T>(chunk);
  const int tx = threadIdx.x % (kTile / 4), ty = threadIdx.x / (kTile / 4);
  const int64_t row0 = int64_t(blockIdx.y) * kTile, col0 = int64_t(blockIdx.x) * kTile;
  const float eps = chunk.eps;
  constexpr int kLoads = kTile * kTileDepth / kTileThreads;
  // Each step's elements are loaded into registers one step ahead, in flight during the sums.
  float next_anchors[kLoads], next_candidates[kLoads];
  const auto load = [&](int64_t k0) {
#pragma unroll
    for (int q = 0; q < kLoads; ++q) {
      const int e = threadIdx.x + q * kTileThreads, r = e / kTileDepth, kk = e % kTileDepth;
      const int64_t k = k0 + kk, a = row0 + r, c = col0 + r;
      const bool inside = k < chunk.dim;
      next_anchors[q] = inside && a < chunk.rows
                            ? to_acc(embeddings[(chunk.first + a) * chunk.dim + k]) : 0.f;
      next_candidates[q] =
          !inside ? eps : c < chunk.batch ? to_acc(embeddings[c * chunk.dim + k]) : 0.f;
    }
  };
  float acc[4][4] = {};
  load(0);
  for (int64_t k0 = 0; k0 < chunk.dim; k0 += kTileDepth) {
#pragma unroll
    for (int q = 0; q < kLoads; ++q) {
      const int e = threadIdx.x + q * kTileThreads, r = e / kTileDepth, kk = e % kTileDepth;
      anchors[kk][r] = next_anchors[q];
      candidates[kk][r] = next_candidates[q];
    }
    __syncthreads();
    if (k0 + kTileDepth < chunk.dim) load(k0 + kTileDepth);
#pragma unroll
    for (int kk = 0; kk < kTileDepth; ++kk) {
      const float4 a = *reinterpret_cast<const float4*>(&anchors[kk][ty * 4]);
      const float4 b = *reinterpret_cast<const float4*>(&candidates[kk][tx * 4]);
      const float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float v = (av[i] - bv[j]) + eps;
          acc[i][j] = fmaf(v, v, acc[i][j]);
        }
      }
    }
    __syncthreads();
  }
  for (int i = 0; i < 4; ++i) {
    const int64_t a = row0 + ty * 4 + i;
    if (a >= chunk.rows) continue;
    for (int j = 0; j < 4; ++j) {
      const int64_t c = col0 + tx * 4 + j;
      if (c < chunk.batch) {
        dists[a * chunk.batch + c] = rule_distance(chunk.rule, acc[i][j]);
      }
    }
  }
}

// The rows' mean, first per slice of rows: a block per 32 columns and slice, lanes along the
// rows, warps down the slice, the warps' sums added in order. partials: [slices, dim] double.
template <typename T>
__global__ void __launch_bounds__(kRowThreads)
    column_sums_kernel(const T* x, int64_t batch, int64_t dim, double* partials) {
  constexpr int kWarps = kRowThreads / 32;
  __shared__ double warp_sums[kWarps][32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t column = int64_t(blockIdx.x) * 32 + lane;
  const int64_t slice_rows = (batch + gridDim.y - 1) / gridDim.y;
  const int64_t from = int64_t(blockIdx.y) * slice_rows;
  const int64_t to = std::min(batch, from + slice_rows);
  double sum = 0.0;
  if (column < dim) {
#pragma unroll 4
    for (int64_t r = from + warp; r < to; r += kWarps) sum += to_acc(x[r * dim + column]);
  }
  warp_sums[warp][lane] = sum;
  __syncthreads();
  if (warp != 0 || column >= dim) return;
  for (int w = 1; w < kWarps; ++w) sum += warp_sums[w][lane];
  partials[blockIdx.y * dim + column] = sum;
}

// ... then a thread per column adds the slices in order.
__global__ void column_means_kernel(const double* partials, int slices, int64_t batch,
                                    int64_t dim, float* mean) {
  const int64_t column = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (column >= dim) return;
  double sum = 0.0;
  for (int s = 0; s < slices; ++s) sum += partials[s * dim + column];
  mean[column] = float(sum / double(batch));
}

// batch_hard's label order by counting, first per slice of columns: for each row, how many of
// the slice's rows come before it in the stable order (a smaller label, or the same at a smaller
// index). kRankRowsPerThread rows a thread, the slice's labels staged through shared memory.
// ahead: [slices, batch] int32.
__global__ void __launch_bounds__(kRowThreads)
    label_ranks_kernel(const int64_t* labels, int64_t batch, int32_t* ahead) {
  constexpr int kRows = kRankRowsPerThread;
  __shared__ int64_t staged[kRowThreads];
  const int64_t slice_columns = (batch + gridDim.y - 1) / gridDim.y;
  const int64_t from = int64_t(blockIdx.y) * slice_columns;
  const int64_t to = std::min(batch, from + slice_columns);
  int64_t row[kRows], mine[kRows];
  int32_t count[kRows];
#pragma unroll
  for (int u = 0; u < kRows; ++u) {
    row[u] = (int64_t(blockIdx.x) * kRows + u) * kRowThreads + threadIdx.x;
    mine[u] = row[u] < batch ? labels[row[u]] : 0;
    count[u] = 0;
  }
  for (int64_t base = from; base < to; base += kRowThreads) {
    __syncthreads();  // the last tile's labels read by every thread
    if (base + threadIdx.x < to) staged[threadIdx.x] = labels[base + threadIdx.x];
    __syncthreads();
    const int staged_count = int(std::min<int64_t>(kRowThreads, to - base));
    for (int j = 0; j < staged_count; ++j) {
      const int64_t label = staged[j];
#pragma unroll
      for (int u = 0; u < kRows; ++u) {
        count[u] += label < mine[u] || (label == mine[u] && base + j < row[u]);
      }
    }
  }
#pragma unroll
  for (int u = 0; u < kRows; ++u) {
    if (row[u] < batch) ahead[int64_t(blockIdx.y) * batch + row[u]] = count[u];
  }
}

// ... then a thread per row adds its slices' counts: its place in the stable order.
__global__ void label_order_kernel(const int64_t* labels, const int32_t* ahead, int slices,
                                   int64_t batch, int64_t* sorted_labels, int64_t* order) {
  const int64_t row = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= batch) return;
  int64_t place = 0;
  for (int s = 0; s < slices; ++s) place += ahead[s * batch + row];
  order[place] = row;
  sorted_labels[place] = labels[row];
}

// A (label, row) pair of batch_hard's label order; rows are unique, so the order is total.
struct LabelRow {
  int64_t label;
  int32_t row;
};

__device__ __forceinline__ bool before(const LabelRow& x, const LabelRow& y) {
  return x.label < y.label || (x.label == y.label && x.row < y.row);
}

// batch_hard's label order, first per tile of kLabelTile rows: the tile's pairs sorted (bitonic,
// two a thread at places 2 t and 2 t + 1): partners within a warp by shuffles, farther ones
// (15 of the 66 steps) through shared memory. Past the batch's end the pairs are (int64 max,
// int32 max), after every real one.
__global__ void __launch_bounds__(kLabelThreads)
    label_tiles_kernel(const int64_t* labels, int64_t batch, int64_t* tile_labels,
                       int32_t* tile_rows) {
  static_assert(kLabelTile == 2 * kLabelThreads, "two pairs a thread");
  __shared__ int64_t keys[kLabelTile];
  __shared__ int32_t rows[kLabelTile];
  const int t = threadIdx.x;
  const int64_t first = int64_t(blockIdx.x) * kLabelTile;
  LabelRow mine[2];
  for (int k = 0; k < 2; ++k) {
    const int64_t r = first + 2 * t + k;
    mine[k] = r < batch ? LabelRow{labels[r], int32_t(r)} : LabelRow{INT64_MAX, INT32_MAX};
  }
  for (int size = 2; size <= kLabelTile; size *= 2) {
    for (int stride = size / 2; stride > 0; stride /= 2) {
      const bool ascending = ((2 * t) & size) == 0;  // the same for both places (size >= 2)
      if (stride == 1) {
        if (before(mine[1], mine[0]) == ascending) {
          const LabelRow x = mine[0];
          mine[0] = mine[1], mine[1] = x;
        }
        continue;
      }
      LabelRow other[2];
      if (stride < 64) {  // the partner's places 2 (t ^ stride / 2) + k: a lane of this warp
        for (int k = 0; k < 2; ++k) {
          other[k] = {__shfl_xor_sync(0xffffffffu, mine[k].label, stride / 2),
                      __shfl_xor_sync(0xffffffffu, mine[k].row, stride / 2)};
        }
      } else {
        for (int k = 0; k < 2; ++k) keys[2 * t + k] = mine[k].label, rows[2 * t + k] = mine[k].row;
        __syncthreads();
        for (int k = 0; k < 2; ++k) {
          other[k] = {keys[(2 * t + k) ^ stride], rows[(2 * t + k) ^ stride]};
        }
        __syncthreads();
      }
      // The lower place keeps the run's first of the two, the upper its second.
      const bool keeps_first = (((2 * t) & stride) == 0) == ascending;
      for (int k = 0; k < 2; ++k) {
        if (before(other[k], mine[k]) == keeps_first) mine[k] = other[k];
      }
    }
  }
  for (int k = 0; k < 2; ++k) {
    const int64_t r = first + 2 * t + k;
    if (r < batch) tile_labels[r] = mine[k].label, tile_rows[r] = mine[k].row;
  }
}

// ... then a thread per pair: its place in the stable order is its place in its tile plus, in
// every other tile (a binary search), the rows before it: an earlier tile's rows come first at
// an equal label, a later tile's after.
__global__ void __launch_bounds__(kRowThreads)
    label_merge_kernel(const int64_t* tile_labels, const int32_t* tile_rows, int64_t batch,
                       int64_t* sorted_labels, int64_t* order) {
  const int64_t s = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (s >= batch) return;
  const int64_t my_tile = s / kLabelTile, label = tile_labels[s];
  int64_t place = s - my_tile * kLabelTile;
  for (int64_t tile = 0; tile * kLabelTile < batch; ++tile) {
    if (tile == my_tile) continue;
    const int64_t* keys = tile_labels + tile * kLabelTile;
    const bool equal_before = tile < my_tile;
    int64_t lo = 0, hi = std::min<int64_t>(kLabelTile, batch - tile * kLabelTile);
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (equal_before ? keys[mid] <= label : keys[mid] < label) lo = mid + 1; else hi = mid;
    }
    place += lo;
  }
  order[place] = tile_rows[s];
  sorted_labels[place] = label;
}

// A warp per row: x~ = x - mean (float, the Gram products' rows) and its terms (|x~|^2, sum x~),
// summed in double.
__global__ void __launch_bounds__(kRowThreads)
    centred_rows_kernel(const float* x, const float* mean, int64_t batch, int64_t dim,
                        float* centred, float2* terms) {
  const int64_t row = warp_row();
  if (row >= batch) return;
  const int lane = threadIdx.x % 32;
  double square = 0.0, sum = 0.0;
  for (int64_t k = lane; k < dim; k += 32) {
    const float v = x[row * dim + k] - mean[k];
    centred[row * dim + k] = v;
    square += double(v) * v;
    sum += v;
  }
  square = warp_all_reduce(square, Plus());
  sum = warp_all_reduce(sum, Plus());
  if (lane == 0) terms[row] = make_float2(float(square), float(sum));
}

// A block per anchor row, in place: the Gram products g = x~_i . x~_c of the chunk's rows become
// the rule's distances, d^2 = |x~_i|^2 + |x~_c|^2 - 2 g + 2 eps (sum x~_i - sum x~_c) + D eps^2
// (torch's |a - b + eps|^2). Where d^2 is below (|x~_i|^2 + |x~_c|^2) / keep_ratio (close pairs,
// whose products cancel) or not finite, the warp computes the exact distance instead.
__global__ void __launch_bounds__(kRowThreads)
    gram_distances_kernel(MiningChunk chunk, const float2* terms, float keep_ratio, float* dists) {
  const int64_t anchor = chunk.first + blockIdx.x, batch = chunk.batch;
  const int lane = threadIdx.x % 32;
  const float* x = rows_of<float>(chunk);
  const float* a = x + anchor * chunk.dim;
  float* row = dists + int64_t(blockIdx.x) * batch;
  const float2 mine = terms[anchor];
  const double tail = double(chunk.dim) * chunk.eps * chunk.eps;
  // whole warps walk the row, so each can take its lanes' exact distances together
  for (int64_t c0 = threadIdx.x - lane; c0 < batch; c0 += kRowThreads) {
    const int64_t c = c0 + lane;
    float d = 0.f;
    bool exact = false;
    if (c < batch) {
      const float2 theirs = terms[c];
      const double norms = double(mine.x) + theirs.x;
      const double square = norms - 2.0 * row[c] +
                            2.0 * chunk.eps * (double(mine.y) - theirs.y) + tail;
      exact = !(norms <= keep_ratio * square) || !(square <= DBL_MAX);
      d = rule_distance(chunk.rule, float(square));
    }
    for (unsigned todo = __ballot_sync(0xffffffffu, exact); todo != 0; todo &= todo - 1) {
      const int from = __ffs(todo) - 1;
      const float square =
          exact_sq_distance(a, x + (c0 + from) * chunk.dim, chunk.dim, chunk.eps, lane);
      if (lane == from) d = rule_distance(chunk.rule, square);
    }
    if (c < batch) row[c] = d;
  }
}

// The candidates of one block: its best pick in thread 0 (beats is a total order, so the
// butterfly's order does not matter).
template <bool kLargest>
__device__ Pick block_best(Pick pick, Pick* scratch) {
  pick = warp_all_reduce(pick, [](Pick mine, Pick other) {
    return beats<kLargest>(other, mine) ? other : mine;
  });
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = pick;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kRowThreads / 32; ++w) {
      if (beats<kLargest>(scratch[w], pick)) pick = scratch[w];
    }
  }
  return pick;
}

// The upstream gradient reaching anchor i's loss.
__device__ __forceinline__ float upstream_of(Upstream up, int64_t i) {
  if (up.grad == nullptr) return 1.f;
  if (up.reduction == kNone) return up.grad[i];
  return up.reduction == kMean ? up.grad[0] / fmaxf(up.count[0], 1.f) : up.grad[0];
}

// softplus with torch's threshold (20): x itself above it.
__device__ __forceinline__ double softplus(double x) { return x > 20.0 ? x : log1p(exp(x)); }

// A block per anchor: its hardest positive (largest distance, NaN first, then the lowest index)
// and negative (smallest), then d(a, p) and d(a, n) again as the triplet op computes them
// (element differences in float, sums in double) and the rule's loss.
template <bool kPick, typename T>
__global__ void __launch_bounds__(kRowThreads)
    hard_loss_kernel(MiningChunk chunk, const float* dists, const int64_t* picked, float* loss,
                     int64_t* counted, double* state) {
  const LossRule& rule = chunk.rule;
  const bool every_anchor = rule.counting == Counting::kEveryAnchor;
  __shared__ Pick positives[kRowThreads / 32], negatives[kRowThreads / 32];
  __shared__ int64_t chosen[2];
  __shared__ double sums_ap[kRowThreads / 32], sums_an[kRowThreads / 32];
  const int64_t anchor = blockIdx.x, batch = chunk.batch;
  int64_t positive, negative;
  if constexpr (kPick) {
    const float* d = dists + anchor * batch;
    const int64_t my_id = chunk.ids[anchor];
    Pick best_positive{0.f, -1}, best_negative{0.f, -1};
    for (int64_t c = first_candidate(chunk, anchor) + threadIdx.x; c < batch; c += kRowThreads) {
      const Pick candidate{d[c], c};
      if (chunk.ids[c] != my_id) {
        if (beats<false>(candidate, best_negative)) best_negative = candidate;
      } else if (c != anchor && beats<true>(candidate, best_positive)) {
        best_positive = candidate;
      }
    }
    best_positive = block_best<true>(best_positive, positives);
    best_negative = block_best<false>(best_negative, negatives);
    if (threadIdx.x == 0) chosen[0] = best_positive.index, chosen[1] = best_negative.index;
    __syncthreads();
    positive = chosen[0] >= 0 ? chosen[0] : anchor;
    negative = chosen[1] >= 0 ? chosen[1] : anchor;
  } else {
    positive = picked[anchor];
    negative = picked[batch + anchor];
  }
  const bool found = positive != anchor && negative != anchor;
  if (!every_anchor && !found) positive = negative = anchor;
  // sentence-transformers: without a negative, the row's largest distance, its farthest positive
  if (every_anchor && negative == anchor) negative = positive;
  const T* a = rows_of<T>(chunk) + anchor * chunk.dim;
  const T* p = rows_of<T>(chunk) + positive * chunk.dim;
  const T* n = rows_of<T>(chunk) + negative * chunk.dim;
  double sum_ap = 0.0, sum_an = 0.0;
  for (int64_t k = threadIdx.x; k < chunk.dim; k += kRowThreads) {
    const float x_a = to_acc(a[k]);
    const double v_ap = (x_a - to_acc(p[k])) + chunk.eps, v_an = (x_a - to_acc(n[k])) + chunk.eps;
    sum_ap = fma(v_ap, v_ap, sum_ap);
    sum_an = fma(v_an, v_an, sum_an);
  }
  sum_ap = block_sum<kRowThreads>(sum_ap, sums_ap);
  sum_an = block_sum<kRowThreads>(sum_an, sums_an);
  if (threadIdx.x != 0) return;
  // float inputs: a sum past float's range is inf, as torch's float sums make it
  const auto distance = [&](double s, bool exists) {
    return !exists ? 0.0 : s > double(FLT_MAX) ? INFINITY : rule.half_square ? s / 2 : sqrt(s);
  };
  const double d_ap = distance(sum_ap, positive != anchor);
  const double d_an = distance(sum_an, negative != anchor);
  const double hinge_in = double(chunk.margin) + d_ap - d_an;
  const float term = every_anchor || found ? float(rule.soft ? softplus(hinge_in) : hinge(hinge_in))
                                           : 0.f;
  loss[anchor] = term;
  counted[anchor] = rule.counting == Counting::kPositive ? term > 0.f : every_anchor || found;
  state[anchor] = double(positive);
  state[batch + anchor] = double(negative);
  state[2 * batch + anchor] = d_ap;
  state[3 * batch + anchor] = d_an;
}

// Anchor i's scales of its two distances' gradients: g d loss / d d, times 1 / d for the
// distance |a - b + eps| (0 at d = 0), as the triplet op's backward takes them.
struct HardScales {
  int64_t positive, negative;
  float c_ap, c_an;
};

// d softplus(x) / dx as torch's backward takes it: 1 above the threshold (20).
__device__ __forceinline__ float softplus_slope(float x) {
  const float z = expf(x);
  return x > 20.f ? 1.f : z / (z + 1.f);
}

__device__ __forceinline__ HardScales hard_scales(const double* state, int64_t batch, int64_t i,
                                                  float margin, float g, bool hinge_at_zero,
                                                  const LossRule& rule) {
  HardScales s{int64_t(state[i]), int64_t(state[batch + i]), 0.f, 0.f};
  const float d_ap = float(state[2 * batch + i]), d_an = float(state[3 * batch + i]);
  const float hinge_in = margin + d_ap - d_an;
  const bool passes_at_zero = hinge_at_zero || rule.counting == Counting::kEveryAnchor;
  // d loss / d (d_ap - d_an)
  const float slope = rule.soft ? softplus_slope(hinge_in)
                      : hinge_in > 0.f || (hinge_in == 0.f && passes_at_zero) ? 1.f : 0.f;
  const float scale = g * slope;
  const auto per_distance = [&](float d) {
    return rule.half_square ? scale : d == 0.f ? 0.f : scale / d;
  };
  if (slope != 0.f && s.positive != i) s.c_ap = per_distance(d_ap);
  if (slope != 0.f && s.negative != i) s.c_an = -per_distance(d_an);
  return s;
}

// An anchor's term in another row's gradient: coef x (x_anchor - x_row + eps).
struct Hit {
  int64_t anchor;
  int row;  // in the block's tile
  float coef;
};

// Writes gradient row m, slice by slice, lanes in step: its own term as an anchor (own; resume:
// the row's sum so far, read back, instead), then the terms of the anchors that chose it, as
// for_each_hit(add) passes them, add(anchor, coef) in the same order for every lane.
template <typename T, typename ForEachHit>
__device__ __forceinline__ void write_gradient_row(const MiningChunk& chunk, int64_t m,
                                                   const HardScales& own, bool resume,
                                                   float* grad, int lane,
                                                   ForEachHit for_each_hit) {
  const int64_t dim = chunk.dim;
  const T* x = rows_of<T>(chunk);
  const T* xm = x + m * dim;
  const float eps = chunk.eps;
  float* out = grad + m * dim;
  for (int64_t slice = 0; slice < dim; slice += 32 * kGradientSlice) {
    const int64_t k0 = slice + lane;
    float row[kGradientSlice], acc[kGradientSlice];
#pragma unroll
    for (int u = 0; u < kGradientSlice; ++u) {
      const int64_t k = k0 + 32 * u;
      row[u] = k < dim ? to_acc(xm[k]) : 0.f;
      acc[u] = 0.f;
      if (k >= dim) continue;
      if (resume) {
        acc[u] = out[k];
      } else if (own.c_ap != 0.f || own.c_an != 0.f) {
        const float f_ap = __fmul_rn(own.c_ap, (row[u] - to_acc(x[own.positive * dim + k])) + eps);
        const float f_an = __fmul_rn(own.c_an, (row[u] - to_acc(x[own.negative * dim + k])) + eps);
        acc[u] = __fadd_rn(f_ap, f_an);
      }
    }
    for_each_hit([&](int64_t anchor, float coef) {
      const T* xa = x + anchor * dim;
#pragma unroll
      for (int u = 0; u < kGradientSlice; ++u) {
        const int64_t k = k0 + 32 * u;
        if (k < dim) acc[u] = __fadd_rn(acc[u], __fmul_rn(coef, (to_acc(xa[k]) - row[u]) + eps));
      }
    });
#pragma unroll
    for (int u = 0; u < kGradientSlice; ++u) {
      if (k0 + 32 * u < dim) out[k0 + 32 * u] = acc[u];
    }
  }
}

// A block per tile of 64 rows, 8 per warp. The block scans the anchors for those that chose a
// tile row as positive or negative and lists them (anchor order; a full list is worked off
// before the scan goes on, the rows' sums so far read back); each warp then writes its rows. One
// writer per row: no atomics. One body past 100 lines: the scan and the writes take turns on one
// shared list within the block. Bounds for 2 blocks an SM (64 registers, so 4 fit: more warps
// to cover its loads).
template <typename T>
__global__ void __launch_bounds__(kRowThreads, 2)
    hard_gradient_kernel(MiningChunk chunk, const double* state, Upstream up, bool hinge_at_zero,
                         int rows_per_warp, float* grad) {
  constexpr int kWarps = kRowThreads / 32;
  const int tile_rows = kWarps * rows_per_warp;
  __shared__ Hit hits[kHitSlots];
  __shared__ int warp_counts[2][kWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t batch = chunk.batch, tile_first = int64_t(blockIdx.x) * tile_rows;
  const auto in_tile = [&](int64_t row) { return uint64_t(row - tile_first) < uint64_t(tile_rows); };
  int64_t next = 0;
  bool first_round = true;
  do {
    int filled = 0;
    // Each group's choices are read one group ahead, in flight during the last one's barriers.
    const auto choices = [&](int64_t i) {  // anchor i's positive and negative (-1, -1: none)
      return i < batch ? make_longlong2(int64_t(state[i]), int64_t(state[batch + i]))
                       : make_longlong2(-1, -1);
    };
    longlong2 ahead = choices(next + threadIdx.x);
    for (; next < batch; next += kRowThreads) {
      const int64_t i = next + threadIdx.x;
      const int64_t chose_positive = ahead.x, chose_negative = ahead.y;
      ahead = choices(i + kRowThreads);
      const bool near = i < batch && (in_tile(chose_positive) || in_tile(chose_negative));
      if (!__syncthreads_or(near)) continue;  // most groups chose no row of the tile
      bool as_positive = false, as_negative = false;
      HardScales s{0, 0, 0.f, 0.f};
      if (near) {
        s = hard_scales(state, batch, i, chunk.margin, upstream_of(up, i), hinge_at_zero,
                        chunk.rule);
        as_positive = s.positive != i && in_tile(chose_positive);
        as_negative = s.negative != i && in_tile(chose_negative);
      }
      const BlockPlaces<2> places =
          block_places<kRowThreads>({as_positive, as_negative}, warp_counts);
      __syncthreads();  // warp_counts is read before the next group writes it
      // A group adds at most 2 x 256 hits, so an empty list always takes it.
      if (filled + places.starts[2] > kHitSlots) break;
      if (as_positive) hits[filled + places.at[0]] = {i, int(s.positive - tile_first), -s.c_ap};
      if (as_negative) hits[filled + places.at[1]] = {i, int(s.negative - tile_first), -s.c_an};
      filled += places.starts[2];
    }
    __syncthreads();  // the list is written
    for (int r = 0; r < rows_per_warp; ++r) {
      const int tile_row = warp * rows_per_warp + r;
      const int64_t m = tile_first + tile_row;
      if (m >= batch) break;
      const HardScales own = first_round ? hard_scales(state, batch, m, chunk.margin,
                                                       upstream_of(up, m), hinge_at_zero,
                                                       chunk.rule)
                                         : HardScales{0, 0, 0.f, 0.f};
      write_gradient_row<T>(chunk, m, own, !first_round, grad, lane, [&](auto add) {
        for (int base = 0; base < filled; base += 32) {  // the row's hits, 32 looked at at once
          const bool is_mine = base + lane < filled && hits[base + lane].row == tile_row;
          for (unsigned mine = __ballot_sync(0xffffffffu, is_mine); mine != 0; mine &= mine - 1) {
            const Hit hit = hits[base + __ffs(mine) - 1];
            add(hit.anchor, hit.coef);
          }
        }
      });
    }
    first_round = false;
    __syncthreads();  // the list is worked off before the scan refills it
  } while (next < batch);
}

// The first place in sorted[0, n) whose value is >= value: the warp's lanes probe 32 places a
// round (4 rounds for 2^17 values), every lane ends with the same answer.
__device__ __forceinline__ int64_t warp_lower_bound(const int32_t* sorted, int64_t n, int32_t value,
                                                    int lane) {
  int64_t lo = 0, hi = n;  // the answer lies in [lo, hi]
  while (lo < hi) {
    const int64_t step = (hi - lo + 31) / 32;
    const int64_t probe = lo + (lane + 1) * step - 1;
    const unsigned below = __ballot_sync(0xffffffffu, probe < hi && sorted[probe] < value);
    const int64_t passed = __popc(below);  // lanes [0, passed) probed values below
    lo += passed * step;
    hi = min(hi, lo + step - 1);
  }
  return lo;
}

// batch_hard's gradient from the anchors' choices sorted by the row chosen: rows [2 batch] int32
// (each anchor's positive, then each anchor's negative, as the state holds them, stably sorted) and
// places (their index before the sort: i for anchor i's positive, batch + i for its negative). A
// warp per row: its own term, then its run of the sorted choices in order (positives, then
// negatives, each in anchor order), 32 at a time. One writer per row: no atomics.
template <typename T>
__global__ void __launch_bounds__(kRowThreads)
    hard_gradient_sorted_kernel(MiningChunk chunk, const double* state, Upstream up,
                                bool hinge_at_zero, const int32_t* rows, const int64_t* places,
                                float* grad) {
  const int lane = threadIdx.x % 32;
  const int64_t m = warp_row(), batch = chunk.batch, choices = 2 * batch;
  if (m >= batch) return;
  const HardScales own =
      hard_scales(state, batch, m, chunk.margin, upstream_of(up, m), hinge_at_zero, chunk.rule);
  const int64_t first = warp_lower_bound(rows, choices, int32_t(m), lane);
  write_gradient_row<T>(chunk, m, own, false, grad, lane, [&](auto add) {
    for (int64_t base = first;; base += 32) {  // the run of m's choices, 32 at a time
      const int64_t at = base + lane;
      const bool in_run = at < choices && rows[at] == m;
      const int64_t place = at < choices ? places[at] : 0;  // read beside rows[at]
      int64_t anchor = m;  // m: no term (an anchor without a positive or negative holds itself)
      float coef = 0.f;
      if (in_run) {
        anchor = place < batch ? place : place - batch;
        if (anchor != m) {
          const HardScales s = hard_scales(state, batch, anchor, chunk.margin,
                                           upstream_of(up, anchor), hinge_at_zero, chunk.rule);
          coef = place < batch ? -s.c_ap : -s.c_an;
        }
      }
      for (unsigned left = __ballot_sync(0xffffffffu, anchor != m); left != 0; left &= left - 1) {
        const int from = __ffs(left) - 1;
        add(__shfl_sync(0xffffffffu, anchor, from), __shfl_sync(0xffffffffu, coef, from));
      }
      if (__ballot_sync(0xffffffffu, in_run) != 0xffffffffu) break;  // the run ended here
    }
  });
}

// One triplet's part in batch_all by the rule: its loss, d loss / d (d_ap - d_an), and whether
// it counts. Outside the band nothing; relu keeps NaN (as torch's relu does). kGeneral false:
// the plain rule (no band, the hinge, losses > 0 count), its checks compiled out of the hot loop.
struct TripletTerm {
  float loss, slope;
  bool counted;
};

template <bool kGeneral>
__device__ __forceinline__ TripletTerm triplet_term(const LossRule& rule, float margin, float d_ap,
                                                    float d_an) {
  if (kGeneral && rule.band != Band::kNone) {
    const float gap = d_an - d_ap, edge = rule.band_margin;
    const bool in_band = rule.band == Band::kEasy ? gap > edge
                         : rule.band == Band::kHard ? gap <= edge && gap <= 0.f
                         : rule.band == Band::kSemihard ? gap <= edge && gap > 0.f
                                                        : gap <= edge;
    if (!in_band) return {0.f, 0.f, false};
  }
  const float v = (margin + d_ap) - d_an;
  if (kGeneral && rule.soft) {
    const float loss = v > 20.f ? v : log1pf(expf(v));
    return {loss, softplus_slope(v), loss > 0.f};
  }
  const float floor = kGeneral && rule.counting == Counting::kAbove1e16 ? 1e-16f : 0.f;
  return {v > 0.f || v != v ? v : 0.f, v > 0.f ? 1.f : 0.f, v > floor};
}

// fn(c, d[c]) for each column c of the row, from `from` (this thread's: every kRowThreads-th),
// whose label is not the anchor's, in column order; kColumnUnroll columns' labels and distances
// loaded before any is looked at.
template <typename Fn>
__device__ __forceinline__ void for_each_negative(const MiningChunk& chunk, const float* d,
                                                  int64_t my_id, int64_t from, Fn fn) {
  constexpr int64_t kStride = int64_t(kRowThreads) * kColumnUnroll;
  for (int64_t c0 = from + threadIdx.x; c0 < chunk.batch; c0 += kStride) {
    int64_t ids[kColumnUnroll];
    float values[kColumnUnroll];
#pragma unroll
    for (int q = 0; q < kColumnUnroll; ++q) {
      const int64_t c = c0 + int64_t(q) * kRowThreads;
      ids[q] = c < chunk.batch ? chunk.ids[c] : my_id;
      values[q] = c < chunk.batch ? d[c] : 0.f;
    }
#pragma unroll
    for (int q = 0; q < kColumnUnroll; ++q) {
      if (ids[q] != my_id) fn(c0 + int64_t(q) * kRowThreads, values[q]);
    }
  }
}

// semi_hard's choice for each staged positive j of a row: the nearest negative farther than
// d(i, j) (the lowest column among equals), else the farthest one; its loss
// max(margin + d(i, j) - d(i, n), 0) (d(i, n) 0 without negatives) into thread 0's sums. The
// positives go kPositiveGroup at a time, their distances in registers, each thread keeping its
// columns' nearest per positive (its columns come in order, so a strict compare keeps the first
// of equals; NaN until one is seen); the first group's pass finds the farthest negative too.
// Where weights are wanted, the positive's weight is its slope, and the slot then holds the
// chosen column (staged, -1: none) and the slope (positive_d) for the negatives' weights.
__device__ void choose_semi_hard(const MiningChunk& chunk, const float* d, int64_t my_id,
                                 float* positive_d, int64_t* staged, int filled, float* w,
                                 double& sum, int64_t& count) {
  __shared__ Pick scratch[kRowThreads / 32];
  Pick farthest{0.f, -1};
  for (int first = 0; first < filled; first += kPositiveGroup) {
    const int group = min(kPositiveGroup, filled - first);
    float beyond_d[kPositiveGroup], nearest[kPositiveGroup];
    int nearest_column[kPositiveGroup];  // batch < 2^31 (check_mining)
#pragma unroll
    for (int j = 0; j < kPositiveGroup; ++j) {
      beyond_d[j] = j < group ? positive_d[first + j] : NAN;  // NaN: nothing is beyond it
      nearest[j] = NAN;
      nearest_column[j] = -1;
    }
    const bool finds_farthest = first == 0;
    for (int64_t c = threadIdx.x; c < chunk.batch; c += kRowThreads) {
      if (chunk.ids[c] == my_id) continue;
      const float v = d[c];
      if (finds_farthest && beats<true>(Pick{v, c}, farthest)) farthest = {v, c};
#pragma unroll
      for (int j = 0; j < kPositiveGroup; ++j) {
        if (v > beyond_d[j] && !(v >= nearest[j])) nearest[j] = v, nearest_column[j] = int(c);
      }
    }
    if (finds_farthest) {
      farthest = block_best<true>(farthest, scratch);  // thread 0's
      __syncthreads();  // thread 0 has read the scratch before the next pick fills it
    }
#pragma unroll
    for (int j = 0; j < kPositiveGroup; ++j) {
      if (j >= group) break;  // uniform across the block: group is
      const Pick best = block_best<false>(Pick{nearest[j], nearest_column[j]}, scratch);
      if (threadIdx.x == 0) {
        const Pick negative = best.index >= 0 ? best : farthest;
        const float v = (chunk.margin + positive_d[first + j]) -
                        (negative.index >= 0 ? negative.value : 0.f);
        const float slope = v > 0.f ? 1.f : 0.f;
        sum += v > 0.f || v != v ? v : 0.f;
        count += 1;
        if (w != nullptr) w[staged[first + j]] = slope;
        staged[first + j] = negative.index;
        positive_d[first + j] = slope;
      }
      __syncthreads();  // thread 0 has read the scratch before the next pick fills it
    }
  }
}

// A block per anchor row of the chunk. Its positives are staged (d(i, j)) a slot each, every
// negative is held against them; weights: each column's d loss / d d(i, c), scaled by g_i /
// d(i, c) at the end (g_i for |a - b|^2 / 2). Where weights overwrite dists (a whole batch), the
// row is first copied to shared memory.
// One body past 100 lines: staging, the pairs and the weights share the row's slots in shared
// memory.
template <bool kGeneral, bool kSemiHard>
__global__ void __launch_bounds__(kRowThreads)
    batch_all_kernel(MiningChunk chunk, const float* dists, Upstream up, float* loss,
                     int64_t* counted, float* weights, double* weight_sums) {
  __shared__ float positive_d[kPositiveSlots];  // d(i, j) of the staged positives
  __shared__ int64_t staged[kPositiveSlots];    // their columns
  __shared__ int warp_counts[1][kRowThreads / 32];
  __shared__ double sum_scratch[kRowThreads / 32];
  __shared__ double weight_sum_scratch[kRowThreads / 32];
  __shared__ int64_t count_scratch[kRowThreads / 32];
  __shared__ float slope_scratch[kRowThreads / 32];
  extern __shared__ float row_copy[];  // [batch] where weights == dists
  const LossRule& rule = chunk.rule;
  const float margin = chunk.margin;
  const int64_t row = blockIdx.x, anchor = chunk.first + row, batch = chunk.batch;
  const float* d = dists + row * batch;
  const int64_t my_id = chunk.ids[anchor];
  float* w = weights != nullptr ? weights + row * batch : nullptr;
  if (w == d) {
    for (int64_t c = threadIdx.x; c < batch; c += kRowThreads) row_copy[c] = d[c];
    __syncthreads();
    d = row_copy;
  }
  if (w != nullptr) {
    for (int64_t c = threadIdx.x; c < batch; c += kRowThreads) w[c] = 0.f;
  }
  double sum = 0.0;
  int64_t count = 0;
  const int64_t candidates = first_candidate(chunk, anchor);
  int64_t next = candidates;  // the next column to look at for positives
  while (next < batch) {
    // Stage the next positives, in column order.
    int filled = 0;
    __syncthreads();  // the last pass's readers are done with the slots
    for (; next < batch && filled + kRowThreads <= kPositiveSlots; next += kRowThreads) {
      const int64_t c = next + threadIdx.x;
      const bool is_positive = c < batch && c != anchor && chunk.ids[c] == my_id;
      const BlockPlaces<1> places = block_places<kRowThreads>({is_positive}, warp_counts);
      if (is_positive) {
        positive_d[filled + places.at[0]] = d[c];
        staged[filled + places.at[0]] = c;
      }
      filled += places.starts[1];
      __syncthreads();  // warp_counts is read before the next group writes it
    }
    if (filled == 0) continue;
    if constexpr (kSemiHard) {
      choose_semi_hard(chunk, d, my_id, positive_d, staged, filled, w, sum, count);
      __syncthreads();
      if (w != nullptr && threadIdx.x == 0) {  // one writer, slot order: the same bits each run
        for (int j = 0; j < filled; ++j) {
          if (staged[j] >= 0) w[staged[j]] -= positive_d[j];
        }
      }
      continue;
    }
    // Every negative against the staged positives, kPositiveGroup at a time: each thread keeps
    // its negatives' slopes per positive of the group, the block sums them.
    for (int first = 0; first < filled; first += kPositiveGroup) {
      const int group = min(kPositiveGroup, filled - first);
      float positive_slopes[kPositiveGroup] = {};
      // (for_each_negative passes over the anchor and its positives: they share its label)
      for_each_negative(chunk, d, my_id, candidates, [&](int64_t c, float dn) {
        float slopes = 0.f;
        int hits = 0;
#pragma unroll
        for (int j = 0; j < kPositiveGroup; ++j) {
          if (j >= group) break;
          const TripletTerm term = triplet_term<kGeneral>(rule, margin, positive_d[first + j], dn);
          sum += term.loss;
          slopes += term.slope;
          positive_slopes[j] += term.slope;
          hits += term.counted;
        }
        count += hits;
        if (w != nullptr) w[c] -= slopes;
      });
      if (w == nullptr) continue;
#pragma unroll
      for (int j = 0; j < kPositiveGroup; ++j) {
        if (j >= group) break;  // uniform across the block: group is
        const float total = block_sum<kRowThreads>(positive_slopes[j], slope_scratch);
        if (threadIdx.x == 0) w[staged[first + j]] = total;
        __syncthreads();  // thread 0 has read the scratch before the next sum fills it
      }
    }
  }
  if (w != nullptr) {
    __syncthreads();  // every weight of the row is written
    const float g = upstream_of(up, anchor);
    double weight_sum = 0.0;
    for (int64_t c = threadIdx.x; c < batch; c += kRowThreads) {
      const float weight = w[c];
      w[c] = weight == 0.f ? 0.f : rule.half_square ? g * weight : d[c] != 0.f ? g * weight / d[c]
                                                                                : 0.f;
      weight_sum += w[c];
    }
    if (weight_sums != nullptr) {
      const double total = block_sum<kRowThreads>(weight_sum, weight_sum_scratch);
      if (threadIdx.x == 0) weight_sums[anchor] = total;
    }
  }
  if (loss == nullptr) return;
  const double total = block_sum<kRowThreads>(sum, sum_scratch);
  const int64_t total_count = block_sum<kRowThreads>(count, count_scratch);
  if (threadIdx.x == 0) {
    loss[anchor] = float(total);
    counted[anchor] = total_count;
  }
}

// semi_hard past the whole batch: the gradient from a chunk's rows of weights A [rows, batch],
// which hold a few nonzeros each (every (anchor, positive) pair's positive and chosen negative),
// read as they are instead of in double matrix products: differences exact in float, then
// scaled, sums in double into out [batch, dim] (one writer per row, chunks in order: the same
// bits each run). First the rows: out_i += sum_c A[i, c] (x_i - x_c + eps), a warp per anchor
// row, its nonzeros listed in column order kSparseSlots at a time (kSparseUnroll loads in flight).
__global__ void __launch_bounds__(kRowThreads)
    sparse_rows_gradient_kernel(MiningChunk chunk, const float* weights, double* out) {
  constexpr int kWarps = kRowThreads / 32;
  __shared__ int listed_columns[kWarps][kSparseSlots];
  __shared__ float listed_weights[kWarps][kSparseSlots];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t row = int64_t(blockIdx.x) * kWarps + warp;
  if (row >= chunk.rows) return;  // a warp's own work: no block barrier below
  const int64_t batch = chunk.batch, dim = chunk.dim, i = chunk.first + row;
  const float* x = rows_of<float>(chunk);
  const float* a = weights + row * batch;
  int* columns = listed_columns[warp];
  float* values = listed_weights[warp];
  int64_t from = 0;
  while (from < batch) {
    int filled = 0;
    while (from < batch && filled + 32 * kSparseUnroll <= kSparseSlots) {
      float w[kSparseUnroll];
#pragma unroll
      for (int u = 0; u < kSparseUnroll; ++u) {
        const int64_t c = from + 32 * u + lane;
        w[u] = c < batch ? a[c] : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kSparseUnroll; ++u) {  // NaN weights are listed too
        const unsigned listed = __ballot_sync(0xffffffffu, w[u] != 0.f);
        if (w[u] != 0.f) {
          const int slot = filled + __popc(listed & ((1u << lane) - 1u));
          columns[slot] = int(from + 32 * u + lane);
          values[slot] = w[u];
        }
        filled += __popc(listed);
      }
      from += 32 * kSparseUnroll;
    }
    __syncwarp();
    for (int64_t k = lane; k < dim; k += 32) {
      const float xi = x[i * dim + k];
      double sum = 0.0;
      for (int j = 0; j < filled; ++j) {
        sum += __fmul_rn(values[j], (xi - x[int64_t(columns[j]) * dim + k]) + chunk.eps);
      }
      out[i * dim + k] += sum;
    }
    __syncwarp();  // the list is read before the next scan refills it
  }
}

// ... then the columns: out_c -= sum_i A[i, c] (x_i - x_c + eps), a block per 32 columns. Warp v
// lists each column's nonzeros (a lane per column) in rows [v R / 8, (v + 1) R / 8), until a list
// is full; then warp w adds columns w, w + 8, ... over the lists in warp order (rows in order).
__global__ void __launch_bounds__(kRowThreads)
    sparse_columns_gradient_kernel(MiningChunk chunk, const float* weights, double* out) {
  constexpr int kWarps = kRowThreads / 32;
  __shared__ int listed_rows[kWarps][kColumnSlots][32];
  __shared__ float listed_weights[kWarps][kColumnSlots][32];
  __shared__ int listed_counts[kWarps][32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t batch = chunk.batch, dim = chunk.dim, c0 = int64_t(blockIdx.x) * 32;
  const int64_t c = c0 + lane, span = (chunk.rows + kWarps - 1) / kWarps;
  const int64_t end = std::min(chunk.rows, (warp + 1) * span);
  int64_t r = std::min(chunk.rows, warp * span);
  const float* x = rows_of<float>(chunk);
  while (__syncthreads_or(r < end)) {
    int count = 0;
    bool room = true;
    while (room && r < end) {
      float w[kSparseUnroll];
#pragma unroll
      for (int u = 0; u < kSparseUnroll; ++u) {
        w[u] = r + u < end && c < batch ? weights[(r + u) * batch + c] : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kSparseUnroll; ++u) {
        room = __all_sync(0xffffffffu, count < kColumnSlots);
        if (!room || r >= end) break;  // uniform across the warp
        if (w[u] != 0.f) {
          listed_rows[warp][count][lane] = int(r);
          listed_weights[warp][count][lane] = w[u];
          ++count;
        }
        ++r;
      }
    }
    listed_counts[warp][lane] = count;
    __syncthreads();
    for (int column = warp; column < 32 && c0 + column < batch; column += kWarps) {
      const int64_t m = c0 + column;
      for (int64_t k = lane; k < dim; k += 32) {
        const float xm = x[m * dim + k];
        double sum = 0.0;
        for (int v = 0; v < kWarps; ++v) {
          for (int j = 0; j < listed_counts[v][column]; ++j) {
            const int64_t anchor = chunk.first + listed_rows[v][j][column];
            sum += __fmul_rn(listed_weights[v][j][column], (x[anchor * dim + k] - xm) + chunk.eps);
          }
        }
        out[m * dim + k] -= sum;
      }
    }
    __syncthreads();  // the lists are read before the next scan refills them
  }
}

// grad_m = sum_c A[m, c] (x_m - x_c + eps) - sum_i A[i, m] (x_i - x_m + eps) with A[i, c] =
// g_i weights[i, c], written as sum_c (A[m, c] + A[c, m]) (x_m - x_c) + eps (sum_c A[m, c] -
// A[c, m]): each difference exact before it is scaled. Tiles of 64 rows x 64 elements, the
// columns c staged 16 at a time, as distances_kernel, by two halves of the block taking every
// other step (twice the warps an SM: at users' batches the grid is about a block an SM), the
// second half's sums added to the first's at the end. With gridDim.z parts, block z takes the
// z-th span of the columns and writes its sums to parts[z] (gradient_parts_kernel adds them).
constexpr int kGradientHalves = 2;
struct AllGradientShared {
  struct Step {
    float from_rows[kTileDepth][kTile + 4];     // A[m, c]
    float from_columns[kTileDepth][kTile + 4];  // A[c, m]
    float candidates[kTileDepth][kTile + 4];    // x_c
  };
  union {
    Step steps[kGradientHalves];
    float4 second_half[5][kTileThreads];  // its acc rows, then its skews
  };
};
__global__ void __launch_bounds__(kTileThreads * kGradientHalves)
    all_gradient_kernel(MiningChunk chunk, const float* weights, Upstream up, float* grad,
                        float* parts) {
  __shared__ __align__(16) AllGradientShared sh;
  const float* x = rows_of<float>(chunk);
  const int64_t batch = chunk.batch, dim = chunk.dim;
  const int half = threadIdx.x / kTileThreads, t = threadIdx.x % kTileThreads;
  const int tx = t % (kTile / 4), ty = t / (kTile / 4);
  const int64_t row0 = int64_t(blockIdx.y) * kTile, col0 = int64_t(blockIdx.x) * kTile;
  constexpr int64_t kStride = kGradientHalves * kTileDepth;
  const int64_t span = ((batch + gridDim.z - 1) / gridDim.z + kStride - 1) / kStride * kStride;
  const int64_t begin = int64_t(blockIdx.z) * span, end = std::min(batch, begin + span);
  AllGradientShared::Step& step = sh.steps[half];
  float mine[4][4], acc[4][4] = {}, skew[4] = {};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t m = row0 + ty * 4 + i, k = col0 + tx * 4 + j;
      mine[i][j] = m < batch && k < dim ? x[m * dim + k] : 0.f;
    }
  }
  const bool per_anchor = up.reduction == kNone;
  const float g_all = per_anchor ? 0.f : upstream_of(up, 0);
  constexpr int kLoads = kTile * kTileDepth / kTileThreads;
  // Each step's elements are loaded into registers one step ahead, in flight during the sums.
  float next_rows[kLoads], next_columns[kLoads], next_candidates[kLoads];
  const auto load = [&](int64_t c0) {
#pragma unroll
    for (int q = 0; q < kLoads; ++q) {
      const int e = t + q * kTileThreads;
      const int r = e / kTileDepth, cc = e % kTileDepth;  // along a row of weights
      const int64_t m = row0 + r, c = c0 + cc;
      next_rows[q] = m < batch && c < end
                         ? (per_anchor ? up.grad[m] : g_all) * weights[m * batch + c] : 0.f;
      const int r2 = e % kTile, cc2 = e / kTile;  // along a column
      const int64_t m2 = row0 + r2, c2 = c0 + cc2, k = col0 + r2;
      next_columns[q] = m2 < batch && c2 < end
                            ? (per_anchor ? up.grad[c2] : g_all) * weights[c2 * batch + m2] : 0.f;
      next_candidates[q] = c2 < end && k < dim ? x[c2 * dim + k] : 0.f;
    }
  };
  // Both halves run every round (past the span the second loads zeros): one barrier for both.
  load(begin + half * kTileDepth);
  for (int64_t c0 = begin; c0 < end; c0 += kStride) {
#pragma unroll
    for (int q = 0; q < kLoads; ++q) {
      const int e = t + q * kTileThreads;
      step.from_rows[e % kTileDepth][e / kTileDepth] = next_rows[q];
      step.from_columns[e / kTile][e % kTile] = next_columns[q];
      step.candidates[e / kTile][e % kTile] = next_candidates[q];
    }
    __syncthreads();
    if (c0 + kStride < end) load(c0 + kStride + half * kTileDepth);
#pragma unroll
    for (int cc = 0; cc < kTileDepth; ++cc) {
      const float4 a = *reinterpret_cast<const float4*>(&step.from_rows[cc][ty * 4]);
      const float4 b = *reinterpret_cast<const float4*>(&step.from_columns[cc][ty * 4]);
      const float4 xc = *reinterpret_cast<const float4*>(&step.candidates[cc][tx * 4]);
      const float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
      const float cv[4] = {xc.x, xc.y, xc.z, xc.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float both = av[i] + bv[i];
        skew[i] += av[i] - bv[i];
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(both, mine[i][j] - cv[j], acc[i][j]);
      }
    }
    __syncthreads();  // also frees the steps for second_half after the last round
  }
  if (half == 1) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      sh.second_half[i][t] = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
    }
    sh.second_half[4][t] = make_float4(skew[0], skew[1], skew[2], skew[3]);
  }
  __syncthreads();
  if (half == 1) return;
  float* out = gridDim.z == 1 ? grad : parts + int64_t(blockIdx.z) * batch * dim;
  const float4 other_skew = sh.second_half[4][t];
  const float skews[4] = {other_skew.x, other_skew.y, other_skew.z, other_skew.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t m = row0 + ty * 4 + i;
    if (m >= batch) continue;
    const float4 o = sh.second_half[i][t];
    const float other[4] = {o.x, o.y, o.z, o.w};
    const float skew_m = skew[i] + skews[i];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t k = col0 + tx * 4 + j;
      if (k < dim) out[m * dim + k] = fmaf(chunk.eps, skew_m, acc[i][j] + other[j]);
    }
  }
}

// out = the sum of count parts of n floats each, in part order (deterministic).
__global__ void __launch_bounds__(kRowThreads)
    gradient_parts_kernel(const float* parts, int count, int64_t n, float* out) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    float sum = parts[i];
    for (int part = 1; part < count; ++part) sum += parts[part * n + i];
    out[i] = sum;
  }
}

// D = A B + D on the double tensor cores, one 16 x 8 x 4 product per warp (sm_90): a = A[lane / 4
// + 8 {0, 1}][lane % 4], b = B[lane % 4][lane / 4], d = D[lane / 4 + 8 {0, 0, 1, 1}][2 (lane % 4) +
// {0, 1, 0, 1}].
__device__ __forceinline__ void mma_16x8x4(double (&d)[4], double a0, double a1, double b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "mma.sync.aligned.m16n8k4.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
      "{%0, %1, %2, %3};"
      : "+d"(d[0]), "+d"(d[1]), "+d"(d[2]), "+d"(d[3])
      : "d"(a0), "d"(a1), "d"(b));
#endif
}

// Copies `bytes` (4 or 16) from global memory to shared memory without the registers, in the
// current group of asynchronous copies; zeros where !valid (src then only an address).
__device__ __forceinline__ void copy_async(void* dst, const void* src, int bytes, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  if (bytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(to), "l"(src),
                 "r"(valid ? 16 : 0));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(to), "l"(src),
                 "r"(valid ? 4 : 0));
  }
#endif
}
__device__ __forceinline__ void commit_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;");
#endif
}
// Waits until at most kPending of this thread's groups of copies are still in flight.
template <int kPending>
__device__ __forceinline__ void wait_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending));
#endif
}

// all_gradient_kernel's gradient written as x_m r_m - (S x)_m + eps (sum_c A[m, c] - A[c, m]),
// S = A + A^T (float, as staged) and r_m = sum_c S[m, c]: the products on the double tensor
// cores, where a float times a float is exact and the sums keep a row's near-cancelling terms to
// float's precision. Tiles of 64 rows x 128 elements, the columns c taken 16 at a time: each
// step's floats copied asynchronously kGradientStages - 1 steps ahead, then summed and converted
// into column-major double stages; each of the 8 warps 32 x 32 of the tile.
constexpr int kGradientDepth = 16, kGradientThreads = 256, kGradientStages = 3;
struct GradientCopies {  // one step's floats as copied
  float rows[kGradientRows][kGradientDepth];     // A[m, c]
  float columns[kGradientDepth][kGradientRows];  // A[c, m], 4-float groups swizzled (column_at)
  float x[kGradientDepth][kGradientCols];        // x[c, k]
};
struct GradientShared {
  GradientCopies copies[kGradientStages];
  // Rows padded by 4 doubles (8 banks): a fragment's 4 rows of a half-warp's 64-bit loads fall
  // on distinct banks; S's columns swizzled (sum_at) so that the stores are too.
  double sums[kGradientDepth][kGradientRows + 4];        // S[m, c] at [c][sum_at(c, m)]
  double candidates[kGradientDepth][kGradientCols + 4];  // x[c, k] at [c][k]
  double row_sums[kGradientThreads / kGradientRows][kGradientRows];
  float skews[kGradientThreads / kGradientRows][kGradientRows];
};
__device__ __forceinline__ int sum_at(int c, int m) { return m ^ ((c >> 2 & 3) << 2); }
__device__ __forceinline__ int column_at(int c, int m) { return m ^ ((c >> 2 & 3) << 3); }

__global__ void __launch_bounds__(kGradientThreads, 2)
    all_gradient_mma_kernel(MiningChunk chunk, const float* weights, Upstream up, float* grad) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // the plan takes this kernel only on sm_90+
#else
  constexpr int kQuarters = kGradientThreads / kGradientRows;
  extern __shared__ __align__(16) unsigned char gradient_shared[];
  GradientShared& sh = *reinterpret_cast<GradientShared*>(gradient_shared);
  const float* x = rows_of<float>(chunk);
  const int64_t batch = chunk.batch, dim = chunk.dim;
  const int64_t row0 = int64_t(blockIdx.y) * kGradientRows;
  const int64_t col0 = int64_t(blockIdx.x) * kGradientCols;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int warp_row = warp / 4 * 32, warp_col = warp % 4 * 32;
  // Summing: S[sm, c0 + sc .. + 4) and x[c0 + xc .. + 8, xk], a row's 4 quarters in adjacent lanes.
  const int sm = threadIdx.x / kQuarters, sq = threadIdx.x % kQuarters, sc = sq * 4;
  const int xk = threadIdx.x % kGradientCols, xc = threadIdx.x / kGradientCols * 8;
  const int64_t m = row0 + sm;
  const bool per_anchor = up.reduction == kNone;
  const float g_all = per_anchor ? 0.f : upstream_of(up, 0);
  const float g_m = m < batch ? (per_anchor ? up.grad[m] : g_all) : 0.f;
  // 16-byte copies where every group of 4 floats is whole and aligned, else 4-byte ones.
  const bool wide = batch % 4 == 0 && dim % 4 == 0 &&
                    reinterpret_cast<uintptr_t>(weights) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(x) % 16 == 0;
  // Copies of the step from column c0 into stage: 4 floats of A's rows, 4 of its columns and 8
  // of x a thread, each warp reading whole 64- to 512-byte runs.
  const auto copy_step = [&](int64_t c0, GradientCopies& stage) {
    // 4 floats from column `first` of row `row` of a rows x width matrix, at src.
    const auto group = [&](float* dst, const float* src, int64_t row, int64_t rows, int64_t first,
                           int64_t width) {
      if (wide) {
        const bool valid = row < rows && first < width;
        copy_async(dst, valid ? src : weights, 16, valid);
      } else {
        for (int i = 0; i < 4; ++i) {
          const bool valid = row < rows && first + i < width;
          copy_async(dst + i, valid ? src + i : weights, 4, valid);
        }
      }
    };
    {
      const int r = threadIdx.x / 4, q = threadIdx.x % 4;
      const int64_t row = row0 + r, c = c0 + 4 * q;
      group(&stage.rows[r][4 * q], weights + row * batch + c, row, batch, c, batch);
    }
    {
      const int cc = threadIdx.x / 16, q = threadIdx.x % 16;
      const int64_t c = c0 + cc, row = row0 + 4 * q;
      group(&stage.columns[cc][column_at(cc, 4 * q)], weights + c * batch + row, c, batch, row,
            batch);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int e = threadIdx.x + j * kGradientThreads, cc = e / 32, q = e % 32;
      const int64_t c = c0 + cc, k = col0 + 4 * q;
      group(&stage.x[cc][4 * q], x + c * dim + k, c, batch, k, dim);
    }
  };
  double row_sum = 0.0;
  float skew = 0.f;
  double acc[2][4][4] = {};
  const int64_t steps = (batch + kGradientDepth - 1) / kGradientDepth;
#pragma unroll
  for (int s = 0; s < kGradientStages - 1; ++s) {
    if (s < steps) copy_step(s * kGradientDepth, sh.copies[s]);
    commit_copies();
  }
  for (int64_t step = 0; step < steps; ++step) {
    wait_copies<kGradientStages - 2>();  // this thread's copies of the step have landed
    __syncthreads();  // everyone's; and the last step's products are done with the doubles
    {
      const int64_t ahead = step + kGradientStages - 1;
      if (ahead < steps) copy_step(ahead * kGradientDepth, sh.copies[ahead % kGradientStages]);
      commit_copies();
    }
    const GradientCopies& stage = sh.copies[step % kGradientStages];
    const int64_t c0 = step * kGradientDepth;
    const float4 rows = *reinterpret_cast<const float4*>(&stage.rows[sm][sc]);
    const float row_values[4] = {rows.x, rows.y, rows.z, rows.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int c = sc + i;
      const float g_c = per_anchor ? (c0 + c < batch ? up.grad[c0 + c] : 0.f) : g_all;
      const float from_row = g_m * row_values[i];
      const float from_column = g_c * stage.columns[c][column_at(c, sm)];
      const float both = from_row + from_column;
      skew += from_row - from_column;
      row_sum += both;
      sh.sums[c][sum_at(c, sm)] = both;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) sh.candidates[xc + i][xk] = stage.x[xc + i][xk];
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kGradientDepth; k += 4) {
      const int c = k + lane % 4;
      double a[4], b[4];
#pragma unroll
      for (int t = 0; t < 4; ++t) a[t] = sh.sums[c][sum_at(c, warp_row + t * 8 + lane / 4)];
#pragma unroll
      for (int t = 0; t < 4; ++t) b[t] = sh.candidates[c][warp_col + t * 8 + lane / 4];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) mma_16x8x4(acc[i][j], a[2 * i], a[2 * i + 1], b[j]);
      }
    }
  }
  wait_copies<0>();
  sh.row_sums[sq][sm] = row_sum;
  sh.skews[sq][sm] = skew;
  __syncthreads();
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    const int r = warp_row + t * 8 + lane / 4;
    const int64_t row = row0 + r;
    if (row >= batch) continue;
    double sum = 0.0;  // the quarters of the row, in one order
    float skew_sum = 0.f;
#pragma unroll
    for (int q = 0; q < kQuarters; ++q) {
      sum += sh.row_sums[q][r];
      skew_sum += sh.skews[q][r];
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t k = col0 + warp_col + j * 8 + lane % 4 * 2 + h;
        if (k >= dim) continue;
        const double v = double(x[row * dim + k]) * sum - acc[t / 2][j][t % 2 * 2 + h];
        grad[row * dim + k] = float(v + double(chunk.eps) * double(skew_sum));
      }
    }
  }
#endif
}

// One block: the sums of the per-anchor losses and counts in double, in a fixed order.
__global__ void __launch_bounds__(kRowThreads)
    mined_total_kernel(const float* losses, const int64_t* counted, int64_t batch, int64_t reduction,
                  float* loss, float* count) {
  __shared__ double sum_scratch[kRowThreads / 32];
  __shared__ int64_t count_scratch[kRowThreads / 32];
  double sum = 0.0;
  int64_t n = 0;
  for (int64_t i = threadIdx.x; i < batch; i += kRowThreads) {
    if (reduction != kNone) sum += losses[i];
    n += counted[i];
  }
  sum = block_sum<kRowThreads>(sum, sum_scratch);
  n = block_sum<kRowThreads>(n, count_scratch);
  if (threadIdx.x != 0) return;
  if (reduction != kNone) loss[0] = float(reduction == kMean ? sum / double(n > 1 ? n : 1) : sum);
  count[0] = float(n);
}

// A warp per row: |x|^2 in double, the lanes striding the row.
__device__ double row_square_sum(const float* x, int64_t dim, int lane) {
  double sq = 0.0;
  for (int64_t k = lane; k < dim; k += 32) sq += double(x[k]) * x[k];
  return warp_all_reduce(sq, Plus());
}

constexpr double kUnitRowsFloor = 1e-12;  // the libraries' normalisation: x / max(|x|, 1e-12)

__global__ void __launch_bounds__(kRowThreads)
    unit_rows_kernel(const float* x, int64_t batch, int64_t dim, float* unit) {
  const int64_t row = warp_row();
  if (row >= batch) return;
  const int lane = threadIdx.x % 32;
  x += row * dim;
  const float scale = float(fmax(sqrt(row_square_sum(x, dim, lane)), kUnitRowsFloor));
  for (int64_t k = lane; k < dim; k += 32) unit[row * dim + k] = x[k] / scale;
}

__global__ void __launch_bounds__(kRowThreads)
    unit_rows_backward_kernel(const float* x, const float* unit_grad, int64_t batch, int64_t dim,
                              float* grad) {
  const int64_t row = warp_row();
  if (row >= batch) return;
  const int lane = threadIdx.x % 32;
  x += row * dim;
  unit_grad += row * dim;
  const double norm = sqrt(row_square_sum(x, dim, lane));
  double along = 0.0;  // x . g
  for (int64_t k = lane; k < dim; k += 32) along += double(x[k]) * unit_grad[k];
  along = warp_all_reduce(along, Plus());
  const bool scaled = norm >= kUnitRowsFloor;
  const double projection = scaled ? along / (norm * norm) : 0.0;
  const double scale = scaled ? norm : kUnitRowsFloor;
  for (int64_t k = lane; k < dim; k += 32) {
    grad[row * dim + k] = float((unit_grad[k] - x[k] * projection) / scale);
  }
}

// launch(T{}) for rows of dtype T: float32, float16 or bfloat16.
template <typename Launch>
cudaError_t with_rows(DType dtype, Launch launch) {
  switch (dtype) {
    case DType::kFloat: return launch(float{});
    case DType::kHalf: return launch(__half{});
    case DType::kBFloat16: return launch(__nv_bfloat16{});
    default: return cudaErrorInvalidValue;
  }
}

// The kernels of batch_all and semi_hard read float32 rows only.
bool float_rows(const MiningChunk& chunk) { return chunk.dtype == DType::kFloat; }

}  // namespace

cudaError_t launch_unit_rows(const float* x, int64_t batch, int64_t dim, float* unit,
                             cudaStream_t stream) {
  unit_rows_kernel<<<warp_row_blocks(batch), kRowThreads, 0, stream>>>(x, batch, dim, unit);
  return cudaGetLastError();
}

cudaError_t launch_unit_rows_backward(const float* x, const float* unit_grad, int64_t batch,
                                      int64_t dim, float* grad, cudaStream_t stream) {
  unit_rows_backward_kernel<<<warp_row_blocks(batch), kRowThreads, 0, stream>>>(
      x, unit_grad, batch, dim, grad);
  return cudaGetLastError();
}

cudaError_t launch_gram_rows(const MiningChunk& chunk, const MiningPlan& plan, const int64_t* order,
                             const float* mean, void* rounded, float* bounds, int64_t* classes,
                             cudaStream_t stream) {
  return with_rows(chunk.dtype, [&](auto element) {
    const GramBounds terms = gram_bounds(bounds, chunk.batch);
    gram_rows_kernel<decltype(element)><<<warp_row_blocks(chunk.batch), kRowThreads, 0, stream>>>(
        chunk, plan, order, mean, static_cast<__nv_bfloat16*>(rounded), terms, classes);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    thread_spreads_kernel<<<warp_row_blocks(kRowThreads), kRowThreads, 0, stream>>>(
        terms, chunk.batch, plan.vector);
    return cudaGetLastError();
  });
}

int64_t gram_bounds_floats(int64_t batch) { return 4 * batch + kRowThreads; }

int hardest_blocks_per_sm(int vector, DType dtype) {
  int blocks = 0;
  const cudaError_t status = with_rows(dtype, [&](auto element) {
    using T = decltype(element);
    const auto kernel = vector == 4 ? hardest_kernel<4, T> : hardest_kernel<1, T>;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kRowThreads, 0);
  });
  if (status != cudaSuccess) (void)cudaGetLastError();  // no rounding, and no error left behind
  return status == cudaSuccess ? blocks : 0;
}

cudaError_t launch_hardest(const MiningChunk& chunk, const MiningPlan& plan, const void* gram,
                           const float* bounds, const int64_t* classes, const int64_t* order,
                           int64_t* positive, int64_t* negative, bool* valid,
                           cudaStream_t stream) {
  return with_rows(chunk.dtype, [&](auto element) {
    using T = decltype(element);
    const auto kernel = plan.vector == 4 ? hardest_kernel<4, T> : hardest_kernel<1, T>;
    kernel<<<chunk.rows, plan.row_block, 0, stream>>>(
        chunk, static_cast<const __nv_bfloat16*>(gram),
        gram_bounds(const_cast<float*>(bounds), chunk.batch), classes, order, positive, negative,
        valid);
    return cudaGetLastError();
  });
}

cudaError_t launch_distances(const MiningChunk& chunk, const MiningPlan& plan, float* dists,
                             cudaStream_t stream) {
  const dim3 grid((chunk.batch + plan.tile - 1) / plan.tile, (chunk.rows + plan.tile - 1) / plan.tile);
  return with_rows(chunk.dtype, [&](auto element) {
    distances_kernel<decltype(element)><<<grid, kTileThreads, 0, stream>>>(chunk, dists);
    return cudaGetLastError();
  });
}

cudaError_t launch_column_means(const void* x, DType dtype, int64_t batch, int64_t dim,
                                const MiningPlan& plan, double* partials, float* mean,
                                cudaStream_t stream) {
  if (batch == 0 || dim == 0) return cudaSuccess;  // no mean to write (a grid of 0 is no launch)
  const cudaError_t err = with_rows(dtype, [&](auto element) {
    using T = decltype(element);
    column_sums_kernel<T><<<dim3(unsigned((dim + 31) / 32), plan.mean_slices), kRowThreads, 0,
                            stream>>>(static_cast<const T*>(x), batch, dim, partials);
    return cudaGetLastError();
  });
  if (err != cudaSuccess) return err;
  column_means_kernel<<<(dim + kRowThreads - 1) / kRowThreads, kRowThreads, 0, stream>>>(
      partials, plan.mean_slices, batch, dim, mean);
  return cudaGetLastError();
}

int64_t label_order_scratch(const MiningPlan& plan, int64_t batch) {
  return plan.count_labels ? plan.rank_slices * batch : 3 * batch;  // tiles: int64 labels, rows
}

cudaError_t launch_label_order(const int64_t* labels, int64_t batch, const MiningPlan& plan,
                               int32_t* scratch, int64_t* sorted_labels, int64_t* order,
                               cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  if (plan.count_labels) {
    const int64_t rows_per_block = int64_t(kRowThreads) * kRankRowsPerThread;
    label_ranks_kernel<<<dim3(unsigned((batch + rows_per_block - 1) / rows_per_block),
                              plan.rank_slices),
                         kRowThreads, 0, stream>>>(labels, batch, scratch);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    label_order_kernel<<<(batch + kRowThreads - 1) / kRowThreads, kRowThreads, 0, stream>>>(
        labels, scratch, plan.rank_slices, batch, sorted_labels, order);
    return cudaGetLastError();
  }
  int64_t* tile_labels = reinterpret_cast<int64_t*>(scratch);  // 8-byte aligned: an allocation
  int32_t* tile_rows = scratch + 2 * batch;
  label_tiles_kernel<<<unsigned((batch + kLabelTile - 1) / kLabelTile), kLabelThreads, 0,
                       stream>>>(labels, batch, tile_labels, tile_rows);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  label_merge_kernel<<<(batch + kRowThreads - 1) / kRowThreads, kRowThreads, 0, stream>>>(
      tile_labels, tile_rows, batch, sorted_labels, order);
  return cudaGetLastError();
}

cudaError_t launch_centred_rows(const float* x, const float* mean, int64_t batch, int64_t dim,
                                float* centred, float* terms, cudaStream_t stream) {
  centred_rows_kernel<<<warp_row_blocks(batch), kRowThreads, 0, stream>>>(
      x, mean, batch, dim, centred, reinterpret_cast<float2*>(terms));
  return cudaGetLastError();
}

cudaError_t launch_gram_distances(const MiningChunk& chunk, const MiningPlan& plan,
                                  const float* terms, float* dists, cudaStream_t stream) {
  if (!float_rows(chunk)) return cudaErrorInvalidValue;
  gram_distances_kernel<<<chunk.rows, plan.row_block, 0, stream>>>(
      chunk, reinterpret_cast<const float2*>(terms), plan.gram_keep_ratio, dists);
  return cudaGetLastError();
}

cudaError_t launch_hard_loss(const MiningChunk& chunk, const MiningPlan& plan, const float* dists,
                             const int64_t* picked, float* loss, int64_t* counted,
                             double* state, cudaStream_t stream) {
  return with_rows(chunk.dtype, [&](auto element) {
    using T = decltype(element);
    const auto kernel = picked == nullptr ? hard_loss_kernel<true, T> : hard_loss_kernel<false, T>;
    kernel<<<chunk.batch, plan.row_block, 0, stream>>>(chunk, dists, picked, loss, counted, state);
    return cudaGetLastError();
  });
}

cudaError_t launch_hard_gradient(const MiningChunk& chunk, const MiningPlan& plan,
                                 const double* state, const Upstream& upstream, bool hinge_at_zero,
                                 const int32_t* sorted_rows, const int64_t* places, float* grad,
                                 cudaStream_t stream) {
  const int64_t tile_rows = plan.row_block / 32 * plan.gradient_rows_per_warp;
  return with_rows(chunk.dtype, [&](auto element) {
    using T = decltype(element);
    if (plan.gradient_sorted_choices) {
      hard_gradient_sorted_kernel<T><<<warp_row_blocks(chunk.batch), kRowThreads, 0, stream>>>(
          chunk, state, upstream, hinge_at_zero, sorted_rows, places, grad);
    } else {
      hard_gradient_kernel<T><<<unsigned((chunk.batch + tile_rows - 1) / tile_rows),
                                plan.row_block, 0, stream>>>(
          chunk, state, upstream, hinge_at_zero, plan.gradient_rows_per_warp, grad);
    }
    return cudaGetLastError();
  });
}

cudaError_t launch_batch_all(const MiningChunk& chunk, const MiningPlan& plan, const float* dists,
                             const Upstream& upstream, float* loss, int64_t* counted,
                             float* weights, double* weight_sums, cudaStream_t stream) {
  const size_t row_copy = weights == dists ? size_t(chunk.batch) * sizeof(float) : 0;
  const LossRule& rule = chunk.rule;
  const bool general =
      rule.soft || rule.band != Band::kNone || rule.counting == Counting::kAbove1e16;
  const auto kernel = chunk.mining == Mining::kSemiHard ? batch_all_kernel<false, true>
                      : general                         ? batch_all_kernel<true, false>
                                                        : batch_all_kernel<false, false>;
  kernel<<<chunk.rows, plan.row_block, row_copy, stream>>>(chunk, dists, upstream, loss, counted,
                                                           weights, weight_sums);
  return cudaGetLastError();
}

cudaError_t launch_all_gradient(const MiningChunk& chunk, const MiningPlan& plan,
                                const float* weights, const Upstream& upstream, float* partials,
                                float* grad, cudaStream_t stream) {
  if (!float_rows(chunk)) return cudaErrorInvalidValue;
  if (plan.gradient_tensor_cores) {
    const dim3 grid((chunk.dim + kGradientCols - 1) / kGradientCols,
                    (chunk.batch + kGradientRows - 1) / kGradientRows);
    const int bytes = sizeof(GradientShared);
    const cudaError_t err = allow_shared_memory<all_gradient_mma_kernel>(bytes);
    if (err != cudaSuccess) return err;
    all_gradient_mma_kernel<<<grid, kGradientThreads, bytes, stream>>>(chunk, weights, upstream,
                                                                       grad);
  } else {
    const int parts = plan.gradient_column_parts;
    if (parts > 1 && partials == nullptr) return cudaErrorInvalidValue;
    const dim3 grid((chunk.dim + plan.tile - 1) / plan.tile,
                    (chunk.batch + plan.tile - 1) / plan.tile, parts);
    all_gradient_kernel<<<grid, kTileThreads * kGradientHalves, 0, stream>>>(
        chunk, weights, upstream, grad, partials);
    if (parts > 1) {
      const cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) return err;
      const int64_t n = chunk.batch * chunk.dim;
      const int64_t blocks = std::min<int64_t>((n + kRowThreads - 1) / kRowThreads, 4096);
      gradient_parts_kernel<<<unsigned(blocks), kRowThreads, 0, stream>>>(partials, parts, n,
                                                                          grad);
    }
  }
  return cudaGetLastError();
}

cudaError_t launch_sparse_gradient(const MiningChunk& chunk, const float* weights, double* out,
                                   cudaStream_t stream) {
  if (!float_rows(chunk)) return cudaErrorInvalidValue;
  if (chunk.rows == 0) return cudaSuccess;  // a grid of 0 blocks is no launch
  constexpr int kWarps = kRowThreads / 32;
  sparse_rows_gradient_kernel<<<unsigned((chunk.rows + kWarps - 1) / kWarps), kRowThreads, 0,
                                stream>>>(chunk, weights, out);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  sparse_columns_gradient_kernel<<<unsigned((chunk.batch + 31) / 32), kRowThreads, 0, stream>>>(
      chunk, weights, out);
  return cudaGetLastError();
}

cudaError_t launch_finish(const float* losses, const int64_t* counted, int64_t batch,
                          int64_t reduction, float* loss, float* count, cudaStream_t stream) {
  mined_total_kernel<<<1, kRowThreads, 0, stream>>>(losses, counted, batch, reduction, loss, count);
  return cudaGetLastError();
}

}  // namespace fused_triplet
// library-only }
