#!/usr/bin/env bash
# The GPU device check (see check.py): bash benchmarks/gpu/check.sh OUT_DIR
# Needs only torch, triton and transformers; stops itself before 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:?usage: bash benchmarks/gpu/check.sh OUT_DIR}"
mkdir -p "$out"
timeout 470 python benchmarks/gpu/check.py "$out" "${@:2}" 2>&1 | tee "$out/check.log"
