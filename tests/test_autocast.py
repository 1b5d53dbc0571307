"""CUDA autocast as torch does it. torch puts triplet_margin_loss on autocast's float32 list: under
torch.autocast("cuda", float16 / bfloat16) it computes the loss of the inputs cast to float32,
returns it in float32, and gives 2-byte inputs their gradients in their own dtype (the float32
gradient rounded once). fused_triplet's kernels read the 2-byte inputs directly (the cast is
exact) and give the same. GPU only."""

import pytest
import torch
import torch.nn.functional as F

import fused_triplet as ft
from conftest import (assert_as_accurate_as_torch, distance_scale, fused_loss, rand_triplet,
                      requires_cuda)

pytestmark = requires_cuda
DEV = "cuda"
HALVES = [torch.float16, torch.bfloat16]


def loss_and_grads(fn, inputs, dtype, weight=None, **kw):
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    with torch.autocast("cuda", dtype=dtype):
        loss = fn(*xs, **kw)
    (loss.sum() if weight is None else loss.sum() * weight).backward()
    return loss.detach(), [x.grad for x in xs]


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("shape", [(512, 128), (4096, 512), (37, 3), (64, 8192), (3, 100000)])
@pytest.mark.parametrize("pnorm,swap", [(2.0, False), (2.0, True), (1.0, False), (3.0, True)])
def test_loss_and_gradients_as_torch(dtype, shape, pnorm, swap):
    inputs = rand_triplet(shape, dtype, DEV, seed=1)
    for reduction in ("none", "mean", "sum"):
        kw = dict(p=pnorm, swap=swap, reduction=reduction, margin=0.5)
        ours, our_grads = loss_and_grads(ft.triplet_margin_loss, inputs, dtype, **kw)
        theirs, their_grads = loss_and_grads(F.triplet_margin_loss, inputs, dtype, **kw)
        assert ours.dtype == theirs.dtype == torch.float32
        exact = [x.double() for x in inputs]
        ref = F.triplet_margin_loss(*exact, **kw)
        scale = distance_scale(*exact, pnorm, 1e-6, swap)
        scale = {"none": scale, "mean": scale.mean(), "sum": scale.sum()}[reduction]
        # float32's tolerance, relative to the distances the loss is the difference of (their
        # rounding, torch's as ours, scales with them)
        torch.testing.assert_close(ours.double() / scale, theirs.double() / scale,
                                   rtol=1.3e-6, atol=1e-5)
        assert_as_accurate_as_torch(ours, theirs, ref, scale)
        for g, t in zip(our_grads, their_grads):
            assert g.dtype == t.dtype == dtype
            torch.testing.assert_close(g, t)  # the dtype's tolerance: one rounding each


@pytest.mark.parametrize("dtype", HALVES)
def test_outside_autocast_nothing_changes(dtype):
    inputs = rand_triplet((256, 64), dtype, DEV, seed=2)
    assert ft.triplet_margin_loss(*inputs).dtype == dtype
    with torch.autocast("cuda", dtype=dtype, enabled=False):
        assert ft.triplet_margin_loss(*inputs).dtype == dtype
    with torch.autocast("cuda", dtype=dtype):  # float32 and float64 inputs keep their dtype
        for other in (torch.float32, torch.float64):
            assert ft.triplet_margin_loss(*(x.to(other) for x in inputs)).dtype == other
        mixed = ft.triplet_margin_loss(inputs[0], inputs[1].float(), inputs[2])
        assert mixed.dtype == torch.float32


@pytest.mark.parametrize("dtype", HALVES)
def test_under_torch_compile(dtype):
    inputs = rand_triplet((128, 512), dtype, DEV, seed=3)
    compiled = torch.compile(lambda a, p, n: ft.triplet_margin_loss(a, p, n, swap=True),
                             fullgraph=True)
    ours, our_grads = loss_and_grads(compiled, inputs, dtype)
    eager, eager_grads = loss_and_grads(ft.triplet_margin_loss, inputs, dtype, swap=True)
    theirs, their_grads = loss_and_grads(F.triplet_margin_loss, inputs, dtype, swap=True)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert torch.equal(ours, eager)
    for g, e, t in zip(our_grads, eager_grads, their_grads):
        assert g.dtype == dtype
        torch.testing.assert_close(g, t)
        assert torch.equal(g, e)


@pytest.mark.parametrize("dtype", HALVES)
def test_amp_training_loop_one_pass_same_bits(dtype):
    """AMP with GradScaler's scale as the upstream gradient: from the third step the forward
    predicts it; every step gives the two-pass path's bits."""
    inputs = rand_triplet((1024, 256), dtype, DEV, seed=4)
    kw = dict(margin=0.8125, swap=True)
    two = loss_and_grads(fused_loss, inputs, dtype, 65536.0, forward=0, **kw)
    for _ in range(4):
        one = loss_and_grads(fused_loss, inputs, dtype, 65536.0, **kw)
        assert torch.equal(one[0], two[0])
        assert all(torch.equal(g1, g2) for g1, g2 in zip(one[1], two[1]))
    raw = ft._internal_ops().upstream_history(*inputs, 0.8125, 2.0, 1e-6, True, 1, True).cpu()
    assert raw[0, 0].view(torch.float32).item() == 65536.0 and raw[0, 1].item() == 1


@pytest.mark.parametrize("dtype", HALVES)
def test_opcheck_float32_loss(dtype):
    op = ft._ops().triplet_margin_loss
    a, p, n = (x.requires_grad_() for x in rand_triplet((6, 40), dtype, DEV, seed=5))
    for reduction in (0, 1):
        torch.library.opcheck(op, (a, p, n, 1.0, 2.0, 1e-6, True, reduction, True))
