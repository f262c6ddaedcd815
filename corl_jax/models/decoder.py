"""One Flax NNX decoder for Qwen2/2.5, Llama-3.x and Qwen3 (families differ by `ModelConfig` flags).

Parameters of the L transformer blocks are stacked with a leading layer axis (`decoder.layers.*`,
shape [L, ...]) and applied with one `jax.lax.scan`; every parameter carries `logical_axes`
metadata used by `corl_jax.models.sharding`.

Call paths (all return hidden states after the final RMSNorm; logits are `decoder.logits(hidden)`
or chunks of `hidden @ decoder.unembedding()`):

* Training / scoring: `decoder(input_ids, positions, attention_mask) -> [B, T, D]`.
* Sampling with a KV cache (`KVCache`, see its docstring):
  `cache = decoder.init_cache(batch, max_len)`,
  `last_hidden, cache = decoder.prefill(ids, positions, mask, cache)`,
  `hidden, cache = decoder.decode_step(tokens, positions, cache, attend_len=...)`.

Batches are left-padded; `positions = max(cumsum(mask) - 1, 0)` (see `positions_from_mask`).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from corl_jax.models.config import ModelConfig

_F32 = jnp.float32
_MASKED = jnp.finfo(_F32).min  # finite, so fully-masked (padding) query rows stay NaN-free

_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
    """RoPE positions [B, T] int32 of a left-padded batch: count of real tokens before each one."""
    return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)


@flax.struct.dataclass
class KVCache:
    """Stacked per-layer key/value cache for incremental decoding.

    k, v:  [L, B, H_kv, S, head_dim] in the cache dtype. Slot s of row b holds the key/value of the
           token written at step s (prompt tokens first, then one slot per decode step). Slots are
           the second-minor axis so that an attended prefix [:, :, :, :attend_len] is already in
           the (batch, kv-head, slot, dim) layout of the attention matmuls: no per-step transpose.
    mask:  [B, S] bool, True where a slot holds a real token (left padding stays False).
    index: int32 scalar, the next slot to write; shared by all rows (left-padded prompts end in
           the same column, so every row writes its t-th new token into the same slot).

    Decoder methods update the cache functionally (`dynamic_update_slice` on the scan carry, so
    under `jit` with donation XLA writes in place). `max_len` is S; callers keep
    index + new tokens <= S (a write past the end is clamped by XLA, not reported).
    """

    k: jax.Array
    v: jax.Array
    mask: jax.Array
    index: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def repeat_batch(self, n: int) -> "KVCache":
        """Each row repeated n times consecutively (row b -> rows b*n .. b*n+n-1), e.g. to share one
        prefilled prompt among its n samples."""
        return self.replace(
            k=jnp.repeat(self.k, n, axis=1), v=jnp.repeat(self.v, n, axis=1), mask=jnp.repeat(self.mask, n, axis=0)
        )

    @staticmethod
    def logical_axes() -> "KVCache":
        """Logical axis names of each field (for `corl_jax.models.sharding.cache_shardings`)."""
        kv = ("layers", "batch", "kv_heads", "cache_seq", "head_dim")
        return KVCache(k=kv, v=kv, mask=("batch", "cache_seq"), index=())


class Decoder(nnx.Module):
    """Decoder-only transformer (RMSNorm, RoPE, GQA attention, SwiGLU MLP), one implementation for all families."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        self.config = c
        L, D, H, K, hd, F, V = (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                                c.intermediate_size, c.vocab_size)
        normal = nnx.initializers.normal(0.02)

        def param(shape, axes, init=normal):
            return nnx.Param(init(rngs.params(), shape, c.param_dtype), logical_axes=axes)

        ones, zeros = nnx.initializers.ones, nnx.initializers.zeros
        self.embed = param((V, D), ("vocab", "embed"))
        layers = dict(
            attn_norm=param((L, D), ("layers", "norm"), ones),
            q_proj=param((L, D, H, hd), ("layers", "embed", "heads", "head_dim")),
            k_proj=param((L, D, K, hd), ("layers", "embed", "kv_heads", "head_dim")),
            v_proj=param((L, D, K, hd), ("layers", "embed", "kv_heads", "head_dim")),
            o_proj=param((L, H, hd, D), ("layers", "heads", "head_dim", "embed")),
            mlp_norm=param((L, D), ("layers", "norm"), ones),
            gate_proj=param((L, D, F), ("layers", "embed", "mlp")),
            up_proj=param((L, D, F), ("layers", "embed", "mlp")),
            down_proj=param((L, F, D), ("layers", "mlp", "embed")),
        )
        if c.qkv_bias:
            layers.update(
                q_bias=param((L, H, hd), ("layers", "heads", "head_dim"), zeros),
                k_bias=param((L, K, hd), ("layers", "kv_heads", "head_dim"), zeros),
                v_bias=param((L, K, hd), ("layers", "kv_heads", "head_dim"), zeros),
            )
        if c.o_bias:
            layers.update(o_bias=param((L, D), ("layers", "norm"), zeros))
        if c.qk_norm:
            layers.update(
                q_norm=param((L, hd), ("layers", "head_dim"), ones),
                k_norm=param((L, hd), ("layers", "head_dim"), ones),
            )
        self.layers = nnx.Dict(layers)
        self.final_norm = param((D,), ("norm",), ones)
        if not c.tie_word_embeddings:
            self.lm_head = param((D, V), ("embed", "vocab"))

    # ----------------------------------------------------------------------------------- public paths

    def __call__(self, input_ids: jax.Array, positions: jax.Array, attention_mask: jax.Array, *,
                 unroll_layers: bool = False) -> jax.Array:
        """Full-sequence forward: int32 ids/positions [B, T], bool mask [B, T] -> hidden [B, T, D].

        Causal + key-padding mask; `config.remat` selects the rematerialisation policy. `unroll_layers` (all
        paths) applies the blocks one by one with static weight slices instead of one `lax.scan`: bigger
        programs, but no per-layer dynamic-slice copies of the weights and cache (see `_run`)."""
        T = input_ids.shape[1]
        causal = jnp.tril(jnp.ones((T, T), bool))
        mask = causal[None] & attention_mask[:, None, :].astype(bool)
        return self._run(input_ids, positions, mask, None, None, unroll_layers)[0]

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        """An empty cache for `batch` rows and `max_len` slots (dtype defaults to the compute dtype)."""
        c = self.config
        shape = (c.num_layers, batch, c.num_kv_heads, max_len, c.head_dim)
        dtype = c.dtype if dtype is None else dtype
        return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), mask=jnp.zeros((batch, max_len), bool),
                       index=jnp.zeros((), jnp.int32))

    def prefill(self, input_ids, positions, attention_mask, cache: KVCache, *, attend_len: int | None = None,
                unroll_layers: bool = False):
        """Write a left-padded prompt block [B, T] into slots [index, index+T) and attend over slots
        [0, attend_len) (static; default the whole cache; must be >= index+T).

        Returns (hidden of the last column [B, D], updated cache). Prefilling an empty cache with
        attend_len=T costs exactly one prompt forward."""
        hidden, cache = self._extend(input_ids, positions, attention_mask, cache, attend_len, unroll_layers)
        return hidden[:, -1], cache

    def decode_step(self, tokens, positions, cache: KVCache, *, attend_len: int | None = None,
                    unroll_layers: bool = False):
        """One token per row: tokens, positions int32 [B] -> (hidden [B, D], updated cache).

        The token is written at slot `cache.index` (then index += 1); attention reads only slots
        [0, attend_len) — a static bound (e.g. a length bucket) that the caller keeps > index."""
        ones = jnp.ones((tokens.shape[0], 1), bool)
        hidden, cache = self._extend(tokens[:, None], positions[:, None], ones, cache, attend_len, unroll_layers)
        return hidden[:, 0], cache

    def unembedding(self) -> jax.Array:
        """Output projection [D, V] (the transposed embedding when tied), for vocabulary-chunked logits."""
        return self.embed[...].T if self.config.tie_word_embeddings else self.lm_head[...]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits [..., V] = hidden @ unembedding (inputs in compute dtype, float32 products/accumulation)."""
        w = self.unembedding().astype(self.config.dtype)
        return jnp.einsum("...d,dv->...v", hidden.astype(self.config.dtype), w, preferred_element_type=_F32)

    # ----------------------------------------------------------------------------------- internals

    def _extend(self, input_ids, positions, token_mask, cache: KVCache, attend_len, unroll_layers):
        """Append a block of T tokens to the cache and run it; the mask covers cache slots [0, attend_len)."""
        T = input_ids.shape[1]
        attend_len = cache.max_len if attend_len is None else attend_len
        slot_mask = jax.lax.dynamic_update_slice(cache.mask, token_mask.astype(bool), (0, cache.index))
        query_slots = cache.index + jnp.arange(T)
        causal = jnp.arange(attend_len)[None, :] <= query_slots[:, None]  # [T, attend_len]
        mask = causal[None] & slot_mask[:, None, :attend_len]
        hidden, cache = self._run(input_ids, positions, mask, cache, attend_len, unroll_layers)
        return hidden, cache.replace(mask=slot_mask, index=cache.index + T)

    def _run(self, input_ids, positions, mask, cache, attend_len, unroll_layers):
        """Embed, scan (or unroll) the stacked layers (optionally with the cache on the carry), final norm."""
        c = self.config
        h = jnp.take(self.embed[...], input_ids, axis=0).astype(c.dtype)
        cos, sin = _rope_cos_sin(positions, c.rope_inv_freq())
        layer_params = {name: p[...] for name, p in self.layers.items()}

        def block(carry, p):
            h, kv, layer = carry
            x = _rms_norm(h, p["attn_norm"], c)
            q, k, v = _project_qkv(x, p, cos, sin, c)
            if kv is not None:  # write this block's K/V at `cache.index`, then read the attended prefix
                ck, cv = kv
                start = (layer, 0, 0, cache.index, 0)
                ck = jax.lax.dynamic_update_slice(ck, k[None].astype(ck.dtype), start)
                cv = jax.lax.dynamic_update_slice(cv, v[None].astype(cv.dtype), start)
                size = (1, *ck.shape[1:3], attend_len, ck.shape[4])
                k = jax.lax.dynamic_slice(ck, (layer, 0, 0, 0, 0), size)[0].astype(c.dtype)
                v = jax.lax.dynamic_slice(cv, (layer, 0, 0, 0, 0), size)[0].astype(c.dtype)
                kv = (ck, cv)
            if cache is None and c.fused_attention:
                attn = _fused_attention(q, k, v, mask)
            else:
                attn = _attention(q, k, v, mask, c)
            out = jnp.einsum("bthk,hkd->btd", attn, p["o_proj"].astype(c.dtype))
            if c.o_bias:
                out = out + p["o_bias"].astype(c.dtype)
            h = h + out
            h = h + _mlp(_rms_norm(h, p["mlp_norm"], c), p, c)
            return (h, kv, layer + 1), None

        if cache is None and c.remat != "none":
            block = jax.checkpoint(block, policy=_REMAT_POLICIES[c.remat], prevent_cse=False)
        kv = None if cache is None else (cache.k, cache.v)
        if unroll_layers:  # static per-layer slices, which XLA can read in place
            carry = (h, kv, 0)
            for i in range(c.num_layers):
                carry, _ = block(carry, {name: p[i] for name, p in layer_params.items()})
            h, kv, _ = carry
        else:
            (h, kv, _), _ = jax.lax.scan(block, (h, kv, jnp.zeros((), jnp.int32)), layer_params)
        h = _rms_norm(h, self.final_norm[...], c)
        if cache is not None:
            cache = cache.replace(k=kv[0], v=kv[1])
        return h, cache


def _rms_norm(x, weight, c: ModelConfig):
    """RMSNorm over the last axis with float32 statistics; output in the compute dtype."""
    x32 = x.astype(_F32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + c.rms_norm_eps)
    return normed.astype(c.dtype) * weight.astype(c.dtype)


def _rope_cos_sin(positions, inv_freq):
    """cos, sin [B, T, head_dim] (float32) for HF's rotate-half RoPE."""
    freqs = positions.astype(_F32)[..., None] * jnp.asarray(inv_freq)
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def _apply_rope(x, cos, sin):
    """Rotate x [B, T, heads, head_dim] in float32; returns x's dtype."""
    x32 = x.astype(_F32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos[:, :, None] + rotated * sin[:, :, None]).astype(x.dtype)


def _project_qkv(x, p, cos, sin, c: ModelConfig):
    """q [B, T, H, hd], k and v [B, H_kv, T, hd]: projections, optional biases and q/k norms, RoPE."""
    dt = c.dtype
    q = jnp.einsum("btd,dhk->bthk", x, p["q_proj"].astype(dt))
    k = jnp.einsum("btd,dhk->bthk", x, p["k_proj"].astype(dt))
    v = jnp.einsum("btd,dhk->bthk", x, p["v_proj"].astype(dt))
    if c.qkv_bias:
        q, k, v = q + p["q_bias"].astype(dt), k + p["k_bias"].astype(dt), v + p["v_bias"].astype(dt)
    if c.qk_norm:
        q, k = _rms_norm(q, p["q_norm"], c), _rms_norm(k, p["k_norm"], c)
    q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
    return q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # K/V in the cache layout


def _attention(q, k, v, mask, c: ModelConfig):
    """Grouped-query attention without repeating K/V: q [B, T, H, hd], k/v [B, H_kv, S, hd],
    mask [B, T, S] bool -> [B, T, H, hd]. Scores and softmax in float32."""
    B, T, H, hd = q.shape
    K = k.shape[1]
    q = q.reshape(B, T, K, H // K, hd)
    scores = jnp.einsum("btkgd,bksd->bkgts", q, k, preferred_element_type=_F32) * (hd ** -0.5)
    scores = jnp.where(mask[:, None, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(c.dtype)
    return jnp.einsum("bkgts,bksd->btkgd", probs, v).reshape(B, T, H, hd)


def _fused_attention(q, k, v, mask, implementation="cudnn"):
    """`_attention` by cuDNN's fused kernel (no [T, S] scores in memory): same shapes, bf16/fp16 inputs.
    (implementation="xla" runs the same layout anywhere, for tests.)"""
    to_bshd = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731  [B, H_kv, S, hd] -> [B, S, H_kv, hd]
    return jax.nn.dot_product_attention(q, to_bshd(k), to_bshd(v), mask=mask[:, None], implementation=implementation)


def _mlp(x, p, c: ModelConfig):
    """SwiGLU: down(silu(gate(x)) * up(x)), as 2-D matmuls over the flattened tokens (the same math as the
    [B, T, D] einsums; XLA:CPU then makes no transposed copies of the activations in the backward pass)."""
    dt = c.dtype
    tokens = x.reshape(-1, x.shape[-1])
    gate = tokens @ p["gate_proj"].astype(dt)
    up = tokens @ p["up_proj"].astype(dt)
    return ((jax.nn.silu(gate) * up) @ p["down_proj"].astype(dt)).reshape(x.shape)
