"""Per-kernel GPU times of one forward + backward (or forward) case, for finding which kernel a
slow bench.py row spends its time in. A diagnosis aid, not part of the library.

    python scripts/profile_case.py [--shape 65536x1024] [--dtype bf16] [--forward-only]
        [--contender fused|compile|eager] [--rounds 10] [--timeline]

Prints torch.profiler's table of CUDA kernels (total and per-call GPU time) over `rounds`
steps after a warm-up, with the L2 flushed before each step as bench.py does. --timeline: the
device sleeps 5 ms before each step so the host is ahead, and one step's kernels are listed in
order with their median durations and the idle gaps between them (what bench.py's GPU time
adds up; for comparing the kernels of two contenders one for one).
"""

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fused_triplet  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="65536x1024")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--contender", default="fused", choices=["fused", "compile", "eager"])
    parser.add_argument("--forward-only", action="store_true")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--timeline", action="store_true")
    parser.add_argument("--mining", choices=["batch_hard", "batch_all"],
                        help="mined_triplet_margin_loss on (B, D) embeddings, 8 per class")
    args = parser.parse_args()
    shape = tuple(int(v) for v in args.shape.split("x"))
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    a = (torch.rand(shape, device="cuda") * torch.rand((), device="cuda")).to(dtype)
    p = torch.rand(shape, device="cuda").to(dtype)
    n = torch.rand(shape, device="cuda").to(dtype)
    module = {"fused": fused_triplet.TripletMarginLoss(),
              "compile": torch.compile(torch.nn.TripletMarginLoss()),
              "eager": torch.nn.TripletMarginLoss()}[args.contender]
    if not args.forward_only:
        a, p, n = (x.requires_grad_() for x in (a, p, n))
    if args.mining:  # a is the embeddings, p stands in for the labels
        p = (torch.arange(shape[0], device="cuda") // 8)[torch.randperm(shape[0], device="cuda")]
        n = a
        module = lambda e, labels, _: fused_triplet.mined_triplet_margin_loss(  # noqa: E731
            e, labels, args.mining)

    def step():
        for x in (a, p, n):
            x.grad = None
        if args.forward_only:
            with torch.no_grad():
                return module(a, p, n)
        loss = module(a, p, n)
        loss.backward()
        return loss

    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.rounds):
            flush.zero_()
            if args.timeline:
                torch.cuda._sleep(10_000_000)  # the host issues the whole step meanwhile
            step()
        flush.zero_()  # ends the last step's kernel list
        torch.cuda.synchronize()
    print(f"{args.contender} {args.shape} {args.dtype} "
          f"{'forward' if args.forward_only else 'forward + backward'}, {args.rounds} rounds")
    if args.timeline:
        print_timeline(prof)
    else:
        print(prof.key_averages().table(sort_by="device_time_total", row_limit=15,
                                        max_name_column_width=90))


def print_timeline(prof):
    """One step's kernels in order (the ones between a sleep and the next flush): median
    duration of each and of the idle gap before it, over the profiled steps."""
    kernels = sorted((e for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA and "Mem" not in e.name),
                     key=lambda e: e.time_range.start)
    steps = []
    for e in kernels:
        if "spin" in e.name.lower() or "sleep" in e.name.lower():  # torch.cuda._sleep's kernel
            steps.append([])
        elif steps:
            steps[-1].append(e)
    steps = [s[:-1] for s in steps]  # drop the flush that follows each step
    for i, e in enumerate(steps[0]):
        dur = statistics.median(s[i].time_range.elapsed_us() for s in steps)
        gap = statistics.median(s[i].time_range.start - s[i - 1].time_range.end
                                for s in steps) if i else 0.0
        print(f"  gap {gap:6.2f} us  kernel {dur:6.2f} us  {e.name[:80]}")
    span = statistics.median(s[-1].time_range.end - s[0].time_range.start for s in steps)
    print(f"  first kernel start to last kernel end: {span:.2f} us")


if __name__ == "__main__":
    main()
