"""Per-agent optimiser: global-norm clipping + AdamW on HF's ``cosine_with_min_lr`` schedule.

Matches the reference's HF Trainer settings (co_rl_reference.md §1.11, §2.2): AdamW
(0.9, 0.95, 1e-8, weight decay 0), clip 1.0, linear warmup over ceil(0.03 * total) steps
from 0, then a half cosine from the peak to ``min_lr_rate * peak``. Parameters and optimiser
state stay fp32 ("master weights").
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax


def num_warmup_steps(total_steps: int, warmup_ratio: float) -> int:
    """HF's warmup length for a ratio: ceil(total_steps * warmup_ratio) (same float expression)."""
    return math.ceil(total_steps * warmup_ratio)


def make_schedule(
    peak_lr: float, total_steps: int, *, warmup_ratio: float = 0.03, min_lr_rate: float = 0.1
) -> optax.Schedule:
    """HF ``get_cosine_with_min_lr_schedule_with_warmup`` (num_cycles 0.5) as optax's own
    ``warmup_cosine_decay_schedule``.

    ``schedule(step)`` is the learning rate of the update with 0-based index ``step`` (optax's
    count; HF's LambdaLR at the same step): step 0 of a warmup uses lr 0, warmup is
    peak * step / W, then peak * (min_lr_rate + (1 - min_lr_rate) * 0.5 * (1 + cos(pi * p)))
    with p = (step - W) / max(1, total - W). Past ``total_steps`` it stays at the minimum (HF
    would climb the cosine back up).
    """
    if peak_lr <= 0 or total_steps < 1:
        raise ValueError(f"need peak_lr > 0 and total_steps >= 1; got {peak_lr}, {total_steps}")
    if not (0.0 <= warmup_ratio < 1.0 and 0.0 <= min_lr_rate <= 1.0):
        raise ValueError(f"need 0 <= warmup_ratio < 1 and 0 <= min_lr_rate <= 1; got {warmup_ratio}, {min_lr_rate}")
    warmup = num_warmup_steps(total_steps, warmup_ratio)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=peak_lr, warmup_steps=warmup, decay_steps=warmup + max(1, total_steps - warmup),
        end_value=min_lr_rate * peak_lr)


def _is_matrix(params: Any) -> Any:
    """Weight-decay mask: HF decays every parameter but biases and norm scales, i.e. all ndim >= 2."""
    return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def make_optimizer(
    peak_lr: float,
    total_steps: int,
    *,
    warmup_ratio: float = 0.03,
    min_lr_rate: float = 0.1,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    max_grad_norm: float = 1.0,
) -> optax.GradientTransformation:
    """clip_by_global_norm(max_grad_norm) then AdamW (torch semantics) on ``make_schedule``."""
    schedule = make_schedule(peak_lr, total_steps, warmup_ratio=warmup_ratio, min_lr_rate=min_lr_rate)
    return optax.chain(
        optax.clip_by_global_norm(max_grad_norm),
        optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=_is_matrix),
    )


def opt_state_shardings(optimizer: optax.GradientTransformation, params: Any, mesh=None) -> Any:
    """Shardings of ``optimizer.init(params)``: every subtree shaped like ``params`` (AdamW's mu and nu) takes the
    parameters' shardings leaf for leaf; the rest (step counts) is replicated over ``mesh``, or without a mesh placed
    like the first parameter. ``params`` may be abstract (``jax.ShapeDtypeStruct`` leaves with shardings)."""
    structure = jax.tree.structure(params)
    shardings = jax.tree.map(lambda x: x.sharding, params)
    rest = (jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()) if mesh is not None
            else jax.tree.leaves(shardings)[0])
    like_params = lambda x: jax.tree.structure(x) == structure  # noqa: E731
    return jax.tree.map(lambda x: shardings if like_params(x) else rest, jax.eval_shape(optimizer.init, params),
                        is_leaf=like_params)


def init_opt_state(optimizer: optax.GradientTransformation, params: Any, mesh=None) -> Any:
    """``optimizer.init(params)`` placed per ``opt_state_shardings``: moments sharded like their parameters, every
    array committed (as ``update`` returns them, so its second step reuses the first step's compilation)."""
    return jax.jit(optimizer.init, out_shardings=opt_state_shardings(optimizer, params, mesh))(params)

