"""Training in one pass: under autograd, 'mean' and 'sum' losses of float32 and bfloat16 rows the
kernels can hold get their gradients written by the forward (for an upstream gradient of 1); the
backward applies the upstream gradient in place. Whichever path runs, the bits are the same:
each path is forced here and checked against the other, and both against torch. GPU only."""

import math

import pytest
import torch
import torch.nn.functional as F

import fused_triplet as ft
from conftest import assert_as_accurate_as_torch, forced, rand_triplet, requires_cuda

pytestmark = requires_cuda
DEV = "cuda"
ROWS, ONE_PASS = 0, 2  # forward families: the rows kernel (then the backward kernels), one pass


def bits(x):
    return None if x is None else x.view(torch.int16 if x.element_size() == 2 else torch.int32)


def step(inputs, requires=(True, True, True), weight=None, forward=-1, **kw):
    """loss and the inputs' .grad after (weight * loss).backward() (loss.backward() for None)."""
    xs = [x.detach().clone().requires_grad_(r) for x, r in zip(inputs, requires)]
    with forced(forward):
        loss = ft.triplet_margin_loss(*xs, **kw)
        (loss if weight is None else loss * weight).backward()
    return loss.detach(), [x.grad for x in xs]


def torch_grads(inputs, requires, weight, double=False, **kw):
    xs = [(x.double() if double else x).detach().clone().requires_grad_(r)
          for x, r in zip(inputs, requires)]
    loss = F.triplet_margin_loss(*xs, **kw)
    (loss if weight is None else loss * weight).backward()
    return [x.grad for x in xs]


def takes_one_pass(inputs, pnorm=2.0, swap=False):
    return "training onepass" in ft._ops().describe_plans(*inputs, pnorm, swap)


# Teams of 8, 32 and 256 threads (few rows promote theirs), up to 8 packs per thread, and 12 and
# 16 (teams of 32) where the GPU's shared memory per block holds them (an H100/H200 does).
CASES = [((1024, 128), torch.float32), ((300, 64), torch.bfloat16), ((4096, 512), torch.float32),
         ((1000, 1024), torch.bfloat16), ((64, 8192), torch.float32), ((5, 4096), torch.float32),
         ((33, 16384), torch.bfloat16), ((2, 7, 96), torch.float32)]
CASES_BEYOND_8_PACKS = [((8192, 1536), torch.float32), ((8192, 3072), torch.bfloat16)]


@pytest.mark.parametrize("shape,dtype", CASES + CASES_BEYOND_8_PACKS)
@pytest.mark.parametrize("pnorm", [2.0, 1.0])
def test_one_pass_same_bits_as_two_passes(shape, dtype, pnorm):
    inputs = rand_triplet(shape, dtype, DEV, seed=1)
    if (shape, dtype) in CASES_BEYOND_8_PACKS and not takes_one_pass(inputs, pnorm):
        pytest.skip("this GPU's shared memory per block does not hold 12 packs per thread")
    assert takes_one_pass(inputs, pnorm)
    for swap in (False, True):
        for reduction in ("mean", "sum"):
            for weight in (None, 0.5, -3.0):
                for requires in ((True, True, True), (True, False, True), (False, True, False)):
                    kw = dict(p=pnorm, swap=swap, reduction=reduction, margin=0.5)
                    loss1, one = step(inputs, requires, weight, ONE_PASS, **kw)
                    loss2, two = step(inputs, requires, weight, ROWS, **kw)
                    case = (swap, reduction, weight, requires)
                    assert torch.equal(bits(loss1), bits(loss2)), case
                    for g1, g2, r in zip(one, two, requires):
                        assert (g1 is not None) == r and (g2 is not None) == r, case
                        if r:
                            assert torch.equal(bits(g1), bits(g2)), case
                    if requires != (True, True, True):
                        continue
                    theirs = torch_grads(inputs, requires, weight, **kw)
                    ref = torch_grads(inputs, requires, weight, double=True, **kw)
                    for g, t, r in zip(one, theirs, ref):
                        assert_as_accurate_as_torch(g, t, r)


@pytest.mark.parametrize("upstream", [math.nan, math.inf, -math.inf, 0.0])
@pytest.mark.parametrize("swap", [False, True])
def test_nonfinite_and_zero_upstream_like_torch(upstream, swap):
    """Rows whose hinge is off keep a zero gradient whatever the upstream gradient (torch's
    clamp_min passes none of it to them), the others take it: non-finite where torch's are.
    An infinite upstream gradient times the local gradient a - p's and a - n's terms sum to is
    +-inf where torch, multiplying each term first, may add inf to -inf: NaN."""
    a, p, n = rand_triplet((64, 256), torch.float32, DEV, seed=2)
    p[0::2] = a[0::2] + 0.01 * n[0::2]  # inactive hinges on even rows
    weight = torch.tensor(upstream, device=DEV)
    ours = {}
    for name, family in (("one", ONE_PASS), ("two", ROWS)):
        ours[name] = step((a, p, n), weight=weight, forward=family, swap=swap)[1]
    theirs = torch_grads((a, p, n), (True, True, True), weight, swap=swap)
    for g1, g2, t in zip(ours["one"], ours["two"], theirs):
        assert torch.equal(bits(g1), bits(g2))
        assert torch.equal(g1.isfinite(), t.isfinite())
        assert torch.equal(g1[t.isinf()], t[t.isinf()])
        if not math.isinf(upstream):
            assert torch.equal(g1.isnan(), t.isnan())
        assert (g1[0::2] == 0).all()
        finite = g1.isfinite() & t.isfinite()
        torch.testing.assert_close(g1[finite], t[finite], rtol=1e-4, atol=1e-6)


def test_path_follows_the_last_upstream_gradient():
    """The forward writes gradients (allocating them) only while the last backward of the same
    problem saw an upstream gradient of 1."""
    xs = [x.requires_grad_() for x in rand_triplet((4096, 256), torch.float32, DEV, seed=3)]
    grads_bytes = 3 * xs[0].numel() * xs[0].element_size()
    kw = dict(margin=1.2345)  # a problem of its own: no other test's backward notes for it

    def forward_allocates(weight):
        for x in xs:
            x.grad = None
        torch.cuda.synchronize()  # the previous backward's note has landed
        before = torch.cuda.memory_allocated()
        loss = ft.triplet_margin_loss(*xs, **kw)
        allocated = torch.cuda.memory_allocated() - before
        (loss if weight is None else loss * weight).backward()
        return allocated >= grads_bytes

    forward_allocates(None)
    assert forward_allocates(0.5)      # the last backward saw 1: one pass
    assert not forward_allocates(0.5)  # it saw 0.5: two passes
    assert not forward_allocates(None)
    assert forward_allocates(None)     # 1 again: one pass again


def test_second_backward_with_retained_graph():
    xs = [x.requires_grad_() for x in rand_triplet((512, 512), torch.float32, DEV, seed=4)]
    with forced(ONE_PASS):
        loss = ft.triplet_margin_loss(*xs, swap=True)
    loss.backward(retain_graph=True)  # the one pass's gradients
    first = [x.grad.clone() for x in xs]
    for x in xs:
        x.grad = None
    (2 * loss).backward()  # they are gone: the backward kernels
    for x, g in zip(xs, first):
        assert torch.equal(bits(x.grad), bits(2 * g))


def test_create_graph_differentiates_torch_formula():
    inputs = rand_triplet((64, 512), torch.float32, DEV, seed=5)
    xs = [x.clone().requires_grad_() for x in inputs]
    with forced(ONE_PASS):
        loss = ft.triplet_margin_loss(*xs, swap=True, reduction="sum")
    grads = torch.autograd.grad(loss, xs, create_graph=True)
    assert all(g.grad_fn is not None for g in grads)
    theirs = torch_grads(inputs, (True, True, True), None, swap=True, reduction="sum")
    for g, t in zip(grads, theirs):
        torch.testing.assert_close(g, t, rtol=1e-4, atol=1e-6)
    second = torch.autograd.grad(sum(g.square().sum() for g in grads), xs)
    assert all(torch.isfinite(s).all() for s in second)


@pytest.mark.parametrize("fast_mode", [False, True])
def test_gradcheck_float32(fast_mode):
    """The one pass takes float32 (not float64): finite differences at float32's precision.
    fast_mode's random projections send upstream gradients other than 1."""
    a, p, n = (x.requires_grad_() for x in rand_triplet((6, 32), torch.float32, DEV, seed=6))
    assert takes_one_pass((a, p, n))
    with forced(ONE_PASS):
        for reduction in ("mean", "sum"):
            fn = lambda *xs: ft.triplet_margin_loss(*xs, margin=2.0, reduction=reduction)
            with pytest.warns(UserWarning, match="double precision"):
                assert torch.autograd.gradcheck(fn, (a, p, n), eps=1e-2, atol=2e-3, rtol=1e-2,
                                                fast_mode=fast_mode)


def test_no_gradients_written_without_autograd():
    xs = [x.requires_grad_() for x in rand_triplet((4096, 256), torch.float32, DEV, seed=7)]
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            loss = ft.triplet_margin_loss(*xs)
            assert torch.cuda.memory_allocated() - before < xs[0].numel() * 4
        assert loss.grad_fn is None


def test_paths_cannot_be_forced_where_they_cannot_run():
    a, p, n = (x.requires_grad_() for x in rand_triplet((8, 64), torch.float32, DEV))
    with forced(ONE_PASS), pytest.raises(RuntimeError, match="onepass forward takes p = 1 or 2"):
        ft.triplet_margin_loss(a, p, n, p=3.0)
    a, p, n = (x.requires_grad_() for x in rand_triplet((8, 64), torch.float16, DEV))
    with forced(ONE_PASS), pytest.raises(RuntimeError, match="onepass forward takes float32 and bfloat16"):
        ft.triplet_margin_loss(a, p, n)
    with forced(ONE_PASS):  # 'none' and no-grad calls take the other kernels
        ft.triplet_margin_loss(a, p, n, reduction="none").sum().backward()
        with torch.no_grad():
            ft.triplet_margin_loss(a, p, n)
