"""The one-file export: self-contained, same results as the package; the KernelBench file: its
template with the library's kernel sources and build, within KernelBench's rules."""

import os
import re
import subprocess
import sys

import pytest
import torch

import fused_triplet as ft
from conftest import HAS_CUDA, ROOT
from kernelbench_rules import precision_downgrades, strip_comments, violations


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


def test_exported_file_holds_the_kernels(exported):
    stripped = strip_comments(exported.read_text())
    assert "__global__" in stripped and "load_inline" in stripped
    assert re.search(r"\b(threadIdx|blockIdx|blockDim)\.", stripped)


def test_exported_file_without_the_template_says_so(exported, tmp_path):
    # the one-file copy holds no KernelBench template: one line and status 1, no traceback
    proc = subprocess.run([sys.executable, str(exported), "--export", "kb.py", "--kernelbench"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "KernelBench template" in proc.stderr and proc.stderr.strip().count("\n") == 0


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


# ---- The KernelBench file (export(path, kernelbench=True)): the float32 forward problem 99
# reaches and nothing of the other dtypes, so KernelBench's precision-downgrade warning finds
# nothing and the first build takes seconds.

KERNELBENCH_KERNELS = ["forward_finish_kernel", "forward_ring_kernel", "forward_rows_kernel"]


@pytest.fixture(scope="module")
def kernelbench_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("kernelbench") / "model_new.py"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "fused_triplet.py"), "--export",
                           str(path), "--kernelbench"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return path


def load(path):
    namespace = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # as KernelBench does
    return namespace


def test_kernelbench_file_has_no_precision_downgrade(kernelbench_file):
    text = kernelbench_file.read_text()
    assert precision_downgrades(text) == []
    assert violations(text) == []
    stripped = strip_comments(text)
    assert "__global__" in stripped and "load_inline" in stripped
    assert re.search(r"\b(threadIdx|blockIdx|blockDim)\.", stripped)
    # the package's sources do carry such patterns: the check would notice them
    assert precision_downgrades(ft.cuda_source())


def test_kernelbench_file_holds_only_float32_forward_kernels(kernelbench_file):
    namespace = load(kernelbench_file)
    assert "KernelBench file" in namespace["__doc__"]
    cuda = strip_comments(namespace["cuda_source"]())
    cpp = strip_comments(namespace["cpp_source"]())
    assert not re.search(r"\b(__half|__nv_bfloat16|half2|cuda_fp16|cuda_bf16)", cuda + cpp)
    kernels = sorted(set(re.findall(
        r"__global__ void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\(", cuda)))
    assert kernels == KERNELBENCH_KERNELS
    assert not cpp.strip()  # no torch-facing C++: its forward is the CUDA file's C entry
    assert namespace["_extension_name"]() != ft._extension_name()  # a build of its own


def test_kernelbench_file_is_its_template_with_the_library_build(kernelbench_file):
    # the generator's parts: the template's own code, then the library's sections verbatim
    text = kernelbench_file.read_text()
    library = open(os.path.join(ROOT, "fused_triplet.py")).read()
    build = library[library.index("def build("):library.index("def _finish_loading(")]
    model = library[library.index("class ModelNew("):library.index("# In-batch mining")]
    assert text.count(build) == 1 and text.count("def _after_load(") == 1
    assert text.count(model.rstrip("-# \n")) == 1 and text.count("class ModelNew(") == 1
    assert "mined_triplet" not in strip_comments(text) and "@@" not in text


def test_kernelbench_file_takes_the_torch_path_for_the_rest(kernelbench_file):
    namespace = load(kernelbench_file)
    takes = namespace["_kernelbench_takes"]
    x = torch.rand(4, 8)
    assert takes(x, x, x, 2.0, False)
    assert not takes(x, x, x, 1.0, False) and not takes(x, x, x, 2.0, True)
    assert not takes(*(x.double(),) * 3, 2.0, False)
    with torch.enable_grad():
        assert not takes(x.requires_grad_(), x, x, 2.0, False)
    g = torch.Generator().manual_seed(0)
    a, p, n = (torch.rand(16, 40, generator=g) for _ in range(3))
    for kw in (dict(), dict(p=1.0, swap=True, reduction="none")):
        assert torch.equal(namespace["triplet_margin_loss"](a, p, n, **kw),
                           ft.triplet_margin_loss(a, p, n, **kw))
    assert torch.equal(namespace["ModelNew"](1.0)(a, p, n), ft.ModelNew(1.0)(a, p, n))


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU visible")
def test_kernelbench_file_matches_package_on_cuda(kernelbench_file, tmp_path):
    code = ("import sys, torch\nsys.modules['fused_triplet'] = None\n"
            "ns = {}\nexec(compile(open(sys.argv[1]).read(), sys.argv[1], 'exec'), ns)\n"
            "g = torch.Generator().manual_seed(0)\n"
            "a, p, n = (torch.rand(512, 1024, generator=g).cuda() for _ in range(3))\n"
            "loss = ns['triplet_margin_loss']\n"
            "out = [ns['ModelNew'](1.0)(a, p, n), loss(a, p, n, p=1.0),\n"
            "       loss(a.half(), p.half(), n.half()),\n"
            "       loss(a, p[:1], n, margin=0.5, reduction='none'),\n"  # a broadcast row
            "       loss(a[:, ::2], p[:, ::2], n[:, ::2], reduction='sum'),\n"  # strided
            "       loss(a[:, 1:], p[:, 1:], n[:, 1:]), ns['ModelNew'](1.0)(a[:0], p[:0], n[:0])]\n"
            "torch.save([x.cpu() for x in out], sys.argv[2])\n")
    out = tmp_path / "out.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code, str(kernelbench_file), str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(out)
    g = torch.Generator().manual_seed(0)
    a, p, n = (torch.rand(512, 1024, generator=g).cuda() for _ in range(3))
    assert torch.equal(got[0], ft.ModelNew(1.0)(a, p, n).cpu())  # the same kernels, the same bits
    assert torch.equal(got[3], ft.triplet_margin_loss(a, p[:1], n, margin=0.5,
                                                      reduction="none").cpu())
    assert torch.equal(got[4], ft.triplet_margin_loss(a[:, ::2], p[:, ::2], n[:, ::2],
                                                      reduction="sum").cpu())
    assert torch.equal(got[5], ft.triplet_margin_loss(a[:, 1:], p[:, 1:], n[:, 1:]).cpu())
    assert got[6].isnan()  # the mean of no rows, as torch's
    torch.testing.assert_close(got[1], torch.nn.TripletMarginLoss(p=1.0)(a, p, n).cpu())
    torch.testing.assert_close(got[2], torch.nn.TripletMarginLoss()(a.half(), p.half(),
                                                                    n.half()).cpu())
