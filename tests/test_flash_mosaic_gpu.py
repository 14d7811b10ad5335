"""Mosaic GPU (Hopper) flash attention, Triton backward: what the CPU can check, and GPU tests.

On the CPU nothing here runs the kernel: jax's Mosaic GPU interpret mode cannot execute it (its
wgmma takes neither a transposed K nor P from registers). The CPU tests check
  * that the kernel lowers for "cuda" (``jax.export``: the whole Pallas -> Mosaic GPU lowering in
    Python, register layouts, wgmma/TMA constraints, the shared-memory budget);
  * the tile walk: for every program and warpgroup, the kv tiles it skips are fully masked, the
    tiles it runs without a mask are fully visible, and the memory warpgroup loads exactly the
    tiles that the compute warpgroups need;
  * a jnp replay of the kernel's walk (same programs, warpgroup rows, kv ranges, full/masked split
    and the kernel's own mask, online-softmax and finalize helpers, P cast to the input dtype)
    against the fp32 reference, including padded lengths, bottom-right causal alignment and rows
    that see no key;
  * the registration in ``jattn.flash_attention(implementation="mosaic_gpu")``: its custom_vjp
    hands the forward's out and LSE to the Triton backward kernels, run in interpret mode with
    ``fk.fwd_call`` replaced by the replay (monkeypatch), against the fp32 reference's VJP; that
    every unsupported option raises NotImplementedError naming it; and that forward + backward
    lower for "cuda" (``.lower(lowering_platforms=("cuda",))``: ``jax.export`` refuses the
    Triton custom call, which has no export compatibility guarantee).
Tests marked ``gpu`` run the compiled kernel on an sm90 GPU against the reference: the kernel
alone, and forward + VJP through ``jattn.flash_attention(implementation="mosaic_gpu")``.
"""
from __future__ import annotations

import dataclasses
import re
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from pallas_kernels import compat
from pallas_kernels.common import walk as wk
from pallas_kernels.flash import mosaic_gpu as mg
from pallas_kernels.flash import mosaic_gpu_fwd_kernel as fk
from pallas_kernels.flash.reference import attention_reference
from pallas_kernels.tuning import mask_kind
from tests.helpers import ci_cases, normal

TOL = {jnp.bfloat16: 2e-2, jnp.float16: 2e-2}
# Options for compiling the CPU replay only (how XLA:CPU optimises the test harness).
_FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _rel(a, b):
  a = np.asarray(a, np.float32).astype(np.float64)
  b = np.asarray(b, np.float32).astype(np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _check(out, lse, q, k, v, causal, dtype, q_seg=None, kv_seg=None, **mask):
  """Kernel (or replay) results against the fp32 reference; ``mask``: local_window_size,
  logits_soft_cap, scale (the reference's keywords)."""
  ref = jax.jit(lambda q, k, v, qs, ks: attention_reference(
      q, k, v, causal=causal, q_segment_ids=qs, kv_segment_ids=ks, **mask))
  r_out, r_lse = ref.lower(q, k, v, q_seg, kv_seg).compile(_FAST_CPU_COMPILE)(
      q, k, v, q_seg, kv_seg)
  tol = TOL[dtype]
  assert out.shape == r_out.shape and out.dtype == q.dtype
  assert _rel(out, r_out) < tol, _rel(out, r_out)
  lse, r_lse = np.asarray(lse), np.asarray(r_lse)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(r_lse))
  fin = np.isfinite(r_lse)
  assert np.isfinite(lse[fin]).all()
  assert _rel(np.where(fin, lse, 0.0), np.where(fin, r_lse, 0.0)) < tol
  if (~fin).any():   # rows that see no key: output exactly 0
    rows = np.asarray(out, np.float32).transpose(0, 2, 1, 3)[~fin]
    assert (rows == 0).all()


def _inputs(seed, b, sq, sk, hq, hk, d, dtype):
  return normal(seed, (b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, d), dtype=dtype)


# -------------------------------------------------------------------------------- lowering (CPU)

def _bs(block_k, stages, protocol="pingpong", **kw):
  return mg.BlockSizes(64, block_k, stages, protocol=protocol, **kw)


# Each protocol at the head dims and tiles its table entries use, with the masks the kernel
# branches on (causal, windows, soft cap, segment ids, ragged lengths); then the per-call options.
LOWER_CASES = {
    "d128_pingpong": dict(sq=256, sk=256, hq=2, hk=2, d=128, causal=False, bs=_bs(128, 2)),
    "d256_causal_ragged_pingpong": dict(sq=200, sk=300, hq=2, hk=1, d=256, causal=True,
                                        bs=_bs(64, 2)),
    "d64_fp16_q_longer_pingpong_kwait": dict(sq=384, sk=130, hq=2, hk=1, d=64, causal=True,
                                             dtype=jnp.float16, bs=_bs(128, 3, "pingpong_kwait")),
    "d64_bk256_segments_pingpong_kwait": dict(sq=328, sk=600, hq=2, hk=1, d=64, causal=False,
                                              seg=True, bs=_bs(256, 3, "pingpong_kwait")),
    "d64_soft_cap_pingpong_kwait": dict(sq=256, sk=256, hq=2, hk=2, d=64, causal=True,
                                        logits_soft_cap=30.0, bs=_bs(128, 3, "pingpong_kwait")),
    "d128_causal_gqa_handoff_kwait_fence": dict(sq=512, sk=512, hq=4, hk=2, d=128, causal=True,
                                                bs=_bs(128, 2, "handoff_kwait_fence")),
    "d128_window_100_30_handoff_kwait_fence": dict(
        sq=200, sk=328, hq=4, hk=2, d=128, causal=False, local_window_size=(100, 30),
        bs=_bs(128, 2, "handoff_kwait_fence")),
    "d128_segments_causal_handoff_kwait_fence": dict(
        sq=200, sk=328, hq=4, hk=2, d=128, causal=True, seg=True,
        bs=_bs(128, 2, "handoff_kwait_fence")),
    "d256_causal_window_511_handoff_kwait": dict(
        sq=1024, sk=1024, hq=2, hk=1, d=256, causal=True, local_window_size=(511, 0),
        bs=_bs(64, 2, "handoff_kwait")),
    "d256_segments_soft_cap_handoff_kwait": dict(
        sq=512, sk=512, hq=2, hk=2, d=256, causal=True, seg=True, logits_soft_cap=5.0,
        bs=_bs(64, 2, "handoff_kwait")),
    "d128_overlap": dict(sq=384, sk=320, hq=4, hk=2, d=128, causal=False,
                         bs=_bs(128, 2, "overlap")),
    "d128_causal_window_64_overlap": dict(sq=200, sk=328, hq=4, hk=2, d=128, causal=True,
                                          local_window_size=(64, 0), bs=_bs(128, 2, "overlap")),
    "d256_causal_overlap": dict(sq=512, sk=512, hq=2, hk=2, d=256, causal=True,
                                bs=_bs(64, 2, "overlap")),
    "d64_segments_window_soft_cap_overlap_3_stages": dict(
        sq=328, sk=200, hq=2, hk=1, d=64, causal=False, seg=True, local_window_size=(100, 30),
        logits_soft_cap=5.0, bs=_bs(128, 3, "overlap")),
    "d128_segments_overlap_one_segment_static_mask": dict(
        sq=512, sk=512, hq=4, hk=2, d=128, causal=True, seg=True,
        bs=_bs(128, 2, "overlap", one_segment_static_mask=True)),
    # tail_kv_splits: the main launch, the key-chunk launch and the in-place row writer
    "d128_tail_kv_splits_overlap": dict(sq=700, sk=1024, hq=4, hk=2, d=128, causal=False,
                                        bs=_bs(128, 2, "overlap", tail_kv_splits=4)),
    "d256_tail_kv_splits_overlap": dict(sq=512, sk=512, hq=2, hk=2, d=256, causal=False,
                                        bs=_bs(64, 2, "overlap", tail_kv_splits=2)),
}


def test_block_sizes_checks():
  """BlockSizes rejects an unknown protocol and several query tiles per program without the
  overlap (whose hand-over turns alone run on across a program's tiles)."""
  with pytest.raises(ValueError, match="protocol"):
    mg.BlockSizes(64, 128, 2, protocol="no_such_protocol")
  for name in mg.PROTOCOLS:
    if name != "overlap":
      with pytest.raises(ValueError, match="q_tiles_per_program"):
        _bs(128, 2, name, q_tiles_per_program=2)
  assert _bs(128, 2, "overlap", q_tiles_per_program=2).q_tiles_per_program == 2


def _simulate_turns(tiles, skips, rng):
  """The overlap's hand-over barriers (``rendezvous.at[wg]``: one arrival completes a phase)
  under a random interleaving of the two compute warpgroups, for a program whose query tiles
  have ``tiles[i] + 1`` turns each. ``skips(wg, k, n, first, last)`` -> (skip wait, skip
  hand-over). Returns None if every op ran with each barrier phase waited for before the next
  arrival, else the failure ("deadlock" or "second arrival before the wait")."""
  ops = {0: [], 1: []}
  for i, n in enumerate(tiles):
    for wg in (0, 1):
      for k in range(n + 1):
        sw, sh = (bool(x) for x in skips(wg, k, n, i == 0, i == len(tiles) - 1))
        if not sw:
          ops[wg].append(("wait", wg))
        if not sh:
          ops[wg].append(("arrive", 1 - wg))
  completed, waited, pos = [0, 0], [0, 0], [0, 0]
  while pos[0] < len(ops[0]) or pos[1] < len(ops[1]):
    ready = []
    for wg in (0, 1):
      if pos[wg] < len(ops[wg]):
        op, bar = ops[wg][pos[wg]]
        if op == "arrive" or completed[bar] > waited[bar]:
          ready.append(wg)
    if not ready:
      return "deadlock"
    wg = ready[rng.integers(len(ready))]
    op, bar = ops[wg][pos[wg]]
    if op == "arrive":
      if completed[bar] - waited[bar] >= 1:
        return "second arrival before the wait"
      completed[bar] += 1
    else:
      waited[bar] += 1
    pos[wg] += 1
  return None if completed == waited else "unconsumed arrival"


@pytest.mark.parametrize("tiles", [(3,), (0, 2)] + [pytest.param(t, marks=pytest.mark.slow)
                                                   for t in [(3, 3), (1, 4, 2), (2, 0, 0, 5),
                                                             (6, 6, 6, 6)]])
def test_overlap_turns_run_on_across_query_tiles(tiles):
  """``_turn_skips`` over a program's query tiles (turn counts per tile, 0: a tile whose range
  is empty still has its one turn): no deadlock and no barrier phase arrived twice before its
  wait, for 200 random interleavings; restarting the single-tile protocol at every tile (what
  a single query tile needs) fails as soon as a program has two tiles."""
  rng = np.random.default_rng(sum(tiles) * 31 + len(tiles))
  for _ in range(200):
    assert _simulate_turns(tiles, fk._turn_skips, rng) is None
  per_tile = lambda wg, k, n, first, last: fk._turn_skips(wg, k, n, True, True)
  results = {_simulate_turns(tiles, per_tile, rng) for _ in range(200)}
  if len(tiles) == 1:
    assert results == {None}
  else:
    assert results - {None}, results


def _mosaic_module_text(bs, monkeypatch, seq=512):
  """The Mosaic GPU module of the D128 forward as text, captured before serialization (by
  wrapping ``mosaic.gpu.core._run_serde_pass``) while lowering for "cuda" on the CPU."""
  from jax.experimental.mosaic.gpu import core as mgpu_core
  seen = []
  orig = mgpu_core._run_serde_pass

  def spy(module, *, serialize, **kw):
    if serialize:
      seen.append(str(module))
    return orig(module, serialize=serialize, **kw)
  monkeypatch.setattr(mgpu_core, "_run_serde_pass", spy)
  q = jax.ShapeDtypeStruct((1, seq, 2, 128), jnp.bfloat16)
  jax.jit(lambda q: mg.flash_attention(q, q, q, block_sizes=bs)).trace(q).lower(
      lowering_platforms=("cuda",))
  assert len(seen) == 1
  return seen[0]


def test_overlap_keeps_both_wgmmas_in_flight(monkeypatch):
  """The overlap kernel waits with one wgmma group still pending (Q K^T done, P V not) in its
  loop; the default kernel only ever waits for all (so this test can fail)."""
  import re
  pending = lambda text: sorted(set(re.findall(r"wgmma\.wait\.group\.sync\.aligned (\d+)", text)))
  assert pending(_mosaic_module_text(mg.BlockSizes(64, 128, 2), monkeypatch)) == ["0"]
  assert pending(_mosaic_module_text(_bs(128, 2, "overlap"), monkeypatch)) == ["0", "1"]


@pytest.mark.parametrize("name", ci_cases(LOWER_CASES, [   # one case per protocol
    "d128_pingpong", "d64_fp16_q_longer_pingpong_kwait", "d128_causal_gqa_handoff_kwait_fence",
    "d256_causal_window_511_handoff_kwait", "d64_segments_window_soft_cap_overlap_3_stages",
    "d128_tail_kv_splits_overlap"]))
def test_lowers_for_cuda(name):
  case = dict(LOWER_CASES[name])
  dtype = case.pop("dtype", jnp.bfloat16)
  bs = case.pop("bs", None)
  seg = case.pop("seg", False)
  mask = {key: case.pop(key) for key in ("local_window_size", "logits_soft_cap") if key in case}
  sq, sk, hq, hk, d = (case[n] for n in ("sq", "sk", "hq", "hk", "d"))
  q = jax.ShapeDtypeStruct((2, sq, hq, d), dtype)
  kv = jax.ShapeDtypeStruct((2, sk, hk, d), dtype)
  segs = ((jax.ShapeDtypeStruct((2, sq), jnp.int32), jax.ShapeDtypeStruct((2, sk), jnp.int32))
          if seg else ())
  fn = jax.jit(lambda q, k, v, *segs: mg.flash_attention(q, k, v, *segs, causal=case["causal"],
                                                         block_sizes=bs, **mask))
  lowered = fn.trace(q, kv, kv, *segs).lower(lowering_platforms=("cuda",))
  text = lowered.as_text()
  assert "mosaic_gpu" in text and "wgmma" in text
  assert [a.shape for a in jax.tree.leaves(lowered.out_info)] == [(2, sq, hq, d), (2, hq, sq)]
  # tail_kv_splits writes the skipped rows with one Triton kernel (aliased, in place)
  n_triton = text.count("__gpu$xla.gpu.triton") + text.count("triton_kernel_call_ffi")
  assert n_triton == (1 if bs is not None and bs.tail_kv_splits else 0), n_triton


@pytest.mark.parametrize("protocol,causal,seg", ci_cases([
    ("overlap", True, False), ("overlap", False, True), ("pingpong", True, False),
    ("pingpong_kwait", True, True), ("handoff_kwait", False, False),
    ("handoff_kwait_fence", True, False)], [   # each protocol once
    ("overlap", False, True), ("pingpong", True, False), ("pingpong_kwait", True, True),
    ("handoff_kwait", False, False), ("handoff_kwait_fence", True, False)]))
def test_protocols_lower_with_a_block_schedule(protocol, causal, seg):
  """Each protocol on a block schedule's walk (drains, per-entry codes; the overlap's pending
  P V carried across skipped entries), D128, with and without segment ids."""
  from pallas_kernels.block_schedule import make_schedule
  q = jax.ShapeDtypeStruct((2, 512, 2, 128), jnp.bfloat16)
  ids = jax.ShapeDtypeStruct((2, 512), jnp.int32)
  sched = make_schedule(512, 512, 128, 128, causal=causal, local_window_size=(200, 0))
  bs = _bs(128, 2, protocol)
  segs = (ids, ids) if seg else ()
  fn = jax.jit(lambda q, k, v, *segs: mg.flash_attention(q, k, v, *segs, causal=causal,
                                                         block_sizes=bs, schedule=sched))
  text = fn.trace(q, q, q, *segs).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text and "wgmma" in text


def test_kv_prefix_lowers_and_checks():
  """``kv_prefix`` (a context-parallel ring's halo read from its own arrays) lowers with two
  more kernel operands; a prefix that is not whole tiles, or with segment ids, is refused."""
  q = jax.ShapeDtypeStruct((1, 1000, 2, 128), jnp.bfloat16)
  pre = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
  fn = jax.jit(lambda q, k, v, kp, vp: mg.flash_attention(
      q, k, v, causal=True, local_window_size=(200, 0), kv_prefix=(kp, vp)))
  lowered = fn.trace(q, q, q, pre, pre).lower(lowering_platforms=("cuda",))
  assert [a.shape for a in jax.tree.leaves(lowered.out_info)] == [(1, 1000, 2, 128), (1, 2, 1000)]
  odd = jax.ShapeDtypeStruct((1, 100, 2, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="kv_prefix"):
    mg.flash_attention(q, q, q, causal=True, kv_prefix=(odd, odd))
  ids = jax.ShapeDtypeStruct((1, 1000), jnp.int32)
  with pytest.raises(ValueError, match="kv_prefix"):
    mg.flash_attention(q, q, q, ids, ids, kv_prefix=(pre, pre))


def test_shared_memory_overflow_fails_to_lower():
  """The lowering checks the shared-memory budget (so the lowering test can fail): 3 stages of
  128-key tiles at D128 need ~227 KiB plus barriers, over the limit."""
  q = jax.ShapeDtypeStruct((1, 256, 1, 128), jnp.bfloat16)
  fn = jax.jit(lambda q: mg.flash_attention(q, q, q, block_sizes=mg.BlockSizes(64, 128, 3)))
  with pytest.raises(ValueError, match="shared memory"):
    jax.export.export(fn, platforms=["cuda"])(q)


# ------------------------------------------------- several query tiles per program (CPU)

# BlockSizes(q_tiles_per_program=P): each program runs P query tiles of one (batch, head) one
# after the other, the K/V ring running on across them and the next tile's Q prefetched into a
# second Q/O buffer. Lengths: 2048 / 256 = 8 tiles; 1000 -> 4 tiles (P=3: 3 + 1); 700 x 260
# causal: tiles of rows that see no key.
Q_TILES_LOWER_CASES = {
    "d128_dense_ragged_p3": dict(sq=1000, sk=777, causal=False, p=3),
    "d128_causal_window_511_p2": dict(sq=2048, sk=2048, causal=True, p=2,
                                      local_window_size=(511, 0)),
    "d128_causal_q_longer_empty_rows_p4": dict(sq=700, sk=260, causal=True, p=4),
}


@pytest.mark.parametrize("name", list(Q_TILES_LOWER_CASES))
def test_q_tiles_per_program_lowers_for_cuda(name):
  case = dict(Q_TILES_LOWER_CASES[name])
  bs = _bs(128, 2, "overlap", q_tiles_per_program=case.pop("p"))
  mask = {"local_window_size": case.pop("local_window_size", None)}
  sq, sk = case["sq"], case["sk"]
  q = jax.ShapeDtypeStruct((2, sq, 4, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, sk, 2, 128), jnp.bfloat16)
  fn = jax.jit(lambda q, k, v: mg.flash_attention(q, k, v, causal=case["causal"],
                                                  block_sizes=bs, **mask))
  exported = jax.export.export(fn, platforms=["cuda"])(q, kv, kv)
  text = exported.mlir_module()
  assert "mosaic_gpu" in text and "wgmma" in text
  assert [a.shape for a in exported.out_avals] == [(2, sq, 4, 128), (2, 4, sq)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_q,p", [(1, 2), (5, 2), (8, 4), (7, 3), (3, 8)])
def test_q_tiles_per_program_cover_every_tile_once(n_q, p, causal):
  """``_program_tiles``: the programs' tiles are every query tile exactly once, consecutive
  within a program, every program but possibly the last has P; causal: longest first."""
  st = mg._static_config((1, n_q * 128, 1, 128), (1, n_q * 128, 1, 128), jnp.bfloat16,
                         causal=causal, scale=None,
                         block_sizes=_bs(128, 2, "overlap", q_tiles_per_program=p))
  assert st.num_q_programs == n_q and st.num_programs == -(-n_q // p)
  seen = []
  for g in range(st.num_programs):
    count, tile_of = fk._program_tiles(g, st)
    count = int(count)
    assert 1 <= count <= p and (count == p or g == st.num_programs - 1)
    tiles = [int(tile_of(jnp.int32(i))) for i in range(count)]
    assert tiles == sorted(tiles, reverse=causal)
    assert abs(tiles[-1] - tiles[0]) == count - 1
    seen += tiles
  assert sorted(seen) == list(range(n_q))
  if causal:
    assert seen == list(range(n_q))[::-1]


def test_q_tiles_per_program_checks():
  for bad in (0, -1, 1.5, True, "2"):
    with pytest.raises(ValueError, match="q_tiles_per_program"):
      mg.BlockSizes(64, 128, 2, q_tiles_per_program=bad)
  bs = _bs(128, 2, "overlap", q_tiles_per_program=2)
  q = jnp.ones((1, 256, 2, 128), jnp.bfloat16)
  seg = jnp.ones((1, 256), jnp.int32)
  with pytest.raises(ValueError, match="segment ids or a block schedule"):
    mg.flash_attention(q, q, q, seg, seg, block_sizes=bs)
  from pallas_kernels.block_schedule import make_schedule
  with pytest.raises(ValueError, match="segment ids or a block schedule"):
    mg.flash_attention(q, q, q, schedule=make_schedule(256, 256, 128, 128), block_sizes=bs)


def test_q_tiles_per_program_d256_over_shared_memory():
  """D256 (64x64 tiles, 2 stages) with the second Q/O buffer: over the 227 KiB limit."""
  q = jax.ShapeDtypeStruct((1, 512, 2, 256), jnp.bfloat16)
  bs = _bs(64, 2, "overlap", q_tiles_per_program=2)
  fn = jax.jit(lambda q: mg.flash_attention(q, q, q, causal=True, block_sizes=bs))
  with pytest.raises(ValueError, match="shared memory"):
    jax.export.export(fn, platforms=["cuda"])(q)


# ---------------------------------------------------------------------------- tile walk (CPU)


WALK_MASKS = {
    "dense": dict(causal=False),
    "causal": dict(causal=True),
    "causal_window_64": dict(causal=True, window=(64, 0)),
    "window_100_30": dict(causal=False, window=(100, 30)),
    "causal_window_511": dict(causal=True, window=(511, 0)),
    "window_left_only": dict(causal=False, window=(70, None)),
    "window_right_only": dict(causal=False, window=(None, 5)),
    "window_0_0": dict(causal=False, window=(0, 0)),
}


def _walk_segments(name, b, sq, sk):
  """Segment ids for the walk tests: packed documents with padding (0) at the end, or random
  short runs (documents that do not line up between q and kv)."""
  rng = np.random.default_rng(zlib.crc32(name.encode()))
  if sq == sk:   # packed documents, the tail padding
    cuts = np.sort(rng.choice(np.arange(1, sq), size=3, replace=False))
    q = np.searchsorted(cuts, np.arange(sq), side="right") + 1
    q[sq - sq // 7:] = 0
    q = np.broadcast_to(q, (b, sq)).copy()
    return q.astype(np.int32), q.astype(np.int32)
  q = np.sort(rng.integers(0, 4, size=(b, sq)), axis=1)
  k = np.sort(rng.integers(0, 4, size=(b, sk)), axis=1)
  return q.astype(np.int32), k.astype(np.int32)


_SEG_BOUNDS_JIT = jax.jit(fk.seg_bounds, static_argnums=2)


def _walk_ranges(st, q_seg_p=None, kv_seg_p=None):
  """numpy [B, programs, 2] (plo, phi) and [B, programs, 2, 4] (lo, flo, fhi, hi) exactly as the
  kernel derives them (``_program_ranges``), for every batch row."""
  n = st.num_q_programs
  if q_seg_p is not None:
    # one jitted program per config (op by op, each of its ~30 ops compiled on its own: 4x slower)
    bounds = np.asarray(_SEG_BOUNDS_JIT(jnp.asarray(q_seg_p), jnp.asarray(kv_seg_p), st))
    return bounds[..., :2], bounds[..., 2:fk._SEG_BOUNDS_ONE].reshape(
        bounds.shape[:2] + (fk.COMPUTE_WGS, 4))
  prog, wgs = [], []
  for tile in range(n):
    row0 = tile * 2 * st.block_q
    plo, _, _, phi = (int(x) for x in fk._static_ranges(row0, 2 * st.block_q, st))
    prog.append((plo, phi))
    wgs.append([tuple(int(x) for x in fk._clip_to_program(
        plo, phi, *fk._static_ranges(row0 + wg * st.block_q, st.block_q, st)))
        for wg in range(2)])
  return np.asarray(prog)[None], np.asarray(wgs)[None]


def _check_walk(st, q_seg=None, kv_seg=None, *, tight=True):
  """Every warpgroup's walk against an independent element mask (``masks.element_mask``): tiles
  outside [lo, hi) are invisible to its real rows, tiles in [flo, fhi) fully visible (no mask),
  lo <= flo <= fhi <= hi inside the program's [plo, phi), which is exactly the union of the
  warpgroups' non-empty ranges (the memory warpgroup loads nothing else); with ``tight`` the
  first and last tile of a range hold a visible key."""
  from pallas_kernels.masks import element_mask
  bq, bk, sq, sk = st.block_q, st.block_k, st.q_len, st.kv_len
  sq_pad, sk_pad = st.num_q_programs * 2 * bq, st.num_kv_tiles * bk
  q_pos = np.arange(sq_pad) + (sk - sq)
  k_pos = np.arange(sk_pad)
  segs = q_seg is not None
  if segs:
    q_seg_p = np.pad(q_seg, ((0, 0), (0, sq_pad - sq)))
    kv_seg_p = np.pad(kv_seg, ((0, 0), (0, sk_pad - sk)))
    vis = np.asarray(element_mask(q_pos, k_pos, causal=st.causal, window=st.window, kv_len=sk,
                                  q_seg=q_seg_p, kv_seg=kv_seg_p))          # [B, Sq', Sk']
    prog, wgs = _walk_ranges(st, q_seg_p, kv_seg_p)
  else:
    vis = np.asarray(element_mask(q_pos, k_pos, causal=st.causal, window=st.window,
                                  kv_len=sk))[None]
    prog, wgs = _walk_ranges(st)
  vis = vis & (np.arange(sq_pad) < sq)[None, :, None]                         # real rows only
  tiles = vis.reshape(vis.shape[0], sq_pad // bq, bq, st.num_kv_tiles, bk)
  any_vis = tiles.any(axis=(2, 4))                                           # [B, wg tiles, nk]
  real = (np.arange(sq_pad) < sq).reshape(-1, bq)                             # [wg tiles, bq]
  all_vis = (tiles | ~real[None, :, :, None, None]).all(axis=(2, 4))
  for bi in range(prog.shape[0]):
    for p in range(st.num_q_programs):
      plo, phi = prog[bi, p]
      assert 0 <= plo <= phi <= st.num_kv_tiles, (bi, p, plo, phi)
      union = set()
      for wg in range(2):
        lo, flo, fhi, hi = wgs[bi, p, wg]
        i = 2 * p + wg
        where = (bi, p, wg, (lo, flo, fhi, hi))
        assert plo <= lo <= flo <= fhi <= hi <= phi, where
        t = np.arange(st.num_kv_tiles)
        assert not any_vis[bi, i, (t < lo) | (t >= hi)].any(), where      # skipped: invisible
        assert all_vis[bi, i, flo:fhi].all(), where                        # unmasked: visible
        if hi > lo:
          union |= set(range(lo, hi))
          if tight:
            assert any_vis[bi, i, lo] and any_vis[bi, i, hi - 1], where
        if tight and not segs:   # no visible tile is masked without need at the range's edges
          assert not (any_vis[bi, i].any() and hi == lo), where
      assert union == set(range(plo, phi)), (bi, p, union, plo, phi)
  if not segs:
    _check_edge_masks(st, vis[0], wgs[0])


def _check_edge_masks(st, vis, wgs):
  """The kernel's edge masks (``_tile_visible`` with edge "left" on a warpgroup's [lo, flo),
  "right" on [fhi, hi), ``_edge_bounds``) equal the element mask ``vis`` [Sq', Sk'] on every
  real row of those tiles."""
  bq, bk = st.block_q, st.block_k
  rows = np.arange(bq)[:, None]
  cols = np.arange(bk)[None, :]
  real = np.arange(vis.shape[0]) < st.q_len
  for p in range(st.num_q_programs):
    for wg in range(2):
      lo, flo, fhi, hi = (int(x) for x in wgs[p, wg])
      row0 = (2 * p + wg) * bq
      for edge, tiles in (("left", range(lo, flo)), ("right", range(fhi, hi))):
        for t in tiles:
          got = fk._tile_visible(rows, cols, row0, t, st, edge=edge)
          got = np.ones((bq, bk), bool) if got is None else np.broadcast_to(got, (bq, bk))
          want = vis[row0:row0 + bq, t * bk:(t + 1) * bk]
          ok = real[row0:row0 + bq, None]
          assert ((got == want) | ~ok).all(), (p, wg, edge, t, (lo, flo, fhi, hi))


WALK_SHAPES = [(128, 128), (1000, 1000), (200, 300), (384, 130), (64, 1000), (1, 77), (200, 328),
               (328, 200)]
WALK_TILES = [mg.BlockSizes(64, 128, 2), mg.BlockSizes(64, 64, 2), mg.BlockSizes(128, 64, 2)]


@pytest.mark.parametrize("mask", list(WALK_MASKS))
def test_tile_walk_skips_only_masked_tiles(mask):
  causal, window = WALK_MASKS[mask]["causal"], WALK_MASKS[mask].get("window")
  for sq, sk in WALK_SHAPES:
    for bs in WALK_TILES:
      st = mg._static_config((1, sq, 1, 128), (1, sk, 1, 128), jnp.bfloat16, causal=causal,
                             scale=None, block_sizes=bs, local_window_size=window)
      _check_walk(st)


@pytest.mark.parametrize("mask", ci_cases(["dense", "causal", "causal_window_64", "window_100_30"],
                                          ["causal_window_64"]))
def test_tile_walk_with_segments(mask):
  """Segment ids: the per-(batch, program) ranges of ``fk.seg_bounds`` (packed documents with
  padding when q_len == kv_len, random sorted ids otherwise)."""
  causal, window = WALK_MASKS[mask]["causal"], WALK_MASKS[mask].get("window")
  for sq, sk in [(1000, 1000), (512, 512), (200, 328), (328, 200), (200, 200)]:
    for bs in WALK_TILES:
      st = mg._static_config((2, sq, 1, 128), (2, sk, 1, 128), jnp.bfloat16, causal=causal,
                             scale=None, block_sizes=bs, local_window_size=window, has_seg=True)
      q_seg, kv_seg = _walk_segments(f"{mask}{sq}{sk}", 2, sq, sk)
      _check_walk(st, q_seg, kv_seg, tight=False)


def test_tile_walk_packed_documents_skip_other_documents():
  """Four aligned documents (the issue-8 layout, scaled down): each warpgroup walks only its own
  document's tiles (causal), so the work is that of four separate causal rows."""
  sq, docs = 2048, 4
  seg = np.repeat(np.arange(1, docs + 1, dtype=np.int32), sq // docs)[None]
  st = mg._static_config((1, sq, 1, 128), (1, sq, 1, 128), jnp.bfloat16, causal=True,
                         scale=None, block_sizes=mg.BlockSizes(64, 128, 2), has_seg=True)
  _check_walk(st, seg, seg, tight=True)
  prog, wgs = _walk_ranges(st, seg, seg)
  walked = int((wgs[..., 3] - wgs[..., 0]).sum())
  one_doc = mg._static_config((1, sq // docs, 1, 128), (1, sq // docs, 1, 128), jnp.bfloat16,
                              causal=True, scale=None, block_sizes=mg.BlockSizes(64, 128, 2))
  _, wgs1 = _walk_ranges(one_doc)
  assert walked == docs * int((wgs1[..., 3] - wgs1[..., 0]).sum())
  masked = int((wgs[..., 1] - wgs[..., 0] + wgs[..., 3] - wgs[..., 2]).sum())
  assert masked == docs * int((wgs1[..., 1] - wgs1[..., 0] + wgs1[..., 3] - wgs1[..., 2]).sum())


def test_one_segment_flag_is_exact():
  """``fk.seg_bounds``' one-segment flag (masked tiles then take the static mask only): set for
  every warpgroup of aligned packed documents (each walks tiles of its own document only), and
  in general exactly when every tile of the warpgroup's [lo, hi) holds one and the same nonzero
  id on both sides (checked against the ids themselves on random layouts with padding)."""
  sq, docs = 2048, 4
  seg = np.repeat(np.arange(1, docs + 1, dtype=np.int32), sq // docs)[None]
  bs = mg.BlockSizes(64, 128, 2, one_segment_static_mask=True)
  st = mg._static_config((1, sq, 1, 128), (1, sq, 1, 128), jnp.bfloat16, causal=True,
                         scale=None, block_sizes=dataclasses.replace(
                             bs, one_segment_static_mask=False), has_seg=True)
  assert _SEG_BOUNDS_JIT(jnp.asarray(seg), jnp.asarray(seg), st).shape[-1] == 10  # option off
  st = dataclasses.replace(st, one_seg_mask=True)
  bounds = np.asarray(_SEG_BOUNDS_JIT(jnp.asarray(seg), jnp.asarray(seg), st))
  assert bounds.shape[-1] == fk._SEG_BOUNDS_ONE + 2
  assert (bounds[..., fk._SEG_BOUNDS_ONE:] == 1).all()
  rng = np.random.default_rng(7)
  n_set = n_clear = 0
  for sq, sk, causal in [(1000, 1000, True), (328, 200, False), (200, 328, True)]:
    st = mg._static_config((2, sq, 1, 128), (2, sk, 1, 128), jnp.bfloat16, causal=causal,
                           scale=None, block_sizes=mg.BlockSizes(
                               64, 64, 2, one_segment_static_mask=True), has_seg=True)
    bq, bk = st.block_q, st.block_k
    sq_p, sk_p = st.num_q_programs * 2 * bq, st.num_kv_tiles * bk
    for _ in range(3):
      q_seg = np.sort(rng.integers(0, 3, size=(2, sq)), axis=1).astype(np.int32)
      kv_seg = (q_seg if sq == sk else
                np.sort(rng.integers(0, 3, size=(2, sk)), axis=1).astype(np.int32))
      qp = np.pad(q_seg, ((0, 0), (0, sq_p - sq)))
      kp = np.pad(kv_seg, ((0, 0), (0, sk_p - sk)))
      bounds = np.asarray(_SEG_BOUNDS_JIT(jnp.asarray(qp), jnp.asarray(kp), st))
      for bi in range(2):
        for p in range(st.num_q_programs):
          for wg in range(2):
            lo, hi = bounds[bi, p, 2 + 4 * wg], bounds[bi, p, 5 + 4 * wg]
            rows = qp[bi, (2 * p + wg) * bq:(2 * p + wg + 1) * bq]
            keys = kp[bi, lo * bk:hi * bk]
            want = hi <= lo or bool(rows.min() != 0 and (rows == rows[0]).all()
                                    and (keys == rows[0]).all())     # no tile: nothing to mask
            got = bool(bounds[bi, p, fk._SEG_BOUNDS_ONE + wg])
            assert got == want, (sq, sk, bi, p, wg, lo, hi)
            n_set += got
            n_clear += not got
  assert n_set and n_clear


def _layout_segments(kind, rng, b, n):
  """int32 [b, n] segment ids: "right_pad" / "left_pad" packed documents (non-decreasing ids,
  lengths that line up with no tile) with padding (0) at the end / start, "negative" the
  right-padded rows negated, "arbitrary" random ids in -3..3 (0 in the middle, not monotone)
  with int32-extreme ids mixed in, "zeros" all padding."""
  if kind == "zeros":
    return np.zeros((b, n), np.int32)
  if kind == "arbitrary":
    ids = rng.integers(-3, 4, size=(b, n))
    extreme = rng.random((b, n)) < 0.05
    return np.where(extreme, rng.choice([np.iinfo(np.int32).min, np.iinfo(np.int32).max],
                                        size=(b, n)), ids).astype(np.int32)
  out = np.zeros((b, n), np.int32)
  for r in range(b):
    pad = int(rng.integers(1, n // 3))
    cuts = np.sort(rng.choice(np.arange(1, n - pad), size=3, replace=False))
    docs = np.searchsorted(cuts, np.arange(n - pad), side="right") + 1
    out[r] = np.concatenate([docs, np.zeros(pad)] if kind != "left_pad" else
                            [np.zeros(pad), docs])
  return -out if kind == "negative" else out


SEGMENT_LAYOUTS = ["right_pad", "left_pad", "negative", "arbitrary", "zeros"]


@pytest.mark.parametrize("kind", SEGMENT_LAYOUTS)
@pytest.mark.parametrize("mask", ["dense", "causal", "causal_window_64"])
def test_tile_walk_segment_layouts(kind, mask):
  """``fk.seg_bounds`` for any segment-id layout: no tile with a visible element is skipped and no
  unmasked tile masks an element (``_check_walk``); for packed rows (padding at either end) each
  warpgroup's range is tight: its first and last tiles hold a visible key (a last q tile of
  document and padding walked every earlier kv tile when its id range included 0)."""
  causal, window = WALK_MASKS[mask]["causal"], WALK_MASKS[mask].get("window")
  rng = np.random.default_rng(zlib.crc32(f"{kind}{mask}".encode()))
  for n in (1000, 328):
    for bs in WALK_TILES:
      st = mg._static_config((2, n, 1, 128), (2, n, 1, 128), jnp.bfloat16, causal=causal,
                             scale=None, block_sizes=bs, local_window_size=window, has_seg=True)
      seg = _layout_segments(kind, rng, 2, n)
      _check_walk(st, seg, seg, tight=kind in ("right_pad", "left_pad", "negative"))


@pytest.mark.parametrize("kind", SEGMENT_LAYOUTS)
def test_walk_codes_segment_layouts(kind):
  """``_walk_codes`` (the block-schedule walk's per-warpgroup classes) for every kv tile of every
  warpgroup, against the element mask: a tile with a visible element is never _SKIP, a _FULL
  tile has every element of the warpgroup's real rows visible; packed rows skip exactly the
  tiles without a visible element."""
  from pallas_kernels.masks import element_mask
  rng = np.random.default_rng(zlib.crc32(kind.encode()))
  sq = sk = 1000
  for causal in (False, True):
    st = mg._static_config((2, sq, 1, 128), (2, sk, 1, 128), jnp.bfloat16, causal=causal,
                           scale=None, block_sizes=mg.BlockSizes(64, 64, 2), has_seg=True)
    bq, bk, nk = st.block_q, st.block_k, st.num_kv_tiles
    sq_pad, sk_pad = st.num_q_programs * 2 * bq, nk * bk
    seg = _layout_segments(kind, rng, 2, sq)
    qs, ks = np.pad(seg, ((0, 0), (0, sq_pad - sq))), np.pad(seg, ((0, 0), (0, sk_pad - sk)))
    n_wg = sq_pad // bq
    tiles = jnp.broadcast_to(jnp.arange(nk, dtype=jnp.int32), (1, 1, n_wg, nk))
    codes = np.asarray(fk._walk_codes(tiles, jnp.ones(tiles.shape, bool), st, jnp.asarray(qs),
                                      jnp.asarray(ks)))[:, 0]                  # [B, n_wg, nk]
    vis = np.asarray(element_mask(np.arange(sq_pad), np.arange(sk_pad), causal=causal,
                                  window=None, kv_len=sk, q_seg=qs, kv_seg=ks))
    vis = vis & (np.arange(sq_pad) < sq)[None, :, None]                        # [B, Sq', Sk']
    t = vis.reshape(2, n_wg, bq, nk, bk)
    real = (np.arange(sq_pad) < sq).reshape(n_wg, bq)[None, :, :, None, None]
    any_vis, all_vis = t.any(axis=(2, 4)), (t | ~real).all(axis=(2, 4))
    assert not (any_vis & (codes == wk.SKIP)).any(), (kind, causal)
    assert all_vis[codes == wk.FULL].all(), (kind, causal)
    if kind in ("right_pad", "left_pad", "negative"):
      np.testing.assert_array_equal(codes != wk.SKIP, any_vis)


def test_tile_walk_check_can_fail():
  """The walk check catches a range that skips a visible tile (a window's left edge one tile
  too far right)."""
  st = mg._static_config((1, 1000, 1, 128), (1, 1000, 1, 128), jnp.bfloat16, causal=True,
                         scale=None, block_sizes=mg.BlockSizes(64, 128, 2),
                         local_window_size=(200, 0))
  real = fk._static_ranges

  def shifted(row0, n, st):
    lo, flo, fhi, hi = real(row0, n, st)
    lo = jnp.minimum(lo + 1, hi)
    return lo, jnp.maximum(flo, lo), jnp.maximum(fhi, lo), hi
  fk._static_ranges = shifted
  try:
    with pytest.raises(AssertionError):
      _check_walk(st)
  finally:
    fk._static_ranges = real


@pytest.mark.parametrize("drop", ["right_on_left_edges", "padded_keys"])
def test_edge_mask_check_can_fail(drop, monkeypatch):
  """The walk check catches edge masks that drop a bound they need: the right bound on a left
  edge of a window narrower than a tile (0, 0), or the padded-key compare of a last tile that
  no other bound masks (a left-only window, 1000 keys in 128-key tiles)."""
  window = (0, 0) if drop == "right_on_left_edges" else (70, None)
  st = mg._static_config((1, 1000, 1, 128), (1, 1000, 1, 128), jnp.bfloat16, causal=False,
                         scale=None, block_sizes=mg.BlockSizes(64, 128, 2),
                         local_window_size=window)
  real = fk._edge_bounds

  def dropped(st, edge):
    pad, r_on, l_on = real(st, edge)
    return (pad and drop != "padded_keys",
            r_on and not (edge == "left" and drop == "right_on_left_edges"), l_on)
  _check_walk(st)   # the real edges pass
  monkeypatch.setattr(fk, "_edge_bounds", dropped)
  with pytest.raises(AssertionError):
    _check_walk(st)


def _replay(q, k, v, q_seg=None, kv_seg=None, *, causal, block_sizes=None, **kw):
  """Compile ``_replay_fn`` with cheap XLA:CPU codegen (it is unrolled and runs once)."""
  fn = jax.jit(functools.partial(_replay_fn, causal=causal, block_sizes=block_sizes, **kw))
  return fn.lower(q, k, v, q_seg, kv_seg).compile(_FAST_CPU_COMPILE)(q, k, v, q_seg, kv_seg)


def _replay_step(t, carry, *, masked, st, q_t, k_all, v_all, row0, qs_t, ks_all, p_dtype,
                 one_seg=None, edge=None):
  """One kv tile t of a warpgroup (query rows row0 .. row0 + bq) in the kernel's walk, in jnp
  with the kernel's helpers: logits (``_cap_logits``), with ``masked`` ``_tile_visible``
  (segment ids qs_t [bq] / ks_all [Sk'] unless qs_t is None; where the traced bool ``one_seg``
  (``fk.seg_bounds``' one-segment flag) is true, the static mask only, as the kernel's
  ``masked="static"`` with ``BlockSizes.one_segment_static_mask``: the flag is exact, so the
  answer is the same either way, and the replay checks that), ``_online_softmax``, P cast to
  p_dtype. carry = (acc [bq, D], m, l); also
  used by tests/test_sparse_mosaic_gpu.py."""
  acc, m, l = carry
  bq, bk = st.block_q, st.block_k
  k_t = lax.dynamic_slice_in_dim(k_all, t * bk, bk)            # [bk, D]
  v_t = lax.dynamic_slice_in_dim(v_all, t * bk, bk)
  s = fk._cap_logits(jnp.dot(q_t, k_t.T, preferred_element_type=jnp.float32), st)  # [bq, bk]
  if masked:
    rows = lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    cols = lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    ks_t = None if qs_t is None else lax.dynamic_slice_in_dim(ks_all, t * bk, bk)
    vis = fk._tile_visible(rows, cols, row0, t, st, qs_t, ks_t, edge=edge)
    if one_seg is not None:
      static = fk._tile_visible(rows, cols, row0, t, st, edge=edge)
      vis = jnp.where(one_seg, True if static is None else static, vis)
    s = fk._apply_mask(s, vis)
  p, alpha, m, l = fk._online_softmax(s, m, l, st)
  acc = acc * alpha[:, None] + jnp.dot(p.astype(p_dtype), v_t,
                                       preferred_element_type=jnp.float32)
  return acc, m, l


def _replay_fn(q, k, v, q_seg=None, kv_seg=None, *, causal, block_sizes=None, scale=None,
               local_window_size=None, logits_soft_cap=None):
  """The kernel's forward walk in jnp, with its own helpers (see the module docstring): per
  warpgroup the ranges of ``_program_ranges`` (static or ``fk.seg_bounds``), masked edges
  [lo, flo) and [fhi, hi), unmasked [flo, fhi)."""
  b, sq, hq, d = q.shape
  sk = k.shape[1]
  has_seg = q_seg is not None
  st = mg._static_config(q.shape, k.shape, q.dtype, causal=causal, scale=scale,
                         block_sizes=block_sizes, local_window_size=local_window_size,
                         logits_soft_cap=logits_soft_cap, has_seg=has_seg)
  bq, bk = st.block_q, st.block_k
  sq_pad, sk_pad = st.num_q_programs * 2 * bq, st.num_kv_tiles * bk
  qp = jnp.pad(q, ((0, 0), (0, sq_pad - sq), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
  heads = jnp.arange(hq) // st.group                           # kv head of each query head
  kp = jnp.pad(k, ((0, 0), (0, sk_pad - sk), (0, 0), (0, 0)))[:, :, heads].transpose(0, 2, 1, 3)
  vp = jnp.pad(v, ((0, 0), (0, sk_pad - sk), (0, 0), (0, 0)))[:, :, heads].transpose(0, 2, 1, 3)
  n_rows = sq_pad // bq
  if has_seg:
    qs_p = jnp.pad(q_seg.astype(jnp.int32), ((0, 0), (0, sq_pad - sq)))
    ks_p = jnp.pad(kv_seg.astype(jnp.int32), ((0, 0), (0, sk_pad - sk)))
    bounds = fk.seg_bounds(qs_p, ks_p, st)
    ranges = bounds[..., 2:fk._SEG_BOUNDS_ONE].reshape(b, n_rows, 4)
    ones = (bounds[..., fk._SEG_BOUNDS_ONE:].reshape(b, n_rows) if st.one_seg_mask
            else jnp.zeros((b, n_rows), jnp.int32))
  else:
    qs_p = jnp.zeros((b, sq_pad), jnp.int32)
    ks_p = jnp.zeros((b, sk_pad), jnp.int32)
    per = []
    for tile in range(st.num_q_programs):
      row0 = tile * 2 * bq
      plo, _, _, phi = fk._static_ranges(row0, 2 * bq, st)
      for wg in range(2):
        per.append(jnp.stack(fk._clip_to_program(
            plo, phi, *fk._static_ranges(row0 + wg * bq, bq, st))))
    ranges = jnp.broadcast_to(jnp.stack(per), (b, n_rows, 4))
    ones = jnp.zeros((b, n_rows), jnp.int32)

  def warpgroup(q_t, k_all, v_all, row0, rng, one, qs_t, ks_all):   # [bq, D], [Sk', D] x 2
    step = functools.partial(_replay_step, st=st, q_t=q_t, k_all=k_all, v_all=v_all, row0=row0,
                             qs_t=qs_t if has_seg else None, ks_all=ks_all, p_dtype=q.dtype,
                             one_seg=(one != 0) if has_seg else None)
    carry = (jnp.zeros((bq, d), jnp.float32), jnp.full((bq,), fk._M_INIT, jnp.float32),
             jnp.zeros((bq,), jnp.float32))
    lo, flo, fhi, hi = rng[0], rng[1], rng[2], rng[3]
    carry = lax.fori_loop(lo, flo, functools.partial(step, masked=True, edge="left"), carry)
    carry = lax.fori_loop(flo, fhi, functools.partial(step, masked=False), carry)
    acc, m, l = lax.fori_loop(fhi, hi, functools.partial(step, masked=True, edge="right"),
                              carry)
    return fk._finalize(acc, m, l)

  q_tiles = qp.reshape(b, hq, n_rows, bq, d)                   # [B, Hq, tiles, bq, D]
  row0s = jnp.broadcast_to(jnp.arange(n_rows, dtype=jnp.int32) * bq, (b, hq, n_rows))
  rng = jnp.broadcast_to(ranges[:, None], (b, hq, n_rows, 4))
  one = jnp.broadcast_to(ones[:, None], (b, hq, n_rows))
  qs_tiles = jnp.broadcast_to(qs_p.reshape(b, 1, n_rows, bq), (b, hq, n_rows, bq))
  ks_all = jnp.broadcast_to(ks_p[:, None], (b, hq, sk_pad))
  per_tile = jax.vmap(warpgroup, in_axes=(0, None, None, 0, 0, 0, 0, None))
  out, lse = jax.vmap(jax.vmap(per_tile))(q_tiles, kp, vp, row0s, rng, one, qs_tiles, ks_all)
  out = out.reshape(b, hq, sq_pad, d).transpose(0, 2, 1, 3)[:, :sq].astype(q.dtype)
  return out, lse.reshape(b, hq, sq_pad)[:, :, :sq]


REPLAY_CASES = {
    "dense_ragged_gqa": dict(b=1, sq=200, sk=300, hq=4, hk=2, d=64, causal=False),
    "causal_square": dict(b=2, sq=256, sk=256, hq=2, hk=1, d=64, causal=True),
    "causal_q_shorter": dict(b=1, sq=100, sk=333, hq=2, hk=2, d=64, causal=True),
    "causal_q_longer_empty_rows": dict(b=1, sq=300, sk=130, hq=2, hk=1, d=64, causal=True),
    "fp16_tiles_64": dict(b=1, sq=160, sk=200, hq=2, hk=2, d=64, causal=True,
                          dtype=jnp.float16, bs=mg.BlockSizes(64, 64, 2)),
    # 192-key tiles: tile edges that are not powers of two, a padded last tile
    "tiles_192_dense": dict(b=1, sq=300, sk=500, hq=2, hk=1, d=64, causal=False,
                            bs=mg.BlockSizes(64, 192, 2)),
    "tiles_192_causal_q_shorter": dict(b=1, sq=200, sk=500, hq=2, hk=2, d=64, causal=True,
                                       bs=mg.BlockSizes(64, 192, 2)),
    # local windows (jax.nn convention (left, right), bottom-right aligned)
    "causal_window_64": dict(b=1, sq=200, sk=328, hq=4, hk=2, d=64, causal=True,
                             local_window_size=(64, 0)),
    "window_100_30": dict(b=1, sq=200, sk=328, hq=4, hk=2, d=64, causal=False,
                          local_window_size=(100, 30)),
    "window_100_30_q_longer": dict(b=1, sq=328, sk=200, hq=4, hk=2, d=64, causal=False,
                                   local_window_size=(100, 30)),
    "causal_window_64_tiles_64": dict(b=1, sq=328, sk=328, hq=2, hk=1, d=64, causal=True,
                                      local_window_size=(64, 0), bs=mg.BlockSizes(64, 64, 2)),
    "window_0_0_empty_rows": dict(b=1, sq=300, sk=130, hq=2, hk=1, d=64, causal=False,
                                  local_window_size=(0, 0)),
    # soft cap (on the scaled logit)
    "soft_cap_causal": dict(b=1, sq=200, sk=328, hq=4, hk=2, d=64, causal=True,
                            logits_soft_cap=2.0, scale=0.5),
    "soft_cap_window": dict(b=1, sq=200, sk=328, hq=4, hk=2, d=64, causal=False,
                            logits_soft_cap=5.0, local_window_size=(100, 30)),
    # segment ids (0 = padding)
    "segments_dense": dict(b=2, sq=200, sk=200, hq=4, hk=2, d=64, causal=False, seg="packed"),
    "segments_causal": dict(b=2, sq=200, sk=200, hq=4, hk=2, d=64, causal=True, seg="packed"),
    "segments_aligned_docs_static_mask": dict(
        b=2, sq=512, sk=512, hq=2, hk=1, d=64, causal=True, seg="aligned4",
        bs=mg.BlockSizes(64, 128, 2, one_segment_static_mask=True)),
    "segments_packed_static_mask": dict(
        b=2, sq=200, sk=200, hq=4, hk=2, d=64, causal=True, seg="packed",
        bs=mg.BlockSizes(64, 64, 2, one_segment_static_mask=True)),
    "segments_causal_q_shorter": dict(b=2, sq=200, sk=328, hq=4, hk=2, d=64, causal=True,
                                      seg="random"),
    "segments_window_soft_cap": dict(b=2, sq=328, sk=200, hq=4, hk=2, d=64, causal=False,
                                     seg="random", local_window_size=(100, 30),
                                     logits_soft_cap=3.0),
}


def _segments(name, b, sq, sk, kind):
  """"packed": documents of random lengths with padding (0) at the end, the same ids for q and
  kv (needs sq == sk); "random": sorted random ids in 0..3 (0 = padding) for q and kv
  independently (documents that do not line up, q_len != kv_len); "aligned4": four documents
  of sq / 4 tokens (aligned packed rows, scaled down: every warpgroup walks one document, so
  its masked tiles take the static mask only, ``fk.seg_bounds``' one-segment flag)."""
  if kind == "aligned4":
    assert sq == sk and sq % 4 == 0
    ids = np.repeat(np.arange(1, 5, dtype=np.int32), sq // 4)
    q_seg = kv_seg = np.broadcast_to(ids, (b, sq)).copy()
  elif kind == "packed":
    assert sq == sk
    q_seg, kv_seg = _walk_segments(name, b, sq, sk)
  else:
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    q_seg = np.sort(rng.integers(0, 4, size=(b, sq)), axis=1).astype(np.int32)
    kv_seg = np.sort(rng.integers(0, 4, size=(b, sk)), axis=1).astype(np.int32)
  return jnp.asarray(q_seg), jnp.asarray(kv_seg)


def _mask_args(case, name):
  """Pops the mask options of a case: (causal, q_seg, kv_seg, dict of reference keywords)."""
  causal = case.pop("causal")
  kind = case.pop("seg", None)
  mask = {key: case.pop(key) for key in ("local_window_size", "logits_soft_cap", "scale")
          if key in case}
  q_seg = kv_seg = None
  if kind is not None:
    q_seg, kv_seg = _segments(name, case["b"], case["sq"], case["sk"], kind)
  return causal, q_seg, kv_seg, mask


@pytest.mark.parametrize("name", ci_cases(REPLAY_CASES, [
    "causal_q_longer_empty_rows", "fp16_tiles_64", "tiles_192_causal_q_shorter",
    "window_100_30_q_longer", "window_0_0_empty_rows", "soft_cap_window",
    "segments_causal_q_shorter", "segments_aligned_docs_static_mask"]))
def test_replayed_walk_matches_reference(name):
  case = dict(REPLAY_CASES[name])
  dtype = case.pop("dtype", jnp.bfloat16)
  bs = case.pop("bs", None)
  causal, q_seg, kv_seg, mask = _mask_args(case, name)
  q, k, v = _inputs(zlib.crc32(name.encode()), dtype=dtype, **case)
  out, lse = _replay(q, k, v, q_seg, kv_seg, causal=causal, block_sizes=bs, **mask)
  _check(out, lse, q, k, v, causal, dtype, q_seg, kv_seg, **mask)


# -------------------------------------------------------------------------- errors (CPU)


def test_unsupported_options_raise():
  """(Block schedules are walked: tests/test_sparse_mosaic_gpu.py; tiles the kernel cannot walk
  raise ValueError there.)"""
  q = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
  with pytest.raises(NotImplementedError):
    mg.flash_attention(q, q, q, interpret=True)
  with pytest.raises(NotImplementedError, match="float32"):
    mg.flash_attention(q.astype(jnp.float32), q.astype(jnp.float32), q.astype(jnp.float32))
  q96 = jnp.ones((1, 128, 2, 96), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="head_dim"):
    mg.flash_attention(q96, q96, q96)
  seg = jnp.ones((1, 128), jnp.int32)
  with pytest.raises(ValueError, match="together"):
    mg.flash_attention(q, q, q, seg, None)
  with pytest.raises(ValueError, match="soft_cap"):
    mg.flash_attention(q, q, q, logits_soft_cap=0.0)


def test_mosaic_backward_takes_block_schedules():
  """backward="mosaic" with a block schedule: the call configures the Mosaic GPU
  backward walking it; backward tiles wider than the schedule's raise ValueError at the call."""
  from pallas_kernels.block_schedule import make_schedule
  from pallas_kernels.flash import mosaic_gpu_bwd as mb
  q = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
  bs = mg.BlockSizes(64, 64, 2, backward="mosaic")
  sched = make_schedule(128, 128, 128, 64, causal=True)
  st = mg._static_config(q.shape, q.shape, q.dtype, causal=True, scale=None, block_sizes=bs,
                         schedule=sched)
  assert st.backward == "mosaic" and st.has_sched
  with pytest.raises(ValueError, match="block_k_dkv=128 does not divide"):
    mg.flash_attention(q, q, q, None, None, sched, causal=True, block_sizes=bs,
                       bwd_block_sizes=mb.BlockSizes(64, 128, 64, 64))


# ------------------------------------------- jattn registration, hybrid backward (CPU)


def _replayed_fwd_call(q_p, k_p, v_p, st, q_seg=None, kv_seg=None, bounds=None):
  """Stand-in for ``fk.fwd_call`` on the CPU: the jnp replay of the kernel's walk (its own mask,
  online softmax and ``_finalize``, so the same out and natural-log LSE, -inf for empty rows), on
  the same padded inputs and returning the same padded shapes. With segment ids the replay
  recomputes ``fk.seg_bounds`` from the padded ids (what the wrapper passed as ``bounds``)."""
  bs = mg.BlockSizes(st.block_q, st.block_k, st.num_stages, protocol=st.protocol)
  seg = () if q_seg is None else (q_seg[:, :st.q_len], kv_seg[:, :st.kv_len])
  out, lse = _replay_fn(q_p[:, :st.q_len], k_p[:, :st.kv_len], v_p[:, :st.kv_len], *seg,
                        causal=st.causal, block_sizes=bs, scale=st.scale,
                        local_window_size=st.window, logits_soft_cap=st.soft_cap)
  pad = q_p.shape[1] - st.q_len
  out = jnp.pad(out, ((0, 0), (0, pad), (0, 0), (0, 0)))
  lse = jnp.pad(lse, ((0, 0), (0, 0), (0, pad)), constant_values=-jnp.inf)
  if st.tail_batch >= 0:   # tail_kv_splits: the kernel's skipped program walks no key
    rows = 2 * st.block_q
    r0 = (st.num_q_programs - 1) * rows
    out = out.at[st.tail_batch, r0:r0 + rows].set(0)
    lse = lse.at[st.tail_batch, :, r0:r0 + rows].set(-jnp.inf)
  return out, lse


def _vjp_vs_reference(q, k, v, causal, *, interpret, scale=None, block_sizes=None, q_seg=None,
                      kv_seg=None, local_window_size=None, logits_soft_cap=None):
  """(kernel, reference) results: out, lse and the VJP of (out, lse) for random cotangents,
  through ``jattn.flash_attention(implementation="mosaic_gpu", return_lse=True)``; the reference
  runs in fp32 on the upcast inputs."""
  import jattn
  d_out, = normal(99, q.shape, dtype=q.dtype)
  d_lse, = normal(100, (q.shape[0], q.shape[2], q.shape[1]))
  mask = dict(local_window_size=local_window_size, logits_soft_cap=logits_soft_cap)

  def kernel_run(q, k, v):
    f = lambda q, k, v: jattn.flash_attention(q, k, v, causal=causal, scale=scale,
                                              segment_ids=q_seg, kv_segment_ids=kv_seg,
                                              return_lse=True, implementation="mosaic_gpu",
                                              interpret=interpret, block_sizes=block_sizes,
                                              **mask)
    (out, lse), vjp = jax.vjp(f, q, k, v)
    return out, lse, vjp((d_out, d_lse))

  def ref_run(q, k, v):
    up = lambda x: x.astype(jnp.float32)
    f = functools.partial(attention_reference, causal=causal, scale=scale, q_segment_ids=q_seg,
                          kv_segment_ids=kv_seg, **mask)
    (out, lse), vjp = jax.vjp(f, up(q), up(k), up(v))
    return out, lse, vjp((up(d_out), d_lse))

  run = lambda fn: (jax.jit(fn).lower(q, k, v).compile(_FAST_CPU_COMPILE) if interpret
                    else jax.jit(fn))(q, k, v)
  return run(kernel_run), run(ref_run)


def _assert_vjp_close(got, want, dtype):
  (out, lse, grads), (r_out, r_lse, r_grads) = got, want
  tol = TOL[dtype]
  assert out.dtype == dtype and lse.dtype == jnp.float32
  assert _rel(out, r_out) < tol, ("out", _rel(out, r_out))
  lse, r_lse = np.asarray(lse), np.asarray(r_lse)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(r_lse))
  fin = np.isfinite(r_lse)
  assert _rel(np.where(fin, lse, 0.0), np.where(fin, r_lse, 0.0)) < tol
  for name, g, r in zip(("dq", "dk", "dv"), grads, r_grads):
    assert g.shape == r.shape and g.dtype == dtype, (name, g.shape, g.dtype)
    assert np.isfinite(np.asarray(g, np.float32)).all(), name
    assert _rel(g, r) < tol, (name, _rel(g, r))
  if (~fin).any():   # rows that see no key: zero gradient for their queries
    dq = np.asarray(grads[0], np.float32).transpose(0, 2, 1, 3)[~fin]
    assert (dq == 0).all()


VJP_CASES = {
    "dense_gqa_ragged": dict(sq=200, sk=328, causal=False),
    "causal_gqa_ragged": dict(sq=200, sk=328, causal=True),
    "causal_q_longer_empty_rows": dict(sq=328, sk=200, causal=True, scale=0.1),
}
# Masks: the Triton backward and, except segment ids, the Mosaic GPU
# backward.
VJP_MASK_CASES = {
    "causal_window_64": dict(sq=200, sk=328, causal=True, local_window_size=(64, 0)),
    "window_100_30": dict(sq=200, sk=328, causal=False, local_window_size=(100, 30)),
    "window_100_30_q_longer": dict(sq=328, sk=200, causal=False, local_window_size=(100, 30)),
    "soft_cap_causal": dict(sq=200, sk=328, causal=True, logits_soft_cap=2.0, scale=0.5),
    "segments_causal_packed": dict(sq=200, sk=200, causal=True, seg="packed"),
    "segments_q_shorter": dict(sq=200, sk=328, causal=False, seg="random"),
    "segments_window_soft_cap": dict(sq=328, sk=200, causal=True, seg="random",
                                     local_window_size=(100, 30), logits_soft_cap=3.0),
}


@pytest.mark.parametrize("name", ci_cases([*VJP_CASES, *VJP_MASK_CASES], [
    "causal_q_longer_empty_rows", "window_100_30_q_longer", "segments_window_soft_cap"]))
def test_registered_vjp_uses_triton_backward(name, monkeypatch):
  """jattn.flash_attention(implementation="mosaic_gpu", backward="triton" block sizes): the
  custom_vjp feeds the forward's out and LSE to the Triton backward (interpret mode). The Mosaic
  forward cannot run on the CPU, so ``fk.fwd_call`` is replaced by the jnp replay of its walk
  (same LSE convention)."""
  monkeypatch.setattr(fk, "fwd_call", _replayed_fwd_call)
  case = dict(VJP_CASES.get(name) or VJP_MASK_CASES[name])
  case.update(b=1)
  causal, q_seg, kv_seg, mask = _mask_args(case, name)
  q, k, v = _inputs(zlib.crc32(name.encode()), hq=4, hk=2, d=64, dtype=jnp.bfloat16, **case)
  # backward="triton" explicitly: unmasked D64/D128 calls default to the Mosaic GPU backward.
  bs = dataclasses.replace(mg.default_block_sizes(64), backward="triton")
  got, want = _vjp_vs_reference(q, k, v, causal, interpret=True, q_seg=q_seg, kv_seg=kv_seg,
                                block_sizes=bs, **mask)
  _assert_vjp_close(got, want, jnp.bfloat16)


@pytest.mark.parametrize("splits,sq,b", ci_cases([(4, 1000, 2), (2, 256, 1), (8, 300, 3)],
                                                [(2, 256, 1)]))
def test_tail_kv_splits_through_the_replay(splits, sq, b, monkeypatch):
  """``BlockSizes.tail_kv_splits``: the kernel (its jnp replay, which also leaves the skipped
  program's rows at 0 / -inf as the kernel does) skips the last query program of the last
  batch row; the second launch over the key chunks and the log-sum-exp merge fill them in.
  Out, LSE and the VJP (Triton backward, interpret) against the fp32 reference, GQA 4:2, a
  ragged last query tile (1000, 300) and a single program (256)."""
  calls = []
  real = _replayed_fwd_call
  monkeypatch.setattr(fk, "fwd_call", lambda *a, **kw: calls.append(a[3]) or real(*a, **kw))
  q, k, v = _inputs(zlib.crc32(f"tail{splits}".encode()), b=b, sq=sq, sk=1024, hq=4, hk=2,
                    d=64, dtype=jnp.bfloat16)
  bs = mg.BlockSizes(64, 128, 2, backward="triton", tail_kv_splits=splits)
  got, want = _vjp_vs_reference(q, k, v, False, interpret=True, block_sizes=bs)
  _assert_vjp_close(got, want, jnp.bfloat16)
  main, tail = calls[0], calls[1]
  assert (main.tail_batch, main.tail_kv_splits) == (b - 1, splits)
  assert (tail.tail_batch, tail.num_q_programs, tail.kv_len) == (-1, 1, 1024 // splits)


def test_fit_tail_kv_splits_keeps_it_only_where_it_pays(monkeypatch):
  """The table's tail_kv_splits (H200 dense D128/D256) reaches a call only for dense masks, keys
  a multiple of C * block_k, and a last wave partial by 1..Hq programs; jattn's default block
  sizes go through it (here with the H200 table and 132 SMs), block-sparse never takes it."""
  bs = mg.BlockSizes(64, 128, 2, tail_kv_splits=8)
  fit = lambda q, k=None, **kw: mg.fit_tail_kv_splits(bs, q, k or q, core_count=132,
                                                      **kw).tail_kv_splits
  assert fit((2, 16384, 16, 128)) == 8                       # 4096 = 31 * 132 + 4 (4 <= 16)
  assert fit((1, 16384, 33, 128)) == 0                       # 32 full waves
  assert fit((1, 16384, 31, 128)) == 8                       # 3968 = 30 * 132 + 8 (<= 31)
  assert fit((1, 16384, 16, 128)) == 0                       # 2048 = 15 * 132 + 68 (> 16)
  assert fit((2, 16384, 16, 128), (2, 16000, 16, 128)) == 0  # keys not a multiple of 1024
  for kw in (dict(causal=True), dict(window=(511, 0)), dict(segments=True),
             dict(schedule=True)):
    assert fit((2, 16384, 16, 128), **kw) == 0, kw
  assert mg.fit_tail_kv_splits(bs, (2, 16384, 16, 128), (2, 16384, 16, 128)).tail_kv_splits \
      == (8 if compat.gpu_core_count() == 132 else 0)      # no GPU here: 1 "SM", never
  # jattn: the H200 table's dense entry on 132 SMs
  import jattn
  monkeypatch.setattr(compat, "gpu_core_count", lambda: 132)
  q = jax.ShapeDtypeStruct((2, 16384, 16, 128), jnp.bfloat16)
  plan = lambda k=q, **kw: jattn.flash_attention_plan(q, k, k, device_kind="NVIDIA H200", **kw)
  got = lambda **kw: plan(**kw).config.tail_kv_splits
  assert got(causal=False) == 8
  assert got(causal=False, segment_ids=jnp.ones((2, 16384), jnp.int32)) == 0
  assert got(causal=True) == 0
  assert got(causal=False, k=jax.ShapeDtypeStruct((2, 4096 + 128, 16, 128), jnp.bfloat16)) == 0
  # the causal-window entry's two query tiles per program: not with segment ids (range path)
  seg = jnp.ones((2, 16384), jnp.int32)
  tiles = lambda **kw: plan(causal=True, local_window_size=(511, 0), **kw).config \
      .q_tiles_per_program
  assert tiles() == 2 and tiles(segment_ids=seg) == 1
  bs2 = _bs(128, 2, "overlap", q_tiles_per_program=2)
  for kw, want in ((dict(), 2), (dict(segments=True), 1), (dict(schedule=True), 1)):
    assert mg.fit_block_sizes(bs2, q.shape, q.shape, causal=True, **kw).q_tiles_per_program \
        == want, kw


def test_tail_kv_splits_checks():
  """tail_kv_splits: an int >= 0, q_tiles_per_program 1, dense masks and keys a multiple of
  tail_kv_splits * block_k; each other call raises, naming why."""
  with pytest.raises(ValueError, match="tail_kv_splits must be an int"):
    mg.BlockSizes(64, 128, 2, tail_kv_splits=-1)
  with pytest.raises(ValueError, match="q_tiles_per_program=1"):
    _bs(128, 2, "overlap", tail_kv_splits=2, q_tiles_per_program=2)
  bs = mg.BlockSizes(64, 128, 2, tail_kv_splits=4)
  cfg = lambda k_shape, **kw: mg._static_config((1, 1024, 2, 128), k_shape, jnp.bfloat16,
                                                scale=None, block_sizes=bs, **kw)
  assert cfg((1, 1024, 2, 128), causal=False).tail_kv_splits == 4
  assert mg._static_config((1, 1024, 2, 128), (1, 1024, 2, 128), jnp.bfloat16, causal=False,
                           scale=None, block_sizes=mg.BlockSizes(64, 128, 2)).tail_batch == -1
  for kw, why in [(dict(causal=True), "causal"),
                  (dict(causal=False, local_window_size=(64, 64)), "local window"),
                  (dict(causal=False, has_seg=True), "segment ids")]:
    with pytest.raises(ValueError, match=why):
      cfg((1, 1024, 2, 128), **kw)
  with pytest.raises(ValueError, match="not a multiple"):
    cfg((1, 1000, 2, 128), causal=False)


@pytest.mark.parametrize("name", ci_cases([*VJP_CASES, *VJP_MASK_CASES], [
    "soft_cap_causal", "segments_q_shorter"]))
def test_registered_vjp_with_mosaic_backward(name, monkeypatch):
  """``BlockSizes(backward="mosaic")``: the custom_vjp hands the same residuals to the Mosaic GPU
  backward (``mosaic_gpu_bwd``). Neither Mosaic kernel runs on the CPU: the forward and both
  backward kernels are replaced by their jnp replays (tests/test_flash_mosaic_gpu_bwd.py)."""
  import test_flash_mosaic_gpu_bwd as tb
  from pallas_kernels.flash import mosaic_gpu_bwd as mb
  monkeypatch.setattr(fk, "fwd_call", _replayed_fwd_call)
  monkeypatch.setattr(mb, "_dkv_call", tb._replay_dkv_call)
  monkeypatch.setattr(mb, "_dq_call", tb._replay_dq_call)
  called = []
  real_bwd = mb.flash_attention_bwd
  monkeypatch.setattr(mb, "flash_attention_bwd", lambda *a, **kw: called.append(1) or
                      real_bwd(*a, **kw))
  case = dict(VJP_CASES.get(name) or VJP_MASK_CASES[name])
  case.update(b=1)
  causal, q_seg, kv_seg, mask = _mask_args(case, name)
  q, k, v = _inputs(zlib.crc32(name.encode()), hq=4, hk=2, d=64, dtype=jnp.bfloat16, **case)
  bs = mg.BlockSizes(backward="mosaic")
  got, want = _vjp_vs_reference(q, k, v, causal, interpret=True, block_sizes=bs, q_seg=q_seg,
                                kv_seg=kv_seg, **mask)
  assert called, "the Mosaic GPU backward was not used"
  _assert_vjp_close(got, want, jnp.bfloat16)


def test_mosaic_backward_option_is_checked_at_the_call():
  """backward="mosaic" with head_dim 256 raises when the forward is called (not at grad time);
  an unknown backward name is a ValueError."""
  import jattn
  q = jnp.zeros((1, 64, 2, 256), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="head_dim 256"):
    jattn.flash_attention(q, q, q, implementation="mosaic_gpu",
                          block_sizes=mg.BlockSizes(64, 64, 2, backward="mosaic"))
  with pytest.raises(ValueError, match="backward"):
    mg.BlockSizes(backward="cudnn")


def test_vjp_check_catches_a_base2_lse(monkeypatch):
  """The VJP test can fail: a forward whose LSE is in base 2 (the kernel's internal domain)
  instead of natural log gives wrong gradients through the Triton backward."""
  def base2_lse(q_p, k_p, v_p, st):
    out, lse = _replayed_fwd_call(q_p, k_p, v_p, st)
    return out, lse * fk.LOG2E
  monkeypatch.setattr(fk, "fwd_call", base2_lse)
  q, k, v = _inputs(5, b=1, sq=130, sk=130, hq=2, hk=1, d=64, dtype=jnp.bfloat16)
  bs = dataclasses.replace(mg.default_block_sizes(64), backward="triton")
  (_, _, grads), (_, _, r_grads) = _vjp_vs_reference(q, k, v, True, interpret=True,
                                                     block_sizes=bs)
  assert _rel(grads[0], r_grads[0]) > 0.1


def test_registered_path_rejects_unsupported_options():
  """Every option the Hopper path lacks raises NotImplementedError naming it (no fallback);
  windows, segment ids and soft cap are supported (``test_registered_vjp_uses_triton_backward``)."""
  import jattn
  q = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
  call = functools.partial(jattn.flash_attention, implementation="mosaic_gpu")
  for kwargs, name in ((dict(interpret=True), "interpret"),):
    with pytest.raises(NotImplementedError, match=name):
      call(q, q, q, **kwargs)
  q96 = jnp.ones((1, 128, 2, 96), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="head_dim 96"):
    call(q96, q96, q96)
  with pytest.raises(NotImplementedError, match="head_dim_v 128"):
    call(q, q, jnp.ones((1, 128, 2, 128), jnp.bfloat16))
  with pytest.raises(NotImplementedError, match="dtype"):
    call(*(q.astype(jnp.float32),) * 3)
  with pytest.raises(TypeError, match="dtypes differ"):
    call(q, q.astype(jnp.float16), q.astype(jnp.float16))
  with pytest.raises(TypeError, match="BlockSizes"):
    from pallas_kernels.flash import triton as ft
    call(q, q, q, block_sizes=ft.default_block_sizes(64, jnp.bfloat16))


@pytest.mark.parametrize("mask", ["dense", "causal", "causal_window_511", "soft_cap",
                                  "segments_causal"])
def test_registered_fwd_bwd_lowers_for_cuda(mask):
  """jax.grad through jattn.flash_attention(implementation="mosaic_gpu") lowers for "cuda": the
  Mosaic GPU forward and the two Mosaic GPU backward kernels (no Triton call) for every mask."""
  import jattn
  q = jax.ShapeDtypeStruct((2, 1000, 4, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 1000, 2, 128), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((2, 1000), jnp.int32)
  kwargs = {"dense": dict(), "causal": dict(causal=True),
            "causal_window_511": dict(causal=True, local_window_size=(511, 0)),
            "soft_cap": dict(logits_soft_cap=30.0), "segments_causal": dict(causal=True)}[mask]
  loss = lambda q, k, v, seg: jattn.flash_attention(
      q, k, v, implementation="mosaic_gpu", segment_ids=seg if "segments" in mask else None,
      **kwargs).astype(jnp.float32).sum()
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv, seg).lower(
      lowering_platforms=("cuda",)).as_text()
  n = text.count("__gpu$xla.gpu.triton") + text.count("triton_kernel_call_ffi")
  assert n == 0, n
  calls = re.findall(r"custom_call @(mosaic_gpu\w*)", text)
  assert len(calls) == 3, calls


# ----------------------------------------------------------------------------- GPU (sm90)

# Kernel-specific cases: every protocol at the tiles its table entries use, with the masks and
# lengths the kernel branches on (edge masks, empty rows, ragged tiles, segment walks, several
# query tiles per program). The generic mask / GQA / dtype matrix is tests/test_conformance.py.
GPU_CASES = {
    "d128_causal_gqa_pingpong": dict(b=2, sq=2048, sk=2048, hq=8, hk=2, d=128, causal=True,
                                     bs=_bs(128, 2)),
    "d128_window_left_only_ragged_pingpong": dict(
        b=1, sq=1000, sk=1000, hq=2, hk=2, d=128, causal=False, local_window_size=(70, None),
        bs=_bs(128, 2)),
    "d64_causal_ragged_pingpong_kwait": dict(b=1, sq=1000, sk=1000, hq=4, hk=2, d=64,
                                             causal=True, bs=_bs(128, 3, "pingpong_kwait")),
    "d64_bk256_segments_random_q_shorter_pingpong_kwait": dict(
        b=2, sq=700, sk=1111, hq=4, hk=2, d=64, causal=False, seg="random",
        bs=_bs(256, 3, "pingpong_kwait")),
    "d128_q_longer_empty_rows_handoff_kwait_fence": dict(
        b=1, sq=700, sk=260, hq=2, hk=2, d=128, causal=True, bs=_bs(128, 2, "handoff_kwait_fence")),
    "d128_window_100_30_soft_cap_fp16_handoff_kwait_fence": dict(
        b=1, sq=1328, sk=1000, hq=2, hk=1, d=128, causal=False, local_window_size=(100, 30),
        logits_soft_cap=2.0, scale=0.5, dtype=jnp.float16, bs=_bs(128, 2, "handoff_kwait_fence")),
    "d256_causal_ragged_handoff_kwait": dict(b=1, sq=777, sk=777, hq=4, hk=2, d=256, causal=True,
                                             bs=_bs(64, 2, "handoff_kwait")),
    "d128_q_shorter_overlap": dict(b=1, sq=300, sk=1111, hq=2, hk=2, d=128, causal=True,
                                   bs=_bs(128, 2, "overlap")),
    "d128_causal_window_511_overlap_p2": dict(
        b=2, sq=2048, sk=2048, hq=4, hk=2, d=128, causal=True, local_window_size=(511, 0),
        bs=_bs(128, 2, "overlap", q_tiles_per_program=2)),
    "d128_segments_packed_overlap_static_mask": dict(
        b=2, sq=1000, sk=1000, hq=4, hk=2, d=128, causal=True, seg="packed",
        bs=_bs(128, 2, "overlap", one_segment_static_mask=True)),
    "d256_segments_aligned_docs_overlap": dict(b=1, sq=1024, sk=1024, hq=2, hk=2, d=256,
                                               causal=True, seg="aligned4",
                                               bs=_bs(64, 2, "overlap")),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_matches_reference(name):
  if compat.gpu_compute_capability() != (9, 0):
    pytest.skip(f"needs sm90 (Hopper), got {compat.gpu_compute_capability()}")
  case = dict(GPU_CASES[name])
  dtype = case.pop("dtype", jnp.bfloat16)
  bs = case.pop("bs", None)
  causal, q_seg, kv_seg, mask = _mask_args(case, name)
  q, k, v = _inputs(zlib.crc32(name.encode()), dtype=dtype, **case)
  fn = jax.jit(lambda q, k, v, qs, ks: mg.flash_attention(q, k, v, qs, ks, causal=causal,
                                                          block_sizes=bs, **mask))
  out, lse = fn(q, k, v, q_seg, kv_seg)
  _check(out, lse, q, k, v, causal, dtype, q_seg, kv_seg, **mask)


# Through the registered path, forward and VJP against the fp32 reference: jattn's default at
# D256 (Triton backward) and the Triton backward on the masks it takes
# (the Mosaic GPU backward's own cases: tests/test_flash_mosaic_gpu_bwd.py).
GPU_VJP_CASES = {
    "d256_causal_gqa_ragged": dict(b=1, sq=777, sk=777, hq=4, hk=2, d=256, causal=True),
    "d64_segments_window_soft_cap_triton_bwd": dict(
        b=1, sq=1000, sk=1000, hq=2, hk=1, d=64, causal=True, seg="packed",
        local_window_size=(200, 0), logits_soft_cap=5.0),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_VJP_CASES))
def test_gpu_registered_forward_and_vjp(name):
  """Mosaic GPU forward + Triton backward (masks included)."""
  if compat.gpu_compute_capability() != (9, 0):
    pytest.skip(f"needs sm90 (Hopper), got {compat.gpu_compute_capability()}")
  case = dict(GPU_VJP_CASES[name])
  causal, q_seg, kv_seg, mask = _mask_args(case, name)
  q, k, v = _inputs(zlib.crc32(name.encode()), dtype=jnp.bfloat16, **case)
  bs = None
  if name.endswith("triton_bwd"):
    window, segments = mask.get("local_window_size"), q_seg is not None
    bs = dataclasses.replace(mg.fit_block_sizes(
        mg.default_block_sizes(q.shape[-1], mask=mask_kind(causal, window, segments=segments)),
        q.shape, k.shape, causal=causal, window=window, segments=segments), backward="triton")
  got, want = _vjp_vs_reference(q, k, v, causal, interpret=False, block_sizes=bs, q_seg=q_seg,
                                kv_seg=kv_seg, **mask)
  _assert_vjp_close(got, want, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("backward", ["mosaic", "triton"])
def test_gpu_tail_kv_splits_forward_and_vjp(backward):
  """``tail_kv_splits`` (the H200 dense default) through jattn on the GPU:
  the forward's split rows and their LSE (written in place by ``_place_rows``) feed both
  backwards; GQA 4:2, a ragged last query tile, against the fp32 reference."""
  if compat.gpu_compute_capability() != (9, 0):
    pytest.skip(f"needs sm90 (Hopper), got {compat.gpu_compute_capability()}")
  q, k, v = _inputs(zlib.crc32(f"tail_vjp_{backward}".encode()), b=2, sq=1000, sk=1024, hq=4,
                    hk=2, d=128, dtype=jnp.bfloat16)
  bs = _bs(128, 2, "overlap", tail_kv_splits=4, backward=backward)
  got, want = _vjp_vs_reference(q, k, v, False, interpret=False, block_sizes=bs)
  _assert_vjp_close(got, want, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("d,window", [(128, (300, 0)), (64, None)])
def test_gpu_kv_prefix_equals_the_concatenation(d, window):
  """The forward over keys split in two arrays (``kv_prefix``) is bit-identical to the call on
  their concatenation: a causal window reaching into the prefix, and GQA without a window."""
  if compat.gpu_compute_capability() != (9, 0):
    pytest.skip(f"needs sm90 (Hopper), got {compat.gpu_compute_capability()}")
  q, k, v = _inputs(zlib.crc32(f"prefix_{d}".encode()), b=2, sq=1000, sk=1512, hq=4, hk=2,
                    d=d, dtype=jnp.bfloat16)
  mask = dict(causal=True, local_window_size=window)
  cut = lambda x: (x[:, :512], x[:, 512:])
  (kp, k2), (vp, v2) = cut(k), cut(v)
  got = jax.jit(lambda: mg.flash_attention(q, k2, v2, kv_prefix=(kp, vp), **mask))()
  want = jax.jit(lambda: mg.flash_attention(q, k, v, **mask))()
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
  _check(*got, q, k, v, True, jnp.bfloat16, local_window_size=window)
