#!/usr/bin/env bash
# (Its dense decode trace, an inline Python block when it ran, is now
# experiments/decode_merge_trace.py: the same calls, checks and trace.)
# One GPU call (< 10 min), session 25. Supersedes next_gpu_session_zzf.sh (its steps 0-2 are
# here too).
# (0) GPU tests: decode_attention(..., merge="pallas"), the sparse head-major path (with the
#     selection's new search_loop="kary"), the selection kernel with every search on the
#     adversarial rows at 2048 blocks;
# (1) dense decode by kernel trace, merge "xla" vs "pallas" through the API;
# (2) the sparse head-major call (API default: early bit search) against the same call with
#     search_loop="kary" (16 / 32 / 8 trials) and with 8 attention warps, kernel trace, twice.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import jax, jaxlib, triton; print(jax.__version__, jaxlib.__version__, triton.__version__)" >> "$OUT/gpu.txt" 2>&1
timeout ${T_TESTS:-170} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider -o addopts="" \
  tests/test_decode.py tests/test_sparse_decode_layout.py tests/test_sparse.py \
  -k "pallas_merge or hnd or gpu_decode_select_searches or gpu_sparse_decode_triton" \
  > "$OUT/gpu_tests.txt" 2>&1
echo "GPU tests rc=$?"; tail -3 "$OUT/gpu_tests.txt"
timeout ${T_TRACE:-100} python3 experiments/decode_merge_trace.py --merges xla,pallas,xla --implementation triton \
  --out "$OUT/decode_merge_trace.json" 2>&1 | grep -v -i warn | tee "$OUT/decode_merge_trace.txt"
i=0
for rows in "--hnd-select kary,kary:32 --hnd-grid 16:3:2:pe" "--hnd-select kary,kary:8"; do
  i=$((i + 1))
  timeout ${T_LAYOUT:-140} python3 experiments/probe_sparse_decode_layout.py --calls 1,4 \
    --rounds 1 --skip sparse_nhd,dense_hnd $rows --kernel-trace 32 \
    --out "$OUT/sparse_decode_kary_$i.json" > "$OUT/sparse_decode_kary_$i.txt" 2>&1
  echo "layout probe $i rc=$?"; grep -v Warn "$OUT/sparse_decode_kary_$i.txt" | grep "rel_err\|program)\|FAILED" | cut -c1-170
done
