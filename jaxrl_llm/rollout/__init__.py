"""Rollout: the KV-cache sampler (jitted prefill + decode loop), greedy and sampled."""

from jaxrl_llm.rollout.protocol import DecodeFns
from jaxrl_llm.rollout.sampler import SampleOutput
from jaxrl_llm.rollout.sampler import filter_logits
from jaxrl_llm.rollout.sampler import sample
from jaxrl_llm.rollout.dapo import (
    DynamicSamplingStats, dynamic_sampling, overlong_penalty, zero_variance_groups)

__all__ = ["DecodeFns", "SampleOutput", "filter_logits", "sample",
           "DynamicSamplingStats", "dynamic_sampling", "overlong_penalty",
           "zero_variance_groups"]
