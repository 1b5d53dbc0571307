// library-only {
// In-batch mining for mined_triplet_margin_loss (p = 2) on float embeddings (2-byte ones cast
// exactly first), one chunk of anchors at a time; a block scans one anchor's row of
// the chunk. No atomics: the same inputs give the same bits.
//   hardest_kernel    batch_hard: from the bfloat16 Gram matrix's approximate squared distances
//                     and their error bounds, the candidates that can be the hardest positive or
//                     negative, decided by their exact distance.
//   distances_kernel  batch_all: exact distances of (anchor, candidate) tiles, torch's formula.
//   batch_all_kernel  batch_all: per anchor, the sum and count of relu(margin + d_ap - d_an) over
//                     its (positive, negative) pairs; backward: d loss / d d(i, c) / d(i, c).
// The loss of batch_hard's chosen triplets is the fused triplet op's, on the gathered rows.
#include "mining_launch.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

namespace fused_triplet {

// ==== The mining table ====
// A chunk x batch float buffer of at most 2^26 floats (256 MiB): the Gram products stay large
// enough for the tensor cores, the memory bounded at any batch.
constexpr int64_t kChunkFloats = int64_t(1) << 26;
constexpr int kRowThreads = 256;  // a block per anchor row: 8 warps, loads in flight across it
constexpr int kTile = 64;         // distances: 64 x 64 pairs per block, 4 x 4 per thread
constexpr int kTileDepth = 16;    // elements of each row staged in shared memory per step
constexpr int kTileThreads = (kTile / 4) * (kTile / 4);
constexpr int kPositiveSlots = 2048;  // batch_all: positives staged per pass over the negatives
// The Gram matrix's error on a squared distance, relative to (|x_i| + |x_c| + eps sqrt(D))^2:
// bfloat16 rounding of the centred inputs (2^-9 each, 2^-7 with room) and float accumulation of
// D products (2^-24 each; 2^-20 per element allows truncating tensor-core adds). That square is
// at most 2 (|x_i| + eps sqrt(D))^2 + 2 |x_c|^2, so the bound splits into a term per row.
constexpr float kGramRoundingBound = 1.0f / 128;
constexpr float kGramPerElementBound = 1.0f / (1 << 20);

MiningPlan plan_mining(int64_t batch, int64_t dim) {
  MiningPlan plan;
  plan.gram_bound = kGramRoundingBound + float(dim + 16) * kGramPerElementBound;
  plan.chunk_rows = std::clamp<int64_t>(kChunkFloats / std::max<int64_t>(batch, 1), 1,
                                        std::max<int64_t>(batch, 1));
  plan.row_block = kRowThreads;
  plan.tile = kTile;
  return plan;
}

namespace {

// torch's pairwise_distance squared, sum(((a - b) + eps)^2) in float, lanes striding the row; the
// butterfly leaves the same bits in every lane.
__device__ float exact_sq_distance(const float* a, const float* b, int64_t dim, float eps,
                                   int lane) {
  float acc = 0.f;
  for (int64_t k = lane; k < dim; k += 32) {
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

// One block per anchor row, in two passes over it. First the bounds (thread t takes candidates
// t, t + 256, ...): a lower bound of the row's largest positive squared distance, an upper bound
// of its smallest negative one. Then each warp takes 32 consecutive candidates at a time, and
// every one whose own bounds can still beat the row's gets its exact distance from the whole
// warp: the true extreme always can, so it is always decided exactly (NaN approximations always
// are). The warps then combine their picks.
__global__ void __launch_bounds__(kRowThreads)
    hardest_kernel(MiningChunk chunk, const float* gram, const float4* bounds, int64_t* positive,
                   int64_t* negative, bool* valid) {
  constexpr int kWarps = kRowThreads / 32;
  __shared__ float warp_floors[kWarps], warp_ceilings[kWarps];
  __shared__ int warp_has[kWarps];
  __shared__ Pick warp_positives[kWarps], warp_negatives[kWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t row = blockIdx.x, anchor = chunk.first + row, batch = chunk.batch;
  const float* embeddings = chunk.embeddings;
  const float* anchor_row = embeddings + anchor * chunk.dim;
  const float* gram_row = gram + row * batch;
  const float2* candidate_terms = reinterpret_cast<const float2*>(bounds);  // [2 c]: .x, .y of c
  const float4 me = bounds[anchor];  // .z, .w: this row's anchor terms
  const int64_t my_id = chunk.ids[anchor];
  float floor = -INFINITY, ceiling = INFINITY;
  int has = 0;  // bit 0: a positive, bit 1: a negative
  for (int64_t c = threadIdx.x; c < batch; c += kRowThreads) {
    if (c == anchor) continue;
    const float minus_two_gram = -2.f * gram_row[c];
    const float2 b = candidate_terms[2 * c];
    if (chunk.ids[c] == my_id) {
      has |= 1;
      floor = fmaxf(floor, me.z + (b.x + minus_two_gram));
    } else {
      has |= 2;
      ceiling = fminf(ceiling, me.w + (b.y + minus_two_gram));
    }
  }
  floor = warp_max(floor);
  ceiling = warp_min(ceiling);
  for (int offset = 16; offset > 0; offset >>= 1) has |= __shfl_xor_sync(0xffffffffu, has, offset);
  if (lane == 0) warp_floors[warp] = floor, warp_ceilings[warp] = ceiling, warp_has[warp] = has;
  __syncthreads();
  for (int w = 0; w < kWarps; ++w) {
    floor = fmaxf(floor, warp_floors[w]);
    ceiling = fminf(ceiling, warp_ceilings[w]);
    has |= warp_has[w];
  }
  Pick best_positive{0.f, -1}, best_negative{0.f, -1};
  for (int64_t first = int64_t(warp) * 32; first < batch; first += kRowThreads) {
    const int64_t c = first + lane;
    bool is_positive = false, is_negative = false;
    float lower = 0.f, upper = 0.f;  // bounds of the squared distance to candidate c
    if (c < batch && c != anchor) {
      const float minus_two_gram = -2.f * gram_row[c];
      const float2 b = candidate_terms[2 * c];
      lower = me.z + (b.x + minus_two_gram);
      upper = me.w + (b.y + minus_two_gram);
      is_positive = chunk.ids[c] == my_id;
      is_negative = !is_positive;
    }
    const bool nan = lower != lower || upper != upper;
    const unsigned positives = __ballot_sync(0xffffffffu, is_positive && (nan || upper >= floor));
    unsigned candidates =
        positives | __ballot_sync(0xffffffffu, is_negative && (nan || lower <= ceiling));
    while (candidates != 0) {
      const int bit = __ffs(candidates) - 1;
      candidates &= candidates - 1;
      const int64_t column = first + bit;
      const Pick exact{exact_sq_distance(anchor_row, embeddings + column * chunk.dim, chunk.dim,
                                         chunk.eps, lane),
                       column};
      if ((positives >> bit) & 1u) {
        if (beats<true>(exact, best_positive)) best_positive = exact;
      } else if (beats<false>(exact, best_negative)) {
        best_negative = exact;
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
  positive[anchor] = found ? best_positive.index : anchor;
  negative[anchor] = found ? best_negative.index : anchor;
  valid[anchor] = found && has == 3;
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

cudaError_t launch_hardest(const MiningChunk& chunk, const MiningPlan& plan, const float* gram,
                           const float* bounds, int64_t* positive, int64_t* negative, bool* valid,
                           cudaStream_t stream) {
  hardest_kernel<<<chunk.rows, plan.row_block, 0, stream>>>(
      chunk, gram, reinterpret_cast<const float4*>(bounds), positive, negative, valid);
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
