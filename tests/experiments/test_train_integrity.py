"""Checkpoint integrity of the experiments' trainer: checksums, fallback to the previous good
checkpoint, configuration fingerprints, unwritable output folders, exact resume."""
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import coadaptation as C
from experiments import train_lib as T


class TinyLM(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(11, 8, rngs=rngs)
    self.out = nnx.Linear(8, 11, rngs=rngs)

  def __call__(self, tokens):
    return self.out(jnp.tanh(self.embed(tokens)))


class Stream:
  def batch(self, step):
    rng = np.random.default_rng([3, step])
    tok = rng.integers(0, 11, (2, 9)).astype(np.int32)
    return {"inputs": tok[:, :-1], "targets": tok[:, 1:],
            "segment_ids": np.ones((2, 8), np.int32), "positions": np.zeros((2, 8), np.int32),
            "weights": np.ones((2, 8), np.float32), "answer_mask": np.zeros((2, 8), bool)}

  def state(self, step):
    return {"next_step": step}


def _trainer(lr=1e-2):
  return T.Trainer(TinyLM(nnx.Rngs(0)), T.OptimConfig(lr=lr, warmup_steps=1, total_steps=6),
                   mesh=T.make_mesh(jax.devices()[:1]), use_segments=False)


def _fit(ckpt, lr=1e-2, **kw):
  tr = _trainer(lr)
  done = tr.fit(Stream(), 6, ckpt_dir=ckpt, ckpt_every=2, log_every=1, progress=False,
                config={"lr": lr, "steps": 6}, **kw)
  return tr, done


def _leaves(tr):
  return [np.asarray(x) for x in jax.tree.leaves((tr.params, tr.opt_state))]


def test_flipped_byte_is_reported_and_the_run_falls_back_to_the_previous_checkpoint(
    tmp_path, capsys):
  ref, _ = _fit(str(tmp_path / "ref"))
  ckpt = str(tmp_path / "run")
  _, done = _fit(ckpt, stop_after=4)
  assert not done and T.checkpoint_steps(ckpt) == [2, 4]          # two kept
  assert T.verify_integrity(os.path.join(ckpt, "4")) is None
  files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(ckpt, "4")) for f in fs
           if f != T.INTEGRITY_FILE]
  victim = max(files, key=os.path.getsize)
  with open(victim, "r+b") as f:                                  # flip one byte
    f.seek(os.path.getsize(victim) // 2)
    b = f.read(1)
    f.seek(-1, 1)
    f.write(bytes([b[0] ^ 0x01]))
  assert "checksum mismatch" in T.verify_integrity(os.path.join(ckpt, "4"))
  capsys.readouterr()
  res, done = _fit(ckpt)
  said = capsys.readouterr().out
  assert os.path.join(ckpt, "4") in said and "corrupt" in said and "checksum" in said
  assert done and res.fit_start_step == 2 and res.step == 6         # resumed from step 2
  assert os.path.isdir(ckpt + ".corrupt/4")                         # kept aside, not deleted
  for a, b in zip(_leaves(ref), _leaves(res)):                      # and still exact
    np.testing.assert_array_equal(a, b)
  assert res.curves["step"] == ref.curves["step"] == list(range(6))


def test_a_checkpoint_that_fails_to_restore_falls_back_too(tmp_path, capsys):
  ckpt = str(tmp_path / "run")
  _fit(ckpt, stop_after=4)
  os.remove(os.path.join(ckpt, "4", T.INTEGRITY_FILE))             # unverifiable
  res, _ = _fit(ckpt, stop_after=0)
  assert res.step == 2 and "integrity.json" in capsys.readouterr().out


def test_resume_with_another_learning_rate_is_refused(tmp_path):
  ckpt = str(tmp_path / "run")
  _fit(ckpt, stop_after=2)
  with pytest.raises(T.ConfigMismatchError, match=r"lr: 0\.01 there, 0\.02 now"):
    _fit(ckpt, lr=2e-2)
  res, _ = _fit(ckpt, stop_after=0)                                 # same settings: resumes
  assert res.step == 2


def test_cli_refuses_an_existing_out_with_other_settings(tmp_path, capsys):
  out = str(tmp_path / "o")
  C.bind_output_dir(out, C.PRESETS["plumbing"])
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["config"]["lr"] == 3e-3
  t0 = time.perf_counter()
  rc = C.main(["--preset", "plumbing", "--out", out, "--lr", "1e-3", "--no-progress"])
  assert rc == 2 and time.perf_counter() - t0 < 5
  err = capsys.readouterr().err
  assert "lr" in err and out in err and "steps" not in err
  with pytest.raises(T.ConfigMismatchError, match="batch_size"):
    C.bind_output_dir(out, C.override_preset(C.PRESETS["plumbing"], ["batch_size=6"]))
  C.bind_output_dir(out, C.override_preset(C.PRESETS["plumbing"], ["seeds=5"]))   # not bound


def test_unwritable_out_fails_fast_naming_the_path(tmp_path, capsys):
  blocker = tmp_path / "file"
  blocker.write_text("x")
  out = str(blocker / "out")                                        # parent is a file
  t0 = time.perf_counter()
  assert C.main(["--preset", "plumbing", "--out", out, "--no-progress"]) == 2
  assert time.perf_counter() - t0 < 5
  assert f"output directory {out!r} is not writable" in capsys.readouterr().err
  with pytest.raises(OSError, match="checkpoint directory .*file/ckpt"):
    _fit(str(blocker / "ckpt"))
  if os.geteuid() != 0:                                             # root ignores permissions
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    with pytest.raises(OSError, match="not writable"):
      T.ensure_writable_dir(str(ro))


def test_concurrent_writers_of_one_results_file_never_collide(tmp_path):
  """Parallel variant groups write the same partial results file: each write stays atomic and
  none fails on another's temporary file."""
  import concurrent.futures
  path = str(tmp_path / "results.json")

  def write(i):
    for j in range(200):
      T.save_json(path, {"writer": i, "j": j, "rows": list(range(300))})
  with concurrent.futures.ThreadPoolExecutor(4) as ex:
    list(ex.map(write, range(4)))
  with open(path) as f:
    assert json.load(f)["j"] == 199
  assert sorted(os.listdir(tmp_path)) == ["results.json"]
