"""Environments and tools for multi-turn episodes.

* :mod:`~jaxrl_llm.envs.base`: the :class:`Env` protocol (``reset(seed) -> messages``,
  ``step(text) -> StepResult``) and the checks of what an environment returns.
* :mod:`~jaxrl_llm.envs.chat`: chat formats, the opening and each environment turn
  rendered once to token ids (:class:`TemplateChat`, :class:`PlainChat`).
* :mod:`~jaxrl_llm.envs.tools`: :class:`Tool` (a function with its JSON schema), the
  tool-call parsers (:data:`TOOL_PARSERS`) and the tool turns of their results.
* :mod:`~jaxrl_llm.envs.sandbox`: :func:`run_python`, model-written code in a limited
  subprocess.
* :mod:`~jaxrl_llm.envs.builtin`: the calculator, number-guessing and code-test
  environments.
* :mod:`~jaxrl_llm.envs.adapters`: gymnasium text environments and textarena games.

The episodes themselves (token sequences, loss masks, behaviour log-probs) are built
by :func:`jaxrl_llm.rollout.multiturn.run_episodes`.

An environment is named ``NAME`` (:data:`ENVS`), ``PREFIX:ID`` (:data:`ENV_SOURCES`:
``gym:ID``, ``textarena:ID``) or ``module:factory`` (the user's own; ``factory(**kwargs)``
returns the environment), and made by :func:`make_env`.

Examples:
  >>> env = make_env("guess_number", high=10)
  >>> env.reset(0)[0]["content"][:31]
  'Guess my number between 1 and 1'
  >>> make_env("nope")
  Traceback (most recent call last):
  ...
  ValueError: unknown environment 'nope': one of ['calculator', 'code_tests',
  'guess_number'], gym:ID, textarena:ID or module:factory.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from jaxrl_llm.envs.adapters import GymTextEnv, TextArenaEnv
from jaxrl_llm.envs.base import (
    Env,
    Message,
    StepResult,
    check_max_turns,
    check_messages,
    check_step,
    env_name,
    episode_reward,
)
from jaxrl_llm.envs.builtin import (
    CALCULATOR,
    CODE_PROBLEMS,
    CalculatorEnv,
    CodeProblem,
    CodeTestEnv,
    GuessNumberEnv,
    calculator,
    extract_code,
)
from jaxrl_llm.envs.chat import (
    CHAT_CHARS,
    ChatFormat,
    PlainChat,
    TemplateChat,
    chat_format,
)
from jaxrl_llm.envs.sandbox import SandboxResult, python_tool, run_python
from jaxrl_llm.envs.tools import (
    TOOL_PARSERS,
    ParsedTurn,
    Tool,
    ToolCall,
    get_tool_parser,
    parse_hermes,
    parse_llama3_json,
    tool_messages,
)

ENVS: dict[str, Callable[..., Env]] = {
    "calculator": CalculatorEnv,
    "guess_number": GuessNumberEnv,
    "code_tests": CodeTestEnv,
}
"""Built-in environments by name; register one with ``ENVS[name] = factory``."""

ENV_SOURCES: dict[str, Callable[..., Env]] = {
    "gym": GymTextEnv,
    "textarena": TextArenaEnv,
}
"""Families of environments named ``PREFIX:ID``: ``factory(ID, **kwargs)``. A prefix
here wins over a module of that name in ``module:factory``."""


def _one_line(e: BaseException) -> str:
  text = " ".join(str(e).split())
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


def make_env(name: str, **kwargs: Any) -> Env:
  """The environment ``name`` built with ``kwargs``: a name of :data:`ENVS`,
  ``PREFIX:ID`` of :data:`ENV_SOURCES`, or ``module:factory`` (``module`` imported,
  ``factory(**kwargs)`` called).

  Raises:
    ValueError: one line naming ``name``: an unknown name, a module that does not
      import, a missing factory, a factory that raises (its exception's type and
      message), or a result without ``reset`` / ``step``.

  Examples:
    >>> make_env("jaxrl_llm.envs.builtin:GuessNumberEnv", low=5, high=3)
    Traceback (most recent call last):
    ...
    ValueError: environment 'jaxrl_llm.envs.builtin:GuessNumberEnv': its factory raised
    ValueError: `low` must be < `high`, got 5 and 3.
  """
  if not isinstance(name, str) or not name.strip():
    raise ValueError(f"`name` must be a non-empty str, got {name!r}.")
  if ":" not in name:
    if name not in ENVS:
      raise ValueError(f"unknown environment {name!r}: one of {sorted(ENVS)}, "
                       f"{', '.join(p + ':ID' for p in ENV_SOURCES)} or module:factory.")
    factory: Callable[..., Any] = ENVS[name]
    args: tuple = ()
  else:
    prefix, rest = name.split(":", 1)
    if prefix in ENV_SOURCES:
      factory, args = ENV_SOURCES[prefix], (rest,)
    else:
      try:
        module = importlib.import_module(prefix)
      except Exception as e:   # noqa: BLE001 - any import failure is one line
        raise ValueError(f"environment {name!r}: cannot import module {prefix!r} "
                         f"({_one_line(e)}).") from None
      found = getattr(module, rest, None)
      if not callable(found):
        raise ValueError(f"environment {name!r}: module {prefix!r} has no callable "
                         f"{rest!r}.")
      factory, args = found, ()
  try:
    env = factory(*args, **kwargs)
  except Exception as e:   # noqa: BLE001 - the user's factory: any failure is one line
    raise ValueError(f"environment {name!r}: its factory raised {_one_line(e)}") from None
  if not isinstance(env, Env):
    raise ValueError(f"environment {name!r}: the factory returned a {type(env).__name__}, "
                     "which has no reset(seed) and step(text).")
  return env


__all__ = [
    "Env", "Message", "StepResult", "check_max_turns", "check_messages", "check_step",
    "env_name", "episode_reward",
    "ENVS", "ENV_SOURCES", "make_env",
    "CHAT_CHARS", "ChatFormat", "PlainChat", "TemplateChat", "chat_format",
    "TOOL_PARSERS", "ParsedTurn", "Tool", "ToolCall", "get_tool_parser", "parse_hermes",
    "parse_llama3_json", "tool_messages",
    "SandboxResult", "python_tool", "run_python",
    "CALCULATOR", "CODE_PROBLEMS", "CalculatorEnv", "CodeProblem", "CodeTestEnv",
    "GuessNumberEnv", "calculator", "extract_code",
    "GymTextEnv", "TextArenaEnv",
]
