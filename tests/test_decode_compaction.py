"""Decode compaction (`Sampler(compaction=n)`, `rollout.decode_compaction`) and forced completion lengths: the
compacted decode loop samples the same tokens as the uncompacted one (greedy and sampled, both attention paths,
through the cohort), and forced lengths end every row where asked."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from config_files import load_config
from corl_jax.cohort import Cohort, load_agents
from corl_jax.config import ConfigError, validate
from corl_jax.data import PromptBlock
from corl_jax.demo import arithmetic
from corl_jax.models import sharding
from corl_jax.sampling.controls import SamplingParams
from corl_jax.sampling.engine import Buckets
from test_sampling import SMALL, checkpoint, mixed_length_prompts, sampler_for  # noqa: F401  (fixture)

STOPS = tuple(range(3, 259, 12))  # ~8% of the vocabulary: sampled rows stop after ~12 tokens, at spread-out steps


def generate(directory, compaction, params, *, attention="xla", buckets=SMALL, max_new_tokens=40, seed=0,
             forced_lengths=None, stop_ids=STOPS):
    sampler = sampler_for(directory, buckets, stop_ids=stop_ids, attention=attention)
    sampler.compaction = compaction
    ids, mask = mixed_length_prompts([7, 3, 5], 7, seed=seed)
    return sampler.generate(ids, mask, num_samples=4, max_new_tokens=max_new_tokens, params=params,
                            key=jax.random.key(seed), forced_lengths=forced_lengths)


def assert_same(a, b):
    for field in ("tokens", "mask", "lengths", "truncated"):
        np.testing.assert_array_equal(np.asarray(getattr(b, field)), np.asarray(getattr(a, field)), err_msg=field)
    np.testing.assert_allclose(np.asarray(b.logprobs), np.asarray(a.logprobs), atol=1e-5)


@pytest.mark.parametrize("params", [SamplingParams(greedy=True), SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.8, top_p=0.9)], ids=str)
def test_compaction_samples_the_same_tokens(params, checkpoint):  # noqa: F811
    directory = checkpoint("qwen2")
    off = generate(directory, 0, params, stop_ids=() if params.greedy else STOPS)
    if params.greedy:  # the tiny model's greedy rows rarely stop by themselves: stop on a token each row emits
        tokens = np.asarray(off.tokens)
        stops = tuple(sorted({int(tokens[row, 4 + 3 * row]) for row in range(0, 12, 2)}))
        off = generate(directory, 0, params, stop_ids=stops)
    else:
        stops = STOPS
    lengths = np.asarray(off.lengths)
    assert len(set(lengths.tolist())) >= 3 and lengths.min() < 10, "the test needs rows ending at spread steps"
    for compaction in (1, 2):
        assert_same(off, generate(directory, compaction, params, stop_ids=stops))


def test_compaction_with_the_pallas_kernel_and_one_segment(checkpoint):  # noqa: F811
    directory = checkpoint("qwen3")
    params = SamplingParams(temperature=1.0)
    buckets = Buckets(prompt=4, new_tokens=40, kv_block=0)
    off = generate(directory, 0, params, attention="pallas", buckets=buckets, seed=3)
    assert_same(off, generate(directory, 2, params, attention="pallas", buckets=buckets, seed=3))


@pytest.mark.parametrize("attention", ["xla", "pallas"])
def test_compaction_on_a_mesh_samples_the_same_tokens(attention, checkpoint):  # noqa: F811
    """Batch over 4 data shards, kv heads over 2 tensor shards: each stage's rows are every batch shard's own
    leading cache rows, moved across shards when rows finish unevenly; the tokens are the single device's."""
    directory = checkpoint("llama")
    ids, mask = mixed_length_prompts([3, 8, 5, 6], 8, seed=5)
    kwargs = dict(num_samples=4, max_new_tokens=40, params=SamplingParams(temperature=1.0), key=jax.random.key(2))
    single = sampler_for(directory, stop_ids=STOPS).generate(ids, mask, **kwargs)
    lengths = np.asarray(single.lengths)
    assert len(set(lengths.tolist())) >= 4 and lengths.min() < 10, "the test needs rows ending at spread steps"
    sampler = sampler_for(directory, stop_ids=STOPS, mesh=sharding.make_mesh(data=4, tensor=2), attention=attention)
    sampler.compaction = 2  # stages of 16, 8 and 4 rows: 4, 2 and 1 per batch shard
    assert sampler.batch_shards(16) == 4
    sharded = sampler.generate(ids, mask, **kwargs)
    assert len(sharded.tokens.sharding.device_set) == 8
    assert_same(single, sharded)


def test_forced_lengths_end_rows_where_asked(checkpoint):  # noqa: F811
    directory = checkpoint("llama")
    forced = np.array([1, 40, 3, 55, 7, 12, 2, 9, 30, 41, 5, 18])  # 55 and 41 exceed the budget: truncated
    params = SamplingParams(temperature=1.0)
    off = generate(directory, 0, params, forced_lengths=forced, stop_ids=(7, 9))
    lengths, tokens = np.asarray(off.lengths), np.asarray(off.tokens)
    np.testing.assert_array_equal(lengths, np.minimum(forced, 40))
    np.testing.assert_array_equal(np.asarray(off.truncated), forced > 40)
    for row, length in enumerate(lengths):
        if forced[row] <= 40:
            assert tokens[row, length - 1] == 7
        assert np.all(tokens[row, length:] == 0)
    assert_same(off, generate(directory, 2, params, forced_lengths=forced, stop_ids=(7, 9)))
    with pytest.raises(ValueError, match="forced_lengths must be 12 lengths >= 1"):
        generate(directory, 0, params, forced_lengths=forced[:5])


def test_bad_compaction_is_named(checkpoint):  # noqa: F811
    directory = checkpoint("qwen2")
    with pytest.raises(ValueError, match="decode compaction 3 halves the batch of 12 rows"):
        generate(directory, 3, SamplingParams(greedy=True))
    with pytest.raises(ValueError, match="integer >= 0"):
        sampler_for(directory).__class__(sampler_for(directory).model, stop_ids=(), compaction=-1)
    config = load_config("ring3")
    for value, message in ((-1, "not an integer >= 0"), (20, "do not divide")):
        config.rollout.decode_compaction = value
        with pytest.raises(ConfigError, match=f"rollout.decode_compaction.*{message}"):
            validate(config)


def test_cohort_samples_the_same_completions_with_compaction():
    """The composed path: `rollout.decode_compaction` reaches the agent's sampler, and `Cohort.sample` returns the
    same completions with it on."""
    results = {}
    for compaction in (0, 2):
        config = load_config("rent")
        config.rollout.decode_compaction = compaction
        validate(config)
        agents = load_agents(config, config.train.max_steps)
        for a in agents:  # the tiny model's rows rarely stop by themselves: stop on ~8% of the vocabulary
            a.sampler.stop_ids = np.asarray(STOPS, np.int32)
        cohort = Cohort(config, agents)
        block = PromptBlock(step=1, epoch=0, problems=tuple(arithmetic.generate("rl", config.rollout.prompts_per_step)))
        r = config.rollout
        results[compaction] = [
            cohort.sample(a, block.texts(a.text_field), a.step_key(1, 0), num_samples=r.num_generations,
                          max_new_tokens=r.max_new_tokens, temperature=r.temperature).completions for a in agents]
        assert all(a.sampler.compaction == compaction for a in agents)
    lengths = np.concatenate([np.asarray(c.lengths) for c in results[0]])
    assert len(set(lengths.tolist())) > 1, "the test needs rows of different lengths"
    for off, on in zip(results[0], results[2], strict=True):
        assert_same(off, on)
