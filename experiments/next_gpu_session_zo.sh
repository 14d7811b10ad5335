#!/usr/bin/env bash
# One GPU call (~5 min), written in session 22 (not run yet): what the causal window 512 still
# spends after the edge masks (1.452x its tile sum in run 84; gate 1.2x). (1) ncu of the window
# forward with the H200 entry (128-key tiles, the overlap): details + SASS page; read the SASS
# page's regions here (experiments/ncu_sass_regions.py, run on the device too) against run 52's
# (masked bodies ~900 instructions at 5x the samples per execution of the full body).
# (2) Interleaved sweep: the entry against the fence at 128 keys with 1, 2 and 4 query tiles
# per program (q_tiles_per_program needs the non-overlap path; run 49 tried P = 2 only with
# 64-key tiles and the old masks). Outputs under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
CASES=window T_CASE=${T_CASE:-200} bash experiments/next_gpu_session_p.sh
[ -f "$OUT/ncu_fwd_window_sass.csv.gz" ] && python3 experiments/ncu_sass_regions.py \
  "$OUT/ncu_fwd_window_sass.csv.gz" --kernel 0 | cut -c1-170 | head -24
timeout ${T_SWEEP:-120} python3 -c "
import dataclasses as dc, json
from pallas_kernels.flash import mosaic_gpu as m
e = m.default_block_sizes(128, mask='causal_window')
f = dc.replace(e, overlap_softmax=False, pingpong_handoff=False, early_k_load=False,
               softmax_fence=True)
cfgs = [e, f, dc.replace(f, q_tiles_per_program=2), dc.replace(f, q_tiles_per_program=4), e, f,
        dc.replace(f, q_tiles_per_program=2)]
rows = m._sweep(head_dim=128, causal=True, local_window_size=(511, 0), configs=cfgs)
json.dump(rows, open('$OUT/sweep_window_q_tiles.json', 'w'), indent=1, default=str)
" 2>&1 | grep -v "^WARNING" | sed -E "s/BlockSizes\(block_q=64, block_k=([0-9]+).*softmax_fence=([A-Za-z]+).*q_tiles_per_program=([0-9]+), overlap_softmax=([A-Za-z]+).*\)/bk=\1 fence=\2 P=\3 overlap=\4/" | tail -8
