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
variants="fwd_chunk_8k_all bulk_persist4 bulk_persist2"
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
# Session k merged the forward ring 4 x 4 KiB for 2-byte dtypes (4 x 8 KiB before), measured
# at (32768, 8192) bf16 only (0.3700 ms vs 0.4005). The other bf16 shapes whose rows take the
# bulk forward were not A/B'd: split rows (4x16777216, 16x4194304; 4x16777216 read 0.1228 ms vs
# compile 0.1175 after it, 0.1194 vs 0.1165 in session i's sweep) and 8 KiB rows that a block
# takes (128x4096). fwd_chunk_8k_all is the ring before k. Persistent grids of 4 or 2 blocks
# per SM over the new 48 KiB ring (bulk_persist2 gained 6% over the 96 KiB ring in bf16).
# Each variants.py run times torch.compile too (~25 s per contender); forward unless --backward.
ab() {  # shape dtype variant,variant... [--backward]
  timeout 150 python3 scripts/variants.py --shape "$1" --dtype "$2" ${4:-} $v "base,$3" \
    | tee "$out/ab_$1_$2${4:-}.txt"
}
ab 4x16777216 bf16 fwd_chunk_8k_all
ab 16x4194304 bf16 fwd_chunk_8k_all
ab 128x4096 bf16 fwd_chunk_8k_all
ab 32768x8192 bf16 fwd_chunk_8k_all --backward
ab 32768x8192 bf16 bulk_persist4,bulk_persist2
