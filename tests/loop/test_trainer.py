"""The RL loop: every algorithm runs, kill-and-resume is exact, bad input is refused."""

import argparse
import json
import os
import subprocess
import sys
import typing

import numpy as np
import pytest

from jaxrl_llm.loop.config import RunConfig
from jaxrl_llm.loop.recipes import RECIPES
from jaxrl_llm.loop.resolve import resolve
from jaxrl_llm.loop.run import run_training
from jaxrl_llm.run_folder import RunFolderError
from tests._devices import xla_flags_with_devices
from tests.utils import train_two_steps

ALGOS = tuple(RECIPES)

SMALL = dict(steps=3, prompts_per_step=4, group_size=2, eval_every=3, eval_size=8,
             save_every=2, progress=False)


def _budget(max_new_tokens):
  """A stand-in task for :func:`resolve`: only its response budget is read."""
  return argparse.Namespace(max_new_tokens=max_new_tokens)


def _rows(out):
  with open(os.path.join(out, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.mark.slow
@pytest.mark.parametrize("algo", ALGOS)
def test_three_steps_of_every_algo_give_finite_metrics(algo, tmp_path):
  summary = run_training(RunConfig(algo=algo, out=str(tmp_path), **SMALL))
  rows = _rows(tmp_path)
  assert [r["step"] for r in rows] == [0, 1, 2, 3]
  for row in rows[1:]:
    for key in ("reward", "loss", "pg_loss", "entropy", "approx_kl", "pg_clipfrac",
                "adv_raw_var", "grad_norm"):
      assert np.isfinite(row[key]), (algo, key)
    assert row["skipped"] == 0
  assert "eval_accuracy" in rows[-1] and summary["steps"] == 3
  if algo == "ppo":
    assert np.isfinite(rows[-1]["vf_loss"])


@pytest.mark.slow
def test_keyboard_interrupt_checkpoints_the_last_step_and_resumes(tmp_path):
  """Ctrl-C inside the loop saves the last completed step (no periodic checkpoint is
  due) and ``--resume`` continues from it. That a resumed run equals an uninterrupted
  one bit for bit is test_cli_faults' SIGKILL / SIGTERM test, on the real command."""
  cfg = dict(SMALL, steps=4, algo="ppo", save_every=10)

  def stop_after_two(row):
    if row["step"] == 2:
      raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    run_training(RunConfig(out=str(tmp_path), **cfg), on_step=stop_after_two)
  assert os.listdir(tmp_path / "checkpoints") == ["2"]
  run_training(RunConfig(out=str(tmp_path), resume=True, **cfg))
  resumed = _rows(tmp_path)
  assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
  assert all(np.isfinite(r["loss"]) and r["skipped"] == 0 for r in resumed[1:])


@pytest.mark.slow
def test_bad_input_is_refused_with_clear_messages(tmp_path):
  with pytest.raises(ValueError, match=r"valid tasks: .*reverse"):
    RunConfig(task="chess").validate()
  with pytest.raises(ValueError, match="valid algos: ppo, grpo"):
    RunConfig(algo="dpo").validate()
  with pytest.raises(ValueError, match="group-size >= 2"):
    resolve(RunConfig(algo="grpo", group_size=1))   # the recipe's check
  resolve(RunConfig(algo="self_critical", group_size=1))   # not a group estimator
  out = str(tmp_path / "run")
  run_training(RunConfig(out=out, **dict(SMALL, steps=1)))
  with pytest.raises(RunFolderError, match=r"different config.*lr"):
    run_training(RunConfig(out=out, lr=0.5, **dict(SMALL, steps=1)))
  with pytest.raises(RunFolderError, match="--resume"):
    run_training(RunConfig(out=out, **dict(SMALL, steps=1)))


@pytest.mark.slow
def test_cli_train_eval_plot_as_subprocess(tmp_path):
  out = str(tmp_path / "cli_run")
  # Two forced CPU devices and --data 2: the CLI trains on a data-parallel mesh.
  # (the caller's own forced device count, e.g. 8, is replaced)
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=xla_flags_with_devices(os.environ.get("XLA_FLAGS", ""), 2))
  cmd = [sys.executable, "-m", "jaxrl_llm", "train", "--steps", "2", "--prompts-per-step",
         "4", "--group-size", "2", "--eval-size", "8", "--eval-every", "2", "--data", "2",
         "--out", out]
  done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
  assert done.returncode == 0, done.stderr
  assert "eval_accuracy_end" in done.stdout
  assert os.path.exists(os.path.join(out, "config.json"))
  # a second train into the same folder without --resume is refused, with exit code 2
  again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
  assert again.returncode == 2 and "--resume" in again.stderr
  bad = subprocess.run([sys.executable, "-m", "jaxrl_llm", "train", "--algo", "nope"],
                       capture_output=True, text=True, env=env, timeout=600)
  assert bad.returncode == 2 and "invalid choice: 'nope'" in bad.stderr
  assert "Traceback" not in bad.stderr and "grpo" in bad.stderr
  assert os.path.getsize(os.path.join(out, "curves.png")) > 10_000    # the run's own plot
  from jaxrl_llm.cli import main  # (in-process: one interpreter less)
  png = str(tmp_path / "curves.png")
  assert main(["plot", out, out, "--labels", "a", "b", "-o", png]) == 0
  assert os.path.getsize(png) > 10_000


# ---------------------------------------------------------- config, recipes and CLI


def test_run_config_composes_the_train_config():
  from jaxrl_llm.loop import RunConfig as LoopRunConfig
  assert LoopRunConfig is RunConfig
  ppo = RunConfig(algo="ppo", train={"kl_coef": 0.01, "policy_loss": "gspo"})
  cfg = resolve(ppo, _budget(8)).train
  assert (cfg.use_value, cfg.kl_mode, cfg.kl_coef, cfg.policy_loss) == (
      True, "reward", 0.01, "gspo")
  assert cfg.clip_range() == (3e-4, 4e-4)
  dr = resolve(RunConfig(algo="dr_grpo"), _budget(8)).train
  assert (dr.use_value, dr.loss_agg_mode, dr.norm_length) == (
      False, "seq-mean-token-sum-norm", 8)
  saved = RunConfig.from_dict({"algo": "ppo", "train": {"clip_low": 0.1}})
  assert saved.train == {"clip_low": 0.1}
  # the earlier flat form and key names are gone (0.1.0 has no older runs to load)
  for old in ({"clip": 0.1}, {"kl_coef": 0.0}, {"critic_lr": 1e-4}, {"nonsense": 1}):
    with pytest.raises(ValueError, match=next(iter(old))):
      RunConfig.from_dict(old)
  with pytest.raises(ValueError, match="lam"):
    resolve(RunConfig(train={"lam": 2.0}))


def test_a_recipe_with_rollout_side_settings_is_one_registration():
  """A new algorithm (here a DAPO variant: a fixed 2-token overlong buffer, dynamic
  sampling, critic-free, KL off) is one ``register_recipe`` call: ``resolve``, the
  command's ``--algo`` choices and its help read the registry."""
  from jaxrl_llm.cli import build_parser, run_config_from_args
  from jaxrl_llm.loop.recipes import Recipe, Sampling, register_recipe
  register_recipe(Recipe("dapo2", "grpo", "DAPO with a fixed buffer",
                         dict(use_value=False, whiten_advantages=False, vf_clip=None),
                         sampling=Sampling(dynamic_sampling=True, overlong_buffer=2)))
  try:
    run = run_config_from_args(build_parser().parse_args(["train", "--algo", "dapo2"]))
    resolved = resolve(run)
    assert (resolved.sampling.dynamic_sampling, resolved.sampling.overlong_buffer) == (
        True, 2)
    assert (resolved.train.use_value, resolved.train.kl_mode) == (False, "none")
    assert resolved.critic_warmup_steps == 0 and not resolved.optimizer.split
    assert resolve(RunConfig(algo="dapo2", overlong_buffer=0)).sampling.overlong_buffer == 0
  finally:
    del RECIPES["dapo2"]


def test_clip_end_schedule_reaches_clip_end_on_the_last_step():
  # The step's schedule reads state.step: 0 on the first train step, steps - 1 on the last.
  cfg = resolve(RunConfig(steps=5, clip_end=0.05), _budget(8)).train
  clips = [float(cfg.clip_schedule(s)) for s in range(5)]
  np.testing.assert_allclose(clips, [0.2, 0.1625, 0.125, 0.0875, 0.05], rtol=1e-6)
  one = resolve(RunConfig(steps=1, clip_end=0.05), _budget(8)).train
  assert float(one.clip_schedule(0)) == pytest.approx(0.2)   # one step: the start value
  assert resolve(RunConfig(steps=5), _budget(8)).train.clip_schedule is None


class _FakeState(typing.NamedTuple):
  params: typing.Any


class _FakeCheckpointer:
  """What the loop calls on its Checkpointer, without orbax."""

  def __init__(self, directory, **kwargs):
    self.directory, self.steps = directory, []

  def save(self, step, state, extra=None, force=False):
    self.steps.append(step)

  def all_steps(self):
    return list(self.steps)

  def latest_step(self):
    return self.steps[-1] if self.steps else None

  def note_step(self, skipped):
    pass

  def close(self):
    pass


@pytest.mark.parametrize("skipped,max_skips,error", [
    (1.0, 20, None),          # one of the step's two updates skipped: the step learned
    (1.0, 1, None),           # ... and it is no skipped step for --max-consecutive-skips
    (2.0, 20, "every update of steps 1-3 was skipped"),
    (2.0, 2, "stopped at step 2: every update of the last 2 steps was skipped"),
])
def test_a_step_counts_as_skipped_only_when_all_its_updates_were(
    monkeypatch, tmp_path, skipped, max_skips, error):
  """The loop's reading of metrics["skipped"] (a count of the step's skipped updates)."""
  import jax.numpy as jnp

  import jaxrl_llm.loop.run as T

  def fake_step(state, batch):
    metrics = {"skipped": jnp.float32(skipped), "loss": jnp.float32(0)}
    return _FakeState({"w": state.params["w"] + 1.0}), metrics

  fake_step.init = lambda params, rng=None: _FakeState(params)  # type: ignore[attr-defined]
  monkeypatch.setattr(T, "make_train_step", lambda apply, opt, config, **kw: fake_step)
  def fake_batch(*a, info=None, **k):
    if info is not None:         # the scores the loop's learning-signal watch reads
      info.update(scores=np.array([0.0, 1.0], np.float32), exact=np.zeros(2, np.float32))
    return {"x": np.zeros(1)}, {"reward": 0.0}

  monkeypatch.setattr(T, "build_batch", fake_batch)
  monkeypatch.setattr(T, "evaluate", lambda *a: {"eval_accuracy": 0.0, "eval_reward": 0.0})
  monkeypatch.setattr(T, "Checkpointer", _FakeCheckpointer)
  policy = argparse.Namespace(init_params={"w": jnp.zeros(2)}, apply=None,
                              ref_params=lambda params: params, trainable=None,
                              ref_shares_params=False, rollout_stats=dict)
  run = RunConfig(out=str(tmp_path / "run"), max_consecutive_skips=max_skips,
                  train={"num_minibatches": 2}, **SMALL)
  if error is None:
    assert T.run_training(run, policy=policy)["steps"] == 3
  else:
    with pytest.raises(T.SkippedUpdatesError, match=error):
      T.run_training(run, policy=policy)
  assert [r.get("skipped") for r in _rows(run.out)][1:3] == [skipped, skipped]
  config = resolve(run).train
  assert not T.step_skipped({"skipped": 1.0}, config)
  assert T.step_skipped({"skipped": 2.0}, config) and not T.step_skipped({}, config)


def test_cli_help_lists_every_loss_algo_and_task_with_defaults():
  from jaxrl_llm.cli import build_parser
  from jaxrl_llm.tasks import TASKS
  from jaxrl_llm.train import POLICY_LOSS_REGISTRY
  parser = build_parser()
  sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
  text = sub.choices["train"].format_help()
  for name in list(POLICY_LOSS_REGISTRY) + list(ALGOS) + sorted(TASKS):
    assert name in text, name
  for flag in ("--policy-loss", "--tau-pos", "--clip-high", "--dual-clip", "--kl-coef",
               "--num-minibatches", "--data"):
    assert flag in text, flag
  # every option says what it is and its default
  train_actions = [a for a in sub.choices["train"]._actions if a.option_strings
                   and a.dest != "help"]
  assert all("(default:" in (a.help or "") for a in train_actions)


def test_cli_arguments_become_the_run_config():
  from jaxrl_llm.cli import build_parser, run_config_from_args
  args = build_parser().parse_args(
      ["train", "--algo", "ppo", "--policy-loss", "sapo", "--tau-pos", "2", "--clip-low", "0.1",
       "--hybrid-n", "3", "--no-whiten-advantages", "--data", "2", "--clip-high", "none"])
  run = run_config_from_args(args)
  assert run.algo == "ppo" and run.mesh_data == 2
  assert run.train == {"policy_loss": "sapo", "clip_low": 0.1, "hybrid_n": 3,
                       "whiten_advantages": False, "loss_hparams": {"tau_pos": 2.0},
                       "advantage_estimator": "hybrid", "clip_high": None}
  cfg = resolve(run).train
  assert cfg.hparam_values()["tau_pos"] == 2.0 and cfg.advantage_estimator == "hybrid"


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["gspo"])   # the flag's path is the same for every loss
def test_cli_trains_with_other_policy_losses_without_nan(loss, tmp_path):
  out = str(tmp_path / loss)
  rows = train_two_steps(out, "--policy-loss", loss)
  for row in rows[1:]:
    assert np.isfinite(row["approx_kl"]), loss
    assert row["skipped"] == 0
  expected = {"gspo": 3e-4, "cispo": 0.2}[loss]
  assert rows[1]["clip_eps"] == pytest.approx(expected)
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["train"] == {"policy_loss": loss}


@pytest.mark.parametrize("algo", ALGOS)
def test_every_recipe_pushes_the_rewarded_completion_up(algo):
  """Learning signal of the trainer's wiring: recipe -> estimator -> train step.

  Two completions of one prompt, the first rewarded: after one SGD step the first
  becomes more likely and the second less likely, whatever the algorithm.
  """
  import jax
  import jax.numpy as jnp
  import optax

  from jaxrl_llm.loop.recipes import get_recipe
  from jaxrl_llm.train import AdvantageInputs, compute_advantages, make_train_step, policy_forward

  vocab = 5
  params = {"w": jnp.zeros((vocab, vocab), jnp.float32),
            "v": jnp.zeros((vocab,), jnp.float32)}
  apply = lambda p, tokens, pos, attn: (p["w"][tokens], p["v"][tokens])
  tokens = np.array([[0, 1, 2, 3], [0, 1, 4, 4]], np.int32)
  ones = np.ones(tokens.shape, np.float32)
  loss_mask = np.array([[0, 0, 1, 1], [0, 0, 1, 1]], np.float32)
  scores = np.array([1.0, 0.0], np.float32)
  rewards = np.zeros(tokens.shape, np.float32)
  rewards[:, -1] = scores
  batch = dict(tokens=tokens, attention_mask=ones, loss_mask=loss_mask)
  logp0, _, values = policy_forward(apply, params, batch)
  batch.update(old_logp=np.asarray(logp0), ref_logp=np.asarray(logp0))
  run = RunConfig(algo=algo, group_size=2)
  config = resolve(run, _budget(2)).train
  recipe = get_recipe(algo)
  if config.use_value:
    batch["old_values"] = np.asarray(values)
  if config.pos_nll_coef is not None:
    batch["positive"] = scores
  if recipe.in_step:
    batch["rewards"] = rewards
  else:
    batch["advantages"] = np.asarray(compute_advantages(
        recipe.estimator, AdvantageInputs(rewards=rewards, mask=loss_mask, scores=scores,
                                          greedy_scores=np.full(2, 0.5, np.float32),
                                          group_size=2),
        config.hparam_values())[0])
  step = make_train_step(apply, optax.sgd(1.0), config)
  state, metrics = jax.jit(step)(step.init(params), batch)
  assert float(metrics["skipped"]) == 0
  logp1, _, _ = policy_forward(apply, state.params, batch)
  delta = np.asarray(((logp1 - logp0) * loss_mask).sum(1))
  assert delta[0] > 1e-3 and delta[1] < -1e-3, (algo, delta)
