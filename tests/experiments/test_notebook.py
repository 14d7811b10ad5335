"""Execute notebooks/sparsity_patterns.ipynb with nbclient so it cannot rot.

The notebook reads a results directory from ``JATTN_COAD_RESULTS``. If that variable is set (CI
can point it at an existing plumbing run), the test uses it; otherwise it first runs the
plumbing-only preset with the four variants the cells need into a temporary directory.
"""
import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOK = os.path.join(ROOT, "notebooks", "sparsity_patterns.ipynb")


def _results_dir(tmp_path):
  given = os.environ.get("JATTN_COAD_RESULTS")
  if given and os.path.exists(os.path.join(given, "results.json")):
    return given
  from experiments import coadaptation as C
  out = str(tmp_path / "coad")
  assert C.main(["--preset", "plumbing", "--out", out, "--no-progress",
                 "--variants", "full,posthoc_proxy,posthoc_oracle,sparse_ste"]) == 0
  return out


def test_sparsity_patterns_notebook_executes(tmp_path, monkeypatch):
  out = _results_dir(tmp_path)
  monkeypatch.setenv("JATTN_COAD_RESULTS", out)
  monkeypatch.delenv("MPLBACKEND", raising=False)           # the notebook uses inline figures
  monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  nb = nbformat.read(NOTEBOOK, as_version=4)
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": ROOT}})
  client.execute()
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
  assert not [o for o in outputs if o.get("output_type") == "error"]
  images = [o for o in outputs if "image/png" in o.get("data", {})]
  assert len(images) >= 4                       # picked query, mass curves, heatmaps, curves
  text = "".join(o.get("text", "") for o in outputs)
  assert out in text and "posthoc_oracle" in text
  tables = [o for o in outputs if "text/markdown" in o.get("data", {})]
  assert tables and "| full |" in tables[0]["data"]["text/markdown"]
