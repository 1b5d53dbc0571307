"""KernelBench's check of the KernelBench file (level 1 problem 99) on a GPU.

Writes the KernelBench file (`fused_triplet.py --export PATH --kernelbench`) into a scratch
folder and prints KernelBench's static check of it (its errors and warnings,
tests/kernelbench_rules.py). Then, each in a fresh process whose path does not hold the project,
as KernelBench's eval runs a submission: the file's first build (timed, into an empty extension
folder), exec and ModelNew, 5 seeded trials against torch.nn.TripletMarginLoss at
atol = rtol = 1e-4, and 100 timed trials (CUDA events, a 256 MiB fill before each, the mean as
KernelBench reports it); the same timing for torch.compile and eager torch. With --full, the
whole library's export instead of the KernelBench file.

    python scripts/check_export.py [--full]
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH, DIM, MARGIN = 32768, 8192, 1.0
# What KernelBench's checker counts as errors (its STRICT_CHECKS); the rest it warns about.
STRICT = {"try/except", "pass statement", "concurrency", "tensor subclass", "timing reassignment"}


def get_inputs():
    import torch
    a = torch.rand(BATCH, DIM) * torch.rand(())
    return [x.cuda() for x in (a, torch.rand(BATCH, DIM), torch.rand(BATCH, DIM))]


def run_child(kind, path):
    import torch
    reference = torch.nn.TripletMarginLoss(margin=MARGIN)
    built = None
    if kind == "submission":
        import importlib.util
        assert importlib.util.find_spec("fused_triplet") is None, "the project must not be importable"
        namespace = {}
        start = time.monotonic()
        exec(compile(open(path).read(), path, "exec"), namespace)
        model = namespace["ModelNew"](MARGIN)
        model(*(torch.rand(2, 8, device="cuda") for _ in range(3)))  # the first build
        torch.cuda.synchronize()
        built = time.monotonic() - start
    elif kind == "torch.compile":
        model = torch.compile(torch.nn.TripletMarginLoss(margin=MARGIN))
    else:
        model = reference
    errors = []
    for trial in range(5):
        torch.manual_seed(trial)
        inputs = get_inputs()
        ref, out = reference(*inputs), model(*inputs)
        assert torch.allclose(ref, out, atol=1e-4, rtol=1e-4), (trial, ref.item(), out.item())
        errors.append(abs(ref.item() - out.item()))
    torch.manual_seed(42)
    inputs = get_inputs()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        model(*inputs)
    times = []
    for _ in range(100):
        torch.cuda.synchronize()
        flush.fill_(1)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model(*inputs)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    print(json.dumps({"contender": kind, "first_build_s": built,
                      "max_abs_err_5_seeds": max(errors), "mean_ms": statistics.mean(times),
                      "median_ms": statistics.median(times)}), flush=True)


def main():
    if len(sys.argv) == 3 and not sys.argv[1].startswith("--"):
        run_child(sys.argv[1], sys.argv[2])
        return
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from kernelbench_rules import precision_downgrades, violations

    scratch = tempfile.mkdtemp(prefix="kernelbench_")
    path = os.path.join(scratch, "model_new.py")
    export = [sys.executable, os.path.join(ROOT, "fused_triplet.py"), "--export", path]
    subprocess.run(export + ([] if "--full" in sys.argv else ["--kernelbench"]), check=True)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    found = violations(text)
    errors = sorted({v for v in found if v.split(":")[0] in STRICT})
    warnings = sorted({v for v in found if v.split(":")[0] not in STRICT} |
                      {"precision downgrade: " + m for m in precision_downgrades(text)})
    print(f"static check: {'valid' if not errors else 'INVALID'}, {len(errors)} errors, "
          f"{len(warnings)} warnings")
    for line in errors + warnings:
        print(f"  {line}")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TORCH_EXTENSIONS_DIR"] = os.path.join(scratch, "ext")  # a first build, as the eval's
    me = os.path.abspath(__file__)
    for kind in ("submission", "torch.compile", "eager"):
        subprocess.run([sys.executable, me, kind, path], cwd=scratch, env=env, check=True)


if __name__ == "__main__":
    main()
