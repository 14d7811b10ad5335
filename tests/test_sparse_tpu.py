"""Sparse decode with implementation="mosaic_tpu": TPU interpreter on CPU, and TPU lowering.

The kernel (pallas_kernels/sparse/decode_tpu.py) is compared with the fp32 reference attention
restricted to the XLA selection (which the "mosaic_tpu" path uses too). The TPU interpreter runs
the grid step by step, so the sizes are small: 16-token blocks, a few kv heads and slots.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jattn import sparse as sp
from pallas_kernels.flash.reference import attention_reference
from pallas_kernels.sparse import decode_tpu

from test_sparse import _narrow_value_decode_inputs, _rel
from tests.helpers import normal


def _reference(q, kc, vc, lens, idx, bs):
  """fp32 attention over the kept blocks' positions < lens: (out [b, hq, dv], lse [b, hq])."""
  b, n, hk, _ = kc.shape
  idx = np.asarray(idx)
  mask = np.zeros((b, hk, 1, n), bool)
  for bi in range(b):
    for g in range(hk):
      for j in idx[bi, g][idx[bi, g] >= 0]:
        mask[bi, g, 0, j * bs:min((j + 1) * bs, int(lens[bi]))] = True
  up = lambda x: jnp.asarray(x, jnp.float32)
  out, lse = attention_reference(up(q)[:, None], up(kc), up(vc), block_mask=jnp.asarray(mask))
  return out[:, 0], lse[:, :, 0], mask


def _run(q, cache, lens, summ, *, bs, top_k, paged, **kw):
  kw = dict(top_k=top_k, return_lse=True, return_indices=True, **kw)
  if paged:
    kp, vp, table = cache
    return jax.jit(functools.partial(sp.sparse_paged_decode_attention, **kw))(
        q, kp, vp, table, lens, summ)
  kc, vc = cache
  return jax.jit(functools.partial(sp.sparse_decode_attention, block_size=bs, **kw))(
      q, kc, vc, lens, summ)


def _check(out, lse, ref, ref_lse, lens, tol):
  assert not np.isnan(np.asarray(out, np.float32)).any()
  assert _rel(out, ref) < tol, _rel(out, ref)
  empty = np.asarray(lens) == 0
  assert np.all(np.asarray(out, np.float32)[empty] == 0)
  assert np.all(np.isneginf(np.asarray(lse)[empty]))
  np.testing.assert_allclose(np.asarray(lse)[~empty], np.asarray(ref_lse)[~empty], rtol=1e-4,
                             atol=1e-4)


@pytest.mark.parametrize("d,dv,hq,hk,dtype,tol", [
    pytest.param(128, 128, 8, 2, jnp.float32, 2e-3, marks=pytest.mark.slow),  # GQA 4, D128
    (128, 128, 8, 2, jnp.bfloat16, 2e-2),   # bf16 (16-row sublane tiles)
    # head_dim 72: every head's rows, strided loads
    pytest.param(72, 72, 6, 2, jnp.float32, 2e-3, marks=pytest.mark.slow),
    (48, 32, 6, 2, jnp.float32, 2e-3),      # values narrower than keys, GQA 3
    # MLA-like, one kv head: full-width lane blocks
    pytest.param(72, 40, 4, 1, jnp.float32, 2e-3, marks=pytest.mark.slow),
])
def test_sparse_decode_mosaic_tpu_interpret(d, dv, hq, hk, dtype, tol):
  """Contiguous and paged (shuffled pages, NaN spare pages, garbage table entries past the
  lengths) against the fp32 reference over the XLA selection, which both paths return. Lengths:
  0, 1, a length ending mid-block (45 = 2 blocks + 13) whose 3 visible blocks leave 1 candidate
  for top_k = 2 (so a -1 padded slot is skipped), and a full cache (100, a partial last
  block; 4 of its 7 blocks kept)."""
  b, n, bs, top_k = 4, 100, 16, 2
  lens = [100, 0, 1, 45]
  q, kc, vc, kp, vp, table = _narrow_value_decode_inputs(60 + d + hk, b, n, hq, hk, d, dv, bs,
                                                         lens, dtype)
  lens = jnp.array(lens, jnp.int32)
  summ = sp.init_block_summaries(kc, lens, block_size=bs)
  psumm = sp.init_block_summaries(kp, lens, block_size=bs, page_table=table)
  idx_x = jax.jit(functools.partial(sp.select_decode_blocks, top_k=top_k))(q, summ, lens)
  assert int(jnp.sum(idx_x[3] >= 0)) == 3 * hk and idx_x.shape[-1] == 4   # top_k > visible
  ref, ref_lse, mask = _reference(q, kc, vc, lens, idx_x, bs)
  assert mask[0].sum() < hk * n                                   # sparse: blocks were skipped
  for paged, cache, s in ((False, (kc, vc), summ), (True, (kp, vp, table), psumm)):
    out, lse, idx = _run(q, cache, lens, s, bs=bs, top_k=top_k, paged=paged,
                         implementation="mosaic_tpu", interpret=True)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(idx_x))
    assert out.shape == (b, hq, dv) and out.dtype == dtype and lse.dtype == jnp.float32
    _check(out, lse, ref, ref_lse, lens, tol)


def test_sparse_decode_mosaic_tpu_kernel_lists():
  """The kernel alone: unsorted lists, explicit counts shorter than the -1 padding would say
  (slots past a count are skipped even if they hold ids), a kept block past the length (all
  masked: no NaN) and an empty list (count 0) next to a full one."""
  b, n, hq, hk, d, bs = 2, 64, 4, 2, 128, 16
  q, kc, vc = normal(70, (b, hq, d), (b, n, hk, d), (b, n, hk, d))
  lens = jnp.array([40, 64], jnp.int32)
  idx = jnp.array([[[2, 0, 3], [1, 2, 0]], [[3, 1, 0], [0, 2, 1]]], jnp.int32)
  counts = jnp.array([[3, 1], [0, 3]], jnp.int32)
  out, lse = decode_tpu.sparse_decode(q, kc, vc, lens, idx, counts, block_size=bs,
                                      interpret=True)
  kept = jnp.where(jnp.arange(3) < counts[..., None], idx, -1)
  ref, ref_lse, _ = _reference(q, kc, vc, lens, kept, bs)
  assert _rel(out, ref) < 2e-3
  assert np.all(np.asarray(out[1, :2]) == 0) and np.all(np.isneginf(np.asarray(lse[1, :2])))
  np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-4, atol=1e-4)


def test_sparse_decode_mosaic_tpu_errors():
  q = jnp.ones((1, 4, 128)); k = jnp.ones((1, 64, 2, 128))
  lens = jnp.array([40])
  summ = sp.init_block_summaries(k, lens, block_size=16)
  kw = dict(block_size=16, top_k=1, implementation="mosaic_tpu", interpret=True)
  with pytest.raises(ValueError, match="num_splits"):
    sp.sparse_decode_attention(q, k, k, lens, summ, num_splits=2, **kw)
  with pytest.raises(ValueError, match="multiple of 16"):     # 8-token blocks of a bf16 cache
    kb = k.astype(jnp.bfloat16)
    sp.sparse_decode_attention(q, kb, kb, lens, sp.init_block_summaries(kb, lens, block_size=8),
                               **{**kw, "block_size": 8})
  with pytest.raises(ValueError, match="implementation"):
    sp.sparse_decode_attention(q, k, k, lens, summ, **{**kw, "implementation": "no_such_impl"})


def _export_tpu(f, *args):
  return jax.export.export(jax.jit(f), platforms=["tpu"])(*args).mlir_module()


def test_sparse_decode_mosaic_tpu_lowers_for_tpu():
  """B1, 128K cache, GQA 32:8, D128, 64-token blocks, bf16 (the bench's decode case),
  contiguous and paged; plus the all-heads-rows layout (head_dim 72)."""
  S = jax.ShapeDtypeStruct
  bf16 = jnp.bfloat16
  n, bs, hq, hk, d = 131072, 64, 32, 8, 128
  nb = n // bs
  summ = sp.BlockSummaries(sums=S((1, nb, hk, d), jnp.float32), lengths=S((1,), jnp.int32),
                           block_size=bs)
  f = functools.partial(sp.sparse_decode_attention, block_size=bs, top_k=387,
                        implementation="mosaic_tpu")
  mlir = _export_tpu(f, S((1, hq, d), bf16), S((1, n, hk, d), bf16), S((1, n, hk, d), bf16),
                     S((1,), jnp.int32), summ)
  assert "tpu_custom_call" in mlir and "jattn_sparse_decode_tpu" in mlir
  g = functools.partial(sp.sparse_paged_decode_attention, top_k=387, implementation="mosaic_tpu")
  mlir = _export_tpu(g, S((1, hq, d), bf16), S((nb + 16, bs, hk, d), bf16),
                     S((nb + 16, bs, hk, d), bf16), S((1, nb), jnp.int32), S((1,), jnp.int32),
                     summ)
  assert "jattn_sparse_paged_decode_tpu" in mlir
  rows = functools.partial(decode_tpu.sparse_decode, block_size=bs)
  mlir = _export_tpu(rows, S((2, 8, 72), bf16), S((2, 4096, 2, 72), bf16),
                     S((2, 4096, 2, 72), bf16), S((2,), jnp.int32), S((2, 2, 16), jnp.int32))
  assert "jattn_sparse_decode_tpu" in mlir


def test_sparse_decode_default_is_mosaic_tpu_on_tpu(monkeypatch):
  """implementation=None picks the Mosaic TPU kernel when the default backend is a TPU (and
  stays XLA on the CPU)."""
  S = jax.ShapeDtypeStruct
  summ = sp.BlockSummaries(sums=S((1, 16, 2, 128), jnp.float32), lengths=S((1,), jnp.int32),
                           block_size=64)
  args = (S((1, 8, 128), jnp.bfloat16), S((1, 1024, 2, 128), jnp.bfloat16),
          S((1, 1024, 2, 128), jnp.bfloat16), S((1,), jnp.int32), summ)
  # A fresh function per export: jit would reuse the first trace.
  f = lambda: functools.partial(sp.sparse_decode_attention, block_size=64, top_k=2)
  assert "tpu_custom_call" not in _export_tpu(f(), *args)
  monkeypatch.setattr(sp.decode.compat, "default_backend", lambda: "tpu")
  assert "jattn_sparse_decode_tpu" in _export_tpu(f(), *args)
