"""Serving-grade decode (jattn.decode_serving): length-balanced schedules and the unified-max
softmax, on "xla" and "triton" (interpret mode), against the fp32 reference. Tiny shapes."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import decode as dec
from jattn import decode_serving as serve
from pallas_kernels.decode import reference as dref
from pallas_kernels.decode import triton as kt
from tests.helpers import ci_cases, rel_err
from tests.test_decode import _inputs, _paginate

BK16 = kt.DecodeBlockSizes(block_k=16)
_REF = jax.jit(dref.decode_reference, static_argnames=("local_window_size", "logits_soft_cap"))


def _check(out, lse, ref_out, ref_lse, lengths, tol=2e-3):
  assert rel_err(out, ref_out) < tol
  empty = np.asarray(lengths) == 0
  assert np.all(np.asarray(out)[empty] == 0) and np.all(np.isneginf(np.asarray(lse)[empty]))
  np.testing.assert_allclose(np.asarray(lse)[~empty], np.asarray(ref_lse)[~empty], rtol=tol,
                             atol=tol)


@pytest.mark.parametrize("window", [None, 13])
def test_balance_units_partition_the_visible_blocks(window):
  """Every visible block of every row is in exactly one unit of its row, units are contiguous
  per row, at most max_units, and no unit exceeds ceil(total / (max_units - batch)) blocks;
  the same under jit with traced lengths."""
  rng = np.random.default_rng(0)
  build = jax.jit(functools.partial(serve.balance_units, capacity=1000, block=16, max_units=11,
                                    window_left=window))
  for lengths in ([0, 1000, 17, 1], rng.integers(0, 1001, 5), [0, 0, 0, 0, 0]):
    lengths = np.asarray(lengths)
    s = build(jnp.asarray(lengths, jnp.int32))
    row, first, count = (np.asarray(x) for x in s.units)
    starts = np.asarray(s.row_units)
    lo = np.zeros_like(lengths) if window is None else np.maximum(lengths - 1 - window, 0)
    nblk = np.maximum(-(-lengths // 16) - lo // 16, 0)
    assert starts[0] == 0 and starts[-1] <= 11 and np.all(np.diff(starts) >= 0)
    if nblk.sum():
      assert count.max() <= -(-nblk.sum() // (11 - len(lengths)))
    for b in range(len(lengths)):
      mine = np.arange(starts[b], starts[b + 1])
      assert np.all(row[mine] == b) and np.all(count[mine] > 0)
      blocks = np.concatenate([np.arange(first[u], first[u] + count[u]) for u in mine] or [[]])
      np.testing.assert_array_equal(blocks, np.arange(lo[b] // 16, lo[b] // 16 + nblk[b]))
    unused = np.arange(starts[-1], 11)
    assert np.all(row[unused] == len(lengths)) and np.all(count[unused] == 0)


# (layout, lengths, window, cap, dtype)
CASES = [
    ("nhd", [0, 1, 77, 100], None, None, jnp.float32),
    ("paged", [100, 0, 33, 9], (40, 0), 3.0, jnp.float32),
    ("hnd", [64, 5, 0, 100], 20, None, jnp.bfloat16),
]


@pytest.mark.parametrize("impl,layout,lengths,window,cap,dtype",
                         ci_cases([("triton", *c) for c in CASES]
                                  + [("xla", *c) for c in CASES[:2]],
                                  [("triton", *CASES[2]), ("xla", *CASES[0]), ("xla", *CASES[1])]))
def test_schedule_and_unified_max_match_reference(impl, layout, lengths, window, cap, dtype):
  """Scheduled (exact and unified max) and split unified-max calls == the fp32 reference, with
  empty rows, length 1, a window, a soft cap, GQA 3:1, contiguous, paged and head-major."""
  q, k, v = _inputs(50, 4, 100, 6, 2, 24, dtype)
  lengths = jnp.array(lengths, jnp.int32)
  ref_out, ref_lse = _REF(q, k, v, lengths, local_window_size=window, logits_soft_cap=cap)
  kw = dict(local_window_size=window, logits_soft_cap=cap, implementation=impl,
            block_sizes=None if impl == "xla" else BK16)
  if layout == "paged":
    k_pages, v_pages, table = _paginate(51, k, v, lengths, 16)
    args, call = (q, k_pages, v_pages, lengths), functools.partial(
        dec.paged_decode_attention, q, k_pages, v_pages, table, lengths)
    kw_s = dict(page_table=table)
  else:
    kc, vc = (k, v) if layout == "nhd" else (jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2))
    args, call = (q, kc, vc, lengths), functools.partial(dec.decode_attention, q, kc, vc,
                                                        lengths, kv_layout=layout)
    kw_s = dict(kv_layout=layout)
  sched = jattn.decode_schedule(*args, max_units=9, local_window_size=window,
                                implementation=impl, block_sizes=kw["block_sizes"], **kw_s)
  tol = 2e-3 if dtype == jnp.float32 else 2e-2
  for extra in (dict(schedule=sched), dict(schedule=sched, softmax="unified_max"),
                dict(num_splits=3, softmax="unified_max")):
    out, lse = call(return_lse=True, interpret=True, **extra, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape
    _check(out, lse, ref_out, ref_lse, lengths, tol)


@pytest.mark.parametrize("impl,scheduled", ci_cases(
    [(i, s) for s in (False, True) for i in ("xla", "triton")], [("xla", False), ("triton", True)]))
def test_unified_max_recomputes_overshooting_rows(impl, scheduled):
  """Bad estimates are recomputed exactly: far below the max (exp would overflow to inf),
  far above (exp would underflow to 0), -inf, +inf, NaN; a good estimate and an empty row
  stay on the plain sum. Without the recompute these rows give inf/NaN or zeros."""
  q, k, v = _inputs(60, 7, 80, 4, 2, 16)
  q = q * 30.0                                     # logits of several hundred: exp overflows
  lengths = jnp.array([80, 61, 7, 80, 33, 0, 50], jnp.int32)
  ref_out, ref_lse = _REF(q, k, v, lengths)
  true_max = jnp.max(jnp.where(jnp.arange(80)[None, None, :] < lengths[:, None, None],
                               jnp.einsum("bhd,bnhd->bhn", q, jnp.repeat(k, 2, axis=2)) / 4.0,
                               -jnp.inf), axis=-1)                       # [b, hq]
  est = jnp.stack([true_max[0] - 300.0, true_max[1] + 300.0,
                   jnp.full((4,), -jnp.inf), jnp.full((4,), jnp.inf),
                   jnp.full((4,), jnp.nan), jnp.zeros(4), true_max[6] + 1.0])
  kw = dict(implementation=impl, block_sizes=None if impl == "xla" else BK16, interpret=True,
            return_lse=True, softmax="unified_max", max_estimate=est)
  if scheduled:
    kw["schedule"] = jattn.decode_schedule(q, k, v, lengths, implementation=impl,
                                           block_sizes=kw["block_sizes"], max_units=12)
  else:
    kw["num_splits"] = 3
  out, lse = dec.decode_attention(q, k, v, lengths, **kw)
  assert np.all(np.isfinite(np.asarray(out)))
  _check(out, lse, ref_out, ref_lse, lengths)
  # The default estimate (the newest key's logit) on the same inputs.
  kw.pop("max_estimate")
  out, lse = dec.decode_attention(q, k, v, lengths, **kw)
  _check(out, lse, ref_out, ref_lse, lengths)


def test_unified_partials_sum_to_the_row():
  """The Triton kernel's unified partials (acc, l, mx) against one estimate: sum acc / sum l is
  the row's output and m_hat + log sum l its lse; mx is each partial's max logit; masked-off
  programs (active 0) read nothing."""
  q, k, v = _inputs(70, 2, 64, 4, 2, 16)
  lengths = jnp.array([64, 23], jnp.int32)
  ref_out, ref_lse = _REF(q, k, v, lengths)
  m_hat = serve.newest_key_logits(q, k, lengths, scale=0.25)
  sched = serve.balance_units(lengths, capacity=64, block=16, max_units=4)
  acc, l, mx = kt.decode_partials(q, k, v, lengths, units=sched.units, m_hat=m_hat,
                                  block_sizes=BK16, interpret=True)
  rows = np.asarray(sched.unit_row)
  for b in range(2):
    mine = rows == b
    out = acc[0, mine].sum(0) / l[0, mine].sum(0)[:, None]
    assert rel_err(out, ref_out[b]) < 1e-5
    np.testing.assert_allclose(m_hat[b] + jnp.log(l[0, mine].sum(0)), ref_lse[b], rtol=1e-5)
  assert np.all(np.asarray(mx[0, rows < 2]) <= np.asarray(ref_lse)[rows[rows < 2]])
  active = jnp.zeros((1, 4, 2), jnp.int32).at[0, 0, 1].set(1)
  _, lse = kt.decode_partials(q, k, v, lengths, units=sched.units, active=active,
                              block_sizes=BK16, interpret=True)
  assert np.all(np.isneginf(np.asarray(lse[0, 1:]))) and np.all(np.isneginf(lse[0, 0, :2]))
  assert np.all(np.isfinite(np.asarray(lse[0, 0, 2:])))


def test_schedule_under_jit_with_traced_lengths():
  """One jit of schedule + call serves every batch composition of the same shapes."""
  q, k, v = _inputs(80, 3, 96, 4, 2, 16)

  @jax.jit
  def step(lengths):
    s = jattn.decode_schedule(q, k, v, lengths, implementation="triton", block_sizes=BK16,
                              max_units=6)
    return dec.decode_attention(q, k, v, lengths, implementation="triton", block_sizes=BK16,
                                interpret=True, schedule=s, softmax="unified_max")
  for lengths in ([96, 3, 40], [0, 96, 95]):
    lengths = jnp.array(lengths, jnp.int32)
    assert rel_err(step(lengths), _REF(q, k, v, lengths)[0]) < 2e-3
  assert step._cache_size() == 1


def test_plan_and_validation():
  q, k, v = _inputs(90, 2, 64, 4, 2, 16)
  lens = jnp.array([64, 10], jnp.int32)
  s = jattn.decode_schedule(q, k, v, lens, implementation="triton", block_sizes=BK16,
                            max_units=5)
  p = dec.decode_plan(q, k, v, lens, implementation="triton", block_sizes=BK16, schedule=s,
                      softmax="unified_max")
  assert p.config == dec.DecodeConfig(None, BK16, "pallas", "unified_max", 5)
  assert dec.decode_plan(q, k, v, lens, implementation="xla").config.softmax == "exact"
  assert serve.default_max_units("triton", 8, 8, core_count=132) == 74
  call = functools.partial(dec.decode_attention, q, k, v, lens, implementation="triton",
                           block_sizes=BK16, interpret=True)
  with pytest.raises(ValueError, match="num_splits or schedule"):
    call(schedule=s, num_splits=2)
  with pytest.raises(ValueError, match="blocks of 16 keys, the call 2 in blocks of 128"):
    call(schedule=s, block_sizes=None)
  with pytest.raises(TypeError, match="DecodeSchedule"):
    call(schedule=s.units)
  with pytest.raises(ValueError, match="softmax must be one of"):
    call(softmax="online")
  with pytest.raises(ValueError, match="max_estimate applies to softmax='unified_max'"):
    call(max_estimate=jnp.zeros((2, 4)))
  with pytest.raises(ValueError, match=r"max_estimate must be \[batch, q_heads\]"):
    call(softmax="unified_max", max_estimate=jnp.zeros((2,)))
  with pytest.raises(ValueError, match=r"max_units must be an int in \[2, "):
    jattn.decode_schedule(q, k, v, lens, implementation="xla", max_units=1)
  with pytest.raises(NotImplementedError, match="Mosaic TPU"):
    dec.decode_plan(q, k, v, lens, implementation="mosaic_tpu", softmax="unified_max")


def test_triton_serving_paths_lower_for_gpu():
  """The scheduled and unified-max Triton kernels lower for CUDA at a bench shape (GQA 32:8,
  D128, bf16, B8 S32K paged), recompute branch included."""
  S = jax.ShapeDtypeStruct
  bf16 = jnp.bfloat16

  def call(q, kp, vp, table, lens):
    s = jattn.decode_schedule(q, kp, vp, lens, page_table=table, implementation="triton",
                              max_units=64)
    return jattn.paged_decode_attention(q, kp, vp, table, lens, implementation="triton",
                                        schedule=s, softmax="unified_max")
  disabled = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  exp = jax.export.export(jax.jit(call), platforms=["cuda"], disabled_checks=disabled)(
      S((8, 32, 128), bf16), S((2048 * 8, 16, 8, 128), bf16), S((2048 * 8, 16, 8, 128), bf16),
      S((8, 2048), jnp.int32), S((8,), jnp.int32))
  assert exp.mlir_module().count("xla.gpu.triton") >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
def test_serving_paths_on_gpu(paged):
  """Compiled Triton: mixed lengths (GQA 32:8, D128, bf16), scheduled exact and unified max
  and split unified max == the fp32 reference."""
  lengths = jnp.array([4096, 17, 1, 3000, 0, 4095, 64, 2500], jnp.int32)
  q, k, v = _inputs(100, 8, 4096, 32, 8, 128, jnp.bfloat16)
  ref_out, ref_lse = _REF(q, k, v, lengths)
  if paged:
    kp, vp, table = _paginate(101, k, v, lengths, 16)
    args, kw = (q, kp, vp, lengths), dict(page_table=table)
    call = functools.partial(jattn.paged_decode_attention, q, kp, vp, table, lengths)
  else:
    args, kw, call = (q, k, v, lengths), {}, functools.partial(jattn.decode_attention, q, k, v,
                                                               lengths)
  s = jattn.decode_schedule(*args, **kw)
  for extra in (dict(schedule=s), dict(schedule=s, softmax="unified_max"),
                dict(softmax="unified_max")):
    out, lse = call(return_lse=True, **extra)
    _check(out, lse, ref_out, ref_lse, lengths, 2e-2)


def _kept_reference(q, k, v, lengths, indices, block):
  """fp32 attention over the kept blocks of each (row, kv head): (out, lse)."""
  b, hq, d = q.shape
  n, hk = k.shape[1], k.shape[2]
  blk = jnp.arange(n) // block
  keep = jnp.any(indices[..., None] == blk, axis=2) & (jnp.arange(n) < lengths[:, None, None])
  s = jnp.einsum("bhgd,bnhd->bhgn", q.reshape(b, hk, hq // hk, d), k,
                 precision=jax.lax.Precision.HIGHEST) / np.sqrt(d)
  s = jnp.where(keep[:, :, None], s, -jnp.inf)
  lse = jax.nn.logsumexp(s, axis=-1)
  p = jnp.where(keep[:, :, None], jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0)[..., None]),
                0.0)
  out = jnp.einsum("bhgn,bnhd->bhgd", p, v, precision=jax.lax.Precision.HIGHEST)
  return out.reshape(b, hq, -1), lse.reshape(b, hq)


@pytest.mark.parametrize("impl,paged", ci_cases(
    [("xla", False), ("triton", True), ("triton", False)], [("triton", True), ("triton", False)]))
def test_sparse_decode_unified_max(impl, paged):
  """Sparse decode with softmax="unified_max" == the fp32 attention over the kept blocks, with
  the default estimate and with overshooting / -inf / NaN estimates, an empty row, paged and
  contiguous caches."""
  q, k, v = _inputs(110, 4, 256, 4, 2, 16)
  q = q * 20.0
  lengths = jnp.array([256, 0, 100, 170], jnp.int32)
  kw = dict(top_k=3, implementation=impl, interpret=True, return_lse=True,
            return_indices=True, num_splits=None if impl == "xla" else 3)
  est = jnp.stack([jnp.full((4,), -500.0), jnp.zeros(4), jnp.full((4,), -jnp.inf),
                   jnp.full((4,), jnp.nan)])
  if paged:
    kp, vp, table = _paginate(111, k, v, lengths, 16)
    summ = jattn.init_block_summaries(kp, lengths, block_size=16, page_table=table)
    call = functools.partial(jattn.sparse_paged_decode_attention, q, kp, vp, table, lengths,
                             summ, **kw)
  else:
    summ = jattn.init_block_summaries(k, lengths, block_size=16)
    call = functools.partial(jattn.sparse_decode_attention, q, k, v, lengths, summ,
                             block_size=16, **kw)
  for extra in (dict(softmax="unified_max"), dict(softmax="unified_max", max_estimate=est)):
    out, lse, idx = call(**extra)
    ref_out, ref_lse = _kept_reference(q, k, v, lengths, idx, 16)
    assert np.all(np.isfinite(np.asarray(out)))
    _check(out, lse, ref_out, ref_lse, lengths)
  with pytest.raises(ValueError, match="max_estimate applies"):
    call(max_estimate=est)


def test_a_schedule_that_misses_keys_is_refused():
  """A schedule whose units do not reach a sequence's visible key blocks (made for shorter
  lengths, or for a window the call does not have) raises ValueError naming it, eagerly and
  under ``debug_checks``; one that covers more than the call needs gives the exact result."""
  q, k = jax.random.normal(jax.random.key(0), (2, 8, 64)), jax.random.normal(
      jax.random.key(1), (2, 256, 2, 64))
  run = lambda lens, s, **kw: jattn.decode_attention(q, k, k, jnp.array(lens), schedule=s,
                                                     implementation="xla", **kw)
  s = jattn.decode_schedule(q, k, k, jnp.array([100, 9]), implementation="xla", max_units=4)
  np.testing.assert_allclose(run([60, 0], s), run([60, 0], None), rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match=r"schedule \(key blocks up to, per sequence\)\[0\] = 2"):
    run([250, 9], s)
  sw = jattn.decode_schedule(q, k, k, jnp.array([200, 9]), implementation="xla", max_units=4,
                             local_window_size=(10, 0))
  with pytest.raises(ValueError, match=r"schedule \(first key block of sequence\)\[0\] = 2"):
    run([200, 9], sw)
  f = jax.jit(lambda lens, s: jattn.decode_attention(q, k, k, lens, schedule=s,
                                                     implementation="xla"))
  with pytest.raises(ValueError, match="schedule"), jattn.debug_checks():
    f(jnp.array([250, 9]), s)
