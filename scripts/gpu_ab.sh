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
variants="div_skip_zero"
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
# The pointwise backward's fp32 division by the distance takes its slow-path subroutine when the
# numerator is 0 (session i, ncu: an inactive hinge; under swap, the unchosen distance): base
# against div_skip_zero (no division for a zero numerator; same values), with the inputs' usual
# hinges (margin 1: nearly all active) and with about half inactive (margin 0.001; torch wants a
# margin > 0), and with swap (the distance not chosen gets a zero numerator on every row). Each
# variants.py run times torch.compile too (~25 s per contender).
for c in "4096x512 bf16 1.0" "4096x512 bf16 0.001" "4096x512 bf16 1.0 --swap" \
         "1024x128 fp32 0.001"; do
  set -- $c
  timeout 100 python3 scripts/variants.py --backward --shape "$1" --dtype "$2" --margin "$3" \
    ${4:-} $v base,div_skip_zero | tee "$out/ab_$1_$2_m$3${4:-}.txt"
done
