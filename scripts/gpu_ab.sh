#!/usr/bin/env bash
# Unmeasured kernels on the GPU machine, in two device calls of < 600 s (back to back, so the
# second finds the first's builds on the still-warm machine; a cold one rebuilds them):
#   bash scripts/gpu_ab.sh test   # build, the CUDA kernel tests, compute-sanitizer (variant
#                                 # builds compile in the background meanwhile)
#   bash scripts/gpu_ab.sh ab     # A/B timings of scripts/variants.py variants (lists below)
# Each step has its own time limit so a slow one cannot starve the rest; logs go to $OUT (or
# ./gpu_logs).
set -uo pipefail
out="${OUT:-gpu_logs}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/fused_triplet_ext}"
variants="bwd_no_pointwise bwd_pointwise_32m split_slice8k split_slice4k"
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
# The pointwise backward (<= 8 MiB per input) against the flat kernel it replaces there
# (bwd_no_pointwise) and a 32 MiB threshold.
for c in "4096x512 bf16" "4096x512 fp32" "1024x128 fp32" "8192x1024 bf16"; do
  set -- $c
  timeout 70 python3 scripts/variants.py --backward --shape "$1" --dtype "$2" \
    $v base,bwd_no_pointwise,bwd_pointwise_32m | tee "$out/ab_$1_$2.txt"
done
# Forward: few rows of 8-32 KiB (128 x 4096: 128 blocks; torch.compile 0.84-0.91x faster)
# split into column slices of >= 8 or 4 KiB instead of >= 32 KiB.
for c in "128x4096 fp32" "128x4096 bf16"; do
  set -- $c
  timeout 50 python3 scripts/variants.py --shape "$1" --dtype "$2" \
    $v base,split_slice8k,split_slice4k | tee "$out/ab_fwd_$1_$2.txt"
done
