"""Tests of corl_jax.sampling: sampling controls, the generation engine, and its parity with transformers."""

import re

import numpy as np
import pytest
import scipy.stats

import jax
import jax.numpy as jnp

from corl_jax.sampling.controls import SamplingParams, sample_tokens, truncation_threshold


# ----------------------------------------------------------------------------------------------
# Sampling controls on raw logits.
# ----------------------------------------------------------------------------------------------


def reference_kept_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """vLLM's processing written out literally in float64: temperature, min_p, top_k, top_p.

    Returns the renormalised distribution actually sampled from, one row per row of `logits`.
    """
    z = logits.astype(np.float64) / p.temperature
    out = np.empty_like(z)
    for b, row in enumerate(z):
        row = row.copy()
        if p.min_p > 0:
            probs = np.exp(row - row.max())
            probs /= probs.sum()
            row[probs < p.min_p * probs.max()] = -np.inf
        if p.top_k > 0:
            kth = np.sort(row)[::-1][min(p.top_k, row.size) - 1]
            row[row < kth] = -np.inf
        if p.top_p < 1:
            order = np.argsort(row, kind="stable")  # ascending, as vLLM
            probs = np.exp(row[order] - row.max())
            probs /= probs.sum()
            drop = np.cumsum(probs) <= 1 - p.top_p
            drop[-1] = False
            row[order[drop]] = -np.inf
        probs = np.exp(row - row.max())
        out[b] = probs / probs.sum()
    return out


PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=0.8, top_p=0.7),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.9, top_k=12, top_p=0.8, min_p=0.02),
    # few candidates: most rows overflow them, so the exact sort fallback runs
    SamplingParams(temperature=2.0, top_p=0.95, top_p_candidates=4),
]


@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_kept_set_matches_vllm_definition(params):
    logits = np.asarray(jax.random.normal(jax.random.key(0), (64, 97)) * 3.0, np.float32)
    want = reference_kept_probs(logits, params) > 0
    z = jnp.asarray(logits) / params.temperature
    got = np.asarray(z >= truncation_threshold(z, params))
    np.testing.assert_array_equal(got, want)


def test_top_p_ties_are_kept_or_dropped_together():
    # Probabilities 0.4, 0.2, 0.2, 0.2: top_p=0.5 needs one of the tied 0.2s; all three are kept.
    logits = jnp.log(jnp.array([[0.4, 0.2, 0.2, 0.2], [0.2, 0.2, 0.4, 0.2]]))
    for candidates in (1, 2, 4):
        params = SamplingParams(top_p=0.5, top_p_candidates=candidates)
        kept = np.asarray(logits >= truncation_threshold(logits, params))
        np.testing.assert_array_equal(kept, np.ones((2, 4), bool))
    kept = np.asarray(logits >= truncation_threshold(logits, SamplingParams(top_p=0.3)))
    np.testing.assert_array_equal(kept, [[1, 0, 0, 0], [0, 0, 1, 0]])


@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_token_frequencies_match_truncated_softmax(params):
    """Chi-square goodness of fit of many draws from one logits row (fixed seed)."""
    vocab, draws = 24, 40_000
    logits = np.asarray(jax.random.normal(jax.random.key(1), (1, vocab)) * 1.5, np.float32)
    want = reference_kept_probs(logits, params)[0]
    tokens, logprobs = jax.jit(sample_tokens, static_argnums=2)(
        jnp.broadcast_to(jnp.asarray(logits), (draws, vocab)), jax.random.key(2), params
    )
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    assert np.all(want[tokens] > 0), "sampled a token outside the truncated set"
    np.testing.assert_allclose(logprobs, np.log(want[tokens]), atol=1e-5)
    counts = np.bincount(tokens, minlength=vocab)
    kept = want > 0
    result = scipy.stats.chisquare(counts[kept], draws * want[kept])
    assert result.pvalue > 1e-3, (result, counts, draws * want)


def test_sampling_depends_only_on_the_key():
    logits = jax.random.normal(jax.random.key(3), (8, 50))
    params = SamplingParams(temperature=0.7, top_p=0.9)
    a = sample_tokens(logits, jax.random.key(4), params)[0]
    b = sample_tokens(logits, jax.random.key(4), params)[0]
    c = sample_tokens(logits, jax.random.key(5), params)[0]
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_greedy_and_raw_logprobs():
    logits = jax.random.normal(jax.random.key(6), (5, 40)) * 2
    log_softmax = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    tokens, logprobs = sample_tokens(logits, jax.random.key(0), SamplingParams(greedy=True))
    np.testing.assert_array_equal(tokens, np.argmax(np.asarray(logits), axis=-1))
    np.testing.assert_allclose(logprobs, log_softmax[np.arange(5), tokens], atol=1e-6)
    params = SamplingParams(temperature=0.5, top_k=3, logprobs="raw")
    tokens, logprobs = sample_tokens(logits, jax.random.key(0), params)
    np.testing.assert_allclose(logprobs, log_softmax[np.arange(5), tokens], atol=1e-6)


def test_default_path_has_no_sort_or_top_k():
    def ops(params):
        text = jax.jit(sample_tokens, static_argnums=2).lower(
            jnp.zeros((4, 1000)), jax.random.key(0), params
        ).as_text()
        return set(re.findall(r"(?:stablehlo|chlo)\.(sort|top_k)\b", text))

    assert ops(SamplingParams()) == set()
    assert ops(SamplingParams(temperature=0.5, min_p=0.1)) == set()
    assert ops(SamplingParams(top_k=10)) == {"top_k"}
    assert ops(SamplingParams(top_p=0.9)) == {"top_k", "sort"}  # the sort is the fallback branch


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=0.0), "greedy=True"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(logprobs="sampled"), "logprobs"),
    ],
)
def test_bad_params_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
