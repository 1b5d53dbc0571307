#!/usr/bin/env bash
# Runs scripts/sanitize_driver.py under compute-sanitizer's memcheck, racecheck, initcheck and
# synccheck, each part of the driver in a process of its own (racecheck's host memory grows with
# every launch); prints each run's summary line. Logs go to $LOG_DIR (default ./gpu_logs).
# Exit status: non-zero if any run reported an error.
#   bash scripts/sanitize.sh [PART ...]   (the driver's parts: plans rows ring onepass mining)
set -uo pipefail
out="${LOG_DIR:-gpu_logs}"; mkdir -p "$out"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/fused_triplet_ext}"
sanitizer="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
parts=("$@"); [ "${#parts[@]}" -gt 0 ] || parts=(plans rows ring onepass mining)
python3 fused_triplet.py --build > "$out/sanitize_build.log" 2>&1 || exit 1
status=0
for tool in memcheck racecheck initcheck synccheck; do
  for part in "${parts[@]}"; do
    log="$out/sanitize_${tool}_$part.txt"
    "$sanitizer" --tool "$tool" --error-exitcode 99 python3 scripts/sanitize_driver.py "$part" \
      > "$log" 2>&1
    rc=$?
    echo "$tool $part: exit $rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)"
    [ "$rc" -eq 0 ] || status=1
  done
done
exit $status
