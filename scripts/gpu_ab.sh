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
variants="cs_stores no_rows_ring rows_ring_min16m rows_ring_per16 rows_ring_one_wave"
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
  # Branches plain-stores and ring-threshold (session o, first run on a GPU in session p).
  # Plain-stores: gradients stored with plain stores except fp64 (evict-first before; 0.35%
  # faster at (32768, 8192) fp32 with the 4 x 8 KiB ring, results/h200_variants_backward_2026-11-29.txt);
  # fwd+bwd against cs_stores (main's stores).
  ab 32768x8192 fp32 cs_stores --backward
  ab 262144x256 fp32 cs_stores --backward
  # Ring-threshold: the forward's short-rows ring from 128 MiB per input, not 16 (at 16 and
  # 64 MiB it ran slower than the team kernel). Against the team kernel (no_rows_ring), main's
  # 16 MiB (rows_ring_min16m) and, from 16 MiB, longer ring blocks (rows_ring_per16: 16 chunks
  # each; rows_ring_one_wave: chunks / 264 each).
  ab 65536x256 fp32 no_rows_ring,rows_ring_min16m,rows_ring_per16,rows_ring_one_wave
  ab 16384x1024 fp32 no_rows_ring,rows_ring_min16m,rows_ring_per16,rows_ring_one_wave
  exit 0
fi
# ab2: the rest of both lists.
ab 65536x1024 bf16 cs_stores --backward
ab 4096x512 bf16 cs_stores --backward
ab 131072x256 fp32 no_rows_ring,rows_ring_one_wave
ab 262144x256 fp32 no_rows_ring,rows_ring_one_wave
