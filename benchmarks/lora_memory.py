r"""Per-device memory of a PPO train step: full fine-tuning vs LoRA vs QLoRA (nf4).

Run: ``python -m benchmarks.lora_memory [--models 1b,8b] [--lengths 8192,32768]
[--modes full,lora,qlora] [--devices 1,8] [--json out.json]``.

Nothing runs: each step is AOT-compiled (``jax.jit(step).lower(ShapeDtypeStruct
inputs).compile()``, XLA's default pipeline) and ``memory_analysis()`` gives the
per-device bytes of the arguments (base weights, adapters, optimizer state, batch),
outputs and temporaries; ``total = arguments + outputs + temporaries - aliased`` (the
donated state is aliased to the output). The models are built abstractly
(``nnx.eval_shape``; qwix's LoRA init runs traced), so an 8B model needs no memory.

The step is :func:`jaxrl_llm.make_ppo_train_step` (built by ``make_train_step`` with
the PPO config and, for LoRA, ``trainable=lora_trainable``; value head, GAE from rewards, Adam,
``remat=True``, ``logprob_chunk_size=1024``), one sequence of ``T`` tokens per device:

* ``full``: every weight trained (Adam state for all);
* ``lora``: rank-16 adapters on q,k,v,o,gate,up,down (alpha 32), base bf16, frozen
  (``make_train_step(..., trainable=lora_trainable)``: Adam state for the adapters and
  the value head only, no base gradient);
* ``qlora``: the same adapters over an nf4 base (blocks of 64 inputs; qwix).

Models: ``tiny`` (``TransformerConfig.tiny(256)``, float32; for tests), ``1b`` (d 2048,
16 layers, 16/8 heads, d_ff 5632, vocab 32000) and ``8b`` (Llama-3-8B shapes: d 4096, 32
layers, 32/8 heads, d_ff 14336, vocab 128256), bf16.
``devices=8`` compiles for 8 forced CPU devices on ``make_mesh(fsdp=8)`` as a sharded
run does (:func:`benchmarks._aot.compile_ppo_step`, shared with
``benchmarks/long_sequence.py``): parameters, adapters and optimizer state sharded by
the mesh rules, batch 8 (one row per device), the forward wrapped by
:func:`jaxrl_llm.train.shard_apply_fn` so the activations stay batch-sharded. Each
(model, devices) group runs in its own subprocess. The longest measured ``T`` within
24 and 80 GiB per device is reported per (model, mode, devices), with the shortest
measured ``T`` that did not fit (the bracket).
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
RANK, ALPHA = 16, 32.0
MODES = ("full", "lora", "qlora")


def model_config(name: str):
  import jax.numpy as jnp

  from jaxrl_llm.models.transformer import TransformerConfig
  common = dict(max_seq_len=262144, dtype=jnp.bfloat16, remat=True, value_head=True)
  if name == "tiny":   # the tests' size (float32)
    return TransformerConfig.tiny(256, max_seq_len=4096, remat=True, value_head=True)
  if name == "1b":
    return TransformerConfig(vocab_size=32000, d_model=2048, n_layers=16, n_heads=16,
                             n_kv_heads=8, d_ff=5632, **common)
  if name == "8b":
    return TransformerConfig(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
                             n_kv_heads=8, d_ff=14336, rope_theta=500000.0,
                             tie_embeddings=False, **common)
  raise ValueError(f"`model` must be 'tiny', '1b' or '8b', got {name!r}.")


def compile_case(name: str, mode: str, devices: int, length: int) -> dict:
  """AOT-compiles one step; its per-device memory (nothing runs).

  ``devices`` > 1: ``make_mesh(fsdp=devices)`` with one row per device, compiled as a
  sharded run does (:func:`benchmarks._aot.compile_ppo_step`: ``shard_apply_fn``
  anchors the activations to the batch sharding, so every device holds one row).
  """
  import resource

  import jax
  import optax
  from flax import nnx

  from benchmarks._aot import compile_ppo_step, memory_gib, num_elements, ppo_batch
  from jaxrl_llm.models.lora import apply_lora, lora_trainable
  from jaxrl_llm.models.transformer import Transformer, make_apply_fn, split_model
  from jaxrl_llm.train import TrainConfig, init_train_state

  if mode not in MODES:
    raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}.")
  cfg = model_config(name)

  def build():
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    if mode == "full":
      return model
    return apply_lora(model, rank=RANK, alpha=ALPHA,
                      base_dtype="nf4" if mode == "qlora" else "bf16")

  graphdef, params = split_model(nnx.eval_shape(build))
  trainable = None if mode == "full" else lora_trainable
  optimizer = optax.adam(1e-5)
  config = TrainConfig(logprob_chunk_size=1024)
  state = jax.eval_shape(lambda p: init_train_state(p, optimizer, config,
                                                    trainable=trainable), params)
  compiled, seconds = compile_ppo_step(make_apply_fn(graphdef), optimizer, config, state,
                                       ppo_batch(devices, length),
                                       {"fsdp": devices} if devices > 1 else None,
                                       trainable=trainable)
  rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2.0 ** 20
  return {"model": name, "mode": mode, "devices": devices, "T": length,
          "params": num_elements(params), "opt_state_elems": num_elements(state.opt_state),
          **memory_gib(compiled), "compile_s": seconds, "peak_rss_gib": rss_gb}


def worker(args) -> None:
  rows = []
  for model in args.models:
    for length in args.lengths:
      for mode in args.modes:
        try:
          row = compile_case(model, mode, args.devices[0], length)
        except Exception as e:  # a failed compile is a result
          row = {"model": model, "mode": mode, "devices": args.devices[0], "T": length,
                 "skipped": f"{type(e).__name__}: {str(e)[:300]}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(args.json, "w") as f:
          json.dump(rows, f)


def fits(rows: list[dict], gib: float) -> dict:
  """``{(model, mode, devices): (longest measured T whose total fits gib or 0, shortest
  measured T that does not fit or None)}``."""
  out: dict = {}
  for r in rows:
    if "total_gib" not in r:
      continue
    key = (r["model"], r["mode"], r["devices"])
    fit, over = out.get(key, (0, None))
    if r["total_gib"] <= gib:
      fit = max(fit, r["T"])
    else:
      over = r["T"] if over is None else min(over, r["T"])
    out[key] = (fit, over)
  return out


def table(rows: list[dict]) -> str:
  lines = ["| model | devices | mode | T | total GiB/dev | args GiB/dev | temp GiB/dev | "
           "Adam state elems | compile s |", "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    devices = "1" if r["devices"] == 1 else f"{r['devices']} (fsdp={r['devices']})"
    head = f"| {r['model']} | {devices} | {r['mode']} | {r['T']} | "
    if "total_gib" in r:
      lines.append(head + f"{r['total_gib']:.2f} | {r['args_gib']:.2f} | "
                   f"{r['temp_gib']:.2f} | {r['opt_state_elems']:.3g} | "
                   f"{r['compile_s']:.0f} |")
    else:
      lines.append(head + f"not compiled: {r['skipped']} | | | | |")
  return "\n".join(lines)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--models", default="1b,8b")
  p.add_argument("--modes", default="full,lora,qlora")
  p.add_argument("--lengths", default="8192,32768")
  p.add_argument("--devices", default="1,8")
  p.add_argument("--json", default=None)
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  args.models = args.models.split(",")
  args.modes = args.modes.split(",")
  args.lengths = [int(x) for x in args.lengths.split(",")]
  args.devices = [int(x) for x in args.devices.split(",")]
  if args.worker:
    worker(args)
    return
  rows: list[dict] = []
  for devices in args.devices:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
      out = tmp.name
    env = forced_device_env(devices, ROOT, platforms="cpu")
    cmd = [sys.executable, "-m", "benchmarks.lora_memory", "--worker",
           "--models", ",".join(args.models), "--modes", ",".join(args.modes),
           "--lengths", ",".join(map(str, args.lengths)), "--devices", str(devices),
           "--json", out]
    subprocess.run(cmd, cwd=ROOT, env=env, check=False)
    if os.path.exists(out) and os.path.getsize(out):
      with open(out) as f:
        rows.extend(json.load(f))
  print(table(rows))
  for gib in (24.0, 80.0):
    for (m, mode, d), (fit, over) in fits(rows, gib).items():
      print(f"{m} {mode} {d} device(s): longest measured T within {gib:g} GiB/device: "
            f"{fit or 'none'}" + (f" ({over} does not fit)" if over else ""))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
