"""Hashes of the Mosaic GPU forward's lowered modules, to check that a refactor is a no-op.

Lowers ``pallas_kernels.flash.mosaic_gpu.flash_attention`` for "cuda" on the CPU for a fixed set
of configurations (head dims, masks, segment ids, block schedules, with and without
``overlap_softmax``), captures each Mosaic GPU module before serialization (by wrapping
``jax.experimental.mosaic.gpu.core._run_serde_pass``), drops its locations and prints one short
hash per module. Run it on two checkouts (``git worktree add /tmp/base <commit>``) with
``JAX_TRACEBACK_IN_LOCATIONS_LIMIT=0`` and compare the lines: equal hashes mean the same kernels.
Session 18 used it to show that the non-overlap kernels are unchanged since 8dd1fa0 and that the
overlap range path is byte-identical to the GPU-tested e8efd26.

Example:
    JAX_TRACEBACK_IN_LOCATIONS_LIMIT=0 python experiments/mosaic_module_hashes.py --repo /tmp/base
    JAX_TRACEBACK_IN_LOCATIONS_LIMIT=0 python experiments/mosaic_module_hashes.py --repo .
"""
from __future__ import annotations

import argparse
import hashlib
import re
import sys


def module_hashes(overlap: bool, seq: int = 512) -> list[str]:
  """One 10-hex-digit hash per configuration, in a fixed order.

  Args:
    overlap: the ``overlap_softmax`` configurations (range path: dense, causal, windows, soft
      cap; options that older checkouts lack are not used otherwise).
    seq: sequence length of the lowered problems.

  Returns:
    The hashes.
  """
  import jax
  import jax.numpy as jnp
  from jax.experimental.mosaic.gpu import core as mgpu_core
  from pallas_kernels.block_schedule import make_schedule
  from pallas_kernels.flash import mosaic_gpu as mg
  seen = []
  orig = mgpu_core._run_serde_pass

  def spy(module, *, serialize, **kw):
    if serialize:
      seen.append(re.sub(r"loc\([^)]*\)", "", str(module)))
    return orig(module, serialize=serialize, **kw)
  mgpu_core._run_serde_pass = spy
  try:
    if overlap:
      ov = dict(overlap_softmax=True, pingpong_handoff=True, early_k_load=True)
      cfgs = [(128, mg.BlockSizes(64, 128, 2, **ov)), (128, mg.BlockSizes(64, 64, 2, **ov)),
              (256, mg.BlockSizes(64, 64, 2, **ov)),
              (64, mg.BlockSizes(64, 128, 3, pingpong=False, overlap_softmax=True))]
      masks = [(False, None, None, False, False), (True, None, None, False, False),
               (True, (200, 0), None, False, False), (False, (100, 30), 5.0, False, False)]
    else:
      cfgs = [(128, mg.BlockSizes(64, 128, 2, softmax_fence=True, k_wait_in_pv=True,
                                  pingpong_handoff=True)),
              (128, mg.BlockSizes(64, 64, 2, softmax_fence=True)),
              (64, mg.BlockSizes(64, 128, 3, k_wait_in_pv=True)),
              (256, mg.BlockSizes(64, 64, 2, k_wait_in_pv=True, pingpong_handoff=True))]
      masks = [(False, None, None, False, False), (True, None, None, False, False),
               (True, (200, 0), None, False, False), (True, None, None, True, False),
               (True, None, None, False, True)]
    out = []
    for d, bs in cfgs:
      for causal, win, cap, seg, sch in masks:
        q = jax.ShapeDtypeStruct((2, seq, 2, d), jnp.bfloat16)
        ids = jax.ShapeDtypeStruct((2, seq), jnp.int32)
        segs = (ids, ids) if seg else ()
        sched = make_schedule(seq, seq, 128, bs.block_k, causal=causal) if sch else None
        seen.clear()
        jax.jit(lambda q, *s: mg.flash_attention(
            q, q, q, *s, causal=causal, local_window_size=win, logits_soft_cap=cap,
            block_sizes=bs, schedule=sched)).trace(q, *segs).lower(lowering_platforms=("cuda",))
        out.append(hashlib.md5(seen[0].encode()).hexdigest()[:10])
    return out
  finally:
    mgpu_core._run_serde_pass = orig


def main(argv=None):
  """Print the default and the overlap configurations' hashes of the checkout at --repo.

  Args:
    argv: command-line arguments (default sys.argv).

  Returns:
    None.
  """
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--repo", default=".", help="checkout whose pallas_kernels to lower")
  ap.add_argument("--overlap", action="store_true", help="the overlap_softmax configurations")
  args = ap.parse_args(argv)
  sys.path.insert(0, args.repo)
  print(" ".join(module_hashes(args.overlap)))


if __name__ == "__main__":
  main()
