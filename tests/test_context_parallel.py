"""Context-parallel attention against the single-device call.

The planning tests run in-process. The multi-device tests (``eight``) need 8 devices: they skip
in the ordinary process and ``test_on_8_cpu_devices`` runs them in a subprocess with
``--xla_force_host_platform_device_count=8``, so every other test keeps the default devices.
"""
import functools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import context_parallel as cp
from tests.helpers import ci_cases, rel_err

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
eight = pytest.mark.skipif(jax.device_count() < 8,
                           reason="needs 8 devices: run by test_on_8_cpu_devices")


# ----------------------------------------------------------------------------- planning
def _visible(qpos, kpos, causal, window):
  """Brute-force mask [len(qpos), len(kpos)]."""
  d = kpos[None, :] - qpos[:, None]
  m = np.ones(d.shape, bool)
  if causal:
    m &= d <= 0
  if window is not None:
    if window[0] is not None:
      m &= d >= -window[0]
    if window[1] is not None:
      m &= d <= window[1]
  return m


def test_pair_call_masks_exactly_the_visible_rows_and_columns():
  rng = np.random.default_rng(0)
  windows = [None, (0, 0), (3, 0), (5, 2), (None, 4), (7, None), (20, 20)]
  for _ in range(400):
    cq, ck = (int(x) for x in rng.integers(1, 12, 2))
    base = int(rng.integers(-30, 30))
    causal = bool(rng.integers(2))
    window = windows[rng.integers(len(windows))]
    want = _visible(np.arange(cq) + base, np.arange(ck), causal, window)
    call = cp.pair_call(base, cq, ck, causal, window)
    got = np.zeros((cq, ck), bool)
    if call is not None:
      assert min(call.nq, call.nk) >= 1 and all(w is None or w >= 0 for w in call.window or ())
      qpos = np.arange(call.nq) + (call.nk - call.nq)          # bottom-right aligned
      got[call.q0:call.q0 + call.nq, call.k0:call.k0 + call.nk] = _visible(
          qpos, np.arange(call.nk), call.causal, call.window)
    assert (got == want).all(), (base, cq, ck, causal, window, call)
    assert (call is None) == (not want.any())


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("n", [1, 7, 16, 29])
def test_permute_round_trip(layout, n):
  x = jnp.arange(2 * n).reshape(2, n)
  y = cp.context_parallel_permute(x, 4, layout)
  assert sorted(np.asarray(y[0]).tolist()) == list(range(n))
  assert (cp.context_parallel_unpermute(y, 4, layout) == x).all()
  pos = cp.layout_positions(n, 4, layout)
  assert (np.asarray(y[0]) == pos[pos >= 0]).all()


def test_windows_run_only_neighbour_steps():
  # chunk 128, window 64: a device's own chunks and its predecessor's
  kw = {"causal": True, "local_window_size": (63, 0)}
  p = jattn.context_parallel_plan(1024, 1024, 4, layout="contiguous", **kw)
  # the forward: one call per device over its chunk and the previous one's last 256 keys
  assert p.shifts == (0, 1) and p.halo == 256 and p.kernel_calls == 4
  assert np.count_nonzero(p.table) == 4 + 3      # the backward's chunk pairs
  assert jattn.context_parallel_plan(1024, 1024, 4, layout="contiguous", causal=True,
                                     local_window_size=(63, 1)).halo == 0   # reaches forward
  z = jattn.context_parallel_plan(2048, 2048, 4, layout="zigzag", **kw)
  # own: chunk pairs (d, d), (2P-1-d, 2P-1-d), and at d = P-1 chunk P after chunk P-1 (those
  # three: one joint call); shift 1: chunk d-1 before d (d >= 1); shift P-1: chunk 2P-2-d
  # before 2P-1-d (d <= P-2)
  assert z.shifts == (0, 1, 3) and z.kernel_calls == 8 + 1 + 3 + 3 - 2
  assert z.joint == jattn.context_parallel.PairCall(0, 512, 0, 512, True, (63, 0))
  unmasked = jattn.context_parallel_plan(2048, 2048, 4)   # one whole call per device and step
  assert unmasked.joint is None and unmasked.kernel_calls == 4 * 4
  dense = jattn.context_parallel_plan(2048, 2048, 4, causal=True)
  assert dense.shifts == (0, 1, 2, 3)
  assert (np.count_nonzero(dense.table[:, 1:], axis=(2, 3)) == 2).all()   # balanced


@pytest.mark.parametrize("p,window", ci_cases([(2, (11, 0)), (4, None), (3, (5, 2))],
                                               [(3, (5, 2))]))
def test_device_forward_equals_one_call(p, window):
  """Each device's forward run on its own (kernels and merges, no communication) equals its
  rows of the single call: diagonal pairs batched over the local chunks, neighbour pairs merged
  into their rows only."""
  n = 2 * p * 16
  q, k, v, _, _, _ = _inputs(3, 2, n, n, 4, 2, 8, 8, 0)
  mask = {"causal": True, "local_window_size": window}
  plan = jattn.context_parallel_plan(n, n, p, **mask)
  ref, ref_lse = jattn.flash_attention(q, k, v, return_lse=True, implementation="xla", **mask)
  shard = lambda x: jnp.split(cp.context_parallel_permute(x, p), p, axis=1)

  @jax.jit
  def devices(qs, ks, vs):   # every device's forward (each on its own inputs): one program
    kv = list(zip(ks, vs))
    return [cp.ring_device_forward(plan, qs[d], kv, d, implementation="xla") for d in range(p)]

  outs = devices(shard(q), shard(k), shard(v))
  out = cp.context_parallel_unpermute(jnp.concatenate([o for o, _ in outs], axis=1), p)
  lse = cp.context_parallel_unpermute(jnp.concatenate([x for _, x in outs], axis=1), p)
  assert rel_err(out, ref) < 2e-5 and rel_err(jnp.swapaxes(lse, 1, 2), ref_lse) < 2e-5


@pytest.mark.parametrize("on_gpu", [False, pytest.param(True, marks=pytest.mark.gpu)])
def test_contiguous_window_under_one_jit(on_gpu):
  """Every device's forward of a contiguous window plan (neighbour pairs: partial-row calls
  merged in place), traced as one program, equals the single call; on a GPU with the default
  kernels in bf16 (XLA:GPU's dynamic-slice fusion once made this program cyclic)."""
  p, n, w = 4, 4 * (512 if on_gpu else 32), (127 if on_gpu else 11, 0)
  dtype, impl = (jnp.bfloat16, None) if on_gpu else (jnp.float32, "xla")
  q, k, v = (x.astype(dtype) for x in _inputs(5, 1, n, n, 4, 2, 64, 64, 0)[:3])
  mask = {"causal": True, "local_window_size": w}
  plan = jattn.context_parallel_plan(n, n, p, **mask, layout="contiguous")
  shard = lambda x: jnp.split(cp.context_parallel_permute(x, p, layout="contiguous"), p, axis=1)

  @jax.jit
  def ring(qs, ks, vs):
    kv = list(zip(ks, vs))
    return [cp.ring_device_forward(plan, qs[d], kv, d, implementation=impl)[0]
            for d in range(p)]

  outs = ring(shard(q), shard(k), shard(v))
  out = cp.context_parallel_unpermute(jnp.concatenate(outs, axis=1), p, layout="contiguous")
  f32 = lambda x: x.astype(jnp.float32)
  ref = jattn.flash_attention(f32(q), f32(k), f32(v), implementation="xla", **mask)
  assert rel_err(f32(out), ref) < (1e-2 if on_gpu else 2e-5)


def test_bad_arguments_raise():
  x = jnp.zeros((1, 16, 2, 8))
  mesh = jax.make_mesh((1,), ("seq",))
  with pytest.raises(ValueError, match="strategy"):
    jattn.context_parallel_attention(x, x, x, mesh=mesh, axis_name="seq", strategy="tree")
  with pytest.raises(ValueError, match="layout"):
    jattn.context_parallel_attention(x, x, x, mesh=mesh, axis_name="seq", layout="striped")
  with pytest.raises(ValueError, match="axis_name"):
    jattn.context_parallel_attention(x, x, x, mesh=mesh, axis_name="data")
  with pytest.raises(ValueError, match="cudnn"):
    jattn.context_parallel_attention(x, x, x, mesh=mesh, axis_name="seq", implementation="cudnn")
  with pytest.raises(ValueError, match="num_shards"):
    jattn.context_parallel_permute(x, 0)
  sparse = functools.partial(jattn.sparse_attention, x, x, x, mesh=mesh, axis_name="seq",
                             top_k=1, q_block_size=4, implementation="xla")
  with pytest.raises(ValueError, match="block_size"):   # zigzag, 1 device: chunks of 8
    sparse(block_size=16)
  with pytest.raises(ValueError, match="gate_grad"):
    sparse(block_size=4, gate_grad="ste")
  with pytest.raises(ValueError, match="axis_name"):
    jattn.sparse_attention(x, x, x, mesh=mesh, block_size=4, top_k=1)
  sel = jattn.select_blocks(x, x, block_size=4, q_block_size=4, top_k=1)
  with pytest.raises(ValueError, match="selection"):
    jattn.context_parallel_plan(32, 32, 1, causal=True, selection=sel)   # made for 16 tokens
  from flax import nnx

  from jattn.nn import Attention, LayerSpec
  with pytest.raises(ValueError, match="csa"):
    Attention(16, 2, 2, 8, LayerSpec("csa", top_k=2, window=4), context_mesh=mesh,
              context_axis="seq", rngs=nnx.Rngs(0))


@pytest.mark.heavy
def test_on_8_cpu_devices(request):
  """Runs this module's ``eight`` tests in a process with 8 CPU devices."""
  if jax.device_count() >= 8:
    pytest.skip("this process has 8 devices: the eight_ tests run here")
  # conftest's XLA flags stay (the subprocess's conftest then has nothing to probe)
  env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                                    " --xla_force_host_platform_device_count=8").strip())
  cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         os.path.abspath(__file__), "-k", "eight_"]
  if request.config.getoption("--run-slow"):
    cmd.append("--run-slow")
  proc = subprocess.run(cmd, check=False, env=env, cwd=ROOT, capture_output=True, text=True,
                        timeout=900)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
  skipped = re.search(r"(\d+) skipped", proc.stdout)
  assert " passed" in proc.stdout, proc.stdout[-2000:]
  assert (int(skipped.group(1)) if skipped else 0) == (
      0 if request.config.getoption("--run-slow") else len(SLOW) + len(SPARSE_SLOW)), (
          proc.stdout[-2000:])


# ----------------------------------------------------------------------------- 8 devices
def _mesh(n=8):
  return jax.sharding.Mesh(np.array(jax.devices()[:n]), ("seq",))   # Auto axis


def _inputs(seed, b, lq, lk, hq, hk, d, dv, docs):
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  q, k, v = f(b, lq, hq, d), f(b, lk, hk, d), f(b, lk, hk, dv)
  seg = None
  if docs:   # ascending document ids with some padding (0) at the end
    seg = np.sort(rng.integers(1, docs + 1, (b, lq)), axis=1)
    seg[:, lq - 3:] = 0
    seg = jnp.asarray(seg, jnp.int32)
  return q, k, v, seg, f(b, lq, hq, dv), f(b, hq, lq)


def _check(strategy, layout, *, lq=100, lk=None, hq=4, hk=2, causal=True, window=None,
           docs=0, cap=None, mesh=None, **kw):
  """Outputs, LSE and gradients (through both) against ``flash_attention`` on one device."""
  lk = lk or lq
  mesh = mesh or _mesh()
  p = mesh.shape["seq"]
  q, k, v, seg, ct, ct_lse = _inputs(lq * 7 + lk, 2, lq, lk, hq, hk, 16, 8, docs)
  opts = {"causal": causal, "local_window_size": window, "logits_soft_cap": cap}
  perm = functools.partial(cp.context_parallel_permute, num_shards=p, layout=layout)
  unperm = functools.partial(cp.context_parallel_unpermute, num_shards=p, layout=layout)

  def single(q, k, v):
    return jattn.flash_attention(q, k, v, segment_ids=seg, return_lse=True,
                                 implementation="xla", **opts)

  def parallel(q, k, v):
    out, lse = jattn.context_parallel_attention(
        perm(q), perm(k), perm(v), mesh=mesh, axis_name="seq", return_lse=True,
        segment_ids=None if seg is None else perm(seg), strategy=strategy, layout=layout,
        **opts, **kw)
    return unperm(out), unperm(lse, axis=2)

  def loss(f, q, k, v):
    out, lse = f(q, k, v)
    return jnp.sum(out * ct) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * ct_lse)
  want = jax.jit(lambda q, k, v: (single(q, k, v), jax.grad(
      functools.partial(loss, single), (0, 1, 2))(q, k, v)))(q, k, v)
  got = jax.jit(lambda q, k, v: (parallel(q, k, v), jax.grad(
      functools.partial(loss, parallel), (0, 1, 2))(q, k, v)))(q, k, v)
  (o, lse), grads = got
  (o_ref, lse_ref), grads_ref = want
  assert (np.isfinite(lse) == np.isfinite(lse_ref)).all()
  fin = np.isfinite(lse_ref)
  errs = [rel_err(o, o_ref), rel_err(np.where(fin, lse, 0), np.where(fin, lse_ref, 0))]
  errs += [rel_err(g, r) for g, r in zip(grads, grads_ref)]
  assert max(errs) < 2e-3, errs


CASES = {   # strategies and layouts (SLOW: the rest); masks, GQA, soft cap, odd lengths spread over them
    "ring_zigzag": {"strategy": "ring", "layout": "zigzag", "docs": 5, "cap": 5.0},
    "ring_contiguous_halo": {"strategy": "ring", "layout": "contiguous", "window": (7, 0)},
    "ring_q_contiguous": {"strategy": "ring_q", "layout": "contiguous", "causal": False, "docs": 3},
    "all_gather_contiguous": {"strategy": "all_gather", "layout": "contiguous", "cap": 3.0},
}
SLOW = {
    "ring_contiguous": {"strategy": "ring", "layout": "contiguous", "causal": False,
                        "window": (7, 3)},
    "all_gather_zigzag": {"strategy": "all_gather", "layout": "zigzag", "window": (5, 0)},
    "ring_q_zigzag": {"strategy": "ring_q", "layout": "zigzag", "lq": 40, "lk": 100,
                      "causal": False, "window": (9, 2)},
    "ring_zigzag_long_kv": {"strategy": "ring", "layout": "zigzag", "lq": 40, "lk": 100, "hk": 1},
    "ring_zigzag_dense_window": {"strategy": "ring", "layout": "zigzag", "causal": False,
                                     "window": (20, 20), "docs": 2},
}


@eight
@pytest.mark.parametrize("name", list(CASES))
def test_eight_matches_single_device(name):
  _check(**CASES[name])


@eight
@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW))
def test_eight_matches_single_device_more(name):
  _check(**SLOW[name])


# 100 tokens: chunks of 7 (zigzag, 16 chunks) or 13 (contiguous, 8), padded at the end. Per-token
# selection under a mesh also runs by default in test_eight_transformer_context_parallel.
SPARSE = {
    "contiguous_blocks_documents": {"layout": "contiguous", "block_size": 13, "q_block_size": 13,
                                    "top_k": 1, "num_init_blocks": 0, "causal": False,
                                    "docs": 3},
}
SPARSE_SLOW = {
    "zigzag_per_token_documents": {"layout": "zigzag", "block_size": 7, "q_block_size": 1,
                                   "top_k": 0.3, "docs": 4},   # each token: 30% of its blocks
}


@eight
@pytest.mark.parametrize("name", list(SPARSE))
def test_eight_sparse_matches_single_device(name):
  _check_sparse(SPARSE[name])


@eight
@pytest.mark.slow
@pytest.mark.parametrize("name", list(SPARSE_SLOW))
def test_eight_sparse_matches_single_device_more(name):
  _check_sparse(SPARSE_SLOW[name])


def _check_sparse(case):
  """Block-sparse ring (GQA): outputs, LSE and gradients equal one device's sparse_attention."""
  opts = dict(case, implementation="xla", return_lse=True)
  layout = opts.pop("layout")
  q, k, v, seg, ct, ct_lse = _inputs(5, 2, 100, 100, 4, 2, 16, 8, opts.pop("docs", 0))
  perm = functools.partial(cp.context_parallel_permute, num_shards=8, layout=layout)
  unperm = functools.partial(cp.context_parallel_unpermute, num_shards=8, layout=layout)

  def parallel(q, k, v):
    out, lse = jattn.sparse_attention(perm(q), perm(k), perm(v), mesh=_mesh(), axis_name="seq",
                                      layout=layout, segment_ids=None if seg is None else perm(seg),
                                      **opts)
    return unperm(out), unperm(lse, axis=2)

  def loss(f, q, k, v):
    out, lse = f(q, k, v)
    return jnp.sum(out * ct) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * ct_lse)
  single = functools.partial(jattn.sparse_attention, segment_ids=seg, **opts)
  (o_ref, lse_ref), grads_ref = jax.jit(lambda q, k, v: (single(q, k, v), jax.grad(
      functools.partial(loss, single), (0, 1, 2))(q, k, v)))(q, k, v)
  (o, lse), grads = jax.jit(lambda q, k, v: (parallel(q, k, v), jax.grad(
      functools.partial(loss, parallel), (0, 1, 2))(q, k, v)))(q, k, v)
  fin = np.isfinite(lse_ref)   # padding rows (segment id 0) see nothing: -inf
  assert (np.isfinite(lse) == fin).all() and fin.mean() > 0.9
  errs = [rel_err(o, o_ref), rel_err(np.where(fin, lse, 0), np.where(fin, lse_ref, 0))]
  errs += [rel_err(g, r) for g, r in zip(grads, grads_ref)]
  assert max(errs) < 2e-3, errs


@eight
def test_eight_sparse_skips_unselected_pairs(monkeypatch):
  """Contiguous layout: chunk pairs in which no row keeps a block never run, the plan counts
  the ones that do, and the output equals one device's."""
  count = _count_calls(monkeypatch, "block_sparse_attention")
  n, kw = 256, {"block_size": 16, "q_block_size": 32, "top_k": 1, "implementation": "xla"}
  q, k, v, _, _, _ = _inputs(2, 1, n, n, 4, 2, 16, 16, 0)
  ref, sel = jattn.sparse_attention(q, k, v, return_selection=True, **kw)
  f = jax.jit(functools.partial(jattn.sparse_attention, mesh=_mesh(), axis_name="seq",
                                layout="contiguous", **kw))
  assert rel_err(f(q, k, v), ref) < 2e-3
  plan = jattn.context_parallel_plan(n, n, 8, causal=True, layout="contiguous", selection=sel)
  causal_calls = jattn.context_parallel_plan(n, n, 8, causal=True,
                                             layout="contiguous").kernel_calls
  assert len(count) == plan.kernel_calls < causal_calls, (len(count), plan.kernel_calls)


@eight
def test_eight_interpret_kernel():
  _check("ring", "zigzag", lq=64, hq=2, mesh=_mesh(2), implementation="triton", interpret=True)


def _count_calls(monkeypatch, name="flash_attention"):
  """Counts the chunk-pair kernel calls that run (on every device), via a debug callback; a
  call batched over a device's chunks (batch B * m, here B = 1) counts m pairs."""
  count = []
  real = getattr(cp, name)

  def counted(q, *a, **kw):
    jax.debug.callback(lambda: count.extend([1] * q.shape[0]))
    return real(q, *a, **kw)
  monkeypatch.setattr(cp, name, counted)
  return count


@eight
def test_eight_counts_window_and_document_skips(monkeypatch):
  count = _count_calls(monkeypatch)
  mesh, n = _mesh(), 512
  q, k, v, _, _, _ = _inputs(1, 1, n, n, 2, 2, 16, 16, 0)
  perm = functools.partial(cp.context_parallel_permute, num_shards=8)
  plan = jattn.context_parallel_plan(n, n, 8, causal=True, local_window_size=(15, 0))
  f = jax.jit(functools.partial(jattn.context_parallel_attention, mesh=mesh, axis_name="seq",
                                causal=True, local_window_size=(15, 0)))
  jax.block_until_ready(f(perm(q), perm(k), perm(v)))
  # Shift 0: 16 diagonal pairs and device 7's (chunks 7, 8 adjacent: one joint call for 3 pairs).
  assert plan.shifts == (0, 1, 7) and len(count) == plan.kernel_calls == 16 + 1 + 7 + 7 - 2
  # Causal: shift 0, devices 0-6 a diagonal call (2 chunks) and a full pair, device 7 its joint
  # call; every later shift, one call per device for its full pairs (one query or key chunk).
  count.clear()
  causal = jattn.context_parallel_plan(n, n, 8, causal=True)
  g = jax.jit(functools.partial(jattn.context_parallel_attention, mesh=mesh, axis_name="seq",
                                causal=True))
  out = g(perm(q), perm(k), perm(v))
  ref = jattn.flash_attention(q, k, v, causal=True, implementation="xla")
  assert rel_err(cp.context_parallel_unpermute(out, 8), ref) < 2e-3
  assert len(count) == causal.kernel_calls == 7 * 3 + 1 + 7 * 8
  # Packed documents of 32 tokens (= one of the 16 chunks): pairs across documents never run.
  count.clear()
  seg = perm(jnp.repeat(jnp.arange(1, 17, dtype=jnp.int32), 32)[None])
  f = jax.jit(functools.partial(jattn.context_parallel_attention, mesh=mesh, axis_name="seq",
                                causal=True))
  out = f(perm(q), perm(k), perm(v), segment_ids=seg)
  ref = jattn.flash_attention(q, k, v, causal=True, segment_ids=cp.context_parallel_unpermute(
      seg, 8), implementation="xla")
  assert rel_err(cp.context_parallel_unpermute(out, 8), ref) < 2e-3
  assert len(count) == 15   # one diagonal call per chunk, device 7's two in its joint call


def _dims(text):
  return {int(x) for shape in re.findall(r"\[([\d,]+)\]", text) for x in shape.split(",") if x}


@eight
def test_eight_ring_holds_no_full_sequence_kv():
  mesh, n = _mesh(), 1024   # local shards: 128 keys
  shape = jax.ShapeDtypeStruct((1, n, 2, 24), jnp.float32)
  def loss(q, k, v, strategy):
    return jnp.sum(jattn.context_parallel_attention(q, k, v, mesh=mesh, axis_name="seq",
                                                    causal=True, strategy=strategy))
  grads = jax.jit(jax.grad(functools.partial(loss, strategy="ring"), (0, 1, 2)))
  ring = _dims(grads.lower(shape, shape, shape).compile().as_text())   # forward and backward
  assert 128 in ring and 1024 not in ring, sorted(ring)
  gathered = jax.jit(functools.partial(loss, strategy="all_gather")).lower(shape, shape, shape)
  assert 1024 in _dims(gathered.compile().as_text())   # the check sees a gathered sequence


@eight
def test_eight_sharded_decode():
  mesh = _mesh()
  rng = np.random.default_rng(3)
  q = jnp.asarray(rng.standard_normal((3, 4, 16)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((3, 128, 2, 16)), jnp.float32) for _ in range(2))
  lengths = jnp.array([5, 128, 70], jnp.int32)
  out, lse = jattn.context_parallel_decode_attention(q, k, v, lengths, mesh=mesh,
                                                     axis_name="seq", return_lse=True,
                                                     logits_soft_cap=4.0)
  ref, ref_lse = jattn.decode_attention(q, k, v, lengths, return_lse=True, logits_soft_cap=4.0,
                                        implementation="xla")
  assert rel_err(out, ref) < 2e-3 and rel_err(lse, ref_lse) < 2e-3


@eight
def test_eight_transformer_context_parallel():
  from flax import nnx

  from jattn.nn import LayerSpec, Transformer, TransformerConfig
  mesh = _mesh(4)   # 4 shards of 8 tokens (8 shards compile 1.6x longer)
  cfg = functools.partial(TransformerConfig, 50, 2, 32, 4, 2, 8, layers=(
      LayerSpec("local", window=6), LayerSpec("sparse", top_k=2, block_size=2, q_block_size=1)))
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, 50, (2, 32)), jnp.int32)

  def loss(model, tokens):   # order-free: a mean over tokens
    return jnp.mean(jax.nn.log_softmax(model(tokens))[..., 0])
  ref_model = Transformer(cfg(), rngs=nnx.Rngs(0))
  model = Transformer(cfg(context_mesh=mesh, context_axis="seq"), rngs=nnx.Rngs(0))
  ref_loss, ref_grads = nnx.jit(nnx.value_and_grad(loss))(ref_model, tokens)
  got_loss, grads = nnx.jit(nnx.value_and_grad(loss))(
      model, cp.context_parallel_permute(tokens, 4))
  assert abs(float(got_loss) - float(ref_loss)) < 1e-5
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    assert rel_err(g, r) < 2e-3
