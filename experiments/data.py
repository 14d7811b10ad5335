"""Data for the co-adaptation experiment: a seeded long-context retrieval task plus real text.

Everything here is numpy and *stateless*: the batch of training step ``s`` is a pure function of
``(seed, s)``, so a resumed run sees exactly the batches an uninterrupted run would have seen (the
"data iterator state" saved in a checkpoint is just the step).

Vocabulary (``Vocab``): bytes 0..255 (the text corpus is byte level), then a few special tokens,
then ``num_keys`` key tokens, ``num_values`` value tokens and, for the ``"pairs"`` task,
``num_keys * num_values`` fused key-value needle tokens.

Retrieval episode (one row of ``seq_len + 1`` tokens; inputs ``row[:-1]``, targets ``row[1:]``)::

    [ haystack of real text (bytes) with needles written into its last `span` tokens ... ]
    [ QUERY key_a VAL(a)  QUERY key_b VAL(b) ... ]        <- num_queries queries at the end

* task ``"copy"`` (the simplest needle task): one needle per episode, a value token ``VAL(v)``
  (value tokens occur nowhere else); the query is ``QUERY KEY(k)`` (k random, uninformative) and
  the answer is ``VAL(v)``:
  one content-addressed lookup and a copy (tied embeddings make the copy easy). Small models learn
  it in a few hundred steps, so sparse selection is tested on a task the dense baseline solves.
* task ``"pairs"`` (needles with keys): a needle is one fused token ``PAIR(k, v)``; answering
  needs one content-addressed lookup (the query key matches the needle's key part, the answer is
  its value part).
* task ``"mqar"`` (multi-query associative recall): a needle is two tokens ``KEY(k) VAL(v)``;
  answering needs an induction circuit (find the earlier ``KEY(k)``, copy the token after it).

``num_pairs >= num_queries`` needles are written, with distinct keys and values drawn with
replacement, so the unqueried needles are distractors and every value occurs several times.
The score is the accuracy of the argmax prediction at the answer positions (the token after the
queried key). A curriculum grows ``span`` from short to the full haystack; episodes shorter
than a row are packed several per row, each its own document (segment ids, positions from 0), so
a short span is a short context with more answers per step.

Text rows: the ``.py`` files of the Python installation's standard library as a byte-level corpus,
split into train and held-out files by a hash of the path, packed into rows of ``seq_len + 1``
tokens with ``jattn.packing.pack_bfd`` (segment ids 1-based per row, positions restart at 0 in every
document, loss weights drop padding and cross-document targets).
"""
from __future__ import annotations

import dataclasses
import glob
import os
import sysconfig
import zlib

import numpy as np

NUM_BYTES = 256
QUERY = 256      # marks a query: QUERY KEY(k) -> VAL(v)
SEP = 257        # unused filler special (kept so the layout has room for more specials)
_SPECIALS = 4


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  """The retrieval task.

  Attributes:
    seq_len: model input length (rows hold seq_len + 1 tokens).
    task: "copy" (one value needle), "pairs" (fused key-value needle tokens) or "mqar"
      (KEY VAL needles, induction).
    num_keys: size of the key vocabulary.
    num_values: size of the value vocabulary.
    num_pairs: needles per episode (distinct keys); the unqueried ones are distractors.
    num_queries: queries per episode, answered in the query section at the end.
    text_fraction: fraction of each training batch that is packed real text (LM rows).
    answer_weight: value of ``weights`` at answer positions (informational: the training loss
      normalises answers separately, see ``train_lib.weighted_xent``).
  """
  seq_len: int = 512
  task: str = "pairs"
  num_keys: int = 16
  num_values: int = 16
  num_pairs: int = 8
  num_queries: int = 4
  text_fraction: float = 0.25
  answer_weight: float = 4.0

  def __post_init__(self):
    if self.task not in ("copy", "pairs", "mqar"):
      raise ValueError(f"task must be 'copy', 'pairs' or 'mqar', got {self.task!r}")
    if self.task == "copy" and not self.num_pairs == self.num_queries == 1:
      raise ValueError("task 'copy' has one needle and one query (num_pairs = num_queries = 1)")
    if not 1 <= self.num_queries <= self.num_pairs <= self.num_keys:
      raise ValueError("need 1 <= num_queries <= num_pairs <= num_keys")
    if not 0.0 <= self.text_fraction < 1.0:
      raise ValueError("text_fraction must be in [0, 1)")
    if self.haystack_len < self.needle_len * self.num_pairs:
      raise ValueError("seq_len too short for the needles")

  @property
  def vocab(self) -> "Vocab":
    return Vocab(self.num_keys, self.num_values, self.task == "pairs")

  @property
  def needle_len(self) -> int:
    return 1 if self.task == "pairs" else 2

  @property
  def query_len(self) -> int:
    """Tokens of the query section at the end of a row."""
    return 3 * self.num_queries

  @property
  def haystack_len(self) -> int:
    return self.seq_len + 1 - self.query_len


@dataclasses.dataclass(frozen=True)
class Vocab:
  """Token id layout (see the module docstring).

  Example:
    >>> v = Vocab(16, 16, True)
    >>> v.key(0), v.value(0), v.pair(0, 0), v.size
    (260, 276, 292, 576)
  """
  num_keys: int
  num_values: int
  fused_pairs: bool

  @property
  def key_base(self):
    return NUM_BYTES + _SPECIALS

  @property
  def value_base(self):
    return self.key_base + self.num_keys

  @property
  def pair_base(self):
    return self.value_base + self.num_values

  def key(self, k):
    """Token id of key ``k``."""
    return self.key_base + k

  def value(self, v):
    """Token id of value ``v``."""
    return self.value_base + v

  def pair(self, k, v):
    """Token id of the fused needle (key ``k``, value ``v``)."""
    return self.pair_base + k * self.num_values + v

  @property
  def size(self):
    """Vocabulary size, rounded up to a multiple of 64."""
    n = self.pair_base + (self.num_keys * self.num_values if self.fused_pairs else 0)
    return -(-n // 64) * 64


# --------------------------------------------------------------------------------------------------
# Text corpus
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class TextCorpus:
  """A byte-level corpus: a flat uint16 token array plus document offsets.

  Attributes:
    tokens: uint16 [total] concatenated documents.
    offsets: int64 [num_docs + 1] document boundaries in ``tokens``.
    names: document names (relative paths).
  """
  tokens: np.ndarray
  offsets: np.ndarray
  names: list

  @property
  def lengths(self) -> np.ndarray:
    return np.diff(self.offsets)

  def doc(self, i) -> np.ndarray:
    """Tokens of document ``i``."""
    return self.tokens[self.offsets[i]:self.offsets[i + 1]]


def python_source_files(root=None):
  """The ``.py`` files of the Python installation's standard library, sorted.

  Args:
    root: directory to scan; default ``sysconfig.get_paths()["stdlib"]``.

  Returns:
    A sorted list of (absolute path, path relative to root); site-packages are excluded.

  Example:
    >>> files = python_source_files()
    >>> len(files) > 100
    True
  """
  root = root or sysconfig.get_paths()["stdlib"]
  paths = glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
  out = []
  for p in sorted(paths):
    rel = os.path.relpath(p, root)
    if "site-packages" in rel.split(os.sep) or "dist-packages" in rel.split(os.sep):
      continue
    out.append((p, rel))
  return out


def load_python_corpus(*, max_bytes=None, heldout_every=10, root=None):
  """Load the standard library's source files as byte-level train and held-out corpora.

  A file is held out iff ``crc32(relative path) % heldout_every == 0`` (stable across runs).
  Files are read in sorted order until ``max_bytes`` per split is reached.

  Args:
    max_bytes: optional cap on the bytes of each split.
    heldout_every: one in this many files (by hash) goes to the held-out split.
    root: directory to scan (default: the stdlib).

  Returns:
    (train, heldout) ``TextCorpus`` objects.

  Example:
    >>> train, held = load_python_corpus(max_bytes=200_000)
    >>> int(train.lengths.sum()) <= 200_000
    True
  """
  splits = {"train": ([], []), "heldout": ([], [])}
  sizes = {"train": 0, "heldout": 0}
  for path, rel in python_source_files(root):
    split = "heldout" if zlib.crc32(rel.encode()) % heldout_every == 0 else "train"
    if max_bytes is not None and sizes[split] >= max_bytes:
      continue
    try:
      with open(path, "rb") as f:
        data = f.read()
    except OSError:
      continue
    if not data:
      continue
    if max_bytes is not None:
      data = data[:max_bytes - sizes[split]]
    splits[split][0].append(np.frombuffer(data, np.uint8).astype(np.uint16))
    splits[split][1].append(rel)
    sizes[split] += len(data)
  out = []
  for split in ("train", "heldout"):
    arrays, names = splits[split]
    if not arrays:
      raise RuntimeError(f"no {split} source files found under {root}")
    lengths = np.array([len(a) for a in arrays], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    out.append(TextCorpus(np.concatenate(arrays), offsets, names))
  return tuple(out)


# --------------------------------------------------------------------------------------------------
# Packed text rows
# --------------------------------------------------------------------------------------------------

class PackedText:
  """A corpus packed into rows of ``row_len`` tokens with Best-Fit-Decreasing (``pack_bfd``).

  Args:
    corpus: a ``TextCorpus``.
    row_len: tokens per row (``seq_len + 1``: inputs and shifted targets come from one row).

  Example:
    >>> train, _ = load_python_corpus(max_bytes=100_000)
    >>> packed = PackedText(train, 129)
    >>> rows = packed.rows(np.arange(2))
    >>> rows["tokens"].shape
    (2, 129)
  """

  def __init__(self, corpus: TextCorpus, row_len: int):
    from jattn.packing import pack_bfd
    self.corpus = corpus
    self.row_len = row_len
    self.plan = pack_bfd(np.asarray(corpus.lengths), row_len, split_long=True)
    self.num_rows = int(self.plan.num_bins)
    self.utilisation = float(self.plan.utilization())

  def rows(self, idx):
    """Materialise packed rows (``jattn.packing.materialize``).

    Args:
      idx: int array of row indices in [0, num_rows).

    Returns:
      dict of numpy arrays [len(idx), row_len]: "tokens" (int32), "segment_ids" (int32, 1-based
      per row, 0 = padding) and "positions" (int32, restarting at 0 in each document chunk).
    """
    from jattn.packing import materialize
    b = materialize(self.plan, (self.corpus.tokens, self.corpus.offsets), np.asarray(idx))
    return {"tokens": b.tokens.astype(np.int32), "segment_ids": b.segment_ids,
            "positions": b.positions}


def text_batch(packed: PackedText, rows: dict):
  """Turn packed rows of ``seq_len + 1`` tokens into a model batch.

  Args:
    packed: unused except for documentation symmetry (kept for a stable call signature).
    rows: output of ``PackedText.rows``.

  Returns:
    dict with "inputs", "targets", "segment_ids", "positions" (int32 [n, seq_len]), "weights"
    (float32: 1 where the target is a real token of the same document, else 0) and "answer_mask"
    (bool, all False: text rows carry no retrieval answers).
  """
  del packed
  tok, seg, pos = rows["tokens"], rows["segment_ids"], rows["positions"]
  same_doc = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)
  return {
      "inputs": tok[:, :-1], "targets": tok[:, 1:], "segment_ids": seg[:, :-1],
      "positions": pos[:, :-1], "weights": same_doc.astype(np.float32),
      "answer_mask": np.zeros(same_doc.shape, bool),
  }


# --------------------------------------------------------------------------------------------------
# Retrieval episodes
# --------------------------------------------------------------------------------------------------

def _episode(cfg, rng, haystack, span, row, weights, answer, off):
  """Write one episode (``span`` haystack tokens with needles, then the queries) into
  ``row[off:off + span + query_len]``; returns (needle positions, answer positions) in the row."""
  voc = cfg.vocab
  nl, npairs = cfg.needle_len, cfg.num_pairs
  total = len(haystack.tokens)
  start = rng.integers(0, total - span + 1)
  row[off:off + span] = haystack.tokens[start:start + span]
  keys = rng.choice(cfg.num_keys, npairs, replace=False)
  vals = rng.integers(0, cfg.num_values, npairs)
  slot = span // npairs
  offs = rng.integers(0, slot - nl + 1, npairs)   # one needle per slot, random offset inside it
  pos = off + np.arange(npairs) * slot + offs
  for p, k, v in zip(pos, keys, vals):
    if cfg.task == "pairs":
      row[p] = voc.pair(k, v)
    elif cfg.task == "copy":
      row[p] = voc.value(v)
    else:
      row[p], row[p + 1] = voc.key(k), voc.value(v)
    if p > 0:
      weights[p - 1] = 0.0        # the needle itself is unpredictable
    if cfg.task == "mqar":
      weights[p] = 0.0            # so is its value given the key
  q = rng.choice(npairs, cfg.num_queries, replace=False)
  ans = []
  for i, j in enumerate(q):
    base = off + span + 3 * i
    row[base:base + 3] = (QUERY, voc.key(keys[j]), voc.value(vals[j]))
    weights[base - 1] = 0.0       # predicting QUERY: fixed format, keep the loss clean
    weights[base] = 0.0           # which key is queried is random
    weights[base + 1] = cfg.answer_weight
    answer[base + 1] = True
    ans.append(base + 1)
  return pos, np.array(ans)


def retrieval_rows(cfg: TaskConfig, rng: np.random.Generator, n: int, haystack: TextCorpus,
                   span: int):
  """Generate ``n`` rows of retrieval episodes.

  An episode is ``span`` haystack tokens (a contiguous slice of the corpus) with the needles
  written into them, followed by the query section. A row holds as many episodes as fit
  (``(seq_len + 1) // (span + query_len)``), each its own packed document (segment ids 2, 3, ...
  with positions restarting at 0), right-aligned; the tokens before them are a text filler
  document (segment 1). At the full span (evaluation) a row is one episode. Short spans early in
  the curriculum thus give short contexts and more answers per step.

  Args:
    cfg: the task.
    rng: numpy Generator (the only source of randomness).
    n: rows to generate.
    haystack: text corpus the haystacks are cut from.
    span: haystack tokens per episode (the curriculum knob); clipped to
      [needle_len * num_pairs, haystack_len].

  Returns:
    dict like ``text_batch`` plus "needle_pos" (int32 [n, num_pairs]: positions of the first
    token of each needle of the *last* episode of each row) and "answer_pos" (int32
    [n, num_queries]: input positions whose target is an answer, last episode).

  Example:
    >>> train, _ = load_python_corpus(max_bytes=100_000)
    >>> cfg = TaskConfig(seq_len=128, num_pairs=4, num_queries=2, task="pairs")
    >>> b = retrieval_rows(cfg, np.random.default_rng(0), 3, train, span=32)
    >>> b["inputs"].shape, int(b["answer_mask"].sum())   # 3 episodes of 2 queries per row
    ((3, 128), 18)
  """
  H, L1 = cfg.haystack_len, cfg.seq_len + 1
  span = int(np.clip(span, cfg.needle_len * cfg.num_pairs, H))
  if len(haystack.tokens) < L1:
    raise ValueError(f"haystack corpus has {len(haystack.tokens)} tokens, need at least {L1}")
  ep = span + cfg.query_len
  k = max(1, L1 // ep)
  lead = L1 - k * ep
  rows = np.zeros((n, L1), np.int32)
  weights = np.ones((n, L1 - 1), np.float32)
  answer = np.zeros((n, L1 - 1), bool)
  seg = np.zeros((n, L1 - 1), np.int32)
  pos = np.zeros((n, L1 - 1), np.int32)
  needle_pos = np.zeros((n, cfg.num_pairs), np.int32)
  answer_pos = np.zeros((n, cfg.num_queries), np.int32)
  wpad = np.ones(L1, np.float32)      # weights with a spare slot for the row's last token
  apad = np.zeros(L1, bool)
  starts = [lead + i * ep for i in range(k)]
  seg_row = np.zeros(L1, np.int32)
  pos_row = np.zeros(L1, np.int32)
  bounds = ([0] if lead else []) + starts + [L1]
  for si, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
    seg_row[a:b] = si + 1
    pos_row[a:b] = np.arange(b - a)
  for r in range(n):
    wpad[:] = 1.0
    apad[:] = False
    if lead:
      start = rng.integers(0, len(haystack.tokens) - lead + 1)
      rows[r, :lead] = haystack.tokens[start:start + lead]
    for off in starts:
      npos, apos = _episode(cfg, rng, haystack, span, rows[r], wpad, apad, off)
      if off > 0:
        wpad[off - 1] = 0.0           # no target across a document boundary
    needle_pos[r], answer_pos[r] = npos, apos
    weights[r], answer[r] = wpad[:-1], apad[:-1]
    seg[r], pos[r] = seg_row[:-1], pos_row[:-1]
  return {
      "inputs": rows[:, :-1], "targets": rows[:, 1:], "segment_ids": seg, "positions": pos,
      "weights": weights, "answer_mask": answer, "needle_pos": needle_pos,
      "answer_pos": answer_pos,
  }


# --------------------------------------------------------------------------------------------------
# The training stream
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Curriculum:
  """Episode span (haystack tokens) as a function of the training step: short to long.

  The span grows geometrically from ``start`` tokens to the full haystack at ``ramp_frac`` of the
  total steps, then stays there. (Small models learn the lookup within a few dozen steps on
  5-token episodes; what takes time is extending it to long contexts, so every doubling of the
  length gets an equal share of the ramp.)

  Example:
    >>> c = Curriculum(start=8, ramp_frac=0.5)
    >>> c.span(0, 100, 512), c.span(25, 100, 512), c.span(50, 100, 512)
    (8, 64, 512)
  """
  start: int = 8
  ramp_frac: float = 0.7

  def span(self, step, total_steps, haystack_len):
    """Episode span (tokens) at ``step`` of ``total_steps``."""
    if self.ramp_frac <= 0 or self.start >= haystack_len:
      return haystack_len
    t = min(1.0, step / max(1.0, self.ramp_frac * total_steps))
    return int(round(self.start * (haystack_len / self.start) ** t))


class TrainStream:
  """Deterministic, stateless training batches: ``batch(step)`` depends only on (seed, step).

  Each batch has ``batch_size`` rows: ``round(text_fraction * batch_size)`` packed text rows
  (drawn without replacement within an epoch of the packed corpus, epoch order seeded) and the
  rest retrieval episodes at the curriculum's span for that step.

  Args:
    cfg: the task.
    train_text: ``TextCorpus`` for the haystack and the text rows.
    batch_size: rows per batch (global, before sharding).
    total_steps: the run's length (the curriculum depends on it).
    seed: data seed.
    curriculum: a ``Curriculum``.

  Example:
    >>> train, _ = load_python_corpus(max_bytes=100_000)
    >>> s = TrainStream(TaskConfig(seq_len=128, num_pairs=4, num_queries=2), train, 4, 10, 0)
    >>> b = s.batch(3)
    >>> b["inputs"].shape
    (4, 128)
  """

  def __init__(self, cfg, train_text, batch_size, total_steps, seed, curriculum=Curriculum()):
    self.cfg, self.text = cfg, train_text
    self.batch_size, self.total_steps, self.seed = batch_size, total_steps, seed
    self.curriculum = curriculum
    self.num_text = int(round(cfg.text_fraction * batch_size))
    self.packed = PackedText(train_text, cfg.seq_len + 1) if self.num_text else None

  def span(self, step):
    """Needle span used at ``step``."""
    return self.curriculum.span(step, self.total_steps, self.cfg.haystack_len)

  def _text_rows(self, step):
    n, per = self.packed.num_rows, self.num_text
    first = step * per
    idx = []
    for i in range(first, first + per):
      epoch, j = divmod(i, n)
      perm = np.random.default_rng([self.seed, 1, epoch]).permutation(n)
      idx.append(perm[j])
    return text_batch(self.packed, self.packed.rows(np.array(idx)))

  def batch(self, step):
    """The global batch of training step ``step`` (dict of numpy arrays, see ``text_batch``)."""
    rng = np.random.default_rng([self.seed, 0, step])
    ret = retrieval_rows(self.cfg, rng, self.batch_size - self.num_text, self.text, self.span(step))
    keys = ("inputs", "targets", "segment_ids", "positions", "weights", "answer_mask")
    if not self.num_text:
      return {k: ret[k] for k in keys}
    txt = self._text_rows(step)
    return {k: np.concatenate([ret[k], txt[k]]) for k in keys}

  def state(self, step):
    """The iterator state to checkpoint (stateless: the next step and the seed)."""
    return {"next_step": int(step), "seed": int(self.seed)}


def eval_sets(cfg: TaskConfig, heldout: TextCorpus, *, num_retrieval, num_text, seed):
  """Held-out evaluation data: retrieval episodes at full span and packed held-out text rows.

  Args:
    cfg: the task.
    heldout: held-out ``TextCorpus`` (haystacks and text rows both come from it).
    num_retrieval: retrieval episodes.
    num_text: packed text rows (at most the number the held-out corpus fills).
    seed: evaluation seed (keep it different from the training seeds).

  Returns:
    (retrieval batch dict, text batch dict).
  """
  ret = retrieval_rows(cfg, np.random.default_rng([seed, 7]), num_retrieval, heldout,
                       cfg.haystack_len)
  packed = PackedText(heldout, cfg.seq_len + 1)
  n = min(num_text, packed.num_rows)
  txt = text_batch(packed, packed.rows(np.arange(n)))
  return ret, txt
