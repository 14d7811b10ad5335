#!/usr/bin/env bash
# One GPU call (~6 min), written in session 23 (not run yet): issue 5's sparse decode attention
# (34.5 us of the 46.4 us call in run 89: 102 MB at 2.96 TB/s, where dense decode reads at 4.35).
# (1) the attention grid by device kernel trace of the 4-call program: splits x (num_stages,
#     blocks_per_step) around the default (33 splits, 2 stages x 2 blocks on the head-major
#     cache), all with the fused selection; the layout probe now passes the caches as jit
#     arguments (run 88 spent its 420 s compiling them in as constants).
# (2) Nsight Compute sections of the attention kernel alone (speed of light, memory workload,
#     warp stall states, occupancy): is it latency-bound on the kept blocks' loads (long
#     scoreboard), and how many bytes per SM are in flight?
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_LAYOUT:-300} python3 experiments/probe_sparse_decode_layout.py --calls 1,4 \
  --rounds ${ROUNDS:-2} --skip sparse_nhd,dense_hnd \
  --hnd-grid ${GRID:-16:3:1,16:2:2,16:4:2,24:3:1,33:3:1,48:3:1,66:3:1,66:2:2} \
  --kernel-trace ${CALLS:-32} \
  --out "$OUT/sparse_decode_grid_trace.json" > "$OUT/sparse_decode_grid_trace.txt" 2>&1
echo "grid probe rc=$?"; grep -v Warn "$OUT/sparse_decode_grid_trace.txt" | grep "rel_err\|by kernel_program sum" | cut -c1-600
grep "program)" "$OUT/sparse_decode_grid_trace.txt" | cut -c1-200
NCU=${NCU:-/usr/local/cuda/bin/ncu}
timeout ${T_NCU:-150} $NCU --target-processes all --profile-from-start off --clock-control none \
  --kernel-name regex:jattn_sparse_decode_merged --launch-count 2 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
  --section Occupancy --section LaunchStats --section SchedulerStats --csv --page details \
  python3 experiments/ncu_sparse_decode.py --row sparse_hnd --calls 2 \
  > "$OUT/ncu_sparse_attention_sections.csv" 2> "$OUT/ncu_sparse_attention_sections.err"
echo "ncu rc=$?"
grep -i "Memory Throughput\|DRAM Throughput\|Duration\|Stall Long\|Stall Wait\|Achieved Occupancy\|Registers Per\|Shared Memory Config\|Warp Cycles Per Issued\|Eligible Warps" \
  "$OUT/ncu_sparse_attention_sections.csv" | head -24 | cut -c1-220
