"""Where the time of block-sparse decode goes: dense vs sparse decode and each sparse stage.

One process, random non-zero bf16 inputs, every timed output checked against a reference.
Default case = the issue-5 bench case "B1 S128K GQA32:8 D128 top19% blk64" (top_k 387 of 2048
blocks, + the initial and the local block). Rows (``--list`` prints them; ``--rows`` picks some):

* ``dense``: ``jattn.decode.decode_attention(implementation="triton")`` (the bench baseline).
* ``sparse``: ``sparse_decode_attention(implementation="triton")``, selection included (the
  bench's timed call): three kernels (scores, select, attend with the merge folded in: the
  last split to arrive merges). ``dense`` and ``sparse`` always run: the ratios and the
  equality checks of the other rows need them.
* ``sparse_4k``: the previous four-kernel path, built from the same public kernels (scores,
  select, ``sparse_decode_partials``, ``merge_decode_partials``) at the same split count: the
  old-vs-new comparison of the in-kernel merge (``summary.merged_vs_4k_*``).
* stages of it, each alone on precomputed inputs: ``scores`` (decode_block_scores),
  ``select`` (select_decode_slots), ``attend`` (sparse_decode_partials with counts; also at
  several split counts), ``merge`` (merge_decode_partials).
* selection variants on the same scores: ``select_w{1,2,8}`` (num_warps), ``select_r2``,
  ``select_r4`` (radix threshold search, ``digit_bits`` 2 / 4: 16 / 8 dependent reductions
  instead of 32), ``select_r4_w{1,8}``, ``select_r2_w1``, ``select_r4_1chunk`` (one compare
  tile over all blocks instead of the register-bounded chunks); each checked equal to the
  default selection on all three score sets (``checks.select_*_equal_default``), and
  ``sparse_r2`` / ``sparse_r4``: the whole 3-kernel call with the digit_bits=2 / 4 selection
  (``checks.sparse_r*_equals_sparse``: output and indices bit-identical to ``sparse``).
* fused scores + selection (``score_select_decode_slots``, one launch instead of ``scores`` +
  ``select``): ``score_select_fused`` (default score splits: 32 programs per kv head on the
  H200, the last to arrive selects; a memset of the counters before it),
  ``score_select_fused_s1`` (one program per (batch, kv head): no counter, no memset, each
  program reads its kv head's 1 MiB of fp32 key sums alone), ``score_select_fused_s8``,
  ``score_select_fused_r4`` / ``score_select_fused_s1_r4`` (digit_bits=4); each checked equal
  to ``scores`` + ``select`` on all three input sets (``checks.score_select_fused*_equal``:
  indices, counts, zeroed counters). Whole calls: ``sparse_fused``
  (``sparse_decode_attention(fused_select=True)``, two launches + the memset),
  ``sparse_fused_s1`` (``score_splits=1``: two launches), ``sparse_fused_r2`` /
  ``sparse_fused_r4`` (digit_bits=2 / 4, from the kernels), each bit-identical to ``sparse``
  (``checks.sparse_fused*_equals_sparse``, output and indices).
* the previous path's XLA stages for comparison: ``xla_scores`` (einsum), ``xla_select``
  (lax.top_k + sort), ``xla_merge`` (jattn.merge.merge_partials), and ``sparse_prev`` (XLA
  selection + attend over the unsorted-free list + XLA merge, as before the kernels).
* ``sparse_mosaic`` (not with --tiny): ``sparse_decode_attention(implementation="mosaic_gpu")``:
  the same scores + select kernels, the Mosaic GPU attention over the kept blocks
  (``pallas_kernels.sparse.decode_mosaic_gpu``: TMA reads of the kept blocks, its default
  splits = one CTA per SM) and the merge kernel; checked vs the fp32 reference and ``sparse``
  (indices equal). In sweep mode it is re-timed with dense and sparse at the end.
* ``sparse_xla``: the pure XLA implementation; ``host_floor``: one trivial XLA kernel with the
  whole call's arguments (the per-call floor of the host-timed method).
* attention-kernel sweep (only with ``--sweep-attend`` / ``--attend-configs`` / ``--attend-best``;
  then the default rows are dense, sparse, every ``sw_*`` row and ``sparse_best``): ``sw_<cfg>``
  times the attention over the kept blocks alone, on the fixed block lists of the ``select``
  kernel (three input sets), for one launch configuration ``<cfg>`` =
  ``s<splits>_w<num_warps>_st<num_stages>_b<blocks_per_step>[_la0][_nm|_xm|_mk]`` (fields in any
  order, missing ones at the kernel's defaults: the default splits, w4, st3, b1, block ids one
  step ahead, merge in the kernel; ``_la0``: ids loaded in the step; ``_nm``: partials only, no
  merge; ``_xm``: partials + XLA merge; ``_mk``: partials + merge kernel). In-kernel-merge rows
  with splits > 1 also run XLA's memset of the [1, kv_heads] arrival counters (~1-2 us, which
  the whole call does not pay: the select kernel writes them). Each config compiles two
  programs, ``--sweep-unroll`` (32) calls and a quarter of that, and is timed by their slope
  (``device_ms``) and the long one / calls (``unroll_ms``); no host timing (a single kernel call
  host-timed is the dispatch floor). After the last sweep row every config's two programs are
  timed again in ``--sweep-rounds`` (3) interleaved rounds (no compiles): ``device_ms`` /
  ``unroll_ms`` use the best times over all rounds, ``round_device_ms`` the slope of each round
  (the spread is the noise; run 12 saw 33 vs 60 us for 33 vs 32 splits); dense, sparse and
  sparse_best get the same re-timing rounds together at the end. A sweep row's check runs on
  the long program's first output (no extra compile): rel err vs the fp32 reference
  (``*_sweep_rel_err`` < 5e-3), max abs vs the ``sparse`` output, and for the default config
  bit-identity with it (``*_equals_sparse``). ``sparse_best``: the whole call (scores +
  select + the attention with the fastest passing sweep config by ``device_ms``, or
  ``--attend-best``), timed like every other row (``summary.speedup_best_*``;
  ``summary.attend_sweep``: the configs by device time).
* ``--sweep-mosaic``: sweep rows ``sw_mg_s<splits>_st<stages>_<nm|mk|xm>`` of the Mosaic GPU
  attention (``MOSAIC_GRID``: alone, + merge kernel, + XLA merge, stages, splits) and two
  Triton controls, then ``sparse_mosaic`` and ``sparse_best`` (which may be a Mosaic config).

Three timings per row (``--timings`` picks some): ``host_ms`` is the bench's method (median of
host-timed loops of async calls, rotating 3 input sets: includes dispatch when dispatch is
slower than the GPU); ``unroll_ms`` = (host time of one jitted program running the op on
``--unroll`` (16) different queries, back to back) / unroll, as in a model's decode step;
``device_ms`` = the slope (T(unroll) - T(unroll/2)) / (unroll/2) of such programs: the GPU time
per call without the per-program dispatch (best of ``--prog-repeats`` runs of each program).

Checks (fp32 references on input set 0): each row's check runs the row's own jitted function
(the one that is timed: no extra compile) and is printed next to the row and stored in its
JSON entry (``rows[i].checks``) and in ``checks``; ``sparse`` is also run ``--repeat`` times
on the same inputs and must give bit-identical outputs (a split that merged before all
partials were visible would show up as a mismatch). ``ok`` = every check of the chosen rows
passed and no chosen row failed.

Where the time goes (GPU): every row compiles three XLA programs (one call for the check and
``host_ms``, --unroll calls, --unroll/2 calls); with jax >= 0.11 each program's lowering runs
Triton's compiler on every Pallas kernel in it, so an unchanged kernel was compiled again for
every program of every row. This script memoises that compile by the kernel's IR
(``meta.triton_compile``: calls, cache hits, seconds; ``--no-triton-cache`` turns it off).
Each row prints its wall time split into check (incl. the first compile), host, x16 and x8
(compile + runs of the two programs); the JSON is rewritten after every row (``complete``:
false until the end), so a timeout keeps the finished rows.

Usage (GPU):  python experiments/probe_sparse_decode.py --out $OUT/probe.json
              [--rows 'select_r*,sparse_fused*'] [--timings unroll,device] [--repeat 0]
       sweep: python experiments/probe_sparse_decode.py --sweep-attend --repeat 10
              --out $OUT/sweep.json [--attend-configs s17_w8,s33_b2_st2,...]
      Mosaic: python experiments/probe_sparse_decode.py --sweep-mosaic --repeat 10
              --out $OUT/probe_mosaic.json
CPU smoke test: python experiments/probe_sparse_decode.py --tiny --rows select_r2 --out /tmp/p.json
  (--tiny: 2K tokens, GQA 4:2, D64, 16-token blocks, 3 splits, kernels interpreted; every row
  interpreted takes ~8 min on 2 CPU cores)
  sweep dry run: python experiments/probe_sparse_decode.py --tiny --sweep-attend --out /tmp/s.json
"""
from __future__ import annotations

import argparse
import fnmatch
import functools
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments.bench_kernels import _sync, time_fn  # noqa: E402
from jattn import sparse as sp  # noqa: E402
from jattn.merge import merge_partials  # noqa: E402
from pallas_kernels.flash.reference import attention_reference  # noqa: E402
from pallas_kernels.sparse.decode import (default_num_splits, merge_decode_partials,  # noqa: E402
                                          sparse_decode, sparse_decode_partials)
from pallas_kernels.sparse.decode_select import (decode_block_scores,  # noqa: E402
                                                 default_score_splits,
                                                 score_select_decode_slots,
                                                 select_decode_slots)


# (name suffix, score_splits or None = default, digit_bits) of the fused score + selection rows
FUSED_VARIANTS = (("", None, 1), ("_s1", 1, 1), ("_s8", 8, 1), ("_r4", None, 4),
                  ("_s1_r4", 1, 4))
# (digit_bits, num_warps or None = default, search_chunk or None = default) of the radix rows
RADIX_VARIANTS = ((2, None, None), (4, None, None), (4, 1, None), (4, 8, None), (2, 1, None),
                  (4, None, 1 << 30))
ALWAYS_ROWS = ("dense", "sparse")          # the ratios' and the equality checks' baselines
TIMINGS = ("host", "unroll", "device")
FINAL_RETIME = ("dense", "sparse", "sparse_r2", "sparse_mosaic",
                "sparse_best")              # sweep mode: re-timed together
# The attention kernel's launch sweep (``--sweep-attend``), 16 configs; see the docstring for
# the names. {d} = the default splits (33 on the H200 at B1 with 8 kv heads: 264 programs, two
# per SM), {p} = the largest power of two <= d (32: the in-kernel merge's [splits, d] tile is
# padded to a power of two, 64 rows at 33 splits), {h} = d // 2 (16: 128 programs, one wave at
# one program per SM), {t} = 2 d. Around the default (4 warps, 3 stages, one 64-token block per
# step, in-kernel merge): the merge (none / XLA / merge kernel), split counts, warps, stages,
# block ids loaded in the step, 128 keys per step (two blocks: 64 KB of K+V per stage, so one
# program per SM: with {h} splits), and {h} splits with the XLA merge.
ATTEND_GRID = ("s{d}_w4_st3_b1", "s{d}_w4_st3_b1_nm", "s{d}_w4_st3_b1_xm", "s{d}_w4_st3_b1_mk",
               "s{p}_w4_st3_b1", "s{h}_w4_st3_b1", "s{t}_w4_st3_b1", "s{d}_w8_st3_b1",
               "s{d}_w2_st3_b1", "s{d}_w4_st2_b1", "s{d}_w4_st4_b1", "s{d}_w4_st3_b1_la0",
               "s{h}_w4_st3_b2", "s{h}_w4_st2_b2", "s{h}_w8_st3_b2", "s{h}_w4_st3_b1_xm")
# --sweep-mosaic: the Mosaic GPU attention (pallas_kernels.sparse.decode_mosaic_gpu) around its
# default ({m} splits = one CTA per SM, 4 stages): attention alone (_nm), with the merge kernel
# (the whole call's) or the XLA merge, stages 2 / 3, two waves ({d} splits), half the SMs (8
# splits); then the Triton default, alone and with the merge kernel, as same-run controls.
MOSAIC_GRID = ("mg_s{m}_st4_nm", "mg_s{m}_st4_mk", "mg_s{m}_st4_xm", "mg_s{m}_st3_mk",
               "mg_s{m}_st2_mk", "mg_s{d}_st4_mk", "mg_s{d}_st2_mk", "mg_s8_st4_mk",
               "s{d}_w4_st3_b1_nm", "s{d}_w4_st3_b1")
MERGES = {"": "in-kernel merge (sparse_decode)",
          "nm": "no merge: partials only (sparse_decode_partials)",
          "xm": "partials + XLA merge (jattn.merge.merge_partials)",
          "mk": "partials + merge kernel (merge_decode_partials)"}
_CFG_FIELDS = {"st": "num_stages", "s": "splits", "w": "num_warps", "b": "blocks_per_step",
               "la": "index_lookahead"}


def parse_attend_config(spec, default_splits, mosaic_splits=None):
  """An attention sweep config name -> dict of the kernel's launch options and the merge.

  ``s<splits>_w<warps>_st<stages>_b<blocks per step>[_la0][_nm|_xm|_mk][_ct]``, fields in any
  order; ``ct`` (compact, a diagnostic): the kept blocks copied, outside the timing, into a
  contiguous cache in list order, read through ids 0..count-1 (the same bytes and the same
  arithmetic as the scattered read, so the output equals the config's; the difference in time
  is what the scattered placement costs: address translation, DRAM page locality);
  missing fields take the defaults (``default_splits``, 4 warps, 3 stages, 1 block per step,
  block ids one step ahead, merge in the kernel). With the field ``mg``: the Mosaic GPU kernel
  (``kernel`` = "mosaic_gpu"), fields s and st only (defaults ``mosaic_splits``, 4 stages) and
  a merge of nm / xm / mk (default mk: it has no in-kernel merge).

  >>> parse_attend_config("s17_b2_xm", 33)["splits"], attend_config_name(
  ...     parse_attend_config("b2_xm_s17", 33))
  (17, 's17_w4_st3_b2_xm')
  >>> attend_config_name(parse_attend_config("mg_st2", 33, 16))
  'mg_s16_st2_mk'
  >>> attend_config_name(parse_attend_config("st2_b2_ct", 33))
  's33_w4_st2_b2_ct'
  """
  cfg = dict(splits=int(default_splits), num_warps=4, num_stages=3, blocks_per_step=1,
             index_lookahead=True, merge="", compact=False)
  toks = [t for t in str(spec).strip().split("_") if t]
  if "ct" in toks:
    toks.remove("ct")
    cfg["compact"] = True
  if "mg" in toks:
    toks.remove("mg")
    cfg.update(kernel="mosaic_gpu", num_stages=4,
               splits=int(mosaic_splits or default_splits))
    bad = [t for t in toks if t not in MERGES and not re.fullmatch(r"(st|s)\d+", t)]
    if bad:
      raise ValueError(f"attend config {spec!r}: the Mosaic GPU kernel (mg) takes s<n>, st<n> "
                       f"and nm / xm / mk only, got {bad}")
  for tok in toks:
    m = re.fullmatch(r"(st|la|s|w|b)(\d+)", tok)
    if tok in MERGES:
      cfg["merge"] = tok
    elif m:
      key, val = _CFG_FIELDS[m.group(1)], int(m.group(2))
      if key == "index_lookahead":
        if val not in (0, 1):
          raise ValueError(f"attend config {spec!r}: la must be 0 or 1")
        val = bool(val)
      cfg[key] = val
    else:
      raise ValueError(f"attend config {spec!r}: unknown field {tok!r} (expected s<n>, w<n>, "
                       f"st<n>, b<n>, la0/la1, nm, xm or mk)")
  pow2 = lambda x: x >= 1 and not x & (x - 1)
  if cfg["splits"] < 1 or cfg["num_stages"] < 1 or not pow2(cfg["num_warps"]) or not pow2(
      cfg["blocks_per_step"]):
    raise ValueError(f"attend config {spec!r}: splits and stages >= 1, warps and blocks per "
                     f"step powers of two")
  if cfg.get("kernel") == "mosaic_gpu":
    cfg["merge"] = cfg["merge"] or "mk"
    if cfg["num_stages"] < 2:
      raise ValueError(f"attend config {spec!r}: the Mosaic GPU ring needs st >= 2")
  return cfg


def attend_config_name(cfg):
  """The canonical name of a parsed config (every field, defaults included)."""
  ct = "_ct" if cfg.get("compact") else ""
  if cfg.get("kernel") == "mosaic_gpu":
    return f"mg_s{cfg['splits']}_st{cfg['num_stages']}_{cfg['merge']}" + ct
  return (f"s{cfg['splits']}_w{cfg['num_warps']}_st{cfg['num_stages']}_"
          f"b{cfg['blocks_per_step']}" + ("" if cfg["index_lookahead"] else "_la0") +
          (f"_{cfg['merge']}" if cfg["merge"] else "") + ct)


def compact_kept_blocks(k, indices, counts, block_size):
  """The kept blocks of a contiguous cache copied into a contiguous one, in list order.

  Args:
    k: [batch, len, kv_heads, d] cache (len a multiple of block_size).
    indices: int32 [batch, kv_heads, width] block ids (-1 padded) in the order the kernel reads.
    counts: int32 [batch, kv_heads] listed ids per row (the entries past it are -1).
    block_size: tokens per block.

  Returns:
    (k_c [batch, width * block_size, kv_heads, d], ids [batch, kv_heads, width]): list entry j
    of (b, h) is block j of k_c's head h, ids j (j < count) or -1; padded entries are zeros.

  >>> import numpy as np
  >>> k = jnp.arange(2 * 8 * 2 * 1, dtype=jnp.float32).reshape(2, 8, 2, 1)   # 4 blocks of 2
  >>> kc, ids = compact_kept_blocks(k, jnp.array([[[3, 1], [0, -1]]] * 2), jnp.array([[2, 1]] * 2), 2)
  >>> np.asarray(kc[0, :, 0, 0]).tolist(), np.asarray(kc[0, :, 1, 0]).tolist()
  ([12.0, 14.0, 4.0, 6.0], [1.0, 3.0, 0.0, 0.0])
  >>> np.asarray(ids[0]).tolist()
  [[0, 1], [0, -1]]
  """
  b, n, h, d = k.shape
  w = indices.shape[-1]
  blocks = k.reshape(b, n // block_size, block_size, h, d)
  safe = jnp.where(indices >= 0, indices, 0)
  g = blocks[jnp.arange(b)[:, None, None], safe, :, jnp.arange(h)[None, :, None], :]
  g = jnp.where((indices >= 0)[..., None, None], g, 0)                # [b, h, w, bs, d]
  k_c = g.transpose(0, 2, 3, 1, 4).reshape(b, w * block_size, h, d)
  j = jnp.arange(w, dtype=jnp.int32)
  ids = jnp.where(j < counts[..., None], j, -1).astype(jnp.int32)
  return k_c, ids


def _pow2(n):
  return max(16, 1 << (int(n) - 1).bit_length())


def row_names(split_list, sweep=(), mosaic=True):
  """Every row of the probe, in the order it runs (``split_list``: the attend rows' splits;
  ``sweep``: canonical attention sweep config names, whose rows and ``sparse_best`` come last;
  ``mosaic``: the ``sparse_mosaic`` row, not with --tiny: the kernel has no interpreter).
  """
  names = ["dense", "sparse", "sparse_4k", "sparse_xla_merge"]
  names += ["sparse_mosaic"] if mosaic else []
  names += ["scores", "select"]
  names += [f"select_w{w}" for w in (1, 2, 8)]
  names += [f"select_r{b}" + (f"_w{w}" if w else "") + ("_1chunk" if ch else "")
            for b, w, ch in RADIX_VARIANTS]
  names += ["sparse_r4", "sparse_r2"]
  names += [f"score_select_fused{s}" for s, _, _ in FUSED_VARIANTS]
  names += ["sparse_fused", "sparse_fused_s1", "sparse_fused_r4", "sparse_fused_r2",
            "host_floor"]
  names += [f"attend_s{ns}" for ns in split_list]
  names += ["attend_merged", "merge", "xla_scores", "xla_select", "xla_merge", "sparse_prev",
            "sparse_xla"]
  if sweep:
    names += [f"sw_{c}" for c in sweep] + ["sparse_best"]
  return names


def select_rows(names, spec, always=ALWAYS_ROWS):
  """The rows of ``names`` (in their order) that ``spec`` picks, plus ``always``.

  spec: None / "" (all rows) or comma-separated exact names or fnmatch patterns; a pattern
  with a leading "-" removes the rows it matches (e.g. "*,-attend_s*"). A pattern that matches
  no row is an error (a typo would otherwise silently skip rows).

  >>> select_rows(["dense", "sparse", "select", "select_r2", "sparse_r2"], "select_r*")
  ['dense', 'sparse', 'select_r2']
  """
  pats = [p.strip() for p in (spec or "").split(",") if p.strip()]
  inc = [p for p in pats if not p.startswith("-")]
  exc = [p[1:] for p in pats if p.startswith("-")]
  bad = [p for p in inc + exc if not any(fnmatch.fnmatchcase(n, p) for n in names)]
  if bad:
    raise ValueError(f"--rows patterns {bad} match no row; rows: {', '.join(names)}")
  keep = [n for n in names
          if n in always or ((not inc or any(fnmatch.fnmatchcase(n, p) for p in inc))
                             and not any(fnmatch.fnmatchcase(n, p) for p in exc))]
  return keep


def check_passes(key, value):
  """True / False for a check entry, None for an informational one."""
  if key.endswith("_error"):
    return False
  if isinstance(value, bool):
    return value
  if key == "scores_rel_err_vs_xla":
    return value < 1e-5
  if key.endswith("_sweep_rel_err"):      # sweep rows vs the fp32 reference (sparse: 1.9e-3)
    return value < 5e-3
  if key.endswith("_rel_err"):
    return value < 2e-2
  if key.endswith("_mismatches"):
    return value == 0
  return None


def cache_triton_compile():
  """Memoise the Triton compile that Pallas runs while lowering each pallas_call (jax >= 0.11):
  the same kernel IR in another program (every row compiles three) is compiled once. Returns
  the stats dict (calls, hits, compile_s) or None when this jax has no such call."""
  try:
    from jax._src.pallas.triton import pallas_call_registration as reg
  except Exception:  # noqa: BLE001
    return None
  triton = getattr(reg, "triton", None)
  if triton is None or not callable(getattr(triton, "compile", None)):
    return None
  stats = dict(calls=0, hits=0, compile_s=0.0)
  cache = {}

  class _Cached:
    def __getattr__(self, name):
      return getattr(triton, name)

    def compile(self, *a, **kw):  # noqa: A003
      stats["calls"] += 1
      try:
        key = (a, tuple(sorted(kw.items())))
        hash(key)
      except TypeError:
        key = None
      if key is not None and key in cache:
        stats["hits"] += 1
        return cache[key]
      t0 = time.perf_counter()
      res = triton.compile(*a, **kw)
      stats["compile_s"] += time.perf_counter() - t0
      if key is not None:
        cache[key] = res
      return res

  reg.triton = _Cached()
  return stats


def host_ms(fn, arg_sets, *, min_time, repeats=3):
  """The bench's timing (``bench_kernels.time_fn``): median ms per call of host-timed loops."""
  return time_fn(fn, arg_sets, min_time=min_time, repeats=repeats)[0]


def best_ms(many, qs, rest, repeats):
  """Best host ms of ``repeats`` runs of the (compiled) program ``many(qs, rest)``."""
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    _sync(many(qs, rest))
    times.append((time.perf_counter() - t0) * 1e3)
  return float(np.min(times))


def program_ms(fn, qs, rest, *, repeats, return_outputs=False):
  """Best host ms (of ``repeats``, after a compiling run) of one jitted program that calls
  fn(q_i, *rest[i % len(rest)]) for every q_i in ``qs`` back to back (one dispatch). With
  ``return_outputs``: (ms, the compiling run's list of outputs, the program)."""
  many = jax.jit(lambda qs, rest: [fn(q, *rest[i % len(rest)]) for i, q in enumerate(qs)])
  outs = _sync(many(qs, rest))
  ms = best_ms(many, qs, rest, repeats)
  return (ms, outs, many) if return_outputs else ms


def rel_err(x, ref):
  x = jnp.asarray(x, jnp.float32)
  ref = jnp.asarray(ref, jnp.float32)
  return float(jnp.linalg.norm((x - ref).ravel()) / (jnp.linalg.norm(ref.ravel()) + 1e-30))


def _equal(xs, ys):
  xs, ys = jax.tree_util.tree_leaves(xs), jax.tree_util.tree_leaves(ys)
  return len(xs) == len(ys) and all(bool(jnp.array_equal(x, y)) for x, y in zip(xs, ys))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", help="JSON output path (rewritten after every row)")
  ap.add_argument("--tiny", action="store_true", help="small CPU case, kernels interpreted")
  ap.add_argument("--rows", default=None,
                  help="comma-separated row names or fnmatch patterns (e.g. "
                       "'select_r*,sparse_fused*'; '-pat' removes rows); dense and sparse "
                       "always run. Default: every row (see --list)")
  ap.add_argument("--list", action="store_true", help="print the row names and exit")
  ap.add_argument("--timings", default=",".join(TIMINGS),
                  help="comma-separated subset of host,unroll,device (device also gives "
                       "unroll: both use the --unroll-call program)")
  ap.add_argument("--unroll", type=int, default=None,
                  help="calls per program for device_ms (also n/2; the slope is reported)")
  ap.add_argument("--prog-repeats", type=int, default=10,
                  help="runs of each unrolled program (best is kept); they cost ~1 ms each")
  ap.add_argument("--min-time", type=float, default=None,
                  help="seconds per host-timed loop (3 loops per row; default 0.2, tiny 0.01)")
  ap.add_argument("--splits", default=None, help="comma-separated split counts for 'attend'")
  ap.add_argument("--repeat", type=int, default=None,
                  help="runs of the sparse call on the same inputs for the identity check "
                       "(default 50, tiny 3; 0 skips it)")
  ap.add_argument("--no-triton-cache", action="store_true",
                  help="do not memoise Triton compiles across programs (see the docstring)")
  ap.add_argument("--sweep-attend", action="store_true",
                  help="add the attention-kernel sweep rows (sw_<config>; the default grid "
                       "ATTEND_GRID, 16 configs around the default splits) and sparse_best; "
                       "without --rows only dense, sparse, the sweep rows and sparse_best run")
  ap.add_argument("--attend-configs", default=None,
                  help="comma-separated sweep configs instead of the default grid (implies "
                       "--sweep-attend), e.g. 's17_w8,s33_st4_b2,s33_xm'")
  ap.add_argument("--block-size", type=int, default=None,
                  help="tokens per block (default 64, tiny 16; the Mosaic GPU rows need a "
                       "multiple of 64)")
  ap.add_argument("--sweep-mosaic", action="store_true",
                  help="sweep the Mosaic GPU attention (MOSAIC_GRID: mg_* rows + two Triton "
                       "controls; with --sweep-attend after ATTEND_GRID); without --rows: dense, "
                       "sparse, sparse_mosaic, the sweep rows and sparse_best")
  ap.add_argument("--attend-best", default=None,
                  help="sparse_best's attention config (implies --sweep-attend); default: the "
                       "sweep row with the lowest device_ms whose checks passed")
  ap.add_argument("--best-digit-bits", type=int, default=1, choices=(1, 2, 4),
                  help="sparse_best's selection: 1 = the bit search (the default path), 2 / 4 "
                       "= the radix search (the same indices)")
  ap.add_argument("--sweep-unroll", type=int, default=None,
                  help="calls in the sweep rows' long program (default 32, tiny 4); the short "
                       "one has a quarter, device_ms is the slope")
  ap.add_argument("--hnd", action="store_true",
                  help="the head-major cache (kv_layout='hnd') as jattn runs it: batch x kv_heads "
                       "sequences of one kv head (B8 Hk1 GQA 4:1 at the default shape), so every "
                       "row reads contiguous 64-token blocks")
  ap.add_argument("--sweep-rounds", type=int, default=3,
                  help="extra timing rounds of every sweep row's compiled programs after the "
                       "last one, interleaved (no compiles; ~0.1 s per config and round); "
                       "likewise dense, sparse and sparse_best at the end")
  args = ap.parse_args(argv)
  t_start = time.perf_counter()
  timings = {t.strip() for t in args.timings.split(",") if t.strip()}
  if not timings <= set(TIMINGS):
    ap.error(f"--timings: unknown {sorted(timings - set(TIMINGS))}")
  if args.tiny:
    n, hq, hk, d, bs, interpret, min_time, unroll = 2048, 4, 2, 64, 16, True, 0.01, 4
  else:
    n, hq, hk, d, bs, interpret, min_time, unroll = 131072, 32, 8, 128, 64, False, 0.2, 16
  nbatch = 1
  if args.hnd:   # the head-major cache as jattn runs it: batch x kv_heads sequences of one head
    nbatch, hq, hk = hk, hq // hk, 1
  bs = args.block_size or bs
  min_time = args.min_time if args.min_time is not None else min_time
  unroll = args.unroll or unroll
  repeat = args.repeat if args.repeat is not None else (3 if args.tiny else 50)
  nb = n // bs
  fraction = 0.19
  top_k = max(0, int(round(fraction * nb)) - 2)           # as jattn.sparse.bench_cases
  dtype = jnp.bfloat16
  width = sp.decode._decode_width(nb, top_k, 1, 1)
  sel_kw = dict(top_k=top_k, num_init_blocks=1, num_local_blocks=1)
  splits = 3 if args.tiny else default_num_splits(nbatch, hk, width)   # tiny: exercise the merge
  split_list = ([int(x) for x in args.splits.split(",")] if args.splits else
                sorted({splits, 16, 32, 66}) if not args.tiny else [splits, 2])
  from pallas_kernels.sparse import decode_mosaic_gpu as smg
  mg_splits = 3 if args.tiny else smg.default_num_splits(nbatch, hk, width)
  sweep_mode = bool(args.sweep_attend or args.attend_configs or args.attend_best
                    or args.sweep_mosaic)
  sweep_cfgs = {}                          # canonical name -> parsed config, in grid order
  try:
    grid = (ATTEND_GRID if args.sweep_attend or not args.sweep_mosaic else ()) + (
        MOSAIC_GRID if args.sweep_mosaic else ())
    grid = [g.format(d=splits, p=1 << (splits.bit_length() - 1), h=max(1, splits // 2),
                     t=2 * splits, m=mg_splits) for g in grid]
    for spec in ((args.attend_configs.split(",") if args.attend_configs else grid)
                 if sweep_mode else ()):
      if spec.strip():
        cfg = parse_attend_config(spec, splits, mg_splits)
        sweep_cfgs.setdefault(attend_config_name(cfg), cfg)
    if args.attend_best:
      parse_attend_config(args.attend_best, splits, mg_splits)
  except ValueError as e:
    ap.error(str(e))
  sweep_unroll = args.sweep_unroll or (4 if args.tiny else 32)
  names = row_names(split_list, tuple(sweep_cfgs), mosaic=not args.tiny)
  if args.list:
    print("\n".join(names))
    return 0
  if not args.out:
    ap.error("--out is required")
  try:
    rows_spec = args.rows
    if rows_spec is None and sweep_mode:
      rows_spec = "sw_*,sparse_best" if sweep_cfgs else "sparse_best"
      if args.sweep_mosaic and not args.tiny:
        rows_spec += ",sparse_mosaic"
    chosen = select_rows(names, rows_spec)
  except ValueError as e:
    ap.error(str(e))
  triton_stats = None if args.no_triton_cache else cache_triton_compile()
  case = (f"B{nbatch} S{n // 1024}K GQA{hq}:{hk} D{d} top{fraction:.0%} blk{bs}"
          + (" (head-major cache: B1 Hk%d as %d sequences)" % (nbatch, nbatch) if args.hnd else ""))
  print(f"{case}: top_k={top_k} width={width} backend={jax.default_backend()} "
        f"device={jax.devices()[0].device_kind} jax={jax.__version__}", flush=True)
  print(f"rows ({len(chosen)} of {len(names)}): {', '.join(chosen)}; timings "
        f"{','.join(t for t in TIMINGS if t in timings)}; unroll {unroll}; repeat {repeat}; "
        f"triton compile cache {'on' if triton_stats is not None else 'off/unavailable'}",
        flush=True)

  # ---- inputs
  t0 = time.perf_counter()
  lens = jnp.full((nbatch,), n, jnp.int32)
  keys = jax.random.split(jax.random.key(7), 9)
  sets = []
  for i in range(3):
    kc = jax.random.normal(keys[3 * i + 1], (nbatch, n, hk, d), dtype)
    vc = jax.random.normal(keys[3 * i + 2], (nbatch, n, hk, d), dtype)
    sets.append((kc, vc, sp.init_block_summaries(kc, lens, block_size=bs)))
  qs = [jax.random.normal(jax.random.key(100 + i), (nbatch, hq, d), dtype)
        for i in range(unroll)]
  # the sweep rows' queries: qs, then more (distinct (query, set) pairs: nothing for XLA to CSE)
  qs_sw = qs[:sweep_unroll] + [
      jax.random.normal(jax.random.key(100 + i), (nbatch, hq, d), dtype)
      for i in range(len(qs), sweep_unroll)]
  q = qs[0]
  kc, vc, summ = sets[0]
  _sync((sets, qs, qs_sw))
  setup_s = {"inputs": time.perf_counter() - t0}

  rows, checks = [], {}
  res = dict(case=case, top_k=top_k, width=width, default_splits=splits, ok=None,
             complete=False, rows_chosen=chosen, checks=checks, summary={}, rows=rows,
             meta=dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                       backend=jax.default_backend(), unroll=unroll, tiny=args.tiny,
                       timings=sorted(timings), prog_repeats=args.prog_repeats,
                       min_time=min_time, repeat=repeat, argv=list(argv or sys.argv[1:]),
                       setup_s=setup_s, triton_compile=triton_stats,
                       attend_sweep=dict(configs=list(sweep_cfgs), unroll=sweep_unroll,
                                         best_override=args.attend_best) if sweep_mode
                       else None))

  # ---- shared data, computed on first use (only the chosen rows pay for it)
  memo = {}

  def lazy(f):
    @functools.wraps(f)
    def get():
      if f.__name__ not in memo:
        memo[f.__name__] = _sync(f())
      return memo[f.__name__]
    return get

  up = lambda x: x.astype(jnp.float32)

  @lazy
  def ref_sparse():
    """fp32 attention restricted to the XLA selection (select_decode_blocks) on set 0."""
    idx = idx_xla()                                            # [nbatch, hk, width]
    sel = jnp.zeros((nbatch, hk, nb + 1), bool).at[
        jnp.arange(nbatch)[:, None, None], jnp.arange(hk)[None, :, None],
        jnp.where(idx < 0, nb, idx)].set(True)
    mask = jnp.repeat(sel[..., :nb], bs, axis=-1)[:, :, None, :]
    return jax.jit(lambda q, k, v, m: attention_reference(up(q)[:, None], up(k), up(v),
                                                          block_mask=m))(q, kc, vc, mask)[0][:, 0]

  @lazy
  def ref_dense():
    return jax.jit(lambda q, k, v: attention_reference(up(q)[:, None], up(k), up(v)))(
        q, kc, vc)[0][:, 0]

  @lazy
  def idx_xla():
    return jax.jit(functools.partial(sp.select_decode_blocks, **sel_kw))(q, summ, lens)

  sc_fn = functools.partial(decode_block_scores, block_size=bs, interpret=interpret)
  sel_fn = functools.partial(select_decode_slots, block_size=bs, max_selected=width,
                             interpret=interpret, **sel_kw)

  @lazy
  def score_sets():
    """Block scores of the three sets, all with q = qs[0] (the select rows ignore q)."""
    return [(sc_fn(q, s.sums, s.lengths),) for _, _, s in sets]

  @lazy
  def lists():
    return [sel_fn(s, lens) for (s,) in score_sets()]

  @lazy
  def lists3():
    """(indices, counts, zeroed counters): also the fused rows' reference."""
    return [sel_fn(s, lens, return_arrivals=True) for (s,) in score_sets()]

  @lazy
  def parts():
    att = functools.partial(sparse_decode_partials, block_size=bs, num_splits=splits,
                            interpret=interpret)
    return [att(qs[i % unroll], k, v, lens, il, None, c)
            for i, ((k, v, _), (il, c)) in enumerate(zip(sets, lists()))]

  sparse = jax.jit(functools.partial(sp.sparse_decode_attention, kv_lengths=lens, block_size=bs,
                                     implementation="triton", interpret=interpret,
                                     return_indices=True, num_splits=splits, **sel_kw))
  base = {}                                # the sparse row's (out, idx) on set 0

  def equals_sparse(out_idx):
    return _equal(out_idx, base["out_idx"])

  def write_json():
    if not args.out:
      return
    res["meta"]["wall_s"] = time.perf_counter() - t_start
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
      json.dump(res, f, indent=1)
    os.replace(tmp, args.out)

  # ---- rows: name -> (what, build); build() -> (fn, per_set, check) where fn(q, *per_set[i])
  # is timed on the three sets and check(fn) -> dict runs the jitted fn on set 0 / all sets.
  specs = {}

  def row(name, what):
    def deco(build):
      specs[name] = (what, build)
      return build
    return deco

  try:
    from jattn import decode as dec
    dense_fn = lambda q, k, v, s: dec.decode_attention(q, k, v, lens, implementation="triton",
                                                       interpret=interpret)
  except Exception as e:  # noqa: BLE001
    dense_fn = None
    checks["dense_error"] = f"{type(e).__name__}: {e}"[:400]

  @row("dense", "jattn.decode.decode_attention triton")
  def _():
    return dense_fn, sets, lambda f: {"dense_rel_err": rel_err(f(q, kc, vc, summ), ref_dense())}

  @row("sparse", f"whole sparse decode (3 kernels, in-kernel merge), splits={splits}; "
                 f"returns (out, indices)")
  def _():
    def check(f):
      out, idx = base["out_idx"] = f(q, kc, vc, summ)
      c = {"sparse_rel_err": rel_err(out, ref_sparse()),
           "sparse_indices_equal_xla": bool(jnp.array_equal(idx, idx_xla()))}
      mism = sum(int(not _equal(f(q, kc, vc, summ), (out, idx))) for _ in range(repeat))
      c["merged_repeat_runs"] = repeat
      c["merged_repeat_mismatches"] = mism
      cnt = np.asarray(jnp.sum(idx >= 0, axis=-1))
      c["kept_blocks_per_head"] = cnt.tolist()
      c["kept_fraction"] = float(cnt.mean() / nb)
      return c
    return lambda q, k, v, s: sparse(q, k, v, block_summaries=s), sets, check

  def four_kernels(q, k, v, s):
    """The previous path: scores, select, attention partials, merge kernel (4 launches)."""
    sc = decode_block_scores(q, s.sums, s.lengths, block_size=bs, interpret=interpret)
    i, c = select_decode_slots(sc, lens, block_size=bs, max_selected=width, interpret=interpret,
                               **sel_kw)
    o, l = sparse_decode_partials(q, k, v, lens, i, None, c, block_size=bs, num_splits=splits,
                                  interpret=interpret)
    return merge_decode_partials(o, l, out_dtype=dtype, interpret=interpret)[0]

  def attend_xla_merge(q, k, v, i, c=None, num_splits=splits):
    """sparse_decode_partials over the selected blocks, merged by XLA (jattn.merge)."""
    o, l = sparse_decode_partials(q, k, v, lens, i, None, c, block_size=bs,
                                  num_splits=num_splits, interpret=interpret)
    return merge_partials(o, l, axis=1)[0].astype(dtype)

  def sparse_check(key):
    """check(f) -> {key: rel err of f on set 0 vs the sparse reference}."""
    return lambda f: {key: rel_err(f(q, kc, vc, summ), ref_sparse())}

  @row("sparse_4k", f"previous whole sparse decode (4 kernels, merge kernel), splits={splits}")
  def _():
    def check(f):
      o4 = f(q, kc, vc, summ)
      out = base["out_idx"][0]
      return {"sparse_4k_rel_err": rel_err(o4, ref_sparse()),
              "merged_equals_4k": bool(jnp.array_equal(out, o4)),
              "merged_vs_4k_max_abs": float(jnp.max(jnp.abs(up(out) - up(o4))))}
    return four_kernels, sets, check

  @row("sparse_xla_merge", "scores + select + attend kernels, XLA merge")
  def _():
    def fn(q, k, v, s):
      i, c = sel_fn(sc_fn(q, s.sums, s.lengths), lens)
      return attend_xla_merge(q, k, v, i, c)
    return fn, sets, sparse_check("sparse_xla_merge_rel_err")

  if not args.tiny:
    @row("sparse_mosaic", f"whole sparse decode with the Mosaic GPU attention "
                          f"(implementation='mosaic_gpu': scores + select + TMA attention + "
                          f"merge kernel), splits={mg_splits}; returns (out, indices)")
    def _():
      mosaic = jax.jit(functools.partial(
          sp.sparse_decode_attention, kv_lengths=lens, block_size=bs,
          implementation="mosaic_gpu", return_indices=True, **sel_kw))

      def check(f):
        out, idx = f(q, kc, vc, summ)
        c = {"sparse_mosaic_rel_err": rel_err(out, ref_sparse())}
        c.update(vs_sparse("sparse_mosaic", out))
        if "out_idx" in base:
          c["sparse_mosaic_indices_equal_sparse"] = bool(jnp.array_equal(idx,
                                                                         base["out_idx"][1]))
        return c
      return lambda q, k, v, s: mosaic(q, k, v, block_summaries=s), sets, check

  @row("scores", "decode_block_scores kernel")
  def _():
    def check(f):
      return {"scores_rel_err_vs_xla": rel_err(f(q, summ), jax.jit(sp.decode._decode_scores)(q, summ))}
    return (lambda q, s: sc_fn(q, s.sums, s.lengths)), [(s,) for _, _, s in sets], check

  @row("select", "select_decode_slots kernel")
  def _():
    def check(f):
      xidx = jax.jit(functools.partial(sp.decode._decode_select_from_scores, block_size=bs, **sel_kw))(
          score_sets()[0][0], lens)
      return {"select_equal_xla_on_same_scores":
              bool(jnp.array_equal(f(q, score_sets()[0][0])[0], xidx))}
    return (lambda q, s: sel_fn(s, lens)), score_sets(), check

  def equal_default_check(name):
    """fn(q, scores_i) equals the default selection on all three score sets."""
    return lambda f: {f"{name}_equal_default": all(
        _equal(f(q, s), l) for (s,), l in zip(score_sets(), lists()))}

  # The selection is 32 dependent block-wide reductions (a bit search): with one warp they are
  # shuffles only, with more warps each one also crosses shared memory and a barrier.
  for w in (1, 2, 8):
    @row(f"select_w{w}", f"select_decode_slots kernel, num_warps={w} "
                         f"(default {max(4, min(16, _pow2(nb) // 512))})")
    def _(w=w):
      sel_w = functools.partial(sel_fn, num_warps=w)
      return (lambda q, s: sel_w(s, lens)), score_sets(), equal_default_check(f"select_w{w}")

  # Radix threshold search (digit_bits 2 / 4: 16 / 8 dependent reductions instead of 32, each
  # over a [2**bits, chunk] compare tile summed over the chunks of the block axis); the same
  # selection as the default, checked on all three score sets.
  nb_pad = _pow2(nb)
  for bits, w, ch in RADIX_VARIANTS:
    name = f"select_r{bits}" + (f"_w{w}" if w else "") + ("_1chunk" if ch else "")

    @row(name, f"select_decode_slots, digit_bits={bits}" + (f", num_warps={w}" if w else "") +
         (f", search_chunk={min(ch, nb_pad)}" if ch else ", default search_chunk"))
    def _(bits=bits, w=w, ch=ch, name=name):
      sel_r = functools.partial(sel_fn, digit_bits=bits, search_chunk=ch,
                                **({"num_warps": w} if w else {}))
      return (lambda q, s: sel_r(s, lens)), score_sets(), equal_default_check(name)

  # The whole call with the radix selection (the 3-kernel path of "sparse", built from the
  # public kernels): output and indices bit-identical to "sparse".
  for bits in (4, 2):
    @row(f"sparse_r{bits}", f"whole sparse decode as 'sparse' with the digit_bits={bits} "
                            f"selection, splits={splits}; returns (out, indices)")
    def _(bits=bits):
      def fn(q, k, v, s):
        sc = sc_fn(q, s.sums, s.lengths)
        i, c, a = sel_fn(sc, lens, return_arrivals=True, digit_bits=bits)
        return sparse_decode(q, k, v, lens, i, None, c, a, block_size=bs, num_splits=splits,
                             out_dtype=dtype, interpret=interpret)[0], i
      return fn, sets, lambda f: {f"sparse_r{bits}_equals_sparse":
                                  equals_sparse(f(q, kc, vc, summ))}

  # Scores + selection in one kernel (score_select_decode_slots): the same indices, counts
  # and zeroed counters as scores + select (checked on all three input sets, q = qs[0]).
  ss_default = default_score_splits(nbatch, hk, nb)
  n_tiles = -(-nb // min(64, _pow2(nb)))                  # 64-block score tiles per kv head

  def eff_splits(ss):
    """score_splits as the kernel runs it (every split at least one tile)."""
    ss = min(ss or ss_default, n_tiles)
    return -(-n_tiles // -(-n_tiles // ss))

  for suffix, ss, bits in FUSED_VARIANTS:
    name = f"score_select_fused{suffix}"

    @row(name, f"score_select_decode_slots (scores + select, 1 launch), score_splits="
               f"{eff_splits(ss)}{' (default)' if ss is None else ''}, digit_bits={bits}")
    def _(ss=ss, bits=bits, name=name):
      fz = functools.partial(score_select_decode_slots, block_size=bs, max_selected=width,
                             score_splits=ss, digit_bits=bits, return_arrivals=True,
                             interpret=interpret, **sel_kw)

      def check(f):
        return {f"{name}_equal": all(_equal(f(q, s), r)
                                     for (_, _, s), r in zip(sets, lists3()))}
      return (lambda q, s: fz(q, s.sums, s.lengths, lens)), [(s,) for _, _, s in sets], check

  whole = {"sparse_fused": (None, "whole sparse decode, fused_select=True (score_select + "
                                  "attend: 2 launches, + a counter memset if score_splits > 1)"),
           "sparse_fused_s1": (1, "whole sparse decode, fused_select=True (2 launches)")}
  for name, (ss, what) in whole.items():
    @row(name, f"{what}, score_splits={eff_splits(ss)}, splits={splits}; returns (out, indices)")
    def _(ss=ss, name=name):
      fused = jax.jit(functools.partial(
          sp.sparse_decode_attention, kv_lengths=lens, block_size=bs, implementation="triton",
          interpret=interpret, return_indices=True, num_splits=splits, fused_select=True,
          score_splits=ss, **sel_kw))
      return ((lambda q, k, v, s: fused(q, k, v, block_summaries=s)), sets,
              lambda f: {f"{name}_equals_sparse": equals_sparse(f(q, kc, vc, summ))})

  for bits in (4, 2):
    @row(f"sparse_fused_r{bits}", f"whole sparse decode as 'sparse_fused' with the digit_bits="
                                  f"{bits} selection, score_splits={eff_splits(None)}, "
                                  f"splits={splits}; returns (out, indices)")
    def _(bits=bits):
      def fn(q, k, v, s):
        i, c, a = score_select_decode_slots(q, s.sums, s.lengths, lens, block_size=bs,
                                            max_selected=width, digit_bits=bits,
                                            return_arrivals=True, interpret=interpret, **sel_kw)
        return sparse_decode(q, k, v, lens, i, None, c, a, block_size=bs, num_splits=splits,
                             out_dtype=dtype, interpret=interpret)[0], i
      return fn, sets, lambda f: {f"sparse_fused_r{bits}_equals_sparse":
                                  equals_sparse(f(q, kc, vc, summ))}

  # Per-call floor of the host-timed method: a jitted call that launches one trivial kernel
  # with the same arguments as the whole sparse decode.
  @row("host_floor", "one trivial XLA kernel, same arguments")
  def _():
    return (lambda q, k, v, s: q * 2), sets, None

  for ns in split_list:
    @row(f"attend_s{ns}", f"sparse_decode_partials, {ns} splits x {hk} kv heads" +
         (" (default)" if ns == splits else ""))
    def _(ns=ns):
      att = functools.partial(sparse_decode_partials, block_size=bs, num_splits=ns,
                              interpret=interpret)
      return ((lambda q, k, v, i, c: att(q, k, v, lens, i, None, c)),
              [(k, v, i, c) for (k, v, _), (i, c) in zip(sets, lists())], None)

  @row("attend_merged", f"sparse_decode (attend + in-kernel merge), {splits} splits")
  def _():
    merged = functools.partial(sparse_decode, block_size=bs, num_splits=splits,
                               interpret=interpret)
    return ((lambda q, k, v, i, c, a: merged(q, k, v, lens, i, None, c, a)[0]),
            [(k, v) + tuple(l3) for (k, v, _), l3 in zip(sets, lists3())],
            lambda f: {"attend_merged_equals_sparse": bool(jnp.array_equal(
                f(q, kc, vc, *lists3()[0]), base["out_idx"][0]))})

  @row("merge", "merge_decode_partials kernel")
  def _():
    mg = functools.partial(merge_decode_partials, out_dtype=dtype, interpret=interpret)
    return ((lambda q, o, l: mg(o, l)), parts(),
            lambda f: {"attend_merge_rel_err": rel_err(f(q, *parts()[0])[0], ref_sparse())})

  @row("xla_scores", "previous: einsum + divide (XLA)")
  def _():
    return (lambda q, s: sp.decode._decode_scores(q, s)), [(s,) for _, _, s in sets], None

  @row("xla_select", "previous: lax.top_k + forced + sort (XLA)")
  def _():
    return ((lambda q, s: sp.decode._decode_select_from_scores(s, lens, block_size=bs, **sel_kw)),
            score_sets(), None)

  @row("xla_merge", "previous: jattn.merge.merge_partials (XLA)")
  def _():
    return (lambda q, o, l: merge_partials(o, l, axis=1)[0].astype(dtype)), parts(), None

  @row("sparse_prev", "XLA select + kernel (32 splits) + XLA merge")
  def _():
    def prev(q, k, v, s):
      return attend_xla_merge(q, k, v, sp.decode._decode_select(q, s, lens, **sel_kw), num_splits=32)
    return prev, sets, sparse_check("sparse_prev_rel_err")

  @row("sparse_xla", "pure XLA")
  def _():
    sx = jax.jit(functools.partial(sp.sparse_decode_attention, kv_lengths=lens, block_size=bs,
                                   implementation="xla", **sel_kw))
    return ((lambda q, k, v, s: sx(q, k, v, block_summaries=s)), sets,
            sparse_check("sparse_xla_rel_err"))

  # ---- attention-kernel sweep: sw_<cfg> (the attention alone on the select kernel's block
  # lists) and sparse_best (the whole call with the fastest config)
  def attend_fn(cfg):
    """fn(q, k, v, indices, counts, arrivals=None) for a sweep config: the output [1, hq, d]
    in dtype, or the partials (out, lse) for ``_nm``. arrivals None: zeros made in the call."""
    if cfg.get("kernel") == "mosaic_gpu":
      from pallas_kernels.decode.mosaic_gpu import DecodeBlockSizes
      mkw = dict(block_size=bs, num_splits=cfg["splits"],
                 block_sizes=DecodeBlockSizes(64, cfg["num_stages"]))
      part = lambda q, k, v, i, c: smg.sparse_decode_partials(q, k, v, lens, i, None, c, **mkw)
    else:
      kw = dict(block_size=bs, num_splits=cfg["splits"], num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"], blocks_per_step=cfg["blocks_per_step"],
                index_lookahead=cfg["index_lookahead"], interpret=interpret)
      part = lambda q, k, v, i, c: sparse_decode_partials(q, k, v, lens, i, None, c, **kw)
    merge = cfg["merge"]
    if merge == "":
      return lambda q, k, v, i, c, a=None: sparse_decode(q, k, v, lens, i, None, c, a,
                                                         out_dtype=dtype, **kw)[0]
    if merge == "nm":
      return lambda q, k, v, i, c, a=None: part(q, k, v, i, c)
    if merge == "xm":
      return lambda q, k, v, i, c, a=None: merge_partials(*part(q, k, v, i, c),
                                                          axis=1)[0].astype(dtype)
    return lambda q, k, v, i, c, a=None: merge_decode_partials(
        *part(q, k, v, i, c), out_dtype=dtype, interpret=interpret)[0]

  default_cfg = parse_attend_config("", splits)

  def vs_sparse(key, out):
    """Max abs difference to the sparse row's output (and bit-identity for ``key`` given)."""
    if "out_idx" not in base:
      return {}
    ref_out = base["out_idx"][0]
    c = {f"{key}_max_abs_vs_sparse": float(jnp.max(jnp.abs(up(out) - up(ref_out))))}
    c[f"{key}_bitwise_vs_sparse"] = "equal" if bool(jnp.array_equal(out, ref_out)) else "differs"
    return c

  def sweep_what(cfg):
    if cfg.get("kernel") == "mosaic_gpu":
      return (f"Mosaic GPU attention alone: splits={cfg['splits']} x {hk} kv heads, "
              f"{cfg['num_stages']}-stage TMA ring of 64-key tiles, {MERGES[cfg['merge']]}")
    return (f"attention alone: splits={cfg['splits']} x {hk} kv heads, "
            f"warps={cfg['num_warps']}, stages={cfg['num_stages']}, "
            f"{cfg['blocks_per_step'] * bs} keys/step, ids "
            f"{'one step ahead' if cfg['index_lookahead'] else 'in the step'}, "
            f"{MERGES[cfg['merge']]}" +
            (", kept blocks compacted (contiguous copy, ids 0..count-1)"
             if cfg.get("compact") else ""))

  for cname, cfg in sweep_cfgs.items():
    @row(f"sw_{cname}", sweep_what(cfg))
    def _(cfg=cfg, cname=cname):
      key = f"sw_{cname}"
      per_set = [(k, v, i, c) for (k, v, _), (i, c) in zip(sets, lists())]
      if cfg.get("compact"):   # the same bytes, contiguous (made once, outside the timing)
        per_set = _sync([(compact_kept_blocks(k, i, c, bs)[0], *compact_kept_blocks(v, i, c, bs),
                          c) for k, v, i, c in per_set])

      def check(f):
        out = f(q, *per_set[0])
        if cfg["merge"] == "nm":
          out = merge_partials(*out, axis=1)[0].astype(dtype)
        c = {f"{key}_sweep_rel_err": rel_err(out, ref_sparse())}
        c.update(vs_sparse(key, out))
        if cfg == default_cfg and "out_idx" in base:    # the attention of the sparse call
          c[f"{key}_equals_sparse"] = bool(jnp.array_equal(out, base["out_idx"][0]))
        return c
      return attend_fn(cfg), per_set, check

  def best_sweep_config():
    """The sweep row with the lowest device_ms whose checks all passed (not ``_nm``, not
    ``_ct``)."""
    ok = [r for r in rows if r["stage"].startswith("sw_") and "device_ms" in r
          and "error" not in r and r.get("checks")
          and not any(check_passes(k, v) is False for k, v in r["checks"].items())
          and sweep_cfgs[r["stage"][3:]]["merge"] != "nm"
          and not sweep_cfgs[r["stage"][3:]].get("compact")]
    if not ok:
      raise RuntimeError("no sweep row with a device time and passing checks: pass "
                         "--attend-best")
    return min(ok, key=lambda r: r["device_ms"])["stage"][3:]

  if sweep_mode:
    @row("sparse_best", "whole sparse decode (scores + select + attention) with the sweep's "
                        "fastest config (device_ms) or --attend-best; returns (out, indices)")
    def _():
      cname = attend_config_name(parse_attend_config(args.attend_best, splits, mg_splits)) \
          if args.attend_best else best_sweep_config()
      cfg = parse_attend_config(cname, splits, mg_splits)
      if cfg["merge"] == "nm":
        raise ValueError(f"sparse_best needs a config with a merge, got {cname}")
      att = attend_fn(cfg)

      def fn(q, k, v, s):
        i, c, a = sel_fn(sc_fn(q, s.sums, s.lengths), lens, return_arrivals=True,
                         digit_bits=args.best_digit_bits)
        return att(q, k, v, i, c, a), i

      def check(f):
        out, idx = f(q, kc, vc, summ)
        c = {"sparse_best_config": cname + (f" r{args.best_digit_bits}"
                                            if args.best_digit_bits > 1 else ""),
             "sparse_best_sweep_rel_err": rel_err(out, ref_sparse())}
        c.update(vs_sparse("sparse_best", out))
        if "out_idx" in base:
          c["sparse_best_indices_equal_sparse"] = bool(jnp.array_equal(idx, base["out_idx"][1]))
        return c
      return fn, sets, check

  assert list(specs) == names, (list(specs), names)

  # ---- run the chosen rows
  def run_row(name):
    what, build = specs[name]
    r = dict(stage=name, what=what)
    ph = {}
    t_row = time.perf_counter()
    sweep = name.startswith("sw_")
    try:
      t = time.perf_counter()
      fn, per_set, check = build()
      if fn is None:
        raise RuntimeError(checks.get(f"{name}_error", "not available"))
      fn = jax.jit(fn)
      ph["inputs"] = time.perf_counter() - t
      if sweep:
        # Two programs (sweep_unroll calls and a quarter), the check on the long one's first
        # output (q = qs[0], input set 0): one compile per program, no host timing.
        rest = [tuple(p) for p in per_set]
        n_long, n_short = sweep_unroll, max(1, sweep_unroll // 4)
        t = time.perf_counter()
        full, outs, many_long = program_ms(fn, qs_sw[:n_long], rest, repeats=args.prog_repeats,
                                           return_outputs=True)
        ph[f"x{n_long}"] = time.perf_counter() - t
        if check is not None:
          t = time.perf_counter()
          try:
            r["checks"] = check(lambda *a: outs[0])
          except Exception as e:  # noqa: BLE001
            r["checks"] = {f"{name}_check_error": f"{type(e).__name__}: {e}"[:400]}
          ph["check"] = time.perf_counter() - t
          checks.update(r["checks"])
        r["unroll_ms"] = full / n_long
        if n_short < n_long:
          t = time.perf_counter()
          part, _, many_short = program_ms(fn, qs_sw[:n_short], rest,
                                           repeats=args.prog_repeats, return_outputs=True)
          ph[f"x{n_short}"] = time.perf_counter() - t
          r["device_ms"] = (full - part) / (n_long - n_short)
          r["round_device_ms"] = [r["device_ms"]]
          sweep_progs[name] = dict(row=r, long=(many_long, qs_sw[:n_long], [full]),
                                   short=(many_short, qs_sw[:n_short], [part]), rest=rest)
        check = None                              # done; skip the generic path below
      if check is not None:
        t = time.perf_counter()
        try:
          r["checks"] = check(fn)
        except Exception as e:  # noqa: BLE001
          r["checks"] = {f"{name}_check_error": f"{type(e).__name__}: {e}"[:400]}
        ph["check"] = time.perf_counter() - t
        checks.update(r["checks"])
      arg_sets = [(qs[i % unroll],) + tuple(p) for i, p in enumerate(per_set)]
      rest = [tuple(p) for p in per_set]
      if "host" in timings and not sweep:
        t = time.perf_counter()
        r["host_ms"] = host_ms(fn, arg_sets, min_time=min_time)
        ph["host"] = time.perf_counter() - t
      if timings & {"unroll", "device"} and not sweep:
        t = time.perf_counter()
        full, _, many_full = program_ms(fn, qs, rest, repeats=args.prog_repeats,
                                        return_outputs=True)
        ph[f"x{len(qs)}"] = time.perf_counter() - t
        if "unroll" in timings:
          r["unroll_ms"] = full / len(qs)
        if "device" in timings:
          t = time.perf_counter()
          half = len(qs) // 2
          part, _, many_half = program_ms(fn, qs[:half], rest, repeats=args.prog_repeats,
                                          return_outputs=True)
          ph[f"x{half}"] = time.perf_counter() - t
          r["device_ms"] = (full - part) / (len(qs) - half)
          if sweep_mode and name in FINAL_RETIME:        # re-timed together at the end
            r["round_device_ms"] = [r["device_ms"]]
            final_progs[name] = dict(row=r, long=(many_full, qs, [full]),
                                     short=(many_half, qs[:half], [part]), rest=rest)
    except Exception as e:  # noqa: BLE001  keep probing
      r["error"] = f"{type(e).__name__}: {e}"[:400]
    r["wall_s"] = time.perf_counter() - t_row
    r["phases_s"] = {k: round(v, 2) for k, v in ph.items()}
    rows.append(r)
    cks = r.get("checks", {})
    bad = [k for k, v in cks.items() if check_passes(k, v) is False]
    ck = ("" if not cks else " | check " + ("FAIL " + ",".join(bad) if bad else "ok") + ": " +
          ", ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in cks.items() if check_passes(k, v) is not None))
    fmt = lambda k: f"{r[k]:8.4f}" if k in r else "     n/a"
    print(f"  {name:24s} host {fmt('host_ms')} ms   unroll {fmt('unroll_ms')} ms   device "
          f"{fmt('device_ms')} ms   {what}{ck}{' | ERROR ' + r['error'] if 'error' in r else ''}"
          f" | {r['wall_s']:.1f}s (" + ", ".join(f"{k} {v:.1f}" for k, v in ph.items()) + ")",
          flush=True)

  def summarize():
    by = {r["stage"]: r for r in rows}
    summary = {}
    for key in ("host_ms", "unroll_ms", "device_ms"):
      if key in by.get("dense", {}) and key in by.get("sparse", {}):
        summary[f"speedup_{key}"] = by["dense"][key] / by["sparse"][key]
      if key in by.get("dense", {}) and key in by.get("sparse_4k", {}):
        summary[f"speedup_4k_{key}"] = by["dense"][key] / by["sparse_4k"][key]
      if key in by.get("sparse", {}) and key in by.get("sparse_4k", {}):
        summary[f"merged_vs_4k_{key}"] = by["sparse_4k"][key] / by["sparse"][key]
      for name in ("sparse_fused", "sparse_fused_s1", "sparse_fused_r4", "sparse_fused_r2",
                   "sparse_r4", "sparse_r2", "sparse_mosaic"):
        short = name[len("sparse_"):]
        if key in by.get("dense", {}) and key in by.get(name, {}):
          summary[f"speedup_{short}_{key}"] = by["dense"][key] / by[name][key]
        if key in by.get("sparse", {}) and key in by.get(name, {}):
          summary[f"{short}_vs_sparse_{key}"] = by["sparse"][key] / by[name][key]
    for key in ("host_ms", "unroll_ms", "device_ms"):
      if key in by.get("dense", {}) and key in by.get("sparse_best", {}):
        summary[f"speedup_best_{key}"] = by["dense"][key] / by["sparse_best"][key]
      if key in by.get("sparse", {}) and key in by.get("sparse_best", {}):
        summary[f"best_vs_sparse_{key}"] = by["sparse"][key] / by["sparse_best"][key]
    sw = sorted((r for r in rows if r["stage"].startswith("sw_") and "device_ms" in r),
                key=lambda r: r["device_ms"])
    if sw:
      summary["attend_sweep"] = [
          dict(config=r["stage"][3:], device_us=round(r["device_ms"] * 1e3, 2),
               unroll_us=round(r["unroll_ms"] * 1e3, 2),
               round_device_us=[round(x * 1e3, 2) for x in r.get("round_device_ms", [])],
               ok=not any(check_passes(k, v) is False for k, v in r.get("checks", {}).items()))
          for r in sw]
    if "sparse_best_config" in checks:
      summary["sparse_best_config"] = checks["sparse_best_config"]
    if "kept_blocks_per_head" in checks:
      kv_bytes = 2 * float(np.sum(checks["kept_blocks_per_head"])) * bs * d * 2
      summary["kept_kv_bytes"] = kv_bytes
      summary["kv_read_us_at_4TBps"] = kv_bytes / 4e12 * 1e6
    res["summary"] = summary
    res["ok"] = bool(all(check_passes(k, v) is not False for k, v in checks.items())
                     and not any("error" in r for r in rows))
    res["meta"]["triton_compile"] = triton_stats and dict(triton_stats)

  setup_s["before_rows"] = time.perf_counter() - t_start
  write_json()
  sweep_progs = {}                         # sw_ row -> its two compiled programs and times
  final_progs = {}                         # sweep mode: dense, sparse, sparse_best likewise

  def retime(progs, what):
    """--sweep-rounds more timing rounds of each row's two compiled programs, the rows
    interleaved (drift and clock changes hit all of them alike); device_ms and unroll_ms become
    those of the best times over all rounds, round_device_ms lists the slope of each round (its
    spread is the noise)."""
    if not progs or args.sweep_rounds <= 0:
      return
    t0 = time.perf_counter()
    for _ in range(args.sweep_rounds):
      for e in progs.values():
        for which in ("long", "short"):
          many, qq, times = e[which]
          try:
            times.append(best_ms(many, qq, e["rest"], args.prog_repeats))
          except Exception as ex:  # noqa: BLE001
            e["row"]["retime_error"] = f"{type(ex).__name__}: {ex}"[:200]
        r = e["row"]
        n_long, n_short = len(e["long"][1]), len(e["short"][1])
        r["round_device_ms"].append((e["long"][2][-1] - e["short"][2][-1]) / (n_long - n_short))
    for e in progs.values():
      r = e["row"]
      n_long, n_short = len(e["long"][1]), len(e["short"][1])
      r["device_ms"] = (min(e["long"][2]) - min(e["short"][2])) / (n_long - n_short)
      r["unroll_ms"] = min(e["long"][2]) / n_long
    print(f"  ({what} re-timed: {args.sweep_rounds} more rounds of {len(progs)} rows, "
          f"{time.perf_counter() - t0:.1f}s: " + ", ".join(
              f"{e['row']['stage']} {e['row']['device_ms'] * 1e3:.1f}" for e in progs.values())
          + " us device)", flush=True)

  for pos, name in enumerate(chosen):
    run_row(name)
    if name.startswith("sw_") and not (chosen[pos + 1:] or [""])[0].startswith("sw_"):
      retime(sweep_progs, "sweep")          # after the last sweep row, before sparse_best
    summarize()
    write_json()
  retime(final_progs, "whole-call rows")    # sweep mode: the ratios' rows together
  res["complete"] = True
  summarize()
  write_json()
  ts = triton_stats
  print("summary:", json.dumps(res["summary"]), f"ok={res['ok']}",
        f"wall {res['meta']['wall_s']:.1f}s (setup {setup_s['before_rows']:.1f}s)" +
        (f"; triton compiles {ts['calls'] - ts['hits']} ({ts['compile_s']:.1f}s), "
         f"{ts['hits']} cache hits" if ts else ""), flush=True)
  if res["summary"].get("attend_sweep"):
    print("attention sweep by device time (us; the floor of the kept K+V reads at 4 TB/s: "
          f"{res['summary'].get('kv_read_us_at_4TBps', float('nan')):.1f}):", flush=True)
    for e in res["summary"]["attend_sweep"]:
      rd = e["round_device_us"] or [float("nan")]
      print(f"  {e['config']:24s} device {e['device_us']:8.2f}   unroll {e['unroll_us']:8.2f}"
            f"   rounds {min(rd):.2f}..{max(rd):.2f}{'' if e['ok'] else '   CHECK FAILED'}",
            flush=True)
    failed = [r["stage"] for r in rows if r["stage"].startswith("sw_") and "error" in r]
    if failed:
      print("  sweep rows with errors:", ", ".join(failed), flush=True)
  if "sparse_best_config" in res["summary"]:
    print(f"sparse_best = scores + select + attention {res['summary']['sparse_best_config']}: "
          + ", ".join(f"dense/best {k[len('speedup_best_'):]} {v:.2f}x"
                      for k, v in res["summary"].items() if k.startswith("speedup_best_")),
          flush=True)
  if not res["ok"]:
    print("failed:", [k for k, v in checks.items() if check_passes(k, v) is False],
          [r["stage"] for r in rows if "error" in r], flush=True)
  return 0 if res["ok"] else 1


if __name__ == "__main__":
  sys.exit(main())
