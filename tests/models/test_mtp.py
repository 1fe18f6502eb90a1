"""The MiniMax-M3 MTP module held in the Decoder: built from the config, filled from the fixture's
mtp.* tensors, and its combine rule against the formula written in numpy."""
from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from agentjax.errors import ModelConfigError
from agentjax.models import load_model
from agentjax.models.decoder import Decoder
from agentjax.models.params import split_model
from agentjax.models.presets import PRESETS

FIXTURE = Path(__file__).parent / "data" / "minimax-m3-b"


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def test_combine_is_eh_proj_of_normed_embedding_and_hidden_with_position_zero_embedding_dropped():
    cfg, params, _ = load_model(str(FIXTURE))
    graphdef, _ = split_model(cfg)
    mtp = nnx.merge(graphdef, params).mtp[0]
    rng = np.random.default_rng(0)
    e, h = (rng.standard_normal((5, cfg.hidden_size)).astype(np.float32) for _ in range(2))
    positions = np.array([0, 1, 2, 3, 0], np.int32)
    ours = np.asarray(mtp.combine(jnp.asarray(e), jnp.asarray(h), jnp.asarray(positions)))
    enorm, hnorm = np.asarray(mtp.enorm.weight[...]), np.asarray(mtp.hnorm.weight[...])
    e_kept = np.where(positions[:, None] == 0, 0.0, e)
    expected = np.concatenate([_rms(e_kept, enorm, cfg.rms_norm_eps), _rms(h, hnorm, cfg.rms_norm_eps)], -1)
    np.testing.assert_allclose(ours, expected @ np.asarray(mtp.eh_proj.kernel[...]), atol=1e-5)


def test_mtp_needs_the_block_sparse_and_moe_configs():
    cfg = PRESETS["tiny-dense"].replace(num_mtp_modules=1)
    with pytest.raises(ModelConfigError, match="num_mtp_modules=1 needs the block_sparse and moe configs"):
        Decoder(cfg, rngs=nnx.Rngs(0))


def test_deepseek_v4_mtp_combines_every_residual_stream_with_the_normed_embedding():
    """DeepSeek-V4's module (fixture deepseek-v4-a, upstream mtp.0.* tensors): `h_proj(hnorm(h_n)) +
    e_proj(enorm(e))` for each stream n, with e zeroed at position 0; its block is a swa_mqa + MoE layer."""
    cfg, params, _ = load_model(str(FIXTURE.parent / "deepseek-v4-a"))
    graphdef, _ = split_model(cfg)
    mtp = nnx.merge(graphdef, params).mtp[0]
    assert type(mtp.block.attn).__name__ == "SlidingWindowMQA" and not mtp.block.mlp.hashed
    rng = np.random.default_rng(1)
    streams = rng.standard_normal((4, cfg.hyper_connections.num_streams, cfg.hidden_size)).astype(np.float32)
    e = rng.standard_normal((4, cfg.hidden_size)).astype(np.float32)
    positions = np.array([0, 5, 6, 7], np.int32)
    ours = np.asarray(mtp.combine(jnp.asarray(e), jnp.asarray(streams), jnp.asarray(positions)))
    w = {name: np.asarray(getattr(mtp, name).kernel[...]) for name in ("e_proj", "h_proj")}
    e_kept = np.where(positions[:, None] == 0, 0.0, e)
    expected = (_rms(streams, np.asarray(mtp.hnorm.weight[...]), cfg.rms_norm_eps) @ w["h_proj"]
                + (_rms(e_kept, np.asarray(mtp.enorm.weight[...]), cfg.rms_norm_eps) @ w["e_proj"])[:, None])
    np.testing.assert_allclose(ours, expected, atol=1e-5)


@pytest.mark.parametrize("name, roles", [("tiny-minimax-m3", {"kv", "index"}), ("tiny-dsv4", {"window"})])
def test_with_mtp_kv_cache_the_mtp_layer_gets_slots_in_the_groups_of_its_kind(name, roles):
    """Speculative decoding's "mtp" method sets `mtp_kv_cache`: the MTP layer (number num_layers) stores KV
    in a slot of its own in the groups the main layers of its kind use (MiniMax-M3: K/V and indexer keys
    as the block-sparse layers; DeepSeek-V4: the window rows as the swa_mqa layer), so the group count and
    the KV manager's plan stay as they were; the block's mixer reads those groups."""
    from agentjax.kv.cache_layout import kv_buffer_specs, kv_slots

    cfg = PRESETS[name]
    with_mtp = cfg.replace(mtp_kv_cache=True)
    plain_slots, slots = kv_slots(cfg), kv_slots(with_mtp)
    mtp = {role: place for (layer, role), place in slots.items() if layer == cfg.num_layers}
    assert set(mtp) == roles and set(plain_slots) == set(slots) - {(cfg.num_layers, role) for role in roles}
    for role, (group, slot) in mtp.items():
        sharing = [layer for (layer, r), (g, _) in plain_slots.items() if g == group]
        assert sharing and slot == len(sharing)  # the next slot of a main group
    assert len(kv_buffer_specs(with_mtp, 16)) == len(kv_buffer_specs(cfg, 16))
    module = Decoder(with_mtp, rngs=nnx.Rngs(0)).mtp[0]
    assert dict(module.slot_table) == {role: slot for role, (_, slot) in mtp.items()}
    with pytest.raises(Exception, match="mtp_kv_cache needs MTP modules"):
        PRESETS["tiny-dense"].replace(mtp_kv_cache=True)
