"""The CUDA module compiles (a GPU is not needed) and ptxas reports no spills and no stack."""

import os
import re
import subprocess
import sys

import pytest
import torch
from torch.utils import cpp_extension

from conftest import ROOT

needs_nvcc = pytest.mark.skipif(
    cpp_extension.CUDA_HOME is None or not os.path.exists(
        os.path.join(cpp_extension.CUDA_HOME or "", "bin", "nvcc")),
    reason="no CUDA toolkit found (set CUDA_HOME to the toolkit folder)")


@pytest.fixture(scope="module")
def build_log(tmp_path_factory):
    """A fresh verbose build in a scratch extension dir, in a subprocess (loading the library
    registers the fused_triplet op namespace, which a process can do only once)."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path_factory.mktemp("ext")))
    if not torch.cuda.is_available():
        env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "fused_triplet.py"), "--build"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    log = proc.stderr + proc.stdout  # stderr: the first-build notice; stdout: ninja, the path
    assert proc.returncode == 0, log[-6000:]
    return log


@needs_nvcc
def test_cuda_module_compiles(build_log):
    assert "compiling the CUDA kernels" in build_log  # the one-line notice of a first build
    assert build_log.strip().splitlines()[-1].endswith(".so")  # --build prints the library


@needs_nvcc
def test_no_spills_and_no_stack(build_log):
    kernels = re.findall(r"Compiling entry function '(\w+)'", build_log)
    assert len(kernels) >= 96, f"expected every kernel instantiation, ptxas reported {len(kernels)}"
    props = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                       build_log)
    assert len(props) >= len(kernels)
    bad = [p for p in props if p != ("0", "0", "0")]
    assert not bad, f"stack/spills reported by ptxas: {bad}"
