#!/usr/bin/env bash
# (Its dense decode trace is now experiments/decode_merge_trace.py; superseded by zzg, run 99.)
# One GPU call (~4 min), written in session 24 (not run yet).
# (0) GPU tests of decode_attention(..., merge="pallas") (the splits merged by one Triton
#     kernel; 123.15 against 126.92 us per call by kernel trace in run 92, through a direct
#     call) and of the sparse head-major path;
# (1) dense decode by kernel trace with merge="pallas" through the API: if it holds, make it
#     the default for "triton" / "mosaic_gpu" (jattn/decode.py, _check_merge);
# (2) the sparse head-major call (session 24's Hopper default: 16 splits, 3 stages x 2 blocks,
#     prefetched ids; 3.00-3.02x by kernel sums in runs 96-98) with 8 warps (':e' rows), twice,
#     against dense decode with both merges, so the ratio is also known against the faster
#     dense baseline.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_TESTS:-150} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider -o addopts="" \
  tests/test_decode.py tests/test_sparse_decode_layout.py -k "pallas_merge or hnd" \
  > "$OUT/gpu_tests_merge.txt" 2>&1
echo "GPU tests rc=$?"; tail -2 "$OUT/gpu_tests_merge.txt"
timeout ${T_TRACE:-120} python3 experiments/decode_merge_trace.py --merges xla,pallas --implementation triton \
  --out "$OUT/decode_merge_trace.json" 2>&1 | grep -v -i warn | tee "$OUT/decode_merge_trace.txt"
for i in 1 2; do
  timeout ${T_LAYOUT:-100} python3 experiments/probe_sparse_decode_layout.py --calls 1,4 \
    --rounds 1 --skip sparse_nhd,dense_hnd --hnd-grid 16:3:2:pe,16:3:1:pe --kernel-trace 32 \
    --out "$OUT/sparse_decode_warps_$i.json" > "$OUT/sparse_decode_warps_$i.txt" 2>&1
  echo "layout probe $i rc=$?"; grep -v Warn "$OUT/sparse_decode_warps_$i.txt" | grep "rel_err\|program)" | cut -c1-170
done
