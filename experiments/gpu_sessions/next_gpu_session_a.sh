#!/usr/bin/env bash
# One GPU call (~8-9 min; run tool timeout_s 600) with the session-14 work that has never run on
# a GPU and needs no tokamax: the Mosaic GPU sparse decode (issue 5's 3x: GPU tests, then the
# probe's --sweep-mosaic with interleaved re-timing of dense / sparse / sparse_mosaic), then the
# H200-tuned D256 Triton backward (its ragged GQA GPU case and D256 end to end vs cuDNN).
# Outputs under $OUT. The fused Mosaic backward v2 has its own call:
# experiments/mosaic_gpu_bwd_fused_session.sh (docs/kernels.md, "Next GPU session").
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/nvidia_smi.txt"
timeout ${T_SPARSE_TESTS:-120} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider \
  -o addopts="" tests/test_sparse_decode_mosaic_gpu.py > "$OUT/gpu_tests_sparse_decode_mosaic.txt" 2>&1
echo "sparse decode mosaic tests rc=$?"; tail -5 "$OUT/gpu_tests_sparse_decode_mosaic.txt"
timeout ${T_PROBE:-200} python3 experiments/probe_sparse_decode.py --sweep-mosaic --repeat 10 \
  --prog-repeats 30 --out "$OUT/h200_sparse_decode_mosaic_probe.json" > "$OUT/sparse_decode_mosaic_probe.txt" 2>&1
echo "probe rc=$?"; tail -25 "$OUT/sparse_decode_mosaic_probe.txt"
timeout ${T_D256_TESTS:-70} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider \
  -o addopts="" tests/test_flash_triton.py -k d256 > "$OUT/gpu_tests_d256.txt" 2>&1
echo "d256 tests rc=$?"; tail -3 "$OUT/gpu_tests_d256.txt"
timeout ${T_D256_BENCH:-150} python3 -m experiments.bench_kernels --ops flash --seqs 16384 \
  --masks dense,causal --head-dims 256 --impls jattn_default,jax_nn_cudnn \
  --out "$OUT/h200_flash_d256.json" > "$OUT/bench_d256.txt" 2>&1
echo "d256 bench rc=$?"; grep "op=" "$OUT/bench_d256.txt" | cut -c1-160
