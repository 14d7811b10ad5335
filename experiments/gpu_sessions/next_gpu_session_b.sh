#!/usr/bin/env bash
# One GPU call (~8 min; run tool timeout_s 600), session 15: the Hopper forward tile sweeps that
# never ran (D64, D256), the window-512 and packed-documents tile sums on the Hopper forward, then
# the Hopper block-sparse fwd+bwd rows (bench_kernels --ops sparse). Outputs under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_SWEEPS:-330} python3 - "$OUT" > "$OUT/mosaic_fwd_sweeps.txt" 2>&1 <<'PY'
import dataclasses, json, sys, time
import jax
from pallas_kernels.flash import mosaic_gpu as m
out = sys.argv[1]
B = m.BlockSizes
def cfgs(hd):
  base = m.default_block_sizes(hd)
  r = lambda **kw: dataclasses.replace(base, **kw)
  if hd == 64:
    return [base, r(num_stages=2), r(num_stages=4), r(block_k=64), r(block_k=64, num_stages=4),
            r(block_k=192, num_stages=2), r(block_k=256, num_stages=2), r(block_q=128, block_k=64),
            r(block_q=128, block_k=128, num_stages=2), r(compute_registers=240)]
  if hd == 256:
    return [base, r(pingpong=False), r(compute_registers=240), r(compute_registers=224)]
  return [base, r(block_k=64), r(block_k=64, num_stages=3), r(block_k=64, num_stages=4),
          r(num_stages=3)]
cases = [("d64", dict(head_dim=64)), ("d64_causal", dict(head_dim=64, causal=True)),
         ("d256", dict(head_dim=256)), ("d256_causal", dict(head_dim=256, causal=True)),
         ("window512", dict(causal=True, local_window_size=(511, 0))),
         ("docs4", dict(docs=4)), ("causal", dict(causal=True))]
res = {}
for name, kw in cases:
  t = time.time()
  print(f"== {name} {kw}", flush=True)
  res[name] = m._sweep(configs=cfgs(kw.get("head_dim", 128)), iters=10, **kw)
  print(f"   ({time.time() - t:.0f} s)", flush=True)
  json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=res),
            open(f"{out}/h200_mosaic_fwd_sweeps.json", "w"), indent=1, default=str)
PY
echo "sweeps rc=$?"; grep -v Warning "$OUT/mosaic_fwd_sweeps.txt" | grep "==\|ms" | cut -c1-230
timeout ${T_SPARSE:-200} python3 -m experiments.bench_kernels --ops sparse \
  --out "$OUT/h200_sparse_bench.json" > "$OUT/bench_sparse.txt" 2>&1
echo "sparse bench rc=$?"; grep "op=" "$OUT/bench_sparse.txt" | cut -c1-200
