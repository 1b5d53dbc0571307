"""A small run of every kernel family, for compute-sanitizer (scripts/sanitize.sh).

Forward: teams of 8, 32 and 256 threads, the bulk-copy kernel (4 x 8192), split rows and their
combining kernel (3 x 20000), the scalar (unaligned) path, every norm kind, swap, each
reduction; backward for the same (aligned contiguous rows take the pointwise backward for
p = 2 / 1: (128, 8), (64, 100), (9, 3000), (4, 8192), (3, 20000)); then, p = 2 / 1 only: the
pointwise backward over 16 MiB per input ((4200, 1024): short rows; (2, 2100000): few long
rows) and the row ring (strided rows of >= 8 KiB: (1500, 3000) of a (1500, 3008) tensor; and
split: (3, 1500000) of (3, 1500004)); the forward's short-rows ring (>= 128 MiB per input of
1 KiB or 4 KiB rows); last, bf16 through the bulk forward's 2-byte rings: whole rows
(4 x 4 KiB), a row whose last chunk is 16 bytes, split rows (4 x 8 KiB; the last slice a part
chunk).
"""
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fused_triplet as ft  # noqa: E402

torch.manual_seed(0)
shapes = [(37, 3), (64, 257), (128, 8), (64, 100), (9, 3000), (4, 8192), (3, 20000)]
for shape in shapes:
    for offset in (0, 1):  # 1: misaligned storage, the scalar path
        base = [torch.rand(shape[0] * shape[1] + offset, device="cuda") for _ in range(3)]
        a, p, n = (x[offset:].view(shape) for x in base)
        for pnorm in (2.0, 1.0, math.inf, 3.0):
            for swap in (False, True):
                for reduction in ("none", "mean", "sum"):
                    ft.triplet_margin_loss(a, p, n, p=pnorm, swap=swap, reduction=reduction)
                xs = [x.detach().requires_grad_() for x in (a, p, n)]  # same offsets
                ft.triplet_margin_loss(*xs, p=pnorm, swap=swap).backward()
for shape, width in [((4200, 1024), 1024), ((2, 2100000), 2100000),  # > 16 MiB (fp32)
                     ((1500, 3000), 3008), ((3, 1500000), 1500004)]:  # strided: the row ring
    xs = [torch.rand(shape[0], width, device="cuda").requires_grad_() for _ in range(3)]
    for pnorm in (2.0, 1.0):
        ft.triplet_margin_loss(*(x[:, :shape[1]] for x in xs), p=pnorm, swap=True).backward()
for shape in [(131075, 256), (32771, 1024)]:  # the forward's short-rows ring; last chunk part
    xs = [torch.rand(shape, device="cuda") for _ in range(3)]
    for reduction in ("none", "mean"):
        ft.triplet_margin_loss(*xs, swap=True, reduction=reduction)
for shape in [(4, 8192), (4, 4104), (3, 20000)]:  # bf16: 2 x 4 KiB + 16 B for 4104
    xs = [torch.rand(shape, device="cuda").bfloat16().requires_grad_() for _ in range(3)]
    for reduction in ("none", "mean"):
        ft.triplet_margin_loss(*xs, swap=True, reduction=reduction).sum().backward()
torch.cuda.synchronize()
print("sanitize driver: done")
