"""Each kernel family, forced for inputs it can take: the same results as torch, and the same bits
as every other family that can take the same input (they share each thread's elements, their
order and the reduction tree by construction; this checks it). Skipped without a GPU."""

import pytest
import torch

import fused_triplet as ft
from conftest import (assert_as_accurate_as_torch, distance_scale, fused_loss, rand_triplet,
                      requires_cuda)

pytestmark = requires_cuda
DEV = "cuda"
FORWARD = {"rows": 0, "ring": 1}
BACKWARD = {"rows": 0, "pointwise": 1}


def plans(a, p, n, pnorm=2.0, swap=False, forward=-1, backward=-1):
    return ft._internal_ops().describe_plans(a, p, n, pnorm, swap, forward, backward)


def can_run(forward=-1, backward=-1, *args, **kw):
    try:
        plans(*args, forward=forward, backward=backward, **kw)
    except RuntimeError as e:
        assert "cannot run" in str(e)
        return False
    return True


def loss_and_grads(anchor, positive, negative, **kw):
    xs = [x.detach().clone().requires_grad_() for x in (anchor, positive, negative)]
    loss = fused_loss(*xs, **kw)
    grads = torch.autograd.grad(loss.sum(), xs)
    torch.cuda.synchronize()
    return loss.detach(), grads


def strided(x, width):
    """x as the first columns of a wider tensor: a row stride other than its length."""
    wide = torch.empty(x.shape[0], width, dtype=x.dtype, device=x.device)
    wide[:, : x.shape[1]] = x
    return wide[:, : x.shape[1]]


# Whole-block teams (long or few rows), split rows, every dtype; float32 teams of 8 and 32 (the
# ring's tiles: rows ending mid-stage, a last row group not full); a strided case.
FORWARD_CASES = [((64, 8192), torch.float32), ((300, 3000), torch.float32),
                 ((4, 100000), torch.float32), ((40, 20000), torch.bfloat16),
                 ((3, 50000), torch.float16), ((100, 2048), torch.float16),
                 ((128, 4096), torch.bfloat16), ((40001, 100), torch.float32),
                 ((9003, 300), torch.float32)]


@pytest.mark.parametrize("shape,dtype", FORWARD_CASES)
@pytest.mark.parametrize("pnorm", [2.0, 1.0])
def test_forward_families_same_bits(shape, dtype, pnorm):
    a, p, n = rand_triplet(shape, dtype, DEV, seed=1)
    cases = [(a, p, n), (a, strided(p, shape[1] + 8), n)]
    ran = 0
    for args in cases:
        if not can_run(FORWARD["ring"], -1, *args, pnorm=pnorm):
            continue  # e.g. not sm_90
        ran += 1
        for swap in (False, True):
            for reduction in ("none", "mean", "sum"):
                kw = dict(p=pnorm, swap=swap, reduction=reduction)
                results = {}
                for name, family in FORWARD.items():
                    results[name] = loss_and_grads(*args, forward=family, **kw)[0]
                assert torch.equal(results["rows"], results["ring"]), (swap, reduction)
                theirs = torch.nn.functional.triplet_margin_loss(*args, **kw)
                ref = torch.nn.functional.triplet_margin_loss(*(x.double() for x in args), **kw)
                scale = distance_scale(*args, pnorm, 1e-6, swap)
                scale = {"none": scale, "mean": scale.mean(), "sum": scale.sum()}[reduction]
                assert_as_accurate_as_torch(results["ring"], theirs, ref, scale)
    if not ran:
        pytest.skip("the ring forward needs sm_90")


BACKWARD_CASES = [((257, 100), torch.float32), ((1500, 3000), torch.float32),
                  ((3, 100000), torch.bfloat16), ((2048, 96), torch.float16),
                  ((600, 64), torch.bfloat16), ((4096, 8), torch.float32)]


@pytest.mark.parametrize("shape,dtype", BACKWARD_CASES)
@pytest.mark.parametrize("pnorm", [2.0, 1.0])
def test_backward_families_same_bits(shape, dtype, pnorm):
    a, p, n = rand_triplet(shape, dtype, DEV, seed=2)
    broadcast = a[:1].expand_as(a)  # one anchor row for all: row stride 0
    for args in ((a, p, n), (a, strided(p, shape[1] + 8), n), (broadcast, p, n)):
        assert can_run(-1, BACKWARD["pointwise"], *args, pnorm=pnorm)
        for swap in (False, True):
            for reduction in ("none", "mean"):
                kw = dict(p=pnorm, swap=swap, reduction=reduction, margin=0.1)
                grads = {}
                for name, family in BACKWARD.items():
                    grads[name] = loss_and_grads(*args, backward=family, **kw)[1]
                for g_rows, g_pointwise in zip(grads["rows"], grads["pointwise"]):
                    assert torch.equal(g_rows, g_pointwise), (swap, reduction)
                theirs, ref = [], []
                for cast, out in ((lambda x: x, theirs), (lambda x: x.double(), ref)):
                    xs = [cast(x).detach().clone().requires_grad_() for x in args]
                    loss = torch.nn.functional.triplet_margin_loss(*xs, **kw)
                    out.extend(torch.autograd.grad(loss.sum(), xs))
                for g, t, r in zip(grads["pointwise"], theirs, ref):
                    assert_as_accurate_as_torch(g, t, r)


def test_family_that_cannot_run_is_an_error():
    a, p, n = rand_triplet((8, 33), torch.float32, DEV)  # 132-byte rows: no 16-byte loads
    with pytest.raises(RuntimeError, match="asked-for forward family cannot run"):
        fused_loss(a, p, n, forward=FORWARD["ring"])
    with pytest.raises(RuntimeError, match="asked-for backward family cannot run"):
        loss_and_grads(a, p, n, backward=BACKWARD["pointwise"])
    a, p, n = rand_triplet((8, 64), torch.float32, DEV)  # p = 3 needs the rows kernel
    with pytest.raises(RuntimeError, match="p = 1 or 2"):
        loss_and_grads(a, p, n, p=3.0, backward=BACKWARD["pointwise"])
    with pytest.raises(RuntimeError, match="follows a onepass forward"):
        loss_and_grads(a, p, n, forward=FORWARD["rows"], backward=2)


def test_plans_are_described():
    a, p, n = rand_triplet((32, 8192), torch.float32, DEV)
    text = plans(a, p, n)
    assert text.startswith("forward ") and "; backward " in text and "threads_per_row=" in text
    assert "; training onepass" in text and "; training backward check" in text
    rows_text = plans(a, p, n, pnorm=3.0)
    assert "forward rows" in rows_text and "backward rows" in rows_text
