#!/usr/bin/env bash
# One GPU call (~4-5 min), session 20: why packed documents (four causal 4K documents per 16K
# row, segment ids) take 1.21x their tile sum. The same work without segment ids is B4 S4K H16
# causal (same tiles, same programs). Time both with the bench's timer (each checked against
# cuDNN per document), then Nsight Compute (--set full) of one launch of each.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
for c in packed causal4k; do
  timeout 120 python3 experiments/ncu_flash_fwd.py --case $c --calls 2 --time 2>&1 \
    | grep -E "case|Error|error" | tee "$OUT/time_$c.txt"
done
CASES="packed causal4k" T_CASE=150 bash experiments/gpu_sessions/next_gpu_session_p.sh
