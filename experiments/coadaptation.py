"""Co-adaptation experiment: does top-K sparsity learned in training keep what pruning loses?

Trains small decoder LMs (``jattn.nn.Transformer``) from scratch on the same data, steps,
parameters and optimiser, paired by seed:

  ==================  =================================================================
  full                causal global attention in every layer (the baseline)
  posthoc_proxy       the full model pruned post hoc by the mean-pooled block score
  posthoc_oracle      the full model pruned post hoc by each layer's true block mass
  sparse_none         trained with per-token top-K block sparsity, no gate gradient
  sparse_ste          ... straight-through gate gradient
  sparse_gumbel       ... Gumbel gate gradient (evaluated with the deterministic top-K)
  sparse_distill      ... hard top-K plus score distillation (``jattn.sparse.block_score_kl``)
  local_global_nope   periodic 5 local (RoPE, window) : 1 global layers, NoPE global layers
  local_global_rope   the same with RoPE global layers
  csa                 CSA "compressed" (4 tokens -> 1 entry, top-K entries + raw window)
  csa_two_stage       CSA two-stage (compressed keys score blocks, exact attention on the
                      top-K raw blocks plus its own, one softmax)
  ==================  =================================================================

Selection (``experiments.coadaptation_analysis``): per query token (``q_block_size`` 1 on the
CPU presets through the XLA path; the GPU presets' trained layers select per 16-query tile),
shared by the GQA group, initial and local blocks kept, each query keeping 19% of its own
visible blocks (``top_k=keep_fraction``: round(0.19 V) of V, at least the initial and local
ones); CSA two-stage, whose ``top_k`` is a count, keeps 19% at the answer query.

Metrics per (task, length, variant, seed): retrieval score (>= 256 held-out episodes on the
real presets), held-out text bits per byte, measured sparsity (overall and at the answers),
concentration, proxy recall, needle recall (>= 64 analysed rows), decode ms; aggregated with
95% bootstrap intervals and paired differences against full, post-hoc proxy and post-hoc oracle.
The dense baseline must reach ``min_baseline_score`` first, else the run stops (exit 4).

Usage::

  python -m experiments.coadaptation --out runs/default                  # default preset, CPU
  python -m experiments.coadaptation --preset plumbing --out /tmp/p      # plumbing only (CI)
  python -m experiments.coadaptation --preset cpu512 --out runs/c512 --set task=mqar
  python -m experiments.coadaptation --preset gpu8k --out runs/g8 --variants full,posthoc_proxy
  python -m experiments.coadaptation merge runs/c512 runs/g8 --out runs/all

Writes ``OUT/results.json`` ({"rows", "aggregate", "meta"}), ``OUT/table.md``, PNG figures in
``OUT/figures/`` and per-run state in ``OUT/runs/<variant>_s<seed>/``. ``OUT/config.json`` binds
the directory to its settings; a killed run resumes from its last good checkpoint.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time

import numpy as np

VARIANTS = ("full", "posthoc_proxy", "posthoc_oracle", "sparse_none", "sparse_ste",
            "sparse_gumbel", "sparse_distill", "local_global_nope", "local_global_rope", "csa",
            "csa_two_stage")
DEFAULT_VARIANTS = VARIANTS
POSTHOC = {"posthoc_proxy": "proxy", "posthoc_oracle": "oracle"}  # the full model, pruned
TRAINED = tuple(v for v in VARIANTS if v not in POSTHOC)
SPARSE_GATES = {"sparse_none": "none", "sparse_ste": "ste", "sparse_gumbel": "gumbel"}
SPARSE_VARIANTS = (*SPARSE_GATES, "sparse_distill")   # trained with LayerSpec("sparse")
BLOCK_VARIANTS = (*POSTHOC, *SPARSE_VARIANTS)          # per-token top-K block selection


@dataclasses.dataclass(frozen=True)
class Preset:
  """Everything that defines one experiment size.

  Attributes:
    name: preset name.
    seq_len: model context (training and evaluation).
    task, num_keys, num_values, num_pairs, num_queries, text_fraction: the retrieval task
      (``experiments.data.TaskConfig``).
    num_layers, d_model, num_heads, num_kv_heads, head_dim: the model (``TransformerConfig``).
    batch_size: global batch (rows); must divide by the number of devices.
    steps: training steps per variant.
    lr, warmup_steps: optimiser.
    block_size: key block size of the block-sparse variants and CSA two-stage.
    q_block_size: queries sharing one selection in trained sparse layers (1: per query token,
      through the XLA path; GPU presets use the smallest tile the Triton kernels take).
    keep_fraction: share of each query's visible blocks kept (the sparse layers' ``top_k``).
    variants: comma-separated variants the preset runs by default.
    min_baseline_score: the dense baseline must reach this retrieval score, else the run stops.
    window: local window of the local/global variant.
    local_per_global: local layers per global layer.
    csa_ratio, csa_top_k, csa_window: CSA compression ratio, kept entries, raw window.
    corpus_bytes: cap on text bytes per split (None: the whole stdlib).
    eval_retrieval, eval_text: evaluation rows.
    seeds: default number of seeds.
    curriculum_start, curriculum_ramp: the episode span starts at this many tokens and grows
      geometrically to the full haystack at this fraction of the steps (``data.Curriculum``).
    param_dtype: parameter dtype of the model (the master copy).
    compute_dtype: None or "bfloat16": mixed-precision forward/backward (``Trainer``).
    cache_dtype: KV-cache dtype of the decode benchmark.
    decode_tokens: tokens timed in the decode benchmark.
    analysis_rows: eval rows analysed (concentration, recall, needle recall).
    ckpt_every, log_every: checkpoint and learning-curve intervals.
    implementation: attention implementation passed to the model (None: jattn's default).
    score_aux_weight: "sparse_distill": weight w of the score-distillation term
      (``LayerSpec.score_aux_weight``; every layer adds w * its KL).
    aux_gate: "sparse_distill": its gate gradient mode ("none", "ste" or "gumbel").
    aux_pool: "sparse_distill": pooling of the distillation target over a block's queries ("max"
      or "sum"; ``LayerSpec.score_aux_pool``).
  """
  name: str
  seq_len: int
  num_layers: int
  d_model: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  batch_size: int
  steps: int
  lr: float
  warmup_steps: int
  block_size: int
  window: int
  csa_top_k: int
  csa_window: int
  task: str = "copy"
  num_keys: int = 16
  num_values: int = 16
  num_pairs: int = 8
  num_queries: int = 4
  text_fraction: float = 0.25
  q_block_size: int = 1
  keep_fraction: float = 0.19
  variants: str = ",".join(VARIANTS)
  min_baseline_score: float = 0.9
  local_per_global: int = 5
  csa_ratio: int = 4
  corpus_bytes: int | None = 4_000_000
  eval_retrieval: int = 256
  eval_text: int = 32
  seeds: int = 1
  curriculum_start: int = 8
  curriculum_ramp: float = 0.7
  param_dtype: str = "float32"
  compute_dtype: str | None = None
  cache_dtype: str = "float32"
  decode_tokens: int = 16
  analysis_rows: int = 64
  ckpt_every: int = 100
  log_every: int = 10
  implementation: str | None = None
  interpret: bool = False
  score_aux_weight: float = 1.0
  aux_gate: str = "none"
  aux_pool: str = "max"

  def task_config(self):
    """The ``TaskConfig`` of this preset."""
    from experiments.data import TaskConfig
    return TaskConfig(seq_len=self.seq_len, task=self.task, num_keys=self.num_keys,
                      num_values=self.num_values, num_pairs=self.num_pairs,
                      num_queries=self.num_queries, text_fraction=self.text_fraction)


PRESETS = {
    # Plumbing only (CI): every variant and phase on a 2-core CPU in about a minute; the model is
    # too small and short-trained for its numbers to mean anything.
    "plumbing": Preset(name="plumbing", seq_len=64, num_layers=2, d_model=32, num_heads=2,
                       num_kv_heads=1, head_dim=16, batch_size=4, steps=4, lr=3e-3,
                       warmup_steps=1, block_size=8, window=16, local_per_global=1, csa_top_k=4,
                       csa_window=8, task="copy", num_pairs=1, num_queries=1,
                       curriculum_start=4, corpus_bytes=200_000, eval_retrieval=8, eval_text=4,
                       decode_tokens=2, analysis_rows=4, ckpt_every=2,
                       log_every=2, min_baseline_score=0.0),
    # The README's first command: 3 seeds of the decisive cells (full, post-hoc proxy and
    # oracle, trained STE and score distillation) at 128 tokens in 16 blocks of 8 (per token:
    # the answer query keeps 3 of 16 blocks), aimed at < 5 minutes on 2 CPU cores.
    "default": Preset(name="default", seq_len=128, num_layers=2, d_model=48, num_heads=2,
                      num_kv_heads=1, head_dim=24, batch_size=16, steps=150, lr=4e-3,
                      warmup_steps=15, block_size=8, window=16, local_per_global=1, csa_top_k=4,
                      csa_window=16, task="copy", num_values=32, num_pairs=1, num_queries=1,
                      text_fraction=0.125, corpus_bytes=1_000_000, eval_retrieval=256,
                      eval_text=16, seeds=3, curriculum_start=4, decode_tokens=4,
                      analysis_rows=64, ckpt_every=50, log_every=10,
                      variants="full,posthoc_proxy,posthoc_oracle,sparse_ste,sparse_distill"),
    # CPU cells of the length sweep: every variant, 3 seeds; --set seq_len=1024 / 2048 with
    # block_size 16 keeps the geometry (blocks of 16, per-token selection). --set task=mqar
    # runs the multi-query associative recall task (8 pairs, 4 queried, 4 distractors).
    "cpu512": Preset(name="cpu512", seq_len=512, num_layers=3, d_model=64, num_heads=2,
                     num_kv_heads=1, head_dim=32, batch_size=8, steps=250, lr=3e-3,
                     warmup_steps=25, block_size=16, window=64, local_per_global=2,
                     csa_top_k=16, csa_window=64, task="copy", num_values=32, num_pairs=1,
                     num_queries=1, text_fraction=0.125, corpus_bytes=2_000_000, seeds=3,
                     curriculum_start=4, decode_tokens=8, ckpt_every=50),
    # GPU cells (one Hopper GPU, H100 80 GB or H200): blocks of 64 as at 8K, selection per
    # 16-query tile (the smallest tile of the Triton kernels), bf16. Split into cell groups
    # (experiments/coadaptation_parallel.sh) that fit 10-minute calls; `merge` joins them.
    "gpu4k": Preset(name="gpu4k", seq_len=4096, num_layers=6, d_model=256, num_heads=4,
                    num_kv_heads=2, head_dim=64, batch_size=8, steps=300, lr=2e-3,
                    warmup_steps=50, block_size=64, q_block_size=16, window=512, csa_top_k=64,
                    csa_window=512, task="copy", num_values=32, num_pairs=1, num_queries=1,
                    corpus_bytes=None, text_fraction=0.125, seeds=3, cache_dtype="bfloat16",
                    compute_dtype="bfloat16", decode_tokens=32, analysis_rows=64,
                    ckpt_every=100, log_every=20),
}
PRESETS["gpu8k"] = dataclasses.replace(PRESETS["gpu4k"], name="gpu8k", seq_len=8192)


# --------------------------------------------------------------------------------------------------
# Sparsity bookkeeping
# --------------------------------------------------------------------------------------------------

def causal_pairs(n):
  """Number of causal (query, key) pairs of a length-``n`` sequence."""
  return n * (n + 1) // 2


def window_sparsity(seq_len, window):
  """Fraction of causal pairs outside a causal window of ``window`` tokens."""
  kept = sum(min(i + 1, window) for i in range(seq_len))
  return 1.0 - kept / causal_pairs(seq_len)


def csa_sparsity(seq_len, ratio, top_k, window):
  """Fraction of causal query-key scores CSA "compressed" does not compute.

  A query at t computes ``min(t + 1, window)`` raw scores plus ``min(top_k, visible entries)``
  compressed ones (entry c is visible once t >= c * ratio + 2 * ratio - 1); each counts as one
  score against the ``t + 1`` of full causal attention.
  """
  kept = 0
  for t in range(seq_len):
    vis = max(0, (t + 1 - 2 * ratio) // ratio + 1) if t + 1 >= 2 * ratio else 0
    kept += min(t + 1, window) + min(top_k, vis)
  return max(0.0, 1.0 - kept / causal_pairs(seq_len))


# --------------------------------------------------------------------------------------------------
# Models (jattn.nn)
# --------------------------------------------------------------------------------------------------

def sparse_top_k(preset):
  """top_k of the block-sparse variants and the post-hoc rules: the float ``keep_fraction``, so
  each query (block) keeps that share of its own visible blocks (``jattn.sparse.select_blocks``)."""
  return float(preset.keep_fraction)


def csa_top_k(preset):
  """top_k (a count) of CSA two-stage: the answer query keeps ``keep_fraction`` of its visible
  blocks (``coadaptation_analysis.per_query_top_k``), its own block (the one forced block of
  ``jattn.nn.csa.two_stage_attention``) included.

  >>> csa_top_k(PRESETS["cpu512"])   # 32 visible blocks: 6 kept = own + 5 by score
  5
  """
  from experiments.coadaptation_analysis import per_query_top_k
  return per_query_top_k(preset.seq_len, preset.block_size, preset.keep_fraction, num_forced=1)


def variant_layers(preset, variant):
  """The per-layer ``LayerSpec`` tuple of a trained variant (or of the post-hoc evaluation).

  Args:
    preset: a ``Preset``.
    variant: one of ``VARIANTS``.

  Returns:
    tuple of ``jattn.nn.LayerSpec``, one per layer.
  """
  from jattn.nn import LayerSpec, local_global_schedule
  n, bs = preset.num_layers, preset.block_size
  if variant == "full":
    return tuple(LayerSpec("global") for _ in range(n))
  if variant in BLOCK_VARIANTS:
    aux = {"score_aux_weight": float(preset.score_aux_weight),
           "score_aux_pool": preset.aux_pool} if variant == "sparse_distill" else {}
    qbs = preset.q_block_size if variant in SPARSE_VARIANTS else 1
    return tuple(LayerSpec("sparse", block_size=bs, q_block_size=qbs, top_k=sparse_top_k(preset),
                           gate_grad=_gate_name(variant_gate(preset, variant)), **aux)
                 for _ in range(n))
  if variant in ("local_global_nope", "local_global_rope"):
    rope = None if variant == "local_global_nope" else 10000.0
    layers = list(local_global_schedule(n, preset.local_per_global, preset.window,
                                        global_rope_base=rope))
    if all(s.kind == "local" for s in layers):  # fewer layers than one period: keep one global
      layers[-1] = LayerSpec("global", rope_base=rope)
    return tuple(layers)
  if variant == "csa":
    return tuple(LayerSpec("csa", compress_ratio=preset.csa_ratio, top_k=preset.csa_top_k,
                           window=preset.csa_window, csa_mode="compressed") for _ in range(n))
  if variant == "csa_two_stage":
    return tuple(LayerSpec("csa", compress_ratio=preset.csa_ratio, top_k=csa_top_k(preset),
                           block_size=bs, csa_mode="two_stage") for _ in range(n))
  raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")


def variant_gate(preset, variant):
  """The gate gradient mode of a sparse variant ("none" post hoc; ``preset.aux_gate``
  for sparse_distill)."""
  if variant == "sparse_distill":
    return preset.aux_gate
  return SPARSE_GATES.get(variant, "none")


def _gate_name(gate):
  """Map the experiment's gate names (none/ste/gumbel) to the ones ``LayerSpec`` accepts."""
  from jattn.nn import schedule
  accepted = schedule.GATE_GRADS
  if gate in accepted:
    return gate
  aliases = {"ste": ("straight_through",), "gumbel": ("softmax", "gumbel_softmax")}
  for alias in aliases.get(gate, ()):
    if alias in accepted:
      return alias
  raise ValueError(f"gate_grad {gate!r} not supported by LayerSpec (accepts {accepted})")


def model_config(preset, layers, context_mesh=None):
  """The ``jattn.nn.TransformerConfig`` for ``preset`` with the given layer specs (attention
  context-parallel over ``context_mesh``'s "seq" axis when given)."""
  import jax.numpy as jnp
  from jattn.nn import TransformerConfig
  vocab = preset.task_config().vocab.size
  kwargs = dict(vocab_size=vocab, num_layers=preset.num_layers, d_model=preset.d_model,
                num_heads=preset.num_heads, num_kv_heads=preset.num_kv_heads,
                head_dim=preset.head_dim, layers=tuple(layers))
  # compute_dtype sets the activations' dtype too: with dtype=None, fp32 norms would hand the
  # attention kernels fp32 q/k/v (IEEE fp32 dots, ~20x slower on the GPU than bf16).
  dtype = None if preset.compute_dtype is None else jnp.dtype(preset.compute_dtype)
  impl = preset.implementation   # CSA two-stage runs XLA only (the dry run asks for "triton")
  impl = None if any(s.csa_mode == "two_stage" for s in layers if s.kind == "csa") else impl
  return TransformerConfig(**kwargs, implementation=impl,
                           interpret=preset.interpret,
                           param_dtype=jnp.dtype(preset.param_dtype), dtype=dtype,
                           context_mesh=context_mesh,
                           context_axis=None if context_mesh is None else "seq")


def dry_run_preset(preset):
  """A few-minute CPU rehearsal of a GPU preset: same model, layers and dtypes, every variant and
  phase (train, resume checkpoints, eval, analysis, decode timing, figures), but at most 1024
  tokens, 3 steps and tiny eval sets, with the Pallas Triton kernels in interpret mode, so code
  paths that only the GPU would take (kernel dtypes, tile constraints, decode) run on the CPU.

  Args:
    preset: a ``Preset``.

  Returns:
    A new ``Preset`` (name suffixed "-dryrun").

  Example:
    >>> p = dry_run_preset(PRESETS["gpu8k"])
    >>> p.seq_len, p.steps, p.implementation, p.interpret
    (1024, 3, 'triton', True)
  """
  return dataclasses.replace(
      preset, name=preset.name + "-dryrun", seq_len=min(preset.seq_len, 1024), steps=3,
      batch_size=2, warmup_steps=1, eval_retrieval=2, eval_text=2, decode_tokens=2,
      analysis_rows=1, ckpt_every=2, log_every=1, seeds=1,
      implementation="triton", interpret=True)


def build_model(preset, variant, seed, context_mesh=None):
  """A freshly initialised ``jattn.nn.Transformer`` for a variant (parameters from ``seed``;
  context-parallel over ``context_mesh``'s "seq" axis when given)."""
  from flax import nnx
  from jattn.nn import Transformer
  return Transformer(model_config(preset, variant_layers(preset, variant), context_mesh),
                     rngs=nnx.Rngs(seed))


def uses_segments(variant):
  """Whether a variant's model takes packed segment ids (CSA layers reject them: their pooled
  windows would straddle documents, so CSA trains on packed text rows without the mask)."""
  return not variant.startswith("csa")


# --------------------------------------------------------------------------------------------------
# One run: train (resumable), evaluate, analyse
# --------------------------------------------------------------------------------------------------

class Context:
  """Shared, loaded-once state of an experiment invocation: corpora, eval sets, mesh.

  Args:
    preset: a ``Preset``.
    devices: devices for the data-parallel mesh (default: all).
    context_parallel: devices each training sequence is split over (zig-zag layout; the batch
      is split over the rest); evaluation, analysis and decode run the unsharded model.
  """

  def __init__(self, preset, devices=None, context_parallel=1):
    from experiments import data
    from experiments.train_lib import make_mesh
    self.preset = preset
    self.task = preset.task_config()
    t0 = time.perf_counter()
    self.train_text, self.heldout_text = data.load_python_corpus(max_bytes=preset.corpus_bytes)
    self.eval_retrieval, self.eval_text = data.eval_sets(
        self.task, self.heldout_text, num_retrieval=preset.eval_retrieval,
        num_text=preset.eval_text, seed=10_007)
    self.mesh = make_mesh(devices, context_parallel)
    self.context_parallel = context_parallel
    self.load_s = time.perf_counter() - t0

  def stream(self, seed):
    """The training stream of a seed (identical for every variant of that seed; with context
    parallelism its token arrays come in zig-zag order, which a token-wise loss ignores)."""
    from experiments import data
    p = self.preset
    stream = data.TrainStream(self.task, self.train_text, p.batch_size, p.steps, seed,
                              data.Curriculum(p.curriculum_start, p.curriculum_ramp))
    return stream if self.context_parallel == 1 else ZigzagStream(stream, self.context_parallel)


class ZigzagStream:
  """A training stream whose [batch, seq] arrays come permuted into the zig-zag layout of
  ``num_shards`` sequence shards (``jattn.context_parallel_permute``), for context parallelism.

  Args:
    stream: the stream (``batch(step)``, ``state(step)``, ``span(step)``).
    num_shards: devices each sequence is split over.

  Example:
    >>> class S:
    ...   def batch(self, step): return {"inputs": np.arange(8)[None]}
    >>> ZigzagStream(S(), 2).batch(0)["inputs"].tolist()
    [[0, 1, 6, 7, 2, 3, 4, 5]]
  """

  def __init__(self, stream, num_shards):
    self.stream, self.num_shards = stream, num_shards

  def batch(self, step):
    from jattn.context_parallel import layout_positions
    b = dict(self.stream.batch(step))
    for k, v in b.items():
      if np.ndim(v) == 2:
        pos = layout_positions(v.shape[1], self.num_shards, "zigzag")
        b[k] = np.asarray(v)[:, pos[pos >= 0]]
    return b

  def __getattr__(self, name):   # state, span, ...
    return getattr(self.stream, name)


def _opt(preset):
  from experiments.train_lib import OptimConfig
  return OptimConfig(lr=preset.lr, warmup_steps=preset.warmup_steps, total_steps=preset.steps)


# Preset fields that do not change what a run computes (how many seeds run is chosen per call).
NOT_FINGERPRINTED = ("seeds",)


def experiment_config(preset):
  """The configuration an output directory is bound to: every ``Preset`` field except
  ``NOT_FINGERPRINTED`` (a JSON-able dict; its ``train_lib.config_fingerprint`` is stored with
  every checkpoint and in ``OUT/config.json``)."""
  return {k: v for k, v in dataclasses.asdict(preset).items() if k not in NOT_FINGERPRINTED}


def bind_output_dir(out_dir, preset):
  """Create ``out_dir`` (failing at once, naming it, if it is not writable) and bind it to the
  preset's configuration: the first call writes ``config.json``; later calls with another
  configuration raise ``train_lib.ConfigMismatchError`` naming the differing keys.

  Example:
    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> bind_output_dir(d, PRESETS["plumbing"]); bind_output_dir(d, PRESETS["plumbing"])
  """
  from experiments.train_lib import (
      check_same_config,
      config_fingerprint,
      ensure_writable_dir,
      save_json,
  )
  ensure_writable_dir(out_dir)
  cfg = experiment_config(preset)
  path = os.path.join(out_dir, "config.json")
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
    check_same_config(old.get("config", {}), json.loads(json.dumps(cfg)), f"--out {out_dir}")
    return
  if os.path.isdir(os.path.join(out_dir, "runs")) and os.listdir(os.path.join(out_dir, "runs")):
    from experiments.train_lib import ConfigMismatchError
    raise ConfigMismatchError(f"--out {out_dir} holds runs but no config.json: its configuration "
                              "is unknown; use a fresh output directory")
  save_json(path, {"config": cfg, "fingerprint": config_fingerprint(cfg)})


def train_run(ctx, variant, seed, run_dir, *, stop_after=None, progress=True, deadline=None):
  """Train one (variant, seed), resuming from ``run_dir/ckpt`` if a checkpoint is there.

  Args:
    ctx: a ``Context``.
    variant: a trained variant (``TRAINED``).
    seed: model-init, data and per-step seed.
    run_dir: the run's directory.
    stop_after: stop after this many steps in this call (simulated kill), or None.
    progress: tqdm progress bar.
    deadline: ``time.monotonic()`` after which training stops (checkpointed), or None.

  Returns:
    (trainer, finished: bool).
  """
  from flax import nnx

  from experiments.train_lib import Trainer
  p = ctx.preset
  model = build_model(p, variant, seed, ctx.mesh if ctx.context_parallel > 1 else None)
  trainer = Trainer(model, _opt(p), mesh=ctx.mesh, seed=seed, use_segments=uses_segments(variant),
                    compute_dtype=p.compute_dtype)
  finished = trainer.fit(ctx.stream(seed), p.steps, ckpt_dir=os.path.join(run_dir, "ckpt"),
                         ckpt_every=p.ckpt_every, stop_after=stop_after, log_every=p.log_every,
                         desc=f"{variant} s{seed}", progress=progress,
                         extra_record={"variant": variant, "seed": seed, "preset": p.name},
                         deadline=deadline,
                         config=dict(experiment_config(p), variant=variant, seed=seed))
  if ctx.context_parallel > 1:   # evaluation, analysis and decode: the unsharded model
    trainer.use_graphdef(nnx.graphdef(build_model(p, variant, seed)))
  return trainer, finished


def posthoc_module(full_model, rule, preset):
  """The full model's trained weights pruned post hoc by ``rule`` ("proxy" or "oracle") on each
  layer's own q/k, as an ``nnx.Module`` with the model's call signature (so the trainer's
  evaluation runs it): ``coadaptation_analysis.masked_forward``."""
  from flax import nnx

  from experiments.coadaptation_analysis import masked_forward

  class Pruned(nnx.Module):
    def __init__(self, model):
      self.model = model

    def __call__(self, tokens, segment_ids=None, positions=None, *, return_qk=False):
      logits, layers = masked_forward(self.model, tokens, rule=rule,
                                      block_size=preset.block_size, top_k=sparse_top_k(preset),
                                      segment_ids=segment_ids, positions=positions)
      return (logits, layers) if return_qk else logits
  return Pruned(full_model)


def posthoc_decode_state(ctx, full_trainer):
  """The full model with every layer a top-K sparse layer (the proxy rule as a ``jattn.nn``
  model: ``sparsify``), for decode timing; (graphdef, params, rest). Decode steps select per
  token; the prefill selects per ``q_block_size`` tile as the trained variants do (a kernel
  implementation needs tiles of at least 16 queries)."""
  from flax import nnx

  from jattn.nn.transformer import sparsify
  p = ctx.preset
  model = sparsify(full_trainer.model(), sparse_top_k(p), block_size=p.block_size,
                   q_block_size=p.q_block_size)
  return nnx.split(model, nnx.Param, ...)


# --------------------------------------------------------------------------------------------------
# Analysis: per-layer q/k, selections, concentration, attention maps
# --------------------------------------------------------------------------------------------------

def layer_qk(graphdef, params, rest, tokens):
  """Per-layer attention inputs of a model (``Transformer(..., return_qk=True)``).

  Args:
    graphdef, params, rest: an ``nnx.split`` of a ``jattn.nn.Transformer`` (or of a
      ``posthoc_module``).
    tokens: int [batch, seq].

  Returns:
    list over layers of dicts with q [batch, seq, heads, d] and k [batch, seq, kv_heads, d]
    (fp32, after norms and RoPE, as the layer's attention sees them).
  """
  import jax
  import jax.numpy as jnp
  from flax import nnx

  @jax.jit
  def f(params, rest, tokens):
    model = nnx.merge(graphdef, params, rest)
    _, qks = model(tokens, return_qk=True)
    return [{"q": d["q"].astype(jnp.float32), "k": d["k"].astype(jnp.float32)} for d in qks]
  return f(params, rest, jnp.asarray(tokens))


def pool_blocks(m, size):
  """Sum the last two axes of ``m`` over ``size`` x ``size`` tiles (heatmaps of long contexts)."""
  n = m.shape[-1] // size * size
  m = m[..., :n, :n]
  return m.reshape(m.shape[:-2] + (n // size, size, n // size, size)).sum((-3, -1))


def needle_targets(task, tokens, answer_pos, needle_pos):
  """Position of the needle each answer query asks for (matched by key).

  Args:
    task: the ``TaskConfig``.
    tokens: int [b, seq] inputs.
    answer_pos: int [b, a] positions of the queried key tokens.
    needle_pos: int [b, num_pairs] positions of the needles.

  Returns:
    int [b, a]: the needle token position (for "mqar", the needle's key token).
  """
  voc = task.vocab
  if task.task == "copy":                                   # one needle, one query
    return np.asarray(needle_pos)[:, :1].copy()
  out = np.zeros_like(answer_pos)
  for r in range(tokens.shape[0]):
    ntok = tokens[r, needle_pos[r]]
    nkey = (ntok - voc.pair_base) // voc.num_values if voc.fused_pairs else ntok - voc.key_base
    for a in range(answer_pos.shape[1]):
      k = tokens[r, answer_pos[r, a]] - voc.key_base
      out[r, a] = needle_pos[r][int(np.flatnonzero(nkey == k)[0])]
  return out


_JIT = {}


def _layer_metrics(q, k, block_size, keep_fraction):
  """Jitted per layer: (concentration, proxy recall) and the dense probabilities of row 0."""
  import jax

  from experiments import coadaptation_analysis as A
  key = ("metrics", block_size, keep_fraction)
  if key not in _JIT:
    def f(q, k):
      from jattn.sparse import block_scores
      mass = A.block_mass(q, k, block_size=block_size)
      proxy = block_scores(q, k, block_size=block_size, q_block_size=1)
      return A.concentration_and_recall(mass, proxy, block_size=block_size,
                                        keep_fraction=keep_fraction)
    _JIT[key] = jax.jit(f)
  c, r = _JIT[key](q, k)
  return float(c), float(r)


def _probs(q, k, spec=None):
  """Jitted ``jattn.nn.attention_probabilities``."""
  import jax

  from jattn.nn.transformer import attention_probabilities
  if "probs" not in _JIT:
    _JIT["probs"] = jax.jit(attention_probabilities, static_argnums=2)
  return _JIT["probs"](q, k, spec)


def analyse(ctx, variant, graphdef, params, rest, *, retrieval_head=None, curve=True):
  """Attention analysis of one model on the first ``analysis_rows`` held-out episodes.

  Block-sparse variants (post hoc and trained) are analysed with their per-token selections on
  each layer's q/k (post-hoc ones inside the pruned forward); the full model's concentration
  and proxy recall are those of its dense attention. Local/global: the window; CSA: sparsity by
  arithmetic only.

  Returns:
    dict: "sparsity", "sparsity_answers", "concentration", "proxy_recall", "needle_recall",
    per-layer lists ("layer_*"), "mass_curve" ({"fraction", "oracle", "proxy"}: concentration
    and the proxy's share of the total candidate mass against the kept fraction),
    "retrieval_head", "needle_attention" [layers, heads], and figure arrays "heat" (the drawn
    head's dense map, pooled), "selection" [seq, blocks] bool (block variants) for row 0.
  """
  from experiments import coadaptation_analysis as A
  p = ctx.preset
  ev = ctx.eval_retrieval
  n = min(p.analysis_rows, ev["inputs"].shape[0])
  bs, tk = p.block_size, sparse_top_k(p)
  layers = variant_layers(p, "full" if variant in POSTHOC else variant)
  rule = "oracle" if variant == "posthoc_oracle" else "proxy"
  per_layer = {"conc": [], "rec": [], "sp": [], "sp_ans": [], "needle": []}
  needle_att, heat, selection = None, None, None
  chunk = 8
  for i in range(0, n, chunk):
    tokens = ev["inputs"][i:i + chunk]
    ans_pos = ev["answer_pos"][i:i + chunk]
    needle_of = needle_targets(ctx.task, tokens, ans_pos, ev["needle_pos"][i:i + chunk])
    qks = layer_qk(graphdef, params, rest, tokens)
    r = np.arange(tokens.shape[0])[:, None]
    att = np.stack([np.asarray(_probs(d["q"], d["k"], spec))[r, :, ans_pos, needle_of].mean((0, 1))
                    for d, spec in zip(qks, layers)])                     # [layers, heads]
    needle_att = att * len(tokens) if needle_att is None else needle_att + att * len(tokens)
    stats = {"conc": [], "rec": [], "sp": [], "sp_ans": [], "needle": []}
    for d, spec in zip(qks, layers):
      if variant == "full" or variant in BLOCK_VARIANTS:
        c, rc = _layer_metrics(d["q"], d["k"], bs, p.keep_fraction)
        stats["conc"].append(c)
        stats["rec"].append(rc)
      if variant in BLOCK_VARIANTS:
        sel = A.select(rule, d["q"], d["k"], block_size=bs, top_k=tk)
        sp, spa = A.selection_sparsity(sel, ans_pos)
        stats["sp"].append(sp)
        stats["sp_ans"].append(spa)
        stats["needle"].append(A.needle_recall([sel], ans_pos, needle_of, bs)[0])
    for key, vals in stats.items():
      per_layer[key].append((len(tokens), vals))
    if i == 0:
      if retrieval_head is None:
        retrieval_head = tuple(int(x) for x in np.unravel_index(np.argmax(att), att.shape))
      L, H = retrieval_head
      pool = max(1, tokens.shape[1] // 128)
      heat = np.asarray(pool_blocks(_probs(qks[L]["q"][:1], qks[L]["k"][:1], layers[L])[0, H],
                                    pool))
      if variant in BLOCK_VARIANTS:
        g = qks[L]["q"].shape[2] // qks[L]["k"].shape[2]
        sel = A.select(rule, qks[L]["q"][:1], qks[L]["k"][:1], block_size=bs, top_k=tk)
        selection = np.asarray(sel.tile_mask())[0, H // g]
      curve_pts = None
      if curve and (variant == "full" or variant in BLOCK_VARIANTS):
        fr = (0.06, 0.12, 0.19, 0.3, 0.5)
        pts = [[_layer_metrics(d["q"], d["k"], bs, f) for d in qks] for f in fr]
        curve_pts = {"fraction": list(fr),
                     "oracle": [float(np.mean([c for c, _ in x])) for x in pts],
                     "proxy": [float(np.mean([c * rc for c, rc in x])) for x in pts]}

  def avg(key):
    tot = sum(w for w, v in per_layer[key] if v)
    if not tot:
      return None
    lay = np.sum([w * np.asarray(v) for w, v in per_layer[key] if v], 0) / tot
    return [float(x) for x in lay]
  out = {"retrieval_head": list(retrieval_head), "needle_attention": (needle_att / n).tolist(),
         "heat": heat, "selection": selection, "mass_curve": curve_pts,
         "needle_blocks": needle_targets(ctx.task, ev["inputs"][:1], ev["answer_pos"][:1],
                                         ev["needle_pos"][:1])[0] // bs,
         "answer_blocks": ev["answer_pos"][0] // bs, "analysis_rows": n}
  for key, name in (("conc", "concentration"), ("rec", "proxy_recall"), ("sp", "sparsity"),
                    ("sp_ans", "sparsity_answers"), ("needle", "needle_recall")):
    lay = avg(key)
    if lay is not None and not np.all(np.isfinite(lay)):
      lay = None                                       # no query qualifies at this length
    out["layer_" + name] = lay
    out[name] = None if lay is None else (max(lay) if key == "needle" else float(np.mean(lay)))
  s = ev["inputs"].shape[1]
  if variant == "full":
    out.update(sparsity=0.0, sparsity_answers=0.0, needle_recall=1.0)
  elif variant.startswith("local_global"):
    ans = ev["answer_pos"][:n]
    nd = needle_targets(ctx.task, ev["inputs"][:n], ans, ev["needle_pos"][:n])
    out["sparsity"] = float(np.mean([window_sparsity(s, spec.window) if spec.kind == "local"
                                     else 0.0 for spec in layers]))
    out["sparsity_answers"] = float(np.mean([1 - min(1.0, spec.window / (ans.mean() + 1))
                                             if spec.kind == "local" else 0.0 for spec in layers]))
    out["needle_recall"] = float(max(1.0 if spec.kind == "global" else
                                     float(np.mean(ans - nd < spec.window)) for spec in layers))
  elif variant == "csa":
    out["sparsity"] = csa_sparsity(s, p.csa_ratio, p.csa_top_k, p.csa_window)
  elif variant == "csa_two_stage":
    nb, kept = -(-s // bs), csa_top_k(p) + 1   # + the query's own block
    out["sparsity"] = block_sparsity_per_token(s, bs, kept)
    out["sparsity_answers"] = 1.0 - min(nb, kept) / nb
  return out


def block_sparsity_per_token(seq_len, block_size, keep):
  """1 - kept / visible key blocks over all query tokens when each keeps ``keep`` blocks."""
  vis = np.arange(seq_len) // block_size + 1
  return float(1.0 - np.minimum(vis, keep).sum() / vis.sum())


# --------------------------------------------------------------------------------------------------
# Decode timing
# --------------------------------------------------------------------------------------------------

def decode_ms(graphdef, params, rest, tokens, *, num_tokens, dtype):
  """Median milliseconds per generated token at the end of a ``len(tokens)``-long context.

  Prefills ``len(tokens) - num_tokens - 1`` tokens through the model's ``decode`` path (one
  call), compiles the one-token step, then times ``num_tokens`` one-token ``decode`` steps.

  Args:
    graphdef, params, rest: the model.
    tokens: int [seq], one context.
    num_tokens: timed steps.
    dtype: cache dtype.

  Returns:
    float, median ms per token.
  """
  import jax
  import jax.numpy as jnp
  from flax import nnx
  model = nnx.merge(graphdef, params, rest)
  seq = len(tokens)
  model.init_cache(1, seq, jnp.dtype(dtype))
  gd, state = nnx.split(model)

  @jax.jit
  def step(state, tok):
    m = nnx.merge(gd, state)
    logits = m.decode(tok)
    return logits, nnx.state(m)

  toks = jnp.asarray(np.asarray(tokens, np.int32))[None]
  pre = seq - num_tokens - 1
  logits, state = step(state, toks[:, :pre])
  logits, state = step(state, toks[:, pre:pre + 1])  # compile the one-token step
  jax.block_until_ready(logits)
  times = []
  for i in range(pre + 1, seq):
    t0 = time.perf_counter()
    logits, state = step(state, toks[:, i:i + 1])
    jax.block_until_ready(logits)
    times.append(time.perf_counter() - t0)
  return float(np.median(times) * 1e3)


# --------------------------------------------------------------------------------------------------
# Orchestration
# --------------------------------------------------------------------------------------------------

ROW_FIELDS = ("variant", "task", "seq_len", "seed", "sparsity", "sparsity_answers", "score", "bpb",
              "concentration", "proxy_recall", "needle_recall", "decode_ms")
METRICS = ("score", "bpb", "sparsity", "sparsity_answers", "concentration", "proxy_recall",
           "needle_recall", "decode_ms")


class BaselineNotSolved(RuntimeError):
  """The dense baseline did not solve the task: comparing variants would be meaningless."""


def _final(curves, key, last=3):
  vals = [v for v in curves.get(key, [])[-last:] if v is not None]
  return float(np.mean(vals)) if vals else None


def _save_analysis(path, an):
  arrays = {k: np.asarray(v) for k, v in an.items()
            if k in ("heat", "selection", "needle_blocks", "answer_blocks") and v is not None}
  np.savez_compressed(path, **arrays)


def inference_state(ctx, variant, trainer):
  """The model a trained variant is evaluated with: Gumbel gates perturb the block scores only
  to train, so "sparse_gumbel" (and a Gumbel "sparse_distill") is evaluated with the
  deterministic top-K of the same weights. Returns (graphdef, params, rest)."""
  from flax import nnx

  from jattn.nn.transformer import with_config
  if variant_gate(ctx.preset, variant) != "gumbel":
    return trainer.graphdef, trainer.params, trainer.rest
  cfg = model_config(ctx.preset, variant_layers(ctx.preset, "sparse_none"))
  return nnx.split(with_config(trainer.model(), cfg), nnx.Param, ...)


def finish_run(ctx, variant, seed, run_dir, trainer, *, retrieval_head=None):
  """Evaluate and analyse a trained model (or the full one pruned post hoc, for ``POSTHOC``
  variants) and write ``run_dir/result.json`` and ``analysis.npz``. Returns the result row."""
  from flax import nnx

  from experiments.train_lib import save_json
  p = ctx.preset
  if variant in POSTHOC:
    gd, pr, rs = nnx.split(posthoc_module(trainer.model(), POSTHOC[variant], p), nnx.Param, ...)
    dec = posthoc_decode_state(ctx, trainer) if variant == "posthoc_proxy" else None
  else:
    gd, pr, rs = inference_state(ctx, variant, trainer)
    dec = (gd, pr, rs)
  t0 = time.perf_counter()
  ret = trainer.evaluate(ctx.eval_retrieval, graphdef=gd, params=pr, rest=rs)
  txt = trainer.evaluate(ctx.eval_text, graphdef=gd, params=pr, rest=rs)
  t_eval = time.perf_counter()
  an = analyse(ctx, variant, gd, trainer.cast(pr), rs, retrieval_head=retrieval_head,
               curve=seed == 0)
  t_an = time.perf_counter()
  dms = None
  if dec is not None:
    dms = decode_ms(dec[0], trainer.cast(dec[1]), dec[2], ctx.eval_retrieval["inputs"][0],
                    num_tokens=p.decode_tokens, dtype=p.cache_dtype)
  phases = {"eval_s": t_eval - t0, "analysis_s": t_an - t_eval,
            "decode_s": time.perf_counter() - t_an}
  curves = trainer.curves
  row = {
      "variant": variant, "task": p.task, "seq_len": p.seq_len, "seed": seed,
      "sparsity": an["sparsity"], "sparsity_answers": an["sparsity_answers"],
      "score": ret["score"], "loss": txt["text_nll"], "bpb": txt["bpb"],
      "concentration": an["concentration"], "proxy_recall": an["proxy_recall"],
      "needle_recall": an["needle_recall"], "decode_ms": dms,
      "eval_episodes": int(ret["ans_count"]), "analysis_rows": an["analysis_rows"],
      "answer_nll": ret["answer_nll"], "train_loss": _final(curves, "loss"),
      "train_answer_acc": _final(curves, "answer_acc"), "steps": p.steps,
      "q_block_size": 1 if variant in POSTHOC else p.q_block_size, "top_k": sparse_top_k(p),
      "phase_s": phases, "run": os.path.relpath(run_dir, os.path.dirname(os.path.dirname(run_dir))),
      "analysis": {k: an[k] for k in {"retrieval_head", "needle_attention", "mass_curve"}
                   | {k for k in an if k.startswith("layer_")}},
      "curves": curves,
  }
  _save_analysis(os.path.join(run_dir, "analysis.npz"), an)
  save_json(os.path.join(run_dir, "result.json"), row)
  return row


def run_experiment(preset, out_dir, *, seeds=None, variants=None, stop_after=None,
                   progress=True, devices=None, log=print, on_row=None, deadline=None,
                   context_parallel=1):
  """Train, evaluate and analyse every (variant, seed); resumable.

  Finished runs (``runs/<variant>_s<seed>/result.json``) are loaded, not redone; an unfinished
  run resumes from its checkpoint. The full model of each seed must reach
  ``preset.min_baseline_score`` first, else ``BaselineNotSolved`` is raised.

  Args:
    preset: a ``Preset``.
    out_dir: output directory.
    seeds: number of seeds (default ``preset.seeds``); seeds are 0..seeds-1.
    variants: variants to run (default ``preset.variants``; post-hoc ones need "full").
    stop_after: stop after this many training steps in this call (a simulated kill).
    progress: tqdm progress bars.
    devices: devices of the data-parallel mesh (default: all).
    log: print function.
    on_row: optional callback ``on_row(rows)`` after every finished run (partial results).
    deadline: ``time.monotonic()`` after which training stops (checkpointed); a run not yet
      started is left unstarted when a run finished in this call took longer than what is left.
    context_parallel: devices each training sequence is split over (``Context``).

  Returns:
    (rows, finished): the result rows and whether every run completed.
  """
  variants = preset.variants.split(",") if variants is None else variants
  variants = tuple(v for v in VARIANTS if v in variants)
  if any(v in POSTHOC for v in variants) and "full" not in variants:
    raise ValueError("post-hoc variants prune the full model: include 'full' in variants")
  seeds = preset.seeds if seeds is None else seeds
  ctx = Context(preset, devices, context_parallel)
  log(f"[coadaptation] preset={preset.name} task={preset.task} seq_len={preset.seq_len}"
      f" devices={ctx.mesh.devices.size} context_parallel={context_parallel}"
      f" top_k={sparse_top_k(preset)} block={preset.block_size}"
      f" q_block={preset.q_block_size}")
  budget = stop_after
  rows = []
  took = {}   # variant -> longest wall time of a run started and finished in this call
  for seed in range(seeds):
    full_trainer, full_head = None, None
    for variant in variants:
      run_dir = os.path.join(out_dir, "runs", f"{variant}_s{seed}")
      os.makedirs(run_dir, exist_ok=True)
      done_path = os.path.join(run_dir, "result.json")
      if os.path.exists(done_path):
        with open(done_path) as f:
          row = json.load(f)
      elif variant in POSTHOC:
        if full_trainer is None:  # restore the finished full model from its checkpoint
          full_trainer, _ = train_run(ctx, "full", seed,
                                      os.path.join(out_dir, "runs", f"full_s{seed}"),
                                      stop_after=0, progress=False)
        row = finish_run(ctx, variant, seed, run_dir, full_trainer, retrieval_head=full_head)
        log(_row_line(row))
      else:
        if (budget is not None and budget <= 0) or (
            deadline is not None and time.monotonic() > deadline):
          return rows, False
        from experiments.train_lib import checkpoint_steps
        fresh = not checkpoint_steps(os.path.join(run_dir, "ckpt"))
        need = took.get(variant, max(took.values(), default=None))
        if deadline is not None and fresh and need is not None and (
            time.monotonic() + need > deadline):   # it would stop unfinished: leave it unstarted
          log(f"[coadaptation] {variant} seed {seed} not started: a run took {need:.0f} s here, "
              f"{deadline - time.monotonic():.0f} s of the time budget are left")
          return rows, False
        t0 = time.monotonic()
        trainer, finished = train_run(ctx, variant, seed, run_dir, stop_after=budget,
                                      progress=progress, deadline=deadline)
        if budget is not None:
          budget -= trainer.step - trainer.fit_start_step
        if not finished:
          return rows, False
        if full_head is None and variant != "full":
          full_head = _finished_full_head(out_dir, seed)
        row = finish_run(ctx, variant, seed, run_dir, trainer, retrieval_head=full_head)
        if fresh:
          took[variant] = max(took.get(variant, 0.0), time.monotonic() - t0)
        if variant == "full":
          full_trainer = trainer
        log(_row_line(row))
      if variant == "full":
        full_head = tuple(row["analysis"]["retrieval_head"])
        if row["score"] < preset.min_baseline_score:
          raise BaselineNotSolved(
              f"the dense baseline scores {row['score']:.3f} on task {preset.task!r} at "
              f"{preset.seq_len} tokens (seed {seed}), below min_baseline_score "
              f"{preset.min_baseline_score}: the task is not solved, so the variants are not "
              "compared; train longer or change the preset")
      rows.append(row)
      if on_row:
        on_row(rows)
  return rows, True


def _finished_full_head(out_dir, seed):
  """The full model's drawn (layer, head) if ``runs/full_s<seed>`` finished, else None."""
  path = os.path.join(out_dir, "runs", f"full_s{seed}", "result.json")
  try:
    with open(path) as f:
      return tuple(json.load(f)["analysis"]["retrieval_head"])
  except (OSError, KeyError, ValueError):
    return None


def _fmt(x, nd=3):
  return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def _row_line(row):
  return (f"  {row['variant']:<18} seed {row['seed']}: score {_fmt(row['score'])} "
          f"bpb {_fmt(row['bpb'])} sparsity {_fmt(row['sparsity'])} "
          f"conc {_fmt(row['concentration'])} recall {_fmt(row['proxy_recall'])} "
          f"decode {_fmt(row['decode_ms'], 2)} ms")


def _ok(x):
  return x is not None and not (isinstance(x, float) and math.isnan(x))


def aggregate(rows):
  """Aggregated rows per (task, seq_len, variant): per metric mean with a 95% bootstrap interval
  over seeds, and paired differences (by seed) of score, bpb and concentration against
  "full", "posthoc_proxy" and "posthoc_oracle" with their intervals.

  Returns:
    list of dicts: "task", "seq_len", "variant", "n", "<metric>" {"mean", "lo", "hi", "n"},
    "diff_vs_<variant>" {metric: {"diff", "lo", "hi", "n"}}.
  """
  from experiments.coadaptation_analysis import paired_bootstrap
  out = []
  cells = sorted({(r.get("task", "copy"), r.get("seq_len", 0)) for r in rows})
  for task, L in cells:
    cell = [r for r in rows if (r.get("task", "copy"), r.get("seq_len", 0)) == (task, L)]
    by = {v: {r["seed"]: r for r in cell if r["variant"] == v} for v in VARIANTS}
    for v in VARIANTS:
      if not by[v]:
        continue
      agg = {"task": task, "seq_len": L, "variant": v, "n": len(by[v])}
      for m in METRICS:
        vals = [r[m] for r in by[v].values() if _ok(r.get(m))]
        if vals:
          ci = paired_bootstrap(vals, [0.0] * len(vals))
          agg[m] = {"mean": ci["diff"], "lo": ci["lo"], "hi": ci["hi"], "n": ci["n"]}
      refs = ("full", *POSTHOC) + (("local_global_rope",) if v == "local_global_nope" else ())
      for ref in refs:
        if ref == v or not by[ref]:
          continue
        diffs = {}
        for m in ("score", "bpb", "concentration"):
          seeds = sorted(s for s in by[v] if s in by[ref] and _ok(by[v][s].get(m))
                         and _ok(by[ref][s].get(m)))
          if seeds:
            diffs[m] = paired_bootstrap([by[v][s][m] for s in seeds],
                                        [by[ref][s][m] for s in seeds])
        if diffs:
          agg[f"diff_vs_{ref}"] = diffs
      out.append(agg)
  return out


SEED_CLAIMS = {
    "full": "baseline",
    "posthoc_proxy": "81% sparse: -2.5 to -5 pts; top-19% blocks hold ~60% of the mass",
    "posthoc_oracle": "(not in the source: pruning by true attention mass)",
    "sparse_none": "trained at 81%: -0.48 pts; >95% of the mass in the top 19%",
    "sparse_ste": "trained at 81%: -0.48 pts; >95% of the mass in the top 19%",
    "sparse_gumbel": "trained at 81%: -0.48 pts; >95% of the mass in the top 19%",
    "sparse_distill": "trained at 81%: -0.48 pts; >95% of the mass in the top 19%",
    "local_global_nope": "~83% sparse: -0.3 to -0.8 pts; NoPE global >= RoPE global",
    "local_global_rope": "~83% sparse: -0.3 to -0.8 pts",
    "csa": "~90% sparse: -0.5 to -1.0 pts",
    "csa_two_stage": "~90% sparse: -0.5 to -1.0 pts",
}


def _ci(d, scale=1.0, nd=1, signed=False):
  if not d:
    return "-"
  m = d.get("mean", d.get("diff"))
  f = f"{{:{'+' if signed else ''}.{nd}f}}"
  if d["n"] < 2:
    return f.format(m * scale)
  return f"{f.format(m * scale)} [{d['lo'] * scale:.{nd}f}, {d['hi'] * scale:.{nd}f}]"


def format_table(agg):
  """Markdown tables, one per (task, seq_len): means with 95% bootstrap intervals over seeds;
  score differences are paired by seed (percentage points)."""
  lines = []
  for task, L in sorted({(a["task"], a["seq_len"]) for a in agg}):
    lines += [f"**task {task}, {L} tokens**", "",
              "| variant | n | sparsity all / answers | score (pts) | Δ vs full | Δ vs post-hoc proxy"
              " | Δ vs post-hoc oracle | text bpb | concentration | proxy recall | needle recall |"
              " decode ms |", "|" + "---|" * 12]
    for a in agg:
      if (a["task"], a["seq_len"]) != (task, L):
        continue
      sp = a.get("sparsity", {}).get("mean")
      spa = a.get("sparsity_answers", {}).get("mean")
      spt = f"{_fmt(sp and 100 * sp, 0)} / {_fmt(spa and 100 * spa, 0)}%" if sp is not None \
          else "-"
      dv = [_ci(a.get(f"diff_vs_{r}", {}).get("score"), 100, 1, True)
            for r in ("full", *POSTHOC)]
      lines.append(f"| {a['variant']} | {a['n']} | {spt} | {_ci(a.get('score'), 100)} | "
                   f"{' | '.join(dv)} | {_ci(a.get('bpb'), 1, 3)} | "
                   f"{_ci(a.get('concentration'), 1, 3)} | {_ci(a.get('proxy_recall'), 1, 3)} | "
                   f"{_ci(a.get('needle_recall'), 1, 2)} | {_ci(a.get('decode_ms'), 1, 2)} |")
    lines.append("")
  return "\n".join(lines)


def verdicts(agg, min_baseline_score=0.9):
  """Plain-language checks per cell: baseline solved; trained vs post-hoc (proxy, oracle)
  beyond the 95% interval or not."""
  out = []
  for a in agg:
    head = f"{a['task']} {a['seq_len']}:"
    if a["variant"] == "full" and "score" in a:
      ok = a["score"]["mean"] >= min_baseline_score
      out.append(f"{head} dense baseline {'solved' if ok else 'did NOT solve'} the task "
                 f"(score {100 * a['score']['mean']:.1f}, threshold "
                 f"{100 * min_baseline_score:.0f}).")
    if a["variant"] in SPARSE_VARIANTS:
      for ref in POSTHOC:
        d = a.get(f"diff_vs_{ref}", {}).get("score")
        if not d:
          continue
        if d["n"] < 2:
          sig = "one seed: no interval"
        else:
          sig = "beyond its 95% interval" if d["lo"] > 0 or d["hi"] < 0 else "within its interval"
        out.append(f"{head} {a['variant']} - {ref}: {100 * d['diff']:+.1f} pts "
                   f"[{100 * d['lo']:.1f}, {100 * d['hi']:.1f}] ({sig}, n={d['n']}).")
  return out


# The source's claims, each with the measurement that tests it: (claim, variants measured (the
# best-scoring one is reported), metric, reference, the claimed band in the metric's units).
CLAIMS = (
    ("post-hoc top-K at 81% sparsity costs 2.5-5 pts", ("posthoc_proxy",), "score", "full",
     (-5.0, -2.5)),
    ("trained top-K at 81% sparsity costs ~0.5 pts", SPARSE_VARIANTS, "score", "full",
     (-1.0, 0.0)),
    ("the top 19% of blocks hold ~60% of a dense model's mass", ("full",), "concentration",
     None, (0.5, 0.7)),
    ("after sparse training the top 19% hold >95% of the mass", SPARSE_VARIANTS,
     "concentration", None, (0.95, 1.0)),
    ("local/global 5:1 (~83% sparse) costs 0.3-0.8 pts", ("local_global_nope",), "score", "full",
     (-0.8, -0.3)),
    ("NoPE global layers are at least as good as RoPE ones", ("local_global_nope",), "score",
     "local_global_rope", (0.0, math.inf)),
    ("CSA (~90% sparse) costs 0.5-1.0 pts", ("csa", "csa_two_stage"), "score", "full",
     (-1.0, -0.5)),
)


def claim_verdicts(agg, max_width=10.0):
  """Each of the source's claims (``CLAIMS``) against one (task, length) cell: the measured value
  with its 95% interval and a verdict. "reproduced": the interval meets the claimed band;
  "contradicted": it lies wholly outside (the side is named: a larger or smaller loss for
  scores, lower or higher for mass shares); "inconclusive": it meets the band
  but is wider than ``max_width`` points (scores; 0.1 for mass shares); "untested at this
  scale": the cell lacks the variant.

  Returns:
    list of dicts "task", "seq_len", "n", "claim", "variant", "measured", "verdict".

  Example:
    >>> a = [{"task": "copy", "seq_len": 64, "variant": "full", "n": 3,
    ...       "concentration": {"mean": 0.43, "lo": 0.38, "hi": 0.48, "n": 3}}]
    >>> [v["verdict"] for v in claim_verdicts(a)][2]
    'contradicted (lower)'
  """
  out = []
  for task, L in sorted({(a["task"], a["seq_len"]) for a in agg}):
    cell = {a["variant"]: a for a in agg if (a["task"], a["seq_len"]) == (task, L)}
    for claim, variants, metric, ref, (lo_c, hi_c) in CLAIMS:
      scale = 100.0 if metric == "score" else 1.0
      found = []
      for v in variants:
        d = cell.get(v, {}).get(f"diff_vs_{ref}" if ref else metric)
        d = d.get(metric) if (ref and d) else d
        if d:
          found.append((v, d.get("diff", d.get("mean")) * scale, d["lo"] * scale,
                        d["hi"] * scale, d["n"]))
      row = {"task": task, "seq_len": L, "claim": claim, "variant": "-", "n": 0,
             "measured": "-", "verdict": "untested at this scale"}
      if found:
        v, m, lo, hi, n = max(found, key=lambda f: f[1])
        nd = 1 if metric == "score" else 3
        unit = " pts" if metric == "score" else ""
        row.update(variant=v, n=n, measured=f"{m:+.{nd}f}{unit} [{lo:.{nd}f}, {hi:.{nd}f}]"
                   if ref else f"{m:.{nd}f} [{lo:.{nd}f}, {hi:.{nd}f}]")
        worse, better = ("a larger loss", "a smaller loss") if metric == "score" else (
            "lower", "higher")
        if hi < lo_c:
          row["verdict"] = f"contradicted ({worse})"
        elif lo > hi_c:
          row["verdict"] = f"contradicted ({better})"
        elif hi - lo > (max_width if metric == "score" else max_width / 100):
          row["verdict"] = "inconclusive (interval too wide)"
        else:
          row["verdict"] = "reproduced"
      out.append(row)
  return out


def format_claims(claims, preset=None):
  """Markdown table of ``claim_verdicts`` rows, one per claim and cell."""
  scale = "" if preset is None else (f" ({preset['num_layers']} layers, d_model "
                                     f"{preset['d_model']}, {preset['steps']} steps)")
  lines = [f"**The source's claims at this scale{scale}**", "",
           "| task, length | claim | variant | n | measured (95% interval) | verdict |",
           "|---|---|---|---|---|---|"]
  lines += [f"| {c['task']}, {c['seq_len']} | {c['claim']} | {c['variant']} | {c['n']} | "
            f"{c['measured']} | {c['verdict']} |" for c in claims]
  return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------------

def _save_png(fig, path):
  """Save and close a matplotlib figure as a PNG with an adaptive 128-colour palette (about a
  third of the RGBA file; the plots use few colours). Returns ``path``."""
  import io

  import matplotlib.pyplot as plt
  from PIL import Image
  buf = io.BytesIO()
  fig.savefig(buf, format="png", dpi=110)
  plt.close(fig)
  buf.seek(0)
  Image.open(buf).convert("RGB").quantize(colors=128).save(path, optimize=True)
  return path


def make_figures(out_dir, rows, agg, seed=0):
  """Write PNG figures (matplotlib, Agg) into ``out_dir/figures``; returns their paths.

  * ``gap.png``: score of each trained sparse variant minus post-hoc proxy and minus post-hoc
    oracle against context length, with 95% intervals, per task.
  * ``mass_curves.png``: concentration (oracle) and the proxy's captured share against the kept
    fraction, for the full model and the trained sparse variants.
  * ``heatmaps.png``: one layer/head (the full model's retrieval head), row 0: the full and
    trained models' dense attention (log colour bar) and the kept blocks of the post-hoc
    oracle, post-hoc proxy and trained selections.
  * ``learning_curves.png``: training loss and answer accuracy per trained variant.
  Saved with a 128-colour palette (``_save_png``).
  """
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.colors import LogNorm
  fig_dir = os.path.join(out_dir, "figures")
  os.makedirs(fig_dir, exist_ok=True)
  paths = []
  tasks = sorted({a["task"] for a in agg})
  trained_sparse = [v for v in SPARSE_VARIANTS if any(a["variant"] == v for a in agg)]
  if trained_sparse and any(f"diff_vs_{r}" in a for a in agg for r in POSTHOC):
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks):
      for i, v in enumerate(trained_sparse):
        for ref, ls in zip(POSTHOC, ("-", "--")):
          pts = sorted((a["seq_len"], a[f"diff_vs_{ref}"]["score"]) for a in agg
                       if a["task"] == task and a["variant"] == v and f"diff_vs_{ref}" in a
                       and "score" in a[f"diff_vs_{ref}"])
          if not pts:
            continue
          x = np.array([p[0] for p in pts], float)
          y = np.array([100 * p[1]["diff"] for p in pts])
          err = np.array([[100 * (p[1]["diff"] - p[1]["lo"]), 100 * (p[1]["hi"] - p[1]["diff"])]
                          for p in pts]).T
          ax.errorbar(x * (1 + 0.03 * i), y, yerr=err, ls=ls, marker="o", capsize=3,
                      color=f"C{i}", label=f"{v} - {ref}")
      ax.axhline(0, color="grey", lw=1)
      ax.set_xscale("log", base=2)
      ax.set_xlabel("context length (tokens)")
      ax.set_ylabel("score difference (pts, 95% CI)")
      ax.set_title(f"task {task}", fontsize=9)
      ax.legend(fontsize=6)
    fig.tight_layout()
    paths.append(_save_png(fig, os.path.join(fig_dir, "gap.png")))
  first = sorted({(r["task"], r["seq_len"]) for r in rows})[0]
  by_v = {r["variant"]: r for r in rows if r["seed"] == seed
          and (r["task"], r["seq_len"]) == first}
  curves = {v: r["analysis"].get("mass_curve") for v, r in by_v.items()
            if v == "full" or v in SPARSE_VARIANTS}
  curves = {v: c for v, c in curves.items() if c}
  if curves:
    fig, ax = plt.subplots(figsize=(5, 3.8))
    for i, (v, c) in enumerate(curves.items()):
      ax.plot(c["fraction"], c["oracle"], marker="o", color=f"C{i}", label=f"{v}: oracle")
      ax.plot(c["fraction"], c["proxy"], marker="x", ls="--", color=f"C{i}", label=f"{v}: proxy")
    ax.axvline(0.19, color="grey", ls=":", lw=1)
    ax.set_xlabel("kept fraction of visible blocks (answer-query rule)")
    ax.set_ylabel("share of non-forced attention mass kept")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=6)
    fig.tight_layout()
    paths.append(_save_png(fig, os.path.join(fig_dir, "mass_curves.png")))
  npz = {}
  for v, r in by_v.items():
    path = os.path.join(out_dir, r.get("run", os.path.join("runs", f"{v}_s{seed}")),
                        "analysis.npz")
    if os.path.exists(path):
      npz[v] = dict(np.load(path))
  panels = [(v, "heat") for v in ("full", *SPARSE_VARIANTS) if v in npz and "heat" in npz[v]]
  panels += [(v, "selection") for v in (*POSTHOC, *SPARSE_VARIANTS)
             if v in npz and "selection" in npz[v]]
  if panels:
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.4), squeeze=False)
    head = by_v.get("full", next(iter(by_v.values())))["analysis"]["retrieval_head"]
    for ax, (v, kind) in zip(axes[0], panels):
      a = npz[v][kind]
      if kind == "heat":
        im = ax.imshow(a + 1e-6, norm=LogNorm(vmin=1e-4, vmax=max(1.0, float(a.max()))),
                       cmap="magma", aspect="auto")
        ax.set_title(f"{v}: dense attention", fontsize=8)
        ax.set_xlabel("key (pooled)", fontsize=7)
      else:
        im = ax.imshow(a, cmap="Greys", interpolation="nearest", aspect="auto", vmin=0, vmax=1)
        ax.scatter(npz[v]["needle_blocks"], npz[v]["answer_blocks"] + 0 * npz[v]["needle_blocks"],
                   s=18, facecolors="none", edgecolors="red", label="needle")
        ax.set_title(f"{v}: kept blocks", fontsize=8)
        ax.set_xlabel("key block", fontsize=7)
      ax.set_ylabel("query", fontsize=7)
      fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(f"layer {head[0]} head {head[1]}, seed {seed}, {first[0]} {first[1]} tokens",
                 fontsize=9)
    fig.tight_layout()
    paths.append(_save_png(fig, os.path.join(fig_dir, "heatmaps.png")))
  trained = [v for v in VARIANTS if v in by_v and v not in POSTHOC]
  if trained:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.4))
    for v in trained:
      c = by_v[v]["curves"]
      a1.plot(c["step"], c["loss"], label=v)
      a2.plot(c["step"], c["answer_acc"], label=v)
    a1.set_xlabel("step")
    a1.set_ylabel("train loss")
    a2.set_xlabel("step")
    a2.set_ylabel("train answer accuracy (curriculum span)")
    a2.legend(fontsize=7)
    fig.tight_layout()
    paths.append(_save_png(fig, os.path.join(fig_dir, "learning_curves.png")))
  return paths


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------

DEFINITIONS = {
    "score": "retrieval accuracy (argmax) at the answer positions of held-out episodes, needles "
             "anywhere in the context",
    "bpb": "held-out text bits per byte",
    "sparsity": "1 - kept / causally visible key blocks over every query token (block variants; "
                "windows and CSA by arithmetic)",
    "sparsity_answers": "the same at the answer queries",
    "concentration": "share of the true attention mass outside the always-kept blocks that the "
                     "top round(0.19 V) - forced blocks by true mass hold (V visible blocks), "
                     "over queries that neither keep everything nor nothing by rank; mean over "
                     "layers, kv heads, rows",
    "proxy_recall": "true mass in the proxy's (mean-pooled score's) picks over the true mass in "
                    "the oracle's, same queries and counts",
    "needle_recall": "share of answer queries whose needle's block is kept (best layer, any kv "
                     "head)",
    "decode_ms": "median ms per one-token decode step at the end of a seq_len context (batch 1)",
    "intervals": "95% percentile bootstrap over seeds (paired by seed for differences)",
}


def thin_curves(curves, most=100):
  """Learning curves cut to every k-th logged point plus the last (at most ``most`` + 1), as
  ``results.json`` keeps them; each run's ``result.json`` keeps every logged step.

  Example:
    >>> c = thin_curves({"step": list(range(1, 502)), "loss": [1.0] * 501})
    >>> len(c["step"]), c["step"][:2], c["step"][-1]
    (85, [1, 7], 501)
  """
  out = {}
  for key, v in curves.items():
    k = max(1, -(-len(v) // most))
    out[key] = v[::k] + (v[-1:] if v and (len(v) - 1) % k else [])
  return out


def write_results(out_dir, rows, *, finished, wall_s, meta=None, min_baseline_score=0.9):
  """Write ``results.json`` ({"rows", "aggregate", "meta"}) and ``table.md``; return
  (aggregate, table text, verdict lines)."""
  import jax

  from experiments.train_lib import save_json
  agg = aggregate(rows)
  table = format_table(agg)
  notes = verdicts(agg, min_baseline_score)
  claims = claim_verdicts(agg)
  meta = {"finished": finished, "wall_s": wall_s, "devices": [str(d) for d in jax.devices()],
          "backend": jax.default_backend(), "jax": jax.__version__,
          "python": platform.python_version(), "verdicts": notes, "seed_claims": SEED_CLAIMS,
          "claims": claims, "definitions": DEFINITIONS, **(meta or {})}
  kept = [dict(r, curves=thin_curves(r["curves"])) if r.get("curves") else r for r in rows]
  save_json(os.path.join(out_dir, "results.json"), {"rows": kept, "aggregate": agg, "meta": meta})
  with open(os.path.join(out_dir, "table.md"), "w") as f:
    f.write(table + "\n" + "\n".join(f"- {n}" for n in notes) + "\n\n"
            + format_claims(claims, meta.get("preset")))
  return agg, table, notes


def merge(sources, out_dir):
  """Join finished runs of several output directories (cell groups, tasks, lengths) into one.

  Copies each ``SRC/runs/<variant>_s<seed>/{result.json,analysis.npz}`` to
  ``OUT/runs/<task>_L<seq_len>/<variant>_s<seed>/`` and writes results, table and figures
  (with the preset in ``meta`` when every source's ``config.json`` holds the same one).

  Returns:
    (rows, aggregate).
  """
  import glob
  import shutil

  from experiments.train_lib import ensure_writable_dir, save_json
  ensure_writable_dir(out_dir)
  rows = []
  for src in sources:
    for path in sorted(glob.glob(os.path.join(src, "runs", "*", "result.json"))):
      with open(path) as f:
        row = json.load(f)
      rel = os.path.join("runs", f"{row['task']}_L{row['seq_len']}",
                         f"{row['variant']}_s{row['seed']}")
      if any(r["run"] == rel for r in rows):
        raise ValueError(f"{path}: {rel} appears in two sources")
      dest = os.path.join(out_dir, rel)
      os.makedirs(dest, exist_ok=True)
      npz = os.path.join(os.path.dirname(path), "analysis.npz")
      if os.path.exists(npz):
        shutil.copy(npz, dest)
      row["run"] = rel
      save_json(os.path.join(dest, "result.json"), row)
      rows.append(row)
  if not rows:
    raise ValueError(f"no finished runs under {sources}")
  meta = {"sources": list(sources)}
  presets = []
  for src in sources:
    try:
      with open(os.path.join(src, "config.json")) as f:
        presets.append(json.load(f)["config"])
    except (OSError, KeyError, ValueError):
      presets.append(None)
  if presets[0] is not None and all(p == presets[0] for p in presets):
    meta["preset"] = presets[0]
  agg, _, _ = write_results(out_dir, rows, finished=True, wall_s=None, meta=meta)
  make_figures(out_dir, rows, agg)
  return rows, agg


def override_preset(preset, assignments):
  """A copy of ``preset`` with ``FIELD=VALUE`` strings applied, each value parsed as the field's
  current type (int, float, str, bool: true/false; "none" sets None where the field is None or a
  str).

  Args:
    preset: a ``Preset``.
    assignments: iterable of "field=value" strings.

  Returns:
    The new ``Preset``.

  Raises:
    ValueError: unknown field, malformed assignment or unparsable value.

  Example:
    >>> override_preset(PRESETS["plumbing"], ["lr=1e-3", "steps=5"]).lr
    0.001
  """
  fields = {f.name: f for f in dataclasses.fields(preset)}
  changes = {}
  for a in assignments:
    key, sep, raw = a.partition("=")
    key = key.strip()
    if not sep or key not in fields:
      raise ValueError(f"--set expects FIELD=VALUE with FIELD one of {sorted(fields)}, got {a!r}")
    cur = getattr(preset, key)
    try:
      if raw.lower() == "none" and (cur is None or isinstance(cur, str)):
        val = None
      elif isinstance(cur, bool):
        if raw.lower() not in ("true", "false"):
          raise ValueError(raw)
        val = raw.lower() == "true"
      elif isinstance(cur, int):
        val = int(raw)
      elif isinstance(cur, float):
        val = float(raw)
      elif cur is None:                  # an unset optional field: a number if it parses
        try:
          val = int(raw)
        except ValueError:
          val = raw
      else:
        val = raw
    except ValueError:
      raise ValueError(f"--set {key}: cannot parse {raw!r} as {type(cur).__name__}") from None
    changes[key] = val
  return dataclasses.replace(preset, **changes)


def main(argv=None):
  """Command line entry point (see the module docstring)."""
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv[:1] == ["merge"]:
    mp = argparse.ArgumentParser(prog="coadaptation merge",
                                 description="join finished output directories into one")
    mp.add_argument("sources", nargs="+")
    mp.add_argument("--out", required=True)
    a = mp.parse_args(argv[1:])
    _, agg = merge(a.sources, a.out)
    print(format_table(agg))
    return 0
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--preset", default="default", choices=sorted(PRESETS))
  ap.add_argument("--out", required=True, help="output directory")
  ap.add_argument("--seeds", type=int, default=None, help="number of seeds (default per preset)")
  ap.add_argument("--variants", default=None,
                  help="comma-separated subset of " + ",".join(VARIANTS) + " (default: the "
                       "preset's)")
  ap.add_argument("--steps", type=int, default=None, help="override the preset's training steps")
  ap.add_argument("--lr", type=float, default=None,
                  help="override the preset's peak learning rate (an existing --out made with "
                       "other settings is refused)")
  ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                  help="override any Preset field, e.g. --set curriculum_ramp=0.5 --set "
                       "batch_size=16 (repeatable; an existing --out made with other settings is "
                       "refused)")
  ap.add_argument("--stop-after", type=int, default=None,
                  help="stop after this many training steps (simulated kill; rerun to resume)")
  ap.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
  ap.add_argument("--time-budget", type=float, default=None,
                  help="seconds: stop training (checkpointed) once this much wall time has "
                       "passed, or before a run that a run finished in this call says cannot "
                       "end in time, and exit 3; rerun the same command to continue. Leave "
                       "room for one variant's evaluation (~1 min on the H200) below a hard "
                       "limit")
  ap.add_argument("--context-parallel", type=int, default=1, metavar="N",
                  help="train with every sequence split over N devices (zig-zag layout) and the "
                       "batch over the rest; the full, sparse_none and local/global variants")
  ap.add_argument("--dry-run", action="store_true",
                  help="CPU rehearsal: tiny sizes, Triton kernels in interpret mode (see "
                       "dry_run_preset)")
  args = ap.parse_args(argv)
  preset = PRESETS[args.preset]
  if args.dry_run:
    preset = dry_run_preset(preset)
  if args.steps is not None:
    preset = dataclasses.replace(preset, steps=args.steps,
                                 warmup_steps=min(preset.warmup_steps, max(1, args.steps // 5)))
  try:
    preset = override_preset(preset, args.set)
  except ValueError as e:
    ap.error(str(e))
  if args.lr is not None:
    if not args.lr > 0:
      ap.error(f"--lr must be positive, got {args.lr}")
    preset = dataclasses.replace(preset, lr=args.lr)
  names = preset.variants if args.variants is None else args.variants
  variants = tuple(v.strip() for v in names.split(",") if v.strip())
  unknown = set(variants) - set(VARIANTS)
  if unknown:
    ap.error(f"unknown variants {sorted(unknown)}")
  if args.context_parallel != 1:
    import jax
    if args.context_parallel < 1 or jax.device_count() % args.context_parallel:
      ap.error(f"--context-parallel {args.context_parallel} must divide the "
               f"{jax.device_count()} devices")
    # context-parallel sparse layers take hard top-K only (no gate gradient or distillation);
    # CSA layers do not run context-parallel
    bad = [v for v in variants
           if (v in SPARSE_VARIANTS and v != "sparse_none") or v.startswith("csa")]
    if bad:
      ap.error(f"--context-parallel runs the full, post-hoc, sparse_none and local/global "
               f"variants, not {bad}")
  from experiments.train_lib import ConfigMismatchError
  try:
    bind_output_dir(args.out, preset)
  except (OSError, ConfigMismatchError) as e:
    print(f"[coadaptation] error: {e}", file=sys.stderr)
    return 2
  t0 = time.perf_counter()
  partial = os.path.join(args.out, "partial")

  def on_row(rows):  # partial results while the run goes on (results.json only at the end)
    os.makedirs(partial, exist_ok=True)
    write_results(partial, rows, finished=False, wall_s=time.perf_counter() - t0,
                  meta={"preset": dataclasses.asdict(preset)},
                  min_baseline_score=preset.min_baseline_score)
  deadline = None if args.time_budget is None else time.monotonic() + args.time_budget
  try:
    rows, finished = run_experiment(preset, args.out, seeds=args.seeds, variants=variants,
                                    stop_after=args.stop_after, progress=not args.no_progress,
                                    on_row=on_row, deadline=deadline,
                                    context_parallel=args.context_parallel)
  except BaselineNotSolved as e:
    print(f"[coadaptation] stopped: {e}", file=sys.stderr)
    return 4
  except ConfigMismatchError as e:   # a checkpoint written with another configuration
    print(f"[coadaptation] error: {e}", file=sys.stderr)
    return 2
  wall = time.perf_counter() - t0
  if not finished:
    why = (f"--stop-after {args.stop_after} steps" if args.stop_after is not None
           else f"--time-budget {args.time_budget:g} s")
    print(f"[coadaptation] stopped by {why} ({wall:.1f} s); rerun the same command to resume.")
    return 3
  agg, table, notes = write_results(
      args.out, rows, finished=True, wall_s=wall, min_baseline_score=preset.min_baseline_score,
      meta={"preset": dataclasses.asdict(preset), "sparse_top_k": sparse_top_k(preset)})
  figs = make_figures(args.out, rows, agg)
  print(f"\nCo-adaptation, preset {preset.name}: seq_len {preset.seq_len}, "
        f"{len({r['seed'] for r in rows})} seed(s), {preset.steps} steps, {wall:.1f} s\n")
  print(table)
  print()
  for n in notes:
    print("-", n)
  print(f"\nresults: {os.path.join(args.out, 'results.json')}")
  for f in figs:
    print(f"figure:  {f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
