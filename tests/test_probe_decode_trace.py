"""CPU dry runs (kernels interpreted) of the GPU probes that time sparse decode by device kernel
time: ``experiments/probe_decode_select.py`` and ``experiments/probe_sparse_decode_layout.py
--kernel-trace``. They check that each row runs, is checked against its reference, and gets the
trace's per-call figures; the numbers themselves mean something only on a GPU."""
import json

import pytest

from experiments import decode_merge_trace as dmt
from experiments import probe_decode_select as pds
from experiments import probe_sparse_attention_parts as psp
from experiments import probe_sparse_decode_layout as psl


def test_probe_decode_select_tiny(tmp_path):
  out = tmp_path / "sel.json"
  res = pds.main(["--tiny", "--inputs", "2", "--reps", "1", "--out", str(out),
                  "--rows", "scores_c32_w4,select_r1_w8,select_r2_w16_cf,fused_r1_wd"])
  rows = res["rows"]
  assert set(rows) == {"scores_c32_w4", "select_r1_w8_cd", "select_r1_w8_cd_rolled",
                       "select_r1_w8_cd_early", "select_r2_w16_cf", "fused_r1_wd_cd"}
  for name, row in rows.items():
    assert row["ok"], name                        # equal to the default kernels' outputs
    assert row["sum_us"] > 0 and row["kernel_trace"]["calls"] == 2, name
  assert json.loads(out.read_text())["case"]["blocks"] == 32


def test_probe_sparse_decode_layout_kernel_trace_tiny(tmp_path):
  out = tmp_path / "layout.json"
  psl.main(["--tiny", "--calls", "1,2", "--rounds", "1", "--skip", "sparse_nhd,dense_hnd",
            "--hnd-grid", "4:2:2", "--kernel-trace", "2", "--out", str(out)])
  res = json.loads(out.read_text())
  assert set(res["rows"]) == {"dense_nhd", "sparse_hnd", "sparse_hnd_s4_st2_b2"}
  for name, row in res["rows"].items():
    assert row["ok"], name
    assert row["kernel_trace"]["sum_us"] > 0 and row["kernel_trace_program"]["calls"] == 2
  assert set(res["kernel_trace_program_sum_us_dense_over_row"]) == set(res["rows"])


def test_probe_sparse_decode_layout_survives_a_failing_row(tmp_path, monkeypatch):
  """A row that fails to compile or run (on a GPU: e.g. a launch over the shared-memory limit)
  is reported under failed_rows and dropped; the other rows are still checked and timed."""
  real = psl.sp.decode._hnd_decode

  def broken(*a, **kw):
    if dict(kw.get("_launch", ())).get("num_stages") == 5:
      raise RuntimeError("out of shared memory")
    return real(*a, **kw)
  monkeypatch.setattr(psl.sp, "_hnd_decode", broken)
  out = tmp_path / "layout.json"
  psl.main(["--tiny", "--calls", "1,2", "--rounds", "1", "--skip", "sparse_nhd,dense_hnd",
            "--hnd-grid", "4:5:1,4:2:2:p,4:2:2:wm:p", "--out", str(out)])
  res = json.loads(out.read_text())
  assert set(res["failed_rows"]) == {"sparse_hnd_s4_st5_b1"}
  assert "out of shared memory" in res["failed_rows"]["sparse_hnd_s4_st5_b1"]
  assert set(res["rows"]) == {"dense_nhd", "sparse_hnd", "sparse_hnd_s4_st2_b2_p",
                              "sparse_hnd_s4_st2_b2_mpw"}
  assert all(r["ok"] for r in res["rows"].values())
  with pytest.raises(ValueError, match="flags are letters of"):
    psl.main(["--tiny", "--hnd-grid", "4:2:2:x", "--out", str(out)])


def test_probe_decode_select_survives_a_failing_variant(tmp_path, monkeypatch):
  """A variant whose kernel fails (on a GPU: e.g. a lowering the Triton backend rejects) is
  reported with its error and ok=False; the other rows run."""
  real = pds.select_decode_slots

  def broken(*a, search_loop="unrolled", **kw):
    if search_loop == "early":
      raise NotImplementedError("no while loop here")
    return real(*a, search_loop=search_loop, **kw)
  monkeypatch.setattr(pds, "select_decode_slots", broken)
  res = pds.main(["--tiny", "--inputs", "2", "--reps", "1", "--out", str(tmp_path / "s.json"),
                  "--rows", "select_r1_w8_cd"])
  rows = res["rows"]
  assert rows["select_r1_w8_cd_early"]["ok"] is False
  assert "no while loop" in rows["select_r1_w8_cd_early"]["error"]
  assert rows["select_r1_w8_cd"]["ok"] and rows["select_r1_w8_cd_rolled"]["ok"]


def test_probe_sparse_attention_parts_tiny(tmp_path):
  """The attention-parts probe (session 25): every row (the merged kernel, partials + merge
  kernel, lists cut to 0 / 2 / 32 blocks) matches the fp32 reference on its own lists and
  gets the trace's per-call figures."""
  out = tmp_path / "parts.json"
  res = psp.main(["--tiny", "--out", str(out)])
  assert set(res["rows"]) == {"merged", "partials+merge", "counts=0", "counts=2", "counts=32"}
  for name, row in res["rows"].items():
    assert row["ok"], name
    assert row["sum_us"] > 0 and row["calls"] == 2, name
  assert json.loads(out.read_text())["case"]["splits"] >= 1


def test_decode_merge_trace_tiny(tmp_path):
  """The dense decode merge trace (sessions 24-25): each merge (a repeated one as <m>_again)
  matches the fp32 reference and gets the trace's per-call figures."""
  res = dmt.main(["--tiny", "--merges", "default,xla,default", "--out",
                  str(tmp_path / "m.json")])
  assert set(res) == {"default", "xla", "default_again"}
  for name, row in res.items():
    assert row["ok"], name
    assert row["sum_us"] > 0 and row["calls"] == 2, name
