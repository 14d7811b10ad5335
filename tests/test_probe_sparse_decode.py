"""experiments/probe_sparse_decode.py's row filter and check rules (pure Python, no kernels:
the probe itself runs on the GPU; `--tiny` runs it interpreted, minutes per row set)."""
import pytest

from experiments import probe_sparse_decode as probe

NAMES = probe.row_names([33, 16])


def test_row_names_include_the_radix_whole_calls():
  for name in ("dense", "sparse", "select_r2", "select_r4", "sparse_r2", "sparse_r4",
               "score_select_fused_s1", "sparse_fused", "sparse_fused_r2", "sparse_fused_r4",
               "attend_s33", "attend_s16"):
    assert name in NAMES
  assert len(set(NAMES)) == len(NAMES)


def test_select_rows_patterns_keep_order_and_baselines():
  assert probe.select_rows(NAMES, None) == NAMES
  got = probe.select_rows(NAMES, "sparse_fused*,select_r2")
  assert got == ["dense", "sparse", "select_r2", "sparse_fused", "sparse_fused_s1",
                 "sparse_fused_r4", "sparse_fused_r2"]
  # exclusions; dense and sparse stay even when excluded
  got = probe.select_rows(NAMES, "*,-attend_s*,-s*")
  assert "attend_s33" not in got and "select" not in got
  assert got[:2] == ["dense", "sparse"] and "merge" in got
  with pytest.raises(ValueError, match="match no row"):
    probe.select_rows(NAMES, "select_r3*")


def test_check_rules():
  assert probe.check_passes("sparse_rel_err", 1e-3) is True
  assert probe.check_passes("sparse_rel_err", 0.1) is False
  assert probe.check_passes("scores_rel_err_vs_xla", 1e-3) is False
  assert probe.check_passes("merged_repeat_mismatches", 0) is True
  assert probe.check_passes("sparse_r2_equals_sparse", False) is False
  assert probe.check_passes("select_r2_check_error", "boom") is False
  assert probe.check_passes("kept_fraction", 0.19) is None


def test_list_runs_nothing(capsys):
  assert probe.main(["--list", "--tiny"]) == 0
  assert "sparse_fused_r2" in capsys.readouterr().out.split()


def test_attend_sweep_configs_and_rows():
  """--sweep-attend's config names: any field order, defaults filled in, canonical names; the
  sweep rows come after every other row, only when asked for; bad names are errors."""
  cfg = probe.parse_attend_config("b2_xm_s17", 33)
  assert cfg == dict(splits=17, num_warps=4, num_stages=3, blocks_per_step=2,
                     index_lookahead=True, merge="xm", compact=False)
  assert probe.attend_config_name(cfg) == "s17_w4_st3_b2_xm"
  ct = probe.parse_attend_config("ct_st2_b2", 33)   # the compact diagnostic (session 22)
  assert ct["compact"] and probe.attend_config_name(ct) == "s33_w4_st2_b2_ct"
  assert probe.attend_config_name(probe.parse_attend_config("", 33)) == "s33_w4_st3_b1"
  assert probe.attend_config_name(probe.parse_attend_config("st4_la0_w8", 33)) == \
      "s33_w8_st4_b1_la0"
  for bad in ("s33_x1", "b3", "w3", "la2", "s0"):
    with pytest.raises(ValueError):
      probe.parse_attend_config(bad, 33)
  names = probe.row_names([33], ("s33_w4_st3_b1", "s16_w4_st3_b2"))
  assert names[-3:] == ["sw_s33_w4_st3_b1", "sw_s16_w4_st3_b2", "sparse_best"]
  assert probe.row_names([33]) == probe.row_names([33], ())
  assert probe.select_rows(names, "sw_*,sparse_best") == ["dense", "sparse"] + names[-3:]
  assert probe.check_passes("sw_s33_w4_st3_b1_sweep_rel_err", 2e-3) is True
  assert probe.check_passes("sw_s33_w4_st3_b1_sweep_rel_err", 1e-2) is False
  assert probe.check_passes("sparse_best_config", "s33_w4_st3_b1") is None
  assert probe.check_passes("sw_s33_w4_st3_b1_bitwise_vs_sparse", "differs") is None


def test_list_sweep_rows(capsys):
  assert probe.main(["--list", "--tiny", "--sweep-attend"]) == 0
  out = capsys.readouterr().out.split()
  assert len([n for n in out if n.startswith("sw_")]) == len(probe.ATTEND_GRID) == 16
  assert out[-1] == "sparse_best" and "sw_s3_w4_st3_b1" in out      # tiny: 3 default splits
  assert probe.main(["--list", "--tiny", "--attend-configs", "s2_b2,s2_w4_st3_b2"]) == 0
  assert capsys.readouterr().out.split()[-2:] == ["sw_s2_w4_st3_b2", "sparse_best"]


def test_compact_kept_blocks_reads_the_same_bytes():
  """The ``_ct`` diagnostic: the Triton attention over a compacted copy of the kept blocks (ids
  0..count-1) gives the scattered read's output to the bit (same bytes, same order)."""
  import doctest

  import jax
  import jax.numpy as jnp
  from pallas_kernels.sparse.decode import sparse_decode
  runner = doctest.DocTestRunner(verbose=False)
  for t in doctest.DocTestFinder().find(probe.compact_kept_blocks, globs=dict(vars(probe))):
    runner.run(t)
  assert runner.summarize(verbose=False).attempted > 0 and runner.failures == 0
  b, n, hq, hk, d, bs = 2, 128, 4, 2, 16, 16
  ks = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(ks[0], (b, hq, d), jnp.float32)
  k = jax.random.normal(ks[1], (b, n, hk, d), jnp.float32)
  v = jax.random.normal(ks[2], (b, n, hk, d), jnp.float32)
  idx = jnp.array([[[0, 3, 5, 7], [1, 2, 7, -1]], [[2, 4, -1, -1], [0, 6, 7, -1]]], jnp.int32)
  cnt = jnp.sum(idx >= 0, axis=-1).astype(jnp.int32)
  lens = jnp.full((b,), n, jnp.int32)
  kw = dict(block_size=bs, num_splits=2, interpret=True)
  out = sparse_decode(q, k, v, lens, idx, None, cnt, **kw)[0]
  k_c, ids = probe.compact_kept_blocks(k, idx, cnt, bs)
  v_c, _ = probe.compact_kept_blocks(v, idx, cnt, bs)
  assert k_c.shape == (b, 4 * bs, hk, d)
  out_c = sparse_decode(q, k_c, v_c, lens, ids, None, cnt, **kw)[0]
  assert bool(jnp.array_equal(out, out_c))
