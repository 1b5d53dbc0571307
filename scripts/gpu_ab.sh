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
variants="tpr_8packs_warp team8_16packs"
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
# Team sizes for rows of 4-8 KiB (session j merged a team of 8 for <= 64 packs only; a warp
# still takes up to 512 packs, 16 per thread): tpr_8packs_warp caps a warp at 256 packs
# (4 KiB), so rows over 4 KiB up to 8 KiB take whole blocks (8 KiB: the bulk forward).
# team8_16packs is the rule before session j, as a check of its gain. Each variants.py run
# times torch.compile too (~25 s per contender); forward only unless --backward.
for c in "65536x2048 fp32" "32768x4096 bf16" "65536x1536 fp32" "65536x1024 bf16 --backward"; do
  set -- $c
  timeout 100 python3 scripts/variants.py --shape "$1" --dtype "$2" ${3:-} \
    $v base,$(echo $variants | tr ' ' ,) | tee "$out/ab_$1_$2${3:-}.txt"
done
