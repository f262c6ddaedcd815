"""GRPO core and optimiser vs an independent CPU-torch transcription of TRL / HF (float64 oracle)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from corl_jax import grpo, optim

B, T, D, V = 4, 6, 5, 13
RTOL, ATOL = 2e-5, 2e-6


def _data(seed=0, batch=B, length=T):
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(batch, length, D)).astype(np.float32)
    unembed = (rng.normal(size=(D, V)) * 0.7).astype(np.float32)
    targets = rng.integers(0, V, size=(batch, length)).astype(np.int32)
    lengths = rng.integers(1, length + 1, size=batch)
    lengths[-1] = 0 if batch > 2 else lengths[-1]  # one empty completion
    mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.float32)
    rewards = rng.integers(0, 2, size=batch).astype(np.float32)
    advantages = (rewards - rewards.mean() + rng.normal(size=batch) * 0.5).astype(np.float32)
    return hidden, unembed, targets, mask, advantages


def _close(ours, ref, rtol=RTOL, atol=ATOL):
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    np.testing.assert_allclose(ours, ref, rtol=rtol, atol=atol)
    return float(np.max(np.abs(ours - ref))) if ours.size else 0.0


# ----------------------------------------------------------------------------- torch oracle (TRL)


def torch_logps(hidden, unembed, targets, temperature=1.0):
    logits = hidden @ unembed / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    probs = logp_all.exp()
    return logp, -(probs * logp_all).sum(-1), logp_all.mean(-1)


def torch_trl_loss(
    per_token_logps, old, advantages, mask, loss_type, *, eps_low=0.2, eps_high=0.2, beta=0.0, ref=None,
    is_ratio=None, max_completion_length=None, num_items_in_batch=None, ga=1,
):
    """TRL GRPOTrainer._compute_loss (token-level IS), transcribed."""
    old = per_token_logps.detach() if old is None else old
    advantages = advantages.unsqueeze(1)
    coef_1 = torch.exp(per_token_logps - old)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if is_ratio is not None:
        per_token_loss = per_token_loss * is_ratio
    if beta != 0.0:
        per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
        per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / ga
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0) / ga
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length) / ga
    else:
        loss = (per_token_loss * mask).sum() / num_items_in_batch
    count = mask.sum().clamp(min=1.0)
    low = ((coef_1 < 1 - eps_low) & (advantages < 0)).double()
    high = ((coef_1 > 1 + eps_high) & (advantages > 0)).double()
    metrics = {
        "clip_ratio/low_mean": (low * mask).sum() / count,
        "clip_ratio/high_mean": (high * mask).sum() / count,
        "clip_ratio/region_mean": (((low + high) > 0).double() * mask).sum() / count,
    }
    if beta != 0.0:
        metrics["kl"] = (per_token_kl * mask).sum() / count
    return loss, metrics


def _t(x, grad=False):
    return torch.tensor(np.asarray(x, np.float64), requires_grad=grad)


# ----------------------------------------------------------------------------- log-probs


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 4, 6, 100])  # T=6: divides, does not divide, exceeds
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_token_logprobs_and_stats_match_full_log_softmax(chunk_size, temperature):
    hidden, unembed, targets, _, _ = _data()
    logp, entropy, mean_logp = grpo.token_logprobs(
        jnp.asarray(hidden), jnp.asarray(unembed), jnp.asarray(targets),
        temperature=temperature, chunk_size=chunk_size, with_stats=True,
    )
    ref = torch_logps(_t(hidden), _t(unembed), torch.tensor(targets), temperature)
    assert logp.dtype == entropy.dtype == mean_logp.dtype == jnp.float32
    for ours, theirs in zip((logp, entropy, mean_logp), ref):
        _close(ours, theirs.numpy())
    only_logp = grpo.token_logprobs(jnp.asarray(hidden), jnp.asarray(unembed), jnp.asarray(targets),
                                    temperature=temperature, chunk_size=chunk_size)
    # the same formula in another program: equal to float32 rounding (bit for bit at LLVM -O2; at the tests' -O0,
    # temperature 0.6, one in six values comes out 1 ulp off)
    np.testing.assert_allclose(only_logp, logp, rtol=1e-6, atol=0)


def test_token_logprobs_gradients_match_torch_autograd():
    hidden, unembed, targets, _, _ = _data(1)
    weights = np.random.default_rng(2).normal(size=(3, B, T))

    def ours(h, w):
        out = grpo.token_logprobs(h, w, jnp.asarray(targets), chunk_size=4, temperature=0.8, with_stats=True)
        return sum(jnp.sum(jnp.asarray(c, jnp.float32) * o) for c, o in zip(weights, out))

    g_h, g_w = jax.grad(ours, argnums=(0, 1))(jnp.asarray(hidden), jnp.asarray(unembed))
    th, tw = _t(hidden, True), _t(unembed, True)
    sum((_t(c) * o).sum() for c, o in zip(weights, torch_logps(th, tw, torch.tensor(targets), 0.8))).backward()
    _close(g_h, th.grad.numpy(), rtol=1e-4, atol=1e-5)
    _close(g_w, tw.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_token_logprobs_backward_keeps_only_a_chunk_of_logits():
    """Compiled fwd+bwd temp memory stays far below one [B, T, V] fp32 logits array."""
    batch, length, dim, vocab, chunk = 2, 256, 8, 4096, 16
    h = jnp.ones((batch, length, dim), jnp.float32)
    w = jnp.ones((dim, vocab), jnp.float32)
    y = jnp.zeros((batch, length), jnp.int32)
    loss = lambda h, w: jnp.sum(grpo.token_logprobs(h, w, y, chunk_size=chunk, with_stats=True)[1])
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(h, w).compile()
    analysis = compiled.memory_analysis()
    if analysis is None:
        pytest.skip("this backend reports no memory analysis")
    chunk_logits_bytes, full_logits_bytes = batch * chunk * vocab * 4, batch * length * vocab * 4
    assert analysis.temp_size_in_bytes < 8 * chunk_logits_bytes  # a few chunk-sized buffers (5 on CPU)
    assert analysis.temp_size_in_bytes < full_logits_bytes / 2


def test_token_logprobs_rejects_mismatched_shapes():
    hidden, unembed, targets, _, _ = _data()
    with pytest.raises(ValueError, match="unembedding must be"):
        grpo.token_logprobs(jnp.asarray(hidden), jnp.asarray(unembed.T), jnp.asarray(targets))
    with pytest.raises(ValueError, match="targets"):
        grpo.token_logprobs(jnp.asarray(hidden), jnp.asarray(unembed), jnp.asarray(targets[:, :2]))


# ----------------------------------------------------------------------------- loss


CASES = [  # (old_logp shift scale, beta, use is_ratio)
    (None, 0.0, False),  # num_iterations = 1: ratio == 1, no clipping
    (0.6, 0.0, False),  # clipping active on both sides
    (0.6, 0.04, True),  # + k3 KL and vLLM-style IS weights
]


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
@pytest.mark.parametrize("shift,beta,use_is", CASES)
def test_grpo_loss_values_metrics_and_gradients_match_trl(loss_type, shift, beta, use_is):
    hidden, unembed, targets, mask, adv = _data(3)
    rng = np.random.default_rng(4)
    full = jax.nn.log_softmax(jnp.asarray(hidden) @ jnp.asarray(unembed), -1)
    base = np.asarray(jnp.take_along_axis(full, jnp.asarray(targets)[..., None], -1)[..., 0])
    old = None if shift is None else (base + rng.normal(size=base.shape) * shift).astype(np.float32)
    ref = (base + rng.normal(size=base.shape) * 0.3).astype(np.float32)
    is_ratio = rng.uniform(0.5, 3.0, size=base.shape).astype(np.float32) if use_is else None
    # This micro-batch is the first of 3 accumulated ones (TRL's ga=3); the step's other rows only set the weights.
    step_mask = np.concatenate([mask, _data(5)[3], _data(6)[3]])
    kwargs = dict(max_completion_length=T, num_items_in_batch=float(step_mask.sum()))
    weights = grpo.loss_row_weights(jnp.asarray(step_mask), loss_type=loss_type, group_size=B,
                                    max_completion_length=T)[:B]

    def ours(h, w):
        logp = grpo.token_logprobs(h, w, jnp.asarray(targets), chunk_size=4)
        return grpo.grpo_loss(
            logp, None if old is None else jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), weights,
            beta=beta, ref_logp=jnp.asarray(ref), is_ratio=None if is_ratio is None else jnp.asarray(is_ratio))

    (loss, rows), (g_h, g_w) = jax.value_and_grad(ours, argnums=(0, 1), has_aux=True)(
        jnp.asarray(hidden), jnp.asarray(unembed))
    metrics = grpo.loss_metrics(rows, B)
    th, tw = _t(hidden, True), _t(unembed, True)
    t_loss, t_metrics = torch_trl_loss(
        torch_logps(th, tw, torch.tensor(targets))[0], None if old is None else _t(old), _t(adv), _t(mask),
        loss_type, beta=beta, ref=_t(ref), is_ratio=None if is_ratio is None else _t(is_ratio), ga=3, **kwargs,
    )
    t_loss.backward()
    _close(loss, t_loss.item())
    _close(g_h, th.grad.numpy(), rtol=1e-4, atol=1e-6)
    _close(g_w, tw.grad.numpy(), rtol=1e-4, atol=1e-6)
    t_metrics["clip_ratio/low_min"] = t_metrics["clip_ratio/low_mean"]  # one micro-batch (one rank)
    t_metrics["clip_ratio/high_max"] = t_metrics["clip_ratio/high_mean"]
    assert set(metrics) == set(t_metrics)
    for key, value in t_metrics.items():
        _close(metrics[key], value.item())
    if shift is not None:  # the clipped case really clips, on both sides
        assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0


def test_grpo_loss_bnpo_groups_and_metrics_are_per_group():
    """bnpo and the metrics treat each group of rows as TRL treats one micro-batch; min/max run across groups."""
    hidden, unembed, targets, mask, adv = _data(5)
    logp = grpo.token_logprobs(jnp.asarray(hidden), jnp.asarray(unembed), jnp.asarray(targets))
    old = logp + jnp.asarray(np.random.default_rng(6).normal(size=logp.shape) * 0.6, jnp.float32)
    weights = lambda m: grpo.loss_row_weights(jnp.asarray(m), loss_type="bnpo", group_size=2, max_completion_length=T)
    grouped, rows = grpo.grpo_loss(logp, old, jnp.asarray(adv), jnp.asarray(mask), weights(mask), entropy=-logp)
    halves = [grpo.grpo_loss(logp[i:i + 2], old[i:i + 2], jnp.asarray(adv[i:i + 2]), jnp.asarray(mask[i:i + 2]),
                             weights(mask[i:i + 2]), entropy=-logp[i:i + 2]) for i in (0, 2)]
    _close(grouped, (halves[0][0] + halves[1][0]) / 2)
    per_half = [grpo.loss_metrics(h[1], 2) for h in halves]
    metrics = grpo.loss_metrics(rows, 2)
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy"):
        _close(metrics[key], (per_half[0][key] + per_half[1][key]) / 2)
    _close(metrics["clip_ratio/low_min"], min(h["clip_ratio/low_mean"] for h in per_half))
    _close(metrics["clip_ratio/high_max"], max(h["clip_ratio/high_mean"] for h in per_half))
    assert per_half[0]["clip_ratio/high_mean"] != per_half[1]["clip_ratio/high_mean"]  # min/max are informative


def test_grpo_loss_and_row_weights_reject_bad_configuration():
    logp, mask, adv, weights = jnp.zeros((2, 3)), jnp.ones((2, 3)), jnp.zeros(2), jnp.ones(2)
    with pytest.raises(ValueError, match="loss_type must be one of"):
        grpo.loss_row_weights(mask, loss_type="ppo", group_size=2, max_completion_length=3)
    with pytest.raises(ValueError, match="group_size=3 must divide"):
        grpo.loss_row_weights(mask, loss_type="bnpo", group_size=3, max_completion_length=3)
    with pytest.raises(ValueError, match="ref_logp"):
        grpo.grpo_loss(logp, None, adv, mask, weights, beta=0.1)
    with pytest.raises(ValueError, match="advantages"):
        grpo.grpo_loss(logp, None, jnp.zeros((2, 3)), mask, weights)
    with pytest.raises(ValueError, match="row_weights"):
        grpo.grpo_loss(logp, None, adv, mask, jnp.ones(3))


# ----------------------------------------------------------------------------- advantages / rewards


@pytest.mark.parametrize("scale", grpo.SCALE_MODES)
def test_group_advantages_match_trl(scale):
    rewards = np.array([1, 0, 0, 1, 1, 1, 1, 1, 0.5, 0, 0, 2], np.float32)  # group 2 all equal
    ours = grpo.group_advantages(jnp.asarray(rewards), 4, scale=scale)
    r = torch.tensor(rewards, dtype=torch.float64)
    mean = r.view(-1, 4).mean(1).repeat_interleave(4)
    std = r.view(-1, 4).std(1).repeat_interleave(4) if scale != "batch" else r.std().expand_as(r)
    ref = r - mean if scale == "none" else (r - mean) / (std + 1e-4)
    _close(ours, ref.numpy())
    np.testing.assert_array_equal(ours[4:8], 0.0)
    np.testing.assert_array_equal(grpo.group_advantages(jnp.asarray(rewards).reshape(3, 4), 4, scale=scale),
                                  np.asarray(ours).reshape(3, 4))


def test_group_advantages_single_generation_and_bad_shapes():
    np.testing.assert_array_equal(grpo.group_advantages(jnp.array([1.0, 0.0]), 1), [0.0, 0.0])
    with pytest.raises(ValueError, match="multiple of num_generations=4"):
        grpo.group_advantages(jnp.zeros(6), 4)
    with pytest.raises(ValueError, match="G=3 but num_generations=4"):
        grpo.group_advantages(jnp.zeros((2, 3)), 4)
    with pytest.raises(ValueError, match="scale must be one of"):
        grpo.group_advantages(jnp.zeros(4), 4, scale="global")


def test_reward_metrics_match_trl():
    rewards = np.array([1, 0, 0, 1, 1, 1, 1, 1], np.float32)
    metrics = grpo.reward_metrics(jnp.asarray(rewards), 4)
    r = torch.tensor(rewards, dtype=torch.float64)
    _close(metrics["reward"], r.mean().item())
    _close(metrics["reward_std"], r.std().item())
    _close(metrics["frac_reward_zero_std"], 0.5)


def test_intrinsic_rewards_match_naive_full_vocab():
    hidden, unembed, targets, mask, _ = _data(6)
    _, entropy, mean_logp = grpo.token_logprobs(
        jnp.asarray(hidden), jnp.asarray(unembed), jnp.asarray(targets), chunk_size=4, with_stats=True)
    logp_all = torch.log_softmax(_t(hidden) @ _t(unembed), -1)
    m = _t(mask)
    naive_h = -(logp_all.exp() * logp_all).sum(-1)
    naive_kl = -math.log(V) - logp_all.mean(-1)
    for kind, per_token, sign in (("entropy", naive_h, -1.0), ("self_certainty", naive_kl, 1.0)):
        ours = grpo.intrinsic_rewards(entropy, mean_logp, jnp.asarray(mask), V, kind=kind)
        ref = [sign * (per_token[i] * m[i]).sum().item() / m[i].sum().item() if m[i].sum() > 0 else 0.0
               for i in range(B)]
        assert ref[-1] == 0.0  # the empty completion
        _close(ours, ref)
    with pytest.raises(ValueError, match="kind must be one of"):
        grpo.intrinsic_rewards(entropy, mean_logp, jnp.asarray(mask), V, kind="confidence")


def test_sampling_correction_matches_trl():
    rng = np.random.default_rng(12)
    old = rng.normal(size=(3, 5)) - 2.0
    sampled = old + rng.normal(size=(3, 5)) * 0.8
    sampled[0, 0] = old[0, 0] - 3.0  # exp(3) > cap
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], np.float32)
    ratio, metrics = grpo.sampling_correction(jnp.asarray(old, jnp.float32), jnp.asarray(sampled, jnp.float32),
                                              jnp.asarray(mask), cap=3.0)
    t_old, t_sampled, t_mask = _t(old), _t(sampled), _t(mask).bool()  # TRL token_truncate, transcribed
    t_ratio = torch.clamp(torch.exp((t_old - t_sampled) * t_mask), max=3.0)
    _close(ratio, t_ratio.numpy(), rtol=1e-5, atol=1e-6)
    delta = torch.abs(t_old - t_sampled)[t_mask]
    flat = t_ratio[t_mask]
    expected = {"sampling/sampling_logp_difference/mean": delta.mean(), "sampling/sampling_logp_difference/max":
                delta.max(), "sampling/importance_sampling_ratio/min": flat.min(),
                "sampling/importance_sampling_ratio/mean": flat.mean(), "sampling/importance_sampling_ratio/max":
                flat.max()}
    assert set(metrics) == set(expected)
    for key, value in expected.items():
        _close(metrics[key], value.item(), rtol=1e-5, atol=1e-6)
    assert float(metrics["sampling/importance_sampling_ratio/max"]) == 3.0  # the cap bites


# ----------------------------------------------------------------------------- accumulation


def _toy_model_batch(seed, batch):
    hidden, unembed, targets, mask, adv = _data(seed, batch=batch)
    rng = np.random.default_rng(seed + 100)
    params = {"proj": jnp.asarray(rng.normal(size=(D, D)) * 0.5, jnp.float32), "unembed": jnp.asarray(unembed)}
    old = np.asarray(rng.normal(size=(batch, T)) * 0.3 - 2.5, np.float32)
    data = {"x": hidden, "targets": targets, "mask": mask, "adv": adv, "old": old}
    return params, {k: jnp.asarray(v) for k, v in data.items()}


def _jax_loss_fn():
    """Loss and gradient of one micro-batch whose rows carry their step-level weights `w`."""
    def loss_fn(params, mb):
        logp = grpo.token_logprobs(mb["x"] @ params["proj"], params["unembed"], mb["targets"], chunk_size=4)
        return grpo.grpo_loss(logp, mb["old"], mb["adv"], mb["mask"], mb["w"])
    return jax.value_and_grad(loss_fn, has_aux=True)


def _with_weights(batch, loss_type, group_size):
    weights = grpo.loss_row_weights(batch["mask"], loss_type=loss_type, group_size=group_size, max_completion_length=T)
    return dict(batch, w=weights)


def _torch_accumulated(params, batch, loss_type, micro, num_items):
    """TRL: one backward per micro-batch of `micro` rows, loss / GA, grads summed."""
    tp = {k: _t(v, True) for k, v in params.items()}
    rows = len(batch["x"])
    total = 0.0
    for lo in range(0, rows, micro):
        mb = {k: np.asarray(v)[lo:lo + micro] for k, v in batch.items()}
        logp = torch_logps(_t(mb["x"]) @ tp["proj"], tp["unembed"], torch.tensor(mb["targets"]))[0]
        loss, _ = torch_trl_loss(logp, _t(mb["old"]), _t(mb["adv"]), _t(mb["mask"]), loss_type,
                                 max_completion_length=T, num_items_in_batch=num_items, ga=rows // micro)
        loss.backward()
        total += loss.item()
    return total, {k: v.grad.numpy() for k, v in tp.items()}


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
def test_accumulate_grads_matches_trl_for_any_micro_batch_size(loss_type):
    """TRL with 2-row micro-batches (the reference) == ours accumulating 4x2, 2x4 or 1x8 rows in groups of 2."""
    params, batch = _toy_model_batch(7, 8)
    num_items = jnp.sum(batch["mask"])
    ref_loss, ref_grads = _torch_accumulated(params, batch, loss_type, 2, float(num_items))
    for num_micro in (4, 2, 1):
        (loss, rows), grads = jax.jit(lambda p, b: grpo.accumulate_grads(_jax_loss_fn(), p, b, num_micro))(
            params, _with_weights(batch, loss_type, 2))
        _close(loss, ref_loss)
        for key in params:
            _close(grads[key], ref_grads[key], rtol=1e-4, atol=1e-6)
            assert grads[key].dtype == jnp.float32
        np.testing.assert_array_equal(rows["tokens"], np.asarray(batch["mask"]).sum(1))  # batch order


def test_accumulate_grads_rejects_unequal_micro_batches():
    params, batch = _toy_model_batch(7, 6)
    batch = _with_weights(batch, "bnpo", 2)
    with pytest.raises(ValueError, match="num_micro=4 does not split 6 rows"):
        grpo.accumulate_grads(_jax_loss_fn(), params, batch, 4)
    with pytest.raises(ValueError, match="num_micro=0"):
        grpo.accumulate_grads(_jax_loss_fn(), params, batch, 0)


# ----------------------------------------------------------------------------- optimiser


@pytest.mark.parametrize("total,ratio", [(50, 0.03), (7, 0.03), (100, 0.03), (40, 0.1), (10, 0.0)])
def test_schedule_matches_transformers(total, ratio):
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    warmup = math.ceil(total * ratio)
    assert optim.num_warmup_steps(total, ratio) == warmup
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-6)
    sched = get_cosine_with_min_lr_schedule_with_warmup(opt, warmup, total, min_lr_rate=0.1)
    ours = optim.make_schedule(1e-6, total, warmup_ratio=ratio, min_lr_rate=0.1)
    for step in range(total + 1):  # HF's lr for update `step`, before scheduler.step()
        _close(ours(step), opt.param_groups[0]["lr"], rtol=1e-6, atol=1e-15)
        opt.step()
        sched.step()
    if warmup:
        assert float(ours(0)) == 0.0
    _close(ours(total), 1e-7, rtol=1e-6)
    _close(ours(total + 10), 1e-7, rtol=1e-6)  # stays at the minimum past the end


def test_one_adamw_step_matches_hand_computation():
    params = {"w": jnp.array([[1.0, -2.0], [0.5, 3.0]]), "b": jnp.array([0.1, -0.1])}
    grads = {"w": jnp.array([[0.3, -0.4], [0.0, 0.0]]), "b": jnp.array([0.0, 0.0])}  # norm 0.5 < 1
    tx = optim.make_optimizer(1e-3, 10, warmup_ratio=0.0, weight_decay=0.1)
    updates, _ = tx.update(grads, tx.init(params), params)
    lr, b1, b2, eps = 1e-3, 0.9, 0.95, 1e-8
    for key in params:
        g, p = np.asarray(grads[key], np.float64), np.asarray(params[key], np.float64)
        m_hat, v_hat = (1 - b1) * g / (1 - b1), (1 - b2) * g**2 / (1 - b2)
        decay = 0.1 * p if p.ndim >= 2 else 0.0  # no decay on biases / norm scales
        _close(updates[key], -lr * (m_hat / (np.sqrt(v_hat) + eps) + decay), rtol=1e-5, atol=1e-10)


def test_optimizer_matches_torch_adamw_with_clip_and_hf_schedule():
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    rng = np.random.default_rng(10)
    init = {"w": rng.normal(size=(3, 4)), "b": rng.normal(size=(4,))}
    grads_seq = [{k: rng.normal(size=v.shape) * 2.0 for k, v in init.items()} for _ in range(6)]  # norms > 1
    tx = optim.make_optimizer(1e-2, 6, warmup_ratio=0.3, weight_decay=0.05)
    params = {k: jnp.asarray(v, jnp.float32) for k, v in init.items()}
    state = tx.init(params)
    tw, tb = (torch.nn.Parameter(torch.tensor(init[k])) for k in ("w", "b"))
    opt = torch.optim.AdamW([{"params": [tw], "weight_decay": 0.05}, {"params": [tb], "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    sched = get_cosine_with_min_lr_schedule_with_warmup(opt, math.ceil(6 * 0.3), 6, min_lr_rate=0.1)
    for grads in grads_seq:
        updates, state = tx.update({k: jnp.asarray(v, jnp.float32) for k, v in grads.items()}, state, params)
        params = optax.apply_updates(params, updates)
        tw.grad, tb.grad = torch.tensor(grads["w"]), torch.tensor(grads["b"])
        torch.nn.utils.clip_grad_norm_([tw, tb], 1.0)
        opt.step()
        sched.step()
    _close(params["w"], tw.detach().numpy(), rtol=1e-5, atol=1e-6)
    _close(params["b"], tb.detach().numpy(), rtol=1e-5, atol=1e-6)
