"""The Pallas decode-attention kernels (Triton and Mosaic/TPU, interpreted on CPU) against a naive per-row, per-head
softmax."""

import jax.numpy as jnp
import numpy as np
import pytest

from corl_jax.models.decode_attention import decode_attention


def naive(q, k_cache, v_cache, layer, start, end):
    B, H, hd = q.shape
    group = H // k_cache.shape[2]
    out = np.zeros((B, H, hd))
    for b in range(B):
        for h in range(H):
            k = k_cache[layer, b, h // group, start[b]:end[b]]
            v = v_cache[layer, b, h // group, start[b]:end[b]]
            scores = k @ q[b, h] / np.sqrt(hd)
            p = np.exp(scores - scores.max())
            out[b, h] = (p / p.sum()) @ v
    return out


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (4, 4), (8, 1)])
def test_matches_naive_attention_over_filled_slots(heads, kv_heads, backend):
    rng = np.random.default_rng(heads * 10 + kv_heads)
    L, B, S, hd = 2, 5, 96, 16
    k_cache, v_cache = (rng.normal(size=(L, B, kv_heads, S, hd)).astype(np.float32) for _ in range(2))
    q = rng.normal(size=(B, heads, hd)).astype(np.float32)
    # one slot, a block boundary, a whole split, the whole cache, a span across splits
    start = np.array([40, 16, 0, 0, 5], np.int32)
    end = np.array([41, 48, 32, 96, 70], np.int32)
    out = decode_attention(jnp.asarray(q), jnp.asarray(k_cache), jnp.asarray(v_cache), 1, jnp.asarray(start),
                           jnp.asarray(end), block_k=16, split=32, backend=backend, interpret=True)
    np.testing.assert_allclose(np.asarray(out), naive(q, k_cache, v_cache, 1, start, end), atol=1e-5)


def test_rejects_a_cache_that_is_not_whole_blocks():
    q = jnp.zeros((1, 2, 8))
    cache = jnp.zeros((1, 1, 1, 40, 8))
    with pytest.raises(ValueError, match="multiples of block_k"):
        decode_attention(q, cache, cache, 0, jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32), block_k=16, split=32)


def test_rejects_a_head_dim_triton_cannot_tile():
    q = jnp.zeros((1, 2, 24))
    cache = jnp.zeros((1, 1, 1, 32, 24))
    with pytest.raises(ValueError, match="head_dim 24 is not a power of two.*attention='xla'"):
        decode_attention(q, cache, cache, 0, jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32), block_k=16, split=32,
                         interpret=False)  # the compiled (GPU) kernel; the interpreter takes any head_dim


def test_tpu_kernel_rejects_a_head_dim_it_cannot_read_in_place():
    q = jnp.zeros((1, 2, 64))
    cache = jnp.zeros((1, 1, 1, 32, 64))
    with pytest.raises(ValueError, match="head_dim 64 is not a multiple of 128.*attention='xla'"):
        decode_attention(q, cache, cache, 0, jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32), block_k=16, split=32,
                         backend="tpu")  # compiled for a TPU (not interpreted)
