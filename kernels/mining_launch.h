// library-only {
// The launch API of the in-batch mining kernels (mining_kernels.cu) for mining_ops.cpp: plain
// structs and functions, no torch headers. The anchors go one chunk of rows at a time, so no
// buffer is ever batch x batch.
#ifndef FUSED_TRIPLET_MINING_LAUNCH_H
#define FUSED_TRIPLET_MINING_LAUNCH_H

#include "triplet_launch.h"

namespace fused_triplet {

// Every choice of a mining call, made in plan_mining.
struct MiningPlan {
  int64_t chunk_rows;     // anchors per chunk: a chunk x batch float buffer stays within its budget
  int row_block;          // threads per block of the row kernels (a block per anchor row)
  int vector;             // hardest_kernel's columns per load: 4 (16 bytes) or 1
  float gram_bound;       // the Gram products' accumulation error, relative to |x~_i| |x~_c|
  float rounding_weight;  // splits the bfloat16 rounding error into a term per row
  int tile;               // the distance kernel's square tile of (anchor, candidate) pairs
};

MiningPlan plan_mining(int64_t batch, int64_t dim);

// One chunk of anchors [first, first + rows) against all `batch` embeddings (batch, dim), float,
// contiguous (2-byte embeddings cast exactly); ids: each embedding's label. Per-anchor outputs
// and inputs are indexed by embedding (arrays of `batch`).
struct MiningChunk {
  const float* embeddings;
  const int64_t* ids;
  int64_t batch, dim, first, rows;
  float eps, margin;
};

// batch_hard's Gram inputs for the whole batch (chunk.first and rows unused), sorted by label:
// rounded [batch, dim] bfloat16, the embedding order[s] less mean ([dim] float) at row s, and
// bounds [2, batch, 2] float, the terms of launch_hardest; classes [batch, 2] int64, each sorted
// position's class range [first, last) in the sorted labels (chunk.ids).
cudaError_t launch_gram_rows(const MiningChunk& chunk, const MiningPlan& plan, const int64_t* order,
                             const float* mean, void* rounded, float* bounds, int64_t* classes,
                             cudaStream_t stream);

// batch_hard: the hardest positive and negative of each anchor of the chunk, the batch sorted by
// label: ids the sorted labels, order[s] the embedding at sorted position s, and the chunk's rows
// sorted positions. gram: [rows, batch] float dot products x_s . x_c of the sorted, centred
// embeddings rounded to bfloat16; bounds: [2, batch, 2] float by sorted position, the terms as a
// candidate (lower, upper), then as an anchor (lower, upper): d(s, c)^2 lies within
// [lower_s + lower_c - 2 gram, upper_s + upper_c - 2 gram]. Candidates whose interval reaches
// the extreme's are decided by the exact distance of the embeddings. positive / negative: int64
// indices of the embeddings, by embedding (the anchor itself where there is none); valid: 1
// where the anchor has both.
cudaError_t launch_hardest(const MiningChunk& chunk, const MiningPlan& plan, const float* gram,
                           const float* bounds, const int64_t* classes, const int64_t* order,
                           int64_t* positive, int64_t* negative, bool* valid,
                           cudaStream_t stream);

// The exact distances of the chunk's anchors to every embedding: dists [rows, batch] float,
// torch's pairwise_distance (p = 2, eps inside the norm).
cudaError_t launch_distances(const MiningChunk& chunk, const MiningPlan& plan, float* dists,
                             cudaStream_t stream);

// batch_all over the chunk's rows of exact distances. Forward (upstream == nullptr): each
// anchor's sum of relu(margin + d(i, j) - d(i, k)) over its (positive j, negative k) pairs and
// how many are > 0 (loss float, active int64). Backward: coeffs [rows, batch] =
// upstream[i] * (d loss_i / d d(i, c)) / d(i, c) (0 where d(i, c) is 0), what the gradient's
// matrix products take.
cudaError_t launch_batch_all(const MiningChunk& chunk, const MiningPlan& plan, const float* dists,
                             const float* upstream, float* loss, int64_t* active, float* coeffs,
                             cudaStream_t stream);

}  // namespace fused_triplet

#endif  // FUSED_TRIPLET_MINING_LAUNCH_H
// library-only }
