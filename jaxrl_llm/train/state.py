"""Transitional: :class:`~jaxrl_llm.train.config.TrainConfig` under its earlier module
name, imported only by :mod:`jaxrl_llm.parallel.pmap`, whose train-step wrappers the
rooms branch moves into ``train/``. Delete this module when they merge."""

from jaxrl_llm.train.config import TrainConfig

__all__ = ["TrainConfig"]
