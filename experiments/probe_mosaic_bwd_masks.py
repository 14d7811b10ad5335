"""Forward + backward on the Hopper path with masks: the Mosaic GPU backward (windows and soft cap
since session 26) against the Triton backward (the default for masked calls before) and jax.nn's
cuDNN, all in one process (GPU only).

Per case (B2 H16 bf16 unless --shape) it times, with the bench's timer (``pallas_kernels._timing``,
3 random input sets):
  * ``cudnn_fwd`` / ``cudnn_fwd_bwd`` (jax.nn.dot_product_attention(implementation="cudnn"); no
    soft cap there, so soft-cap cases have no cuDNN rows; no segment ids either, so packed
    documents run cuDNN on the same documents as separate causal rows, the same math);
  * ``jattn_fwd`` (the Mosaic GPU forward, the table's tiles for the mask kind);
  * ``fwd_bwd[triton]`` and ``fwd_bwd[mosaic]`` (that forward + each backward), and
    ``fwd_bwd[mosaic <cfg>]`` for the backward tile configs given with --configs.
Each fwd+bwd row reports max |d - d_ref| over dq, dk, dv against the Triton backward's gradients
(``diff_vs_triton``) and, where it ran, cuDNN's (``diff_vs_cudnn``), on the first input set.
The GPU tests (``-m gpu``) check both backwards against the fp32 reference.

Usage (on an H100/H200):
  python experiments/probe_mosaic_bwd_masks.py --out probe.json
  python experiments/probe_mosaic_bwd_masks.py --cases window512 --configs 64,64,64,64,3,2
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time

CASES = {
    # name: (seq, head_dim, causal, window, soft_cap, docs: packed causal documents per row)
    "window512": (16384, 128, True, (511, 0), None, None),
    "window512_d64": (16384, 64, True, (511, 0), None, None),
    "window512_s4k": (4096, 128, True, (511, 0), None, None),
    "window2048": (16384, 128, True, (2047, 0), None, None),
    "soft_cap_causal": (16384, 128, True, None, 30.0, None),
    "window512_soft_cap": (16384, 128, True, (511, 0), 30.0, None),
    "packed4": (16384, 128, True, None, None, 4),
    "packed16_d64": (16384, 64, True, None, None, 16),
}


def _bwd_config(text):
  """"bq_dkv,bk_dkv,bq_dq,bk_dq,stages_dkv,stages_dq" -> mosaic_gpu_bwd.BlockSizes."""
  from pallas_kernels.flash import mosaic_gpu_bwd as mb
  return mb.BlockSizes(*(int(x) for x in text.split(",")))


def run_case(name, *, batch=2, heads=16, configs=(), iters=None):
  """Rows of one case (see the module doc).

  Args:
    name: a key of ``CASES``.
    batch, heads: problem size (self-attention, no GQA).
    configs: extra ``mosaic_gpu_bwd.BlockSizes`` for the Mosaic backward.
    iters: calls per timed loop (None: enough for 0.25 s).

  Returns:
    A list of dicts: case, name, ms (or error), diff_vs_triton, diff_vs_cudnn.

  Example:
    >>> rows = run_case("window512")  # doctest: +SKIP
  """
  import jax
  import jax.numpy as jnp
  from pallas_kernels._timing import random_sets, timed
  from pallas_kernels.flash import mosaic_gpu as mg
  from pallas_kernels.tuning import mask_kind

  seq, d, causal, window, cap, docs = CASES[name]
  shape = (batch, seq, heads, d)
  seg = None if docs is None else jnp.broadcast_to(
      jnp.repeat(jnp.arange(1, docs + 1, dtype=jnp.int32), seq // docs), (batch, seq))
  sets = [dict(zip(("q", "k", "v", "do"), s))
          for s in random_sets([shape] * 4, jnp.bfloat16)]
  base = mg.fit_block_sizes(mg.default_block_sizes(d, mask=mask_kind(
      causal, window, segments=seg is not None)), shape, shape, causal=causal, window=window,
      segments=seg is not None)
  rows, ref = [], {}

  def timeit(fn, *names):
    return timed(jax.jit(fn), [tuple(s[n] for n in names) for s in sets], iters=iters)

  def maxdiff(a, b):
    return max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
               for x, y in zip(a, b))

  def add(label, fn, names, grads=True):
    row = dict(case=name, name=label)
    try:
      out, ms = timeit(fn, *names)
      row["ms"] = ms
      if grads:
        for key, r in ref.items():
          row[f"diff_vs_{key}"] = maxdiff(out, r)
        if not all(bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))) for g in out):
          row["nonfinite"] = True
    except Exception as e:  # reported, not fatal
      out = None
      row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    rows.append(row)
    print(json.dumps(row), flush=True)
    return out

  def jattn_fwd_bwd(bs, bwd_bs=None):
    f = lambda q, k, v: mg.flash_attention(q, k, v, seg, seg, causal=causal,
                                           local_window_size=window, logits_soft_cap=cap,
                                           block_sizes=bs, bwd_block_sizes=bwd_bs)[0]

    def run(q, k, v, do):
      _, vjp = jax.vjp(f, q, k, v)
      return vjp(do)
    return run

  if cap is None:
    rows_of = (lambda x: x) if docs is None else (   # documents as separate rows
        lambda x: x.reshape(batch * docs, seq // docs, heads, d))
    back = (lambda x: x) if docs is None else (lambda x: x.reshape(shape))
    cudnn_rows = functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                                   local_window_size=window, implementation="cudnn")
    cudnn = lambda q, k, v: back(cudnn_rows(rows_of(q), rows_of(k), rows_of(v)))

    def cudnn_fwd_bwd(q, k, v, do):
      _, vjp = jax.vjp(cudnn, q, k, v)
      return vjp(do)
    add("cudnn_fwd", cudnn, ("q", "k", "v"), grads=False)
    g = add("cudnn_fwd_bwd", cudnn_fwd_bwd, ("q", "k", "v", "do"), grads=False)
    if g is not None:
      ref["cudnn"] = g
  add("jattn_fwd", lambda q, k, v: mg.flash_attention(
      q, k, v, seg, seg, causal=causal, local_window_size=window, logits_soft_cap=cap,
      block_sizes=base), ("q", "k", "v"), grads=False)
  g = add("fwd_bwd[triton]", jattn_fwd_bwd(dataclasses.replace(base, backward="triton")),
          ("q", "k", "v", "do"))
  if g is not None:
    ref["triton"] = g
  add("fwd_bwd[mosaic]", jattn_fwd_bwd(dataclasses.replace(base, backward="mosaic")),
      ("q", "k", "v", "do"))
  for cfg in configs:
    add(f"fwd_bwd[mosaic {cfg}]", jattn_fwd_bwd(base, cfg), ("q", "k", "v", "do"))
  return rows


def main(argv=None):
  """Command line: run the cases, print one JSON row per timing, write them to --out.

  Args:
    argv: the arguments (None: sys.argv).

  Returns:
    The list of rows of every case.

  Example:
    >>> rows = main(["--cases", "packed4", "--out", "probe.json"])  # doctest: +SKIP
  """
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--cases", default="window512,soft_cap_causal,window512_d64",
                 help=f"comma-separated, of {list(CASES)}")
  p.add_argument("--configs", default="",
                 help="';'-separated Mosaic backward tiles 'bq_dkv,bk_dkv,bq_dq,bk_dq,sdkv,sdq'")
  p.add_argument("--batch", type=int, default=2)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--out", default=None)
  a = p.parse_args(argv)
  configs = [_bwd_config(c) for c in a.configs.split(";") if c]
  import jax
  meta = dict(date=time.strftime("%Y-%m-%d"), jax=jax.__version__,
              device=jax.devices()[0].device_kind, batch=a.batch, heads=a.heads)
  rows = []
  for name in a.cases.split(","):
    rows += run_case(name, batch=a.batch, heads=a.heads, configs=configs)
    if a.out:
      with open(a.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
  return rows


if __name__ == "__main__":
  main()
