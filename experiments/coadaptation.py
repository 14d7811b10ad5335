"""Co-adaptation experiment: trained vs post-hoc top-K block sparsity at equal sparsity.

Trains small decoder LMs (``jattn.nn.Transformer``) from scratch on the same data and budget:

  =================  ===================================================================
  full               causal global attention in every layer (the baseline)
  posthoc_topk       the *full* model evaluated with top-K block selection (~81% sparse)
  sparse_none        trained with top-K block sparsity, hard selection (no gate gradient)
  sparse_ste         ... straight-through gate gradient
  sparse_gumbel      ... relaxed (softmax / Gumbel) gate gradient
  sparse_aux         ... hard top-K plus score distillation: the block scorer is trained towards
                     the dense attention's block mass (jattn.sparse.block_score_kl); not run
                     unless named in --variants
  local_global       periodic 5 local (RoPE, window) : 1 global (NoPE) layers
  csa                compressed sparse attention (4 tokens -> 1, top-K entries + window)
  =================  ===================================================================

Data (``experiments.data``): seeded needle retrieval episodes over real-text haystacks (the Python
standard library's source, byte level) plus packed text rows (``jattn.packing.pack_bfd``), with a
curriculum that spreads needles from short to full distance.

Metrics per variant and seed: retrieval accuracy at full distance (``score``), held-out text bits
per byte (``bpb``) and loss, measured attention ``sparsity`` (fraction of causal query-key scores
not computed), ``captured_mass`` (fraction of the layer's full-softmax attention mass that lies
inside what the variant keeps), decode time per token at the longest context (``decode_ms``), and
learning curves.

Usage::

  python -m experiments.coadaptation --preset smoke --out /tmp/coad     # ~1-2 min on CPU
  python -m experiments.coadaptation --preset cpu --out runs/cpu          # < 30 min, 3 seeds
  python -m experiments.coadaptation --preset h200 --out runs/h200        # one H200, ~10 min
  python -m experiments.coadaptation --preset h200 --out /tmp/dry --dry-run  # CPU rehearsal, ~4 min

Writes ``OUT/results.json`` ({"rows": [...], "meta": {...}}), ``OUT/table.md``, PNG figures in
``OUT/figures/`` and per-run state in ``OUT/runs/<variant>_s<seed>/`` (a killed run restarts
where it stopped: finished runs are skipped, the running one resumes from its orbax checkpoint).
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

VARIANTS = ("full", "posthoc_topk", "sparse_none", "sparse_ste", "sparse_gumbel", "sparse_aux",
            "local_global", "csa")
# What runs without --variants: every variant but sparse_aux, which is opt-in (name it in
# --variants).
DEFAULT_VARIANTS = tuple(v for v in VARIANTS if v != "sparse_aux")
TRAINED = tuple(v for v in VARIANTS if v != "posthoc_topk")
SPARSE_GATES = {"sparse_none": "none", "sparse_ste": "ste", "sparse_gumbel": "gumbel"}
SPARSE_VARIANTS = (*SPARSE_GATES, "sparse_aux")   # trained with LayerSpec("sparse")


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
    block_size: sparse key/query block size.
    target_sparsity: block sparsity of the sparse variants (top_k is chosen to get closest).
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
    analysis_rows: eval rows used for attention maps / captured mass.
    curve_points: top_k values of the captured-mass-vs-kept-fraction curve (besides the
      sparse variants' own top_k; computed for seed 0).
    ckpt_every, log_every: checkpoint and learning-curve intervals.
    implementation: attention implementation passed to the model (None: jattn's default).
    score_aux_weight: "sparse_aux": weight w of the score-distillation term
      (``LayerSpec.score_aux_weight``; every layer adds w * its KL).
    aux_gate: "sparse_aux": its gate gradient mode ("none", "ste" or "gumbel").
    aux_pool: "sparse_aux": pooling of the distillation target over a block's queries ("max"
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
  target_sparsity: float = 0.81
  local_per_global: int = 5
  csa_ratio: int = 4
  corpus_bytes: int | None = 4_000_000
  eval_retrieval: int = 64
  eval_text: int = 32
  seeds: int = 1
  curriculum_start: int = 8
  curriculum_ramp: float = 0.7
  param_dtype: str = "float32"
  compute_dtype: str | None = None
  cache_dtype: str = "float32"
  decode_tokens: int = 16
  analysis_rows: int = 4
  curve_points: int = 6
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
    # CI: a 2-core CPU, about 1-2 minutes for all variants. Three layers (periodic 2:1 instead of
    # 5:1 local/global) to keep compile time down; the numbers are not meant to be meaningful.
    "smoke": Preset(name="smoke", seq_len=256, num_layers=3, d_model=32, num_heads=2,
                    num_kv_heads=1, head_dim=16, batch_size=8, steps=20, lr=3e-3,
                    warmup_steps=4, block_size=8, window=32, local_per_global=2, csa_top_k=8,
                    csa_window=16, task="copy", num_pairs=1, num_queries=1, curriculum_start=4,
                    corpus_bytes=300_000, eval_retrieval=16, eval_text=8, decode_tokens=4,
                    analysis_rows=2, curve_points=2, ckpt_every=10, log_every=4),
    # CPU: aimed at < 30 minutes on an idle 2-core CPU for every variant and 3 seeds. Three layers
    # (the local/global variant is 2 local : 1 global) and 128 tokens in 32 blocks of 4.
    "cpu": Preset(name="cpu", seq_len=128, num_layers=3, d_model=64, num_heads=4, num_kv_heads=2,
                  head_dim=16, batch_size=16, steps=200, lr=3e-3, warmup_steps=20, block_size=4,
                  window=16, local_per_global=2, csa_top_k=4, csa_window=8, task="copy",
                  num_values=32, num_pairs=1, num_queries=1, text_fraction=0.125,
                  corpus_bytes=2_000_000, eval_retrieval=128, eval_text=32, seeds=3,
                  curriculum_start=4, decode_tokens=8, analysis_rows=4, ckpt_every=50),
    # One H200, ~10 minutes for every variant (1 seed) at 8K context: per variant ~15 s compile
    # + ~55 s eval/analysis/decode, and a step at full length ~0.9 s with fp32 attention (less
    # with bf16); 300 steps fit about 9 minutes of wall time in bf16 (two --time-budget calls).
    "h200": Preset(name="h200", seq_len=8192, num_layers=6, d_model=256, num_heads=4,
                   num_kv_heads=2, head_dim=64, batch_size=8, steps=300, lr=2e-3,
                   warmup_steps=50, block_size=64, window=512, csa_top_k=64, csa_window=512,
                   task="copy", num_values=32, num_pairs=1, num_queries=1, corpus_bytes=None,
                   text_fraction=0.125,
                   eval_retrieval=64, eval_text=32, cache_dtype="bfloat16",
                   compute_dtype="bfloat16", decode_tokens=32, analysis_rows=2,
                   ckpt_every=100, log_every=20),
}


# --------------------------------------------------------------------------------------------------
# Sparsity bookkeeping
# --------------------------------------------------------------------------------------------------

def causal_pairs(n):
  """Number of causal (query, key) pairs of a length-``n`` sequence."""
  return n * (n + 1) // 2


def block_sparsity(num_blocks, top_k, num_init=1, num_local=1):
  """Causal block sparsity of top-K selection with always-kept initial and local blocks.

  Query block i (0-based) keeps ``min(i + 1, num_init + num_local + top_k)`` of its ``i + 1``
  causally visible key blocks.

  Args:
    num_blocks: blocks along the sequence.
    top_k: selected blocks beyond the initial and local ones.
    num_init, num_local: always-kept blocks.

  Returns:
    Fraction of causal blocks skipped.

  Example:
    >>> round(block_sparsity(32, 1), 3)
    0.824
  """
  keep = num_init + num_local + top_k
  kept = sum(min(i + 1, keep) for i in range(num_blocks))
  return 1.0 - kept / causal_pairs(num_blocks)


def top_k_for_sparsity(seq_len, block_size, target):
  """The top_k whose causal block sparsity is closest to ``target``.

  Example:
    >>> top_k_for_sparsity(512, 16, 0.81)
    1
  """
  n = seq_len // block_size
  ks = range(1, max(2, n))
  return min(ks, key=lambda k: abs(block_sparsity(n, k) - target))


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
  """top_k of the sparse variants for this preset (closest to ``target_sparsity``)."""
  return top_k_for_sparsity(preset.seq_len, preset.block_size, preset.target_sparsity)


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
  if variant in SPARSE_VARIANTS or variant == "posthoc_topk":
    aux = dict(score_aux_weight=float(preset.score_aux_weight),
               score_aux_pool=preset.aux_pool) if variant == "sparse_aux" else {}
    return tuple(LayerSpec("sparse", block_size=bs, q_block_size=bs, top_k=sparse_top_k(preset),
                           gate_grad=_gate_name(variant_gate(preset, variant)), **aux)
                 for _ in range(n))
  if variant == "local_global":
    layers = list(local_global_schedule(n, preset.local_per_global, preset.window))
    if all(s.kind == "local" for s in layers):  # fewer layers than one period: keep one global
      layers[-1] = LayerSpec("global", rope_base=None)
    return tuple(layers)
  if variant == "csa":
    return tuple(LayerSpec("csa", compress_ratio=preset.csa_ratio, top_k=preset.csa_top_k,
                           window=preset.csa_window, csa_mode="compressed") for _ in range(n))
  raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")


def variant_gate(preset, variant):
  """The gate gradient mode of a sparse variant ("none" for posthoc_topk; ``preset.aux_gate``
  for sparse_aux)."""
  if variant == "sparse_aux":
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


def model_config(preset, layers):
  """The ``jattn.nn.TransformerConfig`` for ``preset`` with the given layer specs."""
  import jax.numpy as jnp
  from jattn.nn import TransformerConfig
  vocab = preset.task_config().vocab.size
  kwargs = dict(vocab_size=vocab, num_layers=preset.num_layers, d_model=preset.d_model,
                num_heads=preset.num_heads, num_kv_heads=preset.num_kv_heads,
                head_dim=preset.head_dim, layers=tuple(layers))
  # compute_dtype sets the activations' dtype too: with dtype=None, fp32 norms would hand the
  # attention kernels fp32 q/k/v (IEEE fp32 dots, ~20x slower on the GPU than bf16).
  dtype = None if preset.compute_dtype is None else jnp.dtype(preset.compute_dtype)
  return TransformerConfig(**kwargs, implementation=preset.implementation,
                           interpret=preset.interpret,
                           param_dtype=jnp.dtype(preset.param_dtype), dtype=dtype)


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
    >>> p = dry_run_preset(PRESETS["h200"])
    >>> p.seq_len, p.steps, p.implementation, p.interpret
    (1024, 3, 'triton', True)
  """
  return dataclasses.replace(
      preset, name=preset.name + "-dryrun", seq_len=min(preset.seq_len, 1024), steps=3,
      batch_size=2, warmup_steps=1, eval_retrieval=2, eval_text=2, decode_tokens=2,
      analysis_rows=1, curve_points=2, ckpt_every=2, log_every=1, seeds=1,
      implementation="triton", interpret=True)


def build_model(preset, variant, seed):
  """A freshly initialised ``jattn.nn.Transformer`` for a variant (parameters from ``seed``)."""
  from flax import nnx
  from jattn.nn import Transformer
  return Transformer(model_config(preset, variant_layers(preset, variant)),
                     rngs=nnx.Rngs(seed))


def uses_segments(variant):
  """Whether a variant's model takes packed segment ids (CSA layers reject them: their pooled
  windows would straddle documents, so CSA trains on packed text rows without the mask)."""
  return variant != "csa"


# --------------------------------------------------------------------------------------------------
# One run: train (resumable), evaluate, analyse
# --------------------------------------------------------------------------------------------------

class Context:
  """Shared, loaded-once state of an experiment invocation: corpora, eval sets, mesh.

  Args:
    preset: a ``Preset``.
    devices: devices for the data-parallel mesh (default: all).
  """

  def __init__(self, preset, devices=None):
    from experiments import data
    from experiments.train_lib import make_mesh
    self.preset = preset
    self.task = preset.task_config()
    t0 = time.perf_counter()
    self.train_text, self.heldout_text = data.load_python_corpus(max_bytes=preset.corpus_bytes)
    self.eval_retrieval, self.eval_text = data.eval_sets(
        self.task, self.heldout_text, num_retrieval=preset.eval_retrieval,
        num_text=preset.eval_text, seed=10_007)
    self.mesh = make_mesh(devices)
    self.load_s = time.perf_counter() - t0

  def stream(self, seed):
    """The training stream of a seed (identical for every variant of that seed)."""
    from experiments import data
    p = self.preset
    return data.TrainStream(self.task, self.train_text, p.batch_size, p.steps, seed,
                            data.Curriculum(p.curriculum_start, p.curriculum_ramp))


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
    >>> bind_output_dir(d, PRESETS["smoke"]); bind_output_dir(d, PRESETS["smoke"])
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
  from experiments.train_lib import Trainer
  p = ctx.preset
  model = build_model(p, variant, seed)
  trainer = Trainer(model, _opt(p), mesh=ctx.mesh, seed=seed, use_segments=uses_segments(variant),
                    compute_dtype=p.compute_dtype)
  finished = trainer.fit(ctx.stream(seed), p.steps, ckpt_dir=os.path.join(run_dir, "ckpt"),
                         ckpt_every=p.ckpt_every, stop_after=stop_after, log_every=p.log_every,
                         desc=f"{variant} s{seed}", progress=progress,
                         extra_record={"variant": variant, "seed": seed, "preset": p.name},
                         deadline=deadline,
                         config=dict(experiment_config(p), variant=variant, seed=seed))
  return trainer, finished


def posthoc_state(ctx, full_trainer):
  """The full model's trained weights run with post-hoc top-K block sparsity.

  Uses ``jattn.nn.transformer.sparsify``: every global layer becomes a "sparse" layer with the
  sparse variants' block size and top_k (same RoPE), parameters copied unchanged.

  Returns:
    (graphdef, params, rest) of the post-hoc sparse model.
  """
  from flax import nnx
  from jattn.nn.transformer import sparsify
  p = ctx.preset
  model = sparsify(full_trainer.model(), sparse_top_k(p), block_size=p.block_size,
                   q_block_size=p.block_size)
  want = variant_layers(p, "posthoc_topk")
  if tuple(model.config.layers) != tuple(want):
    raise ValueError(f"sparsify gave layers {model.config.layers}, expected {want}")
  return nnx.split(model, nnx.Param, ...)


# --------------------------------------------------------------------------------------------------
# Analysis: per-layer q/k, selections, captured mass, attention maps
# --------------------------------------------------------------------------------------------------

def layer_qk(graphdef, params, rest, tokens):
  """Per-layer attention inputs of a model (``Transformer(..., return_qk=True)``).

  Args:
    graphdef, params, rest: an ``nnx.split(model, nnx.Param, ...)`` of a ``jattn.nn.Transformer``.
    tokens: int [batch, seq].

  Returns:
    list over layers of dicts with q [batch, seq, heads, d] and k [batch, seq, kv_heads, d]
    (fp32 jax arrays, after norms and RoPE, as the layer's attention sees them).
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


def tile_sparsity(tiles, block_size, seq_len):
  """Element-level causal sparsity of square block tiles (q_block_size == block_size).

  A kept off-diagonal tile holds ``bs^2`` causal pairs, a kept diagonal tile ``bs (bs + 1) / 2``;
  the result is 1 - kept pairs / causal pairs, averaged over the leading axes.

  Args:
    tiles: bool [..., nq, nk] kept tiles (``BlockSelection.tile_mask()``).
    block_size: block size.
    seq_len: sequence length (nq * block_size).

  Returns:
    float.

  Example:
    >>> round(tile_sparsity(np.tril(np.ones((4, 4), bool)), 16, 64), 6)
    0.0
  """
  t = np.asarray(tiles)
  bs, nq = block_size, t.shape[-2]
  diag = np.eye(nq, dtype=bool)
  below = np.tril(np.ones((nq, nq), bool), -1)
  kept = (t & below).sum((-2, -1)) * bs * bs + (t & diag).sum((-2, -1)) * bs * (bs + 1) // 2
  return float(1.0 - kept.mean() / causal_pairs(seq_len))


def tile_block_sparsity(tiles):
  """Causal *block* sparsity: 1 - kept tiles / causal tiles (the seed's "81% block sparsity")."""
  t = np.asarray(tiles)
  nq = t.shape[-2]
  return float(1.0 - (t & np.tril(np.ones((nq, nq), bool))).sum((-2, -1)).mean()
               / causal_pairs(nq))


def _select(q, k, preset, top_k=None):
  from jattn import sparse
  bs = preset.block_size
  return sparse.select_blocks(q, k, block_size=bs, q_block_size=bs, causal=True,
                              top_k=sparse_top_k(preset) if top_k is None else top_k)


_SELECT_CACHE = {}


def select_all_layers(qks, preset, top_k=None):
  """Top-K block selections and captured mass of every layer in one jitted call.

  Args:
    qks: ``layer_qk`` output.
    preset: the ``Preset`` (block size; top_k default ``sparse_top_k``).
    top_k: override top_k.

  Returns:
    (tiles: list of bool numpy [b, kv_heads, nq, nk] kept tiles (``BlockSelection.tile_mask``),
    masses: list of float, ``jattn.captured_mass`` of each layer's selection).
  """
  import jax
  from jattn import sparse
  tk = sparse_top_k(preset) if top_k is None else top_k
  key = (preset.block_size, tk)
  if key not in _SELECT_CACHE:
    def f(qks):
      sels = [_select(d["q"], d["k"], preset, top_k=tk) for d in qks]
      masses = [sparse.captured_mass(d["q"], d["k"], sel, causal=True)
                for d, sel in zip(qks, sels)]
      return [sel.tile_mask() for sel in sels], masses
    _SELECT_CACHE[key] = jax.jit(f)
  tiles, masses = _SELECT_CACHE[key](qks)
  return [np.asarray(t) for t in tiles], [float(m) for m in masses]


def score_kl_all_layers(qks, preset):
  """Per layer, ``jattn.sparse.block_score_kl`` of the layer's q/k (the sparse variants' rules):
  how far the mean-pooled block scorer's distribution over candidate blocks is from the dense
  attention's block mass, pooled over queries by ``preset.aux_pool`` for every variant (nats;
  what "sparse_aux" trains on). One jitted call.

  Returns:
    list of float, one per layer.
  """
  import jax
  from jattn import sparse
  bs, pool = preset.block_size, preset.aux_pool
  key = ("kl", bs, pool)
  if key not in _SELECT_CACHE:
    _SELECT_CACHE[key] = jax.jit(lambda qks: [
        sparse.block_score_kl(d["q"], d["k"], block_size=bs, q_block_size=bs, query_pool=pool)
        for d in qks])
  return [float(x) for x in _SELECT_CACHE[key](qks)]


def _needle_kept(tiles, ans_pos, needle_of, block_size):
  """Fraction of answer queries whose needle's block is kept (by any kv head), best layer."""
  best = []
  r = np.arange(ans_pos.shape[0])[:, None]
  for t in tiles:                                                  # [b, hk, nq, nk]
    hit = t[r, :, ans_pos // block_size, needle_of // block_size]   # [b, a, hk]
    best.append(float(hit.any(-1).mean()))
  return max(best)


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


def _dense_stats(qks, layers, rows, ans_pos, needle_of):
  """Jitted: per layer, dense attention from answers to needles [layers, heads] and, for local
  layers, the mean dense-softmax mass inside the window."""
  import jax
  import jax.numpy as jnp
  from jattn.nn.transformer import attention_probabilities
  windows = tuple(spec.window if spec.kind == "local" else None for spec in layers)
  if windows in _DENSE_CACHE:
    f = _DENSE_CACHE[windows]
    hits, masses = f(qks, rows, ans_pos, needle_of)
    return np.asarray(hits), [float(m) for m in masses]

  @jax.jit
  def f(qks, rows, ans_pos, needle_of):
    hits, masses = [], []
    for d, w in zip(qks, windows):
      P = attention_probabilities(d["q"], d["k"], None)                # [b, hq, s, s]
      hits.append(P[rows, :, ans_pos, needle_of].mean((0, 1)))         # [hq]
      if w is not None:
        s = P.shape[-1]
        i, j = jnp.arange(s)[:, None], jnp.arange(s)[None]
        masses.append(jnp.mean(jnp.sum(jnp.where(j > i - w, P, 0.0), -1)))
    return jnp.stack(hits), masses
  _DENSE_CACHE[windows] = f
  hits, masses = f(qks, rows, ans_pos, needle_of)
  return np.asarray(hits), [float(m) for m in masses]


_DENSE_CACHE = {}


def _probs(q, k, spec=None):
  """Jitted ``jattn.nn.attention_probabilities``."""
  import jax
  from jattn.nn.transformer import attention_probabilities
  if "probs" not in _DENSE_CACHE:
    _DENSE_CACHE["probs"] = jax.jit(attention_probabilities, static_argnums=2)
  return _DENSE_CACHE["probs"](q, k, spec)


def analyse(ctx, variant, graphdef, params, rest, *, retrieval_head=None, curve=True):
  """Attention analysis of one model on the first ``analysis_rows`` held-out episodes.

  What "kept" means per variant: trained sparse -> its own top-K selection; full ->
  nothing dropped (its post-hoc top-K numbers are reported under "posthoc_*"); posthoc_topk ->
  the top-K selection on the full model's q/k; local_global -> the window in local layers, all
  in global layers; csa -> sparsity from the layer arithmetic (``csa_sparsity``), no captured mass
  (its compressed entries are not a subset of the raw keys).

  Args:
    ctx: a ``Context``.
    variant: the model's variant.
    graphdef, params, rest: the model.
    retrieval_head: (layer, head) to draw; default: the head whose dense attention from the
      answer queries to their needles is largest on this model.
    curve: also compute the captured-mass-vs-kept-fraction curve (a few more selections).

  Returns:
    dict: "sparsity", "captured_mass", "needle_block_kept", "mass_curve" (list of
    [kept_fraction, captured_mass] over top_k; full and sparse variants), "score_kl" /
    "layer_score_kl" (``score_kl_all_layers``; full and sparse variants), "retrieval_head",
    "needle_attention" [layers, heads] (dense attention mass from answers to needles), and figure
    arrays: "heat" [nb, nb] (the drawn head's attention as the model computes it, pooled),
    "heat_full" (its dense-softmax map), "selection" [nqb, nkb] bool (or None).
  """
  import jax.numpy as jnp
  p = ctx.preset
  ev = ctx.eval_retrieval
  n = p.analysis_rows
  tokens = ev["inputs"][:n]
  s, bs = tokens.shape[1], p.block_size
  layers = variant_layers(p, variant)
  qks = layer_qk(graphdef, params, rest, tokens)
  ans_pos, needle_pos = ev["answer_pos"][:n], ev["needle_pos"][:n]
  needle_of = needle_targets(ctx.task, tokens, ans_pos, needle_pos)
  rows = np.arange(n)[:, None]
  hq = qks[0]["q"].shape[2]
  g = hq // qks[0]["k"].shape[2]
  scores, local_mass = _dense_stats(qks, layers, rows, ans_pos, needle_of)
  if retrieval_head is None:
    retrieval_head = tuple(int(x) for x in np.unravel_index(np.argmax(scores), scores.shape))
  L, H = retrieval_head
  pool = max(1, s // 128)
  P_full = _probs(qks[L]["q"][:1], qks[L]["k"][:1])[0, H]                      # [s, s]
  out = {"retrieval_head": list(retrieval_head), "needle_attention": scores.tolist(),
         "needle_blocks": needle_of[0] // bs, "answer_blocks": ans_pos[0] // bs,
         "heat_full": np.asarray(pool_blocks(P_full, pool)), "selection": None,
         "mass_curve": None}
  out["heat"] = out["heat_full"]
  if variant == "full" or variant == "posthoc_topk" or variant in SPARSE_VARIANTS:
    tiles, masses = select_all_layers(qks, p)
    sparsity = float(np.mean([tile_sparsity(t, bs, s) for t in tiles]))
    bsp = float(np.mean([tile_block_sparsity(t) for t in tiles]))
    mass = float(np.mean(masses))
    kept = _needle_kept(tiles, ans_pos, needle_of, bs)
    out["selection"] = tiles[L][0, H // g]
    out["layer_captured_mass"] = masses
    out["layer_score_kl"] = score_kl_all_layers(qks, p)
    out["score_kl"] = float(np.mean(out["layer_score_kl"]))
    if variant == "full":
      out.update(sparsity=0.0, block_sparsity=0.0, captured_mass=1.0, needle_block_kept=1.0,
                 posthoc_sparsity=sparsity, posthoc_block_sparsity=bsp,
                 posthoc_captured_mass=mass, posthoc_needle_block_kept=kept)
    else:
      out.update(sparsity=sparsity, block_sparsity=bsp, captured_mass=mass,
                 needle_block_kept=kept)
      m = np.kron(tiles[L][0, H // g], np.ones((bs, bs), bool))[:s, :s]
      Pm = jnp.where(m, P_full, 0.0)
      out["heat"] = np.asarray(pool_blocks(Pm / jnp.maximum(Pm.sum(-1, keepdims=True), 1e-30),
                                           pool))
    if curve:
      nb = s // bs
      ks = sorted(set(int(x) for x in np.geomspace(1, max(1, nb - 2), p.curve_points).round())
                  | {sparse_top_k(p)})
      points = []
      for tk in ks:
        sk, mk = (tiles, masses) if tk == sparse_top_k(p) else select_all_layers(qks, p, top_k=tk)
        points.append([1.0 - float(np.mean([tile_sparsity(x, bs, s) for x in sk])),
                       float(np.mean(mk))])
      out["mass_curve"] = points
  elif variant == "local_global":
    it = iter(local_mass)
    masses = [next(it) if spec.kind == "local" else 1.0 for spec in layers]
    out["captured_mass"] = float(np.mean(masses))
    out["sparsity"] = float(np.mean([window_sparsity(s, spec.window) if spec.kind == "local"
                                     else 0.0 for spec in layers]))
    out["needle_block_kept"] = float(max(
        1.0 if spec.kind == "global" else float(np.mean(ans_pos - needle_of < spec.window))
        for spec in layers))
    if layers[L].kind == "local":
      P_loc = _probs(qks[L]["q"][:1], qks[L]["k"][:1], layers[L])[0, H]
      out["heat"] = np.asarray(pool_blocks(P_loc, pool))
  else:  # csa
    out.update(sparsity=csa_sparsity(s, p.csa_ratio, p.csa_top_k, p.csa_window),
               captured_mass=None, needle_block_kept=None)
  return out


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

ROW_FIELDS = ("variant", "seed", "sparsity", "score", "loss", "bpb", "captured_mass", "decode_ms",
              "needle_block_kept", "answer_nll", "train_loss", "train_answer_acc", "steps",
              "train_time_s")


def _final(curves, key, last=3):
  vals = [v for v in curves.get(key, [])[-last:] if v is not None]
  return float(np.mean(vals)) if vals else None


def _save_analysis(path, an):
  arrays = {k: np.asarray(v) for k, v in an.items()
            if k in ("heat", "heat_full", "selection", "needle_blocks", "answer_blocks")
            and v is not None}
  np.savez_compressed(path, **arrays)


def _scalar_analysis(an):
  keep = ("sparsity", "block_sparsity", "captured_mass", "needle_block_kept",
          "layer_captured_mass", "posthoc_sparsity", "posthoc_block_sparsity",
          "posthoc_captured_mass", "posthoc_needle_block_kept", "retrieval_head",
          "needle_attention", "mass_curve", "score_kl", "layer_score_kl")
  return {k: an[k] for k in keep if k in an}


def inference_state(ctx, variant, trainer):
  """The model a trained variant is evaluated with.

  "sparse_gumbel" (and "sparse_aux" with aux_gate "gumbel") perturbs its block scores with
  Gumbel noise only to train; it is evaluated (and decoded) with the deterministic hard top-K of
  the same weights (gate "none").

  Returns:
    (graphdef, params, rest).
  """
  from flax import nnx
  from jattn.nn.transformer import with_config
  if variant_gate(ctx.preset, variant) != "gumbel":
    return trainer.graphdef, trainer.params, trainer.rest
  cfg = model_config(ctx.preset, variant_layers(ctx.preset, "sparse_none"))
  return nnx.split(with_config(trainer.model(), cfg), nnx.Param, ...)


def finish_run(ctx, variant, seed, run_dir, trainer, *, graphdef=None, params=None, rest=None,
               retrieval_head=None, train_curves=None):
  """Evaluate and analyse a trained (or post-hoc) model and write ``run_dir/result.json``.

  Returns:
    the result row (dict).
  """
  p = ctx.preset
  if graphdef is None and variant in SPARSE_VARIANTS and variant_gate(p, variant) == "gumbel":
    graphdef, params, rest = inference_state(ctx, variant, trainer)
  gd = graphdef or trainer.graphdef
  pr = params if params is not None else trainer.params
  rs = rest if rest is not None else trainer.rest
  kw = {} if graphdef is None else dict(graphdef=gd, params=pr, rest=rs)
  t0 = time.perf_counter()
  ret = trainer.evaluate(ctx.eval_retrieval, **kw)
  txt = trainer.evaluate(ctx.eval_text, **kw)
  t_eval = time.perf_counter()
  pr = trainer.cast(pr)  # analysis and decode run in the compute dtype, as training did
  an = analyse(ctx, variant, gd, pr, rs, retrieval_head=retrieval_head, curve=seed == 0)
  t_an = time.perf_counter()
  dms = decode_ms(gd, pr, rs, ctx.eval_retrieval["inputs"][0], num_tokens=p.decode_tokens,
                  dtype=p.cache_dtype)
  phases = {"eval_s": t_eval - t0, "analysis_s": t_an - t_eval,
            "decode_s": time.perf_counter() - t_an}
  print(f"  {variant} s{seed}: " + " ".join(f"{k} {v:.1f}" for k, v in phases.items()),
        flush=True)
  curves = train_curves if train_curves is not None else trainer.curves
  row = {
      "variant": variant, "seed": seed, "sparsity": an["sparsity"], "score": ret["score"],
      "loss": txt["text_nll"], "bpb": txt["bpb"], "captured_mass": an["captured_mass"],
      "decode_ms": dms, "needle_block_kept": an["needle_block_kept"],
      "answer_nll": ret["answer_nll"], "train_loss": _final(curves, "loss"),
      "train_answer_acc": _final(curves, "answer_acc"), "steps": p.steps,
      "train_time_s": curves["time_s"][-1] if curves.get("time_s") else None,
      "eval_time_s": time.perf_counter() - t0, "phase_s": phases,
      "analysis": _scalar_analysis(an), "curves": curves,
  }
  from experiments.train_lib import save_json
  _save_analysis(os.path.join(run_dir, "analysis.npz"), an)
  save_json(os.path.join(run_dir, "result.json"), row)
  return row


def run_experiment(preset, out_dir, *, seeds=None, variants=DEFAULT_VARIANTS, stop_after=None,
                   progress=True, devices=None, log=print, on_row=None, deadline=None):
  """Train, evaluate and analyse every (variant, seed); resumable.

  Finished runs (``runs/<variant>_s<seed>/result.json``) are loaded, not redone; an unfinished run
  resumes from its checkpoint.

  Args:
    preset: a ``Preset``.
    out_dir: output directory.
    seeds: number of seeds (default ``preset.seeds``); seeds are 0..seeds-1.
    variants: variants to run ("posthoc_topk" needs "full").
    stop_after: stop after this many training steps in this call (a simulated kill; the next
      call continues), or None.
    progress: tqdm progress bars.
    devices: devices of the data-parallel mesh (default: all).
    log: print function.
    on_row: optional callback ``on_row(rows)`` after every finished run (partial results).

  Returns:
    (rows, finished): the result rows and whether every run completed.
  """
  variants = tuple(v for v in VARIANTS if v in variants)
  if "posthoc_topk" in variants and "full" not in variants:
    raise ValueError("posthoc_topk evaluates the full model: include 'full' in variants")
  seeds = preset.seeds if seeds is None else seeds
  ctx = Context(preset, devices)
  log(f"[coadaptation] preset={preset.name} seq_len={preset.seq_len}"
      f" devices={ctx.mesh.devices.size} train_text={len(ctx.train_text.tokens)} bytes"
      f" ({len(ctx.train_text.names)} files)"
      f" sparse top_k={sparse_top_k(preset)} block={preset.block_size}")
  budget = stop_after
  rows = []
  for seed in range(seeds):
    full_trainer, full_head = None, None
    for variant in variants:
      run_dir = os.path.join(out_dir, "runs", f"{variant}_s{seed}")
      os.makedirs(run_dir, exist_ok=True)
      done_path = os.path.join(run_dir, "result.json")
      if os.path.exists(done_path):
        with open(done_path) as f:
          row = json.load(f)
        rows.append(row)
        if variant == "full":
          full_head = tuple(row["analysis"]["retrieval_head"])
        continue
      if variant == "posthoc_topk":
        if full_trainer is None:  # restore the finished full model from its checkpoint
          full_trainer, _ = train_run(ctx, "full", seed,
                                      os.path.join(out_dir, "runs", f"full_s{seed}"),
                                      stop_after=0, progress=False)
        gd, pr, rs = posthoc_state(ctx, full_trainer)
        row = finish_run(ctx, variant, seed, run_dir, full_trainer, graphdef=gd, params=pr,
                         rest=rs, retrieval_head=full_head, train_curves=full_trainer.curves)
        rows.append(row)
        log(_row_line(row))
        if on_row:
          on_row(rows)
        continue
      if (budget is not None and budget <= 0) or (
          deadline is not None and time.monotonic() > deadline):
        return rows, False
      trainer, finished = train_run(ctx, variant, seed, run_dir, stop_after=budget,
                                    progress=progress, deadline=deadline)
      if budget is not None:
        budget -= trainer.step - trainer.fit_start_step
      if not finished:
        return rows, False
      if full_head is None and variant != "full":  # full ran in another process (same out_dir)
        full_head = _finished_full_head(out_dir, seed)
      row = finish_run(ctx, variant, seed, run_dir, trainer, retrieval_head=full_head)
      if variant == "full":
        full_trainer, full_head = trainer, tuple(row["analysis"]["retrieval_head"])
      rows.append(row)
      log(_row_line(row))
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
  return (f"  {row['variant']:<14} seed {row['seed']}: score {_fmt(row['score'])} "
          f"bpb {_fmt(row['bpb'])} sparsity {_fmt(row['sparsity'])} "
          f"mass {_fmt(row['captured_mass'])} decode {_fmt(row['decode_ms'], 2)} ms")


def summarise(rows):
  """Per-variant mean and standard deviation (over seeds) of the numeric row fields.

  Returns:
    dict variant -> {field: {"mean", "std", "n"}}.
  """
  out = {}
  for v in VARIANTS:
    rs = [r for r in rows if r["variant"] == v]
    if not rs:
      continue
    d = {}
    for f in ("sparsity", "score", "loss", "bpb", "captured_mass", "decode_ms",
              "needle_block_kept", "answer_nll", "train_answer_acc"):
      vals = [r[f] for r in rs if r.get(f) is not None and not
              (isinstance(r[f], float) and math.isnan(r[f]))]
      if vals:
        d[f] = {"mean": float(np.mean(vals)), "std": float(np.std(vals, ddof=1))
                if len(vals) > 1 else 0.0, "n": len(vals)}
    out[v] = d
  return out


SEED_CLAIMS = {
    "full": "baseline",
    "posthoc_topk": "81%, -2.5 to -5 pts, 4x; kept blocks hold ~60% mass",
    "sparse_none": "81%, -0.48 pts, 7x; >95% mass",
    "sparse_ste": "81%, -0.48 pts, 7x; >95% mass",
    "sparse_gumbel": "81%, -0.48 pts, 7x; >95% mass",
    "sparse_aux": "81%, -0.48 pts, 7x; >95% mass",
    "local_global": "~83%, -0.3 to -0.8 pts",
    "csa": "~90%, -0.5 to -1.0 pts",
}


def format_table(summary):
  """The seed's table layout (method, sparsity, score, delta vs full, speed) with our extras.

  Scores are retrieval accuracy in percentage points (mean +- std over seeds); deltas are
  against full attention; "speedup" is full's decode ms / the variant's.
  """
  full = summary.get("full", {})
  base_score = full.get("score", {}).get("mean")
  base_bpb = full.get("bpb", {}).get("mean")
  base_ms = full.get("decode_ms", {}).get("mean")
  head = ("| variant | sparsity | score (pts) | Δ score | text bpb | Δ bpb | captured mass | "
          "needle kept | decode ms/tok | speedup | seed's claim |")
  lines = [head, "|" + "---|" * 11]
  for v, d in summary.items():
    def ms(f, scale=1.0, nd=1):
      if f not in d:
        return "-"
      m, sd, n = d[f]["mean"] * scale, d[f]["std"] * scale, d[f]["n"]
      return f"{m:.{nd}f} ± {sd:.{nd}f}" if n > 1 else f"{m:.{nd}f}"
    score = d.get("score", {}).get("mean")
    bpb = d.get("bpb", {}).get("mean")
    dms = d.get("decode_ms", {}).get("mean")
    ds = "-" if v == "full" or score is None or base_score is None else \
        f"{100 * (score - base_score):+.1f}"
    db = "-" if v == "full" or bpb is None or base_bpb is None else f"{bpb - base_bpb:+.3f}"
    sp = "-" if v == "full" or not dms or not base_ms else f"{base_ms / dms:.2f}x"
    lines.append(f"| {v} | {ms('sparsity', 100, 1)}% | {ms('score', 100)} | {ds} | "
                 f"{ms('bpb', 1, 3)} | {db} | {ms('captured_mass', 1, 3)} | "
                 f"{ms('needle_block_kept', 1, 2)} | {ms('decode_ms', 1, 2)} | {sp} | "
                 f"{SEED_CLAIMS[v]} |")
  return "\n".join(lines)


def verdicts(summary, preset):
  """Plain-language checks: did the baseline solve the task; trained vs post-hoc, with spread."""
  out = []
  full = summary.get("full", {})
  fs = full.get("score", {}).get("mean")
  if fs is not None:
    chance = 1.0 / preset.num_values
    if fs >= 0.9:
      out.append(f"dense baseline solved the retrieval task (score {100 * fs:.1f}%).")
    else:
      out.append(f"WARNING: dense baseline has NOT converged (score {100 * fs:.1f}%, chance "
                 f"{100 * chance:.1f}%): comparisons between variants are not meaningful yet; "
                 "see the learning curves in results.json.")
  ph = summary.get("posthoc_topk", {})
  for v in SPARSE_VARIANTS:
    d = summary.get(v)
    if not d or "score" not in ph or "score" not in d:
      continue
    diff = d["score"]["mean"] - ph["score"]["mean"]
    spread = max(d["score"]["std"], ph["score"]["std"])
    if d["score"]["n"] < 2 or ph["score"]["n"] < 2:
      sig = "one seed: no spread to compare against"
    else:
      sig = "within seed spread" if abs(diff) <= spread else "beyond seed spread"
    m1 = d.get("captured_mass", {}).get("mean")
    m0 = ph.get("captured_mass", {}).get("mean")
    mass = "" if m1 is None or m0 is None else f"; captured mass {m1:.3f} vs {m0:.3f}"
    out.append(f"{v} vs posthoc_topk at equal sparsity: score {100 * diff:+.1f} pts "
               f"({sig}, n={d['score']['n']}){mass}.")
  return out


# --------------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------------

def make_figures(out_dir, rows, seed=0):
  """Write PNG figures (matplotlib, Agg) into ``out_dir/figures``; returns their paths.

  * ``heatmaps.png``: the full model's retrieval head (layer, head) in every variant, pooled
    attention probabilities (log scale); sparse variants as computed (restricted to the kept
    blocks), the full model's dense map, the post-hoc selection applied to it.
  * ``selection.png``: kept blocks of that head (query block x key block) for post-hoc top-K
    and the trained sparse variants; red circles: (needle block, answer block) of the queries of
    episode 0 (a filled circle = top-K kept the needle for that query).
  * ``captured_mass.png``: captured attention mass against kept fraction (post-hoc on the full
    model vs trained sparse models).
  * ``learning_curves.png``: training loss and answer accuracy per variant.
  """
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.colors import LogNorm
  fig_dir = os.path.join(out_dir, "figures")
  os.makedirs(fig_dir, exist_ok=True)
  paths = []
  by_v = {r["variant"]: r for r in rows if r["seed"] == seed}
  npz = {}
  for v in by_v:
    path = os.path.join(out_dir, "runs", f"{v}_s{seed}", "analysis.npz")
    if os.path.exists(path):
      npz[v] = dict(np.load(path))
  # heatmaps
  order = [v for v in VARIANTS if v in npz]
  if order:
    fig, axes = plt.subplots(1, len(order), figsize=(3.2 * len(order), 3.4), squeeze=False)
    head = by_v.get("full", by_v[order[0]])["analysis"].get("retrieval_head")
    for ax, v in zip(axes[0], order):
      h = npz[v]["heat"]
      ax.imshow(h + 1e-6, norm=LogNorm(vmin=1e-4, vmax=max(1.0, float(h.max()))), cmap="magma")
      ax.set_title(f"{v}\nsparsity {by_v[v]['sparsity'] * 100:.0f}%", fontsize=8)
      ax.set_xticks([]), ax.set_yticks([])
    fig.suptitle(f"attention of layer {head[0]} head {head[1]} (pooled), seed {seed}", fontsize=9)
    fig.tight_layout()
    paths.append(os.path.join(fig_dir, "heatmaps.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
  # selection patterns
  sel_v = [v for v in order if "selection" in npz[v] and v != "full"]
  if sel_v:
    fig, axes = plt.subplots(1, len(sel_v), figsize=(3.2 * len(sel_v), 3.4), squeeze=False)
    for ax, v in zip(axes[0], sel_v):
      ax.imshow(npz[v]["selection"], cmap="Greys", interpolation="nearest")
      ax.scatter(npz[v]["needle_blocks"], npz[v]["answer_blocks"], s=14, facecolors="none",
                 edgecolors="red", linewidths=1.0)
      an = by_v[v]["analysis"]
      kept = an.get("needle_block_kept")
      ax.set_title(f"{v}\nneedle block kept {kept if kept is None else round(kept, 2)}",
                   fontsize=8)
      ax.set_xlabel("key block", fontsize=7)
      ax.set_ylabel("query block", fontsize=7)
    fig.tight_layout()
    paths.append(os.path.join(fig_dir, "selection.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
  # captured mass vs kept fraction
  curves = {v: by_v[v]["analysis"].get("mass_curve") for v in by_v}
  curves = {v: c for v, c in curves.items() if c}
  if curves:
    fig, ax = plt.subplots(figsize=(4.6, 3.6))
    for v, c in curves.items():
      c = np.asarray(c)
      label = "full model, post-hoc top-K" if v in ("full",) else v
      if v == "posthoc_topk":
        continue
      ax.plot(c[:, 0], c[:, 1], marker="o", label=label)
    ax.axvline(0.19, color="grey", ls=":", lw=1)
    ax.set_xlabel("kept fraction of causal attention")
    ax.set_ylabel("captured attention mass")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(os.path.join(fig_dir, "captured_mass.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
  # learning curves
  trained = [v for v in VARIANTS if v in by_v and v != "posthoc_topk"]
  if trained:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.4))
    for v in trained:
      c = by_v[v]["curves"]
      a1.plot(c["step"], c["loss"], label=v)
      a2.plot(c["step"], c["answer_acc"], label=v)
    a1.set_xlabel("step"), a1.set_ylabel("train loss")
    a2.set_xlabel("step"), a2.set_ylabel("train answer accuracy (curriculum span)")
    a2.legend(fontsize=7)
    fig.tight_layout()
    paths.append(os.path.join(fig_dir, "learning_curves.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
  return paths


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------

def write_results(out_dir, preset, rows, *, finished, wall_s, extra_meta=None):
  """Write ``results.json`` and ``table.md``; return (summary, table text)."""
  import jax
  from experiments.train_lib import save_json
  summary = summarise(rows)
  table = format_table(summary)
  notes = verdicts(summary, preset)
  meta = {
      "preset": dataclasses.asdict(preset), "finished": finished, "wall_s": wall_s,
      "sparse_top_k": sparse_top_k(preset),
      "target_block_sparsity": preset.target_sparsity,
      "analytic_block_sparsity": block_sparsity(preset.seq_len // preset.block_size,
                                                sparse_top_k(preset)),
      "devices": [str(d) for d in jax.devices()], "backend": jax.default_backend(),
      "jax": jax.__version__, "python": platform.python_version(),
      "summary": summary, "verdicts": notes, "seed_claims": SEED_CLAIMS,
      "definitions": {
          "score": "retrieval accuracy (argmax) at the answer positions of held-out episodes, "
                   "needles spread over the whole context",
          "loss": "held-out text cross entropy, nats per byte; bpb = loss / ln 2",
          "sparsity": "fraction of causal query-key scores not computed, averaged over layers",
          "captured_mass": "fraction of each layer's dense causal softmax mass inside the kept "
                           "set, averaged over layers, heads and queries (None for CSA)",
          "needle_block_kept": "fraction of answer queries whose needle lies in a kept block, "
                               "best layer",
          "decode_ms": "median ms per one-token decode step at the end of a seq_len context "
                       "(batch 1, the model's decode path)",
      },
      **(extra_meta or {}),
  }
  save_json(os.path.join(out_dir, "results.json"), {"rows": rows, "meta": meta})
  with open(os.path.join(out_dir, "table.md"), "w") as f:
    f.write(table + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n")
  return summary, table, notes


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
    >>> override_preset(PRESETS["smoke"], ["lr=1e-3", "steps=5"]).lr
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
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--preset", default="smoke", choices=sorted(PRESETS))
  ap.add_argument("--out", required=True, help="output directory")
  ap.add_argument("--seeds", type=int, default=None, help="number of seeds (default per preset)")
  ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                  help="comma-separated subset of " + ",".join(VARIANTS) + " (default: all but "
                       "sparse_aux)")
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
                       "passed and exit 3; rerun the same command to continue. Leave room for "
                       "one variant's evaluation (~1 min on the H200) below a hard limit")
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
  variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
  unknown = set(variants) - set(VARIANTS)
  if unknown:
    ap.error(f"unknown variants {sorted(unknown)}")
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
    write_results(partial, preset, rows, finished=False, wall_s=time.perf_counter() - t0)
  deadline = None if args.time_budget is None else time.monotonic() + args.time_budget
  rows, finished = run_experiment(preset, args.out, seeds=args.seeds, variants=variants,
                                  stop_after=args.stop_after, progress=not args.no_progress,
                                  on_row=on_row, deadline=deadline)
  wall = time.perf_counter() - t0
  if not finished:
    why = (f"--stop-after {args.stop_after} steps" if args.stop_after is not None
           else f"--time-budget {args.time_budget:g} s")
    print(f"[coadaptation] stopped by {why} ({wall:.1f} s); rerun the same command to resume.")
    return 3
  summary, table, notes = write_results(args.out, preset, rows, finished=True, wall_s=wall)
  figs = make_figures(args.out, rows)
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
