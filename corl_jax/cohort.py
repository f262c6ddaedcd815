"""The cohort: N agents, each with its own model, tokenizer, chat template, optimiser and PRNG stream, and one
Co-RL step over all of them (co_rl_reference.md §1.13):

    same prompt block ─► per agent: chat prompts → sample G completions (device) → texts (host)
    all texts ─► task.score: keys → voting.score_step (votes, teacher, rewards [A, P, G])       one controller
    per agent: advantages → GRPO update with its own optimiser                                  device

Labels pass in memory; every agent receives the same `PromptBlock`, so prompt ids cannot misalign. With
`placement="partitioned"` each agent owns a disjoint slice of the devices and JAX's asynchronous dispatch runs the
agents' sampling and updates concurrently; with `"shared"` they take turns on the whole mesh.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from flax import nnx

from corl_jax import grpo, multihost, packing
from corl_jax.config import ConfigError, topology_of
from corl_jax.data import DataError, Problem, PromptBlock
from corl_jax.models import Policy, positions_from_mask
from corl_jax.models.sharding import batch_sharding, make_mesh
from corl_jax.optim import init_opt_state, make_optimizer, make_schedule
from corl_jax.registry import resolve_model_paths
from corl_jax.sampling.controls import SamplingParams
from corl_jax.sampling.engine import Completions, Sampler
from corl_jax.stand_ins import load_policy
from corl_jax.tasks import make_task
from corl_jax.tokenization import decode_completions, encode_prompts, prompt_lengths, stop_token_ids

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class UpdateSettings:
    """The static GRPO settings of an agent's jitted update (hashable: part of the compiled program)."""

    loss_type: str
    eps_low: float
    eps_high: float
    beta: float
    num_micro: int
    chunk_size: int
    temperature: float
    group_size: int = 2                # the reference's per-device micro-batch: bnpo's groups, metric means
    max_completion_length: int = 0     # dr_grpo's divisor (the reference: max_completion_length); 0: padded width


@dataclasses.dataclass
class Agent:
    """One policy of the cohort. `params` are the fp32 master weights; the decoder computes in its compute dtype."""

    name: str
    index: int
    policy: Policy
    graphdef: Any
    params: Any
    opt_state: Any
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule        # learning rate of the n-th optimiser update (for logging)
    text_field: str
    chat_template: str | None
    sampler: Sampler
    key: jax.Array                  # base PRNG key: seed + agent index; each step folds in the step number
    ref_params: Any = None          # frozen initial weights, only when beta > 0
    tokens_seen: int = 0            # prompt + completion tokens trained on so far (TRL's num_input_tokens_seen)

    @property
    def mesh(self):
        return self.policy.mesh

    def step_key(self, step: int, purpose: int) -> jax.Array:
        return jax.random.fold_in(jax.random.fold_in(self.key, step), purpose)

    def encode(self, texts: list[str], max_prompt_len: int) -> tuple[np.ndarray, np.ndarray]:
        return encode_prompts(self.policy.tokenizer, texts, max_prompt_len=max_prompt_len,
                              chat_template=self.chat_template)

    def put(self, x) -> jax.Array:
        """`x` on the agent's devices, batch-sharded."""
        if self.mesh is None:
            return jnp.asarray(x)
        return jax.device_put(x, batch_sharding(x.shape, self.mesh, self.policy.rules))


def load_agents(config: ml_collections.ConfigDict, total_steps: int) -> list[Agent]:
    """Load every agent of `config` onto its devices (whole mesh or its own slice), with a fresh optimiser."""
    meshes = agent_meshes(config, jax.devices(), config.placement)
    agents = []
    paths = resolve_model_paths([spec.model_path for spec in config.agents.values()])
    for index, ((name, spec), path) in enumerate(zip(config.agents.items(), paths)):
        policy = load_policy(path, dtype=_DTYPES[spec.param_dtype], compute_dtype=_DTYPES[spec.compute_dtype],
                                 mesh=meshes[index], remat=config.grpo.remat, attention=config.grpo.attention)
        _check_checkpoint(name, spec, path, policy)
        agents.append(make_agent(config, name, index, policy, stop_token_ids(policy.tokenizer, path), total_steps))
    return agents


def _check_checkpoint(name: str, spec: ml_collections.ConfigDict, path: str, policy: Policy) -> None:
    """The agent's family is the architecture of its checkpoint, and its tokenizer fits the model's vocabulary."""
    if policy.config.model_type != spec.family:
        raise ConfigError(f"config.agents.{name}.family: {spec.family!r}, but {path} holds a "
                          f"{policy.config.model_type} model. Fix: set family={policy.config.model_type!r}, or point "
                          "model_path at a checkpoint of that family")
    tokens, vocab = len(policy.tokenizer), policy.config.vocab_size
    if tokens > vocab:
        raise ConfigError(f"config.agents.{name}.model_path: the tokenizer in {path} has {tokens} tokens but the "
                          f"model's vocab_size is {vocab} (ids from {vocab} on have no embedding). Fix: use the "
                          "tokenizer files that belong to these weights")


def check_prompt_lengths(agents: list[Agent], problems: list[Problem], max_prompt_len: int,
                         skip_bad_rows: bool) -> list[Problem]:
    """`problems` whose chat prompt fits `max_prompt_len` tokens for every agent. An over-long one raises a
    DataError naming its source row, or with `skip_bad_rows` is dropped with a warning."""
    too_long: dict[int, tuple[str, int]] = {}
    for agent in agents:
        texts = [getattr(p, agent.text_field) or p.text for p in problems]
        lengths = prompt_lengths(agent.policy.tokenizer, texts, chat_template=agent.chat_template)
        for i, n in enumerate(lengths):
            if n > max_prompt_len:
                too_long.setdefault(i, (agent.name, n))
    if not too_long:
        return problems
    first = min(too_long)
    where = (f"{problems[first].source}: row {problems[first].id}: its prompt has {too_long[first][1]} tokens for "
             f"agent {too_long[first][0]}, more than rollout.max_prompt_len={max_prompt_len}")
    if not skip_bad_rows:
        raise DataError(f"{where} ({len(too_long)} of {len(problems)} rows are too long). Fix: raise "
                        "config.rollout.max_prompt_len, or set config.data.skip_bad_rows=True to drop such rows")
    kept = [p for i, p in enumerate(problems) if i not in too_long]
    if not kept:
        raise DataError(f"{where}, and so is every other row. Fix: raise config.rollout.max_prompt_len")
    logging.warning("%s; dropped %d such rows of %d (data.skip_bad_rows)", where, len(too_long), len(problems))
    return kept


def make_agent(config: ml_collections.ConfigDict, name: str, index: int, policy: Policy, stop_ids,
               total_steps: int) -> Agent:
    """An agent around a loaded policy: optimiser and schedule per config.optim, sampler, PRNG stream."""
    spec = config.agents[name]
    graphdef, params = nnx.split(policy.model)
    lr = spec.learning_rate if spec.learning_rate > 0 else config.optim.learning_rate
    o, updates = config.optim, total_steps * config.grpo.num_iterations
    optimizer = make_optimizer(lr, updates, warmup_ratio=o.warmup_ratio, min_lr_rate=o.min_lr_rate, b1=o.b1,
                               b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, max_grad_norm=o.max_grad_norm)
    return Agent(
        name=name, index=index, policy=policy, graphdef=graphdef, params=params,
        opt_state=init_opt_state(optimizer, params, policy.mesh), optimizer=optimizer,
        schedule=make_schedule(lr, updates, warmup_ratio=o.warmup_ratio, min_lr_rate=o.min_lr_rate),
        text_field=spec.text_field, chat_template=spec.chat_template or None,
        sampler=Sampler.from_policy(policy, stop_ids=stop_ids, attention=config.rollout.decode_attention,
                                    compaction=config.rollout.decode_compaction),
        key=jax.random.key(config.seed + index),
        ref_params=_leafwise(jnp.copy, params) if config.grpo.beta > 0 else None)


def agent_meshes(config: ml_collections.ConfigDict, devices: list, placement: str) -> list:
    """One ("data", "fsdp", "tensor") mesh per agent of `config` over `devices`: all of them for every agent
    (placement "shared"), or disjoint equal slices (placement "partitioned"). On several processes each agent takes
    an equal share of every process's devices, so every agent spans every process (host reads of its arrays gather
    through collectives, which need devices of each process); on one, contiguous slices. `config.mesh.data=-1`
    fills the devices the other axes leave."""
    n, m = len(config.agents), config.mesh
    processes = sorted({d.process_index for d in devices})
    local = [[d for d in devices if d.process_index == p] for p in processes]
    if placement == "partitioned":
        each = len(local[0])
        if any(len(ds) != each for ds in local) or each < n or each % n:
            where = f"{len(devices)} chips" if len(local) == 1 else \
                f"the {[len(ds) for ds in local]} chips of {len(local)} processes"
            raise ValueError(f"placement=partitioned splits {where} among {n} agents: needs a multiple of the agent "
                             "count (on every process). Fix: --config.placement=shared (compile_check: "
                             "--placement=shared) or a larger slice")
        size = each // n
        groups = [[d for ds in local for d in ds[i * size:(i + 1) * size]] for i in range(n)]
    elif placement == "shared":
        groups = [list(devices)] * n
    else:
        raise ValueError(f"unknown placement {placement!r}. Fix: --config.placement=shared or partitioned")
    size = len(groups[0])
    data = size // (m.fsdp * m.tensor) if m.data == -1 else m.data
    used = data * m.fsdp * m.tensor
    what = f"mesh data={m.data} fsdp={m.fsdp} tensor={m.tensor}"
    if min(m.fsdp, m.tensor) < 1 or data < 1 or size % used or (m.data == -1 and used != size):
        raise ValueError(f"{what} does not fit the {size} chips of an agent ({placement} placement). Fix: "
                         f"--config.mesh.* with data*fsdp*tensor dividing {size} (data=-1 fills the rest)")
    if len(processes) > 1:
        missing = sorted(set(processes) - {d.process_index for d in groups[0][:used]})
        if missing:
            raise ValueError(f"{what} uses no device of process(es) {missing}; with several processes every agent's "
                             "mesh must span all of them. Fix: --config.mesh.data=-1 (all of the agent's devices) "
                             "or a mesh whose size is the agent's device count")
    return [make_mesh(data=data, fsdp=m.fsdp, tensor=m.tensor, devices=group[:used]) for group in groups]


# --------------------------------------------------------------------------------------------- the GRPO update


def _completion_logprobs(graphdef, params, tokens, attention, prompt_len: int, s: UpdateSettings):
    """log p, entropy and mean_v log p of the completion tokens [B, Tc] under the policy, in position chunks
    (never the whole [B, Tc, V] logits)."""
    model = nnx.merge(graphdef, params)
    hidden = model(tokens, positions_from_mask(attention), attention)[:, prompt_len - 1:-1]
    unembedding = model.unembedding().astype(hidden.dtype)
    return grpo.token_logprobs(hidden, unembedding, tokens[:, prompt_len:], temperature=s.temperature,
                               chunk_size=s.chunk_size, with_stats=True)


def _on_mesh(fn, mesh):
    """`fn` called inside `jax.set_mesh(mesh)`, where TPU attention kernels (splash) run per shard; `fn` without one."""
    if mesh is None:
        return fn

    def call(*args):
        with jax.set_mesh(mesh):
            return fn(*args)

    return call


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def score_completions(graphdef, params, tokens, attention, prompt_len: int, s: UpdateSettings):
    """No-grad log p / entropy / mean log p [B, Tc] in micro-batches (old log-probs, KL reference, RENT/Intuitor)."""
    micro = -(-tokens.shape[0] // s.num_micro)

    def one(xs):
        return _completion_logprobs(graphdef, params, *xs, prompt_len, s)

    split = lambda x: x.reshape(s.num_micro, micro, *x.shape[1:])
    outs = jax.lax.map(one, (split(tokens), split(attention)))
    return tuple(o.reshape(tokens.shape[0], -1) for o in outs)


def _loss_fn(graphdef, s: UpdateSettings, prompt_len: int, params, micro):
    logp, entropy, _ = _completion_logprobs(graphdef, params, micro["tokens"], micro["attention"], prompt_len, s)
    return grpo.grpo_loss(
        logp, micro.get("old_logp"), micro["advantages"], micro["completion_mask"], micro["row_weights"],
        eps_low=s.eps_low, eps_high=s.eps_high, beta=s.beta, ref_logp=micro.get("ref_logp"),
        is_ratio=micro.get("is_ratio"), entropy=entropy)


@functools.partial(jax.jit, static_argnums=(1,))
def _row_weights(completion_mask, s: UpdateSettings):
    """The reference's per-row loss weights of a step's rows in reference micro-batch order (`grpo.loss_row_weights`)."""
    return grpo.loss_row_weights(completion_mask, loss_type=s.loss_type, group_size=s.group_size,
                                 max_completion_length=s.max_completion_length or completion_mask.shape[1])


def _apply(optimizer, params, opt_state, grads, loss, rows, s: UpdateSettings):
    metrics = grpo.loss_metrics(rows, s.group_size)
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    metrics = dict(metrics, loss=loss, grad_norm=grad_norm, skipped=(~finite).astype(jnp.float32))
    return keep(new_params, params), keep(new_opt_state, opt_state), metrics


@functools.partial(jax.jit, static_argnums=(0, 1, 5), donate_argnums=(2, 3))
def update(graphdef, optimizer, params, opt_state, batch, s: UpdateSettings):
    """One optimiser step on a batch of completions with exact gradient accumulation over micro-batches.

    The loss and gradient are the reference's for micro-batches of `s.group_size` rows, whatever `s.num_micro`
    (which only trades memory for speed). Optional batch keys: `old_logp` (PPO ratio's denominator; absent:
    c == 1), `is_ratio` (sampler importance weights), `ref_logp` (KL, beta > 0).
    A non-finite loss or gradient leaves parameters and optimiser state unchanged (`metrics["skipped"]` = 1)."""
    prompt_len = batch["tokens"].shape[1] - batch["completion_mask"].shape[1]
    batch = dict(batch, row_weights=_row_weights(batch["completion_mask"], s))
    loss_and_grad = jax.value_and_grad(functools.partial(_loss_fn, graphdef, s, prompt_len), has_aux=True)
    (loss, rows), grads = grpo.accumulate_grads(loss_and_grad, params, batch, s.num_micro)
    return _apply(optimizer, params, opt_state, grads, loss, rows, s)


def completion_widths(attention: np.ndarray, prompt_len: int) -> np.ndarray:
    """Per row, the completion columns up to its last attended token (host [N, Tp + Tc] attention)."""
    completion = np.asarray(attention)[:, prompt_len:]
    last = completion.shape[1] - np.argmax(completion[:, ::-1], axis=1)
    return np.where(completion.any(axis=1), last, 0)


def bucket_plan(prompt_tokens: np.ndarray, widths: np.ndarray, num_micro: int, bucket: int, prompt_len: int,
                max_width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows sorted by completion width into `num_micro` micro-batches (row indices [num_micro, rows]), with each
    micro-batch's prompt and completion widths: its longest prompt / completion rounded up to `bucket` tokens (at
    most `prompt_len` / `max_width`). `bucket` 0: batch order at the full widths."""
    if bucket == 0:
        return (np.arange(len(widths)).reshape(num_micro, -1), np.full(num_micro, prompt_len),
                np.full(num_micro, max_width))
    order = np.argsort(widths, kind="stable").reshape(num_micro, -1)
    rounded = lambda x, cap: np.minimum(np.maximum(-(-x.max(axis=1) // bucket) * bucket, bucket), cap)
    return order, rounded(prompt_tokens[order], prompt_len), rounded(widths[order], max_width)


def padded_flops_fraction(model_config, prompt_tokens: np.ndarray, widths: np.ndarray,
                          plan: tuple[np.ndarray, np.ndarray, np.ndarray]) -> float:
    """Share of the update's FLOPs (`ModelConfig.train_flops`) spent on padding, 1 - real / executed: rows of
    `prompt_tokens` + `widths` real tokens, run as the plan's micro-batches at their prompt + completion widths."""
    order, prompt_widths, micro_widths = plan
    executed = sum(order.shape[1] * model_config.train_flops(int(p + w), int(w))
                   for p, w in zip(prompt_widths, micro_widths))
    real = sum(model_config.train_flops(int(p + w), int(w)) for p, w in zip(prompt_tokens, widths))
    return 1.0 - real / executed


@functools.partial(jax.jit, static_argnums=(0, 5, 6), donate_argnums=(2, 3))
def _accumulate(graphdef, params, grad_sum, loss_sum, micro, prompt_len: int, s: UpdateSettings):
    loss_and_grad = jax.value_and_grad(functools.partial(_loss_fn, graphdef, s, prompt_len), has_aux=True)
    (loss, rows), grads = loss_and_grad(params, micro)
    return jax.tree.map(lambda a, g: a + g.astype(a.dtype), grad_sum, grads), loss_sum + loss, rows


_apply_jit = jax.jit(_apply, static_argnums=(0, 6), donate_argnums=(1, 2))


def bucketed_update(graphdef, optimizer, params, opt_state, batch, s: UpdateSettings,
                    plan: tuple[np.ndarray, np.ndarray, np.ndarray]):
    """`update` over the micro-batches of `plan` (`bucket_plan`: rows sorted by completion length, each micro-batch
    trimmed to its bucket widths; one compiled program per width pair). The row weights are computed in the batch's
    (reference) order before sorting, so loss and gradient equal `update`'s up to float summation order; metrics
    likewise."""
    prompt_len = batch["tokens"].shape[1] - batch["completion_mask"].shape[1]
    batch = dict(batch, row_weights=_row_weights(batch["completion_mask"], s))
    order, prompt_widths, micro_widths = plan
    grads = _leafwise(jnp.zeros_like, params)
    loss, rows = jnp.zeros((), jnp.float32), []

    def trim(key, x, idx, prompt_width, width):
        x = x[idx]
        if key in ("tokens", "attention"):  # left-padded prompts: drop leading columns that no row attends
            return x[:, prompt_len - prompt_width:prompt_len + width]
        return x[:, :width] if x.ndim == 2 else x

    for idx, prompt_width, width in zip(order, prompt_widths.tolist(), micro_widths.tolist()):
        micro = {k: trim(k, v, idx, prompt_width, width) for k, v in batch.items()}
        grads, loss, micro_rows = _accumulate(graphdef, params, grads, loss, micro, prompt_width, s)
        rows.append(micro_rows)
    inverse = np.argsort(order.reshape(-1))
    rows = jax.tree.map(lambda *xs: jnp.concatenate(xs)[inverse], *rows)
    return _apply_jit(optimizer, params, opt_state, grads, loss, rows, s)


def _packed_logprobs(graphdef, params, micro, s: UpdateSettings):
    """log p and entropy [N, Tc] of the completion tokens of a packed micro-batch's rows (`packing.packed_micro`);
    other rows' columns read an arbitrary scored slot (mask them)."""
    model = nnx.merge(graphdef, params)
    hidden = model(micro["tokens"], micro["positions"], micro["segments"])
    hidden = hidden.reshape(-1, hidden.shape[-1])[micro["head_index"]]  # [K, H, D]: completion-predicting only
    unembedding = model.unembedding().astype(hidden.dtype)
    logp, entropy, _ = grpo.token_logprobs(hidden, unembedding, micro["targets"], temperature=s.temperature,
                                           chunk_size=s.chunk_size, with_stats=True)
    return logp.reshape(-1)[micro["row_index"]], entropy.reshape(-1)[micro["row_index"]]


def _packed_loss_fn(graphdef, s: UpdateSettings, params, batch, micro):
    logp, entropy = _packed_logprobs(graphdef, params, micro, s)
    mask = batch["completion_mask"] * micro["scored"]
    live, old_logp = mask > 0, batch.get("old_logp")
    # columns outside this micro-batch's rows: inert, finite values (c = 1) instead of another row's log-prob
    logp = jnp.where(live, logp, 0.0 if old_logp is None else old_logp)
    return grpo.grpo_loss(
        logp, old_logp, batch["advantages"], mask, batch["row_weights"], eps_low=s.eps_low, eps_high=s.eps_high,
        beta=s.beta, ref_logp=batch.get("ref_logp"), is_ratio=batch.get("is_ratio"),
        entropy=jnp.where(live, entropy, 0.0))


@functools.partial(jax.jit, static_argnums=(0, 4), donate_argnums=(2, 3))
def _accumulate_packed(graphdef, params, grad_sum, loss_sum, s: UpdateSettings, batch, micro):
    loss_and_grad = jax.value_and_grad(functools.partial(_packed_loss_fn, graphdef, s), has_aux=True)
    (loss, rows), grads = loss_and_grad(params, batch, micro)
    return jax.tree.map(lambda a, g: a + g.astype(a.dtype), grad_sum, grads), loss_sum + loss, rows


@functools.partial(jax.jit, static_argnums=(0, 3))
def _score_packed(graphdef, params, micro, s: UpdateSettings):
    logp, _ = _packed_logprobs(graphdef, params, micro, s)
    return jnp.where(micro["scored"], logp, 0.0)


def _placed(tree, shardings):
    """`tree` on the (same-structured) `shardings`, by one program that every process runs. (`jax.device_put`
    decides leaf by leaf, from each array's sharding as its process reports it, whether to run a resharding program;
    a 2-process packed run hung at step 2 with both processes inside those programs.)"""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, _placer(tuple(jax.tree.leaves(shardings)))(leaves))


@functools.lru_cache(maxsize=64)
def _placer(shardings: tuple):
    """The identity on a list of arrays, compiled with `shardings` as its outputs' (kept exactly, P("x", None) too,
    so that the next step's programs see the shardings they were compiled for)."""
    return jax.jit(lambda leaves: leaves, out_shardings=list(shardings), donate_argnums=0)


def _leafwise(fn, tree):
    """`jax.tree.map(fn, tree)` for a one-array `fn` (`jnp.zeros_like`, `jnp.copy`) as one program whose outputs keep
    the leaves' shardings. Eagerly every leaf is a program of its own, and on several CPU processes such a burst
    right behind a collective program hung XLA:CPU (2 x 4 packed run, at step 2 or 3, 2 hangs in 15 runs): in each
    process three devices' parts of an all-reduce waited in gloo for the fourth, which waited for a launch slot on
    its device (`xla::Semaphore` in `CpuPjRtRawLoadedExecutable::Execute`)."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, _leafwise_program(fn, tuple(x.sharding for x in leaves))(leaves))


@functools.lru_cache(maxsize=64)
def _leafwise_program(fn, shardings: tuple):
    return jax.jit(lambda leaves: [fn(x) for x in leaves], out_shardings=list(shardings))


@jax.jit
def _sum_trees(trees: list):
    """The leafwise sum of same-structured trees, as one program (one per list length). Summed eagerly, the adds of
    differently sharded per-micro-batch outputs hung XLA:CPU's collectives on 8 devices (the paper-shape CLI run)."""
    return jax.tree.map(lambda *xs: sum(xs), *trees)


def packed_micro_batches(plan: packing.PackPlan, tokens: np.ndarray, attention: np.ndarray, prompt_len: int,
                         prompt_tokens: np.ndarray, widths: np.ndarray, put) -> list[dict[str, jax.Array]]:
    """The plan's micro-batches (`packing.packed_micro`) of the step's host rows, placed by `put`."""
    return [jax.tree.map(put, packing.packed_micro(tokens, attention, prompt_len, prompt_tokens, widths, plan, m))
            for m in range(plan.num_micro)]


def packed_score(graphdef, params, micros: list[dict[str, jax.Array]], s: UpdateSettings) -> jax.Array:
    """`score_completions`' log p [N, Tc] from packed micro-batches (0 after each row's last attended column)."""
    return _sum_trees([_score_packed(graphdef, params, micro, s) for micro in micros])


def packed_update(graphdef, optimizer, params, opt_state, batch, s: UpdateSettings,
                  micros: list[dict[str, jax.Array]]):
    """`update` over packed micro-batches (`packed_micro_batches`; one compiled program per line width and scored
    length). `batch` holds the step's row arrays ([N] / [N, Tc]: completion_mask, advantages and the optional
    old_logp, is_ratio, ref_logp); row weights come from the whole step's mask in the batch's (reference) order, so
    loss, gradient and metrics equal `update`'s up to float summation order."""
    batch = dict(batch, row_weights=_row_weights(batch["completion_mask"], s))
    grads = _leafwise(jnp.zeros_like, params)
    loss, rows = jnp.zeros((), jnp.float32), []
    for micro in micros:
        grads, loss, micro_rows = _accumulate_packed(graphdef, params, grads, loss, s, batch, micro)
        rows.append(micro_rows)  # zero outside the micro-batch's rows
    rows = _sum_trees(rows)
    return _apply_jit(optimizer, params, opt_state, grads, loss, rows, s)


# --------------------------------------------------------------------------------------------- one step


@dataclasses.dataclass
class Rollouts:
    """One agent's completions of a prompt block (device arrays until fetched)."""

    prompt_ids: np.ndarray     # [P, Tp]
    prompt_mask: np.ndarray    # [P, Tp]
    completions: Completions   # [P*G, ...]
    texts: list[str] | None = None


class Cohort:
    """The agents of a run and the step that trains them together."""

    def __init__(self, config: ml_collections.ConfigDict, agents: list[Agent]):
        self.config = config
        self.agents = agents
        self.topology = topology_of(config)
        self.task = make_task(config)  # vote keys, the reward's equivalence and eval grading of config.task
        g, r = config.grpo, config.rollout
        batch = r.prompts_per_step * r.num_generations
        self.settings = UpdateSettings(loss_type=g.loss_type, eps_low=g.eps_low, eps_high=g.eps_high, beta=g.beta,
                                       num_micro=batch // g.micro_batch_size, chunk_size=g.logprob_chunk_size,
                                       temperature=r.temperature if r.temperature > 0 else 1.0,
                                       group_size=g.reference_micro_batch_size,
                                       max_completion_length=r.max_new_tokens)

    def sample(self, agent: Agent, texts: list[str], key: jax.Array, *, num_samples: int, max_new_tokens: int,
               temperature: float) -> Rollouts:
        """Dispatch one agent's sampling (asynchronous: no host transfer here, except `multihost.settled`'s wait)."""
        r = self.config.rollout
        ids, mask = agent.encode(texts, r.max_prompt_len)
        params = SamplingParams(temperature=temperature if temperature > 0 else 1.0, top_p=r.top_p, top_k=r.top_k,
                                min_p=r.min_p, greedy=temperature == 0)
        nnx.update(agent.policy.model, agent.params)  # the sampler reads the model's current weights
        out = agent.sampler.generate(ids, mask, num_samples=num_samples, max_new_tokens=max_new_tokens,
                                     params=params, key=key)
        return Rollouts(ids, mask, multihost.settled(out))

    def finish(self, agent: Agent, rollouts: Rollouts) -> Rollouts:
        """Fetch the completions (gathered from every process) and decode their texts (host)."""
        tokens, mask = multihost.to_host((rollouts.completions.tokens, rollouts.completions.mask))
        rollouts.texts = decode_completions(agent.policy.tokenizer, tokens, mask)
        return rollouts

    def step(self, block: PromptBlock, step: int) -> tuple[dict[str, dict[str, float]], list[dict]]:
        """One Co-RL step on `block`; returns per-agent metrics and the per-prompt vote records."""
        r, timings = self.config.rollout, {}
        t0 = time.perf_counter()
        rollouts = [self.sample(a, block.texts(a.text_field), a.step_key(step, 0), num_samples=r.num_generations,
                                max_new_tokens=r.max_new_tokens, temperature=r.temperature) for a in self.agents]
        rollouts = [self.finish(a, ro) for a, ro in zip(self.agents, rollouts)]
        timings["time/sampling"] = time.perf_counter() - t0
        batches = [self._batch(a, ro) for a, ro in zip(self.agents, rollouts)]

        records: list[dict] = []
        if self.topology == "intrinsic":
            t0 = time.perf_counter()
            rewards, label_metrics = self._intrinsic_rewards(batches), {a.name: {} for a in self.agents}
            timings["time/rewards"] = time.perf_counter() - t0
        elif multihost.is_main():  # grading is time-bounded: one process grades, every process gets its rewards
            result = self.task.score(
                [ro.texts for ro in rollouts], block.problems, topology=self.topology,
                threshold=self.config.self_consistency_threshold, step=step,
                agent_names=[a.name for a in self.agents])
            rewards, label_metrics, records = multihost.broadcast(result.rewards), result.metrics, result.records
            timings.update(result.timings)
        else:
            shape = (len(self.agents), len(block.problems), r.num_generations)
            rewards = multihost.broadcast(np.zeros(shape, np.float32))
            label_metrics = {a.name: {} for a in self.agents}

        t0 = time.perf_counter()
        pending = [self._update(a, ro, b, rewards[a.index].reshape(-1), step)
                   for a, ro, b in zip(self.agents, rollouts, batches)]
        metrics = {a.name: {**label_metrics[a.name], **{k: float(v) for k, v in m.items()}, **timings}
                   for a, m in zip(self.agents, pending)}
        update_time = time.perf_counter() - t0
        for m in metrics.values():
            m["time/update"] = update_time
        return metrics, records

    def _batch(self, agent: Agent, rollouts: Rollouts) -> dict[str, jax.Array]:
        """Prompt (repeated G times) + completion token rows, attention and loss masks."""
        g = self.config.rollout.num_generations
        c = rollouts.completions
        prompt_ids = agent.put(np.repeat(rollouts.prompt_ids, g, axis=0))
        prompt_mask = agent.put(np.repeat(rollouts.prompt_mask, g, axis=0))
        loss_mask = c.mask
        if self.config.grpo.mask_truncated_completions:
            loss_mask = loss_mask & ~c.truncated[:, None]
        return {"tokens": jnp.concatenate([prompt_ids, c.tokens], axis=1),
                "attention": jnp.concatenate([prompt_mask, c.mask], axis=1),
                "completion_mask": loss_mask.astype(jnp.float32),
                "sampling_logp": c.logprobs}

    def _intrinsic_rewards(self, batches: list[dict[str, jax.Array]]) -> np.ndarray:
        """RENT (−mean entropy) or Intuitor (mean KL(U‖p)) per completion, from a no-grad forward (§4.3)."""
        kind = "entropy" if self.config.method == "rent" else "self_certainty"
        out = []
        for agent, b in zip(self.agents, batches):
            prompt_len = b["tokens"].shape[1] - b["completion_mask"].shape[1]
            score = _on_mesh(score_completions, agent.mesh)
            _, entropy, mean_logp = score(agent.graphdef, agent.params, b["tokens"], b["attention"],
                                          prompt_len, self.settings)
            out.append(multihost.settled(grpo.intrinsic_rewards(entropy, mean_logp, b["completion_mask"],
                                                                agent.policy.config.vocab_size, kind)))
        g = self.config.rollout.num_generations
        return np.stack([x.reshape(-1, g) for x in multihost.to_host(out)])

    def _update(self, agent: Agent, rollouts: Rollouts, batch: dict[str, jax.Array], rewards: np.ndarray,
                step: int) -> dict[str, Any]:
        """Advantages, then `num_iterations` optimiser steps of one agent on its rollouts (rows shuffled into
        micro-batches as the reference does), with the reference's metrics (§5.4)."""
        g, r = self.config.grpo, self.config.rollout
        train = _on_mesh(update, agent.mesh)
        rewards = jnp.asarray(rewards, jnp.float32)  # host-side values (the same on every process): local device
        batch = dict(batch, advantages=agent.put(np.asarray(
            grpo.group_advantages(rewards, r.num_generations, scale=g.scale_rewards))))
        order = np.asarray(jax.random.permutation(agent.step_key(step, 1), rewards.shape[0]))
        batch = jax.tree.map(lambda x: x[order], batch)
        sampling_logp = batch.pop("sampling_logp")
        prompt_len = batch["tokens"].shape[1] - batch["completion_mask"].shape[1]
        attention = multihost.to_host(batch["attention"])  # the micro-batch plan and the padded-FLOPs metric read it
        prompt_tokens, widths = attention[:, :prompt_len].sum(axis=1), completion_widths(attention, prompt_len)
        if g.packing:
            plan = packing.pack_plan(prompt_tokens, widths, g.micro_batch_size, attention.shape[1], g.length_bucket)
            micros = packed_micro_batches(plan, multihost.to_host(batch.pop("tokens")), attention, prompt_len,
                                          prompt_tokens, widths, agent.put)
            del batch["attention"]
            score = lambda graphdef, params: _on_mesh(packed_score, agent.mesh)(graphdef, params, micros,
                                                                                 self.settings)
            padded = packing.packed_flops_fraction(agent.policy.config, prompt_tokens, widths, plan)
        else:
            plan = bucket_plan(prompt_tokens, widths, self.settings.num_micro, g.length_bucket, prompt_len,
                               attention.shape[1] - prompt_len)
            score = lambda graphdef, params: _on_mesh(score_completions, agent.mesh)(
                graphdef, params, batch["tokens"], batch["attention"], prompt_len, self.settings)[0]
            padded = padded_flops_fraction(agent.policy.config, prompt_tokens, widths, plan)
        correction = {}
        if g.num_iterations > 1 or g.importance_sampling_correction:  # TRL computes old log-probs in both cases
            batch["old_logp"] = score(agent.graphdef, agent.params)
        if g.importance_sampling_correction:
            batch["is_ratio"], correction = grpo.sampling_correction(
                batch["old_logp"], sampling_logp, batch["completion_mask"], g.importance_sampling_cap)
        if agent.ref_params is not None:
            batch["ref_logp"] = score(agent.graphdef, agent.ref_params)
        shardings = jax.tree.map(lambda x: x.sharding, (agent.params, agent.opt_state))
        for _ in range(g.num_iterations):
            if g.packing:
                params, opt_state, metrics = _on_mesh(packed_update, agent.mesh)(
                    agent.graphdef, agent.optimizer, agent.params, agent.opt_state, batch, self.settings, micros)
            elif g.length_bucket:
                params, opt_state, metrics = _on_mesh(bucketed_update, agent.mesh)(
                    agent.graphdef, agent.optimizer, agent.params, agent.opt_state, batch, self.settings, plan)
            else:
                params, opt_state, metrics = train(agent.graphdef, agent.optimizer, agent.params, agent.opt_state,
                                                   batch, self.settings)
            # back on the input's (equivalent) shardings, so that every step reuses one compiled `update` (and the
            # sampler's programs and a restore target find the loaded layout)
            agent.params, agent.opt_state = _placed((params, opt_state), shardings)
        c = rollouts.completions
        metrics, correction, lengths, truncated = multihost.to_host((metrics, correction, c.lengths, c.truncated))
        metrics["update/padded_flops_fraction"] = padded
        terminated = lengths[~truncated] if (~truncated).any() else np.zeros(1, lengths.dtype)
        agent.tokens_seen += int(rollouts.prompt_mask.sum()) * r.num_generations + int(lengths.sum())
        first_update = (step - 1) * g.num_iterations
        return {**grpo.reward_metrics(rewards, r.num_generations, _REWARD_NAMES.get(self.config.method,
                                                                                    "reward_correctness")),
                **self._intrinsic_metrics(rewards), **metrics, **correction,
                "learning_rate": agent.schedule(first_update), "num_tokens": agent.tokens_seen,
                "completions/mean_length": lengths.mean(), "completions/min_length": lengths.min(),
                "completions/max_length": lengths.max(), "completions/mean_terminated_length": terminated.mean(),
                "completions/min_terminated_length": terminated.min(),
                "completions/max_terminated_length": terminated.max(),
                "completions/clipped_ratio": truncated.mean()}

    def _intrinsic_metrics(self, rewards: jax.Array) -> dict[str, jax.Array]:
        """RENT / Intuitor's own logs of the mean reward (§5.3): the same number under the reference's names."""
        mean = jnp.mean(rewards)
        if self.config.method == "rent":
            return {"intrinsic/entropy/avg": mean, "entropy/avg_reward": mean, "entropy/avg_H": -mean}
        if self.config.method == "intuitor":
            return {"intrinsic/self_certainty/avg": mean, "self_certainty/avg_reward": mean,
                    "self_certainty/avg_kl_u_p": mean}
        return {}


# The reference's reward-function names (TRL logs rewards/<function name>/mean|std).
_REWARD_NAMES = {"rent": "reward_entropy", "intuitor": "reward_self_certainty"}
