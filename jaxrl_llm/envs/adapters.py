"""Adapters: environments of other libraries as an :class:`~jaxrl_llm.envs.base.Env`.

* :class:`GymTextEnv`: a `gymnasium <https://gymnasium.farama.org>`_ environment whose
  observations and actions are strings (``spaces.Text``): ``reset(seed=)`` gives the
  first user message, ``step(text)`` the next one, its reward, and ``done`` =
  ``terminated or truncated`` (``info["truncated"]`` tells which). A non-string
  observation raises ``ValueError`` naming the environment. ``make_env("gym:ID")``.
* :class:`TextArenaEnv`: a single-player `textarena <https://github.com/LeonGuertler/
  TextArena>`_ game: its observations since the last turn, joined, are the user
  message; the game's reward (``close()``) is the last turn's. ``make_env
  ("textarena:ID")``; an id without a suffix is made in its ``-raw`` version (no
  observation wrapper: each turn's message holds the new observations only, not the
  whole history again). textarena seeds Python's global ``random`` in ``reset``.

Both packages are optional (``pip install 'jaxrl_llm[envs]'``), imported when an
adapter is built.

`verifiers <https://github.com/PrimeIntellect-ai/verifiers>`_ environments (0.4) are
agents that call the model through an OpenAI-compatible client; they need the
recording endpoint (the ``serve`` part of the agents work), not a step adapter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxrl_llm.envs.base import Message, StepResult


def _require(module: str, extra: str = "envs") -> Any:
  try:
    return __import__(module)
  except ImportError as e:
    raise ImportError(f"{module!r} is needed for this environment: pip install "
                      f"'jaxrl_llm[{extra}]' (or pip install {module}).") from e


class GymTextEnv:
  """A gymnasium environment with string observations and actions (the module
  docstring).

  Args:
    env: a ``gymnasium.Env``, or a registered id for ``gymnasium.make`` (with
      ``kwargs``).
    system_prompt: an opening system message ("" or None: none).
    name: the name in error messages (default: the gymnasium id or class).
  """

  def __init__(self, env: Any, *, system_prompt: str | None = None,
               name: str | None = None, **kwargs: Any) -> None:
    if isinstance(env, str):
      gym = _require("gymnasium")
      env_id = env
      env = gym.make(env_id, **kwargs)
    spec = getattr(env, "spec", None)
    self.env = env
    self.name = name or getattr(spec, "id", None) or type(env).__name__
    self.system_prompt = system_prompt

  def _observation(self, obs: Any, where: str) -> str:
    if not isinstance(obs, str):
      raise ValueError(f"environment {self.name!r} returned a {where} observation of type "
                       f"{type(obs).__name__}; a text environment's must be a str.")
    return obs

  def reset(self, seed: int) -> list[Message]:
    obs, _ = self.env.reset(seed=int(seed))
    opening = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
    return opening + [{"role": "user", "content": self._observation(obs, "reset()")}]

  def step(self, assistant_text: str) -> StepResult:
    obs, reward, terminated, truncated, info = self.env.step(assistant_text)
    text = self._observation(obs, "step()")
    done = bool(terminated) or bool(truncated)
    messages = [{"role": "user", "content": text}] if text else []
    return StepResult(messages, float(reward), done,
                      {**dict(info or {}), "truncated": bool(truncated) and not terminated})


def _observation_text(obs: Any) -> str:
  """textarena's observation as text: a string as is, a list of ``(from_id, message,
  type)`` tuples as their messages joined by newlines."""
  if isinstance(obs, str):
    return obs
  if isinstance(obs, Sequence):
    return "\n".join(str(m[1]) if isinstance(m, Sequence) and len(m) > 1 else str(m)
                     for m in obs)
  return str(obs)


class TextArenaEnv:
  """A single-player textarena game (the module docstring).

  Args:
    env: a textarena env, or its registry id (made with ``textarena.make``; ``kwargs``
      go there). An id with no ``-raw`` / ``-train`` suffix gets ``-raw``.
    name: the name in error messages (default: the id).
  """

  def __init__(self, env: Any, *, name: str | None = None, **kwargs: Any) -> None:
    if isinstance(env, str):
      ta = _require("textarena")
      env_id = env if env.endswith(("-raw", "-train")) else env + "-raw"
      env = ta.make(env_id=env_id, **kwargs)
    self.env = env
    self.name = name or getattr(env, "env_id", None) or type(env).__name__

  def _user(self) -> list[Message]:
    _, obs = self.env.get_observation()
    text = _observation_text(obs)
    return [{"role": "user", "content": text}] if text else []

  def reset(self, seed: int) -> list[Message]:
    self.env.reset(num_players=1, seed=int(seed))
    return self._user()

  def step(self, assistant_text: str) -> StepResult:
    done, info = self.env.step(assistant_text)
    if not done:
      return StepResult(self._user(), 0.0, False, dict(info or {}))
    rewards, game_info = self.env.close()
    reward = float((rewards or {}).get(0, 0.0))
    return StepResult([], reward, True, {**dict(info or {}), "game": game_info})


__all__ = ["GymTextEnv", "TextArenaEnv"]
