"""Tests for jaxrl_llm.logprobs: token_logprobs and token_logprobs_from_hidden."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_llm.logprobs import default_chunk_size, token_logprobs, token_logprobs_from_hidden
from tests.utils import assert_close, assert_no_recompile, random_mask

# ------------------------------------------------------------------------------ helpers


def np_logprobs_loop(logits, targets, mask):
  """Plain float64 loop reference: (logp, entropy), 0 where masked."""
  logits = np.asarray(logits, np.float64)
  batch, time, _ = logits.shape
  logp = np.zeros((batch, time))
  ent = np.zeros((batch, time))
  for b in range(batch):
    for t in range(time):
      if mask[b, t] <= 0:
        continue
      z = logits[b, t]
      m = z.max()
      lse = m + math.log(sum(math.exp(zi - m) for zi in z))
      logp[b, t] = z[targets[b, t]] - lse
      ent[b, t] = -sum(math.exp(zi - lse) * (zi - lse) for zi in z)
  return logp, ent


def naive_from_hidden(hidden, lm_head, targets, mask=None, temperature=1.0):
  """Full-logits reference (float32), differentiable by plain autodiff."""
  z = jnp.einsum("btd,dv->btv", jnp.asarray(hidden, jnp.float32),
                 jnp.asarray(lm_head, jnp.float32)) / temperature
  log_q = jax.nn.log_softmax(z, axis=-1)
  logp = jnp.take_along_axis(log_q, targets[..., None], axis=-1)[..., 0]
  ent = -jnp.sum(jnp.exp(log_q) * log_q, axis=-1)
  if mask is None:
    return logp, ent
  valid = mask > 0
  return jnp.where(valid, logp, 0.0), jnp.where(valid, ent, 0.0)


def random_problem(seed, batch, time, dim, vocab, scale=1.0):
  rng = np.random.default_rng(seed)
  hidden = jnp.asarray(rng.normal(size=(batch, time, dim)) * scale, jnp.float32)
  lm_head = jnp.asarray(rng.normal(size=(dim, vocab)) / math.sqrt(dim), jnp.float32)
  targets = jnp.asarray(rng.integers(0, vocab, size=(batch, time)), jnp.int32)
  mask = jnp.asarray(random_mask(rng, batch, time))
  return hidden, lm_head, targets, mask


# One problem shape shared by the comparison tests, so jit caches are reused.
SHAPE = dict(batch=3, time=13, dim=6, vocab=17)
CHUNKS = (1, 5, None)  # 5 does not divide T=13; None -> T (one chunk)


def _ref_and_ours_loss(hidden, lm_head, targets, mask, temperature, lp_coef, ent_coef,
                       chunk_size, return_entropy):
  batch, time = targets.shape
  g_lp = lp_coef * jnp.linspace(-1.0, 2.0, batch * time).reshape(batch, time)
  g_ent = ent_coef * jnp.cos(jnp.arange(batch * time, dtype=jnp.float32)).reshape(
      batch, time)

  def ours(h, w, t):
    return token_logprobs_from_hidden(h, w, targets, mask=mask, chunk_size=chunk_size,
                                      return_entropy=return_entropy, temperature=t)

  def ref(h, w, t):
    out = naive_from_hidden(h, w, targets, mask, t)
    return out if return_entropy else out[0]

  def loss(fn):
    def inner(h, w, t):
      out = fn(h, w, t)
      if return_entropy:
        return jnp.sum(g_lp * out[0]) + jnp.sum(g_ent * out[1])
      return jnp.sum(g_lp * out)
    return inner

  return ours, ref, loss


@functools.partial(jax.jit, static_argnames=("chunk_size", "return_entropy"))
def compare(hidden, lm_head, targets, mask, temperature, lp_coef=1.0, ent_coef=0.0, *,
            chunk_size, return_entropy=True):
  """(ours values, ref values, ours grads, ref grads) wrt (hidden, lm_head, temperature)."""
  ours, ref, loss = _ref_and_ours_loss(hidden, lm_head, targets, mask, temperature,
                                       lp_coef, ent_coef, chunk_size, return_entropy)
  args = (hidden, lm_head, temperature)
  return (ours(*args), ref(*args), jax.grad(loss(ours), argnums=(0, 1, 2))(*args),
          jax.grad(loss(ref), argnums=(0, 1, 2))(*args))


def assert_compare(result, grad_tol=1e-5):
  ours_v, ref_v, ours_g, ref_g = result
  assert_close(ours_v, ref_v)
  assert_close(ours_g[:2], ref_g[:2], atol=grad_tol, rtol=grad_tol)
  assert_close(ours_g[2], ref_g[2], atol=1e-4, rtol=1e-4)  # a sum over all B*T*V terms


forward = jax.jit(token_logprobs_from_hidden,
                  static_argnames=("chunk_size", "return_entropy"))


# ------------------------------------------------------------------------ token_logprobs


@functools.partial(jax.jit, static_argnames=("return_entropy",))
def jit_token_logprobs(logits, targets, mask=None, return_entropy=False):
  return token_logprobs(logits, targets, mask, return_entropy=return_entropy)


def test_token_logprobs_hand_fixture():
  # Probabilities chosen by hand: rows [1/2, 1/4, 1/4] and [0.1, 0.1, 0.8].
  probs = np.array([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8], [1 / 3, 1 / 3, 1 / 3]]])
  logits = jnp.asarray(np.log(probs) + 7.0, jnp.float32)  # shift must not matter
  targets = jnp.array([[1, 2, 0]])
  mask = jnp.array([[1, 1, 0]])
  logp, ent = token_logprobs(logits, targets, mask, return_entropy=True)
  assert logp.dtype == jnp.float32 and logp.shape == (1, 3)
  assert_close(logp, [[math.log(0.25), math.log(0.8), 0.0]])
  h0 = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))  # = 1.5 log 2
  h1 = -(2 * 0.1 * math.log(0.1) + 0.8 * math.log(0.8))
  assert_close(ent, [[h0, h1, 0.0]])
  assert abs(h0 - 1.5 * math.log(2)) < 1e-12


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_token_logprobs_matches_numpy_loop(dtype):
  rng = np.random.default_rng(1)
  batch, time, vocab = 3, 7, 6
  logits = (rng.normal(size=(batch, time, vocab)) * 3).astype(np.float32)
  logits = np.asarray(jnp.asarray(logits, dtype).astype(jnp.float32))  # what the fn sees
  targets = rng.integers(0, vocab, size=(batch, time))
  mask = random_mask(rng, batch, time)
  logp, ent = jit_token_logprobs(jnp.asarray(logits, dtype), jnp.asarray(targets),
                                 jnp.asarray(mask), return_entropy=True)
  ref_logp, ref_ent = np_logprobs_loop(logits, targets, mask)
  assert logp.dtype == jnp.float32 and ent.dtype == jnp.float32
  assert_close(logp, ref_logp, atol=2e-5)
  assert_close(ent, ref_ent, atol=2e-5)


def test_token_logprobs_masked_garbage_and_bad_targets():
  rng = np.random.default_rng(2)
  logits = rng.normal(size=(2, 4, 5)).astype(np.float32)
  targets = rng.integers(0, 5, size=(2, 4))
  mask = np.array([[1, 1, 0, 1], [0, 1, 1, 0]], np.float32)
  clean = jit_token_logprobs(jnp.asarray(logits), jnp.asarray(targets),
                             jnp.asarray(mask), return_entropy=True)
  dirty_logits = logits.copy()
  dirty_logits[mask == 0] = np.nan
  dirty_targets = np.where(mask > 0, targets, -100)
  dirty = jit_token_logprobs(jnp.asarray(dirty_logits), jnp.asarray(dirty_targets),
                             jnp.asarray(mask), return_entropy=True)
  assert_close(dirty, clean, atol=0, rtol=0)
  assert float(jnp.abs(dirty[0][mask == 0]).sum()) == 0.0
  ent_grad = jax.jit(jax.grad(lambda z: token_logprobs(
      z, jnp.asarray(dirty_targets), jnp.asarray(mask), return_entropy=True)[1].sum()))
  g = ent_grad(jnp.asarray(dirty_logits))
  assert np.all(np.isfinite(np.asarray(g)))
  # Out-of-range targets at valid positions are clipped into [0, V).
  out = jit_token_logprobs(jnp.asarray(logits), jnp.full((2, 4), 99), None)
  assert_close(out, jit_token_logprobs(jnp.asarray(logits), jnp.full((2, 4), 4), None))


def test_token_logprobs_neg_inf_logits():
  logits = jnp.array([[[0.0, -jnp.inf, 0.0]]])
  logp, ent = jit_token_logprobs(logits, jnp.array([[0]]), return_entropy=True)
  assert_close(logp, [[math.log(0.5)]])
  assert_close(ent, [[math.log(2.0)]])
  ent_grad = jax.jit(jax.grad(lambda z: token_logprobs(
      z, jnp.array([[0]]), return_entropy=True)[1].sum()))
  g = ent_grad(logits)
  assert np.all(np.isfinite(np.asarray(g)))
  assert float(g[0, 0, 1]) == 0.0


def test_token_logprobs_grad_matches_log_softmax():
  rng = np.random.default_rng(3)
  logits = jnp.asarray(rng.normal(size=(2, 5, 7)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 7, size=(2, 5)))
  mask = jnp.asarray(random_mask(rng, 2, 5))
  w = jnp.asarray(rng.normal(size=(2, 5)), jnp.float32)

  def ours(z):
    lp, ent = token_logprobs(z, targets, mask, return_entropy=True)
    return jnp.sum(w * lp) + 0.1 * jnp.sum(ent)

  def ref(z):
    log_q = jax.nn.log_softmax(z)
    lp = jnp.take_along_axis(log_q, targets[..., None], -1)[..., 0]
    ent = -jnp.sum(jnp.exp(log_q) * log_q, -1)
    return jnp.sum(w * lp * mask) + 0.1 * jnp.sum(ent * mask)

  assert_close(jax.jit(jax.grad(ours))(logits), jax.jit(jax.grad(ref))(logits))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), vocab=st.sampled_from([1, 7]),
       shift=st.floats(-50.0, 50.0), scale=st.floats(0.0, 20.0))
def test_token_logprobs_properties(seed, vocab, shift, scale):
  rng = np.random.default_rng(seed)
  logits = (rng.normal(size=(2, 3, vocab)) * scale).astype(np.float32)
  targets = jnp.asarray(rng.integers(0, vocab, size=(2, 3)))
  mask = jnp.asarray(random_mask(rng, 2, 3))
  logp, ent = jit_token_logprobs(jnp.asarray(logits), targets, mask, return_entropy=True)
  # log p <= 0, 0 <= H <= log V, invariant to a constant shift of the logits.
  assert np.all(np.asarray(logp) <= 1e-6)
  assert np.all(np.asarray(ent) >= -1e-5)
  assert np.all(np.asarray(ent) <= math.log(vocab) + 1e-5)
  shifted = jit_token_logprobs(jnp.asarray(logits + np.float32(shift)), targets, mask,
                               return_entropy=True)
  assert_close(shifted, (logp, ent), atol=1e-4, rtol=1e-4)
  # The probabilities of all V possible targets sum to 1 at every position.
  all_targets = jnp.broadcast_to(jnp.arange(vocab)[:, None, None], (vocab, 2, 3))
  all_lp = jax.vmap(jit_token_logprobs, in_axes=(None, 0))(jnp.asarray(logits), all_targets)
  assert_close(jnp.exp(all_lp).sum(0), jnp.ones((2, 3)), atol=1e-5)


def test_token_logprobs_jit_vmap():
  rng = np.random.default_rng(4)
  logits = jnp.asarray(rng.normal(size=(3, 2, 4, 5)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 5, size=(3, 2, 4)))
  per_slice = jnp.stack([jit_token_logprobs(logits[i], targets[i]) for i in range(3)])
  assert_close(jax.jit(jax.vmap(token_logprobs))(logits, targets), per_slice)


def test_token_logprobs_bad_inputs():
  z = jnp.zeros((2, 3, 4))
  with pytest.raises(ValueError, match="logits"):
    token_logprobs(jnp.zeros((2, 3)), jnp.zeros((2, 3), jnp.int32))
  with pytest.raises(ValueError, match="logits"):
    token_logprobs(jnp.zeros((2, 3, 4), jnp.int32), jnp.zeros((2, 3), jnp.int32))
  with pytest.raises(ValueError, match="targets"):
    token_logprobs(z, jnp.zeros((2, 3)))
  with pytest.raises(ValueError, match="targets"):
    token_logprobs(z, jnp.zeros((2, 4), jnp.int32))
  with pytest.raises(ValueError, match="mask"):
    token_logprobs(z, jnp.zeros((2, 3), jnp.int32), jnp.ones((3, 2)))


# -------------------------------------------------------------------------- from hidden


def test_from_hidden_hand_fixture():
  # D=2, V=3. With h = (1, 1) and W columns (0,0), (1,1), (0,0): logits (0, 2, 0).
  hidden = jnp.array([[[1.0, 1.0], [1.0, 1.0], [0.5, -0.5]]])
  lm_head = jnp.array([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]])
  targets = jnp.array([[1, 0, 2]])
  norm = math.log(2 + math.exp(2.0))
  logp, ent = forward(hidden, lm_head, targets, chunk_size=2, return_entropy=True)
  p1, p0 = math.exp(2.0 - norm), math.exp(-norm)
  assert_close(logp, [[2.0 - norm, -norm, -math.log(3.0)]])
  h_peaked = -(p1 * math.log(p1) + 2 * p0 * math.log(p0))
  assert_close(ent, [[h_peaked, h_peaked, math.log(3.0)]])
  # Temperature 2 halves the logits: (0, 1, 0).
  logp_t = forward(hidden, lm_head, targets, temperature=2.0)
  assert_close(logp_t[0, :2], [1.0 - math.log(2 + math.e), -math.log(2 + math.e)])
  # d logp_0 / d W for token 0 (target 1, h = (1, 1)): h^T (onehot - p), i.e. both rows
  # are (-p0, 1 - p1, -p0).
  g = jax.jit(jax.grad(lambda w: token_logprobs_from_hidden(
      hidden[:, :1], w, targets[:, :1]).sum()))(lm_head)
  assert_close(g, [[-p0, 1 - p1, -p0], [-p0, 1 - p1, -p0]])


@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_from_hidden_matches_naive_values_and_grads(chunk_size):
  hidden, lm_head, targets, mask = random_problem(5, **SHAPE, scale=2.0)
  for ent_coef in (0.0, 0.37):  # traced: the second call reuses the compilation
    assert_compare(compare(hidden, lm_head, targets, mask, 0.7, 1.0, ent_coef,
                           chunk_size=chunk_size))


def test_from_hidden_logp_only_and_entropy_only_losses():
  hidden, lm_head, targets, mask = random_problem(6, **SHAPE)
  # Without entropy output: values and grads of a logp-only loss.
  assert_compare(compare(hidden, lm_head, targets, mask, 1.3, chunk_size=5,
                         return_entropy=False))
  # A pure entropy-bonus loss: the gradient flows only through the entropy.
  assert_compare(compare(hidden, lm_head, targets, mask, 1.3, 0.0, 1.0, chunk_size=5))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), chunk=st.sampled_from(CHUNKS),
       temperature=st.floats(0.25, 4.0), scale=st.floats(0.0, 5.0),
       ent_coef=st.floats(-1.0, 1.0))
def test_from_hidden_property_matches_naive(seed, chunk, temperature, scale, ent_coef):
  hidden, lm_head, targets, mask = random_problem(seed, **SHAPE, scale=scale)
  result = compare(hidden, lm_head, targets, mask, temperature, 1.0, ent_coef,
                   chunk_size=chunk)
  assert_compare(result, grad_tol=2e-5)
  logp, ent = result[0]
  assert np.all(np.asarray(logp) <= 1e-6)
  assert np.all(np.asarray(ent) >= -1e-5)
  assert np.all(np.asarray(ent) <= math.log(SHAPE["vocab"]) + 1e-5)


def test_from_hidden_numpy_loop_reference():
  hidden, lm_head, targets, mask = random_problem(7, **SHAPE, scale=3.0)
  logits = np.einsum("btd,dv->btv", np.asarray(hidden, np.float64),
                     np.asarray(lm_head, np.float64)) / 0.5
  ref = np_logprobs_loop(logits, np.asarray(targets), np.asarray(mask))
  out = forward(hidden, lm_head, targets, mask=mask, chunk_size=5, return_entropy=True,
                temperature=0.5)
  assert_close(out, ref, atol=2e-5)


def test_from_hidden_masking():
  hidden, lm_head, targets, mask = random_problem(8, **SHAPE)
  mask = mask.at[0, 2].set(0.0).at[0, 0].set(1.0)
  invalid = np.asarray(mask) == 0
  clean = forward(hidden, lm_head, targets, mask=mask, chunk_size=5, return_entropy=True)
  dirty_h = jnp.where(jnp.asarray(invalid)[..., None], jnp.nan, hidden)
  dirty_y = jnp.where(jnp.asarray(invalid), -100, targets)
  dirty = forward(dirty_h, lm_head, dirty_y, mask=mask, chunk_size=5, return_entropy=True)
  assert_close(dirty, clean, atol=0, rtol=0)
  assert np.all(np.asarray(dirty[0])[invalid] == 0)
  assert np.all(np.asarray(dirty[1])[invalid] == 0)

  @jax.jit
  def grads(h, y):
    def loss(h, w):
      lp, ent = token_logprobs_from_hidden(h, w, y, mask=mask, chunk_size=5,
                                           return_entropy=True)
      return jnp.sum(lp) + jnp.sum(ent)
    return jax.grad(loss, argnums=(0, 1))(h, lm_head)

  gh, gw = grads(dirty_h, dirty_y)
  assert np.all(np.isfinite(np.asarray(gw)))
  assert np.all(np.asarray(gh)[invalid] == 0)
  assert_close((gh, gw), grads(hidden, targets), atol=0, rtol=0)


def test_from_hidden_bf16_inputs():
  hidden, lm_head, targets, mask = random_problem(9, **SHAPE)
  h16, w16 = hidden.astype(jnp.bfloat16), lm_head.astype(jnp.bfloat16)

  @jax.jit
  def run(h, w):
    def loss(fn):
      return lambda h, w: jnp.sum(fn(h, w)[0]) + 0.1 * jnp.sum(fn(h, w)[1])
    ours = lambda h, w: token_logprobs_from_hidden(h, w, targets, mask=mask, chunk_size=5,
                                                   return_entropy=True)
    ref = lambda h, w: naive_from_hidden(h, w, targets, mask)
    h32, w32 = h.astype(jnp.float32), w.astype(jnp.float32)
    return (ours(h, w), ref(h32, w32), jax.grad(loss(ours), argnums=(0, 1))(h, w),
            jax.grad(loss(ref), argnums=(0, 1))(h32, w32))

  (logp, ent), ref, (gh, gw), ref_g = run(h16, w16)
  assert logp.dtype == jnp.float32 and ent.dtype == jnp.float32
  # Forward: exact float32 math on the bf16 values.
  assert_close((logp, ent), ref, atol=1e-5)
  # Backward: bf16 cotangents into the matmuls, results rounded to bf16.
  assert gh.dtype == jnp.bfloat16 and gw.dtype == jnp.bfloat16
  assert_close((gh, gw), ref_g, atol=3e-2, rtol=3e-2)


def test_from_hidden_jit_vmap_and_no_recompile():
  hidden, lm_head, targets, mask = random_problem(10, **SHAPE)
  stacked_h = jnp.stack([hidden, hidden * 0.5, -hidden])

  def f(h, w, y, m, t):
    return token_logprobs_from_hidden(h, w, y, mask=m, chunk_size=5, return_entropy=True,
                                      temperature=t)

  vm = jax.jit(jax.vmap(f, in_axes=(0, None, None, None, None)))(
      stacked_h, lm_head, targets, mask, 0.7)
  ref = jax.jit(jax.vmap(lambda h: naive_from_hidden(h, lm_head, targets, mask, 0.7)))(
      stacked_h)
  assert_close(vm, ref)
  # Per-example gradients wrt lm_head under vmap.
  per_ex = jax.jit(jax.vmap(jax.grad(lambda w, h: f(h, w, targets, mask, 0.7)[0].sum()),
                            in_axes=(None, 0)))(lm_head, stacked_h)
  per_ex_ref = jax.jit(jax.vmap(jax.grad(
      lambda w, h: naive_from_hidden(h, w, targets, mask, 0.7)[0].sum()),
                                in_axes=(None, 0)))(lm_head, stacked_h)
  assert_close(per_ex, per_ex_ref)
  # Changing the (traced) temperature does not recompile, forward or backward.
  assert_no_recompile(f, *[(hidden, lm_head, targets, mask, jnp.float32(t))
                           for t in (1.0, 0.5, 2.0)])
  grad_fn = jax.grad(lambda h, w, t: f(h, w, targets, mask, t)[0].sum(), argnums=(0, 1))
  assert_no_recompile(grad_fn, *[(hidden, lm_head, t) for t in (1.0, 0.7)])


def test_default_chunk_size():
  assert default_chunk_size(1, 100) == 100
  assert default_chunk_size(1, 5000) == 1024
  assert default_chunk_size(4, 5000) == 256
  assert default_chunk_size(5000, 7) == 1


def test_from_hidden_bad_inputs():
  h, w, y = jnp.zeros((2, 3, 4)), jnp.zeros((4, 5)), jnp.zeros((2, 3), jnp.int32)
  with pytest.raises(ValueError, match="hidden"):
    token_logprobs_from_hidden(jnp.zeros((2, 4)), w, y)
  with pytest.raises(ValueError, match="hidden"):
    token_logprobs_from_hidden(jnp.zeros((2, 3, 4), jnp.int32), w, y)
  with pytest.raises(ValueError, match="lm_head"):
    token_logprobs_from_hidden(h, jnp.zeros((4, 5, 1)), y)
  with pytest.raises(ValueError, match="lm_head"):
    token_logprobs_from_hidden(h, jnp.zeros((5, 4)), y)
  with pytest.raises(ValueError, match="targets"):
    token_logprobs_from_hidden(h, w, jnp.zeros((2, 3)))
  with pytest.raises(ValueError, match="targets"):
    token_logprobs_from_hidden(h, w, jnp.zeros((3, 2), jnp.int32))
  with pytest.raises(ValueError, match="mask"):
    token_logprobs_from_hidden(h, w, y, mask=jnp.ones((2, 4)))
  with pytest.raises(ValueError, match="chunk_size"):
    token_logprobs_from_hidden(h, w, y, chunk_size=0)
  with pytest.raises(ValueError, match="temperature"):
    token_logprobs_from_hidden(h, w, y, temperature=jnp.ones(2))
  for bad in (0, 0.0, -1.0, np.float32(0.0), float("nan")):
    with pytest.raises(ValueError, match="`temperature` must be > 0"):
      token_logprobs_from_hidden(h, w, y, temperature=bad)


def test_from_hidden_empty_sequence():
  out = token_logprobs_from_hidden(jnp.zeros((2, 0, 3)), jnp.zeros((3, 4)),
                                   jnp.zeros((2, 0), jnp.int32), return_entropy=True)
  assert out[0].shape == (2, 0) and out[1].shape == (2, 0)


def _compiled_temp_bytes(fn, *shapes):
  grad_fn = jax.value_and_grad(lambda h, w, y: jnp.sum(fn(h, w, y)), argnums=(0, 1))
  return jax.jit(grad_fn).lower(*shapes).compile().memory_analysis().temp_size_in_bytes


def test_from_hidden_memory_grows_with_chunk_not_sequence():
  batch, time, dim, vocab = 1, 2048, 64, 8192
  shapes = (jax.ShapeDtypeStruct((batch, time, dim), jnp.float32),
            jax.ShapeDtypeStruct((dim, vocab), jnp.float32),
            jax.ShapeDtypeStruct((batch, time), jnp.int32))
  naive = _compiled_temp_bytes(lambda h, w, y: naive_from_hidden(h, w, y)[0], *shapes)
  ours = _compiled_temp_bytes(
      lambda h, w, y: token_logprobs_from_hidden(h, w, y, chunk_size=256), *shapes)
  ours_ent = _compiled_temp_bytes(
      lambda h, w, y: sum(token_logprobs_from_hidden(h, w, y, chunk_size=256,
                                                     return_entropy=True)), *shapes)
  full_logits = batch * time * vocab * 4
  assert naive >= full_logits  # the naive one holds at least the whole [B, T, V] logits
  assert ours < 0.4 * naive, (ours, naive)
  assert ours_ent < 0.4 * naive, (ours_ent, naive)
  # Bounded by a few chunks of logits (XLA CPU keeps < 4 alive; an H200's scheduler
  # 5.3 chunks' worth) plus [B, T, D]-sized buffers, and independent of T: doubling T
  # adds [B, T, D]-sized buffers, never a chunk of logits per 256 tokens.
  chunk_logits = batch * 256 * vocab * 4
  assert ours < 6 * chunk_logits + 16 * batch * time * dim * 4, ours
  long_shapes = (jax.ShapeDtypeStruct((batch, 2 * time, dim), jnp.float32), shapes[1],
                 jax.ShapeDtypeStruct((batch, 2 * time), jnp.int32))
  ours_long = _compiled_temp_bytes(
      lambda h, w, y: token_logprobs_from_hidden(h, w, y, chunk_size=256), *long_shapes)
  assert ours_long - ours < 16 * batch * time * dim * 4, (ours, ours_long)


def test_a_zero_size_vocabulary_is_named():
  """Issue 28, fault 6: an empty vocabulary axis reached numpy's reduction error."""
  with pytest.raises(ValueError, match=r"^`logits` must have a non-empty vocabulary"):
    token_logprobs(jnp.zeros((1, 3, 0)), jnp.zeros((1, 3), jnp.int32))
  with pytest.raises(ValueError, match=r"^`lm_head` must have a non-empty vocabulary"):
    token_logprobs_from_hidden(jnp.zeros((1, 3, 4)), jnp.zeros((4, 0)),
                               jnp.zeros((1, 3), jnp.int32))
