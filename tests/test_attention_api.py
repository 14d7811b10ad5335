"""jattn.flash_attention: validation, dispatch, and the "xla" path against the reference."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from pallas_kernels.flash.reference import attention_reference


def _rand(key, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(key), shape, dtype)


def test_bad_inputs_name_the_problem():
  q, k = _rand(0, (2, 16, 4, 32)), _rand(1, (2, 16, 2, 32))
  with pytest.raises(ValueError, match="multiple of kv_heads"):
    jattn.flash_attention(q, _rand(2, (2, 16, 3, 32)), _rand(3, (2, 16, 3, 32)))
  with pytest.raises(ValueError, match="head_dim"):
    jattn.flash_attention(q, _rand(2, (2, 16, 2, 16)), _rand(3, (2, 16, 2, 16)))
  with pytest.raises(ValueError, match="segment_ids must be"):
    jattn.flash_attention(q, k, k, segment_ids=jnp.ones((2, 15), jnp.int32))
  with pytest.raises(ValueError, match="unknown implementation"):
    jattn.flash_attention(q, k, k, implementation="cuda")
  with pytest.raises(ValueError, match="batch, seq, heads"):
    jattn.flash_attention(q[0], k, k)
  with pytest.raises(TypeError, match="floating"):
    jattn.flash_attention(q.astype(jnp.int32), k, k)
  with pytest.raises(TypeError, match="integer"):
    jattn.flash_attention(q, k, k, segment_ids=jnp.ones((2, 16), jnp.float32))
  with pytest.raises(ValueError, match="kv_segment_ids"):
    jattn.flash_attention(q, _rand(4, (2, 20, 2, 32)), _rand(5, (2, 20, 2, 32)),
                          segment_ids=jnp.ones((2, 16), jnp.int32))
  with pytest.raises(ValueError, match="soft_cap"):
    jattn.flash_attention(q, k, k, logits_soft_cap=0.0)
  with pytest.raises(ValueError, match=">= 0"):
    jattn.flash_attention(q, k, k, local_window_size=(-1, 0))


@pytest.mark.parametrize("impl", ["xla", "triton", "mosaic_tpu"])
def test_window_sides_past_any_sequence_are_unbounded(impl):
  """A window side of 2**30 or more (up to any int) is unbounded, on every path: it is never
  added to a position (int32 would wrap)."""
  kw = dict(implementation=impl, interpret=impl != "xla")
  q, k = _rand(0, (1, 40, 2, 8)), _rand(1, (1, 24, 1, 8))
  for causal, big, want in ((False, (0, 2**31 - 1), (0, None)), (False, 2**40, None),
                            (True, (2**31 - 1, 2**30), (None, None)), (True, (5, 2**33), (5, None))):
    got = jattn.flash_attention(q, k, k, causal=causal, local_window_size=big, **kw)
    ref = jattn.flash_attention(q, k, k, causal=causal, local_window_size=want, **kw)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
  qd = q[:, 0]
  got = jattn.decode_attention(qd, k, k, jnp.array([20]), local_window_size=2**31 - 1, **kw)
  ref = jattn.decode_attention(qd, k, k, jnp.array([20]), **kw)
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-6, atol=1e-6)
  if impl == "xla":
    got = jattn.dot_product_attention(q, k, k, local_window_size=(2**31 - 1, 2**31 - 1))
    np.testing.assert_allclose(np.asarray(got), np.asarray(jattn.dot_product_attention(q, k, k)),
                               rtol=1e-6, atol=1e-6)


def test_dtypes_and_window_forms_are_checked():
  q = _rand(0, (1, 16, 2, 8))
  with pytest.raises(TypeError, match="q must have a floating dtype"):
    jattn.flash_attention(*(q.astype(jnp.float8_e4m3fn),) * 3)
  with pytest.raises(TypeError, match="dtypes differ: q float32, k bfloat16"):
    jattn.flash_attention(q, q.astype(jnp.bfloat16), q.astype(jnp.bfloat16))
  with pytest.raises(TypeError, match="dtypes differ: k_cache float32, v_cache bfloat16"):
    jattn.decode_attention(q[:, 0], q, q.astype(jnp.bfloat16), jnp.array([3]))
  for bad in ((True, 0), True, 2.5, (1, 2, 3), (None,), "ab"):
    with pytest.raises(TypeError, match="local_window_size"):
      jattn.flash_attention(q, q, q, local_window_size=bad)
  np.testing.assert_array_equal(   # numpy ints are ints
      np.asarray(jattn.flash_attention(q, q, q, local_window_size=np.int64(3))),
      np.asarray(jattn.flash_attention(q, q, q, local_window_size=3)))


def test_cudnn_rejects_what_it_cannot_do():
  q = _rand(0, (1, 16, 2, 32))
  with pytest.raises(ValueError, match="segment ids"):
    jattn.flash_attention(q, q, q, segment_ids=jnp.ones((1, 16), jnp.int32), implementation="cudnn")
  with pytest.raises(ValueError, match="logits_soft_cap"):
    jattn.flash_attention(q, q, q, logits_soft_cap=5.0, implementation="cudnn")


def test_mosaic_gpu_rejects_what_it_does_not_support():
  """fp32 and head_dim 32 are outside the Hopper kernel: the error names the implementation."""
  q = _rand(0, (1, 16, 2, 32))
  with pytest.raises(NotImplementedError, match="mosaic_gpu"):
    jattn.flash_attention(q, q, q, implementation="mosaic_gpu")


def test_platform_defaults():
  x = jax.ShapeDtypeStruct((1, 64, 2, 32), jnp.float32)
  plan = lambda **kw: jattn.flash_attention_plan(x, x, x, **kw)
  assert plan(platform="gpu").implementation == "triton"
  assert plan(platform="tpu").implementation == "mosaic_tpu"
  assert plan(platform="cpu").implementation == "xla"
  assert plan(implementation="cudnn", platform="tpu").implementation == "cudnn"


def test_flash_attention_plan_picks_hopper_path_for_measured_calls():
  """None on sm90: Mosaic GPU for bf16/fp16 D64/D128/D256 (its backward for D64/D128 calls
  with any mask, Triton's for D256); Triton on other GPUs, for fp32, other head dims, head_dim_v !=
  head_dim, interpret mode or a Triton BlockSizes."""
  from pallas_kernels.flash import mosaic_gpu as mg, triton as ft
  sds = lambda d, dt=jnp.bfloat16: jax.ShapeDtypeStruct((2, 300, 4, d), dt)
  h200, a100 = "NVIDIA H200", "NVIDIA A100-SXM4-80GB"
  names = lambda *a, **kw: (lambda p: (p.implementation, p.backward))(
      jattn.flash_attention_plan(*a, **kw))
  x = sds(128)
  assert names(x, x, x, device_kind=h200) == ("mosaic_gpu", "mosaic_gpu")
  for mask in (dict(local_window_size=(511, 0)), dict(logits_soft_cap=30.0),
               dict(local_window_size=(511, 0), logits_soft_cap=30.0),
               dict(segment_ids=jnp.ones((2, 300), jnp.int32)),
               dict(segment_ids=jnp.ones((2, 300), jnp.int32), local_window_size=(511, 0))):
    assert names(x, x, x, device_kind=h200, **mask) == ("mosaic_gpu", "mosaic_gpu"), mask
  for d, bwd in ((64, "mosaic_gpu"), (256, "triton")):
    y = sds(d, jnp.float16)
    assert names(y, y, y, device_kind=h200) == ("mosaic_gpu", bwd), d
  for args, kw in [((x, x, x), dict(device_kind=a100)),
                   ((x, x, x), dict(device_kind="NVIDIA B200")),
                   ((sds(128, jnp.float32),) * 3, dict(device_kind=h200)),
                   ((sds(96),) * 3, dict(device_kind=h200)),
                   ((sds(32),) * 3, dict(device_kind=h200)),
                   ((x, x, sds(64)), dict(device_kind=h200)),
                   ((x, x, x), dict(device_kind=h200, interpret=True)),
                   ((x, x, x), dict(device_kind=h200,
                                    block_sizes=ft.default_block_sizes(128, jnp.bfloat16)))]:
    assert names(*args, **kw) == ("triton", "triton"), kw
  # Named implementations are kept; on Hopper's path explicit block sizes choose the backward.
  hop = mg.default_block_sizes(64)
  assert names(sds(64), sds(64), sds(64), implementation="mosaic_gpu")[1] == "mosaic_gpu"
  assert names(x, x, x, implementation="mosaic_gpu", block_sizes=hop)[1] == "triton"
  assert names(x, x, x, device_kind=h200, block_sizes=hop)[0] == "mosaic_gpu"
  assert names(x, x, x, implementation="xla", device_kind=h200)[0] == "xla"


def test_flash_attention_plan_reports_configs_and_table():
  """The plan holds the configs that run and the table they came from: the H200 reads its own
  table, the H100 its own or the nearest Hopper table, other devices generic.json; explicit
  block sizes read none."""
  from pallas_kernels import tuning
  from pallas_kernels.flash import mosaic_gpu as mg, mosaic_gpu_bwd as mgb, triton as ft
  x = jax.ShapeDtypeStruct((2, 1024, 4, 128), jnp.bfloat16)
  for kind, table in (("NVIDIA H200", "nvidia_h200.json"),
                      ("NVIDIA H100 80GB HBM3", tuning.table_file("NVIDIA H100 80GB HBM3"))):
    p = jattn.flash_attention_plan(x, x, x, causal=True, device_kind=kind)
    assert (p.op, p.table, p.device_kind) == ("flash", table, kind)
    want = mg.default_block_sizes(128, jnp.bfloat16, device_kind=kind, mask="causal")
    assert p.config == mg.fit_block_sizes(dataclasses.replace(want, backward="mosaic"), x.shape,
                                          x.shape, causal=True)
    assert p.backward_config == mgb.default_block_sizes(128, device_kind=kind, mask="causal")
    assert tuning.table_file(kind) == table
  p = jattn.flash_attention_plan(x, x, x, platform="gpu", device_kind="NVIDIA A100-SXM4-80GB")
  assert p.config == p.backward_config == ft.default_block_sizes(128, jnp.bfloat16)
  assert p.table == "generic.json"
  bs = ft.BlockSizes(32, 32)
  p = jattn.flash_attention_plan(x, x, x, implementation="triton", block_sizes=bs)
  assert (p.config, p.table) == (bs, None)
  p = jattn.flash_attention_plan(x, x, x, platform="cpu")
  assert (p.implementation, p.config, p.backward, p.table) == ("xla", None, "xla", None)
  with pytest.raises(TypeError, match="BlockSizes"):
    jattn.flash_attention_plan(x, x, x, implementation="triton", block_sizes=mg.BlockSizes())


def test_flash_attention_dispatches_on_the_plan(monkeypatch):
  """flash_attention(None) on a (simulated) Hopper GPU runs the Mosaic GPU path, with the Mosaic
  GPU backward for D128 calls with or without masks and the Triton one at D256."""
  from pallas_kernels import compat
  from pallas_kernels.flash import mosaic_gpu as mg, mosaic_gpu_bwd as mgb, triton as ft
  seen = []

  def fake_kernel(q, k, v, q_seg, kv_seg, *, block_sizes, bwd_block_sizes, **kw):
    kind = ("mosaic" if isinstance(bwd_block_sizes, mgb.BlockSizes) else
            "triton" if isinstance(bwd_block_sizes, ft.BlockSizes) else None)
    seen.append((block_sizes.backward, kind))
    return q, jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)

  monkeypatch.setattr(mg, "flash_attention", fake_kernel)
  monkeypatch.setattr(compat, "default_backend", lambda: "gpu")
  monkeypatch.setattr(compat, "gpu_compute_capability", lambda: (9, 0))
  q = jnp.ones((1, 64, 2, 128), jnp.bfloat16)
  jattn.flash_attention(q, q, q, causal=True)
  jattn.flash_attention(q, q, q, causal=True, local_window_size=(63, 0))
  seg = jnp.ones((1, 64), jnp.int32)
  jattn.flash_attention(q, q, q, causal=True, segment_ids=seg)
  q256 = jnp.ones((1, 64, 2, 256), jnp.bfloat16)
  jattn.flash_attention(q256, q256, q256, causal=True)
  mosaic = ("mosaic", "mosaic")
  assert seen == [mosaic, mosaic, mosaic, ("triton", "triton")]


def _naive(q, k, v, mask, scale):
  """Independent float64 numpy attention with an explicit [b, hq, sq, sk] mask."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  g = q.shape[2] // k.shape[2]
  k = np.repeat(k, g, axis=2)
  v = np.repeat(v, g, axis=2)
  s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
  s = np.where(mask, s, -np.inf)
  m = s.max(-1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0)
  p = np.exp(s - m)
  l = p.sum(-1, keepdims=True)
  o = np.einsum("bhqk,bkhd->bqhd", p / np.where(l == 0, 1, l), v)
  lse = np.where(l[..., 0] == 0, -np.inf, (m + np.log(np.where(l == 0, 1, l)))[..., 0])
  return o, lse


def test_reference_matches_naive_numpy_with_everything():
  b, sq, sk, hq, hk, d = 2, 37, 45, 4, 2, 24
  q, k, v = _rand(0, (b, sq, hq, d)), _rand(1, (b, sk, hk, d)), _rand(2, (b, sk, hk, d))
  qs = np.array([[1] * 20 + [2] * 17, [0] * 37])
  ks = np.array([[1] * 25 + [2] * 20, [1] * 45])
  out, lse = jattn.flash_attention(q, k, v, causal=True, local_window_size=(9, 3),
                                   segment_ids=jnp.asarray(qs), kv_segment_ids=jnp.asarray(ks),
                                   return_lse=True, implementation="xla")
  qpos = np.arange(sq)[:, None] + (sk - sq)
  kpos = np.arange(sk)[None, :]
  mask = (kpos <= qpos) & (kpos >= qpos - 9) & (kpos <= qpos + 3)
  mask = mask[None, None] & (qs[:, None, :, None] == ks[:, None, None, :]) & (ks[:, None, None, :] != 0)
  ref_o, ref_lse = _naive(q, k, v, mask, d ** -0.5)
  np.testing.assert_allclose(out, ref_o, atol=1e-5)
  np.testing.assert_allclose(lse, ref_lse, atol=1e-5)
  assert np.all(np.asarray(out[1]) == 0) and np.all(np.isneginf(np.asarray(lse[1])))


def test_empty_rows_have_zero_grad_not_nan():
  q = _rand(0, (1, 8, 2, 16))
  seg = jnp.array([[1, 1, 1, 1, 0, 0, 0, 0]], jnp.int32)

  def loss(q):
    o, lse = jattn.flash_attention(q, q, q, segment_ids=seg, return_lse=True, implementation="xla")
    return jnp.sum(o ** 2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

  g = jax.grad(loss)(q)
  assert not jnp.any(jnp.isnan(g))
  assert jnp.all(g[0, 4:] == 0)


def test_soft_cap_matches_reference():
  q, k = _rand(0, (1, 20, 2, 16)) * 4, _rand(1, (1, 20, 2, 16)) * 4
  out = jattn.flash_attention(q, k, k, logits_soft_cap=3.0, implementation="xla")
  ref, _ = attention_reference(q, k, k, logits_soft_cap=3.0)
  plain, _ = attention_reference(q, k, k)
  np.testing.assert_allclose(out, ref, atol=1e-6)
  assert float(jnp.max(jnp.abs(out - plain))) > 1e-2


def test_triton_per_pass_tiles_through_the_api():
  """block_sizes with backward tiles other than the forward's: flash_attention builds the
  backward's schedule of the same mask (interpret mode), and out, LSE and grads match "xla"."""
  from pallas_kernels.flash import triton as ft
  q, k, v = _rand(0, (1, 40, 4, 32)), _rand(1, (1, 40, 2, 32)), _rand(2, (1, 40, 2, 32))
  seg = jnp.asarray([[1] * 23 + [2] * 14 + [0] * 3], jnp.int32)
  d_out, d_lse = _rand(3, (1, 40, 4, 32)), _rand(4, (1, 4, 40))
  bs = ft.BlockSizes(16, 16, bwd_block_q=32)
  assert bs.bwd_tiles == (32, 16)

  def run(impl, **kw):
    f = lambda q, k, v: jattn.flash_attention(q, k, v, causal=True, local_window_size=(9, 0),
                                              segment_ids=seg, return_lse=True,
                                              implementation=impl, **kw)
    (out, lse), vjp = jax.vjp(f, q, k, v)
    return (out, jnp.where(jnp.isfinite(lse), lse, 0.0)) + vjp((d_out, d_lse))

  got = jax.jit(lambda: run("triton", interpret=True, block_sizes=bs))()
  want = jax.jit(lambda: run("xla"))()
  for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
    err = float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w))
    assert err < 2e-3, (name, err)
