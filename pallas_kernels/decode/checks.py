"""Argument checks shared by the split-KV decode kernels (Triton and Mosaic TPU)."""
from __future__ import annotations


def check_partials_args(q, k, v, kv_lengths, num_splits):
  """Raise ValueError for inputs no decode kernel can take.

  Args:
    q, kv_lengths: [batch, q_heads, head_dim] and [batch].
    k, v: caches (contiguous [batch, max_len, kv_heads, head_dim] or pages) that agree in all
      but the last dim: v's head_dim_v may differ from k's head_dim (MLA).
    num_splits: split count, >= 1.

  Returns:
    None.

  Example:
    >>> import jax.numpy as jnp
    >>> check_partials_args(jnp.ones((1, 4, 8)), jnp.ones((1, 16, 2, 8)), jnp.ones((1, 16, 2, 8)),
    ...                     jnp.ones((1,), jnp.int32), 2)
  """
  if q.ndim != 3:
    raise ValueError(f"q must be [batch, q_heads, head_dim], got shape {q.shape}")
  if k.ndim != 4 or v.ndim != 4 or k.shape[:3] != v.shape[:3]:
    raise ValueError(f"k and v caches must be 4-D and agree in all but the last dim (head_dim "
                     f"may differ), got {k.shape} and {v.shape}")
  if q.shape[-1] != k.shape[-1]:
    raise ValueError(f"q and k head_dim differ: q {q.shape}, k {k.shape}")
  if kv_lengths.shape != (q.shape[0],):
    raise ValueError(f"kv_lengths must have shape (batch,) = ({q.shape[0]},), "
                     f"got {kv_lengths.shape}")
  if int(num_splits) < 1:
    raise ValueError(f"num_splits must be >= 1, got {num_splits}")


def check_page_table(q, page_table):
  """Raise ValueError unless page_table is [batch, max_pages] for q's batch.

  Args:
    q, page_table: [batch, q_heads, head_dim] and int32 [batch, max_pages].

  Returns:
    None.

  Example:
    >>> import jax.numpy as jnp
    >>> check_page_table(jnp.ones((2, 4, 8)), jnp.zeros((2, 3), jnp.int32))
  """
  if page_table.ndim != 2 or page_table.shape[0] != q.shape[0]:
    raise ValueError(f"page_table must be [batch, max_pages] with batch {q.shape[0]}, "
                     f"got {page_table.shape}")
