"""Training attention on TPUs by JAX's Pallas splash-attention kernel (`pallas.ops.tpu.splash_attention`).

The update's full-sequence forward is causal self-attention over rows of left-padded prompts and padded
completions. The kernel never holds [T, T] scores: a static causal mask (block-sparse: blocks above the diagonal
are skipped) and segment ids (1 for tokens with attention_mask 1, 0 for padding; or the segments of packed rows)
make a real token attend to the real tokens of its segment at or before it, exactly the decoder's XLA mask. A
padding query attends to padding keys only (itself at least), so no softmax row is empty; its output is unused.

GQA runs the kernel's MQA variant (`make_splash_mqa_single_device`): one call per (row, kv head) takes that kv
head's group of q heads [group, T, hd] against its K/V [T, hd] (no repeated K/V), vmapped over rows and kv heads.
The sequence is padded to a whole number of 128-token blocks (segment 0) and stripped afterwards. The kernel does
not scale scores: q is scaled by head_dim ** -0.5 first. Under a mesh (the abstract mesh of `jax.set_mesh`), the
kernel runs per shard (`jax.shard_map` over the batch axes and the kv heads over `tensor`), like the TPU decode
kernel in `decode_attention`. Off a TPU it runs in Pallas' interpreter (tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import PartitionSpec as P

from corl_jax.models.sharding import DEFAULT_RULES, logical_to_spec

BLOCK = 128  # the kernel's q/kv block (BlockSizes.get_default)


def splash_attention(q, k, v, token_mask, *, interpret: bool | None = None, rules=DEFAULT_RULES):
    """Causal attention of q [B, T, H, hd] over k/v [B, H_kv, T, hd] within the segments of token_mask [B, T]
    (bool or int segment ids; keys of segment 0 are padding) -> [B, T, H, hd] in q's dtype (float32 softmax and
    accumulation). Inside `jax.set_mesh`, runs per batch/kv-head shard. `interpret` (default: unless the mesh's
    devices, or without a mesh the default backend, are TPUs) runs the kernel in Pallas' interpreter."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    platform = jax.default_backend() if device is None else device.platform
    interpret = platform != "tpu" if interpret is None else interpret
    fn = lambda q, k, v, m: _attend(q, k, v, m, interpret)  # noqa: E731
    if mesh.empty:
        return fn(q, k, v, token_mask)
    kv_spec = logical_to_spec(("batch", "kv_heads", None, None), k.shape, mesh, rules)
    batch, heads = kv_spec[0], kv_spec[1]
    q_spec = P(batch, None, heads, None)  # q heads split like the kv heads (groups stay whole)
    return jax.shard_map(fn, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, P(batch, None)), out_specs=q_spec,
                         check_vma=False)(q, k, v, token_mask)


def _attend(q, k, v, token_mask, interpret):
    B, T, H, hd = q.shape
    K = k.shape[1]
    g = H // K
    Tp = -(-T // BLOCK) * BLOCK
    pad = ((0, 0), (0, 0), (0, 0), (0, Tp - T), (0, 0))
    q = (q.astype(jnp.float32) * hd ** -0.5).astype(q.dtype)
    q = jnp.pad(q.reshape(B, T, K, g, hd).transpose(0, 2, 3, 1, 4), pad)  # [B, K, g, Tp, hd]
    k, v = (jnp.pad(x, pad[1:]) for x in (k, v))  # [B, K, Tp, hd]
    segments = jnp.pad(token_mask.astype(jnp.int32), ((0, 0), (0, Tp - T)))
    mask = splash.MultiHeadMask([splash.CausalMask((Tp, Tp)) for _ in range(g)])
    kernel = splash.make_splash_mqa_single_device(mask, interpret=interpret)

    def row(q, k, v, seg):  # q [K, g, Tp, hd], k/v [K, Tp, hd], seg [Tp]
        ids = splash.SegmentIds(q=seg, kv=seg)
        return jax.vmap(lambda q, k, v: kernel(q, k, v, ids))(q, k, v)

    out = jax.vmap(row)(q, k, v, segments)  # [B, K, g, Tp, hd]
    return out[:, :, :, :T].transpose(0, 3, 1, 2, 4).reshape(B, T, H, hd).astype(q.dtype)
