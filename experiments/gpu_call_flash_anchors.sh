#!/usr/bin/env bash
# One GPU call (run 26, session 14): D128 S16K dense/causal/window with every anchor (tokamax from .whl,
# carry it), then D64/D256 dense/causal (Triton, Mosaic GPU, cuDNN, tokamax mosaic), then the
# Mosaic forward's causal window-512 timing. Outputs under $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && cp -r .whl/shim/xprof /tmp/site/
export PYTHONPATH=/tmp/site:$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
timeout 215 python3 -m experiments.bench_kernels --ops flash --seqs 16384 --masks dense,causal,window --impls jattn_default,jax_nn_cudnn,tokamax_mosaic --out $OUT/bench_d128.json > $OUT/bench_d128.txt 2>&1; echo d128 rc $?
grep "op=" $OUT/bench_d128.txt | cut -c1-150
timeout 250 python3 -m experiments.bench_kernels --ops flash --seqs 16384 --masks dense,causal --head-dims 64,256 --impls jattn_triton,jattn_mosaic_gpu,jax_nn_cudnn,tokamax_mosaic --out $OUT/bench_d64_256.json > $OUT/bench_d64_256.txt 2>&1; echo d64/256 rc $?
grep "op=\|skipped\|FAILED" $OUT/bench_d64_256.txt | cut -c1-150
timeout 70 python3 -c "from pallas_kernels.flash import mosaic_gpu as m; m._sweep(causal=True, local_window_size=(511, 0), configs=[m.default_block_sizes(128)])" > $OUT/tilesum_window.txt 2>&1; echo tile rc $?; tail -5 $OUT/tilesum_window.txt
