"""Probe (GPU): does a head-major KV cache ([batch, kv_heads, len, head_dim], "HND") lift the
sparse decode's read rate?  Issue 5's sparse decode at B1 S128K GQA 32:8 D128, 64-token blocks,
top 19%.  The cache layout the kernels read today is [batch, len, kv_heads, head_dim] ("NHD"): a
kept 64-token block of one kv head is 64 rows of 256 B, 2 KB apart, while the other kv heads'
rows in between are read only if they kept the same block.  A head-major cache makes each kept
block one contiguous 16 KB run.

Rows: ``dense_nhd`` / ``sparse_nhd`` read the [B, S, Hk, D] cache; ``sparse_hnd`` and
``dense_hnd`` call ``sparse_decode_attention`` / ``decode_attention`` with ``kv_layout="hnd"`` on
the head-major copy [B, Hk, S, D] (the library runs it as B * Hk sequences of one kv head: the
head-major cache reshaped (free) to [B * Hk, S, 1, D], query head h * G + g becoming query head
g of sequence b * Hk + h; no kernel change, the same default split count as NHD).  Every row
is checked against the fp32 reference in the same process (the HND rows also against their NHD
row), and every timing is a device slope: jitted programs of 2 and 6 calls by default, each call
on its own q (so XLA cannot merge identical calls), interleaved rounds.

Run 34 (H200, before ``kv_layout`` existed, the same reshape by hand for both HND rows) repeated
q's in the long program (calls i and i + 4 got identical inputs and were CSE'd), which halved the
absolute per-call times; the NHD / HND ratios stand.

  python experiments/probe_sparse_decode_layout.py --out OUT.json
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

# --hnd-grid flags: Triton attention options added to a row's launch
GRID_FLAGS = {"p": (("prefetch_ids", True),), "w": (("split_by", "width"),),
              "m": (("merge_stores_last", False),), "e": (("num_warps", 8),),
              "k": (("merge_kernel", True),)}


def to_hnd(x):
  """[B, S, Hk, D] -> the head-major copy [B, Hk, S, D] (made once, outside timing)."""
  return jnp.transpose(x, (0, 2, 1, 3))


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--out", default="probe_sparse_decode_layout.json")
  p.add_argument("--seq", type=int, default=131072)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--calls", default="2,6", help="calls in the short and the long program")
  p.add_argument("--mosaic", action="store_true", help="also the mosaic_gpu rows")
  p.add_argument("--hnd-splits", default="",
                 help="e.g. 16,24,49: more sparse_hnd rows with these num_splits (Triton)")
  p.add_argument("--hnd-fused", action="store_true",
                 help="also sparse_hnd with fused_select=True (scores + selection, one launch)")
  p.add_argument("--hnd-repeat", action="store_true",
                 help="also sparse_hnd_repeat: the head-major call as before session 20 (the "
                      "lengths repeated per kv head in XLA, no lengths_group), an A/B of it")
  p.add_argument("--hnd-launch", default="",
                 help="e.g. 3:1,2:2: more sparse_hnd rows with the Triton attention launched "
                      "with num_stages:blocks_per_step (sparse_hnd_st3_b1, ...; session 22's "
                      "default is 2:2, the previous one 3:1)")
  p.add_argument("--hnd-unfused", action="store_true",
                 help="also sparse_hnd_unfused: fused_select=False (three launches; the "
                      "head-major Triton default is one launch for scores + selection since "
                      "session 23)")
  p.add_argument("--hnd-grid", default="",
                 help="e.g. 16:2:2,24:3:1,33:2:2:pw: more head-major rows (fused selection) "
                      "with the Triton attention at splits:num_stages:blocks_per_step[:flags] "
                      "(sparse_hnd_s16_st2_b2, ...; flags: p = prefetch_ids, w = "
                      "split_by='width', m = merge_stores_last=False, e = 8 warps, k = "
                      "merge_kernel (the splits merged by a second kernel); row suffix "
                      "_<flags>)")
  p.add_argument("--hnd-select", default="",
                 help="e.g. unrolled,kary,kary:8,early/4,early/2c32: more head-major rows (the "
                      "API's launch) whose scores + selection kernel runs with that "
                      "search_loop[:search_trials][/num_warps[c<score tile blocks>]] "
                      "(sparse_hnd_unrolled, sparse_hnd_kary8, sparse_hnd_early_w4, "
                      "sparse_hnd_early_w2_c32, ...; default 'early', 8 warps, 64-block tiles)")
  p.add_argument("--hnd-all", action="store_true",
                 help="a head-major row with fused_select='all' (the API's one-launch path)")
  p.add_argument("--one-launch", default="",
                 help="e.g. 33:2:2:p,16:3:1:p: head-major rows with fused_select='all' "
                      "(pallas_kernels.sparse.decode_one_launch: scores, selection and "
                      "attention in one Triton launch; GPU only) at "
                      "splits:num_stages:blocks_per_step[:p] (sparse_hnd_one_s33_st2_b2_p, ...)")
  p.add_argument("--attend", default="",
                 help="e.g. 16:3:2,16:3:1: head-major rows with fused_select='attend' (the "
                      "scores launch, then the attention kernel whose every program selects "
                      "itself; pallas_kernels.sparse.decode_fused_select) at "
                      "splits:num_stages:blocks_per_step (sparse_hnd_attend_s16_st3_b2, ...)")
  p.add_argument("--skip", default="", help="comma list of row names not to run "
                 "(dense_nhd, the ratios' base, always runs)")
  p.add_argument("--top-frac", type=float, default=0.19,
                 help="kept share of the blocks, the initial and local ones included "
                      "(issue 5's case: 0.19)")
  p.add_argument("--tiny", action="store_true", help="CPU dry run (interpret, small shapes)")
  p.add_argument("--kernel-trace", type=int, default=0, metavar="CALLS",
                 help="also each row's device kernel time per call from a profiler trace of "
                      "that many calls (experiments/kernel_trace.py; 0: off): the kernel sum "
                      "(launch gaps excluded) and the span, with the dense / row ratios; "
                      "then the same from the long program (--calls' second count of calls in "
                      "one executable, so the span has no host dispatch gaps)")
  a = p.parse_args(argv)
  B, Hq, Hk, D, bs = 1, 32, 8, 128, 64
  S = 1024 if a.tiny else a.seq
  nb = S // bs
  top_k = max(1, round(a.top_frac * nb) - 2)
  interp = a.tiny
  impl = "xla" if a.tiny else "triton"
  keys = jax.random.split(jax.random.key(0), 8)
  dt = jnp.bfloat16
  k = jax.random.normal(keys[0], (B, S, Hk, D), dt)
  v = jax.random.normal(keys[1], (B, S, Hk, D), dt)
  m_short, m_long = map(int, a.calls.split(","))
  if not 0 < m_short < m_long:
    raise ValueError(f"--calls must be two counts 0 < short < long, got {a.calls!r}")
  # one distinct q per call of the long program (the short one uses the first m_short)
  qs = [jax.random.normal(kq, (B, Hq, D), dt) for kq in jax.random.split(keys[2], m_long)]
  lens = jnp.full((B,), S, jnp.int32)
  summ = sp.init_block_summaries(k, lens, block_size=bs)
  kh, vh = to_hnd(k), to_hnd(v)                                       # [B, Hk, S, D]
  summ_h = sp.init_block_summaries(kh, lens, block_size=bs, kv_layout="hnd")
  kw = dict(block_size=bs, top_k=top_k, interpret=interp)
  # Every row is a function of (q, c), c = the cache arrays below passed as a jit argument: as
  # closure constants the 128K-token caches were embedded in each program's HLO (~1 GB of
  # constants per compile: run 88 spent its 420 s compiling 7 rows).
  cache = dict(k=k, v=v, kh=kh, vh=vh, summ=summ, summ_h=summ_h, lens=lens)

  fns = {
      "dense_nhd": lambda q, c: jd.decode_attention(q, c["k"], c["v"], c["lens"],
                                                    interpret=interp),
      "dense_hnd": lambda q, c: jd.decode_attention(q, c["kh"], c["vh"], c["lens"],
                                                    interpret=interp, kv_layout="hnd"),
      "sparse_nhd": lambda q, c: sp.sparse_decode_attention(q, c["k"], c["v"], c["lens"],
                                                             c["summ"], implementation=impl,
                                                             **kw),
      "sparse_hnd": lambda q, c: sp.sparse_decode_attention(q, c["kh"], c["vh"], c["lens"],
                                                             c["summ_h"], implementation=impl,
                                                             kv_layout="hnd", **kw),
  }
  hnd = dict(implementation=impl, kv_layout="hnd", **kw)
  for n in (int(x) for x in a.hnd_splits.split(",") if x):
    fns[f"sparse_hnd_s{n}"] = lambda q, c, n=n: sp.sparse_decode_attention(
        q, c["kh"], c["vh"], c["lens"], c["summ_h"], num_splits=n, **hnd)

  def hnd_row(launch, *, num_splits=None, fused=True, select=()):
    """A head-major row through ``sp.decode._hnd_decode`` with explicit Triton launch / selection
    options (the API's own call uses ``_HND_TRITON_LAUNCH`` and the default selection)."""
    return lambda q, c: sp.decode._hnd_decode(
        q, c["kh"], c["vh"], c["lens"], c["summ_h"], return_lse=False, return_indices=False,
        num_init_blocks=1, num_local_blocks=1, scale=None, num_splits=num_splits,
        fused_select=fused, score_splits=None, _launch=launch, _select=select,
        implementation=impl, **kw)

  for spec in (x for x in a.hnd_launch.split(",") if x):
    st_, b_ = (int(x) for x in spec.split(":"))
    launch = (("num_stages", st_), ("blocks_per_step", b_))
    fns[f"sparse_hnd_st{st_}_b{b_}"] = hnd_row(launch, fused=False)
  for spec in (x for x in a.hnd_grid.split(",") if x):
    n_, st_, b_, *flags = spec.split(":")
    n_, st_, b_ = int(n_), int(st_), int(b_)
    launch = (("num_stages", st_), ("blocks_per_step", b_))
    flags = "".join(flags)
    if set(flags) - set(GRID_FLAGS):
      raise ValueError(f"--hnd-grid: {spec!r}: flags are letters of {sorted(GRID_FLAGS)}")
    for f in sorted(set(flags)):
      launch += GRID_FLAGS[f]
    name = f"sparse_hnd_s{n_}_st{st_}_b{b_}" + (f"_{''.join(sorted(set(flags)))}" if flags
                                                 else "")
    fns[name] = hnd_row(launch, num_splits=n_)
  select_rows = set()                # the API call with another search: bit-identical outputs
  for spec in (x for x in a.hnd_select.split(",") if x):
    spec, *launch = spec.split("/")
    loop, *trials = spec.split(":")
    warps, _, chunk = (launch[0] if launch else "").partition("c")
    name = (f"sparse_hnd_{loop}{''.join(trials)}" + (f"_w{warps}" if warps else "")
            + (f"_c{chunk}" if chunk else ""))
    select_rows.add(name)
    select = ((("search_loop", loop),) + tuple(("search_trials", int(t)) for t in trials)
              + ((("num_warps", int(warps)),) if warps else ())
              + ((("chunk", int(chunk)),) if chunk else ()))
    fns[name] = hnd_row(sp.decode._hnd_triton_launch(kh, vh, bs), select=select)
  if a.hnd_unfused:
    fns["sparse_hnd_unfused"] = lambda q, c: sp.sparse_decode_attention(
        q, c["kh"], c["vh"], c["lens"], c["summ_h"], fused_select=False, **hnd)
  if a.hnd_all:
    fns["sparse_hnd_all"] = lambda q, c: sp.sparse_decode_attention(
        q, c["kh"], c["vh"], c["lens"], c["summ_h"], fused_select="all", **hnd)
  if a.hnd_fused:
    fns["sparse_hnd_fused"] = lambda q, c: sp.sparse_decode_attention(
        q, c["kh"], c["vh"], c["lens"], c["summ_h"], fused_select=True, **hnd)
  if a.hnd_repeat:
    def sparse_hnd_repeat(q, c):
      from jattn._layout import hnd_as_sequences
      q2, k2, v2, lens2 = hnd_as_sequences(q, c["kh"], c["vh"], c["lens"])   # lengths repeated
      summ2 = sp.BlockSummaries(sums=c["summ_h"].sums.reshape(B * Hk, nb, 1, D),
                                lengths=jnp.repeat(c["summ_h"].lengths, Hk), block_size=bs)
      out = sp.decode._sparse_decode(q2, k2, v2, lens2, summ2, None, scale=None, return_lse=False,
                              return_indices=False, implementation=impl, num_splits=None,
                              num_init_blocks=1, num_local_blocks=1, **kw)
      return out.reshape(B, Hq, D)
    fns["sparse_hnd_repeat"] = sparse_hnd_repeat
  for spec in (x for x in a.one_launch.split(",") if x):   # fused_select="all" at a launch
    n_, st_, b_, *flags = spec.split(":")
    n_, st_, b_, pre = int(n_), int(st_), int(b_), "p" in "".join(flags)
    launch = (("num_stages", st_), ("blocks_per_step", b_), ("prefetch_ids", pre))
    fns[f"sparse_hnd_one_s{n_}_st{st_}_b{b_}" + ("_p" if pre else "")] = hnd_row(
        launch, num_splits=n_, fused="all")
  for spec in (x for x in a.attend.split(",") if x):      # fused_select="attend" at a launch
    n_, st_, b_ = (int(x) for x in spec.split(":"))
    launch = (("num_stages", st_), ("blocks_per_step", b_))
    fns[f"sparse_hnd_attend_s{n_}_st{st_}_b{b_}"] = hnd_row(launch, num_splits=n_,
                                                            fused="attend")
  if a.mosaic and not a.tiny:
    fns["sparse_mosaic_nhd"] = lambda q, c: sp.sparse_decode_attention(
        q, c["k"], c["v"], c["lens"], c["summ"], implementation="mosaic_gpu", **kw)
    fns["sparse_mosaic_hnd"] = lambda q, c: sp.sparse_decode_attention(
        q, c["kh"], c["vh"], c["lens"], c["summ_h"], implementation="mosaic_gpu",
        kv_layout="hnd", **kw)
  for n in (x for x in a.skip.split(",") if x):
    if n not in fns or n == "dense_nhd":
      raise ValueError(f"--skip: no row {n!r} to skip (rows: {', '.join(fns)})")
    del fns[n]
  res = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, case=dict(
      B=B, S=S, Hq=Hq, Hk=Hk, D=D, block=bs, top_k=top_k, kept_blocks=top_k + 2, blocks=nb,
      calls=[m_short, m_long], distinct_q_per_call=True), rows={})
  # check: fp32 reference on the NHD selection, every row against it
  outs, failed = {}, {}
  for n, f in list(fns.items()):     # a row that fails to compile or run is reported, not fatal
    try:
      outs[n] = jax.block_until_ready(jax.jit(f)(qs[0], cache))
    except Exception as e:           # noqa: BLE001 (e.g. shared memory over the limit)
      if n == "dense_nhd":
        raise
      failed[n] = f"{type(e).__name__}: {str(e)[:300]}"
      print(f"{n}: FAILED {failed[n]}", flush=True)
      del fns[n]
  res["failed_rows"] = failed
  ref_sparse = sp.sparse_decode_attention(qs[0].astype(jnp.float32), k.astype(jnp.float32),
                                          v.astype(jnp.float32), lens, summ,
                                          implementation="xla", block_size=bs, top_k=top_k)
  ref_dense = jd.decode_attention(qs[0].astype(jnp.float32), k.astype(jnp.float32),
                                  v.astype(jnp.float32), lens, implementation="xla")
  def err(x, r):
    x, r = x.astype(jnp.float32), r.astype(jnp.float32)
    return float(jnp.linalg.norm(x - r) / jnp.linalg.norm(r))
  for n, o in outs.items():
    r = ref_dense if n.startswith("dense") else ref_sparse
    row = res["rows"][n] = dict(rel_err=err(o, r), ok=err(o, r) < 5e-3)
    twin = n[:n.index("_hnd")] + "_nhd" if "_hnd" in n else None
    if twin in outs:      # same selection and blocks: equal to the NHD row up to rounding
      row["max_abs_diff_vs_nhd"] = float(jnp.max(jnp.abs(
          o.astype(jnp.float32) - outs[twin].astype(jnp.float32))))
      row["ok"] = row["ok"] and row["max_abs_diff_vs_nhd"] < 1e-2
    same = n == "sparse_hnd_repeat" or n in select_rows
    if same and "sparse_hnd" in outs:   # the same attention on the same selection: bit-identical
      row["max_abs_diff_vs_sparse_hnd"] = float(jnp.max(jnp.abs(
          o.astype(jnp.float32) - outs["sparse_hnd"].astype(jnp.float32))))
      row["ok"] = row["ok"] and row["max_abs_diff_vs_sparse_hnd"] == 0.0
    print(n, "rel_err", row["rel_err"], "ok", row["ok"], "max_abs_diff_vs_nhd",
          row.get("max_abs_diff_vs_nhd"), flush=True)
  # device slope: programs of m_short and m_long calls (one dispatch each, a distinct q per
  # call), interleaved rounds
  progs = {}
  for n, f in fns.items():
    for m in (m_short, m_long):
      pr = jax.jit(lambda qq, c, f=f: [f(x, c) for x in qq])
      jax.block_until_ready(pr(qs[:m], cache))
      progs[(n, m)] = pr
  def best(pr, m, reps=5):
    ts = []
    for _ in range(reps):
      t0 = time.perf_counter(); jax.block_until_ready(pr(qs[:m], cache))
      ts.append(time.perf_counter() - t0)
    return min(ts)
  slopes = {n: [] for n in fns}
  for _ in range(a.rounds):
    for n in fns:
      t_s, t_l = best(progs[(n, m_short)], m_short), best(progs[(n, m_long)], m_long)
      slopes[n].append((t_l - t_s) / (m_long - m_short) * 1e6)
  for n in fns:
    res["rows"][n].update(device_us=statistics.median(slopes[n]), rounds_us=slopes[n])
    print(f"{n:22s} device {statistics.median(slopes[n]):8.2f} us  rounds "
          f"{', '.join(f'{x:.1f}' for x in slopes[n])}", flush=True)
  d = res["rows"]["dense_nhd"]["device_us"]
  res["speedups_vs_dense_nhd"] = {n: d / r["device_us"] for n, r in res["rows"].items()}
  print("dense_nhd / row:", {n: round(x, 2) for n, x in res["speedups_vs_dense_nhd"].items()})
  if a.kernel_trace:
    from experiments.kernel_trace import format_times, kernel_times
    traced, traced_prog = {}, {}
    for n, f in fns.items():   # each row: calls one at a time, distinct q per call
      try:
        traced[n] = kernel_times(jax.jit(f), [(x, cache) for x in qs], calls=a.kernel_trace)
      except RuntimeError as e:   # e.g. no device plane (CUPTI missing): keep the slopes
        res["kernel_trace_error"] = str(e)
        print("kernel trace failed:", e, flush=True)
        break
      print(format_times(n, traced[n]), flush=True)
      res["rows"][n]["kernel_trace"] = traced[n]
      # the long program (m_long calls in one executable): its span has no host dispatch gaps
      tp = kernel_times(progs[(n, m_long)], [(qs[:m_long], cache)],
                        calls=max(1, -(-a.kernel_trace // m_long)), calls_per_run=m_long)
      traced_prog[n] = res["rows"][n]["kernel_trace_program"] = tp
      print(format_times(n + " (program)", tp), flush=True)
    for tag, tr in (("", traced), ("_program", traced_prog)):
      for key in ("sum_us", "span_us") if "dense_nhd" in tr else ():
        base = tr["dense_nhd"][key]
        r = res[f"kernel_trace{tag}_{key}_dense_over_row"] = {
            n: (base / t[key] if t[key] else None) for n, t in tr.items()}
        print(f"dense_nhd / row by kernel{tag} {key}:",
              {n: (round(x, 2) if x else x) for n, x in r.items()}, flush=True)
  json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
  main()
