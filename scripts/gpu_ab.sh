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
variants="plain_stores approx_div"
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
# Where the small pointwise backward loses to Triton's (its load order is not it, session h):
# base against plain stores of the gradients (plain_stores) and approximate fp32 division
# (approx_div), at the two shapes of session g's kernel timeline. Each variants.py run times
# torch.compile too (~25 s per contender).
for c in "4096x512 bf16" "1024x128 fp32"; do
  set -- $c
  timeout 130 python3 scripts/variants.py --backward --shape "$1" --dtype "$2" \
    $v base,plain_stores,approx_div | tee "$out/ab_$1_$2.txt"
done
