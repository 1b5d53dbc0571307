"""A/B this checkout's kernels against other checkouts', in one process, over the sweep's cases.

    mkdir /tmp/main && git archive main fused_triplet.py kernels | tar -x -C /tmp/main
    python scripts/ab.py --base /tmp/main [--base other=/tmp/other ...] [--shapes 262144x256,...]
                         [--dtypes fp32,bf16] [--modes forward,fwd+bwd] [--rounds 30] [--json ab.json]

Each other checkout's fused_triplet.py and kernels are copied with their op namespace renamed
(fused_triplet -> ft_<name>; a plain folder is named "base"), so all the libraries load side by
side; they build in parallel. Each case times them all with bench.py's method (interleaved rounds,
L2 flushed, GPU time), and prints new / the first base: below 1 the new kernels are faster.
Add --compile to time torch.compile too. --mining: mined_triplet_margin_loss's fwd+bwd over
bench.py's mining cases instead, with each library's peak extra memory.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def renamed_copy(base: str, module: str, folder: str) -> None:
    """The base checkout's module and kernels with the namespace renamed to `module`, under
    folder/module (its own folder: the module reads kernels/ beside itself)."""
    folder = os.path.join(folder, module)
    for name in ["fused_triplet.py"] + [os.path.join("kernels", f) for f in
                                        os.listdir(os.path.join(base, "kernels"))]:
        with open(os.path.join(base, name), encoding="utf-8") as f:
            text = f.read().replace("fused_triplet", module)
        target = os.path.join(folder, name.replace("fused_triplet", module))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w", encoding="utf-8") as f:
            f.write(text)


def main() -> int:
    import bench

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, action="append",
                        help="another checkout's root folder, as FOLDER or NAME=FOLDER")
    parser.add_argument("--shapes", help=f"default {bench.SWEEP_SHAPES}; with --mining, "
                        "those of its cases to time (default all)")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--modes", default="forward,fwd+bwd",
                        help="forward, fwd+bwd (loss.backward()), weighted ((0.5 * loss).backward()), "
                        "alternating (upstream gradients 1 and 0.5 in turn)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--compile", action="store_true", help="time torch.compile as well")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--minings", help="with --mining, those of its losses to time "
                        "(default all), e.g. batch_hard")
    parser.add_argument("--mining", action="store_true",
                        help="mined_triplet_margin_loss over bench.py's mining cases")
    args = parser.parse_args()

    import torch
    import fused_triplet

    folder = tempfile.mkdtemp(prefix="ft_ab_")
    bases = {}
    for spec in args.base:
        name, _, path = spec.rpartition("=")
        module = "ft_" + (name or "base")
        renamed_copy(path, module, folder)
        bases[name or "base"] = module
    # Build all at once, each in its own process (a process registers an op namespace once).
    where = {m: os.path.join(folder, m) for m in bases.values()}
    where["fused_triplet"] = ROOT
    builds = {m: subprocess.Popen([sys.executable, "-c", f"import {m}; {m}.build()"], cwd=cwd,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for m, cwd in where.items()}
    for name, proc in builds.items():
        out, _ = proc.communicate()
        if proc.returncode:
            print(f"{name}: build failed\n{out[-3000:]}")
            return 1
    libraries = {}
    for name, module in bases.items():
        sys.path.insert(0, where[module])
        libraries[name] = importlib.import_module(module)
        libraries[name].build()
    fused_triplet.build()
    libraries["new"] = fused_triplet
    first = next(iter(bases))

    if args.mining:
        rows = ab_mining(libraries, first, args.rounds, args.shapes, args.minings)
        args.modes = ""
    else:
        rows = []
    names = list(libraries) + (["compile"] if args.compile else [])
    if args.modes:
        print(f"{'mode':>8} {'shape':>12} {'dtype':>8} " + " ".join(f"{n[:9]:>9}" for n in names)
              + f" {'new/' + first[:4]:>8}")
    for mode in filter(None, args.modes.split(",")):
        for dtype_name in args.dtypes.split(","):
            for shape in bench.parse_shapes(args.shapes or bench.SWEEP_SHAPES):
                dtype = bench.DTYPES[dtype_name]
                inputs = bench.make_inputs(shape, dtype)
                modules = {name: lib.TripletMarginLoss() for name, lib in libraries.items()}
                if args.compile:
                    torch._dynamo.reset()
                    modules["compile"] = torch.compile(torch.nn.TripletMarginLoss())
                if mode == "forward":
                    fns = modules
                    ctx = torch.no_grad
                else:
                    inputs = [x.requires_grad_() for x in inputs]
                    weights = {"weighted": [0.5], "alternating": [1.0, 0.5]}.get(mode, [1.0])

                    def step_of(module):
                        calls = [0]

                        def step(*xs):
                            for x in xs:
                                x.grad = None
                            loss = module(*xs)
                            weight = weights[calls[0] % len(weights)]
                            calls[0] += 1
                            (loss if weight == 1.0 else weight * loss).backward()
                        return step
                    fns = {name: step_of(m) for name, m in modules.items()}
                    ctx = torch.enable_grad
                with ctx():
                    row = timed_row({"mode": mode, "shape": list(shape), "dtype": dtype_name},
                                    fns, inputs, first, args.rounds, 5)
                del inputs
                report(rows, row, f"{mode:>8} {'x'.join(map(str, shape)):>12} {dtype_name:>8} "
                       + " ".join(f"{row[n]:>9.4f}" for n in names))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1)
    shutil.rmtree(folder, ignore_errors=True)
    return 0


def timed_row(row: dict, fns: dict, inputs, first: str, rounds: int, warmup: int,
              **timing) -> dict:
    """row with each contender's median ms (bench.py's interleaved timing) and new / first."""
    import bench

    times = bench.time_interleaved(fns, inputs, rounds, warmup, **timing)
    ms = {name: statistics.median(t) for name, t in times.items()}
    return {**row, **ms, "new_over_base": ms["new"] / ms[first]}


def report(rows: list, row: dict, cells: str) -> None:
    """row kept and printed after its cells, with new / first; the case's memory released."""
    import torch

    rows.append(row)
    print(f"{cells} {row['new_over_base']:>8.3f}", flush=True)
    torch.cuda.empty_cache()


def ab_mining(libraries: dict, first: str, rounds: int, shapes: str | None,
              minings: str | None = None) -> list:
    """Each library's mined loss, fwd+bwd of the mean, on bench.py's mining cases: median ms
    (interleaved, as bench.py times them) and peak extra memory."""
    import bench
    import torch

    rows = []
    print(f"{'mining':>10} {'shape':>10} {'dtype':>6} "
          + " ".join(f"{n[:9]:>9} {'MiB':>7}" for n in libraries) + f" {'new/' + first[:4]:>8}")
    for mining, batch, dim, dtype_name in bench.MINING_CASES:
        if shapes and f"{batch}x{dim}" not in shapes.split(","):
            continue
        if minings and mining not in minings.split(","):
            continue
        torch.manual_seed(0)
        e = torch.randn(batch, dim, device="cuda").to(bench.DTYPES[dtype_name]).requires_grad_()
        labels = (torch.arange(batch, device="cuda") // 8)[torch.randperm(batch, device="cuda")]

        def step_of(lib, mining=mining):
            def step(x, y):
                x.grad = None
                lib.mined_triplet_margin_loss(x, y, mining).backward()
            return step
        fns = {name: step_of(lib) for name, lib in libraries.items()}
        extra = {}
        for name, fn in fns.items():
            fn(e, labels)
            e.grad = None
            extra[name] = bench.peak_extra(fn, e, labels)[1] / 2**20
        row = timed_row({"mode": f"mined {mining}", "shape": [batch, dim], "dtype": dtype_name,
                         "extra_mib": extra}, fns, (e, labels), first,
                        rounds if batch <= 16384 else 5, 2, lead_factor=bench.MINING_LEAD_FACTOR)
        del e
        report(rows, row, f"{mining:>10} {batch}x{dim:<5} {dtype_name:>6} "
               + " ".join(f"{row[n]:>9.4f} {extra[n]:>7.0f}" for n in libraries))
    return rows


if __name__ == "__main__":
    sys.exit(main())
