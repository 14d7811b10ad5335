#!/usr/bin/env bash
# One GPU call (~6-8 min; run tool timeout_s 600), written in session 18 for session 19:
# (1) the GPU tests of overlap_softmax on the segment-id range path (3 cases, never run on a GPU);
# (2) only if they pass: packed 4 x 4K documents (B2 S16K H16 D128 causal segments) with
#     _sweep's default configs, whose last row is the overlap + early_k_load variant (the
#     causal_segments entry is 1.10 ms in the bench, 1.14x its tile sum, run 41);
# (3) Nsight Compute on the Mosaic backward (issue 8's fwd+bwd gap: 0.92x cuDNN), B1 S8K H16
#     D128 (experiments/ncu_flash_fwd.py): the two-kernel backward (--bwd: forward, dK/dV, dQ)
#     and the fused one (--fused-bwd: forward, fused), details pages and SASS stall samples.
#     Outputs under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_TESTS:-150} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider -o addopts="" \
  tests/test_flash_mosaic_gpu.py -k "segments and overlap" > "$OUT/gpu_tests_segments_overlap.txt" 2>&1
rc=$?; echo "segments overlap GPU tests rc=$rc"; tail -3 "$OUT/gpu_tests_segments_overlap.txt"
if [ $rc -eq 0 ]; then
  timeout ${T_SWEEP:-200} python3 -c "
import json
from pallas_kernels.flash import mosaic_gpu as m
rows = m._sweep(docs=4)
json.dump(rows, open('$OUT/h200_mosaic_docs4_overlap.json', 'w'), indent=1, default=str)
" > "$OUT/sweep_docs4.txt" 2>&1
  echo "sweep docs4 rc=$?"; grep "^{" "$OUT/sweep_docs4.txt" | cut -c1-330
fi
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
# the two-kernel backward (forward, dK/dV, dQ: 3 launches) and the fused one (forward, fused: 2)
for v in "bwd 3" "fused-bwd 2"; do
  set -- $v
  timeout ${T_NCU:-150} $NCU --target-processes all -k "regex:mosaic_gpu_kernel" -c $2 --set full \
    --import-source no -f -o "$OUT/ncu_$1" python3 experiments/ncu_flash_fwd.py --case dense --$1 \
    --calls 1 > "$OUT/ncu_$1_log.txt" 2>&1
  echo "ncu $1 rc=$?"; grep -E "max abs|==PROF==|==ERROR==" "$OUT/ncu_$1_log.txt" | head -8
  if [ -f "$OUT/ncu_$1.ncu-rep" ]; then
    $NCU --import "$OUT/ncu_$1.ncu-rep" --page details > "$OUT/ncu_$1_details.txt" 2>&1
    $NCU --import "$OUT/ncu_$1.ncu-rep" --page source --csv --print-source sass 2>/dev/null \
      | gzip > "$OUT/ncu_$1_sass.csv.gz"
    grep -E "mosaic_gpu_kernel|Duration|Registers Per|Local Memory Spilling Requests  |Issue Slots Busy|No Eligible|Tensor is|highest-utilized" \
      "$OUT/ncu_$1_details.txt" | head -30
    rm -f "$OUT/ncu_$1.ncu-rep"
  fi
done
