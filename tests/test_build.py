"""The CUDA module compiles (a GPU is not needed): at most 100 kernel functions per architecture,
no spills and no stack (ptxas -v), and a built library loads without a toolkit."""

import os
import re
import subprocess
import sys

import pytest
import torch
from torch.utils import cpp_extension

import fused_triplet as ft
from conftest import ROOT, announce

TOOLKIT, TOOLKIT_PROBLEM = ft._find_toolkit(cpp_extension)
needs_nvcc = pytest.mark.skipif(
    TOOLKIT_PROBLEM is not None,
    reason=f"cannot compile the CUDA kernels: {TOOLKIT_PROBLEM} (set CUDA_HOME to the toolkit)")


@pytest.fixture(scope="module")
def build_env(tmp_path_factory):
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path_factory.mktemp("ext")),
               FUSED_TRIPLET_PTXAS_VERBOSE="1")
    if not torch.cuda.is_available():
        env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    return env


@pytest.fixture(scope="module")
def build_log(build_env, tmp_path_factory, pytestconfig):
    """Two processes build at once into one empty extension dir (a scratch one): both must
    succeed (torch's lock file serialises them). In subprocesses, since loading the library
    registers the fused_triplet op namespace, which a process can do only once. Their output
    goes to files: a full pipe would block the builder the other one waits for."""
    announce(pytestconfig, f"tests/test_build.py: compiling the CUDA kernels with {TOOLKIT} for "
             f"{ft._target_archs(build_env)} ({ft.BUILD_TIME} per architecture on 2 cores)...")
    logs_dir = tmp_path_factory.mktemp("logs")
    builders = []
    for k in range(2):
        log = open(logs_dir / f"build{k}.log", "w")
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "fused_triplet.py"), "--build"],
                                cwd=ROOT, env=build_env, text=True, stdout=log,
                                stderr=subprocess.STDOUT)
        builders.append((proc, log, logs_dir / f"build{k}.log"))
    logs = []
    for proc, log, path in builders:
        proc.wait(timeout=1800)
        log.close()
        logs.append(path.read_text())  # the first-build notice, ninja's output, the path
        assert proc.returncode == 0, logs[-1][-6000:]
    return max(logs, key=len)  # the one that compiled


@needs_nvcc
def test_cached_library_loads_without_a_toolkit(build_log, build_env):
    env = dict(build_env, CUDA_HOME="/nonexistent", PATH="/usr/bin:/bin")
    # Nor torch.utils.cpp_extension (setuptools and a CUDA probe: 0.43 s on the H200 host).
    code = ("import sys, fused_triplet as f; print(f.build()); "
            "assert 'torch.utils.cpp_extension' not in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compiling" not in proc.stderr


def test_no_toolkit_is_a_clear_error_and_cpu_still_works(tmp_path):
    env = dict(os.environ, CUDA_HOME=str(tmp_path / "no-toolkit"), PATH="/usr/bin:/bin",
               TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    code = ("import torch, fused_triplet as f\n"
            "x = torch.rand(4, 5)\n"
            "print(float(f.triplet_margin_loss(x, x + 1, x * 2)))\n"
            "f.build()\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0
    assert "needs the CUDA toolkit" in proc.stderr and "Set CUDA_HOME" in proc.stderr
    float(proc.stdout.strip().splitlines()[0])  # the CPU path ran first


@needs_nvcc
def test_unwritable_extension_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(blocker / "ext"), TORCH_CUDA_ARCH_LIST="9.0")
    proc = subprocess.run([sys.executable, "-c", "import fused_triplet as f; f.build()"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "cannot write the build folder" in proc.stderr and "TORCH_EXTENSIONS_DIR" in proc.stderr


@needs_nvcc
def test_cuda_module_compiles(build_log):
    # the one-line notice of a first build: what, for which architectures, with which CUDA
    assert re.search(r"fused_triplet: compiling its CUDA kernels for sm_\d+.* with CUDA \d+\.\d+ "
                     r"\(about \d+ s, once", build_log)
    assert build_log.strip().splitlines()[-1].endswith(".so")  # --build prints the library


@needs_nvcc
def test_kernels_compile_for_older_gpus(tmp_path, pytestconfig):
    # Features of newer targets (sm_90's bulk copies, double tensor-core products from sm_80)
    # stay behind arch guards: the CUDA source compiles for sm_75 (the oldest CUDA 13 takes) and
    # sm_80, where the plans never take those kernels.
    source = tmp_path / "kernels.cu"
    source.write_text(ft.cuda_source())
    announce(pytestconfig, "tests/test_build.py: compiling the CUDA source for sm_75 and sm_80...")
    nvcc = os.path.join(TOOLKIT, "bin", "nvcc")
    proc = subprocess.run([nvcc, "-O3", "-std=c++17", "--expt-relaxed-constexpr", "-c",
                           "-gencode=arch=compute_75,code=sm_75",
                           "-gencode=arch=compute_80,code=sm_80", str(source),
                           "-o", str(tmp_path / "kernels.o")],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]


@needs_nvcc
def test_few_kernels_no_spills_and_no_stack(build_log):
    kernels = re.findall(r"Compiling entry function '(\w+)' for '(sm_\w+)'", build_log)
    archs = {arch for _, arch in kernels}
    assert archs, "ptxas reported no kernels"
    mining = ("gram_rows_kernel", "hardest_kernel", "distances_kernel", "batch_all_kernel",
              "hard_loss_kernel", "hard_gradient_kernel", "hard_gradient_sorted_kernel",
              "all_gradient_kernel",
              "all_gradient_mma_kernel", "mined_total_kernel", "unit_rows", "centred_rows_kernel",
              "column_sums_kernel", "column_means_kernel", "label_ranks_kernel",
              "label_order_kernel", "label_tiles_kernel", "label_merge_kernel",
              "sparse_rows_gradient_kernel", "sparse_columns_gradient_kernel",
              "thread_spreads_kernel", "gradient_parts_kernel")
    for arch in archs:
        count = sum(1 for name, a in kernels if a == arch and not any(m in name for m in mining))
        assert 40 <= count <= 100, f"{count} triplet kernel functions for {arch}"
        # the mining kernels: 9 that batch_hard runs, each for float32, float16 and bfloat16
        # rows (27: its Gram rows, hardest_kernel in two load widths (16-byte loads where the
        # Gram rows are aligned), the exact distances, hard_loss_kernel picking its triplets or
        # taking hardest_kernel's, its gradient by scans or from the sorted choices, the rows'
        # column sums); 19 on float32 rows or none: the Gram distances, batch_all_kernel for the
        # plain rule, the general one and semi_hard; the unit rows forward and backward;
        # batch_all's centred rows, its gradient in float (and its column parts' sum) and on the
        # tensor cores; semi_hard's sparse gradient (rows, columns); the rows' mean's second step,
        # batch_hard's label order in two by counting or in two by sorted tiles and its threads'
        # spreads, the reduction
        assert sum(1 for name, a in kernels if a == arch and any(m in name for m in mining)) == 46
    props = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                       build_log)
    assert len(props) >= len(kernels)
    bad = [p for p in props if p != ("0", "0", "0")]
    assert not bad, f"stack/spills reported by ptxas: {bad}"


@needs_nvcc
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: nothing to ask for")
def test_no_gpu_and_no_arch_list_is_a_clear_error(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CUDA_ARCH_LIST"}
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "ext")
    proc = subprocess.run([sys.executable, "-c", "import fused_triplet as f; f.build()"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "set TORCH_CUDA_ARCH_LIST" in proc.stderr


FAKE_CHECK = r"""
import torch, fused_triplet as ft
from torch._subclasses.fake_tensor import FakeTensorMode
ft.build()
with FakeTensorMode():
    a, p, n = (torch.empty(8, 33, device="cuda") for _ in range(3))
    for dtype, swap, red in ((torch.float32, True, 1), (torch.float16, False, 0), (torch.float64, True, 2)):
        x = [t.to(dtype) for t in (a, p, n)]
        loss, dists = torch.ops.fused_triplet.triplet_margin_loss(*x, 1.0, 2.0, 1e-6, swap, red)
        assert loss.shape == ((8,) if red == 0 else ()) and loss.dtype == dtype
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        assert dists.shape == (3 if swap else 2, 8) and dists.dtype == acc
        # The C++ autograd kernel on fake tensors: the backward reaches the fake backward op.
        # On CPU fakes: the autograd engine wants a real device for CUDA ones (the kernels
        # are fake either way, and the Autograd key is device-agnostic).
        x = [torch.empty(8, 33, dtype=dtype).requires_grad_(k != 1) for k in range(3)]
        loss, dists = torch.ops.fused_triplet.triplet_margin_loss(*x, 1.0, 2.0, 1e-6, swap, red)
        assert "TripletMarginLossFunction" in loss.grad_fn.name() and not dists.requires_grad
        ga, gn = torch.autograd.grad(loss, [x[0], x[2]], torch.ones_like(loss))
        assert ga.shape == (8, 33) and gn.dtype == dtype


# What torch.compile's AOTAutograd traces for a training step (make_fx of forward + grad): the
# two fused ops and the upstream ones, nothing of torch's own formula.
def step(a, p, n):
    loss, _ = torch.ops.fused_triplet.triplet_margin_loss(a, p, n, 1.0, 2.0, 1e-6, True, 1)
    return torch.autograd.grad(loss, (a, p, n))


from torch.fx.experimental.proxy_tensor import make_fx
code = make_fx(step, tracing_mode="fake")(*(torch.rand(8, 33, requires_grad=True)
                                           for _ in range(3))).code
assert "fused_triplet.triplet_margin_loss_backward" in code and "norm" not in code, code
print("fake ok")
"""


@needs_nvcc
def test_fake_kernels_and_autograd_glue(build_log, build_env):
    """The ops' fake kernels and the C++ autograd kernel, on fake CUDA tensors (no GPU)."""
    proc = subprocess.run([sys.executable, "-c", FAKE_CHECK], cwd=ROOT, env=build_env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "fake ok" in proc.stdout, proc.stderr[-3000:]


@needs_nvcc
def test_kernelbench_file_builds_six_float32_kernels(build_env, tmp_path, pytestconfig):
    """The KernelBench file compiles the float32 forward kernels problem 99 reaches: 6 kernel
    functions per architecture, no spills. Its first build's time is reported (not asserted:
    machines differ)."""
    import time

    path = tmp_path / "model_new.py"
    subprocess.run([sys.executable, os.path.join(ROOT, "fused_triplet.py"), "--export", str(path),
                    "--kernelbench"], check=True, capture_output=True, timeout=120)
    env = dict(build_env, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(path), "--build"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    seconds = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = proc.stdout + proc.stderr
    kernels = re.findall(r"Compiling entry function '(\w+)' for '(sm_\w+)'", log)
    for arch in {a for _, a in kernels}:
        assert sum(1 for _, a in kernels if a == arch) == 6, (arch, kernels)
    props = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                       log)
    assert props and all(p == ("0", "0", "0") for p in props), props
    announce(pytestconfig, f"tests/test_build.py: the KernelBench file's first build took "
             f"{seconds:.1f} s ({env.get('TORCH_CUDA_ARCH_LIST', 'this GPU')})")


@needs_nvcc
def test_first_build_says_one_line(tmp_path):
    """A first build (not verbose) prints its one notice, nothing of torch's or ninja's."""
    path = tmp_path / "model_new.py"
    subprocess.run([sys.executable, os.path.join(ROOT, "fused_triplet.py"), "--export", str(path),
                    "--kernelbench"], check=True, capture_output=True, timeout=120)
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    env.pop("FUSED_TRIPLET_PTXAS_VERBOSE", None)
    if not torch.cuda.is_available():
        env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    proc = subprocess.run([sys.executable, "-c", "import model_new; model_new.build()"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fused_triplet: compiling its CUDA kernels"), lines
    assert proc.stdout == ""


@needs_nvcc
def test_build_command_without_a_gpu_or_arch_list_says_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: nothing to ask for")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CUDA_ARCH_LIST"}
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "ext")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "fused_triplet.py"), "--build"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "TORCH_CUDA_ARCH_LIST" in proc.stderr


def test_export_into_a_missing_folder_says_one_line(tmp_path):
    target = tmp_path / "no_such_folder" / "fused_triplet_single.py"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "fused_triplet.py"), "--export",
                           str(target)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and str(target) in proc.stderr


def test_build_announcement_names_the_architectures():
    assert ft._target_archs({"TORCH_CUDA_ARCH_LIST": "8.0;9.0+PTX"}) == "sm_80, sm_90"
    if not torch.cuda.is_available():
        assert ft._target_archs({}) == "no GPU visible"


def test_version():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "fused_triplet.py"), "--version"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == f"fused_triplet {ft.__version__}"
