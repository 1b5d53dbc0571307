// The op schemas (torch.ops.fused_triplet.*), their CUDA implementations and the forward's
// autograd. Fake (meta) kernels are registered from Python (fused_triplet.py), after this
// library loads.
#include "triplet_common.cuh"

#include <torch/library.h>

TORCH_LIBRARY(fused_triplet, m) {
  // Inputs: three tensors of one shape (..., D), dtype and CUDA device (the Python wrapper
  // broadcasts and promotes them). Returns (loss, dists): loss has the batch shape for
  // reduction 0 ('none') and is a scalar for 1 ('mean') and 2 ('sum'), in the input dtype;
  // dists is [2 or 3 (swap), rows] (d_ap, d_an, d_pn) in the accumulation dtype (fp32, or fp64
  // for fp64 inputs).
  m.def(
      "triplet_margin_loss(Tensor anchor, Tensor positive, Tensor negative, float margin, "
      "float p, float eps, bool swap, int reduction) -> (Tensor, Tensor)");
  // The gradients of (anchor, positive, negative) given the upstream gradient of the loss and
  // the forward's dists; output_mask says which are needed (the others come back empty).
  // hinge_at_zero: whether clamp_min passes the gradient at exactly 0 (torch <= 2.13 does).
  m.def(
      "triplet_margin_loss_backward(Tensor grad, Tensor anchor, Tensor positive, "
      "Tensor negative, Tensor dists, float margin, float p, float eps, bool swap, "
      "int reduction, bool hinge_at_zero, bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
  // The hinge_at_zero the forward's autograd passes to the backward op: set once, when the
  // library loads, from a probe of the installed torch (fused_triplet._hinge_passes_at_zero).
  m.def("set_hinge_at_zero(bool value) -> ()", &fused_triplet::set_hinge_at_zero);
}

TORCH_LIBRARY_IMPL(fused_triplet, CUDA, m) {
  m.impl("triplet_margin_loss", &fused_triplet::triplet_margin_loss_cuda);
  m.impl("triplet_margin_loss_backward", &fused_triplet::triplet_margin_loss_backward_cuda);
}

TORCH_LIBRARY_IMPL(fused_triplet, Autograd, m) {
  m.impl("triplet_margin_loss", &fused_triplet::triplet_margin_loss_autograd);
}
