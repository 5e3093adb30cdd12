"""Extending the library: a new policy loss is one function plus its registration, in one
file (this one); the train step, the run config and the command then take it by name."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.train.registry import POLICY_LOSS_REGISTRY, register_policy_loss
from tests.utils import train_two_steps


def scaled_reinforce_loss(logp, old_logp, advantages, mask, *, scale):
  """``-scale * A * logp`` per token (REINFORCE with a traced scale), and one metric."""
  del old_logp
  per_token = -scale * advantages * logp * mask
  return per_token, {"scaled_reinforce_scale": jnp.asarray(scale, jnp.float32)}


@pytest.mark.slow
def test_a_registered_policy_loss_trains_from_the_command(tmp_path):
  register_policy_loss("scaled_reinforce", scaled_reinforce_loss, scale=0.5,
                       doc="REINFORCE times a traced scale (a test's own loss)")
  try:
    rows = train_two_steps(str(tmp_path / "run"), "--policy-loss", "scaled_reinforce")
  finally:
    POLICY_LOSS_REGISTRY.pop("scaled_reinforce")
  for row in rows[1:]:
    np.testing.assert_allclose(row["scaled_reinforce_scale"], 0.5)
