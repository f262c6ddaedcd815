"""Sampling controls over one step's logits [B, V]: temperature, min_p, top_k, top_p, greedy.

Every truncation used here keeps an *upper set* of the temperature-scaled logits `z = logits / T`,
so the whole pipeline (vLLM's order: temperature -> min_p -> top_k -> top_p, each on the
renormalised result of the previous) reduces to one threshold per row: token i is kept iff
`z_i >= threshold`. A token is then drawn by inverting the CDF of softmax(z[kept]) with one
uniform number per row (block masses, then one block's entries: two passes over the vocabulary, no
per-token random numbers, which cost more than the rest of the step's sampling together on an
H200), and the logprob is `z_tok - logsumexp(z[kept])`. The default path (top_p = 1, top_k = 0,
min_p = 0) does no sort and no top-k at all.

Definitions (ties are treated symmetrically: equal logits are all kept or all dropped):
  * min_p: keep p_i >= min_p * max_j p_j.
  * top_k: keep z_i >= the k-th largest z (vLLM/HF keep ties with the k-th as well).
  * top_p: keep token i iff the probability mass of tokens strictly more likely than i is < top_p
    (the smallest prefix of the sorted distribution whose mass reaches top_p; as vLLM/HF).
top_p without top_k looks only at the `top_p_candidates` largest logits (`lax.top_k`), which is
exact whenever the nucleus ends inside them (checked per step); otherwise that step falls back to
a full sort, so the result is always exact.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

LogprobsMode = Literal["processed", "raw"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Static (hashable) sampling settings; each distinct value compiles its own program.

    Attributes:
      temperature: > 0; logits are divided by it before any truncation.
      top_k: keep the k most likely tokens (0 = off).
      top_p: nucleus mass in (0, 1] (1 = off).
      min_p: keep tokens whose probability is >= min_p * the top probability (0 = off).
      greedy: argmax decoding; temperature and truncation are then ignored.
      logprobs: "processed" = log-probability under the distribution actually sampled from
        (temperature-scaled and truncated, vLLM's processed_logprobs); "raw" = log_softmax of the
        unscaled, untruncated logits. Greedy always reports log_softmax(logits).
      top_p_candidates: how many top logits the top_p path inspects before falling back to a sort.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    greedy: bool = False
    logprobs: LogprobsMode = "processed"
    top_p_candidates: int = 256

    def __post_init__(self):
        if not self.greedy and not self.temperature > 0:
            raise ValueError(
                f"temperature must be > 0 (got {self.temperature}); for argmax decoding pass greedy=True"
            )
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p}")
        if self.logprobs not in ("processed", "raw"):
            raise ValueError(f"logprobs must be 'processed' or 'raw', got {self.logprobs!r}")
        if self.top_p_candidates < 1:
            raise ValueError(f"top_p_candidates must be >= 1, got {self.top_p_candidates}")

    @property
    def truncates(self) -> bool:
        """Whether any truncation (min_p, top_k, top_p) is active."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)


def sample_tokens(
    logits: jax.Array, key: jax.Array, params: SamplingParams, *, uniform: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row of `logits` [B, V] (float32 preferred).

    uniform: float32 [B] in [0, 1), the rows' random numbers (default `jax.random.uniform(key, [B])`).
    Returns (tokens int32 [B], logprobs float32 [B]); see `SamplingParams.logprobs` for which
    distribution the logprobs refer to.
    """
    logits = logits.astype(jnp.float32)  # no-op for float32 logits; fused into consumers otherwise
    if params.greedy:
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return tokens, _token_logprob(logits, tokens, logits_normalizer(logits))
    z = logits / params.temperature
    if params.truncates:
        threshold = truncation_threshold(z, params)
        z = jnp.where(z >= threshold, z, -jnp.inf)
    tokens, normalizer = draw(z, key, uniform=uniform)
    if params.logprobs == "raw":
        return tokens, _token_logprob(logits, tokens, logits_normalizer(logits))
    return tokens, _token_logprob(z, tokens, normalizer)


def draw(z: jax.Array, key: jax.Array, block: int = 128, *,
         uniform: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """One token per row of scaled logits `z` [B, V] (-inf = dropped) from softmax(z), by inverse CDF.

    A uniform u in [0, total mass) (`uniform` [B] in [0, 1) times the mass; default from `key`) picks the block
    of `block` tokens whose cumulative mass first exceeds u, then the token inside it. Returns (tokens int32 [B], logsumexp(z) [B]).
    """
    batch, vocab = z.shape
    blocks = -(-vocab // block)
    top = jnp.max(z, axis=-1, keepdims=True)
    padded = jnp.pad(z, ((0, 0), (0, blocks * block - vocab)), constant_values=-jnp.inf)
    mass = jnp.exp(padded - top).reshape(batch, blocks, block)  # unnormalised probabilities
    block_mass = mass.sum(axis=-1)
    cumulative = jnp.cumsum(block_mass, axis=-1)
    total = cumulative[:, -1]
    if uniform is None:
        uniform = jax.random.uniform(key, (batch,), jnp.float32)
    target = uniform * total
    chosen = _first_above(cumulative, target, block_mass > 0)
    inside = jnp.take_along_axis(mass, chosen[:, None, None], axis=1)[:, 0]  # [B, block]
    before = jnp.take_along_axis(cumulative - block_mass, chosen[:, None], axis=1)[:, 0]
    offset = _first_above(jnp.cumsum(inside, axis=-1), target - before, inside > 0)
    return (chosen * block + offset).astype(jnp.int32), top[:, 0] + jnp.log(total)


def _first_above(cumulative: jax.Array, target: jax.Array, nonzero: jax.Array) -> jax.Array:
    """Per row, the first index whose nondecreasing `cumulative` [B, N] exceeds `target` [B]; when rounding
    leaves none above, the last index with nonzero mass (so a dropped token is never chosen)."""
    first = jnp.sum(cumulative <= target[:, None], axis=-1)
    last_nonzero = cumulative.shape[-1] - 1 - jnp.argmax(nonzero[:, ::-1], axis=-1)
    return jnp.minimum(first, last_nonzero)


def logits_normalizer(z: jax.Array) -> jax.Array:
    """logsumexp over the last axis, [B, V] -> [B] (-inf entries are dropped)."""
    return jax.nn.logsumexp(z, axis=-1)


def _token_logprob(z: jax.Array, tokens: jax.Array, normalizer: jax.Array) -> jax.Array:
    return jnp.take_along_axis(z, tokens[:, None], axis=-1)[:, 0] - normalizer


def truncation_threshold(z: jax.Array, params: SamplingParams) -> jax.Array:
    """Per-row threshold [B, 1] on scaled logits `z` [B, V]: the kept set is `z >= threshold`."""
    threshold = jnp.full((z.shape[0], 1), -jnp.inf, jnp.float32)
    if params.min_p > 0.0:
        threshold = jnp.max(z, axis=-1, keepdims=True) + jnp.log(jnp.float32(params.min_p))
    if params.top_k == 0 and params.top_p == 1.0:
        return threshold
    vocab = z.shape[-1]
    k = min(params.top_k, vocab) if params.top_k > 0 else min(params.top_p_candidates, vocab)
    candidates = jax.lax.top_k(z, k)[0]  # [B, k], descending
    if params.top_k > 0:
        threshold = jnp.maximum(threshold, candidates[:, -1:])
    if params.top_p == 1.0:
        return threshold
    normalizer = logits_normalizer(jnp.where(z >= threshold, z, -jnp.inf))[:, None]
    nucleus, exact = _nucleus_threshold(candidates, threshold, normalizer, params.top_p)
    if params.top_k > 0 or k == vocab:
        return nucleus  # the candidates hold the whole kept set: always exact
    return jax.lax.cond(
        jnp.all(exact),
        lambda: nucleus,
        lambda: _nucleus_threshold(-jnp.sort(-z, axis=-1), threshold, normalizer, params.top_p)[0],
    )


def _nucleus_threshold(
    sorted_desc: jax.Array, threshold: jax.Array, normalizer: jax.Array, top_p: float
) -> tuple[jax.Array, jax.Array]:
    """Top-p threshold from the largest scaled logits `sorted_desc` [B, K] (descending).

    Among candidates, the mass of tokens strictly above candidate r is computable exactly (all of
    them are candidates), and the exclusive cumulative sum equals it at the first element of each
    tie group, so `min{c_r : excl_r < top_p}` is the nucleus threshold. Returns it with a per-row
    flag that is True when the last candidate is dropped, i.e. the nucleus ended inside the
    candidates and no token outside them can be kept.
    """
    kept_so_far = sorted_desc >= threshold
    probs = jnp.where(kept_so_far, jnp.exp(sorted_desc - normalizer), 0.0)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    in_nucleus = kept_so_far & (mass_before < top_p)
    nucleus = jnp.min(jnp.where(in_nucleus, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.maximum(threshold, nucleus), ~in_nucleus[:, -1]
