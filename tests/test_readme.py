"""The README's usage example runs as written (CPU, implementation=None -> "xla")."""
import pathlib
import re

import numpy as np


def test_readme_usage_example_runs():
  text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
  code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
  scope = {}
  exec(compile(code, "README.md", "exec"), scope)
  out, lse = scope["out"], scope["lse"]
  assert out.shape == (2, 1000, 8, 96) and lse.shape == (2, 8, 1000)
  assert np.all(np.isfinite(np.asarray(out, np.float32)))
  assert scope["plan"].num_bins == 2  # 4096 | 3000 + 900 + 120
