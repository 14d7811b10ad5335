#!/usr/bin/env bash
# One GPU call (~3 min), session 25, after run 101 (the sparse attention kernel's time fits
# ~8 us fixed + 0.92 us per kept block per program: its fixed part, not its bandwidth, is what
# is left). fused_select="attend": scores in one launch, then the attention kernel whose every
# program selects (early bit search) from its kv head's scores itself, so the single-program
# selection after the last score tile (its atomic, search, compaction and the kernel boundary)
# leaves the critical path; each split repeats the search instead.
# (0) GPU tests of decode_fused_select (the nhd test and the new head-major API test);
# (1) the layout probe twice: API default against attend rows at 16 splits x 3 stages x 2 / 1
#     blocks and 33 x 3 x 1, device kernel trace.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_TESTS:-150} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider -o addopts="" \
  tests/test_sparse_decode_fused_select.py > "$OUT/gpu_tests.txt" 2>&1
echo "GPU tests rc=$?"; tail -3 "$OUT/gpu_tests.txt"
for i in 1 2; do
  timeout ${T_LAYOUT:-150} python3 experiments/probe_sparse_decode_layout.py --calls 1,4 \
    --rounds 1 --skip sparse_nhd,dense_hnd --attend 16:3:2,16:3:1,33:3:1 --kernel-trace 32 \
    --out "$OUT/sparse_decode_attend_$i.json" > "$OUT/sparse_decode_attend_$i.txt" 2>&1
  echo "layout probe $i rc=$?"; grep -v Warn "$OUT/sparse_decode_attend_$i.txt" | grep "rel_err\|program)\|FAILED" | cut -c1-200
done
