// library-only {
// The torch side of the in-batch mining (mined_triplet_margin_loss with p = 2 on CUDA): one op
// per step's forward and one for its backward, with their autograd in C++ (as the triplet op's:
// a Python autograd layer costs a small batch more host time than its kernels take). Input
// checks come before any launch; nothing synchronises with the host, so a step can be captured
// in a CUDA graph. The Python side registers the fake kernels.
#include "check_text.h"
#include "device_facts.h"
#include "mining_launch.h"

#include <ATen/Context.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>
#include <tuple>

namespace fused_triplet {

bool hinge_passes_at_zero();  // the installed torch's clamp_min convention (triplet_ops.cpp)
std::optional<DType> kernel_dtype(at::ScalarType type);  // the kernels' element type (ditto)

namespace {

// The ops' own matrix products and casts run as written, whatever autocast the caller is under.
using NoAutocast = c10::impl::ExcludeDispatchKeyGuard;

Mining mining_of(int64_t mining) {
  TORCH_CHECK(mining >= 0 && mining <= 2,
              "fused_triplet mining: mining must be 0 (batch_hard), 1 (batch_all) or 2 "
              "(semi_hard), got ", std::to_string(mining));
  return static_cast<Mining>(mining);
}

// The ops' loss rule: distance 0 |a - b + eps|, 1 |a - b|^2 / 2 (eps 0), 2 and 3 the same of the
// rows scaled to unit length (eps 0); hinge 0 max(x, 0), 1 softplus(x); counting and band as
// LossRule's enums (counting 1 for batch_hard, 3 for batch_all only).
LossRule rule_of(Mining mining, int64_t distance, int64_t hinge, int64_t counting, int64_t band,
                 double band_margin, double eps) {
  TORCH_CHECK(distance >= 0 && distance <= 3 && (distance == 0 || eps == 0.0) &&
                  (hinge == 0 || hinge == 1),
              "fused_triplet mining: distance must be 0, or 1-3 with eps 0, and hinge 0 or 1, "
              "got ", std::to_string(distance), " and ", std::to_string(hinge));
  const bool hard = mining == Mining::kBatchHard, all = mining == Mining::kBatchAll;
  TORCH_CHECK(mining != Mining::kSemiHard || (hinge == 0 && counting == 0 && band == 0),
              "fused_triplet mining: semi_hard takes the hinge, its own counting and no band");
  TORCH_CHECK(counting == 0 || counting == 2 || (counting == 1 && hard) ||
                  (counting == 3 && all),
              "fused_triplet mining: counting must be 0, 1 (batch_hard), 2 or 3 (batch_all), got ",
              std::to_string(counting));
  TORCH_CHECK(band == 0 || (band >= 1 && band <= 4 && all),
              "fused_triplet mining: band must be 0, or 1-4 for batch_all, got ",
              std::to_string(band));
  return {distance >= 2, distance % 2 == 1, hinge == 1, static_cast<Counting>(counting),
          static_cast<Band>(band), float(band_margin)};
}

void check_reduction(int64_t reduction) {
  TORCH_CHECK(reduction == kNone || reduction == kMean || reduction == kSum,
              "fused_triplet mining: reduction must be 0 (none), 1 (mean) or 2 (sum), got ",
              std::to_string(reduction));
}

// The embeddings the mining ops take (the kernels read them as float, cast exactly); the Python
// side sends every other dtype to the torch reference, and the ops refuse them before any launch.
void check_mining(const at::Tensor& embeddings, const at::Tensor& labels, Mining mining,
                  int64_t references) {
  TORCH_CHECK(embeddings.is_cuda() && labels.device() == embeddings.device(),
              "fused_triplet mining: embeddings and labels must be on one CUDA device, got ",
              embeddings.device(), " and ", labels.device());
  TORCH_CHECK(embeddings.dim() == 2, "fused_triplet mining: expected (batch, dim) embeddings, got ",
              shape_text(embeddings));
  const at::ScalarType type = embeddings.scalar_type();
  TORCH_CHECK(type == at::kHalf || type == at::kBFloat16 || type == at::kFloat,
              "fused_triplet mining: expected float16, bfloat16 or float32 embeddings, got ", type);
  // column indices are int32 in the kernels' lists (a batch of 2^31 rows is 2^62 pairs)
  TORCH_CHECK(embeddings.size(0) < (int64_t(1) << 31),
              "fused_triplet mining: batches of up to 2^31 - 1 rows, got ",
              std::to_string(embeddings.size(0)));
  TORCH_CHECK(labels.scalar_type() == at::kLong && labels.dim() == 1 &&
                  labels.size(0) == embeddings.size(0),
              "fused_triplet mining: expected int64 labels of shape (",
              std::to_string(embeddings.size(0)), "), got ", labels.scalar_type(), " ",
              shape_text(labels));
  TORCH_CHECK(references == 0 || (references > 0 && references <= embeddings.size(0) &&
                                  mining != Mining::kSemiHard),
              "fused_triplet mining: references must be 0, or at most the rows given "
              "(batch_hard and batch_all), got ", std::to_string(references));
  // a reference set runs on the whole batch's kernels only
  TORCH_CHECK(references == 0 || embeddings.size(0) <= whole_batch_rows(mining, true),
              "fused_triplet mining: a reference set needs batch + references <= ",
              std::to_string(whole_batch_rows(mining, true)), ", got ",
              std::to_string(embeddings.size(0)));
}

// What batch_all's and semi_hard's state holds for the backward: nothing (the backward
// recomputes the weights), the whole batch's weights, or the gradient for an upstream gradient
// of 1 (the scalar reductions past the whole batch's sizes).
enum class Saved { kNothing, kWeights, kGradient };

// The backward's own inputs against the checked embeddings: the upstream gradient, the
// forward's count and state. Returns what the state holds.
Saved check_backward_inputs(const at::Tensor& grad, const at::Tensor& count,
                            const at::Tensor& state, const at::Tensor& embeddings, Mining mining,
                            int64_t reduction) {
  const int64_t batch = embeddings.size(0);
  const auto on_device = [&](const at::Tensor& x) { return x.device() == embeddings.device(); };
  TORCH_CHECK(grad.scalar_type() == at::kFloat && on_device(grad) &&
                  grad.dim() == (reduction == kNone ? 1 : 0) &&
                  (reduction != kNone || grad.size(0) == batch),
              "fused_triplet mining: expected a float32 gradient of the loss's shape on the "
              "embeddings' device, got ", grad.scalar_type(), " ", shape_text(grad), " on ",
              grad.device());
  TORCH_CHECK(count.scalar_type() == at::kFloat && count.dim() == 0 && on_device(count),
              "fused_triplet mining: expected the forward's float32 count, got ",
              count.scalar_type(), " ", shape_text(count));
  const auto shaped = [&](int64_t rows, int64_t columns, at::ScalarType dtype) {
    return state.dim() == 2 && state.size(0) == rows && state.size(1) == columns &&
           state.scalar_type() == dtype;
  };
  const bool all = mining != Mining::kBatchHard;
  const Saved saved = !all ? Saved::kNothing
                      : shaped(batch, batch, at::kFloat) ? Saved::kWeights
                      : shaped(batch, embeddings.size(1), at::kDouble) && reduction != kNone
                          ? Saved::kGradient
                          : Saved::kNothing;
  TORCH_CHECK(on_device(state) && state.is_contiguous() &&
                  (all ? saved != Saved::kNothing ||
                             (state.numel() == 0 && state.scalar_type() == at::kFloat)
                       : shaped(4, batch, at::kDouble)),
              "fused_triplet mining: the state is not the forward's: ", state.scalar_type(), " ",
              shape_text(state));
  // saved states are batch_all's (and semi_hard's), whose whole batch a reference set leaves as is
  const int64_t whole_rows = whole_batch_rows(mining, false);
  TORCH_CHECK(saved != Saved::kWeights || batch <= whole_rows,
              "fused_triplet mining: saved weights for a batch the plan does not keep whole");
  TORCH_CHECK(saved != Saved::kGradient || batch > whole_rows,
              "fused_triplet mining: a saved gradient for a batch the plan keeps whole");
  return saved;
}

// What every mining op does first, for as long as it runs: check its inputs (and the op's own,
// check_more, after the embeddings' and before any launch), leave autocast, take the inputs'
// device, read them as contiguous embeddings (batch_hard's kernels take 2-byte ones as given: no
// float copy beside them; the others a float copy, exact; scaled to unit length where the rule
// says) and int64 labels.
struct MiningCall {
  // The ops' arguments: the mining code, the reduction, the loss rule, as rule_of reads it, and
  // the reference set's rows.
  MiningCall(const at::Tensor& embeddings_in, const at::Tensor& labels_in, int64_t mining_code,
             int64_t reduction, double eps, int64_t distance, int64_t hinge, int64_t counting,
             int64_t band, double band_margin, int64_t references_in,
             const std::function<void()>& check_more = nullptr)
      : MiningCall(embeddings_in, labels_in, mining_of(mining_code),
                   (check_reduction(reduction),
                    rule_of(mining_of(mining_code), distance, hinge, counting, band, band_margin,
                            eps)),
                   references_in, check_more) {}
  MiningCall(const at::Tensor& embeddings_in, const at::Tensor& labels_in, Mining mining_in,
             LossRule rule_in, int64_t references_in = 0,
             const std::function<void()>& check_more = nullptr)
      : mining(mining_in),
        rule(rule_in),
        references(references_in),
        checked((check_mining(embeddings_in, labels_in, mining_in, references_in),
                 check_more ? check_more() : void(), true)),
        no_autocast(c10::autocast_dispatch_keyset),
        guard(embeddings_in.device()),
        stream(c10::cuda::getCurrentCUDAStream(embeddings_in.get_device()).stream()),
        given(mining == Mining::kBatchHard && !rule.unit_rows
                  ? embeddings_in.contiguous()
                  : embeddings_in.to(at::kFloat).contiguous()),
        embeddings(rule.unit_rows ? unit_rows(given) : given),
        labels(labels_in.contiguous()),
        floats(given.options().dtype(at::kFloat)),
        input_bytes(int64_t(embeddings_in.nbytes())),
        copy_bytes(int64_t(given.is_same(embeddings_in) ? 0 : given.nbytes()) +
                   int64_t(embeddings.is_same(given) ? 0 : embeddings.nbytes())) {}
  // The plan of this call's shapes on its device (allow_whole false: chunks at any batch).
  MiningPlan plan(bool allow_whole = true) const {
    const DeviceFacts facts = device_facts(embeddings.get_device());
    return plan_mining(mining, embeddings.size(0), embeddings.size(1), facts.cc_major,
                       facts.sm_count, *kernel_dtype(embeddings.scalar_type()), input_bytes,
                       copy_bytes, references > 0, allow_whole);
  }
  // Every anchor of the float embeddings as one chunk.
  MiningChunk whole(const at::Tensor& ids, double margin, double eps) const {
    return {embeddings.data_ptr(), *kernel_dtype(embeddings.scalar_type()),
            ids.data_ptr<int64_t>(), embeddings.size(0),
            embeddings.size(1), 0, embeddings.size(0), references, float(eps), float(margin),
            mining, rule};
  }
  // fn(chunk) for each chunk of anchors, with these ids (the labels, or them sorted).
  void for_each_chunk(const MiningPlan& plan, const at::Tensor& ids, double margin, double eps,
                      const std::function<void(const MiningChunk&)>& fn) const {
    MiningChunk chunk = whole(ids, margin, eps);
    for (chunk.first = 0; chunk.first < chunk.batch; chunk.first += plan.chunk_rows) {
      chunk.rows = std::min(plan.chunk_rows, chunk.batch - chunk.first);
      fn(chunk);
    }
  }
  // The gradient of the given rows from the gradient (float, or the chunks' double) of the
  // rows the kernels read.
  at::Tensor given_gradient(const at::Tensor& grad_in) const {
    if (!rule.unit_rows || grad_in.numel() == 0) return grad_in;
    const at::Tensor grad = grad_in.to(at::kFloat);
    at::Tensor out = at::empty_like(grad);
    C10_CUDA_CHECK(launch_unit_rows_backward(given.data_ptr<float>(), grad.data_ptr<float>(),
                                             grad.size(0), grad.size(1), out.data_ptr<float>(),
                                             stream));
    return out;
  }
  Mining mining;
  LossRule rule;
  int64_t references;  // the last rows: the reference set (MiningChunk's)
  bool checked;
  NoAutocast no_autocast;
  c10::cuda::CUDAGuard guard;
  cudaStream_t stream;
  at::Tensor given;       // the embeddings as given (batch_hard) or as float
  at::Tensor embeddings;  // the rows the kernels read: given, or given scaled to unit length
  at::Tensor labels;
  at::TensorOptions floats;  // float32 on the call's device: losses, distances, scratch
  int64_t input_bytes;  // the embeddings' bytes as given
  int64_t copy_bytes;   // given's and embeddings' bytes where they are copies

 private:
  at::Tensor unit_rows(const at::Tensor& x) const {
    at::Tensor out = at::empty_like(x);
    if (x.numel() > 0) {
      C10_CUDA_CHECK(launch_unit_rows(x.data_ptr<float>(), x.size(0), x.size(1),
                                      out.data_ptr<float>(), stream));
    }
    return out;
  }
};

// The rows' mean [dim] float of x [batch, dim] (launch_column_means'), the Gram products' centre.
at::Tensor column_means(const at::Tensor& x, const MiningPlan& plan, cudaStream_t stream) {
  at::Tensor mean = at::empty({x.size(1)}, x.options().dtype(at::kFloat));
  const at::Tensor partials =
      at::empty({plan.mean_slices, x.size(1)}, x.options().dtype(at::kDouble));
  C10_CUDA_CHECK(launch_column_means(x.data_ptr(), *kernel_dtype(x.scalar_type()), x.size(0),
                                     x.size(1), plan, partials.data_ptr<double>(),
                                     mean.data_ptr<float>(), stream));
  return mean;
}

// batch_all's distances of a chunk of anchors, launch_distances' values: from the exact kernel,
// or where the plan says from the float Gram products of the centred rows (never TF32: too
// coarse), exact where those are not accurate enough.
class AllDistances {
 public:
  AllDistances(const MiningCall& call, const MiningPlan& plan) : call_(call), plan_(plan) {
    if (!plan.gram_distances) return;
    const at::Tensor& x = call.embeddings;
    centred_ = at::empty_like(x);
    terms_ = at::empty({x.size(0), 2}, x.options());
    const at::Tensor mean = column_means(x, plan, call.stream);
    C10_CUDA_CHECK(launch_centred_rows(x.data_ptr<float>(), mean.data_ptr<float>(), x.size(0),
                                       x.size(1), centred_.data_ptr<float>(),
                                       terms_.data_ptr<float>(), call.stream));
  }
  // dists: the chunk's rows [chunk.rows, batch] float.
  void write(const MiningChunk& chunk, at::Tensor dists) const {
    if (!plan_.gram_distances) {
      C10_CUDA_CHECK(launch_distances(chunk, plan_, dists.data_ptr<float>(), call_.stream));
      return;
    }
    {
      const at::NoTF32Guard exact_products;
      at::mm_out(dists, centred_.narrow(0, chunk.first, chunk.rows), centred_.t());
    }
    C10_CUDA_CHECK(launch_gram_distances(chunk, plan_, terms_.data_ptr<float>(),
                                         dists.data_ptr<float>(), call_.stream));
  }

 private:
  const MiningCall& call_;
  const MiningPlan& plan_;
  at::Tensor centred_, terms_;
};

// batch_hard's large batches: (positive, negative) [2, batch] and valid per anchor from the
// bfloat16 Gram products, exact where it counts. The rows go sorted by label (stable), so each
// anchor's positives are one range of columns.
std::tuple<at::Tensor, at::Tensor> mine_hardest(const MiningCall& call, const MiningPlan& plan,
                                                double eps) {
  const at::Tensor& embeddings = call.embeddings;
  const int64_t batch = embeddings.size(0);
  at::Tensor picks = at::empty({2, batch}, call.labels.options());
  at::Tensor valid = at::empty({batch}, call.labels.options().dtype(at::kBool));
  const at::Tensor sorted_labels = at::empty_like(call.labels);
  const at::Tensor order = at::empty_like(call.labels);
  {  // the order's scratch freed before the products' chunks, the call's peak
    const at::Tensor scratch =
        at::empty({label_order_scratch(plan, batch)}, call.labels.options().dtype(at::kInt));
    C10_CUDA_CHECK(launch_label_order(call.labels.data_ptr<int64_t>(), batch, plan,
                                      scratch.data_ptr<int32_t>(),
                                      sorted_labels.data_ptr<int64_t>(),
                                      order.data_ptr<int64_t>(), call.stream));
  }
  at::Tensor rounded = at::empty(embeddings.sizes(), embeddings.options().dtype(at::kBFloat16));
  at::Tensor bounds = at::empty({gram_bounds_floats(batch)}, call.floats);
  at::Tensor classes = at::empty({batch, 2}, call.labels.options());
  const at::Tensor mean = column_means(embeddings, plan, call.stream);
  C10_CUDA_CHECK(launch_gram_rows(call.whole(sorted_labels, 0.0, eps), plan,
                                  order.data_ptr<int64_t>(), mean.data_ptr<float>(),
                                  rounded.data_ptr(), bounds.data_ptr<float>(),
                                  classes.data_ptr<int64_t>(), call.stream));
  at::Tensor gram = at::empty({plan.chunk_rows, batch}, rounded.options());
  call.for_each_chunk(plan, sorted_labels, 0.0, eps, [&](const MiningChunk& chunk) {
    at::Tensor rows = gram.narrow(0, 0, chunk.rows);
    at::mm_out(rows, rounded.narrow(0, chunk.first, chunk.rows), rounded.t());
    C10_CUDA_CHECK(launch_hardest(chunk, plan, rows.data_ptr(), bounds.data_ptr<float>(),
                                  classes.data_ptr<int64_t>(), order.data_ptr<int64_t>(),
                                  picks.data_ptr<int64_t>(), picks.data_ptr<int64_t>() + batch,
                                  valid.data_ptr<bool>(), call.stream));
  });
  return {picks, valid};
}

// batch_all's gradient past the whole batch's sizes, by double matrix products from rows of weights
// A[i, c] (upstream applied):
//   dL/dx_m = sum_c A[m, c] (x_m - x_c + eps) - sum_i A[i, m] (x_i - x_m + eps)
//           = (r_m + s_m) x_m + eps (r_m - s_m) - (A x)_m - (A^T x)_m,
// r and s A's row and column sums, x the rows less their mean (the distances are unchanged and the
// products' error shrinks to the spread), in double: a row's products nearly cancel where its
// partners are close (large weights 1 / d), beyond float's precision. launch_batch_all gives r.
// Where the plan says the weights are sparse (semi_hard), launch_sparse_gradient reads them as
// they are instead.
class AllGradient {
 public:
  AllGradient(const MiningCall& call, const MiningPlan& plan)
      : call_(call),
        plan_(plan),
        x_(plan.sparse_gradient ? at::Tensor() : centred(call.embeddings.to(at::kDouble))),
        out_(at::zeros(call.embeddings.sizes(), call.floats.dtype(at::kDouble))),
        row_sums_(plan.sparse_gradient ? at::Tensor() : at::zeros({out_.size(0)}, out_.options())),
        column_sums_(row_sums_.defined() ? at::zeros_like(row_sums_) : at::Tensor()) {}
  // Where launch_batch_all writes r, by embedding (none for the sparse weights).
  double* row_sums() { return row_sums_.defined() ? row_sums_.data_ptr<double>() : nullptr; }
  // The chunk's rows of A, float [chunk.rows, batch].
  void add_rows(const MiningChunk& chunk, const at::Tensor& weights) {
    if (plan_.sparse_gradient) {
      C10_CUDA_CHECK(launch_sparse_gradient(chunk, weights.data_ptr<float>(),
                                            out_.data_ptr<double>(), call_.stream));
      return;
    }
    const int64_t first = chunk.first;
    for (int64_t part = 0; part < weights.size(0); part += plan_.gradient_part_rows) {
      const int64_t rows = std::min(plan_.gradient_part_rows, weights.size(0) - part);
      const at::Tensor a = weights.narrow(0, part, rows).to(at::kDouble);
      column_sums_ += a.sum(0);
      out_.narrow(0, first + part, rows).addmm_(a, x_, 1, -1);
      out_.addmm_(a.t(), x_.narrow(0, first + part, rows), 1, -1);
    }
  }
  at::Tensor result(double eps) {
    if (plan_.sparse_gradient) return out_;
    return out_.addcmul_(x_, (row_sums_ + column_sums_).unsqueeze(1))
        .add_(eps * (row_sums_ - column_sums_).unsqueeze(1));
  }

 private:
  static at::Tensor centred(const at::Tensor& x) { return x - x.mean(0, true); }
  const MiningCall& call_;
  const MiningPlan& plan_;
  at::Tensor x_, out_, row_sums_, column_sums_;
};

// The forward: (loss, count, state). loss: float32, per anchor ('none') or reduced; count: one
// float32, the valid anchors (batch_hard) or active triplets (batch_all) that 'mean' divides by;
// state: what the backward reads. batch_hard: [4, batch] double (positive, negative, d(a, p),
// d(a, n)); batch_all and semi_hard when for_backward: the whole batch's weights [batch, batch]
// float where the plan keeps the batch whole, else for 'mean' and 'sum' the gradient of the rows
// the kernels read for an upstream gradient of 1, [batch, dim] double (the weights' rows are
// used as they are made, not made twice); else empty (the backward recomputes the weights).
std::tuple<at::Tensor, at::Tensor, at::Tensor> mined_loss_cuda(
    const at::Tensor& embeddings_in, const at::Tensor& labels_in, int64_t mining_code,
    double margin, double eps, int64_t reduction, bool for_backward, int64_t distance,
    int64_t hinge, int64_t counting, int64_t band, double band_margin, int64_t references) {
  const MiningCall call(embeddings_in, labels_in, mining_code, reduction, eps, distance, hinge,
                        counting, band, band_margin, references);
  const Mining mining = call.mining;
  const at::Tensor& embeddings = call.embeddings;
  const int64_t batch = embeddings.size(0);
  const at::TensorOptions& floats = call.floats;
  at::Tensor per_anchor = at::empty({batch}, floats);
  at::Tensor counted = at::empty({batch}, call.labels.options());
  at::Tensor count = at::empty({}, floats);
  at::Tensor loss = reduction == kNone ? per_anchor : at::empty({}, floats);
  const MiningPlan plan = call.plan();
  const bool keeps_weights = mining != Mining::kBatchHard && for_backward && plan.whole;
  const bool keeps_gradient =
      mining != Mining::kBatchHard && for_backward && !plan.whole && reduction != kNone;
  at::Tensor state = mining == Mining::kBatchHard
                         ? at::empty({4, batch}, floats.dtype(at::kDouble))
                         : at::empty({keeps_weights ? batch : 0, keeps_weights ? batch : 0}, floats);
  if (batch > 0) {
    const MiningChunk all = call.whole(call.labels, margin, eps);
    if (mining == Mining::kBatchHard) {
      at::Tensor dists, picks;
      if (plan.whole) {
        dists = at::empty({batch, batch}, floats);
        C10_CUDA_CHECK(launch_distances(all, plan, dists.data_ptr<float>(), call.stream));
      } else {
        picks = std::get<0>(mine_hardest(call, plan, eps));
      }
      C10_CUDA_CHECK(launch_hard_loss(all, plan, plan.whole ? dists.data_ptr<float>() : nullptr,
                                      plan.whole ? nullptr : picks.data_ptr<int64_t>(),
                                      per_anchor.data_ptr<float>(), counted.data_ptr<int64_t>(),
                                      state.data_ptr<double>(), call.stream));
    } else {
      const AllDistances distances(call, plan);
      const at::Tensor dists =
          keeps_weights ? state : at::empty({plan.chunk_rows, batch}, floats);
      const at::Tensor weights = keeps_gradient ? at::empty_like(dists) : dists;
      std::optional<AllGradient> gradient;
      if (keeps_gradient) gradient.emplace(call, plan);
      call.for_each_chunk(plan, call.labels, margin, eps, [&](const MiningChunk& chunk) {
        distances.write(chunk, dists.narrow(0, 0, chunk.rows));
        C10_CUDA_CHECK(launch_batch_all(
            chunk, plan, dists.data_ptr<float>(), {}, per_anchor.data_ptr<float>(),
            counted.data_ptr<int64_t>(),
            keeps_weights || keeps_gradient ? weights.data_ptr<float>() : nullptr,
            gradient ? gradient->row_sums() : nullptr, call.stream));
        if (gradient) gradient->add_rows(chunk, weights.narrow(0, 0, chunk.rows));
      });
      if (gradient) state = gradient->result(eps);
    }
  }
  C10_CUDA_CHECK(launch_finish(per_anchor.data_ptr<float>(), counted.data_ptr<int64_t>(), batch,
                               reduction, loss.data_ptr<float>(), count.data_ptr<float>(),
                               call.stream));
  return {loss, count, state};
}

// The backward: the embeddings' gradient for the upstream gradient of the loss (float32, as the
// forward's loss) and the forward's count and state.
at::Tensor mined_loss_backward_cuda(const at::Tensor& grad_in, const at::Tensor& embeddings_in,
                                    const at::Tensor& labels_in, const at::Tensor& count,
                                    const at::Tensor& state, int64_t mining_code, double margin,
                                    double eps, int64_t reduction, bool hinge_at_zero,
                                    int64_t distance, int64_t hinge, int64_t counting,
                                    int64_t band, double band_margin, int64_t references) {
  Saved saved = Saved::kNothing;
  const MiningCall call(embeddings_in, labels_in, mining_code, reduction, eps, distance, hinge,
                        counting, band, band_margin, references, [&] {
                          saved = check_backward_inputs(grad_in, count, state, embeddings_in,
                                                        mining_of(mining_code), reduction);
                        });
  const Mining mining = call.mining;
  const at::Tensor& embeddings = call.embeddings;
  const int64_t batch = embeddings.size(0);
  const MiningPlan plan = call.plan();
  const at::Tensor grad = grad_in.contiguous();
  const Upstream up{grad.data_ptr<float>(), count.data_ptr<float>(), reduction};
  const MiningChunk all = call.whole(call.labels, margin, eps);
  at::Tensor out;
  if (embeddings.numel() == 0) {  // nothing to launch (a grid of no columns is not a launch)
    out = at::zeros(embeddings.sizes(), call.floats);
  } else if (mining == Mining::kBatchHard) {
    out = at::empty(embeddings.sizes(), call.floats);
    // the anchors' choices (positives, then negatives) by the row chosen, anchor order kept;
    // int32 keys (batch < 2^31): half the radix passes of the state's doubles
    const auto [rows, places] =
        plan.gradient_sorted_choices
            ? at::sort(state.narrow(0, 0, 2).reshape({-1}).to(at::kInt), /*stable=*/true, 0,
                       false)
            : std::tuple<at::Tensor, at::Tensor>();
    C10_CUDA_CHECK(launch_hard_gradient(
        all, plan, state.data_ptr<double>(), up, hinge_at_zero,
        rows.defined() ? rows.data_ptr<int32_t>() : nullptr,
        places.defined() ? places.data_ptr<int64_t>() : nullptr, out.data_ptr<float>(),
        call.stream));
  } else if (saved == Saved::kWeights) {
    out = at::empty(embeddings.sizes(), call.floats);
    const int64_t parts = plan.gradient_column_parts;
    const at::Tensor partials =
        parts > 1 ? at::empty({parts, batch, embeddings.size(1)}, call.floats) : at::Tensor();
    C10_CUDA_CHECK(launch_all_gradient(all, plan, state.data_ptr<float>(), up,
                                       partials.defined() ? partials.data_ptr<float>() : nullptr,
                                       out.data_ptr<float>(), call.stream));
  } else if (saved == Saved::kGradient) {  // the upstream gradient as upstream_of applies it
    const at::Tensor scale = reduction == kMean ? grad / count.clamp_min(1.0) : grad;
    out = (state * scale.to(at::kDouble)).to(at::kFloat);
  } else {  // the weights again, a chunk of anchors at a time
    const AllDistances distances(call, plan);
    AllGradient gradient(call, plan);
    at::Tensor dists = at::empty({plan.chunk_rows, batch}, call.floats);
    at::Tensor weights = at::empty_like(dists);
    call.for_each_chunk(plan, call.labels, margin, eps, [&](const MiningChunk& chunk) {
      distances.write(chunk, dists.narrow(0, 0, chunk.rows));
      C10_CUDA_CHECK(launch_batch_all(chunk, plan, dists.data_ptr<float>(), up, nullptr,
                                      nullptr, weights.data_ptr<float>(), gradient.row_sums(),
                                      call.stream));
      gradient.add_rows(chunk, weights.narrow(0, 0, chunk.rows));
    });
    out = gradient.result(eps);
  }
  return call.given_gradient(out).to(embeddings_in.scalar_type());
}

// The ops through the dispatcher: under torch.compile and fake tensors the calls below autograd
// must reach the fake kernels and the tracer.
const auto& mined_loss_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fused_triplet::mined_triplet_loss", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, int64_t, double, double, int64_t, bool,
              int64_t, int64_t, int64_t, int64_t, double, int64_t)>();
  return op;
}

const auto& mined_loss_backward_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fused_triplet::mined_triplet_loss_backward", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, int64_t, double, double, int64_t,
                            bool, int64_t, int64_t, int64_t, int64_t, double, int64_t)>();
  return op;
}

class MinedLossFunction : public torch::autograd::Function<MinedLossFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& embeddings,
                                                const at::Tensor& labels, int64_t mining,
                                                double margin, double eps, int64_t reduction,
                                                int64_t distance, int64_t hinge, int64_t counting,
                                                int64_t band, double band_margin,
                                                int64_t references) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [loss, count, state] = mined_loss_op().call(embeddings, labels, mining, margin, eps,
                                                     reduction, true, distance, hinge, counting,
                                                     band, band_margin, references);
    ctx->save_for_backward({embeddings, labels, count, state});
    // the options as one record, in the backward op's order
    ctx->saved_data["options"] = c10::ivalue::Tuple::create(
        {mining, margin, eps, reduction, distance, hinge, counting, band, band_margin,
         references});
    ctx->mark_non_differentiable({count, state});
    ctx->set_materialize_grads(false);  // count and state never get a gradient (no zero fills)
    return {loss, count, state};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    torch::autograd::variable_list out(12);  // the embeddings; labels and options get none
    if (!grads[0].defined() || !ctx->needs_input_grad(0)) return out;
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "fused_triplet mining: the fused backward is not differentiable (create_graph="
                "True); the float64 or CPU path is");
    const auto saved = ctx->get_saved_variables();
    const auto& o = ctx->saved_data["options"].toTupleRef().elements();
    out[0] = mined_loss_backward_op().call(
        grads[0], saved[0], saved[1], saved[2], saved[3], o[0].toInt(), o[1].toDouble(),
        o[2].toDouble(), o[3].toInt(), hinge_passes_at_zero(), o[4].toInt(), o[5].toInt(),
        o[6].toInt(), o[7].toInt(), o[8].toDouble(), o[9].toInt());
    return out;
  }
};

// Under autograd with embeddings that need a gradient: the forward keeps its state for the
// backward; otherwise the op runs as it is (batch_all then keeps no weights).
std::tuple<at::Tensor, at::Tensor, at::Tensor> mined_loss_autograd(
    const at::Tensor& embeddings, const at::Tensor& labels, int64_t mining, double margin,
    double eps, int64_t reduction, bool for_backward, int64_t distance, int64_t hinge,
    int64_t counting, int64_t band, double band_margin, int64_t references) {
  if (at::GradMode::is_enabled() && embeddings.requires_grad()) {
    auto out = MinedLossFunction::apply(embeddings, labels, mining, margin, eps, reduction,
                                        distance, hinge, counting, band, band_margin, references);
    return {out[0], out[1], out[2]};
  }
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return mined_loss_op().call(embeddings, labels, mining, margin, eps, reduction, for_backward,
                              distance, hinge, counting, band, band_margin, references);
}

// Tests: batch_hard's large-batch mining alone, (positive, negative, valid) per anchor, the labels
// ordered by counting (count_labels) or by sorted tiles at any batch.
std::tuple<at::Tensor, at::Tensor, at::Tensor> mine_batch_hard_cuda(const at::Tensor& embeddings,
                                                                    const at::Tensor& labels,
                                                                    double eps, bool count_labels) {
  const MiningCall call(embeddings, labels, Mining::kBatchHard, LossRule{});
  const int64_t batch = call.embeddings.size(0);
  if (batch == 0) {
    return {at::empty({0}, call.labels.options()), at::empty({0}, call.labels.options()),
            at::empty({0}, call.labels.options().dtype(at::kBool))};
  }
  MiningPlan plan = call.plan(false);
  plan.count_labels = count_labels;
  const auto [picks, valid] = mine_hardest(call, plan, eps);
  const at::Tensor anchors = at::arange(batch, picks.options());
  return {at::where(valid, picks[0], anchors), at::where(valid, picks[1], anchors), valid};
}

int64_t mining_whole_rows(int64_t mining) {
  return whole_batch_rows(mining_of(mining), /*references=*/true);
}

}  // namespace
}  // namespace fused_triplet
// library-only }
