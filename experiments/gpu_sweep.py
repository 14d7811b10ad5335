"""Block-size sweep of the Triton flash kernels on the GPU (writes JSON rows to argv[1]).

    python -m experiments.gpu_sweep OUT.json

The winners go into ``_DEFAULT_BLOCK_SIZES`` in ``pallas_kernels/flash/triton.py``.
"""
import dataclasses
import json
import sys

from pallas_kernels.flash import triton as ft


def main():
  out = sys.argv[1]
  rows = []
  allc = ft._bench_configs()
  # 0: the default (per-pass tiles), 3: the previous single-tile default, then other tilings.
  configs = [allc[i] for i in (0, 3, 6, 7, 9, 11) if i < len(allc)]
  for seq, causal, window in ((16384, False, None), (16384, True, None), (16384, True, (511, 0))):
    for r in ft._sweep(seq=seq, causal=causal, local_window_size=window, configs=configs, iters=5):
      r = dict(r)
      r["config"] = dataclasses.asdict(r["config"]) if dataclasses.is_dataclass(r["config"]) else str(r["config"])
      r.update(seq=seq, causal=causal, window=window)
      rows.append(r)
      with open(out, "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
  main()
