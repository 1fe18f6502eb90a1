"""The peer side of `scripts/bench_generate.py`'s line protocol, shared by the transformers peer (run in a
torch venv without agentjax, so this module imports only the standard library) and the agentjax peer at
another revision. One JSON object a line on stdin, one JSON reply a line on stdout:

    {"op": "generate", "prompts": [[ids...], ...], "max_new_tokens": 64}
        -> {"seconds": wall time of the generate call, "new_token_ids": [[...], ...]}
    {"op": "quit"}
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable


def open_replies(threads: int):
    """The replies' channel (the original stdout); anything libraries print goes to stderr from here on.
    Also keeps this process on its first `threads` allowed CPUs."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) > threads:
        os.sched_setaffinity(0, allowed[:threads])
    return replies


def serve(replies, ready: dict, generate: Callable[[list[list[int]], int], tuple[float, list[list[int]]]]) -> None:
    """Write the ready line, then answer requests until "quit" or the end of stdin; `generate(prompts,
    max_new_tokens)` returns (seconds, new token ids per prompt)."""
    replies.write(json.dumps({"ready": True, **ready}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "quit":
            break
        seconds, new_token_ids = generate(request["prompts"], int(request["max_new_tokens"]))
        replies.write(json.dumps({"seconds": seconds, "new_token_ids": new_token_ids}) + "\n")
