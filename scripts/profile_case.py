"""Per-kernel GPU times of one forward + backward (or forward) case, for finding which kernel a
slow bench.py row spends its time in. A diagnosis aid, not part of the library.

    python scripts/profile_case.py [--shape 65536x1024] [--dtype bf16] [--forward-only]
        [--contender fused|compile|eager] [--rounds 10]

Prints torch.profiler's table of CUDA kernels (total and per-call device time) over `rounds`
steps after a warm-up, with the L2 flushed before each step as bench.py does.
"""

import argparse
import os
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
            step()
        torch.cuda.synchronize()
    print(f"{args.contender} {args.shape} {args.dtype} "
          f"{'forward' if args.forward_only else 'forward + backward'}, {args.rounds} rounds")
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=15, max_name_column_width=90))


if __name__ == "__main__":
    main()
