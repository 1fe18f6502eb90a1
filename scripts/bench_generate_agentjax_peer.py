"""An agentjax of another revision as a peer of `scripts/bench_generate.py` (`--baseline-rev`).

bench_generate.py checks the revision out in a `git worktree` and starts this script with that
worktree first on PYTHONPATH, so `agentjax` here is the old code. It speaks the line protocol of
`peer_protocol.py` (seconds: the wall time of LLM.generate). Its first line is {"ready": true,
"revision": ..., "load_s": ...}. It uses only the public `LLM` and `SamplingParams`, greedy with
`ignore_eos`, so any revision since the first can answer.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from peer_protocol import open_replies, serve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="CPUs this process may use (default 2)")
    parser.add_argument("--engine-args", default="{}", help="LLM settings as a JSON object")
    parser.add_argument("--revision", default="", help="the revision's name, echoed in the ready line")
    args = parser.parse_args()
    replies = open_replies(args.threads)

    started = time.perf_counter()
    from agentjax import LLM, SamplingParams

    llm = LLM(None, numerics="fast", **json.loads(args.engine_args))
    ready = {"revision": args.revision, "load_s": time.perf_counter() - started,
             "agentjax": os.path.dirname(sys.modules["agentjax"].__file__)}

    def generate(prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
        sampling = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        started = time.perf_counter()
        outputs = llm.generate(prompts, sampling)
        return time.perf_counter() - started, [o.token_ids for o in outputs]

    serve(replies, ready, generate)


if __name__ == "__main__":
    main()
