"""bench.py without a GPU says so and exits 0 (no traceback)."""

import os
import subprocess
import sys

from conftest import ROOT


def test_bench_without_gpu_exits_cleanly():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    for args in ([], ["--sweep", "--backward"]):
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), *args], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert "no CUDA GPU visible" in proc.stdout and "Traceback" not in proc.stderr
