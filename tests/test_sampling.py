"""Tests of corl_jax.sampling: sampling controls, the generation engine, and its parity with transformers."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
import scipy.stats

from corl_jax.sampling.controls import SamplingParams, _first_above, draw, sample_tokens, truncation_threshold

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


def test_draw_inverts_the_cdf_like_a_naive_float64_search():
    """Block-wise inverse CDF against the textbook one with the same uniform, over a vocabulary of several
    blocks (not a multiple of the block) with dropped tokens and a wholly dropped block."""
    rows, vocab = 512, 1000
    z = np.array(jax.random.normal(jax.random.key(7), (rows, vocab)) * 2, np.float32)
    z[:, ::3] = -np.inf
    z[:, 128:256] = -np.inf
    key = jax.random.key(8)
    tokens, normalizer = jax.jit(draw)(jnp.asarray(z), key)
    tokens = np.asarray(tokens)
    assert np.all(np.isfinite(z[np.arange(rows), tokens])), "drew a dropped token"
    np.testing.assert_allclose(normalizer, scipy.special.logsumexp(z.astype(np.float64), axis=-1), rtol=1e-6)
    u = np.asarray(jax.random.uniform(key, (rows,), jnp.float32), np.float64)
    cdf = np.cumsum(scipy.special.softmax(z.astype(np.float64), axis=-1), axis=-1)
    want = (cdf <= u[:, None]).sum(axis=-1)
    clear = np.abs(cdf - u[:, None]).min(axis=-1) > 1e-5  # u not within float32 rounding of a CDF step
    assert clear.sum() > 0.95 * rows
    np.testing.assert_array_equal(tokens[clear], want[clear])


def test_a_target_rounded_onto_the_total_mass_picks_the_last_kept_token():
    cumulative = jnp.array([[1.0, 2.0, 2.0, 2.0], [0.5, 1.5, 2.5, 3.0]])
    nonzero = jnp.array([[True, True, False, False], [True, True, True, True]])
    np.testing.assert_array_equal(_first_above(cumulative, jnp.array([2.0, 1.5]), nonzero), [1, 2])


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


# ----------------------------------------------------------------------------------------------
# The engine on tiny random checkpoints, against transformers.
# ----------------------------------------------------------------------------------------------

import torch  # noqa: E402  (CPU torch: the transformers oracle)
import transformers  # noqa: E402
from flax import nnx  # noqa: E402

import corl_jax.models as models  # noqa: E402
from corl_jax.models import sharding  # noqa: E402
from corl_jax.sampling import engine  # noqa: E402
from corl_jax.sampling.engine import Buckets, Sampler, segment_ends  # noqa: E402
from hf_tiny import hf_logits, make_tiny_hf_checkpoint  # noqa: E402

FAMILIES = {
    "qwen2": dict(num_key_value_heads=2),
    "llama": dict(num_key_value_heads=1, tie_word_embeddings=True),
    "qwen3": dict(num_key_value_heads=2, head_dim=24),
}
# Small buckets so that tiny tests cross several attention segments and extra prompt padding.
SMALL = Buckets(prompt=8, new_tokens=16, kv_block=8)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    built = {}

    def get(family):
        if family not in built:
            built[family] = make_tiny_hf_checkpoint(tmp_path_factory.mktemp(family), family, **FAMILIES[family])
        return built[family]

    return get


def mixed_length_prompts(lengths, width, seed=0, vocab=259):
    """Left-padded random prompts [P, width] (pad id 0) with the given real lengths."""
    rng = np.random.default_rng(seed)
    mask = np.arange(width)[None, :] >= width - np.asarray(lengths)[:, None]
    return np.where(mask, rng.integers(3, vocab, (len(lengths), width)), 0).astype(np.int32), mask


def hf_greedy(directory, ids, mask, max_new_tokens, stop_ids, pad_id):
    """transformers' greedy `generate`, padded to max_new_tokens with pad_id."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        out = model.generate(torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask, dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(stop_ids) or None,
                             pad_token_id=pad_id)
    new = out[:, ids.shape[1]:].numpy()
    return np.pad(new, ((0, 0), (0, max_new_tokens - new.shape[1])), constant_values=pad_id)


def sampler_for(directory, buckets=SMALL, stop_ids=(), mesh=None, attention="xla"):
    policy = models.from_pretrained(directory, dtype=jnp.float32, mesh=mesh)
    return Sampler(policy.model, stop_ids=stop_ids, pad_id=0, mesh=mesh, buckets=buckets, attention=attention)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_equals_transformers_generate(family, checkpoint):
    directory = checkpoint(family)
    ids, mask = mixed_length_prompts([11, 3, 7], 11)  # prompt bucket 8 -> width 16
    sampler = sampler_for(directory)
    out = sampler.generate(ids, mask, num_samples=2, max_new_tokens=24, params=SamplingParams(greedy=True),
                           key=jax.random.key(0))
    want = hf_greedy(directory, ids, mask, 24, stop_ids=(), pad_id=0)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.repeat(want, 2, axis=0))
    assert np.all(out.mask) and np.all(out.lengths == 24) and np.all(out.truncated)


def test_attention_segments_and_the_pallas_kernel_do_not_change_the_result(checkpoint):
    directory = checkpoint("qwen3")
    ids, mask = mixed_length_prompts([5, 9], 9, seed=1)
    params = SamplingParams(temperature=0.8)
    results = [
        sampler_for(directory, Buckets(prompt=4, new_tokens=40, kv_block=block), attention=attention).generate(
            ids, mask, num_samples=3, max_new_tokens=37, params=params, key=jax.random.key(7))
        for block, attention in ((0, "xla"), (5, "xla"), (16, "xla"), (0, "pallas"))
    ]
    for other in results[1:]:
        np.testing.assert_array_equal(np.asarray(other.tokens), np.asarray(results[0].tokens))
        np.testing.assert_allclose(np.asarray(other.logprobs), np.asarray(results[0].logprobs), atol=1e-5)
    assert segment_ends(40, 16) == (16, 32, 40) and segment_ends(40, 0) == (40,)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.7, top_p=0.9, min_p=0.01), SamplingParams(temperature=1.2, top_k=20, logprobs="raw")],
    ids=str,
)
def test_logprobs_equal_teacher_forced_forward(params, checkpoint):
    directory = checkpoint("qwen2")
    ids, mask = mixed_length_prompts([6, 10], 10, seed=2)
    out = sampler_for(directory).generate(ids, mask, num_samples=2, max_new_tokens=12, params=params,
                                          key=jax.random.key(3))
    tokens, logprobs = np.asarray(out.tokens), np.asarray(out.logprobs)
    full_ids = np.concatenate([np.repeat(ids, 2, axis=0), tokens], axis=1)
    full_mask = np.concatenate([np.repeat(mask, 2, axis=0), np.ones_like(tokens, bool)], axis=1)
    # logits predicting completion token t sit at column (prompt width - 1 + t)
    logits = hf_logits(directory, full_ids, full_mask)[:, ids.shape[1] - 1:-1]
    for row in range(tokens.shape[0]):
        if params.logprobs == "raw":
            want = scipy.special.log_softmax(logits[row].astype(np.float64), axis=-1)
        else:
            with np.errstate(divide="ignore"):  # log(0) for dropped tokens, never sampled
                want = np.log(reference_kept_probs(logits[row], params))
        np.testing.assert_allclose(logprobs[row], want[np.arange(tokens.shape[1]), tokens[row]], atol=1e-4)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, top_p=0.8), SamplingParams(temperature=1.3, top_k=12)],
                         ids=str)
def test_first_token_frequencies_match_the_model(params, checkpoint):
    """Chi-square of 4000 samples of one prompt's first token against the model's truncated softmax."""
    directory = checkpoint("llama")
    ids, mask = mixed_length_prompts([7], 7, seed=4)
    draws = 4000
    out = sampler_for(directory).generate(ids, mask, num_samples=draws, max_new_tokens=1, params=params,
                                          key=jax.random.key(5))
    want = reference_kept_probs(hf_logits(directory, ids, mask)[:, -1], params)[0]
    counts = np.bincount(np.asarray(out.tokens[:, 0]), minlength=want.size)
    kept = want > 0
    assert counts[~kept].sum() == 0
    assert kept.sum() > 3, "the test needs a non-trivial truncated distribution"
    result = scipy.stats.chisquare(counts[kept], draws * want[kept])
    assert result.pvalue > 1e-3, result


def test_stop_tokens_end_rows_and_belong_to_the_completion(checkpoint):
    directory = checkpoint("qwen2")
    ids, mask = mixed_length_prompts([4, 8, 6], 8, seed=6)
    greedy = SamplingParams(greedy=True)
    free = sampler_for(directory).generate(ids, mask, num_samples=1, max_new_tokens=20, params=greedy,
                                           key=jax.random.key(0))
    free_tokens = np.asarray(free.tokens)
    stop = int(free_tokens[0, 4])  # row 0 stops at its first occurrence of this token
    out = sampler_for(directory, stop_ids=(stop,)).generate(ids, mask, num_samples=1, max_new_tokens=20,
                                                            params=greedy, key=jax.random.key(0))
    tokens, out_mask = np.asarray(out.tokens), np.asarray(out.mask)
    np.testing.assert_array_equal(tokens, hf_greedy(directory, ids, mask, 20, stop_ids=(stop,), pad_id=0))
    for row in range(3):
        hits = np.flatnonzero(free_tokens[row] == stop)
        length = hits[0] + 1 if hits.size else 20
        assert out.lengths[row] == length and bool(out.truncated[row]) == (hits.size == 0)
        np.testing.assert_array_equal(out_mask[row], np.arange(20) < length)
        np.testing.assert_array_equal(tokens[row, :length], free_tokens[row, :length])
        assert np.all(tokens[row, length:] == 0) and np.all(np.asarray(out.logprobs)[row, length:] == 0)
    assert not out.truncated[0] and tokens[0, out.lengths[0] - 1] == stop


def test_deterministic_for_a_key_and_compiled_once_per_bucket(checkpoint, caplog):
    directory = checkpoint("qwen3")
    ids, mask = mixed_length_prompts([5, 3], 5, seed=8)
    sampler = sampler_for(directory)
    params = SamplingParams(temperature=1.0)
    with caplog.at_level("INFO", logger="corl_jax.sampling.engine"):
        a = sampler.generate(ids, mask, num_samples=2, max_new_tokens=10, params=params, key=jax.random.key(1))
        b = sampler.generate(ids, mask, num_samples=2, max_new_tokens=10, params=params, key=jax.random.key(1))
        c = sampler.generate(ids, mask, num_samples=2, max_new_tokens=14, params=params, key=jax.random.key(2))
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert c.tokens.shape == (4, 14) and not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens)[:, :10])
    compiles = [r for r in caplog.records if "compiling" in r.getMessage()]
    assert len(compiles) == 1 and "'new_tokens': 16" in compiles[0].getMessage()
    raw_key = sampler.generate(ids, mask, num_samples=2, max_new_tokens=10, params=params, key=jax.random.PRNGKey(1))
    np.testing.assert_array_equal(np.asarray(raw_key.tokens), np.asarray(a.tokens))  # same seed, legacy key


def test_auto_attention_avoids_the_kernel_for_a_head_dim_triton_cannot_tile(checkpoint, monkeypatch):
    model = models.from_pretrained(checkpoint("qwen3"), dtype=jnp.float32).model  # head_dim 24
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert Sampler(model, stop_ids=[0]).attention == "xla"
    ids, mask = mixed_length_prompts([3], 4, seed=0)
    with pytest.raises(ValueError, match="head_dim 24 is not a power of two.*attention='xla'"):
        Sampler(model, stop_ids=[0], attention="pallas", compiler_options={}).generate(
            ids, mask, num_samples=1, max_new_tokens=2, params=SamplingParams(), key=jax.random.key(0))
    four = models.from_pretrained(checkpoint("llama"), dtype=jnp.float32).model
    assert four.config.head_dim & (four.config.head_dim - 1) == 0
    assert Sampler(four, stop_ids=[0]).attention == "pallas"


def test_auto_attention_on_tpu_takes_the_kernel_for_whole_lane_tiles(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    for head_dim, want in ((128, "pallas"), (64, "xla")):
        config = models.ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=32,
                                    num_layers=1, num_heads=2, num_kv_heads=1, head_dim=head_dim)
        model = nnx.eval_shape(lambda: models.Decoder(config, rngs=nnx.Rngs(0)))
        assert Sampler(model, stop_ids=[0]).attention == want


@pytest.mark.parametrize("attention", ["xla", "pallas", "pallas_tpu"])
def test_sharded_over_eight_devices_equals_single_device(attention, checkpoint, monkeypatch):
    """Batch over the data axis, kv heads over tensor; the Pallas kernel runs per shard (shard_map). pallas_tpu: the
    TPU (Mosaic) kernel, interpreted, in the whole sampling program."""
    assert jax.device_count() == 8, "tests/conftest.py provides 8 fake CPU devices"
    if attention == "pallas_tpu":
        kernel = engine.decode_attention
        monkeypatch.setattr(engine, "decode_attention",
                            lambda *args, backend, **kw: kernel(*args, backend="tpu", interpret=True, **kw))
        attention = "pallas"
    directory = checkpoint("llama")
    ids, mask = mixed_length_prompts([3, 8, 5, 6, 2, 7, 4, 8], 8, seed=9)
    params = SamplingParams(temperature=0.9, top_p=0.95)
    kwargs = dict(num_samples=2, max_new_tokens=12, params=params, key=jax.random.key(11))
    single = sampler_for(directory).generate(ids, mask, **kwargs)
    mesh = sharding.make_mesh(data=4, tensor=2)
    sharded = sampler_for(directory, mesh=mesh, attention=attention).generate(ids, mask, **kwargs)
    assert len(sharded.tokens.sharding.device_set) == 8
    np.testing.assert_array_equal(np.asarray(sharded.tokens), np.asarray(single.tokens))
    np.testing.assert_allclose(np.asarray(sharded.logprobs), np.asarray(single.logprobs), atol=1e-5)


@pytest.mark.parametrize(
    "ids, mask, message",
    [
        (np.array([[1, 2], [3, 4]]), np.array([[True, True], [False, False]]), "no tokens"),
        (np.array([[1, 2, 3]]), np.array([[True, False, True]]), "left-padded"),
        (np.array([[1, 999]]), np.array([[True, True]]), r"\[0, 272\)"),
        (np.array([1, 2]), np.array([True, True]), r"\[P, Tp\]"),
    ],
)
def test_bad_prompts_are_rejected(ids, mask, message, checkpoint):
    sampler = sampler_for(checkpoint("qwen2"))
    with pytest.raises(ValueError, match=message):
        sampler.generate(ids, mask, num_samples=1, max_new_tokens=4, params=SamplingParams(), key=jax.random.key(0))


# ----------------------------------------------------------------------------------------------
# The real SmolLM2-135M-Instruct, real chat prompts, and the text helper.
# ----------------------------------------------------------------------------------------------

from corl_jax import tokenization  # noqa: E402
from corl_jax.models import smollm2  # noqa: E402
from corl_jax.sampling.text import generate_texts  # noqa: E402

PROBLEMS = [  # MATH-500 problems (test set, as bundled by the reference)
    "What is the value of $513^2 - 487^2$?",
    "Simplify $\\sqrt{242}$.",
    "How many positive whole-number divisors does 196 have?",
]


def test_smollm2_greedy_equals_transformers_on_chat_prompts():
    directory = smollm2.smollm2_hf_dir()
    policy = models.from_pretrained(directory, dtype=jnp.float32)
    stop_ids = tokenization.stop_token_ids(policy.tokenizer, directory)
    sampler = Sampler.from_policy(policy, stop_ids=stop_ids, buckets=Buckets(prompt=16, new_tokens=48, kv_block=16))
    texts, out = generate_texts(sampler, policy.tokenizer, PROBLEMS, num_samples=1, max_new_tokens=40,
                                params=SamplingParams(greedy=True), key=jax.random.key(0))
    ids, mask = tokenization.encode_prompts(policy.tokenizer, PROBLEMS, bucket=16)
    assert len(set(mask.sum(1).tolist())) == 3, "the batch should mix prompt lengths"
    want = hf_greedy(directory, ids, mask, 40, stop_ids=stop_ids, pad_id=policy.tokenizer.pad_token_id)
    np.testing.assert_array_equal(np.asarray(out.tokens), want)
    assert np.asarray(out.lengths).min() >= 32, "at least 32 new tokens are compared in every row"
    assert texts == [[t] for t in policy.tokenizer.batch_decode(
        [row[keep].tolist() for row, keep in zip(want, np.asarray(out.mask))], skip_special_tokens=True)]
    assert all(t[0].strip() for t in texts)
