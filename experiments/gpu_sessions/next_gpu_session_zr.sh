#!/usr/bin/env bash
# One GPU call (~5 min), written in session 22 (not run yet): the intra-warpgroup overlap with
# several query tiles per program (BlockSizes.q_tiles_per_program > 1 with overlap_softmax: the
# hand-over turns run on across a program's tiles, ``_turn_skips``; lowered and its barrier
# protocol simulated on the CPU only). (1) its 4 GPU tests (*overlap_q_tiles*: a hang would
# show as the timeout); (2) interleaved sweeps against the H200 entries: the causal window 512
# (1.452x its tile sum in run 84; 12.7 us per program against 8.7 at the dense rate, so the
# per-program fixed costs are the target) with P = 2 and 4, then D128 dense and causal with
# P = 2 (4096 programs of ~220 us: ~1% at most there). Outputs under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_TESTS:-120} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider -o addopts="" \
  tests/test_flash_mosaic_gpu.py -k "overlap_q_tiles" > "$OUT/gpu_tests_overlap_q_tiles.txt" 2>&1
rc=$?; echo "overlap q_tiles GPU tests rc=$rc"; tail -2 "$OUT/gpu_tests_overlap_q_tiles.txt"
[ $rc -ne 0 ] && exit 0     # a failure or a hang: do not time it
short='s/BlockSizes\(block_q=64, block_k=([0-9]+).*q_tiles_per_program=([0-9]+), overlap_softmax=([A-Za-z]+).*tail_kv_splits=([0-9]+).*\)/bk=\1 P=\2 overlap=\3 tail=\4/'
timeout ${T_WINDOW:-100} python3 -c "
import dataclasses as dc, json
from pallas_kernels.flash import mosaic_gpu as m
e = m.default_block_sizes(128, mask='causal_window')
p2, p4 = dc.replace(e, q_tiles_per_program=2), dc.replace(e, q_tiles_per_program=4)
rows = m._sweep(head_dim=128, causal=True, local_window_size=(511, 0), configs=[e, p2, p4, e, p2, p4])
json.dump(rows, open('$OUT/sweep_window_overlap_q_tiles.json', 'w'), indent=1, default=str)
" 2>&1 | grep -v "^WARNING" | sed -E "$short" | tail -7
for causal in False True; do
  timeout ${T_D128:-110} python3 -c "
import dataclasses as dc, json
from pallas_kernels.flash import mosaic_gpu as m
from pallas_kernels.tuning import mask_kind
e = m.default_block_sizes(128, mask=mask_kind($causal, None))
base = m.fit_tail_kv_splits(e, (2, 16384, 16, 128), (2, 16384, 16, 128), causal=$causal)
p2 = dc.replace(e, q_tiles_per_program=2, tail_kv_splits=0)
rows = m._sweep(head_dim=128, causal=$causal, configs=[base, p2, base, p2])
json.dump(rows, open('$OUT/sweep_d128_overlap_q_tiles_causal_$causal.json', 'w'), indent=1, default=str)
" 2>&1 | grep -v "^WARNING" | sed -E "$short" | tail -5
done
