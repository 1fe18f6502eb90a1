"""The model runner: ragged batch metadata, jitted step functions and the sampler."""
from agentjax.ragged_batch import RaggedBatch
from agentjax.runner.sampler import SamplingMetadata, sample_tokens
from agentjax.runner.step import make_forward, make_sampling_step, make_step

__all__ = ["RaggedBatch", "SamplingMetadata", "make_forward", "make_sampling_step", "make_step", "sample_tokens"]
