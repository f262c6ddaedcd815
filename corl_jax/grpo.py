"""GRPO core, independent of the model: token log-probs, advantages, losses, accumulation.

Everything here works on the decoder's final hidden states ``[B, T, D]`` and the unembedding
matrix ``W [D, V]`` (logits = hidden @ W), so it never sees model code. Formulas follow the
reference's TRL fork (co_rl_reference.md §1.10, §4.3, §5.4); all functions are jit-friendly
(configuration arguments are static Python values, arrays carry explicit dtypes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
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


# ----------------------------------------------------------------------------- masks


def completion_mask(
    completion_ids: jax.Array, eos_ids: Sequence[int], *, mask_truncated: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Mask of completion tokens up to and including the first EOS, and which rows are truncated.

    A row with no EOS is truncated (hit the length limit); with ``mask_truncated`` (TRL's
    ``mask_truncated_completions``, off in the reference) its whole mask is zeroed.
    Returns (int32 mask [B, T], bool is_truncated [B]).
    """
    is_eos = jnp.isin(completion_ids, jnp.asarray(list(eos_ids), dtype=completion_ids.dtype))
    eos_seen_before = jnp.cumsum(is_eos, axis=1) - is_eos  # EOS tokens strictly before t
    mask = eos_seen_before == 0
    is_truncated = ~jnp.any(is_eos, axis=1)
    if mask_truncated:
        mask = mask & ~is_truncated[:, None]
    return mask.astype(jnp.int32), is_truncated


def truncated_is_ratio(old_logp: jax.Array, sampling_logp: jax.Array, mask: jax.Array, cap: float = 3.0):
    """Per-token importance weight min(exp(old - sampler), cap) (TRL ``token_truncate``), no grad."""
    diff = (old_logp - sampling_logp) * mask.astype(jnp.float32)
    return jax.lax.stop_gradient(jnp.minimum(jnp.exp(diff), jnp.float32(cap)))


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


def reward_metrics(rewards: jax.Array, num_generations: int) -> dict[str, jax.Array]:
    """TRL's reward, reward_std (unbiased, whole batch) and frac_reward_zero_std (per group)."""
    grouped = _grouped(rewards, num_generations)
    group_std = _unbiased_std(grouped, axis=1)
    return {
        "reward": jnp.mean(grouped),
        "reward_std": _unbiased_std(grouped),
        "frac_reward_zero_std": jnp.mean((jnp.abs(group_std) <= 1e-8).astype(jnp.float32)),
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


def _masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _bnpo(per_token, mask, rows, group_size):
    """Mean over normalisation groups (of ``group_size`` rows) of each group's token mean."""
    batch = per_token.shape[0]
    group_size = batch if group_size is None else group_size
    if batch % group_size:
        raise ValueError(f"bnpo_group_size={group_size} must divide the micro-batch size {batch}")
    tokens = jnp.sum(per_token * mask, axis=1).reshape(-1, group_size).sum(axis=1)
    counts = jnp.sum(mask, axis=1).reshape(-1, group_size).sum(axis=1)
    live = jnp.any(rows.reshape(-1, group_size), axis=1).astype(jnp.float32)
    return jnp.sum(live * tokens / jnp.maximum(counts, 1.0)) / jnp.maximum(jnp.sum(live), 1.0)


def grpo_loss(
    logp: jax.Array,
    old_logp: jax.Array | None,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    loss_type: str = "bnpo",
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    beta: float = 0.0,
    ref_logp: jax.Array | None = None,
    is_ratio: jax.Array | None = None,
    max_completion_length: int | None = None,
    num_items_in_batch: jax.Array | int | None = None,
    num_micro_batches: int = 1,
    valid_rows: jax.Array | None = None,
    bnpo_group_size: int | None = None,
    entropy: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped GRPO surrogate of one micro-batch, aggregated exactly as TRL does.

    Per token: l = -min(c A, clip(c, 1 - eps_low, 1 + eps_high) A) * is_ratio + beta * k3 with
    c = exp(logp - old_logp) (old_logp=None: stop_gradient(logp), i.e. num_iterations = 1) and
    k3 = exp(ref - logp) - (ref - logp) - 1. Aggregation over masked tokens m:
      grpo:    mean over rows of sum_t m l / max(1, sum_t m), / num_micro_batches
      bnpo:    sum m l / max(1, sum m), / num_micro_batches (the reference); with
               ``bnpo_group_size`` s, the mean of that over consecutive groups of s rows
               (reproduces the reference's per-device micro-batches inside a bigger one)
      dr_grpo: sum m l / (rows * max_completion_length), / num_micro_batches
      dapo:    sum m l / num_items_in_batch (mask tokens of the whole accumulated batch)
    ``num_micro_batches`` is TRL's gradient-accumulation divisor; summing the micro-batch losses
    (see ``accumulate_grads``) gives the reference's step loss. ``valid_rows`` [B] bool marks
    padding rows (False) that count nowhere, not even in the row counts of grpo / dr_grpo.

    Returns (float32 loss, metrics): clip_ratio/{low_mean, high_mean, region_mean} (TRL
    definitions: ratio below 1 - eps_low with A < 0, above 1 + eps_high with A > 0, either),
    ``kl`` when beta != 0 and ``entropy`` when per-token entropies are given (masked means).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}; got {loss_type!r}")
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError("loss_type='dr_grpo' needs max_completion_length")
    if loss_type == "dapo" and num_items_in_batch is None:
        raise ValueError("loss_type='dapo' needs num_items_in_batch (mask tokens of the accumulated batch)")
    if beta != 0.0 and ref_logp is None:
        raise ValueError("beta != 0 needs ref_logp (log-probs of the frozen reference policy)")
    if advantages.shape != logp.shape[:1] or mask.shape != logp.shape:
        raise ValueError(
            f"need logp, mask [B, T] and advantages [B]; got {logp.shape}, {mask.shape}, {advantages.shape}"
        )

    rows = jnp.ones(logp.shape[:1], bool) if valid_rows is None else valid_rows.astype(bool)
    mask = mask.astype(jnp.float32) * rows[:, None]
    old_logp = jax.lax.stop_gradient(logp) if old_logp is None else old_logp
    ratio = jnp.exp(logp - old_logp)
    adv = advantages.astype(jnp.float32)[:, None]
    per_token = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv)
    if is_ratio is not None:
        per_token = per_token * is_ratio
    metrics = {}
    if beta != 0.0:
        log_ref_ratio = ref_logp - logp
        kl = jnp.exp(log_ref_ratio) - log_ref_ratio - 1.0
        per_token = per_token + beta * kl
        metrics["kl"] = _masked_mean(kl, mask)

    num_rows = jnp.maximum(jnp.sum(rows.astype(jnp.float32)), 1.0)
    if loss_type == "grpo":
        per_row = jnp.sum(per_token * mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
        loss = jnp.sum(per_row) / num_rows / num_micro_batches
    elif loss_type == "bnpo":
        loss = _bnpo(per_token, mask, rows, bnpo_group_size) / num_micro_batches
    elif loss_type == "dr_grpo":
        loss = jnp.sum(per_token * mask) / (num_rows * max_completion_length) / num_micro_batches
    else:  # dapo
        loss = jnp.sum(per_token * mask) / jnp.maximum(jnp.asarray(num_items_in_batch, jnp.float32), 1.0)

    low = ((ratio < 1.0 - eps_low) & (adv < 0)).astype(jnp.float32)
    high = ((ratio > 1.0 + eps_high) & (adv > 0)).astype(jnp.float32)
    metrics["clip_ratio/low_mean"] = _masked_mean(low, mask)
    metrics["clip_ratio/high_mean"] = _masked_mean(high, mask)
    metrics["clip_ratio/region_mean"] = _masked_mean(jnp.maximum(low, high), mask)
    if entropy is not None:
        metrics["entropy"] = _masked_mean(jax.lax.stop_gradient(entropy), mask)
    return loss.astype(jnp.float32), jax.lax.stop_gradient(metrics)


# ----------------------------------------------------------------------------- accumulation


def accumulate_grads(
    loss_and_grad_fn: Callable[[Any, Any, jax.Array], tuple[tuple[jax.Array, dict], Any]],
    params: Any,
    batch: Any,
    num_micro: int,
) -> tuple[tuple[jax.Array, dict], Any]:
    """Sum losses and gradients over ``num_micro`` micro-batches with one ``lax.scan``.

    ``batch`` is a pytree of arrays sharing a leading row axis B. It is cut into ``num_micro``
    consecutive micro-batches of ceil(B / num_micro) rows; the last one is padded with zero
    rows when B does not divide. ``loss_and_grad_fn(params, micro_batch, valid_rows)`` returns
    ``((loss, metrics), grads)`` (the output of ``jax.value_and_grad(..., has_aux=True)``);
    ``valid_rows`` [rows] bool is False on padding, to be passed to ``grpo_loss``, whose
    ``num_micro_batches=num_micro`` (and, for dapo, ``num_items_in_batch`` = mask sum of the
    whole batch) makes the summed result the reference's accumulated step.
    Returns ((summed loss, metrics averaged over micro-batches), summed grads in params' dtypes).
    """
    leaves = jax.tree.leaves(batch)
    num_rows = leaves[0].shape[0]
    if any(x.shape[:1] != (num_rows,) for x in leaves):
        raise ValueError(f"all batch arrays need the same leading row axis; got {[x.shape for x in leaves]}")
    micro_size = -(-num_rows // max(num_micro, 1))
    if num_micro < 1 or (num_micro - 1) * micro_size >= num_rows:
        raise ValueError(
            f"num_micro={num_micro} does not split {num_rows} rows into non-empty micro-batches of "
            f"{micro_size}; choose num_micro <= {num_rows} with (num_micro - 1) * ceil(B / num_micro) < B"
        )
    padded = num_micro * micro_size

    def split(x):
        x = jnp.pad(x, [(0, padded - num_rows)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(num_micro, micro_size, *x.shape[1:])

    micro_batches = jax.tree.map(split, batch)
    valid = (jnp.arange(padded) < num_rows).reshape(num_micro, micro_size)

    def step(carry, xs):
        grad_sum, loss_sum = carry
        (loss, metrics), grads = loss_and_grad_fn(params, *xs)
        grad_sum = jax.tree.map(lambda s, g: s + g.astype(s.dtype), grad_sum, grads)
        return (grad_sum, loss_sum + loss.astype(jnp.float32)), metrics

    init = (jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32))
    (grads, loss), metrics = jax.lax.scan(step, init, (micro_batches, valid))
    return (loss, jax.tree.map(lambda m: jnp.mean(m, axis=0), metrics)), grads
