"""jattn.decode with implementation="mosaic_tpu": TPU interpreter on CPU, and TPU lowering.

The TPU interpreter runs grid step by step, so the sizes are tiny and the calls few.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jattn import decode as dec
from pallas_kernels.decode import mosaic_tpu as dtpu
from pallas_kernels.decode import reference as dref

from test_decode import TOL, _inputs, _paginate, _rel

_REF = jax.jit(dref.decode_reference, static_argnames=(
    "scale", "local_window_size", "logits_soft_cap", "num_splits", "upcast"))


def _check(out, lse, ref_out, ref_lse, lengths, tol):
  assert _rel(out, ref_out) < tol, _rel(out, ref_out)
  empty = np.asarray(lengths) == 0
  assert bool(jnp.all(out[empty] == 0)) and bool(jnp.all(jnp.isneginf(lse[empty])))
  np.testing.assert_allclose(np.asarray(lse[~empty]), np.asarray(ref_lse[~empty]), rtol=tol,
                             atol=tol)


@pytest.mark.parametrize("dtype,hk,group,lengths,window,cap,splits,block_k", [
    # GQA 3, fp32, zero- and one-token sequences, window + soft cap, 3 splits, partial block.
    (jnp.float32, 2, 3, [0, 1, 77], (50, 0), 5.0, 3, 16),
    # bf16, 4 kv heads (strided 16-bit loads), default split count (1).
    (jnp.bfloat16, 4, 2, [100, 9], None, None, None, 32),
])
def test_mosaic_tpu_decode_interpret(dtype, hk, group, lengths, window, cap, splits, block_k):
  q, k, v = _inputs(20, len(lengths), 100, hk * group, hk, 32, dtype)
  lengths = jnp.array(lengths, jnp.int32)
  ref_out, ref_lse = _REF(q, k, v, lengths, local_window_size=window, logits_soft_cap=cap)
  out, lse = dec.decode_attention(q, k, v, lengths, local_window_size=window,
                                  logits_soft_cap=cap, num_splits=splits, return_lse=True,
                                  implementation="mosaic_tpu", interpret=True,
                                  block_sizes=dtpu.DecodeBlockSizes(block_k=block_k))
  assert out.dtype == dtype
  _check(out, lse, ref_out, ref_lse, lengths, TOL[dtype])


def test_mosaic_tpu_paged_decode_interpret():
  """Two pages per step (block_k 32, page 16), shuffled table with garbage past the lengths."""
  lengths = [0, 33, 70]
  q, k, v = _inputs(21, 3, 70, 4, 2, 32)
  ref_out, ref_lse = _REF(q, k, v, jnp.array(lengths, jnp.int32), local_window_size=(50, 0))
  k_pages, v_pages, table = _paginate(22, k, v, lengths, 16)
  out, lse = dec.paged_decode_attention(q, k_pages, v_pages, table, jnp.array(lengths, jnp.int32),
                                        local_window_size=(50, 0), num_splits=2, return_lse=True,
                                        implementation="mosaic_tpu", interpret=True,
                                        block_sizes=dtpu.DecodeBlockSizes(block_k=32))
  _check(out, lse, ref_out, ref_lse, lengths, 2e-3)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_mosaic_tpu_decode_lowers_for_tpu(dtype):
  S = jax.ShapeDtypeStruct
  f = functools.partial(dec.decode_attention, local_window_size=(1000, 0), logits_soft_cap=30.0,
                        num_splits=4, implementation="mosaic_tpu")
  exp = jax.export.export(jax.jit(f), platforms=["tpu"])(
      S((2, 32, 128), dtype), S((2, 4096, 8, 128), dtype), S((2, 4096, 8, 128), dtype),
      S((2,), jnp.int32))
  assert "tpu_custom_call" in exp.mlir_module()
  g = functools.partial(dec.paged_decode_attention, num_splits=2, implementation="mosaic_tpu")
  exp = jax.export.export(jax.jit(g), platforms=["tpu"])(
      S((2, 32, 128), dtype), S((100, 64, 8, 128), dtype), S((100, 64, 8, 128), dtype),
      S((2, 40), jnp.int32), S((2,), jnp.int32))
  assert "tpu_custom_call" in exp.mlir_module()


def test_mosaic_tpu_decode_values_narrower_than_keys_interpret():
  """MLA-shaped caches (values narrower than keys): contiguous d 48 / dv 32 with GQA 3 and
  zero- and one-token sequences; paged d 72 / dv 40, two pages per step through a shuffled
  table. The output has the value width and equals the fp32 reference."""
  q, k, v = _inputs(23, 3, 48, 6, 2, 48, dv=32)
  lengths = jnp.array([0, 1, 45], jnp.int32)
  ref_out, ref_lse = _REF(q, k, v, lengths)
  out, lse = dec.decode_attention(q, k, v, lengths, num_splits=2, return_lse=True,
                                  implementation="mosaic_tpu", interpret=True,
                                  block_sizes=dtpu.DecodeBlockSizes(block_k=16))
  assert out.shape == (3, 6, 32)
  _check(out, lse, ref_out, ref_lse, lengths, 2e-3)

  lengths = [1, 0, 40]
  q, k, v = _inputs(24, 3, 40, 4, 2, 72, dv=40)
  ref_out, ref_lse = _REF(q, k, v, jnp.array(lengths, jnp.int32))
  k_pages, v_pages, table = _paginate(25, k, v, lengths, 16)
  out, lse = dec.paged_decode_attention(q, k_pages, v_pages, table, jnp.array(lengths, jnp.int32),
                                        num_splits=1, return_lse=True,
                                        implementation="mosaic_tpu", interpret=True,
                                        block_sizes=dtpu.DecodeBlockSizes(block_k=32))
  assert out.shape == (3, 4, 40)
  _check(out, lse, ref_out, ref_lse, lengths, 2e-3)


def test_mosaic_tpu_decode_mla_shapes_lower_for_tpu():
  """Keys 192 wide (128 + 64 rope dims), values 128: contiguous and paged kernels lower."""
  S = jax.ShapeDtypeStruct
  bf16 = jnp.bfloat16
  f = functools.partial(dec.decode_attention, num_splits=2, implementation="mosaic_tpu")
  exp = jax.export.export(jax.jit(f), platforms=["tpu"])(
      S((2, 16, 192), bf16), S((2, 4096, 1, 192), bf16), S((2, 4096, 1, 128), bf16),
      S((2,), jnp.int32))
  assert "tpu_custom_call" in exp.mlir_module()
  g = functools.partial(dec.paged_decode_attention, num_splits=2, implementation="mosaic_tpu")
  exp = jax.export.export(jax.jit(g), platforms=["tpu"])(
      S((2, 16, 192), bf16), S((100, 64, 1, 192), bf16), S((100, 64, 1, 128), bf16),
      S((2, 40), jnp.int32), S((2,), jnp.int32))
  assert "tpu_custom_call" in exp.mlir_module()
