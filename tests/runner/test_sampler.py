"""The device sampler's penalties and log probabilities on hand-computed logits (no model)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from agentjax.runner.extras import RowPenalties, penalty_inputs
from agentjax.runner.sampler import (
    SamplingMetadata,
    apply_penalties,
    gather_logprobs,
    log_probabilities,
    sample_tokens_and_logits,
)

LOGITS = np.array([[2.0, 1.0, -1.0, 0.5, 3.0, -2.0]], np.float32)


def penalties(presence=0.0, frequency=0.0, repetition=1.0, outputs=(), prompt=(), bias=None) -> RowPenalties:
    """The engine's table layout: prompt tokens (seen, no count), output tokens with counts, bias entries."""
    counts: dict[int, int] = {}
    for token in outputs:
        counts[token] = counts.get(token, 0) + 1
    bias = bias or {}
    ids = [*prompt, *counts, *bias]
    return RowPenalties(
        presence, frequency, repetition, np.array(ids, np.int32),
        np.array([0] * len(prompt) + list(counts.values()) + [0] * len(bias), np.int32),
        np.array([1] * (len(prompt) + len(counts)) + [0] * len(bias), np.int32),
        np.array([0.0] * (len(prompt) + len(counts)) + list(bias.values()), np.float32))


def penalized(logits: np.ndarray, row: RowPenalties, num_rows: int = 1) -> np.ndarray:
    table = penalty_inputs(num_rows, {0: row})
    padded = np.zeros((num_rows, logits.shape[1]), np.float32)
    padded[0] = logits[0]
    return np.asarray(apply_penalties(jnp.asarray(padded), table))[0]


def test_frequency_penalty_subtracts_the_penalty_times_each_tokens_repeats():
    # token 4 generated 3 times, token 0 twice, token 2 once
    out = penalized(LOGITS, penalties(frequency=1.0, outputs=[4, 0, 4, 2, 4, 0]))
    expected = LOGITS[0] - 1.0 * np.array([2, 0, 1, 0, 3, 0])  # [0, 1, -2, 0.5, 0, -2]
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-6)
    assert out[4] == pytest.approx(3.0 - 3.0) and out.argmax() == 1  # the greedy pick moves to a fresh token


def test_presence_penalty_subtracts_once_per_generated_token_whatever_its_count():
    out = penalized(LOGITS, penalties(presence=0.75, outputs=[4, 4, 4, 1]))
    expected = LOGITS[0] - 0.75 * np.array([0, 1, 0, 0, 1, 0])
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-6)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output_tokens():
    out = penalized(LOGITS, penalties(repetition=2.0, prompt=[0, 2], outputs=[5]))
    expected = LOGITS[0].copy()
    expected[0] = 2.0 / 2.0  # positive, in the prompt
    expected[2] = -1.0 * 2.0  # negative, in the prompt
    expected[5] = -2.0 * 2.0  # negative, in the output
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-6)


def test_logit_bias_of_minus_100_bans_the_greedy_token_and_plus_bias_promotes_another():
    out = penalized(LOGITS, penalties(bias={4: -100.0, 5: 4.5}))
    expected = LOGITS[0].copy()
    expected[4] -= 100.0
    expected[5] += 4.5
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-5)
    assert int(out.argmax()) == 5


def test_penalties_apply_in_vllms_order_bias_then_repetition_then_frequency_and_presence():
    # token 3: logit 0.5, bias +1.5 -> 2.0, repetition 4 -> 0.5, frequency 0.25 x 2 -> 0.0, presence 0.5 -> -0.5
    out = penalized(LOGITS, penalties(presence=0.5, frequency=0.25, repetition=4.0, outputs=[3, 3], bias={3: 1.5}))
    assert out[3] == pytest.approx(-0.5, abs=1e-6)


def test_rows_without_penalties_keep_their_logits_bit_for_bit():
    logits = np.random.default_rng(0).normal(size=(8, 50)).astype(np.float32)
    table = penalty_inputs(8, {3: penalties(frequency=1.0, outputs=[7, 7])})
    out = np.asarray(apply_penalties(jnp.asarray(logits), table))
    assert np.array_equal(np.delete(out, 3, axis=0), np.delete(logits, 3, axis=0))
    assert out[3, 7] == pytest.approx(logits[3, 7] - 2.0)


def test_gather_logprobs_gives_value_rank_and_top_tokens_best_first():
    values = np.asarray(log_probabilities(jnp.asarray(LOGITS)))
    chosen, ranks, top_ids, top_values = (np.asarray(a) for a in gather_logprobs(jnp.asarray(values),
                                                                                 jnp.array([3]), 3))
    expected = LOGITS[0] - np.log(np.exp(LOGITS[0]).sum())
    assert chosen[0] == pytest.approx(expected[3], abs=1e-6)
    assert ranks[0] == 4  # 3.0, 2.0 and 1.0 beat 0.5
    assert top_ids[0].tolist() == [4, 0, 1]
    np.testing.assert_allclose(top_values[0], expected[[4, 0, 1]], atol=1e-6)
    assert np.exp(top_values).sum() <= 1.0


def test_processed_logits_are_the_inputs_for_greedy_rows_and_temperature_scaled_for_drawn_rows():
    logits = np.tile(LOGITS, (2, 1))
    meta = SamplingMetadata.greedy(2, logits.shape[1])
    meta.temperature[1] = 2.0
    meta.seeds[1] = 7
    tokens, processed = (np.asarray(a) for a in sample_tokens_and_logits(jnp.asarray(logits), meta))
    assert tokens[0] == 4
    np.testing.assert_array_equal(processed[0], LOGITS[0])
    np.testing.assert_allclose(processed[1], LOGITS[0] / 2.0, atol=1e-6)
