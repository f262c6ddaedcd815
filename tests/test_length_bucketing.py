"""Length-bucketed GRPO update (`grpo.length_bucket`): reference row weights, the micro-batch plan, the padded-FLOPs
count, and the composed trainer with bucketing on vs off. (The bucketed update against the torch transcription of
the reference step, for every loss type: tests/test_update_oracle.py, length_bucket 2.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from config_files import load_config
from corl_jax import grpo
from corl_jax.cohort import Cohort, bucket_plan, completion_widths, load_agents, padded_flops_fraction
from corl_jax.config import validate
from corl_jax.data import PromptBlock
from corl_jax.demo import arithmetic
from corl_jax.models import Decoder, ModelConfig
from test_grpo import T, _torch_accumulated, _toy_model_batch

RTOL, GRAD_TOL = 2e-5, dict(rtol=1e-4, atol=1e-6)  # float32 against the float64 torch reference


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
def test_row_weights_give_the_reference_loss_for_any_row_order(loss_type):
    """Weights from the reference grouping (2-row groups in batch order), then rows shuffled into micro-batches of 3:
    loss and gradient equal the reference's accumulation over its 2-row micro-batches."""
    params, batch = _toy_model_batch(11, 12)
    ref_loss, ref_grads = _torch_accumulated(params, batch, loss_type, 2, float(jnp.sum(batch["mask"])))
    weights = grpo.loss_row_weights(batch["mask"], loss_type=loss_type, group_size=2, max_completion_length=T)
    order = np.random.default_rng(0).permutation(12)
    shuffled = {k: v[order] for k, v in dict(batch, w=weights).items()}

    def loss_fn(p, mb):
        logp = grpo.token_logprobs(mb["x"] @ p["proj"], p["unembed"], mb["targets"], chunk_size=4)
        return grpo.grpo_loss(logp, mb["old"], mb["adv"], mb["mask"], mb["w"])

    (loss, rows), grads = jax.jit(lambda p, b: grpo.accumulate_grads(
        jax.value_and_grad(loss_fn, has_aux=True), p, b, 4))(params, shuffled)
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
    for key in params:
        np.testing.assert_allclose(grads[key], ref_grads[key], **GRAD_TOL)
    np.testing.assert_array_equal(rows["tokens"], np.asarray(shuffled["mask"]).sum(1))


def test_bucket_plan_and_completion_widths():
    attention = np.zeros((4, 3 + 8), bool)
    attention[:, 1:3] = True                      # prompts of 2 tokens (left-padded to 3)
    attention[0, 0] = True                        # one of 3
    for row, length in enumerate([8, 1, 0, 5]):
        attention[row, 3:3 + length] = True
    widths = completion_widths(attention, 3)
    np.testing.assert_array_equal(widths, [8, 1, 0, 5])
    prompt_tokens = attention[:, :3].sum(axis=1)
    order, prompt_widths, micro_widths = bucket_plan(prompt_tokens, widths, 2, 4, 3, 8)
    np.testing.assert_array_equal(order, [[2, 1], [3, 0]])
    np.testing.assert_array_equal(prompt_widths, [3, 3])  # rounded up to 4, capped at the prompt width
    np.testing.assert_array_equal(micro_widths, [4, 8])
    order, prompt_widths, micro_widths = bucket_plan(prompt_tokens, widths, 2, 0, 3, 8)
    np.testing.assert_array_equal(order, [[0, 1], [2, 3]])
    np.testing.assert_array_equal(micro_widths, [8, 8])


def test_train_flops_counts_every_matmul():
    """The per-token term is 2 x the layers' matmul weights (the stacked kernels: [layers, in, ...]), x3 for
    fwd+bwd; attention and the unembedding (over the completion positions) are added by hand."""
    config = ModelConfig(model_type="qwen2", vocab_size=50, hidden_size=16, intermediate_size=24, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=4)
    state = nnx.state(Decoder(config, rngs=nnx.Rngs(0)), nnx.Param)
    leaves = jax.tree_util.tree_leaves_with_path(state)
    matmul = sum(x.size for path, x in leaves if x.ndim >= 3 and "layers" in jax.tree_util.keystr(path))
    seq, head = 10, 4
    expected = 3 * (2 * matmul * seq + 4 * 2 * 16 * seq * seq + 2 * 16 * 50 * head)
    assert config.train_flops(seq, head) == pytest.approx(expected)
    prompt_tokens, widths = np.array([3, 3]), np.array([4, 4])
    plan = bucket_plan(prompt_tokens, widths, 1, 0, 3, 4)
    assert padded_flops_fraction(config, prompt_tokens, widths, plan) == pytest.approx(0.0)
    plan = bucket_plan(prompt_tokens, np.array([4, 1]), 1, 0, 3, 4)
    executed, real = 2 * config.train_flops(7, 4), config.train_flops(7, 4) + config.train_flops(4, 1)
    assert padded_flops_fraction(config, prompt_tokens, np.array([4, 1]), plan) == pytest.approx(1 - real / executed)


def test_bad_length_bucket_is_named():
    config = load_config("ring3")
    config.grpo.length_bucket = -1
    with pytest.raises(ValueError, match="grpo.length_bucket"):
        validate(config)


def test_cohort_step_with_length_buckets_equals_padded_update():
    """A `:tiny` cohort step (rent: dense rewards, so the gradient is not zero) with length_bucket 8 vs 0: the same
    parameters and loss after the step (same seed: same samples), and the padded-FLOPs fraction is logged."""
    results = {}
    for bucket in (0, 8):
        config = load_config("rent")
        # AdamW eps 1e-4: at 1e-8 a weight with a ~0 gradient moves by O(lr) on float noise alone (test_update_oracle)
        config.optim.update(learning_rate=1e-2, warmup_ratio=0.0, eps=1e-4)
        config.grpo.update(length_bucket=bucket, packing=False)
        validate(config)
        agents = load_agents(config, config.train.max_steps)
        metrics, _ = Cohort(config, agents).step(PromptBlock(step=1, epoch=0, problems=tuple(
            arithmetic.generate("rl", config.rollout.prompts_per_step))), 1)
        results[bucket] = agents, metrics
    (padded, m0), (bucketed, m4) = results[0], results[8]
    for a0, a4 in zip(padded, bucketed, strict=True):
        for x, y in zip(jax.tree.leaves(a0.params), jax.tree.leaves(a4.params), strict=True):
            np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-4, atol=1e-6)
        assert m4[a0.name]["loss"] == pytest.approx(m0[a0.name]["loss"], rel=1e-4, abs=1e-7)
        assert 0.0 <= m4[a0.name]["update/padded_flops_fraction"] <= m0[a0.name]["update/padded_flops_fraction"] < 1
