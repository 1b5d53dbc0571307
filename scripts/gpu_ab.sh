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
variants="split_fill512 chain_follow_ups"
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
  # Where (128, 4096) forward's ~1 us behind torch.compile goes: each contender's kernels and
  # the gaps between them, in order (scripts/profile_case.py --timeline).
  for c in fused compile; do
    timeout 90 python3 scripts/profile_case.py --shape 128x4096 --dtype fp32 --forward-only \
      --contender $c --timeline > "$out/timeline_128x4096_fp32_$c.txt" 2>&1
    tail -8 "$out/timeline_128x4096_fp32_$c.txt"
  done
  wait
  exit 0
fi
# Session l: more column slices per split row were slower ((4, 16777216) bf16 forward: 2048
# blocks 0.1324 ms, 4096 0.1521, 1024 0.1209; torch.compile 0.1183); fewer (512 blocks, slices
# twice as long) not yet measured. The fill constant also sets the team rule's and the backward's
# few-rows thresholds, so time fwd+bwd too. chain_follow_ups: the forward's one-block follow-up
# kernel chained to its main grid (programmatic dependent launch; kChainFollowUps), for the small
# cases torch.compile wins by ~1 us ((128, 4096) fp32 and bf16) and split rows.
# Each variants.py run times torch.compile too (~25 s per contender); forward unless --backward.
ab() {  # shape dtype variant,variant... [--backward]
  timeout 150 python3 scripts/variants.py --shape "$1" --dtype "$2" ${4:-} $v "base,$3" \
    | tee "$out/ab_$1_$2${4:-}.txt"
}
ab 4x16777216 bf16 split_fill512,chain_follow_ups
ab 16x4194304 bf16 split_fill512
ab 4x16777216 fp32 split_fill512
ab 16x4194304 fp32 split_fill512 --backward
ab 128x4096 fp32 chain_follow_ups
ab 128x4096 bf16 chain_follow_ups
