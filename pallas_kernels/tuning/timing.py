"""The timer of the tuning command and the benchmark."""
from __future__ import annotations

import time

import jax
import numpy as np


def sync(x):
  """Block until every array of a pytree is ready.

  Args:
    x: a pytree of arrays (other leaves are left alone).

  Returns:
    ``x``, once ready.

  Example:
    >>> import jax.numpy as jnp
    >>> float(sync({"a": jnp.ones(2)})["a"][0])
    1.0
  """
  return jax.block_until_ready(x)


def time_fn(fn, arg_sets, *, iters=None, min_time=0.1, min_iters=5, max_iters=2000, repeats=3):
  """Median milliseconds per call of ``fn(*args)``, rotating over ``arg_sets``.

  Each input set is called once to compile and warm up; then ``repeats`` loops of ``iters``
  asynchronous calls are timed on the host, each ended by one wait for the last output.

  Args:
    fn, arg_sets: a jitted function and a list of argument tuples (several, to defeat the L2).
    iters, min_time, min_iters, max_iters: calls per loop; default: enough for ``min_time``
      seconds, clipped to [min_iters, max_iters].
    repeats: loops; the median is returned.

  Returns:
    (median_ms, spread_ms) where spread is max - min over the loops.

  Example:
    >>> import jax.numpy as jnp
    >>> f = jax.jit(lambda x: x + 1)
    >>> ms, _ = time_fn(f, [(jnp.ones(4),)], iters=3, repeats=2)
  """
  for args in arg_sets:  # compile + warm up
    sync(fn(*args))
  if iters is None:
    t0 = time.perf_counter()
    sync(fn(*arg_sets[0]))
    iters = int(min(max(min_time / max(time.perf_counter() - t0, 1e-6), min_iters), max_iters))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = None
    for i in range(iters):
      out = fn(*arg_sets[i % len(arg_sets)])
    sync(out)
    times.append((time.perf_counter() - t0) * 1e3 / iters)
  return float(np.median(times)), float(max(times) - min(times))


def random_sets(shapes, dtype, *, num_sets=3, seed=0):
  """``num_sets`` distinct tuples of standard-normal arrays of ``shapes`` (inputs for ``time_fn``).

  Args:
    shapes, dtype: a list of array shapes (one array per shape in each tuple) and their dtype.
    num_sets, seed: how many tuples; the PRNG seed.

  Returns:
    A list of ``num_sets`` tuples of arrays.

  Example:
    >>> import jax.numpy as jnp
    >>> sets = random_sets([(2, 3), (4,)], jnp.float32)
    >>> len(sets), sets[0][1].shape, bool((sets[0][0] != sets[1][0]).all())
    (3, (4,), True)
  """
  keys = jax.random.split(jax.random.key(seed), num_sets * len(shapes)).reshape(num_sets, -1)
  return [tuple(jax.random.normal(kk, s, dtype) for kk, s in zip(ks, shapes)) for ks in keys]
