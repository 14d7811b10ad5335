"""Shared memory, registers and spills of the sparse decode attention kernel's Triton configs,
on a machine without a GPU (occupancy questions before a GPU session).

Two steps, two Python environments:

1. ``dump`` (this repo's environment, jax): lowers ``sparse_decode`` / ``sparse_decode_partials``
   for CUDA at the issue-5 bench shape (B1 S128K, GQA 32:8, D128 bf16, 64-token blocks, 389 kept
   blocks per kv head) with ``jax.export(..., platforms=["cuda"])``, takes each Triton custom
   call's ``ir`` attribute (the Pallas kernel's TTIR as MLIR bytecode), prints it as text with
   jaxlib's Triton dialect registered and writes ``<config>.ttir`` plus ``<config>.json``
   (num_warps, num_stages). Configs are the probe's attention sweep names
   (``experiments/probe_sparse_decode.py``: ``s33_w4_st3_b1``, ``_nm`` = partials only, ...;
   ``_xm`` / ``_mk`` dump the partials kernel, which is what they launch).
2. ``compile`` (a separate venv with ``pip install triton``; no jax needed): compiles each
   ``.ttir`` with ``triton.compile(path, target=GPUTarget("cuda", 90, 32))`` and reports
   ``metadata.shared`` and, from the bundled ``ptxas`` (the newest one that accepts the PTX)
   with ``-v``, registers and spill bytes; writes ``resources.json``.

The numbers are upstream Triton's; XLA compiles the same TTIR with its own bundled Triton and
pass pipeline, so they can differ (docs/kernels.md, "Sparse decode" > "Run 19-20").

``dump-flash`` does step 1 for the flash backward (``pallas_kernels.flash.triton.
flash_attention_bwd``, the backward behind the Mosaic GPU forward): one ``<config>__dkv.ttir`` /
``<config>__dq.ttir`` pair (``__fused`` for a fused config) per backward config, spelled
``FLASH_SPEC`` (e.g. ``q64k64_w8s2_c32d32``), at B1 S4096 H2 bf16 causal (both the unmasked and
the masked chunk loops; the kernel code does not depend on the sequence length). The names of
``experiments.gpu_sweep.bwd_d256_configs`` are accepted too.

Usage:  python experiments/triton_resources.py dump --out /tmp/ttir [--configs s33,s33_nm,...]
        python experiments/triton_resources.py dump-flash --out /tmp/ttir_bwd --head-dim 256 \
            --configs q64k64_w8s2_c16d32,q128k64_w8s1_c64d32
        /path/to/venv/bin/python experiments/triton_resources.py compile /tmp/ttir
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys


def dump(out_dir, configs):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import jax
  import jax.numpy as jnp

  from experiments.probe_sparse_decode import attend_config_name, parse_attend_config
  from pallas_kernels.sparse.decode import sparse_decode, sparse_decode_partials

  shape = jax.ShapeDtypeStruct
  bf16, i32 = jnp.bfloat16, jnp.int32
  n, bs, hq, hk, d, width, default_splits = 131072, 64, 32, 8, 128, 389, 33
  args = (shape((1, hq, d), bf16), shape((1, n, hk, d), bf16), shape((1, n, hk, d), bf16),
          shape((1,), i32), shape((1, hk, width), i32), shape((1, hk), i32), shape((1, hk), i32))
  disabled = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  os.makedirs(out_dir, exist_ok=True)
  for spec in configs:
    cfg = parse_attend_config(spec, default_splits)
    name = attend_config_name(cfg)
    kw = dict(block_size=bs, num_splits=cfg["splits"], num_warps=cfg["num_warps"],
              num_stages=cfg["num_stages"], blocks_per_step=cfg["blocks_per_step"],
              index_lookahead=cfg["index_lookahead"])
    if cfg["merge"] == "":
      fn = lambda q, k, v, lens, i, c, a, kw=kw: sparse_decode(q, k, v, lens, i, None, c, a,
                                                               **kw)
    else:
      fn = lambda q, k, v, lens, i, c, a, kw=kw: sparse_decode_partials(q, k, v, lens, i, None,
                                                                        c, **kw)
    text = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=disabled)(
        *args).mlir_module()
    ttir, _, warps, stages = _triton_calls(text)[0]     # the attention kernel
    with open(os.path.join(out_dir, name + ".ttir"), "w") as f:
      f.write(ttir)
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
      json.dump(dict(config=name, num_warps=warps, num_stages=stages), f)
    print(f"{name}: {len(ttir)} chars of TTIR, num_warps={warps}, num_stages={stages}")


def _triton_calls(text):
  """[(ttir text, name, num_warps, num_stages)] of every Triton custom call in a StableHLO text."""
  from jax._src.interpreters import mlir as jm
  from jax._src.lib import triton as jt
  from jax._src.lib.mlir import ir

  found = []
  with jm.make_ir_context() as ctx:
    jt.dialect.register_dialect(ctx)

    def walk(op):
      for region in op.regions:
        for block in region.blocks:
          for o in block.operations:
            if o.operation.name == "stablehlo.custom_call":
              bc = o.operation.attributes["mhlo.backend_config"]
              found.append((ir.Module.parse(bc["ir"].value_bytes).operation.get_asm(
                  enable_debug_info=False), str(bc["name"]).strip('"'),
                  int(re.match(r"\d+", str(bc["num_warps"]))[0]),
                  int(re.match(r"\d+", str(bc["num_stages"]))[0])))
            walk(o.operation)
    walk(ir.Module.parse(text).operation)
  return found


FLASH_SPEC = re.compile(r"q(\d+)k(\d+)_w(\d+)s(\d+)_c(\d+)d(\d+)(_fused)?$")


def flash_spec_config(spec):
  """A backward ``BlockSizes`` from ``q<bwd_block_q>k<bwd_block_k>_w<warps>s<stages>_c<dkv_q_chunk>
  d<dq_k_chunk>[_fused]`` (forward fields: 64x64, the D256 default's) or a name of
  ``experiments.gpu_sweep.bwd_d256_configs()``."""
  from pallas_kernels.flash import triton as ft
  m = FLASH_SPEC.match(spec)
  if m is None:
    from experiments.gpu_sweep import bwd_d256_configs
    return bwd_d256_configs()[spec]
  bq, bk, w, s, cq, ck = (int(x) for x in m.groups()[:6])
  return ft.BlockSizes(64, 64, num_warps=8, num_stages=2, bwd_num_warps=w, bwd_num_stages=s,
                       dkv_q_chunk=cq, dq_k_chunk=ck, bwd_block_q=bq, bwd_block_k=bk,
                       fused_bwd=bool(m[7]))


def dump_flash(out_dir, specs, head_dim=256, seq=4096, causal=True):
  """Write the flash backward kernels' TTIR of each config spec (see the module docstring)."""
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import jax
  import jax.numpy as jnp

  from pallas_kernels.flash import triton as ft

  sd, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
  b, h = 1, 2
  x = sd((b, seq, h, head_dim), bf16)
  lse = sd((b, h, seq), jnp.float32)
  disabled = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  os.makedirs(out_dir, exist_ok=True)
  for spec in specs:
    cfg = flash_spec_config(spec)
    fn = lambda q, k, v, o, l, do, cfg=cfg: ft.flash_attention_bwd(
        q, k, v, o, l, do, jnp.zeros_like(l), causal=causal, scale=head_dim ** -0.5,
        block_sizes=cfg)
    text = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=disabled)(
        x, x, x, x, lse, x).mlir_module()
    for ttir, name, warps, stages in _triton_calls(text):
      kern = name.replace("jattn_flash_bwd_", "")
      base = os.path.join(out_dir, f"{spec}__{kern}")
      with open(base + ".ttir", "w") as f:
        f.write(ttir)
      with open(base + ".json", "w") as f:
        json.dump(dict(config=f"{spec}__{kern}", num_warps=warps, num_stages=stages), f)
      print(f"{spec}__{kern}: {len(ttir)} chars of TTIR, num_warps={warps}, "
            f"num_stages={stages}", flush=True)


def compile_dir(in_dir, arch):
  os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
  import triton
  from triton.backends.compiler import GPUTarget

  from triton._C.libtriton import ir as tir
  from triton.compiler.compiler import make_backend

  bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
  ptxas = sorted(glob.glob(os.path.join(bindir, "ptxas*")), reverse=True)
  target = GPUTarget("cuda", arch, 32)
  backend = make_backend(target)
  rows = []
  for path in sorted(glob.glob(os.path.join(in_dir, "*.ttir"))):
    if path.endswith(".opt.ttir"):
      continue
    meta = json.load(open(path[:-5] + ".json"))
    row = dict(config=meta["config"], num_warps=meta["num_warps"],
               num_stages=meta["num_stages"])
    try:
      # triton.compile of an IR file starts AFTER that file's stage, so a .ttir would skip the
      # TTIR passes (make_ttir: canonicalize, combine, cse, ...) that XLA's pipeline runs on the
      # Pallas TTIR. Without them `acc + dot(a, b)` stays a dot into a zero accumulator plus
      # an add (a second live fp32 accumulator: ~1 KB of spills in the flash dK/dV kernel at
      # D256 that the real compile does not have). Run them here, compile the result.
      ctx = tir.context()
      tir.load_dialects(ctx)
      backend.load_dialects(ctx)
      mod = tir.parse_mlir_module(path, ctx)
      mod.context = ctx
      opts = backend.parse_options(dict(num_warps=meta["num_warps"],
                                        num_stages=meta["num_stages"]))
      backend.make_ttir(mod, {}, opts, arch)
      opt_path = path[:-5] + ".opt.ttir"
      with open(opt_path, "w") as f:
        f.write(str(mod))
      k = triton.compile(opt_path, target=target,
                         options=dict(num_warps=meta["num_warps"],
                                      num_stages=meta["num_stages"]))
      row["shared_bytes"] = int(k.metadata.shared)
      ptx = path + ".ptx"
      with open(ptx, "w") as f:
        f.write(k.asm["ptx"])
      for exe in ptxas:                                  # the first that accepts this PTX
        res = subprocess.run([exe, "-v", f"-arch=sm_{arch}a", ptx, "-o", os.devnull],
                             capture_output=True, text=True)
        if res.returncode == 0:
          regs = re.search(r"Used (\d+) registers", res.stderr)
          spill = re.search(r"(\d+) bytes spill stores", res.stderr)
          row["registers"] = int(regs[1]) if regs else None
          row["spill_store_bytes"] = int(spill[1]) if spill else None
          break
    except Exception as e:  # noqa: BLE001
      row["error"] = f"{type(e).__name__}: {e}"[:300]
    rows.append(row)
    print(f"{row['config']:24s} warps {row['num_warps']} stages {row['num_stages']} "
          f"shared {row.get('shared_bytes', '?')} B registers {row.get('registers', '?')} "
          f"spills {row.get('spill_store_bytes', '?')} B {row.get('error', '')}", flush=True)
  with open(os.path.join(in_dir, "resources.json"), "w") as f:
    json.dump(dict(triton=triton.__version__, arch=arch, rows=rows), f, indent=1)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  sub = ap.add_subparsers(dest="cmd", required=True)
  d = sub.add_parser("dump", help="write <config>.ttir (needs jax; this repo's environment)")
  d.add_argument("--out", required=True)
  d.add_argument("--configs", default=None,
                 help="comma-separated probe sweep configs (default: the probe's grid at 33 "
                      "splits)")
  f = sub.add_parser("dump-flash", help="write <config>__<kernel>.ttir of the flash backward")
  f.add_argument("--out", required=True)
  f.add_argument("--configs", required=True,
                 help="comma-separated specs (q64k64_w8s2_c16d32[_fused]) or bwd_d256 names")
  f.add_argument("--head-dim", type=int, default=256)
  f.add_argument("--dense", action="store_true", help="non-causal (default: causal)")
  c = sub.add_parser("compile", help="compile a dump directory (needs the triton package)")
  c.add_argument("dir")
  c.add_argument("--arch", type=int, default=90)
  args = ap.parse_args(argv)
  if args.cmd == "dump":
    if args.configs:
      configs = [x for x in args.configs.split(",") if x.strip()]
    else:
      sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
      from experiments.probe_sparse_decode import ATTEND_GRID
      configs = [g.format(d=33, p=32, h=16, t=66) for g in ATTEND_GRID]
    dump(args.out, configs)
  elif args.cmd == "dump-flash":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    dump_flash(args.out, [x for x in args.configs.split(",") if x.strip()], args.head_dim,
               causal=not args.dense)
  else:
    compile_dir(args.dir, args.arch)
  return 0


if __name__ == "__main__":
  sys.exit(main())
