"""Fused Mosaic GPU (Hopper) flash attention backward (dQ inside the dK/dV kernel): CPU checks
and GPU tests.

On the CPU nothing here runs the kernel (jax's Mosaic GPU interpret mode cannot execute its wgmma
operands). The CPU tests check
  * that the kernel lowers for "cuda" (``jax.export``: the Pallas -> Mosaic GPU lowering, register
    layouts, wgmma/TMA constraints incl. the transposed dS^T operand, the column-sliced K operand
    and the fp32 TMA reduce-add, the shared-memory budget), and that 4 stages fail to lower;
  * the fused walk: both warpgroups of a program walk the same query tiles; the tiles a
    warpgroup runs unmasked see all of its keys, and all are real keys;
  * the exchange protocol (ring, per-parity dS barriers, the final ``done`` barrier) simulated
    with random interleavings of the three warpgroups: no deadlock, no dS buffer or K tile
    overwritten while the other warpgroup's dQ wgmma reads it; a single-buffered exchange is
    caught;
  * a jnp replay of the kernel (programs, warpgroup key tiles, shared step range, masks, GQA
    walk, dS in the input dtype, per-step dQ contributions summed in fp32) substituted for
    ``_fused_call`` (monkeypatch), through the public wrapper, against ``jax.vjp`` of the fp32
    reference.
Tests marked ``gpu`` run the compiled kernel on an sm90 GPU against the reference's VJP.
"""
from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import test_flash_mosaic_gpu_bwd as base
from pallas_kernels import compat
from pallas_kernels.flash import mosaic_gpu_bwd as mb
from pallas_kernels.flash import mosaic_gpu_bwd_fused as mf

TOL = base.TOL


# -------------------------------------------------------------------------------- lowering (CPU)

def _lower(b, sq, sk, hq, hk, d, causal, dtype=jnp.bfloat16, bs=None, opts=None):
  q = jax.ShapeDtypeStruct((b, sq, hq, d), dtype)
  kv = jax.ShapeDtypeStruct((b, sk, hk, d), dtype)
  lse = jax.ShapeDtypeStruct((b, hq, sq), jnp.float32)
  fn = jax.jit(lambda q, k, v, o, l, do: mf.flash_attention_bwd(q, k, v, o, l, do, causal=causal,
                                                                 block_sizes=bs, options=opts))
  return jax.export.export(fn, platforms=["cuda"])(q, kv, kv, q, lse, q)


LOWER_CASES = {
    "d128": dict(sq=256, sk=256, hq=2, hk=2, d=128, causal=False),
    "d128_causal_gqa_ragged": dict(sq=200, sk=328, hq=4, hk=2, d=128, causal=True),
    "d128_fp16_q_longer_3_stages": dict(sq=384, sk=130, hq=2, hk=1, d=128, causal=True,
                                        dtype=jnp.float16, bs=mb.BlockSizes(num_stages_dkv=3)),
    "d64_causal_gqa_ragged": dict(sq=300, sk=500, hq=4, hk=2, d=64, causal=True),
}
V2_BS = mb.BlockSizes(compute_registers=240)
# v2 options (CPU-verified only): each change alone at v1's registers, and the v2 candidate.
V2_LOWER_CASES = {
    "v2_d128": dict(sq=256, sk=256, hq=2, hk=2, d=128, causal=False, bs=V2_BS,
                    opts=mf.V2_OPTIONS),
    "v2_d128_causal_gqa_ragged": dict(sq=200, sk=328, hq=4, hk=2, d=128, causal=True, bs=V2_BS,
                                      opts=mf.V2_OPTIONS),
    "v2_d64_causal_gqa_ragged": dict(sq=300, sk=500, hq=4, hk=2, d=64, causal=True, bs=V2_BS,
                                     opts=mf.V2_OPTIONS),
    "pipelined_d128_fp16_q_longer": dict(sq=384, sk=130, hq=2, hk=1, d=128, causal=True,
                                         dtype=jnp.float16,
                                         opts=mf.FusedOptions(pipelined=True)),
    "lean_d128_causal_gqa_ragged": dict(sq=200, sk=328, hq=4, hk=2, d=128, causal=True,
                                        opts=mf.FusedOptions(lean=True)),
}


@pytest.mark.parametrize("name", list(LOWER_CASES) + list(V2_LOWER_CASES))
def test_lowers_for_cuda(name):
  case = dict({**LOWER_CASES, **V2_LOWER_CASES}[name])
  exported = _lower(2, **case)
  text = exported.mlir_module()
  assert text.count("custom_call @mosaic_gpu") == 1                 # one kernel
  assert "output_operand_alias" in text                             # the fp32 dQ buffer
  sq, sk, hq, hk, d = (case[n] for n in ("sq", "sk", "hq", "hk", "d"))
  assert [a.shape for a in exported.out_avals] == [(2, sq, hq, d), (2, sk, hk, d), (2, sk, hk, d)]


def test_shared_memory_overflow_fails_to_lower():
  with pytest.raises(ValueError, match="shared memory"):
    _lower(1, 256, 256, 1, 1, 128, False, bs=mb.BlockSizes(num_stages_dkv=4))
  with pytest.raises(ValueError, match="shared memory"):    # 4 dS buffers leave room for 2 stages
    _lower(1, 256, 256, 1, 1, 128, False, bs=mb.BlockSizes(num_stages_dkv=3),
           opts=mf.FusedOptions(pipelined=True))


def test_register_split_is_checked():
  q = jnp.ones((1, 128, 2, 128), jnp.bfloat16)
  lse = jnp.zeros((1, 2, 128), jnp.float32)
  with pytest.raises(ValueError, match="504"):
    mf.flash_attention_bwd(q, q, q, q, lse, q, block_sizes=mb.BlockSizes(compute_registers=240))
  with pytest.raises(ValueError, match="multiple of 8"):
    mf.flash_attention_bwd(q, q, q, q, lse, q, options=mf.FusedOptions(memory_registers=20))


def test_unsupported_inputs_raise():
  q = jnp.ones((1, 128, 2, 256), jnp.bfloat16)
  lse = jnp.zeros((1, 2, 128), jnp.float32)
  with pytest.raises(NotImplementedError, match="head_dim 256"):
    mf.flash_attention_bwd(q, q, q, q, lse, q)
  q128 = jnp.ones((1, 128, 2, 128), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="block_k_dkv"):
    mf.flash_attention_bwd(q128, q128, q128, q128, lse, q128,
                           block_sizes=mb.BlockSizes(block_k_dkv=128))
  with pytest.raises(NotImplementedError, match="block_q_dkv"):
    mf.flash_attention_bwd(q128, q128, q128, q128, lse, q128,
                           block_sizes=mb.BlockSizes(block_q_dkv=128))
  q32 = jnp.ones((1, 128, 2, 128), jnp.float32)
  with pytest.raises(NotImplementedError, match="float32"):
    mf.flash_attention_bwd(q32, q32, q32, q32, lse, q32)


# ---------------------------------------------------------------------------- tile walk (CPU)


@pytest.mark.parametrize("causal", [False, True])
def test_fused_walk(causal):
  """Per program: both warpgroups start at the program's first tile; the tiles a warpgroup runs
  unmasked see all its keys and hold only real keys; the skipped tiles see none of them."""
  bs = mf.default_block_sizes()
  for sq, sk in base.WALK_SHAPES:
    st = mf._static_config((1, sq, 1, 128), (1, sk, 1, 128), jnp.bfloat16, causal=causal,
                           scale=None, block_sizes=bs)
    bq, bk, nq = bs.block_q_dkv, bs.block_k_dkv, st.num_q_tiles_dkv
    assert st.q_pad % bq == 0 and st.kv_pad == st.num_dkv_programs * 2 * bk
    keys = np.arange(bk)[:, None]
    qs = np.arange(bq)[None, :]
    for prog in range(st.num_dkv_programs):
      firsts = []
      for wg in range(2):
        k0 = prog * 2 * bk + wg * bk
        first, full = (int(x) for x in mf._fused_q_range(jnp.int32(prog), jnp.int32(k0), st))
        assert 0 <= first <= full <= nq and first < nq, (sq, sk, prog, wg)
        firsts.append(first)
        for i in range(nq):
          ref = base._ref_visible(qs + i * bq, keys + k0, st)
          if i < first:
            assert not ref.any(), (sq, sk, prog, wg, i)
          elif i < full:
            kern = np.asarray(mf._fused_visible(keys, qs, k0, i, st))
            np.testing.assert_array_equal(kern & (qs + i * bq < sq), ref)
          else:
            assert (keys + k0 < sk).all(), (sq, sk, prog, wg, i)          # no padded key
            np.testing.assert_array_equal(ref, np.broadcast_to(qs + i * bq < sq, ref.shape))
      assert firsts[0] == firsts[1]


# ------------------------------------------------------- exchange protocol simulation (CPU)


def _fused_protocol(st, prog, seed, *, ds_buffers=2, done_barrier=True, pipelined=False):
  """The fused kernel's barriers for one program: the Q/dO/lse/delta ring as in the dK/dV
  kernel, dS^T written per (parity, warpgroup) and read by both warpgroups' dQ wgmmas between
  the exchange wait and the end of the step, K tiles overwritten by dK after the done barrier.
  A read window that sees a buffer change fails. ``pipelined``: ``FusedOptions(pipelined=True)``
  (dS^T buffer and barrier by ring step mod ``ds_buffers``; step j's dQ window reads step j - 1's
  buffer after waiting for it, from the issue of step j's dV/dK until the end of step j; the last
  step's dQ after the loop, before the done barrier; a prologue arrival on buffer
  ``ds_buffers - 1`` that step 0 waits for, its dQ discarded)."""
  stages, nq = st.bs.num_stages_dkv, st.num_q_tiles_dkv
  first_p = int(mf._fused_q_range(jnp.int32(prog), jnp.int32(prog * 2 * st.bs.block_k_dkv),
                                  st)[0])
  per_head = nq - first_p
  total = st.group * per_head
  loaded = [base._Barrier(stages) for _ in range(4)]
  free = base._Barrier(stages, arrivals=2)
  ds_ready = base._Barrier(ds_buffers, arrivals=2)
  done = base._Barrier(1, arrivals=2)
  tick = base._Barrier(1, arrivals=10 ** 9)               # a scheduling point, never completes
  data = [[None] * stages for _ in range(4)]
  ds = [[None, None] for _ in range(ds_buffers)]
  k_own = ["K", "K"]
  steps = {0: 0, 1: 0}

  def memory():
    def load(j, slot):
      g = j // per_head
      for buf in range(4):
        data[buf][slot] = (g, first_p + j - g * per_head)
        yield ("arrive", loaded[buf], slot)
    for s in range(min(stages, total)):
      yield from load(s, s)
    for j in range(stages, max(total, stages)):
      yield ("wait", free, j % stages)
      yield from load(j, j % stages)

  def dq_window(wg, j):                                   # wait for step j's dS, read it + K
    par = j % ds_buffers
    yield ("wait", ds_ready, par)
    assert ds[par] == [j, j] and k_own == ["K", "K"], (wg, j, ds[par], k_own)  # dQ wgmma
    yield ("arrive", tick, 0)                             # ... still reading
    assert ds[par] == [j, j] and k_own == ["K", "K"], (wg, j, ds[par], k_own)

  def compute(wg):
    if pipelined:                                         # the prologue's "step -1" arrival
      yield ("arrive", ds_ready, ds_buffers - 1)
    for g in range(st.group):
      for i in range(first_p, nq):
        j = g * per_head + i - first_p
        slot, par = j % stages, j % ds_buffers
        for buf in range(4):
          yield ("wait", loaded[buf], slot)
          assert data[buf][slot] == (g, i), (buf, data[buf][slot], g, i)
        ds[par][wg] = j                                   # store dS^T, fence, arrive
        yield ("arrive", ds_ready, par)
        if not pipelined:
          yield from dq_window(wg, j)
        elif j > 0:
          yield from dq_window(wg, j - 1)
        else:                                             # discarded dQ of "step -1"
          yield ("wait", ds_ready, ds_buffers - 1)
        assert all(data[buf][slot] == (g, i) for buf in range(4))
        steps[wg] += 1
        yield ("arrive", free, slot)
    if pipelined:
      yield from dq_window(wg, total - 1)
    if done_barrier:
      yield ("arrive", done, 0)
      yield ("wait", done, 0)
    k_own[wg] = "dK"

  base._simulate([memory(), compute(0), compute(1)], seed)
  assert steps[0] == steps[1] == total


@pytest.mark.parametrize("causal", [False, True])
def test_exchange_protocol_never_deadlocks_or_overwrites(causal):
  for (sq, sk, hq, hk), stages in [((200, 328, 4, 2), 2), ((328, 200, 2, 1), 3),
                                   ((700, 300, 3, 1), 2)]:
    st = mf._static_config((1, sq, hq, 128), (1, sk, hk, 128), jnp.bfloat16, causal=causal,
                           scale=None, block_sizes=mb.BlockSizes(num_stages_dkv=stages))
    for prog in range(st.num_dkv_programs):
      for seed in range(3):
        _fused_protocol(st, prog, seed=seed)


@pytest.mark.parametrize("causal", [False, True])
def test_pipelined_exchange_protocol_never_deadlocks_or_overwrites(causal):
  """``FusedOptions(pipelined=True)``: 4 dS^T buffers, dQ of step j - 1 inside step j."""
  for (sq, sk, hq, hk), stages in [((200, 328, 4, 2), 2), ((700, 300, 3, 1), 2)]:
    st = mf._static_config((1, sq, hq, 128), (1, sk, hk, 128), jnp.bfloat16, causal=causal,
                           scale=None, block_sizes=mb.BlockSizes(num_stages_dkv=stages))
    for prog in range(st.num_dkv_programs):
      for seed in range(3):
        _fused_protocol(st, prog, seed=seed, ds_buffers=mf._PIPELINED_DS_BUFFERS,
                        pipelined=True)


@pytest.mark.parametrize("kw", [dict(ds_buffers=1), dict(done_barrier=False),
                                dict(pipelined=True, ds_buffers=2),
                                dict(pipelined=True, ds_buffers=3, stages=3),
                                dict(pipelined=True, ds_buffers=4, done_barrier=False)])
def test_protocol_simulation_catches_a_race(kw):
  """The simulation can fail: one dS buffer (a warpgroup rewrites its half while the other
  still reads it), or no done barrier (dK overwrites a K tile the other warpgroup's last dQ
  wgmma reads); pipelined: v1's two buffers (the other warpgroup's dQ of step j - 2 runs in its
  step j - 1, which this warpgroup's waits do not order before its step j), or no done barrier
  (the last dQ, after the loop); 3 buffers race at 3 stages (at 2 the ring orders them)."""
  kw = dict(kw)
  st = mf._static_config((1, 512, 2, 128), (1, 256, 1, 128), jnp.bfloat16, causal=False,
                         scale=None, block_sizes=mb.BlockSizes(num_stages_dkv=kw.pop("stages", 2)))
  with pytest.raises(AssertionError, match="'K'"):           # a read window's check, no deadlock
    for seed in range(50):
      _fused_protocol(st, 0, seed=seed, **kw)


# ------------------------------------------------------------------------------- replay (CPU)


def _replay_fused_call(q, k, v, do, lse2, delta, st, opts=mf.FusedOptions(), *,
                       drop_last_dq=False):
  """jnp replay of ``_fused_kernel`` on the padded inputs: per program and GQA head the shared
  step range, per warpgroup its keys' masked/unmasked split (the kernel's helpers), dS^T in the
  input dtype for dK and dQ, each step's dQ contribution (dS over both warpgroups' keys) @ K *
  scale added to an fp32 buffer; the programs' buffers summed. ``opts.pipelined``: the
  contribution of ring step j is added in step j + 1 (across the masked/unmasked loops and GQA
  heads) to the tile the kernel's ``_tile_of_step(j)`` names, the last one after the walk
  (``drop_last_dq``: not, a planted bug). ``opts.lean``: S^T and dP^T accumulated onto
  -lse2 / c and -delta (``_lean_acc_init``), P^T = ``_lean_probs``, dS^T = P^T acc_dp, the
  mask from a key vector and a query vector, broadcast."""
  b, sq_pad, hq, d = q.shape
  hk = k.shape[2]
  bq, bk, nq, g_n = st.bs.block_q_dkv, st.bs.block_k_dkv, st.num_q_tiles_dkv, st.group
  n_prog = st.num_dkv_programs
  rows = lax.broadcasted_iota(jnp.int32, (bk, bq), 0)
  cols = lax.broadcasted_iota(jnp.int32, (bk, bq), 1)
  dot = base._dot

  def program(k_p, v_p, q_g, do_g, lse_g, delta_g, prog):   # [2bk, D] x2, [G, Sq', D] x2, [G, Sq']
    k0p = prog * (2 * bk)
    first = mf._fused_q_range(prog, k0p, st)[0]
    fulls = [mf._fused_q_range(prog, k0p + w * bk, st)[1] for w in range(2)]

    def add_dq(dq, contrib, g, i):
      old = lax.dynamic_slice_in_dim(dq[g], i * bq, bq)
      return dq.at[g].set(lax.dynamic_update_slice_in_dim(dq[g], old + contrib, i * bq, 0))

    per_head = nq - first
    tile_of = functools.partial(mf._tile_of_step, first_program=first, per_head=per_head)

    def step(i, carry, *, g):
      dk, dv, dq, pend, has_pend = carry
      sl = lambda x: lax.dynamic_slice_in_dim(x[g], i * bq, bq)
      q_t, do_t, lse_t, delta_t = sl(q_g), sl(do_g), sl(lse_g), sl(delta_g)
      ds_all, dk_new, dv_new = [], [], []
      for w in range(2):
        k_t, v_t = k_p[w * bk:(w + 1) * bk], v_p[w * bk:(w + 1) * bk]
        if opts.lean:                                      # accumulators from -lse2/c, -delta
          init_s, init_dp = mf._lean_acc_init(lse_t, delta_t, (bk, bq), st)
          p_t = mf._lean_probs(init_s + dot(k_t, q_t.T), st)
          r, c = rows[:, :1], cols[:1, :]
        else:
          p_t = mb._probs(dot(k_t, q_t.T), lse_t, st, axis=1)
          r, c = rows, cols
        masked = jnp.where(mf._fused_visible(r, c, k0p + w * bk, i, st), p_t, 0.0)
        p_t = jnp.where(i < fulls[w], masked, p_t)
        if opts.lean:
          ds_t = (p_t * (init_dp + dot(v_t, do_t.T))).astype(st.dtype)
        else:
          ds_t = mb._dscores(p_t, dot(v_t, do_t.T), delta_t, axis=1).astype(st.dtype)
        dv_new.append(dv[w] + dot(p_t.astype(st.dtype), do_t))
        dk_new.append(dk[w] + dot(ds_t, q_t))
        ds_all.append(ds_t)
      contrib = dot(jnp.concatenate(ds_all).T, k_p) * st.scale        # [bq, D]
      if not opts.pipelined:
        dq = add_dq(dq, contrib, g, i)
      else:                                                # step j - 1's dQ, then hold step j's
        j = g * per_head + i - first                       # ring step; the kernel's target map
        dq = jnp.where(has_pend, add_dq(dq, pend, *tile_of(j - 1)), dq)
        pend, has_pend = contrib, True
      return jnp.stack(dk_new), jnp.stack(dv_new), dq, pend, has_pend

    def head(g, carry):
      return lax.fori_loop(first, nq, functools.partial(step, g=g), carry)

    zeros = jnp.zeros((2, bk, d), jnp.float32)
    dk, dv, dq, pend, has_pend = lax.fori_loop(
        0, g_n, head, (zeros, zeros, jnp.zeros((g_n, sq_pad, d), jnp.float32),
                       jnp.zeros((bq, d), jnp.float32), jnp.bool_(False)))
    if opts.pipelined and not drop_last_dq:               # the last step's dQ, after the walk
      dq = jnp.where(has_pend, add_dq(dq, pend, *tile_of(g_n * per_head - 1)), dq)
    return ((dk * st.scale).astype(st.dtype).reshape(2 * bk, d),
            dv.astype(st.dtype).reshape(2 * bk, d), dq)

  kp = k.reshape(b, n_prog, 2 * bk, hk, d).transpose(0, 3, 1, 2, 4)   # [B, Hk, P, 2bk, D]
  vp = v.reshape(b, n_prog, 2 * bk, hk, d).transpose(0, 3, 1, 2, 4)
  grp = lambda x: x.transpose(0, 2, 1, 3).reshape(b, hk, g_n, sq_pad, d)
  grp_rows = lambda x: x.reshape(b, hk, g_n, sq_pad)
  per_prog = jax.vmap(program, in_axes=(0, 0, None, None, None, None, 0))
  dk, dv, dq = jax.vmap(jax.vmap(per_prog, in_axes=(0, 0, 0, 0, 0, 0, None)),
                        in_axes=(0, 0, 0, 0, 0, 0, None))(
      kp, vp, grp(q), grp(do), grp_rows(lse2), grp_rows(delta), jnp.arange(n_prog, dtype=jnp.int32))
  out = lambda x: x.transpose(0, 2, 3, 1, 4).reshape(b, n_prog * 2 * bk, hk, d)
  dq = dq.sum(axis=2).reshape(b, hq, sq_pad, d).transpose(0, 2, 1, 3)  # programs' reduce-adds
  return dq, out(dk), out(dv)


def _fused_vs_reference(q, k, v, do, causal, *, scale=None, bs=None, d_lse=None, opts=None):
  def both(q, k, v, do, d_lse):
    out, lse = base._reference_residuals(q, k, v, causal, scale)
    got = mf.flash_attention_bwd(q, k, v, out, lse, do, causal=causal, scale=scale,
                                 block_sizes=bs, d_lse=d_lse, options=opts)
    return got, base._reference_grads(q, k, v, do, d_lse, causal, scale), lse
  fn = jax.jit(both)
  if compat.default_backend() == "cpu":
    return fn.lower(q, k, v, do, d_lse).compile(base._FAST_CPU_COMPILE)(q, k, v, do, d_lse)
  return fn(q, k, v, do, d_lse)


REPLAY_CASES = {
    "dense_gqa_ragged": dict(b=1, sq=130, sk=200, hq=2, hk=1, d=64, causal=False),
    "causal_gqa_ragged_d_lse": dict(b=1, sq=200, sk=328, hq=4, hk=2, d=64, causal=True,
                                    d_lse=True),
    "causal_q_longer_empty_rows_fp16": dict(b=1, sq=328, sk=200, hq=2, hk=1, d=64, causal=True,
                                            scale=0.1, dtype=jnp.float16),
}


@pytest.mark.parametrize("name", list(REPLAY_CASES))
def test_replayed_kernel_matches_reference_vjp(name, monkeypatch):
  monkeypatch.setattr(mf, "_fused_call", _replay_fused_call)
  case = dict(REPLAY_CASES[name])
  dtype = case.pop("dtype", jnp.bfloat16)
  causal, scale, with_d_lse = case.pop("causal"), case.pop("scale", None), case.pop("d_lse", False)
  q, k, v, do = base._inputs(zlib.crc32(name.encode()), dtype=dtype, **case)
  d_lse = (jax.random.normal(jax.random.key(7), (case["b"], case["hq"], case["sq"]), jnp.float32)
           if with_d_lse else None)
  got, want, lse = _fused_vs_reference(q, k, v, do, causal, scale=scale, d_lse=d_lse)
  base._assert_grads_close(got, want, lse, q, k, dtype)


V2_REPLAY_CASES = {
    "v2_causal_gqa_ragged_d_lse": dict(REPLAY_CASES["causal_gqa_ragged_d_lse"]),
    "v2_causal_q_longer_empty_rows_fp16": dict(REPLAY_CASES["causal_q_longer_empty_rows_fp16"]),
}


@pytest.mark.parametrize("name", list(V2_REPLAY_CASES))
def test_replayed_v2_kernel_matches_reference_vjp(name, monkeypatch):
  """The v2 options' replay (dQ one step late across loops and heads, the vector mask) through
  the wrapper with ``V2_OPTIONS`` (the wrapper passes the options to ``_fused_call``)."""
  monkeypatch.setattr(mf, "_fused_call", _replay_fused_call)
  case = dict(V2_REPLAY_CASES[name])
  dtype = case.pop("dtype", jnp.bfloat16)
  causal, scale, with_d_lse = case.pop("causal"), case.pop("scale", None), case.pop("d_lse", False)
  q, k, v, do = base._inputs(zlib.crc32(name.encode()), dtype=dtype, **case)
  d_lse = (jax.random.normal(jax.random.key(7), (case["b"], case["hq"], case["sq"]), jnp.float32)
           if with_d_lse else None)
  got, want, lse = _fused_vs_reference(q, k, v, do, causal, scale=scale, d_lse=d_lse,
                                       bs=V2_BS, opts=mf.V2_OPTIONS)
  base._assert_grads_close(got, want, lse, q, k, dtype)


def test_pipelined_replay_check_catches_a_missing_last_dq(monkeypatch):
  """The pipelined replay can fail: without the dQ issued after the walk, the last query tile
  of the last GQA head misses the contributions of every program (dk, dv unaffected)."""
  monkeypatch.setattr(mf, "_fused_call", functools.partial(_replay_fused_call, drop_last_dq=True))
  q, k, v, do = base._inputs(5, b=1, sq=128, sk=128, hq=2, hk=1, d=64, dtype=jnp.bfloat16)
  got, want, _ = _fused_vs_reference(q, k, v, do, False, opts=mf.FusedOptions(pipelined=True))
  assert base._rel(got[0], want[0]) > 0.1
  assert base._rel(got[1], want[1]) < 1e-2 and base._rel(got[2], want[2]) < 1e-2


def test_replay_check_catches_a_wrong_mask(monkeypatch):
  """The replay test can fail: a walk that skips the diagonal mask gives a wrong dq (the
  contributions of keys past each row's diagonal) and wrong dk/dv."""
  monkeypatch.setattr(mf, "_fused_call", _replay_fused_call)
  monkeypatch.setattr(mf, "_fused_visible", lambda rows, cols, k0, i, st: rows >= 0)
  q, k, v, do = base._inputs(3, b=1, sq=128, sk=128, hq=1, hk=1, d=64, dtype=jnp.bfloat16)
  got, want, _ = _fused_vs_reference(q, k, v, do, True)
  assert all(base._rel(g, w) > 0.1 for g, w in zip(got, want))


# ----------------------------------------------------------------------------- GPU (sm90)

GPU_CASES = {
    "d128": dict(b=2, sq=2048, sk=2048, hq=4, hk=4, d=128, causal=False),
    "d128_causal_gqa": dict(b=2, sq=2048, sk=2048, hq=8, hk=2, d=128, causal=True),
    "d128_ragged_gqa": dict(b=1, sq=1000, sk=1000, hq=4, hk=2, d=128, causal=False),
    "d128_ragged_causal_kv_odd": dict(b=1, sq=777, sk=1001, hq=3, hk=1, d=128, causal=True),
    "d128_causal_q_shorter": dict(b=1, sq=300, sk=1111, hq=2, hk=2, d=128, causal=True),
    "d128_causal_q_longer_empty_rows": dict(b=1, sq=700, sk=260, hq=2, hk=1, d=128, causal=True),
    "d128_fp16_d_lse": dict(b=1, sq=512, sk=512, hq=2, hk=1, d=128, causal=True,
                            dtype=jnp.float16, d_lse=True),
    "d128_3_stages": dict(b=1, sq=1024, sk=1024, hq=2, hk=1, d=128, causal=True,
                          bs=mb.BlockSizes(num_stages_dkv=3)),
    "d64": dict(b=2, sq=1024, sk=1024, hq=4, hk=4, d=64, causal=False),
    "d64_causal_gqa_ragged": dict(b=1, sq=1000, sk=777, hq=4, hk=1, d=64, causal=True),
    # v2 options (never run on a GPU yet): the candidate, then each change alone.
    "v2_d128": dict(b=2, sq=2048, sk=2048, hq=4, hk=4, d=128, causal=False, bs=V2_BS,
                    opts=mf.V2_OPTIONS),
    "v2_d128_ragged_causal_gqa_kv_odd": dict(b=1, sq=777, sk=1001, hq=4, hk=2, d=128,
                                             causal=True, bs=V2_BS, opts=mf.V2_OPTIONS),
    "v2_d64_causal_gqa_ragged": dict(b=1, sq=1000, sk=777, hq=4, hk=1, d=64, causal=True,
                                     bs=V2_BS, opts=mf.V2_OPTIONS),
    "pipelined_d128_causal_gqa": dict(b=2, sq=2048, sk=2048, hq=8, hk=2, d=128, causal=True,
                                      opts=mf.FusedOptions(pipelined=True)),
    "lean_d128_causal_q_longer_empty_rows": dict(b=1, sq=700, sk=260, hq=2, hk=1, d=128,
                                                 causal=True, opts=mf.FusedOptions(lean=True)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_matches_reference_vjp(name):
  """The compiled fused kernel on the reference's residuals vs jax.vjp of the fp32 reference."""
  base._skip_unless_sm90()
  case = dict(GPU_CASES[name])
  dtype, bs, opts = case.pop("dtype", jnp.bfloat16), case.pop("bs", None), case.pop("opts", None)
  causal, with_d_lse = case.pop("causal"), case.pop("d_lse", False)
  q, k, v, do = base._inputs(zlib.crc32(name.encode()), dtype=dtype, **case)
  d_lse = (jax.random.normal(jax.random.key(7), (case["b"], case["hq"], case["sq"]), jnp.float32)
           if with_d_lse else None)
  got, want, lse = _fused_vs_reference(q, k, v, do, causal, bs=bs, d_lse=d_lse, opts=opts)
  base._assert_grads_close(got, want, lse, q, k, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_matches_two_kernel_backward(causal):
  """Fused vs the GPU-verified two-kernel backward on the Mosaic forward's residuals: dk/dv
  close to bf16 rounding, dq too (only the fp32 sum order differs)."""
  base._skip_unless_sm90()
  from pallas_kernels.flash import mosaic_gpu as mg
  q, k, v, do = base._inputs(11, b=1, sq=1000, sk=1000, hq=4, hk=2, d=128, dtype=jnp.bfloat16)

  @jax.jit
  def run(q, k, v, do):
    out, lse = mg.flash_attention(q, k, v, causal=causal)
    return (mf.flash_attention_bwd(q, k, v, out, lse, do, causal=causal),
            mb.flash_attention_bwd(q, k, v, out, lse, do, causal=causal), lse)
  fused, two, lse = run(q, k, v, do)
  for name, f, t in zip(("dq", "dk", "dv"), fused, two):
    assert base._rel(f, t) < 1e-2, (name, base._rel(f, t))
  want = base._reference_grads(q, k, v, do, None, causal, None)
  base._assert_grads_close(fused, want, lse, q, k, jnp.bfloat16)


def test_lowers_as_the_mosaic_forwards_custom_vjp():
  """As the backward of a custom_vjp around the Mosaic GPU forward, under jax.grad (the mutable
  dQ buffer inside a VJP rule): two Mosaic GPU kernels, gradients of the inputs' shapes."""
  from pallas_kernels.flash import mosaic_gpu as mg

  @jax.custom_vjp
  def attn(q, k, v):
    return mg.flash_attention(q, k, v, causal=True)[0]

  def fwd(q, k, v):
    out, lse = mg.flash_attention(q, k, v, causal=True)
    return out, (q, k, v, out, lse)

  def bwd(res, do):
    return mf.flash_attention_bwd(*res, do, causal=True)
  attn.defvjp(fwd, bwd)
  loss = lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32))
  q = jax.ShapeDtypeStruct((1, 1000, 4, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 1000, 2, 128), jnp.bfloat16)
  exported = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))),
                               platforms=["cuda"])(q, kv, kv)
  assert [a.shape for a in exported.out_avals] == [q.shape, kv.shape, kv.shape]
  assert exported.mlir_module().count("custom_call @mosaic_gpu") == 2
