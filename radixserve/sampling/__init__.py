"""Sampling: request parameters, the vectorized seeded sampler, logprobs."""

from radixserve.sampling.logprobs import TopLogprobs, token_logprobs, top_logprobs
from radixserve.sampling.params import SamplingParams
from radixserve.sampling.sampler import SamplingBatch, sample

__all__ = [
    "SamplingBatch",
    "SamplingParams",
    "TopLogprobs",
    "sample",
    "token_logprobs",
    "top_logprobs",
]
