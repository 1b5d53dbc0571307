// The torch side of fused_triplet: input checks, outputs, the op schemas with their CUDA kernels
// and autograd. Compiled by the host compiler; the kernels sit behind triplet_launch.h.
//
// Autograd is in C++ (registered for the Autograd key) rather than Python: on small inputs a
// Python autograd layer took more host time per training step than the kernels took on the GPU.
// Fake kernels (shapes only, for torch.compile) are registered from fused_triplet.py.
#include "triplet_launch.h"

#include <ATen/core/Tensor.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
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
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>

namespace fused_triplet {
namespace {

// Whether the installed torch's clamp_min passes the gradient at exactly its bound: probed in
// Python when the library loads, set through fused_triplet::set_hinge_at_zero.
std::atomic<bool> hinge_at_zero{false};
// Test-only: the kernel families to launch instead of the plan's (-1: the plan's).
std::atomic<int> forced_forward{-1};
std::atomic<int> forced_backward{-1};

// Where each 'mean' / 'sum' backward notes whether its upstream gradient was exactly 1, for the
// next forward of the same problem to choose one pass (1) or two (0): host memory the GPU writes,
// read without a sync, so late by as many steps as the host runs ahead of the GPU. A slot per
// hash of device, shape, dtype and options; allocated on first use outside a CUDA graph capture.
constexpr int kUpstreamSlots = 256;
std::atomic<int*> upstream_notes{nullptr};         // host view
std::atomic<int*> upstream_notes_device{nullptr};  // the same memory as the GPU addresses it
std::atomic<bool> upstream_notes_failed{false};
std::mutex upstream_notes_mutex;

bool allocate_upstream_notes(cudaStream_t stream) {
  if (upstream_notes.load() != nullptr) return true;
  if (upstream_notes_failed.load()) return false;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess ||
      capture != cudaStreamCaptureStatusNone) {
    (void)cudaGetLastError();
    return false;  // allocating would break the capture: two passes until a call outside one
  }
  const std::lock_guard<std::mutex> lock(upstream_notes_mutex);
  if (upstream_notes.load() != nullptr) return true;
  void* host = nullptr;
  void* device = nullptr;
  if (cudaHostAlloc(&host, kUpstreamSlots * sizeof(int),
                    cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess ||
      cudaHostGetDevicePointer(&device, host, 0) != cudaSuccess) {
    (void)cudaGetLastError();
    upstream_notes_failed.store(true);  // no mapped host memory: always two passes
    return false;
  }
  int* notes = static_cast<int*>(host);
  for (int i = 0; i < kUpstreamSlots; ++i) notes[i] = 1;  // until a backward says otherwise
  upstream_notes_device.store(static_cast<int*>(device));
  upstream_notes.store(notes);
  return true;
}

int upstream_slot(const TripletProblem& pr, int64_t reduction, int device) {
  uint64_t key[9] = {static_cast<uint64_t>(device), static_cast<uint64_t>(pr.rows),
                     static_cast<uint64_t>(pr.dim), static_cast<uint64_t>(pr.dtype),
                     static_cast<uint64_t>(reduction), static_cast<uint64_t>(pr.swap)};
  std::memcpy(&key[6], &pr.margin, 8);
  std::memcpy(&key[7], &pr.p_norm, 8);
  std::memcpy(&key[8], &pr.eps, 8);
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the words
  for (uint64_t k : key) h = (h ^ k) * 1099511628211ull;
  return static_cast<int>(h % kUpstreamSlots);
}

// The device's address of the problem's note, or nullptr ('none', or no notes).
int* upstream_note_for_gpu(const TripletProblem& pr, int64_t reduction, int device,
                           cudaStream_t stream) {
  if (reduction == kNone || !allocate_upstream_notes(stream)) return nullptr;
  return upstream_notes_device.load() + upstream_slot(pr, reduction, device);
}

// What the last backward of this problem noted (true also before any).
bool last_upstream_was_one(const TripletProblem& pr, int64_t reduction, int device,
                           cudaStream_t stream) {
  if (!allocate_upstream_notes(stream)) return false;
  const volatile int* note = upstream_notes.load() + upstream_slot(pr, reduction, device);
  return *note != 0;
}

// The kernels' element type for a tensor dtype; none for every other dtype (float8 types count as
// floating in c10, and the kernels would read them as wider elements).
std::optional<DType> kernel_dtype(at::ScalarType type) {
  switch (type) {
    case at::kHalf: return DType::kHalf;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kFloat: return DType::kFloat;
    case at::kDouble: return DType::kDouble;
    default: return std::nullopt;
  }
}

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
  TORCH_CHECK(kernel_dtype(a.scalar_type()).has_value(),
              "fused_triplet: expected float16, bfloat16, float32 or float64 inputs, got ",
              a.scalar_type());
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


at::ScalarType acc_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

int device_attribute(const at::Tensor& on, cudaDeviceAttr attribute) {
  int value = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attribute, on.get_device()));
  return value;
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
  pr.dtype = *kernel_dtype(a.scalar_type());  // check_inputs took it
  pr.margin = margin;
  pr.p_norm = pnorm;
  pr.eps = eps;
  pr.swap = swap;
  pr.cc_major = device_attribute(a, cudaDevAttrComputeCapabilityMajor);
  pr.smem_per_block = device_attribute(a, cudaDevAttrMaxSharedMemoryPerBlockOptin);
  return pr;
}

// write_grads: the call may take the one-pass family (forcing it applies to such calls only).
LaunchPlan forward_plan(const TripletProblem& pr, bool write_grads) {
  auto family = static_cast<ForwardFamily>(forced_forward.load());
  if (family == ForwardFamily::kOnePass && !write_grads) family = ForwardFamily::kAuto;
  const char* unfit = forward_family_unfit(pr, family);
  TORCH_CHECK(unfit == nullptr, "fused_triplet: the forced forward family cannot run: ", unfit);
  return plan_forward(pr, family, write_grads);
}

LaunchPlan backward_plan(const TripletProblem& pr) {
  const auto family = static_cast<BackwardFamily>(forced_backward.load());
  const char* unfit = backward_family_unfit(pr, family);
  TORCH_CHECK(unfit == nullptr, "fused_triplet: the forced backward family cannot run: ", unfit);
  return plan_backward(pr, family);
}

struct ForwardResult {
  at::Tensor loss, dists;
  std::array<at::Tensor, 3> grads;  // the one pass's gradients (upstream 1), else undefined
};

// The forward. one_pass: under autograd ('mean' / 'sum'), the inputs that require grad; where
// any does and the last backward of this problem saw an upstream gradient of 1 (or the family is
// forced), the plan may take the one-pass family, which also writes their gradients.
ForwardResult run_forward(const at::Tensor& anchor, const at::Tensor& positive,
                          const at::Tensor& negative, double margin, double p, double eps,
                          bool swap, int64_t reduction, std::array<bool, 3> one_pass) {
  check_inputs(anchor, positive, negative, p, reduction);
  const c10::cuda::CUDAGuard guard(anchor.device());
  const auto batch = anchor.sizes().slice(0, anchor.dim() - 1);
  const int64_t dim = anchor.size(-1);
  const int64_t rows = rows_of(anchor);
  const auto opts = anchor.options();
  ForwardResult out;
  out.dists = at::empty({swap ? 3 : 2, rows}, opts.dtype(acc_dtype(anchor)));
  out.loss = reduction == kNone ? at::empty(batch, opts) : at::empty({}, opts);
  if (rows == 0) {  // torch: the mean of nothing is nan, the sum of nothing 0
    if (reduction == kMean) out.loss.fill_(std::numeric_limits<double>::quiet_NaN());
    if (reduction == kSum) out.loss.zero_();
    return out;
  }
  const at::Tensor a = as_rows(anchor, rows, dim);
  const at::Tensor pos = as_rows(positive, rows, dim);
  const at::Tensor neg = as_rows(negative, rows, dim);
  const TripletProblem pr = make_problem(a, pos, neg, margin, p, eps, swap);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  bool write_grads = reduction != kNone && (one_pass[0] || one_pass[1] || one_pass[2]);
  if (write_grads && forced_forward.load() != static_cast<int>(ForwardFamily::kOnePass)) {
    write_grads = last_upstream_was_one(pr, reduction, anchor.get_device(), stream);
  }
  const LaunchPlan plan = forward_plan(pr, write_grads);
  GradOutputs grads{nullptr, nullptr, nullptr, hinge_at_zero.load()};
  if (plan.family == static_cast<int>(ForwardFamily::kOnePass)) {
    void** ptrs[3] = {&grads.grad_a, &grads.grad_p, &grads.grad_n};
    for (int k = 0; k < 3; ++k) {
      if (!one_pass[k]) continue;
      out.grads[k] = at::empty(anchor.sizes(), opts);
      *ptrs[k] = out.grads[k].data_ptr();
    }
  }
  const auto bytes = static_cast<int64_t>(forward_workspace_bytes(pr, plan, reduction));
  at::Tensor workspace = at::empty({bytes}, opts.dtype(at::kByte));
  C10_CUDA_CHECK(launch_forward(pr, plan, reduction, out.loss.data_ptr(), out.dists.data_ptr(),
                                workspace.data_ptr(), grads, stream));
  return out;
}

std::tuple<at::Tensor, at::Tensor> forward_cuda(const at::Tensor& anchor,
                                                const at::Tensor& positive,
                                                const at::Tensor& negative, double margin,
                                                double p, double eps, bool swap,
                                                int64_t reduction) {
  ForwardResult out = run_forward(anchor, positive, negative, margin, p, eps, swap, reduction,
                                  {false, false, false});
  return {out.loss, out.dists};
}

// A backward over the inputs' (rows, dim) views: into `grads` (undefined where not needed), or,
// in_place, the upstream gradient applied to a one-pass forward's gradients there.
void run_backward(const at::Tensor& grad, const at::Tensor& anchor, const at::Tensor& positive,
                  const at::Tensor& negative, const at::Tensor& dists, double margin, double p,
                  double eps, bool swap, int64_t reduction, bool hinge,
                  const std::array<at::Tensor, 3>& grads, bool in_place) {
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
  const at::Tensor a = as_rows(anchor, rows, dim);
  const at::Tensor pos = as_rows(positive, rows, dim);
  const at::Tensor neg = as_rows(negative, rows, dim);
  const at::Tensor g = grad.reshape({-1}).contiguous();
  const at::Tensor d = dists.contiguous();
  const TripletProblem pr = make_problem(a, pos, neg, margin, p, eps, swap);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const BackwardInputs in{g.data_ptr(), d.data_ptr(), hinge,
                          grads[0].defined() ? grads[0].data_ptr() : nullptr,
                          grads[1].defined() ? grads[1].data_ptr() : nullptr,
                          grads[2].defined() ? grads[2].data_ptr() : nullptr,
                          upstream_note_for_gpu(pr, reduction, anchor.get_device(), stream)};
  C10_CUDA_CHECK(in_place ? launch_upstream(pr, reduction, in, stream)
                          : launch_backward(pr, backward_plan(pr), reduction, in, stream));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cuda(
    const at::Tensor& grad, const at::Tensor& anchor, const at::Tensor& positive,
    const at::Tensor& negative, const at::Tensor& dists, double margin, double p, double eps,
    bool swap, int64_t reduction, bool hinge, std::array<bool, 3> output_mask) {
  check_inputs(anchor, positive, negative, p, reduction);
  const c10::cuda::CUDAGuard guard(anchor.device());
  std::array<at::Tensor, 3> out;
  const at::Tensor* inputs[3] = {&anchor, &positive, &negative};
  for (int k = 0; k < 3; ++k) {
    out[k] = output_mask[k] ? at::empty(inputs[k]->sizes(), anchor.options())
                            : at::empty({0}, anchor.options());
  }
  if (rows_of(anchor) == 0 || anchor.size(-1) == 0 ||
      !(output_mask[0] || output_mask[1] || output_mask[2])) {
    return {out[0], out[1], out[2]};
  }
  std::array<at::Tensor, 3> written;
  for (int k = 0; k < 3; ++k) {
    if (output_mask[k]) written[k] = out[k];
  }
  run_backward(grad, anchor, positive, negative, dists, margin, p, eps, swap, reduction, hinge,
               written, /*in_place=*/false);
  return {out[0], out[1], out[2]};
}

// The backward of a one-pass forward: its gradients (upstream 1) times the upstream gradient, in
// place; nothing but a note when that is 1.
void apply_upstream(const at::Tensor& grad, const at::Tensor& anchor, const at::Tensor& positive,
                    const at::Tensor& negative, const at::Tensor& dists, double margin, double p,
                    double eps, bool swap, int64_t reduction,
                    const std::array<at::Tensor, 3>& grads) {
  const c10::cuda::CUDAGuard guard(anchor.device());
  run_backward(grad, anchor, positive, negative, dists, margin, p, eps, swap, reduction,
               hinge_at_zero.load(), grads, /*in_place=*/true);
}

// Tensors the one pass may take directly: real CUDA tensors with no Python dispatch in the way
// (fake and functional tensors under torch.compile, subclasses, dispatch modes take the op).
bool plain_cuda(const at::Tensor& x) {
  constexpr c10::DispatchKeySet kWrapped({c10::DispatchKey::Python,
                                          c10::DispatchKey::Functionalize});
  return x.is_cuda() && !x.key_set().has_any(kWrapped);
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
                                                int64_t reduction, bool one_pass) {
    at::Tensor loss, dists;
    if (one_pass) {  // the kernels directly: only they can hand back the gradients
      ForwardResult out = run_forward(
          anchor, positive, negative, margin, p, eps, swap, reduction,
          {anchor.requires_grad(), positive.requires_grad(), negative.requires_grad()});
      loss = out.loss;
      dists = out.dists;
      // Kept outside the saved variables, and dropped by the backward that returns them, so
      // that autograd can take them as .grad without a copy.
      const char* names[3] = {"grad_a", "grad_p", "grad_n"};
      for (int k = 0; k < 3; ++k) {
        if (out.grads[k].defined()) ctx->saved_data[names[k]] = out.grads[k];
      }
    } else {
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
    torch::autograd::variable_list out(9);  // a, p, n; the six options get none
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
    // The one pass's gradients, taken out (a second backward, retain_graph=True, takes two).
    std::array<at::Tensor, 3> held;
    const char* names[3] = {"grad_a", "grad_p", "grad_n"};
    for (int k = 0; k < 3; ++k) {
      const auto it = ctx->saved_data.find(names[k]);
      if (it == ctx->saved_data.end()) continue;
      held[k] = it->second.toTensor();
      ctx->saved_data.erase(it);
    }
    const bool one_pass = held[0].defined() || held[1].defined() || held[2].defined();
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
    if (one_pass) {
      for (int k = 0; k < 3; ++k) {
        if (!needed[k]) held[k] = at::Tensor();
      }
      apply_upstream(grad_loss, saved[0], saved[1], saved[2], saved[3], margin, p, eps, swap,
                     reduction, held);
      for (int k = 0; k < 3; ++k) out[k] = held[k];
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
  // One pass possible: gradients will be wanted ('mean' / 'sum', autograd recording) and the
  // tensors are plain CUDA ones with no dispatch mode to see the op.
  const bool one_pass =
      reduction != kNone && at::GradMode::is_enabled() &&
      (anchor.requires_grad() || positive.requires_grad() || negative.requires_grad()) &&
      plain_cuda(anchor) && plain_cuda(positive) && plain_cuda(negative) &&
      c10::impl::TorchDispatchModeTLS::stack_len() == 0;
  auto out = TripletMarginLossFunction::apply(anchor, positive, negative, margin, p, eps, swap,
                                              reduction, one_pass);
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
  return "forward " + describe_plan(forward_plan(pr, false), true) + "; training " +
         describe_plan(forward_plan(pr, true), true) + "; backward " +
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
  // Tests: launch these kernel families (forward 0 rows, 1 ring, 2 one pass (training calls,
  // whatever the last upstream gradient); backward 0 rows, 1 pointwise; -1 the plan's), and
  // describe what the plans pick (forward, training forward if gradients wanted, backward).
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
