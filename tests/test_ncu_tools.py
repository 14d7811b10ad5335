"""experiments/ncu_sass_regions.py on a real profile (run 52's causal-window forward)."""
import doctest
import os

from experiments import ncu_sass_regions as nr

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WINDOW = os.path.join(ROOT, "experiments", "results",
                      "h200_ncu_fwd_window_sass_run52_20261201.csv.gz")


def test_docstring_examples_run():
  assert doctest.testmod(nr).failed == 0


def test_run52_window_regions():
  """Two kernels (``-c 2``); in each, the full-tile loop body (471 instructions, 1 ISETP) and
  two masked bodies (~900, 160+ ISETP) with ~5x its stall samples per execution, as
  docs/mosaic_fwd_vs_tokamax.md ("Edge masks") reads it."""
  kernels = nr.read_kernels(WINDOW)
  assert len(kernels) == 2
  for _, rows in kernels:
    regs = nr.regions(rows)
    assert abs(sum(r["share"] for r in nr.regions(rows, min_len=0)) - 1.0) < 1e-9
    full = [r for r in regs if r["n"] == 471]
    masked = [r for r in regs if r["n"] > 800 and r["ops"]["ISETP"] >= 160]
    assert len(full) == 1 and full[0]["ops"]["ISETP"] <= 2 and len(masked) == 2
    for m in masked:
      assert m["per_exec"] > 4 * full[0]["per_exec"]
  out = nr.main([WINDOW, "--kernel", "1"])
  assert list(out) == [1]
