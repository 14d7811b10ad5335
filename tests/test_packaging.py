"""The package metadata holds: a tested jax range with both bounds that the installed jax is in,
hardware extras, a version, the license, and ``jattn.nn`` reachable from ``import jattn``."""
import pathlib
import subprocess
import sys
import tomllib

import jax
from packaging.requirements import Requirement
from packaging.version import Version

import jattn

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _jax_spec(reqs):
  return next(Requirement(r) for r in reqs if Requirement(r).name == "jax").specifier


def test_jax_range_has_both_bounds_and_holds_the_installed_jax():
  spec = _jax_spec(PROJECT["dependencies"])
  ops = {s.operator for s in spec}
  assert ops & {">=", ">"} and ops & {"<", "<="}, str(spec)
  assert Version(jax.__version__) in spec, (jax.__version__, str(spec))


def test_hardware_extras_pin_the_same_range():
  extras = PROJECT["optional-dependencies"]
  for name, jax_extra in (("cuda12", "cuda12"), ("cuda13", "cuda13"), ("tpu", "tpu")):
    req = next(Requirement(r) for r in extras[name] if Requirement(r).name == "jax")
    assert req.extras == {jax_extra}
    assert req.specifier == _jax_spec(PROJECT["dependencies"])


def test_version_and_license():
  assert jattn.__version__ == PROJECT["version"]
  assert PROJECT["license"] == "Apache-2.0"
  assert "Apache License" in (ROOT / "LICENSE").read_text()
  names = {Requirement(r).name for r in PROJECT["dependencies"]}
  assert "chex" not in names   # never imported


def test_nn_is_lazy_and_reachable():
  code = ("import sys, jattn; assert 'jattn.nn' not in sys.modules; "
          "from jattn.nn import Transformer; assert jattn.nn.Transformer is Transformer")
  subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
