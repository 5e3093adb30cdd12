"""Parallel primitives: meshes, sharding rules, ring attention, sequence-parallel GAE /
log-probs, pmap device-axis helpers, multi-host initialisation and watchdog.

Data parallel, FSDP and tensor parallel layouts are all ``jax.jit`` with shardings
derived from the parameters' logical axis names through a rules table
(:func:`make_rules`, :func:`state_shardings`, :func:`shard_batch`); the train steps
built on them (``shard_train_step``, ``shard_apply_fn``, ``make_pmap_train_step``) live
in the train package, above this one: nothing here imports the models or the train
step. The same code runs on one CPU, one accelerator, or a multi-host mesh.

Importing this package registers :func:`ring_attention` as the ``"ring"``
implementation of :func:`jaxrl_llm.dot_product_attention`; the model uses it whenever
the ambient mesh has a ``sequence`` axis > 1 (:func:`ambient_mesh`; the sharded train
step sets it), so the whole train step is split over the tokens.
"""

from jaxrl_llm.parallel.mesh import MESH_AXES, make_mesh, mesh_axis_sizes
from jaxrl_llm.parallel.multihost import (
    gather_to_host,
    initialize_multihost,
    resolve_multihost_args,
    resolve_timeouts,
    shutdown_multihost,
)
from jaxrl_llm.parallel.pmap import replicate, split_batch, unreplicate
from jaxrl_llm.parallel.ring import ring_attention, ring_dot_product_attention
from jaxrl_llm.parallel.sequence import sequence_parallel_gae, sequence_parallel_token_logprobs
from jaxrl_llm.parallel.sharding import (
    DEFAULT_RULES,
    ambient_mesh,
    batch_shardings,
    batch_spec,
    batch_specs,
    host_local_batch,
    logical_to_spec,
    make_rules,
    param_shardings,
    param_specs,
    put_sharded,
    shard_batch,
    sharding_summary,
    state_shardings,
    state_specs,
)

__all__ = [
    "MESH_AXES", "make_mesh", "mesh_axis_sizes",
    "DEFAULT_RULES", "make_rules", "logical_to_spec", "param_specs", "param_shardings",
    "state_specs", "state_shardings", "batch_spec", "batch_specs", "batch_shardings",
    "shard_batch", "host_local_batch", "put_sharded", "sharding_summary", "ambient_mesh",
    "replicate", "unreplicate", "split_batch",
    "sequence_parallel_gae", "sequence_parallel_token_logprobs",
    "ring_attention", "ring_dot_product_attention",
    "initialize_multihost", "resolve_multihost_args", "gather_to_host",
    "resolve_timeouts", "shutdown_multihost",
]
