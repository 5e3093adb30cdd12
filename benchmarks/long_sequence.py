r"""Long-sequence PPO memory: per-device memory of the whole train step vs ``T``.

Run: ``python -m benchmarks.long_sequence [--quick] [--json out.json]
[--models small,1b] [--devices 1,8] [--lengths 2048,...]``.

Nothing runs: every step is AOT-compiled (``jax.jit(step, in_shardings=...)
.lower(ShapeDtypeStruct inputs).compile()``) and XLA's ``memory_analysis()`` gives the
per-device sizes of the arguments (parameters, Adam state, batch), outputs and
temporaries. The step is :func:`jaxrl_llm.make_ppo_train_step` with a value head,
GAE from rewards, Adam, ``remat=True`` and ``logprob_chunk_size=1024``, batch ``B = 1``,
for

* ``small``: ``TransformerConfig.small(32000, remat=True)`` (float32);
* ``1b``: ``TransformerConfig(vocab_size=32000, d_model=2048, n_layers=16,
  n_heads=16, n_kv_heads=8, d_ff=5632, dtype=bfloat16, remat=True)``.

``devices=1`` compiles for one CPU device (the model's attention is
:func:`jaxrl_llm.dot_product_attention` with ``implementation=None``: blockwise at long
``T``). ``devices=8`` compiles for 8 forced CPU devices (``XLA_FLAGS`` is set in a
subprocess before jax is imported) on ``make_mesh(data=1, sequence=8)`` with token
arrays sharded ``P(None, "sequence")`` and the step traced under the ambient mesh, as
:func:`jaxrl_llm.train.shard_train_step` does: the attention is
:func:`jaxrl_llm.parallel.ring_attention` and every per-token computation holds
``T / 8`` tokens per device.

Columns: ``total GiB/dev = arguments + outputs + temporaries - aliased`` (the donated
state is aliased to the output), ``temp GiB/dev`` (activations and scratch),
``growth = total(2T) / total(T)`` and ``temp growth`` likewise, ``compile s``. The
longest measured ``T`` whose total fits 16 GiB and 80 GiB per device is reported per
(model, devices). Each (model, devices) group runs in its own subprocess; lengths are
tried in increasing order and a group stops early when a compile exceeds
``--max-compile-s`` (the remaining lengths are reported as not compiled).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GIB = 2.0 ** 30
LENGTHS = (2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
QUICK_LENGTHS = (2048, 8192, 32768)
GOALS = (  # (model, devices, T, GiB per device): the targets
    ("small", 1, 32768, 2.0), ("1b", 1, 32768, 24.0), ("1b", 8, 262144, 24.0))


def model_config(name: str):
  import jax.numpy as jnp

  from jaxrl_llm.models.transformer import TransformerConfig
  if name == "small":
    return TransformerConfig.small(32000, remat=True, max_seq_len=262144)
  if name == "1b":
    return TransformerConfig(vocab_size=32000, d_model=2048, n_layers=16, n_heads=16,
                             n_kv_heads=8, d_ff=5632, max_seq_len=262144,
                             dtype=jnp.bfloat16, remat=True)
  raise ValueError(f"`model` must be 'small' or '1b', got {name!r}.")


def compile_case(name: str, devices: int, length: int) -> dict:
  """AOT-compiles one PPO step; returns its per-device memory (nothing runs)."""
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec

  from jaxrl_llm.models.transformer import Transformer, make_apply_fn, split_model
  from jaxrl_llm.parallel import ambient_mesh, batch_shardings, make_mesh, state_shardings
  from jaxrl_llm.train import TrainConfig, init_train_state, make_ppo_train_step, shard_apply_fn

  cfg = model_config(name)
  graphdef, params = split_model(nnx.eval_shape(lambda: Transformer(cfg,
                                                                    rngs=nnx.Rngs(0))))
  optimizer = optax.adam(1e-5)
  config = TrainConfig(logprob_chunk_size=1024)
  state = jax.eval_shape(lambda p: init_train_state(p, optimizer, config), params)
  f32 = lambda: jax.ShapeDtypeStruct((1, length), jnp.float32)
  batch = {"tokens": jax.ShapeDtypeStruct((1, length), jnp.int32),
           "attention_mask": f32(), "loss_mask": f32(), "old_logp": f32(),
           "old_values": f32(), "rewards": f32()}
  apply_fn = make_apply_fn(graphdef)
  start = time.perf_counter()
  if devices == 1:
    step = make_ppo_train_step(apply_fn, optimizer, config)
    jitted = jax.jit(step, donate_argnums=0)
  else:
    mesh = make_mesh(data=1, sequence=devices)
    inner = make_ppo_train_step(shard_apply_fn(apply_fn, mesh), optimizer, config)

    def step(state, batch):
      with ambient_mesh(mesh, batch):   # what shard_train_step does
        return inner(state, batch)

    s_shard = state_shardings(state, mesh)
    jitted = jax.jit(step, in_shardings=(s_shard, batch_shardings(batch, mesh)),
                     out_shardings=(s_shard, NamedSharding(mesh, PartitionSpec())),
                     donate_argnums=0)
  compiled = jitted.lower(state, batch).compile()
  seconds = time.perf_counter() - start
  mem = compiled.memory_analysis()
  total = (mem.argument_size_in_bytes + mem.output_size_in_bytes
           + mem.temp_size_in_bytes - mem.alias_size_in_bytes)
  hlo = compiled.as_text()
  n_params = int(sum(x.size for x in jax.tree_util.tree_leaves(params)))
  return {"model": name, "params": n_params, "devices": devices, "T": length,
          "total_gib": total / GIB, "temp_gib": mem.temp_size_in_bytes / GIB,
          "args_gib": mem.argument_size_in_bytes / GIB, "compile_s": seconds,
          "collective_permutes": hlo.count("collective-permute-start")
          or hlo.count("collective-permute(")}


def worker(args) -> None:
  """One (model, devices) group in this process; rows written to ``args.json``."""
  if not args.full_optimization:
    # Compile faster on a small CPU box; XLA's memory_analysis() was identical with and
    # without these (small model, T = 8192, 1 device: 1.4749 GiB in all three runs).
    import jax
    jax.config.update("jax_disable_most_optimizations", True)
  rows = []
  for length in args.lengths:
    if rows and rows[-1].get("compile_s", 0) > args.max_compile_s:
      rows.append({"model": args.models[0], "devices": args.devices[0], "T": length,
                   "skipped": f"previous compile > {args.max_compile_s:.0f} s"})
      continue
    try:
      rows.append(compile_case(args.models[0], args.devices[0], length))
    except Exception as e:  # a failed compile is a result (e.g. out of host memory)
      rows.append({"model": args.models[0], "devices": args.devices[0], "T": length,
                   "skipped": f"{type(e).__name__}: {str(e)[:200]}"})
    print(json.dumps(rows[-1]), flush=True)
    with open(args.json, "w") as f:
      json.dump(rows, f)


def run_group(model: str, devices: int, lengths, max_compile_s: float,
              full_optimization: bool = False) -> list:
  out = os.path.join(tempfile.mkdtemp(), "rows.json")
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  flags.append(f"--xla_force_host_platform_device_count={devices}")
  if not full_optimization and not any("backend_optimization_level" in f for f in flags):
    flags.append("--xla_backend_optimization_level=0")
  env["XLA_FLAGS"] = " ".join(flags)
  cmd = [sys.executable, "-m", "benchmarks.long_sequence", "--worker", "--models", model,
         "--devices", str(devices), "--lengths", ",".join(map(str, lengths)),
         "--max-compile-s", str(max_compile_s), "--json", out]
  if full_optimization:
    cmd.append("--full-optimization")
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                        check=False)
  rows = []
  if os.path.exists(out):
    with open(out) as f:
      rows = json.load(f)
  if proc.returncode != 0:
    done = {r["T"] for r in rows}
    rows += [{"model": model, "devices": devices, "T": t,
              "skipped": f"worker exit {proc.returncode}: {proc.stderr[-200:]!r}"}
             for t in lengths if t not in done]
  return rows


def summarize(rows: list) -> tuple[list, list]:
  """Adds growth columns; returns ``(rows, fit lines)``."""
  fits = []
  groups = {}
  for r in rows:
    groups.setdefault((r["model"], r["devices"]), []).append(r)
  for (model, devices), group in groups.items():
    prev = None
    for r in sorted(group, key=lambda r: r["T"]):
      if "total_gib" not in r:
        continue
      if prev is not None and r["T"] == 2 * prev["T"]:
        r["growth"] = r["total_gib"] / prev["total_gib"]
        r["temp_growth"] = r["temp_gib"] / max(prev["temp_gib"], 1e-12)
      prev = r
    measured = [r for r in group if "total_gib" in r]
    for cap in (16, 80):
      ok = [r["T"] for r in measured if r["total_gib"] <= cap]
      fits.append(f"{model}, {devices} device(s): longest measured T within {cap} GiB "
                  f"per device: {max(ok) if ok else 'none'}"
                  + (" (the longest measured)" if ok and max(ok) == max(
                      r["T"] for r in measured) else ""))
  return rows, fits


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true", help=f"T in {QUICK_LENGTHS}")
  p.add_argument("--models", default="small,1b")
  p.add_argument("--devices", default="1,8")
  p.add_argument("--lengths", default=None, help="comma-separated T values")
  p.add_argument("--max-compile-s", type=float, default=900.0,
                 help="stop a group after a compile slower than this")
  p.add_argument("--full-optimization", action="store_true",
                 help="compile with XLA's default optimisations (slower; by default "
                      "jax_disable_most_optimizations and backend level 0)")
  p.add_argument("--json", default=None)
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  args.models = args.models.split(",")
  args.devices = [int(d) for d in str(args.devices).split(",")]
  args.lengths = ([int(t) for t in args.lengths.split(",")] if args.lengths
                  else list(QUICK_LENGTHS if args.quick else LENGTHS))
  if args.worker:
    return worker(args)
  sys.path.insert(0, ROOT)
  from benchmarks._common import machine, markdown_table, write_json
  rows = []
  for model in args.models:
    for devices in args.devices:
      group = run_group(model, devices, args.lengths, args.max_compile_s,
                        args.full_optimization)
      for r in group:
        print(json.dumps(r), flush=True)
      rows += group
  rows, fits = summarize(rows)
  print(f"# Long-sequence PPO step memory ({machine()}; AOT compile only)")
  cols = ["model", "devices", "T", "total_gib", "temp_gib", "growth", "temp_growth",
          "compile_s", "skipped"]
  print(markdown_table(rows, cols))
  for line in fits:
    print(line)
  goals = []
  for model, devices, length, cap in GOALS:
    hit = [r for r in rows if (r["model"], r["devices"], r["T"]) == (model, devices,
                                                                      length)]
    got = hit[0].get("total_gib") if hit else None
    goals.append({"goal": f"{model}, T={length}, {devices} device(s) <= {cap} GiB",
                  "measured_gib": got,
                  "met": None if got is None else bool(got <= cap)})
  print(markdown_table(goals, ["goal", "measured_gib", "met"]))
  write_json(args.json, {"benchmark": "long_sequence", "machine": machine(),
                         "rows": rows, "fits": fits, "goals": goals})
  return rows


if __name__ == "__main__":
  main()
