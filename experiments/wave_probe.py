"""Wave quantization of the Mosaic GPU forward (issue 8, H200): does the last, partial wave of
programs cost a whole wave?

At B2 S16K H16 D128 the forward launches 32 (batch, head) pairs x 128 query programs = 4096
programs, one resident per SM (167 KB of shared memory), i.e. 31.03 waves of 132 on an H200: 31
full waves and a last one of 4 programs. If a program's time is the same everywhere, the
kernel takes 32 wave-times for 31.03 waves of work, 3.1% more than the work. This probe times
the forward (and cuDNN through jax.nn, the same run) at B1 S16K with H heads for several H,
so the number of waves differs:

  H = 31: 3968 programs, 30.06 waves -> 31;   H = 32: 4096, 31.03 -> 32;
  H = 33: 4224, exactly 32;                   H = 16 x B2: as H = 32.

With quantization, H33 takes as long as H32 (both 32 waves); with perfect balance it takes
33/32 as long. Every row is checked against cuDNN (max abs difference printed).

Example (CPU: only prints the plan):
    python experiments/wave_probe.py --dry-run
"""
from __future__ import annotations

import argparse
import json
import math

import jax
import jax.numpy as jnp


def _programs(b, h, s, rows=128):
  return b * h * math.ceil(s / rows)


def main(argv=None):
  """Parse arguments, time the shapes, print and return the rows.

  Args:
    argv: command-line arguments (default sys.argv).

  Returns:
    A list of row dicts (empty with --dry-run).
  """
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--shapes", default="1x31,1x32,1x33,2x16,1x64,1x66",
                  help="comma-separated BxH at S --seq")
  ap.add_argument("--seq", type=int, default=16384)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--causal", action="store_true")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--sms", type=int, default=132)
  ap.add_argument("--out", default=None, help="write the rows as JSON here")
  ap.add_argument("--dry-run", action="store_true")
  args = ap.parse_args(argv)
  shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
  for b, h in shapes:
    n = _programs(b, h, args.seq)
    print(f"B{b} H{h}: {n} programs = {n / args.sms:.2f} waves of {args.sms}")
  if args.dry_run:
    return []
  import jattn
  from pallas_kernels._timing import random_sets, time_fn

  d, s = args.head_dim, args.seq
  fns = {
      "jattn_mosaic_gpu": jax.jit(lambda q, k, v: jattn.flash_attention(
          q, k, v, causal=args.causal, implementation="mosaic_gpu")),
      "jax_nn_cudnn": jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=args.causal, implementation="cudnn")),
  }
  sets = {}
  for b, h in shapes:
    sets[(b, h)] = random_sets([(b, s, h, d)] * 3, jnp.bfloat16, num_sets=2, seed=b * 100 + h)
  checks = {}
  for (b, h), st in sets.items():
    ref = fns["jax_nn_cudnn"](*st[0])
    out = fns["jattn_mosaic_gpu"](*st[0])
    checks[(b, h)] = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
  times = {}
  for r in range(args.rounds):                       # interleaved rounds
    for (b, h), st in sets.items():
      for name, fn in fns.items():
        ms, _ = time_fn(fn, st, repeats=3)
        times.setdefault((b, h, name), []).append(ms)
  rows = []
  for (b, h), st in sets.items():
    n = _programs(b, h, s)
    for name in fns:
      t = sorted(times[(b, h, name)])[len(times[(b, h, name)]) // 2]
      row = dict(op="flash_fwd_waves", impl=name, case=f"B{b} S{s} H{h} D{d}"
                 + (" causal" if args.causal else ""), ms=t, rounds_ms=times[(b, h, name)],
                 programs=n, waves=n / args.sms, ms_per_pair=t / (b * h),
                 max_abs_vs_cudnn=checks[(b, h)])
      rows.append(row)
      print(f"{row['case']:<28} {name:<18} {t:8.3f} ms  {t / (b * h) * 1e3:7.2f} us/pair  "
            f"waves {n / args.sms:6.2f}  rounds {[round(x, 3) for x in row['rounds_ms']]}  "
            f"max|d| {checks[(b, h)]:.4f}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows), f,
                indent=1)
  return rows


if __name__ == "__main__":
  main()
