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

SPLIT_BLOCKS = "constexpr int64_t kSplitBlocks = 512;"

VARIANTS = {
    "base": [],
    # Forward: register loads instead of the copy-engine ring, ring shapes, team and split rules.
    "nobulk": [(BULK, "return false &&")],
    "bulk_16k_x2": [(CHUNK, CHUNK.replace("8192", "16384")), (STAGES, STAGES.replace("4", "2"))],
    "bulk_4k_x8": [(CHUNK, CHUNK.replace("8192", "4096")), (STAGES, STAGES.replace("4", "8"))],
    "bulk_8k_x6": [(STAGES, STAGES.replace("4", "6"))],
    "bulk_4k_x4": [(CHUNK, CHUNK.replace("8192", "4096"))],
    "fwd_chunk_8k_all": [(CHUNK, CHUNK.replace("4096", "8192"))],
    "bulk_persist2": [(GRID, "std::min<int64_t>(row_groups, 132 * 2)")],
    "split_fill512": [(FILL, FILL.replace("1024", "512"))],
    "split_blocks1024": [(SPLIT_BLOCKS, SPLIT_BLOCKS.replace("512", "1024"))],
    "split_blocks256": [(SPLIT_BLOCKS, SPLIT_BLOCKS.replace("512", "256"))],
    "split_slice8k": [(SLICE, SLICE.replace("32 * 1024", "8 * 1024"))],
    "split_ldg": [("          if (bulk) {\n            launch_forward_bulk",
                   "          if (false) {\n            launch_forward_bulk")],
    "no_rows_ring": [("constexpr bool kRowsRing = true;", "constexpr bool kRowsRing = false;")],
    "rows_ring_min16m": [ROWS_RING_16M],
    "team_by_length": [(TEAM_FILL, TEAM_FILL.replace("kFillBlocks;", "0;"))],
    "team8_16packs": [(TPR_RULE_FULL, TPR_RULE_FULL.replace("8 * 8", "8 * 16"))],
    "fwd_unroll2": [(UNROLL, UNROLL.replace(": 4;", ": 2;"))],
    "unchain_follow_ups": [("constexpr bool kChainFollowUps = true;",
                            "constexpr bool kChainFollowUps = false;")],
    # Loads and stores.
    "plain_loads": [(LOAD, "ld.global.v4.u32")],
    "cs_stores": [("constexpr bool kPlainStores = true;", "constexpr bool kPlainStores = false;")],
    # Backward (time with --backward).
    "bwd_ring_4k_x6": [(BWD_STAGES, BWD_STAGES.replace("4", "6"))],
    "bwd_ring_8k_x4": [(BWD_CHUNK, BWD_CHUNK.replace("4096", "8192"))],
    "bwd_pointwise_max16m": [(PW_MAX, PW_MAX.replace("int64_t(1) << 31", "int64_t(1) << 20"))],
    "pointwise_from_end": [(PW_BLOCK, "const uint32_t block = gridDim.x - 1 - blockIdx.x;")],
    "pointwise_nc_loads": [("constexpr bool kPointwisePlainLoads = true;",
                            "constexpr bool kPointwisePlainLoads = false;")],
    "backward_in_order": [("constexpr bool kBackwardFromEnd = true;",
                           "constexpr bool kBackwardFromEnd = false;")],
    "bwd_pointwise_x1": [(PW_PACKS, PW_PACKS.replace("2;", "1;"))],
    "bwd_pointwise_x4": [(PW_PACKS, PW_PACKS.replace("2;", "4;"))],
    "div_always": [("return (g == A(0) && x > A(0)) ? g : g / x;", "return g / x;")],
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
        torch.cuda._sleep(DEVICE_LEAD_CYCLES)  # host issues the whole call first: GPU time
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
