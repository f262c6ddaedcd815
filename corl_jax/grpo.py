"""GRPO core, independent of the model: token log-probs, advantages, losses, accumulation.

Everything here works on the decoder's final hidden states ``[B, T, D]`` and the unembedding
matrix ``W [D, V]`` (logits = hidden @ W), so it never sees model code. Formulas follow the
reference's TRL fork (co_rl_reference.md §1.10, §4.3, §5.4); all functions are jit-friendly
(configuration arguments are static Python values, arrays carry explicit dtypes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_MODES = ("group", "batch", "none")
INTRINSIC_KINDS = ("entropy", "self_certainty")
STD_EPS = 1e-4  # the reference's denominator epsilon: A = (r - mean) / (std + 1e-4)


# ----------------------------------------------------------------------------- log-probs


def token_logprobs(
    hidden: jax.Array,
    unembedding: jax.Array,
    targets: jax.Array,
    *,
    temperature: float = 1.0,
    chunk_size: int = 128,
    with_stats: bool = False,
):
    """log p(target) per position, in sequence chunks so [B, T, V] logits never exist at once.

    Args:
      hidden: [B, T, D] final-normed hidden states (any float dtype).
      unembedding: [D, V]; logits = hidden @ unembedding / temperature, accumulated in fp32.
      targets: [B, T] integer token ids scored at each position.
      temperature: logits divisor (the reference divides by the sampling temperature, 1.0).
      chunk_size: positions per chunk; peak memory is about B * chunk_size * V fp32 values.
      with_stats: also return the per-token entropy H = -sum_v p log p and the mean log-prob
        over the full vocabulary (mean_v log p_v), from the same pass.

    Returns:
      float32 [B, T] log-probs, or the tuple (logp, entropy, mean_logp) of [B, T] arrays.
      Each chunk is rematerialised in the backward pass (jax.checkpoint), so differentiating
      (w.r.t. hidden and unembedding, stats included) also stores no more than one chunk.
    """
    if hidden.ndim != 3 or targets.shape != hidden.shape[:2]:
        raise ValueError(f"hidden must be [B, T, D] and targets [B, T]; got {hidden.shape} and {targets.shape}")
    if unembedding.ndim != 2 or unembedding.shape[0] != hidden.shape[2]:
        raise ValueError(f"unembedding must be [D, V] with D={hidden.shape[2]}; got {unembedding.shape}")
    if chunk_size < 1 or temperature <= 0:
        raise ValueError(f"need chunk_size >= 1 and temperature > 0; got {chunk_size}, {temperature}")
    batch, length, dim = hidden.shape
    chunk_size = min(chunk_size, length)
    num_chunks = -(-length // chunk_size)
    pad = num_chunks * chunk_size - length

    def to_chunks(x):  # [B, T, ...] -> [num_chunks, B, chunk, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.swapaxes(x.reshape(batch, num_chunks, chunk_size, *x.shape[2:]), 0, 1)

    @jax.checkpoint
    def chunk_fn(h, y):
        logits = jnp.einsum("bcd,dv->bcv", h, unembedding, preferred_element_type=jnp.float32)
        logits = logits / jnp.float32(temperature)
        lse = jax.nn.logsumexp(logits, axis=-1)
        logp = jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0] - lse
        if not with_stats:
            return (logp,)
        probs = jnp.exp(logits - lse[..., None])
        entropy = lse - jnp.sum(probs * logits, axis=-1)
        mean_logp = jnp.mean(logits, axis=-1) - lse
        return logp, entropy, mean_logp

    outs = jax.lax.map(lambda xs: chunk_fn(*xs), (to_chunks(hidden), to_chunks(targets.astype(jnp.int32))))
    outs = tuple(jnp.swapaxes(o, 0, 1).reshape(batch, num_chunks * chunk_size)[:, :length] for o in outs)
    return outs if with_stats else outs[0]


# ----------------------------------------------------------------------------- sampler correction


def sampling_correction(
    old_logp: jax.Array, sampling_logp: jax.Array, mask: jax.Array, cap: float = 3.0
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """TRL's ``token_truncate`` importance weight of the sampler's tokens under the trainer's forward.

    rho = min(exp((old_logp - sampling_logp) * mask), cap) per token (1 on masked positions), a constant
    (no gradient). ``old_logp`` is the trainer's no-grad log-prob of the sampled token, ``sampling_logp``
    the sampler's (the reference: vLLM's processed log-probs). Also returns TRL's metrics over the masked
    tokens: sampling/sampling_logp_difference/{mean,max} (|old - sampler|) and
    sampling/importance_sampling_ratio/{min,mean,max} (0 when no token is masked in).
    """
    live = mask.astype(bool)
    diff = jnp.where(live, old_logp - sampling_logp, 0.0).astype(jnp.float32)
    ratio = jax.lax.stop_gradient(jnp.minimum(jnp.exp(diff), jnp.float32(cap)))
    count = jnp.maximum(jnp.sum(live), 1)
    any_live = jnp.any(live)
    gap = jnp.abs(diff)
    metrics = {
        "sampling/sampling_logp_difference/mean": jnp.sum(gap) / count,
        "sampling/sampling_logp_difference/max": jnp.max(gap),
        "sampling/importance_sampling_ratio/min": jnp.where(any_live, jnp.min(jnp.where(live, ratio, jnp.inf)), 0.0),
        "sampling/importance_sampling_ratio/mean": jnp.sum(jnp.where(live, ratio, 0.0)) / count,
        "sampling/importance_sampling_ratio/max": jnp.where(any_live, jnp.max(jnp.where(live, ratio, -jnp.inf)), 0.0),
    }
    return ratio, jax.lax.stop_gradient(metrics)


# ----------------------------------------------------------------------------- rewards


def _grouped(rewards: jax.Array, num_generations: int) -> jax.Array:
    if rewards.ndim == 2 and rewards.shape[1] != num_generations:
        raise ValueError(f"rewards [P, G] has G={rewards.shape[1]} but num_generations={num_generations}")
    if rewards.ndim not in (1, 2) or rewards.size % num_generations:
        raise ValueError(
            f"rewards must be [N] with N a multiple of num_generations={num_generations}, or [P, G]; "
            f"got shape {rewards.shape}"
        )
    return rewards.astype(jnp.float32).reshape(-1, num_generations)


def _unbiased_std(x: jax.Array, axis=None) -> jax.Array:
    """torch.std (ddof=1); 0 where there is a single element, as TRL does."""
    count = x.size if axis is None else x.shape[axis]
    return jnp.std(x, axis=axis, ddof=1) if count > 1 else jnp.zeros_like(jnp.mean(x, axis=axis))


def group_advantages(
    rewards: jax.Array, num_generations: int, *, scale: str = "group", eps: float = STD_EPS
) -> jax.Array:
    """GRPO advantages A = (r - mean_group) / (std + eps), float32, same shape as ``rewards``.

    ``rewards`` is [N] (consecutive runs of ``num_generations`` rollouts of one prompt) or
    [P, G]. ``scale``: "group" = unbiased std of the prompt's G rewards (the reference);
    "batch" = unbiased std over all rewards; "none" = no division. Groups whose rewards are all
    equal get A = 0.
    """
    if scale not in SCALE_MODES:
        raise ValueError(f"scale must be one of {SCALE_MODES}; got {scale!r}")
    grouped = _grouped(rewards, num_generations)
    centred = grouped - jnp.mean(grouped, axis=1, keepdims=True)
    if scale == "group":
        centred = centred / (_unbiased_std(grouped, axis=1)[:, None] + eps)
    elif scale == "batch":
        centred = centred / (_unbiased_std(grouped) + eps)
    return centred.reshape(rewards.shape)


def reward_metrics(rewards: jax.Array, num_generations: int, name: str = "reward_correctness") -> dict[str, jax.Array]:
    """TRL's reward, reward_std (unbiased, whole batch), frac_reward_zero_std (per group) and the per-function
    rewards/<name>/mean|std (the reference has one reward function, so they repeat reward / reward_std)."""
    grouped = _grouped(rewards, num_generations)
    group_std = _unbiased_std(grouped, axis=1)
    mean, std = jnp.mean(grouped), _unbiased_std(grouped)
    return {
        "reward": mean,
        "reward_std": std,
        "frac_reward_zero_std": jnp.mean((jnp.abs(group_std) <= 1e-8).astype(jnp.float32)),
        f"rewards/{name}/mean": mean,
        f"rewards/{name}/std": std,
    }


def intrinsic_rewards(
    entropy: jax.Array, mean_logp: jax.Array, mask: jax.Array, vocab_size: int, kind: str = "entropy"
) -> jax.Array:
    """Per-sequence intrinsic reward [B] of the RENT / Intuitor baselines (§4.3).

    kind="entropy" (RENT): r = -mean_t H_t. kind="self_certainty" (Intuitor):
    r = mean_t KL(U || p_t) with KL = -log V - mean_v log p_v, V = ``vocab_size`` (the full,
    padded unembedding width). Means run over masked tokens; an empty completion gets 0.
    """
    if kind not in INTRINSIC_KINDS:
        raise ValueError(f"kind must be one of {INTRINSIC_KINDS}; got {kind!r}")
    per_token = -entropy if kind == "entropy" else -math.log(vocab_size) - mean_logp
    mask = mask.astype(jnp.float32)
    count = jnp.sum(mask, axis=-1)
    total = jnp.sum(per_token.astype(jnp.float32) * mask, axis=-1)
    return jnp.where(count > 0, total / jnp.maximum(count, 1.0), 0.0)


# ----------------------------------------------------------------------------- loss


def grpo_loss(
    logp: jax.Array,
    old_logp: jax.Array | None,
    advantages: jax.Array,
    mask: jax.Array,
    row_weights: jax.Array,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    beta: float = 0.0,
    ref_logp: jax.Array | None = None,
    is_ratio: jax.Array | None = None,
    entropy: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped GRPO surrogate of B rows: their share sum_rows w * sum_t m l of the step loss.

    Per token: l = -min(c A, clip(c, 1 - eps_low, 1 + eps_high) A) * is_ratio + beta * k3 with
    c = exp(logp - old_logp) (old_logp=None: stop_gradient(logp), i.e. c == 1) and
    k3 = exp(ref - logp) - (ref - logp) - 1; m is the mask. ``row_weights`` [B] come from ``loss_row_weights`` of
    the whole step's mask and carry the loss type's normalisation (the reference's TRL aggregation), so summed over
    micro-batches of any rows, in any order and of any trimmed width (``accumulate_grads``), it is the reference's
    step loss.

    Returns (float32 loss, row sums): per row [B], the masked token sums ``tokens`` (sum m),
    ``clip_ratio/low``, ``clip_ratio/high``, ``clip_ratio/region`` (TRL: c below 1 - eps_low with
    A < 0, above 1 + eps_high with A > 0, either), ``kl`` (beta != 0) and ``entropy`` (when given);
    ``loss_metrics`` turns them into TRL's metrics.
    """
    if beta != 0.0 and ref_logp is None:
        raise ValueError("beta != 0 needs ref_logp (log-probs of the frozen reference policy)")
    if advantages.shape != logp.shape[:1] or mask.shape != logp.shape or row_weights.shape != logp.shape[:1]:
        raise ValueError(f"need logp, mask [B, T], advantages and row_weights [B]; got {logp.shape}, {mask.shape}, "
                         f"{advantages.shape}, {row_weights.shape}")

    mask = mask.astype(jnp.float32)
    old_logp = jax.lax.stop_gradient(logp) if old_logp is None else old_logp
    ratio = jnp.exp(logp - old_logp)
    adv = advantages.astype(jnp.float32)[:, None]
    per_token = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv)
    if is_ratio is not None:
        per_token = per_token * is_ratio
    low = ((ratio < 1.0 - eps_low) & (adv < 0)).astype(jnp.float32)
    high = ((ratio > 1.0 + eps_high) & (adv > 0)).astype(jnp.float32)
    per_row = lambda x: jnp.sum(x * mask, axis=1)
    rows = {"tokens": jnp.sum(mask, axis=1), "clip_ratio/low": per_row(low), "clip_ratio/high": per_row(high),
            "clip_ratio/region": per_row(jnp.maximum(low, high))}
    if beta != 0.0:
        log_ref_ratio = ref_logp - logp
        kl = jnp.exp(log_ref_ratio) - log_ref_ratio - 1.0
        per_token = per_token + beta * kl
        rows["kl"] = per_row(kl)
    if entropy is not None:
        rows["entropy"] = per_row(entropy)
    loss = jnp.sum(per_row(per_token) * row_weights.astype(jnp.float32))
    return loss.astype(jnp.float32), jax.lax.stop_gradient(rows)


def loss_row_weights(
    mask: jax.Array,
    *,
    loss_type: str,
    group_size: int,
    max_completion_length: int,
) -> jax.Array:
    """Per-row weights w [N] of a whole step's loss mask [N, Tc] (rows in reference micro-batch order) such that
    the step loss of ``grpo_loss`` is sum_rows w * sum_t m l for every loss type:
      grpo: 1 / (N max(1, sum_t m)); bnpo: 1 / ((N / group_size) max(1, sum m of the row's group of
      ``group_size`` consecutive rows)); dr_grpo: 1 / (N max_completion_length); dapo: 1 / max(1, sum m).
    The weights fix which rows are normalised together, so the rows may then be regrouped or reordered freely.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}; got {loss_type!r}")
    rows = mask.shape[0]
    if rows % group_size:
        raise ValueError(f"group_size={group_size} must divide the batch ({rows} rows)")
    tokens = jnp.sum(mask.astype(jnp.float32), axis=1)
    if loss_type == "grpo":
        return 1.0 / (rows * jnp.maximum(tokens, 1.0))
    if loss_type == "bnpo":
        group_tokens = jnp.repeat(tokens.reshape(-1, group_size).sum(axis=1), group_size)
        return 1.0 / ((rows // group_size) * jnp.maximum(group_tokens, 1.0))
    if loss_type == "dr_grpo":
        return jnp.full((rows,), 1.0 / (rows * max_completion_length), jnp.float32)
    return jnp.full((rows,), 1.0, jnp.float32) / jnp.maximum(jnp.sum(tokens), 1.0)


def loss_metrics(rows: dict[str, jax.Array], group_size: int) -> dict[str, jax.Array]:
    """TRL's loss metrics from ``grpo_loss``'s row sums [N] of a whole step.

    TRL takes masked token means per micro-batch (``group_size`` rows each), then the mean over micro-batches
    (and ranks); ``clip_ratio/low_min`` / ``clip_ratio/high_max`` are its min / max across ranks, here across
    the step's micro-batches. Micro-batches without tokens are skipped (TRL's nanmean); 0 if all are empty.
    """
    groups = {k: v.reshape(-1, group_size).sum(axis=1) for k, v in rows.items()}
    tokens = groups.pop("tokens")
    live = tokens > 0
    means = {k: v / jnp.maximum(tokens, 1.0) for k, v in groups.items()}
    any_live = jnp.any(live)
    mean = lambda x: jnp.sum(jnp.where(live, x, 0.0)) / jnp.maximum(jnp.sum(live), 1)
    out = {
        "clip_ratio/low_mean": mean(means["clip_ratio/low"]),
        "clip_ratio/low_min": jnp.where(any_live, jnp.min(jnp.where(live, means["clip_ratio/low"], jnp.inf)), 0.0),
        "clip_ratio/high_mean": mean(means["clip_ratio/high"]),
        "clip_ratio/high_max": jnp.where(any_live, jnp.max(jnp.where(live, means["clip_ratio/high"], -jnp.inf)),
                                         0.0),
        "clip_ratio/region_mean": mean(means["clip_ratio/region"]),
    }
    out.update({k: mean(means[k]) for k in ("kl", "entropy") if k in means})
    return out


# ----------------------------------------------------------------------------- accumulation


def accumulate_grads(
    loss_and_grad_fn: Callable[[Any, Any], tuple[tuple[jax.Array, Any], Any]],
    params: Any,
    batch: Any,
    num_micro: int,
) -> tuple[tuple[jax.Array, Any], Any]:
    """Sum losses and gradients over ``num_micro`` equal micro-batches with one ``lax.scan``.

    ``batch`` is a pytree of arrays sharing a leading row axis B, cut into ``num_micro`` consecutive
    micro-batches of B / num_micro rows. ``loss_and_grad_fn(params, micro_batch)`` returns
    ``((loss, row_aux), grads)`` (``jax.value_and_grad(..., has_aux=True)`` of ``grpo_loss``-style losses,
    whose row weights refer to the whole batch, so the sum is the step loss).
    Returns ((summed loss, row_aux of all B rows in batch order), summed grads in params' dtypes).
    """
    leaves = jax.tree.leaves(batch)
    num_rows = leaves[0].shape[0]
    if any(x.shape[:1] != (num_rows,) for x in leaves):
        raise ValueError(f"all batch arrays need the same leading row axis; got {[x.shape for x in leaves]}")
    if num_micro < 1 or num_rows % num_micro:
        raise ValueError(f"num_micro={num_micro} does not split {num_rows} rows into equal micro-batches; "
                         f"choose a divisor of {num_rows}")
    micro_batches = jax.tree.map(lambda x: x.reshape(num_micro, num_rows // num_micro, *x.shape[1:]), batch)

    def step(carry, micro):
        grad_sum, loss_sum = carry
        (loss, aux), grads = loss_and_grad_fn(params, micro)
        grad_sum = jax.tree.map(lambda s, g: s + g.astype(s.dtype), grad_sum, grads)
        return (grad_sum, loss_sum + loss.astype(jnp.float32)), aux

    init = (jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32))
    (grads, loss), aux = jax.lax.scan(step, init, micro_batches)
    return (loss, jax.tree.map(lambda a: a.reshape(num_rows, *a.shape[2:]), aux)), grads
