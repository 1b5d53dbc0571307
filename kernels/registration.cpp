// library-only {
// Every op of the library in one place: the schemas users call (fused_triplet), the library's
// own plumbing and the tests' views (fused_triplet_internal), and each op's kernels by dispatch
// key. The entry points are defined in triplet_ops.cpp and mining_ops.cpp; fused_triplet.py
// compiles the .cpp files as one translation unit, so they keep internal linkage.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <string>
#include <tuple>

namespace fused_triplet {
namespace {

// triplet_ops.cpp
std::tuple<at::Tensor, at::Tensor> forward_cuda(const at::Tensor& anchor,
                                                const at::Tensor& positive,
                                                const at::Tensor& negative, double margin,
                                                double p, double eps, bool swap,
                                                int64_t reduction, bool float32_loss,
                                                int64_t forward_family, int64_t backward_family);
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cuda(
    const at::Tensor& grad, const at::Tensor& anchor, const at::Tensor& positive,
    const at::Tensor& negative, const at::Tensor& dists, double margin, double p, double eps,
    bool swap, int64_t reduction, bool hinge, std::array<bool, 3> output_mask, int64_t family);
std::tuple<at::Tensor, at::Tensor> forward_autograd(
    const at::Tensor& anchor, const at::Tensor& positive, const at::Tensor& negative,
    double margin, double p, double eps, bool swap, int64_t reduction, bool float32_loss,
    int64_t forward_family, int64_t backward_family);
std::tuple<at::Tensor, at::Tensor> forward_autocast(
    const at::Tensor& anchor, const at::Tensor& positive, const at::Tensor& negative,
    double margin, double p, double eps, bool swap, int64_t reduction, bool float32_loss,
    int64_t forward_family, int64_t backward_family);
void set_hinge_at_zero(bool value);
void release_step_state();
std::string describe_plans(const at::Tensor& anchor, const at::Tensor& positive,
                           const at::Tensor& negative, double p, bool swap,
                           int64_t forward_family, int64_t backward_family);
at::Tensor upstream_history(const at::Tensor& anchor, const at::Tensor& positive,
                            const at::Tensor& negative, double margin, double p, double eps,
                            bool swap, int64_t reduction, bool float32_loss);

// mining_ops.cpp
std::tuple<at::Tensor, at::Tensor, at::Tensor> mined_loss_cuda(
    const at::Tensor& embeddings, const at::Tensor& labels, int64_t mining, double margin,
    double eps, int64_t reduction, bool for_backward, int64_t distance, int64_t hinge,
    int64_t counting, int64_t band, double band_margin, int64_t references);
at::Tensor mined_loss_backward_cuda(const at::Tensor& grad, const at::Tensor& embeddings,
                                    const at::Tensor& labels, const at::Tensor& count,
                                    const at::Tensor& state, int64_t mining, double margin,
                                    double eps, int64_t reduction, bool hinge_at_zero,
                                    int64_t distance, int64_t hinge, int64_t counting,
                                    int64_t band, double band_margin, int64_t references);
std::tuple<at::Tensor, at::Tensor, at::Tensor> mined_loss_autograd(
    const at::Tensor& embeddings, const at::Tensor& labels, int64_t mining, double margin,
    double eps, int64_t reduction, bool for_backward, int64_t distance, int64_t hinge,
    int64_t counting, int64_t band, double band_margin, int64_t references);
std::tuple<at::Tensor, at::Tensor, at::Tensor> mine_batch_hard_cuda(const at::Tensor& embeddings,
                                                                    const at::Tensor& labels,
                                                                    double eps, bool count_labels);
int64_t mining_whole_rows(int64_t mining);

}  // namespace
}  // namespace fused_triplet

TORCH_LIBRARY(fused_triplet, m) {
  // Inputs: three tensors of one shape (..., D), dtype and CUDA device (the Python wrapper
  // broadcasts and promotes them). Returns (loss, dists): loss has the batch shape for
  // reduction 0 ('none') and is a scalar for 1 ('mean') and 2 ('sum'), in the input dtype
  // (float32 for 2-byte inputs with float32_loss, as autocast sets it); dists is
  // [2 or 3 (swap), rows] (d_ap, d_an, d_pn) in float (double for double inputs).
  // forward_family / backward_family: -1 lets the plan choose; tests ask for a family (forward
  // 0 rows, 1 ring, 2 one pass; backward 0 rows, 1 pointwise, 2 check after a one pass).
  m.def(
      "triplet_margin_loss(Tensor anchor, Tensor positive, Tensor negative, float margin, "
      "float p, float eps, bool swap, int reduction, bool float32_loss=False, "
      "int forward_family=-1, int backward_family=-1) -> (Tensor, Tensor)");
  // The gradients of (anchor, positive, negative) given the loss's upstream gradient (in the
  // loss's dtype) and the forward's dists; output_mask says which are needed (the others come
  // back empty). hinge_at_zero: whether clamp_min passes the gradient at exactly 0 (torch <= 2.13
  // does).
  m.def(
      "triplet_margin_loss_backward(Tensor grad, Tensor anchor, Tensor positive, "
      "Tensor negative, Tensor dists, float margin, float p, float eps, bool swap, "
      "int reduction, bool hinge_at_zero, bool[3] output_mask, int family=-1) "
      "-> (Tensor, Tensor, Tensor)");
  // In-batch mining, p = 2; labels int64 (the Python side converts any integer dtype); mining 0
  // batch_hard, 1 batch_all, 2 semi_hard; reduction as at::Reduction (0 none, 1 mean, 2 sum);
  // the loss rule as rule_of reads it; references: the last rows are a reference set
  // (MiningChunk's). Returns (loss, count, state): mined_loss_cuda says what each holds.
  m.def("mined_triplet_loss(Tensor embeddings, Tensor labels, int mining, float margin, "
        "float eps, int reduction, bool for_backward=False, int distance=0, int hinge=0, "
        "int counting=0, int band=0, float band_margin=0., int references=0) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("mined_triplet_loss_backward(Tensor grad, Tensor embeddings, Tensor labels, "
        "Tensor count, Tensor state, int mining, float margin, float eps, int reduction, "
        "bool hinge_at_zero, int distance=0, int hinge=0, int counting=0, int band=0, "
        "float band_margin=0., int references=0) -> Tensor");
}

TORCH_LIBRARY(fused_triplet_internal, m) {
  // Set when the library loads, from a probe of the installed torch; the one pass's state is
  // released when the interpreter exits (while CUDA is still up).
  m.def("set_hinge_at_zero(bool value) -> ()", &fused_triplet::set_hinge_at_zero);
  m.def("release_step_state() -> ()", &fused_triplet::release_step_state);
  // The largest batch the mining plan keeps whole (the fake kernel's shape of batch_all's state).
  m.def("mining_whole_rows(int mining) -> int", &fused_triplet::mining_whole_rows);
  // Tests: what the plans pick, what the one pass predicts from, batch_hard's large-batch mining.
  m.def(
      "describe_plans(Tensor anchor, Tensor positive, Tensor negative, float p, bool swap, "
      "int forward_family=-1, int backward_family=-1) -> str");
  m.def(
      "upstream_history(Tensor anchor, Tensor positive, Tensor negative, float margin, float p, "
      "float eps, bool swap, int reduction, bool float32_loss=False) -> Tensor");
  m.def("mine_batch_hard(Tensor embeddings, Tensor labels, float eps, bool count_labels=True) "
        "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fused_triplet, CUDA, m) {
  m.impl("triplet_margin_loss", &fused_triplet::forward_cuda);
  m.impl("triplet_margin_loss_backward", &fused_triplet::backward_cuda);
  m.impl("mined_triplet_loss", &fused_triplet::mined_loss_cuda);
  m.impl("mined_triplet_loss_backward", &fused_triplet::mined_loss_backward_cuda);
}

TORCH_LIBRARY_IMPL(fused_triplet_internal, CUDA, m) {
  m.impl("describe_plans", &fused_triplet::describe_plans);
  m.impl("upstream_history", &fused_triplet::upstream_history);
  m.impl("mine_batch_hard", &fused_triplet::mine_batch_hard_cuda);
}

TORCH_LIBRARY_IMPL(fused_triplet, Autograd, m) {
  m.impl("triplet_margin_loss", &fused_triplet::forward_autograd);
  m.impl("mined_triplet_loss", &fused_triplet::mined_loss_autograd);
}

TORCH_LIBRARY_IMPL(fused_triplet, AutocastCUDA, m) {
  m.impl("triplet_margin_loss", &fused_triplet::forward_autocast);
}
// library-only }
