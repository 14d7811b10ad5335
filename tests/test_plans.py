"""The plans return what the calls run: the configs the kernel entry points receive are the
plan's, for flash and block-sparse attention (CPU: Triton and Mosaic TPU in interpret mode; a
simulated Hopper GPU with fake Mosaic GPU kernels)."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
import jattn.attention as api
import jattn.sparse.attention as sparse_api
from pallas_kernels import compat, tuning
from pallas_kernels.flash import mosaic_gpu as mg
from pallas_kernels.flash import mosaic_tpu as mt
from pallas_kernels.flash import triton as ft


def _rand(key, shape, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(key).standard_normal(shape, np.float32).astype(dtype))


def _traced(f, *args):
  """f(*args) traced, not run: the kernel entry points receive their configs while tracing."""
  return jax.eval_shape(f, *args)


def _select(q, k, **kw):
  """``jattn.select_blocks`` as one jitted program."""
  return jax.jit(functools.partial(jattn.select_blocks, **kw))(q, k)


def _recorder(seen):
  """A kernel entry point that records its configs and returns zeros of the right shapes."""
  def kernel(q, k, v, q_seg, kv_seg, schedule=None, *, block_sizes=None, bwd_block_sizes=None,
             **kw):
    seen.append(dict(block_sizes=block_sizes, bwd_block_sizes=bwd_block_sizes,
                     tiles=None if schedule is None else (schedule.block_q, schedule.block_k)))
    b, sq, hq, _ = q.shape
    return jnp.zeros((b, sq, hq, v.shape[-1]), q.dtype), jnp.zeros((b, hq, sq), jnp.float32)
  return kernel


@pytest.fixture
def hopper(monkeypatch):
  """This process seen as an H200 (sm90, 132 multiprocessors)."""
  monkeypatch.setattr(tuning, "device_kind", lambda: "NVIDIA H200")
  monkeypatch.setattr(compat, "default_backend", lambda: "gpu")
  monkeypatch.setattr(compat, "gpu_compute_capability", lambda: (9, 0))
  monkeypatch.setattr(compat, "gpu_core_count", lambda: 132)


@pytest.fixture
def one_resolution(monkeypatch):
  """Counts the calls of the one resolution (both op families reach it)."""
  calls = []
  real = api.resolve

  def spy(op, *a, **kw):
    calls.append(op)
    return real(op, *a, **kw)

  monkeypatch.setattr(api, "resolve", spy)
  monkeypatch.setattr(sparse_api, "resolve", spy)
  return calls


FLASH_CALLS = [dict(causal=True), dict(causal=False),
               dict(causal=True, local_window_size=(31, 0)),
               dict(causal=True, segment_ids=jnp.asarray([[1] * 40 + [2] * 24], jnp.int32))]


@pytest.mark.parametrize("call", FLASH_CALLS)
def test_flash_triton_runs_its_plan(monkeypatch, one_resolution, call):
  seen = []
  monkeypatch.setattr(ft, "flash_attention", _recorder(seen))
  q, k = _rand(0, (1, 64, 4, 32)), _rand(1, (1, 64, 2, 32))
  kw = dict(call, implementation="triton", interpret=True)
  _traced(lambda q, k: jattn.flash_attention(q, k, k, **kw), q, k)
  plan = jattn.flash_attention_plan(q, k, k, **kw)
  assert one_resolution == ["flash", "flash"]
  assert (plan.implementation, plan.backward, plan.table) == ("triton", "triton",
                                                              tuning.table_file())
  assert seen == [dict(block_sizes=plan.config, bwd_block_sizes=None,
                       tiles=(plan.config.block_q, plan.config.block_k))]
  assert plan.backward_config == plan.config


def test_flash_mosaic_tpu_runs_its_plan(monkeypatch):
  seen = []
  monkeypatch.setattr(mt, "flash_attention", _recorder(seen))
  q = _rand(0, (1, 300, 2, 64))
  _traced(lambda q: jattn.flash_attention(q, q, q, causal=True, implementation="mosaic_tpu",
                                          interpret=True), q)
  plan = jattn.flash_attention_plan(q, q, q, causal=True, implementation="mosaic_tpu")
  assert plan.table is None   # a heuristic default, no table
  assert seen[0]["tiles"] == (plan.config.block_q, plan.config.block_k)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("call", FLASH_CALLS + [dict(causal=True, logits_soft_cap=30.0)])
def test_flash_hopper_default_runs_its_plan(monkeypatch, hopper, one_resolution, d, call):
  """implementation=None on a (simulated) H200: the forward and backward configs the Mosaic GPU
  entry point receives are the plan's, read from the H200 table and fitted to the call."""
  seen = []
  monkeypatch.setattr(mg, "flash_attention", _recorder(seen))
  q = jnp.zeros((1, 64, 2, d), jnp.bfloat16)
  _traced(lambda q: jattn.flash_attention(q, q, q, **call), q)
  plan = jattn.flash_attention_plan(q, q, q, **call)
  assert one_resolution == ["flash", "flash"]
  assert (plan.implementation, plan.table, plan.device_kind) == (
      "mosaic_gpu", "nvidia_h200.json", "NVIDIA H200")
  assert plan.backward == ("triton" if d == 256 else "mosaic_gpu")
  assert seen == [dict(block_sizes=plan.config, bwd_block_sizes=plan.backward_config,
                       tiles=None)]
  # the same plan when the device is described instead of simulated
  monkeypatch.undo()
  assert jattn.flash_attention_plan(q, q, q, device_kind="NVIDIA H200", **call) == plan


def test_flash_hopper_plan_fits_the_tail_to_the_call(monkeypatch, hopper):
  """The fit step belongs to the plan: the dense table entry's last-wave option is kept for a
  call whose last wave is short (16 programs on 15 multiprocessors), dropped for a call whose
  waves are full (120 programs)."""
  seen = []
  monkeypatch.setattr(mg, "flash_attention", _recorder(seen))
  monkeypatch.setattr(compat, "gpu_core_count", lambda: 15)
  table = mg.default_block_sizes(128, mask="dense")
  for heads, tail in ((2, table.tail_kv_splits), (15, 0)):
    q = jnp.zeros((1, 1024, heads, 128), jnp.bfloat16)
    plan = jattn.flash_attention_plan(q, q, q)
    fitted = mg.fit_block_sizes(table, q.shape, q.shape, core_count=15)
    assert plan.config == dataclasses.replace(fitted, backward="mosaic")
    assert plan.config.tail_kv_splits == tail
    _traced(lambda q: jattn.flash_attention(q, q, q), q)
    assert seen[-1]["block_sizes"] == plan.config


def test_flash_hopper_mask_runs_mosaic_on_uniform_tiles(monkeypatch, hopper):
  """A mask on a (simulated) H200: the plan is Mosaic GPU on the schedule of the mask's visible
  128 x 128 tiles with a Triton fallback; on device, a mask uniform on every tile (the edge tiles
  are cut at 300) runs the Mosaic kernel, one with a mixed tile the fallback."""
  seen = []
  monkeypatch.setattr(mg, "flash_attention", _recorder(seen))
  fallback = _recorder(seen)
  monkeypatch.setattr(ft, "flash_attention",
                      lambda *a, **kw: tuple(x + 1 for x in fallback(*a, **kw)))
  q = jnp.zeros((1, 300, 4, 64), jnp.bfloat16)
  tiles = jnp.asarray([[1, 0, 1], [0, 1, 1], [1, 1, 0]], bool)
  aligned = jnp.repeat(jnp.repeat(tiles, 128, 0), 128, 1)[None, None, :300, :300]
  plan = jattn.flash_attention_plan(q, q, q, causal=True, mask=aligned)
  assert (plan.implementation, plan.fallback.implementation) == ("mosaic_gpu", "triton")
  assert jattn.flash_attention_plan(q, q, q, mask=aligned, bias=jnp.zeros(aligned.shape)
                                    ).implementation == "triton"
  q256 = jnp.zeros((1, 300, 4, 256), jnp.bfloat16)   # the Mosaic GPU backward's head dims only
  assert jattn.flash_attention_plan(q256, q256, q256, mask=aligned).implementation == "triton"
  run = jax.jit(lambda m: jattn.flash_attention(q, q, q, causal=True, mask=m))
  assert float(run(aligned).max()) == 0.0             # the Mosaic GPU branch
  assert float(run(aligned.at[..., 5, 7].set(False)).min()) == 1.0   # the fallback
  assert seen == [dict(block_sizes=plan.config, bwd_block_sizes=plan.backward_config,
                       tiles=(128, 128)),
                  dict(block_sizes=plan.fallback.config, bwd_block_sizes=None,
                       tiles=(plan.fallback.config.block_q, plan.fallback.config.block_k))]


def test_block_sparse_triton_runs_its_plan(monkeypatch, one_resolution):
  seen = []
  monkeypatch.setattr(ft, "flash_attention", _recorder(seen))
  q, k = _rand(0, (1, 256, 4, 32)), _rand(1, (1, 256, 2, 32))
  sel = _select(q, k, block_size=32, q_block_size=64, top_k=2)
  _traced(lambda q, k: jattn.block_sparse_attention(q, k, k, sel, implementation="triton",
                                                    interpret=True), q, k)
  plan = jattn.block_sparse_plan(q, k, k, sel, implementation="triton", interpret=True)
  assert one_resolution == ["block_sparse", "block_sparse"]
  assert (plan.op, plan.config.block_q, plan.config.block_k) == ("block_sparse", 64, 32)
  assert seen == [dict(block_sizes=plan.config, bwd_block_sizes=None, tiles=(64, 32))]
  # sparse_attention: one plan for the same tiles, run as returned
  seen.clear()
  _traced(lambda q, k: jattn.sparse_attention(q, k, k, block_size=32, q_block_size=64, top_k=2,
                                              gate_grad="ste", implementation="triton",
                                              interpret=True), q, k)
  assert seen == [dict(block_sizes=plan.config, bwd_block_sizes=None, tiles=(64, 32))]


def test_block_sparse_mosaic_tpu_runs_its_plan(monkeypatch):
  seen = []
  monkeypatch.setattr(mt, "flash_attention", _recorder(seen))
  q = _rand(0, (1, 512, 2, 64))
  sel = _select(q, q, block_size=128, q_block_size=128, top_k=1)
  _traced(lambda q: jattn.block_sparse_attention(q, q, q, sel, implementation="mosaic_tpu",
                                                 interpret=True), q)
  plan = jattn.block_sparse_plan(q, q, q, sel, implementation="mosaic_tpu")
  assert (plan.config.block_q, plan.config.block_k) == seen[0]["tiles"] == (128, 128)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_block_sparse_hopper_default_runs_its_plan(monkeypatch, hopper, d):
  seen = []
  monkeypatch.setattr(mg, "flash_attention", _recorder(seen))
  q = jnp.zeros((1, 512, 2, d), jnp.bfloat16)
  seg = jnp.ones((1, 512), jnp.int32)
  sel = _select(q, q, block_size=64, q_block_size=128, top_k=2)
  _traced(lambda q: jattn.block_sparse_attention(q, q, q, sel, segment_ids=seg), q)
  plan = jattn.block_sparse_plan(q, q, q, sel, segment_ids=seg)
  assert (plan.implementation, plan.table) == ("mosaic_gpu", "nvidia_h200.json")
  assert plan.backward == ("triton" if d == 256 else "mosaic_gpu")
  assert plan.config.block_k <= 64 and plan.config.tail_kv_splits == 0
  assert seen == [dict(block_sizes=plan.config, bwd_block_sizes=plan.backward_config,
                       tiles=(128, 64))]


def test_block_sparse_plan_needs_tiles_the_kernels_take():
  x = jax.ShapeDtypeStruct((1, 512, 2, 128), jnp.bfloat16)
  h200 = dict(device_kind="NVIDIA H200")
  assert jattn.block_sparse_plan(x, x, x, q_block_size=32, block_size=64,
                                 **h200).implementation == "triton"
  with pytest.raises(ValueError, match="powers of two >= 64"):
    jattn.block_sparse_plan(x, x, x, q_block_size=32, block_size=64, implementation="mosaic_gpu",
                            **h200)
  with pytest.raises(ValueError, match="powers of two >= 16"):
    jattn.block_sparse_plan(x, x, x, q_block_size=24, block_size=64, implementation="triton")
  with pytest.raises(ValueError, match="selection or q_block_size"):
    jattn.block_sparse_plan(x, x, x)


def test_device_description_is_shared():
  """Dispatch and tables read one description: a device without a table of its own plans with
  the nearest of its architecture or generic.json, and says so."""
  for kind, table, sm90 in (("NVIDIA H200", "nvidia_h200.json", True),
                            ("NVIDIA H800", tuning.table_file("NVIDIA H800"), True),
                            ("NVIDIA A100-SXM4-80GB", "generic.json", False),
                            ("TPU v5 lite", "generic.json", False)):
    dev = tuning.device(kind=kind)
    assert (dev.table, dev.sm90) == (table, sm90), kind
  x = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
  plan = jattn.flash_attention_plan(x, x, x, device_kind="TPU v5 lite")
  assert (plan.implementation, plan.table, plan.device_kind) == ("mosaic_tpu", None,
                                                                 "TPU v5 lite")
