"""Tests for jaxrl_llm.advantages: fixtures, NumPy references, properties, transforms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_llm import advantages as adv_lib
from jaxrl_llm.advantages import (
  broadcast_to_tokens,
  discounted_returns,
  dr_grpo_advantages,
  gae,
  group_advantages,
  grpo_advantages,
  hybrid_advantages,
  lambda_returns,
  nstep_returns,
  reinforce_pp_advantages,
  remax_advantages,
  rloo_advantages,
  self_critical_advantages,
)
from tests.utils import assert_close, assert_no_recompile, random_mask

# ------------------------------------------------------------------------------------
# Independent plain-NumPy references (loops over valid steps).


def np_valid_steps(m_row):
  return [t for t in range(len(m_row)) if m_row[t] > 0]


def np_gae(r, v, m, gamma, lam, boot=None):
  """verl loop semantics, written over the list of valid steps of each row."""
  B, T = r.shape
  gamma = np.broadcast_to(gamma, (B, T))
  lam = np.broadcast_to(lam, (B, T))
  adv = np.zeros((B, T))
  for b in range(B):
    steps = np_valid_steps(m[b])
    a_next, v_next = 0.0, (0.0 if boot is None else boot[b])
    for t in reversed(steps):
      delta = r[b, t] + gamma[b, t] * v_next - v[b, t]
      a_next = delta + gamma[b, t] * lam[b, t] * a_next
      adv[b, t] = a_next
      v_next = v[b, t]
  return adv, (adv + v) * m


def np_gae_zeroed(r, v, m, gamma, lam, boot=None):
  """TRL / OpenRLHF: zero masked rewards and values, recurse over every position."""
  B, T = r.shape
  r, v = r * m, v * m
  adv = np.zeros((B, T))
  for b in range(B):
    a = 0.0
    for t in reversed(range(T)):
      nv = v[b, t + 1] if t + 1 < T else (0.0 if boot is None else boot[b])
      a = r[b, t] + gamma * nv - v[b, t] + gamma * lam * a
      adv[b, t] = a
  return adv * m


def np_nstep(r, v, m, n, gamma, boot=None):
  B, T = r.shape
  out = np.zeros((B, T))
  for b in range(B):
    steps = np_valid_steps(m[b])
    N = len(steps)
    for j, t in enumerate(steps):
      total, disc = 0.0, 1.0
      for k in range(min(n, N - j)):
        total += disc * r[b, steps[j + k]]
        disc *= gamma
      tail = v[b, steps[j + n]] if j + n < N else (0.0 if boot is None else boot[b])
      out[b, t] = total + disc * tail
  return out


def np_discounted(r, m, gamma, boot=None):
  B, T = r.shape
  out = np.zeros((B, T))
  for b in range(B):
    g = 0.0 if boot is None else boot[b]
    for t in reversed(np_valid_steps(m[b])):
      g = r[b, t] + gamma * g
      out[b, t] = g
  return out


def np_group(scores, group_size, baseline, scale, eps, ddof, singleton):
  s = np.asarray(scores, np.float64)
  out = np.zeros_like(s)
  batch_std = np.std(s, ddof=ddof) if len(s) > ddof else 0.0
  for start in range(0, len(s), group_size):
    g = s[start:start + group_size]
    n = len(g)
    for i in range(n):
      if n == 1:
        out[start + i] = g[i] if singleton == "raw" else 0.0
        continue
      if baseline == "mean":
        b = g.mean()
      elif baseline == "leave_one_out":
        b = (g.sum() - g[i]) / (n - 1)
      else:
        b = 0.0
      if scale == "group":
        d = (np.std(g, ddof=ddof) if n > ddof else 0.0) + eps
      elif scale == "batch":
        d = batch_std + eps
      else:
        d = 1.0
      out[start + i] = (g[i] - b) / d
  return out


def random_inputs(seed, B=5, T=17):
  rng = np.random.default_rng(seed)
  r = rng.normal(size=(B, T)).astype(np.float32)
  v = rng.normal(size=(B, T)).astype(np.float32)
  m = random_mask(rng, B, T)
  boot = rng.normal(size=(B,)).astype(np.float32)
  return r, v, m, boot


# ------------------------------------------------------------------------------------
# GAE fixtures.

RLAX_R = np.array([[0, 0, 1, 0, -0.5], [0, 0, 0, 0, 1]], np.float32)
RLAX_V = np.array([[1, 4, -3, -2, -1, -1], [-3, -2, -1, 0, 5, -1]], np.float32)
RLAX_G = np.array([[.99] * 5, [.9, .9, .9, 0, .9]], np.float32)


@pytest.mark.parametrize("method", ["scan", "associative"])
@pytest.mark.parametrize("lam,expected", [
    (1.0, [[-1.45118, -4.4557, 2.5396, 0.5249, -0.49], [3, 2, 1, 0, -4.9]]),
    (0.7, [[-0.676979, -5.248167, 2.4846, 0.6704, -0.49], [2.2899, 1.73, 1, 0, -4.9]]),
])
def test_gae_rlax_fixture(method, lam, expected):
  # rlax: values has length T+1; values[T] is our bootstrap, discount_t our gamma.
  adv, ret = gae(RLAX_R, RLAX_V[:, :-1], np.ones_like(RLAX_R), gamma=RLAX_G, lam=lam,
                 bootstrap_value=RLAX_V[:, -1], method=method)
  assert_close(adv, expected, atol=1e-4)
  assert_close(ret, np.asarray(expected) + RLAX_V[:, :-1], atol=1e-4)


@pytest.mark.parametrize("method", ["scan", "associative"])
def test_gae_verl_fixtures(method):
  adv, ret = gae(np.array([[0, 0, 1, 0.]]), np.array([[.5, .2, .8, 9.]]),
                 np.array([[1, 1, 1, 0]]), gamma=1.0, lam=0.95, method=method)
  assert_close(adv, [[0.4505, 0.79, 0.2, 0.0]])
  assert_close(ret, [[0.9505, 0.99, 1.0, 0.0]])
  white = adv_lib.masked_whiten(adv, np.array([[1, 1, 1, 0]]))
  assert_close(white[0, :3], [-0.100186, 1.046322, -0.946136], atol=1e-5)
  # Multi-turn: the 0.1 reward on a masked token is dropped.
  adv, _ = gae(np.array([[0, 0, .1, 0, 1, 0]]), np.array([[.3, .4, .5, 7, .6, 5]]),
               np.array([[1, 1, 0, 0, 1, 0]]), method=method)
  assert_close(adv, [[0.7, 0.6, 0, 0, 0.4, 0]])


@pytest.mark.parametrize("method", ["scan", "associative"])
@pytest.mark.parametrize("transparent", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_matches_numpy_on_random_masked_inputs(method, transparent, seed):
  r, v, m, boot = random_inputs(seed)
  gamma, lam = 0.97, 0.9
  adv, ret = gae(r, v, m, gamma=gamma, lam=lam, bootstrap_value=boot, method=method,
                 transparent_mask=transparent)
  if transparent:
    e_adv, e_ret = np_gae(r, v, m, gamma, lam, boot)
  else:
    e_adv = np_gae_zeroed(r, v, m, gamma, lam, boot)
    e_ret = (e_adv + v) * m
  assert_close(adv, e_adv, atol=1e-5)
  assert_close(ret, e_ret, atol=1e-5)
  assert np.all(np.asarray(adv)[m == 0] == 0)


def test_gae_per_token_gamma_matches_numpy():
  r, v, m, boot = random_inputs(3)
  rng = np.random.default_rng(3)
  gamma = rng.uniform(0, 1, r.shape).astype(np.float32)
  lam = rng.uniform(0, 1, r.shape).astype(np.float32)
  e_adv, _ = np_gae(r, v, m, gamma, lam, boot)
  for method in ("scan", "associative"):
    adv, _ = gae(r, v, m, gamma=gamma, lam=lam, bootstrap_value=boot, method=method)
    assert_close(adv, e_adv, atol=1e-5)


gae_jit = jax.jit(gae, static_argnames=("method", "transparent_mask"))
hybrid_jit = jax.jit(hybrid_advantages, static_argnames=("n", "method"))


# Shapes are fixed (ragged lengths come from the mask) so hypothesis reuses one
# compilation per function instead of tracing a new shape for every example.
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), gamma=st.floats(0.5, 1.0), lam=st.floats(0.0, 1.0))
def test_gae_properties(seed, gamma, lam):
  r, v, m, boot = random_inputs(seed, B=3, T=16)
  adv_s, ret_s = gae_jit(r, v, m, gamma=gamma, lam=lam, bootstrap_value=boot)
  adv_a, ret_a = gae_jit(r, v, m, gamma=gamma, lam=lam, bootstrap_value=boot,
                         method="associative")
  assert_close(adv_s, adv_a, atol=1e-5)
  assert_close(ret_s, ret_a, atol=1e-5)
  # lam = 1: Monte-Carlo return minus value.
  adv1, _ = gae_jit(r, v, m, gamma=gamma, lam=1.0, bootstrap_value=boot)
  mc = np_discounted(r, m, gamma, boot)
  assert_close(adv1, (mc - v) * m, atol=1e-4)
  # lam = 0: TD(0) error = 1-step return minus value.
  adv0, _ = gae_jit(r, v, m, gamma=gamma, lam=0.0, bootstrap_value=boot)
  assert_close(adv0, (np_nstep(r, v, m, 1, gamma, boot) - v) * m, atol=1e-5)
  # Masked positions never influence valid outputs.
  noise = np.where(m > 0, 0.0, 1e6).astype(np.float32)
  adv_n, _ = gae_jit(r + noise, v - noise, m, gamma=gamma, lam=lam, bootstrap_value=boot)
  assert_close(adv_n, adv_s, atol=1e-6)


def test_gae_long_sequence_scan_equals_associative():
  T = 32768
  rng = np.random.default_rng(0)
  r = (rng.normal(size=(2, T)) * 0.01).astype(np.float32)  # per-token KL-like reward
  r[:, -1] += 1.0                                          # outcome reward
  v = rng.normal(size=(2, T)).astype(np.float32)
  m = np.ones((2, T), np.float32)
  m[1, T // 2:] = 0
  a_s, _ = jax.jit(lambda *x: gae(*x, gamma=1.0, lam=0.95))(r, v, m)
  a_a, _ = jax.jit(lambda *x: gae(*x, gamma=1.0, lam=0.95, method="associative"))(r, v, m)
  np.testing.assert_allclose(np.asarray(a_s), np.asarray(a_a), atol=1e-5, rtol=1e-5)
  e_adv, _ = np_gae(r[:, -2048:], v[:, -2048:], m[:, -2048:], 1.0, 0.95)
  # the last 2048 steps do not depend on earlier ones
  np.testing.assert_allclose(np.asarray(a_s)[:, -2048:], e_adv, atol=1e-5, rtol=1e-5)


def test_default_method_is_chosen_by_backend(monkeypatch):
  import jaxrl_llm.advantages as A
  r, v, m, _ = random_inputs(5)
  want = {"cpu": "scan", "gpu": "associative", "tpu": "associative"}
  for backend, method in want.items():
    monkeypatch.setattr(A.jax, "default_backend", lambda b=backend: b)
    assert A.default_gae_method() == method
    adv, ret = jax.jit(lambda *x: gae(*x, gamma=0.9, lam=0.8))(r, v, m)
    e_adv, e_ret = np_gae(r, v, m, 0.9, 0.8)
    assert_close((adv, ret), (e_adv, e_ret), atol=1e-5)


def test_gae_all_masked_and_empty_and_bf16():
  r, v, m, boot = random_inputs(4)
  m[:] = 0
  adv, ret = gae(r, v, m, bootstrap_value=boot)
  assert np.all(np.asarray(adv) == 0) and np.all(np.asarray(ret) == 0)
  r, v, m, _ = random_inputs(5)
  adv16, ret16 = gae(jnp.asarray(r, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16), m,
                     gamma=0.99, lam=0.95)
  assert adv16.dtype == jnp.bfloat16 and ret16.dtype == jnp.bfloat16
  adv32, _ = gae(np.asarray(jnp.asarray(r, jnp.bfloat16), np.float32),
                 np.asarray(jnp.asarray(v, jnp.bfloat16), np.float32), m,
                 gamma=0.99, lam=0.95)
  assert np.all(np.isfinite(np.asarray(adv16, np.float32)))
  assert_close(np.asarray(adv16, np.float32), adv32, atol=0.1, rtol=0.02)


@pytest.mark.parametrize("method", ["scan", "associative"])
def test_gae_jit_vmap_grad_and_no_recompile(method):
  r, v, m, _ = random_inputs(6)
  f = lambda r, v, m, g, l: gae(r, v, m, gamma=g, lam=l, method=method)[0]
  assert_close(jax.jit(f)(r, v, m, 0.9, 0.8), f(r, v, m, 0.9, 0.8), atol=1e-6)
  stacked = jax.vmap(f, in_axes=(0, 0, 0, None, None))(r[None].repeat(2, 0),
                                                       v[None].repeat(2, 0),
                                                       m[None].repeat(2, 0), 0.9, 0.8)
  assert_close(stacked[1], f(r, v, m, 0.9, 0.8), atol=1e-6)
  # lam = gamma = 1: A_t = sum_{valid t' >= t} r_t' - V_t, so the gradients are exact.
  g_v = jax.grad(lambda v: jnp.sum(f(r, v, m, 1.0, 1.0)))(v)
  assert_close(g_v, -m)
  g_r = jax.grad(lambda r: jnp.sum(f(r, v, m, 1.0, 1.0)))(r)
  assert_close(g_r, np.cumsum(m, axis=1) * m)
  assert_no_recompile(f, (r, v, m, 0.9, 0.8), (r, v, m, 0.5, 0.3))


def test_gae_bad_inputs():
  r, v, m, _ = random_inputs(7)
  with pytest.raises(ValueError, match="rewards"):
    gae(r[0], v[0], m[0])
  with pytest.raises(ValueError, match="values"):
    gae(r, v[:, :-1], m)
  with pytest.raises(ValueError, match="mask"):
    gae(r, v, m[:-1])
  with pytest.raises(ValueError, match=r"rewards.*dtype|dtype.*rewards|floating"):
    gae(r.astype(np.int32), v, m)
  with pytest.raises(ValueError, match="method"):
    gae(r, v, m, method="fft")
  with pytest.raises(ValueError, match="bootstrap_value"):
    gae(r, v, m, bootstrap_value=np.zeros(3))
  with pytest.raises(ValueError, match="gamma"):
    gae(r, v, m, gamma=np.ones(3))


# ------------------------------------------------------------------------------------
# n-step, lambda, discounted, hybrid.


@pytest.mark.parametrize("n", [1, 2, 5, 40])
@pytest.mark.parametrize("seed", [0, 1])
def test_nstep_matches_numpy(n, seed):
  r, v, m, boot = random_inputs(seed)
  out = nstep_returns(r, v, m, n=n, gamma=0.9, bootstrap_value=boot)
  assert_close(out, np_nstep(r, v, m, n, 0.9, boot) * m, atol=1e-5)


def test_nstep_fixture_by_hand():
  # valid steps 0, 2, 3 with rewards 1, 2, 3 and values 10, 20, 30; gamma = 0.5
  r = np.array([[1., 9., 2., 3.]])
  v = np.array([[10., 99., 20., 30.]])
  m = np.array([[1, 0, 1, 1]])
  out = nstep_returns(r, v, m, n=2, gamma=0.5, bootstrap_value=np.array([4.]))
  # t0: 1 + .5*2 + .25*30 = 9.5 ; t2: 2 + .5*3 + .25*4 = 4.5 ; t3: 3 + .5*4 = 5
  assert_close(out, [[9.5, 0.0, 4.5, 5.0]])


def test_discounted_and_lambda_returns():
  r, v, m, boot = random_inputs(8)
  for method in ("scan", "associative"):
    g = discounted_returns(r, m, gamma=0.8, bootstrap_value=boot, method=method)
    assert_close(g, np_discounted(r, m, 0.8, boot), atol=1e-5)
    lr = lambda_returns(r, v, m, gamma=0.8, lam=0.6, bootstrap_value=boot, method=method)
    assert_close(lr, np_gae(r, v, m, 0.8, 0.6, boot)[1], atol=1e-5)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.sampled_from([1, 3]), mix=st.floats(0, 1),
       lam=st.floats(0, 1))
def test_hybrid_properties(seed, n, mix, lam):
  r, v, m, boot = random_inputs(seed, B=3, T=12)
  kw = {"n": n, "gamma": 0.95, "lam": lam, "bootstrap_value": boot}
  a1, r1 = hybrid_jit(r, v, m, mix=1.0, **kw)
  assert_close(a1, gae_jit(r, v, m, gamma=0.95, lam=lam, bootstrap_value=boot)[0],
               atol=1e-5)
  assert_close(r1, (np.asarray(a1) + v) * m, atol=1e-5)
  a0, _ = hybrid_jit(r, v, m, mix=0.0, **kw)
  assert_close(a0, (np_nstep(r, v, m, n, 0.95, boot) - v) * m, atol=1e-5)
  am, _ = hybrid_jit(r, v, m, mix=mix, **kw)
  assert_close(am, mix * np.asarray(a1) + (1 - mix) * np.asarray(a0), atol=1e-5)


def test_hybrid_no_recompile_and_grad():
  r, v, m, _ = random_inputs(9)
  f = lambda v, mix, lam: hybrid_advantages(r, v, m, n=3, gamma=0.9, lam=lam, mix=mix)[0]
  assert_no_recompile(f, (v, 0.2, 0.9), (v, 0.7, 0.5))
  g = jax.grad(lambda v: jnp.sum(f(v, 0.5, 0.9)))(v)
  assert np.all(np.isfinite(np.asarray(g))) and np.all(np.asarray(g)[m == 0] == 0)
  with pytest.raises(ValueError, match="`n`"):
    nstep_returns(r, v, m, n=0)


# ------------------------------------------------------------------------------------
# Sequence-level estimators.


@pytest.mark.parametrize("eps,expected", [(1e-6, 0.866024), (1e-4, 0.865875),
                                          (1e-9, 0.866025)])
def test_grpo_fixture_verl_trl_openrlhf(eps, expected):
  a = grpo_advantages(np.array([1., 0., 0., 1.], np.float32), group_size=4, eps=eps)
  assert_close(a, [expected, -expected, -expected, expected], atol=2e-6)


def test_rloo_fixture_and_identity():
  s = np.array([1., 0., 0., 1.], np.float32)
  assert_close(rloo_advantages(s, group_size=4), [2 / 3, -2 / 3, -2 / 3, 2 / 3])
  rng = np.random.default_rng(0)
  s = rng.normal(size=(12,)).astype(np.float32)
  g = s.reshape(3, 4)
  expected = 4 / 3 * (g - g.mean(1, keepdims=True))
  assert_close(rloo_advantages(s, group_size=4), expected.reshape(-1), atol=1e-5)


@pytest.mark.parametrize("baseline", ["mean", "leave_one_out", "none"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("group_size", [1, 3, 4])
def test_group_advantages_match_numpy(baseline, scale, group_size):
  rng = np.random.default_rng(group_size)
  s = rng.normal(size=(12,)).astype(np.float32)
  s[:group_size] = 0.5  # one constant group
  for singleton in ("raw", "zero"):
    out = group_advantages(s, group_size=group_size, baseline=baseline, scale=scale,
                           eps=1e-6, ddof=1, singleton=singleton)
    exp = np_group(s, group_size, baseline, scale, 1e-6, 1, singleton)
    assert_close(out, exp, atol=1e-5)
    assert np.all(np.isfinite(np.asarray(out)))


def test_group_edge_cases_zero_std_and_singletons():
  s = np.array([3., 3., 3., 3.], np.float32)
  assert_close(grpo_advantages(s, group_size=4), np.zeros(4))
  assert_close(grpo_advantages(s, group_size=1), s)                    # verl: raw
  assert_close(grpo_advantages(s, group_size=1, singleton="zero"), np.zeros(4))
  assert_close(rloo_advantages(s, group_size=1, singleton="zero"), np.zeros(4))


def test_group_ids_equal_contiguous_and_valid_rows_excluded():
  rng = np.random.default_rng(1)
  s = rng.normal(size=(8,)).astype(np.float32)
  perm = rng.permutation(8)
  ids = (np.arange(8) // 4)[perm]
  by_ids = grpo_advantages(s[perm], group_ids=ids, num_groups=2)
  contiguous = np.asarray(grpo_advantages(s, group_size=4))[perm]
  assert_close(by_ids, contiguous, atol=1e-6)
  # An invalid (fully rejected) row neither shifts its siblings nor gets a value.
  valid = np.ones(8, np.float32)
  valid[0] = 0
  out = grpo_advantages(s, group_size=4, valid=valid)
  assert float(out[0]) == 0.0
  assert_close(out[1:4], np_group(s[1:4], 3, "mean", "group", 1e-6, 1, "raw"), atol=1e-5)
  assert_close(out[4:], contiguous[np.argsort(perm)][4:], atol=1e-6)


def test_group_jit_vmap_grad_and_no_recompile():
  s = jnp.array([1., 2., 4., 8., 0., 1.])
  f = lambda s, eps: grpo_advantages(s, group_size=3, eps=eps)
  assert_close(jax.jit(f)(s, 1e-6), f(s, 1e-6), atol=1e-6)
  batched = jax.vmap(f, in_axes=(0, None))(jnp.stack([s, 2 * s]), 1e-6)
  assert_close(batched[1], f(2 * s, 1e-6), atol=1e-5)
  g = jax.grad(lambda s: jnp.sum(f(s, 1e-6) ** 2))(s)
  assert np.all(np.isfinite(np.asarray(g)))
  assert_no_recompile(f, (s, 1e-6), (s, 1e-4))


def test_group_bad_inputs():
  s = np.zeros(6, np.float32)
  with pytest.raises(ValueError, match="group_size"):
    grpo_advantages(s, group_size=4)
  with pytest.raises(ValueError, match="scores"):
    grpo_advantages(np.zeros((2, 3), np.float32), group_size=3)
  with pytest.raises(ValueError, match="scores"):
    grpo_advantages(np.zeros(6, np.int32), group_size=3)
  with pytest.raises(ValueError, match="baseline"):
    group_advantages(s, group_size=3, baseline="median")
  with pytest.raises(ValueError, match="num_groups"):
    group_advantages(s, group_ids=np.zeros(6, np.int32))
  with pytest.raises(ValueError, match="exactly one"):
    group_advantages(s)


def test_dr_grpo_self_critical_broadcast():
  s = np.array([1., 0., 0., 1., 2., 2.], np.float32)
  assert_close(dr_grpo_advantages(s, group_size=2), [.5, -.5, -.5, .5, 0, 0])
  assert_close(self_critical_advantages(s, np.ones(6, np.float32)), s - 1)
  with pytest.raises(ValueError, match="greedy_scores"):
    self_critical_advantages(s, np.ones(5, np.float32))
  m = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
  assert_close(broadcast_to_tokens(np.array([2., -1.], np.float32), m),
               [[2, 2, 0], [-1, 0, 0]])


def test_reinforce_pp_and_remax():
  r, _, m, _ = random_inputs(10, B=4, T=9)
  out = reinforce_pp_advantages(r, m, gamma=0.9)
  g = np_discounted(r, m, 0.9)
  valid = g[m > 0]
  white = (g - valid.mean()) / np.sqrt(valid.var(ddof=1) + 1e-8) * m
  assert_close(out, white, atol=1e-4)
  # baseline variant: centre per group, broadcast, whiten over the batch tokens
  out_b = reinforce_pp_advantages(r, m, group_size=2)
  s = (r * m).sum(1)
  c = (s.reshape(2, 2) - s.reshape(2, 2).mean(1, keepdims=True)).reshape(-1)
  tok = c[:, None] * m
  vals = tok[m > 0]
  assert_close(out_b, (tok - vals.mean()) / np.sqrt(vals.var(ddof=1) + 1e-8) * m, atol=1e-4)
  b = np.array([0.5, -1, 2, 0], np.float32)
  assert_close(remax_advantages(r, m, b), (np_discounted(r, m, 1.0) - b[:, None]) * m,
               atol=1e-5)


# ------------------------------------------------------------------------------------
# The reverse linear recurrence: both methods, any T, input validation.


def np_recurrence(c, d, init):
  x = np.zeros_like(d, dtype=np.float64)
  nxt = np.asarray(init, np.float64)
  for t in reversed(range(d.shape[1])):
    nxt = d[:, t] + c[:, t] * nxt
    x[:, t] = nxt
  return x


@pytest.mark.parametrize("method", ["scan", "associative"])
@pytest.mark.parametrize("T", [1, 7, 8, 9, 63, 64, 65, 200, 1000])
def test_reverse_linear_recurrence_matches_numpy(method, T):
  rng = np.random.default_rng(T)
  c = rng.uniform(0, 1, (3, T)).astype(np.float32)
  c[:, ::5] = 0.0   # episode ends inside the row
  d = rng.normal(size=(3, T)).astype(np.float32)
  init = rng.normal(size=(3,)).astype(np.float32)
  x = adv_lib.reverse_linear_recurrence(c, d, init, method=method)
  assert x.shape == (3, T) and x.dtype == jnp.float32
  assert_close(x, np_recurrence(c, d, init), atol=1e-5)


def test_reverse_linear_recurrence_bad_inputs():
  c = np.ones((2, 5), np.float32)
  with pytest.raises(ValueError, match="coeffs"):
    adv_lib.reverse_linear_recurrence(c[0], c[0], np.zeros(2, np.float32))
  with pytest.raises(ValueError, match="inputs"):
    adv_lib.reverse_linear_recurrence(c, c[:, :4], np.zeros(2, np.float32))
  with pytest.raises(ValueError, match="init"):
    adv_lib.reverse_linear_recurrence(c, c, np.zeros(3, np.float32))
  with pytest.raises(ValueError, match="coeffs"):
    adv_lib.reverse_linear_recurrence(c.astype(np.int32), c, np.zeros(2, np.float32))
  with pytest.raises(ValueError, match="method"):
    adv_lib.reverse_linear_recurrence(c, c, np.zeros(2, np.float32), method="fft")
  with pytest.raises(ValueError, match="unroll"):
    adv_lib.reverse_linear_recurrence(c, c, np.zeros(2, np.float32), unroll=0)


@pytest.mark.parametrize("T", [1, 9, 100, 1000])
def test_gae_scan_equals_associative_any_length(T):
  r, v, m, boot = random_inputs(T, B=4, T=T)
  for lam in (0.9, np.full(r.shape, 0.7, np.float32)):
    a_s, r_s = gae(r, v, m, gamma=0.99, lam=lam, bootstrap_value=boot)
    a_a, r_a = gae(r, v, m, gamma=0.99, lam=lam, bootstrap_value=boot,
                   method="associative")
    assert_close(a_s, a_a, atol=1e-5)
    assert_close(r_s, r_a, atol=1e-5)
    if T <= 100:
      assert_close(a_s, np_gae(r, v, m, 0.99, lam, boot)[0], atol=1e-5)


def test_gae_per_row_coefficients_equal_per_token():
  r, v, m, boot = random_inputs(11)
  lam_row = np.linspace(0, 1, r.shape[0]).astype(np.float32)
  gamma_row = np.linspace(0.5, 1, r.shape[0]).astype(np.float32)
  for method in ("scan", "associative"):
    a_row, _ = gae(r, v, m, gamma=gamma_row, lam=lam_row, bootstrap_value=boot,
                   method=method)
    a_tok, _ = gae(r, v, m, gamma=np.repeat(gamma_row[:, None], r.shape[1], 1),
                   lam=np.repeat(lam_row[:, None], r.shape[1], 1), bootstrap_value=boot,
                   method=method)
    assert_close(a_row, a_tok, atol=1e-5)
    e_adv, _ = np_gae(r, v, m, gamma_row[:, None], lam_row[:, None], boot)
    assert_close(a_row, e_adv, atol=1e-5)


# ------------------------------------------------------------------------------------
# Decoupled GAE and the length-adaptive lambda (VC-PPO / VAPO).


def lam_forms(B, T, rng):
  return {"scalar": 0.9, "row": rng.uniform(0, 1, B).astype(np.float32),
          "token": rng.uniform(0, 1, (B, T)).astype(np.float32)}


@pytest.mark.parametrize("method", ["scan", "associative"])
@pytest.mark.parametrize("form", ["scalar", "row", "token"])
def test_decoupled_gae_equals_two_gae_calls(method, form):
  r, v, m, boot = random_inputs(12)
  lam_p = lam_forms(*r.shape, np.random.default_rng(0))[form]
  adv, ret = adv_lib.decoupled_gae(r, v, m, gamma=0.97, lam_policy=lam_p, lam_value=1.0,
                                   bootstrap_value=boot, method=method)
  e_adv, _ = gae(r, v, m, gamma=0.97, lam=lam_p, bootstrap_value=boot, method=method)
  _, e_ret = gae(r, v, m, gamma=0.97, lam=1.0, bootstrap_value=boot, method=method)
  assert_close(adv, e_adv, atol=1e-5)
  assert_close(ret, e_ret, atol=1e-5)
  # independent NumPy loop
  lam_np = np.broadcast_to(lam_p if np.ndim(lam_p) != 1 else lam_p[:, None], r.shape)
  assert_close(adv, np_gae(r, v, m, 0.97, lam_np, boot)[0], atol=1e-5)
  assert_close(ret, np_gae(r, v, m, 0.97, 1.0, boot)[1], atol=1e-5)
  assert np.all(np.asarray(adv)[m == 0] == 0) and np.all(np.asarray(ret)[m == 0] == 0)


def test_decoupled_gae_value_targets_are_reward_to_go():
  r, v, m, _ = random_inputs(13)
  _, ret = adv_lib.decoupled_gae(r, v, m, gamma=1.0, lam_policy=0.95, lam_value=1.0)
  assert_close(ret, np_discounted(r, m, 1.0), atol=1e-5)
  # hand fixture: one terminal reward, the targets are 1 on every valid token
  _, ret = adv_lib.decoupled_gae(np.array([[0, 0, 0, 1.]]), np.array([[.3, 9, .1, .2]]),
                                 np.array([[1, 0, 1, 1]]), lam_policy=0.5, lam_value=1.0)
  assert_close(ret, [[1, 0, 1, 1]])


def test_decoupled_gae_jit_vmap_grad_and_no_recompile():
  r, v, m, boot = random_inputs(14)
  f = lambda r, v, lp, lv: adv_lib.decoupled_gae(r, v, m, gamma=0.99, lam_policy=lp,
                                                 lam_value=lv, bootstrap_value=boot)
  lam_row = np.linspace(0.1, 0.9, r.shape[0]).astype(np.float32)
  assert_close(jax.jit(f)(r, v, lam_row, 1.0), f(r, v, lam_row, 1.0), atol=1e-6)
  batched = jax.vmap(f, in_axes=(0, 0, None, None))(np.stack([r, 2 * r]),
                                                   np.stack([v, v]), lam_row, 0.5)
  assert_close(jax.tree.map(lambda x: x[1], batched), f(2 * r, v, lam_row, 0.5),
               atol=1e-5)
  # gamma = lam = 1: returns are the reward-to-go, so d(sum ret)/d(values) = 0 and
  # d(sum adv)/d(values) = -mask.
  g = jax.grad(lambda v: jnp.sum(f(r, v, 1.0, 1.0)[0]))(v)
  assert_close(g * m, -m, atol=1e-6)
  assert_no_recompile(f, (r, v, lam_row, 1.0), (r, v, lam_row * 0.5, 0.9))


def np_length_adaptive(m, alpha):
  length = (m > 0).sum(1).astype(np.float64)
  return np.clip(1 - 1 / np.maximum(alpha * length, 1), 0, 1)


def test_length_adaptive_lambda_fixtures_and_numpy():
  lengths = np.array([100, 500, 1000, 20, 21, 1, 0])
  m = (np.arange(1000)[None, :] < lengths[:, None]).astype(np.float32)
  lam = adv_lib.length_adaptive_lambda(m)
  assert lam.shape == (7,) and lam.dtype == jnp.float32
  assert_close(lam, [0.80, 0.96, 0.98, 0.0, 1 - 1 / 1.05, 0.0, 0.0], atol=1e-6)
  rng = np.random.default_rng(0)
  for alpha in (0.01, 0.05, 0.5):
    mr = random_mask(rng, 6, 300)
    assert_close(adv_lib.length_adaptive_lambda(mr, alpha=alpha),
                 np_length_adaptive(mr, alpha), atol=1e-6)
  # the masked holes do not count; a boolean mask works
  assert_close(adv_lib.length_adaptive_lambda(mr > 0, alpha=0.05),
               np_length_adaptive(mr, 0.05), atol=1e-6)


def test_length_adaptive_lambda_jit_vmap_no_recompile_and_feeds_decoupled_gae():
  r, v, m, _ = random_inputs(15, T=64)
  f = lambda m, a: adv_lib.length_adaptive_lambda(m, alpha=a)
  assert_close(jax.jit(f)(m, 0.1), np_length_adaptive(m, 0.1), atol=1e-6)
  assert_close(jax.vmap(f, in_axes=(0, None))(np.stack([m, m]), 0.1)[1],
               np_length_adaptive(m, 0.1), atol=1e-6)
  assert_no_recompile(f, (m, 0.05), (m, 0.2))
  lam = adv_lib.length_adaptive_lambda(m, alpha=0.1)
  adv, _ = adv_lib.decoupled_gae(r, v, m, lam_policy=lam, lam_value=1.0)
  assert_close(adv, np_gae(r, v, m, 1.0, np.asarray(lam)[:, None], None)[0], atol=1e-5)


# ------------------------------------------------------------------------------------
# Masking contract: whatever sits at a masked position (NaN, inf) changes nothing.


def _poison(x, m, value):
  return np.where(m > 0, x, value).astype(x.dtype)


def _token_estimators(method):
  """Every public token-level estimator as f(rewards, values, mask, gamma, lam)."""
  kw = {"method": method}
  return {
      "gae": lambda r, v, m, g, l, b: gae(r, v, m, gamma=g, lam=l, bootstrap_value=b, **kw),
      "gae_trl": lambda r, v, m, g, l, b: gae(r, v, m, gamma=0.9, lam=0.8,
                                             bootstrap_value=b, transparent_mask=False,
                                             **kw),
      "decoupled_gae": lambda r, v, m, g, l, b: adv_lib.decoupled_gae(
          r, v, m, gamma=g, lam_policy=l, lam_value=1.0, bootstrap_value=b, **kw),
      "lambda_returns": lambda r, v, m, g, l, b: lambda_returns(
          r, v, m, gamma=g, lam=l, bootstrap_value=b, **kw),
      "discounted_returns": lambda r, v, m, g, l, b: discounted_returns(
          r, m, gamma=g, bootstrap_value=b, **kw),
      "nstep_returns": lambda r, v, m, g, l, b: nstep_returns(
          r, v, m, n=3, gamma=g, bootstrap_value=b),
      "hybrid_advantages": lambda r, v, m, g, l, b: hybrid_advantages(
          r, v, m, n=2, gamma=g, lam=l, mix=0.3, bootstrap_value=b, **kw),
      "reverse_linear_recurrence": lambda r, v, m, g, l, b: adv_lib.reverse_linear_recurrence(
          jnp.where(m > 0, 0.9, 1.0), jnp.where(m > 0, r, 0.0), b,
          method=method) * (m > 0),
      "reinforce_pp": lambda r, v, m, g, l, b: reinforce_pp_advantages(r, m, gamma=g),
      "reinforce_pp_baseline": lambda r, v, m, g, l, b: reinforce_pp_advantages(
          r, m, group_size=2),
      "remax": lambda r, v, m, g, l, b: remax_advantages(r, m, b),
      "broadcast_to_tokens": lambda r, v, m, g, l, b: broadcast_to_tokens(
          jnp.where(m.sum(1) > 0, b, np.nan), m),
      "length_adaptive_lambda": lambda r, v, m, g, l, b: adv_lib.length_adaptive_lambda(m),
  }


POISONS = (np.nan, np.inf, -np.inf, 3e38)


@pytest.mark.parametrize("method", ["scan", "associative"])
def test_masked_inputs_change_nothing_in_any_estimator(method):
  """Every poison of ``POISONS`` at the masked positions of two random masks, with
  scalar and per-token gamma/lam. Each estimator is jitted once: the inputs (poisons
  included) are traced, so all the cases share its two compiles."""
  cases = []
  for seed in (0, 1):
    r, v, m, boot = random_inputs(seed, B=6, T=13)
    m[0, 3] = 0   # a hole inside a response
    rng = np.random.default_rng(seed)
    gamma = rng.uniform(0.5, 1, r.shape).astype(np.float32)
    lam = rng.uniform(0, 1, r.shape).astype(np.float32)
    cases.append((r, v, m, boot, gamma, lam))
  for name, f in _token_estimators(method).items():
    f = jax.jit(f)
    for r, v, m, boot, gamma, lam in cases:
      for g, l in ((0.95, 0.9), (gamma, lam)):
        if name == "gae_trl" and not np.isscalar(g):
          continue
        clean = [np.asarray(c) for c in jax.tree.leaves(f(r, v, m, g, l, boot))]
        for poison in POISONS:
          bad_g = g if np.isscalar(g) else _poison(g, m, poison)
          bad_l = l if np.isscalar(l) else _poison(l, m, poison)
          dirty = f(_poison(r, m, poison), _poison(v, m, poison), m, bad_g, bad_l, boot)
          for c, d in zip(clean, jax.tree.leaves(dirty)):
            d = np.asarray(d)
            assert np.all(np.isfinite(d)), (name, poison)
            np.testing.assert_array_equal(d, c, err_msg=f"{name} changed by {poison}")
            if c.ndim == 2:
              assert np.all(c[m == 0] == 0), name


@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_group_estimators_ignore_invalid_rows(poison):
  rng = np.random.default_rng(0)
  s = rng.normal(size=(8,)).astype(np.float32)
  valid = np.array([1, 1, 0, 1, 1, 1, 1, 0], np.float32)
  dirty = np.where(valid > 0, s, poison).astype(np.float32)
  fns = {"grpo": lambda s: grpo_advantages(s, group_size=4, valid=valid),
         "rloo": lambda s: rloo_advantages(s, group_size=4, valid=valid),
         "dr_grpo": lambda s: dr_grpo_advantages(s, group_size=4, valid=valid),
         "batch": lambda s: group_advantages(s, group_size=2, scale="batch", valid=valid),
         "ids": lambda s: group_advantages(s, group_ids=np.array([0, 0, 1, 1, 0, 1, 5, -1]),
                                           num_groups=2, valid=valid)}
  for name, f in fns.items():
    np.testing.assert_array_equal(np.asarray(f(dirty)), np.asarray(f(s)), err_msg=name)
    assert np.all(np.asarray(f(dirty))[valid == 0] == 0), name


@pytest.mark.parametrize("method", ["scan", "associative"])
def test_masked_nan_leaves_gradients_finite_and_unchanged(method):
  r, v, m, boot = random_inputs(3)
  rng = np.random.default_rng(3)
  lam = rng.uniform(0, 1, r.shape).astype(np.float32)
  for lam_ in (0.9, lam):
    def loss(r, v, lam_=lam_):
      adv, ret = gae(r, v, m, gamma=0.99, lam=lam_, bootstrap_value=boot, method=method)
      return jnp.sum(adv ** 2) + jnp.sum(ret)
    g_clean = jax.grad(loss, argnums=(0, 1))(r, v)
    g_dirty = jax.grad(loss, argnums=(0, 1))(_poison(r, m, np.nan), _poison(v, m, np.inf))
    for c, d in zip(g_clean, g_dirty):
      np.testing.assert_array_equal(np.asarray(d), np.asarray(c))
      assert np.all(np.asarray(c)[m == 0] == 0)


# ------------------------------------------------------------------------------------
# Documented numeric ranges: a concrete number outside raises, naming the argument.

_R, _V, _M, _ = random_inputs(20, B=4, T=6)


@pytest.mark.parametrize("call,name", [
    (lambda: gae(_R, _V, _M, lam=1.5), "lam"),
    (lambda: gae(_R, _V, _M, gamma=-1), "gamma"),
    (lambda: gae(_R, _V, _M, gamma=1.01), "gamma"),
    (lambda: gae(_R, _V, _M, lam=float("nan")), "lam"),
    (lambda: gae(_R, _V, _M, lam=-0.1, transparent_mask=False), "lam"),
    (lambda: lambda_returns(_R, _V, _M, lam=2.0), "lam"),
    (lambda: discounted_returns(_R, _M, gamma=-0.5), "gamma"),
    (lambda: nstep_returns(_R, _V, _M, n=2, gamma=1.5), "gamma"),
    (lambda: nstep_returns(_R, _V, _M, n=True), "`n`"),
    (lambda: hybrid_advantages(_R, _V, _M, n=2, mix=2.0), "mix"),
    (lambda: hybrid_advantages(_R, _V, _M, n=2, mix=-0.1), "mix"),
    (lambda: hybrid_advantages(_R, _V, _M, n=2, lam=1.2), "lam"),
    (lambda: adv_lib.decoupled_gae(_R, _V, _M, lam_policy=1.1, lam_value=1.0),
     "lam_policy"),
    (lambda: adv_lib.decoupled_gae(_R, _V, _M, lam_policy=0.9, lam_value=-1),
     "lam_value"),
    (lambda: adv_lib.decoupled_gae(_R, _V, _M, lam_policy=np.zeros(3), lam_value=1.0),
     "lam_policy"),
    (lambda: adv_lib.length_adaptive_lambda(_M, alpha=0.0), "alpha"),
    (lambda: adv_lib.length_adaptive_lambda(_M, alpha=-1), "alpha"),
    (lambda: adv_lib.length_adaptive_lambda(_M[0]), "mask"),
    (lambda: reinforce_pp_advantages(_R, _M, eps=-1), "eps"),
    (lambda: reinforce_pp_advantages(_R, _M, gamma=3.0), "gamma"),
    (lambda: reinforce_pp_advantages(_R, _M, gamma=3.0, group_size=2), "gamma"),
    (lambda: group_advantages(np.zeros(4, np.float32), group_size=2, eps=-1e-6), "eps"),
    (lambda: group_advantages(np.zeros(4, np.float32), group_size=2, ddof=-1), "ddof"),
    (lambda: grpo_advantages(np.zeros(4, np.float32), group_size=2, eps=-1), "eps"),
])
def test_out_of_range_numbers_raise_naming_the_argument(call, name):
  with pytest.raises(ValueError, match=name):
    call()


def test_range_edges_and_traced_values_are_accepted():
  for g, l in ((0, 0), (1, 1), (0.0, 1.0)):
    gae(_R, _V, _M, gamma=g, lam=l)
  adv_lib.length_adaptive_lambda(_M, alpha=1e-9)
  hybrid_advantages(_R, _V, _M, n=1, mix=0)
  # traced values cannot be checked: they are used as given, under jit
  out = jax.jit(lambda l: gae(_R, _V, _M, lam=l)[0])(1.5)
  assert np.all(np.isfinite(np.asarray(out)))
