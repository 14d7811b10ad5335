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
  # Usage on the GPU: python -m experiments.gpu_sweep OUT.json (the A/B cases come first).
  configs = [allc[i] for i in (0, 3, 6, 7, 9, 11) if i < len(allc)]
  # Launch order A/B (causal only): the default groups 4 (batch, head) pairs, heaviest tiles first;
  # head_group=1 is the per-head order that runs 1-5 measured.
  per_head = dataclasses.replace(allc[0], head_group=1)
  cases = [(4096, True, None, [allc[0], per_head]), (16384, True, None, [allc[0], per_head])]
  cases += [(seq, causal, window, configs) for seq, causal, window in
            ((16384, False, None), (16384, True, None), (16384, True, (511, 0)))]
  for seq, causal, window, cfgs in cases:
    for r in ft._sweep(seq=seq, causal=causal, local_window_size=window, configs=cfgs, iters=5):
      r = dict(r)
      r["config"] = dataclasses.asdict(r["config"]) if dataclasses.is_dataclass(r["config"]) else str(r["config"])
      r.update(seq=seq, causal=causal, window=window)
      rows.append(r)
      with open(out, "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
  main()
