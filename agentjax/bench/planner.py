"""Deployment planning on the simulator: saturation profiling and the P/D sweep.

Saturation runs prefill-only and decode-only instances (turns back to back) and colocated ("mixed")
instances (with the replay's think times) of every layout and GPU count at rising AgentX
concurrency until requests per second stop growing. The P/D sweep combines
the best prefill and decode instances at every ratio that fills a GPU budget, next to the
colocated instances, and finds the Pareto frontier of TPGS against P90 interactivity. Every figure
is a projection of the simulator; nothing here runs a model.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from agentjax.bench.agentx import AgentxConfig
from agentjax.bench.cost import SECONDS_PER_HOUR, ApiPrices, api_cost
from agentjax.bench.cost_terms import PROJECTION, Layout
from agentjax.bench.gpus import DeviceSpec
from agentjax.bench.model_shapes import ModelShape
from agentjax.bench.sim_offload import OffloadPlan
from agentjax.bench.simulator import SimTarget, simulate_agentx
from agentjax.bench.speculation import Speculation
from agentjax.bench.sweep import pareto_front
from agentjax.bench.traces import Session
from agentjax.config import EngineConfig
from agentjax.errors import AgentjaxError, InvalidRequestError
from agentjax.progress import ProgressBar

logger = logging.getLogger(__name__)

GROWTH = 1.03  # a level must beat the best requests/s so far by 3% for the profile to go on
LEVEL_KEYS = ("tpgs", "p90_interactivity", "hit_rate", "requests", "errors", "ttft_p90_s", "itl_p50_s",
              "e2e_p50_s", "input_tokens", "cached_tokens", "output_tokens", "wall_time_s", "padding_fraction")


def candidate_layouts(shape: ModelShape, gpus: int, role: str) -> list[Layout]:
    """TP always; DEP for MoE models; DCP for models with an MLA latent cache; PCP for prefill."""
    layouts = [Layout(tp=gpus)]
    if gpus > 1 and shape.moe is not None:
        layouts.append(Layout(dp=gpus, ep=gpus))
    latent = any(s.expand_flops_per_entry for mixer, _ in shape.mixers for s in mixer.streams)
    if gpus > 1 and latent:
        layouts.append(Layout(tp=gpus, dcp=gpus))
    if gpus > 1 and role == "prefill" and gpus % 2 == 0:
        layouts.append(Layout(tp=gpus // 2, pcp=2))
    return layouts


@dataclass
class SaturationPlan:
    """What `saturation` profiles."""

    shape: ModelShape
    device: DeviceSpec
    gpu_counts: Sequence[int]
    levels: Sequence[int]
    agentx: AgentxConfig
    engine: EngineConfig
    roles: Sequence[str] = ("prefill", "decode", "mixed")
    layouts: Sequence[str] | None = None  # None: candidate_layouts
    min_interactivity: float = 50.0
    router: str = "sticky"
    pad_batches: bool = True
    variant: str = ""  # a label for these engine settings, appended to each layout's name
    assumptions: list[str] = field(default_factory=list)
    speculation: Speculation | None = None  # speculative decoding (off: None)
    offload: OffloadPlan | None = None  # KV offload tiers (off: None)


def _level_figures(summary: dict, lanes: int, duration_s: float) -> dict:
    """A level's figures; requests/s and TPGS over the span of its requests, never shorter than the
    run (a handful of requests in a short span would otherwise look fast)."""
    figures = {"lanes": lanes, **{key: summary.get(key) for key in LEVEL_KEYS}}
    wall = summary.get("wall_time_s") or 0.0
    span = max(wall, duration_s)
    figures["rps"] = summary["requests"] / span if summary["requests"] else 0.0
    if figures["tpgs"] and wall > 0:  # the summary's TPGS is over the requests' own span
        figures["tpgs"] *= wall / span
    return figures


def profile_config(plan: SaturationPlan, sessions: Sequence[Session], layout: Layout, role: str,
                   progress: ProgressBar | None = None) -> dict:
    """One (role, layout): AgentX levels until requests/s stop growing."""
    engine = plan.engine
    if role == "decode":  # the prompt's KV arrives whole (its transfer time is added by pd_sweep)
        engine = dataclasses.replace(engine, long_prefill_token_threshold=0,
                                     max_num_batched_tokens=max(engine.max_num_batched_tokens, plan.shape.max_context))
    target = SimTarget(plan.shape, plan.device, layout, engine, role=role, router=plan.router,
                       pad_batches=plan.pad_batches, speculation=plan.speculation,
                       offload=plan.offload if role != "decode" else None)  # decode: the prompt's KV arrives
    capacity = target.cost_model().capacity()
    entry = {"role": role, "layout": layout.name + (f" {plan.variant}" if plan.variant else ""), "gpus": layout.gpus,
             "levels": [],
             "kv_tokens_per_engine": capacity.kv_tokens_per_engine,
             "weight_gb_per_gpu": capacity.weight_bytes_per_gpu / 1e9}
    if not capacity.feasible:
        entry["skipped"] = "does not fit: no memory left for KV"
        if progress:
            progress.advance(len(plan.levels), f"{role} {layout.name}: does not fit")
        return entry
    best = 0.0
    for index, lanes in enumerate(plan.levels):
        # Prefill and decode instances are profiled saturated (turns back to back); colocated ones
        # with the replay's think times, as AgentX runs them.
        think = plan.agentx.think_scale if role == "mixed" else 0.0
        config = dataclasses.replace(plan.agentx, lanes=lanes, think_scale=think, salt=f"{role}-{layout.name}-c{lanes}:")
        try:
            summary = simulate_agentx(config, target, sessions)
        except AgentjaxError as error:  # e.g. the KV pool cannot hold what this many lanes send
            entry["stopped"] = f"{lanes} lanes: {error}"
            if progress:
                progress.advance(len(plan.levels) - index, f"{role} {layout.name}: stopped")
            break
        figures = _level_figures(summary, lanes, config.duration_s)
        entry["levels"].append(figures)
        if progress:
            progress.advance(1, f"{role} {layout.name} C={lanes}: {figures['rps']:.2f} req/s")
        if figures["errors"] or figures["rps"] < best * GROWTH:
            if progress:
                progress.advance(len(plan.levels) - index - 1)
            break
        best = max(best, figures["rps"])
    levels = entry["levels"]
    entry["max_rps"] = max((lv["rps"] for lv in levels), default=0.0)
    meeting = [lv["rps"] for lv in levels if (lv["p90_interactivity"] or 0.0) >= plan.min_interactivity]
    entry["max_rps_at_target"] = max(meeting, default=0.0)
    return entry


def saturation(plan: SaturationPlan, sessions: Sequence[Session], show_progress: bool = True) -> dict:
    """Profiles every role, GPU count and layout; returns the saturation document."""
    jobs = [(role, layout) for gpus in plan.gpu_counts for role in plan.roles
            for layout in ([Layout.parse(text) for text in plan.layouts if Layout.parse(text).gpus == gpus]
                           if plan.layouts else candidate_layouts(plan.shape, gpus, role))]
    progress = ProgressBar(len(jobs) * len(plan.levels), "saturation", enabled=show_progress)
    configs = [profile_config(plan, sessions, layout, role, progress) for role, layout in jobs]
    return {"label": PROJECTION, "model": plan.shape.name, "device": plan.device.name,
            "gpu_price_per_hour": plan.device.price_per_hour, "min_interactivity": plan.min_interactivity,
            "kv_bytes_per_token": plan.shape.kv_bytes_per_token, "scaleout_bw": plan.device.scaleout_bw,
            "network_efficiency": plan.device.efficiency.network,
            "agentx": {k: v for k, v in dataclasses.asdict(plan.agentx).items() if k != "progress"},
            "engine": {k: v for k, v in dataclasses.asdict(plan.engine).items() if k != "extra"},
            "assumptions": plan.assumptions, "configs": configs}


# ---------------------------------------------------------------- the P/D sweep

def _prefill_ttft(prefill: dict, rps_per_instance: float) -> float | None:
    """P90 TTFT of the level with the fewest lanes that carries this load (if none does, the level
    with the most req/s). A level past the instance's knee (more lanes, fewer req/s, say a KV pool
    that no longer holds the sessions) never stands for a lighter load."""
    levels = sorted(prefill["levels"], key=lambda lv: lv["lanes"])
    for level in levels:
        if level["rps"] >= rps_per_instance:
            return level["ttft_p90_s"]
    return max(levels, key=lambda lv: lv["rps"])["ttft_p90_s"] if levels else None


def _api_per_token(level: dict, prices: ApiPrices) -> float:
    tokens = level["input_tokens"] + level["output_tokens"]
    return api_cost(level["input_tokens"], level["cached_tokens"], level["output_tokens"], prices) / tokens


def _point(kind: str, total_gpus: int, rps: float, tokens_per_request: float, interactivity: float,
           price: float | None, api_per_token: float, **details) -> dict:
    tpgs = rps * tokens_per_request / total_gpus
    point = {"kind": kind, "gpus": total_gpus, "tpgs": tpgs, "p90_interactivity": interactivity, "rps": rps,
             **details}
    if price is not None and tpgs > 0:
        point["gpu_cost_per_hour"] = price * total_gpus
        point["api_cost_per_hour"] = api_per_token * tpgs * total_gpus * SECONDS_PER_HOUR
        point["gpu_cost_per_million_tokens"] = price / (tpgs * SECONDS_PER_HOUR / 1e6)
        point["cost_advantage"] = point["api_cost_per_hour"] / point["gpu_cost_per_hour"]
    return point


def merge_saturation(documents: Sequence[dict]) -> dict:
    """One document from several saturation runs of the same model and device (say, prefill and
    decode profiled at different concurrency levels)."""
    first = documents[0]
    for other in documents[1:]:
        if (other["model"], other["device"]) != (first["model"], first["device"]):
            raise InvalidRequestError(f"cannot merge saturation runs of {other['model']} on {other['device']} "
                                      f"with {first['model']} on {first['device']}")
    return {**first, "configs": [c for d in documents for c in d["configs"]]}


def pd_sweep(document: dict, total_gpus: int, min_interactivity: float | None = None,
             prices: ApiPrices = ApiPrices()) -> dict:
    """Every P/D split of `total_gpus` from the saturation document's best prefill instances and
    decode curves, plus colocated instances that divide the budget; the Pareto frontier and the
    best TPGS at P90 interactivity >= `min_interactivity`.

    A split of x prefill and y decode instances at decode level C serves
    min(x * prefill max req/s, y * decode req/s at C); its P90 interactivity adds to the decode
    level's P90 seconds per output token the prefill P90 TTFT at that load plus the transfer of the
    prompt's KV, spread over the mean output (a conservative sum of percentiles)."""
    target = document["min_interactivity"] if min_interactivity is None else min_interactivity
    price = document.get("gpu_price_per_hour")
    configs = [c for c in document["configs"] if c["levels"]]
    prefills = [c for c in configs if c["role"] == "prefill" and c["max_rps"] > 0]
    decodes = [c for c in configs if c["role"] == "decode"]
    points = []
    for prefill in prefills:
        for decode in decodes:
            for x in range(1, total_gpus // prefill["gpus"] + 1):
                left = total_gpus - x * prefill["gpus"]
                if left < decode["gpus"] or left % decode["gpus"]:
                    continue
                y = left // decode["gpus"]
                for level in decode["levels"]:
                    if not level["requests"] or not level["p90_interactivity"]:
                        continue
                    rps = min(x * prefill["max_rps"], y * level["rps"])
                    per_request_out = level["output_tokens"] / level["requests"]
                    per_request_in = level["input_tokens"] / level["requests"]
                    transfer = per_request_in * document["kv_bytes_per_token"] / (
                        document["scaleout_bw"] * document["network_efficiency"])
                    ttft = _prefill_ttft(prefill, rps / x) or 0.0
                    seconds_per_token = 1.0 / level["p90_interactivity"] + (ttft + transfer) / per_request_out
                    points.append(_point(
                        "pd", total_gpus, rps, per_request_in + per_request_out, 1.0 / seconds_per_token, price,
                        _api_per_token(level, prices), prefill=f"{x} x {prefill['layout']}",
                        decode=f"{y} x {decode['layout']}", decode_lanes=level["lanes"],
                        bottleneck="prefill" if x * prefill["max_rps"] < y * level["rps"] else "decode"))
    for mixed in (c for c in configs if c["role"] == "mixed" and total_gpus % c["gpus"] == 0):
        copies = total_gpus // mixed["gpus"]
        for level in mixed["levels"]:
            if level["requests"] and level["p90_interactivity"]:
                points.append(_point(
                    "colocated", total_gpus, copies * level["rps"],
                    (level["input_tokens"] + level["output_tokens"]) / level["requests"],
                    level["p90_interactivity"], price, _api_per_token(level, prices),
                    instances=f"{copies} x {mixed['layout']}", lanes=level["lanes"] * copies))
    front = pareto_front([(p["p90_interactivity"], p["tpgs"]) for p in points])
    meeting = [p for p in points if p["p90_interactivity"] >= target]
    best = max(meeting, key=lambda p: p["tpgs"], default=None)
    return {"label": PROJECTION, "model": document["model"], "device": document["device"], "gpus": total_gpus,
            "min_interactivity": target, "assumptions": document.get("assumptions", []), "points": points,
            "pareto": [points[i] for i in front], "best": best}


def plot_points(points: Sequence[dict], front: Sequence[dict], path, target: float | None, title: str,
                label: Callable[[dict], str]) -> None:
    """TPGS against P90 interactivity, by kind, with the Pareto frontier and the target line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5.5))
    colours = {"pd": "tab:green", "colocated": "tab:gray", "decode": "tab:purple", "mixed": "tab:gray"}
    for kind in sorted({p["kind"] for p in points}):
        chosen = [p for p in points if p["kind"] == kind]
        axes.scatter([p["p90_interactivity"] for p in chosen], [p["tpgs"] for p in chosen],
                     color=colours.get(kind, "tab:blue"), label=kind, s=18, zorder=2)
    ordered = sorted(front, key=lambda p: p["p90_interactivity"])
    axes.plot([p["p90_interactivity"] for p in ordered], [p["tpgs"] for p in ordered], "-o", color="tab:red",
              label="Pareto frontier", zorder=3)
    for point in ordered:
        axes.annotate(label(point), (point["p90_interactivity"], point["tpgs"]), textcoords="offset points",
                      xytext=(4, 4), fontsize=7)
    if target is not None:
        axes.axvline(target, linestyle="--", color="tab:blue", label=f"target {target:g} tok/s")
    axes.set_xlabel("P90 interactivity (tok/s per user, E2E-normalised)")
    axes.set_ylabel("TPGS (total tokens / GPU-s)")
    axes.set_title(f"{title} (projection)")
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
