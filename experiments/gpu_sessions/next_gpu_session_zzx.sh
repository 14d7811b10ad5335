#!/usr/bin/env bash
# Session 28 (run 125), again first thing in session 29: the training selection's top-k as a
# Pallas mask kernel on the GPU (pallas_kernels/sparse/topk.py; lax.top_k's sort was 0.33 ms of
# the 64K call, run 122). Run 125's bench ran out of time on XLA constant folding (fixed after
# it: static schedules in numpy, optimization barriers), so its bench rows are still missing.
# 1. GPU tests: select_blocks' lists with the kernel equal the sort path's (16K and 256K).
# 2. Per-kernel trace of the Hopper sparse call at 64K (the kernel's time, the sort gone).
# 3. bench_kernels --ops sparse (speedup_vs_own_dense).
# T_PART=B (a second call, on the warm machine): is pairing two selected 64-key blocks into one
# 128-key forward step worth building? The D128 sparse forward alone on one schedule at 64K
# (probe --kernels-only: its forward-only row) and the dense causal forward at 64K with 64- and
# 128-key tiles (mosaic_gpu._sweep, cuDNN in the same process).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
if [ "${T_PART:-A}" = B ]; then
  timeout ${T_PROBE:-150} python3 -m experiments.probe_sparse_mosaic_bwd --seqs 65536 \
    --kernels-only --out "$OUT/probe_sparse_d128_kernels.json" 2>&1 | grep '"op"' | cut -c1-220
  timeout ${T_SWEEP:-200} python3 -c "
import dataclasses, json
from pallas_kernels.flash import mosaic_gpu as mg
base = mg.default_block_sizes(128, mask='causal')
rows = mg._sweep(batch=1, seq=65536, causal=True,
                 configs=[base, dataclasses.replace(base, block_k=64)])
json.dump(dict(rows=rows), open('$OUT/fwd_causal_64k_bk.json', 'w'), indent=1)
" 2>&1 | grep -v Warning | tail -6
  exit 0
fi
timeout ${T_TESTS:-90} python3 -m pytest -q -m gpu tests/test_sparse.py -k "selection_kernel" \
  2>&1 | tail -2
timeout ${T_TRACE:-120} python3 -m experiments.probe_sparse_mosaic_bwd --seqs 65536 --trace \
  --out "$OUT/probe_sparse_trace.json" 2>&1 | cut -c1-1200
timeout ${T_BENCH:-400} python3 -m experiments.bench_kernels --ops sparse \
  --out "$OUT/bench_sparse.json" > "$OUT/bench_sparse.txt" 2>&1
echo "bench rc=$?"; grep -c "Constant folding" "$OUT/bench_sparse.txt"; grep -E "sparse_speedup|sparse_fwdbwd|sparse_select" "$OUT/bench_sparse.txt" | cut -c1-200 | head -24
