"""Block-size sweep and A/B cases of the Triton flash kernels on the GPU (JSON rows to OUT).

    python -m experiments.gpu_sweep OUT.json [--cases causal_bwd,...] [--seqs 4096,16384]
    python -m experiments.gpu_sweep OUT.json --dry-run   # CPU: tiny sizes, Pallas interpreter
    python -m experiments.gpu_sweep OUT.json --cases tiles,causal_bwd,causal_bwd_dense \
        --write-tuning CANDIDATE.json --run "run 23"     # also a candidate tuning table

Case sets (``--cases``, default ``causal_bwd``):
  * ``causal_bwd``: why the causal backward trails tokamax-triton (docs/kernels.md, "Causal
    backward vs tokamax"): B2 H16 D128 bf16 causal, the default against each backward option
    (``CAUSAL_BWD_CONFIGS``), each with forward, forward+backward, backward alone and each
    backward kernel alone (bwd_ms, dkv_ms, dq_ms, prep_ms; the ``fused*`` configs run one
    backward kernel, so no dkv_ms / dq_ms), plus tokamax's Triton op timed the same way in the
    same process when it imports.
  * ``causal_bwd_dense``: the same configs non-causal (an option must not slow it down).
  * ``launch``: launch order A/B (the default groups 4 (batch, head) pairs, heaviest first;
    head_group=1 is the per-head order of runs 1-5).
  * ``tiles``: the tile sweep of run 3 (the default, the old single-tile default, others).

With ``--write-tuning PATH`` every config is also checked against the fp32 reference (outputs
and gradients at B1 H2, ``min(seq, CHECK_SEQ)`` keys, same mask, head dim and dtype; each row
gets ``check``), and PATH receives a candidate table in the format of ``pallas_kernels/tuning``
(see ``tuning_table``): per mask kind the checked config with the lowest median forward time
(entry "triton_fwd") and backward time (entry "triton_bwd") at the longest sequence measured
for that mask kind (``--from-rows`` merges the rows of several calls), one "all" entry per pass
when every measured mask kind picks the same. Review it, then merge its entries into the device's
table (``pallas_kernels/tuning/nvidia_h200.json``; docs/kernels.md, "Tuning data").
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

from pallas_kernels.flash import triton as ft


def causal_bwd_configs(head_dim: int = 128, dtype=jnp.bfloat16) -> dict:
  """name -> BlockSizes for the causal-backward A/B (the first is the default)."""
  d = ft.default_block_sizes(head_dim, dtype)
  return {
      "default": d,
      # the D128 default before session 12 (8 warps x 3 stages, 64-row steps)
      "prev_default": ft.PREV_D128_BF16 if (head_dim, jnp.dtype(dtype).itemsize) == (128, 2)
                      else d,
      # dK/dV walks 64-row q tiles (= its chunk): the diagonal's all-masked chunks are skipped
      # and only the chunk that crosses the diagonal is masked (bit-for-bit the same terms).
      "dkv_block_q64": dataclasses.replace(d, dkv_block_q=d.dkv_q_chunk),
      # tokamax 0.0.17's Triton VJP heuristic on an H200 (no H200 autotuning cache): dK/dV steps
      # of 64 kv x 32 q, dQ steps of 64 q x 32 kv, 4 warps, 2 stages (two CTAs per SM).
      "tokamax_tiles": dataclasses.replace(d, bwd_block_q=64, bwd_block_k=64, bwd_num_warps=4,
                                           bwd_num_stages=2, dkv_q_chunk=32, dq_k_chunk=32),
      "tokamax_tiles+dkv_block_q32": dataclasses.replace(
          d, bwd_block_q=64, bwd_block_k=64, bwd_num_warps=4, bwd_num_stages=2, dkv_q_chunk=32,
          dq_k_chunk=32, dkv_block_q=32),
      # default tiles, 4 warps x 2 stages with 32-row steps (two CTAs per SM if registers allow)
      "bwd_w4s2_chunk32": dataclasses.replace(d, bwd_num_warps=4, bwd_num_stages=2,
                                              dkv_q_chunk=32, dq_k_chunk=32, dkv_block_q=32),
      # One fused backward kernel (BlockSizes.fused_bwd): program t does dK/dV of kv span t, then
      # dQ of q span t (spans of max(bwd tiles) rows), constant work per program under causal.
      # With the default tiles (8 warps, 3 stages, one CTA per SM), with the diagonal chunks
      # skipped, and with tokamax's tiling/launch (4 warps, 2 stages: two CTAs per SM, so an
      # SM can hold one program in its dK/dV phase and another in its dQ phase).
      "fused": dataclasses.replace(d, fused_bwd=True),
      "fused+dkv_block_q64": dataclasses.replace(d, fused_bwd=True, dkv_block_q=d.dkv_q_chunk),
      "fused+tokamax_tiles": dataclasses.replace(
          d, bwd_block_q=64, bwd_block_k=64, bwd_num_warps=4, bwd_num_stages=2, dkv_q_chunk=32,
          dq_k_chunk=32, fused_bwd=True),
  }


def _tokamax_rows(batch, seq, heads, head_dim, causal, dtype, iters):
  """tokamax-triton timed like ``ft._sweep`` (same inputs, same timer); [] if not importable."""
  try:
    import tokamax
  except Exception as e:  # pragma: no cover - optional anchor
    print(f"tokamax not importable: {e}")
    return []
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (batch, seq, heads, head_dim), dtype)
  k = jax.random.normal(keys[1], (batch, seq, heads, head_dim), dtype)
  v = jax.random.normal(keys[2], (batch, seq, heads, head_dim), dtype)
  f = lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=causal,
                                                    implementation="triton")

  def timeit(fn, *args):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3

  row = dict(config="tokamax_triton")
  try:
    row["fwd_ms"] = timeit(jax.jit(f), q, k, v)
    row["fwd_bwd_ms"] = timeit(jax.jit(jax.grad(
        lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))), q, k, v)
    out, vjp_fn = jax.vjp(f, q, k, v)
    ct = jax.random.normal(keys[3], out.shape, out.dtype)
    row["bwd_ms"] = timeit(jax.jit(lambda fn, ct: fn(ct)), vjp_fn, ct)
  except Exception as e:
    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
  print(row, flush=True)
  return [row]


def plan(case_sets, seqs, head_dim=128):
  """[(seq, causal, window, {name: BlockSizes}, time_bwd, with_tokamax)] for the case sets."""
  out = []
  ab = causal_bwd_configs(head_dim)
  for cs in case_sets:
    if cs == "causal_bwd":
      out += [(s, True, None, ab, True, True) for s in seqs]
    elif cs == "causal_bwd_dense":
      out += [(s, False, None, ab, True, True) for s in seqs]
    elif cs == "launch":
      d = ft.default_block_sizes(head_dim, jnp.bfloat16)
      cfgs = {"default": d, "head_group1": dataclasses.replace(d, head_group=1)}
      out += [(s, True, None, cfgs, False, False) for s in seqs]
    elif cs == "tiles":
      allc = ft._bench_configs(head_dim)
      # D128: 0: the default (per-pass tiles), 3: the previous single-tile default, then other
      # tilings. Other head dims: the default and every candidate of ft._SWEEP_CANDIDATES.
      idx = (0, 3, 6, 7, 9, 11) if head_dim == 128 else range(len(allc))
      cfgs = {f"bench{i}": allc[i] for i in idx if i < len(allc)}
      out += [(16384, causal, window, cfgs, False, False) for causal, window in
              ((False, None), (True, None), (True, (511, 0)))]
    else:
      raise ValueError(f"unknown case set {cs!r}")
  return out


CHECK_SEQ = 1024
CHECK_TOL = {2: 2e-2, 4: 2e-3}  # relative L2 error of out / dq / dk / dv, by input itemsize
_FWD_FIELDS, _BWD_FIELDS = ft._FWD_FIELDS, ft._BWD_FIELDS


def check_config(cfg, *, seq, causal, window, head_dim, dtype, interpret=False, heads=2):
  """The Triton kernels with ``cfg`` against the fp32 reference (outputs and gradients).

  Args:
    cfg: a Triton ``BlockSizes``.
    seq, causal, window, head_dim, dtype: the case (checked at ``min(seq, CHECK_SEQ)`` keys).
    interpret: run the kernels in the Pallas interpreter.
    heads: query and kv heads (batch 1).

  Returns:
    A dict: seq, out/dq/dk/dv (relative L2 errors), ok (all finite and below ``CHECK_TOL``),
    or error and ok False.
  """
  import numpy as np

  import jattn
  from pallas_kernels.flash.reference import attention_reference

  n = min(seq, CHECK_SEQ)
  keys = jax.random.split(jax.random.key(1), 4)
  q, k, v, do = (jax.random.normal(kk, (1, n, heads, head_dim), dtype) for kk in keys)
  mask = dict(causal=causal, local_window_size=None if window is None else tuple(window))

  def vjp(f, *args):
    out, fn = jax.vjp(f, *args)
    return (out, *fn(do.astype(out.dtype)))

  res = dict(seq=n)
  try:
    got = jax.jit(lambda q, k, v: vjp(lambda q, k, v: jattn.flash_attention(
        q, k, v, implementation="triton", interpret=interpret, block_sizes=cfg, **mask),
        q, k, v))(q, k, v)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = jax.jit(lambda q, k, v: vjp(lambda q, k, v: attention_reference(
        q, k, v, **mask)[0], q, k, v))(*f32)
    ok = True
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
      a = np.asarray(a.astype(jnp.float32), np.float64)
      b = np.asarray(b, np.float64)
      err = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
      res[name] = err
      ok = ok and bool(np.isfinite(a).all()) and err < CHECK_TOL[jnp.dtype(dtype).itemsize]
    res["ok"] = ok
  except Exception as e:  # a config that does not compile fails its check
    res.update(error=f"{type(e).__name__}: {str(e)[:200]}", ok=False)
  return res


def mask_kind(causal, window) -> str:
  """The tuning tables' mask key of a case: "dense", "causal", "window" or "causal_window"."""
  windowed = window is not None and tuple(window) != (None, None)
  if windowed:
    return "causal_window" if causal else "window"
  return "causal" if causal else "dense"


def _git_commit():
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
  except Exception:
    return "unknown"


def tuning_table(rows, *, head_dim, dtype, device_kind, provenance):
  """A candidate tuning table (format of ``pallas_kernels/tuning``) from checked sweep rows.

  Per mask kind (``mask_kind``), among the configs timed at the longest sequence measured for
  that kind whose every row of that kind has no error and ``check["ok"]`` (configs compared by
  value, not name; tokamax rows ignored): the lowest median forward time at that length gives
  the "triton_fwd" entry (the forward's fields), the lowest backward time (``bwd_ms`` when every
  such row has it, else fwd_bwd_ms - fwd_ms) the "triton_bwd" entry (the backward's fields; its
  tiles written out when the forward winner has other tiles). A pass whose winner is the same
  for every measured mask kind (two or more) gets one entry with mask "all".

  Args:
    rows: the sweep's rows (``main``'s output: config as a dict, name, seq, causal, window,
      fwd_ms, fwd_bwd_ms, optional bwd_ms, error, check).
    head_dim, dtype: the sweep's head dim and input dtype (the table's keys).
    device_kind: jax ``device_kind`` of the machine that ran the sweep.
    provenance: fields for every entry's provenance (status, run, date, commit, command,
      results, device).

  Returns:
    A dict: format, device_kinds, description, entries (possibly empty).
  """
  d_key = max(32, ft._pow2(head_dim))
  dcls = "32bit" if jnp.dtype(dtype).itemsize >= 4 else "16bit"
  default = json.dumps(dataclasses.asdict(ft.default_block_sizes(head_dim, dtype)),
                       sort_keys=True)
  groups, seqs = {}, {}
  for r in rows:
    if not isinstance(r.get("config"), dict):
      continue  # tokamax rows
    m = mask_kind(r["causal"], r.get("window"))
    seqs.setdefault(m, set()).add(r["seq"])
    key = json.dumps(r["config"], sort_keys=True)
    g = groups.setdefault(m, {}).setdefault(
        key, dict(config=r["config"], names=set(), fwd={}, bwd={}, fwd_bwd={}, ok=True))
    g["names"].add(r["name"])
    if "error" in r or not (r.get("check") or {}).get("ok") or "fwd_ms" not in r:
      g["ok"] = False
      continue
    s = r["seq"]
    g["fwd"][s] = min(g["fwd"].get(s, math.inf), r["fwd_ms"])
    g["fwd_bwd"][s] = min(g["fwd_bwd"].get(s, math.inf), r["fwd_bwd_ms"] - r["fwd_ms"])
    if "bwd_ms" in r:
      g["bwd"][s] = min(g["bwd"].get(s, math.inf), r["bwd_ms"])
  winners = {}  # mask -> (fwd params, bwd params, provenance extras)
  for m, cands in sorted(groups.items()):
    top = max(seqs[m])
    ok = [g for g in cands.values() if g["ok"] and top in g["fwd"]]
    if not ok:
      continue
    bwd_key = "bwd" if all(top in g["bwd"] for g in ok) else "fwd_bwd"
    best_f = min(ok, key=lambda g: g["fwd"][top])
    best_b = min(ok, key=lambda g: g[bwd_key][top])
    dflt = cands.get(default)
    fwd = {k: best_f["config"][k] for k in _FWD_FIELDS}
    bwd = {k: best_b["config"][k] for k in _BWD_FIELDS}
    cb = best_b["config"]
    if (cb["block_q"], cb["block_k"]) != (fwd["block_q"], fwd["block_k"]):
      bwd["bwd_block_q"] = cb["bwd_block_q"] or cb["block_q"]
      bwd["bwd_block_k"] = cb["bwd_block_k"] or cb["block_k"]

    def measured(best, k, metric):
      out = dict(metric=metric, selected_at_seq=top, configs=sorted(best["names"]),
                 ms={str(s): round(t, 4) for s, t in sorted(best[k].items())},
                 candidates=len(ok), of=len(cands))
      if dflt is not None and dflt["ok"]:
        out["current_default_ms"] = {str(s): round(t, 4) for s, t in sorted(dflt[k].items())}
      return out

    winners[m] = (fwd, bwd, measured(best_f, "fwd", "fwd_ms"),
                  measured(best_b, bwd_key, "bwd_ms" if bwd_key == "bwd"
                           else "fwd_bwd_ms - fwd_ms"))
  entries = []
  for kernel, i in (("triton_fwd", 0), ("triton_bwd", 1)):
    same = len(winners) >= 2 and all(w[i] == next(iter(winners.values()))[i]
                                     for w in winners.values())
    for m, w in winners.items():
      mask = "all" if same else m
      prov = dict(provenance, selection="lowest median time at the longest measured seq "
                  "among configs whose outputs and gradients matched the fp32 reference",
                  measured={mm: ww[2 + i] for mm, ww in winners.items()} if same
                  else {m: w[2 + i]})
      entries.append(dict(kernel=kernel, head_dim=d_key, dtype=dcls, mask=mask,
                          params=dict(w[i]), provenance=prov))
      if same:
        break
  return {"format": 1, "device_kinds": [device_kind],
          "description": "Candidate written by experiments/gpu_sweep.py --write-tuning: review, "
                         "then merge its entries into the device's table in "
                         "pallas_kernels/tuning (docs/kernels.md, 'Tuning data').",
          "entries": entries}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("out", help="JSON file (rewritten after every row)")
  p.add_argument("--cases", default="causal_bwd",
                 help="comma list of: causal_bwd, causal_bwd_dense, launch, tiles")
  p.add_argument("--seqs", default="4096,16384")
  p.add_argument("--head-dim", type=int, default=128,
                 help="head dim of every case (bf16, B2 H16); 64 and 256 have untimed defaults")
  p.add_argument("--iters", type=int, default=10, help="timed calls per row (median)")
  p.add_argument("--configs", default=None,
                 help="causal_bwd*: comma list of config names to keep (default: all)")
  p.add_argument("--no-tokamax", action="store_true")
  p.add_argument("--dry-run", action="store_true",
                 help="CPU smoke test: seq 128, B1 H2 D32 fp32 configs, Pallas interpreter")
  p.add_argument("--write-tuning", metavar="PATH", default=None,
                 help="check every config against the reference and write a candidate tuning "
                      "table (format of pallas_kernels/tuning) to PATH")
  p.add_argument("--run", default=None,
                 help="run label for the candidate table's provenance (e.g. 'run 23')")
  p.add_argument("--from-rows", default=None, metavar="A.json[,B.json]",
                 help="with --write-tuning: no sweep, the candidate from these rows files of "
                      "earlier --write-tuning calls (e.g. case sets split over calls); OUT unused")
  args = p.parse_args(argv)
  if args.from_rows:
    if not args.write_tuning:
      p.error("--from-rows needs --write-tuning")
    rows = []
    for path in args.from_rows.split(","):
      with open(path) as fh:
        rows += json.load(fh)
    _write_tuning(args, argv, rows, args.from_rows.replace(",", "; "))
    return rows
  seqs = [int(s) for s in args.seqs.split(",")]
  cases = plan(args.cases.split(","), seqs, args.head_dim)
  keep = None if args.configs is None else set(args.configs.split(","))
  rows = []
  device, commit = jax.devices()[0].device_kind, _git_commit()
  for seq, causal, window, cfgs, time_bwd, with_tk in cases:
    names = [n for n in cfgs if keep is None or n in keep or not time_bwd]
    kw = dict(seq=seq, causal=causal, local_window_size=window, iters=args.iters,
              time_bwd=time_bwd, head_dim=args.head_dim)
    if args.dry_run:
      # Tiny problem in the interpreter: only checks that every config builds and runs.
      small = {n: dataclasses.replace(cfgs[n], block_q=16, block_k=16,
                                      bwd_block_q=32 if cfgs[n].bwd_tiles[0] > 64 else 16,
                                      bwd_block_k=16, dkv_q_chunk=16, dq_k_chunk=16,
                                      dkv_block_q=16 if cfgs[n].dkv_block_q else None)
               for n in names}
      kw.update(seq=128, batch=1, q_heads=2, kv_heads=2, head_dim=32, dtype=jnp.float32,
                interpret=True, iters=1)
      cfg_list = [small[n] for n in names]
    else:
      cfg_list = [cfgs[n] for n in names]
    for name, r in zip(names, ft._sweep(configs=cfg_list, **kw)):
      r = dict(r)
      if args.write_tuning and "error" not in r:
        r["check"] = check_config(r["config"], seq=kw["seq"], causal=causal, window=window,
                                  head_dim=kw["head_dim"], dtype=kw.get("dtype", jnp.bfloat16),
                                  interpret=kw.get("interpret", False))
        print(name, r["check"], flush=True)
      r["config"] = dataclasses.asdict(r["config"])
      r.update(name=name, seq=kw["seq"], causal=causal, window=window, device=device,
               commit=commit)
      rows.append(r)
      with open(args.out, "w") as fh:
        json.dump(rows, fh, indent=1)
    if with_tk and not args.no_tokamax and not args.dry_run:
      for r in _tokamax_rows(2, seq, 16, args.head_dim, causal, jnp.bfloat16, args.iters):
        r.update(name="tokamax_triton", seq=seq, causal=causal, window=window)
        rows.append(r)
        with open(args.out, "w") as fh:
          json.dump(rows, fh, indent=1)
  if args.write_tuning:
    _write_tuning(args, argv, rows, args.out)
  return rows


def _write_tuning(args, argv, rows, results):
  """Write ``tuning_table`` of ``rows`` to ``args.write_tuning`` (device and commit: the rows')."""
  head_dim, dtype = (32, jnp.float32) if args.dry_run else (args.head_dim, jnp.bfloat16)
  kinds = {r["device"] for r in rows if "device" in r}
  commits = sorted({r["commit"] for r in rows if "commit" in r})
  if len(kinds) > 1:
    raise ValueError(f"rows from several devices: {sorted(kinds)}")
  kind = kinds.pop() if kinds else jax.devices()[0].device_kind
  now = datetime.datetime.now(datetime.timezone.utc)
  prov = dict(status="dry-run" if args.dry_run else "tuned",
              run=args.run or f"gpu_sweep {now:%Y-%m-%dT%H:%M}Z", date=f"{now:%Y-%m-%d}",
              device=kind, commit=", ".join(commits) or _git_commit(),
              command="python -m experiments.gpu_sweep " + " ".join(
                  sys.argv[1:] if argv is None else argv),
              results=results)
  table = tuning_table(rows, head_dim=head_dim, dtype=dtype, device_kind=kind, provenance=prov)
  with open(args.write_tuning, "w") as fh:
    json.dump(table, fh, indent=1)
  print(f"candidate tuning table ({len(table['entries'])} entries): {args.write_tuning}")


if __name__ == "__main__":
  main()
