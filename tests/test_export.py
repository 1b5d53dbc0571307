"""The one-file export: self-contained, same results as the package, within KernelBench's rules."""

import os
import re
import subprocess
import sys

import pytest
import torch

import fused_triplet as ft
from conftest import HAS_CUDA, ROOT

# ---- KernelBench's static rules for CUDA submissions, as the issue lists them. The harness
# strips from the first '#' or '//' of every line (even inside strings), then searches.

ALLOWED_NN = r"(Module|parameter|Parameter|ParameterList|ParameterDict|ModuleList|ModuleDict|init)\b"
COMPUTE_OPS = (
    "mm bmm matmul einsum conv conv1d conv2d conv3d conv_transpose1d conv_transpose2d "
    "conv_transpose3d avg_pool1d avg_pool2d avg_pool3d max_pool1d max_pool2d max_pool3d "
    "adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d adaptive_max_pool1d "
    "adaptive_max_pool2d adaptive_max_pool3d relu hardtanh elu selu leaky_relu gelu softsign "
    "softplus softmax log_softmax tanh sigmoid hardsigmoid silu mish batch_norm group_norm "
    "layer_norm instance_norm rms_norm normalize linear cross_entropy kl_div mse_loss huber_loss "
    "triplet_margin_loss cosine_similarity logsumexp clamp dropout").split()
FORBIDDEN = {
    "try/except": [r"\btry\s*:", r"\bexcept\s*:", r"\bexcept\s+\w+"],
    "pass statement": [r"\bpass\b"],
    "torch.nn compute module": [r"torch\.nn\.(?!" + ALLOWED_NN + ")"],
    "functional op": [r"torch\.nn\.functional\.\w+", r"\bnn\.functional\.\w+",
                      r"\bF\.(conv|linear|relu|gelu|softmax|batch_norm|layer_norm|dropout|max_pool|avg_pool)"],
    "torch compute op": [r"\btorch\.(" + "|".join(COMPUTE_OPS) + r")(?=\s*\(|\s|$)"],
    "streams": [r"torch\.cuda\.Stream\(", r"with\s+torch\.cuda\.stream", r"\.wait_stream\(",
                r"\.record_stream\("],
    "concurrency": [r"\bthreading\b", r"\bmultiprocessing\b", r"concurrent\.futures"],
    "tensor subclass": [r"class\s+\w+\s*\(\s*torch\.Tensor\s*\)", r"_make_subclass"],
    "timing reassignment": [r"torch\.cuda\.Event\s*=(?!=)", r"\btime\.(time|perf_counter)\s*=(?!=)",
                            r"elapsed_time\s*=(?!=)"],
}


def strip_comments(code: str) -> str:
    out = []
    for line in code.split("\n"):
        for mark in ("#", "//"):
            if mark in line:
                line = line[:line.index(mark)]
        out.append(line)
    return "\n".join(out)


def violations(code: str):
    code = strip_comments(code)
    return [f"{rule}: {m.group(0)!r}" for rule, patterns in FORBIDDEN.items()
            for pattern in patterns for m in re.finditer(pattern, code)]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    path = tmp_path_factory.mktemp("export") / "triplet_single_file.py"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "fused_triplet.py"), "--export",
                           str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return path


def test_rule_checker_catches_what_it_should():
    assert violations("x = torch.clamp(y, 0)") and violations("try:\n  f()\nexcept Exception:")
    assert violations("torch.nn.functional.relu(x)") and violations("m = torch.nn.Linear(3, 4)")
    assert not violations("class M(torch.nn.Module):\n    # one pass, try: except\n    x = 1")


def test_exported_file_within_kernelbench_rules(exported):
    text = exported.read_text()
    assert violations(text) == []
    stripped = strip_comments(text)
    assert "__global__" in stripped and "load_inline" in stripped
    assert re.search(r"\b(threadIdx|blockIdx|blockDim)\.", stripped)


def test_package_itself_within_kernelbench_rules():
    with open(os.path.join(ROOT, "fused_triplet.py")) as f:
        assert violations(f.read()) == []


def test_exported_sources_equal_package_sources(exported):
    namespace = {}
    exec(compile(exported.read_text(), str(exported), "exec"), namespace)
    assert namespace["KERNEL_SOURCES"] == ft.KERNEL_SOURCES
    assert namespace["cuda_source"]() == ft.cuda_source()
    assert namespace["_extension_name"]() == ft._extension_name()  # the same cached build


CHILD = r"""
import sys, torch
sys.modules["fused_triplet"] = None  # the package may be installed: any import of it now fails
path, out, device = sys.argv[1], sys.argv[2], sys.argv[3]
namespace = {}
exec(compile(open(path).read(), path, "exec"), namespace)   # as KernelBench loads a submission
g = torch.Generator().manual_seed(0)
a, p, n = (torch.rand(64, 300, generator=g).to(device) for _ in range(3))
results = {}
for swap in (False, True):
    for red in ("none", "mean", "sum"):
        for pnorm in (2.0, 1.0, float("inf"), 3.0):
            results[(swap, red, pnorm)] = namespace["triplet_margin_loss"](
                a, p, n, margin=0.8, p=pnorm, swap=swap, reduction=red).cpu()
results["module"] = namespace["TripletMarginLoss"](margin=0.5, swap=True)(a, p, n).cpu()
results["model_new"] = namespace["ModelNew"](1.0)(a, p, n).cpu()
ag, pg, ng = (x.clone().requires_grad_() for x in (a, p, n))
namespace["triplet_margin_loss"](ag, pg, ng).backward()
results["grads"] = [x.grad.cpu() for x in (ag, pg, ng)]
torch.save(results, out)
"""


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU visible"))])
def test_exported_file_matches_package_in_a_fresh_process(exported, tmp_path, device):
    out = tmp_path / "results.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(exported), str(out), device],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(out)
    g = torch.Generator().manual_seed(0)
    a, p, n = (torch.rand(64, 300, generator=g).to(device) for _ in range(3))
    for swap in (False, True):
        for red in ("none", "mean", "sum"):
            for pnorm in (2.0, 1.0, float("inf"), 3.0):
                want = ft.triplet_margin_loss(a, p, n, margin=0.8, p=pnorm, swap=swap, reduction=red)
                assert torch.equal(got[(swap, red, pnorm)], want.cpu())
    assert torch.equal(got["module"], ft.TripletMarginLoss(margin=0.5, swap=True)(a, p, n).cpu())
    assert torch.equal(got["model_new"], ft.ModelNew(1.0)(a, p, n).cpu())
    ag, pg, ng = (x.clone().requires_grad_() for x in (a, p, n))
    ft.triplet_margin_loss(ag, pg, ng).backward()
    for x, y in zip(got["grads"], (ag, pg, ng)):
        assert torch.equal(x, y.grad.cpu())
