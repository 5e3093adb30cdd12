"""Save, restore and resume a whole :class:`~jaxrl_llm.train.TrainState` with orbax.

A thin layer over ``orbax.checkpoint.CheckpointManager``: keep-last-N, atomic saves
(orbax writes to a temporary folder and renames it when complete, so an interrupted
save never shadows the previous checkpoint), and restore onto the structure, dtypes and
shardings of a template state, so a state saved on one mesh can be restored on another.
A JSON ``extra`` dict (e.g. the data-stream position of a trainer) is saved alongside.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp


def abstract_like(tree):
  """``jax.ShapeDtypeStruct`` of every leaf, keeping its sharding when it has one."""

  def one(x):
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

  return jax.tree_util.tree_map(one, tree)


class Checkpointer:
  """Checkpoints of a train state in ``directory`` (one sub-folder per step).

  Examples:
    >>> import tempfile, jax.numpy as jnp
    >>> ckpt = Checkpointer(tempfile.mkdtemp(), max_to_keep=2)
    >>> ckpt.save(1, {"w": jnp.ones(3)}, extra={"epoch": 0})
    True
    >>> state, extra = ckpt.restore({"w": jnp.zeros(3)})
    >>> float(state["w"].sum()), extra
    (3.0, {'epoch': 0})
    >>> ckpt.close()
  """

  def __init__(self, directory: str, *, max_to_keep: Optional[int] = 3,
               save_interval_steps: int = 1, async_save: bool = False):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, save_interval_steps=save_interval_steps, create=True,
        enable_async_checkpointing=async_save)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def save(self, step: int, state: Any, *, extra: Optional[dict] = None,
           force: bool = False) -> bool:
    """Saves ``state`` (and JSON ``extra``) as ``step``; returns whether it saved."""
    args = {"state": ocp.args.StandardSave(state)}
    args["extra"] = ocp.args.JsonSave(extra or {})
    saved = self._manager.save(int(step), args=ocp.args.Composite(**args), force=force)
    self._manager.wait_until_finished()
    return bool(saved)

  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def restore(self, template: Any, step: Optional[int] = None):
    """Restores ``(state, extra)`` from ``step`` (default: the latest).

    ``template`` is a state of the right structure: concrete arrays, or
    ``jax.ShapeDtypeStruct`` leaves (see :func:`abstract_like`) whose ``sharding``
    says where each restored leaf goes, e.g. onto a different mesh than at save time.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    restored = self._manager.restore(int(step), args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_like(template)),
        extra=ocp.args.JsonRestore()))
    return restored["state"], dict(restored["extra"] or {})

  def close(self) -> None:
    self._manager.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
