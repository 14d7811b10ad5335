"""Run the Mosaic GPU flash forward a few times, for Nsight Compute (``ncu``) to profile (H200).

Each case compiles the forward once, runs it ``--calls`` times on random bf16 inputs and checks
the last output against jax.nn's cuDNN forward (so a profile is never of a wrong kernel). ncu
then profiles the kernels it is told to, e.g. (see experiments/gpu_sessions/next_gpu_session_p.sh):

    ncu --target-processes all -k regex:mosaic -c 1 --set full \
        python experiments/ncu_flash_fwd.py --case dense

Cases (B, S, H, D128 bf16, the tuning table's entry for the mask, as jattn picks it; before
session 20 the script used the "all" entry unless --overlap):
  dense:  B1 S8K H16 non-causal.
  causal: B1 S8K H16 causal.
  window: B2 S16K H16 causal window (511, 0) (issue 8's window case).
  packed: B1 S16K H16, four causal 4K documents per row (segment ids; issue 8's packed case).
  causal4k: B4 S4K H16 causal: the packed case's work without segment ids (same tiles).

With ``--bwd`` it runs forward + backward (jax.grad through ``jattn.flash_attention``) and
checks dq against cuDNN's; ``ncu -k regex:mosaic_gpu_kernel -c 3`` then profiles the forward,
dK/dV and dQ kernels of one call.

Example (CPU: only parses the arguments; the kernels need a GPU):
    python experiments/ncu_flash_fwd.py --case window --calls 1 --dry-run
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

CASES = {
    "dense": dict(b=1, s=8192, h=16, causal=False, window=None),
    "causal": dict(b=1, s=8192, h=16, causal=True, window=None),
    "window": dict(b=2, s=16384, h=16, causal=True, window=(511, 0)),
    "packed": dict(b=1, s=16384, h=16, causal=True, window=None, docs=4),
    "causal4k": dict(b=4, s=4096, h=16, causal=True, window=None),
}


def main(argv=None):
  """Parse arguments, run the case, print the check against cuDNN.

  Args:
    argv: command-line arguments (default sys.argv).

  Returns:
    The max abs difference against cuDNN (None with --dry-run).
  """
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--case", choices=sorted(CASES), default="dense")
  ap.add_argument("--calls", type=int, default=2)
  ap.add_argument("--dry-run", action="store_true")
  ap.add_argument("--bwd", action="store_true",
                  help="forward + backward through jattn (implementation='mosaic_gpu': the Mosaic "
                       "backward at D128 without masks), for profiling the backward kernels")
  ap.add_argument("--fused-bwd", action="store_true",
                  help="the forward, then the fused Mosaic backward (mosaic_gpu_bwd_fused: dQ by "
                       "reduce-adds inside the dK/dV kernel) on its out and lse")
  ap.add_argument("--time", action="store_true",
                  help="also time the forward with the bench's timer (pallas_kernels._timing; "
                       "not under ncu) and print its ms")
  ap.add_argument("--overlap", action="store_true",
                  help="BlockSizes.overlap_softmax (+ pingpong_handoff, early_k_load) on the "
                       "mask's default tiles")
  args = ap.parse_args(argv)
  c = CASES[args.case]
  shape = (c["b"], c["s"], c["h"], 128)
  from pallas_kernels.flash import mosaic_gpu as mg
  from pallas_kernels.tuning import mask_kind
  # the tiles jattn picks for the mask (the table's mask entry), as in the bench
  base = mg.default_block_sizes(128, mask=mask_kind(c["causal"], c["window"],
                                                    segments=bool(c.get("docs"))))
  bs = base
  if args.overlap:
    import dataclasses
    bs = dataclasses.replace(base, overlap_softmax=True, pingpong_handoff=True,
                             early_k_load=True, k_wait_in_pv=False, softmax_fence=False)
  if args.dry_run:
    print("inputs", shape, "bfloat16;", bs)
    return None
  ks = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(kk, shape, jnp.bfloat16) for kk in ks)
  docs = c.get("docs")
  seg = None
  if docs:
    seg = jnp.repeat(jnp.arange(1, docs + 1, dtype=jnp.int32), c["s"] // docs)[None]
    seg = jnp.broadcast_to(seg, (c["b"], c["s"]))
  fn = jax.jit(lambda q, k, v: mg.flash_attention(
      q, k, v, seg, seg, causal=c["causal"], local_window_size=c["window"], block_sizes=bs)[0])
  if args.fused_bwd:
    from pallas_kernels.flash import mosaic_gpu_bwd_fused as mf
    ct = jax.random.normal(jax.random.key(1), shape, jnp.bfloat16)
    fused = jax.jit(lambda q, k, v, do: mf.flash_attention_bwd(
        q, k, v, *mg.flash_attention(q, k, v, causal=c["causal"]), do, causal=c["causal"]))
    for _ in range(args.calls):
      dq, _, _ = fused(q, k, v, ct)
    ref = jax.grad(lambda q: jnp.sum(jax.nn.dot_product_attention(
        q, k, v, is_causal=c["causal"], implementation="cudnn").astype(jnp.float32)
        * ct.astype(jnp.float32)))(q)
    err = float(jnp.max(jnp.abs(dq.astype(jnp.float32) - ref.astype(jnp.float32))))
    print(f"case {args.case} (fused bwd): max abs dq diff vs cuDNN {err:.4g}", flush=True)
    return err
  if args.bwd:
    import jattn
    loss = lambda q, k, v: jnp.sum(jattn.flash_attention(
        q, k, v, causal=c["causal"], local_window_size=c["window"],
        implementation="mosaic_gpu").astype(jnp.float32) * ct)
    ct = jax.random.normal(jax.random.key(1), shape, jnp.float32)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    for _ in range(args.calls):
      dq, _, _ = grad(q, k, v)
    ref = jax.grad(lambda q, k, v: jnp.sum(jax.nn.dot_product_attention(
        q, k, v, is_causal=c["causal"], local_window_size=c["window"],
        implementation="cudnn").astype(jnp.float32) * ct))(q, k, v)
    err = float(jnp.max(jnp.abs(dq.astype(jnp.float32) - ref.astype(jnp.float32))))
    print(f"case {args.case} (bwd): max abs dq diff vs cuDNN {err:.4g}", flush=True)
    return err
  out = None
  for _ in range(args.calls):
    out = fn(q, k, v)
  out.block_until_ready()
  if args.time:
    from pallas_kernels._timing import random_sets, time_fn
    ms, _ = time_fn(fn, random_sets([shape] * 3, jnp.bfloat16, num_sets=3))
    print(f"case {args.case}: {ms:.4f} ms (bench timer)", flush=True)
  if docs:   # each document alone: [B * docs, S / docs, H, D] causal
    split = lambda x: x.reshape(c["b"] * docs, c["s"] // docs, *shape[2:])
    ref = jax.nn.dot_product_attention(split(q), split(k), split(v), is_causal=True,
                                       implementation="cudnn").reshape(shape)
  else:
    ref = jax.nn.dot_product_attention(q, k, v, is_causal=c["causal"],
                                       local_window_size=c["window"], implementation="cudnn")
  err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
  print(f"case {args.case}: max abs diff vs cuDNN {err:.4g}", flush=True)
  return err


if __name__ == "__main__":
  main()
