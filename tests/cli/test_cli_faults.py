"""Real faults on the real command: kill -9 and SIGTERM mid-run, then ``--resume``.

One uninterrupted run and one run that is killed with SIGKILL, resumed, stopped with
SIGTERM, and resumed again. The interrupted run must end bit-identical to the
uninterrupted one (the exact checksums of the whole final train state, recorded with
its checkpoint, are equal), with every step of ``metrics.jsonl`` present once and
equal, and strict JSON throughout.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from jaxrl_llm.loop.accounting import comparable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 6
FLAGS = ["--algo", "ppo", "--steps", str(STEPS), "--prompts-per-step", "4",
         "--group-size", "2", "--eval-size", "8", "--eval-every", "3", "--save-every",
         "2", "--no-progress"]


def _env():
  return dict(os.environ, JAX_PLATFORMS="cpu",
              PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _cmd(out, *extra):
  return [sys.executable, "-m", "jaxrl_llm", "train", *FLAGS, "--out", str(out), *extra]


def _rows(out):
  def refuse(token):
    raise AssertionError(f"non-strict JSON token {token} in metrics.jsonl")

  path = os.path.join(out, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    lines = f.read().splitlines()
  rows = []
  for line in lines:
    try:
      rows.append(json.loads(line, parse_constant=refuse))
    except json.JSONDecodeError:
      break                                     # a torn last line while running
  return rows


def _run_until(out, step, sig, *extra):
  """Starts a run and sends ``sig`` once this run has written ``step``'s row (a
  resumed run first drops the rows after its checkpoint, so wait for that)."""
  stale = any(r.get("step") == step for r in _rows(out))
  proc = subprocess.Popen(_cmd(out, *extra), env=_env(), cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  try:
    deadline = time.time() + 900
    while time.time() < deadline and proc.poll() is None:
      present = any(r.get("step") == step for r in _rows(out))
      if stale and not present:
        stale = False
      elif present and not stale:
        proc.send_signal(sig)
        break
      time.sleep(0.05)
    stdout, stderr = proc.communicate(timeout=900)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  return proc.returncode, stdout, stderr


def _final_checksums(out):
  path = os.path.join(out, "checkpoints", str(STEPS), "verify", "metadata")
  with open(path) as f:
    record = json.load(f)
  return record["paths"], record["checksums"]


def _comparable(rows):
  return [comparable(r) for r in rows]       # without the time and memory columns


@pytest.mark.slow
def test_sigkill_and_sigterm_then_resume_is_bit_identical(tmp_path):
  full = tmp_path / "full"
  done = subprocess.run(_cmd(full), env=_env(), cwd=ROOT, capture_output=True,
                        text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]

  run = tmp_path / "interrupted"
  code, _, err = _run_until(run, 3, signal.SIGKILL)
  assert code == -signal.SIGKILL, err[-3000:]
  assert [r["step"] for r in _rows(run)][:4] == [0, 1, 2, 3]

  # SIGTERM (what SLURM / Kubernetes / preemptible VMs send) once step 3 is done
  # again: the step in flight finishes, is checkpointed, and the process exits.
  code, _, err = _run_until(run, 3, signal.SIGTERM, "--resume")
  assert code == 128 + signal.SIGTERM, err[-3000:]
  assert "resuming from step 2" in err, err[-3000:]
  saved = re.search(r"checkpoint saved at step (\d+)", err)
  assert saved and int(saved.group(1)) in (3, 4), err[-3000:]
  at = int(saved.group(1))
  assert os.path.isdir(run / "checkpoints" / str(at))

  done = subprocess.run(_cmd(run, "--resume"), env=_env(), cwd=ROOT,
                        capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  assert f"resuming from step {at}" in done.stderr

  full_rows, run_rows = _rows(full), _rows(run)
  assert [r["step"] for r in run_rows] == list(range(STEPS + 1))   # none lost or doubled
  assert _comparable(run_rows) == _comparable(full_rows)
  assert _final_checksums(run) == _final_checksums(full)


# ------------------------------------------------- user mistakes: one line, no traces


def _cli(*argv, env=None, timeout=300):
  return subprocess.run([sys.executable, "-m", "jaxrl_llm", *argv], cwd=ROOT,
                        env=env or _env(), capture_output=True, text=True, timeout=timeout)


def _one_line_error(done, *parts):
  assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
  errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
  for part in parts:
    assert part in errors[0], (part, errors[0])
  return errors[0]


def _main(capsys, *argv):
  """The command in this process (no import cost): ``(exit code, stdout, stderr)``."""
  from jaxrl_llm.cli import main
  code = main(list(argv))
  out, err = capsys.readouterr()
  return subprocess.CompletedProcess(argv, code, out, err)


@pytest.mark.parametrize("flags,parts", [
    (["--eval-every", "0"], ["--eval-every must be >= 1 (got 0)"]),
    (["--save-every", "-5"], ["--save-every must be >= 1"]),
    (["--num-minibatches", "3"], ["--prompts-per-step 32 x --group-size 8 = 256",
                                  "--num-minibatches 3"]),
    (["--fsdp", "3"], ["--data 1 x --fsdp 3 x --tensor 1 needs ",
                       "devices; this host has"]),
    (["--data", "0"], ["--data must be >= 1 or -1"]),
    (["--temperature", "0"], ["--temperature"]),
    (["--algo", "dapo", "--overlong-buffer", "8"],
     ["--overlong-buffer 8 is longer than the task's response budget of 4 tokens"]),
    (["--critic-init", "/"], ["--critic-init '/':", "config.json is missing"]),
    # settings the recipe's train step would crash on or silently ignore
    (["--algo", "ppo", "--no-use-value"],
     ["--no-use-value: --algo ppo computes its advantages in the train step"]),
    (["--algo", "vapo", "--lam", "0.9"],
     ["--lam 0.9 is not used by --advantage-estimator vapo_gae",
      "--advantage-estimator decoupled_gae"]),
    (["--algo", "ppo", "--lam-value", "0.9"],
     ["--lam-value 0.9 is not used by --advantage-estimator gae", "decoupled_gae"]),
    (["--algo", "ppo", "--hybrid-mix", "0.3"],
     ["--hybrid-mix 0.3 is not used by --advantage-estimator gae", "hybrid"]),
    (["--algo", "vapo", "--hybrid-mix", "0.3"],
     ["--hybrid-mix 0.3 is not used by --advantage-estimator vapo_gae"]),
    (["--critic", "policy"], ["--critic policy needs a recipe with a value model "
                              "(--algo grpo has none"]),
    (["--algo", "dapo", "--value-lr", "0.01"],
     ["--value-lr 0.01 needs a recipe with a value model (--algo dapo has none"]),
    (["--critic-warmup-steps", "2"], ["--critic-warmup-steps 2 needs a recipe with a value"]),
    # issue 41 item 11: a warm-up as long as the run trained no policy, without a word
    (["--algo", "ppo", "--critic-warmup-steps", "5", "--steps", "5"],
     ["--critic-warmup-steps 5 >= --steps 5: every step would train only the value "
      "function", "choose --critic-warmup-steps below --steps"]),
    (["--algo", "rloo", "--hybrid-n", "3"],
     ["--hybrid-n 3 sets the in-step advantage estimator, but --algo rloo computes"]),
    (["--advantage-estimator", "gae"], ["--advantage-estimator gae sets the in-step"]),
    (["--kl-mode", "reward"], ["--kl-mode reward puts the KL into the token rewards, but "
                               "--algo grpo computes", "use --kl-mode loss"]),
])
def test_flag_mistakes_are_one_line_errors_and_write_nothing(capsys, tmp_path, flags,
                                                             parts):
  out = tmp_path / "run"
  _one_line_error(_main(capsys, "train", *flags, "--out", str(out)), *parts)
  assert not out.exists()                      # a failed start leaves nothing behind


@pytest.mark.parametrize("alias,value", [("--clip", "0.1"), ("--recipe", "ppo"),
                                         ("--lam-policy", "0.9"), ("--critic-lr", "1e-4")])
def test_the_removed_flag_aliases_are_argparse_errors(capsys, alias, value):
  """--clip, --recipe, --lam-policy and --critic-lr are gone (--clip-low, --algo, --lam
  and --value-lr are the flags)."""
  from jaxrl_llm.cli import build_parser
  with pytest.raises(SystemExit) as info:
    build_parser().parse_args(["train", alias, value])
  assert info.value.code == 2
  err = capsys.readouterr().err
  assert alias in err and ("unrecognized arguments" in err or "ambiguous option" in err)


def test_a_real_command_line_mistake_is_one_line(tmp_path):
  out = tmp_path / "run"
  done = _cli("train", "--eval-every", "0", "--out", str(out))
  error = _one_line_error(done, "--eval-every must be >= 1")
  assert done.stderr.strip().splitlines() == [error]   # no note of a start that fails
  assert not out.exists()


def test_train_is_the_default_command_with_flags_too(capsys, tmp_path):
  from jaxrl_llm.cli import COMMANDS, build_parser
  out = tmp_path / "run"
  done = _one_line_error(_main(capsys, "--eval-every", "0", "--out", str(out)),
                         "--eval-every must be >= 1 (got 0)")
  assert "invalid choice" not in done
  assert not out.exists()
  for argv in (["--help"], ["-h"]):                  # alone: the top-level help
    with pytest.raises(SystemExit) as info:
      _main(capsys, *argv)
    assert info.value.code == 0
    assert "{train,eval,plot,export,serve}" in capsys.readouterr().out
  with pytest.raises(SystemExit):
    _main(capsys, "--steps", "3", "--help")          # after a train flag: train's help
  assert "--policy-loss" in capsys.readouterr().out
  sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
  assert tuple(sub.choices) == COMMANDS


def test_eval_and_plot_say_what_is_missing_where(capsys, tmp_path):
  missing = tmp_path / "nope"
  _one_line_error(_main(capsys, "eval", "--out", str(missing)),
                  f"{missing} does not exist")
  empty = tmp_path / "empty"
  empty.mkdir()
  _one_line_error(_main(capsys, "eval", "--out", str(empty)), "not a run folder",
                  f"{empty}/config.json is missing")
  (empty / "config.json").write_text("{}")
  _one_line_error(_main(capsys, "eval", "--out", str(empty)), "has no checkpoint yet",
                  f"{empty}/checkpoints")
  _one_line_error(_main(capsys, "plot", str(missing)), f"run folder {missing} does not")
  _one_line_error(_main(capsys, "plot", str(empty)), f"{empty} has no metrics.jsonl")
  (empty / "metrics.jsonl").write_text("")
  _one_line_error(_main(capsys, "plot", str(empty)), "holds no rows yet")
  _one_line_error(_main(capsys, "plot", str(empty), "--labels", "a", "b"),
                  "2 labels for 1 run")


def test_plot_on_binary_garbage_says_it_is_not_a_metrics_file(capsys, tmp_path):
  for name, garbage in (("a", bytes(range(256)) * 8), ("b", b"\x00\x01\x02\xff data")):
    run = tmp_path / name
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(garbage)
    _one_line_error(_main(capsys, "plot", str(run), "-o", str(tmp_path / "c.png")),
                    f"{run}/metrics.jsonl is not a metrics file: line 1 is binary data")


def test_plot_tolerates_a_torn_line_and_explains_a_missing_matplotlib(capsys, tmp_path):
  run = tmp_path / "run"
  run.mkdir()
  (run / "metrics.jsonl").write_text(
      '{"step": 0, "eval_accuracy": 0.1}\n{"step": 1, "reward": 0.5, "loss": null}\n'
      '{"step": 2, "rew')
  png = tmp_path / "c.png"
  done = _main(capsys, "plot", str(run), "-o", str(png))
  assert done.returncode == 0, done.stderr[-3000:]
  assert "line 3 is incomplete (torn write)" in done.stderr and png.stat().st_size > 1000
  fake = tmp_path / "fake"
  (fake / "matplotlib").mkdir(parents=True)
  (fake / "matplotlib" / "__init__.py").write_text(
      "raise ImportError(\"No module named 'matplotlib'\")\n")
  env = dict(_env(), PYTHONPATH=str(fake) + os.pathsep + _env()["PYTHONPATH"])
  _one_line_error(_cli("plot", str(run), "-o", str(png), env=env),
                  "drawing needs matplotlib", "pip install matplotlib")


def _saved_run(tmp_path, algo="ppo", name="run", **fields):
  from jaxrl_llm import run_folder as rf
  from jaxrl_llm.loop.config import RunConfig
  out = tmp_path / name
  out.mkdir()
  run = RunConfig(out=str(out), algo=algo, steps=10, lr=0.01, **fields)
  rf.write_json(str(out / "config.json"), __import__("dataclasses").asdict(run))
  return str(out)


def _resumed(argv):
  from jaxrl_llm.cli import _resume_config, build_parser
  args = build_parser().parse_args(["train", *argv])
  return _resume_config(args, argv)


def test_resume_alone_continues_the_saved_run_and_names_contradictions(tmp_path):
  out = _saved_run(tmp_path, train={"kl_coef": 0.05})
  run = _resumed(["--out", out, "--resume"])          # algo, lr, kl_coef: all saved
  assert (run.algo, run.lr, run.steps, run.train, run.resume) == (
      "ppo", 0.01, 10, {"kl_coef": 0.05}, True)
  run = _resumed(["--out", out, "--resume", "--steps", "20", "--eval-every", "5"])
  assert (run.steps, run.eval_every, run.lr) == (20, 5, 0.01)   # resumable: changed
  run = _resumed(["--out", out, "--resume", "--lr", "0.01", "--kl-coef", "0.05"])
  assert run.lr == 0.01                                # restating the saved value is fine
  with pytest.raises(ValueError) as info:
    _resumed(["--out", out, "--resume", "--lr", "0.5", "--algo", "grpo",
              "--kl-coef", "0.1"])
  msg = str(info.value)
  assert "--algo grpo (the saved run has ppo)" in msg and "--lr 0.5 (the saved" in msg
  assert "--kl-coef 0.1 (the saved run has 0.05)" in msg and "Only --steps" in msg
  assert "\n" not in msg


@pytest.mark.parametrize("algo,fields,same,other,message", [
    ("dapo", {}, ["--dynamic-sampling", "--overlong-buffer", "0", "--clip-high", "0.28"],
     ["--no-dynamic-sampling"], "--dynamic-sampling False (the saved run has True)"),
    ("dapo", {}, ["--overlong-buffer", "0"], ["--overlong-buffer", "2"],
     "--overlong-buffer 2 (the saved run has 0)"),
    ("dapo", {}, [], ["--clip-high", "none"], "--clip-high None (the saved run has 0.28)"),
    ("vapo", {}, ["--critic-warmup-steps", "10", "--value-lr", "0.02"],
     ["--critic-warmup-steps", "5"], "--critic-warmup-steps 5 (the saved run has 10)"),
    ("vapo", {}, ["--critic-warmup-steps", "none"], ["--value-lr", "0.01"],
     "--value-lr 0.01 (the saved run has 0.02)"),
    ("ppo", {"train": {"policy_loss": "sapo"}}, ["--tau-pos", "1.0", "--tau-neg", "1.05"],
     ["--tau-pos", "2"], "--tau-pos 2.0 (the saved run has 1.0)"),
    # --hybrid-n alone selects the hybrid estimator: that is a change, named as such
    ("ppo", {}, ["--lam", "0.95"], ["--hybrid-n", "4"],
     "--advantage-estimator hybrid (the saved run has gae)"),
])
def test_resume_accepts_restating_the_value_the_saved_run_uses(tmp_path, algo, fields, same,
                                                               other, message):
  """Recipe-defaulted run fields and loss hyperparameters are saved as None: restating
  the value the run uses (the recipe's, lr x value_lr_scale, the overlong buffer, the
  loss's default) is no contradiction; another value is, with the value the run uses."""
  out = _saved_run(tmp_path, algo=algo, **fields)
  run = _resumed(["--out", out, "--resume", *same])
  assert run.algo == algo and run.resume and run.train == fields.get("train", {})
  with pytest.raises(ValueError) as info:
    _resumed(["--out", out, "--resume", *other])
  assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.slow
def test_training_that_skips_every_update_says_so_and_fails(tmp_path):
  out = tmp_path / "run"
  # The sizes of test_trainer's SMALL runs: their compiled programs are cached.
  done = _cli("train", "--temperature", "1e-30", "--steps", "2", "--prompts-per-step",
              "4", "--group-size", "2", "--eval-size", "8", "--eval-every", "2",
              "--out", str(out), "--no-progress", timeout=900)
  assert done.returncode == 1, done.stderr[-3000:]
  assert "error: every update of steps 1-2 was skipped" in done.stderr, done.stderr[-3000:]
  assert "Traceback" not in done.stderr
  assert [r["step"] for r in _rows(out)] == [0, 1, 2]          # metrics kept, strict


def test_an_unwritable_checkpoint_folder_stops_the_run_before_any_compute(capsys, tmp_path):
  """Issue 28, fault 4: found at start-up, not at the first save after the compute."""
  from tests.utils import make_unwritable_folder
  out = tmp_path / "run"
  out.mkdir()
  make_unwritable_folder(out / "checkpoints")
  done = _main(capsys, "train", "--steps", "2", "--save-every", "2", "--prompts-per-step",
               "4", "--group-size", "2", "--eval-size", "8", "--out", str(out),
               "--no-progress")
  assert done.returncode == 1, done.stderr[-3000:]
  errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
  assert errors[0].startswith(f"error: checkpoint folder {out}/checkpoints is not "
                              "writable: "), errors[0]
  assert sorted(os.listdir(out)) == ["checkpoints"]     # no config.json, no metrics


@pytest.mark.slow
def test_a_record_less_garbage_checkpoint_costs_no_verified_one(capsys, tmp_path):
  """Issue 28, fault 1, on the command: a resumed run from a checkpoint without a
  verification record that holds finite garbage says so, saves nothing while its every
  update is skipped, and keeps the last verified checkpoint (before: it saved the
  garbage at step 6 with a fresh record and rotation deleted step 2)."""
  import jax
  import jax.numpy as jnp
  import orbax.checkpoint as ocp
  out = tmp_path / "run"
  small = ["--algo", "grpo", "--prompts-per-step", "4", "--group-size", "2",
           "--eval-size", "4", "--eval-every", "100", "--save-every", "2", "--no-progress",
           "--out", str(out)]
  assert _main(capsys, "train", "--steps", "4", *small).returncode == 0
  folder = str(out / "checkpoints")
  manager = ocp.CheckpointManager(folder)
  state = manager.restore(4, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
  garbage = jax.tree_util.tree_map(
      lambda x: x * 1e30 if jnp.issubdtype(x.dtype, jnp.floating) else x, state["state"])
  manager.delete(4)                                 # step 4 as an older version wrote it
  manager.save(4, args=ocp.args.Composite(state=ocp.args.StandardSave(garbage),
                                          extra=ocp.args.JsonSave({"step": 4})))
  manager.wait_until_finished()
  manager.close()
  done = _main(capsys, "train", "--resume", "--steps", "8", "--max-consecutive-skips", "3",
               "--out", str(out))
  assert done.returncode == 1, done.stderr[-3000:]
  lines = done.stderr.splitlines()
  assert f"checkpoint {folder}/4 has no verification record (saved before records " \
         "existed, or its verify/ folder is missing): restored it checked only against " \
         "the template and for finite values" in lines, lines
  assert f"not saving step 6: every update since the restore of step 4 was skipped " \
         "(non-finite values), so its state is the restored one; " \
         f"{folder}/4 stays the newest checkpoint" in lines, lines
  assert lines[-1].startswith("error: stopped at step 7: every update of the last 3 "
                              "steps was skipped"), lines
  assert sorted(os.listdir(folder), key=int) == ["2", "4"]     # step 2 is still there


@pytest.mark.slow
def test_ctrl_c_twice_on_the_command_keeps_the_save_and_prints_no_traceback(tmp_path):
  """Issue 28, fault 2, on the real command: Ctrl-C once after step 2, and again as
  soon as the checkpoint it asked for is being written. (When the second one comes
  after the write, it stops at once; either way nothing is torn.) The direct test of
  a SIGINT inside orbax's write is test_checkpoint's."""
  out = tmp_path / "run"
  cmd = [sys.executable, "-m", "jaxrl_llm", "train", "--algo", "grpo", "--steps", "6",
         "--prompts-per-step", "4", "--group-size", "2", "--eval-size", "4",
         "--eval-every", "100", "--save-every", "100", "--no-progress", "--out", str(out)]
  proc = subprocess.Popen(cmd, env=_env(), cwd=ROOT, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE)
  hit = False
  try:
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
      if any(r.get("step") == 2 for r in _rows(out)):
        proc.send_signal(signal.SIGINT)
        break
      time.sleep(0.02)
    folder = out / "checkpoints"
    while time.time() < deadline and proc.poll() is None:
      names = os.listdir(folder) if folder.is_dir() else []
      if any(".orbax-checkpoint-tmp" in n for n in names) or any(n.isdigit() for n in names):
        hit = any(".orbax-checkpoint-tmp" in n for n in names)
        proc.send_signal(signal.SIGINT)
        break
      time.sleep(0.001)
    _, err = proc.communicate(timeout=600)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
  assert "Traceback" not in err and "ERROR:absl" not in err, err[-3000:]
  names = os.listdir(out / "checkpoints")
  assert len(names) == 1 and names[0].isdigit(), names       # the save, and no temp folder
  lines = [line for line in err.splitlines() if line]
  after = lines[lines.index("received SIGINT: finishing the current step, saving a "
                            "checkpoint, then exiting (Ctrl-C again to stop at once)") + 1:]
  assert after[-1] == f"curves: {out}/curves.png", after    # the interrupted run's curves
  after = after[:-1]
  step = names[0]
  assert "orbax" not in err, err[-3000:]
  held = (f"Ctrl-C: the checkpoint of step {step} is being written; the interrupt takes "
          "effect once it is complete")
  saved = (f"SIGINT: checkpoint saved at step {step} in {out}/checkpoints; continue with "
           f"--resume --out {out}")
  assert after in (
      [held, saved],                                # the second Ctrl-C came during the write
      [saved],                                      # ... after it, while the run stopped
      [f"interrupted: checkpoint saved at step {step} in {out}"]), after   # ... just after
  print("second Ctrl-C during the write:", hit, after)
  done = subprocess.run(cmd + ["--resume"], env=_env(), cwd=ROOT, capture_output=True,
                        text=True, timeout=600)
  assert done.returncode == 0 and f"resuming from step {names[0]}" in done.stderr, \
      done.stderr[-3000:]


@pytest.mark.slow
def test_a_disk_that_fills_up_mid_run_is_one_line_with_the_os_cause(tmp_path):
  """Issue 28, fault 3, on the real command and a real full disk (a 70 MiB tmpfs, so
  root only): the disk is filled after step 1, and step 2's checkpoint cannot be
  written. Before: 114 lines of orbax background-thread logs and 2 tracebacks, then a
  line cut before the cause, and the temporary folder left on the full disk."""
  mnt = tmp_path / "disk"
  mnt.mkdir()
  mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=70m", "tmpfs", str(mnt)],
                           capture_output=True)
  if mounted.returncode != 0:
    pytest.skip("cannot mount a small tmpfs here (needs root); test_checkpoint's "
                "RLIMIT_FSIZE test covers the save path")
  try:
    out = mnt / "run"
    cmd = [sys.executable, "-m", "jaxrl_llm", "train", "--algo", "grpo", "--steps", "4",
           "--prompts-per-step", "4", "--group-size", "2", "--eval-size", "4",
           "--eval-every", "100", "--save-every", "2", "--no-progress", "--out", str(out)]
    proc = subprocess.Popen(cmd, env=_env(), cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
      deadline = time.time() + 600
      while time.time() < deadline and proc.poll() is None:
        if any(r.get("step") == 1 for r in _rows(out)):
          _fill(mnt / "filler", leave=256 << 10)          # 256 KiB for metrics rows
          break
        time.sleep(0.02)
      _, err = proc.communicate(timeout=600)
    finally:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
    left = sorted(os.listdir(out / "checkpoints"))
  finally:
    subprocess.run(["umount", str(mnt)], check=True)
  assert proc.returncode == 1, err[-3000:]
  assert "Traceback" not in err and "absl" not in err and "asyncio" not in err, err[-3000:]
  assert err.splitlines()[-1] == (
      f"error: cannot save checkpoint step 2 in {out}/checkpoints: no space left on "
      "device (ENOSPC); free some space or choose another --out"), err[-3000:]
  assert left == []                                 # no temporary folder left behind


def _fill(path, leave: int) -> None:
  """Fills the disk holding ``path`` up to ENOSPC in 1 MiB writes, then frees ``leave``
  bytes. Writing until the OS refuses (instead of one write sized by ``statvfs``) stays
  right while the run writes to the same disk."""
  with open(path, "wb", buffering=0) as f:
    try:
      while True:
        f.write(b"\0" * (1 << 20))
    except OSError as e:
      if e.errno != errno.ENOSPC:
        raise
    f.truncate(max(0, os.path.getsize(path) - leave))


def _step_records(folder, step, value):
  """Writes ``{"step": value}`` as the step record of checkpoint ``step``: the extra file,
  and (``value`` a pair) also the copy in the verification record."""
  import pathlib
  pathlib.Path(folder, str(step), "extra", "metadata").write_text(json.dumps(
      {"step": value[0] if isinstance(value, tuple) else value}))
  if isinstance(value, tuple):
    verify = pathlib.Path(folder, str(step), "verify", "metadata")
    record = json.loads(verify.read_text())
    record["extra"] = {"step": value[0]}
    verify.write_text(json.dumps(record))


@pytest.mark.slow     # 18-24 s on 2 cores (several runs and resumes)
def test_a_step_record_that_disagrees_falls_back_or_refuses_in_one_line(capsys, tmp_path):
  """Reliability issue, item 1: ``{"step": 99999}`` in ``checkpoints/2/extra/metadata``
  made ``--resume`` train nothing and exit 0; ``{"step": 1}`` there dropped the metrics
  rows after step 1 and retrained from step 2's parameters and Adam state. Now the
  record covers the extra file and the step is checked against the folder's name and
  the state's step counter: the resume falls back to step 1 (one line), or, with no
  step left, refuses in one line."""
  import shutil
  base = tmp_path / "base"
  small = ["--algo", "grpo", "--prompts-per-step", "4", "--group-size", "2",
           "--eval-size", "4", "--eval-every", "100", "--save-every", "1", "--no-progress"]
  assert _main(capsys, "train", "--steps", "2", *small, "--out", str(base)).returncode == 0
  from jaxrl_llm import run_folder as rf
  from jaxrl_llm.loop.config import read_run_config
  extras = rf.checkpoint_extras(str(base))      # each step records its run and its watch
  watch = {s: extras[s].pop("signal_watch") for s in extras}
  assert extras == {s: {"step": s, "run": read_run_config(str(base / "config.json"))
                        .identity()} for s in (1, 2)}
  assert [(w["step"], w["first_step"]) for w in watch.values()] == [(1, 1), (2, 1)]
  for name, value, reason in (
      ("edited", 99999, "its extra record's 'step' is 99999, saved as 2 with this step"),
      ("both", (1,), "its extra record says step 1, its folder 2")):   # record too
    out = tmp_path / name
    shutil.copytree(base, out)
    folder = f"{out}/checkpoints"
    _step_records(folder, 2, value)
    done = _main(capsys, "train", "--resume", "--steps", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert lines[:2] == [f"checkpoint {folder}/2 is unusable ({reason}); falling back to "
                         "an older checkpoint", f"resuming from step 1 ({folder}/1)"], lines
    assert [r["step"] for r in _rows(out)] == [0, 1, 2]       # step 2 trained again
  out = tmp_path / "alone"
  shutil.copytree(base, out)
  shutil.rmtree(out / "checkpoints" / "1")
  _step_records(f"{out}/checkpoints", 2, 99999)
  rows = _rows(out)
  done = _main(capsys, "train", "--resume", "--steps", "3", "--out", str(out))
  assert done.returncode == 1, done.stderr[-3000:]
  assert done.stderr.splitlines() == [
      f"error: no usable checkpoint in {out}/checkpoints: step 2 (its extra record's "
      "'step' is 99999, saved as 2 with this step)"], done.stderr
  assert _rows(out) == rows                                  # nothing trained or dropped


def test_the_state_step_counter_must_be_the_folder_step():
  import jax.numpy as jnp
  import optax

  from jaxrl_llm.loop.setup import step_problem
  from jaxrl_llm.train import TrainConfig, init_train_state
  state = init_train_state({"w": jnp.ones(2)}, optax.adam(1e-3), TrainConfig())
  assert step_problem(0, state, {"step": 0}) is None
  assert step_problem(2, state, {"step": 2}) == "its state's step counter is 0, its folder 2"
  assert step_problem(2, state, {"step": True}) == "its extra record says step True, its folder 2"
  assert step_problem(2, {"w": 1}, {}) == "its extra record says step None, its folder 2"


# One fresh interpreter: each hand-edited config.json of a run folder, resumed; reports
# the exit codes, stderr and whether JAX was imported along the way.
_EDITED_CONFIGS = r"""
import contextlib, dataclasses, io, json, os, sys
import jaxrl_llm.cli as cli
from jaxrl_llm.loop.config import RunConfig
root = sys.argv[1]
good = dataclasses.asdict(RunConfig(steps=3))
stamp = {"step": 2, "run": RunConfig(steps=3).identity()}
edits = {
    "list": [], "null": None, "steps": {**good, "steps": "abc"},
    "kl_coef": {**good, "train": {"kl_coef": "x"}}, "train": {**good, "train": []},
    "task_config": {**good, "task_config": "min_terms=2"},
    "seed": {**good, "seed": True}, "task_type": {**good, "task": 7},
    "task": {**good, "task": "copy"},          # a valid task, not the one trained
}
out = {}
for name, config in edits.items():
  run = os.path.join(root, name)
  os.makedirs(os.path.join(run, "checkpoints", "2", "extra"))
  with open(os.path.join(run, "config.json"), "w") as f:
    json.dump(config, f)
  with open(os.path.join(run, "checkpoints", "2", "extra", "metadata"), "w") as f:
    json.dump(stamp, f)
  err = io.StringIO()
  with contextlib.redirect_stderr(err):
    rc = cli.main(["train", "--resume", "--out", run, "--no-progress"])
  out[name] = (rc, err.getvalue())
out["jax_imported"] = sorted(m for m in ("jax", "jaxlib", "flax", "optax", "orbax")
                             if m in sys.modules)
print(json.dumps(out))
"""


def test_a_hand_edited_config_is_one_line_naming_the_field_before_jax(tmp_path):
  """Reliability issue, item 4: wrong types in a run's config.json gave a traceback on
  --resume (after up to 35 s of imports and building); a valid but different task
  resumed the run on that task. Now each is one line naming the file and the field,
  exit code 2, and JAX is never imported."""
  done = subprocess.run([sys.executable, "-c", _EDITED_CONFIGS, str(tmp_path)],
                        capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  result = json.loads(done.stdout.strip().splitlines()[-1])
  assert result.pop("jax_imported") == []
  expected = {
      "list": "holds [], not a JSON object of run settings",
      "null": "holds null, not a JSON object of run settings",
      "steps": 'steps must be an int, got "abc"',
      "kl_coef": 'train.kl_coef must be a number, got "x"',
      "train": "train must be a JSON object of TrainConfig fields, got []",
      "task_config": 'task_config must be a list of strings, got "min_terms=2"',
      "seed": "seed must be an int, got true",
      "task_type": "task must be null or a string, got 7",
      "task": 'task "copy" (its checkpoints were trained with "reverse"), which step 2 '
              "records: the file was edited after the run started",
  }
  for name, message in expected.items():
    rc, err = result[name]
    config = tmp_path / name / "config.json"
    lines = err.splitlines()
    assert rc == 2 and len(lines) == 1, (name, rc, err)
    assert lines[0].startswith(f"error: {config}: {message}"), (name, err)


def _tree(folder):
  """``{relative path: bytes}`` of every file under ``folder``."""
  return {os.path.relpath(os.path.join(d, n), folder): open(os.path.join(d, n), "rb").read()
          for d, _, names in os.walk(folder) for n in names}


def test_resume_of_a_run_folder_with_planted_links_changes_nothing_outside_it(capsys,
                                                                              tmp_path):
  """Reliability issue, item 3: ``--resume`` on a crafted run folder wrote outside it:
  ``metrics.jsonl.tmp -> F`` was followed by the atomic rewrite (and ``metrics.jsonl``
  became a link to F), ``curves.png -> F`` and ``config.json.tmp -> F`` were
  overwritten; a step folder that was a link fell back, trained, then died in
  ``OSError: Cannot call rmtree on a symbolic link``. Now files are created fresh and
  renamed into place; a link the run would append to or restore from is refused in
  one line."""
  import shutil
  outside = tmp_path / "outside"
  outside.mkdir()
  for name in ("f1", "f2", "f3", "f4"):
    (outside / name).write_text(f"{name}: not the run's\n")
  shutil.copytree(outside, outside / "step")
  before = _tree(outside)
  base = tmp_path / "base"
  small = ["--algo", "grpo", "--prompts-per-step", "4", "--group-size", "2",
           "--eval-size", "4", "--eval-every", "100", "--save-every", "2", "--no-progress"]
  assert _main(capsys, "train", "--steps", "3", *small, "--out", str(base)).returncode == 0
  shutil.rmtree(base / "checkpoints" / "3")          # killed after step 3's row: resume
  run = tmp_path / "links"                           # drops it (a metrics rewrite)
  shutil.copytree(base, run)
  for name, target in (("metrics.jsonl.tmp", "f1"), ("curves.png", "f2"),
                       ("config.json.tmp", "f3")):
    if os.path.exists(run / name):
      os.unlink(run / name)
    os.symlink(outside / target, run / name)
  done = _main(capsys, "train", "--resume", "--out", str(run))
  assert done.returncode == 0, done.stderr[-3000:]
  assert f"{run}/metrics.jsonl: dropped 1 row after step 2" in done.stderr
  assert _tree(outside) == before
  assert not any(os.path.islink(run / n) for n in os.listdir(run)), os.listdir(run)
  assert [r["step"] for r in _rows(run)] == [0, 1, 2, 3]
  assert (run / "curves.png").read_bytes()[:4] == b"\x89PNG"
  for name, plant, message in (
      ("metrics", ("metrics.jsonl", outside / "f4"),
       f"is a symbolic link (to {outside}/f4): a run folder's files are written by the "
       "run alone; remove the link"),
      ("step", ("checkpoints/4", outside / "step"),
       f"error: checkpoint step folder {{run}}/checkpoints/4 is a symbolic link (to "
       f"{outside}/step); a checkpoint is a folder the checkpointer wrote: remove the "
       "link")):
    run = tmp_path / name
    shutil.copytree(base, run)
    if name == "metrics":
      os.unlink(run / plant[0])
    os.symlink(plant[1], run / plant[0])
    done = _main(capsys, "train", "--resume", "--out", str(run))
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode == 1 and len(errors) == 1, done.stderr[-3000:]
    assert message.format(run=run) in errors[0], errors
    assert "Traceback" not in done.stderr
    assert _tree(outside) == before


def test_an_export_replaces_planted_links_and_writes_nothing_through_them(tmp_path):
  """Export outputs are written into a fresh folder, then moved into place: a planted
  ``hf -> D`` or ``value_head.safetensors -> F`` is replaced, D and F are untouched."""
  from jaxrl_llm.loop.export import _staged
  outside = tmp_path / "outside"
  outside.mkdir()
  (outside / "model.safetensors").write_text("not the run's\n")
  before = _tree(outside)
  run = tmp_path / "run"
  run.mkdir()
  os.symlink(outside, run / "hf")
  os.symlink(outside / "model.safetensors", run / "value_head.safetensors")
  os.link(outside / "model.safetensors", run / "policy.gguf")     # a hard link, too
  (run / "critic").mkdir()
  os.symlink(outside / "model.safetensors", run / "critic" / "model.safetensors")
  with _staged(str(run)) as stage:
    for folder in ("hf", "critic"):
      os.makedirs(os.path.join(stage, folder))
      with open(os.path.join(stage, folder, "model.safetensors"), "w") as f:
        f.write("trained\n")
    with open(os.path.join(stage, "value_head.safetensors"), "w") as f:
      f.write("head\n")
    with open(os.path.join(stage, "policy.gguf"), "w") as f:
      f.write("gguf\n")
  assert sorted(os.listdir(run)) == ["critic", "hf", "policy.gguf", "value_head.safetensors"]
  assert _tree(run) == {"hf/model.safetensors": b"trained\n",
                        "critic/model.safetensors": b"trained\n",
                        "value_head.safetensors": b"head\n", "policy.gguf": b"gguf\n"}
  assert not any(os.path.islink(os.path.join(d, n)) for d, dirs, names in os.walk(run)
                 for n in dirs + names)
  assert _tree(outside) == before
  with pytest.raises(RuntimeError), _staged(str(run)) as stage:      # a failed export
    os.makedirs(os.path.join(stage, "hf"))
    raise RuntimeError("failed mid-export")
  assert _tree(run)["hf/model.safetensors"] == b"trained\n"           # the old one stays
  assert sorted(os.listdir(run)) == ["critic", "hf", "policy.gguf", "value_head.safetensors"]


def test_a_linked_checkpoint_folder_is_refused_in_one_line_and_never_followed(capsys,
                                                                              tmp_path):
  """Reliability issue, item 3: ``--resume`` on a run whose ``checkpoints`` is a link to
  a folder D elsewhere restored from D, saved its new steps into D and rotated D's old
  ones away (exit 0). Now ``train --resume`` and ``eval`` refuse it in one line and
  nothing in D changes."""
  import shutil
  run = tmp_path / "run"
  small = ["--algo", "grpo", "--prompts-per-step", "4", "--group-size", "2",
           "--eval-size", "4", "--eval-every", "100", "--save-every", "2", "--no-progress"]
  assert _main(capsys, "train", "--steps", "3", *small, "--out", str(run)).returncode == 0
  shutil.rmtree(run / "checkpoints" / "3")           # so that a resume trains and saves
  outside = tmp_path / "outside"
  shutil.move(run / "checkpoints", outside)
  os.symlink(outside, run / "checkpoints")
  before = _tree(outside)
  message = (f"{run}/checkpoints is a symbolic link (to {outside}): a run folder's files "
             "are written by the run alone; remove the link")
  done = _main(capsys, "train", "--resume", "--out", str(run))
  errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
  assert done.returncode == 1 and errors == [f"error: {message}"], done.stderr[-3000:]
  done = _main(capsys, "eval", "--out", str(run))
  errors = [line for line in done.stderr.splitlines() if line.startswith("error")]
  assert done.returncode != 0 and len(errors) == 1, done.stderr[-3000:]
  assert f"checkpoint folder {run}/checkpoints is a symbolic link" in errors[0], errors
  assert "Traceback" not in done.stderr
  assert _tree(outside) == before


def test_ctrl_c_before_step_1_says_no_checkpoint_and_draws_without_warnings(
    capsys, tmp_path, monkeypatch):
  """Reliability issue, item 11: Ctrl-C during step 1 printed ``interrupted: checkpoint
  saved at step None`` and matplotlib's ``No artists with labels found to put in
  legend`` warning (curves of the step-0 row alone)."""
  import warnings

  from jaxrl_llm.loop import run as run_module

  def interrupted(r, step):
    raise KeyboardInterrupt

  monkeypatch.setattr(run_module, "_train_step", interrupted)
  out = tmp_path / "run"
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    done = _main(capsys, "train", "--algo", "grpo", "--steps", "3", "--prompts-per-step",
                 "4", "--group-size", "2", "--eval-size", "4", "--out", str(out),
                 "--no-progress")
  assert done.returncode == 130
  assert (f"interrupted: no checkpoint in {out} (no step was completed and saved; a new "
          "run starts from step 0)") in done.stderr.splitlines(), done.stderr
  assert "None" not in done.stderr and "Traceback" not in done.stderr
  assert [str(w.message) for w in caught if "matplotlib" in w.filename
          or "legend" in str(w.message)] == []


def test_resume_of_a_finished_run_says_it_is_complete_in_one_line(capsys, tmp_path):
  """Reliability issue, item 11: ``--resume`` on a finished run built the rollouts and
  announced ``steps 3-2`` (a 69 s no-op on SmolLM2); now one line says it is complete,
  nothing is trained or written."""
  out = tmp_path / "run"
  assert _main(capsys, "train", "--algo", "grpo", "--steps", "2", "--prompts-per-step",
               "4", "--group-size", "2", "--eval-size", "4", "--out", str(out)).returncode == 0
  before = _tree(out)
  done = _main(capsys, "train", "--resume", "--out", str(out))
  assert done.returncode == 0, done.stderr[-3000:]
  assert (f"{out} is already complete: its checkpoint is step 2 of --steps 2; nothing to "
          "train (pass a larger --steps to go on)") in done.stderr.splitlines(), done.stderr
  assert "steps 3-2" not in done.stderr
  kept = lambda tree: {k: v for k, v in tree.items()
                       if k == "metrics.jsonl" or k.startswith("checkpoints/")}
  assert kept(_tree(out)) == kept(before)


def test_a_recipe_warmup_as_long_as_the_run_is_a_warning_naming_both_flags(capsys):
  """Reliability issue, item 11: --algo vapo (10 warm-up steps) with --steps 3 trained
  no policy without a word; the recipe's own warm-up is a warning (the run may want
  only its critic), the flag's an error (above)."""
  from jaxrl_llm.cli import _check_warmup
  from jaxrl_llm.loop.config import RunConfig
  _check_warmup(RunConfig(algo="vapo", steps=3), 10)
  assert capsys.readouterr().err == (
      "warning: --algo vapo warms its critic up for 10 steps (--critic-warmup-steps), all "
      "of --steps 3: the policy will not change; pass a larger --steps or a smaller "
      "--critic-warmup-steps\n")
  _check_warmup(RunConfig(algo="vapo", steps=11), 10)
  assert capsys.readouterr().err == ""
