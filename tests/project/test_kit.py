"""The VC-PPO / VAPO / DAPO kit in the train step and the trainer: critic warm-up,
value learning rate, positive-example NLL, rollout-mismatch correction, dynamic
sampling and the overlong penalty, the vapo / dapo recipes and their flags."""

import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_llm.loop.config import RunConfig
from jaxrl_llm.loop.resolve import effective, resolve
from jaxrl_llm.models.critic import actor_critic_params, value_param_labels
from jaxrl_llm.train import TrainConfig, make_train_step, policy_forward
from jaxrl_llm.train.optim import policy_value_optimizer
from tests.utils import train_two_steps

V = 5


def _shared_trunk_apply(p, tokens, pos, attn):
  """A toy shared-trunk model: ``embed`` feeds the LM head ``w`` and the value head."""
  h = p["embed"][tokens]                                  # [B, L, D]
  return h @ p["w"], (h @ p["value_w"])[..., 0] + p["value_b"][0]


def _shared_params(seed=0, d=3):
  r = np.random.default_rng(seed)
  return {"embed": jnp.asarray(r.normal(size=(V, d)), jnp.float32),
          "w": jnp.asarray(r.normal(size=(d, V)), jnp.float32),
          "value_w": jnp.asarray(r.normal(size=(d, 1)) * 0.1, jnp.float32),
          "value_b": jnp.zeros((1,), jnp.float32)}


def _batch(apply, params, *, seed=0, values=True):
  r = np.random.default_rng(seed)
  tokens = r.integers(0, V, size=(4, 6)).astype(np.int32)
  ones = np.ones(tokens.shape, np.float32)
  loss_mask = ones.copy()
  loss_mask[:, :2] = 0
  loss_mask[1, -1] = 0
  batch = dict(tokens=tokens, attention_mask=ones, loss_mask=loss_mask)
  logp, _, vals = policy_forward(apply, params, batch)
  rewards = np.zeros(tokens.shape, np.float32)
  rewards[:, -2] = np.array([1.0, 0.0, 1.0, 0.0], np.float32)
  batch.update(old_logp=np.asarray(logp), rewards=rewards)
  if values:
    batch["old_values"] = np.asarray(vals)
  return batch


# ------------------------------------------------------------- critic warm-up, value lr


def test_value_param_labels_split_value_head_and_critic():
  labels = value_param_labels(_shared_params())
  assert labels == {"embed": "policy", "w": "policy", "value_w": "critic",
                    "value_b": "critic"}
  ac = value_param_labels(actor_critic_params({"a": 1.0}, {"b": 2.0}))
  assert ac == {"policy": {"a": "policy"}, "critic": {"b": "critic"}}


def test_frozen_optimizer_starts_fresh_after_warmup():
  from jaxrl_llm.train.optim import freeze_for
  params = jnp.array([1.0, -0.0, 2.0])
  g = [jnp.array([0.3, -1.0, 2.0]), jnp.array([1.0, 1.0, -1.0]),
       jnp.array([0.5, 0.25, 4.0])]
  opt = freeze_for(optax.adam(0.1), 2)
  state = opt.init(params)
  for grad in g[:2]:
    u, state = opt.update(grad, state, params)
    after = optax.apply_updates(params, u)
    # -0.0 is the exact additive identity: even the -0.0 entry keeps its sign bit
    np.testing.assert_array_equal(np.signbit(after), np.signbit(params))
    np.testing.assert_array_equal(after, params)
  u, _ = opt.update(g[2], state, params)
  fresh, _ = optax.adam(0.1).update(g[2], optax.adam(0.1).init(params), params)
  np.testing.assert_array_equal(np.asarray(u), np.asarray(fresh))   # Adam's first step
  np.testing.assert_allclose(np.asarray(u), -0.1 * np.sign(g[2]), rtol=1e-5)


def test_critic_warmup_freezes_the_policy_bit_for_bit_while_value_loss_falls():
  params = _shared_params()
  batch = _batch(_shared_trunk_apply, params)
  opt = policy_value_optimizer(optax.adam(1e-2), optax.adam(5e-2), warmup_updates=6)
  step = jax.jit(make_train_step(_shared_trunk_apply, opt, TrainConfig(vf_clip=None)))
  state = make_train_step(_shared_trunk_apply, opt, TrainConfig(vf_clip=None)).init(params)
  vf = []
  for _ in range(6):
    state, m = step(state, batch)
    vf.append(float(m["vf_loss"]))
  for k in ("embed", "w"):              # the shared trunk is frozen with the policy
    np.testing.assert_array_equal(np.asarray(state.params[k]), np.asarray(params[k]))
  assert not np.array_equal(np.asarray(state.params["value_w"]),
                            np.asarray(params["value_w"]))
  assert vf[-1] < 0.8 * vf[0], vf
  state, _ = step(state, batch)         # warm-up over: the policy moves
  assert not np.array_equal(np.asarray(state.params["w"]), np.asarray(params["w"]))


def test_critic_warmup_with_a_separate_critic_moves_only_the_critic():
  pol = {"w": jnp.asarray(np.random.default_rng(1).normal(size=(V, V)), jnp.float32)}
  cri = {"v": jnp.zeros((V,), jnp.float32)}
  params = actor_critic_params(pol, cri)
  apply = lambda p, tokens, pos, attn: (p["policy"]["w"][tokens], p["critic"]["v"][tokens])
  batch = _batch(apply, params)
  opt = policy_value_optimizer(optax.adam(1e-2), optax.adam(1e-1), warmup_updates=3)
  step_fn = make_train_step(apply, opt, TrainConfig(vf_clip=None))
  state = step_fn.init(params)
  vf = []
  for _ in range(3):
    state, m = jax.jit(step_fn)(state, batch)
    vf.append(float(m["vf_loss"]))
  np.testing.assert_array_equal(np.asarray(state.params["policy"]["w"]),
                                np.asarray(pol["w"]))
  assert vf[-1] < vf[0]


def test_run_value_lr_and_warmup_settings():
  value_lr = lambda run: resolve(run).optimizer.value_lr
  assert value_lr(RunConfig(algo="vapo", lr=1e-3)) == pytest.approx(2e-3)
  assert value_lr(RunConfig(algo="vapo", lr=1e-3, value_lr=5e-3)) == 5e-3
  assert value_lr(RunConfig(algo="ppo", lr=1e-3)) == 1e-3
  assert resolve(RunConfig(algo="vapo")).critic_warmup_steps == 10
  assert resolve(RunConfig(algo="vapo", critic_warmup_steps=0)).critic_warmup_steps == 0
  assert resolve(RunConfig(algo="ppo")).critic_warmup_steps == 0
  # plain Adam (unchanged state layout) unless a value lr or warm-up asks otherwise
  params = _shared_params()
  assert isinstance(resolve(RunConfig(algo="ppo")).optimizer.build().init(params), tuple)
  state = resolve(RunConfig(algo="vapo")).optimizer.build().init(params)
  assert state.inner_states["policy"].inner_state.updates == 0   # the freeze counter
  with pytest.raises(ValueError, match=r"critic-warmup-steps .* value model"):
    resolve(RunConfig(algo="grpo", critic_warmup_steps=3))


# ---------------------------------------------------------------- positive-example NLL


def test_positive_nll_fixture_and_microbatching():
  params = {"w": jnp.asarray(np.random.default_rng(2).normal(size=(V, V)), jnp.float32)}
  apply = lambda p, tokens, pos, attn: (p["w"][tokens], None)
  batch = _batch(apply, params, values=False)
  batch["advantages"] = np.zeros(4, np.float32)
  batch["positive"] = np.array([1.0, 1.0, 0.0, 0.0], np.float32)
  logp = np.asarray(batch["old_logp"])
  mask = batch["loss_mask"] * batch["positive"][:, None]
  want = -(logp * mask).sum() / mask.sum()            # token mean over correct responses
  for micro in (1, 2):
    cfg = TrainConfig(use_value=False, whiten_advantages=False, pos_nll_coef=0.1,
                      num_microbatches=micro)
    step = make_train_step(apply, optax.sgd(1.0), cfg)
    new, m = jax.jit(step)(step.init(params), batch)
    np.testing.assert_allclose(float(m["pos_nll"]), want, rtol=1e-6)
    np.testing.assert_allclose(float(m["loss"]), 0.1 * want, rtol=1e-5)
  # the update is plain SGD on 0.1 * NLL (the pg term is 0 with zero advantages)
  grad = jax.grad(lambda p: -0.1 * jnp.sum(
      policy_forward(apply, p, batch)[0] * mask) / mask.sum())(params)
  np.testing.assert_allclose(np.asarray(new.params["w"]),
                             np.asarray(params["w"] - grad["w"]), atol=1e-6)
  with pytest.raises(ValueError, match="positive"):
    bad = {k: val for k, val in batch.items() if k != "positive"}
    step(step.init(params), bad)


# ------------------------------------------------------------- rollout mismatch correction


def _pg_setup():
  params = {"w": jnp.asarray(np.random.default_rng(3).normal(size=(V, V)), jnp.float32)}
  apply = lambda p, tokens, pos, attn: (p["w"][tokens], None)
  batch = _batch(apply, params, values=False)
  adv = np.random.default_rng(4).normal(size=batch["tokens"].shape).astype(np.float32)
  batch["advantages"] = adv * batch["loss_mask"]
  return params, apply, batch


def test_rollout_correction_with_unit_weights_is_bit_identical():
  params, apply, batch = _pg_setup()
  base = TrainConfig(use_value=False, whiten_advantages=False)
  corrected = TrainConfig(use_value=False, whiten_advantages=False,
                          rollout_correction="token")
  s0 = make_train_step(apply, optax.adam(1e-2), base)
  s1 = make_train_step(apply, optax.adam(1e-2), corrected)
  a, _ = jax.jit(s0)(s0.init(params), batch)
  b, m = jax.jit(s1)(s1.init(params), {**batch, "rollout_logp": batch["old_logp"]})
  np.testing.assert_array_equal(np.asarray(a.params["w"]), np.asarray(b.params["w"]))
  assert float(m["rollout_is_mean"]) == 1.0 and float(m["rollout_is_clipfrac"]) == 0.0


def test_rollout_correction_weights_the_policy_loss():
  params, apply, batch = _pg_setup()
  mask = batch["loss_mask"]
  shift = np.zeros(mask.shape, np.float32)
  shift[0, 3] = 1.0          # ratio e -> truncated to 2
  shift[2, 4] = -np.log(2.0)  # ratio 1/2, kept
  rollout_logp = batch["old_logp"] - shift
  weights = np.where(mask > 0, np.minimum(np.exp(shift), 2.0), 0.0)
  cfg = TrainConfig(use_value=False, whiten_advantages=False, rollout_correction="token")
  step = make_train_step(apply, optax.sgd(1.0), cfg)
  new, m = jax.jit(step)(step.init(params), {**batch, "rollout_logp": rollout_logp})
  n = mask.sum()
  np.testing.assert_allclose(float(m["rollout_is_mean"]), (n - 2 + 2.0 + 0.5) / n,
                             rtol=1e-6)
  np.testing.assert_allclose(float(m["rollout_is_clipfrac"]), 1 / n, rtol=1e-6)
  np.testing.assert_allclose(float(m["rollout_is_max"]), np.e, rtol=1e-6)
  # at ratio 1 the weighted PPO step equals the plain step with advantages * weights
  plain = make_train_step(apply, optax.sgd(1.0),
                          TrainConfig(use_value=False, whiten_advantages=False))
  ref, _ = jax.jit(plain)(plain.init(params),
                          {**batch, "advantages": batch["advantages"] * weights})
  np.testing.assert_allclose(np.asarray(new.params["w"]), np.asarray(ref.params["w"]),
                             atol=1e-6)
  with pytest.raises(ValueError, match="rollout_logp"):
    step(step.init(params), batch)


# ------------------------------------------------- dynamic sampling and overlong penalty


class _FakePolicy:
  """Random completions of ``n`` tokens (no model): exercises build_batch's wiring."""

  def __init__(self, n, vocab):
    self.n, self.vocab, self.calls = n, vocab, 0

  def generate(self, params, tokens, mask, key, *, max_new_tokens, eos_id,
               temperature=1.0, greedy=False, n=1):
    self.calls += 1
    tokens, mask = np.repeat(tokens, n, axis=0), np.repeat(mask, n, axis=0)
    b = tokens.shape[0]
    r = np.random.default_rng(self.calls)
    completion = r.integers(3, self.vocab, size=(b, max_new_tokens)).astype(np.int32)
    lengths = r.integers(1, max_new_tokens + 1, size=b).astype(np.int32)
    cmask = (np.arange(max_new_tokens)[None] < lengths[:, None]).astype(np.float32)
    return types.SimpleNamespace(
        tokens=np.concatenate([tokens, completion], 1),
        mask=np.concatenate([np.asarray(mask, np.float32), cmask], 1),
        completion=completion, completion_mask=cmask, lengths=lengths,
        finished=lengths < max_new_tokens,
        sampling_logprobs=-np.ones((b, max_new_tokens), np.float32))

  def forward(self, params, batch):
    z = np.zeros(batch["tokens"].shape, np.float32)
    return z, z, z

  ref_forward = forward


def _fake_task(score_fn, max_new_tokens=6):
  from jaxrl_llm.tasks import get_task
  real = get_task("reverse")
  return types.SimpleNamespace(
      tokenizer=real.tokenizer, sample_prompts=real.sample_prompts,
      max_prompt_len=real.max_prompt_len, max_new_tokens=max_new_tokens,
      score=score_fn, exact=score_fn, parsed=lambda problems, texts: None)


def test_dynamic_sampling_never_trains_on_an_all_equal_group():
  from jaxrl_llm.loop.batch import build_batch
  calls = {"n": 0}

  def score(problems, texts):   # the first two of every four groups are all-equal
    calls["n"] += 1
    s = np.random.default_rng(calls["n"]).integers(0, 2, size=len(texts)).astype(float)
    s = s.reshape(-1, 2)
    s[0::4] = 1.0
    s[1::4] = 0.0
    return s.reshape(-1)

  run = RunConfig(algo="dapo", prompts_per_step=8, group_size=2, max_sampling_draws=3,
                  overlong_buffer=1)
  task = _fake_task(score)
  policy = _FakePolicy(6, task.tokenizer.vocab_size)
  info: dict = {}
  batch, stats = build_batch(resolve(run, task), task, policy, None, None,
                             np.random.default_rng(0), jax.random.PRNGKey(0), info=info)
  adv = batch["advantages"].reshape(-1, 2)
  assert batch["tokens"].shape[0] == 16
  # dapo has no KL term: no reference is scored (and none was passed)
  assert "ref_logp" not in batch and stats["ref_s"] == 0.0 and "old_logp" in batch
  assert np.all(np.abs(adv).max(axis=1) > 0)            # no all-equal group
  # ... of task scores (the filter's criterion, before the overlong penalty)
  assert np.all(np.ptp(np.asarray(info["task_scores"]).reshape(-1, 2), axis=1) > 0)
  assert 1 <= stats["sampling_draws"] <= 3 == run.max_sampling_draws
  assert stats["groups_drawn"] == 8 * stats["sampling_draws"]
  # the overlong penalty (a 1-token buffer of the 6-token budget) is applied
  assert stats["overlong_penalty"] < 0
  batch, stats = build_batch(resolve(run, task), task, _FakePolicy(6, 40), None, None,
                             np.random.default_rng(0), jax.random.PRNGKey(0))
  assert stats["groups_kept"] > 0
  # no group with signal at all: the batch trains nothing (an exact no-op update)
  flat = _fake_task(lambda problems, texts: np.zeros(len(texts)))
  batch, stats = build_batch(resolve(run, flat), flat, _FakePolicy(6, 40), None, None,
                             np.random.default_rng(0), jax.random.PRNGKey(0))
  assert stats["groups_kept"] == 0 and stats["sampling_draws"] == 3
  assert batch["loss_mask"].sum() == 0


def test_build_batch_carries_rollout_logp_and_positive_marks():
  from jaxrl_llm.loop.batch import build_batch
  task = _fake_task(lambda problems, texts: np.arange(len(texts)) % 2 * 1.0)
  run = RunConfig(algo="vapo", prompts_per_step=2, group_size=2,
                  train={"rollout_correction": "token"})
  batch, stats = build_batch(resolve(run, task), task, _FakePolicy(6, 40), None, None,
                             np.random.default_rng(0), jax.random.PRNGKey(0))
  np.testing.assert_array_equal(batch["positive"], [0.0, 1.0, 0.0, 1.0])
  # cut at the budget: the rows whose completion took all 6 tokens without an eos
  lengths = batch["loss_mask"].sum(1)
  assert stats["truncated_frac"] == np.mean(lengths == 6) == 0.0
  assert "unparsed_frac" not in stats       # the task does not say
  fake = _FakePolicy(6, 40)
  fake.calls = 5                            # its 6th draw: lengths 6, 1, 6, 6
  _, stats = build_batch(resolve(run, task), task, fake, None, None,
                         np.random.default_rng(0), jax.random.PRNGKey(0))
  assert stats["truncated_frac"] == 0.75
  np.testing.assert_array_equal(batch["rollout_logp"], -batch["loss_mask"])


# ------------------------------------------------------------------ recipes and the CLI


def test_recipes_vapo_and_dapo_and_flags_override_them():
  from jaxrl_llm.cli import build_parser, run_config_from_args
  vapo = resolve(RunConfig(algo="vapo")).train
  assert (vapo.advantage_estimator, vapo.lam_value, vapo.lam_alpha, vapo.clip_range(),
          vapo.pos_nll_coef, vapo.loss_agg_mode, vapo.use_value, vapo.kl_mode) == (
      "vapo_gae", 1.0, 0.05, (0.2, 0.28), 0.1, "token-mean", True, "none")
  dapo = RunConfig(algo="dapo")
  cfg = resolve(dapo).train
  assert (cfg.use_value, cfg.kl_mode, cfg.clip_range()) == (False, "none", (0.2, 0.28))
  # The overlong buffer: a quarter of a dataset's budget; none on a built-in task,
  # whose budget is its longest answer + eos (a buffer would hit every correct answer).
  assert resolve(dapo).sampling.dynamic_sampling
  assert resolve(dapo).sampling.overlong_buffer == 0
  on_dataset = RunConfig(algo="dapo", dataset="d.jsonl", max_new_tokens=200)
  assert effective(on_dataset, "overlong_buffer") == 50
  args = build_parser().parse_args(
      ["train", "--algo", "vapo", "--critic-warmup-steps", "0",
       "--lam-value", "0.99", "--lam-alpha", "0.1", "--clip-high", "0.3",
       "--value-lr", "0.01", "--no-dynamic-sampling", "--overlong-buffer", "4"])
  resolved = resolve(run_config_from_args(args))
  cfg = resolved.train
  assert resolved.run.algo == "vapo" and resolved.critic_warmup_steps == 0
  assert (cfg.lam, cfg.lam_value, cfg.lam_alpha, cfg.clip_high) == (0.95, 0.99, 0.1, 0.3)
  assert resolved.optimizer.value_lr == 0.01 and resolved.sampling.overlong_buffer == 4
  assert resolved.sampling.dynamic_sampling is False
  # vapo_gae's policy lambda is length-adaptive: --lam needs decoupled_gae.
  args = build_parser().parse_args(["train", "--algo", "vapo", "--lam", "0.9"])
  with pytest.raises(ValueError, match="--advantage-estimator decoupled_gae"):
    resolve(run_config_from_args(args))
  args = build_parser().parse_args(["train", "--algo", "vapo", "--lam", "0.9",
                                    "--advantage-estimator", "decoupled_gae"])
  assert resolve(run_config_from_args(args)).train.lam == 0.9


@pytest.mark.parametrize("argv,field,value", [
    (["--algo", "vapo", "--pos-nll-coef", "none"], "pos_nll_coef", None),
    (["--algo", "vapo", "--lam-value", "none"], "lam_value", None),
    (["--algo", "vapo", "--lam-alpha", "None"], "lam_alpha", None),
    (["--algo", "dr_grpo", "--norm-length", "none"], "norm_length", None),
    (["--algo", "dapo", "--clip-high", "none"], "clip_high", None),
    (["--algo", "vapo"], "pos_nll_coef", 0.1),             # not given: the recipe's
    (["--algo", "dapo"], "clip_high", 0.28),
])
def test_an_explicit_none_flag_replaces_the_recipes_value(argv, field, value):
  from jaxrl_llm.cli import build_parser, run_config_from_args
  run = run_config_from_args(build_parser().parse_args(["train", *argv]))
  config = resolve(run).train
  assert run.train == ({field: None} if value is None else {})
  assert getattr(config, field) == value
  if field == "clip_high" and value is None:
    assert config.clip_range() == (0.2, None)   # symmetric


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["vapo", "dapo"])
def test_cli_recipe_trains_two_steps_without_nan(recipe, tmp_path):
  warmup = ["--critic-warmup-steps", "1"] if recipe == "vapo" else []
  rows = train_two_steps(str(tmp_path / recipe), "--algo", recipe, *warmup)
  if recipe == "vapo":
    assert rows[1]["critic_warmup"] == 1.0 and "critic_warmup" not in rows[2]
    assert np.isfinite(rows[2]["pos_nll"]) and np.isfinite(rows[2]["vf_loss"])
  else:
    assert 1 <= rows[1]["sampling_draws"] <= 4


@pytest.mark.slow
def test_critic_init_warm_starts_the_value_head_from_a_run_folder(tmp_path, capsys):
  from jaxrl_llm.loop.run import run_training
  from jaxrl_llm.loop.setup import make_policy, make_task, warm_start_value_params
  small = dict(prompts_per_step=4, group_size=2, eval_every=2, eval_size=8, progress=False)
  src = str(tmp_path / "warm")
  run_training(RunConfig(algo="ppo", steps=2, save_every=2, out=src, seed=1, **small))
  run = RunConfig(algo="vapo", critic_init=src, out=str(tmp_path / "b"), **small)
  task = make_task(run)
  policy = make_policy(resolve(run, task), task)
  params = warm_start_value_params(run, policy.init_params)
  ours = jax.tree_util.tree_leaves_with_path(params)
  init = dict(jax.tree_util.tree_leaves_with_path(policy.init_params))
  moved = {jax.tree_util.keystr(p) for p, leaf in ours
           if not np.array_equal(np.asarray(leaf), np.asarray(init[p]))}
  assert moved == {"['value_b'].value", "['value_w'].value"}, moved
  with pytest.raises(ValueError, match="value model"):
    resolve(RunConfig(algo="grpo", critic_init=src))
  # A separate critic cannot start from a value head: one line, exit 2, nothing written.
  from jaxrl_llm.cli import main
  bad = tmp_path / "separate"
  assert main(["train", "--algo", "ppo", "--critic", "policy", "--critic-init", src,
               "--out", str(bad), "--no-progress"]) == 2
  err = capsys.readouterr().err
  assert err.startswith(f"error: --critic-init {src!r}: value parameter ") and \
      "layout must match" in err and err.count("\n") == 1, err
  assert not bad.exists() or not os.listdir(bad)


def test_build_batch_runs_no_policy_forward_when_the_step_takes_old_logp():
  from jaxrl_llm.loop.batch import build_batch
  task = _fake_task(lambda problems, texts: np.arange(len(texts)) % 2 * 1.0)
  calls = []

  class Counting(_FakePolicy):
    def forward(self, params, batch):
      calls.append("forward")
      return super().forward(params, batch)

  for from_step, forwards in ((False, 1), (True, 0)):
    calls.clear()
    run = RunConfig(algo="grpo", prompts_per_step=2, group_size=2,
                    train={"old_logp_from_step": from_step})
    batch, stats = build_batch(resolve(run, task), task, Counting(6, 40), None, None,
                               np.random.default_rng(0), jax.random.PRNGKey(0))
    assert len(calls) == forwards and ("old_logp" in batch) == (not from_step)
    assert stats["old_logp_s"] >= 0.0 and (stats["old_logp_s"] == 0.0) == from_step
