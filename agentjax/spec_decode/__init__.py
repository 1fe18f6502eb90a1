"""Speculative decoding: draft proposers, their settings and the acceptance counters (host side).

The device side is the ordinary sampling step: a decode row carries its draft tokens as extra query
tokens and the step samples a token at each of them (`RaggedBatch.build(sample_counts=...)`).
"""
from agentjax.spec_decode.config import SpeculativeConfig
from agentjax.spec_decode.speculator import SpecDecodeStats, Speculator, accepted_prefix

__all__ = ["SpeculativeConfig", "SpecDecodeStats", "Speculator", "accepted_prefix"]
