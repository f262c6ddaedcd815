"""The update's splash attention (Pallas TPU kernel, interpreted on CPU) against the decoder's XLA attention:
outputs at real tokens, gradients, a sharded call, and a deviceless compile for a TPU (libtpu)."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from corl_jax.models import Decoder, sharding
from corl_jax.models.config import ModelConfig, attention_impl
from corl_jax.models.decoder import _attention
from corl_jax.models.splash_attention import splash_attention


def _inputs(B, T, H, K, hd, lengths, seed=0):
    q, k, v = (jax.random.normal(jax.random.key(seed + i), s) for i, s in
               enumerate([(B, T, H, hd), (B, K, T, hd), (B, K, T, hd)]))
    token_mask = jnp.arange(T)[None] >= (T - jnp.asarray(lengths))[:, None]  # left padding
    token_mask = token_mask.at[0, -2].set(False)  # a padded slot inside a row (padded completion)
    full = jnp.tril(jnp.ones((T, T), bool))[None] & token_mask[:, None, :]
    return q, k, v, token_mask, full


def _config(H, K, hd, **kw):
    return ModelConfig.from_hf_dict({"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32,
                                     "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": H,
                                     "num_key_value_heads": K, "head_dim": hd}, **kw)


@pytest.mark.parametrize("hd", [64, 128])
def test_matches_xla_attention_at_real_tokens(hd):
    B, T, H, K = 2, 20, 4, 2  # T not a whole 128-token block: padded and stripped
    q, k, v, token_mask, full = _inputs(B, T, H, K, hd, [20, 9])
    got = splash_attention(q, k, v, token_mask, interpret=True)
    want = _attention(q, k, v, full, _config(H, K, hd))
    rows = np.asarray(token_mask)  # padding query rows are unused downstream
    np.testing.assert_allclose(np.asarray(got)[rows], np.asarray(want)[rows], atol=2e-5)


def test_gradients_match_xla_attention():
    B, T, H, K, hd = 2, 12, 4, 1, 64  # MQA
    q, k, v, token_mask, full = _inputs(B, T, H, K, hd, [12, 5], seed=3)
    weight = jax.random.normal(jax.random.key(9), q.shape) * token_mask[:, :, None, None]  # loss on real rows

    def loss(attend):
        return lambda q, k, v: jnp.sum(attend(q, k, v) * weight)

    got = jax.grad(loss(lambda q, k, v: splash_attention(q, k, v, token_mask, interpret=True)), (0, 1, 2))(q, k, v)
    want = jax.grad(loss(lambda q, k, v: _attention(q, k, v, full, _config(H, K, hd))), (0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=5e-5)


def test_sharded_decoder_forward_matches_xla():
    c = _config(4, 2, 64)
    model = Decoder(c, rngs=nnx.Rngs(0))
    mesh = sharding.make_mesh(data=2, tensor=2, devices=jax.devices()[:4])
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, sharding.state_shardings(state, mesh)))
    B, T = 4, 10
    ids = jax.random.randint(jax.random.key(1), (B, T), 0, 64)
    token_mask = jnp.arange(T)[None] >= jnp.asarray([0, 3, 6, 1])[:, None]
    positions = jnp.maximum(jnp.cumsum(token_mask, axis=1) - 1, 0)
    ids, positions, token_mask = (jax.device_put(x, sharding.batch_sharding(x.shape, mesh))
                                  for x in (ids, positions, token_mask))
    want = nnx.jit(lambda m, *a: m(*a))(model, ids, positions, token_mask)
    splash_model = nnx.merge(nnx.graphdef(Decoder(dataclasses.replace(c, attention="splash"), rngs=nnx.Rngs(0))),
                             nnx.state(model))
    with jax.set_mesh(mesh):
        lowered = nnx.jit(lambda m, *a: m(*a)).lower(splash_model, ids, positions, token_mask).as_text()
        got = nnx.jit(lambda m, *a: m(*a))(splash_model, ids, positions, token_mask)
    assert "shard_map" in lowered or "sdy.manual_computation" in lowered  # the kernel runs per shard
    rows = np.asarray(token_mask)
    np.testing.assert_allclose(np.asarray(got)[rows], np.asarray(want)[rows], atol=1e-4)


def test_auto_picks_splash_on_tpus_cudnn_on_gpus_with_bf16_else_xla():
    assert attention_impl("auto", "tpu", jnp.float32, 64) == "splash"
    assert attention_impl("auto", "gpu", jnp.bfloat16, 128) == "cudnn"
    assert attention_impl("auto", "gpu", jnp.float32, 128) == "xla"
    assert attention_impl("auto", "cpu", jnp.bfloat16, 128) == "xla"
    assert attention_impl("xla", "tpu", jnp.bfloat16, 128) == "xla"


HAVE_LIBTPU = os.path.isfile(os.environ.get("TPU_LIBRARY_PATH", ""))


@pytest.mark.skipif(not HAVE_LIBTPU, reason="needs libtpu: set TPU_LIBRARY_PATH (see test_compile_check)")
@pytest.mark.parametrize("hd", [64, 128])
def test_update_gradient_with_splash_compiles_for_v5e(hd):
    """The Mosaic kernel (forward and backward), per shard of a v5e-4 data x tensor mesh, lowers and compiles."""
    from corl_jax.compile_check import topology_devices

    devices, _ = topology_devices("v5e-4")
    mesh = sharding.make_mesh(data=2, tensor=2, devices=devices)
    B, T, H, K = 4, 200, 8, 2
    spec = lambda shape, logical: jax.ShapeDtypeStruct(  # noqa: E731
        shape, jnp.bfloat16, sharding=jax.sharding.NamedSharding(mesh, sharding.logical_to_spec(logical, shape, mesh)))
    q = spec((B, T, H, hd), ("batch", None, "heads", None))
    k = spec((B, K, T, hd), ("batch", "kv_heads", None, None))
    m = jax.ShapeDtypeStruct((B, T), bool, sharding=sharding.batch_sharding((B, T), mesh))

    def loss(q, k, v, m):
        return splash_attention(q, k, v, m).astype(jnp.float32).sum()

    with jax.set_mesh(mesh):
        lowered = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, k, k, m)
    text = lowered.as_text()
    assert text.count("tpu_custom_call") >= 3  # forward, dq and dkv kernels
    lowered.compile()
