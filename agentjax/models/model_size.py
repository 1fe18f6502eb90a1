"""How big a model is, from its abstract shapes and its KV plan: parameters (total, per MTP module,
active per token), KV bytes per token of the growing (prefix) groups, and the bounded per-sequence
part (sliding windows and rolling compressor states, recurrent states). Nothing is allocated (`jax.eval_shape` through
`abstract_model`), so full-size presets such as `preset:minimax-m3` report in seconds on a CPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from flax import nnx

from agentjax.config import ModelConfig
from agentjax.kv.cache_layout import required_page_tokens, specs_from_model_config
from agentjax.kv.specs import plan_groups
from agentjax.models.params import abstract_model


@dataclass(frozen=True)
class ModelSize:
    """Parameter counts and KV bytes of one model configuration."""

    total_params: int  # the decoder (embeddings, layers, LM head), without MTP modules
    mtp_params: int  # all MTP modules together
    active_params: int  # per token: every non-routed parameter plus top-k/E of the routed experts
    kv_bytes_per_token: float  # bytes per token of the groups that grow with the context, at the plan's page size
    state_bytes_per_sequence: int  # fixed recurrent state per sequence (checkpoint groups)
    page_tokens: int
    num_mtp_modules: int = 0
    # Bounded per-sequence KV: every window group's layers times the bytes of one full window
    # (DeepSeek-V4's sliding windows and compressor states; ARCHITECTURES.md's "fixed per-sequence state").
    window_bytes_per_sequence: int = 0

    @property
    def mtp_params_per_module(self) -> int:
        return self.mtp_params // self.num_mtp_modules if self.num_mtp_modules else 0


def _is_routed_expert(path: tuple) -> bool:
    names = [str(p) for p in path]
    return any(a == "mlp" and b == "experts" for a, b in zip(names, names[1:]))


def model_size(cfg: ModelConfig, page_tokens: int | None = None) -> ModelSize:
    """Counts from `cfg`'s abstract model; KV from its groups planned at `page_tokens` tokens per page
    (default: what the model requires, else 16)."""
    page_tokens = page_tokens or required_page_tokens(cfg) or 16
    total = mtp = routed = 0
    for path, variable in nnx.to_flat_state(nnx.state(abstract_model(cfg))):
        count = math.prod(variable.get_value().shape)
        if str(path[0]) == "mtp":
            mtp += count
            continue
        total += count
        if _is_routed_expert(path):
            routed += count
    inactive = 0
    if cfg.moe is not None and routed:
        inactive = routed - routed * cfg.moe.num_experts_per_token // cfg.moe.num_experts
    plan = plan_groups(specs_from_model_config(cfg), page_tokens, scale_tokens_per_page=False)
    kv_bytes = sum(g.used_bytes_per_page / g.tokens_per_page for g in plan.groups if g.spec.hit_rule == "prefix")
    state_bytes = sum(g.used_bytes_per_page for g in plan.groups if g.spec.hit_rule == "checkpoint")
    window_bytes = sum(g.num_layers * g.spec.bytes_for_tokens(g.spec.window) for g in plan.groups
                       if g.spec.hit_rule == "window")
    return ModelSize(total, mtp, total - inactive, kv_bytes, state_bytes, page_tokens, cfg.num_mtp_modules,
                     window_bytes)
