"""Block-sparse attention on the Hopper path: ``block_sparse_attention(implementation="mosaic_gpu")``.

The Mosaic GPU forward walks the selection's block schedule
(``mosaic_gpu_fwd_kernel.schedule_walk``: per program the union of its two 64-row warpgroups'
kv lists, each entry run unmasked, masked or skipped per warpgroup); the backward walks the
same schedule: the Mosaic GPU dK/dV and dQ kernels at head_dim 64/128 (``mosaic_gpu_bwd``), the
Triton ones at head_dim 256.
On the CPU (the kernel cannot be interpreted, see tests/test_flash_mosaic_gpu.py):
  * the walk against an independent element mask restricted to the selection (every tile a
    warpgroup needs is listed, tiles it runs unmasked are fully visible, nothing is listed twice,
    nothing is loaded that neither warpgroup needs), on awkward shapes: q_len != kv_len, ragged
    lengths, GQA, packed segment ids with padding, non-causal, every way the schedule's tiles
    relate to the kernel's (64-row schedule tiles: two rows per program, merged; 128; 256 and
    256-key tiles split into kernel tiles);
  * a jnp replay of the kernel's walk of the packed rows (the kernel's own mask, soft-max and
    finalize helpers) against the fp32 reference restricted to the selection's mask;
  * forward + VJP through ``jattn.block_sparse_attention`` with the replay standing in for the
    kernel and the backward's kernels replayed (Mosaic GPU: tests/test_flash_mosaic_gpu_bwd.py's
    jnp replays) or interpreted (Triton); lowering for "cuda" of the kernel and of forward +
    backward (three Mosaic GPU calls); the errors.
Tests marked ``gpu`` run the compiled kernels on an sm90 GPU.
"""
from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jattn import sparse as sp
from pallas_kernels import compat
from pallas_kernels.block_schedule import make_schedule
from pallas_kernels.common import walk as wk
from pallas_kernels.flash import mosaic_gpu as mg
from pallas_kernels.flash import mosaic_gpu_fwd_kernel as fk
from pallas_kernels.flash.reference import attention_reference
from test_flash_mosaic_gpu import _replay_step
from tests.helpers import ci_cases

_FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _compiled(fn, *args):
  """fn(*args), compiled with cheap XLA:CPU codegen (test harness code that runs once)."""
  return jax.jit(fn).lower(*args).compile(_FAST_CPU_COMPILE)(*args)


def select(q, k, *, segment_ids=None, kv_segment_ids=None, **kw):
  return _compiled(lambda q, k, s, ks: sp.select_blocks(q, k, segment_ids=s, kv_segment_ids=ks,
                                                        **kw), q, k, segment_ids, kv_segment_ids)


def _rel(a, b):
  a = np.asarray(a, np.float32).astype(np.float64)
  b = np.asarray(b, np.float32).astype(np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _inputs(seed, b, sq, sk, hq, hk, d, dtype=jnp.bfloat16):
  """Standard normal q, k, v (numpy's generator: no per-shape compile on the CPU)."""
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
               for shape in ((b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, d)))


def _packed(name, b, n):
  """Packed documents of random lengths, the tail padded (id 0)."""
  rng = np.random.default_rng(zlib.crc32(name.encode()))
  seg = np.zeros((b, n), np.int32)
  for r in range(b):
    cuts = np.sort(rng.choice(np.arange(1, n), size=2, replace=False))
    seg[r] = np.searchsorted(cuts, np.arange(n), side="right") + 1
    seg[r, n - int(rng.integers(1, n // 6)):] = 0
  return seg


# (b, sq, sk, hq, hk, d, q_block_size, block_size, top_k, causal, segments)
CASES = {
    # 64-row selection blocks: each program merges two rows (the union path)
    "q64_k64_causal_ragged_gqa": (2, 300, 300, 4, 2, 64, 64, 64, 1, True, False),
    "q64_k128_q_shorter": (1, 200, 457, 4, 2, 64, 64, 128, 1, True, False),
    # 128-row blocks = one program: one list for both warpgroups (the benchmark's layout)
    "q128_k64_segments_gqa": (2, 520, 520, 4, 2, 128, 128, 64, 2, True, True),
    "q128_k128_q_longer_empty_rows": (1, 600, 520, 2, 1, 64, 128, 128, 1, True, False),
    "q128_k64_non_causal": (1, 333, 333, 4, 2, 128, 128, 64, 2, False, False),
    # 256-row / 256-key blocks: programs share a row, schedule tiles split into kernel tiles
    "q256_k256_segments_ragged": (2, 1300, 1300, 2, 2, 128, 256, 256, 1, True, True),
}


@functools.lru_cache(maxsize=None)   # inputs and selection built once per session
def _case(name, dtype=jnp.bfloat16):
  b, sq, sk, hq, hk, d, qbs, bs, top_k, causal, segs = CASES[name]
  q, k, v = _inputs(zlib.crc32(name.encode()), b, sq, sk, hq, hk, d, dtype)
  q_seg = kv_seg = None
  if segs:
    kv_seg = jnp.asarray(_packed(name, b, sk))
    q_seg = kv_seg[:, sk - sq:]
  sel = select(q, k, block_size=bs, q_block_size=qbs, top_k=top_k, causal=causal,
               segment_ids=q_seg, kv_segment_ids=kv_seg)
  # Some selectable tile must be dropped, or a kernel ignoring the selection would pass.
  counts = np.asarray(sel.counts)
  assert counts.sum() < np.broadcast_to(np.asarray(sel.num_visible), counts.shape).sum()
  return q, k, v, q_seg, kv_seg, sel, causal


def _configs(q_block_size, block_size, d, dtype=jnp.bfloat16, **kw):
  """(forward, backward) configs of ``block_sparse_plan(implementation="mosaic_gpu")``."""
  x = jax.ShapeDtypeStruct((1, 1024, 2, d), dtype)
  kw = {n: jax.ShapeDtypeStruct(x.shape[:2], jnp.int32) if "segment" in n and a is not None
        else a for n, a in kw.items()}                       # the plan validates their shape
  plan = sp.block_sparse_plan(x, x, x, q_block_size=q_block_size, block_size=block_size,
                              implementation="mosaic_gpu", **kw)
  return plan.config, plan.backward_config


def _walk_of(q, k, q_seg, kv_seg, sel, causal):
  """(st, walk) exactly as ``block_sparse_attention(implementation="mosaic_gpu")`` builds them."""
  fwd_bs, bwd_bs = _configs(sel.q_block_size, sel.block_size, q.shape[-1], q.dtype,
                            causal=causal, segment_ids=q_seg)
  sq, sk = q.shape[1], k.shape[1]
  sched_of = lambda sel, q_seg, kv_seg: make_schedule(
      sq, sk, sel.q_block_size, sel.block_size, causal=causal, q_segment_ids=q_seg,
      kv_segment_ids=kv_seg, block_mask=sel.tile_mask(), max_kv_blocks=sel.max_selected)
  st = mg._static_config(q.shape, k.shape, q.dtype, causal=causal, scale=None,
                         block_sizes=fwd_bs, bwd_block_sizes=bwd_bs,
                         has_seg=q_seg is not None,
                         schedule=jax.eval_shape(sched_of, sel, q_seg, kv_seg))
  sq_pad, sk_pad = st.num_q_programs * 2 * st.block_q, st.num_kv_tiles * st.block_k
  pad = lambda x, n: None if x is None else jnp.pad(x, ((0, 0), (0, n - x.shape[1])))
  walk = _compiled(lambda sel, q_seg, kv_seg: fk.schedule_walk(
      sched_of(sel, q_seg, kv_seg), st, pad(q_seg, sq_pad), pad(kv_seg, sk_pad)),
      sel, q_seg, kv_seg)
  return st, np.asarray(walk)


def _tile_mask(sel):
  """numpy bool [B, Hk, nq, nk]: the selection's kept blocks (``BlockSelection.tile_mask``)."""
  idx = np.asarray(sel.indices)
  tm = np.zeros(idx.shape[:3] + (sel.num_kv_blocks + 1,), bool)
  np.put_along_axis(tm, np.where(idx < 0, sel.num_kv_blocks, idx), True, axis=-1)
  return tm[..., :-1]


@functools.lru_cache(maxsize=None)
def _case_walk(name):
  """(st, walk) of a case (cached; callers copy before editing)."""
  q, k, v, q_seg, kv_seg, sel, causal = _case(name)
  return _walk_of(q, k, q_seg, kv_seg, sel, causal)


def _decode(row):
  n = int(row[0])
  e = row[1:1 + n]
  return n, e >> wk.WALK_SHIFT, e & 3, (e >> 2) & 3


def _check_sched_walk(st, walk, sel, q_seg, kv_seg, *, tight):
  """The walk against the element mask (``masks.element_mask``) & the selection's mask."""
  from pallas_kernels.masks import element_mask
  bq, bk, sq, sk = st.block_q, st.block_k, st.q_len, st.kv_len
  n_prog, nk = st.num_q_programs, st.num_kv_tiles
  sq_pad, sk_pad = n_prog * 2 * bq, nk * bk
  seg = q_seg is not None
  pad = lambda x, n: None if x is None else np.pad(np.asarray(x), ((0, 0), (0, n - x.shape[1])))
  vis = np.asarray(_compiled(lambda qs, ks: element_mask(
      jnp.arange(sq_pad) + (sk - sq), jnp.arange(sk_pad), causal=st.causal, window=st.window,
      kv_len=sk, q_seg=qs, kv_seg=ks), pad(q_seg, sq_pad), pad(kv_seg, sk_pad)))
  if not seg:
    vis = vis[None]
  blk = np.repeat(np.repeat(_tile_mask(sel), sel.q_block_size, 2), sel.block_size, 3)
  blk = np.pad(blk[:, :, :sq, :sk], ((0, 0), (0, 0), (0, sq_pad - sq), (0, sk_pad - sk)))
  real = (np.arange(sq_pad) < sq)
  allowed = vis[:, None] & blk & real[None, None, :, None]                     # [B, Hk, Sq', Sk']
  b, hk = blk.shape[:2]
  t6 = allowed.reshape(b, hk, 2 * n_prog, bq, nk, bk)
  any_t = t6.any(axis=(3, 5))                                         # [B, Hk, wg tiles, nk]
  all_t = (t6 | ~real.reshape(1, 1, -1, bq, 1, 1)).all(axis=(3, 5))
  compacted = not (sel.q_block_size == 2 * bq and sel.block_size == bk)
  for bi in range(b):
    for h in range(hk):
      for p in range(n_prog):
        row = walk[bi if walk.shape[0] > 1 else 0, h if walk.shape[1] > 1 else 0, p]
        n, t, c0, c1 = _decode(row)
        where = (bi, h, p, t.tolist(), c0.tolist(), c1.tolist())
        assert n <= walk.shape[-1] - 1 and len(set(t.tolist())) == n, where    # no repeats
        assert ((t >= 0) & (t < nk)).all(), where
        assert set(c0.tolist()) <= {0, 1, 2} and set(c1.tolist()) <= {0, 1, 2}, where
        if compacted:   # nothing is loaded that neither warpgroup needs
          assert ((c0 | c1) != 0).all(), where
        for wg, c in ((0, c0), (1, c1)):
          i = 2 * p + wg
          need = set(np.nonzero(any_t[bi, h, i])[0].tolist())
          listed = set(t[c != 0].tolist())
          assert need <= listed, (where, wg, need - listed)                   # nothing skipped
          assert all_t[bi, h, i, t[c == 1]].all(), (where, wg)                 # unmasked: visible
          if tight:
            assert listed <= need, (where, wg, listed - need)


def test_walk_check_can_fail():
  """The walk check catches a dropped entry and a partial tile marked full."""
  q, k, v, q_seg, kv_seg, sel, causal = _case("q128_k64_segments_gqa")
  st, walk = _case_walk("q128_k64_segments_gqa")
  partial = [int(((_decode(walk[0, 0, p])[2] == 2)).sum()) for p in range(st.num_q_programs)]
  p = int(np.argmax(partial))                                       # a program with masked tiles
  assert partial[p] > 0
  dropped = walk.copy()
  dropped[:, :, p, 0] -= 1                                          # forget the last entry
  with pytest.raises(AssertionError):
    _check_sched_walk(st, dropped, sel, q_seg, kv_seg, tight=False)
  full = walk.copy()
  n = full[0, 0, p, 0]
  full[0, 0, p, 1:1 + n] = (full[0, 0, p, 1:1 + n] >> 4 << 4) | 1 | (1 << 2)   # all "full"
  with pytest.raises(AssertionError):
    _check_sched_walk(st, full, sel, q_seg, kv_seg, tight=False)


# ------------------------------------------------------------------ replay of the kernel's walk


def _replayed_sched_call(q_p, k_p, v_p, st, q_seg=None, kv_seg=None, bounds=None,
                         walk_rows=None):
  """Stand-in for ``fk.fwd_call`` in schedule mode: a jnp replay of the kernel's walk of the
  packed rows (entry order, per-warpgroup codes: skip / unmasked / masked step with the kernel's
  ``_tile_visible``, ``_cap_logits``, ``_online_softmax``, P cast to the input dtype,
  ``_finalize``), on the padded inputs, returning the padded shapes."""
  walk = walk_rows
  assert st.has_sched and walk is not None and bounds is None
  b, sq_pad, hq, d = q_p.shape
  bq, n_prog = st.block_q, st.num_q_programs
  heads = jnp.arange(hq) // st.group
  kp = k_p[:, :, heads].transpose(0, 2, 1, 3)                        # [B, Hq, Sk', D]
  vp = v_p[:, :, heads].transpose(0, 2, 1, 3)
  qt = q_p.transpose(0, 2, 1, 3).reshape(b, hq, n_prog, 2, bq, d)
  wrows = walk[jnp.arange(b) if walk.shape[0] > 1 else jnp.zeros(b, jnp.int32)]
  wrows = wrows[:, heads if walk.shape[1] > 1 else jnp.zeros(hq, jnp.int32)]   # [B, Hq, P, W]
  has_seg = q_seg is not None
  qs = (q_seg if has_seg else jnp.zeros((b, sq_pad), jnp.int32)).reshape(b, n_prog, 2, bq)
  ks = kv_seg if has_seg else jnp.zeros((b, k_p.shape[1]), jnp.int32)

  def warpgroup(q_t, k_all, v_all, wrow, p, wg, qs_t, ks_all):
    step = functools.partial(_replay_step, st=st, q_t=q_t, k_all=k_all, v_all=v_all,
                             row0=(2 * p + wg) * bq, qs_t=qs_t if has_seg else None,
                             ks_all=ks_all, p_dtype=q_p.dtype)

    def body(j, carry):
      entry = wrow[1 + j]
      t = entry >> wk.WALK_SHIFT
      code = (entry >> (2 * wg)) & 3
      return lax.switch(code, [lambda c: c, lambda c: step(t, c, masked=False),
                               lambda c: step(t, c, masked=True)], carry)

    carry = (jnp.zeros((bq, d), jnp.float32), jnp.full((bq,), fk._M_INIT, jnp.float32),
             jnp.zeros((bq,), jnp.float32))
    return fk._finalize(*lax.fori_loop(0, wrow[0], body, carry))

  per_wg = jax.vmap(warpgroup, in_axes=(0, None, None, None, None, 0, 0, None))
  per_prog = jax.vmap(per_wg, in_axes=(0, None, None, 0, 0, None, 0, None))
  per_head = jax.vmap(per_prog, in_axes=(0, 0, 0, 0, None, None, None, None))
  per_batch = jax.vmap(per_head, in_axes=(0, 0, 0, 0, None, None, 0, 0))
  out, lse = per_batch(qt, kp, vp, wrows, jnp.arange(n_prog), jnp.arange(2), qs, ks)
  out = out.reshape(b, hq, sq_pad, d).transpose(0, 2, 1, 3).astype(q_p.dtype)
  return out, lse.reshape(b, hq, sq_pad)


def _reference(q, k, v, q_seg, kv_seg, sel, causal, scale=None):
  up = lambda x: x.astype(jnp.float32)
  return attention_reference(up(q), up(k), up(v), causal=causal, q_segment_ids=q_seg,
                             kv_segment_ids=kv_seg, scale=scale, block_mask=sel.to_mask())


@pytest.mark.parametrize("name", ci_cases(CASES, [
    "q64_k64_causal_ragged_gqa", "q128_k64_non_causal", "q128_k128_q_longer_empty_rows",
    "q128_k64_segments_gqa"]))
def test_walk_and_replay_match_the_selection(name, monkeypatch):
  """The walk covers exactly the selection's visible tiles (``_check_sched_walk``); then
  ``block_sparse_attention(implementation="mosaic_gpu")``'s forward, with the replay in place of
  the kernel: out and LSE against the fp32 reference restricted to the selection's mask (rows
  that see no key: output 0, LSE -inf)."""
  q, k, v, q_seg, kv_seg, sel, causal = _case(name)
  st, walk = _case_walk(name)
  assert st.has_sched and st.sched_heads == (k.shape[2] > 1)
  # Without segment ids the walk is exact: a warpgroup lists a tile iff one of its rows sees
  # one of its keys (tight); with them, per-tile min/max ids may list a tile no row sees.
  _check_sched_walk(st, walk, sel, q_seg, kv_seg, tight=q_seg is None)
  tm = _tile_mask(sel)
  if sel.q_block_size == st.block_q:
    # 64-row schedule rows: a program's list is the union of its two rows, in order, each tile
    # once with both warpgroups' codes.
    both = 0
    for p in range(st.num_q_programs):
      n, t, c0, c1 = _decode(walk[0, 0, p])
      rows = [2 * p + w for w in range(2) if 2 * p + w < tm.shape[2]]
      assert set(t.tolist()) <= set(np.nonzero(tm[0, 0, rows].any(0))[0].tolist())
      assert list(t) == sorted(t)
      both += int(((c0 != 0) & (c1 != 0)).sum())
    assert both > 0
  if sel.block_size > st.block_k:
    # Wide schedule tiles: each kept block is walked as its kernel tiles.
    r = sel.block_size // st.block_k
    for p in range(st.num_q_programs):
      n, t, _, _ = _decode(walk[0, 0, p])
      blocks = set(np.nonzero(tm[0, 0, p * 2 * st.block_q // sel.q_block_size])[0].tolist())
      assert set((t // r).tolist()) <= blocks
      assert n == 0 or all(any(r * j + i in t for i in range(r)) for j in blocks)
  monkeypatch.setattr(fk, "fwd_call", _replayed_sched_call)
  run = lambda q, k, v: sp.block_sparse_attention(
      q, k, v, sel, causal=causal, segment_ids=q_seg, kv_segment_ids=kv_seg, return_lse=True,
      implementation="mosaic_gpu")
  out, lse = _compiled(run, q, k, v)
  r_out, r_lse = _compiled(lambda q, k, v: _reference(q, k, v, q_seg, kv_seg, sel, causal),
                           q, k, v)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert _rel(out, r_out) < 2e-2, _rel(out, r_out)
  lse, r_lse = np.asarray(lse), np.asarray(r_lse)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(r_lse))
  fin = np.isfinite(r_lse)
  assert _rel(np.where(fin, lse, 0.0), np.where(fin, r_lse, 0.0)) < 2e-2
  if (~fin).any():
    assert (np.asarray(out, np.float32).transpose(0, 2, 1, 3)[~fin] == 0).all()


def test_replay_check_can_fail(monkeypatch):
  """A walk whose codes are all "full" (no element mask: keys past the causal diagonal and of
  other documents leak in) fails the comparison."""
  def unmasked(q_p, k_p, v_p, st, q_seg=None, kv_seg=None, bounds=None, walk_rows=None):
    walk = walk_rows
    j = jnp.arange(walk.shape[-1])
    n = walk[..., :1]
    listed = (j >= 1) & (j <= n)
    walk = jnp.where(listed, (walk >> wk.WALK_SHIFT << wk.WALK_SHIFT) | 5, walk)
    return _replayed_sched_call(q_p, k_p, v_p, st, q_seg, kv_seg, bounds, walk)
  monkeypatch.setattr(fk, "fwd_call", unmasked)
  q, k, v, q_seg, kv_seg, sel, causal = _case("q128_k64_segments_gqa")
  out = _compiled(lambda q, k, v: sp.block_sparse_attention(
      q, k, v, sel, causal=causal, segment_ids=q_seg, implementation="mosaic_gpu"), q, k, v)
  r_out, _ = _compiled(lambda q, k, v: _reference(q, k, v, q_seg, kv_seg, sel, causal), q, k, v)
  assert _rel(out, r_out) > 0.1


VJP_CASES = ["q128_k64_segments_gqa", "q64_k128_q_shorter"]


@pytest.mark.parametrize("name,backward", ci_cases(
    [(n, b) for n in VJP_CASES for b in ("mosaic", "triton")],
    [("q64_k128_q_shorter", "mosaic"), ("q64_k128_q_shorter", "triton")]))
def test_vjp_walks_the_selection_in_the_backward(name, backward, monkeypatch):
  """Forward (replay) + the backward on the selection's schedule: the VJP of (out, lse) matches
  the fp32 reference's. "mosaic": jattn's default at head_dim 64/128, the Mosaic GPU backward's
  kernels (jnp replays of ``mosaic_gpu_bwd``) walking the schedule's lists; "triton": the Triton
  backward (interpreted; jattn's at head_dim 256) on the schedule's tiles."""
  from pallas_kernels.flash import mosaic_gpu_bwd as mb
  from pallas_kernels.flash import triton as ft
  from test_flash_mosaic_gpu_bwd import _replay_dkv_call, _replay_dq_call
  monkeypatch.setattr(fk, "fwd_call", _replayed_sched_call)
  tiles = []
  if backward == "mosaic":
    record = lambda replay: lambda *a: tiles.append(a[6].has_sched) or replay(*a)
    monkeypatch.setattr(mb, "_dkv_call", record(_replay_dkv_call))
    monkeypatch.setattr(mb, "_dq_call", record(_replay_dq_call))
  else:
    real_bwd = ft._bwd_calls
    st_of = lambda a: next(x for x in a if hasattr(x, "block_q"))   # the backward's statics
    monkeypatch.setattr(ft, "_bwd_calls", lambda *a: tiles.append((st_of(a).block_q,
                                                                   st_of(a).block_k))
                        or real_bwd(*a))
    import jattn.attention
    monkeypatch.setattr(jattn.attention, "MOSAIC_GPU_BWD_HEAD_DIMS", ())   # Triton's for all
  q, k, v, q_seg, kv_seg, sel, causal = _case(name)
  ks = jax.random.split(jax.random.key(3), 2)
  d_out = jax.random.normal(ks[0], q.shape, q.dtype)
  d_lse = jax.random.normal(ks[1], (q.shape[0], q.shape[2], q.shape[1]), jnp.float32)

  def kernel(q, k, v):
    f = lambda q, k, v: sp.block_sparse_attention(
        q, k, v, sel, causal=causal, segment_ids=q_seg, kv_segment_ids=kv_seg, return_lse=True,
        implementation="mosaic_gpu", interpret=True)
    (out, lse), vjp = jax.vjp(f, q, k, v)
    return out, lse, vjp((d_out, d_lse))

  def ref(q, k, v):
    up = lambda x: x.astype(jnp.float32)
    f = lambda q, k, v: _reference(q, k, v, q_seg, kv_seg, sel, causal)
    (out, lse), vjp = jax.vjp(f, up(q), up(k), up(v))
    return out, lse, vjp((up(d_out), d_lse))

  out, lse, grads = _compiled(kernel, q, k, v)
  r_out, r_lse, r_grads = _compiled(ref, q, k, v)
  assert tiles == ([True, True] if backward == "mosaic" else
                   [(sel.q_block_size, sel.block_size)])
  assert _rel(out, r_out) < 2e-2
  fin = np.isfinite(np.asarray(r_lse))
  assert _rel(np.where(fin, lse, 0.0), np.where(fin, r_lse, 0.0)) < 2e-2
  for nm, g, r in zip("qkv", grads, r_grads):
    assert g.shape == r.shape and g.dtype == q.dtype, nm
    assert _rel(g, r) < 2e-2, (nm, _rel(g, r))


# ------------------------------------------------------------------------------ lowering (CPU)

LOWER_CASES = {
    "d128_q128_k64_gqa": dict(sq=1000, sk=1000, hq=4, hk=2, d=128, qbs=128, bs=64),
    "d64_q64_k128_segments_q_shorter": dict(sq=300, sk=500, hq=2, hk=1, d=64, qbs=64, bs=128,
                                            seg=True),
    "d256_q256_k256_handoff_kwait": dict(sq=640, sk=640, hq=2, hk=2, d=256, qbs=256, bs=256,
                                         protocol="handoff_kwait"),
}


@pytest.mark.parametrize("name", list(LOWER_CASES))
def test_kernel_with_schedule_lowers_for_cuda(name):
  """The schedule-walking kernel lowers for "cuda" (jax.export: the Mosaic GPU lowering with the
  per-entry branches around wgmma, register layouts, shared memory)."""
  c = dict(LOWER_CASES[name])
  b, sq, sk, hq, hk, d = 2, c["sq"], c["sk"], c["hq"], c["hk"], c["d"]
  base = mg.default_block_sizes(d)
  bs = mg.BlockSizes(base.block_q, min(base.block_k, c["bs"]), base.num_stages,
                     protocol=c.get("protocol", "pingpong"))
  nq, nk = -(-sq // c["qbs"]), -(-sk // c["bs"])
  shapes = [jax.ShapeDtypeStruct((b, sq, hq, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((b, sk, hk, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((b, sk, hk, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((b, hk, nq, nk), jnp.bool_)]
  if c.get("seg"):
    shapes += [jax.ShapeDtypeStruct((b, sq), jnp.int32), jax.ShapeDtypeStruct((b, sk), jnp.int32)]

  def fn(q, k, v, keep, *segs):
    s = make_schedule(sq, sk, c["qbs"], c["bs"], causal=True, block_mask=keep,
                      q_segment_ids=segs[0] if segs else None,
                      kv_segment_ids=segs[1] if segs else None)
    return mg.flash_attention(q, k, v, *segs, schedule=s, causal=True, block_sizes=bs)
  exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(*shapes)
  text = exported.mlir_module()
  assert "mosaic_gpu" in text
  assert [a.shape for a in exported.out_avals] == [(b, sq, hq, d), (b, hq, sq)]


@pytest.mark.parametrize("gate_grad", ["none", "ste"])
def test_sparse_fwd_bwd_lowers_for_cuda(gate_grad):
  """jax.grad through ``sparse_attention(implementation="mosaic_gpu")`` (selection + block-sparse
  attention) lowers for "cuda": the selection's top-k kernel (Triton), the Mosaic GPU forward
  and its two backward kernels, and with the STE gate the Triton gate-gradient kernel."""
  q = jax.ShapeDtypeStruct((1, 2048, 4, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 2048, 2, 128), jnp.bfloat16)
  loss = lambda q, k, v: sp.sparse_attention(
      q, k, v, block_size=64, q_block_size=128, top_k=3, gate_grad=gate_grad,
      implementation="mosaic_gpu").astype(jnp.float32).sum()
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("mosaic_gpu_v2") == 3 or text.count("@mosaic_gpu") == 3
  calls = [ln for ln in text.splitlines()
           if "__gpu$xla.gpu.triton" in ln or "triton_kernel_call_ffi" in ln]
  top_k = [ln for ln in calls if "jattn_top_k_mask" in ln]
  assert len(top_k) == 1, len(top_k)
  assert len(calls) - 1 == (0 if gate_grad == "none" else 1), len(calls)


# ------------------------------------------------------------------------------------ errors


def test_unsupported_block_sizes_and_options_raise():
  """Errors at trace time (shapes only): block sizes the kernels cannot walk name the allowed
  sizes; fp32 and interpret=True raise NotImplementedError naming them."""
  q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 256, 1, 64), jnp.bfloat16)
  f32 = lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32)
  sel_of = lambda qbs, bs: jax.eval_shape(functools.partial(
      sp.select_blocks, block_size=bs, q_block_size=qbs, top_k=1), q, k)
  attn = lambda q, k, sel, **kw: jax.eval_shape(lambda q, k, sel: sp.block_sparse_attention(
      q, k, k, sel, implementation="mosaic_gpu", **kw), q, k, sel)
  for qbs, bs, bad in ((32, 64, "q_block_size=32"), (64, 96, "block_size=96"),
                       (128, 16, "block_size=16")):
    with pytest.raises(ValueError, match=f"powers of two >= 64.*{bad}"):
      attn(q, k, sel_of(qbs, bs))
  sel = sel_of(128, 64)
  with pytest.raises(NotImplementedError, match="float32"):
    attn(f32(q), f32(k), sel)
  with pytest.raises(NotImplementedError, match="interpret"):
    attn(q, k, sel, interpret=True)
  # The kernel module: schedule tiles that are not multiples of the kernel's, a Triton backward
  # with other tiles, a Mosaic backward with tiles wider than the schedule's, other lengths.
  from pallas_kernels.flash import triton as ft
  sched = lambda bq, bk: jax.eval_shape(lambda: make_schedule(256, 256, bq, bk, causal=True))
  call = lambda q, s, **kw: jax.eval_shape(lambda q, k: mg.flash_attention(
      q, k, k, schedule=s, causal=True, **kw), q, k)
  with pytest.raises(ValueError, match="block_k=64"):
    call(q, sched(64, 64))                                            # kernel block_k 128
  with pytest.raises(ValueError, match="backward tiles"):
    call(q, sched(128, 128), bwd_block_sizes=ft.BlockSizes(64, 64))
  from pallas_kernels.flash import mosaic_gpu_bwd as mb
  with pytest.raises(ValueError, match="block_k_dq=256 does not divide the schedule's block_k"):
    call(q, sched(128, 128), bwd_block_sizes=mb.BlockSizes(64, 64, 64, 256))
  call(q, sched(128, 128), block_sizes=mg.BlockSizes(backward="mosaic"))   # fits its tiles
  with pytest.raises(ValueError, match="lengths"):
    call(jax.ShapeDtypeStruct((1, 200, 2, 64), jnp.bfloat16), sched(128, 128))


# ------------------------------------------------------------------------------- GPU (sm90)

# (b, s, hq, hk, d, q_block_size, block_size, top_k, segments, dtype)
GPU_CASES = {
    # the benchmark's layout (one list per program), packed documents, GQA
    "d128_q128_k64_segments_gqa": (2, 2048, 4, 2, 128, 128, 64, 4, True, jnp.bfloat16),
    # 128-key kernel tiles, ragged length
    "d128_q128_k128_ragged": (1, 2000, 4, 2, 128, 128, 128, 3, False, jnp.bfloat16),
    # 64-row selection blocks: each program merges two rows
    "d128_q64_k64_union_segments": (1, 1500, 2, 2, 128, 64, 64, 4, True, jnp.bfloat16),
    "d64_q128_k128_fp16": (1, 2048, 4, 1, 64, 128, 128, 3, False, jnp.float16),
    # 256-key blocks split into 128-key kernel tiles (64-key tiles in the Mosaic backward),
    # 256-row blocks shared by two programs (compacted lists); D256 (64-key kernel tiles): forward
    # only, its Triton backward tiles (D256) are the "triton" implementation's, untested on a GPU,
    # as are the Triton's at 256 x 256 (so the D64 case's VJP is checked against the reference
    # only).
    "d64_q256_k256_fp16": (1, 2048, 4, 1, 64, 256, 256, 2, False, jnp.float16),
    "d256_q128_k64_segments": (1, 1024, 2, 1, 256, 128, 64, 2, True, jnp.bfloat16),
    # no segment ids: the H200's D256 causal entry (the overlap) on the walk
    "d256_q128_k64": (1, 1024, 2, 1, 256, 128, 64, 2, False, jnp.bfloat16),
}
GPU_FORWARD_ONLY = ("d256_q128_k64_segments", "d256_q128_k64")
GPU_NO_TRITON_VJP = ("d64_q256_k256_fp16",)


def _gpu_case(name):
  if compat.gpu_compute_capability() != (9, 0):
    pytest.skip(f"needs sm90 (Hopper), got {compat.gpu_compute_capability()}")
  b, s, hq, hk, d, qbs, bs, top_k, segs, dtype = GPU_CASES[name]
  q, k, v = _inputs(zlib.crc32(name.encode()), b, s, s, hq, hk, d, dtype)
  seg = jnp.asarray(_packed(name, b, s)) if segs else None
  sel = jax.jit(functools.partial(sp.select_blocks, block_size=bs, q_block_size=qbs,
                                  top_k=top_k))(q, k, segment_ids=seg)
  return q, k, v, seg, sel, dtype


def _check_out_lse(out, lse, r_out, r_lse, dtype):
  assert out.dtype == dtype and _rel(out, r_out) < 2e-2, _rel(out, r_out)
  lse, r_lse = np.asarray(lse), np.asarray(r_lse)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(r_lse))
  fin = np.isfinite(r_lse)
  assert _rel(np.where(fin, lse, 0.0), np.where(fin, r_lse, 0.0)) < 2e-2


def test_mosaic_gpu_block_sizes_follow_the_mask_kind(monkeypatch):
  """The block-sparse Hopper forward takes the device table's entry for the call's mask kind
  (on the H200 at D128: the intra-warpgroup overlap for causal selections, also with segment
  ids), with at most 128 keys per kernel tile and never more than the selection's block."""
  from pallas_kernels import tuning
  monkeypatch.setattr(tuning, "device_kind", lambda: "NVIDIA H200")
  mg._tuned_block_sizes.cache_clear()
  try:
    got = {}
    for d, qbs, bs, seg in [(128, 128, 64, False), (128, 64, 64, True), (128, 128, 256, False),
                            (64, 256, 256, False), (256, 128, 64, False)]:
      fwd, _ = _configs(qbs, bs, d, causal=True,
                        segment_ids=jnp.ones((1, 1024), jnp.int32) if seg else None)
      got[d, qbs, bs, seg] = (fwd.block_k, fwd.num_stages, fwd.protocol == "overlap")
  finally:
    mg._tuned_block_sizes.cache_clear()
  assert got == {(128, 128, 64, False): (64, 2, True), (128, 64, 64, True): (64, 2, True),
                 (128, 128, 256, False): (128, 2, True), (64, 256, 256, False): (128, 3, False),
                 (256, 128, 64, False): (64, 2, True)}


# The default GPU run takes GPU_FAST; the other cases are marked slow.
GPU_FAST = ("d128_q128_k64_segments_gqa", "d128_q64_k64_union_segments", "d64_q256_k256_fp16",
            "d256_q128_k64_segments")



@pytest.mark.gpu
@pytest.mark.parametrize("name", ci_cases(GPU_CASES, GPU_FAST))
def test_gpu_block_sparse_mosaic_forward(name):
  """The compiled Mosaic GPU forward walking the selection vs the fp32 reference over it."""
  q, k, v, seg, sel, dtype = _gpu_case(name)
  out, lse = jax.jit(lambda q, k, v: sp.block_sparse_attention(
      q, k, v, sel, segment_ids=seg, return_lse=True, implementation="mosaic_gpu"))(q, k, v)
  r_out, r_lse = jax.jit(lambda q, k, v: _reference(q, k, v, seg, seg, sel, True))(q, k, v)
  _check_out_lse(out, lse, r_out, r_lse, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ci_cases([n for n in GPU_CASES if n not in GPU_FORWARD_ONLY],
                                          [n for n in GPU_FAST if n not in GPU_FORWARD_ONLY]))
def test_gpu_block_sparse_mosaic_vjp(name):
  """Mosaic GPU forward + backward on the selection (at head_dim 64/128 the Mosaic GPU backward
  walking the schedule's lists): the VJP of (out, lse) vs the fp32 reference's, and
  vs the "triton" implementation (same schedule, the Triton kernels)."""
  q, k, v, seg, sel, dtype = _gpu_case(name)
  rng = np.random.default_rng(5)
  d_out = jnp.asarray(rng.standard_normal(q.shape, np.float32), dtype)
  d_lse = jnp.asarray(rng.standard_normal((q.shape[0], q.shape[2], q.shape[1]), np.float32))

  def run(impl):
    up = (lambda x: x.astype(jnp.float32)) if impl == "ref" else (lambda x: x)

    def f(q, k, v):
      g = lambda q, k, v: (_reference(q, k, v, seg, seg, sel, True) if impl == "ref" else
                           sp.block_sparse_attention(q, k, v, sel, segment_ids=seg,
                                                     return_lse=True, implementation=impl))
      (out, lse), vjp = jax.vjp(g, *(up(x) for x in (q, k, v)))
      return out, lse, vjp((up(d_out), d_lse))
    return jax.jit(f)(q, k, v)
  out, lse, grads = run("mosaic_gpu")
  r_out, r_lse, r_grads = run("ref")
  _check_out_lse(out, lse, r_out, r_lse, dtype)
  for nm, g, r in zip("qkv", grads, r_grads):
    assert g.dtype == dtype and np.isfinite(np.asarray(g, np.float32)).all(), nm
    assert _rel(g, r) < 2e-2, (nm, _rel(g, r))
  if name in GPU_NO_TRITON_VJP:
    return
  t_out, _, t_grads = run("triton")
  assert _rel(out, t_out) < 1e-2
  for nm, g, t in zip("qkv", grads, t_grads):
    assert _rel(g, t) < 1e-2, (nm, _rel(g, t))


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_sparse_attention_ste_mosaic_matches_triton():
  """``sparse_attention(gate_grad="ste")``: same selection, forward and gradients (incl. the
  gate gradient through the scores) on the Hopper path as on the Triton path."""
  if compat.gpu_compute_capability() != (9, 0):
    pytest.skip(f"needs sm90 (Hopper), got {compat.gpu_compute_capability()}")
  q, k, v = _inputs(23, 1, 2048, 2048, 4, 2, 128)
  kw = dict(block_size=64, q_block_size=128, top_k=4, gate_grad="ste")

  def run(impl):
    loss = lambda q, k, v: (sp.sparse_attention(q, k, v, implementation=impl, **kw)
                            .astype(jnp.float32) ** 2).sum()
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
  (l_m, g_m), (l_t, g_t) = run("mosaic_gpu"), run("triton")
  assert abs(float(l_m) - float(l_t)) < 1e-2 * abs(float(l_t))
  for nm, a, b in zip("qkv", g_m, g_t):
    assert _rel(a, b) < 2e-2, (nm, _rel(a, b))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["d128_q128_k128_ragged"] + [
    pytest.param(n, marks=pytest.mark.slow)
    for n in ("d128_q128_k64_segments_gqa", "d128_q64_k64_union_segments")])
def test_gpu_block_sparse_mosaic_forward_overlap(name):
  """The overlap protocol (FA3's intra-warpgroup overlap; a pending P V carried across skipped
  entries) on the walk of a selection's schedule, whatever the device's table picks: the
  compiled forward vs the fp32 reference over the selection."""
  q, k, v, seg, sel, dtype = _gpu_case(name)
  fwd_bs, bwd_bs = _configs(sel.q_block_size, sel.block_size, q.shape[-1], q.dtype,
                            segment_ids=seg)
  fwd_bs = dataclasses.replace(fwd_bs, protocol="overlap", q_tiles_per_program=1)
  s = q.shape[1]
  sched = make_schedule(s, s, sel.q_block_size, sel.block_size, causal=True,
                        q_segment_ids=seg, kv_segment_ids=seg, block_mask=sel.tile_mask(),
                        max_kv_blocks=sel.max_selected)
  segs = (seg, seg) if seg is not None else ()
  out, lse = jax.jit(lambda q, k, v: mg.flash_attention(
      q, k, v, *segs, schedule=sched, causal=True, block_sizes=fwd_bs,
      bwd_block_sizes=bwd_bs))(q, k, v)
  r_out, r_lse = jax.jit(lambda q, k, v: _reference(q, k, v, seg, seg, sel, True))(q, k, v)
  _check_out_lse(out, lse, r_out, r_lse, dtype)


# ------------------------------------------------------------- the default on Hopper (plan)


def test_block_sparse_plan_picks_the_hopper_path_only_for_covered_calls():
  """``block_sparse_plan``: implementation=None on sm90 is "mosaic_gpu" for bf16/fp16 with
  head_dim 64/128/256 (= head_dim_v) and block sizes that are powers of two >= 64, with the
  Mosaic backward at 64/128; every other call keeps the platform's default; a named
  implementation is kept."""
  s = lambda d=128, dv=None, dt=jnp.bfloat16: (jax.ShapeDtypeStruct((1, 4096, 8, d), dt),
                                               jax.ShapeDtypeStruct((1, 4096, 2, d), dt),
                                               jax.ShapeDtypeStruct((1, 4096, 2, dv or d), dt))
  def plan(x, qbs=128, bs=64, device_kind="NVIDIA H200", **kw):
    p = sp.block_sparse_plan(*x, q_block_size=qbs, block_size=bs, device_kind=device_kind, **kw)
    return p.implementation, p.backward
  hopper, triton = ("mosaic_gpu", "mosaic_gpu"), ("triton", "triton")
  a100 = "NVIDIA A100-SXM4-80GB"
  assert plan(s()) == hopper
  assert plan(s(64, dt=jnp.float16), qbs=64, bs=256) == hopper
  assert plan(s(256)) == ("mosaic_gpu", "triton")
  with pytest.raises(ValueError, match="powers of two"):   # Triton's tiles, no fallback
    plan(s(), bs=96)
  for x, kw in [(s(), dict(device_kind=a100)), (s(), dict(qbs=32)), (s(dt=jnp.float32), {}), (s(96), {}), (s(128, 64), {}),
                (s(), dict(interpret=True))]:
    assert plan(x, **kw) == triton, kw
  assert plan(s(), implementation="triton") == triton
  assert plan(s(), device_kind=a100, implementation="mosaic_gpu") == hopper
  assert plan(s(), platform="cpu") == ("xla", "xla")


@pytest.mark.parametrize("cc,want", [((9, 0), "mosaic_gpu"), ((8, 0), "triton")])
def test_default_dispatch_follows_the_plan(cc, want, monkeypatch):
  """``block_sparse_attention`` and ``sparse_attention`` with implementation=None dispatch on
  ``block_sparse_plan``: on a (mocked) sm90 GPU the Mosaic GPU kernels, else Triton (kernels
  replaced by recorders; shapes only)."""
  from pallas_kernels.flash import triton as ft
  monkeypatch.setattr(compat, "default_backend", lambda: "gpu")
  monkeypatch.setattr(compat, "gpu_compute_capability", lambda: cc)
  called = []

  def recorder(name):
    def f(q, k, v, *a, **kw):
      called.append(name)
      return jnp.zeros(q.shape, q.dtype), jnp.zeros((q.shape[0], q.shape[2], q.shape[1]))
    return f
  monkeypatch.setattr(mg, "flash_attention", recorder("mosaic_gpu"))
  monkeypatch.setattr(ft, "flash_attention", recorder("triton"))
  q = jax.ShapeDtypeStruct((1, 512, 4, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 512, 2, 128), jnp.bfloat16)
  sel = jax.eval_shape(functools.partial(sp.select_blocks, block_size=64, q_block_size=128,
                                         top_k=2), q, k)
  jax.eval_shape(lambda q, k, sel: sp.block_sparse_attention(q, k, k, sel), q, k, sel)
  jax.eval_shape(lambda q, k: sp.sparse_attention(q, k, k, block_size=64, q_block_size=128,
                                                  top_k=2), q, k)
  assert called == [want, want]


@pytest.mark.gpu
def test_gpu_default_is_the_hopper_path():
  """On sm90, implementation=None runs the Mosaic GPU path (``block_sparse_plan``): forward and
  gradients identical to implementation="mosaic_gpu"."""
  if compat.gpu_compute_capability() != (9, 0):
    pytest.skip(f"needs sm90 (Hopper), got {compat.gpu_compute_capability()}")
  q, k, v = _inputs(29, 1, 2048, 2048, 4, 2, 128)
  kw = dict(block_size=64, q_block_size=128, top_k=4)
  p = sp.block_sparse_plan(q, k, v, q_block_size=128, block_size=64)
  assert (p.implementation, p.backward) == ("mosaic_gpu", "mosaic_gpu")

  def run(impl):
    loss = lambda q, k, v: (sp.sparse_attention(q, k, v, implementation=impl, **kw)
                            .astype(jnp.float32) ** 2).sum()
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
  (l_d, g_d), (l_m, g_m) = run(None), run("mosaic_gpu")
  assert float(l_d) == float(l_m)
  for a, b in zip(g_d, g_m):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
