#!/usr/bin/env bash
# Text out of an Nsight Compute report (used by next_gpu_session_p.sh and _t.sh):
#   bash experiments/ncu_report.sh PREFIX PATTERN LINES
# reads PREFIX.ncu-rep and writes PREFIX_details.txt (the details page) and PREFIX_sass.csv.gz
# (the SASS source page with per-instruction stall samples), prints the first LINES lines of
# the details page that match the extended regex PATTERN, then deletes the report (too large
# to bring back from the device). Does nothing when the report is missing.
set -uo pipefail
prefix=$1; pattern=$2; lines=$3
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
[ -f "$prefix.ncu-rep" ] || exit 0
$NCU --import "$prefix.ncu-rep" --page details > "${prefix}_details.txt" 2>&1
$NCU --import "$prefix.ncu-rep" --page source --csv --print-source sass 2>/dev/null \
  | gzip > "${prefix}_sass.csv.gz"
grep -E "$pattern" "${prefix}_details.txt" | head -"$lines"
rm -f "$prefix.ncu-rep"
