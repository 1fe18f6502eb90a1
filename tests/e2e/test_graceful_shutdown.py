"""SIGTERM with streams still running past `--timeout-graceful-shutdown`: each stream (chat, Anthropic
messages, Responses) ends with an error event in its API's shape, the process exits 0, and the log has
no CancelledError traceback."""
from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from tests.e2e.conftest import start_server, stop_server

pytestmark = pytest.mark.slow

MODEL = "preset:tiny-dense"
STREAMS = {
    "/v1/chat/completions": ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000,
                              "ignore_eos": True, "stream": True}, '"code":"shutting_down"'),
    "/v1/messages": ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000,
                      "stream": True}, '"type":"error"'),
    "/v1/responses": ({"model": MODEL, "input": "hi", "max_output_tokens": 4000, "stream": True},
                      '"type":"response.failed"'),
}


def test_streams_cut_by_the_graceful_shutdown_end_with_an_error_event_and_no_traceback(tmp_path):
    server = start_server(tmp_path, "--model", MODEL, "--timeout-graceful-shutdown", "3")
    received: dict[str, list[str]] = {path: [] for path in STREAMS}

    def stream(path: str) -> None:
        body, _ = STREAMS[path]
        with httpx.stream("POST", f"{server.base_url}{path}", json=body, timeout=120) as response:
            for line in response.iter_lines():
                received[path].append(line)

    threads = [threading.Thread(target=stream, args=(path,)) for path in STREAMS]
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 120
        while not all(len(lines) >= 6 for lines in received.values()):  # every stream is under way
            assert time.monotonic() < deadline, {path: lines[-2:] for path, lines in received.items()}
            time.sleep(0.1)
        server.process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(60)
    finally:
        status = stop_server(server)
    assert status == 0
    for path, (_, needle) in STREAMS.items():
        tail = "\n".join(received[path][-6:])
        assert needle in tail and "shutting down" in tail, (path, tail)
    log = server.log_path.read_text(errors="replace")
    assert "graceful shutdown: ending 3 request(s)" in log
    assert "Traceback" not in log and "CancelledError" not in log and "Cancel 3 running task" not in log, log[-3000:]
