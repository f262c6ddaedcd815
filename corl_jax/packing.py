"""Sequence packing for the GRPO update (`grpo.packing`): the step's rows, each its real prompt tokens followed by
its completion up to the last attended token, laid end to end in lines of at most the batch's full width.

A micro-batch is `lines_per_micro` lines (the unpacked micro-batch's row count, so no micro-batch holds more tokens
than an unpacked one), trimmed to its fullest line rounded up to `bucket` tokens. Each row is one attention segment
(causal within itself only) whose RoPE positions restart at 0, so every real token sees exactly what it sees in the
row's own left-padded sequence. Only the positions that predict a completion token go through the unembedding
(`head_index`: the micro-batch's such positions, in row order, as [K, H]); `row_index` maps them back to the step's
[N, Tc] row layout, where the loss (`grpo.grpo_loss` with the step's reference row weights) runs as in the unpacked
update.

Rows go to lines longest first, each onto the least-loaded line (balanced lines waste the least width); the number
of micro-batches is the fewest whose lines hold every row within the full width.
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np


@dataclasses.dataclass(frozen=True)
class PackPlan:
    """Where each of the step's N rows sits: `line` [N] (micro-batch m holds lines [m K, (m + 1) K)), `offset` [N]
    (its first column), and per micro-batch its line width `widths` [M] and scored positions per line `heads` [M]."""

    line: np.ndarray
    offset: np.ndarray
    lines_per_micro: int
    widths: np.ndarray
    heads: np.ndarray

    @property
    def num_micro(self) -> int:
        return len(self.widths)

    def rows_of(self, micro: int) -> np.ndarray:
        return np.flatnonzero(self.line // self.lines_per_micro == micro)


# A micro-batch's scored positions per line are rounded up to a multiple of its line width / HEAD_STEPS: at most
# HEAD_STEPS head sizes per width, so a run whose lengths change every step compiles few update programs
# (experiments/bench/compile_churn.py: 3.5x fewer than rounding to half the bucket, for ~1 point more padded FLOPs).
HEAD_STEPS = 8


def _round_up(x: np.ndarray | int, bucket: int, cap: int) -> np.ndarray:
    return np.minimum(np.maximum(-(-np.asarray(x) // bucket) * bucket, bucket), cap)


def _balanced_lines(lengths: np.ndarray, num_lines: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Longest row first onto the least-loaded line: line [N], offset [N] and the lines' loads [num_lines]."""
    line, offset = np.zeros(len(lengths), np.int64), np.zeros(len(lengths), np.int64)
    heap = [(0, i) for i in range(num_lines)]
    for row in np.argsort(-lengths, kind="stable"):
        load, index = heapq.heappop(heap)
        line[row], offset[row] = index, load
        heapq.heappush(heap, (load + int(lengths[row]), index))
    loads = np.zeros(num_lines, np.int64)
    np.add.at(loads, line, lengths)
    return line, offset, loads


def pack_plan(prompt_tokens: np.ndarray, widths: np.ndarray, lines_per_micro: int, line_len: int,
              bucket: int) -> PackPlan:
    """Rows of `prompt_tokens` real prompt tokens and `widths` completion columns (`cohort.completion_widths`)
    packed into micro-batches of `lines_per_micro` lines of at most `line_len` tokens, widths rounded up to
    `bucket` (at most `line_len`), scored positions per line up to a multiple of the width / `HEAD_STEPS`."""
    if np.any(prompt_tokens < 1):
        raise ValueError("every row needs at least one prompt token (its first completion token is scored there)")
    lengths = np.asarray(prompt_tokens, np.int64) + np.asarray(widths, np.int64)
    if lengths.max() > line_len:
        raise ValueError(f"a row of {lengths.max()} tokens does not fit a line of {line_len}")
    num_micro = max(1, -(-int(lengths.sum()) // (lines_per_micro * line_len)))
    while True:
        line, offset, loads = _balanced_lines(lengths, num_micro * lines_per_micro)
        if loads.max() <= line_len:
            break
        num_micro += 1
    # heavier lines first: micro-batches of similar loads, the lightest last
    order = np.argsort(-loads, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    line, loads = rank[line], loads[order].reshape(num_micro, lines_per_micro)
    scored = np.zeros(num_micro, np.int64)
    np.add.at(scored, line // lines_per_micro, widths)
    line_widths = _round_up(loads.max(axis=1), bucket, line_len)
    per_line, head_step = -(-scored // lines_per_micro), np.maximum(line_widths // HEAD_STEPS, 1)
    heads = np.minimum(-(-per_line // head_step) * head_step, line_widths)
    return PackPlan(line=line, offset=offset, lines_per_micro=lines_per_micro, widths=line_widths, heads=heads)


def packed_flops_fraction(model_config, prompt_tokens: np.ndarray, widths: np.ndarray, plan: PackPlan) -> float:
    """Share of the update's FLOPs (`ModelConfig.train_flops`: attention over each line's full square) spent on
    padding, 1 - real / executed, the real FLOPs being each row's own sequence."""
    executed = sum(plan.lines_per_micro * model_config.train_flops(int(w), int(h))
                   for w, h in zip(plan.widths, plan.heads))
    real = sum(model_config.train_flops(int(p + w), int(w)) for p, w in zip(prompt_tokens, widths))
    return 1.0 - real / executed


def packed_micro(tokens: np.ndarray, attention: np.ndarray, prompt_len: int, prompt_tokens: np.ndarray,
                 widths: np.ndarray, plan: PackPlan, micro: int) -> dict[str, np.ndarray]:
    """Host arrays of micro-batch `micro` from the step's left-padded rows `tokens`, `attention` [N, Tp + Tc]:
    `tokens`, `positions`, `segments` [K, W] (segment 0: padding), `head_index`, `targets` [K, H] (flat [K W]
    positions predicting completion tokens, and those tokens), `row_index` [N, Tc] (row column -> flat [K H] head
    slot; 0 where unused) and `scored` [N, Tc] bool (the columns of this micro-batch's rows up to their widths)."""
    K, W, H = plan.lines_per_micro, int(plan.widths[micro]), int(plan.heads[micro])
    completion_len = tokens.shape[1] - prompt_len
    out = dict(tokens=np.zeros((K, W), np.int32), positions=np.zeros((K, W), np.int32),
               segments=np.zeros((K, W), np.int32), head_index=np.zeros((K, H), np.int32),
               targets=np.zeros((K, H), np.int32), row_index=np.zeros((len(tokens), completion_len), np.int32),
               scored=np.zeros((len(tokens), completion_len), bool))
    head_index, targets = out["head_index"].reshape(-1), out["targets"].reshape(-1)  # views
    used = 0  # head slots filled
    for segment, row in enumerate(plan.rows_of(micro), start=1):
        k, start = int(plan.line[row]) - micro * K, int(plan.offset[row])
        p, w = int(prompt_tokens[row]), int(widths[row])
        columns = slice(prompt_len - p, prompt_len + w)
        span = slice(start, start + p + w)
        out["tokens"][k, span] = tokens[row, columns]
        live = attention[row, columns].astype(bool)
        out["segments"][k, span] = np.where(live, segment, 0)
        out["positions"][k, span] = np.maximum(np.cumsum(live) - 1, 0)
        head_index[used:used + w] = k * W + start + p - 1 + np.arange(w)
        targets[used:used + w] = tokens[row, prompt_len:prompt_len + w]
        out["row_index"][row, :w] = used + np.arange(w)
        out["scored"][row, :w] = True
        used += w
    return out
