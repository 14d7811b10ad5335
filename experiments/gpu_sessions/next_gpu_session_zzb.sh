#!/usr/bin/env bash
# One GPU call (~5 min), written in session 24 after run 92 (sparse head-major 43.24 us by
# kernel sums, best grid row 42.84, dense 127.15: 2.94-2.97x; issue 5 needs 3x): the one-launch
# sparse decode (pallas_kernels/sparse/decode_one_launch.py: score tiles, selection and
# attention splits as roles of one kernel by ticket; the attention splits load their query
# while the selection runs and start on their head's list as soon as its flag is up).
# (0) its GPU test (compiled: the two-launch path's lists to the bit, output within bf16);
#     a hang would show as the 150 s timeout, and then the probe runs without its rows;
# (1) layout probe by device kernel trace: dense, the default head-major call, the best
#     two-launch grid row and one-launch rows at splits:stages:blocks[:p].
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_TESTS:-150} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider -o addopts="" \
  tests/test_sparse_decode_one_launch.py > "$OUT/gpu_tests_one_launch.txt" 2>&1
rc=$?; echo "GPU tests rc=$rc"; tail -3 "$OUT/gpu_tests_one_launch.txt"
ONE=${ONE:-33:2:2:p,16:3:1:p,33:3:1:p,16:2:2:p,24:3:1:p}
ALL=--hnd-all
[ $rc -eq 0 ] || { ONE=""; ALL=""; }
timeout ${T_LAYOUT:-240} python3 experiments/probe_sparse_decode_layout.py --calls 1,4 \
  --rounds ${ROUNDS:-2} --skip sparse_nhd,dense_hnd --hnd-grid 16:3:1:p --one-launch "$ONE" $ALL \
  --kernel-trace ${CALLS:-32} \
  --out "$OUT/sparse_decode_one_launch_trace.json" > "$OUT/sparse_decode_one_launch_trace.txt" 2>&1
echo "layout probe rc=$?"; grep -v Warn "$OUT/sparse_decode_one_launch_trace.txt" | grep "rel_err\|by kernel_program" | cut -c1-600
grep "program)" "$OUT/sparse_decode_one_launch_trace.txt" | cut -c1-230
tail -5 "$OUT/sparse_decode_one_launch_trace.txt" | cut -c1-300
