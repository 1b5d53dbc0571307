"""`pip install .` gives an importable fused_triplet that finds its kernels from any folder."""

import importlib.util
import os
import subprocess
import sys

from conftest import ROOT


def test_installed_module_finds_its_kernels(tmp_path):
    target = tmp_path / "site"
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *isolation,
                           "--target", str(target), ROOT], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    code = ("import fused_triplet as f, json; "
            "print(json.dumps([f.__file__, list(f.KERNEL_SOURCES), f._extension_name()]))")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(target)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json
    import fused_triplet as ft
    path, names, name = json.loads(proc.stdout.strip().splitlines()[-1])
    assert path.startswith(str(target))
    assert names == list(ft.KERNEL_SOURCES) and name == ft._extension_name()  # the same build
    # the KernelBench file from the installed package (its template installs with the kernels)
    proc = subprocess.run([sys.executable, "-c", "import fused_triplet as f; f.export('kb.py', "
                           "kernelbench=True)"], cwd=elsewhere, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=str(target)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "class ModelNew(" in (elsewhere / "kb.py").read_text()
