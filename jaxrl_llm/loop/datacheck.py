"""Up-front checks of a ``--dataset`` run, before JAX and the model are loaded.

:func:`check_dataset` builds the run's :class:`~jaxrl_llm.tasks.JsonlTask` (every line
parsed, every prompt rendered and tokenized as training will) and checks what would
otherwise fail late or silently:

* a malformed line, a record without ``answer``, an empty file: ``ValueError``
  ``"FILE:LINE: ..."`` (from :func:`~jaxrl_llm.tasks.load_jsonl`);
* a prompt that with ``--max-new-tokens`` needs more positions than the Hugging Face
  model has (``max_position_embeddings`` of its ``config.json``): ``ValueError`` naming
  the longest row;
* reference answers that the chosen ``--reward`` cannot parse
  (:data:`~jaxrl_llm.tasks.verifiers.ANSWER_PARSERS`; for a reward without a parser,
  answers it cannot reward even when the completion *is* the answer): such a row
  rewards only a completion that writes the answer exactly, or none. Up to
  :data:`CHECKED_ROWS` rows are checked (spread over the file); more than
  :data:`UNREACHABLE_SHARE` of them unparsed gives a warning with examples (a few odd
  answers are common in real datasets: no warning for those).

Nothing here imports JAX (the command runs it before).
"""

from __future__ import annotations

import json
import os
from typing import Any

from jaxrl_llm.loop.config import RunConfig

# Rows of a dataset whose answers are checked against the reward (evenly spaced).
CHECKED_ROWS = 500
# The share of checked rows whose answer the reward cannot reward that makes a warning.
UNREACHABLE_SHARE = 0.05


def _task(run: RunConfig) -> Any:
  """The run's JsonlTask (:func:`jaxrl_llm.loop.task_setup.make_task`)."""
  from jaxrl_llm.loop.task_setup import make_task
  from jaxrl_llm.tasks import load_jsonl
  assert run.dataset is not None
  load_jsonl(run.dataset)              # the data's own errors first (FILE:LINE)
  return make_task(run)


def _max_positions(model: str) -> int | None:
  from jaxrl_llm.model_files import checkpoint_path, is_gguf
  from jaxrl_llm.models.sources import checkpoint_config
  path = checkpoint_path(model)
  if path is None:
    return None                        # a preset: sized to the task
  if is_gguf(path):
    return checkpoint_config(path).max_seq_len
  file = os.path.join(path, "config.json")
  with open(file, encoding="utf-8") as f:
    try:
      value = json.load(f).get("max_position_embeddings")
    except (json.JSONDecodeError, AttributeError):
      return None                      # from_pretrained reports it
  return value if isinstance(value, int) else None


def unparsed_rows(task: Any, reward: str, rows: int = CHECKED_ROWS) -> tuple[int, list]:
  """``(checked, problems)``: of up to ``rows`` training problems of ``task`` (evenly
  spaced), those whose reference answer the reward ``reward`` cannot parse: its
  :data:`~jaxrl_llm.tasks.verifiers.ANSWER_PARSERS` entry says no or, for a reward
  without one, it gives 0 to each of the completions ``answer``, ``\\boxed{answer}``
  and ``\\boxed{reference}`` (the answer of a ``#### n`` / ``\\boxed{}`` rationale).

  Examples:
    >>> import json, os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "d.jsonl")
    >>> with open(path, "w") as f:
    ...   for answer in ["7", "#### 12", "x = 3, y = 4", "1/2"]:
    ...     _ = f.write(json.dumps({"prompt": "q", "answer": answer}) + "\\n")
    >>> from jaxrl_llm.tasks import JsonlTask
    >>> checked, bad = unparsed_rows(JsonlTask(path=path, max_new_tokens=4), "math")
    >>> checked, [p.answer for p in bad]
    (4, ['x = 3, y = 4'])
  """
  from jaxrl_llm.tasks.verifiers import ANSWER_PARSERS, reference_answer
  problems = list(task.problems)
  if len(problems) > rows:
    step = len(problems) / rows
    problems = [problems[int(i * step)] for i in range(rows)]
  parses = ANSWER_PARSERS.get(reward)
  if parses is not None:
    return len(problems), [p for p in problems if not parses(p.answer)]
  candidates = [lambda a: a, lambda a: f"\\boxed{{{a}}}",
                lambda a: f"\\boxed{{{reference_answer(a)}}}"]
  best = None
  for make in candidates:
    scores = task.score(problems, [make(p.answer) for p in problems])
    best = scores if best is None else best.clip(min=scores)
  assert best is not None
  return len(problems), [p for p, s in zip(problems, best.tolist()) if s <= 0]


def _eval_overlap(run: RunConfig, task: Any) -> list[str]:
  """A warning when rows of ``--eval-dataset`` repeat a training prompt (their score
  is not held out)."""
  if run.eval_dataset is None:
    return []
  train = {p.prompt for p in task.problems}
  evals = task.eval_problems(1 << 62)         # all of them (the first n rows)
  shared = [p for p in evals if p.prompt in train]
  if not shared:
    return []
  return [f"warning: {len(shared)} of the {len(evals)} rows of --eval-dataset "
          f"{run.eval_dataset} repeat a prompt of --dataset {run.dataset} (e.g. line "
          f"{shared[0].info['line']}); their evaluation is not held out"]


def check_dataset(run: RunConfig) -> list[str]:
  """Builds and checks the run's dataset task (see the module docstring).

  Returns:
    Warning lines (``"warning: ..."``) to print; empty when all is well.

  Raises:
    ValueError: one line, ``FILE:LINE: ...`` where a row is at fault.
  """
  task = _task(run)
  limit = _max_positions(run.model)
  need = task.max_prompt_len + task.max_new_tokens
  if limit is not None and need > limit:
    longest = max(task.problems + tuple(task.eval_problems(len(task.problems))),
                  key=lambda p: len(task.tokenizer.encode(p.prompt)))
    n = len(task.tokenizer.encode(longest.prompt))
    raise ValueError(
        f"{run.dataset}:{longest.info['line']}: the prompt is {n} tokens, which with "
        f"--max-new-tokens {task.max_new_tokens} needs {n + task.max_new_tokens} positions; "
        f"{run.model} has {limit} (max_position_embeddings). Shorten or drop the long "
        "prompts, or lower --max-new-tokens")
  warnings = _eval_overlap(run, task)
  checked, bad = unparsed_rows(task, run.reward)
  if len(bad) <= UNREACHABLE_SHARE * checked:
    return warnings
  examples = "; ".join(f"line {p.info['line']}: {p.answer[:40]!r}" for p in bad[:3])
  return [*warnings, f"warning: --reward {run.reward} cannot parse the answers of {len(bad)} of "
          f"{checked} checked rows of {run.dataset} (e.g. {examples}); those rows reward "
          "only a completion that writes the answer exactly, or none. Choose another "
          "--reward (math, boxed, exact, math_verify, ...) or fix the answers"]


__all__ = ["CHECKED_ROWS", "UNREACHABLE_SHARE", "check_dataset", "unparsed_rows"]
