"""The ``jaxrl-llm`` command: ``train``, ``eval`` and ``plot``.

``jaxrl-llm train`` with no flags trains the tiny built-in policy with GRPO on the
default task (reverse a 3-digit string) and prints a summary; ``jaxrl-llm eval --out
RUN`` re-evaluates a run's latest checkpoint; ``jaxrl-llm plot RUN [RUN ...]`` draws
the learning curves of one or several runs into a PNG.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

PLOT_KEYS = (("reward", "train reward"), ("eval_accuracy", "eval accuracy (greedy)"),
             ("kl_ref", "KL to reference"), ("pg_clipfrac", "clip fraction"),
             ("entropy", "entropy"), ("adv_raw_var", "advantage variance"))


def _add_train_args(p: argparse.ArgumentParser):
  from jaxrl_llm.trainer import RunConfig
  d = RunConfig()
  p.add_argument("--task", default=d.task, help="built-in task (default: %(default)s)")
  p.add_argument("--algo", default=d.algo,
                 help="ppo | grpo | dr_grpo | rloo | self_critical | reinforce_pp "
                      "(default: %(default)s)")
  p.add_argument("--model", default=d.model, help="tiny | small (default: %(default)s)")
  p.add_argument("--steps", type=int, default=d.steps)
  p.add_argument("--prompts-per-step", type=int, default=d.prompts_per_step)
  p.add_argument("--group-size", type=int, default=d.group_size)
  p.add_argument("--lr", type=float, default=d.lr)
  p.add_argument("--seed", type=int, default=d.seed)
  p.add_argument("--temperature", type=float, default=d.temperature)
  p.add_argument("--kl-coef", type=float, default=d.kl_coef)
  p.add_argument("--clip", type=float, default=d.clip, help="PPO clip epsilon")
  p.add_argument("--clip-end", type=float, default=None,
                 help="anneal the clip epsilon linearly from --clip to this value")
  p.add_argument("--adaptive-clip", action="store_true",
                 help="adapt the clip epsilon to keep the approx KL at target")
  p.add_argument("--num-epochs", type=int, default=d.num_epochs)
  p.add_argument("--num-minibatches", type=int, default=d.num_minibatches)
  p.add_argument("--gamma", type=float, default=d.gamma)
  p.add_argument("--lam", type=float, default=d.lam)
  p.add_argument("--hybrid-n", type=int, default=None,
                 help="PPO: mix n-step returns into GAE (hybrid advantages)")
  p.add_argument("--hybrid-mix", type=float, default=d.hybrid_mix)
  p.add_argument("--entropy-coef", type=float, default=d.entropy_coef)
  p.add_argument("--eval-every", type=int, default=d.eval_every)
  p.add_argument("--eval-size", type=int, default=d.eval_size)
  p.add_argument("--save-every", type=int, default=d.save_every)
  p.add_argument("--data", dest="mesh_data", type=int, default=d.mesh_data,
                 help="data-parallel mesh axis size (-1: all remaining devices)")
  p.add_argument("--fsdp", dest="mesh_fsdp", type=int, default=d.mesh_fsdp,
                 help="FSDP mesh axis size (parameters and optimizer state sharded)")
  p.add_argument("--tensor", dest="mesh_tensor", type=int, default=d.mesh_tensor,
                 help="tensor-parallel mesh axis size (heads / mlp / vocab sharded)")
  p.add_argument("--out", default=d.out, help="run folder (default: %(default)s)")
  p.add_argument("--resume", action="store_true", help="continue the run in --out")
  p.add_argument("--overwrite", action="store_true", help="replace the run in --out")
  p.add_argument("--no-progress", dest="progress", action="store_false")


def _run_config(args):
  from jaxrl_llm.trainer import RunConfig
  fields = {f.name for f in dataclasses.fields(RunConfig)}
  return RunConfig(**{k: val for k, val in vars(args).items() if k in fields})


def cmd_train(args) -> int:
  from jaxrl_llm.trainer import RunFolderError, format_summary, train
  run = _run_config(args)
  try:
    run.validate()
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  try:
    summary = train(run)
  except RunFolderError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    return 130
  print(format_summary(summary))
  return 0


def cmd_eval(args) -> int:
  import jax
  import optax
  from jaxrl_llm.checkpoint import Checkpointer
  from jaxrl_llm.tasks import get_task
  from jaxrl_llm.trainer import (Policy, RunConfig, evaluate, train_config_for)
  from jaxrl_llm.train import init_train_state
  with open(os.path.join(args.out, "config.json")) as f:
    run = RunConfig(**json.load(f))
  task = get_task(run.task)
  tok = task.tokenizer
  policy = Policy(run, tok.vocab_size, task.max_prompt_len + task.max_new_tokens,
                  tok.pad_id)
  config = train_config_for(run, task.max_new_tokens)
  template = init_train_state(policy.init_params, optax.adam(run.lr), config,
                              rng=jax.random.PRNGKey(run.seed))
  with Checkpointer(os.path.join(args.out, "checkpoints")) as ckpt:
    state, extra = ckpt.restore(template)
  result = {"step": extra.get("step"),
            **evaluate(policy, state.params, task, task.eval_problems(args.eval_size))}
  print(json.dumps(result))
  return 0


def load_history(run_dir: str) -> list[dict]:
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def cmd_plot(args) -> int:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(2, 3, figsize=(13, 7))
  for run_dir in args.runs:
    rows = load_history(run_dir)
    label = args.labels[args.runs.index(run_dir)] if args.labels else os.path.basename(
        os.path.normpath(run_dir))
    for ax, (key, title) in zip(axes.flat, PLOT_KEYS):
      pts = [(r["step"], r[key]) for r in rows if key in r]
      if pts:
        xs, ys = zip(*pts)
        ax.plot(xs, ys, label=label, marker="o" if key.startswith("eval") else None,
                markersize=3)
      ax.set_title(title)
      ax.set_xlabel("step")
  axes.flat[0].legend()
  fig.tight_layout()
  fig.savefig(args.output, dpi=110)
  print(args.output)
  return 0


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="jaxrl-llm", description=__doc__.split("\n")[0])
  sub = parser.add_subparsers(dest="command")
  p_train = sub.add_parser("train", help="train the built-in policy on a task")
  _add_train_args(p_train)
  p_train.set_defaults(func=cmd_train)
  p_eval = sub.add_parser("eval", help="evaluate a run's latest checkpoint")
  p_eval.add_argument("--out", default="runs/default")
  p_eval.add_argument("--eval-size", type=int, default=256)
  p_eval.set_defaults(func=cmd_eval)
  p_plot = sub.add_parser("plot", help="plot learning curves of runs into a PNG")
  p_plot.add_argument("runs", nargs="+", help="run folders")
  p_plot.add_argument("--labels", nargs="*", default=None)
  p_plot.add_argument("--output", "-o", default="curves.png")
  p_plot.set_defaults(func=cmd_plot)
  return parser


def main(argv=None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.command is None:
    args = parser.parse_args(["train"] + list(argv or sys.argv[1:]))
  return args.func(args)


if __name__ == "__main__":
  sys.exit(main())
