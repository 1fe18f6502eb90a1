"""Renders a model's chat template (Jinja2, as Hugging Face does) into the prompt text it was trained on.

The template comes from the GGUF's `tokenizer.chat_template`, or from a built-in default for an
architecture whose files ship none (Gemma-3). Templates run in a sandboxed environment. Host only:
never imports jax.
"""
from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from agentjax.errors import TokenizerError
from checkpoints.tool_prompt import fold_tools, needs_tool_folding, template_supports_tools

# Gemma-3's instruction-tuned template, as published with google/gemma-3-*-it: the system prompt is
# folded into the first user turn, and the assistant's role is called "model".
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""

BUILTIN_CHAT_TEMPLATES: dict[str, str] = {
    "gemma3": GEMMA3_CHAT_TEMPLATE,
}

# Tokens that close a turn in the common template families; the ones a model's vocabulary and
# template both use become stop tokens beside its eos.
END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|eom_id|>")


def builtin_chat_template(architecture: str | None) -> str | None:
    """The chat template to use for an architecture whose files carry none, or None."""
    return BUILTIN_CHAT_TEMPLATES.get(architecture or "")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format_string: str) -> str:
    return datetime.datetime.now().strftime(format_string)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Hugging Face's `tojson`: unlike Jinja's own, it does not HTML-escape and keeps non-ASCII text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _new_environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


class ChatTemplate:
    """A compiled chat template; `render` turns OpenAI-style messages into prompt text."""

    def __init__(self, source: str):
        self.source = source
        try:
            self._template = _new_environment().from_string(source)
        except jinja2.exceptions.TemplateError as error:
            raise TokenizerError(f"the chat template does not compile: {error}") from error
        self.supports_tools = template_supports_tools(source)

    def render(self, messages: Sequence[Mapping[str, Any]], *, special_tokens: Mapping[str, str | None],
               add_generation_prompt: bool = True, tools: Sequence[Mapping[str, Any]] | None = None,
               **kwargs: Any) -> str:
        """The prompt text; `special_tokens` supplies `bos_token`, `eos_token` and the like.

        A template without tool support gets the tools, tool calls and tool results folded into
        plain messages (`checkpoints.tool_prompt`)."""
        if not messages:
            raise TokenizerError("apply_chat_template needs at least one message; got none")
        if not self.supports_tools and needs_tool_folding(messages, tools):
            try:
                messages, tools = fold_tools(messages, tools), None
            except (TypeError, KeyError, AttributeError) as error:
                raise TokenizerError(f"tool calls or tools are malformed: {type(error).__name__}: {error}") from error
        plain_messages = [dict(message) for message in messages]
        for index, message in enumerate(plain_messages):
            if "role" not in message:
                raise TokenizerError(f"message {index} has no 'role'; each message needs role and content")
        variables = {**special_tokens, **kwargs}
        try:
            return self._template.render(messages=plain_messages, tools=tools,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as error:
            raise TokenizerError(f"the chat template failed: {error}") from error
        except (TypeError, KeyError, IndexError, AttributeError) as error:
            raise TokenizerError(f"the chat template failed on these messages: "
                                 f"{type(error).__name__}: {error}") from error
