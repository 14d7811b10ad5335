"""One case matrix, every implementation: ``jattn.flash_attention`` forward (out, LSE) and VJP
against the fp32 reference (``attention_reference`` at HIGHEST precision on upcast inputs).

Each implementation declares what it supports (``CAPS``): a case it supports must match the
reference within the dtype's tolerance; a case it does not must raise NotImplementedError or
ValueError naming the option (checked by tracing only, so it costs no kernel run).

CPU: "xla", and "triton" / "mosaic_tpu" in the Pallas interpreter, at small sizes (``CASES``).
GPU (``pytest -m gpu``): "triton", "mosaic_gpu" and "cudnn" compiled, at moderate sizes
(``GPU_CASES``).
"""
from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from pallas_kernels.flash.reference import attention_reference
from tests import helpers

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16


@dataclasses.dataclass(frozen=True)
class Case:
  """One cell of the matrix: shapes, mask, dtype. ``segments``: None, "packed" (documents with
  one-token ones, a padded tail, the last batch row all padding when batch > 1) or "left_negative"
  (padding at the start, negative ids: ordinary ids)."""
  batch: int = 1
  q_len: int = 64
  kv_len: int | None = None
  q_heads: int = 2
  kv_heads: int = 2
  head_dim: int = 32
  head_dim_v: int | None = None
  dtype: object = F32
  causal: bool = False
  window: object = None
  segments: str | None = None
  soft_cap: float | None = None

  @property
  def sk(self):
    return self.q_len if self.kv_len is None else self.kv_len


CASES = {
    # dense, MQA 4:1, batch 2, v head dim != qk head dim
    "dense_mqa_dv48": Case(batch=2, q_heads=4, kv_heads=1, head_dim_v=48),
    # head_dim 72 (padded inside the kernels), odd length, GQA 2:1, soft cap
    "causal_gqa_d72_softcap": Case(q_len=100, q_heads=4, head_dim=72, causal=True, soft_cap=2.0),
    # q shorter than kv: causal aligned bottom-right, with a window
    "causal_window_q_shorter": Case(q_len=40, kv_len=100, causal=True, window=(30, 0)),
    # q longer than kv, causal: the first 60 queries see no key (0 output, -inf LSE, 0 grads)
    "causal_q_longer_empty_rows": Case(q_len=100, kv_len=40, causal=True),
    # two-sided int window on a length that is a multiple of no tile, GQA 2:1
    "window_int_gqa": Case(q_len=130, q_heads=4, window=20),
    # a window unbounded on the right, q_len != kv_len
    "window_left_only": Case(q_len=77, kv_len=90, window=(30, None)),
    # packed documents (one-token ones), padded tail, a fully padded batch row; causal window
    "segments_packed_causal_window": Case(batch=2, q_len=90, kv_len=110, q_heads=4,
                                          causal=True, window=(40, 0), segments="packed"),
    # padding at the start and negative ids
    "segments_left_padding_negative_ids": Case(batch=2, q_len=93, q_heads=4,
                                               segments="left_negative"),
    "bf16_d96_causal_gqa": Case(q_len=72, q_heads=4, head_dim=96, dtype=BF16, causal=True),
    "fp16_d64_causal_window_softcap": Case(q_len=72, q_heads=2, kv_heads=1, head_dim=64,
                                           dtype=F16, causal=True, window=(20, 0), soft_cap=5.0),
}

GPU_CASES = {
    "bf16_d128_causal_gqa": Case(batch=2, q_len=1000, q_heads=8, head_dim=128, dtype=BF16,
                                 causal=True),
    "bf16_d128_causal_window": Case(q_len=1000, q_heads=4, kv_heads=4, head_dim=128, dtype=BF16,
                                    causal=True, window=(255, 0)),
    "bf16_d64_dense_q_shorter": Case(q_len=512, kv_len=1000, q_heads=4, head_dim=64, dtype=BF16),
    "bf16_d64_segments": Case(batch=2, q_len=1024, q_heads=4, head_dim=64, dtype=BF16,
                              segments="packed"),
    "bf16_d256_causal": Case(q_len=384, head_dim=256, dtype=BF16, causal=True),
    "bf16_d256_ragged_gqa": Case(q_len=1000, kv_len=1111, q_heads=4, head_dim=256, dtype=BF16),
    "fp16_d96_mqa_causal": Case(batch=2, q_len=640, q_heads=4, kv_heads=1, head_dim=96,
                                dtype=F16, causal=True),
    "fp16_d128_softcap": Case(q_len=513, head_dim=128, dtype=F16, soft_cap=20.0),
    "fp32_d72_causal_window": Case(q_len=777, kv_len=900, q_heads=4, head_dim=72, causal=True,
                                   window=(63, 0)),
}


@dataclasses.dataclass(frozen=True)
class Caps:
  """What an implementation supports through ``jattn.flash_attention``."""
  dtypes: tuple = (F32, BF16, F16)
  head_dims: tuple | None = None   # None: 1..max_head_dim
  max_head_dim: int | None = None
  head_dim_v: bool = True          # head_dim_v != head_dim
  segments: bool = True
  soft_cap: bool = True
  lse: bool = True                 # return_lse
  causal_q_ne_kv: bool = True      # causal with q_len != kv_len (bottom-right)
  one_sided_window: bool = True    # a window side of None
  ragged_d256: bool = True         # head_dim 256 with lengths not multiples of 64 (cuDNN on
                                   # jax 0.11.2 refuses Q 1000 / KV 1111 there: seen on an H100)

  def unsupported(self, c: Case) -> str | None:
    """The option of ``c`` this implementation rejects (a word of its error), or None."""
    d = c.head_dim
    if self.head_dims is not None and d not in self.head_dims or (
        self.max_head_dim is not None and d > self.max_head_dim):
      return "head_dim"
    if jnp.dtype(c.dtype) not in {jnp.dtype(t) for t in self.dtypes}:
      return "dtype"
    if not self.head_dim_v and c.head_dim_v not in (None, d):
      return "head_dim_v"
    if not self.segments and c.segments:
      return "segment ids"
    if not self.soft_cap and c.soft_cap is not None:
      return "soft_cap"
    if not self.causal_q_ne_kv and c.causal and c.sk != c.q_len:
      return "q_len != kv_len"
    if not self.one_sided_window and isinstance(c.window, tuple) and None in c.window:
      return "window"
    if not self.ragged_d256 and d == 256 and (c.q_len % 64 or c.sk % 64):
      return "sequence length"
    return None


CAPS = {
    "xla": Caps(),
    "triton": Caps(max_head_dim=256),
    "mosaic_tpu": Caps(),
    "mosaic_gpu": Caps(dtypes=(BF16, F16), head_dims=(64, 128, 256), head_dim_v=False),
    "cudnn": Caps(dtypes=(BF16, F16), segments=False, soft_cap=False, lse=False,
                  causal_q_ne_kv=False, one_sided_window=False, ragged_d256=False),
}


def _inputs(name, c: Case):
  rng = np.random.default_rng(zlib.crc32(name.encode()))
  q, k, v = helpers.random_qkv(rng, c.batch, c.q_len, c.sk, c.q_heads, c.kv_heads,
                               c.head_dim, c.head_dim_v, c.dtype)
  q_seg = kv_seg = None
  if c.segments == "packed":
    q_seg = helpers.packed_segments(rng, c.batch, c.q_len, pad_tail=c.q_len // 8)
    if c.batch > 1:
      q_seg[-1] = 0  # a batch row of padding only: every query sees no key
    # kv: a prefix of document 1 (keys only), then the queries' documents
    kv_seg = np.concatenate([np.ones((c.batch, c.sk - c.q_len), np.int32), q_seg], axis=1)
  elif c.segments == "left_negative":
    q_seg = helpers.packed_segments(rng, c.batch, c.q_len, pad_head=13, one_token_docs=False)
    q_seg[1:] = -q_seg[1:]
    kv_seg = q_seg
  if q_seg is not None:
    q_seg, kv_seg = jnp.asarray(q_seg), jnp.asarray(kv_seg)
  d_out = jnp.asarray(rng.standard_normal(q.shape[:3] + v.shape[3:], np.float32))
  d_lse = jnp.asarray(rng.standard_normal((c.batch, c.q_heads, c.q_len), np.float32))
  return (q, k, v), (q_seg, kv_seg), (d_out, d_lse)


def _mask_kwargs(c: Case, q_seg, kv_seg):
  return dict(causal=c.causal, local_window_size=c.window, segment_ids=q_seg,
              kv_segment_ids=kv_seg, logits_soft_cap=c.soft_cap)


def _fwd_vjp(f, qkv, cts, with_lse):
  """(out, lse, grads) of ``f(q, k, v) -> (out, lse)`` under one jit; without ``with_lse`` the
  VJP takes no LSE cotangent (the LSE is still returned when ``f`` gives one)."""
  def run(q, k, v, d_out, d_lse):
    (out, lse), vjp = jax.vjp(f, q, k, v)
    if with_lse:
      return out, lse, vjp((d_out.astype(out.dtype), d_lse))
    d_none = None if lse is None else jnp.zeros_like(lse)
    return out, lse, vjp((d_out.astype(out.dtype), d_none))
  return helpers.jit_run(run, *qkv, *cts)


@functools.cache
def _reference(name, c: Case, with_lse):
  """(out, lse, grads) of the fp32 reference on the case's inputs: computed once per process
  and shared by the case's cells (every implementation is compared with the same values)."""
  qkv, (q_seg, kv_seg), cts = _inputs(name, c)

  def reference(q, k, v):
    return attention_reference(q, k, v, causal=c.causal, local_window_size=c.window,
                               q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                               logits_soft_cap=c.soft_cap)

  return _fwd_vjp(reference, tuple(x.astype(jnp.float32) for x in qkv), cts, with_lse)


def _check(impl, name, c: Case, *, interpret):
  caps = CAPS[impl]
  qkv, (q_seg, kv_seg), cts = _inputs(name, c)
  mask = _mask_kwargs(c, q_seg, kv_seg)

  def kernel(q, k, v):
    r = jattn.flash_attention(q, k, v, implementation=impl, interpret=interpret,
                              return_lse=caps.lse, **mask)
    return r if caps.lse else (r, None)

  out, lse, grads = _fwd_vjp(kernel, qkv, cts, caps.lse)
  r_out, r_lse, r_grads = _reference(name, c, caps.lse)
  t = helpers.tol(c.dtype)
  assert out.dtype == c.dtype and out.shape == r_out.shape, (out.dtype, out.shape)
  assert np.isfinite(np.asarray(out, np.float32)).all()
  assert helpers.rel_err(out, r_out) < t, ("out", helpers.rel_err(out, r_out))
  if caps.lse:
    helpers.assert_lse_close(lse, r_lse, t)
  assert [g.dtype for g in grads] == [c.dtype] * 3
  helpers.assert_grads_close(grads, r_grads, t)
  # Rows that see no key: output 0 and dQ 0 exactly (from the reference's -inf rows).
  empty = np.isneginf(np.asarray(r_lse)).transpose(0, 2, 1)  # [B, Sq, Hq]
  if empty.any():
    assert np.all(np.asarray(out, np.float32)[empty] == 0.0)
    assert np.all(np.asarray(grads[0], np.float32)[empty] == 0.0)


def _cells(impls, cases):
  """The supported (implementation, case) cells, case by case: a case's cells run one after
  the other, so that a worker computes the case's reference once (``_reference``)."""
  return [pytest.param(i, n, id=f"{i}-{n}") for n, c in cases.items() for i in impls
          if CAPS[i].unsupported(c) is None]


@pytest.mark.parametrize("impl,name", _cells(("xla", "triton", "mosaic_tpu"), CASES))
def test_matches_reference_cpu(impl, name):
  _check(impl, name, CASES[name], interpret=impl != "xla")


@pytest.mark.gpu
@pytest.mark.parametrize("impl,name", _cells(("triton", "mosaic_gpu", "cudnn"), GPU_CASES))
def test_matches_reference_gpu(impl, name):
  _check(impl, name, GPU_CASES[name], interpret=False)


# Cells an implementation rejects, beyond the matrix's: head dims past the kernels' limits and
# options cuDNN lacks (return_lse). cuDNN's dtype check needs cuDNN (GPU only).
EXTRA = {
    "d320": Case(head_dim=320),
    "d72_bf16": Case(head_dim=72, dtype=BF16),
    "fp32_d64": Case(head_dim=64),
    "segments_bf16_d64": Case(head_dim=64, dtype=BF16, segments="packed"),
    "softcap_bf16_d64": Case(head_dim=64, dtype=BF16, soft_cap=3.0),
    "causal_q_shorter_bf16_d64": Case(q_len=32, kv_len=64, head_dim=64, dtype=BF16, causal=True),
    "window_right_open_bf16_d64": Case(head_dim=64, dtype=BF16, window=(8, None)),
    "dv32_bf16_d64": Case(head_dim=64, head_dim_v=32, dtype=BF16),
}
_ALL = ("xla", "triton", "mosaic_tpu", "mosaic_gpu", "cudnn")
_REJECTED = [pytest.param(i, n, id=f"{i}-{n}",
                          marks=[pytest.mark.gpu] if i == "cudnn" and CAPS[i].unsupported(c) in (
                              "dtype", "sequence length") else [])
             for i in _ALL for n, c in {**CASES, **EXTRA}.items()
             if CAPS[i].unsupported(c) is not None]


@pytest.mark.parametrize("impl,name", _REJECTED)
def test_unsupported_cells_raise(impl, name):
  """Tracing is enough: the checks run before any kernel (a supported cell would trace fine)."""
  c = {**CASES, **EXTRA}[name]
  qkv, (q_seg, kv_seg), _ = _inputs(name, c)
  f = lambda q, k, v: jattn.flash_attention(q, k, v, implementation=impl,
                                            interpret=impl in ("triton", "mosaic_tpu"),
                                            **_mask_kwargs(c, q_seg, kv_seg))
  with pytest.raises((NotImplementedError, ValueError), match=r"support|must be"):
    jax.eval_shape(f, *qkv)


def test_cudnn_rejects_return_lse():
  x = jax.ShapeDtypeStruct((1, 64, 2, 64), BF16)
  with pytest.raises(ValueError, match="return_lse"):
    jax.eval_shape(lambda q: jattn.flash_attention(q, q, q, implementation="cudnn",
                                                   return_lse=True), x)


def test_matrix_covers_the_semantics():
  """The CPU matrix holds every mask, GQA, odd lengths, 72/96 head dims, each dtype, soft cap,
  segment ids and rows that see no key (a guard against trimming it by accident)."""
  cs = list(CASES.values())
  assert any(c.causal and c.window for c in cs) and any(c.window and not c.causal for c in cs)
  assert any(c.causal and not c.window for c in cs) and any(
      not (c.causal or c.window or c.segments) for c in cs)
  assert {c.segments for c in cs} >= {"packed", "left_negative"}
  assert any(c.sk > c.q_len for c in cs) and any(c.sk < c.q_len for c in cs)
  assert any(c.q_heads > c.kv_heads for c in cs) and any(c.soft_cap for c in cs)
  assert {72, 96} <= {c.head_dim for c in cs} and {c.dtype for c in cs} == {F32, BF16, F16}
  assert any(c.q_len % 16 for c in cs)
