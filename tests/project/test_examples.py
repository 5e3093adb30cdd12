"""The scripts of examples/ run at tiny sizes and give the seeded values they gave."""

from __future__ import annotations

import ast
import importlib.util
import os

import jax
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = ("grpo_minimal", "ppo_custom_loop")


def _load(name):
  spec = importlib.util.spec_from_file_location(
      f"examples_{name}", os.path.join(ROOT, "examples", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("name", EXAMPLES)
def test_examples_use_the_public_api_only(name):
  with open(os.path.join(ROOT, "examples", f"{name}.py")) as f:
    tree = ast.parse(f.read())
  imported = [(node.module, alias.name) for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom) for alias in node.names]
  for module, alias in imported:
    if module == "__future__":
      continue
    assert not any(part.startswith("_") for part in module.split(".")), module
    assert not alias.startswith("_"), (module, alias)
  attrs = [node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
           and isinstance(node.value, ast.Name) and node.value.id == "rl"]
  assert attrs and not [a for a in attrs if a.startswith("_")]


@pytest.mark.slow
def test_grpo_minimal_runs_and_is_seeded():
  history = _load("grpo_minimal").main(steps=3, prompts_per_step=4, group_size=4,
                                       eval_every=2, eval_size=8, log=lambda _: None)
  assert len(history["reward"]) == 3 and len(history["eval_accuracy"]) == 3
  metrics = history["metrics"]
  assert metrics["skipped"] == 0 and np.isfinite(metrics["loss"])
  assert abs(metrics["adv_mean"]) < 1e-6        # group-normalised advantages
  if jax.default_backend() == "cpu":             # the seeded samples of this machine type
    np.testing.assert_allclose(history["reward"], [0.018229168, 0.0, 0.0546875], atol=1e-6)
    assert history["eval_accuracy"] == [0.0, 0.0, 0.0]


@pytest.mark.slow
def test_ppo_custom_loop_runs_and_its_critic_learns():
  history = _load("ppo_custom_loop").main(steps=3, batch_size=8, eval_size=8,
                                          log=lambda _: None)
  assert len(history["reward"]) == len(history["vf_loss"]) == 3
  # Learning signal: the separate critic fits the returns (Adam, its own lr).
  assert history["vf_loss"][-1] < history["vf_loss"][0] / 4
  assert history["explained_variance"][-1] > history["explained_variance"][0]
  if jax.default_backend() == "cpu":
    np.testing.assert_allclose(history["reward"], [0.020833334, 0.020833334, 0.015625],
                               atol=1e-6)
    np.testing.assert_allclose(history["vf_loss"], [4.0287347, 0.4046798, 0.22112493],
                               rtol=1e-4)
