"""Benchmark: prefix hits of a recurrent-state model against a dense one on the same agent stream, written to
the "## Recurrent-state prefix hits on agent traffic (AgentX replay)" section of BENCHMARKS.md (issue 37).

`agentjax bench agentx` in process, once per model, on the dev traces with subagents, retried requests and
one compaction per session added, and a fixed number of sessions per lane, so both models get the same
requests. Each row carries its exact command, its hit rate per request kind (first, turn, branch,
compaction, retry) and what each KV page group alone could have served. Outputs are capped: no prompt
holds an earlier output, so the hit rates do not depend on them. Hit rates are exact; seconds are not.

    python scripts/bench_agentx_state_hits.py [--context-scale 0.25] [--lanes 4] [--sessions-per-lane 1]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmarks_md import publish  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Recurrent-state prefix hits on agent traffic (AgentX replay)"
KINDS = ("first", "turn", "branch", "compaction", "retry")


def command(args: argparse.Namespace, model: str, out: Path) -> list[str]:
    return ["agentjax", "bench", "agentx", "--model", model, "--traces", args.traces, "--lanes", str(args.lanes),
            "--context-scale", str(args.context_scale), "--duration", "36000",
            "--sessions-per-lane", str(args.sessions_per_lane), "--max-output-tokens", str(args.max_output_tokens),
            "--subagent-share", str(args.subagent_share), "--retry-rate", str(args.retry_rate), "--compaction",
            "--max-model-len", str(args.max_model_len), "--seed", str(args.seed), "--out", str(out)]


def run(args: argparse.Namespace, model: str, out: Path) -> tuple[str, dict, float]:
    argv = command(args, model, out)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "agentjax.cli", *argv[1:]], cwd=REPO, check=True)
    shown = shlex.join(argv[:-1] + ["r.json"])
    return shown, json.loads(out.read_text()), time.perf_counter() - started


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def row(model: str, summary: dict, seconds: float) -> str:
    kinds = summary.get("hit_rate_by_kind", {})
    by_kind = " / ".join(f"{_percent(kinds[k]['hit_rate'])} ({kinds[k]['requests']})" if k in kinds else "-"
                         for k in KINDS)
    kv = summary.get("kv", {})
    groups = ", ".join(f"{name} {tokens:,}" for name, tokens in kv.get("group_hits", {}).items())
    return (f"| {model} | {summary['requests']:,} | {summary['errors']} | {summary['input_tokens']:,} | "
            f"{summary['cached_tokens']:,} | **{_percent(summary['hit_rate'])}** | {by_kind} | {groups} | "
            f"{kv.get('branch_states_saved', '-')} | {kv.get('evictions', '-')} | {seconds:.0f} |")


def section(args: argparse.Namespace, rows: list[tuple[str, str, dict, float]], load: tuple) -> str:
    lines = [SECTION, "",
             "Written by `scripts/bench_agentx_state_hits.py` (`python scripts/bench_agentx_state_hits.py "
             f"--context-scale {args.context_scale} --lanes {args.lanes} --sessions-per-lane "
             f"{args.sessions_per_lane}`): one run, both models on the same requests (the dev traces, "
             f"{args.sessions_per_lane} session(s) per lane, the first part-way in; subagents in "
             f"{args.subagent_share:.0%} of sessions branching off the system prompt and tools, "
             f"{args.retry_rate:.0%} of requests re-sent identically, one compaction per session). "
             "Hit rate per kind: the requests' cached over input tokens (requests in brackets); `first` is "
             "a lane's or a fresh session's cold first request. Group hits: the prompt tokens each KV page "
             "group alone could serve (a hit is the least of them).", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average {load[0]:.1f} at the start and "
             f"{load[1]:.1f} at the end (shared machine: the seconds are noisy, the hit rates exact).", "",
             "| model | requests | errors | input tokens | cached | token hit rate | by kind: "
             + " / ".join(KINDS) + " | group hits | branch states saved | evictions | seconds |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [row(model, summary, seconds) for model, _, summary, seconds in rows]
    rates = {model: summary["hit_rate"] for model, _, summary, _ in rows}
    if len(rates) == 2 and None not in rates.values():
        (first, a), (second, b) = rates.items()
        lines += ["", f"{first} - {second}: {100 * (a - b):+.2f} points."]
    lines += ["", "Commands (`r.json` a scratch file):", ""]
    lines += [f"    {shown}" for _, shown, _, _ in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="preset:tiny-kimi-k3,preset:tiny-dense")
    parser.add_argument("--traces", default="../shared/traces/agentx-dev")
    parser.add_argument("--context-scale", type=float, default=0.25)
    parser.add_argument("--lanes", type=int, default=4)
    parser.add_argument("--sessions-per-lane", type=int, default=1)
    parser.add_argument("--max-output-tokens", type=int, default=4)
    parser.add_argument("--subagent-share", type=float, default=0.44)
    parser.add_argument("--retry-rate", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=262_144,
                        help="one context length for both models (tiny-dense has 4,096 positions, tiny-kimi-k3 "
                             "32,768): no prompt is cut for one model only")
    parser.add_argument("--no-write", action="store_true", help="print the section only")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for index, model in enumerate(args.models.split(",")):
            shown, summary, seconds = run(args, model, Path(tmp) / f"r{index}.json")
            rows.append((model.removeprefix("preset:"), shown, summary, seconds))
    publish(section(args, rows, (load_before, os.getloadavg()[0])), not args.no_write)


if __name__ == "__main__":
    main()
