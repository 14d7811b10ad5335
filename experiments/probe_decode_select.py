"""Probe (GPU): the sparse decode's block scores and selection kernels, each timed alone by device
kernel time (``experiments/kernel_trace.py``: CUPTI trace, no replay, no host timing).

Issue 5's sparse decode at B1 S128K GQA 32:8 D128, 64-token blocks, top 19%, on the head-major
cache (``kv_layout="hnd"``: 8 sequences of one kv head, lengths shared through
``lengths_group``). Run 67 (ncu) had the selection at 8.3 us and the scores at 5.7 of a ~50 us
call, and a 3x speedup over dense decode (issue 5) needs ~5 us less; whole-call slopes cannot
see 5 us (run 83's rounds spread 22-81 us). Here every row is one kernel (or the fused scores +
selection kernel) run on 8 distinct inputs in one jitted program, traced ``--reps`` times: the
per-call kernel time and the span per call (gaps between the program's kernels included).

Rows:
* ``scores_c{chunk}_w{warps}``: ``decode_block_scores`` launch variants; checked bit-identical
  to the default's scores (same loads and arithmetic per block).
* ``select_r{bits}_w{warps}_c{chunk}[_{loop}]``: ``select_decode_slots`` with ``digit_bits``
  (1 = the 32-step bit search, 2 / 4 = radix passes), ``num_warps``, ``search_chunk`` ("d" =
  default, "f" = the whole block axis in one compare tile) and ``search_loop`` ("rolled",
  "early": stop at the first trial counting exactly top_k); indices and counts checked equal
  to the default's.
* ``fused_r{bits}_w{warps}_c{chunk}``: ``score_select_decode_slots`` (scores + selection, one
  launch), the same check.

  python experiments/probe_decode_select.py --out OUT.json        # GPU
  python experiments/probe_decode_select.py --tiny                 # CPU dry run (interpreted)
"""
import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from jattn import sparse as sp
from pallas_kernels.sparse.decode_select import (decode_block_scores, score_select_decode_slots,
                                                 select_decode_slots)

# (digit_bits, num_warps or None, search_chunk: None = default, "f" = whole axis[, search_loop])
SELECT_VARIANTS = ((1, None, None), (1, 1, None), (1, 2, None), (1, 8, None), (1, 16, None),
                   (1, 32, None), (2, None, None), (2, 16, "f"), (4, None, None), (4, 8, "f"),
                   (4, 16, "f"), (4, 16, None), (4, 32, "f"),
                   (1, 8, None, "rolled"), (1, 8, None, "early"), (1, 4, None, "early"),
                   (1, 16, None, "early"))
FUSED_VARIANTS = ((1, None, None), (1, 8, None), (1, 16, None), (4, 16, "f"), (2, 16, "f"),
                  (1, 8, None, "early"), (1, 8, None, "rolled"))
SCORE_VARIANTS = ((64, 4), (32, 4), (128, 4), (64, 2), (64, 8), (128, 8))


def variant_name(kind, bits, warps, chunk, loop="unrolled"):
  """Row name of a selection variant, e.g. ``select_r4_w16_cf``, ``select_r1_w8_cd_early``."""
  tail = "" if loop == "unrolled" else f"_{loop}"
  return f"{kind}_r{bits}_w{warps or 'd'}_c{chunk or 'd'}{tail}"


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--out", default="probe_decode_select.json")
  p.add_argument("--seq", type=int, default=131072)
  p.add_argument("--inputs", type=int, default=8, help="distinct inputs = calls per program")
  p.add_argument("--reps", type=int, default=4, help="traced runs of the program")
  p.add_argument("--tiny", action="store_true", help="CPU dry run (interpret, small shapes)")
  p.add_argument("--rows", default="", help="comma list of row-name prefixes to run (default all)")
  a = p.parse_args(argv)
  from experiments.kernel_trace import format_times, kernel_times
  B, Hq, Hk, D, bs = 1, 32, 8, 128, 64
  S = 2048 if a.tiny else a.seq
  nb = S // bs
  top_k = max(1, round(0.19 * nb) - 2)
  width = min(top_k + 2, nb)
  interp = a.tiny
  keys = jax.random.split(jax.random.key(1), a.inputs + 1)
  kh = jax.random.normal(keys[0], (B, Hk, S, D), jnp.bfloat16)
  lens = jnp.full((B,), S, jnp.int32)
  summ = sp.init_block_summaries(kh, lens, block_size=bs, kv_layout="hnd")
  sums2 = summ.sums.reshape(B * Hk, nb, 1, D)               # the head-major path's sequences
  g = Hq // Hk
  qs = [jax.random.normal(kq, (B * Hk, g, D), jnp.bfloat16) for kq in keys[1:]]
  common = dict(block_size=bs, interpret=interp, lengths_group=Hk)
  sel_kw = dict(top_k=top_k, num_init_blocks=1, num_local_blocks=1, max_selected=width)

  def scores_fn(chunk=64, num_warps=4):
    return lambda q: decode_block_scores(q, sums2, summ.lengths, chunk=chunk,
                                         num_warps=num_warps, **common)
  score_list = [jax.block_until_ready(jax.jit(scores_fn())(q)) for q in qs]

  def chunk_arg(c):
    return None if c is None else (1 << 30 if c == "f" else int(c))

  rows = {}          # name -> (fn of one input, inputs, reference fn or None, kind)
  for chunk, w in SCORE_VARIANTS:
    rows[f"scores_c{chunk}_w{w}"] = (scores_fn(chunk, w), qs, "scores")
  for bits, w, c, *lp in SELECT_VARIANTS:
    loop = lp[0] if lp else "unrolled"
    f = (lambda s, bits=bits, w=w, c=c, loop=loop: select_decode_slots(
        s, lens, num_warps=w, digit_bits=bits, search_chunk=chunk_arg(c), return_arrivals=True,
        search_loop=loop, **sel_kw, **common))
    rows[variant_name("select", bits, w, c, loop)] = (f, score_list, "select")
  for bits, w, c, *lp in FUSED_VARIANTS:
    loop = lp[0] if lp else "unrolled"
    f = (lambda q, bits=bits, w=w, c=c, loop=loop: score_select_decode_slots(
        q, sums2, summ.lengths, lens, num_warps=w, digit_bits=bits, search_chunk=chunk_arg(c),
        return_arrivals=True, search_loop=loop, **sel_kw, **common))
    rows[variant_name("fused", bits, w, c, loop)] = (f, qs, "fused")
  if a.rows:
    pre = tuple(x for x in a.rows.split(",") if x)
    rows = {n: r for n, r in rows.items() if n.startswith(pre)}
  # references: the default kernels' results on every input
  ref_scores = score_list
  ref_sel = [jax.block_until_ready(jax.jit(
      lambda s: select_decode_slots(s, lens, return_arrivals=True, **sel_kw, **common))(s))
      for s in score_list]
  res = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows={}, case=dict(
      B=B, Hq=Hq, Hk=Hk, D=D, S=S, block=bs, top_k=top_k, kept=width, blocks=nb,
      layout="hnd (B*Hk sequences of one kv head, lengths_group=Hk)", inputs=a.inputs,
      reps=a.reps))
  for name, (f, inputs, kind) in rows.items():
    jf = jax.jit(f)
    try:                     # a variant that fails to lower or run is reported, not fatal
      outs = [jax.block_until_ready(jf(x)) for x in inputs]
    except Exception as e:   # noqa: BLE001
      res["rows"][name] = dict(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
      print(f"{name}: FAILED {res['rows'][name]['error']}", flush=True)
      continue
    if kind == "scores":
      ok = all(bool(jnp.array_equal(o, r)) for o, r in zip(outs, ref_scores))
    else:
      ok = all(bool(jnp.array_equal(o[0], r[0])) and bool(jnp.array_equal(o[1], r[1]))
               and not bool(jnp.any(o[2])) for o, r in zip(outs, ref_sel))
    row = res["rows"][name] = dict(ok=ok)
    print(f"{name}: equal to the default: {ok}", flush=True)
    if not ok:
      continue
    prog = jax.jit(lambda xs, f=f: [f(x) for x in xs])
    try:
      t = kernel_times(prog, [(inputs,)], calls=a.reps, calls_per_run=len(inputs))
    except RuntimeError as e:
      res["kernel_trace_error"] = str(e)
      print("kernel trace failed:", e, flush=True)
      break
    row.update(kernel_trace=t, sum_us=t["sum_us"], span_us=t["span_us"])
    print(format_times(name, t), flush=True)
    json.dump(res, open(a.out, "w"), indent=1)
  print("\nrow                      ok   kernel us/call   span us/call")
  for name, row in res["rows"].items():
    print(f"{name:24s} {str(row['ok']):5s} {row.get('sum_us', float('nan')):10.2f} "
          f"{row.get('span_us', float('nan')):12.2f}")
  json.dump(res, open(a.out, "w"), indent=1)
  return res


if __name__ == "__main__":
  main()
