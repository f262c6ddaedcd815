"""One Flax NNX decoder for Qwen2/2.5, Llama-3.x and Qwen3 (families differ by `ModelConfig` flags).

Parameters of the L transformer blocks are stacked with a leading layer axis (`decoder.layers.*`,
shape [L, ...]) and applied with one `jax.lax.scan` in training and prefill; every parameter carries
`logical_axes` metadata used by `corl_jax.models.sharding`. Decoding runs the layers one by one on
`DecodeWeights` (per-layer buffers in the compute dtype, fused q/k/v and gate/up projections).

Call paths (all return hidden states after the final RMSNorm; logits are `decoder.logits(hidden)`
or chunks of `hidden @ decoder.unembedding()`):

* Training / scoring: `decoder(input_ids, positions, attention_mask) -> [B, T, D]`.
* Sampling with a KV cache (`KVCache`, see its docstring):
  `cache = decoder.init_cache(batch, max_len)`,
  `last_hidden, cache = decoder.prefill(ids, positions, mask, cache)`,
  `weights = decoder.decode_weights()` (once per generation),
  `hidden, cache = decoder.decode_step(tokens, positions, cache, weights, attend_len=...)`.

Batches are left-padded; `positions = max(cumsum(mask) - 1, 0)` (see `positions_from_mask`).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from corl_jax.models.config import ModelConfig
from corl_jax.models.splash_attention import splash_attention

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

    A decode step may run n < B rows (compacted decoding keeps the whole cache and moves the live rows to the
    front, `move_rows`): they are the cache's *leading rows* for `batch_shards` = s, the first n/s rows of each of
    the s equal blocks of its B rows (a prefix on one device; each batch shard's own prefix on a mesh, so no row
    crosses a shard to be read or written).
    """

    k: jax.Array
    v: jax.Array
    mask: jax.Array
    index: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def repeat_batch(self, n: int, max_len: int | None = None) -> "KVCache":
        """Each row repeated n times consecutively (row b -> rows b*n .. b*n+n-1), e.g. to share one prefilled
        prompt among its n samples, in a cache of `max_len` slots (default: this one's; later slots empty, `index`
        unchanged). The repeated rows are written into the new cache one layer at a time: no repeated copy of the
        whole cache exists beside it."""
        max_len = self.max_len if max_len is None else max_len

        def fill(layer, kv):
            return tuple(jax.lax.dynamic_update_index_in_dim(
                out, jnp.repeat(jax.lax.dynamic_index_in_dim(x, layer, keepdims=False), n, axis=0), layer, 0)
                for out, x in zip(kv, (self.k, self.v)))

        L, B, H, _, D = self.k.shape
        empty = tuple(jnp.zeros((L, B * n, H, max_len, D), x.dtype) for x in (self.k, self.v))
        k, v = jax.lax.fori_loop(0, L, fill, empty)
        mask = jnp.zeros((B * n, max_len), bool).at[:, :self.max_len].set(jnp.repeat(self.mask, n, axis=0))
        return self.replace(k=k, v=v, mask=mask)

    def move_rows(self, source, target) -> "KVCache":
        """The cache with rows `target` (int [n]) holding what rows `source` held, moved one layer at a time so
        that the only temporary is one layer of n rows (the cache itself is updated in place)."""
        def move(layer, kv):  # (gathers and scatters touch one layer's slab, never the whole stacked cache)
            slabs = (jax.lax.dynamic_index_in_dim(x, layer, keepdims=False) for x in kv)
            return tuple(jax.lax.dynamic_update_index_in_dim(x, slab.at[target].set(slab[source]), layer, 0)
                         for x, slab in zip(kv, slabs))

        k, v = jax.lax.fori_loop(0, self.k.shape[0], move, (self.k, self.v))
        return self.replace(k=k, v=v, mask=self.mask.at[target].set(self.mask[source]))

    @staticmethod
    def logical_axes() -> "KVCache":
        """Logical axis names of each field (for `corl_jax.models.sharding.cache_shardings`)."""
        kv = ("layers", "batch", "kv_heads", "cache_seq", "head_dim")
        return KVCache(k=kv, v=kv, mask=("batch", "cache_seq"), index=())


@flax.struct.dataclass
class DecodeWeights:
    """A decoder's weights laid out for decoding, made once per generation by `Decoder.decode_weights`.

    Every array is in the compute dtype and every layer has buffers of its own (no slicing of stacked
    parameters inside the decode loop); q/k/v are fused into one `qkv_proj` [D, (H + 2 H_kv) * hd] (and
    `qkv_bias`), gate/up into one `gate_up_proj` [D, 2F]: three matmuls per block instead of six.

    embed: [V, D]; unembed: [V, D] (the embedding itself when tied); final_norm: [D];
    layers: one dict per layer.
    """

    embed: jax.Array
    unembed: jax.Array
    final_norm: jax.Array
    layers: tuple

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits [B, V] of hidden [B, D]."""
        return jnp.einsum("bd,vd->bv", hidden.astype(self.unembed.dtype), self.unembed, preferred_element_type=_F32)


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
        """Full-sequence forward: int32 ids/positions [B, T], mask [B, T] -> hidden [B, T, D].

        Causal + key-padding mask. The mask is bool, or int segment ids (0: padding) of packed rows: a token then
        attends only to earlier tokens of its own segment. `config.remat` selects the rematerialisation policy.
        `unroll_layers` applies the blocks one by one with static weight slices instead of one `lax.scan`: bigger
        programs, but no per-layer dynamic-slice copies of the weights and cache (see `_run`)."""
        T = input_ids.shape[1]
        segments = attention_mask.astype(jnp.int32)
        causal = jnp.tril(jnp.ones((T, T), bool))
        # a padding query (segment 0) keeps attending to every earlier real key, as the bool mask always did
        same = (segments[:, :, None] == segments[:, None, :]) | (segments[:, :, None] == 0)
        mask = causal[None] & same & (segments[:, None, :] != 0)
        return self._run(input_ids, positions, mask, None, None, unroll_layers, token_mask=segments)[0]

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        """An empty cache for `batch` rows and `max_len` slots (dtype defaults to the compute dtype)."""
        c = self.config
        shape = (c.num_layers, batch, c.num_kv_heads, max_len, c.head_dim)
        dtype = c.dtype if dtype is None else dtype
        return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), mask=jnp.zeros((batch, max_len), bool),
                       index=jnp.zeros((), jnp.int32))

    def prefill(self, input_ids, positions, attention_mask, cache: KVCache, *, attend_len: int | None = None):
        """Write a left-padded prompt block [B, T] into slots [index, index+T) and attend over slots
        [0, attend_len) (static; default the whole cache; must be >= index+T).

        Returns (hidden of the last column [B, D], updated cache). Prefilling an empty cache with
        attend_len=T costs exactly one prompt forward."""
        hidden, cache = self._extend(input_ids, positions, attention_mask, cache, attend_len)
        return hidden[:, -1], cache

    def decode_weights(self) -> DecodeWeights:
        """The current weights in the compute dtype, laid out for decoding (see `DecodeWeights`)."""
        c = self.config
        dt = c.dtype
        stacked = {name: p[...].astype(dt) for name, p in self.layers.items()}
        layers = []
        for i in range(c.num_layers):
            p = {name: w[i] for name, w in stacked.items()}
            flat = lambda name: p.pop(name).reshape(c.hidden_size, -1)  # noqa: E731  [D, heads, hd] -> [D, heads*hd]
            p["qkv_proj"] = jnp.concatenate([flat("q_proj"), flat("k_proj"), flat("v_proj")], axis=1)
            if c.qkv_bias:
                p["qkv_bias"] = jnp.concatenate([p.pop(f"{x}_bias").reshape(-1) for x in "qkv"])
            p["gate_up_proj"] = jnp.concatenate([p.pop("gate_proj"), p.pop("up_proj")], axis=1)
            layers.append(p)
        embed = self.embed[...].astype(dt)
        unembed = embed if c.tie_word_embeddings else self.lm_head[...].astype(dt).T
        return DecodeWeights(embed=embed, unembed=unembed, final_norm=self.final_norm[...].astype(dt),
                             layers=tuple(layers))

    def decode_step(self, tokens, positions, cache: KVCache, weights: DecodeWeights, *,
                    attend_len: int | None = None, cache_attention=None, batch_shards: int = 1):
        """One token per row: tokens, positions int32 [n] -> (hidden [n, D], updated cache).

        The rows are the cache's n leading rows for `batch_shards` (all of them when n is the cache's batch; see
        `KVCache`). The token is written at slot `cache.index` (then index += 1). The layers run one by one on `weights`
        (`self.decode_weights()`, made once per generation, not per step). Attention reads
        either the static prefix [0, attend_len) of the cache (XLA; default the whole cache, the caller keeps
        attend_len > index), or, with `cache_attention(q [B, H, hd], k_cache, v_cache, layer, start, end)`
        (e.g. `decode_attention.decode_attention`), only each row's filled slots [first real slot, index]: the
        prompts are left-padded and every later slot is filled, so this is the same set as the mask's."""
        c = self.config
        n = tokens.shape[0]
        slot_mask = _update_leading_rows(cache.mask, jnp.ones((n, 1), bool), (0, cache.index), 0, batch_shards)
        rows_mask = _leading_rows(slot_mask, n, 0, batch_shards)
        attend_len = cache.max_len if attend_len is None else attend_len
        mask = rows_mask[:, None, :attend_len]  # slots after `index` are still empty: causal by construction
        start = jnp.argmax(rows_mask, axis=1).astype(jnp.int32)
        end = jnp.broadcast_to(cache.index + 1, start.shape).astype(jnp.int32)
        h = jnp.take(weights.embed, tokens[:, None], axis=0)
        cos, sin = _rope_cos_sin(positions[:, None], c.rope_inv_freq())
        kv = (cache.k, cache.v)
        for layer, p in enumerate(weights.layers):
            def attend(q, k, v, layer=layer):
                ck, cv = (_write_slot(x, new, layer, cache.index, batch_shards) for x, new in zip(kv, (k, v)))
                if cache_attention is not None:
                    return cache_attention(q[:, 0], ck, cv, layer, start, end)[:, None], (ck, cv)
                keys, values = (_leading_rows(x[layer, :, :, :attend_len], n, 0, batch_shards).astype(c.dtype)
                                for x in (ck, cv))
                return _attention(q, keys, values, mask, c), (ck, cv)

            h, kv = _block(h, p, cos, sin, c, attend)
        h = _rms_norm(h, weights.final_norm, c)
        return h[:, 0], cache.replace(k=kv[0], v=kv[1], mask=slot_mask, index=cache.index + 1)

    def unembedding(self) -> jax.Array:
        """Output projection [D, V] (the transposed embedding when tied), for vocabulary-chunked logits."""
        return self.embed[...].T if self.config.tie_word_embeddings else self.lm_head[...]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits [..., V] = hidden @ unembedding (inputs in compute dtype, float32 products/accumulation)."""
        w = self.unembedding().astype(self.config.dtype)
        return jnp.einsum("...d,dv->...v", hidden.astype(self.config.dtype), w, preferred_element_type=_F32)

    # ----------------------------------------------------------------------------------- internals

    def _extend(self, input_ids, positions, token_mask, cache: KVCache, attend_len):
        """Append a block of T tokens to the cache and run it; the mask covers cache slots [0, attend_len)."""
        T = input_ids.shape[1]
        attend_len = cache.max_len if attend_len is None else attend_len
        slot_mask = jax.lax.dynamic_update_slice(cache.mask, token_mask.astype(bool), (0, cache.index))
        query_slots = cache.index + jnp.arange(T)
        causal = jnp.arange(attend_len)[None, :] <= query_slots[:, None]  # [T, attend_len]
        mask = causal[None] & slot_mask[:, None, :attend_len]
        hidden, cache = self._run(input_ids, positions, mask, cache, attend_len, unroll_layers=False)
        return hidden, cache.replace(mask=slot_mask, index=cache.index + T)

    def _run(self, input_ids, positions, mask, cache, attend_len, unroll_layers, token_mask=None):
        """Embed, scan (or unroll) the stacked layers (optionally with the cache on the carry), final norm.
        `token_mask` [B, T] int segment ids (full-sequence forwards) are what the splash kernel masks keys by."""
        c = self.config
        h = jnp.take(self.embed[...], input_ids, axis=0).astype(c.dtype)
        cos, sin = _rope_cos_sin(positions, c.rope_inv_freq())
        layer_params = {name: p[...] for name, p in self.layers.items()}

        def block(carry, p):
            h, kv, layer = carry

            def attend(q, k, v):
                if kv is None:
                    impl = c.train_attention
                    if impl == "splash":
                        return splash_attention(q, k, v, token_mask), None
                    attn = _fused_attention(q, k, v, mask) if impl == "cudnn" else _attention(q, k, v, mask, c)
                    return attn, None
                # write this block's K/V at `cache.index`, then read the attended prefix
                ck, cv = (_write_slot(x, new, layer, cache.index) for x, new in zip(kv, (k, v)))
                size = (1, *ck.shape[1:3], attend_len, ck.shape[4])
                k = jax.lax.dynamic_slice(ck, (layer, 0, 0, 0, 0), size)[0].astype(c.dtype)
                v = jax.lax.dynamic_slice(cv, (layer, 0, 0, 0, 0), size)[0].astype(c.dtype)
                return _attention(q, k, v, mask, c), (ck, cv)

            h, kv = _block(h, p, cos, sin, c, attend)
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


def _block(h, p, cos, sin, c: ModelConfig, attend):
    """One transformer block on hidden [B, T, D] with layer parameters `p` (stacked-layer slices or
    `DecodeWeights` layers). `attend(q, k, v) -> (attn [B, T, H, hd], aux)` does the attention and any cache
    I/O; returns (new hidden, aux)."""
    x = _rms_norm(h, p["attn_norm"], c)
    q, k, v = _project_qkv(x, p, cos, sin, c)
    attn, aux = attend(q, k, v)
    out = _matmul(attn.reshape(*attn.shape[:2], -1), p["o_proj"].reshape(-1, c.hidden_size), c)
    if c.o_bias:
        out = out + p["o_bias"].astype(c.dtype)
    h = h + out
    return h + _mlp(_rms_norm(h, p["mlp_norm"], c), p, c), aux


def _write_slot(cache_kv, new, layer, index, batch_shards=1):
    """Write new K or V [n, H_kv, T, hd] of `layer` into the stacked cache [L, B, H_kv, S, hd] at slot `index`
    (rows: the cache's n leading rows, see `KVCache`)."""
    return _update_leading_rows(cache_kv, new[None], (layer, 0, 0, index, 0), 1, batch_shards)


def _shard_blocks(x, axis, batch_shards):
    """x with its batch axis `axis` split into (batch_shards, rows per shard)."""
    return x.reshape(*x.shape[:axis], batch_shards, x.shape[axis] // batch_shards, *x.shape[axis + 1:])


def _leading_rows(x, n, axis, batch_shards):
    """The n leading rows (see `KVCache`) of x along its batch axis `axis`."""
    if n == x.shape[axis]:
        return x
    blocks = jax.lax.slice_in_dim(_shard_blocks(x, axis, batch_shards), 0, n // batch_shards, axis=axis + 1)
    return blocks.reshape(*x.shape[:axis], n, *x.shape[axis + 1:])


def _update_leading_rows(x, update, start, axis, batch_shards):
    """`dynamic_update_slice(x, update, start)` with update's rows along the batch axis `axis` (whose start is 0)
    written to x's leading rows (see `KVCache`)."""
    update = update.astype(x.dtype)
    if update.shape[axis] == x.shape[axis]:
        return jax.lax.dynamic_update_slice(x, update, start)
    start = (*start[:axis], 0, *start[axis:])
    blocks = jax.lax.dynamic_update_slice(_shard_blocks(x, axis, batch_shards),
                                          _shard_blocks(update, axis, batch_shards), start)
    return blocks.reshape(x.shape)


def _matmul(x, w, c: ModelConfig):
    """x [..., D_in] @ w [D_in, D_out] as one 2-D matmul in the compute dtype."""
    return (x.reshape(-1, x.shape[-1]) @ w.astype(c.dtype)).reshape(*x.shape[:-1], w.shape[-1])


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
    """q [B, T, H, hd], k and v [B, H_kv, T, hd]: projections (three, or one fused `qkv_proj` of
    `DecodeWeights`), optional biases and q/k norms, RoPE."""
    dt = c.dtype
    B, T, _ = x.shape
    H, K, hd = c.num_heads, c.num_kv_heads, c.head_dim
    if "qkv_proj" in p:
        qkv = _matmul(x, p["qkv_proj"], c)
        if c.qkv_bias:
            qkv = qkv + p["qkv_bias"].astype(dt)
        q, k, v = jnp.split(qkv, (H * hd, (H + K) * hd), axis=-1)
        q, k, v = q.reshape(B, T, H, hd), k.reshape(B, T, K, hd), v.reshape(B, T, K, hd)
    else:
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
    """`_attention` by cuDNN's fused kernel (no [T, S] scores in memory): same shapes, bf16/fp16 inputs; `mask`
    must lie inside the causal triangle (every full-sequence mask does), so cuDNN may skip the blocks above it.
    (implementation="xla" runs the same layout anywhere, for tests.)"""
    to_bshd = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731  [B, H_kv, S, hd] -> [B, S, H_kv, hd]
    return jax.nn.dot_product_attention(q, to_bshd(k), to_bshd(v), mask=mask[:, None], is_causal=True,
                                        implementation=implementation)


def _mlp(x, p, c: ModelConfig):
    """SwiGLU: down(silu(gate(x)) * up(x)), as 2-D matmuls over the flattened tokens (the same math as the
    [B, T, D] einsums; XLA:CPU then makes no transposed copies of the activations in the backward pass).
    `DecodeWeights` layers hold gate and up as one fused `gate_up_proj` [D, 2F]."""
    if "gate_up_proj" in p:
        gate, up = jnp.split(_matmul(x, p["gate_up_proj"], c), 2, axis=-1)
    else:
        gate, up = _matmul(x, p["gate_proj"], c), _matmul(x, p["up_proj"], c)
    return _matmul(jax.nn.silu(gate) * up, p["down_proj"], c)
