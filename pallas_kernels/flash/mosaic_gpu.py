"""Flash attention for Hopper (sm90): the Pallas Mosaic GPU forward (``mosaic_gpu_fwd_kernel``)
with a Triton or Mosaic GPU backward. Here: ``BlockSizes``, the tuned defaults and
``flash_attention`` (padding, segment ids, schedules, the custom_vjp).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import compat, tuning
from pallas_kernels.block_schedule import check_schedule_args
from pallas_kernels.common.merge import merge_partials
from pallas_kernels.common.util import check_int, check_qkv_shapes, check_segment_ids, pad_axis
from pallas_kernels.flash import mosaic_gpu_bwd
from pallas_kernels.flash import mosaic_gpu_fwd_kernel as fk

__all__ = ["BlockSizes", "PROTOCOLS", "default_block_sizes", "fit_block_sizes",
           "fit_tail_kv_splits", "flash_attention"]

PROTOCOLS = fk.PROTOCOLS
_COMPUTE_WGS = fk.COMPUTE_WGS
HEAD_DIMS = (64, 128, 256)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles, ring depth and barrier protocol of the Mosaic GPU forward.

  Attributes:
    block_q, block_k: query rows per compute warpgroup (2 per program) and keys per kv tile,
      multiples of 64 (wgmma's M).
    num_stages: K/V shared-memory slots in the TMA ring (>= 2).
    protocol: a key of ``PROTOCOLS`` (see ``mosaic_gpu_fwd_kernel.Protocol``); how the two
      compute warpgroups share the tensor cores and the ring. Results are the same for all.
    backward: "triton" (the Triton dK/dV and dQ kernels) or "mosaic" (``mosaic_gpu_bwd``).
    q_tiles_per_program: P >= 1 query tiles per program, the K/V ring running on across them.
      P > 1 needs protocol "overlap" and no segment ids or block schedule; not for D256.
    one_segment_static_mask: with segment ids, a warpgroup whose walk holds one nonzero id on
      both sides masks edge tiles with the static mask only (the same result).
    tail_kv_splits: C > 0: the partial last wave (Hq programs) runs as a second launch over C
      key chunks, merged by log-sum-exp (``fit_tail_kv_splits`` says where it applies).

  Example:
    >>> BlockSizes(64, 128, 2, protocol="overlap", q_tiles_per_program=2).rows_per_program
    128
  """
  block_q: int = 64
  block_k: int = 128
  num_stages: int = 2
  protocol: str = "pingpong"
  backward: str = "triton"
  q_tiles_per_program: int = 1
  one_segment_static_mask: bool = False
  tail_kv_splits: int = 0

  def __post_init__(self):
    if self.protocol not in PROTOCOLS:
      raise ValueError(f"protocol must be one of {sorted(PROTOCOLS)}, got {self.protocol!r}")
    if self.backward not in ("triton", "mosaic"):
      raise ValueError(f"backward must be 'triton' or 'mosaic', got {self.backward!r}")
    for name, n in (("block_q", self.block_q), ("block_k", self.block_k)):
      if n % 64 or n <= 0:
        raise ValueError(f"{name} must be a positive multiple of 64, got {n}")
    if self.num_stages < 2:
      raise ValueError(f"num_stages must be >= 2, got {self.num_stages}")
    p, c = self.q_tiles_per_program, self.tail_kv_splits
    check_int("q_tiles_per_program", p)
    check_int("tail_kv_splits", c, lo=0)
    if p > 1 and self.protocol != "overlap":
      raise ValueError(f"q_tiles_per_program={p} (> 1) needs protocol='overlap' (its hand-over "
                       f"turns run on across a program's query tiles), got {self.protocol!r}")
    if c and p != 1:
      raise ValueError("tail_kv_splits needs q_tiles_per_program=1")

  @property
  def rows_per_program(self) -> int:
    return _COMPUTE_WGS * self.block_q


@functools.lru_cache(maxsize=None)
def _tuned_block_sizes(head_dim: int, device_kind: str | None, mask: str = "all") -> BlockSizes:
  return BlockSizes(**tuning.required_params("mosaic_gpu_fwd", head_dim, "16bit", device_kind,
                                             mask))


def default_block_sizes(head_dim: int, dtype=jnp.bfloat16,
                        device_kind: str | None = None, mask: str = "all") -> BlockSizes:
  """Default ``BlockSizes`` for a head dimension and mask kind, from the device's tuning table.

  Args:
    head_dim, dtype: 64, 128 or 256; bf16 or fp16 (only checked: both have the same tiles).
    device_kind: jax ``device_kind`` whose table to read (default: the first device's).
    mask: "all", "dense", "causal", "window", "causal_window" or "causal_segments"
      (``tuning.mask_kind``).

  Returns:
    A ``BlockSizes``.

  Example:
    >>> default_block_sizes(128).block_k
    128
    >>> default_block_sizes(128, device_kind="NVIDIA H200", mask="causal_window").protocol
    'overlap'
  """
  mosaic_gpu_bwd.check_dtype(dtype, "forward")
  _check_head_dim(head_dim)
  return _tuned_block_sizes(head_dim, tuning.resolve_kind(device_kind), mask)   # cached by kind


def _check_head_dim(d):
  if d not in HEAD_DIMS:
    raise NotImplementedError(f"the Mosaic GPU forward supports head_dim 64, 128 or 256, got {d}")


def fit_block_sizes(bs: BlockSizes, q_shape, k_shape, *, causal=False, window=None,
                    segments=False, schedule=False, core_count=None) -> BlockSizes:
  """A table default fitted to one call: ``fit_tail_kv_splits``, and ``q_tiles_per_program``
  back to 1 where the call has segment ids or a block schedule.

  Args:
    bs, q_shape, k_shape, causal, window, segments, schedule, core_count: as for
      ``fit_tail_kv_splits``.

  Returns:
    A ``BlockSizes``.

  Example:
    >>> bs = BlockSizes(64, 128, 2, protocol="overlap", q_tiles_per_program=2)
    >>> fit_block_sizes(bs, (1, 4096, 8, 128), (1, 4096, 8, 128), causal=True,
    ...                 window=(511, 0), segments=True).q_tiles_per_program
    1
  """
  bs = fit_tail_kv_splits(bs, q_shape, k_shape, causal=causal, window=window, segments=segments,
                          schedule=schedule, core_count=core_count)
  if bs.q_tiles_per_program > 1 and (segments or schedule):
    bs = dataclasses.replace(bs, q_tiles_per_program=1)
  return bs


def fit_tail_kv_splits(bs: BlockSizes, q_shape, k_shape, *, causal=False, window=None,
                       segments=False, schedule=False, core_count=None) -> BlockSizes:
  """``bs`` with ``tail_kv_splits`` kept only where supported and it pays (else 0): dense mask,
  keys a multiple of ``tail_kv_splits * block_k``, (B * Hq * query programs) mod SMs in [1, Hq].

  Args:
    bs, q_shape, k_shape: the forward's ``BlockSizes``; [B, Sq, Hq, D] and [B, Sk, Hk, D].
    causal, window, segments, schedule: the call's masks (window: None or (left, right)).
    core_count: SMs per GPU (default ``compat.gpu_core_count()``, 1 without a GPU: never).

  Returns:
    A ``BlockSizes``.

  Example:
    >>> bs = BlockSizes(64, 128, 2, tail_kv_splits=8)   # B2 S16K H16: 4096 = 31 x 132 + 4
    >>> fit_tail_kv_splits(bs, (2, 16384, 16, 128), (2, 16384, 16, 128),
    ...                    core_count=132).tail_kv_splits
    8
  """
  if not int(bs.tail_kv_splits):
    return bs
  b, sq, hq, _ = q_shape
  sms = compat.gpu_core_count() if core_count is None else int(core_count)
  last = (b * hq * -(-sq // bs.rows_per_program)) % sms
  ok = 1 <= last <= hq and not _tail_unsupported(bs, k_shape, causal=causal, window=window,
                                                  segments=segments, schedule=schedule)
  return bs if ok else dataclasses.replace(bs, tail_kv_splits=0)


def _tail_unsupported(bs: BlockSizes, k_shape, *, causal, window, segments, schedule):
  """What of a call ``tail_kv_splits`` does not support (empty: nothing)."""
  bad = [name for name, on in (("causal", causal), ("a local window", window is not None),
                               ("segment ids", segments), ("a block schedule", schedule)) if on]
  c, sk = int(bs.tail_kv_splits), k_shape[1]
  if sk % (c * bs.block_k):
    bad.append(f"kv length {sk} not a multiple of tail_kv_splits * block_k = {c * bs.block_k}")
  return bad


def _static_config(q_shape, k_shape, dtype, *, causal, scale, block_sizes, interpret=False,
                   bwd_block_sizes=None, local_window_size=None, logits_soft_cap=None,
                   has_seg=False, schedule=None) -> fk.KernelConfig:
  """The kernel's static configuration of a call (the schedule, if any, checked)."""
  _, sq, hq, d = q_shape
  _, sk, hk, _ = k_shape
  window = mosaic_gpu_bwd.check_call_args(sq, sk, local_window_size, logits_soft_cap)
  bs = block_sizes or default_block_sizes(d, dtype)
  _check_head_dim(d)
  backward = "mosaic" if isinstance(bwd_block_sizes, mosaic_gpu_bwd.BlockSizes) else bs.backward
  if backward == "mosaic":
    if bwd_block_sizes is not None and not isinstance(bwd_block_sizes, mosaic_gpu_bwd.BlockSizes):
      raise TypeError(f"backward='mosaic' takes a mosaic_gpu_bwd.BlockSizes as bwd_block_sizes, "
                      f"got {type(bwd_block_sizes)}")
    mosaic_gpu_bwd.check_head_dim(d)              # D256: NotImplementedError now, not at grad
  if bs.q_tiles_per_program > 1 and (has_seg or schedule is not None):
    raise ValueError(f"q_tiles_per_program={bs.q_tiles_per_program} (> 1) runs the range path "
                     f"only: not with segment ids or a block schedule (use "
                     f"q_tiles_per_program=1)")
  extra = {}   # the KernelConfig fields of a schedule and of tail_kv_splits
  if schedule is not None:
    _check_schedule(schedule, q_shape, k_shape, bs,
                    None if backward == "mosaic" else bwd_block_sizes)
    if backward == "mosaic":   # its tiles against the schedule's: now, not at grad time
      mosaic_gpu_bwd.check_schedule(schedule, q_shape, k_shape, bwd_block_sizes or (
          mosaic_gpu_bwd.call_block_sizes(d, dtype, causal=causal, window=window,
                                          has_seg=has_seg, schedule=schedule)))
    bsz, hsz = schedule.kv_indices.shape[:2]
    extra = dict(has_sched=True, sched_batch=q_shape[0] > 1 and (has_seg or bsz > 1),
                 sched_heads=hsz > 1)
  c = int(bs.tail_kv_splits)
  if c:
    bad = _tail_unsupported(bs, k_shape, causal=causal, window=window, segments=has_seg,
                            schedule=schedule is not None)
    if bad:
      raise ValueError(f"tail_kv_splits={c} (dense masks only) does not support " + "; ".join(bad))
    extra.update(tail_batch=int(q_shape[0]) - 1, tail_kv_splits=c)
  return fk.KernelConfig(
      block_q=bs.block_q, block_k=bs.block_k, num_stages=bs.num_stages, q_len=sq, kv_len=sk,
      num_q_programs=-(-sq // bs.rows_per_program), num_kv_tiles=-(-sk // bs.block_k),
      head_dim=d, group=hq // hk, causal=bool(causal),
      scale=float(d ** -0.5 if scale is None else scale), dtype=jnp.dtype(dtype),
      window=window, soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
      has_seg=bool(has_seg), interpret=bool(interpret), bwd_block_sizes=bwd_block_sizes,
      backward=backward, protocol=bs.protocol, q_tiles_per_program=int(bs.q_tiles_per_program),
      one_seg_mask=bool(bs.one_segment_static_mask), **extra)


def _forward_impl(q, k, v, q_seg, kv_seg, schedule, st: fk.KernelConfig, kv_prefix=()):
  """Unpadded inputs -> (out, lse natural log), by ``fk.fwd_call`` on whole tiles."""
  sq_pad = st.num_q_programs * _COMPUTE_WGS * st.block_q
  sk_pad = (st.num_kv_tiles - st.prefix_tiles) * st.block_k
  q_p, k_p, v_p = pad_axis(q, 1, sq_pad), pad_axis(k, 1, sk_pad), pad_axis(v, 1, sk_pad)
  q_seg_p = kv_seg_p = None
  if st.has_seg:
    q_seg_p = pad_axis(q_seg.astype(jnp.int32), 1, sq_pad)      # padding: segment 0
    kv_seg_p = pad_axis(kv_seg.astype(jnp.int32), 1, sk_pad)
  if st.has_sched:
    walk = fk.schedule_walk(schedule, st, q_seg_p, kv_seg_p)
    out, lse = fk.fwd_call(q_p, k_p, v_p, st, q_seg_p, kv_seg_p, walk_rows=walk)
  elif st.has_seg:
    out, lse = fk.fwd_call(q_p, k_p, v_p, st, q_seg_p, kv_seg_p,
                           fk.seg_bounds(q_seg_p, kv_seg_p, st))
  elif kv_prefix:
    out, lse = fk.fwd_call(q_p, k_p, v_p, st, kv_prefix=kv_prefix)
  else:
    out, lse = fk.fwd_call(q_p, k_p, v_p, st)
    if st.tail_kv_splits:
      out, lse = _tail_fixup(q_p, k_p, v_p, out, lse, st)
  return out[:, :st.q_len], lse[:, :, :st.q_len]


_forward = jax.custom_vjp(lambda q, k, v, q_seg, kv_seg, schedule, st: _forward_impl(
    q, k, v, q_seg, kv_seg, schedule, st), nondiff_argnums=(6,))


def _forward_fwd(q, k, v, q_seg, kv_seg, schedule, st):
  out, lse = _forward_impl(q, k, v, q_seg, kv_seg, schedule, st)
  return (out, lse), (q, k, v, q_seg, kv_seg, schedule, out, lse)


def _forward_bwd(st, res, cts):
  """The backward kernels (``st.backward``: Triton or Mosaic GPU) on this forward's residuals."""
  q, k, v, q_seg, kv_seg, schedule, out, lse = res
  d_out, d_lse = cts
  kw = {"causal": st.causal, "scale": st.scale, "local_window_size": st.window,
        "logits_soft_cap": st.soft_cap, "q_segment_ids": q_seg, "kv_segment_ids": kv_seg,
        "schedule": schedule, "block_sizes": st.bwd_block_sizes}
  if st.backward == "mosaic":
    grads = mosaic_gpu_bwd.flash_attention_bwd(q, k, v, out, lse, d_out, d_lse=d_lse, **kw)
  else:
    from pallas_kernels.flash import triton as ft  # local: the forward alone needs none
    grads = ft.flash_attention_bwd(q, k, v, out, lse, d_out, d_lse, interpret=st.interpret, **kw)
  return tuple(grads) + (None, None, None)


_forward.defvjp(_forward_fwd, _forward_bwd)


def _tail_fixup(q_p, k_p, v_p, out, lse, st: fk.KernelConfig):
  """``tail_kv_splits``: the skipped rows by a launch over key chunks, merged into out / lse."""
  c, bb = st.tail_kv_splits, st.tail_batch
  _, _, hq, d = q_p.shape
  sk_pad, hk = k_p.shape[1], k_p.shape[2]
  rows = _COMPUTE_WGS * st.block_q
  r0 = (st.num_q_programs - 1) * rows
  q_t = jnp.broadcast_to(q_p[bb, r0:r0 + rows][None], (c, rows, hq, d))
  k_t = k_p[bb].reshape(c, sk_pad // c, hk, d)          # contiguous chunks: free reshapes
  v_t = v_p[bb].reshape(c, sk_pad // c, hk, v_p.shape[-1])
  st_t = dataclasses.replace(st, q_len=rows, kv_len=sk_pad // c, num_q_programs=1,
                             num_kv_tiles=st.num_kv_tiles // c, tail_batch=-1, tail_kv_splits=0)
  o_t, l_t = fk.fwd_call(q_t, k_t, v_t, st_t)             # [c, rows, hq, d], [c, hq, rows]
  o, l = merge_partials(o_t.transpose(0, 2, 1, 3), l_t, axis=0)     # [hq, rows, d], [hq, rows]
  return _place_rows(out, lse, o.transpose(1, 0, 2).astype(out.dtype), l, bb, r0,
                     interpret=st.interpret)


def _place_rows(out, lse, rows_out, rows_lse, b, r0, *, interpret=False):
  """``out[b, r0:r0 + R] = rows_out``, ``lse[b, :, r0:r0 + R] = rows_lse`` in place by an aliasing
  Triton kernel: XLA fails to compile ``.at[].set`` of the Mosaic kernel's output ("DUS target
  must be a fusion parameter"). R (a power of two) must divide r0."""
  n, hq, d = rows_out.shape
  if n & (n - 1) or r0 % n:
    raise ValueError(f"_place_rows: {n} rows must be a power of two dividing r0={r0}")

  def kernel(o_ref, l_ref, out_in, lse_in, out_ref, lse_ref):
    del out_in, lse_in                                   # aliased: only this block is written
    out_ref[...] = o_ref[...]
    lse_ref[...] = l_ref[...]

  row_block = r0 // n
  dst = [pl.BlockSpec((None, n, None, d), lambda h: (b, row_block, h, 0)),
         pl.BlockSpec((None, None, n), lambda h: (b, h, row_block))]
  return pl.pallas_call(
      kernel, grid=(hq,), input_output_aliases={2: 0, 3: 1}, out_specs=dst,
      in_specs=[pl.BlockSpec((n, None, d), lambda h: (0, h, 0)),
                pl.BlockSpec((None, n), lambda h: (h, 0)), *dst],
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (out, lse)],
      compiler_params=compat.triton_compiler_params(num_warps=8, num_stages=1),
      interpret=interpret, name="jattn_mosaic_tail_place")(rows_out, rows_lse, out, lse)


def _check_schedule(schedule, q_shape, k_shape, bs: BlockSizes, bwd_block_sizes):
  """ValueError unless the kernel (tiles ``bs``) and a Triton ``bwd_block_sizes`` (None: no
  check) can walk ``schedule``: tiles powers of two, multiples of ``bs``'s, the backward's."""
  check_schedule_args(schedule, q_shape, k_shape)
  sbq, sbk = schedule.block_q, schedule.block_k
  bad = [f"{name}={n}" for name, n, unit in (("block_q", sbq, bs.block_q),
                                             ("block_k", sbk, bs.block_k))
         if n % unit or n & (n - 1)]
  if bad:
    raise ValueError(
        f"the Mosaic GPU forward walks schedules whose tiles are powers of two and multiples of "
        f"its own tiles (block_q={bs.block_q} query rows per warpgroup, block_k={bs.block_k} "
        f"keys): allowed block_q {bs.block_q}, {2 * bs.block_q}, {4 * bs.block_q}, ...; "
        f"block_k {bs.block_k}, {2 * bs.block_k}, ...; got schedule {', '.join(bad)}")
  if bwd_block_sizes is not None and tuple(bwd_block_sizes.bwd_tiles) != (sbq, sbk):
    raise ValueError(f"bwd_block_sizes backward tiles {tuple(bwd_block_sizes.bwd_tiles)} differ "
                     f"from the schedule's ({sbq}, {sbk}): the Triton backward walks the "
                     f"schedule at its own tiles")


def flash_attention(q, k, v, q_segment_ids=None, kv_segment_ids=None, schedule=None, *,
                    causal: bool = False, local_window_size=None, scale: float | None = None,
                    logits_soft_cap: float | None = None, block_sizes: BlockSizes | None = None,
                    interpret: bool = False, bwd_block_sizes=None, kv_prefix=None):
  """Flash attention on Hopper: Pallas Mosaic GPU forward, Triton or Mosaic GPU backward
  (``BlockSizes.backward``; differentiable w.r.t. q, k, v and through the LSE).

  Args:
    q, k, v, q_segment_ids, kv_segment_ids, causal, local_window_size, scale, logits_soft_cap:
      as for ``reference.attention_reference`` (segment ids: both or neither; cap > 0); bf16 or
      fp16, D in (64, 128, 256) for q, k and v.
    schedule: None or a ``block_schedule.BlockSchedule`` for (Sq, Sk) with leading axes
      [1|B, 1|Hk]: only its kv tiles are visited (forward and backward). Its tiles must be
      powers of two and multiples of ``block_sizes.block_q`` / ``block_k``.
    block_sizes: ``BlockSizes`` of the forward (None: ``default_block_sizes(D)``).
    interpret: runs the backward's Triton kernels in the Pallas interpreter (the forward
      cannot be interpreted).
    bwd_block_sizes: a Triton ``BlockSizes`` or a ``mosaic_gpu_bwd.BlockSizes`` (None: the
      defaults of ``block_sizes.backward``).
    kv_prefix: None or (k_prefix, v_prefix) [B, n, Hk, D], n a multiple of ``block_k``: keys
      that precede k and v, read from their own arrays (as if concatenated in front: a
      context-parallel ring's halo, without the copy). Forward only (not differentiable); no
      segment ids, schedule or ``tail_kv_splits``.

  Returns:
    (out, lse) as ``reference.attention_reference`` (a row that sees no key: out 0, lse -inf).

  Example (on an H100/H200):
    >>> q = jax.random.normal(jax.random.key(0), (1, 1024, 8, 128), jnp.bfloat16)
    >>> out, lse = flash_attention(q, q, q, causal=True)  # doctest: +SKIP
    >>> from pallas_kernels.block_schedule import make_schedule
    >>> keep = jnp.tril(jnp.ones((8, 16), bool))[None, None]    # any [1|B, 1|Hk, 8, 16] tiles
    >>> s = make_schedule(1024, 1024, 128, 64, causal=True, block_mask=keep)
    >>> out, lse = flash_attention(q, q, q, schedule=s, causal=True)  # doctest: +SKIP
  """
  check_qkv_shapes(q, k, v)
  if not (q.dtype == k.dtype == v.dtype):
    raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  mosaic_gpu_bwd.check_dtype(q.dtype, "forward")
  check_segment_ids(q_segment_ids, kv_segment_ids, q.shape, k.shape)
  n_pre = 0 if kv_prefix is None else kv_prefix[0].shape[1]
  st = _static_config(q.shape, (k.shape[0], n_pre + k.shape[1], *k.shape[2:]), q.dtype,
                      causal=causal, scale=scale, block_sizes=block_sizes, interpret=interpret,
                      bwd_block_sizes=bwd_block_sizes, local_window_size=local_window_size,
                      logits_soft_cap=logits_soft_cap, has_seg=q_segment_ids is not None,
                      schedule=schedule)
  if kv_prefix is None:
    return _forward(q, k, v, q_segment_ids, kv_segment_ids, schedule, st)
  if n_pre % st.block_k or st.has_seg or st.has_sched or st.tail_kv_splits:
    raise ValueError(f"kv_prefix: {n_pre} keys (a multiple of block_k={st.block_k}), no segment "
                     f"ids, schedule or tail_kv_splits")
  return _forward_impl(q, k, v, None, None, None, dataclasses.replace(
      st, prefix_tiles=n_pre // st.block_k), tuple(kv_prefix))

