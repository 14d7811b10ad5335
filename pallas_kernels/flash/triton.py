"""Flash attention as portable Pallas GPU kernels (Triton lowering), walking a block schedule.

Forward: one program per (query tile, batch, query head). It walks the tile's kv list from a
``BlockSchedule``: first the full tiles (no element mask at all), then the partial tiles (element
mask applied), with an online softmax in the base-2 domain (log2(e) folded into the logit scale)
and fp32 accumulators. Tiles that the schedule leaves out are never loaded.

Backward (custom_vjp, as in jax's ``pallas/ops/gpu/attention.py`` but schedule-driven), walking
its own schedule of the same mask (``bwd_schedule``, default: the forward's), whose tiles may
differ from the forward's: all it takes from the forward (out, log-sum-exp) is per row.
  * dK/dV: one program per (kv tile, batch, kv head). It keeps K, V and the fp32 dK, dV
    accumulators on chip and walks, for every query head of its GQA group, the query tiles of the
    transposed schedule (``q_indices``), so K/V are never repeated in memory.
  * dQ: one program per (query tile, batch, query head), walking the schedule's kv list.
  * ``BlockSizes(fused_bwd=True)`` (option): one kernel instead of the two, one program per
    (span, batch, kv head) doing dK/dV of a kv span and then dQ of the paired q span, so that
    under a causal mask every program has the same work (``_fused_bwd_kernel``).
  delta = rowsum(dO * O) - dLSE, so cotangents of the returned log-sum-exp are honoured.
  ``flash_attention_bwd`` runs the same two kernels on another forward's (out, lse) for dense or
  causal masks: the Mosaic GPU (Hopper) forward's backward.

Padding happens here: sequences to multiples of both passes' tile sizes, head dims to a power of
two (Triton blocks need power-of-two shapes). Padded keys are always in partial tiles (the schedule
marks them so) and are masked there; padded queries and head-dim columns are sliced away.

The schedule's lists are reordered once per call (jnp, cheap) so that each row is
``[count, n_full, full tiles..., partial tiles...]``: the kernels then run two loops with dynamic
trip counts and no per-tile branch, each prefetching the next tile index one step ahead.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import compat
from pallas_kernels.block_schedule import BlockSchedule
from pallas_kernels.masks import normalize_window, visible

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
_NEG_INF = float("-inf")
_POS_INF = float("inf")


# ----------------------------------------------------------------------------------------------
# Block sizes
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes and launch parameters of the Triton flash attention kernels.

  ``block_q`` x ``block_k`` is the tile of the forward's block schedule; ``bwd_block_q`` x
  ``bwd_block_k`` (default: the same) the tile of the schedule that both backward kernels walk.
  The two passes may use different tiles because everything the backward takes from the forward
  (out, log-sum-exp) is per row. The backward kernels may split a tile further into chunks.

  Attributes:
    block_q: forward query tile (power of two, >= 16).
    block_k: forward key/value tile (power of two, >= 16).
    num_warps: forward warps per program (None: a default from the tile and head dim).
    num_stages: forward software-pipelining depth (None: default).
    bwd_num_warps: backward warps per program (None: default).
    bwd_num_stages: backward pipelining depth (None: default).
    dkv_q_chunk: rows of a backward query tile processed per step of the dK/dV kernel (divides
      the dK/dV kernel's q tile, ``dkv_tiles[0]``; None: default).
    dq_k_chunk: rows of a backward kv tile processed per step of the dQ kernel (divides the
      backward block_k; None: default).
    bwd_block_q: backward query tile (None: ``block_q``).
    bwd_block_k: backward key/value tile (None: ``block_k``).
    head_group: launch order of every kernel's (tile, batch, head) programs. 1: tiles fastest,
      one (batch, head) after another. G > 1: G consecutive (batch, head) pairs fastest, then
      tiles from the heaviest (most causal tiles) down, then the next G pairs, so the programs
      launched last are the lightest (balances the causal triangle's tail). None: 4 for causal
      masks without a left window (when 4 divides batch x heads, else 2 or 1), 1 otherwise.
    dkv_block_q: query tile of the schedule that the dK/dV kernel walks (its transposed q lists;
      None: the backward block_q). Set it to ``dkv_q_chunk`` and the kernel visits the mask at
      chunk granularity: on the causal diagonal (and window / document edges) it skips the
      chunks that no query of them can see and masks only the chunks that cross the edge,
      instead of masking (or computing for nothing) every chunk of a partial backward tile.
      Needs a third schedule (``flash_attention(dkv_schedule=...)``; ``jattn.flash_attention``
      builds it). The dQ kernel keeps the backward tiles.
    fused_bwd: run the backward as ONE kernel of paired tiles instead of two (dK/dV, then dQ).
      Program t of a (kv head, batch) covers a span of L = max(bwd_block_q, bwd_block_k) rows:
      it computes dK/dV of the kv tiles in kv span t (all heads of the GQA group, summed on
      chip), then dQ of the q tiles in q span (t - s) mod P for each head of the group, where
      s = floor((kv_len - q_len) / L) aligns the bottom-right causal diagonal and P is the number
      of spans. Under a causal mask every program then has the same work: kv span t walks the
      q rows below it, q span t the kv rows left of it. Same schedules, masks, chunking and
      fp32 accumulation as the two kernels (every mask the schedule describes is supported);
      the only thing it cannot do is the timing switch ``_bwd_parts="dkv"|"dq"`` (one kernel).

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
  head_group: int | None = None
  dkv_block_q: int | None = None
  fused_bwd: bool = False

  @property
  def bwd_tiles(self) -> tuple[int, int]:
    """(block_q, block_k) of the backward schedule."""
    return (self.bwd_block_q or self.block_q, self.bwd_block_k or self.block_k)

  @property
  def dkv_tiles(self) -> tuple[int, int]:
    """(block_q, block_k) of the schedule that the dK/dV kernel walks.

    Example:
      >>> BlockSizes(64, 64, bwd_block_q=128, dkv_block_q=64).dkv_tiles
      (64, 64)
    """
    bq, bk = self.bwd_tiles
    return (self.dkv_block_q or bq, bk)


# Default launch configurations: data in ``pallas_kernels/tuning`` (one JSON table per device,
# ``generic.json`` for every other device; see docs/kernels.md, "Tuning data"), keyed by kernel
# ("triton_fwd": the forward's fields below, "triton_bwd": the backward's), padded head dim
# (32, 64, 128, 256) and dtype class (16-bit: wgmma and cp.async pipelining, checked to fit
# shared memory and not spill registers on sm_90a; 32-bit: IEEE fp32 products, for accuracy not
# speed). Each entry records where it comes from: D128 16-bit tuned on the H200 (forward tiles:
# run 3's sweep; backward launch: runs 13-14, 4 warps x 2 stages with 32-row steps, causal
# fwd+bwd at 16K 28.3 -> 22.9 ms), the other head dims and fp32 untimed. The previous D128
# 16-bit default (8 warps x 3 stages, 64-row steps): PREV_D128_BF16.
_FWD_FIELDS = ("block_q", "block_k", "num_warps", "num_stages", "head_group")
_BWD_FIELDS = ("bwd_block_q", "bwd_block_k", "bwd_num_warps", "bwd_num_stages", "dkv_q_chunk",
               "dq_k_chunk", "dkv_block_q", "fused_bwd")


@functools.lru_cache(maxsize=None)
def _tuned_block_sizes(d_key: int, itemsize: int, device_kind: str | None) -> BlockSizes:
  """The table's ``BlockSizes`` for a padded head dim and itemsize (2 or 4) on a device."""
  from pallas_kernels import tuning
  kind = tuning.device_kind() if device_kind is None else device_kind
  dcls = "32bit" if itemsize >= 4 else "16bit"
  fwd = tuning.params("triton_fwd", d_key, dcls, device=kind)
  bwd = tuning.params("triton_bwd", d_key, dcls, device=kind)
  if fwd is None or bwd is None:
    raise KeyError(f"no triton_fwd/triton_bwd tuning entry for head_dim {d_key} {dcls} on "
                   f"{kind!r} ({tuning.table_file(kind)})")
  return BlockSizes(**{k: fwd[k] for k in _FWD_FIELDS}, **{k: bwd[k] for k in _BWD_FIELDS})


# The D128 16-bit default before session 12 (backward 8 warps x 3 stages, 64-row steps): kept
# for A/B rows in the benchmark (``jattn_triton[prev_default]``).
PREV_D128_BF16 = BlockSizes(64, 64, num_warps=4, num_stages=3, bwd_num_warps=8, bwd_num_stages=3,
                            dkv_q_chunk=64, dq_k_chunk=64, bwd_block_q=128, bwd_block_k=64)

# Candidates for a GPU sweep (``_sweep``), 16-bit inputs, by padded head dim. Each compiles for
# sm_90a without register spills unless noted. Fields: block_q, block_k, fwd warps, fwd stages,
# bwd warps, bwd stages, dkv_q_chunk, dq_k_chunk (then optionally bwd_block_q, bwd_block_k; an
# 8-field entry is a single-tile config: one tile for both passes). Keep block_k >= 64: the
# dK/dV kernel's dots have block_k rows, and wgmma needs 64.
_SWEEP_CANDIDATES = {
    64: [(128, 64, 8, 3, 8, 2, 64, 64), (128, 128, 8, 3, 8, 2, 32, 32), (64, 64, 4, 3, 4, 2, 32, 32),
         (128, 64, 4, 4, 4, 2, 64, 64)],
    128: [(128, 64, 8, 3, 8, 3, 32, 64), (128, 64, 8, 3, 8, 2, 32, 32), (128, 64, 8, 3, 8, 3, 64, 64),
          (128, 64, 8, 3, 8, 2, 16, 64), (128, 64, 8, 4, 8, 2, 64, 64), (64, 64, 4, 3, 8, 2, 64, 64),
          (64, 64, 4, 3, 8, 3, 32, 64), (64, 64, 4, 4, 8, 2, 64, 64),
          (128, 128, 8, 2, 8, 2, 16, 32), (128, 128, 8, 2, 8, 2, 16, 16),
          (64, 128, 4, 2, 8, 2, 16, 32)],
    256: [(64, 64, 8, 2, 8, 1, 16, 16), (64, 64, 8, 3, 8, 2, 16, 64),
          (128, 64, 8, 2, 8, 2, 16, 16)],  # the last spills ~650 bytes in the forward
}


def default_block_sizes(head_dim: int, dtype, device_kind: str | None = None) -> BlockSizes:
  """Default tiles and launch parameters for the Triton kernels (tuned for Hopper).

  Read from the tuning table of the device (``pallas_kernels.tuning``; the same for every mask).

  Args:
    head_dim: the (unpadded) head dimension, up to 256.
    dtype: the input dtype (fp32 needs twice the shared memory of bf16/fp16, so smaller tiles).
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
  # the cache key is the resolved kind (never None: a test that swaps tuning.device_kind must
  # not leave its table cached for this machine's calls)
  from pallas_kernels import tuning
  return _tuned_block_sizes(max(32, _pow2(head_dim)), itemsize, tuning.resolve_kind(device_kind))


def _launch_defaults(block_q, block_k, d_pad, dv_pad, dtype, *, bwd_block_q=None,
                     bwd_block_k=None) -> BlockSizes:
  """Launch parameters for given tiles, per pass: the tuned table's forward (backward) parameters
  when the forward (backward) tiles match the table's, otherwise a heuristic from the tile sizes
  and a shared-memory budget of ~200 KiB."""
  itemsize = 4 if jnp.dtype(dtype).itemsize >= 4 else 2
  from pallas_kernels import tuning
  tuned = _tuned_block_sizes(max(32, max(d_pad, dv_pad)), itemsize, tuning.resolve_kind(None))
  bbq, bbk = bwd_block_q or block_q, bwd_block_k or block_k
  budget = 200 * 1024
  if (tuned.block_q, tuned.block_k) == (block_q, block_k):
    num_warps, num_stages = tuned.num_warps, tuned.num_stages
  else:
    big = max(block_q, block_k) >= 128 and max(d_pad, dv_pad) >= 128
    fwd_stage = block_k * (d_pad + dv_pad) * itemsize  # one K and one V tile
    num_warps = 8 if big else 4
    num_stages = int(max(1, min(3, (budget - block_q * d_pad * itemsize) // fwd_stage)))
  if tuned.bwd_tiles == (bbq, bbk):
    bwd = (tuned.bwd_num_warps, tuned.bwd_num_stages, tuned.dkv_q_chunk, tuned.dq_k_chunk)
  else:
    big = max(bbq, bbk) >= 128 and max(d_pad, dv_pad) >= 128
    dkv_chunk = min(bbq, 64 if itemsize == 2 else 32)
    bwd_stage = dkv_chunk * (d_pad + dv_pad) * itemsize  # one Q and one dO chunk
    bwd_stages = max(1, min(2, (budget - bbk * (d_pad + dv_pad) * itemsize) // bwd_stage))
    bwd = (8 if big else 4, int(bwd_stages), dkv_chunk, min(bbk, 64 if itemsize == 2 else 32))
  return BlockSizes(block_q, block_k, num_warps=num_warps, num_stages=num_stages,
                    bwd_num_warps=bwd[0], bwd_num_stages=bwd[1], dkv_q_chunk=bwd[2],
                    dq_k_chunk=bwd[3], bwd_block_q=bwd_block_q, bwd_block_k=bwd_block_k)


def _bench_configs(head_dim: int = 128, dtype=jnp.bfloat16) -> list[BlockSizes]:
  """Candidate ``BlockSizes`` for a GPU sweep (the first entry is the default); see ``_sweep``.

  Args:
    head_dim: the head dimension.
    dtype: the input dtype.

  Returns:
    A list of ``BlockSizes`` (each needs its own schedules: forward tiles block_q x block_k,
    backward tiles ``bwd_tiles``; an entry without bwd_block_q/bwd_block_k uses one tile for
    both passes).

  Example:
    >>> len(_bench_configs()) > 1
    True
  """
  out = [default_block_sizes(head_dim, dtype)]
  if jnp.dtype(dtype).itemsize == 2:
    for c in _SWEEP_CANDIDATES[max(64, _pow2(head_dim))]:
      out.append(BlockSizes(*c))
  return list(dict.fromkeys(out))


def _visible_pairs(q_len, kv_len, causal, window):
  """Number of visible (query, key) pairs of a static mask (numpy, for FLOP counts)."""
  import numpy as np  # local: only the benchmark helpers need it
  pos = np.arange(q_len, dtype=np.int64) + (kv_len - q_len)
  lo = np.zeros_like(pos)
  hi = np.full_like(pos, kv_len - 1)
  if window is not None:
    left, right = window
    if left is not None:
      lo = np.maximum(lo, pos - left)
    if right is not None:
      hi = np.minimum(hi, pos + right)
  if causal:
    hi = np.minimum(hi, pos)
  return int(np.maximum(hi - lo + 1, 0).sum())


def _sweep(batch: int = 2, seq: int = 4096, q_heads: int = 16, kv_heads: int = 16,
           head_dim: int = 128, *, causal: bool = True, local_window_size=None,
           dtype=jnp.bfloat16, configs=None, iters: int = 10, verbose: bool = True,
           interpret: bool = False, time_bwd: bool = False):
  """Time forward and forward+backward of the compiled kernels for each candidate config (GPU).

  TFLOP/s count only visible (query, key) pairs: forward 4*B*Hq*D*pairs, forward+backward
  3.5x that (the backward counted as 2.5x the forward, as FlashAttention-2 does).

  Args:
    batch, seq, q_heads, kv_heads, head_dim: problem size (self-attention, Sq = Sk = seq).
    causal, local_window_size: the mask.
    dtype: input dtype.
    configs: list of ``BlockSizes`` (default: ``_bench_configs(head_dim, dtype)``).
    iters: timed iterations (median reported) after one warm-up.
    verbose: print one line per config.
    interpret: run in the Pallas interpreter (only to smoke-test this helper on a CPU).
    time_bwd: also time the backward alone (the VJP of saved residuals, no forward): bwd_ms
      (both kernels and the delta precompute), dkv_ms / dq_ms (one kernel + precompute) and
      prep_ms (precompute only: delta, base-2 LSE, zero gradients), so the kernels' own times
      are dkv_ms - prep_ms and dq_ms - prep_ms. A ``fused_bwd`` config has no dkv_ms / dq_ms.

  Returns:
    A list of dicts: config, fwd_ms, fwd_bwd_ms, fwd_tflops, fwd_bwd_tflops (and with
    ``time_bwd``: bwd_ms, dkv_ms, dq_ms, prep_ms, bwd_tflops), error (a config that fails to
    compile, e.g. out of shared memory, gets ``error`` and no timings).

  Example:
    >>> rows = _sweep(seq=16384, local_window_size=(511, 0))  # doctest: +SKIP
  """
  import statistics
  import time

  from pallas_kernels.block_schedule import make_schedule

  configs = _bench_configs(head_dim, dtype) if configs is None else configs
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (batch, seq, q_heads, head_dim), dtype)
  k = jax.random.normal(keys[1], (batch, seq, kv_heads, head_dim), dtype)
  v = jax.random.normal(keys[2], (batch, seq, kv_heads, head_dim), dtype)
  window = normalize_window(local_window_size)
  pairs = _visible_pairs(seq, seq, causal, window)
  fwd_flops = 4.0 * batch * q_heads * head_dim * pairs

  def timeit(fn, *args):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3

  rows = []
  for cfg in configs:
    def attn(q, k, v, cfg=cfg, parts="all"):
      sched = make_schedule(seq, seq, cfg.block_q, cfg.block_k, causal=causal,
                            local_window_size=window)
      bwd_sched = dkv_sched = None
      if cfg.bwd_tiles != (cfg.block_q, cfg.block_k):
        bwd_sched = make_schedule(seq, seq, *cfg.bwd_tiles, causal=causal,
                                  local_window_size=window)
      if cfg.dkv_tiles != cfg.bwd_tiles:
        dkv_sched = make_schedule(seq, seq, *cfg.dkv_tiles, causal=causal,
                                  local_window_size=window)
      return flash_attention(
          q, k, v, None, None, sched, causal=causal, local_window_size=window,
          scale=head_dim ** -0.5, logits_soft_cap=None, block_sizes=cfg, interpret=interpret,
          bwd_schedule=bwd_sched, dkv_schedule=dkv_sched, _bwd_parts=parts)

    def bwd_ms(parts, attn=attn):
      # The VJP closure (a pytree of the saved residuals) is a jit argument: only the backward
      # runs in the timed program.
      out, vjp_fn = jax.vjp(lambda q, k, v: attn(q, k, v, parts=parts)[0], q, k, v)
      ct = jax.random.normal(keys[3], out.shape, out.dtype)
      return timeit(jax.jit(lambda fn, ct: fn(ct)), vjp_fn, ct)

    fwd = jax.jit(lambda q, k, v: attn(q, k, v)[0])
    fwd_bwd = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v)[0].astype(jnp.float32)),
                               argnums=(0, 1, 2)))
    row = dict(config=cfg)
    try:
      row["fwd_ms"] = timeit(fwd, q, k, v)
      row["fwd_bwd_ms"] = timeit(fwd_bwd, q, k, v)
      row["fwd_tflops"] = fwd_flops / row["fwd_ms"] * 1e-9
      row["fwd_bwd_tflops"] = 3.5 * fwd_flops / row["fwd_bwd_ms"] * 1e-9
      if time_bwd:
        for key, parts in (("bwd_ms", "all"), ("dkv_ms", "dkv"), ("dq_ms", "dq"),
                           ("prep_ms", "none")):
          if cfg.fused_bwd and parts in ("dkv", "dq"):
            continue  # one kernel: no per-kernel split (bwd_ms - prep_ms is the kernel)
          row[key] = bwd_ms(parts)
        row["bwd_tflops"] = 2.5 * fwd_flops / row["bwd_ms"] * 1e-9
    except Exception as e:  # a config that does not compile (e.g. shared memory) is reported
      row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    rows.append(row)
    if verbose:
      print(row, flush=True)
  return rows


def _pow2(n: int) -> int:
  return max(16, pl.next_power_of_2(int(n)))


# ----------------------------------------------------------------------------------------------
# Static configuration shared by the kernels
# ----------------------------------------------------------------------------------------------


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
  num_warps: int
  num_stages: int
  bwd_num_warps: int
  bwd_num_stages: int
  dkv_q_chunk: int
  dq_k_chunk: int
  interpret: bool
  head_group: int | None = None  # see BlockSizes.head_group; None: the default rule
  dkv_block_q: int | None = None  # backward only: the dK/dV kernel's q tile (None: block_q)
  bwd_parts: str = "all"  # backward kernels to run: "all", "dkv", "dq", "none" (timing only)
  fused_bwd: bool = False  # backward only: one kernel of paired spans (BlockSizes.fused_bwd)


def _launch_order(st: _Static, num_tiles: int, batch: int, heads: int):
  """(grid, tile_axis, index) for ``num_tiles`` x ``batch`` x ``heads`` programs.

  ``index(p0, p1, p2) -> (t, bi, h)``: grid indices to the program's launch-order tile number
  t (0 = launched first; the kernels map it to the heaviest tile) and its (batch, head).
  ``tile_axis`` is the grid axis of t, for ``pl.program_id`` inside the kernels. CUDA (and so
  the Triton lowering) dispatches grid axis 0 fastest.
  """
  group = st.head_group
  if group is None:
    triangular = st.causal and (st.window is None or st.window[0] is None)
    group = 4 if triangular else 1
  group = max(1, int(group))
  while (batch * heads) % group:
    group //= 2
  if group == 1:
    return (num_tiles, batch, heads), 0, lambda p0, p1, p2: (p0, p1, p2)

  def index(p0, p1, p2):
    bh = p2 * group + p0
    return p1, bh // heads, bh % heads
  return (group, num_tiles, batch * heads // group), 1, index


def _tile_specs(order, tile_of):
  """``spec(shape, f)`` -> a BlockSpec whose index map runs ``f(tile, batch, head)`` on the
  program's (tile, batch, head) under launch ``order`` (from ``_launch_order``); ``tile_of`` maps
  the launch-order tile number to the tile the kernel works on."""
  def spec(shape, f):
    def index_map(*p):
      t, bi, h = order(*p)
      return f(tile_of(t), bi, h)
    return pl.BlockSpec(shape, index_map)
  return spec


def _logits(q, k, st: _Static):
  """Scaled (and soft-capped) logits in the base-2 domain, and tanh(x/cap) for the backward.

  q: [m, D], k: [n, D] -> ([m, n] fp32, [m, n] fp32 or None).
  """
  qk = _dot_nt(q, k)  # [m, n]
  if st.soft_cap is None:
    return qk * (st.scale * LOG2E), None
  th = jnp.tanh(qk * (st.scale / st.soft_cap))  # [m, n]
  return th * (st.soft_cap * LOG2E), th


def _tile_mask(q_pos, k_pos, q_seg, k_seg, st: _Static, *, kv_major=False):
  """masks.visible for one tile: q_pos [m], k_pos [n] -> bool [m, n] ([n, m] when ``kv_major``)."""
  if kv_major:
    qp, kp = q_pos[None, :], k_pos[:, None]  # [1, m], [n, 1]
  else:
    qp, kp = q_pos[:, None], k_pos[None, :]  # [m, 1], [1, n]
  qs = ks = None
  if q_seg is not None:
    qs, ks = (q_seg[None, :], k_seg[:, None]) if kv_major else (q_seg[:, None], k_seg[None, :])
  return visible(qp, kp, qs, ks, causal=st.causal, window=st.window, kv_len=st.kv_len)


def _precision(a):
  # fp32 operands: IEEE fp32 products (DEFAULT would mean TF32 on the GPU); 16-bit: native.
  return lax.Precision.HIGHEST if a.dtype == jnp.float32 else None


def _dot_nn(a, b):
  """[m, k] @ [k, n] -> fp32 [m, n]."""
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=_precision(a),
                         preferred_element_type=jnp.float32)


def _dot_nt(a, b):
  """[m, k] @ [n, k]^T -> fp32 [m, n]."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_precision(a),
                         preferred_element_type=jnp.float32)


def _row_entry(row_ref, at, i):
  """Entry i of a packed schedule row: ``row_ref[i]``, or ``row_ref[at, i]`` for a block of rows."""
  return row_ref[i] if at is None else row_ref[at, i]


def _walk(row_ref, lo, hi, num_chunks, body, carry, at=None):
  """Run ``carry = body(tile, chunk, carry)`` for flat steps j in [lo, hi) of a schedule row.

  Step j visits chunk ``j % num_chunks`` of tile ``row[2 + j // num_chunks]``. The tile index of
  step j + 1 is loaded during step j (a loop-carried prefetch), so no load of the schedule sits
  between the loop start and the tile loads that Triton pipelines. Rows are long enough
  (``_pack_rows``) that the prefetch past the last step stays in bounds. ``at``: the row is
  ``row_ref[at]`` of a block of rows (the fused backward's), else ``row_ref`` itself.
  """
  def split(j):
    if num_chunks == 1:
      return j, 0
    return lax.div(j, jnp.int32(num_chunks)), lax.rem(j, jnp.int32(num_chunks))

  def step(j, state):
    tile, carry = state
    t_next, _ = split(j + 1)
    _, chunk = split(j)
    return _row_entry(row_ref, at, 2 + t_next), body(tile, chunk, carry)

  t_lo, _ = split(lo)
  _, carry = lax.fori_loop(lo, hi, step, (_row_entry(row_ref, at, 2 + t_lo), carry))
  return carry


# ----------------------------------------------------------------------------------------------
# Forward kernel
# ----------------------------------------------------------------------------------------------


def _fwd_kernel(*refs, st: _Static, has_seg: bool, num_q_tiles: int, tile_axis: int):
  """Refs: q [bq, D], k [Sk, D], v [Sk, Dv], (q_seg [bq], kv_seg [Sk]), row [W]
  -> o [bq, Dv], lse [bq] (natural log)."""
  if has_seg:
    q_ref, k_ref, v_ref, qseg_ref, kseg_ref, row_ref, o_ref, lse_ref = refs
  else:
    q_ref, k_ref, v_ref, row_ref, o_ref, lse_ref = refs
    qseg_ref = kseg_ref = None
  bq, bk = st.block_q, st.block_k
  d_v = o_ref.shape[-1]
  assert q_ref.shape[0] == bq and k_ref.shape[0] % bk == 0, (q_ref.shape, k_ref.shape)

  qi = num_q_tiles - 1 - pl.program_id(tile_axis)  # heaviest causal tiles first
  q = q_ref[...]  # [bq, D]
  q_pos = qi * bq + lax.iota(jnp.int32, bq) + (st.kv_len - st.q_len)  # [bq]
  q_seg = qseg_ref[...] if has_seg else None  # [bq]
  count = row_ref[0]
  n_full = row_ref[1]

  def step(tile, _chunk, carry, masked):
    acc, m_prev, l_prev = carry  # [bq, Dv], [bq], [bq]
    start = pl.multiple_of(tile * bk, bk)
    k = k_ref[pl.ds(start, bk), :]  # [bk, D]
    s, _ = _logits(q, k, st)  # [bq, bk], base-2 logits
    if masked:
      k_pos = start + lax.iota(jnp.int32, bk)
      k_seg = kseg_ref[pl.ds(start, bk)] if has_seg else None
      s = jnp.where(_tile_mask(q_pos, k_pos, q_seg, k_seg, st), s, _NEG_INF)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))  # [bq]
    # A row may still have seen nothing (-inf): exponentiate against 0 so no NaN appears.
    m_use = jnp.where(m_new == _NEG_INF, 0.0, m_new) if masked else m_new
    alpha = jnp.exp2(m_prev - m_use)  # [bq]
    p = jnp.exp2(s - m_use[:, None])  # [bq, bk]
    l_new = l_prev * alpha + jnp.sum(p, axis=1)
    v = v_ref[pl.ds(start, bk), :]  # [bk, Dv]
    acc = acc * alpha[:, None] + _dot_nn(p.astype(v.dtype), v)  # [bq, Dv]
    return acc, m_new, l_new

  carry = (jnp.zeros((bq, d_v), jnp.float32), jnp.full((bq,), _NEG_INF, jnp.float32),
           jnp.zeros((bq,), jnp.float32))
  carry = _walk(row_ref, 0, n_full, 1, functools.partial(step, masked=False), carry)
  carry = _walk(row_ref, n_full, count, 1, functools.partial(step, masked=True), carry)
  acc, m, l = carry
  empty = l == 0.0
  l_safe = jnp.where(empty, 1.0, l)
  o_ref[...] = (acc * (1.0 / l_safe)[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(empty, _NEG_INF, (m + jnp.log2(l_safe)) * LN2)


def _row_index_maps(rows):
  """Index helpers into the packed schedule rows [Bs, Hs, n, W] (size-1 axes broadcast)."""
  bs, hs = rows.shape[:2]
  rb = (lambda b: b) if bs > 1 else (lambda b: 0)
  rh = (lambda hk: hk) if hs > 1 else (lambda hk: 0)
  return rb, rh


def _fwd_call(q, k, v, q_seg, kv_seg, rows, st: _Static):
  """Padded inputs -> (out [B, Sq, Hq, Dv] in q.dtype, lse [B, Hq, Sq] fp32).

  The grid covers the schedule's nq query tiles; when the arrays are padded further (for the
  backward's tiles), rows past nq * block_q get out 0 and lse -inf (they are padding).
  """
  b, sq, hq, d = q.shape
  _, sk, hk, d_v = v.shape
  g = hq // hk
  bq = st.block_q
  nq = rows.shape[2]
  assert nq * bq <= sq and sk % st.block_k == 0, (nq, bq, sq, sk, st.block_k)
  has_seg = q_seg is not None
  rb, rh = _row_index_maps(rows)
  w = rows.shape[-1]

  grid, tile_axis, order = _launch_order(st, nq, b, hq)

  spec = _tile_specs(order, lambda t: nq - 1 - t)

  in_specs = [
      spec((None, bq, None, d), lambda i, bi, h: (bi, i, h, 0)),
      spec((None, sk, None, d), lambda i, bi, h: (bi, 0, h // g, 0)),
      spec((None, sk, None, d_v), lambda i, bi, h: (bi, 0, h // g, 0)),
  ]
  args = [q, k, v]
  if has_seg:
    in_specs += [spec((None, bq), lambda i, bi, h: (bi, i)),
                 spec((None, sk), lambda i, bi, h: (bi, 0))]
    args += [q_seg, kv_seg]
  in_specs.append(spec((None, None, None, w), lambda i, bi, h: (rb(bi), rh(h // g), i, 0)))
  args.append(rows)
  out_shape = [jax.ShapeDtypeStruct((b, nq * bq, hq, d_v), q.dtype),
               jax.ShapeDtypeStruct((b, hq, nq * bq), jnp.float32)]
  out_specs = [spec((None, bq, None, d_v), lambda i, bi, h: (bi, i, h, 0)),
               spec((None, None, bq), lambda i, bi, h: (bi, h, i))]
  kernel = functools.partial(_fwd_kernel, st=st, has_seg=has_seg, num_q_tiles=nq,
                             tile_axis=tile_axis)
  out, lse = pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=compat.triton_compiler_params(st.num_warps, st.num_stages),
      interpret=st.interpret,
      name="jattn_flash_fwd",
  )(*args)
  return _pad_axis(out, 1, sq), _pad_axis(lse, 2, sq, _NEG_INF)


# ----------------------------------------------------------------------------------------------
# Backward kernels
# ----------------------------------------------------------------------------------------------


def _dkv_tile(q_ref, do_ref, lse_ref, delta_ref, qseg_ref, row_ref, k, v, k_pos, k_seg, *,
              st: _Static, groups: int, at=None):
  """dK (unscaled) and dV of one kv tile, fp32 [bk, D] / [bk, Dv], summed over the GQA group.

  q_ref [Sq, G, D], do_ref [Sq, G, Dv], lse_ref / delta_ref [G, Sq], qseg_ref [Sq] or None; the
  schedule row (transposed q list of ``st``'s tiles) is ``row_ref`` or ``row_ref[at]``; k [bk, D],
  v [bk, Dv], k_pos [bk] and k_seg [bk] (or None) are the kv tile's.
  """
  bq = st.block_q
  cq = st.dkv_q_chunk
  nc = bq // cq
  assert bq % cq == 0, (bq, cq)
  has_seg = qseg_ref is not None
  count = _row_entry(row_ref, at, 0)
  n_full = _row_entry(row_ref, at, 1)
  off = st.kv_len - st.q_len

  # Everything is computed kv-major ([bk, cq] = transposed logits), so the big P and dS tiles
  # feed the dK/dV dots without a transpose; only the small Q / dO chunks are read transposed.
  def step(tile, c, carry, g, masked):
    dk, dv = carry  # [bk, D], [bk, Dv] fp32
    start = pl.multiple_of(tile * bq + c * cq, cq)
    q = q_ref[pl.ds(start, cq), g, :]  # [cq, D]
    lse2 = lse_ref[g, pl.ds(start, cq)]  # [cq]
    s_t, th_t = _logits(k, q, st)  # [bk, cq]
    if masked:
      q_pos = start + lax.iota(jnp.int32, cq) + off
      q_seg = qseg_ref[pl.ds(start, cq)] if has_seg else None
      mask_t = _tile_mask(q_pos, k_pos, q_seg, k_seg, st, kv_major=True)  # [bk, cq]
      s_t = jnp.where(mask_t, s_t, _NEG_INF)
    p_t = jnp.exp2(s_t - lse2[None, :])  # [bk, cq]
    do = do_ref[pl.ds(start, cq), g, :]  # [cq, Dv]
    dv = dv + _dot_nn(p_t.astype(do.dtype), do)  # [bk, Dv]
    delta = delta_ref[g, pl.ds(start, cq)]  # [cq]
    dp_t = _dot_nt(v, do)  # [bk, cq]
    ds_t = p_t * (dp_t - delta[None, :])  # d loss / d capped logit
    if th_t is not None:
      ds_t = ds_t * (1.0 - th_t * th_t)
    dk = dk + _dot_nn(ds_t.astype(q.dtype), q)  # [bk, D]
    return dk, dv

  def head(g, carry):
    carry = _walk(row_ref, 0, n_full * nc, nc, functools.partial(step, g=g, masked=False), carry,
                  at=at)
    return _walk(row_ref, n_full * nc, count * nc, nc, functools.partial(step, g=g, masked=True),
                 carry, at=at)

  carry = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  if groups == 1:
    return head(0, carry)
  return lax.fori_loop(0, groups, head, carry)


def _dq_tile(k_ref, v_ref, kseg_ref, row_ref, q, do, lse2, delta, q_pos, q_seg, *, st: _Static,
             at=None):
  """dQ (unscaled) of one query tile, fp32 [bq, D].

  k_ref [Sk, D], v_ref [Sk, Dv], kseg_ref [Sk] or None; the schedule row (kv list of ``st``'s
  tiles) is ``row_ref`` or ``row_ref[at]``; q [bq, D], do [bq, Dv], lse2 / delta / q_pos [bq]
  and q_seg [bq] (or None) are the query tile's (one head).
  """
  bk = st.block_k
  ck = st.dq_k_chunk
  nc = bk // ck
  assert bk % ck == 0, (bk, ck)
  has_seg = kseg_ref is not None
  count = _row_entry(row_ref, at, 0)
  n_full = _row_entry(row_ref, at, 1)

  def step(tile, c, dq, masked):
    start = pl.multiple_of(tile * bk + c * ck, ck)
    k = k_ref[pl.ds(start, ck), :]  # [ck, D]
    v = v_ref[pl.ds(start, ck), :]  # [ck, Dv]
    s, th = _logits(q, k, st)  # [bq, ck]
    if masked:
      k_pos = start + lax.iota(jnp.int32, ck)
      k_seg = kseg_ref[pl.ds(start, ck)] if has_seg else None
      s = jnp.where(_tile_mask(q_pos, k_pos, q_seg, k_seg, st), s, _NEG_INF)
    p = jnp.exp2(s - lse2[:, None])  # [bq, ck]
    dp = _dot_nt(do, v)  # [bq, ck]
    ds = p * (dp - delta[:, None])
    if th is not None:
      ds = ds * (1.0 - th * th)
    return dq + _dot_nn(ds.astype(k.dtype), k)  # [bq, D]

  dq = jnp.zeros(q.shape, jnp.float32)
  dq = _walk(row_ref, 0, n_full * nc, nc, functools.partial(step, masked=False), dq, at=at)
  return _walk(row_ref, n_full * nc, count * nc, nc, functools.partial(step, masked=True), dq,
               at=at)


def _dkv_kernel(*refs, st: _Static, has_seg: bool, groups: int, tile_axis: int):
  """Refs: q [Sq, G, D], k [bk, D], v [bk, Dv], do [Sq, G, Dv], lse2 [G, Sq], delta [G, Sq],
  (q_seg [Sq], kv_seg [bk]), row [W] -> dk [bk, D], dv [bk, Dv].

  lse2 is the log-sum-exp in base 2, +inf for rows that saw nothing (so p = 0 there).
  """
  if has_seg:
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kseg_ref, row_ref,
     dk_ref, dv_ref) = refs
  else:
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, row_ref, dk_ref, dv_ref = refs
    qseg_ref = kseg_ref = None
  bk = st.block_k
  assert k_ref.shape[0] == bk, k_ref.shape

  ki = pl.program_id(tile_axis)  # causal: kv tile 0 sees every query tile (heaviest first)
  k = k_ref[...]  # [bk, D]
  v = v_ref[...]  # [bk, Dv]
  k_pos = ki * bk + lax.iota(jnp.int32, bk)  # [bk]
  k_seg = kseg_ref[...] if has_seg else None  # [bk]
  dk, dv = _dkv_tile(q_ref, do_ref, lse_ref, delta_ref, qseg_ref, row_ref, k, v, k_pos, k_seg,
                     st=st, groups=groups)
  dk_ref[...] = (dk * st.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(*refs, st: _Static, has_seg: bool, num_q_tiles: int, tile_axis: int):
  """Refs: q [bq, D], k [Sk, D], v [Sk, Dv], do [bq, Dv], lse2 [bq], delta [bq],
  (q_seg [bq], kv_seg [Sk]), row [W] -> dq [bq, D]."""
  if has_seg:
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kseg_ref, row_ref,
     dq_ref) = refs
  else:
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, row_ref, dq_ref = refs
    qseg_ref = kseg_ref = None
  bq = st.block_q
  assert q_ref.shape[0] == bq, q_ref.shape

  qi = num_q_tiles - 1 - pl.program_id(tile_axis)  # heaviest causal tiles first
  q_pos = qi * bq + lax.iota(jnp.int32, bq) + (st.kv_len - st.q_len)
  q_seg = qseg_ref[...] if has_seg else None
  dq = _dq_tile(k_ref, v_ref, kseg_ref, row_ref, q_ref[...], do_ref[...], lse_ref[...],
                delta_ref[...], q_pos, q_seg, st=st)
  dq_ref[...] = (dq * st.scale).astype(dq_ref.dtype)


def _fused_span(st: _Static) -> int:
  """Rows of q and of kv that one program of the fused backward covers: max(block_q, block_k)
  of the backward tiles (both powers of two, so it is a multiple of each)."""
  return max(st.block_q, st.block_k)


def _fused_bwd_kernel(*refs, st: _Static, dkv_st: _Static, has_seg: bool, groups: int,
                      num_programs: int, q_shift: int, tile_axis: int):
  """Refs: q [Sq, G, D], k [Sk, D], v [Sk, Dv], do [Sq, G, Dv], lse2 [G, Sq], delta [G, Sq],
  (q_seg [Sq], kv_seg [Sk]), dkv rows [L / bk, W], dq rows [L / bq, W]
  -> dq [L, G, D], dk [L, D], dv [L, Dv] (L = ``_fused_span(st)``).

  Program t: dK/dV of the kv tiles of kv span t (rows t*L .. t*L + L - 1; ``dkv_st``'s tiles and
  transposed q lists, the GQA group summed), then dQ of the q tiles of q span
  u = (t + q_shift) mod num_programs for each head of the group (``st``'s tiles and kv lists).
  Spans past the padded arrays are skipped (their output rows are sliced away by the caller).
  Programs start from the last span down.
  """
  if has_seg:
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kseg_ref, dkv_rows_ref,
     dq_rows_ref, dq_ref, dk_ref, dv_ref) = refs
  else:
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dkv_rows_ref, dq_rows_ref, dq_ref,
     dk_ref, dv_ref) = refs
    qseg_ref = kseg_ref = None
  span = _fused_span(st)
  bq, bk = st.block_q, st.block_k
  assert dkv_st.block_k == bk and span % bq == 0 and span % bk == 0, (dkv_st, st)
  # Spans in descending order: with q shorter than kv the first spans have no dQ phase (they
  # start last), with q longer the last ones no dK/dV phase (near-empty, they start first).
  t = num_programs - 1 - pl.program_id(tile_axis)
  u = t if q_shift == 0 else lax.rem(t + q_shift, jnp.int32(num_programs))
  off = st.kv_len - st.q_len

  def dkv_phase():
    for i in range(span // bk):  # static: the kv tiles of this span, one after another
      start = pl.multiple_of(t * span + i * bk, bk)
      k = k_ref[pl.ds(start, bk), :]  # [bk, D]
      v = v_ref[pl.ds(start, bk), :]  # [bk, Dv]
      k_pos = start + lax.iota(jnp.int32, bk)
      k_seg = kseg_ref[pl.ds(start, bk)] if has_seg else None
      dk, dv = _dkv_tile(q_ref, do_ref, lse_ref, delta_ref, qseg_ref, dkv_rows_ref, k, v, k_pos,
                         k_seg, st=dkv_st, groups=groups, at=i)
      dk_ref[pl.ds(i * bk, bk), :] = (dk * st.scale).astype(dk_ref.dtype)
      dv_ref[pl.ds(i * bk, bk), :] = dv.astype(dv_ref.dtype)

  def dq_head(g, carry):
    for i in range(span // bq):  # static: the q tiles of this span
      start = pl.multiple_of(u * span + i * bq, bq)
      q_pos = start + lax.iota(jnp.int32, bq) + off
      q_seg = qseg_ref[pl.ds(start, bq)] if has_seg else None
      dq = _dq_tile(k_ref, v_ref, kseg_ref, dq_rows_ref, q_ref[pl.ds(start, bq), g, :],
                    do_ref[pl.ds(start, bq), g, :], lse_ref[g, pl.ds(start, bq)],
                    delta_ref[g, pl.ds(start, bq)], q_pos, q_seg, st=st, at=i)
      dq_ref[pl.ds(i * bq, bq), g, :] = (dq * st.scale).astype(dq_ref.dtype)
    return carry

  def dq_phase():
    if groups == 1:
      dq_head(0, None)
    else:
      lax.fori_loop(0, groups, dq_head, None)

  # Spans that lie inside the padded arrays; static when every program has both phases.
  for phase, idx, n in ((dkv_phase, t, k_ref.shape[0] // span),
                        (dq_phase, u, q_ref.shape[0] // span)):
    if n >= num_programs:
      phase()
    else:
      pl.when(idx < n)(phase)


def _bwd_calls(q, k, v, q_seg, kv_seg, fwd_rows, bwd_rows, do, lse2, delta, st: _Static):
  """Padded inputs -> (dq, dk, dv) in the input dtypes.

  ``st`` carries the backward tiles; ``fwd_rows`` / ``bwd_rows`` are the backward schedule's kv
  lists (dQ) and transposed q lists (dK/dV; with ``st.dkv_block_q`` set, the transposed lists of
  a schedule whose q tile is ``st.dkv_block_q``). The grids cover that schedule's tiles;
  gradient rows of padding past them are 0. ``st.bwd_parts`` other than "all" (timing only)
  skips kernels and returns zeros in their place. ``st.fused_bwd``: one kernel computes all
  three (``_fused_bwd_call``; the padded lengths must be multiples of ``_fused_span(st)``).
  """
  dkv_st = st
  if st.dkv_block_q is not None:
    dkv_st = dataclasses.replace(st, block_q=st.dkv_block_q,
                                 dkv_q_chunk=min(st.dkv_q_chunk, st.dkv_block_q))
  sq, sk = q.shape[1], k.shape[1]
  if st.fused_bwd:
    if st.bwd_parts == "none":
      return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
    if st.bwd_parts != "all":
      raise ValueError(f"the fused backward is one kernel: _bwd_parts={st.bwd_parts!r} cannot "
                       f"run a part of it (use 'all' or 'none')")
    dq, dk, dv = _fused_bwd_call(q, k, v, q_seg, kv_seg, fwd_rows, bwd_rows, do, lse2, delta,
                                 st, dkv_st)
    return dq[:, :sq], dk[:, :sk], dv[:, :sk]
  if st.bwd_parts in ("all", "dkv"):
    dk, dv = _dkv_call(q, k, v, q_seg, kv_seg, bwd_rows, do, lse2, delta, dkv_st)
  else:
    dk, dv = jnp.zeros_like(k), jnp.zeros_like(v)
  if st.bwd_parts in ("all", "dq"):
    dq = _dq_call(q, k, v, q_seg, kv_seg, fwd_rows, do, lse2, delta, st)
  else:
    dq = jnp.zeros_like(q)
  return _pad_axis(dq, 1, sq), _pad_axis(dk, 1, sk), _pad_axis(dv, 1, sk)


def _dkv_call(q, k, v, q_seg, kv_seg, rows, do, lse2, delta, st: _Static):
  """dK / dV (padded inputs; ``rows``: transposed q lists of ``st``'s tiles) -> dk, dv
  [B, nk * block_k, Hk, D / Dv]."""
  b, sq, hq, d = q.shape
  _, sk, hk, d_v = v.shape
  g = hq // hk
  bq, bk = st.block_q, st.block_k
  nk = rows.shape[2]
  assert nk * bk <= sk and sq % bq == 0 and sk % bk == 0, (nk, sq, sk, bq, bk)
  has_seg = q_seg is not None
  params = compat.triton_compiler_params(st.bwd_num_warps, st.bwd_num_stages)

  # dK / dV: programs over (kv tile, batch, kv head); kv tile 0 is the heaviest causal one.
  grid, tile_axis, order = _launch_order(st, nk, b, hk)
  spec = _tile_specs(order, lambda t: t)
  rb, rh = _row_index_maps(rows)
  in_specs = [
      spec((None, sq, g, d), lambda i, bi, h: (bi, 0, h, 0)),       # q
      spec((None, bk, None, d), lambda i, bi, h: (bi, i, h, 0)),    # k
      spec((None, bk, None, d_v), lambda i, bi, h: (bi, i, h, 0)),  # v
      spec((None, sq, g, d_v), lambda i, bi, h: (bi, 0, h, 0)),     # do
      spec((None, g, sq), lambda i, bi, h: (bi, h, 0)),             # lse2
      spec((None, g, sq), lambda i, bi, h: (bi, h, 0)),             # delta
  ]
  args = [q, k, v, do, lse2, delta]
  if has_seg:
    in_specs += [spec((None, sq), lambda i, bi, h: (bi, 0)),
                 spec((None, bk), lambda i, bi, h: (bi, i))]
    args += [q_seg, kv_seg]
  in_specs.append(spec((None, None, None, rows.shape[-1]),
                       lambda i, bi, h: (rb(bi), rh(h), i, 0)))
  args.append(rows)
  return pl.pallas_call(
      functools.partial(_dkv_kernel, st=st, has_seg=has_seg, groups=g, tile_axis=tile_axis),
      grid=grid,
      in_specs=in_specs,
      out_specs=[spec((None, bk, None, d), lambda i, bi, h: (bi, i, h, 0)),
                 spec((None, bk, None, d_v), lambda i, bi, h: (bi, i, h, 0))],
      out_shape=[jax.ShapeDtypeStruct((b, nk * bk, hk, d), k.dtype),
                 jax.ShapeDtypeStruct((b, nk * bk, hk, d_v), v.dtype)],
      compiler_params=params,
      interpret=st.interpret,
      name="jattn_flash_bwd_dkv",
  )(*args)


def _dq_call(q, k, v, q_seg, kv_seg, rows, do, lse2, delta, st: _Static):
  """dQ (padded inputs; ``rows``: kv lists of ``st``'s tiles) -> dq [B, nq * block_q, Hq, D]."""
  b, sq, hq, d = q.shape
  _, sk, hk, d_v = v.shape
  g = hq // hk
  bq, bk = st.block_q, st.block_k
  nq = rows.shape[2]
  assert nq * bq <= sq and sq % bq == 0 and sk % bk == 0, (nq, sq, sk, bq, bk)
  has_seg = q_seg is not None
  params = compat.triton_compiler_params(st.bwd_num_warps, st.bwd_num_stages)

  # dQ: programs over (query tile, batch, query head), heaviest causal query tiles first.
  grid, tile_axis, order = _launch_order(st, nq, b, hq)
  spec = _tile_specs(order, lambda t: nq - 1 - t)
  rb, rh = _row_index_maps(rows)
  in_specs = [
      spec((None, bq, None, d), lambda i, bi, h: (bi, i, h, 0)),          # q
      spec((None, sk, None, d), lambda i, bi, h: (bi, 0, h // g, 0)),     # k
      spec((None, sk, None, d_v), lambda i, bi, h: (bi, 0, h // g, 0)),   # v
      spec((None, bq, None, d_v), lambda i, bi, h: (bi, i, h, 0)),        # do
      spec((None, None, bq), lambda i, bi, h: (bi, h, i)),                # lse2
      spec((None, None, bq), lambda i, bi, h: (bi, h, i)),                # delta
  ]
  args = [q, k, v, do, lse2, delta]
  if has_seg:
    in_specs += [spec((None, bq), lambda i, bi, h: (bi, i)),
                 spec((None, sk), lambda i, bi, h: (bi, 0))]
    args += [q_seg, kv_seg]
  in_specs.append(spec((None, None, None, rows.shape[-1]),
                       lambda i, bi, h: (rb(bi), rh(h // g), i, 0)))
  args.append(rows)
  return pl.pallas_call(
      functools.partial(_dq_kernel, st=st, has_seg=has_seg, num_q_tiles=nq, tile_axis=tile_axis),
      grid=grid,
      in_specs=in_specs,
      out_specs=spec((None, bq, None, d), lambda i, bi, h: (bi, i, h, 0)),
      out_shape=jax.ShapeDtypeStruct((b, nq * bq, hq, d), q.dtype),
      compiler_params=params,
      interpret=st.interpret,
      name="jattn_flash_bwd_dq",
  )(*args)


def _fused_bwd_call(q, k, v, q_seg, kv_seg, dq_rows, dkv_rows, do, lse2, delta, st: _Static,
                    dkv_st: _Static):
  """dQ, dK, dV in one kernel of paired spans (``BlockSizes.fused_bwd``; padded inputs whose
  lengths are multiples of the span L) -> dq [B, P * L, Hq, D], dk / dv [B, P * L, Hk, D / Dv];
  rows past the inputs' lengths are not written (the caller slices them away).

  ``dq_rows``: kv lists of ``st``'s tiles (as ``_dq_call``); ``dkv_rows``: transposed q lists of
  ``dkv_st``'s tiles (as ``_dkv_call``). Grid: P = max(Sk, Sq) / L programs per (batch, kv head).
  """
  b, sq, hq, d = q.shape
  _, sk, hk, d_v = v.shape
  g = hq // hk
  bq, bk = st.block_q, st.block_k
  span = _fused_span(st)
  assert sq % span == 0 and sk % span == 0 and sq % dkv_st.block_q == 0, (sq, sk, span, dkv_st)
  nk_sched, nq_sched = dkv_rows.shape[2], dq_rows.shape[2]
  assert nk_sched * bk <= sk and nq_sched * bq <= sq, (nk_sched, nq_sched, sq, sk)
  num_programs = max(sk // span, sq // span)
  # Rows for every tile of every program's spans: tiles past the schedule's get count 0 (their
  # gradients are 0, as the two-kernel backward pads them).
  dkv_rows = _pad_axis(dkv_rows, 2, num_programs * (span // bk))
  dq_rows = _pad_axis(dq_rows, 2, num_programs * (span // bq))
  # Pair kv span t with q span t - s (mod P), s = floor((kv_len - q_len) / L): for a bottom-right
  # causal mask the q span whose diagonal meets kv span t, so the two phases' work adds up to
  # about the same for every program.
  q_shift = (-((st.kv_len - st.q_len) // span)) % num_programs
  has_seg = q_seg is not None
  params = compat.triton_compiler_params(st.bwd_num_warps, st.bwd_num_stages)

  grid, tile_axis, order = _launch_order(st, num_programs, b, hk)
  last = num_programs - 1  # launch-order program t works on kv span last - t (see the kernel)
  spec_k = _tile_specs(order, lambda t: last - t)
  if q_shift:
    spec_q = _tile_specs(order, lambda t: lax.rem(last - t + q_shift, jnp.int32(num_programs)))
  else:
    spec_q = spec_k
  rb, rh = _row_index_maps(dkv_rows)
  qb, qh = _row_index_maps(dq_rows)
  in_specs = [
      spec_k((None, sq, g, d), lambda i, bi, h: (bi, 0, h, 0)),       # q
      spec_k((None, sk, None, d), lambda i, bi, h: (bi, 0, h, 0)),    # k
      spec_k((None, sk, None, d_v), lambda i, bi, h: (bi, 0, h, 0)),  # v
      spec_k((None, sq, g, d_v), lambda i, bi, h: (bi, 0, h, 0)),     # do
      spec_k((None, g, sq), lambda i, bi, h: (bi, h, 0)),             # lse2
      spec_k((None, g, sq), lambda i, bi, h: (bi, h, 0)),             # delta
  ]
  args = [q, k, v, do, lse2, delta]
  if has_seg:
    in_specs += [spec_k((None, sq), lambda i, bi, h: (bi, 0)),
                 spec_k((None, sk), lambda i, bi, h: (bi, 0))]
    args += [q_seg, kv_seg]
  in_specs += [spec_k((None, None, span // bk, dkv_rows.shape[-1]),
                      lambda i, bi, h: (rb(bi), rh(h), i, 0)),
               spec_q((None, None, span // bq, dq_rows.shape[-1]),
                      lambda i, bi, h: (qb(bi), qh(h), i, 0))]
  args += [dkv_rows, dq_rows]
  kernel = functools.partial(_fused_bwd_kernel, st=st, dkv_st=dkv_st, has_seg=has_seg, groups=g,
                             num_programs=num_programs, q_shift=q_shift, tile_axis=tile_axis)
  n = num_programs * span
  return pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=in_specs,
      out_specs=[spec_q((None, span, g, d), lambda i, bi, h: (bi, i, h, 0)),
                 spec_k((None, span, None, d), lambda i, bi, h: (bi, i, h, 0)),
                 spec_k((None, span, None, d_v), lambda i, bi, h: (bi, i, h, 0))],
      out_shape=[jax.ShapeDtypeStruct((b, n, hq, d), q.dtype),
                 jax.ShapeDtypeStruct((b, n, hk, d), k.dtype),
                 jax.ShapeDtypeStruct((b, n, hk, d_v), v.dtype)],
      compiler_params=params,
      interpret=st.interpret,
      name="jattn_flash_bwd_fused",
  )(*args)


# ----------------------------------------------------------------------------------------------
# custom_vjp wiring (on padded arrays)
# ----------------------------------------------------------------------------------------------


def _bwd_row_terms(out, lse, d_out, d_lse):
  """The per-row inputs of the backward kernels, from any forward's (out, lse) and cotangents.

  out, d_out: [B, Sq, Hq, Dv]; lse: [B, Hq, Sq] fp32, natural log, -inf for rows that see no key;
  d_lse: [B, Hq, Sq]. Returns (delta, lse2), both [B, Hq, Sq] fp32: delta = rowsum(dO * O) - dLSE
  (elementwise + reduce, no TF32 matmul) and lse2 = lse * log2(e), +inf where lse is -inf (the
  kernels compute p = exp2(s - lse2), so those rows get p = 0 and zero gradients).
  """
  delta = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1)  # [B, Sq, Hq]
  delta = jnp.swapaxes(delta, 1, 2) - d_lse.astype(jnp.float32)
  lse2 = jnp.where(lse == _NEG_INF, _POS_INF, lse * LOG2E)  # base 2; +inf -> p = 0
  return delta, lse2


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _flash_padded(st, bst, q, k, v, q_seg, kv_seg, fwd_rows, dq_rows, dkv_rows):
  """st / fwd_rows: the forward's tiles and kv lists; bst / dq_rows / dkv_rows: the backward's
  tiles, kv lists (dQ) and transposed q lists (dK/dV)."""
  return _fwd_call(q, k, v, q_seg, kv_seg, fwd_rows, st)


def _flash_padded_fwd(st, bst, q, k, v, q_seg, kv_seg, fwd_rows, dq_rows, dkv_rows):
  out, lse = _fwd_call(q, k, v, q_seg, kv_seg, fwd_rows, st)
  return (out, lse), (q, k, v, q_seg, kv_seg, dq_rows, dkv_rows, out, lse)


def _flash_padded_bwd(st, bst, res, cts):
  del st
  q, k, v, q_seg, kv_seg, dq_rows, dkv_rows, out, lse = res
  d_out, d_lse = cts
  delta, lse2 = _bwd_row_terms(out, lse, d_out, d_lse)
  dq, dk, dv = _bwd_calls(q, k, v, q_seg, kv_seg, dq_rows, dkv_rows, d_out.astype(q.dtype),
                          lse2, delta, bst)
  return dq, dk, dv, None, None, None, None, None


_flash_padded.defvjp(_flash_padded_fwd, _flash_padded_bwd)


# ----------------------------------------------------------------------------------------------
# Schedule packing and the public entry point
# ----------------------------------------------------------------------------------------------


def _pack_rows(indices, counts, partial):
  """[Bs, Hs, n, L] lists -> int32 [Bs, Hs, n, W] rows ``[count, n_full, full..., partial...]``.

  W is a power of two >= L + 3 (``_walk`` prefetches one entry past the last visited tile);
  entries past ``count`` are never used.
  """
  length = indices.shape[-1]
  j = jnp.arange(length, dtype=jnp.int32)
  valid = j < counts[..., None]
  part = (partial != 0) & valid
  key = jnp.where(valid, jnp.where(part, length + j, j), 2 * length + j)
  order = jnp.argsort(key, axis=-1)
  idx = jnp.take_along_axis(indices.astype(jnp.int32), order, axis=-1)
  counts = counts.astype(jnp.int32)
  n_full = counts - jnp.sum(part, axis=-1, dtype=jnp.int32)
  width = pl.next_power_of_2(length + 3)
  pad = jnp.zeros(idx.shape[:-1] + (width - length - 2,), jnp.int32)
  return jnp.concatenate([counts[..., None], n_full[..., None], idx, pad], axis=-1)


def _pad_axis(x, axis, size, value=0):
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)


def flash_attention(q, k, v, q_segment_ids, kv_segment_ids, schedule: BlockSchedule, *,
                    causal: bool, local_window_size, scale: float,
                    logits_soft_cap: float | None, num_warps=None, num_stages=None,
                    interpret: bool = False, bwd_num_warps=None, bwd_num_stages=None,
                    dkv_q_chunk=None, dq_k_chunk=None, block_sizes: BlockSizes | None = None,
                    bwd_schedule: BlockSchedule | None = None,
                    dkv_schedule: BlockSchedule | None = None, _bwd_parts: str = "all"):
  """Flash attention on the GPU (Pallas, Triton lowering), walking a block schedule.

  Differentiable (custom_vjp) with respect to q, k, v, including through the returned LSE.

  Args:
    q: [B, Sq, Hq, D]; fp32, bf16 or fp16.
    k: [B, Sk, Hk, D]; Hq % Hk == 0 (query head h reads kv head h // (Hq // Hk)).
    v: [B, Sk, Hk, Dv].
    q_segment_ids, kv_segment_ids: None (both) or int32 [B, Sq] / [B, Sk]; 0 is padding.
    schedule: ``make_schedule(Sq, Sk, block_q, block_k, ...)`` for the same mask; drives the
      forward, and its tile sizes are the forward kernel's tiles (powers of two >= 16).
    causal: bottom-right aligned causal mask.
    local_window_size: None, int or (left, right) (jax.nn convention).
    scale: logit scale (None: 1 / sqrt(head_dim)).
    logits_soft_cap: None or cap (logits = cap * tanh(logits / cap)).
    num_warps, num_stages: forward launch parameters (None: defaults for the tile size).
    interpret: run the kernels in the Pallas interpreter (CPU).
    bwd_num_warps, bwd_num_stages: backward launch parameters (None: defaults).
    dkv_q_chunk: query rows per step of the dK/dV kernel (divides the backward block_q; None:
      default).
    dq_k_chunk: key rows per step of the dQ kernel (divides the backward block_k; None: default).
    block_sizes: optional ``BlockSizes`` (e.g. from ``_bench_configs``) supplying every launch
      parameter not passed explicitly; its forward tiles must equal ``schedule``'s and its
      ``bwd_tiles`` ``bwd_schedule``'s.
    bwd_schedule: the schedule of the same mask (same lengths, causal, window, segment ids, block
      mask) with the backward's tiles; it drives dQ (its kv lists) and dK/dV (its transposed q
      lists). None: ``schedule`` (one tiling for both passes).
    dkv_schedule: optional schedule of the same mask with the backward's block_k and its own
      block_q (``BlockSizes.dkv_block_q``, e.g. the dK/dV chunk): the dK/dV kernel walks its
      transposed q lists instead of ``bwd_schedule``'s. None: ``bwd_schedule``.
    _bwd_parts: timing only: "dkv", "dq" or "none" runs only that backward kernel (or neither)
      and returns zero gradients in place of the other's.

  Returns:
    (out [B, Sq, Hq, Dv] in q.dtype, lse [B, Hq, Sq] fp32, natural log, -inf for rows that
    see no key; their output is 0).

  Example:
    >>> from pallas_kernels.block_schedule import make_schedule
    >>> q = jax.random.normal(jax.random.key(0), (1, 100, 2, 32))
    >>> s = make_schedule(100, 100, 32, 16, causal=True)
    >>> out, lse = flash_attention(q, q, q, None, None, s, causal=True, local_window_size=None,
    ...                            scale=32 ** -0.5, logits_soft_cap=None, interpret=True)
    >>> out.shape, lse.shape
    ((1, 100, 2, 32), (1, 2, 100))
  """
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"q, k, v must be [batch, seq, heads, head_dim], got {q.shape}, {k.shape}, "
                     f"{v.shape}")
  b, sq, hq, d = q.shape
  bk_, sk, hk, dk_ = k.shape
  if bk_ != b or v.shape[:3] != k.shape[:3] or dk_ != d:
    raise ValueError(f"q, k, v shapes do not agree: {q.shape}, {k.shape}, {v.shape}")
  if hq % hk:
    raise ValueError(f"q heads ({hq}) must be a multiple of kv heads ({hk})")
  d_v = v.shape[-1]
  if scale is None:
    scale = d ** -0.5
  if not (1 <= d <= 256 and 1 <= d_v <= 256):
    raise ValueError(f"head_dim must be <= 256, got {d} (v: {d_v})")
  if not (q.dtype == k.dtype == v.dtype):
    raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  if q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
    raise TypeError(f"dtype must be float32, bfloat16 or float16, got {q.dtype}")
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("q_segment_ids and kv_segment_ids must be given together")
  if q_segment_ids is not None and (q_segment_ids.shape != (b, sq)
                                    or kv_segment_ids.shape != (b, sk)):
    raise ValueError(f"segment ids must be [batch, len]: got {q_segment_ids.shape}, "
                     f"{kv_segment_ids.shape} for q {q.shape}, k {k.shape}")
  if bwd_schedule is None:
    bwd_schedule = schedule
  if dkv_schedule is None:
    dkv_schedule = bwd_schedule
  if _bwd_parts not in ("all", "dkv", "dq", "none"):
    raise ValueError(f"_bwd_parts must be all, dkv, dq or none, got {_bwd_parts!r}")
  for what, sch in (("schedule", schedule), ("bwd_schedule", bwd_schedule),
                    ("dkv_schedule", dkv_schedule)):
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
  bq, bk = schedule.block_q, schedule.block_k
  bbq, bbk = bwd_schedule.block_q, bwd_schedule.block_k
  dkv_bq = dkv_schedule.block_q
  if dkv_schedule.block_k != bbk:
    raise ValueError(f"dkv_schedule block_k ({dkv_schedule.block_k}) must equal the backward "
                     f"schedule's ({bbk})")

  if block_sizes is not None:
    if (block_sizes.block_q, block_sizes.block_k) != (bq, bk):
      raise ValueError(f"block_sizes tiles ({block_sizes.block_q}, {block_sizes.block_k}) differ "
                       f"from the schedule's ({bq}, {bk})")
    if block_sizes.bwd_tiles != (bbq, bbk):
      raise ValueError(f"block_sizes backward tiles {block_sizes.bwd_tiles} differ from the "
                       f"backward schedule's ({bbq}, {bbk}): pass bwd_schedule=make_schedule(..., "
                       f"{block_sizes.bwd_tiles[0]}, {block_sizes.bwd_tiles[1]}, <same mask>)")
    if block_sizes.dkv_tiles != (dkv_bq, bbk):
      raise ValueError(f"block_sizes dK/dV tiles {block_sizes.dkv_tiles} differ from the dK/dV "
                       f"schedule's ({dkv_bq}, {bbk}): pass dkv_schedule=make_schedule(..., "
                       f"{block_sizes.dkv_tiles[0]}, {block_sizes.dkv_tiles[1]}, <same mask>)")
    num_warps = num_warps or block_sizes.num_warps
    num_stages = num_stages or block_sizes.num_stages
    bwd_num_warps = bwd_num_warps or block_sizes.bwd_num_warps
    bwd_num_stages = bwd_num_stages or block_sizes.bwd_num_stages
    dkv_q_chunk = dkv_q_chunk or block_sizes.dkv_q_chunk
    dq_k_chunk = dq_k_chunk or block_sizes.dq_k_chunk
  head_group = None if block_sizes is None else block_sizes.head_group
  fused_bwd = block_sizes is not None and bool(block_sizes.fused_bwd)
  if fused_bwd and _bwd_parts in ("dkv", "dq"):
    raise ValueError(f"BlockSizes.fused_bwd runs dQ, dK and dV in one kernel: _bwd_parts="
                     f"{_bwd_parts!r} cannot run a part of it (use 'all' or 'none')")
  if head_group is not None and head_group < 1:
    raise ValueError(f"head_group must be >= 1 or None, got {head_group}")
  defaults = _launch_defaults(bq, bk, _pow2(d), _pow2(d_v), q.dtype, bwd_block_q=bbq,
                              bwd_block_k=bbk)
  dkv_q_chunk = min(dkv_q_chunk or defaults.dkv_q_chunk, dkv_bq)
  dq_k_chunk = min(dq_k_chunk or defaults.dq_k_chunk, bbk)
  for name, c, blk in (("dkv_q_chunk", dkv_q_chunk, dkv_bq), ("dq_k_chunk", dq_k_chunk, bbk)):
    if c < 16 or blk % c:
      raise ValueError(f"{name}={c} must be >= 16 and divide the backward tile {blk}")
  st = _Static(
      block_q=bq, block_k=bk, q_len=sq, kv_len=sk, causal=bool(causal),
      window=normalize_window(local_window_size), scale=float(scale),
      soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
      num_warps=int(num_warps or defaults.num_warps),
      num_stages=int(num_stages or defaults.num_stages),
      bwd_num_warps=int(bwd_num_warps or defaults.bwd_num_warps),
      bwd_num_stages=int(bwd_num_stages or defaults.bwd_num_stages),
      dkv_q_chunk=int(dkv_q_chunk), dq_k_chunk=int(dq_k_chunk), interpret=bool(interpret),
      head_group=head_group)
  bst = dataclasses.replace(st, block_q=bbq, block_k=bbk,
                            dkv_block_q=None if dkv_bq == bbq else dkv_bq, bwd_parts=_bwd_parts,
                            fused_bwd=fused_bwd)

  # Pad the sequences to a multiple of both passes' tiles (powers of two: the larger one); each
  # pass's grid covers its own tiles, and rows past them are padding (see _fwd_call, _bwd_calls).
  # The fused backward's programs cover spans of max(bbq, bbk) rows of both q and kv.
  span = _fused_span(bst) if fused_bwd else 1
  sq_p = -(-sq // max(bq, bbq, dkv_bq, span)) * max(bq, bbq, dkv_bq, span)
  sk_p = -(-sk // max(bk, bbk, span)) * max(bk, bbk, span)
  d_p, dv_p = _pow2(d), _pow2(d_v)
  qp = _pad_axis(_pad_axis(q, 1, sq_p), 3, d_p)
  kp = _pad_axis(_pad_axis(k, 1, sk_p), 3, d_p)
  vp = _pad_axis(_pad_axis(v, 1, sk_p), 3, dv_p)
  if q_segment_ids is not None:
    qs = _pad_axis(q_segment_ids.astype(jnp.int32), 1, sq_p)
    ks = _pad_axis(kv_segment_ids.astype(jnp.int32), 1, sk_p)
  else:
    qs = ks = None
  fwd_rows = _pack_rows(schedule.kv_indices, schedule.kv_counts, schedule.kv_partial)
  if bwd_schedule is schedule:
    dq_rows = fwd_rows
  else:
    dq_rows = _pack_rows(bwd_schedule.kv_indices, bwd_schedule.kv_counts,
                         bwd_schedule.kv_partial)
  dkv_rows = _pack_rows(dkv_schedule.q_indices, dkv_schedule.q_counts, dkv_schedule.q_partial)
  out, lse = _flash_padded(st, bst, qp, kp, vp, qs, ks, fwd_rows, dq_rows, dkv_rows)
  return out[:, :sq, :, :d_v], lse[:, :, :sq]


def flash_attention_bwd(q, k, v, out, lse, d_out, d_lse, *, causal: bool, scale: float,
                        block_sizes: BlockSizes | None = None, interpret: bool = False,
                        _bwd_parts: str = "all"):
  """The Triton backward kernels (dK/dV, dQ) for another forward's residuals (dense or causal).

  Used by the Mosaic GPU forward (``pallas_kernels.flash.mosaic_gpu``), whose custom_vjp keeps
  (q, k, v, out, lse) and hands them here. The mask is dense or causal (bottom-right aligned);
  the backward walks ``make_schedule(Sq, Sk, *block_sizes.bwd_tiles, causal=causal)``. Segment
  ids, windows and soft cap are not taken: the forward that calls this supports none of them.

  Args:
    q: [B, Sq, Hq, D]; k: [B, Sk, Hk, D]; v: [B, Sk, Hk, Dv] (Hq % Hk == 0), unpadded.
    out: the forward's output [B, Sq, Hq, Dv].
    lse: the forward's log-sum-exp [B, Hq, Sq] fp32: natural log, -inf for rows that see no key
      (the convention of ``flash_attention`` here and of the Mosaic GPU forward); converted to
      base 2 (+inf for -inf rows) exactly as this module's own backward does.
    d_out: cotangent of out [B, Sq, Hq, Dv].
    d_lse: cotangent of lse [B, Hq, Sq] (zeros when only out is used).
    causal: causal mask (bottom-right aligned when Sq != Sk).
    scale: the logit scale the forward used.
    block_sizes: Triton ``BlockSizes`` whose backward fields are used (None:
      ``default_block_sizes(D, q.dtype)``).
    interpret: run the kernels in the Pallas interpreter (CPU).
    _bwd_parts: timing only (``experiments/gpu_sweep.py``): "dkv", "dq" or "none" runs only that
      kernel (or neither) and returns zeros for the rest; not with ``fused_bwd`` ("all", "none").

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
  from pallas_kernels.block_schedule import make_schedule  # local: only this bridge needs it

  b, sq, hq, d = q.shape
  _, sk, hk, d_v = v.shape
  if k.shape[:3] != v.shape[:3] or k.shape[3] != d or hq % hk:
    raise ValueError(f"q, k, v shapes do not agree: {q.shape}, {k.shape}, {v.shape}")
  if out.shape != (b, sq, hq, d_v) or lse.shape != (b, hq, sq):
    raise ValueError(f"residuals out {out.shape} / lse {lse.shape} do not match q {q.shape}, "
                     f"v {v.shape}")
  bs = block_sizes or default_block_sizes(max(d, d_v), q.dtype)
  bbq, bbk = bs.bwd_tiles
  d_p, dv_p = _pow2(d), _pow2(d_v)
  defaults = _launch_defaults(bbq, bbk, d_p, dv_p, q.dtype, bwd_block_q=bbq, bwd_block_k=bbk)
  dkv_q_chunk = min(bs.dkv_q_chunk or defaults.dkv_q_chunk, bbq)
  dq_k_chunk = min(bs.dq_k_chunk or defaults.dq_k_chunk, bbk)
  st = _Static(
      block_q=bbq, block_k=bbk, q_len=sq, kv_len=sk, causal=bool(causal), window=None,
      scale=float(scale), soft_cap=None, num_warps=int(defaults.num_warps),
      num_stages=int(defaults.num_stages),
      bwd_num_warps=int(bs.bwd_num_warps or defaults.bwd_num_warps),
      bwd_num_stages=int(bs.bwd_num_stages or defaults.bwd_num_stages),
      dkv_q_chunk=int(dkv_q_chunk), dq_k_chunk=int(dq_k_chunk), interpret=bool(interpret),
      head_group=bs.head_group, fused_bwd=bool(bs.fused_bwd), bwd_parts=_bwd_parts)
  schedule = make_schedule(sq, sk, bbq, bbk, causal=causal)
  dq_rows = _pack_rows(schedule.kv_indices, schedule.kv_counts, schedule.kv_partial)
  dkv_rows = _pack_rows(schedule.q_indices, schedule.q_counts, schedule.q_partial)
  # Padded query rows get d_out = 0, d_lse = 0 and lse = -inf (p = 0): they add nothing.
  pq, pk = (_fused_span(st),) * 2 if st.fused_bwd else (bbq, bbk)
  sq_p, sk_p = -(-sq // pq) * pq, -(-sk // pk) * pk
  qp = _pad_axis(_pad_axis(q, 1, sq_p), 3, d_p)
  kp = _pad_axis(_pad_axis(k, 1, sk_p), 3, d_p)
  vp = _pad_axis(_pad_axis(v, 1, sk_p), 3, dv_p)
  outp = _pad_axis(_pad_axis(out, 1, sq_p), 3, dv_p)
  dop = _pad_axis(_pad_axis(d_out.astype(q.dtype), 1, sq_p), 3, dv_p)
  lsep = _pad_axis(lse.astype(jnp.float32), 2, sq_p, _NEG_INF)
  dlsep = _pad_axis(d_lse.astype(jnp.float32), 2, sq_p)
  delta, lse2 = _bwd_row_terms(outp, lsep, dop, dlsep)
  dq, dk, dv = _bwd_calls(qp, kp, vp, None, None, dq_rows, dkv_rows, dop, lse2, delta, st)
  return dq[:, :sq, :, :d], dk[:, :sk, :, :d], dv[:, :sk, :, :d_v]


__all__ = ["BlockSizes", "default_block_sizes", "flash_attention", "flash_attention_bwd"]
