"""Benchmark: sticky routing against queue-depth balancing through `agentjax router`, side by side on the
same replicas and seed, written to the "## Router: sticky vs queue depth" section of BENCHMARKS.md
(issue 18, acceptance 2).

For each configuration (a model and a context scale), starts N `agentjax serve` replicas, warms them
(an untimed replay through a router of each policy, so no measured run pays for XLA compilation),
then for each round and policy starts `agentjax router --policy P`, replays the AgentX dev traces
through it with the `agentjax bench agentx` replay (`AgentxRun` + `HttpBackend`, the code behind
`agentjax bench agentx --url ROUTER`), and stops the router. Each run has its own salt, so runs share no prefixes on the shared replicas. Reports the token
hit rate, TTFT P50/P90 of later turns (every turn of a session after the first one this run sent),
TPGS, and the router's routing decisions. A benchmark, not a test: CI does not run it.

    python scripts/bench_router.py [--configs preset:tiny-dense@0.01,preset:tiny-long@0.05] [--replicas 3]
        [--lanes 6] [--duration 60] [--rounds 3] [--no-write]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from benchmarks_md import benchmark_parser, write_section  # noqa: E402
from local_server import free_port, start_healthy  # noqa: E402
from agentjax.bench.agentx import AgentxConfig, AgentxRun, load_sessions  # noqa: E402
from agentjax.bench.backends import HttpBackend  # noqa: E402

SECTION = "## Router: sticky vs queue depth"
CLI = [sys.executable, "-m", "agentjax.cli"]


def start(argv: list[str], log_path: Path, timeout_s: float = 300) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = start_healthy([*argv, "--port", str(port)], port, log_path, REPO, timeout_s=timeout_s)
    return process, f"http://127.0.0.1:{port}"


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def router_counts(url: str) -> dict[str, float]:
    """Routing decisions by reason, retries and session migrations from the router's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    counts: dict[str, float] = {}
    for name, labels, value in re.findall(r"^agentjax:router_(routing_decisions|session_migrations|retries)_total"
                                          r"\{([^}]*)\} (\S+)$", text, re.M):
        reason = re.search(r'reason="([^"]*)"', labels).group(1)
        counts[f"{name}:{reason}"] = float(value)
    return counts


def replica_counters(urls: list[str]) -> dict[str, dict[str, float]]:
    """Each replica's prompt tokens computed (not read from the cache) and generated, so far."""
    counters = {}
    for url in urls:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        values = dict(re.findall(r"^agentjax:(prompt_tokens_computed_total|generation_tokens_total) (\S+)$", text, re.M))
        counters[url] = {name: float(value) for name, value in values.items()}
    return counters


def requests_per_replica(router_url: str, urls: list[str]) -> list[int]:
    text = httpx.get(f"{router_url}/metrics", timeout=10).text
    found = dict(re.findall(r'^agentjax:router_requests_total\{replica="([^"]+)"\} (\S+)$', text, re.M))
    return [int(float(found.get(url, 0))) for url in urls]


def later_turn_ttfts(run: AgentxRun) -> list[float]:
    """TTFTs of counted requests that are not the first request their session sent in this run."""
    seen: set[str] = set()
    later = []
    for record, counted in sorted(run.records, key=lambda item: item[0].start_time_s):
        first = record.session_id not in seen
        seen.add(record.session_id)
        if counted and not first and record.succeeded and record.ttft_s is not None:
            later.append(record.ttft_s)
    return later


def replay(args: argparse.Namespace, router_url: str, salt: str, duration_s: float, sessions) -> tuple[dict, AgentxRun]:
    config = AgentxConfig(traces=args.traces, lanes=args.lanes, context_scale=args.context_scale,
                          duration_s=duration_s, think_scale=args.think_scale, seed=args.seed,
                          gpus=args.replicas, salt=salt, progress=True)
    run = AgentxRun(config, sessions, HttpBackend(router_url))
    summary = asyncio.run(run.run())
    return summary, run


def measure(args: argparse.Namespace, replica_urls: list[str], policy: str, salt: str, duration_s: float,
            sessions, log_dir: Path) -> dict:
    router, url = start([*CLI, "router", "--policy", policy, "--replica", *replica_urls],
                        log_dir / f"router-{salt}.log", timeout_s=60)
    try:
        started = time.time()
        before = replica_counters(replica_urls)
        summary, run = replay(args, url, salt, duration_s, sessions)
        after = replica_counters(replica_urls)
        counts = router_counts(url)
        per_replica = requests_per_replica(url, replica_urls)
    finally:
        stop(router)
    computed = [after[u].get("prompt_tokens_computed_total", 0) - before[u].get("prompt_tokens_computed_total", 0)
                for u in replica_urls]
    later = later_turn_ttfts(run)
    result = {"policy": policy, "salt": salt, "started": time.strftime("%H:%M", time.gmtime(started)),
              "load_average": os.getloadavg()[0], "later_turns": len(later),
              "later_ttft_p50_s": float(np.percentile(later, 50)) if later else None,
              "later_ttft_p90_s": float(np.percentile(later, 90)) if later else None,
              "router": counts, "requests_per_replica": per_replica, "prompt_tokens_computed": computed,
              **{k: summary[k] for k in ("tpgs", "hit_rate", "requests", "errors", "ttft_p50_s",
                                                            "ttft_p90_s", "input_tokens", "cached_tokens",
                                                            "output_tokens", "wall_time_s", "p90_interactivity")}}
    print(f"[bench_router] {json.dumps(result)}", file=sys.stderr, flush=True)
    return result


def fmt(value: float | None, style: str) -> str:
    return "-" if value is None else style.format(value)


def _row(label: str, policy: str, r: dict) -> str:
    moves = sum(v for k, v in r["router"].items() if k.startswith("session_migrations:"))
    per_request = sum(r["prompt_tokens_computed"]) / max(1, sum(r["requests_per_replica"]))
    return (f"| {label} | {policy} | {r['requests']} | {r['errors']} | {fmt(r['hit_rate'], '{:.2%}')} | "
            f"{fmt(r['later_ttft_p50_s'], '{:.3f}')} | {fmt(r['later_ttft_p90_s'], '{:.3f}')} | "
            f"{fmt(r['ttft_p50_s'], '{:.3f}')} | {fmt(r['tpgs'], '{:,.1f}')} | {per_request:,.0f} | "
            f"{' / '.join(map(str, r['requests_per_replica']))} | {moves:.0f} | {r['load_average']:.1f} |")


def _mean_row(policy: str, runs: list[dict]) -> str:
    def mean(key: str) -> float | None:
        values = [r[key] for r in runs if r[key] is not None]
        return sum(values) / len(values) if values else None
    return (f"| mean of {len(runs)} | {policy} | {sum(r['requests'] for r in runs) / len(runs):.0f} | "
            f"{sum(r['errors'] for r in runs)} | {fmt(mean('hit_rate'), '{:.2%}')} | "
            f"{fmt(mean('later_ttft_p50_s'), '{:.3f}')} | {fmt(mean('later_ttft_p90_s'), '{:.3f}')} | "
            f"{fmt(mean('ttft_p50_s'), '{:.3f}')} | {fmt(mean('tpgs'), '{:,.1f}')} | | | | |")


def config_table(config: argparse.Namespace, results: list[dict]) -> list[str]:
    lines = [f"### {config.replicas} x `agentjax serve --model {config.model} --num-kv-blocks {config.num_kv_blocks}`, "
             f"context scale {config.context_scale}", "",
             "| run | policy | requests | errors | token hit rate | TTFT P50 later turns (s) | TTFT P90 later turns (s) "
             "| TTFT P50 all (s) | TPGS (tok/GPU-s) | prompt tokens computed per request | requests per replica "
             "| session moves | load avg |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for index, r in enumerate(results, 1):
        lines.append(_row(f"{index} ({r['started']} UTC)", r["policy"], r))
    for policy in dict.fromkeys(r["policy"] for r in results):
        lines.append(_mean_row(policy, [r for r in results if r["policy"] == policy]))
    lines += ["", "Routing decisions per run (router `/metrics`):", ""]
    for index, r in enumerate(results, 1):
        decisions = ", ".join(f"{k.split(':', 1)[1]} {v:.0f}" for k, v in sorted(r["router"].items())
                              if k.startswith("routing_decisions:"))
        lines.append(f"- run {index} ({r['policy']}): {decisions}")
    return lines + [""]


def section(args: argparse.Namespace, tables: list[list[str]], machine: str, command: str) -> str:
    lines = [SECTION, "",
             "Written by `scripts/bench_router.py` (issue 18, acceptance 2). For each configuration below: "
             f"{args.replicas} `agentjax serve` replicas behind `agentjax router --policy P`, replaying "
             "`../shared/traces/agentx-dev` with the `agentjax bench agentx --url ROUTER` replay "
             f"({args.lanes} closed-loop lanes, think scale {args.think_scale}, seed {args.seed}, "
             f"{args.duration:.0f} s per run after each lane's warm-up request), the policies in turn for "
             f"{args.rounds} round(s). Same replicas and seed for every run of a configuration; each run has its own "
             "salt (no prefixes shared across runs); an untimed replay per policy warmed the replicas first "
             f"({args.warmup_duration:.0f} s each). TPGS divides by {args.replicas} (one nominal GPU per replica). "
             "Later turns: every request of a session after the first one the run sent (a lane's first session "
             "starts part-way through, so its first request is cold under any policy). Prompt tokens computed: "
             "the replicas' `agentjax:prompt_tokens_computed_total` over the run, per request.", "", machine, ""]
    for table in tables:
        lines += table
    lines += ["Command:", "", f"    {command}", ""]
    return "\n".join(lines)


def machine_line(load_before: float) -> str:
    cpu = platform.machine()
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    return (f"Machine: {os.cpu_count()} CPU cores ({cpu}), shared with other agents' work, Python "
            f"{platform.python_version()}, run on {time.strftime('%Y-%m-%d')}; load average {load_before:.1f} "
            f"before the replicas started, {os.getloadavg()[0]:.1f} at the end (per run: last column). The "
            "replicas, the router and the client share those cores, so the replicas are not independent "
            "machines: latency differences come from the work each policy makes them do (cache misses recompute "
            "prefixes), not from added parallel capacity.")


def run_config(args: argparse.Namespace, config: argparse.Namespace, log_dir: Path) -> list[dict]:
    """Start the replicas of one configuration, warm them, measure every policy each round, stop them."""
    sessions = load_sessions(AgentxConfig(traces=config.traces, context_scale=config.context_scale))
    replica_flags = ["--model", config.model, "--num-kv-blocks", str(config.num_kv_blocks)]
    replicas = []
    try:
        for index in range(config.replicas):  # one at a time: parallel start-ups fight for the 2 cores
            replicas.append(start([*CLI, "serve", *replica_flags], log_dir / f"replica-{config.model}-{index}.log"))
        urls = [url for _, url in replicas]
        print(f"[bench_router] {config.model} at scale {config.context_scale}: replicas {urls}; warming up",
              file=sys.stderr, flush=True)
        tag = f"{config.model}@{config.context_scale}"
        for policy in args.policies.split(","):  # each policy's batch shapes compiled before any measured run
            measure(config, urls, policy, f"{tag}-warmup-{policy}", args.warmup_duration, sessions, log_dir)
        return [measure(config, urls, policy, f"{tag}-{policy}-{round_index}", args.duration, sessions, log_dir)
                for round_index in range(args.rounds) for policy in args.policies.split(",")]
    finally:
        for process, _ in replicas:
            stop(process)


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--traces", default=str(REPO.parent / "shared" / "traces" / "agentx-dev"))
    parser.add_argument("--configs", default="preset:tiny-dense@0.01,preset:tiny-long@0.05",
                        help="comma-separated MODEL@CONTEXT_SCALE; replicas are started anew for each")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--num-kv-blocks", type=int, default=4096)
    parser.add_argument("--lanes", type=int, default=6)
    parser.add_argument("--think-scale", type=float, default=0.0)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--warmup-duration", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3, help="each policy in turn, this many times")
    parser.add_argument("--policies", default="sticky,queue")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    args = parser.parse_args()
    command = "python scripts/bench_router.py " + " ".join(sys.argv[1:])
    load_before = os.getloadavg()[0]
    tables, raw = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.configs.split(","):
            model, _, scale = spec.rpartition("@")
            config = argparse.Namespace(**{**vars(args), "model": model, "context_scale": float(scale)})
            results = run_config(args, config, Path(tmp))
            raw[spec] = results
            tables.append(config_table(config, results))
    if args.json:
        args.json.write_text(json.dumps(raw, indent=2) + "\n")
    text = section(args, tables, machine_line(load_before), command)
    print(text)
    if not args.no_write:
        write_section(text)
        print(f"[bench_router] wrote the {SECTION!r} section of BENCHMARKS.md", file=sys.stderr)


if __name__ == "__main__":
    main()
