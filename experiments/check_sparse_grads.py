"""Triton vs XLA check of the sparse attention the h200 preset trains with: outputs and gradients.

The trained sparse variants of the h200 co-adaptation preset (``experiments/coadaptation.py``)
collapsed on the H200 once long rows arrived. On the GPU their layers run the Pallas Triton
kernels (forward, dQ, dK/dV and the gate-gradient kernel); on a CPU the same code runs "xla".
This script runs the exact call the model's sparse layers make
(``jattn.sparse.sparse_attention(q, k, v, block_size, top_k, q_block_size, gate_grad, rng,
causal=True, segment_ids, scale=1/sqrt(head_dim))``, one initial and one local block) with both
implementations on the same inputs and compares, per tensor:

  out, lse (forward), dq, dk, dv (``jax.grad`` of sum(out * ct), the gate path included for
  "ste"/"gumbel"), dgate (the per-kept-tile gate cotangent, ``sparse._gated_attention``'s VJP)

as norm-wise relative errors ||triton - xla|| / ||xla||, plus: non-finite values (either side),
equal block selections, -inf lse rows in the same places, and a repeat run of the Triton path
(must be bitwise identical: no atomics anywhere). Inputs: bf16-representable q/k/v (the fp32
cases use the same values, so both dtypes select the same blocks), packed segment ids as the data
stream makes them (a retrieval row at span 1625: a 53-token filler document then 5 episodes, as
at training step ~160; a packed text row with padding id 0 at its end; an evaluation row; a
1600-token case with a ragged last block), all three gate modes. Unless ``--no-model``: one loss
+ parameter-gradient comparison of the whole preset model (6 layers, d 256, bf16 compute, the
preset's sparse_ste layers, one retrieval row with an episode of ~25 blocks plus one packed text
row from the real corpus), with the dense "full" model as the control for what bf16
triton-vs-xla differences look like at model level.

Bounds (exit 1 if exceeded; ``TOL``): bf16 2e-2, fp32 2e-3. The "xla" path computes attention
in fp32 at HIGHEST precision and rounds its results to the input dtype, so in bf16 the
difference is the kernels' own bf16 error: P and dS are rounded to bf16 before their matmuls
(unit roundoff 2^-9 ~ 2e-3 per element, averaged over many terms) and outputs/gradients are
stored in bf16. Measured in interpret mode at these shapes (CPU, jax 0.10.2): out 1.6e-3, dq
3.0e-3, dk 2.9e-3, dv 2.6e-3, dgate 1.5e-3, lse 5e-8; so 2e-2 leaves a ~7x margin, while a wrong
mask, a dropped or extra tile, a wrong lse or a wrong chunk offset gives O(0.1-1). In fp32 the
kernels use IEEE fp32 products (Precision.HIGHEST): measured 3e-7 to 7e-7; 2e-3 still tolerates a
stray TF32 product (~1e-3: worth knowing, not a training killer) and fails on any real bug.
dgate is a tile sum of dS terms that cancel (a full row of dS sums to 0) and the xla side of it
runs bf16 matmuls too, so it gets 4x the bound. The whole-model gradients go through 6 bf16
layers and discrete top-k selections (a near-tie flipped by a 1-ulp difference changes a whole
tile), so they are judged against the dense control: fail if the sparse model's gradient error
exceeds max(5 x the dense model's, 5e-2). Measured in interpret mode at the preset's model with
2048 tokens: bf16 grad rel 8.4e-3 (full) vs 0.9-1.1e-2 (sparse none/ste/gumbel); fp32 ~1.2e-6
for all.

Usage::

  python -m experiments.check_sparse_grads --out runs/check_sparse.json         # H200, < 2 min
  python -m experiments.check_sparse_grads --interpret --small --out /tmp/c.json  # CPU, ~1.5 min

Order: bf16 packed 8K rows (every gate), the whole-model check, the other bf16 cases, fp32.
``--time-budget`` (default 150 s) skips what is left after that much wall time (listed under
"skipped", not failed). Exit status: 0 all within bounds, 1 a failure (table and JSON say which).

Prints a table; writes JSON ({"rows": [...], "model": [...], "meta": {...}, "failures": [...]})
to ``--out`` after every case (so a killed run keeps what it finished).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time

import numpy as np

TOL = {"bfloat16": 2e-2, "float32": 2e-3}
DGATE_FACTOR = 4.0
MODEL_FACTOR, MODEL_FLOOR = 5.0, 5e-2
TENSORS = ("out", "lse", "dq", "dk", "dv", "dgate")


# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------

def retrieval_segments(seq, span, query_len=3):
  """Segment ids of one retrieval row as ``experiments.data.retrieval_rows`` lays it out: a
  filler document (id 1) of the tokens left over, then ``(seq + 1) // (span + query_len)``
  episodes of ``span + query_len`` tokens (ids 2, 3, ...), right-aligned; no padding."""
  L1 = seq + 1
  ep = span + query_len
  k = max(1, L1 // ep)
  lead = L1 - k * ep
  seg = np.zeros(L1, np.int32)
  bounds = ([0] if lead else []) + [lead + i * ep for i in range(k)] + [L1]
  for si, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
    seg[a:b] = si + 1
  return seg[:seq]


def text_segments(seq, rng, mean_doc, pad):
  """A packed text row: documents of exponential lengths (>= 16 tokens), ids 1, 2, ..., then
  ``pad`` tokens of padding (id 0) at the end."""
  seg = np.zeros(seq, np.int32)
  pos, i = 0, 1
  while pos < seq - pad:
    n = int(max(16, rng.exponential(mean_doc)))
    seg[pos:min(pos + n, seq - pad)] = i
    pos += n
    i += 1
  return seg


def cases(small):
  """The kernel cases: (name, seq, list of per-row segment-id layouts, dtypes or None: all)."""
  rng = np.random.default_rng(0)
  if small:
    return [
        ("small_packed", 320, [retrieval_segments(320, 60), text_segments(320, rng, 70, 23)],
         None),
        ("small_ragged", 200, [text_segments(200, rng, 50, 9)], None),
    ]
  return [
      # training step ~160 (span ~1625): 53-token filler + 5 episodes; packed text with padding
      ("8k_packed", 8192, [retrieval_segments(8192, 1625),
                           text_segments(8192, rng, 1500, 301)], None),
      # evaluation row (full span): 13-token filler + one episode
      ("8k_eval", 8192, [retrieval_segments(8192, 8192 - 12)], ("bfloat16",)),
      # ~1.6K tokens, not a multiple of the block: ragged last block, padding, 5 episodes
      ("1.6k_packed", 1600, [retrieval_segments(1600, 300), text_segments(1600, rng, 400, 37)],
       None),
  ]


def sparse_config(small):
  """Options of the h200 preset's sparse layers (from the preset itself), or tiny ones."""
  from experiments import coadaptation as coad
  p = coad.PRESETS["h200"]
  spec = coad.variant_layers(p, "sparse_ste")[0]
  cfg = dict(num_heads=p.num_heads, num_kv_heads=p.num_kv_heads, head_dim=p.head_dim,
             block_size=spec.block_size, q_block_size=spec.q_block_size, top_k=spec.top_k)
  if small:
    cfg.update(head_dim=32, block_size=16, q_block_size=16, top_k=3)
  return cfg


def make_inputs(seed, batch, seq, cfg, logit_std):
  """bf16-representable q, k, v (fp32 arrays) and an fp32 cotangent; logits have std ~logit_std."""
  import jax
  import jax.numpy as jnp
  hq, hk, d = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
  ks = jax.random.split(jax.random.key(seed), 4)
  a = math.sqrt(logit_std)
  r = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
  q = r(a * jax.random.normal(ks[0], (batch, seq, hq, d)))
  k = r(a * jax.random.normal(ks[1], (batch, seq, hk, d)))
  v = r(jax.random.normal(ks[2], (batch, seq, hk, d)))
  ct = jax.random.normal(ks[3], (batch, seq, hq, d))
  return q, k, v, ct


# --------------------------------------------------------------------------------------------------
# One implementation, one gate mode
# --------------------------------------------------------------------------------------------------

def make_fn(impl, gate, cfg, interpret):
  """Jitted f(q, k, v, seg, ct, rng) -> dict of out, lse, dq, dk, dv, dgate, indices."""
  import jax
  import jax.numpy as jnp
  from jattn import sparse
  scale = 1.0 / math.sqrt(cfg["head_dim"])
  kw = dict(block_size=cfg["block_size"], q_block_size=cfg["q_block_size"], top_k=cfg["top_k"],
            causal=True, scale=scale, implementation=impl, interpret=interpret)

  def f(q, k, v, seg, ct, rng):
    rng = rng if gate == "gumbel" else None

    def loss(q, k, v):
      out = sparse.sparse_attention(q, k, v, gate_grad=gate, rng=rng, segment_ids=seg, **kw)
      return jnp.sum(out.astype(jnp.float32) * ct), out

    (_, out), (dq, dk, dv) = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    _, sel = sparse.sparse_attention(q, k, v, gate_grad=gate, rng=rng, segment_ids=seg,
                                     return_selection=True, **kw)
    bare = dataclasses.replace(sel, scores=None)
    gate0 = jnp.zeros(sel.indices.shape, jnp.float32)
    gated = lambda g: sparse._gated_attention(q, k, v, g, bare, seg, seg, True, scale, impl,
                                              bool(interpret))
    (out2, lse), vjp = jax.vjp(gated, gate0)
    (dgate,) = vjp((ct.astype(out2.dtype), jnp.zeros_like(lse)))
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv, dgate=dgate, indices=sel.indices)

  return jax.jit(f)


def rel_err(a, b, name):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  out = {}
  if name == "lse":
    ia, ib = np.isneginf(a), np.isneginf(b)
    out["neginf_mismatch"] = int(np.sum(ia != ib))
    ok = ~ia & ~ib
    a, b = np.where(ok, a, 0.0), np.where(ok, b, 0.0)
  out["nonfinite"] = int(np.sum(~np.isfinite(a))) + int(np.sum(~np.isfinite(b)))
  a = np.where(np.isfinite(a), a, 0.0)
  b = np.where(np.isfinite(b), b, 0.0)
  nb = np.linalg.norm(b)
  out["rel"] = float(np.linalg.norm(a - b) / max(nb, 1e-30))
  out["max_abs"] = float(np.max(np.abs(a - b))) if a.size else 0.0
  out["ref_max"] = float(np.max(np.abs(b))) if b.size else 0.0
  return out


def kernel_case(name, seq, layouts, dtype_name, gate, cfg, interpret, seed, logit_std):
  """Run triton (twice) and xla for one case; returns the result row."""
  import jax
  import jax.numpy as jnp
  dtype = jnp.dtype(dtype_name)
  seg = jnp.asarray(np.stack(layouts))
  q, k, v, ct = make_inputs(seed, seg.shape[0], seq, cfg, logit_std)
  q, k, v = (x.astype(dtype) for x in (q, k, v))
  rng = jax.random.key(seed + 1)
  t0 = time.perf_counter()
  res = {}
  for impl in ("triton", "xla"):
    fn = make_fn(impl, gate, cfg, interpret if impl == "triton" else False)
    r = jax.block_until_ready(fn(q, k, v, seg, ct, rng))
    res[impl] = {n: np.asarray(x.astype(jnp.float32) if x.dtype != jnp.int32 else x)
                 for n, x in r.items()}
    if impl == "triton":
      r2 = jax.block_until_ready(fn(q, k, v, seg, ct, rng))
      res["repeat"] = {n: np.asarray(x.astype(jnp.float32) if x.dtype != jnp.int32 else x)
                       for n, x in r2.items()}
  t, x, t2 = res["triton"], res["xla"], res["repeat"]
  row = {"case": name, "seq": seq, "batch": int(seg.shape[0]), "dtype": dtype_name, "gate": gate,
         "time_s": round(time.perf_counter() - t0, 2)}
  idx = t["indices"]
  row["sel_equal"] = bool(np.array_equal(idx, x["indices"]))
  row["kept_blocks_mean"] = float(np.mean(np.sum(idx >= 0, -1)))
  row["deterministic"] = all(np.array_equal(t[n], t2[n], equal_nan=True) for n in t)
  failures = []
  tol = TOL[dtype_name]
  for n in TENSORS:
    e = rel_err(t[n], x[n], n)
    row[n] = e
    bound = tol * (DGATE_FACTOR if n == "dgate" else 1.0)
    if not e["rel"] <= bound:
      failures.append(f"{n} rel {e['rel']:.2e} > {bound:.0e}")
    if e["nonfinite"]:
      failures.append(f"{n} has {e['nonfinite']} non-finite values")
    if e.get("neginf_mismatch"):
      failures.append(f"lse -inf rows differ in {e['neginf_mismatch']} places")
  if not row["sel_equal"]:
    failures.append("selections differ")
  if not row["deterministic"]:
    failures.append("triton repeat run not bitwise identical")
  row["failures"] = failures
  return row


# --------------------------------------------------------------------------------------------------
# Whole model: loss and parameter gradients
# --------------------------------------------------------------------------------------------------

def model_batch(preset, small, step_span, rows):
  """A training batch: ``rows`` retrieval rows at span ~step_span plus one packed text row."""
  from experiments import data
  task = preset.task_config()
  corpus, _ = data.load_python_corpus(max_bytes=1_000_000 if small else 3_000_000)
  rng = np.random.default_rng(123)
  ret = data.retrieval_rows(task, rng, rows, corpus, step_span)
  packed = data.PackedText(corpus, preset.seq_len + 1)
  txt = data.text_batch(packed, packed.rows(np.array([0])))
  keys = ("inputs", "targets", "segment_ids", "positions", "weights", "answer_mask")
  return {kk: np.concatenate([ret[kk], txt[kk]]) for kk in keys}


def model_check(variant, preset, batch, interpret):
  """Loss and parameter gradients of one variant's model, triton vs xla (same init, same batch).

  Returns a dict: loss for each, loss rel diff, global grad rel error, the worst leaf."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from experiments import coadaptation as coad
  from experiments.train_lib import _call, _cast, weighted_xent
  out = {"variant": variant}
  grads, losses = {}, {}
  t0 = time.perf_counter()
  jb = {kk: jnp.asarray(vv) for kk, vv in batch.items()}
  for impl in ("triton", "xla"):
    p = dataclasses.replace(preset, implementation=impl,
                            interpret=bool(interpret) and impl == "triton")
    model = coad.build_model(p, variant, 0)
    gd, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def f(params, rest, b, gd=gd, dt=p.compute_dtype):
      # as train_lib._train_step: nnx.value_and_grad w.r.t. nnx.Param, so the Gumbel layers may
      # draw from (and advance) their RNG stream inside; the same rest -> the same noise.
      m = nnx.merge(gd, _cast(params, None if dt is None else jnp.dtype(dt)), rest)
      loss_fn = lambda m: weighted_xent(_call(m, b, coad.uses_segments(variant), {}), b)[0]
      loss, grads = nnx.value_and_grad(loss_fn)(m)
      return loss, jax.tree.map(lambda g, x: g.astype(x.dtype), grads, params)

    loss, g = jax.block_until_ready(f(params, rest, jb))
    losses[impl] = float(loss)
    grads[impl] = [np.asarray(x, np.float64) for x in jax.tree.leaves(g)]
    names = [jax.tree_util.keystr(kp) for kp, _ in jax.tree_util.tree_leaves_with_path(g)]
  gt, gx = grads["triton"], grads["xla"]
  flat_t = np.concatenate([x.ravel() for x in gt])
  flat_x = np.concatenate([x.ravel() for x in gx])
  out["loss_triton"], out["loss_xla"] = losses["triton"], losses["xla"]
  out["loss_rel"] = abs(losses["triton"] - losses["xla"]) / max(abs(losses["xla"]), 1e-30)
  out["grad_rel"] = float(np.linalg.norm(flat_t - flat_x) / max(np.linalg.norm(flat_x), 1e-30))
  out["nonfinite"] = int(np.sum(~np.isfinite(flat_t)) + np.sum(~np.isfinite(flat_x)))
  per = [(float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)), n)
         for a, b, n in zip(gt, gx, names)]
  worst = max(per)
  out["worst_leaf"], out["worst_leaf_rel"] = worst[1], worst[0]
  out["time_s"] = round(time.perf_counter() - t0, 2)
  return out


# --------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------

def _fmt_row(r):
  cells = [f"{r['case']:<12}", f"{r['dtype']:<8}", f"{r['gate']:<6}"]
  for n in TENSORS:
    cells.append(f"{r[n]['rel']:.2e}")
  cells.append("yes" if r["sel_equal"] else "NO")
  cells.append("yes" if r["deterministic"] else "NO")
  cells.append(f"{r['time_s']:.1f}")
  cells.append("ok" if not r["failures"] else "FAIL: " + "; ".join(r["failures"]))
  return " | ".join(cells)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True, help="JSON output path")
  ap.add_argument("--interpret", action="store_true",
                  help="run the Triton kernels in the Pallas interpreter (CPU)")
  ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
  ap.add_argument("--dtypes", default="bfloat16,float32")
  ap.add_argument("--gates", default="none,ste,gumbel")
  ap.add_argument("--cases", default=None, help="comma-separated subset of the case names")
  ap.add_argument("--no-model", action="store_true", help="skip the whole-model comparison")
  ap.add_argument("--model-variants", default="full,sparse_ste",
                  help="variants of the model check (full is the dense control)")
  ap.add_argument("--no-kernels", action="store_true", help="only the whole-model comparison")
  ap.add_argument("--model-seq", type=int, default=None,
                  help="sequence length of the model check (default: the preset's 8192; "
                       "--small: 256)")
  ap.add_argument("--model-compute-dtype", default=None,
                  help="override the preset's compute dtype in the model check ('none': fp32)")
  ap.add_argument("--logit-std", type=float, default=2.0, help="std of the random logits")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--time-budget", type=float, default=150.0,
                  help="seconds: skip the remaining cases (listed as skipped, not failed) once "
                       "this much wall time has passed (0: no limit)")
  args = ap.parse_args(argv)

  import jax
  t_start = time.perf_counter()
  cfg = sparse_config(args.small)
  dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
  gates = [g.strip() for g in args.gates.split(",") if g.strip()]
  todo = [] if args.no_kernels else cases(args.small)
  if args.cases:
    want = {c.strip() for c in args.cases.split(",")}
    todo = [c for c in todo if c[0] in want]
    if not todo and not args.no_kernels:
      ap.error(f"--cases {args.cases!r} matches none of {[c[0] for c in cases(args.small)]}")
  meta = {"config": cfg, "tol": TOL, "dgate_factor": DGATE_FACTOR,
          "model_bound": {"factor_of_dense": MODEL_FACTOR, "floor": MODEL_FLOOR},
          "interpret": args.interpret, "small": args.small, "logit_std": args.logit_std,
          "jax": jax.__version__, "devices": [str(d) for d in jax.devices()],
          "python": platform.python_version()}
  result = {"rows": [], "model": [], "meta": meta, "failures": [], "skipped": []}

  def save():
    d = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(d, exist_ok=True)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
      json.dump(result, f, indent=1)
    os.replace(tmp, args.out)

  def over_budget():
    return bool(args.time_budget) and time.perf_counter() - t_start > args.time_budget

  print(f"[check_sparse_grads] {meta['devices']} jax {jax.__version__} config {cfg}"
        f" interpret={args.interpret}", flush=True)
  head = ("case         | dtype    | gate   | " + " | ".join(f"{n:<8}" for n in TENSORS)
          + " | sel eq | determ | s | verdict")

  def run_kernels(tasks):
    print("\nrelative errors ||triton - xla|| / ||xla||")
    print(head, flush=True)
    for name, seq, layouts, dtype, gate in tasks:
      if over_budget():
        result["skipped"].append(f"{name}/{dtype}/{gate}")
        continue
      row = kernel_case(name, seq, layouts, dtype, gate, cfg, args.interpret, args.seed,
                        args.logit_std)
      result["rows"].append(row)
      result["failures"] += [f"{name}/{dtype}/{gate}: {f}" for f in row["failures"]]
      print(_fmt_row(row), flush=True)
      save()

  def run_model():
    from experiments import coadaptation as coad
    preset = coad.PRESETS["h200"]
    if args.small:
      preset = dataclasses.replace(preset, seq_len=256, num_layers=2, d_model=64, head_dim=32,
                                   block_size=16, window=64)
    if args.model_seq:
      preset = dataclasses.replace(preset, seq_len=args.model_seq)
    if args.model_compute_dtype:
      cd = args.model_compute_dtype
      preset = dataclasses.replace(preset, compute_dtype=None if cd.lower() == "none" else cd)
    # Episodes of ~25 key blocks (span 1625 at blocks of 64: 5 per 8K row, as at training step
    # ~160), so that top-k selection drops blocks; at most one episode per row.
    span = max(16, min(1625 * preset.block_size // 64, preset.seq_len - 12))
    batch = model_batch(preset, args.small, span, rows=1)
    meta["model_preset"] = {"seq_len": preset.seq_len, "num_layers": preset.num_layers,
                            "d_model": preset.d_model, "block_size": preset.block_size,
                            "top_k": coad.sparse_top_k(preset), "span": span,
                            "compute_dtype": preset.compute_dtype}
    dense_rel = None
    print("\nmodel loss + parameter gradients, triton vs xla "
          f"(seq {preset.seq_len}, {preset.num_layers} layers, {preset.compute_dtype})")
    for variant in [v.strip() for v in args.model_variants.split(",") if v.strip()]:
      if over_budget():
        result["skipped"].append(f"model/{variant}")
        continue
      m = model_check(variant, preset, batch, args.interpret)
      fails = []
      if m["nonfinite"]:
        fails.append(f"{m['nonfinite']} non-finite gradient values")
      if variant == "full":
        dense_rel = m["grad_rel"]
      else:
        bound = max(MODEL_FLOOR, MODEL_FACTOR * (dense_rel or 0.0))
        m["bound"] = bound
        if not m["grad_rel"] <= bound:
          fails.append(f"grad rel {m['grad_rel']:.2e} > {bound:.1e}")
      m["failures"] = fails
      result["model"].append(m)
      result["failures"] += [f"model/{variant}: {f}" for f in fails]
      print(f"  {variant:<12} loss triton {m['loss_triton']:.5f} xla {m['loss_xla']:.5f} "
            f"(rel {m['loss_rel']:.1e}) | grad rel {m['grad_rel']:.2e} | worst leaf "
            f"{m['worst_leaf_rel']:.2e} {m['worst_leaf']} | {m['time_s']:.1f} s | "
            + ("ok" if not fails else "FAIL: " + "; ".join(fails)), flush=True)
      save()

  # Priority order (a --time-budget cut keeps the most telling ones): the training configuration
  # (first dtype, first case: bf16 packed 8K rows, every gate), then the whole model, then the rest.
  tasks = [(name, seq, layouts, dtype, gate) for dtype in dtypes
           for name, seq, layouts, only in todo if only is None or dtype in only
           for gate in gates]
  is_first = [bool(todo) and t[0] == todo[0][0] and t[3] == dtypes[0] for t in tasks]
  if any(is_first):
    run_kernels([t for t, f in zip(tasks, is_first) if f])
  if not args.no_model:
    run_model()
  if not all(is_first):
    run_kernels([t for t, f in zip(tasks, is_first) if not f])

  meta["wall_s"] = round(time.perf_counter() - t_start, 1)
  save()
  print(f"\n{len(result['rows'])} kernel cases, {len(result['model'])} model checks, "
        f"{len(result['skipped'])} skipped, {meta['wall_s']} s; JSON: {args.out}")
  if result["skipped"]:
    print(f"SKIPPED (--time-budget {args.time_budget:g} s): " + ", ".join(result["skipped"]))
  if result["failures"]:
    print("FAILURES:")
    for f in result["failures"]:
      print("  " + f)
    return 1
  print("all within bounds")
  return 0


if __name__ == "__main__":
  sys.exit(main())
