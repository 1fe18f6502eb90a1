"""Rows, summary table and BENCHMARKS.md row of `scripts/fuzz_parity.py` (plain Python: no torch, no jax)."""
from __future__ import annotations

import datetime
import platform
import re
from collections import Counter

from benchmarks_md import BENCHMARKS, section_lines, write_section

# Verdicts that are not agentjax bugs under the issue's margin rule (see fuzz_parity.py's docstring).
PASSING = ("match", "near-tie", "hf-paths-part", "indexer-tie")
LOGIT_TOLERANCE = 1e-4
SECTION = "## Parity fuzzing against transformers 5.24.0 (issue 36)"
TABLE_HEADER = ("| family | seed | budget | minutes | configs tried | excluded | passed (match / near-tie / hf-paths-part / "
                "indexer-tie) | failing | prompt logits > 1e-4 | max prompt logit diff | load avg (start / max / end) "
                "| date (UTC) |")


def _kinds(row: dict) -> str:
    fields = row.get("fields", {})
    kinds = fields.get("layer_types") or []
    short = {"sliding_attention": "S", "compressed_sparse_attention": "C", "heavily_compressed_attention": "H",
             "full_attention": "F", "minimax_m3_sparse": "B", "linear_attention": "K"}
    if not kinds and "linear_attn_config" in fields:
        full = set(fields["linear_attn_config"]["full_attn_layers"])
        kinds = ["full_attention" if i + 1 in full else "linear_attention" for i in range(fields["num_hidden_layers"])]
    return "".join(short.get(k, "?") for k in kinds)


def prompt_logit_diff(row: dict) -> float:
    """The prompt logits' difference that counts: against transformers rerun with stable indexer ties
    where its indexer met a tie (its own prompt logits then depend on torch.topk's tie order)."""
    return row.get("stable_prompt_logits_max_diff", row.get("prompt_logits_max_diff", 0.0))


def line(row: dict) -> str:
    head = f"config {row['config']:4d} seed {row['seed']} [{_kinds(row)}] prompt {row['prompt_len']:4d}"
    if "excluded" in row:
        return f"{head}  excluded: {row['excluded']}"
    if row["verdict"] == "error":
        return f"{head}  ERROR {row['error'][:200]} ({row['seconds']} s)"
    first = row["first_difference"]
    where = "" if first is None else (f" first diff step {first} margin {row['margin_there']:.4f} "
                                       f"hf paths agree {row['hf_paths_agree_there']}")
    return (f"{head}  {row['verdict']:13s}{where} prompt logits {row['prompt_logits_max_diff']:.2e} "
            f"(stable {row.get('stable_prompt_logits_max_diff', float('nan')):.2e}) steps "
            f"{row['step_logits_max_diff']:.2e} ({row['seconds']} s)")


def summarize(args, rows: list[dict], excluded: Counter, minutes: float, loads: tuple) -> dict:
    verdicts = Counter(r["verdict"] for r in rows)
    over = [r for r in rows if r["verdict"] != "error" and prompt_logit_diff(r) > LOGIT_TOLERANCE]
    diffs = [prompt_logit_diff(r) for r in rows if r["verdict"] != "error"]
    return {
        "family": args.family, "seed": args.seed, "minutes": round(minutes, 1), "budget_minutes": args.minutes,
        "tried": len(rows) + sum(excluded.values()), "excluded": sum(excluded.values()),
        "verdicts": dict(verdicts), "passed": sum(verdicts[v] for v in PASSING),
        "failing": sum(n for v, n in verdicts.items() if v not in PASSING),
        "prompt_logits_over_tolerance": len(over), "max_prompt_logit_diff": max(diffs, default=0.0),
        "loads": loads, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {platform.system()}",
    }


def markdown(summary: dict, rows: list[dict], excluded: Counter) -> str:
    v = summary["verdicts"]
    out = [f"# fuzz_parity: {summary['family']}, seed {summary['seed']}, {summary['minutes']} minutes", "",
           f"tried {summary['tried']}, excluded {summary['excluded']}, passed {summary['passed']} "
           f"(match {v.get('match', 0)}, near-tie {v.get('near-tie', 0)}, hf-paths-part {v.get('hf-paths-part', 0)}, "
           f"indexer-tie {v.get('indexer-tie', 0)}), failing {summary['failing']}; prompt logits over "
           f"{LOGIT_TOLERANCE:g}: {summary['prompt_logits_over_tolerance']} (max {summary['max_prompt_logit_diff']:.2e}); "
           f"load average {summary['loads'][0]:.1f} / {summary['loads'][1]:.1f} / {summary['loads'][2]:.1f}", "",
           "| config | seed | layers | prompt | chunk | page | verdict | first diff | margin | hf paths agree | "
           "prompt logits diff | step logits diff | s |", "|---" * 13 + "|"]
    for r in rows:
        if r["verdict"] == "error":
            out.append(f"| {r['config']} | {r['seed']} | {_kinds(r)} | {r['prompt_len']} | {r['chunk']} | | error | "
                       f"| | | | | {r['seconds']} |")
            continue
        first = r["first_difference"]
        out.append(f"| {r['config']} | {r['seed']} | {_kinds(r)} | {r['prompt_len']} | {r['chunk']} | {r['block_size']} "
                   f"| {r['verdict']} | {'' if first is None else first} | "
                   f"{'' if first is None else format(r['margin_there'], '.4f')} | "
                   f"{'' if first is None else r['hf_paths_agree_there']} | {prompt_logit_diff(r):.2e} | "
                   f"{r['step_logits_max_diff']:.2e} | {r['seconds']} |")
    if excluded:
        out += ["", "Excluded configs, by reason:", ""]
        out += [f"- {n} x {reason}" for reason, n in excluded.most_common()]
    return "\n".join(out) + "\n"


def add_to_benchmarks(summary: dict) -> None:
    """Add (or replace) this family and seed's row in BENCHMARKS.md's fuzzing section."""
    v = summary["verdicts"]
    row = (f"| {summary['family']} | {summary['seed']} | {summary['budget_minutes']:g} | {summary['minutes']} | "
           f"{summary['tried']} | "
           f"{summary['excluded']} | {summary['passed']} ({v.get('match', 0)} / {v.get('near-tie', 0)} / "
           f"{v.get('hf-paths-part', 0)} / {v.get('indexer-tie', 0)}) | {summary['failing']} | "
           f"{summary['prompt_logits_over_tolerance']} | {summary['max_prompt_logit_diff']:.1e} | "
           f"{summary['loads'][0]:.1f} / {summary['loads'][1]:.1f} / {summary['loads'][2]:.1f} | {summary['date']} |")
    rows = [r for r in section_lines(SECTION, BENCHMARKS)
            if re.match(r"\| (deepseek-v4|kimi-linear|minimax-m3) \|", r)
            and not r.startswith(f"| {summary['family']} | {summary['seed']} |")]
    rows = sorted(rows + [row])
    body = [SECTION, "",
            "Random tiny configs per family (`scripts/fuzz_parity_configs.py`), each with a random prompt of 1-2,000 "
            "tokens and 24 greedy tokens, transformers (CPU torch, float32) against agentjax (`batch_invariant`, "
            "alone and in prefill chunks). One run at a time under `nice -n 10` on the 2-core development machine "
            f"({summary['machine']}):", "",
            "    nice -n 10 $HF_PY scripts/fuzz_parity.py --family FAMILY --seed SEED --minutes BUDGET "
            "--agentjax-python .venv/bin/python --benchmarks", "",
            "`$HF_PY` is the python that `../shared/bench/hf_reference/setup.sh` prints; BUDGET is the row's "
            "budget column (a run finishes the config in progress when it is spent, so minutes run over it). "
            "Verdicts as in "
            "fuzz_parity.py's docstring; \"failing\" counts DIVERGENCE, exactness and error. Prompt logits are "
            "compared with transformers' uncached forward (with stable indexer ties where its indexer met a tie).",
            "", TABLE_HEADER, "|---" * 12 + "|", *rows]
    write_section("\n".join(body) + "\n")
