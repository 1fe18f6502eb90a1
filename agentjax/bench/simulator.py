"""The planning simulator: the real Engine, Scheduler and KVCacheManager on a virtual clock, with
each step's time taken from the roofline cost model instead of a model run.

It replays agent traces through the same `AgentxRun` and `EngineBackend` as `agentjax bench agentx`
(same lanes, warm-up and think-time rules), on an asyncio loop whose clock jumps to the next timer
instead of sleeping, and reports the same figures plus the cost comparison. A DEP instance is one
engine per attention rank, stepped in lockstep (the slowest rank sets the step time); its requests are
placed on the ranks, and a deployment's on its `instances`, by the router's real policies
(sim_router.py). Options run more of the real engine: speculative decoding (the scheduler's drafts,
verified at the stated acceptance rates, the drafter charged by the cost model; speculation.py) and
the KV offload connector over virtual-time host and disk tiers (sim_offload.py). Every figure it
reports is a projection; it never loads weights or runs a model.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agentjax.bench.agentx import AgentxConfig, AgentxRun, load_sessions
from agentjax.bench.backends import EngineBackend
from agentjax.bench.cost import compare_costs
from agentjax.bench.cost_terms import PROJECTION, Layout
from agentjax.bench.costmodel import CostModel
from agentjax.bench.gpus import DeviceSpec
from agentjax.bench.model_shapes import ModelShape
from agentjax.bench.sim_clock import StepTimer, VirtualClock, VirtualRunner, VirtualTimeLoop
from agentjax.bench.sim_offload import OffloadPlan, build_virtual_offload
from agentjax.bench.sim_router import ROUTERS, FleetBackend, PolicyPlacement
from agentjax.bench.speculation import Speculation
from agentjax.bench.traces import Session
from agentjax.config import EngineConfig
from agentjax.engine import Engine
from agentjax.errors import InvalidRequestError, OutOfPagesError
from agentjax.engine_kv import engine_kv_layout
from agentjax.kv import KVCacheManager
from agentjax.kv.policy_order import engine_eviction_order

logger = logging.getLogger(__name__)

ROLES = ("mixed", "prefill", "decode")
# A pool this large already holds every session of a replay; a tiny model on a big GPU would
# otherwise ask for tens of millions of pages (seconds to build, slow to scan).
MAX_SIMULATED_PAGES = 1 << 20


@dataclass(frozen=True)
class ModelInfo:
    """What the Engine reads of a model when its KV manager and runner are given."""

    name: str
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = ()
    num_mtp_modules: int = 0  # the simulated drafter is "mtp"-scheduled (Speculation.engine_config)
    mtp_kv_cache: bool = False

    def replace(self, **changes) -> "ModelInfo":
        return dataclasses.replace(self, **changes)


class LockstepEngines:
    """A DEP instance: one real Engine per attention rank, the router's policy placing each request
    (`PolicyPlacement`), and one step that runs every rank's step and charges the slowest
    (`StepTimer.charge`)."""

    def __init__(self, engines: Sequence[Engine], timer: StepTimer, router: str = "sticky") -> None:
        self.engines, self.timer, self.router = list(engines), timer, router
        self.placement = PolicyPlacement(router, self.engines, label="rank")
        self.model_cfg = engines[0].model_cfg
        self.max_model_len = engines[0].max_model_len
        self._owner: dict[str, int] = {}
        self._count = 0

    def _next_id(self) -> int:
        self._count += 1
        return self._count

    def add_request(self, prompt, sampling, request_id=None, *, session_id=None, hints=None, **options) -> str:
        rank = self.placement.place(prompt, session_id or getattr(hints, "session_id", None), hints)
        try:
            request_id = self.engines[rank].add_request(prompt, sampling, request_id or f"r{rank}-{self._next_id()}",
                                                        session_id=session_id, hints=hints, **options)
        except Exception:
            self.placement.release(rank)
            raise
        self._owner[request_id] = rank
        return request_id

    def step(self):
        outputs = []
        for engine in self.engines:
            outputs += engine.step()
        if not self.timer.charge() and not outputs:
            self._wait_for_copies()
        for output in outputs:
            if output.finished:
                rank = self._owner.pop(output.request_id, None)
                if rank is not None:
                    self.placement.release(rank)
        return outputs

    def _wait_for_copies(self) -> None:
        """No rank ran anything: ranks whose requests wait for KV copies let the clock move to the
        next completion (each rank's worker leaves the clock to the group)."""
        waits = [e.offload_worker.next_event_in() for e in self.engines
                 if e.offload_worker is not None and e.offload.num_held]
        if waits:
            pending = [w for w in waits if w is not None]
            self.timer.spend(min([0.01, *pending]))

    def abort(self, request_id: str) -> None:
        rank = self._owner.pop(request_id, None)
        if rank is not None:
            self.engines[rank].abort(request_id)
            self.placement.release(rank)

    def has_unfinished(self) -> bool:
        return any(engine.has_unfinished() for engine in self.engines)


@dataclass
class SimTarget:
    """One simulated serving instance (or `instances` of them behind the router's `router` policy,
    which also places a DEP instance's requests on its ranks). `kv_tokens` overrides the KV capacity
    per engine that the cost model derives from memory; `model_config` (a runnable ModelConfig) gives
    the engine its real hybrid KV plan, else one full-attention group of the shape's page size is used.
    `speculation` turns on speculative decoding, `offload` the KV offload tiers."""

    shape: ModelShape
    device: DeviceSpec
    layout: Layout = field(default_factory=Layout)
    engine: EngineConfig = field(default_factory=EngineConfig)
    kernel: str | None = None  # None: "reference" on the CPU (agentjax's jnp kernels there), else "paged"
    role: str = "mixed"
    router: str = "sticky"
    kv_tokens: int | None = None
    model_config: Any = None
    vocab_size: int | None = None
    memory_utilization: float = 0.9
    precompiled: frozenset = frozenset()  # shape keys compiled before the run (no compile_s)
    pad_batches: bool = True  # charge the runner's padded token and row buckets, as agentjax runs
    speculation: Speculation | None = None
    offload: OffloadPlan | None = None
    instances: int = 1
    seed: int = 0  # the acceptance draws

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise InvalidRequestError(f"role={self.role!r}: expected one of {ROLES}")
        if self.router not in ROUTERS:
            raise InvalidRequestError(f"router={self.router!r}: expected one of {ROUTERS}")
        if self.instances < 1:
            raise InvalidRequestError(f"instances={self.instances} must be >= 1")
        if self.kernel is None:
            self.kernel = "reference" if self.device.name == "CPU" else "paged"
        if self.speculation is not None and self.model_config is not None:
            raise InvalidRequestError("speculation is simulated on model shapes only, not with model_config")
        if self.offload is not None and self.model_config is not None:
            raise InvalidRequestError("offload tiers are simulated on model shapes only, not with model_config")

    @property
    def gpus(self) -> int:
        return self.layout.gpus * self.instances

    def cost_model(self) -> CostModel:
        reserve = 4e9 if self.device.name != "CPU" else 0.0
        return CostModel(self.shape, self.device, self.layout, kernel=self.kernel, pad_batches=self.pad_batches,
                         memory_utilization=self.memory_utilization, activation_reserve_bytes=reserve,
                         max_num_seqs=self.engine.max_num_seqs, speculation=self.speculation)

    def engine_config(self) -> EngineConfig:
        if self.speculation is None:
            return self.engine
        return dataclasses.replace(self.engine, speculative_config=self.speculation.engine_config())


def build_instance(target: SimTarget, clock: VirtualClock, keep_log: bool = False,
                   defer: bool = False) -> tuple[Any, StepTimer]:
    """The engine (or DEP group) of one instance of `target` on `clock`, and its step timer (`keep_log`:
    the timer keeps every step's time and rows; `defer`: its driver sleeps the step times)."""
    model = target.cost_model()
    timer = StepTimer(model, clock, target.role, keep_log, defer)
    timer.seen_shapes.update(target.precompiled)
    kv_tokens = target.kv_tokens
    capacity = model.capacity() if target.model_config is None else None
    if kv_tokens is None and capacity is not None:
        if not capacity.feasible:
            raise OutOfPagesError(
                f"{target.shape.name} does not fit {target.layout.gpus} x {target.device.name} as "
                f"{target.layout.name}: {capacity.weight_bytes_per_gpu / 1e9:.0f} GB of weights per GPU, "
                f"{capacity.free_bytes_per_gpu / 1e9:.0f} GB left for KV")
        kv_tokens = capacity.kv_tokens_per_engine
    cfg = target.engine_config()
    engines = []
    for rank in range(target.layout.dp):
        offload = None
        if target.model_config is not None:
            order = engine_eviction_order(cfg.kv_policy, clock)
            if kv_tokens and not cfg.num_kv_blocks:
                kv = KVCacheManager.from_model_config(target.model_config, kv_tokens // cfg.block_size, cfg.block_size,
                                                      enable_caching=cfg.enable_prefix_caching, clock=clock,
                                                      eviction_order=order)
            else:  # the KV memory the real engine lays out for these settings
                kv = KVCacheManager.from_layout(engine_kv_layout(target.model_config, cfg),
                                                enable_caching=cfg.enable_prefix_caching, clock=clock,
                                                eviction_order=order)
            info = target.model_config
        else:
            pages = min(max(2, kv_tokens // cfg.block_size + 1), MAX_SIMULATED_PAGES)
            kv = KVCacheManager.full_attention(pages, cfg.block_size, enable_caching=cfg.enable_prefix_caching,
                                               cache_on_allocate=False, clock=clock,
                                               eviction_order=engine_eviction_order(cfg.kv_policy, clock))
            info = ModelInfo(target.shape.name, target.vocab_size or target.shape.vocab, target.shape.max_context,
                             num_mtp_modules=1 if target.speculation is not None else 0)
            if target.offload is not None:  # a DEP group moves the clock for its ranks' idle waits
                offload = build_virtual_offload(target.offload, kv, target.shape, target.device,
                                                capacity.kv_bytes_per_token_per_gpu * cfg.block_size, clock,
                                                timer.spend if target.layout.dp == 1 else None)
        runner = VirtualRunner(timer, rank, target.speculation, cfg.block_size, target.seed)
        engines.append(Engine(info, None, cfg, kv=kv, runner=runner, offload=offload))
    if target.layout.dp == 1:
        return engines[0], timer
    return LockstepEngines(engines, timer, target.router), timer


def prefill_only(sessions: Sequence[Session]) -> list[Session]:
    """The sessions with every turn cut to one output token (a prefill instance's work)."""
    def cut(session: Session) -> Session:
        return dataclasses.replace(
            session, turns=[dataclasses.replace(turn, output_tokens=1) for turn in session.turns],
            subagents=[cut(sub) for sub in session.subagents])
    return [cut(session) for session in sessions]


def simulate_agentx(config: AgentxConfig, target: SimTarget, sessions: Sequence[Session] | None = None,
                    gpu_price_per_hour: float | None = None, step_log: list | None = None,
                    progress: bool = False) -> dict:
    """The AgentX replay of `config` against `target`, on a virtual clock. Returns the summary of
    `agentjax bench agentx` (TPGS, P90 interactivity, hit rate, TTFT/ITL/E2E percentiles) plus the
    step statistics and, with a GPU price, the cost per million tokens against the API.
    `step_log`, if given, receives (seconds, rows per rank) for every step (of every instance); `progress`
    shows a bar of simulated seconds against the duration."""
    sessions = load_sessions(config) if sessions is None else sessions
    if target.role == "prefill":
        sessions = prefill_only(sessions)
    config = dataclasses.replace(config, gpus=target.gpus, progress=progress)
    clock = VirtualClock()
    loop = VirtualTimeLoop(clock)
    placement = None
    try:
        if target.instances == 1:
            instance, timer = build_instance(target, clock, keep_log=step_log is not None)
            instances, timers = [instance], [timer]
            backend = EngineBackend(instance, clock=clock)
        else:  # instances step side by side: each driver sleeps its own step times
            built = [build_instance(target, clock, keep_log=step_log is not None, defer=True)
                     for _ in range(target.instances)]
            instances, timers = [b[0] for b in built], [b[1] for b in built]
            placement = PolicyPlacement(target.router, instances, label="instance")
            backend = FleetBackend([EngineBackend(i, clock=clock, step_delay=t.take_deferred) for i, t in built],
                                   placement)
        summary = loop.run_until_complete(AgentxRun(config, sessions, backend, clock=clock, label="simulate").run())
    finally:
        loop.close()
    if step_log is not None:
        for timer in timers:
            step_log.extend(timer.log)
    summary.update(
        label=PROJECTION, simulated_s=clock.now, steps=sum(t.steps for t in timers),
        busy_s=max(t.busy_s for t in timers), compiled_shapes=len(set().union(*(t.seen_shapes for t in timers))),
        device=target.device.name, layout=target.layout.name, instances=target.instances, model=target.shape.name,
        role=target.role, router=target.router, efficiency=target.device.efficiency.to_dict(),
        padding_fraction=padding_fraction(timers))
    summary.update(_option_figures(target, instances, placement))
    price = gpu_price_per_hour if gpu_price_per_hour is not None else target.device.price_per_hour
    if price is not None and summary["input_tokens"] + summary["output_tokens"] > 0:
        comparison = compare_costs(summary, price)
        summary.update(gpu_price_per_hour=price, gpu_cost_per_million_tokens=comparison.gpu_cost_per_million_tokens,
                       api_cost_per_million_tokens=comparison.api_cost_per_million_tokens,
                       cost_advantage=comparison.advantage)
    return summary


def padding_fraction(timers: Sequence[StepTimer]) -> float:
    """The share of the steps' token slots that were bucket padding (0 with exact shapes): the
    runner's padded shapes over every rank, against the real tokens the steps carried."""
    slots = sum(t.token_slots for t in timers)
    return 1.0 - sum(t.tokens for t in timers) / slots if slots else 0.0


def _option_figures(target: SimTarget, instances: list, placement: PolicyPlacement | None) -> dict:
    """What the routing, speculation and offload options did in the run."""
    engines = [engine for instance in instances for engine in getattr(instance, "engines", [instance])]
    figures: dict = {}
    placements = [p for p in [placement, *(getattr(i, "placement", None) for i in instances)] if p is not None]
    if placements:
        figures["routing"] = [p.snapshot() for p in placements]
    if target.speculation is not None:
        proposed = sum(e.runner.drafts_proposed for e in engines)
        accepted = sum(e.runner.drafts_accepted for e in engines)
        figures["speculation"] = {"method": target.speculation.method,
                                  "num_speculative_tokens": target.speculation.num_speculative_tokens,
                                  "draft_tokens": proposed, "accepted_tokens": accepted,
                                  "acceptance_rate": accepted / proposed if proposed else None}
    if target.offload is not None:
        loaded: dict = {}
        stored: dict = {}
        for engine in engines:
            snapshot = engine.offload.snapshot()
            for tier in snapshot["tiers"]:
                loaded[tier] = loaded.get(tier, 0) + snapshot["pages_loaded"][tier]
                stored[tier] = stored.get(tier, 0) + snapshot["pages_stored"][tier]
        figures["offload"] = {"pages_loaded": loaded, "pages_stored": stored,
                              "pages_prefetched": sum(e.offload.snapshot()["pages_prefetched"] for e in engines),
                              "link_busy_s": {q: max(e.offload_worker.busy_s[q] for e in engines)
                                              for q in ("to_host", "to_device", "disk")}}
    return figures
