"""Benchmark: recurrent states in `agentjax bench kv-sim` on the AgentX dev traces, for Kimi-K3 at full size,
written to the "## Recurrent-state retention (kv-sim)" section of BENCHMARKS.md (issue 37, acceptance 3 and 4).

One subprocess per configuration, so each row carries its exact command: the attention pages alone (what
a model without states would hit), then Kimi-K3's states (464.6 MB each, 16.8K tokens of its bfloat16 MLA
latent) with the engine's default (cost-aware interval), a state every 64 tokens, end-of-prompt states
only, and the Marconi rule. States may hold at most half of the device memory; the section reports the
peak share they held. Hit rates are deterministic; only the seconds depend on the machine's load.

    python scripts/bench_kv_sim_states.py [--traces '../shared/traces/agentx-dev/*.json.gz'] [--lanes 32]
        [--hbm-tokens 4M]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kv_sim import machine_line, run_kv_sim  # noqa: E402
from benchmarks_md import write_section  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Recurrent-state retention (kv-sim)"
VARIANTS = [  # (label, extra flags)
    ("attention pages only (no states)", []),
    ("default: cost-aware interval + end of prompt", ["--state-model", "kimi-k3"]),
    ("a state every 64 tokens + end of prompt", ["--state-model", "kimi-k3", "--state-interval", "64"]),
    ("end of prompt only", ["--state-model", "kimi-k3", "--state-retention", "end"]),
    ("Marconi: end of prompt + recurring prefixes", ["--state-model", "kimi-k3", "--state-retention", "marconi"]),
]


def run(args: argparse.Namespace, extra: list[str], out: Path) -> tuple[str, dict]:
    return run_kv_sim(["--traces", args.traces, "--lanes", str(args.lanes), "--stagger", "10", "--hbm-tokens",
                       args.hbm_tokens, "--policies", "lru", *extra], out, "bench_kv_sim_states")


def section(rows: list[tuple[str, str, dict]], machine: str) -> str:
    lines = [SECTION, "",
             "Written by `scripts/bench_kv_sim_states.py`. `agentjax bench kv-sim` as in the section above, with "
             "Kimi-K3's recurrent states (agentjax/bench/kv_sim_states.py): a hit lands on the longest prefix whose "
             "state the device holds, each state costs 16,805 tokens of MLA latent (464.6 MB), states are evicted "
             "least recently used first and hold at most half of the device memory, the attention pages the rest.",
             "", machine, "",
             "| states | interval (tokens) | LRU hit rate | Belady | states saved | peak share of memory | seconds |",
             "|---|---|---|---|---|---|---|"]
    for label, _, summary in rows:
        results = summary["results"]
        states = results["lru"].get("states")
        interval = "-" if not states or states["interval_tokens"] is None else f"{states['interval_tokens']:,}"
        saved = f"{states['states_saved']:,}" if states else "-"
        share = f"{100 * states['peak_state_share']:.1f}%" if states else "-"
        lines.append(f"| {label} | {interval} | {100 * results['lru']['token_hit_rate']:.2f}% | "
                     f"{100 * results['belady']['token_hit_rate']:.2f}% | {saved} | {share} | {summary['seconds']:.0f} |")
    config = rows[0][2]["config"]
    lines += ["", f"C = {config['lanes']} lanes, {config['hbm_tokens']:,} device tokens. Commands:", ""]
    lines += [f"    {command}" for _, command, _ in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default="../shared/traces/agentx-dev/*.json.gz")
    parser.add_argument("--lanes", type=int, default=32)
    parser.add_argument("--hbm-tokens", default="4M")
    parser.add_argument("--out", type=Path, default=REPO / "BENCHMARKS.md")
    args = parser.parse_args()
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for index, (label, extra) in enumerate(VARIANTS):
            command, summary = run(args, extra, Path(tmp) / f"r{index}.json")
            rows.append((label, command, summary))
    write_section(section(rows, machine_line(load_before, os.getloadavg())), args.out)
    print(f"[bench_kv_sim_states] wrote the {SECTION!r} section of {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
