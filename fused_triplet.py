"""fused_triplet: a fused CUDA TripletMarginLoss for PyTorch (nn.TripletMarginLoss, fused).

One kernel reads anchor, positive and negative once and writes the per-sample losses (and the
distances a backward needs); 'mean'/'sum' add one tiny deterministic reduction kernel. The
backward kernel reads them once more and writes the gradients. Eager PyTorch instead
materialises `x1 - x2 + eps` (B x D) for each distance.

Layout of this file: kernel sources -> build -> op registration (fake kernels) -> argument
handling -> public API (triplet_margin_loss, TripletMarginLoss, ModelNew) -> in-batch mining
(mined_triplet_margin_loss, MinedTripletMarginLoss; one op per loss on CUDA, a chunked torch
reference elsewhere) -> drop-ins for sentence-transformers' and pytorch-metric-learning's
triplet losses (on the mined op where it computes them, their formulas in torch elsewhere) and
gather_across_ranks -> export (this file with its sources inlined, or the benchmark file: its
template's own part, the first two sections and ModelNew) -> command line.

Semantics are torch's (see README.md): d(x, y) = ||x - y + eps||_p over the last dim,
loss_i = max(margin + d(a_i, p_i) - d(a_i, n_i), 0), swap uses min(d(a, n), d(p, n)).
CUDA inputs of a floating dtype go to the fused kernels (forward and backward); everything
else (CPU tensors, integer or complex dtypes, 0-d inputs, shapes that broadcast unusually)
goes to torch's own triplet_margin_loss.
"""

from __future__ import annotations

import atexit
import functools
import glob
import hashlib
import inspect
import math
import os
import sys

import torch
from torch import Tensor
from torch.nn import _reduction as _torch_reduction

__version__ = "0.1.0"
__all__ = ["triplet_margin_loss", "TripletMarginLoss", "mined_triplet_margin_loss",
           "MinedTripletMarginLoss", "BatchHardTripletLoss", "BatchHardSoftMarginTripletLoss",
           "BatchAllTripletLoss", "BatchSemiHardTripletLoss",
           "BatchHardTripletLossDistanceFunction", "pml_triplet_loss", "gather_across_ranks",
           "ModelNew", "build", "export"]

# ---------------------------------------------------------------------------------------------
# Kernel sources: every file of kernels/, read at import: the .cu files (and the headers they
# include) go to nvcc, the .cpp files (and theirs) to the host compiler. An exported single file
# (export() below) holds them inline instead, as a dict literal on the line `KERNEL_SOURCES = ...`.
# ---------------------------------------------------------------------------------------------


def _kernel_folder() -> str | None:
    """kernels/ beside this file (or fused_triplet_kernels/, as pip installs it), if there."""
    here = os.path.dirname(os.path.abspath(__file__))
    folders = [os.path.join(here, name) for name in ("kernels", "fused_triplet_kernels")]
    return next((f for f in folders if os.path.isdir(f)), None)


def _read_kernel_sources() -> dict:
    """{file name: text} for the sources of the kernel folder; {} if there is none (the CPU path
    still works; build() says what to do)."""
    folder = _kernel_folder()
    if folder is None:
        return {}
    names = sorted(f for f in os.listdir(folder) if f.endswith((".h", ".cuh", ".cu", ".cpp")))
    sources = {}
    for name in names:
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            sources[name] = f.read()
    return sources


KERNEL_SOURCES = _read_kernel_sources()


def _expand(name: str) -> str:
    """A source file with each local #include "x" replaced by x's text (headers keep their
    include guards), so the sources can be compiled from strings."""
    lines = []
    for line in KERNEL_SOURCES[name].splitlines():
        if line.lstrip().startswith('#include "'):
            lines.append(_expand(line.split('"')[1]))
        else:
            lines.append(line)
    return f"// ---- {name}\n" + "\n".join(lines) + "\n"


def cuda_source() -> str:
    """What nvcc compiles: the .cu files with their headers (no torch headers)."""
    return "".join(_expand(n) for n in KERNEL_SOURCES if n.endswith(".cu"))


def cpp_source() -> str:
    """What the host compiler compiles: the torch-facing .cpp files with their headers."""
    return "".join(_expand(n) for n in KERNEL_SOURCES if n.endswith(".cpp"))


# ---------------------------------------------------------------------------------------------
# Build: torch.utils.cpp_extension.load_inline, cached under torch's extension dir; the name
# carries a hash of the sources, the flags and the torch version, so a changed source (or another
# torch) builds anew and an unchanged one loads the cached library.
# ---------------------------------------------------------------------------------------------

# The torch-facing C++ is launch plumbing: -O1 compiles it 14% sooner than -O2 (it set the first
# build's pace) with host-bound steps unchanged (docs/performance.md).
CXX_FLAGS = ["-O1"]
# A first build on 2 cores for one architecture (ninja compiles the CUDA file and the
# torch-facing C++ side by side; the CUDA file takes longer).
BUILD_TIME = "about 30 s"
_library_path = None


def _nvcc_flags() -> list:
    # FUSED_TRIPLET_PTXAS_VERBOSE=1: ptxas reports registers and spills (tests/test_build.py).
    verbose = ["-Xptxas=-v"] if os.environ.get("FUSED_TRIPLET_PTXAS_VERBOSE") == "1" else []
    # nvcc's -O is the host code's (the device code is the same cubin at any level): the CUDA
    # file's host side is launch plumbing too, and its host compile ends the CUDA file's build.
    return ["-O1", "-lineinfo"] + verbose


def _nvcc_release(toolkit: str):
    """(major, minor) of the toolkit's nvcc, or None where it says none."""
    import re
    import subprocess

    out = subprocess.run([os.path.join(toolkit, "bin", "nvcc"), "--version"],
                         capture_output=True, text=True).stdout
    found = re.search(r"release (\d+)\.(\d+)", out)
    return (int(found.group(1)), int(found.group(2))) if found else None


def _parallel_flags(release) -> list:
    """nvcc 12+ optimizes the kernels on every core (--split-compile; the same binary), so the
    first build takes a fraction of the time on a many-core host. Not in the extension's name:
    a library built either way loads the same."""
    return ["--split-compile=0"] if release and release[0] >= 12 else []


def _extension_name() -> str:
    # torch's version too: a library built against another torch must not be loaded.
    key = cuda_source() + cpp_source() + " ".join(_nvcc_flags() + CXX_FLAGS) + torch.__version__
    return "fused_triplet_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _toolkit_problem(cuda_home) -> str | None:
    """Why the CUDA toolkit torch found cannot build the kernels, or None if it can."""
    if not cuda_home or not os.path.exists(os.path.join(cuda_home, "bin", "nvcc")):
        return f"no CUDA toolkit found (CUDA_HOME={cuda_home!r})"
    libs = [os.path.join(cuda_home, d) for d in ("lib64", "lib")]
    if not any(os.path.isdir(d) and any(f.startswith("libcudart.so") for f in os.listdir(d))
               for d in libs):
        return (f"{cuda_home} has bin/nvcc but no lib64/libcudart.so (a wrapper script's "
                "folder rather than the toolkit's?)")
    return None


def _find_toolkit(cpp_extension):
    """The CUDA toolkit folder to build with, and why none can (None when one can). An explicit
    $CUDA_HOME is taken as it is; without one, the folder torch found (from the nvcc on PATH,
    which may be a wrapper script elsewhere) and then /usr/local/cuda, /usr/local/cuda-*."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"], _toolkit_problem(os.environ["CUDA_HOME"])
    candidates = [cpp_extension.CUDA_HOME, "/usr/local/cuda"]
    candidates += sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for folder in candidates:
        if folder and _toolkit_problem(folder) is None:
            return folder, None
    return cpp_extension.CUDA_HOME, _toolkit_problem(cpp_extension.CUDA_HOME)


def _default_build_root() -> str:
    """torch's extension cache, as torch.utils.cpp_extension.get_default_build_root() gives it,
    without importing that module."""
    import torch._appdirs

    return os.path.realpath(torch._appdirs.user_cache_dir(appname="torch_extensions"))


def _unwritable(path: str) -> bool:
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return not (os.path.isdir(path) and os.access(path, os.W_OK))


def _build_location():
    """(name, folder, library, marker) of this torch's build of the sources: under
    $TORCH_EXTENSIONS_DIR, else torch's extension cache; the marker is written once the library
    is whole."""
    name = _extension_name()
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or _default_build_root()
    folder = os.path.join(root, name)
    return name, folder, os.path.join(folder, name + ".so"), os.path.join(folder, "fused_triplet.built")


def _cpp_extension(verbose: bool):
    """torch.utils.cpp_extension, imported only to compile (it imports setuptools and probes
    CUDA). Its import-time notice that no GPU is visible only with verbose: the build's own line
    says which toolkit and architectures it uses."""
    import logging

    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    if not verbose:
        log.setLevel(logging.ERROR)
    from torch.utils import cpp_extension
    log.setLevel(level)
    return cpp_extension


def _target_archs(environ=None) -> str:
    """The architectures a build compiles for, as torch's extension builder picks them (in the
    environment `environ`, default this process's)."""
    listed = (os.environ if environ is None else environ).get("TORCH_CUDA_ARCH_LIST")
    if listed:
        archs = listed.replace(",", ";").replace(" ", ";").split(";")
        return ", ".join("sm_" + a.split("+")[0].replace(".", "") for a in archs if a)
    caps = sorted({torch.cuda.get_device_capability(d) for d in range(torch.cuda.device_count())})
    return ", ".join(f"sm_{major}{minor}" for major, minor in caps) or "no GPU visible"


def _build_problem(cpp_extension=None) -> str | None:
    """Why build() cannot load or compile the kernels here, or None if it can."""
    if not KERNEL_SOURCES:
        return ("fused_triplet: the CUDA sources are missing: keep the kernels/ folder beside "
                "fused_triplet.py, or use the one-file export (python fused_triplet.py --export "
                "PATH)")
    _, folder, library, marker = _build_location()
    if os.path.exists(marker) and os.path.exists(library):
        return None
    toolkit, problem = _find_toolkit(cpp_extension or _cpp_extension(False))
    if problem:
        return (f"fused_triplet: compiling the CUDA kernels needs the CUDA toolkit: {problem}. "
                "Set CUDA_HOME to the toolkit's folder (the one with bin/nvcc and "
                "lib64/libcudart.so). CPU tensors do not need it.")
    if not torch.cuda.is_available() and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return ("fused_triplet: no GPU visible to build for: set TORCH_CUDA_ARCH_LIST (e.g. 9.0 "
                "for an H100/H200) to compile anyway")
    if _unwritable(folder):
        return (f"fused_triplet: cannot write the build folder {folder}: set "
                "TORCH_EXTENSIONS_DIR to a writable folder")
    return None


def build(verbose: bool = False) -> str:
    """Compile (the first time only) and load the CUDA ops; returns the shared library's path.

    Called on first CUDA use. Builds under $TORCH_EXTENSIONS_DIR, else torch's extension cache.
    A library already built there for these sources and this torch loads without a toolkit.
    """
    if _library_path is not None:
        return _library_path
    name, folder, library, marker = _build_location() if KERNEL_SOURCES else (None,) * 4
    if marker and os.path.exists(marker) and os.path.exists(library):
        # Built before for these sources and this torch: load it directly (no toolkit needed,
        # none of load_inline's checks).
        torch.ops.load_library(library)
        return _finish_loading(library)
    cpp_extension = _cpp_extension(verbose) if KERNEL_SOURCES else None
    problem = _build_problem(cpp_extension)
    if problem:
        raise RuntimeError(problem)
    toolkit, _ = _find_toolkit(cpp_extension)
    os.makedirs(folder, exist_ok=True)
    cpp_extension.CUDA_HOME = toolkit  # load_inline reads nvcc and libcudart from here
    release = _nvcc_release(toolkit)
    if not os.path.exists(library):
        cuda = f"CUDA {release[0]}.{release[1]}" if release else toolkit
        print(f"fused_triplet: compiling its CUDA kernels for {_target_archs()} with {cuda} "
              f"({BUILD_TIME}, once; later imports load the built library)...", file=sys.stderr,
              flush=True)
    # Only the headers each side includes itself (torch's implicit ones cost most of the build).
    implicit = "no_implicit_headers" in inspect.signature(cpp_extension.load_inline).parameters
    path = cpp_extension.load_inline(
        name=name,
        cpp_sources=cpp_source(),
        cuda_sources=cuda_source(),
        extra_cflags=CXX_FLAGS,
        extra_cuda_cflags=_nvcc_flags() + _parallel_flags(release),
        build_directory=folder,
        is_python_module=False,
        verbose=verbose,
        **({"no_implicit_headers": True} if implicit else {}),
    )
    with open(marker + f".{os.getpid()}", "w") as f:
        f.write(path + "\n")
    os.replace(marker + f".{os.getpid()}", marker)
    return _finish_loading(path)


# torch.compile runs build() at trace time and keeps the result (a first call inside a compiled
# function loads the ops instead of tracing the build): the mark torch.compiler.
# assume_constant_result sets, set here without importing Dynamo (seconds at import).
build._dynamo_marked_constant = True


def _finish_loading(path: str) -> str:
    global _library_path
    if _library_path is None:  # set first: a concurrent first call must not register twice
        _library_path = path
        _after_load(path)  # what the module holding this section does with its library
    return path


# ---------------------------------------------------------------------------------------------
# Op registration: the schemas, CUDA kernels and autograd (whose backward is the fused backward
# op) live in C++ (kernels/registration.cpp registers every op); the fake kernels (shapes and
# dtypes only, for torch.compile and FakeTensor) and the clamp_min convention the backward
# follows are registered here once the library is loaded.
# ---------------------------------------------------------------------------------------------


def _hinge_passes_at_zero() -> bool:
    """Whether the installed torch's clamp_min passes the gradient at exactly its bound (torch up
    to 2.13 does, 2.14 does not); the fused backward does the same. Autograd on for the probe:
    the library loads on first use, which may come under no_grad or inference_mode."""
    with torch.inference_mode(False), torch.enable_grad():
        x = torch.zeros((), requires_grad=True)
        (grad,) = torch.autograd.grad(x.clamp_min(0), x)
    return bool(grad != 0)


def _triplet_fake(anchor, positive, negative, margin, p, eps, swap, reduction,
                  float32_loss=False, forward_family=-1, backward_family=-1):
    batch = anchor.shape[:-1]
    acc_dtype = torch.float64 if anchor.dtype == torch.float64 else torch.float32
    two_byte = anchor.dtype in (torch.float16, torch.bfloat16)
    loss = anchor.new_empty(batch if reduction == 0 else (),
                            dtype=torch.float32 if float32_loss and two_byte else anchor.dtype)
    dists = anchor.new_empty((3 if swap else 2, math.prod(batch)), dtype=acc_dtype)
    return loss, dists


def _triplet_backward_fake(grad, anchor, positive, negative, dists, margin, p, eps, swap,
                           reduction, hinge_at_zero, output_mask, family=-1):
    return tuple(x.new_empty(x.shape) if needed else x.new_empty((0,))
                 for x, needed in zip((anchor, positive, negative), output_mask))


def _mine_batch_hard_fake(embeddings, labels, eps, count_labels=True):
    batch = embeddings.shape[0]
    return labels.new_empty(batch), labels.new_empty(batch), labels.new_empty(batch, dtype=torch.bool)


def _mined_loss_fake(embeddings, labels, mining, margin, eps, reduction, for_backward=False,
                     distance=0, hinge=0, counting=0, band=0, band_margin=0.0, references=0):
    batch = embeddings.shape[0]
    floats = dict(dtype=torch.float32)
    loss = embeddings.new_empty(batch if reduction == 0 else (), **floats)
    if mining == 0:
        state = embeddings.new_empty((4, batch), dtype=torch.float64)
    else:
        whole = batch <= _MINING_WHOLE_ROWS[mining]
        if for_backward and whole:  # the weights
            state = embeddings.new_empty((batch, batch), **floats)
        elif for_backward and reduction != 0:  # the gradient for an upstream gradient of 1
            state = embeddings.new_empty((batch, embeddings.shape[1]), dtype=torch.float64)
        else:
            state = embeddings.new_empty((0, 0), **floats)
    return loss, embeddings.new_empty((), **floats), state


def _mined_loss_backward_fake(grad, embeddings, labels, count, state, mining, margin, eps,
                              reduction, hinge_at_zero, distance=0, hinge=0, counting=0, band=0,
                              band_margin=0.0, references=0):
    return embeddings.new_empty(embeddings.shape)


_TRIPLET_OP = None  # torch.ops.fused_triplet.triplet_margin_loss.default, once loaded
# per mining, the largest batch whose kernels stay whole with a reference set (from the plan;
# batch_all's whole batch, its saved weights, the same without one)
_MINING_WHOLE_ROWS = []


def _after_load(path: str) -> None:
    """The Python parts of the ops, once their library is loaded."""
    global _TRIPLET_OP
    internal = torch.ops.fused_triplet_internal
    internal.set_hinge_at_zero(_hinge_passes_at_zero())  # the C++ side keeps it
    atexit.register(internal.release_step_state)  # the one pass's device memory, while CUDA is up
    _TRIPLET_OP = torch.ops.fused_triplet.triplet_margin_loss.default
    torch.library.register_fake("fused_triplet::triplet_margin_loss")(_triplet_fake)
    torch.library.register_fake("fused_triplet::triplet_margin_loss_backward")(
        _triplet_backward_fake)
    torch.library.register_fake("fused_triplet_internal::mine_batch_hard")(_mine_batch_hard_fake)
    torch.library.register_fake("fused_triplet::mined_triplet_loss")(_mined_loss_fake)
    torch.library.register_fake("fused_triplet::mined_triplet_loss_backward")(
        _mined_loss_backward_fake)
    _MINING_WHOLE_ROWS[:] = [internal.mining_whole_rows(m) for m in (0, 1, 2)]


def _ops():
    build()
    return torch.ops.fused_triplet


def _internal_ops():
    """The library's plumbing and the tests' views of the plans (not ops users call)."""
    build()
    return torch.ops.fused_triplet_internal


# ---------------------------------------------------------------------------------------------
# Argument handling, as torch's functional triplet_margin_loss does it (torch's own helpers where
# it has them); inputs the kernels do not take go to torch's triplet_margin_loss itself.
# ---------------------------------------------------------------------------------------------

_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _reduction_enum(size_average, reduce, reduction) -> int:
    if size_average is not None or reduce is not None:
        reduction = _torch_reduction.legacy_get_string(size_average, reduce)
    return _torch_reduction.get_enum(reduction)  # torch's ValueError and deprecation warning


def _type_name(value) -> str:
    kind = type(value)
    return kind.__name__ if kind.__module__ in ("builtins", "torch") else \
        f"{kind.__module__}.{kind.__name__}"


def _is_float_arg(value) -> bool:
    """What torch's argument parser takes for a float: Python and NumPy reals, 0-d tensors."""
    if isinstance(value, (int, float)):
        return True
    if isinstance(value, Tensor):
        return value.dim() == 0
    return type(value).__module__ == "numpy" and getattr(value, "dtype", None) is not None \
        and value.dtype.kind in "biuf" and getattr(value, "ndim", 1) == 0


def _check_options(margin, p, eps, swap, function="triplet_margin_loss") -> None:
    """torch's TypeError for an option of the wrong type (margin's comparison came first); the
    mined function's options sit at the same positions."""
    for position, name, value in ((4, "margin", margin), (5, "p", p), (6, "eps", eps)):
        if not _is_float_arg(value):
            raise TypeError(f"{function}(): argument '{name}' (position {position}) must "
                            f"be float, not {_type_name(value)}")
    if not isinstance(swap, bool):
        raise TypeError(f"{function}(): argument 'swap' (position 7) must be bool, not "
                        f"{_type_name(swap)}")


def _check_tensors(anchor, positive, negative) -> None:
    for position, (name, value) in enumerate(
            (("anchor", anchor), ("positive", positive), ("negative", negative)), start=1):
        if not isinstance(value, Tensor):
            raise TypeError(f"triplet_margin_loss(): argument '{name}' (position {position}) must "
                            f"be Tensor, not {type(value).__name__}")


def _fused_shape(anchor: Tensor, positive: Tensor, negative: Tensor, p: float):
    """The common shape the fused kernels would compute over, or None if they don't take these
    inputs (torch's own function then computes them, or raises its error). Checks in the order
    that keeps a plain call's host time short."""
    if not anchor.is_cuda:
        return None
    device = anchor.device
    if positive.device != device or negative.device != device:
        return None
    if not (anchor.dtype in _FUSED_DTYPES and positive.dtype in _FUSED_DTYPES
            and negative.dtype in _FUSED_DTYPES):
        return None
    shape = anchor.shape
    if not shape == positive.shape == negative.shape:
        if not anchor.dim() == positive.dim() == negative.dim():
            return None
        try:
            shape = torch.broadcast_shapes(shape, positive.shape, negative.shape)
        except RuntimeError:  # torch's own function raises its error
            return None
    if len(shape) == 0 or (shape[-1] == 0 and math.isinf(p)):
        return None
    return tuple(shape)


def _fused_triplet_margin_loss(anchor, positive, negative, shape, margin, p, eps, swap, reduction):
    """The fused op on inputs _fused_shape() took. Under CUDA autocast the op's autocast kernel
    gives 2-byte inputs a float32 loss, as torch's float32 policy for this op does."""
    inputs = (anchor, positive, negative)
    if not anchor.dtype == positive.dtype == negative.dtype:
        dtype = torch.promote_types(torch.promote_types(anchor.dtype, positive.dtype),
                                    negative.dtype)
        inputs = tuple(x.to(dtype) for x in inputs)
    if not anchor.shape == positive.shape == negative.shape:
        # views: a broadcast row becomes row stride 0 in the kernel
        inputs = tuple(x.expand(shape) for x in inputs)
    args = (*inputs, float(margin), float(p), float(eps), bool(swap), reduction)
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (
            anchor.requires_grad or positive.requires_grad or negative.requires_grad)):
        return _ops().triplet_margin_loss(*args)[0]
    # No gradient wanted: go straight to the CUDA kernel, past the op's autograd kernel (host
    # work only, but small inputs take less GPU time than the host spends per call).
    op = _TRIPLET_OP if _TRIPLET_OP is not None else _ops().triplet_margin_loss.default
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)[0]


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def triplet_margin_loss(anchor: Tensor, positive: Tensor, negative: Tensor, margin: float = 1.0,
                        p: float = 2.0, eps: float = 1e-6, swap: bool = False,
                        size_average: bool | None = None, reduce: bool | None = None,
                        reduction: str = "mean") -> Tensor:
    """Drop-in for torch's functional triplet_margin_loss (same arguments, results, errors)."""
    reduction_enum = _reduction_enum(size_average, reduce, reduction)
    if margin <= 0:
        raise ValueError(f"margin must be greater than 0, got {margin}")
    _check_tensors(anchor, positive, negative)
    _check_options(margin, p, eps, swap)
    shape = _fused_shape(anchor, positive, negative, float(p))
    if shape is not None:
        return _fused_triplet_margin_loss(anchor, positive, negative, shape, margin, p, eps, swap,
                                          reduction_enum)
    return torch.nn.functional.triplet_margin_loss(
        anchor, positive, negative, margin, p, eps, swap,
        reduction=("none", "mean", "sum")[reduction_enum])


class TripletMarginLoss(torch.nn.Module):
    """Drop-in for torch's nn.TripletMarginLoss module (same constructor and forward)."""

    __constants__ = ["margin", "p", "eps", "swap", "reduction"]

    def __init__(self, margin: float = 1.0, p: float = 2.0, eps: float = 1e-6, swap: bool = False,
                 size_average=None, reduce=None, reduction: str = "mean") -> None:
        super().__init__()
        if size_average is not None or reduce is not None:
            reduction = _torch_reduction.legacy_get_string(size_average, reduce)
        if margin <= 0:
            raise ValueError(
                f"TripletMarginLoss: expected margin to be greater than 0, got {margin} instead")
        self.margin = margin
        self.p = p
        self.eps = eps
        self.swap = swap
        self.reduction = reduction

    def forward(self, anchor: Tensor, positive: Tensor, negative: Tensor) -> Tensor:
        """The loss of the triplets (anchor[i], positive[i], negative[i]): inputs of one shape
        (..., D), or shapes that broadcast as torch's; see triplet_margin_loss."""
        return triplet_margin_loss(anchor, positive, negative, margin=self.margin, p=self.p,
                                   eps=self.eps, swap=self.swap, reduction=self.reduction)

    def extra_repr(self) -> str:
        return (f"margin={self.margin}, p={self.p}, eps={self.eps}, swap={self.swap}, "
                f"reduction={self.reduction!r}")


class ModelNew(torch.nn.Module):
    """KernelBench level 1 problem 99: the per-sample loss kernel, then the mean."""

    def __init__(self, margin: float = 1.0) -> None:
        super().__init__()
        self.margin = margin

    def forward(self, anchor: Tensor, positive: Tensor, negative: Tensor) -> Tensor:
        """The mean triplet margin loss (p = 2, eps = 1e-6), as the problem's Model."""
        return triplet_margin_loss(anchor, positive, negative, margin=self.margin)


# ---------------------------------------------------------------------------------------------
# In-batch mining: the triplets of a labelled batch, found inside it. On CUDA (p = 2, 2-byte and
# float32 embeddings) each loss is the op mined_triplet_loss, its autograd in C++
# (kernels/mining_ops.cpp); everything else runs the torch reference below, in chunks of anchors.
# ---------------------------------------------------------------------------------------------

_MININGS = ("batch_hard", "batch_all")  # the ops' mining codes: 0, 1
_MINING_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_REFERENCE_CHUNK_ELEMENTS = 1 << 24  # the reference's largest per-chunk tensor (64 MiB of float)
# The CPU path's thresholds (their measurements: docs/performance.md, "In-batch mining").
# batch^2 x dim below which CPU mining takes every difference instead of Gram products: fewer
# operations. batch_all's in float64, below 2^18 (float64 differences lose to the products from
# about 2^19); batch_hard's torch's own, below 2^21 and 80 rows (from 80 rows the products'
# bounds cost less); float64 rows' below 2^19 (twice the bytes)
_CPU_DIFFERENCES_BELOW = 1 << 18
_CPU_HARD_DIFFERENCES_BELOW = {torch.float32: 1 << 21, torch.float64: 1 << 19}
_CPU_HARD_DIFFERENCE_ROWS_BELOW = 80
# batch^2 x dim below which float64 batch_all keeps torch's (rows, batch, dim) differences for
# autograd (1 MiB; recomputing them is host time); from it every difference by cdist, the
# gradient from products of the centred rows, faster than autograd's through cdist (float64
# rows take every difference: Gram products would not reach their rounding)
_CPU_FEW_DIFFERENCES = 1 << 17
# batch_all's sums from this many columns search only the positives' thresholds (each row's
# columns holding them, from a topk of the mask), not every column's; below, the topk, sort and
# gathers cost more than the searches they save
_CPU_POSITIVES_SEARCHED_FROM = 128
# rows x batch^2 up to which batch_all's sums take every triplet one by one (20 rows): fewer
# operations than the sort and prefix sums
_CPU_EVERY_TRIPLET_UP_TO = 1 << 13


def _every_difference(x: Tensor, mining: str) -> bool:
    """Whether CPU mining takes every difference of this batch (the thresholds above)."""
    size = x.shape[0] ** 2 * x.shape[1]
    if mining == "batch_hard":
        return (x.shape[0] < _CPU_HARD_DIFFERENCE_ROWS_BELOW
                and size < _CPU_HARD_DIFFERENCES_BELOW[x.dtype])
    return size < _CPU_DIFFERENCES_BELOW


def _check_mining_inputs(embeddings, labels, mining, margin, p, eps, reduction) -> None:
    name = "mined_triplet_margin_loss"
    if not isinstance(embeddings, Tensor) or not isinstance(labels, Tensor):
        raise TypeError(f"{name}: embeddings and labels must be tensors, got "
                        f"{_type_name(embeddings)} and {_type_name(labels)}")
    if mining not in _MININGS:
        raise ValueError(f"{name}: mining must be 'batch_hard' or 'batch_all', got {mining!r}")
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"{reduction} is not a valid value for reduction")
    _check_options(margin, p, eps, False, name)
    if not margin > 0:
        raise ValueError(f"{name}: margin must be a number greater than 0, got {margin!r}")
    if embeddings.dim() != 2:
        raise ValueError(f"{name}: expected embeddings of shape (batch, dim), got shape "
                         f"{tuple(embeddings.shape)}")
    if not embeddings.is_floating_point():
        raise TypeError(f"{name}: expected floating-point embeddings, got {embeddings.dtype}")
    if labels.dim() != 1 or labels.shape[0] != embeddings.shape[0]:
        raise ValueError(f"{name}: expected labels of shape ({embeddings.shape[0]},) for "
                         f"{embeddings.shape[0]} embeddings, got shape {tuple(labels.shape)}")
    if labels.is_floating_point() or labels.is_complex():
        raise TypeError(f"{name}: expected integer labels, got {labels.dtype}")
    if labels.device != embeddings.device:
        raise RuntimeError(f"{name}: embeddings and labels must be on one device, got "
                           f"{embeddings.device} and {labels.device}")


def _mining_takes(embeddings: Tensor, p: float) -> bool:
    """Whether the mining kernels take these embeddings (else the torch reference runs)."""
    return (embeddings.is_cuda and p == 2.0
            and embeddings.dtype in _MINING_DTYPES and embeddings.numel() > 0)


def _row_chunks(batch: int, per_row: int):
    step = max(1, _REFERENCE_CHUNK_ELEMENTS // max(per_row, 1))
    return [(start, min(start + step, batch)) for start in range(0, batch, step)]


def _distances_from(x: Tensor, start: int, stop: int, p: float, eps: float) -> Tensor:
    """torch's pairwise_distance of rows start:stop of x to every row: (stop - start, batch),
    its bits (its norm of x_i - x_j + eps) with eps added in place: one (rows, batch, dim)
    temporary, not two (on CPU a second one past a few MiB is page-faulted in every call)."""
    differences = x[start:stop, None, :] - x[None, :, :]
    return torch.linalg.vector_norm(differences.add_(eps), p, dim=-1)


def _label_masks(labels: Tensor, ref_labels: Tensor, first: int | None) -> tuple:
    """(positives, negatives) of the anchors' labels against ref_labels, as (anchors, refs)
    masks. first: where the anchors start among the refs when the refs are the batch itself (an
    anchor is not its own positive); None for a reference set of other rows."""
    same = labels[:, None] == ref_labels[None, :]
    negatives = ~same
    if first is not None:
        same.diagonal(first).fill_(False)  # (i, first + i): the anchor itself
    return same, negatives


def _first_extreme(d: Tensor, mask: Tensor, largest: bool) -> Tensor:
    """Per row, the first column of `mask` holding the row's largest (smallest) d; NaN is the
    extreme, as torch's max and min propagate it."""
    masked = d.masked_fill(~mask, -math.inf if largest else math.inf)
    extreme = masked.amax(1, keepdim=True) if largest else masked.amin(1, keepdim=True)
    hit = mask & ((masked == extreme) | (masked.isnan() & extreme.isnan()))
    return hit.view(torch.uint8).argmax(1)  # the first hit


@functools.lru_cache(maxsize=64)  # a tensor and its item each call otherwise
def _torch_eps(eps: float, dtype: torch.dtype) -> float:
    """eps as torch's pairwise_distance adds it to rows of dtype: rounded to it."""
    return float(torch.tensor(eps, dtype=dtype))


def _gram_squares(x: Tensor, centred: Tensor, norms: Tensor, start: int, stop: int,
                  eps: float) -> tuple:
    """|x_i - x_j + eps|^2 of rows start:stop against every row, differentiable, from float64
    Gram products of the centred rows c (norms: their squared norms) as |c_i + eps|^2 + |c_j|^2
    - 2 c_i.c_j - 2 eps sum(c_j) (no rows x dim temporaries); and |c_i + eps|^2 of rows
    start:stop, whose sums with norms our roundings stay within _gram_rounding(dim) of."""
    eps = _torch_eps(eps, x.dtype)
    totals = centred.sum(1)
    shifted = norms[start:stop] + eps * (2 * totals[start:stop] + x.shape[1] * eps)
    squares = torch.addmm(norms - 2 * eps * totals, centred[start:stop], centred.t(), alpha=-2)
    return squares.add_(shifted[:, None]), shifted


def _gram_rounding(dim: int) -> float:
    """Our roundings of |a - b|^2 over |a~|^2 + |b~|^2: 2 dim + 16 of a product's (c_i.c_j, not
    (c_i + eps).c_j: twice; the centring's among the 16), with room."""
    return 2.4 * (2 * dim + 16) * 2.0 ** -53


def _squares_and_bounds(x: Tensor, centred: Tensor, norms: Tensor, start: int, stop: int,
                        eps: float) -> tuple:
    """_gram_squares's squares and how far torch's pairwise_distance(x_i, x_j, 2, eps)^2 in x's
    dtype can lie from them: our roundings and torch's (the difference, eps, the sum of squares,
    the root; an underflow an element), with (a + b)^2 <= 2 a^2 + 2 b^2 where that saves a
    pass, and a square at most twice its sum (plus our rounding)."""
    dim, facts = x.shape[1], torch.finfo(x.dtype)
    squares, shifted = _gram_squares(x, centred, norms, start, stop, eps)
    ours = _gram_rounding(dim)
    theirs = 1.2 * (dim + 8) * facts.eps / 2  # of (2 sqrt(squares + ours) + sqrt(dim) eps)^2
    per_sum = ours * (1 + 8 * theirs) + 8 * theirs * (2 + ours)
    constant = theirs * 2 * dim * eps ** 2 + 4 * (dim + 1) * facts.tiny
    bound = (shifted * per_sum + constant)[:, None] + norms * per_sum
    return squares, bound


def _first_extremes(x: Tensor, start: int, positives: Tensor, negatives: Tensor,
                    eps: float) -> tuple:
    """Per row of the candidate masks (rows start:stop of x against every row), the first column
    holding the largest of torch's pairwise_distance (p = 2) among its positive candidates and
    the smallest among its negative ones: a row's only candidate as it is, the distances
    computed for rows with several (any column for a row without one)."""
    candidates = torch.cat([positives, negatives])  # both at once: half the operations
    chosen = candidates.view(torch.uint8).argmax(1)  # a row's first candidate, no copy
    several = (candidates.sum(1) > 1).nonzero()[:, 0]
    if len(several):
        rows, cols = candidates[several].nonzero(as_tuple=True)  # a row's columns ascending
        places = several[rows]
        anchors = places % len(positives) + start
        step = max(1, _REFERENCE_CHUNK_ELEMENTS // max(x.shape[1], 1))
        d = torch.cat([torch.pairwise_distance(x[anchors[s:s + step]], x[cols[s:s + step]],
                                               2.0, eps) for s in range(0, len(rows), step)])
        d = torch.where(places < len(positives), d, -d)  # a smallest d is a largest -d
        best = d.new_full((len(several),), -math.inf).scatter_reduce(0, rows, d, "amax")
        first = torch.where(d == best[rows], cols, candidates.shape[1])
        chosen[several] = torch.full_like(several, candidates.shape[1]).scatter_reduce(
            0, rows, first, "amin")
    return chosen[:len(positives)], chosen[len(positives):]


def _bounded_hardest(x: Tensor, centred: Tensor, norms: Tensor, start: int, stop: int,
                     eps: float, is_positive: Tensor, is_negative: Tensor) -> tuple:
    """Rows start:stop's hardest positive and negative by torch's pairwise_distance (p = 2),
    computed only where float64 Gram bounds leave the choice open (ties and near-ties)."""
    squares, bound = _squares_and_bounds(x, centred, norms, start, stop, eps)
    lower, upper = squares - bound, squares.add_(bound)
    floor = torch.where(is_positive, lower, -math.inf).amax(1, keepdim=True)
    ceiling = torch.where(is_negative, upper, math.inf).amin(1, keepdim=True)
    return _first_extremes(x, start, is_positive & (upper >= floor),
                           is_negative & (lower <= ceiling), eps)


def _centred_rows(x: Tensor, p: float, eps: float, every_difference: bool = False):
    """(x's rows in float64 less their mean, their squared norms) for distances from Gram
    products (float64 rows: from every difference, the gradient from the products): on CPU (on a
    GPU the index lists of the pairs left open would sync), p = 2, rows and eps finite and well
    inside x's dtype's range (torch's sums of squares must not overflow); else None. A float
    batch that takes every difference (_every_difference) reads no products: (None, None); a
    float64 one below _CPU_FEW_DIFFERENCES takes torch's own differences: None."""
    limit = torch.finfo(x.dtype).max / 64
    if x.device.type != "cpu" or p != 2 or not x.shape[1] * eps * eps < limit:  # NaN fails
        return None
    if every_difference:  # |a - b + eps|^2 <= dim (2 max |x| + eps)^2
        if x.dtype == torch.float64 and x.shape[0] ** 2 * x.shape[1] < _CPU_FEW_DIFFERENCES:
            return None  # torch's own differences, whatever the rows' range
        reach = 2.0 * float(x.abs().amax() if x.numel() else 0) + eps
        if not x.shape[1] * reach * reach < limit:
            return None
        if x.dtype != torch.float64:  # float rows: autograd's gradient through cdist
            return None, None
    centred = x.to(torch.float64, copy=True)
    centred -= centred.mean(0)
    norms = torch.linalg.vector_norm(centred, dim=1).square()
    return (centred, norms) if every_difference or bool((norms < limit).all()) else None


def _reference_batch_hard(x: Tensor, labels: Tensor, p: float, eps: float) -> tuple:
    """(positive, negative, valid) per anchor by torch's pairwise_distance, one chunk of anchors
    at a time; the anchor itself where it has no positive or no negative. The distances only
    where float64 Gram bounds leave the choice open where _centred_rows allows and the batch
    is not small (else every (anchor, row) difference: batch x batch x dim)."""
    batch = x.shape[0]
    positive = torch.empty(batch, dtype=torch.long, device=x.device)
    negative = torch.empty_like(positive)
    valid = torch.empty(batch, dtype=torch.bool, device=x.device)
    with torch.no_grad():
        gram = None if _every_difference(x, "batch_hard") else _centred_rows(x, p, eps)
        for start, stop in _row_chunks(batch, batch if gram else batch * x.shape[1]):
            is_positive, is_negative = _label_masks(labels[start:stop], labels, start)
            if gram:
                positive[start:stop], negative[start:stop] = _bounded_hardest(
                    x, *gram, start, stop, eps, is_positive, is_negative)
            else:
                d = _distances_from(x, start, stop, p, eps)
                positive[start:stop] = _first_extreme(d, is_positive, largest=True)
                negative[start:stop] = _first_extreme(d, is_negative, largest=False)
            valid[start:stop] = is_positive.any(1) & is_negative.any(1)
    anchors = torch.arange(batch, device=x.device)
    return torch.where(valid, positive, anchors), torch.where(valid, negative, anchors), valid


class _GramDistances(torch.autograd.Function):
    """Rows start:stop of torch's pairwise_distance (p = 2) to every row from float64 Gram
    products of the centred rows (_gram_squares), 0 at the close pairs (where the products'
    rounding could reach 2^-30 of the square; returned as a mask, less the diagonal, whose
    distances no loss reads); for float64 rows from every difference of the centred rows, the
    close pairs those within sqrt(1/8) of their norms. The backward: with V = grad / d, sum_j
    V_ij (c_i - c_j + eps) to row i and its opposite to row j, as two products with the centred
    rows in float64 (one, of V + V^T, for the whole batch; the centring's own gradient sums to 0:
    distances do not move with a common shift)."""

    @staticmethod
    def forward(ctx, x: Tensor, centred: Tensor, norms: Tensor, start: int, stop: int,
                eps: float) -> tuple:
        ctx.start, ctx.eps = start, _torch_eps(eps, x.dtype)
        if x.dtype == torch.float64:  # centred rows: eps rounds at their scale, as torch's
            roots = _every_distance(centred, start, stop, eps)
            # the products' gradient rounds with the rows' norms: torch's distance where they
            # pass 8 x its square (duplicates: only eps apart)
            close = norms[start:stop, None] + norms >= roots.square() * 8
            roots.masked_fill_(close, 0.0)
        else:
            squares, shifted = _gram_squares(x, centred, norms, start, stop, eps)
            close = (_gram_rounding(x.shape[1]) * (shifted[:, None] + norms)
                     >= squares * 2.0 ** -30)
            roots = squares.masked_fill_(close, 0.0).sqrt_()
        ctx.save_for_backward(centred, roots, close)
        exact = close.clone()
        exact.diagonal(start).fill_(False)
        ctx.mark_non_differentiable(exact)
        return roots.to(x.dtype), exact

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor, _):
        centred, roots, close = ctx.saved_tensors
        weights = (grad.double() / roots).masked_fill_(close, 0.0)
        anchors = centred[ctx.start:ctx.start + len(roots)]
        by_row, by_column = weights.sum(1, keepdim=True), weights.sum(0).unsqueeze(1)
        if len(roots) == len(centred):  # the whole batch: one product, of V + V^T
            rows_grad = torch.addmm((by_row - by_column) * ctx.eps, weights + weights.t(),
                                    centred, alpha=-1)
            rows_grad.addcmul_(centred, by_row + by_column)
            return rows_grad.to(grad.dtype), None, None, None, None, None
        # in place: fewer batch x dim temporaries (each a page-faulting allocation on CPU)
        rows_grad = torch.addmm(by_column * -ctx.eps, weights.t(), anchors, alpha=-1)
        rows_grad.addcmul_(centred, by_column)
        own = rows_grad[ctx.start:ctx.start + len(roots)]
        own.addmm_(weights, centred, alpha=-1).addcmul_(anchors, by_row).add_(by_row * ctx.eps)
        return rows_grad.to(grad.dtype), None, None, None, None, None


def _part(t: Tensor, start: int, stop: int) -> Tensor:
    """t[start:stop], or t itself when that is all of it (no slice, nor its backward's copy)."""
    return t if start == 0 and stop == len(t) else t[start:stop]


def _every_distance(x: Tensor, start: int, stop: int, eps: float) -> Tensor:
    """Rows start:stop of torch's pairwise_distance (p = 2) to every row from every difference in
    float64 (float rows' differences are exact there), without batch x batch x dim temporaries."""
    rows = x.double()
    return torch.cdist(_part(rows, start, stop) + _torch_eps(eps, x.dtype), rows,
                       compute_mode="donot_use_mm_for_euclid_dist")


def _row_distances(x: Tensor, gram, start: int, stop: int, p: float, eps: float) -> Tensor:
    """Rows start:stop of torch's pairwise_distance to every row, differentiable. With gram
    (_centred_rows's, without a graph): every difference in float64 (_GramDistances's for float64
    rows), or float64 Gram products (no batch x batch x dim differences); torch's own at the
    close pairs, an anchor's own distance 0."""
    if gram is None:
        return _distances_from(x, start, stop, p, eps)
    if gram[0] is None:  # float rows' every difference: autograd's gradient, fewest operations
        return _every_distance(x, start, stop, eps).to(x.dtype)
    far, close = _GramDistances.apply(x, *gram, start, stop, eps)
    rows, cols = close.nonzero(as_tuple=True)
    if not len(rows):
        return far
    return far.index_put((rows, cols), torch.pairwise_distance(x[start + rows], x[cols], 2.0,
                                                               eps))


def _each_triplet(d: Tensor, is_positive: Tensor, is_negative: Tensor, margin: float) -> tuple:
    """_TripletSums's per row sums, counts and weights taken triplet by triplet: rows x batch^2
    (inf and NaN propagate as relu's value and derivative do)."""
    triplets = is_positive[:, :, None] & is_negative[:, None, :]
    gaps = margin + d[:, :, None] - d[:, None, :]
    each = torch.where(triplets, gaps.relu(), 0.0)
    passes = triplets & ~(gaps <= 0)  # relu's derivative: NaN passes
    return each.sum((1, 2)), (each > 0).sum((1, 2)), (passes.sum(2) - passes.sum(1)).to(d.dtype)


def _sorted_triplet_sums(d: Tensor, is_positive: Tensor, is_negative: Tensor,
                         margin: float) -> tuple:
    """_each_triplet's sums, counts and weights from each row's negatives sorted by distance: the
    negatives closer than margin + d_ij are a prefix of them, so each positive adds a count and a
    prefix sum (O(B log B) an anchor, not B^2); a negative's weight is minus the positives whose
    margin reaches past it. Rows with a distance that is not finite go to _each_triplet."""
    negatives, order = torch.where(is_negative, d, math.inf).sort(1)  # the others last
    places, thresholds, positive = None, margin + d, is_positive
    if d.shape[1] >= _CPU_POSITIVES_SEARCHED_FROM:  # only the positives' thresholds searched:
        # each row's k columns holding them (k the most a row has; other columns fill the rest)
        places = is_positive.view(torch.uint8).topk(int(is_positive.sum(1).max()), 1).indices
        places = places.sort(1).values  # in column order, as the losses' sums take them
        thresholds, positive = thresholds.gather(1, places), is_positive.gather(1, places)
    counts = torch.searchsorted(negatives, thresholds).mul_(positive)  # negatives < it
    prefix = torch.nn.functional.pad(negatives.cumsum(1), (1, 0))
    losses = (counts * thresholds - prefix.gather(1, counts)).sum(1)  # 0 where counts are
    active = counts.sum(1)
    # the negative at sorted place r takes minus the positives whose count passes r
    reached = torch.zeros_like(prefix, dtype=counts.dtype).scatter_add_(
        1, counts, torch.ones_like(counts)).cumsum_(1)  # counts <= r
    passing = torch.empty_like(order).scatter_(1, order, counts.shape[1] - reached[:, :-1])
    weights = (counts - passing if places is None else
               passing.neg_().scatter_add_(1, places, counts)).to(d.dtype)
    if not math.isfinite(d.sum()):  # rows with a distance that is not finite
        finite = torch.where(is_positive | is_negative, d, 0.0).isfinite().all(1)
        rows = (~finite).nonzero()[:, 0]
        losses[rows], active[rows], weights[rows] = _each_triplet(
            d[rows], is_positive[rows], is_negative[rows], margin)
    return losses, active, weights


class _TripletSums(torch.autograd.Function):
    """Per anchor row of d: the sum of relu(margin + d_ij - d_ik) over its triplets (positive j,
    negative k) and how many are > 0, triplet by triplet in small batches, else from sorted
    rows (_sorted_triplet_sums). The backward is the anchor's gradient times each entry's count
    (a positive's negatives inside its margin; minus, for a negative, the positives whose margin
    reaches past it)."""

    @staticmethod
    def forward(ctx, d: Tensor, is_positive: Tensor, is_negative: Tensor, margin: float) -> tuple:
        small = d.shape[0] * d.shape[1] ** 2 <= _CPU_EVERY_TRIPLET_UP_TO
        losses, active, weights = (_each_triplet if small else _sorted_triplet_sums)(
            d, is_positive, is_negative, margin)
        ctx.save_for_backward(weights)
        ctx.mark_non_differentiable(active)
        return losses, active

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor, _):
        (weights,) = ctx.saved_tensors
        return weights * grad[:, None], None, None, None


def _batch_all_rows(x: Tensor, gram, labels: Tensor, start: int, stop: int, margin: float,
                    p: float, eps: float) -> tuple:
    """Anchors start:stop: each one's sum of relu(margin + d_ap - d_an) over its triplets, and
    how many are > 0 (_TripletSums)."""
    d = _row_distances(x, gram, start, stop, p, eps)
    return _TripletSums.apply(d, *_label_masks(_part(labels, start, stop), labels, start), margin)


def _reference_batch_all(x: Tensor, labels: Tensor, margin: float, p: float, eps: float) -> tuple:
    """(loss, active) per anchor. float64 rows take every difference (Gram products would not
    reach their rounding). A chunk's (rows, batch, dim) differences (but a few), or its (rows,
    batch) distances where the batch takes several chunks, are recomputed in the backward
    (checkpoint) instead of kept."""
    from torch.utils.checkpoint import checkpoint

    gram = _centred_rows(x.detach(), p, eps,
                         x.dtype == torch.float64 or _every_difference(x, "batch_all"))
    per_row = x.shape[0] * (4 if gram else x.shape[1])  # a chunk's float64 (rows, batch) tensors
    chunks = _row_chunks(x.shape[0], per_row)
    kept = gram or x.shape[0] ** 2 * x.shape[1] < _CPU_FEW_DIFFERENCES  # what autograd may keep
    parts = [_batch_all_rows(x, gram, labels, start, stop, margin, p, eps)
             if kept and len(chunks) == 1 else
             checkpoint(_batch_all_rows, x, gram, labels, start, stop, margin, p, eps,
                        use_reentrant=False)
             for start, stop in chunks]
    if not parts:  # an empty batch: still in the graph, so that backward() runs
        return x.sum(1) * 0, torch.zeros(0, dtype=torch.long, device=x.device)
    if len(parts) == 1:  # no cat: one node fewer for autograd
        return parts[0]
    return torch.cat([loss for loss, _ in parts]), torch.cat([count for _, count in parts])


def mined_triplet_margin_loss(embeddings: Tensor, labels: Tensor, mining: str = "batch_hard",
                              margin: float = 1.0, p: float = 2.0, eps: float = 1e-6,
                              reduction: str = "mean") -> Tensor:
    """Triplet margin loss over the triplets mined inside a labelled batch.

    embeddings (B, D), labels (B,) of an integer dtype. d(i, j) is torch's pairwise_distance
    (eps inside the norm); positives of anchor i: j != i with its label, negatives: other labels.
    batch_hard: loss_i = max(margin + max_j d(i, j) - min_k d(i, k), 0) for anchors with both
    ('mean' over them). batch_all: every (i, j, k), relu(margin + d(i, j) - d(i, k)); 'none' is
    each anchor's sum, 'mean' the sum over the triplets > 0 (0 when none). The loss is float32
    (float64 for float64 embeddings); gradients follow autograd of these formulas."""
    _check_mining_inputs(embeddings, labels, mining, margin, p, eps, reduction)
    margin, p, eps = float(margin), float(p), float(eps)
    if _mining_takes(embeddings, p):
        return _ops().mined_triplet_loss(embeddings, labels.long(), _MININGS.index(mining), margin,
                                         eps, _reduction_enum(None, None, reduction))[0]
    losses, counted = _mined_losses(embeddings, labels.long(), mining, margin, p, eps)
    if reduction == "none":
        return losses
    total = losses.sum()
    return total if reduction == "sum" else total / counted.clamp_min(1)


def _mined_losses(embeddings: Tensor, labels: Tensor, mining: str, margin: float, p: float,
                  eps: float) -> tuple:
    """The torch reference: (per-anchor losses, what 'mean' divides by), the losses in float32
    (float64 for float64 embeddings), differentiable."""
    x = embeddings if embeddings.dtype == torch.float64 else embeddings.float()
    if mining == "batch_all":
        losses, active = _reference_batch_all(x, labels, margin, p, eps)
        return losses, active.sum()
    positive, negative, valid = _reference_batch_hard(x.detach(), labels, p, eps)
    if x.device.type == "cpu" and p == 2:  # on a GPU the backward's index_add has atomics
        return _hardest_hinges(x, positive, negative, valid, margin, eps), valid.sum()
    losses = triplet_margin_loss(x, x[positive], x[negative], margin=margin, p=p, eps=eps,
                                 reduction="none")
    return torch.where(valid, losses, 0.0), valid.sum()


def _hardest_hinges(x: Tensor, positive: Tensor, negative: Tensor, valid: Tensor, margin: float,
                    eps: float) -> Tensor:
    """Per row of x torch's triplet_margin_loss (p = 2) with its chosen positive and negative
    row, 0 where not valid, differentiable through _HardestHinges (no batch x dim gathers in
    the graph)."""
    with torch.no_grad():
        d = torch.stack([torch.pairwise_distance(x, x.index_select(0, positive), 2.0, eps),
                         torch.pairwise_distance(x, x.index_select(0, negative), 2.0, eps)])
        scales = d.reciprocal().nan_to_num_(nan=math.nan, posinf=0.0)  # 0 at 0, as the norm's
    return _HardestHinges.apply(x, d[0], d[1], torch.stack([positive, negative]), scales, valid,
                                margin, _torch_eps(eps, x.dtype))


class MinedTripletMarginLoss(torch.nn.Module):
    """mined_triplet_margin_loss as a module: forward(embeddings, labels)."""

    def __init__(self, mining: str = "batch_hard", margin: float = 1.0, p: float = 2.0,
                 eps: float = 1e-6, reduction: str = "mean") -> None:
        super().__init__()
        if mining not in _MININGS:
            raise ValueError(
                f"MinedTripletMarginLoss: mining must be 'batch_hard' or 'batch_all', got {mining!r}")
        self.mining, self.margin, self.p, self.eps = mining, margin, p, eps
        self.reduction = reduction

    def forward(self, embeddings: Tensor, labels: Tensor) -> Tensor:
        """The loss of the triplets mined in the batch: embeddings (B, D), integer labels (B,);
        see mined_triplet_margin_loss."""
        return mined_triplet_margin_loss(embeddings, labels, mining=self.mining,
                                         margin=self.margin, p=self.p, eps=self.eps,
                                         reduction=self.reduction)

    def extra_repr(self) -> str:
        return (f"mining={self.mining!r}, margin={self.margin}, p={self.p}, eps={self.eps}, "
                f"reduction={self.reduction!r}")


# ---------------------------------------------------------------------------------------------
# Drop-ins for the libraries' triplet losses: sentence-transformers' Batch*TripletLoss classes and
# pytorch-metric-learning's TripletMarginLoss with its miners. Their formulas, values and
# gradients (ties to the lowest index), without their batch^3 tensors: the (anchor, positive)
# pairs go a chunk at a time against their anchors' rows of distances. Neither library is
# imported; their objects are read by class name and attributes.
# ---------------------------------------------------------------------------------------------

_PAIR_CHUNK_ELEMENTS = 1 << 22  # (pairs x batch) per chunk of the pair losses: 16 MiB of float
# batch^2 x dim from which the hard losses' torch path differentiates only the chosen distances:
# below it the index ops cost more than the batch x batch products they save (2 CPU cores)
_ST_CHOSEN_ENTRIES_FROM = 1 << 21
# rows up to which semi-hard sorts each row's negatives (one sort and search, the batch at once)
# rather than gathering its (anchor, positive) pairs' rows: 0.86-0.91x the step at 16-48 rows,
# 0.96x at 64; 1.09x at 80 and 1.2-2x from 96 (the sort's batch^2 log batch against batch x pairs)
_ST_SORTED_SEMI_HARD_ROWS = 64


def _st_rows(embeddings: Tensor, cosine: bool) -> Tensor:
    """The rows whose Gram products give sentence-transformers' distances: the embeddings, unit
    rows for cosine; 2-byte embeddings in float32 (its cos_sim and euclidean distance both)."""
    narrow = embeddings.dtype in (torch.float16, torch.bfloat16)
    rows = embeddings.float() if narrow else embeddings
    return torch.nn.functional.normalize(rows, dim=1) if cosine else rows


def _st_gram(rows: Tensor, cosine: bool) -> Tensor:
    """rows @ rows.T as the library takes it: euclidean's with autocast off."""
    if cosine:
        return rows @ rows.t()
    with torch.autocast(device_type=rows.device.type, enabled=False):
        return rows @ rows.t()


def _st_distances(gram: Tensor, cosine: bool, squared: bool = False) -> Tensor:
    """sentence-transformers' distances from the Gram matrix of _st_rows: 1 - cos clamped at 0,
    0 on the diagonal; or |b|^2 - 2 a.b + |a|^2 with negatives set to 0, and its root, whose
    gradient is 0 at exactly 0."""
    if cosine:
        is_self = torch.eye(len(gram), dtype=torch.bool, device=gram.device)
        return (1 - gram).clamp_min(0.0).masked_fill(is_self, 0.0)
    norms = gram.diagonal()
    squares = norms.unsqueeze(0) - 2.0 * gram + norms.unsqueeze(1)
    squares = torch.where(squares < 0, 0.0, squares)
    if squared:
        return squares
    zero = squares == 0
    return torch.where(zero, 0.0, (squares + zero * 1e-16).sqrt())


def _st_euclidean_distance(embeddings: Tensor, squared: bool = False) -> Tensor:
    """sentence-transformers' euclidean distances: from the Gram matrix (autocast off)."""
    return _st_distances(_st_gram(_st_rows(embeddings, False), False), False, squared)


def _st_cosine_distance(embeddings: Tensor) -> Tensor:
    """sentence-transformers' cosine distances: 1 - cos, clamped at 0, the diagonal 0."""
    return _st_distances(_st_gram(_st_rows(embeddings, True), True), True)


class BatchHardTripletLossDistanceFunction:
    """sentence-transformers' distance functions for the Batch*TripletLoss drop-ins (its own are
    recognised by name)."""
    cosine_distance = staticmethod(_st_cosine_distance)
    euclidean_distance = staticmethod(_st_euclidean_distance)
    eucledian_distance = euclidean_distance


def _st_distance_of(metric, owner: str):
    name = getattr(metric, "__name__", "")
    if "BatchHardTripletLossDistanceFunction" in getattr(metric, "__qualname__", "") or \
            metric in (_st_cosine_distance, _st_euclidean_distance):
        if name in ("euclidean_distance", "eucledian_distance", "_st_euclidean_distance"):
            return _st_euclidean_distance
        if name in ("cosine_distance", "_st_cosine_distance"):
            return _st_cosine_distance
    raise ValueError(f"{owner}: distance_metric must be BatchHardTripletLossDistanceFunction's "
                     f"euclidean_distance or cosine_distance (sentence-transformers' or this "
                     f"module's), got {metric!r}")


def _pair_chunks(positives: Tensor):
    """The (anchor, positive) index pairs of the mask, in chunks whose rows of the distance
    matrix stay within _PAIR_CHUNK_ELEMENTS."""
    anchors, refs = positives.nonzero(as_tuple=True)
    step = max(1, _PAIR_CHUNK_ELEMENTS // max(positives.shape[1], 1))
    return [(anchors[s:s + step], refs[s:s + step]) for s in range(0, len(anchors), step)]


def _hinge(x: Tensor, smooth: bool) -> Tensor:
    return torch.nn.functional.softplus(x) if smooth else x.relu()


class _SentenceTransformersTripletLoss(torch.nn.Module):
    """What the four sentence-transformers drop-ins share: the model, the distance, the calls."""

    _FUSED = None  # the mined op's mining, hinge and counting for this loss, where it has them

    def __init__(self, model, distance_metric, margin) -> None:
        super().__init__()
        self.sentence_embedder = model
        self.distance_metric = distance_metric
        self.triplet_margin = margin
        self._distance = _st_distance_of(distance_metric, type(self).__name__)

    def forward(self, sentence_features, labels: Tensor) -> Tensor:
        """The loss of the model's sentence embeddings of sentence_features[0] (a dict of model
        inputs) with these labels, as sentence-transformers' class computes it."""
        embedding = self.sentence_embedder(sentence_features[0])["sentence_embedding"]
        return self.compute_loss_from_embeddings([embedding], labels)

    def compute_loss_from_embeddings(self, embeddings: list, labels: Tensor) -> Tensor:
        """The loss of embeddings[0] (batch, dim) with labels (batch,) of any dtype."""
        x = embeddings[0]
        if labels.numel() != x.shape[0]:
            raise ValueError(f"{type(self).__name__} expects {x.shape[0]} labels (one per "
                             f"example), but got {labels.numel()} labels with shape "
                             f"{tuple(labels.shape)}.")
        labels = labels.reshape(-1)
        if self._FUSED is not None and _mining_takes(x, 2.0):
            cosine = self._distance is _st_cosine_distance
            margin = 0.0 if self.triplet_margin is None else float(self.triplet_margin)
            return _library_loss_on_the_op(x, labels, _COSINE if cosine else _EUCLIDEAN,
                                           margin, *self._FUSED)
        return self._torch_loss(x, labels)

    def _torch_loss(self, x: Tensor, labels: Tensor) -> Tensor:
        return self._loss(self._distance(x), labels)


# The mined op's distance codes: |a - b| (eps 0), cosine 1 - cos (|a - b|^2 / 2 of unit rows), and
# |a - b| of unit rows (the op scales the rows itself: one launch where torch's takes a dozen).
_EUCLIDEAN, _COSINE, _UNIT_EUCLIDEAN = 0, 3, 2


def _library_loss_on_the_op(x: Tensor, labels: Tensor, distance: int, margin: float,
                            mining: int, hinge: int, counting: int, band: int = 0,
                            band_margin: float = 0.0, references: int = 0) -> Tensor:
    """A library's loss ('mean') as the mined op computes it on exact distances (a similarity's
    order is its distance's reverse); labels as int64 ids (equal where they compare equal); the
    last `references` rows a reference set."""
    if labels.is_floating_point() or labels.is_complex():
        labels = labels.unique(return_inverse=True)[1]
    return _ops().mined_triplet_loss(x, labels.long(), mining, margin, 0.0, 1, False,
                                     distance, hinge, counting, band, band_margin, references)[0]


class _HardestDistances(torch.autograd.Function):
    """The hardest positive and negative distance per anchor (sentence-transformers'), as found
    on distances computed without a graph. The backward is autograd's of the distance for the
    entries (anchor, chosen) that take the gradient (the positive's, the negative's, and the
    row's largest), times `scales` (the masks and the distance's derivative there), by
    _chosen_rows_gradient."""

    @staticmethod
    def forward(ctx, rows: Tensor, positive: Tensor, negative: Tensor, chosen: Tensor,
                scales: Tensor, cosine: bool) -> tuple:
        ctx.save_for_backward(rows, chosen, scales)
        ctx.cosine = cosine
        return positive, negative

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, positive_grad: Tensor, negative_grad: Tensor):
        rows, chosen, scales = ctx.saved_tensors
        grads = torch.stack([positive_grad, negative_grad, negative_grad][:len(chosen)])
        return (_chosen_rows_gradient(rows, chosen, scales * grads, ctx.cosine, 0.0),
                None, None, None, None, None)


class _HardestHinges(torch.autograd.Function):
    """max(margin + positive - negative, 0) per row, 0 where not valid, of torch's distances
    (eps inside the norm) found without a graph, as one autograd node: the gradient passes
    where the hinge's argument is >= 0 (clamp_min's) and the row is valid."""

    @staticmethod
    def forward(ctx, rows: Tensor, positive: Tensor, negative: Tensor, chosen: Tensor,
                scales: Tensor, valid: Tensor, margin: float, eps: float) -> Tensor:
        gaps = margin + positive - negative
        ctx.save_for_backward(rows, chosen, scales, valid & (gaps >= 0))
        ctx.eps = eps
        return torch.where(valid, gaps.clamp_min(0), 0.0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        rows, chosen, scales, passes = ctx.saved_tensors
        passed = torch.where(passes, grad, 0.0)
        weights = scales * torch.stack([passed, -passed])
        return (_chosen_rows_gradient(rows, chosen, weights, False, ctx.eps),
                None, None, None, None, None, None, None)


def _chosen_rows_gradient(rows: Tensor, chosen: Tensor, weights: Tensor, cosine: bool,
                          eps: float) -> Tensor:
    """The gradient to rows of the distances d(row i, row chosen[k, i]) (weights[k, i]: the
    upstream gradient times the distance's derivative factor): each entry's to its two rows,
    summed by index_add in index order, not through gathers or batch x batch products."""
    weights = weights.unsqueeze(2)
    picked = rows.index_select(0, chosen.reshape(-1)).view(*chosen.shape, rows.shape[1])
    if cosine:  # 1 - a.b: a gets -b, b gets -a (the sign is in weights)
        terms = weights * rows
        rows_grad = picked.mul_(weights).sum(0)
    else:  # |a - b + eps|: a gets (a - b + eps) / d, b the opposite (1 / d is in weights)
        terms = picked.sub_(rows)
        if eps:
            terms.sub_(eps)
        terms.mul_(weights)
        rows_grad = terms.sum(0).neg_()
    rows_grad.index_add_(0, chosen.reshape(-1), terms.reshape(-1, rows.shape[1]))
    return rows_grad


def _st_extremes(d: Tensor, labels: Tensor) -> tuple:
    """The library's max and min over the rows of d: (positive, negative, largest) as (values,
    indices) per row (the largest's of shape (batch, 1)), and the (positives, negatives) masks."""
    positives, negatives = _label_masks(labels, labels, 0)
    positive = (positives * d).max(1)
    largest = d.max(1, keepdim=True)
    negative = (d + largest.values * (~negatives)).min(1)
    return positive, negative, largest, positives, negatives


def _st_hardest(x: Tensor, labels: Tensor, distance) -> tuple:
    """sentence-transformers' hardest pair per anchor: the largest positive distance (0 without
    positives) and the smallest negative one, each other row counting as the row's largest
    distance more (so an anchor without negatives gets about its largest distance). On CPU past
    _ST_CHOSEN_ENTRIES_FROM, with finite distances, the library's values are found without a
    graph and autograd reaches only the entries the library's max and min pass theirs to."""
    cosine = distance is _st_cosine_distance
    if x.device.type == "cpu" and x.shape[0] ** 2 * x.shape[1] >= _ST_CHOSEN_ENTRIES_FROM:
        rows = _st_rows(x, cosine)
        with torch.no_grad():
            gram = _st_gram(rows, cosine)
            d = _st_distances(gram, cosine)
            extremes = _st_extremes(d, labels)
        # a row's largest distance is NaN or inf where any of its distances is: then the
        # library's graph, which spreads them as the library does
        if bool(extremes[2].values.isfinite().all()):
            return _chosen_distances(rows, gram, d, cosine, *extremes)
    # the library's own graph on a GPU too (the backward's index_add would add with atomics)
    positive, negative, *_ = _st_extremes(distance(x), labels)
    return positive.values, negative.values


def _chosen_distances(rows: Tensor, gram: Tensor, d: Tensor, cosine: bool, positive, negative,
                      largest, positives: Tensor, negatives: Tensor) -> tuple:
    """_st_hardest's pair from the distances d of rows (Gram products gram) and their extremes,
    all computed without a graph: the library's values, and a gradient through the entries its
    max and min pass theirs to only."""
    with torch.no_grad():
        # the entries that take the gradient: the positive (times its mask), the negative, and
        # the row's largest where the negative is not one (the library's shift)
        chosen = torch.stack([positive.indices, negative.indices, largest.indices[:, 0]], 1)
        masks = torch.cat([positives.gather(1, chosen[:, :1]), torch.ones_like(positives[:, :1]),
                           (~negatives).gather(1, chosen[:, 1:2])], 1)
        if cosine:  # clamp_min passes where 1 - a.b >= 0, i.e. a.b <= 1; the diagonal was filled
            anchors = torch.arange(len(d), device=d.device).unsqueeze(1)
            passes = (gram.gather(1, chosen) <= 1) & (chosen != anchors)
            scales = torch.where(passes & masks, -1.0, 0.0)
        else:  # a distance of 0 has gradient 0
            distances = d.gather(1, chosen)
            scales = torch.where((distances > 0) & masks, 1 / distances, 0.0)
    return _HardestDistances.apply(rows, positive.values, negative.values,
                                   chosen.t().contiguous(), scales.t().contiguous(), cosine)


class BatchHardTripletLoss(_SentenceTransformersTripletLoss):
    """sentence-transformers' BatchHardTripletLoss: the mean over every anchor of
    max(hardest positive - hardest negative + margin, 0)."""

    _FUSED = (0, 0, 1)  # batch_hard, max(x, 0), every anchor counts

    def __init__(self, model=None, distance_metric=_st_euclidean_distance,
                 margin: float = 5) -> None:
        super().__init__(model, distance_metric, margin)

    def _torch_loss(self, x: Tensor, labels: Tensor) -> Tensor:
        positive, negative = _st_hardest(x, labels, self._distance)
        losses = positive - negative + self.triplet_margin
        return torch.where(losses < 0, 0.0, losses).mean()


class BatchHardSoftMarginTripletLoss(_SentenceTransformersTripletLoss):
    """sentence-transformers' BatchHardSoftMarginTripletLoss: the mean of
    softplus(hardest positive - hardest negative) over every anchor."""

    _FUSED = (0, 1, 1)  # batch_hard, softplus, every anchor counts

    def __init__(self, model=None, distance_metric=_st_euclidean_distance) -> None:
        super().__init__(model, distance_metric, None)

    def _torch_loss(self, x: Tensor, labels: Tensor) -> Tensor:
        positive, negative = _st_hardest(x, labels, self._distance)
        return torch.nn.functional.softplus(positive - negative).mean()


class BatchAllTripletLoss(_SentenceTransformersTripletLoss):
    """sentence-transformers' BatchAllTripletLoss: max(d_ap - d_an + margin, 0) over every
    (anchor, positive, negative), summed, over the number of them above 1e-16."""

    _FUSED = (1, 0, 3)  # batch_all, max(x, 0), the losses above 1e-16 count

    def __init__(self, model=None, distance_metric=_st_euclidean_distance,
                 margin: float = 5) -> None:
        super().__init__(model, distance_metric, margin)

    def _loss(self, d: Tensor, labels: Tensor) -> Tensor:
        positives, negatives = _label_masks(labels, labels, 0)
        total, count = d[:0].sum(), 0  # a 0 in the graph
        for anchors, refs in _pair_chunks(positives):
            losses = negatives[anchors] * (d[anchors, refs].unsqueeze(1) - d[anchors] +
                                           self.triplet_margin)
            losses = torch.where(losses < 0, 0.0, losses)
            total = total + losses.sum()
            count = count + (losses > 1e-16).sum()
        return total / (count + 1e-16)


class BatchSemiHardTripletLoss(_SentenceTransformersTripletLoss):
    """sentence-transformers' BatchSemiHardTripletLoss (FaceNet's rule): for each (anchor,
    positive) the nearest negative farther than the positive, else the farthest negative;
    max(d_ap - d_an + margin, 0) summed over the pairs, over their number."""

    _FUSED = (2, 0, 0)  # semi_hard, max(x, 0), its pairs count

    def __init__(self, model=None, distance_metric=_st_euclidean_distance,
                 margin: float = 5) -> None:
        super().__init__(model, distance_metric, margin)
        self.margin = margin

    def _loss(self, d: Tensor, labels: Tensor) -> Tensor:
        positives, negatives = _label_masks(labels, labels, 0)
        smallest = d.min(1, keepdim=True).values
        # the farthest negative as the library finds it: shifted by the row's smallest distance
        farthest = ((d - smallest) * negatives).max(1, keepdim=True).values + smallest
        pick = self._sorted_losses if len(d) <= _ST_SORTED_SEMI_HARD_ROWS else self._pair_losses
        return pick(d, positives, negatives, farthest) / positives.sum().clamp(min=1e-16)

    def _pair_losses(self, d: Tensor, positives: Tensor, negatives: Tensor,
                     farthest: Tensor) -> Tensor:
        """The sum of every pair's loss, a chunk of (anchor, positive) pairs at a time against
        their anchors' rows."""
        total, plain = d[:0].sum(), d.detach()
        for anchors, refs in _pair_chunks(positives):
            with torch.no_grad():  # the choice; the gradient then flows through the chosen d only
                rows = plain[anchors]
                beyond = torch.where(negatives[anchors] & (rows > plain[anchors, refs, None]),
                                     rows, math.inf)
                nearest = beyond.min(1)
            negative = torch.where(nearest.values.isfinite(), d[anchors, nearest.indices],
                                   farthest[anchors, 0])
            losses = (d[anchors, refs] - negative) + self.margin
            total = total + torch.maximum(losses, torch.zeros_like(losses)).sum()
        return total

    def _sorted_losses(self, d: Tensor, positives: Tensor, negatives: Tensor,
                       farthest: Tensor) -> Tensor:
        """The sum of every pair's loss, the nearest negative beyond the positive found by a
        search of the row's sorted negatives (the first of equal ones, as the pairs' min)."""
        with torch.no_grad():
            plain = d.detach()
            ordered, order = plain.masked_fill(~negatives, math.inf).sort(dim=1, stable=True)
            place = torch.searchsorted(ordered, plain, right=True).clamp_(max=len(d) - 1)
            beyond, nearest = ordered.gather(1, place).isfinite(), order.gather(1, place)
        negative = torch.where(beyond, d.gather(1, nearest), farthest)
        losses = torch.where(positives, (d - negative) + self.margin, 0.0)
        return torch.maximum(losses, torch.zeros_like(losses)).sum()


# pytorch-metric-learning: TripletMarginLoss's settings this module computes, and its miners'.
_PML_BANDS = ("all", "hard", "semihard", "easy")


def _pml_distance(distance, what: str) -> tuple:
    """(normalises, is a similarity) of a pytorch-metric-learning distance object."""
    kind = type(distance).__name__
    if kind == "LpDistance" and distance.p == 2 and distance.power == 1:
        return bool(distance.normalize_embeddings), False
    if kind == "CosineSimilarity" and distance.power == 1:
        return True, True
    raise ValueError(f"pml_triplet_loss: {what} must be LpDistance(p=2, power=1) or "
                     f"CosineSimilarity(), got {kind} with p={getattr(distance, 'p', None)}, "
                     f"power={getattr(distance, 'power', None)}")


def _pml_settings(loss_func, miner) -> dict:
    """The loss's and the miner's settings, or a ValueError naming the one not covered."""
    if type(loss_func).__name__ != "TripletMarginLoss":
        raise ValueError(f"pml_triplet_loss: loss_func must be pytorch-metric-learning's "
                         f"TripletMarginLoss, got {type(loss_func).__name__}")
    if loss_func.swap:
        raise ValueError("pml_triplet_loss: TripletMarginLoss(swap=True) is not covered")
    if loss_func.triplets_per_anchor != "all":
        raise ValueError(f"pml_triplet_loss: TripletMarginLoss(triplets_per_anchor="
                         f"{loss_func.triplets_per_anchor!r}) is not covered, only 'all'")
    reducer = type(loss_func.reducer).__name__
    if reducer != "AvgNonZeroReducer":
        raise ValueError(f"pml_triplet_loss: the reducer must be AvgNonZeroReducer, got {reducer}")
    if getattr(loss_func, "embedding_regularizer", None) is not None:
        raise ValueError("pml_triplet_loss: an embedding_regularizer is not covered")
    normalises, similarity = _pml_distance(loss_func.distance, "loss_func.distance")
    settings = {"margin": float(loss_func.margin), "smooth": bool(loss_func.smooth_loss),
                "normalises": normalises, "similarity": similarity, "band": None,
                "band_margin": 0.0, "hardest": False}
    if miner is None:
        return settings
    kind = type(miner).__name__
    if kind not in ("BatchHardMiner", "TripletMarginMiner"):
        raise ValueError(f"pml_triplet_loss: miner must be None, BatchHardMiner or "
                         f"TripletMarginMiner, got {kind}")
    if _pml_distance(miner.distance, "miner.distance") != (normalises, similarity):
        raise ValueError("pml_triplet_loss: miner.distance must be the loss's distance")
    if kind == "BatchHardMiner":
        settings["hardest"] = True
    elif miner.type_of_triplets not in _PML_BANDS:
        raise ValueError(f"pml_triplet_loss: TripletMarginMiner(type_of_triplets="
                         f"{miner.type_of_triplets!r}) is not one of {_PML_BANDS}")
    else:
        settings["band"], settings["band_margin"] = miner.type_of_triplets, float(miner.margin)
    return settings


def _pml_values(x: Tensor, refs: Tensor, normalises: bool, similarity: bool) -> Tensor:
    """The library's distance matrix as distances: larger is farther (a similarity negated)."""
    if normalises:
        same = refs is x
        x = torch.nn.functional.normalize(x, dim=1)
        refs = x if same else torch.nn.functional.normalize(refs, dim=1)
    if similarity:
        return -(x @ refs.t())
    if x.dtype == torch.float16:  # the library's float16 route: torch's pairwise_distance
        return torch.stack([torch.pairwise_distance(row.expand_as(refs), refs, 2.0, 1e-6)
                            for row in x])
    return torch.cdist(x, refs, p=2)


def _in_band(gap: Tensor, band: str, band_margin: float) -> Tensor:
    """TripletMarginMiner's choice on gap = d_an - d_ap (s_ap - s_an for a similarity)."""
    if band == "easy":
        return gap > band_margin
    keep = gap <= band_margin
    if band == "hard":
        return keep & (gap <= 0)
    return keep & (gap > 0) if band == "semihard" else keep


def _references_fit(embeddings: Tensor, ref_emb: Tensor, ref_labels: Tensor, mining: int) -> bool:
    """Whether the op takes this reference set after the batch: rows like the batch's, labels for
    each, and both within the whole batch's kernels (else the torch formula runs)."""
    return (ref_emb.device == embeddings.device and ref_emb.dtype == embeddings.dtype
            and ref_emb.dim() == 2 and ref_emb.shape[1] == embeddings.shape[1]
            and 0 < ref_emb.shape[0] == ref_labels.numel()
            and ref_labels.device == embeddings.device
            and embeddings.shape[0] + ref_emb.shape[0] <= _whole_rows(mining))


def _whole_rows(mining: int) -> int:
    _ops()  # the plan's sizes come with the library
    return _MINING_WHOLE_ROWS[mining]


def pml_triplet_loss(loss_func, miner, embeddings: Tensor, labels: Tensor,
                     ref_emb: Tensor | None = None, ref_labels: Tensor | None = None) -> Tensor:
    """pytorch-metric-learning's `loss_func(embeddings, labels, miner(embeddings, labels, ref_emb,
    ref_labels), ref_emb, ref_labels)` (its value and gradient) for its TripletMarginLoss
    (AvgNonZeroReducer, smooth_loss or not) with miner None (every triplet), BatchHardMiner or
    TripletMarginMiner, distance LpDistance(p=2, power=1) or CosineSimilarity, read off the
    objects; a setting it does not cover raises ValueError naming it. ref_emb / ref_labels: the
    positives and negatives come from them (no row excluded as its own positive)."""
    settings = _pml_settings(loss_func, miner)
    if (ref_emb is None) != (ref_labels is None):
        raise ValueError("pml_triplet_loss: ref_emb and ref_labels go together (the library "
                         "would reuse the batch's labels for ref_emb)")
    mining = 0 if settings["hardest"] else 1
    if _mining_takes(embeddings, 2.0) and (
            ref_emb is None or _references_fit(embeddings, ref_emb, ref_labels, mining)):
        rows, row_labels, references = embeddings, labels.reshape(-1), 0
        if ref_emb is not None:  # the op's reference set: the rows after the batch
            rows = torch.cat([embeddings, ref_emb])
            row_labels = torch.cat([row_labels, ref_labels.reshape(-1)])
            references = ref_emb.shape[0]
        band = 0 if settings["band"] is None else 1 + _PML_BANDS.index(settings["band"])
        distance = (_COSINE if settings["similarity"] else
                    _UNIT_EUCLIDEAN if settings["normalises"] else _EUCLIDEAN)
        loss = _library_loss_on_the_op(
            rows, row_labels, distance, settings["margin"], mining, int(settings["smooth"]), 2,
            band, settings["band_margin"], references)
        return loss.to(embeddings.dtype)  # the library's loss has the embeddings' dtype
    refs, ref_labels = (embeddings, labels) if ref_emb is None else (ref_emb, ref_labels)
    values = _pml_values(embeddings, refs, settings["normalises"], settings["similarity"])
    positives, negatives = _label_masks(labels.reshape(-1), ref_labels.reshape(-1),
                                        0 if ref_emb is None else None)
    margin, smooth = settings["margin"], settings["smooth"]
    total, count = values[:0].sum(), 0
    if settings["hardest"]:
        with torch.no_grad():
            valid = positives.any(1) & negatives.any(1)
            positive = _first_extreme(values, positives, largest=True)
            negative = _first_extreme(values, negatives, largest=False)
        rows = valid.nonzero()[:, 0]
        chunks = [(rows, positive[rows], negative[rows])]
    else:
        chunks = [(anchors, refs_, None) for anchors, refs_ in _pair_chunks(positives)]
    for anchors, chosen, negative in chunks:
        anchor_positive = values[anchors, chosen].unsqueeze(1)
        if negative is None:  # every negative of the pair
            anchor_negative, keep = values[anchors], negatives[anchors]
        else:
            anchor_negative = values[anchors, negative].unsqueeze(1)
            keep = torch.ones_like(anchor_negative, dtype=torch.bool)
        if settings["band"] is not None:
            keep = keep & _in_band(anchor_negative - anchor_positive, settings["band"],
                                   settings["band_margin"])
        losses = _hinge((anchor_positive - anchor_negative) + margin, smooth)
        keep = keep & (losses > 0)  # AvgNonZeroReducer: the mean of the losses above 0
        total = total + torch.where(keep, losses, 0.0).sum()
        count = count + keep.sum()
    count = torch.as_tensor(count, device=values.device)
    return torch.where(count > 0, total / count.clamp_min(1), (embeddings * 0).sum())


class _GatherFromRanks(torch.autograd.Function):
    """Every rank's rows in rank order; the backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, sizes: list, group):
        ctx.rank, ctx.sizes = torch.distributed.get_rank(group), sizes
        padded = x.new_zeros((max(sizes),) + tuple(x.shape[1:]))
        padded[:len(x)] = x
        parts = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([part[:size] for part, size in zip(parts, sizes)])

    @staticmethod
    def backward(ctx, grad: Tensor):
        start = sum(ctx.sizes[:ctx.rank])
        return grad[start:start + ctx.sizes[ctx.rank]], None, None


def gather_across_ranks(embeddings: Tensor, labels: Tensor, group=None) -> tuple:
    """(embeddings, labels) of every rank of torch.distributed, concatenated in rank order (ranks
    may hold different batch sizes). The gradient of the gathered embeddings flows back to this
    rank's rows, so a loss of the global batch computed on every rank gives each rank the
    gradient of its rows in the single-process loss of the concatenation."""
    sizes = torch.tensor([len(embeddings)], device=embeddings.device)
    every = [torch.empty_like(sizes) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(every, sizes, group=group)
    sizes = [int(size) for size in every]
    gathered_labels = _GatherFromRanks.apply(labels, sizes, group)
    return _GatherFromRanks.apply(embeddings, sizes, group), gathered_labels


# ---------------------------------------------------------------------------------------------
# One-file export: this module with the kernel sources inlined, for copying into a project or
# submitting to the benchmark (whose problem takes `ModelNew`).
# ---------------------------------------------------------------------------------------------


def _python_literal(text: str) -> str:
    if "'''" not in text and not text.endswith("\\"):
        return "r'''" + text + "'''"
    return repr(text)


_SECOND_FILE_ONLY = "// kernelbench-only: "  # a line of code the benchmark file alone holds


def _forward_only(name: str, text: str) -> str:
    """A kernel source without its library-only lines (`... // library-only`) and blocks
    (`// library-only {` to `// library-only }`), with its _SECOND_FILE_ONLY lines as code."""
    out, skipping = [], False
    for line in text.splitlines():
        marker = line.strip()
        if marker in ("// library-only {", "// library-only }"):
            assert skipping == marker.endswith("}"), f"{name}: unbalanced library-only block"
            skipping = not skipping
        elif marker.startswith(_SECOND_FILE_ONLY) and not skipping:
            out.append(line[:len(line) - len(line.lstrip())] + marker[len(_SECOND_FILE_ONLY):])
        elif not skipping and not line.rstrip().endswith("// library-only"):
            out.append(line)
    assert not skipping, f"{name}: unclosed library-only block"
    return "\n".join(out) + "\n"


_BANNER = "# " + "-" * 93 + "\n"
_TEMPLATE = "kernelbench_model.py"  # the benchmark file's own part, in the kernel folder


def _with_sources(text: str, sources: dict) -> str:
    """text with its `KERNEL_SOURCES = ...` statement (a call here, a dict literal in an export)
    replaced by the sources as a dict literal."""
    start = text.index("\nKERNEL_SOURCES = ") + 1
    end = text.index("\n", start) + 1
    if text.startswith("KERNEL_SOURCES = {\n", start):
        end = text.index("\n}\n", start) + 3
    inline = "".join(f"    {name!r}: {_python_literal(code)},\n" for name, code in sources.items())
    return text[:start] + "KERNEL_SOURCES = {\n" + inline + "}\n" + text[end:]


def export(path: str, kernelbench: bool = False) -> str:
    """Write the library as one self-contained Python file at `path`; returns `path`. With
    kernelbench=True, the KernelBench file instead: its template (kernels/kernelbench_model.py)
    with this module's kernel sources, build and ModelNew, and only the float32 forward kernels
    problem 99 reaches (a build of seconds)."""
    with open(os.path.abspath(__file__), encoding="utf-8") as f:
        text = f.read()
    sources = KERNEL_SOURCES
    if kernelbench:
        template = os.path.join(_kernel_folder() or "kernels", _TEMPLATE)
        if not os.path.exists(template):
            raise FileNotFoundError(f"fused_triplet: the KernelBench template {template} is "
                                    "missing (export it from the project or the package)")
        first = text.index(_BANNER + "# Kernel sources")
        library = text[first:text.index(_BANNER + "# Op registration")]
        model = text[text.index("class ModelNew("):text.index(_BANNER + "# In-batch mining")]
        with open(template, encoding="utf-8") as f:
            text = (f.read().replace("# @@ the library's kernel sources and build @@\n", library)
                    .replace("# @@ the library's ModelNew @@\n", model))
        sources = {name: _forward_only(name, code) for name, code in sources.items()}
    with open(path, "w", encoding="utf-8") as f:
        f.write(_with_sources(text, sources))
    return path


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def _main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"fused_triplet {__version__}")
    parser.add_argument("--build", action="store_true",
                        help="compile and load the CUDA kernels now (verbose), print the library")
    parser.add_argument("--export", metavar="PATH",
                        help="write the library as one self-contained .py file (kernels inlined)")
    parser.add_argument("--kernelbench", action="store_true",
                        help="with --export: the KernelBench file (float32 forward kernels only)")
    args = parser.parse_args(argv)
    if args.kernelbench and not args.export:
        parser.error("--kernelbench goes with --export PATH")
    if args.export:
        if not os.path.isdir(os.path.dirname(os.path.abspath(args.export))):
            print(f"fused_triplet: cannot write {args.export}: its folder does not exist",
                  file=sys.stderr)
            return 1
        try:
            print(export(args.export, kernelbench=args.kernelbench))
        except FileNotFoundError as error:
            print(error, file=sys.stderr)
            return 1
    if args.build:
        problem = _build_problem()
        if problem:
            print(problem, file=sys.stderr)
            return 1
        print(build(verbose=True))
    if not (args.export or args.build):
        parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(_main())
