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

On TPUs (`backend="tpu"`) a Mosaic kernel does the same: the grid is (batch, kv head, cache block); the start/end
slots are prefetched scalars, the K/V block map clamps each row's blocks to those overlapping [start, end) so the
pipeline fetches nothing for the others (an unchanged block index is not copied again), and an online softmax runs
across the blocks in VMEM scratch. JAX's shipped TPU kernels (`pallas.ops.tpu.paged_attention`,
`ragged_paged_attention`) attend over slots [0, length) of paged caches: they have no start slot for left-padded
prompts and want other cache layouts, so they do not fit this cache.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

_F32 = jnp.float32
_MIN_ROWS = 16  # tensor-core tiles need at least 16 query rows


def supports_head_dim(head_dim: int, backend: str = "gpu") -> bool:
    """Whether the compiled kernel reads the cache in place: Triton tiles only power-of-two sizes; a TPU block
    [slots, head_dim] needs whole 128-lane tiles (head_dim 64 makes XLA copy the whole cache into a padded layout
    for every call: measured by compile_check's temp bytes)."""
    if backend == "tpu":
        return head_dim % 128 == 0
    return head_dim > 0 and head_dim & (head_dim - 1) == 0


def decode_attention(q, k_cache, v_cache, layer: int, start, end, *, block_k: int = 64, split: int = 256,
                     num_warps: int = 4, num_stages: int = 2, backend: str | None = None,
                     interpret: bool | None = None):
    """Attention of one token per row over cache slots [start, end).

    q: [B, H, hd] (compute dtype); k_cache, v_cache: [L, B, H_kv, S, hd]; layer: static layer index;
    start, end: int32 [B] with 0 <= start < end <= S. S must be a multiple of `block_k` and `split` a multiple of
    `block_k`. backend: the platform the program is compiled for (default: JAX's default backend): "tpu" runs the
    Mosaic kernel (`split`, num_warps, num_stages unused), others the Triton kernel; `interpret` (default: on CPUs)
    runs the chosen kernel in Pallas' interpreter. num_warps, num_stages: Triton settings of the compiled kernel.
    Returns [B, H, hd] in q's dtype; scores, softmax and accumulation in float32.
    """
    B, H, hd = q.shape
    K, S = k_cache.shape[2], k_cache.shape[3]
    backend = jax.default_backend() if backend is None else backend
    interpret = backend == "cpu" if interpret is None else interpret
    if S % block_k or split % block_k:
        raise ValueError(f"cache length {S} and split {split} must be multiples of block_k={block_k}")
    if backend == "tpu":
        if not interpret and not supports_head_dim(hd, "tpu"):
            raise ValueError(f"head_dim {hd} is not a multiple of 128, which the TPU kernel needs to read the cache "
                             "in place; use the XLA decode attention (Sampler(attention='xla'))")
        return _tpu_decode_attention(q, k_cache, v_cache, layer, start, end, block_k=block_k, interpret=interpret)
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


def _tpu_decode_attention(q, k_cache, v_cache, layer, start, end, *, block_k, interpret):
    """The Mosaic (TPU) kernel: grid (batch, kv head, cache block), online softmax over a row's filled blocks."""
    from jax.experimental.pallas import tpu as pltpu

    B, H, hd = q.shape
    K, S = k_cache.shape[2], k_cache.shape[3]
    g = H // K
    rows = -(-g // _MIN_ROWS) * _MIN_ROWS  # whole (16, 128) bf16 tiles of query rows
    grouped = jnp.pad(q.reshape(B, K, g, hd), ((0, 0), (0, 0), (0, rows - g), (0, 0)))

    def cache_block(b, h, j, start_ref, end_ref):  # blocks outside the row's filled ones repeat its first/last
        j = jnp.clip(j, jax.lax.div(start_ref[b], block_k), jax.lax.div(end_ref[b] - 1, block_k))  # (no floor:
        # its sign op needs a TPU attached to lower)
        return layer, b, h, j, 0

    row_block = pl.BlockSpec((None, None, rows, hd), lambda b, h, j, *_: (b, h, 0, 0))
    kv_spec = pl.BlockSpec((None, None, None, block_k, hd), cache_block)
    out = pl.pallas_call(
        functools.partial(_tpu_kernel, block_k=block_k, scale=hd ** -0.5),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(B, K, S // block_k), in_specs=[row_block, kv_spec, kv_spec],
            out_specs=row_block,
            scratch_shapes=[pltpu.VMEM((rows, _LANES), _F32), pltpu.VMEM((rows, _LANES), _F32),
                            pltpu.VMEM((rows, hd), _F32)]),
        out_shape=jax.ShapeDtypeStruct((B, K, rows, hd), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="decode_attention_tpu",
    )(start.astype(jnp.int32), end.astype(jnp.int32), grouped, k_cache, v_cache)
    return out[:, :, :g].reshape(B, H, hd)


_LANES = 128  # running max/sum are kept broadcast over a full lane tile


def _tpu_kernel(start_ref, end_ref, q_ref, k_ref, v_ref, out_ref, max_ref, sum_ref, acc_ref, *, block_k, scale):
    b, j = pl.program_id(0), pl.program_id(2)
    lo, hi = start_ref[b], end_ref[b]

    @pl.when(j == 0)
    def _():
        max_ref[...] = jnp.full(max_ref.shape, -1e30, _F32)
        sum_ref[...] = jnp.zeros(sum_ref.shape, _F32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, _F32)

    @pl.when((j * block_k < hi) & ((j + 1) * block_k > lo))  # the block holds filled slots
    def _():
        q, k, v = q_ref[...], k_ref[...], v_ref[...]
        precision = jax.lax.Precision.HIGHEST if q.dtype == _F32 else None
        scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                     preferred_element_type=_F32) * scale  # [rows, block_k]
        slot = j * block_k + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
        scores = jnp.where((slot >= lo) & (slot < hi), scores, -jnp.inf)
        running_max = max_ref[...][:, :1]
        new_max = jnp.maximum(running_max, scores.max(axis=1, keepdims=True))
        correction = jnp.exp(running_max - new_max)
        probs = jnp.exp(scores - new_max)
        weighted = jnp.dot(probs.astype(v.dtype), v, precision=precision, preferred_element_type=_F32)
        acc_ref[...] = acc_ref[...] * correction + weighted
        sum_ref[...] = jnp.broadcast_to(sum_ref[...][:, :1] * correction + probs.sum(axis=1, keepdims=True),
                                        sum_ref.shape)
        max_ref[...] = jnp.broadcast_to(new_max, max_ref.shape)

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        out_ref[...] = (acc_ref[...] / sum_ref[...][:, :1]).astype(out_ref.dtype)
