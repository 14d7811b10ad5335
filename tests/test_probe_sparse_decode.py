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
