"""Time kernel variants on one shape: each variant is the kernel source with textual edits,
built in parallel (one process each: the op namespace can be registered once per process), then
timed one after another on the GPU against torch.compile. A tuning aid, not part of the library.

    python scripts/variants.py [--shape 32768x8192] [--dtype fp32] [--only a,b] [--backward]
                               [--margin 1.0] [--swap]  # margin 0.001: about half the hinges
                                                        # inactive

`--only base,tree=/path/to/other/checkout` times this checkout's kernels against another's.
"""

import argparse
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

RING = "if (ring_pays(pr, g) && !forward_unfit(pr, g, ForwardFamily::kRing)) {"
CHUNK = "kRingChunkBytes = 8192,"
STAGES = "kRingStages = 4,"
UNROLL = "constexpr int kForwardUnrollElems = 16;"
ROWS_BLOCKS = "kRowsMinBlocksSm90 = 4,"
SPLIT_BLOCKS = "kSplitBlocks = 512,"
FILL = "constexpr int64_t kFillBlocks = 1024;"
PW_PACKS = "kPointwisePacks = 2;"
FOLD = "constexpr int kFoldPacks = 4;"

VARIANTS = {
    "base": [],
    "no_ring": [(RING, RING.replace("if (ring_pays", "if (false && ring_pays"))],  # register loads
    "ring_chunk_4k": [(CHUNK, CHUNK.replace("8192", "4096"))],
    "ring_stages_6": [(STAGES, STAGES.replace("4", "6"))],
    "fwd_unroll_8_elems": [(UNROLL, UNROLL.replace("16;", "8;"))],
    "rows_3_blocks": [(ROWS_BLOCKS, ROWS_BLOCKS.replace("4,", "3,"))],
    "split_blocks1024": [(SPLIT_BLOCKS, SPLIT_BLOCKS.replace("512", "1024"))],
    "split_blocks256": [(SPLIT_BLOCKS, SPLIT_BLOCKS.replace("512", "256"))],
    "fill_512": [(FILL, FILL.replace("1024", "512"))],
    "bwd_pointwise_x1": [(PW_PACKS, PW_PACKS.replace("2;", "1;"))],
    "bwd_pointwise_x4": [(PW_PACKS, PW_PACKS.replace("2;", "4;"))],
    "fold_every_pack": [(FOLD, FOLD.replace("4;", "1;"))],
}


def apply(name):
    """Builds variant `name`: VARIANTS' edits of the kernel sources, or `tree=DIR`: the kernel
    sources of another checkout (scripts/ab.py times two checkouts in one process)."""
    import fused_triplet as ft
    if name.startswith("tree="):
        folder = os.path.join(name.split("=", 1)[1], "kernels")
        ft.KERNEL_SOURCES.clear()
        for k in sorted(os.listdir(folder)):
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
