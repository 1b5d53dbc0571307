"""Benchmark fused_triplet against eager torch.nn.TripletMarginLoss and torch.compile of it.

    python bench.py                       # KernelBench level 1 problem 99: (32768, 8192) fp32
    python bench.py --shapes 4096x512,16x4194304 --dtypes fp32,bf16 --json results.json
    python bench.py --backward            # forward + backward: loss.backward(), (0.5 * loss).backward()
    python bench.py --sweep [--backward] --json sweep.json --plot sweep.png   # the sweep's shapes
    python bench.py --sweep --backward --shapes 1024x128,4096x512 --json part1.json   # a part
    python bench.py --merge part1.json part2.json --json sweep.json --plot sweep.png   # no GPU
    python bench.py --loops --json results/h200_loops.json   # training loops (autocast, GradScaler, ...)
    python bench.py --mining --json results/h200_mining.json   # in-batch mining vs cdist + masks
    python bench.py --readme-table        # README's speed tables, from results/

Method: CUDA events around each call; contenders interleaved round by round with the L2 cache
flushed (a 256 MiB write) before every timed call; warm-up rounds first; median over rounds. The
GPU sleeps ~1 ms (torch.cuda._sleep) after each flush, before the start event, so the host has
issued the whole call by the time the clock starts: the flushed times are GPU time, as in a
training loop whose host runs ahead, not host launch latency (--host-latency times without the
sleep). A fresh torch.compile per shape (torch._dynamo.reset()), so recompile limits never silently fall
back to eager. Effective TB/s = bytes that must move (each input read once; with a backward, each
gradient written once too) / median time.
Cases under 16 MiB of input also get a per-call time: back-to-back calls (no flush) over enough
rotated input sets to exceed the L2, so launch and Python overhead count as users see them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

import fused_triplet

PEAK_TBPS = 4.8  # H200 HBM3e datasheet
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
DEFAULT_SHAPES = "32768x8192"
# ~1 ms at the H200's 1.98 GHz: longer than any contender's host work per call (eager fwd+bwd
# issues ~20 kernels), so every launch of the timed call is issued before its start event.
DEVICE_LEAD_CYCLES = 2_000_000
# A mined step's host work (label sort, chunks, gathers, autograd; cdist + masks' too) outlasts
# that at small batches: its steps get 10 times the lead.
MINING_LEAD_FACTOR = 10
SWEEP_SHAPES = "1024x128,4096x512,128x4096,262144x256,65536x1024,32768x8192,16x4194304,4x16777216"
SMALL_BYTES = 16 << 20
RESULTS = "results/h200_sweep.json"  # the recorded sweep: README's table and plot come from it
LOOP_RESULTS = "results/h200_loops.json"  # the recorded training loops: README's second table
README_CASES = [("forward", "32768x8192"), ("fwd+bwd", "32768x8192"),
                ("fwd+bwd 0.5x", "32768x8192")]


def parse_shapes(text: str):
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",") if item]


def make_inputs(shape, dtype, seed=0):
    """KernelBench's get_inputs(): anchor scaled by a random scalar, all uniform [0, 1)."""
    torch.manual_seed(seed)
    a = torch.rand(shape, device="cuda") * torch.rand((), device="cuda")
    p = torch.rand(shape, device="cuda")
    n = torch.rand(shape, device="cuda")
    return a.to(dtype), p.to(dtype), n.to(dtype)


def time_interleaved(fns: dict, args, rounds: int, warmup: int, after_flush=None, lead_factor=1):
    """{name: [ms per round]}: each round calls every contender once, L2 flushed before each,
    then lead_factor x DEVICE_LEAD_CYCLES of device sleep so the host is ahead when the start
    event fires. after_flush: called after each flush (scripts/fixed_cost.py: a read that
    cleans the L2)."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        for fn in fns.values():
            fn(*args)
    torch.cuda.synchronize()
    events = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            flush.zero_()
            if after_flush is not None:
                after_flush()
            if DEVICE_LEAD_CYCLES:
                torch.cuda._sleep(lead_factor * DEVICE_LEAD_CYCLES)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*args)
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {name: [s.elapsed_time(e) for s, e in pairs] for name, pairs in events.items()}


def time_back_to_back(fn, input_sets, calls=200, repeats=3):
    """Median over `repeats` of (events around `calls` back-to-back calls) / calls, in ms."""
    results = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            fn(*input_sets[i % len(input_sets)])
        end.record()
        torch.cuda.synchronize()
        results.append(start.elapsed_time(end) / calls)
    return statistics.median(results)


def per_call_times(fns, inputs):
    """{name: per-call ms} for a case under SMALL_BYTES of input, else None."""
    nbytes = sum(x.numel() * x.element_size() for x in inputs)
    if nbytes >= SMALL_BYTES:
        return None
    copies = min(63, 2 * torch.cuda.get_device_properties(0).L2_cache_size // nbytes)
    sets = [inputs] + [[x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
                       for _ in range(copies)]
    return {name: time_back_to_back(fn, sets) for name, fn in fns.items()}


def bench_forward(shape, dtype, rounds, warmup, margin=1.0):
    inputs = make_inputs(shape, dtype)
    eager = torch.nn.TripletMarginLoss(margin=margin)
    torch._dynamo.reset()
    compiled = torch.compile(torch.nn.TripletMarginLoss(margin=margin))
    ours = fused_triplet.TripletMarginLoss(margin=margin)
    fns = {"eager": eager, "torch.compile": compiled, "fused_triplet": ours}
    with torch.no_grad():
        results = {name: fn(*inputs) for name, fn in fns.items()}
        times = time_interleaved(fns, inputs, rounds, warmup)
        per_call = per_call_times(fns, inputs)
    bytes_moved = sum(x.numel() * x.element_size() for x in inputs)
    results = {name: [out] for name, out in results.items()}
    return summarize("forward", shape, dtype, times, results, bytes_moved, per_call=per_call)


def summarize(mode, shape, dtype, times, results, bytes_moved, extra_bytes=None, per_call=None):
    """One row per contender (the last is fused_triplet): median time, effective bandwidth,
    speedup of fused_triplet over it, max error of its outputs against eager's."""
    rows = []
    for name, samples in times.items():
        ms = statistics.median(samples)
        row = {"shape": list(shape), "dtype": str(dtype).replace("torch.", ""), "mode": mode,
               "contender": name, "median_ms": ms, "min_ms": min(samples),
               "tbps": bytes_moved / ms / 1e9, "peak_pct": 100 * bytes_moved / ms / 1e9 / PEAK_TBPS,
               "max_abs_err_vs_eager": max((x.double() - y.double()).abs().max().item()
                                           for x, y in zip(results[name], results["eager"]))}
        if extra_bytes is not None:
            row["extra_mib"] = extra_bytes[name] / 2**20
        if per_call is not None:
            row["per_call_ms"] = per_call[name]
        rows.append(row)
    for row in rows:
        row["fused_speedup"] = row["median_ms"] / rows[-1]["median_ms"]
    return rows


def bench_backward(shape, dtype, rounds, warmup, margin=1.0, weight=1.0):
    """Forward + backward of the mean loss, grads of all three inputs: loss.backward(), or with
    weight != 1 (weight * loss).backward() (an upstream gradient other than 1, as a weighted
    loss, gradient accumulation or GradScaler sends). Peak extra memory is max_memory_allocated
    during one step minus the inputs and the three gradients."""
    inputs = [x.requires_grad_() for x in make_inputs(shape, dtype)]
    torch._dynamo.reset()
    modules = {"eager": torch.nn.TripletMarginLoss(margin=margin),
               "torch.compile": torch.compile(torch.nn.TripletMarginLoss(margin=margin)),
               "fused_triplet": fused_triplet.TripletMarginLoss(margin=margin)}
    input_bytes = sum(x.numel() * x.element_size() for x in inputs)
    results, steps, extra = {}, {}, {}
    for name, module in modules.items():
        def step(*xs, module=module):
            for x in xs:
                x.grad = None
            loss = module(*xs)
            (loss if weight == 1.0 else weight * loss).backward()
            return loss
        step(*inputs)  # compile / build outside the measurement
        for x in inputs:
            x.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = step(*inputs)
        torch.cuda.synchronize()
        extra[name] = torch.cuda.max_memory_allocated() - base - input_bytes
        results[name] = [loss.detach()] + [x.grad for x in inputs]  # step() drops, not reuses, them
        steps[name] = step
    times = time_interleaved(steps, inputs, rounds, warmup)
    per_call = per_call_times(steps, inputs)
    # The least any implementation moves: a, p, n read once, three gradients written (two
    # passes read the inputs twice: 1.5x this).
    bytes_moved = 2 * input_bytes
    mode = "fwd+bwd" if weight == 1.0 else f"fwd+bwd {weight}x"
    return summarize(mode, shape, dtype, times, results, bytes_moved, extra, per_call)


def bench_backward_weighted(shape, dtype, rounds, warmup):
    return bench_backward(shape, dtype, rounds, warmup, weight=0.5)


# Training loops as people write them: (input dtype, autocast dtype or None, losses per step,
# how the step's loss is differentiated). Every contender runs the same loop code.
LOOPS = {
    "loss.backward()": (torch.float32, None, 1, lambda losses, scaler: losses[0].backward()),
    "(loss / 4).backward()": (torch.float32, None, 1,
                              lambda losses, scaler: (losses[0] / 4).backward()),
    "GradScaler fp32": (torch.float32, None, 1,
                        lambda losses, scaler: scaler.scale(losses[0]).backward()),
    "AMP fp16 + GradScaler": (torch.float16, torch.float16, 1,
                              lambda losses, scaler: scaler.scale(losses[0]).backward()),
    "AMP bf16": (torch.bfloat16, torch.bfloat16, 1, lambda losses, scaler: losses[0].backward()),
    "l1 + 0.5 * l2": (torch.float32, None, 2,
                      lambda losses, scaler: (losses[0] + 0.5 * losses[1]).backward()),
}
LOOP_SHAPES = "32768x8192,4096x512"


def bench_loop(shape, name, rounds, warmup, margin=1.0):
    """One training step of a loop in LOOPS (forward and backward of its losses, gradients of
    every input), eager vs torch.compile vs fused_triplet; loss dtype and bytes as it moves them."""
    dtype, amp, losses, differentiate = LOOPS[name]
    inputs = [x.requires_grad_() for k in range(losses)
              for x in make_inputs(shape, dtype, seed=k)]
    torch._dynamo.reset()
    modules = {"eager": torch.nn.TripletMarginLoss(margin=margin),
               "torch.compile": torch.compile(torch.nn.TripletMarginLoss(margin=margin)),
               "fused_triplet": fused_triplet.TripletMarginLoss(margin=margin)}
    steps, results = {}, {}
    for contender, module in modules.items():
        scaler = torch.amp.GradScaler("cuda", init_scale=65536.0)

        def step(*xs, module=module, scaler=scaler):
            for x in xs:
                x.grad = None
            with torch.autocast("cuda", dtype=amp or torch.float16, enabled=amp is not None):
                out = [module(*xs[3 * k:3 * k + 3]) for k in range(losses)]
            differentiate(out, scaler)
            return out

        out = step(*inputs)  # compile / build outside the measurement
        results[contender] = [x.detach() for x in out] + [x.grad for x in inputs]
        steps[contender] = step
    times = time_interleaved(steps, inputs, rounds, warmup)
    rows = summarize(f"loop {name}", shape, dtype, times, results,
                     2 * sum(x.numel() * x.element_size() for x in inputs))
    for row in rows:
        row["loss_dtype"] = str(results[row["contender"]][0].dtype).replace("torch.", "")
    return rows


# In-batch mining, fwd+bwd of the mean loss on leaf embeddings, labels 8 per class:
# (mining, batch, dim, dtype). Contenders where they fit: the plain fused triplet step of the same
# (B, D), sentence-transformers' BatchHardTripletLoss and pytorch-metric-learning's BatchHardMiner +
# TripletMarginLoss (test extras, skipped with a line when absent); the B x B x D matmul floors.
MINING_SHAPES = [(64, 128), (64, 512), (256, 128), (256, 512), (1024, 128), (1024, 512),
                 (2048, 512), (4096, 512), (16384, 512), (32768, 128), (65536, 512)]
MINING_CASES = ([(m, b, d, "fp32") for m in ("batch_hard", "batch_all") for b, d in MINING_SHAPES]
                + [("batch_hard", b, d, "bf16") for b, d in MINING_SHAPES if b >= 16384])
MINING_RESULTS = "results/h200_mining.json"
PLAIN_STEP_MAX_BATCH = 1024   # the plain step is the small batches' yardstick
README_MINING_SHAPES = [(64, 128), (1024, 512), (16384, 512), (65536, 512)]
LIBRARY_MAX_BATCH = 32768     # the libraries' B x B matrices: several GiB each beyond this


def sentence_transformers_batch_hard(margin):
    """sentence-transformers' BatchHardTripletLoss on embeddings, or why it cannot run."""
    try:
        from sentence_transformers import losses
    except ImportError as error:
        return f"sentence-transformers not installed ({error})"
    loss = losses.BatchHardTripletLoss(model=None, margin=margin)
    if hasattr(loss, "compute_loss_from_embeddings"):
        return lambda e, labels: loss.compute_loss_from_embeddings([e], labels)
    return lambda e, labels: loss.batch_hard_triplet_loss(labels, e)


def pml_batch_hard(margin):
    """pytorch-metric-learning's BatchHardMiner + TripletMarginLoss (its distance without
    normalising, as ours), or why it cannot run."""
    try:
        from pytorch_metric_learning import distances, losses, miners, reducers
    except ImportError as error:
        return f"pytorch-metric-learning not installed ({error})"
    distance = distances.LpDistance(normalize_embeddings=False)
    miner = miners.BatchHardMiner(distance=distance)
    loss = losses.TripletMarginLoss(margin=margin, distance=distance,
                                    reducer=reducers.MeanReducer())
    return lambda e, labels: loss(e, labels, miner(e, labels))


def peak_extra(fn, *args):
    """(fn(*args), the bytes allocated at its peak beyond those allocated before the call)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn(*args)
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - before


# The drop-ins against the classes they replace: (library, variant, batch, dim), fp32.
DROPIN_CASES = ([("sentence-transformers", v, 1024, 512) for v in (
                    "BatchHardTripletLoss", "BatchHardSoftMarginTripletLoss", "BatchAllTripletLoss",
                    "BatchSemiHardTripletLoss")]
                + [("pytorch-metric-learning", v, b, 512) for v, b in (
                    ("BatchHardMiner", 1024), ("semihard", 1024), ("semihard", 4096),
                    (None, 1024), (None, 4096))]
                + [("sentence-transformers", "BatchSemiHardTripletLoss", 16384, 512)])
DROPIN_RESULTS = "results/h200_dropins.json"


# The drop-ins built on batch_hard (the rest on batch_all), for our own mined loss beside each.
HARDEST_VARIANTS = ("BatchHardTripletLoss", "BatchHardSoftMarginTripletLoss", "BatchHardMiner")


def dropin_steps(library, variant):
    """{name: loss(embeddings, labels)} for ours and the library's, or a line why not."""
    try:
        if library == "sentence-transformers":
            from sentence_transformers.sentence_transformer import losses as st
            theirs, ours = getattr(st, variant)(None), getattr(fused_triplet, variant)(None)
            return {"fused_triplet": lambda e, y: ours.compute_loss_from_embeddings([e], y),
                    library: lambda e, y: theirs.compute_loss_from_embeddings([e], y)}
        from pytorch_metric_learning import distances, losses, miners
    except ImportError as error:
        return f"{library} is not installed ({error})"
    loss = losses.TripletMarginLoss(margin=0.2, distance=distances.CosineSimilarity())
    miner = (None if variant is None
             else miners.BatchHardMiner(distance=distances.CosineSimilarity())
             if variant == "BatchHardMiner"
             else miners.TripletMarginMiner(margin=0.2, type_of_triplets=variant,
                                            distance=distances.CosineSimilarity()))
    return {"fused_triplet": lambda e, y: fused_triplet.pml_triplet_loss(loss, miner, e, y),
            library: lambda e, y: loss(e, y, None if miner is None else miner(e, y))}


def training_step(loss):
    """step(x, y): x's gradient cleared, loss(x, y) and its backward; returns the loss."""
    def step(x, y):
        x.grad = None
        out = loss(x, y)
        out.backward()
        return out
    return step


def bench_dropin(library, variant, batch, dim, rounds, warmup):
    """One drop-in case: each contender's synced fwd+bwd step and peak extra memory."""
    torch.manual_seed(0)
    e = torch.randn(batch, dim, device="cuda").requires_grad_()
    labels = (torch.arange(batch, device="cuda") // 8)[torch.randperm(batch, device="cuda")]
    losses = dropin_steps(library, variant)
    base = {"library": library, "variant": str(variant), "shape": [batch, dim]}
    if isinstance(losses, str):
        return [dict(base, contender=library, skipped=losses)]
    mining = "batch_hard" if variant in HARDEST_VARIANTS else "batch_all"
    own = f"fused_triplet {mining}"  # our own mined loss of the family the drop-in builds on
    losses[own] = lambda e, y: fused_triplet.mined_triplet_margin_loss(e, y, mining)
    steps, rows = {}, []
    for name, loss in losses.items():
        step = training_step(loss)
        row = dict(base, contender=name)
        try:
            step(e, labels)
            e.grad = None
            out, extra = peak_extra(step, e, labels)
            row.update(loss=out.item(), extra_mib=(extra - e.numel() * 4) / 2**20)
            steps[name] = step
        except torch.OutOfMemoryError:
            row["failed"] = "out of memory"
            torch.cuda.empty_cache()
        rows.append(row)
    # A step that follows the library's reads slower, so our own mined loss is timed against
    # ours alone, in a second interleaved run.
    own_step = steps.pop(own, None)
    times = time_synced(steps, (e, labels), rounds, warmup)
    paired = (time_synced({"fused_triplet": steps["fused_triplet"], own: own_step}, (e, labels),
                          rounds, warmup) if own_step and "fused_triplet" in steps else {})
    for row in rows:
        name = row["contender"]
        if name == own and paired:
            row["step_ms"] = statistics.median(paired[own])
            row["over_own"] = statistics.median(paired["fused_triplet"]) / row["step_ms"]
        elif name in times:
            row["step_ms"] = statistics.median(times[name])
    ours = rows[0].get("step_ms")
    for row in rows:
        if ours and "step_ms" in row:
            row["fused_speedup"] = row["step_ms"] / ours
    return rows


# torch's path on CPU (CPU users, notebooks, CI): per shape, the mined losses against
# pytorch-metric-learning's settings that equal them, every drop-in against the class it replaces.
CPU_SHAPES = [(32, 768), (64, 128), (256, 512), (1024, 512)]  # (32, 768): sentence-transformers
CPU_CASES = ([("mined", m) for m in ("batch_hard", "batch_all")]
             + [(library, variant) for library, variant, batch, _ in DROPIN_CASES if batch == 1024])
CPU_RESULTS = "results/cpu_mining.json"


def pml_all_triplets(margin):
    """pytorch-metric-learning's TripletMarginLoss without a miner (every triplet, the mean of
    those > 0: batch_all's), or why it cannot run."""
    try:
        from pytorch_metric_learning import distances, losses, reducers
    except ImportError as error:
        return f"pytorch-metric-learning not installed ({error})"
    loss = losses.TripletMarginLoss(margin=margin, reducer=reducers.AvgNonZeroReducer(),
                                    distance=distances.LpDistance(normalize_embeddings=False))
    return lambda e, labels: loss(e, labels)


def bench_cpu(family, variant, batch, dim, rounds, warmup):
    """One CPU case: each contender's fwd+bwd step on the host clock, interleaved."""
    torch.manual_seed(0)
    e = torch.randn(batch, dim).requires_grad_()
    labels = (torch.arange(batch) // 8)[torch.randperm(batch)]
    if family == "mined":
        losses = {"fused_triplet": lambda x, y: fused_triplet.mined_triplet_margin_loss(
            x, y, variant), "pytorch-metric-learning": (
            pml_batch_hard if variant == "batch_hard" else pml_all_triplets)(1.0)}
    else:
        losses = dropin_steps(family, variant)
    base = {"family": family, "variant": str(variant), "shape": [batch, dim],
            "threads": torch.get_num_threads()}
    if isinstance(losses, str):
        return [dict(base, contender=family, skipped=losses)]
    steps = {name: training_step(loss) for name, loss in losses.items() if callable(loss)}
    times = {name: statistics.median(t) for name, t in
             time_synced(steps, (e, labels), rounds, warmup, sync=lambda: None).items()}
    return [dict(base, contender=name, step_ms=times[name],
                 over_fused=times[name] / times["fused_triplet"]) if name in times else
            dict(base, contender=name, skipped=loss) for name, loss in losses.items()]


def readme_cpu_table(rows):
    """README's CPU table: per case, ours and the library's step at each shape."""
    shapes = [list(s) for s in CPU_SHAPES]
    head = "| loss on CPU | library | " + " | ".join(f"{b} x {d}" for b, d in CPU_SHAPES) + " |"
    lines = [head, "|---|---|" + "---:|" * len(shapes)]
    for family, variant in CPU_CASES:
        case = [r for r in rows if r["family"] == family and r["variant"] == str(variant)]
        for library in dict.fromkeys(r["contender"] for r in case if "step_ms" in r):
            if library == "fused_triplet":
                continue
            cells = []
            for shape in shapes:
                ours, theirs = ([r for r in case if r["shape"] == shape and r["contender"] == c]
                                for c in ("fused_triplet", library))
                cells.append(f"**{ours[0]['step_ms']:.2f}** / {theirs[0]['step_ms']:.2f} ms"
                             if ours and theirs and "step_ms" in theirs[0] else "-")
            name = (f"mined_triplet_margin_loss {variant}" if family == "mined" else
                    f"pml_triplet_loss, {variant or 'no miner'}"
                    if family == "pytorch-metric-learning" else variant)
            lines.append(f"| {name} | {library} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def launches_and_syncs(fn, args):
    """(kernels, copies and fills launched, host synchronisations and device-to-host copies) of
    one call, from the profiler, less what it counts around an empty call (its own)."""
    from torch.profiler import ProfilerActivity, profile

    def counts(fn, args):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn(*args)
        device = [e for e in prof.events() if e.device_type.name == "CUDA"]
        syncs = [e for e in prof.events() if e.name in (
            "cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")]
        to_host = [e for e in device if "DtoH" in e.name or "Device -> Pageable" in e.name
                   or "Device -> Pinned" in e.name]
        return len(device), len(syncs) + len(to_host)
    (launches, syncs), (own_launches, own_syncs) = counts(fn, args), counts(lambda: None, ())
    return launches - own_launches, syncs - own_syncs


def time_synced(fns: dict, args, rounds: int, warmup: int, sync=None):
    """{name: [ms per round]} with the host in the window: synchronised before, each call timed
    on the host clock until the device has finished it, contenders interleaved, in reverse order
    every other round (the first of a round read 2-4% slower than the second, whichever it was).
    sync: what waits for the device (torch.cuda.synchronize; nothing on CPU)."""
    sync = sync or torch.cuda.synchronize
    for _ in range(warmup):
        for fn in fns.values():
            fn(*args)
    times = {name: [] for name in fns}
    for round_index in range(rounds):
        order = list(fns.items())
        for name, fn in order if round_index % 2 == 0 else reversed(order):
            sync()
            start = time.perf_counter()
            fn(*args)
            sync()
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def bench_mining(mining, batch, dim, dtype_name, rounds, warmup, margin=1.0):
    """One mining case: every contender's synced step, GPU time, launches and synchronisations
    per step and peak extra memory beyond the inputs and their gradients; the matmul floors."""
    torch.manual_seed(0)
    dtype = DTYPES[dtype_name]
    e = torch.randn(batch, dim, device="cuda").to(dtype).requires_grad_()
    labels = (torch.arange(batch, device="cuda") // 8)[torch.randperm(batch, device="cuda")]
    losses = {"fused_triplet": lambda x, y: fused_triplet.mined_triplet_margin_loss(
        x, y, mining, margin=margin)}
    skipped = {}
    if batch <= LIBRARY_MAX_BATCH:
        for name, make in (("s-t BatchHard", sentence_transformers_batch_hard),
                           ("pml BatchHard", pml_batch_hard)):
            loss = make(margin)
            if isinstance(loss, str):
                skipped[name] = loss
            else:
                losses[name] = loss
    steps, inputs = {}, {}
    for name, loss in losses.items():
        steps[name], inputs[name] = training_step(loss), (e, labels)
    if batch <= PLAIN_STEP_MAX_BATCH:
        a, p, n = (torch.randn(batch, dim, device="cuda").to(dtype).requires_grad_()
                   for _ in range(3))

        def plain(a, p, n):
            a.grad = p.grad = n.grad = None
            out = fused_triplet.triplet_margin_loss(a, p, n, margin=margin)
            out.backward()
            return out
        steps["plain fused step"], inputs["plain fused step"] = plain, (a, p, n)
    rows, alive = [], {}
    for name, step in steps.items():
        row = {"shape": [batch, dim], "dtype": str(dtype).replace("torch.", ""),
               "mode": f"mined {mining}", "contender": name}
        try:
            args = inputs[name]
            step(*args)
            for x in args:  # the warm-up's gradients are not the measured step's
                x.grad = None
            grads = sum(x.numel() * x.element_size() for x in args if x.is_floating_point())
            out, extra = peak_extra(step, *args)
            row.update(loss=out.item(), extra_mib=(extra - grads) / 2**20)
            row["launches"], row["syncs"] = launches_and_syncs(step, args)
            alive[name] = step
        except torch.OutOfMemoryError:
            row["failed"] = "out of memory"
            torch.cuda.empty_cache()
        rows.append(row)
    if not alive:
        return rows
    # each contender with its own inputs: wrap so the timers call every one with no arguments
    calls = {name: (lambda step=step, args=inputs[name]: step(*args)) for name, step in alive.items()}
    synced = time_synced(calls, (), rounds, warmup)
    # A step that follows a library's reads slower (as in bench_dropin: (4096, 512) batch_hard
    # 0.96 ms against 0.65), so ours and the plain step are timed again without the libraries.
    beside_libraries = {}
    if any(name in losses and name != "fused_triplet" for name in calls):
        beside_libraries = {name: statistics.median(synced[name]) for name in calls
                            if name not in losses or name == "fused_triplet"}
        synced.update(time_synced({name: call for name, call in calls.items()
                                   if name in beside_libraries}, (), rounds, warmup))
    gpu = time_interleaved(calls, (), rounds, warmup, lead_factor=MINING_LEAD_FACTOR)
    for row in rows:
        if row["contender"] in alive:
            row.update(step_ms=statistics.median(synced[row["contender"]]),
                       gpu_ms=statistics.median(gpu[row["contender"]]))
        if row["contender"] in beside_libraries:
            row["step_ms_beside_libraries"] = beside_libraries[row["contender"]]
    mining_speedups(rows)
    for name, why in skipped.items():
        rows.append({"shape": [batch, dim], "dtype": rows[0]["dtype"], "mode": f"mined {mining}",
                     "contender": name, "failed": why})
    for floor_dtype in (torch.float32, torch.bfloat16):
        x = e.detach().to(floor_dtype)
        try:
            t = time_interleaved({"mm": lambda x=x: x @ x.t()}, (), min(rounds, 10), 2)["mm"]
            rows.append({"shape": [batch, dim], "dtype": str(floor_dtype).replace("torch.", ""),
                         "mode": f"mined {mining}", "contender": "B x B x D matmul",
                         "gpu_ms": statistics.median(t)})
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
        del x
    return rows


def mining_speedups(rows):
    """Each contender's step over ours: a library's over ours in the same interleaved run (the
    lower ratio), the plain step's over ours timed beside it."""
    ours = rows[0]
    for row in rows:
        if "step_ms" in row and "step_ms" in ours:
            library = "step_ms_beside_libraries" not in row
            row["fused_speedup"] = row["step_ms"] / ours.get(
                "step_ms_beside_libraries" if library else "step_ms", ours["step_ms"])


def print_mining_table(rows):
    head = (f"{'mode':>18} {'shape':>11} {'dtype':>9} {'contender':>17} {'step ms':>9} "
            f"{'GPU ms':>9} {'fused x':>8} {'launches':>8} {'syncs':>5} {'extra MiB':>10} "
            f"{'loss':>10}")
    print(head)
    print("-" * len(head))
    for r in rows:
        shape = "x".join(str(v) for v in r["shape"])
        lead = f"{r['mode']:>18} {shape:>11} {r['dtype']:>9} {r['contender']:>17}"
        if "failed" in r:
            print(f"{lead} {r['failed']}")
            continue
        def num(key, fmt):
            return format(r[key], fmt) if key in r else "-"
        print(f"{lead} {num('step_ms', '9.3f')} {num('gpu_ms', '9.3f')} "
              f"{num('fused_speedup', '7.2f')}{'x' if 'fused_speedup' in r else ' '} "
              f"{num('launches', '8d')} {num('syncs', '5d')} {num('extra_mib', '10.1f')} "
              f"{num('loss', '10.5f')}")


def readme_mining_table(rows):
    """README's mining table (float32, README_MINING_SHAPES): each case's step (host in the
    window) against the plain fused step and the libraries, and the matmul floor of its GPU
    time."""
    lines = ["| mining | B x D | dtype | fused_triplet step | GPU | launches | plain fused step | "
             "sentence-transformers | pytorch-metric-learning | bf16 matmul |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, shape, dtype in dict.fromkeys((r["mode"], tuple(r["shape"]), r["dtype"])
                                            for r in rows if r["contender"] == "fused_triplet"
                                            and tuple(r["shape"]) in README_MINING_SHAPES
                                            and r["dtype"] == "float32"):
        case = {r["contender"]: r for r in rows if (r["mode"], tuple(r["shape"])) == (mode, shape)
                and (r["dtype"] == dtype or r["contender"] == "B x B x D matmul")}
        floor = [r for r in rows if (r["mode"], tuple(r["shape"])) == (mode, shape)
                 and r["contender"] == "B x B x D matmul" and r["dtype"] == "bfloat16"]
        ours = case["fused_triplet"]

        def other(name):
            r = case.get(name)
            if r is None or "failed" in r:
                return "-" if r is None or "not installed" in r["failed"] else r["failed"]
            return f"{r['step_ms']:.2f} ms ({r['fused_speedup']:.1f}x)"
        floor_text = f"{floor[0]['gpu_ms']:.2f} ms" if floor else "-"
        lines.append(f"| {mode.removeprefix('mined ')} | {shape[0]} x {shape[1]} | {dtype} | "
                     f"**{ours['step_ms']:.2f} ms** | {ours['gpu_ms']:.2f} ms | {ours['launches']} | "
                     f"{other('plain fused step')} | {other('s-t BatchHard')} | "
                     f"{other('pml BatchHard')} | {floor_text} |")
    return "\n".join(lines)


def readme_dropins_table(rows):
    """README's drop-in table: each drop-in's synced step against the class it replaces, and
    the peak extra memory of both."""
    lines = ["| drop-in | library | B x D | fused_triplet step | library's step | extra MiB (ours / "
             "library's) | vs our own mined loss |", "|---|---|---|---:|---:|---:|---:|"]
    for library, variant, shape in dict.fromkeys((r["library"], r["variant"], tuple(r["shape"]))
                                                 for r in rows):
        case = {r["contender"]: r for r in rows
                if (r["library"], r["variant"], tuple(r["shape"])) == (library, variant, shape)}
        ours, theirs = case.get("fused_triplet", {}), case.get(library, {})
        if "step_ms" not in ours:
            continue
        name = variant if library == "sentence-transformers" else (
            f"pml_triplet_loss, {'no miner' if variant == 'None' else variant}")
        their_step = (f"{theirs['step_ms']:.2f} ms ({theirs['fused_speedup']:.1f}x)"
                      if "step_ms" in theirs else theirs.get("failed", theirs.get("skipped", "-")))
        their_mib = f"{theirs['extra_mib']:.0f}" if "extra_mib" in theirs else "-"
        mining, own = next(((contender.split()[-1], r) for contender, r in case.items()
                            if "over_own" in r), ("", {}))
        versus = f"{own['over_own']:.2f}x {mining}" if own else "-"
        lines.append(f"| {name} | {library} | {shape[0]} x {shape[1]} | "
                     f"**{ours['step_ms']:.2f} ms** | {their_step} | "
                     f"{ours['extra_mib']:.0f} / {their_mib} | {versus} |")
    return "\n".join(lines)


def print_table(rows):
    head = (f"{'shape':>16} {'dtype':>8} {'contender':>14} {'median ms':>10} {'TB/s':>6} "
            f"{'% peak':>7} {'fused x':>8} {'max err':>9}")
    if any("extra_mib" in r for r in rows):
        head += f" {'extra MiB':>9}"
    if any("per_call_ms" in r for r in rows):
        head += f" {'per-call ms':>11}"
    print(head)
    print("-" * len(head))
    for r in rows:
        shape = "x".join(str(v) for v in r["shape"])
        extra = f" {r['extra_mib']:>9.1f}" if "extra_mib" in r else ""
        extra += f" {r['per_call_ms']:>11.4f}" if "per_call_ms" in r else ""
        print(f"{shape:>16} {r['dtype']:>8} {r['contender']:>14} {r['median_ms']:>10.4f} "
              f"{r['tbps']:>6.2f} {r['peak_pct']:>6.1f}% {r['fused_speedup']:>7.2f}x "
              f"{r['max_abs_err_vs_eager']:>9.2e}{extra}")


def print_markdown(rows):
    """README-style table: one line per (mode, shape, dtype), the three contenders side by side."""
    print("| mode | shape | dtype | eager ms | compile ms | fused ms | fused TB/s | vs eager "
          "| vs compile |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    cases = dict.fromkeys((r["mode"], "x".join(map(str, r["shape"])), r["dtype"]) for r in rows)
    for mode, shape, dtype in cases:
        by = {r["contender"]: r for r in rows
              if (r["mode"], "x".join(map(str, r["shape"])), r["dtype"]) == (mode, shape, dtype)}
        if not {"eager", "torch.compile", "fused_triplet"} <= by.keys():
            continue
        fused = by["fused_triplet"]
        print(f"| {mode} | {shape} | {dtype} | {by['eager']['median_ms']:.4f} | "
              f"{by['torch.compile']['median_ms']:.4f} | {fused['median_ms']:.4f} | "
              f"{fused['tbps']:.2f} | {by['eager']['fused_speedup']:.2f}x | "
              f"{by['torch.compile']['fused_speedup']:.2f}x |")


def readme_table(rows):
    """README's speed table: the KernelBench shape, forward and forward + backward, fp32 and
    bf16, each contender's median ms and fused_triplet's speedup over it."""
    lines = ["| pass | shape | dtype | eager | torch.compile | fused_triplet | fused TB/s |",
             "|---|---|---|---:|---:|---:|---:|"]
    for mode, shape in README_CASES:
        for dtype in dict.fromkeys(r["dtype"] for r in rows):
            by = {r["contender"]: r for r in rows if r["mode"] == mode and r["dtype"] == dtype
                  and "x".join(map(str, r["shape"])) == shape}
            if len(by) < 3:
                continue
            fused = by["fused_triplet"]
            lines.append(
                f"| {mode} | {shape.replace('x', ' x ')} | {dtype} | "
                f"{by['eager']['median_ms']:.3f} ms ({by['eager']['fused_speedup']:.2f}x) | "
                f"{by['torch.compile']['median_ms']:.3f} ms "
                f"({by['torch.compile']['fused_speedup']:.2f}x) | "
                f"**{fused['median_ms']:.3f} ms** | {fused['tbps']:.2f} |")
    return "\n".join(lines)


def readme_loops_table(rows):
    """README's training-loop table: each loop's step, each contender's median ms and
    fused_triplet's speedup over it, and the loss dtype every contender returns."""
    lines = ["| loop | shape | loss | eager | torch.compile | fused_triplet | fused TB/s |",
             "|---|---|---|---:|---:|---:|---:|"]
    for mode, shape in dict.fromkeys((r["mode"], "x".join(map(str, r["shape"]))) for r in rows):
        by = {r["contender"]: r for r in rows
              if r["mode"] == mode and "x".join(map(str, r["shape"])) == shape}
        if len(by) < 3:
            continue
        fused = by["fused_triplet"]
        lines.append(
            f"| `{mode.removeprefix('loop ')}` | {shape.replace('x', ' x ')} | "
            f"{fused['loss_dtype']} | {by['eager']['median_ms']:.3f} ms "
            f"({by['eager']['fused_speedup']:.2f}x) | {by['torch.compile']['median_ms']:.3f} ms "
            f"({by['torch.compile']['fused_speedup']:.2f}x) | **{fused['median_ms']:.3f} ms** | "
            f"{fused['tbps']:.2f} |")
    return "\n".join(lines)


def merge(paths, json_path, plot_path):
    """Joins the JSON of several runs (parts of a sweep): tables, markdown, JSON and plot."""
    rows, metas = [], []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        metas.append(data["meta"])
        rows += data["results"]
    for mode in dict.fromkeys(r["mode"] for r in rows):
        print_table([r for r in rows if r["mode"] == mode])
    print_markdown(rows)
    if plot_path:
        plot(rows, plot_path, metas[0].get("gpu", "GPU") if metas else "GPU")
    if json_path:
        with open(json_path, "w") as f:
            meta = {**(metas[0] if metas else {}), "parts": metas}  # gpu, torch, date: the first's
            json.dump({"meta": meta, "results": rows}, f, indent=1)
    return 0


def plot(rows, path, gpu_name):
    """Effective TB/s per case and contender, one panel per (mode, dtype), peak as a line."""
    try:
        import matplotlib
    except ImportError:
        print(f"bench.py: matplotlib is not installed; no plot written to {path}")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["mode"], r["dtype"]) for r in rows})
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3.6 * len(panels)), squeeze=False)
    for ax, (mode, dtype) in zip(axes[:, 0], panels):
        sub = [r for r in rows if r["mode"] == mode and r["dtype"] == dtype]
        cases = list(dict.fromkeys("x".join(map(str, r["shape"])) for r in sub))
        contenders = list(dict.fromkeys(r["contender"] for r in sub))
        width = 0.8 / len(contenders)
        for k, name in enumerate(contenders):
            values = [next(r["tbps"] for r in sub if r["contender"] == name
                           and "x".join(map(str, r["shape"])) == c) for c in cases]
            ax.bar([i + k * width for i in range(len(cases))], values, width, label=name)
        ax.axhline(PEAK_TBPS, color="k", linestyle="--", linewidth=1, label=f"peak {PEAK_TBPS} TB/s")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))], cases, fontsize=8)
        ax.set_ylabel("effective TB/s")
        ax.set_title(f"{mode}, {dtype}, {gpu_name}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"bench.py: plot written to {path}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", help=f"comma list of BxD (default {DEFAULT_SHAPES}; "
                        "with --sweep, its shapes)")
    parser.add_argument("--dtypes", help="comma list of " + ",".join(DTYPES) +
                        " (default fp32; with --sweep, fp32,bf16)")
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds (median)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed rounds first")
    parser.add_argument("--backward", action="store_true",
                        help="time forward + backward (grads of all inputs), with peak extra "
                        "memory: loss.backward() and (0.5 * loss).backward()")
    parser.add_argument("--loops", action="store_true",
                        help="time training loops (" + ", ".join(LOOPS) + ") at "
                        + LOOP_SHAPES + " (or --shapes)")
    parser.add_argument("--mining", action="store_true",
                        help="time mined_triplet_margin_loss (fwd+bwd) against the formulations "
                        "users write today: " + ", ".join(f"{m} {b}x{d} {t}"
                                                         for m, b, d, t in MINING_CASES))
    parser.add_argument("--dropins", action="store_true",
                        help="time the drop-ins (fwd+bwd) against the library classes they "
                        "replace: " + ", ".join(f"{v} {b}x{d}" for _, v, b, d in DROPIN_CASES))
    parser.add_argument("--cpu", action="store_true",
                        help="time torch's path on CPU (fwd+bwd, the host clock): the mined "
                        "losses and every drop-in against the libraries at " +
                        ", ".join(f"{b}x{d}" for b, d in CPU_SHAPES) +
                        f" (recorded: {CPU_RESULTS})")
    parser.add_argument("--sweep", action="store_true",
                        help="fp32 and bf16 over " + SWEEP_SHAPES + " (forward; --backward adds both fwd+bwd)")
    parser.add_argument("--host-latency", action="store_true",
                        help="no device sleep before each timed call: host launch latency counts")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="no timing: join earlier --json outputs (tables, --json, --plot)")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of effective TB/s per case "
                        "(needs matplotlib)")
    parser.add_argument("--readme-table", action="store_true",
                        help=f"no timing: print README's speed tables from {RESULTS}, "
                        f"{LOOP_RESULTS}, {MINING_RESULTS} and {DROPIN_RESULTS}")
    args = parser.parse_args(argv)
    if args.readme_table:
        with open(RESULTS) as f:
            print(readme_table(json.load(f)["results"]))
        if os.path.exists(LOOP_RESULTS):
            with open(LOOP_RESULTS) as f:
                print("\n" + readme_loops_table(json.load(f)["results"]))
        if os.path.exists(MINING_RESULTS):
            with open(MINING_RESULTS) as f:
                print("\n" + readme_mining_table(json.load(f)["results"]))
        if os.path.exists(DROPIN_RESULTS):
            with open(DROPIN_RESULTS) as f:
                print("\n" + readme_dropins_table(json.load(f)["results"]))
        if os.path.exists(CPU_RESULTS):
            with open(CPU_RESULTS) as f:
                print("\n" + readme_cpu_table(json.load(f)["results"]))
        return 0
    if args.cpu:
        rows = []
        for batch, dim in CPU_SHAPES:
            for family, variant in CPU_CASES:
                small = batch < 1024  # the libraries' cubes take seconds a step at 1024 rows
                case_rows = bench_cpu(family, variant, batch, dim,
                                      rounds=args.rounds if small else min(args.rounds, 5),
                                      warmup=args.warmup if small else 1)
                rows += case_rows
                for row in case_rows:
                    print(f"{str(variant):>30} {batch}x{dim:<5} {row['contender']:>24} "
                          f"{row.get('step_ms', float('nan')):10.2f} ms "
                          f"{row.get('over_fused', float('nan')):6.2f}x "
                          f"{row.get('skipped', '')}", flush=True)
        write_json(args.json, None, rows)
        return 0
    if args.merge:
        return merge(args.merge, args.json, args.plot)
    if args.host_latency:
        global DEVICE_LEAD_CYCLES
        DEVICE_LEAD_CYCLES = 0
    # --sweep with --shapes/--dtypes runs part of the sweep (forward and, with --backward,
    # forward + backward): the whole one outlasts a 600 s device call.
    args.shapes = args.shapes or (SWEEP_SHAPES if args.sweep else
                                  LOOP_SHAPES if args.loops else DEFAULT_SHAPES)
    args.dtypes = args.dtypes or ("fp32,bf16" if args.sweep else "fp32")
    if not torch.cuda.is_available():
        recorded = MINING_RESULTS if args.mining else DROPIN_RESULTS if args.dropins else \
            LOOP_RESULTS if args.loops else (
            f"{RESULTS} (plot: results/h200_sweep.png)")
        print(f"bench.py: no CUDA GPU visible, so nothing to time here. The recorded H200 numbers "
              f"are in {recorded}; README's tables: python bench.py --readme-table.",
              file=sys.stderr)
        return 2

    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"{datetime.date.today()}; 'fused x' = contender time / fused_triplet time")
    fused_triplet.build()
    if args.mining:
        rows = []
        for case in MINING_CASES:
            _, batch, dim, _ = case
            small = batch <= 4096  # well under a second per round: all rounds
            case_rows = bench_mining(*case, rounds=args.rounds if small else min(args.rounds, 5),
                                     warmup=args.warmup if small else min(args.warmup, 1))
            rows += case_rows
            torch.cuda.empty_cache()
            print_mining_table(case_rows)
        print_mining_table(rows)
        write_json(args.json, props, rows)
        return 0
    if args.dropins:
        rows = []
        for case in DROPIN_CASES:
            case_rows = bench_dropin(*case, rounds=args.rounds if case[2] <= 1024 else 5,
                                     warmup=args.warmup if case[2] <= 1024 else 1)
            rows += case_rows
            torch.cuda.empty_cache()
            for row in case_rows:
                print(f"{row['variant']:>30} {'x'.join(map(str, row['shape'])):>9} "
                      f"{row['contender']:>24} {row.get('step_ms', float('nan')):10.3f} ms "
                      f"{row.get('extra_mib', float('nan')):9.1f} MiB "
                      f"{row.get('fused_speedup', float('nan')):7.1f}x "
                      f"{row.get('skipped', row.get('failed', ''))}", flush=True)
        write_json(args.json, props, rows)
        return 0
    if args.loops:
        rows = []
        for shape in parse_shapes(args.shapes):
            for name in LOOPS:
                case = bench_loop(shape, name, args.rounds, args.warmup)
                rows += case
                torch.cuda.empty_cache()
                print(f"# {case[0]['mode']} {'x'.join(map(str, shape))}: fused "
                      f"{case[-1]['median_ms']:.4f} ms ({case[-1]['loss_dtype']} loss), "
                      f"{case[0]['fused_speedup']:.2f}x eager, {case[1]['fused_speedup']:.2f}x "
                      "torch.compile", flush=True)
        print_table(rows)
        write_json(args.json, props, rows)
        return 0
    benches = [bench_backward, bench_backward_weighted] if args.backward else [bench_forward]
    if args.sweep and args.backward:
        benches.insert(0, bench_forward)
    rows = []
    for bench in benches:
        for dtype_name in args.dtypes.split(","):
            for shape in parse_shapes(args.shapes):
                case = bench(shape, DTYPES[dtype_name], args.rounds, args.warmup)
                rows += case
                torch.cuda.empty_cache()
                ours = case[-1]
                print(f"# {case[0]['mode']} {'x'.join(map(str, shape))} {dtype_name}: fused "
                      f"{ours['median_ms']:.4f} ms, {ours['tbps']:.2f} TB/s, "
                      f"{case[0]['fused_speedup']:.2f}x eager, {case[1]['fused_speedup']:.2f}x "
                      "torch.compile", flush=True)
    for mode in dict.fromkeys(r["mode"] for r in rows):
        print_table([r for r in rows if r["mode"] == mode])
    if args.plot:
        plot(rows, args.plot, props.name)
    write_json(args.json, props, rows)
    return 0


def write_json(path, props, rows):
    if not path:
        return
    meta = {"gpu": props.name if props else None, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "date": str(datetime.date.today()),
            "device_lead_cycles": DEVICE_LEAD_CYCLES, "mining_lead_factor": MINING_LEAD_FACTOR}
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
