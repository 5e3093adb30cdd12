"""Save, restore and resume a whole :class:`~jaxrl_llm.train.TrainState` with orbax.

A layer over ``orbax.checkpoint.CheckpointManager`` that only hands back state it has
verified:

* **Atomic saves**: orbax writes into a temporary folder and renames it when complete,
  so an interrupted save never shadows the previous checkpoint.
* **A fingerprint with every step**: each save also writes a small JSON record of the
  state: its tree paths, shapes, dtypes, whether every leaf is finite, and two 32-bit
  checksums per leaf over the raw bits ``w_i`` (the leaf's words as ``uint32``)::

      s1 = sum_i w_i              (mod 2**32)
      s2 = sum_i (2 i + 1) w_i    (mod 2**32)

  Both are exact integer sums, so they do not depend on reduction order or on the mesh
  the state lives on (a state saved on 8 devices verifies on 1), and because ``1`` and
  ``2 i + 1`` are odd, and so invertible mod ``2**32``, *any* change of a single word
  changes both. They are computed on device by one jitted function (a collective when
  the state is sharded), so nothing is gathered to the host.
* **The step and the extra record too**: the record also holds the step it was saved
  as and a copy of the JSON ``extra`` dict, so the folder's name, the ``extra`` file
  and the record must all agree: a step folder renamed or copied, or an ``extra``
  file edited, truncated or flipped, does not verify. (The record's own entries are
  checked against the data and the ``extra`` file, so a fault in it is caught too.)
* **Verified restores with fallback**: :meth:`Checkpointer.restore` re-reads the
  record, checks the restored tree against the template and the record (structure,
  shapes, dtypes, finiteness, checksums, step, ``extra``; and a caller's own ``check``,
  e.g. that a train state's step counter is the folder's step) and, when the latest
  step fails (flipped bytes, a truncated data file, missing metadata, a non-finite
  state), logs one line naming it and falls back to the newest step that verifies.
  Orbax's own errors never escape as tracebacks: a step that cannot be read is a step
  that does not verify.
* **No links followed**: a checkpoint folder, or a step folder in it, that is a
  symbolic link is refused in one line (:class:`CheckpointError`): restoring it would
  read, and saving or rotating write or delete, files outside the checkpoint folder.
* **Never a non-finite checkpoint**: a state holding a NaN or an inf is not saved (one
  line says so), so the newest checkpoint is always one a run can go on from.
* **Rotation that keeps a good state**: ``max_to_keep`` keeps the newest N steps *and*
  the newest step that is trusted (saved with a verification record, finite at save
  time and not found bad since), so a run that starts saving garbage cannot rotate
  away its last good checkpoint. A step without a record (an older version's) restores
  with a one-line note but is never trusted; and after a restore, a run that notes
  (:meth:`Checkpointer.note_step`) that every update since was skipped saves nothing,
  so the restored state never comes back with a fresh record.
* **Restore anywhere**: restore onto the structure, dtypes and shardings of a template
  state (concrete arrays or ``jax.ShapeDtypeStruct`` leaves with shardings, see
  :func:`abstract_like`), so a state saved on one mesh can be restored on another.

A JSON ``extra`` dict (e.g. the data-stream position of a trainer) is saved alongside.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
import shutil
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxrl_llm import run_folder as rf

VERIFY_ITEM = "verify"


class CheckpointError(RuntimeError):
  """No checkpoint could be saved, or none of the requested ones verifies."""


def abstract_like(tree: Any) -> Any:
  """``jax.ShapeDtypeStruct`` of every leaf, keeping its sharding when it has one."""

  def one(x):
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

  return jax.tree_util.tree_map(one, tree)


def _words(x: jax.Array) -> jax.Array:
  """The raw bits of ``x`` as ``uint32`` words (one per element; two for 8-byte types)."""
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  size = x.dtype.itemsize
  if size == 4:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  if size == 8:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)      # adds a trailing axis of 2
  unsigned = {2: jnp.uint16, 1: jnp.uint8}[size]
  return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _linear_index(shape: tuple[int, ...]) -> jax.Array:
  """Row-major element index ``i`` of every position (``uint32``, wraps mod 2**32)."""
  idx = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(len(shape))):
    idx = idx + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(
        stride % 2**32)
    stride *= shape[axis]
  return idx


def _leaf_fingerprint(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  w = _words(x)
  odd = jnp.uint32(2) * _linear_index(w.shape) + jnp.uint32(1)
  sums = jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum(w * odd, dtype=jnp.uint32)])
  inexact = jnp.issubdtype(x.dtype, jnp.inexact)
  finite = jnp.all(jnp.isfinite(x)) if inexact else jnp.array(True)
  return sums, finite


# One leaf per call: a program over the whole state keeps each leaf's uint32 words and
# indices alive at once (2.7 GiB of temporaries for a 1.2 GiB SmolLM2 state, compiled);
# per leaf the temporaries are one leaf's. The sums are exact uint32 arithmetic, so the
# checksums are the same either way. Each call is waited for before the next: on a
# multi-process state every call is a collective, and several in flight at once
# deadlocked two gloo processes restoring onto an fsdp mesh.
_leaf_fingerprint_jit = jax.jit(_leaf_fingerprint)


def _fingerprints(leaves: list) -> tuple[list, list]:
  out = [jax.block_until_ready(_leaf_fingerprint_jit(x)) for x in leaves]
  return [o[0] for o in out], [o[1] for o in out]


def fingerprint(state: Any) -> dict:
  """The verification record of ``state``: paths, shapes, dtypes, finiteness, checksums.

  Examples:
    >>> import jax.numpy as jnp
    >>> rec = fingerprint({"w": jnp.array([1.0, 2.0]), "n": jnp.array(3)})
    >>> rec["paths"], rec["shapes"], rec["finite"]
    (["['n']", "['w']"], [[], [2]], True)
    >>> rec["checksums"][1] == fingerprint({"w": jnp.array([1.0, 2.0])})["checksums"][0]
    True
    >>> fingerprint({"w": jnp.array([1.0, jnp.inf])})["nonfinite"]
    ["['w']"]
  """
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  paths = [jax.tree_util.keystr(p) for p, _ in flat]
  leaves = [jnp.asarray(x) for _, x in flat]
  sums, finite = _fingerprints(leaves) if leaves else ([], [])
  sums = [[int(v) for v in _on_host(s)] for s in sums]
  finite = [bool(_on_host(f)) for f in finite]
  return {"paths": paths, "shapes": [list(x.shape) for x in leaves],
          "dtypes": [str(x.dtype) for x in leaves], "checksums": sums,
          "finite": all(finite),
          "nonfinite": [p for p, f in zip(paths, finite) if not f]}


def _on_host(x: jax.Array) -> np.ndarray:
  """The value of a small result on this host, also when it spans several processes
  (a multi-host state's fingerprint: replicated, so the local copy is the value)."""
  if x.is_fully_addressable:
    return np.asarray(x)
  if x.sharding.is_fully_replicated:
    return np.asarray(x.addressable_data(0))
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def verify_against(record: dict, state: Any, template: Any = None) -> str | None:
  """Why ``state`` does not match ``record`` (and ``template``), or ``None`` if it does.

  Checks, in order: tree paths, shapes and dtypes against the template and against the
  record, finiteness of every leaf, then the checksums.

  Examples:
    >>> import jax.numpy as jnp
    >>> rec = fingerprint({"w": jnp.ones(3)})
    >>> verify_against(rec, {"w": jnp.ones(3)}) is None
    True
    >>> verify_against(rec, {"w": jnp.ones(3).at[1].set(1.0000001)})
    "checksum of ['w'] differs from the one saved with this step"
  """
  got = fingerprint(state)
  if template is not None:
    want = jax.tree_util.tree_flatten_with_path(template)[0]
    want_paths = [jax.tree_util.keystr(p) for p, _ in want]
    if want_paths != got["paths"]:
      return _first_path_difference("template", want_paths, got["paths"])
    for path, (_, t), shape, dtype in zip(want_paths, want, got["shapes"], got["dtypes"]):
      t_shape = list(t.shape) if hasattr(t, "shape") else list(np.shape(t))
      t_dtype = str(jnp.dtype(t.dtype)) if hasattr(t, "dtype") else dtype
      if t_shape != shape or t_dtype != dtype:
        return f"leaf {path} is {dtype}{shape}, the template wants {t_dtype}{t_shape}"
  if record.get("paths") != got["paths"]:
    return _first_path_difference("saved record", record.get("paths") or [], got["paths"])
  for key in ("shapes", "dtypes"):
    for path, saved, now in zip(got["paths"], record[key], got[key]):
      if saved != now:
        return f"leaf {path} has {key[:-1]} {now}, saved as {saved}"
  if got["nonfinite"]:
    more = len(got["nonfinite"]) - 1
    return (f"non-finite values in {got['nonfinite'][0]}"
            + (f" and {more} other leaves" if more else ""))
  for path, saved, now in zip(got["paths"], record["checksums"], got["checksums"]):
    if list(saved) != list(now):
      return f"checksum of {path} differs from the one saved with this step"
  return None


def record_part(record: dict, part: str) -> dict:
  """The entries of a verification record under the field (or key) ``part`` of the
  saved state, with paths relative to it: the record :func:`fingerprint` gives of
  that part alone.

  Examples:
    >>> import jax.numpy as jnp
    >>> rec = fingerprint({"params": {"w": jnp.ones(2)}, "opt": jnp.zeros(3)})
    >>> record_part(rec, "params") == fingerprint({"w": jnp.ones(2)})
    True
  """
  prefixes = (f".{part}", f"[{part!r}]")
  keep, paths = [], []
  for i, path in enumerate(record.get("paths") or []):
    for prefix in prefixes:
      rest = path[len(prefix):]
      if path.startswith(prefix) and rest[:1] in ("", ".", "["):
        keep.append(i)
        paths.append(rest)
        break
  pick = lambda key: [record[key][i] for i in keep]
  nonfinite = set(record.get("nonfinite", ()))
  bad = [rest for i, rest in zip(keep, paths) if record["paths"][i] in nonfinite]
  return {"paths": paths, "shapes": pick("shapes"), "dtypes": pick("dtypes"),
          "checksums": pick("checksums"), "finite": not bad, "nonfinite": bad}


def _first_path_difference(what: str, want: list, got: list) -> str:
  missing = [p for p in want if p not in got]
  extra = [p for p in got if p not in want]
  if missing:
    return f"tree differs from the {what}: {missing[0]} is missing"
  if extra:
    return f"tree differs from the {what}: unexpected leaf {extra[0]}"
  return f"tree differs from the {what}: leaves in another order"


def _well_formed(record: Any) -> bool:
  """Whether ``record`` is a verification record :func:`fingerprint` could have written
  (not a damaged one: a key's name flipped, a list cut short)."""
  keys = ("paths", "shapes", "dtypes", "checksums")
  return (isinstance(record, dict) and all(isinstance(record.get(k), list) for k in keys)
          and len({len(record[k]) for k in keys}) == 1
          and isinstance(record.get("finite"), bool)
          and isinstance(record.get("nonfinite", []), list)
          and all(isinstance(c, list) and len(c) == 2 for c in record["checksums"]))


def _canonical(value: Any) -> str:
  return json.dumps(value, sort_keys=True)


def _header_problem(record: dict, step: int, extra: dict) -> str | None:
  """Why the step and the ``extra`` dict restored from folder ``step`` do not match
  its record (records of older versions hold neither: nothing to compare), or None."""
  saved = record.get("step")
  if saved is not None and saved != step:
    return f"its verification record was saved as step {saved!r}"
  if "extra" not in record or _canonical(record["extra"]) == _canonical(extra):
    return None
  saved_extra = record["extra"] if isinstance(record["extra"], dict) else {}
  missing = object()
  one_sided = lambda key: key not in extra or key not in saved_extra
  for key in sorted(set(extra) | set(saved_extra), key=lambda k: (one_sided(k), k)):
    now, then = extra.get(key, missing), saved_extra.get(key, missing)
    if now is missing or then is missing or _canonical(now) != _canonical(then):
      show = lambda v: "missing" if v is missing else _short(v)
      return (f"its extra record's {key!r} is {show(now)}, saved as {show(then)} with "
              "this step")
  return "its extra record differs from the one saved with this step"


def _short(value: Any, limit: int = 60) -> str:
  text = _canonical(value)
  return text if len(text) <= limit else text[:limit - 3] + "..."


def _one_line(exc: BaseException, limit: int = 160) -> str:
  text = " ".join(str(exc).split()) or type(exc).__name__
  if len(text) > limit:
    text = text[:limit - 3] + "..."
  return f"{type(exc).__name__}: {text}"


def _stderr(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


class Checkpointer:
  """Verified checkpoints of a train state in ``directory`` (one sub-folder per step).

  Args:
    directory: where the step folders go (created if missing).
    max_to_keep: keep the newest ``max_to_keep`` steps, plus the newest trusted one
      (finite at save time and not found bad on restore) if it is older; ``None``
      keeps all.
    save_interval_steps: orbax's interval; :meth:`save` of other steps returns
      ``False`` unless ``force``.
    async_save: write in a background thread (every :meth:`save` still waits for it).
    log: called with each one-line message (a checkpoint that failed verification,
      rotation notes); default: print to stderr.
    stamp: JSON data added to the ``extra`` of every step saved (under its own keys;
      a :meth:`save`'s ``extra`` wins a clash): e.g. which run the state belongs to,
      as the training loop records it (``{"run": RunConfig.identity()}``). A value
      may be a function of no arguments, called at each save (live data: the loop's
      learning-signal watch).

  Raises:
    CheckpointError: ``directory`` is a symbolic link (one line).

  Examples:
    >>> import tempfile, jax.numpy as jnp
    >>> ckpt = Checkpointer(tempfile.mkdtemp(), max_to_keep=2)
    >>> ckpt.save(1, {"w": jnp.ones(3)}, extra={"epoch": 0})
    True
    >>> state, extra = ckpt.restore({"w": jnp.zeros(3)})
    >>> float(state["w"].sum()), extra, ckpt.restored_step
    (3.0, {'epoch': 0}, 1)
    >>> ckpt.close()
  """

  def __init__(self, directory: str, *, max_to_keep: int | None = 3,
               save_interval_steps: int = 1, async_save: bool = False,
               log: Callable[[str], None] | None = None,
               stamp: dict | None = None) -> None:
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"`max_to_keep` must be >= 1 or None, got {max_to_keep}.")
    self.directory = os.path.abspath(directory)
    if os.path.islink(self.directory):
      raise CheckpointError(
          f"checkpoint folder {self.directory} is a symbolic link (to "
          f"{os.readlink(self.directory)}); the checkpointer writes and deletes step "
          "folders only in a folder of its own: remove the link or pass the folder it "
          "points to")
    self.max_to_keep = max_to_keep
    self.log = log or _stderr
    self.stamp = dict(stamp or {})
    self.bad_steps: dict[int, str] = {}
    self.restored_step: int | None = None
    self._records: dict[int, dict] = {}
    self._steps_since_restore = 0        # note_step calls since the restore ...
    self._learned_since_restore = False  # ... and whether one of them applied an update
    # Rotation is done here (see _rotate), not by orbax, so it can spare a good step.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None, save_interval_steps=save_interval_steps, create=True,
        enable_async_checkpointing=async_save)
    try:
      self._manager = ocp.CheckpointManager(self.directory, options=options)
    except OSError as e:
      raise CheckpointError(f"cannot use checkpoint folder {self.directory}: "
                            f"{_one_line(e)}") from None

  # ------------------------------------------------------------------------- save

  def save(self, step: int, state: Any, *, extra: dict | None = None,
           force: bool = False) -> bool:
    """Saves ``state`` (and JSON ``extra``) as ``step``; returns whether it saved.

    A state holding a NaN or an inf is never written (one line logged, returns
    ``False``): a checkpoint to resume from is a finite one. A step that exists
    already is kept (returns ``False``), as orbax does not save a step older than its
    newest one; steps from ``step`` on that failed verification
    in :meth:`restore` are deleted first (logged), so a run that fell back to an
    older checkpoint saves its new steps in their place.

    Ctrl-C (SIGINT) while the step is written does not tear the save: it is held (one
    line says so) until the step is complete and rotated, then handed to the handler
    that was in place (Python's raises ``KeyboardInterrupt``; a
    :class:`~jaxrl_llm.run_folder.GracefulStop` that is already stopping, whose save
    this is, needs nothing more). A save never leaves its temporary folder behind.

    Raises:
      CheckpointError: the save failed (full disk, unwritable folder, ...); one line
        naming the folder and the operating-system cause (``no space left on device
        (ENOSPC)``). Orbax's background-thread error logs are silenced during the
        save, and the failed step's temporary folder is removed.
    """
    step = int(step)
    if (self.restored_step is not None and self._steps_since_restore
        and not self._learned_since_restore):
      self.log(f"not saving step {step}: every update since the restore of step "
               f"{self.restored_step} was skipped (non-finite values), so its state is the "
               f"restored one; {self._step_dir(self.restored_step)} stays the newest "
               "checkpoint")
      return False
    with _HoldInterrupts(self.log, step):
      return self._save(step, state, extra, force)

  def note_step(self, skipped: bool) -> None:
    """Tells the checkpointer whether the train step just done applied no update.

    After a :meth:`restore`, once steps have been noted and every one was ``skipped``
    (its updates refused as non-finite), :meth:`save` saves nothing and rotates
    nothing out: the state is the restored one, maybe garbage that a checkpoint
    without a record let through, and a new step would give it a fresh record and
    could push the last verified checkpoint out. Callers that never note steps save
    as before.
    """
    self._steps_since_restore += 1
    self._learned_since_restore = self._learned_since_restore or not skipped

  def _save(self, step: int, state: Any, extra: dict | None, force: bool, *,
            nonfinite_ok: bool = False) -> bool:
    self._refuse_linked_steps()
    for s in self.all_steps():
      if s >= step and s in self.bad_steps:      # replaced by the run that went on
        self.log(f"removing unusable checkpoint {self._step_dir(s)} "
                 f"({self.bad_steps.pop(s)})")
        self._manager.delete(s)
        self._records.pop(s, None)
    if step in self.all_steps():
      return False
    extra = {**{k: v() if callable(v) else v for k, v in self.stamp.items()}, **(extra or {})}
    try:                 # the copy of extra in the record is what a restore reads back
      saved_extra = json.loads(json.dumps(extra))
    except (TypeError, ValueError) as e:
      raise ValueError(f"`extra` must be JSON data: {e}") from None
    record = {**fingerprint(state), "step": step, "extra": saved_extra}
    if not record["finite"] and not nonfinite_ok:
      self._refuse_nonfinite(step, record["nonfinite"])
      return False
    args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                              extra=ocp.args.JsonSave(extra),
                              **{VERIFY_ITEM: ocp.args.JsonSave(record)})
    with _quiet_orbax():
      try:
        saved = self._manager.save(step, args=args, force=force)
        self._manager.wait_until_finished()
      except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise bare Exception
        self._discard_partial(step)
        raise CheckpointError(f"cannot save checkpoint step {step} in {self.directory}: "
                              f"{_save_failure(e)}") from None
    if saved:
      self._records[step] = record
      self.bad_steps.pop(step, None)
      self._rotate()
    return bool(saved)

  def _refuse_nonfinite(self, step: int, leaves: list[str]) -> None:
    """Logs, in one line, that ``step`` is not saved: its state holds NaN or inf."""
    more = f" and {len(leaves) - 1} other leaves" if len(leaves) > 1 else ""
    good = [s for s in self.all_steps() if s < step and self.trusted(s)]
    keep = (f"{self._step_dir(good[-1])} stays the newest good checkpoint" if good
            else "no checkpoint is written")
    self.log(f"not saving step {step}: its state holds non-finite values (NaN or inf) "
             f"in {leaves[0]}{more}; {keep}")

  def _discard_partial(self, step: int) -> None:
    """Removes what a failed save of ``step`` left: its temporary folder (the space a
    full disk needs back), once orbax's background writes have stopped."""
    with contextlib.suppress(Exception):  # noqa: BLE001 - the failure is being reported already
      self._manager.wait_until_finished()
    pattern = glob.escape(self._step_dir(step)) + _TMP_SUFFIX + "*"
    # Orbax gives up at the first failed write while the others are still in flight,
    # and those can finish, re-creating files, after the folder is removed: look again
    # a few times (about 1.5 s in all, on this failure path only).
    for delay in (0.0, 0.05, 0.1, 0.2, 0.4, 0.8):
      time.sleep(delay)
      for path in glob.glob(pattern):
        shutil.rmtree(path, ignore_errors=True)

  def _step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def _record(self, step: int) -> dict | None:
    """The verification record saved with ``step`` (``None`` if absent or unreadable)."""
    if step not in self._records:
      if not os.path.isdir(os.path.join(self._step_dir(step), VERIFY_ITEM)):
        return None
      try:
        got = self._manager.restore(step, args=ocp.args.Composite(
            **{VERIFY_ITEM: ocp.args.JsonRestore()}))[VERIFY_ITEM]
      except Exception:  # noqa: BLE001 - an unreadable record is a missing one
        return None
      if not _well_formed(got):                # e.g. a key's name flipped: damaged
        return None
      self._records[step] = dict(got)
    return self._records[step]

  def trusted(self, step: int) -> bool:
    """Whether ``step`` counts as a good state for rotation (see the class doc)."""
    if step in self.bad_steps:
      return False
    record = self._record(step)
    return record is not None and bool(record.get("finite"))

  def _rotate(self) -> None:
    if self.max_to_keep is None:
      return
    steps = sorted(self.all_steps())
    keep = set(steps[-self.max_to_keep:])
    good = next((s for s in reversed(steps) if self.trusted(s)), None)
    if good is not None:
      keep.add(good)
    for s in steps:
      if s not in keep:
        self._manager.delete(s)
        self._records.pop(s, None)
        self.bad_steps.pop(s, None)

  # ---------------------------------------------------------------------- restore

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def restore(self, template: Any, step: int | None = None, *,
              fallback: bool = True, part: str | None = None,
              check: Callable[[int, Any, dict], str | None] | None = None
              ) -> tuple[Any, dict]:
    """Restores ``(state, extra)`` from ``step`` (default: the newest that verifies).

    ``template`` is a state of the right structure: concrete arrays, or
    ``jax.ShapeDtypeStruct`` leaves (see :func:`abstract_like`) whose ``sharding``
    says where each restored leaf goes, e.g. onto a different mesh than at save time.

    ``part`` names one field (or key) of the saved state, e.g. ``"params"`` of a
    :class:`~jaxrl_llm.train.TrainState`: then ``template`` is that part's template,
    only its arrays are read (an optimizer's moments are never loaded: what export
    and eval need, in a third of the memory) and the result is the part, verified
    against the leaves of the record under it.

    ``check(step, state, extra)``: the caller's own test of a candidate that passed
    verification, the reason it is unusable or ``None`` (the training loop's: the
    ``extra`` step and the state's step counter are the folder's step); a candidate
    it refuses falls back like a corrupt one.

    Every candidate is verified (see the module doc). With ``step=None`` and
    ``fallback``, a step that fails is logged in one line naming it, recorded in
    ``bad_steps``, and the next older step is tried; ``restored_step`` tells which
    step was returned. Checkpoints saved without a record (older versions, or a lost
    ``verify/`` folder) are only checked against the template and for finiteness, and
    restoring one logs a line saying so; they never count as trusted for rotation, so
    the newest verified step is kept beside them.

    Raises:
      FileNotFoundError: the folder holds no checkpoint.
      CheckpointError: no candidate verifies (the message lists each one's reason),
        or a step folder is a symbolic link.
    """
    self._refuse_linked_steps()
    steps = self.all_steps()
    if not steps:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    if step is not None:
      candidates = [int(step)]
    else:
      candidates = sorted(steps, reverse=True)
      if not fallback:
        candidates = candidates[:1]
    failures = []
    for s in candidates:
      result, reason = self._restore_verified(template, s, part)
      if reason is None and check is not None:
        reason = check(s, *result)
      if reason is None:
        self.restored_step = s
        self._steps_since_restore, self._learned_since_restore = 0, False
        if self._record(s) is None:
          self.log(f"checkpoint {self._step_dir(s)} has no verification record (saved "
                   f"before records existed, or its {VERIFY_ITEM}/ folder is missing): "
                   "restored it checked only against the template and for finite values")
        return result
      self.bad_steps[s] = reason
      failures.append(f"step {s} ({reason})")
      if step is None and fallback and s != candidates[-1]:
        self.log(f"checkpoint {self._step_dir(s)} is unusable ({reason}); falling back "
                 "to an older checkpoint")
    raise CheckpointError(f"no usable checkpoint in {self.directory}: "
                          + "; ".join(failures))

  def _restore_verified(self, template: Any, step: int, part: str | None = None
                        ) -> tuple[Any, str | None]:
    if step not in self.all_steps():
      return None, "no such step"
    record = self._record(step)
    if part is None:
      args: Any = ocp.args.StandardRestore(abstract_like(template))
    else:
      item = {part: abstract_like(template)}
      args = ocp.args.PyTreeRestore(
          item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
          partial_restore=True)
    _silence_abandoned_writes()                  # and the reads of a step that fails
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(
          state=args, extra=ocp.args.JsonRestore()))
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise bare Exception
      return None, f"cannot be read: {_one_line(_root_cause(e))}"
    state, extra = restored["state"], restored["extra"]
    if extra is None:
      extra = {}
    if not isinstance(extra, dict):
      return None, f"its extra record is not a JSON object ({type(extra).__name__})"
    if record is None and os.path.isdir(os.path.join(self._step_dir(step), VERIFY_ITEM)):
      return None, "its verification record cannot be read (or is damaged)"
    reason = _header_problem(record, step, extra) if record is not None else None
    if reason is not None:
      return None, reason
    if part is not None:
      state = state[part]
      record = None if record is None else record_part(record, part)
    if record is None:
      record = fingerprint(state)                # legacy step: structure + finiteness
    reason = verify_against(record, state, template)
    return (state, extra), reason

  def _refuse_linked_steps(self) -> None:
    """Raises :class:`CheckpointError` when a step folder is a symbolic link (a missing
    folder is orbax's to report)."""
    step = rf.linked_step_folder(self.directory)
    if step is not None:
      raise CheckpointError(rf.linked_step_message(step))

  def close(self) -> None:
    self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()


_TMP_SUFFIX = ".orbax-checkpoint-tmp"     # orbax's name for a step folder being written
_OS_CODE = re.compile(r"os_error_code='?(\d+)|\[Errno (\d+)\]")


def _chain(exc: BaseException) -> list[BaseException]:
  """``exc`` and its causes / contexts, outermost first."""
  out: list[BaseException] = []
  cur: BaseException | None = exc
  while cur is not None and all(cur is not e for e in out):
    out.append(cur)
    cur = cur.__cause__ or cur.__context__
  return out


def _os_cause(exc: BaseException) -> OSError | None:
  """The operating-system error behind ``exc``: an ``OSError`` in its chain, or the
  errno that tensorstore writes into its message (``[os_error_code='28']``)."""
  for e in reversed(_chain(exc)):
    if isinstance(e, OSError) and e.errno:
      return e
  for e in reversed(_chain(exc)):
    match = _OS_CODE.search(str(e))
    if match:
      code = int(match.group(1) or match.group(2))
      return OSError(code, os.strerror(code))
  return None


def _save_failure(exc: BaseException) -> str:
  """Why a save failed, in one line: the OS cause when there is one (``no space left on
  device (ENOSPC); ...``), else the innermost error, shortened."""
  cause = _os_cause(exc)
  if cause is not None:
    return rf.os_reason(cause)
  return _one_line(_root_cause(exc))


class _HoldInterrupts:
  """Within (main thread only): SIGINT is held, not raised, and handed on at the end.

  An interrupt raised inside orbax's save abandons its background writes half done
  (two tracebacks at interpreter exit, the step lost, ``<step>.orbax-checkpoint-tmp``
  left behind). Held, the first SIGINT logs one line; on a clean exit it is delivered
  to the previous handler, unless that is a :class:`~jaxrl_llm.run_folder.GracefulStop`
  already stopping (its stop is this save's reason). A save that fails raises its own
  error instead.
  """

  def __init__(self, log: Callable[[str], None], step: int):
    self.log, self.step = log, step
    self.pending = False
    self.previous: Any = None

  def _hold(self, signum: int, frame: Any) -> None:
    if not self.pending:
      self.pending = True
      self.log(f"Ctrl-C: the checkpoint of step {self.step} is being written; the "
               "interrupt takes effect once it is complete")

  def __enter__(self) -> _HoldInterrupts:
    if threading.current_thread() is threading.main_thread():
      previous = signal.getsignal(signal.SIGINT)
      if callable(previous):                     # not SIG_DFL / SIG_IGN: leave those be
        self.previous = previous
        signal.signal(signal.SIGINT, self._hold)
    return self

  def __exit__(self, exc_type: Any, *exc: object) -> None:
    if self.previous is None:
      return
    signal.signal(signal.SIGINT, self.previous)
    if not self.pending or exc_type is not None:
      return
    owner = getattr(self.previous, "__self__", None)
    if isinstance(owner, rf.GracefulStop) and owner.requested:
      return                                     # already stopping after this save
    self.previous(signal.SIGINT, None)           # e.g. raises KeyboardInterrupt


class _DropOrbaxErrors(logging.Filter):
  """Drops orbax's own error logs (tracebacks of its background threads)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.levelno >= logging.ERROR and "orbax" in record.pathname)


def _through_orbax(tb: Any) -> bool:
  return any("orbax" in frame.filename for frame in traceback.extract_tb(tb))


class _DropAbandonedOrbaxTasks(logging.Filter):
  """Drops asyncio's "exception was never retrieved" for orbax's write tasks: when one
  write fails, orbax stops waiting for its sibling writes, whose own failures (the same
  full disk) are then logged, with tracebacks, whenever they are garbage-collected."""

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info
    return not ("exception was never retrieved" in str(record.msg) and exc is not None
                and _abandoned_write(exc[1], exc[2]))


def _abandoned_write(exc: BaseException | None, tb: Any) -> bool:
  """A failure of one of orbax's writes: raised through orbax's code (a ``Task``), or
  set on a bare ``Future`` by tensorstore (no traceback) with the path of orbax's
  temporary step folder in its message."""
  if tb is not None and _through_orbax(tb):
    return True
  return exc is not None and _TMP_SUFFIX in str(exc)


def _quiet_unraisable(previous: Callable[[Any], None]) -> Callable[[Any], None]:
  def hook(unraisable: Any) -> None:
    exc, tb = unraisable.exc_value, unraisable.exc_traceback
    if (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed" and tb
        is not None and traceback.extract_tb(tb)[0].name == "call_soon_threadsafe"):
      return                # a write orbax abandoned completes after its loop closed
    code = getattr(unraisable.object, "cr_code", None)
    if (code is not None and "orbax" in code.co_filename
        and str(exc).startswith(_ABANDONED_READ)):
      return                # a read orbax abandoned when a sibling read failed, closed
    previous(unraisable)
  return hook


def _silence_abandoned_writes() -> None:
  """Keeps the writes that orbax abandons on a failed save from printing tracebacks.

  When one tensorstore write fails (``ENOSPC``), orbax raises at once and closes its
  event loop while the other writes are still in flight. Each then fails on its own,
  later, from a tensorstore thread: its completion callback finds the loop closed
  (an unraisable ``RuntimeError: Event loop is closed``, printed as a bare
  traceback), and its task, garbage-collected, logs "Task exception was never
  retrieved" (a bare ``Future`` that tensorstore failed says "Future exception ...",
  with no traceback); a write that had not started leaves an unawaited orbax
  serialization coroutine (a ``RuntimeWarning``, often at exit). The failure itself is
  reported once by :meth:`Checkpointer.save`; these echoes are dropped (only these: the
  unraisable hook, the ``asyncio`` logger and the warnings filter pass everything else
  on). Installed by the first save (the echoes can come before orbax reports the
  failure, and after); the hook only over Python's default one.

  A restore that fails the same way (a truncated or flipped data file) abandons its
  sibling reads: each, closed unfinished, raises "Encountered error while reading
  array index" from its coroutine, printed as a traceback (three of them for one bad
  file). The failed step is reported once (the fallback line); those are dropped too.
  """
  global _ASYNCIO_FILTERED
  if not _ASYNCIO_FILTERED:
    logging.getLogger("asyncio").addFilter(_DropAbandonedOrbaxTasks())
    _ASYNCIO_FILTERED = True
  # An abandoned write that never started: its coroutine is collected unawaited, often
  # at exit ("sys:1: RuntimeWarning: coroutine ... was never awaited"). Added at every
  # save (an identical filter moves to the front rather than piling up).
  warnings.filterwarnings("ignore", message=_ABANDONED_COROUTINE, category=RuntimeWarning)
  if sys.unraisablehook is sys.__unraisablehook__:    # leave a hook someone set alone
    sys.unraisablehook = _quiet_unraisable(sys.unraisablehook)


_ASYNCIO_FILTERED = False
_ABANDONED_COROUTINE = r"coroutine 'async_serialize\w*\.<locals>\.\w+' was never awaited"
_ABANDONED_READ = "Encountered error while reading array index"


@contextlib.contextmanager
def _quiet_orbax():
  """Within: orbax's background-thread error logs are dropped. The failure they
  describe reaches :meth:`Checkpointer.save` as an exception and is reported once,
  in one line, as a :class:`CheckpointError`."""
  _silence_abandoned_writes()
  drop = _DropOrbaxErrors()
  loggers = [logging.getLogger("absl"), logging.getLogger("orbax")]
  for lg in loggers:
    lg.addFilter(drop)
  try:
    yield
  finally:
    for lg in loggers:
      lg.removeFilter(drop)


def _root_cause(exc: BaseException) -> BaseException:
  """The innermost cause of a chained exception (where orbax hides ``ENOSPC``)."""
  seen = set()
  while True:
    nxt = exc.__cause__ or exc.__context__
    if nxt is None or id(nxt) in seen:
      return exc
    seen.add(id(exc))
    exc = nxt


__all__ = ["Checkpointer", "CheckpointError", "abstract_like", "fingerprint", "record_part",
           "verify_against"]
