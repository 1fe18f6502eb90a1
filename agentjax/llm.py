"""`LLM`: the notebook API. Loads a model and runs an engine over many prompts at once.

    llm = LLM()                                     # the embedded SmolLM2-135M-Instruct
    outs = llm.generate(["Once upon a time"], SamplingParams(max_tokens=32, temperature=0.0))
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=16))
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agentjax.config import EngineConfig
from agentjax.engine import Engine
from agentjax.errors import InvalidRequestError
from agentjax.sampling_params import SamplingParams

_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


@dataclass
class RequestOutput:
    """One finished request: generated text and ids, and how much of its prompt was cached."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int


class LLM:
    """A model plus an engine. Engine settings come by their CLI names in snake case."""

    def __init__(self, model: str | None = None, *, dtype: str = "float32", **engine_args: Any):
        from agentjax.models import load_model

        unknown = set(engine_args) - _ENGINE_FIELDS
        if unknown:
            raise InvalidRequestError(
                f"unknown engine settings {sorted(unknown)}; known: {sorted(_ENGINE_FIELDS - {'extra'})}"
            )
        self.engine_config = EngineConfig(**engine_args)
        self.model_config, self.params, self.tokenizer = load_model(model, dtype=dtype)
        self.engine = Engine(self.model_config, self.params, self.engine_config, self.tokenizer)

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        session_ids: Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids) in one batched run, in prompt order.

        `session_ids` (one per prompt) mark turns of agent sessions: a finished turn's pages stay
        pinned for a while so the session's next turn finds its prefix cached.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        sampling_params = sampling_params or SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise InvalidRequestError(
                f"got {len(sampling_params)} sampling params for {len(prompts)} prompts"
            )
        encoded = [self._encode(p) for p in prompts]
        session_ids = list(session_ids) if session_ids is not None else [None] * len(prompts)
        if len(session_ids) != len(prompts):
            raise InvalidRequestError(f"got {len(session_ids)} session ids for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, sp, session_id in zip(encoded, sampling_params, session_ids):
                ids.append(self.engine.add_request(prompt, sp, session_id=session_id))
        except Exception:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        generated: dict[str, list[int]] = {i: [] for i in ids}
        reasons: dict[str, str | None] = {}
        cached: dict[str, int] = {}
        for out in self.engine.run_until_done():
            if out.request_id in generated:
                generated[out.request_id].extend(out.new_token_ids)
                cached[out.request_id] = out.num_cached_tokens
                if out.finished:
                    reasons[out.request_id] = out.finish_reason
        results = []
        for request_id, prompt, sp in zip(ids, encoded, sampling_params):
            tokens = generated[request_id]
            text = self.tokenizer.decode(tokens) if self.tokenizer is not None else ""
            for stop in sp.stop:
                if stop in text:
                    text = text[: text.index(stop)]
            results.append(
                RequestOutput(request_id, prompt, tokens, text, reasons.get(request_id), cached.get(request_id, 0))
            )
        return results

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        sampling_params: SamplingParams | None = None,
        session_id: str | None = None,
        **template_kwargs: Any,
    ) -> RequestOutput:
        """One assistant reply to `messages`, rendered with the model's chat template."""
        prompt = self.tokenizer.encode_chat(messages, add_generation_prompt=True, **template_kwargs)
        return self.generate([prompt], sampling_params, session_ids=[session_id])[0]
