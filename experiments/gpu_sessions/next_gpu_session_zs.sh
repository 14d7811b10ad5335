#!/usr/bin/env bash
# One GPU call (~3 min), written in session 22, rows added in session 23 (not run yet): issue
# 8's decode point (4.0 TB/s
# and 1.15x jax.nn cuDNN at B1 S128K, GQA 32:8, D128 bf16) by device kernel time. The bench
# times host loops (level with cuDNN at 3.9-4.0 TB/s); experiments/kernel_trace.py gives each
# implementation's kernels per call from a profiler trace of 32 calls on 3 input sets: the
# kernel sum (launch gaps excluded) and the span (gaps included), and the K+V read rate of
# each. Rows checked against the fp32 reference first. Outputs under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_TRACE:-200} python3 - <<'PY' 2>&1 | grep -v -i warn | tee "$OUT/decode_kernel_trace.txt"
import json, jax, jax.numpy as jnp
from jattn import decode as dec
from experiments.kernel_trace import kernel_times, format_times
b, n, hq, hk, d = 1, 131072, 32, 8, 128
sets = []
for i in range(3):
  k1, k2, k3 = jax.random.split(jax.random.key(i), 3)
  sets.append((jax.random.normal(k1, (b, hq, d), jnp.bfloat16),
               jax.random.normal(k2, (b, n, hk, d), jnp.bfloat16),
               jax.random.normal(k3, (b, n, hk, d), jnp.bfloat16), jnp.full((b,), n, jnp.int32)))
nbytes = b * n * hk * d * 2 * 2
q, k, v, lens = sets[0]
f32 = lambda x: x.astype(jnp.float32)
ref = dec.decode_attention(f32(q), f32(k), f32(v), lens, implementation="xla")
fns = {
    "jax_nn_cudnn": lambda q, k, v, l: jax.nn.dot_product_attention(q[:, None], k, v, implementation="cudnn")[:, 0],
    "jattn_default": lambda q, k, v, l: dec.decode_attention(q, k, v, l),
    "jattn_triton": lambda q, k, v, l: dec.decode_attention(q, k, v, l, implementation="triton"),
    "jattn_mosaic_gpu": lambda q, k, v, l: dec.decode_attention(q, k, v, l,
                                                                implementation="mosaic_gpu"),
}
# session 23: the Triton partials merged by one Pallas kernel instead of XLA's ~4 fusions
# (5.7 us of run 87's 129.5 us dense call); a candidate for jattn's default merge
from pallas_kernels.decode import triton as _kt
from pallas_kernels.sparse.decode import merge_decode_partials as _mdp
_splits = dec.default_num_splits("triton", b, hk, n)
def _triton_merge_kernel(q, k, v, l):
  o, lse = _kt.decode_partials(q, k, v, l, num_splits=_splits)
  return _mdp(o, lse, out_dtype=q.dtype)[0]
fns["jattn_triton_merge_kernel"] = _triton_merge_kernel
res = {}
for name, f in fns.items():
  f = jax.jit(f)
  out = f(*sets[0])
  err = float(jnp.linalg.norm(f32(out) - ref) / jnp.linalg.norm(ref))
  r = kernel_times(f, sets, calls=32, warmup=3)
  r.update(rel_err=err, tbps_kernels=nbytes / (r["sum_us"] * 1e-6) / 1e12,
           tbps_span=nbytes / (r["span_us"] * 1e-6) / 1e12)
  res[name] = r
  print(format_times(name, r), f"| rel_err {err:.2e} | {r['tbps_kernels']:.2f} TB/s by kernels,"
        f" {r['tbps_span']:.2f} by span", flush=True)
c = res["jax_nn_cudnn"]
for name, r in res.items():
  print(f"{name}: vs cuDNN {c['sum_us'] / r['sum_us']:.3f}x by kernels, "
        f"{c['span_us'] / r['span_us']:.3f}x by span")
json.dump(res, open("OUT_DIR/decode_kernel_trace.json".replace("OUT_DIR", __import__("os").environ["OUT"]), "w"), indent=1)
PY
echo "decode kernel trace rc=${PIPESTATUS[0]}"
