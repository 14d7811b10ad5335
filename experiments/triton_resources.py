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

``dump-fused-select`` does step 1 for the selection-inside-attention sparse decode
(``pallas_kernels.sparse.decode_fused_select.sparse_decode_select_attend``) at the same bench
shape, next to what the three-launch path runs: ``sparse_decode`` (the merged attention kernel,
default launch, 33 splits), ``select_d<bits>`` (``select_decode_slots``, digit_bits 1 / 2 /
4) and ``fused_d<bits>_<reduce|scratch>[_s<splits>][_c<search_chunk>][_rolled]`` (the fused
kernel: threshold search, lookup, split count, radix compare tile, ``search_loop="rolled"``).
``compile`` also reports, from the cubin's SASS (``cuobjdump -sass``): the instruction count,
the instructions and CTA barriers before the first ``LDGSTS`` (the first K/V copy: the
prologue every program runs before any attention traffic; a loop in it counts once), each
loop's body (``sass_loops``: first instruction, length, barriers, ``LDGSTS``), and from the
TTGIR whether the main loop is software-pipelined (``async_copy_global_to_local`` issued
before the loop and ``async_wait`` in it).

Usage:  python experiments/triton_resources.py dump --out /tmp/ttir [--configs s33,s33_nm,...]
        python experiments/triton_resources.py dump-flash --out /tmp/ttir_bwd --head-dim 256 \
            --configs q64k64_w8s2_c16d32,q128k64_w8s1_c64d32
        python experiments/triton_resources.py dump-fused-select --out /tmp/ttir_fs \
            [--configs sparse_decode,select_d2,fused_d2_reduce,fused_d2_scratch,...]
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


FUSED_SELECT_CONFIGS = ("sparse_decode", "select_d1", "select_d2", "select_d4",
                        "fused_d1_reduce", "fused_d2_reduce", "fused_d2_scratch",
                        "fused_d4_reduce", "fused_d4_scratch", "fused_d2_reduce_s16",
                        "fused_d1_reduce_rolled", "fused_d2_reduce_rolled",
                        "fused_d2_scratch_rolled", "fused_d4_reduce_rolled")
_FUSED_SPEC = re.compile(r"fused_d(\d)_(reduce|scratch)(?:_s(\d+))?(?:_c(\d+))?(_rolled)?$")


def dump_fused_select(out_dir, configs):
  """Write the TTIR of ``sparse_decode``, ``select_decode_slots`` and the fused selection +
  attention kernel at the issue-5 bench shape (B1 S128K GQA 32:8 D128 bf16, 64-token blocks,
  top_k 387: 389 of 2048 blocks, 33 splits unless ``_s<n>``), one ``<config>.ttir`` each."""
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import jax
  import jax.numpy as jnp

  from pallas_kernels.sparse import decode_fused_select as fs
  from pallas_kernels.sparse import decode_select as ds
  from pallas_kernels.sparse.decode import sparse_decode

  sd, bf16, i32, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32, jnp.float32
  n, bs, hq, hk, d, width, splits, top_k = 131072, 64, 32, 8, 128, 389, 33, 387
  nb = n // bs
  q, k = sd((1, hq, d), bf16), sd((1, n, hk, d), bf16)
  lens, scores, arr = sd((1,), i32), sd((1, hk, nb), f32), sd((1, hk), i32)
  idx, cnt = sd((1, hk, width), i32), sd((1, hk), i32)
  disabled = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  os.makedirs(out_dir, exist_ok=True)
  for name in configs:
    m = re.match(r"sparse_decode(?:_s(\d+))?$", name)
    if m:
      s = int(m[1] or splits)
      fn = lambda q, k, v, l, i, c, a, s=s: sparse_decode(q, k, v, l, i, None, c, a,
                                                          block_size=bs, num_splits=s)
      args = (q, k, k, lens, idx, cnt, arr)
    elif re.match(r"select_d\d$", name):
      fn = lambda s, l, db=int(name[-1]): ds.select_decode_slots(
          s, l, block_size=bs, top_k=top_k, num_init_blocks=1, num_local_blocks=1,
          max_selected=width, digit_bits=db)
      args = (scores, lens)
    else:
      m = _FUSED_SPEC.match(name)
      if m is None:
        raise ValueError(f"unknown config {name!r}")
      kw = dict(block_size=bs, top_k=top_k, num_splits=int(m[3] or splits),
                digit_bits=int(m[1]), lookup=m[2],
                search_chunk=int(m[4]) if m[4] else None)
      if m[5]:
        kw["search_loop"] = "rolled"
      fn = lambda q, k, v, l, s, a, kw=kw: fs.sparse_decode_select_attend(
          q, k, v, l, s, None, a, **kw)
      args = (q, k, k, lens, scores, arr)
    text = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=disabled)(
        *args).mlir_module()
    ttir, _, warps, stages = _triton_calls(text)[0]
    with open(os.path.join(out_dir, name + ".ttir"), "w") as f:
      f.write(ttir)
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
      json.dump(dict(config=name, num_warps=warps, num_stages=stages), f)
    print(f"{name}: {len(ttir)} chars of TTIR, num_warps={warps}, num_stages={stages}",
          flush=True)


def _sass_stats(cubin_path, bindir):
  """SASS instruction counts of a cubin: total, before the first LDGSTS (cp.async) and the CTA
  barriers among those; None where cuobjdump is missing."""
  exe = os.path.join(bindir, "cuobjdump")
  if not os.path.exists(exe):
    return {}
  sass = subprocess.run([exe, "-sass", cubin_path], capture_output=True, text=True).stdout
  ops, addrs, targets = [], [], []
  for line in sass.splitlines():
    m = re.match(r"\s+/\*([0-9a-f]{4,6})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)",
                 line)
    if m:
      addrs.append(int(m[1], 16))
      ops.append(m[2])
      t = re.search(r"0x([0-9a-f]+)", m[3]) if m[2].startswith("BRA") else None
      targets.append(int(t[1], 16) if t else None)
  first = next((i for i, o in enumerate(ops) if o.startswith("LDGSTS")), None)
  head = ops if first is None else ops[:first]
  count = lambda xs, p: sum(o.startswith(p) for o in xs)
  loops = []                                             # backward branches: loop bodies
  where = {a: i for i, a in enumerate(addrs)}
  for i, t in enumerate(targets):
    if t is not None and t < addrs[i] and t in where:
      body = ops[where[t]:i + 1]
      loops.append(dict(start=where[t], length=len(body), bar=count(body, "BAR"),
                        ldgsts=count(body, "LDGSTS")))
  return dict(sass_instructions=len(ops),
              sass_before_first_ldgsts=None if first is None else first,
              bar_before_first_ldgsts=None if first is None else count(head, "BAR"),
              bar_total=count(ops, "BAR"), sass_loops=loops)


def _pipeline_stats(ttgir):
  """Whether the TTGIR's main loop is software-pipelined: async copies before the first
  scf.for and in it, and the async_wait depth in it."""
  loop = ttgir.find("scf.for")
  if loop < 0:
    return dict(loop=False)
  body = ttgir[loop:]
  end = body.find("scf.yield")
  body = body[:end] if end > 0 else body
  wait = re.search(r"ttg\.async_wait[^\n]*\{num = (\d+)", body)
  return dict(loop=True,
              async_copies_before_loop=ttgir[:loop].count("ttg.async_copy_global_to_local"),
              async_copies_in_loop=body.count("ttg.async_copy_global_to_local"),
              async_wait_num_in_loop=int(wait[1]) if wait else None)


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
      row.update(_pipeline_stats(k.asm["ttgir"]))
      with open(path[:-5] + ".ttgir", "w") as f:
        f.write(k.asm["ttgir"])
      cubin = path[:-5] + ".cubin"
      with open(cubin, "wb") as f:
        f.write(k.asm["cubin"])
      row.update(_sass_stats(cubin, bindir))
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
          f"spills {row.get('spill_store_bytes', '?')} B "
          f"prologue {row.get('sass_before_first_ldgsts', '?')} SASS / "
          f"{row.get('bar_before_first_ldgsts', '?')} BAR {row.get('error', '')}", flush=True)
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
  fsp = sub.add_parser("dump-fused-select",
                       help="write the fused selection + attention kernel's TTIR and its "
                            "three-launch counterparts'")
  fsp.add_argument("--out", required=True)
  fsp.add_argument("--configs", default=",".join(FUSED_SELECT_CONFIGS),
                   help="comma-separated: sparse_decode[_s<n>], select_d<bits>, "
                        "fused_d<bits>_<reduce|scratch>[_s<n>][_c<chunk>][_rolled]")
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
  elif args.cmd == "dump-fused-select":
    dump_fused_select(args.out, [x for x in args.configs.split(",") if x.strip()])
  elif args.cmd == "dump-flash":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    dump_flash(args.out, [x for x in args.configs.split(",") if x.strip()], args.head_dim,
               causal=not args.dense)
  else:
    compile_dir(args.dir, args.arch)
  return 0


if __name__ == "__main__":
  sys.exit(main())
