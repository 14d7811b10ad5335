"""Flash attention as portable Pallas GPU kernels (Triton lowering), walking a block schedule
(docs/flash.md, "The portable kernels"). Forward: a program per (query tile, batch, query head),
full tiles unmasked, then partial tiles masked. Backward (custom_vjp): dK/dV per (kv tile, batch,
kv head) over the transposed schedule and the GQA group, dQ per query tile. Sequences are padded
to the tiles (padded keys masked), head dims to a power of two.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jax.experimental import pallas as pl

from pallas_kernels import compat, tuning
from pallas_kernels.block_schedule import BlockSchedule, make_schedule
from pallas_kernels.common import softmax, util
from pallas_kernels.common.softmax import LOG2E
from pallas_kernels.common.util import check_segment_ids, next_pow2, pad_axis, round_up
from pallas_kernels.masks import normalize_window, visible

_NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes and launch parameters of the Triton flash attention kernels (None: a default).

  Attributes:
    block_q, block_k: forward query and key/value tiles (powers of two, >= 16).
    num_warps, num_stages: forward warps per program and software-pipelining depth (defaults
      from the tiles and head dim).
    bwd_num_warps, bwd_num_stages: the backward's.
    dkv_q_chunk, dq_k_chunk: rows per step of the dK/dV kernel's query tile (dividing
      ``dkv_tiles[0]``) and of the dQ kernel's kv tile (dividing the backward block_k).
    bwd_block_q, bwd_block_k: backward query and key/value tiles (None: the forward's).
    dkv_block_q: query tile of the schedule that the dK/dV kernel walks (None: the backward
      block_q); needs ``flash_attention(dkv_schedule=...)``.

  Example:
    >>> BlockSizes(64, 64, num_warps=4, num_stages=3, bwd_block_q=128).bwd_tiles
    (128, 64)
  """
  block_q: int
  block_k: int
  num_warps: int | None = None
  num_stages: int | None = None
  bwd_num_warps: int | None = None
  bwd_num_stages: int | None = None
  dkv_q_chunk: int | None = None
  dq_k_chunk: int | None = None
  bwd_block_q: int | None = None
  bwd_block_k: int | None = None
  dkv_block_q: int | None = None

  @property
  def bwd_tiles(self) -> tuple[int, int]:
    """(block_q, block_k) of the backward schedule."""
    return (self.bwd_block_q or self.block_q, self.bwd_block_k or self.block_k)

  @property
  def dkv_tiles(self) -> tuple[int, int]:
    """(block_q, block_k) of the schedule that the dK/dV kernel walks."""
    bq, bk = self.bwd_tiles
    return (self.dkv_block_q or bq, bk)


# Default launch configurations: ``pallas_kernels/tuning`` ("triton_fwd" / "triton_bwd").
_FWD_FIELDS = ("block_q", "block_k", "num_warps", "num_stages")
_BWD_FIELDS = ("bwd_block_q", "bwd_block_k", "bwd_num_warps", "bwd_num_stages", "dkv_q_chunk",
               "dq_k_chunk", "dkv_block_q")


@functools.cache
def _tuned_block_sizes(d_key: int, itemsize: int, device_kind: str | None) -> BlockSizes:
  """The table's ``BlockSizes`` for a padded head dim and itemsize (2 or 4) on a device."""
  dcls = "32bit" if itemsize >= 4 else "16bit"
  fwd, bwd = (tuning.required_params(kernel, d_key, dcls, device_kind)
              for kernel in ("triton_fwd", "triton_bwd"))
  return BlockSizes(**{k: fwd[k] for k in _FWD_FIELDS}, **{k: bwd[k] for k in _BWD_FIELDS})


def default_block_sizes(head_dim: int, dtype, device_kind: str | None = None) -> BlockSizes:
  """Default tiles and launch parameters for the Triton kernels (tuned for Hopper).

  Args:
    head_dim, dtype: the (unpadded) head dimension, up to 256, and the input dtype (fp32 needs
      twice the shared memory of bf16/fp16, so smaller tiles).
    device_kind: jax ``device_kind`` whose table to read (default: the first device's).

  Returns:
    A ``BlockSizes``.

  Example:
    >>> bs = default_block_sizes(128, jnp.bfloat16)
    >>> (bs.block_q, bs.block_k), bs.bwd_tiles, (bs.bwd_num_warps, bs.bwd_num_stages)
    ((64, 64), (128, 64), (4, 2))
  """
  if head_dim > 256:
    raise ValueError(f"head_dim must be <= 256, got {head_dim}")
  itemsize = 4 if jnp.dtype(dtype).itemsize >= 4 else 2
  # cached by the resolved kind, never None (a swapped tuning.device_kind must not hit it)
  return _tuned_block_sizes(next_pow2(head_dim, minimum=32), itemsize,
                            tuning.resolve_kind(device_kind))


_LAUNCH_FIELDS = ("num_warps", "num_stages", "bwd_num_warps", "bwd_num_stages", "dkv_q_chunk",
                  "dq_k_chunk")


def _launch_defaults(bs: BlockSizes, d_pad, dv_pad, dtype) -> dict:
  """{``_LAUNCH_FIELDS``: default}, per pass: the table's if its tiles match, else a heuristic."""
  itemsize = 4 if jnp.dtype(dtype).itemsize >= 4 else 2
  tuned = _tuned_block_sizes(max(32, max(d_pad, dv_pad)), itemsize, tuning.resolve_kind(None))
  (bq, bk), (bbq, bbk) = (bs.block_q, bs.block_k), bs.bwd_tiles
  budget, row = 200 * 1024, (d_pad + dv_pad) * itemsize
  warps = lambda tq, tk: 8 if max(tq, tk) >= 128 and max(d_pad, dv_pad) >= 128 else 4
  if (tuned.block_q, tuned.block_k) == (bq, bk):
    fwd = (tuned.num_warps, tuned.num_stages)
  else:  # a stage holds one K and one V tile
    fwd = (warps(bq, bk), int(max(1, min(3, (budget - bq * d_pad * itemsize) // (bk * row)))))
  if tuned.bwd_tiles == (bbq, bbk):
    bwd = (tuned.bwd_num_warps, tuned.bwd_num_stages, tuned.dkv_q_chunk, tuned.dq_k_chunk)
  else:  # a stage holds one Q and one dO chunk
    dkv_chunk = min(bbq, 64 if itemsize == 2 else 32)
    bwd_stages = max(1, min(2, (budget - bbk * row) // (dkv_chunk * row)))
    bwd = (warps(bbq, bbk), int(bwd_stages), dkv_chunk, min(bbk, 64 if itemsize == 2 else 32))
  return dict(zip(_LAUNCH_FIELDS, fwd + bwd, strict=True))


@dataclasses.dataclass(frozen=True)
class _Static:
  block_q: int
  block_k: int
  q_len: int            # unpadded
  kv_len: int           # unpadded
  causal: bool
  window: tuple | None  # (left, right), either side None = unbounded
  scale: float
  soft_cap: float | None
  num_warps: int        # forward launch (unused by the backward)
  num_stages: int
  bwd_num_warps: int
  bwd_num_stages: int
  dkv_q_chunk: int
  dq_k_chunk: int
  interpret: bool
  dkv_block_q: int | None = None  # backward only: the dK/dV kernel's q tile (None: block_q)


def _launch_order(st: _Static, num_tiles: int, batch: int, heads: int):
  """(grid, tile_axis, index: program ids -> (t, bi, h)), t the launch-order tile (0 first) on
  grid axis ``tile_axis``. Causal masks launch G (4, 2 or 1) (batch, head) pairs fastest, heaviest
  tiles first; other masks launch tiles fastest."""
  triangular = st.causal and (st.window is None or st.window[0] is None)
  group = 4 if triangular else 1
  while (batch * heads) % group:
    group //= 2
  if group == 1:
    return (num_tiles, batch, heads), 0, lambda p0, p1, p2: (p0, p1, p2)

  def index(p0, p1, p2):
    bh = p2 * group + p0
    return p1, bh // heads, bh % heads
  return (group, num_tiles, batch * heads // group), 1, index


def _tile_specs(order, tile_of):
  """``spec(shape, f)``: a BlockSpec indexed by ``f(tile_of(t), bi, h)`` under launch ``order``."""
  def spec(shape, f):
    def index_map(*p):
      t, bi, h = order(*p)
      return f(tile_of(t), bi, h)
    return pl.BlockSpec(shape, index_map)
  return spec


def _logits(q, k, st: _Static):
  """(scaled, soft-capped base-2 logits [m, n] fp32 of q, k; tanh(x / cap) or None: no cap)."""
  qk = _dot(q, k, trans_b=True)  # [m, n]
  if st.soft_cap is None:
    return qk * (st.scale * LOG2E), None
  th = jnp.tanh(qk * (st.scale / st.soft_cap))  # [m, n]
  return th * (st.soft_cap * LOG2E), th


def _tile_mask(q_pos, k_pos, q_seg, k_seg, st: _Static, *, kv_major=False):
  """masks.visible for one tile: q_pos [m], k_pos [n] -> bool [m, n] ([n, m] when ``kv_major``)."""
  rows = lambda x: None if x is None else x[:, None]
  cols = lambda x: None if x is None else x[None, :]
  qx, kx = (cols, rows) if kv_major else (rows, cols)
  return visible(qx(q_pos), kx(k_pos), qx(q_seg), kx(k_seg), causal=st.causal, window=st.window,
                 kv_len=st.kv_len)


def _dot(a, b, trans_b=False):
  """a @ b (``trans_b``: b^T) in fp32; fp32 operands at HIGHEST (DEFAULT means TF32 on GPUs)."""
  return lax.dot_general(a, b, (((1,), (1 if trans_b else 0,)), ((), ())),
                         precision=lax.Precision.HIGHEST if a.dtype == jnp.float32 else None,
                         preferred_element_type=jnp.float32)


def _walk_row(row_ref, num_chunks, body, carry):
  """``carry = body(tile, chunk, carry, masked=...)`` over a schedule row's full tiles, then its
  partial ones; step j visits chunk ``j % num_chunks`` of tile ``row[2 + j // num_chunks]``, the
  next tile index read one step ahead (``_pack_rows`` pads the rows)."""
  def split(j):
    if num_chunks == 1:
      return j, 0
    return lax.div(j, jnp.int32(num_chunks)), lax.rem(j, jnp.int32(num_chunks))

  def walk(lo, hi, masked, carry):  # flat steps [lo, hi)
    def step(j, state):
      tile, carry = state
      t_next, _ = split(j + 1)
      _, chunk = split(j)
      return row_ref[2 + t_next], body(tile, chunk, carry, masked=masked)

    t_lo, _ = split(lo)
    return lax.fori_loop(lo, hi, step, (row_ref[2 + t_lo], carry))[1]

  count, n_full = row_ref[0], row_ref[1]
  carry = walk(0, n_full * num_chunks, False, carry)
  return walk(n_full * num_chunks, count * num_chunks, True, carry)


def _split_refs(refs, n_in, has):
  """(inputs, segment id refs, (mask, bias) refs, row_ref, outputs); absent refs (``has``) None."""
  rest = list(refs[n_in:])
  take = lambda flag: rest.pop(0) if flag else None
  segs = (take(has[0]), take(has[0]))
  extra = (take(has[1]), take(has[2]))
  return refs[:n_in], segs, extra, rest[0], rest[1:]


def _bias_and_vis(s, bias, mask, vis):
  """(s plus a natural-units bias tile or None, ``vis`` and an int8 mask tile or None)."""
  if bias is not None:
    s = s + bias.astype(jnp.float32) * LOG2E
  if mask is not None:
    vis = mask != 0 if vis is None else vis & (mask != 0)
  return s, vis


def _q_tile_logits(st: _Static, num_q_tiles, tile_axis, qseg_ref, kseg_ref, mask_ref, bias_ref):
  """``logits(q, k, start, masked)``: ``_logits`` of the program's q tile and the keys k at
  [start, start + n) plus the bias, -inf where hidden (mask refs read when ``masked``), tanh."""
  qi = num_q_tiles - 1 - pl.program_id(tile_axis)
  q_pos = qi * st.block_q + lax.iota(jnp.int32, st.block_q) + (st.kv_len - st.q_len)  # [bq]
  q_seg = None if qseg_ref is None else qseg_ref[...]  # [bq]

  def logits(q, k, start, masked):
    n = k.shape[0]
    s, th = _logits(q, k, st)  # [bq, n] base-2 logits
    cols = pl.ds(start, n)
    vis = mask = None
    if masked:
      k_pos = start + lax.iota(jnp.int32, n)
      k_seg = None if kseg_ref is None else kseg_ref[cols]
      vis = _tile_mask(q_pos, k_pos, q_seg, k_seg, st)
      mask = None if mask_ref is None else mask_ref[:, cols]  # [bq, n]
    s, vis = _bias_and_vis(s, None if bias_ref is None else bias_ref[:, cols], mask, vis)
    return (s if vis is None else jnp.where(vis, s, _NEG_INF)), th
  return logits


def _fwd_kernel(*refs, st: _Static, has: tuple, num_q_tiles: int, tile_axis: int):
  """Refs: q [bq, D], k [Sk, D], v [Sk, Dv], (q_seg [bq], kv_seg [Sk]), (mask [bq, Sk] int8),
  (bias [bq, Sk]), row [W] -> o [bq, Dv], lse [bq] (natural log)."""
  ((q_ref, k_ref, v_ref), (qseg_ref, kseg_ref), (mask_ref, bias_ref), row_ref,
   (o_ref, lse_ref)) = _split_refs(refs, 3, has)
  bq, bk = st.block_q, st.block_k
  d_v = o_ref.shape[-1]
  assert q_ref.shape[0] == bq and k_ref.shape[0] % bk == 0, (q_ref.shape, k_ref.shape)

  logits = _q_tile_logits(st, num_q_tiles, tile_axis, qseg_ref, kseg_ref, mask_ref, bias_ref)
  q = q_ref[...]  # [bq, D]

  def step(tile, _chunk, carry, masked):
    acc, m_prev, l_prev = carry  # [bq, Dv], [bq], [bq]
    start = pl.multiple_of(tile * bk, bk)
    k = k_ref[pl.ds(start, bk), :]  # [bk, D]
    v = None
    if masked:  # a non-finite value: NaN logits (masked for the rows that cannot see it)
      k, v = softmax.hide_nonfinite_values(k, v_ref[pl.ds(start, bk), :])
    s, _ = logits(q, k, start, masked)
    # A row of a partial tile may still have seen nothing (-inf): guard_empty avoids NaN.
    p, alpha, m_new, l_new = softmax.online_softmax_step(s, m_prev, l_prev, guard_empty=masked)
    if v is None:
      v = v_ref[pl.ds(start, bk), :]  # [bk, Dv]
    acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v)  # [bq, Dv]
    return acc, m_new, l_new

  carry = (jnp.zeros((bq, d_v), jnp.float32), jnp.full((bq,), _NEG_INF, jnp.float32),
           jnp.zeros((bq,), jnp.float32))
  out, lse = softmax.finalize(*_walk_row(row_ref, 1, step, carry))
  o_ref[...] = out.astype(o_ref.dtype)
  lse_ref[...] = lse


def _row_index_maps(rows):
  """(batch, head) -> index into the packed schedule rows [Bs, Hs, n, W] (size-1 axes shared)."""
  bs, hs = rows.shape[:2]
  return (lambda b: b if bs > 1 else 0), (lambda hk: hk if hs > 1 else 0)


def _q_major_call(kernel, name, st: _Static, q, k, v, more, q_seg, kv_seg, mask, bias, rows,
                  outs, *, bwd, bias_grad=False):
  """``kernel`` per (query tile, batch, query head) on a q tile, all of k and v, ``more`` (tiled
  as q, or [B, Hq, Sq] rows), the segment ids, mask / bias stripes [bq, Sk] and the schedule row
  -> ``outs`` (tiled as ``more``) and, with ``bias_grad``, aliased zero dbias [B, Hq, Sq, Sk]
  fp32 stripes. ``bwd``: the backward's launch parameters."""
  b, sq, hq, _ = q.shape
  sk, g, bq, nq = k.shape[1], hq // k.shape[2], st.block_q, rows.shape[2]
  grid, tile_axis, order = _launch_order(st, nq, b, hq)
  spec = _tile_specs(order, lambda t: nq - 1 - t)
  tile = lambda x: (spec((None, bq, None, x.shape[-1]), lambda i, bi, h: (bi, i, h, 0))
                    if x.ndim == 4 else spec((None, None, bq), lambda i, bi, h: (bi, h, i)))
  full = lambda x: spec((None, sk, None, x.shape[-1]), lambda i, bi, h: (bi, 0, h // g, 0))
  in_specs = [tile(q), full(k), full(v), *map(tile, more)]
  args = [q, k, v, *more]
  if q_seg is not None:
    in_specs += [spec((None, bq), lambda i, bi, h: (bi, i)),
                 spec((None, sk), lambda i, bi, h: (bi, 0))]
    args += [q_seg, kv_seg]
  for x in (mask, bias):
    if x is not None:
      xb, xh = x.shape[0] > 1, x.shape[1] > 1
      in_specs.append(spec((None, None, bq, sk), lambda i, bi, h, xb=xb, xh=xh:
                           (bi if xb else 0, h if xh else 0, i, 0)))
      args.append(x)
  rb, rh = _row_index_maps(rows)
  in_specs.append(spec((None, None, None, rows.shape[-1]),
                       lambda i, bi, h: (rb(bi), rh(h // g), i, 0)))
  args.append(rows)
  out_specs, aliases = [tile(x) for x in outs], {}
  if bias_grad:
    dbias_spec = spec((None, None, bq, sk), lambda i, bi, h: (bi, h, i, 0))
    aliases = {len(args): len(outs)}
    in_specs.append(dbias_spec)
    args.append(jnp.zeros((b, hq, sq, sk), jnp.float32))
    out_specs.append(dbias_spec)
    outs = [*outs, jax.ShapeDtypeStruct((b, hq, sq, sk), jnp.float32)]
  launch = (st.bwd_num_warps, st.bwd_num_stages) if bwd else (st.num_warps, st.num_stages)
  return pl.pallas_call(
      functools.partial(kernel, st=st, num_q_tiles=nq, tile_axis=tile_axis,
                        has=(q_seg is not None, mask is not None, bias is not None, bias_grad)),
      grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=outs,
      input_output_aliases=aliases, compiler_params=compat.triton_compiler_params(*launch),
      interpret=st.interpret, name=name)(*args)


def _fwd_call(q, k, v, q_seg, kv_seg, mask, bias, rows, st: _Static):
  """Padded inputs -> (out, lse fp32); rows past the schedule's tiles get out 0 and lse -inf."""
  b, sq, hq, _ = q.shape
  n = rows.shape[2] * st.block_q
  assert n <= sq and k.shape[1] % st.block_k == 0, (n, sq, k.shape, st.block_k)
  outs = [jax.ShapeDtypeStruct((b, n, hq, v.shape[-1]), q.dtype),
          jax.ShapeDtypeStruct((b, hq, n), jnp.float32)]
  out, lse = _q_major_call(_fwd_kernel, "jattn_flash_fwd", st, q, k, v, (), q_seg, kv_seg, mask,
                           bias, rows, outs, bwd=False)
  return pad_axis(out, 1, sq), pad_axis(lse, 2, sq, _NEG_INF)


def _dkv_kernel(*refs, st: _Static, has: tuple, groups: int, tile_axis: int):
  """Refs: q [Sq, G, D], k [bk, D], v [bk, Dv], do [Sq, G, Dv], lse2 [G, Sq], delta [G, Sq],
  (q_seg [Sq], kv_seg [bk]), (mask [G | 1, Sq, bk] int8), (bias [G | 1, Sq, bk]), row [W]
  -> dk [bk, D], dv [bk, Dv], summed over the GQA group."""
  ((q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), (qseg_ref, kseg_ref),
   (mask_ref, bias_ref), row_ref, (dk_ref, dv_ref)) = _split_refs(refs, 6, has)
  bq, bk, cq = st.block_q, st.block_k, st.dkv_q_chunk
  assert k_ref.shape[0] == bk and bq % cq == 0, (k_ref.shape, bq, cq)

  ki = pl.program_id(tile_axis)  # causal: kv tile 0 sees every query tile (heaviest first)
  k, v = k_ref[...], v_ref[...]  # [bk, D], [bk, Dv]
  k_pos = ki * bk + lax.iota(jnp.int32, bk)  # [bk]
  k_seg = None if kseg_ref is None else kseg_ref[...]  # [bk]

  # Computed kv-major ([bk, cq] = transposed logits): P and dS feed the dK/dV dots directly.
  def step(tile, c, carry, g, masked):
    dk, dv = carry  # [bk, D], [bk, Dv] fp32
    start = pl.multiple_of(tile * bq + c * cq, cq)
    q = q_ref[pl.ds(start, cq), g, :]  # [cq, D]
    lse2 = lse_ref[g, pl.ds(start, cq)]  # [cq]
    s_t, th_t = _logits(k, q, st)  # [bk, cq]
    rows = pl.ds(start, cq)
    # the group's mask / bias rows (one shared by the group when it has one head)
    tile_t = lambda ref: None if ref is None else ref[g if ref.shape[0] > 1 else 0, rows, :].T
    vis_t = mask_t = None
    if masked:
      q_pos = start + lax.iota(jnp.int32, cq) + (st.kv_len - st.q_len)
      q_seg = None if qseg_ref is None else qseg_ref[rows]
      vis_t = _tile_mask(q_pos, k_pos, q_seg, k_seg, st, kv_major=True)  # [bk, cq]
      mask_t = tile_t(mask_ref)
    s_t, vis_t = _bias_and_vis(s_t, tile_t(bias_ref), mask_t, vis_t)
    p_t = jnp.exp2(s_t - lse2[None, :])  # [bk, cq]
    if vis_t is not None:  # p = 0 where hidden, even with a NaN lse row or a NaN key
      p_t = jnp.where(vis_t, p_t, 0.0)
    do = do_ref[pl.ds(start, cq), g, :]  # [cq, Dv]
    dv = dv + _dot(p_t.astype(do.dtype), do)  # [bk, Dv]
    delta = delta_ref[g, pl.ds(start, cq)]  # [cq]
    dp_t = _dot(v, do, trans_b=True)  # [bk, cq]
    ds_t = p_t * (dp_t - delta[None, :])  # d loss / d capped logit
    if vis_t is not None:  # ... and dS = 0 (a NaN delta or value there)
      ds_t = jnp.where(vis_t, ds_t, 0.0)
    if th_t is not None:
      ds_t = ds_t * (1.0 - th_t * th_t)
    dk = dk + _dot(ds_t.astype(q.dtype), q)  # [bk, D]
    return dk, dv

  def head(g, carry):
    return _walk_row(row_ref, bq // cq, functools.partial(step, g=g), carry)

  carry = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  dk, dv = head(0, carry) if groups == 1 else lax.fori_loop(0, groups, head, carry)
  dk_ref[...] = (dk * st.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(*refs, st: _Static, has: tuple, num_q_tiles: int, tile_axis: int):
  """Refs: q [bq, D], k [Sk, D], v [Sk, Dv], do [bq, Dv], lse2 [bq], delta [bq], (q_seg [bq],
  kv_seg [Sk]), (mask [bq, Sk] int8), (bias [bq, Sk]), row [W], (dbias [bq, Sk] zeros, aliased)
  -> dq [bq, D], (dbias: dlogits on the visited tiles)."""
  ((q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), (qseg_ref, kseg_ref),
   (mask_ref, bias_ref), row_ref, outs) = _split_refs(refs, 6, has[:3])
  dq_ref, dbias_ref = (outs[-2], outs[-1]) if has[3] else (outs[0], None)
  bq, bk, ck = st.block_q, st.block_k, st.dq_k_chunk
  assert q_ref.shape[0] == bq and bk % ck == 0, (q_ref.shape, bk, ck)

  logits = _q_tile_logits(st, num_q_tiles, tile_axis, qseg_ref, kseg_ref, mask_ref, bias_ref)
  q, do = q_ref[...], do_ref[...]  # [bq, D], [bq, Dv]
  lse2, delta = lse_ref[...], delta_ref[...]  # [bq]

  def step(tile, c, dq, masked):
    start = pl.multiple_of(tile * bk + c * ck, ck)
    k = k_ref[pl.ds(start, ck), :]  # [ck, D]
    v = v_ref[pl.ds(start, ck), :]  # [ck, Dv]
    if masked:  # non-finite entries -> 0 (rows that see them have a NaN log-sum-exp)
      k, v = softmax.zero_nonfinite(k), softmax.zero_nonfinite(v)
    s, th = logits(q, k, start, masked)
    p = jnp.exp2(s - lse2[:, None])  # [bq, ck]
    dp = _dot(do, v, trans_b=True)  # [bq, ck]
    ds = p * (dp - delta[:, None])  # d loss / d logit (= d loss / d bias)
    if dbias_ref is not None:
      dbias_ref[:, pl.ds(start, ck)] = ds
    if th is not None:
      ds = ds * (1.0 - th * th)
    return dq + _dot(ds.astype(k.dtype), k)  # [bq, D]

  dq = _walk_row(row_ref, bk // ck, step, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * st.scale).astype(dq_ref.dtype)


def _bwd_calls(q, k, v, q_seg, kv_seg, mask, bias, dq_rows, dkv_rows, out, lse, d_out, d_lse,
               st: _Static, bias_grad=False):
  """Padded inputs, a forward's (out, lse) and cotangents (padded rows: d_out 0, lse -inf) ->
  (dq, dk, dv) in the input dtypes and dbias [B, Hq, Sq, Sk] fp32 (None unless ``bias_grad``)."""
  delta = softmax.delta_rows(out, d_out, d_lse)  # [B, Hq, Sq] fp32
  lse2 = softmax.lse_base2(lse)  # base 2, +inf -> p = 0
  do = d_out.astype(q.dtype)
  dkv_st = st
  if st.dkv_block_q is not None:
    dkv_st = dataclasses.replace(st, block_q=st.dkv_block_q,
                                 dkv_q_chunk=min(st.dkv_q_chunk, st.dkv_block_q))
  dk, dv = _dkv_call(q, k, v, q_seg, kv_seg, mask, bias, dkv_rows, do, lse2, delta, dkv_st)
  b, sq, hq, d = q.shape
  n = dq_rows.shape[2] * st.block_q
  assert n <= sq and sq % st.block_q == 0 and k.shape[1] % st.block_k == 0, (n, sq, k.shape, st)
  dq, *dbias = _q_major_call(_dq_kernel, "jattn_flash_bwd_dq", st, q, k, v, (do, lse2, delta),
                             q_seg, kv_seg, mask, bias, dq_rows,
                             [jax.ShapeDtypeStruct((b, n, hq, d), q.dtype)], bwd=True,
                             bias_grad=bias_grad)
  return (pad_axis(dq, 1, sq), pad_axis(dk, 1, k.shape[1]), pad_axis(dv, 1, k.shape[1]),
          dbias[0] if bias_grad else None)


def _dkv_call(q, k, v, q_seg, kv_seg, mask, bias, rows, do, lse2, delta, st: _Static):
  """dK / dV (padded inputs; ``rows``: transposed q lists) -> dk, dv [B, nk * bk, Hk, D | Dv]."""
  b, sq, hq, _ = q.shape
  _, sk, hk, _ = v.shape
  g, bq, bk, nk = hq // hk, st.block_q, st.block_k, rows.shape[2]
  assert nk * bk <= sk and sq % bq == 0 and sk % bk == 0, (nk, sq, sk, bq, bk)
  has_seg = q_seg is not None

  # Programs over (kv tile, batch, kv head); kv tile 0 is the heaviest causal one.
  grid, tile_axis, order = _launch_order(st, nk, b, hk)
  spec = _tile_specs(order, lambda t: t)
  rb, rh = _row_index_maps(rows)
  group = lambda x: spec((None, sq, g, x.shape[-1]), lambda i, bi, h: (bi, 0, h, 0))  # q, do
  tile = lambda x: spec((None, bk, None, x.shape[-1]), lambda i, bi, h: (bi, i, h, 0))  # k, v
  stats = spec((None, g, sq), lambda i, bi, h: (bi, h, 0))  # lse2, delta
  in_specs = [group(q), tile(k), tile(v), group(do), stats, stats]
  args = [q, k, v, do, lse2, delta]
  if has_seg:
    in_specs += [spec((None, sq), lambda i, bi, h: (bi, 0)),
                 spec((None, bk), lambda i, bi, h: (bi, i))]
    args += [q_seg, kv_seg]
  for x in (mask, bias):   # [1 | B, 1 | Hq, Sq, Sk]: the group's heads of kv head h
    if x is not None:
      xb, xg = x.shape[0] > 1, g if x.shape[1] > 1 else 1
      in_specs.append(spec((None, xg, sq, bk), lambda i, bi, h, xb=xb, xh=x.shape[1] > 1:
                           (bi if xb else 0, h if xh else 0, 0, i)))
      args.append(x)
  in_specs.append(spec((None, None, None, rows.shape[-1]), lambda i, bi, h: (rb(bi), rh(h), i, 0)))
  args.append(rows)
  return pl.pallas_call(
      functools.partial(_dkv_kernel, st=st, has=(has_seg, mask is not None, bias is not None),
                        groups=g, tile_axis=tile_axis),
      grid=grid, in_specs=in_specs, out_specs=[tile(k), tile(v)],
      out_shape=[jax.ShapeDtypeStruct((b, nk * bk) + x.shape[2:], x.dtype) for x in (k, v)],
      compiler_params=compat.triton_compiler_params(st.bwd_num_warps, st.bwd_num_stages),
      interpret=st.interpret, name="jattn_flash_bwd_dkv")(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _flash_padded(st, bst, q, k, v, q_seg, kv_seg, mask, bias, fwd_rows, dq_rows, dkv_rows):
  """st / fwd_rows: the forward's tiles and kv lists; bst, dq_rows, dkv_rows: the backward's."""
  return _fwd_call(q, k, v, q_seg, kv_seg, mask, bias, fwd_rows, st)


def _flash_padded_fwd(st, bst, *args):
  # symbolic zeros: ``perturbed`` says whether the bias is differentiated (the dbias stripes are
  # [B, Hq, Sq, Sk] fp32: written only when needed).
  q, k, v, q_seg, kv_seg, mask, bias, fwd_rows, dq_rows, dkv_rows = (
      None if a is None else a.value for a in args)
  out, lse = _fwd_call(q, k, v, q_seg, kv_seg, mask, bias, fwd_rows, st)
  bias_grad = () if bias is not None and args[6].perturbed else None   # a static marker
  return (out, lse), (q, k, v, q_seg, kv_seg, mask, bias, dq_rows, dkv_rows, out, lse, bias_grad)


def _flash_padded_bwd(st, bst, res, cts):
  del st
  q, k, v, q_seg, kv_seg, mask, bias, dq_rows, dkv_rows, out, lse, bias_grad = res
  d_out, d_lse = (jnp.zeros(c.shape, c.dtype) if isinstance(c, SymbolicZero) else c for c in cts)
  dq, dk, dv, dbias = _bwd_calls(q, k, v, q_seg, kv_seg, mask, bias, dq_rows, dkv_rows, out, lse,
                                 d_out, d_lse, bst, bias_grad is not None)
  if dbias is not None:   # reduce over the bias's shared (size-1) batch / head axes
    axes = tuple(a for a in (0, 1) if bias.shape[a] == 1)
    dbias = jnp.sum(dbias, axis=axes, keepdims=True).astype(bias.dtype)
  return dq, dk, dv, None, None, None, dbias, None, None, None


_flash_padded.defvjp(_flash_padded_fwd, _flash_padded_bwd, symbolic_zeros=True)


def _pack_rows(indices, counts, partial):
  """[Bs, Hs, n, L] lists -> int32 [Bs, Hs, n, W] rows ``[count, n_full, full..., partial...]``:
  W is a power of two >= L + 3 (``_walk_row`` prefetches one entry past the last visited tile)."""
  length = indices.shape[-1]
  j = jnp.arange(length, dtype=jnp.int32)
  valid = j < counts[..., None]
  part = (partial != 0) & valid
  key = jnp.where(valid, jnp.where(part, length + j, j), 2 * length + j)
  order = jnp.argsort(key, axis=-1)
  idx = jnp.take_along_axis(indices.astype(jnp.int32), order, axis=-1)
  counts = counts.astype(jnp.int32)
  n_full = counts - jnp.sum(part, axis=-1, dtype=jnp.int32)
  width = next_pow2(length + 3)
  pad = jnp.zeros(idx.shape[:-1] + (width - length - 2,), jnp.int32)
  return jnp.concatenate([counts[..., None], n_full[..., None], idx, pad], axis=-1)


def _check_shapes(q, k, v, q_segment_ids, kv_segment_ids):
  """ValueError / TypeError for inputs the kernels do not take; -> (b, sq, hq, d, sk, hk, d_v)."""
  b, sq, hq, d, sk, hk, d_v = util.check_qkv_shapes(q, k, v, same_dv=False)
  if not (1 <= d <= 256 and 1 <= d_v <= 256):
    raise ValueError(f"head_dim must be <= 256, got {d} (v: {d_v})")
  if not (q.dtype == k.dtype == v.dtype):
    raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  if q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
    raise TypeError(f"dtype must be float32, bfloat16 or float16, got {q.dtype}")
  check_segment_ids(q_segment_ids, kv_segment_ids, q.shape, k.shape)
  return b, sq, hq, d, sk, hk, d_v


def _check_schedule(what, sch, b, sq, sk, hk):
  if (sch.q_len, sch.kv_len) != (sq, sk):
    raise ValueError(f"{what} is for lengths ({sch.q_len}, {sch.kv_len}), inputs have "
                     f"({sq}, {sk})")
  for name, n in (("block_q", sch.block_q), ("block_k", sch.block_k)):
    if n < 16 or n & (n - 1):
      raise ValueError(f"{what} {name} must be a power of two >= 16 for the Triton kernel, "
                       f"got {n}")
  for arr in (sch.kv_indices, sch.q_indices):
    bs, hs = arr.shape[:2]
    if bs not in (1, b) or hs not in (1, hk):
      raise ValueError(f"{what} leading dims must be [1|{b}, 1|{hk}], got {arr.shape[:2]}")


def _pad_inputs(q, k, v, q_seg, kv_seg, sq_p, sk_p):
  """Pad sequences to (sq_p, sk_p) and head dims to Triton's powers of two."""
  d_p, dv_p = next_pow2(q.shape[-1], minimum=16), next_pow2(v.shape[-1], minimum=16)
  qp = pad_axis(pad_axis(q, 1, sq_p), 3, d_p)
  kp = pad_axis(pad_axis(k, 1, sk_p), 3, d_p)
  vp = pad_axis(pad_axis(v, 1, sk_p), 3, dv_p)
  seg = lambda x, n: None if x is None else pad_axis(x.astype(jnp.int32), 1, n)
  return qp, kp, vp, seg(q_seg, sq_p), seg(kv_seg, sk_p)


def _statics(bs: BlockSizes, q, v, *, causal, window, scale, soft_cap, interpret, dkv_block_q):
  """(forward, backward) ``_Static``s of a call: ``bs``'s values, defaults for its None fields."""
  bbq, bbk = bs.bwd_tiles
  defaults = _launch_defaults(bs, next_pow2(q.shape[-1], minimum=16),
                              next_pow2(v.shape[-1], minimum=16), q.dtype)
  launch = {f: getattr(bs, f) or defaults[f] for f in _LAUNCH_FIELDS}
  for name, blk in (("dkv_q_chunk", dkv_block_q), ("dq_k_chunk", bbk)):
    launch[name] = c = min(launch[name], blk)
    if c < 16 or blk % c:
      raise ValueError(f"{name}={c} must be >= 16 and divide the backward tile {blk}")
  st = _Static(
      block_q=bs.block_q, block_k=bs.block_k, q_len=q.shape[1], kv_len=v.shape[1],
      causal=bool(causal), window=window, scale=float(scale),
      soft_cap=None if soft_cap is None else float(soft_cap), interpret=bool(interpret),
      **{f: int(x) for f, x in launch.items()})
  bst = dataclasses.replace(st, block_q=bbq, block_k=bbk,
                            dkv_block_q=None if dkv_block_q == bbq else dkv_block_q)
  return st, bst


def flash_attention(q, k, v, q_segment_ids, kv_segment_ids, schedule: BlockSchedule, *,
                    causal: bool, local_window_size, scale: float | None,
                    logits_soft_cap: float | None, interpret: bool = False,
                    block_sizes: BlockSizes | None = None,
                    bwd_schedule: BlockSchedule | None = None,
                    dkv_schedule: BlockSchedule | None = None, mask=None, bias=None):
  """Flash attention on the GPU (Pallas, Triton lowering), walking a block schedule.

  Differentiable (custom_vjp) in q, k, v and ``bias``, including through the returned LSE.

  Args:
    q, k, v, q_segment_ids, kv_segment_ids, causal, local_window_size, scale, logits_soft_cap:
      as for ``reference.attention_reference`` (segment ids: both or neither); fp32, bf16 or
      fp16, head dims <= 256.
    schedule: ``make_schedule(Sq, Sk, block_q, block_k, ...)`` for the same mask; it drives the
      forward, its tiles (powers of two >= 16) are the forward kernel's.
    interpret: run the kernels in the Pallas interpreter (CPU).
    block_sizes: optional ``BlockSizes`` (launch parameters) whose tiles match the schedules'
      (None: ``BlockSizes(schedule.block_q, schedule.block_k)``).
    bwd_schedule, dkv_schedule: the same mask's schedule at the backward's tiles (None:
      ``schedule``) and for the dK/dV kernel (None: ``bwd_schedule``).
    mask: None or bool [1 | B, 1 | Hq, Sq, Sk], an element mask (True: visible) that the kernels
      read in the schedules' partial tiles (build the schedules with ``make_schedule(...,
      mask=...)``); a size-1 axis is shared.
    bias: None or float [1 | B, 1 | Hq, Sq, Sk], added to the (soft-capped) logits; its
      gradient is computed only when it is differentiated ([B, Hq, Sq, Sk] fp32 in the backward).

  Returns:
    (out, lse) as ``reference.attention_reference`` (a row that sees no key: out 0, lse -inf).

  Example:
    >>> from pallas_kernels.block_schedule import make_schedule
    >>> q = jax.random.normal(jax.random.key(0), (1, 100, 2, 32))
    >>> s = make_schedule(100, 100, 32, 16, causal=True)
    >>> out, lse = flash_attention(q, q, q, None, None, s, causal=True, local_window_size=None,
    ...                            scale=32 ** -0.5, logits_soft_cap=None, interpret=True)
    >>> out.shape, lse.shape
    ((1, 100, 2, 32), (1, 2, 100))
  """
  b, sq, hq, d, sk, hk, d_v = _check_shapes(q, k, v, q_segment_ids, kv_segment_ids)
  for name, x in (("mask", mask), ("bias", bias)):
    if x is not None and (x.ndim != 4 or x.shape[0] not in (1, b) or x.shape[1] not in (1, hq)
                          or x.shape[2:] != (sq, sk)):
      raise ValueError(f"{name} must be [1 | {b}, 1 | {hq}, {sq}, {sk}], got {x.shape}")
  bwd_schedule = schedule if bwd_schedule is None else bwd_schedule
  dkv_schedule = bwd_schedule if dkv_schedule is None else dkv_schedule
  for what, sch in (("schedule", schedule), ("bwd_schedule", bwd_schedule),
                    ("dkv_schedule", dkv_schedule)):
    _check_schedule(what, sch, b, sq, sk, hk)
  bq, bk = schedule.block_q, schedule.block_k
  bbq, bbk = bwd_schedule.block_q, bwd_schedule.block_k
  dkv_bq = dkv_schedule.block_q
  if dkv_schedule.block_k != bbk:
    raise ValueError(f"dkv_schedule block_k ({dkv_schedule.block_k}) must equal the backward "
                     f"schedule's ({bbk})")
  if block_sizes is None:
    block_sizes = BlockSizes(bq, bk, bwd_block_q=bbq, bwd_block_k=bbk, dkv_block_q=dkv_bq)
  if (block_sizes.block_q, block_sizes.block_k) != (bq, bk):
    raise ValueError(f"block_sizes tiles ({block_sizes.block_q}, {block_sizes.block_k}) differ "
                     f"from the schedule's ({bq}, {bk})")
  for what, arg, tiles, want in (("backward", "bwd", block_sizes.bwd_tiles, (bbq, bbk)),
                                 ("dK/dV", "dkv", block_sizes.dkv_tiles, (dkv_bq, bbk))):
    if tiles != want:
      raise ValueError(f"block_sizes {what} tiles {tiles} differ from the {what} schedule's "
                       f"{want}: pass {arg}_schedule=make_schedule(..., {tiles[0]}, {tiles[1]}, "
                       "<same mask>)")
  st, bst = _statics(block_sizes, q, v, causal=causal, window=normalize_window(local_window_size),
                     scale=d ** -0.5 if scale is None else scale, soft_cap=logits_soft_cap,
                     interpret=interpret, dkv_block_q=dkv_bq)

  sq_p, sk_p = round_up(sq, max(bq, bbq, dkv_bq)), round_up(sk, max(bk, bbk))
  qp, kp, vp, qs, ks = _pad_inputs(q, k, v, q_segment_ids, kv_segment_ids, sq_p, sk_p)
  pad2 = lambda x: pad_axis(pad_axis(x, 2, sq_p), 3, sk_p)   # padded keys stay masked
  mask = None if mask is None else pad2(mask.astype(jnp.int8))
  kv_rows = lambda s: _pack_rows(s.kv_indices, s.kv_counts, s.kv_partial)
  fwd_rows = kv_rows(schedule)
  dq_rows = fwd_rows if bwd_schedule is schedule else kv_rows(bwd_schedule)
  dkv_rows = _pack_rows(dkv_schedule.q_indices, dkv_schedule.q_counts, dkv_schedule.q_partial)
  out, lse = _flash_padded(st, bst, qp, kp, vp, qs, ks, mask, None if bias is None else pad2(bias),
                           fwd_rows, dq_rows, dkv_rows)
  return out[:, :sq, :, :d_v], lse[:, :, :sq]


def flash_attention_bwd(q, k, v, out, lse, d_out, d_lse, *, causal: bool, scale: float,
                        local_window_size=None, logits_soft_cap: float | None = None,
                        q_segment_ids=None, kv_segment_ids=None,
                        schedule: BlockSchedule | None = None,
                        block_sizes: BlockSizes | None = None, interpret: bool = False):
  """The Triton backward kernels (dK/dV, dQ) for another forward's residuals, walking
  ``schedule`` or, without one, ``make_schedule`` at ``block_sizes.bwd_tiles``.

  Args:
    q, k, v, causal, scale, local_window_size, logits_soft_cap, q_segment_ids, kv_segment_ids:
      the forward's (unpadded), as for ``flash_attention``.
    out, lse: the forward's output [B, Sq, Hq, Dv] and log-sum-exp [B, Hq, Sq] fp32 (natural
      log, -inf for rows that see no key).
    d_out, d_lse: their cotangents (d_lse: zeros when only out is used).
    schedule: optional block schedule of the mask; its tiles are the backward's.
    block_sizes: ``BlockSizes`` whose backward fields are used (None: with a schedule, its
      tiles and default launch parameters; else ``default_block_sizes(D, q.dtype)``).
    interpret: run the kernels in the Pallas interpreter (CPU).

  Returns:
    (dq, dk, dv) in the dtypes and shapes of q, k, v.

  Example:
    >>> from pallas_kernels.flash.reference import attention_reference
    >>> q = jax.random.normal(jax.random.key(0), (1, 40, 2, 32))
    >>> out, lse = attention_reference(q, q, q, causal=True)
    >>> dq, dk, dv = flash_attention_bwd(q, q, q, out, lse, out, jnp.zeros_like(lse),
    ...                                  causal=True, scale=32 ** -0.5, interpret=True)
    >>> dq.shape
    (1, 40, 2, 32)
  """
  b, sq, hq, d, sk, hk, d_v = _check_shapes(q, k, v, q_segment_ids, kv_segment_ids)
  if out.shape != (b, sq, hq, d_v) or lse.shape != (b, hq, sq):
    raise ValueError(f"residuals out {out.shape} / lse {lse.shape} do not match q {q.shape}, "
                     f"v {v.shape}")
  window = normalize_window(local_window_size)
  if block_sizes is None:
    block_sizes = (default_block_sizes(max(d, d_v), q.dtype) if schedule is None
                   else BlockSizes(schedule.block_q, schedule.block_k))
  bbq, bbk = block_sizes.bwd_tiles
  if schedule is None:
    schedule = make_schedule(sq, sk, bbq, bbk, causal=causal, local_window_size=window,
                             q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
  elif (schedule.block_q, schedule.block_k) != (bbq, bbk):
    raise ValueError(f"schedule tiles ({schedule.block_q}, {schedule.block_k}) differ from "
                     f"block_sizes.bwd_tiles {block_sizes.bwd_tiles}")
  _check_schedule("schedule", schedule, b, sq, sk, hk)
  _, bst = _statics(block_sizes, q, v, causal=causal, window=window, scale=scale,
                    soft_cap=logits_soft_cap, interpret=interpret, dkv_block_q=bbq)
  sq_p, sk_p = round_up(sq, bbq), round_up(sk, bbk)
  qp, kp, vp, qs, ks = _pad_inputs(q, k, v, q_segment_ids, kv_segment_ids, sq_p, sk_p)
  # Padded query rows get d_out = 0, d_lse = 0 and lse = -inf (p = 0): they add nothing.
  pad_rows = lambda x: pad_axis(pad_axis(x, 1, sq_p), 3, vp.shape[-1])
  outp, dop = pad_rows(out), pad_rows(d_out.astype(q.dtype))
  lsep = pad_axis(lse.astype(jnp.float32), 2, sq_p, _NEG_INF)
  dlsep = pad_axis(d_lse.astype(jnp.float32), 2, sq_p)
  dq_rows = _pack_rows(schedule.kv_indices, schedule.kv_counts, schedule.kv_partial)
  dkv_rows = _pack_rows(schedule.q_indices, schedule.q_counts, schedule.q_partial)
  dq, dk, dv, _ = _bwd_calls(qp, kp, vp, qs, ks, None, None, dq_rows, dkv_rows, outp, lsep, dop,
                             dlsep, bst)
  return dq[:, :sq, :, :d], dk[:, :sk, :, :d], dv[:, :sk, :, :d_v]


__all__ = ["BlockSizes", "default_block_sizes", "flash_attention", "flash_attention_bwd"]
