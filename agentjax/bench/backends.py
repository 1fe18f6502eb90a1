"""Where an AgentX replay sends its turns: the `Backend` protocol and its two implementations.

`EngineBackend` steps an in-process `Engine` on the caller's asyncio loop; `HttpBackend` streams
`/v1/completions` from an OpenAI-compatible server. Each turns a `TurnRequest` into a `RequestRecord`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from agentjax.bench.metrics import RequestRecord
from agentjax.bench.traces import TokenIdRange
from agentjax.errors import InvalidRequestError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TurnRequest:
    """What a backend sends for one turn."""

    prompt: list[int]
    max_tokens: int
    session_id: str
    turn_index: int
    hints: dict[str, Any] = field(default_factory=dict)


class Backend(Protocol):
    token_range: TokenIdRange
    max_prompt_tokens: int | None  # the backend's own cap (None: unknown)

    async def start(self) -> None: ...
    async def send(self, request: TurnRequest) -> RequestRecord: ...
    async def close(self) -> None: ...


def _failed(request: TurnRequest, start: float, error: BaseException | str,
            clock: Callable[[], float] = time.perf_counter) -> RequestRecord:
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return RequestRecord(start, None, clock(), len(request.prompt), 0, 0, error=text,
                         session_id=request.session_id, turn_index=request.turn_index)


class EngineBackend:
    """An in-process `Engine`, stepped by one task on the caller's asyncio loop (the Engine is
    not thread-safe, and one loop needs no locks). A step blocks the loop while it runs."""

    def __init__(self, engine: Any, clock: Callable[[], float] = time.perf_counter,
                 step_delay: Callable[[], float] | None = None) -> None:
        """`clock` stamps token arrivals (the planning simulator passes its virtual clock);
        `step_delay`, if given, returns the seconds the step just run takes, slept before its tokens
        are delivered (the simulator's instances of a deployment share one virtual clock this way)."""
        self.engine = engine
        self.clock = clock
        self.step_delay = step_delay
        vocab = engine.model_cfg.vocab_size
        self.token_range = TokenIdRange(low=min(256, vocab // 2), vocab_size=vocab)
        self.max_prompt_tokens = engine.max_model_len - 1
        self._queues: dict[str, asyncio.Queue] = {}
        self._wake = asyncio.Event()
        self._driver: asyncio.Task | None = None
        self._broken: BaseException | None = None

    @classmethod
    def from_model(cls, model: str | None, **engine_args: Any) -> EngineBackend:
        from agentjax.llm import LLM

        return cls(LLM(model, **engine_args).engine)

    async def start(self) -> None:
        self._driver = asyncio.create_task(self._drive(), name="agentx-engine")

    async def _drive(self) -> None:
        while True:
            if not self.engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                outputs = self.engine.step()
            except Exception as error:  # the engine's state is suspect: fail everything after it
                logger.exception("engine step failed")
                self._broken = error
                for request_id, queue in list(self._queues.items()):
                    self.engine.abort(request_id)
                    queue.put_nowait(error)
                continue
            if self.step_delay is not None:
                delay = self.step_delay()
                if delay > 0:
                    await asyncio.sleep(delay)
            now = self.clock()
            for output in outputs:
                queue = self._queues.get(output.request_id)
                if queue is not None:
                    queue.put_nowait((now, output))
            await asyncio.sleep(0)  # let the lanes take their tokens and send their next turns

    async def send(self, request: TurnRequest) -> RequestRecord:
        from agentjax.sampling_params import SamplingParams
        from agentjax.scheduler.request import AgentHints

        start = self.clock()
        if self._broken is not None:
            return _failed(request, start, self._broken, self.clock)
        sampling = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)
        try:
            request_id = self.engine.add_request(request.prompt, sampling, session_id=request.session_id,
                                                 hints=AgentHints(**request.hints))
        except Exception as error:
            return _failed(request, start, error, self.clock)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._wake.set()
        times: list[float] = []
        cached = 0
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    return _failed(request, start, item, self.clock)
                now, output = item
                times.extend([now] * len(output.new_token_ids))
                cached = output.num_cached_tokens
                if output.finished:
                    break
        except asyncio.CancelledError:
            self.engine.abort(request_id)
            raise
        finally:
            self._queues.pop(request_id, None)
        return RequestRecord.from_token_times(start, times, times[-1] if times else self.clock(),
                                              len(request.prompt), cached, session_id=request.session_id,
                                              turn_index=request.turn_index)

    def kv_stats(self) -> dict:
        """Where the engine's prefix hits came from: the prompt tokens each KV page group alone could
        serve (`group_hits`, by group name), tokens served through turn ends, states saved at branch
        points, and pages evicted. {} for an engine of several ranks (no one KV manager)."""
        if not hasattr(self.engine, "kv"):
            return {}
        kv = self.engine.kv.stats()
        layout = getattr(self.engine.kv, "layout", None)
        names = layout.group_names() if layout is not None else [str(g) for g in range(len(kv["group_hits"]))]
        return {"query_tokens": kv["queries"], "hit_tokens": kv["hits"],
                "group_hits": dict(zip(names, kv["group_hits"])), "turn_end_hits": kv["turn_end_hits"],
                "turn_ends_saved": kv["turn_ends_saved"], "branch_states_saved": kv["branch_states_saved"],
                "evictions": kv["evictions"], "preemptions": self.engine.scheduler.num_preemptions}

    async def close(self) -> None:
        if self._driver is not None:
            self._driver.cancel()
            await asyncio.gather(self._driver, return_exceptions=True)


class HttpBackend:
    """An OpenAI-compatible server: streaming `/v1/completions` with a token-id prompt, through
    the official `openai` async client; `session_id` and `agent_hints` go in the body,
    the session id also as `X-Session-ID`."""

    def __init__(self, url: str, model: str | None = None, api_key: str | None = None,
                 vocab_size: int = 49_152, max_prompt_tokens: int | None = None,
                 timeout_s: float = 600.0, http_client: Any = None) -> None:
        import openai

        self.client = openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key or "EMPTY",
                                         timeout=timeout_s, max_retries=0, http_client=http_client)
        self.model = model
        self.token_range = TokenIdRange(low=256, vocab_size=vocab_size)
        self.max_prompt_tokens = max_prompt_tokens

    async def start(self) -> None:
        """Picks the served model (the first listed unless given) and, unless given, takes the
        prompt cap from its card's `max_model_len` (agentjax and vLLM list it)."""
        models = (await self.client.models.list()).data
        if self.model is None:
            if not models:
                raise InvalidRequestError("the server lists no models; pass --model")
            self.model = models[0].id
        card = next((m for m in models if m.id == self.model), None)
        max_model_len = getattr(card, "max_model_len", None) if card is not None else None
        if self.max_prompt_tokens is None and isinstance(max_model_len, int) and max_model_len > 1:
            self.max_prompt_tokens = max_model_len - 1

    async def send(self, request: TurnRequest) -> RequestRecord:
        start = time.perf_counter()
        times: list[float] = []
        usage = None
        try:
            stream = await self.client.completions.create(
                model=self.model, prompt=request.prompt, max_tokens=request.max_tokens, stream=True,
                stream_options={"include_usage": True}, temperature=0.0,
                extra_body={"ignore_eos": True, "session_id": request.session_id,
                            "agent_hints": request.hints},
                extra_headers={"X-Session-ID": request.session_id})
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.choices and chunk.choices[0].text:
                    times.append(now)
                if chunk.usage is not None:
                    usage = chunk.usage
        except asyncio.CancelledError:
            raise
        except Exception as error:
            return _failed(request, start, error)
        end = time.perf_counter()
        if usage is None:
            return _failed(request, start, "the stream ended without a usage chunk")
        details = usage.prompt_tokens_details
        cached = int(getattr(details, "cached_tokens", 0) or 0) if details is not None else 0
        # Text chunks may carry several tokens: the usage's count is the truth, gaps are per chunk.
        return RequestRecord(start, times[0] if times else None, end, int(usage.prompt_tokens), cached,
                             int(usage.completion_tokens), tuple(np.diff(times).tolist()),
                             session_id=request.session_id, turn_index=request.turn_index)

    async def close(self) -> None:
        await self.client.close()
