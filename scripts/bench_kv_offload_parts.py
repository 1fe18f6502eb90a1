"""Parts of scripts/bench_kv_offload.py that drive the scheduler, the KV manager harness and the engine.

`bench_scheduler`: agent sessions (growing prompts, C in flight) through the real Scheduler and
KVCacheManager with no model, with the offload connector's scheduler side on (host tier, loads
completed at once as an idle worker would) and off, the two runs stepping in lockstep; the step time
is schedule + update + turn ends.
`bench_kv_manager`: the vLLM harness's closed-loop KV replay (see scripts/bench_kv_manager.py) with a
third engine, agentjax with the tiers on: each admission also looks its prompt up in the tiers, each
turn end prepares its stores. `bench_ttft`: SmolLM2, a 4K-token history, the next turn's TTFT.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HARNESS = REPO.parent / "shared" / "bench" / "vllm_baseline"


# -- scheduler step time ------------------------------------------------------------------------------
class _SchedulerRun:
    """One run of agent sessions through the real Scheduler and KVCacheManager, a step at a time, with the
    offload connector on or off; `step()` runs and times one step (schedule + update + turn ends)."""

    def __init__(self, offload: bool, sessions: int, concurrency: int, turns: int, seed: int = 0,
                 device_pages: int = 3000, reply_tokens: int = 24):
        import random

        from agentjax.config import EngineConfig
        from agentjax.kv import FullAttentionSpec, KVCacheManager
        from agentjax.kv.offload.connector import OffloadConnector
        from agentjax.kv.offload.host import HostPageIndex
        from agentjax.kv.offload.policies import GroupEntries, RecomputeCost, TierEntryScore
        from agentjax.kv.policy_order import engine_eviction_order
        from agentjax.scheduler.scheduler import Scheduler

        self.rng = random.Random(seed)
        # The engine's eviction order (its default KV policy, which hears the session turn ends) in both modes.
        self.kv = KVCacheManager.from_specs([FullAttentionSpec()], device_pages, 16, cache_on_allocate=False,
                                            eviction_order=engine_eviction_order("hints"))
        # As the engine builds it (agentjax.runner.offload_worker.build_offload): a scored host tier and the
        # recompute score of SmolLM2-135M (30 layers, 9 query heads of 64; 737,280-byte float32 pages of 16 tokens).
        score = TierEntryScore(RecomputeCost.for_model(134.5e6, 30, 9, 64), [GroupEntries(16, 737_280)])
        self.connector = (OffloadConnector(self.kv, host=HostPageIndex(1, 40_000, scored=True), entry_score=score)
                          if offload else None)
        self.scheduler = Scheduler(EngineConfig(max_num_batched_tokens=2048, max_num_seqs=64), self.kv,
                                   offload=self.connector)
        self.turns, self.reply_tokens = turns, reply_tokens
        self.prompts = {s: [self.rng.randrange(100, 40_000) for _ in range(2000)] for s in range(sessions)}
        self.turn_of = dict.fromkeys(range(sessions), 0)
        self.pending = list(range(sessions))
        self.arrivals = 0
        self.step_times: list[float] = []
        self.loads = 0
        for _ in range(concurrency):
            self._start(self.pending.pop(0))

    def _start(self, session: int) -> None:
        from agentjax.sampling_params import SamplingParams
        from agentjax.scheduler.request import Request

        self.arrivals += 1
        request = Request(f"s{session}-t{self.turn_of[session]}", self.prompts[session],
                          SamplingParams(max_tokens=self.reply_tokens), frozenset(), session_id=f"s{session}",
                          arrival_index=self.arrivals)
        self.scheduler.add(request)

    @property
    def done(self) -> bool:
        return not self.scheduler.has_unfinished()

    def step(self) -> None:
        from agentjax.scheduler.request import RequestState

        scheduler = self.scheduler
        started = time.perf_counter()
        plan = scheduler.schedule()
        if plan.kv_transfers is not None:
            for job in plan.kv_transfers.loads:  # an idle worker: the copy is done at once
                self.connector.results.put(("load", job.job_id, {}))
                self.loads += 1
        produced = scheduler.update_from_output(plan, [7] * len(plan.scheduled))
        ended = []
        for request, _ in produced:
            if len(request.output_token_ids) >= request.sampling.max_tokens:
                request.state = RequestState.FINISHED
                scheduler.finish(request)
                ended.append(request)
        self.step_times.append(time.perf_counter() - started)
        for request in ended:  # the next turn arrives (untimed: the client's side)
            session = int(request.session_id[1:])
            self.turn_of[session] += 1
            if self.turn_of[session] < self.turns:
                self.prompts[session] = request.all_token_ids + [self.rng.randrange(100, 40_000) for _ in range(300)]
                self._start(session)
            elif self.pending:
                self._start(self.pending.pop(0))

    def result(self) -> dict:
        stats = self.kv.stats()
        return {"steps": len(self.step_times), "mean_us": 1e6 * statistics.fmean(self.step_times),
                "median_us": 1e6 * statistics.median(self.step_times), "hit_rate": stats["hit_rate"],
                "hits": stats["hits"], "loads": self.loads,
                "pages_loaded": self.connector.stats.get("pages_loaded", "host") if self.connector else 0}


def _run_scheduler_pair(**run_args) -> dict[bool, dict]:
    """The same sessions with the connector off and on, stepped in lockstep (off, on, on, off, ...), so a
    drift in the machine's speed reaches both runs alike. Results by mode."""
    runs = {mode: _SchedulerRun(mode, **run_args) for mode in (False, True)}
    order = (False, True)
    while not all(run.done for run in runs.values()):
        for mode in order:
            if not runs[mode].done:
                runs[mode].step()
        order = order[::-1]
    return {mode: run.result() for mode, run in runs.items()}


def bench_scheduler(args) -> list[str]:
    lines = ["### Scheduler step time, offload connector off and on",
             "", "48 agent sessions of 5 turns (2,000-token first prompt, +300 tokens and a reply of 24 or 256 tokens "
             "per turn), 16 in flight, through the real Scheduler and KVCacheManager (pages of 16 tokens, the "
             "engine's default KV policy `hints`; as the engine builds the connector: a 40,000-page host tier "
             "evicting by SmolLM2-135M's recompute score, interval retention); loads complete at once (an idle "
             "worker), so the figure is the host-side cost: schedule + update_from_output + turn ends per step. "
             "With 20,000 device pages nothing is evicted, so on / off is the connector's overhead (a lookup at "
             "each admission, the store selection and host slots at each turn end); with 3,000 the tier serves "
             f"evicted prefixes (the connector's work: staging loads too). Medians over {args.repeats} pairs of runs; "
             "the two runs of a pair step in lockstep in one process (off, on, on, off, ...), so a drift in the "
             "machine's speed reaches both alike; the ratios are medians of the pairs' ratios.", "",
             "| device pages | reply tokens | offload | steps | mean step µs | median step µs | device+host hit rate "
             "| loads (pages) | on / off (mean, median) |", "|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for device_pages, reply in ((20_000, 24), (20_000, 256), (3_000, 24)):
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(args.repeats):
            for mode, result in _run_scheduler_pair(sessions=48, concurrency=16, turns=5, device_pages=device_pages,
                                                    reply_tokens=reply).items():
                runs[mode].append(result)
        means = {mode: statistics.median(r["mean_us"] for r in results) for mode, results in runs.items()}
        medians = {mode: statistics.median(r["median_us"] for r in results) for mode, results in runs.items()}
        pair_ratio = lambda stat: statistics.median(on[stat] / off[stat] for on, off in zip(runs[True], runs[False]))  # noqa: E731
        for mode, results in runs.items():
            r = results[0]
            ratio = f"{pair_ratio('mean_us'):.3f}, {pair_ratio('median_us'):.3f}" if mode else ""
            lines.append(f"| {device_pages:,} | {reply} | {'on' if mode else 'off'} | {r['steps']} | "
                         f"{means[mode]:.0f} | {medians[mode]:.0f} | {r['hit_rate']:.3f} | "
                         f"{r['loads']} ({r['pages_loaded']}) | {ratio} |")
        on, off = runs[True][0], runs[False][0]
        if on["pages_loaded"]:
            extra_ms = (means[True] * on["steps"] - means[False] * off["steps"]) / 1e3
            notes.append(f"With {device_pages:,} device pages and replies of {reply} tokens the tier gave back "
                         f"{on['pages_loaded']:,} pages in {on['loads']} loads, so the on run reuses "
                         f"{on['hits'] - off['hits']:,} prompt tokens that the off run recomputes (no model runs "
                         f"here: that recompute is not in the off figures); the on run's host side spends "
                         f"{extra_ms:.1f} ms more in all, {1e3 * extra_ms / on['pages_loaded']:.1f} µs per page it "
                         "brings back (the lookups into the tier, planning and staging each load, caching the "
                         "loaded pages, the longer prefix at admission); compare the recompute it saves in the "
                         "cached-turn TTFT table below.")
    return lines + [""] + notes + ([""] if notes else [])


# -- the KV manager harness -----------------------------------------------------------------------------
DRIVER = r'''
import json, sys, types
sys.argv = ["bench.py", *sys.argv[1:]]
import bench
from workload import add_workload_args, load_workload, workload_config_from_args
import argparse
from agentjax_adapter import AgentjaxKVManagerAdapter
import vllm_adapter
from agentjax.kv.offload.connector import OffloadConnector
from agentjax.kv.offload.host import HostPageIndex
from agentjax.kv.offload.policies import GroupEntries, RecomputeCost, TierEntryScore
ap = argparse.ArgumentParser(); add_workload_args(ap)
ap.add_argument("-C", type=int, nargs="+"); ap.add_argument("--num-blocks", type=int)
ap.add_argument("--repeats", type=int)
a = ap.parse_args()
wl = load_workload(workload_config_from_args(a))
max_len = wl.summary()["max_seq_len"]

class Tiered(AgentjaxKVManagerAdapter):
    """agentjax with the tiers on: a host tier of 8x the device; each admission also looks the prompt up
    in the tiers (counted in lookup), each turn end prepares its stores (counted in free). `scored`: as
    the engine builds it, evicting by SmolLM2-135M's recompute score; else an LRU host index."""
    def __init__(self, *args, scored, **kwargs):
        super().__init__(*args, **kwargs)
        self.name = "agentjax-tiers-on-scored" if scored else "agentjax-tiers-on-lru"
        score = TierEntryScore(RecomputeCost.for_model(134.5e6, 30, 9, 64), [GroupEntries(16, 737_280)])
        self.connector = OffloadConnector(self.m, host=HostPageIndex(1, 8 * a.num_blocks, scored=scored),
                                          entry_score=score if scored else None)
    def try_admit(self, handle):
        req_id, toks, _ = handle
        import time
        t0 = time.perf_counter_ns()
        self.tier_pages = self.connector.lookup(toks)
        spent = time.perf_counter_ns() - t0
        ok = super().try_admit(handle)
        self.t_lookup_ns[-1] += spent
        return ok
    def release(self, handle):
        import time
        t0 = time.perf_counter_ns()
        self.connector.on_turn_end(types.SimpleNamespace(request_id=handle[0], hints=None))
        self.connector.take_transfers()
        spent = time.perf_counter_ns() - t0
        super().release(handle)
        self.t_free_ns[-1] += spent

for C in a.C:
    for repeat in range(a.repeats):
        for make in (lambda: vllm_adapter.VllmKVManagerAdapter(a.num_blocks, 16, max_len),
                     lambda: AgentjaxKVManagerAdapter(a.num_blocks, 16, max_len),
                     lambda: Tiered(a.num_blocks, 16, max_len, scored=False),
                     lambda: Tiered(a.num_blocks, 16, max_len, scored=True)):
            wl.synth.clear_cache()
            ad = make()
            res = bench.run_kv_closed_loop(ad, wl, C, None)
            print(json.dumps({"C": C, "repeat": repeat, "engine": ad.name, "turn_us": res["turn_total_us_mean"],
                              "hit": res["prefix_hit_rate"]}), flush=True)
'''


def bench_kv_manager(args) -> list[str]:
    python = Path(os.environ.get("VLLM_VENV_PYTHON", ""))
    if not python.name or not python.exists():
        return ["### KV manager per-turn time with the tiers on", "",
                f"Not run: the vLLM harness venv is missing; build it with "
                "`bash ../shared/bench/vllm_baseline/setup.sh` and set VLLM_VENV_PYTHON to its Python.", ""]
    command = [str(python), "-c", DRIVER, "--num-traces", "20", "-C", "16", "64", "--num-blocks", "20000",
               "--repeats", str(args.repeats), "--tokens-per-block", "10"]
    done = subprocess.run(command, cwd=HARNESS, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True)
    if done.returncode:
        raise SystemExit(f"the harness failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    lines = ["### KV manager per-turn time with the tiers on", "",
             "The harness of `scripts/bench_kv_manager.py` (20 traces, 20,000 pages of 16 tokens, 10 tokens per "
             "trace block) with two more engines in the same process: agentjax with the tiers on, a host tier of "
             "8x the device whose lookups (the longest prefix over device and tiers, `OffloadConnector.lookup`) "
             "count in each admission and whose store preparation (retention, host slots) counts in each turn "
             "end; its host index evicts LRU, or (scored) by recompute score as the engine builds it "
             "(SmolLM2-135M's score; the store preparation then also computes the entries' scores and keeps "
             "their GreedyDual order). Medians of per-run means; ratio = median of per-run ratios to vLLM.", "",
             "| C | vLLM µs/turn | agentjax µs/turn | tiers on, LRU host µs/turn | / vLLM "
             "| tiers on, scored host µs/turn | / vLLM | hit vLLM / agentjax / LRU / scored |",
             "|---|---|---|---|---|---|---|---|"]
    for concurrency in sorted({r["C"] for r in rows}):
        by_engine: dict[str, list[dict]] = {}
        for r in rows:
            if r["C"] == concurrency:
                by_engine.setdefault(r["engine"], []).append(r)
        vllm = next(v for k, v in by_engine.items() if k.startswith("vllm"))
        plain = by_engine["agentjax-kvcachemanager"]
        cells = []
        for name in ("agentjax-tiers-on-lru", "agentjax-tiers-on-scored"):
            tiers = by_engine[name]
            ratios = [t["turn_us"] / v["turn_us"] for t, v in zip(tiers, vllm)]
            cells.append(f"{statistics.median(r['turn_us'] for r in tiers):.0f} | {statistics.median(ratios):.2f} "
                         f"({', '.join(f'{x:.2f}' for x in ratios)})")
        hits = " / ".join(f"{by_engine[name][0]['hit']:.4f}" for name in (
            next(k for k in by_engine if k.startswith("vllm")), "agentjax-kvcachemanager", "agentjax-tiers-on-lru",
            "agentjax-tiers-on-scored"))
        med = lambda rs: statistics.median(r["turn_us"] for r in rs)  # noqa: E731
        lines.append(f"| {concurrency} | {med(vllm):.0f} | {med(plain):.0f} | {cells[0]} | {cells[1]} | {hits} |")
    return lines + [""]


# -- cached-turn TTFT -----------------------------------------------------------------------------------
def _ttft(engine, prompt, sampling) -> float:
    started = time.perf_counter()
    request_id = engine.add_request(prompt, sampling)
    while True:
        for out in engine.step():
            if out.request_id == request_id:
                first = time.perf_counter() - started
                for _ in engine.run_until_done():
                    pass
                return first


def bench_ttft(args, model) -> list[str]:
    from agentjax.config import EngineConfig
    from agentjax.engine import Engine
    from agentjax.sampling_params import SamplingParams

    cfg, params, tok = model
    history_len = args.history_tokens
    text = " ".join(f"Step {i}: the agent read file_{i}.py and found a function." for i in range(2000))
    tokens = tok.encode(text)
    histories = [tokens[i * 7: i * 7 + history_len] for i in range(1 + args.repeats)]
    sampling = SamplingParams(max_tokens=1, temperature=0.0)
    results = {}
    for mode in ("host tier", "recompute", "device (reference)"):
        settings = {"host_cache_gb": 1.0} if mode == "host tier" else {}
        engine = Engine(cfg, params, EngineConfig(num_kv_blocks=2 * history_len // 16 + 64, **settings), tok)
        times = []
        for i, history in enumerate(histories):
            _ttft(engine, history, sampling)
            if engine.offload_worker is not None:
                engine.offload_worker.flush(engine.runner)
            if mode != "device (reference)":
                engine.kv.evict_free_pages()
            elapsed = _ttft(engine, history + tok.encode(" Next, the agent"), sampling)
            if i:  # the first round compiles
                times.append(elapsed)
        results[mode] = statistics.median(times)
        if engine.offload_worker is not None:
            loaded = engine.offload.stats.get("pages_loaded", "host")
            engine.offload_worker.close()
    lines = ["### Cached-turn TTFT, SmolLM2-135M, 4K-token history", "",
             f"A {history_len}-token history is computed, then every cached page is evicted from the device "
             "(not for the reference row), then the next turn (the history plus 4 tokens) is timed from "
             "`add_request` to its first token: with the host tier the prefix is loaded back, without it it is "
             f"recomputed. Default (fast) numerics, prefill budget 2,048 tokens per step; medians of "
             f"{args.repeats} histories after one compile round ({loaded} host pages loaded in all).", "",
             "| prefix from | TTFT ms | vs recompute |", "|---|---|---|"]
    for mode, seconds in results.items():
        lines.append(f"| {mode} | {1e3 * seconds:.0f} | {seconds / results['recompute']:.3f} |")
    return lines + [""]
