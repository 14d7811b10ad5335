"""Where the sparse decode attention's fixed time goes (issue 5; session 25).

The head-major sparse decode's attention kernel (``pallas_kernels.sparse.decode.sparse_decode``
at the API's head-major launch: 16 splits, 3 stages x 2 blocks on sm90, prefetched ids) fits
~8 us + 0.92 us per kept block of its longest program (run 101). This probe times, by device
kernel trace, at B1 S128K GQA 32:8 D128 bf16 with the real 19% selection (from the API's own
scores + selection kernel, computed once outside the timed calls):

* ``merged``: the kernel as the API runs it (its last split per kv head merges);
* ``partials+merge``: ``sparse_decode_partials`` (the same loop, no merge) and then
  ``merge_decode_partials`` (one merge kernel): the in-kernel merge's share;
* ``counts=k``: the merged kernel with every list cut to its first k blocks (0, 2, 32): the
  time of a launch whose splits walk (almost) nothing, i.e. the fixed part by itself.

Every row's output is checked against the fp32 XLA reference on the same lists.

Usage: PYTHONPATH=. python experiments/probe_sparse_attention_parts.py --out parts.json
(``--tiny``: CPU dry run in interpret mode at small shapes).
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default="sparse_attention_parts.json")
  p.add_argument("--calls", type=int, default=32, help="calls per kernel trace")
  p.add_argument("--tiny", action="store_true", help="CPU dry run (interpret, small shapes)")
  a = p.parse_args(argv)
  from experiments.kernel_trace import format_times, kernel_times
  from jattn import sparse as sp
  from jattn._layout import hnd_as_sequences
  from pallas_kernels.sparse import decode as sd

  b, hq, hk, d, bs = 1, 32, 8, 128, 64
  n = 2048 if a.tiny else 131072
  nb = n // bs
  top_k = max(1, round(0.19 * nb) - 2)
  interp = a.tiny
  ks = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(ks[0], (b, hq, d), jnp.bfloat16)
  kh = jax.random.normal(ks[1], (b, hk, n, d), jnp.bfloat16)
  vh = jax.random.normal(ks[2], (b, hk, n, d), jnp.bfloat16)
  lens = jnp.full((b,), n, jnp.int32)
  summ = sp.init_block_summaries(kh, lens, block_size=bs, kv_layout="hnd")
  _, _, idx = sp.sparse_decode_attention(q, kh, vh, lens, summ, block_size=bs, top_k=top_k,
                                         kv_layout="hnd", return_lse=True,
                                         return_indices=True, interpret=interp,
                                         implementation="triton")
  q2, k2, v2, lens2 = hnd_as_sequences(q, kh, vh, lens)
  idx2 = idx.reshape(b * hk, 1, -1)
  cnt2 = jnp.sum(idx2 >= 0, axis=-1).astype(jnp.int32)              # [b * hk, 1]
  width = idx2.shape[-1]
  launch = dict(sp.decode._hnd_triton_launch(kh, vh, bs))
  splits = sp.decode._hnd_triton_num_splits(b * hk, width)
  kw = dict(block_size=bs, num_splits=splits, interpret=interp, **launch)

  def merged(counts):
    return lambda q2, k2, v2: sd.sparse_decode(q2, k2, v2, lens2, idx2, None, counts, **kw)[0]

  def partials_merge(q2, k2, v2):
    o, lse = sd.sparse_decode_partials(q2, k2, v2, lens2, idx2, None, cnt2, **kw)
    return sd.merge_decode_partials(o, lse, out_dtype=q2.dtype, interpret=interp)[0]

  rows = {"merged": (merged(cnt2), width), "partials+merge": (partials_merge, width)}
  for c in (0, 2, 32):
    rows[f"counts={c}"] = (merged(jnp.minimum(cnt2, c)), c)
  res = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
             case=dict(B=b, S=n, Hq=hq, Hk=hk, D=d, block=bs, kept=width, splits=splits,
                       launch=launch), rows={})
  f32 = lambda x: x.astype(jnp.float32)
  for name, (fn, kept) in rows.items():
    fn = jax.jit(fn)
    out = fn(q2, k2, v2)
    sub = jnp.where(jnp.arange(width) < kept, idx2, -1)                # the first kept blocks
    ref = sp.decode._sparse_decode_xla(f32(q2), f32(k2), f32(v2), lens2, sub, None, bs,
                                1.0 / d ** 0.5)[0]
    err = float(jnp.linalg.norm(f32(out) - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30))
    row = dict(rel_err=err, ok=err < 5e-3)
    row.update(kernel_times(fn, [(q2, k2, v2)] * 3, calls=2 if a.tiny else a.calls,
                            warmup=1 if a.tiny else 3))
    print(format_times(name, row), f"| rel_err {err:.2e}", flush=True)
    res["rows"][name] = row
  json.dump(res, open(a.out, "w"), indent=1)
  return res


if __name__ == "__main__":
  main()
