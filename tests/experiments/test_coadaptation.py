"""Co-adaptation experiment: data, sparsity bookkeeping, plumbing run, exact resume, data parallel.

Sizes are tiny (CPU CI); the end-to-end run uses the plumbing-only preset.
"""
import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from experiments import coadaptation as C
from experiments import data
from tests.helpers import ci_cases

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def corpus():
  return data.load_python_corpus(max_bytes=200_000)


# ------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("task", ["pairs", "mqar"])
def test_retrieval_answers_match_needles(corpus, task):
  train, _ = corpus
  cfg = data.TaskConfig(seq_len=200, task=task, num_pairs=6, num_queries=3)
  voc = cfg.vocab
  b = data.retrieval_rows(cfg, np.random.default_rng(3), 5, train, span=120)
  full = np.concatenate([b["inputs"], b["targets"][:, -1:]], axis=1)   # the rows
  assert b["answer_mask"].sum() == 5 * 3
  for r in range(5):
    needles = {}
    for p in b["needle_pos"][r]:
      assert p >= cfg.haystack_len - 120                       # inside the span
      if task == "pairs":
        t = full[r, p] - voc.pair_base
        needles[t // voc.num_values] = t % voc.num_values
      else:
        needles[full[r, p] - voc.key_base] = full[r, p + 1] - voc.value_base
    assert len(needles) == 6                                    # distinct keys
    for a in b["answer_pos"][r]:
      key = b["inputs"][r, a] - voc.key_base
      assert b["inputs"][r, a - 1] == data.QUERY
      assert b["targets"][r, a] == voc.value(needles[key])
      assert b["answer_mask"][r, a] and b["weights"][r, a] == cfg.answer_weight
    found = C.needle_targets(cfg, b["inputs"][r:r + 1], b["answer_pos"][r:r + 1],
                             b["needle_pos"][r:r + 1])
    for a, npos in zip(b["answer_pos"][r], found[0]):
      tok = full[r, npos]
      k = (tok - voc.pair_base) // voc.num_values if task == "pairs" else tok - voc.key_base
      assert k == b["inputs"][r, a] - voc.key_base


def test_stream_is_a_pure_function_of_seed_and_step(corpus):
  train, _ = corpus
  cfg = data.TaskConfig(seq_len=128, num_pairs=4, num_queries=2, text_fraction=0.5)
  s1 = data.TrainStream(cfg, train, 4, 100, seed=5)
  s2 = data.TrainStream(cfg, train, 4, 100, seed=5)
  a, b = s1.batch(17), s2.batch(17)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])
  c = data.TrainStream(cfg, train, 4, 100, seed=6).batch(17)
  assert not np.array_equal(a["inputs"], c["inputs"])
  assert s1.span(0) < s1.span(99) == cfg.haystack_len           # curriculum: short to long
  # packed text rows: weights drop padding and cross-document targets
  seg = a["segment_ids"][2:]
  w = a["weights"][2:]
  tgt_seg = np.concatenate([seg[:, 1:], np.zeros_like(seg[:, :1])], 1)
  assert np.all(w[(seg == 0)] == 0)
  assert np.all((w > 0) <= ((seg == tgt_seg) | (np.arange(seg.shape[1]) == seg.shape[1] - 1)))


# ------------------------------------------------------------------------------------------------
# Sparsity bookkeeping (brute force)
# ------------------------------------------------------------------------------------------------

def test_selection_sizes():
  """Sparse layers keep 19% of each query's visible blocks; CSA two-stage's count keeps 19% at
  the answer query (24 of 128 blocks at 8K: its own block, forced, + 23 by score)."""
  p = C.PRESETS["gpu8k"]
  assert C.sparse_top_k(p) == 0.19
  assert C.csa_top_k(p) == 23 and C.csa_top_k(p) + 1 == round(0.19 * p.seq_len / p.block_size)


def test_window_sparsity_brute_force():
  i, j = np.arange(50)[:, None], np.arange(50)[None]
  w = 7
  want = 1 - ((j <= i) & (j > i - w)).sum() / ((j <= i).sum())
  assert C.window_sparsity(50, w) == pytest.approx(want)


# ------------------------------------------------------------------------------------------------
# End to end
# ------------------------------------------------------------------------------------------------

# By default one variant per family (dense, both post-hoc scorers, a trained gate, local/global,
# CSA two-stage); every variant with --run-slow.
FAMILIES = "full,posthoc_proxy,posthoc_oracle,sparse_gumbel,local_global_nope,csa_two_stage"


@pytest.mark.heavy
@pytest.mark.parametrize("variants", ci_cases([FAMILIES, ",".join(C.VARIANTS)], [FAMILIES]),
                         ids=["families", "every_variant"])
def test_plumbing_cli_writes_every_variant_and_resumes(tmp_path, capsys, variants):
  out = str(tmp_path / "plumbing")
  args = ["--preset", "plumbing", "--out", out, "--no-progress", "--variants", variants]
  assert C.main(args + ["--stop-after", "6"]) == 3               # killed inside the 2nd variant
  assert not os.path.exists(os.path.join(out, "results.json"))
  assert C.main(args) == 0                                       # resumes and finishes
  with open(os.path.join(out, "results.json")) as f:
    res = json.load(f)
  rows = {r["variant"]: r for r in res["rows"]}
  assert set(rows) == set(variants.split(","))
  for r in rows.values():
    for f in C.ROW_FIELDS:
      assert f in r, (r["variant"], f)
    assert 0.0 <= r["score"] <= 1.0 and np.isfinite(r["bpb"]) and r["task"] == "copy"
  assert rows["full"]["sparsity"] == 0.0 and rows["full"]["needle_recall"] == 1.0
  assert rows["posthoc_oracle"]["decode_ms"] is None and rows["posthoc_proxy"]["decode_ms"] > 0
  for v in set(C.BLOCK_VARIANTS) & set(rows):    # same per-token rule: same measured sparsity
    assert rows[v]["sparsity"] == pytest.approx(rows["posthoc_proxy"]["sparsity"])
    assert 0 < rows[v]["sparsity_answers"] < 1 and rows[v]["q_block_size"] == 1
  for v in {"local_global_nope", "local_global_rope", "csa", "csa_two_stage"} & set(rows):
    assert rows[v]["sparsity"] > 0.2
  agg = {a["variant"]: a for a in res["aggregate"]}
  assert "diff_vs_posthoc_oracle" in agg["sparse_gumbel"] and agg["full"]["score"]["n"] == 1
  for name in ("gap", "mass_curves", "heatmaps", "learning_curves"):
    assert os.path.getsize(os.path.join(out, "figures", f"{name}.png")) > 1000
  printed = capsys.readouterr().out
  assert "| posthoc_oracle |" in printed and "Δ vs post-hoc oracle" in printed
  merged = str(tmp_path / "merged")
  assert C.main(["merge", out, "--out", merged]) == 0
  with open(os.path.join(merged, "results.json")) as f:
    m = json.load(f)
  assert len(m["rows"]) == len(res["rows"])
  assert m["meta"]["preset"]["seq_len"] == 64          # one source: its preset is kept
  assert os.path.exists(os.path.join(merged, "runs", "copy_L64", "full_s0", "analysis.npz"))
  # the notebook test renders this finished run instead of training its own (same process)
  os.environ.setdefault("JATTN_COAD_RESULTS", out)


def test_a_baseline_that_does_not_solve_the_task_stops_the_run(tmp_path, capsys):
  out = str(tmp_path / "gate")
  args = ["--preset", "plumbing", "--out", out, "--no-progress", "--variants", "full,sparse_ste",
          "--set", "min_baseline_score=0.99", "--set", "steps=1"]
  assert C.main(args) == 4
  err = capsys.readouterr().err
  assert "dense baseline scores" in err and "not solved" in err
  assert not os.path.exists(os.path.join(out, "runs", "sparse_ste_s0", "result.json"))


def _tiny(**kw):
  base = dict(seq_len=64, num_layers=2, d_model=32, num_heads=2, num_kv_heads=1, head_dim=16,
              batch_size=4, steps=6, lr=3e-3, warmup_steps=2, block_size=8, window=16,
              csa_top_k=4, csa_window=8, num_pairs=1, num_queries=1, corpus_bytes=100_000,
              eval_retrieval=4, eval_text=4, ckpt_every=2, log_every=1)
  base.update(kw)
  return C.Preset(name="tiny", **base)


def test_resume_is_exact(tmp_path):
  """A run stopped after 3 steps and resumed ends bit-identical to an uninterrupted run (Gumbel
  gates: the RNG stream is part of the checkpoint)."""
  preset = _tiny()
  ctx = C.Context(preset, devices=jax.devices()[:1])
  ref, done = C.train_run(ctx, "sparse_gumbel", 0, str(tmp_path / "a"), progress=False)
  assert done
  part, done = C.train_run(ctx, "sparse_gumbel", 0, str(tmp_path / "b"), stop_after=3,
                           progress=False)
  assert not done and part.step == 3
  res, done = C.train_run(ctx, "sparse_gumbel", 0, str(tmp_path / "b"), progress=False)
  assert done and res.fit_start_step == 3 and res.step == 6
  for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(res.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for a, b in zip(jax.tree.leaves(ref.opt_state), jax.tree.leaves(res.opt_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert ref.curves["loss"] == res.curves["loss"]
  m1, m2 = ref.evaluate(ctx.eval_retrieval), res.evaluate(ctx.eval_retrieval)
  assert m1 == m2
  # and training did change the parameters (the comparison is not vacuous)
  fresh = C.build_model(preset, "sparse_gumbel", 0)
  from flax import nnx
  p0 = jax.tree.leaves(nnx.state(fresh, nnx.Param))
  assert any(not np.array_equal(np.asarray(a), np.asarray(b))
             for a, b in zip(p0, jax.tree.leaves(ref.params)))


def _np(x):
  """A numpy copy of an array leaf (typed PRNG keys as their key data)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return np.asarray(x)


class _Killed(BaseException):
  """A hard kill: not an ``Exception``, so no handler and no save of ``fit`` sees it."""


def test_killed_run_resumes_from_last_periodic_checkpoint(tmp_path, monkeypatch):
  """A run killed between periodic checkpoints (ckpt_every=2; dies in the 5th of 6 steps, no
  final save) reruns from the step-4 checkpoint, replays the data stream from there and ends
  bit-identical to an uninterrupted run. Same preset/variant as test_resume_is_exact, so the
  jitted train and eval steps are already compiled in a full run of this file."""
  from experiments import train_lib
  preset = _tiny()
  assert preset.ckpt_every == 2 and preset.steps == 6
  ctx = C.Context(preset, devices=jax.devices()[:1])
  ref, done = C.train_run(ctx, "sparse_gumbel", 0, str(tmp_path / "a"), progress=False)
  assert done
  saved, real_step, real_save = [], train_lib._train_step, train_lib.Trainer.save
  with monkeypatch.context() as m:
    def killed_step(*args):
      if killed_step.calls == 4:              # step index 4: after the step-4 checkpoint
        raise _Killed
      killed_step.calls += 1
      return real_step(*args)
    killed_step.calls = 0

    def recording_save(self, manager, extra=None):
      saved.append(self.step)
      return real_save(self, manager, extra)
    m.setattr(train_lib, "_train_step", killed_step)
    m.setattr(train_lib.Trainer, "save", recording_save)
    with pytest.raises(_Killed):
      C.train_run(ctx, "sparse_gumbel", 0, str(tmp_path / "b"), progress=False)
  assert saved == [2, 4]                                  # periodic only; nothing at the kill
  assert sorted(os.listdir(tmp_path / "b" / "ckpt")) == ["2", "4"]   # two kept
  # a kill during a save leaves orbax's unfinalised temporary directory: the rerun ignores it
  os.makedirs(tmp_path / "b" / "ckpt" / "6.orbax-checkpoint-tmp-0" / "state")
  res, done = C.train_run(ctx, "sparse_gumbel", 0, str(tmp_path / "b"), progress=False)
  assert done and res.fit_start_step == 4 and res.step == 6
  for a, b in zip(jax.tree.leaves((ref.params, ref.rest, ref.opt_state)),
                  jax.tree.leaves((res.params, res.rest, res.opt_state))):
    np.testing.assert_array_equal(_np(a), _np(b))
  for k in ("step", "loss", "answer_acc", "lr", "span"):  # no duplicated or missing entries
    assert res.curves[k] == ref.curves[k], k
  assert res.curves["step"] == list(range(6))
  assert ref.evaluate(ctx.eval_retrieval) == res.evaluate(ctx.eval_retrieval)


def test_deadline_stops_with_a_checkpoint_and_resumes(tmp_path):
  """--time-budget: a passed deadline stops training after the current step with a checkpoint
  (run_experiment reports unfinished); the same call without a deadline continues from there."""
  import time
  preset = _tiny(steps=4)
  ctx = C.Context(preset, devices=jax.devices()[:1])
  run_dir = str(tmp_path / "r")
  part, done = C.train_run(ctx, "full", 0, run_dir, progress=False,
                           deadline=time.monotonic() - 1.0)
  assert not done and part.step == 1
  res, done = C.train_run(ctx, "full", 0, run_dir, progress=False)
  assert done and res.fit_start_step == 1 and res.step == 4
  rows, finished = C.run_experiment(preset, str(tmp_path / "x"), variants=("full",),
                                    progress=False, devices=jax.devices()[:1],
                                    deadline=time.monotonic() - 1.0)
  assert rows == [] and not finished


def test_deadline_leaves_a_run_unstarted_when_the_last_one_took_longer(tmp_path, monkeypatch):
  """A run that a finished run's wall time says cannot end before the deadline is not started
  (a device call's unfinished runs would be lost): no checkpoint is written for it."""
  import time
  preset = _tiny(steps=2, min_baseline_score=0.0)
  skip = [0.0]
  real = time.monotonic
  monkeypatch.setattr(time, "monotonic", lambda: real() + skip[0])
  deadline = real() + 1e4
  lines = []

  def on_row(rows):   # after the full run (seconds of compiling and training): 0.5 s left
    skip[0] = deadline - real() - 0.5
  rows, finished = C.run_experiment(preset, str(tmp_path / "x"), variants=("full", "sparse_ste"),
                                    seeds=1, progress=False, devices=jax.devices()[:1],
                                    deadline=deadline, on_row=on_row, log=lines.append)
  assert [r["variant"] for r in rows] == ["full"] and not finished
  assert "sparse_ste seed 0 not started" in lines[-1]
  assert not os.path.exists(tmp_path / "x" / "runs" / "sparse_ste_s0" / "ckpt")


DP_SCRIPT = textwrap.dedent("""
  import json, jax, numpy as np
  from experiments import coadaptation as C
  from tests.experiments.test_coadaptation import _tiny
  assert len(jax.devices()) == 4, jax.devices()
  preset = _tiny(steps=3, batch_size=8)
  out = {}
  for n in (4, 1):
    ctx = C.Context(preset, devices=jax.devices()[:n])
    tr, _ = C.train_run(ctx, "sparse_ste", 0, f"{OUT}/dp{n}", progress=False)
    out[n] = [np.asarray(x) for x in jax.tree.leaves(tr.params)]
    if n == 4:
      from experiments.train_lib import shard_batch, BATCH_KEYS
      b = shard_batch({k: ctx.stream(0).batch(0)[k] for k in BATCH_KEYS}, ctx.mesh)
      shards = len(b["inputs"].addressable_shards)
      shard_rows = b["inputs"].addressable_shards[0].data.shape[0]
      loss4 = tr.curves["loss"]
    else:
      loss1 = tr.curves["loss"]
  err = max(float(np.linalg.norm(a - b) / np.linalg.norm(b)) for a, b in zip(out[4], out[1]))
  print(json.dumps({"err": err, "shards": shards, "shard_rows": shard_rows,
                    "loss4": loss4, "loss1": loss1}))
""")


@pytest.mark.heavy
def test_data_parallel_on_four_cpu_devices(tmp_path):
  env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +   # keeps conftest's
                                    " --xla_force_host_platform_device_count=4").strip(),
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  script = DP_SCRIPT.replace("{OUT}", str(tmp_path))
  proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  res = json.loads(proc.stdout.strip().splitlines()[-1])
  assert res["shards"] == 4 and res["shard_rows"] == 2
  # the same global batch on 4 devices and on 1: same training up to float reassociation
  assert res["err"] < 1e-4, res
  np.testing.assert_allclose(res["loss4"], res["loss1"], rtol=1e-5)


CP_SCRIPT = textwrap.dedent("""
  import json, os, jax
  import jattn.nn.attention as attn_mod
  from experiments import coadaptation as C
  assert len(jax.devices()) == 2, jax.devices()
  calls, real = [], attn_mod.context_parallel_attention
  attn_mod.context_parallel_attention = lambda *a, **kw: calls.append(1) or real(*a, **kw)
  out = os.path.join("{OUT}", "cp2")   # each sequence over both devices
  assert C.main(["--preset", "plumbing", "--out", out, "--no-progress", "--variants", "full",
                 "--seeds", "1", "--context-parallel", "2"]) == 0
  with open(os.path.join(out, "results.json")) as f:
    row = json.load(f)["rows"][0]
  cp_calls = len(calls)
  ctx = C.Context(C.PRESETS["plumbing"])   # the reference: data parallel over both devices
  tr, _ = C.train_run(ctx, "full", 0, os.path.join("{OUT}", "ref"), progress=False)
  print(json.dumps({"calls": [cp_calls, len(calls) - cp_calls],
                    "cp": row["curves"]["loss"] + [row["loss"]],
                    "ref": tr.curves["loss"] + [tr.evaluate(ctx.eval_text)["text_nll"]]}))
""")



@pytest.mark.heavy
def test_context_parallel_training_on_two_cpu_devices(tmp_path):
  """--context-parallel 2 (zig-zag sequence shards, segment ids, RoPE positions) trains the
  plumbing preset as the unsharded run does: the same losses (training curve and held-out text)
  up to float reassociation. The ring merges chunk partials by log-sum-exp instead of one
  softmax (fp32 relative differences ~1e-7 per call; measured through 4 Adam steps: 2e-7), so
  rtol 1e-5; a batch left in the original order changes the losses by 1.6%."""
  env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                                    " --xla_force_host_platform_device_count=2").strip(),
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run([sys.executable, "-c", CP_SCRIPT.replace("{OUT}", str(tmp_path))],
                        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  res = json.loads(proc.stdout.strip().splitlines()[-1])
  assert res["calls"][0] > 0 and res["calls"][1] == 0, res
  np.testing.assert_allclose(res["cp"], res["ref"], rtol=1e-5)


def test_compute_dtype_reaches_the_attention_kernels(monkeypatch):
  """A preset's compute_dtype is the activations' dtype, so attention gets bf16 q/k/v (with
  dtype=None the fp32 norms handed fp32 q/k/v to the kernels: IEEE fp32 dots on the GPU)."""
  import jax
  import jax.numpy as jnp
  import jattn.nn.attention as attn_mod
  from experiments import coadaptation as C
  seen = []
  real = attn_mod.flash_attention

  def spy(q, k, v, *args, **kwargs):
    seen.append((q.dtype, k.dtype, v.dtype))
    return real(q, k, v, *args, **kwargs)

  monkeypatch.setattr(attn_mod, "flash_attention", spy)
  for compute, want in (("bfloat16", jnp.bfloat16), (None, jnp.float32)):
    seen.clear()
    p = dataclasses.replace(C.PRESETS["plumbing"], compute_dtype=compute)
    model = C.build_model(p, "full", 0)
    jax.eval_shape(lambda t: model(t), jnp.zeros((1, p.seq_len), jnp.int32))
    assert seen and all(d == (want,) * 3 for d in seen), (compute, seen)


def test_dry_run_preset_runs_the_pallas_kernels_in_interpret_mode(monkeypatch):
  """--dry-run keeps the model and dtypes of a GPU preset and sends attention through the Triton
  kernels in interpret mode (the full CLI rehearsal takes minutes; this checks the wiring)."""
  import jax
  import jax.numpy as jnp
  import jattn.attention as api
  from experiments import coadaptation as C
  p = C.dry_run_preset(C.PRESETS["gpu8k"])
  base = C.PRESETS["gpu8k"]
  assert (p.num_layers, p.d_model, p.head_dim, p.compute_dtype, p.block_size) == (
      base.num_layers, base.d_model, base.head_dim, base.compute_dtype, base.block_size)
  assert p.seq_len == 1024 and p.steps == 3 and p.interpret and p.implementation == "triton"
  import jattn.sparse.attention as sparse_api
  seen = []
  real = api.resolve

  def spy(op, *a, implementation=None, **kw):
    seen.append((implementation, kw.get("interpret")))
    return real(op, *a, implementation=implementation, **kw)

  monkeypatch.setattr(api, "resolve", spy)
  monkeypatch.setattr(sparse_api, "resolve", spy)
  model = C.build_model(p, "full", 0)
  jax.eval_shape(lambda t: model(t), jnp.zeros((1, p.seq_len), jnp.int32))
  assert seen and all(s == ("triton", True) for s in seen), seen


@pytest.mark.slow
def test_dry_run_of_a_gpu_preset_finishes(tmp_path, capsys):
  """Every variant of a GPU preset on the CPU (over 25 minutes on 2 cores): training through
  the Triton kernels (16-query tiles), post-hoc per-token selection, trained top-K with a
  fractional top_k, local/global, both CSA modes, decode timing, analysis and the table (the
  3-step baseline cannot solve the task: threshold 0)."""
  out = str(tmp_path / "dry")
  assert C.main(["--preset", "gpu4k", "--dry-run", "--out", out, "--seeds", "1", "--no-progress",
                 "--set", "min_baseline_score=0"]) == 0
  rows = json.load(open(os.path.join(out, "results.json")))["rows"]
  assert sorted(r["variant"] for r in rows) == sorted(C.VARIANTS)


def test_override_preset_parses_by_field_type():
  from experiments import coadaptation as C
  p = C.override_preset(C.PRESETS["gpu8k"], ["lr=1e-3", "steps=120", "curriculum_ramp=0.5",
                                            "compute_dtype=none", "corpus_bytes=1000"])
  assert (p.lr, p.steps, p.curriculum_ramp, p.compute_dtype, p.corpus_bytes) == (
      1e-3, 120, 0.5, None, 1000)
  for bad in (["nope=1"], ["steps"], ["steps=1.5"]):
    with pytest.raises(ValueError):
      C.override_preset(C.PRESETS["gpu8k"], bad)


def test_sparse_distill_variant_same_forward_more_gradient():
  """sparse_distill: every layer LayerSpec("sparse", score_aux_weight=w); the model computes exactly
  what sparse_none computes from the same weights, and only the q/k projections get an extra
  gradient (the score-distillation term); --set reaches its weight and gate."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from jattn.nn import LayerSpec
  p = _tiny(seq_len=128, block_size=16, num_layers=1)
  layers = C.variant_layers(p, "sparse_distill")
  assert all(s.kind == "sparse" and s.score_aux_weight == 1.0 and s.gate_grad == "none"
             and s.score_aux_pool == "max" for s in layers)
  q = C.override_preset(p, ["score_aux_weight=0.25", "aux_gate=ste", "aux_pool=sum"])
  assert C.variant_layers(q, "sparse_distill")[0].score_aux_weight == 0.25
  assert C.variant_layers(q, "sparse_distill")[0].score_aux_pool == "sum"
  assert C.variant_layers(q, "sparse_distill")[0].gate_grad == C._gate_name("ste")
  assert all(s.score_aux_weight == 0.0 for s in C.variant_layers(p, "sparse_ste"))
  with pytest.raises(ValueError, match="score_aux_weight"):
    LayerSpec("global", score_aux_weight=1.0)
  with pytest.raises(ValueError, match="score_aux_pool"):
    LayerSpec("sparse", top_k=1, score_aux_pool="mean")
  toks = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 128)), jnp.int32)
  outs, grads = [], []
  for v in ("sparse_none", "sparse_distill"):
    gd, params, rest = nnx.split(C.build_model(p, v, 0), nnx.Param, ...)

    def loss(params):
      return jnp.mean(nnx.merge(gd, params, rest)(toks) ** 2)
    val, g = jax.jit(jax.value_and_grad(loss))(params)
    outs.append(float(val))
    grads.append({"/".join(map(str, k)): np.asarray(x) for k, x in
                  jax.tree_util.tree_leaves_with_path(g)})
  assert outs[0] == outs[1]
  changed = {k for k in grads[0] if not np.array_equal(grads[0][k], grads[1][k])}
  assert any("wq" in k for k in changed) and any("wk" in k for k in changed), changed
  assert not any("wv" in k or "wo" in k for k in changed), changed   # values: untouched
  assert all(np.isfinite(x).all() for x in grads[1].values())

