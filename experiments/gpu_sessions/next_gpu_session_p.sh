#!/usr/bin/env bash
# One GPU call (~4-6 min), session 18: Nsight Compute profiles of the Mosaic GPU forward (ncu is
# at /usr/local/cuda/bin/ncu on the device, found in run 50). Cases of
# experiments/ncu_flash_fwd.py: dense (B1 S8K H16 D128), window (B2 S16K H16 D128, causal window
# (511, 0)). Each: --set full on one launch of the forward kernel ("anonymous_mosaic_gpu_kernel",
# run 51) and of cuDNN's ("...sdpa...", the check), the
# details page as text and the SASS source page (per-instruction stall samples) as gzipped CSV.
# If ncu profiles nothing (name or permission), the kernel list of a one-metric pass is saved.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
$NCU --version | tail -1
if [ -n "${PTXAS_DUMP:-}" ]; then   # ptxas -v of the Mosaic kernels (registers, spills, wgmma warnings)
  MOSAIC_GPU_DUMP_PTXAS=1 timeout 120 python3 experiments/ncu_flash_fwd.py --case dense --calls 1 \
    ${NCU_ARGS:-} > "$OUT/ptxas_dump.txt" 2>&1
  grep -i -E "registers|spill|warn|serializ|max abs" "$OUT/ptxas_dump.txt" | sort | uniq -c | head -20
fi
for case in ${CASES:-dense window}; do
  rep="$OUT/ncu_fwd_$case"
  timeout ${T_CASE:-200} $NCU --target-processes all -k "regex:mosaic_gpu_kernel|sdpa" -c 2 --set full \
    --import-source no -f -o "$rep" python3 experiments/ncu_flash_fwd.py --case $case ${NCU_ARGS:-} \
    > "$OUT/ncu_fwd_${case}_log.txt" 2>&1
  echo "$case rc=$?"; grep -E "max abs|==PROF==|==ERROR==|==WARNING==" "$OUT/ncu_fwd_${case}_log.txt" | head -8
  if [ -f "$rep.ncu-rep" ]; then
    bash experiments/ncu_report.sh "$rep" "Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Issue Slots Busy|No Eligible|One or More|Warp Cycles Per Issued|Executed Ipc A" 20
  else
    timeout 120 $NCU --target-processes all --metrics gpu__time_duration.sum \
      python3 experiments/ncu_flash_fwd.py --case $case --calls 1 > "$OUT/ncu_names_$case.txt" 2>&1
    grep -E "^  [A-Za-z_]" "$OUT/ncu_names_$case.txt" | sort | uniq -c | sort -rn | head -12
  fi
done
