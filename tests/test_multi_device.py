"""Several devices: the DDP example (gloo on CPU everywhere; NCCL on 2 GPUs) and device placement."""

import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import fused_triplet as ft
from conftest import ROOT, rand_triplet, same_error

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
requires_two_gpus = pytest.mark.skipif(
    not TWO_GPUS, reason=f"needs 2 CUDA GPUs, {torch.cuda.device_count()} visible")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ddp_example(backend, device, steps=2):
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           os.path.join(ROOT, "examples", "ddp_train.py"), "--backend", backend, "--device",
           device, "--steps", str(steps), "--check-grads"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "DDP gradients vs single process" in proc.stdout and "(ok)" in proc.stdout
    return proc.stdout


def test_ddp_example_gloo_cpu_matches_single_process():
    run_ddp_example("gloo", "cpu")


@requires_two_gpus
def test_ddp_example_nccl_two_gpus_matches_single_process():
    print(run_ddp_example("nccl", "cuda", steps=20))


@requires_two_gpus
def test_inputs_on_second_gpu_while_current_is_first():
    torch.cuda.set_device(0)
    a, p, n = rand_triplet((512, 4096), device="cuda:1", seed=1)
    for reduction in ("none", "mean"):
        ours = ft.triplet_margin_loss(a, p, n, reduction=reduction)
        assert ours.device == torch.device("cuda:1")
        torch.testing.assert_close(ours, F.triplet_margin_loss(a, p, n, reduction=reduction))
    assert torch.cuda.current_device() == 0


@requires_two_gpus
def test_inputs_on_different_gpus_raise_torch_error():
    a, p, n = rand_triplet((8, 16), device="cuda:0", seed=2)
    p1 = p.to("cuda:1")
    same_error(lambda: ft.triplet_margin_loss(a, p1, n), lambda: F.triplet_margin_loss(a, p1, n))
