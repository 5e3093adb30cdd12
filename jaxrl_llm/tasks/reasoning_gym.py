"""reasoning-gym's procedural generators as a `Task` (``--task rg:NAME[,NAME...]``).

`reasoning-gym <https://github.com/open-thought/reasoning-gym>`_ (``pip install
'jaxrl_llm[rg]'``) generates verifiable problems procedurally: each entry of
``reasoning_gym.create_dataset(name, size=..., seed=..., **config)`` has a ``question``,
an ``answer`` and ``metadata``, and the dataset's own ``score_answer(answer, entry)``
scores an answer in [0, 1]. :class:`ReasoningGymTask` runs one or several generators:

* **prompt**: the entry's question, a blank line and :data:`ANSWER_INSTRUCTION` (answer
  inside ``<answer>...</answer>``); with ``chat`` (a model tokenizer with a chat
  template) it is one user message rendered with the template and a generation prompt,
  else the text itself (after the tokenizer's ``raw_text_prefix``, the bos a base
  model's tokenizer puts first).
* **answer**: :func:`extract_answer`, the text of the last ``<answer>...</answer>`` of
  the completion; without one, the completion's last number when the entry's answer
  is a number (a small instruct model answers "The answer is 17." whatever it is
  told), else the whole completion (stripped).
* **reward**: reasoning-gym's ``score_answer`` of that answer (clipped to [0, 1]; a
  scorer that raises scores 0); **exact**: reward 1.
* **splits**: the training pool is entries ``0..size-1`` of each generator at ``seed``
  (the ``size`` and ``seed`` settings; reasoning-gym's ``size`` default, 500, and seed
  0); the evaluation set is the first ``ceil(eval_size / k)`` entries of each of the
  ``k`` generators at ``eval_seed`` (``2**31``, far from every training seed: most
  generators seed entry ``i`` with ``seed + i``, so nearby seeds share entries),
  interleaved. Every training entry whose question is also an evaluation question is
  dropped from the pool, so the two splits never share a question, whatever the
  sizes and seeds. Training draws the pool uniformly with replacement.
* **settings** (``config``, ``--task-config KEY=VALUE``): the fields of the
  generator's config class (``min_terms``, ``max_digits``, ...), given to every named
  generator (each must have the field), or ``NAME.KEY=VALUE`` for one of them.

Which generators run. Version 0.1.25 ships its data files (word lists, ARC tasks) in
the wheel and opens no network connection: every generator but ``composite`` builds
an entry offline (checked with sockets blocked). ``composite`` is refused (it takes
dataset specs, not flat settings: name the generators, ``rg:a,b``), and so is any
generator that cannot build its first entry here (a missing data file or module, a
network access in a later version, a setting it rejects): :func:`check_spec` builds
it, before JAX is imported, and says why in one line.

Examples:
  >>> task = ReasoningGymTask(datasets=("chain_sum",), eval_size=2, max_new_tokens=16,
  ...                         config={"size": 4, "max_terms": 2, "max_digits": 1})
  >>> p = task.eval_problems(1)[0]
  >>> print(p.prompt)
  State the final answer to the following arithmetic problem: 8 + 2 =
  <BLANKLINE>
  Give your final answer inside <answer></answer> tags.
  >>> p.answer
  '10'
  >>> task.score([p] * 3, ["so <answer>10</answer>", "<answer>11</answer>", "10"]).tolist()
  [1.0, 0.0, 1.0]
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from jaxrl_llm._names import DEFAULT_MAX_NEW_TOKENS
from jaxrl_llm.tasks.base import PoolTask, Problem
from jaxrl_llm.tasks.sources import TaskSource
from jaxrl_llm.tasks.tokenizer import CharTokenizer
from jaxrl_llm.tasks.verifiers import extract_last_number, parse_number

#: What follows each question (after a blank line).
ANSWER_INSTRUCTION = "Give your final answer inside <answer></answer> tags."
#: The reasoning-gym seed of the evaluation entries (training uses the ``seed`` setting).
EVAL_SEED = 1 << 31
#: Generators refused by name, with the reason.
REFUSED = {"composite": "it mixes generators from dataset specs; name the generators "
                        "instead (rg:NAME,NAME)"}
# The training pool's seed when the settings give none (reasoning-gym's is random).
_DEFAULT_POOL_SEED = 0

# The examples of this module generate problems (conftest.py skips them without it).
__doctest_requires__ = ("reasoning_gym",)

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(completion: str, numeric: bool = False) -> str:
  """The answer in a completion: the text inside its last ``<answer>...</answer>``,
  stripped; without such a tag, for a ``numeric`` answer the last number of the
  completion (:func:`~jaxrl_llm.tasks.verifiers.extract_last_number`, thousands
  commas removed: an instruct model's "The answer is 1,021." gives ``1021``), else
  the whole completion, stripped.

  Examples:
    >>> extract_answer("think... <answer>3</answer> no, <answer> 4 </answer>")
    '4'
    >>> extract_answer(" 42 ")
    '42'
    >>> extract_answer("8 + 2 = 10, so the answer is 1,021.", numeric=True)
    '1021'
    >>> extract_answer("The answer is -3.", numeric=False)
    'The answer is -3.'
  """
  found = _ANSWER_TAG.findall(completion)
  if found:
    return found[-1].strip()
  number = extract_last_number(completion) if numeric else None
  if number is not None:
    return number.replace(",", "")
  return completion.strip()


def _require_rg():
  try:
    import reasoning_gym
  except ImportError:
    raise ValueError("`task` rg:... needs reasoning-gym, which is not installed: pip "
                     "install 'jaxrl_llm[rg]'") from None
  return reasoning_gym


def _names(spec: str) -> tuple[str, ...]:
  """The generator names of a spec ``NAME[,NAME...]`` (checked)."""
  from reasoning_gym.factory import DATASETS
  names = tuple(n.strip() for n in spec.split(","))
  if not spec.strip() or not all(names):
    raise ValueError(f"`task` rg:{spec} must name reasoning-gym generators: "
                     "rg:NAME[,NAME...]")
  if len(set(names)) != len(names):
    raise ValueError(f"`task` rg:{spec} names a generator twice")
  for n in names:
    if n in REFUSED:
      raise ValueError(f"`task` rg:{n} is not supported: {REFUSED[n]}")
    if n not in DATASETS:
      import difflib
      close = difflib.get_close_matches(n, sorted(DATASETS), n=3)
      hint = f" (did you mean {', '.join(close)}?)" if close else ""
      valid = sorted(set(DATASETS) - set(REFUSED))
      raise ValueError(f"`task` rg:{n}: reasoning-gym has no generator {n!r}{hint}; "
                       f"its {len(valid)} generators: {', '.join(valid)}")
  return names


def generator_settings(names: Sequence[str], config: Mapping[str, Any]
                       ) -> dict[str, dict[str, Any]]:
  """``{name: settings}``: ``config`` split over the generators ``names`` (a plain
  key goes to every one, ``NAME.KEY`` to one), each key checked against the
  generator's config class.

  Raises:
    ValueError: one line naming ``task_config`` for a key a generator lacks.

  Examples:
    >>> generator_settings(["chain_sum", "leg_counting"],
    ...                    {"size": 8, "chain_sum.max_terms": 3})
    {'chain_sum': {'size': 8, 'max_terms': 3}, 'leg_counting': {'size': 8}}
  """
  from reasoning_gym.factory import DATASETS
  out: dict[str, dict[str, Any]] = {n: {} for n in names}
  for key, value in config.items():
    target, dot, field = key.rpartition(".")
    if dot and target not in out:
      raise ValueError(f"`task_config` {key}={value}: {target!r} is not one of the "
                       f"task's generators ({', '.join(names)})")
    for n in ([target] if dot else list(names)):
      fields = [f.name for f in dataclasses.fields(DATASETS[n][1])]
      if field not in fields:
        raise ValueError(f"`task_config` {key}={value}: reasoning-gym's {n} has no "
                         f"setting {field!r}; its settings: {', '.join(fields)}")
      out[n][field] = value
  return out


def _create(name: str, settings: Mapping[str, Any], *, size: int | None = None,
            seed: int | None = None):
  """``reasoning_gym.create_dataset(name, **settings)``, with ``size`` and ``seed`` when
  given (else the settings' own, and seed 0: reasoning-gym's default seed is random);
  a one-line error if reasoning-gym rejects the settings."""
  rg = _require_rg()
  config = dict(settings)
  if size is not None:
    config["size"] = size
  config["seed"] = seed if seed is not None else config.get("seed", _DEFAULT_POOL_SEED)
  try:
    return rg.create_dataset(name, **config)
  except Exception as e:  # noqa: BLE001 - reasoning-gym's checks raise many kinds
    shown = " ".join(f"{k}={v}" for k, v in settings.items()) or "its defaults"
    raise ValueError(f"`task_config` for rg:{name} ({shown}): reasoning-gym rejects it: "
                     f"{type(e).__name__}: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
  return " ".join(str(e).split())[:200] or "(no message)"


def check_spec(spec: str, config: Mapping[str, Any]) -> None:
  """Raises a one-line ``ValueError`` unless ``rg:spec`` with ``config`` builds: the
  generators exist (and are not refused), every setting is a field of their config,
  reasoning-gym accepts the values, and each generates its first entry here.

  Examples:
    >>> check_spec("chain_sum", {"max_terms": 3})
    >>> try:
    ...   check_spec("chain_sum", {"max_terms": 3, "nope": 1})
    ... except ValueError as e:
    ...   print(str(e)[:60])
    `task_config` nope=1: reasoning-gym's chain_sum has no setti
  """
  _require_rg()
  names = _names(spec)
  for name, settings in generator_settings(names, config).items():
    dataset = _create(name, settings, size=1)
    try:
      dataset[0]
    except Exception as e:  # noqa: BLE001 - a generator's failure, whatever it is
      raise ValueError(f"`task` rg:{name}: reasoning-gym cannot generate it here "
                       f"({type(e).__name__}: {_one_line(e)})") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReasoningGymTask(PoolTask):
  """One or several reasoning-gym generators as a :class:`~jaxrl_llm.tasks.base.Task`
  (the module docstring has the prompt, answer, reward and split rules).

  Attributes:
    datasets: reasoning-gym generator names (``reasoning_gym.factory.DATASETS``).
    config: settings of the generators (see :func:`generator_settings`); ``size`` and
      ``seed`` set the training pool (per generator).
    tokenizer: a model's tokenizer; default: a ``CharTokenizer`` over the characters
      of the task's prompts and answers (for models trained from scratch).
    chat: render prompts as one user message with the tokenizer's chat template.
    max_new_tokens: tokens sampled per completion.
    eval_size: evaluation entries in all (split evenly over the generators).
    eval_seed: the reasoning-gym seed of the evaluation entries.
    instruction: the text after each question.
  """

  name: ClassVar[str] = "rg"
  datasets: tuple[str, ...]
  config: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)
  tokenizer: Any = None
  chat: bool = False
  max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
  eval_size: int = 256
  eval_seed: int = EVAL_SEED
  holdout: float = 0.0
  instruction: str = ANSWER_INSTRUCTION
  _train: tuple[Problem, ...] = dataclasses.field(init=False, repr=False, compare=False)
  _eval: tuple[Problem, ...] = dataclasses.field(init=False, repr=False, compare=False)
  _scorers: Mapping[str, Any] = dataclasses.field(init=False, repr=False, compare=False)
  _max_prompt_len: int = dataclasses.field(init=False, repr=False, compare=False)

  def __post_init__(self) -> None:
    super().__post_init__()
    for field, value in (("max_new_tokens", self.max_new_tokens),
                         ("eval_size", self.eval_size)):
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"`{field}` must be a positive int, got {value!r}.")
    _require_rg()
    names = _names(",".join(self.datasets))
    settings = generator_settings(names, self.config)
    per_eval = math.ceil(self.eval_size / len(names))
    scorers, evals, entries = {}, [], []
    for name in names:
      train_ds = _create(name, settings[name])
      eval_ds = _create(name, settings[name], size=per_eval, seed=self.eval_seed)
      scorers[name] = train_ds.score_answer
      evals.append([(name, e) for e in eval_ds])
      entries += [(name, e) for e in train_ds]
    # Round-robin over the generators, so the first n cover each of them.
    eval_entries = [pair for group in zip(*evals) for pair in group][:self.eval_size]
    held = {e["question"] for _, e in eval_entries}
    train_entries = [(n, e) for n, e in entries if e["question"] not in held]
    if not train_entries:
      raise ValueError(f"every training question of rg:{','.join(names)} is also an "
                       "evaluation question; raise the `task_config` size")
    tokenizer = self.tokenizer
    if tokenizer is None:
      chars = {c for _, e in train_entries + eval_entries
               for c in self._text(e["question"]) + str(e["answer"])}
      tokenizer = CharTokenizer("".join(sorted(chars)))
    train = [self._problem(n, e, tokenizer) for n, e in train_entries]
    evals_p = [self._problem(n, e, tokenizer) for n, e in eval_entries]
    object.__setattr__(self, "tokenizer", tokenizer)
    object.__setattr__(self, "_scorers", scorers)
    object.__setattr__(self, "_train", tuple(train))
    object.__setattr__(self, "_eval", tuple(evals_p))
    object.__setattr__(self, "_max_prompt_len",
                       max(len(tokenizer.encode(p.prompt)) for p in train + evals_p))

  # ---- rendering ---------------------------------------------------------------

  def _text(self, question: str) -> str:
    return f"{question}\n\n{self.instruction}"

  def _problem(self, name: str, entry: Mapping[str, Any], tokenizer: Any) -> Problem:
    text = self._text(entry["question"])
    if self.chat:
      template = getattr(tokenizer, "apply_chat_template", None)
      if template is None:
        raise ValueError(f"`chat` needs a tokenizer with a chat template (e.g. "
                         f"HFTokenizer), got {type(tokenizer).__name__}.")
      prompt = template([{"role": "user", "content": text}], add_generation_prompt=True)
    else:
      prompt = getattr(tokenizer, "raw_text_prefix", "") + text
    answer = str(entry["answer"])
    return Problem(prompt=prompt, answer=answer,
                   info={"dataset": name, "question": entry["question"], "entry": entry,
                         "numeric": parse_number(answer) is not None})

  # ---- the Task interface ------------------------------------------------------

  @property
  def max_prompt_len(self) -> int:
    """The longest prompt (training and evaluation), in tokens."""
    return self._max_prompt_len


  @property
  def eval_on_train_rows(self) -> bool:
    """False: the evaluation questions are never training questions."""
    return False




  def reward(self, problem: Problem, completion: str) -> float:
    """reasoning-gym's ``score_answer`` of :func:`extract_answer` (clipped to [0, 1];
    0 when the scorer raises)."""
    score = self._scorers[problem.info["dataset"]]
    try:
      value = float(score(extract_answer(completion, problem.info["numeric"]),
                          problem.info["entry"]))
    except Exception:  # noqa: BLE001 - a model's text must not end the run
      return 0.0
    return min(max(value, 0.0), 1.0) if math.isfinite(value) else 0.0

  def parsed(self, problems: Sequence[Problem], completions: Sequence[str]
             ) -> np.ndarray:
    """An ``<answer>`` tag, else a number where the answer is one, else any text.

    Examples:
      >>> task = ReasoningGymTask(datasets=("chain_sum",), eval_size=1,
      ...                         config={"size": 2, "max_terms": 2, "max_digits": 1})
      >>> p = task.eval_problems(1)[0]
      >>> task.parsed([p] * 3, ["<answer>x</answer>", "it is 7", "no idea"]).tolist()
      [True, True, False]
    """
    self._check_pairs(problems, completions)
    return np.asarray([bool(_ANSWER_TAG.search(c)) or (
        extract_last_number(c) is not None if p.info["numeric"] else bool(c.strip()))
        for p, c in zip(problems, completions)], bool)

  def is_correct(self, problem: Problem, completion: str) -> bool:
    """Reward 1."""
    return self.reward(problem, completion) >= 1.0

  def exact(self, problems: Sequence[Problem], completions: Sequence[str]) -> np.ndarray:
    """Reward 1, bool ``[n]`` (each completion scored once)."""
    return self.score(problems, completions) >= 1.0

  @property
  def answer_chars(self) -> str:
    return "".join(sorted({c for p in self._eval for c in p.answer})) or "0"


def build(spec: str, config: Mapping[str, Any] | None = None, **options: Any
          ) -> ReasoningGymTask:
  """The task ``rg:spec`` (``options``: :class:`ReasoningGymTask` fields)."""
  return ReasoningGymTask(datasets=tuple(s.strip() for s in spec.split(",")),
                          config=dict(config or {}), **options)


REASONING_GYM = TaskSource(
    prefix="rg", check=check_spec, build=build,
    doc="rg:NAME[,NAME...]: reasoning-gym generators (pip install 'jaxrl_llm[rg]'), "
        "settings by --task-config KEY=VALUE")

__all__ = ["ANSWER_INSTRUCTION", "EVAL_SEED", "REASONING_GYM", "REFUSED",
           "ReasoningGymTask", "build", "check_spec", "extract_answer",
           "generator_settings"]
