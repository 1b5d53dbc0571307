#!/usr/bin/env bash
# Runs scripts/sanitize_driver.py under compute-sanitizer's memcheck, racecheck, initcheck and
# synccheck; prints each tool's summary line. Logs go to $LOG_DIR (default ./gpu_logs).
# Exit status: non-zero if any tool reported an error. Arguments go to the driver (--mining).
set -uo pipefail
out="${LOG_DIR:-gpu_logs}"; mkdir -p "$out"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/fused_triplet_ext}"
sanitizer="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
python3 fused_triplet.py --build > "$out/sanitize_build.log" 2>&1 || exit 1
status=0
for tool in memcheck racecheck initcheck synccheck; do
  "$sanitizer" --tool "$tool" --error-exitcode 99 python3 scripts/sanitize_driver.py "$@" \
    > "$out/sanitize_$tool.txt" 2>&1
  rc=$?
  echo "$tool: exit $rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitize_$tool.txt" | tail -1)"
  [ "$rc" -eq 0 ] || status=1
done
exit $status
