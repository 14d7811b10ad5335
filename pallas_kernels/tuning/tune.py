"""Tune the flash kernels on this GPU and write a table that jattn reads for its device kind.

    python -m pallas_kernels.tuning.tune --quick --out ~/jattn-tables
    export JATTN_TUNING_DIR=~/jattn-tables      # jattn now reads the table for this card

Per table key, on B2 H16 with 16K tokens (8K with ``--quick``), the fastest candidate that
matches an fp32 reference wins; today's config is always a candidate (docs/flash.md)."""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import tuning
from pallas_kernels.block_schedule import make_schedule
from pallas_kernels.flash import mosaic_gpu as mg
from pallas_kernels.flash import mosaic_gpu_bwd as mgb
from pallas_kernels.flash import triton as ft
from pallas_kernels.flash.reference import attention_reference
from pallas_kernels.tuning.timing import random_sets, time_fn

# mask kind -> (causal, window) of the tuning shapes
MASKS = {"dense": (False, None), "causal": (True, None), "causal_window": (True, (511, 0))}
HOPPER_KERNELS = ("mosaic_gpu_fwd", "mosaic_gpu_bwd")


def candidates(kernel: str, head_dim: int, mask: str, quick: bool) -> list[dict]:
  """The candidate params of one key (``BlockSizes`` fields), incumbents not included.

  Args:
    kernel, head_dim, mask: the key: one of ``tuning.KERNELS``, a head dim, a kind of ``MASKS``.
    quick: the reduced set of ``--quick``.

  Returns:
    A list of dicts of the kernel's ``BlockSizes`` fields.

  Example:
    >>> len(candidates("mosaic_gpu_fwd", 128, "causal", quick=True)) > 3
    True
  """
  out = []
  if kernel == "mosaic_gpu_fwd":
    block_ks = {256: (64,), 64: (256,) if quick else (128, 256)}.get(head_dim,
                                                                (128,) if quick else (64, 128))
    protocols = sorted(mg.PROTOCOLS)
    for bk, stages, proto in itertools.product(block_ks, (2,) if quick else (2, 3), protocols):
      out.append(dict(block_q=64, block_k=bk, num_stages=stages, protocol=proto))
      if proto == "overlap" and mask == "causal_window" and head_dim != 256:
        out.append(dict(out[-1], q_tiles_per_program=2))
      if proto == "overlap" and mask == "dense":
        out.append(dict(out[-1], tail_kv_splits=8))
  elif kernel == "mosaic_gpu_bwd":
    for bk_dq, st_dkv, st_dq in itertools.product((64, 128), (2, 3) if quick else (2, 3, 4),
                                                  (2,) if quick else (2, 3)):
      out.append(dict(block_q_dkv=64, block_k_dkv=64, block_q_dq=64, block_k_dq=bk_dq,
                      num_stages_dkv=st_dkv, num_stages_dq=st_dq))
  elif kernel == "triton_fwd":
    for bq, bk, warps, stages in itertools.product((64, 128), (32, 64) if quick else (32, 64, 128),
                                                   (4, 8), (2, 3)):
      out.append(dict(block_q=bq, block_k=bk, num_warps=warps, num_stages=stages))
  elif kernel == "triton_bwd":
    for warps, stages, chunk in itertools.product((4, 8), (2, 3), (32, 64)):
      out.append(dict(bwd_block_q=None, bwd_block_k=None, bwd_num_warps=warps,
                      bwd_num_stages=stages, dkv_q_chunk=chunk, dq_k_chunk=chunk, dkv_block_q=None))
  else:
    raise ValueError(f"kernel must be one of {tuning.KERNELS}, got {kernel!r}")
  return out


def _call(kernel, params, incumbent_fwd, causal, window):
  """A jitted fn(q, k, v, do) -> output (forward kernels) or gradients (backward kernels)."""
  mask = dict(causal=causal, local_window_size=window)
  if kernel.startswith("mosaic"):
    if kernel == "mosaic_gpu_fwd":
      fwd, bwd = mg.BlockSizes(**params), None
    else:
      fwd = dataclasses.replace(mg.BlockSizes(**incumbent_fwd), backward="mosaic")
      bwd = mgb.BlockSizes(**params)

    def attn(q, k, v):
      return mg.flash_attention(q, k, v, block_sizes=fwd, bwd_block_sizes=bwd, **mask)[0]
  else:
    bs = ft.BlockSizes(**{**incumbent_fwd, **params})

    def attn(q, k, v):
      sched = make_schedule(q.shape[1], k.shape[1], bs.block_q, bs.block_k, **mask)
      return ft.flash_attention(q, k, v, None, None, sched, scale=None, logits_soft_cap=None,
                                block_sizes=bs, **mask)[0]
  if kernel.endswith("_fwd"):
    return jax.jit(lambda q, k, v, do: attn(q, k, v))
  return jax.jit(lambda q, k, v, do: jax.vjp(attn, q, k, v)[1](do))


def _check(fn, args, causal, window, tol=2e-2):
  """Relative error of fn on one (batch row, head) slice against the fp32 reference."""
  q, k, v, do = (a[:1, :, :1].astype(jnp.float32) for a in args)
  ref = lambda q_: attention_reference(q_, k, v, causal=causal, local_window_size=window)[0]
  want, got = ref(q), fn(*args)
  if isinstance(got, tuple):   # gradients: check dq through the reference's vjp
    want, got = jax.vjp(ref, q)[1](do)[0], got[0]
  got = np.asarray(got[:1, :, :1], np.float32)
  err = float(np.linalg.norm(got - np.asarray(want)) / max(np.linalg.norm(np.asarray(want)), 1e-30))
  return err, err < tol


def tune_key(kernel, head_dim, mask, *, seq, quick, kind, log=print):
  """Time the candidates of one key and return the winning table entry (None if none ran).

  Args:
    kernel, head_dim, mask, quick: as :func:`candidates` (head_dim 64, 128 or 256; the Triton
      kernels read one entry for every mask: tuned on "causal", it is written for "all").
    seq: tokens per sequence of the tuning shape (B2 H16, bf16).
    kind: this device's kind (its current table gives the incumbent).
    log: printer of one line per candidate.

  Returns:
    A table entry (kernel, head_dim, dtype, mask, params, provenance) or None.

  Example (on a Hopper GPU):
    >>> e = tune_key("mosaic_gpu_fwd", 128, "causal", seq=8192, quick=True,
    ...              kind=tuning.device_kind())  # doctest: +SKIP
  """
  causal, window = MASKS[mask]
  fwd_kernel = "mosaic_gpu_fwd" if kernel.startswith("mosaic") else "triton_fwd"
  incumbent_fwd = tuning.required_params(fwd_kernel, head_dim, "16bit", kind, mask)
  incumbent = tuning.required_params(kernel, head_dim, "16bit", kind, mask)
  cands = [incumbent] + [c for c in candidates(kernel, head_dim, mask, quick) if c != incumbent]
  args_sets = random_sets([(2, seq, 16, head_dim)] * 4, jnp.bfloat16, num_sets=2)
  timed = []
  for i, p in enumerate(cands):
    t0 = time.perf_counter()
    try:
      fn = _call(kernel, p, incumbent_fwd, causal, window)
      err, ok = _check(fn, args_sets[0], causal, window)
      ms = time_fn(fn, args_sets, repeats=3)[0] if ok else float("inf")
    except Exception as e:   # a candidate that does not compile (shared memory, registers)
      err, ok, ms = None, False, float("inf")
      log(f"  {kernel} D{head_dim} {mask} {p}: failed: {type(e).__name__}: {str(e)[:120]}")
    else:
      log(f"  {kernel} D{head_dim} {mask} {p}: {ms:.3f} ms rel_err {err:.1e} "
          f"({time.perf_counter() - t0:.1f} s)")
    timed.append((ms, i, p))
  best_ms, _, best = min(timed, key=lambda t: (t[0], t[1]))
  if not np.isfinite(best_ms):
    return None
  prov = dict(status="tuned", ms=round(best_ms, 4), incumbent_ms=round(timed[0][0], 4),
              shape=f"B2 S{seq} H16 bf16", candidates=len(cands))
  return dict(kernel=kernel, head_dim=head_dim, dtype="16bit",
              mask=mask if kernel.startswith("mosaic") else "all", params=best, provenance=prov)


def main(argv=None) -> dict:
  """The command line: tune this GPU's kernels and write ``<out>/<device>.json``.

  Args:
    argv: the arguments (default: ``sys.argv[1:]``); see ``--help``.

  Returns:
    The written table (a dict in the tables' format).

  Example (on a GPU):
    >>> main(["--quick", "--kernels", "mosaic_gpu_fwd", "--out", "/tmp/t"])  # doctest: +SKIP
  """
  ap = argparse.ArgumentParser(prog="python -m pallas_kernels.tuning.tune",
                               description=__doc__.split("\n\n")[0])
  ap.add_argument("--kernels", default=None,
                  help=f"comma list among {', '.join(tuning.KERNELS)} (default: the Mosaic GPU "
                       f"kernels on Hopper, the Triton ones elsewhere)")
  ap.add_argument("--head-dims", default="64,128,256", help="comma list (default: %(default)s)")
  ap.add_argument("--masks", default=",".join(MASKS), help="comma list among %(default)s")
  ap.add_argument("--quick", action="store_true", help="fewer candidates, 8K tokens")
  ap.add_argument("--out", default=".", help="folder of the written table (default: %(default)s)")
  a, dev = ap.parse_args(argv), tuning.device()
  if dev.platform != "gpu":
    ap.error(f"the tuning command needs a GPU, this machine's jax backend is {dev.platform!r}")
  kernels = (a.kernels.split(",") if a.kernels else
             list(HOPPER_KERNELS) if dev.sm90 else ["triton_fwd", "triton_bwd"])
  bad = [k for k in kernels if k not in tuning.KERNELS or (k in HOPPER_KERNELS and not dev.sm90)]
  masks = a.masks.split(",")
  bad += [m for m in masks if m not in MASKS]
  if bad:
    ap.error(f"unknown or unsupported here: {', '.join(bad)} (kernels: {tuning.KERNELS}, Mosaic "
             f"GPU ones on Hopper only; masks: {tuple(MASKS)})")
  head_dims, t0, entries = [int(d) for d in a.head_dims.split(",")], time.time(), []
  print(f"tuning on {dev.kind} (today's table: {dev.table})", flush=True)
  dims = {"mosaic_gpu_fwd": mg.HEAD_DIMS, "mosaic_gpu_bwd": mgb.HEAD_DIMS}
  for kernel, d, mask in itertools.product(kernels, head_dims, masks):
    if d not in dims.get(kernel, (d,)) or (kernel.startswith("triton") and mask != "causal"):
      continue   # Triton reads "all" entries, tuned on "causal"
    e = tune_key(kernel, d, mask, seq=8192 if a.quick else 16384, quick=a.quick, kind=dev.kind,
                 log=lambda s: print(s, flush=True))
    if e is not None:
      entries.append(e)
      print(f"{kernel} D{d} {mask}: {e['params']} {e['provenance']['ms']} ms "
            f"(incumbent {e['provenance']['incumbent_ms']} ms)", flush=True)
  common = dict(command="python -m pallas_kernels.tuning.tune " + " ".join(argv or sys.argv[1:]),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=dev.kind, jax_version=jax.__version__, seconds=round(time.time() - t0))
  for e in entries:
    e["provenance"].update(common)
  table = dict(format=1, device_kinds=[dev.kind], description=(
      f"Flash kernel configs tuned on {dev.kind} by pallas_kernels.tuning.tune; keys it did not "
      f"tune fall back to generic.json."), entries=entries)
  os.makedirs(a.out, exist_ok=True)
  path = os.path.join(a.out, tuning.table_name(dev.kind))
  with open(path, "w") as f:
    json.dump(table, f, indent=1)
  print(f"wrote {path} ({len(entries)} entries, {common['seconds']} s)")
  return table


if __name__ == "__main__":
  main()
