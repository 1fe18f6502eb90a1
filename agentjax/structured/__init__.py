"""Structured output: decoding constrained to a JSON schema, a Lark grammar or a regex.

`StructuredOutput` (host-only, no jax and no grammar library) says what a request's output must
match; `GrammarBackend` compiles it with llguidance into a per-request matcher that yields token
masks. The sampler takes those masks as an input array, so constraining a request never
recompiles the step.
"""
from agentjax.structured.spec import StructuredOutput

__all__ = ["StructuredOutput"]
