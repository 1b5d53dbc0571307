"""Time kernel variants on one shape: each variant is the kernel source with textual edits,
built in parallel (one process each: the op namespace can be registered once per process), then
timed one after another on the GPU against torch.compile. A tuning aid, not part of the library.

    python scripts/variants.py [--shape 32768x8192] [--dtype fp32] [--only a,b] [--backward]
                               [--margin 1.0] [--swap]  # margin 0.001: about half the hinges
                                                        # inactive

`--only base,tree=.ab/main` times this checkout's kernels against another checkout's.
"""

import argparse
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LOAD = "ld.global.nc.L1::no_allocate.v4.u32"
UNROLL = "constexpr int kUnroll = K == NormKind::kOther ? 1 : 4;"
TPR_RULE = "packs <= 32 * 16 ? 32 : kBlockThreads);"
TPR_RULE_FULL = "packs <= 8 * 8 ? 8 : (" + TPR_RULE  # both team thresholds
TPR_DEFAULT = "default: with_swap(k, std::integral_constant<int, kBlockThreads>{});"
GRID = "std::min<int64_t>(row_groups, int64_t(1) << 20)"
BLOCK = "constexpr int kBlockThreads = 256;"

BULK = "return vectorized && cfg.threads_per_row == kBlockThreads &&"
BULK_LOOP = ("ring.chunks.chunk_elems(sp, col) / kVec);\n"
             "      for (int v = threadIdx.x; v < packs; v += kBlockThreads) {")
STAGES = "constexpr int kForwardStages = 4;"
CHUNK = "constexpr int kForwardChunkBytes = sizeof(T) < 4 && !kSplitRows ? 4096 : 8192;"
BWD_STAGES = "constexpr int kBackwardStages = 4;"
BWD_CHUNK = "constexpr int kBackwardChunkBytes = 4096;"
TEAM_FILL = "constexpr int64_t kTeamFillBlocks = kFillBlocks;"
PW_MAX = "constexpr int64_t kPointwiseMaxPacks = int64_t(1) << 31;"
PW_BLOCK = "const uint32_t block = blockIdx.x;"
PW_PACKS = "constexpr int kPointwisePacks = 2;"
CS_STORE = "__stcs(reinterpret_cast<uint4*>(ptr), raw);"
L2_SCALE = "return d == A(0) ? A(0) : scale_div(g, d);"
FILL = "constexpr int64_t kFillBlocks = 1024;"
SLICE = "constexpr int64_t kMinSliceBytes = 32 * 1024;"
ROWS_RING_MIN = "constexpr int64_t kRowsRingMinBytes = int64_t(128) << 20;"
ROWS_RING_16M = (ROWS_RING_MIN, ROWS_RING_MIN.replace("int64_t(128) << 20", "int64_t(16) << 20"))
ROWS_RING_PER_BLOCK = ("ring.per_block = std::max<int64_t>(1, std::min<int64_t>(8, chunks / "
                       "kFillBlocks));")
SPLIT_BLOCKS = "constexpr int64_t kSplitBlocks = 512;"

VARIANTS = {
    "base": [],
    "nobulk": [(BULK, "return false &&")],  # forward and backward
    "nobulk_tpr128": [(TPR_RULE, TPR_RULE.replace("kBlockThreads);", "128);")),
                      (TPR_DEFAULT, TPR_DEFAULT.replace("kBlockThreads>", "128>"))],
    "nobulk_block512": [(BULK, "return false &&"), (BLOCK, BLOCK.replace("256", "512"))],
    # CHUNK edits of "8192" change the ring of 4-byte and wider types and of split rows only;
    # whole rows of 2-byte types keep 4 KiB chunks (fwd_chunk_8k_all: 8 KiB for every type, the
    # ring before session k).
    "bulk_persist2": [(GRID, "std::min<int64_t>(row_groups, 132 * 2)")],
    "bulk_persist4": [(GRID, "std::min<int64_t>(row_groups, 132 * 4)")],  # 4 x 48 KiB rings
    "bulk_16k_x2": [(CHUNK, CHUNK.replace("8192", "16384")), (STAGES, STAGES.replace("4", "2"))],
    "bulk_4k_x8": [(CHUNK, CHUNK.replace("8192", "4096")), (STAGES, STAGES.replace("4", "8"))],
    "bulk_8k_x6": [(STAGES, STAGES.replace("4", "6"))],
    "bulk_16k_x4": [(CHUNK, CHUNK.replace("8192", "16384"))],
    "bulk_4k_x4": [(CHUNK, CHUNK.replace("8192", "4096"))],  # fp32 too; 48 KiB: 4 blocks per SM
    "fwd_chunk_8k_all": [(CHUNK, CHUNK.replace("4096", "8192"))],  # 2-byte dtypes as before k
    "bulk_4k_x6": [(CHUNK, CHUNK.replace("8192", "4096")), (STAGES, STAGES.replace("4", "6"))],
    # split rows (time with --shape 16x4194304 or 4x16777216). Blocks the slices aim at, session
    # l (as kFillBlocks), (4, 16777216) bf16: 2048 0.1324 ms, 4096 0.1521, 1024 0.1209; session m:
    # 512 0.1122 vs 1024 0.1177, merged as kSplitBlocks. split_fill512 (kFillBlocks, which also
    # sets the team rule, the split threshold and the backward's few-rows rules) is kept to A/B.
    # Session n, 256 vs 512 (forward ms): (4, 16777216) bf16 0.1101 vs 0.1122 / 0.1121 and 0.1100
    # vs 0.1124 / 0.1119; fp32 0.1964 vs 0.1974 / 0.1978; (16, 4194304) bf16 0.1084 vs 0.1086 /
    # 0.1083; fp32 0.1951 vs 0.1938 / 0.1937. Mixed: not merged.
    "split_fill512": [(FILL, FILL.replace("1024", "512"))],
    "split_blocks1024": [(SPLIT_BLOCKS, SPLIT_BLOCKS.replace("512", "1024"))],
    "split_blocks256": [(SPLIT_BLOCKS, SPLIT_BLOCKS.replace("512", "256"))],
    # Rows of 8-32 KiB split too: (128, 4096) has 128 blocks for 132 SMs; with the chained
    # follow-up (session m) the combining kernel costs less than it did. Session n, forward ms:
    # (128, 4096) fp32 8k 0.0098, 4k 0.0113 vs 0.0094 / 0.0095; bf16 4k 0.0095, 2k 0.0110 vs
    # 0.0090 / 0.0093. Slower: not merged.
    "split_slice8k": [(SLICE, SLICE.replace("32 * 1024", "8 * 1024"))],  # few 8-32 KiB rows split
    "split_slice4k": [(SLICE, SLICE.replace("32 * 1024", "4 * 1024"))],
    "split_slice2k": [(SLICE, SLICE.replace("32 * 1024", "2 * 1024"))],
    "split_slice64k": [(SLICE, SLICE.replace("32 * 1024", "64 * 1024"))],
    # The forward's short-rows ring (1 or 4 KiB contiguous rows, kRowsRing): off (the team
    # kernel), or from other sizes per input. Session n, ring vs no_rows_ring (forward ms):
    # (262144, 256) fp32 0.1943 / 0.1942 vs 0.2016; (65536, 1024) fp32 0.1909 / 0.1910 vs
    # 0.1985; (131072, 512) bf16 0.1082 / 0.1081 vs 0.1097. Merged from 16 MiB. Session o, the
    # ring slower below 128 MiB: (16384, 256) fp32 0.0236 / 0.0234 vs 0.0211, (4096, 1024) fp32
    # 0.0237 vs 0.0221, (65536, 256) fp32 0.0601 / 0.0600 vs 0.0587, (16384, 1024) fp32 0.0603 /
    # 0.0601 vs 0.0586; from 4 MiB at (8192, 256) fp32 0.0165 vs 0.0146 (branch ring-threshold:
    # from 128 MiB). rows_ring_min16m: main's 16 MiB, to time these shapes with the ring.
    "no_rows_ring": [("constexpr bool kRowsRing = true;", "constexpr bool kRowsRing = false;")],
    "rows_ring_min16m": [ROWS_RING_16M],
    "rows_ring_min64m": [(ROWS_RING_MIN, ROWS_RING_MIN.replace("int64_t(128) << 20", "int64_t(64) << 20"))],
    # Why the ring loses below 128 MiB is not known. At 64 MiB its 1024 blocks of 8 chunks run in
    # about 4 waves of 264 resident blocks (2 per SM), and each block fills its ring once. With
    # the ring from 16 MiB (time at 65536x256 / 16384x1024 fp32 against no_rows_ring), try
    # longer blocks: 16 chunks each (512 blocks at 64 MiB), or one wave (chunks / 264 each).
    "rows_ring_per16": [ROWS_RING_16M, (ROWS_RING_PER_BLOCK, ROWS_RING_PER_BLOCK.replace(
        "min<int64_t>(8, chunks / kFillBlocks)", "min<int64_t>(16, chunks / 512)"))],
    "rows_ring_one_wave": [ROWS_RING_16M, (ROWS_RING_PER_BLOCK,
                                           "ring.per_block = (chunks + 263) / 264;")],
    "split_ldg": [("          if (bulk) {\n            launch_forward_bulk",
                   "          if (false) {\n            launch_forward_bulk")],
    # backward (time with --backward): the bulk-copy ring's shape, stores, register loads
    "bwd_ring_4k_x6": [(BWD_STAGES, BWD_STAGES.replace("4", "6"))],  # 72 KiB: 3 blocks per SM
    "bwd_ring_8k_x4": [(BWD_CHUNK, BWD_CHUNK.replace("4096", "8192"))],  # 96 KiB: 2 per SM
    "bwd_ring_4k_x8": [(BWD_STAGES, BWD_STAGES.replace("4", "8"))],  # 96 KiB: 2 per SM
    "bwd_ring_2k_x8": [(BWD_CHUNK, BWD_CHUNK.replace("4096", "2048")),
                       (BWD_STAGES, BWD_STAGES.replace("4", "8"))],  # 48 KiB: 4 per SM
    "bwd_ring_4k_x3": [(BWD_STAGES, BWD_STAGES.replace("4", "3"))],  # 36 KiB: 6 per SM
    # Evict-first gradient stores for every type (main before branch plain-stores: plain stores
    # except fp64).
    "cs_stores": [("constexpr bool kPlainStores = true;", "constexpr bool kPlainStores = false;")],
    "bwd_plain_stores": [("__stcs(reinterpret_cast<uint4*>(ptr), raw);",
                          "*reinterpret_cast<uint4*>(ptr) = raw;")],
    "team_by_length": [(TEAM_FILL, TEAM_FILL.replace("kFillBlocks;", "0;"))],  # before
    # The pointwise backward's reach (branch pointwise-all: every size up to 2^31 packs per
    # input; the flat bulk-copy backward removed). Before: up to 16 MiB per input (session h;
    # 8 / 32 MiB and none timed), then the flat ring (short rows, split rows, fewer than 1024
    # rows) or the row ring (>= 1024 whole rows of >= 8 KiB). Up to 1 GiB, fwd+bwd ms: session n
    # (1 pack, no-allocate loads, evict-first stores) (262144, 256) fp32 0.5885 vs 0.5904 /
    # 0.5908, (65536, 1024) bf16 0.3117 vs 0.3088 / 0.3081; session o (2 packs) (32768, 8192)
    # fp32 2.2928 vs 2.2725 / 2.2722; session p (plain stores; Inductor's backward there is one
    # pointwise kernel, 1.510 ms a call against our row ring's 1.554,
    # results/h200_inductor_32768x8192_fp32_2026-11-30p.txt): no-allocate loads 2.2980, in
    # order 2.2818, plain loads 2.2497 / 2.2499 vs the ring's 2.2731-2.2737 (compile 2.2557);
    # (262144, 256) fp32 0.5920 / 0.5905 / 0.5795 vs the flat ring's 0.5881 / 0.5886 (0.5787).
    # bwd_pointwise_max16m: back to 16 MiB; above it, whole rows of >= 8 KiB take the row ring
    # on sm_90 and the rest the register-load kernel (the flat ring is gone).
    "bwd_pointwise_max16m": [(PW_MAX, PW_MAX.replace("int64_t(1) << 31", "int64_t(1) << 20"))],
    # The pointwise blocks from the last one down, as the ring kernels walk (kBackwardFromEnd).
    # Session q, in order (now main) vs from the end: numbers at the pointwise kernel's block.
    "pointwise_from_end": [(PW_BLOCK, "const uint32_t block = gridDim.x - 1 - blockIdx.x;")],
    # The pointwise backward's loads as before session p (read-only, no L1 allocation).
    "pointwise_nc_loads": [("constexpr bool kPointwisePlainLoads = true;",
                            "constexpr bool kPointwisePlainLoads = false;")],
    # Every kernel's streaming loads plain. Session p, (32768, 8192) fp32: fwd+bwd 2.2734 vs
    # 2.2733 / 2.2737, forward 0.7145 vs 0.7148 / 0.7149: no change.
    # Session r (the team kernel): forward (262144, 256) bf16 0.1087 vs 0.1084 / 0.1082,
    # (65536, 1024) bf16 0.1064 vs 0.1082 / 0.1080; fwd+bwd (262144, 256) bf16 0.3018 vs
    # 0.3039 / 0.3028. Not landed (no device time left for the suite).
    "plain_loads": [(LOAD, "ld.global.v4.u32")],
    # The backward walks the rows in order, not from the last one down (kBackwardFromEnd: the
    # rows the forward read last may still be in L2). Session o: 0.07% slower at (32768, 8192)
    # fp32, 0.4-0.7% at (262144, 256) fp32 / (65536, 1024) bf16 (numbers at kBackwardFromEnd).
    "backward_in_order": [("constexpr bool kBackwardFromEnd = true;",
                           "constexpr bool kBackwardFromEnd = false;")],
    # Packs per thread in the pointwise backward (kPointwisePacks; Triton's gives a thread 8
    # elements, 2 fp32 packs). Session o: 2 faster than 1 at (4096, 512) (numbers there).
    "bwd_pointwise_x1": [(PW_PACKS, PW_PACKS.replace("2;", "1;"))],
    "bwd_pointwise_x4": [(PW_PACKS, PW_PACKS.replace("2;", "4;"))],
    # 8 elements per thread per input in every dtype, as Triton's: 1 pack for 2-byte types.
    # Session r, fwd+bwd ms vs base: (262144, 256) bf16 0.3026 vs 0.3044 / 0.3042, (65536, 1024)
    # bf16 0.3004 vs 0.3010 / 0.3013, (4096, 512) bf16 0.0221 vs 0.0205 / 0.0213: not kept.
    "bwd_pointwise_8elems": [("constexpr int kP = kPointwisePacks;",
                              "constexpr int kP = sizeof(T) < 4 ? 1 : kPointwisePacks;"),
                             ("constexpr int64_t kPerBlock = kPointwiseThreads * kPointwisePacks;",
                              "constexpr int64_t kPerBlock = kPointwiseThreads * "
                              "(sizeof(scalar_t) < 4 ? 1 : kPointwisePacks);")],
    # Where the small pointwise backward loses to Triton's (7.42 vs 4.91 us at (4096, 512) bf16;
    # not its load order: session h): gradients stored with plain stores instead of st.global.cs
    # (evict-first), and fp32 division by the distance as div.full.f32 (Triton's `/`: 2 ulp, full
    # range) or __fdividef (div.approx) instead of IEEE division with its slow path. Experiments,
    # not correct to the last bit; session i measured all three as noise (results/).
    "plain_stores": [(CS_STORE, "*reinterpret_cast<uint4*>(ptr) = raw;")],
    "full_div": [(L2_SCALE, "if constexpr (std::is_same_v<A, float>) { float q; asm(\"div.full.f32 %0, %1, %2;\" "
                            ": \"=f\"(q) : \"f\"(g), \"f\"(d)); return d == A(0) ? A(0) : q; }\n    "
                            "return d == A(0) ? A(0) : scale_div(g, d);")],
    "approx_div": [(L2_SCALE, "return d == A(0) ? A(0) : (std::is_same_v<A, float> ? "
                              "__fdividef(g, d) : g / d);")],
    # Before scale_div (session j, merged: no loss, within noise, results/): IEEE g / d for a zero
    # numerator too, which takes division's slow-path subroutine.
    "div_always": [("return (g == A(0) && x > A(0)) ? g : g / x;", "return g / x;")],
    # Forward teams for mid-length rows (session j, results/h200_variants_2026-11-29j.txt):
    # team8_16packs is the rule before, a team of 8 for up to 16 packs per thread per input
    # (65536 x 1024 bf16 forward: 0.1164 ms, against 0.1088 with a warp per row as merged);
    # tpr_8packs_warp also caps a warp at 8 packs (8 KiB rows: whole blocks, the bulk forward;
    # session k: much slower, (65536, 2048) fp32 0.5814 vs 0.3910 ms); tpr_4packs caps both at
    # 4 (65536 x 1024 fp32: 0.2396 vs 0.1990, slower);
    # fwd_unroll2 keeps 2 packs per input in flight instead of 4 (0.2017 vs 0.1990, no gain).
    "team8_16packs": [(TPR_RULE_FULL, TPR_RULE_FULL.replace("8 * 8", "8 * 16"))],
    "tpr_8packs_warp": [(TPR_RULE_FULL, TPR_RULE_FULL.replace("32 * 16", "32 * 8"))],
    "tpr_4packs": [(TPR_RULE_FULL, TPR_RULE_FULL.replace("8 * 8", "8 * 4").replace("32 * 16", "32 * 4"))],
    "fwd_unroll2": [(UNROLL, UNROLL.replace(": 4;", ": 2;"))],
    # Session m, not kept: more resident team-forward blocks by a register cap,
    # __launch_bounds__(256, 6) with 3 packs in flight (40 registers) or (256, 8) with 2 (32),
    # spill in every p = 2 / p = 1 instantiation (fp32 TPR 8: 32-56 bytes; sm_90 -Xptxas -v):
    # pointers, row sums and the swap distance need more than the loads.
    # The bulk forward's consumer loop, one pack of each input per iteration (not unrolled in the
    # SASS: each iteration waits on its shared-memory loads), unrolled by 2 (bf16: a thread's
    # 2 packs of each 8 KiB chunk in one iteration). Time at 32768x8192 bf16. Built for sm_90:
    # bf16 p = 2 48 registers, no spills; the double general-p instances spill (24 / 64 bytes),
    # so a merge would unroll only K != kOther. Session k: 0.4139 vs 0.4005 ms, slower, with the
    # 8 KiB ring; on the 4 KiB ring merged since, a bf16 thread has one pack per chunk.
    "bulk_unroll2": [(BULK_LOOP, BULK_LOOP.replace("\n", "\n#pragma unroll 2\n"))],
    # The forward's one-block follow-up ('mean' / 'sum' of block sums; split rows' combining)
    # launched plainly, not chained to its main grid (triplet_common.cuh). Session m, chained vs
    # this: (128, 4096) fp32 0.0093 vs 0.0108 ms, bf16 0.0091 vs 0.0100, (1024, 128) fp32 0.0069
    # vs 0.0084 (this script times ModelNew: 'mean').
    "unchain_follow_ups": [("constexpr bool kChainFollowUps = true;",
                            "constexpr bool kChainFollowUps = false;")],
}


def apply(name):
    """Builds variant `name`: VARIANTS' edits of the kernel sources, or `tree=DIR`: the kernel
    sources of another checkout (e.g. `git archive main | tar -x -C .ab/main`, for A/B)."""
    import fused_triplet as ft
    if name.startswith("tree="):
        folder = os.path.join(name.split("=", 1)[1], "kernels")
        for k in ft.KERNEL_SOURCES:
            with open(os.path.join(folder, k), encoding="utf-8") as f:
                ft.KERNEL_SOURCES[k] = f.read()
        ft.build()
        return ft
    for old, new in VARIANTS[name]:
        hits = [k for k, text in ft.KERNEL_SOURCES.items() if old in text]
        assert hits, f"{name}: {old!r} not found"
        for k in hits:
            ft.KERNEL_SOURCES[k] = ft.KERNEL_SOURCES[k].replace(old, new)
    ft.build()
    return ft


def time_one(name, shape, dtype_name, backward=False, margin=1.0, swap=False, rounds=50):
    import torch
    from bench import DEVICE_LEAD_CYCLES
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    torch.manual_seed(0)
    a = (torch.rand(shape, device="cuda") * torch.rand((), device="cuda")).to(dtype)
    p = torch.rand(shape, device="cuda").to(dtype)
    n = torch.rand(shape, device="cuda").to(dtype)
    if name == "torch.compile":
        fn = torch.compile(torch.nn.TripletMarginLoss(margin=margin, swap=swap))
    else:  # swap: the module (ModelNew, KernelBench's, has no swap)
        ft = apply(name)
        fn = ft.TripletMarginLoss(margin=margin, swap=True) if swap else ft.ModelNew(margin)
    if backward:  # forward + backward, grads of all three inputs
        loss_fn = fn
        a, p, n = (x.requires_grad_() for x in (a, p, n))

        def fn(a, p, n):
            for x in (a, p, n):
                x.grad = None  # a fresh gradient each call (no accumulation pass)
            loss = loss_fn(a, p, n)
            loss.backward()
            return loss.detach()
    ref = torch.nn.TripletMarginLoss(margin=margin, swap=swap)(a, p, n)
    active = (torch.nn.functional.triplet_margin_loss(a, p, n, margin=margin, swap=swap,
                                                      reduction="none")
              > 0).float().mean().item()
    out = fn(a, p, n)
    err = (out.double() - ref.double()).abs().item()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(5):
        fn(a, p, n)
    times = []
    for _ in range(rounds):
        flush.zero_()
        torch.cuda._sleep(DEVICE_LEAD_CYCLES)  # host queues the whole call first: device time
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn(a, p, n)
        e.record()
        times.append((s, e))
    torch.cuda.synchronize()
    ms = statistics.median(x.elapsed_time(y) for x, y in times)
    nbytes = (9 if backward else 3) * a.numel() * a.element_size()
    print(f"{name:>18} {ms:8.4f} ms {nbytes / ms / 1e9:6.3f} TB/s  err {err:.1e}  "
          f"active rows {active:.0%}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="32768x8192")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--only", default="")
    parser.add_argument("--backward", action="store_true", help="time forward + backward")
    parser.add_argument("--margin", type=float, default=1.0)
    parser.add_argument("--swap", action="store_true", help="the loss with swap=True")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "NAME"))
    args = parser.parse_args()
    shape = tuple(int(v) for v in args.shape.split("x"))
    if args.child:
        mode, name = args.child
        if mode == "build":
            apply(name)
        else:
            time_one(name, shape, args.dtype, args.backward, args.margin, args.swap)
        return
    wanted = args.only.split(",") if args.only else []
    names = [n for n in VARIANTS if not wanted or n in wanted]
    names += [n for n in wanted if n.startswith("tree=")]
    me = [sys.executable, os.path.abspath(__file__), "--shape", args.shape, "--dtype", args.dtype,
          "--margin", str(args.margin)] + (["--swap"] if args.swap else [])
    me += ["--backward"] if args.backward else []
    builds = [subprocess.Popen(me + ["--child", "build", n], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True) for n in names]
    for n, proc in zip(names, builds):
        _, err = proc.communicate()
        if proc.returncode:
            print(f"{n}: build failed\n{err[-3000:]}")
    print(f"shape {args.shape} {args.dtype}")
    for n in ["torch.compile"] + names + ["base"]:
        subprocess.run(me + ["--child", "time", n])


if __name__ == "__main__":
    main()
