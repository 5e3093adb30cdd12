"""The no-learning-signal warning (jaxrl_llm.loop.signals) and the rollout fractions it
names (truncated, unparsed)."""

import math

import numpy as np
import pytest

from jaxrl_llm.loop.signals import (
  MIN_NO_SIGNAL_STEPS,
  NO_SIGNAL_STEPS,
  SignalWatch,
  signal_window,
)
from jaxrl_llm.tasks import JsonlTask
from jaxrl_llm.tasks.base import Problem


def _window_by_counting(prompts, group_size, success=0.05, false_alarm=0.01):
  """The smallest k in [3, 10] whose k flat steps in a row have chance <= false_alarm,
  counted step by step."""
  q = (success ** group_size + (1 - success) ** group_size) ** prompts
  for k in range(MIN_NO_SIGNAL_STEPS, NO_SIGNAL_STEPS + 1):
    if q ** k <= false_alarm:
      return k
  return NO_SIGNAL_STEPS


@pytest.mark.parametrize("prompts,group_size", [
    (1, 2), (1, 8), (2, 4), (4, 8), (8, 4), (8, 8), (32, 8), (2, 16), (3, 3)])
def test_window_is_the_fewest_steps_of_a_one_percent_false_alarm(prompts, group_size):
  assert signal_window(prompts, group_size) == _window_by_counting(prompts, group_size)


def test_window_pins_and_bounds():
  # the module docstring's settings: a real model's first run, the defaults, P = 1
  assert [signal_window(8, 4), signal_window(32, 8), signal_window(1, 8)] == [3, 3, 10]
  # q = 0.95**8 + 0.05**8 = 0.6634; 0.6634**11 = 0.011 > 1%, 0.6634**12 = 0.0073
  assert math.ceil(math.log(0.01) / math.log(0.95 ** 8 + 0.05 ** 8)) == 12
  # fewer prompts or smaller groups never shorten the window
  for p in range(1, 12):
    for g in range(2, 10):
      assert signal_window(p, g) >= signal_window(p + 1, g)
      assert signal_window(p, g) >= signal_window(p, g + 1)
  # no group baseline (G = 1): the batch is one group of P
  assert signal_window(64, 1) == signal_window(1, 64) == 3


def test_the_warning_names_the_truncated_and_unparsed_fractions():
  watch = SignalWatch(window=3, first_step=1, last_step=50)
  flat = np.zeros(8)
  outs = [watch.update(s, flat, group_size=4, grad_norm=0.0, accuracy=0.0,
                       truncated=0.75, unparsed=0.5) for s in (1, 2, 3)]
  assert outs[:2] == [None, None]
  assert outs[2].startswith("warning: no learning signal in steps 1-3 of 50: every "
                            "group's rewards were equal (mean reward 0, completions cut "
                            "at --max-new-tokens 75%, without a parsable answer 50%)")
  # once per run; a step with signal resets the streak of a run that has not warned
  assert watch.update(4, flat, group_size=4, grad_norm=0.0, accuracy=0.0) is None
  fresh = SignalWatch(window=3, first_step=1, last_step=50)
  for s, scores in enumerate([flat, flat, np.r_[1.0, np.zeros(7)], flat, flat], 1):
    assert fresh.update(s, scores, group_size=4, grad_norm=None, accuracy=0.0) is None
  assert "steps 4-6 of 50" in fresh.update(6, flat, group_size=4, grad_norm=None,
                                           accuracy=0.0)
  assert "%" not in SignalWatch(window=3).update(1, flat, group_size=4, grad_norm=0.0,
                                                  accuracy=0.0)


def test_jsonl_parsed_follows_the_reward(tmp_path):
  path = tmp_path / "d.jsonl"
  path.write_text('{"prompt": "1+1=", "answer": "2"}\n')
  p = Problem("1+1=", "2")
  texts = ["it is 2", r"\boxed{3}", "no number"]
  assert JsonlTask(path=str(path), reward_fn="math").parsed([p] * 3, texts).tolist() == [
      True, True, False]
  assert JsonlTask(path=str(path), reward_fn="boxed").parsed([p] * 3, texts).tolist() == [
      False, True, False]
  assert JsonlTask(path=str(path), reward_fn="exact").parsed([p] * 3, texts) is None


def test_signal_watch_state_round_trips_and_refuses_another_step():
  watch = SignalWatch(window=5, first_step=1, last_step=9)
  flat = np.zeros(4)
  for s in (1, 2, 3):
    watch.update(s, flat, group_size=2, grad_norm=None, accuracy=0.0)
  saved = watch.state()
  assert saved == {"step": 3, "streak": 3, "warned": None, "first_step": 1}
  again = SignalWatch(window=5, last_step=9)
  assert again.restore(saved, 3) and again.state() == saved
  # A state of another step, or a malformed one, starts afresh after the resumed step.
  for bad, step in ((saved, 4), ({**saved, "streak": 9}, 3), ({**saved, "streak": 2.0}, 3),
                    ({**saved, "warned": 1}, 3), ({"step": 3}, 3), (None, 3)):
    fresh = SignalWatch(window=5, last_step=9)
    assert not fresh.restore(bad, step)
    assert fresh.state() == {"step": step, "streak": 0, "warned": None,
                             "first_step": step + 1}


@pytest.mark.slow
def test_a_resumed_run_continues_the_no_signal_streak(tmp_path, monkeypatch):
  """A streak of steps without signal crosses the resume: a run stopped at step 2 of
  4 and resumed warns at step 4 with a streak of 4, as the uninterrupted run does, and
  its rows are that run's. A checkpoint without the watch's state (an older version)
  resumes with a fresh watch: no error, the streak counted from step 3."""
  import json
  import os

  import jaxrl_llm.loop.run as loop_run
  from jaxrl_llm.checkpoint import Checkpointer
  from jaxrl_llm.loop.config import RunConfig
  data = tmp_path / "never.jsonl"      # an answer the tiny random model never writes
  data.write_text("".join(json.dumps({"prompt": f"q{i}:", "answer": "zqzqzqzq"}) + "\n"
                          for i in range(16)))
  cfg = dict(steps=4, prompts_per_step=4, group_size=2, eval_every=2, eval_size=4,
             save_every=2, progress=False, dataset=str(data), reward="exact",
             max_new_tokens=4)

  def rows(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
      return [{k: v for k, v in json.loads(line).items() if not k.endswith("_s")
               and k not in ("compiles", "peak_rss_mb", "compile_cache_hits")}
              for line in f]

  def stop_after_two(row):
    if row["step"] == 2:
      raise KeyboardInterrupt

  def stopped_then_resumed(out):
    with pytest.raises(KeyboardInterrupt):
      loop_run.run_training(RunConfig(out=out, **cfg), on_step=stop_after_two)
    monkeypatch.undo()
    return loop_run.run_training(RunConfig(out=out, resume=True, **cfg))

  whole, parts, old = (str(tmp_path / name) for name in ("whole", "parts", "old"))
  assert "steps 1-4 of 4" in loop_run.run_training(RunConfig(out=whole, **cfg))["warning"]
  assert "steps 1-4 of 4" in stopped_then_resumed(parts)["warning"]
  want, got = rows(whole), rows(parts)
  assert [r["step"] for r in got] == [0, 1, 2, 3, 4]
  assert [r.get("no_learning_signal_steps") for r in want] == [None] * 4 + [4.0]
  assert got == want
  monkeypatch.setattr(loop_run, "Checkpointer", lambda *a, stamp, **kw: Checkpointer(
      *a, stamp={k: v for k, v in stamp.items() if k != "signal_watch"}, **kw))
  assert "steps 3-4 of 4" in stopped_then_resumed(old)["warning"]
  assert [r.get("no_learning_signal_steps") for r in rows(old)] == [None] * 4 + [2.0]
