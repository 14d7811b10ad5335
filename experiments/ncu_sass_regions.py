"""Stall samples by code region, from an Nsight Compute SASS source page (``ncu_report.sh``'s
``PREFIX_sass.csv.gz``).

A region is a run of consecutive SASS instructions that all executed the same number of times
(one basic block, or several with the same count: a loop body, a prologue). For each region
this prints its instruction range, its execution count, its share of all stall samples, the
samples per execution (relative to the busiest region's), and its most frequent opcodes. It is
how session 22 read run 52's window profile: the masked-tile loop bodies (~900 instructions,
160 ISETP and 192 FSEL more than the full-tile body's 471) held 5x the samples per execution
of the full-tile loop, which led to the edge masks.

  python experiments/ncu_sass_regions.py experiments/results/h200_ncu_fwd_window_sass_run52_20261201.csv.gz

A report with several kernels (ncu ``-c 2``) lists them one after the other; ``--kernel`` picks
one (0-based), default all.
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io


def _int(x: str) -> int:
  return int(x.replace(",", "") or 0)


def read_kernels(path: str):
  """Parse a SASS source page CSV (optionally gzipped).

  Args:
    path: the CSV file (``.gz`` read with gzip).

  Returns:
    A list of kernels, each (name, rows) with rows a list of dicts: ``op`` (the opcode without
    predicate or modifiers), ``source`` (the instruction text), ``executed`` (warp-level
    executions) and ``samples`` (all stall samples).

  Example:
    >>> text = ('"Kernel Name","k",\\n"Address","Source","Warp Stall Sampling (All Samples)",'
    ...         '"Instructions Executed"\\n"0x0","@P0 ISETP.GE.AND P0, PT, R1, R2, PT","3","8"\\n')
    >>> import tempfile, os
    >>> f = tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False); _ = f.write(text)
    >>> f.close(); read_kernels(f.name)[0][1][0]["op"]; os.unlink(f.name)
    'ISETP'
  """
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as f:
    rows = list(csv.reader(io.StringIO(f.read())))
  kernels, header, cur = [], None, None
  for r in rows:
    if not r:
      continue
    if r[0] == "Kernel Name":
      cur = (r[1] if len(r) > 1 else "?", [])
      kernels.append(cur)
      header = None
      continue
    if r[0] == "Address":
      header = r
      continue
    if header is None or cur is None or len(r) < len(header) - 1:
      continue
    i_src, i_s = header.index("Source"), header.index("Warp Stall Sampling (All Samples)")
    i_e = header.index("Instructions Executed")
    if not r[i_e].replace(",", "").isdigit():
      continue
    toks = r[i_src].split()
    op = (toks[1] if toks and toks[0].startswith("@") and len(toks) > 1 else
          (toks[0] if toks else "?")).split(".")[0]
    cur[1].append(dict(op=op, source=r[i_src].strip(), executed=_int(r[i_e]),
                       samples=_int(r[i_s])))
  return kernels


def regions(rows, *, min_len: int = 20, min_share: float = 0.01):
  """Group instructions into runs of equal execution count and keep the notable ones.

  Args:
    rows: one kernel's rows from ``read_kernels``.
    min_len: keep regions of at least this many instructions ...
    min_share: ... or holding at least this share of the kernel's stall samples.

  Returns:
    A list of dicts: first, last (instruction indices), n, executed, samples, share,
    per_exec (samples per execution), ops (Counter of opcodes).

  Example:
    >>> rows = [dict(op="FADD", executed=4, samples=2)] * 3 + [dict(op="BRA", executed=1, samples=5)]
    >>> [(r["n"], r["executed"], r["samples"]) for r in regions(rows, min_len=1)]
    [(3, 4, 6), (1, 1, 5)]
  """
  total = sum(r["samples"] for r in rows) or 1
  out, cur = [], None
  for i, r in enumerate(rows):
    if cur is not None and cur["executed"] == r["executed"]:
      cur["last"] = i
      cur["n"] += 1
      cur["samples"] += r["samples"]
      cur["ops"][r["op"]] += 1
    else:
      cur = dict(first=i, last=i, n=1, executed=r["executed"], samples=r["samples"],
                 ops=collections.Counter({r["op"]: 1}))
      out.append(cur)
  for c in out:
    c["share"] = c["samples"] / total
    c["per_exec"] = c["samples"] / c["executed"] if c["executed"] else 0.0
  return [c for c in out if c["n"] >= min_len or c["share"] >= min_share]


def main(argv=None):
  """Print the notable regions of each kernel of a SASS source page.

  Args:
    argv: command-line arguments (default sys.argv).

  Returns:
    {kernel index: list of regions} as printed.
  """
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("csv", help="SASS source page (ncu --page source --csv --print-source sass)")
  ap.add_argument("--kernel", type=int, default=None, help="only this kernel (0-based)")
  ap.add_argument("--min-len", type=int, default=20)
  ap.add_argument("--min-share", type=float, default=0.01)
  a = ap.parse_args(argv)
  result = {}
  for k, (name, rows) in enumerate(read_kernels(a.csv)):
    if a.kernel is not None and k != a.kernel:
      continue
    regs = regions(rows, min_len=a.min_len, min_share=a.min_share)
    top = max((r["per_exec"] for r in regs), default=1.0) or 1.0
    print(f"kernel {k}: {name}: {len(rows)} instructions, "
          f"{sum(r['samples'] for r in rows)} stall samples")
    for r in regs:
      ops = ", ".join(f"{o} {c}" for o, c in r["ops"].most_common(6))
      print(f"  [{r['first']:>5}-{r['last']:>5}] n={r['n']:>4} exec={r['executed']:>9} "
            f"samples={100 * r['share']:5.1f}% per_exec={r['per_exec'] / top:5.2f}  {ops}")
    result[k] = regs
  return result


if __name__ == "__main__":
  main()
