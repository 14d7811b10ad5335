"""Tuning tables (pallas_kernels/tuning): the loaded defaults are bit-identical to the constants
they replaced (commit 061afb8) on this machine, on an H200 and on any other device, except the
entries retuned since by a recorded sweep (H200 Mosaic GPU backward D128: 3 dK/dV stages, run 25;
H200 Triton backward for 16-bit head dims 129-256: 128-row dQ tiles, 32-row steps, run 29)."""
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
# The H200 table's forward protocols on top of those tiles.
H200_MOSAIC_OPTIONS = {
    64: dict(protocol="pingpong_kwait"),
    128: dict(protocol="handoff_kwait_fence"),
    256: dict(protocol="handoff_kwait"),
}
H200_MOSAIC_OVERLAP = dict(protocol="overlap")
# the H200's D64 dense and causal entries: 256-key tiles, 3 stages
H200_MOSAIC_D64_BK256 = dict(block_k=256, num_stages=3, protocol="pingpong_kwait")
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
      want = TRITON_BEFORE[key]
      if device == "NVIDIA H200" and key == (256, 2):  # retuned backward (run 29)
        want = dataclasses.replace(want, bwd_block_q=128, bwd_block_k=64, dkv_q_chunk=32,
                                   dq_k_chunk=32)
      assert _same(got, want), (device, head_dim, dtype)
  with pytest.raises(ValueError):
    ft.default_block_sizes(512, jnp.bfloat16, device_kind=device)


@pytest.mark.parametrize("device", DEVICES)
def test_mosaic_default_block_sizes_unchanged(device):
  for dtype in (jnp.bfloat16, jnp.float16):
    for head_dim, want in MOSAIC_BEFORE.items():
      if device == "NVIDIA H200":
        want = dataclasses.replace(want, **H200_MOSAIC_OPTIONS[head_dim])
      assert _same(mg.default_block_sizes(head_dim, dtype, device_kind=device), want)
    for head_dim, want in MOSAIC_BWD_BEFORE.items():
      if device == "NVIDIA H200" and head_dim == 128:  # retuned from the run-25 sweep
        want = dataclasses.replace(want, num_stages_dkv=3)
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
  assert tuning.entry("mosaic_gpu_fwd", 128, "16bit", device="NVIDIA H200")["params"][
      "protocol"] == "handoff_kwait_fence"


def test_mask_kind_and_mask_entries():
  assert [tuning.mask_kind(c, w) for c, w in [(False, None), (True, None), (True, (511, 0)),
                                              (False, (100, 30)), (True, (None, None))]] == [
      "dense", "causal", "causal_window", "window", "causal"]
  # segment ids change only the causal kind without a window
  assert [tuning.mask_kind(c, w, segments=True) for c, w in [
      (False, None), (True, None), (True, (511, 0)), (False, (100, 30))]] == [
      "dense", "causal_segments", "causal_window", "window"]
  # the H200's causal-window entry (run 38: fence; run 81: back to 128-key tiles with the edge
  # masks, 64 since run 33), packed documents
  # (run 61: the overlap; run 71: one_segment_static_mask) and causal (runs 55-56: the
  # overlap); every other kind and device: "all"
  got = mg.default_block_sizes(128, device_kind="NVIDIA H200", mask="causal_window")
  assert _same(got, dataclasses.replace(MOSAIC_BEFORE[128], **H200_MOSAIC_OVERLAP,
                                        q_tiles_per_program=2))   # runs 82, 85
  got = mg.default_block_sizes(128, device_kind="NVIDIA H200", mask="causal_segments")
  assert _same(got, dataclasses.replace(MOSAIC_BEFORE[128], **H200_MOSAIC_OVERLAP,
                                        one_segment_static_mask=True))   # run 71
  for kind in ("all", "window"):     # fence (run 37), tokamax's K wait + handoff (44)
    assert _same(mg.default_block_sizes(128, device_kind="NVIDIA H200", mask=kind),
                 dataclasses.replace(MOSAIC_BEFORE[128], **H200_MOSAIC_OPTIONS[128]))
  # dense and causal at D128 and D256: FA3's intra-warpgroup overlap (runs 55-56); dense also
  # the last wave by key chunks (run 74; jattn applies it through fit_tail_kv_splits)
  for head_dim in (128, 256):
    for kind in ("dense", "causal"):
      tail = dict(tail_kv_splits=8) if kind == "dense" else {}
      assert _same(mg.default_block_sizes(head_dim, device_kind="NVIDIA H200", mask=kind),
                   dataclasses.replace(MOSAIC_BEFORE[head_dim], **H200_MOSAIC_OVERLAP, **tail))
  for kind in ("dense", "causal"):   # D64: 256-key tiles (runs 60-61)
    assert _same(mg.default_block_sizes(64, device_kind="NVIDIA H200", mask=kind),
                 dataclasses.replace(MOSAIC_BEFORE[64], **H200_MOSAIC_D64_BK256))
  for head_dim in (64, 256):
    for kind in tuning.MASK_KINDS:
      if kind in ("dense", "causal"):
        continue
      assert _same(mg.default_block_sizes(head_dim, device_kind="NVIDIA H200", mask=kind),
                   dataclasses.replace(MOSAIC_BEFORE[head_dim], **H200_MOSAIC_OPTIONS[head_dim]))
  for kind in tuning.MASK_KINDS:
    assert _same(mg.default_block_sizes(128, device_kind="cpu", mask=kind), MOSAIC_BEFORE[128])
  assert tuning.required_params("mosaic_gpu_fwd", 128, "16bit", "NVIDIA H200",
                                "causal_window")["block_k"] == 128


def test_flash_attention_asks_for_the_mask_kinds_tiles(monkeypatch):
  """jattn.flash_attention(implementation="mosaic_gpu") passes the mask kind to the tile
  lookup: on an H200 a causal window gets the 64-key tiles with the softmax fence, packed
  documents (causal with segment ids) the 128-key ones with the overlap, a non-causal mask
  with segment ids the "dense" entry, i.e. the intra-warpgroup overlap as causal and dense
  masks."""
  import jax
  import jattn

  class Stop(Exception):
    pass

  seen = []

  def fake_forward(*args, block_sizes, **kwargs):
    seen.append(block_sizes)
    raise Stop

  monkeypatch.setattr(tuning, "device_kind", lambda: "NVIDIA H200")
  monkeypatch.setattr(mg, "flash_attention", fake_forward)
  mg._tuned_block_sizes.cache_clear()
  try:
    x = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
    seg = jnp.ones((1, 256), jnp.int32)
    for kw in (dict(causal=True, local_window_size=(511, 0)), dict(causal=True),
               dict(causal=True, segment_ids=seg), dict(causal=False, segment_ids=seg),
               dict(causal=False)):
      with pytest.raises(Stop):
        jattn.flash_attention(x, x, x, implementation="mosaic_gpu", **kw)
  finally:
    mg._tuned_block_sizes.cache_clear()
  assert [(b.block_k, b.protocol) for b in seen] == [(128, "overlap")] * 5


def test_tables_well_formed():
  names = {tuning.GENERIC_TABLE, *tuning.DEVICE_TABLES.values()}
  assert names == {f for f in os.listdir(os.path.dirname(tuning.__file__))
                   if f.endswith(".json")}
  for name in names:
    with open(os.path.join(os.path.dirname(tuning.__file__), name)) as f:
      data = json.load(f)
    assert data["device_kinds"] == [k for k, v in tuning.DEVICE_TABLES.items() if v == name]
    table = tuning.load_table(name)
    assert {k[0] for k in table} == set(tuning.KERNELS)
    for key, e in table.items():
      # mask-specific tuning so far: the H200 Mosaic forward's causal window (runs 33, 38),
      # packed documents (runs 38, 61), causal and dense (runs 41-61); the Mosaic backward's
      # D64 causal window (run 110)
      assert key[3] == "all" or (name, key) in {
          ("nvidia_h200.json", ("mosaic_gpu_fwd", 128, "16bit", m))
          for m in ("causal_window", "causal_segments", "causal", "dense")} | {
          ("nvidia_h200.json", ("mosaic_gpu_fwd", d, "16bit", m))
          for d in (64, 256) for m in ("causal", "dense")} | {
          ("nvidia_h200.json", ("mosaic_gpu_bwd", 64, "16bit", "causal_window")),
          ("nvidia_h200.json", ("mosaic_gpu_bwd", 128, "16bit", "block_sparse"))}, key
      prov = e["provenance"]
      assert prov["status"] in ("tuned", "untimed"), key
      assert prov["commit"]
      if prov["status"] == "tuned":
        for field in ("date", "device", "command"):
          assert prov[field], (key, field)
    # every 16-bit Triton and Mosaic D128 entry is tuned; of the other head dims the H200's
    # Triton D256 backward and Mosaic D64 / D256 forwards
    assert {k for k, e in table.items() if e["provenance"]["status"] == "tuned"} == {
        ("triton_fwd", 128, "16bit", "all"), ("triton_bwd", 128, "16bit", "all"),
        ("mosaic_gpu_fwd", 128, "16bit", "all")} | (
            {("mosaic_gpu_bwd", 128, "16bit", "all"), ("triton_bwd", 256, "16bit", "all"),
             ("mosaic_gpu_fwd", 128, "16bit", "causal_window"),
             ("mosaic_gpu_fwd", 128, "16bit", "causal_segments"),
             ("mosaic_gpu_fwd", 128, "16bit", "causal"),
             ("mosaic_gpu_fwd", 128, "16bit", "dense"),
             ("mosaic_gpu_fwd", 256, "16bit", "causal"), ("mosaic_gpu_fwd", 256, "16bit", "dense"),
             ("mosaic_gpu_fwd", 64, "16bit", "causal"), ("mosaic_gpu_fwd", 64, "16bit", "dense"),
             ("mosaic_gpu_fwd", 64, "16bit", "all"), ("mosaic_gpu_fwd", 256, "16bit", "all"),
             ("mosaic_gpu_bwd", 64, "16bit", "causal_window"),
             ("mosaic_gpu_bwd", 128, "16bit", "block_sparse")}
            if name == "nvidia_h200.json" else set())
  assert set(ft._FWD_FIELDS) | set(ft._BWD_FIELDS) == set(ft.BlockSizes.__dataclass_fields__)


def test_tables_ship_as_package_data():
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, "pyproject.toml"), "rb") as f:
    cfg = tomllib.load(f)
  assert "*.json" in cfg["tool"]["setuptools"]["package-data"]["pallas_kernels.tuning"]
