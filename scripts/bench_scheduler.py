"""Benchmark: agentjax's scheduler side by side with vLLM 0.33's v1 `Scheduler`, without a model.

Both schedulers replay the identical closed-loop stream of agent turns through
`../shared/bench/vllm_baseline/bench.py::run_sched_closed_loop` (that harness's `--engine agentjax`
covers kv mode only, so this script imports its functions and `workload.py` and runs both adapters in
one process): vLLM through `vllm_adapter.VllmSchedulerAdapter`, agentjax through
`scripts/sched_adapter.AgentjaxSchedulerAdapter`. Every repeat runs both engines, alternating which goes
first. The table gives medians over repeats of each run's median step time; `--write-md` replaces
the "## Scheduler" section of BENCHMARKS.md. A benchmark, not a test: CI does not run it.

    python scripts/bench_scheduler.py --num-traces 20 --tokens-per-block 10 -C 16 64 --repeats 3 --write-md

Two workloads (`--configs`): "dev", the workload flags as given (the dev traces mostly hit the cache),
and "pressure", other agent traces whose contexts overflow the pool, so the token hit rate falls to
about 0.4 and admissions wait for pages (`--pressure-*` flags: the trace glob, tokens per trace block,
pool size and concurrency; the other workload flags are shared).

It re-executes itself in the harness's vLLM venv (Python 3.11, built by the harness's setup.sh; its
Python in VLLM_VENV_PYTHON) with the repo on PYTHONPATH. `--engines agentjax` runs without vLLM;
`--profile` adds a cProfile of one agentjax run per C (top functions by own time).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HARNESS = Path(os.environ.get("VLLM_BASELINE_DIR", REPO.parent / "shared" / "bench" / "vllm_baseline"))
VENV_PY = Path(os.environ.get("VLLM_VENV_PYTHON", ""))
SECTION = "## Scheduler"
CHILD_ENV = "AGENTJAX_BENCH_SCHEDULER_CHILD"
CONFIGS = {"dev": "dev traces", "pressure": "cache pressure"}
IMPORTED = ["agentjax/scheduler", "agentjax/kv", "agentjax/config.py", "agentjax/sampling_params.py"]


def _reexec_in_venv() -> None:
    """Run this script again in the vLLM venv, with the repo and the harness importable."""
    if os.environ.get(CHILD_ENV) or Path(sys.prefix).resolve() == VENV_PY.parent.parent.resolve():
        return
    if not VENV_PY.name or not VENV_PY.exists():
        sys.exit(f"vLLM venv missing: run `bash {HARNESS}/setup.sh` and set VLLM_VENV_PYTHON to its Python (or pass --engines agentjax "
                 f"with {CHILD_ENV}=1 to use this interpreter)")
    env = dict(os.environ, **{CHILD_ENV: "1"})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    sys.exit(subprocess.call([str(VENV_PY), str(Path(__file__).resolve()), *sys.argv[1:]], env=env))


def _paths() -> None:
    for p in (str(HARNESS), str(REPO), str(REPO / "scripts")):
        if p not in sys.path:
            sys.path.insert(0, p)


def parse_args(argv=None):
    _paths()
    from workload import add_workload_args

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", nargs="+", choices=["vllm", "agentjax"], default=["vllm", "agentjax"])
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--pressure-traces", default=None,
                    help="trace glob of the pressure workload (default: trace_01* of the dev traces' folder)")
    ap.add_argument("--pressure-tokens-per-block", type=int, default=15)
    ap.add_argument("--pressure-num-blocks", type=int, default=20000)
    ap.add_argument("--pressure-concurrency", type=int, nargs="+", default=[16])
    ap.add_argument("--concurrency", "-C", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-blocks", type=int, default=20000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--long-prefill-token-threshold", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=None, help="default: longest prompt+output")
    ap.add_argument("--watermark", type=float, default=None,
                    help="agentjax scheduler watermark (default: the engine's, 0.01 of the pages)")
    ap.add_argument("--time-limit", type=float, default=None, help="per run, seconds")
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--stop-when-drained", action="store_true")
    ap.add_argument("--profile", action="store_true", help="cProfile one extra agentjax run per C")
    ap.add_argument("--out", default=None, help="append one JSON line per run")
    ap.add_argument("--write-md", action="store_true", help="replace the '## Scheduler' section of BENCHMARKS.md")
    ap.add_argument("--notes", default=None, help="markdown file appended to the section (profile findings)")
    ap.add_argument("--from-jsonl", default=None,
                    help="summarize (and --write-md) the runs saved by an earlier --out instead of running")
    add_workload_args(ap)
    return ap.parse_args(argv)


def configurations(a) -> list[tuple[str, argparse.Namespace]]:
    """(name, flags) per selected workload: "pressure" takes its trace glob, scale, pool and concurrency
    from the --pressure-* flags, everything else from the shared flags."""
    out = []
    for name in a.configs:
        c = argparse.Namespace(**vars(a))
        if name == "pressure":
            from workload import WorkloadConfig

            c.traces = a.pressure_traces or str(Path(WorkloadConfig.traces).parent / "trace_01*.json*")
            c.tokens_per_block, c.num_blocks = a.pressure_tokens_per_block, a.pressure_num_blocks
            c.concurrency, c.max_context = a.pressure_concurrency, None
        out.append((name, c))
    return out


def make_adapter(engine: str, a, max_model_len: int):
    if engine == "vllm":
        import vllm_adapter as va

        return va.VllmSchedulerAdapter(va.SchedulerAdapterConfig(
            num_blocks=a.num_blocks, block_size=a.block_size, max_model_len=max_model_len,
            max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
            long_prefill_token_threshold=a.long_prefill_token_threshold))
    from sched_adapter import AgentjaxSchedulerAdapter

    return AgentjaxSchedulerAdapter(a.num_blocks, a.block_size, a.max_num_batched_tokens,
                                    a.long_prefill_token_threshold, a.max_num_seqs, max_model_len,
                                    watermark=a.watermark)


def run_one(engine: str, C: int, a, wl, max_model_len: int) -> dict:
    from bench import run_sched_closed_loop

    wl.synth.clear_cache()  # same starting state for every run
    ad = make_adapter(engine, a, max_model_len)
    try:
        res = run_sched_closed_loop(ad, wl, C, a.time_limit, a.max_steps, 0, a.stop_when_drained)
    except Exception as e:  # a scheduler bug must not take the other engine's runs down with it
        import traceback

        traceback.print_exc()
        return {"engine_key": engine, "engine": getattr(ad, "name", engine), "concurrency": C,
                "error": f"{type(e).__name__}: {e}"}
    res["engine_key"] = engine
    return res


def profile_agentjax(C: int, a, wl, max_model_len: int, top: int = 25) -> str:
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    res = run_one("agentjax", C, a, wl, max_model_len)
    prof.disable()
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf).sort_stats("tottime")
    st.print_stats(top)
    buf.write("\n--- by cumulative time ---\n")
    st.sort_stats("cumulative").print_stats(top)
    return f"[profile agentjax C={C}] wall={res['wall_s']}s steps={res['steps']} (cProfile inflates times)\n" + buf.getvalue()


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _fmt(x, nd=1):
    return "n/a" if x is None else f"{x:.{nd}f}"


def summarize(results: list[dict], engines: list[str], keys: list[tuple[str, int]]) -> list[dict]:
    """One row per (workload, C) of `keys`; results without a "config" are of the dev workload."""
    rows = []
    for config, C in keys:
        row = {"C": C, "config": config}
        mine = [r for r in results if r.get("config", "dev") == config and r["concurrency"] == C]
        for e in engines:
            rs = [r for r in mine if r["engine_key"] == e and "error" not in r]
            errs = [r["error"] for r in mine if r["engine_key"] == e and "error" in r]
            if errs:
                row.setdefault("errors", {})[e] = errs
            if not rs:
                continue
            g = lambda k, sub="median": [r[k].get(sub) for r in rs]  # noqa: E731
            row[e] = {
                "runs": len(rs),
                "step_med": _med(g("step_us")), "step_med_runs": g("step_us"),
                "step_p99": _med(g("step_us", "p99")),
                "sat_med": _med(g("step_us_saturated")), "sat_med_runs": g("step_us_saturated"),
                "sat_frac": rs[0]["saturated_step_fraction"],
                "sched_med": _med(g("schedule_us")), "upd_med": _med(g("update_from_output_us")),
                "total_s": _med([r["sched_plus_update_total_s"] for r in rs]),
                "steps": rs[0]["steps"], "turns": f"{rs[0]['completed_turns']}/{rs[0]['total_turns']}",
                "hit": rs[0]["prefix_hit_rate"], "hits_all": [round(r["prefix_hit_rate"], 4) for r in rs],
                "preemptions": [r["preemptions"] for r in rs], "max_running": rs[0]["max_running"],
                "stop": rs[0]["stop_reason"], "kv_hit": rs[0].get("kv_hit_rate"),
                "resumes": rs[0].get("preempted_resumes"),
            }
        if "vllm" in row and "agentjax" in row:
            rv, ra = [[r for r in mine if r["engine_key"] == e and "error" not in r] for e in ("vllm", "agentjax")]
            # per-repeat ratios (the two runs of one repeat ran back to back)
            vb = {r["repeat"]: r for r in rv}
            row["ratios"] = [round(x["step_us"]["median"] / vb[x["repeat"]]["step_us"]["median"], 2)
                             for x in ra if x["repeat"] in vb]
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    out = ["| workload | C | engine | step µs median (runs) | step µs p99 | saturated-step µs median (share of steps) "
           "| schedule / update µs median | schedule+update total s | steps | turns | hit rate | preemptions "
           "| max running |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for e in ("vllm", "agentjax"):
            d = row.get(e)
            if d is None:
                continue
            runs = ", ".join(_fmt(x) for x in d["step_med_runs"])
            sat = "n/a (never C in flight)" if d["sat_med"] is None else \
                f"{_fmt(d['sat_med'])} ({100 * d['sat_frac']:.0f}%)"
            out.append(f"| {CONFIGS[row['config']]} | {row['C']} | {e} | {_fmt(d['step_med'])} ({runs}) | {_fmt(d['step_p99'])} | {sat} | "
                       f"{_fmt(d['sched_med'])} / {_fmt(d['upd_med'])} | {_fmt(d['total_s'], 2)} | {d['steps']} | "
                       f"{d['turns']} | {d['hit']:.4f} | {'/'.join(map(str, d['preemptions']))} | "
                       f"{d['max_running']} |")
    for row in rows:
        for e, errs in row.get("errors", {}).items():
            out.append(f"\n{e} on {CONFIGS[row['config']]} at C={row['C']} failed in {len(errs)} run(s): `{errs[0]}`")
    return "\n".join(out)


def ratio_lines(rows: list[dict]) -> list[str]:
    lines = []
    for row in rows:
        if "ratios" not in row:
            continue
        v, x = row["vllm"], row["agentjax"]
        r = x["step_med"] / v["step_med"]
        sat = ""
        if v["sat_med"] and x["sat_med"]:
            sat = f"; saturated steps {x['sat_med']:.1f} / {v['sat_med']:.1f} µs = {x['sat_med'] / v['sat_med']:.2f}"
        lines.append(f"- {CONFIGS[row['config']]}, C={row['C']}: agentjax / vLLM median step = {x['step_med']:.1f} / {v['step_med']:.1f} µs "
                     f"= **{r:.2f}** (per repeat: {', '.join(map(str, row['ratios']))}; goal <= 0.30){sat}; "
                     f"hit rate {x['hit']:.4f} vs {v['hit']:.4f} ({100 * (x['hit'] - v['hit']):+.2f} pt).")
    return lines


def main(argv=None) -> int:
    _reexec_in_venv()
    a = parse_args(argv)
    from workload import load_workload, workload_config_from_args

    configs, loaded = configurations(a), {}
    for name, c in configs:
        t0 = time.perf_counter()
        wl = load_workload(workload_config_from_args(c))
        loaded[name] = (wl, wl.summary(), c.max_model_len or wl.summary()["max_seq_len"])
        print(f"workload {name}: {json.dumps(loaded[name][1])} ({time.perf_counter() - t0:.1f}s)", file=sys.stderr)
    vver = None
    if "vllm" in a.engines and not a.from_jsonl:
        import vllm_adapter as va

        vver = va.vllm_version()
    results = []
    rev = _git_rev()
    keys = [(name, C) for name, c in configs for C in c.concurrency]
    if a.from_jsonl:
        with open(a.from_jsonl) as f:
            results = [json.loads(line) for line in f if line.strip()]
        a.engines = [e for e in a.engines if any(r["engine_key"] == e for r in results)]
        keys = sorted({(r.get("config", "dev"), r["concurrency"]) for r in results}, key=lambda k: (k[0] != "dev", k))
        a.repeats = 0
        vver = next((r.get("vllm") for r in results if r.get("vllm")), vver)
    for rep in range(a.repeats):
        for name, c in configs:
            wl, summ, max_model_len = loaded[name]
            for C in c.concurrency:
                order = a.engines if rep % 2 == 0 else list(reversed(a.engines))
                for e in order:
                    res = run_one(e, C, c, wl, max_model_len)
                    res.update(repeat=rep, config=name, agentjax_rev=rev, max_num_batched_tokens=a.max_num_batched_tokens,
                               long_prefill_token_threshold=a.long_prefill_token_threshold,
                               num_blocks=c.num_blocks, block_size=a.block_size, max_model_len=max_model_len,
                               python=platform.python_version(), vllm=vver, workload=summ)
                    results.append(res)
                    tag = f"[rep {rep} {name:<8} C={C:>3} {e:<8}]"
                    if "error" in res:
                        print(f"{tag} FAILED: {res['error']}", file=sys.stderr, flush=True)
                        continue
                    su, ss = res["step_us"], res["step_us_saturated"]
                    print(f"{tag} wall={res['wall_s']}s steps={res['steps']} "
                          f"turns={res['completed_turns']}/{res['total_turns']} step_us med/p99="
                          f"{su.get('median')}/{su.get('p99')} sat={ss.get('median')} "
                          f"sched/upd={res['schedule_us'].get('median')}/{res['update_from_output_us'].get('median')} "
                          f"hit={res['prefix_hit_rate']:.4f} pre={res['preemptions']}", file=sys.stderr, flush=True)
                    if a.out:
                        with open(a.out, "a") as f:
                            f.write(json.dumps(res) + "\n")
    rows = summarize(results, a.engines, keys)
    tab = table(rows)
    print(tab)
    for line in ratio_lines(rows):
        print(line)
    if a.profile:
        for name, c in configs:
            for C in c.concurrency:
                print(f"[{name}] " + profile_agentjax(C, c, *loaded[name][::2]), file=sys.stderr)
    if a.write_md:
        rev = next((r["agentjax_rev"] for r in results if r.get("agentjax_rev")), rev)
        from benchmarks_md import write_section

        write_section(section(a, argv, {name: (c, loaded[name][1]) for name, c in configs}, rows, tab, vver, rev),
                      REPO / "BENCHMARKS.md")
        print(f"wrote the {SECTION!r} section of {REPO / 'BENCHMARKS.md'}", file=sys.stderr)
    return 0


def _git_rev() -> str:
    try:
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", *IMPORTED],
                               capture_output=True, text=True).stdout.strip()
        return rev + (" with uncommitted changes to the scheduler or KV code" if dirty else "")
    except OSError:
        return "unknown"


def _workload_line(name: str, c, summ: dict) -> str:
    return (f"- {CONFIGS[name]}: `{Path(c.traces).name}` ({summ['files']} traces, {summ['sessions']} sessions, "
            f"{summ['turns']} turns), {summ['tokens_per_block']} tokens per trace block, mean prompt "
            f"{summ['mean_prompt']:.0f} tokens (max {summ['max_prompt']}); {c.num_blocks} pages of {c.block_size} "
            f"tokens; C = {', '.join(map(str, c.concurrency))}.")


def section(a, argv, workloads: dict, rows, tab, vver, rev) -> str:
    cmd = "python scripts/bench_scheduler.py " + " ".join(argv if argv is not None else sys.argv[1:])
    cmd = re.sub(r" --(write-md|from-jsonl \S+|notes \S+)", "", cmd).strip()
    return "\n".join([
        SECTION, "",
        f"Command: `{cmd}`. Both schedulers replay the identical closed-loop stream of "
        "`../shared/bench/vllm_baseline/bench.py::run_sched_closed_loop` in one process, one engine "
        "after the other, the order alternating per repeat: vLLM's v1 `Scheduler` (synchronous, fcfs, chunked "
        "prefill, prefix caching) through `vllm_adapter.VllmSchedulerAdapter`, agentjax's "
        "`Scheduler` on a single-group `KVCacheManager` (`cache_on_allocate=False`, as in the engine) through "
        "`scripts/sched_adapter.py::AgentjaxSchedulerAdapter`. No model: the fake output gives token 7 to every "
        "row that finished its prefill.",
        f"Machine: {platform.machine()} VM with {os.cpu_count()} CPU cores shared with other work, Python "
        f"{platform.python_version()}, vLLM {vver}, agentjax at {rev}; max_num_batched_tokens "
        f"{a.max_num_batched_tokens}, max_num_seqs {a.max_num_seqs}, long_prefill_token_threshold "
        f"{a.long_prefill_token_threshold}. Workloads (the pressure one's contexts overflow the pool: admissions "
        "wait for pages and the hit rate falls to about 0.4):",
        *[_workload_line(name, c, summ) for name, (c, summ) in workloads.items()],
        "",
        "Step time = `schedule()` + `update_from_output()`; for agentjax the update also holds the finish "
        "handling (length check and `Scheduler.remove`, which frees the pages), as vLLM's `update_from_output` "
        "frees finished requests itself. Building the fake output and the requests is outside it; note that vLLM "
        "hashes every prompt block (sha256) when the `Request` is made, outside the step, while agentjax hashes "
        "inside `schedule()` (admission) and `update_from_output()` (`cache_blocks`). Saturated steps: those with "
        "all C turns in flight. Each figure is the median over repeats of the run's median (runs listed).",
        "Hit rate, both engines with vLLM's `PrefixCacheStats` definition: summed over admissions that are not "
        "resumes after a preemption, cached tokens the request starts from / its tokens at admission. "
        "(agentjax's `kv.stats()` counts the same tokens over every successful allocation, resumes included.)",
        "",
        tab, "",
        *ratio_lines(rows), "",
        *([Path(a.notes).read_text().rstrip("\n"), ""] if a.notes else []),
    ])


if __name__ == "__main__":
    sys.exit(main())
