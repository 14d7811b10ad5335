"""Documentation holds: every docstring example runs (doctest), every docs page's python code runs,
and every public function and class of a public module documents its arguments, return value and
an example."""
import doctest
import importlib
import inspect
import pathlib
import pkgutil
import re

import pytest

import jattn
import pallas_kernels


def _modules():
  names = []
  for pkg in (jattn, pallas_kernels):
    names.append(pkg.__name__)
    names += [m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
  return names


MODULES = _modules()


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
  mod = importlib.import_module(name)
  result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
                           verbose=False)
  assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


def _public(mod):
  names = getattr(mod, "__all__", None)
  if names is None:
    names = [n for n in vars(mod) if not n.startswith("_")]
  for n in names:
    obj = getattr(mod, n, None)
    if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == mod.__name__:
      yield obj


def test_public_api_is_documented():
  missing = {}
  for name in MODULES:
    if any(part.startswith("_") for part in name.split(".")):
      continue  # private modules
    for obj in _public(importlib.import_module(name)):
      doc = inspect.getdoc(obj) or ""
      miss = [] if "Example" in doc else ["Example"]
      if inspect.isfunction(obj):
        if inspect.signature(obj).parameters and "Args" not in doc:
          miss.append("Args")
        if "Returns" not in doc and "Yields" not in doc:
          miss.append("Returns")
      if miss:
        missing[f"{name}.{obj.__qualname__}"] = miss
  assert not missing, missing


DOC_PAGES = sorted((pathlib.Path(__file__).resolve().parent.parent / "docs").glob("*.md"))


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: p.name)
def test_doc_code_blocks_run(page):
  """Every ```python block of a docs page runs on the CPU (the page's blocks share one scope)."""
  blocks = re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.DOTALL)
  scope = {"__name__": f"docs.{page.stem}"}
  for i, code in enumerate(blocks):
    exec(compile(code, f"{page.name}, python block {i + 1}", "exec"), scope)
