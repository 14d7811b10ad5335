#!/usr/bin/env bash
# (Its dense decode trace, an inline Python block when it ran, is now
# experiments/decode_merge_trace.py: the same calls, checks and trace.)
# One GPU call (< 10 min), session 25, after run 99 (next_gpu_session_zzg.sh).
# (0) GPU tests: the dense decode's new default merge (one Triton kernel, "triton" and
#     "mosaic_gpu"), the selection kernel with every search (search_loop="kary" now packs its
#     trials' counts into one scalar reduction), the sparse head-major path;
# (1) dense decode by kernel trace through the API: default (merge="pallas", writing bf16
#     itself) against merge="xla";
# (2) the sparse head-major call (API default: early bit search, 8 warps) against the same call
#     with search_loop="kary" (4 / 2 / 8 trials) and with 4 warps for the scores + selection
#     kernel, kernel trace, two processes. dense_nhd is the API default (now the Pallas merge).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv > "$OUT/gpu.txt" 2>&1
timeout ${T_TESTS:-200} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider -o addopts="" \
  tests/test_decode.py tests/test_sparse_decode_layout.py tests/test_sparse.py \
  -k "pallas_merge or hnd or gpu_decode_select_searches" > "$OUT/gpu_tests.txt" 2>&1
echo "GPU tests rc=$?"; tail -3 "$OUT/gpu_tests.txt"
timeout ${T_TRACE:-100} python3 experiments/decode_merge_trace.py --merges default,xla,default \
  --out "$OUT/decode_merge_trace.json" 2>&1 | grep -v -i warn | tee "$OUT/decode_merge_trace.txt"
for i in 1 2; do
  timeout ${T_LAYOUT:-130} python3 experiments/probe_sparse_decode_layout.py --calls 1,4 \
    --rounds 1 --skip sparse_nhd,dense_hnd --hnd-select kary,kary:2,kary:8,early/4,kary/4 \
    --kernel-trace 32 --out "$OUT/sparse_decode_kary_$i.json" > "$OUT/sparse_decode_kary_$i.txt" 2>&1
  echo "layout probe $i rc=$?"; grep -v Warn "$OUT/sparse_decode_kary_$i.txt" | grep "rel_err\|program)\|FAILED" | cut -c1-170
done
