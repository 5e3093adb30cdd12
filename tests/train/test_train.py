"""Train steps on the tiny reference model: learning, exact microbatching, guards."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl_llm import losses
from jaxrl_llm.checkpoint import Checkpointer
from jaxrl_llm.models.transformer import Transformer, TransformerConfig, make_apply_fn, split_model
from jaxrl_llm.train import (
  GRPO_DEFAULTS,
  TrainConfig,
  init_train_state,
  make_grpo_train_step,
  make_ppo_train_step,
  make_train_step,
  policy_forward,
)
from tests.utils import assert_close

B, L, V = 8, 12, 32


@pytest.fixture(scope="module")
def setup():
  graphdef, params = split_model(Transformer(TransformerConfig.tiny(V), rngs=nnx.Rngs(0)))
  apply = make_apply_fn(graphdef)
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, V, (B, L)).astype(np.int32)
  attn = np.ones((B, L), np.float32)
  attn[:2, :2] = 0                                   # left padding
  loss_mask = np.zeros((B, L), np.float32)
  loss_mask[:, 6:] = 1
  loss_mask[3, 9:] = 0
  attn[3, 9:] = 0                                    # a shorter response, right padded
  rewards = np.zeros((B, L), np.float32)
  rewards[:, -1] = rng.normal(size=B)
  rewards[3, 8] = 1.0
  batch = dict(tokens=tokens, attention_mask=attn, loss_mask=loss_mask)
  logp, _, values = jax.jit(lambda p, b: policy_forward(apply, p, b))(params, batch)
  batch.update(old_logp=np.asarray(logp), old_values=np.asarray(values), rewards=rewards,
               ref_logp=np.asarray(logp) - 0.05)
  return apply, params, batch


def _run(apply, params, batch, config, steps=1, lr=1e-3, opt=None):
  opt = opt or optax.adam(lr)
  state = init_train_state(params, opt, config)
  step = jax.jit(make_train_step(apply, opt, config))
  history = []
  for _ in range(steps):
    state, metrics = step(state, batch)
    history.append(jax.tree_util.tree_map(float, metrics))
  return state, history, step


def test_ppo_loss_decreases_on_a_fixed_batch(setup):
  apply, params, batch = setup
  _, hist, step = _run(apply, params, batch, TrainConfig(num_minibatches=2), steps=6)
  assert hist[-1]["loss"] < hist[0]["loss"]
  assert hist[-1]["vf_loss"] < hist[0]["vf_loss"]
  assert all(h["skipped"] == 0 for h in hist)
  assert step._cache_size() == 1
  for key in ("pg_clipfrac", "pg_clipfrac_lower", "approx_kl", "entropy", "grad_norm",
              "vf_clipfrac", "adv_mean", "adv_std", "clip_eps", "explained_variance"):
    assert np.isfinite(hist[-1][key]), key


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_microbatches_equal_full_batch(setup, mode):
  apply, params, batch = setup
  results = []
  for micro in (1, 4):
    config = TrainConfig(num_microbatches=micro, loss_agg_mode=mode, entropy_coef=0.01,
                         kl_mode="loss", kl_coef=0.1)
    # SGD: Adam's g / sqrt(v) would turn rounding noise on ~0 gradients into +-lr.
    state, hist, _ = _run(apply, params, batch, config, opt=optax.sgd(0.5))
    results.append((state.params, hist[0]))
  assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)
  for key in ("loss", "pg_loss", "vf_loss", "pg_clipfrac", "approx_kl", "kl_loss"):
    assert results[0][1][key] == pytest.approx(results[1][1][key], abs=1e-5), key


def test_chunked_logprob_gradients_equal_naive(setup):
  apply, params, batch = setup

  def apply_logits(p, tokens, positions, attn):
    hidden, values, lm_head = apply(p, tokens, positions, attn)
    return hidden @ lm_head, values

  def loss(fn, chunk):
    def f(p):
      logp, ent, values = policy_forward(fn, p, batch, chunk_size=chunk)
      return jnp.sum(logp * batch["loss_mask"]) + 0.1 * jnp.sum(ent) + jnp.sum(values)
    return jax.jit(jax.grad(f))(params)

  assert_close(loss(apply, 4), loss(apply_logits, None), atol=1e-5, rtol=1e-5)


def test_nonfinite_batch_is_skipped_and_state_kept(setup):
  apply, params, batch = setup
  opt = optax.adam(1e-3)
  config = TrainConfig()
  step = jax.jit(make_train_step(apply, opt, config))    # one compilation for all
  state = init_train_state(params, opt, config)
  for key in ("rewards", "old_logp"):
    bad = dict(batch)
    bad[key] = np.array(batch[key])
    bad[key][0, 7] = np.nan
    new_state, metrics = step(state, bad)
    assert float(metrics["skipped"]) == 1.0
    assert_close(new_state.params, state.params, atol=0, rtol=0)
    assert_close(new_state.opt_state, state.opt_state, atol=0, rtol=0)
  # NaN outside the loss mask is harmless.
  ok = dict(batch)
  ok["old_logp"] = np.array(batch["old_logp"])
  ok["old_logp"][0, 0] = np.nan
  _, metrics = step(state, ok)
  assert float(metrics["skipped"]) == 0
  assert step._cache_size() == 1


def test_policy_forward_names_a_missing_batch_key(setup):
  """Issue 28, fault 6: a batch without ``attention_mask`` raised a bare KeyError."""
  apply, params, batch = setup
  with pytest.raises(ValueError, match=r"`batch` is missing key\(s\) \['attention_mask'\]"):
    policy_forward(apply, params, {"tokens": batch["tokens"]})
  with pytest.raises(ValueError, match=r"`batch` is missing key\(s\) \['tokens'\]"):
    policy_forward(apply, params, {"attention_mask": batch["attention_mask"]})


def test_bad_batches_raise_naming_the_key(setup):
  apply, params, batch = setup
  opt = optax.adam(1e-3)
  config = TrainConfig()
  state = init_train_state(params, opt, config)
  step = make_train_step(apply, opt, config)
  missing = {k: v for k, v in batch.items() if k != "old_values"}
  with pytest.raises(ValueError, match="old_values"):
    step(state, missing)
  with pytest.raises(ValueError, match="loss_mask"):
    step(state, {**batch, "loss_mask": batch["loss_mask"][:, :-1]})
  with pytest.raises(ValueError, match="old_logp"):
    step(state, {**batch, "old_logp": batch["old_logp"].astype(np.int32)})
  with pytest.raises(ValueError, match="tokens"):
    step(state, {**batch, "tokens": batch["tokens"].astype(np.float32)})
  with pytest.raises(ValueError, match="divisible"):
    make_train_step(apply, opt, TrainConfig(num_minibatches=3))(state, batch)
  with pytest.raises(ValueError, match="policy_loss"):
    TrainConfig(policy_loss="trpo")


def test_hparams_are_traced_and_clip_schedule(setup):
  apply, params, batch = setup
  schedule = optax.linear_schedule(0.2, 0.05, transition_steps=2)
  opt = optax.sgd(1e-3)
  config = TrainConfig(clip_schedule=schedule)
  state = init_train_state(params, opt, config)
  step = jax.jit(make_train_step(apply, opt, config))
  eps = []
  for i in range(3):
    state, m = step(state, batch)
    eps.append(float(m["clip_eps"]))
    state = state.replace(hparams={**state.hparams, "vf_coef": jnp.float32(0.1 * i),
                                   "lam": jnp.float32(0.9)})
  assert eps == pytest.approx([0.2, 0.125, 0.05])
  assert step._cache_size() == 1


def test_adaptive_clip_and_kl_controllers_move(setup):
  apply, params, batch = setup
  config = TrainConfig(adaptive_clip=True, adaptive_kl=True, kl_mode="reward",
                       kl_coef=0.05, kl_target=0.01, num_epochs=2)
  _state, hist, _ = _run(apply, params, batch, config, steps=3, lr=3e-3)
  assert hist[-1]["clip_eps"] != pytest.approx(hist[0]["clip_eps"])
  assert hist[-1]["kl_coef"] > hist[0]["kl_coef"]      # observed KL 0.05 > target 0.01


@pytest.mark.parametrize("loss", ["ppo", "gspo", "cispo", "sapo", "gmpo", "reinforce"])
def test_grpo_family_steps_learn(loss):
  """Each policy loss moves sequence log-probs in the direction of their advantages
  (on the table model: the same program as the inf-old-logp test below compiles)."""
  params, batch = _table_params(), _table_batch()
  step_fn = make_grpo_train_step(_table_apply, optax.adam(1e-2), policy_loss=loss)
  step = jax.jit(step_fn)
  state = step_fn.init(params)
  logp0, _, _ = policy_forward(_table_apply, params, batch)
  for _ in range(3):
    state, m = step(state, batch)
    assert np.isfinite(float(m["loss"])) and float(m["skipped"]) == 0
  logp1, _, _ = policy_forward(_table_apply, state.params, batch)
  # Sequences with positive advantage became more likely, negative ones less.
  delta = np.asarray(((logp1 - logp0) * batch["loss_mask"]).sum(1))
  assert np.corrcoef(delta, batch["advantages"])[0, 1] > 0.5


def test_checkpoint_resume_is_bit_identical(setup, tmp_path):
  apply, params, batch = setup
  opt = optax.adam(1e-3)
  config = TrainConfig(num_minibatches=2, adaptive_clip=True)
  step = jax.jit(make_train_step(apply, opt, config))
  # Committed to the device, as restored arrays are: one compile of `step` serves both.
  state = jax.device_put(init_train_state(params, opt, config, rng=jax.random.PRNGKey(7)),
                         jax.devices()[0])
  with Checkpointer(str(tmp_path), max_to_keep=2) as ckpt:
    for i in range(4):
      state, _ = step(state, batch)
      ckpt.save(int(state.step), state, extra={"step": int(state.step)})
      if i == 1:
        at_two = state
    assert ckpt.all_steps() == [3, 4]          # keep-last-N
    uninterrupted = state
    # a "restarted process": restore step 3 into a freshly built template
    template = init_train_state(params, opt, config)
    restored, extra = ckpt.restore(template, step=3)
  assert extra == {"step": 3}
  resumed, _ = step(restored, batch)
  assert_close(resumed, uninterrupted, atol=0, rtol=0)
  assert step._cache_size() == 1
  assert int(at_two.step) == 2


def test_given_advantages_give_returns_from_the_raw_advantages(setup):
  _, params, batch = setup
  from jaxrl_llm.train import prepare_batch
  config = TrainConfig(whiten_advantages=True)
  state = init_train_state(params, optax.sgd(0.1), config)
  adv = np.random.default_rng(1).normal(3.0, 2.0, batch["tokens"].shape).astype(np.float32)
  given = {k: val for k, val in batch.items() if k != "rewards"}
  out = prepare_batch({**given, "advantages": adv}, state, config)
  m = batch["loss_mask"]
  assert_close(out["returns"], (adv + batch["old_values"]) * m, atol=1e-6)
  assert abs(float(np.sum(np.asarray(out["advantages"]) * m) / m.sum())) < 1e-5  # whitened


# ------------------------------------------------- one source of truth, fault handling
# A tiny table model (logits and values looked up per token): compiles in a second.

TV = 6


def _table_apply(p, tokens, positions, attn):
  del positions, attn
  return p["w"][tokens], p["v"][tokens]


def _table_params(seed=0):
  rng = np.random.default_rng(seed)
  return {"w": jnp.asarray(rng.normal(size=(TV, TV)), jnp.float32),
          "v": jnp.asarray(rng.normal(size=(TV,)), jnp.float32)}


def _table_batch(seed=0, b=4, length=5):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, TV, (b, length)).astype(np.int32)
  ones = np.ones((b, length), np.float32)
  loss_mask = ones.copy()
  loss_mask[:, 0] = 0
  loss_mask[1, 3:] = 0
  rewards = np.zeros((b, length), np.float32)
  rewards[:, -1] = rng.normal(size=b)
  return dict(tokens=tokens, attention_mask=ones, loss_mask=loss_mask,
              old_logp=np.log(rng.uniform(0.05, 0.5, (b, length))).astype(np.float32),
              ref_logp=np.log(rng.uniform(0.05, 0.5, (b, length))).astype(np.float32),
              old_values=rng.normal(size=(b, length)).astype(np.float32),
              rewards=rewards,
              advantages=np.array([1.0, -2.0, 0.5, -1.0], np.float32)[:b])


def test_state_from_another_config_raises_naming_the_difference():
  params, batch = _table_params(), _table_batch()
  opt = optax.sgd(0.1)
  config = TrainConfig(use_value=False, whiten_advantages=False, dual_clip=3.0)
  step = make_train_step(_table_apply, opt, config)
  other = init_train_state(params, opt, TrainConfig(use_value=False))
  with pytest.raises(ValueError, match="dual_clip"):
    step(other, batch)
  with pytest.raises(ValueError, match="vf_clip"):   # GRPO defaults drop vf_clip
    make_grpo_train_step(_table_apply, opt)(other, batch)
  # The matching state: pg_loss is the dual-clipped loss of the config.
  _, m = jax.jit(step)(step.init(params), batch)
  logp, _, _ = policy_forward(_table_apply, params, batch)
  mask = batch["loss_mask"]
  want = []
  for dual in (3.0, None):
    per_tok, _ = losses.ppo_policy_loss(logp, batch["old_logp"], batch["advantages"],
                                        mask, clip_low=0.2, dual_clip=dual)
    want.append(float(losses.aggregate(per_tok, mask)))
  assert want[0] != pytest.approx(want[1], abs=1e-3)    # the dual clip is active here
  assert float(m["pg_loss"]) == pytest.approx(want[0], rel=1e-5, abs=1e-6)


def test_overrides_apply_on_top_of_a_given_config():
  step = make_ppo_train_step(_table_apply, optax.sgd(0.1), TrainConfig(kl_coef=0.5),
                             dual_clip=2.0)
  assert step.config.dual_clip == 2.0 and step.config.kl_coef == 0.5
  step = make_grpo_train_step(_table_apply, optax.sgd(0.1), TrainConfig(),
                              policy_loss="sapo")
  assert step.config.policy_loss == "sapo" and step.config.use_value   # config kept
  with pytest.raises(ValueError, match="clip_lo"):
    make_ppo_train_step(_table_apply, optax.sgd(0.1), TrainConfig(), clip_lo=0.1)


def test_per_loss_defaults_and_loss_hparams():
  assert TrainConfig(policy_loss="gspo").clip_range() == (3e-4, 4e-4)
  assert TrainConfig(policy_loss="gmpo").clip_range() == (0.4, 0.4)
  assert TrainConfig().clip_range() == (0.2, None)
  hp = TrainConfig(policy_loss="sapo", loss_hparams={"tau_pos": 2.0}).hparam_values()
  assert hp["tau_pos"] == 2.0 and hp["tau_neg"] == 1.05
  with pytest.raises(ValueError, match="tau_pos"):
    TrainConfig(policy_loss="ppo", loss_hparams={"tau_pos": 2.0})
  with pytest.raises(ValueError, match="dual_clip"):
    TrainConfig(policy_loss="sapo", dual_clip=3.0)
  for name, bad in (("clip_low", -0.2), ("lam", 2.0), ("gamma", -1.0),
                    ("temperature", 0.0), ("hybrid_mix", 2.0)):
    with pytest.raises(ValueError, match=name):
      TrainConfig(**{name: bad})


def test_sapo_temperatures_are_traced_and_used():
  params, batch = _table_params(), _table_batch()
  step = make_grpo_train_step(_table_apply, optax.sgd(0.1), policy_loss="sapo")
  jitted = jax.jit(step)
  state = step.init(params)
  losses_ = []
  for tau in (1.0, 3.0):
    s = state.replace(hparams={**state.hparams, "tau_pos": jnp.float32(tau),
                               "tau_neg": jnp.float32(tau)})
    _, m = jitted(s, batch)
    logp, _, _ = policy_forward(_table_apply, params, batch)
    per_tok, _ = losses.sapo_policy_loss(logp, batch["old_logp"], batch["advantages"],
                                         batch["loss_mask"], tau_pos=tau, tau_neg=tau)
    assert float(m["pg_loss"]) == pytest.approx(
        float(losses.aggregate(per_tok, batch["loss_mask"])), rel=1e-5)
    losses_.append(float(m["pg_loss"]))
  assert losses_[0] != pytest.approx(losses_[1])
  assert jitted._cache_size() == 1


def test_adaptive_kl_is_the_same_on_one_and_two_devices_through_axis_name():
  params, batch = _table_params(), _table_batch()
  del batch["advantages"]
  config = TrainConfig(kl_mode="reward", adaptive_kl=True, kl_coef=0.1, kl_target=0.01,
                       kl_horizon=100.0)
  opt = optax.sgd(0.1)
  state = init_train_state(params, opt, config)
  one, m1 = jax.jit(make_train_step(_table_apply, opt, config))(state, batch)
  step2 = make_train_step(_table_apply, opt, config, axis_name="data")
  split = jax.tree_util.tree_map(lambda x: x.reshape((2, -1) + x.shape[1:]), batch)
  two, m2 = jax.jit(jax.vmap(step2, in_axes=(None, 0), axis_name="data"))(state, split)
  assert float(one.kl_ctrl.coef) != pytest.approx(0.1)
  np.testing.assert_allclose(np.asarray(two.kl_ctrl.coef), float(one.kl_ctrl.coef),
                             rtol=1e-6)
  assert_close(jax.tree_util.tree_map(lambda x: x[0], two.params), one.params,
               atol=1e-6, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(m2["rollout_kl"]), float(m1["rollout_kl"]),
                             rtol=1e-5)


def test_poisoned_optimizer_state_is_skipped():
  params, batch = _table_params(), _table_batch()
  opt = optax.adam(1e-2)
  step = make_train_step(_table_apply, opt, TrainConfig())
  state = step.init(params)
  poisoned = jax.tree_util.tree_map(lambda x: x, state.opt_state)
  mu = poisoned[0].mu
  poisoned = (poisoned[0]._replace(mu={**mu, "w": mu["w"].at[0, 0].set(jnp.inf)}),
              *poisoned[1:])
  new, m = jax.jit(step)(state.replace(opt_state=poisoned), batch)
  assert float(m["skipped"]) == 1.0
  assert_close(new.params, params, atol=0, rtol=0)
  assert all(np.all(np.isfinite(x)) for x in jax.tree_util.tree_leaves(new.params))


def test_all_masked_batch_is_an_exact_no_op():
  params, batch = _table_params(), _table_batch()
  del batch["advantages"]
  batch["loss_mask"] = np.zeros_like(batch["loss_mask"])
  opt = optax.adam(1e-2)
  config = TrainConfig(kl_mode="reward", adaptive_kl=True, kl_coef=0.1,
                       adaptive_clip=True, num_minibatches=2)
  step = make_train_step(_table_apply, opt, config)
  state = step.init(params, rng=jax.random.PRNGKey(3))
  new, m = jax.jit(step)(state, batch)
  assert int(new.step) == 1 and float(m["skipped_empty"]) == 2.0
  assert float(m["skipped"]) == 0.0
  assert_close(new.replace(step=state.step), state, atol=0, rtol=0)


def test_reward_kl_with_given_advantages_raises():
  """The step can only put the KL in rewards it turns into advantages itself."""
  params, batch = _table_params(), _table_batch()
  for use_value in (False, True):
    config = TrainConfig(use_value=use_value, kl_mode="reward", kl_coef=1.0)
    step = make_train_step(_table_apply, optax.sgd(0.1), config)
    with pytest.raises(ValueError, match="kl_mode='reward' with batch\\['advantages'\\]"):
      step(step.init(params), batch)


@pytest.mark.parametrize("fault", ["empty", "nan"])
def test_step_metrics_average_the_applied_updates_only(fault):
  """One row per minibatch and lr 0: each update's approx_kl is its row's, so the step
  reports (and the clip controller sees) the mean over the 3 applied rows."""
  from jaxrl_llm.control import adaptive_clip_update
  params, batch = _table_params(), _table_batch()
  if fault == "empty":
    batch["loss_mask"][0] = 0
  else:
    batch["old_logp"][0, 3] = np.nan
  config = TrainConfig(use_value=False, whiten_advantages=False, adaptive_clip=True,
                       adaptive_clip_target=0.6, num_minibatches=4)
  step = make_train_step(_table_apply, optax.sgd(0.0), config)
  state = step.init(params)
  new, m = jax.jit(step)(state, batch)
  logp, _, _ = _np_forward(params, batch["tokens"])
  row_kl = [np.mean(0.5 * np.square(logp[i] - batch["old_logp"][i])[batch["loss_mask"][i] > 0])
            for i in (1, 2, 3)]
  want = float(np.mean(row_kl))
  assert want == pytest.approx(0.4052658, abs=1e-6)
  assert (float(m["skipped"]), float(m["skipped_empty"])) == (
      (0.0, 1.0) if fault == "empty" else (1.0, 0.0))
  assert float(m["approx_kl"]) == pytest.approx(want, rel=1e-5)
  assert np.isfinite(float(m["loss"])) and np.isfinite(float(m["grad_norm"]))
  assert float(new.clip_ctrl.eps) == pytest.approx(
      float(adaptive_clip_update(state.clip_ctrl, want).eps), rel=1e-6)
  assert float(new.clip_ctrl.eps) != pytest.approx(float(state.clip_ctrl.eps))


def test_rollout_is_metrics_do_not_depend_on_microbatches_or_devices():
  """Max and ESS are not token means: exact for any microbatching and under axis_name."""
  params, batch = _table_params(), _table_batch()
  noise = np.random.default_rng(5).normal(0.0, 0.8, batch["old_logp"].shape)
  batch["rollout_logp"] = (batch["old_logp"] + noise).astype(np.float32)
  valid = batch["loss_mask"] > 0
  rho = np.exp(batch["old_logp"] - batch["rollout_logp"].astype(np.float64))[valid]
  w = np.minimum(rho, 2.0)
  want = {"rollout_is_max": rho.max(), "rollout_is_mean": w.mean(),
          "rollout_is_ess": w.sum() ** 2 / (w.size * np.square(w).sum())}
  assert [round(x, 5) for x in want.values()] == [2.88489, 1.36401, 0.84144]
  split = jax.tree_util.tree_map(lambda x: x.reshape((2, -1) + x.shape[1:]), batch)
  for micro, devices in ((1, 1), (2, 1), (4, 1), (2, 2)):
    config = TrainConfig(use_value=False, whiten_advantages=False, rollout_correction="token",
                         num_microbatches=micro)
    step = make_train_step(_table_apply, optax.sgd(0.1), config,
                           axis_name="data" if devices > 1 else None)
    if devices > 1:     # two devices of two rows, one row per microbatch
      step = jax.vmap(step, in_axes=(None, 0), axis_name="data")
    _, m = jax.jit(step)(init_train_state(params, optax.sgd(0.1), config),
                         split if devices > 1 else batch)
    for key, val in want.items():
      np.testing.assert_allclose(np.asarray(m[key]), val, rtol=1e-5, err_msg=key)


def test_rollout_kl_is_the_mean_of_the_responses_token_means():
  """verl's apply_kl_penalty statistic: each non-empty response weighs the same."""
  params, batch = _table_params(), _table_batch(length=8)
  del batch["advantages"]
  batch["loss_mask"][:] = 0
  batch["loss_mask"][0, 2:] = 1
  batch["loss_mask"][2, 2:3] = 1
  batch["loss_mask"][3, 2:5] = 1          # row 1: no response token
  m = batch["loss_mask"]
  k1 = (batch["old_logp"] - batch["ref_logp"]).astype(np.float64) * m
  rows = m.sum(1) > 0
  want = float(np.mean(k1.sum(1)[rows] / m.sum(1)[rows]))
  assert want == pytest.approx(0.0918473, abs=1e-6)
  assert k1.sum() / m.sum() == pytest.approx(0.2312877, abs=1e-6)   # not the token mean
  config = TrainConfig(kl_mode="reward", adaptive_kl=True, kl_coef=0.1, kl_target=0.1,
                       kl_horizon=100.0)
  step = make_train_step(_table_apply, optax.sgd(0.1), config)
  new, metrics = jax.jit(step)(step.init(params), batch)
  assert float(metrics["rollout_kl"]) == pytest.approx(want, rel=1e-5)
  assert float(new.kl_ctrl.coef) == pytest.approx(0.1 * (1 + (want / 0.1 - 1) * 4 / 100),
                                                  rel=1e-6)


@pytest.mark.parametrize("loss", ["ppo", "gspo", "cispo", "sapo", "gmpo", "reinforce"])
@pytest.mark.parametrize("family", ["ppo", "grpo"])
def test_inf_old_logp_is_skipped_in_every_algorithm(loss, family):
  params, batch = _table_params(), _table_batch()
  make = make_ppo_train_step if family == "ppo" else make_grpo_train_step
  step = make(_table_apply, optax.adam(1e-2), policy_loss=loss)
  state = step.init(params)
  bad = dict(batch, old_logp=np.full_like(batch["old_logp"], np.inf))
  new, m = jax.jit(step)(state, bad)
  assert float(m["skipped"]) == 1.0
  assert_close(new.params, params, atol=0, rtol=0)
  # inf / NaN outside the loss mask are never read
  ok = dict(batch, old_logp=np.where(batch["loss_mask"] > 0, batch["old_logp"], np.inf),
            ref_logp=np.where(batch["loss_mask"] > 0, batch["ref_logp"], np.nan))
  _, m = jax.jit(step)(state, ok)
  assert float(m["skipped"]) == 0.0 and np.isfinite(float(m["kl_ref"]))


# ------------------------------------- one step against an independent NumPy reference


def _np_forward(p, tokens):
  """float64 NumPy: log-probs, entropies, values aligned with the tokens (column 0 = 0)."""
  w, vh = np.asarray(p["w"], np.float64), np.asarray(p["v"], np.float64)
  b, length = tokens.shape
  logp, ent, values = np.zeros((b, length)), np.zeros((b, length)), np.zeros((b, length))
  for i in range(b):
    for t in range(1, length):
      logits = w[tokens[i, t - 1]]
      z = logits - logits.max()
      log_sm = z - np.log(np.exp(z).sum())
      logp[i, t] = log_sm[tokens[i, t]]
      ent[i, t] = -(np.exp(log_sm) * log_sm).sum()
      values[i, t] = vh[tokens[i, t - 1]]
  return logp, ent, values


def _np_gae(rewards, values, mask, gamma, lam):
  """GAE per row over its (contiguous) valid tokens; the value after the last is 0."""
  adv = np.zeros_like(rewards)
  for i in range(rewards.shape[0]):
    idx = np.flatnonzero(mask[i])
    last = 0.0
    for k in range(len(idx) - 1, -1, -1):
      t = idx[k]
      next_v = values[i, idx[k + 1]] if k + 1 < len(idx) else 0.0
      delta = rewards[i, t] + gamma * next_v - values[i, t]
      last = delta + gamma * lam * last
      adv[i, t] = last
  return adv


def _np_step_loss(p, batch, c, adv, returns):
  """The step's scalar loss in float64 NumPy (token-mean aggregation)."""
  m = batch["loss_mask"].astype(np.float64)
  n = m.sum()
  logp, ent, values = _np_forward(p, batch["tokens"])
  ratio = np.exp(logp - batch["old_logp"])
  pg = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - c["clip"], 1 + c["clip"]))
  terms = {"pg_loss": (pg * m).sum() / n, "entropy": (ent * m).sum() / n}
  loss = terms["pg_loss"] - c["entropy_coef"] * terms["entropy"]
  if c["use_value"]:
    old = batch["old_values"]
    clipped = np.clip(values, old - c["vf_clip"], old + c["vf_clip"])
    vf = 0.5 * np.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    terms["vf_loss"] = (vf * m).sum() / n
    loss += c["vf_coef"] * terms["vf_loss"]
  x = logp - batch["ref_logp"]
  terms["kl_loss"] = ((np.exp(-x) + x - 1.0) * m).sum() / n              # k3
  loss += c["kl_coef"] * terms["kl_loss"]
  return loss, terms


def _np_sgd(p, batch, c, adv, returns, lr, eps=1e-6):
  """Parameters after one SGD step, the gradient by central differences (float64)."""
  new = {}
  for name, x in p.items():
    x = np.asarray(x, np.float64)
    grad = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
      for sign in (1, -1):
        q = {k: np.asarray(val, np.float64).copy() for k, val in p.items()}
        q[name][idx] += sign * eps
        grad[idx] += sign * _np_step_loss(q, batch, c, adv, returns)[0] / (2 * eps)
    new[name] = x - lr * grad
  return new


@pytest.mark.parametrize("family", ["ppo", "grpo"])
def test_one_step_matches_numpy_loss_and_sgd_update(family):
  params = _table_params(seed=1)
  params = jax.tree_util.tree_map(lambda x: 0.3 * x, params)
  batch = _table_batch(seed=2)
  batch["loss_mask"][1, 3:] = 0                    # row 1: a shorter response
  lr = 0.5
  c = dict(clip=0.2, entropy_coef=0.01, vf_coef=0.5, vf_clip=0.2, kl_coef=0.1,
           gamma=0.9, lam=0.8, use_value=family == "ppo")
  m = batch["loss_mask"].astype(np.float64)
  if family == "ppo":
    del batch["advantages"]
    config = TrainConfig(kl_mode="loss", kl_kind="k3", kl_coef=c["kl_coef"],
                         entropy_coef=c["entropy_coef"], vf_clip=c["vf_clip"],
                         gamma=c["gamma"], lam=c["lam"])
    raw = _np_gae(batch["rewards"].astype(np.float64), batch["old_values"], m, c["gamma"],
                  c["lam"])
    returns = (raw + batch["old_values"]) * m
    valid = raw[m > 0]
    adv = (raw - valid.mean()) / np.sqrt(valid.var(ddof=1) + 1e-8) * m
  else:
    config = dataclasses.replace(TrainConfig(**GRPO_DEFAULTS), kl_coef=c["kl_coef"],
                                 entropy_coef=c["entropy_coef"])
    adv, returns = batch["advantages"][:, None] * m, None
  step = make_train_step(_table_apply, optax.sgd(lr), config)
  new, metrics = jax.jit(step)(step.init(params), batch)
  loss, terms = _np_step_loss(params, batch, c, adv, returns)
  assert float(metrics["loss"]) == pytest.approx(loss, rel=1e-5, abs=1e-6)
  for key, val in terms.items():
    assert float(metrics[key]) == pytest.approx(val, rel=1e-4, abs=1e-6), key
  want = _np_sgd(params, batch, c, adv, returns, lr)
  for name in ("w", "v"):
    np.testing.assert_allclose(np.asarray(new.params[name]), want[name], rtol=1e-4,
                               atol=2e-5, err_msg=name)
  if family == "grpo":                             # no value head: its params are unused
    np.testing.assert_array_equal(np.asarray(new.params["v"]), np.asarray(params["v"]))


def test_decoupled_estimators_in_the_step():
  from jaxrl_llm import advantages as A
  from jaxrl_llm.train import AdvantageInputs, compute_advantages
  params, batch = _table_params(), _table_batch()
  del batch["advantages"]
  m = batch["loss_mask"]
  inputs = AdvantageInputs(rewards=batch["rewards"], values=batch["old_values"], mask=m)
  hp = TrainConfig(lam=0.9, lam_value=1.0).hparam_values()
  adv, ret = compute_advantages("decoupled_gae", inputs, hp)
  want_adv, want_ret = A.decoupled_gae(batch["rewards"], batch["old_values"], m, gamma=1.0,
                                       lam_policy=0.9, lam_value=1.0)
  assert_close(adv, want_adv, atol=1e-6)
  assert_close(ret, want_ret, atol=1e-6)
  assert "lam_value" not in TrainConfig().hparam_names()        # absent unless set
  for est in ("decoupled_gae", "vapo_gae"):
    step = make_train_step(_table_apply, optax.sgd(0.1),
                           TrainConfig(advantage_estimator=est, lam_value=1.0))
    _, metrics = jax.jit(step)(step.init(params), batch)
    assert float(metrics["skipped"]) == 0 and np.isfinite(float(metrics["vf_loss"]))


def _compiled_step_lines(n_leaves: int) -> int:
  """Lines of the optimised HLO of a PPO step over ``n_leaves`` parameter arrays."""
  params = {f"w{i:03d}": np.full((4, 4), 0.1 * i, np.float32) for i in range(n_leaves)}
  apply = lambda p, tokens, pos, attn: (sum(p.values())[tokens], None)   # logits [B,L,4]
  config = TrainConfig(use_value=False, whiten_advantages=False)
  step = make_train_step(apply, optax.adam(1e-3), config)
  ones = np.ones((2, 3), np.float32)
  batch = dict(tokens=np.ones((2, 3), np.int32), attention_mask=ones, loss_mask=ones,
               old_logp=np.log(0.25) * ones, advantages=np.array([1.0, -1.0], np.float32))
  compiled = jax.jit(step).lower(step.init(params), batch).compile()
  return len(compiled.as_text().splitlines())


def test_compiled_step_grows_linearly_with_the_parameter_leaves():
  """Keeping or dropping an update is one decision for all leaves. Selecting each leaf
  with the step's finiteness flag let XLA copy the flag's and-chain over every leaf
  into every leaf's update fusion: quadratic in the number of leaves (from 16 to 64
  leaves the optimised program grew 9.5x, 13,494 to 128,454 lines; now 2.6x)."""
  small, large = _compiled_step_lines(16), _compiled_step_lines(64)
  assert large < 4 * small, (small, large)


def test_old_logp_from_step_equals_a_batch_carrying_the_current_log_probs():
  """With one update per batch, ``old_logp_from_step`` takes pi_old from the update's
  own forward (detached): the same update as a batch whose ``old_logp`` are the current
  parameters' log-probs, without that batch key, and the ratio exactly 1."""
  params = _table_params()
  batch = {k: v for k, v in _table_batch().items() if k not in ("old_values", "rewards")}
  config = TrainConfig(**{**GRPO_DEFAULTS, "kl_mode": "loss", "kl_coef": 0.1})
  step = make_train_step(_table_apply, optax.adam(1e-2), config)
  from_step = make_train_step(_table_apply, optax.adam(1e-2), dataclasses.replace(
      config, old_logp_from_step=True))
  current, _, _ = policy_forward(_table_apply, params, batch)
  carried = {**batch, "old_logp": np.asarray(current)}
  new_a, m_a = jax.jit(step)(step.init(params), carried)
  no_old = {k: v for k, v in batch.items() if k != "old_logp"}
  new_b, m_b = jax.jit(from_step)(from_step.init(params), no_old)
  assert_close(new_b.params, new_a.params, atol=1e-6, rtol=1e-6)
  assert float(m_b["ppo_kl"]) == 0.0 and float(m_b["pg_clipfrac"]) == 0.0
  assert float(m_b["ratio_mean"]) == 1.0
  np.testing.assert_allclose(float(m_b["loss"]), float(m_a["loss"]), rtol=1e-5, atol=1e-7)
  with pytest.raises(ValueError, match="batch is missing key"):
    step(step.init(params), no_old)


@pytest.mark.parametrize("kwargs,name", [
    (dict(num_epochs=2), "num_epochs > 1"), (dict(num_minibatches=2), "num_minibatches"),
    (dict(use_value=True), "use_value"), (dict(kl_mode="reward"), "kl_mode='reward'"),
    (dict(kl_mode="loss", adaptive_kl=True), "adaptive_kl"),
    (dict(rollout_correction="token"), "rollout_correction")])
def test_old_logp_from_step_refuses_what_reads_old_logp_before_the_update(kwargs, name):
  with pytest.raises(ValueError, match=f"`old_logp_from_step`.*{name}"):
    TrainConfig(**{**GRPO_DEFAULTS, **kwargs, "old_logp_from_step": True})


# -------------------------------------------- log-probs from a static start (issue 42)

START = 6   # the setup batch's first response column: its loss_mask is 0 before it


def _forward(apply, params, batch, start, chunk_size=None):
  return jax.jit(lambda p, b: policy_forward(apply, p, b, chunk_size=chunk_size,
                                             logprob_start=start))(params, batch)


def _logits_apply(apply):
  def apply_logits(p, tokens, positions, attn):
    hidden, values, lm_head = apply(p, tokens, positions, attn)
    return hidden @ lm_head, values
  return apply_logits


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_logprob_start_gives_the_full_log_probs_from_its_column_and_zeros_before(
    setup, chunk_size):
  apply, params, batch = setup
  for fn in (apply, _logits_apply(apply)):        # hidden + LM head, and logits
    full, sliced = (_forward(fn, params, batch, s, chunk_size) for s in (None, START))
    for f, s in zip(full[:2], sliced[:2]):        # log-probs, entropies
      assert s.shape == f.shape == (B, L)
      assert_close(s[:, START:], f[:, START:], atol=1e-6, rtol=1e-6)
      assert np.all(np.asarray(s)[:, :START] == 0.0)
    np.testing.assert_array_equal(sliced[2], full[2])    # values: every position
    # Pinned (the tiny model of the fixture, seed 0): sums over the response columns.
    assert_close(np.array([jnp.sum(sliced[0]), jnp.sum(sliced[1])]),
                 [-189.0479, 130.7741], atol=2e-3, rtol=0)


def test_logprob_start_gradients_equal_the_full_computation(setup):
  apply, params, batch = setup
  mask = batch["loss_mask"]

  def grads(start):
    def f(p):
      logp, ent, values = policy_forward(apply, p, batch, chunk_size=4,
                                         logprob_start=start)
      return jnp.sum((logp + 0.1 * ent) * mask) + jnp.sum(values)
    return jax.jit(jax.grad(f))(params)

  full, sliced = grads(None), grads(START)
  assert_close(sliced, full, atol=1e-6, rtol=1e-5)
  embed = next(x for x in jax.tree_util.tree_leaves(sliced) if np.ndim(x) == 2
               and np.shape(x)[0] == V)
  assert float(jnp.abs(embed).sum()) > 0     # the tied LM head gets a gradient


@pytest.mark.parametrize("family", ["ppo", "grpo"])
def test_logprob_start_train_step_equals_the_full_one(setup, family):
  """Loss, metrics and the update (SGD at lr 1: the negated gradient) of a step that
  computes log-probs from the first response column equal the full step's."""
  apply, params, batch = setup
  kw = dict(entropy_coef=0.01, kl_mode="loss", kl_coef=0.1, num_microbatches=2)
  if family == "grpo":
    kw.update(GRPO_DEFAULTS, old_logp_from_step=True)
    batch = {k: x for k, x in batch.items() if k not in ("old_logp", "old_values")}
    batch["advantages"] = np.linspace(-1.0, 1.0, B).astype(np.float32)
  results = []
  for start in (None, START):
    state, hist, step = _run(apply, params, batch, TrainConfig(logprob_start=start, **kw),
                             opt=optax.sgd(1.0))
    update = jax.tree_util.tree_map(lambda a, b: np.asarray(a) - np.asarray(b),
                                    state.params, params)
    results.append((hist[0], update))
    assert step._cache_size() == 1
  (full, full_update), (sliced, sliced_update) = results
  assert full.keys() == sliced.keys()
  for key in full:
    assert_close(sliced[key], full[key], atol=1e-6, rtol=1e-5, err_msg=key)
  assert_close(sliced_update, full_update, atol=1e-6, rtol=1e-5)
  assert full["skipped"] == 0 and full["grad_norm"] > 0
  pinned = {"ppo": 0.318797, "grpo": -0.038462}[family]      # the fixture's loss
  assert_close(sliced["loss"], pinned, atol=1e-4, rtol=0)


@pytest.mark.parametrize("start", [0, -1, L, L + 3, True, 2.0])
def test_logprob_start_out_of_range_raises_naming_it(setup, start):
  apply, params, batch = setup
  with pytest.raises(ValueError, match=r"`logprob_start` must be None or an int with "
                                       rf"1 <= logprob_start < L = {L}"):
    policy_forward(apply, params, batch, logprob_start=start)


def test_logprob_start_config_is_checked_and_the_step_refuses_a_too_wide_one(setup):
  apply, params, batch = setup
  with pytest.raises(ValueError, match="`logprob_start` must be None or an int >= 1"):
    TrainConfig(logprob_start=0)
  config = TrainConfig(logprob_start=L)
  opt = optax.sgd(0.1)
  with pytest.raises(ValueError, match=r"`logprob_start`.* < L = 12"):
    make_train_step(apply, opt, config)(init_train_state(params, opt, config), batch)


def test_logprob_start_is_ignored_for_packed_rows(setup):
  apply, params, batch = setup
  seg = np.ones((B, L), np.int32)
  seg[:, 8:] = 2          # a second sequence from column 8: its log-probs from there
  packed = dict(batch, segment_ids=seg)
  full, sliced = (_forward(apply, params, packed, s) for s in (None, START))
  for f, s in zip(full, sliced):
    np.testing.assert_array_equal(s, f)
  assert np.all(np.asarray(sliced[0])[2:, 1:START] != 0)    # rows 0, 1: left padding
