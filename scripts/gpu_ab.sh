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
variants="split_slice4k split_slice2k split_slice8k split_blocks256 bwd_pointwise_1g"
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
# Session m chained the forward's follow-up kernel (the combining of split rows costs less now)
# and halved the slices per split row (kSplitBlocks 512). Still behind torch.compile: (128, 4096)
# bf16 forward 0.0095 vs 0.0090 ms; its timeline has our main kernel at 4.26 us against
# compile's 3.14 us reduction kernel, 128 blocks for 132 SMs. Queued: split those rows too
# (kMinSliceBytes 32 KiB -> 8 / 4 / 2 KiB: 4096 fp32 rows into 2 / 4 slices, bf16 into 1 / 2 /
# 4), and fewer slices still for split rows (256 blocks).
# Each variants.py run times torch.compile too (~25 s per contender); forward unless --backward.
ab() {  # shape dtype variant,variant... [--backward]
  timeout 150 python3 scripts/variants.py --shape "$1" --dtype "$2" ${4:-} $v "base,$3" \
    | tee "$out/ab_$1_$2${4:-}.txt"
}
if [ "$1" = ab ]; then
  ab 128x4096 fp32 split_slice8k,split_slice4k
  ab 128x4096 bf16 split_slice4k,split_slice2k
  ab 4x16777216 bf16 split_blocks256
  ab 16x4194304 bf16 split_blocks256
  exit 0
fi
# Session m's sweep: (262144, 256) and (65536, 1024) fp32 forward 0.98x torch.compile, fwd+bwd
# 0.96-0.97x in both dtypes. Queued: the pointwise backward (compile's kind) above 16 MiB per
# input. (A register cap for more resident team-forward blocks spills: scripts/variants.py.)
ab 262144x256 fp32 bwd_pointwise_1g --backward
ab 65536x1024 bf16 bwd_pointwise_1g --backward
