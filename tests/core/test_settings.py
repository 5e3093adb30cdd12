"""Tests for jaxrl_llm.settings: the run's fields by section (each once, under its own
type), the frozen section views, and each section's checks (the messages of the flat
checks they replaced, the order in which several faults are named)."""

from __future__ import annotations

import dataclasses
import json
import typing

import pytest

from jaxrl_llm import settings
from jaxrl_llm.loop.config import RunConfig
from jaxrl_llm.settings import (
  SECTIONS,
  LoraSettings,
  RolloutSettings,
  run_fields,
  section_view,
  validate_sections,
)


def test_every_run_field_is_in_exactly_one_section_with_its_type():
  hints = typing.get_type_hints(RunConfig)
  seen: list = []
  for section in SECTIONS.values():
    own = typing.get_type_hints(section.settings)
    for name, field in run_fields(section.settings).items():
      assert own[name] == hints[field], (section.name, name, field)
      seen.append(field)
  assert sorted(seen) == sorted(f.name for f in dataclasses.fields(RunConfig))
  assert len(seen) == len(set(seen))
  for section in SECTIONS.values():     # names before the ranges, combinations after
    assert section.rules.count(settings.BOUNDS) == 1, section.name
  assert list(SECTIONS) == ["task", "recipe", "model", "critic", "budget", "dapo", "mesh",
                            "io", "rollout", "lora"]


def test_sections_are_frozen_views_of_the_flat_run():
  run = RunConfig(task="sort", lora_rank=4, lora_alpha=8.0, async_rollouts=True,
                  max_staleness=2, mesh_fsdp=2, steps=9, value_lr=0.1, train={"lam": 0.9})
  assert run.section("lora") == LoraSettings(rank=4, alpha=8.0,
                                             targets="q,k,v,o,gate,up,down",
                                             base_dtype="bf16", init=None)
  assert run.section("rollout") == RolloutSettings(
      backend="engine", slots=None, prefill_rows=1, partial=False, token_budget=None,
      partial_kv="recompute", asynchronous=True, max_staleness=2, devices=0)
  assert run.section("mesh").sizes == (1, 2, 1)
  assert (run.section("budget").steps, run.section("critic").lr,
          run.section("recipe").train, run.section("task").name) == (9, 0.1, {"lam": 0.9},
                                                                     "sort")
  with pytest.raises(dataclasses.FrozenInstanceError):
    run.section("lora").rank = 8                               # type: ignore[misc]
  with pytest.raises(ValueError, match="unknown section 'loras'; sections: task, recipe"):
    run.section("loras")
  # The flat surface is unchanged: keywords, asdict, config.json, rebuilt from sections.
  flat = {field: getattr(section_view(run, s), name) for s in SECTIONS
          for name, field in run_fields(SECTIONS[s].settings).items()}
  assert RunConfig(**flat) == run
  assert RunConfig.from_dict(json.loads(json.dumps(dataclasses.asdict(run)))) == run
  assert list(dataclasses.asdict(run))[:4] == ["task", "task_config", "algo", "model"]


# One fault each: the message the flat checks of the previous version raised (each
# compared with main at cabf401 on these inputs).
SINGLE_FAULTS = [
    ({"task": "sort", "dataset": "d.jsonl"},
     "--task sort and --dataset are exclusive: a --dataset run trains on the dataset"),
    ({"task_config": ["a=1"]}, "--task-config a=1 is a setting of a task source's --task "
     "(rg:NAME); --task reverse takes none"),
    ({"eval_dataset": "e.jsonl"}, "--eval-dataset is a setting of --dataset (a --task has "
     "its own held-out split); add --dataset"),
    ({"holdout": 0.1}, "--holdout is a setting of --dataset (a --task has its own "
     "held-out split); add --dataset"),
    ({"dataset": "/no/such.jsonl"}, "--dataset '/no/such.jsonl' is not a file"),
    ({"algo": "nope"}, "unknown algo 'nope'; valid algos: ppo, grpo, dr_grpo, rloo, "
     "self_critical, reinforce_pp, vapo, dapo"),
    ({"critic": "nope"}, "--critic 'nope' must be 'policy', a Hugging Face model folder "
     "(with config.json), a .gguf file or a packaged model"),
    ({"steps": 0}, "--steps must be >= 1 (got 0)"),
    ({"lora_rank": 0}, "--lora-rank must be an int >= 1 (got 0)"),
    ({"lr": 0.0}, "--lr must be > 0 (got 0.0)"),
    ({"overlong_penalty": -0.5}, "--overlong-penalty must be >= 0 (got -0.5)"),
    ({"mesh_fsdp": -2}, "--fsdp must be >= 1 or -1 (all remaining devices), got -2"),
    ({"mesh_data": -1, "mesh_tensor": -1}, "only one of --data, --fsdp, --tensor may be -1"),
    ({"remat": True, "lora_rank": 4}, "--remat is not supported with --lora-rank yet (the "
     "adapters are applied by qwix inside the blocks)"),
    ({"resume": True, "overwrite": True}, "--resume and --overwrite are exclusive"),
    ({"partial_rollouts": True, "rollout": "simple"}, "--partial-rollouts needs --rollout "
     "engine (got --rollout simple): in-flight samples live in the engine's slots"),
    ({"partial_kv": "keep"}, "--partial-kv keep is a setting of --partial-rollouts; add "
     "--partial-rollouts"),
    ({"async_rollouts": True, "rollout": "vllm"}, "--async generates on a JAX engine of "
     "its own; with --rollout vllm the vLLM engine lives in the trainer's process (use "
     "--rollout engine)"),
    ({"rollout_devices": 1}, "--rollout-devices 1 is a setting of --async; add --async"),
    ({"rollout_devices": 1, "async_rollouts": True, "rollout": "simple"},
     "--rollout-devices needs --rollout engine (got --rollout simple)"),
    ({"async_rollouts": True, "partial_rollouts": True},
     "--async and --partial-rollouts are exclusive (choose one)"),
    ({"max_staleness": 2}, "--max-staleness 2 is a setting of --async; add --async"),
    ({"pack_tokens": 8}, "--pack-tokens is the row budget of --pack; add --pack"),
    ({"lora_targets": "q"}, "--lora-targets is a setting of --lora-rank; add --lora-rank"),
    ({"lora_rank": 4, "lora_targets": "zz"}, "--lora-targets 'zz': ['zz'] matches no "
     "module; valid targets: q,k,v,o,gate,up,down or all"),
    ({"lora_rank": 4, "partial_rollouts": True}, "--partial-rollouts is not supported with "
     "--lora-rank yet (its engine would run the base weights)"),
    ({"token_budget": 16}, "--token-budget is the budget of --partial-rollouts; add "
     "--partial-rollouts"),
]


@pytest.mark.parametrize("fields,message", SINGLE_FAULTS)
def test_each_section_names_the_flag_at_fault(fields, message):
  with pytest.raises(ValueError) as e:
    RunConfig(**fields).validate()
  assert str(e.value) == message


def test_several_faults_name_the_names_then_the_ranges_then_the_combinations(tmp_path):
  """Phase by phase, as the flat checks did: what a name refers to, then the declared
  ranges (in field order), then how settings combine."""
  faults = [({"holdout": 0}, "--holdout is a setting of --dataset"),           # names
            ({"steps": 0, "partial_kv": "keep"}, "--steps must be >= 1"),     # ranges
            ({"lora_rank": 0, "partial_kv": "keep"}, "--lora-rank must be an int"),
            ({"max_new_tokens": 0, "lr": -1.0}, "--lr must be > 0"),          # field order
            ({"critic_init": str(tmp_path), "steps": 0}, "--steps must be >= 1"),
            ({"task": "nope", "algo": "nope"}, "unknown task 'nope'")]
  for fields, start in faults:
    with pytest.raises(ValueError) as e:
      RunConfig(**fields).validate()
    assert str(e.value).startswith(start), (fields, str(e.value))


class _Catalog:
  """A catalog of one task and one recipe: the checks need nothing above their floor."""

  def task_names(self):
    return ["only"]

  def task_source(self, name):
    return None

  def task_sources_doc(self):
    return "no sources"

  def check_task_config(self, source, task_config):
    raise AssertionError

  def reward_names(self):
    return ["exact"]

  def check_algo(self, name):
    if name != "mine":
      raise ValueError(f"unknown algo {name!r}")

  def lora_adapter_mismatch(self, run):
    return ("rank", run.lora_rank, 8)


def test_the_checks_read_the_higher_floors_through_a_catalog(tmp_path):
  catalog = _Catalog()
  validate_sections(RunConfig(task="only", algo="mine"), catalog)
  with pytest.raises(ValueError, match="unknown task 'reverse'; valid tasks: only, or no "
                     "sources"):
    validate_sections(RunConfig(algo="mine"), catalog)
  with pytest.raises(ValueError, match="unknown algo 'grpo'"):
    validate_sections(RunConfig(task="only"), catalog)
  adapter = tmp_path / "adapter"
  with pytest.raises(ValueError) as e:
    validate_sections(RunConfig(task="only", algo="mine", lora_rank=4,
                                lora_init=str(adapter)), catalog)
  assert str(e.value) == (f"--lora-init {str(adapter)!r}: the adapter has rank 8, the run "
                          "--lora-rank 4; pass --lora-rank 8")


def test_the_settings_module_is_jax_free_and_flag_is_one_function():
  import subprocess
  import sys
  code = ("import sys, jaxrl_llm.settings, jaxrl_llm.loop.config; "
          "print(sorted(m for m in ('jax', 'optax', 'flax') if m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True)
  assert out.stdout.strip() == "[]"
  from jaxrl_llm.loop import config
  assert config.flag is settings.flag
