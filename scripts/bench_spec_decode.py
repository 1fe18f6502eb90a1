"""Speculative decoding benchmark: n-gram drafts on against off, SmolLM2-135M on code-editing prompts.

Each prompt holds a whole Python file of 100-300 lines (modules of the Python standard library, so the
files are fixed for a given Python) and asks for the file back with one change: a function (or, in a
module of classes, a method) renamed.
Such replies copy most of the prompt, which is what prompt lookup drafts. For batch 1 (the first file)
and batch 8 (eight files), with n-gram drafts off and on, it runs the requests once to warm up (compiles
and caches the prompts' pages), then again timed, and reports:

  * tokens per step: new tokens per decode row per step (1 without drafts; 1 + accepted drafts with);
  * decode tok/s: tokens made in decode-only steps / the wall time of those steps;
  * acceptance: accepted / proposed draft tokens, and accepted tokens by draft position.

Greedy decoding (temperature 0), so the two arms produce the same replies (checked, reported).

Usage:
    python scripts/bench_spec_decode.py [--k 4] [--max-tokens 256] [--lookup-min 2 --lookup-max 5]
        [--numerics fast] [--out result.json] [--write]      # --write: the BENCHMARKS.md section
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import inspect
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
SECTION = "## Speculative decoding: n-gram drafts on code-editing prompts (SmolLM2-135M, CPU)"
FILES = ["colorsys", "bisect", "fnmatch", "sched", "getopt", "glob", "netrc", "graphlib"]


def editing_prompts(tokenizer) -> list[tuple[str, list[int]]]:
    """(module name, chat prompt ids): 'return this file with function X renamed to X_renamed'."""
    prompts = []
    for name in FILES:
        source = inspect.getsource(importlib.import_module(name))
        function = re.findall(r"^\s*def ([a-z]\w*)\(", source, re.MULTILINE)[0]  # a function or a method
        message = (f"Here is the file {name}.py:\n```python\n{source}```\n"
                   f"Rename the function `{function}` to `{function}_renamed` and change nothing else. "
                   f"Reply with the whole updated file in one code block.")
        prompts.append((name, tokenizer.encode_chat([{"role": "user", "content": message}])))
    return prompts


def run_arm(llm, prompts: list[list[int]], k: int | None, args) -> dict:
    """One engine, a warm-up run and a timed run of `prompts` together; figures of the timed run."""
    from agentjax.config import EngineConfig
    from agentjax.engine import Engine
    from agentjax.sampling_params import SamplingParams

    pages = sum(-(-(len(p) + args.max_tokens + 16) // 16) for p in prompts) + 64
    settings = dict(numerics=args.numerics, num_kv_blocks=pages, max_num_batched_tokens=2048, max_num_seqs=16)
    if k is not None:
        settings["speculative_config"] = {"method": "ngram", "num_speculative_tokens": k,
                                          "prompt_lookup_min": args.lookup_min, "prompt_lookup_max": args.lookup_max}
    engine = Engine(llm.model_config, llm.params, EngineConfig(**settings), llm.tokenizer)
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    for prompt in prompts:  # warm-up: compiles the step shapes and caches the prompts' pages
        engine.add_request(prompt, SamplingParams(max_tokens=min(48, args.max_tokens), temperature=0.0))
    list(engine.run_until_done())
    before = dict(engine.stats().get("spec_decode", {}))
    ids = [engine.add_request(prompt, greedy) for prompt in prompts]
    replies = {i: [] for i in ids}
    decode_s = decode_tokens = row_steps = steps = 0
    while engine.has_unfinished():
        plan_rows = len(engine.scheduler.running)
        started = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - started
        record = engine.step_log[-1]
        for out in outputs:
            replies[out.request_id].extend(out.new_token_ids)
        if record.rows and not any(prefill for _, _, prefill in record.rows) and plan_rows:
            decode_s += elapsed
            decode_tokens += sum(len(out.new_token_ids) for out in outputs)
            row_steps += len(record.rows)
            steps += 1
    after = engine.stats().get("spec_decode")
    result = {"k": k, "batch": len(prompts), "decode_steps": steps, "decode_s": decode_s,
              "decode_tokens": decode_tokens, "tokens_per_step": decode_tokens / max(1, row_steps),
              "decode_tok_s": decode_tokens / decode_s if decode_s else 0.0,
              "reply_tokens": [len(replies[i]) for i in ids], "replies": [replies[i] for i in ids]}
    if after is not None:
        drafts = {key: after[key] - before.get(key, 0) for key in ("num_drafts", "num_draft_tokens",
                                                                   "num_accepted_tokens")}
        drafts["accepted_per_position"] = [a - b for a, b in zip(after["accepted_per_position"],
                                                                  before.get("accepted_per_position", [0] * k))]
        result["spec_decode"] = drafts
    return result


def table(results: list[dict]) -> str:
    lines = ["| batch | n-gram drafts | tokens per step | decode tok/s | speed-up | draft tokens accepted | "
             "accepted by position |", "|---|---|---|---|---|---|---|"]
    for batch in sorted({r["batch"] for r in results}):
        off = next(r for r in results if r["batch"] == batch and r["k"] is None)
        for r in [x for x in results if x["batch"] == batch]:
            spec = r.get("spec_decode")
            accepted = (f"{spec['num_accepted_tokens']}/{spec['num_draft_tokens']} "
                        f"({spec['num_accepted_tokens'] / max(1, spec['num_draft_tokens']):.0%})") if spec else "-"
            per_position = " / ".join(str(v) for v in spec["accepted_per_position"]) if spec else "-"
            lines.append(f"| {batch} | {'off' if r['k'] is None else f'k={r['k']}'} | {r['tokens_per_step']:.2f} | "
                         f"{r['decode_tok_s']:.1f} | {r['decode_tok_s'] / off['decode_tok_s']:.2f}x | {accepted} | "
                         f"{per_position} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--numerics", choices=("fast", "batch_invariant"), default="fast")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    parser.add_argument("--write", action="store_true", help="write the BENCHMARKS.md section")
    args = parser.parse_args()
    from agentjax import LLM

    load_before = os.getloadavg()
    llm = LLM(numerics=args.numerics)
    named = editing_prompts(llm.tokenizer)
    results = []
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = [ids for _, ids in named[:batch]]
        for k in (None, args.k):
            result = run_arm(llm, prompts, k, args)
            print(f"batch {batch} k={k}: {result['tokens_per_step']:.2f} tokens/step, "
                  f"{result['decode_tok_s']:.1f} decode tok/s", flush=True)
            results.append(result)
        off, on = results[-2], results[-1]
        on["same_replies_as_off"] = off["replies"] == on["replies"]
    load_after = os.getloadavg()
    body = table(results)
    lengths = [len(ids) for _, ids in named]
    notes = (f"Prompts: {len(FILES)} standard-library modules ({', '.join(FILES)}; {min(lengths)}-{max(lengths)} "
             f"prompt tokens), each asking for the file back with one function renamed; greedy, "
             f"max_tokens={args.max_tokens}, numerics={args.numerics}; n-gram k={args.k}, prompt_lookup_min="
             f"{args.lookup_min}, prompt_lookup_max={args.lookup_max}. Replies with drafts equal those without: "
             f"{all(r.get('same_replies_as_off', True) for r in results)}. Tokens per step = new tokens per decode "
             f"row per step; decode tok/s over decode-only steps of the timed (second) run. Machine: "
             f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average "
             f"{load_before[0]:.1f} at the start and {load_after[0]:.1f} at the end; "
             f"{datetime.date.today().isoformat()}.")
    command = "python scripts/bench_spec_decode.py " + " ".join(sys.argv[1:])
    print(body)
    print(notes)
    if args.out:
        Path(args.out).write_text(json.dumps({"results": results, "notes": notes}, indent=1))
    if args.write:
        from benchmarks_md import write_section

        write_section(f"{SECTION}\n\n`{command.strip()}`\n\n{body}\n\n{notes}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
