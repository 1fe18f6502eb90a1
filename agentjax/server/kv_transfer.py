"""A replica's part when a router moves KV between replicas: `POST /kv/prefill` and `POST /kv/flush`.

`/kv/prefill` makes a request's prompt KV resident on this replica: the prompt is tokenized as its
route would, the pages the offload tiers hold (another replica's, in Mooncake) are loaded by block
hash and the rest is computed; one token is sampled and thrown away. With `store`, it answers once
the prompt's pages are in the shared tiers, so a decode replica can pull them (P/D); it runs as a
branch point (the prompt continues elsewhere), so a selective retention stores the whole prompt. With
`session_id`, it runs as that session with the body's agent hints, so a migration's target keeps
the pages for the session's next turn. `/kv/flush` answers once every turn that has ended here has
its pages stored (a migration's source, before the target reads them). Never imports jax.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, Field

from agentjax.sampling_params import SamplingParams
from agentjax.scheduler.request import AgentHints
from agentjax.server.errors import APIError, KVTierUnavailableError
from agentjax.server.kv_view import PROMPT_PATHS, parse_prompt
from agentjax.server.tenancy import tenant_of

logger = logging.getLogger(__name__)

SHARED_TIER = "mooncake"  # the tier other replicas read
FLUSH_TIMEOUT_S = 60.0


class PrefillRequest(BaseModel):
    path: str = Field(description="the route the body is for: " + ", ".join(PROMPT_PATHS))
    body: dict[str, Any]
    store: bool = Field(False, description="answer once the prompt's pages are in the shared (Mooncake) tier")
    session_id: str | None = Field(None, max_length=256,
                                   description="run as this session, with the body's agent hints")


def check_shared_tier(offload: dict | None) -> None:
    """Raises unless the Mooncake tier is there and in use (`offload`: `Engine.stats()["kv_offload"]`)."""
    if not offload or SHARED_TIER not in offload.get("tiers", ()):
        raise APIError("a P/D prefill needs the Mooncake tier: start agentjax serve with --mooncake-master "
                       "HOST:PORT", code="kv_offload_disabled")
    if offload.get("degraded", {}).get(SHARED_TIER):
        raise KVTierUnavailableError("the Mooncake tier is out of use on this replica (its master is unreachable "
                                     "or the pool failed); the prompt's pages are not shared",
                                     code="kv_tier_degraded")


def install_kv_transfer_routes(app: FastAPI, async_engine: Any, serving: Any, messages_serving: Any,
                               responses_serving: Any) -> None:
    """`POST /kv/prefill` and `POST /kv/flush` (see the module docstring)."""

    async def flushed_tiers(why: str) -> dict[str, bool]:
        try:
            degraded = await asyncio.wait_for(async_engine.flush_offload(), FLUSH_TIMEOUT_S)
        except TimeoutError:
            raise KVTierUnavailableError(f"the offload tiers did not take this replica's page stores within "
                                         f"{FLUSH_TIMEOUT_S:.0f} s", code="kv_store_timeout") from None
        if degraded is None:
            raise APIError(f"{why} needs a KV offload tier: start agentjax serve with --mooncake-master "
                           "HOST:PORT", code="kv_offload_disabled")
        return degraded

    @app.post("/kv/prefill")
    async def prefill(wanted: PrefillRequest, request: Request) -> dict:
        """Computes (or loads) the prompt of `body`, a request for `path`, into this replica's KV cache
        (in the caller's cache namespace: the router sends the client's key)."""
        tenant = tenant_of(request.scope)
        tokens, salt, parsed = await serving.chat_path.off_loop(parse_prompt, wanted.path, wanted.body, tenant,
                                                                serving, messages_serving, responses_serving)
        if not tokens:
            raise APIError("the body's prompt is empty", param="body")
        if wanted.store:
            check_shared_tier(async_engine.stats.get("kv_offload"))  # before any compute
        if wanted.session_id is not None:
            kwargs = serving.engine_kwargs_of(parsed, tenant.session(wanted.session_id), request)
        else:
            kwargs = {"cache_salt": salt} if salt is not None else {}
        if wanted.store:  # the prompt continues on another replica: a selective retention stores all of it
            kwargs["hints"] = AgentHints(branch_point=True, pin="none")
        stream = await async_engine.add_request(tokens, SamplingParams(max_tokens=1, temperature=0.0), **kwargs)
        final = None
        try:
            async for output in stream:
                final = output
        except asyncio.CancelledError:
            async_engine.abort(stream.request_id)
            raise
        answer = {"prompt_tokens": len(tokens), "cached_tokens": final.num_cached_tokens if final else 0}
        if wanted.store:
            degraded = await flushed_tiers("a P/D prefill")
            check_shared_tier({"tiers": list(degraded), "degraded": degraded})
            answer["stored_in"] = SHARED_TIER
        return answer

    @app.post("/kv/flush")
    async def flush() -> dict:
        """Answers once the page stores of every turn that ended here have reached their tiers."""
        degraded = await flushed_tiers("/kv/flush")
        return {"tiers": sorted(degraded), "degraded": sorted(name for name, down in degraded.items() if down)}
