"""`Problem` and `DataError`: what every data source yields, in a leaf module so that a source (the synthetic
world of corl_jax.demo, the file and hub readers of corl_jax.data) can make problems without importing a reader."""

from __future__ import annotations

import dataclasses


class DataError(ValueError):
    """A data source that cannot be read as problems; the message names the source, the row and the fix."""


@dataclasses.dataclass(frozen=True)
class Problem:
    """One problem. `id` is its row index in its source, stable across runs and agents."""

    id: int
    text: str
    answer: str | None
    source: str
    rephrased: str | None = None  # the same problem in other words (same answer)
    solution: str | None = None   # a worked solution ending in \\boxed{answer} (labeled SFT data only)
    entry_point: str | None = None         # code problems, HumanEval style: the function `check(candidate)` tests
    canonical_solution: str | None = None  # code problems: complete reference code (oracle diagnostics only)
