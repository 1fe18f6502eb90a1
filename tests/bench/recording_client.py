"""A client for tests of the AgentX replay itself: it keeps every request it is sent and answers each at
once with an empty reply, so a test reads what the replay sends without an engine or a server."""
from __future__ import annotations

from agentjax.bench.metrics import RequestRecord
from agentjax.bench.traces import TokenIdRange


class RecordingClient:
    token_range = TokenIdRange()
    max_prompt_tokens = None

    def __init__(self):
        self.sent = []

    async def start(self):
        pass

    async def close(self):
        pass

    async def send(self, request):
        self.sent.append(request)
        return RequestRecord(0.0, 0.0, 0.0, len(request.prompt), 0, request.max_tokens,
                             session_id=request.session_id, turn_index=request.turn_index)
