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
