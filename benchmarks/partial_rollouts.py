"""Synchronous vs partial rollouts on a task with heavy-tailed response lengths.

Run: ``python -m benchmarks.partial_rollouts [--quick] [--steps 30] [--seeds 0,1,2]
[--task repeat] [--json OUT.json]``.

Each (mode, seed) is one ``run_training`` of the same run config, with and without
``--partial-rollouts``. Per step the loop reports ``time_s`` (the step: generation,
scoring, reference/old log-probs, update; evaluation excluded) and ``generate_s``
(the engine's generation). In this single-process loop the trainer sits idle while the
engine generates, so ``generate_s`` is the trainer's idle time per step and
``time_s - generate_s`` the sampler's. Reported (steps after the first two, which
compile): the mean step time, iterations/s, trained samples/s, trained tokens/s,
mean ``generate_s`` (trainer idle) and its share of the step, the mean trained
response length, the staleness of partial runs, and the final greedy eval.

The task: ``repeat`` (answers of 200 characters + eos, 201 tokens allowed) on the
untrained tiny model, whose samples stop on an eos drawn at random: most responses are
short, a few run to the 201-token limit (the length distribution is printed). A
synchronous step decodes until its longest sample ends, most slots idle in the tail;
a partial step stops once ``--prompts-per-step`` groups are complete.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import machine, markdown_table, write_json
from jaxrl_llm.loop.config import RunConfig
from jaxrl_llm.loop.run import run_training


def one_run(mode: str, seed: int, args) -> dict:
  rows: list[dict] = []
  with tempfile.TemporaryDirectory() as out:
    run = RunConfig(task=args.task, algo=args.algo, steps=args.steps,
                    prompts_per_step=args.prompts, group_size=args.group, seed=seed,
                    eval_every=args.eval_every or args.steps, eval_size=args.eval_size,
                    save_every=args.steps, out=out, progress=False,
                    partial_rollouts=mode.startswith("partial"),
                    token_budget=args.budget if mode.startswith("partial") else None,
                    partial_kv="keep" if mode == "partial-keep" else "recompute",
                    async_rollouts=mode.startswith("async"),
                    max_staleness=int(mode[5:]) if mode.startswith("async") else 1)
    start = time.perf_counter()
    summary = run_training(run, on_step=rows.append)
    wall = time.perf_counter() - start
  warm = [r for r in rows if r["step"] > 2]
  batch = args.prompts * args.group
  step_s = float(np.mean([r["time_s"] for r in warm]))
  gen_s = float(np.mean([r["generate_s"] for r in warm]))
  if mode.startswith("async"):      # a rollout thread: each side waits on the other
    trainer_idle = float(np.mean([r["trainer_wait_s"] for r in warm]))
    sampler_idle = float(np.mean([r["sampler_wait_s"] for r in warm]))
  else:                             # one thread: the trainer waits while it generates
    trainer_idle, sampler_idle = gen_s, step_s - gen_s
  length = float(np.mean([r["response_length"] for r in warm]))
  out = {"mode": mode, "seed": seed, "steps": args.steps, "wall_s": round(wall, 1),
         "step_s": step_s, "it_s": 1.0 / step_s, "samples_s": batch / step_s,
         "tokens_s": batch * length / step_s, "generate_s": gen_s,
         "trainer_idle_s": trainer_idle, "sampler_idle_s": sampler_idle,
         "trainer_idle_share": trainer_idle / step_s,
         "response_length": length,
         "eval_reward_end": summary["eval_reward_end"],
         "eval_accuracy_end": summary["eval_accuracy_end"],
         "train_reward_last10": summary["train_reward_last10"]}
  elapsed, curve = 0.0, []            # greedy eval reward against the steps' time
  for r in rows:
    elapsed += r.get("time_s", 0.0)
    if "eval_reward" in r:
      curve.append((r["step"], round(elapsed, 1), round(r["eval_reward"], 4)))
  out["eval_curve"] = curve
  if mode != "sync":
    out["staleness_mean"] = float(np.mean([r["staleness_mean"] for r in warm]))
    out["staleness_max"] = float(np.max([r["staleness_max"] for r in warm]))
    out["behaviour_kl"] = float(np.mean([r["behaviour_kl"] for r in warm]))
  if mode.startswith("partial"):
    out["in_flight"] = float(np.mean([r["in_flight"] for r in warm]))
    out["recompute_s"] = float(np.mean([r["recompute_s"] for r in warm]))
  return out


_PHASE_WARMUP = 4


def rollout_phase(args) -> list[dict]:
  """The generation of one step alone, at fixed (initial) weights: the length mix of
  the untrained model stays heavy-tailed (training on ``repeat`` quickly makes most
  responses long). ``sync`` is :func:`jaxrl_llm.loop.batch._rollout` through the
  engine; ``partial`` / ``partial-keep`` are :class:`PartialRollouts` steps whose
  ``version`` advances every step (so ``recompute`` prefills the in-flight samples
  again each step, as in training). The first ``_PHASE_WARMUP`` steps compile (the
  recompute's smaller row counts appear in steps 2-4) and are left out."""
  import jax

  from jaxrl_llm.loop.batch import _rollout
  from jaxrl_llm.loop.partial import PartialRollouts
  from jaxrl_llm.loop.resolve import resolve
  from jaxrl_llm.loop.setup import make_policy, make_task
  run = RunConfig(task=args.task, algo=args.algo, prompts_per_step=args.prompts,
                  group_size=args.group, seed=0)
  task = make_task(run)
  resolved = resolve(run, task)
  policy = make_policy(resolved, task)
  params = policy.init_params
  modes = ("sync", "partial", "partial-keep")
  partials = {mode: PartialRollouts(policy, task, resolved.sampling, resolved.train,
                                    args.budget,
                                    "keep" if mode == "partial-keep" else "recompute")
              for mode in modes[1:]}
  rec = {mode: {"generate_s": [], "decode_steps": [], "util": [], "recompute_s": [],
                "lengths": []} for mode in modes}
  for step in range(1, args.phase_steps + 1):
    for mode in modes:          # interleaved: a change of the machine's load hits all
      partial = partials.get(mode)
      engine = policy.backend if partial is None else partial.engine
      rng, key = np.random.default_rng([0, step]), jax.random.PRNGKey(step)
      stats_calls: list[dict] = []
      generate = engine.generate

      def counted(*a, _generate=generate, _calls=stats_calls, _engine=engine, **k):
        result = _generate(*a, **k)
        _calls.append(dict(_engine.stats))
        return result

      engine.generate = counted
      start = time.perf_counter()
      if partial is None:
        rows, _ = _rollout(resolved.sampling, task, policy, params, rng, key,
                           resolved.train, args.prompts)
        recompute = 0.0
      else:
        rows, _, stats = partial.rollout(params, step - 1, rng, key)
        recompute = stats["recompute_s"]
      elapsed = time.perf_counter() - start
      del engine.generate
      if step <= _PHASE_WARMUP:
        continue
      steps = sum(c.get("decode_steps", 0) for c in stats_calls)
      tokens = sum(c.get("generated_tokens", 0) for c in stats_calls)
      r = rec[mode]
      r["generate_s"].append(elapsed)
      r["decode_steps"].append(steps)
      r["util"].append(tokens / (engine.max_slots * max(steps, 1)))
      r["recompute_s"].append(recompute)
      for name in ("decode_s", "prefill_s", "total_s", "decode_calls", "prefill_calls",
                   "admit_calls"):
        r.setdefault(name, []).append(sum(c.get(name, 0) for c in stats_calls))
      r["lengths"].extend(np.asarray(rows["lengths"]).tolist())
  out = []
  for mode in modes:
    r = rec[mode]
    lengths = np.asarray(r["lengths"])
    out.append({"mode": mode, "generate_s": float(np.mean(r["generate_s"])),
                "decode_steps": float(np.mean(r["decode_steps"])),
                "slot_utilisation": float(np.mean(r["util"])),
                "recompute_s": float(np.mean(r["recompute_s"])),
                **{name: float(np.mean(r[name])) for name in (
                    "total_s", "decode_s", "prefill_s", "decode_calls", "prefill_calls",
                    "admit_calls")},
                "length_p10": float(np.percentile(lengths, 10)),
                "length_p50": float(np.percentile(lengths, 50)),
                "length_p90": float(np.percentile(lengths, 90))})
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true", help="smoke sizes")
  p.add_argument("--task", default="repeat")
  p.add_argument("--algo", default="grpo")
  p.add_argument("--steps", type=int, default=30)
  p.add_argument("--seeds", default="0")
  p.add_argument("--prompts", type=int, default=8)
  p.add_argument("--group", type=int, default=4)
  p.add_argument("--budget", type=int, default=None, help="--token-budget (None: default)")
  p.add_argument("--eval-size", type=int, default=32)
  p.add_argument("--eval-every", type=int, default=None, help="(None: at the end only)")
  p.add_argument("--modes", default="sync,partial,partial-keep,async1,async2",
                 help="sync, partial (recompute the cache), partial-keep (stale cache), "
                 "asyncK (--async --max-staleness K)")
  p.add_argument("--phase-steps", type=int, default=10,
                 help="steps of the fixed-weights rollout-phase measurement (0: skip)")
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)
  if args.quick:
    args.steps, args.prompts, args.group, args.eval_size = 4, 2, 2, 4
    args.phase_steps = _PHASE_WARMUP + 1
  seeds = [int(s) for s in args.seeds.split(",")]
  modes = args.modes.split(",")
  runs = [one_run(mode, seed, args) for seed in seeds for mode in modes if mode]
  phase = rollout_phase(args) if args.phase_steps > _PHASE_WARMUP else []
  print(f"machine: {machine()}")
  print(f"task {args.task}, algo {args.algo}, {args.steps} steps, {args.prompts} prompts "
        f"x {args.group} samples, token budget {args.budget or 'default'}\n")
  cols = ["mode", "seed", "step_s", "it_s", "samples_s", "tokens_s", "generate_s",
          "trainer_idle_s", "trainer_idle_share", "sampler_idle_s", "response_length",
          "eval_reward_end", "eval_accuracy_end", "staleness_mean", "staleness_max", "in_flight",
          "behaviour_kl", "recompute_s"]
  shown = [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}
           for r in runs]
  if runs:
    print(markdown_table(shown, [c for c in cols if any(c in r for r in runs)]))
    print("\neval reward curves (step, seconds of steps so far, greedy eval reward):")
    for r in runs:
      print(f"  {r['mode']} seed {r['seed']}: {r['eval_curve']}")
  if phase:
    print(f"\nrollout phase alone at the initial weights ({args.phase_steps - _PHASE_WARMUP} "
          f"steps after {_PHASE_WARMUP} compiling ones; trained lengths of the step's "
          "batch):\n")
    print(markdown_table(phase, list(phase[0])))
  if args.json:
    write_json(args.json, {"machine": machine(), "args": vars(args), "runs": runs,
                           "rollout_phase": phase})
  return runs


if __name__ == "__main__":
  main()
