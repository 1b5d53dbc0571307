// The launch API between the torch-facing C++ (triplet_ops.cpp, compiled by the host compiler)
// and the CUDA kernels (triplet_kernels.cu, compiled by nvcc): plain structs and functions, no
// torch headers, so nvcc never parses them.
#ifndef FUSED_TRIPLET_LAUNCH_H
#define FUSED_TRIPLET_LAUNCH_H

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace fused_triplet {

enum class DType : int { kHalf = 0, kBFloat16 = 1, kFloat = 2, kDouble = 3 };
enum Reduction : int64_t { kNone = 0, kMean = 1, kSum = 2 };  // at::Reduction's values

// The kernel families; kAuto lets the plan choose (tests force the others). kOnePass also
// writes the gradients (training); the plan takes it only when asked for gradients.
enum class ForwardFamily : int { kAuto = -1, kRows = 0, kRing = 1, kOnePass = 2 };
enum class BackwardFamily : int { kAuto = -1, kRows = 0, kPointwise = 1 };

// The three inputs as (rows, dim) arrays with unit element stride, and the loss options.
struct TripletProblem {
  const void* a;
  const void* p;
  const void* n;
  int64_t stride_a, stride_p, stride_n;  // row strides in elements (0: a broadcast row)
  int64_t rows, dim;
  DType dtype;
  double margin, p_norm, eps;
  bool swap;
  int cc_major;         // compute capability of the device the inputs are on
  int smem_per_block;   // shared memory a block may take there (bytes, opting in)
};

// What to launch. Every field follows from the problem in plan_forward / plan_backward.
struct LaunchPlan {
  int family;               // ForwardFamily or BackwardFamily, as int
  bool vectorized;          // 16-byte loads: every row start (and gradient row) aligned
  int threads_per_row;      // team of consecutive threads on one row (8, 32 or 256)
  int64_t splits;           // column slices per row, one unit each (1: whole rows)
  int64_t split_elems;      // elements per slice (a multiple of 16 bytes)
  int ring_chunk_bytes;     // ring: bytes of each input per stage (0: not a ring)
  int64_t units;            // row groups of kBlockThreads / threads_per_row rows, times splits
  int64_t grid;             // blocks of the main kernel (block b takes units b, b + grid, ...)
  const char* reason;       // the table entry that decided the family
};

LaunchPlan plan_forward(const TripletProblem& problem, ForwardFamily forced, bool write_grads);
LaunchPlan plan_backward(const TripletProblem& problem, BackwardFamily forced);
// Why `forced` cannot take the problem, or nullptr if it can.
const char* forward_family_unfit(const TripletProblem& problem, ForwardFamily family);
const char* backward_family_unfit(const TripletProblem& problem, BackwardFamily family);
std::string describe_plan(const LaunchPlan& plan, bool forward);

// Bytes of scratch the forward needs (block sums or slice partials).
size_t forward_workspace_bytes(const TripletProblem& problem, const LaunchPlan& plan,
                               int64_t reduction);

// The one-pass forward's gradients: contiguous (rows, dim), or nullptr where not needed.
// hinge_at_zero: whether clamp_min passes the gradient at exactly 0 (the installed torch's).
struct GradOutputs {
  void* grad_a;
  void* grad_p;
  void* grad_n;
  bool hinge_at_zero;
};

// loss: [rows] ('none') or one value, in the input dtype; dists: [2 or 3, rows] in the
// accumulation dtype (float, double for double inputs); grads: the one-pass plan's (else
// unused). Returns the first launch error.
cudaError_t launch_forward(const TripletProblem& problem, const LaunchPlan& plan,
                           int64_t reduction, void* loss, void* dists, void* workspace,
                           const GradOutputs& grads, cudaStream_t stream);

// What a backward reads and writes. grad: the upstream gradient, [rows] ('none') or one value
// in the input dtype; dists: the forward's; grad_a/p/n: contiguous (rows, dim), or nullptr
// where not needed; upstream_flag: host-mapped memory where a 'mean' / 'sum' backward notes
// whether its upstream gradient was exactly 1, or nullptr.
struct BackwardInputs {
  const void* grad;
  const void* dists;
  bool hinge_at_zero;
  void* grad_a;
  void* grad_p;
  void* grad_n;
  int* upstream_flag;
};

cudaError_t launch_backward(const TripletProblem& problem, const LaunchPlan& plan,
                            int64_t reduction, const BackwardInputs& in, cudaStream_t stream);

// The backward of a one-pass forward: grad_a/p/n hold its gradients and get the upstream
// gradient in place.
cudaError_t launch_upstream(const TripletProblem& problem, int64_t reduction,
                            const BackwardInputs& in, cudaStream_t stream);

}  // namespace fused_triplet

#endif  // FUSED_TRIPLET_LAUNCH_H
