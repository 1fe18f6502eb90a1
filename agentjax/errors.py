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


class OutOfPagesError(AgentjaxError):
    """The KV pool has too few free pages for a request."""
