"""This process's share of a multi-host run (``jax.distributed``: one process per host).

Every process runs the same loop. A step's prompts are drawn identically everywhere
(from ``(seed, step)``); process ``p`` generates, scores and scores the log-probs of
only its rows of the global batch, the rows the mesh's data axes give its devices
(:meth:`Processes.row_range`: a contiguous block, whole groups), and feeds them to
:func:`jaxrl_llm.parallel.shard_batch`. What needs the whole batch (the reward and
accuracy means, group and batch baselines) is computed from small all-gathered
per-row arrays (:meth:`Processes.gather`), so every process computes the same
advantages as one process would. In a single process every method is the identity
and no collective runs.

Examples:
  >>> procs = Processes()
  >>> procs.count, procs.primary, procs.row_range(8, None)
  (1, True, (0, 8))
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


class Processes:
  """``jax.process_index()`` / ``jax.process_count()`` and the collectives of the loop."""

  def __init__(self) -> None:
    self.index = jax.process_index()
    self.count = jax.process_count()

  @property
  def primary(self) -> bool:
    """Process 0: the one that writes the run folder, metrics and progress."""
    return self.index == 0

  @property
  def multi(self) -> bool:
    return self.count > 1

  def row_range(self, rows: int, mesh: Any) -> tuple[int, int]:
    """``[lo, hi)``: the rows of a ``rows``-row global batch this process feeds.

    Raises:
      ValueError: this process's rows are not one contiguous block in process order
        (a mesh whose data axes interleave the processes' devices).
    """
    if not self.multi:
      return 0, rows
    from jax.sharding import NamedSharding

    from jaxrl_llm.parallel.sharding import batch_spec
    spec = batch_spec((rows, 1), mesh)
    index = NamedSharding(mesh, spec).addressable_devices_indices_map((rows, 1))
    spans = {idx[0].indices(rows)[:2] for idx in index.values()}  # type: ignore[index]
    lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
    share = rows // self.count
    if sum(b - a for a, b in spans) != hi - lo or (lo, hi) != (self.index * share,
                                                              (self.index + 1) * share):
      raise ValueError(f"process {self.index}'s batch rows {sorted(spans)} are not the "
                       f"contiguous block {self.index * share}-{(self.index + 1) * share} "
                       f"of the {rows}-row batch; use a mesh whose data axes follow "
                       "the processes (the default make_mesh order)")
    return lo, hi

  def gather(self, tree: Any) -> Any:
    """Every process's ``tree`` of numpy arrays (equal shapes), concatenated along
    axis 0 in process order (a collective: every process calls it)."""
    if not self.multi:
      return tree
    from jax.experimental import multihost_utils
    out = multihost_utils.process_allgather(tree, tiled=True)
    return jax.tree_util.tree_map(np.asarray, out)

  def gather_uneven(self, values: np.ndarray, sizes: list[int]) -> np.ndarray:
    """The processes' 1-d ``values`` of lengths ``sizes`` (this process's is
    ``sizes[index]``), concatenated in process order."""
    if not self.multi:
      return np.asarray(values)
    width = max(sizes)
    padded = np.zeros((width,), np.asarray(values).dtype)
    padded[:len(values)] = values
    got = self.gather(padded[None])
    return np.concatenate([got[p, :n] for p, n in enumerate(sizes)])

  def agree_stop(self, signum: int | None) -> int:
    """The stop signal every process acts on: the largest signal number any process
    received (0: none). A collective in a multi-process run, called once per step, so
    every process checkpoints the same step."""
    if not self.multi:
      return int(signum or 0)
    got = self.gather(np.array([int(signum or 0)], np.int32))
    return int(np.max(got))

  def barrier(self, name: str) -> None:
    """Waits until every process reaches the barrier ``name``."""
    if self.multi:
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices(name)

  def local(self, tree: Any) -> Any:
    """``tree`` with every leaf on this process's devices (what a process-local
    computation such as generation takes): an array replicated over the processes
    gives its local copy (a view: read it before the train step donates the state),
    one sharded across them is all-gathered. The identity in one process."""
    if not self.multi:
      return tree
    from jax.experimental import multihost_utils

    def one(x: Any) -> Any:
      if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return x
      if x.sharding.is_fully_replicated:
        return x.addressable_data(0)
      return jax.numpy.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree_util.tree_map(one, tree)


def check_multiprocess(run: Any, resolved: Any, count: int, device_count: int) -> None:
  """One-line ``ValueError`` for a run setting that a ``count``-process run does not
  support (yet), or a batch that does not split into whole groups per process.

  Examples:
    >>> from jaxrl_llm.loop.config import RunConfig
    >>> from jaxrl_llm.loop.resolve import resolve
    >>> run = RunConfig(prompts_per_step=3)
    >>> try:
    ...   check_multiprocess(run, resolve(run), 2, 4)
    ... except ValueError as e:
    ...   print(str(e)[:62])
    --prompts-per-step 3 must be a multiple of the 2 processes (ea
  """
  import dataclasses
  unsupported = [(run.rollout != "engine", f"--rollout {run.rollout} (its draws are "
                  "keyed by batch position; use --rollout engine)"),
                 (run.partial_rollouts, "--partial-rollouts"),
                 (run.async_rollouts, "--async"),
                 (run.pack, "--pack (each process would pack its rows into its own "
                  "row count)"),
                 (resolved.sampling.dynamic_sampling, "dynamic sampling (--algo dapo or "
                  "--dynamic-sampling; add --no-dynamic-sampling)")]
  for bad, what in unsupported:
    if bad:
      raise ValueError(f"{what} is not supported in a multi-process run ({count} "
                       "processes) yet; run it on one process")
  if run.prompts_per_step % count:
    raise ValueError(f"--prompts-per-step {run.prompts_per_step} must be a multiple of "
                     f"the {count} processes (each generates whole groups of its share)")
  if (run.mesh_data, run.mesh_fsdp, run.mesh_tensor) == (1, 1, 1):
    run = dataclasses.replace(run, mesh_data=-1)   # the default: data over every device
  run.check_devices(device_count)


def host_value(x: Any) -> np.ndarray:
  """A replicated array's value on this host (``np.asarray`` of its local copy when it
  spans several processes)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return np.asarray(x.addressable_data(0))
  return np.asarray(x)


__all__ = ["Processes", "host_value", "check_multiprocess"]
