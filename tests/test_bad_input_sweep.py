"""A generated sweep of bad input over the public API: every argument of every entry point under
each mutation class (rank, dtype, zero-size axes, mismatched sizes, bad scalars, wrong Python
types, out-of-range values, huge sizes as ``jax.ShapeDtypeStruct``), on every implementation
that an entry point takes ("xla", and "triton" / "mosaic_tpu" in interpret mode).

Each input's outcome is one of
  named     ValueError / TypeError whose message names the mutated argument (good);
  accepted  the call returned (good only for inputs that are valid: huge sizes, lists);
  silent    an invalid input was accepted (bad);
  unnamed   ValueError / TypeError not naming the argument (bad);
  other     any other exception (bad).
Static checks run under ``jax.eval_shape`` (nothing is allocated); value checks (lengths, page
ids) run eagerly on small arrays and raise before any kernel runs. A second part runs valid edge
inputs (odd lengths, GQA / MQA, q shorter / longer than kv, lengths 0 and full, NaN / inf at
masked positions and in unused pages) against an fp32 numpy reference.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import sparse as sp

SDS = jax.ShapeDtypeStruct
F32 = jnp.float32
IMPLS = ("xla", "triton", "mosaic_tpu")
NAN, INF = float("nan"), float("inf")


def sds(*shape, dtype=F32):
  return SDS(shape, dtype)


# ----------------------------------------------------------------------------- entry points
@dataclasses.dataclass
class Spec:
  """One public entry point: a valid call and what each argument is.

  args: a valid call's arguments by name (``SDS`` values are traced under ``jax.eval_shape``,
    everything else is passed as is, so concrete arrays keep their value checks).
  arrays: name -> axis letters; a lowercase axis must agree with another argument (one more
    along it alone is invalid), an uppercase one is free.
  scalars: name -> scalar class (``SCALAR_BAD``).
  optional: arguments left out of ``args`` that take an array: swept with this valid value.
  impl: whether the entry point takes ``implementation=`` (swept over ``IMPLS``).
  direct: call without ``jax.eval_shape`` (the result is not an array pytree).
  huge: valid calls with huge sizes, as overrides of ``args`` (``SDS`` only).
  zero_ok: arrays for which a zero-size axis is valid.
  any_array: arrays of any rank and dtype (only Python types and lowercase axes are swept).
  valid: (argument, mutation) pairs the entry point documents as valid input.
  """
  fn: object
  args: dict
  arrays: dict
  scalars: dict = dataclasses.field(default_factory=dict)
  optional: dict = dataclasses.field(default_factory=dict)
  impl: bool = False
  direct: bool = False
  huge: tuple = ()
  zero_ok: tuple = ()
  any_array: tuple = ()
  valid: tuple = ()


def _specs():
  q, k = sds(2, 32, 4, 16), sds(2, 32, 2, 16)
  dq, dk = sds(2, 4, 16), sds(2, 32, 2, 16)
  pages = sds(6, 16, 2, 16)
  lens = np.array([20, 32], np.int32)
  table = np.array([[0, 1], [2, 3]], np.int32)
  seg = np.ones((2, 32), np.int32)
  qkv = {"q": "bShd", "k": "bshd", "v": "bshD"}
  flash_scalars = {"causal": "bool", "local_window_size": "window", "scale": "scale",
                   "logits_soft_cap": "cap", "return_lse": "bool", "interpret": "bool"}
  flash_opt = {"segment_ids": seg, "mask": np.ones((2, 1, 32, 32), bool),
               "bias": sds(2, 4, 32, 32)}
  huge_qkv = ({"q": sds(2, 2**17, 4, 16), "k": sds(2, 2**17, 2, 16), "v": sds(2, 2**17, 2, 16)},
              {"q": sds(2**16, 32, 4, 16), "k": sds(2**16, 32, 2, 16), "v": sds(2**16, 32, 2, 16)})
  dec = {"q": dq, "k_cache": dk, "v_cache": dk, "kv_lengths": lens}
  dec_axes = {"q": "bhd", "k_cache": "bshd", "v_cache": "bshD", "kv_lengths": "b"}
  paged = {"q": dq, "k_pages": pages, "v_pages": pages, "page_table": table, "kv_lengths": lens}
  paged_axes = {"q": "bhd", "k_pages": "Pshd", "v_pages": "PshD", "page_table": "bM",
                "kv_lengths": "b"}
  dec_scalars = {"scale": "scale", "local_window_size": "window", "logits_soft_cap": "cap",
                 "num_splits": "optposint", "return_lse": "bool", "interpret": "bool",
                 "kv_layout": "layout", "softmax": "softmax"}
  sq, sk = sds(1, 256, 4, 16), sds(1, 256, 2, 16)   # Mosaic TPU: tiles of 128
  sseg = {"segment_ids": np.ones((1, 256), np.int32)}
  # concrete summaries and a selection, each from one jitted program (collection-time cost)
  summ = jax.jit(functools.partial(sp.init_block_summaries, block_size=16))(
      jnp.zeros((2, 32, 2, 16)), lens)
  psumm = jax.jit(functools.partial(sp.init_block_summaries, block_size=16))(
      jnp.zeros((6, 16, 2, 16)), lens, page_table=table)
  sel = jax.jit(functools.partial(sp.select_blocks, block_size=128, q_block_size=128, top_k=1))(
      jnp.zeros((1, 256, 4, 16)), jnp.zeros((1, 256, 2, 16)))
  sparse_scalars = {"block_size": "posint", "top_k": "limit", "q_block_size": "posint",
                    "gate_grad": "enum", "gate_temperature": "cap", "causal": "bool",
                    "num_init_blocks": "nonneg", "num_local_blocks": "nonneg", "scale": "scale",
                    "interpret": "bool", "return_selection": "bool",
                    "score_aux_weight": "finite", "score_aux_pool": "enum"}
  sdec_scalars = {"top_k": "limit", "num_init_blocks": "nonneg", "num_local_blocks": "nonneg",
                  "scale": "scale", "return_lse": "bool", "return_indices": "bool",
                  "interpret": "bool", "num_splits": "optposint", "softmax": "softmax"}
  new_kv = {"k_new": sds(2, 2, 16), "v_new": sds(2, 2, 16)}
  cp_scalars = {"num_shards": "posint", "layout": "cplayout", "axis": "axis"}
  return {
    "flash_attention": Spec(jattn.flash_attention, {"q": q, "k": k, "v": k}, qkv, flash_scalars,
                            flash_opt, impl=True, huge=huge_qkv),
    "flash_attention_plan": Spec(jattn.flash_attention_plan, {"q": q, "k": k, "v": k}, qkv,
                                 {**flash_scalars, "platform": "enum"}, flash_opt, impl=True,
                                 direct=True, huge=huge_qkv),
    "dot_product_attention": Spec(
        jattn.dot_product_attention, {"query": q, "key": k, "value": k},
        {"query": "bShd", "key": "bshd", "value": "bshD"},
        {"scale": "scale", "is_causal": "bool", "local_window_size": "window",
         "interpret": "bool"},
        {"query_seq_lengths": np.array([3, 32], np.int32),
         "key_value_seq_lengths": np.array([5, 32], np.int32),
         "mask": np.ones((2, 1, 32, 32), bool), "bias": sds(2, 4, 32, 32)}, impl=True,
        huge=({"query": sds(2, 2**17, 4, 16), "key": sds(2, 2**17, 2, 16),
               "value": sds(2, 2**17, 2, 16)},)),
    "decode_attention": Spec(
        jattn.decode_attention, dec, dec_axes, dec_scalars, impl=True,
        huge=({"k_cache": sds(2, 2**22, 2, 16), "v_cache": sds(2, 2**22, 2, 16),
               "kv_lengths": np.array([2**22, 7], np.int32)},)),
    "paged_decode_attention": Spec(
        jattn.paged_decode_attention, paged, paged_axes, dec_scalars, impl=True,
        huge=({"k_pages": sds(2**20, 16, 2, 16), "v_pages": sds(2**20, 16, 2, 16),
               "page_table": np.array([[2**20 - 1, 0], [5, 9]], np.int32)},)),
    "decode_plan": Spec(jattn.decode_plan, dec, dec_axes, dec_scalars, impl=True, direct=True),
    "decode_schedule": Spec(jattn.decode_schedule, dec, dec_axes,
                            {"local_window_size": "window", "kv_layout": "layout",
                             "max_units": "optposint"}, direct=True),
    "sparse_attention": Spec(
        jattn.sparse_attention,
        {"q": sq, "k": sk, "v": sk, "block_size": 128, "top_k": 1, "q_block_size": 128},
        qkv, sparse_scalars, sseg, impl=True),
    "block_sparse_attention": Spec(
        jattn.block_sparse_attention, {"q": sq, "k": sk, "v": sk, "selection": sel}, qkv,
        {"selection": "object", "causal": "bool", "scale": "scale", "return_lse": "bool",
         "interpret": "bool"}, sseg, impl=True),
    "select_blocks": Spec(
        sp.select_blocks, {"q": sq, "k": sk, "block_size": 128, "top_k": 1, "q_block_size": 128},
        {"q": "bShd", "k": "bShd"},
        {"block_size": "posint", "top_k": "limit", "q_block_size": "posint", "causal": "bool",
         "num_init_blocks": "nonneg", "num_local_blocks": "nonneg", "score": "enum"}, sseg),
    "sparse_decode_attention": Spec(
        jattn.sparse_decode_attention,
        {**dec, "block_summaries": summ, "block_size": 16, "top_k": 1}, dec_axes,
        {**sdec_scalars, "block_size": "posint", "block_summaries": "object"}, impl=True),
    "sparse_paged_decode_attention": Spec(
        jattn.sparse_paged_decode_attention, {**paged, "block_summaries": psumm, "top_k": 1},
        paged_axes, {**sdec_scalars, "block_summaries": "object"}, impl=True),
    "init_block_summaries": Spec(sp.init_block_summaries,
                                 {"k_cache": dk, "kv_lengths": lens, "block_size": 16},
                                 {"k_cache": "bSHD", "kv_lengths": "b"},
                                 {"block_size": "posint", "kv_layout": "layout"}),
    "update_block_summaries": Spec(sp.update_block_summaries,
                                   {"summaries": summ, "k_cache": dk, "kv_lengths": lens},
                                   {"k_cache": "bShd", "kv_lengths": "b"},
                                   {"summaries": "object"}),
    "append_kv": Spec(jattn.append_kv, {"k_cache": dk, "v_cache": dk, "kv_lengths": lens, **new_kv},
                      {"k_cache": "bshd", "v_cache": "bshd", "kv_lengths": "b", "k_new": "bhd",
                       "v_new": "bhd"}),
    "append_kv_paged": Spec(jattn.append_kv_paged,
                            {"k_pages": pages, "v_pages": pages, "page_table": table,
                             "kv_lengths": lens, **new_kv},
                            {"k_pages": "Pshd", "v_pages": "Pshd", "page_table": "bM",
                             "kv_lengths": "b", "k_new": "bhd", "v_new": "bhd"}),
    "merge_partials": Spec(jattn.merge_partials,
                           {"outs": sds(3, 2, 8, 4, 16), "lses": sds(3, 2, 8, 4)},
                           {"outs": "nbshD", "lses": "nbsh"}, {"axis": "axis"}),
    "segments_from_lengths": Spec(jattn.segments_from_lengths,
                                  {"doc_lengths": np.array([[3, 2], [4, 0]], np.int32),
                                   "max_len": 8},
                                  {"doc_lengths": "BD"}, {"max_len": "posint"},
                                  zero_ok=("doc_lengths",)),
    "pack_bfd": Spec(jattn.pack_bfd, {"lengths": np.array([3, 5, 2], np.int64), "max_len": 8},
                     {"lengths": "N"}, {"max_len": "posint", "split_long": "bool"}, direct=True,
                     zero_ok=("lengths",)),
    "context_parallel_permute": Spec(jattn.context_parallel_permute,
                                     {"x": sds(2, 32, 4, 16), "num_shards": 4}, {"x": "BSHD"},
                                     cp_scalars, any_array=("x",)),
    "context_parallel_unpermute": Spec(jattn.context_parallel_unpermute,
                                       {"x": sds(2, 32, 4, 16), "num_shards": 4}, {"x": "BSHD"},
                                       cp_scalars, any_array=("x",)),
    "context_parallel_plan": Spec(jattn.context_parallel_plan,
                                  {"q_len": 64, "kv_len": 64, "num_shards": 4}, {},
                                  {"q_len": "posint", "kv_len": "posint", "num_shards": "posint",
                                   "causal": "bool", "local_window_size": "window",
                                   "strategy": "enum", "layout": "cplayout"}, direct=True),
    "make_schedule": Spec(jattn.make_schedule,
                          {"q_len": 64, "kv_len": 64, "block_q": 16, "block_k": 16}, {},
                          {"q_len": "posint", "kv_len": "posint", "block_q": "posint",
                           "block_k": "posint", "causal": "bool", "local_window_size": "window"},
                          direct=True),
  }


def _nn_specs():
  from jattn import nn
  q, k = sds(2, 32, 4, 16), sds(2, 32, 2, 16)
  return {
    "nn.dot_product_attention": Spec(nn.dot_product_attention, {"query": q, "key": k, "value": k},
                                     {"query": "bShd", "key": "bshd", "value": "bshD"},
                                     {"is_causal": "bool", "dropout_rate": "rate",
                                      "interpret": "bool"},
                                     {"mask": np.ones((2, 1, 32, 32), bool)}, impl=True,
                                     valid=(("mask", "dtype float32"),)),   # read as bool
    "nn.apply_rope": Spec(nn.apply_rope, {"x": sds(2, 32, 4, 16),
                                          "positions": np.zeros((2, 32), np.int32)},
                          {"x": "bsHD", "positions": "bs"}, {"base": "posfloat"},
                          valid=(("base", "None"),)),   # NoPE: x unchanged
    "nn.rope_frequencies": Spec(nn.rope_frequencies, {"rotary_dim": 16}, {},
                                {"rotary_dim": "posint", "base": "posfloat"}),
    "nn.LayerSpec": Spec(nn.LayerSpec, {"kind": "local", "window": 8}, {},
                         {"kind": "enum", "window": "posint", "rope_base": "posfloat",
                          "block_size": "posint", "q_block_size": "posint",
                          "compress_ratio": "posint"}, direct=True,
                         valid=(("rope_base", "None"),)),   # NoPE
    "nn.TransformerConfig": Spec(nn.TransformerConfig,
                                 {"vocab_size": 37, "num_layers": 2, "d_model": 32,
                                  "num_heads": 4, "num_kv_heads": 2, "head_dim": 8}, {},
                                 {"vocab_size": "posint", "num_layers": "posint",
                                  "d_model": "posint", "num_heads": "posint",
                                  "num_kv_heads": "posint", "head_dim": "posint",
                                  "norm_eps": "posfloat", "kv_cache_layout": "layout"},
                                 direct=True),
    "nn.local_global_schedule": Spec(nn.local_global_schedule, {"num_layers": 6}, {},
                                     {"num_layers": "posint", "local_per_global": "nonneg",
                                      "window": "posint"}, direct=True),
  }


# ----------------------------------------------------------------------------- mutations
# scalar class -> (invalid values, values that may be accepted or refused by name)
SCALAR_BAD = {
  "bool": (("yes", None, [True], 1.0), ()),
  "scale": ((NAN, INF, -INF, "0.1", [0.5], complex(1, 1)), ()),
  "cap": ((NAN, INF, 0.0, -1.0, "30", [30.0]), ()),
  "finite": ((NAN, INF, "0.1", [0.5]), ()),
  "rate": ((NAN, -0.5, 1.5, "0.1"), ()),
  "posfloat": ((NAN, INF, 0.0, -1.0, "1e4", None), ()),
  "posint": ((0, -1, 1.5, NAN, "4", None, True), ()),
  "limit": ((0, -1, 1.5, NAN, "4", None, True), (2**31,)),
  "nonneg": ((-1, 1.5, NAN, "1", None), ()),
  "optposint": ((0, -1, 1.5, NAN, "4", True), (2**31,)),
  "axis": ((7, -7, 1.5, "1", None), ()),
  "window": ((-1, (-1, 0), (0, -2), (1, 2, 3), 1.5, "5", NAN, (NAN, 0)), ()),
  "layout": (("bhsd", None, 3), ()),
  "cplayout": (("bogus", None, 3), ()),
  "softmax": (("bogus", None, 3), ()),
  "enum": (("bogus", 3, [1]), ()),
  "object": (("bogus", None, 3, [1]), ()),
}
ARRAY_DTYPES = {"float": (jnp.int32, jnp.bool_, jnp.complex64),
                "int": (jnp.float32, jnp.bool_, jnp.complex64, np.float64),
                "bool": (jnp.float32, jnp.complex64)}


@dataclasses.dataclass(frozen=True)
class Case:
  entry: str
  impl: str | None
  arg: str
  mutation: str
  kwargs: dict = dataclasses.field(compare=False, hash=False)
  invalid: bool = True        # False: accepted, or refused naming ``arg``
  names: tuple = ()           # other arguments an error may name instead (a size mismatch)
  eager: bool = False         # concrete values: run eagerly (jit would trace them)

  @property
  def id(self):
    return f"{self.entry}[{self.impl or '-'}] {self.arg}: {self.mutation}"


def _like(x, shape=None, dtype=None):
  """x (an SDS or a concrete array) with another shape or dtype, of the same kind."""
  shape = tuple(x.shape) if shape is None else tuple(shape)
  dtype = x.dtype if dtype is None else dtype
  if isinstance(x, SDS):
    return SDS(shape, dtype)
  return np.zeros(shape, np.dtype(dtype))   # zeros: valid lengths, page ids and masks


def _array_mutations(name, x, axes, zero_ok, any_array=(), optional=False):
  if name in any_array:
    for i, a in enumerate(axes):
      if a.islower():
        shape = list(x.shape)
        yield f"axis {i} ({a}) + 1", _like(x, shape[:i] + [shape[i] + 1] + shape[i + 1:]), True
    yield "str", "bogus", True
    yield "None", None, True
    return
  kind = ("float" if jnp.issubdtype(x.dtype, jnp.floating) else
          "bool" if x.dtype == jnp.bool_ else "int")
  yield "rank-1", _like(x, x.shape[1:]), not optional   # a mask / bias may broadcast
  yield "rank+1", _like(x, (1,) + tuple(x.shape)), True
  for dt in ARRAY_DTYPES[kind]:
    yield f"dtype {np.dtype(dt).name}", _like(x, dtype=dt), True
  for i, a in enumerate(axes):
    shape = list(x.shape)
    if name not in zero_ok:
      yield f"zero-size axis {i}", _like(x, shape[:i] + [0] + shape[i + 1:]), True
    if a.islower():
      yield f"axis {i} ({a}) + 1", _like(x, shape[:i] + [shape[i] + 1] + shape[i + 1:]), True
  yield "str", "bogus", True
  yield "None", None, True
  yield "nested list", np.zeros(x.shape, np.dtype(x.dtype)).tolist() if math.prod(
      x.shape) < 10_000 else None, False


def _value_mutations(entry, args):
  """Out-of-range concrete values of the index arrays (eager checks)."""
  if "kv_lengths" in args:
    cap = 32
    yield "kv_lengths", "negative", np.array([-1, 3], np.int32)
    yield "kv_lengths", "past capacity", np.array([3, cap + 1], np.int32)
    yield "kv_lengths", "int64 past int32", np.array([2**40, 3], np.int64)
  if "page_table" in args:
    yield "page_table", "page id -1 in use", np.array([[0, -1], [2, 3]], np.int32)
    yield "page_table", "page id past the pool", np.array([[0, 6], [2, 3]], np.int32)
    yield "page_table", "int64 page id past int32", np.array([[0, 1], [2, 2**40]], np.int64)
  if "doc_lengths" in args:
    yield "doc_lengths", "negative", np.array([[3, -2], [4, 0]], np.int32)
    yield "doc_lengths", "int64 past int32", np.array([[3, 2**40], [4, 0]], np.int64)
  if "lengths" in args:
    yield "lengths", "negative", np.array([3, -5, 2], np.int64)


def _all_specs():
  """Every entry point's ``Spec``, built once per process (``SPECS``)."""
  if not SPECS:
    SPECS.update(_specs(), **_nn_specs())
  return SPECS


def _cases():
  specs = _all_specs()
  out = []
  for entry, spec in specs.items():
    impls = IMPLS if spec.impl else (None,)
    for impl in impls:
      base = dict(spec.args)
      if impl is not None:
        base.update(implementation=impl, interpret=impl != "xla")
      def add(arg, mut, kw, invalid=True, eager=False, entry=entry, impl=impl, spec=spec):
        invalid = invalid and (arg, mut) not in spec.valid
        letter = re.fullmatch(r"axis \d+ \((\w)\) \+ 1", mut)
        names = tuple(n for n, axes in spec.arrays.items()
                      if letter and n != arg and letter[1] in axes)
        out.append(Case(entry, impl, arg, mut, kw, invalid, names, eager))
      add("-", "valid call", base, False)
      for name, axes in spec.arrays.items():
        for mut, val, invalid in _array_mutations(name, spec.args[name], axes, spec.zero_ok,
                                                  spec.any_array):
          if val is not None or mut == "None":
            add(name, mut, dict(base, **{name: val}), invalid)
      for name, val in spec.optional.items():
        add(name, "valid", dict(base, **{name: val}), False)
        axes = "".join("b" if i == 0 else "S" for i in range(np.ndim(val)))
        for mut, bad, invalid in _array_mutations(name, val, axes, (), optional=True):
          if mut != "None" and bad is not None:
            add(name, mut, dict(base, **{name: bad}), invalid)
      for name, cls in spec.scalars.items():
        bad, maybe = SCALAR_BAD[cls]
        for val in bad:
          add(name, repr(val), dict(base, **{name: val}))
        for val in maybe:
          add(name, repr(val), dict(base, **{name: val}), False)
      for arg, mut, val in _value_mutations(entry, spec.args):
        add(arg, mut, dict(base, **{arg: val}), eager=True)
      for i, over in enumerate(spec.huge):
        add(",".join(over), f"huge sizes {i}", dict(base, **over), False)
      if impl in (None, "xla") and spec.impl:
        for val in ("bogus", 3):
          add("implementation", repr(val), dict(base, implementation=val))
  return out


def _call(spec, kw, eager=False):
  if eager:   # small zeros for the shapes; the concrete values under test stay
    return spec.fn(**{n: jnp.zeros(v.shape, v.dtype) if isinstance(v, SDS) else v
                      for n, v in kw.items()})
  traced = {n: v for n, v in kw.items() if isinstance(v, SDS)}
  static = {n: v for n, v in kw.items() if n not in traced}
  if spec.direct:
    return spec.fn(**kw)
  return jax.eval_shape(lambda t: spec.fn(**static, **t), traced)


def _names(msg, name):
  """Whether ``msg`` names the argument ``name`` (as a word; ``q_heads`` names q)."""
  return any(re.search(rf"(?<![A-Za-z0-9]){re.escape(n)}(?![A-Za-z0-9])", msg)
             for n in name.split(","))


def outcome(spec, case):
  try:
    _call(spec, case.kwargs, case.eager)
  except (ValueError, TypeError) as e:
    named = any(_names(str(e), n) for n in (case.arg,) + case.names) and case.arg != "-"
    return ("named" if named else "unnamed"), e
  except Exception as e:  # noqa: BLE001 - any other exception is a finding
    return "other", e
  return ("silent" if case.invalid else "accepted"), None


SPECS = {}
CASES = _cases()


def _spec(entry):
  return _all_specs()[entry]


def test_sweep_covers_every_implementation():
  """>= 350 generated inputs on each of xla, triton and mosaic_tpu."""
  count = collections.Counter((c.entry, c.impl) for c in CASES)
  print("\n".join(f"{e:32s} {i or '-':10s} {n}" for (e, i), n in sorted(count.items(), key=str)))
  per_impl = collections.Counter()
  for (_, impl), n in count.items():
    per_impl[impl] += n
  print(dict(per_impl), "total", sum(count.values()))
  assert sum(count.values()) >= 350
  assert all(per_impl[i] >= 350 for i in IMPLS), per_impl


@pytest.mark.parametrize("entry", sorted({c.entry for c in CASES}))
def test_bad_input_sweep(entry):
  """Every generated input of ``entry``: refused naming the argument, or (valid inputs only)
  accepted; never silent, unnamed or another exception."""
  tally, bad = collections.Counter(), []
  for case in (c for c in CASES if c.entry == entry):
    result, err = outcome(_spec(entry), case)
    tally[case.impl or "-", result] += 1
    if result in ("named", "accepted"):
      continue
    line = f"{case.id} -> {result}" + (f" ({type(err).__name__}: {str(err)[:150]})" if err else "")
    bad.append(line)
  print(entry, dict(sorted(tally.items())))
  assert not bad, f"{len(bad)} bad outcomes:\n" + "\n".join(bad)


# ----------------------------------------------------------------------------- valid edge inputs
def _reference(q, k, v, vis, scale=None):
  """fp64 numpy attention: q [B, Sq, Hq, D], k/v [B, Sk, Hk, D] (clean), vis bool [B, Sq, Sk];
  a row that sees no key gives 0."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  g = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, g, 2), np.repeat(v, g, 2)
  s = np.einsum("bqhd,bkhd->bhqk", q, k) * (scale or q.shape[-1] ** -0.5)
  s = np.where(vis[:, None], s, -np.inf)
  top = np.max(s, -1, keepdims=True)
  p = np.exp(s - np.where(np.isfinite(top), top, 0))
  p /= np.maximum(p.sum(-1, keepdims=True), 1e-300)
  return np.einsum("bhqk,bkhd->bqhd", p, v)


def _visibility(sq, sk, causal=False, window=None, seg_q=None, seg_k=None, batch=2):
  """bool [B, Sq, Sk]: bottom-right aligned causal / window, segment ids (0: padding)."""
  qpos, kpos = np.arange(sq)[:, None] + sk - sq, np.arange(sk)[None]
  vis = np.ones((sq, sk), bool)
  if causal:
    vis &= kpos <= qpos
  if window is not None:
    vis &= (kpos >= qpos - window[0]) & (kpos <= qpos + window[1])
  vis = np.broadcast_to(vis, (batch, sq, sk))
  if seg_q is not None:
    vis = vis & (seg_q[:, :, None] == seg_k[:, None, :]) & (seg_k[:, None, :] != 0)
  return vis


def _segments(b, n, rng):
  """[b, n] int32 documents 1, 2, .. with trailing padding (0) of a few tokens."""
  cuts = np.sort(rng.choice(np.arange(1, n - 3), 2, replace=False))
  seg = np.searchsorted(cuts, np.arange(n), side="right").astype(np.int32) + 1
  seg = np.broadcast_to(seg, (b, n)).copy()
  seg[:, n - 3:] = 0
  return seg


def _poisoned(x, hidden, value):
  """x [B, S, H, D] with ``value`` at positions hidden [B, S]."""
  return jnp.where(jnp.asarray(hidden)[:, :, None, None], value, x)


def _flash_edges():
  rng = np.random.default_rng(0)
  shapes = ((37, 53), (53, 37), (1, 33), (40, 40))
  heads = ((4, 4), (4, 2), (4, 1))
  masks = ("none", "causal", "window", "segments")
  for i, ((sq, sk), mask) in enumerate((s, m) for s in shapes for m in masks):
    hq, hk = heads[i % 3]
    kw, seg_q, seg_k = {}, None, None
    if mask == "causal":
      kw["causal"] = True
    elif mask == "window":
      kw["local_window_size"] = (5, 3)
    elif mask == "segments":
      if sq < 4 or sk < 4:
        continue
      seg_q, seg_k = _segments(2, sq, rng), _segments(2, sk, rng)
      kw.update(segment_ids=jnp.asarray(seg_q), kv_segment_ids=jnp.asarray(seg_k))
    vis = _visibility(sq, sk, kw.get("causal", False), kw.get("local_window_size"), seg_q, seg_k)
    yield f"flash {sq}x{sk} {hq}/{hk} {mask}", (sq, sk, hq, hk, kw, vis)


def _run_flash(impl, sq, sk, hq, hk, kw, vis, seed=0):
  rng = np.random.default_rng(seed)
  q, k, v = (rng.standard_normal(s).astype(np.float32)
             for s in ((2, sq, hq, 16), (2, sk, hk, 16), (2, sk, hk, 16)))
  hidden = ~vis.any(1)                                            # keys no query row sees
  extra = {} if impl == "xla" else {"interpret": True}
  if impl == "triton":
    from pallas_kernels.flash import triton
    extra["block_sizes"] = triton.BlockSizes(16, 16, dkv_q_chunk=16, dq_k_chunk=16)
  f = jax.jit(lambda q, k, v: jattn.flash_attention(q, k, v, implementation=impl, **kw, **extra))
  outs = [f(q, _poisoned(k, hidden, p), _poisoned(v, hidden, -p)) for p in (NAN, INF)]
  return outs, _reference(q, k, v, vis)


def _decode_edges():
  for i, (hq, hk) in enumerate(((4, 4), (4, 2), (4, 1))):
    for window in (None, (5, 0)):
      yield f"decode {hq}/{hk} window={window}", ("contiguous", hq, hk, window)
    yield f"paged decode {hq}/{hk}", ("paged", hq, hk, None)


def _run_decode(impl, layout, hq, hk, window, seed=1):
  """Lengths 0, odd and full; NaN / inf past each length, in unused pages and unused table
  entries of -1."""
  rng = np.random.default_rng(seed)
  b, n, d, ps = 3, 32, 16, 16
  lens = np.array([0, 17, n], np.int32)
  q = rng.standard_normal((b, hq, d)).astype(np.float32)
  k, v = (rng.standard_normal((b, n, hk, d)).astype(np.float32) for _ in range(2))
  hidden = np.arange(n)[None] >= lens[:, None]
  vis = ~hidden[:, None]
  if window is not None:
    vis = vis & (np.arange(n)[None, None] >= lens[:, None, None] - 1 - window[0])
  extra = {} if impl == "xla" else {"interpret": True}
  outs = []
  f = jax.jit(lambda q, k, v: jattn.decode_attention(q, k, v, lens, local_window_size=window,
                                                     implementation=impl, **extra))
  g = jax.jit(lambda q, k, v, t: jattn.paged_decode_attention(q, k, v, t, lens,
                                                              implementation=impl, **extra))
  for p in (NAN, INF):
    kk, vv = _poisoned(k, hidden, p), _poisoned(v, hidden, -p)
    if layout == "contiguous":
      outs.append(f(q, kk, vv))
      continue
    # pages 0..5 hold the sequences, 6 and 7 are unused (poisoned); -1 marks unused entries
    table = np.array([[-1, -1], [0, 1], [2, 3]], np.int32)
    pool_k = jnp.concatenate([kk.reshape(b * 2, ps, hk, d)[2:], jnp.full((4, ps, hk, d), p)])
    pool_v = jnp.concatenate([vv.reshape(b * 2, ps, hk, d)[2:], jnp.full((4, ps, hk, d), -p)])
    table[1, 1] = 1
    outs.append(g(q, pool_k, pool_v, table))
  return [o[:, None] for o in outs], _reference(q[:, None], k, v, vis)


def _dpa_edges():
  for causal in (False, True):
    for hq, hk in ((4, 2), (4, 1)):
      yield f"dot_product_attention {hq}/{hk} causal={causal}", (hq, hk, causal)


def _run_dpa(impl, hq, hk, causal, seed=2):
  """jax.nn's key_value_seq_lengths (0, odd, full) with NaN / inf past each length."""
  rng = np.random.default_rng(seed)
  b, s, d = 3, 24, 16
  lens = np.array([0, 11, s], np.int32)
  q, k, v = (rng.standard_normal(x).astype(np.float32)
             for x in ((b, s, hq, d), (b, s, hk, d), (b, s, hk, d)))
  hidden = np.arange(s)[None] >= lens[:, None]
  vis = _visibility(s, s, causal, batch=b) & ~hidden[:, None]
  extra = {} if impl == "xla" else {"interpret": True}
  f = jax.jit(lambda q, k, v: jattn.dot_product_attention(
      q, k, v, is_causal=causal, key_value_seq_lengths=lens, implementation=impl, **extra))
  outs = [f(q, _poisoned(k, hidden, p), _poisoned(v, hidden, -p)) for p in (NAN, INF)]
  return outs, _reference(q, k, v, vis)


EDGES = ([(n, "flash", a) for n, a in _flash_edges()] + [(n, "decode", a) for n, a in
                                                          _decode_edges()]
         + [(n, "dpa", a) for n, a in _dpa_edges()])
RUN = {"flash": _run_flash, "decode": _run_decode, "dpa": _run_dpa}
# The interpret-mode kernels on a sample (each case compiles a kernel): Triton's 16-tiles take
# odd sizes; Mosaic TPU's decode kernels run small caches (its flash kernels: 128-tiles, covered
# by test_masked_poison.py).
SAMPLE = {"xla": None, "triton": ("flash 37x53 4/2 causal", "flash 53x37 4/2 segments",
                                  "decode 4/2 window=None", "paged decode 4/1"),
          "mosaic_tpu": ("decode 4/1 window=(5, 0)", "paged decode 4/2")}


@pytest.mark.parametrize("impl", IMPLS)
def test_valid_edge_inputs_match_reference(impl):
  """Odd lengths, q shorter / longer than kv, GQA / MQA, lengths 0 and full, NaN / inf at every
  masked position and in unused pages: the fp64 reference of the clean inputs, and no NaN."""
  bad, ran = [], 0
  for name, kind, args in EDGES:
    if SAMPLE[impl] is not None and name not in SAMPLE[impl]:
      continue
    outs, want = RUN[kind](impl, *args)
    ran += 1
    for poison, got in zip(("nan", "inf"), outs):
      got = np.asarray(got, np.float64)
      err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
      if not np.isfinite(got).all() or err > 2e-5:
        bad.append(f"{name} [{impl}] poison={poison}: finite={np.isfinite(got).all()}, "
                   f"rel err {err:.2e}")
  print(impl, "edge inputs:", ran)
  assert ran == (len(EDGES) if SAMPLE[impl] is None else len(SAMPLE[impl]))
  assert not bad, "\n".join(bad)
