"""Probe (GPU): does moving the block selection into the attention kernel's prologue make the
sparse decode of issue 5 >= 3x dense?  B1 S128K GQA 32:8 D128 bf16, 64-token blocks, top_k 387
(+1 initial +1 local = 389 of 2048 blocks).

Rows:
  dense:  ``jattn.decode.decode_attention`` (the Triton split-KV decode).
  sparse: today's ``jattn.sparse.sparse_decode_attention(..., implementation="triton")``: three
          launches (scores, selection, attention + merge).
  fused:  ``pallas_kernels.sparse.decode_fused_select.sparse_decode_fused``: two launches
          (scores + zeroed counters, then selection + attention + merge in one kernel).
  fused_scratch (``--scratch``): the fused kernel with ``lookup="scratch"`` (each split stores
          its share of the kept list to HBM and loads the ids back in its loop, as
          ``sparse_decode``, instead of a [2048] compare + sum per step).
  fused_rolled (``--rolled``): the fused kernel with ``search_loop="rolled"`` (the threshold
          search as one loop in the kernel: the same dynamic work, ~4x less straight-line
          code ahead of the first K/V copy; tells instruction fetch from issue work apart).
  fused_s16, fused_s66 (``--extra-splits 16,66``): the fused kernel with other split counts
          (each extra row costs two more GPU compiles; off by default).

Checks (the first query's output from the short timing program, so no extra compiles): every
row against the fp32 reference (dense or sparse "xla", relative L2 error < 5e-3); fused rows vs
sparse: bit equality of the outputs (expected for "fused", which has sparse's split count: the
same blocks, order and arithmetic; other split counts differ by rounding). ``--full-check``
(always with ``--tiny``): also the kept lists and lse of fused vs sparse (two more compiles).
Timing: device slope from jitted programs of 2 and 6 calls (one dispatch each; every call of a
program has its own query, so XLA cannot merge calls), 5 interleaved rounds; prints us per call
and dense / row. Compiles by default: 3 functions x 2 programs.

  python experiments/probe_sparse_decode_fused_select.py --out OUT.json
  python experiments/probe_sparse_decode_fused_select.py --tiny     # CPU dry run (interpret)
"""
import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jattn import decode as jd
from jattn import sparse as sp
from pallas_kernels.sparse import decode_fused_select as fs


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--out", default="probe_sparse_decode_fused_select.json")
  p.add_argument("--seq", type=int, default=131072)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--calls", default="2,6", help="calls in the short and the long program")
  p.add_argument("--extra-splits", default="", help="e.g. 16,66: more fused rows")
  p.add_argument("--scratch", action="store_true",
                 help="also the fused row with lookup='scratch' (block ids via an HBM list)")
  p.add_argument("--rolled", action="store_true",
                 help="also the fused row with search_loop='rolled' (the search as a loop)")
  p.add_argument("--digit-bits", type=int, default=2, help="fused threshold search (1, 2, 4)")
  p.add_argument("--full-check", action="store_true",
                 help="also compare kept lists and lse of fused vs sparse (2 more compiles)")
  p.add_argument("--tiny", action="store_true", help="CPU dry run (interpret, small shapes)")
  a = p.parse_args(argv)
  B, Hq, Hk, D, bs = 1, 32, 8, 128, 64
  S = 2048 if a.tiny else a.seq
  nb = S // bs
  top_k = 387 if S == 131072 else max(1, round(0.19 * nb) - 2)
  interp = a.tiny
  m_short, m_long = map(int, a.calls.split(","))
  keys = jax.random.split(jax.random.key(0), 3 + m_long)
  dt = jnp.bfloat16
  k = jax.random.normal(keys[0], (B, S, Hk, D), dt)
  v = jax.random.normal(keys[1], (B, S, Hk, D), dt)
  qs = [jax.random.normal(keys[3 + i], (B, Hq, D), dt) for i in range(m_long)]   # distinct
  lens = jnp.full((B,), S, jnp.int32)
  summ = sp.init_block_summaries(k, lens, block_size=bs)
  kw = dict(block_size=bs, top_k=top_k)

  def sparse(q, **x):
    return sp.sparse_decode_attention(q, k, v, lens, summ, implementation="triton",
                                      interpret=interp, **kw, **x)

  def fused(q, num_splits=None, lookup="reduce", **x):
    return fs.sparse_decode_fused(q, k, v, lens, summ.sums, summ.lengths, num_splits=num_splits,
                                  digit_bits=a.digit_bits, lookup=lookup, interpret=interp,
                                  **kw, **x)

  fns = {"dense": lambda q: jd.decode_attention(q, k, v, lens, interpret=interp),
         "sparse": sparse, "fused": fused}
  if a.scratch:
    fns["fused_scratch"] = lambda q: fused(q, lookup="scratch")
  if a.rolled:
    fns["fused_rolled"] = lambda q: fused(q, search_loop="rolled")
  for s in filter(None, a.extra_splits.split(",")):
    fns[f"fused_s{int(s)}"] = lambda q, s=int(s): fused(q, num_splits=s)
  width = fs.decode_width(nb, top_k, 1, 1)
  res = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, case=dict(
      B=B, S=S, Hq=Hq, Hk=Hk, D=D, block=bs, top_k=top_k, kept_blocks=width, blocks=nb,
      digit_bits=a.digit_bits), rows={})

  # programs of m_short and m_long calls, one distinct query per call (the only compiles
  # besides the fp32 references and, with --full-check, two single calls)
  t0 = time.perf_counter()
  progs, first = {}, {}
  for n, f in fns.items():
    for m in (m_short, m_long):
      pr = jax.jit(lambda qq, f=f, m=m: [f(qq[i]) for i in range(m)])
      o = jax.block_until_ready(pr(qs))
      progs[(n, m)] = pr
      first.setdefault(n, o[0])                  # output for qs[0]
  res["compile_s"] = time.perf_counter() - t0

  # checks on qs[0]: every row vs its fp32 reference; fused rows vs sparse (bit equality of
  # the outputs; with --full-check also the kept lists and lse, one more call of each)
  t0 = time.perf_counter()
  q0 = qs[0]
  up = lambda x: x.astype(jnp.float32)
  ref_sparse = sp.sparse_decode_attention(up(q0), up(k), up(v), lens, summ,
                                          implementation="xla", **kw)
  ref_dense = jd.decode_attention(up(q0), up(k), up(v), lens, implementation="xla")
  def err(x, r):
    x, r = up(x), up(r)
    return float(jnp.linalg.norm(x - r) / jnp.linalg.norm(r))
  full = a.full_check or a.tiny
  if full:
    s_out, s_lse, s_idx = jax.jit(lambda q: sparse(q, return_lse=True,
                                                   return_indices=True))(q0)
    f_out, f_lse, f_idx = jax.jit(lambda q: fused(q, return_lse=True,
                                                  return_indices=True))(q0)
  for n in fns:
    e = err(first[n], ref_dense if n == "dense" else ref_sparse)
    row = dict(rel_err=e, ok=e < 5e-3)
    if n.startswith("fused"):
      row.update(out_bit_identical_to_sparse=bool(np.array_equal(
                     np.asarray(up(first[n])), np.asarray(up(first["sparse"])))),
                 out_max_abs_diff_vs_sparse=float(jnp.max(jnp.abs(
                     up(first[n]) - up(first["sparse"])))))
    if n == "fused" and full:
      fin = np.isfinite(np.asarray(s_lse))
      row.update(same_indices=bool(np.array_equal(np.asarray(f_idx), np.asarray(s_idx))),
                 lse_max_abs_diff_vs_sparse=float(np.max(np.abs(
                     np.asarray(f_lse)[fin] - np.asarray(s_lse)[fin]), initial=0)),
                 out_matches_program=bool(np.array_equal(np.asarray(up(f_out)),
                                                         np.asarray(up(first[n])))))
    res["rows"][n] = row
    print(f"{n:14s} " + ", ".join(f"{kk} {vv:.2e}" if isinstance(vv, float) else f"{kk} {vv}"
                                  for kk, vv in row.items()), flush=True)
  res["check_s"] = time.perf_counter() - t0
  print(f"checks {res['check_s']:.1f} s, program compiles {res['compile_s']:.1f} s", flush=True)
  def best(pr, reps=5):
    ts = []
    for _ in range(reps):
      t0 = time.perf_counter(); jax.block_until_ready(pr(qs)); ts.append(time.perf_counter() - t0)
    return min(ts)
  slopes = {n: [] for n in fns}
  for _ in range(a.rounds):
    for n in fns:
      t_s, t_l = best(progs[(n, m_short)]), best(progs[(n, m_long)])
      slopes[n].append((t_l - t_s) / (m_long - m_short) * 1e6)
  for n in fns:
    res["rows"][n].update(device_us=statistics.median(slopes[n]), rounds_us=slopes[n])
    print(f"{n:14s} device {statistics.median(slopes[n]):8.2f} us  rounds "
          f"{', '.join(f'{x:.1f}' for x in slopes[n])}", flush=True)
  d = res["rows"]["dense"]["device_us"]
  res["dense_over_row"] = {n: d / r["device_us"] if r["device_us"] > 0 else None
                           for n, r in res["rows"].items()}
  print("dense / row:", {n: (round(x, 2) if x else x) for n, x in res["dense_over_row"].items()})
  json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
  main()
