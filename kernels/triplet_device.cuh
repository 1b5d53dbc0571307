// Device helpers shared by the kernels in triplet_kernels.cu and mining_kernels.cu: the dynamic
// shared memory allowance, element types, 16-byte loads and stores, p-norms, deterministic team
// and block reductions, the sm_90 bulk-copy ring and the chained follow-up launch. Plain CUDA: no
// torch headers. Lines marked library-only are left out of the KernelBench file (float32 forward
// only; fused_triplet.export).
#ifndef FUSED_TRIPLET_DEVICE_CUH
#define FUSED_TRIPLET_DEVICE_CUH

#include <cuda_bf16.h>  // library-only
#include <cuda_fp16.h>  // library-only
#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <limits>

namespace fused_triplet {

// Device slots of the per-kernel caches (shared memory allowance, residency).
constexpr int kMaxDevices = 64;

// Lets kKernel take `bytes` of dynamic shared memory on the current device, once per kernel and
// device (a call each launch cost the small cases a microsecond).
template <auto kKernel>
cudaError_t allow_shared_memory(int bytes) {
  static std::atomic<int> allowed[kMaxDevices] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess || (device < kMaxDevices && allowed[device].load() >= bytes)) return err;
  err = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess && device < kMaxDevices) allowed[device].store(bytes);
  return err;
}

constexpr int kBlockThreads = 256;  // every row kernel's block: enough warps to hide a row end
constexpr int kVecBytes = 16;       // one 128-bit load per thread per input

// ---- element types -----------------------------------------------------------------------------
// acc_t: the element arithmetic, as torch's norms do it (float; double for double inputs).
// sum_t: the row sums, in double for every type: a distance in the thousands minus another leaves a
// small loss, so the sums must be more accurate than torch's float ones for the loss to be too,
// and 2-byte inputs under autocast owe a float32 loss as accurate as float32 inputs get. (A
// few 16-byte packs of 2-byte elements are summed in float first: see PackSums.)
template <typename T> struct TypesOf { using acc = float; };
template <> struct TypesOf<double> { using acc = double; };  // library-only
template <typename T> using acc_t = typename TypesOf<T>::acc;
template <typename T> using sum_t = double;

__device__ __forceinline__ float to_acc(float x) { return x; }
// Rounding to the element type, from the element arithmetic (float or double) or the sums.
__device__ __forceinline__ void round_to(float x, float& out) { out = x; }
__device__ __forceinline__ void round_to(double x, float& out) { out = static_cast<float>(x); }
// library-only {
// Explicit conversions: torch's build flags disable the half/bfloat16 conversion operators.
__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ void round_to(double x, double& out) { out = x; }
__device__ __forceinline__ void round_to(float x, __half& out) { out = __float2half_rn(x); }
__device__ __forceinline__ void round_to(float x, __nv_bfloat16& out) { out = __float2bfloat16_rn(x); }
__device__ __forceinline__ void round_to(double x, __half& out) { out = __double2half(x); }
__device__ __forceinline__ void round_to(double x, __nv_bfloat16& out) { out = __double2bfloat16(x); }
// library-only }
template <typename T, typename X>
__device__ __forceinline__ T from_acc(X x) {
  T out;
  round_to(x, out);
  return out;
}

// ---- 16-byte loads and stores --------------------------------------------------------------------

template <typename T>
struct alignas(kVecBytes) Pack {
  static constexpr int kN = kVecBytes / sizeof(T);
  T v[kN];
};

// Streaming loads: every input byte is read once, so bypass L1 and use the read-only path.
template <typename T>
__device__ __forceinline__ Pack<T> load_stream(const T* ptr) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(ptr));
  Pack<T> out;
  memcpy(&out, &r, sizeof(out));
  return out;
}

// Plain loads, as Triton emits for a pointwise kernel: the pointwise backward's (faster there).
template <typename T>
__device__ __forceinline__ Pack<T> load_plain(const T* ptr) {
  Pack<T> out;
  const uint4 r = *reinterpret_cast<const uint4*>(ptr);
  memcpy(&out, &r, sizeof(out));
  return out;
}

template <typename T>
__device__ __forceinline__ Pack<T> as_pack(const uint4& raw) {
  Pack<T> out;
  memcpy(&out, &raw, sizeof(out));
  return out;
}

// 16 bytes global -> shared without registers (sm_80 cp.async, bypassing L1; a plain load and
// store before), and the wait for this thread's copies.
__device__ __forceinline__ void copy_to_shared(uint4* dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(dst))), "l"(src) : "memory");
#else
  *dst = *static_cast<const uint4*>(src);
#endif
}

__device__ __forceinline__ void wait_copies_to_shared() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// ---- NaN-propagating helpers (torch's max/min/clamp_min propagate NaN) ----------------------------

template <typename S> __device__ __forceinline__ S max_nan(S a, S b) { return (a != a || a > b) ? a : b; }
template <typename S> __device__ __forceinline__ S min_nan(S a, S b) { return (a != a || a < b) ? a : b; }
template <typename S> __device__ __forceinline__ S hinge(S v) { return v < S(0) ? S(0) : v; }

// Precision-exact math: float overloads must not promote to double.
__device__ __forceinline__ float abs_acc(float a) { return fabsf(a); }
__device__ __forceinline__ double abs_acc(double a) { return fabs(a); }
__device__ __forceinline__ float pow_acc(float a, float b) { return powf(a, b); }
__device__ __forceinline__ double pow_acc(double a, double b) { return pow(a, b); }
__device__ __forceinline__ float fma_acc(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double fma_acc(double a, double b, double c) { return fma(a, b, c); }
// Rounded as written, never fused into an fma.
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float sqrt_acc(float a) { return sqrtf(a); }
__device__ __forceinline__ double sqrt_acc(double a) { return sqrt(a); }

// ---- p-norms ------------------------------------------------------------------------------------
// ||x||_p over a row as add (per element), combine (two partial sums) and finish, as torch's norm
// kernels define it: p = 0 counts non-zeros, +inf is max |x|, -inf min |x|, else (sum |x|^p)^(1/p).
// p = 2 and p = 1 are compile-time kinds (kTwo, kOne); kOther takes the mode at run time.

enum class NormKind : int { kTwo = 0, kOne = 1, kOther = 2 };
enum class NormMode : int { kTwo = 0, kOne = 1, kZero = 2, kInf = 3, kNegInf = 4, kPow = 5 };

struct NormParams {
  NormMode mode;
  double p, inv_p;
};

template <typename T, NormKind K>
struct Norm {
  using A = acc_t<T>;
  using S = sum_t<T>;
  NormMode mode;
  A p;      // element powers in the element arithmetic
  S inv_p;  // the finishing root in the sums' precision

  __device__ __forceinline__ explicit Norm(const NormParams& prm)
      : mode(K == NormKind::kTwo ? NormMode::kTwo : K == NormKind::kOne ? NormMode::kOne : prm.mode),
        p(static_cast<A>(prm.p)), inv_p(static_cast<S>(prm.inv_p)) {}

  // U: the sum's type, S (a row's sums) or A (a few packs' partial sums, see PackSums).
  template <typename U = S>
  __device__ __forceinline__ U identity() const {
    return K == NormKind::kOther && mode == NormMode::kNegInf ? std::numeric_limits<U>::infinity()
                                                               : U(0);
  }
  template <typename U>
  __device__ __forceinline__ void add(U& s, A x) const {
    if constexpr (K == NormKind::kTwo) {
      const U w = static_cast<U>(x);
      s = fma_acc(w, w, s);  // exact square for float inputs (double sums)
    } else if constexpr (K == NormKind::kOne) {
      s += static_cast<U>(abs_acc(x));
    } else {
      switch (mode) {
        case NormMode::kTwo: { const U w = static_cast<U>(x); s = fma_acc(w, w, s); break; }
        case NormMode::kOne: s += static_cast<U>(abs_acc(x)); break;
        case NormMode::kZero: s += (x == A(0)) ? U(0) : U(1); break;
        case NormMode::kInf: s = max_nan(s, static_cast<U>(abs_acc(x))); break;
        case NormMode::kNegInf: s = min_nan(s, static_cast<U>(abs_acc(x))); break;
        default: s += static_cast<U>(pow_acc(abs_acc(x), p)); break;
      }
    }
  }
  __device__ __forceinline__ S combine(S a, S b) const {
    if constexpr (K == NormKind::kOther) {
      if (mode == NormMode::kInf) return max_nan(a, b);
      if (mode == NormMode::kNegInf) return min_nan(a, b);
    }
    return a + b;
  }
  __device__ __forceinline__ S finish(S s) const {
    // float inputs: a sum past float's range is inf, as torch's float sums make it
    if constexpr (sizeof(S) > sizeof(A)) {
      if (s > static_cast<S>(std::numeric_limits<A>::max())) s = std::numeric_limits<S>::infinity();
    }
    if constexpr (K == NormKind::kTwo) return sqrt_acc(s);
    if constexpr (K == NormKind::kOne) return s;
    if (mode == NormMode::kTwo) return sqrt_acc(s);
    if (mode == NormMode::kPow) return pow_acc(s, inv_p);
    return s;
  }
};

// The per-row partial sums: d(a, p), d(a, n) and, with swap, d(p, n).
template <typename S>
struct RowSums {
  S ap, an, pn;
};

template <typename N, typename S>
__device__ __forceinline__ RowSums<S> combine3(const N& norm, const RowSums<S>& x,
                                               const RowSums<S>& y) {
  return {norm.combine(x.ap, y.ap), norm.combine(x.an, y.an), norm.combine(x.pn, y.pn)};
}

// Deterministic reduction over a team of `tpr` consecutive threads (8, 32 or the block): fixed
// shuffle and shared-memory order, so the same inputs always give the same bits. Every thread of
// the block calls it (it may hold barriers). Teams up to a warp get the result in every lane,
// larger ones in lane 0. smem: one RowSums per warp.
template <typename N, typename S>
__device__ __forceinline__ RowSums<S> team_reduce(RowSums<S> s, int tpr, const N& norm,
                                                  RowSums<S>* smem) {
  for (int offset = (tpr < 32 ? tpr : 32) / 2; offset > 0; offset /= 2) {
    const RowSums<S> o{__shfl_xor_sync(0xffffffffu, s.ap, offset),
                       __shfl_xor_sync(0xffffffffu, s.an, offset),
                       __shfl_xor_sync(0xffffffffu, s.pn, offset)};
    s = combine3(norm, s, o);
  }
  if (tpr > 32) {  // block-uniform
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) smem[warp] = s;
    __syncthreads();
    if (threadIdx.x % tpr == 0) {
      for (int w = 1; w < tpr / 32; ++w) s = combine3(norm, s, smem[warp + w]);
    }
    __syncthreads();  // smem is reused by the next unit
  }
  return s;
}

// A butterfly over the warp's 32 lanes in a fixed order, op(mine, other's) at each step: every
// lane ends with the same bits. shfl_xor exchanges one value (a kernel file may add overloads for
// its own types).
template <typename S>
__device__ __forceinline__ S shfl_xor(S x, int offset) {
  return __shfl_xor_sync(0xffffffffu, x, offset);
}

template <typename S, typename Op>
__device__ __forceinline__ S warp_all_reduce(S x, Op op) {
  for (int offset = 16; offset > 0; offset /= 2) x = op(x, shfl_xor(x, offset));
  return x;
}

struct Plus {
  template <typename S>
  __device__ __forceinline__ S operator()(S a, S b) const { return a + b; }
};

// Deterministic block-wide sum in a fixed order; the result is valid in thread 0.
template <int kThreads, typename S>
__device__ __forceinline__ S block_sum(S v, S* smem) {
  v = warp_all_reduce(v, Plus());
  if (threadIdx.x % 32 == 0) smem[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    v = smem[0];
    for (int w = 1; w < kThreads / 32; ++w) v += smem[w];
  }
  return v;
}

// library-only {
// Places in a list the block fills in thread order, kind after kind (every kind-0 entry, then
// the kind-1 ones, ...), each thread adding at most one entry of each kind, the same in every
// run. counts: shared, [kKinds][kThreads / 32]; one barrier inside, and the caller's own must
// come before counts is written again.
template <int kKinds>
struct BlockPlaces {
  int at[kKinds];          // where this thread's entry of each kind goes (where it adds one)
  int starts[kKinds + 1];  // where each kind's entries start; starts[kKinds]: the list's length
};

template <int kThreads, int kKinds>
__device__ __forceinline__ BlockPlaces<kKinds> block_places(const bool (&adds)[kKinds],
                                                            int (*counts)[kThreads / 32]) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  unsigned ballots[kKinds];
#pragma unroll
  for (int k = 0; k < kKinds; ++k) {
    ballots[k] = __ballot_sync(0xffffffffu, adds[k]);
    if (lane == 0) counts[k][warp] = __popc(ballots[k]);
  }
  __syncthreads();
  BlockPlaces<kKinds> places;
  places.starts[0] = 0;
#pragma unroll
  for (int k = 0; k < kKinds; ++k) {
    int before = 0, all = 0;
    for (int w = 0; w < kThreads / 32; ++w) {
      before += w < warp ? counts[k][w] : 0;
      all += counts[k][w];
    }
    places.at[k] = places.starts[k] + before + __popc(ballots[k] & ((1u << lane) - 1u));
    places.starts[k + 1] = places.starts[k] + all;
  }
  return places;
}
// library-only }

// ---- bulk async copies (sm_90 copy engine) and mbarriers ------------------------------------------
// Only the ring kernel uses them, and the host launches it only on sm_90+; on older targets they
// compile to nothing (the kernel traps).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define FUSED_TRIPLET_HAS_BULK_COPY 1
#endif

__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

struct RingBarrier {
  uint64_t* bar;
  __device__ __forceinline__ void init() const {
#ifdef FUSED_TRIPLET_HAS_BULK_COPY
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar)));
    // make the initialisation visible to the copy engine (the async proxy)
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
  }
  __device__ __forceinline__ void expect(uint32_t bytes) const {
#ifdef FUSED_TRIPLET_HAS_BULK_COPY
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
                 "r"(bytes) : "memory");
#endif
  }
  __device__ __forceinline__ void arrive() const {
#ifdef FUSED_TRIPLET_HAS_BULK_COPY
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
#endif
  }
  __device__ __forceinline__ void wait(uint32_t parity) const {
#ifdef FUSED_TRIPLET_HAS_BULK_COPY
    uint32_t done = 0;
    do {  // the loop exists only where the barrier does
      asm volatile(
          "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
          "selp.u32 %0, 1, 0, p;\n}"
          : "=r"(done)
          : "r"(smem_u32(bar)), "r"(parity)
          : "memory");
    } while (!done);
#endif
  }
  // Global -> shared copy of `bytes` (a multiple of 16, both addresses 16-byte aligned) that
  // completes its bytes on this barrier.
  __device__ __forceinline__ void copy(void* dst, const void* src, uint32_t bytes) const {
#ifdef FUSED_TRIPLET_HAS_BULK_COPY
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar))
        : "memory");
#endif
  }
};

// A tile of `map` (a tensor map over (rows, dim) elements: a box of rows x columns) at column
// `col` of row `row` -> shared memory at dst (128-byte aligned), row after row; it completes its
// bytes (the whole box: parts outside the tensor are zeros) on `bar`.
__device__ __forceinline__ void copy_tile(const RingBarrier& bar, void* dst, const CUtensorMap* map,
                                          int32_t col, int32_t row) {
#ifdef FUSED_TRIPLET_HAS_BULK_COPY
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];"
      ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(row),
        "r"(smem_u32(bar.bar))
      : "memory");
#endif
}

// ---- chained follow-up launches (sm_90 programmatic dependent launch) ---------------------------
// The forward's one-block finishing kernel is scheduled once every block of the main grid has
// started (allow_follow_up, at each main kernel's start) and waits in wait_for_main_grid until the
// main grid's writes are visible: same order and results, without the launch gap. No-ops before
// sm_90 or when the launch did not ask for it.
__device__ __forceinline__ void allow_follow_up() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_main_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace fused_triplet

#endif  // FUSED_TRIPLET_DEVICE_CUH
