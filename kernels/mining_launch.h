// library-only {
// The launch API of the in-batch mining kernels (mining_kernels.cu) for mining_ops.cpp: plain
// structs and functions, no torch headers. Small batches keep the batch x batch distances whole;
// large ones go one chunk of anchors at a time, so no buffer outgrows the plan's budget.
#ifndef FUSED_TRIPLET_MINING_LAUNCH_H
#define FUSED_TRIPLET_MINING_LAUNCH_H

#include "triplet_launch.h"

namespace fused_triplet {

// batch_hard: per anchor its hardest positive and negative. batch_all: every (anchor, positive,
// negative). semi_hard (FaceNet's, as sentence-transformers computes it): per (anchor, positive)
// the nearest negative farther than the positive, else the farthest negative (0 without
// negatives); 'mean' over the (anchor, positive) pairs. batch_all and semi_hard share the
// distance rows and the weights' gradient.
enum class Mining : int64_t { kBatchHard = 0, kBatchAll = 1, kSemiHard = 2 };

// What 'mean' divides by: the anchors with a triplet (batch_hard) or the triplets with a loss
// > 0 (batch_all); every anchor (sentence-transformers' batch_hard: without a positive d_ap is
// 0, without a negative d_an is d_ap again, the hinge passes its gradient at 0); the losses > 0
// (pytorch-metric-learning's AvgNonZeroReducer); the losses > 1e-16 (sentence-transformers'
// batch_all).
enum class Counting : int64_t { kFound = 0, kEveryAnchor = 1, kPositive = 2, kAbove1e16 = 3 };
// batch_all's triplets by gap = d_an - d_ap against band_margin (pytorch-metric-learning's
// TripletMarginMiner): every one, <= (all), also <= 0 (hard), also > 0 (semihard), > (easy).
enum class Band : int64_t { kNone = 0, kAll = 1, kHard = 2, kSemihard = 3, kEasy = 4 };

// What a mined loss computes once its triplets are mined: d = |a - b + eps|, or |a - b|^2 / 2
// (the cosine distance of unit rows: the libraries' cosine, eps 0), of the rows as given or
// scaled to unit length first (x / max(|x|, 1e-12), as the libraries normalise); each triplet's
// loss max(margin + d_ap - d_an, 0) or softplus(margin + d_ap - d_an); counting; batch_all's band.
struct LossRule {
  bool unit_rows;
  bool half_square;
  bool soft;
  Counting counting;
  Band band;
  float band_margin;
};

// Every choice of a mining call, made in plan_mining.
struct MiningPlan {
  bool whole;             // one batch x batch buffer of exact distances (else chunks of anchors)
  int64_t chunk_rows;     // anchors per chunk (the whole batch when whole)
  int row_block;          // threads per block of the row kernels (a block per anchor row)
  int vector;             // hardest_kernel's columns per load: 4 (16 bytes) or 1
  float gram_bound;       // the Gram products' error (sums, bfloat16 result), over |x~_i| |x~_c|
  float rounding_weight;  // splits the bfloat16 rounding error into a term per row
  int tile;               // the tiled kernels' square tile of (row, column) pairs
  bool gram_distances;    // batch_all: distances from float Gram products (else the exact kernel)
  float gram_keep_ratio;  // a Gram distance is kept where d^2 >= (|x~_i|^2 + |x~_c|^2) / this
  int64_t gradient_part_rows;  // past the whole batch: rows of weights per double product
  int gradient_rows_per_warp;  // batch_hard's gradient: rows each warp writes
  bool gradient_sorted_choices;  // ... from the choices sorted by row (else each block scans them)
  bool gradient_tensor_cores;  // batch_all's whole-batch gradient: double products on tensor cores
  int gradient_column_parts;   // ... else the float kernel's columns split over this many blocks
  bool sparse_gradient;   // past the whole batch: the chunks' weights read for their nonzeros
  int mean_slices;        // the Gram products' centre: slices of rows summed apart
  bool count_labels;      // batch_hard's label order by counting compares (else sorted tiles)
  int rank_slices;        // ... counting: the columns split this many ways
};

// cc_major, sm_count: the device's compute capability and SMs; dtype: the rows the kernels read;
// input_bytes: the embeddings' bytes as given; copy_bytes: the call's copies of them (float, unit
// rows); references: the call has a reference set (whole batches only). allow_whole false: chunks
// at any batch (tests of the large batches' kernels).
MiningPlan plan_mining(Mining mining, int64_t batch, int64_t dim, int cc_major, int sm_count,
                       DType dtype, int64_t input_bytes, int64_t copy_bytes, bool references,
                       bool allow_whole = true);
// The largest batch whose distances stay whole, with or without a reference set (the shape of
// batch_all's saved weights; a reference set's limit).
int64_t whole_batch_rows(Mining mining, bool references);

// One chunk of anchors [first, first + rows) against all `batch` embeddings (batch, dim),
// contiguous, read as float (2-byte ones cast exactly): batch_hard's kernels take them as given,
// the others a float32 copy (launchers of float32 kernels refuse other rows); ids: each
// embedding's label. Per-anchor outputs and inputs are indexed by embedding (arrays of `batch`).
// references > 0: a reference set (pytorch-metric-learning's ref_emb), the last `references`
// rows, holds every positive and negative, and only the rows before it are anchors (a whole
// batch only).
struct MiningChunk {
  const void* embeddings;  // [batch, dim] of dtype: float32, or 2-byte rows for batch_hard
  DType dtype;
  const int64_t* ids;
  int64_t batch, dim, first, rows;
  int64_t references;
  float eps, margin;
  Mining mining;
  LossRule rule;
};

// How the loss was reduced, and the upstream gradient of the backward: [batch] ('none') or one
// value, times 1 / max(count, 1) for 'mean' (count: the forward's, one float).
struct Upstream {
  const float* grad;
  const float* count;
  int64_t reduction;
};

// batch_hard's Gram inputs for the whole batch (chunk.first and rows unused), sorted by label:
// rounded [batch, dim] bfloat16, the embedding order[s] less mean ([dim] float) at row s, and
// bounds [gram_bounds_floats(batch)] float, the terms of launch_hardest; classes [batch, 2] int64,
// each sorted position's class range [first, last) in the sorted labels (chunk.ids).
cudaError_t launch_gram_rows(const MiningChunk& chunk, const MiningPlan& plan, const int64_t* order,
                             const float* mean, void* rounded, float* bounds, int64_t* classes,
                             cudaStream_t stream);
int64_t gram_bounds_floats(int64_t batch);

// batch_hard: the hardest positive and negative of each anchor of the chunk, the batch sorted by
// label: ids the sorted labels, order[s] the embedding at sorted position s, and the chunk's rows
// sorted positions. gram: [rows, batch] bfloat16, the dot products x_s . x_c (float sums) of the
// sorted, centred embeddings rounded to bfloat16; bounds: launch_gram_rows's, by sorted position,
// each row's terms as a candidate (centre, spread) and as an anchor (lower, upper): d(s, c)^2
// lies within [lower_s + centre_c - 2 gram - spread_c, upper_s + centre_c - 2 gram + spread_c].
// Candidates whose interval reaches the extreme's are decided by the exact distance of the
// embeddings. positive / negative: int64 indices of the embeddings, by embedding (each the anchor
// itself where it has none); valid: 1 where the anchor has both.
cudaError_t launch_hardest(const MiningChunk& chunk, const MiningPlan& plan, const void* gram,
                           const float* bounds, const int64_t* classes, const int64_t* order,
                           int64_t* positive, int64_t* negative, bool* valid,
                           cudaStream_t stream);

// The exact distances of the chunk's anchors to every embedding: dists [rows, batch] float, the
// rule's d (torch's pairwise_distance with p = 2, or |a - b|^2 / 2).
cudaError_t launch_distances(const MiningChunk& chunk, const MiningPlan& plan, float* dists,
                             cudaStream_t stream);

// The rows' mean, the Gram products' centre: mean [dim] float of x [batch, dim] of dtype (float32
// or 2-byte), summed in double in a fixed order; partials: [plan.mean_slices, dim] double scratch.
cudaError_t launch_column_means(const void* x, DType dtype, int64_t batch, int64_t dim,
                                const MiningPlan& plan, double* partials, float* mean,
                                cudaStream_t stream);

// batch_hard's label order: sorted_labels and order [batch] int64 as labels.sort(stable) gives
// them (values, indices); scratch: [label_order_scratch(plan, batch)] int32 (batch < 2^31).
int64_t label_order_scratch(const MiningPlan& plan, int64_t batch);
cudaError_t launch_label_order(const int64_t* labels, int64_t batch, const MiningPlan& plan,
                               int32_t* scratch, int64_t* sorted_labels, int64_t* order,
                               cudaStream_t stream);

// The Gram products' rows: centred [batch, dim] float = x - mean ([dim] float) and terms
// [batch, 2] float, each row's (|centred|^2, sum of centred) summed in double.
cudaError_t launch_centred_rows(const float* x, const float* mean, int64_t batch, int64_t dim,
                                float* centred, float* terms, cudaStream_t stream);

// In place, dists [rows, batch] float: the chunk's Gram products of centred rows become the rule's
// distances (launch_distances'), exact where the products cannot give them accurately.
cudaError_t launch_gram_distances(const MiningChunk& chunk, const MiningPlan& plan,
                                  const float* terms, float* dists, cudaStream_t stream);

// batch_hard's loss of every anchor (chunk: the whole batch) by the chunk's rule. picked ==
// nullptr: the hardest positive and negative chosen here from dists [batch, batch] (the rule's
// distances); else picked [2, batch] int64 as launch_hardest wrote them. Writes
// loss [batch] float, counted [batch] int64 (the anchors 'mean' divides by) and state [4, batch]
// double: positive, negative (the anchor itself where it has none, or for ours both where it
// lacks one), d(a, p), d(a, n) in double sums (0 for one it lacks).
cudaError_t launch_hard_loss(const MiningChunk& chunk, const MiningPlan& plan, const float* dists,
                             const int64_t* picked, float* loss, int64_t* counted,
                             double* state, cudaStream_t stream);

// batch_hard's gradient of the embeddings (float [batch, dim]), every row written: each anchor's
// own term, then the anchors that chose the row as positive or negative. Where
// plan.gradient_sorted_choices: sorted_rows [2 batch] int32, the state's positives then
// negatives stably sorted, and places [2 batch] int64, their indices before the sort (else both
// unused: each block scans the choices).
cudaError_t launch_hard_gradient(const MiningChunk& chunk, const MiningPlan& plan,
                                 const double* state, const Upstream& upstream, bool hinge_at_zero,
                                 const int32_t* sorted_rows, const int64_t* places, float* grad,
                                 cudaStream_t stream);

// batch_all (or semi_hard) over the chunk's rows of exact distances: each anchor's sum of the
// rule's loss over its (positive j, negative k) pairs in the band (semi_hard: over its positives
// with their chosen negative) and how many the rule counts (semi_hard: its positives) (loss float,
// counted int64; nullptr: not wanted). weights (nullptr: not wanted): [rows, batch] = g_i (d
// loss_i / d d(i, c)) / d(i, c) (0 where d(i, c) is 0; no division for |a - b|^2 / 2), g_i the
// upstream gradient (1 where upstream.grad is nullptr). weights may be dists itself when the
// plan keeps the batch whole. weight_sums (nullptr: not wanted; with weights): [batch] double,
// each anchor's sum of its row of weights, by embedding.
cudaError_t launch_batch_all(const MiningChunk& chunk, const MiningPlan& plan, const float* dists,
                             const Upstream& upstream, float* loss, int64_t* counted,
                             float* weights, double* weight_sums, cudaStream_t stream);

// batch_all's gradient of the embeddings (float [batch, dim]) from the whole batch's weights
// [batch, batch] (launch_batch_all's without the upstream gradient, applied here). partials:
// [plan.gradient_column_parts, batch, dim] float scratch where the plan splits the columns (else
// unused).
cudaError_t launch_all_gradient(const MiningChunk& chunk, const MiningPlan& plan,
                                const float* weights, const Upstream& upstream, float* partials,
                                float* grad, cudaStream_t stream);

// semi_hard's gradient past the whole batch: out [batch, dim] double (zeros before the first
// chunk) gets a chunk's rows of weights [chunk.rows, batch] (launch_batch_all's, upstream applied):
// out_m += sum_c A[m, c] (x_m - x_c + eps) - sum_i A[i, m] (x_i - x_m + eps).
cudaError_t launch_sparse_gradient(const MiningChunk& chunk, const float* weights, double* out,
                                   cudaStream_t stream);

// The rows x [batch, dim] float scaled to unit length: unit = x / max(|x|, 1e-12) (the norm in
// double), a warp per row.
cudaError_t launch_unit_rows(const float* x, int64_t batch, int64_t dim, float* unit,
                             cudaStream_t stream);
// The gradient through that scaling: grad = (g - u (u . g)) / |x| where |x| >= 1e-12 (u the unit
// row), else g / 1e-12 (below its bound clamp_min passes no gradient to the norm).
cudaError_t launch_unit_rows_backward(const float* x, const float* unit_grad, int64_t batch,
                                      int64_t dim, float* grad, cudaStream_t stream);

// The reduction: loss = the sum of loss[batch] (over max(count, 1) for 'mean'; nothing for
// 'none') and count = the sum of counted[batch], both one float, sums in double.
cudaError_t launch_finish(const float* losses, const int64_t* counted, int64_t batch,
                          int64_t reduction, float* loss, float* count, cudaStream_t stream);

}  // namespace fused_triplet

#endif  // FUSED_TRIPLET_MINING_LAUNCH_H
// library-only }
