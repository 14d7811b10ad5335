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
  for kind in ("NVIDIA A100-SXM4-80GB", "no such device"):
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


def test_table_choice_and_fallback(monkeypatch):
  assert tuning.table_file("NVIDIA H200") == "nvidia_h200.json"
  for kind in ("cpu", "NVIDIA A100-SXM4-80GB", "TPU v5 lite"):
    assert tuning.table_file(kind) == tuning.GENERIC_TABLE
    assert tuning.device(kind=kind).table == tuning.GENERIC_TABLE
  # a Hopper card without a table of its own reads the nearest of its architecture
  hopper = {k: v for k, v in tuning.DEVICE_TABLES.items() if "H1" in k or "H2" in k}
  assert hopper, "the package ships Hopper tables"
  for kind in ("NVIDIA H800", "NVIDIA GH200 480GB", "NVIDIA H100 PCIe"):
    if kind not in tuning.DEVICE_TABLES:
      assert tuning.table_file(kind) in hopper.values(), kind
  monkeypatch.setattr(tuning, "DEVICE_TABLES", {"NVIDIA H200": "nvidia_h200.json"})
  assert tuning.table_file("NVIDIA H100 80GB HBM3") == "nvidia_h200.json"
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
    if name == tuning.GENERIC_TABLE:   # device tables hold the keys they tuned
      assert {k[0] for k in table} == set(tuning.KERNELS)
    for key, e in table.items():
      prov = e["provenance"]
      assert prov["status"] in ("tuned", "untimed"), key
      if prov["status"] == "untimed":
        assert prov["commit"]
      if prov["status"] == "tuned":
        for field in ("date", "device", "command"):
          assert prov[field], (key, field)
      if key[0] in modules:     # every entry makes a valid BlockSizes
        modules[key[0]].BlockSizes(**e["params"])
      elif key[0] == "triton_fwd" and ("triton_bwd",) + key[1:] in table:
        bwd = table[("triton_bwd",) + key[1:]]["params"]
        assert set(e["params"]) == set(TRITON_FWD_FIELDS)
        assert set(e["params"]) | set(bwd) == set(ft.BlockSizes.__dataclass_fields__)
        ft.BlockSizes(**e["params"], **bwd)


def test_tables_ship_as_package_data():
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, "pyproject.toml"), "rb") as f:
    cfg = tomllib.load(f)
  assert "*.json" in cfg["tool"]["setuptools"]["package-data"]["pallas_kernels.tuning"]


def test_user_tables_override_the_package(tmp_path, monkeypatch):
  """A table in $JATTN_TUNING_DIR that lists a kind is what that kind reads; others unchanged."""
  e = dict(tuning.entry("mosaic_gpu_fwd", 128, "16bit", mask="causal", device="NVIDIA H200"))
  e["params"] = dict(e["params"], block_k=64)
  kind = "NVIDIA H200"
  (tmp_path / tuning.table_name(kind)).write_text(json.dumps(
      dict(format=1, device_kinds=[kind], description="test", entries=[e])))
  monkeypatch.setenv(tuning.USER_DIR_ENV, str(tmp_path))
  assert tuning.table_file(kind) == str(tmp_path / "nvidia_h200.json")
  assert tuning.params("mosaic_gpu_fwd", 128, "16bit", "causal", kind)["block_k"] == 64
  assert tuning.table_file("cpu") == tuning.GENERIC_TABLE


def test_tune_candidates_and_cli():
  from pallas_kernels.tuning import tune
  for kernel in tuning.KERNELS:
    for quick in (True, False):
      cands = tune.candidates(kernel, 128, "causal", quick)
      assert cands and len({json.dumps(c, sort_keys=True) for c in cands}) == len(cands)
      mod = {"mosaic_gpu_fwd": mg, "mosaic_gpu_bwd": mgb}.get(kernel)
      for c in cands:   # every candidate is a valid config of its kernel
        if mod is not None:
          mod.BlockSizes(**c)
        elif kernel == "triton_fwd":
          ft.BlockSizes(**c)
        else:
          ft.BlockSizes(64, 64, **c)
  with pytest.raises(ValueError, match="kernel"):
    tune.candidates("nope", 128, "causal", True)
  with pytest.raises(SystemExit) as e:   # no GPU here: a clear refusal, exit code 2
    tune.main(["--quick"])
  assert e.value.code == 2


@pytest.mark.gpu
def test_tune_quick_writes_a_loadable_table(tmp_path):
  from pallas_kernels.tuning import tune
  kernels = "mosaic_gpu_fwd" if tuning.device().sm90 else "triton_fwd"
  table = tune.main(["--quick", "--kernels", kernels, "--head-dims", "128", "--masks", "causal",
                     "--out", str(tmp_path)])
  loaded = tuning.load_table(str(tmp_path / tuning.table_name(tuning.device_kind())))
  assert len(loaded) == len(table["entries"]) == 1
  (e,) = table["entries"]
  assert e["provenance"]["ms"] <= e["provenance"]["incumbent_ms"]
