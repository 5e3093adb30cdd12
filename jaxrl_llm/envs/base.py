"""The environment protocol of multi-turn episodes, and the checks of what one returns.

An environment speaks chat messages (``{"role": ..., "content": ...}`` dicts):

* ``reset(seed) -> messages``: the opening messages (a system prompt, the task),
  deterministic in ``seed``;
* ``step(assistant_text) -> StepResult(messages, reward, done, info)``: the model's
  turn (its sampled tokens decoded once to text) in, the environment's reply turn(s)
  out (a tool result, game feedback, a follow-up question), a reward for the turn, and
  whether the episode is over.

An episode's reward is the sum of its turn rewards,

.. math::
  R = \\sum_{k=1}^{K} r_k ,

over the K turns the model took (an episode cut by ``max_turns`` or by its length
budget keeps the rewards of the turns it took). An environment that scores only the
end returns 0 until its last turn; one that rewards progress returns increments
(:class:`~jaxrl_llm.envs.builtin.CodeTestEnv` returns the change of its pass rate, so
the sum is the last pass rate wherever the episode stops).

The environment never sees token ids and never renders its messages: the rollout
(:func:`jaxrl_llm.rollout.multiturn.run_episodes`) renders them once through the
model's chat template and appends the ids to the episode's token sequence, whose
sampled ids are never decoded and re-encoded for training ("token in, token out").

What an environment returns is checked (:func:`check_messages`, :func:`check_step`):
a wrong type raises ``ValueError`` naming the environment and the field.

Examples:
  >>> class Echo:
  ...   name = "echo"
  ...   def reset(self, seed):
  ...     return [{"role": "user", "content": f"say {seed}"}]
  ...   def step(self, text):
  ...     return StepResult([], reward=float(text == "7"), done=True)
  >>> env = Echo()
  >>> isinstance(env, Env), check_messages(env.reset(7), env="echo", field="reset()")
  (True, [{'role': 'user', 'content': 'say 7'}])
  >>> check_step(env.step("7"), env="echo").reward
  1.0
  >>> check_step(StepResult([{"role": "user", "content": 3}]), env="echo")
  Traceback (most recent call last):
  ...
  ValueError: environment 'echo' returned step().messages[0]['content'] of type int; it
  must be a str.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from jaxrl_llm._validate import check_int

Message = dict[str, Any]
"""One chat message: ``{"role": str, "content": str, ...}`` (a tool turn may carry
``"name"``, as the chat templates read it)."""


@dataclasses.dataclass(frozen=True)
class StepResult:
  """What :meth:`Env.step` returns.

  Attributes:
    messages: the environment's reply turn(s), in order (``role`` ``"user"`` for
      feedback, ``"tool"`` for a tool's result). Empty is allowed (an episode that
      ends, or an environment that lets the model speak again).
    reward: the reward of the model's turn (a finite real number).
    done: whether the episode is over (its reply is then not rendered: no model turn
      follows it).
    info: anything else (logged, never trained on).
  """

  messages: Sequence[Message] = ()
  reward: float = 0.0
  done: bool = False
  info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@runtime_checkable
class Env(Protocol):
  """A multi-turn environment over chat messages (the module docstring).

  ``name`` (optional; the class name otherwise) names it in error messages. ``tools``
  (optional): the :class:`~jaxrl_llm.envs.tools.Tool` s the prompt offers the model,
  rendered through the chat template's ``tools=`` argument.
  """

  def reset(self, seed: int) -> list[Message]:
    """The opening messages of the episode of ``seed`` (deterministic in it)."""
    ...

  def step(self, assistant_text: str) -> StepResult:
    """The environment's answer to the model's turn ``assistant_text``."""
    ...


def env_name(env: Any) -> str:
  """The name an environment goes by in messages: its ``name`` attribute, else its
  class's name.

  >>> env_name(object())
  'object'
  """
  name = getattr(env, "name", None)
  return name if isinstance(name, str) and name else type(env).__name__


def check_messages(messages: Any, *, env: str, field: str) -> list[Message]:
  """``messages`` as a list of dicts, each with a string ``role`` and ``content``.

  Args:
    messages: what the environment returned.
    env: the environment's name (for the message).
    field: where it came from (``"reset()"``, ``"step().messages"``).

  Raises:
    ValueError: naming ``env`` and the field, for anything but a sequence of mappings
      whose ``role`` is a non-empty str and whose ``content`` is a str.

  Examples:
    >>> check_messages({"role": "user"}, env="e", field="reset()")
    Traceback (most recent call last):
    ...
    ValueError: environment 'e' returned reset() of type dict; it must be a list of message dicts.
  """
  if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
    raise ValueError(f"environment {env!r} returned {field} of type "
                     f"{type(messages).__name__}; it must be a list of message dicts.")
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, Mapping):
      raise ValueError(f"environment {env!r} returned {field}[{i}] of type "
                       f"{type(m).__name__}; it must be a dict with 'role' and 'content'.")
    for key in ("role", "content"):
      if key not in m:
        raise ValueError(f"environment {env!r} returned {field}[{i}] without {key!r}.")
      if not isinstance(m[key], str):
        raise ValueError(f"environment {env!r} returned {field}[{i}][{key!r}] of type "
                         f"{type(m[key]).__name__}; it must be a str.")
    if not m["role"]:
      raise ValueError(f"environment {env!r} returned {field}[{i}] with an empty 'role'.")
    out.append(dict(m))
  return out


def check_step(result: Any, *, env: str) -> StepResult:
  """``result`` (a :class:`StepResult`) with its fields checked and normalised
  (``reward`` a float, ``done`` a bool, ``messages`` a list of dicts).

  Raises:
    ValueError: naming ``env`` and the field: not a :class:`StepResult`, messages as in
      :func:`check_messages`, a reward that is not a finite real number (a bool is
      not one), ``done`` not a bool, ``info`` not a mapping.

  Examples:
    >>> check_step(StepResult([], reward=float("nan")), env="e")
    Traceback (most recent call last):
    ...
    ValueError: environment 'e' returned step().reward = nan; it must be a finite real number.
  """
  if not isinstance(result, StepResult):
    raise ValueError(f"environment {env!r} returned step() of type "
                     f"{type(result).__name__}; it must be a StepResult.")
  messages = check_messages(result.messages, env=env, field="step().messages")
  reward = result.reward
  if (isinstance(reward, (bool, np.bool_)) or not isinstance(reward, (int, float, np.number))
      or not math.isfinite(float(reward))):
    raise ValueError(f"environment {env!r} returned step().reward = {reward!r}; it must "
                     "be a finite real number.")
  if not isinstance(result.done, (bool, np.bool_)):
    raise ValueError(f"environment {env!r} returned step().done of type "
                     f"{type(result.done).__name__}; it must be a bool.")
  if not isinstance(result.info, Mapping):
    raise ValueError(f"environment {env!r} returned step().info of type "
                     f"{type(result.info).__name__}; it must be a dict.")
  return StepResult(messages, float(reward), bool(result.done), dict(result.info))


def check_max_turns(max_turns: Any) -> int:
  """``max_turns`` as an int >= 1 (the most model turns of an episode).

  >>> check_max_turns(0)
  Traceback (most recent call last):
  ...
  ValueError: `max_turns` must be an int >= 1, got 0.
  """
  return check_int("max_turns", max_turns)


def episode_reward(turn_rewards: Sequence[float]) -> float:
  """An episode's reward: the sum of its turn rewards (0 for no turn).

  >>> episode_reward([0.0, 0.25, 0.5])
  0.75
  """
  return float(sum(turn_rewards))


__all__ = ["Env", "Message", "StepResult", "check_max_turns", "check_messages",
           "check_step", "env_name", "episode_reward"]
