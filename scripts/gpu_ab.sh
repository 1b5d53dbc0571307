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
variants="pointwise_nc_loads pointwise_in_order bwd_pointwise_max16m tree=.ab/main"
v="--only"
( time python3 fused_triplet.py --build ) > "$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
if [ "${1:-test}" = test ]; then
  for n in $variants; do
    python3 scripts/variants.py --child build "$n" > "$out/build_${n//\//_}.log" 2>&1 &
  done
  timeout 240 python3 -m pytest tests/test_cuda_backward.py tests/test_cuda.py -q -x \
    > "$out/pytest_ab.txt" 2>&1
  tail -3 "$out/pytest_ab.txt"
  timeout 180 bash scripts/sanitize.sh | tee "$out/sanitize_summary.txt"
  wait
  exit 0
fi
# Each variants.py run times torch.compile too (~25 s per contender); forward unless --backward.
ab() {  # shape dtype variant,variant... [--backward]
  timeout 150 python3 scripts/variants.py --shape "$1" --dtype "$2" ${4:-} $v "base,$3" \
    | tee "$out/ab_$1_$2${4:-}.txt"
}
if [ "$1" = ab ]; then
  # Branch pointwise-all (session p, not yet run on a GPU): the pointwise backward, with plain
  # loads, for contiguous aligned rows of every size (session p, up to 1 GiB per input: faster
  # than the row ring and torch.compile at (32768, 8192) fp32, 2.2497 ms, and than the flat ring
  # at (262144, 256) fp32); the flat ring removed. Against main's kernels (tree=.ab/main: make
  # it with `mkdir -p .ab/main && git archive main kernels | tar -x -C .ab/main` and pass
  # carry [".ab"]), the pointwise blocks in order, and its no-allocate loads where it ran
  # before (<= 16 MiB per input).
  ab 32768x8192 fp32 tree=.ab/main,pointwise_in_order --backward
  ab 65536x1024 bf16 tree=.ab/main,pointwise_in_order --backward
  ab 262144x256 bf16 tree=.ab/main --backward
  ab 16x4194304 fp32 tree=.ab/main --backward
  ab 4096x512 bf16 pointwise_nc_loads,pointwise_in_order --backward
  ab 4096x512 fp32 pointwise_nc_loads --backward
  exit 0
fi
# ab2: the sweep's other shapes, and the ring at 1 GiB (bwd_pointwise_max16m).
ab 262144x256 fp32 tree=.ab/main --backward
ab 65536x1024 fp32 tree=.ab/main --backward
ab 32768x8192 bf16 tree=.ab/main --backward
ab 4x16777216 fp32 tree=.ab/main --backward
ab 16x4194304 bf16 tree=.ab/main,bwd_pointwise_max16m --backward
ab 128x4096 bf16 pointwise_nc_loads --backward
ab 1024x128 bf16 pointwise_nc_loads --backward
