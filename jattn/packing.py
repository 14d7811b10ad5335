"""Sample packing (docs/packing.md): Best-Fit-Decreasing plans (``pack_bfd``), packed rows from a
``TokenStore`` (``materialize``), segment ids under jit and a resumable ``PackedIterator``."""
from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jattn._validate import as_int32, check_flags, check_int, check_range, is_traced

__all__ = ["PackPlan", "pack_bfd", "TokenStore", "PackedBatch", "materialize",
           "loss_weights_from_segments", "segments_from_lengths", "PackedIterator"]


# ----------------------------------------------------------------------------- Planning
@dataclasses.dataclass(frozen=True, eq=False)
class PackPlan:
  """Where every chunk of every document goes: one entry per chunk, in document order.

  Chunk i holds tokens ``chunk_starts[i]:+chunk_lengths[i]`` (1 <= length <= max_len) of
  document ``doc_ids[i]`` (an index into the input lengths) at columns
  ``offsets[i]:+chunk_lengths[i]`` of row ``bins[i]``; rows fill back to back from column 0.

  Attributes:
    doc_ids, chunk_starts, chunk_lengths, bins, offsets: int64 [num_chunks], as above.
    num_bins, max_len: number of rows and row length.
    num_docs: number of input documents (including empty ones, which have no chunk).

  Example:
    >>> plan = pack_bfd([3, 6, 2], max_len=8)
    >>> plan.bins.tolist(), plan.offsets.tolist(), plan.row_loads.tolist()
    ([1, 0, 0], [0, 0, 6], [8, 3])
  """
  doc_ids: np.ndarray
  chunk_starts: np.ndarray
  chunk_lengths: np.ndarray
  bins: np.ndarray
  offsets: np.ndarray
  num_bins: int
  max_len: int
  num_docs: int

  @property
  def num_chunks(self) -> int:
    return int(self.doc_ids.shape[0])

  @functools.cached_property
  def row_loads(self) -> np.ndarray:
    """int64 [num_bins]: tokens used in each row."""
    return np.bincount(self.bins, weights=self.chunk_lengths,
                       minlength=self.num_bins).astype(np.int64)

  @functools.cached_property
  def row_index(self) -> tuple[np.ndarray, np.ndarray]:
    """(order, starts): chunks of row r are ``order[starts[r]:starts[r + 1]]``, by offset."""
    counts = np.bincount(self.bins, minlength=self.num_bins)
    return np.lexsort((self.offsets, self.bins)), np.concatenate([[0], np.cumsum(counts)])

  @functools.cached_property
  def max_segments(self) -> int:
    """The largest number of chunks in one row (0 for an empty plan)."""
    return int(np.bincount(self.bins, minlength=self.num_bins).max()) if self.num_bins else 0

  def utilization(self) -> float:
    """Fraction of the row slots that hold a token (1.0 for an empty plan).

    Example:
      >>> pack_bfd([3, 6, 2], max_len=8).utilization()
      0.6875
    """
    return (float(self.chunk_lengths.sum()) / (self.num_bins * self.max_len) if self.num_bins
            else 1.0)

  @functools.cached_property
  def doc_lengths(self) -> np.ndarray:
    """int64 [num_docs]: each document's tokens (its chunks' total)."""
    return np.bincount(self.doc_ids, self.chunk_lengths, self.num_docs).astype(np.int64)


def _ranks(c: np.ndarray) -> np.ndarray:
  """Each element's index within its group in ``np.repeat(x, c)`` (c: group sizes)."""
  return np.arange(int(c.sum()), dtype=np.int64) - np.repeat(np.cumsum(c) - c, c)


class _CapacityTree:
  """Segment tree over capacities 0..max_len marking those with an open bin (leaves at
  ``size + r``; a node is 1 iff a leaf below is). Pure Python: called once per run of chunks."""

  def __init__(self, max_len: int):
    self.size = 1 << max_len.bit_length()   # the smallest power of two > max_len
    self.t = [0] * (2 * self.size)

  def add(self, r: int):
    t, i = self.t, r + self.size
    while i and not t[i]:
      t[i] = 1
      i >>= 1

  def remove(self, r: int):
    t, i = self.t, r + self.size
    t[i] = 0
    while i > 1 and not t[i ^ 1]:  # the parent of two empty subtrees is empty
      i >>= 1
      t[i] = 0

  def first_at_least(self, lo: int) -> int:
    """Smallest capacity r >= lo that has a bin, or -1. O(log max_len)."""
    t, size, i = self.t, self.size, lo + self.size
    if t[i]:
      return lo
    while i > 1:  # climb until a right sibling subtree holds a bin
      if not i & 1 and t[i + 1]:
        i += 1
        break
      i >>= 1
    else:
      return -1
    while i < size:  # leftmost marked leaf below i
      i = 2 * i if t[2 * i] else 2 * i + 1
    return i - size


def _bfd_runs(counts: np.ndarray, max_len: int):
  """BFD on chunk-length counts (counts[L]: chunks of length L) into bins of ``max_len``: returns
  (bin_ids, runs, num_bins); run j = (m, k, last, cap, length) puts k chunks of ``length`` into
  each of m bins ``bin_ids[j]`` but the last, which gets ``last``; the bins had ``cap`` free
  slots before (``max_len`` for new bins)."""
  tree = _CapacityTree(max_len)
  levels: dict = {}  # levels[r]: ids of open bins with r free slots
  bin_ids, runs, num_bins = [], [], 0
  for length in (max_len - np.flatnonzero(counts[::-1])).tolist():  # descending, counts > 0
    c = int(counts[length])
    while c:
      r = tree.first_at_least(length)
      if r < 0:  # no open bin fits: open fresh ones
        r, k = max_len, max_len // length
        m = -(-c // k)
        ids = range(num_bins, num_bins + m)
        num_bins += m
      else:
        k, lvl = r // length, levels[r]
        m = min(-(-c // k), len(lvl))
        ids = lvl[-m:]
        del lvl[-m:]
        if not lvl:
          tree.remove(r)
      placed = min(c, m * k)
      last = placed - (m - 1) * k
      bin_ids.append(ids)
      runs.append((m, k, last, r, length))
      # The first m - 1 bins move to capacity r - k*length, the last to r - last*length (0: full).
      for nr, moved in ((r - k * length, ids[:m - 1]), (r - last * length, ids[m - 1:])):
        if nr > 0 and len(moved):
          tgt = levels.setdefault(nr, [])
          if not tgt:
            tree.add(nr)
          tgt.extend(moved)
      c -= placed
  return bin_ids, runs, num_bins


def pack_bfd(lengths, max_len: int, *, split_long: bool = True) -> PackPlan:
  """Pack documents into rows of ``max_len`` tokens with Best-Fit-Decreasing: chunks go longest
  first into the open row with the least free space that fits them.

  Args:
    lengths: 1-D integer document lengths; 0-length documents get no chunk.
    max_len: row length (tokens per packed sequence), >= 1.
    split_long: cut documents longer than ``max_len`` into chunks (True) or raise (False).

  Returns:
    A ``PackPlan`` with one entry per chunk, in document order.

  Example:
    >>> plan = pack_bfd([5, 3, 0, 4, 12], max_len=8)
    >>> plan.num_bins, plan.doc_ids.tolist(), plan.chunk_lengths.tolist()
    (3, [0, 1, 3, 4, 4], [5, 3, 4, 8, 4])
  """
  check_int("max_len", max_len)
  max_len = int(max_len)
  check_flags(split_long=split_long)
  lengths = np.asarray(lengths)
  if lengths.ndim != 1:
    raise ValueError(f"lengths must be a 1-D sequence, got shape {lengths.shape}")
  if lengths.size and (lengths.dtype == bool or not np.issubdtype(lengths.dtype, np.integer)):
    raise ValueError(f"lengths must be integers, got dtype {lengths.dtype}")
  check_range("lengths", lengths, 0, np.iinfo(np.int64).max)   # before the cast: no wrap
  lengths = lengths.astype(np.int64)
  if not split_long and (bad := np.flatnonzero(lengths > max_len)).size:
    raise ValueError(f"document {bad[0]} has {lengths[bad[0]]} tokens > max_len={max_len} "
                     "and split_long=False")
  n_chunks = -(-lengths // max_len)  # 0 for empty documents
  doc_ids = np.repeat(np.arange(lengths.shape[0], dtype=np.int64), n_chunks)
  starts = _ranks(n_chunks) * max_len
  clen = np.minimum(max_len, lengths[doc_ids] - starts)
  # Longest first, stable (numpy's stable sort on keys of <= 16 bits is a radix sort).
  key_dtype = np.uint16 if max_len < 2 ** 16 else np.uint32
  order = np.argsort((max_len - clen).astype(key_dtype), kind="stable")
  counts = np.bincount(clen, minlength=max_len + 1)
  bin_ids, runs, num_bins = _bfd_runs(counts, max_len)
  # Runs -> per-chunk bins and offsets (sorted order): each bin of a run gets reps chunks of
  # length rlen from column max_len - cap on.
  m, k, last, cap, rlen = np.asarray(runs, np.int64).reshape(-1, 5).T
  entry_bins = np.fromiter(itertools.chain.from_iterable(bin_ids), np.int64, int(m.sum()))
  reps = np.repeat(k, m)
  reps[np.cumsum(m) - 1] = last
  per_chunk = lambda x: np.repeat(np.repeat(x, m), reps)
  bins, offsets = np.empty_like(clen), np.empty_like(clen)
  bins[order] = np.repeat(entry_bins, reps)
  offsets[order] = per_chunk(max_len - cap) + _ranks(reps) * per_chunk(rlen)
  return PackPlan(doc_ids, starts, clen, bins, offsets, int(num_bins), max_len,
                  int(lengths.shape[0]))


# ----------------------------------------------------------------------------- Materialising rows
@dataclasses.dataclass(frozen=True, eq=False)
class TokenStore:
  """Documents as one flat token array plus boundaries (CSR layout): document d is
  ``tokens[offsets[d]:offsets[d + 1]]``.

  Attributes:
    tokens: 1-D int array of all documents' tokens, back to back.
    offsets: int64 [num_docs + 1], non-decreasing from 0 to ``len(tokens)``.

  Example:
    >>> store = TokenStore(np.arange(5), np.array([0, 2, 5]))
    >>> store.offsets.tolist()
    [0, 2, 5]
  """
  tokens: np.ndarray
  offsets: np.ndarray

  def __post_init__(self):
    tokens, offsets = np.asarray(self.tokens), np.asarray(self.offsets, np.int64)
    if tokens.ndim != 1:
      raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
    if tokens.dtype.kind not in "iu":
      raise TypeError(f"tokens must be integers, got dtype {tokens.dtype}")
    if (offsets.ndim != 1 or offsets.shape[0] < 1 or offsets[0] != 0
        or offsets[-1] != tokens.shape[0] or (np.diff(offsets) < 0).any()):
      raise ValueError("offsets must be non-decreasing boundaries [num_docs + 1] from 0 to "
                       "len(tokens)")
    object.__setattr__(self, "tokens", tokens)
    object.__setattr__(self, "offsets", offsets)

  @classmethod
  def from_documents(cls, docs: Sequence) -> "TokenStore":
    """A store of ``docs``: 1-D integer arrays (or lists), one per document, empty ones allowed.

    Example:
      >>> s = TokenStore.from_documents([[1, 2, 3], [], [4]])
      >>> s.lengths.tolist(), s.tokens.tolist()
      ([3, 0, 1], [1, 2, 3, 4])
    """
    arrs = [np.asarray(d).reshape(-1) for d in docs]
    offsets = np.cumsum([0] + [a.shape[0] for a in arrs], dtype=np.int64)
    tokens = np.concatenate([a for a in arrs if a.size] or [np.zeros(0, np.int32)])
    return cls(tokens, offsets)

  @property
  def num_docs(self) -> int:
    return int(self.offsets.shape[0] - 1)

  @property
  def lengths(self) -> np.ndarray:
    """int64 [num_docs]: document lengths."""
    return np.diff(self.offsets)


def _check_pad_id(pad_id, dtype):
  info = np.iinfo(dtype)
  check_int("pad_id", pad_id, int(info.min), int(info.max))


def _as_store(store) -> TokenStore:
  if isinstance(store, TokenStore):
    return store
  try:
    if isinstance(store, tuple) and len(store) == 2 and np.ndim(store[0]) == 1 and \
        np.ndim(store[1]) == 1 and not isinstance(store[0], (list, tuple)):
      return TokenStore(*store)
    return TokenStore.from_documents(store)
  except (TypeError, ValueError) as e:
    raise type(e)(f"store: {e}") from None


@dataclasses.dataclass(frozen=True, eq=False)
class PackedBatch:
  """Packed rows ready for a training step (numpy arrays).

  Attributes:
    tokens: [n, max_len] token ids (``pad_id`` in padding).
    segment_ids: int32 [n, max_len]; chunks numbered 1, 2, ... per row, 0 for padding.
    positions: int32 [n, max_len]; restart at 0 at each chunk start (0 in padding).
    loss_weights: float32 [n, max_len]: ``[r, t]`` weights the prediction of
      ``tokens[r, t + 1]`` from t: 1 iff both lie in one chunk (the last column is always 0).
    doc_lengths: int32 [n, max_segments]; chunk lengths in row order, zero padded.
    doc_ids: int64 [n, max_segments]; document of each chunk, -1 padded.
    chunk_starts: int64 [n, max_segments]; first token of each chunk in its document, 0 padded.

  Example:
    >>> store = TokenStore.from_documents([[1, 2, 3], [4, 5]])
    >>> batch = materialize(pack_bfd(store.lengths, max_len=8), store)
    >>> batch.segment_ids.tolist(), batch.positions.tolist()
    ([[1, 1, 1, 2, 2, 0, 0, 0]], [[0, 1, 2, 0, 1, 0, 0, 0]])
  """
  tokens: np.ndarray
  segment_ids: np.ndarray
  positions: np.ndarray
  loss_weights: np.ndarray
  doc_lengths: np.ndarray
  doc_ids: np.ndarray
  chunk_starts: np.ndarray


def loss_weights_from_segments(segment_ids):
  """Next-token loss weights from segment ids (numpy or jax arrays).

  Args:
    segment_ids: int [..., seq]; 0 is padding.

  Returns:
    float32 [..., seq]: 1 iff position t is not padding and t + 1 is in the same segment.

  Example:
    >>> loss_weights_from_segments(np.array([1, 1, 2, 2, 2, 0])).tolist()
    [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
  """
  xp = jnp if isinstance(segment_ids, jax.Array) else np
  s = segment_ids
  same = (s[..., :-1] == s[..., 1:]) & (s[..., :-1] != 0)
  return xp.concatenate([same, xp.zeros(s.shape[:-1] + (1,), bool)], axis=-1).astype(xp.float32)


def materialize(plan: PackPlan, store, rows=None, *, max_segments: int | None = None,
                pad_id: int = 0) -> PackedBatch:
  """Build packed rows (tokens, segment ids, positions, loss weights) from a plan.

  Args:
    plan: a ``PackPlan`` over the store's documents.
    store: a ``TokenStore``, a ``(flat_tokens, offsets)`` pair or a list of 1-D integer token
      arrays, with the plan's document lengths (else ValueError naming a document of the rows).
    rows: int rows (bins) to build, default all; -1 gives an all-padding row.
    max_segments, pad_id: width (>= 1) of ``doc_lengths``/``doc_ids`` (default
      ``plan.max_segments``) and the token id written in padding (an int of the tokens' dtype).

  Returns:
    A ``PackedBatch`` with ``len(rows)`` rows of ``plan.max_len`` tokens.

  Example:
    >>> docs = [np.arange(1, 6), np.arange(11, 14), np.arange(21, 25)]
    >>> plan = pack_bfd([5, 3, 4], max_len=8)
    >>> b = materialize(plan, docs)
    >>> b.tokens.tolist()
    [[1, 2, 3, 4, 5, 11, 12, 13], [21, 22, 23, 24, 0, 0, 0, 0]]
  """
  store = _as_store(store)
  if store.num_docs != plan.num_docs:
    raise ValueError(f"plan has {plan.num_docs} documents, store has {store.num_docs}")
  rows = np.asarray(np.arange(plan.num_bins) if rows is None else rows).reshape(-1)
  if rows.size and rows.dtype.kind not in "iu":
    raise TypeError(f"rows must be integers, got dtype {rows.dtype}")
  if (bad := (rows < -1) | (rows >= plan.num_bins)).any():
    raise ValueError(f"rows must be in [-1, {plan.num_bins}), got {rows[bad][:5].tolist()}")
  rows = rows.astype(np.int64)
  max_segments = max(plan.max_segments, 1) if max_segments is None else max_segments
  check_int("max_segments", max_segments)
  _check_pad_id(pad_id, store.tokens.dtype)
  n, max_len = rows.shape[0], plan.max_len
  (order, starts), real = plan.row_index, rows >= 0
  lo = np.where(real, starts[np.maximum(rows, 0)], 0)
  cnt = np.where(real, starts[np.maximum(rows, 0) + 1] - lo, 0)  # chunks per output row
  if n and cnt.max() > max_segments:
    raise ValueError(f"a row has {int(cnt.max())} chunks > max_segments={max_segments}")
  rank = _ranks(cnt)  # chunk rank in its row
  ch = order[np.repeat(lo, cnt) + rank]  # chunk indices, by row then offset
  out_row = np.repeat(np.arange(n, dtype=np.int64), cnt)
  doc, clen = plan.doc_ids[ch], plan.chunk_lengths[ch]
  lens = store.offsets[doc + 1] - store.offsets[doc]
  if (bad := np.flatnonzero(lens != plan.doc_lengths[doc])).size:
    raise ValueError(f"store document {doc[bad[0]]} has {lens[bad[0]]} tokens, the plan's has "
                     f"{plan.doc_lengths[doc[bad[0]]]}")
  within = _ranks(clen)  # token index within its chunk
  r, col = np.repeat(out_row, clen), np.repeat(plan.offsets[ch], clen) + within
  src = np.repeat(store.offsets[doc] + plan.chunk_starts[ch], clen) + within

  def filled(width, index, fill, dtype, values):   # [n, width] of ``fill``, values at index
    x = np.full((n, width), fill, dtype)
    x[index] = values
    return x
  per_chunk = functools.partial(filled, max_segments, (out_row, rank))
  per_token = functools.partial(filled, max_len, (r, col))
  segment_ids = per_token(0, np.int32, np.repeat(rank + 1, clen))
  return PackedBatch(tokens=per_token(pad_id, store.tokens.dtype, store.tokens[src]),
                     segment_ids=segment_ids, positions=per_token(0, np.int32, within),
                     loss_weights=loss_weights_from_segments(segment_ids),
                     doc_lengths=per_chunk(0, np.int32, clen),
                     doc_ids=per_chunk(-1, np.int64, doc),
                     chunk_starts=per_chunk(0, np.int64, plan.chunk_starts[ch]))


# ---------------------------------------------------------------------------- Segment ids under jit
def segments_from_lengths(doc_lengths, max_len: int):
  """Segment ids and positions of packed rows from per-row document lengths (jit-compatible).

  Args:
    doc_lengths: int [batch, max_docs], laid out back to back from column 0 (zeros skipped, a row
      cut at ``max_len``, max_docs 0: padding rows); concrete ones in [0, 2**31 - 1] (ValueError
      naming the entry, TypeError for other dtypes), traced negative ones count as 0
      (``jattn.debug_checks``).
    max_len: row length (static), >= 1.

  Returns:
    (segment_ids int32 [batch, max_len], 1-based per row, 0 for padding;
    positions int32 [batch, max_len], restarting at 0 in each document, 0 in padding).

  Example:
    >>> seg, pos = segments_from_lengths(jnp.array([[3, 2, 0]]), max_len=6)
    >>> seg.tolist(), pos.tolist()
    ([[1, 1, 1, 2, 2, 0]], [[0, 1, 2, 0, 1, 0]])
  """
  check_int("max_len", max_len)
  x = doc_lengths if is_traced(doc_lengths) else np.asarray(doc_lengths)
  if x.ndim != 2:
    raise ValueError(f"doc_lengths must be [batch, max_docs], got shape {x.shape}")
  x = as_int32("doc_lengths", x)
  check_range("doc_lengths", x, 0, np.iinfo(np.int32).max)
  return _segments_from_lengths(x, int(max_len))


@functools.partial(jax.jit, static_argnames=("max_len",))
def _segments_from_lengths(doc_lengths, max_len):
  # Clipped to [0, max_len] (negatives count as 0, sums cannot overflow); an empty document
  # appended (a no-op) makes max_docs >= 1.
  lengths = jnp.pad(jnp.clip(doc_lengths, 0, max_len), ((0, 0), (0, 1)))  # [b, d + 1]
  ends = jnp.cumsum(lengths, axis=-1)  # [b, d]
  nonzero_before = jnp.cumsum(lengths > 0, axis=-1) - (lengths > 0)  # [b, d]
  col = jnp.arange(max_len, dtype=jnp.int32)
  # Document containing each column: the first whose end is > col (zero-length ones never are).
  doc = jax.vmap(lambda e: jnp.searchsorted(e, col, side="right"))(ends)  # [b, max_len]
  doc = jnp.minimum(doc, lengths.shape[-1] - 1)
  valid = col[None, :] < ends[:, -1:]
  seg = jnp.take_along_axis(nonzero_before, doc, axis=-1) + 1
  start = jnp.take_along_axis(ends - lengths, doc, axis=-1)
  return (jnp.where(valid, seg, 0).astype(jnp.int32),
          jnp.where(valid, col[None, :] - start, 0).astype(jnp.int32))


# ----------------------------------------------------------------------------- Training iterator
class PackedIterator:
  """Shuffled, epoch-aware, seeded, resumable iterator over packed batches (docs/packing.md):
  each epoch packs the documents permuted by ``(seed, epoch)`` and permutes the rows.

  Args:
    store: a ``TokenStore``, ``(flat_tokens, offsets)`` or a list of 1-D token arrays.
    max_len, batch_size: row length and rows per batch (ints >= 1).
    seed, pad_id: integer seed (>= 0) and the token id for padding (an int of the tokens' dtype).
    window: pack in shuffled windows of this many documents (int >= 1; None: all at once).
    max_segments: static width of ``doc_lengths``/``doc_ids``; default epoch 0's, rounded up to 8.
    num_epochs: stop after this many epochs (int >= 0; None: never stop).
    state: None, or a ``get_state`` dict to resume from.

  Example:
    >>> docs = [np.full(n, i + 1) for i, n in enumerate([5, 3, 4, 9, 2])]
    >>> it = PackedIterator(docs, max_len=8, batch_size=2, seed=0, num_epochs=1)
    >>> b = next(it)
    >>> b.tokens.shape, it.get_state()["step"]
    ((2, 8), 1)
  """

  def __init__(self, store, max_len: int, batch_size: int, *, seed: int = 0,
               window: int | None = None, max_segments: int | None = None,
               num_epochs: int | None = None, pad_id: int = 0, state: dict | None = None):
    for name, x, lo in (("max_len", max_len, 1), ("batch_size", batch_size, 1), ("seed", seed, 0),
                        ("window", window, 1), ("max_segments", max_segments, 1),
                        ("num_epochs", num_epochs, 0)):
      if x is not None or name in ("max_len", "batch_size", "seed"):
        check_int(name, x, lo, 2**63 - 1 if name == "seed" else 2**31 - 1)
    self.store = _as_store(store)
    _check_pad_id(pad_id, self.store.tokens.dtype)
    self.max_len, self.batch_size, self.seed = int(max_len), int(batch_size), int(seed)
    self.window, self.num_epochs, self.pad_id = window and int(window), num_epochs, pad_id
    self._epoch = self._step = 0
    self._cache: tuple[int, PackPlan, np.ndarray] | None = None
    if max_segments is None:
      max_segments = -(-max(self._epoch_plan(0)[0].max_segments, 1) // 8) * 8
    self.max_segments = int(max_segments)
    if state is not None:
      self.set_state(state)

  def _epoch_plan(self, epoch: int) -> tuple[PackPlan, np.ndarray]:
    if self._cache is not None and self._cache[0] == epoch:
      return self._cache[1:]
    rng, lengths = np.random.default_rng([self.seed, epoch]), self.store.lengths
    perm = rng.permutation(lengths.shape[0])
    w = self.window or max(lengths.shape[0], 1)
    parts, bin_base = [], 0
    for lo in range(0, lengths.shape[0], w):
      ids = perm[lo:lo + w]
      p = pack_bfd(lengths[ids], self.max_len)
      parts.append((ids[p.doc_ids], p.chunk_starts, p.chunk_lengths, p.bins + bin_base, p.offsets))
      bin_base += p.num_bins
    cols = [np.concatenate(c) for c in zip(*parts)] if parts else [np.zeros(0, np.int64)] * 5
    key = np.lexsort((cols[1], cols[0]))  # document order, as pack_bfd returns
    plan = PackPlan(*(c[key] for c in cols), num_bins=bin_base, max_len=self.max_len,
                    num_docs=int(lengths.shape[0]))
    self._cache = (epoch, plan, rng.permutation(plan.num_bins))
    return self._cache[1:]

  def steps_in_epoch(self, epoch: int | None = None) -> int:
    """Batches in ``epoch`` (default: the current one): ``ceil(rows / batch_size)``.

    Example:
      >>> it = PackedIterator([np.ones(5, int), np.ones(5, int)], max_len=8, batch_size=1)
      >>> it.steps_in_epoch()
      2
    """
    plan, _ = self._epoch_plan(self._epoch if epoch is None else epoch)
    return -(-plan.num_bins // self.batch_size)

  def _fingerprint(self) -> list:
    lengths = self.store.lengths
    # Cheap content hash of the lengths: resuming on a different corpus must fail loudly.
    h = int(np.bitwise_xor.reduce(lengths * 2654435761 + np.arange(lengths.shape[0]) * 40503)
            ) if lengths.size else 0
    return [self.seed, self.max_len, self.batch_size, self.window, int(lengths.shape[0]), h]

  def get_state(self) -> dict:
    """The iterator's position, a JSON-serialisable dict of "epoch", "step" and "fingerprint": the
    next batch is batch ``step`` of ``epoch``.

    Example:
      >>> it = PackedIterator([np.ones(3, int)], max_len=4, batch_size=1)
      >>> it.get_state()["epoch"], it.get_state()["step"]
      (0, 0)
    """
    return {"epoch": self._epoch, "step": self._step, "fingerprint": self._fingerprint()}

  def set_state(self, state: dict) -> None:
    """Continue from a ``get_state`` dict of an identically configured iterator (else ValueError).

    Example:
      >>> it = PackedIterator([np.ones(3, int)] * 4, max_len=4, batch_size=1)
      >>> it.set_state({"epoch": 1, "step": 2, "fingerprint": it.get_state()["fingerprint"]})
      >>> it.get_state()["step"]
      2
    """
    if list(state["fingerprint"]) != self._fingerprint():
      raise ValueError("state comes from an iterator with a different configuration or corpus")
    epoch, step = state["epoch"], state["step"]
    check_int("state['epoch']", epoch, 0)
    check_int("state['step']", step, 0, self.steps_in_epoch(epoch))
    self._epoch, self._step = int(epoch), int(step)

  def __iter__(self) -> Iterator[PackedBatch]:
    return self

  def __next__(self) -> PackedBatch:
    while True:
      if self.num_epochs is not None and self._epoch >= self.num_epochs:
        raise StopIteration
      plan, row_order = self._epoch_plan(self._epoch)
      if self._step * self.batch_size < plan.num_bins:
        break
      if plan.num_bins == 0 and self.num_epochs is None:
        raise StopIteration  # nothing to yield, ever
      self._epoch, self._step = self._epoch + 1, 0
    rows = row_order[self._step * self.batch_size:(self._step + 1) * self.batch_size]
    rows = np.concatenate([rows, np.full(self.batch_size - rows.shape[0], -1, np.int64)])
    batch = materialize(plan, self.store, rows, max_segments=self.max_segments, pad_id=self.pad_id)
    self._step += 1
    return batch
