#!/usr/bin/env bash
# One GPU call (~5-6 min), session 18: (a) BlockSizes.store_wait_read_only (end-of-program wait
# for the O/LSE TMA stores to have read shared memory only; the ncu profile of run 52 puts ~8% of
# the window kernel's compute-warp samples on the full wait) on the causal window 512 and D128
# non-causal defaults; (b) the GPU tests of store_wait_read_only and overlap_softmax (FA3's
# intra-warpgroup overlap), under a timeout in case of a hang; (c) only if (b) passed: the overlap
# sweep (D128 non-causal, causal, window 512). B2 S16K H16 bf16, mosaic_gpu._sweep (the bench's
# timer, cuDNN in the same process). Rows print as they finish; outputs under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
sweep() {   # name, python expression of the _sweep call (b = the mask's default BlockSizes)
  timeout ${T_SWEEP:-150} python3 -c "
import dataclasses as dc, json
from pallas_kernels.flash import mosaic_gpu as m
r = lambda b, **kw: dc.replace(b, **kw)
ov = dict(overlap_softmax=True, pingpong_handoff=True, k_wait_in_pv=False, softmax_fence=False)
rows = $2
json.dump(rows, open('$OUT/h200_mosaic_$1.json', 'w'), indent=1, default=str)
" > "$OUT/sweep_$1.txt" 2>&1
  echo "sweep $1 rc=$?"
  grep "^{" "$OUT/sweep_$1.txt" | sed -E "s/compute_registers=232, //; s/backward='triton', //; s/block_q=64, //; s/q_major_grid=False, //; s/no_reduction_scratch=False, //; s/q_tiles_per_program=1, //" | cut -c1-330
}
if [ -n "${PTXAS_DUMP:-}" ]; then   # ptxas -v of the overlap kernel: registers, spills, C7513
  MOSAIC_GPU_DUMP_PTXAS=1 timeout 120 python3 experiments/ncu_flash_fwd.py --case dense --calls 1 \
    --overlap > "$OUT/ptxas_dump_overlap.txt" 2>&1
  grep -i -E "registers|spill|C75|max abs" "$OUT/ptxas_dump_overlap.txt" | sort | uniq -c | head
fi
if [ -z "${SKIP_A:-}" ]; then
  sweep store_read_window "(lambda b: m._sweep(causal=True, local_window_size=(511, 0), configs=[b, r(b, store_wait_read_only=True)]))(m.default_block_sizes(128, mask='causal_window'))"
  sweep store_read_dense "(lambda b: m._sweep(configs=[b, r(b, store_wait_read_only=True)]))(m.default_block_sizes(128))"
fi
timeout ${T_TESTS:-220} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider -o addopts="" \
  tests/test_flash_mosaic_gpu.py -k "overlap or store_wait" > "$OUT/gpu_tests_overlap.txt" 2>&1
rc=$?; echo "overlap gpu tests rc=$rc"; tail -4 "$OUT/gpu_tests_overlap.txt"
if [ $rc -eq 0 ] || [ -n "${FORCE_C:-}" ]; then
  sweep overlap_dense "(lambda b: m._sweep(configs=[b, r(b, **ov), r(b, early_k_load=True, **ov), r(b, num_stages=3, no_reduction_scratch=True, **ov)]))(m.default_block_sizes(128))"
  sweep overlap_causal "(lambda b: m._sweep(causal=True, configs=[b, r(b, **ov), r(b, early_k_load=True, **ov)]))(m.default_block_sizes(128, mask='causal'))"
  sweep overlap_window "(lambda b: m._sweep(causal=True, local_window_size=(511, 0), configs=[b, r(b, **ov), r(b, store_wait_read_only=True, **ov), r(b, num_stages=3, store_wait_read_only=True, **ov)]))(m.default_block_sizes(128, mask='causal_window'))"
fi
