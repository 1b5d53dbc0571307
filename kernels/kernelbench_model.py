"""fused_triplet's KernelBench file (level 1 problem 99: ModelNew(margin), a TripletMarginLoss).

Its kernels are the float32 forward for p = 2 without swap, called through ctypes (its build
compiles no torch headers); every other call (other dtypes or p, swap, gradients) takes the
torch formula, correct but not fused. Written by `python fused_triplet.py --export PATH
--kernelbench` from this template and the library's kernel sources, build and ModelNew (at
its placeholder lines); the library itself is `python fused_triplet.py --export PATH`. Within
KernelBench's static rules.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import inspect
import math
import os
import sys

import torch
from torch import Tensor

# @@ the library's kernel sources and build @@

BUILD_TIME = "about 8 s"  # the build of the float32 forward alone, without torch's headers

# ---------------------------------------------------------------------------------------------
# The forward: kernels/kernelbench_entry.cu's C function, through ctypes.
# ---------------------------------------------------------------------------------------------

_forward_entry = None
# The workspace each problem's plan asked for (device, rows, dim, strides, reduction: bytes), so
# that a repeated problem makes one call: KernelBench's timing sees a call's host time once it
# outlasts the L2 flush before it.
_workspace_bytes = {}
_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}


def _after_load(path: str) -> None:
    global _forward_entry
    library = ctypes.CDLL(path)
    entry = library.fused_triplet_kernelbench_forward
    pointer, i64, f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
    entry.argtypes = [pointer, pointer, pointer, i64, i64, i64, i64, i64, f64, f64, i64,
                      pointer, pointer, pointer, ctypes.POINTER(i64), pointer]
    entry.restype = ctypes.c_int
    library.fused_triplet_kernelbench_error.argtypes = [ctypes.c_int]
    library.fused_triplet_kernelbench_error.restype = ctypes.c_char_p
    entry.error = library.fused_triplet_kernelbench_error
    _forward_entry = entry


def _same_rank_broadcast(shapes) -> tuple | None:
    """torch's broadcast of equal-rank shapes, or None where they do not broadcast."""
    out = list(shapes[0])
    for shape in shapes[1:]:
        for i, size in enumerate(shape):
            if size != out[i] and 1 not in (size, out[i]):
                return None
            out[i] = size if out[i] == 1 else out[i]
    return tuple(out)


def _kernelbench_takes(anchor: Tensor, positive: Tensor, negative: Tensor, p: float,
                       swap: bool) -> bool:
    """What the kernels compute: float32 forwards for p = 2 without swap."""
    grads = torch.is_grad_enabled() and (anchor.requires_grad or positive.requires_grad
                                         or negative.requires_grad)
    return (anchor.dtype == positive.dtype == negative.dtype == torch.float32 and p == 2.0
            and not swap and not grads)


def _fused_shape(anchor: Tensor, positive: Tensor, negative: Tensor, p: float, swap: bool):
    """The common shape the kernels compute over, or None where the torch formula runs."""
    inputs = (anchor, positive, negative)
    if not (anchor.is_cuda and _kernelbench_takes(anchor, positive, negative, p, swap)
            and all(x.device == anchor.device and x.dim() == anchor.dim() for x in inputs)):
        return None
    shape = _same_rank_broadcast([tuple(x.shape) for x in inputs])
    return shape if shape else None


def _fused_forward(anchor: Tensor, positive: Tensor, negative: Tensor, margin: float,
                   eps: float, reduction: int) -> Tensor:
    build()
    batch, dim = anchor.shape[:-1], anchor.shape[-1]
    rows = math.prod(batch)
    loss = anchor.new_empty(batch if reduction == 0 else ())
    if rows == 0:  # torch: the mean of nothing is nan, the sum of nothing 0
        return loss.fill_(math.nan) if reduction == 1 else loss.zero_()
    # (rows, dim) views with unit element stride (a broadcast row keeps row stride 0)
    views = (anchor, positive, negative)
    if len(batch) != 1:
        views = tuple(x.reshape(rows, dim) for x in views)
    if dim > 1 and not views[0].stride(1) == views[1].stride(1) == views[2].stride(1) == 1:
        views = tuple(v.contiguous() if v.stride(1) != 1 else v for v in views)
    dists = anchor.new_empty((2, rows))
    strides = tuple(v.stride(0) for v in views)
    key = (anchor.device, rows, dim, strides, reduction)
    need = ctypes.c_int64(_workspace_bytes.get(key, 0))
    with torch.cuda.device(anchor.device):
        stream = torch.cuda.current_stream().cuda_stream
        args = [*(v.data_ptr() for v in views), *strides, rows, dim, float(margin), float(eps),
                reduction, loss.data_ptr(), dists.data_ptr()]
        for _ in range(2):  # the first call of a problem learns its plan's workspace
            workspace = torch.empty(need.value, dtype=torch.uint8, device=anchor.device)
            code = _forward_entry(*args, workspace.data_ptr(), ctypes.byref(need), stream)
            if code != -1:
                break
            _workspace_bytes[key] = need.value
    if code != 0:
        what = ("the kernels do not take this problem" if code < 0
                else _forward_entry.error(code).decode())
        raise RuntimeError(f"fused_triplet (KernelBench file): {what}")
    return loss


def _pairwise_distance(x1: Tensor, x2: Tensor, p: float, eps: float) -> Tensor:
    innermost_dim = max(x1.dim(), x2.dim()) - 1  # as ATen writes it (-1 for 0-d inputs)
    return torch.linalg.vector_norm(x1 - x2 + eps, p, dim=innermost_dim)


def _torch_formula(anchor, positive, negative, margin, p, eps, swap, reduction):
    """ATen's triplet_margin_loss in the tensor methods KernelBench's rules allow."""
    dist_pos = _pairwise_distance(anchor, positive, p, eps)
    dist_neg = _pairwise_distance(anchor, negative, p, eps)
    if swap:
        dist_neg = dist_neg.minimum(_pairwise_distance(positive, negative, p, eps))
    loss = (margin + dist_pos - dist_neg).clamp_min(0)
    return loss.mean() if reduction == 1 else loss.sum() if reduction == 2 else loss


# ---------------------------------------------------------------------------------------------
# What KernelBench calls (and torch's functional and module forms, for trying the file out).
# ---------------------------------------------------------------------------------------------


def triplet_margin_loss(anchor: Tensor, positive: Tensor, negative: Tensor, margin: float = 1.0,
                        p: float = 2.0, eps: float = 1e-6, swap: bool = False,
                        reduction: str = "mean") -> Tensor:
    """torch's functional triplet_margin_loss: the kernels where they take the inputs."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{reduction} is not a valid value for reduction")
    shape = _fused_shape(anchor, positive, negative, float(p), bool(swap))
    if shape is None:
        return _torch_formula(anchor, positive, negative, margin, p, eps, swap,
                              _REDUCTIONS[reduction])
    inputs = tuple(x.expand(shape) for x in (anchor, positive, negative))
    return _fused_forward(*inputs, margin, eps, _REDUCTIONS[reduction])


class TripletMarginLoss(torch.nn.Module):
    """torch's nn.TripletMarginLoss (its reduction names)."""

    def __init__(self, margin: float = 1.0, p: float = 2.0, eps: float = 1e-6, swap: bool = False,
                 reduction: str = "mean") -> None:
        super().__init__()
        self.margin, self.p, self.eps, self.swap, self.reduction = margin, p, eps, swap, reduction

    def forward(self, anchor: Tensor, positive: Tensor, negative: Tensor) -> Tensor:
        """The loss of the triplets (anchor[i], positive[i], negative[i])."""
        return triplet_margin_loss(anchor, positive, negative, self.margin, self.p, self.eps,
                                   self.swap, self.reduction)


# @@ the library's ModelNew @@
if __name__ == "__main__":
    if sys.argv[1:] != ["--build"]:
        sys.exit(f"usage: python {os.path.basename(__file__)} --build")
    problem = _build_problem()
    if problem:
        sys.exit(problem)
    print(build(verbose=True))
