// Forward: one pass over anchor, positive and negative.
//
// Three kernels compute the same rows: triplet_forward_bulk_kernel for long rows that are 16-byte
// aligned (sm_90 copy engine into shared memory; 0.717 ms against 0.747 ms for register loads at
// (32768, 8192) fp32 on the H200, see scripts/variants.py), triplet_forward_kernel for the rest
// (teams of 8, 32 or 256 threads per row, 128-bit register loads, or scalar loads if unaligned),
// and, when there are too few rows to fill the GPU, triplet_forward_split_kernel: each row split
// into column slices, one block each, whose partial sums finish_split_rows_kernel combines.
//
// Each row i gives d(a_i, p_i), d(a_i, n_i) (and with swap d(p_i, n_i)), where
// d(x, y) = ||x - y + eps||_p, then loss_i = max(margin + d_ap - min(d_an, d_pn), 0).
// Per row the kernel writes the distances (what a backward needs: B values each, never B x D)
// and either the loss (reduction 'none') or, per block, the sum of its rows' losses, which
// sum_partials_kernel then adds up in a fixed order ('mean' / 'sum'): no atomics, so the same
// inputs always give the same bits.
#include "triplet_common.cuh"

namespace fused_triplet {

template <typename T>
struct ForwardArgs : TripletRows<T> {
  T* loss_rows;           // [rows] loss in the input dtype (reduction 'none'), or null
  acc_t<T>* block_sums;   // [gridDim.x] sum of the block's row losses ('mean'/'sum'), or null
  acc_t<T>* dists;        // [2 or 3, rows]: d_ap, d_an (, d_pn with swap)
  acc_t<T>* partials;     // split rows: [3, rows * splits] per-slice norm partial sums
};

// Accumulates one element of each difference (x - y + eps, as torch computes it).
template <bool SWAP, typename A, NormKind K>
__device__ __forceinline__ void accumulate3(const Norm<A, K>& norm, RowSums<A>& s, A xa, A xp,
                                            A xn, A eps) {
  norm.add(s.ap, xa - xp + eps);
  norm.add(s.an, xa - xn + eps);
  if constexpr (SWAP) norm.add(s.pn, xp - xn + eps);
}

// Lane 0 of a team, once its row's sums are reduced: distances, loss, outputs.
template <bool SWAP, typename T, NormKind K>
__device__ __forceinline__ void finish_row(const ForwardArgs<T>& args, const Norm<acc_t<T>, K>& norm,
                                           const RowSums<acc_t<T>>& s, int64_t row,
                                           acc_t<T>& loss_sum) {
  using A = acc_t<T>;
  const A d_ap = norm.finish(s.ap);
  const A d_an = norm.finish(s.an);
  A d_neg = d_an;
  args.dists[row] = d_ap;
  args.dists[args.rows + row] = d_an;
  if constexpr (SWAP) {
    const A d_pn = norm.finish(s.pn);
    args.dists[2 * args.rows + row] = d_pn;
    d_neg = min_nan(d_an, d_pn);
  }
  const A loss = hinge(args.margin + d_ap - d_neg);
  if (args.loss_rows != nullptr) args.loss_rows[row] = static_cast<T>(loss);
  loss_sum += loss;
}

// Accumulates one thread's share of a row: elements lane, lane + TPR, ... (in 16-byte packs
// when aligned), so a team's loads are contiguous and coalesced.
template <typename T, NormKind K, int TPR, bool SWAP>
__device__ __forceinline__ void accumulate_row(const ForwardArgs<T>& args, int64_t row, int lane,
                                               const Norm<acc_t<T>, K>& norm,
                                               RowSums<acc_t<T>>& s) {
  using A = acc_t<T>;
  constexpr int kVec = Pack<T>::kN;
  // 4 packs per input in flight per thread: 12 x 16 B outstanding loads, enough to cover DRAM
  // latency at the occupancy the register budget allows. General p calls pow (a subroutine):
  // unrolled, the values live across those calls spill, and pow-bound code gains nothing from
  // more loads in flight, so it goes one pack at a time.
  constexpr int kUnroll = K == NormKind::kOther ? 1 : 4;
  const T* a = args.a + row * args.stride_a;
  const T* p = args.p + row * args.stride_p;
  const T* n = args.n + row * args.stride_n;
  const A eps = args.eps;
  const int64_t dim = args.dim;

  auto add = [&](A xa, A xp, A xn) { accumulate3<SWAP>(norm, s, xa, xp, xn, eps); };

  int64_t i = lane;  // scalar element index for the tail / unaligned path
  if (args.vectorized) {
    const int64_t packs = dim / kVec;
    int64_t v = lane;
    for (; v + (kUnroll - 1) * TPR < packs; v += kUnroll * TPR) {
      Pack<T> pa[kUnroll], pp[kUnroll], pn[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        pa[u] = load_pack(a + (v + u * TPR) * kVec);
        pp[u] = load_pack(p + (v + u * TPR) * kVec);
        pn[u] = load_pack(n + (v + u * TPR) * kVec);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          add(to_acc<A>(pa[u].v[j]), to_acc<A>(pp[u].v[j]), to_acc<A>(pn[u].v[j]));
        }
      }
    }
    for (; v < packs; v += TPR) {
      const Pack<T> pa = load_pack(a + v * kVec), pp = load_pack(p + v * kVec),
                    pn = load_pack(n + v * kVec);
#pragma unroll
      for (int j = 0; j < kVec; ++j) add(to_acc<A>(pa.v[j]), to_acc<A>(pp.v[j]), to_acc<A>(pn.v[j]));
    }
    i = packs * kVec + lane;
  } else {
    // Unaligned rows: plain element loads, still unrolled so several are in flight.
    for (; i + (kUnroll - 1) * TPR < dim; i += kUnroll * TPR) {
      A xa[kUnroll], xp[kUnroll], xn[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        xa[u] = to_acc<A>(a[i + u * TPR]);
        xp[u] = to_acc<A>(p[i + u * TPR]);
        xn[u] = to_acc<A>(n[i + u * TPR]);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) add(xa[u], xp[u], xn[u]);
    }
  }
  for (; i < dim; i += TPR) add(to_acc<A>(a[i]), to_acc<A>(p[i]), to_acc<A>(n[i]));
}

template <typename T, NormKind K, int TPR, bool SWAP>
__global__ void __launch_bounds__(kBlockThreads)
    triplet_forward_kernel(const ForwardArgs<T> args) {
  allow_follow_up();
  using A = acc_t<T>;
  constexpr int kRowsPerBlock = kBlockThreads / TPR;
  __shared__ RowSums<A> smem_rows[kBlockThreads / 32];
  __shared__ A smem_sum[kBlockThreads / 32];

  const Norm<A, K> norm{args.norm};
  const int team = threadIdx.x / TPR;
  const int lane = threadIdx.x % TPR;
  A team_loss_sum = A(0);

  // Block-uniform loop bounds: every thread reaches team_reduce's barriers.
  for (int64_t base = int64_t(blockIdx.x) * kRowsPerBlock; base < args.rows;
       base += int64_t(gridDim.x) * kRowsPerBlock) {
    const int64_t row = base + team;
    RowSums<A> s{norm.identity(), norm.identity(), norm.identity()};
    if (row < args.rows) accumulate_row<T, K, TPR, SWAP>(args, row, lane, norm, s);
    s = team_reduce<TPR>(s, norm, smem_rows);
    if (row < args.rows && lane == 0) finish_row<SWAP>(args, norm, s, row, team_loss_sum);
  }
  if (args.block_sums != nullptr) {
    // Lane 0 of each team holds its rows' sum; other lanes add 0. Fixed order.
    const A total = block_sum<kBlockThreads>(lane == 0 ? team_loss_sum : A(0), smem_sum);
    if (threadIdx.x == 0) args.block_sums[blockIdx.x] = total;
  }
}

// Long aligned rows: the copy engine streams each row (or, for split rows, each slice) through
// shared memory (BulkRing, in triplet_common.cuh); the whole block reduces each stage.
template <typename T, NormKind K, bool SWAP, int kChunkBytes>
__global__ void __launch_bounds__(kBlockThreads)
    triplet_forward_bulk_kernel(const ForwardArgs<T> args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // the host launches this only on sm_90+
#else
  allow_follow_up();
  using A = acc_t<T>;
  constexpr int kVec = Pack<T>::kN;
  extern __shared__ __align__(128) unsigned char stage_mem[];
  using Ring = BulkRing<T, kForwardStages, kChunkBytes, RowChunks>;
  __shared__ __align__(8) uint64_t full[kForwardStages];
  __shared__ RowSums<A> smem_rows[kBlockThreads / 32];

  const Norm<A, K> norm{args.norm};
  Ring ring(args, stage_mem, full, RowChunks<T, Ring::kChunkElems>(args));
  A loss_sum = A(0);
  RowSums<A> s{norm.identity(), norm.identity(), norm.identity()};
  // Unit by unit, chunk by chunk: no 64-bit division per chunk (at 8 KiB chunks each thread
  // reduces only 2 packs per input; calling chunks.at() per chunk, three 64-bit divisions,
  // measured 0.753 ms against 0.717 at (32768, 8192) fp32).
  int64_t c = 0;
  for (int64_t i = 0; i < ring.chunks.units; ++i) {
    const int64_t unit = ring.chunks.unit(i);
    const auto sp = ring.chunks.span(args, unit);
    for (int64_t k = 0; k < ring.chunks.per_unit; ++k, ++c) {
      const unsigned char* stage = ring.wait(c);
      const int64_t col = sp.first + k * Ring::kChunkElems;
      const int packs = static_cast<int>(ring.chunks.chunk_elems(sp, col) / kVec);
      for (int v = threadIdx.x; v < packs; v += kBlockThreads) {
        const Pack<T> pa = ring.pack(stage, 0, v), pp = ring.pack(stage, 1, v),
                      pn = ring.pack(stage, 2, v);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          accumulate3<SWAP>(norm, s, to_acc<A>(pa.v[j]), to_acc<A>(pp.v[j]),
                            to_acc<A>(pn.v[j]), args.eps);
        }
      }
      ring.release(args, c);
    }
    s = team_reduce<kBlockThreads>(s, norm, smem_rows);
    if (threadIdx.x == 0) {
      if (args.splits == 1) {
        finish_row<SWAP>(args, norm, s, sp.row, loss_sum);
      } else {  // one slice of a split row: its partial sums, as the split kernel writes them
        const int64_t slices = args.rows * args.splits;
        args.partials[unit] = s.ap;
        args.partials[slices + unit] = s.an;
        args.partials[2 * slices + unit] = s.pn;
      }
    }
    s = RowSums<A>{norm.identity(), norm.identity(), norm.identity()};
  }
  if (args.block_sums != nullptr && threadIdx.x == 0) args.block_sums[blockIdx.x] = loss_sum;
#endif
}

// Many short contiguous rows (sm_90): the copy engine streams a, p, n as flat arrays through the
// same ring (FlatChunks: block b takes chunks [b * per_block, + per_block)); rows of kTeam * 32
// bytes divide the 8 KiB chunk, so each chunk holds kRowsPerChunk whole rows, a team of kTeam
// threads each, and every thread reduces 2 packs per input per chunk, as in the long-row ring.
template <typename T, NormKind K, bool SWAP, int kTeam>
__global__ void __launch_bounds__(kBlockThreads)
    triplet_forward_rows_ring_kernel(const ForwardArgs<T> args, int64_t per_block) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // the host launches this only on sm_90+
#else
  allow_follow_up();
  using A = acc_t<T>;
  constexpr int kChunkBytes = kRowsRingChunkBytes;
  using Ring = BulkRing<T, kForwardStages, kChunkBytes, FlatChunks>;
  constexpr int kRowsPerChunk = kBlockThreads / kTeam;
  constexpr int kRowPacks = kChunkBytes / kVecBytes / kRowsPerChunk;
  static_assert(kRowPacks % kTeam == 0, "a team's threads take the same number of packs");
  extern __shared__ __align__(128) unsigned char stage_mem[];
  __shared__ __align__(8) uint64_t full[kForwardStages];
  __shared__ RowSums<A> smem_rows[kBlockThreads / 32];
  __shared__ A smem_sum[kBlockThreads / 32];

  const Norm<A, K> norm{args.norm};
  Ring ring(args, stage_mem, full, FlatChunks<T, Ring::kChunkElems>(args, per_block));
  const int team = threadIdx.x / kTeam;
  const int lane = threadIdx.x % kTeam;
  A team_loss_sum = A(0);
  int64_t row = ring.chunks.first * kRowsPerChunk + team;
  for (int64_t c = 0; c < ring.chunks.total; ++c, row += kRowsPerChunk) {  // block-uniform
    const unsigned char* stage = ring.wait(c);
    RowSums<A> s{norm.identity(), norm.identity(), norm.identity()};
    if (row < args.rows) {  // the last chunk may hold fewer rows
#pragma unroll
      for (int k = 0; k < kRowPacks / kTeam; ++k) {
        const int v = team * kRowPacks + k * kTeam + lane;
        const Pack<T> pa = ring.pack(stage, 0, v), pp = ring.pack(stage, 1, v),
                      pn = ring.pack(stage, 2, v);
#pragma unroll
        for (int j = 0; j < Pack<T>::kN; ++j) {
          accumulate3<SWAP>(norm, s, to_acc<A>(pa.v[j]), to_acc<A>(pp.v[j]),
                            to_acc<A>(pn.v[j]), args.eps);
        }
      }
    }
    ring.release(args, c);  // the packs are in registers: the stage can refill meanwhile
    s = team_reduce<kTeam>(s, norm, smem_rows);
    if (row < args.rows && lane == 0) finish_row<SWAP>(args, norm, s, row, team_loss_sum);
  }
  if (args.block_sums != nullptr) {
    // Lane 0 of each team holds its rows' sum; other lanes add 0. Fixed order.
    const A total = block_sum<kBlockThreads>(lane == 0 ? team_loss_sum : A(0), smem_sum);
    if (threadIdx.x == 0) args.block_sums[blockIdx.x] = total;
  }
#endif
}

// Few long rows: block b computes slice b % splits of row b / splits (the same code as one
// row of triplet_forward_kernel, on a column range) and writes its three partial sums.
template <typename T, NormKind K, bool SWAP>
__global__ void __launch_bounds__(kBlockThreads)
    triplet_forward_split_kernel(const ForwardArgs<T> args) {
  allow_follow_up();
  using A = acc_t<T>;
  __shared__ RowSums<A> smem_rows[kBlockThreads / 32];
  const Norm<A, K> norm{args.norm};
  const int64_t slices = args.rows * args.splits;
  for (int64_t b = blockIdx.x; b < slices; b += gridDim.x) {  // block-uniform bounds
    const int64_t row = b / args.splits;
    const int64_t first = (b % args.splits) * args.split_elems;
    ForwardArgs<T> slice = args;  // columns [first, first + split_elems) of every row
    slice.a += first;
    slice.p += first;
    slice.n += first;
    slice.dim = min(args.split_elems, args.dim - first);
    RowSums<A> s{norm.identity(), norm.identity(), norm.identity()};
    accumulate_row<T, K, kBlockThreads, SWAP>(slice, row, threadIdx.x, norm, s);
    s = team_reduce<kBlockThreads>(s, norm, smem_rows);
    if (threadIdx.x == 0) {
      args.partials[b] = s.ap;
      args.partials[slices + b] = s.an;
      args.partials[2 * slices + b] = s.pn;
    }
  }
}

// Combines each split row's slices in order (deterministic), then distances, losses and, for
// 'mean'/'sum', their sum in fp64 divided by `divisor` into out[0]. One block: split rows are few.
template <typename T, NormKind K, bool SWAP>
__global__ void __launch_bounds__(kBlockThreads)
    finish_split_rows_kernel(const ForwardArgs<T> args, double divisor, T* __restrict__ out) {
  using A = acc_t<T>;
  __shared__ double smem[kBlockThreads / 32];
  const Norm<A, K> norm{args.norm};
  const int64_t slices = args.rows * args.splits;
  wait_for_main_grid();  // the partials
  double loss_sum = 0.0;
  for (int64_t row = threadIdx.x; row < args.rows; row += kBlockThreads) {
    RowSums<A> s{norm.identity(), norm.identity(), norm.identity()};
    for (int64_t at = row * args.splits; at < (row + 1) * args.splits; ++at) {
      s.ap = norm.combine(s.ap, args.partials[at]);
      s.an = norm.combine(s.an, args.partials[slices + at]);
      s.pn = norm.combine(s.pn, args.partials[2 * slices + at]);
    }
    A row_loss = A(0);
    finish_row<SWAP>(args, norm, s, row, row_loss);
    loss_sum += static_cast<double>(row_loss);
  }
  if (out != nullptr) {  // uniform: every thread reaches block_sum's barrier
    loss_sum = block_sum<kBlockThreads>(loss_sum, smem);
    if (threadIdx.x == 0) out[0] = static_cast<T>(loss_sum / divisor);
  }
}

// Adds the per-block sums in a fixed order (fp64), divides by `divisor` (rows for 'mean',
// 1 for 'sum') and writes the scalar in the output dtype. One block: the partials are few.
constexpr int kSumThreads = 1024;

template <typename T, typename A>
__global__ void __launch_bounds__(kSumThreads)
    sum_partials_kernel(const A* __restrict__ partials, int64_t count, double divisor,
                        T* __restrict__ out) {
  __shared__ double smem[kSumThreads / 32];
  wait_for_main_grid();  // the block sums
  double v = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += kSumThreads) v += static_cast<double>(partials[i]);
  v = block_sum<kSumThreads>(v, smem);
  if (threadIdx.x == 0) out[0] = static_cast<T>(v / divisor);
}

// The bulk forward with its ring's chunk size (kForwardChunkBytes: split rows differ for 2-byte
// dtypes).
template <typename T, NormKind K, bool SWAP, bool kSplitRows>
void launch_forward_bulk(int64_t grid, cudaStream_t stream, const ForwardArgs<T>& args) {
  constexpr int kChunkBytes = kForwardChunkBytes<T, kSplitRows>;
  launch_bulk(triplet_forward_bulk_kernel<T, K, SWAP, kChunkBytes>,
              BulkRing<T, kForwardStages, kChunkBytes, RowChunks>::kSmemBytes, grid, stream, args);
}

// Where the short-rows ring applies: its team (threads per row) and grid, or team 0.
struct RowsRingConfig {
  int team = 0;
  int64_t per_block = 0;  // consecutive chunks per block
  int64_t grid = 0;
};

// sm_90, rows not split, contiguous and 16-byte aligned (a, p, n read as flat arrays), of
// exactly 1 or 4 KiB (kRowsRingChunkBytes / kBlockThreads = 32 bytes per thread per chunk), at
// least kRowsRingMinBytes per input. Chunks per block: up to 8 (64 KiB per input, as one
// (32768, 8192) fp32 row), fewer where that would leave fewer than kFillBlocks blocks (never
// from 64 MiB per input on).
inline RowsRingConfig choose_rows_ring(const RowConfig& cfg, int64_t rows, int64_t dim,
                                       int64_t elem_size, bool flat_rows, const at::Tensor& on) {
  RowsRingConfig ring;
  const int64_t row_bytes = dim * elem_size;
  if (!kRowsRing || !flat_rows || cfg.splits != 1 || (row_bytes != 1024 && row_bytes != 4096) ||
      rows * row_bytes < kRowsRingMinBytes || compute_capability_major(on) < 9) {
    return ring;
  }
  const int64_t chunks = (rows * row_bytes + kRowsRingChunkBytes - 1) / kRowsRingChunkBytes;
  ring.team = static_cast<int>(row_bytes / (kRowsRingChunkBytes / kBlockThreads));
  ring.per_block = std::max<int64_t>(1, std::min<int64_t>(8, chunks / kFillBlocks));
  ring.grid = (chunks + ring.per_block - 1) / ring.per_block;
  return ring;
}

template <typename T, NormKind K, bool SWAP>
void launch_forward_rows_ring(const RowsRingConfig& ring, cudaStream_t stream,
                              const ForwardArgs<T>& args) {
  constexpr int kSmem = BulkRing<T, kForwardStages, kRowsRingChunkBytes, FlatChunks>::kSmemBytes;
  if (ring.team == 32) {
    launch_bulk(triplet_forward_rows_ring_kernel<T, K, SWAP, 32>, kSmem, ring.grid, stream, args,
                ring.per_block);
  } else {
    launch_bulk(triplet_forward_rows_ring_kernel<T, K, SWAP, 128>, kSmem, ring.grid, stream, args,
                ring.per_block);
  }
}

// ---- host op -------------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> triplet_margin_loss_cuda(const at::Tensor& anchor,
                                                            const at::Tensor& positive,
                                                            const at::Tensor& negative,
                                                            double margin, double p, double eps,
                                                            bool swap, int64_t reduction) {
  check_triplet_inputs(anchor, positive, negative, p, reduction);
  const c10::cuda::CUDAGuard guard(anchor.device());

  const auto batch = anchor.sizes().slice(0, anchor.dim() - 1);
  const int64_t dim = anchor.size(-1);
  const int64_t rows = c10::multiply_integers(batch);
  const auto dtype = anchor.scalar_type();
  const auto acc_dtype = dtype == at::kDouble ? at::kDouble : at::kFloat;
  const auto opts = anchor.options();

  at::Tensor dists = at::empty({swap ? 3 : 2, rows}, opts.dtype(acc_dtype));
  at::Tensor loss = reduction == kNone ? at::empty(batch, opts) : at::empty({}, opts);
  if (rows == 0) {  // torch: mean of nothing is nan, sum of nothing is 0
    if (reduction == kMean) loss.fill_(std::numeric_limits<double>::quiet_NaN());
    if (reduction == kSum) loss.zero_();
    return {loss, dists};
  }

  const at::Tensor a = as_rows(anchor, rows, dim);
  const at::Tensor pos = as_rows(positive, rows, dim);
  const at::Tensor neg = as_rows(negative, rows, dim);
  const bool vectorized = rows_aligned(a) && rows_aligned(pos) && rows_aligned(neg);
  const RowConfig cfg = choose_row_config(rows, dim, anchor.element_size());
  const bool bulk = use_bulk_kernel(cfg, dim, anchor.element_size(), vectorized, anchor);
  const bool flat_rows = vectorized && (rows == 1 || (a.stride(0) == dim && pos.stride(0) == dim &&
                                                      neg.stride(0) == dim));
  const RowsRingConfig ring =
      choose_rows_ring(cfg, rows, dim, anchor.element_size(), flat_rows, anchor);
  const int64_t grid = ring.team != 0 ? ring.grid : cfg.grid;  // blocks of the main kernel
  at::Tensor block_sums, partials;
  if (cfg.splits > 1) {
    partials = at::empty({3, rows * cfg.splits}, opts.dtype(acc_dtype));
  } else if (reduction != kNone) {
    block_sums = at::empty({grid}, opts.dtype(acc_dtype));
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const double divisor = reduction == kMean ? static_cast<double>(rows) : 1.0;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "fused_triplet_forward", [&] {
    using A = acc_t<scalar_t>;
    ForwardArgs<scalar_t> args;
    static_cast<TripletRows<scalar_t>&>(args) =
        make_triplet_rows<scalar_t>(a, pos, neg, vectorized, cfg, margin, eps, p);
    args.loss_rows = reduction == kNone ? loss.mutable_data_ptr<scalar_t>() : nullptr;
    args.block_sums = block_sums.defined() ? block_sums.mutable_data_ptr<A>() : nullptr;
    args.dists = dists.mutable_data_ptr<A>();
    args.partials = partials.defined() ? partials.mutable_data_ptr<A>() : nullptr;
    dispatch_row_kernel(norm_kind(p), cfg.threads_per_row, swap, [&](auto kind, auto tpr, auto sw) {
      constexpr NormKind K = decltype(kind)::value;
      constexpr int TPR = decltype(tpr)::value;
      constexpr bool SWAP = decltype(sw)::value;
      if (ring.team != 0) {  // the same instantiation whatever TPR
        launch_forward_rows_ring<scalar_t, K, SWAP>(ring, stream, args);
        return;
      }
      if constexpr (TPR == kBlockThreads) {
        if (cfg.splits > 1) {  // two launches whatever the reduction
          if (bulk) {
            launch_forward_bulk<scalar_t, K, SWAP, /*split rows*/ true>(cfg.grid, stream, args);
          } else {
            triplet_forward_split_kernel<scalar_t, K, SWAP><<<cfg.grid, kBlockThreads, 0,
                                                              stream>>>(args);
          }
          C10_CUDA_KERNEL_LAUNCH_CHECK();
          launch_follow_up(finish_split_rows_kernel<scalar_t, K, SWAP>, kBlockThreads, stream,
                           anchor, args, divisor,
                           reduction == kNone ? nullptr : loss.mutable_data_ptr<scalar_t>());
          return;
        }
        if (bulk) {
          launch_forward_bulk<scalar_t, K, SWAP, /*split rows*/ false>(cfg.grid, stream, args);
          return;
        }
      }
      triplet_forward_kernel<scalar_t, K, TPR, SWAP><<<cfg.grid, kBlockThreads, 0, stream>>>(args);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (reduction != kNone && cfg.splits == 1) {
      launch_follow_up(sum_partials_kernel<scalar_t, A>, kSumThreads, stream, anchor,
                       static_cast<const A*>(args.block_sums), grid, divisor,
                       loss.mutable_data_ptr<scalar_t>());
    }
  });
  return {loss, dists};
}

}  // namespace fused_triplet
