#!/usr/bin/env bash
# The co-adaptation experiment with several seeds in one GPU call: one process per variant group
# shares the GPU, each training a disjoint set of variants into the same output directory
# (finished runs are kept in OUT_DIR/runs/<variant>_s<seed>/); one more call of the same command
# with every variant then loads them and writes results.json, table.md and the figures.
#   [PRESET=gpu8k] [MEM_FRACTION=0.2] [VARIANT_GROUPS="full,posthoc_proxy,posthoc_oracle sparse_ste ..."] \
#   OUT_DIR=runs/gpu8k SEEDS=3 BUDGET=470 bash experiments/coadaptation_parallel.sh [extra args]
# A group written "variants@fraction" gets that share of GPU memory instead of MEM_FRACTION (the
# CSA variants train partly through the XLA path; the full group's 4K evaluation needs more than
# 0.15 of an 80 GB card).
# Exit 0 when every group finished; 3 when groups stopped at their time budget (rerun the same
# command while the machine is warm: every run resumes from its checkpoint); otherwise the first
# other exit code of a group (2: settings refused, 4: the dense baseline did not solve the task).
set -uo pipefail
OUT_DIR=${OUT_DIR:-runs/gpu8k}; SEEDS=${SEEDS:-3}; BUDGET=${BUDGET:-470}
mkdir -p "$OUT_DIR"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
VARIANT_GROUPS=${VARIANT_GROUPS:-full,posthoc_proxy,posthoc_oracle,local_global_nope,local_global_rope@0.2 sparse_none,sparse_ste@0.15 sparse_gumbel,sparse_distill@0.15 csa,csa_two_stage@0.45}
pids=()
for entry in $VARIANT_GROUPS; do
  group=${entry%@*}; frac=${MEM_FRACTION:-0.2}; [ "$entry" != "$group" ] && frac=${entry#*@}
  XLA_PYTHON_CLIENT_MEM_FRACTION=$frac \
  python3 -m experiments.coadaptation --preset "${PRESET:-gpu8k}" --out "$OUT_DIR" --seeds "$SEEDS" \
    --variants "$group" --no-progress --time-budget "$BUDGET" "$@" \
    > "$OUT_DIR/log_${group//,/+}.txt" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do
  wait "$p"; r=$?
  if [ "$r" != 0 ] && { [ "$rc" = 0 ] || [ "$rc" = 3 ]; }; then rc=$r; fi
done
echo "groups done (rc $rc)"
[ "$rc" = 0 ] || exit "$rc"
python3 -m experiments.coadaptation --preset "${PRESET:-gpu8k}" --out "$OUT_DIR" --seeds "$SEEDS" \
  --variants "$(echo $VARIANT_GROUPS | sed 's/@[0-9.]*//g' | tr ' ' ',')" --no-progress "$@" \
  > "$OUT_DIR/log_table.txt" 2>&1
rc=$?; tail -40 "$OUT_DIR/log_table.txt"; exit $rc
