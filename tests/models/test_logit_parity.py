"""The JAX forward matches an independent float64 numpy forward on the real GGUF weights."""
from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from numpy_reference import reference_logits, reference_weights  # noqa: E402

from agentjax.models.params import params_from_arrays  # noqa: E402
from agentjax.runner import RaggedBatch, make_step  # noqa: E402
from agentjax.runner.step import make_forward, make_logits_fn  # noqa: E402
from checkpoints.gguf import load_gguf  # noqa: E402
from tests.fresh_process import run_in_fresh_process  # noqa: E402


def _jax_logits(cfg, arrays, tokens, page_size=16, positions=None):
    """Logits at every position of `tokens`, or only at `positions` (the LM head over a 262K vocabulary
    at every position would cost more memory than the whole forward)."""
    params = params_from_arrays(cfg, arrays)
    kv_pages = cfg.new_kv_pages(2 + len(tokens) // page_size + 1, page_size)
    batch = RaggedBatch.from_prompts([tokens], page_size)
    if positions is None:
        logits, _ = make_step(cfg, all_positions=True)(params, kv_pages, batch)
        return np.asarray(logits)[: len(tokens)]
    hidden, _ = jax.jit(make_forward(cfg))(params, kv_pages, batch)
    return np.asarray(jax.jit(make_logits_fn(cfg))(params, hidden[jnp.asarray(positions)]))


@pytest.mark.slow
def test_smollm2_logits_match_float64_numpy_reference():
    from checkpoints.embedded import smollm2_path

    cfg, arrays, reader = load_gguf(smollm2_path())
    tokens = [int(t) for t in np.random.default_rng(0).integers(100, cfg.vocab_size, 32)]
    ours = _jax_logits(cfg, arrays, tokens)
    ref = reference_logits(reader, tokens)
    assert np.abs(ours[-1] - ref[-1]).max() < 1e-3
    assert np.abs(ours - ref).max() < 1e-3
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.slow
def test_gemma3_logits_match_reference_and_sliding_window_matters():
    # About 4 GB of its own (262K-token vocabulary, float64 reference weights): in a worker that
    # already holds earlier tests' memory it would pass the 8 GB bound.
    run_in_fresh_process(__file__, "check_gemma3_logits_and_sliding_window")


def check_gemma3_logits_and_sliding_window():
    from checkpoints.embedded import gemma3_path

    cfg, arrays, reader = load_gguf(gemma3_path())
    assert cfg.sliding_window == 512 and cfg.layer_types.count("full_attention") == 3
    rng = np.random.default_rng(1)
    tokens = [2] + [int(t) for t in rng.integers(300, cfg.vocab_size, 599)]  # longer than the window
    # Every page boundary (16 tokens), the window's edge and the last token: the LM head over a
    # 262K vocabulary at all 600 positions would cost more than the whole forward.
    positions = sorted({*range(0, len(tokens), 8), *range(15, len(tokens), 16), 510, 511, 512, 513, len(tokens) - 1})
    ours = _jax_logits(cfg, arrays, tokens, positions=positions)
    del arrays  # the float32 weights go before the float64 reference is read
    weights = reference_weights(reader)
    ref = reference_logits(reader, tokens, weights=weights, positions=positions)
    assert np.abs(ours[-1] - ref[-1]).max() < 1e-3
    assert np.abs(ours - ref).max() < 1e-3
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    ref_full = reference_logits(reader, tokens, sliding=False, weights=weights, positions=positions)
    # inside the window both agree; past it the window changes the result
    inside = [i for i, position in enumerate(positions) if position < 512]
    assert np.abs(ref_full[inside] - ref[inside]).max() < 1e-9
    assert np.abs(ref_full[-1] - ref[-1]).max() > 1e-2
