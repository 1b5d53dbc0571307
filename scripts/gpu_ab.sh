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
variants="plain_loads pointwise_nc_loads bwd_pointwise_max16m"
v="--only"
( time python3 fused_triplet.py --build ) > "$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
if [ "${1:-test}" = test ]; then
  for n in $variants; do
    python3 scripts/variants.py --child build "$n" > "$out/build_${n//\//_}.log" 2>&1 &
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
  # Plain loads in the team kernel (session r: (65536, 1024) bf16 forward 1.6% faster, the
  # rest within the spread), again and at the other shapes the team kernel takes.
  ab 65536x1024 bf16 plain_loads
  ab 65536x1024 bf16 plain_loads --backward
  ab 262144x256 bf16 plain_loads
  ab 4096x512 bf16 plain_loads,pointwise_nc_loads --backward
  exit 0
fi
# ab2: the small shapes session r did not time for the pointwise backward's plain loads, and
# the ring at 1 GiB of bf16.
ab 4096x512 fp32 pointwise_nc_loads --backward
ab 128x4096 bf16 pointwise_nc_loads --backward
ab 16x4194304 bf16 bwd_pointwise_max16m --backward
