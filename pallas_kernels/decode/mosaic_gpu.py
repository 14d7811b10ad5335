"""Split-KV decode attention for Hopper (sm90) in Pallas Mosaic GPU: TMA ring, wgmma, warp
specialisation. Contiguous and paged caches.

STATUS (2026-11-30): written and verified on the CPU only (jax 0.10.2 and 0.11.2): it lowers for "cuda"
(``jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))``: the whole Pallas -> Mosaic GPU
lowering, wgmma/TMA constraints, the shared-memory budget) and a jnp replay of its split/tile walk
(``tests/test_decode_mosaic_gpu.py``) matches the fp32 reference. It has NOT run on a GPU; the
``gpu``-marked test there is the first thing to run (docs/kernels.md, "Mosaic GPU decode").
``jattn.decode_attention`` / ``jattn.paged_decode_attention`` with ``implementation="mosaic_gpu"``
run it; ``implementation=None`` never picks it.

Structure: one program (CTA) per (split, kv head, batch) -- the same split-KV partials as the
Triton kernel (``pallas_kernels/decode/triton.py``): split s of sequence b covers the key tiles
[t0, t1) of that sequence's own length (``_split_range``: n = cdiv(length, block_k) tiles,
cdiv(n, num_splits) per split), so splits past a short sequence's end load nothing and write
out 0, lse -inf; ``jattn.merge.merge_partials`` merges them exactly. Two warpgroups:

  * warpgroup 0 (compute) loads the GQA group's query rows once by TMA, then for every kv tile:
    S = Q K^T by wgmma into fp32 registers, an online softmax in the base-2 domain (scale *
    log2(e) folded into one multiply), O += P V by wgmma with P (in the cache dtype) from
    registers. Only the last tile of a sequence whose length is not a multiple of ``block_k``
    builds an element mask. At the end it writes the group's rows of the partial output (fp32)
    and the lse through shared memory by TMA.
  * warpgroup 1 (memory) streams the split's K and V tiles through a ring of ``num_stages``
    shared-memory slots by TMA; each slot has a "loaded" barrier (TMA completion) and a "free"
    barrier the compute warpgroup arrives on once its wgmma has read the slot.

Why wgmma with the group padded to 64 rows (and not a register dot for the 1-8 query rows of a
GQA group): wgmma's M is 64, so a group of g heads wastes 64 / g of the tensor-core work, but
decode is bound by HBM bytes, not FLOPs: per key and kv head the kernel reads 2 * D * 2 bytes
(K and V, 16-bit) and issues 2 * 2 * 64 * D FLOPs, 64 FLOP/byte, i.e. ~275 TFLOP/s at 4.3 TB/s,
well under the H200's ~990 dense bf16 TFLOP/s, so the padded rows cost issue slots, not time.
A register path would need K^T in a register layout that Mosaic GPU only produces from wgmma,
per-row cross-lane reductions over D and a broadcast multiply per key -- more code, more
registers, and no tensor cores. The padded query rows are zeros (the wrapper pads q to
[B, Hk, 64, D], a few KiB); their logits are 0 and their outputs are never written.

Code layout: ``split_program`` (both warpgroups of one program, given its tile walk and the TMA
copies of a tile), ``launch`` (grid, scratch, outputs) and ``unpack_refs`` are shared with the
sparse decode kernel (``pallas_kernels.sparse.decode_mosaic_gpu``, which walks each kv head's
list of kept blocks); ``_decode_kernel`` gives them the dense walk.

Layout of the results (what ``jattn.decode`` merges): o [B, num_splits, Hq, D] fp32 (the kernel
writes [B, S, Hk, group, D]: only the group's rows leave shared memory, a free reshape) and lse
[B, num_splits, Hq] fp32, natural log, -inf for splits without a visible key (the kernel writes
all 64 rows of [B, S, Hk, 64], since a TMA box of fewer than 4 fp32 is not allowed; the wrapper
slices).

Paged caches (``paged_decode_partials``): the memory warpgroup fills a ring slot with one TMA
per page when pages are smaller than a tile (page_size dividing ``block_k``: 16, 32 or 64 keys at
the default 64-key tiles; the slot's loaded barrier counts the copies) or one TMA per tile inside
a page (page_size a multiple of ``block_k``), the page number read from the table in GMEM.
Copies that start at or past the sequence's length read its first page instead
(``_page_copy``): table entries past the length may point anywhere.

Masked keys and non-finite values: keys past the length in the last tile are masked in the
logits (p = 0), but their V rows still enter the P V wgmma, where 0 * NaN = NaN. Paged caches
never load a page past the length (above); in a contiguous cache, and in the last page of a
paged one, the rows between the length and the end of that tile must hold finite values (zeros,
stale K/V: anything but Inf/NaN). The Triton kernel masks its loads instead.

Unsupported (NotImplementedError naming the option): local windows, logits soft cap, head dims
other than 64/128/256, head_dim_v != head_dim, caches other than bf16/fp16, GQA groups over 64
query heads per kv head, page sizes that neither divide ``block_k`` nor are multiples of it,
interpret mode (jax's Mosaic GPU interpreter has no wgmma with transposed or register operands).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.decode.checks import check_partials_args

__all__ = ["DecodeBlockSizes", "default_block_sizes", "decode_partials", "paged_decode_partials",
           "check_options"]

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
_M_INIT = -1e30     # finite initial max: exp2(m - m_new) never sees -inf - -inf
ROWS = 64           # wgmma's M: the GQA group's query rows are padded to it
_HEAD_DIMS = (64, 128, 256)
_SMEM_LIMIT = 227 * 1024


@dataclasses.dataclass(frozen=True)
class DecodeBlockSizes:
  """Tiles of the Mosaic GPU decode kernel.

  Attributes:
    block_k: keys per kv tile (a multiple of 64: wgmma's N for Q K^T and K for P V).
    num_stages: K/V slots in the TMA ring (>= 2).

  Example:
    >>> DecodeBlockSizes(64, 4).smem_bytes(128)
    180480
  """
  block_k: int = 64
  num_stages: int = 4

  def __post_init__(self):
    if self.block_k <= 0 or self.block_k % 64:
      raise ValueError(f"block_k must be a positive multiple of 64, got {self.block_k}")
    if self.num_stages < 2:
      raise ValueError(f"num_stages must be >= 2, got {self.num_stages}")

  def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
    """Shared memory of the buffers: Q tile, K/V ring, fp32 output and lse staging (barriers and
    alignment come on top; the lowering rejects a kernel over 227 KiB)."""
    q = ROWS * head_dim * itemsize
    ring = 2 * self.num_stages * self.block_k * head_dim * itemsize
    return q + ring + ROWS * _o_chunk(head_dim) * 4 + ROWS * 4


def default_block_sizes(head_dim: int) -> DecodeBlockSizes:
  """Untimed starting points (no GPU run yet): 4 stages of 64-key tiles for D64/D128 (64 or
  128 KiB of K/V in flight per CTA, ~180 KiB of shared memory at D128), 2 stages for D256 (the
  most that fits 227 KiB).

  Args:
    head_dim: 64, 128 or 256.

  Returns:
    A ``DecodeBlockSizes``.

  Example:
    >>> default_block_sizes(128)
    DecodeBlockSizes(block_k=64, num_stages=4)
  """
  if head_dim == 256:
    return DecodeBlockSizes(64, 2)
  return DecodeBlockSizes(64, 4)


def check_options(*, head_dim, head_dim_v, dtype, window_left=None, logits_soft_cap=None,
                  group=1, interpret=False, page_size=None, block_k=None):
  """NotImplementedError naming the first option the kernel does not support.

  Args:
    head_dim, head_dim_v: of the keys / values.
    dtype: the cache dtype.
    window_left, logits_soft_cap: must be None.
    group: query heads per kv head (at most 64).
    interpret: must be False.
    page_size: None (contiguous) or the paged cache's page size: it must divide ``block_k``
      (the tile's keys, default ``default_block_sizes(head_dim).block_k``) or be a multiple
      of it.
    block_k: the kernel's tile (None: the default for head_dim).

  Returns:
    None.

  Example:
    >>> check_options(head_dim=128, head_dim_v=128, dtype=jnp.bfloat16, group=4)
  """
  if window_left is not None:
    raise NotImplementedError("implementation='mosaic_gpu' decode does not support "
                              "local_window_size")
  if logits_soft_cap is not None:
    raise NotImplementedError("implementation='mosaic_gpu' decode does not support "
                              "logits_soft_cap")
  if interpret:
    raise NotImplementedError("implementation='mosaic_gpu' decode cannot run with "
                              "interpret=True (jax's Mosaic GPU interpreter has no wgmma with "
                              "transposed or register operands)")
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise NotImplementedError(f"implementation='mosaic_gpu' decode supports bfloat16 and float16 "
                              f"caches (dtype), got {jnp.dtype(dtype)}")
  if head_dim not in _HEAD_DIMS:
    raise NotImplementedError(f"implementation='mosaic_gpu' decode supports head_dim 64, 128 or "
                              f"256, got head_dim {head_dim}")
  if head_dim_v != head_dim:
    raise NotImplementedError(f"implementation='mosaic_gpu' decode needs head_dim_v == head_dim, "
                              f"got head_dim_v {head_dim_v} and head_dim {head_dim}")
  if group > ROWS:
    raise NotImplementedError(f"implementation='mosaic_gpu' decode supports at most {ROWS} query "
                              f"heads per kv head (GQA group), got {group}")
  if page_size is not None:
    bk = block_k or default_block_sizes(head_dim).block_k
    if bk % page_size and page_size % bk:
      raise NotImplementedError(f"implementation='mosaic_gpu' paged decode needs a page_size "
                                f"that divides block_k ({bk}) or is a multiple of it, got "
                                f"page_size {page_size}")


@dataclasses.dataclass(frozen=True)
class _Static:
  block_k: int
  num_stages: int
  num_splits: int
  capacity: int        # cache length (unpadded): lengths are clamped to it
  num_tiles: int       # padded capacity // block_k
  head_dim: int
  group: int
  scale: float
  dtype: jnp.dtype
  page_size: int | None = None   # paged cache: keys per page (None: contiguous)

  @property
  def copies_per_tile(self) -> int:
    """TMA copies per K (and per V) tile: one per page when pages are smaller than a tile."""
    if self.page_size is None or self.page_size >= self.block_k:
      return 1
    return self.block_k // self.page_size

  @property
  def copy_rows(self) -> int:
    return self.block_k // self.copies_per_tile


# -------------------------------------------------------------------------------------------
# Scalar and tile arithmetic (jnp on values: the kernel uses these, the CPU replay too)
# -------------------------------------------------------------------------------------------


def _o_chunk(head_dim: int) -> int:
  """Columns of the fp32 output staging buffer: at most 128 (D256 leaves in two halves: a
  [64, 256] fp32 buffer would not fit next to a 2-stage ring of 64-key tiles)."""
  return min(head_dim, 128)


def _clamp_length(length, st: _Static):
  """A sequence's visible keys: its kv_lengths entry clamped to [0, capacity] (keys of the
  tile padding past the capacity are then masked like any key past the length)."""
  return jnp.clip(jnp.asarray(length, jnp.int32), 0, st.capacity)


def _split_range(length, split, st: _Static):
  """Key tiles of split ``split`` of a sequence of ``length`` keys (``_clamp_length``'s, int32
  scalars or arrays): (t0, tf, t1), tiles [t0, tf) fully below the length (no mask), [tf, t1)
  the masked tail (at most one tile); t0 == t1 for a split past the sequence's end."""
  bk = st.block_k
  length = _clamp_length(length, st)
  n = lax.div(length + (bk - 1), jnp.int32(bk))
  per = lax.div(n + (st.num_splits - 1), jnp.int32(st.num_splits))
  t0 = jnp.minimum(split * per, n)
  t1 = jnp.minimum(t0 + per, n)
  tf = jnp.clip(lax.div(length, jnp.int32(bk)), t0, t1)
  return t0, tf, t1


def _page_copy(length, t, j, st: _Static):
  """Paged cache: (page-table column, first row in the page) of copy ``j`` of kv tile ``t``
  (``st.copy_rows`` keys from token t * block_k + j * copy_rows). A copy that starts at or past
  the length reads the sequence's first page instead (column 0; only tiles with a key below the
  length are loaded, so length > 0): table entries past the length may point anywhere, and the
  masked keys' values must be finite (P = 0 times a NaN is NaN in the P V wgmma)."""
  ps = st.page_size
  start = t * st.block_k + j * st.copy_rows
  live = start < length
  col = jnp.where(live, lax.div(start, jnp.int32(ps)), 0)
  row = jnp.where(live, lax.rem(start, jnp.int32(ps)), 0)
  return col, row


def _online_softmax(s, m, l, st: _Static):
  """Base-2 online-softmax step: s [R, bk] fp32 raw logits (masked: -inf), m/l [R] ->
  (p, alpha, m_new, l_new)."""
  c = st.scale * LOG2E
  m_new = jnp.maximum(m, s.max(axis=1) * c)
  alpha = jnp.exp2(m - m_new)
  p = jnp.exp2(s * c - lax.broadcast_in_dim(m_new, s.shape, [0]))
  return p, alpha, m_new, l * alpha + p.sum(axis=1)


def _finalize(acc, m, l):
  """acc [R, D], m, l [R] -> (out fp32, lse natural log; 0 and -inf where l == 0)."""
  empty = l == 0.0
  l_safe = jnp.where(empty, 1.0, l)
  out = acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0])
  return out, jnp.where(empty, -jnp.inf, m * LN2 + jnp.log(l_safe))


# -------------------------------------------------------------------------------------------
# Kernel
# -------------------------------------------------------------------------------------------


def split_program(st: _Static, bufs, *, q_src, o_dst, lse_dst, length, lo, hi, runs, key0,
                  copies):
  """One split-KV program (CTA) of a decode kernel: both warpgroups, shared by the dense and
  the sparse decode kernels (``pallas_kernels.sparse.decode_mosaic_gpu``). The program walks
  the kv tiles t in [lo, hi) (traced int32; ring slot (t - lo) % num_stages).

  Args:
    st: the static parameters (``_Static`` or a subclass).
    bufs: the scratch refs of :func:`launch`: (smem buffers, q_loaded, k_loaded, v_loaded,
      k_free, v_free).
    q_src: GMEM ref [64, D] of the group's padded query rows.
    o_dst: GMEM ref [group, D] (fp32) of the partial output; lse_dst: [64] (fp32).
    length: the sequence's visible keys (int32; masked keys are those at or past it).
    lo, hi: the tiles to walk.
    runs: ((start, stop, masked), ...) consecutive ranges covering [lo, hi); ``masked`` (static)
      builds the element mask ``key0(t) + column < length`` for the tiles of that range.
    key0: tile index -> position of the tile's first key (int32), read by masked runs only.
    copies: tile index -> [(k_src, v_src, dst_rows)]: the TMA copies that fill a ring slot
      (dst_rows None: the whole slot; else a ``pl.ds`` of its rows); the loaded barriers count
      ``st.copies_per_tile`` arrivals, so ``copies`` must return that many.

  Returns:
    None (writes o_dst and lse_dst).
  """
  (q_smem, k_smem, v_smem, o_smem, lse_smem), q_loaded, k_loaded, v_loaded, k_free, v_free = bufs
  bk, stages = st.block_k, st.num_stages
  wg = lax.axis_index("wg")
  slot_of = lambda t: lax.rem(t - lo, jnp.int32(stages))

  @pl.when(wg == 0)
  def _compute():
    plgpu.set_max_registers(232, action="increase")
    plgpu.copy_gmem_to_smem(q_src, q_smem, q_loaded)
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    m = plgpu.layout_cast(jnp.full((ROWS,), _M_INIT, jnp.float32), row_layout)
    l = plgpu.layout_cast(jnp.full((ROWS,), 0.0, jnp.float32), row_layout)
    acc = plgpu.layout_cast(jnp.full((ROWS, st.head_dim), 0.0, jnp.float32), wgmma_layout)
    plgpu.barrier_wait(q_loaded)

    def step(t, carry, *, masked):
      acc, m, l = carry
      slot = slot_of(t)
      plgpu.barrier_wait(k_loaded.at[slot])

      def qk_gemm(s_ref):                                       # [64, bk] fp32
        plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
        return s_ref[...]
      s = pl.run_scoped(qk_gemm, plgpu.ACC((ROWS, bk), jnp.float32))
      plgpu.barrier_arrive(k_free.at[slot])
      if masked:   # keys at or past the length (the sequence's last tile; sparse: every tile)
        cols = plgpu.broadcasted_iota(jnp.int32, (ROWS, bk), 1, layout=wgmma_layout)
        s = jnp.where(cols + key0(t) < length, s, -jnp.inf)
      p, alpha, m_new, l = _online_softmax(s, m, l, st)
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      p = p.astype(st.dtype)
      plgpu.barrier_wait(v_loaded.at[slot])

      def pv_gemm(acc_ref):                                     # [64, D] fp32
        plgpu.wgmma(acc_ref, p, v_smem.at[slot])
      acc = pl.run_state(pv_gemm)(plgpu.ACC.init(acc))         # returns once the wgmma is done
      plgpu.barrier_arrive(v_free.at[slot])
      return acc, m_new, l

    carry = (acc, m, l)
    for start, stop, masked in runs:
      carry = lax.fori_loop(start, stop, functools.partial(step, masked=masked), carry)
    out, lse = _finalize(*carry)
    lse_smem[...] = lse
    dc = _o_chunk(st.head_dim)
    for c in range(st.head_dim // dc):    # D256: two column halves through one staging buffer
      if c:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the previous half has left
      o_smem[...] = out[:, c * dc:(c + 1) * dc]
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, st.group)], o_dst.at[:, pl.ds(c * dc, dc)])
      if not c:
        plgpu.copy_smem_to_gmem(lse_smem, lse_dst)
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 1)
  def _memory():
    plgpu.set_max_registers(40, action="decrease")

    def load(t):
      slot = slot_of(t)
      for k_src, v_src, dst in copies(t):
        k_dst = k_smem.at[slot] if dst is None else k_smem.at[slot, dst]
        v_dst = v_smem.at[slot] if dst is None else v_smem.at[slot, dst]
        plgpu.copy_gmem_to_smem(k_src, k_dst, k_loaded.at[slot])
        plgpu.copy_gmem_to_smem(v_src, v_dst, v_loaded.at[slot])

    for i in range(stages):                                     # fill the ring
      @pl.when(lo + i < hi)
      def _():
        load(lo + i)

    @pl.loop(lo + stages, jnp.maximum(hi, lo + stages))
    def _(t):
      slot = slot_of(t)
      plgpu.barrier_wait(k_free.at[slot])
      plgpu.barrier_wait(v_free.at[slot])
      load(t)


def unpack_refs(refs, num_inputs: int, st: _Static):
  """A kernel's refs as :func:`launch` passes them -> (its ``num_inputs`` input refs, the page
  table ref after them or None (contiguous), o, lse, the scratch refs) and the program's
  (split, kv head, batch) grid indices."""
  paged = st.page_size is not None
  o_ref, lse_ref, *bufs = refs[num_inputs + paged:]
  ids = tuple(lax.axis_index(name) for name in ("splits", "kv_heads", "batch"))
  return refs[:num_inputs], refs[num_inputs] if paged else None, o_ref, lse_ref, bufs, ids


def _decode_kernel(*refs, st: _Static):
  """Refs (GMEM): lens [B] int32, q [B, Hk, 64, D] (group rows, zero padded), k/v [B, N', Hk, D]
  (paged: [P, page_size, Hk, D] and a page table [B, max_pages] int32 after them)
  -> o [B, S, Hk, group, D] fp32, lse [B, S, Hk, 64] fp32; then the scratch of :func:`launch`
  (k/v_loaded count ``copies_per_tile`` TMA arrivals)."""
  paged = st.page_size is not None
  (lens_ref, q_ref, k_ref, v_ref), pt_ref, o_ref, lse_ref, bufs, (split, h, b) = unpack_refs(
      refs, 4, st)
  bk = st.block_k
  length = _clamp_length(lens_ref[b], st)
  t0, tf, t1 = _split_range(length, split, st)

  def copies(t):
    if not paged:
      rows = (b, pl.ds(t * bk, bk), h)
      return [(k_ref.at[rows], v_ref.at[rows], None)]
    n = st.copy_rows
    out = []
    for j in range(st.copies_per_tile):   # one TMA per page (or per tile inside a page)
      col, row = _page_copy(length, t, j, st)
      rows = (pt_ref[b, col], pl.ds(row, n), h)
      out.append((k_ref.at[rows], v_ref.at[rows], pl.ds(j * n, n)))
    return out

  split_program(st, bufs, q_src=q_ref.at[b, h], o_dst=o_ref.at[b, split, h],
                lse_dst=lse_ref.at[b, split, h], length=length, lo=t0, hi=t1,
                runs=((t0, tf, False), (tf, t1, True)), key0=lambda t: t * bk, copies=copies)


def launch(kernel, args, st: _Static, batch: int, kv_heads: int):
  """The Mosaic GPU call of a split-KV decode kernel: grid (splits, kv heads, batch), two
  warpgroups, the scratch ``split_program`` uses (Q tile, K/V rings, fp32 output and lse
  staging, barriers), outputs o [B, S, Hk, group, D] and lse [B, S, Hk, 64] fp32.

  Args:
    kernel: called with the GMEM refs of ``args``, the two outputs and the scratch.
    args: the kernel's inputs.
    st: the static parameters.
    batch, kv_heads: the grid.

  Returns:
    (o, lse).
  """
  d, bk, stages = st.head_dim, st.block_k, st.num_stages
  tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))   # 64 x 16-bit = 128 B
  smem = (
      plgpu.SMEM((ROWS, d), st.dtype, transforms=tiled),                  # Q
      plgpu.SMEM((stages, bk, d), st.dtype, transforms=tiled),            # K ring
      plgpu.SMEM((stages, bk, d), st.dtype, transforms=tiled),            # V ring
      plgpu.SMEM((ROWS, _o_chunk(d)), jnp.float32),                      # O staging
      plgpu.SMEM((ROWS,), jnp.float32),                                   # lse staging
  )
  call = plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct((batch, st.num_splits, kv_heads, st.group, d), jnp.float32),
                jax.ShapeDtypeStruct((batch, st.num_splits, kv_heads, ROWS), jnp.float32)),
      scratch_types=(
          smem,
          plgpu.Barrier(num_barriers=1),                                  # q_loaded
          plgpu.Barrier(num_arrivals=st.copies_per_tile, num_barriers=stages),   # k_loaded
          plgpu.Barrier(num_arrivals=st.copies_per_tile, num_barriers=stages),   # v_loaded
          plgpu.Barrier(num_barriers=stages),                             # k_free
          plgpu.Barrier(num_barriers=stages),                             # v_free
      ),
      grid=(st.num_splits, kv_heads, batch),
      grid_names=("splits", "kv_heads", "batch"),
      num_threads=2,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )
  return call(*args)


def _call(q_p, k, v, lens, st: _Static, page_table=None):
  b, hk = q_p.shape[:2]
  args = (lens, q_p, k, v) + (() if page_table is None else (page_table,))
  return launch(functools.partial(_decode_kernel, st=st), args, st, b, hk)


def _static(q, k, v, num_splits, scale, block_sizes, page_size=None, capacity=None,
            **opts) -> _Static:
  bsz, hq, d = q.shape
  _, n, hk, _ = k.shape
  bs = block_sizes or (default_block_sizes(d) if d in _HEAD_DIMS else DecodeBlockSizes())
  if not isinstance(bs, DecodeBlockSizes):
    raise TypeError(f"block_sizes for implementation='mosaic_gpu' must be a "
                    f"pallas_kernels.decode.mosaic_gpu.DecodeBlockSizes, got {type(bs).__name__}")
  check_options(head_dim=d, head_dim_v=v.shape[-1], dtype=k.dtype, group=hq // hk,
                page_size=page_size, block_k=bs.block_k, **opts)
  n = n if capacity is None else capacity
  return _Static(block_k=bs.block_k, num_stages=bs.num_stages, num_splits=int(num_splits),
                 capacity=n, num_tiles=-(-n // bs.block_k), head_dim=d, group=hq // hk,
                 scale=float(d ** -0.5 if scale is None else scale), dtype=jnp.dtype(k.dtype),
                 page_size=page_size)


def pad_query(q, st: _Static, hk: int):
  """q [B, Hq, D] -> [B, Hk, 64, D] in the cache dtype: kv head h's group rows, zeros below."""
  b = q.shape[0]
  qg = q.astype(st.dtype).reshape(b, hk, st.group, st.head_dim)
  return jnp.pad(qg, ((0, 0), (0, 0), (0, ROWS - st.group), (0, 0)))


def _pad_keys(x, size):
  """The cache padded to whole tiles (a copy, only when the capacity is not a multiple of
  block_k: the TMA boxes of the last tile then stay inside the array)."""
  if x.shape[1] == size:
    return x
  return jnp.pad(x, ((0, 0), (0, size - x.shape[1]), (0, 0), (0, 0)))


@functools.partial(jax.jit, static_argnames=(
    "num_splits", "scale", "window_left", "logits_soft_cap", "block_sizes", "interpret"))
def decode_partials(q, k_cache, v_cache, kv_lengths, *, num_splits, scale=None, window_left=None,
                    logits_soft_cap=None, block_sizes=None, interpret=False):
  """Per-split partial decode attention over a contiguous cache (Mosaic GPU kernel, sm90).

  Args:
    q: [batch, q_heads, head_dim] (cast to the cache dtype).
    k_cache, v_cache: [batch, max_len, kv_heads, head_dim], bf16 or fp16, head_dim 64/128/256.
    kv_lengths: int32 [batch] (clamped to [0, max_len]); the query sits at kv_lengths - 1.
    num_splits: splits of each sequence's keys (each split a whole number of tiles).
    scale: logit scale, default 1/sqrt(head_dim).
    window_left, logits_soft_cap: must be None (NotImplementedError otherwise).
    block_sizes: ``DecodeBlockSizes`` or None (``default_block_sizes``).
    interpret: must be False (NotImplementedError).

  Returns:
    (out [batch, num_splits, q_heads, head_dim] fp32, lse [batch, num_splits, q_heads] fp32),
    splits without a visible key: out 0, lse -inf.

  Example (on an H100/H200):
    >>> o, lse = decode_partials(q, k, v, lens, num_splits=16)  # doctest: +SKIP
  """
  check_partials_args(q, k_cache, v_cache, kv_lengths, num_splits)
  st = _static(q, k_cache, v_cache, num_splits, scale, block_sizes, window_left=window_left,
               logits_soft_cap=logits_soft_cap, interpret=interpret)
  b, hq, d = q.shape
  hk = k_cache.shape[2]
  n_pad = st.num_tiles * st.block_k
  o, lse = _call(pad_query(q, st, hk), _pad_keys(k_cache, n_pad), _pad_keys(v_cache, n_pad),
                 kv_lengths.astype(jnp.int32), st)
  return o.reshape(b, num_splits, hq, d), lse[..., :st.group].reshape(b, num_splits, hq)


@functools.partial(jax.jit, static_argnames=(
    "num_splits", "scale", "window_left", "logits_soft_cap", "block_sizes", "interpret"))
def paged_decode_partials(q, k_pages, v_pages, page_table, kv_lengths, *, num_splits, scale=None,
                          window_left=None, logits_soft_cap=None, block_sizes=None,
                          interpret=False):
  """Per-split partial decode attention over a paged cache (Mosaic GPU kernel, sm90).

  The memory warpgroup fills each ring slot with one TMA per page (pages smaller than
  ``block_k``) or one per tile (pages a multiple of ``block_k``), reading the page table from
  GMEM; copies that start past the sequence's length read its first page instead (finite values
  for the masked keys).

  Args:
    q: [batch, q_heads, head_dim].
    k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim], bf16 or fp16; page_size must
      divide ``block_sizes.block_k`` or be a multiple of it (NotImplementedError otherwise).
    page_table: int32 [batch, max_pages]; entries past a sequence's length are never read.
    kv_lengths: int32 [batch] (clamped to [0, max_pages * page_size]).
    num_splits, scale, window_left, logits_soft_cap, block_sizes, interpret: as in
      :func:`decode_partials`.

  Returns:
    (out [batch, num_splits, q_heads, head_dim] fp32, lse [batch, num_splits, q_heads] fp32).

  Example (on an H100/H200):
    >>> o, lse = paged_decode_partials(q, kp, vp, table, lens, num_splits=8)  # doctest: +SKIP
  """
  check_partials_args(q, k_pages, v_pages, kv_lengths, num_splits)
  if page_table.ndim != 2 or page_table.shape[0] != q.shape[0]:
    raise ValueError(f"page_table must be [batch, max_pages] with batch {q.shape[0]}, "
                     f"got {page_table.shape}")
  _, page_size, hk, _ = k_pages.shape
  st = _static(q, k_pages, v_pages, num_splits, scale, block_sizes, window_left=window_left,
               logits_soft_cap=logits_soft_cap, interpret=interpret, page_size=page_size,
               capacity=page_table.shape[1] * page_size)
  b, hq, d = q.shape
  o, lse = _call(pad_query(q, st, hk), k_pages, v_pages, kv_lengths.astype(jnp.int32), st,
                 page_table.astype(jnp.int32))
  return o.reshape(b, num_splits, hq, d), lse[..., :st.group].reshape(b, num_splits, hq)
