#!/usr/bin/env bash
# One GPU call (~3-4 min), session 20: wave quantization of the Mosaic GPU forward
# (experiments/wave_probe.py). D128 non-causal at B1 H31/32/33/64/66 and B2 H16 (S16K), then
# D256 non-causal and D128 causal at H32 / H33. jattn and cuDNN in the same process, checked.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout 200 python3 experiments/wave_probe.py --out "$OUT/waves_d128.json" 2>&1 | grep -v "^WARNING" | tail -20
timeout 150 python3 experiments/wave_probe.py --shapes 1x32,1x33,2x16 --head-dim 256 \
  --out "$OUT/waves_d256.json" 2>&1 | grep -v "^WARNING" | tail -10
timeout 150 python3 experiments/wave_probe.py --shapes 1x32,1x33,2x16 --causal \
  --out "$OUT/waves_d128_causal.json" 2>&1 | grep -v "^WARNING" | tail -10
