"""Tuned kernel configs kept as data, one JSON table per device (``device_kinds``, ``entries``
keyed by kernel, head dim, dtype class and mask kind, each with ``params`` and ``provenance``),
and the device they key on. Which table a device reads: docs/design.md, "How a call is planned"."""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import re

__all__ = ["DEVICE_TABLES", "GENERIC_TABLE", "KERNELS", "MASK_KINDS", "USER_DIR_ENV", "Device",
           "device", "device_kind", "dtype_class", "entry", "mask_kind", "params",
           "required_params", "table_file", "table_name", "load_table"]

GENERIC_TABLE = "generic.json"
USER_DIR_ENV = "JATTN_TUNING_DIR"
KERNELS = ("triton_fwd", "triton_bwd", "mosaic_gpu_fwd", "mosaic_gpu_bwd")
# "block_sparse": calls walking a block schedule (Mosaic GPU backward only).
MASK_KINDS = ("all", "dense", "causal", "window", "causal_window", "causal_segments",
              "block_sparse")
_DIR = os.path.dirname(os.path.abspath(__file__))
# Hopper parts by device kind (H100, H200, H800, H20, GH200): compute capability 9.0.
_SM90_KIND = re.compile(r"\bG?H(100|200|800|20)\b")


def _kinds_of(folder: str) -> dict:
  """{device kind: table path or package file name} of the tables in a folder."""
  out = {}
  for name in sorted(os.listdir(folder)):
    if name.endswith(".json") and name != GENERIC_TABLE:
      with open(os.path.join(folder, name)) as f:
        kinds = json.load(f).get("device_kinds", [])
      out.update({k: name if folder == _DIR else os.path.join(folder, name) for k in kinds})
  return out


# jax device_kind -> package table file (each table lists the kinds it was tuned on).
DEVICE_TABLES = _kinds_of(_DIR)


@functools.lru_cache(maxsize=None)
def device_kind() -> str | None:
  """The current device's kind, whose table the kernels read.

  Returns:
    ``jax.devices()[0].device_kind`` (cached for the process; None if jax has no device).

  Example:
    >>> isinstance(device_kind(), str)
    True
  """
  import jax
  try:
    return jax.devices()[0].device_kind
  except RuntimeError:
    return None


@dataclasses.dataclass(frozen=True)
class Device:
  """The device a call is planned for: what dispatch and the tables key on.

  Attributes:
    platform: "cpu", "gpu" or "tpu".
    kind: jax's ``device_kind`` (the tables' key), or None without a device.
    compute_capability: (major, minor) of a GPU, or None.
    core_count: multiprocessors of a GPU, or None where unknown (a described device).

  Example:
    >>> d = device(kind="NVIDIA H200")
    >>> d.platform, d.compute_capability, d.sm90, d.table
    ('gpu', (9, 0), True, 'nvidia_h200.json')
  """
  platform: str
  kind: str | None
  compute_capability: tuple[int, int] | None = None
  core_count: int | None = None

  def __post_init__(self):
    cc = self.compute_capability
    if cc is not None and not (isinstance(cc, tuple) and len(cc) == 2
                               and all(isinstance(x, int) for x in cc)):
      raise ValueError(f"compute_capability must be None or a (major, minor) tuple of ints "
                       f"such as (9, 0), got {cc!r}")

  @property
  def sm90(self) -> bool:
    """Hopper (compute capability 9.0): where the Mosaic GPU kernels run."""
    return self.platform == "gpu" and self.compute_capability == (9, 0)

  @property
  def table(self) -> str:
    """The table file this device reads (:func:`table_file`)."""
    return table_file(self.kind)


def device(platform: str | None = None, kind: str | None = None) -> Device:
  """The current device, or one described by overrides.

  Args:
    platform: "cpu", "gpu" or "tpu" (default: ``kind``'s if it names one, else jax's backend).
    kind: a jax ``device_kind`` (default: the current device's); another device's gets the
      compute capability its name implies (9.0 for Hopper, else None) and no core count.

  Returns:
    A :class:`Device`.

  Example:
    >>> device(kind="NVIDIA A100-SXM4-80GB").table
    'generic.json'
    >>> device("gpu", "NVIDIA A100-SXM4-80GB").sm90
    False
  """
  from pallas_kernels import compat
  here = device_kind()
  if kind is None or kind == here:
    platform = platform or compat.default_backend()
    gpu = platform == "gpu"
    return Device(platform, here, compat.gpu_compute_capability() if gpu else None,
                  compat.gpu_core_count() if gpu else None)
  if platform is None:
    platform = ("gpu" if kind.startswith("NVIDIA") else "tpu" if "TPU" in kind
                else compat.default_backend())
  return Device(platform, kind, (9, 0) if platform == "gpu" and _SM90_KIND.search(kind) else None)


def dtype_class(dtype) -> str:
  """The dtype key of the tables.

  Args:
    dtype: an input dtype.

  Returns:
    "16bit" for bf16/fp16 (and narrower), "32bit" for fp32 and wider.

  Example:
    >>> dtype_class("bfloat16"), dtype_class("float32")
    ('16bit', '32bit')
  """
  import numpy as np
  return "32bit" if np.dtype(dtype).itemsize >= 4 else "16bit"


def table_name(kind: str) -> str:
  """The file name of a device kind's table, as the tuning command writes it.

  Args:
    kind: a jax ``device_kind``.

  Returns:
    The kind in lower case, runs of other characters as "_", with ".json".

  Example:
    >>> table_name("NVIDIA H100 80GB HBM3")
    'nvidia_h100_80gb_hbm3.json'
  """
  return re.sub(r"[^a-z0-9]+", "_", kind.lower()).strip("_") + ".json"


def _nearest(kind: str) -> str | None:
  """The package table of the architecture nearest to a kind without one (Hopper only)."""
  m = _SM90_KIND.search(kind)
  if not m:
    return None
  model = "200" if m.group(1) == "200" else "100"   # GH200 parts: the H200's; others: the H100's
  same = [(h.group(1), v) for k, v in DEVICE_TABLES.items() if (h := _SM90_KIND.search(k))]
  return next((v for g, v in same if g == model), same[0][1] if same else None)


def table_file(kind: str | None = None) -> str:
  """The table a device reads: one listing its kind in ``$JATTN_TUNING_DIR``, else in the
  package (``DEVICE_TABLES``), else the nearest Hopper table (GH200: the H200's, else the
  H100's), else ``generic.json``.

  Args:
    kind: a jax ``device_kind`` (default: the current device's).

  Returns:
    A file name in this package, or a path in ``$JATTN_TUNING_DIR``.

  Example:
    >>> table_file("NVIDIA H200"), table_file("cpu")
    ('nvidia_h200.json', 'generic.json')
  """
  kind, user = resolve_kind(kind), os.environ.get(USER_DIR_ENV)
  if kind is None:
    return GENERIC_TABLE
  found = user and os.path.isdir(user) and _kinds_of(user).get(kind)
  return found or DEVICE_TABLES.get(kind) or _nearest(kind) or GENERIC_TABLE


def resolve_kind(kind: str | None) -> str | None:
  """``kind``, or the current device's (:func:`device_kind`) when None: the kernels' cache key."""
  return device_kind() if kind is None else kind


@functools.lru_cache(maxsize=None)
def load_table(name: str) -> dict:
  """One table file, parsed and checked (cached: do not mutate the result).

  Args:
    name: a file name in this package, or a path (e.g. a candidate table).

  Returns:
    {(kernel, head_dim, dtype, mask): entry}, entry being the JSON object (params, provenance).

  Example:
    >>> ("triton_bwd", 128, "16bit", "all") in load_table("nvidia_h200.json")
    True
  """
  with open(os.path.join(_DIR, name)) as f:
    data = json.load(f)
  if data.get("format") != 1:
    raise ValueError(f"{name}: unknown tuning table format {data.get('format')!r}")
  out = {}
  for e in data["entries"]:
    key = (e["kernel"], int(e["head_dim"]), e["dtype"], e.get("mask", "all"))
    if key[0] not in KERNELS or key[2] not in ("16bit", "32bit") or key[3] not in MASK_KINDS:
      raise ValueError(f"{name}: bad entry key {key}")
    if key in out:
      raise ValueError(f"{name}: duplicate entry {key}")
    out[key] = e
  return out


@functools.lru_cache(maxsize=None)
def _merged(name: str) -> dict:
  return {**load_table(GENERIC_TABLE), **load_table(name)}


def entry(kernel: str, head_dim: int, dtype_cls: str, mask: str = "all",
          device: str | None = None) -> dict | None:
  """The table entry for a key on a device (the mask kind's own, else "all").

  Args:
    kernel, head_dim, dtype_cls, mask: one of ``KERNELS``, the head dim (padded to a power of
      two >= 32 for Triton), "16bit" or "32bit" (``dtype_class``), one of ``MASK_KINDS``.
    device: a jax ``device_kind`` (default: the current device's).

  Returns:
    The entry (a dict with kernel, head_dim, dtype, mask, params, provenance), or None.

  Example:
    >>> [entry("mosaic_gpu_fwd", 128, "16bit", m, "NVIDIA H200")["params"]["protocol"]
    ...  for m in ("all", "causal")]
    ['handoff_kwait_fence', 'overlap']
  """
  table, key = _merged(table_file(device)), (kernel, int(head_dim), dtype_cls)
  return table.get((*key, mask)) or table.get((*key, "all"))   # entries are non-empty dicts


def params(kernel: str, head_dim: int, dtype_cls: str, mask: str = "all",
           device: str | None = None) -> dict | None:
  """The ``BlockSizes`` fields of a table entry.

  Args:
    kernel, head_dim, dtype_cls, mask, device: as for ``entry``.

  Returns:
    A new dict of ``BlockSizes`` fields, or None if there is no entry.

  Example:
    >>> params("mosaic_gpu_fwd", 128, "16bit", device="cpu")["block_k"]
    128
  """
  e = entry(kernel, head_dim, dtype_cls, mask, device)
  return None if e is None else dict(e["params"])


def mask_kind(causal: bool, window=None, segments: bool = False) -> str:
  """The tables' mask key of an attention call.

  Args:
    causal, segments: the call's causal flag, and whether it has segment ids (either side).
    window: None or a (left, right) local window (either side may be None: unbounded).

  Returns:
    "dense", "causal", "window", "causal_window", or "causal_segments" (causal with segment
    ids and no window).

  Example:
    >>> mask_kind(True, (511, 0)), mask_kind(False, None), mask_kind(True, None, segments=True)
    ('causal_window', 'dense', 'causal_segments')
  """
  if window is not None and tuple(window) != (None, None):
    return "causal_window" if causal else "window"
  return ("causal_segments" if segments else "causal") if causal else "dense"


def required_params(kernel: str, head_dim: int, dtype_cls: str,
                    device: str | None = None, mask: str = "all") -> dict:
  """``params``, raising KeyError (naming the table file) when there is no entry.

  Args:
    kernel, head_dim, dtype_cls, device, mask: as for ``entry``.

  Returns:
    A new dict of ``BlockSizes`` fields.

  Example:
    >>> required_params("mosaic_gpu_fwd", 128, "16bit", device="cpu")["block_k"]
    128
  """
  kind = resolve_kind(device)
  p = params(kernel, head_dim, dtype_cls, mask, device=kind)
  if p is None:
    raise KeyError(f"no {kernel} tuning entry for head_dim {head_dim} on {kind!r} "
                   f"({table_file(kind)})")
  return p
