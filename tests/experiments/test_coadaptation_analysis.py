"""The co-adaptation experiment's per-token selection rules and metrics against brute force on
a tiny model: proxy and oracle selection, post-hoc oracle forward, concentration, proxy recall,
measured sparsity, needle recall and the paired bootstrap."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import coadaptation_analysis as A

BS, TOPK = 4, 2


def _softmax_causal(q, k):
  """Dense causal softmax, numpy fp64: q [s, d], k [s, d] -> [s, s]."""
  s = q.shape[0]
  z = (q @ k.T) / np.sqrt(q.shape[-1])
  z = np.where(np.tril(np.ones((s, s), bool)), z, -np.inf)
  p = np.exp(z - z.max(-1, keepdims=True))
  return p / p.sum(-1, keepdims=True)


def _brute_mass(q, k, bs):
  """[b, hk, s, nb]: per query token, mass of each key block, mean over the group's heads."""
  b, s, hq, _ = q.shape
  hk = k.shape[2]
  g, nb = hq // hk, -(-s // bs)
  out = np.zeros((b, hk, s, nb))
  for bi in range(b):
    for h in range(hq):
      p = _softmax_causal(q[bi, :, h], k[bi, :, h // g])
      for j in range(nb):
        out[bi, h // g, :, j] += p[:, j * bs:(j + 1) * bs].sum(-1) / g
  return out


def _brute_select(rank, s, bs, top_k):
  """bool [b, hk, s, nb]: block 0 + own block + top_k others by rank (ties: lower block); a
  float top_k: round(top_k * visible) half up in all, at least the forced ones."""
  b, hk = rank.shape[:2]
  keep = np.zeros(rank.shape, bool)
  for bi in range(b):
    for g in range(hk):
      for t in range(s):
        own = t // bs
        keep[bi, g, t, [0, own]] = True
        others = [j for j in range(own + 1) if j not in (0, own)]
        others.sort(key=lambda j: (-rank[bi, g, t, j], j))
        n = top_k if isinstance(top_k, int) else int(top_k * (own + 1) + 0.5) - len({0, own})
        keep[bi, g, t, others[:max(n, 0)]] = True
  return keep


def _qk(seed=0, s=24):
  r = np.random.default_rng(seed)
  q = r.normal(size=(2, s, 4, 8)).astype(np.float32)
  k = r.normal(size=(2, s, 2, 8)).astype(np.float32)
  return q, k


@pytest.mark.parametrize("top_k", [TOPK, 0.6])
def test_proxy_selection_is_per_token_and_shared_by_the_gqa_group(top_k):
  q, k = _qk()
  s = q.shape[1]
  b, hq, hk = 2, 4, 2
  score = np.zeros((b, hk, s, s // BS))
  for bi in range(b):
    for h in range(hq):
      kbar = k[bi, :, h // 2].reshape(s // BS, BS, -1).mean(1)
      score[bi, h // 2] += q[bi, :, h] @ kbar.T               # per token, summed over the group
  sel = A.select("proxy", jnp.asarray(q), jnp.asarray(k), block_size=BS, top_k=top_k)
  assert sel.q_block_size == 1 and sel.tile_mask().shape == (b, hk, s, s // BS)
  np.testing.assert_array_equal(np.asarray(sel.tile_mask()), _brute_select(score, s, BS, top_k))


@pytest.mark.parametrize("top_k", [TOPK, 0.6])
def test_oracle_selection_ranks_by_true_block_mass(top_k):
  q, k = _qk(1)
  s = q.shape[1]
  mass = _brute_mass(q.astype(np.float64), k.astype(np.float64), BS)
  got = np.asarray(A.block_mass(jnp.asarray(q), jnp.asarray(k), block_size=BS))
  np.testing.assert_allclose(got, mass, atol=1e-5)
  np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-5)
  sel = A.select("oracle", jnp.asarray(q), jnp.asarray(k), block_size=BS, top_k=top_k)
  np.testing.assert_array_equal(np.asarray(sel.tile_mask()), _brute_select(mass, s, BS, top_k))


def _tiny_model():
  from jattn.nn import Transformer, TransformerConfig
  cfg = TransformerConfig(vocab_size=23, num_layers=2, d_model=16, num_heads=4, num_kv_heads=2,
                          head_dim=8, implementation="xla")
  return Transformer(cfg, rngs=nnx.Rngs(3))


def _brute_posthoc_logits(model, tokens, rule, top_k):
  """The full model's forward, each layer's attention restricted (by numpy loops) to the blocks
  the rule keeps on that layer's own q/k."""
  from jattn.nn.rope import apply_rope
  b, s = tokens.shape
  pos = jnp.broadcast_to(jnp.arange(s), (b, s))
  x = model.embed(tokens)
  for blk in model.blocks:
    at = blk.attn
    h = blk.attn_norm(x)
    q = apply_rope(at.wq(h).reshape(b, s, 4, 8), pos)
    k = apply_rope(at.wk(h).reshape(b, s, 2, 8), pos)
    v = np.asarray(at.wv(h).reshape(b, s, 2, 8), np.float64)
    qn, kn = np.asarray(q, np.float64), np.asarray(k, np.float64)
    if rule == "oracle":
      rank = _brute_mass(qn, kn, BS)
    else:
      rank = np.zeros((b, 2, s, s // BS))
      for hh in range(4):
        kbar = kn[:, :, hh // 2].reshape(b, s // BS, BS, 8).mean(2)
        rank[:, hh // 2] += np.einsum("btd,bjd->btj", qn[:, :, hh], kbar)
    keep = _brute_select(rank, s, BS, top_k)
    o = np.zeros((b, s, 4, 8))
    for bi in range(b):
      for hh in range(4):
        z = qn[bi, :, hh] @ kn[bi, :, hh // 2].T / np.sqrt(8)
        m = np.repeat(keep[bi, hh // 2], BS, axis=-1) & np.tril(np.ones((s, s), bool))
        z = np.where(m, z, -np.inf)
        p = np.exp(z - z.max(-1, keepdims=True))
        o[bi, :, hh] = (p / p.sum(-1, keepdims=True)) @ v[bi, :, hh // 2]
    x = x + at.wo(jnp.asarray(o.reshape(b, s, 32), jnp.float32))
    x = x + blk.mlp(blk.mlp_norm(x))
  return np.asarray(model._logits(x))


@pytest.mark.parametrize("rule,top_k", [("oracle", TOPK), ("proxy", TOPK), ("oracle", 0.6)])
def test_posthoc_forward_matches_brute_force(rule, top_k):
  model = _tiny_model()
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 23, (2, 24)), jnp.int32)
  got, layers = A.masked_forward(model, tokens, rule=rule, block_size=BS, top_k=top_k)
  want = _brute_posthoc_logits(model, tokens, rule, top_k)
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-4, rtol=2e-4)
  dense = np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens))
  assert np.abs(dense - want).max() > 1e-3                # the pruning did change the output
  assert len(layers) == 2 and layers[0]["selection"].q_block_size == 1


def test_posthoc_forward_keeping_every_block_is_the_full_model():
  model = _tiny_model()
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 23, (1, 24)), jnp.int32)
  got, _ = A.masked_forward(model, tokens, rule="oracle", block_size=BS, top_k=24 // BS)
  full = nnx.jit(lambda m, t: m(t))(model, tokens)
  np.testing.assert_allclose(np.asarray(got), np.asarray(full), atol=2e-5)


def test_concentration_and_proxy_recall_match_brute_force():
  s, bs, frac = 40, 4, 0.3
  q, k = _qk(2, s)
  mass = _brute_mass(q.astype(np.float64), k.astype(np.float64), bs)
  proxy = np.random.default_rng(5).normal(size=mass.shape)
  conc, rec, n = 0.0, 0.0, 0
  for bi in range(2):
    for g in range(2):
      for t in range(s):
        own = t // bs
        cand = [j for j in range(own + 1) if j not in (0, own)]
        kt = int(frac * (own + 1) + 0.5) - (1 if own == 0 else 2)   # round half up
        if not 0 < kt < len(cand):
          continue
        m = mass[bi, g, t]
        top = sorted(cand, key=lambda j: (-m[j], j))[:kt]
        pick = sorted(cand, key=lambda j: (-proxy[bi, g, t, j], j))[:kt]
        conc += m[top].sum() / m[cand].sum()
        rec += m[pick].sum() / m[top].sum()
        n += 1
  assert n > 20
  got_c, got_r = A.concentration_and_recall(jnp.asarray(mass, jnp.float32),
                                            jnp.asarray(proxy, jnp.float32), block_size=bs,
                                            keep_fraction=frac)
  assert float(got_c) == pytest.approx(conc / n, abs=1e-5)
  assert float(got_r) == pytest.approx(rec / n, abs=1e-5)
  assert 0 < float(got_r) < 1 and float(got_c) < 1
  # the oracle ranking recalls all of its own mass
  _, self_rec = A.concentration_and_recall(jnp.asarray(mass, jnp.float32),
                                           jnp.asarray(mass, jnp.float32), block_size=bs,
                                           keep_fraction=frac)
  assert float(self_rec) == pytest.approx(1.0, abs=1e-6)


def test_sparsity_and_needle_recall_brute_force():
  q, k = _qk(3)
  s = q.shape[1]
  sel = A.select("proxy", jnp.asarray(q), jnp.asarray(k), block_size=BS, top_k=1)
  keep = np.asarray(sel.tile_mask())
  vis = np.arange(s // BS)[None, :] <= (np.arange(s) // BS)[:, None]
  want = 1 - keep.sum() / (vis.sum() * 2 * 2)
  ans = np.array([[23], [22]])
  overall, at_ans = A.selection_sparsity(sel, ans)
  assert overall == pytest.approx(want)
  assert at_ans == pytest.approx(1 - 3 / 6)                 # 3 of 6 visible blocks at t=22, 23
  needle = np.array([[9], [1]])
  hit = [keep[0, :, 23, 9 // BS].any(), keep[1, :, 22, 0].any()]
  assert A.needle_recall([sel], ans, needle, BS) == [pytest.approx(np.mean(hit))]


def test_per_query_top_k_and_bootstrap():
  assert A.per_query_top_k(512, 16) == 4 and A.per_query_top_k(8192, 64) == 22
  d = A.paired_bootstrap([1.0, 2.0, 3.0], [0.0, 0.0, 0.0], num_resamples=2000)
  assert d["diff"] == 2.0 and 1.0 <= d["lo"] < 2.0 < d["hi"] <= 3.0 and d["n"] == 3
  with pytest.raises(ValueError, match="equal-length"):
    A.paired_bootstrap([1.0, 2.0], [1.0])


def test_claim_verdicts_cover_each_case():
  """Each claim gets the verdict its interval implies: inside the band, beside it (either side),
  too wide, or untested when the cell lacks the variant; the best trained variant is reported."""
  from experiments.coadaptation import CLAIMS, claim_verdicts
  ci = lambda m, lo, hi: {"diff": m, "mean": m, "lo": lo, "hi": hi, "n": 3}
  agg = [
      {"task": "copy", "seq_len": 64, "variant": "full", "n": 3,
       "concentration": ci(0.62, 0.58, 0.66)},
      {"task": "copy", "seq_len": 64, "variant": "posthoc_proxy", "n": 3,
       "diff_vs_full": {"score": ci(-0.30, -0.35, -0.25)}},
      {"task": "copy", "seq_len": 64, "variant": "sparse_ste", "n": 3,
       "diff_vs_full": {"score": ci(-0.10, -0.20, -0.01)}, "concentration": ci(0.5, 0.4, 0.6)},
      {"task": "copy", "seq_len": 64, "variant": "sparse_distill", "n": 3,
       "diff_vs_full": {"score": ci(-0.004, -0.009, 0.001)}},
      {"task": "copy", "seq_len": 64, "variant": "local_global_nope", "n": 3,
       "diff_vs_full": {"score": ci(-0.005, -0.2, 0.2)},
       "diff_vs_local_global_rope": {"score": ci(0.01, 0.005, 0.02)}},
  ]
  got = {c["claim"]: c for c in claim_verdicts(agg)}
  assert len(got) == len(CLAIMS)
  v = [got[c[0]]["verdict"] for c in CLAIMS]
  assert v == ["contradicted (a larger loss)", "reproduced", "reproduced", "contradicted (lower)",
               "inconclusive (interval too wide)", "reproduced", "untested at this scale"], v
  assert got[CLAIMS[1][0]]["variant"] == "sparse_distill"
  assert got[CLAIMS[0][0]]["measured"] == "-30.0 pts [-35.0, -25.0]"
