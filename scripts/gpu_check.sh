#!/usr/bin/env bash
# Build, benchmark and run the test suite on a machine with a GPU.
# Logs go to $LOG_DIR (default ./gpu_logs).
#   bash scripts/gpu_check.sh [bench args...]
set -uo pipefail
out="${LOG_DIR:-gpu_logs}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/fused_triplet_ext}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$out/gpu.txt"
python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)' | tee -a "$out/gpu.txt"
( time python3 fused_triplet.py --build ) > "$out/build.log" 2>&1 || { tail -50 "$out/build.log"; exit 1; }
grep -E "^real" "$out/build.log"
python3 bench.py --json "$out/bench.json" "$@" 2>&1 | tee "$out/bench.txt"
python3 -m pytest tests -q -rs --maxfail=25 --durations=8 2>&1 | tee "$out/pytest.txt" | tail -40
