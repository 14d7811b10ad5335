"""Flash attention forward for Hopper (sm90) with Pallas Mosaic GPU: TMA, wgmma, warp specialisation.

STATUS (2026-11-30, H200, jax 0.11.2, CUDA 13.0): the forward has run on a GPU and passed its 11
GPU tests (run 9: dense/causal, GQA, bf16/fp16, head_dim 64/128/256, ragged, q_len > kv_len;
experiments/results/h200_gpu_tests_run9_20261130.txt). ``_sweep`` in run 10
(experiments/results/h200_mosaic_gpu_sweep_run10_20261130.json), B2 S16K H16 D128 bf16, default
``BlockSizes(64, 128, num_stages=2, pingpong=True)``: non-causal 7.19 ms = 612 TFLOP/s (jax.nn
cuDNN 6.99 ms, 629), causal 3.81 ms = 577 TFLOP/s (cuDNN 3.83 ms, 575); max |diff| vs cuDNN
5e-4 / 2e-3. Non-causal neighbours: pingpong=False 592 TFLOP/s, block_k=64 485, num_stages=3
over the shared-memory limit (232568 > 232448 bytes). That is ~1.5x the Triton forward (~400
TFLOP/s). D64 and D256 have not been timed.

Differentiable (run on the H200 in run 17 through ``jattn.flash_attention`` with windows, forward
+ VJP vs the reference): ``flash_attention`` here: its custom_vjp hands
(q, k, v, out, lse) to the Triton backward kernels (``triton.flash_attention_bwd``: dK/dV and dQ,
the same LSE convention), and ``jattn.flash_attention(implementation="mosaic_gpu")`` runs it
(``implementation=None`` does not pick it until forward + backward pass on sm90). On the CPU the
forward is only lowered (``jax.export`` for "cuda") and its tile walk and softmax arithmetic are
replayed in jnp by the tests; jax's GPU interpret mode cannot run it (no transposed or register
operands for wgmma), so ``interpret=True`` raises NotImplementedError. The CPU tests check the
hybrid VJP with the replay standing in for the kernel and the Triton backward interpreted.

Local windows, segment ids and logits soft cap (see "Masks" below; run 17 on the H200: all 10
forward cases vs the reference passed, D64/128/256, experiments/results/
h200_gpu_tests_mosaic_masks_run17_20261130.txt); the backward with them is the Triton one
(``_triton_bwd_masked``) where ``backward="triton"``. ``backward="mosaic"`` (``mosaic_gpu_bwd``)
takes local windows, the soft cap and segment ids (session 26) and rejects block schedules at
the call.

Block schedules (``flash_attention(schedule=...)``, what
``jattn.block_sparse_attention(implementation="mosaic_gpu")`` passes for a top-K selection): each
program walks a list of kv tiles instead of contiguous ranges (see "Block schedules" below); the
backward walks the same schedule: the Triton kernels by default, the Mosaic GPU ones with
``backward="mosaic"`` (session 27: ``mosaic_gpu_bwd`` with a schedule; what jattn's block-sparse
path runs at head_dim 64/128). GPU tests pass (runs 19-22, 116-120); timed in runs 32, 116-120.
See docs/kernels.md, "Mosaic GPU (Hopper) block-sparse forward".

``BlockSizes(q_tiles_per_program=P)`` (default 1: the kernel as before, byte-identical
lowering): each program runs P query tiles of one (batch, head) in turn, the K/V ring and its
barrier phases running on across them and the next tile's Q prefetched into a second Q/O
buffer; range path only. Its GPU tests pass on the H200 but it was not faster on a causal window
of 512 (run 49; docs/mosaic_fwd_vs_tokamax.md, "Several query tiles per program").

Structure (FlashAttention-3's forward, as in jax's ``pallas/ops/gpu/attention_mgpu.py``): one
program (CTA) per (query head, query tile of ``2 * block_q`` rows, batch) with three warpgroups:

  * warpgroups 0 and 1 (compute) each own ``block_q`` query rows. Each loads its Q tile once by
    TMA into shared memory, then for every kv tile: S = Q K^T by wgmma into an fp32 register
    accumulator, an online softmax in the base-2 domain (scale * log2(e) folded into one
    multiply), and O += P V by wgmma with P (in the input dtype) from registers. Full tiles run
    without any element mask; only the tiles that need it (the causal diagonal, the padded last
    kv tile) build one.
  * warpgroup 2 (memory) streams K and V tiles into a ring of ``num_stages`` shared-memory slots
    by TMA. Each slot has a "loaded" barrier (TMA completion) and a "free" barrier that both
    compute warpgroups arrive on once their wgmma has finished reading it.

With ``pingpong`` the two compute warpgroups rendezvous twice per kv tile on a shared barrier,
offset by one rendezvous, so that one warpgroup's softmax overlaps the other's matrix multiplies
(FA3's inter-warpgroup ping-pong). Both warpgroups therefore walk the program's whole kv range:
tiles beyond a warpgroup's own causal range are drained (wait loaded, arrive free, rendezvous)
without computing.

Masks (``masks.visible``): causal and windows align bottom-right (query i sits at kv position
kv_len - q_len + i; window (left, right): keys in [pos - left, pos + right]). Each warpgroup walks
the kv tiles [lo, hi) that its rows may see, with the element mask only on the edges [lo, flo)
and [fhi, hi) and none on [flo, fhi) (fully visible); the program's range [plo, phi) is the union
of its two warpgroups' ranges, and the memory warpgroup loads exactly those tiles, so kv tiles
outside every row's window are never loaded. Both compute warpgroups walk [plo, phi) (ping-pong),
draining the tiles before and after their own range. For causal and windows the ranges are scalar
arithmetic on the program index (``_static_ranges``). With segment ids they come from per-tile
data: ``_seg_bounds`` (jnp in the wrapper, from the min/max nonzero segment id per tile as in
``block_schedule.make_schedule``, intersected with the static ranges) gives each (batch, program)
its ranges as int32 scalars that the kernel reads from GMEM; a query tile inside one document
therefore never walks another document's tiles (packed documents cost what separate rows cost),
and tiles between two documents that a tile's rows straddle are walked masked. The segment ids of
the Q tile and of each K tile travel by TMA with them (same barriers). The soft cap is
cap * tanh(scale * s / cap) on every tile before the mask, in the natural domain, then the
base-2 softmax multiplies by log2(e) (``_cap_logits``, ``_softmax_factor``). A query row that sees no key (causal with
q_len > kv_len) returns output 0 and log-sum-exp -inf. Query rows are padded to a multiple of
``2 * block_q`` and keys to a multiple of ``block_k`` in the wrapper (a copy, only when the
lengths are not multiples); padded keys are masked in the last kv tile.

Block schedules (``st.has_sched``): ``_schedule_walk`` (jnp, in the wrapper) turns a
``BlockSchedule`` whose tiles are powers of two and multiples of the kernel's (``block_q`` rows,
``block_k`` keys) into one row per (batch, kv head, program): a count and the program's kv tiles
in increasing order, the union of its two warpgroups' lists (one schedule row when
``2 * block_q`` divides the schedule's block_q, two merged rows when it equals ``block_q``;
wider schedule key tiles are split into kernel tiles), each entry packing the tile and a 2-bit
code per warpgroup: skip, full (no element mask) or partial, recomputed at the warpgroup's 64
rows from this call's mask (``_walk_codes``: static ranges and per-tile nonzero segment min/max, the
classes of ``make_schedule``). The memory warpgroup loads entry j into ring slot j mod S; each
compute warpgroup walks all entries in order (ping-pong keeps its two meetings per entry) and
branches on its code (``lax.cond``: drain the slot, unmasked step or masked step). Tiles outside
the schedule are never loaded; a tile only one warpgroup needs is drained by the other.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import typing

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from pallas_kernels import compat
from pallas_kernels.block_schedule import compact_true


LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# Initial running max: finite, so that a row with nothing visible yet gives exp2(m - m) = 1
# instead of exp2(-inf + inf) = NaN; any real base-2 logit is far above it.
_M_INIT = -1e30
_COMPUTE_WGS = 2


# ----------------------------------------------------------------------------------------------
# Block sizes
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles and pipeline depth of the Mosaic GPU forward.

  Attributes:
    block_q: query rows per compute warpgroup (a multiple of 64, wgmma's M); a program covers
      ``2 * block_q`` rows with its two compute warpgroups.
    block_k: keys per kv tile (a multiple of 64).
    num_stages: K/V shared-memory slots in the TMA ring (>= 2).
    pingpong: rendezvous of the two compute warpgroups so that softmax and wgmma alternate.
    compute_registers: registers per thread requested for the compute warpgroups (the memory
      warpgroup gives its registers back, keeping ``memory_registers``).
    memory_registers: ``setmaxnreg`` of the memory warpgroup (default 40). Both are multiples
      of 8 in [24, 256] with 2 * compute_registers + memory_registers <= 504 (the CTA's launch
      allocation: 168 per thread x 3 warpgroups); 240 / 24 is FlashAttention-3's split.
    softmax_fence: an optimization barrier on (acc, m, l, p) at the end of each tile's softmax,
      before the warpgroup releases the tensor cores to the other one, so that no softmax work
      (e.g. the row sum) is scheduled into the other warpgroup's wgmma window. JAX's own Pallas
      Hopper attention does this at head_dim <= 128 and notes that the ordering changes its
      speed markedly. The dataclass default is off; the H200 table turns it on at D128 except
      for packed documents (runs 37-38, sweep timer; not yet confirmed by the bench, see
      docs/kernels.md). Results are identical either way.
    early_k_load: the memory warpgroup refills a ring slot's K as soon as both compute
      warpgroups have released that K (after their Q K^T wgmma), then waits for the V release
      and refills V, as tokamax's sm90 kernel orders its loads; off (default) it waits for both
      releases (the K release and, after P V, the V release) before issuing either copy, so the
      next K of a slot starts one P V later. Not yet timed on a GPU (docs/mosaic_fwd_vs_tokamax.md).
    pingpong_handoff: with ``pingpong``, hand the tensor cores over instead of meeting: each
      compute warpgroup has its own barrier; after issuing its Q K^T a warpgroup arrives on the
      other's barrier, and before its P V it waits on its own (one wait per kv tile, as tokamax's
      sm90 kernel and FlashAttention-3 do with named barriers). Off (default): one shared
      barrier that both warpgroups arrive on and wait for twice per kv tile (after Q K^T and
      before P V), which also holds a warpgroup's softmax until the other's softmax is done. Not
      yet timed on a GPU (docs/mosaic_fwd_vs_tokamax.md).
    no_reduction_scratch: compile with ``reduction_scratch_bytes=0`` (tokamax's sm90 setting)
      instead of Pallas's default 2 KiB of shared memory reserved for cross-warp reductions: the
      kernel's row max and row sum stay inside a warp, so nothing uses it. This frees room for
      ``num_stages=3`` at D128 with 128-key tiles (~224.6 KiB: 120 bytes over the 227 KiB limit
      with the reserve; tokamax's H100 table picks 3 stages for some D128 shapes). Not yet timed
      on a GPU (docs/mosaic_fwd_vs_tokamax.md).
    k_wait_in_pv: each compute warpgroup waits for the next ring entry's K while its P V wgmma
      runs (after issuing it, before waiting for it), as tokamax's sm90 kernel and JAX's Pallas
      Hopper attention do, instead of at the start of the next step; drains wait for it after
      their meetings. Off (default): the wait opens each step, after the P V has finished. Not
      yet timed on a GPU (docs/mosaic_fwd_vs_tokamax.md).
    q_major_grid: launch the programs with the query tiles fastest (CUDA's x), then heads, then
      batch, so that the programs resident at one time are consecutive query tiles of one head
      and read the same K/V tiles (tokamax's persistent loop walks (batch, heads, q tiles) with
      q tiles innermost); off (default) the heads are fastest, so ~132 resident programs span
      all heads. Not yet timed on a GPU (docs/mosaic_fwd_vs_tokamax.md).
    backward: which kernels compute the gradients: "triton" (default: the Triton dK/dV and dQ
      kernels; GPU tests pass behind this forward, runs 17-22) or "mosaic" (``mosaic_gpu_bwd``,
      the Hopper backward: head_dim 64/128, dense / causal (GPU tests pass, runs 19-22), local
      windows, soft cap and segment ids (session 26), block schedules (session 27, runs
      116-120)).
    q_tiles_per_program: P >= 1 query tiles (``rows_per_program`` rows each) of one (batch,
      head) per program, one after the other: the K/V ring runs on across them (the memory
      warpgroup loads the next tile's first kv tiles while the compute warpgroups finish the
      current one) and the next tile's Q is loaded into a second Q/O buffer during the current
      one, so the per-program fixed costs (ring fill, Q load, epilogue) overlap work. The grid
      has ceil(query tiles / P) programs per (batch, head). 1 (default): one tile per program,
      the kernel as before (byte-identical lowering). P > 1 takes the range path only (no
      segment ids or block schedule: ValueError at the call) and neither ``k_wait_in_pv`` nor
      ``pingpong_handoff`` without ``overlap_softmax`` (ValueError here); D256 does not fit the
      second Q/O buffer. GPU tests pass (run 49); not faster on a causal window of 512 (P = 2:
      0.428 ms vs 0.429; 4 and 8 slower; docs/mosaic_fwd_vs_tokamax.md). With
      ``overlap_softmax`` (session 22, lowered and protocol-simulated on the CPU only, not yet
      run on a GPU) the hand-over turns run on across the program's tiles (``_turn_skips``).

    overlap_softmax: FlashAttention-3's intra-warpgroup overlap: each compute warpgroup issues
      the Q K^T wgmma of kv tile t and the P V wgmma of tile t - 1 back to back, waits only for
      Q K^T (``wgmma_accumulator_load(wait_n=1)``), and runs tile t's softmax while P V(t - 1)
      is still on the tensor cores; the O accumulator is rescaled after that P V completes.
      Each warpgroup keeps two accumulators (O and S) and two P tiles live. With ``pingpong``
      it needs ``pingpong_handoff`` (one turn per kv tile: wait own barrier, issue both wgmmas,
      arrive on the other's). The range path and, lowered on the CPU but not yet run on a GPU,
      segment ids and block schedules (the walk carries a pending P V across skipped entries);
      not with ``k_wait_in_pv`` or ``softmax_fence``. With ``q_tiles_per_program`` > 1 since
      session 22 (CPU only so far, see there).
      Off (dataclass default): Q K^T and P V of a tile are each waited for before the next is
      issued. GPU tests pass (``GPU_CASES`` "*overlap*", runs 53 and 55); with
      ``early_k_load`` it is the H200 table's dense and causal entry at D128 and D256 (runs
      55-57: D128 7.04-7.17 ms vs 7.31-7.41, causal 3.52-3.57 vs 3.68-3.71; slower at D64 and
      no faster on a causal window of 512; docs/mosaic_fwd_vs_tokamax.md).
    one_segment_static_mask: with segment ids (range path), a compute warpgroup whose walk
      holds one and the same nonzero id on both sides (``_seg_bounds``' one-segment flag; every
      warpgroup of aligned packed documents) masks its edge tiles with the static mask only
      (causal, window, padded keys), without the per-element segment compare; the others keep
      it. The same result. Written in session 20 after run 70 (packed documents 0.558 ms against
      0.499 for the same tiles without segment ids, the masked-tile code 1.7x longer). Run 71:
      four 4K documents per 16K row 1.059 ms against 1.091 without (B2 H16 D128), the
      segment-id GPU tests pass; on in the H200 ``causal_segments`` entry, off by default.
    tail_kv_splits: C > 0 (default 0, off): the last wave. The kernel runs one program per SM,
      so B * Hq * programs is rarely a multiple of the SM count, and the last, partial wave
      costs about half a wave (run 69: B2 S16K H16 D128 non-causal, 4096 programs = 31.03
      waves of 132: 224.7 us per (batch, head) against 217.7 when the waves are full). With C,
      the kernel skips the last query program of the last batch row for every head (the last
      Hq programs it launches), and a second launch of the same kernel computes those rows
      over C chunks of the keys, ``Hq * C`` short programs, merged by log-sum-exp in XLA and
      written in place by a small Triton kernel (``_place_rows``; run 72's ``.at[].set`` did
      not compile on the H200).
      Use it when (B * Hq * programs) mod SMs <= Hq (``fit_tail_kv_splits``, which jattn's
      table defaults go through). Dense masks only (no causal, window, segment ids or block
      schedule), keys a multiple of C * block_k, and ``q_tiles_per_program`` 1; other calls
      raise. Runs 74 / 76 (C = 8, B2 S16K H16): D128 6.950 / 6.942 ms against 6.993 / 7.040
      without, D256 13.07 / 13.04 against 13.25 / 13.33; on in the H200 dense D128/D256
      entries.
    all_bounds_mask: masked tiles apply every static bound (padded keys, the causal / right
      bound and the left bound), as before session 22. Off (default): a tile of a warpgroup's
      left edge [lo, flo) applies only the left bound (and the right one only where the window
      is narrower than ``block_q + block_k``), a tile of its right edge [fhi, hi) never the
      left bound (every tile from flo on lies right of every real row's left bound), and the
      padded-key compare only when ``kv_len`` is not a multiple of ``block_k``. The same
      result; for A/B timing only. Without segment ids or a block schedule (those keep every
      bound); the first tile of ``overlap_softmax`` keeps every bound.
    store_wait_read_only: at the end of a program wait only until the O and LSE TMA stores have
      read shared memory (``cp.async.bulk.wait_group.read``, as CUTLASS's ``tma_store_wait``)
      instead of until they have completed in global memory, so that the next program on the SM
      starts sooner. Off (default): the full wait. No measurable effect on the H200 (run 53:
      causal window 512 0.4288 vs 0.4281 ms, D128 7.339 vs 7.326).

  Example:
    >>> BlockSizes(64, 128, 2).rows_per_program
    128
  """
  block_q: int = 64
  block_k: int = 128
  num_stages: int = 2
  pingpong: bool = True
  compute_registers: int = 232
  backward: str = "triton"
  softmax_fence: bool = False
  early_k_load: bool = False
  q_major_grid: bool = False
  pingpong_handoff: bool = False
  no_reduction_scratch: bool = False
  k_wait_in_pv: bool = False
  q_tiles_per_program: int = 1
  overlap_softmax: bool = False
  store_wait_read_only: bool = False
  one_segment_static_mask: bool = False
  tail_kv_splits: int = 0
  all_bounds_mask: bool = False
  memory_registers: int = 40

  def __post_init__(self):
    if self.overlap_softmax:
      bad = [name for name, on in (("k_wait_in_pv", self.k_wait_in_pv),
                                   ("softmax_fence", self.softmax_fence),
                                   ("pingpong without pingpong_handoff",
                                    self.pingpong and not self.pingpong_handoff)) if on]
      if bad:
        raise ValueError("overlap_softmax does not support " + ", ".join(bad))
    p = self.q_tiles_per_program
    if isinstance(p, bool) or not isinstance(p, (int, np.integer)) or p < 1:
      raise ValueError(f"q_tiles_per_program must be an int >= 1, got {p!r}")
    if p > 1 and (self.k_wait_in_pv or (self.pingpong_handoff and not self.overlap_softmax)):
      raise ValueError(f"q_tiles_per_program={p} (> 1) does not support k_wait_in_pv or "
                       f"pingpong_handoff without overlap_softmax (their barrier protocols are "
                       f"not carried across a program's query tiles; the overlap's is, "
                       f"``_turn_skips``); got k_wait_in_pv={self.k_wait_in_pv}, "
                       f"pingpong_handoff={self.pingpong_handoff}")
    if self.pingpong_handoff and not self.pingpong:
      raise ValueError("pingpong_handoff needs pingpong=True")
    if self.backward not in ("triton", "mosaic"):
      raise ValueError(f"backward must be 'triton' or 'mosaic', got {self.backward!r}")
    if self.block_q % 64 or self.block_q <= 0:
      raise ValueError(f"block_q must be a positive multiple of 64, got {self.block_q}")
    if self.block_k % 64 or self.block_k <= 0:
      raise ValueError(f"block_k must be a positive multiple of 64, got {self.block_k}")
    if self.num_stages < 2:
      raise ValueError(f"num_stages must be >= 2, got {self.num_stages}")
    check_register_split(self.compute_registers, self.memory_registers)
    c = self.tail_kv_splits
    if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 0:
      raise ValueError(f"tail_kv_splits must be an int >= 0, got {c!r}")
    if c and self.q_tiles_per_program != 1:
      raise ValueError("tail_kv_splits needs q_tiles_per_program=1")

  @property
  def rows_per_program(self) -> int:
    return _COMPUTE_WGS * self.block_q

  def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
    """Shared memory of one program's buffers: Q/O tiles, the K/V ring, the LSE staging rows,
    the Q/O tiles and LSE rows twice with ``q_tiles_per_program`` > 1 (the lowering adds
    barriers and alignment, and rejects a kernel over 227 KiB)."""
    bufs = 2 if self.q_tiles_per_program > 1 else 1
    qo = bufs * _COMPUTE_WGS * self.block_q * head_dim * itemsize
    kv = 2 * self.num_stages * self.block_k * head_dim * itemsize
    return qo + kv + bufs * _COMPUTE_WGS * self.block_q * 4


# Default tiles: data in ``pallas_kernels/tuning`` (kernel "mosaic_gpu_fwd", one JSON table per
# device; see docs/kernels.md, "Tuning data"). D128: the tiles of run 10 (~160 KiB of shared
# memory) with the softmax fence (runs 37-38), per mask kind; D64 (~112 KiB) and D256
# (~192 KiB): swept in run 33 without a better config.
_HEAD_DIMS = (64, 128, 256)


def check_register_split(compute_registers: int, memory_registers: int) -> None:
  """Checks a kernel's ``setmaxnreg`` values for two compute warpgroups and one memory
  warpgroup (the forward's and the fused backward's layout).

  Args:
    compute_registers: registers per thread of each compute warpgroup.
    memory_registers: registers per thread of the memory warpgroup.

  Returns:
    None; raises ValueError unless both are multiples of 8 in [24, 256] and
    2 * compute_registers + memory_registers <= 504 (the CTA's launch allocation: 168
    registers per thread x 3 warpgroups).

  Example:
    >>> check_register_split(240, 24)
  """
  for name, r in (("compute_registers", compute_registers),
                  ("memory_registers", memory_registers)):
    if r % 8 or not 24 <= r <= 256:
      raise ValueError(f"{name} must be a multiple of 8 in [24, 256], got {r}")
  if _COMPUTE_WGS * compute_registers + memory_registers > 504:
    raise ValueError(f"2 * compute_registers + memory_registers must be <= 504, got "
                     f"{compute_registers} and {memory_registers}")


@functools.lru_cache(maxsize=None)
def _tuned_block_sizes(head_dim: int, device_kind: str | None, mask: str = "all") -> BlockSizes:
  from pallas_kernels import tuning
  return BlockSizes(**tuning.required_params("mosaic_gpu_fwd", head_dim, "16bit", device_kind,
                                             mask))


def default_block_sizes(head_dim: int, dtype=jnp.bfloat16,
                        device_kind: str | None = None, mask: str = "all") -> BlockSizes:
  """Default ``BlockSizes`` for a head dimension (64, 128 or 256; bf16 or fp16) and mask kind.

  Read from the tuning table of the device (``pallas_kernels.tuning``): the entry for ``mask``
  if the table has one, else the entry for every mask. The H200's entries (session 21; each
  with its runs in the table's provenance, summary in docs/kernels.md "Tuning data"): the
  intra-warpgroup overlap for D128/D256 dense and causal, with ``tail_kv_splits=8`` on dense
  (applied per call through ``fit_tail_kv_splits``); 256-key tiles for D64 dense and causal;
  the overlap for a D128 causal window (128-key tiles since session 22's edge masks, runs
  81-82; 64 before); the overlap and ``one_segment_static_mask`` for packed documents
  ("causal_segments").

  Args:
    head_dim: the head dimension of q, k and v.
    dtype: the input dtype (only checked: bf16 and fp16 have the same tiles).
    device_kind: jax ``device_kind`` whose table to read (default: the first device's).
    mask: "all", "dense", "causal", "window", "causal_window" or "causal_segments"
      (``tuning.mask_kind``).

  Returns:
    A ``BlockSizes``.

  Example:
    >>> default_block_sizes(128).block_k
    128
    >>> default_block_sizes(128, device_kind="NVIDIA H200", mask="causal_window").overlap_softmax
    True
  """
  _check_dtype(dtype)
  if head_dim not in _HEAD_DIMS:
    raise NotImplementedError(f"the Mosaic GPU forward supports head_dim 64, 128 or 256, got "
                              f"{head_dim}")
  from pallas_kernels import tuning
  return _tuned_block_sizes(head_dim, tuning.resolve_kind(device_kind), mask)   # cached by kind


def _check_dtype(dtype):
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise NotImplementedError(f"the Mosaic GPU forward supports bfloat16 and float16 inputs, got "
                              f"{jnp.dtype(dtype)}")


# ----------------------------------------------------------------------------------------------
# Static configuration
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Static:
  block_q: int         # rows per compute warpgroup
  block_k: int
  num_stages: int
  pingpong: bool
  compute_registers: int
  memory_registers: int
  q_len: int           # unpadded
  kv_len: int          # unpadded
  num_q_programs: int  # padded q_len // (2 * block_q)
  num_kv_tiles: int    # padded kv_len // block_k
  head_dim: int
  group: int           # query heads per kv head
  causal: bool
  scale: float
  dtype: jnp.dtype
  window: tuple | None = None   # (left, right) from masks.normalize_window; a side None = unbounded
  soft_cap: float | None = None
  has_seg: bool = False         # segment ids: per-(batch, q tile) kv ranges from ``_seg_bounds``
  interpret: bool = False    # the backward's Triton kernels in interpret mode (the forward raises)
  bwd_block_sizes: object = None   # the backward's BlockSizes (triton or mosaic_gpu_bwd) or None
  backward: str = "triton"         # "triton" or "mosaic" (the kernels of the custom_vjp backward)
  softmax_fence: bool = False      # BlockSizes.softmax_fence
  early_k_load: bool = False       # BlockSizes.early_k_load
  q_major_grid: bool = False       # BlockSizes.q_major_grid
  pingpong_handoff: bool = False   # BlockSizes.pingpong_handoff (only with pingpong)
  no_reduction_scratch: bool = False   # BlockSizes.no_reduction_scratch
  k_wait_in_pv: bool = False       # BlockSizes.k_wait_in_pv
  q_tiles_per_program: int = 1     # BlockSizes.q_tiles_per_program (> 1: range path only)
  overlap_softmax: bool = False    # BlockSizes.overlap_softmax
  store_wait_read_only: bool = False   # BlockSizes.store_wait_read_only
  one_seg_mask: bool = False           # BlockSizes.one_segment_static_mask
  edge_masks: bool = True              # not BlockSizes.all_bounds_mask (see ``_edge_bounds``)
  tail_batch: int = -1     # tail_kv_splits: this batch row's last program is skipped (-1: none)
  tail_kv_splits: int = 0  # BlockSizes.tail_kv_splits (0: off)
  # Block schedule (``flash_attention(schedule=...)``): each program walks its row of the packed
  # list from ``_schedule_walk`` (read from GMEM) instead of the ranges of ``_program_ranges``.
  has_sched: bool = False
  sched_batch: bool = False     # the walk has a batch axis (else one row shared by all batches)
  sched_heads: bool = False     # the walk has a kv-head axis (else shared by all heads)

  @property
  def offset(self) -> int:
    """kv position of query row 0 (bottom-right causal alignment)."""
    return self.kv_len - self.q_len

  @property
  def num_full_tiles(self) -> int:
    """kv tiles without padded keys."""
    return self.kv_len // self.block_k

  @property
  def num_programs(self) -> int:
    """Programs per (batch, head): query tiles / ``q_tiles_per_program``, rounded up."""
    return -(-self.num_q_programs // self.q_tiles_per_program)


def _bounds_left(st: _Static):
  """Left window bound (keys >= qpos - left), or None (unbounded)."""
  return None if st.window is None else st.window[0]


def _bounds_right(st: _Static):
  """Effective right bound (keys <= qpos + right): 0 when causal, the window's right side
  otherwise, or None (unbounded)."""
  if st.causal:
    return 0
  return None if st.window is None else st.window[1]


def _static_ranges(row0, n, st: _Static):
  """kv tile ranges of the query rows [row0, row0 + n) (only rows < q_len count) under the
  static mask (causal, window, padded keys): (lo, flo, fhi, hi), int32 (scalars or arrays,
  elementwise in ``row0``), with

    * tiles < lo and >= hi invisible to every real row (never loaded for them),
    * tiles in [flo, fhi) visible in full to every real row (no element mask),
    * tiles in [lo, flo) and [fhi, hi) the edges (element mask),

  and lo <= flo <= fhi <= hi. hi == lo when no real row sees a key tile (all rows padding,
  causal rows before the first key, a window past the keys)."""
  bk, nk = st.block_k, st.num_kv_tiles
  row0 = jnp.asarray(row0, jnp.int32)
  last = jnp.minimum(row0 + n, st.q_len) - 1          # last real row
  q_first = row0 + st.offset                           # kv position of the first row
  q_last = last + st.offset
  left, right = _bounds_left(st), _bounds_right(st)
  zero = jnp.int32(0)
  if left is None:
    lo = jnp.zeros_like(row0)
    flo = lo
  else:
    lo = lax.div(jnp.maximum(zero, q_first - left), jnp.int32(bk))
    flo = lax.div(jnp.maximum(zero, q_last - left) + (bk - 1), jnp.int32(bk))
  lo = jnp.minimum(lo, nk)
  if right is None:
    hi = jnp.full_like(row0, nk)
    fhi = jnp.full_like(row0, st.num_full_tiles)
  else:
    hi = jnp.minimum(lax.div(jnp.maximum(zero, q_last + right + bk), jnp.int32(bk)), nk)
    fhi = jnp.minimum(lax.div(jnp.maximum(zero, q_first + right + 1), jnp.int32(bk)),
                      st.num_full_tiles)
  hi = jnp.where(last < row0, lo, jnp.maximum(hi, lo))
  flo = jnp.clip(flo, lo, hi)
  fhi = jnp.clip(fhi, flo, hi)
  return lo, flo, fhi, hi


def _clip_to_program(plo, phi, lo, flo, fhi, hi):
  """A warpgroup's ranges clipped into its program's [plo, phi) (both warpgroups walk the
  program's range; an empty range becomes an empty range inside it)."""
  lo = jnp.clip(lo, plo, phi)
  hi = jnp.clip(hi, lo, phi)
  flo = jnp.clip(flo, lo, hi)
  fhi = jnp.clip(fhi, flo, hi)
  return lo, flo, fhi, hi


def _seg_bounds(q_seg, kv_seg, st: _Static):
  """Per-(batch, program) kv ranges with segment ids, from the tile classes that
  ``block_schedule.make_schedule`` uses (min/max nonzero segment id per tile, padding id 0 left
  out: ``block_schedule._segment_tile_pairs``; no order of the ids assumed) intersected with the
  static mask: int32 [B, num_q_programs, 2 + 4 * 2] rows
  ``[plo, phi, lo0, flo0, fhi0, hi0, lo1, flo1, fhi1, hi1]`` (program range, then each compute
  warpgroup's (lo, flo, fhi, hi) as in ``_static_ranges``, clipped into the program's); with
  ``BlockSizes.one_segment_static_mask`` two more columns ``one0, one1`` (from
  ``_SEG_BOUNDS_ONE``): each warpgroup's one-segment flag, 1 when every tile of its [lo, hi)
  holds one and the same nonzero id on the query and the key side, so its masked tiles need only
  the static mask.

  A warpgroup walks [lo, hi) = first to last kv tile that any of its rows may see (tiles in
  between that no row sees, across a document gap, are walked masked), without the mask on the
  first run of fully visible tiles [flo, fhi) (one segment on both sides, inside the static
  full range).

  q_seg: int32 [B, Sq'] and kv_seg [B, Sk'] padded with 0 to whole tiles."""
  from pallas_kernels.block_schedule import _segment_tile_classes, _segment_tile_pairs  # no kernel
  bq, bk, nk = st.block_q, st.block_k, st.num_kv_tiles
  n_tiles = st.num_q_programs * _COMPUTE_WGS
  qc = _segment_tile_classes(q_seg, q_seg.shape[1], bq)               # 3 x [B, n_tiles]
  kc = _segment_tile_classes(kv_seg, kv_seg.shape[1], bk)             # 3 x [B, nk]
  seg_any, seg_all = _segment_tile_pairs([x[:, :, None] for x in qc],
                                         [x[:, None, :] for x in kc])   # [B, n_tiles, nk]
  lo_s, flo_s, fhi_s, hi_s = _static_ranges(jnp.arange(n_tiles, dtype=jnp.int32) * bq, bq, st)
  t = jnp.arange(nk, dtype=jnp.int32)[None, :]
  in_static = (t >= lo_s[:, None]) & (t < hi_s[:, None])                 # [n_tiles, nk]
  full_static = (t >= flo_s[:, None]) & (t < fhi_s[:, None])
  visit = seg_any & in_static[None]
  full = seg_all & full_static[None] & visit
  any_visit = visit.any(-1)                                              # [B, n_tiles]
  lo = jnp.where(any_visit, jnp.argmax(visit, -1), nk).astype(jnp.int32)
  hi = jnp.where(any_visit, nk - jnp.argmax(visit[..., ::-1], -1), 0).astype(jnp.int32)
  any_full = full.any(-1)
  flo = jnp.where(any_full, jnp.argmax(full, -1), hi).astype(jnp.int32)
  after = (~full) & (t[None] >= flo[..., None])
  fhi = jnp.where(after.any(-1), jnp.argmax(after, -1), nk).astype(jnp.int32)
  fhi = jnp.where(any_full, jnp.minimum(fhi, hi), flo)
  b = q_seg.shape[0]
  shape = (b, st.num_q_programs, _COMPUTE_WGS)
  lo, flo, fhi, hi = (x.reshape(shape) for x in (lo, flo, fhi, hi))
  plo = lo.min(-1)                                   # empty warpgroups have lo = nk, hi = 0
  phi = jnp.maximum(hi.max(-1), plo)
  lo, flo, fhi, hi = _clip_to_program(plo[..., None], phi[..., None], lo, flo, fhi, hi)
  # one segment: every tile the warpgroup computes (its [lo, hi), masked edges included) holds
  # one and the same nonzero id on both sides (``seg_all``), so the static mask alone is exact
  wg = jnp.stack([lo, flo, fhi, hi], -1).reshape(b, st.num_q_programs, 4 * _COMPUTE_WGS)
  cols = [plo[..., None], phi[..., None], wg]
  if st.one_seg_mask:   # (without the option the rows keep their 10 columns: the same kernels)
    walked = ((t[None] >= lo.reshape(b, n_tiles, 1)) & (t[None] < hi.reshape(b, n_tiles, 1)))
    cols.append(jnp.all(seg_all | ~walked, -1).reshape(shape).astype(jnp.int32))
  return jnp.concatenate(cols, -1).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------
# Block schedules: the per-program walk
# ----------------------------------------------------------------------------------------------

# An entry of a walk row packs a kv tile and what each compute warpgroup does with it:
# ``tile << _WALK_SHIFT | code(warpgroup 0) | code(warpgroup 1) << 2``, each code one of
# _SKIP (drain the ring slot: none of the warpgroup's real rows sees a key of the tile),
# _FULL (every real row sees every key: no element mask) or _PARTIAL (element mask).
_WALK_SHIFT = 4
_SKIP, _FULL, _PARTIAL = 0, 1, 2


class _Mask(typing.NamedTuple):
  """How the kernel masks a tile: ``seg``, with the per-element segment compare (else the static
  mask only); ``edge``, the warpgroup's masked range the tile is in ("left", "right" or None,
  see ``_edge_bounds``)."""
  seg: bool
  edge: str | None


def _walk_codes(tiles, valid, st: _Static, q_seg=None, kv_seg=None):
  """Per-warpgroup class of kernel kv tiles.

  Args:
    tiles: int32 [Bs, Hs, n_wg, L] kernel kv tiles (``block_k`` keys) listed for warpgroup tile
      i (query rows [i * block_q, (i + 1) * block_q)), n_wg = 2 * num_q_programs.
    valid: bool, same shape: the entries that are listed (the others get _SKIP).
    st: the kernel's static configuration (causal, window, lengths, tiles).
    q_seg, kv_seg: None or int32 [B, Sq'] / [B, Sk'] padded with 0 to whole programs / tiles.

  Returns:
    int32 [B', Hs, n_wg, L] codes (B' = B with segment ids, else Bs), the classes
    ``block_schedule.make_schedule`` gives at the warpgroup's 64-row granularity: _SKIP where no
    real row of the warpgroup may see a key of the tile (static mask: causal, window, padded keys,
    from ``_static_ranges``; segment ids: per-tile min/max nonzero ids), _FULL where every real
    row sees every key, _PARTIAL otherwise.
  """
  n_wg = tiles.shape[2]
  ranges = _static_ranges(jnp.arange(n_wg, dtype=jnp.int32) * st.block_q, st.block_q, st)
  return _range_codes(tiles, valid, ranges, q_seg, st.block_q, kv_seg, st.block_k)


def _range_codes(tiles, valid, ranges, own_seg, own_block, walk_seg, walk_block):
  """Codes (_SKIP, _FULL, _PARTIAL) of listed walk tiles from each own tile's static ranges.

  Args:
    tiles: int32 [Bs, Hs, n_own, L] walk tiles listed for each own tile.
    valid: bool, same shape: the entries that are listed (the others get _SKIP).
    ranges: (lo, flo, fhi, hi) int32 [n_own]: own tile i may see walk tiles [lo, hi) and sees
      [flo, fhi) in full under the static mask.
    own_seg, walk_seg: None, or int32 segment ids [B, S'] along the own / walked axis, padded
      with 0 to whole tiles.
    own_block, walk_block: the own / walk tile sizes (for the segment ids' per-tile classes).

  Returns:
    int32 [B', Hs, n_own, L] codes (B' = B with segment ids, else Bs): _SKIP where the static
    mask or the tiles' segment id classes rule every pair out, _FULL where both allow every
    element, else _PARTIAL.
  """
  lo, flo, fhi, hi = (x[:, None] for x in ranges)                           # [n_own, 1]
  visible = valid & (tiles >= lo) & (tiles < hi)
  full = (tiles >= flo) & (tiles < fhi)
  if own_seg is not None:
    from pallas_kernels.block_schedule import _segment_tile_classes, _segment_tile_pairs
    n_own = tiles.shape[2]
    oc = [x[:, :n_own] for x in _segment_tile_classes(own_seg, own_seg.shape[1], own_block)]
    wc = _segment_tile_classes(walk_seg, walk_seg.shape[1], walk_block)     # 3 x [B, n_walk]
    t = jnp.broadcast_to(jnp.clip(tiles, 0, wc[0].shape[1] - 1),
                         (own_seg.shape[0],) + tiles.shape[1:])
    wc_t = [jax.vmap(lambda x, i: x[i])(x, t) for x in wc]                   # [B, Hs, n_own, L]
    seg_any, seg_all = _segment_tile_pairs([x[:, None, :, None] for x in oc], wc_t)
    visible = visible & seg_any
    full = full & seg_all
  return jnp.where(visible, jnp.where(full, _FULL, _PARTIAL), _SKIP).astype(jnp.int32)


def _schedule_walk(schedule, st: _Static, q_seg=None, kv_seg=None):
  """The kernel's walk of a block schedule: for each program, one list of kv tiles with what
  each of its two compute warpgroups does with each tile.

  The schedule (``block_schedule.BlockSchedule``, tiles ``sbq`` x ``sbk`` with ``block_q | sbq``
  and ``block_k | sbk``) lists, per query tile, the kv tiles to visit. Warpgroup tile i (64 rows)
  lies inside schedule row ``i * block_q // sbq``; each listed schedule tile becomes its
  ``sbk // block_k`` kernel tiles. A program's list is the union of its two warpgroups' lists
  (the same list when ``2 * block_q`` divides ``sbq``), in increasing tile order; each entry
  carries both warpgroups' codes (``_walk_codes``: skip, full or partial, recomputed at the
  warpgroup's granularity from the kernel's own mask, so the schedule's partial flags are not
  needed and a tile that is partial for the schedule's larger tile can run unmasked or be
  skipped by one warpgroup). Entries that neither warpgroup needs are dropped (kept, as rare
  drains, only when the lists need no compaction: ``sbq == 2 * block_q`` and ``sbk == block_k``).

  Args:
    schedule: a ``BlockSchedule`` for (q_len, kv_len), leading axes [1|B, 1|Hk].
    st: the kernel's static configuration.
    q_seg, kv_seg: None or int32 segment ids padded to whole programs / kv tiles.

  Returns:
    int32 [B', Hs, num_q_programs, 1 + W] rows ``[count, entry_0, ..., entry_{W-1}]`` (B' = B
    with segment ids or a per-batch schedule, else 1), entry = tile << _WALK_SHIFT | code0 |
    code1 << 2; entries past count are 0 and never read (``_list_walk``).
  """
  return _list_walk(schedule.kv_indices, schedule.kv_counts, schedule.block_q,
                    schedule.block_k, st.block_q, st.block_k, _COMPUTE_WGS * st.num_q_programs,
                    st.num_kv_tiles, lambda tiles, valid: _walk_codes(tiles, valid, st, q_seg,
                                                                      kv_seg))


def _list_walk(idx, cnt, s_own, s_walk, own_block, walk_block, n_own, n_walk, codes_fn):
  """Per-program walk rows of a list schedule, for a kernel whose programs own two warpgroup
  tiles of ``own_block`` along one axis and stream tiles of ``walk_block`` along the other
  (the forward: query rows / kv tiles, ``_schedule_walk``; the Mosaic GPU backward's dQ kernel
  the same, its dK/dV kernel keys / query tiles on the transposed lists).

  Args:
    idx, cnt: int32 [Bs, Hs, R, M] / [Bs, Hs, R]: per schedule tile of ``s_own`` along the own
      axis, the listed tiles of ``s_walk`` along the other and their count.
    s_own, s_walk: the schedule's tile sizes (multiples of ``own_block`` / ``walk_block``).
    own_block, walk_block: the kernel's tiles.
    n_own: the kernel's warpgroup tiles (2 per program); those past the schedule list nothing.
    n_walk: the kernel's walk tiles; listed tiles from ``n_walk`` on are dropped.
    codes_fn: ``(tiles [Bs, Hs, n_own, L], valid) -> codes [B', Hs, n_own, L]`` (_SKIP, _FULL,
      _PARTIAL per own tile).

  Returns:
    int32 [B', Hs, n_own // 2, 1 + W] rows ``[count, entry_0, ..., entry_{W-1}]``, entry =
    tile << _WALK_SHIFT | code0 | code1 << 2, in increasing tile order; entries past count are
    0 and never read.
  """
  bq, bk, sbq = own_block, walk_block, s_own
  rk = s_walk // bk
  n_wg = n_own
  nq_s = idx.shape[2]
  idx = idx.astype(jnp.int32)                                  # [Bs, Hs, nq_s, M]
  cnt = cnt.astype(jnp.int32)                                  # [Bs, Hs, nq_s]
  rows = np.arange(n_wg) * bq // sbq                           # schedule row of each wg tile
  real = jnp.asarray(rows < nq_s)                              # the others: padding, nothing
  rows = np.minimum(rows, nq_s - 1)
  j = np.arange(idx.shape[-1] * rk)
  tiles = idx[:, :, rows][..., j // rk] * rk + jnp.asarray(j % rk, jnp.int32)   # [Bs, Hs, n_wg, L]
  cnt_w = jnp.where(real, cnt[:, :, rows], 0)
  valid = (jnp.asarray(j // rk) < cnt_w[..., None]) & (tiles < n_walk)
  codes = codes_fn(tiles, valid)                               # [B', Hs, n_wg, L]
  tiles = jnp.broadcast_to(tiles, codes.shape)
  t0, t1 = tiles[:, :, 0::2], tiles[:, :, 1::2]                # [B', Hs, P, L]
  c0, c1 = codes[:, :, 0::2], codes[:, :, 1::2]
  if sbq % (_COMPUTE_WGS * bq) == 0:    # both warpgroups read the same row: one list
    t, keep = t0, (c0 | c1) != 0
    if sbq == _COMPUTE_WGS * bq and rk == 1:    # no compaction: the rows as they are
      count = jnp.broadcast_to(cnt_w[:, :, 0::2], c0.shape[:-1])
      entries = (t << _WALK_SHIFT) | c0 | (c1 << 2)
      width = t.shape[-1]
      j = jnp.arange(width, dtype=jnp.int32)
      entries = jnp.where(j < count[..., None], entries, 0)
      return jnp.concatenate([count[..., None], entries], -1).astype(jnp.int32)
  else:                                 # two rows: their union, in increasing tile order
    # Each row's codes scattered over the walk axis (a tile at most once per row), then the
    # tiles either row lists, compacted: no sort (run 121: the sorts were ~2.5 ms at 64K).
    width = min(2 * t0.shape[-1], n_walk)
    dense = [_scatter_codes(tw, cw, n_walk) for tw, cw in ((t0, c0), (t1, c1))]
    keep = (dense[0] | dense[1]) != _SKIP
    order, count = compact_true(keep, width)
    take = lambda x: jnp.take_along_axis(x, order, axis=-1)
    t, c0, c1 = order, take(dense[0]), take(dense[1])
    return _walk_rows(t, c0, c1, count)
  width = min(t.shape[-1], n_walk)
  order, count = compact_true(keep, width)
  take = lambda x: jnp.take_along_axis(x, order, axis=-1)
  return _walk_rows(take(t), take(c0), take(c1), count)


def _scatter_codes(tiles, codes, n):
  """[..., n] int32: each row's codes at its tiles (tiles with code _SKIP are left out; a tile
  at most once per row), _SKIP elsewhere. (Behind an optimization barrier, as
  ``block_schedule.compact_true``: XLA would constant-fold the scatter of a static schedule.)"""
  tiles, codes = jax.lax.optimization_barrier((tiles, codes))
  lead, m = codes.shape[:-1], codes.shape[-1]
  rows = int(np.prod(lead, dtype=np.int64))
  base = jnp.arange(rows, dtype=jnp.int32).reshape(lead + (1,)) * n
  dest = jnp.where(codes != _SKIP, base + tiles, rows * n)     # rows * n: a trash slot
  out = jnp.full((rows * n + 1,), _SKIP, jnp.int32)
  out = out.at[dest.reshape(-1)].set(codes.reshape(-1).astype(jnp.int32),
                                     mode="promise_in_bounds")
  return out[:rows * n].reshape(lead + (n,))


def _walk_rows(t, c0, c1, count):
  """Walk rows ``[count, entry_0, ...]`` from compacted tiles and codes [..., W] (entries past
  ``count`` are 0)."""
  j = jnp.arange(t.shape[-1], dtype=jnp.int32)
  count = jnp.minimum(count, t.shape[-1])
  entries = jnp.where(j < count[..., None], (t << _WALK_SHIFT) | c0 | (c1 << 2), 0)
  return jnp.concatenate([count[..., None], entries], -1).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------
# Tile arithmetic (plain jnp on values: the kernel uses these, and the CPU tests replay the
# kernel's tile walk with them)
# ----------------------------------------------------------------------------------------------


def _edge_bounds(st: _Static, edge):
  """Which static bounds a masked tile applies: (padded keys, right / causal bound, left bound),
  bools. ``edge``: None (any tile: every bound the mask has), "left" (a tile of a warpgroup's
  [lo, flo) from ``_static_ranges``) or "right" (of its [fhi, hi)).

  With ``st.edge_masks`` (default) an edge applies fewer: keys are padded only when kv_len is
  not a multiple of block_k; a tile t >= flo has t * bk >= q_last - left (``_static_ranges``),
  so it is right of every real row's left bound and a right edge never needs it; a tile
  t < flo ends at most at q_last - left + bk - 2, so a left edge needs the right bound only
  when left + right < bq + bk - 3 (a window narrower than a tile pair; taken as < bq + bk).
  Segment ids and block schedules give other ranges: they take every bound."""
  left, right = _bounds_left(st), _bounds_right(st)
  pad, r_on, l_on = True, right is not None, left is not None
  if st.edge_masks and not st.has_seg and not st.has_sched:
    pad = st.kv_len % st.block_k != 0
    if edge == "right":
      l_on = False
    elif edge == "left" and r_on and l_on and left + right >= st.block_q + st.block_k:
      r_on = False
  return pad, r_on, l_on


def _tile_visible(rows, cols, row0, t, st: _Static, q_seg=None, kv_seg=None, edge=None):
  """Element mask of kv tile ``t`` for the query rows from ``row0``: rows/cols are the [bq, bk]
  iotas of the tile. Masks padded keys, keys past each row's causal diagonal, keys outside its
  window (``pallas_kernels.masks.visible``) and, with q_seg [bq] / kv_seg [bk] (the tile's
  segment ids), keys of another segment or of segment 0. ``edge`` ("left", "right" or None):
  which of a warpgroup's masked ranges the tile is in; a bound that cannot mask any real row's
  key there is not applied (``_edge_bounds``). Returns a bool [bq, bk] or None (nothing to
  mask)."""
  pad, r_on, l_on = _edge_bounds(st, edge)
  visible = None
  both = lambda a, b: b if a is None else jnp.logical_and(a, b)
  if pad or r_on or l_on:
    k_pos = cols + t * st.block_k                             # [bq, bk]
  if pad:
    visible = k_pos < st.kv_len
  if r_on or l_on:
    q_pos = rows + (row0 + st.offset)
    if r_on:
      visible = both(visible, k_pos <= q_pos + _bounds_right(st))
    if l_on:
      visible = both(visible, k_pos >= q_pos - _bounds_left(st))
  if q_seg is not None:
    shape = rows.shape
    qs = lax.broadcast_in_dim(q_seg, shape, [0])
    ks = lax.broadcast_in_dim(kv_seg, shape, [1])
    visible = both(visible, jnp.logical_and(qs == ks, ks != 0))
  return visible


def _apply_mask(s, visible):
  """s where ``visible`` (from ``_tile_visible``), -inf elsewhere; s unchanged for None."""
  return s if visible is None else jnp.where(visible, s, -jnp.inf)


def _cap_logits(s, st: _Static):
  """Soft cap on raw logits q.k: cap * tanh(scale * s / cap) (the reference's convention,
  cap on the scaled logit); without a cap, s unchanged (the scale is folded into the softmax's
  multiply, see ``_softmax_factor``)."""
  if st.soft_cap is None:
    return s
  return jnp.tanh(s * (st.scale / st.soft_cap)) * st.soft_cap


def _softmax_factor(st: _Static) -> float:
  """Factor from ``_cap_logits``'s output to base-2 logits: scale * log2(e), or log2(e) when the
  soft cap has already applied the scale."""
  return LOG2E if st.soft_cap is not None else st.scale * LOG2E


def _online_softmax(s, m, l, st: _Static):
  """One online-softmax step in the base-2 domain.

  Args:
    s: [bq, bk] fp32 logits from ``_cap_logits`` (masked entries -inf).
    m: [bq] running max of the base-2 scaled logits (starts at _M_INIT).
    l: [bq] running sum of exp2(logit - m).

  Returns:
    (p [bq, bk] fp32 = exp2(s * c - m_new), alpha [bq] = exp2(m - m_new), m_new, l_new), with
    c = ``_softmax_factor(st)`` (scale * log2(e) without soft cap) folded into one multiply-add
    per element.
  """
  c = _softmax_factor(st)
  m_new = jnp.maximum(m, s.max(axis=1) * c)                   # [bq]
  alpha = jnp.exp2(m - m_new)                                 # [bq]
  p = jnp.exp2(s * c - lax.broadcast_in_dim(m_new, s.shape, [0]))   # [bq, bk]
  return p, alpha, m_new, l * alpha + p.sum(axis=1)


def _finalize(acc, m, l):
  """acc [bq, D], m, l [bq] -> (out [bq, D] fp32, lse [bq] fp32, natural log). Rows that saw no
  key (l == 0) give output 0 and lse -inf."""
  empty = l == 0.0
  l_safe = jnp.where(empty, 1.0, l)
  out = acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0])
  return out, jnp.where(empty, -jnp.inf, m * LN2 + jnp.log(l_safe))


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


def _program_ranges(b, tile, wg, bounds_ref, st: _Static):
  """(plo, phi) of the program and, for compute warpgroup ``wg`` (None: the memory warpgroup,
  program range only), its (lo, flo, fhi, hi) clipped into it: from ``_static_ranges`` or, with
  segment ids, read from the ``_seg_bounds`` row of (batch, program) in GMEM."""
  bq = st.block_q
  if st.has_seg:
    plo, phi = bounds_ref[b, tile, 0], bounds_ref[b, tile, 1]
    if wg is None:
      return plo, phi, None
    base = 2 + 4 * wg
    return plo, phi, tuple(bounds_ref[b, tile, base + j] for j in range(4))
  row0_program = tile * (_COMPUTE_WGS * bq)
  plo, _, _, phi = _static_ranges(row0_program, _COMPUTE_WGS * bq, st)
  if st.tail_batch >= 0:   # tail_kv_splits: the last program of that row walks nothing
    skip = jnp.logical_and(b == st.tail_batch, tile == st.num_q_programs - 1)
    phi = jnp.where(skip, plo, phi)
  if wg is None:
    return plo, phi, None
  return plo, phi, _clip_to_program(plo, phi, *_static_ranges(row0_program + wg * bq, bq, st))


_SEG_BOUNDS_ONE = 2 + 4 * _COMPUTE_WGS   # column of warpgroup 0's one-segment flag


def _one_segment(b, tile, wg, bounds_ref, st: _Static):
  """With segment ids (range path): whether compute warpgroup ``wg`` of program (b, tile) walks
  only tiles of one segment on both sides (``_seg_bounds``' flag; its masked tiles then take the
  static mask only, not the per-element segment compare). None without segment ids or without
  ``BlockSizes.one_segment_static_mask``."""
  if not st.has_seg or st.has_sched or not st.one_seg_mask:
    return None
  return bounds_ref[b, tile, _SEG_BOUNDS_ONE + wg] != 0


def _turn_skips(wg, k, n, first_tile, last_tile):
  """``overlap_softmax``'s hand-over protocol: for compute warpgroup ``wg``'s turn ``k`` of
  ``n + 1`` turns (0..n) in a query tile, (skip the wait for its turn, skip the hand-over after
  it). The turns of a program's query tiles form one sequence: warpgroup 0 skips only the
  program's first wait (it goes first) and warpgroup 1 only the program's last hand-over (no
  turn follows), so that each warpgroup alternates wait and hand-over through all its tiles
  (``q_tiles_per_program`` > 1) and a barrier never gets a second arrival before its wait.
  ``first_tile`` / ``last_tile``: whether the query tile is the program's first / last (both
  True for one tile per program). Plain jnp (the kernel uses it, the CPU tests simulate it).

  Example:
    >>> [tuple(bool(x) for x in _turn_skips(w, k, 2, True, True)) for w in (0, 1) for k in (0, 2)]
    [(True, False), (False, False), (False, False), (False, True)]
  """
  wg, k, n = (jnp.asarray(x, jnp.int32) for x in (wg, k, n))
  skip_wait = jnp.logical_and(jnp.logical_and(first_tile, k == 0), wg == 0)
  skip_hand = jnp.logical_and(jnp.logical_and(last_tile, k == n), wg == 1)
  return skip_wait, skip_hand


def _program_tiles(g, st: _Static):
  """q_tiles_per_program = P > 1: the query tiles of program ``g`` (``rows_per_program`` rows
  each), as (count, i -> the i-th tile), int32: tiles j = g * P + i for i < count =
  min(P, tiles - g * P) (the last program may have fewer), in that order; with causal j counts
  from the last tile (the longest kv ranges first, as the one-tile programs' reversed order)."""
  n_q = st.num_q_programs
  first = jnp.asarray(g, jnp.int32) * st.q_tiles_per_program
  count = jnp.minimum(jnp.int32(st.q_tiles_per_program), n_q - first)
  if st.causal:
    return count, lambda i: (n_q - 1) - (first + i)
  return count, lambda i: first + i


def _fwd_kernel(*refs, st: _Static):
  """Refs: q [B, Sq, Hq, D], k/v [B, Sk, Hk, D] (GMEM), with segment ids also q_seg [B, Sq],
  kv_seg [B, Sk] int32 and bounds [B, programs, 10 or 12] (``_seg_bounds``) -> o [B, Sq, Hq, D],
  lse [B, Hq, Sq] (GMEM, natural log). Scratch: smem = (qo [2, bq, D], k [S, bk, D],
  v [S, bk, D], lse [2, bq], with segment ids q_seg [2, bq], kv_seg [S, bk]), barriers
  q_loaded [2], k/v_loaded [S] (with segment ids q_loaded and k_loaded also count the segment
  copies), k/v_free [S] (2 arrivals), rendezvous (2 arrivals). With a block schedule
  (``st.has_sched``) the last input is the walk [B', Hs, programs, 1 + W] of ``_schedule_walk``
  instead of the bounds (segment ids or not). With ``q_tiles_per_program`` > 1 (range path
  only) qo, lse and q_loaded have 4 entries (two sets, 2 * set + warpgroup) and each program
  runs its query tiles (``_program_tiles``) one after the other, the ring running on."""
  n_in = 3 + (2 if st.has_seg else 0) + (1 if st.has_seg or st.has_sched else 0)
  ins = refs[:n_in]
  o_ref, lse_ref, smem, q_loaded, k_loaded, v_loaded, k_free, v_free, rendezvous = refs[n_in:]
  q_ref, k_ref, v_ref = ins[:3]
  q_seg_ref = kv_seg_ref = bounds_ref = walk_ref = q_seg_smem = kv_seg_smem = None
  if st.has_seg:
    q_seg_ref, kv_seg_ref = ins[3:5]
    qo_smem, k_smem, v_smem, lse_smem, q_seg_smem, kv_seg_smem = smem
  else:
    qo_smem, k_smem, v_smem, lse_smem = smem
  if st.has_sched:
    walk_ref = ins[-1]
  elif st.has_seg:
    bounds_ref = ins[-1]
  bq, bk, stages = st.block_q, st.block_k, st.num_stages
  multi = st.q_tiles_per_program > 1   # several query tiles per program (range path only)
  b = lax.axis_index("batch")
  h = lax.axis_index("heads")
  tile = lax.axis_index("q_tiles")
  if multi:
    n_sub, tile_of = _program_tiles(tile, st)
  elif st.causal:
    tile = (st.num_q_programs - 1) - tile   # longest kv ranges first: a shorter tail
  wg = lax.axis_index("wg")
  kv_h = lax.div(h, jnp.int32(st.group))
  if not multi:
    row0_program = tile * (_COMPUTE_WGS * bq)
  slot_of = lambda t: lax.rem(t, jnp.int32(stages))
  if st.has_sched:   # this program's row of the walk: [count, entries...] (``_schedule_walk``)
    walk_b = b if st.sched_batch else 0
    walk_h = kv_h if st.sched_heads else 0
    walk_count = lambda: walk_ref[walk_b, walk_h, tile, 0]
    walk_entry = lambda j: walk_ref[walk_b, walk_h, tile, 1 + j]

  def meet():
    if st.pingpong:
      plgpu.barrier_arrive(rendezvous)
      plgpu.barrier_wait(rendezvous)

  # pingpong_handoff: rendezvous is one barrier per compute warpgroup (1 arrival each)
  handoff = st.pingpong and st.pingpong_handoff
  hand_over = lambda: plgpu.barrier_arrive(rendezvous.at[1 - wg])   # the other may run P V
  take_turn = lambda: plgpu.barrier_wait(rendezvous.at[wg])         # the other issued Q K^T

  def _compute_tiles():
    # q_tiles_per_program > 1: the program's query tiles one after the other. Q/O buffer and
    # LSE row set u = i mod 2 (index 2 * u + wg, barrier q_loaded[2 * u + wg]) for tile i; the
    # ring position runs on across tiles (``ring_base``: entries of the earlier tiles), as the
    # memory warpgroup's. Each tile keeps the single-tile barrier protocol (warpgroup 1 meets
    # once before its first kv entry, warpgroup 0 once after its last), so the meetings balance
    # per tile.
    row0_of = lambda i: tile_of(i) * (_COMPUTE_WGS * bq) + wg * bq
    buf_of = lambda i: lax.rem(i, jnp.int32(2)) * _COMPUTE_WGS + wg

    def load_q(i):
      buf = buf_of(i)
      plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0_of(i), bq), h], qo_smem.at[buf],
                              q_loaded.at[buf])

    load_q(jnp.int32(0))                                      # every program has tile 0

    def sub_tile(i, ring_base):
      def prefetch_next_q():   # after tile i's Q wait: tile i + 1's Q into the other buffer
        @pl.when(i + 1 < n_sub)
        def _():
          # that buffer (and LSE row) last held tile i - 1's O, stored by TMA at its end:
          # wait until those stores have read shared memory before overwriting it
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          load_q(i + 1)
      buf = buf_of(i)
      n = _compute_tile(tile_of(i), row0_of(i), qo_smem.at[buf], q_loaded.at[buf],
                        lse_smem.at[buf], ring_base=ring_base, after_q_wait=prefetch_next_q,
                        tile_pos=(i == 0, i == n_sub - 1))
      return ring_base + n

    lax.fori_loop(jnp.int32(0), n_sub, sub_tile, jnp.int32(0))
    plgpu.wait_smem_to_gmem(0, wait_read_only=st.store_wait_read_only)

  def _compute_tile(tile, row0, q_smem, q_barrier, lse_dst, ring_base=None, after_q_wait=None,
                    tile_pos=None):
    """One query tile of this warpgroup (Q already requested on ``q_barrier``): the kv walk and
    the epilogue (O into ``q_smem``, LSE into ``lse_dst``, TMA stores issued, not waited for).
    ``ring_base`` (q_tiles_per_program > 1): ring entries of the program's earlier tiles; the
    tile's entry t - plo is then in slot (ring_base + t - plo) mod stages. Returns the number of
    ring entries of the tile (with ring_base) or None."""
    if ring_base is None:
      ring_slot = slot_of
    else:
      ring_slot = lambda t: lax.rem(ring_base + (t - plo), jnp.int32(stages))
    if not st.has_sched:
      plo, phi, (lo, flo, fhi, hi) = _program_ranges(b, tile, wg, bounds_ref, st)
    # segment ids: masked tiles take ``masked=True`` (static mask and the per-element segment
    # compare) or, where this warpgroup walks one segment only, ``masked="static"``
    one_seg = None if st.has_sched else _one_segment(b, tile, wg, bounds_ref, st)
    # masked: False (a full tile) or _Mask(seg, edge): seg, the per-element segment compare;
    # edge, the warpgroup's masked range ("left" [lo, flo), "right" [fhi, hi), None: unknown)
    seg_of = lambda masked, x: x if masked.seg else None

    def masked_loop(lo_, hi_, body_of, carry, edge=None):
      # tiles [lo_, hi_) masked: all with the static mask when one_seg, else with segments
      if one_seg is None:
        return lax.fori_loop(lo_, hi_, body_of(_Mask(True, edge)), carry)
      mid = jnp.where(one_seg, hi_, lo_)
      carry = lax.fori_loop(lo_, mid, body_of(_Mask(False, edge)), carry)
      return lax.fori_loop(mid, hi_, body_of(_Mask(True, edge)), carry)
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    m = plgpu.layout_cast(jnp.full((bq,), _M_INIT, jnp.float32), row_layout)   # base-2 max
    l = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), row_layout)       # running sum
    acc = plgpu.layout_cast(jnp.full((bq, st.head_dim), 0.0, jnp.float32), wgmma_layout)
    plgpu.barrier_wait(q_barrier)
    if after_q_wait is not None:
      after_q_wait()
    q_seg = None
    if st.has_seg:
      q_seg = compat.mosaic_gpu_load(q_seg_smem.at[wg], layout=row_layout)            # [bq] int32
    if not st.overlap_softmax:   # (overlap_softmax: the turns of ``overlap_walk``)
      pl.when(wg == 1)(take_turn if handoff else meet)
    if st.k_wait_in_pv:   # the first entry's K; each step or drain then waits for the next one
      if st.has_sched:
        n_walk = walk_count()
        pl.when(n_walk > 0)(lambda: plgpu.barrier_wait(k_loaded.at[0]))
      else:
        pl.when(plo < phi)(lambda: plgpu.barrier_wait(k_loaded.at[ring_slot(plo)]))

    def wait_next_k(nxt):
      # k_wait_in_pv: the K of the next ring entry (slot, whether there is one)
      next_slot, has_next = nxt
      pl.when(has_next)(lambda: plgpu.barrier_wait(k_loaded.at[next_slot]))

    def step_at(slot, t, carry, *, masked, nxt=None):
      # kv tile t, in ring slot ``slot`` (t mod stages for ranges, the list position for walks);
      # nxt: (slot, has) of the next entry, whose K this step waits for (k_wait_in_pv)
      acc, m, l = carry
      if not st.k_wait_in_pv:
        plgpu.barrier_wait(k_loaded.at[slot])
      kv_seg = None
      if masked and masked.seg and st.has_seg:   # read before the slot is released (k_free)
        kv_seg = compat.mosaic_gpu_load(kv_seg_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))

      def qk_gemm(s_ref):                                     # [bq, bk] fp32
        plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
        if handoff:
          hand_over()
        else:
          meet()
        return s_ref[...]
      s = pl.run_scoped(qk_gemm, plgpu.ACC((bq, bk), jnp.float32))   # [bq, bk]
      plgpu.barrier_arrive(k_free.at[slot])
      s = _cap_logits(s, st)
      if masked:
        rows = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 0, layout=wgmma_layout)
        cols = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1, layout=wgmma_layout)
        s = _apply_mask(s, _tile_visible(rows, cols, row0, t, st, seg_of(masked, q_seg),
                                         kv_seg, edge=masked.edge))
      p, alpha, m_new, l = _online_softmax(s, m, l, st)
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      p = p.astype(st.dtype)
      if st.softmax_fence:   # all of the softmax before the other warpgroup's wgmma window
        acc, m_new, l, p = lax.optimization_barrier((acc, m_new, l, p))
      if st.pingpong and not handoff:
        plgpu.barrier_arrive(rendezvous)   # softmax done; the other warpgroup may issue wgmma
      plgpu.barrier_wait(v_loaded.at[slot])
      if handoff:
        take_turn()
      elif st.pingpong:
        plgpu.barrier_wait(rendezvous)

      def pv_gemm(acc_ref):                                   # [bq, D] fp32
        plgpu.wgmma(acc_ref, p, v_smem.at[slot])
        if st.k_wait_in_pv:   # while the wgmma runs
          wait_next_k(nxt)
      acc = pl.run_state(pv_gemm)(plgpu.ACC.init(acc))       # returns once the wgmma is done
      plgpu.barrier_arrive(v_free.at[slot])
      return acc, m_new, l

    def step(t, carry, *, masked):
      if st.k_wait_in_pv:
        return step_at(ring_slot(t), t, carry, masked=masked,
                       nxt=(ring_slot(t + 1), t + 1 < phi))
      return step_at(ring_slot(t), t, carry, masked=masked)

    def drain_at(slot, nxt=None):
      # Tiles the other warpgroup needs and this one does not (before or after this
      # warpgroup's own range): keep the ring and the rendezvous count in step. Waiting for the
      # load first means this warpgroup can never arrive on a slot's "free" barrier for a later
      # use of the slot.
      if not st.k_wait_in_pv:   # else waited for by the previous entry
        plgpu.barrier_wait(k_loaded.at[slot])
      plgpu.barrier_wait(v_loaded.at[slot])
      plgpu.barrier_arrive(k_free.at[slot])
      plgpu.barrier_arrive(v_free.at[slot])
      if handoff:
        hand_over()
        take_turn()
      else:
        meet()
        meet()
      if st.k_wait_in_pv:
        # after the meetings: the next K may need the other warpgroup's release of this
        # entry's predecessor, which its P V gives only once this warpgroup has met it
        wait_next_k(nxt)

    def drain(t, _):
      if st.k_wait_in_pv:
        drain_at(ring_slot(t), (ring_slot(t + 1), t + 1 < phi))
      else:
        drain_at(ring_slot(t))
      return None

    def overlap_walk(carry):
      # overlap_softmax. Each compute warpgroup runs n + 1 turns for the program's n ring
      # entries: per entry, a drain (a tile it does not need) or a tile, whose turn issues
      # Q K^T of the tile and then P V of the warpgroup's previous tile (if any), and a last
      # turn that issues the last P V. A turn waits for its loads, then for its own barrier
      # (not warpgroup 0's turn 0), issues, and arrives on the other's (not warpgroup 1's turn
      # n), so the hand-overs pair up for any ranges. The P V of a tile runs while the next
      # tile's softmax does. (Slots and turn numbers are passed as thunks, evaluated where
      # they are used.)
      acc, m, l = carry
      n = walk_count() if st.has_sched else phi - plo
      if not st.has_sched:
        has = lo < hi

      def begin(k):
        if st.pingpong:
          skip, _ = _turn_skips(wg, k, n, *(tile_pos or (True, True)))
          pl.when(jnp.logical_not(skip))(take_turn)

      def end(k):
        if st.pingpong:
          _, skip = _turn_skips(wg, k, n, *(tile_pos or (True, True)))
          pl.when(jnp.logical_not(skip))(hand_over)

      def release(slot):   # an entry this warpgroup does not need
        plgpu.barrier_wait(k_loaded.at[slot])
        plgpu.barrier_wait(v_loaded.at[slot])
        plgpu.barrier_arrive(k_free.at[slot])
        plgpu.barrier_arrive(v_free.at[slot])

      def drain_turn(slot_of_turn, k):
        release(slot_of_turn())
        begin(k)
        end(k)

      def tile_kv_seg(slot, masked):
        # the tile's kv segment ids (with K on k_loaded), read before the slot is released
        if masked and masked.seg and st.has_seg:
          return compat.mosaic_gpu_load(kv_seg_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
        return None

      def softmax(s, t, m, l, masked, kv_seg=None):
        s = _cap_logits(s, st)
        if masked:
          rows = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 0, layout=wgmma_layout)
          cols = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1, layout=wgmma_layout)
          s = _apply_mask(s, _tile_visible(rows, cols, row0, t, st, seg_of(masked, q_seg),
                                           kv_seg, edge=masked.edge))
        return _online_softmax(s, m, l, st)           # p in fp32

      def qk_turn(slot_of_turn, t, k, carry, masked, rescale=False):   # Q K^T only
        # (the first tile; on a walk also a tile after a skip that flushed the pending P V,
        # where acc is not zero and must follow the new max: ``rescale``)
        acc, m, l, _ = carry
        slot = slot_of_turn()
        plgpu.barrier_wait(k_loaded.at[slot])
        kv_seg = tile_kv_seg(slot, masked)
        begin(k())

        def qk_gemm(s_ref):
          plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
          end(k())
          return s_ref[...]
        s = pl.run_scoped(qk_gemm, plgpu.ACC((bq, bk), jnp.float32))
        plgpu.barrier_arrive(k_free.at[slot])
        p, alpha, m, l = softmax(s, t, m, l, masked, kv_seg)
        if rescale:
          acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        return acc, m, l, p.astype(st.dtype)

      def pair_turn(slots_of_turn, t, k, carry, masked):   # Q K^T(t), then the pending P V
        acc, m, l, p = carry
        k_slot, v_slot = slots_of_turn()
        plgpu.barrier_wait(k_loaded.at[k_slot])
        plgpu.barrier_wait(v_loaded.at[v_slot])
        kv_seg = tile_kv_seg(k_slot, masked)
        begin(k())

        def body(refs):
          acc_ref, s_ref, m_ref, l_ref, p32_ref, a_ref = refs
          plgpu.wgmma(s_ref, q_smem, k_smem.at[k_slot].transpose((1, 0)))
          plgpu.wgmma(acc_ref, p, v_smem.at[v_slot])   # the pending P stays untouched until done
          end(k())
          s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)    # Q K^T done, P V may still run
          plgpu.barrier_arrive(k_free.at[k_slot])
          p32, alpha, m_new, l_new = softmax(s, t, m_ref[...], l_ref[...], masked, kv_seg)
          m_ref[...] = m_new
          l_ref[...] = l_new
          p32_ref[...] = p32
          a_ref[...] = alpha
        s0 = plgpu.layout_cast(jnp.full((bq, bk), 0.0, jnp.float32), wgmma_layout)
        acc, _, m, l, p32, alpha = pl.run_state(body)(
            (plgpu.ACC.init(acc), plgpu.ACC.init(s0), m, l, s0, m))   # returns after P V
        plgpu.barrier_arrive(v_free.at[v_slot])
        # the new P in 16 bits only now: written while the P V was in flight, the loop-carried
        # P registers (that wgmma's operand) would make ptxas serialize every wgmma (C7513,
        # run 54)
        p = lax.optimization_barrier(p32).astype(st.dtype)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        return acc, m, l, p

      def pv_turn(slot_of_turn, k, carry, drain_slot=None):   # the pending P V only
        acc, m, l, p = carry
        slot = slot_of_turn()
        plgpu.barrier_wait(v_loaded.at[slot])
        if drain_slot is not None:
          release(drain_slot)
        begin(k())

        def pv_gemm(acc_ref):
          plgpu.wgmma(acc_ref, p, v_smem.at[slot])
          end(k())
        acc = pl.run_state(pv_gemm)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m, l, p

      zero_p = lambda: plgpu.layout_cast(jnp.full((bq, bk), 0.0, st.dtype), wgmma_layout)
      if st.has_sched:
        # The program's list in order, entry j in slot j mod S; carry: (acc, m, l, p, whether a
        # P V is pending, its ring slot)
        shift = 2 * wg

        def walk_turn(j, c):
          state, pending, prev = c[:4], c[4], c[5]
          entry = walk_entry(j)
          t = lax.shift_right_logical(entry, jnp.int32(_WALK_SHIFT))
          code = lax.bitwise_and(lax.shift_right_logical(entry, shift), jnp.int32(3))
          slot = slot_of(j)
          no, yes = jnp.int32(0), jnp.int32(1)
          turn = lambda: j

          def skip(state):
            return lax.cond(
                pending == 1,
                lambda st_: (*pv_turn(lambda: prev, turn, st_, drain_slot=slot), no, prev),
                lambda st_: (drain_turn(lambda: slot, j), (*st_, no, prev))[1], state)

          def run(masked):
            def f(state):
              return lax.cond(
                  pending == 1,
                  lambda st_: (*pair_turn(lambda: (slot, prev), t, turn, st_, masked), yes, slot),
                  lambda st_: (*qk_turn(lambda: slot, t, turn, st_, masked, rescale=True),
                               yes, slot), state)
            return f
          return lax.cond(code == _SKIP, skip, lambda st_: lax.cond(
              code == _FULL, run(False), run(_Mask(True, None)), st_), state)

        c = lax.fori_loop(jnp.int32(0), n, walk_turn, (acc, m, l, zero_p(), jnp.int32(0),
                                                       jnp.int32(0)))
        state, pending, prev = c[:4], c[4], c[5]

        def none(state):
          begin(n)
          end(n)
          return state
        acc, m, l, _ = lax.cond(pending == 1, lambda st_: pv_turn(lambda: prev, lambda: n, st_),
                                none, state)
        return acc, m, l

      # Range path: the drains of [plo, lo), a Q K^T-only turn for lo, a pair turn per tile in
      # (lo, hi), a P V-only turn, the drains of [hi, phi), and an empty turn when the
      # warpgroup has no tile (lo == hi).
      lax.fori_loop(plo, lo, lambda e, c: drain_turn(lambda: ring_slot(e), e - plo), None)
      carry = (acc, m, l, zero_p())
      one = has.astype(jnp.int32)
      carry = masked_loop(lo, lo + one, lambda masked: lambda e, c: qk_turn(
          lambda: ring_slot(e), e, lambda: e - plo, c, masked), carry)   # edge or not: exact mask
      a = lo + 1
      b1 = jnp.maximum(flo, a)
      b2 = jnp.maximum(fhi, a)

      def pair(masked):
        return lambda e, c: pair_turn(lambda: (ring_slot(e), ring_slot(e - 1)), e,
                                      lambda: e - plo, c, masked)
      carry = masked_loop(a, b1, pair, carry, edge="left")
      carry = lax.fori_loop(b1, b2, pair(False), carry)
      carry = masked_loop(b2, hi, pair, carry, edge="right")
      carry = lax.fori_loop(hi, hi + one, lambda e, c: pv_turn(
          lambda: ring_slot(e - 1), lambda: e - plo, c), carry)
      lax.fori_loop(hi, phi, lambda e, c: drain_turn(lambda: ring_slot(e), e - plo + one), None)

      @pl.when(jnp.logical_not(has))
      def _():                                        # the empty turn n
        begin(n)
        end(n)
      acc, m, l, _ = carry
      return acc, m, l

    carry = (acc, m, l)
    if st.overlap_softmax:
      carry = overlap_walk(carry)
    elif st.has_sched:
      # The program's list, in order (the memory warpgroup loads entry j into slot j mod S);
      # this warpgroup's 2-bit code of each entry picks drain, unmasked or masked step.
      shift = 2 * wg

      def walk_step(j, carry):
        entry = walk_entry(j)
        t = lax.shift_right_logical(entry, jnp.int32(_WALK_SHIFT))
        code = lax.bitwise_and(lax.shift_right_logical(entry, shift), jnp.int32(3))
        slot = slot_of(j)
        nxt = (slot_of(j + 1), j + 1 < n_walk) if st.k_wait_in_pv else None

        def skip(carry):
          if st.k_wait_in_pv:
            drain_at(slot, nxt)
          else:
            drain_at(slot)
          return carry

        def run(carry):
          kw = dict(nxt=nxt) if st.k_wait_in_pv else {}
          return lax.cond(code == _FULL, functools.partial(step_at, slot, t, masked=False, **kw),
                          functools.partial(step_at, slot, t, masked=_Mask(True, None), **kw),
                          carry)
        return lax.cond(code == _SKIP, skip, run, carry)
      carry = lax.fori_loop(jnp.int32(0), walk_count(), walk_step, carry)
    else:
      lax.fori_loop(plo, lo, drain, None)
      step_of = lambda masked: functools.partial(step, masked=masked)
      carry = masked_loop(lo, flo, step_of, carry, edge="left")
      carry = lax.fori_loop(flo, fhi, step_of(False), carry)
      carry = masked_loop(fhi, hi, step_of, carry, edge="right")
      lax.fori_loop(hi, phi, drain, None)
    if not st.overlap_softmax:
      pl.when(wg == 0)(hand_over if handoff else meet)
    acc, m, l = carry

    out, lse = _finalize(acc, m, l)
    q_smem[...] = out.astype(st.dtype)                        # Q is dead: reuse its tile for O
    lse_dst[...] = lse
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, o_ref.at[b, pl.ds(row0, bq), h])
    plgpu.copy_smem_to_gmem(lse_dst, lse_ref.at[b, h, pl.ds(row0, bq)])
    if ring_base is not None:
      return phi - plo
    return None

  @pl.when(wg < _COMPUTE_WGS)
  def _compute():
    plgpu.set_max_registers(st.compute_registers, action="increase")
    if multi:
      _compute_tiles()
      return
    row0 = row0_program + wg * bq
    q_smem = qo_smem.at[wg]                                   # [bq, D]
    plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0, bq), h], q_smem, q_loaded.at[wg])
    if st.has_seg:
      plgpu.copy_gmem_to_smem(q_seg_ref.at[b, pl.ds(row0, bq)], q_seg_smem.at[wg],
                              q_loaded.at[wg])
    _compute_tile(tile, row0, q_smem, q_loaded.at[wg], lse_smem.at[wg])
    plgpu.wait_smem_to_gmem(0, wait_read_only=st.store_wait_read_only)

  @pl.when(wg == _COMPUTE_WGS)
  def _memory():
    plgpu.set_max_registers(st.memory_registers, action="decrease")

    def load(t, slot, part="kv"):
      rows = (b, pl.ds(t * bk, bk), kv_h)
      if "k" in part:
        plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_loaded.at[slot])
        if st.has_seg:
          plgpu.copy_gmem_to_smem(kv_seg_ref.at[b, pl.ds(t * bk, bk)], kv_seg_smem.at[slot],
                                  k_loaded.at[slot])
      if "v" in part:
        plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_loaded.at[slot])

    def refill(tile_fn, slot):
      # a later use of a ring slot: wait for its release by both compute warpgroups, then load
      # kv tile tile_fn()
      if st.early_k_load:   # K as soon as its Q K^T is done, V after the P V
        plgpu.barrier_wait(k_free.at[slot])
        t = tile_fn()
        load(t, slot, "k")
        plgpu.barrier_wait(v_free.at[slot])
        load(t, slot, "v")
      else:
        plgpu.barrier_wait(k_free.at[slot])
        plgpu.barrier_wait(v_free.at[slot])
        load(tile_fn(), slot)

    if st.has_sched:   # the walk's entries in order, entry j into slot j mod S
      n = walk_count()
      tile_at = lambda j: lax.shift_right_logical(walk_entry(j), jnp.int32(_WALK_SHIFT))
      for i in range(stages):                                 # fill the ring
        @pl.when(i < n)
        def _():
          load(tile_at(i), i)

      @pl.loop(jnp.int32(stages), jnp.maximum(n, stages))
      def _(j):
        slot = slot_of(j)
        refill(lambda: tile_at(j), slot)
      return

    if multi:
      # The program's query tiles in the compute warpgroups' order, their kv ranges one after
      # the other in one ring: entry c (c counts across tiles) in slot c mod stages, the first
      # ``stages`` entries loaded at once, each later one when both compute warpgroups have
      # released entry c - stages (possibly of the previous tile).
      def sub_tile(i, ring_base):
        plo, phi, _ = _program_ranges(b, tile_of(i), None, bounds_ref, st)

        @pl.loop(jnp.int32(0), phi - plo)
        def _(j):
          c = ring_base + j
          slot = slot_of(c)

          @pl.when(c < stages)
          def _():
            load(plo + j, slot)

          @pl.when(c >= stages)
          def _():
            refill(lambda: plo + j, slot)
        return ring_base + (phi - plo)

      lax.fori_loop(jnp.int32(0), n_sub, sub_tile, jnp.int32(0))
      return

    plo, phi, _ = _program_ranges(b, tile, None, bounds_ref, st)
    for i in range(stages):                                   # fill the ring
      @pl.when(plo + i < phi)
      def _():
        load(plo + i, slot_of(plo + i))

    @pl.loop(plo + stages, jnp.maximum(phi, plo + stages))
    def _(t):
      slot = slot_of(t)
      refill(lambda: t, slot)


# ----------------------------------------------------------------------------------------------
# pallas call and public function
# ----------------------------------------------------------------------------------------------


def _fwd_call(q, k, v, st: _Static, q_seg=None, kv_seg=None, bounds=None, walk=None):
  """Padded q [B, Sq', Hq, D], k/v [B, Sk', Hk, D] (with segment ids: q_seg [B, Sq'],
  kv_seg [B, Sk'] int32 padded with 0, bounds from ``_seg_bounds``; with a block schedule:
  walk from ``_schedule_walk`` and no bounds) -> (o [B, Sq', Hq, D], lse [B, Hq, Sq']).

  The CPU tests substitute this function (monkeypatch) with a jnp replay of the kernel, to run
  the custom_vjp and the Triton backward in interpret mode."""
  if st.interpret:
    raise NotImplementedError("the Mosaic GPU flash attention forward cannot run in interpret "
                              "mode (interpret=True): jax's GPU interpreter has no wgmma with "
                              "transposed or register operands")
  b, sq_pad, hq, d = q.shape
  bq, bk, stages = st.block_q, st.block_k, st.num_stages
  tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))   # 64 x 16-bit = 128 bytes
  # q_tiles_per_program > 1: two sets of Q/O tiles and LSE rows (index 2 * set + warpgroup)
  n_q_bufs = _COMPUTE_WGS * (2 if st.q_tiles_per_program > 1 else 1)
  smem = (
      plgpu.SMEM((n_q_bufs, bq, d), q.dtype, transforms=tiled),         # Q, then O
      plgpu.SMEM((stages, bk, d), k.dtype, transforms=tiled),           # K ring
      plgpu.SMEM((stages, bk, d), v.dtype, transforms=tiled),           # V ring
      plgpu.SMEM((n_q_bufs, bq), jnp.float32),                          # LSE staging
  )
  seg_copies = 1
  args = (q, k, v)
  if st.has_seg:
    smem += (plgpu.SMEM((_COMPUTE_WGS, bq), jnp.int32),                # q segment ids
             plgpu.SMEM((stages, bk), jnp.int32))                      # kv segment ids ring
    seg_copies = 2       # Q + its ids on q_loaded, K + its ids on k_loaded
    args += (q_seg, kv_seg)
    if not st.has_sched:
      args += (bounds,)
  if st.has_sched:
    args += (walk,)
  # The first grid axis is CUDA's x, launched fastest.
  # (q_tiles_per_program > 1: "q_tiles" counts programs of that many query tiles)
  if st.q_major_grid:   # resident programs: consecutive query tiles of one head
    grid = dict(grid=(st.num_programs, hq, b), grid_names=("q_tiles", "heads", "batch"))
  else:
    grid = dict(grid=(hq, st.num_programs, b), grid_names=("heads", "q_tiles", "batch"))
  call = plgpu.kernel(
      functools.partial(_fwd_kernel, st=st),
      out_type=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct((b, hq, sq_pad), jnp.float32)),
      scratch_types=(
          smem,
          plgpu.Barrier(num_arrivals=seg_copies, num_barriers=n_q_bufs),      # q_loaded
          plgpu.Barrier(num_arrivals=seg_copies, num_barriers=stages),        # k_loaded
          plgpu.Barrier(num_barriers=stages),                              # v_loaded
          plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages),   # k_free
          plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages),   # v_free
          (plgpu.Barrier(num_barriers=_COMPUTE_WGS)                        # rendezvous
           if st.pingpong and st.pingpong_handoff else plgpu.Barrier(num_arrivals=_COMPUTE_WGS)),
      ),
      **grid,
      num_threads=_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=(plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0)
                       if st.no_reduction_scratch else plgpu.CompilerParams(approx_math=True)),
  )
  return call(*args)


def _pad_axis(x, axis, size):
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


def _forward_impl(q, k, v, q_seg, kv_seg, schedule, st: _Static):
  """Unpadded q, k, v (segment ids or None, a BlockSchedule or None) -> (out [B, Sq, Hq, D],
  lse [B, Hq, Sq] natural log): pads to whole tiles, runs the kernel (``_fwd_call``) and slices
  the padding away."""
  sq_pad = st.num_q_programs * _COMPUTE_WGS * st.block_q
  sk_pad = st.num_kv_tiles * st.block_k
  q_p = _pad_axis(q, 1, sq_pad)
  k_p = _pad_axis(k, 1, sk_pad)
  v_p = _pad_axis(v, 1, sk_pad)
  if st.has_sched:
    q_seg_p = kv_seg_p = None
    if st.has_seg:
      q_seg_p = _pad_axis(q_seg.astype(jnp.int32), 1, sq_pad)    # padding: segment 0
      kv_seg_p = _pad_axis(kv_seg.astype(jnp.int32), 1, sk_pad)
    walk = _schedule_walk(schedule, st, q_seg_p, kv_seg_p)
    out, lse = _fwd_call(q_p, k_p, v_p, st, q_seg_p, kv_seg_p, walk=walk)
  elif st.has_seg:
    q_seg_p = _pad_axis(q_seg.astype(jnp.int32), 1, sq_pad)      # padding: segment 0
    kv_seg_p = _pad_axis(kv_seg.astype(jnp.int32), 1, sk_pad)
    out, lse = _fwd_call(q_p, k_p, v_p, st, q_seg_p, kv_seg_p, _seg_bounds(q_seg_p, kv_seg_p, st))
  else:
    out, lse = _fwd_call(q_p, k_p, v_p, st)
    if st.tail_kv_splits:
      out, lse = _tail_fixup(q_p, k_p, v_p, out, lse, st)
  return out[:, :st.q_len], lse[:, :, :st.q_len]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _forward(q, k, v, q_seg, kv_seg, schedule, st: _Static):
  return _forward_impl(q, k, v, q_seg, kv_seg, schedule, st)


def _forward_fwd(q, k, v, q_seg, kv_seg, schedule, st):
  out, lse = _forward_impl(q, k, v, q_seg, kv_seg, schedule, st)
  return (out, lse), (q, k, v, q_seg, kv_seg, schedule, out, lse)


def _triton_bwd_masked(q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse, st: _Static,
                       schedule=None):
  """The Triton backward kernels (``triton.flash_attention_bwd``) on this forward's residuals
  for windows, segment ids, soft cap and block schedules: they walk ``make_schedule`` of the full
  mask at the backward tiles, or ``schedule`` (the forward's block schedule, e.g. a top-K
  selection's) at its own tiles."""
  from pallas_kernels.flash import triton as ft
  return ft.flash_attention_bwd(
      q, k, v, out, lse, d_out, d_lse, causal=st.causal, scale=st.scale,
      local_window_size=st.window, logits_soft_cap=st.soft_cap, q_segment_ids=q_seg,
      kv_segment_ids=kv_seg, schedule=schedule, block_sizes=st.bwd_block_sizes,
      interpret=st.interpret)


def _forward_bwd(st, res, cts):
  """The backward kernels on this forward's residuals: Triton's (``triton.flash_attention_bwd``;
  with a window, segment ids or soft cap ``_triton_bwd_masked``) or, with
  ``BlockSizes(backward="mosaic")`` or a ``mosaic_gpu_bwd.BlockSizes`` as ``bwd_block_sizes``,
  the Mosaic GPU ones (``mosaic_gpu_bwd.flash_attention_bwd``, same residuals; every mask, block
  schedules included: its kernels walk the same schedule's lists at their own tiles).

  The conventions match: lse is the natural-log log-sum-exp over the unpadded keys (``_finalize``:
  m * ln 2 + ln l, m the base-2 running max) with -inf for rows that see no key, which the Triton
  backward turns into base 2 and +inf (p = 0) like its own forward's; padded rows are sliced away
  before the residuals are saved; causal alignment is bottom-right in both; the soft cap is on
  the scaled logit in both.
  """
  from pallas_kernels.flash import triton as flash_triton  # local: the forward alone needs none
  q, k, v, q_seg, kv_seg, schedule, out, lse = res
  d_out, d_lse = cts
  if st.backward == "mosaic":
    from pallas_kernels.flash import mosaic_gpu_bwd
    grads = mosaic_gpu_bwd.flash_attention_bwd(q, k, v, out, lse, d_out, causal=st.causal,
                                               scale=st.scale, block_sizes=st.bwd_block_sizes,
                                               d_lse=d_lse, local_window_size=st.window,
                                               logits_soft_cap=st.soft_cap,
                                               q_segment_ids=q_seg if st.has_seg else None,
                                               kv_segment_ids=kv_seg if st.has_seg else None,
                                               schedule=schedule if st.has_sched else None)
  elif st.has_sched:   # the Triton kernels on the same block schedule
    grads = _triton_bwd_masked(q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse, st,
                               schedule=schedule)
  elif st.window is not None or st.soft_cap is not None or st.has_seg:
    grads = _triton_bwd_masked(q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse, st)
  else:
    grads = flash_triton.flash_attention_bwd(q, k, v, out, lse, d_out, d_lse, causal=st.causal,
                                             scale=st.scale, block_sizes=st.bwd_block_sizes,
                                             interpret=st.interpret)
  return tuple(grads) + (None, None, None)


_forward.defvjp(_forward_fwd, _forward_bwd)


def _static_config(q_shape, k_shape, dtype, *, causal, scale, block_sizes, interpret=False,
                   bwd_block_sizes=None, local_window_size=None, logits_soft_cap=None,
                   has_seg=False, schedule=None) -> _Static:
  """The kernel's static configuration for q [B, Sq, Hq, D] and k/v [B, Sk, Hk, D] (and a
  ``BlockSchedule``, checked against the kernel's tiles, or None)."""
  from pallas_kernels.masks import normalize_window
  window = normalize_window(local_window_size)
  if window == (None, None):
    window = None
  if logits_soft_cap is not None and not float(logits_soft_cap) > 0:
    raise ValueError(f"logits_soft_cap must be > 0, got {logits_soft_cap}")
  _, sq, hq, d = q_shape
  _, sk, hk, _ = k_shape
  bs = block_sizes or default_block_sizes(d, dtype)
  if d not in _HEAD_DIMS:
    raise NotImplementedError(f"the Mosaic GPU forward supports head_dim 64, 128 or 256, got {d}")
  from pallas_kernels.flash import mosaic_gpu_bwd   # light: no kernel is built here
  backward = "mosaic" if isinstance(bwd_block_sizes, mosaic_gpu_bwd.BlockSizes) else bs.backward
  if backward == "mosaic":
    if bwd_block_sizes is not None and not isinstance(bwd_block_sizes, mosaic_gpu_bwd.BlockSizes):
      raise TypeError(f"backward='mosaic' takes a mosaic_gpu_bwd.BlockSizes as bwd_block_sizes, "
                      f"got {type(bwd_block_sizes)}")
    mosaic_gpu_bwd._check_head_dim(d)              # D256: NotImplementedError now, not at grad
  if sq < 1 or sk < 1:
    raise ValueError(f"sequence lengths must be >= 1, got q {sq}, kv {sk}")
  if bs.q_tiles_per_program > 1 and (has_seg or schedule is not None):
    raise ValueError(f"q_tiles_per_program={bs.q_tiles_per_program} (> 1) runs the range path "
                     f"only: not with segment ids or a block schedule (use "
                     f"q_tiles_per_program=1)")
  sched = {}
  if schedule is not None:
    _check_schedule(schedule, q_shape, k_shape, bs,
                    None if backward == "mosaic" else bwd_block_sizes)
    if backward == "mosaic":   # its tiles against the schedule's: now, not at grad time
      mosaic_gpu_bwd._check_schedule(schedule, q_shape, k_shape, bwd_block_sizes or (
          mosaic_gpu_bwd.call_block_sizes(d, dtype, causal=causal, window=window,
                                          has_seg=has_seg, schedule=schedule)))
    bsz, hsz = schedule.kv_indices.shape[:2]
    sched = dict(has_sched=True, sched_batch=q_shape[0] > 1 and (has_seg or bsz > 1),
                 sched_heads=hsz > 1)
  return _Static(
      block_q=bs.block_q, block_k=bs.block_k, num_stages=bs.num_stages, pingpong=bs.pingpong,
      compute_registers=bs.compute_registers, memory_registers=bs.memory_registers,
      q_len=sq, kv_len=sk,
      num_q_programs=-(-sq // bs.rows_per_program), num_kv_tiles=-(-sk // bs.block_k),
      head_dim=d, group=hq // hk, causal=bool(causal),
      scale=float(d ** -0.5 if scale is None else scale), dtype=jnp.dtype(dtype),
      window=window, soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
      has_seg=bool(has_seg),
      interpret=bool(interpret), bwd_block_sizes=bwd_block_sizes, backward=backward,
      softmax_fence=bool(bs.softmax_fence), early_k_load=bool(bs.early_k_load),
      q_major_grid=bool(bs.q_major_grid), pingpong_handoff=bool(bs.pingpong_handoff),
      no_reduction_scratch=bool(bs.no_reduction_scratch), k_wait_in_pv=bool(bs.k_wait_in_pv),
      q_tiles_per_program=int(bs.q_tiles_per_program),
      overlap_softmax=bool(bs.overlap_softmax),
      store_wait_read_only=bool(bs.store_wait_read_only),
      one_seg_mask=bool(bs.one_segment_static_mask), edge_masks=not bs.all_bounds_mask,
      **sched, **_tail_config(
          bs, q_shape, k_shape, causal=causal, window=window, has_seg=has_seg,
          schedule=schedule))


def _tail_config(bs: BlockSizes, q_shape, k_shape, *, causal, window, has_seg, schedule):
  """``_Static`` fields of ``BlockSizes.tail_kv_splits`` ({} when off); ValueError naming what
  the call has that the option does not support."""
  c = int(bs.tail_kv_splits)
  if not c:
    return {}
  bad = _tail_unsupported(bs, k_shape, causal=causal, window=window, segments=has_seg,
                          schedule=schedule is not None)
  if bad:
    raise ValueError(f"tail_kv_splits={c} (dense masks only) does not support " + "; ".join(bad))
  return dict(tail_batch=int(q_shape[0]) - 1, tail_kv_splits=c)


def _tail_unsupported(bs: BlockSizes, k_shape, *, causal, window, segments, schedule):
  """What of a call ``tail_kv_splits`` does not support (empty: nothing)."""
  bad = [name for name, on in (("causal", causal), ("a local window", window is not None),
                               ("segment ids", segments), ("a block schedule", schedule)) if on]
  c, sk = int(bs.tail_kv_splits), k_shape[1]
  if sk % (c * bs.block_k):
    bad.append(f"kv length {sk} not a multiple of tail_kv_splits * block_k = {c * bs.block_k}")
  return bad


def fit_block_sizes(bs: BlockSizes, q_shape, k_shape, *, causal=False, window=None,
                    segments=False, schedule=False, core_count=None) -> BlockSizes:
  """A table default fitted to one call: ``fit_tail_kv_splits``, and ``q_tiles_per_program``
  back to 1 where the call has segment ids or a block schedule (several query tiles per program
  run the range path only; the H200's causal-window entry takes 2, and a causal window with
  segment ids has the same table key). A ``BlockSizes`` passed by the caller is used as given
  (and raises where an option is unsupported).

  Args:
    bs: the forward's ``BlockSizes``.
    q_shape, k_shape: [B, Sq, Hq, D] and [B, Sk, Hk, D].
    causal, window, segments, schedule: the call's masks (window: None or (left, right)).
    core_count: SMs per GPU (default ``compat.gpu_core_count()``).

  Returns:
    A ``BlockSizes``.

  Example:
    >>> bs = BlockSizes(64, 128, 2, q_tiles_per_program=2)
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
  """``bs`` with ``tail_kv_splits`` kept only where the call supports it and it pays: no causal
  mask, window, segment ids or block schedule; keys a multiple of ``tail_kv_splits * block_k``;
  and a last wave that is partial by at most ``Hq`` programs, i.e. (B * Hq * query programs) mod
  SMs in [1, Hq] (one program per SM; the option moves exactly the last Hq programs to a
  second, split launch). Otherwise 0. The table defaults go through this (``jattn``'s default
  block sizes); a ``BlockSizes`` passed by the caller is used as given (and raises where the
  option is unsupported).

  Args:
    bs: the forward's ``BlockSizes``.
    q_shape, k_shape: [B, Sq, Hq, D] and [B, Sk, Hk, D].
    causal, window, segments, schedule: the call's masks (window: None or (left, right)).
    core_count: SMs per GPU (default ``compat.gpu_core_count()``, 1 without a GPU: never).

  Returns:
    A ``BlockSizes``.

  Example:
    >>> bs = BlockSizes(64, 128, 2, tail_kv_splits=8)   # B2 S16K H16: 4096 = 31 x 132 + 4
    >>> fit_tail_kv_splits(bs, (2, 16384, 16, 128), (2, 16384, 16, 128),
    ...                    core_count=132).tail_kv_splits
    8
    >>> fit_tail_kv_splits(bs, (1, 16384, 33, 128), (1, 16384, 33, 128),   # 32 full waves
    ...                    core_count=132).tail_kv_splits
    0
  """
  c = int(bs.tail_kv_splits)
  if not c:
    return bs
  b, sq, hq, _ = q_shape
  sms = compat.gpu_core_count() if core_count is None else int(core_count)
  last = (b * hq * -(-sq // bs.rows_per_program)) % sms
  ok = 1 <= last <= hq and not _tail_unsupported(bs, k_shape, causal=causal, window=window,
                                                  segments=segments, schedule=schedule)
  return bs if ok else dataclasses.replace(bs, tail_kv_splits=0)


def _tail_fixup(q_p, k_p, v_p, out, lse, st: _Static):
  """``tail_kv_splits``: the rows of the program the kernel skipped (the last query program of
  batch row ``st.tail_batch``, every head), computed by a second launch of the kernel over
  ``st.tail_kv_splits`` chunks of the keys (batch = chunks, the skipped Q tile in each) and
  merged by log-sum-exp, then written into ``out`` / ``lse`` (padded layouts of ``_fwd_call``)."""
  c, bb = st.tail_kv_splits, st.tail_batch
  _, sq_pad, hq, d = q_p.shape
  sk_pad, hk = k_p.shape[1], k_p.shape[2]
  rows = _COMPUTE_WGS * st.block_q
  r0 = (st.num_q_programs - 1) * rows
  q_t = jnp.broadcast_to(q_p[bb, r0:r0 + rows][None], (c, rows, hq, d))
  k_t = k_p[bb].reshape(c, sk_pad // c, hk, d)          # contiguous chunks: free reshapes
  v_t = v_p[bb].reshape(c, sk_pad // c, hk, v_p.shape[-1])
  st_t = dataclasses.replace(st, q_len=rows, kv_len=sk_pad // c, num_q_programs=1,
                             num_kv_tiles=st.num_kv_tiles // c, tail_batch=-1, tail_kv_splits=0)
  o_t, l_t = _fwd_call(q_t, k_t, v_t, st_t)             # [c, rows, hq, d], [c, hq, rows]
  from pallas_kernels.common.merge import merge_partials
  o, l = merge_partials(o_t.transpose(0, 2, 1, 3), l_t, axis=0)     # [hq, rows, d], [hq, rows]
  return _place_rows(out, lse, o.transpose(1, 0, 2).astype(out.dtype), l, bb, r0,
                     interpret=st.interpret)


def _place_rows(out, lse, rows_out, rows_lse, b, r0, *, interpret=False):
  """``out[b, r0:r0 + R] = rows_out`` and ``lse[b, :, r0:r0 + R] = rows_lse`` in place: a Pallas
  Triton kernel (one program per head) whose outputs alias ``out`` / ``lse``, so only the R rows
  are written. Not ``.at[].set``: on the H200 (jax 0.11.2, run 72) XLA's dynamic-slice fusion
  failed to compile that update of the Mosaic kernel's output ("DUS target must be a fusion
  parameter"). R (a power of two) must divide r0."""
  n, hq, d = rows_out.shape
  if n & (n - 1) or r0 % n:
    raise ValueError(f"_place_rows: {n} rows must be a power of two dividing r0={r0}")

  def kernel(o_ref, l_ref, out_in, lse_in, out_ref, lse_ref):
    del out_in, lse_in                                   # aliased: only this block is written
    out_ref[...] = o_ref[...]
    lse_ref[...] = l_ref[...]

  row_block = r0 // n
  return pl.pallas_call(
      kernel, grid=(hq,),
      in_specs=[pl.BlockSpec((n, None, d), lambda h: (0, h, 0)),
                pl.BlockSpec((None, n), lambda h: (h, 0)),
                pl.BlockSpec((None, n, None, d), lambda h: (b, row_block, h, 0)),
                pl.BlockSpec((None, None, n), lambda h: (b, h, row_block))],
      out_specs=[pl.BlockSpec((None, n, None, d), lambda h: (b, row_block, h, 0)),
                 pl.BlockSpec((None, None, n), lambda h: (b, h, row_block))],
      out_shape=[jax.ShapeDtypeStruct(out.shape, out.dtype),
                 jax.ShapeDtypeStruct(lse.shape, lse.dtype)],
      input_output_aliases={2: 0, 3: 1},
      compiler_params=compat.triton_compiler_params(num_warps=8, num_stages=1),
      interpret=interpret, name="jattn_mosaic_tail_place")(rows_out, rows_lse, out, lse)


def _check_schedule(schedule, q_shape, k_shape, bs: BlockSizes, bwd_block_sizes):
  """ValueError unless the kernel (tiles ``bs``) and the Triton backward can walk ``schedule``:
  same lengths, leading axes [1|B, 1|Hk], schedule tiles multiples of the kernel's
  (``block_q`` rows per warpgroup, ``block_k`` keys) and powers of two >= 16 (the Triton
  backward walks the schedule at its own tiles), a Triton ``bwd_block_sizes`` with those tiles."""
  from pallas_kernels.block_schedule import check_schedule_args
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
                    interpret: bool = False, bwd_block_sizes=None):
  """Flash attention on Hopper: Pallas Mosaic GPU forward, Triton or Mosaic GPU backward
  (custom_vjp).

  The argument shape follows ``pallas_kernels.flash.triton.flash_attention``. Differentiable
  with respect to q, k, v (including through the returned LSE): by default the backward is
  ``pallas_kernels.flash.triton.flash_attention_bwd`` (the Triton dK/dV and dQ kernels) fed with
  this forward's out and LSE (with masks or a schedule: the same kernels through
  ``_triton_bwd_masked``); ``BlockSizes(backward="mosaic")`` or a ``mosaic_gpu_bwd.BlockSizes``
  as ``bwd_block_sizes`` selects ``mosaic_gpu_bwd.flash_attention_bwd`` (every mask and block
  schedules; head_dim 64/128).

  Args:
    q: [B, Sq, Hq, D], bf16 or fp16, D in (64, 128, 256).
    k: [B, Sk, Hk, D]; Hq % Hk == 0 (query head h reads kv head h // (Hq // Hk)).
    v: [B, Sk, Hk, D] (same head dim as k).
    q_segment_ids, kv_segment_ids: None (both) or int [B, Sq] / [B, Sk]: query i sees key j
      only if their ids are equal and non-zero (0 = padding). The kernel walks, per query tile,
      the kv tiles from the first to the last that may hold a key of its segments (tiles of
      other documents are never loaded) and masks the tiles that need it.
    schedule: None (the kernel derives contiguous kv ranges from the mask) or a
      ``block_schedule.BlockSchedule`` for (Sq, Sk) with leading axes [1|B, 1|Hk], e.g.
      ``make_schedule(Sq, Sk, 128, 64, causal=True, block_mask=selection.tile_mask())`` for a
      top-K block selection: the kernel then visits only the schedule's kv tiles
      (``_schedule_walk``: per program the union of its two warpgroups' lists, each tile run
      unmasked, masked or skipped per warpgroup) and the backward walks the same schedule (its
      kv lists and transposed q lists): the Triton dK/dV and dQ kernels at the schedule's
      tiles, or the Mosaic GPU ones at theirs (``backward="mosaic"``). Its tiles must be powers of two and multiples of ``block_sizes.block_q`` /
      ``block_k`` (ValueError otherwise); the element mask (causal, window, segment ids) is this
      call's, the schedule only removes tiles.
    causal: bottom-right aligned causal mask; kv tiles past the diagonal are skipped.
    local_window_size: None, int w (= (w, w)) or (left, right) (jax.nn convention; either side
      None = unbounded): query at position p sees keys in [p - left, p + right]; with causal a
      "window of 512" is (511, 0). kv tiles outside every row's window are skipped, only edge
      tiles are masked.
    scale: logit scale (None: 1 / sqrt(D)).
    logits_soft_cap: None or cap > 0: logits = cap * tanh(scale * q.k / cap) (the reference's
      convention).
    block_sizes: ``BlockSizes`` of the forward (None: ``default_block_sizes(D)``).
    interpret: runs the backward's Triton kernels in the Pallas interpreter; the forward itself
      cannot be interpreted (jax's Mosaic GPU interpret mode, 0.10.2 and 0.11, implements wgmma
      only with both operands in shared memory and untransposed, and this kernel uses K^T and P
      from registers), so a call with interpret=True raises NotImplementedError unless a test has
      substituted ``_fwd_call``.
    bwd_block_sizes: the backward's tiles: a ``pallas_kernels.flash.triton.BlockSizes`` (its
      bwd_* fields) for the Triton backward, or a ``mosaic_gpu_bwd.BlockSizes``, which also
      selects the Mosaic GPU backward; None: the default tiles of the backward that
      ``block_sizes.backward`` names (with a schedule: Triton launch defaults at the schedule's
      tiles; a Triton ``BlockSizes`` given here must have them as ``bwd_tiles``; the Mosaic GPU
      backward's defaults come from its table's "block_sparse" entry cut to the schedule's
      tiles, and tiles given here must divide the schedule's: ValueError at this call). The
      Mosaic GPU backward takes every mask and block schedules.

  Returns:
    (out [B, Sq, Hq, D] in q.dtype, lse [B, Hq, Sq] fp32, natural log, -inf for rows that see
    no key; their output is 0).

  Example (on an H100/H200):
    >>> q = jax.random.normal(jax.random.key(0), (1, 1024, 8, 128), jnp.bfloat16)
    >>> out, lse = flash_attention(q, q, q, causal=True)  # doctest: +SKIP
    >>> from pallas_kernels.block_schedule import make_schedule
    >>> keep = jnp.tril(jnp.ones((8, 16), bool))[None, None]    # any [1|B, 1|Hk, 8, 16] tiles
    >>> s = make_schedule(1024, 1024, 128, 64, causal=True, block_mask=keep)
    >>> out, lse = flash_attention(q, q, q, schedule=s, causal=True)  # doctest: +SKIP
  """
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"q, k, v must be [batch, seq, heads, head_dim], got {q.shape}, {k.shape}, "
                     f"{v.shape}")
  b, sq, hq, d = q.shape
  if k.shape[0] != b or k.shape[3] != d or v.shape != k.shape:
    raise ValueError(f"q, k, v shapes do not agree: {q.shape}, {k.shape}, {v.shape} (k and v "
                     f"must have the same shape and q's head dim)")
  hk, sk = k.shape[2], k.shape[1]
  if hq % hk:
    raise ValueError(f"q heads ({hq}) must be a multiple of kv heads ({hk})")
  if not (q.dtype == k.dtype == v.dtype):
    raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  _check_dtype(q.dtype)
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("q_segment_ids and kv_segment_ids must be given together")
  if q_segment_ids is not None and (q_segment_ids.shape != (b, sq)
                                    or kv_segment_ids.shape != (b, sk)):
    raise ValueError(f"segment ids must be [batch, len]: got {q_segment_ids.shape}, "
                     f"{kv_segment_ids.shape} for q {q.shape}, k {k.shape}")
  st = _static_config(q.shape, k.shape, q.dtype, causal=causal, scale=scale,
                      block_sizes=block_sizes, interpret=interpret,
                      bwd_block_sizes=bwd_block_sizes, local_window_size=local_window_size,
                      logits_soft_cap=logits_soft_cap, has_seg=q_segment_ids is not None,
                      schedule=schedule)
  return _forward(q, k, v, q_segment_ids, kv_segment_ids, schedule, st)


# ----------------------------------------------------------------------------------------------
# GPU benchmark helper (one process: this kernel's configs and jax.nn's cuDNN forward)
# ----------------------------------------------------------------------------------------------


def _visible_ranges(seq: int, causal: bool, window):
  """(lo, hi): each query's visible keys [lo, hi] of a self-attention mask of length ``seq``
  (numpy int64 [seq]; hi < lo when none)."""
  import numpy as np
  i = np.arange(seq)
  hi = i if causal else np.full(seq, seq - 1)
  lo = np.zeros(seq, np.int64)
  if window is not None:
    left, right = window
    if left is not None:
      lo = np.maximum(lo, i - left)
    if right is not None:
      hi = np.minimum(hi, i + right)
  return lo, hi


def _visible_pairs(seq: int, causal: bool, window) -> int:
  """Visible (query, key) pairs of a self-attention mask of length ``seq`` (numpy, exact)."""
  lo, hi = _visible_ranges(seq, causal, window)
  return int((hi - lo + 1).clip(0).sum())


def _sweep(batch: int = 2, seq: int = 16384, q_heads: int = 16, kv_heads: int = 16,
           head_dim: int = 128, *, causal: bool = False, local_window_size=None,
           docs: int | None = None, dtype=jnp.bfloat16, configs=None, iters: int | None = None,
           verbose: bool = True):
  """Time the forward for each config and jax.nn's cuDNN forward on the same problem (GPU only).

  TFLOP/s = 4 * B * Hq * D * (visible query-key pairs) / time: S^2 non-causal, S(S+1)/2
  causal, fewer with a window; with ``docs``, ``docs`` packed causal documents of S / docs
  tokens per row (segment ids 1..docs), whose pairs are docs * n(n+1)/2. Timed as
  ``experiments/bench_kernels.py`` times (``pallas_kernels._timing.time_fn``: async loops
  rotating 3 distinct random input sets, median of 3 loops), cuDNN's row too.

  Args:
    batch, seq, q_heads, kv_heads, head_dim: problem size (self-attention).
    causal: causal mask.
    local_window_size: None, int or (left, right) (a causal window of 512 is (511, 0)); cuDNN
      gets the same window.
    docs: None, or the number of packed documents per row (causal, segment ids): cuDNN has no
      segment ids, so its row times ``batch * docs`` separate causal rows of ``seq // docs``
      (the work the packed kernel should match, as ``experiments/bench_kernels.py``'s packed
      case) and the outputs are compared on that layout.
    dtype: bf16 or fp16.
    configs: list of ``BlockSizes`` (default: the default, a few neighbours and the options of
      docs/mosaic_fwd_vs_tokamax.md; ``q_tiles_per_program`` is not among them: pass e.g.
      ``dataclasses.replace(base, q_tiles_per_program=4)``, as
      experiments/gpu_sessions/next_gpu_session_n.sh does for a causal window).
    iters: calls per timed loop (``time_fn``; None: enough for 0.25 s).
    verbose: print one line per row.

  Returns:
    A list of dicts: name, ms, tflops, max_abs_diff_vs_cudnn (or error).

  Example:
    >>> rows = _sweep(causal=True, local_window_size=(511, 0))  # doctest: +SKIP
    >>> rows = _sweep(docs=4)  # doctest: +SKIP
  """
  from pallas_kernels.masks import normalize_window
  window = normalize_window(local_window_size)
  if docs is not None:
    if seq % docs:
      raise ValueError(f"seq ({seq}) must be a multiple of docs ({docs})")
    causal = True
  if configs is None:
    from pallas_kernels.tuning import mask_kind
    base = default_block_sizes(head_dim, dtype, mask=mask_kind(causal, window,
                                                               segments=docs is not None))
    base = fit_block_sizes(base, (batch, seq, q_heads, head_dim),
                           (batch, seq, kv_heads, head_dim), causal=causal, window=window,
                           segments=docs is not None)
    def variant(**kw):   # None: a combination BlockSizes rejects (e.g. the fence with overlap)
      try:
        return dataclasses.replace(base, **kw)
      except ValueError:
        return None
    configs = [base, variant(softmax_fence=not base.softmax_fence), variant(pingpong=False),
               variant(num_stages=base.num_stages + 1), variant(block_k=64)]
    # the options of docs/mosaic_fwd_vs_tokamax.md: each alone (3 stages with the reduction
    # reserve off: fits at D128), the ping-pong hand-over (new barrier protocol) late, then all
    configs += [variant(early_k_load=True), variant(q_major_grid=True),
                variant(no_reduction_scratch=True),
                variant(no_reduction_scratch=True, num_stages=base.num_stages + 1),
                variant(pingpong_handoff=base.pingpong), variant(k_wait_in_pv=True),
                variant(k_wait_in_pv=True, pingpong_handoff=base.pingpong),
                variant(early_k_load=True, pingpong_handoff=base.pingpong, q_major_grid=True,
                        no_reduction_scratch=True, num_stages=base.num_stages + 1,
                        k_wait_in_pv=True)]
    # FlashAttention-3's intra-warpgroup overlap on or off (the H200 default at D128 / D256
    # dense and causal, runs 55-56)
    if base.overlap_softmax:   # without it, several query tiles per program take neither the
      one = base.q_tiles_per_program == 1          # K wait in PV nor the ping-pong hand-over
      configs.append(variant(overlap_softmax=False, early_k_load=False, k_wait_in_pv=one,
                             pingpong_handoff=base.pingpong_handoff and one))
    else:
      configs.append(variant(overlap_softmax=True, pingpong_handoff=base.pingpong,
                             early_k_load=True, k_wait_in_pv=False, softmax_fence=False))
    configs = [c for c in configs if c is not None]
    configs = list(dict.fromkeys(configs))   # e.g. block_k=64 is already the window's base
  from pallas_kernels._timing import random_sets, timed
  kv_shape = (batch, seq, kv_heads, head_dim)
  sets = random_sets([(batch, seq, q_heads, head_dim), kv_shape, kv_shape], dtype)
  timeit = lambda fn: timed(jax.jit(fn), sets, iters=iters)
  seg = None
  if docs is None:
    pairs = _visible_pairs(seq, causal, window)
  else:
    n = seq // docs
    pairs = docs * _visible_pairs(n, True, window)
    seg = jnp.broadcast_to(jnp.repeat(jnp.arange(1, docs + 1, dtype=jnp.int32), n), (batch, seq))
  flops = 4.0 * batch * q_heads * head_dim * pairs

  cudnn = functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                            local_window_size=window, implementation="cudnn")
  name = "jax_nn_cudnn"
  if docs is not None:   # docs separate causal rows of n tokens
    split = lambda x: x.reshape(batch * docs, n, *x.shape[2:])
    cudnn = lambda q, k, v, f=cudnn: f(split(q), split(k), split(v)).reshape(q.shape)
    name = f"jax_nn_cudnn ({batch * docs} separate causal rows of {n})"
  ref, ref_ms = timeit(cudnn)
  rows = [dict(name=name, ms=ref_ms, tflops=flops / ref_ms * 1e-9)]
  if verbose:   # each row as it finishes: a call cut by a timeout still reports what ran
    print(rows[0], flush=True)
  for cfg in configs:
    row = dict(name=f"mosaic_gpu {cfg}")
    try:
      out, ms = timeit(lambda q, k, v, cfg=cfg: flash_attention(
          q, k, v, seg, seg, causal=causal, local_window_size=window, block_sizes=cfg)[0])
      row.update(ms=ms, tflops=flops / ms * 1e-9, max_abs_diff_vs_cudnn=float(
          jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32)))))
    except Exception as e:  # a config that does not compile is reported, not fatal
      row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    rows.append(row)
    if verbose:
      print(row, flush=True)
  return rows
