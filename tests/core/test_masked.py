"""Tests for jaxrl_llm.masked."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_llm.masked import (
  explained_variance,
  masked_count,
  masked_mean,
  masked_std,
  masked_sum,
  masked_var,
  masked_whiten,
)
from tests.utils import assert_close, assert_no_recompile, random_mask


def test_fixtures_by_hand():
  x = np.array([1., 2., 3., 99.], np.float32)
  m = np.array([1, 1, 1, 0], np.float32)
  assert float(masked_sum(x, m)) == 6.0
  assert float(masked_mean(x, m)) == 2.0
  assert float(masked_var(x, m)) == 1.0              # ddof=1
  assert_close(masked_var(x, m, ddof=0), 2 / 3)
  assert_close(masked_whiten(x, m), [-1, 0, 1, 0], atol=1e-6)
  assert_close(masked_whiten(x, m, shift_mean=False), [1, 2, 3, 0], atol=1e-6)
  assert_close(explained_variance(np.array([1., 2., 3.]), np.array([1., 2., 3.])), 1.0)


def test_zero_and_one_valid_elements_are_finite():
  x = np.array([[5., 7.]], np.float32)
  for m in (np.zeros((1, 2)), np.array([[1., 0.]])):
    for fn in (masked_mean, masked_var, masked_std, masked_whiten):
      assert np.all(np.isfinite(np.asarray(fn(x, m))))
  assert float(masked_mean(x, np.zeros((1, 2)))) == 0.0
  assert float(masked_var(x, np.array([[1., 0.]]))) == 0.0
  assert_close(masked_whiten(x, np.array([[1., 0.]])), [[0., 0.]])
  assert float(explained_variance(x, x + 1, np.array([[1., 0.]]))) == 0.0


def test_nan_outside_mask_never_leaks():
  x = np.array([1., np.nan, np.inf, 3.], np.float32)
  m = np.array([1, 0, 0, 1], np.float32)
  assert float(masked_mean(x, m)) == 2.0
  assert np.all(np.isfinite(np.asarray(masked_whiten(x, m))))
  g = jax.grad(lambda x: masked_mean(x, m))(jnp.asarray(x))
  assert_close(g, [0.5, 0, 0, 0.5])


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), ddof=st.sampled_from([0, 1]))
def test_matches_numpy_on_random_masked_inputs(seed, ddof):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(4, 9)).astype(np.float32)
  m = random_mask(rng, 4, 9, all_masked_row=False)
  vals = x[m > 0].astype(np.float64)
  assert_close(masked_mean(x, m), vals.mean(), atol=1e-5)
  expected_var = vals.var(ddof=ddof) if len(vals) > ddof else 0.0
  assert_close(masked_var(x, m, ddof=ddof), expected_var, atol=1e-5)
  w = np.asarray(masked_whiten(x, m, ddof=ddof))
  assert_close(w[m > 0], (vals - vals.mean()) / np.sqrt(expected_var + 1e-8), atol=1e-4)
  assert np.all(w[m == 0] == 0)
  # per-row axis reduction
  for b in range(4):
    row = x[b][m[b] > 0]
    assert_close(masked_mean(x, m, axis=1)[b], row.mean() if len(row) else 0, atol=1e-5)


def test_bf16_dtype_preserved_jit_vmap_no_recompile():
  x = jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3)
  m = jnp.ones((2, 3))
  assert masked_whiten(x, m).dtype == jnp.bfloat16
  assert masked_mean(x, m).dtype == jnp.float32
  out = jax.vmap(lambda a, b: masked_whiten(a, b))(x.astype(jnp.float32), m)
  assert_close(out[0], [-1, 0, 1], atol=1e-3)
  assert_no_recompile(lambda x, m, e: masked_whiten(x, m, eps=e),
                      (x, m, 1e-8), (x, m, 1e-5))


def test_bad_inputs():
  with pytest.raises(ValueError, match="mask"):
    masked_mean(np.zeros(3, np.float32), np.zeros(4))
  with pytest.raises(ValueError, match="`x`"):
    masked_mean(np.zeros(3, np.int32), np.zeros(3))
  with pytest.raises(ValueError, match="y_true"):
    explained_variance(np.zeros(3), np.zeros(4))


def test_masked_values_change_no_statistic_nor_gradient():
  """NaN, +-inf and 3e38 at masked positions change no value and no gradient. Each
  statistic and its gradient are jitted once (the poisons are traced inputs)."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(3, 7)).astype(np.float32)
  y = rng.normal(size=(3, 7)).astype(np.float32)
  m = random_mask(rng, 3, 7)
  fns = {
      "sum": lambda x, y: masked_sum(x, m),
      "sum_axis": lambda x, y: masked_sum(x, m, axis=1),
      "mean": lambda x, y: masked_mean(x, m),
      "mean_axis": lambda x, y: masked_mean(x, m, axis=1, keepdims=True),
      "var": lambda x, y: masked_var(x, m, ddof=0),
      "var_axis": lambda x, y: masked_var(x, m, axis=1),
      "std": lambda x, y: masked_std(x, m),
      "whiten": lambda x, y: masked_whiten(x, m),
      "whiten_noshift": lambda x, y: masked_whiten(x, m, shift_mean=False, ddof=0),
      "explained_variance": lambda x, y: explained_variance(x, y, m),
  }
  for name, f in fns.items():
    value = jax.jit(f)
    grad = jax.jit(jax.grad(lambda x, y, f=f: jnp.sum(f(x, y)), argnums=(0, 1)))
    clean, g_clean = np.asarray(value(x, y)), grad(x, y)
    if clean.shape == m.shape:
      assert np.all(clean[m == 0] == 0), name
    for poison in (np.nan, np.inf, -np.inf, 3e38):
      dirty = np.where(m > 0, x, poison).astype(np.float32)
      dirty_y = np.where(m > 0, y, poison).astype(np.float32)
      np.testing.assert_array_equal(np.asarray(value(dirty, dirty_y)), clean,
                                    err_msg=f"{name} {poison}")
      for gc, gb in zip(g_clean, grad(dirty, dirty_y)):
        np.testing.assert_array_equal(np.asarray(gb), np.asarray(gc),
                                      err_msg=f"{name} {poison}")


def test_out_of_range_numbers_raise_naming_the_argument():
  x, m = np.ones(4, np.float32), np.ones(4, np.float32)
  with pytest.raises(ValueError, match="eps"):
    masked_whiten(x, m, eps=-1)
  with pytest.raises(ValueError, match="ddof"):
    masked_whiten(x, m, ddof=-1)
  with pytest.raises(ValueError, match="ddof"):
    masked_var(x, m, ddof=-1)
  with pytest.raises(ValueError, match="ddof"):
    masked_std(x, m, ddof=-2)
  # edges and traced values are accepted
  masked_whiten(x, m, eps=0.0, ddof=0)
  assert float(masked_count(m)) == 4.0
  out = jax.jit(lambda e: masked_whiten(x, m, eps=e))(-1.0)
  assert out.shape == (4,)


def test_explained_variance_names_the_argument_of_an_int_input():
  """Issue 28, fault 6: an int target named the internal `x`."""
  with pytest.raises(ValueError, match=r"^`y_true` must be a floating-point array"):
    explained_variance(np.zeros(3, np.float32), np.array([1, 2, 4]))
  with pytest.raises(ValueError, match=r"^`y_pred` must be a floating-point array"):
    explained_variance(np.array([1, 2, 4]), np.zeros(3, np.float32))
