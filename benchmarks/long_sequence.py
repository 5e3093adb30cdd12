r"""Long-sequence PPO memory: per-device memory of the whole train step vs ``T``.

Run: ``python -m benchmarks.long_sequence [--quick] [--json out.json]
[--models small,1b,llama3-8b,qwen3-8b] [--meshes 1 sequence=8 fsdp=8 fsdp=4,sequence=2]
[--lengths 2048,...] [--pipeline default|reduced|both]``.

Nothing runs: every step is AOT-compiled (``jax.jit(step, in_shardings=...)
.lower(ShapeDtypeStruct inputs).compile()``) and XLA's ``memory_analysis()`` gives the
per-device sizes of the arguments (parameters, Adam state, batch), outputs and
temporaries. The step is :func:`jaxrl_llm.make_ppo_train_step` with a value head,
GAE from rewards, Adam, ``remat=True`` and ``logprob_chunk_size=1024``, for

* ``tiny``: ``TransformerConfig.tiny(256, remat=True)`` (float32; for tests);
* ``small``: ``TransformerConfig.small(32000, remat=True)`` (float32);
* ``1b``: ``TransformerConfig(vocab_size=32000, d_model=2048, n_layers=16,
  n_heads=16, n_kv_heads=8, d_ff=5632, dtype=bfloat16, remat=True)``;
* ``llama3-8b``: the Llama-3-8B shape (V=128256, D=4096, 32 layers, 32/8 heads,
  d_ff=14336, untied head, bf16, remat);
* ``qwen3-8b``: the Qwen3-8B shape (V=151936, D=4096, 36 layers, 32/8 heads of 128,
  d_ff=12288, q/k-norm, untied head, bf16, remat).

The model's MLP runs over chunks of ``TransformerConfig.mlp_chunk_size`` (default 4096)
positions per sequence shard.

A mesh is ``1`` (one CPU device, no mesh; attention is
:func:`jaxrl_llm.dot_product_attention` with ``implementation=None``: blockwise at long
``T``) or comma-separated axis sizes of :func:`jaxrl_llm.parallel.make_mesh`
(``sequence=8``, ``fsdp=8``, ``fsdp=4,sequence=2``; the other axes 1), compiled for that
many forced CPU devices (``XLA_FLAGS`` is set in a subprocess before jax is imported)
with the state sharded by the parameters' logical axes (``embed`` over ``fsdp``) and
token arrays over ``P(("data", "fsdp"), "sequence")``, the step traced under the ambient
mesh as :func:`jaxrl_llm.train.shard_train_step` does. A ``sequence`` axis > 1 makes the
attention :func:`jaxrl_llm.parallel.ring_attention` and every per-token computation hold
``T / sequence`` tokens per device. The batch has one row per ``data x fsdp`` device
(``B = 1`` without those axes), so each device holds one row of ``T / sequence`` tokens.
``--devices N`` is the older spelling of ``--meshes``: 1 -> ``1``, N -> ``sequence=N``.

XLA pipeline (``--pipeline``): ``default`` (as users compile: no flags but the forced
device count) or ``reduced`` (``jax_disable_most_optimizations`` and
``--xla_backend_optimization_level=0``: faster compiles, smaller figures for bf16 models
on CPU, not what a user gets); ``both`` compiles each case twice.

Columns: ``total GiB/dev = arguments + outputs + temporaries - aliased`` (the donated
state is aliased to the output), ``temp GiB/dev`` (activations and scratch),
``growth = total(2T) / total(T)`` and ``temp growth`` likewise, ``compile s``. The
longest measured ``T`` whose total fits 16 GiB and 80 GiB per device is reported per
(model, mesh, pipeline). Each (model, mesh, pipeline) group runs in its own
subprocess; lengths are tried in increasing order and a group stops early when a
compile exceeds ``--max-compile-s`` (the remaining lengths are reported as not
compiled).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from benchmarks._aot import forced_device_env

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LENGTHS = (2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
QUICK_LENGTHS = (2048, 8192, 32768)
GOALS = (  # (model, mesh, T, GiB per device): the targets
    ("small", "1", 32768, 2.0), ("1b", "1", 32768, 24.0), ("1b", "sequence=8", 262144, 24.0))
MODELS = ("tiny", "small", "1b", "llama3-8b", "qwen3-8b")
MESH_AXES = ("data", "fsdp", "tensor", "sequence")


def model_config(name: str, **overrides):
  """The named benchmark config (``overrides``: TransformerConfig fields)."""
  import jax.numpy as jnp

  from jaxrl_llm.models.transformer import TransformerConfig
  common = {"max_seq_len": 262144, "remat": True, **overrides}
  if name == "tiny":   # the tests' size
    return TransformerConfig.tiny(256, **common)
  if name == "small":
    return TransformerConfig.small(32000, **common)
  if name == "1b":
    return TransformerConfig(**{"vocab_size": 32000, "d_model": 2048, "n_layers": 16,
                                "n_heads": 16, "n_kv_heads": 8, "d_ff": 5632,
                                "dtype": jnp.bfloat16, **common})
  if name == "llama3-8b":
    return TransformerConfig(**{"vocab_size": 128256, "d_model": 4096, "n_layers": 32,
                                "n_heads": 32, "n_kv_heads": 8, "d_ff": 14336,
                                "rope_theta": 500000.0, "tie_embeddings": False,
                                "norm_eps": 1e-5, "dtype": jnp.bfloat16, **common})
  if name == "qwen3-8b":
    return TransformerConfig(**{"vocab_size": 151936, "d_model": 4096, "n_layers": 36,
                                "n_heads": 32, "n_kv_heads": 8, "head_dim": 128,
                                "d_ff": 12288, "rope_theta": 1000000.0,
                                "tie_embeddings": False, "qk_norm": True,
                                "dtype": jnp.bfloat16, **common})
  raise ValueError(f"`model` must be one of {MODELS}, got {name!r}.")


def parse_mesh(spec: str) -> dict:
  """``"1"`` -> ``{}``; ``"fsdp=4,sequence=2"`` -> ``{"fsdp": 4, "sequence": 2}``."""
  if str(spec) == "1":
    return {}
  axes = {}
  for part in str(spec).split(","):
    name, _, size = part.partition("=")
    if name not in MESH_AXES or not size.isdigit() or int(size) < 1:
      raise ValueError(f"`mesh` must be '1' or comma-separated axis=size over "
                       f"{MESH_AXES}, got {spec!r}.")
    axes[name] = int(size)
  return axes


def mesh_devices(spec: str) -> int:
  n = 1
  for size in parse_mesh(spec).values():
    n *= size
  return n


def compile_case(name: str, mesh_spec: str | int, length: int, **overrides) -> dict:
  """AOT-compiles one PPO step; returns its per-device memory (nothing runs).

  ``mesh_spec``: ``"1"`` or ``"axis=size,..."`` (an int N > 1 means ``sequence=N``);
  ``overrides``: :class:`~jaxrl_llm.models.transformer.TransformerConfig` fields.
  """
  import jax
  import optax
  from flax import nnx

  from benchmarks._aot import compile_ppo_step, memory_gib, num_elements, ppo_batch
  from jaxrl_llm.models.transformer import Transformer, make_apply_fn, split_model
  from jaxrl_llm.train import TrainConfig, init_train_state

  if isinstance(mesh_spec, int):
    mesh_spec = "1" if mesh_spec == 1 else f"sequence={mesh_spec}"
  axes = parse_mesh(mesh_spec)
  devices = mesh_devices(mesh_spec)
  rows = axes.get("data", 1) * axes.get("fsdp", 1)
  cfg = model_config(name, **overrides)
  graphdef, params = split_model(nnx.eval_shape(lambda: Transformer(cfg,
                                                                    rngs=nnx.Rngs(0))))
  optimizer = optax.adam(1e-5)
  config = TrainConfig(logprob_chunk_size=1024)
  state = jax.eval_shape(lambda p: init_train_state(p, optimizer, config), params)
  compiled, seconds = compile_ppo_step(make_apply_fn(graphdef), optimizer, config, state,
                                       ppo_batch(rows, length), axes)
  hlo = compiled.as_text()
  return {"model": name, "params": num_elements(params), "mesh": mesh_spec,
          "devices": devices, "B": rows, "T": length, **memory_gib(compiled),
          "compile_s": seconds,
          "collective_permutes": hlo.count("collective-permute-start")
          or hlo.count("collective-permute("),
          "all_gathers": hlo.count("all-gather-start") or hlo.count("all-gather(")}


REDUCED_FLAGS = "--xla_backend_optimization_level=0"   # + jax_disable_most_optimizations


def worker(args) -> None:
  """One (model, mesh, pipeline) group in this process; rows written to ``args.json``."""
  import jax
  if args.pipeline == "reduced":
    jax.config.update("jax_disable_most_optimizations", True)
  model, mesh = args.models[0], args.meshes[0]
  rows: list[dict] = []
  for length in args.lengths:
    base = {"model": model, "mesh": mesh, "devices": mesh_devices(mesh), "T": length,
            "pipeline": args.pipeline}
    if rows and rows[-1].get("compile_s", 0) > args.max_compile_s:
      rows.append({**base, "skipped": f"previous compile > {args.max_compile_s:.0f} s"})
      continue
    try:
      rows.append({**compile_case(model, mesh, length), "pipeline": args.pipeline})
    except Exception as e:  # a failed compile is a result (e.g. out of host memory)
      rows.append({**base, "skipped": f"{type(e).__name__}: {str(e)[:200]}"})
    print(json.dumps(rows[-1]), flush=True)
    with open(args.json, "w") as f:
      json.dump(rows, f)


def run_group(model: str, mesh: str, lengths, max_compile_s: float,
              pipeline: str = "default") -> list:
  """Runs one (model, mesh, pipeline) group in a subprocess with its XLA flags."""
  out = os.path.join(tempfile.mkdtemp(), "rows.json")
  flags = ([REDUCED_FLAGS] if pipeline == "reduced" and "backend_optimization_level"
           not in os.environ.get("XLA_FLAGS", "") else [])
  env = forced_device_env(mesh_devices(mesh), ROOT, flags)
  cmd = [sys.executable, "-m", "benchmarks.long_sequence", "--worker", "--models", model,
         "--meshes", mesh, "--lengths", ",".join(map(str, lengths)),
         "--max-compile-s", str(max_compile_s), "--json", out, "--pipeline", pipeline]
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                        check=False)
  rows = []
  if os.path.exists(out):
    with open(out) as f:
      rows = json.load(f)
  if proc.returncode != 0:
    done = {r["T"] for r in rows}
    rows += [{"model": model, "mesh": mesh, "devices": mesh_devices(mesh), "T": t,
              "pipeline": pipeline,
              "skipped": f"worker exit {proc.returncode}: {proc.stderr[-200:]!r}"}
             for t in lengths if t not in done]
  return rows


def summarize(rows: list) -> tuple[list, list]:
  """Adds growth columns; returns ``(rows, fit lines)``."""
  fits = []
  groups: dict = {}
  for r in rows:
    groups.setdefault((r["model"], r["mesh"], r.get("pipeline", "default")), []).append(r)
  for (model, mesh, pipeline), group in groups.items():
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
      fits.append(f"{model}, mesh {mesh}, {pipeline} pipeline: longest measured T within "
                  f"{cap} GiB per device: {max(ok) if ok else 'none'}"
                  + (" (the longest measured)" if ok and max(ok) == max(
                      r["T"] for r in measured) else ""))
  return rows, fits


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true", help=f"T in {QUICK_LENGTHS}")
  p.add_argument("--models", default="small,1b", help=f"comma-separated, of {MODELS}")
  p.add_argument("--meshes", nargs="+", default=None,
                 help="'1' or axis=size[,axis=size] each (default: 1 sequence=8)")
  p.add_argument("--devices", default=None,
                 help="older spelling: comma-separated counts, N > 1 = sequence=N")
  p.add_argument("--lengths", default=None, help="comma-separated T values")
  p.add_argument("--max-compile-s", type=float, default=900.0,
                 help="stop a group after a compile slower than this")
  p.add_argument("--pipeline", choices=("default", "reduced", "both"), default="default",
                 help="XLA pipeline: default (as users compile), reduced "
                      "(jax_disable_most_optimizations + backend level 0), or both")
  p.add_argument("--full-optimization", action="store_true",
                 help="accepted for old command lines: the default pipeline is the default")
  p.add_argument("--json", default=None)
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  args.models = args.models.split(",")
  for model in args.models:
    if model not in MODELS:
      p.error(f"--models: unknown {model!r} (one of {MODELS})")
  if args.meshes is None:
    args.meshes = (["1" if int(d) == 1 else f"sequence={int(d)}"
                    for d in str(args.devices).split(",")] if args.devices
                   else ["1", "sequence=8"])
  for mesh in args.meshes:
    try:
      parse_mesh(mesh)
    except ValueError as e:
      p.error(f"--meshes: {e}")
  args.lengths = ([int(t) for t in args.lengths.split(",")] if args.lengths
                  else list(QUICK_LENGTHS if args.quick else LENGTHS))
  if args.worker:
    return worker(args)
  sys.path.insert(0, ROOT)
  from benchmarks._common import machine, markdown_table, write_json
  pipelines = ["default", "reduced"] if args.pipeline == "both" else [args.pipeline]
  rows = []
  for model in args.models:
    for mesh in args.meshes:
      for pipeline in pipelines:
        group = run_group(model, mesh, args.lengths, args.max_compile_s, pipeline)
        for r in group:
          print(json.dumps(r), flush=True)
        rows += group
  rows, fits = summarize(rows)
  print(f"# Long-sequence PPO step memory ({machine()}; AOT compile only)")
  cols = ["model", "mesh", "B", "T", "pipeline", "total_gib", "temp_gib", "args_gib",
          "growth", "temp_growth", "compile_s", "skipped"]
  print(markdown_table(rows, cols))
  for line in fits:
    print(line)
  goals = []
  for model, mesh, length, cap in GOALS:
    hit = [r for r in rows if (r["model"], r["mesh"], r["T"], r.get("pipeline")) == (
        model, mesh, length, "default")]
    got = hit[0].get("total_gib") if hit else None
    goals.append({"goal": f"{model}, T={length}, mesh {mesh}, default pipeline "
                          f"<= {cap} GiB per device",
                  "measured_gib": got, "met": None if got is None else bool(got <= cap)})
  print(markdown_table(goals, ["goal", "measured_gib", "met"]))
  write_json(args.json, {"benchmark": "long_sequence", "machine": machine(),
                         "rows": rows, "fits": fits, "goals": goals})
  return rows


if __name__ == "__main__":
  main()
