// kernelbench-only: #define FUSED_TRIPLET_KERNELBENCH
// The KernelBench file's forward: plain C functions that fused_triplet.py calls through ctypes,
// so that file compiles no torch headers (it leaves the torch-facing C++ out; the library's ops
// live there). The caller checks the inputs first: float32 (rows, dim) arrays with unit element
// stride on the current device, p = 2 without swap; it allocates the loss, dists [2, rows] and
// the workspace that fused_triplet_kernelbench_forward asks for.
#ifdef FUSED_TRIPLET_KERNELBENCH
#include "triplet_launch.h"

#include <cuda_runtime_api.h>

#include <cstdint>

namespace {

fused_triplet::TripletProblem kernelbench_problem(const void* a, const void* p, const void* n,
                                                  int64_t stride_a, int64_t stride_p,
                                                  int64_t stride_n, int64_t rows, int64_t dim,
                                                  double margin, double eps, int64_t reduction) {
  fused_triplet::TripletProblem pr{};
  pr.a = a, pr.p = p, pr.n = n;
  pr.stride_a = stride_a, pr.stride_p = stride_p, pr.stride_n = stride_n;
  pr.rows = rows, pr.dim = dim;
  pr.dtype = fused_triplet::DType::kFloat;
  pr.margin = margin, pr.p_norm = 2.0, pr.eps = eps;
  pr.reduction = reduction;
  int device = 0;
  if (cudaGetDevice(&device) == cudaSuccess) {
    cudaDeviceGetAttribute(&pr.cc_major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&pr.sm_count, cudaDevAttrMultiProcessorCount, device);
    cudaDeviceGetAttribute(&pr.smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  }
  return pr;
}

}  // namespace

// The forward of one problem. workspace_bytes: in, the workspace's size; out, what the plan
// needs. Returns 0 after the launches, -1 without any where the workspace is smaller than that
// (call again with one as large), -2 where the problem is not one the kernels take, else the
// first CUDA error.
extern "C" int fused_triplet_kernelbench_forward(const void* a, const void* p, const void* n,
                                                 int64_t stride_a, int64_t stride_p,
                                                 int64_t stride_n, int64_t rows, int64_t dim,
                                                 double margin, double eps,
                                                 int64_t reduction, void* loss, void* dists,
                                                 void* workspace, int64_t* workspace_bytes,
                                                 void* stream) {
  if (rows <= 0 || dim < 0 || reduction < fused_triplet::kNone ||
      reduction > fused_triplet::kSum) {
    return -2;
  }
  const fused_triplet::TripletProblem pr =
      kernelbench_problem(a, p, n, stride_a, stride_p, stride_n, rows, dim, margin, eps,
                          reduction);
  if (pr.sm_count <= 0) {  // no device facts: the error that hid them
    const cudaError_t err = cudaGetLastError();
    return err != cudaSuccess ? static_cast<int>(err) : -2;
  }
  const fused_triplet::LaunchPlan plan =
      fused_triplet::plan_forward(pr, fused_triplet::ForwardFamily::kAuto, false);
  if (plan.unfit != nullptr) return -2;
  const int64_t needed = static_cast<int64_t>(plan.workspace_bytes);
  const bool fits = *workspace_bytes >= needed && (needed == 0 || workspace != nullptr);
  *workspace_bytes = needed;
  if (!fits) return -1;
  const fused_triplet::OnePassOutputs none{nullptr, nullptr, nullptr, false, nullptr, nullptr};
  return static_cast<int>(fused_triplet::launch_forward(pr, plan, loss, dists, workspace, none,
                                                        static_cast<cudaStream_t>(stream)));
}

// What a CUDA error code says.
extern "C" const char* fused_triplet_kernelbench_error(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}
#endif  // FUSED_TRIPLET_KERNELBENCH
