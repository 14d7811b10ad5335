#!/usr/bin/env bash
# One GPU call (~3 min), session 24: Nsight Compute sections of the head-major sparse decode
# attention kernel (session 24 default: 16 splits, 3 stages x 1 block, prefetched ids) and of
# the dense decode kernel, for issue 5's remaining gap (33.0 us for 102 MB, 3.1 TB/s, where
# dense decode reads 536 MB at 4.4 TB/s): DRAM throughput, stall reasons, occupancy.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
NCU=${NCU:-/usr/local/cuda/bin/ncu}
for spec in sparse_hnd:jattn_sparse_decode_merged dense_hnd:jattn_decode; do
  row=${spec%%:*}; kern=${spec##*:}
  timeout ${T_NCU:-110} $NCU --target-processes all --profile-from-start off --clock-control none \
    --kernel-name regex:$kern --launch-count 2 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section Occupancy --section LaunchStats --section SchedulerStats --csv --page details \
    python3 experiments/ncu_sparse_decode.py --row $row --calls 2 \
    > "$OUT/ncu_${row}_sections.csv" 2> "$OUT/ncu_${row}_sections.err"
  echo "ncu $row rc=$?"
  grep -i "DRAM Throughput\|\"Duration\|Stall Long\|Achieved Occupancy\|Registers Per\|Warp Cycles Per Issued\|Eligible Warps\|L2 Hit\|Mem Busy\|Max Bandwidth" \
    "$OUT/ncu_${row}_sections.csv" | head -14 | cut -c1-200
done
