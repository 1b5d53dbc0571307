// Backward: one pass over anchor, positive and negative, writing the gradients that are needed.
// Two kernels, chosen as the forward's: triplet_backward_bulk_kernel (long aligned rows, p = 2
// or 1, sm_90: inputs through the copy engine's shared-memory ring) and triplet_backward_kernel
// for the rest (teams of 8, 32 or 256 threads per row, register loads; split rows).
//
// Nothing B x D was saved: forward kept only the per-row distances. Per row the gradient is
//   dL/da = c_ap f(u_ap) + c_an f(u_an),  dL/dp = -c_ap f(u_ap) + c_pn f(u_pn),
//   dL/dn = -c_an f(u_an) - c_pn f(u_pn),      u_xy = x - y + eps (recomputed as forward did),
// with f the p-norm's element derivative and c_xy a per-row scale built from the upstream
// gradient, the hinge, the swap choice and d_xy, following torch's autograd formulas:
//   clamp_min: gradient where margin + d_ap - d_neg > 0 (and at exactly 0 as the installed torch
//   does: hinge_at_zero); minimum (swap): to the smaller distance, half each on a tie, both when
//   NaN; norms: p = 2 u / d (0 where d = 0); p = 1 sgn(u); p = +-inf sgn(u) / #ties on the
//   entries equal to the norm (or NaN); p = 0 none; p < 1 sgn(u) |u|^(p-1) (0 at u = 0) d^(1-p);
//   1 < p < 2 sgn(u) |u|^(p-1) / d^(p-1); p >= 2 u |u|^(p-2) / d^(p-1) (0 where d = 0).
#include "triplet_common.cuh"

namespace fused_triplet {

template <typename T>
struct BackwardArgs : TripletRows<T> {  // vectorized: input and gradient rows 16-byte aligned
  const acc_t<T>* dists;  // [2 or 3, rows] from forward
  const T* grad;          // upstream gradient: [rows] ('none') or one value ('mean'/'sum')
  int64_t grad_stride;    // 1 or 0
  acc_t<T> grad_scale;    // 1 / rows for 'mean', else 1
  bool hinge_at_zero;
  T* grad_a;  // [rows, dim] contiguous, or null when not needed
  T* grad_p;
  T* grad_n;
};

template <typename A>
__device__ __forceinline__ A sgn(A x) {
  return A(x > A(0)) - A(x < A(0));  // 0 for 0 and NaN, as torch's sign
}

// The p-norm's element derivative f(u) (without the per-row scale).
template <typename A, NormKind K>
__device__ __forceinline__ A norm_grad_elem(const NormParams<A>& prm, A u, A d) {
  if constexpr (K == NormKind::kTwo) {
    return u;
  } else if constexpr (K == NormKind::kOne) {
    return sgn(u);
  } else {
    switch (prm.mode) {
      case OtherMode::kZero: return A(0);
      case OtherMode::kInf:
      case OtherMode::kNegInf: return (abs_acc(u) == d || u != u) ? sgn(u) : A(0);
      default:
        if (prm.p < A(1)) return u == A(0) ? A(0) : sgn(u) * pow_acc(abs_acc(u), prm.p - A(1));
        if (prm.p < A(2)) return sgn(u) * pow_acc(abs_acc(u), prm.p - A(1));
        return u * pow_acc(abs_acc(u), prm.p - A(2));
    }
  }
}

// g / x for the per-row scales, where x is a norm, a power of one or a tie count. A zero g (a row
// whose hinge is inactive; under swap, the distance not chosen) with x > 0 returns g itself, the
// value g / x has: IEEE division sends a zero numerator to its slow-path subroutine (ncu source
// counters, (4096, 512) bf16: the two warps of one inactive row held 69 of the pointwise
// backward's 554 stall samples there). x = 0 or NaN still divides (0 / 0 and 0 / NaN are NaN).
template <typename A>
__device__ __forceinline__ A scale_div(A g, A x) {
  return (g == A(0) && x > A(0)) ? g : g / x;
}

// The per-row scale of f for a distance d that receives upstream gradient g (ties: the number
// of entries equal to an inf-norm, counted by the kernel).
template <typename A, NormKind K>
__device__ __forceinline__ A norm_grad_scale(const NormParams<A>& prm, A g, A d, A ties) {
  if constexpr (K == NormKind::kTwo) {
    return d == A(0) ? A(0) : scale_div(g, d);
  } else if constexpr (K == NormKind::kOne) {
    return g;
  } else {
    switch (prm.mode) {
      case OtherMode::kZero: return A(0);
      case OtherMode::kInf:
      case OtherMode::kNegInf: return scale_div(g, ties);
      default:
        if (prm.p < A(1)) return g * pow_acc(d, A(1) - prm.p);
        return d == A(0) ? A(0) : scale_div(g, pow_acc(d, prm.p - A(1)));
    }
  }
}

// One row's gradient: the distances and the per-row scale of each distance's f.
template <typename A, NormKind K, bool SWAP>
struct RowGrad {
  NormParams<A> prm;
  A eps;
  A d_ap, d_an, d_pn;  // distances
  A g_ap, g_an, g_pn;  // upstream gradient reaching each distance
  A c_ap, c_an, c_pn;  // scales of f (set by scale())

  // Gradients of one element of each input.
  __device__ __forceinline__ void operator()(A xa, A xp, A xn, A& ga, A& gp, A& gn) const {
    const A f_ap = c_ap * norm_grad_elem<A, K>(prm, xa - xp + eps, d_ap);
    const A f_an = c_an * norm_grad_elem<A, K>(prm, xa - xn + eps, d_an);
    const A f_pn = SWAP ? c_pn * norm_grad_elem<A, K>(prm, xp - xn + eps, d_pn) : A(0);
    ga = f_ap + f_an;
    gp = f_pn - f_ap;
    gn = -f_an - f_pn;
  }
  // The same for one 16-byte pack of each input.
  template <typename T>
  __device__ __forceinline__ void operator()(const Pack<T>& a, const Pack<T>& p, const Pack<T>& n,
                                             Pack<T>& oa, Pack<T>& op, Pack<T>& on) const {
#pragma unroll
    for (int j = 0; j < Pack<T>::kN; ++j) {
      A ga, gp, gn;
      (*this)(to_acc<A>(a.v[j]), to_acc<A>(p.v[j]), to_acc<A>(n.v[j]), ga, gp, gn);
      oa.v[j] = static_cast<T>(ga);
      op.v[j] = static_cast<T>(gp);
      on.v[j] = static_cast<T>(gn);
    }
  }
  // ties: for inf-norms, the number of entries equal to each norm (1 otherwise).
  __device__ __forceinline__ void scale(const RowSums<A>& ties) {
    c_ap = norm_grad_scale<A, K>(prm, g_ap, d_ap, ties.ap);
    c_an = norm_grad_scale<A, K>(prm, g_an, d_an, ties.an);
    c_pn = SWAP ? norm_grad_scale<A, K>(prm, g_pn, d_pn, ties.pn) : A(0);
  }
};

// What one row's gradient scales are made of: its distances and upstream gradient. Loaded
// apart from the math below so that a kernel can issue the next row's loads early and use them
// a row later: a load used at once puts its latency on the block's path.
template <typename T>
struct RowGradInputs {
  acc_t<T> d_ap, d_an, d_pn;
  T grad;
};

template <bool SWAP, typename T>
__device__ __forceinline__ RowGradInputs<T> load_row_grad_inputs(const BackwardArgs<T>& args,
                                                                 int64_t row) {
  return {args.dists[row], args.dists[args.rows + row],
          SWAP ? args.dists[2 * args.rows + row] : acc_t<T>(0), args.grad[row * args.grad_stride]};
}

// Distances and upstream gradients of one row (hinge, swap choice, reduction scale).
template <NormKind K, bool SWAP, typename T>
__device__ __forceinline__ RowGrad<acc_t<T>, K, SWAP> row_grad(const BackwardArgs<T>& args,
                                                                const RowGradInputs<T>& in) {
  using A = acc_t<T>;
  RowGrad<A, K, SWAP> r;
  r.prm = args.norm;
  r.eps = args.eps;
  r.d_ap = in.d_ap;
  r.d_an = in.d_an;
  r.d_pn = in.d_pn;
  const A d_neg = SWAP ? min_nan(r.d_an, r.d_pn) : r.d_an;
  const A hinge_in = args.margin + r.d_ap - d_neg;
  const bool active = hinge_in > A(0) || (hinge_in == A(0) && args.hinge_at_zero);
  const A g = active ? to_acc<A>(in.grad) * args.grad_scale : A(0);
  A w_an = A(1), w_pn = A(0);
  if constexpr (SWAP) {
    w_an = r.d_an > r.d_pn ? A(0) : (r.d_an == r.d_pn ? A(0.5) : A(1));
    w_pn = r.d_an < r.d_pn ? A(0) : (r.d_an == r.d_pn ? A(0.5) : A(1));
  }
  r.g_ap = g;
  r.g_an = -g * w_an;
  r.g_pn = -g * w_pn;
  return r;
}

template <NormKind K, bool SWAP, typename T>
__device__ __forceinline__ RowGrad<acc_t<T>, K, SWAP> row_grad(const BackwardArgs<T>& args,
                                                                int64_t row) {
  return row_grad<K, SWAP>(args, load_row_grad_inputs<SWAP>(args, row));
}

// Writes the needed gradients of one pack at element offset `at` of the contiguous outputs.
template <typename T>
__device__ __forceinline__ void store_grads(const BackwardArgs<T>& args, int64_t at,
                                            const Pack<T>& oa, const Pack<T>& op,
                                            const Pack<T>& on) {
  if (args.grad_a != nullptr) store_pack(args.grad_a + at, oa);
  if (args.grad_p != nullptr) store_pack(args.grad_p + at, op);
  if (args.grad_n != nullptr) store_pack(args.grad_n + at, on);
}

constexpr int kBackwardUnroll = 4;

// The ring and register-load backward kernels walk the rows from the last one down (the
// pointwise kernel walks up: numbers there). The forward (every kernel of it walks up) has
// just read the inputs' last rows, and the backward usually runs right after it: up to the
// L2's size of them can then come from L2, not DRAM.
// torch.compile's backward walks up, from rows evicted long ago. No bit changes: the gradient
// has no reduction across rows. false: in order (A/B, scripts/variants.py). Fwd+bwd
// ms, from the end / in order: (262144, 256) fp32 0.5878 / 0.5881 vs 0.5907, (65536, 1024) bf16
// 0.3084 / 0.3072 vs 0.3094, (4096, 512) bf16 0.0221 / 0.0215 vs 0.0224, (32768, 8192) fp32
// 2.2724 / 2.2723 vs 2.2739 (the L2 holds about 1.5% of the forward's bytes there).
constexpr bool kBackwardFromEnd = true;
// The row ring's units (rows or row slices) in that order.
template <typename T, int64_t kChunkElems>
using BackwardRowChunks = RowChunksOf<T, kChunkElems, kBackwardFromEnd>;

template <typename T, NormKind K, int TPR, bool SWAP>
__global__ void __launch_bounds__(kBlockThreads)
    triplet_backward_kernel(const BackwardArgs<T> args) {
  using A = acc_t<T>;
  constexpr int kVec = Pack<T>::kN;
  // Packs per input in flight: 4 (fp32: 16 elements); 2 for 16-bit types, the same 16
  // elements (unpacked to fp32 they need as many registers: 4 packs of bf16 took 170 registers,
  // one block per SM); 1 for general p (pow calls would spill).
  constexpr int kUnroll = K == NormKind::kOther ? 1
                          : sizeof(T) == 2      ? kBackwardUnroll / 2
                                                : kBackwardUnroll;
  constexpr int kRowsPerBlock = kBlockThreads / TPR;
  __shared__ RowSums<A> smem_rows[kBlockThreads / 32];

  const NormParams<A> prm = args.norm;
  const Norm<A, NormKind::kOne> counter{prm};  // plain sums, for counting inf-norm ties
  const bool inf_norm = K == NormKind::kOther &&
                        (prm.mode == OtherMode::kInf || prm.mode == OtherMode::kNegInf);
  const int team = threadIdx.x / TPR;
  const int lane = threadIdx.x % TPR;

  // Work units: a group of kRowsPerBlock rows, or with split rows (TPR = block) one column slice
  // of one row. Block-uniform bounds.
  const int64_t units = (args.rows + kRowsPerBlock - 1) / kRowsPerBlock * args.splits;
  for (int64_t step = blockIdx.x; step < units; step += gridDim.x) {
    const int64_t unit = kBackwardFromEnd ? units - 1 - step : step;
    const int64_t row = unit / args.splits * kRowsPerBlock + team;
    const int64_t first = unit % args.splits * args.split_elems;  // this unit's columns
    const int64_t len = min(args.split_elems, args.dim - first);
    const bool live = row < args.rows;
    const int64_t r = live ? row : 0;
    RowGrad<A, K, SWAP> rg = row_grad<K, SWAP>(args, r);
    const T* a = args.a + r * args.stride_a;
    const T* p = args.p + r * args.stride_p;
    const T* n = args.n + r * args.stride_n;
    const A eps = args.eps;

    RowSums<A> ties{A(1), A(1), A(1)};
    if (inf_norm) {  // block-uniform: every thread reaches team_reduce's barriers
      // The whole row, also when this unit is one slice of it: ties are a row property.
      RowSums<A> c{A(0), A(0), A(0)};
      for (int64_t i = lane; live && i < args.dim; i += TPR) {
        const A xa = to_acc<A>(a[i]), xp = to_acc<A>(p[i]), xn = to_acc<A>(n[i]);
        const A u_ap = xa - xp + eps, u_an = xa - xn + eps, u_pn = xp - xn + eps;
        c.ap += A(abs_acc(u_ap) == rg.d_ap || u_ap != u_ap);
        c.an += A(abs_acc(u_an) == rg.d_an || u_an != u_an);
        if constexpr (SWAP) c.pn += A(abs_acc(u_pn) == rg.d_pn || u_pn != u_pn);
      }
      c = team_reduce<TPR>(c, counter, smem_rows);
      if constexpr (TPR <= 32) {
        ties = c;  // the xor-shuffle reduction leaves the counts in every lane of the team
      } else {  // only lane 0 holds them: share through shared memory
        if (lane == 0) smem_rows[team] = c;
        __syncthreads();
        ties = smem_rows[team];
        __syncthreads();
      }
    }
    if (!live) continue;

    rg.scale(ties);
    const int64_t out_row = row * args.dim + first;
    a += first;
    p += first;
    n += first;

    int64_t i = lane;  // scalar element index for the tail / unaligned path
    if (args.vectorized) {
      const int64_t packs = len / kVec;
      for (int64_t v0 = lane; v0 < packs; v0 += int64_t(kUnroll) * TPR) {
        Pack<T> pa[kUnroll], pp[kUnroll], pn[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t v = v0 + int64_t(u) * TPR;
          if (v < packs) {
            pa[u] = load_pack(a + v * kVec);
            pp[u] = load_pack(p + v * kVec);
            pn[u] = load_pack(n + v * kVec);
          }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t v = v0 + int64_t(u) * TPR;
          if (v >= packs) break;
          Pack<T> oa, op, on;
          rg(pa[u], pp[u], pn[u], oa, op, on);
          store_grads(args, out_row + v * kVec, oa, op, on);
        }
      }
      i = packs * kVec + lane;
    }
    for (; i < len; i += TPR) {
      A ga, gp, gn;
      rg(to_acc<A>(a[i]), to_acc<A>(p[i]), to_acc<A>(n[i]), ga, gp, gn);
      if (args.grad_a != nullptr) args.grad_a[out_row + i] = static_cast<T>(ga);
      if (args.grad_p != nullptr) args.grad_p[out_row + i] = static_cast<T>(gp);
      if (args.grad_n != nullptr) args.grad_n[out_row + i] = static_cast<T>(gn);
    }
  }
}

// Long aligned rows, p = 2 or 1 (inf-norm ties would need a pass over the row first): the copy
// engine streams each row through shared memory (BulkRing, in triplet_common.cuh) and the block
// writes each stage's gradients from there, so loads in flight do not depend on registers.
template <typename T, NormKind K, bool SWAP>
__global__ void __launch_bounds__(kBlockThreads)
    triplet_backward_bulk_kernel(const BackwardArgs<T> args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // the host launches this only on sm_90+
#else
  static_assert(K != NormKind::kOther, "no inf-norm tie counting here");
  using A = acc_t<T>;
  constexpr int kVec = Pack<T>::kN;
  extern __shared__ __align__(128) unsigned char stage_mem[];
  using Ring = BulkRing<T, kBackwardStages, kBackwardChunkBytes, BackwardRowChunks>;
  __shared__ __align__(8) uint64_t full[kBackwardStages];

  Ring ring(args, stage_mem, full, typename Ring::Order(args));
  RowGrad<A, K, SWAP> rg;
  // Each row's distances and upstream gradient are loaded a row ahead: used at once, their
  // latency stalls every thread at each row start (fwd+bwd 0.1-1.3% faster measured with the
  // loads ahead, both bulk kernels).
  RowGradInputs<T> next{};
  if (ring.chunks.units > 0) {
    next = load_row_grad_inputs<SWAP>(args, ring.chunks.span(args, ring.chunks.unit(0)).row);
  }
  int64_t c = 0;  // unit by unit, chunk by chunk: no 64-bit division per chunk
  for (int64_t i = 0; i < ring.chunks.units; ++i) {
    const auto sp = ring.chunks.span(args, ring.chunks.unit(i));
    rg = row_grad<K, SWAP>(args, next);
    rg.scale(RowSums<A>{A(1), A(1), A(1)});
    if (i + 1 < ring.chunks.units) {
      next = load_row_grad_inputs<SWAP>(args,
                                        ring.chunks.span(args, ring.chunks.unit(i + 1)).row);
    }
    for (int64_t k = 0; k < ring.chunks.per_unit; ++k, ++c) {
      const int64_t col = sp.first + k * Ring::kChunkElems;
      const int packs = static_cast<int>(ring.chunks.chunk_elems(sp, col) / kVec);
      const unsigned char* stage = ring.wait(c);
      for (int v = threadIdx.x; v < packs; v += kBlockThreads) {
        Pack<T> oa, op, on;
        rg(ring.pack(stage, 0, v), ring.pack(stage, 1, v), ring.pack(stage, 2, v), oa, op, on);
        store_grads(args, sp.row * args.dim + col + int64_t(v) * kVec, oa, op, on);
      }
      ring.release(args, c);
    }
  }
#endif
}

// Contiguous inputs (p = 2 or 1, rows a 16-byte multiple): given the per-row scales the
// gradient is elementwise, so each thread loads 16-byte packs of each input straight into
// registers, 128-thread blocks, as Triton's pointwise backward (Inductor's, torch.compile's)
// does. Each thread computes its own row's scales; the threads of a row load the same dists,
// from L1. It replaced, for these inputs:
// - small inputs (up to 16 MiB each): a flat bulk-copy ring kernel that streamed
//   a, p, n as flat arrays through shared memory with a table of row scales; with 1-2 chunks
//   per block its latency chain (barrier init, copies, row table, barrier) made it 1.5x slower
//   (ncu, (4096, 512) bf16: 11.6 us against Triton's 7.7);
// - every size, once its loads were plain: the row ring (whole rows of >= 8 KiB)
//   and the flat ring (the rest) both lost to it (numbers at kPointwisePlainLoads).
// Strided rows keep the row ring (bulk) or the register-load kernel.
constexpr int kPointwiseThreads = 128;
// 32-bit pack indices: the block's first pack plus its 256 stay below 2^32 (32 GiB per input;
// larger inputs take the row ring or the register-load kernel).
constexpr int64_t kPointwiseMaxPacks = int64_t(1) << 31;

// Packs of each input per thread, block-strided (each load instruction of a warp reads 512
// contiguous bytes). Triton's pointwise backward gives a thread 8 elements: 2 fp32 packs, 1
// bf16 pack; ncu at (4096, 512) had our warps waiting longer on memory than Triton's. A thread
// issues the input loads of all its packs before it uses any. Fwd+bwd ms, 2 packs vs 1: (4096, 512) bf16 0.0208 vs 0.0221 / 0.0215 (compile 0.0206), fp32 0.0305
// vs 0.0308 (compile 0.0292).
constexpr int kPointwisePacks = 2;
// Plain loads (load_plain16), not the read-only no-allocate path the other kernels take.
// Fwd+bwd ms with this kernel up to 1 GiB per input: (32768, 8192) fp32 2.2497 /
// 2.2499 against 2.2980 with no-allocate loads (the ring backward 2.2731-2.2737, torch.compile
// 2.2557); (262144, 256) fp32 0.5795 against 0.5920 (flat ring 0.5881-0.5886, compile 0.5787).
// Plain loads in the ring kernels and the forward changed nothing there (2.2734).
constexpr bool kPointwisePlainLoads = true;  // false: no-allocate loads (A/B)

template <typename T, NormKind K, bool SWAP>
__global__ void __launch_bounds__(kPointwiseThreads)
    triplet_backward_pointwise_kernel(const BackwardArgs<T> args, uint32_t packs,
                                      uint32_t packs_per_row) {
  static_assert(K != NormKind::kOther, "no inf-norm tie counting here");
  using A = acc_t<T>;
  constexpr int kVec = Pack<T>::kN;
  constexpr int kP = kPointwisePacks;
  // The grid covers every pack once (the host sizes it): no grid-stride loop. Blocks in order,
  // as Inductor's: from the end (kBackwardFromEnd, the ring kernels' walk) was slower once the
  // loads were plain. Fwd+bwd ms, in order vs from the end: (32768, 8192) fp32
  // 2.2381 vs 2.2493 / 2.2497, bf16 1.1319 vs 1.1336 / 1.1337; (262144, 256) fp32 0.5790 vs
  // 0.5799, bf16 0.3038 vs 0.3049 / 0.3044; (4, 16777216) fp32 0.5821 vs 0.5829 / 0.5821;
  // (65536, 1024) fp32 0.5756 vs 0.5737 / 0.5739.
  const uint32_t block = blockIdx.x;
  const uint32_t first = block * uint32_t(kPointwiseThreads * kP) + threadIdx.x;
  Pack<T> pa[kP], pp[kP], pn[kP];
#pragma unroll
  for (int j = 0; j < kP; ++j) {
    const uint32_t v = first + uint32_t(j * kPointwiseThreads);
    if (v < packs) {
      const int64_t at = int64_t(v) * kVec;
      pa[j] = load_pack<T, kPointwisePlainLoads>(args.a + at);
      pp[j] = load_pack<T, kPointwisePlainLoads>(args.p + at);
      pn[j] = load_pack<T, kPointwisePlainLoads>(args.n + at);
    }
  }
#pragma unroll
  for (int j = 0; j < kP; ++j) {
    const uint32_t v = first + uint32_t(j * kPointwiseThreads);
    if (v >= packs) break;
    RowGrad<A, K, SWAP> rg = row_grad<K, SWAP>(args, int64_t(v / packs_per_row));
    rg.scale(RowSums<A>{A(1), A(1), A(1)});
    Pack<T> oa, op, on;
    rg(pa[j], pp[j], pn[j], oa, op, on);
    store_grads(args, int64_t(v) * kVec, oa, op, on);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> triplet_margin_loss_backward_cuda(
    const at::Tensor& grad, const at::Tensor& anchor, const at::Tensor& positive,
    const at::Tensor& negative, const at::Tensor& dists, double margin, double p, double eps,
    bool swap, int64_t reduction, bool hinge_at_zero, std::array<bool, 3> output_mask) {
  check_triplet_inputs(anchor, positive, negative, p, reduction);
  const c10::cuda::CUDAGuard guard(anchor.device());
  const int64_t dim = anchor.size(-1);
  const int64_t rows = c10::multiply_integers(anchor.sizes().slice(0, anchor.dim() - 1));
  const auto acc_dtype = anchor.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(dists.is_cuda() && dists.device() == anchor.device() &&
                  dists.scalar_type() == acc_dtype && dists.dim() == 2 &&
                  dists.size(0) == (swap ? 3 : 2) && dists.size(1) == rows,
              "fused_triplet: dists must be the forward's [", swap ? 3 : 2, ", ", rows, "] ",
              acc_dtype, " tensor on ", anchor.device());
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
  // Gradients are written contiguous (row stride dim): 16-byte rows need dim * size % 16 == 0.
  const bool vectorized = rows_aligned(a) && rows_aligned(pos) && rows_aligned(neg) &&
                          (rows == 1 || (dim * anchor.element_size()) % kVecBytes == 0);
  const RowConfig cfg = choose_row_config(rows, dim, anchor.element_size());
  const bool bulk = use_bulk_kernel(cfg, dim, anchor.element_size(), vectorized, anchor);
  const bool contiguous_rows =
      rows == 1 || (a.stride(0) == dim && pos.stride(0) == dim && neg.stride(0) == dim);
  const bool elementwise = vectorized && contiguous_rows &&
                           (dim * anchor.element_size()) % kVecBytes == 0 &&
                           norm_kind(p) != NormKind::kOther;
  const bool pointwise =
      elementwise && rows * dim / (kVecBytes / anchor.element_size()) <= kPointwiseMaxPacks;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, anchor.scalar_type(),
                                  "fused_triplet_backward", [&] {
    using A = acc_t<scalar_t>;
    BackwardArgs<scalar_t> args;
    static_cast<TripletRows<scalar_t>&>(args) =
        make_triplet_rows<scalar_t>(a, pos, neg, vectorized, cfg, margin, eps, p);
    args.dists = d.const_data_ptr<A>();
    args.grad = g.const_data_ptr<scalar_t>();
    args.grad_stride = reduction == kNone ? 1 : 0;
    args.grad_scale = reduction == kMean ? A(1) / static_cast<A>(rows) : A(1);
    args.hinge_at_zero = hinge_at_zero;
    args.grad_a = output_mask[0] ? out[0].mutable_data_ptr<scalar_t>() : nullptr;
    args.grad_p = output_mask[1] ? out[1].mutable_data_ptr<scalar_t>() : nullptr;
    args.grad_n = output_mask[2] ? out[2].mutable_data_ptr<scalar_t>() : nullptr;
    dispatch_row_kernel(norm_kind(p), cfg.threads_per_row, swap, [&](auto kind, auto tpr, auto sw) {
      constexpr NormKind K = decltype(kind)::value;
      constexpr int TPR = decltype(tpr)::value;
      constexpr bool SWAP = decltype(sw)::value;
      if constexpr (K != NormKind::kOther) {
        if (pointwise) {
          constexpr int64_t kVec = kVecBytes / static_cast<int64_t>(sizeof(scalar_t));
          const int64_t packs = rows * dim / kVec;
          constexpr int64_t kPerBlock = kPointwiseThreads * kPointwisePacks;
          triplet_backward_pointwise_kernel<scalar_t, K, SWAP>
              <<<(packs + kPerBlock - 1) / kPerBlock, kPointwiseThreads, 0, stream>>>(
                  args, static_cast<uint32_t>(packs), static_cast<uint32_t>(dim / kVec));
          return;
        }
        if (TPR == kBlockThreads && bulk) {
          launch_bulk(triplet_backward_bulk_kernel<scalar_t, K, SWAP>,
                      BulkRing<scalar_t, kBackwardStages, kBackwardChunkBytes,
                               BackwardRowChunks>::kSmemBytes,
                      cfg.grid, stream, args);
          return;
        }
      }
      triplet_backward_kernel<scalar_t, K, TPR, SWAP><<<cfg.grid, kBlockThreads, 0, stream>>>(args);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out[0], out[1], out[2]};
}

}  // namespace fused_triplet
