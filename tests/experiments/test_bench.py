"""The benchmarks' shared timer, issue 8's tile counts and tile sums, the packed-documents bench
and the Mosaic GPU sweeps' wiring, on the CPU (GPU kernels stood in for by the reference)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import bench_kernels as bk
from pallas_kernels import _timing
from pallas_kernels.block_schedule import make_schedule
from pallas_kernels.flash import mosaic_gpu as mg
from pallas_kernels.flash import mosaic_gpu_bwd as mb
from pallas_kernels.flash.reference import attention_reference


def _brute_tiles(seq, rows, bk_, *, causal, window, docs):
  """(needed, all) tiles from the element mask, reduced over (rows x bk_) tiles."""
  i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
  vis = np.ones((seq, seq), bool)
  if causal or docs:
    vis &= j <= i
  if window is not None:
    vis &= j >= i - window[0]
  if docs:
    seg = np.arange(seq) // (seq // docs)
    vis &= seg[:, None] == seg[None, :]
  nq, nk = -(-seq // rows), -(-seq // bk_)
  pad = np.zeros((nq * rows, nk * bk_), bool)
  pad[:seq, :seq] = vis
  return int(pad.reshape(nq, rows, nk, bk_).any((1, 3)).sum()), nq * nk


MASKS = [dict(causal=False, window=None, docs=None), dict(causal=True, window=None, docs=None),
         dict(causal=True, window=(511, 0), docs=None), dict(causal=True, window=(37, 0), docs=None),
         dict(causal=True, window=None, docs=4), dict(causal=True, window=None, docs=3)]


@pytest.mark.parametrize("seq", [384, 1000, 1536])
@pytest.mark.parametrize("tiles", [(128, 128), (128, 64), (256, 64)])
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: "-".join(f"{k}{v}" for k, v in m.items()))
def test_bench_tile_counts_match_brute_force(seq, tiles, mask):
  if mask["docs"] and seq % mask["docs"]:
    pytest.skip("docs must divide seq")
  got = bk.mosaic_tile_counts(seq, 128, tiles=tiles, **mask)
  assert got == _brute_tiles(seq, *tiles, **mask)   # exact: one tile off fails


def test_bench_tile_counts_default_tiles_are_the_kernels():
  """The default tiles are the device table's for the mask kind: on an H200, 128 rows x 128
  keys for a causal window (64 keys from run 33 to run 81), causal and packed documents (the
  generic table: 128 x 128 everywhere)."""
  want = {"NVIDIA H200": [(128, 128)] * 3, "cpu": [(128, 128)] * 3}
  for device, tiles in want.items():
    for kw, t in zip([dict(causal=True, window=(511, 0), docs=None),
                      dict(causal=True, window=None, docs=None),
                      dict(causal=True, window=None, docs=4)], tiles):
      got = bk.mosaic_tile_counts(4096, 128, device_kind=device, **kw)
      assert got == bk.mosaic_tile_counts(4096, 128, tiles=t, **kw), (device, kw)
  # and the tiles change the count (a wrong tile size would be seen)
  assert bk.mosaic_tile_counts(4096, 128, causal=True, window=(511, 0), tiles=(128, 64)) != \
      bk.mosaic_tile_counts(4096, 128, causal=True, window=(511, 0), tiles=(128, 128))


@pytest.mark.parametrize("seq", [1536, 1000])
@pytest.mark.parametrize("mask", MASKS[1:], ids=lambda m: f"w{m['window']}-d{m['docs']}")
def test_bench_tile_counts_vs_the_mosaic_forward_walk(mask, seq):
  """The Mosaic forward's own program ranges [plo, phi) (``_static_ranges``, or ``_seg_bounds``
  with segment ids) walk exactly the needed tiles, packed documents with a last q tile that is
  partly padding (seq 1000 here) included."""
  if mask["docs"] and seq % mask["docs"]:
    pytest.skip("docs must divide seq")
  bs = mg.BlockSizes(64, 64)
  st = mg._static_config((1, seq, 1, 128), (1, seq, 1, 128), jnp.bfloat16, causal=True, scale=None,
                         block_sizes=bs, local_window_size=mask["window"],
                         has_seg=mask["docs"] is not None)
  if mask["docs"] is None:
    rows = jnp.arange(st.num_q_programs) * bs.rows_per_program
    plo, _, _, phi = mg._static_ranges(rows, bs.rows_per_program, st)
  else:
    seg = jnp.repeat(jnp.arange(1, mask["docs"] + 1, dtype=jnp.int32), seq // mask["docs"])[None]
    pad = st.num_q_programs * bs.rows_per_program - seq
    seg = jnp.pad(seg, ((0, 0), (0, pad)))
    bounds = mg._seg_bounds(seg, jnp.pad(seg, ((0, 0), (0, st.num_kv_tiles * 64 - seq - pad))),
                            st)[0]
    plo, phi = bounds[:, 0], bounds[:, 1]
  walked = (int(jnp.sum(phi - plo)), st.num_q_programs * st.num_kv_tiles)
  needed = bk.mosaic_tile_counts(seq, 128, tiles=(bs.rows_per_program, bs.block_k), **mask)
  assert walked == needed
  if mask["docs"]:   # the block schedule of the Triton and TPU kernels at the same tiles
    s = make_schedule(seq, seq, bs.rows_per_program, bs.block_k, causal=True,
                      q_segment_ids=seg[:, :seq], kv_segment_ids=seg[:, :seq])
    assert (int(s.visited_tiles()[0, 0]), s.num_q_blocks * s.num_kv_blocks) == needed


def test_bench_time_fn_rotates_input_sets():
  seen = []
  f = lambda x: seen.append(float(x[0])) or x
  ms, spread = _timing.time_fn(f, [(jnp.full(2, i, jnp.float32),) for i in range(3)], iters=6,
                               repeats=2)
  assert ms > 0 and spread >= 0 and seen[3:] == [0.0, 1.0, 2.0] * 4   # warm-up, then loops
  assert bk.time_fn is _timing.time_fn


def test_bench_tile_sum_fields(monkeypatch, capsys):
  monkeypatch.setattr(bk, "ROWS", [])
  q = jnp.zeros((2, 2048, 2, 128), jnp.bfloat16)
  dense = bk._case(2, 2048, 2, 128)
  assert bk.tile_sum_fields("jattn_mosaic_gpu", dense, 1.0, q, window=(511, 0)) == {}
  assert "no dense row" in capsys.readouterr().out
  bk.ROWS.append(dict(op="flash_fwd", case=dense, impl="jattn_mosaic_gpu", ms=4.0))
  needed, total = bk.mosaic_tile_counts(2048, 128, causal=True, window=(511, 0))
  got = bk.tile_sum_fields("jattn_mosaic_gpu", dense, 1.0, q, window=(511, 0))
  assert got == pytest.approx(dict(tiles_needed=needed, tiles_all=total,
                                   tile_sum_ms=4.0 * needed / total,
                                   tile_sum_ratio=total / (4.0 * needed)))
  assert bk.tile_sum_fields("jax_nn_cudnn", dense, 1.0, q, window=(511, 0)) == {}
  bk.ROWS.append(dict(op="flash_fwd", case=dense, impl="jattn_default", ms=4.0))
  assert bk.tile_sum_fields("jattn_default", dense, 1.0, q, docs=4) == {}   # CPU: runs xla
  assert "not the Mosaic forward" in capsys.readouterr().out


def test_bench_flash_packed_cpu(monkeypatch, capsys):
  """Every packed implementation gets a row or a printed reason; jattn_default (xla on the CPU)
  checks against the reference; the cuDNN anchor is timed on separate rows (here: xla)."""
  monkeypatch.setattr(bk, "ROWS", [])
  monkeypatch.setattr(bk, "time_fn", functools.partial(_timing.time_fn, iters=1, repeats=1))
  _fake_cudnn(monkeypatch)
  bk.bench_flash_packed(s=512, docs=4, h=2, d=64, b=1)
  rows = {r["impl"]: r for r in bk.ROWS}
  assert rows["jattn_default"]["ok"] and rows["jax_nn_cudnn"]["ok"]
  out = capsys.readouterr().out
  for name in bk.PACKED_IMPLS:
    assert name in rows or f"{name}: skipped" in out


def _fake_cudnn(monkeypatch):
  nn_attn = jax.nn.dot_product_attention
  monkeypatch.setattr(jax.nn, "dot_product_attention",
                      lambda *a, implementation=None, **kw: nn_attn(*a, **kw))


def _ref_forward(q, k, v, q_seg=None, kv_seg=None, *, causal=False, local_window_size=None,
                 block_sizes=None, **_):
  return attention_reference(q, k, v, causal=causal, local_window_size=local_window_size,
                             q_segment_ids=q_seg, kv_segment_ids=kv_seg)


@pytest.mark.parametrize("kw", [dict(causal=True, local_window_size=(31, 0)), dict(docs=2)])
def test_mosaic_sweep_rows_cpu(monkeypatch, kw):
  """``_sweep``'s wiring (3 input sets through the shared timer, rows, the cuDNN anchor on
  separate rows for docs) with the reference standing in for the kernel and cuDNN."""
  _fake_cudnn(monkeypatch)
  monkeypatch.setattr(mg, "flash_attention", _ref_forward)
  rows = mg._sweep(1, 256, 2, 2, 64, configs=[mg.BlockSizes()], iters=1, verbose=False, **kw)
  assert [set(r) for r in rows] == [{"name", "ms", "tflops"},
                                    {"name", "ms", "tflops", "max_abs_diff_vs_cudnn"}]
  assert rows[1]["max_abs_diff_vs_cudnn"] < 1e-2


def test_mosaic_sweep_bwd_rows_cpu(monkeypatch):
  _fake_cudnn(monkeypatch)
  monkeypatch.setattr(mg, "flash_attention", _ref_forward)

  def ref_bwd(q, k, v, o, l, do, *, causal=False, block_sizes=None):
    return jax.vjp(lambda q, k, v: attention_reference(q, k, v, causal=causal)[0], q, k, v)[1](do)
  monkeypatch.setattr(mb, "flash_attention_bwd", ref_bwd)
  rows = mb._sweep_bwd(1, 128, 2, 2, 64, causal=True, dtype=jnp.float32, iters=1,
                       configs=[mb.BlockSizes()], verbose=False)
  names = [r["name"].split()[0] for r in rows]
  assert names == ["cudnn_fwd", "cudnn_fwd_bwd", "cudnn_bwd_est", "triton_bwd", "mosaic_bwd",
                   "mosaic_fwd_bwd"]
  assert all(r["max_abs_diff_vs_cudnn"] < 1e-2 for r in rows[4:])


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(causal=True, local_window_size=(31, 0)),
                                dict(docs=2)])
def test_mosaic_sweep_default_configs_cpu(monkeypatch, kw):
  """``_sweep``'s default config list on an H200's table is valid for every mask kind (no
  combination ``BlockSizes`` rejects, e.g. the fence with overlap_softmax) and A/Bs the
  intra-warpgroup overlap against the default."""
  from pallas_kernels import tuning
  _fake_cudnn(monkeypatch)
  monkeypatch.setattr(tuning, "device_kind", lambda: "NVIDIA H200")
  mg._tuned_block_sizes.cache_clear()
  seen = []

  def fake_forward(*args, block_sizes=None, **kwargs):
    seen.append(block_sizes)
    return _ref_forward(*args, **kwargs)
  monkeypatch.setattr(mg, "flash_attention", fake_forward)
  try:
    rows = mg._sweep(1, 256, 2, 2, 128, iters=1, verbose=False, **kw)
  finally:
    mg._tuned_block_sizes.cache_clear()
  assert all("error" not in r for r in rows) and len(rows) == len(set(seen)) + 1 > 5
  assert {b.overlap_softmax for b in seen} == {False, True}


def test_ncu_target_parses_every_case():
  """experiments/ncu_flash_fwd.py (the Nsight Compute target of next_gpu_session_p.sh) builds
  its inputs for every case and option without a GPU (--dry-run)."""
  from experiments import ncu_flash_fwd
  for case in ncu_flash_fwd.CASES:
    for extra in ([], ["--overlap"], ["--bwd"], ["--fused-bwd"]):
      assert ncu_flash_fwd.main(["--case", case, "--dry-run", *extra]) is None


def test_ncu_sparse_decode_target_cpu():
  """experiments/ncu_sparse_decode.py: its summary (doctests: per-call sums, the marker cut)
  and one row's wiring in interpret mode (S1024), checked against the fp32 reference."""
  import doctest
  from experiments import ncu_sparse_decode as nsd
  assert doctest.testmod(nsd).failed == 0
  err, opened = nsd.run_row("sparse_hnd", calls=1, tiny=True)
  assert err < 5e-3 and opened is False       # no CUDA driver on the CPU machine
  from pallas_kernels.sparse import decode_select as ds
  before = ds.select_decode_slots
  err, _ = nsd.run_row("sparse_hnd", calls=1, tiny=True, digit_bits=2, fused_select=True)
  assert err < 5e-3 and ds.select_decode_slots is before   # the patch ends with the row
  with pytest.raises(ValueError, match="row must be"):
    nsd.run_row("sparse", tiny=True)
