"""experiments.bench on the CPU: case and implementation names, the references, a tiny run of
every case family with its results file and summary, and the committed results files' format."""
import dataclasses
import functools
import glob
import json
import os

import jax
import jax.numpy as jnp
import pytest

import jattn
from experiments import bench
from pallas_kernels.tuning import timing
from pallas_kernels.flash.reference import attention_reference

FAST = functools.partial(timing.time_fn, iters=1, repeats=1)


def test_time_fn_rotates_input_sets():
  seen = []
  f = lambda x: seen.append(float(x[0])) or x
  ms, spread = timing.time_fn(f, [(jnp.full(2, i, jnp.float32),) for i in range(3)], iters=6,
                              repeats=2)
  assert ms > 0 and spread >= 0 and seen[3:] == [0.0, 1.0, 2.0] * 4   # warm-up, then loops


def test_time_fn_automatic_iterations_are_bounded():
  calls = []
  f = lambda x: calls.append(1) or x
  timing.time_fn(f, [(jnp.ones(2),)], min_time=0.0, min_iters=5, repeats=3)
  assert len(calls) == 1 + 1 + 5 * 3          # warm-up, the one timed probe call, 3 loops of 5


def test_anchor_group_holds_the_compared_cases():
  assert bench.expand_cases("anchors") == [
      "flash_d128_fwd", "flash_d128_fwdbwd", "flash_d128_causal_fwd", "flash_d128_causal_fwdbwd",
      "flash_window512_fwd", "flash_window512_fwdbwd", "decode_b1_s128k", "sparse_64k"]
  c = bench.CASES["flash_d128_causal_fwdbwd"]
  assert (c.batch, c.seq, c.heads, c.head_dim, c.causal, c.op) == (2, 16384, 16, 128, True,
                                                                   "flash_fwd_bwd")
  assert bench.CASES["flash_window512_fwd"].window == (511, 0)
  d = bench.CASES["decode_b1_s128k"]
  assert (d.batch, d.seq, d.heads, d.kv_heads, d.head_dim) == (1, 131072, 32, 8, 128)
  s = bench.CASES["sparse_64k"]
  assert (s.seq, s.q_block, s.block, s.fraction, s.op) == (65536, 128, 64, 0.19, "sparse_fwd_bwd")
  assert set(bench.expand_cases("all")) == set(bench.CASES)


def test_case_names_groups_and_unknown_names():
  assert bench.expand_cases("decode_b1_s128k,flash_d128") == [
      "flash_d128_fwd", "flash_d128_fwdbwd", "decode_b1_s128k"]          # CASES order
  assert bench.expand_cases("sparse,sparse_64k") == ["sparse_16k", "sparse_64k",
                                                     "sparse_decode_b1_s128k"]
  with pytest.raises(ValueError, match="unknown case.*nope.*valid cases: flash_d128_fwd"):
    bench.expand_cases("flash_d128,nope")


@pytest.mark.parametrize("argv,bad,valid", [
    (["--impl", "jattn,cudnn_fast", "--case", "decode_b1_s128k"], "cudnn_fast", bench.IMPLS),
    (["--impl", "jattn", "--impl", "xla", "--all"], "xla", bench.IMPLS),
    (["--case", "flash_d512"], "flash_d512", bench.CASES),
    (["--case", "decode", "--case", "decode_b1_s128k,nope"], "nope", bench.CASES),
    ([], "--all", ("--case NAME", "--list")),                 # nothing chosen
    (["--all", "--case", "sparse_16k"], "not allowed with", ()),
])
def test_bad_command_lines_exit_2(argv, bad, valid, capsys):
  """Unknown names (and no choice of cases) exit with status 2, naming them and the valid ones."""
  with pytest.raises(SystemExit) as e:
    bench.main(argv)
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert bad in err and all(name in err for name in valid), err


def test_impls_and_list(capsys):
  assert bench.parse_impls("jattn, jax_nn_xla,jattn") == ["jattn", "jax_nn_xla"]
  assert {"jax_nn_cudnn", "jax_nn_xla"} <= set(bench.DEFAULT_IMPLS)   # the anchors, always
  assert bench.main(["--list"]) == 0
  out = capsys.readouterr().out
  assert all(name in out for name in [*bench.CASES, *bench.GROUPS])


def test_help_lists_cases_groups_and_impls(capsys):
  with pytest.raises(SystemExit) as e:
    bench.main(["--help"])
  assert e.value.code == 0
  out = capsys.readouterr().out
  assert all(name in out for name in [*bench.IMPLS, *bench.CASES, *bench.GROUPS])


def test_results_path():
  assert bench.results_path(list(bench.CASES), device_kind="NVIDIA H100 80GB HBM3").endswith(
      os.path.join("experiments", "results", "h100.json"))
  assert bench.results_path(list(bench.CASES), tiny=True) is None
  assert bench.results_path(["sparse_64k"]) is None
  assert bench.results_path(["sparse_64k"], "x.json") == "x.json"
  assert bench.device_slug("TPU v5 lite") == "tpu_v5_lite"


@pytest.mark.parametrize("case", ["flash_window512_fwdbwd", "flash_packed_fwd",
                                  "flash_d128_causal_fwdbwd"])
def test_reference_matches_attention_reference(case):
  """The chunked fp32 reference (forward and gradients) equals the library's reference."""
  c = bench.CASES[case].tiny()
  s, d = c.seq, c.head_dim
  q, k, v, ct = (jax.random.normal(jax.random.key(i), (s, d), jnp.float32) for i in range(4))
  seg = None
  if c.docs:
    seg = jnp.repeat(jnp.arange(1, c.docs + 1, dtype=jnp.int32), s // c.docs)
  out, grads = bench.reference(q, k, v, bench.flash_mask_fn(c, seg), ct=ct, chunk=96)

  def ref(q, k, v):
    o, _ = attention_reference(q[None, :, None], k[None, :, None], v[None, :, None],
                               causal=c.causal, local_window_size=c.window,
                               q_segment_ids=None if seg is None else seg[None],
                               kv_segment_ids=None if seg is None else seg[None])
    return o[0, :, 0]
  want, vjp = jax.vjp(ref, q, k, v)
  assert bench.rel_err(out, want) < 1e-5
  for g, w in zip(grads, vjp(ct)):
    assert bench.rel_err(g, w) < 1e-5


def test_decode_reference_is_the_last_row_of_attention():
  q = jax.random.normal(jax.random.key(0), (2, 4, 16))
  k, v = (jax.random.normal(jax.random.key(i), (2, 40, 2, 16)) for i in (1, 2))
  lengths = jnp.array([40, 7])
  keep = jax.random.bernoulli(jax.random.key(3), 0.5, (2, 2, 40)).at[:, :, 0].set(True)
  got = bench.decode_reference(q, k, v, lengths, keep=keep)
  for b in range(2):
    for h in range(4):
      g = h // 2
      mask = lambda r, c: ((c < lengths[b]) & keep[b, g][c])[None, :]
      want = bench.reference(q[b, h][None], k[b, :, g], v[b, :, g], mask)[0]
      assert bench.rel_err(got[b, h], want) < 1e-5, (b, h)


@pytest.mark.parametrize("seq,q_block,block", [(1024, 128, 64), (1024, 64, 64), (768, 128, 128)])
def test_causal_top_k_matches_the_selection(seq, q_block, block):
  """The bench's top_k keeps the fraction it predicts in jattn's own selection."""
  top_k, frac = bench.causal_top_k(seq, 0.3, q_block=q_block, block=block)
  q = jax.random.normal(jax.random.key(0), (1, seq, 2, 16))
  sel = jattn.select_blocks(q, q, block_size=block, q_block_size=q_block, top_k=top_k)
  kept = float(jnp.sum(sel.counts)) / (bench._visible_blocks(seq, q_block, block) * 2)
  assert abs(kept - frac) < 1e-9


def test_causal_top_k_of_the_64k_case():
  assert bench.causal_top_k(65536, 0.19, q_block=128, block=64)[0] == 100
  assert bench.causal_top_k(16384, 0.19, q_block=128, block=64)[0] == 23


def _check_file(result, cases):
  meta = result["meta"]
  for key in ("date", "device", "jax_version", "commit", "command"):
    assert meta.get(key), key
  assert {r["case"] for r in result["rows"]} == set(cases)
  for r in result["rows"]:
    assert r["case"] in bench.CASES and r["op"] == bench.CASES[r["case"]].op
    assert {"op", "case", "impl", "ms", "ok"} <= set(r), r
    if r.get("ms") is None:
      continue
    assert ("tflops" in r) != ("tbps" in r), r
    if r["op"].startswith("sparse") and not r["impl"].endswith("_dense"):
      assert r["speedup"] > 0, r


def test_tiny_run_every_family(tmp_path, monkeypatch, capsys):
  """One case of each family at tiny sizes, jattn and the XLA anchor: rows checked, file
  written, summary printed."""
  monkeypatch.setattr(bench, "time_fn", FAST)
  out = str(tmp_path / "r.json")
  cases = ["flash_window512_fwdbwd", "flash_packed_fwd", "decode_b8_s32k_paged", "sparse_16k",
           "sparse_decode_b1_s128k"]
  assert bench.main(["--tiny", "--case", ",".join(cases[:2]), "--case", ",".join(cases[2:]),
                     "--impl", "jattn", "--impl", "jax_nn_xla", "--out", out]) == 0
  assert not os.path.exists(out + ".partial")
  with open(out) as fh:
    result = json.load(fh)
  _check_file(result, cases)
  assert result["meta"]["command"].startswith("python -m experiments.bench --tiny")
  rows = {(r["case"], r["impl"]): r for r in result["rows"]}
  want = [(c, i) for c in cases[:3] for i in ("jattn", "jax_nn_xla")]
  want += [(c, i) for c in cases[3:] for i in ("jattn", "jattn_dense")]
  assert set(rows) == set(want)
  for r in rows.values():
    assert r["ok"] and 0 <= r["rel_err"] < 2e-2 and r["ms"] > 0, r
  sp = rows[("sparse_16k", "jattn")]
  assert 0 < sp["kept_fraction"] < 1 and sp["speedup"] == pytest.approx(
      rows[("sparse_16k", "jattn_dense")]["ms"] / sp["ms"])
  table = bench.summary(result)
  assert table in capsys.readouterr().out                      # printed at the end of the run
  assert "| flash_window512_fwdbwd |" in table and "speed vs best anchor" in table
  assert "| sparse_16k |" in table and "jattn dense ms" in table
  line = next(ln for ln in table.splitlines() if ln.startswith("| flash_packed_fwd |"))
  j, a = (rows[("flash_packed_fwd", i)]["ms"] for i in ("jattn", "jax_nn_xla"))
  assert line.endswith(f"| {a / j:.2f} |")


def test_a_failing_implementation_is_a_failed_row(tmp_path, monkeypatch, capsys):
  """An implementation that raises (here: an explicit Pallas kernel without interpret on a
  CPU, or cuDNN without a GPU) gives a row with ok False and its error; the run goes on."""
  monkeypatch.setattr(bench, "time_fn", FAST)
  out = str(tmp_path / "r.json")
  assert bench.main(["--tiny", "--case", "decode_b1_s128k", "--impl",
                     "jattn_xla,jax_nn_cudnn", "--out", out]) == 0
  with open(out) as fh:
    result = json.load(fh)
  rows = {r["impl"]: r for r in result["rows"]}
  assert rows["jattn_xla"]["ok"]
  if jax.default_backend() == "cpu":
    assert rows["jax_nn_cudnn"]["ok"] is False and rows["jax_nn_cudnn"]["error"]
    assert "fail" in bench.summary(result)


def test_interpreted_pallas_kernel_row(monkeypatch):
  """An explicit Pallas implementation in interpret mode is timed and checked like the rest."""
  monkeypatch.setattr(bench, "time_fn", FAST)
  b = bench.Bench(["jattn_triton"], interpret=True)
  c = dataclasses.replace(bench.CASES["flash_d128_causal_fwd"].tiny(), seq=128, batch=1,
                          head_dim=64)
  b.flash(c)
  (row,) = b.rows
  assert row["impl"] == "jattn_triton" and row["ok"] and row["rel_err"] < 2e-2, row


def test_summary_of_rows():
  rows = [dict(op="decode", case="decode_b1_s128k", shape="s", impl=i, ms=ms, tbps=1.0, ok=ok)
          for i, ms, ok in (("jattn", 1.0, True), ("jax_nn_cudnn", 2.0, True),
                            ("jax_nn_xla", 0.5, False))]
  table = bench.summary({"meta": {}, "rows": rows})
  assert "| decode_b1_s128k | s | 1.000 | 2.000 | fail | 2.00 |" in table   # failed anchor left out


RESULTS = sorted(glob.glob(os.path.join(bench.RESULTS_DIR, "*.json")))


@pytest.mark.parametrize("path", [p for p in RESULTS if not os.path.basename(p).startswith(
    ("packing",))], ids=os.path.basename)
def test_committed_results_files(path):
  """Every device file under experiments/results/ has the bench's format and is named after its
  device; its summary prints."""
  with open(path) as fh:
    result = json.load(fh)
  assert os.path.basename(path) == bench.device_slug(result["meta"]["device"]) + ".json"
  _check_file(result, result["meta"]["cases"])
  names = {r["case"] for r in result["rows"]}
  assert set(bench.GROUPS["anchors"]) <= names
  assert "speed vs best anchor" in bench.summary(result)


def test_xla_anchor_above_4k_is_a_skipped_row(monkeypatch):
  """jax.nn's XLA anchor is always asked for; where it would materialise 16K x 16K logits it
  is recorded as skipped (with the reason), never silently missing."""
  monkeypatch.setattr(bench, "time_fn", FAST)
  b = bench.Bench(["jax_nn_xla"])
  assert b._flash_fn(bench.CASES["flash_d128_fwd"], "jax_nn_xla", None) is None
  (row,) = b.rows
  assert row["skipped"] and row["ms"] is None and row["case"] == "flash_d128_fwd"
  table = bench.summary({"meta": {}, "rows": b.rows})
  assert table.splitlines()[-1].split(" | ")[3] == "n/a"


def test_docs_are_generated_from_the_results_files(tmp_path, monkeypatch):
  """docs/benchmarks.md and the README's table are what --write-docs makes of the committed
  H100 and H200 results (regenerate them with the command after a new run); the command
  rewrites only the README's marked block, from the first file."""
  names = ["experiments/results/h100.json", "experiments/results/h200.json"]
  paths = [os.path.join(bench.ROOT, n) for n in names]
  results = []
  for path in paths:
    with open(path) as fh:
      results.append(json.load(fh))
  with open(bench.DOCS_PAGE) as fh:
    assert fh.read() == bench.benchmarks_page(results, names)
  with open(bench.README) as fh:
    readme = fh.read()
  assert f"{bench.README_BEGIN}\n{bench.summary(results[0], bench.README_CASES)}\n{bench.README_END}" in readme
  page, fake_readme = tmp_path / "b.md", tmp_path / "README.md"
  fake_readme.write_text(f"intro\n{bench.README_BEGIN}\nold\n{bench.README_END}\noutro\n")
  monkeypatch.setattr(bench, "DOCS_PAGE", str(page))
  monkeypatch.setattr(bench, "README", str(fake_readme))
  assert bench.main(["--write-docs", *paths]) == 0
  assert page.read_text() == bench.benchmarks_page(results, names)
  assert fake_readme.read_text() == (f"intro\n{bench.README_BEGIN}\n{bench.summary(results[0], bench.README_CASES)}\n"
                                     f"{bench.README_END}\noutro\n")
  for result in results:
    for key in ("device", "jax_version", "commit", "date"):
      assert str(result["meta"][key]) in page.read_text()


def test_resume_runs_only_the_cases_a_stopped_run_left(tmp_path, monkeypatch, capsys):
  """``--resume`` keeps the finished cases of ``<out>.partial``, reruns its last (possibly cut)
  case and the rest, and refuses a partial file of other implementations."""
  monkeypatch.setattr(bench, "time_fn", FAST)
  out = str(tmp_path / "r.json")
  cases = ["decode_b1_s128k", "decode_b8_s32k_paged", "decode_b8_s32k"]
  stopped = bench.Bench(["jattn_xla"], out=out)
  stopped.run(cases[:2], tiny=True)                  # what a killed run leaves behind:
  os.rename(out, out + ".partial")                   # rows of the first two cases
  first = [r for r in stopped.rows if r["case"] == cases[0]]
  seen = []
  monkeypatch.setattr(bench.Bench, "decode", lambda self, case: (
      seen.append(case.name), bench.Bench.__dict__["_failed"](self, case, "jattn_xla",
                                                                ValueError("x")))[0])
  assert bench.main(["--tiny", "--case", ",".join(cases), "--impl", "jattn_xla", "--out", out,
                     "--resume"]) == 0
  assert seen == cases[1:]                           # the cut case again, then the new one
  with open(out) as fh:
    result = json.load(fh)
  assert result["meta"]["cases"] == cases
  assert result["meta"]["date"].split(" to ")[0] == stopped.started   # the first call's start
  assert [r for r in result["rows"] if r["case"] == cases[0]] == first
  assert not os.path.exists(out + ".partial")
  stopped.run(cases[:1], tiny=True)
  os.rename(out, out + ".partial")
  with pytest.raises(SystemExit) as e:
    bench.main(["--tiny", "--case", "decode", "--impl", "jax_nn_xla", "--out", out, "--resume"])
  assert e.value.code == 2 and "impls" in capsys.readouterr().err
