"""The decode protocol, as the rollout layer names it: the classes of
:mod:`jaxrl_llm.models.protocol` (what a model provides, on the models' floor).

Examples:
  >>> from jaxrl_llm.models.protocol import DecodeFns as FromModels
  >>> DecodeFns is FromModels
  True
"""

from __future__ import annotations

from jaxrl_llm.models.protocol import DecodeFns, PagedDecodeFns

__all__ = ["DecodeFns", "PagedDecodeFns"]
