"""Anthropic requests -> the shared ChatInput, and cache_control marks -> pinned prefixes, the latter with
the embedded model's real tokenizer and chat template (no jax, no engine)."""
from __future__ import annotations

import pytest

from agentjax.server.anthropic_convert import chat_input_of, pin_prefixes
from agentjax.server.anthropic_protocol import MessagesRequest
from agentjax.server.chat_path import ChatPath, ToolChoice

EPHEMERAL = {"type": "ephemeral"}
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def request(**fields) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 4, **fields})


def test_blocks_become_openai_style_messages_with_tool_calls_and_tool_results():
    body = request(system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B"}], tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "rain"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "timeout"}, {"type": "text", "text": "!"}]},
            {"type": "text", "text": "Thanks"}]}])
    chat = chat_input_of(body)
    assert chat.messages == [
        {"role": "system", "content": "A\nB"},
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "toolu_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "rain"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: timeout!"},
        {"role": "user", "content": "Thanks"}]
    assert chat.tools == [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                            "parameters": WEATHER["input_schema"]}}]
    assert chat.tool_choice == ToolChoice("auto") and chat.parallel_tool_calls


@pytest.mark.parametrize("choice, expected, parallel", [
    (None, ToolChoice("auto"), True),
    ({"type": "auto", "disable_parallel_tool_use": True}, ToolChoice("auto"), False),
    ({"type": "any"}, ToolChoice("required"), True),
    ({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}, ToolChoice("function", "get_weather"),
     False),
    ({"type": "none"}, ToolChoice("none"), True),
])
def test_tool_choice_maps_to_the_chat_paths_choice(choice, expected, parallel):
    fields = {"tool_choice": choice} if choice else {}
    chat = chat_input_of(request(tools=[WEATHER], messages=[{"role": "user", "content": "hi"}], **fields))
    assert (chat.tool_choice, chat.parallel_tool_calls) == (expected, parallel)
    assert chat_input_of(request(messages=[{"role": "user", "content": "hi"}])).tool_choice == ToolChoice("none")


@pytest.fixture(scope="module")
def smollm2():
    from checkpoints.embedded import smollm2_path
    from checkpoints.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(smollm2_path())
    return tokenizer, ChatPath(None, tokenizer, max_tokens_limit=64)


def pinned_texts(smollm2, body: MessagesRequest) -> tuple[list[str], list[float], str]:
    tokenizer, path = smollm2
    chat = chat_input_of(body)
    prompt = path.prompt_ids(chat)
    pins = pin_prefixes(path, body, chat, prompt)
    assert all(0 < n <= len(prompt) for n, _ in pins)
    return [tokenizer.decode(prompt[:n], False) for n, _ in pins], [t for _, t in pins], tokenizer.decode(prompt, False)


def test_each_mark_pins_the_real_prompt_up_to_the_end_of_its_block(smollm2):
    body = request(
        tools=[{**WEATHER, "cache_control": EPHEMERAL}],
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "Weather in Paris?", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
            {"type": "text", "text": " And tomorrow?"}]}])
    (tools, question), ttls, prompt = pinned_texts(smollm2, body)
    # Without a system prompt the folded tool instructions are the whole system message.
    assert '"get_weather"' in tools and tools.endswith("</tool_response> tags.<|im_end|>\n")
    assert question.endswith("<|im_start|>user\nWeather in Paris?") and ttls == [300.0, 3600.0]
    assert prompt.startswith(question) and prompt.endswith("And tomorrow?<|im_end|>\n<|im_start|>assistant\n")


def test_a_system_mark_covers_the_system_message_and_a_top_level_mark_the_whole_conversation(smollm2):
    body = request(system=[{"type": "text", "text": "You are terse.", "cache_control": EPHEMERAL},
                           {"type": "text", "text": "Answer in French."}],
                   cache_control=EPHEMERAL, messages=[{"role": "user", "content": "Bonjour?"}])
    (system, everything), _, prompt = pinned_texts(smollm2, body)
    assert system.endswith("<|im_start|>system\nYou are terse.")
    assert everything.endswith("user\nBonjour?<|im_end|>\n") and prompt == everything + "<|im_start|>assistant\n"


def test_system_turns_inside_messages_stay_where_they_stand_as_claude_code_sends_them():
    body = request(system="Base.", messages=[
        {"role": "user", "content": [{"type": "text", "text": "Create hello.py"}]},
        {"role": "system", "content": [{"type": "text", "text": "Env: linux", "cache_control": EPHEMERAL},
                                       {"type": "text", "text": "cwd: /tmp"}]},
        {"role": "assistant", "content": "Done."},
        {"role": "system", "content": "Reminder."}],
        thinking={"type": "adaptive", "display": "omitted"}, output_config={"effort": "high"},
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]})
    assert chat_input_of(body).messages == [
        {"role": "system", "content": "Base."}, {"role": "user", "content": "Create hello.py"},
        {"role": "system", "content": "Env: linux\ncwd: /tmp"}, {"role": "assistant", "content": "Done."},
        {"role": "system", "content": "Reminder."}]


def test_a_system_turn_renders_through_the_real_template_and_its_mark_pins_a_prefix(smollm2):
    tokenizer, path = smollm2
    body = request(messages=[{"role": "user", "content": "Create hello.py"},
                             {"role": "system", "content": [{"type": "text", "text": "Env: linux",
                                                             "cache_control": EPHEMERAL}]}])
    chat = chat_input_of(body)
    prompt = path.prompt_ids(chat)
    text = tokenizer.decode(prompt, skip_special_tokens=False)
    assert text.index("<|im_start|>user\nCreate hello.py") < text.index("<|im_start|>system\nEnv: linux")
    [(covered, ttl)] = pin_prefixes(path, body, chat, prompt)
    assert 0 < covered < len(prompt) and ttl == 300.0
