// The torch side of fused_triplet: input checks, outputs, the ops' CUDA kernels, autograd and
// autocast (registration.cpp registers them). Compiled by the host compiler; the kernels sit
// behind triplet_launch.h.
//
// Autograd is in C++ (registered for the Autograd key) rather than Python: on small inputs a
// Python autograd layer took more host time per training step than the kernels took on the GPU.
// Fake kernels (shapes only, for torch.compile) are registered from fused_triplet.py. The
// KernelBench file leaves this file out (fused_triplet.export): its forward goes through
// kernelbench_entry.cu's C function, so its build compiles no torch headers.
// library-only {
#include "check_text.h"
#include "device_facts.h"
#include "triplet_launch.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <cmath>
#include <limits>
#include <mutex>
#include <optional>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/triplet_margin_loss.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <unordered_map>

namespace fused_triplet {

// The kernels' element type for a tensor dtype (the mining ops' too); none for every other dtype
// (float8 types count as floating in c10, and the kernels would read them as wider elements).
std::optional<DType> kernel_dtype(at::ScalarType type) {
  switch (type) {
    case at::kHalf: return DType::kHalf;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kFloat: return DType::kFloat;
    case at::kDouble: return DType::kDouble;
    default: return std::nullopt;
  }
}

namespace {

// Whether the installed torch's clamp_min passes the gradient at exactly its bound: probed in
// Python when the library loads, set through fused_triplet_internal::set_hinge_at_zero.
std::atomic<bool> hinge_at_zero{false};

// ---- inputs ----------------------------------------------------------------------------------

bool two_byte(at::ScalarType type) { return type == at::kHalf || type == at::kBFloat16; }

// The loss's dtype: the inputs', or float32 for 2-byte inputs with float32_loss (autocast's
// float32 policy; float64 stays float64 there too).
at::ScalarType loss_dtype(at::ScalarType input, bool float32_loss) {
  return float32_loss && two_byte(input) ? at::kFloat : input;
}

at::ScalarType acc_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

void check_inputs(const at::Tensor& a, const at::Tensor& p, const at::Tensor& n, double pnorm,
                  int64_t reduction) {
  TORCH_CHECK(reduction >= kNone && reduction <= kSum, "fused_triplet: unknown reduction ",
              std::to_string(reduction));
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
              "them first), got ", shape_text(a), ", ", shape_text(p), ", ", shape_text(n));
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

// The problem as the kernels see it; a, p, n are the (rows, dim) views, which must outlive it.
TripletProblem make_problem(const at::Tensor& a, const at::Tensor& p, const at::Tensor& n,
                            double margin, double pnorm, double eps, bool swap, int64_t reduction,
                            bool float32_loss) {
  TripletProblem pr{};
  pr.a = a.data_ptr();
  pr.p = p.data_ptr();
  pr.n = n.data_ptr();
  pr.stride_a = a.stride(0);
  pr.stride_p = p.stride(0);
  pr.stride_n = n.stride(0);
  pr.rows = a.size(0);
  pr.dim = a.size(1);
  pr.dtype = *kernel_dtype(a.scalar_type());  // check_inputs took it
  pr.float32_loss = float32_loss && two_byte(a.scalar_type());
  pr.margin = margin;
  pr.p_norm = pnorm;
  pr.eps = eps;
  pr.swap = swap;
  pr.reduction = reduction;
  const DeviceFacts facts = device_facts(a.get_device());
  pr.cc_major = facts.cc_major;
  pr.sm_count = facts.sm_count;
  pr.smem_per_block = facts.smem_per_block;
  return pr;
}

LaunchPlan forward_plan(const TripletProblem& pr, int64_t family, bool write_grads) {
  const LaunchPlan plan = plan_forward(pr, static_cast<ForwardFamily>(family), write_grads);
  TORCH_CHECK(plan.unfit == nullptr, "fused_triplet: the asked-for forward family cannot run: ",
              plan.unfit);
  return plan;
}

LaunchPlan backward_plan(const TripletProblem& pr, int64_t family, bool after_one_pass) {
  const LaunchPlan plan = plan_backward(pr, static_cast<BackwardFamily>(family), after_one_pass);
  TORCH_CHECK(plan.unfit == nullptr, "fused_triplet: the asked-for backward family cannot run: ",
              plan.unfit);
  return plan;
}

// ---- what the one pass predicts from -----------------------------------------------------------
// For each problem (an exact key: device, shape, dtype and options) and place in a training step
// (the first forward of the problem after one of its backwards takes place 0, the next place 1,
// ...: `l1 + 0.5 * l2` of one shape gets two), device memory with the upstream gradient the last
// one-pass backward saw there (UpstreamHistory). The forward reads it on the GPU, the backward
// checks the prediction on the GPU: no host sync, and a wrong prediction costs only time.

constexpr int kPlacesPerStep = 8;      // losses of one problem per step that get a prediction
constexpr size_t kMaxProblems = 4096;  // problems kept (each holds 64 bytes on the GPU); then anew

// A problem: device, rows, dim, dtype, float32_loss, swap, reduction and the bits of margin, p
// and eps.
using ProblemKey = std::array<int64_t, 10>;

struct ProblemKeyHash {
  size_t operator()(const ProblemKey& k) const {
    size_t h = 0;
    for (int64_t w : k) h = h * 1000003u ^ std::hash<int64_t>{}(w);
    return h;
  }
};

ProblemKey key_of(const TripletProblem& pr, int device) {
  ProblemKey k{device, pr.rows, pr.dim, static_cast<int64_t>(pr.dtype), pr.float32_loss, pr.swap,
               pr.reduction, 0, 0, 0};
  std::memcpy(&k[7], &pr.margin, 8);
  std::memcpy(&k[8], &pr.p_norm, 8);
  std::memcpy(&k[9], &pr.eps, 8);
  return k;
}

// A problem's histories (kPlacesPerStep UpstreamHistory on its device) and the place of its next
// forward. The map and the autograd nodes of its training forwards share it (a capsule in the
// node), so dropping it from the map frees nothing a node still reads.
struct StepPlaces : torch::CustomClassHolder {
  explicit StepPlaces(at::Tensor h) : histories(std::move(h)) {}
  at::Tensor histories;
  int next = 0;
};

std::mutex places_mutex;
// Emptied by release_step_state, which the Python side calls at exit: a static destructor could
// run after CUDA is torn down, so the map itself is never destroyed.
auto* const step_places =
    new std::unordered_map<ProblemKey, c10::intrusive_ptr<StepPlaces>, ProblemKeyHash>();

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(stream, &status);
  if (err != cudaSuccess) (void)cudaGetLastError();
  return err != cudaSuccess || status != cudaStreamCaptureStatusNone;
}

// A training forward's place in its problem's step (forwards past the last place share it:
// gradcheck's, or a loss never differentiated, predict no worse than two passes).
struct StepPlace {
  c10::intrusive_ptr<StepPlaces> places;  // null: no place
  int index = 0;
  UpstreamHistory* history() const {
    return places ? static_cast<UpstreamHistory*>(places->histories.data_ptr()) + index : nullptr;
  }
};

// The next place of a problem's step. A problem's histories are made on first use (not during a
// CUDA graph capture, where copying the initial history would break it: no place then).
StepPlace take_place(const ProblemKey& key, const at::Tensor& on, cudaStream_t stream) {
  const std::lock_guard<std::mutex> lock(places_mutex);
  auto it = step_places->find(key);
  if (it == step_places->end()) {
    if (capturing(stream)) return {};
    if (step_places->size() >= kMaxProblems) step_places->clear();
    // Until a backward says otherwise, each place predicts an upstream gradient of 1.
    std::array<UpstreamHistory, kPlacesPerStep> initial;
    initial.fill(UpstreamHistory{1.0f, 1u});
    const at::Tensor host = at::from_blob(initial.data(), {kPlacesPerStep * 2},
                                          at::TensorOptions().dtype(at::kInt));
    it = step_places->emplace(key, c10::make_intrusive<StepPlaces>(host.to(on.device()))).first;
  }
  StepPlaces& places = *it->second;
  const int index = std::min(places.next, kPlacesPerStep - 1);
  places.next = index + 1;
  return {it->second, index};
}

// A backward of the problem: its next forward begins a step.
void end_step(StepPlaces& places) {
  const std::lock_guard<std::mutex> lock(places_mutex);
  places.next = 0;
}

// ---- forward -----------------------------------------------------------------------------------

struct ForwardResult {
  at::Tensor loss, dists;
  StepPlace place;                    // a training forward's place (its backward ends the step)
  bool one_pass = false;              // the one-pass kernel ran:
  std::array<at::Tensor, 3> grads;    // its gradients (undefined where not wanted),
  at::Tensor predicted;               // per row the upstream gradient they assume (the backward
                                      // updates the place's history)
};

// The forward. wants: under autograd, the inputs that require grad (a training forward); where
// any does ('mean' / 'sum') and the problem's step has a place left, the plan may take the
// one-pass family, which also writes their gradients.
ForwardResult run_forward(const at::Tensor& anchor, const at::Tensor& positive,
                          const at::Tensor& negative, double margin, double p, double eps,
                          bool swap, int64_t reduction, bool float32_loss, int64_t family,
                          std::array<bool, 3> wants) {
  check_inputs(anchor, positive, negative, p, reduction);
  const c10::cuda::CUDAGuard guard(anchor.device());
  const auto batch = anchor.sizes().slice(0, anchor.dim() - 1);
  const int64_t dim = anchor.size(-1);
  const int64_t rows = rows_of(anchor);
  const auto opts = anchor.options();
  const auto loss_opts = opts.dtype(loss_dtype(anchor.scalar_type(), float32_loss));
  ForwardResult out;
  out.dists = at::empty({swap ? 3 : 2, rows}, opts.dtype(acc_dtype(anchor)));
  out.loss = reduction == kNone ? at::empty(batch, loss_opts) : at::empty({}, loss_opts);
  if (rows == 0) {  // torch: the mean of nothing is nan, the sum of nothing 0
    if (reduction == kMean) out.loss.fill_(std::numeric_limits<double>::quiet_NaN());
    if (reduction == kSum) out.loss.zero_();
    return out;
  }
  const at::Tensor a = as_rows(anchor, rows, dim);
  const at::Tensor pos = as_rows(positive, rows, dim);
  const at::Tensor neg = as_rows(negative, rows, dim);
  const TripletProblem pr = make_problem(a, pos, neg, margin, p, eps, swap, reduction,
                                         float32_loss);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // 'none' takes no place: its upstream gradient is per row, nothing to predict
  if ((wants[0] || wants[1] || wants[2]) && reduction != kNone) {
    out.place = take_place(key_of(pr, anchor.get_device()), anchor, stream);
  }
  const LaunchPlan plan = forward_plan(pr, family, out.place.places.defined());
  OnePassOutputs one_pass{nullptr, nullptr, nullptr, hinge_at_zero.load(), out.place.history(),
                          nullptr};
  if (plan.family == static_cast<int>(ForwardFamily::kOnePass)) {
    out.one_pass = true;
    void** ptrs[3] = {&one_pass.grad_a, &one_pass.grad_p, &one_pass.grad_n};
    for (int k = 0; k < 3; ++k) {
      if (!wants[k]) continue;
      out.grads[k] = at::empty(anchor.sizes(), opts);
      *ptrs[k] = out.grads[k].data_ptr();
    }
    out.predicted = at::empty({rows}, opts.dtype(at::kFloat));
    one_pass.predicted = out.predicted.data_ptr<float>();
  }
  at::Tensor workspace =
      at::empty({static_cast<int64_t>(plan.workspace_bytes)}, opts.dtype(at::kByte));
  C10_CUDA_CHECK(launch_forward(pr, plan, out.loss.data_ptr(), out.dists.data_ptr(),
                                workspace.data_ptr(), one_pass, stream));
  return out;
}

std::tuple<at::Tensor, at::Tensor> forward_cuda(const at::Tensor& anchor,
                                                const at::Tensor& positive,
                                                const at::Tensor& negative, double margin,
                                                double p, double eps, bool swap,
                                                int64_t reduction, bool float32_loss,
                                                int64_t forward_family, int64_t backward_family) {
  (void)backward_family;  // its backward's (the autograd kernel keeps it)
  ForwardResult out = run_forward(anchor, positive, negative, margin, p, eps, swap, reduction,
                                  float32_loss, forward_family, {false, false, false});
  return {out.loss, out.dists};
}

// ---- backward ----------------------------------------------------------------------------------

// A backward over the inputs' (rows, dim) views into `grads` (undefined where not needed). After
// a one-pass forward (predicted defined), they hold its gradients, which the check keeps where
// its prediction was right.
void run_backward(const at::Tensor& grad, const at::Tensor& anchor, const at::Tensor& positive,
                  const at::Tensor& negative, const at::Tensor& dists, double margin, double p,
                  double eps, bool swap, int64_t reduction, bool hinge, int64_t family,
                  const std::array<at::Tensor, 3>& grads, const at::Tensor& predicted,
                  UpstreamHistory* history) {
  const int64_t dim = anchor.size(-1);
  const int64_t rows = rows_of(anchor);
  TORCH_CHECK(dists.is_cuda() && dists.device() == anchor.device() &&
                  dists.scalar_type() == acc_dtype(anchor) && dists.dim() == 2 &&
                  dists.size(0) == (swap ? 3 : 2) && dists.size(1) == rows,
              "fused_triplet: dists must be the forward's [", swap ? "3" : "2", ", ",
              std::to_string(rows), "] ",
              acc_dtype(anchor), " tensor on ", anchor.device());
  // The loss's dtype: the inputs', or float32 for 2-byte inputs under autocast.
  const bool float32_loss = two_byte(anchor.scalar_type()) && grad.scalar_type() == at::kFloat;
  TORCH_CHECK(grad.device() == anchor.device() &&
                  (grad.scalar_type() == anchor.scalar_type() || float32_loss) &&
                  grad.numel() == (reduction == kNone ? rows : 1),
              "fused_triplet: the upstream gradient must be ",
              std::to_string(reduction == kNone ? rows : 1),
              " values of the loss's dtype (", anchor.scalar_type(),
              two_byte(anchor.scalar_type()) ? " or float32" : "", ") on ", anchor.device());
  if (rows == 0 || dim == 0) return;
  const c10::cuda::CUDAGuard guard(anchor.device());
  const at::Tensor a = as_rows(anchor, rows, dim);
  const at::Tensor pos = as_rows(positive, rows, dim);
  const at::Tensor neg = as_rows(negative, rows, dim);
  const at::Tensor g = grad.reshape({-1}).contiguous();
  const at::Tensor d = dists.contiguous();
  const TripletProblem pr = make_problem(a, pos, neg, margin, p, eps, swap, reduction,
                                         float32_loss);
  const LaunchPlan plan = backward_plan(pr, family, predicted.defined());
  const BackwardInputs in{g.data_ptr(), d.data_ptr(), hinge,
                          grads[0].defined() ? grads[0].data_ptr() : nullptr,
                          grads[1].defined() ? grads[1].data_ptr() : nullptr,
                          grads[2].defined() ? grads[2].data_ptr() : nullptr,
                          predicted.defined() ? predicted.data_ptr<float>() : nullptr, history};
  C10_CUDA_CHECK(launch_backward(pr, plan, in, c10::cuda::getCurrentCUDAStream()));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cuda(
    const at::Tensor& grad, const at::Tensor& anchor, const at::Tensor& positive,
    const at::Tensor& negative, const at::Tensor& dists, double margin, double p, double eps,
    bool swap, int64_t reduction, bool hinge, std::array<bool, 3> output_mask, int64_t family) {
  check_inputs(anchor, positive, negative, p, reduction);
  const c10::cuda::CUDAGuard guard(anchor.device());
  std::array<at::Tensor, 3> out;
  const at::Tensor* inputs[3] = {&anchor, &positive, &negative};
  for (int k = 0; k < 3; ++k) {
    out[k] = output_mask[k] ? at::empty(inputs[k]->sizes(), anchor.options())
                            : at::empty({0}, anchor.options());
  }
  if (!(output_mask[0] || output_mask[1] || output_mask[2])) return {out[0], out[1], out[2]};
  std::array<at::Tensor, 3> written;
  for (int k = 0; k < 3; ++k) {
    if (output_mask[k]) written[k] = out[k];
  }
  run_backward(grad, anchor, positive, negative, dists, margin, p, eps, swap, reduction, hinge,
               family, written, at::Tensor(), nullptr);
  return {out[0], out[1], out[2]};
}

// ---- autograd ----------------------------------------------------------------------------------

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
                                                    bool, int64_t, bool, int64_t, int64_t)>();
  return op;
}

const auto& backward_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fused_triplet::triplet_margin_loss_backward", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const at::Tensor&, double, double, double, bool, int64_t, bool,
              std::array<bool, 3>, int64_t)>();
  return op;
}

const char* kHeldGrads[3] = {"grad_a", "grad_p", "grad_n"};

class TripletMarginLossFunction : public torch::autograd::Function<TripletMarginLossFunction> {
 public:
  // one_pass: the kernels may run directly (only they can hand back the gradients).
  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx, const at::Tensor& anchor, const at::Tensor& positive,
      const at::Tensor& negative, double margin, double p, double eps, bool swap,
      int64_t reduction, bool float32_loss, int64_t forward_family, int64_t backward_family,
      bool one_pass) {
    at::Tensor loss, dists;
    if (one_pass) {
      ForwardResult out = run_forward(
          anchor, positive, negative, margin, p, eps, swap, reduction, float32_loss,
          forward_family,
          {anchor.requires_grad(), positive.requires_grad(), negative.requires_grad()});
      loss = out.loss;
      dists = out.dists;
      if (out.place.places) {
        ctx->saved_data["places"] = c10::IValue::make_capsule(out.place.places);
        ctx->saved_data["place"] = int64_t(out.place.index);
      }
      if (out.one_pass) {
        // Kept outside the saved variables, and dropped by the backward that returns them, so
        // that autograd can take them as .grad without a copy.
        for (int k = 0; k < 3; ++k) {
          if (out.grads[k].defined()) ctx->saved_data[kHeldGrads[k]] = out.grads[k];
        }
        ctx->saved_data["predicted"] = out.predicted;
      }
    } else {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(loss, dists) = forward_op().call(anchor, positive, negative, margin, p, eps, swap,
                                                reduction, float32_loss, forward_family,
                                                backward_family);
    }
    ctx->save_for_backward({anchor, positive, negative, dists});
    ctx->saved_data["margin"] = margin;
    ctx->saved_data["p"] = p;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["swap"] = swap;
    ctx->saved_data["reduction"] = reduction;
    ctx->saved_data["backward_family"] = backward_family;
    ctx->mark_non_differentiable({dists});
    // dists never gets a gradient: without this, autograd fills a zero one for it on every
    // backward (a kernel launch).
    ctx->set_materialize_grads(false);
    return {loss, dists};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    torch::autograd::variable_list out(12);  // a, p, n; the nine options get none
    const at::Tensor& grad_loss = grads[0];
    StepPlace place;
    if (const auto it = ctx->saved_data.find("places"); it != ctx->saved_data.end()) {
      place = {c10::static_intrusive_pointer_cast<StepPlaces>(it->second.toCapsule()),
               static_cast<int>(ctx->saved_data["place"].toInt())};
      end_step(*place.places);
    }
    if (!grad_loss.defined()) return out;
    const auto saved = ctx->get_saved_variables();
    const double margin = ctx->saved_data["margin"].toDouble();
    const double p = ctx->saved_data["p"].toDouble();
    const double eps = ctx->saved_data["eps"].toDouble();
    const bool swap = ctx->saved_data["swap"].toBool();
    const int64_t reduction = ctx->saved_data["reduction"].toInt();
    const int64_t family = ctx->saved_data["backward_family"].toInt();
    const std::array<bool, 3> needed = {ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                        ctx->needs_input_grad(2)};
    // The one pass's gradients, taken out (a second backward, retain_graph=True, takes two).
    std::array<at::Tensor, 3> held;
    for (int k = 0; k < 3; ++k) {
      const auto it = ctx->saved_data.find(kHeldGrads[k]);
      if (it == ctx->saved_data.end()) continue;
      if (needed[k]) held[k] = it->second.toTensor();
      ctx->saved_data.erase(it);
    }
    at::Tensor predicted;
    if (const auto it = ctx->saved_data.find("predicted"); it != ctx->saved_data.end()) {
      predicted = it->second.toTensor();
      ctx->saved_data.erase(it);
    }
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
    if (predicted.defined()) {  // after the one pass: check its gradients, in place
      run_backward(grad_loss, saved[0], saved[1], saved[2], saved[3], margin, p, eps, swap,
                   reduction, hinge_at_zero.load(), family, held, predicted, place.history());
      for (int k = 0; k < 3; ++k) out[k] = held[k];
      return out;
    }
    const auto [ga, gp, gn] =
        backward_op().call(grad_loss, saved[0], saved[1], saved[2], saved[3], margin, p, eps,
                           swap, reduction, hinge_at_zero.load(), needed, family);
    if (needed[0]) out[0] = ga;
    if (needed[1]) out[1] = gp;
    if (needed[2]) out[2] = gn;
    return out;
  }
};

std::tuple<at::Tensor, at::Tensor> forward_autograd(
    const at::Tensor& anchor, const at::Tensor& positive, const at::Tensor& negative,
    double margin, double p, double eps, bool swap, int64_t reduction, bool float32_loss,
    int64_t forward_family, int64_t backward_family) {
  // One pass possible: gradients will be wanted ('mean' / 'sum', autograd recording) and the
  // tensors are plain CUDA ones with no dispatch mode to see the op.
  const bool one_pass =
      reduction != kNone && at::GradMode::is_enabled() &&
      (anchor.requires_grad() || positive.requires_grad() || negative.requires_grad()) &&
      plain_cuda(anchor) && plain_cuda(positive) && plain_cuda(negative) &&
      c10::impl::TorchDispatchModeTLS::stack_len() == 0;
  auto out = TripletMarginLossFunction::apply(anchor, positive, negative, margin, p, eps, swap,
                                              reduction, float32_loss, forward_family,
                                              backward_family, one_pass);
  return {out[0], out[1]};
}

// ---- autocast ----------------------------------------------------------------------------------

// torch's CUDA autocast runs triplet_margin_loss in float32 (its float32 list). 2-byte inputs of
// one dtype are read as they are, for a float32 loss (the cast is exact); anything else goes on
// as it came (mixed dtypes are promoted by the caller, float32 and float64 keep theirs).
std::tuple<at::Tensor, at::Tensor> forward_autocast(
    const at::Tensor& anchor, const at::Tensor& positive, const at::Tensor& negative,
    double margin, double p, double eps, bool swap, int64_t reduction, bool float32_loss,
    int64_t forward_family, int64_t backward_family) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCUDA);
  const bool one_two_byte_dtype = two_byte(anchor.scalar_type()) &&
                                  positive.scalar_type() == anchor.scalar_type() &&
                                  negative.scalar_type() == anchor.scalar_type();
  return forward_op().call(anchor, positive, negative, margin, p, eps, swap, reduction,
                           float32_loss || one_two_byte_dtype, forward_family, backward_family);
}


// ---- the library's plumbing and the tests' view -------------------------------------------------

void set_hinge_at_zero(bool value) { hinge_at_zero.store(value); }

// Every problem's histories freed (autograd nodes still holding one keep it).
void release_step_state() {
  const std::lock_guard<std::mutex> lock(places_mutex);
  step_places->clear();
}

// Which kernels the ops would launch for these inputs (already broadcast to one shape), with the
// families asked for: "forward ...; training ...; backward ...; training backward ..." (a one
// pass asked for applies to the training forward).
std::string describe_plans(const at::Tensor& anchor, const at::Tensor& positive,
                           const at::Tensor& negative, double p, bool swap,
                           int64_t forward_family, int64_t backward_family) {
  check_inputs(anchor, positive, negative, p, kMean);
  const c10::cuda::CUDAGuard guard(anchor.device());
  const int64_t rows = rows_of(anchor), dim = anchor.size(-1);
  const at::Tensor a = as_rows(anchor, rows, dim);
  const at::Tensor pos = as_rows(positive, rows, dim);
  const at::Tensor neg = as_rows(negative, rows, dim);
  const TripletProblem pr = make_problem(a, pos, neg, 1.0, p, 1e-6, swap, kMean, false);
  const LaunchPlan training = forward_plan(pr, forward_family, true);
  const bool after_one_pass = training.family == static_cast<int>(ForwardFamily::kOnePass);
  const int64_t plain = after_one_pass ? static_cast<int64_t>(ForwardFamily::kAuto)
                                       : forward_family;
  return "forward " + describe_plan(forward_plan(pr, plain, false), true) +
         "; training " + describe_plan(training, true) + "; backward " +
         describe_plan(backward_plan(pr, backward_family, false), false) +
         "; training backward " +
         describe_plan(backward_plan(pr, backward_family, after_one_pass), false);
}

// The histories of a problem's places as int32 pairs (float bits of the last upstream gradient,
// whether it repeated), a copy; empty before its first training forward.
at::Tensor upstream_history(const at::Tensor& anchor, const at::Tensor& positive,
                            const at::Tensor& negative, double margin, double p, double eps,
                            bool swap, int64_t reduction, bool float32_loss) {
  check_inputs(anchor, positive, negative, p, reduction);
  const c10::cuda::CUDAGuard guard(anchor.device());
  const int64_t rows = rows_of(anchor), dim = anchor.size(-1);
  const at::Tensor a = as_rows(anchor, rows, dim);
  const ProblemKey key = key_of(
      make_problem(a, a, a, margin, p, eps, swap, reduction, float32_loss), anchor.get_device());
  const std::lock_guard<std::mutex> lock(places_mutex);
  const auto it = step_places->find(key);
  if (it == step_places->end()) return at::empty({0, 2}, anchor.options().dtype(at::kInt));
  return it->second->histories.view({kPlacesPerStep, 2}).clone();
}

}  // namespace

bool hinge_passes_at_zero() { return hinge_at_zero.load(); }  // the mining backward's too

}  // namespace fused_triplet
// library-only }
