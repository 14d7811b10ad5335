"""The tree describes the current state: no history references, bounded library size, layers
that import downwards only, a small experiments/ folder, a short README and a license.

CPU only, a few seconds; reads files, imports nothing of the library.
"""
import collections
import os
import pathlib
import re
import subprocess
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

HISTORY_DIRS = ("README.md", "docs", "jattn", "pallas_kernels", "experiments", "notebooks")
TEXT_SUFFIXES = (".py", ".md", ".json", ".ipynb", ".sh", ".txt")

# A history reference names a session, a numbered run or an issue. Matched case-insensitively.
# "run" followed by a number is flagged even where it could be ordinary English ("runs 4
# workers"): reword such text ("4 workers run"), the pattern stays simple and strict.
HISTORY_PATTERNS = {
  "session": r"\bsessions?[ _-]?#?\d+",                # "session 14", "sessions 27-28"
  "run": r"\bruns?[ -]?#?\d+",                         # "run 126", "runs 21-22", "(run 5)"
  "run in a name": r"(?<![a-z])runs?\d+(?![a-z])",    # "h200_run126_bench.json"
  "issue": r"\bissues?[ -]?#?\d+",                     # "issue 8", "issue #5"
  "session in a name": r"[_/]sessions?[_./]",          # "gpu_sessions/next_gpu_session_q.sh"
  "numbered issue": r"#\d+ issue",                    # "#8 issue"
}
HISTORY_RE = re.compile("|".join(f"(?P<g{i}>{p})" for i, p in enumerate(HISTORY_PATTERNS.values())),
                        re.IGNORECASE)

MAX_LIBRARY_FILE_LINES = 1200
# The library's line budget (comments and docstrings included) for every capability: the flash,
# decode, sparse, layer and packing families with the tuning command, input validation, the jax.nn
# drop-in, serving decode and context parallelism.
MAX_LIBRARY_PY_LINES = 13_680
MAX_EXPERIMENTS_FILES = 60
MAX_EXPERIMENTS_BYTES = 3 * 1024 * 1024
MAX_README_LINES = 250


def _tracked(*paths):
  """Files under ``paths`` that git tracks (plus untracked, not ignored ones), relative to ROOT.

  Outside a git checkout (an unpacked source archive): every file, minus caches.
  """
  try:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z",
                          "--", *paths], cwd=ROOT, capture_output=True, check=True).stdout
    files = [f for f in out.decode().split("\0") if f]
  except (OSError, subprocess.CalledProcessError):
    files = []
    for p in paths:
      p = ROOT / p
      found = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]
      files += [str(f.relative_to(ROOT)) for f in found if "__pycache__" not in f.parts]
  return sorted(f for f in files if (ROOT / f).is_file())


def _history_references(text):
  for lineno, line in enumerate(text.splitlines(), 1):
    for m in HISTORY_RE.finditer(line):
      yield lineno, m.group(0)


@pytest.mark.parametrize("snippet", [
  "session 14", "Sessions 27-28", "run 126", "runs 21-22", "(run 5)", "Run 13,",
  "h200_run126_bench.json", "issue 8", "Issue #5", "#8 issue", "run-16 process",
  "experiments/gpu_sessions/next_gpu_session_ze.sh", "mosaic_gpu_bwd_session.sh",
])
def test_history_pattern_catches(snippet):
  assert list(_history_references(snippet)), snippet


@pytest.mark.parametrize("snippet", [
  "runs on the GPU", "run the tests", "pytest -n 2", "rerun3x", "the truncated run",
  "issues a TMA copy", "2 seeds", "run_id", "prune 4 blocks",
])
def test_history_pattern_spares(snippet):
  assert not list(_history_references(snippet)), snippet


def test_no_history_references():
  """No session, numbered run or issue number in the tree's text (dates: CHANGELOG.md only)."""
  found = []
  for f in _tracked(*HISTORY_DIRS):
    if not f.endswith(TEXT_SUFFIXES):
      continue
    text = (ROOT / f).read_text(encoding="utf-8", errors="replace")
    found += [f"{f}:{n}: {ref!r}" for n, ref in _history_references(text)]
  per_file = collections.Counter(f.split(":", 1)[0] for f in found)
  assert not found, (f"{len(found)} history references in {len(per_file)} files "
                     f"{dict(per_file.most_common())}:\n" + "\n".join(found[:60]))


def test_library_file_sizes():
  """No library file over 1,200 lines; all library .py lines within MAX_LIBRARY_PY_LINES."""
  files = _tracked("jattn", "pallas_kernels")
  lines = {f: len((ROOT / f).read_bytes().splitlines()) for f in files}
  long = {f: n for f, n in lines.items() if n > MAX_LIBRARY_FILE_LINES}
  assert not long, f"files over {MAX_LIBRARY_FILE_LINES} lines: {long}"
  total = sum(n for f, n in lines.items() if f.endswith(".py"))
  assert total <= MAX_LIBRARY_PY_LINES, f"jattn + pallas_kernels: {total} .py lines"


def test_kernels_never_import_jattn():
  """``pallas_kernels`` is the lower layer: it never imports ``jattn``."""
  pattern = re.compile(r"^\s*(?:import\s+jattn\b|from\s+jattn\b)|import_module\(\s*['\"]jattn",
                       re.MULTILINE)
  bad = [f for f in _tracked("pallas_kernels") if f.endswith(".py")
         and pattern.search((ROOT / f).read_text(encoding="utf-8"))]
  assert not bad, f"pallas_kernels modules importing jattn: {bad}"


def test_experiments_folder_is_small():
  files = _tracked("experiments")
  size = sum(os.path.getsize(ROOT / f) for f in files)
  assert len(files) <= MAX_EXPERIMENTS_FILES, f"experiments/ holds {len(files)} files"
  assert size <= MAX_EXPERIMENTS_BYTES, f"experiments/ holds {size / 2**20:.1f} MiB"


def test_readme_is_short():
  n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
  assert n <= MAX_README_LINES, f"README.md has {n} lines"


def test_license_matches_pyproject():
  project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
  assert project["license"] == "Apache-2.0"
  assert "LICENSE" in project.get("license-files", [])
  text = (ROOT / "LICENSE").read_text(encoding="utf-8")
  assert "Apache License" in text and "Version 2.0, January 2004" in text
  assert "END OF TERMS AND CONDITIONS" in text          # the full text, not a pointer to it
