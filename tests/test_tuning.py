"""Tuning tables (pallas_kernels/tuning): the loaded defaults are bit-identical to the constants
they replaced (commit 061afb8) on this machine, on an H200 and on any other device."""
import json
import os
import tomllib

import jax.numpy as jnp
import pytest

from pallas_kernels import tuning
from pallas_kernels.flash import mosaic_gpu as mg
from pallas_kernels.flash import mosaic_gpu_bwd as mgb
from pallas_kernels.flash import triton as ft

_T = ft.BlockSizes
# The Python constants before the tables (triton.py / mosaic_gpu.py / mosaic_gpu_bwd.py
# ``_DEFAULT_BLOCK_SIZES`` at 061afb8), keyed as they were.
TRITON_BEFORE = {
    (32, 2): _T(128, 64, num_warps=4, num_stages=3, bwd_num_warps=4, bwd_num_stages=2,
                dkv_q_chunk=64, dq_k_chunk=64),
    (64, 2): _T(128, 64, num_warps=4, num_stages=3, bwd_num_warps=4, bwd_num_stages=2,
                dkv_q_chunk=64, dq_k_chunk=64),
    (128, 2): _T(64, 64, num_warps=4, num_stages=3, bwd_num_warps=4, bwd_num_stages=2,
                 dkv_q_chunk=32, dq_k_chunk=32, bwd_block_q=128, bwd_block_k=64, dkv_block_q=32),
    (256, 2): _T(64, 64, num_warps=8, num_stages=2, bwd_num_warps=8, bwd_num_stages=2,
                 dkv_q_chunk=16, dq_k_chunk=32),
    (32, 4): _T(64, 32, num_warps=8, num_stages=2, bwd_num_warps=8, bwd_num_stages=2,
                dkv_q_chunk=32, dq_k_chunk=32),
    (64, 4): _T(64, 32, num_warps=8, num_stages=2, bwd_num_warps=8, bwd_num_stages=2,
                dkv_q_chunk=32, dq_k_chunk=32),
    (128, 4): _T(64, 32, num_warps=8, num_stages=2, bwd_num_warps=8, bwd_num_stages=2,
                 dkv_q_chunk=32, dq_k_chunk=32),
    (256, 4): _T(32, 16, num_warps=4, num_stages=1, bwd_num_warps=4, bwd_num_stages=1,
                 dkv_q_chunk=16, dq_k_chunk=16),
}
MOSAIC_BEFORE = {
    64: mg.BlockSizes(block_q=64, block_k=128, num_stages=3),
    128: mg.BlockSizes(block_q=64, block_k=128, num_stages=2),
    256: mg.BlockSizes(block_q=64, block_k=64, num_stages=2),
}
MOSAIC_BWD_BEFORE = {
    64: mgb.BlockSizes(64, 64, 64, 128, num_stages_dkv=3, num_stages_dq=3),
    128: mgb.BlockSizes(64, 64, 64, 64, num_stages_dkv=2, num_stages_dq=2),
}
# None: this machine's device; then an H200, an H100 (no table of its own), CPU, unknown.
DEVICES = [None, "NVIDIA H200", "NVIDIA H100 80GB HBM3", "cpu", "no such device"]


def _same(a, b):
  # dataclass equality plus repr: the same values of the same types (False is not 0, None not 0)
  return a == b and repr(a) == repr(b) and type(a) is type(b)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_default_block_sizes_unchanged(device):
  for dtype, itemsize in ((jnp.bfloat16, 2), (jnp.float16, 2), (jnp.float32, 4)):
    for head_dim in (8, 16, 32, 40, 64, 80, 96, 128, 160, 192, 256):
      key = (max(32, max(16, 1 << (head_dim - 1).bit_length())), itemsize)
      got = ft.default_block_sizes(head_dim, dtype, device_kind=device)
      assert _same(got, TRITON_BEFORE[key]), (device, head_dim, dtype)
  with pytest.raises(ValueError):
    ft.default_block_sizes(512, jnp.bfloat16, device_kind=device)


@pytest.mark.parametrize("device", DEVICES)
def test_mosaic_default_block_sizes_unchanged(device):
  for dtype in (jnp.bfloat16, jnp.float16):
    for head_dim, want in MOSAIC_BEFORE.items():
      assert _same(mg.default_block_sizes(head_dim, dtype, device_kind=device), want)
    for head_dim, want in MOSAIC_BWD_BEFORE.items():
      assert _same(mgb.default_block_sizes(head_dim, dtype, device_kind=device), want)
  with pytest.raises(NotImplementedError):
    mg.default_block_sizes(96, device_kind=device)
  with pytest.raises(NotImplementedError):
    mgb.default_block_sizes(256, device_kind=device)
  with pytest.raises(NotImplementedError):
    mg.default_block_sizes(128, jnp.float32, device_kind=device)


def test_default_block_sizes_without_device_kind_use_this_device():
  # the call sites pass no device_kind: the current device's table (generic on a CPU)
  assert _same(ft.default_block_sizes(128, jnp.bfloat16), TRITON_BEFORE[(128, 2)])
  assert _same(mg.default_block_sizes(128), MOSAIC_BEFORE[128])
  assert _same(mgb.default_block_sizes(64), MOSAIC_BWD_BEFORE[64])
  assert ft._launch_defaults(64, 64, 128, 128, jnp.bfloat16, bwd_block_q=128,
                             bwd_block_k=64) == ft.BlockSizes(
      64, 64, num_warps=4, num_stages=3, bwd_num_warps=4, bwd_num_stages=2, dkv_q_chunk=32,
      dq_k_chunk=32, bwd_block_q=128, bwd_block_k=64)


def test_table_choice_and_fallback():
  assert tuning.table_file("NVIDIA H200") == "nvidia_h200.json"
  for kind in ("cpu", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "TPU v5 lite"):
    assert tuning.table_file(kind) == tuning.GENERIC_TABLE
  assert tuning.device_kind() is tuning.device_kind()  # cached
  assert tuning.entry("triton_fwd", 128, "16bit", mask="causal", device="cpu")["mask"] == "all"
  assert tuning.entry("triton_fwd", 512, "16bit", device="cpu") is None
  assert tuning.entry("mosaic_gpu_fwd", 128, "16bit",
                      device="NVIDIA H200")["provenance"]["run"] == "run 10"


def test_tables_well_formed():
  names = {tuning.GENERIC_TABLE, *tuning.DEVICE_TABLES.values()}
  assert names == {f for f in os.listdir(os.path.dirname(tuning.__file__))
                   if f.endswith(".json")}
  root = os.path.dirname(os.path.dirname(os.path.dirname(tuning.__file__)))
  for name in names:
    with open(os.path.join(os.path.dirname(tuning.__file__), name)) as f:
      data = json.load(f)
    assert data["device_kinds"] == [k for k, v in tuning.DEVICE_TABLES.items() if v == name]
    table = tuning.load_table(name)
    assert {k[0] for k in table} == set(tuning.KERNELS)
    for key, e in table.items():
      assert key[3] == "all"  # no mask-specific tuning yet
      prov = e["provenance"]
      assert prov["status"] in ("tuned", "untimed"), key
      assert prov["commit"]
      if prov["status"] == "tuned":
        for field in ("run", "date", "device", "command", "results"):
          assert prov[field], (key, field)
        for path in prov["results"].split("; "):
          assert os.path.exists(os.path.join(root, path)), path
    # every 16-bit Triton and Mosaic D128 entry is tuned; the other head dims are not
    assert {k for k, e in table.items() if e["provenance"]["status"] == "tuned"} == {
        ("triton_fwd", 128, "16bit", "all"), ("triton_bwd", 128, "16bit", "all"),
        ("mosaic_gpu_fwd", 128, "16bit", "all")}
  assert set(ft._FWD_FIELDS) | set(ft._BWD_FIELDS) == set(ft.BlockSizes.__dataclass_fields__)


def test_tables_ship_as_package_data():
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, "pyproject.toml"), "rb") as f:
    cfg = tomllib.load(f)
  assert "*.json" in cfg["tool"]["setuptools"]["package-data"]["pallas_kernels.tuning"]
