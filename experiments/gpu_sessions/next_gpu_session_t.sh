#!/usr/bin/env bash
# One GPU call (~8-9 min; run tool timeout_s 600), written in session 18 for session 19:
# (1) the GPU tests of overlap_softmax on the segment-id range path (3 cases) and on a block
#     schedule's walk (block-sparse selections, 3 cases), never run on a GPU;
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
timeout ${T_TESTS:-200} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider -o addopts="" \
  tests/test_flash_mosaic_gpu.py tests/test_sparse_mosaic_gpu.py -k "overlap and (segments or block_sparse)" \
  > "$OUT/gpu_tests_segments_overlap.txt" 2>&1
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
# (4) D64 (0.97x cuDNN): 256-key tiles (fewer, longer steps; 2 or 3 stages, lowered on the CPU)
timeout ${T_SWEEP:-200} python3 -c "
import dataclasses as dc, json
from pallas_kernels.flash import mosaic_gpu as m
b = m.default_block_sizes(64)
r = lambda **kw: dc.replace(b, **kw)
rows = m._sweep(head_dim=64, configs=[b, r(block_k=256, num_stages=2), r(block_k=256, num_stages=3)])
json.dump(rows, open('$OUT/h200_mosaic_d64_bk256.json', 'w'), indent=1, default=str)
" > "$OUT/sweep_d64_bk256.txt" 2>&1
echo "sweep d64 bk256 rc=$?"; grep "^{" "$OUT/sweep_d64_bk256.txt" | cut -c1-300
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
# the two-kernel backward (forward, dK/dV, dQ: 3 launches) and the fused one (forward, fused: 2)
for v in "bwd 3" "fused-bwd 2"; do
  set -- $v
  timeout ${T_NCU:-150} $NCU --target-processes all -k "regex:mosaic_gpu_kernel" -c $2 --set full \
    --import-source no -f -o "$OUT/ncu_$1" python3 experiments/ncu_flash_fwd.py --case dense --$1 \
    --calls 1 > "$OUT/ncu_$1_log.txt" 2>&1
  echo "ncu $1 rc=$?"; grep -E "max abs|==PROF==|==ERROR==" "$OUT/ncu_$1_log.txt" | head -8
  bash experiments/ncu_report.sh "$OUT/ncu_$1" "mosaic_gpu_kernel|Duration|Registers Per|Local Memory Spilling Requests  |Issue Slots Busy|No Eligible|Tensor is|highest-utilized" 30
done
