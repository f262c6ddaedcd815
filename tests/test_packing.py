"""Packed GRPO update (`grpo.packing`, corl_jax/packing.py): the plan against a naive check of its invariants, the
packed micro-batch arrays, the decoder's segment mask against transformers run row by row, splash's segments
against the XLA mask, the padded-FLOPs count by hand, and the composed cohort step packed vs padded. (The packed
update against the torch transcription of the reference step, every loss type: tests/test_update_oracle.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from config_files import load_config
from corl_jax import models
from corl_jax.cohort import Cohort, load_agents
from corl_jax.config import validate
from corl_jax.data import PromptBlock
from corl_jax.demo import arithmetic
from corl_jax.models import ModelConfig
from corl_jax.models.decoder import _attention
from corl_jax.models.splash_attention import splash_attention
from corl_jax.packing import HEAD_STEPS, pack_plan, packed_flops_fraction, packed_micro
from hf_tiny import hf_logits, make_tiny_hf_checkpoint


def _rows(prompt_tokens, widths, prompt_len, completion_len, seed=0):
    """Left-padded prompts + right-padded completions: tokens, attention [N, prompt_len + completion_len]."""
    rng = np.random.default_rng(seed)
    n = len(prompt_tokens)
    columns = np.arange(prompt_len + completion_len)[None]
    attention = ((columns >= prompt_len - np.asarray(prompt_tokens)[:, None])
                 & (columns < prompt_len + np.asarray(widths)[:, None]))
    tokens = np.where(attention, rng.integers(1, 250, (n, prompt_len + completion_len)), 0).astype(np.int32)
    return tokens, attention


def test_plan_places_every_row_once_within_its_line_and_fills_lines():
    rng = np.random.default_rng(1)
    prompt_tokens, widths = rng.integers(1, 40, 64), rng.integers(0, 200, 64)
    widths[:5] = 200  # full-width rows: a line to themselves
    plan = pack_plan(prompt_tokens, widths, 4, 240, 16)
    lengths = prompt_tokens + widths
    for line in np.unique(plan.line):  # naive: the rows of a line are disjoint intervals inside it
        rows = np.flatnonzero(plan.line == line)
        spans = sorted((plan.offset[r], plan.offset[r] + lengths[r]) for r in rows)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        micro = line // plan.lines_per_micro
        assert spans[-1][1] <= plan.widths[micro] <= 240 and plan.widths[micro] % 16 == 0
    assert plan.num_micro == len(plan.widths) == len(plan.heads)
    assert sorted(np.concatenate([plan.rows_of(m) for m in range(plan.num_micro)])) == list(range(64))
    # fewer micro-batches than the unpacked 16 of 4 rows, and no fewer than the tokens need
    assert -(-lengths.sum() // (4 * 240)) <= plan.num_micro < 16
    for m in range(plan.num_micro):  # scored positions: the micro-batch's completion tokens over its lines, rounded
        need, step = widths[plan.rows_of(m)].sum(), plan.widths[m] // HEAD_STEPS
        assert need <= 4 * plan.heads[m] < need + 4 * step + 4 and plan.heads[m] % step == 0


def test_plan_rejects_rows_it_cannot_place():
    with pytest.raises(ValueError, match="does not fit a line of 10"):
        pack_plan(np.array([3, 4]), np.array([2, 7]), 2, 10, 2)
    with pytest.raises(ValueError, match="at least one prompt token"):
        pack_plan(np.array([0, 4]), np.array([2, 3]), 2, 10, 2)


def test_packed_micro_arrays_rebuild_each_row():
    prompt_len, completion_len = 6, 9
    prompt_tokens, widths = np.array([6, 2, 3, 1, 4]), np.array([9, 4, 0, 7, 2])
    tokens, attention = _rows(prompt_tokens, widths, prompt_len, completion_len)
    plan = pack_plan(prompt_tokens, widths, 2, prompt_len + completion_len, 4)
    seen = 0
    for m in range(plan.num_micro):
        micro = packed_micro(tokens, attention, prompt_len, prompt_tokens, widths, plan, m)
        flat = {k: micro[k].reshape(-1) for k in ("tokens", "positions", "segments")}
        W = micro["tokens"].shape[1]
        for row in plan.rows_of(m):
            seen += 1
            start = (plan.line[row] - m * plan.lines_per_micro) * W + plan.offset[row]
            real = tokens[row][attention[row]]
            span = slice(start, start + len(real))
            np.testing.assert_array_equal(flat["tokens"][span], real)
            np.testing.assert_array_equal(flat["positions"][span], np.arange(len(real)))
            assert len(set(flat["segments"][span])) == 1 and flat["segments"][span][0] > 0
            # each completion column j is scored at the position before it, and reads its own token
            slots = micro["row_index"][row, :widths[row]]
            head = micro["head_index"].reshape(-1)[slots]
            np.testing.assert_array_equal(head, start + prompt_tokens[row] - 1 + np.arange(widths[row]))
            np.testing.assert_array_equal(micro["targets"].reshape(-1)[slots],
                                          tokens[row, prompt_len:prompt_len + widths[row]])
            assert micro["scored"][row].sum() == widths[row] and micro["scored"][row, :widths[row]].all()
        others = np.setdiff1d(np.arange(len(tokens)), plan.rows_of(m))
        assert not micro["scored"][others].any()
        segments = micro["segments"][micro["segments"] > 0]
        assert len(np.unique(segments)) == len(plan.rows_of(m))
    assert seen == len(tokens)


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_packed_forward_equals_transformers_on_each_row(family, tmp_path):
    """Rows packed end to end, each its own segment with positions from 0: the logits at every real token equal
    transformers' on that row alone (the independent oracle for the segment mask and restarted RoPE)."""
    directory = make_tiny_hf_checkpoint(tmp_path / family, family, seed=5)
    policy = models.from_pretrained(directory, dtype=jnp.float32)
    lengths = [13, 5, 9, 1, 20]
    rng = np.random.default_rng(2)
    rows = [rng.integers(1, 250, n).astype(np.int32) for n in lengths]
    line_of, width = [0, 0, 0, 1, 1], 32
    tokens, positions, segments = (np.zeros((2, width), np.int32) for _ in range(3))
    offsets, used = [], [0, 0]
    for segment, (row, line) in enumerate(zip(rows, line_of), start=1):
        span = slice(used[line], used[line] + len(row))
        tokens[line, span], positions[line, span], segments[line, span] = row, np.arange(len(row)), segment
        offsets.append(used[line])
        used[line] += len(row)
    hidden = policy.model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments))
    ours = np.asarray(policy.model.logits(hidden))
    for row, line, offset in zip(rows, line_of, offsets):
        theirs = hf_logits(directory, row[None], np.ones((1, len(row)), bool))[0]
        np.testing.assert_allclose(ours[line, offset:offset + len(row)], theirs, atol=1e-4)


def test_splash_segments_equal_the_xla_segment_mask():
    B, T, H, K, hd = 2, 24, 4, 2, 64
    q, k, v = (jax.random.normal(jax.random.key(i), s) for i, s in
               enumerate([(B, T, H, hd), (B, K, T, hd), (B, K, T, hd)]))
    segments = np.zeros((B, T), np.int32)
    segments[0, :7], segments[0, 7:19], segments[0, 19:22] = 1, 2, 3
    segments[1, :24] = np.repeat([1, 2], 12)
    seg = jnp.asarray(segments)
    full = (jnp.tril(jnp.ones((T, T), bool))[None] & (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0))
    config = ModelConfig.from_hf_dict({"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32,
                                       "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": H,
                                       "num_key_value_heads": K, "head_dim": hd})
    got = splash_attention(q, k, v, seg, interpret=True)
    want = _attention(q, k, v, full, config)
    real = segments > 0
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=2e-5)


def test_packed_flops_count_by_hand():
    config = ModelConfig(model_type="qwen2", vocab_size=50, hidden_size=16, intermediate_size=24, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=4)
    prompt_tokens, widths = np.array([3, 2, 4]), np.array([5, 1, 4])  # rows of 8, 3, 8 tokens in lines of 11
    plan = pack_plan(prompt_tokens, widths, 2, 11, 1)
    assert plan.num_micro == 1 and list(plan.widths) == [11] and list(plan.heads) == [5]
    executed = 2 * config.train_flops(11, 5)
    real = config.train_flops(8, 5) + config.train_flops(3, 1) + config.train_flops(8, 4)
    assert packed_flops_fraction(config, prompt_tokens, widths, plan) == pytest.approx(1 - real / executed)


def test_packing_needs_a_width_rounding():
    config = load_config("ring3")
    config.grpo.update(packing=True, length_bucket=0)
    with pytest.raises(ValueError, match="grpo.packing.*length_bucket"):
        validate(config)


@pytest.mark.parametrize("method, packed_mesh", [("rent", dict(data=1)), ("ttrl", dict(data=2, fsdp=2))])
def test_cohort_step_packed_equals_padded_update(method, packed_mesh):
    """A `:tiny` cohort step packed vs padded on one device (same seed: same samples): the same parameters, loss
    and loss metrics after the step, and a smaller padded-FLOPs fraction. rent's dense rewards make the gradient
    non-zero; ttrl runs the importance-sampling correction from packed old log-probs, packed on a 2 x 2 data/fsdp
    mesh (lines split over data, parameters over fsdp)."""
    results = {}
    for packing in (False, True):
        config = load_config(method)
        if packing:
            config.mesh.update(packed_mesh)
        # AdamW eps 1e-4: at 1e-8 a weight with a ~0 gradient moves by O(lr) on float noise alone (test_update_oracle)
        config.optim.update(learning_rate=1e-2, warmup_ratio=0.0, eps=1e-4)
        config.grpo.update(length_bucket=8 if packing else 0, packing=packing)
        validate(config)
        agents = load_agents(config, config.train.max_steps)
        metrics, _ = Cohort(config, agents).step(PromptBlock(step=1, epoch=0, problems=tuple(
            arithmetic.generate("rl", config.rollout.prompts_per_step))), 1)
        results[packing] = agents, metrics
    (padded, m0), (packed, m1) = results[False], results[True]
    for a0, a1 in zip(padded, packed, strict=True):
        for x, y in zip(jax.tree.leaves(a0.params), jax.tree.leaves(a1.params), strict=True):
            np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-4, atol=1e-6)
        for key in ("loss", "grad_norm", "clip_ratio/region_mean", "entropy"):
            if key in m0[a0.name]:
                assert m1[a0.name][key] == pytest.approx(m0[a0.name][key], rel=1e-4, abs=1e-7), key
        assert 0.0 <= m1[a0.name]["update/padded_flops_fraction"] < m0[a0.name]["update/padded_flops_fraction"]
