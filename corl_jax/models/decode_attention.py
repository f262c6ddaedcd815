"""Decode attention over the KV cache as one Pallas (Triton) kernel: the cost follows each row's filled length.

One query token per row attends over the cache slots [start_b, end_b) of row b (left padding before start_b,
unwritten slots from end_b on). The kernel reads the cache in place, straight out of the stacked
[L, B, H_kv, S, head_dim] buffer (the layer is a static index of the block map: no per-layer copy), and only the
blocks that hold filled slots: a step late in a long generation costs what its context costs, not the cache size.

Split-K (flash decoding): the grid is (batch, kv head, slot split); each program runs an online softmax over the
`block_k`-slot blocks of its split that overlap [start, end) and writes an unnormalised partial output with its
running max and sum; `decode_attention` merges the splits. The q heads of one kv head (GQA group, padded to 16
rows for the tensor cores) share every K/V block they read. Off the GPU the same kernel runs in Pallas' interpreter
(for tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

_F32 = jnp.float32
_MIN_ROWS = 16  # tensor-core tiles need at least 16 query rows


def supports_head_dim(head_dim: int) -> bool:
    """Triton tiles only power-of-two sizes: the kernel reads whole [slots, head_dim] cache rows in place."""
    return head_dim > 0 and head_dim & (head_dim - 1) == 0


def decode_attention(q, k_cache, v_cache, layer: int, start, end, *, block_k: int = 64, split: int = 256,
                     num_warps: int = 4, num_stages: int = 2, interpret: bool | None = None):
    """Attention of one token per row over cache slots [start, end).

    q: [B, H, hd] (compute dtype); k_cache, v_cache: [L, B, H_kv, S, hd]; layer: static layer index;
    start, end: int32 [B] with 0 <= start < end <= S. S must be a multiple of `block_k` and `split` a multiple of
    `block_k`. num_warps, num_stages: Triton settings of the compiled kernel. Returns [B, H, hd] in q's dtype;
    scores, softmax and accumulation in float32.
    """
    B, H, hd = q.shape
    K, S = k_cache.shape[2], k_cache.shape[3]
    if S % block_k or split % block_k:
        raise ValueError(f"cache length {S} and split {split} must be multiples of block_k={block_k}")
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    if not interpret and not supports_head_dim(hd):
        raise ValueError(f"head_dim {hd} is not a power of two, which the Triton kernel cannot tile; "
                         "use the XLA decode attention (Sampler(attention='xla'))")
    g = H // K
    rows = max(_MIN_ROWS, pl.next_power_of_2(g))
    splits = pl.cdiv(S, split)
    grouped = jnp.pad(q.reshape(B, K, g, hd), ((0, 0), (0, 0), (0, rows - g), (0, 0)))
    kernel = functools.partial(_kernel, block_k=block_k, split=split, scale=hd ** -0.5)
    cache_block = pl.BlockSpec((None, None, None, S, hd), lambda b, h, j: (layer, b, h, 0, 0))
    scalar = pl.BlockSpec((None,), lambda b, h, j: (b,))
    partial_out, running_max, running_sum = pl.pallas_call(
        kernel,
        grid=(B, K, splits),
        in_specs=[scalar, scalar, pl.BlockSpec((None, None, rows, hd), lambda b, h, j: (b, h, 0, 0)),
                  cache_block, cache_block],
        out_specs=[pl.BlockSpec((None, None, None, rows, hd), lambda b, h, j: (b, h, j, 0, 0)),
                   pl.BlockSpec((None, None, None, rows), lambda b, h, j: (b, h, j, 0)),
                   pl.BlockSpec((None, None, None, rows), lambda b, h, j: (b, h, j, 0))],
        out_shape=[jax.ShapeDtypeStruct((B, K, splits, rows, hd), _F32),
                   jax.ShapeDtypeStruct((B, K, splits, rows), _F32),
                   jax.ShapeDtypeStruct((B, K, splits, rows), _F32)],
        compiler_params=None if interpret else _triton_params(num_warps, num_stages),
        interpret=interpret,
        name="decode_attention",
    )(start.astype(jnp.int32), end.astype(jnp.int32), grouped, k_cache, v_cache)
    # merge the splits (an empty split has max -1e30 and sum 0: weight 0)
    top = running_max.max(axis=2, keepdims=True)
    weight = jnp.exp(running_max - top)
    total = (running_sum * weight).sum(axis=2)
    out = (partial_out * weight[..., None]).sum(axis=2) / total[..., None]
    return out[:, :, :g].reshape(B, H, hd).astype(q.dtype)


def _triton_params(num_warps, num_stages):
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _kernel(start_ref, end_ref, q_ref, k_ref, v_ref, out_ref, max_ref, sum_ref, *, block_k, split, scale):
    j = pl.program_id(2)
    lo = jnp.maximum(start_ref[...], j * split)
    hi = jnp.minimum(end_ref[...], (j + 1) * split)
    first = lo // block_k
    last = jnp.where(hi > lo, pl.cdiv(hi, block_k), first)  # blocks overlapping [lo, hi); none if empty
    q = q_ref[...]
    rows, hd = q.shape
    # float32 caches (CPU tests, fp32 runs) get full-precision dots rather than the GPU's TF32 default
    precision = jax.lax.Precision.HIGHEST if q.dtype == _F32 else None

    def body(i, carry):
        acc, running_max, running_sum = carry
        offset = pl.multiple_of(i * block_k, block_k)
        k = k_ref[pl.ds(offset, block_k), :]
        scores = jnp.dot(q, k.T, precision=precision, preferred_element_type=_F32) * scale  # [rows, block_k]
        slot = offset + jax.lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
        scores = jnp.where((slot >= lo) & (slot < hi), scores, -jnp.inf)
        new_max = jnp.maximum(running_max, scores.max(axis=1))  # finite: every block holds a filled slot
        correction = jnp.exp(running_max - new_max)
        probs = jnp.exp(scores - new_max[:, None])
        v = v_ref[pl.ds(offset, block_k), :]
        weighted = jnp.dot(probs.astype(v.dtype), v, precision=precision, preferred_element_type=_F32)
        acc = acc * correction[:, None] + weighted
        return acc, new_max, running_sum * correction + probs.sum(axis=1)

    init = (jnp.zeros((rows, hd), _F32), jnp.full((rows,), -1e30, _F32), jnp.zeros((rows,), _F32))
    acc, running_max, running_sum = jax.lax.fori_loop(first, last, body, init)
    out_ref[...] = acc
    max_ref[...] = running_max
    sum_ref[...] = running_sum
