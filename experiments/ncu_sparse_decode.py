"""Kernel-level device times of issue 5's decode rows, for Nsight Compute (H200).

Issue 5 asks sparse decode at B1 S128K (GQA 32:8, D128, 64-token blocks, top 19%) to be 3x
dense decode. ``experiments/probe_sparse_decode_layout.py`` times whole jitted programs from
the host, and its per-call device slopes move by 10-20 us between rounds (runs 36-48: 2.78x to
3.07x). This target runs one row's jitted call ``--calls`` times, each on its own query, between
``cuProfilerStart`` and ``cuProfilerStop``. So ``ncu --profile-from-start off`` sees only
those launches, after compilation and warm-up. ``--clock-control none`` leaves the clocks as in
real runs, and ``gpu__time_duration`` then gives each kernel's device time. Those times have no
host noise, but they also leave out the gaps between a call's kernels (the sparse call has
three kernels, dense decode one or two), so they complement the probe's slopes and do not
replace them. ``summarize`` (below) turns ncu's CSV into per-call sums by kernel name. Two tiny
Pallas kernels named ``ncu_marker_begin`` / ``ncu_marker_end`` bracket the profiled calls, so
the summary is right even when the profiler range cannot be opened (then profile from the start
and let the markers cut).

Rows: dense_nhd (``jattn.decode_attention``, default implementation), dense_hnd (the same on
a head-major cache), sparse_hnd (``sparse_decode_attention(kv_layout="hnd")``, Triton: scores,
selection, attention), sparse_nhd. The last call's output is checked against the fp32 "xla"
reference, and the check is printed.

    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \\
        python experiments/ncu_sparse_decode.py --row sparse_hnd > sparse_hnd.csv
    python experiments/ncu_sparse_decode.py --summarize sparse_hnd.csv --calls 8

On the CPU, ``--tiny`` runs the rows in interpret mode at S1024, which checks only the wiring.
"""
from __future__ import annotations

import argparse
import csv
import ctypes
import io

import jax
import jax.numpy as jnp

ROWS = ("dense_nhd", "dense_hnd", "sparse_hnd", "sparse_nhd")


def _profiler(call: str) -> bool:
  """cuProfilerStart / cuProfilerStop through the CUDA driver; False where there is none."""
  try:
    lib = ctypes.CDLL("libcuda.so.1")
  except OSError:
    return False
  return getattr(lib, call)() == 0


def _marker(name: str, interpret: bool):
  """A tiny Pallas kernel whose launch is named ``name`` (ncu's kernel name contains it): it
  brackets the profiled calls, so ``summarize`` can keep only the launches between the two
  markers when the profiler range is not available."""
  from jax.experimental import pallas as pl

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0
  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                        name=name, interpret=interpret)
  return lambda: jax.block_until_ready(jax.jit(call)(jnp.zeros((8, 128), jnp.float32)))


def run_row(row: str, *, calls: int = 8, seq: int = 131072, tiny: bool = False,
            digit_bits: int = 1, fused_select: bool = False):
  """Compile and warm up one row, then run it ``calls`` times inside the profiler range.

  Args:
    row: one of ``ROWS``.
    calls: profiled calls, each on its own query.
    seq: cache length (tokens).
    tiny: CPU dry run (S1024, interpret mode, "xla" sparse path).
    digit_bits: the selection kernels' threshold search (1: the default bit search; 2 / 4:
      the radix forms, the same selection), patched in for the row's duration (``jattn.sparse``
      looks the kernels up in their module at call time).
    fused_select: sparse rows: ``sparse_decode_attention(fused_select=True)`` (scores and
      selection in one launch; the same selection).

  Returns:
    (relative error of the last call against the fp32 reference, whether the profiler range
    was opened).

  Example:
    >>> run_row("sparse_hnd", calls=1, tiny=True)[1]   # doctest: +SKIP
    False
  """
  if digit_bits == 1:
    return _run_row(row, calls=calls, seq=seq, tiny=tiny, fused_select=fused_select)
  import functools
  from unittest import mock
  from pallas_kernels.sparse import decode_select as ds
  with mock.patch.object(ds, "select_decode_slots", functools.partial(
      ds.select_decode_slots, digit_bits=digit_bits)), mock.patch.object(
      ds, "score_select_decode_slots", functools.partial(
          ds.score_select_decode_slots, digit_bits=digit_bits)):
    return _run_row(row, calls=calls, seq=seq, tiny=tiny, fused_select=fused_select)


def _run_row(row: str, *, calls: int = 8, seq: int = 131072, tiny: bool = False,
             fused_select: bool = False):
  """The body of :func:`run_row` (same arguments; ``digit_bits`` already patched in)."""
  from jattn import decode as jd
  from jattn import sparse as sp
  if row not in ROWS:
    raise ValueError(f"row must be one of {ROWS}, got {row!r}")
  b, hq, hk, d, bs = 1, 32, 8, 128, 64
  s = 1024 if tiny else seq
  top_k = max(1, round(0.19 * (s // bs)) - 2)
  keys = jax.random.split(jax.random.key(0), 4)
  k = jax.random.normal(keys[0], (b, s, hk, d), jnp.bfloat16)
  v = jax.random.normal(keys[1], (b, s, hk, d), jnp.bfloat16)
  qs = [jax.random.normal(kq, (b, hq, d), jnp.bfloat16)
        for kq in jax.random.split(keys[2], calls + 1)]
  lens = jnp.full((b,), s, jnp.int32)
  hnd = row.endswith("_hnd")
  kc, vc = (jnp.transpose(x, (0, 2, 1, 3)) for x in (k, v)) if hnd else (k, v)
  layout = "hnd" if hnd else "nhd"
  kw = dict(interpret=tiny, kv_layout=layout)
  if row.startswith("dense"):
    fn = jax.jit(lambda q: jd.decode_attention(q, kc, vc, lens, **kw))
    ref = jd.decode_attention(qs[-1].astype(jnp.float32), k.astype(jnp.float32),
                              v.astype(jnp.float32), lens, implementation="xla")
  else:
    summ = sp.init_block_summaries(kc, lens, block_size=bs, kv_layout=layout)
    impl = "xla" if tiny else "triton"
    if fused_select and not tiny:
      kw["fused_select"] = True
    fn = jax.jit(lambda q: sp.sparse_decode_attention(
        q, kc, vc, lens, summ, block_size=bs, top_k=top_k, implementation=impl, **kw))
    ref = sp.sparse_decode_attention(
        qs[-1].astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), lens,
        sp.init_block_summaries(k, lens, block_size=bs), block_size=bs, top_k=top_k,
        implementation="xla")
  jax.block_until_ready(fn(qs[0]))                       # compile + warm up
  begin, end = _marker("ncu_marker_begin", tiny), _marker("ncu_marker_end", tiny)
  begin()
  begin()                                                # (compiled: the second is the mark)
  opened = _profiler("cuProfilerStart")
  out = None
  for q in qs[1:]:
    out = jax.block_until_ready(fn(q))
  end()
  if opened:
    _profiler("cuProfilerStop")
  o, r = out.astype(jnp.float32), ref.astype(jnp.float32)
  return float(jnp.linalg.norm(o - r) / jnp.linalg.norm(r)), opened


def summarize(csv_text: str, calls: int) -> dict:
  """Per-call device time by kernel name from ncu's ``--csv`` output.

  Args:
    csv_text: ncu's output (lines before the CSV header are skipped).
    calls: the profiled calls (``--calls``), to turn sums into per-call times.

  Returns:
    {"kernels": {name: us per call}, "total_us": sum over kernels per call, "launches": n}.

  Example:
    >>> text = ('"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\\n'
    ...         '"0","a","gpu__time_duration.sum","ns","1,000"\\n'
    ...         '"1","b","gpu__time_duration.sum","us","3"\\n'
    ...         '"2","a","gpu__time_duration.sum","ns","3000"\\n')
    >>> summarize(text, calls=2)
    {'kernels': {'a': 2.0, 'b': 1.5}, 'total_us': 3.5, 'launches': 3}
    >>> marked = text.replace('"0","a"', '"0","ncu_marker_begin"').replace('"2","a"',
    ...                                                                     '"2","ncu_marker_end"')
    >>> summarize(marked, calls=1)["kernels"]
    {'b': 3.0}
  """
  lines = csv_text.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
  scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
  recs = [r for r in csv.DictReader(io.StringIO("\n".join(lines[start:])))
          if r.get("Metric Name") == "gpu__time_duration.sum"]
  names = [r["Kernel Name"] for r in recs]
  begins = [i for i, n in enumerate(names) if "ncu_marker_begin" in n]
  ends = [i for i, n in enumerate(names) if "ncu_marker_end" in n]
  if begins and ends:   # only the launches between the last begin and the end marker
    recs = recs[begins[-1] + 1:ends[-1]]
  per = {}
  launches = 0
  for rec in recs:
    us = float(rec["Metric Value"].replace(",", "")) * scale[rec["Metric Unit"]]
    per[rec["Kernel Name"]] = per.get(rec["Kernel Name"], 0.0) + us / calls
    launches += 1
  return dict(kernels=per, total_us=sum(per.values()), launches=launches)


def main(argv=None):
  """Run a row under the profiler range, or summarize ncu's CSV.

  Args:
    argv: command-line arguments (default sys.argv).

  Returns:
    The row's (rel_err, opened) or the summary dict.
  """
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--row", choices=ROWS)
  ap.add_argument("--calls", type=int, default=8)
  ap.add_argument("--seq", type=int, default=131072)
  ap.add_argument("--tiny", action="store_true")
  ap.add_argument("--digit-bits", type=int, default=1, choices=(1, 2, 4))
  ap.add_argument("--fused-select", action="store_true")
  ap.add_argument("--summarize", metavar="CSV", help="ncu --csv output to summarize")
  a = ap.parse_args(argv)
  if a.summarize:
    with open(a.summarize) as f:
      res = summarize(f.read(), a.calls)
    for name, us in sorted(res["kernels"].items(), key=lambda x: -x[1]):
      print(f"  {us:9.2f} us/call  {name[:110]}")
    print(f"  total {res['total_us']:.2f} us per call over {res['launches']} launches")
    return res
  if a.row is None:
    ap.error("--row or --summarize is required")
  err, opened = run_row(a.row, calls=a.calls, seq=a.seq, tiny=a.tiny, digit_bits=a.digit_bits,
                        fused_select=a.fused_select)
  print(f"row {a.row}: rel err vs fp32 {err:.3g} ({'ok' if err < 5e-3 else 'FAILED'}); "
        f"profiler range {'opened' if opened else 'not available'}", flush=True)
  return err, opened


if __name__ == "__main__":
  main()
