"""Multi-turn rollouts: KV continuation across turns vs re-prefilling each turn.

Run: ``python -m benchmarks.agents [--quick] [--models tiny,small] [--episodes 16]
[--turns 8] [--prompt-tokens 64] [--turn-tokens 16] [--reply-tokens 48] [--repeats 5]
[--json OUT.json]``.

The workload (issue 38's "8-turn episodes with 512-token histories"): ``--episodes``
episodes of a fake environment through :func:`jaxrl_llm.rollout.multiturn.
run_episodes` and :func:`~jaxrl_llm.rollout.multiturn.engine_generate`, on the
built-in character chat format (:class:`~jaxrl_llm.envs.PlainChat`) and an untrained
model of a preset (``tiny``: 2 layers of 64; ``small``: 4 layers of 256). The opening
is ``--prompt-tokens`` ids; every model turn is ``--turn-tokens`` sampled ids
(temperature 1, no stop id: every turn runs to its limit); every environment reply is
``--reply-tokens`` ids (a user message of fixed length); the episode ends after
``--turns`` model turns: 64 + 8 x 16 + 7 x 48 = 528 tokens by default.

Each round hands the engine every episode's whole sequence. Two engines of the same
settings (one compilation), the same episodes (same seeds, the same draws):

* ``reprefill``: ``prefix_cache=False``: each turn prefills the whole sequence again;
* ``continue``: ``prefix_cache=True``: each turn maps the pages of the sequence so far
  and prefills only the new tokens (the reply, the last sampled token and the tail of
  the last partly filled page).

After one untimed run of each (compilation), ``--repeats`` pairs of runs in one
process, the order in a pair alternating; reported: the median rollout seconds of
each, the ratio of the medians and the median of the pairs' ratios, the prompt tokens
prefilled and reused per run, the engine's prefill/decode device calls and seconds,
and whether the two produced the same episodes (token ids).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import machine, markdown_table, write_json

ARMS = ("reprefill", "continue")


class FixedReplyEnv:
  """A fake environment: an opening of ``prompt`` ids, then a reply of ``reply`` ids
  after every model turn (on :class:`~jaxrl_llm.envs.PlainChat`: ``u:`` + text + eos
  + ``a:``, after the eos closing a turn cut at its limit); never done (the episode
  ends at ``max_turns``); reward 0."""

  name = "fixed_reply"

  def __init__(self, prompt: int, reply: int) -> None:
    self.prompt, self.reply = prompt, reply

  def _text(self, seed: int, k: int, length: int) -> str:
    rng = np.random.default_rng([seed, k])
    return "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz "), length))

  def reset(self, seed: int):
    self.seed, self.k = seed, 0
    return [{"role": "user", "content": self._text(seed, 0, self.prompt - 5)}]

  def step(self, text: str):
    from jaxrl_llm.envs import StepResult
    self.k += 1
    reply = self._text(self.seed, self.k, self.reply - 6)
    return StepResult([{"role": "user", "content": reply}], 0.0, False)


def build(model: str, args):
  """``(engine, params)`` of an untrained ``model`` preset over the chat characters."""
  from flax import nnx

  from jaxrl_llm.envs import CHAT_CHARS
  from jaxrl_llm.models import make_paged_decode_fns, split_model
  from jaxrl_llm.models.transformer import Transformer, get_config
  from jaxrl_llm.rollout import RolloutEngine
  from jaxrl_llm.tasks.tokenizer import CharTokenizer
  tok = CharTokenizer(CHAT_CHARS)
  config = get_config(model, tok.vocab_size, max_seq_len=args.max_len)
  graphdef, params = split_model(Transformer(config, rngs=nnx.Rngs(0)))
  engine = RolloutEngine(make_paged_decode_fns(graphdef), max_slots=args.slots,
                         max_len=args.max_len, page_size=args.page_size,
                         prefill_chunk=args.prefill_chunk, prefill_rows=args.prefill_rows,
                         steps_per_call=args.steps_per_call, num_pages=args.num_pages)
  return engine, params, tok


def one_run(engine, params, tok, args, seed: int) -> dict:
  """One rollout of ``--episodes`` episodes; its seconds, counts and token ids."""
  from jaxrl_llm.envs import PlainChat
  from jaxrl_llm.rollout.multiturn import engine_generate, run_episodes
  calls: list[dict] = []
  # The stop id is outside the vocabulary: every turn runs to its limit.
  generate = engine_generate(engine, params, eos_ids=(tok.vocab_size,), seed=seed,
                             temperature=1.0)

  def counted(prompts, limits):
    out = generate(prompts, limits)
    calls.append(dict(engine.stats))
    return out

  envs = [FixedReplyEnv(args.prompt_tokens, args.reply_tokens) for _ in range(args.episodes)]
  start = time.perf_counter()
  episodes = run_episodes(counted, PlainChat(tok), envs, max_turns=args.turns,
                          max_new_tokens=args.turn_tokens, max_len=args.max_len)
  seconds = time.perf_counter() - start
  engine.reset()                     # the next run starts with an empty cache
  total = lambda name: sum(c.get(name, 0) for c in calls)
  return {"seconds": seconds, "tokens": [e.tokens.tolist() for e in episodes],
          "prefill_tokens": sum(e.prefill_tokens for e in episodes),
          "reused_tokens": sum(e.reused_tokens for e in episodes),
          "length": float(np.mean([len(e.tokens) for e in episodes])),
          "turns": float(np.mean([e.turns for e in episodes])),
          **{name: total(name) for name in ("prefill_calls", "decode_calls", "decode_steps",
                                            "prefill_s", "decode_s", "prefix_evictions")}}


def measure(model: str, args) -> dict:
  """The two arms on ``model``: a warm-up run each, then ``--repeats`` pairs."""
  base, params, tok = build(model, args)
  engines = {"reprefill": base, "continue": base.replica(prefix_cache=True)}
  runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
  for arm in ARMS:                               # compilations
    one_run(engines[arm], params, tok, args, seed=0)
  for rep in range(args.repeats):
    for arm in (ARMS if rep % 2 == 0 else ARMS[::-1]):
      runs[arm].append(one_run(engines[arm], params, tok, args, seed=0))
  med = {arm: statistics.median(r["seconds"] for r in runs[arm]) for arm in ARMS}
  pairs = [c["seconds"] / r["seconds"] for c, r in zip(runs["continue"], runs["reprefill"])]
  row = {"model": model, "episodes": args.episodes, "turns": runs["continue"][0]["turns"],
         "length": runs["continue"][0]["length"],
         "reprefill_s": med["reprefill"], "continue_s": med["continue"],
         "ratio": med["continue"] / med["reprefill"],
         "pair_ratio_median": statistics.median(pairs)}
  for arm in ARMS:
    last = runs[arm][-1]
    for name in ("prefill_tokens", "reused_tokens", "prefill_calls", "decode_calls",
                 "prefill_s", "decode_s"):
      row[f"{arm}_{name}"] = last[name]
  row["evictions"] = runs["continue"][-1]["prefix_evictions"]
  row["same_episodes"] = sum(a == b for a, b in zip(runs["continue"][-1]["tokens"],
                                                    runs["reprefill"][-1]["tokens"]))
  row["seconds"] = {arm: [round(r["seconds"], 4) for r in runs[arm]] for arm in ARMS}
  return row


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true", help="smoke sizes")
  p.add_argument("--models", default="tiny", help="comma-separated presets: tiny, small")
  p.add_argument("--episodes", type=int, default=16)
  p.add_argument("--turns", type=int, default=8)
  p.add_argument("--prompt-tokens", type=int, default=64)
  p.add_argument("--turn-tokens", type=int, default=16)
  p.add_argument("--reply-tokens", type=int, default=48)
  p.add_argument("--slots", type=int, default=16)
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--prefill-chunk", type=int, default=64)
  p.add_argument("--prefill-rows", type=int, default=1)
  p.add_argument("--steps-per-call", type=int, default=16)
  p.add_argument("--num-pages", type=int, default=None,
                 help="the engine's page pool (default: slots x (pages of max_len + 1))")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)
  if args.quick:
    args.episodes, args.turns, args.slots, args.repeats = 2, 3, 2, 1
    args.prompt_tokens, args.turn_tokens, args.reply_tokens = 16, 4, 12
    args.page_size, args.prefill_chunk, args.steps_per_call = 4, 8, 4
  args.max_len = (args.prompt_tokens + args.turns * args.turn_tokens
                  + (args.turns - 1) * args.reply_tokens + args.page_size)
  rows = [measure(m, args) for m in args.models.split(",") if m]
  print(f"machine: {machine()}")
  print(f"{args.episodes} episodes x {args.turns} turns: opening {args.prompt_tokens} "
        f"tokens, turns of {args.turn_tokens}, replies of {args.reply_tokens}; "
        f"{args.slots} slots, {args.num_pages or 'default'} pages of {args.page_size}, "
        f"prefill [{args.prefill_rows}, {args.prefill_chunk}], {args.steps_per_call} decode "
        f"steps a call; median of "
        f"{args.repeats} paired runs\n")
  cols = ["model", "episodes", "turns", "length", "reprefill_s", "continue_s", "ratio",
          "pair_ratio_median", "reprefill_prefill_tokens", "continue_prefill_tokens",
          "continue_reused_tokens", "reprefill_prefill_calls", "continue_prefill_calls",
          "reprefill_decode_calls", "continue_decode_calls", "reprefill_prefill_s",
          "continue_prefill_s", "reprefill_decode_s", "continue_decode_s", "evictions",
          "same_episodes"]
  print(markdown_table(rows, cols))
  for r in rows:
    print(f"\n{r['model']}: seconds per run {r['seconds']}")
  write_json(args.json, {"machine": machine(), "args": vars(args), "rows": rows})
  return rows


if __name__ == "__main__":
  main()
