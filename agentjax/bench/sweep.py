"""`agentjax bench sweep-concurrency`: the AgentX replay at several lane counts.

Writes `sweep.json` (one summary per level and the Pareto-optimal levels) and `sweep.png`, TPGS
against P90 interactivity with the Pareto frontier marked. In-process, one engine serves every
level (loaded and compiled once); each level salts its prompts so levels share no prefixes.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agentjax.bench.agentx import AgentxConfig, load_sessions, run_agentx_async
from agentjax.bench.backends import EngineBackend, HttpBackend
from agentjax.bench.metrics import write_summary
from agentjax.errors import InvalidRequestError

logger = logging.getLogger(__name__)

KEYS = ("tpgs", "p90_interactivity", "hit_rate", "requests", "errors", "ttft_p50_s", "itl_p50_s")


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (higher is better on both), by x."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any(ox >= x and oy >= y and (ox > x or oy > y) for ox, oy in points)
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def plot_sweep(levels: Sequence[dict], front: Sequence[int], path: Path,
               min_interactivity: float | None = None, title: str = "AgentX concurrency sweep") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [level["p90_interactivity"] or 0.0 for level in levels]
    ys = [level["tpgs"] for level in levels]
    figure, axes = plt.subplots(figsize=(7, 5))
    axes.scatter(xs, ys, color="tab:gray", label="concurrency level", zorder=2)
    for x, y, level in zip(xs, ys, levels):
        axes.annotate(f"C={level['lanes']}", (x, y), textcoords="offset points", xytext=(5, 5))
    axes.plot([xs[i] for i in front], [ys[i] for i in front], "-o", color="tab:red",
              label="Pareto frontier", zorder=3)
    if min_interactivity is not None:
        axes.axvline(min_interactivity, linestyle="--", color="tab:blue",
                     label=f"target {min_interactivity:g} tok/s")
    axes.set_xlabel("P90 interactivity (tok/s per user, E2E-normalised)")
    axes.set_ylabel("TPGS (total tokens / GPU-s)")
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


async def _sweep(levels: Sequence[int], make_config: Callable[[int], AgentxConfig],
                 url: str | None, model: str | None, backend_args: dict) -> list[dict]:
    sessions = load_sessions(make_config(levels[0]))
    engine = None if url else EngineBackend.from_model(model, **backend_args).engine
    results = []
    for lanes in levels:
        config = dataclasses.replace(make_config(lanes), lanes=lanes, salt=f"sweep-c{lanes}:")
        backend = HttpBackend(url, model, **backend_args) if url else EngineBackend(engine)
        logger.info("sweep: %d lanes for %.0f s", lanes, config.duration_s)
        summary = await run_agentx_async(config, backend, sessions)
        results.append({"lanes": lanes, **{key: summary.get(key) for key in KEYS}, "summary": summary})
    return results


def run_sweep(levels: Sequence[int], make_config: Callable[[int], AgentxConfig], out_dir: Path,
              *, min_interactivity: float | None = None, url: str | None = None,
              model: str | None = None, **backend_args: Any) -> dict:
    """Runs every level (lane count), writes `out_dir/sweep.json` and `out_dir/sweep.png`."""
    if not levels or any(level < 1 for level in levels):
        raise InvalidRequestError(f"concurrency levels must be >= 1, got {list(levels)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    results = asyncio.run(_sweep(sorted(set(levels)), make_config, url, model, backend_args))
    front = pareto_front([(r["p90_interactivity"] or 0.0, r["tpgs"]) for r in results])
    plot_path, json_path = out_dir / "sweep.png", out_dir / "sweep.json"
    plot_sweep(results, front, plot_path, min_interactivity,
               title=f"AgentX sweep: {url or model or 'embedded model'}")
    document = {"levels": results, "pareto_lanes": [results[i]["lanes"] for i in front],
                "target": url or model or "embedded", "plot": str(plot_path)}
    json_path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    for result in results:
        write_summary(result["summary"], out_dir / f"c{result['lanes']}.json")
    document["json"] = str(json_path)
    return document


def format_sweep(document: dict) -> str:
    pareto = set(document["pareto_lanes"])
    lines = [f"{'lanes':>5}  {'TPGS':>10}  {'P90 inter.':>10}  {'hit rate':>8}  {'requests':>8}  "
             f"{'errors':>6}  pareto"]
    for level in document["levels"]:
        inter = level["p90_interactivity"]
        hit = level["hit_rate"]
        lines.append(f"{level['lanes']:>5}  {level['tpgs']:>10.1f}  "
                     f"{'-' if inter is None else f'{inter:.2f}':>10}  "
                     f"{'-' if hit is None else f'{hit:.1%}':>8}  {level['requests']:>8}  "
                     f"{level['errors']:>6}  {'*' if level['lanes'] in pareto else ''}")
    return "\n".join(lines)
