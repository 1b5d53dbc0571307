#!/usr/bin/env bash
# Unmeasured kernels on the GPU machine, in device calls of < 600 s (back to back, so later
# calls find the first's builds on the still-warm machine; a cold one rebuilds them):
#   bash scripts/gpu_ab.sh test   # build, the CUDA kernel tests, compute-sanitizer (variant
#                                 # builds compile in the background meanwhile)
#   bash scripts/gpu_ab.sh ab     # A/B timings of scripts/variants.py variants (lists below)
#   bash scripts/gpu_ab.sh ab2    # the rest of the list (each part < 600 s)
# Each step has its own time limit so a slow one cannot starve the rest; logs go to $OUT (or
# ./gpu_logs).
set -uo pipefail
out="${OUT:-gpu_logs}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/fused_triplet_ext}"
variants="backward_in_order bwd_pointwise_x2 bwd_pointwise_1g_x2 no_rows_ring rows_ring_min4m"
v="--only"
( time python3 fused_triplet.py --build ) > "$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
if [ "${1:-test}" = test ]; then
  for n in $variants; do
    python3 scripts/variants.py --child build "$n" > "$out/build_$n.log" 2>&1 &
  done
  timeout 240 python3 -m pytest tests/test_cuda_backward.py tests/test_cuda.py -q -x \
    > "$out/pytest_ab.txt" 2>&1
  tail -3 "$out/pytest_ab.txt"
  timeout 180 bash scripts/sanitize.sh | tee "$out/sanitize_summary.txt"
  wait
  exit 0
fi
# Each variants.py run times torch.compile too (~25 s per contender); forward unless --backward.
# tree= contenders join where their folders exist (passed to the device with carry [".ab"]):
# .ab/main = main's kernels (`git archive main | tar -x -C .ab/main`), .ab/rev = branch
# reverse-backward's (the reversed backward with main's pointwise kernel).
trees=""; for t in main rev; do [ -d .ab/$t/kernels ] && trees="$trees,tree=.ab/$t"; done
ab() {  # shape dtype variant,variant... [--backward]
  timeout 150 python3 scripts/variants.py --shape "$1" --dtype "$2" ${4:-} $v "base,$3" \
    | tee "$out/ab_$1_$2${4:-}.txt"
}
if [ "$1" = ab ]; then
  # Branch rev-packs (session o) = reverse-backward + pointwise-packs, neither yet run on a GPU.
  # reverse-backward: every backward kernel walks the rows from the last one down, so the rows
  # the forward read last can come from L2 (backward_in_order: in order). pointwise-packs: the
  # pointwise backward without its grid-stride loop, kPointwisePacks packs per thread (Triton's
  # gives a thread 2 fp32 packs); fwd+bwd (4096, 512) ran 0.94x (fp32) / 0.92x (bf16)
  # torch.compile in session n's sweep.
  ab 32768x8192 fp32 "backward_in_order$trees" --backward
  ab 262144x256 fp32 "backward_in_order,bwd_pointwise_1g_x2" --backward
  ab 4096x512 fp32 "backward_in_order,bwd_pointwise_x2$trees" --backward
  ab 4096x512 bf16 "backward_in_order,bwd_pointwise_x2$trees" --backward
  exit 0
fi
# The rest: other backward kernels reversed (flat bf16, split rows), the short-rows ring's
# threshold, not yet timed: at 16 MiB per input (16384x256, 4096x1024 fp32) ring vs team
# (no_rows_ring), and from 4 MiB (rows_ring_min4m at 8 MiB: 8192x256, 2048x1024 fp32).
ab 65536x1024 bf16 backward_in_order --backward
ab 16x4194304 fp32 backward_in_order --backward
ab 16384x256 fp32 no_rows_ring
ab 4096x1024 fp32 no_rows_ring
ab 8192x256 fp32 rows_ring_min4m
ab 2048x1024 fp32 rows_ring_min4m
