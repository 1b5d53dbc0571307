#!/usr/bin/env bash
# Unmeasured kernels on the GPU machine, in device calls of < 600 s (back to back, so later
# calls find the first's builds on the still-warm machine; a cold one rebuilds them):
#   bash scripts/gpu_ab.sh test   # build, the CUDA kernel tests, compute-sanitizer (variant
#                                 # builds compile in the background meanwhile)
#   bash scripts/gpu_ab.sh ab     # A/B timings of scripts/variants.py variants (lists below)
#   bash scripts/gpu_ab.sh ab2    # the rest of the list, when there is one (each part < 600 s)
# Each step has its own time limit so a slow one cannot starve the rest; logs go to $OUT (or
# ./gpu_logs).
set -uo pipefail
out="${OUT:-gpu_logs}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/fused_triplet_ext}"
variants="bwd_pointwise_x1 bwd_pointwise_x4"
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
ab() {  # shape dtype variant,variant... [--backward]
  timeout 150 python3 scripts/variants.py --shape "$1" --dtype "$2" ${4:-} $v "base,$3" \
    | tee "$out/ab_$1_$2${4:-}.txt"
}
if [ "$1" = ab ]; then
  # Session o merged 2 pointwise-backward packs per thread and timed 1 / 2 / 4 at (1024, 128)
  # bf16, (128, 4096) bf16 and (4096, 512) fp32 (results/h200_variants_2026-11-30o.txt); the
  # rest of the shapes the pointwise kernel takes. (The short-rows ring's threshold, timed in
  # session o: branch ring-threshold.)
  ab 1024x128 fp32 bwd_pointwise_x1,bwd_pointwise_x4 --backward
  ab 128x4096 fp32 bwd_pointwise_x1,bwd_pointwise_x4 --backward
  ab 4096x512 bf16 bwd_pointwise_x1,bwd_pointwise_x4 --backward
  exit 0
fi
