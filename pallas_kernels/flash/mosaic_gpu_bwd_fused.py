"""Fused flash attention backward for Hopper (sm90), Pallas Mosaic GPU: dQ inside the dK/dV kernel.

STATUS: v1 (the defaults) GPU-verified on the H200 in runs 27-28: all 12 GPU tests pass, no
hang; 22.36 ms non-causal / 12.05 ms causal at B2 S16K H16 D128 bf16 (two-kernel 23.13 / 11.26,
cuDNN 21.14 / 10.37), ptxas: register spills (140 / 204 B non-causal, 436 / 500 B causal) and
``warpgroup.arrive`` injected around the register-operand wgmmas. Not the default backward.
v2 (``FusedOptions``: ``pipelined``, ``lean``, ``memory_registers``; candidate ``V2_OPTIONS``
with ``compute_registers=240``): run 31 on the H200, its 5 GPU tests pass (no hang) but no
variant is faster (v2 24.55 / 11.72 ms, pipelined 27.21 / 13.99, lean 23.18 / 12.43 against
the two-kernel 23.44 / 11.74) and every variant still spills (docs/kernels.md, "Fused
backward").
With default options the kernel's Mosaic module is unchanged from the GPU-verified v1.
CPU checks (tests/test_flash_mosaic_gpu_bwd_fused.py): the kernel lowers for "cuda"
(``jax.export``: register layouts, wgmma/TMA constraints, the shared-memory budget); a jnp
replay of the kernel (same programs, warpgroup tiles, loop ranges, masks, GQA walk, per-step dQ
contributions added in the kernel's order) through this module's wrapper matches ``jax.vjp`` of
the fp32 reference; the protocol of the exchange barriers, simulated with random warpgroup
interleavings, neither deadlocks nor lets a warpgroup overwrite a dS buffer the other one still
reads. GPU session script: ``bash experiments/mosaic_gpu_bwd_fused_session.sh`` (ptxas per
variant, GPU tests, then ``_sweep_bwd_fused`` non-causal and causal). Not wired into
``jattn`` or the Mosaic forward's custom_vjp (which use ``mosaic_gpu_bwd``).

Why: ``mosaic_gpu_bwd`` (the default, GPU-verified) runs two kernels: dK/dV (per kv tile,
recomputes S^T and dP^T: 4 matmuls) and dQ (per q tile, recomputes S and dP again: 3 matmuls),
7 matmuls where the usual FLOP count of a backward has 5 (2.5x the forward). Measured on the
H200 at B2 S16K H16 D128 bf16: 23.0 ms = 477 "effective" TFLOP/s = 668 real TFLOP/s, ~97% of the
~688 TFLOP/s matmul ceiling, so the two-kernel design is capped at ~491 effective while cuDNN
reaches 524-537. FlashAttention-3's layout does 5: one kernel per kv tile that also produces
each query tile's dQ contribution and adds it to a global fp32 dQ.

``flash_attention_bwd(q, k, v, out, lse, do)`` has ``mosaic_gpu_bwd.flash_attention_bwd``'s
signature and results. Steps:

  1. delta, lse2 and padding as ``mosaic_gpu_bwd`` (``_prepare``), plus an fp32 dQ buffer of
     zeros [B, Sq', Hq, D] passed to the kernel as a mutable ``jax.Ref`` (aliased in and out of
     the custom call).
  2. One kernel, grid (batch, kv head, kv tile of ``2 * block_k_dkv`` keys): kv tiles vary
     fastest (Mosaic GPU maps the last grid axis to blockIdx.x) so that the CTAs running
     together are one head's kv tiles, reduce-adding into the same dQ rows (L2 locality: a
     head's fp32 dQ is 8 MiB at S16K D128). Warpgroups as the dK/dV kernel of ``mosaic_gpu_bwd``: compute warpgroups
     0 and 1 own ``block_k_dkv`` keys each (K/V in shared memory, dK/dV in fp32 registers), the
     memory warpgroup streams Q, dO, lse2, delta per (query head of the GQA group, query tile)
     through a ring of ``num_stages_dkv`` slots. Per step, each compute warpgroup:
       S^T = K Q^T, dP^T = V dO^T (one wgmma group); P^T = exp2(S^T c - lse2);
       dS^T = P^T (dP^T - delta); stores dS^T (input dtype) to its half of a [2 x block_k_dkv,
       block_q_dkv] shared buffer (two of them, alternating by step parity), arrives on that
       parity's exchange barrier (2 arrivals);
       issues dV += P^T dO, dK += dS^T Q (register A operands), waits on the exchange barrier,
       then issues dQ_w = dS[q, all 2 x block_k_dkv keys] @ K[keys, columns of half w of D]
       (A: the shared dS^T transposed, B: both warpgroups' K tiles, columns w*D/2..(w+1)*D/2):
       a [block_q_dkv, D/2] fp32 tile (32 registers per thread at 64 rows, D128);
       frees the ring slot, waits until its previous dQ reduce-add has read its fp32 staging
       tile (``wait_smem_to_gmem(0, wait_read_only=True)``), stores dQ_w * scale there and
       issues the TMA reduce-add ``copy_smem_to_gmem(..., reduction_op="add")`` into the dQ
       buffer's rows of that query tile and head, columns of half w.
     Both warpgroups walk the same steps (the exchange needs both dS halves): on the causal
     diagonal a warpgroup whose keys see none of a query tile runs it masked (P = 0) instead of
     draining it as the two-kernel dK/dV kernel does (at most one extra tile per head and
     program at 64-row tiles). Double-buffered dS: a warpgroup rewrites the buffer of parity p
     at step j + 2 only after passing step j + 1's exchange barrier, i.e. after the other
     warpgroup finished step j (its dQ wgmma read of that buffer included). At the end both
     warpgroups meet on a ``done`` barrier before overwriting their K tile with dK (the other
     warpgroup's last dQ wgmma reads it).
  3. dq = dQ buffer sliced and cast to the input dtype (XLA).

NONDETERMINISM: dQ is a sum of fp32 reduce-adds from the kv-tile programs in whatever order
they reach L2, so dq may differ in the last bits between runs (dk and dv are deterministic).

Masks and padding: q is padded to a multiple of ``block_q_dkv`` and kv to ``2 * block_k_dkv``
(zeros; lse2 = +inf and delta = 0 on padded rows, so their P and dS are 0). Causal is aligned
bottom-right, tiles on the diagonal get the element mask (the two-kernel dK/dV ranges). Unlike
the dK/dV kernel, padded keys must be masked too (their dS would reach the real rows' dQ through
zero K rows: 0 * P, NaN if P overflowed): in the last program, when kv_len is not a multiple of
``2 * block_k_dkv``, every step is masked.

Supported: bf16/fp16, head_dim 128 and 64 (256 raises NotImplementedError, as in
``mosaic_gpu_bwd``), block_q_dkv == block_k_dkv == 64 (a 128-row query tile's S^T and dP^T
would not fit in registers next to dK/dV at D128), causal or not, GQA, ragged lengths, an LSE
cotangent. The dQ wgmma slices K's columns by warpgroup, so half of D must be whole swizzle
tiles, and wgmma wants one swizzle on both operands: every 16-bit buffer is swizzled 128 B at
D128 and 64 B at D64 (32 columns). Shared memory at D128 (the lowering's count, barriers and
alignment included): 198,872 bytes with 2 stages (own K/V 64 KiB, Q/dO ring 64 KiB, dS exchange
32 KiB, dQ staging 32 KiB fp32, lse/delta), 231,640 with 3 (just under the 232,448 limit), 4 do
not fit.

Registers per compute thread (D128; a [64, 64] fp32 tile is 32 registers, a 16-bit one 16, a
per-query vector of the transposed tile 16, a per-key vector 2): dK + dV accumulators 128 fp32
throughout. v1, softmax phase: S^T and dP^T 64 plus lse2 or delta 16 = 208, plus two [64, 64]
int32 iota tiles (64) in masked steps; wgmma phase: P^T and dS^T operands 32 plus the dQ
half-tile 32 = 192; against 232 (setmaxnreg) minus addresses, indices and descriptors; ptxas
spilled. v2 ``lean``: the S^T/dP^T accumulators start at -lse2/c and -delta, so the vectors
die before the wgmmas (softmax phase 192), the mask uses a key and a query vector (2 + 16), P^T
is cast before the dS^T store; ``memory_registers=24`` with ``compute_registers=240`` adds 8.
v2 ``pipelined`` does not raise the peak (the dQ tile of step j - 1 lives only in step j's
wgmma phase, where v1's lived). Spills are not visible on the CPU.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import compat
from pallas_kernels.flash import mosaic_gpu_bwd as mb
from pallas_kernels.flash.mosaic_gpu import check_register_split
from pallas_kernels.flash.mosaic_gpu_bwd import BlockSizes

_COMPUTE_WGS = mb._COMPUTE_WGS
_FUSED_HEAD_DIMS = (64, 128)
_PIPELINED_DS_BUFFERS = 4       # dS exchange buffers of the pipelined ordering (see FusedOptions)


@dataclasses.dataclass(frozen=True)
class FusedOptions:
  """Variants of the fused kernel (v2; GPU tests pass, none faster than v1: run 31).

  Attributes:
    pipelined: FlashAttention-3's ordering of the exchange. Step j issues dV += P^T dO and
      dK += dS^T Q of step j, then waits for the other warpgroup's dS^T of step j - 1 (stored a
      whole step earlier, so the wait is normally already satisfied) and issues step j - 1's dQ
      wgmmas into the same wgmma group; the dQ reduce-add of step j - 1 follows. The last step's
      dQ is issued after the loop. The warpgroups may then drift up to about a step apart (one's
      softmax overlaps the other's wgmmas) instead of meeting before every dQ. Needs 4 dS^T
      buffers (a warpgroup rewrites buffer j mod 4 at step j; the other warpgroup's last read of
      it, step j - 4's dQ, ended in its step j - 3, which finished before it arrived for step
      j - 2, which this warpgroup waited for in step j - 1): 32 KiB more shared memory, so 2
      ring stages only (231,640 bytes at D128).
    lean: fewer live registers in the softmax phase: the causal/padding mask compares a
      per-thread key vector (2 values) with a query vector (16 values), broadcast, instead of
      two [64, 64] int32 iota tiles (32 registers each); P^T is cast to the input dtype right
      after dS^T is formed (the fp32 P^T dies before the dS^T store and the barrier arrive, not
      inside the wgmma group).
    memory_registers: ``setmaxnreg`` of the memory warpgroup (40 in v1). 24 (FA3's producer
      value) leaves room for ``compute_registers=240`` (2 x 240 + 24 <= 512 per warp slot).

  Example:
    >>> FusedOptions().pipelined
    False
  """
  pipelined: bool = False
  lean: bool = False
  memory_registers: int = 40

  @property
  def ds_buffers(self) -> int:
    return _PIPELINED_DS_BUFFERS if self.pipelined else 2


# The v2 candidate timed next to v1 by ``_sweep_bwd_fused`` (with ``V2_BLOCK_SIZES``).
V2_OPTIONS = FusedOptions(pipelined=True, lean=True, memory_registers=24)


def default_block_sizes(head_dim: int = 128, dtype=jnp.bfloat16) -> BlockSizes:
  """Block sizes of the fused kernel (untuned; only the dK/dV fields and compute_registers are
  used).

  Args:
    head_dim: the head dimension of q, k and v (64 or 128).
    dtype: the input dtype (only checked).

  Returns:
    A ``mosaic_gpu_bwd.BlockSizes`` with 64 x 64 tiles and a 2-slot ring.

  Example:
    >>> default_block_sizes(128).num_stages_dkv
    2
  """
  mb._check_dtype(dtype)
  _check_head_dim(head_dim)
  return BlockSizes(block_q_dkv=64, block_k_dkv=64, num_stages_dkv=2, compute_registers=232)


def _check_head_dim(d):
  if d not in _FUSED_HEAD_DIMS:
    raise NotImplementedError(
        f"the fused Mosaic GPU flash attention backward supports head_dim 128, got head_dim {d} "
        f"(use mosaic_gpu_bwd.flash_attention_bwd)")


def _check_block_sizes(bs: BlockSizes):
  if bs.block_k_dkv != 64:
    raise NotImplementedError(f"the fused backward needs block_k_dkv == 64, got {bs.block_k_dkv}")
  if bs.block_q_dkv != 64:
    raise NotImplementedError(f"the fused backward needs block_q_dkv == 64 (a 128-row tile's S^T "
                              f"and dP^T would not fit in registers at D128), got "
                              f"{bs.block_q_dkv}")


def _check_options(opts: FusedOptions, bs: BlockSizes):
  """setmaxnreg values: multiples of 8 in [24, 256], and the three warpgroups within the CTA's
  launch allocation (3 x 168 = 504 registers per thread slot at 384 threads)."""
  check_register_split(bs.compute_registers, opts.memory_registers)


def _static_config(q_shape, k_shape, dtype, *, causal, scale, block_sizes) -> mb._Static:
  """``mosaic_gpu_bwd._Static`` with the fused kernel's padding (q to block_q_dkv, kv to
  2 * block_k_dkv)."""
  d = q_shape[3]
  _check_head_dim(d)
  bs = block_sizes or default_block_sizes(d, dtype)
  _check_block_sizes(bs)
  st = mb._static_config(q_shape, k_shape, dtype, causal=causal, scale=scale, block_sizes=bs)
  lq, lk = bs.block_q_dkv, bs.keys_per_dkv_program
  return dataclasses.replace(st, q_pad=-(-st.q_len // lq) * lq, kv_pad=-(-st.kv_len // lk) * lk)


def _ragged_keys(st: mb._Static) -> bool:
  """Whether the last program holds padded keys (then all its steps are masked)."""
  return st.kv_len % st.bs.keys_per_dkv_program != 0


def _fused_q_range(prog, k0, st: mb._Static):
  """Steps of the warpgroup with keys [k0, k0 + block_k_dkv) in program ``prog``: (first,
  full) int32; query tiles [first, full) masked, [full, nq) unmasked, where ``first`` is the
  program's first tile (shared by both warpgroups, so that they walk the same steps)."""
  first_program, _ = mb._dkv_q_range(prog * st.bs.keys_per_dkv_program, st)
  _, full = mb._dkv_q_range(k0, st)
  full = jnp.maximum(full, first_program)
  if _ragged_keys(st):
    full = jnp.where(prog == st.num_dkv_programs - 1, jnp.int32(st.num_q_tiles_dkv), full)
  return first_program, full


def _lean_acc_init(lse2, delta, shape, st: mb._Static):
  """``FusedOptions(lean=True)``: initial S^T and dP^T accumulators [bk, bq] from the per-query
  lse2 and delta: -lse2 / c and -delta broadcast along the keys (lse2 = +inf on padded and
  empty rows: -inf, so P = 0 there)."""
  return (lax.broadcast_in_dim(lse2 * (-1.0 / st.c), shape, [1]),
          lax.broadcast_in_dim(-delta, shape, [1]))


def _lean_probs(s_acc, st: mb._Static):
  """P^T = exp2(c (S^T - lse2 / c)) from the lean S^T accumulator."""
  return jnp.exp2(s_acc * st.c)


def _fused_visible(rows, cols, k0, i, st: mb._Static):
  """Element mask of a masked step on the transposed [bk, bq] tile (rows = keys, cols =
  queries): real keys, and the causal diagonal when causal."""
  vis = rows + k0 < st.kv_len
  if st.causal:
    vis = jnp.logical_and(vis, mb._dkv_visible(rows, cols, k0, i, st))
  return vis


def _tile_of_step(j, *, first_program, per_head):
  """Ring step j of a program -> (GQA head g, query tile i): the pipelined dQ's target (step
  j - 1's tile), as the memory warpgroup's walk."""
  g = lax.div(j, jnp.maximum(per_head, 1))
  return g, first_program + (j - g * per_head)


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


def _fused_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dk_ref, dv_ref, smem,
                  own_loaded, q_loaded, do_loaded, lse_loaded, delta_loaded, free, ds_ready,
                  done, *, st: mb._Static, opts: FusedOptions = FusedOptions()):
  """Refs: q/do [B, Sq', Hq, D], k/v [B, Sk', Hk, D], lse2/delta [B, Hq, Sq'] fp32, dq [B, Sq',
  Hq, D] fp32 (zeros in, sums out) -> dk/dv [B, Sk', Hk, D]. Scratch: smem = (k_own [2, bk, D],
  v_own [2, bk, D], q [S, bq, D], do [S, bq, D], lse2 [S, bq], delta [S, bq], ds [2 parities,
  2 wgs, bk, bq], dq staging [2 wgs, bq, D/2] fp32); barriers own_loaded [2 wgs x (k, v)],
  q/do/lse/delta_loaded [S], free [S] (2 arrivals), ds_ready [2 parities] (2 arrivals), done
  (2 arrivals). With ``opts.pipelined``: 4 dS^T buffers and 4 ds_ready barriers (by ring step
  mod 4), and the dQ of ring step j - 1 is issued in step j's dV/dK wgmma group."""
  k_own, v_own, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem = smem
  bq, bk = st.bs.block_q_dkv, st.bs.block_k_dkv
  stages = st.bs.num_stages_dkv
  nq = st.num_q_tiles_dkv
  dcols = st.head_dim // _COMPUTE_WGS
  b = lax.axis_index("batch")
  kv_h = lax.axis_index("heads")
  prog = lax.axis_index("kv_tiles")
  wg = lax.axis_index("wg")
  k0_program = prog * (_COMPUTE_WGS * bk)
  first_program, _ = mb._dkv_q_range(k0_program, st)
  per_head = nq - first_program                           # ring steps per query head (>= 1)
  total = st.group * per_head
  slot_of = lambda j: lax.rem(j, jnp.int32(stages))
  nbuf = opts.ds_buffers
  buf_of = lambda j: lax.rem(j, jnp.int32(nbuf))

  tile_of = functools.partial(_tile_of_step, first_program=first_program, per_head=per_head)

  @pl.when(wg < _COMPUTE_WGS)
  def _compute():
    plgpu.set_max_registers(st.bs.compute_registers, action="increase")
    k0 = k0_program + wg * bk
    col0 = pl.multiple_of(wg * dcols, dcols)
    kt, vt = k_own.at[wg], v_own.at[wg]                   # [bk, D]
    plgpu.copy_gmem_to_smem(k_ref.at[b, pl.ds(k0, bk), kv_h], kt, own_loaded.at[2 * wg])
    plgpu.copy_gmem_to_smem(v_ref.at[b, pl.ds(k0, bk), kv_h], vt, own_loaded.at[2 * wg + 1])
    _, full = _fused_q_range(prog, k0, st)
    wgmma_layout = plgpu.Layout.WGMMA
    col_layout = plgpu.Layout.WGMMA.reduce(0)              # one value per query (column)
    row_layout = plgpu.Layout.WGMMA.reduce(1)              # one value per key (row)
    zeros = lambda shape: plgpu.layout_cast(jnp.full(shape, 0.0, jnp.float32), wgmma_layout)
    dk = zeros((bk, st.head_dim))
    dv = zeros((bk, st.head_dim))
    plgpu.barrier_wait(own_loaded.at[2 * wg])
    plgpu.barrier_wait(own_loaded.at[2 * wg + 1])

    def dq_gemms(dq_acc, buf):                            # dQ_w = dS K[:, half w] over all keys
      for w in range(_COMPUTE_WGS):
        plgpu.wgmma(dq_acc, ds_smem.at[buf, w].transpose((1, 0)),
                    k_own.at[w, :, pl.ds(col0, dcols)])

    def dq_reduce_add(dq, g, i):                          # dQ of (head g, q tile i) -> GMEM (+=)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)     # last reduce-add has read the staging
      dq_smem.at[wg][...] = dq * st.scale
      plgpu.commit_smem()
      h = kv_h * st.group + g
      plgpu.copy_smem_to_gmem(dq_smem.at[wg], dq_ref.at[b, pl.ds(i * bq, bq), h,
                                                        pl.ds(col0, dcols)],
                              reduction_op="add")
    # The other warpgroup's K tile is read by this warpgroup's dQ wgmmas.
    plgpu.barrier_wait(own_loaded.at[2 * (1 - wg)])
    if opts.pipelined:                                    # "step -1" of buffer nbuf - 1: both
      plgpu.barrier_arrive(ds_ready.at[nbuf - 1])         # arrive, step 0 waits

    def step(i, carry, *, g, base, masked):
      dk, dv = carry
      j = base + i                                        # ring step
      slot = slot_of(j)
      par = lax.rem(j, jnp.int32(2)) if not opts.pipelined else buf_of(j)
      qs, dos = q_smem.at[slot], do_smem.at[slot]         # [bq, D]
      plgpu.barrier_wait(q_loaded.at[slot])
      plgpu.barrier_wait(do_loaded.at[slot])

      def st_dpt_gemm(refs):                              # S^T = K Q^T; dP^T = V dO^T [bk, bq]
        st_ref, dpt_ref = refs
        plgpu.wgmma(st_ref, kt, qs.transpose((1, 0)))
        plgpu.wgmma(dpt_ref, vt, dos.transpose((1, 0)))
      if opts.lean:
        # The accumulators start at -lse2 / c and -delta (per query, broadcast), so that
        # P^T = exp2(c acc_s) and dS^T = P^T acc_dp: the lse2/delta vectors (16 registers
        # each) die before the wgmmas are issued instead of living in the softmax phase.
        plgpu.barrier_wait(lse_loaded.at[slot])
        plgpu.barrier_wait(delta_loaded.at[slot])
        init_s, init_dp = _lean_acc_init(
            compat.mosaic_gpu_load(lse_smem.at[slot], layout=col_layout),
            compat.mosaic_gpu_load(delta_smem.at[slot], layout=col_layout), (bk, bq), st)
        s_acc, dp_acc = pl.run_state(st_dpt_gemm)((plgpu.ACC.init(init_s),
                                                   plgpu.ACC.init(init_dp)))
        p_t = _lean_probs(s_acc, st)
        if masked:                                        # [bk] + [bq] vectors, broadcast
          rows = lax.broadcast_in_dim(
              plgpu.broadcasted_iota(jnp.int32, (bk,), 0, layout=row_layout), (bk, bq), [0])
          cols = lax.broadcast_in_dim(
              plgpu.broadcasted_iota(jnp.int32, (bq,), 0, layout=col_layout), (bk, bq), [1])
          p_t = jnp.where(_fused_visible(rows, cols, k0, i, st), p_t, 0.0)
        ds_t = (p_t * dp_acc).astype(st.dtype)
        p_t = p_t.astype(st.dtype)                        # the fp32 P^T dies here
      else:
        s_t, dp_t = pl.run_state(st_dpt_gemm)((plgpu.ACC.init(zeros((bk, bq))),
                                               plgpu.ACC.init(zeros((bk, bq)))))
        plgpu.barrier_wait(lse_loaded.at[slot])
        lse2 = compat.mosaic_gpu_load(lse_smem.at[slot], layout=col_layout)
        p_t = mb._probs(s_t, lse2, st, axis=1)
        if masked:
          rows = plgpu.broadcasted_iota(jnp.int32, (bk, bq), 0, layout=wgmma_layout)
          cols = plgpu.broadcasted_iota(jnp.int32, (bk, bq), 1, layout=wgmma_layout)
          p_t = jnp.where(_fused_visible(rows, cols, k0, i, st), p_t, 0.0)
        plgpu.barrier_wait(delta_loaded.at[slot])
        delta = compat.mosaic_gpu_load(delta_smem.at[slot], layout=col_layout)
        ds_t = mb._dscores(p_t, dp_t, delta, axis=1).astype(st.dtype)
      ds_smem.at[par, wg][...] = ds_t                     # this warpgroup's keys of dS^T
      plgpu.commit_smem()                                 # visible to the async proxy (wgmma)
      plgpu.barrier_arrive(ds_ready.at[par])

      if opts.pipelined:
        prev = buf_of(j + (nbuf - 1))                     # buffer of ring step j - 1

        def grad_gemms(refs):                             # dV += P^T dO; dK += dS^T Q; dQ_{j-1}
          dv_ref, dk_ref, dq_ref_acc = refs
          plgpu.wgmma(dv_ref, p_t.astype(st.dtype), dos)
          plgpu.wgmma(dk_ref, ds_t, qs)
          # Step 0 waits for the prologue's arrivals; its dQ wgmma reads an unwritten buffer
          # and is discarded (no reduce-add): no branch inside the wgmma group.
          plgpu.barrier_wait(ds_ready.at[prev])
          dq_gemms(dq_ref_acc, prev)
        dv, dk, dq = pl.run_state(grad_gemms)((plgpu.ACC.init(dv), plgpu.ACC.init(dk),
                                               plgpu.ACC.init(zeros((bq, dcols)))))
        plgpu.barrier_arrive(free.at[slot])

        @pl.when(j > 0)
        def _():
          dq_reduce_add(dq, *tile_of(j - 1))
        return dk, dv

      def grad_gemms(refs):                               # dV += P^T dO; dK += dS^T Q; dQ_w
        dv_ref, dk_ref, dq_ref_acc = refs
        plgpu.wgmma(dv_ref, p_t.astype(st.dtype), dos)
        plgpu.wgmma(dk_ref, ds_t, qs)
        plgpu.barrier_wait(ds_ready.at[par])              # both halves of dS^T stored
        for w in range(_COMPUTE_WGS):                     # dQ_w = dS K[:, half w] over all keys
          plgpu.wgmma(dq_ref_acc, ds_smem.at[par, w].transpose((1, 0)),
                      k_own.at[w, :, pl.ds(col0, dcols)])
      dv, dk, dq = pl.run_state(grad_gemms)((plgpu.ACC.init(dv), plgpu.ACC.init(dk),
                                             plgpu.ACC.init(zeros((bq, dcols)))))
      plgpu.barrier_arrive(free.at[slot])
      dq_reduce_add(dq, g, i)
      return dk, dv

    def head(g, carry):
      base = g * per_head - first_program                 # ring step of query tile i: base + i
      carry = lax.fori_loop(first_program, full,
                            functools.partial(step, g=g, base=base, masked=True), carry)
      return lax.fori_loop(full, nq, functools.partial(step, g=g, base=base, masked=False),
                           carry)

    dk, dv = lax.fori_loop(0, st.group, head, (dk, dv))
    if opts.pipelined:                                    # the last step's dQ (total >= 1)
      last = total - 1
      plgpu.barrier_wait(ds_ready.at[buf_of(last)])

      def last_dq_gemm(dq_acc):
        dq_gemms(dq_acc, buf_of(last))
      dq_reduce_add(pl.run_state(last_dq_gemm)(plgpu.ACC.init(zeros((bq, dcols)))),
                    *tile_of(last))
    plgpu.barrier_arrive(done)                            # the other warpgroup's last dQ wgmma
    plgpu.barrier_wait(done)                              # has read this K tile
    kt[...] = (dk * st.scale).astype(st.dtype)            # K/V are dead: reuse them for dK/dV
    vt[...] = dv.astype(st.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(kt, dk_ref.at[b, pl.ds(k0, bk), kv_h])
    plgpu.copy_smem_to_gmem(vt, dv_ref.at[b, pl.ds(k0, bk), kv_h])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == _COMPUTE_WGS)
  def _memory():
    plgpu.set_max_registers(opts.memory_registers, action="decrease")

    def load(j, slot):
      g = lax.div(j, jnp.maximum(per_head, 1))
      i = first_program + (j - g * per_head)
      h = kv_h * st.group + g
      rows = pl.ds(i * bq, bq)
      plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem.at[slot], q_loaded.at[slot])
      plgpu.copy_gmem_to_smem(lse_ref.at[b, h, rows], lse_smem.at[slot], lse_loaded.at[slot])
      plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_smem.at[slot], do_loaded.at[slot])
      plgpu.copy_gmem_to_smem(delta_ref.at[b, h, rows], delta_smem.at[slot],
                              delta_loaded.at[slot])

    for s in range(stages):                               # fill the ring
      @pl.when(s < total)
      def _():
        load(jnp.int32(s), s)

    @pl.loop(stages, jnp.maximum(total, stages))
    def _(j):
      slot = slot_of(j)
      plgpu.barrier_wait(free.at[slot])
      load(j, slot)


def _fused_call(q, k, v, do, lse2, delta, st: mb._Static, opts: FusedOptions = FusedOptions()):
  """Padded q/do [B, Sq', Hq, D], k/v [B, Sk', Hk, D], lse2/delta [B, Hq, Sq'] -> (dq [B, Sq',
  Hq, D] fp32 sums (scaled), dk, dv [B, Sk', Hk, D] in the input dtype; rows of padded keys
  garbage).

  The CPU tests substitute this function (monkeypatch) with a jnp replay of the kernel."""
  b, sq_pad, hq, d = q.shape
  _, _, hk, _ = k.shape
  bq, bk, stages = st.bs.block_q_dkv, st.bs.block_k_dkv, st.bs.num_stages_dkv
  # 16-bit buffers: rows of D/2 columns must be whole swizzle tiles (the dQ wgmma slices K's
  # columns by warpgroup), and wgmma needs the same swizzle on both operands: 128 B at D128,
  # 64 B at D64, for every 16-bit buffer.
  swizzle = min(128, d // _COMPUTE_WGS * 2)
  tiled = (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))
  tiled32 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))  # 32 x fp32 = 128 B
  smem = (
      plgpu.SMEM((_COMPUTE_WGS, bk, d), k.dtype, transforms=tiled),     # own K, then dK
      plgpu.SMEM((_COMPUTE_WGS, bk, d), v.dtype, transforms=tiled),     # own V, then dV
      plgpu.SMEM((stages, bq, d), q.dtype, transforms=tiled),           # Q ring
      plgpu.SMEM((stages, bq, d), do.dtype, transforms=tiled),          # dO ring
      plgpu.SMEM((stages, bq), jnp.float32),                            # lse2 ring
      plgpu.SMEM((stages, bq), jnp.float32),                            # delta ring
      plgpu.SMEM((opts.ds_buffers, _COMPUTE_WGS, bk, bq), q.dtype,
                 transforms=tiled),                                     # dS^T exchange
      plgpu.SMEM((_COMPUTE_WGS, bq, d // _COMPUTE_WGS), jnp.float32,
                 transforms=tiled32),                                   # dQ staging
  )
  scratch = (
      smem,
      plgpu.Barrier(num_barriers=2 * _COMPUTE_WGS),                    # own_loaded
      plgpu.Barrier(num_barriers=stages),                              # q_loaded
      plgpu.Barrier(num_barriers=stages),                              # do_loaded
      plgpu.Barrier(num_barriers=stages),                              # lse_loaded
      plgpu.Barrier(num_barriers=stages),                              # delta_loaded
      plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages),   # free
      plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=opts.ds_buffers),  # ds_ready
      plgpu.Barrier(num_arrivals=_COMPUTE_WGS),                        # done
  )
  # The last grid axis is blockIdx.x (the fastest): kv tiles, so that the CTAs resident together
  # are one head's kv tiles, reduce-adding into the same dQ rows (L2 locality; causal: longest
  # programs first within each head).
  mesh = plgpu.Mesh(grid=(b, hk, st.num_dkv_programs), grid_names=("batch", "heads", "kv_tiles"),
                    num_threads=_COMPUTE_WGS + 1, thread_name="wg")

  def body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dk_ref, dv_ref):
    pl.run_scoped(
        functools.partial(_fused_kernel, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref,
                          dk_ref, dv_ref, st=st, opts=opts),
        *scratch, collective_axes="wg")

  dq_acc = jax.new_ref(jnp.zeros((b, sq_pad, hq, d), jnp.float32))
  dk, dv = pl.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
      mesh=mesh,
      compiler_params=plgpu.CompilerParams(approx_math=True),
      name="flash_bwd_fused_dq",
  )(q, k, v, do, lse2, delta, dq_acc)
  return dq_acc[...], dk, dv


# ----------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------


def flash_attention_bwd(q, k, v, out, lse, do, *, causal: bool = False,
                        scale: float | None = None, block_sizes: BlockSizes | None = None,
                        d_lse=None, options: FusedOptions | None = None):
  """Gradients of flash attention with the fused Mosaic GPU (Hopper) backward kernel.

  Same arguments and results as ``mosaic_gpu_bwd.flash_attention_bwd``, except: head_dim 64 or
  128, ``block_sizes`` must have block_q_dkv == block_k_dkv == 64 (its dQ-kernel fields are
  ignored), and dq is nondeterministic in its last bits (fp32 reduce-adds in arrival order).

  Args:
    q: [B, Sq, Hq, D], bf16 or fp16, D in (64, 128).
    k: [B, Sk, Hk, D]; Hq % Hk == 0 (query head h reads kv head h // (Hq // Hk)).
    v: [B, Sk, Hk, D].
    out: the forward's output [B, Sq, Hq, D].
    lse: the forward's log-sum-exp [B, Hq, Sq] fp32, natural log, -inf for rows that see no
      key.
    do: cotangent of out [B, Sq, Hq, D].
    causal: bottom-right aligned causal mask (must match the forward).
    scale: logit scale (None: 1 / sqrt(D)).
    block_sizes: ``BlockSizes`` (None: ``default_block_sizes(D)``).
    d_lse: optional cotangent of lse [B, Hq, Sq] (None: zero).
    options: ``FusedOptions`` (None: the GPU-verified v1 kernel; ``V2_OPTIONS`` with
      ``compute_registers=240`` is the CPU-verified v2 candidate).

  Returns:
    (dq [B, Sq, Hq, D], dk [B, Sk, Hk, D], dv [B, Sk, Hk, D]) in q.dtype; dq accumulated in an
    fp32 buffer by reduce-adds, dk/dv in fp32 registers and summed over each kv head's query
    heads. Rows that see no key get dq = 0.

  Example (on an H100/H200):
    >>> q = jax.random.normal(jax.random.key(0), (1, 1024, 8, 128), jnp.bfloat16)
    >>> from pallas_kernels.flash import mosaic_gpu
    >>> out, lse = mosaic_gpu.flash_attention(q, q, q, causal=True)  # doctest: +SKIP
    >>> dq, dk, dv = flash_attention_bwd(q, q, q, out, lse, out, causal=True)  # doctest: +SKIP
  """
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"q, k, v must be [batch, seq, heads, head_dim], got {q.shape}, {k.shape}, "
                     f"{v.shape}")
  b, sq, hq, d = q.shape
  if k.shape[0] != b or k.shape[3] != d or v.shape != k.shape:
    raise ValueError(f"q, k, v shapes do not agree: {q.shape}, {k.shape}, {v.shape}")
  if hq % k.shape[2]:
    raise ValueError(f"q heads ({hq}) must be a multiple of kv heads ({k.shape[2]})")
  if out.shape != q.shape or do.shape != q.shape:
    raise ValueError(f"out {out.shape} and do {do.shape} must have q's shape {q.shape}")
  if lse.shape != (b, hq, sq):
    raise ValueError(f"lse must be [batch, q_heads, q_len] = {(b, hq, sq)}, got {lse.shape}")
  if not (q.dtype == k.dtype == v.dtype == do.dtype):
    raise TypeError(f"q, k, v, do must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}, "
                    f"{do.dtype}")
  mb._check_dtype(q.dtype)
  st = _static_config(q.shape, k.shape, q.dtype, causal=causal, scale=scale,
                      block_sizes=block_sizes)
  opts = options or FusedOptions()
  _check_options(opts, st.bs)
  lse2, delta = mb._prepare(out, lse, do, d_lse, st)
  q_p, do_p = mb._pad_axis(q, 1, st.q_pad), mb._pad_axis(do, 1, st.q_pad)
  k_p, v_p = mb._pad_axis(k, 1, st.kv_pad), mb._pad_axis(v, 1, st.kv_pad)
  if opts == FusedOptions():                              # v1: the call as GPU-verified
    dq, dk, dv = _fused_call(q_p, k_p, v_p, do_p, lse2, delta, st)
  else:
    dq, dk, dv = _fused_call(q_p, k_p, v_p, do_p, lse2, delta, st, opts)
  return dq[:, :sq].astype(q.dtype), dk[:, :st.kv_len], dv[:, :st.kv_len]


# ----------------------------------------------------------------------------------------------
# GPU benchmark helper (one process: this backward, the two-kernel backward and jax.nn's cuDNN)
# ----------------------------------------------------------------------------------------------


def _default_sweep_configs(head_dim: int = 128, dtype=jnp.bfloat16):
  """(label, BlockSizes, FusedOptions) timed by ``_sweep_bwd_fused``: v1 (GPU-verified, 22.36 /
  12.05 ms in runs 27-28), each v2 change alone at v1's registers, both, and the v2 candidate
  (both + 240/24 registers). 3 stages are left out (27.2 ms in run 27; no room with the
  pipelined exchange's 4 dS buffers)."""
  base = default_block_sizes(head_dim, dtype)
  v2_bs = dataclasses.replace(base, compute_registers=240)
  return [("v1", base, FusedOptions()),
          ("v2=pipelined+lean+regs240/24", v2_bs, V2_OPTIONS),
          ("pipelined", base, FusedOptions(pipelined=True)),
          ("lean", base, FusedOptions(lean=True)),
          ("pipelined+lean", base, FusedOptions(pipelined=True, lean=True))]


def _sweep_bwd_fused(batch: int = 2, seq: int = 16384, q_heads: int = 16, kv_heads: int = 16,
                     head_dim: int = 128, *, causal: bool = False, dtype=jnp.bfloat16,
                     configs=None, iters: int | None = None, verbose: bool = True):
  """Time the fused backward against the two-kernel backward and cuDNN (GPU only).

  Rows: ``cudnn_fwd``, ``cudnn_fwd_bwd`` (jax.nn.dot_product_attention(implementation="cudnn")
  and its VJP), ``cudnn_bwd_est`` (their difference), ``two_kernel_bwd``
  (``mosaic_gpu_bwd.flash_attention_bwd`` with its default tiles), then per config
  ``fused_bwd`` (this backward alone) and, for the first config, ``fused_fwd_bwd`` and
  ``two_kernel_fwd_bwd`` (Mosaic forward + backward, to compare with ``cudnn_fwd_bwd``), and
  ``fused_fwd_bwd`` for the second config too (the v2 candidate by default). Rows are printed
  as they finish (a sweep cut by a timeout keeps its first rows). The
  backwards run on residuals of ``mosaic_gpu.flash_attention`` computed once outside the timing.
  TFLOP/s is "effective": 4 * B * Hq * D * pairs for a forward and 2.5x that for a backward (5
  matmuls), pairs = S^2 or S(S+1)/2 causal; the two-kernel backward really does 7 matmuls
  (``real_tflops`` = 7/5 x). Each row reports max |d - d_cudnn| over dq, dk, dv.

  Args:
    batch, seq, q_heads, kv_heads, head_dim: problem size (self-attention).
    causal: causal mask.
    dtype: bf16 or fp16.
    configs: list of ``BlockSizes`` or ``(label, BlockSizes, FusedOptions)`` (default:
      ``_default_sweep_configs``: v1 and the v2 variants, 2 stages).
    iters: calls per timed loop (``pallas_kernels._timing.time_fn``; None: enough for 0.25 s;
      3 random input sets, as ``mosaic_gpu_bwd._sweep_baseline``).
    verbose: print one line per row.

  Returns:
    A list of dicts: name, ms, tflops, max_abs_diff_vs_cudnn (or error).

  Example:
    >>> rows = _sweep_bwd_fused(causal=True)  # doctest: +SKIP
  """
  from pallas_kernels.flash import mosaic_gpu as mg

  if configs is None:
    configs = _default_sweep_configs(head_dim, dtype)
  configs = [c if isinstance(c, tuple) else (str(c), c, FusedOptions()) for c in configs]
  b = mb._sweep_baseline(batch, seq, q_heads, kv_heads, head_dim, causal=causal, dtype=dtype,
                         iters=iters)
  fwd_flops, bwd_flops, timeit, rows, diff = b.fwd_flops, b.bwd_flops, b.timeit, b.rows, b.diff
  if verbose:
    for row in rows:
      print(row, flush=True)

  def add(name, make, flops, real=1.0):
    row = dict(name=name)
    try:
      grads, ms = make()
      row.update(ms=ms, tflops=flops / ms * 1e-9, max_abs_diff_vs_cudnn=diff(grads))
      if real != 1.0:
        row["real_tflops"] = real * row["tflops"]
    except Exception as e:  # a config that does not compile is reported, not fatal
      row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    rows.append(row)
    if verbose:
      print(row, flush=True)

  def bwd_alone(fn):
    return timeit(lambda q, k, v, o, l, do: fn(q, k, v, o, l, do, causal=causal),
                  "q", "k", "v", "out", "lse", "do")

  def fwd_bwd(fn):
    def run(q, k, v, do):
      o, l = mg.flash_attention(q, k, v, causal=causal)
      return fn(q, k, v, o, l, do, causal=causal)
    return timeit(run, "q", "k", "v", "do")

  add("two_kernel_bwd", lambda: bwd_alone(mb.flash_attention_bwd), bwd_flops, real=7 / 5)
  for n, (label, cfg, opts) in enumerate(configs):
    fused = functools.partial(flash_attention_bwd, block_sizes=cfg, options=opts)
    add(f"fused_bwd {label}", lambda: bwd_alone(fused), bwd_flops)
    if n < 2:
      add(f"fused_fwd_bwd {label}", lambda: fwd_bwd(fused), fwd_flops + bwd_flops)
  add("two_kernel_fwd_bwd", lambda: fwd_bwd(mb.flash_attention_bwd), fwd_flops + bwd_flops)
  return rows
