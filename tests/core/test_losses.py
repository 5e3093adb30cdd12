"""Tests for jaxrl_llm.losses: fixtures, NumPy loop references, properties, transforms."""

from __future__ import annotations

import doctest
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_llm import losses
from jaxrl_llm.losses import (
    AGGREGATION_MODES,
    KL_KINDS,
    aggregate,
    aggregate_parts,
    cispo_policy_loss,
    entropy_from_logits,
    gmpo_policy_loss,
    gspo_policy_loss,
    kl_penalty,
    ppo_policy_loss,
    reinforce_policy_loss,
    rollout_correction_weights,
    sapo_policy_loss,
    value_loss,
)
from tests.utils import assert_close, assert_no_recompile, random_mask

B, T = 5, 7
POLICY_METRICS = {"pg_clipfrac", "pg_clipfrac_lower", "approx_kl", "ppo_kl", "ratio_mean"}


def make_inputs(seed, batch=B, time=T, seq_adv=False, spread=0.4):
  rng = np.random.default_rng(seed)
  mask = random_mask(rng, batch, time)
  logp = -rng.exponential(1.0, (batch, time)).astype(np.float32)
  old = (logp + spread * rng.standard_normal((batch, time))).astype(np.float32)
  shape = (batch,) if seq_adv else (batch, time)
  adv = rng.standard_normal(shape).astype(np.float32)
  return logp, old, adv, mask


def token_adv(adv, mask):
  adv = np.asarray(adv, np.float64)
  if adv.ndim == 1:
    adv = np.repeat(adv[:, None], mask.shape[1], axis=1)
  return adv


def np_masked_mean(x, mask):
  return float(np.sum(x * mask) / max(np.sum(mask), 1.0))


# ----------------------------------------------------------------- NumPy loop references


def ref_ppo(logp, old, adv, mask, lo=0.2, hi=None, c=None, clamp=20.0):
  hi = lo if hi is None else hi
  adv = token_adv(adv, mask)
  loss = np.zeros(mask.shape)
  clip = np.zeros(mask.shape)
  lower = np.zeros(mask.shape)
  ratio = np.zeros(mask.shape)
  kappa = np.zeros(mask.shape)
  for b in range(mask.shape[0]):
    for t in range(mask.shape[1]):
      if not mask[b, t]:
        continue
      k = min(max(float(logp[b, t]) - float(old[b, t]), -clamp), clamp)
      r = math.exp(k)
      a = adv[b, t]
      l1 = -a * r
      l2 = -a * min(max(r, 1 - lo), 1 + hi)
      lc = max(l1, l2)
      out = lc
      if c is not None and a < 0:
        out = min(lc, -a * c)
        lower[b, t] = lc > -a * c
      loss[b, t], clip[b, t], ratio[b, t], kappa[b, t] = out, l2 > l1, r, k
  metrics = {"pg_clipfrac": np_masked_mean(clip, mask),
             "pg_clipfrac_lower": np_masked_mean(lower, mask),
             "approx_kl": np_masked_mean(0.5 * kappa**2, mask),
             "ppo_kl": np_masked_mean(-kappa, mask),
             "ratio_mean": np_masked_mean(ratio, mask)}
  return loss, metrics


def ref_gspo(logp, old, adv, mask, lo=3e-4, hi=4e-4, clamp=10.0):
  adv = token_adv(adv, mask)
  loss = np.zeros(mask.shape)
  for b in range(mask.shape[0]):
    n = int(mask[b].sum())
    total = sum(float(logp[b, t]) - float(old[b, t]) for t in range(mask.shape[1])
                if mask[b, t])
    s = math.exp(min(total / max(n, 1), clamp))
    for t in range(mask.shape[1]):
      if mask[b, t]:
        a = adv[b, t]
        loss[b, t] = max(-a * s, -a * min(max(s, 1 - lo), 1 + hi))
  return loss


def ref_cispo(logp, old, adv, mask, lo=None, hi=5.0, mode="trl"):
  adv = token_adv(adv, mask)
  loss = np.zeros(mask.shape)
  for b in range(mask.shape[0]):
    for t in range(mask.shape[1]):
      if mask[b, t]:
        r = math.exp(min(max(float(logp[b, t]) - float(old[b, t]), -20), 20))
        if mode == "trl":
          w = min(r, hi)
        else:
          w = min(max(r, 0.0 if lo is None else 1 - lo), 1 + hi)
        loss[b, t] = -w * adv[b, t] * float(logp[b, t])
  return loss


def ref_sapo(logp, old, adv, mask, tau_pos=1.0, tau_neg=1.05):
  adv = token_adv(adv, mask)
  loss = np.zeros(mask.shape)
  for b in range(mask.shape[0]):
    for t in range(mask.shape[1]):
      if mask[b, t]:
        r = math.exp(float(logp[b, t]) - float(old[b, t]))
        tau = tau_pos if adv[b, t] > 0 else tau_neg
        gate = 4.0 / tau / (1.0 + math.exp(-tau * (r - 1.0)))
        loss[b, t] = -gate * adv[b, t]
  return loss


def ref_gmpo_rows(logp, old, adv, mask, lo=0.4, hi=0.4):
  """Per-row GMPO sequence losses L_i (verl geo_mean) and row lengths."""
  adv = token_adv(adv, mask)
  rows, lengths = [], []
  for b in range(mask.shape[0]):
    n = int(mask[b].sum())
    ksum, asum = 0.0, 0.0
    for t in range(mask.shape[1]):
      if not mask[b, t]:
        continue
      k = float(logp[b, t]) - float(old[b, t])
      kc = min(max(k, -lo), hi)
      a = adv[b, t]
      sgn = float(np.sign(a))
      ksum += sgn * min(sgn * k, sgn * kc)
      asum += a
    denom = max(n, 1)
    rows.append(-(asum / denom) * math.exp(ksum / denom))
    lengths.append(n)
  return np.array(rows), np.array(lengths)


def ref_gmpo(logp, old, adv, mask, lo=0.4, hi=0.4):
  rows, lengths = ref_gmpo_rows(logp, old, adv, mask, lo, hi)
  return mask * (rows / np.maximum(lengths, 1))[:, None]


def ref_reinforce(logp, adv, mask, old=None, is_clip=None):
  adv = token_adv(adv, mask)
  loss = np.zeros(mask.shape)
  for b in range(mask.shape[0]):
    for t in range(mask.shape[1]):
      if mask[b, t]:
        w = 1.0
        if old is not None:
          w = math.exp(float(logp[b, t]) - float(old[b, t]))
          if is_clip is not None:
            w = min(w, is_clip)
        loss[b, t] = -adv[b, t] * float(logp[b, t]) * w
  return loss


def ref_value(values, old, returns, mask, clip):
  loss = np.zeros(mask.shape)
  clipped = np.zeros(mask.shape)
  for b in range(mask.shape[0]):
    for t in range(mask.shape[1]):
      if mask[b, t]:
        v, r = float(values[b, t]), float(returns[b, t])
        l1 = (v - r) ** 2
        if clip is None:
          loss[b, t] = 0.5 * l1
        else:
          vc = min(max(v, float(old[b, t]) - clip), float(old[b, t]) + clip)
          l2 = (vc - r) ** 2
          loss[b, t] = 0.5 * max(l1, l2)
          clipped[b, t] = l2 > l1
  return loss, np_masked_mean(clipped, mask)


def ref_kl(logp, ref, kind, clamp=None):
  base = kind.rstrip("+")
  base = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}.get(base, base)
  out = np.zeros(np.shape(logp))
  for idx in np.ndindex(out.shape):
    x = float(logp[idx]) - float(ref[idx])
    val = {"k1": x, "abs": abs(x), "k2": 0.5 * x * x,
           "k3": math.exp(min(max(-x, -20), 20)) - min(max(-x, -20), 20) - 1}[base]
    if clamp is not None:
      val = min(max(val, -clamp), clamp)
    out[idx] = val
  return out


def ref_entropy(logits):
  logits = np.asarray(logits, np.float64)
  out = np.zeros(logits.shape[:-1])
  for idx in np.ndindex(out.shape):
    z = logits[idx]
    p = np.exp(z - z.max())
    p /= p.sum()
    out[idx] = -sum(pi * math.log(pi) for pi in p if pi > 0)
  return out


def ref_aggregate(loss, mask, mode, norm_length=None):
  rows = []
  for b in range(mask.shape[0]):
    n = int(mask[b].sum())
    s = sum(float(loss[b, t]) for t in range(mask.shape[1]) if mask[b, t])
    rows.append((s, n))
  total = sum(s for s, _ in rows)
  tokens = sum(n for _, n in rows)
  nonempty = [(s, n) for s, n in rows if n > 0]
  if mode == "token-mean":
    return total / tokens if tokens else 0.0
  if mode == "token-sum":
    return total
  if not nonempty:
    return 0.0
  if mode == "seq-mean-token-sum":
    return sum(s for s, _ in nonempty) / len(nonempty)
  if mode == "seq-mean-token-mean":
    return sum(s / n for s, n in nonempty) / len(nonempty)
  norm = mask.shape[1] if norm_length is None else norm_length
  return sum(s / norm for s, _ in nonempty) / len(nonempty)


# --------------------------------------------------------------------------- PPO


@pytest.mark.parametrize("adv,ratio,expected", [
    (-1.0, 5.0, 3.0), (1.0, 5.0, -1.2), (-1.0, 0.5, 0.8), (1.0, 0.5, -0.5),
    (-1.0, 1.1, 1.1)])
def test_ppo_verl_fixtures(adv, ratio, expected):
  logp = jnp.full((1, 1), math.log(ratio))
  loss, _ = ppo_policy_loss(logp, jnp.zeros((1, 1)), jnp.full((1, 1), adv),
                            jnp.ones((1, 1)), clip_low=0.2, dual_clip=3.0)
  assert_close(loss[0, 0], expected, atol=1e-6)


@pytest.mark.parametrize("clip_high", [None, 0.28])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("seq_adv", [False, True])
def test_ppo_matches_numpy(clip_high, dual_clip, seq_adv):
  logp, old, adv, mask = make_inputs(0, seq_adv=seq_adv, spread=1.5)
  loss, metrics = ppo_policy_loss(logp, old, adv, mask, clip_low=0.2,
                                  clip_high=clip_high, dual_clip=dual_clip)
  ref_loss, ref_metrics = ref_ppo(logp, old, adv, mask, 0.2, clip_high, dual_clip)
  assert loss.shape == (B, T) and loss.dtype == jnp.float32
  assert_close(loss, ref_loss, atol=1e-5)
  assert set(metrics) == POLICY_METRICS
  assert_close({k: metrics[k] for k in ref_metrics}, ref_metrics, atol=1e-5)
  assert 0 < ref_metrics["pg_clipfrac"] < 1  # the inputs do exercise the clip
  if dual_clip is not None:
    assert ref_metrics["pg_clipfrac_lower"] > 0


def test_ppo_log_ratio_clamp():
  logp, old = jnp.array([[100.0, -100.0]]), jnp.zeros((1, 2))
  adv, mask = jnp.array([[-1.0, 1.0]]), jnp.ones((1, 2))
  loss, metrics = ppo_policy_loss(logp, old, adv, mask)
  assert_close(loss, [[math.exp(20.0), -math.exp(-20.0)]], rtol=1e-5, atol=0)
  assert np.isfinite(float(metrics["ratio_mean"]))
  loss, _ = ppo_policy_loss(logp, old, adv, mask, log_ratio_clamp=None)
  assert np.isinf(float(loss[0, 0]))  # e^100 overflows float32 without the clamp


def test_ppo_gradients_analytic():
  logp, old, adv, mask = make_inputs(1, spread=0.0)
  old = logp - np.float32(0.05)  # ratio e^0.05 inside the clip range for every token
  n = mask.sum()

  def objective(lp):
    per_tok, _ = ppo_policy_loss(lp, old, adv, mask, clip_low=0.2)
    return aggregate(per_tok, mask, "token-mean")

  grad = jax.grad(objective)(jnp.asarray(logp))
  assert_close(grad, -adv * math.exp(0.05) * mask / n, atol=1e-6)

  # Clipped tokens (ratio e^0.5 > 1.2 with A > 0) get zero gradient.
  old_far = logp - np.float32(0.5)
  grad = jax.grad(lambda lp: aggregate(
      ppo_policy_loss(lp, old_far, adv, mask)[0], mask))(jnp.asarray(logp))
  expected = np.where(adv > 0, 0.0, -adv * math.exp(0.5) / n) * mask
  assert_close(grad, expected, atol=1e-6)


def test_ppo_grad_matches_finite_differences():
  logp, old, adv, mask = make_inputs(2, spread=0.3)
  f = jax.jit(lambda lp: aggregate(ppo_policy_loss(lp, old, adv, mask, clip_high=0.28,
                                                   dual_clip=3.0)[0], mask,
                                   "seq-mean-token-mean"))
  grad = np.asarray(jax.grad(f)(jnp.asarray(logp, jnp.float32)), np.float64)
  h = 1e-3
  for b, t in np.argwhere(mask > 0)[::4]:
    up, down = logp.copy(), logp.copy()
    up[b, t] += h
    down[b, t] -= h
    fd = (float(f(jnp.asarray(up))) - float(f(jnp.asarray(down)))) / (2 * h)
    assert abs(fd - grad[b, t]) < 2e-3


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), lo=st.floats(0.01, 0.5), extra=st.floats(0.0, 0.3),
       c=st.floats(1.5, 10.0))
def test_ppo_properties(seed, lo, extra, c):
  logp, old, adv, mask = make_inputs(seed, spread=1.0)
  ratio = np.exp(logp - old)
  plain, _ = ppo_policy_loss(logp, old, adv, mask, clip_low=lo, clip_high=lo + extra)
  dual, _ = ppo_policy_loss(logp, old, adv, mask, clip_low=lo, clip_high=lo + extra,
                            dual_clip=c)
  plain, dual = np.asarray(plain), np.asarray(dual)
  # Pessimistic bound: the clipped surrogate is never below the unclipped one.
  assert np.all(plain >= (-adv * ratio) * mask - 1e-5)
  # Dual clip caps the loss at -A c for negative advantages and is a no-op otherwise.
  assert np.all(np.where((adv < 0) & (mask > 0), dual <= -adv * c + 1e-5, True))
  assert_close(np.where(adv >= 0, dual, 0), np.where(adv >= 0, plain, 0))
  # A huge clip range gives the plain importance-weighted loss.
  wide, _ = ppo_policy_loss(logp, old, adv, mask, clip_low=1e6)
  assert_close(wide, -adv * ratio * mask, rtol=1e-5, atol=1e-5)


def test_ppo_dual_clip_validation():
  logp, old, adv, mask = make_inputs(3)
  for bad in (1.0, 0.5, 1):
    with pytest.raises(ValueError, match="dual_clip"):
      ppo_policy_loss(logp, old, adv, mask, dual_clip=bad)
  # Traced values are not checked (and stay finite).
  loss, _ = jax.jit(lambda c: ppo_policy_loss(logp, old, adv, mask, dual_clip=c))(0.5)
  assert np.all(np.isfinite(loss))


def test_ppo_no_recompile_when_clip_changes():
  logp, old, adv, mask = make_inputs(4)
  fn = lambda lo, hi, c: ppo_policy_loss(logp, old, adv, mask, clip_low=lo,
                                         clip_high=hi, dual_clip=c)
  assert_no_recompile(fn, (0.2, 0.28, 3.0), (0.1, 0.2, 2.0), (0.05, 0.05, 5.0))


def test_ppo_clip_schedule_no_recompile():
  """Dynamic clipping: an optax schedule 0.2 -> 0.05 feeds clip_low under one jit."""
  logp, old, adv, mask = make_inputs(5, spread=0.15)
  schedule = optax.linear_schedule(0.2, 0.05, transition_steps=100)

  def step_loss(step):
    per_tok, metrics = ppo_policy_loss(logp, old, adv, mask, clip_low=schedule(step))
    return aggregate(per_tok, mask), metrics["pg_clipfrac"]

  jitted = jax.jit(step_loss)
  clipfracs = []
  for step in (0, 25, 50, 100, 200):
    loss, clipfrac = jitted(jnp.asarray(step))
    eps = 0.2 - 0.15 * min(step, 100) / 100
    ref_loss, _ = ref_ppo(logp, old, adv, mask, lo=eps)
    assert_close(loss, ref_aggregate(ref_loss, mask, "token-mean"), atol=1e-5)
    clipfracs.append(float(clipfrac))
  assert jitted._cache_size() == 1
  assert clipfracs == sorted(clipfracs) and clipfracs[-1] > clipfracs[0]


# ------------------------------------------------------------------ other policy losses


def test_gspo_matches_numpy():
  logp, old, adv, mask = make_inputs(6, seq_adv=True, spread=0.3)
  for lo, hi in [(3e-4, 4e-4), (0.05, 0.1)]:
    loss, metrics = gspo_policy_loss(logp, old, adv, mask, clip_low=lo, clip_high=hi)
    assert_close(loss, ref_gspo(logp, old, adv, mask, lo, hi), atol=1e-5)
    assert set(metrics) == POLICY_METRICS
  # Upper clamp of the log sequence ratio (no lower clamp).
  big = jnp.full((1, 2), 30.0)
  loss, _ = gspo_policy_loss(big, jnp.zeros((1, 2)), jnp.array([-1.0]), jnp.ones((1, 2)))
  assert_close(loss, [[math.exp(10.0)] * 2], rtol=1e-5)


def test_gspo_token_gradient_equals_sequence_gradient():
  """The token form aggregated with seq-mean-token-mean has GSPO's sequence gradient."""
  logp, old, adv, mask = make_inputs(7, seq_adv=True, spread=0.02)
  lo, hi = 0.01, 0.012
  valid_rows = mask.sum(1) > 0

  def sequence_loss(lp):
    n = jnp.maximum(mask.sum(1), 1)
    s = jnp.exp(jnp.sum((lp - old) * mask, 1) / n)
    per_seq = jnp.maximum(-adv * s, -adv * jnp.clip(s, 1 - lo, 1 + hi))
    return jnp.sum(jnp.where(valid_rows, per_seq, 0.0)) / valid_rows.sum()

  def token_loss(lp):
    per_tok, _ = gspo_policy_loss(lp, old, adv, mask, clip_low=lo, clip_high=hi)
    return aggregate(per_tok, mask, "seq-mean-token-mean")

  lp = jnp.asarray(logp)
  assert_close(token_loss(lp), sequence_loss(lp), atol=1e-6)
  assert_close(jax.grad(token_loss)(lp), jax.grad(sequence_loss)(lp), atol=1e-6)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), lo=st.floats(1e-3, 0.3), hi=st.floats(1e-3, 0.3))
def test_gspo_equals_ppo_for_constant_token_ratios(seed, lo, hi):
  rng = np.random.default_rng(seed)
  logp, _, adv, mask = make_inputs(seed, seq_adv=True)
  shift = rng.normal(0, 0.3, (B, 1)).astype(np.float32)
  old = logp - shift  # every token of a row has log-ratio `shift`
  gspo, _ = gspo_policy_loss(logp, old, adv, mask, clip_low=lo, clip_high=hi)
  ppo, _ = ppo_policy_loss(logp, old, adv, mask, clip_low=lo, clip_high=hi)
  assert_close(gspo, ppo, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mode,lo,hi", [("trl", None, 5.0), ("trl", None, 1.5),
                                        ("verl", None, 0.28), ("verl", 0.2, 0.28)])
def test_cispo_matches_numpy(mode, lo, hi):
  logp, old, adv, mask = make_inputs(8, spread=1.5)
  loss, metrics = cispo_policy_loss(logp, old, adv, mask, clip_low=lo, clip_high=hi,
                                    mode=mode)
  assert_close(loss, ref_cispo(logp, old, adv, mask, lo, hi, mode), atol=1e-5)
  assert set(metrics) == POLICY_METRICS
  ratio = np.exp(np.clip(logp - old, -20, 20))
  weight = (np.minimum(ratio, hi) if mode == "trl"
            else np.clip(ratio, 0.0 if lo is None else 1 - lo, 1 + hi))
  assert_close(metrics["pg_clipfrac"], np_masked_mean(weight != ratio, mask), atol=1e-6)


def test_cispo_gradient_is_weighted_policy_gradient():
  logp, old, adv, mask = make_inputs(9, spread=1.5)
  ratio = np.exp(logp - old)
  for mode, weight in [("trl", np.minimum(ratio, 2.0)),
                       ("verl", np.clip(ratio, 0.8, 1.28))]:
    lo = None if mode == "trl" else 0.2
    hi = 2.0 if mode == "trl" else 0.28
    f = lambda lp, lo=lo, hi=hi, mode=mode: aggregate(
        cispo_policy_loss(lp, old, adv, mask, clip_low=lo, clip_high=hi, mode=mode)[0],
        mask)
    grad = jax.grad(f)(jnp.asarray(logp))
    # Every valid token keeps a gradient (no token is dropped by the clip).
    assert_close(grad, -weight * adv * mask / mask.sum(), atol=1e-6, rtol=1e-5)


def test_cispo_validation():
  logp, old, adv, mask = make_inputs(10)
  with pytest.raises(ValueError, match="clip_low"):
    cispo_policy_loss(logp, old, adv, mask, clip_low=0.2, mode="trl")
  with pytest.raises(ValueError, match="mode"):
    cispo_policy_loss(logp, old, adv, mask, mode="openrlhf")


@pytest.mark.parametrize("lo,hi", [(None, 5.0), (0.2, 0.28), (0.2, None)])
def test_cispo_conventions_are_two_functions_behind_the_selector(lo, hi):
  # cispo_policy_loss(mode=...) is exactly cispo_trl_policy_loss / cispo_verl_policy_loss.
  logp, old, adv, mask = make_inputs(12, spread=1.5)
  if lo is None:
    got = cispo_policy_loss(logp, old, adv, mask, clip_high=hi)
    want = losses.cispo_trl_policy_loss(logp, old, adv, mask, clip_high=hi)
    np.testing.assert_array_equal(got[0], want[0])
    assert {k: float(x) for k, x in got[1].items()} == {
        k: float(x) for k, x in want[1].items()}
  got = cispo_policy_loss(logp, old, adv, mask, clip_low=lo, clip_high=hi, mode="verl")
  want = losses.cispo_verl_policy_loss(logp, old, adv, mask, clip_low=lo, clip_high=hi)
  np.testing.assert_array_equal(got[0], want[0])
  assert {k: float(x) for k, x in got[1].items()} == {k: float(x) for k, x in want[1].items()}
  assert_close(got[0], ref_cispo(logp, old, adv, mask, lo, lo if hi is None else hi, "verl"),
               atol=1e-5)
  with pytest.raises(ValueError, match="clip_high"):
    losses.cispo_trl_policy_loss(logp, old, adv, mask, clip_high=None)
  with pytest.raises(ValueError, match="clip_high"):
    losses.cispo_verl_policy_loss(logp, old, adv, mask, clip_high=None)


def test_sapo_matches_numpy_and_on_policy_gradient():
  logp, old, adv, mask = make_inputs(11, spread=0.5)
  for tp, tn in [(1.0, 1.05), (2.0, 0.5)]:
    loss, metrics = sapo_policy_loss(logp, old, adv, mask, tau_pos=tp, tau_neg=tn)
    assert_close(loss, ref_sapo(logp, old, adv, mask, tp, tn), atol=1e-5)
    assert float(metrics["pg_clipfrac"]) == 0.0
  # On-policy (ratio 1) the gate has slope 1: plain policy gradient.
  f = lambda lp: aggregate(sapo_policy_loss(lp, jax.lax.stop_gradient(lp), adv, mask,
                                            tau_pos=2.0)[0], mask)
  grad = jax.grad(f)(jnp.asarray(logp))
  assert_close(grad, -adv * mask / mask.sum(), atol=1e-6)
  with pytest.raises(ValueError, match="tau_neg"):
    sapo_policy_loss(logp, old, adv, mask, tau_neg=0.0)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), lo=st.floats(0.05, 1.0), hi=st.floats(0.05, 1.0),
       seq_adv=st.booleans())
def test_gmpo_matches_numpy(seed, lo, hi, seq_adv):
  logp, old, adv, mask = make_inputs(seed, seq_adv=seq_adv, spread=0.8)
  loss, metrics = gmpo_policy_loss(logp, old, adv, mask, clip_low=lo, clip_high=hi)
  assert_close(loss, ref_gmpo(logp, old, adv, mask, lo, hi), atol=1e-5, rtol=1e-5)
  assert set(metrics) == POLICY_METRICS
  # seq-mean-token-sum of the per-token form is the mean GMPO sequence loss.
  rows, lengths = ref_gmpo_rows(logp, old, adv, mask, lo, hi)
  expected = rows[lengths > 0].mean() if np.any(lengths > 0) else 0.0
  assert_close(aggregate(loss, mask, "seq-mean-token-sum"), expected, atol=1e-5, rtol=1e-5)


def test_gmpo_gradient_matches_sequence_loss():
  logp, old, adv, mask = make_inputs(12, seq_adv=True, spread=0.3)
  nonempty = mask.sum(1) > 0

  def sequence_loss(lp):
    k = lp - old
    kc = jnp.clip(k, -0.4, 0.4)
    sgn = jnp.sign(adv)[:, None]
    ks = sgn * jnp.minimum(sgn * k, sgn * kc)
    n = jnp.maximum(mask.sum(1), 1)
    rows = -adv * jnp.exp(jnp.sum(ks * mask, 1) / n)
    return jnp.sum(jnp.where(nonempty, rows, 0.0)) / nonempty.sum()

  token = lambda lp: aggregate(gmpo_policy_loss(lp, old, adv, mask)[0], mask,
                               "seq-mean-token-sum")
  lp = jnp.asarray(logp)
  assert_close(token(lp), sequence_loss(lp), atol=1e-6)
  assert_close(jax.grad(token)(lp), jax.grad(sequence_loss)(lp), atol=1e-6)


def test_reinforce_matches_numpy_and_gradient():
  logp, old, adv, mask = make_inputs(13, spread=1.0)
  loss, metrics = reinforce_policy_loss(logp, adv, mask)
  assert_close(loss, ref_reinforce(logp, adv, mask), atol=1e-6)
  assert float(metrics["ratio_mean"]) == pytest.approx(1.0)
  for is_clip in (None, 2.0):
    loss, metrics = reinforce_policy_loss(logp, adv, mask, old_logp=old, is_clip=is_clip)
    assert_close(loss, ref_reinforce(logp, adv, mask, old, is_clip), atol=1e-5, rtol=1e-5)
  grad = jax.grad(lambda lp: aggregate(reinforce_policy_loss(lp, adv, mask)[0], mask,
                                       "token-sum"))(jnp.asarray(logp))
  assert_close(grad, -adv * mask)
  with pytest.raises(ValueError, match="old_logp"):
    reinforce_policy_loss(logp, adv, mask, is_clip=2.0)


# ------------------------------------------------------- shared behaviour of policy losses

POLICY_LOSSES = {
    "ppo": lambda lp, old, adv, m: ppo_policy_loss(lp, old, adv, m, clip_high=0.28,
                                                   dual_clip=3.0),
    "gspo": lambda lp, old, adv, m: gspo_policy_loss(lp, old, adv, m),
    "cispo_trl": lambda lp, old, adv, m: cispo_policy_loss(lp, old, adv, m),
    "cispo_verl": lambda lp, old, adv, m: cispo_policy_loss(lp, old, adv, m, clip_low=0.2,
                                                            clip_high=0.28, mode="verl"),
    "sapo": lambda lp, old, adv, m: sapo_policy_loss(lp, old, adv, m),
    "gmpo": lambda lp, old, adv, m: gmpo_policy_loss(lp, old, adv, m),
    "reinforce": lambda lp, old, adv, m: reinforce_policy_loss(lp, adv, m, old_logp=old,
                                                               is_clip=2.0),
}


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_masked_positions_do_not_matter(name):
  fn = POLICY_LOSSES[name]
  logp, old, adv, mask = make_inputs(14, spread=0.5)
  dirty = [x.copy() for x in (logp, old, adv)]
  holes = mask == 0
  for x, junk in zip(dirty, (np.nan, 1e30, -np.inf)):
    x[holes] = junk
  clean_loss, clean_metrics = fn(logp, old, adv, mask)
  dirty_loss, dirty_metrics = fn(*dirty, mask)
  assert_close(dirty_loss, clean_loss, atol=0, rtol=0)
  assert_close(dirty_metrics, clean_metrics, atol=0, rtol=0)
  assert np.all(np.asarray(dirty_loss)[holes] == 0)

  for mode in ("token-mean", "seq-mean-token-mean"):
    g = jax.grad(lambda lp, mode=mode: aggregate(fn(lp, dirty[1], dirty[2], mask)[0],
                                                 mask, mode))(jnp.asarray(dirty[0]))
    g = np.asarray(g)
    assert np.all(np.isfinite(g)), (name, mode)
    assert np.all(g[holes] == 0), (name, mode)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_policy_losses_bf16_jit_vmap(name):
  fn = POLICY_LOSSES[name]
  logp, old, adv, mask = make_inputs(15, spread=0.3)
  ref_loss, _ = fn(logp, old, adv, mask)
  bf16 = [jnp.asarray(x, jnp.bfloat16) for x in (logp, old, adv)]
  stack = [np.stack([x, x[::-1]]) for x in (logp, old, adv, mask)]

  @jax.jit
  def both(bf16, stack):  # one compilation for the bf16 call and the vmapped call
    return fn(*bf16, mask), jax.vmap(fn)(*stack)

  (loss, metrics), (vloss, vmetrics) = both(bf16, stack)
  assert loss.dtype == jnp.bfloat16
  assert all(m.dtype == jnp.float32 and m.shape == () for m in metrics.values())
  assert np.all(np.isfinite(np.asarray(loss, np.float32)))
  assert_close(np.asarray(loss, np.float32), ref_loss, atol=0.1, rtol=0.05)
  # vmap over a stack of batches == one (eager) call per batch.
  for i in range(2):
    one_loss, one_metrics = fn(*[s[i] for s in stack])
    assert_close(vloss[i], one_loss, atol=1e-6)
    assert_close({k: v[i] for k, v in vmetrics.items()}, one_metrics, atol=1e-6)


POLICY_COEFFS = {  # two sets of coefficient values per loss (traced: one compilation)
    "ppo": (ppo_policy_loss, {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0},
            {"clip_low": 0.05, "clip_high": 0.1, "dual_clip": 10.0}),
    "gspo": (gspo_policy_loss, {"clip_low": 3e-4, "clip_high": 4e-4},
             {"clip_low": 0.1, "clip_high": 0.2}),
    "cispo": (cispo_policy_loss, {"clip_high": 5.0}, {"clip_high": 1.5}),
    "sapo": (sapo_policy_loss, {"tau_pos": 1.0, "tau_neg": 1.05},
             {"tau_pos": 3.0, "tau_neg": 0.5}),
    "gmpo": (gmpo_policy_loss, {"clip_low": 0.4, "clip_high": 0.4},
             {"clip_low": 0.1, "clip_high": 0.7}),
    "reinforce": (lambda lp, old, adv, m, **kw: reinforce_policy_loss(lp, adv, m,
                                                                      old_logp=old, **kw),
                  {"is_clip": 2.0}, {"is_clip": 5.0}),
}


@pytest.mark.parametrize("name", sorted(POLICY_COEFFS))
def test_policy_losses_no_recompile_when_coefficients_change(name):
  fn, first, second = POLICY_COEFFS[name]
  logp, old, adv, mask = make_inputs(16)
  call = lambda coeffs: fn(logp, old, adv, mask, **coeffs)
  assert_no_recompile(call, (first,), (second,))


def test_small_hand_fixtures():
  one = jnp.ones((1, 2))
  # CISPO verl: weights clip(10, 0.8, 1.28) = 1.28 and clip(0.5, 0.8, 1.28) = 0.8.
  logp, old = jnp.log(jnp.array([[0.5, 0.1]])), jnp.log(jnp.array([[0.05, 0.2]]))
  loss, m = cispo_policy_loss(logp, old, jnp.array([1.0]), one, clip_low=0.2,
                              clip_high=0.28, mode="verl")
  assert_close(loss, [[-1.28 * math.log(0.5), -0.8 * math.log(0.1)]], atol=1e-6)
  assert float(m["pg_clipfrac"]) == 1.0
  # SAPO at ratio 2, A = 1, tau 1: -4 sigmoid(1).
  loss, _ = sapo_policy_loss(jnp.log(jnp.array([[2.0, 1.0]])), jnp.zeros((1, 2)),
                             jnp.array([1.0]), one)
  assert_close(loss, [[-4 / (1 + math.exp(-1.0)), -2.0]], atol=1e-6)
  # GMPO with A = -1: kappa* = max(kappa, clip) = [0.6, -0.4] -> rho = e^0.1, L_i = e^0.1.
  loss, m = gmpo_policy_loss(jnp.array([[0.6, -0.9]]), jnp.zeros((1, 2)),
                             jnp.array([-1.0]), one)
  assert_close(loss, [[math.exp(0.1) / 2] * 2], atol=1e-6)
  assert float(m["pg_clipfrac_lower"]) == 1.0 and float(m["pg_clipfrac"]) == 0.0
  # REINFORCE with truncated IS: w = min(e^1, 2) = 2 and e^-1.
  loss, m = reinforce_policy_loss(jnp.array([[-1.0, -2.0]]), jnp.array([1.0]), one,
                                  old_logp=jnp.array([[-2.0, -1.0]]), is_clip=2.0)
  assert_close(loss, [[2.0 * -1.0 * -1.0, math.exp(-1.0) * 2.0]], atol=1e-6)
  assert float(m["pg_clipfrac"]) == 0.5


@jax.jit
def _is_weighted_grads(logp, old, adv, mask, cap):
  cispo = lambda x: aggregate(cispo_policy_loss(x, old, adv, mask, clip_high=cap)[0], mask)
  rf = lambda x: aggregate(reinforce_policy_loss(x, adv, mask, old_logp=old,
                                                 is_clip=cap)[0], mask)
  return jax.grad(cispo)(logp), jax.grad(rf)(logp)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), cap=st.floats(1.01, 5.0), tau=st.floats(0.2, 3.0),
       clip=st.floats(0.05, 2.0))
def test_is_weighted_losses_properties(seed, cap, tau, clip):
  logp, old, adv, mask = make_inputs(seed, spread=1.0)
  # CISPO/REINFORCE gradients are -w A m / N with the truncated weight w.
  weight = np.minimum(np.exp(logp - old), cap)
  g_cispo, g_rf = _is_weighted_grads(logp, old, adv, mask, cap)
  expected = -weight * adv * mask / max(mask.sum(), 1)
  assert_close(g_cispo, expected, atol=1e-6, rtol=1e-4)
  assert_close(g_rf, expected, atol=1e-6, rtol=1e-4)
  # SAPO's gate is bounded by 4/tau, so |L| <= 4 |A| / tau.
  sapo, _ = sapo_policy_loss(logp, old, adv, mask, tau_pos=tau, tau_neg=tau)
  assert np.all(np.abs(np.asarray(sapo)) <= 4 * np.abs(adv) / tau + 1e-5)
  # Value loss: clipping never lowers the loss; a huge clip range is a no-op.
  values, ret = old, logp
  clipped, _ = value_loss(values, np.zeros_like(values), ret, mask, clip=clip)
  plain, _ = value_loss(values, None, ret, mask, clip=None)
  assert np.all(np.asarray(clipped) >= np.asarray(plain) - 1e-6)
  wide, metrics = value_loss(values, np.zeros_like(values), ret, mask, clip=1e6)
  assert_close(wide, plain, atol=1e-6)
  assert float(metrics["vf_clipfrac"]) == 0.0


def test_policy_loss_shape_errors():
  logp, old, adv, mask = make_inputs(16)
  with pytest.raises(ValueError, match="old_logp"):
    ppo_policy_loss(logp, old[:, :-1], adv, mask)
  with pytest.raises(ValueError, match="mask"):
    gspo_policy_loss(logp, old, adv, mask[:-1])
  with pytest.raises(ValueError, match="advantages"):
    ppo_policy_loss(logp, old, adv[:, :3], mask)
  with pytest.raises(ValueError, match="advantages"):
    sapo_policy_loss(logp, old, adv[:-1, 0], mask)
  with pytest.raises(ValueError, match="advantages"):
    gmpo_policy_loss(logp, old, adv[..., None], mask)
  with pytest.raises(ValueError, match="logp"):
    cispo_policy_loss(logp[0], old[0], adv[0], mask[0])
  with pytest.raises(ValueError, match="logp"):
    reinforce_policy_loss(logp.astype(np.int32), adv, mask)


# -------------------------------------------------------------------------- value loss


def test_value_loss_fixture_and_numpy():
  loss, metrics = value_loss(jnp.ones((1, 1)), jnp.zeros((1, 1)), jnp.full((1, 1), 2.0),
                             jnp.ones((1, 1)), clip=0.5)
  assert float(loss[0, 0]) == 1.125 and float(metrics["vf_clipfrac"]) == 1.0

  rng = np.random.default_rng(17)
  mask = random_mask(rng, B, T)
  values, old, ret = (rng.standard_normal((3, B, T)).astype(np.float32))
  for clip in (0.2, 0.5, None):
    loss, metrics = value_loss(values, old if clip else None, ret, mask, clip=clip)
    ref_loss, ref_frac = ref_value(values, old, ret, mask, clip)
    assert_close(loss, ref_loss, atol=1e-6)
    assert_close(metrics["vf_clipfrac"], ref_frac, atol=1e-6)


def test_value_loss_masking_grad_dtype_and_errors():
  rng = np.random.default_rng(18)
  mask = random_mask(rng, B, T)
  values, old, ret = (rng.standard_normal((3, B, T)).astype(np.float32))
  dirty = values.copy()
  dirty[mask == 0] = np.nan
  f = lambda v: aggregate(value_loss(v, old, ret, mask, clip=10.0)[0], mask, "token-sum")
  grad = np.asarray(jax.grad(f)(jnp.asarray(dirty)))
  assert_close(grad, (values - ret) * mask, atol=1e-6)  # unclipped: d/dv 0.5 (v-R)^2
  loss, _ = value_loss(jnp.asarray(values, jnp.bfloat16), old, ret, mask)
  assert loss.dtype == jnp.bfloat16
  assert_no_recompile(lambda c: value_loss(values, old, ret, mask, clip=c), (0.2,), (0.5,))
  with pytest.raises(ValueError, match="old_values"):
    value_loss(values, None, ret, mask, clip=0.5)
  with pytest.raises(ValueError, match="returns"):
    value_loss(values, old, ret[:, :2], mask)
  with pytest.raises(ValueError, match="old_values"):
    value_loss(values, old[:2], ret, mask)


# ----------------------------------------------------------------------------------- KL


@pytest.mark.parametrize("kind,first,second", [
    ("k1", 1.0, -1.0), ("kl", 1.0, -1.0), ("k2", 0.5, 0.5), ("mse", 0.5, 0.5),
    ("k3", 0.367879, 0.718282), ("low_var_kl", 0.367879, 0.718282), ("abs", 1.0, 1.0),
    ("k1+", 1.0, -1.0), ("k3+", 0.367879, 0.718282)])
def test_kl_fixtures(kind, first, second):
  out = kl_penalty(jnp.array([-1.0, -2.0]), jnp.array([-2.0, -1.0]), kind)
  assert_close(out, [first, second], atol=1e-6)


@pytest.mark.parametrize("kind", losses.KL_KINDS)
def test_kl_matches_numpy_and_plus_gradient(kind):
  rng = np.random.default_rng(19)
  logp = -rng.exponential(1.0, (B, T)).astype(np.float32)
  ref = (logp + rng.normal(0, 2.0, (B, T))).astype(np.float32)
  for clamp in (None, 1.0):
    assert_close(kl_penalty(logp, ref, kind, clamp=clamp), ref_kl(logp, ref, kind, clamp),
                 atol=1e-5, rtol=1e-5)
  if kind.endswith("+"):
    grad_lp, grad_ref = jax.grad(lambda a, b: jnp.sum(kl_penalty(a, b, kind)),
                                 argnums=(0, 1))(jnp.asarray(logp), jnp.asarray(ref))
    assert_close(grad_lp, logp - ref, atol=1e-5)  # gradient of k2 = 0.5 x^2
    assert_close(grad_ref, ref - logp, atol=1e-5)


def _kl_probe_points():
  """float32 log-ratios that stress k3: random ones (200 fixed seeds), every float32
  within 4096 ulps of 0 on both sides, and a dense grid of small values (where
  exp(y) - y - 1 used to round to -5.96e-08)."""
  rng = np.random.default_rng(1234)
  parts = [rng.uniform(-30.0, 30.0, 200 * T), rng.normal(0.0, 1e-3, 200 * T),
           np.linspace(-1e-2, 1e-2, 200_001), np.linspace(-1.0, 1.0, 200_001)]
  tiny = np.arange(0, 4096, dtype=np.int32).view(np.float32)
  parts += [tiny, -tiny]
  return np.concatenate([np.asarray(p, np.float32) for p in parts])


_KL_NONNEG_KINDS = ("k2", "k3", "abs", "k2+", "k3+", "abs+")


@jax.jit
def _kl_nonneg(x):
  return {kind: kl_penalty(x, jnp.zeros_like(x), kind) for kind in _KL_NONNEG_KINDS}


def test_kl_estimators_nonnegative_and_finite():
  """k3 = expm1(-x) + x is never below 0 in float32 (the old exp form gave -5.96e-08)."""
  x = _kl_probe_points()
  for kind, out in _kl_nonneg(x).items():
    out = np.asarray(out)
    assert np.all(np.isfinite(out)), kind
    assert np.all(out >= 0), (kind, x[out < 0][:5], out[out < 0][:5])
  # The textbook form does go negative on these points: the probe exercises the bug.
  y = np.clip(-x, -20, 20)
  old = np.asarray(jnp.exp(y) - y - 1.0)
  assert np.any(old < 0)
  # k3 at exactly 0 is exactly 0, and matches the float64 value elsewhere (to the
  # float32 cancellation error of expm1(y) - y, about ulp(y)).
  k3 = np.asarray(_kl_nonneg(x)["k3"], np.float64)
  assert k3[x == 0].max() == 0.0
  y64 = np.clip(-x.astype(np.float64), -20, 20)
  assert_close(k3, np.expm1(y64) - y64, rtol=2e-6, atol=5e-8)


def test_kl_mask_clamp_dtype_and_errors():
  rng = np.random.default_rng(20)
  mask = random_mask(rng, B, T)
  logp = -rng.exponential(1.0, (B, T)).astype(np.float32)
  ref = logp + 0.5
  dirty = logp.copy()
  dirty[mask == 0] = np.nan
  out = kl_penalty(dirty, ref, "k3+", mask=mask)
  assert_close(out, ref_kl(logp, ref, "k3") * mask, atol=1e-6)
  grad = jax.grad(lambda a: jnp.sum(kl_penalty(a, ref, "k3", mask=mask)))(jnp.asarray(dirty))
  assert np.all(np.isfinite(grad)) and np.all(np.asarray(grad)[mask == 0] == 0)
  # Extreme log-ratios stay finite (k3's exponent is clipped to +-20).
  assert np.all(np.isfinite(kl_penalty(jnp.array([-500.0]), jnp.array([0.0]), "k3")))
  assert kl_penalty(jnp.asarray(logp, jnp.bfloat16), ref, "k2").dtype == jnp.bfloat16
  assert_no_recompile(lambda c: kl_penalty(logp, ref, "k3", clamp=c), (10.0,), (0.1,))
  with pytest.raises(ValueError, match="kind"):
    kl_penalty(logp, ref, "k4")
  with pytest.raises(ValueError, match="ref_logp"):
    kl_penalty(logp, ref[:, :2], "k1")
  with pytest.raises(ValueError, match="mask"):
    kl_penalty(logp, ref, "k1", mask=mask[:2])


# ------------------------------------------------------------------------------ entropy

# Jitted: each test uses new shapes, and one compiled program beats per-op kernels.
_entropy = jax.jit(entropy_from_logits)


def test_entropy_matches_numpy_and_bounds():
  rng = np.random.default_rng(21)
  logits = rng.normal(0, 3.0, (3, 4, 11)).astype(np.float32)
  out = _entropy(logits)
  assert out.shape == (3, 4) and out.dtype == jnp.float32
  assert_close(out, ref_entropy(logits), atol=1e-5)
  assert np.all(out >= 0) and np.all(out <= math.log(11) + 1e-5)
  assert_close(_entropy(jnp.zeros((2, 16))), [math.log(16)] * 2, atol=1e-6)
  bf = _entropy(jnp.asarray(logits, jnp.bfloat16))
  assert bf.dtype == jnp.float32 and np.all(np.isfinite(bf))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(0.01, 100.0),
       shift=st.floats(-1e3, 1e3))
def test_entropy_properties(seed, scale, shift):
  logits = np.random.default_rng(seed).standard_normal((4, 9)).astype(np.float32) * scale
  out = np.asarray(_entropy(logits))
  assert np.all(out >= -1e-6) and np.all(out <= math.log(9) + 1e-5)
  assert_close(_entropy(logits + np.float32(shift)), out, atol=2e-3)
  assert_close(out, ref_entropy(logits), atol=1e-4)


def test_entropy_huge_and_infinite_logits():
  inf = np.inf
  z = [0.3, -1.2, 2.0, 0.0]
  logits = jnp.array([
      [1e30, 1e30, 0.0, -inf],           # huge: ln 2
      [3e38, -3e38, 3e38, -inf],         # near float32 max: ln 2
      [5e4, 5e4 - 1.0, -1e4, -inf],      # two-point distribution
      [0.0, 0.0, -inf, -inf],            # banned tokens: ln 2
      [-inf, -inf, -inf, -inf],          # nothing allowed: 0
      z,
      [x + 1e4 for x in z],              # shift invariance
  ])
  out = _entropy(logits)
  p = np.array([1.0, math.exp(-1.0)]) / (1 + math.exp(-1.0))
  two_point = -np.sum(p * np.log(p))
  ln2 = math.log(2)
  assert_close(out[:5], [ln2, ln2, two_point, ln2, 0.0], atol=1e-6)
  assert_close(out[5], ref_entropy(np.array(z)), atol=1e-6)
  assert_close(out[6], out[5], atol=1e-3)
  # Finite gradients everywhere; analytic dH/dz = -p (log p - sum p log p) on a row.
  grad = np.asarray(jax.jit(jax.grad(lambda x: jnp.sum(_entropy(x))))(logits), np.float64)
  assert np.all(np.isfinite(grad))
  probs = np.asarray(jax.nn.softmax(jnp.array(z)), np.float64)
  logp = np.log(probs)
  assert_close(grad[5], -probs * (logp - np.sum(probs * logp)), atol=1e-6)
  with pytest.raises(ValueError, match="logits"):
    entropy_from_logits(jnp.ones((3,), jnp.int32))


# -------------------------------------------------------------------------- aggregation

FIX_LOSS = np.array([[1., 2., 3., 0.], [4., 0., 0., 0.]], np.float32)
FIX_MASK = np.array([[1., 1., 1., 0.], [1., 0., 0., 0.]], np.float32)


@pytest.mark.parametrize("mode,expected", [
    ("token-mean", 2.5), ("token-sum", 10.0), ("seq-mean-token-sum", 5.0),
    ("seq-mean-token-mean", 3.0), ("seq-mean-token-sum-norm", 1.25)])
def test_aggregate_fixture(mode, expected):
  assert float(aggregate(FIX_LOSS, FIX_MASK, mode)) == expected
  # An empty third row changes nothing (excluded from the sequence count).
  loss = np.concatenate([FIX_LOSS, np.full((1, 4), np.nan, np.float32)])
  mask = np.concatenate([FIX_MASK, np.zeros((1, 4), np.float32)])
  assert float(aggregate(loss, mask, mode, norm_length=4)) == expected
  assert float(aggregate(FIX_LOSS, np.zeros_like(FIX_MASK), mode)) == 0.0


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), shape=st.sampled_from([(B, T), (1, 3)]),
       norm=st.one_of(st.none(), st.floats(1.0, 100.0)))
def test_aggregate_matches_numpy(seed, shape, norm):
  batch, time = shape
  rng = np.random.default_rng(seed)
  mask = random_mask(rng, batch, time)
  loss = rng.standard_normal((batch, time)).astype(np.float32)
  for mode in AGGREGATION_MODES:
    assert_close(aggregate(loss, mask, mode, norm_length=norm),
                 ref_aggregate(loss, mask, mode, norm), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_aggregate_parts_sum_over_microbatches(mode):
  rng = np.random.default_rng(22)
  batch, time = 12, 9
  mask = random_mask(rng, batch, time)
  mask[3] = 0.0  # another empty row, in a different microbatch
  loss = rng.standard_normal((batch, time)).astype(np.float32)
  full = aggregate(loss, mask, mode)
  total, denom = aggregate_parts(loss, mask, mode)
  assert_close(total / jnp.maximum(denom, 1.0), full, atol=0, rtol=0)

  # 4 microbatches of 3 rows: sum the parts, then divide once.
  parts = [aggregate_parts(loss[i:i + 3], mask[i:i + 3], mode) for i in range(0, 12, 3)]
  sums = sum(p[0] for p in parts)
  denoms = sum(p[1] for p in parts)
  assert_close(sums / jnp.maximum(denoms, 1.0), full, atol=1e-6, rtol=1e-6)

  # Same with a psum over a named axis (how devices would reduce it).
  def on_device(l, m):
    t, d = aggregate_parts(l, m, mode)
    return jax.lax.psum(t, "dev") / jnp.maximum(jax.lax.psum(d, "dev"), 1.0)

  shards = jax.jit(jax.vmap(on_device, axis_name="dev"))(loss.reshape(4, 3, time),
                                                         mask.reshape(4, 3, time))
  assert_close(shards, [full] * 4, atol=1e-6, rtol=1e-6)

  # Integer-valued losses: the sum over microbatches is bit-exact for token modes.
  ints = rng.integers(-5, 6, (batch, time)).astype(np.float32)
  if mode in ("token-mean", "token-sum", "seq-mean-token-sum"):
    parts = [aggregate_parts(ints[i:i + 3], mask[i:i + 3], mode) for i in range(0, 12, 3)]
    combined = sum(p[0] for p in parts) / jnp.maximum(sum(p[1] for p in parts), 1.0)
    assert float(combined) == float(aggregate(ints, mask, mode))


def test_aggregate_grad_jit_no_recompile_and_errors():
  rng = np.random.default_rng(23)
  mask = random_mask(rng, B, T)
  loss = rng.standard_normal((B, T)).astype(np.float32)
  grad = jax.grad(lambda l: aggregate(l, mask, "seq-mean-token-mean"))(jnp.asarray(loss))
  lengths = mask.sum(1, keepdims=True)
  rows = (lengths[:, 0] > 0).sum()
  assert_close(grad, mask / np.maximum(lengths, 1) / rows, atol=1e-7)
  assert_no_recompile(lambda n: aggregate(loss, mask, "seq-mean-token-sum-norm",
                                          norm_length=n), (4.0,), (100.0,))
  assert aggregate(jnp.asarray(loss, jnp.bfloat16), mask).dtype == jnp.float32
  with pytest.raises(ValueError, match="token-mean"):  # the message lists the modes
    aggregate(loss, mask, "sequence-mean")
  with pytest.raises(ValueError, match="mask"):
    aggregate(loss, mask[:, :2])
  with pytest.raises(ValueError, match="per_token"):
    aggregate(loss[0], mask[0])
  with pytest.raises(ValueError, match="norm_length"):
    aggregate(loss, mask, "seq-mean-token-sum-norm", norm_length=0)


def test_doctests():
  # The package docstring and every topic module (the functions live in the modules).
  attempted = 0
  for module in (losses, losses.policy, losses.value, losses.divergence,
                 losses.aggregation, losses.correction):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, module.__name__
    attempted += result.attempted
  assert attempted > 5


# ---------------------------------------------------------- GSPO dual clip, uniform clips


def test_gspo_dual_clip_matches_numpy_and_ppo():
  logp, old, adv, mask = make_inputs(32, seq_adv=True, spread=1.5)
  for lo, hi, c in [(3e-4, 4e-4, 3.0), (0.05, 0.1, 1.5)]:
    loss, m = gspo_policy_loss(logp, old, adv, mask, clip_low=lo, clip_high=hi,
                               dual_clip=c)
    # Reference: the sequence ratio per row, then PPO's rule per token.
    ref = np.zeros(mask.shape)
    lower = np.zeros(mask.shape)
    for b in range(B):
      n = int(mask[b].sum())
      s = math.exp(min(sum(float(logp[b, t]) - float(old[b, t]) for t in range(T)
                           if mask[b, t]) / max(n, 1), 10.0))
      a = float(adv[b])
      lc = max(-a * s, -a * min(max(s, 1 - lo), 1 + hi))
      for t in range(T):
        if mask[b, t]:
          ref[b, t] = min(lc, -a * c) if a < 0 else lc
          lower[b, t] = a < 0 and lc > -a * c
    assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    assert_close(m["pg_clipfrac_lower"], np_masked_mean(lower, mask), atol=1e-6)
  assert float(m["pg_clipfrac_lower"]) > 0  # the second setting exercises the clip
  # Constant token ratios: GSPO with dual clip is PPO with dual clip.
  shift = np.random.default_rng(31).normal(0, 1.0, (B, 1)).astype(np.float32)
  gspo, _ = gspo_policy_loss(logp, logp - shift, adv, mask, clip_low=0.1, clip_high=None,
                             dual_clip=2.0)
  ppo, _ = ppo_policy_loss(logp, logp - shift, adv, mask, clip_low=0.1, dual_clip=2.0)
  assert_close(gspo, ppo, atol=1e-5, rtol=1e-5)
  # Where the dual clip binds the loss is the constant -A c: zero gradient there.
  g = jax.grad(lambda lp: aggregate(gspo_policy_loss(lp, old, adv, mask, clip_low=0.05,
                                                     clip_high=0.1, dual_clip=1.5)[0],
                                    mask, "seq-mean-token-mean"))(jnp.asarray(logp))
  assert np.all(np.asarray(g)[lower > 0] == 0)
  assert_no_recompile(lambda c: gspo_policy_loss(logp, old, adv, mask, dual_clip=c),
                      (3.0,), (10.0,))


def test_clip_high_none_means_symmetric():
  logp, old, adv, mask = make_inputs(32, seq_adv=True, spread=0.8)
  cispo_verl = functools.partial(cispo_policy_loss, mode="verl")
  for fn, eps in [(ppo_policy_loss, 0.2), (gspo_policy_loss, 0.01), (gmpo_policy_loss, 0.3),
                  (cispo_verl, 0.2)]:
    sym, _ = fn(logp, old, adv, mask, clip_low=eps, clip_high=None)
    both, _ = fn(logp, old, adv, mask, clip_low=eps, clip_high=eps)
    assert_close(sym, both, atol=0, rtol=0)
  for kwargs in ({"clip_high": None}, {"clip_high": None, "mode": "verl"}):
    with pytest.raises(ValueError, match="clip_high"):
      cispo_policy_loss(logp, old, adv, mask, **kwargs)


# ------------------------------------------------------------------------ range checks

_LP, _OLD, _ADV, _MASK = make_inputs(33)
RANGE_ERRORS = [  # (argument named in the message, call)
    ("clip_low", lambda: ppo_policy_loss(_LP, _OLD, _ADV, _MASK, clip_low=-0.2)),
    ("clip_high", lambda: ppo_policy_loss(_LP, _OLD, _ADV, _MASK, clip_high=-0.1)),
    ("clip_low", lambda: ppo_policy_loss(_LP, _OLD, _ADV, _MASK, clip_low=float("nan"))),
    ("log_ratio_clamp", lambda: ppo_policy_loss(_LP, _OLD, _ADV, _MASK, log_ratio_clamp=0)),
    ("clip_low", lambda: gspo_policy_loss(_LP, _OLD, _ADV, _MASK, clip_low=-3e-4)),
    ("clip_high", lambda: gspo_policy_loss(_LP, _OLD, _ADV, _MASK, clip_high=-1.0)),
    ("dual_clip", lambda: gspo_policy_loss(_LP, _OLD, _ADV, _MASK, dual_clip=0.5)),
    ("log_ratio_clamp", lambda: gspo_policy_loss(_LP, _OLD, _ADV, _MASK,
                                                 log_ratio_clamp=-1.0)),
    ("clip_low", lambda: gmpo_policy_loss(_LP, _OLD, _ADV, _MASK, clip_low=-0.4)),
    ("clip_high", lambda: gmpo_policy_loss(_LP, _OLD, _ADV, _MASK, clip_high=-0.4)),
    ("clip_high", lambda: cispo_policy_loss(_LP, _OLD, _ADV, _MASK, clip_high=0.0)),
    ("clip_low", lambda: cispo_policy_loss(_LP, _OLD, _ADV, _MASK, clip_low=-0.2,
                                           mode="verl")),
    ("clip_high", lambda: cispo_policy_loss(_LP, _OLD, _ADV, _MASK, clip_high=-0.1,
                                            mode="verl")),
    ("tau_pos", lambda: sapo_policy_loss(_LP, _OLD, _ADV, _MASK, tau_pos=-1.0)),
    ("log_ratio_clamp", lambda: sapo_policy_loss(_LP, _OLD, _ADV, _MASK,
                                                 log_ratio_clamp=0.0)),
    ("is_clip", lambda: reinforce_policy_loss(_LP, _ADV, _MASK, old_logp=_OLD,
                                              is_clip=-1)),
    ("is_clip", lambda: reinforce_policy_loss(_LP, _ADV, _MASK, old_logp=_OLD,
                                              is_clip=0.0)),
    ("clip", lambda: value_loss(_LP, _OLD, _ADV, _MASK, clip=-0.5)),
    ("clamp", lambda: kl_penalty(_LP, _OLD, "k3", clamp=-1)),
    ("clamp", lambda: kl_penalty(_LP, _OLD, "k1+", clamp=0.0)),
    ("norm_length", lambda: aggregate(_LP, _MASK, "seq-mean-token-sum-norm",
                                      norm_length=-3)),
    ("threshold", lambda: rollout_correction_weights(_LP, _MASK, threshold=0.0)),
    ("threshold", lambda: rollout_correction_weights(_LP, _MASK, threshold=-2)),
    ("lower", lambda: rollout_correction_weights(_LP, _MASK, lower=-0.1)),
    ("lower", lambda: rollout_correction_weights(_LP, _MASK, threshold=2.0, lower=3.0)),
    ("level", lambda: rollout_correction_weights(_LP, _MASK, level="batch")),
    ("mask", lambda: rollout_correction_weights(_LP, _MASK[:, :2])),
    ("log_ratio", lambda: rollout_correction_weights(_LP[0], _MASK[0])),
    ("log_ratio", lambda: rollout_correction_weights(_LP.astype(np.int32), _MASK)),
]


@pytest.mark.parametrize("name,call", RANGE_ERRORS,
                         ids=[f"{i}-{n}" for i, (n, _) in enumerate(RANGE_ERRORS)])
def test_out_of_range_numbers_raise_naming_the_argument(name, call):
  with pytest.raises(ValueError, match=f"`{name}`"):
    call()


def test_range_checks_skip_traced_values_and_accept_boundaries():
  # Traced coefficients cannot be checked (data cannot raise under jit): finite output.
  loss, _ = jax.jit(lambda lo: ppo_policy_loss(_LP, _OLD, _ADV, _MASK, clip_low=lo))(-0.2)
  assert np.all(np.isfinite(loss))
  w, _ = jax.jit(lambda lo: rollout_correction_weights(_LP - _OLD, _MASK, lower=lo))(5.0)
  assert np.all(np.isfinite(w))
  # Boundary values are allowed: zero clip ranges, lower == threshold, numpy scalars.
  ppo_policy_loss(_LP, _OLD, _ADV, _MASK, clip_low=0.0, clip_high=np.float32(0.0))
  gmpo_policy_loss(_LP, _OLD, _ADV, _MASK, clip_low=0, clip_high=0)
  value_loss(_LP, _OLD, _ADV, _MASK, clip=0.0)
  rollout_correction_weights(_LP - _OLD, _MASK, threshold=1.0, lower=1.0)


# ------------------------------------------------------------------ rollout correction


def ref_rollout(log_ratio, mask, level, threshold, lower):
  """The verl rule in plain Python (float64): weights and metrics."""
  w = np.zeros(mask.shape)
  rho = np.zeros(mask.shape)
  for b in range(mask.shape[0]):
    seq = sum(float(log_ratio[b, t]) for t in range(mask.shape[1]) if mask[b, t])
    for t in range(mask.shape[1]):
      if not mask[b, t]:
        continue
      ell = seq if level == "sequence" else float(log_ratio[b, t])
      r = math.exp(min(max(ell, -20.0), 20.0))
      rho[b, t] = r
      if lower is None:
        w[b, t] = min(r, threshold)
      else:
        w[b, t] = r if lower <= r <= threshold else 0.0
  valid = mask > 0
  n = valid.sum()
  metrics = {
      "rollout_is_mean": np_masked_mean(w, mask),
      "rollout_is_max": float(rho[valid].max()) if n else 0.0,
      "rollout_is_clipfrac": np_masked_mean((w != rho).astype(float), mask),
      "rollout_mismatch_kl": np_masked_mean(np.where(mask > 0, np.expm1(np.clip(
          log_ratio.astype(np.float64), -20, 20)) - np.clip(log_ratio, -20, 20), 0.0), mask),
      "rollout_is_ess": (float(w.sum() ** 2 / (n * np.square(w).sum()))
                         if np.square(w).sum() > 0 else 0.0),
  }
  return w, metrics


def make_log_ratio(seed, batch=B, time=T, scale=0.8):
  rng = np.random.default_rng(seed)
  mask = random_mask(rng, batch, time)
  return (scale * rng.standard_normal((batch, time))).astype(np.float32), mask


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold,lower", [(2.0, None), (5.0, None), (2.0, 0.5),
                                             (5.0, 0.5), (1.5, 0.9)])
def test_rollout_correction_matches_numpy(level, threshold, lower):
  for seed in (40, 41, 42):
    log_ratio, mask = make_log_ratio(seed)
    w, m = rollout_correction_weights(log_ratio, mask, level=level, threshold=threshold,
                                      lower=lower)
    ref_w, ref_m = ref_rollout(log_ratio, mask, level, threshold, lower)
    assert w.shape == (B, T) and w.dtype == jnp.float32
    assert_close(w, ref_w, atol=1e-6, rtol=1e-5)
    assert set(m) == set(ref_m)
    assert_close(m, ref_m, atol=1e-6, rtol=1e-5)
    assert np.all(np.asarray(w)[mask == 0] == 0)
    if level == "sequence":  # one weight per row
      for b in range(B):
        row = np.asarray(w)[b][mask[b] > 0]
        assert np.all(row == row[:1])


def test_rollout_correction_hand_fixture_and_clamp():
  lr = jnp.log(jnp.array([[1.0, 3.0, 0.25, 0.5]]))
  mask = jnp.array([[1.0, 1.0, 1.0, 0.0]])
  w, m = rollout_correction_weights(lr, mask)
  assert_close(w, [[1.0, 2.0, 0.25, 0.0]], atol=1e-6)
  assert_close(m, {"rollout_is_mean": 3.25 / 3, "rollout_is_max": 3.0,
                   "rollout_is_clipfrac": 1 / 3,
                   "rollout_mismatch_kl": (0.0 + (2 - math.log(3)) + (-0.75 - math.log(0.25))) / 3,
                   "rollout_is_ess": 3.25**2 / (3 * (1 + 4 + 0.0625))}, atol=1e-6)
  w, _ = rollout_correction_weights(lr, mask, lower=0.25)  # both ends are inclusive
  assert_close(w, [[1.0, 0.0, 0.25, 0.0]], atol=1e-6)
  w, _ = rollout_correction_weights(lr, mask, level="sequence", lower=0.5)
  assert_close(w, [[0.75, 0.75, 0.75, 0.0]], atol=1e-6)
  # Log-ratios are clamped at +-20 (verl's SAFETY_BOUND), sequence sums included.
  big = jnp.array([[30.0, 30.0], [-30.0, -30.0]])
  w, m = rollout_correction_weights(big, jnp.ones((2, 2)), threshold=1e9)
  assert_close(w, [[math.exp(20)] * 2, [math.exp(-20)] * 2], rtol=1e-5, atol=0)
  assert_close(m["rollout_is_max"], math.exp(20), rtol=1e-5)
  w, _ = rollout_correction_weights(big, jnp.ones((2, 2)), level="sequence",
                                    threshold=1e9)
  assert_close(w, [[math.exp(20)] * 2, [math.exp(-20)] * 2], rtol=1e-5, atol=0)
  # All-masked batch: zero weights and zero metrics, no NaN.
  w, m = rollout_correction_weights(big, jnp.zeros((2, 2)))
  assert np.all(np.asarray(w) == 0)
  assert all(float(x) == 0.0 for x in m.values())


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_correction_exactly_one_when_policies_agree(level):
  rng = np.random.default_rng(43)
  mask = random_mask(rng, B, T)
  logp = -rng.exponential(2.0, (B, T)).astype(np.float32)
  for lower in (None, 0.5, 1.0):
    w, m = rollout_correction_weights(jnp.asarray(logp) - jnp.asarray(logp), mask,
                                      level=level, lower=lower)
    assert np.all(np.asarray(w) == mask)  # exactly 1 on valid tokens, 0 elsewhere
    assert float(m["rollout_is_clipfrac"]) == 0.0
    assert float(m["rollout_is_ess"]) == pytest.approx(1.0, abs=1e-6)


def test_rollout_correction_nan_fault_stop_gradient_dtype():
  log_ratio, mask = make_log_ratio(44)
  bad = log_ratio.copy()
  b, t = np.argwhere(mask > 0)[0]
  bad[b, t] = np.nan
  w, m = rollout_correction_weights(bad, mask)
  w = np.asarray(w)
  assert np.all(np.isfinite(w)) and w[b, t] == 0  # NaN at a valid token: weight 0
  assert all(np.isfinite(float(x)) for x in m.values())
  w_seq, _ = rollout_correction_weights(bad, mask, level="sequence")
  assert np.all(np.asarray(w_seq)[b] == 0)  # ... on its whole row at sequence level
  # Stop-gradient: no gradient flows into the log-ratio.
  for level in ("token", "sequence"):
    g = jax.grad(lambda x, lvl=level: jnp.sum(
        rollout_correction_weights(x, mask, level=lvl)[0] * x))(jnp.asarray(log_ratio))
    assert_close(g, np.asarray(rollout_correction_weights(log_ratio, mask,
                                                          level=level)[0]), atol=0, rtol=0)
  w_bf, m_bf = rollout_correction_weights(jnp.asarray(log_ratio, jnp.bfloat16), mask)
  assert w_bf.dtype == jnp.bfloat16
  assert all(x.dtype == jnp.float32 and x.shape == () for x in m_bf.values())


def _rollout_traced(log_ratio, mask, threshold, lower, *, level):
  return rollout_correction_weights(log_ratio, mask, level=level, threshold=threshold,
                                    lower=lower)


def test_rollout_correction_jit_vmap_no_recompile():
  log_ratio, mask = make_log_ratio(45)
  stack = np.stack([log_ratio, log_ratio[::-1] * 2]), np.stack([mask, mask[::-1]])
  for level in ("token", "sequence"):
    fn = functools.partial(_rollout_traced, level=level)
    out = jax.jit(jax.vmap(fn, in_axes=(0, 0, None, None)))(*stack, 2.0, 0.5)
    for i in range(2):
      w, m = fn(stack[0][i], stack[1][i], 2.0, 0.5)
      assert_close(out[0][i], w, atol=0, rtol=0)
      assert_close({k: v[i] for k, v in out[1].items()}, m, atol=1e-7)
    assert_no_recompile(functools.partial(fn, log_ratio, mask), (2.0, 0.5),
                        (5.0, 0.2), (1.5, 1.0))
    assert_no_recompile(functools.partial(fn, log_ratio, mask, lower=None),
                        (2.0,), (3.0,))


# ------------------------------------------- masked inputs never matter (NaN, inf, huge)

def _policy_tok(f, a, b, c, cs, m):
  return f(a, b, c, m)


def _policy_seq(f, a, b, c, cs, m):
  return f(a, b, cs, m)


def _kl(kind, a, b, c, cs, m):
  return kl_penalty(a, b, kind, clamp=10.0, mask=m)


def _agg(mode, a, b, c, cs, m):
  return aggregate(a, m, mode), aggregate_parts(a, m, mode)


def _is_weights(level, lower, a, b, c, cs, m):
  return rollout_correction_weights(a - b, m, level=level, lower=lower)


ESTIMATORS = {
    # name: fn(a, b, c, c_seq, mask) -> pytree; a, b, c are [B, T], c_seq is [B].
    **{f"policy_{k}_tok": functools.partial(_policy_tok, f)
       for k, f in POLICY_LOSSES.items()},
    **{f"policy_{k}_seq": functools.partial(_policy_seq, f)
       for k, f in POLICY_LOSSES.items()},
    "gspo_dual": lambda a, b, c, cs, m: gspo_policy_loss(a, b, cs, m, clip_low=0.05,
                                                         dual_clip=2.0),
    "value_clip": lambda a, b, c, cs, m: value_loss(a, b, c, m, clip=0.2),
    "value_plain": lambda a, b, c, cs, m: value_loss(a, None, c, m, clip=None),
    **{f"kl_{k}": functools.partial(_kl, k) for k in KL_KINDS},
    **{f"agg_{k}": functools.partial(_agg, k) for k in AGGREGATION_MODES},
    **{f"is_{lvl}_{lo}": functools.partial(_is_weights, lvl, lo)
       for lvl in ("token", "sequence") for lo in (None, 0.5)},
}


def _first_output(out):
  return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_masked_junk_changes_no_output(name):
  """NaN/inf/huge values at masked positions (and in [B] inputs of empty rows) leave
  every output, metric and gradient bit-identical to the clean call."""
  fn = ESTIMATORS[name]
  for seed in (50, 51):
    logp, old, adv, mask = make_inputs(seed, spread=0.6)
    adv_seq = np.random.default_rng(seed).standard_normal(B).astype(np.float32)
    holes, empty = mask == 0, mask.sum(1) == 0
    assert holes.any() and empty.any()
    clean = fn(logp, old, adv, adv_seq, mask)

    def grad(first, *rest):
      return np.asarray(jax.grad(lambda z: jnp.sum(_first_output(fn(z, *rest))))(
          jnp.asarray(first)))

    clean_grad = grad(logp, old, adv, adv_seq, mask)
    for junk in [(np.nan, np.inf, -np.inf), (1e30, np.nan, np.inf),
                 (-np.inf, -1e30, np.nan)]:
      dirty = [arr.copy() for arr in (logp, old, adv, adv_seq)]
      for arr, j in zip(dirty[:3], junk):
        arr[holes] = j
      dirty[3][empty] = junk[0]
      out = fn(*dirty, mask)
      assert_close(out, clean, atol=0, rtol=0, err_msg=f"{name} {junk}")
      g = grad(*dirty, mask)
      assert np.all(np.isfinite(g)) and np.all(g[holes] == 0), (name, junk)
      assert_close(g, clean_grad, atol=0, rtol=0)
    first = np.asarray(_first_output(clean))
    if first.shape == mask.shape:
      assert np.all(first[holes] == 0), name
