"""Prefill steps trimmed to a token bucket, on and off, side by side: SmolLM2-135M, written to BENCHMARKS.md.

`EngineConfig.trim_prefill_to_buckets` leaves a step's overflow past a token bucket to the next step
when that overflow is smaller than the padding up to the next bucket. This script times the decode
batch of `scripts/bench_generate.py` (its 16 chat prompts, 64 greedy tokens each, prefill included)
through two LLMs in one process, one with the trim and one without, alternating `--runs` times after
a warm-up of each, and checks that both give the same tokens.

    .venv/bin/python scripts/bench_prefill_trim.py [--runs 6] [--threads 2] [--no-write]
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.bench_generate import limit_threads  # noqa: E402
from scripts.bench_generate_prompts import build_prompts  # noqa: E402
from scripts.benchmarks_md import benchmark_parser, write_section  # noqa: E402

SECTION = "## Prefill steps trimmed to a token bucket (SmolLM2-135M, on and off)"


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--runs", type=int, default=6, help="timed runs of each engine, alternating (default 6)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    parser.add_argument("--batch", type=int, default=16, help="prompts in the batch (default 16)")
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt (default 64)")
    args = parser.parse_args()
    threads = limit_threads(args.threads)

    from agentjax import LLM, SamplingParams

    llms = {"on": LLM(numerics="fast"), "off": LLM(numerics="fast", trim_prefill_to_buckets=False)}
    prompts = build_prompts(llms["on"].tokenizer, argparse.Namespace(batch=args.batch, prefill_tokens=1024))[0]
    sampling = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    seconds: dict[str, list[float]] = {name: [] for name in llms}
    tokens: dict[str, list] = {}
    for run in range(args.runs + 1):  # run 0 warms both up (compiles every step shape)
        for name, llm in llms.items():
            started = time.perf_counter()
            outputs = llm.generate(prompts, sampling)
            elapsed = time.perf_counter() - started
            tokens.setdefault(name, [o.token_ids for o in outputs])
            if run:
                seconds[name].append(elapsed)
        print(f"run {run}: " + ", ".join(f"{n} {s[-1]:.2f} s" for n, s in seconds.items() if s), file=sys.stderr)

    on, off = statistics.median(seconds["on"]), statistics.median(seconds["off"])
    same = tokens["on"] == tokens["off"]
    command = "python scripts/bench_prefill_trim.py" + (f" --runs {args.runs}" if args.runs != 6 else "")
    body = "\n".join([
        SECTION, "",
        f"`{command}` on {platform.processor() or platform.machine()} ({threads}), "
        f"{datetime.date.today().isoformat()}: {args.batch} chat prompts ({sum(map(len, prompts))} prompt tokens), "
        f"{args.new_tokens} greedy tokens each, numerics \"fast\"; the two LLMs alternate in one process, "
        f"{args.runs} timed runs each after a warm-up.", "",
        "| trim_prefill_to_buckets | median s | runs (s) | tok/s at the median |", "|---|---|---|---|",
        *(f"| {name} | {statistics.median(s):.2f} | {', '.join(f'{x:.2f}' for x in s)} | "
          f"{args.batch * args.new_tokens / statistics.median(s):.1f} |" for name, s in seconds.items()),
        "",
        f"On / off: {on / off:.3f} of the time ({off / on:.2f}x the speed); "
        f"the two runs' tokens are {'identical' if same else 'DIFFERENT'}.", ""])
    print(body)
    if not args.no_write:
        write_section(body)
    if not same:
        sys.exit("the trimmed and untrimmed runs gave different tokens")


if __name__ == "__main__":
    main()
