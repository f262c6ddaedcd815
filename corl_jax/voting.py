"""From completions to rewards: answer interning, the vote kernel, supervision topologies, co-labeling metrics.

One step of Co-RL (co_rl_reference.md §1.4-1.9) as data:

    text ──extract──► pred text (raw, "" if none) ──normalize──► vote key (None if none)      host, once each
    vote keys ──Interner──► answer ids int32 [A, P, G] (−1 = no answer)                       host
    answer ids ──vote──► label ids [A, P] (−1 = unlabeled), top_freq [A, P]                   jit (stage 1)
    labels ──teacher_labels(topology)──► supervising label ids [A, P]                         jit
    distinct (pred text, label text) pairs ──PairGrader (cached)──► rewards [A, P, G]         host (stage 2)

Strings never enter a jitted function; grading (sympy, slow) is paid once per distinct pair and cached across
steps. The answer rules (extract / normalize / grade) are injected, so this module serves every task and method:
Co-RL math uses `answers.math.grade_answer` (the sci-notation wrapper), TTRL and GT-Reward the raw grader.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

NO_ANSWER = -1  # id of "no answer" (None) and of "unlabeled" (the reference's sentinel)

# pair: A and B supervise each other (2 agents). ring: agent a is supervised by agent (a+1) mod A, the reference
# launchers' `peers[0]` (A←B, B←C, C←A); supervision flows backwards round the ring. peer_majority: the unique
# plurality of the other agents' labels (`_peer_majority_vote`, unused by the reference runs). self: own label
# (TTRL). ground_truth: the dataset's gold answer (GT-Reward).
TOPOLOGIES = ("pair", "ring", "peer_majority", "self", "ground_truth")


class Interner:
    """Maps strings to dense ids 0, 1, 2, ... in first-seen order; None maps to NO_ANSWER and back."""

    def __init__(self):
        self._ids: dict[str, int] = {}
        self.strings: list[str] = []

    def __len__(self) -> int:
        return len(self.strings)

    def intern(self, s: str | None) -> int:
        if s is None:
            return NO_ANSWER
        if not isinstance(s, str):
            raise TypeError(f"Interner takes str or None, got {type(s).__name__}: {s!r}")
        i = self._ids.get(s)
        if i is None:
            i = self._ids[s] = len(self.strings)
            self.strings.append(s)
        return i

    def intern_all(self, items: Sequence[str | None]) -> np.ndarray:
        return np.fromiter((self.intern(s) for s in items), np.int32, len(items))

    def lookup(self, i: int) -> str | None:
        return None if i == NO_ANSWER else self.strings[i]


# ----------------------------------------------------------------------------------------------------------------
# Stage 1: majority vote and supervision (jitted, vectorised over agents and prompts)


@functools.lru_cache(maxsize=256)
def _min_counts(threshold: float, g: int) -> np.ndarray:
    """min_counts[n] = fewest votes c with not (c / n < threshold), exactly as the reference's float64 test."""
    table = np.zeros(g + 1, np.int32)
    for n in range(1, g + 1):
        c = max(0, math.ceil(threshold * n) - 1)
        while c <= n and c / n < threshold:
            c += 1
        table[n] = c  # n + 1 (never reached) when threshold > 1
    return table


@jax.jit
def _vote_kernel(answer_ids: jax.Array, min_counts: jax.Array) -> tuple[jax.Array, jax.Array]:
    valid = answer_ids >= 0
    # counts[..., i] = how many rollouts share rollout i's answer (O(G²) comparisons, G ≤ 64).
    counts = jnp.where(valid, (answer_ids[..., :, None] == answer_ids[..., None, :]).sum(-1), 0)
    best = jnp.argmax(counts, axis=-1)[..., None]  # first maximum = the tied key seen first (Counter order)
    top = jnp.take_along_axis(counts, best, -1)[..., 0]
    n_valid = valid.sum(-1)
    labeled = (n_valid > 0) & (top >= min_counts[n_valid])
    labels = jnp.where(labeled, jnp.take_along_axis(answer_ids, best, -1)[..., 0], NO_ANSWER)
    top_freq = top / jnp.maximum(n_valid, 1)
    return labels.astype(jnp.int32), top_freq.astype(jnp.float32)


def vote(answer_ids, threshold: float) -> tuple[jax.Array, jax.Array]:
    """Per (agent, prompt) plurality answer over G rollouts, as the reference's `_majority_vote` (§1.5).

    answer_ids: int [A, P, G], −1 = rollout without an answer. The frequency of the winner is taken over the
    parseable rollouts (not G); ties go to the answer seen first in rollout order. Returns (labels int32 [A, P],
    −1 where no rollout parses or top_freq < threshold; top_freq float32 [A, P], 0 where no rollout parses).
    """
    answer_ids = jnp.asarray(answer_ids)
    if answer_ids.ndim != 3 or not jnp.issubdtype(answer_ids.dtype, jnp.integer):
        raise ValueError(f"answer_ids must be an integer array [agents, prompts, G], got {answer_ids.dtype}"
                         f"{list(answer_ids.shape)}")
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"self-consistency threshold must be in [0, 1], got {threshold} (the reference uses 0.0)")
    return _vote_kernel(answer_ids.astype(jnp.int32), _min_counts(float(threshold), answer_ids.shape[-1]))


def _peer_majority(labels: jax.Array) -> jax.Array:
    """Per agent, the unique plurality of the other agents' labels; a tie or no labeled peer gives −1."""
    n = labels.shape[0]
    is_peer = ~jnp.eye(n, dtype=bool)  # [a, b]: b is a peer of a
    labeled = labels >= 0
    agrees = (labels[:, None, :] == labels[None, :, :]) & labeled[None, :, :]  # [b, c, p]
    votes = jnp.einsum("ac,bcp->abp", is_peer.astype(jnp.int32), agrees.astype(jnp.int32))  # a's peers voting b's
    candidate = is_peer[:, :, None] & labeled[None, :, :]  # [a, b, p]
    votes = jnp.where(candidate, votes, 0)
    top = votes.max(1)  # [a, p]
    winner = jnp.take_along_axis(jnp.broadcast_to(labels, votes.shape), votes.argmax(1)[:, None, :], 1)[:, 0]
    rival = candidate & (labels[None] != winner[:, None, :]) & (votes == top[:, None, :])
    return jnp.where((top > 0) & ~rival.any(1), winner, NO_ANSWER)


@functools.partial(jax.jit, static_argnames="topology")
def _teacher_kernel(labels: jax.Array, gt_ids: jax.Array | None, topology: str) -> jax.Array:
    if topology in ("pair", "ring"):
        return jnp.roll(labels, -1, axis=0)  # teacher of a = a + 1 (mod A); for A = 2 this is mutual
    if topology == "peer_majority":
        return _peer_majority(labels)
    if topology == "self":
        return labels
    return jnp.broadcast_to(gt_ids, labels.shape)


def teacher_labels(labels, topology: str, gt_ids=None) -> jax.Array:
    """The label each agent is rewarded against, int32 [A, P] (−1 = unlabeled), under a supervision topology.

    labels: int [A, P] from `vote`. gt_ids: int [P] (−1 = no gold answer), required by `ground_truth` only.
    """
    labels = jnp.asarray(labels, jnp.int32)
    if labels.ndim != 2:
        raise ValueError(f"labels must be [agents, prompts], got shape {list(labels.shape)}")
    n = labels.shape[0]
    if topology not in TOPOLOGIES:
        raise ValueError(f"unknown topology {topology!r}; use one of {TOPOLOGIES}")
    if topology == "pair" and n != 2:
        raise ValueError(f"'pair' is mutual supervision of exactly 2 agents, got {n}; use 'ring' for more")
    if topology in ("ring", "peer_majority") and n < 2:
        raise ValueError(f"{topology!r} needs at least 2 agents, got {n}; use 'self' for one agent")
    if topology == "ground_truth":
        if gt_ids is None:
            raise ValueError("topology 'ground_truth' needs gt_ids (the interned gold answers, one per prompt)")
        gt_ids = jnp.asarray(gt_ids, jnp.int32)
        if gt_ids.shape != labels.shape[1:]:
            raise ValueError(f"gt_ids must have shape [{labels.shape[1]}] (one per prompt), got {list(gt_ids.shape)}")
    else:
        gt_ids = None
    return _teacher_kernel(labels, gt_ids, topology)


# ----------------------------------------------------------------------------------------------------------------
# Stage 2: rewards, one grading per distinct (prediction, label) pair


def reward_pairs(pred_ids: np.ndarray, teacher_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct gradable (pred id, label id) pairs [K, 2], and per completion [A, P, G] its pair (−1: reward 0)."""
    pred_ids = np.asarray(pred_ids)
    pairs = np.stack(np.broadcast_arrays(pred_ids, np.asarray(teacher_ids)[..., None]), -1).reshape(-1, 2)
    gradable = (pairs >= 0).all(-1)
    distinct, inverse = np.unique(pairs[gradable], axis=0, return_inverse=True)
    index = np.full(len(pairs), -1, np.int64)
    index[gradable] = inverse.reshape(-1)
    return distinct, index.reshape(pred_ids.shape)


def gather_rewards(pair_rewards: np.ndarray, index: np.ndarray) -> np.ndarray:
    """rewards[a, p, g] = pair_rewards[index[a, p, g]], 0 where index is −1; float32."""
    padded = np.append(np.asarray(pair_rewards, np.float32), np.float32(0.0))
    return padded[index]  # index −1 reads the appended 0


class PairGrader:
    """`grade(pred, label) -> bool` with an LRU cache shared across steps (grading is the slow part of a step).

    grade_many: optional batch form of `grade` with the same results (`answers.math.grade_answers`), which
    `grade_all` uses for the pairs not in the cache (the math graders then run their sympy checks in parallel).
    """

    def __init__(self, grade: Callable[[str, str], bool], max_entries: int = 1 << 20,
                 grade_many: Callable[[list[tuple[str, str]]], list[bool]] | None = None):
        self.grade = grade
        self.grade_many = grade_many
        self.max_entries = max_entries
        self._cache: collections.OrderedDict[tuple[str, str], bool] = collections.OrderedDict()
        self.hits = 0
        self.misses = 0

    def __call__(self, pred: str, label: str) -> bool:
        return self.grade_all([(pred, label)])[0]

    def grade_all(self, pairs: Sequence[tuple[str, str]]) -> list[bool]:
        """The grade of each (pred, label) pair; those not cached are graded once each, together."""
        new = [key for key in dict.fromkeys(pairs) if key not in self._cache]
        self.misses += len(new)
        self.hits += len(pairs) - len(new)
        graded = self.grade_many(new) if self.grade_many is not None else [self.grade(*key) for key in new]
        for key, result in zip(new, graded):
            self._cache[key] = bool(result)
        results = []
        for key in pairs:
            self._cache.move_to_end(key)
            results.append(self._cache[key])
        while len(self._cache) > self.max_entries:
            self._cache.popitem(last=False)
        return results

    def clear(self) -> None:
        self._cache.clear()


# ----------------------------------------------------------------------------------------------------------------
# Metrics (§5.1 co_labeling/*, §5.2 self_labeling/*) and error overlap (§9)


def _rate(hits: np.ndarray, among: np.ndarray) -> float:
    """#(hits & among) / #among, 0 when `among` is empty (the reference's convention)."""
    n = int(among.sum())
    return float((hits & among).sum() / n) if n else 0.0


def co_labeling_metrics(labels: np.ndarray, teacher: np.ndarray, truth_ids: np.ndarray,
                        agent_names: Sequence[str]) -> dict[str, dict[str, float]]:
    """Per agent, the reference's `co_labeling/*` metrics from label ids.

    labels, teacher: [A, P] ids (−1 unlabeled); truth_ids: [P] ids of the normalized gold answers (−1 none), in the
    same id space as labels. Names follow the reference: N = 2 logs the legacy peer metrics, N ≥ 3 per-peer ones and
    the N-way ones (peer_tie_rate is always 0 under `ring`, informative under `peer_majority`).
    """
    labels, teacher, truth_ids = np.asarray(labels), np.asarray(teacher), np.asarray(truth_ids)
    n, n_prompts = labels.shape
    labeled = labels >= 0
    out = {}
    for a, name in enumerate(agent_names):
        me = labels[a]
        m = {"co_labeling/labeled_fraction_me": float(labeled[a].mean()),
             "co_labeling/oracle_accuracy_me": _rate(me == truth_ids, labeled[a])}
        peers = [(a + k) % n for k in range(1, n)]  # ring order, as the reference launchers' --peers
        if n == 2:
            b = peers[0]
            both = labeled[a] & labeled[b]
            m["co_labeling/peer_agreement"] = _rate(me == labels[b], both)
            m["co_labeling/labeled_fraction_peer"] = float(labeled[b].mean())
            m["co_labeling/both_labeled_fraction"] = float(both.mean())
        elif n >= 3:
            for b in peers:
                m[f"co_labeling/peer_agreement/{agent_names[b]}"] = _rate(me == labels[b], labeled[a] & labeled[b])
                m[f"co_labeling/labeled_fraction_peer/{agent_names[b]}"] = float(labeled[b].mean())
            supervised = teacher[a] >= 0
            all_peers = labeled[peers].all(0)
            m["co_labeling/supervision_fraction"] = float(supervised.mean())
            m["co_labeling/peer_tie_rate"] = _rate(~supervised, all_peers)
            m["co_labeling/unanimous_rate"] = _rate((labels[peers] == me).all(0), all_peers & labeled[a])
            m["co_labeling/supervision_contains_truth"] = _rate(teacher[a] == truth_ids, supervised & (truth_ids >= 0))
        out[name] = m
    return out


def self_labeling_metrics(answer_ids: np.ndarray, labels: np.ndarray, top_freq: np.ndarray,
                          label_matches_gt: np.ndarray, agent_names: Sequence[str]) -> dict[str, dict[str, float]]:
    """Per agent, TTRL's `self_labeling/*` metrics (§5.2).

    label_matches_gt: bool [A, P], grade(label, gold) — TTRL's oracle uses the grader, not string equality.
    """
    labeled = np.asarray(labels) >= 0
    return {name: {"self_labeling/fraction_labeled": float(labeled[a].mean()),
                   "self_labeling/top_frequency_mean": float(np.mean(top_freq[a])),
                   "self_labeling/parseable_fraction": float((np.asarray(answer_ids[a]) >= 0).mean()),
                   "self_labeling/pseudo_label_matches_gt": _rate(np.asarray(label_matches_gt[a]), labeled[a])}
            for a, name in enumerate(agent_names)}


def cohens_kappa(e_i, e_j) -> float:
    """Cohen's κ of two binary indicator vectors (e.g. per-prompt correctness of two agents); nan if p_e = 1."""
    e_i, e_j = np.asarray(e_i, bool), np.asarray(e_j, bool)
    if e_i.shape != e_j.shape or e_i.ndim != 1 or not len(e_i):
        raise ValueError(f"cohens_kappa needs two non-empty 1-D vectors of equal length, got {e_i.shape}, {e_j.shape}")
    p_o = float((e_i == e_j).mean())
    p_i, p_j = float(e_i.mean()), float(e_j.mean())
    p_e = p_i * p_j + (1 - p_i) * (1 - p_j)
    return (p_o - p_e) / (1 - p_e) if p_e < 1 else math.nan


def error_overlap(labels_i: Sequence[str | None], labels_j: Sequence[str | None],
                  truths: Sequence[str | None]) -> dict[str, float]:
    """Error overlap of two agents over the prompts with a known truth (§9).

    labels_*: each agent's label per prompt (None = unlabeled, counted as wrong); truths: normalized gold answers
    (prompts with None are skipped). Returns κ of the correctness indicators, P(both wrong) and P(both wrong with
    the same label).
    """
    if not len(labels_i) == len(labels_j) == len(truths):
        raise ValueError(f"error_overlap needs equal lengths, got {len(labels_i)}, {len(labels_j)}, {len(truths)}")
    rows = [(x, y, t) for x, y, t in zip(labels_i, labels_j, truths) if t is not None]
    if not rows:
        raise ValueError("error_overlap needs at least one prompt with a known truth")
    right_i = np.array([x == t for x, _, t in rows])
    right_j = np.array([y == t for _, y, t in rows])
    same_wrong = np.array([x is not None and x == y != t for x, y, t in rows])
    return {"kappa": cohens_kappa(right_i, right_j),
            "p_both_wrong": float((~right_i & ~right_j).mean()),
            "p_both_wrong_same": float(same_wrong.mean())}


# ----------------------------------------------------------------------------------------------------------------
# One step, host side


@dataclasses.dataclass
class StepResult:
    """Everything a step produces: rewards for GRPO, labels for logging, metrics, per-prompt records (JSONL)."""

    rewards: np.ndarray  # float32 [A, P, G]
    labels: list[list[str | None]]  # [A][P] each agent's own vote (None = unlabeled)
    teacher_labels: list[list[str | None]]  # [A][P] the label each agent was rewarded against
    top_freq: np.ndarray  # float32 [A, P]
    metrics: dict[str, dict[str, float]]  # agent name -> {metric name: value}
    records: list[dict]
    timings: dict[str, float]  # seconds: "time/answers" (extract, normalize, grade), "time/vote" (intern, kernels)


def score_step(texts_by_agent: Sequence[Sequence[str]], gt: Sequence[str | None], *, topology: str,
               threshold: float, grader: PairGrader, extract: Callable[[str], str],
               normalize: Callable[[str], str | None], step: int, prompt_ids: Sequence,
               agent_names: Sequence[str] | None = None) -> StepResult:
    """Scores one step of A agents × P prompts × G completions (G rollouts of a prompt contiguous, prompts in the
    same order for every agent, as §1.1).

    Per completion: pred = extract(text) (the raw answer the reward grades, "" if none) and vote key =
    normalize(pred), None when empty. The teacher's label is a vote key, or the raw gold string under
    `ground_truth` (§4.1); a completion's reward is grader(pred, label), 0 when unlabeled.
    """
    n_agents, n_prompts = len(texts_by_agent), len(gt)
    agent_names = list(agent_names) if agent_names is not None else [chr(ord("A") + a) for a in range(n_agents)]
    if len(agent_names) != n_agents:
        raise ValueError(f"{len(agent_names)} agent names for {n_agents} agents")
    if len(prompt_ids) != n_prompts or n_prompts == 0:
        raise ValueError(f"need one gold answer (None allowed) and one prompt id per prompt, got {n_prompts} and "
                         f"{len(prompt_ids)}")
    n_texts = sorted({len(t) for t in texts_by_agent})
    if len(n_texts) != 1 or n_texts[0] == 0 or n_texts[0] % n_prompts:
        raise ValueError(f"every agent needs the same number of completions, G per prompt for the {n_prompts} "
                         f"prompts (a prompt's G contiguous); got {n_texts} per agent")
    shape = (n_agents, n_prompts, n_texts[0] // n_prompts)

    t0 = time.perf_counter()
    preds = [extract(text) for texts in texts_by_agent for text in texts]
    keys = [normalize(p) or None for p in preds]
    label_table, pred_table = Interner(), Interner()
    answer_ids = label_table.intern_all(keys).reshape(shape)
    pred_ids = pred_table.intern_all(preds).reshape(shape)
    truth_keys = [None if g is None else normalize(g) for g in gt]  # oracle keys (§5.1: string equality)
    truth_ids = label_table.intern_all(truth_keys)
    gt_ids = label_table.intern_all(gt) if topology == "ground_truth" else None

    t1 = time.perf_counter()
    label_ids, top_freq = vote(answer_ids, threshold)
    teacher = np.asarray(teacher_labels(label_ids, topology, gt_ids))
    label_ids, top_freq = np.asarray(label_ids), np.asarray(top_freq)

    pairs, index = reward_pairs(pred_ids, teacher)
    t2 = time.perf_counter()
    graded = grader.grade_all([(pred_table.strings[p], label_table.strings[t]) for p, t in pairs.tolist()])
    rewards = gather_rewards(np.array(graded, np.float32), index)

    t3 = time.perf_counter()
    timings = {"time/answers": (t1 - t0) + (t3 - t2), "time/vote": t2 - t1}
    labels = [[label_table.lookup(i) for i in row] for row in label_ids.tolist()]
    teachers = [[label_table.lookup(i) for i in row] for row in teacher.tolist()]
    metrics = co_labeling_metrics(label_ids, teacher, truth_ids, agent_names)
    if topology == "self":
        matches = np.array([[lab is not None and g is not None and grader(lab, g) for lab, g in zip(row, gt)]
                            for row in labels])
        for name, m in self_labeling_metrics(answer_ids, label_ids, top_freq, matches, agent_names).items():
            metrics[name].update(m)
    records = [{"step": step, "prompt_id": prompt_ids[p], "agent": agent_names[a], "label": labels[a][p],
                "teacher_label": teachers[a][p], "gt": gt[p], "gt_key": truth_keys[p],
                "rewards": rewards[a, p].tolist(), "top_freq": float(top_freq[a, p])}
               for a in range(n_agents) for p in range(n_prompts)]
    return StepResult(rewards, labels, teachers, top_freq, metrics, records, timings)
