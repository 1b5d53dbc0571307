import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(
    not HAS_CUDA, reason="no CUDA GPU visible: the fused kernels run only on a GPU")


def announce(config, line):
    """A line on the terminal now, past pytest's capture (a build's minute of silence says why)."""
    reporter = config.pluginmanager.getplugin("terminalreporter")
    capture = config.pluginmanager.getplugin("capturemanager")
    if reporter is None:
        return
    if capture is None:
        reporter.write_line(line)
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line(line)


def fused_loss(anchor, positive, negative, margin=1.0, p=2.0, eps=1e-6, swap=False,
               reduction="mean", forward=-1, backward=-1):
    """fused_triplet's loss (under autograd where the inputs require grad) on inputs of one shape
    and dtype, with the kernel families asked for: forward 0 rows, 1 ring, 2 one pass; backward
    0 rows, 1 pointwise, 2 check; -1 the plan's choice."""
    import fused_triplet as ft

    reduction = {"none": 0, "mean": 1, "sum": 2}[reduction]
    return ft._ops().triplet_margin_loss(anchor, positive, negative, float(margin), float(p),
                                         float(eps), swap, reduction, False, forward,
                                         backward)[0]


def same_error(ours, theirs):
    """Both callables raise; assert the same exception type and message."""
    with pytest.raises(Exception) as expected:
        theirs()
    with pytest.raises(type(expected.value)) as got:
        ours()
    assert type(got.value) is type(expected.value)
    assert str(got.value) == str(expected.value)


def rand_triplet(shape, dtype=torch.float32, device="cpu", seed=0):
    """Fresh random, never-zero inputs, anchors scaled as KernelBench does."""
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.rand(shape, generator=g, device=device, dtype=torch.float32)
    a = a * torch.rand((), generator=g, device=device).add_(0.25)
    p = torch.rand(shape, generator=g, device=device, dtype=torch.float32)
    n = torch.rand(shape, generator=g, device=device, dtype=torch.float32)
    return a.to(dtype), p.to(dtype), n.to(dtype)



def distance_scale(a, p, n, pnorm=2.0, eps=1e-6, swap=False):
    """Per-sample 1 + the float64 distances a loss is made of: the loss is their difference, so
    its fp32 rounding error scales with them, not with the loss."""
    a, p, n = a.double(), p.double(), n.double()
    pairs = ((a, p), (a, n), (p, n)) if swap else ((a, p), (a, n))
    return 1 + sum(torch.pairwise_distance(x, y, pnorm, eps).abs() for x, y in pairs)


def assert_as_accurate_as_torch(ours, theirs, ref, scale=None, slack=2.0, floor=1e-6):
    """`ours` against a float64 reference `ref`: NaN and inf exactly where torch's result
    (`theirs`) has them; elsewhere a max abs error at most `slack` x torch's own, or `floor` x
    the magnitude the rounding scales with (`scale`, default |ref|): a few ulps, where summation
    order alone decides which of two fp32 results is closer."""
    o, t, r = ours.double(), theirs.double(), ref.double()
    assert torch.equal(o.isnan(), t.isnan()) and torch.equal(o.isinf(), t.isinf())
    assert torch.equal(o[o.isinf()], t[t.isinf()])
    finite = o.isfinite() & r.isfinite()
    if not finite.any():
        return
    scale = r.abs() if scale is None else scale.double().expand_as(r)
    err_ours = (o - r)[finite].abs().max().item()
    err_torch = (t - r)[finite].abs().max().item()
    bound = slack * err_torch + floor * scale[finite].max().item()
    assert err_ours <= bound, (err_ours, err_torch, bound)
