#!/usr/bin/env bash
# One GPU call (~8 min; run tool timeout_s 600), session 16 (run 39): (1) issue 5's sparse decode on
# a head-major cache, split counts 16 / 24 and the one-launch scores + selection (run 38's
# probe with 8 rows and 6-call programs timed out in compiles: 6 rows, calls 1 and 4 here);
# (2) the D128 forward / forward+backward with every anchor (tokamax from .whl: carry it) now
# that the fence is the default (issue 8's gates). Outputs under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_LAYOUT:-280} python3 experiments/probe_sparse_decode_layout.py --calls 1,4 --rounds 7 \
  --hnd-splits 16,24 --hnd-fused --skip sparse_nhd --out "$OUT/h200_sparse_decode_layout_splits.json" \
  > "$OUT/sparse_decode_layout_splits.txt" 2>&1
echo "layout probe rc=$?"; grep -v Warn "$OUT/sparse_decode_layout_splits.txt" | tail -14
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && cp -r .whl/shim/xprof /tmp/site/
PYTHONPATH=/tmp/site:$PWD timeout ${T_BENCH:-220} python3 -m experiments.bench_kernels --ops flash --seqs 16384 \
  --masks dense,causal --impls jattn_default,jax_nn_cudnn,tokamax_mosaic --out "$OUT/bench_d128.json" \
  > "$OUT/bench_d128.txt" 2>&1
echo "bench rc=$?"; grep "op=\|skipped\|FAILED" "$OUT/bench_d128.txt" | cut -c1-160
