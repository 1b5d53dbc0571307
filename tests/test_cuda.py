"""The fused CUDA kernels against torch and a float64 reference (skipped without a GPU)."""

import math

import pytest
import torch
import torch.nn.functional as F

import fused_triplet as ft
from conftest import (HAS_CUDA, assert_as_accurate_as_torch, distance_scale, rand_triplet,
                      requires_cuda, same_error)

pytestmark = requires_cuda
DEV = "cuda"


def poison_allocator():
    """Fill cached allocator blocks with NaN and free them, so outputs the op allocates next
    start as NaN: a row the kernel skipped shows up as NaN, never as a plausible 0."""
    keep = []
    for numel in (1, 16, 1 << 10, 1 << 14, 1 << 18, 1 << 22, 1 << 24):
        keep.append(torch.full((numel,), float("nan"), device=DEV))
    del keep


def fp64_losses(a, p, n, margin=1.0, pnorm=2.0, eps=1e-6, swap=False):
    """Per-sample losses in float64 from the (exactly upcast) inputs."""
    return torch.nn.functional.triplet_margin_loss(a.double(), p.double(), n.double(), margin,
                                                   pnorm, eps, swap, reduction="none")


def fused(*args, **kw):
    poison_allocator()
    out = ft.triplet_margin_loss(*args, **kw)
    torch.cuda.synchronize()
    return out


# Shapes that reach each launch configuration: 8, 32 and 256 threads per row, odd D (vector
# tail), D = 1, one row.
SHAPES = [(37, 3), (300, 1), (257, 100), (64, 257), (33, 1000), (9, 3000), (5, 8195), (1, 20000)]
P_VALUES = [2.0, 1.0, math.inf, -math.inf, 0.0, 3.0, 0.5, -1.5]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("swap", [False, True])
def test_fp32_per_sample_vs_fp64_and_torch(shape, swap):
    for seed in range(3):
        a, p, n = rand_triplet(shape, device=DEV, seed=seed)
        ours = fused(a, p, n, swap=swap, reduction="none")
        ref = fp64_losses(a, p, n, swap=swap)
        torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours, F.triplet_margin_loss(a, p, n, swap=swap, reduction="none"),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pnorm", P_VALUES)
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("shape", [(70, 5), (40, 300), (6, 4001)])
def test_every_p(pnorm, swap, shape):
    for seed in range(2):
        a, p, n = rand_triplet(shape, device=DEV, seed=seed)
        kw = dict(margin=0.5, p=pnorm, eps=1e-6, swap=swap, reduction="none")
        ours = fused(a, p, n, **kw).double()
        ref = fp64_losses(a, p, n, 0.5, pnorm, 1e-6, swap)
        # The loss is a difference of two distances: fp32 rounding scales with their size
        # (p = 0.5 squares a sum of thousands of terms), so the bound does too.
        a64, p64, n64 = a.double(), p.double(), n.double()
        dists = [torch.pairwise_distance(x, y, pnorm, 1e-6) for x, y in ((a64, p64), (a64, n64), (p64, n64))]
        bound = 1e-5 * (1 + sum(d.abs() for d in dists))
        assert ((ours - ref).abs() <= bound).all(), ((ours - ref).abs() / bound).max()
        theirs = F.triplet_margin_loss(a, p, n, **kw).double()
        assert ((ours - theirs).abs() <= 2 * bound).all(), ((ours - theirs).abs() / bound).max()


def check_reductions_and_fallbacks(a, p, n, pnorm, pad):
    """Every reduction with and without swap, then a broadcast anchor row (row stride 0) and a
    row-stride view of p (`pad` extra columns), against torch and float64."""
    rows, dim = a.shape
    for swap in (False, True):
        kw = dict(p=pnorm, swap=swap)
        ref = fp64_losses(a, p, n, 1.0, pnorm, 1e-6, swap)
        sc = distance_scale(a, p, n, pnorm, 1e-6, swap)
        for red, r, rs in (("none", ref, sc), ("mean", ref.mean(), sc.mean()),
                           ("sum", ref.sum(), sc.sum())):
            ours = fused(a, p, n, reduction=red, **kw)
            assert ours.dtype == a.dtype
            assert_as_accurate_as_torch(ours, F.triplet_margin_loss(a, p, n, reduction=red, **kw),
                                        r, rs)
    wide = torch.rand(rows, dim + pad, device=a.device).to(a.dtype)
    for args in ((a[:1], p, n), (a, wide[:, :dim], n)):
        ref = fp64_losses(*args, 1.0, pnorm, 1e-6, True)
        assert_as_accurate_as_torch(fused(*args, p=pnorm, swap=True, reduction="none"),
                                    F.triplet_margin_loss(*args, p=pnorm, swap=True,
                                                          reduction="none"), ref,
                                    distance_scale(*args, pnorm, 1e-6, True))


# Few long rows, which the plan cuts into column slices combined by the finishing kernel:
# aligned rows, odd rows (scalar path), one row, a last slice shorter than a ring chunk.
SPLIT_SHAPES = [(4, 65536), (300, 9000), (3, 100003), (1, 1 << 20), (2, 20008)]


@pytest.mark.parametrize("shape", SPLIT_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pnorm", [2.0, 1.0, math.inf, 3.0])
def test_split_rows(shape, dtype, pnorm):
    a, p, n = rand_triplet(shape, dtype=dtype, device=DEV, seed=31)
    check_reductions_and_fallbacks(a, p, n, pnorm, pad=4)  # the fallbacks are split too


# Many short rows, >= 128 MiB per input, every dtype; with broadcast and row-stride inputs.
MANY_ROWS_SHAPES = [((131077, 256), torch.float32), ((32771, 1024), torch.float32),
               ((131075, 512), torch.float16), ((131073, 512), torch.bfloat16),
               ((32769, 2048), torch.bfloat16), ((131073, 128), torch.float64)]


@pytest.mark.parametrize("shape,dtype", MANY_ROWS_SHAPES)
@pytest.mark.parametrize("pnorm", [2.0, 1.0, math.inf, 3.0])
def test_many_short_rows(shape, dtype, pnorm):
    a, p, n = rand_triplet(shape, dtype=dtype, device=DEV, seed=41)
    check_reductions_and_fallbacks(a, p, n, pnorm, pad=8)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("shape", [(1000, 64), (4, 5000), (3000, 700)])
def test_reductions(reduction, shape):
    a, p, n = rand_triplet(shape, device=DEV, seed=11)
    ours = fused(a, p, n, margin=2.0, reduction=reduction)
    ref = fp64_losses(a, p, n, margin=2.0)
    ref = {"none": ref, "mean": ref.mean(), "sum": ref.sum()}[reduction]
    assert ours.shape == ref.shape and ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(500, 128), (64, 1000), (16, 8192)])
def test_half_precision_no_worse_than_torch(dtype, shape):
    for seed in range(3):
        a, p, n = rand_triplet(shape, dtype=dtype, device=DEV, seed=seed)
        ref = fp64_losses(a, p, n)
        ours = fused(a, p, n, reduction="none")
        theirs = F.triplet_margin_loss(a, p, n, reduction="none")
        assert ours.dtype == dtype
        err_ours = (ours.double() - ref).abs()
        err_theirs = (theirs.double() - ref).abs()
        assert err_ours.max() <= err_theirs.max()
        assert err_ours.mean() <= err_theirs.mean()
        for red in ("mean", "sum"):
            r = ref.mean() if red == "mean" else ref.sum()
            assert (fused(a, p, n, reduction=red).double() - r).abs() <= \
                (F.triplet_margin_loss(a, p, n, reduction=red).double() - r).abs()


def test_fp64():
    a, p, n = rand_triplet((300, 999), dtype=torch.float64, device=DEV, seed=5)
    for swap in (False, True):
        ours = fused(a, p, n, swap=swap, reduction="none")
        assert ours.dtype == torch.float64
        torch.testing.assert_close(ours, fp64_losses(a, p, n, swap=swap), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtypes", [(torch.float16, torch.float32, torch.float32),
                                    (torch.bfloat16, torch.float16, torch.float16),
                                    (torch.float32, torch.float64, torch.float32)])
def test_mixed_dtypes_promote(dtypes):
    a, p, n = rand_triplet((40, 77), device=DEV, seed=6)
    a, p, n = a.to(dtypes[0]), p.to(dtypes[1]), n.to(dtypes[2])
    ours = fused(a, p, n, reduction="none")
    theirs = F.triplet_margin_loss(a, p, n, reduction="none")
    assert ours.dtype == theirs.dtype
    torch.testing.assert_close(ours, theirs, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(ours.double(), fp64_losses(a, p, n), rtol=2e-3, atol=2e-3)


# ---- layouts -------------------------------------------------------------------------------------

def _check_layout(a, p, n, **kw):
    ours = fused(a, p, n, reduction="none", **kw)
    torch.testing.assert_close(ours, F.triplet_margin_loss(a, p, n, reduction="none", **kw),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.double(), fp64_losses(a, p, n, **kw), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim", [64, 1001, 4096])
def test_row_stride_views_without_copy(dim):
    wide = [x for x in rand_triplet((50, dim + 12), device=DEV, seed=7)]
    _check_layout(*(x[:, :dim] for x in wide))            # row stride dim + 12: 16 B aligned
    wide = [x for x in rand_triplet((50, dim + 3), device=DEV, seed=8)]
    _check_layout(*(x[:, :dim] for x in wide))            # row stride dim + 3: scalar path


@pytest.mark.parametrize("offset", [1, 2, 3])
def test_misaligned_storage_offsets(offset):
    a, p, n = (x.flatten()[offset:offset + 40 * 515].view(40, 515)
               for x in rand_triplet((41, 515), device=DEV, seed=9))
    _check_layout(a, p, n, swap=True)


def test_mixed_alignment():
    a, p, n = rand_triplet((31, 520), device=DEV, seed=12)
    a, n = a[:30], n[:30]
    p = p.flatten()[1:30 * 520 + 1].view(30, 520)  # only one input misaligned
    _check_layout(a, p, n)


def test_non_contiguous_layouts():
    a, p, n = rand_triplet((64, 48), device=DEV, seed=13)
    _check_layout(a.t().contiguous().t(), p, n)            # column-major
    _check_layout(a[:, ::2], p[:, ::2], n[:, ::2])          # element stride 2
    a3, p3, n3 = rand_triplet((6, 5, 33), device=DEV, seed=14)
    _check_layout(a3.transpose(0, 1), p3.transpose(0, 1), n3.transpose(0, 1))
    _check_layout(a3, p3, n3)


@pytest.mark.parametrize("shapes", [((1, 300), (64, 300), (64, 300)),
                                    ((64, 300), (1, 300), (1, 300)),
                                    ((64, 1), (64, 300), (1, 300)),
                                    ((3, 1, 40), (1, 4, 40), (3, 4, 40))])
def test_broadcasting(shapes):
    g = torch.Generator(device=DEV).manual_seed(0)
    a, p, n = (torch.rand(s, generator=g, device=DEV) for s in shapes)
    _check_layout(a, p, n)
    _check_layout(a, p, n, swap=True)


@pytest.mark.parametrize("shape", [(5,), (1,), (1, 7), (0, 5), (5, 0), (2, 3, 0), (0,), ()])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_edge_shapes(shape, reduction):
    a, p, n = rand_triplet(shape, device=DEV, seed=15)
    ours = fused(a, p, n, reduction=reduction)
    theirs = F.triplet_margin_loss(a, p, n, reduction=reduction)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_nonfinite_inputs_propagate_like_torch():
    a, p, n = rand_triplet((8, 300), device=DEV, seed=16)
    a[0, 5] = float("nan")
    p[1, 7] = float("inf")
    n[2, 9] = -float("inf")
    a[3, 3] = n[3, 3] = float("inf")
    for pnorm in (2.0, 1.0, math.inf, 3.0):
        for swap in (False, True):
            ours = fused(a, p, n, p=pnorm, swap=swap, reduction="none")
            theirs = F.triplet_margin_loss(a, p, n, p=pnorm, swap=swap, reduction="none")
            torch.testing.assert_close(ours, theirs, equal_nan=True)


# ---- KernelBench problem ------------------------------------------------------------------------

def test_kernelbench_problem_99():
    """Level 1 problem 99 inputs: mean within 1e-4 of torch for 5 seeds; per-sample losses within
    1e-5 of a float64 reference (chunked) for the first seed."""
    batch, dim = 32768, 8192
    for seed in range(5):
        torch.manual_seed(seed)
        a = torch.rand(batch, dim, device=DEV) * torch.rand((), device=DEV)
        p = torch.rand(batch, dim, device=DEV)
        n = torch.rand(batch, dim, device=DEV)
        poison_allocator()
        ours = ft.ModelNew(1.0)(a, p, n)
        theirs = torch.nn.TripletMarginLoss(margin=1.0)(a, p, n)
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
        if seed == 0:
            per_sample = fused(a, p, n, reduction="none")
            for lo in range(0, batch, 4096):
                sl = slice(lo, lo + 4096)
                torch.testing.assert_close(per_sample[sl].double(),
                                           fp64_losses(a[sl], p[sl], n[sl]), rtol=1e-5, atol=1e-5)
        del a, p, n


def test_grid_stride_loop_many_rows():
    """More row groups than the grid cap (2^20 blocks of 32 rows): the grid-stride loop runs."""
    rows = (1 << 25) + 77
    a, p, n = rand_triplet((rows, 2), device=DEV, seed=17)
    ours = fused(a, p, n, reduction="none")
    torch.testing.assert_close(ours, F.triplet_margin_loss(a, p, n, reduction="none"),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused(a, p, n).double(), fp64_losses(a, p, n).mean(),
                               rtol=1e-6, atol=1e-6)


# ---- behaviour ----------------------------------------------------------------------------------

def test_deterministic_bits():
    a, p, n = rand_triplet((2000, 1500), device=DEV, seed=18)
    for reduction in ("none", "mean", "sum"):
        first = fused(a, p, n, reduction=reduction)
        for _ in range(20):
            assert torch.equal(fused(a, p, n, reduction=reduction), first)


def test_runs_on_current_stream():
    a, p, n = rand_triplet((512, 2048), device=DEV, seed=19)
    expected = fused(a, p, n, reduction="none")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = ft.triplet_margin_loss(a, p, n, reduction="none")
    side.synchronize()
    assert torch.equal(out, expected)


def test_errors_match_torch_on_cuda():
    a, p, n = rand_triplet((4, 5), device=DEV, seed=20)
    cases = [(a, p.cpu(), n), (a, p, n[0]), (a, p, torch.rand(4, 6, device=DEV)),
             (a.bool(), p.bool(), n.bool())]
    for args in cases:
        same_error(lambda: ft.triplet_margin_loss(*args), lambda: F.triplet_margin_loss(*args))
    for kw in (dict(margin=0.0), dict(reduction="bad")):
        same_error(lambda: ft.triplet_margin_loss(a, p, n, **kw),
                   lambda: F.triplet_margin_loss(a, p, n, **kw))
    same_error(lambda: ft.triplet_margin_loss(a[:, :0], p[:, :0], n[:, :0], p=math.inf),
               lambda: F.triplet_margin_loss(a[:, :0], p[:, :0], n[:, :0], p=math.inf))


def all_dtypes():
    return sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


def test_raw_ops_take_exactly_the_kernels_dtypes():
    """Every torch dtype through the registered ops: the four the kernels have run, any other
    (float8 types count as floating in c10) raises before a launch."""
    kernel_dtypes = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
    ops = ft._ops()
    tried = 0
    for dtype in all_dtypes():
        try:
            xs = [torch.empty((4, 64), dtype=dtype, device=DEV) for _ in range(3)]
        except (RuntimeError, TypeError):
            continue  # no tensor of this dtype can be made here: nothing to pass
        tried += 1
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        dists = torch.rand(2, 4, device=DEV, dtype=acc)
        grad = torch.ones((), dtype=dtype, device=DEV) if dtype in kernel_dtypes else \
            torch.empty((), dtype=dtype, device=DEV)
        calls = [lambda: ops.triplet_margin_loss(*xs, 1.0, 2.0, 1e-6, False, 1),
                 lambda: ops.triplet_margin_loss_backward(grad, *xs, dists, 1.0, 2.0, 1e-6,
                                                          False, 1, True, [True, True, True]),
                 lambda: ft._internal_ops().describe_plans(*xs, 2.0, False)]
        for call in calls:
            if dtype in kernel_dtypes:
                xs[:] = [torch.rand((4, 64), device=DEV).to(dtype) for _ in range(3)]
                call()
            else:  # quantized dtypes stop at the dispatcher: no kernel of ours is registered
                with pytest.raises(RuntimeError, match="expected float16, bfloat16, float32 or "
                                   "float64 inputs|Could not run 'fused_triplet(_internal)?::"):
                    call()
        torch.cuda.synchronize()  # nothing launched read past a buffer
    assert tried > 10


def test_raw_ops_raise_on_sizes_they_do_not_take():
    """Shapes, dists and upstream gradients of the wrong size raise a RuntimeError (with the sizes
    in the message) before a launch, never take the process down."""
    ops = ft._ops()
    a, p, n = (torch.rand(8, 4, device=DEV) for _ in range(3))
    dists = torch.rand(2, 8, device=DEV)
    calls = {
        "one shape": lambda: ops.triplet_margin_loss(a, p[:-1], n, 1.0, 2.0, 1e-6, False, 1),
        "unknown reduction": lambda: ops.triplet_margin_loss(a, p, n, 1.0, 2.0, 1e-6, False, 7),
        "dists": lambda: ops.triplet_margin_loss_backward(
            torch.ones((), device=DEV), a, p, n, dists[:, :-1], 1.0, 2.0, 1e-6, False, 1, True,
            [True, True, True]),
        "upstream gradient": lambda: ops.triplet_margin_loss_backward(
            torch.ones(3, device=DEV), a, p, n, dists, 1.0, 2.0, 1e-6, False, 0, True,
            [True, True, True]),
    }
    for words, call in calls.items():
        with pytest.raises(RuntimeError, match=words):
            call()


def test_requires_grad_gradients_match_torch():
    a, p, n = (x.requires_grad_() for x in rand_triplet((16, 300), device=DEV, seed=21))
    ours = torch.autograd.grad(ft.triplet_margin_loss(a, p, n, swap=True), (a, p, n))
    theirs = torch.autograd.grad(F.triplet_margin_loss(a, p, n, swap=True), (a, p, n))
    for x, y in zip(ours, theirs):
        torch.testing.assert_close(x, y)


def test_integer_inputs_like_torch():
    a, p, n = (torch.randint(-50, 50, (6, 9), device=DEV) for _ in range(3))
    torch.testing.assert_close(ft.triplet_margin_loss(a, p, n), F.triplet_margin_loss(a, p, n))


def test_opcheck():
    op = ft._ops().triplet_margin_loss
    for shape, dtype, swap, reduction in [((8, 33), torch.float32, False, 0),
                                          ((3, 4, 130), torch.float16, True, 1),
                                          ((5, 9), torch.float64, True, 2)]:
        a, p, n = rand_triplet(shape, dtype=dtype, device=DEV, seed=22)
        torch.library.opcheck(op, (a, p, n, 1.0, 2.0, 1e-6, swap, reduction))


def test_torch_compile_fullgraph():
    a, p, n = rand_triplet((128, 512), device=DEV, seed=23)
    compiled = torch.compile(lambda x, y, z: ft.triplet_margin_loss(x, y, z, swap=True),
                             fullgraph=True)
    torch.testing.assert_close(compiled(a, p, n), ft.triplet_margin_loss(a, p, n, swap=True))


def run_in_fresh_process(code):
    """Runs `code` in a new Python process (from the project root, this environment): for
    what only a first call can show (the library loads on first CUDA use)."""
    import os
    import subprocess
    import sys
    from conftest import ROOT
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_first_call_inside_torch_compile_fullgraph():
    """A fresh process whose first fused call is being traced by torch.compile(fullgraph=True)."""
    code = ("import torch, fused_triplet as ft\n"
            "x = [torch.rand(64, 256, device='cuda') for _ in range(3)]\n"
            "f = torch.compile(lambda *t: ft.triplet_margin_loss(*t), fullgraph=True)\n"
            "assert torch.allclose(f(*x), torch.nn.TripletMarginLoss()(*x), rtol=1e-5, atol=1e-5)\n")
    run_in_fresh_process(code)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_first_call_under_no_grad_or_inference_mode(mode):
    """A fresh process whose first fused call (which loads the library and probes torch's
    clamp_min gradient) comes with autograd off, as in an evaluation loop; then a backward."""
    code = ("import torch, fused_triplet as ft\n"
            "x = [torch.rand(64, 256, device='cuda') for _ in range(3)]\n"
            f"with torch.{mode}():\n"
            "    got = ft.triplet_margin_loss(*x)\n"
            "want = torch.nn.TripletMarginLoss()(*x)\n"
            "assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got, want)\n"
            "x[0].requires_grad_()\n"
            "ft.triplet_margin_loss(*x).backward()\n"
            "assert x[0].grad.isfinite().all()\n")
    run_in_fresh_process(code)


def test_module_and_model_new_on_cuda():
    a, p, n = rand_triplet((256, 1024), device=DEV, seed=24)
    for kw in (dict(), dict(margin=0.2, p=1, swap=True, reduction="sum")):
        torch.testing.assert_close(ft.TripletMarginLoss(**kw)(a, p, n),
                                   torch.nn.TripletMarginLoss(**kw)(a, p, n), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ft.ModelNew(1.0)(a, p, n), torch.nn.TripletMarginLoss()(a, p, n))


# Distances in the thousands minus each other leave a small loss: fp32 inputs are summed in
# double and the loss taken from double distances, so ours is within rounding of the loss of
# the fp32 differences x - y + eps (torch's elements) and at least as close to float64 as torch.
ACCURACY_CASES = [  # (make inputs, options)
    (lambda g: [torch.rand(8192, 3, generator=g, device=DEV).t() for _ in range(3)],
     dict(p=1.0, reduction="mean")),
    (lambda g: [torch.rand(4097, generator=g, device=DEV) for _ in range(3)],
     dict(p=0.5, eps=0.0, reduction="mean")),
    (lambda g: [torch.rand(16, 100000, generator=g, device=DEV) for _ in range(3)],
     dict(p=2.0, reduction="none")),
    (lambda g: [torch.rand(2, 3000000, generator=g, device=DEV) for _ in range(3)],
     dict(p=1.0, reduction="sum", swap=True)),
]


def loss_of_fp32_differences(a, p, n, margin=1.0, p_norm=2.0, eps=1e-6, swap=False,
                             reduction="mean"):
    def dist(x, y):
        return torch.linalg.vector_norm((x - y + eps).double(), p_norm, dim=-1)
    d_neg = dist(a, n)
    if swap:
        d_neg = torch.minimum(d_neg, dist(p, n))
    loss = (margin + dist(a, p) - d_neg).clamp_min(0)
    return {"none": loss, "mean": loss.mean(), "sum": loss.sum()}[reduction]


@pytest.mark.parametrize("case", range(len(ACCURACY_CASES)))
def test_fp32_at_least_as_accurate_as_torch(case):
    make, kw = ACCURACY_CASES[case]
    worst_ours = worst_torch = 0.0
    for seed in range(5):
        a, p, n = make(torch.Generator(device=DEV).manual_seed(seed))
        ours = fused(a, p, n, **kw).double()
        theirs = F.triplet_margin_loss(a, p, n, **kw).double()
        ref = F.triplet_margin_loss(a.double(), p.double(), n.double(), **kw)
        opts = dict(p_norm=kw.get("p", 2.0), eps=kw.get("eps", 1e-6), swap=kw.get("swap", False),
                    reduction=kw["reduction"])
        best = loss_of_fp32_differences(a, p, n, **opts)
        scale = 1 + ref.abs()
        assert ((ours - best).abs() / scale).max().item() <= 2 ** -22, seed  # a rounding or two
        worst_ours = max(worst_ours, ((ours - ref).abs() / scale).max().item())
        worst_torch = max(worst_torch, ((theirs - ref).abs() / scale).max().item())
    assert worst_ours <= worst_torch, (worst_ours, worst_torch)
