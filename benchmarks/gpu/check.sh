#!/usr/bin/env bash
# The GPU device check (see check.py): bash benchmarks/gpu/check.sh OUT_DIR [--budget-s S]
# Needs only torch, triton and transformers (flashinfer is measured when installed). check.py
# starts no work after --budget-s (440 s) and is killed at 470 s; if it did not finish, the
# summary is printed from the JSON it wrote after each section.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:?usage: bash benchmarks/gpu/check.sh OUT_DIR}"
mkdir -p "$out"
status=0
timeout 470 python benchmarks/gpu/check.py "$out" "${@:2}" 2>&1 | tee "$out/check.log" || status=$?
if [ "$status" -ne 0 ] && [ -f "$out/gpu_check.json" ]; then
    echo "check.py exited with $status; summary of what it measured:" | tee -a "$out/check.log"
    python benchmarks/gpu/gpu_report.py "$out/gpu_check.json" 2>&1 | tee -a "$out/check.log"
fi
exit "$status"
