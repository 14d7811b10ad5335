#!/usr/bin/env bash
# One GPU call (~5 min), written in session 23 (not run yet): the causal window 512's
# neighbours around the H200 entry (128-key tiles, the overlap, two query tiles per program
# since run 85: 0.378 ms, 1.393x its tile sum in run 89). With P = 2 the per-tile costs are
# shared by two query tiles, which may move the best tile width and stage count: 64-key tiles
# (0.417 at P = 1 in run 81) with 2 and 3 stages, the entry without early_k_load, and P = 3.
# Interleaved, twice; configs BlockSizes rejects or that fail to compile show as errors.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
short='s/BlockSizes\(block_q=64, block_k=([0-9]+), num_stages=([0-9]+).*early_k_load=([A-Za-z]+).*q_tiles_per_program=([0-9]+).*\)/bk=\1 st=\2 early_k=\3 P=\4/'
timeout ${T_WINDOW:-280} python3 -c "
import dataclasses as dc, json
from pallas_kernels.flash import mosaic_gpu as m
e = m.default_block_sizes(128, mask='causal_window')
assert e.q_tiles_per_program == 2, e
def v(**kw):
  try:
    return dc.replace(e, **kw)
  except ValueError as err:
    print('rejected', kw, err); return None
cfgs = [e, v(block_k=64), v(block_k=64, num_stages=3), v(early_k_load=False),
        v(q_tiles_per_program=3)]
cfgs = [c for c in cfgs if c is not None]
rows = m._sweep(head_dim=128, causal=True, local_window_size=(511, 0), configs=cfgs + cfgs)
json.dump(rows, open('$OUT/sweep_window_p2_neighbours.json', 'w'), indent=1, default=str)
" 2>&1 | grep -v "^WARNING" | sed -E "$short" | tail -12
