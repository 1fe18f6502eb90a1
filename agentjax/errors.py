"""Every exception agentjax raises on purpose.

One module, so callers can catch `AgentjaxError` or a specific subclass. Messages name the bad
value and the allowed range. Host only: never imports jax.
"""


class AgentjaxError(Exception):
    """Base class of agentjax's own errors."""


class ModelLoadError(AgentjaxError):
    """A model file or directory is missing, unreadable or malformed."""


class UnsupportedModelError(AgentjaxError):
    """The architecture, tensor layout or quantisation type is not supported."""


class TokenizerError(AgentjaxError):
    """The tokenizer or chat template cannot be built or applied."""


class InvalidRequestError(AgentjaxError, ValueError):
    """A request's prompt or sampling parameters are out of range."""


class PromptTooLongError(InvalidRequestError):
    """A prompt (plus the tokens to generate) exceeds the model's context."""


class TokenLimitError(PromptTooLongError):
    """A text encodes to more tokens than its caller allows; `num_tokens` says how many (the ids
    themselves were never built)."""

    def __init__(self, num_tokens: int, limit: int):
        super().__init__(f"the text encodes to {num_tokens} tokens, over the limit of {limit}")
        self.num_tokens = num_tokens
        self.limit = limit


class OutOfPagesError(AgentjaxError):
    """The KV pool has too few free pages for a request. `cause`: "prompt" or "max_tokens" when one of
    them is why a request can never fit, else None."""

    def __init__(self, message: str, cause: str | None = None):
        super().__init__(message)
        self.cause = cause


class ModelConfigError(ModelLoadError):
    """A model's config lacks a field the loader needs, or holds a value outside the allowed range."""


class InsufficientMemoryError(ModelLoadError):
    """The weights and KV pages of a layout do not fit the memory of the devices present."""


class TensorMismatchError(ModelLoadError):
    """A checkpoint's tensors do not match the model: missing, wrongly shaped or unexpected ones."""


class CorruptCheckpointError(ModelLoadError):
    """A checkpoint or cache file is truncated or unparsable, or its bytes fail their recorded checksums."""


class KernelShapeError(AgentjaxError, ValueError):
    """A Pallas kernel was called with shapes, block sizes or settings it does not support."""


class RouterConfigError(AgentjaxError, ValueError):
    """`agentjax router` was given no replicas, a malformed replica URL, or a policy it cannot run."""


class OffloadTierError(AgentjaxError):
    """A KV offload tier (host memory, disk, Mooncake Store) asked for in the engine settings cannot start."""


class ParallelLayoutError(AgentjaxError, ValueError):
    """The parallel settings (TP, DP/DEP, DCP, PCP, processes) do not fit the model or the devices."""


class SpeculativeConfigError(AgentjaxError, ValueError):
    """`speculative_config` names an unknown method, an out-of-range setting, or a method this model or
    layout cannot run."""


class ServerConfigError(AgentjaxError, ValueError):
    """`agentjax serve` (or `router`) was given an unreadable or malformed keys file, or keys that conflict."""
