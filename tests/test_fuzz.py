"""Seeded fuzz of the public API against torch and a float64 reference.

Shapes (B = 0 and 1, D = 1 and odd), layouts (row-stride views, storage offsets, broadcast rows,
column-major), dtypes and every option; backwards with upstream gradients of 1 and others, and
with some inputs not requiring grad. The default run is quick; for the long run:

    FUSED_TRIPLET_FUZZ_CASES=10000 python -m pytest tests/test_fuzz.py -q
"""

import math
import os
import random

import pytest
import torch
import torch.nn.functional as F

import fused_triplet as ft
from conftest import HAS_CUDA

CASES = int(os.environ.get("FUSED_TRIPLET_FUZZ_CASES", "300"))
# Per-sample loss tolerance, relative to 1 + the distances involved (the loss is a difference of
# distances, so rounding scales with them).
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def make_case(rng: random.Random, device: str):
    batch = rng.choice([0, 1, 2, 3, 7, 33, 100, 257])
    dim = rng.choice([1, 2, 3, 4, 5, 8, 31, 64, 100, 257, 1000, 2048, 4100])
    dtype = rng.choice([torch.float32, torch.float32, torch.float16, torch.bfloat16, torch.float64])
    opts = dict(margin=rng.choice([0.1, 1.0, 3.0]), eps=rng.choice([0.0, 1e-6, 1e-2]),
                p=rng.choice([2.0, 2.0, 1.0, math.inf, -math.inf, 0.0, 3.0, 1.5, 0.5]),
                swap=rng.random() < 0.5, reduction=rng.choice(["none", "mean", "sum"]))
    # The backward's upstream gradient (1 as loss.backward() sends it, or a weight) and which
    # inputs require grad (at least one).
    opts["upstream"] = rng.choice([1.0, 1.0, 0.5, -2.0, 3.0])
    opts["requires"] = rng.choice([(True, True, True), (True, True, True), (True, False, False),
                                   (False, True, True), (True, False, True), (False, False, True)])
    g = torch.Generator(device=device).manual_seed(rng.randrange(1 << 30))

    def tensor():
        layout = rng.choice(["contiguous", "contiguous", "row_stride", "offset", "broadcast",
                             "column_major"])
        scale = rng.choice([1.0, 1.0, 0.01, 10.0])
        if layout == "row_stride":
            x = torch.rand(batch, dim + rng.choice([1, 3, 4, 8]), generator=g, device=device)[:, :dim]
        elif layout == "offset":
            off = rng.choice([1, 2, 3])
            x = torch.rand(batch * dim + off, generator=g, device=device)[off:].view(batch, dim)
        elif layout == "broadcast" and batch > 0:
            x = torch.rand(1, dim, generator=g, device=device)
        elif layout == "column_major":
            x = torch.rand(dim, batch, generator=g, device=device).t()
        else:
            x = torch.rand(batch, dim, generator=g, device=device)
        return (x * scale).to(dtype)

    return (tensor(), tensor(), tensor()), opts


def fp64_bound(a, p, n, opts):
    a, p, n = a.double(), p.double(), n.double()
    d = [torch.pairwise_distance(x, y, opts["p"], opts["eps"]) for x, y in ((a, p), (a, n), (p, n))]
    losses = F.triplet_margin_loss(a, p, n, opts["margin"], opts["p"], opts["eps"], opts["swap"],
                                   reduction="none")
    scale = 1 + sum(x.abs() for x in d)
    return losses, scale


def loss_options(opts):
    return {k: v for k, v in opts.items() if k not in ("upstream", "requires")}


def check_forward(inputs, opts):
    opts = loss_options(opts)
    ours = ft.triplet_margin_loss(*inputs, **opts)
    theirs = F.triplet_margin_loss(*inputs, **opts)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    if ours.device.type == "cpu":
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)
        return
    ref, scale = fp64_bound(*inputs, opts)
    tol = TOL[ours.dtype] * scale
    if opts["reduction"] == "mean":
        ref, tol = ref.mean(), tol.mean()
    elif opts["reduction"] == "sum":
        ref, tol = ref.sum(), tol.sum()
    err = (ours.double() - ref).abs()
    # A loss beyond the dtype's range (fp16 tops out at 65504; p = 0.5 distances do not) is
    # right as the correctly rounded inf; torch gives nan there (inf - inf).
    rounded = ref.to(ours.dtype)
    overflow = rounded.isinf() & (ours == rounded)
    assert bool(((err <= tol) | (ref.isnan() & ours.isnan()) | overflow).all()), (err / tol).max()


def check_backward(inputs, opts):
    """fp32/fp64, differentiable p: gradients against float64 autograd, on rows whose hinge is
    decisively on or off (a hinge within rounding of 0 may legitimately go either way)."""
    if inputs[0].dtype not in (torch.float32, torch.float64) or opts["p"] in (0.0, -math.inf):
        return
    upstream, requires, opts = opts["upstream"], opts["requires"], loss_options(opts)

    def backward(out):
        (out.sum() if upstream == 1.0 else (upstream * out).sum()).backward()

    xs = [x.detach().clone().requires_grad_(r) for x, r in zip(inputs, requires)]
    backward(ft.triplet_margin_loss(*xs, **opts))
    refs = [x.detach().double().requires_grad_() for x in inputs]
    backward(F.triplet_margin_loss(*refs, **opts))
    _, scale = fp64_bound(*inputs, {**opts, "reduction": "none"})
    a64, p64, n64 = (x.detach().double() for x in inputs)
    d_ap = torch.pairwise_distance(a64, p64, opts["p"], opts["eps"])
    d_an = torch.pairwise_distance(a64, n64, opts["p"], opts["eps"])
    if opts["swap"]:
        d_an = d_an.minimum(torch.pairwise_distance(p64, n64, opts["p"], opts["eps"]))
    decisive = ((opts["margin"] + d_ap - d_an).abs() > 1e-3 * scale).reshape(-1)
    tol = 1e-4 if inputs[0].dtype == torch.float32 else 1e-9
    # torch's own gradients at the input dtype: for p < 2 the element derivative |u|^(p-1) is
    # ill-conditioned where u = x - y + eps is within rounding of 0, and there no result at the
    # input dtype is within tol of float64 (eps itself rounds); we must then be as close as torch.
    ts = [x.detach().clone().requires_grad_() for x in inputs]
    backward(F.triplet_margin_loss(*ts, **opts))
    for x, r, t in zip(xs, refs, ts):
        if not x.requires_grad:
            assert x.grad is None
            continue
        g, rg, tg = x.grad.double(), r.grad, t.grad.double()
        if g.shape[0] == decisive.numel():
            g, rg, tg = g[decisive], rg[decisive], tg[decisive]
        elif not decisive.all():
            continue  # a broadcast row sums every row's gradient, ambiguous ones included
        atol = tol * max(1.0, rg.abs().max().item() if rg.numel() else 1.0)
        within = (g - rg).abs() <= atol + tol * rg.abs()
        if not within.all() and opts["p"] < 2:
            worst = (g - rg).abs().max().item()
            assert worst <= 2 * (tg - rg).abs().max().item(), (worst, "torch's", (tg - rg).abs().max())
            continue
        torch.testing.assert_close(g, rg, rtol=tol, atol=atol)


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU visible"))])
def test_fuzz_forward_and_backward(device):
    rng = random.Random(1234)
    failures = []
    for case in range(CASES if device == "cuda" else min(CASES, 200)):
        inputs, opts = make_case(rng, device)
        for check in (check_forward, check_backward):
            try_it = _guard(check, inputs, opts)
            if try_it is not None:
                failures.append((case, check.__name__, [tuple(x.shape) for x in inputs],
                                 [x.stride() for x in inputs], inputs[0].dtype, opts, try_it))
    assert not failures, f"{len(failures)} of {CASES} cases failed; first: {failures[:3]}"


def _guard(check, inputs, opts):
    """Runs one check; returns its failure message, None if it passed (collects them all)."""
    try:
        check(inputs, opts)
    except AssertionError as e:
        return str(e)[:300]
    return None
