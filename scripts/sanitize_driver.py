"""A small run of every kernel family, for compute-sanitizer (scripts/sanitize.sh).

First what the plans pick: teams of 8, 32 and 256 threads, split rows and the finishing kernel,
the unaligned (scalar) path, every norm kind, swap, each reduction, forward and backward. Then
each family asked for where it can run (forward rows and ring; backward rows and pointwise; the
one-pass training forward with its check, predicting right and wrong), p = 2 and 1, upstream
gradients 1 and 0.5: contiguous, strided and split rows, whole fp16/bf16 rows (the ring's 4 KiB
chunks), a row whose last chunk is 16 bytes, a short last slice, float32 rows in the ring's tiles
(teams of 8 and 32, rows ending mid-stage, a last row group not full, strided). Then the in-batch
mining kernels, forward and backward: one embedding, one label, anchors without positives,
uneven labels, odd dims, batch_hard's 16-byte Gram loads, fp32 and bf16.

    python scripts/sanitize_driver.py [PART ...]   (plans, rows, ring, onepass, mining; default all)

scripts/sanitize.sh runs each part in a process of its own: under racecheck the tool's host
memory grows with every launch, and the parts together outgrew a 128 GiB host.
"""
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fused_triplet as ft  # noqa: E402

torch.manual_seed(0)
ops = ft._ops()


def can_run(xs, pnorm, families):
    """Whether the families asked for take these inputs."""
    try:
        ft._internal_ops().describe_plans(*xs, pnorm, True, *families)
    except RuntimeError:
        return False
    return True


def step(xs, families=(-1, -1), p=2.0, swap=False):
    plain = -1 if families[0] == 2 else families[0]  # the one pass is for training calls
    for reduction in (0, 1, 2):
        ops.triplet_margin_loss(*xs, 1.0, p, 1e-6, swap, reduction, False, plain)
    for weight in (1.0, 1.0, 0.5, 0.5, 0.5):  # the one pass predicting right, wrong, none, right
        leaves = [x.detach().requires_grad_() for x in xs]
        loss = ops.triplet_margin_loss(*leaves, 1.0, p, 1e-6, swap, 1, False, *families)[0]
        (weight * loss).backward()


def plans():
    for shape in [(37, 3), (64, 257), (128, 8), (64, 100), (9, 3000), (4, 8192), (3, 20000)]:
        for offset in (0, 1):  # 1: misaligned storage, the scalar path
            base = [torch.rand(shape[0] * shape[1] + offset, device="cuda") for _ in range(3)]
            xs = [x[offset:].view(shape) for x in base]
            for pnorm in (2.0, 1.0, math.inf, 3.0):
                for swap in (False, True):
                    step(xs, p=pnorm, swap=swap)


def families_asked(families):
    cases = []  # (shape, width of the storage rows, dtype)
    cases += [((4200, 1024), 1024, torch.float32), ((1500, 3000), 3008, torch.float32),
              ((40001, 100), 100, torch.float32), ((9003, 300), 304, torch.float32),
              ((3, 1500000), 1500004, torch.float32), ((2, 20008), 20008, torch.float32)]
    cases += [((4, 8192), 8192, d) for d in (torch.bfloat16, torch.float16)]
    cases += [((4, 4104), 4104, torch.bfloat16), ((3, 20000), 20000, torch.bfloat16),
              ((64, 2048), 2048, torch.float64)]
    for shape, width, dtype in cases:
        xs = [torch.rand(shape[0], width, device="cuda", dtype=dtype)[:, :shape[1]]
              for _ in range(3)]
        for pnorm in (2.0, 1.0):
            if can_run(xs, pnorm, families):
                step(xs, families, p=pnorm, swap=True)


def mining_kernels():
    # 1028: batch_hard's 16-byte loads of the Gram rows (batch % 4 == 0, every thread a group).
    # batch_all not there: its backward's column sums reach torch's multi-block sum, whose staging
    # buffer initcheck reports as uninitialized (torch.rand(1028, 1028).sum(0) alone does too).
    for batch, dim, labels_of in [(1, 4, 1), (2, 3, 2), (5, 64, 1), (97, 33, 7), (300, 129, 40),
                                  (1028, 40, 100)]:
        for dtype in (torch.float32, torch.bfloat16):
            e = torch.randn(batch, dim, device="cuda", dtype=dtype, requires_grad=True)
            labels = torch.randint(0, labels_of, (batch,), device="cuda")
            for mining in ("batch_hard", "batch_all") if batch < 1024 else ("batch_hard",):
                ft.mined_triplet_margin_loss(e, labels, mining).backward()


PARTS = {"plans": plans, "rows": lambda: families_asked((0, 0)),
         "ring": lambda: families_asked((1, 1)), "onepass": lambda: families_asked((2, -1)),
         "mining": mining_kernels}
for name in sys.argv[1:] or PARTS:
    PARTS[name]()
torch.cuda.synchronize()
print("sanitize driver: done")
