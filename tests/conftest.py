"""Shared test setup: GPU tests skip cleanly without a GPU; hypothesis profile for CI."""
import os

import jax
import pytest

try:
  from hypothesis import settings
  settings.register_profile("ci", max_examples=int(os.environ.get("JATTN_HYPOTHESIS_EXAMPLES", 25)),
                            deadline=None)
  settings.load_profile("ci")
except ImportError:  # pragma: no cover
  pass


def _has_gpu():
  try:
    return len(jax.devices("gpu")) > 0
  except RuntimeError:
    return False


def pytest_collection_modifyitems(config, items):
  if _has_gpu():
    return
  skip = pytest.mark.skip(reason="needs a GPU (run `pytest -m gpu` on a GPU machine)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
