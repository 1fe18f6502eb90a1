"""Acceptance check of the planning simulator: predict an `agentjax bench agentx` CPU run, then run it.

    python scripts/validate_simulator.py [--traces DIR] [--lanes 4] [--context-scale 0.01] [--duration 60]
        [--long-prefill-token-threshold 0,512]

1. Loads the embedded SmolLM2-135M with `agentjax bench agentx`'s default engine settings.
2. Times the real runner's steps at a few shapes and fits the cost model's CPU factors to them.
   Just before each run it re-times three shapes and scales the factors by how much slower (or
   faster) the shared cores are now.
3. Simulates the replay (real Scheduler and KVCacheManager on a virtual clock, step times from the
   fitted cost model): the prediction, made before the run.
4. Runs the replay for real on the same engine (the shapes timed in step 2 stay compiled, and the
   simulator knows it).
Prints both, and last one JSON line {"predicted": {...}, "measured": {...}, ...} (for the first
threshold; with several, "thresholds" lists every one).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentjax.bench.agentx import DEFAULT_TRACES, AgentxConfig, load_sessions, run_agentx  # noqa: E402
from agentjax.bench.backends import EngineBackend  # noqa: E402
from agentjax.bench.calibrate import fit_cpu, time_steps  # noqa: E402
from agentjax.bench.costmodel import CostModel, scale_efficiency  # noqa: E402
from agentjax.bench.gpus import CPU  # noqa: E402
from agentjax.bench.model_shapes import shape_from_model_config  # noqa: E402
from agentjax.bench.simulator import SimTarget, simulate_agentx  # noqa: E402
from agentjax.engine import Engine  # noqa: E402

PROBE_SHAPES = (((1, 1500),) * 4, ((30, 2500), (1, 1200), (1, 2000), (1, 800)), ((256, 0),))
FIGURES = ("tpgs", "p90_interactivity", "hit_rate", "requests", "ttft_p50_s", "ttft_p90_s", "itl_p50_s",
           "itl_p90_s", "e2e_p50_s", "e2e_p90_s", "input_tokens", "output_tokens", "wall_time_s")


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def record_steps(runner) -> list[tuple[list[tuple[int, int]], float]]:
    """Wraps `runner.execute` to keep every real step's rows and seconds."""
    steps: list = []
    execute = runner.execute

    def timed(rows, *args, **kwargs):
        started = time.perf_counter()
        tokens = execute(rows, *args, **kwargs)
        steps.append(([(len(t), int(start)) for t, start, _ in rows], time.perf_counter() - started))
        return tokens

    runner.execute = timed
    return steps


def diagnose(steps, target) -> dict:
    """After the run (never part of the prediction): the fitted cost model against the run's own
    step times (its share of the prediction's error; the rest is scheduling dynamics)."""
    model = target.cost_model()
    ratios = [model.step_time([rows]) / seconds for rows, seconds in steps if seconds > 0]
    return {"steps": len(steps), "measured_busy_s": sum(s for _, s in steps),
            "fitted_busy_s": sum(model.step_time([rows]) for rows, _ in steps),
            "median_step_ratio_fitted_over_measured": statistics.median(ratios) if ratios else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", default=DEFAULT_TRACES)
    parser.add_argument("--lanes", type=int, default=4)
    parser.add_argument("--context-scale", type=float, default=0.01)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--long-prefill-token-threshold", default="0",
                        help="engine setting for the run and the simulation (0: no cap); a comma-separated "
                             "list runs each in turn on one calibration (a fresh engine on the same runner)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per calibration shape (after the first)")
    parser.add_argument("--skip-measure", action="store_true", help="predict only")
    parser.add_argument("--out", default=None, help="also write the whole result (fit table included) here")
    parser.add_argument("--efficiency-out", default=None,
                        help="write the fitted CPU efficiency factors here (for `agentjax sweep --efficiency`)")
    args = parser.parse_args(argv)

    from agentjax import LLM

    config = AgentxConfig(traces=args.traces, lanes=args.lanes, context_scale=args.context_scale,
                          duration_s=args.duration)
    thresholds = [int(t) for t in str(args.long_prefill_token_threshold).split(",")]
    sessions = load_sessions(config)
    result = {"machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                          "load_start": _load()}, "runs": []}
    llm = LLM(long_prefill_token_threshold=thresholds[0])
    print(f"[validate] loaded {llm.model_config.name}; calibrating (load average {_load()})", file=sys.stderr)
    started = time.perf_counter()
    runner = llm.engine.runner
    timings = time_steps(runner, repeats=args.repeats, progress=True)
    efficiency, table = fit_cpu(llm.model_config, CPU, timings, llm.engine.config.block_size)
    result["fit"] = {"efficiency": efficiency.to_dict(), "steps": table,
                     "seconds": time.perf_counter() - started, "load_after": _load()}
    if args.efficiency_out:
        Path(args.efficiency_out).write_text(json.dumps({"efficiency": efficiency.to_dict()}, indent=2) + "\n",
                                             encoding="utf-8")
    for row in table:
        print(f"[fit] {len(row['rows'])} rows {sum(n for n, _ in row['rows']):5d} tokens: measured "
              f"{row['measured_s']:.3f}s fitted {row['fitted_s']:.3f}s", file=sys.stderr)
    shape = shape_from_model_config(llm.model_config, llm.engine.config.block_size)
    engine = llm.engine
    for threshold in thresholds:
        engine_config = dataclasses.replace(llm.engine_config, long_prefill_token_threshold=threshold)
        if engine is None:  # a fresh engine (empty prefix cache) on the same runner: its shapes stay compiled
            engine = Engine(llm.model_config, llm.params, engine_config, llm.tokenizer, runner=runner)
        run = {"threshold": threshold}
        # The cores are shared: re-time a few shapes now and scale the fitted factors to the load
        # at the start of this run (still before it).
        probe = time_steps(runner, PROBE_SHAPES, repeats=2)
        fitted_model = CostModel(shape, CPU.with_efficiency(efficiency), kernel="reference")
        slowdown = statistics.median(t.steady_s / fitted_model.step_time([t.rows]) for t in probe)
        run["probe"] = {"slowdown": slowdown, "load": _load()}
        print(f"[validate] threshold {threshold}: probe steps run {slowdown:.2f}x the calibrated time "
              f"(load average {_load()})", file=sys.stderr)
        target = SimTarget(shape, CPU.with_efficiency(scale_efficiency(efficiency, slowdown)), kernel="reference",
                           model_config=llm.model_config,
                           engine=dataclasses.replace(engine_config, num_kv_blocks=engine.kv.num_pages),
                           precompiled=frozenset(runner.compiled_shapes))
        started = time.perf_counter()
        predicted = simulate_agentx(config, target, sessions)
        run["predicted"] = {key: predicted.get(key) for key in FIGURES}
        run["predicted"].update(simulated_s=predicted["simulated_s"], steps=predicted["steps"],
                                compiled_shapes=predicted["compiled_shapes"], sim_wall_s=time.perf_counter() - started)
        print(f"[validate] threshold {threshold}: predicted TPGS {predicted['tpgs']:.1f}, P90 interactivity "
              f"{predicted['p90_interactivity']}, {predicted['requests']} requests", file=sys.stderr)
        if not args.skip_measure:
            run["load_before_run"] = _load()
            steps = record_steps(runner)
            measured = run_agentx(config, backend=EngineBackend(engine), sessions=sessions)
            del runner.execute  # drop the recording wrapper
            run["load_after_run"] = _load()
            run["measured"] = {key: measured.get(key) for key in FIGURES}
            run["measured"].update(compiled_shapes=len(runner.compiled_shapes), steps=len(steps))
            run["error"] = {key: (run["predicted"][key] / run["measured"][key] - 1.0)
                            if run["measured"][key] else None for key in ("tpgs", "p90_interactivity")}
            run["diagnosis"] = diagnose(steps, target)
            print(f"[validate] threshold {threshold}: measured TPGS {measured['tpgs']:.1f}, P90 interactivity "
                  f"{measured['p90_interactivity']}, {measured['requests']} requests", file=sys.stderr)
        result["runs"].append(run)
        engine = None
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    keys = ("tpgs", "p90_interactivity", "hit_rate", "requests")
    lines = []
    for run in result["runs"]:
        line = {"predicted": {k: run["predicted"][k] for k in keys}}
        if "measured" in run:
            line["measured"] = {k: run["measured"][k] for k in keys}
            line["error"] = run["error"]
        line["threshold"] = run["threshold"]
        lines.append(line)
    last = dict(lines[0])
    if len(lines) > 1:
        last["thresholds"] = lines
    last["load"] = result["machine"]
    print(json.dumps(last))
    return 0


if __name__ == "__main__":
    sys.exit(main())
