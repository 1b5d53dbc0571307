"""Reliability on the GPU: 64-bit indexing, huge magnitudes, concurrency (skipped without one)."""

import threading

import pytest
import torch
import torch.nn.functional as F

import fused_triplet as ft
from conftest import assert_as_accurate_as_torch, distance_scale, rand_triplet, requires_cuda

pytestmark = requires_cuda
DEV = "cuda"


def free_bytes():
    torch.cuda.empty_cache()  # blocks an earlier test left in torch's cache count as free here
    return torch.cuda.mem_get_info()[0]


@pytest.mark.parametrize("dim", [65540, 65537])  # 16-byte rows and odd rows (scalar path)
def test_more_than_2_31_elements_per_tensor(dim):
    rows = 32768  # rows * dim > 2^31 elements (8.6 GB per fp32 tensor)
    need = 3 * rows * dim * 4 + (4 << 30)
    if free_bytes() < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of free GPU memory, "
                    f"{free_bytes() / 2**30:.0f} GiB free")
    assert rows * dim > 2**31
    a, p, n = rand_triplet((rows, dim), device=DEV, seed=1)
    ours = ft.triplet_margin_loss(a, p, n, reduction="none")
    mean = ft.triplet_margin_loss(a, p, n)
    ref = torch.empty(rows, dtype=torch.float64, device=DEV)
    scale = torch.empty(rows, dtype=torch.float64, device=DEV)
    theirs = torch.empty(rows, dtype=torch.float32, device=DEV)
    for lo in range(0, rows, 2048):  # float64 reference and torch's fp32, in chunks
        sl = slice(lo, lo + 2048)
        ref[sl] = F.triplet_margin_loss(a[sl].double(), p[sl].double(), n[sl].double(),
                                        reduction="none")
        scale[sl] = distance_scale(a[sl], p[sl], n[sl])
        theirs[sl] = F.triplet_margin_loss(a[sl], p[sl], n[sl], reduction="none")
    # Distances are ~100 here (fp32 ulp ~8e-6) and the loss 1 + their difference: compare
    # errors with torch's, with a floor of a few ulps of the distances.
    assert_as_accurate_as_torch(ours, theirs, ref, scale)
    assert_as_accurate_as_torch(mean, theirs.double().mean(), ref.mean(), scale.mean())
    # the last row is the one a 32-bit offset would get wrong
    assert_as_accurate_as_torch(ours[-1:], theirs[-1:], ref[-1:], scale[-1:])


@pytest.mark.parametrize("dim", [65540, 65537])  # 16-byte rows (vector path) and odd rows (scalar)
def test_backward_more_than_2_31_elements_per_tensor(dim):
    """The fused backward's 64-bit offsets: gradients of the mean loss (swap) over 32768 rows,
    checked against float64 (and torch's fp32) on the first, a middle and the last rows."""
    rows = 32768
    need = 6 * rows * dim * 4 + (12 << 30)  # inputs, gradients, a float64 chunk's autograd
    if free_bytes() < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of free GPU memory, "
                    f"{free_bytes() / 2**30:.0f} GiB free")
    assert rows * dim > 2**31
    a, p, n = (x.requires_grad_() for x in rand_triplet((rows, dim), device=DEV, seed=3))
    ft.triplet_margin_loss(a, p, n, swap=True).backward()
    for lo in (0, rows // 2, rows - 512):
        sl = slice(lo, lo + 512)
        exact = [x[sl].detach().double().requires_grad_() for x in (a, p, n)]
        (F.triplet_margin_loss(*exact, swap=True, reduction="sum") / rows).backward()
        theirs = [x[sl].detach().clone().requires_grad_() for x in (a, p, n)]
        (F.triplet_margin_loss(*theirs, swap=True, reduction="sum") / rows).backward()
        for x, t, r in zip((a, p, n), theirs, exact):
            assert_as_accurate_as_torch(x.grad[sl], t.grad, r.grad)


def test_huge_magnitudes_behave_as_torch():
    """1e20 in fp32: squares overflow to inf in fp32 accumulation, as in torch (both give
    inf distances and a nan loss for p = 2); p = 1 and inf stay finite, as accurate as torch's
    against float64."""
    a, p, n = (x * 1e20 for x in rand_triplet((16, 300), device=DEV, seed=2))
    for pnorm in (2.0, 1.0, float("inf")):
        ours = ft.triplet_margin_loss(a, p, n, p=pnorm, reduction="none")
        theirs = F.triplet_margin_loss(a, p, n, p=pnorm, reduction="none")
        ref = F.triplet_margin_loss(a.double(), p.double(), n.double(), p=pnorm,
                                    reduction="none")
        assert_as_accurate_as_torch(ours, theirs, ref, distance_scale(a, p, n, pnorm))
        if pnorm == 2.0:
            assert ours.isnan().all()


def test_two_streams_at_once():
    inputs = [rand_triplet((2048, 4096), device=DEV, seed=s) for s in (3, 4)]
    expected = [ft.triplet_margin_loss(*x, reduction="none") for x in inputs]
    streams = [torch.cuda.Stream() for _ in inputs]
    outs = [None, None]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    for _ in range(20):
        for k, (s, x) in enumerate(zip(streams, inputs)):
            with torch.cuda.stream(s):
                outs[k] = ft.triplet_margin_loss(*x, reduction="none")
    torch.cuda.synchronize()
    for out, exp in zip(outs, expected):
        assert torch.equal(out, exp)


def test_two_python_threads_at_once():
    inputs = [rand_triplet((1024, 2048), device=DEV, seed=s) for s in (5, 6)]
    expected = [ft.triplet_margin_loss(*x) for x in inputs]
    errors = []

    def worker(k):
        for _ in range(50):
            out = ft.triplet_margin_loss(*inputs[k])
            if not torch.equal(out, expected[k]):
                errors.append((k, out.item(), expected[k].item()))

    threads = [threading.Thread(target=worker, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]


def test_bitwise_identical_over_100_calls():
    a, p, n = rand_triplet((4096, 8192), device=DEV, seed=7)
    for reduction in ("none", "mean"):
        first = ft.triplet_margin_loss(a, p, n, swap=True, reduction=reduction)
        for _ in range(100):
            assert torch.equal(ft.triplet_margin_loss(a, p, n, swap=True, reduction=reduction), first)
