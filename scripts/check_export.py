"""KernelBench-style check of the one-file export (level 1 problem 99) on a GPU.

Exports fused_triplet into a scratch folder, then in a fresh process whose path does not hold the
project, loads the file as KernelBench does (exec, take ModelNew), checks 5 seeded trials
against torch.nn.TripletMarginLoss at atol = rtol = 1e-4 and times 100 trials (CUDA events,
L2 flushed before each); then times the package's ModelNew the same way.

    python scripts/check_export.py
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH, DIM, MARGIN = 32768, 8192, 1.0


def get_inputs():
    import torch
    a = torch.rand(BATCH, DIM) * torch.rand(())
    return [x.cuda() for x in (a, torch.rand(BATCH, DIM), torch.rand(BATCH, DIM))]


def run_child(source_kind, path):
    import torch
    if source_kind == "export":
        import importlib.util
        assert importlib.util.find_spec("fused_triplet") is None, "the project must not be importable"
        namespace = {}
        exec(compile(open(path).read(), path, "exec"), namespace)
        model_new = namespace["ModelNew"](MARGIN)
    else:
        sys.path.insert(0, ROOT)
        import fused_triplet
        model_new = fused_triplet.ModelNew(MARGIN)
    reference = torch.nn.TripletMarginLoss(margin=MARGIN)
    errors = []
    for trial in range(5):
        torch.manual_seed(trial)
        inputs = get_inputs()
        ref, out = reference(*inputs), model_new(*inputs)
        assert torch.allclose(ref, out, atol=1e-4, rtol=1e-4), (trial, ref.item(), out.item())
        errors.append(abs(ref.item() - out.item()))
    torch.manual_seed(42)
    inputs = get_inputs()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        model_new(*inputs)
    times = []
    for _ in range(100):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model_new(*inputs)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    print(json.dumps({"source": source_kind, "max_abs_err_5_seeds": max(errors),
                      "mean_ms": statistics.mean(times), "median_ms": statistics.median(times)}))


def main():
    if len(sys.argv) == 3:
        run_child(sys.argv[1], sys.argv[2])
        return
    scratch = tempfile.mkdtemp(prefix="kernelbench_")
    path = os.path.join(scratch, "model_new.py")
    subprocess.run([sys.executable, os.path.join(ROOT, "fused_triplet.py"), "--export", path],
                   check=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    me = os.path.abspath(__file__)
    for kind in ("export", "package", "package", "export"):  # twice each, both orders
        subprocess.run([sys.executable, me, kind, path], cwd=scratch, env=env, check=True)


if __name__ == "__main__":
    main()
