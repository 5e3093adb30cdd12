"""Tests for jaxrl_llm.control: adaptive KL and adaptive clip controllers."""

from __future__ import annotations

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_llm import control
from jaxrl_llm.control import (
    AdaptiveClipState,
    AdaptiveKLState,
    adaptive_clip_init,
    adaptive_clip_update,
    adaptive_kl_init,
    adaptive_kl_update,
)
from jaxrl_llm.losses import aggregate, ppo_policy_loss
from tests.utils import assert_close, assert_no_recompile, random_mask


def ref_kl_controller(coef, target, horizon, kls, n_steps):
  """Plain-Python transcription of AdaptiveKLController.update, applied in sequence."""
  out = []
  for kl in kls:
    if np.isfinite(kl):
      error = min(max(kl / target - 1.0, -0.2), 0.2)
      coef = coef * (1.0 + error * n_steps / horizon)
    out.append(coef)
  return out


def ref_clip_controller(eps, target, lo, hi, rate, observations):
  out = []
  for obs in observations:
    if np.isfinite(obs):
      error = min(max(obs / target - 1.0, -1.0), 1.0)
      eps = min(max(eps * np.exp(-rate * error), lo), hi)
    out.append(eps)
  return out


def _all_f32_scalars(state):
  return all(jnp.asarray(x).dtype == jnp.float32 and jnp.shape(x) == () for x in state)


# ---------------------------------------------------------------------- adaptive KL


@pytest.mark.parametrize("kl,expected", [
    (0.5, 0.1 * (1 + 0.2 * 10 / 100)),    # error 4.0 clipped to +0.2 -> 0.102
    (0.11, 0.1 * (1 + 0.1 * 10 / 100)),   # error 0.1 -> 0.101
    (0.1, 0.1),                           # on target
    (0.0, 0.1 * (1 - 0.2 * 10 / 100)),    # error -1 clipped to -0.2 -> 0.098
])
def test_adaptive_kl_fixture(kl, expected):
  state = adaptive_kl_init(0.1, target=0.1, horizon=100)
  new = adaptive_kl_update(state, kl, 10)
  assert isinstance(new, AdaptiveKLState) and _all_f32_scalars(new)
  assert_close(new.coef, expected, atol=1e-7)
  assert_close((new.target, new.horizon), (state.target, state.horizon), atol=0)


def test_adaptive_kl_defaults_match_verl():
  state = adaptive_kl_init()
  assert_close(tuple(state), (0.001, 0.1, 10000.0), atol=1e-9)


@jax.jit
def _kl_scan(state, kls, n_steps):
  def body(s, kl):
    s = adaptive_kl_update(s, kl, n_steps)
    return s, s.coef
  return jax.lax.scan(body, state, kls)


@settings(max_examples=20, deadline=None)
@given(kls=st.lists(st.one_of(st.floats(0.0, 2.0), st.just(float("nan")),
                              st.just(float("inf"))), min_size=1, max_size=12),
       n_steps=st.integers(1, 512))
def test_adaptive_kl_scan_matches_reference(kls, n_steps):
  state = adaptive_kl_init(0.05, target=0.2, horizon=1000)
  kls_arr = jnp.asarray(np.resize(np.asarray(kls, np.float32), 12))
  _, coefs = _kl_scan(state, kls_arr, jnp.float32(n_steps))
  expected = ref_kl_controller(0.05, 0.2, 1000.0, np.asarray(kls_arr, np.float64), n_steps)
  assert_close(coefs, expected, rtol=1e-5, atol=1e-9)


def test_adaptive_kl_jit_no_recompile_and_errors():
  state = adaptive_kl_init(0.01, target=0.1, horizon=10000)
  assert_no_recompile(adaptive_kl_update, (state, 0.3, 64), (state, 0.01, 128),
                      (adaptive_kl_update(state, 0.2, 32), jnp.nan, 256))
  nan_state = adaptive_kl_update(state, jnp.nan, 64)
  assert float(nan_state.coef) == float(state.coef)
  with pytest.raises(ValueError, match="target"):
    adaptive_kl_init(0.01, target=0.0)
  with pytest.raises(ValueError, match="horizon"):
    adaptive_kl_init(0.01, horizon=-1)
  with pytest.raises(ValueError, match="current_kl"):
    adaptive_kl_update(state, jnp.ones(3), 64)


@pytest.mark.parametrize("name,call", [
    ("init_coef", lambda: adaptive_kl_init(-1)),
    ("init_coef", lambda: adaptive_kl_init(float("nan"))),
    ("target", lambda: adaptive_kl_init(0.1, target=-0.1)),
    ("horizon", lambda: adaptive_kl_init(0.1, horizon=0)),
    ("n_steps", lambda: adaptive_kl_update(adaptive_kl_init(0.1), 0.1, -1)),
    ("init_eps", lambda: adaptive_clip_init(5.0)),
    ("init_eps", lambda: adaptive_clip_init(0.01)),
    ("init_eps", lambda: adaptive_clip_init(0.2, eps_min=0.25, eps_max=0.3)),
    ("eps_min", lambda: adaptive_clip_init(0.2, eps_min=-0.1)),
])
def test_controller_range_errors_name_the_argument(name, call):
  with pytest.raises(ValueError, match=f"`{name}`"):
    call()


def test_controller_range_boundaries_and_traced_values():
  assert float(adaptive_kl_init(0.0).coef) == 0.0  # no KL: allowed, stays 0
  assert float(adaptive_clip_init(0.3).eps) == pytest.approx(0.3)   # == eps_max
  assert float(adaptive_clip_init(0.05).eps) == pytest.approx(0.05)  # == eps_min
  # A traced init_eps cannot be checked: it is clipped into [eps_min, eps_max].
  eps = jax.jit(lambda e: adaptive_clip_init(e).eps)(5.0)
  assert float(eps) == pytest.approx(0.3)


# -------------------------------------------------------------------- adaptive clip


def test_adaptive_clip_fixture_and_state():
  state = adaptive_clip_init(0.2, target=0.02, rate=0.1)
  assert isinstance(state, AdaptiveClipState) and _all_f32_scalars(state)
  assert_close(tuple(state), (0.2, 0.02, 0.05, 0.3, 0.1), atol=1e-8)
  assert_close(adaptive_clip_update(state, 0.04).eps, 0.2 * np.exp(-0.1), atol=1e-7)
  assert_close(adaptive_clip_update(state, 0.01).eps, 0.2 * np.exp(0.05), atol=1e-7)
  assert_close(adaptive_clip_update(state, 0.02).eps, 0.2, atol=1e-7)
  # Saturation: at most a factor e^{-rate} per update, whatever the excess.
  assert_close(adaptive_clip_update(state, 100.0).eps, 0.2 * np.exp(-0.1), atol=1e-7)
  clipfrac = adaptive_clip_init(metric="clipfrac")
  assert_close(clipfrac.target, 0.15, atol=1e-8)
  # init_eps outside the bounds: a Python number raises (issue 14), a traced one is
  # clipped into them.
  with pytest.raises(ValueError, match="init_eps"):
    adaptive_clip_init(0.9)
  assert_close(jax.jit(lambda e: adaptive_clip_init(e).eps)(0.9), 0.3, atol=1e-8)


@settings(max_examples=25, deadline=None)
@given(eps=st.floats(0.05, 0.3), a=st.floats(0.0, 0.2), b=st.floats(0.0, 0.2),
       rate=st.floats(0.01, 1.0))
def test_adaptive_clip_monotone_and_bounded(eps, a, b, rate):
  state = adaptive_clip_init(eps, target=0.02, eps_min=0.05, eps_max=0.3, rate=rate)
  low, high = sorted((a, b))
  eps_low = float(adaptive_clip_update(state, low).eps)
  eps_high = float(adaptive_clip_update(state, high).eps)
  assert eps_high <= eps_low + 1e-7  # more observed KL -> smaller (or equal) epsilon
  for new in (eps_low, eps_high):
    assert 0.05 - 1e-7 <= new <= 0.3 + 1e-7
  base = float(state.eps)
  if high > 0.02:
    assert eps_high <= base + 1e-7
  if low < 0.02:
    assert eps_low >= base - 1e-7


def test_adaptive_clip_scan_converges_to_bounds():
  state = adaptive_clip_init(0.2, target=0.02, rate=0.05)

  def run(observed):
    def body(s, obs):
      s = adaptive_clip_update(s, obs)
      return s, s.eps
    return jax.lax.scan(body, state, observed)

  run = jax.jit(run)
  final, path = run(jnp.full((200,), 0.5, jnp.float32))      # KL stays far above target
  assert_close(final.eps, 0.05, atol=1e-7)
  assert np.all(np.diff(np.asarray(path)) <= 0)
  final, path = run(jnp.zeros((200,), jnp.float32))          # policy barely moves
  assert_close(final.eps, 0.3, atol=1e-7)
  assert np.all(np.diff(np.asarray(path)) >= 0)
  final, _ = run(jnp.full((200,), 0.02, jnp.float32))        # on target: unchanged
  assert_close(final.eps, 0.2, atol=1e-6)
  assert run._cache_size() == 1

  rng = np.random.default_rng(0)
  observed = rng.exponential(0.02, 60).astype(np.float32)
  observed[[5, 17]] = [np.nan, np.inf]          # skipped steps leave the state alone
  _, path = run(jnp.asarray(np.resize(observed, 200)))
  expected = ref_clip_controller(0.2, 0.02, 0.05, 0.3, 0.05,
                                 np.resize(observed, 200).astype(np.float64))
  assert_close(path, expected, rtol=1e-4, atol=1e-7)


def test_adaptive_clip_nonfinite_no_recompile_and_errors():
  state = adaptive_clip_init(0.2)
  for bad in (jnp.nan, jnp.inf, -jnp.inf):
    assert_close(tuple(adaptive_clip_update(state, bad)), tuple(state), atol=0)
  other = adaptive_clip_init(0.1, target=0.5, eps_min=0.01, eps_max=0.4, rate=0.3)
  assert_no_recompile(adaptive_clip_update, (state, 0.01), (state, jnp.nan), (other, 3.0))
  with pytest.raises(ValueError, match="metric"):
    adaptive_clip_init(metric="entropy")
  with pytest.raises(ValueError, match="target"):
    adaptive_clip_init(target=-0.1)
  with pytest.raises(ValueError, match="target"):
    adaptive_clip_init(target=1.5, metric="clipfrac")
  with pytest.raises(ValueError, match="eps_max"):
    adaptive_clip_init(eps_min=0.3, eps_max=0.1)
  with pytest.raises(ValueError, match="rate"):
    adaptive_clip_init(rate=0.0)
  with pytest.raises(ValueError, match="observed"):
    adaptive_clip_update(state, jnp.ones(2))


# ----------------------------------------------- controllers and schedules feeding losses


def _batch(seed=0, batch=4, time=6):
  rng = np.random.default_rng(seed)
  mask = random_mask(rng, batch, time)
  logp = -rng.exponential(1.0, (batch, time)).astype(np.float32)
  old = (logp + rng.normal(0, 0.3, (batch, time))).astype(np.float32)
  adv = rng.standard_normal(batch).astype(np.float32)
  return logp, old, adv, mask


def test_linear_schedule_feeds_clip_low_without_recompiling():
  """Dynamic clipping: optax.linear_schedule(0.2, 0.05, n) evaluated at the step."""
  logp, old, adv, mask = _batch()
  schedule = optax.linear_schedule(0.2, 0.05, transition_steps=10)

  def loss_at(step):
    per_tok, _ = ppo_policy_loss(logp, old, adv, mask, clip_low=schedule(step))
    return aggregate(per_tok, mask)

  steps = [(jnp.asarray(s),) for s in (0, 3, 10, 50)]
  assert_no_recompile(loss_at, *steps)
  jitted = jax.jit(loss_at)
  at_eps = jax.jit(lambda eps: aggregate(
      ppo_policy_loss(logp, old, adv, mask, clip_low=eps)[0], mask))
  for step, eps in [(0, 0.2), (3, 0.155), (10, 0.05), (50, 0.05)]:
    assert_close(jitted(jnp.asarray(step)), at_eps(eps), atol=1e-6)


def test_adaptive_clip_drives_ppo_in_a_scan():
  """A train-loop-shaped scan: the loss metric updates the controller every step."""
  logp, old, adv, mask = _batch(1)
  state = adaptive_clip_init(0.2, target=0.001, rate=0.2)  # observed KL >> target

  def step(s, _):
    _, metrics = ppo_policy_loss(logp, old, adv, mask, clip_low=s.eps)
    s = adaptive_clip_update(s, metrics["approx_kl"])
    return s, s.eps

  run = jax.jit(lambda s: jax.lax.scan(step, s, None, length=30))
  final, path = run(state)
  assert_close(final.eps, 0.05, atol=1e-7)
  assert np.all(np.diff(np.asarray(path)) <= 0)
  run(adaptive_clip_init(0.25, target=0.5, rate=0.1))  # new values: same program
  assert run._cache_size() == 1


def test_doctests():
  result = doctest.testmod(control, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 5 and result.failed == 0
