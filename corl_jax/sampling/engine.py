"""The generation engine: prompt ids in, completion ids and logprobs out (no text in here).

One compiled program per shape bucket does everything on the device:

1. prefill each distinct prompt once (a [P, Tp] forward that writes the prompt's K/V);
2. share the prompt cache with its G samples (`KVCache.repeat_batch`: rows p*G .. p*G+G-1) in a cache
   of Tp + T slots; sample each row's first token from its prompt's last logits;
3. decode one token per row per step in `lax.while_loop`s that stop as soon as every row has
   emitted a stop id (or T tokens). The layers run one by one on `Decoder.decode_weights()` (made
   once per call: per-layer buffers in the compute dtype, fused projections). Attention over the
   cache follows the filled length in one of two ways (`Sampler(attention=...)`):
   * "pallas" (GPUs, TPUs): `decode_attention`, a flash-decoding kernel (Triton on GPUs, Mosaic on TPUs)
     that reads only each row's filled cache blocks, in place; one loop for the whole generation.
   * "xla": the loop is cut into *attention segments*: segment j covers steps
     [(j-1)·kv_block, j·kv_block) and attends over the first Tp + j·kv_block cache slots only, so the
     cost of a step follows the filled length to within kv_block.
4. decode compaction (`Sampler(compaction=n)`, n > 0): the loop runs in *stages* of B, B/2, ..., B/2^n rows.
   Once no batch shard (the whole batch on one device) holds more live rows than its share of the next stage,
   each shard's live rows (and finished ones to fill its share) are gathered into the smaller batch (tokens,
   positions, per-row state) and the loop goes on there; every row's results are scattered back when its stage
   ends. The cache keeps its B rows: each shard's stage rows are moved, in place and one layer at a time, to the
   shard's leading rows (`KVCache.move_rows`, per shard on a mesh: no row crosses chips), which are all that the
   stage's steps read and write: compaction makes no second cache. Row r's uniform number at step t
   is entry r of `uniform(fold_in(key, t), [B])` in every stage, so the tokens do not depend on which
   rows share a batch: compaction on and off sample the same tokens.

The cache is created inside the program and lives in the loop carry, updated in place: no cache
crosses the program boundary, so there is nothing to copy or donate. Shapes are bucketed (prompt
width, new-token budget), the requested `max_new_tokens` is a runtime argument, and each new
program is logged with its bucket and compile time.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from corl_jax.models.decode_attention import decode_attention, supports_head_dim
from corl_jax.models.decoder import Decoder, KVCache, positions_from_mask
from corl_jax.models.sharding import DEFAULT_RULES, batch_sharding, cache_shardings, logical_to_spec
from corl_jax.sampling.controls import SamplingParams, sample_tokens

log = logging.getLogger(__name__)

DECODE_ATTENTION_IMPLS = ("auto", "pallas", "xla")
CACHE_BLOCK = 64  # cache slots are allocated in multiples of the kernel's block
# XLA options of the sampler's programs on GPUs unless the caller gives its own: the whole decode loop as one CUDA
# graph (command buffers with WHILE/CONDITIONAL) and cuBLAS for every matmul (instead of Triton split-K GEMMs for
# the small projections). The fastest set measured on an H200 (experiments/results/bench_sampling.json).
GPU_COMPILER_OPTIONS = {
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUDNN,CUSTOM_CALL,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL",
    "xla_gpu_enable_triton_gemm": False,
}


@flax.struct.dataclass
class Completions:
    """Generated rows, prompt-major: row p*G + g is sample g of prompt p.

    tokens:    int32 [P*G, T]; the stop token is included, later slots hold the pad id.
    mask:      bool [P*G, T]; True on generated tokens up to and including the stop token.
    logprobs:  float32 [P*G, T]; log-probability of each token (0 where masked).
    lengths:   int32 [P*G]; number of True entries of `mask`.
    truncated: bool [P*G]; True when the row hit the token budget without a stop token.
    """

    tokens: jax.Array
    mask: jax.Array
    logprobs: jax.Array
    lengths: jax.Array
    truncated: jax.Array


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Shape buckets that bound the number of compiled programs.

    prompt: prompt width is rounded up to a multiple of this (extra left padding).
    new_tokens: the token budget is rounded up to a multiple of this; the exact budget is a
      runtime argument, so budgets within one bucket share a program.
    kv_block: attention segment width in decode steps (0: attend over the whole cache each step).
    """

    prompt: int = 64
    new_tokens: int = 256
    kv_block: int = 128

    def __post_init__(self):
        for name in ("prompt", "new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"Buckets.{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_block < 0:
            raise ValueError(f"Buckets.kv_block must be >= 0 (0 = one segment), got {self.kv_block}")


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def segment_ends(new_tokens: int, kv_block: int) -> tuple[int, ...]:
    """Decode-step boundaries of the attention segments: (kv_block, 2·kv_block, ..., new_tokens)."""
    if kv_block == 0 or kv_block >= new_tokens:
        return (new_tokens,)
    return tuple(range(kv_block, new_tokens, kv_block)) + (new_tokens,)


class Sampler:
    """Samples completions from one NNX `Decoder`; compiled programs are cached per bucket.

    The decoder's current weights are read at every call (`nnx.split`), so the sampler follows
    training updates made in place on the same model object.

    Args:
      model: the decoder (parameters already placed on `mesh` when one is given).
      stop_ids: token ids that end a completion (e.g. `tokenization.stop_token_ids`).
      pad_id: written after the stop token and used for extra prompt padding.
      mesh, rules: shard the batch over the mesh's batch axes and the cache per `rules`
        (default: the model's `DEFAULT_RULES`); None runs on the default device.
      buckets: shape buckets (see `Buckets`).
      compiler_options: XLA options for the sampler's programs only; None: `GPU_COMPILER_OPTIONS` on GPUs,
        XLA's defaults elsewhere ({} keeps XLA's defaults everywhere).
      attention: decode attention over the cache: "pallas" (the `decode_attention` kernel), "xla" (attention
        segments of `buckets.kv_block` steps) or "auto" (pallas on GPUs when the model's head_dim is a power of
        two and on TPUs when it is a multiple of 128, xla otherwise; see the module docstring).
      compaction: halvings of the decode batch as rows finish (0 = off; see the module docstring); the
        batch of every call must be divisible by 2^compaction (and each stage by the mesh's batch shards).
    """

    def __init__(self, model: Decoder, *, stop_ids: Sequence[int], pad_id: int = 0, mesh: Mesh | None = None,
                 rules=DEFAULT_RULES, buckets: Buckets = Buckets(), compiler_options: dict | None = None,
                 attention: str = "auto", compaction: int = 0):
        vocab = model.config.vocab_size
        stop_ids = tuple(int(i) for i in stop_ids)
        bad = [i for i in stop_ids + (pad_id,) if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"stop/pad ids {bad} are outside the model's vocabulary of {vocab}")
        self.model = model
        self.stop_ids = np.asarray(stop_ids, np.int32)
        self.pad_id = int(pad_id)
        self.mesh = mesh
        self.rules = rules
        self.buckets = buckets
        # the platform the programs are compiled for (compile_check compiles for TPU devices on a CPU host)
        self.platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
        if compiler_options is None:
            compiler_options = GPU_COMPILER_OPTIONS if self.platform == "gpu" else {}
        self.compiler_options = dict(compiler_options)
        if attention not in DECODE_ATTENTION_IMPLS:
            raise ValueError(f"unknown decode attention {attention!r}; use one of {DECODE_ATTENTION_IMPLS}")
        if attention == "auto":  # (an explicit "pallas" with a head_dim the kernel cannot tile fails in the kernel)
            fits = self.platform in ("gpu", "tpu") and supports_head_dim(model.config.head_dim, self.platform)
            attention = "pallas" if fits else "xla"
        self.attention = attention
        if not (isinstance(compaction, (int, np.integer)) and compaction >= 0):
            raise ValueError(f"decode compaction must be an integer >= 0 (0 = off), got {compaction!r}")
        self.compaction = int(compaction)
        self.programs: dict[Any, Any] = {}  # (graphdef, key type, bucket) -> compiled program
        self.compile_seconds: dict[Any, float] = {}  # bucket -> seconds

    @classmethod
    def from_policy(cls, policy, *, stop_ids: Sequence[int], buckets: Buckets = Buckets(),
                    attention: str = "auto", compaction: int = 0) -> "Sampler":
        """A sampler for a loaded `corl_jax.models.Policy` (its mesh, rules and pad id); `stop_ids` as for
        `Sampler`, usually `tokenization.stop_token_ids(policy.tokenizer, checkpoint_dir)`."""
        return cls(policy.model, stop_ids=stop_ids, pad_id=policy.tokenizer.pad_token_id, mesh=policy.mesh,
                   rules=policy.rules, buckets=buckets, attention=attention, compaction=compaction)

    def generate(self, prompt_ids, prompt_mask, *, num_samples: int, max_new_tokens: int,
                 params: SamplingParams, key: jax.Array, forced_lengths=None) -> Completions:
        """Samples `num_samples` completions of at most `max_new_tokens` tokens per prompt.

        prompt_ids int [P, Tp] and prompt_mask bool [P, Tp] are a left-padded batch (every row
        with at least one token). Returns `Completions` with T = max_new_tokens.
        forced_lengths (benchmarks): int [P*G]; row i then ends with the first stop id as its token
        forced_lengths[i] (>= 1) and sampled stop ids do not end it; rows forced past the budget are truncated.
        """
        ids, mask = np.asarray(prompt_ids), np.asarray(prompt_mask, bool)
        _check_prompts(ids, mask, self.model.config.vocab_size)
        if num_samples < 1 or max_new_tokens < 1:
            raise ValueError(f"num_samples ({num_samples}) and max_new_tokens ({max_new_tokens}) must be >= 1")
        rows = ids.shape[0] * num_samples
        stages = self.stages(rows)
        if forced_lengths is not None:
            forced_lengths = np.asarray(forced_lengths)
            if forced_lengths.shape != (rows,) or not self.stop_ids.size or forced_lengths.min() < 1:
                raise ValueError(f"forced_lengths must be {rows} lengths >= 1 (one per row) and the sampler needs "
                                 f"a stop id; got shape {forced_lengths.shape} with {self.stop_ids.size} stop ids")
            forced_lengths = forced_lengths.astype(np.int32)
        width = round_up(ids.shape[1], self.buckets.prompt)
        pad = width - ids.shape[1]
        ids = np.pad(ids.astype(np.int32), ((0, 0), (pad, 0)), constant_values=self.pad_id)
        mask = np.pad(mask, ((0, 0), (pad, 0)), constant_values=False)
        if self.mesh is not None:
            ids, mask = (jax.device_put(x, batch_sharding(x.shape, self.mesh, self.rules)) for x in (ids, mask))
        graphdef, state = nnx.split(self.model)
        new_bucket = round_up(max_new_tokens, self.buckets.new_tokens)
        program = self.program(graphdef, state, ids, mask, key, num_samples, new_bucket, params, stages,
                               forced_lengths is not None)
        out = program(state, ids, mask, self.stop_ids, np.int32(max_new_tokens), key, forced_lengths)
        return jax.tree.map(lambda x: x[:, :max_new_tokens] if x.ndim == 2 else x, out)

    def stages(self, rows: int) -> tuple[int, ...]:
        """Decode batch sizes of a call of `rows` rows: (rows, rows/2, ..., rows/2^compaction)."""
        stages = tuple(rows >> k for k in range(self.compaction + 1))
        if not self.compaction:
            return stages
        shards = self.batch_shards(rows)
        if rows % (1 << self.compaction) or stages[-1] % shards:
            raise ValueError(f"decode compaction {self.compaction} halves the batch of {rows} rows {self.compaction} "
                             f"times into multiples of the {shards} batch shard(s), which it does not divide; lower "
                             "rollout.decode_compaction (0 = off)")
        return stages

    def batch_shards(self, rows: int) -> int:
        """How many shards the mesh splits a batch of `rows` rows into (1 without a mesh)."""
        if self.mesh is None:
            return 1
        spec = logical_to_spec(("batch",), (rows,), self.mesh, self.rules)[0]
        return int(np.prod([self.mesh.shape[a] for a in ((spec,) if isinstance(spec, str) else spec or ())]))

    def program(self, graphdef, state, ids, mask, key, num_samples, new_bucket, params, stages=None, forced=False):
        """The compiled program of a bucket (compiled on first use). The arrays only give shapes and shardings:
        `jax.ShapeDtypeStruct`s compile without weights (`corl_jax.compile_check`)."""
        stages = stages or (ids.shape[0] * num_samples,)
        bucket = dict(prompts=ids.shape[0], samples=num_samples, prompt_width=ids.shape[1], new_tokens=new_bucket,
                      kv_block=self.buckets.kv_block, params=params, attention=self.attention, stages=stages,
                      forced=forced)
        cache_key = (graphdef, str(key.dtype), key.shape, tuple(bucket.items()))  # typed or raw uint32 keys
        program = self.programs.get(cache_key)
        if program is None:
            log.info("sampler: compiling a program for bucket %s", bucket)
            start = time.perf_counter()
            static = dict(graphdef=graphdef, num_samples=num_samples, new_bucket=new_bucket,
                          kv_block=self.buckets.kv_block, params=params, pad_id=self.pad_id, mesh=self.mesh,
                          rules=self.rules, attention=self.attention, platform=self.platform, stages=stages,
                          batch_shards=self.batch_shards(stages[0]))
            jitted = jax.jit(_generate, static_argnames=tuple(static))
            forced_lengths = jax.ShapeDtypeStruct((stages[0],), jnp.int32) if forced else None
            program = jitted.lower(state, ids, mask, self.stop_ids, np.int32(0), key, forced_lengths,
                                   **static).compile(
                compiler_options=self.compiler_options or None)
            seconds = time.perf_counter() - start
            log.info("sampler: compiled bucket %s in %.1f s", bucket, seconds)
            self.programs[cache_key] = program
            self.compile_seconds[tuple(bucket.items())] = seconds
        return program


def _generate(state, prompt_ids, prompt_mask, stop_ids, max_new, key, forced_lengths, *, graphdef, num_samples,
              new_bucket, kv_block, params: SamplingParams, pad_id, mesh, rules, attention, platform,
              stages, batch_shards) -> Completions:
    """The whole generation program (see the module docstring)."""
    model = nnx.merge(graphdef, state)
    weights = model.decode_weights()
    P, Tp = prompt_ids.shape
    B = P * num_samples
    positions = positions_from_mask(prompt_mask)
    hidden, cache = model.prefill(prompt_ids, positions, prompt_mask, model.init_cache(P, Tp), attend_len=Tp)
    cache = cache.repeat_batch(num_samples, round_up(Tp + new_bucket, CACHE_BLOCK))
    if mesh is not None:
        cache = jax.lax.with_sharding_constraint(cache, cache_shardings(cache, mesh, rules))
    logits = jnp.repeat(weights.logits(hidden), num_samples, axis=0)
    first, first_logprob = sample_tokens(logits, jax.random.fold_in(key, 0), params)
    # Position of each row's first new token: one past its last prompt token.
    start_positions = jnp.repeat(positions[:, -1] + 1, num_samples)
    compacts = len(stages) > 1

    def ends(tokens, rows, step):
        """Whether each row's token at `step` (0-based) ends it, and the token to write."""
        if forced_lengths is None:
            return jnp.isin(tokens, stop_ids), tokens
        forced = forced_lengths[rows] == step + 1
        return forced, jnp.where(forced, stop_ids[0], tokens)

    done, first = ends(first, jnp.arange(B), 0)
    carry = _Carry(
        cache=cache,
        tokens=jnp.full((B, new_bucket), pad_id, jnp.int32).at[:, 0].set(first),
        logprobs=jnp.zeros((B, new_bucket), jnp.float32).at[:, 0].set(first_logprob),
        done=done,
        lengths=jnp.ones((B,), jnp.int32),
        rows=jnp.arange(B, dtype=jnp.int32),
        step=jnp.ones((), jnp.int32),
    )

    def decode_step(c: _Carry, attend_len: int, cache_attention) -> _Carry:
        previous = jax.lax.dynamic_index_in_dim(c.tokens, c.step - 1, axis=1, keepdims=False)
        hidden, cache = model.decode_step(previous, start_positions[c.rows] + c.step - 1, c.cache, weights,
                                          attend_len=attend_len, cache_attention=cache_attention,
                                          batch_shards=batch_shards)
        step_key = jax.random.fold_in(key, c.step)
        # per-row uniforms of the whole batch, so that a row's draw does not depend on its stage's rows
        uniform = jax.random.uniform(step_key, (B,), jnp.float32)[c.rows] if compacts else None
        tokens, logprobs = sample_tokens(weights.logits(hidden), step_key, params, uniform=uniform)
        finished, tokens = ends(tokens, c.rows, c.step)
        tokens = jnp.where(c.done, pad_id, tokens)
        logprobs = jnp.where(c.done, 0.0, logprobs)
        return c.replace(
            cache=cache,
            tokens=jax.lax.dynamic_update_index_in_dim(c.tokens, tokens, c.step, axis=1),
            logprobs=jax.lax.dynamic_update_index_in_dim(c.logprobs, logprobs, c.step, axis=1),
            done=c.done | finished,
            lengths=c.lengths + (~c.done).astype(jnp.int32),
            step=c.step + 1,
        )

    segments = (new_bucket,) if attention == "pallas" else segment_ends(new_bucket, kv_block)
    out = None
    for stage, size in enumerate(stages):
        next_size = stages[stage + 1] if stage + 1 < len(stages) else 0
        cache_attention = _pallas_attention(carry.cache, mesh, rules, platform) if attention == "pallas" else None
        for end in segments:
            limit = jnp.minimum(end, max_new)
            carry = jax.lax.while_loop(
                lambda c, limit=limit, next_size=next_size: (c.step < limit) & (
                    _most_live_in_a_shard(c.done, batch_shards) > next_size // batch_shards),
                lambda c, attend_len=Tp + end, attend=cache_attention: decode_step(c, attend_len, attend),
                carry,
            )
        out = carry if out is None else _scatter(out, carry)
        if next_size:
            carry = _compact(carry, next_size, batch_shards, mesh, rules)
    mask = jnp.arange(new_bucket)[None, :] < out.lengths[:, None]
    return Completions(tokens=out.tokens, mask=mask, logprobs=out.logprobs, lengths=out.lengths, truncated=~out.done)


def _most_live_in_a_shard(done, batch_shards: int):
    """The largest count of live rows among the batch shards' blocks of rows."""
    return jnp.max(jnp.sum(~done.reshape(batch_shards, -1), axis=1))


def _compact(c: "_Carry", size: int, batch_shards: int, mesh: Mesh | None, rules) -> "_Carry":
    """`size` rows of `c`: each batch shard keeps size/s of its own rows, the live ones first (they all fit: the
    stage loop ran until no shard had more live rows). A shard's kept cache rows move to its leading rows inside
    the shard (see `KVCache`), so no row crosses shards."""
    per_shard = c.done.shape[0] // batch_shards
    local = jnp.argsort(c.done.reshape(batch_shards, per_shard), axis=1, stable=True)[:, :size // batch_shards]
    keep = (local + per_shard * jnp.arange(batch_shards)[:, None]).reshape(-1)
    return c.replace(cache=_move_to_leading_rows(c.cache, local, mesh, rules), tokens=c.tokens[keep],
                     logprobs=c.logprobs[keep], done=c.done[keep], lengths=c.lengths[keep], rows=c.rows[keep])


def _move_to_leading_rows(cache: KVCache, local, mesh: Mesh | None, rules) -> KVCache:
    """`cache` with each batch shard's rows local[shard] (int [shards, m], indices within the shard) moved to the
    shard's m leading rows; on a mesh, per shard (`shard_map`), so the move is local to each chip."""
    def move(cache, local):
        return cache.move_rows(local[0], jnp.arange(local.shape[1]))

    if mesh is None:
        return move(cache, local)
    specs = jax.tree.map(lambda s: s.spec, cache_shardings(cache, mesh, rules))
    return jax.shard_map(move, mesh=mesh, in_specs=(specs, jax.sharding.PartitionSpec(specs.mask[0])),
                         out_specs=specs, check_vma=False)(cache, local)


def _scatter(out: "_Carry", c: "_Carry") -> "_Carry":
    """`out` (every row) with the per-row results of the stage carry `c` written at its rows."""
    return out.replace(tokens=out.tokens.at[c.rows].set(c.tokens), logprobs=out.logprobs.at[c.rows].set(c.logprobs),
                       done=out.done.at[c.rows].set(c.done), lengths=out.lengths.at[c.rows].set(c.lengths))


def _pallas_attention(cache: KVCache, mesh: Mesh | None, rules, platform: str):
    """`decode_attention` for `platform` as the decoder's `cache_attention`; on a mesh it runs per shard
    (`shard_map` over the batch and kv-head shards of the cache: every shard attends its own rows and heads)."""
    # TPU: 128-slot blocks (fewer grid steps) where the cache length allows; GPU: the Triton kernel's 64
    block_k = 128 if platform == "tpu" and cache.max_len % 128 == 0 else 64
    kernel = functools.partial(decode_attention, block_k=block_k, backend=platform)
    if mesh is None:
        return kernel
    cache_spec = logical_to_spec(KVCache.logical_axes().k, cache.k.shape, mesh, rules)
    batch, heads = cache_spec[1], cache_spec[2]
    rows = jax.sharding.PartitionSpec(batch)
    q_spec = jax.sharding.PartitionSpec(batch, heads, None)  # q heads split like the kv heads (groups stay whole)

    def attend(q, k_cache, v_cache, layer, start, end):
        per_shard = lambda *args: kernel(*args[:3], layer, *args[3:])  # noqa: E731
        return jax.shard_map(per_shard, mesh=mesh, in_specs=(q_spec, cache_spec, cache_spec, rows, rows),
                             out_specs=q_spec, check_vma=False)(q, k_cache, v_cache, start, end)

    return attend


@flax.struct.dataclass
class _Carry:
    cache: KVCache
    tokens: jax.Array
    logprobs: jax.Array
    done: jax.Array
    lengths: jax.Array
    rows: jax.Array  # each row's index in the whole batch (stages of a compacted decode hold a subset)
    step: jax.Array


def _check_prompts(ids: np.ndarray, mask: np.ndarray, vocab: int) -> None:
    if ids.ndim != 2 or ids.shape != mask.shape:
        raise ValueError(f"prompt_ids {ids.shape} and prompt_mask {mask.shape} must both be [P, Tp]")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"prompt_ids must be integer token ids, got dtype {ids.dtype}")
    empty = np.flatnonzero(~mask.any(axis=1))
    if empty.size:
        raise ValueError(f"prompts {empty.tolist()} have no tokens (all-False mask rows); drop them")
    if np.any(mask[:, :-1] & ~mask[:, 1:]):
        raise ValueError("prompts must be left-padded: once a row's mask is True it must stay True "
                         "(use tokenization.encode_prompts, or a tokenizer with padding_side='left')")
    real = ids[mask]
    if real.size and (real.min() < 0 or real.max() >= vocab):
        raise ValueError(f"prompt token ids must be in [0, {vocab}), got range [{real.min()}, {real.max()}]")
