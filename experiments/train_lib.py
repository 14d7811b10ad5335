"""Training harness for the experiments: AdamW + warmup/cosine, a jitted data-parallel step,
resumable orbax checkpoints and jitted evaluation.

* Data parallel: a 1-D ``jax.sharding.Mesh`` with axis ``"data"`` over every visible device (or
  the ones given); batches are placed with ``NamedSharding(mesh, P("data"))``, parameters and
  optimiser state are replicated (``P()``), and XLA inserts the gradient all-reduce.
* Functional NNX: the model is split once into ``(graphdef, params, rest)`` (``rest`` = every
  non-``nnx.Param`` variable, e.g. RNG streams); the jitted step merges, runs, and returns the
  updated ``params`` and ``rest``.
* Resumable: ``Trainer.fit`` saves ``{params, rest, opt_state, step, base_key}`` plus a JSON record
  (data-iterator state, learning curves) with orbax every ``ckpt_every`` steps and at the end. On
  start it restores the latest checkpoint, so a killed run continues where it stopped; because the
  data stream is a pure function of (seed, step) and per-step randomness is ``fold_in(key, step)``,
  the resumed run ends with bit-identical parameters on the same machine.
* Integrity: every checkpoint step directory gets ``integrity.json`` (a SHA-256 over its files
  and the run's configuration fingerprint, ``config_fingerprint``). On start the two newest
  checkpoints are kept; one whose digest does not match (a flipped byte) or that fails to
  restore is reported by path, moved to ``<ckpt_dir>.corrupt/`` and the run falls back to the
  previous good one. A checkpoint of another configuration refuses to resume
  (``ConfigMismatchError``, naming the differing keys).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import shutil
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "weights", "answer_mask")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW with linear warmup and cosine decay.

  Attributes:
    lr: peak learning rate.
    warmup_steps: linear warmup from 0.
    total_steps: schedule length (cosine decays to ``lr * min_lr_ratio`` at this step).
    weight_decay: decoupled weight decay (applied to every parameter with ndim >= 2).
    b1, b2: Adam betas.
    grad_clip: global-norm clipping (None: off).
    min_lr_ratio: final learning rate as a fraction of ``lr``.
  """
  lr: float = 3e-3
  warmup_steps: int = 50
  total_steps: int = 1000
  weight_decay: float = 0.05
  b1: float = 0.9
  b2: float = 0.95
  grad_clip: float | None = 1.0
  min_lr_ratio: float = 0.1


@functools.lru_cache(maxsize=None)
def make_optimizer(cfg: OptimConfig):
  """The optax optimiser for ``cfg``.

  Args:
    cfg: an ``OptimConfig``.

  Returns:
    (optax.GradientTransformation, schedule function step -> learning rate); cached per config,
    so trainers with equal configs share one object (and one compiled train step).

  Example:
    >>> tx, sched = make_optimizer(OptimConfig(lr=1e-3, warmup_steps=10, total_steps=100))
    >>> round(float(sched(10)), 6)
    0.001
  """
  warm = max(1, min(cfg.warmup_steps, cfg.total_steps - 1))
  sched = optax.warmup_cosine_decay_schedule(
      0.0, cfg.lr, warm, max(cfg.total_steps, warm + 1), end_value=cfg.lr * cfg.min_lr_ratio)
  mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
  parts = []
  if cfg.grad_clip is not None:
    parts.append(optax.clip_by_global_norm(cfg.grad_clip))
  parts.append(optax.adamw(sched, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=mask))
  return optax.chain(*parts), sched


def make_mesh(devices=None, context_parallel=1) -> Mesh:
  """A data-parallel mesh with axis name ``"data"`` (and ``"seq"`` for context parallelism).

  Args:
    devices: devices to use; default ``jax.devices()`` (every visible device).
    context_parallel: devices each sequence is split over (axis ``"seq"``); the batch is split
      over the rest. 1: a 1-D data-parallel mesh.

  Returns:
    ``jax.sharding.Mesh`` of shape (num_devices,), or (num_devices // n, n) with axes
    ("data", "seq").

  Example:
    >>> make_mesh().axis_names
    ('data',)
  """
  devices = list(jax.devices() if devices is None else devices)
  if context_parallel == 1:
    return Mesh(np.array(devices), ("data",))
  if context_parallel < 1 or len(devices) % context_parallel:
    raise ValueError(f"context_parallel={context_parallel} must divide the {len(devices)} devices")
  return Mesh(np.array(devices).reshape(-1, context_parallel), ("data", "seq"))


def shard_batch(batch: dict, mesh: Mesh) -> dict:
  """Place a global numpy batch on the mesh, split along the leading (batch) axis.

  Args:
    batch: dict of arrays [global_batch, ...]; global_batch must divide by the mesh size.
    mesh: a ``make_mesh`` mesh.

  Returns:
    dict of ``jax.Array`` with ``NamedSharding(mesh, P("data"))``.

  Example:
    >>> b = shard_batch({"inputs": np.zeros((2, 4), np.int32)}, make_mesh(jax.devices()[:1]))
    >>> b["inputs"].shape
    (2, 4)
  """
  n = mesh.shape["data"]
  out = {}
  for k, v in batch.items():
    if v.shape[0] % n:
      raise ValueError(f"batch dimension {v.shape[0]} of {k!r} does not divide by {n} devices")
    out[k] = jax.device_put(np.asarray(v), NamedSharding(mesh, P("data")))
  return out


def _device_batch(stream, step, mesh):
  b = stream.batch(step)
  return shard_batch({k: b[k] for k in BATCH_KEYS}, mesh)


def weighted_xent(logits, batch, *, answer_loss_weight=1.0):
  """Next-token cross entropy: text (LM) term plus a separately normalised answer term.

  loss = sum(w * nll over non-answer targets) / sum(w) + answer_loss_weight * mean(nll over
  answer targets). Normalising the answer term on its own keeps the few retrieval answers of a
  batch from drowning in thousands of text targets.

  Args:
    logits: [batch, seq, vocab].
    batch: dict with "targets" (int [batch, seq]), "weights" (float [batch, seq]; used for the
      text term) and "answer_mask" (bool [batch, seq]).
    answer_loss_weight: weight of the answer term.

  Returns:
    (loss, metrics): metrics holds sums ("nll_sum", "w_sum", "ans_correct", "ans_count",
    "ans_nll", "txt_nll", "txt_count") so they can be aggregated exactly over eval chunks.

  Example:
    >>> lg = jnp.zeros((1, 2, 4)); b = {"targets": jnp.array([[1, 2]]),
    ...   "weights": jnp.ones((1, 2)), "answer_mask": jnp.array([[False, True]])}
    >>> round(float(weighted_xent(lg, b)[0]), 4)
    2.7726
  """
  logits = logits.astype(jnp.float32)
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]  # [b, s]
  ans = batch["answer_mask"]
  w = jnp.where(ans, 0.0, batch["weights"].astype(jnp.float32))
  txt = w > 0
  correct = (jnp.argmax(logits, -1) == batch["targets"]) & ans
  metrics = {
      "nll_sum": jnp.sum(w * nll), "w_sum": jnp.sum(w),
      "ans_correct": jnp.sum(correct), "ans_count": jnp.sum(ans),
      "ans_nll": jnp.sum(jnp.where(ans, nll, 0.0)),
      "txt_nll": jnp.sum(jnp.where(txt, nll, 0.0)), "txt_count": jnp.sum(txt),
  }
  loss = (metrics["nll_sum"] / jnp.maximum(metrics["w_sum"], 1.0)
          + answer_loss_weight * metrics["ans_nll"] / jnp.maximum(metrics["ans_count"], 1.0))
  return loss, metrics


def _is_key(x):
  return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_saveable(leaves):
  return {f"{i:05d}": (jax.random.key_data(x) if _is_key(x) else x) for i, x in enumerate(leaves)}


def _from_saved(saved, like):
  out = []
  for i, ref in enumerate(like):
    x = saved[f"{i:05d}"]
    if _is_key(ref):
      x = jax.random.wrap_key_data(x, impl=jax.random.key_impl(ref))
    out.append(x)
  return out


def _cast(params, dtype):
  if dtype is None:
    return params
  return jax.tree.map(
      lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def _call(model, batch, use_segments, call_kwargs):
  kwargs = dict(call_kwargs)
  if use_segments:
    kwargs.update(segment_ids=batch["segment_ids"], positions=batch["positions"])
  return model(batch["inputs"], **kwargs)


# The jitted steps are module-level functions of (static) graphdef, optimiser and options, so
# trainers of the same architecture (other seeds, a resumed run) reuse one compilation.
@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5), donate_argnums=(6, 7, 8))
def _train_step(graphdef, tx, use_segments, compute_dtype, call_kwargs, mesh, params, rest,
                opt_state, batch):
  # Merge at the jit level and differentiate with nnx.value_and_grad (w.r.t. nnx.Param), so
  # stateful variables (e.g. the Gumbel gate's RNG stream) may be updated inside the step.
  model = nnx.merge(graphdef, _cast(params, compute_dtype), rest)

  def loss_fn(model):
    return weighted_xent(_call(model, batch, use_segments, call_kwargs), batch)
  (loss, m), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
  _, _, new_rest = nnx.split(model, nnx.Param, ...)
  updates, opt_state = tx.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  m = dict(m, loss=loss, grad_norm=optax.tree.norm(grads))
  repl = NamedSharding(mesh, P())
  return jax.lax.with_sharding_constraint((params, new_rest, opt_state, m), repl)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _eval_step(graphdef, use_segments, compute_dtype, call_kwargs, mesh, params, rest, batch):
  model = nnx.merge(graphdef, _cast(params, compute_dtype), rest)
  m = weighted_xent(_call(model, batch, use_segments, call_kwargs), batch)[1]
  return jax.lax.with_sharding_constraint(m, NamedSharding(mesh, P()))


INTEGRITY_FILE = "integrity.json"
KEEP_CHECKPOINTS = 2


class ConfigMismatchError(ValueError):
  """A resume into a run directory (or checkpoint) written with another configuration."""


def config_fingerprint(config):
  """SHA-256 (hex) of a JSON-able configuration dict, independent of key order.

  Args:
    config: dict of JSON-able values.

  Returns:
    64 hex characters.

  Example:
    >>> config_fingerprint({"lr": 1e-3, "steps": 5}) == config_fingerprint({"steps": 5, "lr": 1e-3})
    True
  """
  text = json.dumps(config, sort_keys=True, default=_json_default)
  return hashlib.sha256(text.encode()).hexdigest()


def config_diff(old, new):
  """Keys whose values differ between two configuration dicts (missing counts as different).

  Example:
    >>> config_diff({"lr": 1e-3, "steps": 5}, {"lr": 2e-3, "steps": 5})
    ['lr']
  """
  keys = sorted(set(old) | set(new))
  return [k for k in keys if k not in old or k not in new or
          json.dumps(old[k], sort_keys=True, default=_json_default)
          != json.dumps(new[k], sort_keys=True, default=_json_default)]


def check_same_config(old, new, where):
  """Raise ``ConfigMismatchError`` naming the differing keys (with both values) if ``old`` and
  ``new`` differ; ``where`` names the directory or file the old configuration came from."""
  diff = config_diff(old, new)
  if diff:
    parts = ", ".join(f"{k}: {old.get(k, '<absent>')!r} there, {new.get(k, '<absent>')!r} now"
                      for k in diff)
    raise ConfigMismatchError(
        f"{where} was written with another configuration (differing keys: {parts}); use a "
        "fresh output directory or the original settings")


def ensure_writable_dir(path, what="output directory"):
  """Create ``path`` if needed and prove it is writable with a probe file, at once.

  Args:
    path: directory.
    what: its role, for the message.

  Raises:
    OSError: naming ``path`` when it cannot be created or written.

  Example:
    >>> import tempfile
    >>> ensure_writable_dir(tempfile.mkdtemp())
  """
  try:
    os.makedirs(path, exist_ok=True)
    probe = os.path.join(path, f".write-probe-{os.getpid()}")
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise OSError(f"{what} {path!r} is not writable: {e.strerror or e}") from None


def dir_digest(path):
  """SHA-256 (hex) over the relative names and bytes of every file under ``path`` except
  ``INTEGRITY_FILE``, in sorted order."""
  h = hashlib.sha256()
  for root, dirs, files in os.walk(path):
    dirs.sort()
    for name in sorted(files):
      full = os.path.join(root, name)
      rel = os.path.relpath(full, path)
      if rel == INTEGRITY_FILE:
        continue
      h.update(rel.encode() + b"\0")
      with open(full, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
          h.update(chunk)
      h.update(b"\0")
  return h.hexdigest()


def write_integrity(step_dir, fingerprint):
  """Write ``step_dir/integrity.json``: the directory's digest and the config fingerprint."""
  save_json(os.path.join(step_dir, INTEGRITY_FILE),
            {"sha256": dir_digest(step_dir), "config_fingerprint": fingerprint})


def verify_integrity(step_dir):
  """Why the checkpoint in ``step_dir`` cannot be trusted, or None if its digest matches."""
  path = os.path.join(step_dir, INTEGRITY_FILE)
  try:
    with open(path) as f:
      want = json.load(f)["sha256"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    return f"no readable {INTEGRITY_FILE} ({type(e).__name__})"
  got = dir_digest(step_dir)
  if got != want:
    return f"checksum mismatch (sha256 {got[:12]}..., recorded {want[:12]}...)"
  return None


def checkpoint_steps(ckpt_dir):
  """Finalised checkpoint steps in ``ckpt_dir`` (integer-named directories), ascending."""
  if not os.path.isdir(ckpt_dir):
    return []
  return sorted(int(n) for n in os.listdir(ckpt_dir)
                if n.isdigit() and os.path.isdir(os.path.join(ckpt_dir, n)))


def quarantine(step_dir, reason, log=print):
  """Report a bad checkpoint by path and move it to ``<ckpt_dir>.corrupt/<step>``."""
  ckpt_dir, step = os.path.split(os.path.normpath(step_dir))
  dest_root = ckpt_dir + ".corrupt"
  os.makedirs(dest_root, exist_ok=True)
  dest = os.path.join(dest_root, step)
  n = 0
  while os.path.exists(dest):
    n += 1
    dest = os.path.join(dest_root, f"{step}-{n}")
  shutil.move(step_dir, dest)
  log(f"[checkpoint] {step_dir} is corrupt: {reason}; moved to {dest}, falling back to the "
      "previous checkpoint")
  return dest


class Trainer:
  """Trains one NNX model with a jitted, data-parallel step and resumable checkpoints.

  Args:
    model: an ``nnx.Module`` whose ``__call__(tokens, segment_ids=..., positions=...)`` returns
      logits [batch, seq, vocab].
    opt: an ``OptimConfig``.
    mesh: a ``make_mesh`` mesh (default: every device).
    seed: seed of the per-step key (``fold_in(key(seed), step)``, available to ``loss_fn``).
    use_segments: pass segment ids and positions to the model (packed text rows).
    call_kwargs: extra keyword arguments for every model call.
    compute_dtype: None (compute in the parameter dtype) or e.g. "bfloat16": mixed precision,
      floating parameters are cast to this dtype for the forward/backward pass, the master copy,
      the optimiser state and the update stay in the parameter dtype (fp32).

  Example:
    >>> # trainer = Trainer(model, OptimConfig(total_steps=100))
    >>> # curves = trainer.fit(stream, ckpt_dir="/tmp/run")
  """

  def __init__(self, model, opt: OptimConfig, *, mesh=None, seed=0, use_segments=True,
               call_kwargs=None, compute_dtype=None):
    self.mesh = mesh or make_mesh()
    self.compute_dtype = None if compute_dtype is None else jnp.dtype(compute_dtype)
    self.opt = opt
    self.tx, self.schedule = make_optimizer(opt)
    self.use_segments = use_segments
    self.call_kwargs = dict(call_kwargs or {})
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    self.use_graphdef(graphdef)
    repl = NamedSharding(self.mesh, P())
    self._repl = repl
    self.params = jax.device_put(params, repl)
    self.rest = jax.device_put(rest, repl)
    self.opt_state = jax.device_put(self.tx.init(self.params), repl)
    self.step = 0
    self.config, self.fingerprint = None, None
    self.base_key = jax.random.key(seed)
    self.curves = {"step": [], "loss": [], "answer_acc": [], "lr": [], "span": [], "time_s": []}

  def use_graphdef(self, graphdef):
    """Run the later steps, evaluations and ``model()`` with ``graphdef``: the same parameters in
    another graph (e.g. the unsharded model after context-parallel training)."""
    self.graphdef = graphdef
    kw = tuple(sorted(self.call_kwargs.items()))
    self._train_step = functools.partial(_train_step, graphdef, self.tx, self.use_segments,
                                         self.compute_dtype, kw, self.mesh)
    self._eval_fn = functools.partial(_eval_step, graphdef, self.use_segments,
                                      self.compute_dtype, kw, self.mesh)

  # -- model calls -------------------------------------------------------------------------------
  def cast(self, params):
    """``params`` with floating leaves in the compute dtype (unchanged without one)."""
    return _cast(params, self.compute_dtype)

  def model(self):
    """The current model as an ``nnx.Module`` (merged from the trained state)."""
    return nnx.merge(self.graphdef, self.params, self.rest)

  # -- checkpoints -------------------------------------------------------------------------------
  def _state_leaves(self):
    tree = (self.params, self.rest, self.opt_state, jnp.asarray(self.step, jnp.int32),
            self.base_key)
    return jax.tree.flatten(tree)

  def save(self, manager, extra=None):
    """Save the full training state at ``self.step`` with an orbax ``CheckpointManager``, then
    write the step directory's ``integrity.json`` (digest and ``self.fingerprint``)."""
    import orbax.checkpoint as ocp
    leaves, _ = self._state_leaves()
    record = {"step": self.step, "curves": self.curves, "config": self.config, **(extra or {})}
    manager.save(self.step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(_to_saveable(leaves)), record=ocp.args.JsonSave(record)),
        force=True)
    manager.wait_until_finished()
    write_integrity(os.path.join(str(manager.directory), str(self.step)), self.fingerprint)

  def _restore_step(self, manager, step):
    import orbax.checkpoint as ocp
    leaves, treedef = self._state_leaves()
    saveable = _to_saveable(leaves)
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._repl), saveable)
    out = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), record=ocp.args.JsonRestore()))
    return out, treedef, leaves

  def restore(self, manager, log=print):
    """Restore the newest good checkpoint of ``manager``, if there is one.

    Each candidate (newest first) must match its ``integrity.json`` digest and restore without
    error; a bad one is reported by path and moved aside (``quarantine``), and the previous one
    is tried. A good checkpoint whose recorded configuration differs from ``self.config``
    raises ``ConfigMismatchError`` naming the differing keys.

    Returns:
      The saved JSON record (dict), or None if there was nothing (good) to restore.
    """
    ckpt_dir = str(manager.directory)
    for step in reversed(checkpoint_steps(ckpt_dir)):
      step_dir = os.path.join(ckpt_dir, str(step))
      reason = verify_integrity(step_dir)
      if reason is None:
        try:
          out, treedef, leaves = self._restore_step(manager, step)
        except Exception as e:  # noqa: BLE001 - any failure to read makes the step unusable
          reason = f"restore failed: {type(e).__name__}: {str(e)[:200]}"
      if reason is not None:
        quarantine(step_dir, reason, log)
        manager.reload()
        continue
      record = out["record"]
      if self.config is not None:
        check_same_config(record.get("config") or {}, self.config, f"checkpoint {step_dir}")
      restored = _from_saved(out["state"], leaves)
      params, rest, opt_state, step_arr, key = jax.tree.unflatten(treedef, restored)
      self.params, self.rest, self.opt_state = params, rest, opt_state
      self.step, self.base_key = int(step_arr), key
      self.curves = record["curves"]
      return record
    return None

  # -- training ----------------------------------------------------------------------------------
  def fit(self, stream, total_steps, *, ckpt_dir=None, ckpt_every=100, stop_after=None,
          log_every=10, desc="train", progress=True, extra_record=None, deadline=None,
          config=None):
    """Train to ``total_steps`` (resuming from ``ckpt_dir`` when it holds a good checkpoint).

    Args:
      stream: object with ``batch(step) -> dict of numpy arrays``, ``state(step) -> dict`` and
        optionally ``span(step)`` (logged in the curves).
      total_steps: the step to train to.
      ckpt_dir: checkpoint directory (None: no checkpoints).
      ckpt_every: save every this many steps (and at the end, and when stopping early).
      stop_after: stop after this many steps *in this call* (simulates a killed run; the
        checkpoint lets the next call continue). None: run to ``total_steps``.
      log_every: record the learning curve every this many steps.
      desc: progress-bar label.
      progress: show a tqdm progress bar.
      extra_record: JSON-able dict stored with every checkpoint.
      deadline: ``time.monotonic()`` value after which training stops at the next step (with a
        checkpoint, like ``stop_after``); None: no limit.
      config: JSON-able dict of the run's configuration, stored in every checkpoint with its
        fingerprint; resuming a checkpoint of another configuration raises
        ``ConfigMismatchError``. None: not checked.

    Returns:
      True if ``total_steps`` was reached, False if stopped early by ``stop_after`` or
      ``deadline``.
    """
    from tqdm.auto import tqdm
    manager = None
    self.config = None if config is None else json.loads(json.dumps(config,
                                                                   default=_json_default))
    self.fingerprint = None if config is None else config_fingerprint(self.config)
    if ckpt_dir is not None:
      import orbax.checkpoint as ocp
      ensure_writable_dir(os.path.abspath(ckpt_dir), "checkpoint directory")
      manager = ocp.CheckpointManager(
          os.path.abspath(ckpt_dir),
          options=ocp.CheckpointManagerOptions(max_to_keep=KEEP_CHECKPOINTS, create=True))
      self.restore(manager)
    start = self.step
    self.fit_start_step = start
    end = total_steps if stop_after is None else min(total_steps, start + stop_after)
    bar = tqdm(total=total_steps, initial=start, desc=desc, disable=not progress,
               mininterval=1.0, leave=False, dynamic_ncols=True)
    t0 = time.perf_counter()
    pending = None
    try:
      for step in range(start, end):
        batch = _device_batch(stream, step, self.mesh) if pending is None else pending
        pending = None
        self.params, self.rest, self.opt_state, m = self._train_step(
            self.params, self.rest, self.opt_state, batch)
        if step + 1 < end:  # prepare the next batch while the device works
          pending = _device_batch(stream, step + 1, self.mesh)
        self.step = step + 1
        if step % log_every == 0 or step + 1 == total_steps:
          loss = float(m["loss"])
          acc = float(m["ans_correct"]) / max(1.0, float(m["ans_count"]))
          if not math.isfinite(loss):
            raise FloatingPointError(f"{desc}: loss is {loss} at step {step}")
          c = self.curves
          c["step"].append(step)
          c["loss"].append(loss)
          c["answer_acc"].append(acc)
          c["lr"].append(float(self.schedule(step)))
          c["span"].append(int(stream.span(step)) if hasattr(stream, "span") else None)
          c["time_s"].append(time.perf_counter() - t0)
          bar.set_postfix(loss=f"{loss:.3f}", acc=f"{acc:.2f}", refresh=False)
          if not progress:  # a plain log line instead of the bar (logs of unattended runs)
            print(f"  {desc} step {step + 1}/{total_steps} loss {loss:.3f} acc {acc:.2f} "
                  f"{c['time_s'][-1]:.1f} s", flush=True)
        bar.update(1)
        if manager is not None and self.step % ckpt_every == 0 and self.step < end:
          self.save(manager, dict(data=stream.state(self.step), **(extra_record or {})))
        if deadline is not None and time.monotonic() > deadline:
          break
    finally:
      bar.close()
    if manager is not None:
      if self.step not in manager.all_steps():  # a restored, finished run has nothing new to save
        self.save(manager, dict(data=stream.state(self.step), **(extra_record or {})))
      manager.close()
    return self.step >= total_steps

  # -- evaluation --------------------------------------------------------------------------------
  def evaluate(self, batch: dict, *, chunk=8, params=None, rest=None, graphdef=None):
    """Aggregate ``weighted_xent`` metrics over a numpy batch, ``chunk`` rows at a time.

    Args:
      batch: dict of numpy arrays (``BATCH_KEYS``).
      chunk: rows per jitted call (rounded to a multiple of the mesh size).
      params, rest, graphdef: evaluate another state (default: the trained one), e.g. a
        post-hoc sparse variant of the trained parameters.

    Returns:
      dict: "score" (answer accuracy), "answer_nll", "text_nll", "bpb" (text nats / ln 2;
      tokens are bytes), "loss" (the training objective), and the raw counts.
    """
    params = self.params if params is None else params
    rest = self.rest if rest is None else rest
    fn = self._eval_fn
    if graphdef is not None:
      fn = functools.partial(_eval_step, graphdef, self.use_segments, self.compute_dtype,
                             tuple(sorted(self.call_kwargs.items())), self.mesh)
    n = batch["inputs"].shape[0]
    dev = self.mesh.shape["data"]
    chunk = max(dev, chunk // dev * dev)
    tot = None
    for i in range(0, n, chunk):
      part = {k: np.asarray(batch[k][i:i + chunk]) for k in BATCH_KEYS}
      rows = part["inputs"].shape[0]
      if rows % dev:  # pad with zero-weight rows
        pad = dev - rows % dev
        part = {k: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)])
                for k, v in part.items()}
        part["segment_ids"][rows:] = 1
      m = fn(params, rest, shard_batch(part, self.mesh))
      m = {k: float(v) for k, v in m.items()}
      tot = m if tot is None else {k: tot[k] + m[k] for k in tot}
    out = dict(tot)
    out["score"] = tot["ans_correct"] / tot["ans_count"] if tot["ans_count"] else float("nan")
    out["answer_nll"] = tot["ans_nll"] / tot["ans_count"] if tot["ans_count"] else float("nan")
    out["text_nll"] = tot["txt_nll"] / tot["txt_count"] if tot["txt_count"] else float("nan")
    out["bpb"] = out["text_nll"] / math.log(2.0)
    out["loss"] = tot["nll_sum"] / max(tot["w_sum"], 1.0) + (
        out["answer_nll"] if tot["ans_count"] else 0.0)
    return out


def save_json(path, obj):
  """Write ``obj`` as indented JSON atomically: to a temporary file of this writer's own (other
  processes may write the same path), then renamed over ``path``."""
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".",
                             prefix=os.path.basename(path) + ".", suffix=".tmp")
  try:
    with os.fdopen(fd, "w") as f:
      json.dump(obj, f, indent=1, default=_json_default)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def _json_default(x):
  if isinstance(x, (np.integer,)):
    return int(x)
  if isinstance(x, (np.floating,)):
    return float(x)
  if isinstance(x, np.ndarray):
    return x.tolist()
  raise TypeError(f"not JSON serialisable: {type(x)}")
