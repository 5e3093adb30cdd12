"""A separate critic through the unchanged train step (jaxrl_llm.models.critic,
jaxrl_llm.train.optim)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl_llm import losses as L
from jaxrl_llm.models import Transformer, TransformerConfig, make_apply_fn, split_model
from jaxrl_llm.models.critic import actor_critic_apply, actor_critic_params
from jaxrl_llm.train import TrainConfig, init_train_state, make_train_step
from jaxrl_llm.train.optim import actor_critic_optimizer

V = 16
CFG = {"d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "d_ff": 64,
       "max_seq_len": 16}


def _models():
  policy = Transformer(TransformerConfig(vocab_size=V, value_head=False, **CFG),
                       rngs=nnx.Rngs(0))
  critic = Transformer(TransformerConfig(vocab_size=V, value_head=True, **CFG),
                       rngs=nnx.Rngs(1))
  return split_model(policy), split_model(critic)


def _batch(seed=0, b=4, t=8):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, V, (b, t)).astype(np.int32)
  attn = np.ones((b, t), np.float32)
  attn[0, :2] = 0
  loss = np.zeros((b, t), np.float32)
  loss[:, 4:] = 1
  return {"tokens": tokens, "attention_mask": attn, "loss_mask": loss,
          "old_logp": (-2.5 + 0.1 * rng.standard_normal((b, t))).astype(np.float32),
          "old_values": (0.3 * rng.standard_normal((b, t))).astype(np.float32),
          "advantages": rng.standard_normal((b, t)).astype(np.float32),
          "returns": rng.standard_normal((b, t)).astype(np.float32)}


CONFIG = TrainConfig(use_value=True, whiten_advantages=False, kl_mode="none",
                     vf_clip=None, vf_coef=0.5)


def _optimizer(lr_policy, lr_critic):
  """SGD with the learning rates in the optimizer state (traced: one compile for all)."""
  sgd = optax.inject_hyperparams(optax.sgd)
  return actor_critic_optimizer(sgd(learning_rate=lr_policy), sgd(learning_rate=lr_critic))


@functools.cache
def _jitted_step():
  (pg, _), (cg, _) = _models()
  return jax.jit(make_train_step(actor_critic_apply(pg, cg), _optimizer(0.0, 0.0), CONFIG))


def _step(lr_policy, lr_critic, batch):
  (_, pp), (_, cp) = _models()
  params = actor_critic_params(pp, cp)
  state = init_train_state(params, _optimizer(lr_policy, lr_critic), CONFIG)
  state, metrics = _jitted_step()(state, batch)
  return params, state.params, metrics


def _flat(tree):
  return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree_util.tree_leaves(tree)])


def test_forward_protocol():
  (pg, pp), (cg, cp) = _models()
  batch = _batch()
  hidden, values, lm_head = actor_critic_apply(pg, cg)(
      actor_critic_params(pp, cp), batch["tokens"], None, batch["attention_mask"])
  p_hidden, _, p_head = make_apply_fn(pg)(pp, batch["tokens"], None,
                                          batch["attention_mask"])
  _, c_values, _ = make_apply_fn(cg)(cp, batch["tokens"], None, batch["attention_mask"])
  np.testing.assert_array_equal(hidden, p_hidden)
  np.testing.assert_array_equal(lm_head, p_head)
  np.testing.assert_array_equal(values, c_values)
  with pytest.raises(ValueError, match="critic has no value head"):
    actor_critic_apply(pg, pg)(actor_critic_params(pp, pp), batch["tokens"])
  with pytest.raises(ValueError, match=r"keys \['critic', 'policy'\]"):
    actor_critic_optimizer(optax.sgd(1.0), optax.sgd(1.0)).init({"policy": pp})


def test_updates_are_independent_and_match_reference():
  batch = _batch()
  params, new_a, metrics = _step(0.1, 0.2, batch)
  _, new_b, _ = _step(0.1, 0.7, batch)      # another critic lr
  _, new_c, _ = _step(0.3, 0.2, batch)      # another policy lr
  # The policy update does not depend on the critic's lr and vice versa.
  np.testing.assert_array_equal(_flat(new_a["policy"]), _flat(new_b["policy"]))
  np.testing.assert_array_equal(_flat(new_a["critic"]), _flat(new_c["critic"]))
  assert np.abs(_flat(new_a["critic"]) - _flat(params["critic"])).max() > 0
  assert np.abs(_flat(new_a["policy"]) - _flat(params["policy"])).max() > 0
  assert np.isfinite(float(metrics["vf_loss"])) and float(metrics["skipped"]) == 0

  # Reference: SGD on the critic alone with the value loss (token mean over the
  # loss mask, values aligned to the token they are about), scaled by vf_coef.
  (_, _), (cg, cp) = _models()
  mask = batch["loss_mask"]

  def vf_loss(critic_params):
    _, values, _ = make_apply_fn(cg)(critic_params, jnp.asarray(batch["tokens"]), None,
                                     jnp.asarray(batch["attention_mask"]))
    values = jnp.concatenate([jnp.zeros_like(values[:, :1]), values[:, :-1]], axis=1)
    per_tok, _ = L.value_loss(values, batch["old_values"], batch["returns"], mask,
                              clip=None)
    return jnp.sum(per_tok * mask) / jnp.sum(mask)

  grads = jax.jit(jax.grad(vf_loss))(cp)
  expected = jax.tree_util.tree_map(lambda p, g: p - 0.2 * CONFIG.vf_coef * g, cp, grads)
  np.testing.assert_allclose(_flat(new_a["critic"]), _flat(expected), rtol=1e-5,
                             atol=1e-6)


def test_policy_update_equals_policy_only_step():
  """The policy part moves exactly as a value-free step with the same advantages."""
  batch = _batch(seed=1)
  _, new, _ = _step(0.1, 0.5, batch)
  (pg, pp), _ = _models()
  config = TrainConfig(use_value=False, whiten_advantages=False, kl_mode="none")
  step = make_train_step(make_apply_fn(pg), optax.sgd(0.1), config)
  policy_only = {k: val for k, val in batch.items() if k not in ("old_values", "returns")}
  state, _ = jax.jit(step)(step.init(pp), policy_only)
  np.testing.assert_allclose(_flat(new["policy"]), _flat(state.params), rtol=1e-6,
                             atol=1e-7)


@pytest.mark.parametrize("critic", [None, "policy"])
def test_reference_keeps_only_the_policy_and_its_logprobs_are_unchanged(critic):
  """The trainer's frozen KL reference (``policy.ref_params``) holds no value-head or
  critic leaves, and its log-probs are the policy's own (values aside)."""
  from jaxrl_llm.loop import RunConfig
  from jaxrl_llm.loop.resolve import resolve
  from jaxrl_llm.loop.setup import make_policy, make_task
  run = RunConfig(algo="ppo", critic=critic, seed=3)
  task = make_task(run)
  policy = make_policy(resolve(run, task), task)
  ref = policy.ref_params(policy.init_params)
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(ref)[0]]
  assert paths and not [p for p in paths if "value_" in p or "'critic'" in p]
  full_paths = jax.tree_util.tree_flatten_with_path(policy.init_params)[0]
  assert any("value_" in jax.tree_util.keystr(p) for p, _ in full_paths)
  # The reference shares the policy's leaves (no copy until the trainer makes one).
  policy_part = policy.init_params if critic is None else policy.init_params["policy"]
  policy_leaves = {id(x) for x in jax.tree_util.tree_leaves(policy_part)}
  assert {id(x) for x in jax.tree_util.tree_leaves(ref)} <= policy_leaves
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, task.tokenizer.vocab_size, (3, 10)).astype(np.int32)
  attn = np.ones((3, 10), np.float32)
  attn[0, :3] = 0
  batch = {"tokens": tokens, "attention_mask": attn}
  logp, ent, values = policy.forward(policy.init_params, batch)
  ref_logp, ref_ent, ref_values = policy.ref_forward(ref, batch)
  assert values is not None and ref_values is None
  np.testing.assert_array_equal(np.asarray(ref_logp), np.asarray(logp))
  np.testing.assert_array_equal(np.asarray(ref_ent), np.asarray(ent))
