"""Semantics, argument handling and errors against torch; runs everywhere (CPU tensors)."""

import math
import os
import re
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import fused_triplet as ft
from conftest import ROOT, rand_triplet, same_error

P_VALUES = [2.0, 1.0, math.inf, -math.inf, 0.0, 3.0, 0.5, -1.5]


def check(ours, theirs, exact=False):
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    if exact:
        assert torch.equal(ours, theirs) or torch.allclose(ours, theirs, rtol=0, atol=0, equal_nan=True)
    else:
        torch.testing.assert_close(ours, theirs, equal_nan=True)


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_cpu_matches_torch(p, swap, reduction):
    for seed in range(3):
        a, pos, neg = rand_triplet((17, 33), seed=seed)
        kw = dict(margin=0.7, p=p, eps=1e-6, swap=swap, reduction=reduction)
        check(ft.triplet_margin_loss(a, pos, neg, **kw), F.triplet_margin_loss(a, pos, neg, **kw),
              exact=True)


@pytest.mark.parametrize("eps", [0.0, 1e-6, 0.25])
@pytest.mark.parametrize("margin", [1e-3, 1.0, 50.0, math.inf])
def test_cpu_margin_eps(eps, margin):
    a, p, n = rand_triplet((9, 7), seed=3)
    kw = dict(margin=margin, eps=eps, reduction="none")
    check(ft.triplet_margin_loss(a, p, n, **kw), F.triplet_margin_loss(a, p, n, **kw), exact=True)


@pytest.mark.parametrize("shape", [(5,), (), (2, 3, 4), (0, 4), (4, 0), (0,), (1, 1)])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_cpu_shapes(shape, reduction):
    a, p, n = rand_triplet(shape, seed=1)
    check(ft.triplet_margin_loss(a, p, n, reduction=reduction),
          F.triplet_margin_loss(a, p, n, reduction=reduction), exact=True)


@pytest.mark.parametrize("shapes", [
    ((4, 5), (1, 5), (4, 5)),
    ((1, 5), (4, 5), (4, 5)),
    ((4, 1), (4, 5), (4, 5)),
    ((4, 1), (4, 5), (4, 3)),   # torch accepts: the two distances run over different D
    ((1, 5), (4, 5), (1, 5)),
    ((3, 1, 6), (1, 2, 6), (3, 2, 6)),
])
def test_cpu_broadcasting(shapes):
    g = torch.Generator().manual_seed(0)
    a, p, n = (torch.rand(s, generator=g) for s in shapes)
    check(ft.triplet_margin_loss(a, p, n, reduction="none"),
          F.triplet_margin_loss(a, p, n, reduction="none"), exact=True)


@pytest.mark.parametrize("dtypes", [
    (torch.float64,) * 3, (torch.float16,) * 3, (torch.bfloat16,) * 3,
    (torch.float16, torch.float32, torch.float32), (torch.bfloat16, torch.float16, torch.float64),
    (torch.int64,) * 3, (torch.int32, torch.float16, torch.int64), (torch.complex64,) * 3,
])
def test_cpu_dtypes(dtypes):
    g = torch.Generator().manual_seed(0)
    xs = [(torch.rand(6, 10, generator=g) * 10).to(dt) for dt in dtypes]
    check(ft.triplet_margin_loss(*xs, reduction="none"), F.triplet_margin_loss(*xs, reduction="none"),
          exact=True)


def test_cpu_nonfinite():
    a, p, n = rand_triplet((6, 5), seed=2)
    a[0, 0] = float("nan")
    p[1, 2] = float("inf")
    n[2, 1] = -float("inf")
    a[3, 3] = float("inf")
    n[3, 3] = float("inf")
    for swap in (False, True):
        check(ft.triplet_margin_loss(a, p, n, swap=swap, reduction="none"),
              F.triplet_margin_loss(a, p, n, swap=swap, reduction="none"), exact=True)


def test_cpu_gradients_match_torch():
    a, p, n = (x.double().requires_grad_() for x in rand_triplet((8, 6), seed=4))
    for swap in (False, True):
        ours = torch.autograd.grad(ft.triplet_margin_loss(a, p, n, swap=swap), (a, p, n))
        theirs = torch.autograd.grad(F.triplet_margin_loss(a, p, n, swap=swap), (a, p, n))
        for x, y in zip(ours, theirs):
            torch.testing.assert_close(x, y)
    assert torch.autograd.gradcheck(lambda *xs: ft.triplet_margin_loss(*xs, swap=True), (a, p, n))


# ---- arguments ---------------------------------------------------------------------------------

@pytest.mark.parametrize("size_average", [None, True, False])
@pytest.mark.parametrize("reduce", [None, True, False])
def test_legacy_reduction_args(size_average, reduce):
    a, p, n = rand_triplet((5, 4), seed=5)
    with warnings.catch_warnings(record=True) as ours_w:
        warnings.simplefilter("always")
        ours = ft.triplet_margin_loss(a, p, n, size_average=size_average, reduce=reduce)
    with warnings.catch_warnings(record=True) as theirs_w:
        warnings.simplefilter("always")
        theirs = F.triplet_margin_loss(a, p, n, size_average=size_average, reduce=reduce)
    check(ours, theirs, exact=True)
    assert [str(w.message) for w in ours_w] == [str(w.message) for w in theirs_w]


def test_elementwise_mean_alias():
    a, p, n = rand_triplet((5, 4), seed=6)
    with pytest.warns(UserWarning, match="elementwise_mean"):
        ours = ft.triplet_margin_loss(a, p, n, reduction="elementwise_mean")
    check(ours, F.triplet_margin_loss(a, p, n, reduction="mean"), exact=True)


def test_errors_match_torch():
    a, p, n = rand_triplet((4, 5), seed=7)
    for kw in (dict(margin=0.0), dict(margin=-1.0), dict(reduction="avg"),
               dict(reduction="avg", margin=-1.0)):
        same_error(lambda: ft.triplet_margin_loss(a, p, n, **kw),
                   lambda: F.triplet_margin_loss(a, p, n, **kw))
    cases = [
        (a, p, n[0]),                                   # ndim mismatch
        (a, p, torch.rand(4, 6)),                       # shape mismatch
        (a, torch.rand(3, 5), n),
        (a.bool(), p.bool(), n.bool()),                 # bool subtraction
    ]
    for args in cases:
        same_error(lambda: ft.triplet_margin_loss(*args), lambda: F.triplet_margin_loss(*args))
        same_error(lambda: ft.triplet_margin_loss(*args, swap=True),
                   lambda: F.triplet_margin_loss(*args, swap=True))
    same_error(lambda: ft.triplet_margin_loss(torch.rand(3, 0), torch.rand(3, 0), torch.rand(3, 0),
                                              p=math.inf),
               lambda: F.triplet_margin_loss(torch.rand(3, 0), torch.rand(3, 0), torch.rand(3, 0),
                                             p=math.inf))


def test_non_tensor_argument_is_type_error():
    a, p, n = rand_triplet((4, 5), seed=7)
    with pytest.raises(TypeError, match="argument 'negative'"):
        ft.triplet_margin_loss(a, p, n.tolist())


@pytest.mark.parametrize("name", ["margin", "p", "eps", "swap"])
def test_option_types_as_torch(name):
    """Each option takes what torch's argument parser takes and rejects the rest with torch's
    TypeError (margin's `<= 0` check comes first, as in torch)."""
    import numpy as np
    a, p, n = rand_triplet((4, 5), seed=3)
    values = ["x", None, [1.0], 1j, True, 2, np.float32(1.5), np.float64(1.5), np.int64(2),
              np.bool_(True), torch.tensor(1.5), torch.tensor([1.5])]
    for value in values:
        kw = {name: value}
        try:
            expected = F.triplet_margin_loss(a, p, n, **kw)
        except Exception:
            same_error(lambda: ft.triplet_margin_loss(a, p, n, **kw),
                       lambda: F.triplet_margin_loss(a, p, n, **kw))
            same_error(lambda: ft.TripletMarginLoss(**kw)(a, p, n),
                       lambda: torch.nn.TripletMarginLoss(**kw)(a, p, n))
            continue
        check(ft.triplet_margin_loss(a, p, n, **kw), expected)


# ---- modules ------------------------------------------------------------------------------------

def test_module_matches_torch():
    a, p, n = rand_triplet((6, 9), seed=8)
    for kw in (dict(), dict(margin=0.3, p=1.0, eps=1e-3, swap=True, reduction="sum"),
               dict(reduction="none", p=3)):
        ours, theirs = ft.TripletMarginLoss(**kw), torch.nn.TripletMarginLoss(**kw)
        assert (ours.margin, ours.p, ours.eps, ours.swap, ours.reduction) == \
            (theirs.margin, theirs.p, theirs.eps, theirs.swap, theirs.reduction)
        check(ours(a, p, n), theirs(a, p, n), exact=True)
    with pytest.warns(UserWarning):
        assert ft.TripletMarginLoss(size_average=False).reduction == "sum"
    assert "margin=1.0" in repr(ft.TripletMarginLoss())


def test_module_rejects_bad_margin():
    for margin in (0.0, -2.0):
        with pytest.raises(ValueError, match="expected margin to be greater than 0"):
            ft.TripletMarginLoss(margin=margin)


def test_model_new_is_kernelbench_problem():
    a, p, n = rand_triplet((16, 32), seed=9)
    check(ft.ModelNew(1.0)(a, p, n), torch.nn.TripletMarginLoss(margin=1.0)(a, p, n), exact=True)
    check(ft.ModelNew(margin=0.5)(a, p, n), torch.nn.TripletMarginLoss(margin=0.5)(a, p, n),
          exact=True)


def test_sources_split_between_nvcc_and_the_host_compiler():
    """nvcc gets the kernels without torch's headers; the host compiler the torch-facing side."""
    cuda, cpp = ft.cuda_source(), ft.cpp_source()
    assert "__global__" in cuda and "#include <torch" not in cuda and "#include <ATen" not in cuda
    assert "TORCH_LIBRARY(fused_triplet" in cpp and "__global__" not in cpp
    assert '#include "' not in cuda + cpp
    kernels = sorted(re.findall(r"__global__ void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\(", cuda))
    assert kernels == ["all_gradient_kernel", "all_gradient_mma_kernel", "backward_check_kernel",
                       "backward_pointwise_kernel", "backward_rows_kernel", "batch_all_kernel",
                       "centred_rows_kernel", "column_means_kernel", "column_sums_kernel",
                       "distances_kernel",
                       "forward_finish_kernel", "forward_one_pass_kernel", "forward_ring_kernel",
                       "forward_rows_kernel", "gradient_parts_kernel", "gram_distances_kernel",
                       "gram_rows_kernel",
                       "hard_gradient_kernel", "hard_gradient_sorted_kernel",
                       "hard_loss_kernel", "hardest_kernel", "label_merge_kernel",
                       "label_order_kernel", "label_ranks_kernel", "label_tiles_kernel",
                       "mined_total_kernel",
                       "sparse_columns_gradient_kernel", "sparse_rows_gradient_kernel",
                       "thread_spreads_kernel", "unit_rows_backward_kernel",
                       "unit_rows_kernel"], kernels


def test_build_is_marked_constant_as_torch_compile_marks_it():
    """build() carries torch.compiler.assume_constant_result's mark (set without importing
    Dynamo, which costs seconds at import): the mark is still the one that API sets."""
    def probe():
        return 0
    marked = torch.compiler.assume_constant_result(probe)
    assert {k: v for k, v in vars(marked).items()} == {"_dynamo_marked_constant": True}
    assert ft.build._dynamo_marked_constant is True


def test_default_build_root_is_torchs():
    """The extension cache build() looks in without importing torch.utils.cpp_extension is the
    one that module builds in."""
    from torch.utils import cpp_extension
    assert ft._default_build_root() == cpp_extension.get_default_build_root()


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_hinge_probe_works_with_autograd_off(mode):
    """The library loads on first CUDA use, which may come under no_grad or inference_mode: the
    probe of torch's clamp_min gradient at 0 must still run autograd and agree."""
    expected = ft._hinge_passes_at_zero()
    with getattr(torch, mode)():
        assert ft._hinge_passes_at_zero() == expected


def test_kernel_variants_edit_lines_that_exist():
    """scripts/variants.py times kernel variants as text edits: each must find its line."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import variants
    for name, edits in variants.VARIANTS.items():
        for old, _ in edits:
            assert any(old in text for text in ft.KERNEL_SOURCES.values()), (name, old)
