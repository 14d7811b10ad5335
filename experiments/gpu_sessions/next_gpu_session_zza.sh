#!/usr/bin/env bash
# One GPU call (~6 min), written in session 24 after run 91 (sparse head-major 43.79 us by
# kernel sums against dense 127.11: 2.90x; issue 5 needs 3x). Three changes, each an A/B:
# - the merged attention's last split computes every query head of its group before storing
#   any (merge_stores_last, now the default; ':m' rows store as they go, the old order): the
#   four heads' partial loads no longer queue behind each other's output stores;
# - split_by="width" (':w' rows): a split's share of the kept list is static, so its id loads
#   issue with the count's load instead of after it (one dependent L2 round trip fewer);
# - the selection keeps the keys >= its threshold directly when they are exactly top_k (the
#   early search's exit, the usual case) and ranks the ties only otherwise (a cumsum and a
#   reduction fewer; default, no switch: compare the selection rows with run 90's 5.47 / 9.01).
# Then issue 8's decode point by device kernel trace (next_gpu_session_zs.sh).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_TESTS:-150} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider -o addopts="" \
  tests/test_sparse_decode_layout.py tests/test_sparse.py > "$OUT/gpu_tests_sparse.txt" 2>&1
echo "GPU tests rc=$?"; tail -2 "$OUT/gpu_tests_sparse.txt"
timeout ${T_SELECT:-100} python3 experiments/probe_decode_select.py \
  --rows select_r1_w8_cd,fused_r1_w8_cd \
  --out "$OUT/decode_select_exact.json" > "$OUT/decode_select_exact.txt" 2>&1
echo "select probe rc=$?"; grep -v Warn "$OUT/decode_select_exact.txt" | grep "^select\|^fused" | grep "True\|False" | cut -c1-120
timeout ${T_LAYOUT:-200} python3 experiments/probe_sparse_decode_layout.py --calls 1,4 \
  --rounds ${ROUNDS:-2} --skip sparse_nhd,dense_hnd \
  --hnd-grid ${GRID:-33:2:2:pm,33:2:2:pw,16:3:1:p,16:3:1:pw,33:3:1:pw,24:3:1:pw} \
  --kernel-trace ${CALLS:-32} \
  --out "$OUT/sparse_decode_merge_trace.json" > "$OUT/sparse_decode_merge_trace.txt" 2>&1
echo "layout probe rc=$?"; grep -v Warn "$OUT/sparse_decode_merge_trace.txt" | grep "rel_err\|by kernel_program sum" | cut -c1-500
grep "program)" "$OUT/sparse_decode_merge_trace.txt" | cut -c1-230
T_TRACE=${T_TRACE:-180} bash experiments/gpu_sessions/next_gpu_session_zs.sh 2>&1 | grep -v "^WARN" | tail -12
