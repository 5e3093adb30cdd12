"""Tests for jaxrl_llm.loop.resolve: the run resolved once (``resolve_run``), the
sections of ``Resolved`` the loop reads, and a run folder written before them."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

import pytest

from jaxrl_llm import cli
from jaxrl_llm.loop.config import RunConfig, read_run_config
from jaxrl_llm.loop.resolve import (
  IOSettings,
  LoraSettings,
  MeshSettings,
  Resolved,
  RolloutSettings,
  resolve,
  resolve_run,
)

# config.json of `jaxrl-llm train --steps 2 --out /tmp/old_run_before --seed 0
# --no-progress --overwrite`, written by main at cabf401 (before issue 36).
OLD_RUN = pathlib.Path(__file__).parents[1] / "fixtures" / "run_before_issue36"


def test_resolve_run_resolves_once_and_builds_the_task():
  run = RunConfig(task="sort", algo="ppo", steps=7, seed=3, prompts_per_step=4,
                  group_size=2, eval_every=5, eval_size=16, save_every=3,
                  out="runs/x", async_rollouts=True, max_staleness=2,
                  lora_rank=4, lora_alpha=8.0, mesh_fsdp=2, pack=True, pack_tokens=32)
  seen = []
  resolved, task = resolve_run(run, before_task=seen.append)
  assert seen == [resolved] and task.name == "sort"
  assert resolved == resolve(run, task)          # the same parts as resolve with the task
  assert resolved.rollout == RolloutSettings(
      backend="engine", slots=None, prefill_rows=1, partial=False, token_budget=None,
      partial_kv="recompute", asynchronous=True, max_staleness=2, devices=0)
  assert resolved.lora == LoraSettings(rank=4, alpha=8.0, targets="q,k,v,o,gate,up,down",
                                       base_dtype="bf16", init=None)
  assert resolved.mesh == MeshSettings(data=1, fsdp=2, tensor=1, pack=True,
                                       pack_tokens=32) == run.section("mesh")
  assert resolved.mesh.sizes == (1, 2, 1)
  io = resolved.io
  assert isinstance(io, IOSettings)
  assert (io.out, io.resume, io.overwrite, io.eval_every, io.eval_size, io.save_every,
          io.progress, io.max_consecutive_skips) == ("runs/x", False, False, 5, 16, 3,
                                                     True, 20)
  assert io == run.section("io")
  assert dict(resolved.record) == dataclasses.asdict(run)
  assert dict(resolved.identity) == run.identity()
  assert (resolved.steps, resolved.seed, resolved.trains_on, resolved.model) == (
      7, 3, "sort", "tiny")
  assert resolve(RunConfig()).lora is None


def test_resolve_run_sets_a_checkpoints_logprob_start_from_its_task(tmp_path):
  tokenizers = pytest.importorskip("tokenizers")
  model = tmp_path / "model"           # a checkpoint folder (its weights never loaded)
  model.mkdir()
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.train_from_iterator(["what is 3 + 4? 7"], tokenizers.trainers.BpeTrainer(
      vocab_size=40, special_tokens=["<eos>"]))
  tok.save(str(model / "tokenizer.json"))
  (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
  (model / "config.json").write_text("{}")
  data = tmp_path / "train.jsonl"
  data.write_text(json.dumps({"prompt": "what is 3 + 4?", "answer": "7"}) + "\n")
  run = RunConfig(model=str(model), dataset=str(data))
  resolved, task = resolve_run(run)
  assert resolved.train.logprob_start == task.max_prompt_len > 0
  assert resolved == resolve(run, task)
  assert resolve(run).train.logprob_start is None     # without the task: unknown


def test_run_training_takes_a_resolved_run_with_its_task():
  from jaxrl_llm.loop.run import run_training
  resolved, task = resolve_run(RunConfig(task="sort"))
  with pytest.raises(ValueError, match="pass the task it was resolved with"):
    run_training(resolved)
  with pytest.raises(ValueError, match="pass task only with a resolved run"):
    run_training(RunConfig(task="sort"), task=task)


def test_the_command_validates_and_resolves_once(monkeypatch, tmp_path, capsys):
  """``jaxrl-llm train`` checks the run once and hands ``(resolved, task)`` over."""
  import jaxrl_llm.loop.run as loop_run
  calls = {"validate": 0}
  validate = RunConfig.validate

  def counted(self):
    calls["validate"] += 1
    validate(self)

  handed = []
  monkeypatch.setattr(RunConfig, "validate", counted)
  monkeypatch.setattr(loop_run, "run_training",
                      lambda run, **kw: handed.append((run, kw)) or {"steps": 0})
  code = cli.main(["train", "--task", "sort", "--steps", "3", "--no-progress",
                   "--out", str(tmp_path / "run")])
  assert code == 0, capsys.readouterr().err
  (run, kw), = handed
  assert isinstance(run, Resolved) and kw["task"].name == "sort"
  assert calls["validate"] == 1 and run.steps == 3


def test_a_run_folder_written_before_the_sections_reads_and_resumes(tmp_path, capsys):
  """The stored config.json of a run written by the previous version: read field for
  field, the same identity, and ``--resume`` of a copy of its folder continues it."""
  path = OLD_RUN / "config.json"
  stored = json.loads(path.read_text())
  run = read_run_config(str(path))
  assert dataclasses.asdict(run) == stored              # flat, as written
  assert run.identity() == RunConfig().identity()       # the default job (steps 2)
  folder = tmp_path / "old"
  folder.mkdir()
  shutil.copy(path, folder / "config.json")
  args = cli.build_parser().parse_args(["train", "--resume", "--out", str(folder)])
  resumed = cli._resume_config(args, ["--resume", "--out", str(folder)])
  assert resumed.identity() == run.identity() and resumed.resume and resumed.steps == 2
  resolved, task = resolve_run(resumed)
  assert resolved.io.resume and resolved.io.out == str(folder) and task.name == "reverse"
  from jaxrl_llm.loop.run import _check_run_folder
  _check_run_folder(resolved.io, resolved.identity)     # this run's folder: accepted
  other = resolve_run(dataclasses.replace(resumed, algo="ppo"))[0]
  from jaxrl_llm.run_folder import RunFolderError
  with pytest.raises(RunFolderError, match=r"different config \(fields \['algo'\]\)"):
    _check_run_folder(other.io, other.identity)
