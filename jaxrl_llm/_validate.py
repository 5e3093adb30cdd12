"""Trace-time argument checks shared by every public function.

All checks look only at static metadata (shape, dtype), so they are safe under
``jax.jit`` and raise a ``ValueError`` that names the offending argument. JAX is
imported inside the array checks, so the configs (which use :func:`check_choice`)
import without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeGuard

if TYPE_CHECKING:   # JAX is imported inside the checks (see the module's docstring)
  import jax
  from jax.typing import DTypeLike


def shape_of(x: Any) -> tuple[int, ...]:
  import jax.numpy as jnp
  return tuple(jnp.shape(x))


def check_rank(name: str, x: Any, rank: int) -> None:
  import jax.numpy as jnp
  if jnp.ndim(x) != rank:
    raise ValueError(
        f"`{name}` must have rank {rank}, got shape {shape_of(x)} (rank {jnp.ndim(x)})."
    )


def check_same_shape(names: Sequence[str], arrays: Sequence) -> None:
  """Raises unless every array in `arrays` has the shape of the first one."""
  first_name, first = names[0], arrays[0]
  for name, x in zip(names[1:], arrays[1:]):
    if x is not None and shape_of(x) != shape_of(first):
      raise ValueError(
          f"`{name}` must have the shape of `{first_name}` {shape_of(first)}, "
          f"got {shape_of(x)}."
      )


def check_float(name: str, x: Any) -> None:
  import jax.numpy as jnp
  if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
    raise ValueError(
        f"`{name}` must be a floating-point array, got dtype {jnp.result_type(x)} "
        f"with shape {shape_of(x)}."
    )


def check_choice(name: str, value: Any, choices: Sequence) -> None:
  if value not in choices:
    raise ValueError(f"`{name}` must be one of {list(choices)}, got {value!r}.")


def check_batch_vector(name: str, x: Any, batch: int) -> None:
  """Checks a per-sequence array of shape [B]."""
  if shape_of(x) != (batch,):
    raise ValueError(f"`{name}` must have shape ({batch},), got {shape_of(x)}.")


def as_f32(x: Any) -> jax.Array:
  import jax.numpy as jnp
  return jnp.asarray(x, dtype=jnp.float32)


def out_dtype(*xs: Any) -> DTypeLike:
  """The float dtype results are cast back to: that of the first float input."""
  import jax.numpy as jnp
  for x in xs:
    if x is not None and jnp.issubdtype(jnp.result_type(x), jnp.floating):
      return jnp.result_type(x)
  return jnp.float32


def is_concrete_number(x: Any) -> TypeGuard[float]:
  """True for a Python or NumPy real scalar (not bool): a value we can check now.

  Traced values (and JAX arrays) are not checked: data cannot raise under ``jax.jit``.
  """
  import numbers  # local imports keep the module's import block untouched for merges
  return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_int(name: str, value: Any, low: int = 1) -> int:
  """``value`` as an ``int`` >= ``low`` (a Python or NumPy integer, not a bool).

  >>> check_int("max_turns", 3)
  3
  >>> check_int("max_turns", 0)
  Traceback (most recent call last):
  ...
  ValueError: `max_turns` must be an int >= 1, got 0.
  """
  import numbers
  if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
    raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}.")
  return int(value)


def check_range(name: str, value: Any, *, low: float | None = None, high: float | None = None,
                low_open: bool = False, high_open: bool = False) -> None:
  """Checks that a concrete number lies in its documented range.

  Only Python (and NumPy scalar) numbers are checked: arrays and traced values cannot be
  inspected at trace time and pass unchecked. NaN is out of every range. Bounds are
  inclusive unless ``low_open`` / ``high_open``.
  """
  import math
  import numbers
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    return
  x = float(value)
  ok = not math.isnan(x)
  if low is not None:
    ok = ok and (x > low if low_open else x >= low)
  if high is not None:
    ok = ok and (x < high if high_open else x <= high)
  if not ok:
    lo = "" if low is None else ("(" if low_open else "[") + f"{low}"
    hi = "" if high is None else f"{high}" + (")" if high_open else "]")
    if low is None:
      bound = f"<{'' if high_open else '='} {high}"
    elif high is None:
      bound = f">{'' if low_open else '='} {low}"
    else:
      bound = f"in {lo}, {hi}"
    raise ValueError(f"`{name}` must be {bound}, got {value!r}.")
