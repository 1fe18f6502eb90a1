"""Start-up of speculative decoding: what each method needs, checked before anything is built.

`plan_speculation` returns the served model's config as the method needs it (with "mtp" its MTP
layers keep KV, `ModelConfig.mtp_kv_cache`) and the device drafter's `Drafting` ("mtp", "draft_model";
None for n-gram, whose drafts come from the host). A draft model is loaded here and must share the
target's vocabulary (the same tokens at the same ids) and keep positional KV only. `make_speculator`
gives the engine's `Speculator`. Every refusal is a `SpeculativeConfigError` that says why. Host only,
except that loading a draft model builds its parameters.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentjax.errors import AgentjaxError, SpeculativeConfigError
from agentjax.spec_decode.speculator import Speculator

# Tokens compared when two tokenizers are checked for one vocabulary (plus the last id).
VOCABULARY_SAMPLE = 4096


@dataclass
class Drafting:
    """A device drafter: its method, draft count and, for "draft_model", the draft's config and parameters."""

    method: str
    num_speculative_tokens: int
    draft_cfg: Any = None
    draft_params: Any = None


def plan_speculation(model_cfg, engine_cfg, tokenizer=None, draft_model=None):
    """`(model config to serve, Drafting or None)`; `draft_model` may give the draft's already loaded
    `(config, params, tokenizer)` in place of loading `speculative_config["model"]`."""
    spec = engine_cfg.speculative_config
    if spec is None:
        return model_cfg, None
    parallel = engine_cfg.parallel
    if parallel.data_parallel_size > 1 or engine_cfg.num_processes > 1:
        raise SpeculativeConfigError(
            f"speculative decoding does not run with data parallelism or several processes yet; the layout "
            f"{parallel.name} (num_processes={engine_cfg.num_processes}) is not supported with speculative_config")
    if spec.method == "ngram":  # drafts come from the host; the laid-out step verifies them as one device's does
        return model_cfg, None
    if not parallel.is_single_device:
        raise SpeculativeConfigError(
            f"speculative_config method {spec.method!r} runs on one device for now (its drafter is not laid out); "
            f"the layout {parallel.name} runs method 'ngram'")
    if engine_cfg.kv_offload_enabled:
        raise SpeculativeConfigError(f"speculative_config method {spec.method!r} does not run with KV offload "
                                     "tiers yet; turn off host_cache_gb, disk_cache_dir and mooncake_master")
    k = spec.num_speculative_tokens
    if spec.method == "mtp":
        if not model_cfg.num_mtp_modules:
            raise SpeculativeConfigError(
                f"speculative_config method 'mtp' needs a model with MTP modules; model {model_cfg.name!r} has none "
                f"(num_mtp_modules=0)")
        return model_cfg.replace(mtp_kv_cache=True), Drafting("mtp", k)
    draft_cfg, draft_params, draft_tokenizer = draft_model or _load_draft(spec.model, model_cfg.dtype)
    _check_draft(model_cfg, tokenizer, draft_cfg, draft_tokenizer, spec.model, engine_cfg.block_size)
    return model_cfg, Drafting("draft_model", k, draft_cfg.replace(mtp_kv_cache=False), draft_params)


def _load_draft(spec: str, dtype: str):
    from agentjax.models import load_model

    try:
        return load_model(spec, dtype=dtype)
    except AgentjaxError as error:
        raise SpeculativeConfigError(f"speculative_config draft model {spec!r} could not be loaded: {error}") from None


def _check_draft(model_cfg, tokenizer, draft_cfg, draft_tokenizer, spec: str, block_size: int) -> None:
    from agentjax.kv.cache_layout import kv_buffer_specs, state_group_ids

    if draft_cfg.vocab_size != model_cfg.vocab_size:
        raise SpeculativeConfigError(
            f"draft model {spec!r} has a vocabulary of {draft_cfg.vocab_size} tokens, the model {model_cfg.name!r} "
            f"{model_cfg.vocab_size}: a draft model must share the model's tokenizer")
    if tokenizer is not None and draft_tokenizer is not None and not _same_vocabulary(tokenizer, draft_tokenizer):
        raise SpeculativeConfigError(
            f"draft model {spec!r} has a tokenizer of another vocabulary than the model {model_cfg.name!r} "
            f"(the same ids spell other tokens): a draft model must share the model's tokenizer")
    if state_group_ids(draft_cfg):
        raise SpeculativeConfigError(
            f"draft model {spec!r} keeps a recurrent state; a draft model must keep positional KV only")
    try:
        kv_buffer_specs(draft_cfg, block_size)
    except AgentjaxError as error:
        raise SpeculativeConfigError(f"draft model {spec!r} cannot use the engine's KV pages: {error}") from None


def _same_vocabulary(first, second) -> bool:
    """Whether two tokenizers spell the same tokens at the same ids (a spread sample of ids and the last)."""
    size = first.vocab_size
    if second.vocab_size != size:
        return False
    ids = sorted({*range(0, size, max(1, size // VOCABULARY_SAMPLE)), size - 1})
    return all(first.id_to_token(i) == second.id_to_token(i) for i in ids)


def make_speculator(engine_cfg, drafting: Drafting | None) -> Speculator | None:
    """None when `engine_cfg.speculative_config` is unset."""
    spec = engine_cfg.speculative_config
    if spec is None:
        return None
    return Speculator(spec, drafts_on_device=drafting is not None)
