"""Projected TPGS at P90 interactivity >= 50 tok/s for the mission's three models on its GPU counts.

    python scripts/project_mission.py [--models minimax-m3,kimi-k3,deepseek-v4-pro] [--duration 120]
        [--traces ../shared/traces/agentx-dev] [--out-dir plan/mission] [--no-padding]
        [--spec-decode [--num-speculative-tokens K] [--spec-acceptance A1,A2,...]] [--offload] [--router R]
        [--reuse-saturation]

For each model: saturation profiling (`agentjax sweep saturation`: prefill-only, decode-only and
colocated instances over the layouts that fit) and the P/D sweep over the mission's GPU budget
(`agentjax sweep pd`); writes each model's saturation.json/png and pd.json/png, and prints a table
of the chosen deployment next to the mission's reported figures. Every figure is a projection of
the simulator with unfitted GPU efficiency factors; the assumptions are printed and saved.
`--spec-decode` adds each model's stated drafter (MTP for DeepSeek-V4-Pro and MiniMax-M3, a draft
model for Kimi-K3; agentjax/bench/speculation.py) and `--offload` the host and disk KV tiers of the
GPU table (agentjax/bench/sim_offload.py); both are off by default, as in the earlier figures.
`--reuse-saturation` runs only the P/D sweep again, on the saturation.json an earlier run left.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentjax.bench.agentx import DEFAULT_TRACES, AgentxConfig, load_sessions  # noqa: E402
from agentjax.bench.cost_terms import Layout  # noqa: E402
from agentjax.bench.gpus import get_device  # noqa: E402
from agentjax.bench.model_shapes import get_shape  # noqa: E402
from agentjax.bench.planner import SaturationPlan, pd_sweep, plot_points, saturation  # noqa: E402
from agentjax.bench.sweep import pareto_front  # noqa: E402
from agentjax.bench.sweep_cli import assumptions, options_from_args  # noqa: E402
from agentjax.config import EngineConfig  # noqa: E402

# The mission's results table (../shared/MISSION.md) and the profiles run for each model:
# (role, layouts, concurrency levels, engine settings changed from the defaults).
MISSION = {
    "deepseek-v4-pro": {"gpu": "GB300", "gpus": 12, "concurrency": 256, "tpgs": 83_000, "p90": 58.3,
                        "profiles": [("prefill", ("dep4", "dep6"), (16, 64), {}),
                                     ("decode", ("dep6", "dep8"), (64, 128, 256), {}),
                                     ("mixed", ("dep12",), (128, 256), {}),
                                     ("mixed", ("dep12",), (128, 256), {"long_prefill_token_threshold": 512}),
                                     ("mixed", ("dep12",), (128, 256), {"prefill_schedule_interval": 4})]},
    "minimax-m3": {"gpu": "B300", "gpus": 2, "concurrency": 24, "tpgs": 70_000, "p90": 74.2,
                   "profiles": [("mixed", ("tp2", "dep2"), (8, 16, 24, 48), {}),
                                ("mixed", ("tp2",), (8, 16, 24, 48), {"long_prefill_token_threshold": 512})]},
    "kimi-k3": {"gpu": "GB300", "gpus": 16, "concurrency": 48, "tpgs": 11_800, "p90": 62.7,
                "profiles": [("prefill", ("tp8",), (8, 32), {}), ("decode", ("tp8-dcp8",), (16, 48, 96), {}),
                             ("mixed", ("tp8-dcp8", "tp16-dcp16"), (24, 48), {})]},
}


def project(name: str, args: argparse.Namespace, out: Path) -> dict:
    mission = MISSION[name]
    saved = out / "saturation.json"
    if args.reuse_saturation and saved.is_file():  # the P/D sweep again on the saved profiles
        document = json.loads(saved.read_text(encoding="utf-8"))
    else:
        document = profile(name, args, out)
    result = pd_sweep(document, mission["gpus"], args.min_interactivity)
    (out / "pd.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    if result["points"]:
        plot_points(result["points"], result["pareto"], out / "pd.png", args.min_interactivity,
                    f"P/D sweep: {name} on {mission['gpus']} x {document['device']}",
                    lambda p: f"{p.get('prefill', '')} {p.get('decode', p.get('instances', ''))}")
    return result


def profile(name: str, args: argparse.Namespace, out: Path) -> dict:
    """The model's saturation profiles, written to OUT/saturation.{json,png}."""
    mission = MISSION[name]
    shape, device = get_shape(name), get_device(mission["gpu"])
    engine = EngineConfig(block_size=shape.page_tokens, max_num_batched_tokens=8192, max_num_seqs=256)
    agentx = AgentxConfig(traces=args.traces, lanes=1, context_scale=1.0, duration_s=args.duration,
                          think_scale=args.think_scale, seed=0)
    sessions = load_sessions(agentx)
    speculation, offload = options_from_args(args, shape, device)
    notes = assumptions(shape, device, engine, agentx, not args.no_padding, speculation, offload, args.router)
    documents = []
    roles = args.profiles.split(",") if args.profiles else None
    for role, layouts, levels, changes in mission["profiles"]:
        if roles is not None and role not in roles:
            continue
        if args.levels:
            levels = tuple(int(level) for level in args.levels.split(","))
        variant = " ".join(f"{'t' if k.startswith('long') else 'interval '}{v}" for k, v in changes.items())
        plan = SaturationPlan(shape, device, sorted({Layout.parse(t).gpus for t in layouts}), levels, agentx,
                              dataclasses.replace(engine, **changes), roles=(role,), layouts=layouts,
                              min_interactivity=args.min_interactivity, variant=variant, router=args.router,
                              pad_batches=not args.no_padding, assumptions=notes, speculation=speculation,
                              offload=offload)
        documents.append(saturation(plan, sessions))
    if not documents:
        raise SystemExit(f"--profiles {args.profiles} leaves no profile of {name}")
    document = {**documents[0], "configs": [c for d in documents for c in d["configs"]]}
    out.mkdir(parents=True, exist_ok=True)
    points = [{"kind": c["role"], "layout": c["layout"], "gpus": c["gpus"], **level}
              for c in document["configs"] if c["role"] in ("decode", "mixed") for level in c["levels"]
              if level["p90_interactivity"]]
    document["pareto"] = [points[i] for i in pareto_front([(p["p90_interactivity"], p["tpgs"]) for p in points])]
    (out / "saturation.json").write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    if points:
        plot_points(points, document["pareto"], out / "saturation.png", args.min_interactivity,
                    f"Saturation: {name} on {device.name}", lambda p: f"{p['layout']} C={p['lanes']}")
    return document


def describe(point: dict | None) -> str:
    if point is None:
        return "none reaches the target"
    if point["kind"] == "pd":
        return f"P/D: {point['prefill']} prefill + {point['decode']} decode, {point['decode_lanes']} lanes per decode instance"
    return f"colocated: {point['instances']}, {point['lanes']} lanes"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="minimax-m3,kimi-k3,deepseek-v4-pro")
    parser.add_argument("--traces", default=DEFAULT_TRACES)
    parser.add_argument("--duration", type=float, default=120.0)
    parser.add_argument("--think-scale", type=float, default=1.0)
    parser.add_argument("--min-interactivity", type=float, default=50.0)
    parser.add_argument("--no-padding", action="store_true",
                        help="charge exact batch shapes instead of agentjax's padded buckets")
    parser.add_argument("--out-dir", default="plan/mission")
    parser.add_argument("--router", choices=("sticky", "prefix", "queue"), default="sticky",
                        help="the router policy placing requests on DEP ranks")
    parser.add_argument("--spec-decode", action="store_true", help="each model's stated drafter and acceptance")
    parser.add_argument("--num-speculative-tokens", type=int, default=None)
    parser.add_argument("--spec-acceptance", default=None, help="comma-separated acceptance per draft position")
    parser.add_argument("--offload", action="store_true",
                        help="KV offload tiers: 80%% of the GPU table's host memory and 90%% of its disk per GPU")
    parser.add_argument("--kv-offload-retention", choices=("interval", "marconi"), default="interval")
    parser.add_argument("--profiles", default=None,
                        help="keep only the profiles of these roles (comma-separated: prefill,decode,mixed)")
    parser.add_argument("--levels", default=None, help="replace every profile's concurrency levels (comma-separated)")
    parser.add_argument("--reuse-saturation", action="store_true",
                        help="run only the P/D sweep, on OUT_DIR/MODEL/saturation.json where a run left one")
    args = parser.parse_args(argv)
    args.host_cache_gb = args.disk_cache_gb = 0.0  # options_from_args reads them (the flags are --offload here)
    rows = []
    for name in args.models.split(","):
        started = time.perf_counter()
        result = project(name, args, Path(args.out_dir) / name)
        best, mission = result["best"], MISSION[name]
        fastest = max(result["points"], key=lambda p: p["p90_interactivity"], default=None)
        rows.append({"model": name, "gpus": f"{mission['gpus']} {mission['gpu']}", "mission_tpgs": mission["tpgs"],
                     "mission_p90": mission["p90"], "mission_concurrency": mission["concurrency"],
                     "projected_tpgs": best and best["tpgs"], "projected_p90": best and best["p90_interactivity"],
                     "deployment": describe(best), "cost": best and {k: best.get(k) for k in (
                         "gpu_cost_per_hour", "api_cost_per_hour", "cost_advantage", "gpu_cost_per_million_tokens")},
                     "highest_p90": fastest and {"tpgs": fastest["tpgs"], "p90": fastest["p90_interactivity"],
                                                 "deployment": describe(fastest)},
                     "seconds": time.perf_counter() - started})
        print(json.dumps(rows[-1]), flush=True)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.out_dir) / "projection.json").write_text(json.dumps(
        {"label": "projection", "rows": rows, "args": vars(args)}, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
