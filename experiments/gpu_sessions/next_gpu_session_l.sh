#!/usr/bin/env bash
# One GPU call (~8-9 min; run tool timeout_s 600; carry .whl for tokamax), session 17 (run 45):
# (1) GPU tests of the new H200 D128 forward defaults (k_wait_in_pv + pingpong_handoff with the
# fence for every mask kind but causal / causal window / packed; causal without the fence);
# (2) the bench, forward and forward+backward, dense and causal D128, against cuDNN and tokamax;
# (3) k_wait_in_pv / pingpong_handoff sweeps at D64 and D256 (dense, causal). Outputs under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && cp -r .whl/shim/xprof /tmp/site/
export PYTHONPATH=/tmp/site:$PWD
timeout ${T_TESTS:-150} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider -o addopts="" \
  tests/test_flash_mosaic_gpu.py -k "(matches_reference and (d128] or d128_ragged or d128_q_shorter] or d128_segments_random or d128_soft_cap)) or (forward_and_vjp and (d128_ragged_gqa or d128_segments_random))" \
  > "$OUT/gpu_tests_defaults.txt" 2>&1
echo "GPU tests rc=$?"; tail -3 "$OUT/gpu_tests_defaults.txt"
timeout ${T_BENCH:-230} python3 -m experiments.bench_kernels --ops flash --seqs 16384 --head-dims 128 \
  --masks dense,causal --impls jattn_default,jax_nn_cudnn,tokamax_mosaic \
  --out "$OUT/h200_bench_d128.json" > "$OUT/bench_d128.txt" 2>&1
echo "bench rc=$?"
grep "op=\|skipped\|FAILED" "$OUT/bench_d128.txt" | sed -E "s/case=B2 S16K H16 //" | cut -c1-200
timeout ${T_SWEEP:-150} python3 -c "
import dataclasses as dc, json
from pallas_kernels.flash import mosaic_gpu as m
rows = {}
for d in (64, 256):
  for causal in (False, True):
    b = m.default_block_sizes(d, mask='causal' if causal else 'dense')
    r = lambda **kw: dc.replace(b, **kw)
    cfgs = [b, r(k_wait_in_pv=True), r(k_wait_in_pv=True, pingpong_handoff=True)]
    rows[f'd{d}_causal_{causal}'] = m._sweep(head_dim=d, causal=causal, configs=cfgs)
    json.dump(rows, open('$OUT/h200_mosaic_kwait_d64_d256.json', 'w'), indent=1, default=str)
" > "$OUT/kwait_d64_d256.txt" 2>&1
echo "sweep rc=$?"; grep "^{" "$OUT/kwait_d64_d256.txt" | sed -E "s/compute_registers=232, //; s/backward='triton', //; s/block_q=64, //; s/early_k_load=False, q_major_grid=False, //; s/no_reduction_scratch=False, //" | cut -c1-200
