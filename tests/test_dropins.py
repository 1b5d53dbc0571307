"""The drop-ins against the libraries they replace, on the same inputs: sentence-transformers'
Batch*TripletLoss classes and pytorch-metric-learning's TripletMarginLoss with its miners (each
library skipped with a line when absent), values and gradients in float64 and float32; their
refusals; gather_across_ranks in two processes."""
import itertools
import math

import pytest
import torch

import fused_triplet as ft
from conftest import requires_cuda

ST_CLASSES = ("BatchHardTripletLoss", "BatchAllTripletLoss", "BatchSemiHardTripletLoss",
              "BatchHardSoftMarginTripletLoss")
ST_DISTANCES = ("euclidean_distance", "cosine_distance")
PML_MINERS = (None, "batch_hard", "all", "hard", "semihard", "easy")
PML_DISTANCES = ("lp", "lp raw", "cosine")


def st_losses():
    return pytest.importorskip(
        "sentence_transformers.sentence_transformer.losses",
        reason="sentence-transformers is not installed (pip install -e .[test]): its drop-ins' "
               "comparison is skipped")


def st_version() -> tuple:
    import sentence_transformers

    return tuple(int(v) for v in sentence_transformers.__version__.split(".")[:2])


def skip_where_the_library_overflows(losses, name, kind):
    """sentence-transformers before 6.3 computes the soft margin as log1p(exp(x)): inf where x is
    large (huge norms); the drop-in follows 6.3's softplus."""
    if name == "BatchHardSoftMarginTripletLoss" and kind == "huge norms" and st_version() < (6, 3):
        pytest.skip(f"sentence-transformers {'.'.join(map(str, st_version()))} overflows to inf "
                    "here (log1p(exp(x))); the drop-in follows 6.3's softplus")


def skip_where_the_library_keeps_two_bytes(distance):
    """sentence-transformers before 6.2 takes the euclidean distance of 2-byte embeddings in
    their own dtype; the drop-in follows 6.2's float32 (its cos_sim upcasts in 6.0 already)."""
    if distance == "euclidean_distance" and st_version() < (6, 2):
        pytest.skip(f"sentence-transformers {'.'.join(map(str, st_version()))} computes 2-byte "
                    "euclidean distances in 2 bytes; the drop-in follows 6.2's float32")


def pml():
    return pytest.importorskip(
        "pytorch_metric_learning",
        reason="pytorch-metric-learning is not installed (pip install -e .[test]): its drop-ins' "
               "comparison is skipped")


def batch(kind, size=48, dim=16, seed=0):
    """Embeddings (float64) and int64 labels of a kind of batch the libraries must agree on."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, dim, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 6, (size,), generator=g)
    if kind == "duplicates":  # ties: repeated rows, in one class and across classes
        x[1], x[2], x[5] = x[0], x[0], x[3]
    elif kind == "single class":
        labels.zero_()
    elif kind == "classes of one":
        labels = torch.arange(size)
    elif kind == "some without positives":
        labels[:6] = torch.arange(100, 106)
    elif kind == "huge norms":
        x = x * 1e4 + 3e4
    return x, labels


KINDS = ("plain", "duplicates", "single class", "classes of one", "some without positives",
         "huge norms")


def batch_clear_of_band_edges(kind, distance, size, dim, edges=(0.0, 0.3), references=0):
    """batch(kind) of the first seed where no triplet's gap d_an - d_ap (float64; a similarity's
    s_ap - s_an) lies within a few float32 roundings of a distance of a miner's band edge, other
    than exactly on it (equal rows): there rounding decides membership, in either library. With
    references, a plain reference set too (its rows the positives and negatives)."""
    for seed in range(50):
        x, labels = batch(kind, size=size, dim=dim, seed=seed)
        refs, ref_labels = (batch("plain", size=references, dim=dim, seed=seed + 100)
                            if references else (x, labels))
        unit = (lambda v: v) if distance == "lp raw" else (lambda v: v / v.norm(dim=1, keepdim=True))
        rows, ref_rows = unit(x), unit(refs)
        d = -(rows @ ref_rows.t()) if distance == "cosine" else torch.cdist(rows, ref_rows)
        positives, negatives = ft._label_masks(labels, ref_labels, None if references else 0)
        gaps = (d[:, None, :] - d[:, :, None])[positives[:, :, None] & negatives[:, None, :]]
        clearance = 16 * torch.finfo(torch.float32).eps * d.abs().max()
        if all(((gaps - e).abs()[gaps != e] > clearance).all() for e in edges):
            return (x, labels, refs, ref_labels) if references else (x, labels)
    raise AssertionError("no seed gives a batch clear of the band edges")


def value_and_grad(fn, x):
    leaf = x.detach().clone().requires_grad_(True)
    loss = fn(leaf)
    (grad,) = torch.autograd.grad(loss, leaf, allow_unused=True)
    return loss.detach(), (torch.zeros_like(leaf) if grad is None else grad)


def assert_within_their_error(got, their, exact):
    """Each of ours (float32) off the library's float64 result by at most 4x the library's own
    float32 error (plus a few float32 ulps of the scale)."""
    for mine, library, want in zip(got, their, exact):
        scale = 1 + want.abs().max()
        allowed = 4 * (library.double() - want).abs() + 8 * torch.finfo(torch.float32).eps * scale
        assert ((mine.double() - want).abs() <= allowed).all(), (mine, library, want)


def assert_like_theirs(ours, theirs, x):
    """float64: equal to theirs far below float32 rounding (sums in another order; distances
    near 0 amplify that in the gradient). float32: ours off their float64 result by at most 4x
    their own float32 error (plus a few float32 ulps of the scale)."""
    exact_value, exact_grad = value_and_grad(theirs, x)
    value, grad = value_and_grad(ours, x)
    torch.testing.assert_close(value, exact_value, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, exact_grad, rtol=1e-6, atol=1e-9)
    x32 = x.float()
    assert_within_their_error(value_and_grad(ours, x32), value_and_grad(theirs, x32),
                              (exact_value, exact_grad))


# ---- sentence-transformers ---------------------------------------------------------------------

@pytest.mark.parametrize("dim", [16, 1024])
@pytest.mark.parametrize(
    "name,distance,kind,semi_hard_pairs",
    [(*case, False) for case in itertools.product(ST_CLASSES, ST_DISTANCES, KINDS)] +
    [("BatchSemiHardTripletLoss", *case, True) for case in itertools.product(ST_DISTANCES, KINDS)])
def test_sentence_transformers_drop_ins(name, distance, kind, dim, semi_hard_pairs, monkeypatch):
    # 48 rows of 1024: the hard losses' torch path differentiates only the chosen distances;
    # semi-hard's rows sorted at 48 rows, or its pairs' rows gathered as past 64
    assert 48 ** 2 * 1024 >= ft._ST_CHOSEN_ENTRIES_FROM > 48 ** 2 * 16
    assert 48 <= ft._ST_SORTED_SEMI_HARD_ROWS
    if semi_hard_pairs:
        monkeypatch.setattr(ft, "_ST_SORTED_SEMI_HARD_ROWS", 0)
    losses = st_losses()
    skip_where_the_library_overflows(losses, name, kind)
    x, labels = batch(kind, dim=dim)
    metric = getattr(losses.BatchHardTripletLossDistanceFunction, distance)
    margin = {} if name == "BatchHardSoftMarginTripletLoss" else {"margin": 0.7}
    theirs = getattr(losses, name)(None, distance_metric=metric, **margin)
    ours = getattr(ft, name)(None, distance_metric=metric, **margin)
    assert_like_theirs(lambda e: ours.compute_loss_from_embeddings([e], labels),
                       lambda e: theirs.compute_loss_from_embeddings([e], labels), x)


def test_sentence_transformers_defaults_forward_and_labels():
    losses = st_losses()
    x, labels = batch("plain")

    class Model(torch.nn.Module):  # sentence-transformers' model call: features -> a dict
        def forward(self, features):
            return {"sentence_embedding": features["x"] * 2}

    for name in ST_CLASSES:
        theirs, ours = getattr(losses, name)(Model()), getattr(ft, name)(Model())
        for these in (labels, labels.int(), labels.to(torch.uint8), labels.double()):
            torch.testing.assert_close(ours([{"x": x}], these), theirs([{"x": x}], these))
        with pytest.raises(ValueError, match="expects 48 labels"):
            ours.compute_loss_from_embeddings([x], labels[:-1])
    assert ft.BatchHardTripletLoss().triplet_margin == 5


def test_sentence_transformers_distance_functions_are_recognised_by_name():
    for metric in (ft.BatchHardTripletLossDistanceFunction.cosine_distance,
                   ft.BatchHardTripletLossDistanceFunction.eucledian_distance):
        ft.BatchAllTripletLoss(None, distance_metric=metric)
    with pytest.raises(ValueError, match="distance_metric must be"):
        ft.BatchAllTripletLoss(None, distance_metric=lambda e: torch.cdist(e, e))


# ---- pytorch-metric-learning -------------------------------------------------------------------

def pml_objects(distance, miner, smooth):
    lib = pml()
    from pytorch_metric_learning import distances, losses, miners

    make = {"lp": lambda: distances.LpDistance(), "cosine": distances.CosineSimilarity,
            "lp raw": lambda: distances.LpDistance(normalize_embeddings=False)}[distance]
    loss_func = losses.TripletMarginLoss(margin=0.2, distance=make(), smooth_loss=smooth)
    if miner is None:
        return lib, loss_func, None
    if miner == "batch_hard":
        return lib, loss_func, miners.BatchHardMiner(distance=make())
    return lib, loss_func, miners.TripletMarginMiner(margin=0.3, type_of_triplets=miner,
                                                     distance=make())


@pytest.mark.parametrize("distance,miner,smooth",
                         list(itertools.product(PML_DISTANCES, PML_MINERS, (False, True))))
@pytest.mark.parametrize("kind", ("plain", "duplicates", "classes of one", "reference set"))
def test_pytorch_metric_learning_drop_in(distance, miner, smooth, kind):
    _, loss_func, mine = pml_objects(distance, miner, smooth)
    x, labels = batch("plain" if kind == "reference set" else kind, size=40)
    refs, ref_labels = (batch("plain", size=30, seed=1) if kind == "reference set"
                        else (None, None))

    def theirs(e):
        r = None if refs is None else refs.to(e.dtype)
        tuples = None if mine is None else mine(e, labels, r, ref_labels)
        return loss_func(e, labels, tuples, r, ref_labels)

    def ours(e):
        r = None if refs is None else refs.to(e.dtype)
        return ft.pml_triplet_loss(loss_func, mine, e, labels, r, ref_labels)

    assert_like_theirs(ours, theirs, x)


def test_pytorch_metric_learning_labels_of_any_dtype():
    _, loss_func, mine = pml_objects("lp", "semihard", False)
    x, labels = batch("plain")
    want = loss_func(x, labels, mine(x, labels))
    for these in (labels.int(), labels.to(torch.uint8), labels.double() + 0.5):
        torch.testing.assert_close(ft.pml_triplet_loss(loss_func, mine, x, these), want)


def test_pytorch_metric_learning_settings_not_covered_raise():
    pml()
    from pytorch_metric_learning import distances, losses, miners, reducers

    x, labels = batch("plain")
    loss = losses.TripletMarginLoss()
    with pytest.raises(ValueError, match="ref_emb and ref_labels"):
        ft.pml_triplet_loss(loss, None, x, labels, ref_emb=x)
    for bad, match in ((losses.TripletMarginLoss(swap=True), "swap"),
                       (losses.TripletMarginLoss(reducer=reducers.SumReducer()), "reducer"),
                       (losses.TripletMarginLoss(distance=distances.LpDistance(p=1)), "LpDistance"),
                       (losses.ContrastiveLoss(), "TripletMarginLoss")):
        with pytest.raises(ValueError, match=match):
            ft.pml_triplet_loss(bad, None, x, labels)
    with pytest.raises(ValueError, match="miner must be"):
        ft.pml_triplet_loss(loss, miners.MultiSimilarityMiner(), x, labels)
    with pytest.raises(ValueError, match="miner.distance"):
        ft.pml_triplet_loss(loss, miners.BatchHardMiner(distance=distances.CosineSimilarity()),
                            x, labels)


@requires_cuda
@pytest.mark.parametrize("name,distance,kind",
                         list(itertools.product(ST_CLASSES, ST_DISTANCES, KINDS)))
@pytest.mark.parametrize("size", [256, 3000])  # 3000: batch_hard's Gram mining
def test_sentence_transformers_drop_ins_on_the_gpu(name, distance, kind, size):
    # Each runs the mined op. float32 against the library's float64 result: at most 4x the
    # library's own float32 error.
    losses = st_losses()
    skip_where_the_library_overflows(losses, name, kind)
    if size > 256 and name not in ("BatchHardTripletLoss", "BatchHardSoftMarginTripletLoss"):
        pytest.skip("the library's batch_all and semi-hard build B x B x B tensors at 3000 rows")
    if name == "BatchSemiHardTripletLoss" and kind == "huge norms":
        x, labels = batch(kind, size=96, dim=64)  # the library's float32 error dwarfs all here
    elif name == "BatchSemiHardTripletLoss":  # clear of d_an = d_ap, where rounding picks
        x, labels = batch_clear_of_band_edges(
            kind, "cosine" if distance == "cosine_distance" else "lp raw", size=96, dim=64,
            edges=(0.0,))
    else:
        x, labels = batch(kind, size=size, dim=64)
    x, labels = x.cuda(), labels.cuda()
    metric = getattr(losses.BatchHardTripletLossDistanceFunction, distance)
    margin = {} if name == "BatchHardSoftMarginTripletLoss" else {"margin": 0.7}
    theirs = getattr(losses, name)(None, distance_metric=metric, **margin)
    ours = getattr(ft, name)(None, distance_metric=metric, **margin)
    exact = value_and_grad(lambda e: theirs.compute_loss_from_embeddings([e], labels), x)
    their = value_and_grad(lambda e: theirs.compute_loss_from_embeddings([e], labels), x.float())
    got = value_and_grad(lambda e: ours.compute_loss_from_embeddings([e], labels), x.float())
    assert got[0].dtype == their[0].dtype and got[1].dtype == torch.float32
    assert_within_their_error(got, their, exact)


@requires_cuda
@pytest.mark.parametrize("distance,miner,smooth",
                         list(itertools.product(PML_DISTANCES, PML_MINERS, (False, True))))
@pytest.mark.parametrize("kind", ("plain", "duplicates", "classes of one"))
def test_pytorch_metric_learning_drop_in_on_the_gpu(distance, miner, smooth, kind):
    # The mined op in float32 against the library's float64 result: at most 4x the library's
    # own float32 error.
    _, loss_func, mine = pml_objects(distance, miner, smooth)
    x, labels = batch_clear_of_band_edges(kind, distance, size=96, dim=32)
    x, labels = x.cuda(), labels.cuda()

    def theirs(e):
        return loss_func(e, labels, None if mine is None else mine(e, labels))

    exact, their = value_and_grad(theirs, x), value_and_grad(theirs, x.float())
    got = value_and_grad(lambda e: ft.pml_triplet_loss(loss_func, mine, e, labels), x.float())
    assert_within_their_error(got, their, exact)


@requires_cuda
@pytest.mark.parametrize("distance,miner,smooth",
                         list(itertools.product(PML_DISTANCES, PML_MINERS, (False, True))))
def test_pytorch_metric_learning_reference_set_on_the_gpu(distance, miner, smooth, monkeypatch):
    # The op with the reference set after the batch: values and the gradients of both, float32
    # against the library's float64 result, at most 4x the library's own float32 error.
    _, loss_func, mine = pml_objects(distance, miner, smooth)
    x, labels, refs, ref_labels = (t.cuda() for t in batch_clear_of_band_edges(
        "plain", distance, size=48, dim=32, references=72))
    calls = []
    on_the_op = ft._library_loss_on_the_op
    monkeypatch.setattr(ft, "_library_loss_on_the_op", lambda *a: calls.append(a) or on_the_op(*a))

    def value_and_grads(fn, dtype):
        e, r = (t.detach().to(dtype).requires_grad_(True) for t in (x, refs))
        loss = fn(e, r)
        grads = torch.autograd.grad(loss, (e, r), allow_unused=True)
        return [loss.detach(), *(torch.zeros_like(t) if g is None else g
                                 for g, t in zip(grads, (e, r)))]

    def theirs(e, r):
        return loss_func(e, labels, None if mine is None else mine(e, labels, r, ref_labels), r,
                         ref_labels)

    exact, their = value_and_grads(theirs, torch.float64), value_and_grads(theirs, torch.float32)
    got = value_and_grads(lambda e, r: ft.pml_triplet_loss(loss_func, mine, e, labels, r,
                                                           ref_labels), torch.float32)
    assert len(calls) == 1 and calls[0][-1] == 72  # the op ran, with the reference set
    assert_within_their_error(got, their, exact)


@requires_cuda
@pytest.mark.parametrize("name", ["BatchAllTripletLoss", "BatchSemiHardTripletLoss"])
@pytest.mark.parametrize("size", [3000, 4500])
def test_sentence_transformers_drop_ins_past_the_whole_batch(name, size):
    # Distances from the Gram products, the gradient by double products; 4500 rows: a chunk of
    # anchors at a time. The library builds B x B x B tensors here: against its formula (the
    # drop-in's torch path) in float64, at most 4x that formula's own float32 error. Classes in
    # clusters of their own, so that no negative sits at a positive's distance (where rounding
    # picks semi-hard's).
    g = torch.Generator().manual_seed(5)
    labels = torch.randint(0, size // 9, (size,), generator=g)
    centres = torch.randn(size // 9, 16, generator=g, dtype=torch.float64) * 4
    x = (centres[labels] + 0.3 * torch.randn(size, 16, generator=g, dtype=torch.float64)).cuda()
    labels = labels.cuda()
    loss = getattr(ft, name)(None, margin=0.7)
    formula = lambda e: loss._loss(loss._distance(e), labels)  # noqa: E731
    exact, their = value_and_grad(formula, x), value_and_grad(formula, x.float())
    got = value_and_grad(lambda e: loss.compute_loss_from_embeddings([e], labels), x.float())
    assert_within_their_error(got, their, exact)


@requires_cuda
@pytest.mark.parametrize("size", [1000, 4500])
def test_semi_hard_is_deterministic(size):
    # 4500 rows: the gradient from each chunk's sparse weights, rows then columns, in order
    g = torch.Generator().manual_seed(11)
    labels = torch.randint(0, size // 8, (size,), generator=g).cuda()
    x = torch.randn(size, 64, generator=g).cuda()
    loss = ft.BatchSemiHardTripletLoss(None, margin=0.7)
    first, second = (value_and_grad(lambda e: loss.compute_loss_from_embeddings([e], labels), x)
                     for _ in range(2))
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_sentence_transformers_hard_drop_ins_spread_what_is_not_finite_as_theirs(value):
    # 48 rows of 1024 with a NaN or inf: the library's graph, NaN wherever the library has it
    losses = st_losses()
    x, labels = batch("plain", dim=1024)
    x[3, 5] = value
    for name, distance in itertools.product(
            ("BatchHardTripletLoss", "BatchHardSoftMarginTripletLoss"), ST_DISTANCES):
        metric = getattr(losses.BatchHardTripletLossDistanceFunction, distance)
        (value_ours, grad), (value_theirs, their_grad) = (
            value_and_grad(lambda e: loss.compute_loss_from_embeddings([e], labels), x)
            for loss in (getattr(ft, name)(None, distance_metric=metric),
                         getattr(losses, name)(None, distance_metric=metric)))
        torch.testing.assert_close(value_ours, value_theirs, equal_nan=True)
        torch.testing.assert_close(grad, their_grad, equal_nan=True)


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_semi_hard_sorted_rows_spread_what_is_not_finite_as_the_pairs(value, monkeypatch):
    # Semi-hard's two torch paths, a NaN or inf in a row (the libraries' versions part there):
    # the same value and gradient, NaN where the other has it
    x, labels = batch("duplicates", dim=64)
    x[3, 5] = value
    loss = ft.BatchSemiHardTripletLoss(None, margin=0.7)
    sorted_rows = value_and_grad(lambda e: loss.compute_loss_from_embeddings([e], labels), x)
    monkeypatch.setattr(ft, "_ST_SORTED_SEMI_HARD_ROWS", 0)
    pairs = value_and_grad(lambda e: loss.compute_loss_from_embeddings([e], labels), x)
    for ours, other in zip(sorted_rows, pairs):
        torch.testing.assert_close(ours, other, equal_nan=True, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dim", [16, 1024])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,distance", list(itertools.product(ST_CLASSES, ST_DISTANCES)))
def test_sentence_transformers_drop_ins_on_two_byte_embeddings(name, distance, dtype, dim):
    # sentence-transformers takes 2-byte rows in float32 for both distances: a float32 loss, the
    # gradient cast back to the embeddings' dtype
    losses = st_losses()
    skip_where_the_library_keeps_two_bytes(distance)
    x, labels = batch("plain", dim=dim)
    metric = getattr(losses.BatchHardTripletLossDistanceFunction, distance)
    theirs = getattr(losses, name)(None, distance_metric=metric)
    ours = getattr(ft, name)(None, distance_metric=metric)
    x = x.to(dtype)
    (value, grad), (their_value, their_grad) = (
        value_and_grad(lambda e: loss.compute_loss_from_embeddings([e], labels), x)
        for loss in (ours, theirs))
    assert value.dtype == their_value.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(value, their_value, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, their_grad, rtol=1e-2, atol=1e-5)


@requires_cuda
def test_fused_drop_ins_take_two_byte_embeddings_and_float_labels():
    losses = st_losses()
    x, labels = batch("plain", size=128, dim=32)
    x, labels = x.cuda(), labels.cuda()
    for name in ST_CLASSES:
        for distance in ST_DISTANCES:
            metric = getattr(losses.BatchHardTripletLossDistanceFunction, distance)
            ours = getattr(ft, name)(None, distance_metric=metric)
            want = ours.compute_loss_from_embeddings([x.float()], labels)
            torch.testing.assert_close(ours.compute_loss_from_embeddings([x.float()],
                                                                         labels * 0.5 + 0.25), want)
            for dtype in (torch.bfloat16, torch.float16):
                got = ours.compute_loss_from_embeddings([x.to(dtype)], labels)
                assert got.dtype == torch.float32  # the library's, from float32 rows
                torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


# ---- across processes --------------------------------------------------------------------------

def _gather_worker(rank, world, port, backend, results):
    torch.distributed.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}",
                                         rank=rank, world_size=world)
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    x, labels = batch("plain", size=21)
    sizes = [12, 9]  # ranks may hold different batch sizes
    start = sum(sizes[:rank])
    local = x[start:start + sizes[rank]].float().to(device).requires_grad_(True)
    everything, all_labels = ft.gather_across_ranks(local, labels[start:start + sizes[rank]]
                                                    .to(device))
    loss = ft.mined_triplet_margin_loss(everything, all_labels, "batch_all", margin=0.5)
    loss.backward()
    results.put((rank, loss.item(), local.grad.tolist()))  # plain data: the process ends first
    torch.distributed.destroy_process_group()


def run_two_ranks(backend):
    """Two processes gather 12 + 9 rows; the loss of the 21 on each, and the local gradients."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    workers = [context.Process(target=_gather_worker, args=(rank, 2, port, backend, results))
               for rank in range(2)]
    for w in workers:
        w.start()
    got = dict((rank, (loss, grad)) for rank, loss, grad in (results.get(timeout=300)
                                                             for _ in workers))
    for w in workers:
        w.join(timeout=60)
        assert w.exitcode == 0
    x, labels = batch("plain", size=21)
    device = "cuda" if backend == "nccl" else "cpu"
    leaf = x.float().to(device).requires_grad_(True)
    want = ft.mined_triplet_margin_loss(leaf, labels.to(device), "batch_all", margin=0.5)
    want.backward()
    for rank, start, stop in ((0, 0, 12), (1, 12, 21)):
        assert got[rank][0] == pytest.approx(want.item(), rel=1e-6)
        torch.testing.assert_close(torch.tensor(got[rank][1]), leaf.grad[start:stop].cpu())


def test_gather_across_ranks_gives_the_single_process_loss_and_gradient():
    run_two_ranks("gloo")


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="fewer than two GPUs visible: the NCCL gather needs two")
def test_gather_across_two_gpus():
    run_two_ranks("nccl")
