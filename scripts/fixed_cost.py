"""Split a forward's GPU time into a per-byte part and a fixed part, and measure how much of
the fixed part is the L2 flush's dirty lines. A diagnosis aid, not part of the library.

    python scripts/fixed_cost.py [--cases 262144x256:bf16,...] [--scales 1,4] [--compile]

bench.py flushes the L2 with a 256 MiB write (flush.zero_()), so each timed call starts with the
L2 full of dirty lines that it must write back to DRAM as its reads evict them. Each case is
timed ('mean', no grad; contenders interleaved, median of `rounds`, the device asleep ~1 ms
before each start event as in bench.py) after two flushes:
  write: flush.zero_(), bench.py's;
  clean: flush.zero_(), then a read of another 256 MiB buffer (the L2 holds clean lines).
and at `scales` x the rows, so t = fixed + bytes / bandwidth fits from the sizes: the slope is
the kernel's streaming bandwidth, the intercept its fixed cost (launch, ramp, tail, follow-up
kernel, the events themselves). "events" is an empty pair of events after the same flush;
"sum(same bytes)" is torch.sum over one fp32 buffer of the case's input bytes (a plain read).
"""

import argparse
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import bench  # noqa: E402
import fused_triplet  # noqa: E402

CASES = ("32768x8192:fp32,262144x256:fp32,262144x256:bf16,65536x1024:fp32,65536x1024:bf16,"
         "16x4194304:fp32,16x4194304:bf16,4x16777216:fp32,4x16777216:bf16")


def time_flushed(fns, args, flush_mode, rounds=30, warmup=3):
    """{name: median ms} with bench.py's timing, after its flush or a clean one."""
    after_flush = None
    if flush_mode == "clean":
        clean = torch.ones(256 << 20, dtype=torch.uint8, device="cuda")
        after_flush = clean.max  # reads 256 MiB: evicts the dirty lines before the clock starts
    times = bench.time_interleaved(fns, args, rounds, warmup, after_flush)
    return {name: statistics.median(ms) for name, ms in times.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=CASES)
    parser.add_argument("--scales", default="1,4")
    parser.add_argument("--compile", action="store_true", help="time torch.compile too")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    ours = fused_triplet.TripletMarginLoss()
    print(f"{'case':>22} {'rows x':>6} {'MB':>7} {'flush':>6} {'contender':>14} {'ms':>8} "
          f"{'TB/s':>6}", flush=True)
    for case in args.cases.split(","):
        shape_text, dtype_name = case.split(":")
        rows, dim = (int(v) for v in shape_text.split("x"))
        fits = {}
        for scale in (int(s) for s in args.scales.split(",")):
            inputs = bench.make_inputs((rows * scale, dim), bench.DTYPES[dtype_name])
            nbytes = sum(x.numel() * x.element_size() for x in inputs)
            # torch.sum over one buffer of the same bytes: a plain streaming read, for a floor.
            same_bytes = torch.rand(nbytes // 4, device="cuda")
            fns = {"fused_triplet": ours, "events": lambda *xs: None,
                   "sum(same bytes)": lambda *xs: same_bytes.sum()}
            if args.compile:
                torch._dynamo.reset()
                fns["torch.compile"] = torch.compile(torch.nn.TripletMarginLoss())
            with torch.no_grad():
                for mode in ("write", "clean"):
                    for name, ms in time_flushed(fns, inputs, mode, args.rounds).items():
                        tbps = nbytes / ms / 1e9 if name != "events" else float("nan")
                        print(f"{case:>22} {scale:>6} {nbytes / 1e6:7.1f} {mode:>6} {name:>14} "
                              f"{ms:8.4f} {tbps:6.2f}", flush=True)
                        fits.setdefault((mode, name), []).append((nbytes, ms))
            del inputs, same_bytes
        for (mode, name), points in fits.items():
            if name == "events" or len(points) < 2:
                continue
            (b0, t0), (b1, t1) = points[0], points[-1]
            slope = (t1 - t0) / (b1 - b0)  # ms per byte
            print(f"{case:>22} fit {mode:>6} {name:>14}: streaming {1 / slope / 1e9:.2f} TB/s, "
                  f"fixed {(t0 - slope * b0) * 1e3:.1f} us", flush=True)


if __name__ == "__main__":
    main()
