"""Rollout: the rectangular KV-cache sampler (``sample``) and the continuous-batching
engine (``RolloutEngine``: paged KV cache, shared prompts, batch-invariant draws), each
a ``RolloutBackend`` (the one protocol the RL loop generates through: ``backend.py``),
and multi-turn episodes over environments, token in and token out (``run_episodes``)."""

from typing import TYPE_CHECKING

from jaxrl_llm.rollout.backend import RolloutBackend, SamplerBackend
from jaxrl_llm.rollout.dapo import (
    DynamicSamplingStats,
    dynamic_sampling,
    overlong_penalty,
    zero_variance_groups,
)
from jaxrl_llm.rollout.engine import Completion, Request, RolloutEngine
from jaxrl_llm.rollout.multiturn import (
    Episode,
    engine_generate,
    episodes_to_batch,
    run_episodes,
)
from jaxrl_llm.rollout.protocol import DecodeFns, PagedDecodeFns
from jaxrl_llm.rollout.replicated import ReplicatedEngine
from jaxrl_llm.rollout.sampler import SampleOutput, filter_logits, sample

__all__ = ["Completion", "DecodeFns", "PagedDecodeFns", "ReplicatedEngine", "Request",
           "RolloutBackend", "RolloutEngine", "SamplerBackend",
           "SampleOutput", "filter_logits", "sample",
           "DynamicSamplingStats", "dynamic_sampling", "overlong_penalty",
           "zero_variance_groups",
           "Episode", "engine_generate", "episodes_to_batch", "run_episodes"]

if TYPE_CHECKING:     # mypy's static check: every backend class implements the protocol
  from jaxrl_llm.rollout.vllm import VllmEngine

  _BACKENDS: tuple[type[RolloutBackend], ...] = (
      SamplerBackend, RolloutEngine, ReplicatedEngine, VllmEngine)
