"""The fused backward (the op's registered autograd) against torch's autograd; GPU only."""

import math

import pytest
import torch
import torch.nn.functional as F

import fused_triplet as ft
from conftest import assert_as_accurate_as_torch, distance_scale, rand_triplet, requires_cuda

pytestmark = requires_cuda
DEV = "cuda"
P_VALUES = [2.0, 1.0, math.inf, -math.inf, 0.0, 3.0, 1.5, 0.5, -1.5]


def fused_loss(a, p, n, margin=1.0, pnorm=2.0, eps=1e-6, swap=False, reduction="mean"):
    # Inputs that require grad must take the fused op, not the torch path.
    assert ft._fused_shape(a, p, n, pnorm) is not None
    return ft.triplet_margin_loss(a, p, n, margin=margin, p=pnorm, eps=eps, swap=swap,
                                  reduction=reduction)


def grads(fn, inputs, upstream=None):
    xs = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    out = fn(*xs)
    out.backward(upstream if upstream is not None else torch.ones_like(out))
    return out.detach(), [x.grad for x in xs]


@pytest.mark.parametrize("pnorm", P_VALUES)
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_gradcheck_fp64(pnorm, swap, reduction):
    a, p, n = (x.double().requires_grad_() for x in rand_triplet((5, 7), device=DEV, seed=1))
    fn = lambda *xs: fused_loss(*xs, margin=2.0, pnorm=pnorm, swap=swap, reduction=reduction)
    assert torch.autograd.gradcheck(fn, (a, p, n), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("shape", [(7,), (3, 4, 9), (6, 1), (2, 3000), (300, 40)])
def test_gradcheck_shapes_and_eps(shape):
    a, p, n = (x.double().requires_grad_() for x in rand_triplet(shape, device=DEV, seed=2))
    for eps in (0.0, 1e-6, 0.3):
        fn = lambda *xs: fused_loss(*xs, margin=1.5, eps=eps, swap=True)
        assert torch.autograd.gradcheck(fn, (a, p, n))


@pytest.mark.parametrize("pnorm", [2.0, 1.0, math.inf, 3.0, 0.5])
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("shape", [(64, 100), (16, 1000), (8, 8192)])
def test_matches_torch_autograd_fp32(pnorm, swap, reduction, shape):
    """fp32 loss and gradients against float64 autograd: as accurate as torch's fp32 autograd
    (both round differently: p = 0.5 distances are ~1e7 here and the loss their difference)."""
    a, p, n = (x.requires_grad_() for x in rand_triplet(shape, device=DEV, seed=3))
    kw = dict(margin=2.0, p=pnorm, swap=swap, reduction=reduction)
    upstream = torch.rand(shape[:-1], device=DEV) if reduction == "none" else None
    out, ours = grads(lambda *x: fused_loss(*x, margin=2.0, pnorm=pnorm, swap=swap,
                                            reduction=reduction), (a, p, n), upstream)
    ref_out, theirs = grads(lambda *x: F.triplet_margin_loss(*x, **kw), (a, p, n), upstream)
    exact_out, exact = grads(lambda *x: F.triplet_margin_loss(*x, **kw),
                             [x.detach().double().requires_grad_() for x in (a, p, n)],
                             None if upstream is None else upstream.double())
    scale = distance_scale(a, p, n, pnorm, 1e-6, swap)
    if reduction != "none":
        scale = scale.mean() if reduction == "mean" else scale.sum()
    assert_as_accurate_as_torch(out, ref_out, exact_out, scale)
    for x, y, r in zip(ours, theirs, exact):
        assert_as_accurate_as_torch(x, y, r)


@pytest.mark.parametrize("pnorm", [2.0, 1.0, math.inf, 3.0])
@pytest.mark.parametrize("shape", [(2, 4500), (3, 10001), (1, 1 << 16)])
def test_split_rows_gradients_fp64(pnorm, shape):
    """Rows of more than 32 KiB and fewer than 512 of them: forward and backward cut each row
    into column slices (inf-norm ties are still counted over the whole row)."""
    a, p, n = (x.double().requires_grad_() for x in rand_triplet(shape, device=DEV, seed=17))
    for swap in (False, True):
        kw = dict(margin=2.0, p=pnorm, swap=swap, reduction="sum")
        out, ours = grads(lambda *x: fused_loss(*x, margin=2.0, pnorm=pnorm, swap=swap,
                                                reduction="sum"), (a, p, n))
        ref_out, theirs = grads(lambda *x: F.triplet_margin_loss(*x, **kw), (a, p, n))
        torch.testing.assert_close(out, ref_out)
        for x, y in zip(ours, theirs):
            torch.testing.assert_close(x, y)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes_close_to_fp64(dtype):
    a, p, n = (x.to(dtype).requires_grad_() for x in rand_triplet((256, 512), device=DEV, seed=4))
    _, ours = grads(lambda *x: fused_loss(*x, swap=True), (a, p, n))
    _, ref = grads(lambda *x: F.triplet_margin_loss(*x, swap=True),
                   [x.detach().double().requires_grad_() for x in (a, p, n)])
    _, theirs = grads(lambda *x: F.triplet_margin_loss(*x, swap=True), (a, p, n))
    for x, r, t in zip(ours, ref, theirs):
        assert x.dtype == dtype
        if dtype == torch.float64:
            torch.testing.assert_close(x, r)
        else:
            assert (x.double() - r).abs().max() <= (t.double() - r).abs().max() * 1.01 + 1e-7


# Aligned rows, p = 2 or 1: long rows, 16-byte rows (hundreds per block), rows that cross
# blocks (16384 x 300), few long rows (3 x 1500000, split in forward), a single row.
POINTWISE_SHAPES = [(1500, 3000), (1100000, 8), (16384, 300), (3, 1500000), (600, 3000),
                    (4096, 8), (2048, 100), (3, 100000), (1, 4), (1100, 3000)]
# Strided rows (x[:, :D] of a (rows, width) tensor), 16-byte aligned, in every dtype.
ALIGNED_STRIDED = ((1100, 4104), 4112)


@pytest.mark.parametrize("shape, width", [(s, None) for s in POINTWISE_SHAPES] + [ALIGNED_STRIDED])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("pnorm", [2.0, 1.0])
@pytest.mark.parametrize("swap", [False, True])
def test_needed_gradients_aligned_rows(dtype, pnorm, swap, shape, width):
    """Aligned rows with p = 2 or 1, contiguous or strided: each subset of needed gradients, a
    per-sample upstream gradient, against float64 autograd, as accurate as torch's own autograd
    in that dtype."""
    rows, d = shape
    a, p, n = rand_triplet((rows, width or d), dtype=dtype, device=DEV, seed=19)
    view = (lambda x: x) if width is None else (lambda x: x[:, :d])
    upstream = torch.rand(rows, device=DEV, dtype=dtype)
    kw = dict(margin=2.0, p=pnorm, swap=swap, reduction="none")
    _, exact = grads(lambda *x: F.triplet_margin_loss(*map(view, x), **kw),
                     [x.detach().double().requires_grad_() for x in (a, p, n)], upstream.double())
    for mask in ([True, True, True], [True, False, True], [False, True, False]):
        xs = [x.detach().clone().requires_grad_(m) for x, m in zip((a, p, n), mask)]
        _, ours = grads(lambda *x: fused_loss(*map(view, x), margin=2.0, pnorm=pnorm, swap=swap,
                                              reduction="none"), xs, upstream)
        _, theirs = grads(lambda *x: F.triplet_margin_loss(*map(view, x), **kw), xs, upstream)
        for x, y, r, needed in zip(ours, theirs, exact, mask):
            if not needed:
                assert x is None
                continue
            assert x.dtype == dtype
            assert_as_accurate_as_torch(x, y, r)


# Team sizes on both sides of the plan's fill rule: many rows keep teams of 8 and 32 threads
# with several packs per thread; few rows take the next bigger team (8 -> 32, 32 -> 256).
# (32768, 200) fp32 and (32768, 512) bf16: teams of 8 with 50 and 64 packs per row (the most a
# team of 8 takes), so their threads run the 4-pack unrolled loop, not only its tail.
TEAM_SHAPES = [((32768, 64), torch.float32), ((32768, 200), torch.float32),
               ((32768, 512), torch.bfloat16), ((8192, 520), torch.float32),
               ((1024, 128), torch.float32), ((128, 2048), torch.bfloat16),
               ((128, 4096), torch.bfloat16), ((100, 4096), torch.float32)]


@pytest.mark.parametrize("shape, dtype", TEAM_SHAPES)
@pytest.mark.parametrize("pnorm", [2.0, math.inf, 3.0])
def test_team_sizes_forward_and_gradients(shape, dtype, pnorm):
    a, p, n = rand_triplet(shape, dtype=dtype, device=DEV, seed=23)
    upstream = torch.rand(shape[0], device=DEV, dtype=dtype)
    kw = dict(margin=2.0, p=pnorm, swap=True, reduction="none")
    exact_out, exact = grads(lambda *x: F.triplet_margin_loss(*x, **kw),
                             [x.detach().double().requires_grad_() for x in (a, p, n)],
                             upstream.double())
    xs = [x.detach().clone().requires_grad_() for x in (a, p, n)]
    out, ours = grads(lambda *x: fused_loss(*x, margin=2.0, pnorm=pnorm, swap=True,
                                            reduction="none"), xs, upstream)
    ref_out, theirs = grads(lambda *x: F.triplet_margin_loss(*x, **kw), xs, upstream)
    assert_as_accurate_as_torch(out, ref_out, exact_out,
                                distance_scale(a, p, n, pnorm, 1e-6, True))
    for x, y, r in zip(ours, theirs, exact):
        assert x.dtype == dtype
        assert_as_accurate_as_torch(x, y, r)


@pytest.mark.parametrize("width", [(3000, 3008), (1024, 1032)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pnorm", [2.0, 1.0])
def test_aligned_strided_rows_gradients(pnorm, dtype, width):
    """x[:, :D] of a wider tensor, rows 16-byte aligned but not contiguous."""
    d, wide_d = width
    wide = [x.detach().requires_grad_()
            for x in rand_triplet((600, wide_d), dtype=dtype, device=DEV, seed=20)]
    views = [w[:, :d] for w in wide]
    kw = dict(margin=2.0, p=pnorm, swap=True)
    ours = torch.autograd.grad(fused_loss(*views, margin=2.0, pnorm=pnorm, swap=True), wide)
    theirs = torch.autograd.grad(F.triplet_margin_loss(*views, **kw), wide)
    exact_in = [w.detach().double().requires_grad_() for w in wide]
    exact = torch.autograd.grad(F.triplet_margin_loss(*[w[:, :d] for w in exact_in], **kw),
                                exact_in)
    for x, y, r in zip(ours, theirs, exact):
        assert x.dtype == dtype
        assert_as_accurate_as_torch(x, y, r)


def test_only_needed_gradients():
    a, p, n = rand_triplet((32, 300), device=DEV, seed=5)
    a.requires_grad_()
    _, (ga, gp, gn) = grads(lambda *x: fused_loss(*x), (a, p, n))
    _, (ra, _, _) = grads(lambda *x: F.triplet_margin_loss(*x), (a, p, n))
    assert gp is None and gn is None
    torch.testing.assert_close(ga, ra)


def test_hinge_exactly_zero_as_installed_torch():
    # D = 1, eps = 0, p = 1: d_ap = 0, d_an = 2 = margin, so the hinge input is exactly 0.
    a = torch.zeros(4, 1, device=DEV, requires_grad=True)
    p = torch.zeros(4, 1, device=DEV, requires_grad=True)
    n = torch.full((4, 1), 2.0, device=DEV, requires_grad=True)
    _, ours = grads(lambda *x: fused_loss(*x, margin=2.0, pnorm=1.0, eps=0.0), (a, p, n))
    _, theirs = grads(lambda *x: F.triplet_margin_loss(*x, margin=2.0, p=1.0, eps=0.0), (a, p, n))
    for x, y in zip(ours, theirs):
        assert torch.equal(x, y)


@pytest.mark.parametrize("pnorm", [2.0, 3.0])
@pytest.mark.parametrize("swap", [False, True])
def test_inactive_and_nonfinite_rows_like_torch(pnorm, swap):
    """Positives close to their anchors on even rows leave those hinges inactive: their rows get
    a zero upstream gradient, which the scales return without dividing by the distance (and,
    under swap, the distance not chosen gets one on every row). That must keep torch's values,
    NaN and inf included: rows with an inf entry (NaN where 0 * inf) and one with a NaN entry
    (NaN across the row, as 0 / NaN gives)."""
    a, p, n = rand_triplet((64, 300), device=DEV, seed=23)
    p[0::2] = a[0::2] + 0.01 * n[0::2]
    a[3, 7], a[5, 11], n[9, 2], p[12, 4] = math.inf, math.nan, math.inf, -math.inf
    for x in (a, p, n):
        x.requires_grad_()
    kw = dict(margin=1.0, swap=swap, reduction="sum")
    _, ours = grads(lambda *x: fused_loss(*x, pnorm=pnorm, **kw), (a, p, n))
    _, theirs = grads(lambda *x: F.triplet_margin_loss(*x, p=pnorm, **kw), (a, p, n))
    hinge = F.triplet_margin_loss(a.detach(), p.detach(), n.detach(), p=pnorm, margin=1.0,
                                  swap=swap, reduction="none")
    assert (hinge == 0).sum() >= 16 and (hinge > 0).sum() >= 16  # both kinds of row
    for x, y in zip(ours, theirs):
        assert torch.equal(x.isnan(), y.isnan()) and torch.equal(x.isinf(), y.isinf())
        assert x.isnan().any(dim=1).sum() >= 2  # rows with a non-finite entry
        both = x.isfinite() & y.isfinite()
        # values within fp32 rounding (accuracy is test_matches_torch_autograd_fp32's business)
        torch.testing.assert_close(x[both], y[both], rtol=1e-4, atol=1e-6)
        assert torch.equal(x[hinge == 0].isfinite(), x[hinge == 0] == 0)  # inactive: 0 or NaN


def test_swap_ties_split_like_torch():
    a, p, n = rand_triplet((16, 50), device=DEV, seed=6)
    p = a.clone()  # d(p, n) == d(a, n) exactly: the minimum's gradient is split in half
    for x in (a, p, n):
        x.requires_grad_()
    _, ours = grads(lambda *x: fused_loss(*x, margin=50.0, swap=True), (a, p, n))
    _, theirs = grads(lambda *x: F.triplet_margin_loss(*x, margin=50.0, swap=True), (a, p, n))
    for x, y in zip(ours, theirs):
        torch.testing.assert_close(x, y)


def test_inf_norm_ties_like_torch():
    a = torch.zeros(3, 8, device=DEV, requires_grad=True)
    p = torch.tensor([[1., -1., 1., 0., 0., 0., 0., 0.]] * 3, device=DEV, requires_grad=True)
    n = torch.rand(3, 8, device=DEV, requires_grad=True)
    for pnorm in (math.inf, -math.inf):
        _, ours = grads(lambda *x: fused_loss(*x, margin=5.0, pnorm=pnorm, eps=0.0), (a, p, n))
        _, theirs = grads(lambda *x: F.triplet_margin_loss(*x, margin=5.0, p=pnorm, eps=0.0),
                          (a, p, n))
        for x, y in zip(ours, theirs):
            torch.testing.assert_close(x, y)


def test_broadcast_and_strided_inputs():
    g = torch.Generator(device=DEV).manual_seed(7)
    a = torch.rand(1, 300, device=DEV, generator=g, requires_grad=True)   # broadcast row
    wide = torch.rand(64, 310, device=DEV, generator=g)
    p = wide[:, :300].detach().requires_grad_()                            # row stride 310
    n = torch.rand(64, 300, device=DEV, generator=g, requires_grad=True)
    _, ours = grads(lambda *x: fused_loss(*x, swap=True), (a, p, n))
    _, theirs = grads(lambda *x: F.triplet_margin_loss(*x, swap=True), (a, p, n))
    for x, y in zip(ours, theirs):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


def test_poisoned_gradients_fully_written():
    keep = [torch.full((1 << 24,), float("nan"), device=DEV) for _ in range(4)]
    del keep
    a, p, n = (x.requires_grad_() for x in rand_triplet((100, 1003), device=DEV, seed=8))
    _, ours = grads(lambda *x: fused_loss(*x, margin=100.0), (a, p, n))
    assert all(torch.isfinite(x).all() for x in ours)


# Rows that are not 16-byte multiples (2047), short rows, rows across blocks, long rows, few
# long rows, aligned strided rows.
@pytest.mark.parametrize("shape, width", [(s, None) for s in [
    (500, 2047), (500, 2048), (16384, 300), (1500, 3000), (3, 100000), (3, 1500000)]] +
    [ALIGNED_STRIDED])
def test_deterministic_gradients(shape, width):
    rows, d = shape
    a, p, n = (x.requires_grad_()
               for x in rand_triplet((rows, width or d), device=DEV, seed=9))
    loss = lambda *x: fused_loss(*(t[:, :d] for t in x), swap=True)
    _, first = grads(loss, (a, p, n))
    for _ in range(100):
        _, again = grads(loss, (a, p, n))
        assert all(torch.equal(x, y) for x, y in zip(first, again))


def test_opcheck_with_grad():
    a, p, n = (x.requires_grad_() for x in rand_triplet((6, 40), device=DEV, seed=10))
    torch.library.opcheck(ft._ops().triplet_margin_loss, (a, p, n, 1.0, 2.0, 1e-6, True, 1))
    d = torch.rand(3, 6, device=DEV)
    torch.library.opcheck(ft._ops().triplet_margin_loss_backward,
                          (torch.rand((), device=DEV), a.detach(), p.detach(), n.detach(), d,
                           1.0, 2.0, 1e-6, True, 1, True, [True, False, True]))


def test_compile_fullgraph_forward_backward():
    a, p, n = (x.requires_grad_() for x in rand_triplet((128, 512), device=DEV, seed=11))
    compiled = torch.compile(lambda *x: fused_loss(*x, swap=True), fullgraph=True)
    _, ours = grads(compiled, (a, p, n))
    _, ref = grads(lambda *x: fused_loss(*x, swap=True), (a, p, n))
    for x, y in zip(ours, ref):
        torch.testing.assert_close(x, y)


def test_compile_reduce_overhead_forward_backward():
    """torch.compile(mode="reduce-overhead"): CUDA graphs (cudagraph trees) around the fused
    forward and backward."""
    a, p, n = (x.requires_grad_() for x in rand_triplet((128, 512), device=DEV, seed=18))
    compiled = torch.compile(lambda *x: fused_loss(*x, swap=True), mode="reduce-overhead")
    for _ in range(3):  # recorded, then replayed
        out, ours = grads(compiled, (a, p, n))
    ref_out, ref = grads(lambda *x: fused_loss(*x, swap=True), (a, p, n))
    torch.testing.assert_close(out, ref_out)
    for x, y in zip(ours, ref):
        torch.testing.assert_close(x, y)


# Whole rows, whose 'mean' / 'sum' follow-up kernel sums block sums, and split rows ((4, 65536)
# fp32: 8 slices per row), whose follow-up combines the slices; on sm_90 both follow-ups are
# chained to their main grid (programmatic dependent launch), which a graph must keep.
@pytest.mark.parametrize("shape", [(256, 1024), (4, 65536)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cuda_graph_capture_and_replay(shape, reduction):
    static = [x.requires_grad_() for x in rand_triplet(shape, device=DEV, seed=12)]
    loss_fn = lambda *x: fused_loss(*x, reduction=reduction).sum()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture
        for _ in range(2):
            loss_fn(*static).backward()
    torch.cuda.current_stream().wait_stream(side)
    for x in static:
        x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = loss_fn(*static)
        loss.backward()
    fresh = rand_triplet(shape, device=DEV, seed=13)
    with torch.no_grad():
        for s, f in zip(static, fresh):
            s.copy_(f)
    graph.replay()
    torch.cuda.synchronize()
    ref_loss, ref_grads = grads(loss_fn, [f.requires_grad_() for f in fresh])
    torch.testing.assert_close(loss.detach(), ref_loss)
    for s, r in zip(static, ref_grads):
        torch.testing.assert_close(s.grad, r)


def test_extra_memory_is_per_sample_only():
    a, p, n = (x.requires_grad_() for x in rand_triplet((4096, 2048), device=DEV, seed=14))
    fused_loss(a, p, n).backward()  # warm up; grads now exist
    for x in (a, p, n):
        x.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fused_loss(a, p, n).backward()
    torch.cuda.synchronize()
    grads_bytes = 3 * a.numel() * a.element_size()
    extra = torch.cuda.max_memory_allocated() - base - grads_bytes
    assert extra <= 1 << 20, extra


def test_grad_fn_is_the_fused_op():
    a, p, n = (x.requires_grad_() for x in rand_triplet((8, 64), device=DEV, seed=15))
    loss = ft.triplet_margin_loss(a, p, n)
    graph = []
    node = loss.grad_fn
    while node is not None:  # the mean's input comes from the fused op's autograd node
        graph.append(type(node).__name__)
        node = node.next_functions[0][0] if node.next_functions else None
    assert not any("Norm" in name or "Clamp" in name for name in graph), graph


@pytest.mark.parametrize("pnorm", [2.0, 1.0, 3.0])
def test_double_backward_through_torch_formula(pnorm):
    a, p, n = (x.double().requires_grad_() for x in rand_triplet((4, 6), device=DEV, seed=16))
    fn = lambda *xs: fused_loss(*xs, margin=2.0, pnorm=pnorm, swap=True, reduction="sum")
    assert torch.autograd.gradgradcheck(fn, (a, p, n))
