"""Rollout device sets on 4 forced CPU devices, run in a subprocess by
tests/loop/test_async_loop.py: ``python -m tests.rollout_devices_worker OUT.json TMP_DIR``."""

from __future__ import annotations

import os

from tests._devices import force_host_devices

force_host_devices(4)    # before jax is imported; the caller's other XLA flags kept

import json
import sys

import jax
import numpy as np
from flax import nnx

from jaxrl_llm.loop import async_rollout
from jaxrl_llm.loop.accounting import MEASURED_COLUMNS
from jaxrl_llm.loop.config import RunConfig
from jaxrl_llm.loop.run import run_training
from jaxrl_llm.models import Transformer, TransformerConfig, make_paged_decode_fns, split_model
from jaxrl_llm.rollout import ReplicatedEngine, Request, RolloutEngine

WALL = MEASURED_COLUMNS       # time, memory and compile columns
ASYNC_ONLY = ("staleness_mean", "staleness_max", "behaviour_kl")


def engines() -> dict:
  devices = jax.devices()
  graphdef, params = split_model(Transformer(TransformerConfig.tiny(32), rngs=nnx.Rngs(0)))
  one = RolloutEngine(make_paged_decode_fns(graphdef), max_slots=4, max_len=24, page_size=4)
  rng = np.random.default_rng(0)
  requests = [Request(rng.integers(1, 32, size=int(rng.integers(1, 6))).tolist(), n=2,
                      max_new_tokens=int(rng.integers(2, 12)), temperature=1.0)
              for _ in range(7)]
  rollout_set = [devices[0], devices[2], devices[3]]
  replicated = ReplicatedEngine(one, rollout_set)
  got = replicated.generate(params, requests, seed=5)
  want = one.generate(params, requests, seed=5)
  equal = len(got) == len(want) and all(
      (a.request, a.sample) == (b.request, b.sample) and np.array_equal(a.tokens, b.tokens)
      and np.array_equal(a.logprobs, b.logprobs) for a, b in zip(got, want))
  where = [sorted(d.id for d in jax.tree.leaves(r._state.pages)[0].devices())
           if r._state is not None else [d.id] for r, d in zip(replicated.replicas,
                                                               rollout_set)]
  return {"devices": len(devices), "engine_equal": equal, "completions": len(got),
          "replica_devices": where}


def loop(tmp: str) -> dict:
  small = dict(steps=4, prompts_per_step=4, group_size=2, eval_every=2, eval_size=8,
               save_every=10, progress=False)
  seen: set[int] = set()
  original = ReplicatedEngine.generate

  def spy(self, params, requests, seed=0, **kw):
    seen.update(d.id for d in self.devices)
    return original(self, params, requests, seed, **kw)

  ReplicatedEngine.generate = spy          # type: ignore[method-assign]
  run_training(RunConfig(out=os.path.join(tmp, "sync"), train={"rollout_correction": "token"},
                         **small))
  run_training(RunConfig(out=os.path.join(tmp, "async"), async_rollouts=True,
                         max_staleness=0, rollout_devices=2, **small))
  assert async_rollout.ReplicatedEngine is ReplicatedEngine

  def rows(name):
    with open(os.path.join(tmp, name, "metrics.jsonl")) as f:
      return [{k: v for k, v in json.loads(line).items() if k not in WALL + ASYNC_ONLY}
              for line in f]

  return {"sync_rows": rows("sync"), "async_rows": rows("async"),
          "generated_on": sorted(seen)}


if __name__ == "__main__":
  out, tmp = sys.argv[1], sys.argv[2]
  result = {**engines(), **loop(tmp)}
  with open(out, "w") as f:
    json.dump(result, f)
