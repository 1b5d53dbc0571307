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
variants="tpr_8packs_warp team8_16packs nobulk bulk_16k_x2 bulk_4k_x4 bulk_persist2 bulk_unroll2"
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
# 1. Team sizes for rows of 4-8 KiB (session j merged a team of 8 for <= 64 packs only; a warp
#    still takes up to 512 packs, 16 per thread): tpr_8packs_warp caps a warp at 256 packs
#    (4 KiB), so rows over 4 KiB up to 8 KiB take whole blocks (8 KiB: the bulk forward).
#    team8_16packs is the rule before session j, as a check of its gain.
# 2. The bulk forward's ring for bf16: its shape was chosen at (32768, 8192) fp32 only (4.57
#    TB/s); bf16 there reaches 4.08 (torch.compile 4.23). A bf16 row is 2 chunks per input, so
#    each block's ring runs dry at its end (fp32: 4 chunks): register loads (nobulk), other
#    rings, and 2 persistent blocks per SM streaming row after row (bulk_persist2; fp32: 0.8%
#    slower), and the consumer loop unrolled by 2 (bulk_unroll2: in the SASS each iteration takes
#    one pack of each input and waits on its shared-memory loads).
# Each variants.py run times torch.compile too (~25 s per contender); forward unless --backward.
ab() {  # shape dtype variant,variant... [--backward]
  timeout 150 python3 scripts/variants.py --shape "$1" --dtype "$2" ${4:-} $v "base,$3" \
    | tee "$out/ab_$1_$2${4:-}.txt"
}
ab 65536x2048 fp32 tpr_8packs_warp
ab 32768x4096 bf16 tpr_8packs_warp
ab 65536x1536 fp32 tpr_8packs_warp
ab 65536x1024 bf16 team8_16packs --backward
ab 32768x8192 bf16 nobulk,bulk_16k_x2,bulk_4k_x4,bulk_persist2,bulk_unroll2
