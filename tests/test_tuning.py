"""Tuning tables (pallas_kernels/tuning): keys, fallbacks to generic.json, and the kernels'
defaults read from them."""
import dataclasses
import json
import os
import tomllib

import jax.numpy as jnp
import pytest

from pallas_kernels import tuning
from pallas_kernels.flash import mosaic_gpu as mg
from pallas_kernels.flash import mosaic_gpu_bwd as mgb
from pallas_kernels.flash import triton as ft

# None: this machine's device; then an H200, an H100 (no table of its own), CPU, unknown.
DEVICES = [None, "NVIDIA H200", "NVIDIA H100 80GB HBM3", "cpu", "no such device"]
TRITON_FWD_FIELDS = ("block_q", "block_k", "num_warps", "num_stages")


def _same(a, b):
  # dataclass equality plus repr: the same values of the same types (False is not 0, None not 0)
  return a == b and repr(a) == repr(b) and type(a) is type(b)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_defaults_are_the_table_entries(device):
  for dtype, dcls in ((jnp.bfloat16, "16bit"), (jnp.float16, "16bit"), (jnp.float32, "32bit")):
    for head_dim in (8, 16, 32, 40, 64, 80, 96, 128, 160, 192, 256):
      key = max(32, 1 << (head_dim - 1).bit_length())
      fwd = tuning.required_params("triton_fwd", key, dcls, device)
      bwd = tuning.required_params("triton_bwd", key, dcls, device)
      assert _same(ft.default_block_sizes(head_dim, dtype, device_kind=device),
                   ft.BlockSizes(**fwd, **bwd)), (device, head_dim, dtype)
  with pytest.raises(ValueError):
    ft.default_block_sizes(512, jnp.bfloat16, device_kind=device)


@pytest.mark.parametrize("device", DEVICES)
def test_mosaic_defaults_are_the_table_entries(device):
  for mask in tuning.MASK_KINDS:
    for dtype in (jnp.bfloat16, jnp.float16):
      for head_dim in (64, 128, 256):
        want = mg.BlockSizes(**tuning.required_params("mosaic_gpu_fwd", head_dim, "16bit",
                                                      device, mask))
        assert _same(mg.default_block_sizes(head_dim, dtype, device_kind=device, mask=mask),
                     want)
      for head_dim in (64, 128):
        want = mgb.BlockSizes(**tuning.required_params("mosaic_gpu_bwd", head_dim, "16bit",
                                                       device, mask))
        assert _same(mgb.default_block_sizes(head_dim, dtype, device_kind=device, mask=mask),
                     want)
  with pytest.raises(NotImplementedError):
    mg.default_block_sizes(96, device_kind=device)
  with pytest.raises(NotImplementedError):
    mgb.default_block_sizes(256, device_kind=device)
  with pytest.raises(NotImplementedError):
    mg.default_block_sizes(128, jnp.float32, device_kind=device)


def test_devices_without_a_table_read_the_generic_one():
  for kind in ("NVIDIA H100 80GB HBM3", "no such device"):
    assert _same(ft.default_block_sizes(128, jnp.bfloat16, device_kind=kind),
                 ft.default_block_sizes(128, jnp.bfloat16, device_kind="cpu"))
    for mask in tuning.MASK_KINDS:
      assert _same(mg.default_block_sizes(128, device_kind=kind, mask=mask),
                   mg.default_block_sizes(128, device_kind="cpu", mask=mask))


def test_default_block_sizes_without_device_kind_use_this_device():
  here = tuning.device_kind()
  assert _same(ft.default_block_sizes(128, jnp.bfloat16),
               ft.default_block_sizes(128, jnp.bfloat16, device_kind=here))
  assert _same(mg.default_block_sizes(128), mg.default_block_sizes(128, device_kind=here))
  assert _same(mgb.default_block_sizes(64), mgb.default_block_sizes(64, device_kind=here))


def test_table_choice_and_fallback():
  assert tuning.table_file("NVIDIA H200") == "nvidia_h200.json"
  for kind in ("cpu", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "TPU v5 lite"):
    assert tuning.table_file(kind) == tuning.GENERIC_TABLE
    assert tuning.device(kind=kind).table == tuning.GENERIC_TABLE
  assert tuning.device_kind() is tuning.device_kind()  # cached
  assert tuning.device().kind == tuning.device_kind()
  assert tuning.entry("triton_fwd", 128, "16bit", mask="causal", device="cpu")["mask"] == "all"
  assert tuning.entry("triton_fwd", 512, "16bit", device="cpu") is None
  with pytest.raises(KeyError, match="generic.json"):
    tuning.required_params("triton_fwd", 512, "16bit", "cpu")


def test_mask_kind_and_mask_entries():
  assert [tuning.mask_kind(c, w) for c, w in [(False, None), (True, None), (True, (511, 0)),
                                              (False, (100, 30)), (True, (None, None))]] == [
      "dense", "causal", "causal_window", "window", "causal"]
  # segment ids change only the causal kind without a window
  assert [tuning.mask_kind(c, w, segments=True) for c, w in [
      (False, None), (True, None), (True, (511, 0)), (False, (100, 30))]] == [
      "dense", "causal_segments", "causal_window", "window"]
  # entry(): a mask kind's own entry where the device's table has one, else the "all" entry
  table = tuning.load_table("nvidia_h200.json")
  for (kernel, head_dim, dcls, mask), e in table.items():
    for kind in tuning.MASK_KINDS:
      own = table.get((kernel, head_dim, dcls, kind))
      got = tuning.entry(kernel, head_dim, dcls, mask=kind, device="NVIDIA H200")
      assert got is (own or table.get((kernel, head_dim, dcls, "all"))
                     or tuning.load_table("generic.json").get((kernel, head_dim, dcls, "all")))


def test_flash_attention_asks_for_the_mask_kinds_tiles(monkeypatch):
  """jattn.flash_attention(implementation="mosaic_gpu") reads the table entry of the call's
  mask kind (a causal window, packed documents, causal, dense; segment ids without causal are
  "dense") and fits it to the call."""
  import jattn

  seen = []

  def fake_forward(q, *args, block_sizes, **kwargs):
    seen.append(block_sizes)
    return q, jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)

  monkeypatch.setattr(tuning, "device_kind", lambda: "NVIDIA H200")
  monkeypatch.setattr(mg, "flash_attention", fake_forward)
  x = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
  seg = jnp.ones((1, 256), jnp.int32)
  calls = [(dict(causal=True, local_window_size=(511, 0)), "causal_window"),
           (dict(causal=True), "causal"), (dict(causal=True, segment_ids=seg), "causal_segments"),
           (dict(causal=False, segment_ids=seg), "dense"), (dict(causal=False), "dense")]
  for kw, kind in calls:
    jattn.flash_attention(x, x, x, implementation="mosaic_gpu", **kw)
    table = mg.default_block_sizes(128, device_kind="NVIDIA H200", mask=kind)
    fitted = mg.fit_block_sizes(table, x.shape, x.shape, causal=kw["causal"],
                                window=kw.get("local_window_size"),
                                segments="segment_ids" in kw)
    assert seen[-1] == dataclasses.replace(fitted, backward="mosaic"), kind


def test_tables_well_formed():
  names = {tuning.GENERIC_TABLE, *tuning.DEVICE_TABLES.values()}
  assert names == {f for f in os.listdir(os.path.dirname(tuning.__file__))
                   if f.endswith(".json")}
  modules = {"mosaic_gpu_fwd": mg, "mosaic_gpu_bwd": mgb}
  for name in names:
    with open(os.path.join(os.path.dirname(tuning.__file__), name)) as f:
      data = json.load(f)
    assert data["device_kinds"] == [k for k, v in tuning.DEVICE_TABLES.items() if v == name]
    table = tuning.load_table(name)
    assert {k[0] for k in table} == set(tuning.KERNELS)
    for key, e in table.items():
      prov = e["provenance"]
      assert prov["status"] in ("tuned", "untimed"), key
      assert prov["commit"]
      if prov["status"] == "tuned":
        for field in ("date", "device", "command"):
          assert prov[field], (key, field)
      if key[0] in modules:     # every entry makes a valid BlockSizes
        modules[key[0]].BlockSizes(**e["params"])
      elif key[0] == "triton_fwd":
        bwd = table[("triton_bwd",) + key[1:]]["params"]
        assert set(e["params"]) == set(TRITON_FWD_FIELDS)
        assert set(e["params"]) | set(bwd) == set(ft.BlockSizes.__dataclass_fields__)
        ft.BlockSizes(**e["params"], **bwd)


def test_tables_ship_as_package_data():
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, "pyproject.toml"), "rb") as f:
    cfg = tomllib.load(f)
  assert "*.json" in cfg["tool"]["setuptools"]["package-data"]["pallas_kernels.tuning"]


def _row(name, cfg, seq, causal, fwd, bwd, ok=True, window=None):
  import dataclasses
  return dict(config=dataclasses.asdict(cfg), name=name, seq=seq, causal=causal, window=window,
              fwd_ms=fwd, fwd_bwd_ms=fwd + bwd + 0.5, bwd_ms=bwd, check=dict(ok=ok))


def test_gpu_sweep_write_tuning_candidate(tmp_path, monkeypatch):
  gs = pytest.importorskip("experiments.gpu_sweep")
  base = ft.default_block_sizes(128, jnp.bfloat16)
  fast_bwd = dataclasses.replace(base, bwd_num_warps=8, bwd_num_stages=3, dkv_block_q=None)
  other_tiles = dataclasses.replace(base, block_q=128, block_k=64, bwd_block_q=None,
                                    bwd_block_k=None, num_warps=8, dkv_block_q=None)
  rows = []
  for seq in (4096, 16384):
    s = seq / 4096
    rows += [_row("default", base, seq, True, 1.0 * s, 3.0 * s),
             _row("fast_bwd", fast_bwd, seq, True, 1.0 * s, 2.0 * s),
             _row("broken", other_tiles, seq, True, 0.1, 0.1, ok=False),  # fast but wrong
             _row("default", base, seq, False, 2.0 * s, 6.0 * s),
             _row("tiles", other_tiles, seq, False, 1.5 * s, 5.0 * s),
             dict(name="tokamax_triton", seq=seq, causal=True, window=None, fwd_ms=0.01)]
  prov = dict(status="tuned", run="test", date="2026-11-30", device="NVIDIA H200",
              commit="abc", command="gpu_sweep ...", results="rows.json")
  table = gs.tuning_table(rows, head_dim=128, dtype=jnp.bfloat16, device_kind="NVIDIA H200",
                          provenance=prov)
  path = tmp_path / "candidate.json"
  path.write_text(json.dumps(table))
  got = {k: e for k, e in tuning.load_table(str(path)).items()}
  assert set(got) == {("triton_fwd", 128, "16bit", "causal"), ("triton_fwd", 128, "16bit", "dense"),
                      ("triton_bwd", 128, "16bit", "causal"), ("triton_bwd", 128, "16bit", "dense")}
  assert got[("triton_fwd", 128, "16bit", "causal")]["params"]["block_q"] == 64  # broken excluded
  assert got[("triton_fwd", 128, "16bit", "dense")]["params"]["block_q"] == 128
  assert got[("triton_bwd", 128, "16bit", "causal")]["params"]["bwd_num_warps"] == 8
  # dense: one config wins both passes, its fields are copied as they are (single tile)
  dense_bwd = got[("triton_bwd", 128, "16bit", "dense")]
  assert dense_bwd["params"]["bwd_block_q"] is None and dense_bwd["params"]["dkv_block_q"] is None
  # causal: backward winner's tiles equal the forward winner's (64x64): fields copied as they are
  assert got[("triton_bwd", 128, "16bit", "causal")]["params"]["bwd_block_q"] == 128
  m = got[("triton_bwd", 128, "16bit", "causal")]["provenance"]
  assert m["run"] == "test" and m["measured"]["causal"]["ms"] == {"4096": 2.0, "16384": 8.0}
  assert m["measured"]["causal"]["current_default_ms"] == {"4096": 3.0, "16384": 12.0}
  # the loader takes a mask entry over "all"
  monkeypatch.setitem(tuning.DEVICE_TABLES, "test device", str(path))
  e = tuning.entry("triton_bwd", 128, "16bit", mask="causal", device="test device")
  assert e["params"]["bwd_num_warps"] == 8
  # no "all" entry in the candidate: the generic table's
  assert tuning.entry("triton_bwd", 128, "16bit", device="test device") == tuning.entry(
      "triton_bwd", 128, "16bit", device="cpu")
  # the same winner for every mask kind: one "all" entry per pass
  same = [r for r in rows if r["name"] in ("default", "tokamax_triton")]
  t2 = gs.tuning_table(same, head_dim=128, dtype=jnp.bfloat16, device_kind="NVIDIA H200",
                       provenance=prov)
  assert [(e["kernel"], e["mask"]) for e in t2["entries"]] == [("triton_fwd", "all"),
                                                               ("triton_bwd", "all")]
  fwd, bwd = (e["params"] for e in t2["entries"])
  assert ft.BlockSizes(**fwd, **bwd) == base
  assert gs.mask_kind(True, (511, 0)) == "causal_window" and gs.mask_kind(False, None) == "dense"
  # a backward winner with other forward tiles than the forward winner: its tiles written out
  win = [_row("default", base, 16384, True, 1.0, 3.0, window=[511, 0]),
         _row("tiles", other_tiles, 16384, True, 2.0, 2.0, window=[511, 0])]
  t3 = gs.tuning_table(win, head_dim=128, dtype=jnp.bfloat16, device_kind="NVIDIA H200",
                       provenance=prov)
  (f3, b3) = t3["entries"]
  assert (f3["mask"], f3["params"]["block_q"], b3["mask"]) == ("causal_window", 64, "causal_window")
  assert (b3["params"]["bwd_block_q"], b3["params"]["bwd_block_k"]) == (128, 64)
  # selection at the longest measured length: a config timed only there competes
  only16k = dataclasses.replace(base, num_stages=4)
  t4 = gs.tuning_table(rows + [_row("s4", only16k, 16384, True, 3.9, 7.9)], head_dim=128,
                       dtype=jnp.bfloat16, device_kind="NVIDIA H200", provenance=prov)
  f4 = {(e["kernel"], e["mask"]): e for e in t4["entries"]}[("triton_fwd", "causal")]
  assert f4["params"]["num_stages"] == 4
  assert f4["provenance"]["measured"]["causal"]["selected_at_seq"] == 16384


def test_gpu_sweep_dry_run_writes_candidate(tmp_path, monkeypatch):
  # the whole --write-tuning path on the CPU: interpreted sweep (the launch case's default
  # config only, seq 128), reference check, candidate table readable by the loader
  gs = pytest.importorskip("experiments.gpu_sweep")
  plan = gs.plan
  monkeypatch.setattr(gs, "plan", lambda *a: [(s, c, w, {"default": cfgs["default"]}, t, tk)
                                              for s, c, w, cfgs, t, tk in plan(*a)])
  rows_path, cand = tmp_path / "rows.json", tmp_path / "cand.json"
  rows = gs.main([str(rows_path), "--dry-run", "--cases", "launch", "--seqs", "128",
                  "--write-tuning", str(cand), "--run", "dry"])
  assert len(rows) == 1 and rows[0]["check"]["ok"]
  table = tuning.load_table(str(cand))
  assert set(table) == {("triton_fwd", 32, "32bit", "causal"),
                        ("triton_bwd", 32, "32bit", "causal")}
  prov = table[("triton_fwd", 32, "32bit", "causal")]["provenance"]
  assert (prov["status"], prov["run"], prov["results"]) == ("dry-run", "dry", str(rows_path))
  again = tmp_path / "again.json"
  gs.main(["unused", "--dry-run", "--from-rows", str(rows_path), "--write-tuning", str(again)])
  assert set(tuning.load_table(str(again))) == set(table)
