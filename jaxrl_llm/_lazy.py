"""Lazy package namespaces (PEP 562): a name is imported from its module on first use.

``import jaxrl_llm`` (and ``jaxrl_llm.train`` / ``jaxrl_llm.loop``) then imports no
JAX, so the ``jaxrl-llm`` command can parse and check its flags, and print ``--help``,
before the heavy imports. ``jaxrl_llm.gae`` works as before: the first access imports
``jaxrl_llm.advantages`` and caches the function in the package namespace.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def lazy_namespace(package: str, exports: Mapping[str, Sequence[str]],
                   namespace: dict) -> tuple[Callable[[str], Any], Callable[[], list]]:
  """``(__getattr__, __dir__)`` for a package whose public names load on first use.

  Args:
    package: the package's ``__name__`` (for the error message).
    exports: ``{module: the public names it defines}``; the package's ``__all__`` is
      :func:`public_names` of it.
    namespace: the package's ``globals()``; a resolved name is cached there, so
      ``__getattr__`` runs once per name.

  Examples:
    >>> ns = {"__name__": "pkg"}
    >>> getattr_, dir_ = lazy_namespace("pkg", {"math": ["sqrt"]}, ns)
    >>> getattr_("sqrt")(9.0), "sqrt" in ns, "sqrt" in dir_()
    (3.0, True, True)
  """
  table = {name: module for module, names in exports.items() for name in names}

  def __getattr__(name: str) -> Any:
    module = table.get(name)
    if module is None:
      raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    namespace[name] = value
    return value

  def __dir__() -> list:
    return sorted(set(namespace) | set(table))

  return __getattr__, __dir__


def public_names(exports: Mapping[str, Sequence[str]]) -> list[str]:
  """The package's ``__all__``: every name of ``exports``, in order.

  Examples:
    >>> public_names({"math": ["sqrt", "pi"], "os": ["sep"]})
    ['sqrt', 'pi', 'sep']
  """
  return [name for names in exports.values() for name in names]
