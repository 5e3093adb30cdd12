"""The RL loop with --partial-rollouts: groups finished across steps, versions,
staleness metrics, resume, and its bad input on the real command."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxrl_llm.loop.config import RunConfig
from jaxrl_llm.loop.partial import PartialRollouts
from jaxrl_llm.loop.resolve import resolve
from jaxrl_llm.loop.run import run_training
from jaxrl_llm.loop.setup import make_policy, make_task

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = dict(prompts_per_step=4, group_size=2, eval_every=2, eval_size=8, save_every=2,
             progress=False, partial_rollouts=True, token_budget=8)


def _rows(out):
  with open(os.path.join(out, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _counting_waits(engine):
  """Wraps ``engine.generate`` to record, per call, the samples that wait for a slot
  (queued in the engine + the call's new ones) as it starts."""
  waits, generate = [], engine.generate

  def counted(params, requests, *args, **kwargs):
    waits.append(engine.waiting + sum(r.n for r in requests))
    return generate(params, requests, *args, **kwargs)

  engine.generate = counted
  return waits


def test_partial_rollouts_train_on_complete_groups_with_their_versions():
  run = RunConfig(**SMALL)
  task = make_task(run)
  resolved = resolve(run, task)
  assert resolved.train.rollout_correction == "token"        # on by default here
  policy = make_policy(resolved, task)
  partial = PartialRollouts(policy, task, resolved.sampling, resolved.train,
                            token_budget=run.token_budget)
  waits = _counting_waits(partial.engine)
  params = policy.init_params
  lags = []
  for version in range(4):
    rng = np.random.default_rng([0, version + 1])
    rows, problems, stats = partial.rollout(params, version, rng,
                                            jax.random.PRNGKey(version))
    g = 2
    assert rows["tokens"].shape[0] == 8 and len(problems) == 4
    # A group's rows hold one prompt, all its samples finished (ended on eos or the
    # budget), and each generated token's version is at most this one.
    for k in range(4):
      group = rows["tokens"][k * g:(k + 1) * g, :task.max_prompt_len]
      assert np.all(group == group[0]) and np.all(rows["problem"][k * g:(k + 1) * g] == k)
    gen = rows["loss_mask"] > 0
    assert np.all((rows["versions"][gen] >= 0) & (rows["versions"][gen] <= version))
    assert np.all(rows["versions"][~gen] == -1)
    assert np.all(rows["rollout_logp"][~gen] == 0) and np.all(rows["rollout_logp"][gen] < 0)
    lag = version - rows["versions"][gen]
    assert stats["staleness_mean"] == pytest.approx(lag.mean())
    assert stats["staleness_max"] == lag.max()
    assert stats["in_flight"] == partial.engine.in_flight
    # Every sample of an untrained group is finished or in the engine (in a slot or
    # waiting for one), and at least a full set of slots' worth waited at every call.
    assert partial.engine.max_slots == 8
    unfinished = sum(g - len(done) for done in partial.finished.values())
    assert stats["in_flight"] == unfinished
    lags.append(stats["staleness_max"])
  assert min(waits) >= 8 and len(waits) > 4
  # Samples did span steps (seeded; these values follow the engine's default pool,
  # which since it holds every slot with a prompt of its own admits samples earlier:
  # with the pool one page short per slot they were [0, 1, 1, 1], 0.6875, 11, 1).
  assert lags == [0, 0, 1, 1]
  assert (stats["staleness_mean"], stats["in_flight"], stats["groups_waiting"]) == (
      0.1875, 10, 0)
  assert partial.engine.reset() == stats["in_flight"] and partial.engine.pages_in_use == 0


def test_a_step_whose_batch_is_already_complete_calls_and_submits_nothing():
  """16 slots and a budget that finishes every sample in one call: step 0 submits 8
  groups (16 samples), completes them and trains 4; step 1 trains the 4 waiting ones
  without an engine call and submits no new group (they would only wait); step 2 tops
  up and calls again."""
  run = RunConfig(**{**SMALL, "token_budget": 10_000, "rollout_slots": 16})
  task = make_task(run)
  resolved = resolve(run, task)
  policy = make_policy(resolved, task)
  partial = PartialRollouts(policy, task, resolved.sampling, resolved.train,
                            token_budget=run.token_budget)
  calls, sent = [], []
  for version in range(3):
    rows, problems, stats = partial.rollout(policy.init_params, version,
                                            np.random.default_rng([1, version]),
                                            jax.random.PRNGKey(version))
    calls.append(stats["engine_calls"])
    sent.append(stats["submitted_groups"])
    assert len(problems) == 4 and np.all(rows["loss_mask"].sum(axis=1) > 0)
  assert calls == [1.0, 0.0, 1.0] and sent == [8.0, 0.0, 8.0]
  assert partial.outstanding == 4 and stats["groups_waiting"] == 4
  assert partial.engine.in_flight == 0


@pytest.mark.slow
def test_a_partial_rollout_run_trains_reports_staleness_and_resumes(tmp_path):
  run_training(RunConfig(steps=2, out=str(tmp_path), **SMALL))
  # Resume: the in-flight samples are not in the checkpoint; they are regenerated.
  run_training(RunConfig(steps=4, out=str(tmp_path), resume=True, **SMALL))
  rows = _rows(tmp_path)
  assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
  for row in rows[1:]:
    for key in ("staleness_mean", "staleness_max", "in_flight", "groups_waiting",
                "behaviour_kl", "rollout_is_mean", "generate_s", "loss"):
      assert np.isfinite(row[key]), key
    assert 0 <= row["staleness_mean"] <= row["staleness_max"] <= row["step"] - 1
    assert row["skipped"] == 0
  assert rows[1]["staleness_max"] == 0 and rows[3]["staleness_max"] == 0  # fresh starts
  assert "eval_accuracy" in rows[-1]


def _train(out, *flags):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  return subprocess.run([sys.executable, "-m", "jaxrl_llm", "train", "--steps", "2",
                         "--out", str(out), *flags], capture_output=True, text=True,
                        env=env, timeout=120)


@pytest.mark.parametrize("flags, message", [
    (["--partial-rollouts", "--token-budget", "0"],
     "error: --token-budget must be an int >= 1 (got 0)"),
    (["--partial-rollouts", "--token-budget", "-4"],
     "error: --token-budget must be an int >= 1 (got -4)"),
    (["--partial-rollouts", "--rollout", "simple"],
     "error: --partial-rollouts needs --rollout engine (got --rollout simple)"),
    (["--token-budget", "8"], "error: --token-budget is the budget of --partial-rollouts"),
    (["--partial-kv", "keep"], "error: --partial-kv keep is a setting of --partial-rollouts"),
])
def test_bad_partial_rollout_flags_are_one_line_errors_before_anything_is_written(
    tmp_path, flags, message):
  out = tmp_path / "run"
  done = _train(out, *flags)
  assert done.returncode == 2
  errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and errors[0].startswith(message), done.stderr
  assert not out.exists()
