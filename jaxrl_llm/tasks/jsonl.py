"""JSONL datasets of prompts and reference answers, as a `Task` the trainer can run.

One JSON object per line (blank lines are skipped)::

  {"prompt": "What is 3 + 4? Put the answer in \\\\boxed{}.", "answer": "7"}
  {"prompt": [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "3 + 4?"}], "answer": "7"}
  {"messages": [{"role": "user", "content": "3 + 4?"}], "answer": "#### 7"}

``prompt`` is a string (used verbatim) or a list of chat messages (``role`` and
``content`` strings, rendered with the tokenizer's chat template and a generation
prompt); ``messages`` is accepted for the latter. ``answer`` is a string or a number
(kept as its JSON text). Every other key goes to the record's ``info``. A malformed
line raises ``ValueError`` starting ``"<path>:<line>: "``.

:class:`JsonlTask` turns a file into a :class:`~jaxrl_llm.tasks.base.Task`: seeded
uniform sampling of training rows, a fixed evaluation split, and scoring with a
batched reward of :mod:`jaxrl_llm.tasks.verifiers` (``"math"`` by default).

Examples:
  >>> import json, os, tempfile
  >>> path = os.path.join(tempfile.mkdtemp(), "data.jsonl")
  >>> with open(path, "w") as f:
  ...   for a, b in [(1, 2), (3, 4), (5, 6)]:
  ...     _ = f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": a + b}) + "\\n")
  >>> [(r.prompt, r.answer, r.line) for r in load_jsonl(path)][:2]
  [('1+2=', '3', 1), ('3+4=', '7', 2)]
  >>> task = JsonlTask(path=path, max_new_tokens=4)
  >>> task.max_prompt_len, task.tokenizer.vocab_size
  (4, 12)
  >>> task.score(task.eval_problems(2), ["3", "8"]).tolist()
  [1.0, 0.0]
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from jaxrl_llm._names import DEFAULT_MAX_NEW_TOKENS
from jaxrl_llm.tasks import verifiers
from jaxrl_llm.tasks.base import PoolTask, Problem
from jaxrl_llm.tasks.tokenizer import CharTokenizer

Message = Mapping[str, str]


@dataclasses.dataclass(frozen=True)
class Record:
  """One line of a JSONL dataset.

  Attributes:
    prompt: a string, or a tuple of chat messages (dicts with ``role`` and ``content``).
    answer: the reference answer as a string.
    line: 1-based line number in the file.
    info: the line's other keys.
  """

  prompt: str | tuple[Message, ...]
  answer: str
  line: int
  info: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)


def _check_messages(messages, where: str) -> tuple[Message, ...]:
  if not isinstance(messages, list) or not messages:
    raise ValueError(f"{where}: chat messages must be a non-empty list, got "
                     f"{type(messages).__name__}.")
  out = []
  for i, m in enumerate(messages):
    if (not isinstance(m, dict) or not isinstance(m.get("role"), str)
        or not isinstance(m.get("content"), str)):
      raise ValueError(f"{where}: message {i} must be an object with string 'role' and "
                       f"'content', got {json.dumps(m)[:80]}.")
    out.append(dict(m))
  return tuple(out)


def parse_record(obj: Any, *, line: int = 0, where: str = "record",
                 prompt_key: str = "prompt", answer_key: str = "answer") -> Record:
  """A :class:`Record` from one decoded JSON value (see the module docstring).

  Raises:
    ValueError: naming ``where`` when ``obj`` is not an object, lacks the prompt or
      answer, or has a prompt/answer of the wrong type.
  """
  if not isinstance(obj, dict):
    raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}.")
  if prompt_key in obj:
    key = prompt_key
  elif "messages" in obj:
    key = "messages"
  else:
    raise ValueError(f"{where}: missing {prompt_key!r} (or 'messages'); keys are "
                     f"{sorted(obj)}.")
  prompt = obj[key]
  if isinstance(prompt, str):
    if not prompt:
      raise ValueError(f"{where}: {key!r} is an empty string.")
  else:
    prompt = _check_messages(prompt, f"{where}: {key!r}")
  if answer_key not in obj:
    raise ValueError(f"{where}: missing {answer_key!r}; keys are {sorted(obj)}.")
  answer = obj[answer_key]
  if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
    raise ValueError(f"{where}: {answer_key!r} must be a string or a number, got "
                     f"{type(answer).__name__}.")
  answer = answer if isinstance(answer, str) else json.dumps(answer)
  info = {k: val for k, val in obj.items() if k not in (key, answer_key)}
  return Record(prompt=prompt, answer=answer, line=line, info=info)


def load_jsonl(path: str | os.PathLike, *, prompt_key: str = "prompt",
               answer_key: str = "answer") -> list[Record]:
  """Reads a JSONL dataset (one object per line; blank lines skipped).

  Args:
    path: the file.
    prompt_key: the key of the prompt (``"messages"`` is accepted as a fallback).
    answer_key: the key of the reference answer.

  Returns:
    The records in file order.

  Raises:
    ValueError: ``"<path>:<line>: ..."`` for a line that is not UTF-8, invalid JSON or
      a malformed record, or if the file holds no record.
  """
  path = os.fspath(path)
  records = []
  with open(path, "rb") as f:
    for n, raw in enumerate(f, start=1):
      where = f"{path}:{n}"
      try:
        text = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at byte "
                         f"{e.start + 1} of the line); save the file as UTF-8.") from None
      if not text.strip():
        continue
      try:
        obj = json.loads(text)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno}).") from None
      records.append(parse_record(obj, line=n, where=where, prompt_key=prompt_key,
                                  answer_key=answer_key))
  if not records:
    raise ValueError(f"{path}: no records (the file is empty).")
  return records


def _split_bucket(text: str) -> float:
  return (zlib.crc32(text.encode("utf-8")) % 10_000) / 10_000


@dataclasses.dataclass(frozen=True, kw_only=True)
class JsonlTask(PoolTask):
  """A JSONL dataset as a :class:`~jaxrl_llm.tasks.base.Task`.

  Training problems are drawn uniformly with replacement from the training rows.
  Evaluation problems are the first ``n`` rows of the evaluation split in file order
  (no repeats, so ``eval_problems(n)`` may return fewer than ``n``): the rows of
  ``eval_path`` when given; else, with ``holdout > 0``, the rows whose prompt hashes
  into the held-out fraction (as in the base class); else, with ``holdout_rows > 0``,
  the rows of the prompts of lowest hash, at least ``holdout_rows`` rows; else all
  rows (train == eval: :attr:`eval_on_train_rows`). A held-out prompt is never a
  training prompt: rows that repeat a prompt stay together.

  Attributes:
    path: the JSONL training file.
    reward_fn: a name in :data:`~jaxrl_llm.tasks.verifiers.REWARDS` or a batched reward
      callable ``(prompts, completions, answers) -> float32 [n]``.
    tokenizer: a tokenizer (:class:`~jaxrl_llm.tasks.tokenizer.CharTokenizer`, or
      :class:`~jaxrl_llm.tasks.hf_tokenizer.HFTokenizer` for a pretrained model);
      default: a ``CharTokenizer`` over the characters of the file's prompts and
      answers (for models trained from scratch).
    max_new_tokens: tokens sampled per completion.
    chat: render string prompts as a single user message with the chat template
      (message-list prompts always use it).
    system_prompt: a system message put before string prompts when ``chat``.
    eval_path: an optional JSONL evaluation file.
    prompt_key, answer_key: the keys read from each line.
    holdout: fraction of rows held out for evaluation when there is no ``eval_path``
      (default 0: evaluate on the training rows).
    holdout_rows: the count of rows held out instead (exclusive with ``holdout``).

  Examples:
    >>> import json, os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "d.jsonl")
    >>> with open(path, "w") as f:
    ...   for a in range(10):
    ...     _ = f.write(json.dumps({"prompt": f"{a}+1=", "answer": a + 1}) + "\\n")
    >>> task = JsonlTask(path=path, holdout_rows=3)
    >>> [p.prompt for p in task.eval_problems()], len(task.problems)
    (['0+1=', '3+1=', '8+1='], 7)
    >>> task.eval_on_train_rows, JsonlTask(path=path).eval_on_train_rows
    (False, True)
  """

  name: ClassVar[str] = "jsonl"
  path: str
  reward_fn: Any = "math"
  tokenizer: Any = None
  max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
  chat: bool = False
  system_prompt: str | None = None
  eval_path: str | None = None
  prompt_key: str = "prompt"
  answer_key: str = "answer"
  holdout: float = 0.0
  holdout_rows: int = 0
  _train: tuple[Problem, ...] = dataclasses.field(init=False, repr=False, compare=False)
  _eval: tuple[Problem, ...] = dataclasses.field(init=False, repr=False, compare=False)
  _reward: Any = dataclasses.field(init=False, repr=False, compare=False)
  _max_prompt_len: int = dataclasses.field(init=False, repr=False, compare=False)

  def __post_init__(self) -> None:
    super().__post_init__()
    if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
      raise ValueError(f"`max_new_tokens` must be a positive int, got "
                       f"{self.max_new_tokens!r}.")
    if (not isinstance(self.holdout_rows, int) or isinstance(self.holdout_rows, bool)
        or self.holdout_rows < 0):
      raise ValueError(f"`holdout_rows` must be an int >= 0, got {self.holdout_rows!r}.")
    if self.holdout_rows and self.holdout:
      raise ValueError("`holdout` and `holdout_rows` are exclusive (a fraction or a "
                       "count of rows).")
    reward_fn = verifiers.get_reward(self.reward_fn)
    records = load_jsonl(self.path, prompt_key=self.prompt_key, answer_key=self.answer_key)
    eval_records = (None if self.eval_path is None else
                    load_jsonl(self.eval_path, prompt_key=self.prompt_key,
                               answer_key=self.answer_key))
    tokenizer = self.tokenizer
    if tokenizer is None:
      tokenizer = _char_tokenizer(records + (eval_records or []))
    train = [self._problem(r, self.path, tokenizer) for r in records]
    if eval_records is not None:
      assert self.eval_path is not None   # eval_records were read from it
      evals = [self._problem(r, self.eval_path, tokenizer) for r in eval_records]
    elif self.holdout > 0 or self.holdout_rows > 0:
      if self.holdout > 0:
        held = [_split_bucket(p.prompt) < self.holdout for p in train]
        setting = f"`holdout`={self.holdout}"
      else:
        held = _held_rows([p.prompt for p in train], self.holdout_rows)
        setting = f"`holdout_rows`={self.holdout_rows}"
      evals = [p for p, h in zip(train, held) if h]
      train = [p for p, h in zip(train, held) if not h]
      if not evals or not train:
        raise ValueError(
            f"{setting} puts {len(evals)} of the {len(held)} rows of "
            f"{self.path} in the eval split; pass `eval_path` or change it.")
    else:
      evals = train
    lengths = [len(self._encode(p, tokenizer)) for p in train + evals]
    object.__setattr__(self, "tokenizer", tokenizer)
    object.__setattr__(self, "_reward", reward_fn)
    object.__setattr__(self, "_train", tuple(train))
    object.__setattr__(self, "_eval", tuple(evals))
    object.__setattr__(self, "_max_prompt_len", max(lengths))

  # ---- rendering ---------------------------------------------------------------

  def _messages(self, record: Record) -> tuple[Message, ...] | None:
    if not isinstance(record.prompt, str):
      return record.prompt
    if not self.chat:
      return None
    system = () if self.system_prompt is None else (
        {"role": "system", "content": self.system_prompt},)
    return system + ({"role": "user", "content": record.prompt},)

  def _problem(self, record: Record, path: str, tokenizer) -> Problem:
    messages = self._messages(record)
    if messages is None:
      assert isinstance(record.prompt, str)
      # The bos a base model's own tokenizer puts first (transformers, vLLM).
      text = getattr(tokenizer, "raw_text_prefix", "") + record.prompt
    else:
      template = getattr(tokenizer, "apply_chat_template", None)
      if template is None:
        raise ValueError(
            f"{path}:{record.line}: a chat prompt needs a tokenizer with a chat template "
            f"(e.g. HFTokenizer), got {type(tokenizer).__name__}.")
      text = template(list(messages), add_generation_prompt=True)
    info = {**record.info, "line": record.line}
    if messages is not None:
      info["messages"] = messages
    return Problem(prompt=text, answer=record.answer, info=info)

  @staticmethod
  def _encode(problem: Problem, tokenizer) -> list[int]:
    try:
      return tokenizer.encode(problem.prompt)
    except ValueError as e:
      raise ValueError(f"line {problem.info['line']}: {e}") from None

  # ---- the Task interface ------------------------------------------------------

  @property
  def max_prompt_len(self) -> int:
    """The longest prompt of the dataset (train and eval), in tokens."""
    return self._max_prompt_len


  @property
  def eval_on_train_rows(self) -> bool:
    """Whether evaluation runs on the training rows (no ``eval_path``, no holdout)."""
    return self.eval_path is None and not self.holdout and not self.holdout_rows

  def parsed(self, problems: Sequence[Problem], completions: Sequence[str]
             ) -> np.ndarray | None:
    """Whether the reward found an answer in each completion, for the rewards that
    say (:data:`~jaxrl_llm.tasks.verifiers.COMPLETION_PARSERS`: ``math``, ``boxed``);
    else None."""
    self._check_pairs(problems, completions)
    found = (verifiers.COMPLETION_PARSERS.get(self.reward_fn)
             if isinstance(self.reward_fn, str) else None)
    return None if found is None else np.asarray([found(c) for c in completions], bool)

  def score(self, problems: Sequence[Problem], completions: Sequence[str]) -> np.ndarray:
    """The batched reward of each (problem, completion), float32 ``[n]`` (one call)."""
    self._check_pairs(problems, completions)
    return verifiers.score(self._reward, [p.prompt for p in problems],
                           list(completions), [p.answer for p in problems])

  def reward(self, problem: Problem, completion: str) -> float:
    return float(self.score([problem], [completion])[0])

  def is_correct(self, problem: Problem, completion: str) -> bool:
    """Reward 1 (exact for the built-in 0/1 rewards; ``>= 1`` for custom ones)."""
    return self.reward(problem, completion) >= 1.0

  def exact(self, problems: Sequence[Problem], completions: Sequence[str]) -> np.ndarray:
    return self.score(problems, completions) >= 1.0


def _held_rows(prompts: Sequence[str], rows: int) -> list[bool]:
  """Which of ``prompts`` are held out: whole prompts (every row of one) in order of
  their hash (crc32, then text) until at least ``rows`` rows are.

  Examples:
    >>> _held_rows(["a", "b", "a", "c"], 1)
    [False, False, False, True]
  """
  counts: dict[str, int] = {}
  for p in prompts:
    counts[p] = counts.get(p, 0) + 1
  held: set[str] = set()
  taken = 0
  for p in sorted(counts, key=lambda t: (_split_bucket(t), t)):
    if taken >= rows:
      break
    held.add(p)
    taken += counts[p]
  return [p in held for p in prompts]


def _char_tokenizer(records: Sequence[Record]) -> CharTokenizer:
  chars: set[str] = set()
  for r in records:
    if not isinstance(r.prompt, str):
      raise ValueError(
          f"line {r.line}: a chat prompt needs a tokenizer with a chat template "
          "(e.g. HFTokenizer); the default character tokenizer has none.")
    chars.update(r.prompt)
    chars.update(r.answer)
  return CharTokenizer("".join(sorted(chars)))


__all__ = ["JsonlTask", "Record", "load_jsonl", "parse_record"]
