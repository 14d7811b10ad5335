"""Masked keys never leak: NaN / inf at keys a query row cannot see leave that row's output, LSE
and every gradient that does not flow through a row seeing them bit-identical to the clean call;
a non-finite value at a visible key still makes the row NaN.

Hidden positions: padding (segment 0), other packed documents, outside the window, beyond
``kv_lengths``, unused pages, unselected sparse blocks. Each case runs the implementation twice,
on clean and on poisoned inputs, and compares with ``np.testing.assert_array_equal``.
CPU: the xla path (with a hypothesis property test), the Triton and Mosaic TPU kernels in
interpret mode, decode, paged decode, sparse attention and sparse decode, and the Transformer.
GPU (``pytest -m gpu``): the compiled Triton kernels and the Mosaic GPU kernels.
"""
from __future__ import annotations

import functools

import hypothesis
import hypothesis.strategies as hst
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import decode as dec
from jattn import sparse as sp
from jattn.sparse import block_sparse_attention, select_blocks
from jattn.sparse import decode as sdec
from pallas_kernels.masks import element_mask, normalize_window

POISONS = (np.nan, np.inf)
# the block selection as one jitted program per call shape
_select_blocks = jax.jit(select_blocks, static_argnames=("block_size", "q_block_size", "top_k"))


def _inputs(b, sq, sk, hq, hk, d, seed, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  q, k, v = (rng.standard_normal(s).astype(np.float32) for s in
             ((b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, d)))
  dout = rng.standard_normal((b, sq, hq, d)).astype(np.float32)
  dlse = rng.standard_normal((b, hq, sq)).astype(np.float32)
  return [jnp.asarray(x, dtype) for x in (q, k, v, dout)] + [jnp.asarray(dlse)]


def _decode_inputs(b, n, hq, hk, d, seed):
  """(rng, q [b, hq, d], k, v [b, n, hk, d]) in fp32 for the decode tests."""
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32)
             for s in ((b, hq, d), (b, n, hk, d), (b, n, hk, d)))
  return rng, q, k, v


def _poison(x, where_bk, value):
  """x [B, S, H, D] with ``value`` at positions where_bk [B, S] (every head and channel)."""
  return jnp.where(jnp.asarray(where_bk)[:, :, None, None], jnp.asarray(value, x.dtype), x)


def _fwd_bwd(fn, q, k, v, dout, dlse):
  (out, lse), vjp = jax.vjp(fn, q, k, v)
  return (out, lse) + vjp((dout, dlse))


def _visibility(sq, sk, *, causal=False, window=None, seg=None, block_mask=None):
  """Numpy bool [B | 1, Hq | 1, Sq, Sk] of which key each query row sees."""
  q_pos, k_pos = jnp.arange(sq) + (sk - sq), jnp.arange(sk)
  window = normalize_window(window)
  if seg is None:
    vis = element_mask(q_pos, k_pos, causal=causal, window=window)[None, None]
  else:
    seg = jnp.asarray(seg)
    vis = element_mask(q_pos, k_pos, causal=causal, window=window, q_seg=seg[:, None],
                       kv_seg=seg[:, None])
  if block_mask is not None:
    vis = vis & block_mask
  return np.asarray(vis)


def _assert_unchanged(fn, q, k, v, dout, dlse, vis, poison_bk, *, poison_k=True, poison_v=True,
                      fields=(0, 1, 2, 3, 4)):
  """Poison k and v at ``poison_bk`` [B, Sk] with NaN, then inf (``_compare``)."""
  run = jax.jit(lambda k, v: _fwd_bwd(fn, q, k, v, dout, dlse))   # one program, three inputs
  clean = run(k, v)
  poisoned = {val: run(_poison(k, poison_bk, val) if poison_k else k,
                       _poison(v, poison_bk, -val) if poison_v else v) for val in POISONS}
  _compare(clean, poisoned, q, k, vis, poison_bk, fields)


def _compare(clean, poisoned, q, k, vis, poison_bk, fields=(0, 1, 2, 3, 4)):
  """(out, lse, dq, dk, dv) of the clean call and of each poisoned one: the rows that see no
  poisoned key keep out, lse and dq, and the keys no such-poisoned row sees keep dk and dv
  (those of ``fields``)."""
  clean = [np.asarray(x) for x in clean]
  b, hq = q.shape[0], q.shape[2]
  hk = k.shape[2]
  vis = np.broadcast_to(vis, (b, hq) + vis.shape[2:])
  bad_rows = (vis & poison_bk[:, None, None, :]).any(-1)              # [B, Hq, Sq]
  good_rows = ~bad_rows.transpose(0, 2, 1)                             # [B, Sq, Hq]
  assert good_rows.any(), "the case hides the poison from no row"
  seen_by_bad = (vis & bad_rows[..., None]).any(2)                     # [B, Hq, Sk]
  good_keys = ~seen_by_bad.reshape(b, hk, hq // hk, -1).any(2).transpose(0, 2, 1)  # [B, Sk, Hk]
  clean[1] = clean[1].transpose(0, 2, 1)                              # lse [B, Sq, Hq]
  for got in poisoned.values():
    got = [np.asarray(x) for x in got]
    got[1] = got[1].transpose(0, 2, 1)
    for i in fields:
      sel = good_rows if i < 3 else good_keys
      np.testing.assert_array_equal(got[i][sel], clean[i][sel], err_msg=f"output {i}")


def _flash(impl, **kw):
  def fn(q, k, v):
    return jattn.flash_attention(q, k, v, return_lse=True, implementation=impl,
                                 interpret=impl != "xla", **kw)
  return fn


def _packed_segments(b, s, doc_lens):
  seg = np.zeros((b, s), np.int32)
  pos = 0
  for i, n in enumerate(doc_lens):
    seg[:, pos:pos + n] = i + 1
    pos += n
  return seg


# ---------------------------------------------------------------------- flash: xla, Triton, TPU
def _triton_blocks():
  from pallas_kernels.flash import triton
  return triton.BlockSizes(16, 16, dkv_q_chunk=16, dq_k_chunk=16)


FLASH_CASES = {   # name: (q_len, kv_len, mask kwargs, poisoned-key rule)
  "packed_docs": (48, 48, {"causal": True, "seg": (13, 20, 9)}, "doc2_and_pad"),
  "window": (48, 48, {"window": (5, 3)}, "tail"),
  "padding": (40, 40, {"seg": (17, 11)}, "pad"),
}


def _case(name, b=1):
  sq, sk, mask, rule = FLASH_CASES[name]
  seg = None if "seg" not in mask else _packed_segments(b, sq, mask["seg"])
  vis = _visibility(sq, sk, causal=mask.get("causal", False), window=mask.get("window"), seg=seg)
  if rule == "doc2_and_pad":
    poison = (seg == 2) | (seg == 0)
  elif rule == "pad":
    poison = seg == 0
  else:
    poison = np.zeros((b, sk), bool)
    poison[:, -8:] = True
  kw = {"causal": mask.get("causal", False), "local_window_size": mask.get("window")}
  if seg is not None:
    kw["segment_ids"] = jnp.asarray(seg)
  return sq, sk, kw, vis, poison


@pytest.mark.parametrize("impl", ["xla", "triton"])
@pytest.mark.parametrize("name", list(FLASH_CASES))
def test_flash_hidden_keys(impl, name):
  sq, sk, kw, vis, poison = _case(name)
  if impl == "triton":
    kw["block_sizes"] = _triton_blocks()
  q, k, v, dout, dlse = _inputs(1, sq, sk, 4, 2, 16, seed=len(name))
  fn = jax.jit(_flash(impl, **kw))
  _assert_unchanged(fn, q, k, v, dout, dlse, vis, poison)


def test_flash_hidden_keys_mosaic_tpu():
  """Two documents and padding across two 128-tiles (every tile partial)."""
  seg = _packed_segments(1, 256, (100, 120))
  vis = _visibility(256, 256, causal=True, seg=seg)
  q, k, v, dout, dlse = _inputs(1, 256, 256, 2, 1, 32, seed=3)
  fn = _flash("mosaic_tpu", causal=True, segment_ids=jnp.asarray(seg))
  _assert_unchanged(jax.jit(fn), q, k, v, dout, dlse, vis, (seg == 2) | (seg == 0))


@pytest.mark.parametrize("impl", ["xla", "triton", "mosaic_tpu"])
def test_flash_visible_nonfinite_propagates(impl):
  """A NaN in one channel of a visible value (or an inf key) makes every row that sees it NaN,
  and leaves the rows that do not see it finite."""
  s = 256 if impl == "mosaic_tpu" else 48
  seg = _packed_segments(1, s, (s // 2, s // 4))
  vis = _visibility(s, s, causal=True, seg=seg)[0, 0]
  q, k, v, _, _ = _inputs(1, s, s, 2, 1, 16, seed=5)
  kw = {"block_sizes": _triton_blocks()} if impl == "triton" else {}
  fn = jax.jit(_flash(impl, causal=True, segment_ids=jnp.asarray(seg), **kw))
  j = s // 2 + 2                                     # in document 2
  for kk, vv in ((k, v.at[0, j, 0, 3].set(jnp.nan)), (k.at[0, j, 0, :].set(jnp.inf), v)):
    out, lse = (np.asarray(x) for x in fn(q, kk, vv))
    sees = vis[:, j]
    assert np.isnan(out[0, sees]).all() and np.isnan(lse[0][:, sees]).all()
    assert np.isfinite(out[0, ~sees]).all()


@functools.cache
def _xla_fwd_bwd(causal):
  """jit(q, k, v, dout, dlse, seg, mask -> out, lse, dq, dk, dv) of the xla path; everything
  but ``causal`` is traced, so the property test compiles twice."""
  def run(q, k, v, dout, dlse, seg, mask):
    fn = functools.partial(jattn.flash_attention, causal=causal, segment_ids=seg, mask=mask,
                           return_lse=True, implementation="xla")
    return _fwd_bwd(fn, q, k, v, dout, dlse)
  return jax.jit(run)


GPU_CASES = {   # name: (seq, mask kwargs, poisoned-key rule) at the kernels' default tiles
  "packed_docs": (384, {"causal": True, "seg": (100, 150, 90)}, "doc2_and_pad"),
  "window": (384, {"causal": True, "window": (40, 0)}, "tail"),
}


def _gpu_case(name):
  s, mask, rule = GPU_CASES[name]
  seg = None if "seg" not in mask else _packed_segments(1, s, mask["seg"])
  vis = _visibility(s, s, causal=mask["causal"], window=mask.get("window"), seg=seg)
  poison = (seg == 2) | (seg == 0) if rule == "doc2_and_pad" else np.arange(s)[None] >= s - 50
  kw = {"causal": mask["causal"], "local_window_size": mask.get("window")}
  if seg is not None:
    kw["segment_ids"] = jnp.asarray(seg)
  return s, kw, vis, poison


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_triton_hidden_keys(name, dtype):
  """The compiled Triton kernels at their default tiles."""
  s, kw, vis, poison = _gpu_case(name)
  q, k, v, dout, dlse = _inputs(1, s, s, 4, 2, 64, seed=21, dtype=dtype)
  fn = jax.jit(lambda q, k, v: jattn.flash_attention(q, k, v, return_lse=True,
                                                     implementation="triton", **kw))
  _assert_unchanged(fn, q, k, v, dout, dlse, vis, poison)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_mosaic_hidden_keys(name):
  """The Mosaic GPU kernels (bf16; the backward on the xla forward's residuals): a hidden key's
  NaN / inf in k or v never reaches dq, dk and dv, and in k never reaches the forward's out and
  lse. (The forward's P V reads v from the shared-memory ring as loaded: a hidden non-finite v
  inside a partial tile is not covered.)"""
  from pallas_kernels import compat
  from pallas_kernels.flash import mosaic_gpu_bwd
  if compat.gpu_compute_capability() != (9, 0):
    pytest.skip("needs sm90 (Hopper)")
  s, kw, vis, poison = _gpu_case(name)
  q, k, v, dout, dlse = _inputs(1, s, s, 4, 2, 64, seed=22, dtype=jnp.bfloat16)

  @jax.jit
  def run(q, k, v):
    out, lse = jattn.flash_attention(q, k, v, return_lse=True, implementation="mosaic_gpu", **kw)
    ref_out, ref_lse = jattn.flash_attention(q, k, v, return_lse=True, implementation="xla", **kw)
    grads = mosaic_gpu_bwd.flash_attention_bwd(
        q, k, v, ref_out, ref_lse, dout, d_lse=dlse, causal=kw["causal"],
        local_window_size=kw["local_window_size"], q_segment_ids=kw.get("segment_ids"))
    return (out, lse) + tuple(grads)

  clean = run(q, k, v)
  cases = ((True, False, (0, 1, 2, 3, 4)), (False, True, (2, 3, 4)), (True, True, (2, 3, 4)))
  for pk, pv, fields in cases:   # poison k, poison v, the outputs that stay clean
    poisoned = {val: run(q, _poison(k, poison, val) if pk else k,
                         _poison(v, poison, -val) if pv else v) for val in POISONS}
    _compare(clean, poisoned, q, k, vis, poison, fields)


@hypothesis.given(data=hst.data())
def test_flash_hidden_keys_property_xla(data):
  """Random documents, padding, element masks, causality and poisoned keys on the xla path."""
  s = 16
  cuts = sorted(data.draw(hst.lists(hst.integers(1, s - 1), max_size=3, unique=True)))
  lens = np.diff([0] + cuts + [s]).tolist()
  seg = _packed_segments(1, s, lens)
  seg[:, s - data.draw(hst.integers(0, lens[-1] - 1)):] = 0           # trailing padding
  causal = data.draw(hst.booleans())
  bits = data.draw(hst.lists(hst.booleans(), min_size=s * s + s, max_size=s * s + s))
  mask = np.asarray(bits[:s * s]).reshape(1, 1, s, s) | np.eye(s, dtype=bool)
  poison = np.asarray(bits[s * s:])[None]
  vis = _visibility(s, s, causal=causal, seg=seg, block_mask=mask)
  hypothesis.assume(not (vis[0, 0] & poison[0]).any(-1).all())
  q, k, v, dout, dlse = _inputs(1, s, s, 2, 1, 8, seed=int(seg.sum()))
  run = _xla_fwd_bwd(causal)
  clean = run(q, k, v, dout, dlse, jnp.asarray(seg), jnp.asarray(mask))
  poisoned = {val: run(q, _poison(k, poison, val), _poison(v, poison, -val), dout, dlse,
                       jnp.asarray(seg), jnp.asarray(mask)) for val in POISONS}
  _compare(clean, poisoned, q, k, vis, poison)


# ---------------------------------------------------------------------- sparse attention
@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_block_sparse_unselected_blocks(impl):
  """Keys of blocks a query block does not select are hidden from its rows."""
  q, k, v, dout, dlse = _inputs(1, 64, 64, 2, 1, 16, seed=7)
  sel = _select_blocks(q, k, block_size=16, q_block_size=16, top_k=1)
  bm = np.asarray(sel.to_mask())
  vis = _visibility(64, 64, causal=True, block_mask=bm)
  poison = np.zeros((1, 64), bool)
  poison[:, 16:32] = True                            # block 1: unselected by some query blocks
  assert not vis[0, 0, 48:, 16:32].all()
  fn = jax.jit(lambda q, k, v: block_sparse_attention(q, k, v, sel, return_lse=True,
                                                      implementation=impl,
                                                      interpret=impl != "xla"))
  _assert_unchanged(fn, q, k, v, dout, dlse, vis, poison)


@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_gate_gradients_unselected_blocks(impl):
  """The gate gradient of a query block whose rows see no poisoned key stays the clean one
  (document 1 poisoned; document 2's query blocks keep the block it shares with document 1)."""
  from jattn.sparse.attention import _gated_attention, block_sparse_plan
  q, k, v, dout, dlse = _inputs(1, 64, 64, 2, 1, 16, seed=9)
  seg = jnp.asarray(_packed_segments(1, 64, (24, 40)))
  sel = _select_blocks(q, k, block_size=16, q_block_size=16, top_k=1, segment_ids=seg)
  poison = np.asarray(seg) == 1
  assert (np.asarray(sel.indices)[0, 0, 2:] == 1).any()   # a doc-2 query block keeps block 1
  plan = block_sparse_plan(q, k, v, sel, segment_ids=seg, implementation=impl,
                           interpret=impl != "xla")
  gate = jnp.zeros(sel.indices.shape, jnp.float32)
  good_blocks = np.arange(4) >= 2

  @jax.jit
  def dgate(k, v):
    fn = lambda g: _gated_attention(q, k, v, g, sel, seg, seg, True, 0.25, plan,
                                    impl != "xla")
    _, vjp = jax.vjp(fn, gate)
    return vjp((dout, dlse))[0]
  clean = np.asarray(dgate(k, v))
  for value in POISONS:
    got = np.asarray(dgate(_poison(k, poison, value), _poison(v, poison, -value)))
    np.testing.assert_array_equal(got[:, :, good_blocks], clean[:, :, good_blocks])
    assert np.isnan(got[:, :, ~good_blocks]).any()


@pytest.mark.parametrize("impl", ["xla", "triton"])
@pytest.mark.parametrize("opts", [dict(gate_grad="ste"), dict(score_aux_weight=0.5),
                                  dict(gate_grad="gumbel", rng=jax.random.key(3))])
def test_sparse_attention_scores_hide_keys(impl, opts):
  """``sparse_attention`` with a gate or the score distillation: a NaN / inf key at padding, or
  (with a gate) one only the last query block sees, leaves the other query blocks' dq
  bit-identical (the mean-pooled scores never read padding; a non-finite block mean counts as
  0). The distillation loss is one mean over query blocks: a key that a row sees moves it."""
  q, k, v, _, _ = _inputs(1, 128, 128, 2, 1, 16, seed=31)
  seg = jnp.asarray(np.r_[np.ones(100), np.zeros(28)][None].astype(np.int32))
  loss = lambda q, k, seg, rows: sp.sparse_attention(
      q, k, v, block_size=16, q_block_size=16, top_k=2, causal=True, segment_ids=seg,
      implementation=impl, interpret=impl != "xla", **opts)[0, :rows].sum()
  dq = jax.jit(jax.grad(loss), static_argnums=3)
  for value in POISONS:
    cases = ((110, seg, 100, 100),) + (((127, None, 127, 112),) if "gate_grad" in opts else ())
    for where, s, rows, good in cases:
      clean = np.asarray(dq(q, k, s, rows))
      got = np.asarray(dq(q, k.at[0, where].set(value), s, rows))
      np.testing.assert_array_equal(got[0, :good], clean[0, :good])


# ---------------------------------------------------------------------- decode
def _decode_fn(impl, paged, **kw):
  def fn(q, k, v, lens, table=None):
    if paged:
      return dec.paged_decode_attention(q, k, v, table, lens, return_lse=True,
                                        implementation=impl, interpret=impl != "xla", **kw)
    return dec.decode_attention(q, k, v, lens, return_lse=True, implementation=impl,
                                interpret=impl != "xla", **kw)
  return fn


@pytest.mark.parametrize("impl", ["xla", "triton", "mosaic_tpu"])
def test_decode_hidden_keys(impl):
  """Contiguous cache: keys beyond kv_lengths and outside the window; paged cache: unused
  slots of used pages and unused pages."""
  b, n, hq, hk, d, ps = 2, 64, 4, 2, 16, 16
  rng, q, k, v = _decode_inputs(b, n, hq, hk, d, seed=11)
  lens = jnp.asarray([37, 50], jnp.int32)
  hidden = (np.arange(n)[None] >= np.asarray(lens)[:, None]) | (
      np.arange(n)[None] < np.asarray(lens)[:, None] - 1 - 20)      # window (20, 0)
  fn = jax.jit(_decode_fn(impl, False, local_window_size=(20, 0), num_splits=2))
  clean = [np.asarray(x) for x in fn(q, k, v, lens)]
  for value in POISONS:
    got = fn(q, _poison(k, hidden, value), _poison(v, hidden, -value), lens)
    for g, c in zip(got, clean):
      np.testing.assert_array_equal(np.asarray(g), c)
  seen = np.zeros((b, n), bool)
  seen[0, 30] = True                                  # visible to sequence 0 only
  out, _ = (np.asarray(x) for x in fn(q, k, _poison(v, seen, np.nan), lens))
  assert np.isnan(out[0]).all()
  np.testing.assert_array_equal(out[1], clean[0][1])
  # paged: 5 pages of 16 per sequence in a pool of 12; pages 10, 11 unused
  table = jnp.asarray([[3, 0, 7, 1, 9], [2, 8, 4, 6, 5]], jnp.int32)
  kp = jnp.asarray(rng.standard_normal((12, ps, hk, d)), jnp.float32)
  vp = jnp.asarray(rng.standard_normal((12, ps, hk, d)), jnp.float32)
  used = np.zeros((12, ps), bool)
  for row, length in zip(np.asarray(table), np.asarray(lens)):
    for t in range(int(length)):
      used[row[t // ps], t % ps] = True
  pfn = jax.jit(_decode_fn(impl, True, num_splits=2))
  clean = [np.asarray(x) for x in pfn(q, kp, vp, lens, table)]
  for value in POISONS:
    got = pfn(q, _poison(kp, ~used, value), _poison(vp, ~used, -value), lens, table)
    for g, c in zip(got, clean):
      np.testing.assert_array_equal(np.asarray(g), c)


@pytest.mark.parametrize("impl", ["xla", "triton", "mosaic_tpu"])
def test_sparse_decode_hidden_keys(impl):
  """Keys beyond kv_lengths and in blocks the selection does not keep."""
  b, n, hq, hk, d, bs = 2, 128, 4, 2, 16, 16
  _, q, k, v = _decode_inputs(b, n, hq, hk, d, seed=13)
  lens = jnp.asarray([70, 121], jnp.int32)
  summ = sdec.init_block_summaries(k, lens, block_size=bs)
  fn = jax.jit(functools.partial(sdec.sparse_decode_attention, block_size=bs, top_k=1,
                                 return_lse=True, return_indices=True, implementation=impl,
                                 interpret=impl != "xla"))
  out, lse, idx = (np.asarray(x) for x in fn(q, k, v, lens, summ))
  kept = np.zeros((b, hk, n // bs), bool)
  for bi in range(b):
    for h in range(hk):
      kept[bi, h, idx[bi, h][idx[bi, h] >= 0]] = True
  # a block hidden from both kv heads, and every position past the length
  hidden = np.repeat(~kept.any(1), bs, axis=1) | (np.arange(n)[None] >= np.asarray(lens)[:, None])
  assert (hidden & (np.arange(n)[None] < np.asarray(lens)[:, None])).any()
  for value in POISONS:
    # the summaries stay the clean ones: the selection is the same, the hidden keys change
    got = fn(q, _poison(k, hidden, value), _poison(v, hidden, -value), lens, summ)
    for g, c in zip(got, (out, lse, idx)):
      np.testing.assert_array_equal(np.asarray(g), c)


# ---------------------------------------------------------------------- the Transformer
@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_transformer_oov_token_stays_in_its_document(impl):
  """An out-of-vocabulary token id (a NaN embedding) in one packed document leaves the other
  documents' logits finite and equal to the clean call's."""
  from flax import nnx

  from jattn.nn import LayerSpec, Transformer, TransformerConfig
  layers = (LayerSpec("global"), LayerSpec("local", window=6))
  if impl == "xla":   # the Triton kernels take blocks of >= 16
    layers += (LayerSpec("sparse", block_size=4, top_k=1, q_block_size=4),)
  cfg = TransformerConfig(vocab_size=37, num_layers=len(layers), d_model=32, num_heads=4,
                          num_kv_heads=2, head_dim=8, layers=layers, implementation=impl,
                          interpret=impl != "xla")
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  seg = _packed_segments(2, 40, (12, 17, 7))
  pos = np.concatenate([np.arange(n) for n in (12, 17, 7, 4)])[None].repeat(2, 0)
  tokens = np.random.default_rng(1).integers(0, 37, (2, 40))
  fwd = nnx.jit(lambda m, t: m(t, jnp.asarray(seg), jnp.asarray(pos)))
  clean = np.asarray(fwd(model, jnp.asarray(tokens)))
  bad = tokens.copy()
  bad[0, 15] = 10_000                                # document 2 of row 0
  got = np.asarray(fwd(model, jnp.asarray(bad)))
  other = seg != 2
  other[1] = True
  assert np.isnan(got[0, seg[0] == 2][3:]).all()    # the document itself: NaN from the token on
  np.testing.assert_array_equal(got[other], clean[other])
  assert np.isfinite(got[other]).all()
