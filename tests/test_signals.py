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
