#!/usr/bin/env bash
# The full test suite on a machine with a GPU in under 10 minutes: one build, then four pytest
# processes at once (the >2^31-element tests, which skip themselves if the
# others leave too little GPU memory; the CUDA kernel tests; the build/export/API/CPU tests,
# whose rebuilds are CPU work; the 10,000-case fuzz). About 4 minutes on the H200 host.
# Logs go to $LOG_DIR (default ./gpu_logs); prints each group's summary line; non-zero if any failed.
#   bash scripts/gpu_suite.sh [fuzz cases, default 10000]
set -uo pipefail
out="${LOG_DIR:-gpu_logs}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/fused_triplet_ext}"
( time python3 fused_triplet.py --build ) > "$out/suite_build.log" 2>&1 || { tail -30 "$out/suite_build.log"; exit 1; }
run() {  # name, pytest args...
  local name=$1; shift
  timeout 420 python3 -m pytest "$@" -v -rs --durations=5 > "$out/pytest_$name.txt" 2>&1
  echo "$?" > "$out/pytest_$name.rc"
}
run big tests/test_cuda_reliability.py &
run kernels tests/test_cuda.py tests/test_cuda_backward.py &
run rest tests --ignore=tests/test_cuda_reliability.py --ignore=tests/test_cuda.py \
  --ignore=tests/test_cuda_backward.py &
FUSED_TRIPLET_FUZZ_CASES="${1:-10000}" run fuzz_long tests/test_fuzz.py -k cuda &
wait
status=0
for name in big kernels rest fuzz_long; do
  echo "$name (rc $(cat "$out/pytest_$name.rc")): $(tail -1 "$out/pytest_$name.txt")"
  [ "$(cat "$out/pytest_$name.rc")" -eq 0 ] || status=1
done
exit $status
