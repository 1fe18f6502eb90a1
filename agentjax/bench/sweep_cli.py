"""`agentjax sweep ...`: deployment planning on the simulator (every figure is a projection).

    agentjax sweep simulate --model minimax-m3 --gpu B300 --layout tp2 --lanes 24 [--spec-decode] [--offload]
    agentjax sweep saturation --model minimax-m3 --gpu B300 --gpus 2 --levels 8,16,24,32 --out-dir plan/
    agentjax sweep pd --saturation plan/saturation.json --gpus-total 2 --out-dir plan/

`--spec-decode` (the model's stated drafter and acceptance, agentjax/bench/speculation.py) and
`--offload` / `--host-cache-gb` / `--disk-cache-gb` (the engine's offload connector over virtual-time
tiers, agentjax/bench/sim_offload.py) are off by default, so figures stay comparable with earlier runs.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from agentjax.bench.agentx import DEFAULT_TRACES
from agentjax.model_specs import FULL_SIZE_NAMES, PRESET_NAMES


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def _add_target_flags(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("Target", "the model and the device the projection is for")
    add = target.add_argument
    add("--model", default="preset:tiny-dense",
        help=f"{', '.join(FULL_SIZE_NAMES)} (full-size shapes) or preset:NAME ({', '.join(PRESET_NAMES)})")
    add("--gpu", default="B300", help="H200, B200, B300, GB300 or CPU")
    add("--efficiency", default=None, help="JSON file of efficiency factors, a device check's fit "
        "(default: the table's unfitted factors)")
    add("--gpu-price", type=float, default=None, help="dollars per GPU-hour (default: the table's)")
    traffic = parser.add_argument_group("Traffic", "the traces the simulated AgentX replay sends")
    add = traffic.add_argument
    add("--traces", default=DEFAULT_TRACES, help="directory of weka traces")
    add("--context-scale", type=float, default=1.0, help="shrink every length by this factor")
    add("--duration", type=float, default=120.0, help="simulated seconds of sending new turns")
    add("--think-scale", type=float, default=1.0,
        help="multiply recorded think times (AgentX replays them: 1.0, capped at 300 s)")
    add("--seed", type=int, default=0, help="seed of the lanes' start turns and the acceptance draws")
    add("--min-interactivity", type=float, default=50.0, help="P90 interactivity target, tok/s")
    engine = parser.add_argument_group("Engine", "the simulated engine's settings")
    add = engine.add_argument
    add("--block-size", type=int, default=None, help="tokens per KV page (default: the model's)")
    add("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
        help="the engine's KV storage: fp8 counts its attention kinds (K/V, MLA latents) as FP8 rows with a "
             "scale per token and head, in capacity and read traffic (DeepSeek-V4 refuses it, as the engine does)")
    add("--max-num-batched-tokens", type=int, default=8192, help="token budget of one step")
    add("--max-num-seqs", type=int, default=256, help="rows in one step")
    add("--long-prefill-token-threshold", type=int, default=0,
        help="cap on one request's prefill tokens per step (0: none)")
    add("--prefill-schedule-interval", type=int, default=1, help="admit new requests every Nth step")
    add("--router", choices=("sticky", "prefix", "queue"), default="sticky",
        help="the router policy (agentjax/router/policies.py) placing requests on DEP ranks and instances")
    add("--no-padding", action="store_true",
        help="charge real token counts, not agentjax's padded shape buckets (a runner with exact shapes)")
    options = parser.add_argument_group("Options", "more of the real engine (off by default, so figures stay "
                                        "comparable with earlier runs)")
    add = options.add_argument
    add("--spec-decode", action="store_true",
        help="speculative decoding with the model's stated drafter and acceptance rates")
    add("--num-speculative-tokens", type=int, default=None,
        help="drafts per decode row with --spec-decode (default: the model's stated count)")
    add("--spec-acceptance", default=None,
        help="comma-separated acceptance per draft position, e.g. 0.85,0.75,0.65, with --spec-decode "
             "(default: the model's stated rates)")
    add("--offload", action="store_true",
        help="KV offload tiers at 80%% of the GPU table's host memory and 90%% of its disk per GPU")
    add("--host-cache-gb", type=float, default=0.0, help="host KV tier per GPU, GB (0: off)")
    add("--disk-cache-gb", type=float, default=0.0, help="disk KV tier per GPU, GB (0: off)")
    add("--kv-offload-retention", choices=("interval", "marconi"), default="interval",
        help="which pages a finished turn stores in the tiers")


def _target_parts(args: argparse.Namespace):
    import dataclasses

    from agentjax.bench.agentx import AgentxConfig
    from agentjax.bench.gpus import get_device
    from agentjax.bench.model_shapes import get_shape
    from agentjax.config import EngineConfig

    shape = get_shape(args.model, kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))
    device = get_device(args.gpu, args.efficiency)
    if args.gpu_price is not None:
        device = dataclasses.replace(device, price_per_hour=args.gpu_price)
    engine = EngineConfig(block_size=args.block_size or shape.page_tokens,
                          max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                          long_prefill_token_threshold=args.long_prefill_token_threshold,
                          prefill_schedule_interval=args.prefill_schedule_interval,
                          kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))
    agentx = AgentxConfig(traces=args.traces, lanes=1, context_scale=args.context_scale, duration_s=args.duration,
                          think_scale=args.think_scale, seed=args.seed)
    return shape, device, engine, agentx


def options_from_args(args: argparse.Namespace, shape, device):
    """(speculation or None, offload plan or None) from the flags."""
    from agentjax.bench.sim_offload import OffloadPlan
    from agentjax.bench.speculation import default_speculation

    speculation = None
    if args.spec_decode:
        acceptance = [float(a) for a in args.spec_acceptance.split(",")] if args.spec_acceptance else None
        speculation = default_speculation(shape).with_settings(args.num_speculative_tokens, acceptance)
    offload = None
    if args.offload:
        offload = OffloadPlan.for_device(device, retention=args.kv_offload_retention)
    elif args.host_cache_gb or args.disk_cache_gb:
        offload = OffloadPlan(args.host_cache_gb, args.disk_cache_gb, args.kv_offload_retention)
    return speculation, offload


def kv_assumption(shape) -> str:
    """What a projection assumes of the KV cache: its dtype, and whose accounting its capacity is."""
    dtype = shape.kv_dtype or "the model's dtype"
    if shape.kv_terms:
        return (f"KV cache: {dtype}, as the engine stores it; capacity from the engine's KV memory layout "
                "(agentjax/kv/layout.py: pages of each page group with their slab padding)")
    return f"KV cache: {dtype} (capacity from the model shape's key streams; not the format the engine runs today)" \
        if shape.kv_dtype == "fp8" else f"KV cache: {dtype}; capacity from the model shape's key streams"


def assumptions(shape, device, engine, agentx, padded: bool = True, speculation=None, offload=None,
                router: str = "sticky") -> list[str]:
    return [
        f"model: {shape.source}",
        kv_assumption(shape),
        f"device {device.name}: peaks from public spec sheets (agentjax/bench/gpus.py); efficiency "
        f"{device.efficiency.source}: compute {device.efficiency.compute}, memory {device.efficiency.memory}, "
        f"network {device.efficiency.network}, {device.efficiency.step_overhead_s * 1e3:g} ms per step",
        f"traffic: AgentX replay of {agentx.traces} at context scale {agentx.context_scale}, think times x "
        f"{agentx.think_scale}, {agentx.duration_s:g} simulated s after each lane's cold first request",
        f"engine: {engine.block_size}-token pages, {engine.max_num_batched_tokens} tokens and {engine.max_num_seqs} "
        f"rows per step, long_prefill_token_threshold {engine.long_prefill_token_threshold}, "
        + ("batches padded to agentjax's shape buckets (padding tokens are computed, the experts see real tokens only)" if padded
           else "exact batch shapes (no padding)"),
        "90% of HBM usable, 4 GB activation reserve per GPU; "
        + (offload.describe(device) if offload is not None else "KV in HBM only (no offload tier: --offload)"),
        speculation.describe() if speculation is not None else "no speculative decoding (--spec-decode)",
        f"requests placed on DEP ranks and instances by the router's {router} policy (agentjax/router/policies.py); "
        "collectives do not overlap compute; pipeline layouts (ppN) fill and drain every step",
        "P/D: the prompt's whole KV crosses the scale-out network; percentiles of prefill and decode add up",
    ]


def cmd_simulate(args: argparse.Namespace) -> int:
    import dataclasses

    from agentjax.bench.cost_terms import Layout
    from agentjax.bench.metrics import format_table, write_summary
    from agentjax.bench.simulator import SimTarget, simulate_agentx

    shape, device, engine, agentx = _target_parts(args)
    speculation, offload = options_from_args(args, shape, device)
    target = SimTarget(shape, device, Layout.parse(args.layout), engine, role=args.role, router=args.router,
                       pad_batches=not args.no_padding, speculation=speculation, offload=offload,
                       instances=args.instances)
    summary = simulate_agentx(dataclasses.replace(agentx, lanes=args.lanes), target, progress=True)
    summary["assumptions"] = assumptions(shape, device, engine, agentx, not args.no_padding, speculation, offload,
                                         args.router)
    copies = f"{target.instances} x " if target.instances > 1 else ""
    print(f"{summary['model']} on {target.gpus} x {device.name} as {copies}{summary['layout']} "
          f"({summary['label']})")
    print(format_table(summary))
    for key in ("speculation", "offload", "routing"):
        if key in summary:
            print(f"{key}: {json.dumps(summary[key])}")
    for key in ("gpu_cost_per_million_tokens", "api_cost_per_million_tokens", "cost_advantage"):
        if key in summary:
            print(f"{key:<44}{summary[key]:>16.3f}")
    if args.out:
        write_summary(summary, args.out)
    return 0


def cmd_saturation(args: argparse.Namespace) -> int:
    from agentjax.bench.agentx import load_sessions
    from agentjax.bench.planner import SaturationPlan, plot_points, saturation
    from agentjax.bench.sweep import pareto_front

    shape, device, engine, agentx = _target_parts(args)
    speculation, offload = options_from_args(args, shape, device)
    plan = SaturationPlan(shape, device, _ints(args.gpus), _ints(args.levels), agentx, engine,
                          roles=tuple(args.roles.split(",")), layouts=args.layouts.split(",") if args.layouts else None,
                          min_interactivity=args.min_interactivity, router=args.router,
                          pad_batches=not args.no_padding, speculation=speculation, offload=offload,
                          assumptions=assumptions(shape, device, engine, agentx, not args.no_padding, speculation,
                                                  offload, args.router))
    document = saturation(plan, load_sessions(agentx))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    points = [{"kind": c["role"], "layout": c["layout"], "gpus": c["gpus"], **level}
              for c in document["configs"] if c["role"] in ("decode", "mixed") for level in c["levels"]
              if level["p90_interactivity"]]
    front = [points[i] for i in pareto_front([(p["p90_interactivity"], p["tpgs"]) for p in points])]
    document["pareto"] = front
    plot_points(points, front, out / "saturation.png", args.min_interactivity,
                f"Saturation: {shape.name} on {device.name}", lambda p: f"{p['layout']} C={p['lanes']}")
    (out / "saturation.json").write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    print(f"{'role':<8} {'layout':<12} {'GPUs':>4}  {'max req/s':>10}  {'at target':>10}  levels")
    for c in document["configs"]:
        note = c.get("skipped") or ", ".join(f"C={lv['lanes']}:{lv['rps']:.2f}" for lv in c["levels"])
        print(f"{c['role']:<8} {c['layout']:<12} {c['gpus']:>4}  {c.get('max_rps', 0):>10.3f}  "
              f"{c.get('max_rps_at_target', 0):>10.3f}  {note}")
    print(f"[agentjax] wrote {out / 'saturation.json'} and {out / 'saturation.png'} (projections)", file=sys.stderr)
    return 0


def cmd_pd(args: argparse.Namespace) -> int:
    from agentjax.bench.planner import merge_saturation, pd_sweep, plot_points

    document = merge_saturation([json.loads(Path(path).read_text(encoding="utf-8"))
                                 for path in args.saturation.split(",")])
    total = args.gpus_total or max(c["gpus"] for c in document["configs"])
    result = pd_sweep(document, total, args.min_interactivity)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def label(p: dict) -> str:
        return f"{p['prefill']} + {p['decode']} C={p['decode_lanes']}" if p["kind"] == "pd" else \
            f"{p['instances']} C={p['lanes']}"

    plot_points(result["points"], result["pareto"], out / "pd.png", result["min_interactivity"],
                f"P/D sweep: {result['model']} on {total} x {result['device']}", label)
    (out / "pd.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"{'TPGS':>10}  {'P90 inter.':>10}  {'req/s':>8}  deployment (Pareto frontier, projections)")
    for p in sorted(result["pareto"], key=lambda p: p["p90_interactivity"]):
        print(f"{p['tpgs']:>10.1f}  {p['p90_interactivity']:>10.2f}  {p['rps']:>8.3f}  {label(p)}")
    best = result["best"]
    if best is None:
        print(f"no deployment reaches P90 interactivity {result['min_interactivity']:g} tok/s")
    else:
        cost = f", ${best['gpu_cost_per_hour']:.2f}/h vs API ${best['api_cost_per_hour']:.0f}/h " \
               f"({best['cost_advantage']:.0f}x)" if "cost_advantage" in best else ""
        print(f"best at >= {result['min_interactivity']:g} tok/s: TPGS {best['tpgs']:.1f}, P90 "
              f"{best['p90_interactivity']:.1f} tok/s: {label(best)}{cost}")
    print(f"[agentjax] wrote {out / 'pd.json'} and {out / 'pd.png'} (projections)", file=sys.stderr)
    return 0


def add_sweep_parser(subparsers: argparse._SubParsersAction,
                     formatter: type[argparse.HelpFormatter] = argparse.HelpFormatter) -> argparse.ArgumentParser:
    """Adds `sweep` and its subcommands to the `agentjax` command's subparsers."""
    sweep = subparsers.add_parser("sweep", help="plan a deployment on the simulator (projections)",
                                  formatter_class=formatter)
    sub = sweep.add_subparsers(dest="sweep_command", required=True, metavar="STEP")

    def add(name: str, **kwargs) -> argparse.ArgumentParser:
        return sub.add_parser(name, description=kwargs["help"], formatter_class=formatter, **kwargs)

    simulate = add("simulate", help="one simulated AgentX replay on one instance")
    simulate.add_argument("--layout", default="tp1", help="tpN, depN, tpN-dcpN, pcpN-tpM, ppN-tpM (ppN-mbK-tpM)")
    simulate.add_argument("--lanes", type=int, default=4, help="concurrent sessions (AgentX concurrency)")
    simulate.add_argument("--instances", type=int, default=1,
                          help="copies of the instance behind the router (--router places each request)")
    simulate.add_argument("--role", choices=("mixed", "prefill", "decode"), default="mixed",
                          help="what the instance runs: whole requests, prompts only, or decodes only")
    simulate.add_argument("--out", default=None, help="write the summary JSON here (default: print only)")
    _add_target_flags(simulate)
    simulate.set_defaults(handler=cmd_simulate)

    sat = add("saturation", help="prefill-only, decode-only and colocated max req/s per layout and GPU count")
    sat.add_argument("--gpus", default="1,2", help="comma-separated GPU counts per instance")
    sat.add_argument("--layouts", default=None,
                     help="comma-separated layouts, ppN-tpM among them (default: candidates per GPU count)")
    sat.add_argument("--roles", default="prefill,decode,mixed", help="comma-separated roles to profile")
    sat.add_argument("--levels", default="1,2,4,8,16", help="comma-separated AgentX concurrency levels")
    sat.add_argument("--out-dir", default="plan", help="writes saturation.json and saturation.png here")
    _add_target_flags(sat)
    sat.set_defaults(handler=cmd_saturation)

    pd = add("pd", help="P/D ratios from the saturation results: Pareto frontier of TPGS vs P90 interactivity")
    pd.add_argument("--saturation", default="plan/saturation.json",
                    help="saturation.json, or several (comma-separated) runs of the same model and device")
    pd.add_argument("--gpus-total", type=int, default=None, help="GPU budget of the deployment (default: the largest instance)")
    pd.add_argument("--min-interactivity", type=float, default=None,
                    help="P90 interactivity target, tok/s (default: the saturation run's)")
    pd.add_argument("--out-dir", default="plan", help="writes pd.json and pd.png here")
    pd.set_defaults(handler=cmd_pd)
    return sweep
