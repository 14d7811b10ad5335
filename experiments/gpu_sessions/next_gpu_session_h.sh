#!/usr/bin/env bash
# One GPU call (~6-8 min; run tool timeout_s 600; carry .whl for tokamax), session 17: the D128
# S16K forward with the one shared timer (pallas_kernels/_timing.py: the sweeps now time as the
# bench does), forward rows only:
#   (1) dense + causal window 512: jattn_default (fence on) vs jattn_mosaic_gpu[no_fence] in one
#       process (the fence A/B the sweep saw as 7.84 -> 7.28 ms), cuDNN and tokamax-mosaic
#       anchors, and issue 8's tile sum of the window rows (tile_sum_ratio, gate <= 1.2: needs
#       the dense row of the same implementation in the same process);
#   (2) packed 4 x 4K documents per 16K row: jattn_default, jattn_triton, jattn_mosaic_gpu and
#       cuDNN on 8 separate 4K causal rows, after the dense rows of the same implementations
#       (their tile sums);
#   (3) causal: the same four as (1).
# One process per case, each under its own timeout (Mosaic configs compile ~20-25 s each on a
# cold machine, Triton ~15 s); rows print and are written as they finish. Outputs under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && cp -r .whl/shim/xprof /tmp/site/
export PYTHONPATH=/tmp/site:$PWD
FENCE="jattn_default,jattn_mosaic_gpu[no_fence],jax_nn_cudnn,tokamax_mosaic"
bench() {  # name, timeout s, bench_kernels arguments...
  local name=$1 t=$2; shift 2
  timeout "$t" python3 -m experiments.bench_kernels --ops flash --seqs 16384 --head-dims 128 \
    --fwd-only --out "$OUT/h200_bench_$name.json" "$@" > "$OUT/bench_$name.txt" 2>&1
  echo "bench $name rc=$?"
  grep "op=\|skipped\|FAILED\|no tile_sum" "$OUT/bench_$name.txt" | sed -E "s/case=B2 S16K H16 //" | cut -c1-200
}
bench dense_window ${T_WINDOW:-205} --masks dense,window --impls "$FENCE"
bench packed ${T_PACKED:-195} --masks dense,packed \
  --impls jattn_default,jattn_triton,jattn_mosaic_gpu,jax_nn_cudnn
bench causal ${T_CAUSAL:-115} --masks causal --impls "$FENCE"
