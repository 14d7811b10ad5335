"""Sparse benchmark cases (moved out of the library; to be folded into the benchmark command)."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from jattn.sparse import *  # noqa: F401,F403
# ----------------------------------------------------------------------------- benchmarks
def causal_top_k_for_density(seq_len, fraction, *, block_size, q_block_size, num_init_blocks=1,
                             num_local_blocks=1):
  """The top_k whose causal selection keeps about ``fraction`` of the causal (visible) tiles.

  Query block i keeps its forced (initial + local) blocks plus min(top_k, remaining visible);
  the returned top_k makes the kept total closest to fraction * visible total.

  Args:
    seq_len: query and key length (self-attention).
    fraction: target fraction of causally visible tiles, e.g. 0.19.
    block_size, q_block_size: selection block sizes.
    num_init_blocks, num_local_blocks: always-kept blocks.

  Returns:
    (top_k, achieved_fraction).

  Example:
    >>> causal_top_k_for_density(65536, 0.19, block_size=128, q_block_size=128)[0]
    49
  """
  n_vis, n_forced, _, _ = _static_counts(seq_len, seq_len, q_block_size, block_size, True,
                                         num_init_blocks, num_local_blocks, 0)
  n_cand = n_vis - n_forced
  ks = np.arange(_cdiv(seq_len, block_size) + 1)
  kept = (n_forced[None, :] + np.minimum(ks[:, None], n_cand[None, :])).sum(1) / n_vis.sum()
  k = int(np.argmin(np.abs(kept - fraction)))
  return k, float(kept[k])


def bench_cases(time_fn, rel_err, *, seqs=(16384, 65536), heads=16, head_dim=128,
                configs=((128, 64), (128, 128)), fraction=0.19, implementation="triton",
                decode_len=131072, decode_heads=(32, 8), decode_block_size=64,
                ste_seqs=(16384,), extra_impls=()):
  """H200 benchmark rows for ``experiments/bench_kernels.py --ops sparse``.

  Training (B1, H16, D128, bf16, causal): dense ``flash_attention(causal=True)`` versus
  ``sparse_attention(gate_grad="none")``, forward+backward, the sparse time including scoring,
  top-k and schedule building, keeping ~19% of the causal tiles (top_k from
  :func:`causal_top_k_for_density`). Block configs (q_block_size, block_size): (128, 64) first,
  the Triton kernel's default 128x64 tile and InfLLM's 64-token key blocks (the recommended
  setting), then (128, 128) (FlexAttention's block size in the anchors).
  Rows: op "sparse_fwdbwd" (dense and sparse ms), "sparse_select" (scoring + top-k + schedule ms
  and its fraction of the sparse time), "sparse_speedup" (dense / sparse); at ``ste_seqs`` also
  the gate_grad="ste" fwd+bwd time (its extra XLA gate-gradient pass).
  Each of ``extra_impls`` (e.g. "mosaic_gpu": the Hopper forward and, at D64/D128, the Mosaic
  GPU backward walking the same selection's schedule) is timed on the same inputs right after
  ``implementation``'s sparse row: op "sparse_fwdbwd", impl ``jattn_<name>_sparse`` (its forward
  checked like the first; its gradients compared with ``implementation``'s, ``grad_rel_err``;
  ``vs_sparse``: ``implementation``'s sparse ms / its ms) and op "sparse_speedup" against the
  same dense row (``speedup``) and against its own dense causal kernel (a
  ``jattn_<name>_dense`` row timed after the first dense one: ``speedup_vs_own_dense``).
  A failure is recorded as a row with ok False.
  Decode (B1, GQA 32:8, D128, bf16, 128K, 64-token blocks, ~19% of blocks): dense
  ``jattn.decode.decode_attention`` vs :func:`sparse_decode_attention` ("triton" and "xla"),
  selection included; op "sparse_decode" and "sparse_decode_speedup".

  Args:
    time_fn: ``time_fn(fn, arg_sets) -> (median_ms, spread_ms)`` (bench_kernels.time_fn).
    rel_err: ``rel_err(x, ref) -> float``.
    seqs, heads, head_dim, configs, fraction, implementation: training cases.
    ste_seqs: sequence lengths at which the STE variant is timed too (first config only).
    extra_impls: further implementations timed on the sparse training cases (not decode).
    decode_len, decode_heads, decode_block_size: the decode case.

  Returns:
    A list of row dicts (op, case, impl, ms, speedup, rel_err, ok, ...).

  Example:
    >>> rows = bench_cases(time_fn, rel_err)   # doctest: +SKIP
  """
  rows = []
  for s in seqs:
    keys = jax.random.split(jax.random.key(s), 12)
    sets = [tuple(jax.random.normal(keys[4 * i + j], (1, s, heads, head_dim), jnp.bfloat16)
                  for j in range(4)) for i in range(3)]

    def fwdbwd(attn):
      def f(q, k, v, do):
        out, vjp = jax.vjp(attn, q, k, v)
        return out, vjp(do)
      return jax.jit(f)

    base = f"B1 S{s // 1024}K H{heads} D{head_dim} causal"
    try:
      dense = fwdbwd(lambda q, k, v: _dense_flash(q, k, v, implementation))
      ms_dense, sp_dense = time_fn(dense, sets)
      rows.append(dict(op="sparse_fwdbwd", case=base, impl=f"jattn_{implementation}_dense",
                       ms=ms_dense, spread_ms=sp_dense))
    except Exception as e:
      rows.append(dict(op="sparse_fwdbwd", case=base, impl=f"jattn_{implementation}_dense",
                       ok=False, error=f"{type(e).__name__}: {e}"[:500]))
      continue
    dense_extra = {}   # each extra implementation's own dense causal kernel (e.g. Hopper's)
    for extra in extra_impls:
      try:
        ms_x, sp_x = time_fn(fwdbwd(lambda q, k, v, extra=extra: _dense_flash(q, k, v, extra)),
                             sets)
        dense_extra[extra] = ms_x
        rows.append(dict(op="sparse_fwdbwd", case=base, impl=f"jattn_{extra}_dense", ms=ms_x,
                         spread_ms=sp_x))
      except Exception as e:
        rows.append(dict(op="sparse_fwdbwd", case=base, impl=f"jattn_{extra}_dense", ok=False,
                         error=f"{type(e).__name__}: {e}"[:500]))
    for qbs, bs in configs:
      top_k, frac = causal_top_k_for_density(s, fraction, block_size=bs, q_block_size=qbs)
      case = f"{base} top{fraction:.0%} q{qbs} k{bs}"
      kw = dict(block_size=bs, q_block_size=qbs, top_k=top_k, implementation=implementation)
      try:
        sparse = fwdbwd(lambda q, k, v: sparse_attention(q, k, v, **kw))

        def select_only(q, k, v, do):
          sel = select_blocks(q, k, block_size=bs, q_block_size=qbs, top_k=top_k)
          sched = make_schedule(s, s, qbs, bs, causal=True, block_mask=sel.tile_mask(),
                                max_kv_blocks=sel.max_selected)
          return sched.kv_indices, sched.q_indices

        # Correctness: last 512 queries of two heads against the fp32 reference.
        q, k, v, _ = sets[0]
        out, sel = jax.jit(lambda q, k, v: sparse_attention(q, k, v, return_selection=True,
                                                            **kw))(q, k, v)
        tail = 512
        nqt = tail // qbs
        sub = BlockSelection(indices=sel.indices[:, :2, -nqt:], counts=sel.counts[:, :2, -nqt:],
                             num_visible=sel.num_visible[:, :2, -nqt:], scores=None,
                             block_size=bs, q_block_size=qbs, q_len=tail, kv_len=s)
        ref = block_sparse_attention(q[:, -tail:, :2], k[:, :, :2], v[:, :, :2], sub,
                                     implementation="xla")
        err = rel_err(out[:, -tail:, :2], ref)
        ok = bool(err < 2e-2)
        ms_sparse, sp_sparse = time_fn(sparse, sets)
        ms_sel, _ = time_fn(jax.jit(select_only), sets)
        dens = float(sel.density("visible"))
        rows.append(dict(op="sparse_fwdbwd", case=case, impl=f"jattn_{implementation}_sparse",
                         ms=ms_sparse, spread_ms=sp_sparse, top_k=top_k, causal_fraction=dens,
                         rel_err=err, ok=ok))
        rows.append(dict(op="sparse_select", case=case, impl="jattn_xla", ms=ms_sel,
                         select_frac=ms_sel / ms_sparse))
        rows.append(dict(op="sparse_speedup", case=case, impl=f"jattn_{implementation}",
                         speedup=ms_dense / ms_sparse, dense_ms=ms_dense, sparse_ms=ms_sparse,
                         select_ms=ms_sel, causal_fraction=dens, ok=ok))
        for extra in extra_impls:
          rows += _bench_extra_sparse(extra, kw, fwdbwd, sparse, sets, time_fn, rel_err, case,
                                      ref, tail, ms_dense, ms_sparse, top_k, dens,
                                      ms_own_dense=dense_extra.get(extra))
        if s in ste_seqs and (qbs, bs) == tuple(configs[0]):
          ste = fwdbwd(lambda q, k, v: sparse_attention(q, k, v, gate_grad="ste", **kw))
          ms_ste, sp_ste = time_fn(ste, sets)
          rows.append(dict(op="sparse_fwdbwd", case=case,
                           impl=f"jattn_{implementation}_sparse_ste", ms=ms_ste,
                           spread_ms=sp_ste, ste_overhead=ms_ste / ms_sparse))
      except Exception as e:  # record the failure, keep benchmarking
        rows.append(dict(op="sparse_speedup", case=case, impl=f"jattn_{implementation}",
                         ok=False, error=f"{type(e).__name__}: {e}"[:500]))

  # Decode at 128K.
  hq, hk = decode_heads
  n = decode_len
  nb = n // decode_block_size
  top_k = max(0, int(round(fraction * nb)) - 2)
  case = f"B1 S{n // 1024}K GQA{hq}:{hk} D{head_dim} top{fraction:.0%} blk{decode_block_size}"
  try:
    keys = jax.random.split(jax.random.key(7), 9)
    lens = jnp.array([n], jnp.int32)
    sets = []
    for i in range(3):
      q = jax.random.normal(keys[3 * i], (1, hq, head_dim), jnp.bfloat16)
      kc = jax.random.normal(keys[3 * i + 1], (1, n, hk, head_dim), jnp.bfloat16)
      vc = jax.random.normal(keys[3 * i + 2], (1, n, hk, head_dim), jnp.bfloat16)
      sets.append((q, kc, vc, init_block_summaries(kc, lens, block_size=decode_block_size)))
    q, kc, vc, summ = sets[0]
    _, idx = sparse_decode_attention(q, kc, vc, lens, summ, block_size=decode_block_size,
                                     top_k=top_k, implementation="xla", return_indices=True)
    sel = jnp.zeros((1, hk, nb + 1), bool).at[0, jnp.arange(hk)[:, None],
                                               jnp.where(idx[0] < 0, nb, idx[0])].set(True)
    mask = jnp.repeat(sel[..., :nb], decode_block_size, axis=-1)[:, :, None, :]
    ref, _ = attention_reference(q[:, None], kc, vc, block_mask=mask)
    ref = ref[:, 0]
    ms_dense = None
    try:
      from jattn import decode as dec
      dense = jax.jit(lambda q, kc, vc, summ: dec.decode_attention(q, kc, vc, lens,
                                                                   implementation=implementation))
      ms_dense, sp_dense = time_fn(dense, sets)
      rows.append(dict(op="sparse_decode", case=case, impl=f"jattn_{implementation}_dense",
                       ms=ms_dense, spread_ms=sp_dense))
    except Exception as e:
      rows.append(dict(op="sparse_decode", case=case, impl=f"jattn_{implementation}_dense",
                       ok=False, error=f"{type(e).__name__}: {e}"[:500]))
    for impl in dict.fromkeys((implementation, "xla")):
      try:
        sparse = jax.jit(functools.partial(sparse_decode_attention, kv_lengths=lens,
                                           block_size=decode_block_size, top_k=top_k,
                                           implementation=impl))
        err = rel_err(sparse(q, kc, vc, block_summaries=summ), ref)
        ms_sparse, sp_sparse = time_fn(
            lambda q, kc, vc, summ: sparse(q, kc, vc, block_summaries=summ), sets)
        rows.append(dict(op="sparse_decode", case=case, impl=f"jattn_sparse_{impl}",
                         ms=ms_sparse, spread_ms=sp_sparse, top_k=top_k, rel_err=err,
                         ok=bool(err < 2e-2)))
        if ms_dense is not None:
          rows.append(dict(op="sparse_decode_speedup", case=case, impl=f"jattn_sparse_{impl}",
                           speedup=ms_dense / ms_sparse, dense_ms=ms_dense, sparse_ms=ms_sparse,
                           ok=bool(err < 2e-2)))
      except Exception as e:
        rows.append(dict(op="sparse_decode_speedup", case=case, impl=f"jattn_sparse_{impl}",
                         ok=False, error=f"{type(e).__name__}: {e}"[:500]))
  except Exception as e:
    rows.append(dict(op="sparse_decode_speedup", case=case, impl="jattn_sparse", ok=False,
                     error=f"{type(e).__name__}: {e}"[:500]))
  return rows


def _bench_extra_sparse(impl, kw, fwdbwd, base_fn, sets, time_fn, rel_err, case, ref, tail,
                        ms_dense, ms_base, top_k, dens, ms_own_dense=None):
  """``bench_cases``'s rows for one more implementation of the same sparse training case: its
  fwd+bwd time, forward error against ``ref`` (last ``tail`` queries of two heads), gradient
  error against the first implementation's (``base_fn``) and the speedups (against the first
  implementation's dense kernel, ``speedup``, and against its own, ``speedup_vs_own_dense``,
  when ``ms_own_dense`` was timed)."""
  name = f"jattn_{impl}_sparse"
  kw = dict(kw, implementation=impl)
  try:
    fn = fwdbwd(lambda q, k, v: sparse_attention(q, k, v, **kw))
    out, grads = fn(*sets[0])
    _, base_grads = base_fn(*sets[0])
    err = rel_err(out[:, -tail:, :2], ref)
    grad_err = max(rel_err(g, b) for g, b in zip(grads, base_grads))
    ok = bool(err < 2e-2 and grad_err < 2e-2)
    ms, spread = time_fn(fn, sets)
    return [dict(op="sparse_fwdbwd", case=case, impl=name, ms=ms, spread_ms=spread, top_k=top_k,
                 causal_fraction=dens, rel_err=err, grad_rel_err=grad_err, vs_sparse=ms_base / ms,
                 ok=ok),
            dict(op="sparse_speedup", case=case, impl=f"jattn_{impl}", speedup=ms_dense / ms,
                 dense_ms=ms_dense, sparse_ms=ms, causal_fraction=dens, ok=ok,
                 **({} if ms_own_dense is None else dict(
                     own_dense_ms=ms_own_dense, speedup_vs_own_dense=ms_own_dense / ms)))]
  except Exception as e:  # record the failure, keep benchmarking
    return [dict(op="sparse_fwdbwd", case=case, impl=name, ok=False,
                 error=f"{type(e).__name__}: {e}"[:500])]


def _dense_flash(q, k, v, implementation):
  """Dense causal flash attention (the bench baseline); see ``jattn.flash_attention``."""
  from jattn.attention import flash_attention
  return flash_attention(q, k, v, causal=True, implementation=implementation)

