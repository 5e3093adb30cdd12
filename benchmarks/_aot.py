r"""AOT memory measurement of a PPO train step, shared by the memory benchmarks.

:func:`compile_ppo_step` compiles (``jax.jit(step).lower(ShapeDtypeStruct inputs)
.compile()``; nothing runs) the step :func:`jaxrl_llm.train.make_train_step` builds
from a model's ``apply_fn`` for a train state and a batch given as shapes, on one
device or on a :func:`jaxrl_llm.parallel.make_mesh` mesh, exactly as a sharded run
would (:func:`jaxrl_llm.train.shard_train_step`'s shardings):

* no mesh: ``jax.jit(step, donate_argnums=0)``;
* a mesh: the forward wrapped by :func:`jaxrl_llm.train.shard_apply_fn` (activations
  anchored to the batch sharding: rows over ``data x fsdp``, tokens over ``sequence``),
  the step traced under the ambient mesh (:func:`jaxrl_llm.parallel.ambient_mesh`, ring
  attention with a ``sequence`` axis), the state sharded by the parameters' logical
  axes, the batch by :func:`jaxrl_llm.parallel.batch_shardings`, metrics replicated,
  the state donated. Without the anchors XLA may keep FSDP-sharded weights in place
  and give every device all rows of the activations (see ``shard_apply_fn``).

:func:`memory_gib` reads ``memory_analysis()`` per device: ``total = arguments +
outputs + temporaries - aliased`` (the donated state is aliased to the output).
:func:`forced_device_env` is the environment of a worker subprocess compiling for
``n`` forced CPU devices (``XLA_FLAGS`` must be set before jax is imported).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

GIB = 2.0 ** 30


def forced_device_env(devices: int, root: str, extra_flags: Iterable[str] = (), *,
                      platforms: str | None = None) -> dict:
  """``os.environ`` for a worker compiling for ``devices`` forced CPU devices.

  ``root`` goes first on ``PYTHONPATH``; ``extra_flags`` are appended to ``XLA_FLAGS``
  (after any inherited flag but the device count); ``platforms``: ``JAX_PLATFORMS``
  (e.g. ``"cpu"``), inherited when None.
  """
  env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
  if platforms is not None:
    env["JAX_PLATFORMS"] = platforms
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  flags.append(f"--xla_force_host_platform_device_count={devices}")
  flags += list(extra_flags)
  env["XLA_FLAGS"] = " ".join(flags)
  return env


def ppo_batch(rows: int, length: int) -> dict:
  """The PPO batch as shapes: int32 ``tokens`` and five float32 ``[rows, length]``
  arrays (``attention_mask``, ``loss_mask``, ``old_logp``, ``old_values``,
  ``rewards``; GAE from rewards)."""
  import jax
  import jax.numpy as jnp
  f32 = lambda: jax.ShapeDtypeStruct((rows, length), jnp.float32)
  return {"tokens": jax.ShapeDtypeStruct((rows, length), jnp.int32),
          "attention_mask": f32(), "loss_mask": f32(), "old_logp": f32(),
          "old_values": f32(), "rewards": f32()}


def compile_ppo_step(apply_fn: Callable, optimizer: Any, config: Any, state: Any,
                     batch: Any, mesh_axes: Mapping[str, int] | None = None, *,
                     trainable: Callable[[Any], Any] | None = None) -> tuple[Any, float]:
  """AOT-compiles ``make_train_step(apply_fn, optimizer, config, trainable=trainable)``.

  Args:
    apply_fn: the model forward (``make_apply_fn(graphdef)``).
    optimizer: the optax optimizer ``state`` was built with.
    config: the :class:`jaxrl_llm.train.TrainConfig`.
    state: the train state as shapes (``jax.eval_shape(init_train_state, ...)``).
    batch: the batch as shapes (:func:`ppo_batch`).
    mesh_axes: ``make_mesh`` axis sizes (``{"fsdp": 8}``); empty or None: one device.
    trainable: as in ``make_train_step`` (e.g. ``lora_trainable``).

  Returns:
    ``(compiled, seconds)``: the compiled executable and the lower + compile time.
  """
  import jax
  from jax.sharding import NamedSharding, PartitionSpec

  from jaxrl_llm.parallel import ambient_mesh, batch_shardings, make_mesh, state_shardings
  from jaxrl_llm.train import make_train_step, shard_apply_fn

  start = time.perf_counter()
  if not mesh_axes:
    step = make_train_step(apply_fn, optimizer, config, trainable=trainable)
    jitted = jax.jit(step, donate_argnums=0)
  else:
    axes = {"data": 1, **mesh_axes}
    mesh = make_mesh(data=axes["data"], fsdp=axes.get("fsdp", 1),
                     tensor=axes.get("tensor", 1), sequence=axes.get("sequence", 1))
    inner = make_train_step(shard_apply_fn(apply_fn, mesh), optimizer, config,
                            trainable=trainable)

    def sharded_step(state, batch):
      with ambient_mesh(mesh, batch):   # what shard_train_step does
        return inner(state, batch)

    s_shard = state_shardings(state, mesh)
    jitted = jax.jit(sharded_step, in_shardings=(s_shard, batch_shardings(batch, mesh)),
                     out_shardings=(s_shard, NamedSharding(mesh, PartitionSpec())),
                     donate_argnums=0)
  compiled = jitted.lower(state, batch).compile()
  return compiled, time.perf_counter() - start


def memory_gib(compiled: Any) -> dict:
  """Per-device GiB of a compiled step: ``total_gib`` (arguments + outputs +
  temporaries - aliased), ``temp_gib``, ``args_gib``, ``output_gib``, ``alias_gib``."""
  mem = compiled.memory_analysis()
  total = (mem.argument_size_in_bytes + mem.output_size_in_bytes
           + mem.temp_size_in_bytes - mem.alias_size_in_bytes)
  return {"total_gib": total / GIB, "temp_gib": mem.temp_size_in_bytes / GIB,
          "args_gib": mem.argument_size_in_bytes / GIB,
          "output_gib": mem.output_size_in_bytes / GIB,
          "alias_gib": mem.alias_size_in_bytes / GIB}


def num_elements(tree: Any) -> int:
  """Number of array elements in a pytree (of arrays or shapes)."""
  import jax
  return int(sum(x.size for x in jax.tree_util.tree_leaves(tree)))
