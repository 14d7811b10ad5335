"""Context parallelism: attention over a sequence split across the devices of a mesh axis.

Each (query chunk, key chunk) pair is one :func:`jattn.flash_attention` call on its visible rows
(or skipped), merged by log-sum-exp; layouts and strategies: docs/context_parallel.md.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from jattn._validate import (as_array, check_flags, check_int, check_qkv, check_scale_and_cap,
                             check_segments)
from jattn.attention import flash_attention, flash_attention_plan, kernel_module
from jattn.decode import decode_attention
from jattn.merge import merge, merge_partials
from jattn.sparse import selection as sel_ops
from jattn.sparse.attention import block_sparse_attention
from pallas_kernels.masks import normalize_window

__all__ = ["ContextParallelPlan", "PairCall", "context_parallel_attention",
           "context_parallel_attention_shard", "context_parallel_decode_attention",
           "context_parallel_permute", "context_parallel_plan", "context_parallel_unpermute",
           "layout_positions", "pair_call", "ring_device_forward", "shard_chunks"]

STRATEGIES = ("ring", "all_gather", "ring_q")
LAYOUTS = ("contiguous", "zigzag")


# ----------------------------------------------------------------------------- layouts
def shard_chunks(num_shards, layout):
  """The global chunk ids each device holds, in its local order.

  Args:
    num_shards: devices along the sequence axis (P).
    layout: "contiguous" (chunk i on device i) or "zigzag" (chunks i and 2P-1-i on device i).

  Returns:
    int numpy array [P, m] (m = 1 or 2 chunks per device).

  Example:
    >>> shard_chunks(2, "zigzag").tolist()
    [[0, 3], [1, 2]]
  """
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  check_int("num_shards", num_shards)
  d = np.arange(num_shards)
  return d[:, None] if layout == "contiguous" else np.stack([d, 2 * num_shards - 1 - d], 1)


def layout_positions(seq_len, num_shards, layout):
  """Original positions in the layout's order, padded at the end to ``m * P`` whole chunks:
  slot t of the padded, permuted array holds original position ``result[t]`` (-1: padding).

  Args:
    seq_len: the sequence length.
    num_shards, layout: as :func:`shard_chunks`.

  Returns:
    int numpy array [padded length].

  Example:
    >>> layout_positions(7, 2, "zigzag").tolist()
    [0, 1, 6, -1, 2, 3, 4, 5]
  """
  ids = shard_chunks(num_shards, layout).reshape(-1)
  c = -(-seq_len // ids.size)
  pos = (ids[:, None] * c + np.arange(c)).reshape(-1)
  return np.where(pos < seq_len, pos, -1)


def _reorder(x, num_shards, layout, axis, inverse):
  x = x if hasattr(x, "shape") else as_array("x", x)   # any dtype; lists as numpy
  check_int("axis", axis, -x.ndim, x.ndim - 1)
  pos = layout_positions(x.shape[axis], num_shards, layout)
  idx = np.argsort(pos[pos >= 0]) if inverse else pos[pos >= 0]
  if np.array_equal(idx, np.arange(x.shape[axis])):
    return x
  sharding = jax.typeof(x).sharding
  if any(getattr(sharding, "spec", ())):   # explicitly sharded: gather first
    x = jax.device_put(x, NamedSharding(sharding.mesh, PS()))
  return jnp.take(x, idx, axis=axis)


def context_parallel_permute(x, num_shards, layout="zigzag", axis=1):
  """Reorder a sequence axis into a context-parallel layout (once, e.g. at data loading): tokens,
  positions, segment ids and labels alike. Any length works (padding slots left out).

  Args:
    x, axis: an array and its sequence axis.
    num_shards, layout: as :func:`shard_chunks` (default "zigzag"; "contiguous" is the identity).

  Returns:
    x permuted along ``axis`` (same shape).

  Example:
    >>> context_parallel_permute(jnp.arange(8)[None], 2).tolist()
    [[0, 1, 6, 7, 2, 3, 4, 5]]
  """
  return _reorder(x, num_shards, layout, axis, inverse=False)


def context_parallel_unpermute(x, num_shards, layout="zigzag", axis=1):
  """Inverse of :func:`context_parallel_permute`.

  Args:
    x: array in the layout's order along ``axis``.
    num_shards, layout, axis: as :func:`context_parallel_permute`.

  Returns:
    x in original sequence order.

  Example:
    >>> x = jnp.arange(10)[None]
    >>> bool((context_parallel_unpermute(context_parallel_permute(x, 2), 2) == x).all())
    True
  """
  return _reorder(x, num_shards, layout, axis, inverse=True)


# ----------------------------------------------------------------------------- planning
@dataclasses.dataclass(frozen=True)
class PairCall:
  """One chunk pair's kernel call: query rows [q0, q0+nq), key rows [k0, k0+nk) of the chunks,
  with ``causal`` and ``window`` in the call's own (bottom-right aligned) coordinates.

  Example:
    >>> PairCall(0, 8, 0, 8, True, None)     # a diagonal causal chunk pair
    PairCall(q0=0, nq=8, k0=0, nk=8, causal=True, window=None)
  """
  q0: int
  nq: int
  k0: int
  nk: int
  causal: bool
  window: tuple | None


def pair_call(base, cq, ck, causal, window):
  """The kernel call of a chunk pair, or None when nothing in it is visible.

  Query row i and key row j of the pair sit at global positions ``i + base + x`` and ``j + x``
  (any x), so the mask asks ``s <= j - i <= t``. The call keeps the rows and columns that see
  something; its bottom-right alignment puts the offset ``u`` at its last rows, so the window it
  gets is ``(u - s, t - u)``, never negative.

  Args:
    base: the query chunk's first position minus the key chunk's first position.
    cq, ck: query and key chunk lengths.
    causal: the call's causal flag.
    window: None or a normalized (left, right).

  Returns:
    A :class:`PairCall` or None.

  Example:
    >>> pair_call(8, 8, 8, True, (3, 0))   # the previous chunk under a 4-token window
    PairCall(q0=0, nq=3, k0=5, nk=3, causal=False, window=(0, 3))
  """
  left, right = window or (None, None)
  s = -math.inf if left is None else base - left
  t = math.inf if right is None else base + right
  t = min(t, base) if causal else t
  if s > ck - 1 or t < -(cq - 1) or s > t:
    return None
  if s <= -(cq - 1) and t >= ck - 1:
    return PairCall(0, cq, 0, ck, False, None)
  q0, q1 = int(max(0, -t)), int(min(cq - 1, ck - 1 - s))
  k0, k1 = int(max(0, s)), int(min(ck - 1, cq - 1 + t))
  u = k1 - q1
  le = None if s == -math.inf else int(u - s)
  ri = None if t == math.inf else int(t - u)
  is_causal = ri == 0
  win = None if le is None and (ri is None or is_causal) else (le, 0 if is_causal else ri)
  return PairCall(q0, q1 + 1 - q0, k0, k1 + 1 - k0, is_causal, win)


@dataclasses.dataclass(frozen=True)
class ContextParallelPlan:
  """The static schedule of a context-parallel call.

  Attributes:
    strategy, layout, num_shards: as given.
    q_chunk, kv_chunk: chunk lengths (after padding).
    shifts: the ring shifts that run, ascending (0 = the device's own chunks).
    calls: the distinct kernel calls (:class:`PairCall`).
    table: int numpy array [P, len(shifts), m, m]: for device d, shift index r, local query chunk
      a and key chunk b, 0 (skipped) or 1 + the index of its call.
    kernel_calls: kernel calls over all devices: non-skipped chunk pairs, one for ``joint`` or
      a step's fully visible pairs of one chunk (with segment ids: pair by pair).
    joint: zig-zag pass-KV: the one call over device P-1's adjacent own chunks (P-1 and P) at
      shift 0, in place of their pairs; else None.
    halo: ring, contiguous layout, a window reaching back at most a chunk and never forward:
      the forward (without segment ids) receives only the previous device's last ``halo`` keys
      (the window rounded up to 256, or the chunk) and runs one call over them and its own
      chunk (P calls; "mosaic_gpu" reads them in place); else 0.

  Example:
    >>> context_parallel_plan(64, 64, 2, causal=True).kernel_calls   # 10 chunk pairs
    6
  """
  strategy: str
  layout: str
  num_shards: int
  q_chunk: int
  kv_chunk: int
  shifts: tuple
  calls: tuple
  table: np.ndarray = dataclasses.field(compare=False)
  joint: PairCall | None = None
  halo: int = 0

  def _whole(self, i) -> PairCall | None:
    """The unmasked call over all local rows and keys of step ``i`` if all its pairs are full."""
    m = self.table.shape[-1]
    if m > 1 and all(c and self.calls[c - 1] == _full(self) for c in self.table[:, i].flat):
      return PairCall(0, m * self.q_chunk, 0, m * self.kv_chunk, False, None)
    return None

  @property
  def kernel_calls(self) -> int:
    if self.halo:
      return self.num_shards
    joint = 0 if self.joint is None else np.count_nonzero(self.table[-1, 0]) - 1
    one = lambda i: self._whole(i) or all(_strip(self, i, e) for e in range(self.num_shards))
    return int(sum(self.num_shards if one(i) else np.count_nonzero(self.table[:, i])
                   for i in range(len(self.shifts)))) - int(joint)


def context_parallel_plan(q_len, kv_len, num_shards, *, causal=False, local_window_size=None,
                          strategy="ring", layout="zigzag", selection=None):
  """Which ring shifts and chunk-pair kernel calls a context-parallel call runs.

  Args:
    q_len, kv_len: sequence lengths (before padding).
    num_shards: devices along the sequence axis (P).
    causal, local_window_size, strategy, layout: as :func:`context_parallel_attention`.
    selection: None, or the whole-sequence (original order) :class:`jattn.BlockSelection` of a
      ``sparse_attention(..., mesh=...)`` call: ``kernel_calls`` then leaves out the pairs in
      which no row keeps a block (skipped at run time; ``shifts`` stay those of the mask).

  Returns:
    A :class:`ContextParallelPlan`.

  Example:
    >>> p = context_parallel_plan(4096, 4096, 4, causal=True, local_window_size=(63, 0),
    ...                           layout="contiguous")
    >>> p.shifts, p.halo, p.kernel_calls   # one call per device, 256 keys of the previous one
    ((0, 1), 256, 4)
  """
  for name, n in (("q_len", q_len), ("kv_len", kv_len), ("num_shards", num_shards)):
    check_int(name, n)
  check_flags(causal=causal)
  if strategy not in STRATEGIES:
    raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
  ids = shard_chunks(num_shards, layout)
  n = ids.size
  cq, ck = -(-q_len // n), -(-kv_len // n)
  live, runs = np.ones((n, n), bool), np.zeros(num_shards, bool)
  if selection is not None:   # [query chunk, key chunk]: some row keeps a block
    if (selection.q_len, selection.kv_len) != (q_len, kv_len) or q_len != kv_len:
      raise ValueError(f"selection must be made for (q_len, kv_len) = {(q_len, q_len)}")
    _check_blocks(cq, selection.block_size, selection.q_block_size)
    tm = np.asarray(selection.tile_mask()).any((0, 1))
    tm = np.pad(tm, ((0, n * cq // selection.q_block_size - tm.shape[0]),
                     (0, n * ck // selection.block_size - tm.shape[1])))
    live = tm.reshape(n, -1, n, tm.shape[1] // n).any((1, 3))
  window = normalize_window(local_window_size)
  index = {}   # call -> 1 + its index in the plan's calls
  table = np.zeros((num_shards, num_shards) + ids.shape[1:] * 2, np.int32)
  for d, r in np.ndindex(num_shards, num_shards):
    e = (d - r) % num_shards          # ring/all_gather: K/V of e here; ring_q: Q of e here
    qd, kd = (e, d) if strategy == "ring_q" else (d, e)
    for a, qi in enumerate(ids[qd]):
      for b, ki in enumerate(ids[kd]):
        call = pair_call(kv_len - q_len + qi * cq - ki * ck, cq, ck, causal, window)
        runs[r] |= call is not None
        if call is not None and live[qi, ki]:
          table[d, r, a, b] = index.setdefault(call, len(index) + 1)
  shifts = tuple(int(r) for r in range(num_shards) if runs[r])
  p = num_shards - 1
  joint = (pair_call(kv_len - q_len + p * (cq - ck), 2 * cq, 2 * ck, causal, window)
           if layout == "zigzag" and strategy != "ring_q" and selection is None
           and shifts[:1] == (0,) and table[p, 0].any() else None)
  plan = ContextParallelPlan(strategy, layout, num_shards, cq, ck, shifts, tuple(index),
                             table[:, list(shifts)])
  keep = joint and (joint.q0, joint.nq) == (0, 2 * cq) and not plan._whole(0)
  if (strategy, layout, shifts, window and window[1]) == ("ring", "contiguous", (0, 1), 0) \
      and q_len == kv_len and selection is None and (plan.table[:, 1, 0, 0] > 0).sum() == p:
    return dataclasses.replace(plan, halo=min(ck, -(-window[0] // 256) * 256))   # whole tiles
  return dataclasses.replace(plan, joint=joint) if keep else plan


# ----------------------------------------------------------------------------- one chunk pair
# Static options of every chunk-pair call (hashable: a custom_vjp static argument); blocks: None
# or (block_size, q_block_size) of block-sparse pairs.
_Kernel = collections.namedtuple(
    "_Kernel", "scale logits_soft_cap implementation interpret blocks", defaults=(None,))


def _run_call(call, kern, q, k, v, qs, ks, sel=None):
  """(out [B, nq, H, Dv] in q's dtype, lse fp32 [B, nq, H]) of one PairCall on full chunks; with
  ``sel`` (the pair's :class:`BlockSelection`) the block-sparse kernel on every row."""
  # The barriers keep XLA:GPU's dynamic-slice fusion from folding these slices and the merge's
  # slices of earlier outputs into the kernel call: with partial-row calls (a window's neighbour
  # chunk) that rewrite builds a cyclic graph and compilation fails (jax 0.11.2, H100).
  sl = lambda x, s0, n: (None if x is None else
                         jax.lax.optimization_barrier(jax.lax.slice_in_dim(x, s0, s0 + n, axis=1)))
  opts = {"segment_ids": sl(qs, call.q0, call.nq), "kv_segment_ids": sl(ks, call.k0, call.nk),
          "scale": kern.scale, "return_lse": True, "implementation": kern.implementation,
          "interpret": kern.interpret, "causal": call.causal}
  if sel is not None:
    out, lse = block_sparse_attention(q, k, v, sel, **opts)
  else:
    out, lse = flash_attention(
        sl(q, call.q0, call.nq), sl(k, call.k0, call.nk), sl(v, call.k0, call.nk),
        local_window_size=call.window, logits_soft_cap=kern.logits_soft_cap, **opts)
  return jax.lax.optimization_barrier((out, jnp.swapaxes(lse, 1, 2)))


def _halo_forward(plan, kern, q, k, v, prev):
  """(out, lse [B, L, H]) of one device under ``plan.halo``: its own chunk's diagonal call with
  the keys ``prev`` = (k, v) [B, halo, Hk, D] of the previous device in front (None: device 0)."""
  diag = plan.calls[plan.table[0, 0, 0, 0] - 1]
  if prev is None:
    return _run_call(diag, kern, q, k, v, None, None)
  kw = dict(causal=diag.causal, local_window_size=diag.window, scale=kern.scale,
            logits_soft_cap=kern.logits_soft_cap)
  both = [(a, jax.ShapeDtypeStruct((a.shape[0], a.shape[1] + b.shape[1], *a.shape[2:]), a.dtype))
          for a, b in zip(prev, (k, v))]
  fp = flash_attention_plan(q, *(x[1] for x in both), return_lse=True, interpret=kern.interpret,
                            implementation=kern.implementation, **kw)
  if fp.implementation == "mosaic_gpu" and plan.halo % fp.config.block_k == 0:   # no copy
    out, lse = kernel_module("mosaic_gpu").flash_attention(q, k, v, block_sizes=fp.config,
                                                            kv_prefix=prev, **kw)
  else:
    out, lse = flash_attention(q, *(jnp.concatenate(x, 1) for x in zip(prev, (k, v))),
                               return_lse=True, implementation=kern.implementation,
                               interpret=kern.interpret, **kw)
  return out, jnp.swapaxes(lse, 1, 2)


def _empty(q, v, rows):   # (zeros, -inf): nothing visible
  return (jnp.zeros((q.shape[0], rows, q.shape[2], v.shape[-1]), q.dtype),
          jnp.full((q.shape[0], rows, q.shape[2]), -jnp.inf, jnp.float32))


def _pair(plan, kern, column, d, q, k, v, qs, ks, sel=None):
  """((out, lse), r0): a chunk pair's partial over query rows [r0, r0 + n), or None when no device
  runs it; a switch over its calls in ``column`` = table[:, r, a, b] (0: skip, also at run time
  without a shared document or a kept block) on device ``d`` (an int if static)."""
  column, d = (column[d:d + 1], 0) if isinstance(d, int) else (column, d)
  kinds = sorted(set(column.tolist()) | ({0} if qs is not None or sel is not None else set()))
  calls = [plan.calls[i - 1] for i in kinds if i]
  if not calls:
    return None
  r0, r1 = min(c.q0 for c in calls), max(c.q0 + c.nq for c in calls)

  def branch(i, q, k, v, qs, ks, sel):
    if not i:
      return _empty(q, v, r1 - r0)
    out, lse = _run_call(plan.calls[i - 1], kern, q, k, v, qs, ks, sel)
    pad = ((0, 0), (plan.calls[i - 1].q0 - r0, r1 - plan.calls[i - 1].q0 - out.shape[1]), (0, 0))
    return jnp.pad(out, pad + ((0, 0),)), jnp.pad(lse, pad, constant_values=-jnp.inf)
  if len(kinds) == 1:
    return branch(kinds[0], q, k, v, qs, ks, sel), r0
  idx = jnp.asarray(np.searchsorted(kinds, column), jnp.int32)[d]
  if qs is not None:   # skip unless some batch row's chunks may share a document (ids overlap)
    lo = lambda s: jnp.min(jnp.where(s > 0, s, jnp.iinfo(jnp.int32).max), axis=1)
    hi = lambda s: jnp.max(jnp.where(s > 0, s, 0), axis=1)
    idx = jnp.where(jnp.any((lo(qs) <= hi(ks)) & (lo(ks) <= hi(qs))), idx, 0)
  if sel is not None:
    idx = jnp.where(jnp.any(sel.counts > 0), idx, 0)
  return jax.lax.switch(idx, [functools.partial(branch, i) for i in kinds], q, k, v, qs, ks,
                        sel), r0


def _pair_selection(plan, kern, sel, d, i, a, b):
  """Query chunk a's rows of ``sel`` (global key block ids) within key slot b at step i, as a
  chunk-pair :class:`BlockSelection`; None without ``sel``."""
  if sel is None:
    return None
  (bs, qbs), p = kern.blocks, plan.num_shards
  nq, nk = plan.q_chunk // qbs, plan.kv_chunk // bs
  owner = (np.arange(p) - plan.shifts[i]) % p       # whose K/V device d holds at step i
  kid = jnp.asarray(shard_chunks(p, plan.layout)[owner, b])[d]
  ix = sel[:, :, a * nq:(a + 1) * nq] - kid * nk    # [B, Hk, nq, max_selected]
  ix = jnp.sort(jnp.where((ix >= 0) & (ix < nk), ix, nk), axis=-1)[..., :min(nk, ix.shape[-1])]
  ix = jnp.where(ix < nk, ix, -1)
  counts = jnp.sum(ix >= 0, axis=-1, dtype=jnp.int32)
  return sel_ops.BlockSelection(ix, counts, counts, None, bs, qbs, plan.q_chunk, plan.kv_chunk)


def _merge_into(acc, part, a0, r0, shapes):
  """``acc`` (None or out [B, m, c, H, Dv], lse [B, m, c, H]) with ``part`` (the same for chunks
  [a0, a0 + k), rows [r0, r0 + n)) merged in place, in fp32; out stays in the kernels' dtype."""
  if acc is None:
    if part[0].shape == shapes[0]:
      return part
    acc = (jnp.zeros(shapes[0], part[0].dtype), jnp.full(shapes[1], -jnp.inf, jnp.float32))
  start = lambda x: (0, a0, r0) + (0,) * (x.ndim - 3)
  rows = [jax.lax.slice(x, start(x), tuple(map(sum, zip(start(x), y.shape))))
          for x, y in zip(acc, part)]
  return tuple(jax.lax.dynamic_update_slice(x, y, start(x))
               for x, y in zip(acc, merge(rows[0], rows[1], part[0], part[1])))


def _step(plan, kern, i, d, acc, q, qs, k, v, ks, sel=None):
  """``acc`` with step ``i``'s pairs on device ``d`` merged in: ``plan.joint`` on device P-1's
  first step, one call for fully visible pairs (``plan._whole``, :func:`_strip`), diagonal pairs
  as one call batched over B * m if the same on every device."""
  b_, m = q.shape[0], plan.table.shape[-1]
  ch = lambda x: None if x is None else x.reshape(b_, m, -1, *x.shape[2:])   # [B, m, c, ...]
  flat = lambda x: None if x is None else x.reshape(-1, *x.shape[2:])
  at = lambda x, j: None if x is None else x[:, j]
  if i == 0 and acc is None and plan.joint is not None and sel is None:
    joint = lambda q, qs, k, v, ks: tuple(map(ch, _run_call(plan.joint, kern, q, k, v, qs, ks)))

    def pairs(q, qs, k, v, ks):
      out = _step(dataclasses.replace(plan, joint=None), kern, i, d, None, q, qs, k, v, ks)
      return tuple(map(ch, _empty(q, v, q.shape[1]))) if out is None else out
    x, last = (q, qs, k, v, ks), plan.num_shards - 1
    if isinstance(d, int):
      return joint(*x) if d == last else pairs(*x)
    return jax.lax.cond(d == last, joint, pairs, *x)
  qm, km, vm, qsm, ksm = map(ch, (q, k, v, qs, ks))
  shapes = ((*qm.shape[:-1], v.shape[-1]), qm.shape[:-1])
  if sel is None and (whole := plan._whole(i)):   # one call over the local rows and keys
    return _merge_into(acc, tuple(map(ch, _run_call(whole, kern, q, k, v, qs, ks))), 0, 0, shapes)
  strips = sel is None and qs is None and {_strip(plan, i, e) for e in (
      [d] if isinstance(d, int) else range(plan.num_shards))}
  if strips and None not in strips:   # one call for a query chunk's or key chunk's full pairs
    dense = lambda q, k, v: _run_call(PairCall(0, q.shape[1], 0, k.shape[1], False, None), kern,
                                      q, k, v, None, None)   # unmasked, no segment ids here

    def strip(row, j, q, k, v):
      if not row:    # every local query chunk against key chunk j
        return tuple(map(ch, dense(q, ch(k)[:, j], ch(v)[:, j])))
      out, lse = dense(ch(q)[:, j], k, v)    # query chunk j against every key chunk
      if len(strips) == 1:
        return out[:, None], lse[:, None]
      return tuple(jnp.stack([x if a == j else e for a in range(m)], 1)
                   for x, e in zip((out, lse), _empty(q, v, plan.q_chunk)))
    kinds = sorted(strips)
    if len(kinds) == 1:
      row, j = kinds[0]
      return _merge_into(acc, strip(row, j, q, k, v), j if row else 0, 0, shapes)
    idx = jnp.asarray([kinds.index(_strip(plan, i, e)) for e in range(plan.num_shards)])[d]
    part = jax.lax.switch(idx, [functools.partial(strip, *c) for c in kinds], q, k, v)
    return _merge_into(acc, part, 0, 0, shapes)
  diag = plan.table[:, i, np.arange(m), np.arange(m)]
  batched = sel is None and m > 1 and diag.min() > 0 and (diag == diag.flat[0]).all()
  if batched:
    call = plan.calls[diag.flat[0] - 1]
    part = _run_call(call, kern, *map(flat, (qm, km, vm, qsm, ksm)))
    acc = _merge_into(acc, tuple(map(ch, part)), 0, call.q0, shapes)
  for a, b in np.ndindex(m, m):
    part = None if batched and a == b else _pair(
        plan, kern, plan.table[:, i, a, b], d, qm[:, a], km[:, b], vm[:, b], at(qsm, a),
        at(ksm, b), _pair_selection(plan, kern, sel, d, i, a, b))
    if part is not None:
      acc = _merge_into(acc, tuple(x[:, None] for x in part[0]), a, part[1], shapes)
  return acc


def _full(plan):   # the call of a fully visible chunk pair
  return PairCall(0, plan.q_chunk, 0, plan.kv_chunk, False, None)


def _strip(plan, i, d):
  """(True, a) when device d's live pairs at step i are query chunk a against every key chunk,
  (False, b) when every query chunk against key chunk b, all fully visible; else None."""
  live, m = plan.table[d, i] > 0, plan.table.shape[-1]
  if m < 2 or not all(plan.calls[c - 1] == _full(plan) for c in plan.table[d, i][live]):
    return None
  rows, cols = np.flatnonzero(live.any(1)), np.flatnonzero(live.any(0))
  if len(rows) == 1 and live[rows[0]].all():
    return True, int(rows[0])
  return (False, int(cols[0])) if len(cols) == 1 and live[:, cols[0]].all() else None


def _flat(acc, q, v):
  """(out [B, L, H, Dv], lse [B, L, H]) of an accumulator (None: nothing visible)."""
  if acc is None:
    return _empty(q, v, q.shape[1])
  return tuple(x.reshape(q.shape[0], -1, *x.shape[3:]) for x in acc)


def _shift(xs, shift, axis_name, p):
  if shift % p == 0:
    return xs
  perm = [(i, (i + shift) % p) for i in range(p)]
  return jax.tree.map(lambda x: jax.lax.ppermute(x, axis_name, perm), xs)


# ----------------------------------------------------------------------------- strategies
def _pass_kv_forward(plan, kern, d, q, v, qs, kvs, sel=None):
  """Every step of a K/V-moving strategy on device ``d``; ``kvs`` yields each step's (k, v, ks)."""
  acc = None
  for i, kv in enumerate(kvs):
    acc = _step(plan, kern, i, d, acc, q, qs, *kv, sel)
  return _flat(acc, q, v)


def _ring_steps(plan, axis_name, xs):
  """Each step's ``xs``; the next shift is issued before this step's kernels, to overlap."""
  p, shifts = plan.num_shards, plan.shifts
  xs = _shift(xs, shifts[0], axis_name, p)
  for i in range(len(shifts)):
    nxt = _shift(xs, shifts[i + 1] - shifts[i], axis_name, p) if i + 1 < len(shifts) else xs
    yield xs
    xs = nxt


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _ring(plan, kern, axis_name, q, k, v, qs, ks, sel):
  """``sel``: None, or this device's rows of a block selection (int [B, Hk, q blocks, n])."""
  if plan.halo and qs is None and sel is None:
    prev = _shift((k[:, -plan.halo:], v[:, -plan.halo:]), 1, axis_name, plan.num_shards)
    return jax.lax.cond(jax.lax.axis_index(axis_name) == 0,
                        lambda *x: _halo_forward(plan, kern, *x[:3], None),
                        lambda *x: _halo_forward(plan, kern, *x), q, k, v, prev)
  return _pass_kv_forward(plan, kern, jax.lax.axis_index(axis_name), q, v, qs,
                          _ring_steps(plan, axis_name, (k, v, ks)), sel)


def _ring_fwd(plan, kern, axis_name, q, k, v, qs, ks, sel):
  out, lse = _ring(plan, kern, axis_name, q, k, v, qs, ks, sel)
  return (out, lse), (q, k, v, qs, ks, sel, out, lse)


def _ring_bwd(plan, kern, axis_name, res, g):
  """dQ stays here; dK/dV travel back with their K/V. A partial (o_p, lse_p) has weight
  w = exp(lse_p - lse): cotangents w * dout and w * (<dout, o_p> - <dout, out> + dlse)."""
  q, k, v, qs, ks, sel, out, lse = res
  dout, dlse = g
  p, m, shifts = plan.num_shards, plan.table.shape[-1], plan.shifts
  d = jax.lax.axis_index(axis_name)
  dout = dout.astype(jnp.float32)
  delta = jnp.sum(dout * out.astype(jnp.float32), axis=-1)             # [B, Lq, H]
  chunks = lambda x: [None] * m if x is None else jnp.split(x, m, axis=1)
  qc, qsc, doc, dlc, lc, dc = map(chunks, (q, qs, dout, dlse, lse, delta))
  dq = [jnp.zeros(x.shape, jnp.float32) for x in qc]
  state = (k, v, ks, jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  state = _shift(state, shifts[0], axis_name, p)
  for i in range(len(shifts)):
    kc, vc, ksc, dkc, dvc = map(chunks, state)
    for a, b in np.ndindex(m, m):
      if not (col := plan.table[:, i, a, b]).any():
        continue
      f = functools.partial(_pair, plan, kern, col, d, qs=qsc[a], ks=ksc[b],
                            sel=_pair_selection(plan, kern, sel, d, i, a, b))
      (o_p, l_p), vjp, r0 = jax.vjp(f, qc[a], kc[b], vc[b], has_aux=True)
      rows = lambda x: jax.lax.slice_in_dim(x, r0, r0 + o_p.shape[1], axis=1)
      w = jnp.where(jnp.isfinite(l_p), jnp.exp(l_p - rows(lc[a])), 0.0)    # [B, n, H]
      ct_l = w * (jnp.sum(rows(doc[a]) * o_p, axis=-1) - rows(dc[a]) + rows(dlc[a]))
      gq, gk, gv = vjp(((w[..., None] * rows(doc[a])).astype(o_p.dtype), ct_l))
      dq[a], dkc[b], dvc[b] = dq[a] + gq, dkc[b] + gk, dvc[b] + gv
    dk, dv = jnp.concatenate(dkc, axis=1), jnp.concatenate(dvc, axis=1)
    if i + 1 < len(shifts):
      state = _shift((*state[:3], dk, dv), shifts[i + 1] - shifts[i], axis_name, p)
  dk, dv = _shift((dk, dv), -shifts[-1], axis_name, p)
  dq = jnp.concatenate(dq, axis=1)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def _ring_q(plan, kern, axis_name, q, k, v, qs, ks):
  p, m, shifts = plan.num_shards, plan.table.shape[-1], plan.shifts
  d = jax.lax.axis_index(axis_name)
  acc = jax.tree.map(lambda x: x.reshape(q.shape[0], m, -1, *x.shape[2:]), _empty(q, v, q.shape[1]))
  for i, (qq, qqs) in enumerate(_ring_steps(plan, axis_name, (q, qs))):
    if i:   # the partial results follow their queries
      acc = _shift(acc, shifts[i] - shifts[i - 1], axis_name, p)
    acc = _step(plan, kern, i, d, acc, qq, qqs, k, v, ks)
  return _flat(_shift(acc, -shifts[-1], axis_name, p), q, v)


def _shard_attention(plan, kern, axis_name, q, k, v, qs, ks):
  """(out [B, Lq_local, H, Dv], lse [B, Lq_local, H]) on one device, inside shard_map."""
  if plan.strategy == "ring":
    return _ring(plan, kern, axis_name, q, k, v, qs, ks, None)
  if plan.strategy == "ring_q":
    return _ring_q(plan, kern, axis_name, q, k, v, qs, ks)
  # all_gather: every step slices the gathered K/V of the device it meets
  d, n = jax.lax.axis_index(axis_name), plan.table.shape[-1] * plan.kv_chunk
  kv = jax.tree.map(lambda x: jax.lax.all_gather(x, axis_name, axis=1, tiled=True), (k, v, ks))
  kvs = (jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(
      x, ((d - s) % plan.num_shards) * n, n, axis=1), kv) for s in plan.shifts)
  return _pass_kv_forward(plan, kern, d, q, v, qs, kvs)


# ----------------------------------------------------------------------------- public API
def _kernel(q, scale, logits_soft_cap, implementation, interpret, blocks=None):
  if implementation == "cudnn":
    raise ValueError("implementation='cudnn' returns no log-sum-exp, which the chunk merge "
                     "needs; use None, 'xla', 'triton', 'mosaic_gpu' or 'mosaic_tpu'")
  scale, cap = check_scale_and_cap(scale, logits_soft_cap, head_dim=q.shape[-1])
  return _Kernel(scale, cap, implementation, bool(interpret), blocks)


def context_parallel_attention_shard(q, k, v, *, axis_name, causal=False, local_window_size=None,
                                     segment_ids=None, kv_segment_ids=None, scale=None,
                                     logits_soft_cap=None, strategy="ring", layout="zigzag",
                                     return_lse=False, implementation=None, interpret=False):
  """:func:`context_parallel_attention` on one device's shard, for use inside ``shard_map``.

  Args:
    q, k, v: local [batch, len, heads, head_dim] shards of the permuted sequences: this device's
      chunks in the layout's order, no padding (lengths a multiple of 2 for "zigzag").
    axis_name: the mesh axis the sequence is split over.
    causal, local_window_size, segment_ids, kv_segment_ids, scale, logits_soft_cap, strategy,
      layout, implementation, interpret: as :func:`context_parallel_attention`, on the shards.
    return_lse: also return the local log-sum-exp [batch, heads, len].

  Returns:
    The local output [batch, len, q_heads, head_dim_v], or (out, lse) if return_lse.

  Example:
    >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("seq",))
    >>> x = jax.random.normal(jax.random.key(0), (1, 64, 2, 16))
    >>> f = jax.shard_map(lambda q, k, v: context_parallel_attention_shard(
    ...     q, k, v, axis_name="seq", causal=True), mesh=mesh, in_specs=PS(None, "seq"),
    ...     out_specs=PS(None, "seq"))
    >>> f(x, x, x).shape
    (1, 64, 2, 16)
  """
  batch, q_len, kv_len, _, _ = check_qkv(q, k, v)
  segment_ids, kv_segment_ids = check_segments(segment_ids, kv_segment_ids, batch, q_len, kv_len)
  p = jax.lax.axis_size(axis_name)
  m = shard_chunks(p, layout).shape[1]
  if q_len % m or kv_len % m:
    raise ValueError(f"layout={layout!r} needs local lengths divisible by {m}, got q {q_len}, "
                     f"kv {kv_len}")
  plan = context_parallel_plan(q_len * p, kv_len * p, p, causal=causal, strategy=strategy,
                               local_window_size=local_window_size, layout=layout)
  kern = _kernel(q, scale, logits_soft_cap, implementation, interpret)
  out, lse = _shard_attention(plan, kern, axis_name, q, k, v, segment_ids, kv_segment_ids)
  return (out, jnp.swapaxes(lse, 1, 2)) if return_lse else out


def ring_device_forward(plan, q, kv_shards, device, *, scale=None, logits_soft_cap=None,
                        implementation=None, interpret=False):
  """One device's kernel calls and merges under a "ring" or "all_gather" plan, every step's K/V
  given up front (no communication; for benchmarks).

  Args:
    plan: a :class:`ContextParallelPlan` of strategy "ring" or "all_gather".
    q: the device's local queries [batch, len, heads, head_dim], in the layout's order.
    kv_shards, device: every device's local (k, v), indexed by device; this device (int).
    scale, logits_soft_cap, implementation, interpret: as :func:`jattn.flash_attention`.

  Returns:
    (out [batch, len, heads, head_dim_v] in q's dtype, lse fp32 [batch, len, heads]).

  Example:
    >>> x = jnp.ones((1, 64, 2, 16))
    >>> plan = context_parallel_plan(128, 128, 2, causal=True)
    >>> out, lse = ring_device_forward(plan, x, [(x, x), (x, x)], 0)
    >>> out.shape, lse.shape
    ((1, 64, 2, 16), (1, 64, 2))
  """
  if plan.strategy == "ring_q":
    raise ValueError("plan.strategy must be 'ring' or 'all_gather', got 'ring_q'")
  kern = _kernel(q, scale, logits_soft_cap, implementation, interpret)
  if plan.halo:
    return _halo_forward(plan, kern, q, *kv_shards[device], device and tuple(
        x[:, -plan.halo:] for x in kv_shards[device - 1]) or None)
  kvs = ((*kv_shards[(device - s) % plan.num_shards], None) for s in plan.shifts)
  return _pass_kv_forward(plan, kern, device, q, kv_shards[device][1], None, kvs)


def _with_padding(x, pos, mesh):
  """x (layout order, padding slots left out) -> the padded layout (zeros in the slots)."""
  if (real := pos >= 0).all():
    return x
  x = jax.device_put(x, NamedSharding(mesh, PS()))   # gathers on explicit meshes need this
  idx = np.where(real, np.cumsum(real) - 1, 0)
  mask = jnp.asarray(real).reshape((1, -1) + (1,) * (x.ndim - 2))
  return jnp.where(mask, jnp.take(x, idx, axis=1), 0)


def context_parallel_attention(q, k, v, *, mesh, axis_name, causal=False, local_window_size=None,
                               segment_ids=None, kv_segment_ids=None, scale=None,
                               logits_soft_cap=None, strategy="ring", layout="zigzag",
                               return_lse=False, implementation=None, interpret=False):
  """Attention over sequences split along a mesh axis (ring, all-gather or pass-Q).

  The result is :func:`jattn.flash_attention` of the unpermuted arrays, permuted. Any length
  works (padded inside to whole chunks, which gathers the arrays once).

  Args:
    q: [batch, q_len, q_heads, head_dim] in the layout's order.
    k, v: [batch, kv_len, kv_heads, head_dim(_v)], likewise (GQA: only the kv heads move).
    mesh, axis_name: a ``jax.sharding.Mesh`` and the axis the sequence is split over.
    causal, local_window_size, segment_ids, kv_segment_ids, scale, logits_soft_cap,
      implementation, interpret: as :func:`jattn.flash_attention` (segment ids in the layout's
      order; any implementation but "cudnn").
    strategy: "ring" (pass-KV), "all_gather" or "ring_q" (pass-Q).
    layout: "zigzag" (device i holds chunks i and 2P-1-i) or "contiguous".
    return_lse: also return the log-sum-exp [batch, q_heads, q_len] (layout order).

  Returns:
    out [batch, q_len, q_heads, head_dim_v] in q.dtype (layout order), or (out, lse).

  Example:
    >>> x = context_parallel_permute(jnp.ones((1, 100, 2, 16)), 1)
    >>> mesh = jax.make_mesh((1,), ("seq",))
    >>> context_parallel_attention(x, x, x, mesh=mesh, axis_name="seq", causal=True).shape
    (1, 100, 2, 16)
  """
  batch, q_len, kv_len, _, _ = check_qkv(q, k, v)
  segment_ids, kv_segment_ids = check_segments(segment_ids, kv_segment_ids, batch, q_len, kv_len)
  window = normalize_window(local_window_size)
  plan = context_parallel_plan(q_len, kv_len, _axis_size(mesh, axis_name), causal=causal,
                               local_window_size=window, strategy=strategy, layout=layout)
  kern = _kernel(q, scale, logits_soft_cap, implementation, interpret)
  local = functools.partial(_shard_attention, plan, kern, axis_name)
  out, lse = _on_mesh(mesh, axis_name, plan, local, q, k, v, segment_ids, kv_segment_ids,
                      causal or (window is not None and window[1] == 0))
  return (out, lse) if return_lse else out


def _axis_size(mesh, axis_name):
  if axis_name not in mesh.axis_names:
    raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {mesh.axis_names}")
  return mesh.shape[axis_name]


def _on_mesh(mesh, axis_name, plan, local, q, k, v, segment_ids, kv_segment_ids, hidden):
  """(out, lse [batch, heads, q_len]) of ``local(q, k, v, qs, ks)`` on every device's shards,
  padded to whole chunks. ``hidden``: the mask hides padded keys (else segment ids do)."""
  batch, q_len, kv_len, p = q.shape[0], q.shape[1], k.shape[1], plan.num_shards
  qpos, kpos = (layout_positions(n, p, plan.layout) for n in (q_len, kv_len))
  if (kpos < 0).any() and segment_ids is None and not hidden:   # padded keys need a mask
    segment_ids, kv_segment_ids = (jnp.ones((batch, n), jnp.int32) for n in (q_len, kv_len))
  args = [_with_padding(x, pos, mesh) for x, pos in ((q, qpos), (k, kpos), (v, kpos))]
  if segment_ids is not None:
    args += [_with_padding(segment_ids, qpos, mesh), _with_padding(kv_segment_ids, kpos, mesh)]
  seq = PS(None, axis_name)
  args = [jax.device_put(x, NamedSharding(mesh, seq)) for x in args]
  out, lse = jax.shard_map(lambda q, k, v, qs=None, ks=None: local(q, k, v, qs, ks), mesh=mesh,
                           in_specs=(seq,) * len(args), out_specs=(seq, seq),
                           axis_names={axis_name}, check_vma=False)(*args)
  if (qpos < 0).any():   # drop the padded rows
    out, lse = (jnp.take(jax.device_put(x, NamedSharding(mesh, PS())), np.flatnonzero(qpos >= 0),
                         axis=1) for x in (out, lse))
  return out, jnp.swapaxes(lse, 1, 2)


def _check_blocks(chunk, block_size, q_block_size):
  for name, size in (("block_size", block_size), ("q_block_size", q_block_size)):
    if chunk % size:
      raise ValueError(f"{name}={size} must divide the chunk length {chunk} (the sequence "
                       f"length over the chunks, rounded up): blocks may not straddle chunks")


def _local_selection(plan, kern, axis_name, n, rule, docs, q, k, qs, ks):
  """This device's rows (int32 [B, Hk, q blocks, n], global key block ids) of the ``rule``
  selection on all-gathered pooled keys (and, with ``docs``, segment id ranges)."""
  (bs, qbs), p = kern.blocks, plan.num_shards
  ids, d = shard_chunks(p, plan.layout), jax.lax.axis_index(axis_name)
  real = jnp.asarray(layout_positions(n, p, plan.layout).reshape(p, -1) >= 0)[d]
  pool = lambda x, s, size: sel_ops.block_mean(jax.lax.stop_gradient(x), (
      jnp.broadcast_to(real, x.shape[:2]) if s is None else s != 0), size)

  def whole(x, size):   # per-block [B, local blocks] of every device -> global block order
    c = plan.q_chunk // size
    order = (np.argsort(ids.reshape(-1))[:, None] * c + np.arange(c)).reshape(-1)[:-(-n // size)]
    return jnp.take(jax.lax.all_gather(x, axis_name, axis=1, tiled=True), order, axis=1)
  rank = sel_ops.pooled_scores(pool(q, qs, qbs), whole(pool(k, ks, bs), bs))
  rows = jnp.asarray((ids[:, :, None] * (plan.q_chunk // qbs) + np.arange(plan.q_chunk // qbs))
                     .reshape(p, -1))[d]
  seg = {"seg_ok": None, "doc_start": None}
  if docs:
    r = tuple(tuple(whole(x, b) for x in sel_ops.segment_ranges(s, b))
              for s, b in ((qs, qbs), (ks, bs)))
    seg = {"seg_ok": sel_ops.segment_overlap(None, None, qbs, bs, ranges=r),
           "doc_start": sel_ops.doc_start_blocks(None, None, qbs, bs, ranges=r)}
  return sel_ops.select_lists(rank, q_len=n, kv_len=n, q_block_size=qbs, block_size=bs,
                              scores=None, rows=rows, **rule, **seg).indices


def _sparse_ring(q, k, v, *, mesh, axis_name, layout, block_size, q_block_size, top_k, causal,
                 num_init_blocks, num_local_blocks, segment_ids, kv_segment_ids, scale,
                 implementation, interpret):
  """``jattn.sparse_attention(..., mesh=, axis_name=)`` (validated there): (out, lse [B, H, L])
  by a ring of block-sparse chunk-pair kernels on each device's rows of the selection."""
  if k.shape[1] != (n := q.shape[1]):
    raise ValueError(f"sparse_attention with a mesh needs q_len == kv_len, got {n}, {k.shape[1]}")
  plan = context_parallel_plan(n, n, _axis_size(mesh, axis_name), causal=causal, layout=layout)
  _check_blocks(plan.q_chunk, block_size, q_block_size)
  kern = _kernel(q, scale, None, implementation, interpret, (block_size, q_block_size))
  rule = dict(causal=causal, top_k=top_k, num_init=num_init_blocks, num_local=num_local_blocks)

  def local(q, k, v, qs, ks):
    sel = _local_selection(plan, kern, axis_name, n, rule, segment_ids is not None, q, k, qs, ks)
    return _ring(plan, kern, axis_name, q, k, v, qs, ks, sel)
  return _on_mesh(mesh, axis_name, plan, local, q, k, v, segment_ids, kv_segment_ids, causal)


def context_parallel_decode_attention(q, k_cache, v_cache, kv_lengths, *, mesh, axis_name,
                                      scale=None, logits_soft_cap=None, return_lse=False,
                                      implementation=None, interpret=False):
  """One-token decode over a KV cache whose length is split along a mesh axis.

  Device i attends its entries [i * n, (i + 1) * n) (n = max_len / P) with
  :func:`jattn.decode_attention`; one log-sum-exp merge across the devices gives the result.

  Args:
    q: [batch, q_heads, head_dim] (replicated).
    k_cache, v_cache: [batch, max_len, kv_heads, head_dim(_v)], sharded along max_len.
    kv_lengths: int32 [batch], valid entries per sequence.
    mesh, axis_name: the mesh and the axis the cache length is split over.
    scale, logits_soft_cap, return_lse, implementation, interpret: as
      :func:`jattn.decode_attention`.

  Returns:
    out [batch, q_heads, head_dim_v] in q.dtype, or (out, lse).

  Example:
    >>> q, kv, mesh = jnp.ones((2, 4, 16)), jnp.ones((2, 64, 2, 16)), jax.make_mesh((1,), ("s",))
    >>> context_parallel_decode_attention(q, kv, kv, jnp.array([5, 64]), mesh=mesh,
    ...                                   axis_name="s").shape
    (2, 4, 16)
  """
  p = _axis_size(mesh, axis_name)
  if k_cache.ndim != 4 or k_cache.shape[1] % p:
    raise ValueError(f"k_cache must be [batch, max_len, kv_heads, head_dim] with max_len "
                     f"divisible by the {p} devices of {axis_name!r}, got {k_cache.shape}")

  def local(q, k, v, lengths):
    n = k.shape[1]
    mine = jnp.clip(lengths - jax.lax.axis_index(axis_name) * n, 0, n).astype(jnp.int32)
    out, lse = decode_attention(q, k, v, mine, return_lse=True, scale=scale, interpret=interpret,
                                logits_soft_cap=logits_soft_cap, implementation=implementation)
    gather = lambda x: jax.lax.all_gather(x, axis_name)               # [P, ...]
    out, lse = merge_partials(gather(out.astype(jnp.float32)), gather(lse), axis=0)
    return out.astype(q.dtype), lse
  seq = PS(None, axis_name)
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  out, lse = jax.shard_map(local, mesh=mesh, in_specs=(PS(), seq, seq, PS()),
                           out_specs=(PS(), PS()), axis_names={axis_name}, check_vma=False)(
                               put(q, PS()), put(k_cache, seq), put(v_cache, seq),
                               put(jnp.asarray(kv_lengths, jnp.int32), PS()))
  return (out, lse) if return_lse else out
