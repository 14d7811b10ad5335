"""Dense decode by device kernel trace with each split merge (sessions 24-25, issue 8's decode).

B1 S128K GQA 32:8 D128 bf16 (``--tiny``: a CPU dry run at 1K tokens, kernels interpreted):
``jattn.decode_attention`` with each ``--merges`` entry ("default": the API's own choice; "xla";
"pallas"), each checked against the fp32 XLA reference, then timed by
``experiments/kernel_trace.py`` (32 calls on 3 input sets: kernel sum and span per call). A
merge may be listed twice (the second row is named ``<merge>_again``) to see drift.

Usage: PYTHONPATH=. python experiments/decode_merge_trace.py --merges default,xla,default \
  --out decode_merge_trace.json
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--merges", default="default,xla,default",
                 help="comma list of merges: default, xla, pallas")
  p.add_argument("--implementation", default=None,
                 help="decode implementation (default: the API's choice)")
  p.add_argument("--out", default="decode_merge_trace.json")
  p.add_argument("--tiny", action="store_true", help="CPU dry run (interpret, 1K tokens)")
  a = p.parse_args(argv)
  from experiments.kernel_trace import format_times, kernel_times
  from jattn import decode as dec

  b, n, hq, hk, d = 1, 1024 if a.tiny else 131072, 32, 8, 128
  impl = "triton" if a.tiny else a.implementation
  sets = []
  for i in range(3):
    k1, k2, k3 = jax.random.split(jax.random.key(i), 3)
    sets.append((jax.random.normal(k1, (b, hq, d), jnp.bfloat16),
                 jax.random.normal(k2, (b, n, hk, d), jnp.bfloat16),
                 jax.random.normal(k3, (b, n, hk, d), jnp.bfloat16),
                 jnp.full((b,), n, jnp.int32)))
  f32 = lambda x: x.astype(jnp.float32)
  q, k, v, lens = sets[0]
  ref = dec.decode_attention(f32(q), f32(k), f32(v), lens, implementation="xla")
  res = {}
  for m in a.merges.split(","):
    kw = {} if m == "default" else dict(merge=m)
    if impl is not None:
      kw["implementation"] = impl
    if a.tiny:
      kw["interpret"] = True
    f = jax.jit(lambda q, k, v, l, kw=kw: dec.decode_attention(q, k, v, l, **kw))
    err = float(jnp.linalg.norm(f32(f(*sets[0])) - ref) / jnp.linalg.norm(ref))
    r = kernel_times(f, sets, calls=2 if a.tiny else 32, warmup=1 if a.tiny else 3)
    r.update(rel_err=err, ok=err < 5e-3)
    res[m if m not in res else m + "_again"] = r
    print(format_times(f"merge={m}", r), f"| rel_err {err:.2e}", flush=True)
  json.dump(res, open(a.out, "w"), indent=1)
  return res


if __name__ == "__main__":
  main()
