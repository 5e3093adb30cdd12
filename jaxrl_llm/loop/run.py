"""The RL loop: sample G completions per prompt, score, estimate advantages, update.

``run_training(RunConfig(...))`` runs a recipe (:mod:`jaxrl_llm.loop.recipes`: PPO
with a value head and GAE, VAPO, or a critic-free estimator: GRPO, Dr.GRPO, RLOO,
self-critical, REINFORCE++, DAPO) with any registered policy loss on a built-in task or
a dataset, evaluating greedy accuracy on the task's held-out split and checkpointing
with orbax. The run is resolved once (:func:`jaxrl_llm.loop.resolve.resolve_run`:
the command does it before JAX is imported and hands over ``(resolved, task)``); the
loop and the pieces of :mod:`jaxrl_llm.loop` read the resolved parts alone
(:class:`~jaxrl_llm.loop.resolve.Resolved`: the recipe's settings and the rollout,
LoRA, mesh and I/O sections), never the run's fields. Everything random in step
``s`` is derived from ``(seed, s)``, so a run resumed from a checkpoint continues
exactly as an uninterrupted one (:mod:`jaxrl_llm.train` is the train-*step* package).

Run folder layout: ``config.json`` (the run config), ``metrics.jsonl`` (one JSON object
per step, eval results included on eval steps), ``checkpoints/<step>/`` (orbax).
Every row also says where the time and memory went (:mod:`jaxrl_llm.loop.accounting`:
``step_s`` split into phases, compile seconds, peak RSS); the summary averages them.

Faults (see :mod:`jaxrl_llm.run_folder` and :mod:`jaxrl_llm.checkpoint`): nothing is
written before the run is built (a failed start leaves no ``config.json``); the folder
is probed for writability and free space first; metrics rows are appended and fsynced
one per step (a resume drops the rows after its checkpoint by an atomic rewrite, never
in place); a resume restores the newest checkpoint that verifies; SIGTERM (and a first
Ctrl-C) finishes the current step, checkpoints it and raises
:class:`~jaxrl_llm.run_folder.RunInterrupted`; ``max_consecutive_skips`` train steps
in a row whose every update was skipped (non-finite loss, gradients or state;
:func:`step_skipped`) stop the run with :class:`SkippedUpdatesError` instead of
checkpointing a run that no longer learns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import run_folder as rf
from jaxrl_llm.checkpoint import Checkpointer
from jaxrl_llm.loop.accounting import PHASES, CompileLog, PhaseClock, peak_rss_mb, phase_summary
from jaxrl_llm.loop.batch import Share, build_batch, pack_train_batch
from jaxrl_llm.loop.config import RunConfig, read_run_config
from jaxrl_llm.loop.evaluation import evaluate
from jaxrl_llm.loop.policy import Policy
from jaxrl_llm.loop.processes import Processes, host_value
from jaxrl_llm.loop.progress import end_progress_line, report_progress
from jaxrl_llm.loop.resolve import IOSettings, MeshSettings, Resolved, resolve_run
from jaxrl_llm.loop.rollouts import Async, InStep, Partial, Rollouts
from jaxrl_llm.loop.setup import make_policy, step_problem
from jaxrl_llm.loop.signals import SignalWatch, signal_window
from jaxrl_llm.tasks.base import Task
from jaxrl_llm.train import TrainConfig, make_train_step


class SkippedUpdatesError(RuntimeError):
  """Too many consecutive train steps were skipped (non-finite values): the run stops."""


def _say(message: str) -> None:
  """A one-line note on stderr (resume, fallback, checkpoint on a signal), on a line of
  its own (an open progress bar is ended first)."""
  end_progress_line()
  sys.stderr.write(message + "\n")
  sys.stderr.flush()


def _silent(message: str) -> None:
  """The notes of a process other than 0 in a multi-process run (process 0 says them)."""


def _signame(signum: int) -> str:
  import signal
  return signal.Signals(signum).name


class _NoMetrics:
  """The metrics writer of a process other than 0 (process 0 writes ``metrics.jsonl``)."""

  def append(self, row: dict) -> None:
    pass

  def close(self) -> None:
    pass


# ------------------------------------------------------------ run folder, placement


def _compile_step(mesh: MeshSettings, rollout_devices: int, step_fn, state):
  """``(jitted step, placed state, batch placer, mesh or None)``: one device, or a mesh
  via :func:`jaxrl_llm.train.shard_train_step` when ``mesh`` asks for one (always in
  a multi-process run: ``mesh`` all 1 there means data parallel over every device);
  the last ``rollout_devices`` devices are left to the rollouts."""
  sizes = mesh.sizes
  if sizes == (1, 1, 1):
    if jax.process_count() == 1:
      return jax.jit(step_fn, donate_argnums=0), state, lambda batch: batch, None
    sizes = (-1, 1, 1)
  from jaxrl_llm.parallel import make_mesh, shard_batch
  from jaxrl_llm.train.sharded import shard_train_step
  placed = make_mesh(data=sizes[0], fsdp=sizes[1], tensor=sizes[2],
                     devices=_train_devices(rollout_devices) if rollout_devices else None)
  jitted, state = shard_train_step(step_fn, state, placed)
  return jitted, state, lambda batch: shard_batch(batch, placed), placed


def _train_devices(rollout_devices: int) -> list[jax.Device]:
  """The trainer's devices: all but the last ``rollout_devices`` (which generate)."""
  devices = jax.devices()
  return devices[:len(devices) - rollout_devices]


def _check_run_folder(io: IOSettings, identity: Mapping[str, Any]) -> None:
  """Refuses a folder that holds another run (``identity``: this run's); writes
  nothing."""
  cfg_path = os.path.join(io.out, rf.CONFIG_FILE)
  if os.path.exists(cfg_path) and not io.overwrite:
    saved_identity = read_run_config(cfg_path).identity()
    if saved_identity != identity:
      diff = sorted(k for k in set(saved_identity) | set(identity)
                    if saved_identity.get(k) != identity.get(k))
      raise rf.RunFolderError(f"{io.out} holds a run with a different config (fields "
                           f"{diff}); resume it with the saved config (--resume alone), "
                           "choose another --out, or pass --overwrite to replace it.")
    if not io.resume:
      raise rf.RunFolderError(f"{io.out} already holds a run; pass --resume to continue it "
                           "or --overwrite to replace it.")
  rf.probe_run_folder(io.out)


def _write_run_folder(io: IOSettings, record: Mapping[str, Any]) -> None:
  """Creates the run folder and writes ``config.json`` (``record``, atomically): the
  run starts."""
  if io.overwrite and os.path.exists(io.out):
    shutil.rmtree(io.out)
  try:
    os.makedirs(io.out, exist_ok=True)
  except OSError as e:
    raise rf.io_error("writing", io.out, e) from None
  rf.write_json(os.path.join(io.out, rf.CONFIG_FILE), dict(record))


# ----------------------------------------------------------------------------- loop


def run_training(run: RunConfig | Resolved, *, task: Task | None = None,
                 policy: Policy | None = None,
                 on_step: Callable[[dict], None] | None = None) -> dict:
  """Runs (or resumes) a training run; returns a summary dict.

  ``run``: a :class:`~jaxrl_llm.loop.config.RunConfig` (validated and resolved here,
  once: :func:`~jaxrl_llm.loop.resolve.resolve_run`), or a run already resolved with
  its ``task`` (``run_training(*resolve_run(run))``, as the command does). ``policy``:
  any :class:`~jaxrl_llm.loop.Policy` (default: the reference transformer of the
  run's model). ``on_step(row)`` is called after every step (tests use it to
  interrupt a run). A ``KeyboardInterrupt`` saves a checkpoint of the last completed
  step and re-raises.

  Multi-host (``jax.distributed`` initialised first, e.g. by
  :func:`jaxrl_llm.parallel.initialize_multihost`; the same call on every process):
  the mesh spans every device, each process generates and scores its rows of every
  step (:mod:`jaxrl_llm.loop.processes`), process 0 alone writes ``config.json`` and
  ``metrics.jsonl`` and prints, checkpoints are saved collectively (one sharded
  checkpoint), and a stop signal on any process stops every process after the same
  step, each saving it (:class:`~jaxrl_llm.run_folder.RunInterrupted` everywhere).
  See ``docs/multihost.md``.

  The stages: :func:`_build` (policy, step, state, folder, checkpoint, metrics; every
  resource it opens is closed by one exit stack, however the run ends), the
  evaluation of step 0, then per step :func:`_train_step` (rollouts -> batch ->
  update -> row) and :func:`_keep_step` (log, checkpoint, progress, signals), then
  :func:`_finish` (the summary).
  """
  t_entry = time.perf_counter()
  resolved, task = _resolved(run, task)
  with contextlib.ExitStack() as stack:
    compiles = CompileLog().start()       # every compile of the run, by function
    stack.callback(compiles.stop)
    r = _build(resolved, task, policy, t_entry, compiles, stack)
    t0 = time.time()
    if r.start >= resolved.steps:   # a finished run resumed: nothing to build or train
      if r.procs.primary:
        _say(f"{resolved.io.out} is already complete: its checkpoint is step {r.start} "
             f"of --steps {resolved.steps}; nothing to train (pass a larger --steps to "
             "go on)")
    else:
      t0 = _run_steps(r, stack, on_step)
    kept = r.ckpt.all_steps()
  return _finish(r, kept, time.time() - t0)


def _resolved(run: RunConfig | Resolved, task: Task | None) -> tuple[Resolved, Task]:
  """``(resolved, task)`` of :func:`run_training`'s ``run``: a run config resolved
  here, or one resolved already (with its task)."""
  if not isinstance(run, Resolved):
    if task is not None:
      raise ValueError("run_training(run_config, task=...): the task is built from the "
                       "run config; pass task only with a resolved run "
                       "(run_training(*resolve_run(run_config)))")
    return resolve_run(run)
  if task is None:
    raise ValueError("run_training(resolved): pass the task it was resolved with "
                     "(resolve_run returns both: run_training(*resolve_run(run)))")
  return run, task


def _run_steps(r: _Run, stack: contextlib.ExitStack,
               on_step: Callable[[dict], None] | None) -> float:
  """The evaluation of step 0 (a new run), the rollouts, and every step after
  ``r.start``; when the steps started (``time.time()``)."""
  if r.start == 0:
    _evaluate_start(r)
  _announce(r)
  r.rollouts = _make_rollouts(r)
  stack.callback(r.rollouts.close)
  t0 = time.time()
  stop = stack.enter_context(rf.GracefulStop(announce=True))
  r.looping = True
  for step in range(r.start + 1, r.resolved.steps + 1):
    row = _train_step(r, step)
    _keep_step(r, step, row, stop, on_step)
  return t0


@dataclasses.dataclass
class _Run:
  """What the stages of :func:`run_training` share: built once by :func:`_build`,
  then read, and the few counters (``state``, ``step``, ``skips``, ...) advanced by
  the steps."""
  resolved: Resolved
  procs: Processes
  task: Task
  policy: Policy
  step_fn: Any
  place: Callable[[dict], dict]
  state: Any
  ref_params: Any
  uses_ref: bool
  share: Share | None
  packer: Callable | None
  eval_problems: Any
  clock: PhaseClock
  compiles: CompileLog
  watch: SignalWatch
  t_row: float
  # Opened by _open: the run folder's checkpointer, metrics and sinks, and the resume.
  ckpt: Checkpointer = dataclasses.field(init=False)
  metrics: Any = dataclasses.field(init=False)
  sinks: Any = dataclasses.field(init=False)
  metrics_path: str = dataclasses.field(init=False)
  start: int = dataclasses.field(init=False)
  history: list = dataclasses.field(init=False)
  rollouts: Any = None
  looping: bool = False
  step: int = 0
  skips: int = 0
  applied: int = 0
  last_eval: float | None = None
  t_warm: float = 0.0
  warm_step: int = 0


def _build(resolved: Resolved, task: Task, policy: Policy | None, t_entry: float,
           compiles: CompileLog, stack: contextlib.ExitStack) -> _Run:
  """Checks the devices and the folder and builds everything a run needs; nothing is
  written before the run is built (then ``config.json``, and the checkpoint and
  metrics resumed: :func:`_open`)."""
  procs = Processes()
  resolved.check_devices(jax.device_count(), procs.count)
  _check_run_folder(resolved.io, resolved.identity)
  config = resolved.train
  if policy is None:
    policy = make_policy(resolved, task)
  step_fn = make_train_step(policy.apply, resolved.optimizer.build(), config,
                            trainable=policy.trainable)
  uses_ref, ref_params = _reference(policy, config)
  init_params = policy.init_params
  if resolved.critic_init is not None:
    from jaxrl_llm.loop.setup import warm_start_value_params
    init_params = warm_start_value_params(resolved.critic_init, init_params)
  state = step_fn.init(init_params, rng=jax.random.PRNGKey(resolved.seed))
  step_fn, state, place, mesh = _compile_step(resolved.mesh, resolved.rollout.devices,
                                              step_fn, state)
  share = None
  if procs.multi:          # this process's rows of every step (whole groups)
    batch_rows = resolved.sampling.prompts_per_step * resolved.sampling.group_size
    share = Share(procs, *procs.row_range(batch_rows, mesh))
    share.prompts(resolved.sampling.group_size)
  r = _Run(resolved=resolved, procs=procs, task=task, policy=policy, step_fn=step_fn,
           place=place, state=state, ref_params=ref_params, uses_ref=uses_ref,
           share=share, packer=_packer(resolved),
           eval_problems=task.eval_problems(resolved.io.eval_size),
           clock=PhaseClock(),   # update, eval, save (and setup) seconds since the last row
           compiles=compiles, t_row=t_entry,
           watch=SignalWatch(_signal_window(resolved), last_step=resolved.steps))
  _open(r, stack)
  r.clock.add("setup_s", time.perf_counter() - t_entry)
  return r


def _packer(resolved: Resolved) -> Callable | None:
  """The packer of the train batch with ``--pack`` (several sequences a row: no
  forward/train work on padding); None without."""
  mesh = resolved.mesh
  if not mesh.pack:
    return None
  devices = 1 if mesh.sizes == (1, 1, 1) else len(_train_devices(resolved.rollout.devices))
  return functools.partial(pack_train_batch, config=resolved.train,
                           max_tokens=mesh.pack_tokens, devices=devices)


def _open(r: _Run, stack: contextlib.ExitStack) -> None:
  """Writes the run folder (process 0: every process checked it first), opens the
  checkpointer, resumes, and opens the metrics and the sinks."""
  resolved, procs = r.resolved, r.procs
  io = resolved.io
  procs.barrier("jaxrl_llm/run_built")  # every process checked the folder before any writes
  if procs.primary:
    _write_run_folder(io, resolved.record)  # everything built: the run starts here
  procs.barrier("jaxrl_llm/run_folder_written")
  r.metrics_path = os.path.join(io.out, rf.METRICS_FILE)
  r.ckpt = Checkpointer(os.path.join(io.out, "checkpoints"), max_to_keep=2,
                        log=_say if procs.primary else _silent,
                        stamp={"run": dict(resolved.identity),     # checked on --resume
                               "signal_watch": r.watch.state})
  stack.push(functools.partial(_close_checkpointer, io.out, r))
  r.start, r.history, r.state = _resume(io, resolved.identity, r.ckpt, r.metrics_path,
                                        r.state, procs, r.watch)
  r.step = r.warm_step = r.start
  r.metrics = rf.MetricsWriter(r.metrics_path) if procs.primary else _NoMetrics()
  stack.callback(r.metrics.close)
  from jaxrl_llm.loop.sinks import BackgroundSinks, make_sinks
  # The sinks take the whole run record (W&B keeps it as the run's config).
  r.sinks = make_sinks(resolved.run, warn=_say) if procs.primary else BackgroundSinks([])
  stack.callback(r.sinks.close)


def _signal_window(resolved: Resolved) -> int:
  """Steps without signal before the warning: the groups of a group baseline, else
  the whole batch as one group (as :func:`_train_step` counts them)."""
  sampling = resolved.sampling
  rows = sampling.prompts_per_step * sampling.group_size
  return (signal_window(sampling.prompts_per_step, sampling.group_size)
          if resolved.estimator.group else signal_window(1, rows))


def _reference(policy: Policy, config: TrainConfig) -> tuple[bool, Any]:
  """``(uses_ref, ref_params)``. A frozen copy of the policy's weights (no value head,
  no critic): the train step donates (and so invalidates) the state's buffers. A LoRA
  policy's reference is its frozen base inside the live parameters (no copy,
  ``ref_params`` None: ``policy.ref_params(state.params)`` each step). With kl_mode
  "none" nothing reads a reference: none is kept, none is scored."""
  uses_ref = config.kl_mode != "none"
  if policy.ref_shares_params or not uses_ref:
    return uses_ref, None
  return uses_ref, jax.tree_util.tree_map(jnp.copy, policy.ref_params(policy.init_params))


def _close_checkpointer(out: str, r: _Run, exc_type: Any, exc: Any, tb: Any) -> bool:
  """The checkpointer's exit, by how the run ends: closed when it ends or stops on a
  signal; on Ctrl-C during the steps the last completed step is saved first (a
  multi-process run keeps its last collective checkpoint); on another failure a
  multi-process run leaves it open (orbax may wait for the other processes)."""
  ckpt, procs = r.ckpt, r.procs
  stopped = exc_type is not None and issubclass(exc_type, rf.RunInterrupted)  # saved
  if (exc_type is not None and issubclass(exc_type, KeyboardInterrupt) and not stopped
      and r.looping):
    if procs.multi:     # a collective save needs every process: the last one stands
      _say(f"\n{_interrupted(out, ckpt, 'kept the checkpoint of step')} (a "
           "multi-process run saves only when every process stops)")
      return False
    _save_on_interrupt(out, ckpt, r.state)
    return False
  if exc_type is None or stopped or not procs.multi:
    ckpt.close()
  return False


def _account(r: _Run, row: dict) -> None:
  """Adds the time and memory columns of the interval since the last row."""
  now = time.perf_counter()
  row.update(r.clock.take(), step_s=now - r.t_row, **r.compiles.take(),
             peak_rss_mb=peak_rss_mb())
  r.t_row = now


def _evaluate_start(r: _Run) -> None:
  """Row 0: the greedy evaluation of the starting weights."""
  r.history = [{"step": 0}]
  with r.clock("eval_s"):
    r.history[-1].update(_evaluate(r.policy, r.state.params, r.task, r.eval_problems,
                                   r.procs))
  _account(r, r.history[-1])
  with r.clock("log_s"):
    r.metrics.append(r.history[-1])
    r.sinks.write(r.history[-1])


def _announce(r: _Run) -> None:
  """The start line (process 0, with progress on)."""
  r.last_eval = next((row["eval_accuracy"] for row in reversed(r.history)
                      if "eval_accuracy" in row), None)
  resolved = r.resolved
  if resolved.io.progress and r.procs.primary:
    opt = resolved.optimizer
    rates = f"lr {opt.lr:g}" + (f", value lr {opt.value_lr:g}" if opt.split else "")
    _say(f"{resolved.recipe.name} on {resolved.trains_on} ({resolved.model} model, "
         f"{rates}): steps {r.start + 1}-{resolved.steps}, writing to {resolved.io.out} "
         "(the first step compiles; it takes longest)"
         + ("; eval on training rows" if r.task.eval_on_train_rows else ""))


def _make_rollouts(r: _Run) -> Rollouts:
  """The run's :class:`~jaxrl_llm.loop.rollouts.Rollouts` (in-flight samples of
  partial rollouts are not checkpointed: :mod:`jaxrl_llm.loop.partial`)."""
  resolved, settings = r.resolved, r.resolved.rollout
  if settings.partial:
    from jaxrl_llm.loop.partial import PartialRollouts
    return Partial(PartialRollouts(r.policy, r.task, resolved.sampling, resolved.train,
                                   settings.token_budget, settings.partial_kv))
  if settings.asynchronous:
    from jaxrl_llm.loop.async_rollout import AsyncRollouts
    devices = (jax.devices()[len(_train_devices(settings.devices)):] if settings.devices
               else None)
    rollouts = Async(AsyncRollouts(
        resolved, r.task, r.policy, max_staleness=settings.max_staleness,
        first_step=r.start + 1, last_step=resolved.steps, seed=resolved.seed,
        devices=devices))
    rollouts.publish(r.state.params, r.start)
    return rollouts
  return InStep()


def _train_step(r: _Run, step: int) -> dict:
  """One RL step: rollouts -> batch -> update -> the step's metrics row (eval and the
  time and memory columns included)."""
  resolved, policy = r.resolved, r.policy
  rng_np = np.random.default_rng([resolved.seed, step])
  key = jax.random.fold_in(jax.random.PRNGKey(resolved.seed), step)
  t_step = time.time()
  drawn, extra = r.rollouts.take(step, r.state.params, rng_np, key)
  scored: dict = {}
  ref = (policy.ref_params(r.state.params) if r.uses_ref and r.ref_params is None
         else r.ref_params)
  batch, stats = build_batch(resolved, r.task, policy, r.procs.local(r.state.params),
                             ref, rng_np, key, drawn=drawn, share=r.share,
                             info=scored, packer=r.packer)
  if drawn is not None:    # generated by the caller (greedy ones of self-critical here)
    from jaxrl_llm.loop.partial import behaviour_kl
    kl = ({"behaviour_kl": behaviour_kl(batch)} if "old_logp" in batch
          else {})                 # (old_logp_from_step: no forward before the update)
    stats.update(extra, **kl,
                 generate_s=extra.get("generate_s", 0.0) + stats.get("generate_s", 0.0))
  with r.clock("update_s"):
    r.state, m = r.step_fn(r.state, r.place(batch))
    jax.block_until_ready((r.state, m))     # the phase's own time (waiting changes nothing)
  r.rollouts.publish(r.state.params, step)
  row = {"step": step, **stats, **policy.rollout_stats(),
         **{k: float(host_value(val)) for k, val in m.items()},
         "time_s": time.time() - t_step}
  if step <= resolved.critic_warmup_steps:
    row["critic_warmup"] = 1.0     # the policy is frozen (OptimizerSettings)
  group = resolved.sampling.group_size if resolved.estimator.group else len(
      scored["scores"])            # a batch-wide baseline
  warning = r.watch.update(step, scored["scores"], group_size=group,
                           grad_norm=row.get("grad_norm"),
                           accuracy=float(np.mean(scored["exact"])),
                           truncated=row.get("truncated_frac"),
                           unparsed=row.get("unparsed_frac"))
  if warning is not None:          # once per run (loop.signals)
    row["no_learning_signal_steps"] = float(r.watch.streak)
    _say(warning)
  if step % resolved.io.eval_every == 0 or step == resolved.steps:
    with r.clock("eval_s"):
      row.update(_evaluate(policy, r.state.params, r.task, r.eval_problems, r.procs))
  for phase in PHASES:
    row.setdefault(phase, 0.0)
  _account(r, row)
  return row


def _keep_step(r: _Run, step: int, row: dict, stop: rf.GracefulStop,
               on_step: Callable[[dict], None] | None) -> None:
  """After a step: its row logged, the skip count, a checkpoint when due, progress,
  ``on_step``, and a stop signal from any process acted on."""
  resolved, io, ckpt = r.resolved, r.resolved.io, r.ckpt
  r.step = step
  r.history.append(row)
  with r.clock("log_s"):            # after the row's time was taken: in the next row
    r.metrics.append(row)
    r.sinks.write(row)              # queued: the sinks' thread writes (loop.sinks)
  r.last_eval = row.get("eval_accuracy", r.last_eval)
  skipped = step_skipped(row, r.resolved.train)
  ckpt.note_step(skipped)       # a restored state that never learns is not saved again
  r.skips = r.skips + 1 if skipped else 0
  r.applied += 0 if skipped else 1
  if r.skips >= io.max_consecutive_skips:
    raise SkippedUpdatesError(
        f"stopped at step {step}: every update of the last {r.skips} steps was "
        "skipped (non-finite loss, gradients or state; see 'skipped' in "
        f"{r.metrics_path}); lower --lr or check the rewards. The last good "
        f"checkpoint is in {ckpt.directory} (step {ckpt.latest_step()}).")
  if step % io.save_every == 0 or step == resolved.steps:
    with r.clock("save_s"):     # after the row (fsynced first): in the next row
      ckpt.save(step, r.state, extra={"step": step})
  if step == r.start + 1:
    r.t_warm, r.warm_step = time.time(), step
  if r.procs.primary:
    with r.clock("log_s"):
      report_progress(resolved.run, step, row, r.t_warm, r.warm_step,  # the whole record
                      last_eval=r.last_eval)
  if on_step is not None:
    on_step(row)
  # Every process acts on a signal any of them received (a collective).
  signum = r.procs.agree_stop(stop.signum)
  if signum and step < resolved.steps:
    name = _signame(signum) + ("" if signum == stop.signum else " (on another "
                               "process of this job)")
    _save_now(io.out, ckpt, r.state, step, name)
    raise rf.RunInterrupted(signum, f"stopped by {name} at step {step}")


def _finish(r: _Run, kept: list, wall_s: float) -> dict:
  """The run's summary (after every resource was closed)."""
  resolved = r.resolved
  if resolved.io.progress and r.procs.primary:
    end_progress_line()
  if r.step > r.start and r.applied == 0:
    raise SkippedUpdatesError(
        f"every update of steps {r.start + 1}-{r.step} was skipped (non-finite loss, "
        f"gradients or state; see 'skipped' in {r.metrics_path}): nothing was learned.")
  summary = summarize(r.history, wall_s, resolved)
  summary.update(phase_summary([row for row in r.history if row["step"] > r.start],
                               final_save_s=r.clock.take().get("save_s", 0.0)))
  if r.watch.warned is not None:
    summary["warning"] = r.watch.warned.removeprefix("warning: ")
  summary["metrics_file"] = r.metrics_path
  summary["checkpoints"] = f"{r.ckpt.directory} (steps {', '.join(map(str, kept))})"
  return summary


def _evaluate(policy: Policy, params, task, problems, procs: Processes) -> dict:
  """:func:`evaluate`, split over the processes of a multi-process run."""
  if not procs.multi:
    return evaluate(policy, params, task, problems)
  return evaluate(policy, procs.local(params), task, problems, procs=procs)


def step_skipped(row: dict, config: TrainConfig) -> bool:
  """True when the train step of metrics ``row`` applied none of its updates.

  ``row["skipped"]`` counts the step's skipped updates (of ``num_epochs *
  num_minibatches``; non-finite values): a step that skipped only some still learned.

  Examples:
    >>> config = TrainConfig(num_minibatches=2)
    >>> step_skipped({"skipped": 1.0}, config), step_skipped({"skipped": 2.0}, config)
    (False, True)
  """
  updates = config.num_epochs * config.num_minibatches
  return row.get("skipped", 0) >= updates - 0.5    # a float count (a mean times updates)


def _resume(io: IOSettings, identity: Mapping[str, Any], ckpt: Checkpointer,
            metrics_path: str, state, procs: Processes | None = None,
            watch: SignalWatch | None = None):
  """``(start step, kept metrics rows, state)``: the newest checkpoint that verifies.

  The metrics rows after that step (computed again by this run), a torn last line and
  rows a resume cannot trust (a step not an int, duplicated or out of order) are
  dropped by an atomic rewrite, said in one note; the rows up to it are kept. In a
  multi-process run every process restores (its shards, a collective) and process 0
  alone touches the metrics file (the others keep no rows). ``watch`` continues the
  learning-signal streak saved with the step (a fresh one when none was saved).
  """
  primary = procs is None or procs.primary
  say = _say if primary else _silent
  start, keep_upto = 0, -1
  if io.resume and ckpt.all_steps():
    state, extra = ckpt.restore(state, check=functools.partial(
        step_problem, identity=dict(identity)))     # the folder's step, of this run
    start = keep_upto = int(extra["step"])
    say(f"resuming from step {start} ({ckpt.directory}/{ckpt.restored_step})")
    if watch is not None:
      watch.restore(extra.get("signal_watch"), start)
  elif io.resume:
    say(f"no checkpoint in {ckpt.directory}: starting from step 0")
  if not primary:
    return start, [], state
  history, note = rf.prepare_metrics(metrics_path, keep_upto=keep_upto)
  if note is not None and keep_upto >= 0:
    _say(note)
  return start, history, state


def _save_now(out: str, ckpt: Checkpointer, state, step: int, why: str) -> None:
  """Checkpoints the completed ``step`` (on a signal) and says where (``out``: the run
  folder)."""
  if step not in ckpt.all_steps():
    ckpt.save(step, state, extra={"step": step}, force=True)
  _say(f"{why}: checkpoint saved at step {ckpt.latest_step()} in {ckpt.directory}; "
       f"continue with --resume --out {out}")


def _save_on_interrupt(out: str, ckpt: Checkpointer, state) -> None:
  """Saves the last completed step. If the interrupt hit inside the donated step
  call, ``state`` is gone and the latest periodic checkpoint stands."""
  try:
    done = int(state.step)
    if done > 0 and done not in ckpt.all_steps():
      ckpt.save(done, state, extra={"step": done}, force=True)
    note = _interrupted(out, ckpt, "checkpoint saved at step")
  except Exception:  # noqa: BLE001 - deleted buffers raise a runtime error
    note = _interrupted(out, ckpt, "kept the checkpoint of step")
  ckpt.close()
  _say(note)


def _interrupted(out: str, ckpt: Checkpointer, saved: str) -> str:
  """The line an interrupted run ends with: its newest checkpoint (``saved`` says how
  it came to be), or that it has none (stopped before a step completed)."""
  latest = ckpt.latest_step()
  if latest is None:
    return (f"interrupted: no checkpoint in {out} (no step was completed and saved; "
            "a new run starts from step 0)")
  return f"interrupted: {saved} {latest} in {out}"


def summarize(history: list[dict], wall_s: float, run: RunConfig | Resolved) -> dict:
  """The summary of a run's metrics rows ``history``: its algorithm, what it trained
  on, the steps, the wall time, the first and last evaluations and the mean reward of
  the last 10 steps. ``run``: the run, resolved or as configured."""
  trains_on: str | None
  if isinstance(run, Resolved):
    algo, trains_on = run.recipe.name, run.trains_on
  else:
    algo, trains_on = run.algo, run.task if run.dataset is None else run.dataset
  evals = [r for r in history if "eval_accuracy" in r]
  steps = [r for r in history if "reward" in r]
  summary = {
      "algo": algo, "task": trains_on,
      "steps": steps[-1]["step"] if steps else 0,
      "wall_s": round(wall_s, 1),
      "eval_accuracy_start": evals[0]["eval_accuracy"] if evals else math.nan,
      "eval_accuracy_end": evals[-1]["eval_accuracy"] if evals else math.nan,
      "eval_reward_start": evals[0]["eval_reward"] if evals else math.nan,
      "eval_reward_end": evals[-1]["eval_reward"] if evals else math.nan,
      "train_reward_last10": float(np.mean([r["reward"] for r in steps[-10:]]))
      if steps else math.nan,
  }
  return summary


def format_summary(summary: dict) -> str:
  width = max(len(k) for k in summary)
  lines = ["-" * (width + 16)]
  for k, val in summary.items():
    val = f"{val:.4f}" if isinstance(val, float) else str(val)
    lines.append(f"{k:<{width}}  {val}")
  lines.append("-" * (width + 16))
  return "\n".join(lines)


__all__ = ["run_training", "SkippedUpdatesError", "summarize", "format_summary",
           "step_skipped"]
