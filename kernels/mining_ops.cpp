// library-only {
// The torch side of the in-batch mining (mined_triplet_margin_loss with p = 2 on CUDA): input
// checks, the chunk loop, the Gram products (cuBLAS) and the batch_all gradient's matrix
// products. The Python side registers the fake kernels and batch_all_loss's autograd.
#include "check_text.h"
#include "mining_launch.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <functional>

namespace fused_triplet {
namespace {

// The embeddings the mining ops take (the kernels read them as float, cast exactly); the Python
// side sends every other dtype to the torch reference, and the ops refuse them before any launch.
void check_mining_dtype(const at::Tensor& embeddings) {
  const at::ScalarType type = embeddings.scalar_type();
  TORCH_CHECK(type == at::kHalf || type == at::kBFloat16 || type == at::kFloat,
              "fused_triplet mining: expected float16, bfloat16 or float32 embeddings, got ", type);
}

// The ops' own matrix products and casts run as written, whatever autocast the caller is under.
using NoAutocast = c10::impl::ExcludeDispatchKeyGuard;

void check_mining(const at::Tensor& embeddings, const at::Tensor& labels) {
  TORCH_CHECK(embeddings.is_cuda() && labels.device() == embeddings.device(),
              "fused_triplet mining: embeddings and labels must be on one CUDA device, got ",
              embeddings.device(), " and ", labels.device());
  TORCH_CHECK(embeddings.dim() == 2, "fused_triplet mining: expected (batch, dim) embeddings, got ",
              shape_text(embeddings));
  check_mining_dtype(embeddings);
  TORCH_CHECK(labels.scalar_type() == at::kLong && labels.dim() == 1 &&
                  labels.size(0) == embeddings.size(0),
              "fused_triplet mining: expected int64 labels of shape (",
              std::to_string(embeddings.size(0)), "), got ", labels.scalar_type(), " ",
              shape_text(labels));
}

// What every mining op does first, for as long as it runs: check its inputs (before any launch),
// leave autocast, take the inputs' device, read them as contiguous float embeddings (exact for
// 2-byte ones) and int64 labels.
struct MiningCall {
  MiningCall(const at::Tensor& embeddings_in, const at::Tensor& labels_in)
      : checked((check_mining(embeddings_in, labels_in), true)),
        no_autocast(c10::autocast_dispatch_keyset),
        guard(embeddings_in.device()),
        embeddings(embeddings_in.to(at::kFloat).contiguous()),
        labels(labels_in.contiguous()) {}
  bool checked;
  NoAutocast no_autocast;
  c10::cuda::CUDAGuard guard;
  at::Tensor embeddings, labels;
};

// Every anchor of the float embeddings as one chunk.
MiningChunk whole_batch(const at::Tensor& embeddings, const at::Tensor& labels, double margin,
                        double eps) {
  return {embeddings.data_ptr<float>(), labels.data_ptr<int64_t>(), embeddings.size(0),
          embeddings.size(1), 0, embeddings.size(0), float(eps), float(margin)};
}

cudaStream_t stream_of(const at::Tensor& x) {
  return c10::cuda::getCurrentCUDAStream(x.get_device()).stream();
}

// The chunk loop: fn(chunk, stream) for each chunk of anchors of the float embeddings, on their
// device and current stream.
void for_each_chunk(const at::Tensor& embeddings, const at::Tensor& labels, double margin,
                    double eps, const MiningPlan& plan,
                    const std::function<void(const MiningChunk&, cudaStream_t)>& fn) {
  MiningChunk chunk = whole_batch(embeddings, labels, margin, eps);
  for (chunk.first = 0; chunk.first < chunk.batch; chunk.first += plan.chunk_rows) {
    chunk.rows = std::min(plan.chunk_rows, chunk.batch - chunk.first);
    fn(chunk, stream_of(embeddings));
  }
}

// The embeddings in float, less their mean (batch_all's gradient; batch_hard's gram_rows_kernel
// centres its rows itself): distances are unchanged, and the matrix products' error, relative to
// the rows' norms, shrinks to the batch's spread.
at::Tensor centred(const at::Tensor& embeddings) {
  const at::Tensor x = embeddings.to(at::kFloat);
  return x - x.mean(0, true);
}

// batch_hard: (positive, negative, valid) per anchor. The rows go sorted by label (stable), so
// each anchor's positives are one range of columns.
std::tuple<at::Tensor, at::Tensor, at::Tensor> mine_batch_hard_cuda(const at::Tensor& embeddings_in,
                                                                    const at::Tensor& labels_in,
                                                                    double eps) {
  const MiningCall call(embeddings_in, labels_in);
  const at::Tensor& embeddings = call.embeddings;
  const int64_t batch = embeddings.size(0);
  at::Tensor positive = at::empty({batch}, call.labels.options());
  at::Tensor negative = at::empty({batch}, call.labels.options());
  at::Tensor valid = at::empty({batch}, call.labels.options().dtype(at::kBool));
  if (batch == 0) return {positive, negative, valid};
  const auto [sorted_labels, order] = call.labels.sort(/*stable=*/true, 0, false);
  const MiningPlan plan = plan_mining(batch, embeddings.size(1));
  at::Tensor rounded = at::empty(embeddings.sizes(), embeddings.options().dtype(at::kBFloat16));
  at::Tensor bounds = at::empty({2, batch, 2}, embeddings.options());
  at::Tensor classes = at::empty({batch, 2}, call.labels.options());
  const at::Tensor mean = embeddings.mean(0);
  C10_CUDA_CHECK(launch_gram_rows(whole_batch(embeddings, sorted_labels, 0.0, eps), plan,
                                  order.data_ptr<int64_t>(), mean.data_ptr<float>(),
                                  rounded.data_ptr(), bounds.data_ptr<float>(),
                                  classes.data_ptr<int64_t>(), stream_of(embeddings)));
  at::Tensor gram = at::empty({plan.chunk_rows, batch}, embeddings.options());
  for_each_chunk(embeddings, sorted_labels, 0.0, eps, plan,
                 [&](const MiningChunk& chunk, cudaStream_t s) {
    at::Tensor rows = gram.narrow(0, 0, chunk.rows);
    at::mm_out(rows, rounded.narrow(0, chunk.first, chunk.rows), rounded.t(), at::kFloat);
    C10_CUDA_CHECK(launch_hardest(chunk, plan, rows.data_ptr<float>(), bounds.data_ptr<float>(),
                                  classes.data_ptr<int64_t>(), order.data_ptr<int64_t>(),
                                  positive.data_ptr<int64_t>(),
                                  negative.data_ptr<int64_t>(), valid.data_ptr<bool>(), s));
  });
  return {positive, negative, valid};
}

// batch_all: (loss, active) per anchor, float32 and int64.
std::tuple<at::Tensor, at::Tensor> batch_all_loss_cuda(const at::Tensor& embeddings_in,
                                                       const at::Tensor& labels_in, double margin,
                                                       double eps) {
  const MiningCall call(embeddings_in, labels_in);
  const at::Tensor& embeddings = call.embeddings;
  const at::Tensor& labels = call.labels;
  const int64_t batch = embeddings.size(0);
  at::Tensor loss = at::empty({batch}, embeddings.options().dtype(at::kFloat));
  at::Tensor active = at::empty({batch}, labels.options());
  if (batch == 0) return {loss, active};
  const MiningPlan plan = plan_mining(batch, embeddings.size(1));
  at::Tensor dists = at::empty({plan.chunk_rows, batch}, loss.options());
  for_each_chunk(embeddings, labels, margin, eps, plan, [&](const MiningChunk& chunk, cudaStream_t s) {
    C10_CUDA_CHECK(launch_distances(chunk, plan, dists.data_ptr<float>(), s));
    C10_CUDA_CHECK(launch_batch_all(chunk, plan, dists.data_ptr<float>(), nullptr,
                                    loss.data_ptr<float>(), active.data_ptr<int64_t>(), nullptr,
                                    s));
  });
  return {loss, active};
}

// batch_all's gradient for the upstream gradient of each anchor's loss. With coefficients
// A[i, c] = grad_i (d loss_i / d d(i, c)) / d(i, c) and x the centred rows,
//   dL/dx_m = sum_c A[m, c] (x_m - x_c + eps) - sum_i A[i, m] (x_i - x_m + eps),
// two matrix products per chunk of rows of A.
at::Tensor batch_all_loss_backward_cuda(const at::Tensor& grad_in, const at::Tensor& embeddings_in,
                                        const at::Tensor& labels_in, double margin, double eps) {
  const MiningCall call(embeddings_in, labels_in);
  const at::Tensor& embeddings = call.embeddings;
  const at::Tensor& labels = call.labels;
  TORCH_CHECK(grad_in.scalar_type() == at::kFloat && grad_in.device() == embeddings_in.device() &&
                  grad_in.dim() == 1 && grad_in.size(0) == embeddings_in.size(0),
              "fused_triplet mining: expected a float32 gradient of shape (",
              std::to_string(embeddings_in.size(0)), ") on the embeddings' device, got ",
              grad_in.scalar_type(), " ", shape_text(grad_in), " on ", grad_in.device());
  const at::Tensor grad = grad_in.contiguous();
  const int64_t batch = embeddings.size(0);
  at::Tensor out = at::zeros(embeddings.sizes(), embeddings.options().dtype(at::kFloat));
  if (batch == 0) return out.to(embeddings_in.scalar_type());
  const at::Tensor x = centred(embeddings);
  const MiningPlan plan = plan_mining(batch, embeddings.size(1));
  at::Tensor dists = at::empty({plan.chunk_rows, batch}, out.options());
  at::Tensor coeffs = at::empty({plan.chunk_rows, batch}, out.options());
  for_each_chunk(embeddings, labels, margin, eps, plan, [&](const MiningChunk& chunk, cudaStream_t s) {
    C10_CUDA_CHECK(launch_distances(chunk, plan, dists.data_ptr<float>(), s));
    C10_CUDA_CHECK(launch_batch_all(chunk, plan, dists.data_ptr<float>(), grad.data_ptr<float>(),
                                    nullptr, nullptr, coeffs.data_ptr<float>(), s));
    const at::Tensor a = coeffs.narrow(0, 0, chunk.rows);
    const at::Tensor rows = x.narrow(0, chunk.first, chunk.rows);
    out.narrow(0, chunk.first, chunk.rows) += a.sum(1, true) * (rows + eps) - at::mm(a, x);
    out += a.sum(0).unsqueeze(1) * (x - eps) - at::mm(a.t(), rows);
  });
  return out.to(embeddings_in.scalar_type());
}

}  // namespace
}  // namespace fused_triplet

TORCH_LIBRARY_FRAGMENT(fused_triplet, m) {
  // In-batch mining, p = 2; labels int64 (the Python side converts any integer dtype).
  // mine_batch_hard: per anchor, its hardest positive and negative (int64; the anchor itself where
  // it has none) and whether it has both.
  m.def("mine_batch_hard(Tensor embeddings, Tensor labels, float eps) -> (Tensor, Tensor, Tensor)");
  // batch_all_loss: per anchor, the float32 sum of relu(margin + d_ap - d_an) over its triplets
  // and how many are > 0; its backward takes the float32 gradient of the per-anchor sums.
  m.def("batch_all_loss(Tensor embeddings, Tensor labels, float margin, float eps) "
        "-> (Tensor, Tensor)");
  m.def("batch_all_loss_backward(Tensor grad, Tensor embeddings, Tensor labels, float margin, "
        "float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(fused_triplet, CUDA, m) {
  m.impl("mine_batch_hard", &fused_triplet::mine_batch_hard_cuda);
  m.impl("batch_all_loss", &fused_triplet::batch_all_loss_cuda);
  m.impl("batch_all_loss_backward", &fused_triplet::batch_all_loss_backward_cuda);
}
// library-only }
