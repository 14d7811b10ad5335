"""The README's code runs as written on a CPU (implementation=None -> "xla"), and its two commands
are the ones CI runs."""
import pathlib
import re

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


@pytest.mark.heavy
def test_readme_python_blocks_run():
  blocks = re.findall(r"```python\n(.*?)```", README, re.DOTALL)
  assert len(blocks) >= 2
  scope = {}
  for i, code in enumerate(blocks):
    exec(compile(code, f"README.md, python block {i + 1}", "exec"), scope)
  out, lse = scope["out"], scope["lse"]
  assert out.shape == (2, 1000, 8, 96) and lse.shape == (2, 8, 1000)
  assert np.all(np.isfinite(np.asarray(out, np.float32)))
  assert scope["plan"].implementation == "xla"
  assert scope["packed"].num_bins == 2                    # 4096 | 3000 + 900 + 120
  assert scope["logits"].shape == (2, 12, 256)


def test_readme_commands_are_the_ci_commands():
  ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
  test_cmd = 'pip install --no-compile -e ".[test,experiments]" && pytest -q -x -n 2'
  main_cmd = 'pip install -e ".[experiments]" && python -m experiments.coadaptation --out runs/default'
  first_block = re.search(r"```bash\n(.*?)```", README, re.DOTALL).group(1)
  assert test_cmd in first_block and main_cmd in first_block
  assert test_cmd in ci.splitlines()
