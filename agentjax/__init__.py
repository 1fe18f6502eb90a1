"""agentjax: a JAX/Pallas serving stack for agentic LLM traffic.

The notebook API (`LLM`, `SamplingParams`, `EngineConfig`) is loaded lazily, so that host-only
subpackages such as `agentjax.kv` import without pulling in jax.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "agentjax.llm",
    "RequestOutput": "agentjax.outputs",
    "CompletionOutput": "agentjax.outputs",
    "TokenLogprobs": "agentjax.logprobs",
    "SamplingParams": "agentjax.sampling_params",
    "EngineConfig": "agentjax.config",
}

if TYPE_CHECKING:
    from agentjax.config import EngineConfig
    from agentjax.llm import LLM
    from agentjax.outputs import CompletionOutput, RequestOutput
    from agentjax.logprobs import TokenLogprobs
    from agentjax.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "CompletionOutput", "TokenLogprobs", "SamplingParams", "EngineConfig",
           "__version__"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'agentjax' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
