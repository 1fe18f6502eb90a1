"""`agentjax bench ...`: the AgentX replay, the report of an official AgentX run, the concurrency sweep,
and the KV policy simulator.

    agentjax bench agentx [--url URL | --model M] --lanes 4 --context-scale 0.01 --duration 60 --out r.json
    agentjax bench report DIR
    agentjax bench sweep-concurrency --levels 1,2,4,8 --out-dir sweep/
    agentjax bench kv-sim --traces 'DIR/*.json.gz' --lanes 32 --hbm-tokens 1M --policies lru,belady,hints --out r.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from agentjax.bench.agentx import DEFAULT_TRACES

_ENGINE_FLAGS = (("--block-size", int, None, "tokens per KV page"),
                 ("--num-kv-blocks", int, None, "KV pages in the pool (default: sized from 1 GiB)"),
                 ("--max-num-batched-tokens", int, None, "token budget of one step"),
                 ("--max-num-seqs", int, None, "rows in one step"),
                 ("--long-prefill-token-threshold", int, None, "cap on prefill tokens per request per step"),
                 ("--prefill-schedule-interval", int, None, "admit new requests every Nth step"),
                 ("--max-model-len", int, None, "longest prompt plus output (the engine's default: the model's positions); "
                  "replays that compare models give them one length, so no prompt is cut for one model only"))


def _add_replay_flags(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("Target", "what the replay sends requests to")
    target.add_argument("--url", default=None, help="server base URL (e.g. http://127.0.0.1:8000); "
                        "default: none, the engine runs in this process")
    target.add_argument("--model", default=None, help="in-process: the model spec (default: the embedded "
                        "SmolLM2-135M-Instruct); with --url: the served model name (default: the first listed)")
    target.add_argument("--api-key", default=None, help="bearer key for --url (default: none)")
    target.add_argument("--vocab-size", type=int, default=49_152,
                        help="with --url: prompt token ids lie in [256, vocab size)")
    target.add_argument("--gpus", type=int, default=1, help="GPUs the served model uses (TPGS divides by it)")
    traffic = parser.add_argument_group("Traffic", "the traces and how they are replayed")
    traffic.add_argument("--traces", default=DEFAULT_TRACES, help="directory of weka traces (.json, .json.gz)")
    traffic.add_argument("--context-scale", type=float, default=0.01, help="shrink every length by this factor")
    traffic.add_argument("--duration", type=float, default=60.0, help="seconds of sending new turns")
    traffic.add_argument("--warmup", type=float, default=0.0, help="seconds at the start not counted")
    traffic.add_argument("--warmup-requests-per-lane", type=int, default=1,
                         help="first requests of each lane not counted (AgentX: 1)")
    traffic.add_argument("--think-scale", type=float, default=0.0,
                         help="multiply recorded think times by this (1.0: as recorded, capped at 300 s; "
                              "0: turns back to back)")
    traffic.add_argument("--seed", type=int, default=0, help="seed of the lanes' start turns and prompt salts")
    traffic.add_argument("--max-context", type=int, default=None,
                         help="cap tokens per prompt, truncating (default: none; the model's context in process, "
                              "the served max_model_len over HTTP)")
    traffic.add_argument("--max-output-tokens", type=int, default=None,
                         help="cap each turn's output (default: none, the recorded length scaled); a prompt "
                              "never holds an earlier output, so token hit rates do not depend on it")
    traffic.add_argument("--sessions-per-lane", type=int, default=None,
                         help="stop each lane after this many sessions, so every run sends the same requests "
                              "(default: none, lanes run until --duration)")
    traffic.add_argument("--subagent-share", type=float, default=0.0,
                         help="add subagent rollouts (a median of 4, branching off the parent's system prompt "
                              "and tools) to this share of sessions (default 0; the reference mix: 0.44)")
    traffic.add_argument("--retry-rate", type=float, default=0.0,
                         help="re-send this share of requests once, identically, as a client does after a "
                              "timeout (default 0)")
    traffic.add_argument("--compaction", action="store_true",
                         help="compact each session once: in its second half the context past the system "
                              "prompt and tools becomes a summary (default: off)")
    traffic.add_argument("--drain-timeout", type=float, default=120.0,
                         help="seconds to let in-flight requests finish after --duration")
    engine = parser.add_argument_group("In-process engine", "settings of the engine this process runs "
                                       "without --url (default: the engine's own)")
    for flag, kind, default, text in _ENGINE_FLAGS:
        engine.add_argument(flag, type=kind, default=default, help=f"{text} (default: the engine's)")


def _engine_args(args: argparse.Namespace) -> dict:
    names = [flag.removeprefix("--").replace("-", "_") for flag, *_ in _ENGINE_FLAGS]
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _config(args: argparse.Namespace, lanes: int, progress: bool):
    from agentjax.bench.agentx import AgentxConfig

    return AgentxConfig(traces=args.traces, lanes=lanes, context_scale=args.context_scale,
                        duration_s=args.duration, warmup_s=args.warmup,
                        warmup_requests_per_lane=args.warmup_requests_per_lane,
                        think_scale=args.think_scale, seed=args.seed, gpus=args.gpus,
                        max_context=args.max_context, drain_timeout_s=args.drain_timeout,
                        progress=progress, sessions_per_lane=args.sessions_per_lane,
                        max_output_tokens=args.max_output_tokens,
                        subagent_share=args.subagent_share, retry_rate=args.retry_rate,
                        compaction=args.compaction)


def _backend_args(args: argparse.Namespace) -> dict:
    if args.url:
        return dict(url=args.url, model=args.model, api_key=args.api_key, vocab_size=args.vocab_size)
    return dict(model=args.model, **_engine_args(args))


def cmd_agentx(args: argparse.Namespace) -> int:
    from agentjax.bench.agentx import load_sessions, run_agentx
    from agentjax.bench.metrics import format_table, write_summary

    config = _config(args, args.lanes, progress=True)
    summary = run_agentx(config, sessions=load_sessions(config), **_backend_args(args))
    summary["target"] = args.url or (args.model or "embedded")
    print(format_table(summary))
    if args.out:
        write_summary(summary, args.out)
        print(f"[agentjax] wrote {args.out}", file=sys.stderr)
    return 1 if summary["errors"] else 0


def cmd_report(args: argparse.Namespace) -> int:
    from agentjax.bench.metrics import format_table, write_summary
    from agentjax.bench.report import report_from_dir

    summary = report_from_dir(args.dir, num_gpus=args.gpus)
    print(format_table(summary))
    if args.out:
        write_summary(summary, args.out)
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from agentjax.bench.sweep import format_sweep, run_sweep

    levels = [int(level) for level in args.levels.split(",") if level.strip()]
    result = run_sweep(levels, lambda lanes: _config(args, lanes, progress=True),
                       Path(args.out_dir), min_interactivity=args.min_interactivity,
                       **_backend_args(args))
    print(format_sweep(result))
    print(f"[agentjax] wrote {result['json']} and {result['plot']}", file=sys.stderr)
    return 0


def cmd_kv_sim(args: argparse.Namespace) -> int:
    from agentjax.bench.kv_sim_cli import run_kv_sim_command

    return run_kv_sim_command(args)


def add_bench_parser(subparsers: argparse._SubParsersAction,
                     formatter: type[argparse.HelpFormatter] = argparse.HelpFormatter) -> argparse.ArgumentParser:
    """Adds `bench` and its subcommands to the `agentjax` command's subparsers."""
    bench = subparsers.add_parser("bench", help="benchmark agent traffic (AgentX replay, report, sweep, KV policy "
                                  "simulator)", formatter_class=formatter)
    sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")

    def add(name: str, **kwargs) -> argparse.ArgumentParser:
        return sub.add_parser(name, description=kwargs["help"], formatter_class=formatter, **kwargs)

    agentx = add("agentx", help="replay agent traces with closed-loop lanes (AgentX)")
    agentx.add_argument("--lanes", type=int, default=4, help="concurrent sessions (AgentX concurrency)")
    agentx.add_argument("--out", default=None, help="write the summary JSON here (default: print only)")
    _add_replay_flags(agentx)
    agentx.set_defaults(handler=cmd_agentx)

    report = add("report", help="AgentX figures from an official AgentX run's profile_export.jsonl")
    report.add_argument("dir", help="the run's --output-artifact-dir, or its profile_export.jsonl itself")
    report.add_argument("--gpus", type=int, default=1, help="GPUs the served model used")
    report.add_argument("--out", default=None, help="write the summary JSON here (default: print only)")
    report.set_defaults(handler=cmd_report)

    sweep = add("sweep-concurrency", help="AgentX at several lane counts; TPGS vs P90 "
                           "interactivity plot with the Pareto frontier")
    sweep.add_argument("--levels", default="1,2,4,8", help="comma-separated lane counts")
    sweep.add_argument("--out-dir", default="sweep", help="writes sweep.json and sweep.png here")
    sweep.add_argument("--min-interactivity", type=float, default=None,
                       help="draw this P90 interactivity target (tok/s) on the plot")
    _add_replay_flags(sweep)
    sweep.set_defaults(handler=cmd_sweep)

    from agentjax.bench.kv_sim_cli import add_kv_sim_flags

    kv_sim = add("kv-sim", help="token hit rate of KV policies per tier on a trace replay "
                            "(the real KV manager on a virtual clock; LRU, Belady and an infinite cache beside)")
    add_kv_sim_flags(kv_sim)
    kv_sim.set_defaults(handler=cmd_kv_sim)
    return bench
