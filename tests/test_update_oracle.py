"""The composed GRPO update (`Cohort._update` -> the jitted `update`) against an independent CPU-torch
transcription of the reference trainer's step on a tiny HF model, in float32.

The oracle is TRL's GRPOTrainer as the reference runs it (co_rl_reference.md §1.2, §1.10, §1.11): no-grad old
log-probs and the vLLM truncated importance weight at generation time, group advantages, one shuffle of the step's
rows, micro-batches of 2 rows (per_device_train_batch_size) accumulated over GA = N / 2 backward passes with TRL's
`_compute_loss` (bnpo / grpo / dr_grpo / dapo, clipping, k3 KL against the initial model), `num_iterations` passes
over the same micro-batches, `clip_grad_norm_`, torch AdamW(0.9, 0.95, 1e-8) on transformers'
`cosine_with_min_lr` schedule. It shares nothing with corl_jax but the checkpoint, the batch and the shuffle order.
Ours runs with other micro-batch sizes, so the comparison also proves the update independent of
`grpo.micro_batch_size`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file

from corl_jax.cohort import Cohort, Rollouts, load_agents
from corl_jax.config import agent_config, base_config, validate
from corl_jax.models import save_pretrained
from corl_jax.sampling import Completions
from hf_tiny import make_tiny_hf_checkpoint

P, G, TP, TC = 4, 4, 5, 6          # prompts, generations, prompt width, completion width: N = 16 rows
N, REF_MICRO, MAX_NEW = P * G, 2, 9  # MAX_NEW (dr_grpo's divisor) differs from the padded width TC on purpose
PAD = 0
# Parameters after AdamW steps at lr 1e-3 agree to this absolute tolerance (each step moves them by ~1e-3; the
# float32 gradients of the two frameworks differ by ~1e-6 relative, measured 1e-7 on the parameters). AdamW runs
# with eps 1e-4 here: at the reference's 1e-8, a weight whose true gradient is ~1e-8 (or exactly 0, e.g. the k3 KL
# gradient while the policy equals the reference) moves by lr * g / (|g| + eps) = O(lr) on float noise alone, in
# either framework, so parameters cannot be compared there. AdamW at eps 1e-8 itself is checked against torch in
# test_grpo.py::test_optimizer_matches_torch_adamw_with_clip_and_hf_schedule (the same optax chain).
ATOL, ADAM_EPS = 1e-6, 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("oracle") / "qwen2", "qwen2", seed=3)


def _config(path, loss_type, micro, *, beta=0.0, iterations=1, steps=3, warmup_ratio=0.0, is_correction=True,
            length_bucket=0, packing=False):
    c = base_config()
    c.method = "gt_reward"
    c.agents.a = agent_config(str(path), "qwen2", compute_dtype="float32")
    c.rollout.update(prompts_per_step=P, num_generations=G, max_new_tokens=MAX_NEW)
    c.grpo.update(loss_type=loss_type, micro_batch_size=micro, beta=beta, num_iterations=iterations, remat="none",
                  importance_sampling_correction=is_correction, logprob_chunk_size=4, length_bucket=length_bucket,
                  packing=packing)
    c.optim.update(learning_rate=1e-3, warmup_ratio=warmup_ratio, max_grad_norm=0.5, eps=ADAM_EPS)
    c.train.max_steps = steps
    c.mesh.data = 1
    validate(c)
    return c


def _step_data(step: int, vocab: int):
    """One step's rollouts: left-padded prompts, completions of varied length (some truncated), sampler
    log-probs near a random model's (so the IS weights vary and some hit the cap), rewards with one flat group."""
    rng = np.random.default_rng(100 + step)
    prompt_len = rng.integers(2, TP + 1, size=P)
    prompt_mask = np.arange(TP)[None, :] >= (TP - prompt_len)[:, None]
    prompt_ids = np.where(prompt_mask, rng.integers(3, vocab, size=(P, TP)), PAD).astype(np.int32)
    lengths = rng.integers(1, TC + 1, size=N)
    truncated = lengths == TC
    mask = np.arange(TC)[None, :] < lengths[:, None]
    tokens = np.where(mask, rng.integers(3, vocab, size=(N, TC)), PAD).astype(np.int32)
    sampling_logp = np.where(mask, rng.uniform(-7.0, -4.5, size=(N, TC)), 0.0).astype(np.float32)
    rewards = rng.integers(0, 2, size=N).astype(np.float32)
    rewards[:G] = 1.0  # a group without signal
    return prompt_ids, prompt_mask, tokens, mask, lengths, truncated, sampling_logp, rewards


# ----------------------------------------------------------------------------- the torch oracle (TRL / HF)


def _torch_logps(model, input_ids, attention_mask, completion_len):
    """TRL `_get_per_token_logps` (temperature 1). Explicit position ids as the mask's running count: RoPE is
    shift-invariant, so this equals HF's default positions on left-padded rows up to rounding."""
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions).logits
    logits = logits[:, -completion_len - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, input_ids[:, -completion_len:].unsqueeze(-1)).squeeze(-1)


def _trl_loss(logp, old, adv, mask, is_ratio, ref, loss_type, beta, ga, num_items):
    """TRL `_compute_loss` of one micro-batch, token-level importance sampling, eps 0.2."""
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 0.8, 1.2)
    per_token = -torch.min(coef_1 * adv.unsqueeze(1), coef_2 * adv.unsqueeze(1))
    if is_ratio is not None:
        per_token = per_token * is_ratio
    if beta != 0.0:
        per_token = per_token + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / ga
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0) / ga
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * MAX_NEW) / ga
    return (per_token * mask).sum() / num_items  # dapo: num_items_in_batch / num_processes (1)


def _torch_run(path, config, steps_data, orders):
    g, o = config.grpo, config.optim
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                              attn_implementation="eager")
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                                  attn_implementation="eager") if g.beta else None
    total = len(steps_data) * g.num_iterations
    opt = torch.optim.AdamW(model.parameters(), lr=o.learning_rate, betas=(o.b1, o.b2), eps=o.eps,
                            weight_decay=o.weight_decay)
    sched = transformers.get_cosine_with_min_lr_schedule_with_warmup(
        opt, math.ceil(total * o.warmup_ratio), total, min_lr_rate=o.min_lr_rate)
    snapshots = []
    for data, order in zip(steps_data, orders):
        prompt_ids, prompt_mask, tokens, mask, _, _, sampling_logp, rewards = data
        ids = torch.cat([torch.as_tensor(np.repeat(prompt_ids, G, 0)).long(), torch.as_tensor(tokens).long()], 1)
        attn = torch.cat([torch.as_tensor(np.repeat(prompt_mask, G, 0)).long(), torch.as_tensor(mask).long()], 1)
        cmask = torch.as_tensor(mask).float()
        with torch.no_grad():  # generation time: old log-probs, IS weights, reference log-probs, advantages
            old = _torch_logps(model, ids, attn, TC)
            is_ratio = (torch.clamp(torch.exp((old - torch.as_tensor(sampling_logp)) * cmask), max=3.0)
                        if g.importance_sampling_correction else None)
            ref = _torch_logps(ref_model, ids, attn, TC) if ref_model is not None else None
            r = torch.as_tensor(rewards).view(-1, G)
            adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)
        num_items = cmask.sum()
        perm = torch.as_tensor(order.copy()).long()
        shuffled = [x[perm] if x is not None else None for x in (ids, attn, cmask, old, is_ratio, ref, adv)]
        ga = N // REF_MICRO
        for _ in range(g.num_iterations):
            for k in range(ga):
                mb = [x[k * REF_MICRO:(k + 1) * REF_MICRO] if x is not None else None for x in shuffled]
                m_ids, m_attn, m_mask, m_old, m_is, m_ref, m_adv = mb
                logp = _torch_logps(model, m_ids, m_attn, TC)
                m_old = m_old if (g.num_iterations > 1 or g.importance_sampling_correction) else logp.detach()
                _trl_loss(logp, m_old, m_adv, m_mask, m_is, m_ref, g.loss_type, g.beta, ga, num_items).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.max_grad_norm)
            opt.step()
            sched.step()
            opt.zero_grad()
        snapshots.append({k: v.detach().numpy().copy() for k, v in model.state_dict().items()})
    return snapshots


# ----------------------------------------------------------------------------- ours


def _our_run(config, steps_data, tmp_path):
    agent = load_agents(config, config.train.max_steps)[0]
    cohort = Cohort(config, [agent])
    snapshots, orders, metrics = [], [], []
    for step, data in enumerate(steps_data, start=1):
        prompt_ids, prompt_mask, tokens, mask, lengths, truncated, sampling_logp, rewards = data
        completions = Completions(tokens=jnp.asarray(tokens), mask=jnp.asarray(mask),
                                  logprobs=jnp.asarray(sampling_logp), lengths=jnp.asarray(lengths, jnp.int32),
                                  truncated=jnp.asarray(truncated))
        rollouts = Rollouts(prompt_ids, prompt_mask, completions)
        orders.append(np.asarray(jax.random.permutation(agent.step_key(step, 1), N)))  # the step's shuffle
        metrics.append(cohort._update(agent, rollouts, cohort._batch(agent, rollouts), rewards, step))
        nnx.update(agent.policy.model, agent.params)
        snapshots.append(load_file(save_pretrained(agent.policy, tmp_path / f"step{step}") / "model.safetensors"))
    return snapshots, orders, metrics


def _max_diff(ours: dict, theirs: dict) -> float:
    assert set(ours) <= set(theirs), set(ours) - set(theirs)
    return max(float(np.max(np.abs(ours[k].astype(np.float64) - theirs[k]))) for k in ours)


CASES = {  # name: (loss_type, our micro-batch size (the oracle's is 2), config overrides)
    "bnpo_reference_defaults": ("bnpo", 4, {}),
    "grpo": ("grpo", 8, {}),
    "dr_grpo_without_is": ("dr_grpo", 2, dict(is_correction=False)),
    "dapo_kl_3_iterations_warmup": ("dapo", N, dict(beta=0.04, iterations=3, warmup_ratio=0.2)),
}


@pytest.mark.parametrize("length_bucket, packing", [(0, False), (2, False), (2, True)],
                         ids=["padded", "bucketed", "packed"])
@pytest.mark.parametrize("case", list(CASES))
def test_update_matches_torch_transcription_of_the_reference_step(case, length_bucket, packing, checkpoint,
                                                                  tmp_path):
    """Also with length-bucketed micro-batches (`grpo.length_bucket` 2: rows sorted by length, widths 2/4/6) and
    with packed ones (`grpo.packing`: rows end to end in lines of 11 tokens; old and reference log-probs scored
    packed too)."""
    loss_type, micro, overrides = CASES[case]
    config = _config(checkpoint, loss_type, micro, length_bucket=length_bucket, packing=packing, **overrides)
    vocab = 200
    steps_data = [_step_data(step, vocab) for step in range(1, 4)]
    ours, orders, metrics = _our_run(config, steps_data, tmp_path)
    theirs = _torch_run(checkpoint, config, steps_data, orders)
    initial = load_file(str(checkpoint / "model.safetensors"))
    moved = max(float(np.max(np.abs(ours[-1][k] - initial[k]))) for k in ours[-1])
    assert moved > 1e-3  # the steps really move the weights, far beyond the tolerance
    for step in (0, 2):  # after 1 and after 3 steps
        assert _max_diff(ours[step], theirs[step]) < ATOL, (step + 1, _max_diff(ours[step], theirs[step]))
    m = metrics[0]
    if case == "bnpo_reference_defaults":
        assert m["grad_norm"] > config.optim.max_grad_norm  # clipping is active (1.7 > 0.5)
    if config.grpo.importance_sampling_correction:
        assert m["sampling/importance_sampling_ratio/max"] == pytest.approx(3.0)
        assert m["sampling/importance_sampling_ratio/min"] < 1.0
    if config.grpo.num_iterations > 1:  # the last iteration has moved away from the old and reference policies
        assert m["clip_ratio/region_mean"] > 0.0 and m["kl"] > 0.0
