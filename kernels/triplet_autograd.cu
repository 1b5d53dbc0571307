// Autograd of fused_triplet::triplet_margin_loss, registered for the Autograd key in
// register_ops.cu: forward runs the op below autograd and saves the inputs and the per-row
// dists (nothing B x D); backward is the fused backward op. In C++ rather than Python
// (torch.library.register_autograd): on small inputs the Python autograd layer took more host
// time per training step than the kernels took on the GPU. torch.compile traces it as it traces
// ATen's own autograd kernels (the ops below it have fake kernels).
#include "triplet_common.cuh"

#include <atomic>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

namespace fused_triplet {

namespace {

// Whether the installed torch's clamp_min passes the gradient at exactly its bound: probed in
// Python when the library loads (fused_triplet._hinge_passes_at_zero), set through the op
// fused_triplet::set_hinge_at_zero.
std::atomic<bool> hinge_at_zero{false};

// The ops through the dispatcher (not the CUDA functions directly): under torch.compile and
// fake tensors the calls below autograd must reach the fake kernels and the tracer.
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

class TripletMarginLossFunction
    : public torch::autograd::Function<TripletMarginLossFunction> {
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
    // backward (a kernel launch). The loss's gradient is then undefined only when it is unused.
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
      // create_graph=True (double backward): the fused backward kernel is not differentiable,
      // so differentiate ATen's own formula on the saved inputs; its gradients are.
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
    const auto [ga, gp, gn] = backward_op().call(grad_loss, saved[0], saved[1], saved[2],
                                                 saved[3], margin, p, eps, swap, reduction,
                                                 hinge_at_zero.load(), needed);
    if (needed[0]) out[0] = ga;
    if (needed[1]) out[1] = gp;
    if (needed[2]) out[2] = gn;
    return out;
  }
};

}  // namespace

void set_hinge_at_zero(bool value) { hinge_at_zero.store(value); }

std::tuple<at::Tensor, at::Tensor> triplet_margin_loss_autograd(
    const at::Tensor& anchor, const at::Tensor& positive, const at::Tensor& negative,
    double margin, double p, double eps, bool swap, int64_t reduction) {
  auto out = TripletMarginLossFunction::apply(anchor, positive, negative, margin, p, eps, swap,
                                              reduction);
  return {out[0], out[1]};
}

}  // namespace fused_triplet
