"""`LLM`: the notebook API. Loads a model and runs an engine over many prompts at once.

    llm = LLM()                                     # the embedded SmolLM2-135M-Instruct
    outs = llm.generate(["Once upon a time"], SamplingParams(max_tokens=32, temperature=0.0))
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=16))
    outs = llm.generate(["2 + 2 ="], SamplingParams(n=3, seed=1, logprobs=5, prompt_logprobs=1))
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from agentjax.config import EngineConfig
from agentjax.data_parallel import make_engine
from agentjax.errors import InvalidRequestError
from agentjax.logprobs import TokenLogprobs, cumulative_logprob
from agentjax.outputs import CompletionOutput, RequestOutput
from agentjax.sampling_params import SamplingParams
from agentjax.stop_strings import ReplyText

_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


class LLM:
    """A model plus an engine. Engine settings come by their CLI names in snake case.

    `dtype` is the model's; `gguf_blocks` keeps a GGUF file's Q4_0/Q4_1/Q8_0 matrices in their blocks
    and dequantises them inside the step (default: when `dtype` is float32; see `load_model`)."""

    def __init__(self, model: str | None = None, *, dtype: str = "float32", gguf_blocks: bool | None = None,
                 **engine_args: Any):
        from agentjax.models import load_model

        unknown = set(engine_args) - _ENGINE_FIELDS
        if unknown:
            raise InvalidRequestError(
                f"unknown engine settings {sorted(unknown)}; known: {sorted(_ENGINE_FIELDS - {'extra'})}"
            )
        self.engine_config = EngineConfig(**engine_args)
        if self.engine_config.num_processes > 1:
            from agentjax.runner.distributed import initialize

            initialize(self.engine_config)  # before any device is used
        self.model_config, self.params, self.tokenizer = load_model(
            model, dtype=dtype, gguf_blocks=gguf_blocks, quantization=self.engine_config.quantization,
            engine_config=self.engine_config)
        self.engine = make_engine(self.model_config, self.params, self.engine_config, self.tokenizer)

    def _require_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise InvalidRequestError(
                f"{what} needs a tokenizer and model {self.model_config.name!r} has none "
                f"(its directory has no tokenizer.json); give prompts as lists of token ids"
            )

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            self._require_tokenizer("a text prompt")
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
        pinned for a while so the session's next turn finds its prefix cached. With `n` (or `best_of`)
        > 1 the samples share the prompt's pages; the best `n` of `best_of` by cumulative log
        probability are returned. With several processes (`num_processes`) every process calls this
        with the same arguments: process 0 runs the engine, the others follow its steps, and all
        return its outputs.
        """
        if self.engine_config.num_processes > 1:
            from agentjax.runner.distributed import generate_across_processes

            return generate_across_processes(self, self._generate, prompts, sampling_params, session_ids)
        return self._generate(prompts, sampling_params, session_ids)

    def _generate(self, prompts, sampling_params=None, session_ids=None) -> list[RequestOutput]:
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
        groups: list[list[str]] = []
        added: list[str] = []
        try:
            for prompt, sp, session_id in zip(encoded, sampling_params, session_ids):
                groups.append([])
                for index in range(sp.num_samples):
                    sample = sp.for_sample(index)
                    if sp.num_samples > sp.n and sample.logprobs is None:
                        sample = dataclasses.replace(sample, logprobs=0)  # best_of ranks by log probability
                    fork_of = groups[-1][0] if index else None
                    added.append(self.engine.add_request(prompt, sample, session_id=session_id, fork_of=fork_of))
                    groups[-1].append(added[-1])
        except Exception:
            for request_id in added:
                self.engine.abort(request_id)
            raise
        streams = {request_id: _SampleStream(self.tokenizer, sp.stop)
                   for ids, sp in zip(groups, sampling_params) for request_id in ids}
        for out in self.engine.run_until_done():
            stream = streams.get(out.request_id)
            if stream is not None:
                stream.add(out)
        return [self._request_output(ids, prompt, sp, streams)
                for ids, prompt, sp in zip(groups, encoded, sampling_params)]

    def _request_output(self, ids: list[str], prompt: list[int], sp: SamplingParams,
                        streams: dict[str, "_SampleStream"]) -> RequestOutput:
        samples = []
        for index, request_id in enumerate(ids):
            stream = streams[request_id]
            text = stream.reply.text if stream.reply is not None else ""
            logprobs = stream.logprobs if stream.logprobs else ([] if sp.logprobs is not None else None)
            cumulative = cumulative_logprob(stream.logprobs) if stream.logprobs else None
            samples.append(CompletionOutput(index, text, stream.tokens, stream.reason, logprobs, cumulative))
        if len(samples) > sp.n:  # best_of: keep the n most likely samples
            samples = sorted(samples, key=lambda c: -c.cumulative_logprob)[: sp.n]
            for index, sample in enumerate(samples):
                sample.index = index
                if sp.logprobs is None:
                    sample.logprobs = None
        first, head = samples[0], streams[ids[0]]
        return RequestOutput(ids[0], prompt, first.token_ids, first.text, first.finish_reason, head.cached,
                             first.logprobs, head.prompt_logprobs, samples)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        sampling_params: SamplingParams | None = None,
        session_id: str | None = None,
        **template_kwargs: Any,
    ) -> RequestOutput:
        """One assistant reply to `messages`, rendered with the model's chat template."""
        self._require_tokenizer("chat")
        prompt = self.tokenizer.encode_chat(messages, add_generation_prompt=True, **template_kwargs)
        return self.generate([prompt], sampling_params, session_ids=[session_id])[0]


class _SampleStream:
    """What one engine request produced, output by output."""

    def __init__(self, tokenizer: Any, stops: Sequence[str]):
        self.reply = ReplyText(tokenizer, stops) if tokenizer is not None else None  # cut as the server cuts
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self.reason: str | None = None
        self.cached = 0

    def add(self, out) -> None:
        self.tokens.extend(out.new_token_ids)
        if self.reply is not None:
            self.reply.push(out.new_token_ids, out.finished)
        self.logprobs.extend(out.logprobs or ())
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.cached = out.num_cached_tokens
        if out.finished:
            self.reason = out.finish_reason
