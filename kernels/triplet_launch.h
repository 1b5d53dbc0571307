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

// The kernel families; kAuto lets the plan choose (tests ask for the others per call). kOnePass
// also writes the gradients (training); the plan takes it only when asked for gradients, and
// its backward is kCheck (which the plan takes only after a one-pass forward).
enum class ForwardFamily : int { kAuto = -1, kRows = 0, kRing = 1, kOnePass = 2 };
enum class BackwardFamily : int { kAuto = -1, kRows = 0, kPointwise = 1, kCheck = 2 };

// The three inputs as (rows, dim) arrays with unit element stride, and the loss options.
struct TripletProblem {
  const void* a;
  const void* p;
  const void* n;
  int64_t stride_a, stride_p, stride_n;  // row strides in elements (0: a broadcast row)
  int64_t rows, dim;
  DType dtype;
  bool float32_loss;  // 2-byte inputs with a float32 loss and upstream gradient (autocast)
  double margin, p_norm, eps;
  bool swap;
  int64_t reduction;
  int cc_major;        // compute capability of the device the inputs are on
  int sm_count;        // its multiprocessors
  int smem_per_block;  // shared memory a block may take there (bytes, opting in)
};

// What to launch: every choice, made in plan_forward / plan_backward; the launchers only
// execute it.
struct LaunchPlan {
  int family;               // ForwardFamily or BackwardFamily, as int
  const char* unfit;        // why the asked-for family cannot take the problem (else nullptr)
  const char* reason;       // the table entry that decided the family
  bool vectorized;          // 16-byte loads: every row start (and gradient row) aligned
  int threads_per_row;      // team of consecutive threads on one row (8, 32 or the block)
  int compiled_team;        // the team size compiled into the rows kernel (8, 32; 0: at run time)
  bool ring_tiles;          // ring: each stage one 2-D tile of each input (else whole-row copies)
  int64_t splits;           // column slices per row, one unit each (1: whole rows)
  int64_t split_elems;      // elements per slice (a multiple of 16 bytes)
  int ring_chunk_bytes;     // ring: bytes of each input per stage (0: not a ring)
  int packs_per_thread;     // one pass: packs of each input a thread holds
  int64_t units;            // row groups of block / threads_per_row rows, times splits
  int block;                // threads per block of the main kernel
  int64_t grid;             // its blocks (block b takes units b, b + grid, ...)
  int smem_bytes;           // its dynamic shared memory
  bool finish;              // a one-block finishing kernel follows (split rows, 'mean' / 'sum')
  bool chained;             // ... launched as the main grid's programmatic dependent (sm_90)
  size_t workspace_bytes;   // scratch of the forward: block sums or slice partials
};

// The plans. forward: `family` asked for (kAuto: the plan's choice), `write_grads`: under
// autograd, gradients wanted ('mean' / 'sum'): the one pass may run. backward: after a one-pass
// forward, or not.
LaunchPlan plan_forward(const TripletProblem& problem, ForwardFamily family, bool write_grads);
LaunchPlan plan_backward(const TripletProblem& problem, BackwardFamily family,
                         bool after_one_pass);
std::string describe_plan(const LaunchPlan& plan, bool forward);

// What the one pass predicts from, per problem and place in a step: the upstream gradient the
// last one-pass backward saw and whether it equalled the one before. 8 bytes of device memory,
// read and written whole.
struct alignas(8) UpstreamHistory {
  float last;
  uint32_t repeated;
};

// The one-pass forward's outputs beyond the loss: its gradients, contiguous (rows, dim), or
// nullptr where not needed; per row the upstream gradient they assume (NaN: none written).
struct OnePassOutputs {
  void* grad_a;
  void* grad_p;
  void* grad_n;
  bool hinge_at_zero;  // whether clamp_min passes the gradient at exactly 0 (the installed torch's)
  const UpstreamHistory* history;
  float* predicted;  // [rows]
};

// loss: [rows] ('none') or one value, in the input dtype (float32 with float32_loss); dists:
// [2 or 3, rows] in the accumulation dtype (float, double for double inputs); workspace:
// plan.workspace_bytes. Returns the first launch error.
cudaError_t launch_forward(const TripletProblem& problem, const LaunchPlan& plan, void* loss,
                           void* dists, void* workspace, const OnePassOutputs& one_pass,
                           cudaStream_t stream);

// What a backward reads and writes. grad: the upstream gradient, [rows] ('none') or one value,
// in the loss's dtype; dists: the forward's; grad_a/p/n: contiguous (rows, dim), or nullptr
// where not needed. After a one-pass forward (kCheck): its gradients are there already,
// `predicted` says for which upstream gradient, and `history` takes this one.
struct BackwardInputs {
  const void* grad;
  const void* dists;
  bool hinge_at_zero;
  void* grad_a;
  void* grad_p;
  void* grad_n;
  const float* predicted;
  UpstreamHistory* history;
};

cudaError_t launch_backward(const TripletProblem& problem, const LaunchPlan& plan,
                            const BackwardInputs& in, cudaStream_t stream);

}  // namespace fused_triplet

#endif  // FUSED_TRIPLET_LAUNCH_H
