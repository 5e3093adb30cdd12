"""DAPO dynamic sampling and soft overlong penalty."""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.rollout import dapo
from jaxrl_llm.rollout.dapo import dynamic_sampling, overlong_penalty, zero_variance_groups


def _np_overlong(lengths, max_length, buffer_length, penalty):
  out = []
  for l in lengths:
    if l <= max_length - buffer_length:
      out.append(0.0)
    elif l <= max_length:
      out.append(penalty * ((max_length - buffer_length) - l) / buffer_length)
    else:
      out.append(-penalty)
  return np.array(out, np.float32)


def test_overlong_penalty_fixture_and_reference():
  # L=16, C=4: zone starts after 12 tokens; DAPO's ((L - C) - l) / C there.
  got = overlong_penalty(jnp.array([0, 12, 13, 14, 16, 17]), max_length=16, buffer_length=4)
  np.testing.assert_allclose(got, [0, 0, -0.25, -0.5, -1, -1])
  rng = np.random.default_rng(0)
  for _ in range(5):
    lengths = rng.integers(0, 300, size=64)
    c = int(rng.integers(1, 200))
    p = float(rng.uniform(0, 2))
    np.testing.assert_allclose(
        overlong_penalty(lengths, max_length=256, buffer_length=c, penalty=p),
        _np_overlong(lengths, 256, c, p), rtol=1e-6, atol=1e-6)


def test_overlong_penalty_jit_vmap_traced_penalty_no_recompile():
  f = jax.jit(lambda l, p: overlong_penalty(l, max_length=8, buffer_length=2, penalty=p))
  lengths = jnp.array([5, 7, 9])
  np.testing.assert_allclose(f(lengths, 1.0), [0, -0.5, -1])
  np.testing.assert_allclose(f(lengths, 2.0), [0, -1, -2])
  assert f._cache_size() == 1
  batched = jax.vmap(lambda l: overlong_penalty(l, max_length=8, buffer_length=2))(
      jnp.array([[5, 7], [8, 9]]))
  np.testing.assert_allclose(batched, [[0, -0.5], [-1, -1]])


@pytest.mark.parametrize("kwargs, name", [
    (dict(max_length=0, buffer_length=1), "max_length"),
    (dict(max_length=8, buffer_length=9), "buffer_length"),
    (dict(max_length=8, buffer_length=0), "buffer_length"),
    (dict(max_length=8, buffer_length=2, penalty=-1.0), "penalty"),
])
def test_overlong_penalty_errors(kwargs, name):
  with pytest.raises(ValueError, match=name):
    overlong_penalty(jnp.array([1]), **kwargs)
  with pytest.raises(ValueError, match="lengths"):
    overlong_penalty(jnp.ones((2, 2)), max_length=4, buffer_length=1)


def test_zero_variance_groups():
  s = np.array([1, 1, 1, 0, 1, 0, 0.5, 0.5, 0.5000001])
  assert zero_variance_groups(s, 3).tolist() == [True, False, False]
  assert zero_variance_groups(s, 3, atol=1e-3).tolist() == [True, False, True]
  assert zero_variance_groups(s, 1).all()
  with pytest.raises(ValueError, match="group_size"):
    zero_variance_groups(s, 2)
  with pytest.raises(ValueError, match="scores"):
    zero_variance_groups(np.ones((2, 2)), 2)


class _Drawer:
  """Draws groups from a fixed script of group scores; counts calls."""

  def __init__(self, script, group_size):
    self.script, self.group_size, self.calls, self.next = list(script), group_size, 0, 0

  def __call__(self, n):
    self.calls += 1
    groups = [self.script[(self.next + i) % len(self.script)] for i in range(n)]
    ids = [self.next + i for i in range(n)]
    self.next += n
    scores = np.array([s for g in groups for s in g], np.float32)
    gid = np.repeat(np.array(ids), self.group_size)
    return {"scores": scores, "group": gid, "tokens": np.arange(scores.size)[:, None]}


def test_dynamic_sampling_keeps_signal_in_order_and_fills():
  # groups: 0 const, 1 signal, 2 const, 3 signal, ...
  script = [(1, 1), (0, 1), (0, 0), (1, 0)]
  drawer = _Drawer(script, 2)
  batch, stats = dynamic_sampling(drawer, num_groups=3, group_size=2, max_draws=10)
  assert stats.draws == 2 and stats.groups_drawn == 6 and stats.groups_kept == 3
  assert stats.groups_repeated == 0
  assert batch["group"].tolist() == [1, 1, 3, 3, 5, 5]       # first kept, in draw order
  assert not zero_variance_groups(batch["scores"], 2).any()
  assert batch["tokens"].shape == (6, 1)


def test_dynamic_sampling_bounded_repeats_or_none():
  drawer = _Drawer([(1, 1), (1, 1), (1, 1), (0, 1)], 2)
  batch, stats = dynamic_sampling(drawer, num_groups=4, group_size=2, max_draws=1)
  assert drawer.calls == 1 and stats.groups_kept == 1 and stats.groups_repeated == 3
  assert batch["group"].tolist() == [3] * 8
  assert not zero_variance_groups(batch["scores"], 2).any()
  dead = _Drawer([(0, 0, 0)], 3)
  batch, stats = dynamic_sampling(dead, num_groups=2, group_size=3, max_draws=5)
  assert batch is None and dead.calls == 5 and stats.groups_kept == 0


def test_dynamic_sampling_random_never_all_equal_and_bounded():
  rng = np.random.default_rng(0)
  for _ in range(30):
    p = rng.uniform(0.02, 0.98)
    calls: list[int] = []

    def draw(n, p=p, calls=calls):
      calls.append(n)
      return {"scores": (rng.uniform(size=n * 4) < p).astype(np.float32)}

    batch, stats = dynamic_sampling(draw, num_groups=5, group_size=4, max_draws=3)
    assert len(calls) <= 3 and stats.draws == len(calls)
    if batch is not None:
      assert batch["scores"].shape == (20,)
      assert not zero_variance_groups(batch["scores"], 4).any()


def test_dynamic_sampling_errors():
  with pytest.raises(ValueError, match="num_groups"):
    dynamic_sampling(lambda n: {}, num_groups=0, group_size=2)
  with pytest.raises(ValueError, match="scores"):
    dynamic_sampling(lambda n: {"x": np.zeros(n * 2)}, num_groups=1, group_size=2)
  with pytest.raises(ValueError, match="rows"):
    dynamic_sampling(lambda n: {"scores": np.zeros(3)}, num_groups=1, group_size=2)


def test_docstring_examples():
  res = doctest.testmod(dapo)
  assert res.failed == 0 and res.attempted >= 3
