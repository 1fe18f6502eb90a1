"""An agentjax of another revision as a peer of `scripts/bench_generate.py` (`--baseline-rev`).

bench_generate.py checks the revision out in a `git worktree` and starts this script with that
worktree first on PYTHONPATH, so `agentjax` here is the old code. It speaks the protocol of
`bench_generate_hf_peer.py`, one JSON object a line:

    {"op": "generate", "prompts": [[ids...], ...], "max_new_tokens": 64}
        -> {"seconds": wall time of LLM.generate, "new_token_ids": [[...], ...]}
    {"op": "quit"}

Its first line is {"ready": true, "revision": ..., "load_s": ...}. It uses only the public `LLM`
and `SamplingParams`, greedy with `ignore_eos`, so any revision since the first can answer.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="CPUs this process may use (default 2)")
    parser.add_argument("--engine-args", default="{}", help="LLM settings as a JSON object")
    parser.add_argument("--revision", default="", help="the revision's name, echoed in the ready line")
    args = parser.parse_args()

    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) > args.threads:
        os.sched_setaffinity(0, allowed[: args.threads])

    started = time.perf_counter()
    from agentjax import LLM, SamplingParams

    llm = LLM(None, numerics="fast", **json.loads(args.engine_args))
    replies.write(json.dumps({"ready": True, "revision": args.revision, "load_s": time.perf_counter() - started,
                              "agentjax": os.path.dirname(sys.modules["agentjax"].__file__)}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "quit":
            break
        sampling = SamplingParams(max_tokens=int(request["max_new_tokens"]), temperature=0.0, ignore_eos=True)
        started = time.perf_counter()
        outputs = llm.generate(request["prompts"], sampling)
        seconds = time.perf_counter() - started
        replies.write(json.dumps({"seconds": seconds, "new_token_ids": [o.token_ids for o in outputs]}) + "\n")


if __name__ == "__main__":
    main()
