// The torch side of fused_triplet: input checks, outputs, the op schemas with their CUDA kernels
// and autograd. Compiled by the host compiler; the kernels sit behind triplet_launch.h.
//
// Autograd is in C++ (registered for the Autograd key) rather than Python: on small inputs a
// Python autograd layer took more host time per training step than the kernels took on the GPU.
// Fake kernels (shapes only, for torch.compile) are registered from fused_triplet.py.
#include "triplet_launch.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/triplet_margin_loss.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/accumulate.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <limits>

namespace fused_triplet {
namespace {

// Whether the installed torch's clamp_min passes the gradient at exactly its bound: probed in
// Python when the library loads, set through fused_triplet::set_hinge_at_zero.
std::atomic<bool> hinge_at_zero{false};
// Test-only: the kernel families to launch instead of the plan's (-1: the plan's).
std::atomic<int> forced_forward{-1};
std::atomic<int> forced_backward{-1};

void check_inputs(const at::Tensor& a, const at::Tensor& p, const at::Tensor& n, double pnorm,
                  int64_t reduction) {
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

int64_t rows_of(const at::Tensor& x) {
  return c10::multiply_integers(x.sizes().slice(0, x.dim() - 1));
}

// (rows, dim) view with unit element stride; a view whenever the batch dims collapse to one row
// stride (contiguous, x[:, :D] of a wider tensor, a broadcast row), a copy otherwise.
at::Tensor as_rows(const at::Tensor& x, int64_t rows, int64_t dim) {
  at::Tensor r = x.reshape({rows, dim});
  if (dim > 1 && r.stride(1) != 1) r = r.contiguous();
  return r;
}

DType dtype_of(at::ScalarType type) {
  switch (type) {
    case at::kHalf: return DType::kHalf;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kFloat: return DType::kFloat;
    default: return DType::kDouble;
  }
}

at::ScalarType acc_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

int compute_capability_major(const at::Tensor& on) {
  int major = 0;
  C10_CUDA_CHECK(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, on.get_device()));
  return major;
}

// The problem as the kernels see it; a, p, n are the (rows, dim) views, which must outlive it.
TripletProblem make_problem(const at::Tensor& a, const at::Tensor& p, const at::Tensor& n,
                            double margin, double pnorm, double eps, bool swap) {
  TripletProblem pr;
  pr.a = a.data_ptr();
  pr.p = p.data_ptr();
  pr.n = n.data_ptr();
  pr.stride_a = a.stride(0);
  pr.stride_p = p.stride(0);
  pr.stride_n = n.stride(0);
  pr.rows = a.size(0);
  pr.dim = a.size(1);
  pr.dtype = dtype_of(a.scalar_type());
  pr.margin = margin;
  pr.p_norm = pnorm;
  pr.eps = eps;
  pr.swap = swap;
  pr.cc_major = compute_capability_major(a);
  return pr;
}

LaunchPlan forward_plan(const TripletProblem& pr) {
  const auto family = static_cast<ForwardFamily>(forced_forward.load());
  const char* unfit = forward_family_unfit(pr, family);
  TORCH_CHECK(unfit == nullptr, "fused_triplet: the forced forward family cannot run: ", unfit);
  return plan_forward(pr, family);
}

LaunchPlan backward_plan(const TripletProblem& pr) {
  const auto family = static_cast<BackwardFamily>(forced_backward.load());
  const char* unfit = backward_family_unfit(pr, family);
  TORCH_CHECK(unfit == nullptr, "fused_triplet: the forced backward family cannot run: ", unfit);
  return plan_backward(pr, family);
}

std::tuple<at::Tensor, at::Tensor> forward_cuda(const at::Tensor& anchor,
                                                const at::Tensor& positive,
                                                const at::Tensor& negative, double margin,
                                                double p, double eps, bool swap,
                                                int64_t reduction) {
  check_inputs(anchor, positive, negative, p, reduction);
  const c10::cuda::CUDAGuard guard(anchor.device());
  const auto batch = anchor.sizes().slice(0, anchor.dim() - 1);
  const int64_t dim = anchor.size(-1);
  const int64_t rows = rows_of(anchor);
  const auto opts = anchor.options();
  at::Tensor dists = at::empty({swap ? 3 : 2, rows}, opts.dtype(acc_dtype(anchor)));
  at::Tensor loss = reduction == kNone ? at::empty(batch, opts) : at::empty({}, opts);
  if (rows == 0) {  // torch: the mean of nothing is nan, the sum of nothing 0
    if (reduction == kMean) loss.fill_(std::numeric_limits<double>::quiet_NaN());
    if (reduction == kSum) loss.zero_();
    return {loss, dists};
  }
  const at::Tensor a = as_rows(anchor, rows, dim);
  const at::Tensor pos = as_rows(positive, rows, dim);
  const at::Tensor neg = as_rows(negative, rows, dim);
  const TripletProblem pr = make_problem(a, pos, neg, margin, p, eps, swap);
  const LaunchPlan plan = forward_plan(pr);
  const auto bytes = static_cast<int64_t>(forward_workspace_bytes(pr, plan, reduction));
  at::Tensor workspace = at::empty({bytes}, opts.dtype(at::kByte));
  C10_CUDA_CHECK(launch_forward(pr, plan, reduction, loss.data_ptr(), dists.data_ptr(),
                                workspace.data_ptr(), c10::cuda::getCurrentCUDAStream()));
  return {loss, dists};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cuda(
    const at::Tensor& grad, const at::Tensor& anchor, const at::Tensor& positive,
    const at::Tensor& negative, const at::Tensor& dists, double margin, double p, double eps,
    bool swap, int64_t reduction, bool hinge, std::array<bool, 3> output_mask) {
  check_inputs(anchor, positive, negative, p, reduction);
  const c10::cuda::CUDAGuard guard(anchor.device());
  const int64_t dim = anchor.size(-1);
  const int64_t rows = rows_of(anchor);
  TORCH_CHECK(dists.is_cuda() && dists.device() == anchor.device() &&
                  dists.scalar_type() == acc_dtype(anchor) && dists.dim() == 2 &&
                  dists.size(0) == (swap ? 3 : 2) && dists.size(1) == rows,
              "fused_triplet: dists must be the forward's [", swap ? 3 : 2, ", ", rows, "] ",
              acc_dtype(anchor), " tensor on ", anchor.device());
  TORCH_CHECK(grad.device() == anchor.device() && grad.scalar_type() == anchor.scalar_type() &&
                  grad.numel() == (reduction == kNone ? rows : 1),
              "fused_triplet: the upstream gradient must be ", reduction == kNone ? rows : 1,
              " values of ", anchor.scalar_type(), " on ", anchor.device());
  std::array<at::Tensor, 3> out;
  const at::Tensor* inputs[3] = {&anchor, &positive, &negative};
  for (int k = 0; k < 3; ++k) {
    out[k] = output_mask[k] ? at::empty(inputs[k]->sizes(), anchor.options())
                            : at::empty({0}, anchor.options());
  }
  if (rows == 0 || dim == 0 || !(output_mask[0] || output_mask[1] || output_mask[2])) {
    return {out[0], out[1], out[2]};
  }
  const at::Tensor a = as_rows(anchor, rows, dim);
  const at::Tensor pos = as_rows(positive, rows, dim);
  const at::Tensor neg = as_rows(negative, rows, dim);
  const at::Tensor g = grad.reshape({-1}).contiguous();
  const at::Tensor d = dists.contiguous();
  const TripletProblem pr = make_problem(a, pos, neg, margin, p, eps, swap);
  const LaunchPlan plan = backward_plan(pr);
  C10_CUDA_CHECK(launch_backward(pr, plan, reduction, g.data_ptr(), d.data_ptr(), hinge,
                                 output_mask[0] ? out[0].data_ptr() : nullptr,
                                 output_mask[1] ? out[1].data_ptr() : nullptr,
                                 output_mask[2] ? out[2].data_ptr() : nullptr,
                                 c10::cuda::getCurrentCUDAStream()));
  return {out[0], out[1], out[2]};
}

// The ops through the dispatcher (not the functions above): under torch.compile and fake
// tensors the calls below autograd must reach the fake kernels and the tracer.
const auto& forward_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fused_triplet::triplet_margin_loss", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&, double, double, double,
                                                    bool, int64_t)>();
  return op;
}

const auto& backward_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fused_triplet::triplet_margin_loss_backward", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const at::Tensor&, double, double, double, bool, int64_t, bool,
              std::array<bool, 3>)>();
  return op;
}

class TripletMarginLossFunction : public torch::autograd::Function<TripletMarginLossFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& anchor,
                                                const at::Tensor& positive,
                                                const at::Tensor& negative, double margin,
                                                double p, double eps, bool swap,
                                                int64_t reduction) {
    at::Tensor loss, dists;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(loss, dists) =
          forward_op().call(anchor, positive, negative, margin, p, eps, swap, reduction);
    }
    ctx->save_for_backward({anchor, positive, negative, dists});
    ctx->saved_data["margin"] = margin;
    ctx->saved_data["p"] = p;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["swap"] = swap;
    ctx->saved_data["reduction"] = reduction;
    ctx->mark_non_differentiable({dists});
    // dists never gets a gradient: without this, autograd fills a zero one for it on every
    // backward (a kernel launch).
    ctx->set_materialize_grads(false);
    return {loss, dists};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    torch::autograd::variable_list out(8);  // a, p, n; the five options get none
    const at::Tensor& grad_loss = grads[0];
    if (!grad_loss.defined()) return out;
    const auto saved = ctx->get_saved_variables();
    const double margin = ctx->saved_data["margin"].toDouble();
    const double p = ctx->saved_data["p"].toDouble();
    const double eps = ctx->saved_data["eps"].toDouble();
    const bool swap = ctx->saved_data["swap"].toBool();
    const int64_t reduction = ctx->saved_data["reduction"].toInt();
    const std::array<bool, 3> needed = {ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                        ctx->needs_input_grad(2)};
    if (at::GradMode::is_enabled()) {
      // create_graph=True (double backward): the fused backward is not differentiable, so
      // differentiate ATen's own formula on the saved inputs; its gradients are.
      std::vector<at::Tensor> wrt;
      for (int k = 0; k < 3; ++k) {
        if (needed[k]) wrt.push_back(saved[k]);
      }
      if (wrt.empty()) return out;
      const at::Tensor loss =
          at::triplet_margin_loss(saved[0], saved[1], saved[2], margin, p, eps, swap, reduction);
      const auto found = torch::autograd::grad({loss}, wrt, {grad_loss}, /*retain_graph=*/true,
                                               /*create_graph=*/true);
      size_t j = 0;
      for (int k = 0; k < 3; ++k) {
        if (needed[k]) out[k] = found[j++];
      }
      return out;
    }
    const auto [ga, gp, gn] =
        backward_op().call(grad_loss, saved[0], saved[1], saved[2], saved[3], margin, p, eps,
                           swap, reduction, hinge_at_zero.load(), needed);
    if (needed[0]) out[0] = ga;
    if (needed[1]) out[1] = gp;
    if (needed[2]) out[2] = gn;
    return out;
  }
};

std::tuple<at::Tensor, at::Tensor> forward_autograd(const at::Tensor& anchor,
                                                    const at::Tensor& positive,
                                                    const at::Tensor& negative, double margin,
                                                    double p, double eps, bool swap,
                                                    int64_t reduction) {
  auto out = TripletMarginLossFunction::apply(anchor, positive, negative, margin, p, eps, swap,
                                              reduction);
  return {out[0], out[1]};
}

void set_hinge_at_zero(bool value) { hinge_at_zero.store(value); }

void force_families(int64_t forward, int64_t backward) {
  forced_forward.store(static_cast<int>(forward));
  forced_backward.store(static_cast<int>(backward));
}

// Which kernels the ops would launch for these inputs (already broadcast to one shape).
std::string describe_plans(const at::Tensor& anchor, const at::Tensor& positive,
                           const at::Tensor& negative, double p, bool swap) {
  check_inputs(anchor, positive, negative, p, kMean);
  const c10::cuda::CUDAGuard guard(anchor.device());
  const int64_t rows = rows_of(anchor), dim = anchor.size(-1);
  const at::Tensor a = as_rows(anchor, rows, dim);
  const at::Tensor pos = as_rows(positive, rows, dim);
  const at::Tensor neg = as_rows(negative, rows, dim);
  const TripletProblem pr = make_problem(a, pos, neg, 1.0, p, 1e-6, swap);
  return "forward " + describe_plan(forward_plan(pr), true) + "; backward " +
         describe_plan(backward_plan(pr), false);
}

}  // namespace
}  // namespace fused_triplet

TORCH_LIBRARY(fused_triplet, m) {
  // Inputs: three tensors of one shape (..., D), dtype and CUDA device (the Python wrapper
  // broadcasts and promotes them). Returns (loss, dists): loss has the batch shape for
  // reduction 0 ('none') and is a scalar for 1 ('mean') and 2 ('sum'), in the input dtype;
  // dists is [2 or 3 (swap), rows] (d_ap, d_an, d_pn) in float (double for double inputs).
  m.def(
      "triplet_margin_loss(Tensor anchor, Tensor positive, Tensor negative, float margin, "
      "float p, float eps, bool swap, int reduction) -> (Tensor, Tensor)");
  // The gradients of (anchor, positive, negative) given the loss's upstream gradient and the
  // forward's dists; output_mask says which are needed (the others come back empty).
  // hinge_at_zero: whether clamp_min passes the gradient at exactly 0 (torch <= 2.13 does).
  m.def(
      "triplet_margin_loss_backward(Tensor grad, Tensor anchor, Tensor positive, "
      "Tensor negative, Tensor dists, float margin, float p, float eps, bool swap, "
      "int reduction, bool hinge_at_zero, bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
  // Set once when the library loads, from a probe of the installed torch.
  m.def("set_hinge_at_zero(bool value) -> ()", &fused_triplet::set_hinge_at_zero);
  // Tests: launch these kernel families (forward 0 rows, 1 ring; backward 0 rows, 1 pointwise;
  // -1 the plan's), and describe what the plans pick.
  m.def("force_families(int forward, int backward) -> ()", &fused_triplet::force_families);
  m.def("describe_plans(Tensor anchor, Tensor positive, Tensor negative, float p, bool swap) -> str");
}

TORCH_LIBRARY_IMPL(fused_triplet, CUDA, m) {
  m.impl("triplet_margin_loss", &fused_triplet::forward_cuda);
  m.impl("triplet_margin_loss_backward", &fused_triplet::backward_cuda);
  m.impl("describe_plans", &fused_triplet::describe_plans);
}

TORCH_LIBRARY_IMPL(fused_triplet, Autograd, m) {
  m.impl("triplet_margin_loss", &fused_triplet::forward_autograd);
}
