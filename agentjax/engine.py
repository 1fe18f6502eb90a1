"""The host loop: `add_request`, `step`, `abort`, and a stream of outputs.

Each step picks the tokens to run (decodes first, then prefill chunks under the token budget),
gives them pages, runs the model once on the ragged batch, and appends the sampled tokens.
Host state is plain Python; the device sees only the padded metadata arrays.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from agentjax.config import EngineConfig, ModelConfig
from agentjax.errors import InvalidRequestError, OutOfPagesError, PromptTooLongError
from agentjax.runner.model_runner import ModelRunner
from agentjax.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class PageAllocator:
    """First-come page allocator over pages 1..num_pages-1 (page 0 is the null page)."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.free_pages: deque[int] = deque(range(1, num_pages))

    @property
    def num_free(self) -> int:
        return len(self.free_pages)

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free_pages):
            raise OutOfPagesError(f"need {count} pages, {len(self.free_pages)} free")
        return [self.free_pages.popleft() for _ in range(count)]

    def release(self, pages: Sequence[int]) -> None:
        self.free_pages.extend(pages)


@dataclass
class EngineRequest:
    """One generation request's host state."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    pages: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    first_token_time: float | None = None
    seed: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < len(self.prompt_token_ids)


@dataclass(frozen=True)
class EngineOutput:
    """What one step produced for one request: its new tokens and, when done, why it stopped."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    num_prompt_tokens: int


class Engine:
    """Serves many requests at once on one model runner."""

    def __init__(self, model_cfg: ModelConfig, params, engine_cfg: EngineConfig, tokenizer=None):
        self.model_cfg = model_cfg
        self.config = engine_cfg
        self.tokenizer = tokenizer
        self.max_model_len = engine_cfg.max_model_len or model_cfg.max_position_embeddings
        num_pages = engine_cfg.num_kv_blocks or self._pages_for_memory(engine_cfg)
        self.runner = ModelRunner(model_cfg, params, num_pages, engine_cfg.block_size, engine_cfg.numerics)
        self.allocator = PageAllocator(num_pages)
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.requests: dict[str, EngineRequest] = {}
        self._ids = itertools.count()
        self.num_steps = 0

    def _pages_for_memory(self, cfg: EngineConfig) -> int:
        page_bytes = self.model_cfg.kv_bytes_per_token() * cfg.block_size
        return max(16, int(cfg.kv_cache_memory_gb * 2**30) // page_bytes)

    # ---- requests -------------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        request_id: str | None = None,
        *,
        session_id: str | None = None,
        priority: int = 0,
        hints=None,
        cache_salt: str | None = None,
    ) -> str:
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        if len(prompt) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(prompt)} tokens; the model's context is {self.max_model_len} "
                f"(a prompt may use at most {self.max_model_len - 1} to leave room for one new token)"
            )
        bad = [t for t in prompt if not 0 <= t < self.model_cfg.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.model_cfg.vocab_size})")
        needed = -(-min(len(prompt) + sampling.max_tokens, self.max_model_len) // self.config.block_size)
        if needed > self.allocator.num_pages - 1:
            raise OutOfPagesError(
                f"the request needs {needed} KV pages but the pool has {self.allocator.num_pages - 1}; "
                f"raise num_kv_blocks or lower max_tokens"
            )
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        stops = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stops |= set(self._eos_token_ids())
        request = EngineRequest(
            request_id, prompt, sampling, frozenset(stops),
            seed=sampling.seed if sampling.seed is not None else (self.config.seed + len(self.requests)) % 2**32,
        )
        self.requests[request_id] = request
        self.waiting.append(request)
        return request_id

    def _eos_token_ids(self) -> tuple[int, ...]:
        if self.tokenizer is not None:
            return tuple(self.tokenizer.stop_token_ids)
        return self.model_cfg.eos_token_ids

    def abort(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
        self.allocator.release(request.pages)
        request.pages = []

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> dict:
        total = self.allocator.num_pages - 1
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "kv_total_blocks": total,
            "kv_free_blocks": self.allocator.num_free,
            "kv_used_blocks": total - self.allocator.num_free,
            "kv_usage": (total - self.allocator.num_free) / total,
        }

    # ---- one step -------------------------------------------------------------------------
    def _pages_to_cover(self, request: EngineRequest, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.config.block_size) - len(request.pages))

    def _schedule(self) -> list[tuple[EngineRequest, int]]:
        """(request, number of new tokens) for this step: decodes, then prefill chunks."""
        budget = self.config.max_num_batched_tokens
        chunk_cap = self.config.long_prefill_token_threshold or budget
        scheduled: list[tuple[EngineRequest, int]] = []
        for request in self.running:
            if len(scheduled) >= self.config.max_num_seqs or budget <= 0:
                break
            remaining = len(request.all_token_ids) - request.num_computed_tokens
            count = min(remaining, budget, chunk_cap if request.is_prefilling else remaining)
            need = self._pages_to_cover(request, request.num_computed_tokens + count)
            if need > self.allocator.num_free:
                continue  # waits for pages held by others to free
            request.pages += self.allocator.allocate(need)
            scheduled.append((request, count))
            budget -= count
        while self.waiting and budget > 0 and len(scheduled) < self.config.max_num_seqs:
            request = self.waiting[0]
            count = min(len(request.prompt_token_ids), budget, chunk_cap)
            need = self._pages_to_cover(request, count)
            if need > self.allocator.num_free:
                break
            self.waiting.popleft()
            request.pages += self.allocator.allocate(need)
            self.running.append(request)
            scheduled.append((request, count))
            budget -= count
        return scheduled

    def step(self) -> list[EngineOutput]:
        scheduled = self._schedule()
        if not scheduled:
            if self.has_unfinished():
                raise OutOfPagesError("no request can be scheduled: the KV pool is too small for what waits")
            return []
        rows, sampling = [], []
        for request, count in scheduled:
            start = request.num_computed_tokens
            rows.append((request.all_token_ids[start : start + count], start, request.pages))
            sp = request.sampling
            sampling.append((sp.temperature, sp.top_k, sp.top_p, request.seed, len(request.output_token_ids)))
        tokens = self.runner.execute(rows, sampling)
        self.num_steps += 1
        now = time.monotonic()
        outputs = []
        for (request, count), token in zip(scheduled, tokens):
            request.num_computed_tokens += count
            if request.num_computed_tokens < len(request.all_token_ids):
                continue  # a prefill chunk that is not the last: its sample is discarded
            request.output_token_ids.append(int(token))
            request.first_token_time = request.first_token_time or now
            reason = self._finish_reason(request)
            if reason:
                self._finish(request, reason)
            outputs.append(
                EngineOutput(
                    request.request_id, [int(token)], reason is not None, reason,
                    request.num_cached_tokens, len(request.prompt_token_ids),
                )
            )
        return outputs

    def _finish_reason(self, request: EngineRequest) -> str | None:
        sp = request.sampling
        generated = len(request.output_token_ids)
        if generated >= sp.min_tokens and request.output_token_ids[-1] in request.stop_token_ids:
            return "stop"
        if sp.stop and self.tokenizer is not None and generated >= sp.min_tokens:
            text = self.tokenizer.decode(request.output_token_ids)
            if any(stop in text for stop in sp.stop):
                return "stop"
        if generated >= sp.max_tokens or len(request.all_token_ids) >= self.max_model_len:
            return "length"
        return None

    def _finish(self, request: EngineRequest, reason: str) -> None:
        request.finish_reason = reason
        self.running.remove(request)
        self.allocator.release(request.pages)
        request.pages = []
        self.requests.pop(request.request_id, None)

    def run_until_done(self) -> Iterator[EngineOutput]:
        while self.has_unfinished():
            yield from self.step()
