"""Text at the edge of a real server: hostile text in any string field of any route (lone surrogates,
NUL, overlong and invalid UTF-8, huge strings) gets a 2xx or a 4xx, never a 5xx, never a traceback
in the log and never a dropped keep-alive connection; `/health` stays fast while a 5 MB body is
tokenized and rejected."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.e2e.conftest import TENANT_KEYS

pytestmark = pytest.mark.slow

MODEL = "preset:tiny-dense"
MESSAGES = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {
    "type": "object", "properties": {"a": {"type": "string", "description": "x"}}}}}
# A valid body per route; every string in it (and the keys of its objects) is a text field to attack.
ROUTE_BODIES = {
    "/v1/chat/completions": {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, "stop": ["zz"], "user": "u",
                             "session_id": "s", "cache_salt": "c", "tools": [TOOL]},
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 1, "stop": "zz", "cache_salt": "c"},
    "/v1/responses": {"model": MODEL, "input": "hi", "instructions": "be brief", "max_output_tokens": 1,
                      "prompt_cache_key": "k", "metadata": {"k": "v"}},
    "/v1/messages": {"model": MODEL, "max_tokens": 1, "system": "s", "messages": MESSAGES,
                     "stop_sequences": ["zz"], "metadata": {"user_id": "u"}},
    "/v1/messages/count_tokens": {"model": MODEL, "system": "s", "messages": MESSAGES},
    "/tokenize": {"model": MODEL, "messages": MESSAGES, "tools": [TOOL]},
    "/detokenize": {"model": MODEL, "tokens": [1, 2]},
    "/kv/prompt_hashes": {"path": "/v1/completions", "body": {"prompt": "hi", "cache_salt": "c"}},
    "/kv/prefill": {"path": "/v1/chat/completions", "body": {"messages": MESSAGES}, "session_id": "s"},
}
HOSTILE = ["\ud800", "\udfff", "a\udc00b", "\x00", "nul\x00in", "\ud83d", "\U0001f600\ud800", "\ufffe\uffff",
           "\u202e\u200b", "x" * 200_000]
RAW_BAD_BYTES = [b"\xc0\x80", b"\xed\xa0\x80", b"\xff", b"\xe2\x82", b"\xf4\x90\x80\x80", b"\xc1\xbf"]


def text_paths(value, path=()) -> list[tuple]:
    """Paths of every string value in `value`, and of every key (`(..., ("key", name))`)."""
    found = []
    if isinstance(value, str):
        found.append(path)
    elif isinstance(value, dict):
        for key, item in value.items():
            found.append((*path, ("key", key)))
            found += text_paths(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += text_paths(item, (*path, index))
    return found


def replaced(value, path: tuple, text: str):
    """`value` with the string (or key) at `path` replaced by `text`."""
    value = json.loads(json.dumps(value))
    *parents, last = path
    holder = value
    for step in parents:
        holder = holder[step]
    if isinstance(last, tuple):
        holder[text] = holder.pop(last[1])
    else:
        holder[last] = text
    return value


MARKER = "MARKER-TO-CORRUPT"


@st.composite
def hostile_requests(draw):
    path = draw(st.sampled_from(sorted(ROUTE_BODIES)))
    body = ROUTE_BODIES[path]
    where = draw(st.sampled_from(text_paths(body)))
    if draw(st.booleans()):  # invalid UTF-8 in the raw bytes: no JSON encoder writes it
        raw = json.dumps(replaced(body, where, MARKER)).encode()
        return path, raw.replace(MARKER.encode(), draw(st.sampled_from(RAW_BAD_BYTES)))
    text = draw(st.one_of(st.sampled_from(HOSTILE), st.text(min_size=1, max_size=20)))
    text = draw(st.sampled_from([text, "ok " + text, text + " ok"]))
    ensure_ascii = draw(st.booleans())  # \\udXXX escapes, or the surrogate itself (json writes it escaped)
    return path, json.dumps(replaced(body, where, text), ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass")


def test_hostile_text_in_any_field_of_any_route_gets_a_4xx_or_2xx_and_no_traceback(tenant_server):
    headers = {"Authorization": f"Bearer {TENANT_KEYS['operator']}", "Content-Type": "application/json"}
    seen: dict[int, int] = {}
    with httpx.Client(base_url=tenant_server.base_url, headers=headers, timeout=120) as http:

        @settings(max_examples=150, deadline=None, phases=[Phase.generate], database=None,
                  suppress_health_check=list(HealthCheck))
        @given(request=hostile_requests())
        def send(request):
            path, raw = request
            response = http.post(path, content=raw)
            seen[response.status_code] = seen.get(response.status_code, 0) + 1
            assert 200 <= response.status_code < 500, (path, raw[:300], response.text[:500])
            assert response.headers.get("connection") != "close", (path, raw[:300])  # keep-alive kept

        send()
        for path in ("/v1/responses/%ED%A0%80", "/v1/responses/a%00b", "/kv/events?epoch=%00%ED%A0%80&after=0"):
            response = http.get(path)
            assert 200 <= response.status_code < 500 and response.headers.get("connection") != "close", path
    assert seen.get(400, 0) > 20, seen  # the hostile strings were refused, not just shrugged off
    log = tenant_server.log_path.read_text(errors="replace")
    assert "Traceback" not in log and " 500 " not in log, log[-3000:]
    tenant_server.assert_healthy()


def _health_latencies_while_a_big_body_is_rejected(tenant_server, body: bytes) -> list[float]:
    """/health round trips (s) measured while `body` is being posted and rejected."""
    outcome: dict = {}

    def send_big() -> None:
        started = time.monotonic()
        response = httpx.post(f"{tenant_server.base_url}/v1/chat/completions", content=body, timeout=300,
                              headers={"Authorization": f"Bearer {TENANT_KEYS['alice']}",
                                       "Content-Type": "application/json"})
        outcome.update(status=response.status_code, text=response.text, seconds=time.monotonic() - started)

    latencies = []
    sender = threading.Thread(target=send_big)
    with httpx.Client(base_url=tenant_server.base_url, timeout=30) as http:
        http.get("/health")  # the connection is open before the clock starts
        sender.start()
        while sender.is_alive():
            started = time.monotonic()
            assert http.get("/health").status_code == 200
            latencies.append(time.monotonic() - started)
            time.sleep(0.02)
    sender.join()
    assert outcome["status"] == 400 and "maximum context length" in outcome["text"], outcome
    assert len(latencies) >= 10, (len(latencies), outcome["seconds"])  # probes ran while it was being handled
    return latencies


def test_health_answers_within_100_ms_while_a_5_mb_body_is_rejected(tenant_server):
    body = json.dumps({"model": MODEL, "max_tokens": 1,
                       "messages": [{"role": "user", "content": "hello world " * 440_000}]}).encode()
    assert len(body) > 5 * 2**20
    # A real-time bound on a shared 2-core machine: one try may lose the CPU to other test processes for
    # longer than 100 ms. Up to three tries; an event loop that the body blocks fails every one of them.
    worst = []
    for _ in range(3):
        latencies = _health_latencies_while_a_big_body_is_rejected(tenant_server, body)
        worst.append(max(latencies))
        if max(latencies) < 0.100:
            break
    assert min(worst) < 0.100, worst
