"""Training in one pass: under autograd, 'mean' and 'sum' losses of rows the kernels can hold get
their gradients written by the forward, for the upstream gradient it predicts (the last one of
the same problem and place in the step, if it repeated); the backward checks the prediction on
the GPU and recomputes what it got wrong. Whatever the prediction, the bits are the two-pass
path's: each training loop here is run both ways and compared, and against torch. GPU only."""

import math

import pytest
import torch
import torch.nn.functional as F

import fused_triplet as ft
from conftest import assert_as_accurate_as_torch, fused_loss, rand_triplet, requires_cuda

pytestmark = requires_cuda
DEV = "cuda"
ROWS, ONE_PASS = 0, 2  # forward families: the rows kernel (then the backward kernels), one pass
REDUCTIONS = {"mean": 1, "sum": 2}


def bits(x):
    return None if x is None else x.view(torch.int16 if x.element_size() == 2 else torch.int32)


def step(inputs, requires=(True, True, True), weight=None, forward=-1, **kw):
    """loss and the inputs' .grad after (weight * loss).backward() (loss.backward() for None)."""
    xs = [x.detach().clone().requires_grad_(r) for x, r in zip(inputs, requires)]
    loss = fused_loss(*xs, forward=forward, **kw)
    (loss if weight is None else loss * weight).backward()
    return loss.detach(), [x.grad for x in xs]


def history(inputs, margin=1.0, p=2.0, eps=1e-6, swap=False, reduction="mean"):
    """(last upstream gradient, whether it repeated) of each place of the problem's step."""
    raw = ft._internal_ops().upstream_history(*inputs, float(margin), float(p), float(eps), swap,
                                     REDUCTIONS[reduction]).cpu()
    return [(v, bool(r)) for v, r in zip(raw[:, 0].view(torch.float32).tolist(),
                                         raw[:, 1].tolist())]


def torch_grads(inputs, requires, weight, double=False, **kw):
    xs = [(x.double() if double else x).detach().clone().requires_grad_(r)
          for x, r in zip(inputs, requires)]
    loss = F.triplet_margin_loss(*xs, **kw)
    (loss if weight is None else loss * weight).backward()
    return [x.grad for x in xs]


def takes_one_pass(inputs, pnorm=2.0, swap=False):
    return "training onepass" in ft._internal_ops().describe_plans(*inputs, pnorm, swap)


def assert_same_bits(one, two, case=None):
    (loss1, grads1), (loss2, grads2) = one, two
    assert torch.equal(bits(loss1), bits(loss2)), case
    for g1, g2 in zip(grads1, grads2):
        assert (g1 is None) == (g2 is None), case
        if g1 is not None:
            assert torch.equal(bits(g1), bits(g2)), case


# Teams of 8, 32 and 256 threads (few rows promote theirs), up to 8 packs per thread, and 12 and
# 16 (teams of 32) where the GPU's shared memory per block holds them (an H100/H200 does).
CASES = [((1024, 128), torch.float32), ((300, 64), torch.bfloat16), ((4096, 512), torch.float32),
         ((1000, 1024), torch.bfloat16), ((64, 8192), torch.float32), ((5, 4096), torch.float32),
         ((33, 16384), torch.bfloat16), ((2, 7, 96), torch.float32), ((700, 256), torch.float16)]
CASES_BEYOND_8_PACKS = [((8192, 1536), torch.float32), ((8192, 3072), torch.bfloat16)]


@pytest.mark.parametrize("shape,dtype", CASES + CASES_BEYOND_8_PACKS)
@pytest.mark.parametrize("pnorm", [2.0, 1.0])
def test_one_pass_same_bits_as_two_passes(shape, dtype, pnorm):
    """Each weight three steps in a row: the first two teach the forward's prediction, the third
    takes the gradients the forward wrote (the history says it predicted the weight)."""
    inputs = rand_triplet(shape, dtype, DEV, seed=1)
    if (shape, dtype) in CASES_BEYOND_8_PACKS and not takes_one_pass(inputs, pnorm):
        pytest.skip("this GPU's shared memory per block does not hold 12 packs per thread")
    assert takes_one_pass(inputs, pnorm)
    for swap in (False, True):
        for reduction in ("mean", "sum"):
            for weight in (None, 0.5, -3.0):
                for requires in ((True, True, True), (True, False, True), (False, True, False)):
                    # a margin per weight: no other weight's backward teaches its history
                    kw = dict(p=pnorm, swap=swap, reduction=reduction,
                              margin=0.5 + 0.01 * (weight or 0))
                    case = (swap, reduction, weight, requires)
                    two = step(inputs, requires, weight, ROWS, **kw)
                    for _ in range(3):
                        one = step(inputs, requires, weight, ONE_PASS, **kw)
                        assert_same_bits(one, two, case)
                    assert history(inputs, **kw)[0] == (1.0 if weight is None else weight, True)
                    if requires != (True, True, True):
                        continue
                    theirs = torch_grads(inputs, requires, weight, **kw)
                    ref = torch_grads(inputs, requires, weight, double=True, **kw)
                    for g, t, r in zip(one[1], theirs, ref):
                        assert_as_accurate_as_torch(g, t, r)


def loop(inputs, weights, forward=-1, **kw):
    """A training loop: one step per weight (None: loss.backward())."""
    return [step(inputs, weight=w, forward=forward, **kw) for w in weights]


@pytest.mark.parametrize("name,weights", [
    ("loss / 4", [0.25] * 5),
    ("GradScaler", [65536.0] * 5),
    ("alternating 1 / 0.5", [None, 0.5] * 3),
    ("GradScaler backs off", [65536.0] * 3 + [32768.0] * 4),
    ("non-finite and zero", [math.nan, math.nan, math.inf, math.inf, -math.inf, 0.0, 0.0, 0.0]),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_training_loops_same_bits_as_two_passes(name, weights, dtype):
    inputs = rand_triplet((512, 256), dtype, DEV, seed=2)
    kw = dict(margin=0.75, swap=True)
    for one, two in zip(loop(inputs, weights, **kw), loop(inputs, weights, ROWS, **kw)):
        assert_same_bits(one, two, name)


@pytest.mark.parametrize("upstream", [math.nan, math.inf, -math.inf, 0.0])
@pytest.mark.parametrize("swap", [False, True])
def test_nonfinite_and_zero_upstream_like_torch(upstream, swap):
    """Rows whose hinge is off keep a zero gradient whatever the upstream gradient (torch's
    clamp_min passes none of it to them), the others take it: non-finite where torch's are
    (NaN where 0 x inf meets, which torch may order differently)."""
    a, p, n = rand_triplet((64, 256), torch.float32, DEV, seed=13)
    p[0::2] = a[0::2] + 0.01 * n[0::2]  # inactive hinges on even rows
    weight = torch.tensor(upstream, device=DEV)
    kw = dict(swap=swap, margin=1.0625)
    ours = {"one": loop((a, p, n), [weight] * 3, **kw)[-1][1],
            "two": step((a, p, n), weight=weight, forward=ROWS, **kw)[1]}
    theirs = torch_grads((a, p, n), (True, True, True), weight, **kw)
    for g1, g2, t in zip(ours["one"], ours["two"], theirs):
        assert torch.equal(bits(g1), bits(g2))
        assert torch.equal(g1.isfinite(), t.isfinite())
        assert torch.equal(g1[t.isinf()], t[t.isinf()])
        if not math.isinf(upstream):
            assert torch.equal(g1.isnan(), t.isnan())
        assert (g1[0::2] == 0).all()
        finite = g1.isfinite() & t.isfinite()
        torch.testing.assert_close(g1[finite], t[finite], rtol=1e-4, atol=1e-6)


def test_predicts_the_last_upstream_gradient_once_it_repeats():
    inputs = rand_triplet((256, 128), torch.float32, DEV, seed=3)
    kw = dict(margin=1.2345)  # a problem of its own: no other test's backward teaches it
    step([x.requires_grad_() for x in inputs], weight=None, **kw)
    assert history(inputs, **kw)[0] == (1.0, True)
    step(inputs, weight=0.5, **kw)
    assert history(inputs, **kw)[0] == (0.5, False)  # changed: the next forward writes none
    step(inputs, weight=0.5, **kw)
    assert history(inputs, **kw)[0] == (0.5, True)   # repeated: the next forward predicts 0.5
    assert history(inputs, **kw)[1:] == [(1.0, True)] * 7  # untouched places


def test_two_losses_of_one_problem_in_one_step():
    """`l1 + 0.5 * l2` over two batches of one shape: each loss keeps its own place in the
    step, so both predict their upstream gradient (1 and 0.5) and take one pass."""
    first = rand_triplet((1024, 256), torch.float32, DEV, seed=4)
    second = rand_triplet((1024, 256), torch.float32, DEV, seed=5)
    kw = dict(margin=0.625)

    def train_step(forward):
        xs = [x.detach().clone().requires_grad_() for x in first + second]
        l1 = fused_loss(*xs[:3], forward=forward, **kw)
        l2 = fused_loss(*xs[3:], forward=forward, **kw)
        (l1 + 0.5 * l2).backward()
        return [x.grad for x in xs]

    two = train_step(ROWS)
    for _ in range(3):
        one = train_step(-1)
        assert all(torch.equal(bits(g1), bits(g2)) for g1, g2 in zip(one, two))
    assert history(first, **kw)[:2] == [(1.0, True), (0.5, True)]


def test_problems_that_shared_a_slot_keep_their_own():
    """Shapes and options whose old hashed slot was one (its hash read each word's low byte):
    each problem's history is its own."""
    problems = [((4096, 512), dict(p=2.0, margin=0.5), 0.25),
                ((1024, 256), dict(p=1.0, margin=1.0), 65536.0),
                ((256, 8192), dict(p=2.0, margin=2.0), 0.5)]
    inputs = [rand_triplet(shape, torch.float32, DEV, seed=6) for shape, _, _ in problems]
    twos = [step(x, weight=w, forward=ROWS, **kw) for x, (_, kw, w) in zip(inputs, problems)]
    for _ in range(3):
        for x, (_, kw, w), two in zip(inputs, problems, twos):
            assert_same_bits(step(x, weight=w, **kw), two)
    for x, (_, kw, w) in zip(inputs, problems):
        assert history(x, **kw)[0] == (w, True)


def test_state_released_under_a_pending_backward():
    """The one pass's state is freed on release (the library does it at exit); a forward
    taken before still owns its place, so its backward updates memory that is still its own,
    and the next steps start the problem's history anew, with the two-pass bits."""
    inputs = rand_triplet((512, 256), torch.float32, DEV, seed=11)
    kw = dict(margin=0.4375)
    two = step(inputs, weight=0.5, forward=ROWS, **kw)
    for _ in range(3):
        assert_same_bits(step(inputs, weight=0.5, **kw), two)
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    loss = fused_loss(*xs, **kw)  # predicts 0.5 from the state about to be released
    ft._internal_ops().release_step_state()
    assert history(inputs, **kw) == []
    (loss * 0.5).backward()
    assert_same_bits((loss.detach(), [x.grad for x in xs]), two)
    assert history(inputs, **kw) == []  # the released place's update went to the node's copy
    for _ in range(3):
        assert_same_bits(step(inputs, weight=0.5, **kw), two)
    assert history(inputs, **kw)[0] == (0.5, True)


def test_several_streams_same_bits():
    """One problem trained on two streams at once with other weights: predictions race, the
    gradients stay the two-pass path's."""
    inputs = rand_triplet((2048, 512), torch.float32, DEV, seed=7)
    kw = dict(margin=0.875)
    weights = {0: 0.25, 1: 3.0}
    expected = {k: step(inputs, weight=w, forward=ROWS, **kw) for k, w in weights.items()}
    streams = [torch.cuda.Stream() for _ in weights]
    results = {k: [] for k in weights}
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    for _ in range(6):
        for k, s in zip(weights, streams):
            with torch.cuda.stream(s):
                results[k].append(step(inputs, weight=weights[k], **kw))
    torch.cuda.synchronize()
    for k in weights:
        for got in results[k]:
            assert_same_bits(got, expected[k])


@pytest.mark.parametrize("weight", [0.5, 65536.0])
def test_cuda_graph_replay_same_bits(weight):
    """A captured training step replayed: the history lives in device memory the graph reads
    and writes, so the replays predict the weight; each gives the two-pass bits."""
    inputs = rand_triplet((1024, 512), torch.float32, DEV, seed=8)
    kw = dict(margin=0.9375)
    expected = step(inputs, weight=weight, forward=ROWS, **kw)
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture makes the problem's history
        for _ in range(2):
            loss = fused_loss(*xs, **kw)
            torch.autograd.grad(loss * weight, xs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = fused_loss(*xs, **kw)
        grads = torch.autograd.grad(loss * weight, xs)
    for _ in range(4):
        graph.replay()
        torch.cuda.synchronize()
        assert_same_bits((loss, list(grads)), expected)
    assert history(inputs, **kw)[0] == (weight, True)


def test_second_backward_with_retained_graph():
    xs = [x.requires_grad_() for x in rand_triplet((512, 512), torch.float32, DEV, seed=9)]
    loss = fused_loss(*xs, swap=True, forward=ONE_PASS)
    loss.backward(retain_graph=True)  # the one pass's gradients
    first = [x.grad.clone() for x in xs]
    for x in xs:
        x.grad = None
    (2 * loss).backward()  # they are gone: the backward kernels
    for x, g in zip(xs, first):
        assert torch.equal(bits(x.grad), bits(2 * g))


def test_create_graph_differentiates_torch_formula():
    inputs = rand_triplet((64, 512), torch.float32, DEV, seed=10)
    xs = [x.clone().requires_grad_() for x in inputs]
    loss = fused_loss(*xs, swap=True, reduction="sum", forward=ONE_PASS)
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
    a, p, n = (x.requires_grad_() for x in rand_triplet((6, 32), torch.float32, DEV, seed=11))
    assert takes_one_pass((a, p, n))
    for reduction in ("mean", "sum"):
        fn = lambda *xs: fused_loss(*xs, margin=2.0, reduction=reduction, forward=ONE_PASS)
        with pytest.warns(UserWarning, match="double precision"):
            assert torch.autograd.gradcheck(fn, (a, p, n), eps=1e-2, atol=2e-3, rtol=1e-2,
                                            fast_mode=fast_mode)


def test_no_gradients_written_without_autograd():
    xs = [x.requires_grad_() for x in rand_triplet((4096, 256), torch.float32, DEV, seed=12)]
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            loss = ft.triplet_margin_loss(*xs)
            assert torch.cuda.memory_allocated() - before < xs[0].numel() * 4
        assert loss.grad_fn is None


def test_one_pass_asked_where_it_cannot_run():
    a, p, n = (x.requires_grad_() for x in rand_triplet((8, 64), torch.float32, DEV))
    with pytest.raises(RuntimeError, match="onepass forward takes p = 1 or 2"):
        fused_loss(a, p, n, p=3.0, forward=ONE_PASS)
    with pytest.raises(RuntimeError, match="onepass forward takes 2- and 4-byte elements"):
        fused_loss(a.double(), p.double(), n.double(), forward=ONE_PASS)
    with pytest.raises(RuntimeError, match="onepass forward takes 'mean' and 'sum'"):
        fused_loss(a, p, n, reduction="none", forward=ONE_PASS)
    with torch.no_grad(), pytest.raises(RuntimeError, match="where gradients are wanted"):
        fused_loss(a, p, n, forward=ONE_PASS)
