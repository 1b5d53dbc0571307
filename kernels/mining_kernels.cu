// library-only {
// In-batch mining for mined_triplet_margin_loss (p = 2) on float embeddings (2-byte ones cast
// exactly first), one chunk of anchors at a time; a block scans one anchor's row of
// the chunk. No atomics: the same inputs give the same bits.
//   gram_rows_kernel  batch_hard: the sorted, centred rows rounded to bfloat16 for the Gram
//                     products, and each row's error bounds.
//   hardest_kernel    batch_hard: from the bfloat16 Gram matrix's approximate squared distances
//                     and their error bounds, the candidates that can be the hardest positive or
//                     negative, decided by their exact distance.
//   distances_kernel  batch_all: exact distances of (anchor, candidate) tiles, torch's formula.
//   batch_all_kernel  batch_all: per anchor, the sum and count of relu(margin + d_ap - d_an) over
//                     its (positive, negative) pairs; backward: d loss / d d(i, c) / d(i, c).
// The loss of batch_hard's chosen triplets is the fused triplet op's, on the gathered rows.
#include "mining_launch.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

namespace fused_triplet {

// ==== The mining table ====
// A chunk x batch float buffer of at most 2^26 floats (256 MiB): the Gram products stay large
// enough for the tensor cores, the memory bounded at any batch.
constexpr int64_t kChunkFloats = int64_t(1) << 26;
constexpr int kRowThreads = 256;  // a block per anchor row: 8 warps, loads in flight across it
constexpr int kRowUnroll = 8;     // batch_hard's bounds pass: columns each thread loads at once
constexpr int kRowVector = 4;     // in 16-byte loads of 4 where rows are (batch % 4 == 0)
constexpr int kDistanceUnroll = 8;  // exact distances: elements of each row a lane loads at once
constexpr int kTile = 64;         // distances: 64 x 64 pairs per block, 4 x 4 per thread
constexpr int kTileDepth = 16;    // elements of each row staged in shared memory per step
constexpr int kTileThreads = (kTile / 4) * (kTile / 4);
constexpr int kPositiveSlots = 2048;  // batch_all: positives staged per pass over the negatives
// The Gram matrix's error on a squared distance d(i, c)^2, with x~ = x + r the centred rows
// rounded to bfloat16: 2 (x~_i . r_c + r_i . x_c) + accumulation, at most
// 2 (|x~_i| |r_c| + |r_i| |x_c|) + 2 gram_bound |x~_i| |x~_c|. 2ab <= w a^2 + b^2 / w splits it into
// a term per row; the weight w = 2^-10 sits near bfloat16's typical |r| / |x|, where the split
// loses least. Float accumulation of D products: 2^-23 each if tensor-core adds truncate, 2^-21
// per element leaves room for the float row terms and the exact distances.
constexpr float kGramRoundingWeight = 1.0f / (1 << 10);
constexpr float kGramPerElementBound = 1.0f / (1 << 21);

MiningPlan plan_mining(int64_t batch, int64_t dim) {
  MiningPlan plan;
  plan.gram_bound = float(dim + 16) * kGramPerElementBound;
  plan.rounding_weight = kGramRoundingWeight;
  plan.chunk_rows = std::clamp<int64_t>(kChunkFloats / std::max<int64_t>(batch, 1), 1,
                                        std::max<int64_t>(batch, 1));
  plan.row_block = kRowThreads;
  // 16-byte groups only where every thread gets one: below, most warps would get no columns.
  plan.vector = batch % kRowVector == 0 && batch >= kRowVector * kRowThreads ? kRowVector : 1;
  plan.tile = kTile;
  return plan;
}

namespace {

// torch's pairwise_distance squared, sum(((a - b) + eps)^2) in float, lanes striding the row; the
// butterfly leaves the same bits in every lane.
__device__ float exact_sq_distance(const float* a, const float* b, int64_t dim, float eps,
                                   int lane) {
  float acc = 0.f;
  int64_t k = lane;
  for (; k + 32 * (kDistanceUnroll - 1) < dim; k += 32 * kDistanceUnroll) {
    float x[kDistanceUnroll], y[kDistanceUnroll];
#pragma unroll
    for (int u = 0; u < kDistanceUnroll; ++u) x[u] = a[k + 32 * u], y[u] = b[k + 32 * u];
#pragma unroll
    for (int u = 0; u < kDistanceUnroll; ++u) {
      const float v = (x[u] - y[u]) + eps;
      acc = fmaf(v, v, acc);
    }
  }
  for (; k < dim; k += 32) {
    const float v = (a[k] - b[k]) + eps;
    acc = fmaf(v, v, acc);
  }
  for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
  return acc;
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

__device__ __forceinline__ float warp_max(float x) {
  for (int offset = 16; offset > 0; offset >>= 1)
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

__device__ __forceinline__ float warp_min(float x) {
  for (int offset = 16; offset > 0; offset >>= 1)
    x = fminf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// batch_hard's Gram inputs, a warp per sorted position s: the embedding order[s] less the batch
// mean, x, rounded to bfloat16 (x~ = x + r), and its bounds' terms, by the spreads of the table:
// w n^2 + |r|^2 / w + 2 gram_bound n^2 (n = max(|x|, |x~|); (n + eps sqrt(D))^2 in the last term
// for an anchor) around |x|^2 - 2 eps sum(x) as a candidate, |x|^2 + 2 eps sum(x) + D eps^2 as an
// anchor. bounds: [2, batch] (lower, upper), candidates then anchors.
__global__ void __launch_bounds__(kRowThreads)
    gram_rows_kernel(MiningChunk chunk, MiningPlan plan, const int64_t* order, const float* mean,
                     __nv_bfloat16* rounded, float2* bounds, int64_t* classes) {
  const int lane = threadIdx.x % 32;
  const int64_t s = int64_t(blockIdx.x) * (kRowThreads / 32) + threadIdx.x / 32;
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
  const float* row = chunk.embeddings + order[s] * dim;
  __nv_bfloat16* out = rounded + s * dim;
  float sq = 0.f, sum = 0.f, rounded_sq = 0.f, residual_sq = 0.f;
  for (int64_t k = lane; k < dim; k += 32) {
    const float x = row[k] - mean[k];
    const __nv_bfloat16 b = __float2bfloat16_rn(x);
    const float w = __bfloat162float(b), r = x - w;
    out[k] = b;
    sq = fmaf(x, x, sq);
    sum += x;
    rounded_sq = fmaf(w, w, rounded_sq);
    residual_sq = fmaf(r, r, residual_sq);
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    sq += __shfl_xor_sync(0xffffffffu, sq, offset);
    sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    rounded_sq += __shfl_xor_sync(0xffffffffu, rounded_sq, offset);
    residual_sq += __shfl_xor_sync(0xffffffffu, residual_sq, offset);
  }
  if (lane != 0) return;
  const float eps = chunk.eps, n2 = fmaxf(sq, rounded_sq), w = plan.rounding_weight;
  const float rounding = w * n2 + residual_sq / w;
  const float anchor_norm = sqrtf(n2) + eps * sqrtf(float(dim));
  const float as_candidate = sq - 2.f * eps * sum;
  const float candidate_spread = rounding + 2.f * plan.gram_bound * n2;
  const float as_anchor = sq + 2.f * eps * sum + float(dim) * eps * eps;
  const float anchor_spread = rounding + 2.f * plan.gram_bound * anchor_norm * anchor_norm;
  bounds[s] = make_float2(as_candidate - candidate_spread, as_candidate + candidate_spread);
  bounds[chunk.batch + s] = make_float2(as_anchor - anchor_spread, as_anchor + anchor_spread);
}

// A block per anchor row, the batch sorted by label: the anchor's positives are the columns of its
// class's range (gram_rows_kernel's classes), the negatives every other column. Each pass works
// on t = candidate term - 2 gram (d^2's interval is the anchor's term + t, rounding monotone in t,
// so extremes of t are extremes of d^2). First the bounds: the negatives in 16-byte groups where
// rows are aligned (thread t takes groups from kVector t, every kVector x 256 columns), the
// class's columns strided over the block: a lower bound of the row's largest positive squared
// distance, an upper bound of its smallest negative one, and each thread's most promising
// positive and negative column with the runner-up's bound. A column whose interval can beat the
// row's bound is a candidate and gets its exact distance from the whole warp: the true extreme
// always is one, so it is always decided exactly. Threads whose runner-up is a candidate too (or
// that saw a bound that is not finite) walk those columns again. The warps then combine picks.
template <int kVector>
__global__ void __launch_bounds__(kRowThreads)
    hardest_kernel(MiningChunk chunk, const float* gram, const float2* bounds,
                   const int64_t* classes, const int64_t* order, int64_t* positive,
                   int64_t* negative, bool* valid) {
  constexpr int kWarps = kRowThreads / 32;
  constexpr int kGroups = kRowUnroll / kVector;  // groups of columns loaded at once
  __shared__ float warp_floors[kWarps], warp_ceilings[kWarps];
  __shared__ Pick warp_positives[kWarps], warp_negatives[kWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t row = blockIdx.x, me = chunk.first + row, batch = chunk.batch;
  const int64_t class_first = classes[2 * me], class_last = classes[2 * me + 1];
  const float* gram_row = gram + row * batch;
  const float2 mine = bounds[batch + me];  // bounds: candidate terms, then anchor terms
  const auto in_class = [&](int64_t c) {
    return uint64_t(c - class_first) < uint64_t(class_last - class_first);
  };
  const auto column_of = [&](int64_t base, int u) {  // the u-th column loaded from base
    return base + (u / kVector) * (kVector * kRowThreads) + u % kVector;
  };
  // Negatives: the smallest upper t, and the smallest lower t, its column and the runner-up.
  float ceiling = INFINITY, bottom = INFINITY, next_bottom = INFINITY;
  int64_t bottom_column = -1;
  float negative_spans = 0.f;  // sum of upper - lower: not finite where a bound is not
  for (int64_t base = int64_t(threadIdx.x) * kVector; base < batch;
       base += kGroups * kVector * kRowThreads) {
    float products[kRowUnroll];
    float2 terms[kRowUnroll];
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const int64_t c = column_of(base, g * kVector);
      if constexpr (kVector == 4) {  // batch % 4 == 0: the group is whole and 16-byte aligned
        const float4 p = c < batch ? *reinterpret_cast<const float4*>(gram_row + c)
                                   : make_float4(0.f, 0.f, 0.f, 0.f);
        const float4 t0 = c < batch ? *reinterpret_cast<const float4*>(bounds + c)
                                    : make_float4(0.f, 0.f, 0.f, 0.f);
        const float4 t1 = c < batch ? *reinterpret_cast<const float4*>(bounds + c + 2)
                                    : make_float4(0.f, 0.f, 0.f, 0.f);
        products[g * 4] = p.x, products[g * 4 + 1] = p.y;
        products[g * 4 + 2] = p.z, products[g * 4 + 3] = p.w;
        terms[g * 4] = make_float2(t0.x, t0.y), terms[g * 4 + 1] = make_float2(t0.z, t0.w);
        terms[g * 4 + 2] = make_float2(t1.x, t1.y), terms[g * 4 + 3] = make_float2(t1.z, t1.w);
      } else {
        products[g] = c < batch ? gram_row[c] : 0.f;
        terms[g] = c < batch ? bounds[c] : make_float2(0.f, 0.f);
      }
    }
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const int64_t first = column_of(base, g * kVector);
      if (first >= batch) continue;
      const bool meets_class = first < class_last && first + kVector > class_first;
#pragma unroll
      for (int j = 0; j < kVector; ++j) {
        const int u = g * kVector + j;
        const int64_t c = first + j;
        if (meets_class && in_class(c)) continue;
        const float lower = fmaf(-2.f, products[u], terms[u].x);
        const float upper = fmaf(-2.f, products[u], terms[u].y);
        negative_spans += upper - lower;
        ceiling = fminf(ceiling, upper);
        bottom_column = lower < bottom ? c : bottom_column;
        next_bottom = fminf(next_bottom, fmaxf(bottom, lower));
        bottom = fminf(bottom, lower);
      }
    }
  }
  // Positives: the largest lower t, and the largest upper t, its column and the runner-up.
  float floor = -INFINITY, top = -INFINITY, next_top = -INFINITY;
  int64_t top_column = -1;
  float positive_spans = 0.f;
  for (int64_t c = class_first + threadIdx.x; c < class_last; c += kRowThreads) {
    if (c == me) continue;
    const float product = gram_row[c];
    const float2 terms = bounds[c];
    const float lower = fmaf(-2.f, product, terms.x), upper = fmaf(-2.f, product, terms.y);
    positive_spans += upper - lower;
    floor = fmaxf(floor, lower);
    top_column = upper > top ? c : top_column;
    next_top = fmaxf(next_top, fminf(top, upper));
    top = fmaxf(top, upper);
  }
  floor = warp_max(floor);
  ceiling = warp_min(ceiling);
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
  const auto as_lower = [&](float t) { return t < INFINITY ? mine.x + t : INFINITY; };
  top = as_upper(top), next_top = as_upper(next_top);
  bottom = as_lower(bottom), next_bottom = as_lower(next_bottom);
  const bool walks_positives = odd_anchor || !(fabsf(positive_spans) < INFINITY) ||
                               (next_top > -INFINITY && next_top >= floor);
  const bool walks_negatives = odd_anchor || !(fabsf(negative_spans) < INFINITY) ||
                               (next_bottom < INFINITY && next_bottom <= ceiling);
  const float* embeddings = chunk.embeddings;
  const float* anchor_row = embeddings + order[me] * chunk.dim;
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
  // The threads that do not walk: their one positive and one negative candidate at most.
  decide_lanes(!walks_positives && top_column >= 0 && top >= floor, top_column, true);
  decide_lanes(!walks_negatives && bottom_column >= 0 && bottom <= ceiling, bottom_column, false);
  // The walking threads' columns again, a warp in step; a NaN interval is always a candidate.
  const auto interval = [&](int64_t c) {
    const float product = gram_row[c];
    const float2 terms = bounds[c];
    return make_float2(mine.x + fmaf(-2.f, product, terms.x),
                       mine.y + fmaf(-2.f, product, terms.y));
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
  if (__any_sync(0xffffffffu, walks_negatives)) {
    for (int64_t first = int64_t(warp) * 32 * kVector; first < batch;
         first += kVector * kRowThreads) {
      for (int j = 0; j < kVector; ++j) {
        const int64_t c = first + lane * kVector + j;
        bool is_candidate = false;
        if (walks_negatives && c < batch && !in_class(c)) {
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
  const bool found = best_positive.index >= 0 && best_negative.index >= 0;
  const int64_t anchor = order[me];
  positive[anchor] = found ? best_positive.index : anchor;
  negative[anchor] = found ? best_negative.index : anchor;
  valid[anchor] = found;
}

__global__ void __launch_bounds__(kTileThreads) distances_kernel(MiningChunk chunk, float* dists) {
  // Rows staged as float, (depth, row); past the row's end the anchor holds 0 and the candidate
  // eps, so (0 - eps) + eps adds exactly 0.
  __shared__ __align__(16) float anchors[kTileDepth][kTile + 4];
  __shared__ __align__(16) float candidates[kTileDepth][kTile + 4];
  const float* embeddings = chunk.embeddings;
  const int tx = threadIdx.x % (kTile / 4), ty = threadIdx.x / (kTile / 4);
  const int64_t row0 = int64_t(blockIdx.y) * kTile, col0 = int64_t(blockIdx.x) * kTile;
  const float eps = chunk.eps;
  float acc[4][4] = {};
  for (int64_t k0 = 0; k0 < chunk.dim; k0 += kTileDepth) {
    for (int e = threadIdx.x; e < kTile * kTileDepth; e += kTileThreads) {
      const int r = e / kTileDepth, kk = e % kTileDepth;
      const int64_t k = k0 + kk, a = row0 + r, c = col0 + r;
      const bool inside = k < chunk.dim;
      anchors[kk][r] = inside && a < chunk.rows
                           ? embeddings[(chunk.first + a) * chunk.dim + k] : 0.f;
      candidates[kk][r] = !inside ? eps
                          : c < chunk.batch ? embeddings[c * chunk.dim + k] : 0.f;
    }
    __syncthreads();
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
      if (c < chunk.batch) dists[a * chunk.batch + c] = sqrtf(acc[i][j]);
    }
  }
}

// Block-wide sum in a fixed order (warp butterflies, then the warps in turn); every thread gets it.
template <typename S>
__device__ S block_sum(S x, S* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  __syncthreads();  // scratch is free
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
  __syncthreads();
  S total = 0;
  for (int w = 0; w < kRowThreads / 32; ++w) total += scratch[w];
  return total;
}

__global__ void __launch_bounds__(kRowThreads)
    batch_all_kernel(MiningChunk chunk, const float* dists, const float* upstream, float* loss,
                     int64_t* active, float* coeffs) {
  __shared__ float thresholds[kPositiveSlots];  // margin + d(i, j) of the staged positives
  __shared__ int64_t staged[kPositiveSlots];    // their columns
  __shared__ int warp_counts[kRowThreads / 32];
  __shared__ double sum_scratch[kRowThreads / 32];
  __shared__ int64_t count_scratch[kRowThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t row = blockIdx.x, anchor = chunk.first + row, batch = chunk.batch;
  const float* d = dists + row * batch;
  const int64_t my_id = chunk.ids[anchor];
  const bool backward = upstream != nullptr;
  float* w = backward ? coeffs + row * batch : nullptr;  // d loss_i / d d(i, c), then / d(i, c)
  if (backward) {
    for (int64_t c = threadIdx.x; c < batch; c += kRowThreads) w[c] = 0.f;
  }
  double sum = 0.0;
  int64_t count = 0;
  int64_t next = 0;  // the next column to look at for positives
  while (next < batch) {
    // Stage the next positives, in column order.
    int filled = 0;
    __syncthreads();  // the last pass's readers are done with the slots
    for (; next < batch && filled + kRowThreads <= kPositiveSlots; next += kRowThreads) {
      const int64_t c = next + threadIdx.x;
      const bool is_positive = c < batch && c != anchor && chunk.ids[c] == my_id;
      const unsigned ballot = __ballot_sync(0xffffffffu, is_positive);
      if (lane == 0) warp_counts[warp] = __popc(ballot);
      __syncthreads();
      int offset = filled, total = 0;
      for (int v = 0; v < kRowThreads / 32; ++v) {
        offset += v < warp ? warp_counts[v] : 0;
        total += warp_counts[v];
      }
      if (is_positive) {
        const int slot = offset + __popc(ballot & ((1u << lane) - 1u));
        thresholds[slot] = chunk.margin + d[c];
        staged[slot] = c;
      }
      filled += total;
      __syncthreads();  // warp_counts is read before the next group writes it
    }
    if (filled == 0) continue;
    // Every negative against the staged positives.
    for (int64_t c = threadIdx.x; c < batch; c += kRowThreads) {
      if (chunk.ids[c] == my_id) continue;  // the anchor and its positives
      const float dn = d[c];
      int hits = 0;
      for (int j = 0; j < filled; ++j) {
        const float v = thresholds[j] - dn;
        if (v > 0.f) {
          ++hits;
          sum += v;
        } else if (v != v) {
          sum += v;  // NaN: the loss is NaN, as torch's relu gives
        }
      }
      count += hits;
      if (backward) w[c] -= float(hits);
    }
    if (backward) {
      // Each staged positive: how many negatives its pairs are active with (a warp each).
      for (int j = warp; j < filled; j += kRowThreads / 32) {
        int hits = 0;
        for (int64_t c = lane; c < batch; c += 32) {
          hits += chunk.ids[c] != my_id && thresholds[j] - d[c] > 0.f;
        }
        for (int offset = 16; offset > 0; offset >>= 1)
          hits += __shfl_xor_sync(0xffffffffu, hits, offset);
        if (lane == 0) w[staged[j]] = float(hits);
      }
    }
  }
  if (backward) {
    __syncthreads();  // every count of the row is written
    const float g = upstream[anchor];
    for (int64_t c = threadIdx.x; c < batch; c += kRowThreads) {
      const float weight = w[c];
      w[c] = weight != 0.f && d[c] != 0.f ? g * weight / d[c] : 0.f;
    }
    return;
  }
  const double total = block_sum(sum, sum_scratch);
  const int64_t total_count = block_sum(count, count_scratch);
  if (threadIdx.x == 0) {
    loss[anchor] = float(total);
    active[anchor] = total_count;
  }
}

}  // namespace

cudaError_t launch_gram_rows(const MiningChunk& chunk, const MiningPlan& plan, const int64_t* order,
                             const float* mean, void* rounded, float* bounds, int64_t* classes,
                             cudaStream_t stream) {
  constexpr int kRowsPerBlock = kRowThreads / 32;
  gram_rows_kernel<<<(chunk.batch + kRowsPerBlock - 1) / kRowsPerBlock, kRowThreads, 0, stream>>>(
      chunk, plan, order, mean, static_cast<__nv_bfloat16*>(rounded),
      reinterpret_cast<float2*>(bounds), classes);
  return cudaGetLastError();
}

cudaError_t launch_hardest(const MiningChunk& chunk, const MiningPlan& plan, const float* gram,
                           const float* bounds, const int64_t* classes, const int64_t* order,
                           int64_t* positive, int64_t* negative, bool* valid,
                           cudaStream_t stream) {
  const auto kernel = plan.vector == 4 ? hardest_kernel<4> : hardest_kernel<1>;
  kernel<<<chunk.rows, plan.row_block, 0, stream>>>(
      chunk, gram, reinterpret_cast<const float2*>(bounds), classes, order, positive, negative,
      valid);
  return cudaGetLastError();
}

cudaError_t launch_distances(const MiningChunk& chunk, const MiningPlan& plan, float* dists,
                             cudaStream_t stream) {
  const dim3 grid((chunk.batch + plan.tile - 1) / plan.tile, (chunk.rows + plan.tile - 1) / plan.tile);
  distances_kernel<<<grid, kTileThreads, 0, stream>>>(chunk, dists);
  return cudaGetLastError();
}

cudaError_t launch_batch_all(const MiningChunk& chunk, const MiningPlan& plan, const float* dists,
                             const float* upstream, float* loss, int64_t* active, float* coeffs,
                             cudaStream_t stream) {
  batch_all_kernel<<<chunk.rows, plan.row_block, 0, stream>>>(chunk, dists, upstream, loss,
                                                              active, coeffs);
  return cudaGetLastError();
}

}  // namespace fused_triplet
// library-only }
