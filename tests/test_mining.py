"""mined_triplet_margin_loss: the torch reference against brute force and pytorch-metric-learning
(everywhere), the kernels against the reference (on a GPU)."""
import itertools
import math

import pytest
import torch

import fused_triplet as ft
from conftest import assert_as_accurate_as_torch, requires_cuda

MININGS = ("batch_hard", "batch_all")
REDUCTIONS = ("none", "mean", "sum")


def labelled_batch(batch, dim, classes, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, dim, generator=g, dtype=torch.float64)
    labels = torch.randint(0, classes, (batch,), generator=g)
    return x.to(device=device, dtype=dtype), labels.to(device)


def brute_force(x, labels, mining, margin, p, eps, reduction):
    """The definitions, one anchor and triplet at a time, in float64."""
    x = x.double()
    d = lambda i, j: torch.linalg.vector_norm(x[i] - x[j] + eps, p)  # noqa: E731
    batch = x.shape[0]
    per_anchor, counted = [], 0
    for i in range(batch):
        pos = [j for j in range(batch) if j != i and labels[j] == labels[i]]
        neg = [k for k in range(batch) if labels[k] != labels[i]]
        if mining == "batch_hard":
            if pos and neg:
                hardest = max(d(i, j) for j in pos) - min(d(i, k) for k in neg)
                per_anchor.append(torch.relu(margin + hardest))
                counted += 1
            else:
                per_anchor.append(torch.zeros((), dtype=torch.float64))
        else:
            terms = [torch.relu(margin + d(i, j) - d(i, k)) for j in pos for k in neg]
            per_anchor.append(sum(terms, torch.zeros((), dtype=torch.float64)))
            counted += sum(int(t > 0) for t in terms)
    losses = torch.stack(per_anchor) if per_anchor else torch.zeros(0, dtype=torch.float64)
    if reduction == "none":
        return losses
    return losses.sum() if reduction == "sum" else losses.sum() / max(counted, 1)


# ---- the reference, everywhere ---------------------------------------------------------------

@pytest.mark.parametrize("mining,reduction,p", list(itertools.product(MININGS, REDUCTIONS, (1.0, 2.0))))
@pytest.mark.parametrize("batch,dim,classes", [(12, 5, 3), (9, 7, 2), (10, 3, 10), (6, 4, 1),
                                                (1, 3, 1), (15, 1, 4)])
def test_reference_matches_the_definitions(mining, reduction, p, batch, dim, classes):
    x, labels = labelled_batch(batch, dim, classes, seed=batch + dim)
    ours = ft.mined_triplet_margin_loss(x, labels, mining, margin=0.7, p=p, eps=1e-6,
                                        reduction=reduction)
    want = brute_force(x, labels, mining, 0.7, p, 1e-6, reduction)
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, want, rtol=1e-12, atol=1e-12)


def test_uneven_classes_and_lonely_anchors():
    # class 0 has one member (no positive), class 3 has most of the batch
    labels = torch.tensor([0, 3, 3, 3, 3, 3, 1, 1, 3, 2, 2, 3])
    x, _ = labelled_batch(12, 6, 4, seed=3)
    for mining in MININGS:
        per_anchor = ft.mined_triplet_margin_loss(x, labels, mining, reduction="none")
        torch.testing.assert_close(per_anchor, brute_force(x, labels, mining, 1.0, 2.0, 1e-6,
                                                           "none"))
        assert per_anchor[0] == 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_single_class_and_empty_batch_give_zero(dtype):
    x, _ = labelled_batch(8, 4, 1, dtype=dtype)
    for mining, reduction in itertools.product(MININGS, ("mean", "sum")):
        assert ft.mined_triplet_margin_loss(x, torch.zeros(8, dtype=torch.long), mining,
                                            reduction=reduction) == 0
        empty = ft.mined_triplet_margin_loss(x[:0], torch.zeros(0, dtype=torch.long), mining,
                                             reduction=reduction)
        assert empty == 0
    assert ft.mined_triplet_margin_loss(x[:0], torch.zeros(0, dtype=torch.long),
                                        reduction="none").shape == (0,)
    for mining in MININGS:  # backward runs on an empty batch: a gradient of shape (0, dim)
        leaf = x[:0].clone().requires_grad_(True)
        ft.mined_triplet_margin_loss(leaf, torch.zeros(0, dtype=torch.long), mining).backward()
        assert leaf.grad.shape == (0, 4)


def test_ties_choose_the_first_index():
    # rows 1 and 2 are one point: the hardest positive of anchor 0 is row 1, never row 2
    x = torch.tensor([[0.0, 0.0], [1.0, 0.0], [1.0, 0.0], [3.0, 0.0], [3.0, 0.0]],
                     dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 0, 0, 1, 1])
    loss = ft.mined_triplet_margin_loss(x, labels, "batch_hard", margin=5.0, reduction="sum")
    loss.backward()
    assert x.grad[2].abs().sum() < x.grad[1].abs().sum()
    positive, negative, valid = ft._reference_batch_hard(x.detach(), labels, 2.0, 1e-6)
    assert positive[0] == 1 and negative[0] == 3 and valid.all()


def test_batch_all_reference_with_duplicates_inf_and_nan():
    # sorted prefixes where every distance is finite, every triplet where one is not
    x, labels = labelled_batch(14, 3, 3, seed=6)
    x[1] = x[2]
    x[5] = x[9]
    x[4, 0] = float("inf")
    x[7, 1] = float("nan")
    for reduction in ("none", "sum"):
        got = ft.mined_triplet_margin_loss(x, labels, "batch_all", margin=0.5, eps=0.0,
                                           reduction=reduction)
        want = brute_force(x, labels, "batch_all", 0.5, 2.0, 0.0, reduction)
        torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-12, atol=1e-12)
    # the gradient too: relu's derivative lets NaN through, and the rows without one keep theirs
    for dtype in (torch.float64, torch.float32):
        grads = []
        for loss in (ft.mined_triplet_margin_loss, brute_force):
            leaf = x.to(dtype, copy=True).requires_grad_(True)  # a leaf of its own each time
            per_anchor = loss(leaf, labels, "batch_all", 0.5, 2.0, 1e-6, "none")
            (per_anchor * torch.arange(1.0, 15.0, dtype=dtype)).sum().backward()
            grads.append(leaf.grad)
        torch.testing.assert_close(*grads, equal_nan=True, rtol=1e-5, atol=1e-6)
    finite = ft.mined_triplet_margin_loss(x[8:], labels[8:], "batch_all", margin=0.5)
    torch.testing.assert_close(finite, brute_force(x[8:], labels[8:], "batch_all", 0.5, 2.0,
                                                   1e-6, "mean"), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["plain", "ties", "duplicates", "huge norms", "tiny",
                                  "subnormal", "one line", "wide"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("eps", [1e-6, 0.0, 1e39, math.inf])
def test_batch_hard_from_bounds_chooses_as_every_distance(kind, dtype, eps, monkeypatch):
    # On CPU batch_hard computes torch's distance only where float64 Gram bounds leave the
    # choice open: the same choice as from every (anchor, row) distance, ties to the first index
    # (the bounds at every size: small batches take every difference)
    monkeypatch.setattr(ft, "_CPU_HARD_DIFFERENCES_BELOW", {torch.float32: 0, torch.float64: 0})
    x, labels = labelled_batch(300 if kind == "wide" else 60, 700 if kind == "wide" else 5, 4,
                               seed=len(kind))
    g = torch.Generator().manual_seed(len(kind))
    grid = torch.randint(-2, 3, x.shape, generator=g, dtype=torch.float64)
    x = {"ties": grid, "duplicates": x[torch.randint(0, 8, (len(x),), generator=g)],
         "huge norms": x * 1e4 + 3e4, "tiny": x * 1e-7, "subnormal": grid * 1e-40,
         "one line": x[:, :1] * torch.ones(x.shape[1], dtype=torch.float64),
         "wide": grid}.get(kind, x).to(dtype)
    d = torch.pairwise_distance(x[:, None, :], x[None, :, :], 2.0, eps)
    is_positive, is_negative = ft._label_masks(labels, labels, 0)
    valid = is_positive.any(1) & is_negative.any(1)
    anchors = torch.arange(len(x))
    want = [torch.where(valid, ft._first_extreme(d, mask, largest), anchors)
            for mask, largest in ((is_positive, True), (is_negative, False))]
    got = ft._reference_batch_hard(x, labels, 2.0, eps)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[2], valid)


@pytest.mark.parametrize("mining", MININGS)
def test_reference_chunks_give_the_same_result(mining, monkeypatch):
    x, labels = labelled_batch(20, 6, 4, seed=5)
    whole = ft.mined_triplet_margin_loss(x, labels, mining, reduction="none")
    monkeypatch.setattr(ft, "_REFERENCE_CHUNK_ELEMENTS", 50)  # one or two anchors per chunk
    torch.testing.assert_close(ft.mined_triplet_margin_loss(x, labels, mining, reduction="none"),
                               whole, rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["8 a class", "uneven", "classes of one", "one class",
                                    "one large class"])
def test_batch_all_sums_over_the_positives_alone_equal_every_column(layout, monkeypatch):
    # From _CPU_POSITIVES_SEARCHED_FROM columns the sums search only each row's positive columns
    # (a topk of its mask, the rest of its k other columns): the same counts and weights as
    # every column's search, the losses to float32 rounding (fewer zeros in the sums)
    g = torch.Generator().manual_seed(len(layout))
    batch = 40
    labels = {"8 a class": torch.arange(batch) // 8,
              "uneven": torch.randint(0, 6, (batch,), generator=g) ** 2,
              "classes of one": torch.arange(batch),
              "one class": torch.zeros(batch, dtype=torch.long),
              "one large class": (torch.arange(batch) >= 8).long() * torch.arange(batch)}[layout]
    d = torch.rand(batch, batch, generator=g)
    d[3, 5] = d[3, 6] = d[3, 7]  # ties among a row's distances
    masks = ft._label_masks(labels, labels, 0)
    results = []
    for searched_from in (0, batch + 1):  # the positives' columns alone, every column
        monkeypatch.setattr(ft, "_CPU_POSITIVES_SEARCHED_FROM", searched_from)
        leaf = d.clone().requires_grad_(True)
        losses, active = ft._TripletSums.apply(leaf, *masks, 0.3)
        (losses * torch.arange(1.0, batch + 1)).sum().backward()
        results.append((losses.detach(), active, leaf.grad))
    (losses, active, grad), (all_losses, all_active, all_grad) = results
    assert torch.equal(active, all_active) and torch.equal(grad, all_grad)
    torch.testing.assert_close(losses, all_losses, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("mining,reduction", list(itertools.product(MININGS, REDUCTIONS)))
def test_gradcheck_float64(mining, reduction):
    x, labels = labelled_batch(10, 4, 3, seed=7)
    x.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda e: ft.mined_triplet_margin_loss(e, labels, mining, margin=0.5,
                                               reduction=reduction), (x,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reduced_precision_embeddings_give_a_float32_loss(dtype):
    x, labels = labelled_batch(12, 8, 3, dtype=dtype, seed=1)
    x.requires_grad_(True)
    for mining in MININGS:
        loss = ft.mined_triplet_margin_loss(x, labels, mining)
        assert loss.dtype == torch.float32
        want = brute_force(x.detach(), labels, mining, 1.0, 2.0, 1e-6, "mean")
        torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-5)
        (grad,) = torch.autograd.grad(loss, x)
        assert grad.dtype == dtype


def test_labels_of_any_integer_dtype():
    x, labels = labelled_batch(12, 5, 3, seed=2)
    want = ft.mined_triplet_margin_loss(x, labels)
    for dtype in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
        torch.testing.assert_close(ft.mined_triplet_margin_loss(x, labels.to(dtype)), want)


def test_module():
    x, labels = labelled_batch(12, 5, 3, seed=4)
    module = ft.MinedTripletMarginLoss("batch_all", margin=0.3, reduction="sum")
    assert repr(module) == ("MinedTripletMarginLoss(mining='batch_all', margin=0.3, p=2.0, "
                            "eps=1e-06, reduction='sum')")
    torch.testing.assert_close(module(x, labels), ft.mined_triplet_margin_loss(
        x, labels, "batch_all", margin=0.3, reduction="sum"))
    with pytest.raises(ValueError, match="mining must be"):
        ft.MinedTripletMarginLoss("semi_hard")


@pytest.mark.parametrize("call,error,match", [
    (lambda x, y: ft.mined_triplet_margin_loss(x, y[:-1]), ValueError, "labels of shape"),
    (lambda x, y: ft.mined_triplet_margin_loss(x, y.double()), TypeError, "integer labels"),
    (lambda x, y: ft.mined_triplet_margin_loss(x[0], y), ValueError, r"shape \(batch, dim\)"),
    (lambda x, y: ft.mined_triplet_margin_loss(x[None], y), ValueError, r"shape \(batch, dim\)"),
    (lambda x, y: ft.mined_triplet_margin_loss(x, y, "semi_hard"), ValueError, "mining must"),
    (lambda x, y: ft.mined_triplet_margin_loss(x, y, reduction="avg"), ValueError, "reduction"),
    (lambda x, y: ft.mined_triplet_margin_loss(x, y, margin=0.0), ValueError, "margin"),
    (lambda x, y: ft.mined_triplet_margin_loss(x, y, p="1"), TypeError,
     r"mined_triplet_margin_loss\(\): argument 'p' \(position 5\) must be float, not str"),
    (lambda x, y: ft.mined_triplet_margin_loss(x, y, eps=None), TypeError, "'eps'"),
    (lambda x, y: ft.mined_triplet_margin_loss(x.long(), y), TypeError, "floating-point"),
    (lambda x, y: ft.mined_triplet_margin_loss(x, y.to("meta")), RuntimeError, "one device"),
])
def test_bad_input_raises_before_any_work(call, error, match):
    x, labels = labelled_batch(8, 4, 2)
    with pytest.raises(error, match=match):
        call(x, labels)


# ---- pytorch-metric-learning, where its definitions meet ours ----------------------------------

def _pml():
    return pytest.importorskip(
        "pytorch_metric_learning",
        reason="pytorch-metric-learning is not installed (pip install -e .[test]): the oracle "
               "comparison is skipped")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batch_hard_matches_pytorch_metric_learning(seed):
    _pml()
    from pytorch_metric_learning import distances, losses, miners, reducers

    x, labels = labelled_batch(48, 16, 6, seed=seed)
    distance = distances.LpDistance(normalize_embeddings=False, p=2, power=1)
    miner = miners.BatchHardMiner(distance=distance)
    loss_fn = losses.TripletMarginLoss(margin=0.2, distance=distance,
                                       reducer=reducers.MeanReducer())
    want = loss_fn(x, labels, miner(x, labels))
    ours = ft.mined_triplet_margin_loss(x, labels, "batch_hard", margin=0.2, eps=0.0)
    torch.testing.assert_close(ours, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batch_all_matches_pytorch_metric_learning(seed):
    _pml()
    from pytorch_metric_learning import distances, losses, reducers

    x, labels = labelled_batch(32, 8, 4, seed=seed)
    loss_fn = losses.TripletMarginLoss(
        margin=0.5, distance=distances.LpDistance(normalize_embeddings=False, p=2, power=1),
        reducer=reducers.AvgNonZeroReducer())
    want = loss_fn(x, labels)
    ours = ft.mined_triplet_margin_loss(x, labels, "batch_all", margin=0.5, eps=0.0)
    torch.testing.assert_close(ours, want, rtol=1e-9, atol=1e-9)


# ---- the kernels, on a GPU ---------------------------------------------------------------------

def every_triplet(x, labels, margin, eps=1e-6):
    """batch_all as users write it, every (i, j, k) of a B x B x B tensor: (per-anchor losses,
    the count of those > 0)."""
    d = torch.pairwise_distance(x[:, None, :], x[None, :, :], 2.0, eps)
    same = labels[:, None] == labels[None, :]
    positive = same & ~torch.eye(len(labels), dtype=torch.bool, device=x.device)
    triplets = positive[:, :, None] & ~same[:, None, :]
    losses = torch.where(triplets, (margin + d[:, :, None] - d[:, None, :]).relu(), 0.0)
    return losses.sum((1, 2)), (losses > 0).sum()


def reference_loss(x, labels, mining, margin, reduction):
    """torch on x's values as a leaf of x's dtype, (float32 for 2-byte x): the loss and the leaf.
    batch_hard: the library's reference; batch_all: every triplet one by one (the library's
    reference adds sorted prefixes, whose float32 rounding is a looser yardstick)."""
    leaf = x.detach().clone().requires_grad_(True)
    if mining == "batch_all":
        losses, counted = every_triplet(leaf, labels, margin)
    else:
        losses, counted = ft._mined_losses(leaf, labels, mining, margin, 2.0, 1e-6)
    if reduction == "none":
        return losses, leaf
    return (losses.sum() if reduction == "sum" else losses.sum() / counted.clamp_min(1)), leaf


def losses_and_grad(losses_of, e, weights):
    """losses_of(e) per anchor, and e's gradient of their sum weighted by weights."""
    leaf = e.clone().requires_grad_(True)
    losses = losses_of(leaf)
    (losses * weights.to(losses.dtype)).sum().backward()
    return losses.detach(), leaf.grad


def rows_of_kind(kind, batch, dim, seed):
    """A float64 batch of 6 classes laid out as `kind` says, and its labels."""
    x, labels = labelled_batch(batch, dim, 6, seed=seed)
    if kind == "near float's range":
        x = x * 1e17
    elif kind == "duplicates":
        x[1::7] = x[0]
    elif kind == "far from the origin":
        x = x + 300
    elif kind == "close and far from it":
        x = x * 1e-2 + 1e4
    elif kind == "tight classes":
        x = labelled_batch(6, dim, 1, seed=seed + 1)[0][labels] * 3 + 0.01 * x
    elif kind == "one point":
        x = torch.zeros_like(x)
    return x, labels


BATCH_ALL_KINDS = ["plain", "duplicates", "far from the origin", "tight classes", "one point",
                   "near float's range"]


@pytest.mark.parametrize("batch", [160, 96, 24])
@pytest.mark.parametrize("eps", [1e-6, 0.0])
@pytest.mark.parametrize("kind", BATCH_ALL_KINDS)
def test_batch_all_float32_on_cpu_as_accurate_as_every_difference(kind, eps, batch):
    # float32 rows on CPU: 96 and 160 rows' distances from float64 Gram products of centred rows
    # (160: batch_all's sums over the positives' columns alone), torch's own for close pairs
    # (duplicates, distances of 0); 24 rows' every difference in float64 (torch's own where
    # float32 sums of squares could overflow: near float's range); per-anchor losses and the
    # gradient of a weight per anchor
    x, labels = rows_of_kind(kind, batch, 48, seed=9)
    weights = torch.rand(batch, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ours = losses_and_grad(lambda e: ft.mined_triplet_margin_loss(
        e, labels, "batch_all", margin=0.5, eps=eps, reduction="none"), x.float(), weights)
    torch_float32, exact = (losses_and_grad(lambda e: every_triplet(e, labels, 0.5, eps)[0], e,
                                            weights) for e in (x.float(), x))
    for got, theirs, want in zip(ours, torch_float32, exact):
        assert_as_accurate_as_torch(got, theirs, want)


@pytest.mark.parametrize("batch,chunks", [(200, 1), (64, 1), (64, 4), (16, 1)])
@pytest.mark.parametrize("eps", [1e-6, 0.0])
@pytest.mark.parametrize("kind", BATCH_ALL_KINDS + ["close and far from it"])
def test_batch_all_float64_on_cpu_within_roundings_of_torch(kind, eps, batch, chunks,
                                                             monkeypatch):
    # float64 rows on CPU: 200 and 64 rows' every difference of the centred rows, the gradient
    # from their products, torch's own distance for pairs close against their norms
    # (duplicates), whole or in chunks of anchors; 16 rows' torch's own differences. Per-anchor
    # losses and the gradient of a weight per anchor within a few float64 roundings of torch's
    # every triplet
    if chunks > 1:  # a chunk's float64 (rows, batch) tensors: 4 x batch a row
        monkeypatch.setattr(ft, "_REFERENCE_CHUNK_ELEMENTS", 4 * batch * batch // chunks)
    x, labels = rows_of_kind(kind, batch, 48, seed=9)
    assert (ft._centred_rows(x, 2.0, eps, True) is not None) == (batch > 16)
    weights = torch.rand(batch, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ours = losses_and_grad(lambda e: ft.mined_triplet_margin_loss(
        e, labels, "batch_all", margin=0.5, eps=eps, reduction="none"), x, weights)
    want = losses_and_grad(lambda e: every_triplet(e, labels, 0.5, eps)[0], x, weights)
    for got, expected in zip(ours, want):
        assert (got - expected).abs().max() <= 1e-15 * batch * expected.abs().max()


@pytest.mark.parametrize("eps", [1e-6, 0.0])
@pytest.mark.parametrize("kind", ["plain", "duplicates", "tight classes", "one point", "nan row"])
def test_batch_hard_gradient_on_cpu_as_accurate_as_torch_on_gathered_rows(kind, eps):
    # CPU batch_hard's backward adds each anchor's terms to its chosen rows (index_add), not
    # through gathered rows: against torch's autograd on x[positive], x[negative] and float64
    x, labels = labelled_batch(64, 24, 6, seed=11)
    if kind == "duplicates":
        x[1::5] = x[0]
    elif kind == "tight classes":
        x = labelled_batch(6, 24, 1, seed=12)[0][labels] * 3 + 0.01 * x
    elif kind == "one point":
        x = torch.zeros_like(x)
    elif kind == "nan row":
        x[3, 2] = math.nan
    weights = torch.rand(64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    positive, negative, valid = ft._reference_batch_hard(x.float(), labels, 2.0, eps)

    def gathered(e):
        losses = torch.nn.functional.triplet_margin_loss(e, e[positive], e[negative], eps=eps,
                                                         reduction="none")
        return torch.where(valid, losses, 0.0)

    ours = losses_and_grad(lambda e: ft.mined_triplet_margin_loss(
        e, labels, "batch_hard", eps=eps, reduction="none"), x.float(), weights)
    torch_float32, exact = (losses_and_grad(gathered, e, weights) for e in (x.float(), x))
    for got, theirs, want in zip(ours, torch_float32, exact):
        assert_as_accurate_as_torch(got, theirs, want)


@requires_cuda
@pytest.mark.parametrize("mining,reduction", list(itertools.product(MININGS, REDUCTIONS)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch,dim,classes", [(64, 32, 8), (257, 33, 20), (300, 7, 2),
                                                (40, 128, 1), (1, 16, 1)])
def test_kernels_match_the_reference(mining, reduction, dtype, batch, dim, classes):
    # Against float64, at least as close as torch's reference in float32 (or a few ulps of the
    # result), for the loss and for the gradient of a different weight per anchor.
    x, labels = labelled_batch(batch, dim, classes, dtype=dtype, device="cuda", seed=batch)
    x.requires_grad_(True)
    loss = ft.mined_triplet_margin_loss(x, labels, mining, margin=0.5, reduction=reduction)
    torch_loss, torch_leaf = reference_loss(x.float() if dtype != torch.float32 else x, labels,
                                            mining, 0.5, reduction)
    exact, exact_leaf = reference_loss(x.double(), labels, mining, 0.5, reduction)
    assert loss.dtype == torch.float32
    assert_as_accurate_as_torch(loss, torch_loss, exact, scale=1 + exact.detach().abs().max())
    weights = torch.rand_like(exact.detach())
    (grad,) = torch.autograd.grad((loss * weights.float()).sum(), x)
    (torch_grad,) = torch.autograd.grad((torch_loss * weights.float()).sum(), torch_leaf)
    (exact_grad,) = torch.autograd.grad((exact * weights).sum(), exact_leaf)
    assert grad.dtype == dtype
    # 2-byte inputs: both round the float32 gradient once, to within one ulp of each other
    torch_grad = torch_grad.to(dtype)
    assert_as_accurate_as_torch(grad, torch_grad, exact_grad,
                                scale=1 + exact_grad.abs().max(),
                                floor=1e-6 if dtype == torch.float32 else 1e-2)


def fused_picks(x, labels, eps=1e-6):
    """(positive, negative, valid) per anchor as the mined op chose them (its state)."""
    _, _, state = ft._ops().mined_triplet_loss(x, labels, 0, 1.0, eps, 1)
    positive, negative = state[0].long(), state[1].long()
    return positive, negative, positive != torch.arange(len(labels), device=x.device)


def sorted_mining(count_labels):
    """The Gram products' mining alone, the labels ordered by counting (count_labels) or by
    sorted tiles, at any batch."""
    return lambda x, labels, eps: ft._internal_ops().mine_batch_hard(x, labels, eps, count_labels)


@requires_cuda
@pytest.mark.parametrize("batch", [512, 2048, 2046, 2100])  # 2048: 16-byte loads of the Gram rows
@pytest.mark.parametrize("offset,spread", [(0.0, 1.0), (1e3, 1e-2), (0.0, 1e-4)])
def test_batch_hard_mines_the_true_extremes(offset, spread, batch):
    # Far from the origin, close together, or both: the Gram products' candidates must still be
    # decided by the exact distance; so must the whole batch's exact distances (up to 1024 rows).
    g = torch.Generator().manual_seed(11)
    x = (offset + spread * torch.randn(batch, 64, generator=g, dtype=torch.float64)).float().double()
    labels = torch.randint(0, 16, (batch,), generator=g)
    want = ft._reference_batch_hard(x, labels, 2.0, 1e-6)
    for mine in (sorted_mining(True), sorted_mining(False), fused_picks):
        got = mine(x.float().cuda(), labels.cuda(), 1e-6)
        for ours, theirs in zip(got, want):
            assert torch.equal(ours.cpu(), theirs)


@requires_cuda
def test_batch_hard_mines_every_chunk():
    # At (9000, 16) the products' budget makes several chunks, one buffer reused: every anchor's
    # picks are the reference's, eagerly and replayed from a CUDA graph.
    x, labels = labelled_batch(9000, 16, 1000, dtype=torch.float32, device="cuda", seed=17)
    want = ft._reference_batch_hard(x.double(), labels, 2.0, 1e-6)
    mine = sorted_mining(False)
    for ours, theirs in zip(mine(x, labels, 1e-6), want):
        assert torch.equal(ours, theirs)
    rows = torch.zeros_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mine(rows, labels, 1e-6)  # warm: cuBLAS's workspace exists before the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = mine(rows, labels, 1e-6)
    rows.copy_(x)
    graph.replay()
    for ours, theirs in zip(got, want):
        assert torch.equal(ours, theirs)


@requires_cuda
@pytest.mark.parametrize("batch", [9001, 33000])
def test_batch_hard_walks_every_column_of_a_walking_thread(batch):
    # Rows close together far from the origin: many threads walk their columns again, each in
    # turn with the warp's lanes 32 of its groups at a time; past 32 x 256 columns (9001, one
    # column a group) and 32 x 1024 (33000, groups of 4) a walker takes several rounds.
    g = torch.Generator().manual_seed(batch)
    x = (1e3 + 1e-2 * torch.randn(batch, 8, generator=g, dtype=torch.float64)).float()
    labels = torch.randint(0, 1000, (batch,), generator=g)
    x, labels = x.cuda(), labels.cuda()
    want = ft._reference_batch_hard(x.double(), labels, 2.0, 1e-6)
    for ours, theirs in zip(sorted_mining(False)(x, labels, 1e-6), want):
        assert torch.equal(ours, theirs)


@requires_cuda
@pytest.mark.parametrize("batch", [2048, 2046])
def test_batch_hard_mines_rows_of_mixed_lengths(batch):
    # Rows 10^4 apart in length: each column's bounds widen with its length, so a thread's best
    # column and its widest spread (which bounds its other columns) belong to different rows.
    g = torch.Generator().manual_seed(batch + 1)
    scale = 10 ** (torch.rand(batch, 1, generator=g, dtype=torch.float64) * 4 - 2)
    x = (scale * torch.randn(batch, 64, generator=g, dtype=torch.float64)).float().double()
    labels = torch.randint(0, 16, (batch,), generator=g)
    want = ft._reference_batch_hard(x, labels, 2.0, 1e-6)
    for mine in (sorted_mining(True), sorted_mining(False)):
        got = mine(x.float().cuda(), labels.cuda(), 1e-6)
        for ours, theirs in zip(got, want):
            assert torch.equal(ours.cpu(), theirs)


@requires_cuda
@pytest.mark.parametrize("batch", [3, 1000, 3001, 9000])
def test_batch_hard_orders_labels_of_any_value(batch):
    # The Gram mining's label order, by counting and by sorted tiles of 2048: int64's extremes,
    # negative and huge labels, classes of one and across tiles, a batch not a multiple of a tile.
    g = torch.Generator().manual_seed(batch)
    values = torch.tensor([-2**63, -2**40, -1, 0, 7, 2**33, 2**62, 2**63 - 1])
    labels = values[torch.randint(0, len(values), (batch,), generator=g)]
    labels[: batch // 3] = torch.randint(-2**62, 2**62, (batch // 3,), generator=g)
    x = torch.randn(batch, 24, generator=g, dtype=torch.float64).float().double()
    want = ft._reference_batch_hard(x, labels, 2.0, 1e-6)
    for count_labels in (True, False):
        got = sorted_mining(count_labels)(x.float().cuda(), labels.cuda(), 1e-6)
        for ours, theirs in zip(got, want):
            assert torch.equal(ours.cpu(), theirs)


@requires_cuda
@pytest.mark.parametrize("batch", [64, 2048])
def test_batch_hard_with_nan_and_inf_rows(batch):
    # torch's max and min propagate NaN: a NaN distance is the hardest positive and negative.
    # The reference in float32, as torch's pairwise_distance gives it for float32 embeddings.
    x, labels = labelled_batch(batch, 16, 6, dtype=torch.float32, seed=batch)
    x[3, 2] = float("nan")
    x[10, 0], x[11, 0], x[12, 5] = float("inf"), float("-inf"), float("inf")
    x[20] = 1e30  # finite, but its squared distances overflow: ties of inf, the first index
    want = ft._reference_batch_hard(x, labels, 2.0, 1e-6)
    for mine in (sorted_mining(True), sorted_mining(False), fused_picks):
        got = mine(x.cuda(), labels.cuda(), 1e-6)
        for ours, theirs in zip(got, want):
            assert torch.equal(ours.cpu(), theirs)


@requires_cuda
@pytest.mark.parametrize("copies", [4, 12])  # 12: 192 rows, ties across the whole batch's tiles
def test_batch_hard_ties_and_duplicates(copies):
    x = torch.randn(16, 8, device="cuda").repeat(copies, 1)  # every row `copies` times
    labels = torch.arange(16, device="cuda").repeat(copies) % 5
    want = ft._reference_batch_hard(x.double(), labels, 2.0, 1e-6)
    for mine in (sorted_mining(True), sorted_mining(False), fused_picks):
        positive, negative, valid = mine(x, labels, 1e-6)
        assert torch.equal(positive, want[0]) and torch.equal(negative, want[1])
        assert torch.equal(valid, want[2])


@requires_cuda
@pytest.mark.parametrize("mining,batch,dtype", [
    ("batch_hard", 1000, torch.float32), ("batch_all", 1000, torch.float32),
    ("batch_hard", 9000, torch.bfloat16),  # chunks of bfloat16 Gram products, 2-byte rows as given
    ("batch_hard", 16400, torch.float16),  # the gradient from the choices sorted by row
    ("batch_all", 4500, torch.float32)])  # chunks, the double products
def test_kernels_are_deterministic(mining, batch, dtype):
    x, labels = labelled_batch(batch, 64, batch // 20, dtype=dtype, device="cuda", seed=9)
    results = []
    for _ in range(2):
        e = x.clone().requires_grad_(True)
        loss = ft.mined_triplet_margin_loss(e, labels, mining)
        loss.backward()
        results.append((loss, e.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def margin_clear_of_kinks(x, labels, anchors, mining, tolerance=2e-5):
    """The first margin from 0.5 up at which no triplet of these anchors (batch_hard: its
    hardest) has margin + d_ap - d_an within tolerance of 0 in float64: there float32 rounding
    decides whether the hinge is active, and the gradient jumps by a whole triplet's."""
    gaps = []
    for i in anchors:
        d = ft._distances_from(x, i, i + 1, 2.0, 1e-6)[0]
        positive, negative = (m[0] for m in ft._label_masks(labels[i:i + 1], labels, i))
        d_ap, d_an = d[positive], d[negative]
        if mining == "batch_hard":
            d_ap, d_an = d_ap.max().reshape(1), d_an.min().reshape(1)
        gaps.append((d_ap[:, None] - d_an[None, :]).flatten())
    gaps = torch.cat(gaps)
    for margin in torch.arange(0.5, 1.0, 0.01, dtype=torch.float64).tolist():
        if ((margin + gaps).abs() > tolerance).all():
            return margin
    raise AssertionError("no margin clear of the hinge's kinks")


def few_anchors_against_float64(x, labels, mining, margin, few, weights):
    """Ours and float64's for a few anchors: the per-anchor losses (float64's of those anchors
    alone for batch_all) and the gradient of their weighted sum (weights 0 past the few)."""
    e = x.clone().requires_grad_(True)
    losses = ft.mined_triplet_margin_loss(e, labels, mining, margin=margin, reduction="none")
    (grad,) = torch.autograd.grad((losses * weights).sum(), e)
    leaf = x.double().requires_grad_(True)
    if mining == "batch_hard":
        want = ft._mined_losses(leaf, labels, mining, margin, 2.0, 1e-6)[0]
    else:
        want = torch.zeros(len(x), dtype=torch.float64, device=x.device)
        for i in few:
            mine = ft._batch_all_rows(leaf, None, labels, i, i + 1, margin, 2.0, 1e-6)[0]
            want = want.index_put((torch.tensor([i], device=x.device),), mine)
    (want_grad,) = torch.autograd.grad((want * weights.double()).sum(), leaf)
    return losses, grad, want, want_grad


@requires_cuda
@pytest.mark.parametrize("mining,batch,hub", [
    ("batch_hard", 9000, False), ("batch_hard", 9000, True),  # the gradient by scans
    ("batch_hard", 16400, False), ("batch_hard", 16400, True),  # ... from the sorted choices
    ("batch_all", 4500, False), ("batch_all", 3000, False), ("batch_all", 1000, False)])
def test_large_batches_in_chunks(mining, batch, hub):
    # Past the whole batch's sizes: batch_hard's Gram mining in chunks, batch_all's distances and
    # gradient a chunk of anchors at a time; batch_all at 3000: the whole batch's distances from
    # the Gram products; at 1000 the whole batch's float gradient, its columns in 4 parts (16
    # tiles). The reference on a few anchors: their losses, and the gradient of a
    # weighted sum of them (the other anchors' weights 0), at a margin where no triplet of theirs
    # sits on the hinge's kink. hub: row 0 at the origin, every other class's hardest negative
    # (thousands of anchors' terms in one row of the gradient).
    x, labels = labelled_batch(batch, 16, batch // 9, dtype=torch.float32, device="cuda", seed=13)
    if hub:
        x[0] = 0.0
    few = [0, 1, 7, batch // 2, batch - 1]
    margin = margin_clear_of_kinks(x.double(), labels, few, mining)
    weights = torch.zeros(batch, device="cuda")
    g = torch.Generator().manual_seed(batch)
    weights[few] = (torch.rand(len(few), generator=g, dtype=torch.float64) + 0.5).float().cuda()
    losses, grad, want, want_grad = few_anchors_against_float64(x, labels, mining, margin, few,
                                                                weights)
    torch.testing.assert_close(losses[few].double(), want[few], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.double(), want_grad, rtol=1e-4, atol=1e-5)
    total, count, _ = ft._ops().mined_triplet_loss(x, labels, ft._MININGS.index(mining), margin,
                                                   1e-6, 2)
    torch.testing.assert_close(total, losses.sum(), rtol=1e-5, atol=1e-5)
    assert count.item() > 0


@requires_cuda
@pytest.mark.parametrize("mining", [1, 2])
def test_large_batches_keep_the_gradient_of_scalar_losses(mining):
    # Past the whole batch's sizes the forward of 'mean' and 'sum' keeps the gradient for an
    # upstream gradient of 1, which the backward scales; 'none' makes the weights again in the
    # backward. The same gradient both ways; the state has the fake kernel's shape and dtype.
    batch = 4500
    x, labels = labelled_batch(batch, 16, batch // 9, dtype=torch.float32, device="cuda", seed=5)
    ops = torch.ops.fused_triplet
    ft.build()
    for reduction in (1, 2):
        kept = x.clone().requires_grad_(True)
        loss, count, state = ops.mined_triplet_loss(kept, labels, mining, 0.5, 1e-6, reduction)
        loss.backward(torch.tensor(0.75, device="cuda"))
        remade = x.clone().requires_grad_(True)
        losses, _, _ = ops.mined_triplet_loss(remade, labels, mining, 0.5, 1e-6, 0)
        scale = 0.75 / max(count.item(), 1.0) if reduction == 1 else 0.75
        losses.backward(torch.full((batch,), scale, device="cuda"))
        torch.testing.assert_close(kept.grad, remade.grad, rtol=1e-5,
                                   atol=1e-6 * remade.grad.abs().max().item())
        fake = ft._mined_loss_fake(x, labels, mining, 0.5, 1e-6, reduction, True)[2]
        assert state.shape == fake.shape == (batch, 16) and state.dtype == fake.dtype


@requires_cuda
@pytest.mark.parametrize("offset,spread,batch,dim", [(0.0, 2e-2, 512, 2048),
                                                     (1e3, 1e-2, 512, 2048),
                                                     (0.0, 2e-2, 509, 2047)])
def test_batch_all_gradient_on_the_tensor_cores(offset, spread, batch, dim):
    # (512, 2048): tiles enough for the whole batch's gradient in double on the tensor cores
    # ((509, 2047): its 4-byte copies, rows not in whole 16-byte groups). Far from the origin a
    # row's products nearly cancel; the gradient of a few anchors' losses (the other anchors'
    # weights 0) against float64's. Distances about 1: every triplet sits far inside the hinge
    # (at 2048 elements of spread 1 hundreds sit within float32's rounding of its kink, where the
    # two precisions differ by whole triplets).
    g = torch.Generator().manual_seed(17)
    x = (offset + spread * torch.randn(batch, dim, generator=g, dtype=torch.float64)).float().cuda()
    labels = torch.randint(0, 32, (batch,), generator=g).cuda()
    few = [0, 1, 99, batch - 1]
    margin = margin_clear_of_kinks(x.double(), labels, few, "batch_all")
    weights = torch.zeros(batch, device="cuda")
    weights[few] = torch.tensor([0.5, 1.0, 1.5, 0.75], device="cuda")
    losses, grad, want, want_grad = few_anchors_against_float64(x, labels, "batch_all", margin,
                                                                few, weights)
    # float32 distances, summed over ~7000 triplets an anchor: a few 1e-6 of the loss and of the
    # largest gradient element
    torch.testing.assert_close(losses[few].double(), want[few], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad.double(), want_grad, rtol=1e-4,
                               atol=1e-5 * want_grad.abs().max().item())
    # one upstream gradient for all anchors ('sum') or one each, all 1: the same bits
    e = x.clone().requires_grad_(True)
    per_anchor = ft.mined_triplet_margin_loss(e, labels, "batch_all", margin=margin,
                                              reduction="none")
    total = ft.mined_triplet_margin_loss(e, labels, "batch_all", margin=margin, reduction="sum")
    assert torch.equal(torch.autograd.grad(per_anchor.sum(), e)[0],
                       torch.autograd.grad(total, e)[0])


@requires_cuda
@pytest.mark.parametrize("batch", [3000, 4500])
def test_batch_all_gram_products_ignore_tf32(batch):
    # A training script's allow_tf32 must not coarsen batch_all's Gram distances to TF32's 10 bits.
    x, labels = labelled_batch(batch, 64, batch // 8, dtype=torch.float32, device="cuda", seed=5)
    results, before = [], torch.backends.cuda.matmul.allow_tf32
    try:
        for allow in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = allow
            e = x.clone().requires_grad_(True)
            loss = ft.mined_triplet_margin_loss(e, labels, "batch_all")
            loss.backward()
            results.append((loss, e.grad))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@requires_cuda
def test_ops_opcheck():
    x, labels = labelled_batch(40, 16, 5, dtype=torch.float32, device="cuda")
    ops = torch.ops.fused_triplet
    ft.build()
    torch.library.opcheck(ft._internal_ops().mine_batch_hard, (x, labels, 1e-6, False))
    # (mining, reduction, eps, (distance, hinge, counting, band, band_margin))
    cases = ([(m, r, 1e-6, (0, 0, 0, 0, 0.0)) for m in (0, 1) for r in (0, 1, 2)]
             + [(0, 1, 0.0, (1, 1, 1, 0, 0.0)), (0, 0, 0.0, (0, 0, 2, 0, 0.0)),
                (1, 1, 0.0, (1, 1, 3, 3, 0.3)), (1, 0, 0.0, (0, 0, 2, 4, 0.1)),
                (2, 1, 1e-6, (0, 0, 0, 0, 0.0)), (2, 0, 0.0, (1, 0, 0, 0, 0.0)),
                (0, 1, 0.0, (3, 0, 1, 0, 0.0)), (1, 1, 0.0, (2, 1, 2, 1, 0.2)),
                (2, 2, 0.0, (3, 0, 0, 0, 0.0)), (0, 1, 0.0, (2, 0, 2, 0, 0.0, 15)),
                (1, 0, 0.0, (3, 1, 2, 2, 0.1, 15))])
    for mining, reduction, eps, rule in cases:
        torch.library.opcheck(ops.mined_triplet_loss, (x.clone().requires_grad_(True), labels,
                                                       mining, 0.5, eps, reduction, False, *rule))
        _, count, state = ops.mined_triplet_loss(x, labels, mining, 0.5, eps, reduction, True,
                                                 *rule)
        grad = torch.rand(40 if reduction == 0 else (), device="cuda")
        torch.library.opcheck(ops.mined_triplet_loss_backward,
                              (grad, x, labels, count, state, mining, 0.5, eps, reduction, True,
                               *rule))


@requires_cuda
@pytest.mark.parametrize("mining", [0, 1, 2])
@pytest.mark.parametrize("unit_distance,distance", [(2, 0), (3, 1)])
def test_unit_rows_are_the_libraries_normalisation(mining, unit_distance, distance):
    # Distances 2 and 3 scale the rows to unit length inside the op: the value and gradient of
    # distances 0 and 1 on rows that torch scales (x / max(|x|, 1e-12)), with a zero row (in a
    # class of its own: its distances to unit rows tie) and one below the floor.
    x, labels = labelled_batch(64, 24, 6, dtype=torch.float32, device="cuda", seed=3)
    x[5], x[9], labels[5] = 0.0, x[9] * 1e-14, 1000
    ops = torch.ops.fused_triplet

    def loss(rows, code):
        return ops.mined_triplet_loss(rows, labels, mining, 0.3, 0.0, 1, False, code, 0, 0, 0,
                                      0.0)[0]

    e = x.clone().requires_grad_(True)
    got = loss(e, unit_distance)
    (got_grad,) = torch.autograd.grad(got, e)
    e = x.clone().requires_grad_(True)
    want = loss(e / e.norm(dim=1, keepdim=True).clamp_min(1e-12), distance)
    (want_grad,) = torch.autograd.grad(want, e)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-5 * want_grad.abs().max())
    assert want_grad[9].abs().max() > 0  # below the floor the gradient is g / 1e-12


@requires_cuda
@pytest.mark.parametrize("mining", MININGS)
def test_a_training_step_in_a_cuda_graph(mining):
    # No host synchronisation and no device-to-host copy: the step is captured and replayed, and
    # replays on new embeddings give the eager step's loss and gradient.
    x, labels = labelled_batch(256, 64, 32, dtype=torch.float32, device="cuda", seed=4)
    e = x.clone().requires_grad_(True)

    def step():
        e.grad = None
        loss = ft.mined_triplet_margin_loss(e, labels, mining, margin=0.5)
        loss.backward()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    e.grad = None
    with torch.cuda.graph(graph):
        loss = ft.mined_triplet_margin_loss(e, labels, mining, margin=0.5)
        loss.backward()
    for seed in (5, 6):
        fresh, _ = labelled_batch(256, 64, 32, dtype=torch.float32, device="cuda", seed=seed)
        with torch.no_grad():
            e.copy_(fresh)
        graph.replay()
        eager = fresh.clone().requires_grad_(True)
        want = ft.mined_triplet_margin_loss(eager, labels, mining, margin=0.5)
        want.backward()
        assert torch.equal(loss, want) and torch.equal(e.grad, eager.grad)


@requires_cuda
@pytest.mark.parametrize("mining", MININGS)
def test_a_step_never_synchronises(mining):
    x, labels = labelled_batch(1024, 128, 128, dtype=torch.float32, device="cuda", seed=8)
    e = x.clone().requires_grad_(True)
    ft.mined_triplet_margin_loss(e, labels, mining).backward()  # built and warm
    torch.cuda.set_sync_debug_mode("error")
    try:
        ft.mined_triplet_margin_loss(e, labels, mining).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@requires_cuda
@pytest.mark.parametrize("batch, dim, dtype", [(12288, 32, torch.float32),
                                               (12288, 32, torch.bfloat16),
                                               (36864, 512, torch.bfloat16),
                                               (65536, 512, torch.float32)])
def test_batch_hard_scratch_within_the_memory_bound(batch, dim, dtype):
    # Beyond the embeddings and their gradient, a step's peak stays within twice the embeddings'
    # bytes + 64 MiB: at narrow rows the bfloat16 products' chunks shrink to fit (2^27 products
    # would take 256 MiB); wide 2-byte rows are read as given (a float copy and its float
    # gradient alone would pass the bound); at (65536, 512) the chunks of 2^27 products round up
    # to whole waves of the mining kernel only where the budget holds them.
    x, labels = labelled_batch(batch, dim, batch // 8, dtype=dtype, device="cuda", seed=21)
    e = x.clone().requires_grad_(True)
    ft.mined_triplet_margin_loss(e, labels).backward()  # built and warm
    e.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ft.mined_triplet_margin_loss(e, labels).backward()
    torch.cuda.synchronize()
    nbytes = e.numel() * e.element_size()
    extra = torch.cuda.max_memory_allocated() - base - nbytes
    assert extra <= 2 * nbytes + (64 << 20), extra / 2**20


@requires_cuda
@pytest.mark.parametrize("mining", MININGS)
def test_under_torch_compile(mining):
    x, labels = labelled_batch(128, 32, 8, dtype=torch.float32, device="cuda", seed=3)
    compiled = torch.compile(lambda e, y: ft.mined_triplet_margin_loss(e, y, mining),
                             fullgraph=True)
    e1, e2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    eager = ft.mined_triplet_margin_loss(e1, labels, mining)
    got = compiled(e2, labels)
    torch.testing.assert_close(got, eager)
    eager.backward()
    got.backward()
    torch.testing.assert_close(e2.grad, e1.grad)


@requires_cuda
def test_under_autocast_the_loss_stays_float32():
    x, labels = labelled_batch(64, 32, 8, dtype=torch.float16, device="cuda")
    with torch.autocast("cuda", torch.float16):
        for mining in MININGS:
            assert ft.mined_triplet_margin_loss(x, labels, mining).dtype == torch.float32


@requires_cuda
def test_raw_ops_refuse_what_the_kernels_do_not_take():
    x, labels = labelled_batch(8, 4, 2, dtype=torch.float32, device="cuda")
    ops = torch.ops.fused_triplet
    ft.build()
    _, count, state = ops.mined_triplet_loss(x, labels, 0, 0.5, 1e-6, 1, True)
    one = torch.ones((), device="cuda")
    big, big_labels = labelled_batch(2100, 4, 2, dtype=torch.float32, device="cuda")
    bad = [
        lambda: ft._internal_ops().mine_batch_hard(x.double(), labels, 1e-6),
        lambda: ft._internal_ops().mine_batch_hard(x, labels.int(), 1e-6),
        lambda: ft._internal_ops().mine_batch_hard(x, labels[:-1], 1e-6),
        lambda: ft._internal_ops().mine_batch_hard(x[0], labels, 1e-6),
        lambda: ft._internal_ops().mine_batch_hard(x, labels.cpu(), 1e-6),
        lambda: ops.mined_triplet_loss(x.to(torch.float8_e4m3fn), labels, 1, 0.5, 1e-6, 1),
        lambda: ops.mined_triplet_loss(x, labels, 3, 0.5, 1e-6, 1),
        lambda: ops.mined_triplet_loss(x, labels, 2, 0.5, 0.0, 1, False, 0, 1),  # semi_hard soft
        lambda: ops.mined_triplet_loss(x, labels, 0, 0.5, 0.0, 1, False, 4),
        lambda: ops.mined_triplet_loss(x, labels, 0, 0.5, 0.0, 1, False, -1),
        lambda: ops.mined_triplet_loss(x, labels, 0, 0.5, 1e-6, 1, False, 1),  # eps with d^2/2
        lambda: ops.mined_triplet_loss(x, labels, 0, 0.5, 1e-6, 1, False, 2),  # eps, unit rows
        lambda: ops.mined_triplet_loss(x, labels, 0, 0.5, 1e-6, 1, False, 3),
        lambda: ops.mined_triplet_loss(x, labels, 0, 0.5, 0.0, 1, False, 0, 2),
        lambda: ops.mined_triplet_loss(x, labels, 1, 0.5, 0.0, 1, False, 0, 0, 1),
        lambda: ops.mined_triplet_loss(x, labels, 0, 0.5, 0.0, 1, False, 0, 0, 3),
        lambda: ops.mined_triplet_loss(x, labels, 0, 0.5, 0.0, 1, False, 0, 0, 0, 1),
        lambda: ops.mined_triplet_loss(x, labels, 1, 0.5, 0.0, 1, False, 0, 0, 0, 5),
        lambda: ops.mined_triplet_loss(x, labels, 0, 0.5, 1e-6, 3),
        lambda: ops.mined_triplet_loss(x, labels, 2, 0.5, 0.0, 1, False, 0, 0, 0, 0, 0.0, 2),
        lambda: ops.mined_triplet_loss(x, labels, 0, 0.5, 0.0, 1, False, 0, 0, 0, 0, 0.0, 9),
        lambda: ops.mined_triplet_loss(x, labels, 1, 0.5, 0.0, 1, False, 0, 0, 0, 0, 0.0, -1),
        lambda: ops.mined_triplet_loss(big, big_labels, 0, 0.5, 0.0, 1, False, 0, 0, 0, 0, 0.0,
                                       100),  # a reference set past the whole batch's kernels
        lambda: ops.mined_triplet_loss(x[:1, :1].expand(2**31, 1), labels[:1].expand(2**31), 2,
                                       0.5, 1e-6, 1),  # 2^31 rows (no memory: strides of 0)
        lambda: ops.mined_triplet_loss_backward(one.half(), x, labels, count, state, 0, 0.5, 1e-6,
                                                1, True),
        lambda: ops.mined_triplet_loss_backward(torch.ones(7, device="cuda"), x, labels, count,
                                                state, 0, 0.5, 1e-6, 0, True),
        lambda: ops.mined_triplet_loss_backward(one, x, labels, count, state[:, :4], 0, 0.5, 1e-6,
                                                1, True),
        lambda: ops.mined_triplet_loss_backward(one, x, labels, count, state.float(), 0, 0.5,
                                                1e-6, 1, True),
        lambda: ops.mined_triplet_loss_backward(one, x, labels, count, torch.ones(9, 9, device="cuda"),
                                                1, 0.5, 1e-6, 1, True),
    ]
    for call in bad:
        with pytest.raises(RuntimeError, match="fused_triplet mining"):
            call()


@requires_cuda
@pytest.mark.parametrize("mining", [0, 1, 2])
@pytest.mark.parametrize("batch", [6, 2100])  # 2100: the Gram products' path (their mean too)
def test_raw_ops_take_rows_of_no_elements(mining, batch):
    # (batch, 0) embeddings: every distance is 0, the gradient has no elements to write.
    x = torch.empty(batch, 0, device="cuda")
    labels = torch.arange(batch, device="cuda") // 2
    ops = torch.ops.fused_triplet
    loss, count, state = ops.mined_triplet_loss(x, labels, mining, 0.5, 1e-6, 1, True)
    grad = ops.mined_triplet_loss_backward(torch.ones((), device="cuda"), x, labels, count, state,
                                           mining, 0.5, 1e-6, 1, True)
    torch.cuda.synchronize()
    assert grad.shape == (batch, 0) and loss.item() == 0.5  # each triplet's hinge: the margin


@requires_cuda
def test_other_p_and_float64_take_the_reference_on_the_gpu():
    x, labels = labelled_batch(50, 8, 5, device="cuda")
    for mining, p in itertools.product(MININGS, (1.0, 2.0)):
        got = ft.mined_triplet_margin_loss(x, labels, mining, p=p)
        want = brute_force(x.cpu(), labels.cpu(), mining, 1.0, p, 1e-6, "mean")
        torch.testing.assert_close(got.cpu(), want)
    # 160 rows: batch_all's sums over the positives' columns (topk of a mask) on the device
    x, labels = labelled_batch(160, 8, 20, device="cuda")
    for p in (1.0, 2.0):
        torch.testing.assert_close(
            ft.mined_triplet_margin_loss(x, labels, "batch_all", p=p, reduction="none").cpu(),
            ft.mined_triplet_margin_loss(x.cpu(), labels.cpu(), "batch_all", p=p,
                                         reduction="none"))


@requires_cuda
def test_devices_that_differ():
    x, labels = labelled_batch(8, 4, 2, dtype=torch.float32, device="cuda")
    with pytest.raises(RuntimeError, match="one device"):
        ft.mined_triplet_margin_loss(x, labels.cpu())

