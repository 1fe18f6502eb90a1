"""The one request path every HTTP API shares (OpenAI chat and completions, Anthropic messages,
OpenAI responses).

A front end turns its request into a `ChatInput` (OpenAI-style message dicts, function tools, a
`ToolChoice`) and `SamplingParams`; `ChatPath` sets the token budget, renders the prompt through
the chat template, adds the structured-output constraint that a forced tool choice needs, queues
the request, and gives back a `ChatRun` (`chat_run.py`) whose events are text deltas, tool calls
as they decode and a final `Finished`. Text completions queue their prompt on the same run with
no parser. Never imports jax.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar

from agentjax.errors import InvalidRequestError, TokenLimitError
from agentjax.sampling_params import SamplingParams
from agentjax.server.async_engine import AsyncEngine
from agentjax.server.chat_run import (  # noqa: F401  (re-exported: the front ends import them from here)
    ChatEvent,
    ChatResult,
    ChatRun,
    Finished,
    LogprobsDelta,
    PromptLogprobs,
    TextDelta,
    ToolCallArguments,
    ToolCallDelta,
    ToolCallStarted,
    merged_events,
)
from agentjax.server.errors import APIError
from agentjax.server.tool_parsers import tool_parser_class
from agentjax.server.worker_pool import WorkerPool
from agentjax.structured.spec import StructuredOutput

T = TypeVar("T")

TOOL_GRAMMAR_ERROR = "the lark constraint is not usable: "  # the tool parsers' constraints are lark grammars
# Most calls one reply makes under a forced tool choice with parallel calls: a small model can
# otherwise repeat calls until max_tokens (the grammar lets the reply end after any call).
MAX_FORCED_PARALLEL_CALLS = 8


@dataclass(frozen=True)
class ToolChoice:
    """`auto` (the model decides), `none` (no tools), `required` (at least one call), or `function`
    (a call of `name`)."""

    mode: Literal["auto", "none", "required", "function"] = "auto"
    name: str | None = None

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "function")


@dataclass
class ChatInput:
    """A chat request, independent of the API it came through."""

    messages: list[dict]  # role, content (text), and OpenAI-style tool_calls / tool_call_id
    tools: list[dict] = field(default_factory=list)  # [{"type": "function", "function": {name, description, parameters}}]
    tool_choice: ToolChoice = ToolChoice()
    parallel_tool_calls: bool = True
    structured: StructuredOutput | None = None  # a response format (JSON schema or object)


class ContextLengthError(APIError):
    """Prompt plus output budget over the model's context (vLLM's 400, naming both numbers)."""


class ChatPath:
    """Budgets, renders, constrains and queues requests on one `AsyncEngine`."""

    def __init__(self, engine: AsyncEngine, tokenizer: Any, *, max_tokens_limit: int | None = None,
                 default_max_tokens: int | None = None, tool_parser: str = "hermes",
                 workers: WorkerPool | None = None):
        self.engine = engine
        self.workers = workers  # where prompts are rendered and tokenized; None: inline (tests)
        self.tokenizer = tokenizer
        self.max_tokens_limit = max_tokens_limit  # the operator's cap (--max-tokens-limit); None: none
        self.default_max_tokens = default_max_tokens  # for requests that set no budget; None: the context left
        self.tool_parser = tool_parser_class(tool_parser)

    # ---- token budget -------------------------------------------------------------------------
    def max_tokens_for(self, requested: int | None, prompt_tokens: int, param: str = "max_tokens",
                       api: Literal["openai", "anthropic"] = "openai", prompt_param: str = "messages") -> int:
        """The output budget, as vLLM sets it: what the request asked for, or (when it asked for
        nothing) the server's default budget if it has one, else the context left after the prompt
        (and no more than the KV pool can hold); never more than the context left. Asking
        for more than the context leaves is a 400 that names both numbers; so is asking for more
        than the operator's cap, when one is set. `prompt_param` names the prompt's field in errors
        about the prompt (`prompt` on /v1/completions, `input` on /v1/responses)."""
        context = self.engine.max_model_len
        left = context - prompt_tokens
        if left < 1:  # the engine rejects it too; this says it in the API's words
            raise ContextLengthError(_prompt_too_long(prompt_tokens, context, api), param=prompt_param,
                                     code="context_length_exceeded")
        limit = self.max_tokens_limit
        if requested is None:
            budget = left if self.default_max_tokens is None else min(left, self.default_max_tokens)
            capacity = getattr(self.engine, "kv_capacity_tokens", None)
            if capacity is not None and capacity - prompt_tokens >= 1:
                budget = min(budget, capacity - prompt_tokens)
            return max(1, min(budget, limit) if limit is not None else budget)
        if limit is not None and requested > limit:
            raise APIError(f"{param}={requested} exceeds this server's limit of {limit} tokens "
                           f"(--max-tokens-limit)", param=param, code="max_tokens_too_large")
        if requested > left:
            raise ContextLengthError(_budget_too_large(param, requested, prompt_tokens, context, api),
                                     param=param, code="context_length_exceeded")
        return requested

    # ---- tools and prompts --------------------------------------------------------------------
    async def off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on the worker pool: rendering and tokenizing take time in proportion to
        the body, and must not stall the event loop."""
        if self.workers is None:
            return fn(*args, **kwargs)
        return await self.workers.run(fn, *args, **kwargs)

    def check_tools(self, chat: ChatInput, param: str = "tools") -> None:
        names = set()
        for index, tool in enumerate(chat.tools):
            function = tool.get("function") if isinstance(tool, Mapping) else None
            if tool.get("type", "function") != "function" or not isinstance(function, Mapping) \
                    or not isinstance(function.get("name"), str) or not function["name"]:
                raise APIError(f"{param}[{index}] must be a function tool with a name", param=f"{param}[{index}]")
            parameters = function.get("parameters")
            if parameters is not None and not isinstance(parameters, Mapping):
                raise APIError(f"{param}[{index}]'s parameters must be a JSON schema object",
                               param=f"{param}[{index}]")
            names.add(function["name"])
        choice = chat.tool_choice
        if choice.forced and not chat.tools:
            raise APIError(f"tool_choice {choice.mode!r} needs tools", param="tool_choice")
        if choice.mode == "function" and choice.name not in names:
            raise APIError(f"tool_choice names {choice.name!r}, which is not among the tools "
                           f"({', '.join(sorted(names))})", param="tool_choice")

    def prompt_ids(self, chat: ChatInput, add_generation_prompt: bool = True,
                   api: Literal["openai", "anthropic"] = "openai", bounded: bool = True,
                   prompt_param: str = "messages") -> list[int]:
        """The rendered prompt. Tools are rendered even with tool choice `none`, so that an agent that
        switches tool choice between turns keeps its prompt prefix (and its cache hits). `bounded`: a
        prompt that leaves no room for one new token is a 400 known from its token count alone (a
        5 MB prompt's ids are never built)."""
        context = self._context() if bounded else None
        try:
            return self.tokenizer.encode_chat(chat.messages, add_generation_prompt=add_generation_prompt,
                                              tools=chat.tools or None, max_tokens=context and context - 1)
        except TokenLimitError as error:
            raise ContextLengthError(_prompt_too_long(error.num_tokens, context, api), param=prompt_param,
                                     code="context_length_exceeded") from None

    def _context(self) -> int | None:
        return getattr(self.engine, "max_model_len", None)

    def text_ids(self, text: str, add_special_tokens: bool = True, bounded: bool = True) -> list[int]:
        """A text prompt's ids (completions), bounded as `prompt_ids`."""
        context = self._context() if bounded else None
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens, max_tokens=context and context - 1)
        except TokenLimitError as error:
            raise ContextLengthError(_prompt_too_long(error.num_tokens, context, "openai"), param="prompt",
                                     code="context_length_exceeded") from None

    def constraint(self, chat: ChatInput) -> StructuredOutput | None:
        """What decoding must produce: a call when the tool choice forces one, else the response format."""
        choice = chat.tool_choice
        if not choice.forced:
            return chat.structured
        if chat.structured is not None:
            raise APIError("a response format cannot be combined with a forced tool choice", param="tool_choice")
        functions = [t["function"] for t in chat.tools if choice.mode == "required" or t["function"]["name"] == choice.name]
        return self.tool_parser.constraint(functions, self.max_forced_calls(chat))

    @staticmethod
    def max_forced_calls(chat: ChatInput) -> int:
        """Calls a forced tool choice may make in one reply: several only for `required` with
        parallel calls on."""
        parallel = chat.parallel_tool_calls and chat.tool_choice.mode == "required"
        return MAX_FORCED_PARALLEL_CALLS if parallel else 1

    # ---- queueing -----------------------------------------------------------------------------
    async def start(self, chat: ChatInput, sampling: SamplingParams, prompt: Sequence[int] | None = None,
                    **engine_kwargs: Any) -> ChatRun:
        """Queues the chat; `engine_kwargs` go to `Engine.add_request`. A caller that passes `prompt`
        has rendered it with `prompt_ids` after `check_tools`."""
        if prompt is None:
            self.check_tools(chat)
            prompt = self.prompt_ids(chat)
        constraint = self.constraint(chat)
        if constraint is not None:
            sampling = replace(sampling, structured=constraint)
        parser = self.tool_parser(chat.tools) if chat.tools and chat.tool_choice.mode != "none" else None
        check = None  # under `auto` the tools' schemas are checked as a forced choice's grammar would be
        if parser is not None and not chat.tool_choice.forced:
            check = self.tool_parser.constraint([t["function"] for t in chat.tools], 1)
        try:
            stream = await self.engine.add_request(list(prompt), sampling, check=check, **engine_kwargs)
        except InvalidRequestError as error:
            if parser is not None and str(error).startswith(TOOL_GRAMMAR_ERROR):
                reason = re.sub(r"^at \d+\(\d+\): ", "", str(error).removeprefix(TOOL_GRAMMAR_ERROR))
                raise APIError(f"tools: a function's parameters are not a usable JSON schema: {reason}",
                               param="tools", code="invalid_tool_schema") from None
            raise
        forced = chat.tool_choice.forced and parser is not None
        run = ChatRun(self.engine, self.tokenizer, stream, len(prompt), sampling, parser, forced_calls=forced)
        run.counts_prompt = engine_kwargs.get("fork_of") is None
        return run

    async def start_text(self, prompt: Sequence[int], sampling: SamplingParams, **engine_kwargs: Any) -> ChatRun:
        """Queues a plain text continuation of `prompt` (text completions): no template, no parser."""
        stream = await self.engine.add_request(list(prompt), sampling, **engine_kwargs)
        run = ChatRun(self.engine, self.tokenizer, stream, len(prompt), sampling, None)
        run.counts_prompt = engine_kwargs.get("fork_of") is None
        return run

    async def start_samples(self, chat: ChatInput | None, sampling: SamplingParams, prompt: Sequence[int],
                            **engine_kwargs: Any) -> list[ChatRun]:
        """`sampling.num_samples` runs of one prompt (`n`, or `best_of`), each with its own seed
        (`SamplingParams.for_sample`): the first computes the prompt, the others wait for it and read
        its pages. `chat` None queues text completions. One sample is a plain `start`."""
        runs: list[ChatRun] = []
        try:
            for index in range(sampling.num_samples):
                kwargs = dict(engine_kwargs, fork_of=runs[0].request_id) if index else engine_kwargs
                sample = sampling.for_sample(index)
                runs.append(await (self.start_text(prompt, sample, **kwargs) if chat is None
                                   else self.start(chat, sample, prompt, **kwargs)))
        except BaseException:
            for run in runs:
                run.abort()
            raise
        return runs


def _budget_too_large(param: str, requested: int, prompt: int, context: int, api: str) -> str:
    if api == "anthropic":  # Anthropic's words, which harnesses read to retry with a smaller budget
        return (f"input length and `max_tokens` exceed context limit: {prompt} + {requested} > {context}, "
                f"decrease input length or `max_tokens` and try again")
    return (f"'{param}' is too large: {requested}. This model's maximum context length is {context} tokens "
            f"and your request has {prompt} input tokens ({requested} > {context} - {prompt})")


def _prompt_too_long(prompt: int, context: int, api: str) -> str:
    if api == "anthropic":
        return f"prompt is too long: {prompt} tokens > {context - 1} maximum"
    return (f"This model's maximum context length is {context} tokens. However, your request has {prompt} "
            f"input tokens (at most {context - 1} leave room for one new token). Please reduce the length "
            f"of the input.")
