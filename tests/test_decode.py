"""jattn.decode: split-KV decode ("xla", "triton" in interpret mode) vs the fp32 reference.

The reference (pallas_kernels.decode.reference, upcast=True) is itself checked against the
flash-attention reference (bottom-right aligned causal attention of the last query). Sizes are
tiny: the Pallas interpreter is slow on the shared 2-core CI box.
"""
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jattn import decode as dec
from pallas_kernels.decode import reference as dref
from pallas_kernels.decode import triton as dtriton
from pallas_kernels.flash.reference import attention_reference
from tests.helpers import normal

TOL = {jnp.float32: 2e-3, jnp.bfloat16: 2e-2}
BK16 = dtriton.DecodeBlockSizes(block_k=16)
_REF = jax.jit(dref.decode_reference, static_argnames=(
    "scale", "local_window_size", "logits_soft_cap", "num_splits", "upcast"))


def _rel(x, ref):
  x, ref = (np.asarray(a, np.float64) for a in (x, ref))   # numpy: no program per shape
  return float(np.linalg.norm((x - ref).ravel()) / np.linalg.norm(ref.ravel()))


def _inputs(seed, b, n, hq, hk, d, dtype=jnp.float32, dv=None):
  """q [b, hq, d], k [b, n, hk, d], v [b, n, hk, dv] (dv defaults to d)."""
  return normal(seed, (b, hq, d), (b, n, hk, d), (b, n, hk, d if dv is None else dv),
                dtype=dtype)


def _paginate(seed, k, v, lengths, page_size, extra_pages=3):
  """Scatter contiguous caches into a shuffled page pool; unused table entries are garbage."""
  b, n, hk, d = k.shape
  dv = v.shape[-1]
  max_pages = -(-n // page_size)
  pad = max_pages * page_size - n
  kp = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b * max_pages, page_size, hk, d)
  vp = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b * max_pages, page_size, hk, dv)
  num_pages = b * max_pages + extra_pages
  perm = np.random.default_rng(seed).permutation(num_pages)
  k_pages = jnp.zeros((num_pages, page_size, hk, d), k.dtype).at[perm[:b * max_pages]].set(kp)
  v_pages = jnp.zeros((num_pages, page_size, hk, dv), v.dtype).at[perm[:b * max_pages]].set(vp)
  # Fill the spare pages with huge values: reading one by mistake breaks the result.
  k_pages = k_pages.at[perm[b * max_pages:]].set(1e4)
  v_pages = v_pages.at[perm[b * max_pages:]].set(jnp.nan)
  table = perm[:b * max_pages].reshape(b, max_pages).astype(np.int32)
  lengths = np.asarray(lengths)
  for i in range(b):  # entries past the length point anywhere, including out of range
    used = -(-int(lengths[i]) // page_size)
    table[i, used:] = np.where(np.arange(max_pages - used) % 2, -7, perm[b * max_pages])
  return k_pages, v_pages, jnp.asarray(table)


def test_reference_matches_flash_reference():
  q, k, v = _inputs(0, 3, 40, 6, 2, 16)
  lengths = jnp.array([40, 17, 1], jnp.int32)
  out, lse = _REF(q, k, v, lengths, local_window_size=(9, 0), logits_soft_cap=3.0)
  flash_ref = jax.jit(functools.partial(attention_reference, causal=True,
                                        local_window_size=(9, 0), logits_soft_cap=3.0))
  for i, n in enumerate(lengths.tolist()):
    r_out, r_lse = flash_ref(q[i:i + 1, None], k[i:i + 1, :n], v[i:i + 1, :n])
    assert _rel(out[i], r_out[0, 0]) < 1e-6
    np.testing.assert_allclose(np.asarray(lse[i]), np.asarray(r_lse[0, :, 0]), rtol=1e-6)
  # Values narrower than keys (MLA): the reference keeps the value width.
  _, _, v_narrow = _inputs(16, 3, 40, 6, 2, 16, dv=10)
  out_n, _ = _REF(q, k, v_narrow, lengths, local_window_size=(9, 0), logits_soft_cap=3.0)
  assert out_n.shape == (3, 6, 10)
  for i, n in enumerate(lengths.tolist()):
    r_out, _ = flash_ref(q[i:i + 1, None], k[i:i + 1, :n], v_narrow[i:i + 1, :n])
    assert _rel(out_n[i], r_out[0, 0]) < 1e-6
  # num_splits in the reference merges chunk partials: same result.
  out4, lse4 = _REF(q, k, v, lengths, local_window_size=(9, 0), logits_soft_cap=3.0,
                    num_splits=3)
  assert _rel(out4, out) < 1e-6
  np.testing.assert_allclose(np.asarray(lse4), np.asarray(lse), rtol=1e-6)


# (seed, batch, max_len, q_heads, kv_heads, head_dim, lengths, window, cap, splits, dtype)
CONTIGUOUS = [
    (1, 4, 100, 6, 2, 24, [0, 1, 77, 100], None, None, (1, 3), jnp.float32),   # GQA 3, D 24
    (2, 3, 90, 4, 4, 16, [90, 33, 2], (20, 0), 2.5, (5,), jnp.float32),       # MHA, window, cap
    (3, 2, 64, 8, 1, 32, [64, 5], 7, None, (4,), jnp.bfloat16),               # MQA, bf16
]


def _impl_cases(cases):
  """Every case with "triton"; the first two with "xla" too (a pure-jnp path: fewer compiles)."""
  return ([pytest.param("triton", c, id=f"triton-seed{c[0]}") for c in cases]
          + [pytest.param("xla", c, id=f"xla-seed{c[0]}") for c in cases[:2]])


@pytest.mark.parametrize("impl,case", _impl_cases(CONTIGUOUS))
def test_decode_matches_reference(impl, case):
  seed, b, n, hq, hk, d, lengths, window, cap, splits, dtype = case
  q, k, v = _inputs(seed, b, n, hq, hk, d, dtype)
  lengths = jnp.array(lengths, jnp.int32)
  ref_out, ref_lse = _REF(q, k, v, lengths, local_window_size=window,
                                           logits_soft_cap=cap)
  for ns in (splits[-1:] if impl == "xla" else splits):  # xla: one split path is enough
    out, lse = dec.decode_attention(q, k, v, lengths, local_window_size=window,
                                    logits_soft_cap=cap, num_splits=ns, return_lse=True,
                                    implementation=impl, interpret=True, block_sizes=None
                                    if impl == "xla" else BK16)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == q.shape[:2]
    assert _rel(out, ref_out) < TOL[dtype], (ns, _rel(out, ref_out))
    empty = np.asarray(lengths) == 0
    assert bool(jnp.all(out[empty] == 0)) and bool(jnp.all(jnp.isneginf(lse[empty])))
    np.testing.assert_allclose(np.asarray(lse[~empty]), np.asarray(ref_lse[~empty]),
                               rtol=TOL[dtype], atol=TOL[dtype])


def test_triton_default_block_and_heuristic_splits_fp32_query_bf16_cache():
  q, k, v = _inputs(4, 2, 300, 4, 2, 64)
  k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
  lengths = jnp.array([300, 129], jnp.int32)
  ref_out, _ = _REF(q, k, v, lengths, scale=0.3)
  out = dec.decode_attention(q, k, v, lengths, scale=0.3, implementation="triton",
                             interpret=True)
  assert out.dtype == jnp.float32
  assert _rel(out, ref_out) < TOL[jnp.bfloat16]


def test_splits_past_the_length_are_empty():
  """Work follows the actual length: splits past it hold lse -inf and zero output."""
  q, k, v = _inputs(5, 2, 128, 4, 2, 16)
  lengths = jnp.array([20, 128], jnp.int32)
  o, lse = dtriton.decode_partials(q, k, v, lengths, num_splits=8, block_sizes=BK16,
                                   interpret=True)
  # Sequence 0: 20 keys = 2 blocks of 16 -> splits 0 and 1 hold them, 2..7 are empty.
  assert bool(jnp.all(jnp.isfinite(lse[0, :2]))) and bool(jnp.all(jnp.isneginf(lse[0, 2:])))
  assert bool(jnp.all(o[0, 2:] == 0))
  assert bool(jnp.all(jnp.isfinite(lse[1])))  # 8 blocks over 8 splits


# (seed, batch, max_len, hq, hk, d, page_size, lengths, window, cap, splits, dtype)
PAGED = [
    (6, 4, 70, 4, 2, 32, 16, [0, 1, 33, 70], None, None, (1, 5), jnp.float32),
    (7, 3, 72, 6, 3, 16, 24, [72, 25, 9], (30, 0), 4.0, (3,), jnp.float32),   # page 24, window
    (8, 2, 64, 8, 2, 64, 32, [64, 40], None, None, (2,), jnp.bfloat16),
]


@pytest.mark.parametrize("impl,case", _impl_cases(PAGED))
def test_paged_decode_matches_reference(impl, case):
  seed, b, n, hq, hk, d, page_size, lengths, window, cap, splits, dtype = case
  q, k, v = _inputs(seed, b, n, hq, hk, d, dtype)
  ref_out, ref_lse = _REF(q, k, v, jnp.array(lengths, jnp.int32),
                                           local_window_size=window, logits_soft_cap=cap)
  k_pages, v_pages, table = _paginate(seed, k, v, lengths, page_size)
  lengths = jnp.array(lengths, jnp.int32)
  for ns in (splits[-1:] if impl == "xla" else splits):
    out, lse = dec.paged_decode_attention(
        q, k_pages, v_pages, table, lengths, local_window_size=window, logits_soft_cap=cap,
        num_splits=ns, return_lse=True, implementation=impl, interpret=True,
        block_sizes=None if impl == "xla" else BK16)
    assert _rel(out, ref_out) < TOL[dtype], (ns, _rel(out, ref_out))
    empty = np.asarray(lengths) == 0
    assert bool(jnp.all(out[empty] == 0)) and bool(jnp.all(jnp.isneginf(lse[empty])))
    np.testing.assert_allclose(np.asarray(lse[~empty]), np.asarray(ref_lse[~empty]),
                               rtol=TOL[dtype], atol=TOL[dtype])


def test_append_kv_then_decode():
  q, k, v = _inputs(9, 3, 48, 4, 2, 16)
  lengths = jnp.array([0, 20, 47], jnp.int32)
  kn, vn = normal(10, (3, 2, 16), (3, 2, 16))
  k2, v2, len2 = jax.jit(dec.append_kv)(k, v, lengths, kn, vn)
  assert len2.tolist() == [1, 21, 48]
  for i, t in enumerate(lengths.tolist()):
    np.testing.assert_array_equal(np.asarray(k2[i, t]), np.asarray(kn[i]))
    np.testing.assert_array_equal(np.asarray(v2[i, t]), np.asarray(vn[i]))
  untouched = jnp.ones(k.shape[:2], bool).at[jnp.arange(3), lengths].set(False)
  assert bool(jnp.all(jnp.where(untouched[..., None, None], k2 == k, True)))

  # Paged: the same appends through a shuffled page table give the same attention.
  k_pages, v_pages, table = _paginate(12, k, v, lengths, 16)
  kp2, vp2, plen2 = jax.jit(dec.append_kv_paged)(k_pages, v_pages, table, lengths, kn, vn)
  assert plen2.tolist() == [1, 21, 48]
  ref = _REF(q, k2, v2, len2)[0]
  out = dec.paged_decode_attention(q, kp2, vp2, table, plen2, implementation="triton",
                                   num_splits=2, interpret=True, block_sizes=BK16)
  assert _rel(out, ref) < 2e-3
  # A full cache drops the write instead of corrupting another row (or another page).
  full = jnp.array([48, 48, 48], jnp.int32)
  k3, _, len3 = dec.append_kv(k2, v2, full, kn, vn)
  assert bool(jnp.all(k3 == k2)) and len3.tolist() == [49, 49, 49]
  kp3, _, _ = dec.append_kv_paged(kp2, vp2, table, full, kn, vn)
  assert bool(jnp.all((kp3 == kp2) | jnp.isnan(kp2)))


def test_default_num_splits_heuristic():
  assert dtriton.default_num_splits(1, 8, 131072, core_count=132) == 16  # one wave
  assert dtriton.default_num_splits(1, 1, 1 << 20, core_count=132) == 32  # at most 32 partials
  assert dtriton.default_num_splits(1, 8, 2048, core_count=132) == 8      # >= 4 blocks a split
  assert dtriton.default_num_splits(8, 8, 32768, core_count=132) == 32   # splits of <= 1K keys
  assert dtriton.default_num_splits(8, 8, 4096, core_count=132) == 4
  assert dtriton.default_num_splits(64, 8, 4096, core_count=132) == 4
  assert dtriton.default_num_splits(64, 8, 1024, core_count=132) == 1
  assert dtriton.default_num_splits(1, 1, 200, core_count=132) == 1   # too short to split
  assert dec.default_num_splits("xla", 1, 8, 131072) == 1


def test_validation_errors():
  q, k, v = _inputs(13, 2, 32, 4, 2, 16)
  lengths = jnp.array([3, 4], jnp.int32)
  call = functools.partial(dec.decode_attention, implementation="xla")
  with pytest.raises(ValueError, match="kv_lengths must have shape"):
    call(q, k, v, jnp.array([3, 4, 5], jnp.int32))
  with pytest.raises(ValueError, match="kv_lengths must have shape"):
    call(q, k, v, jnp.array([[3, 4]], jnp.int32))
  with pytest.raises(ValueError, match="multiple of kv_heads"):
    call(q[:, :3], k, v, lengths)
  with pytest.raises(ValueError, match="head_dim"):
    call(q[..., :8], k, v, lengths)
  with pytest.raises(ValueError, match="same shape"):
    call(q, k, v[:, :16], lengths)
  with pytest.raises(ValueError, match="unknown implementation"):
    dec.decode_attention(q, k, v, lengths, implementation="cuda")
  with pytest.raises(ValueError, match="num_splits"):
    call(q, k, v, lengths, num_splits=0)
  with pytest.raises(ValueError, match="logits_soft_cap"):
    call(q, k, v, lengths, logits_soft_cap=-1.0)
  with pytest.raises(TypeError, match="kv_lengths"):
    call(q, k, v, jnp.array([3.0, 4.0]))
  pages = k.reshape(4, 16, 2, 16)
  table = jnp.array([[0, 1], [2, 3]], jnp.int32)
  pcall = functools.partial(dec.paged_decode_attention, implementation="triton", interpret=True)
  with pytest.raises(ValueError, match="page_table must be"):
    pcall(q, pages, pages, table[0], lengths)
  with pytest.raises(ValueError, match="page_table must be"):
    pcall(q, pages, pages, table[:1], lengths)
  with pytest.raises(ValueError, match="kv_lengths must have shape"):
    pcall(q, pages, pages, table, lengths[:1])
  with pytest.raises(ValueError, match="page_size"):
    pcall(q, k.reshape(8, 8, 2, 16), k.reshape(8, 8, 2, 16), table, lengths)
  with pytest.raises(ValueError, match="kv_lengths must have shape"):
    dec.append_kv(k, v, lengths[:1], k[:, 0], v[:, 0])


def test_append_kv_values_narrower_than_keys():
  """MLA-style caches (values narrower than keys) append contiguous and paged; wrong widths and
  mismatched caches raise."""
  b, n, hk, d, dv = 2, 32, 2, 24, 16
  k = jnp.zeros((b, n, hk, d))
  v = jnp.zeros((b, n, hk, dv))
  lens = jnp.array([3, 31], jnp.int32)
  kn, vn = jnp.ones((b, hk, d)), 2 * jnp.ones((b, hk, dv))
  k2, v2, l2 = dec.append_kv(k, v, lens, kn, vn)
  assert v2.shape == v.shape and float(v2[1, 31, 0, 0]) == 2.0 and l2.tolist() == [4, 32]
  pages_k, pages_v = jnp.zeros((4, 16, hk, d)), jnp.zeros((4, 16, hk, dv))
  table = jnp.array([[3, 1], [0, 2]], jnp.int32)
  pk, pv, _ = dec.append_kv_paged(pages_k, pages_v, table, lens, kn, vn)
  assert float(pv[3, 3, 0, 0]) == 2.0 and float(pv[2, 15, 0, 0]) == 2.0
  with pytest.raises(ValueError, match="v_new must be"):
    dec.append_kv(k, v, lens, kn, jnp.ones((b, hk, d)))
  with pytest.raises(ValueError, match="same first three dims"):
    dec.append_kv(k, jnp.zeros((b, n + 1, hk, dv)), lens, kn, vn)
  with pytest.raises(ValueError, match="same first three dims"):
    dec.append_kv_paged(pages_k, jnp.zeros((4, 8, hk, dv)), table, lens, kn, vn)


def test_triton_lowers_for_gpu_at_bench_shapes():
  """The Pallas -> Triton lowering runs on CPU: catch lowering errors at the real shapes."""
  S = jax.ShapeDtypeStruct
  bf16 = jnp.bfloat16
  disabled = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  f = functools.partial(dec.decode_attention, num_splits=32, local_window_size=(4095, 0),
                        logits_soft_cap=30.0, implementation="triton")
  exp = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=disabled)(
      S((1, 32, 128), bf16), S((1, 131072, 8, 128), bf16), S((1, 131072, 8, 128), bf16),
      S((1,), jnp.int32))
  assert "xla.gpu.triton" in exp.mlir_module()
  g = functools.partial(dec.paged_decode_attention, num_splits=4, implementation="triton")
  exp = jax.export.export(jax.jit(g), platforms=["cuda"], disabled_checks=disabled)(
      S((8, 32, 128), bf16), S((16384, 16, 8, 128), bf16), S((16384, 16, 8, 128), bf16),
      S((8, 2048), jnp.int32), S((8,), jnp.int32))
  assert "xla.gpu.triton" in exp.mlir_module()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d", [(jnp.bfloat16, 128), (jnp.float32, 128), (jnp.bfloat16, 96)])
def test_triton_compiled_on_gpu(dtype, d):
  b, n, hq, hk = 3, 4096, 32, 8
  q, k, v = _inputs(14, b, n, hq, hk, d, dtype)
  lengths = jnp.array([4096, 1, 3001], jnp.int32)
  tol = TOL[dtype]
  for window, cap in ((None, None), ((1000, 0), 30.0)):
    ref_out, ref_lse = _REF(q, k, v, lengths, local_window_size=window,
                                             logits_soft_cap=cap)
    for ns in (None, 1, 7):
      out, lse = jax.jit(functools.partial(
          dec.decode_attention, local_window_size=window, logits_soft_cap=cap, num_splits=ns,
          return_lse=True, implementation="triton"))(q, k, v, lengths)
      assert _rel(out, ref_out) < tol
      np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=tol, atol=tol)
    for page_size in (16, 64):
      k_pages, v_pages, table = _paginate(15, k, v, lengths.tolist(), page_size)
      out = jax.jit(functools.partial(
          dec.paged_decode_attention, local_window_size=window, logits_soft_cap=cap,
          implementation="triton"))(q, k_pages, v_pages, table, lengths)
      assert _rel(out, ref_out) < tol


@pytest.mark.gpu
def test_gpu_pallas_merge():
  """Compiled (B3, 4K, GQA 32:8, D128, bf16, lengths 4096 / 1 / 3001, default and 7 splits,
  contiguous and paged): the "triton" call (splits merged by the Pallas merge kernel) within
  bf16 rounding of the fp32 reference."""
  b, n, hq, hk, d = 3, 4096, 32, 8, 128
  q, k, v = _inputs(19, b, n, hq, hk, d, jnp.bfloat16)
  lengths = jnp.array([4096, 1, 3001], jnp.int32)
  ref_out, ref_lse = _REF(q, k, v, lengths)
  k_pages, v_pages, table = _paginate(20, k, v, lengths.tolist(), 64)
  for ns, paged in itertools.product((None, 7), (False, True)):
    fn = dec.paged_decode_attention if paged else dec.decode_attention
    args = (q, k_pages, v_pages, table, lengths) if paged else (q, k, v, lengths)
    out, lse = jax.jit(functools.partial(fn, num_splits=ns, return_lse=True,
                                         implementation="triton"))(*args)
    assert _rel(out, ref_out) < TOL[jnp.bfloat16]
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_decode_values_narrower_than_keys(impl):
  """MLA-shaped caches (keys d wide, values dv < d; non-power-of-two widths): the output has the
  value width and equals the fp32 reference; contiguous (d 48, dv 32, GQA 3) and paged (d 72,
  dv 40, GQA 2, shuffled pages with NaN spare pages and garbage table entries, window + soft
  cap), zero-length and one-token sequences, several splits."""
  bk = None if impl == "xla" else BK16
  q, k, v = _inputs(17, 3, 60, 6, 2, 48, dv=32)
  lengths = jnp.array([0, 1, 57], jnp.int32)
  ref_out, ref_lse = _REF(q, k, v, lengths)
  out, lse = dec.decode_attention(q, k, v, lengths, num_splits=2, return_lse=True,
                                  implementation=impl, interpret=True, block_sizes=bk)
  assert out.shape == (3, 6, 32) and out.dtype == q.dtype
  assert _rel(out, ref_out) < 2e-3, _rel(out, ref_out)
  assert bool(jnp.all(out[0] == 0)) and bool(jnp.all(jnp.isneginf(lse[0])))
  np.testing.assert_allclose(np.asarray(lse[1:]), np.asarray(ref_lse[1:]), rtol=2e-3, atol=2e-3)

  q, k, v = _inputs(18, 3, 50, 4, 2, 72, dv=40)
  lengths = [1, 0, 50]
  ref_out, ref_lse = _REF(q, k, v, jnp.array(lengths, jnp.int32), local_window_size=(30, 0),
                          logits_soft_cap=4.0)
  k_pages, v_pages, table = _paginate(18, k, v, lengths, 16)
  out, lse = dec.paged_decode_attention(q, k_pages, v_pages, table, jnp.array(lengths, jnp.int32),
                                        local_window_size=(30, 0), logits_soft_cap=4.0,
                                        num_splits=3, return_lse=True, implementation=impl,
                                        interpret=True, block_sizes=bk)
  assert out.shape == (3, 4, 40)
  assert _rel(out, ref_out) < 2e-3, _rel(out, ref_out)
  assert bool(jnp.all(out[1] == 0)) and bool(jnp.all(jnp.isneginf(lse[1])))
  np.testing.assert_allclose(np.asarray(lse)[[0, 2]], np.asarray(ref_lse)[[0, 2]], rtol=2e-3,
                             atol=2e-3)


def test_triton_lowers_for_gpu_mla_shapes():
  """Values narrower than keys (keys 192 = 128 + 64 rope dims, values 128) lower to Triton for
  the dense and the block-sparse decode kernels (paged)."""
  from jattn import sparse as sp
  S = jax.ShapeDtypeStruct
  bf16 = jnp.bfloat16
  disabled = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  g = functools.partial(dec.paged_decode_attention, num_splits=4, implementation="triton")
  exp = jax.export.export(jax.jit(g), platforms=["cuda"], disabled_checks=disabled)(
      S((2, 16, 192), bf16), S((512, 64, 1, 192), bf16), S((512, 64, 1, 128), bf16),
      S((2, 256), jnp.int32), S((2,), jnp.int32))
  assert "xla.gpu.triton" in exp.mlir_module()

  def sparse(q, kp, vp, table, lens):
    summ = sp.init_block_summaries(kp, lens, block_size=64, page_table=table)
    return sp.sparse_paged_decode_attention(q, kp, vp, table, lens, summ, top_k=8,
                                            implementation="triton", num_splits=4)
  exp = jax.export.export(jax.jit(sparse), platforms=["cuda"], disabled_checks=disabled)(
      S((2, 16, 192), bf16), S((512, 64, 1, 192), bf16), S((512, 64, 1, 128), bf16),
      S((2, 256), jnp.int32), S((2,), jnp.int32))
  assert "xla.gpu.triton" in exp.mlir_module()


@pytest.mark.parametrize("layout", ["nhd", "hnd", "paged"])
def test_decode_pallas_merge(layout):
  """The "triton" call merges its splits with the Pallas merge kernel (interpreted): the same
  output and lse as the XLA merge of the same partials within fp32 rounding, and the fp32
  reference; lengths 0 / 1 / ragged, GQA 3:1 with head_dim 24 and values of 40, a window and a
  soft cap, contiguous caches of both layouts and a paged one."""
  from pallas_kernels.common.merge import merge_partials
  from pallas_kernels.decode import triton as kt
  q, k, v = _inputs(31, 3, 70, 6, 2, 24, dv=40)
  lengths = jnp.array([0, 1, 61], jnp.int32)
  kw = dict(local_window_size=(40, 0), logits_soft_cap=20.0, num_splits=3, return_lse=True,
            implementation="triton", interpret=True, block_sizes=BK16)
  pkw = dict(num_splits=3, window_left=40, logits_soft_cap=20.0, block_sizes=BK16,
             interpret=True)
  if layout == "paged":
    k_pages, v_pages, table = _paginate(32, k, v, lengths, 16)
    call = functools.partial(dec.paged_decode_attention, q, k_pages, v_pages, table, lengths,
                             **kw)
    parts = kt.paged_decode_partials(q, k_pages, v_pages, table, lengths, **pkw)
  else:
    kc, vc = (k, v) if layout == "nhd" else (jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2))
    call = functools.partial(dec.decode_attention, q, kc, vc, lengths, kv_layout=layout, **kw)
    parts = kt.decode_partials(q, k, v, lengths, **pkw)
  out, lse = call()
  assert "jattn_merge_partials" in str(jax.make_jaxpr(call)())
  out_x, lse_x = merge_partials(*parts, axis=1)
  assert out.dtype == q.dtype                      # written by the merge kernel itself
  ref_out, ref_lse = _REF(q, k, v, lengths, local_window_size=(40, 0), logits_soft_cap=20.0)
  np.testing.assert_allclose(np.asarray(out), np.asarray(out_x), rtol=1e-5, atol=1e-5)
  fin = np.asarray(lengths) > 0
  np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(lse_x)[fin], rtol=1e-5, atol=1e-5)
  assert np.all(np.isneginf(np.asarray(lse)[~fin])) and np.all(np.asarray(out)[~fin] == 0)
  assert _rel(out, ref_out) < 2e-3
  np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(ref_lse)[fin], rtol=2e-3,
                             atol=2e-3)


def test_merge_partials_pallas_matches_xla():
  """The merge kernel (interpreted) == ``merge_partials`` over the split axis, with empty
  partials (lse -inf, garbage outputs), an all-empty head and a non-power-of-two head_dim."""
  from pallas_kernels.common.merge import merge_partials, merge_partials_pallas
  rng = np.random.default_rng(3)
  o = jnp.asarray(rng.normal(size=(2, 5, 3, 40)), jnp.float32)
  lse = jnp.asarray(rng.normal(size=(2, 5, 3)), jnp.float32)
  lse = lse.at[0, 1:3, 0].set(-jnp.inf).at[1, :, 2].set(-jnp.inf)
  o = o.at[0, 1, 0].set(jnp.nan)
  out, l = merge_partials_pallas(o, lse, out_dtype=jnp.bfloat16, interpret=True)
  want, want_l = merge_partials(o, lse, axis=1)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), rtol=1e-2, atol=1e-2)
  np.testing.assert_allclose(np.asarray(l), np.asarray(want_l), rtol=1e-6)
  assert np.all(np.asarray(out[1, 2], np.float32) == 0) and np.isneginf(np.asarray(l[1, 2])).all()



def test_merge_partials_pallas_by_row_ranges():
  """``row_units=``: the kernel merges each row's contiguous units == ``merge_partials_by_row``,
  with a row of 20 units (more than one 16-row tile), an empty row, an empty partial and unused
  units past the last row (garbage, never read)."""
  from pallas_kernels.common.merge import merge_partials_by_row, merge_partials_pallas
  rng = np.random.default_rng(4)
  starts = np.array([0, 3, 3, 23, 24], np.int32)
  rows = np.repeat(np.arange(4), np.diff(starts))
  rows = np.concatenate([rows, [4, 4]]).astype(np.int32)                 # 2 unused units
  o = jnp.asarray(rng.normal(size=(1, 26, 3, 40)), jnp.float32).at[0, 24:].set(jnp.nan)
  lse = jnp.asarray(rng.normal(size=(1, 26, 3)), jnp.float32).at[0, 5, 1].set(-jnp.inf)
  out, l = merge_partials_pallas(o, lse, interpret=True, row_units=jnp.asarray(starts))
  want, want_l = merge_partials_by_row(o[0], lse[0], jnp.asarray(rows), 4)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(l), np.asarray(want_l), rtol=1e-6)
  assert np.all(np.asarray(out[1]) == 0) and np.isneginf(np.asarray(l[1])).all()

def test_decode_plan_resolution():
  """``decode_plan``: explicit arguments win; otherwise the heuristics (Triton block sizes at
  max(head_dim, head_dim_v), ``default_num_splits`` at (batch, kv_heads, capacity) for both
  layouts and paged caches), the merge by implementation."""
  from jattn._plan import Plan
  from pallas_kernels.decode import mosaic_tpu as ktpu
  from pallas_kernels.decode import triton as kt
  q, k, v = _inputs(1, 2, 4096, 8, 2, 64)
  lens = jnp.array([10, 4096], jnp.int32)
  p = dec.decode_plan(q, k, v, lens, implementation="xla")
  assert isinstance(p, Plan) and (p.op, p.implementation, p.backward, p.table) == (
      "decode", "xla", None, None)
  assert p.config == dec.DecodeConfig(num_splits=1, block_sizes=None, merge="xla")
  p = dec.decode_plan(q, k, v, lens, implementation="triton")
  bs = kt.default_block_sizes(64, k.dtype)
  want = dec.default_num_splits("triton", 2, 2, 4096, bs)
  assert p.config == dec.DecodeConfig(num_splits=want, block_sizes=bs, merge="pallas")
  kh, vh = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
  assert dec.decode_plan(q, kh, vh, lens, kv_layout="hnd", implementation="triton") == p
  mine = kt.DecodeBlockSizes(block_k=32)
  p = dec.decode_plan(q, k, v, lens, implementation="triton", num_splits=5, block_sizes=mine)
  assert p.config == dec.DecodeConfig(num_splits=5, block_sizes=mine, merge="pallas")
  k_pages, v_pages, table = _paginate(2, k, v, lens.tolist(), 64)
  p = dec.decode_plan(q, k_pages, v_pages, lens, page_table=table, implementation="mosaic_tpu")
  assert (p.op, p.config) == ("paged_decode", dec.DecodeConfig(1, ktpu.DecodeBlockSizes()))
  assert dec.decode_plan(q, k, v, lens, implementation="mosaic_gpu").implementation == "triton"
  with pytest.raises(ValueError, match="unknown implementation"):
    dec.decode_plan(q, k, v, lens, implementation="cudnn")


@pytest.mark.parametrize("paged", [False, True])
def test_decode_runs_its_plan(paged, monkeypatch):
  """The call hands the kernel exactly its plan's config (num_splits, block sizes), with and
  without explicit arguments."""
  from pallas_kernels.decode import triton as kt
  seen = []
  name = "paged_decode_partials" if paged else "decode_partials"
  orig = getattr(kt, name)

  def spy(*args, **kw):
    seen.append((kw["num_splits"], kw["block_sizes"]))
    return orig(*args, **kw)
  monkeypatch.setattr(kt, name, spy)
  q, k, v = _inputs(paged + 40, 2, 96, 4, 2, 32 + 8 * paged)
  lens = jnp.array([96, 50], jnp.int32)
  if paged:
    k_pages, v_pages, table = _paginate(41, k, v, lens.tolist(), 16)
    args, call = (q, k_pages, v_pages, table, lens), dec.paged_decode_attention
    plan_args = (q, k_pages, v_pages, lens)
    plan_kw = dict(page_table=table)
  else:
    args, call, plan_args, plan_kw = (q, k, v, lens), dec.decode_attention, (q, k, v, lens), {}
  for kw in (dict(), dict(num_splits=3, block_sizes=BK16)):
    seen.clear()
    call(*args, implementation="triton", interpret=True, **kw)
    plan = dec.decode_plan(*plan_args, implementation="triton", **plan_kw, **kw)
    assert seen == [(plan.config.num_splits, plan.config.block_sizes)], kw
