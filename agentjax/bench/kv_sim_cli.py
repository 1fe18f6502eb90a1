"""The `agentjax bench kv-sim` command: flags, trace loading, the printed table and r.json.

    agentjax bench kv-sim --traces '../shared/traces/agentx-dev/*.json.gz' --lanes 32 --stagger 10 \\
        --hbm-tokens 1M [--host-tokens 8M] [--disk-tokens N] --policies lru,belady,hints --out r.json

Host only: never imports jax. Progress goes to stderr, the table to stdout.
"""
from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import sys
import time
from pathlib import Path

from agentjax.bench.kv_replay import build_replay
from agentjax.bench.kv_sim import KVSimConfig, simulate
from agentjax.bench.kv_sim_states import STATE_RETENTIONS, StatePlan, model_state_tokens
from agentjax.bench.traces import load_weka_trace_file
from agentjax.errors import InvalidRequestError
from agentjax.kv.policies import POLICY_NAMES
from agentjax.progress import Throttle, is_quiet

logger = logging.getLogger(__name__)

_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9}


def parse_tokens(text: str) -> int:
    """'1M' -> 1_000_000, '4m' -> 4_000_000, '64k' -> 64_000, '12345' -> 12345 (decimal units)."""
    value = text.strip().lower().replace("_", "")
    scale = _SUFFIXES.get(value[-1:], 1)
    number = value[:-1] if value[-1:] in _SUFFIXES else value
    try:
        tokens = float(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count (e.g. 1M, 4000000, 64k)") from None
    if tokens < 0 or tokens != int(tokens):
        raise argparse.ArgumentTypeError(f"{text!r} must be a whole, non-negative token count")
    return int(tokens)


def trace_paths(pattern: str) -> list[str]:
    """The weka trace files of a glob (or a directory: its *.json.gz and *.json), sorted by name."""
    if os.path.isdir(pattern):
        paths = glob.glob(os.path.join(pattern, "*.json.gz")) + glob.glob(os.path.join(pattern, "*.json"))
    else:
        paths = glob.glob(pattern)
    if not paths:
        raise InvalidRequestError(f"--traces {pattern!r} matches no trace files")
    return sorted(paths, key=lambda path: (os.path.basename(path), path))


def _policy_options(items: list[str]) -> dict:
    """`hints.overdue_s_per_s=0.5` -> {"hints": {"overdue_s_per_s": 0.5}} (values parsed as JSON)."""
    options: dict = {}
    for item in items:
        name, _, rest = item.partition(".")
        key, eq, raw = rest.partition("=")
        if not (name and key and eq):
            raise InvalidRequestError(f"--policy-option {item!r} must look like POLICY.NAME=VALUE")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        options.setdefault(name, {})[key] = value
    return options


def add_kv_sim_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--traces", default="../shared/traces/agentx-dev/*.json.gz",
                        help="glob of weka trace files, or a directory of them (sessions in file-name order)")
    parser.add_argument("--lanes", type=int, required=True, help="concurrent sessions C")
    parser.add_argument("--stagger", type=float, default=10.0, help="lane l starts at l x this many seconds")
    parser.add_argument("--hbm-tokens", type=parse_tokens, required=True,
                        help="device KV capacity in tokens (1M = 1,000,000; counted in 64-token blocks)")
    parser.add_argument("--host-tokens", type=parse_tokens, default=0, help="host tier capacity in tokens (0: none)")
    parser.add_argument("--disk-tokens", type=parse_tokens, default=0, help="disk tier capacity in tokens (0: none)")
    parser.add_argument("--policies", default="lru,belady,hints",
                        help=f"comma-separated, from {','.join(POLICY_NAMES)}; lru and belady always run")
    parser.add_argument("--retention", default="interval", choices=("interval", "marconi"),
                        help="what the lower tiers store at a turn's end")
    parser.add_argument("--policy-option", action="append", default=[], metavar="POLICY.NAME=VALUE",
                        help="a policy constructor option, e.g. hints.overdue_s_per_s=0.5 (repeatable)")
    parser.add_argument("--hint-sigma", type=float, default=0.5,
                        help="sigma of the lognormal error on expected_next_turn_s hints")
    parser.add_argument("--seed", type=int, default=0, help="seed of the hint errors")
    parser.add_argument("--out", default=None, help="write the results JSON here (default: print only)")
    states = parser.add_argument_group("recurrent states", "a hybrid model's hits land on saved states "
                                       "(agentjax/bench/kv_sim_states.py); device tier only")
    states.add_argument("--state-model", default=None, metavar="PRESET",
                        help="model the recurrent states of this preset at full size (e.g. kimi-k3): a state's "
                             "bytes in tokens of its prefix KV, and its default interval")
    states.add_argument("--state-tokens", type=float, default=None,
                        help="one state's bytes in tokens of prefix KV (default: the --state-model's)")
    states.add_argument("--state-retention", default="interval", choices=STATE_RETENTIONS,
                        help="which states a request leaves: end (the prompt's end), interval (and every "
                             "--state-interval tokens), marconi (and where a prefix seen before ended)")
    states.add_argument("--state-interval", type=parse_tokens, default=None,
                        help="tokens between interval states (default: the --state-model's cost-aware interval)")
    states.add_argument("--max-state-share", type=float, default=0.5,
                        help="the most of the device memory states may hold")


def _state_plan(args: argparse.Namespace, block_tokens: int) -> StatePlan | None:
    """The --state-* flags as a `StatePlan` (None without --state-model or --state-tokens)."""
    if args.state_model is None and args.state_tokens is None:
        return None
    state_tokens, interval = model_state_tokens(args.state_model) if args.state_model else (None, None)
    state_tokens = args.state_tokens or state_tokens
    interval = args.state_interval or interval
    if args.state_retention == "interval" and not interval:
        raise InvalidRequestError("--state-retention interval needs --state-interval (or a --state-model)")
    interval = -(-interval // block_tokens) * block_tokens if interval else 0  # whole trace blocks
    return StatePlan(state_tokens, args.state_retention, interval, args.max_state_share)


def format_kv_sim(summary: dict) -> str:
    config, results = summary["config"], summary["results"]
    lines = [f"kv-sim: {summary['workload']['sessions']} sessions, {summary['workload']['requests']} requests, "
             f"{summary['workload']['input_tokens']:,} input tokens; C={config['lanes']}, stagger "
             f"{config['stagger_s']:g} s, HBM {config['hbm_tokens']:,} tokens, host {config['host_tokens']:,}, "
             f"disk {config['disk_tokens']:,}",
             f"{'policy':<10} {'hit rate':>9} {'device':>8} {'host':>8} {'disk':>8} {'of Belady':>10} {'of inf.':>8}"]
    for name, result in results.items():
        tiers = result["tiers"]
        lines.append(f"{name:<10} {100 * result['token_hit_rate']:8.2f}% {100 * tiers['device']:7.2f}% "
                     f"{100 * tiers['host']:7.2f}% {100 * tiers['disk']:7.2f}% "
                     f"{result.get('of_belady', float('nan')):10.4f} {result.get('of_infinite', 1.0):8.4f}")
    for name, result in results.items():
        if "states" in result:
            states = result["states"]
            lines.append(f"{name:<10} states: {states['retention']} (interval {states['interval_tokens']}), "
                         f"{states['states_saved']:,} saved, peak {100 * states['peak_state_share']:.1f}% of the "
                         f"device memory")
    best = summary["best_online"]
    lines.append(f"best online: {best['policy']} at {best['of_belady']:.4f} of Belady, "
                 f"{best['of_infinite']:.4f} of the infinite cache")
    return "\n".join(lines)


def run_kv_sim_command(args: argparse.Namespace) -> int:
    policies = [name.strip() for name in args.policies.split(",") if name.strip()]
    unknown = [name for name in policies if name not in POLICY_NAMES]
    if unknown:
        raise InvalidRequestError(f"unknown --policies {unknown}; choose from {', '.join(POLICY_NAMES)}")
    started = time.perf_counter()

    def report(message: str) -> None:
        if not is_quiet():
            print(f"[kv-sim {time.perf_counter() - started:6.0f}s] {message}", file=sys.stderr, flush=True)

    paths = trace_paths(args.traces)
    report(f"loading {len(paths)} traces")
    sessions, throttle = [], Throttle()
    for index, path in enumerate(paths):
        if throttle.due():
            report(f"loaded {index}/{len(paths)} traces")
        sessions.append(load_weka_trace_file(path))
    replay = build_replay(sessions, args.lanes, args.stagger, args.hint_sigma, args.seed)
    report(f"{len(replay.requests)} requests, {replay.input_tokens:,} input tokens")
    config = KVSimConfig(lanes=args.lanes, hbm_tokens=args.hbm_tokens, host_tokens=args.host_tokens,
                         disk_tokens=args.disk_tokens, policies=policies, retention=args.retention,
                         policy_options=_policy_options(args.policy_option),
                         states=_state_plan(args, replay.block_tokens))
    summary = simulate(replay, config, report, show_bar=not is_quiet())
    summary["config"].update(traces=args.traces, num_trace_files=len(paths), hint_sigma=args.hint_sigma,
                             seed=args.seed)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    print(format_kv_sim(summary))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
        report(f"wrote {args.out}")
    return 0
