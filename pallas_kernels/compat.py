"""The one place that knows about differences between supported jax versions (0.10.x on the CPU
machines, 0.11.x on the GPU ones): every API whose spelling moved between them goes through here.
"""
from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl

JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())


def triton_compiler_params(num_warps: int | None = None, num_stages: int | None = None):
  """Compiler params for the Pallas Triton (portable GPU) lowering.

  Args:
    num_warps, num_stages: warps per program and software pipelining depth (None: default).

  Returns:
    An object to pass as ``compiler_params=`` to ``pl.pallas_call``.

  Example:
    >>> params = triton_compiler_params(num_warps=4, num_stages=2)
  """
  from jax.experimental.pallas import triton as plgpu_triton
  kwargs = dict(num_warps=num_warps, num_stages=num_stages)
  return plgpu_triton.CompilerParams(**{k: v for k, v in kwargs.items() if v is not None})


def tpu_compiler_params(dimension_semantics=None, **kwargs):
  """Compiler params for the Mosaic TPU lowering.

  Args:
    dimension_semantics: a tuple of "parallel"/"arbitrary" per grid axis, or None.
    **kwargs: passed through (for example ``vmem_limit_bytes``).

  Returns:
    An object to pass as ``compiler_params=`` to ``pl.pallas_call``.

  Example:
    >>> params = tpu_compiler_params(("parallel", "arbitrary"))
  """
  from jax.experimental.pallas import tpu as pltpu
  if dimension_semantics is not None:
    kwargs["dimension_semantics"] = tuple(dimension_semantics)
  return pltpu.CompilerParams(**kwargs)


def tpu_interpret_params():
  """The ``interpret=`` value that runs a Mosaic TPU kernel on the CPU.

  Returns:
    ``pltpu.InterpretParams()``.

  Example:
    >>> p = tpu_interpret_params()
  """
  from jax.experimental.pallas import tpu as pltpu
  return pltpu.InterpretParams()


@functools.lru_cache(maxsize=None)
def default_backend() -> str:
  """The platform of the default jax backend: "cpu", "gpu" or "tpu".

  Returns:
    The platform name.

  Example:
    >>> default_backend() in ("cpu", "gpu", "tpu")
    True
  """
  return jax.default_backend()


@functools.lru_cache(maxsize=None)
def gpu_compute_capability() -> tuple[int, int] | None:
  """The (major, minor) compute capability of the first GPU, or None without one.

  Returns:
    A tuple such as (9, 0) on Hopper, or None.

  Example:
    >>> cc = gpu_compute_capability()
  """
  cc = getattr(_first_gpu(), "compute_capability", None)
  if cc is None:
    return None
  major, minor = str(cc).split(".")[:2]
  return int(major), int(minor)


@functools.lru_cache(maxsize=None)
def gpu_core_count() -> int:
  """Number of streaming multiprocessors of the first GPU (132 on an H200), 1 without a GPU.

  Returns:
    The multiprocessor count.

  Example:
    >>> gpu_core_count() >= 1
    True
  """
  dev = _first_gpu()
  return 1 if dev is None else int(getattr(dev, "core_count", 0) or 132)


def _first_gpu():
  try:
    return jax.devices("gpu")[0]
  except RuntimeError:
    return None


@functools.lru_cache(maxsize=None)
def _mosaic_gpu_load_takes_index() -> bool:
  import inspect
  from jax.experimental.pallas import mosaic_gpu as plgpu
  idx = inspect.signature(plgpu.load).parameters.get("idx")
  return idx is not None and idx.default is inspect.Parameter.empty


def mosaic_gpu_load(ref, *, layout=None):
  """Load a whole (already indexed) Mosaic GPU shared-memory ref into an array, in a kernel body
  (``plgpu.load`` gets the index ``()`` only on jax 0.10.x, which requires it).

  Args:
    ref, layout: a Mosaic GPU ref (e.g. ``smem.at[slot]``) and the result's register layout
      (``plgpu.Layout...``) or None.

  Returns:
    The loaded array.

  Example (inside a ``plgpu.kernel`` body)::

    lse = mosaic_gpu_load(lse_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(1))
  """
  from jax.experimental.pallas import mosaic_gpu as plgpu
  if _mosaic_gpu_load_takes_index():
    return plgpu.load(ref, (), layout=layout)
  return plgpu.load(ref, layout=layout)


__all__ = ["JAX_VERSION", "pl", "triton_compiler_params", "tpu_compiler_params",
           "tpu_interpret_params", "default_backend", "gpu_compute_capability", "gpu_core_count",
           "mosaic_gpu_load"]
