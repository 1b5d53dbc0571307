#!/usr/bin/env bash
# One device call for unmeasured kernels: build, the CUDA tests that cover the bulk-copy paths,
# compute-sanitizer, then A/B timings of scripts/variants.py variants (edit the lists below).
# Each step has its own time limit so a slow one cannot starve the rest; logs go to $OUT
# (or ./gpu_logs).
#   bash scripts/gpu_ab.sh
set -uo pipefail
out="${OUT:-gpu_logs}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/fused_triplet_ext}"
v="--only"
( time python3 fused_triplet.py --build ) > "$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
# Variant builds in the background (CPU) while the tests use the GPU.
for n in bwd_flat_all bwd_nobulk bwd_nobulk_16bit_u4 split_ldg; do
  python3 scripts/variants.py --child build "$n" > "$out/build_$n.log" 2>&1 &
done
timeout 200 python3 -m pytest tests/test_cuda_backward.py tests/test_cuda.py -q -x \
  -k "bulk or flat or strided or split or deterministic or matches_torch or dtypes" \
  > "$out/pytest_ab.txt" 2>&1
tail -3 "$out/pytest_ab.txt"
timeout 150 bash scripts/sanitize.sh | tee "$out/sanitize_summary.txt"
wait
timeout 80 python3 scripts/variants.py --backward $v base,bwd_flat_all | tee "$out/ab_32768x8192.txt"
timeout 80 python3 scripts/variants.py --backward --shape 65536x1024 --dtype bf16 \
  $v base,bwd_nobulk,bwd_nobulk_16bit_u4 | tee "$out/ab_65536x1024_bf16.txt"
timeout 60 python3 scripts/variants.py --shape 16x4194304 $v base,split_ldg \
  | tee "$out/ab_split_forward.txt"
