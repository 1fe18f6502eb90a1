"""Median time of one decode step of the engine on the embedded model (SmolLM2-135M), per sampling kind.

    .venv/bin/python scripts/bench_decode_step.py [--rows 8 32] [--steps 40] [--kinds greedy logprobs ...]

Each kind runs `rows` requests to the end of their prefill, then times `steps` pure decode steps
(`Engine.step()` wall time: median and minimum, and the median host share, i.e. step time less the
time the runner waited on the device); the first decode steps, which compile, are not timed. Kinds: greedy (temperature 0), sampled (temperature 1, top-p 0.9),
logprobs (greedy, top 5 logprobs), penalties (greedy, frequency and presence penalties and a
logit bias). Prints one line per (kind, rows).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentjax import LLM, SamplingParams  # noqa: E402
from agentjax.config import EngineConfig  # noqa: E402
from agentjax.engine import Engine  # noqa: E402

KINDS = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=1.0, top_p=0.9, seed=1),
    "logprobs": dict(temperature=0.0, logprobs=5),
    "penalties": dict(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.5, logit_bias={13: -5.0}),
}


def time_decode(llm: LLM, kind: str, rows: int, steps: int, warmup: int = 3) -> tuple[float, float, float]:
    engine = Engine(llm.model_config, llm.params,
                    EngineConfig(num_kv_blocks=512, max_num_batched_tokens=2048, max_num_seqs=64), llm.tokenizer)
    sampling = SamplingParams(max_tokens=steps + warmup + 2, ignore_eos=True, **KINDS[kind])
    for index in range(rows):
        engine.add_request([1000 + index, 2000, 3000, 4000 + index] * 8, sampling)
    while any(not r.output_token_ids for r in engine.requests.values()):
        engine.step()
    step_s, host_s = [], []
    for index in range(steps + warmup):
        started = time.perf_counter()
        engine.step()
        if index >= warmup:
            step_s.append(time.perf_counter() - started)
            host_s.append(step_s[-1] - engine.runner.last_device_s)
    return statistics.median(step_s), min(step_s), statistics.median(host_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kinds", nargs="+", default=["greedy"], choices=sorted(KINDS))
    args = parser.parse_args()
    llm = LLM()
    for kind in args.kinds:
        for rows in args.rows:
            median, fastest, host = time_decode(llm, kind, rows, args.steps)
            print(f"{kind:>9} {rows:>3} rows: decode step median {median * 1000:7.2f} ms, min {fastest * 1000:7.2f} ms, "
                  f"host {host * 1000:5.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
