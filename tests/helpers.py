"""Shared test helpers: relative error, per-dtype tolerances, random inputs with awkward sizes.

Every kernel is compared with the fp32 reference (``attention_reference`` at HIGHEST precision on
inputs upcast to fp32) by ``rel_err(x, ref) = ||x - ref|| / ||ref||``, with one tolerance per
input dtype (``TOL``). Inputs are random and fresh per test (numpy generators seeded per case:
jax.random would compile once per shape).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Relative-error tolerances per input dtype: fp32 computes in fp32 (IEEE products), 16-bit
# inputs round P and dS to the input dtype before the matmuls.
TOL = {jnp.dtype(jnp.float32): 2e-3, jnp.dtype(jnp.bfloat16): 2e-2,
       jnp.dtype(jnp.float16): 2e-2}


# Interpret-mode programs are big and run once: cheap CPU codegen halves their compile time. The
# options change only how XLA:CPU optimises the program, not what it computes.
_FAST_CPU_COMPILE = {"xla_llvm_disable_expensive_passes": True}


def ci_cases(cases, keep):
  """Parametrize values: those in ``keep`` run by default, the others are marked ``slow`` (run
  with ``--run-slow``); a tuple case fills several argnames. Each feature keeps a default case."""
  cases, keep = list(cases), list(keep)
  assert all(k in cases for k in keep), f"unknown cases: {[k for k in keep if k not in cases]}"
  slow = [pytest.mark.slow]
  return [c if c in keep else pytest.param(*c, marks=slow) if isinstance(c, tuple)
          else pytest.param(c, marks=slow) for c in cases]


def jit_run(fn, *args):
  """``jax.jit(fn)(*args)``, compiled with cheap codegen options on the CPU."""
  lowered = jax.jit(fn).lower(*args)
  on_cpu = jax.default_backend() == "cpu"
  return (lowered.compile(_FAST_CPU_COMPILE) if on_cpu else lowered.compile())(*args)


def tol(dtype) -> float:
  """The relative-error tolerance of an input dtype."""
  return TOL[jnp.dtype(dtype)]


def rel_err(x, ref) -> float:
  """||x - ref|| / ||ref|| in float64 (both cast through fp32); 0-norm refs compare absolutely."""
  x = np.asarray(x, np.float32).astype(np.float64)     # numpy casts: no program per shape
  ref = np.asarray(ref, np.float32).astype(np.float64)
  return float(np.linalg.norm((x - ref).ravel()) / max(np.linalg.norm(ref.ravel()), 1e-30))


def normal(seed, *shapes, dtype=jnp.float32):
  """Standard-normal arrays of ``shapes`` in ``dtype`` from one numpy generator seeded with
  ``seed`` (jax.random would compile a program per shape)."""
  return _normals(np.random.default_rng(seed), shapes, dtype)


def _normals(rng, shapes, dtype):
  return tuple(jnp.asarray(rng.standard_normal(s, np.float32).astype(jnp.dtype(dtype)))
               for s in shapes)


def random_qkv(rng, batch, q_len, kv_len, q_heads, kv_heads, head_dim, head_dim_v=None,
               dtype=jnp.float32):
  """Standard-normal q [B, Sq, Hq, D], k [B, Sk, Hk, D], v [B, Sk, Hk, Dv] in ``dtype``."""
  head_dim_v = head_dim if head_dim_v is None else head_dim_v
  shapes = ((batch, q_len, q_heads, head_dim), (batch, kv_len, kv_heads, head_dim),
            (batch, kv_len, kv_heads, head_dim_v))
  return _normals(rng, shapes, dtype)


def packed_segments(rng, batch, length, *, pad_tail=0, pad_head=0, one_token_docs=True,
                    max_doc=None):
  """int32 [batch, length] ids of packed documents 1, 2, ... of random lengths (every other one a
  single token with ``one_token_docs``), ``pad_head`` / ``pad_tail`` padding tokens (id 0)."""
  max_doc = max(2, length // 3) if max_doc is None else max_doc
  out = np.zeros((batch, length), np.int32)
  for b in range(batch):
    pos, doc = pad_head, 1
    while pos < length - pad_tail:
      n = 1 if one_token_docs and doc % 2 else int(rng.integers(1, max_doc))
      out[b, pos:min(pos + n, length - pad_tail)] = doc
      pos += n
      doc += 1
  return out


def assert_lse_close(lse, ref_lse, tolerance):
  """Same -inf rows (rows that see no key) as the reference, finite elsewhere, close there."""
  lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
  assert lse.dtype == np.float32, lse.dtype
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
  fin = np.isfinite(ref_lse)
  assert np.isfinite(lse[fin]).all()
  err = rel_err(np.where(fin, lse, 0.0), np.where(fin, ref_lse, 0.0))
  assert err < tolerance, ("lse", err)


def assert_grads_close(grads, ref_grads, tolerance, names=("dq", "dk", "dv")):
  """Gradients: the inputs' shapes and dtypes, finite, within ``tolerance`` of the reference's."""
  for name, g, r in zip(names, grads, ref_grads):
    assert g.shape == r.shape, (name, g.shape, r.shape)
    assert np.isfinite(np.asarray(g, np.float32)).all(), name
    err = rel_err(g, r)
    assert err < tolerance, (name, err)
