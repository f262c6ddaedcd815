"""Data sources, field mapping, the reference holdout, the shared prompt stream and the arithmetic world."""

import ast
import json
import operator
import re
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from corl_jax.data import (
    MATH500_PATH,
    DataError,
    Problem,
    PromptStream,
    arithmetic_source,
    holdout_split,
    load_problems,
    load_train_and_eval,
)
from corl_jax.demo import arithmetic

ROWS = [{"prompt": "What is 1 + 1?", "answer": "2"}, {"prompt": "Solve x + 3 = 5.", "answer": 2},
        {"prompt": "Name a prime.", "answer": "7", "rephrased": "Give one prime number."}]
MATH500 = Path(__file__).resolve().parents[2] / "shared" / "data" / "math500_test.json"


def write(path: Path, rows) -> str:
    if path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".jsonl":
        path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq
        columns = dict.fromkeys(key for row in rows for key in row)
        pq.write_table(pa.Table.from_pydict({key: [row.get(key) for row in rows] for key in columns}), path)
    return str(path)


def problems_of(n: int, rephrased: bool = False) -> list[Problem]:
    return [Problem(id=i, text=f"problem {i}", answer=str(i), source="mem",
                    rephrased=f"problem number {i}" if rephrased else None) for i in range(n)]


# ------------------------------------------------------------------------------------------------------- loaders


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".parquet"])
def test_file_formats_give_the_same_problems(tmp_path, suffix):
    rows = [dict(r, answer=str(r["answer"])) for r in ROWS] if suffix == ".parquet" else ROWS
    path = write(tmp_path / f"rows{suffix}", rows)
    problems = load_problems(path)
    assert [(p.id, p.text, p.answer, p.rephrased) for p in problems] == [
        (0, "What is 1 + 1?", "2", None), (1, "Solve x + 3 = 5.", "2", None),
        (2, "Name a prime.", "7", "Give one prime number.")]
    assert all(p.source == path for p in problems)


@pytest.mark.parametrize("row, text, answer", [
    ({"prompt": "P", "answer": "A"}, "P", "A"),                        # MATH-Level345 / MATH-500
    ({"problem": "P", "Answer": "A"}, "P", "A"),                       # Openthoughts_math_30k_opsd
    ({"prompt": "P", "solution": "A"}, "P", "A"),                      # DAPO-Math-17k-Processed
    ({"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "P"},
                 {"role": "user", "content": "later"}],
      "reward_model": {"ground_truth": 12, "style": "rule"}}, "P", "12"),  # verl
])
def test_reference_field_layouts_are_detected(tmp_path, row, text, answer):
    [problem] = load_problems(write(tmp_path / "rows.jsonl", [row]))
    assert (problem.text, problem.answer) == (text, answer)


def test_explicit_fields_with_dotted_paths(tmp_path):
    path = write(tmp_path / "rows.json", [{"q": "P", "meta": {"gold": "A"}, "prompt": "ignored"}])
    [problem] = load_problems(path, question_field="q", answer_field="meta.gold")
    assert (problem.text, problem.answer) == ("P", "A")


def test_math500_ships_with_the_package():
    """`math500` reads the bundled copy, byte-identical to the reference's file where shared/ is laid out."""
    if MATH500.exists():
        assert open(MATH500_PATH, "rb").read() == MATH500.read_bytes()
    problems = load_problems("math500")
    assert len(problems) == 500
    assert problems[0].answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert problems[0].text.startswith("Convert the point $(0,3)$")


@pytest.mark.parametrize("bad_row, message", [
    ({"answer": "1"}, "row 1: field 'prompt' is missing"),
    ({"prompt": "   ", "answer": "1"}, "row 1: field 'prompt' is empty"),
    ({"prompt": "P", "answer": ""}, "row 1: field 'answer' is empty"),
    ({"prompt": [{"role": "system", "content": "S"}], "answer": "1"}, "without a role=='user' message"),
    ({"prompt": {"x": 1}, "answer": "1"}, "holds a dict, not text"),
    ("{not json", "row 1: line 2 is not valid JSON"),
])
def test_malformed_rows_name_file_row_and_field(tmp_path, bad_row, message):
    path = write(tmp_path / "rows.jsonl", [ROWS[0], bad_row, ROWS[2]])
    with pytest.raises(DataError) as error:
        load_problems(path)
    assert message in str(error.value) and path in str(error.value) and "skip_bad_rows" in str(error.value)
    assert [p.id for p in load_problems(path, skip_bad_rows=True)] == [0, 2]  # ids stay row indices


def test_unreadable_sources_say_what_to_do(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_problems(str(tmp_path / "missing.jsonl"))
    with pytest.raises(DataError, match="not an array"):
        load_problems(write(tmp_path / "object.json", {"prompt": "P"}))
    with pytest.raises(DataError, match="question_field"):
        load_problems(write(tmp_path / "odd.json", [{"x": "P", "answer": "A"}]))
    with pytest.raises(DataError, match="answer_field"):
        load_problems(write(tmp_path / "unlabeled.json", [{"prompt": "P"}]))
    [unlabeled] = load_problems(str(tmp_path / "unlabeled.json"), require_answer=False)
    assert unlabeled.answer is None


def test_hf_datasets_source_reads_a_local_dataset_directory(tmp_path):
    pytest.importorskip("datasets")
    directory = tmp_path / "hf_rows"
    directory.mkdir()
    write(directory / "train.jsonl", [dict(r, answer=str(r["answer"])) for r in ROWS])
    problems = load_problems(f"hf:{directory}:train")
    assert [p.text for p in problems] == [r["prompt"] for r in ROWS]


def test_tfds_array_record_builder(tmp_path):
    tfds = pytest.importorskip("tensorflow_datasets")

    class CorlTestProblems(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
                {"problem": tfds.features.Text(), "answer": tfds.features.Text()}))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples()}

        def _generate_examples(self):
            for i in range(4):
                yield i, {"problem": f"What is {i} + 1?", "answer": str(i + 1)}

    CorlTestProblems(data_dir=str(tmp_path), file_format="array_record").download_and_prepare()
    tfds.core.add_data_dir(str(tmp_path))
    problems = load_problems("tfds:corl_test_problems:train")
    assert sorted((p.text, p.answer) for p in problems) == [(f"What is {i} + 1?", str(i + 1)) for i in range(4)]


# -------------------------------------------------------------------------------------------------------- holdout


def test_holdout_matches_hf_train_test_split():
    problems = problems_of(400)
    train, test = holdout_split(problems, 150)
    permutation = np.random.default_rng(42).permutation(400)  # HF: generator.permutation(len(self))
    assert [p.id for p in test] == permutation[:150].tolist()
    assert [p.id for p in train] == permutation[150:].tolist()
    datasets = pytest.importorskip("datasets")
    split = datasets.Dataset.from_dict({"id": list(range(400))}).train_test_split(test_size=150, seed=42)
    assert [p.id for p in test] == split["test"]["id"] and [p.id for p in train] == split["train"]["id"]


def test_train_and_eval_selection(tmp_path):
    rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(20)]
    data = dict(train_path=write(tmp_path / "train.jsonl", rows), eval_path="", holdout_size=5,
                question_field="", answer_field="", skip_bad_rows=False, max_train_samples=0, max_eval_samples=0)
    train, evaluation = load_train_and_eval(data)
    assert len(train) == 15 and {p.id for p in evaluation} == set(np.random.default_rng(42).permutation(20)[:5])
    data.update(eval_path=write(tmp_path / "eval.json", rows[:3]), max_train_samples=4, max_eval_samples=2)
    train, evaluation = load_train_and_eval(data)
    assert len(train) == 4 and [p.text for p in evaluation] == ["p0", "p1"]
    data.update(eval_path="", holdout_size=0)
    with pytest.raises(DataError, match="no evaluation problems"):
        load_train_and_eval(data)


# --------------------------------------------------------------------------------------------------------- stream


def take(stream, n):
    return [next(stream).ids for _ in range(n)]


def take_blocks(stream, n):
    return [next(stream) for _ in range(n)]


def test_stream_is_deterministic_and_epochs_are_fresh_permutations():
    problems = problems_of(10)
    blocks = take(PromptStream(problems, 3, seed=7), 9)  # 3 blocks per epoch, the 10th problem dropped each epoch
    assert blocks == take(PromptStream(problems, 3, seed=7), 9)
    assert blocks != take(PromptStream(problems, 3, seed=8), 9)
    epochs = [sum(blocks[e * 3:(e + 1) * 3], ()) for e in range(3)]
    for epoch in epochs:
        assert len(set(epoch)) == 9 and set(epoch) <= set(range(10))
    assert len({epoch for epoch in epochs}) == 3


def test_stream_state_resumes_the_exact_sequence():
    problems = problems_of(11)
    stream = PromptStream(problems, 4, seed=3)
    take(stream, 5)
    state = json.loads(json.dumps(stream.get_state()))
    expected = take(stream, 7)
    resumed = PromptStream(problems, 4, seed=3)
    resumed.set_state(state)
    assert take(resumed, 7) == expected
    for other in (PromptStream(problems, 4, seed=4), PromptStream(problems, 3, seed=3),
                  PromptStream(problems_of(12), 4, seed=3)):
        with pytest.raises(DataError, match="does not match"):
            other.set_state(state)


def test_agents_read_aligned_surface_texts():
    problems = problems_of(8, rephrased=True)
    by_id = {p.id: p for p in problems}
    for block in take_blocks(PromptStream(problems, 3, seed=0), 4):
        original, rephrased = block.texts("text"), block.texts("rephrased")
        assert original == [by_id[i].text for i in block.ids]
        assert rephrased == [by_id[i].rephrased for i in block.ids]
    with pytest.raises(DataError, match="no rephrased text"):
        next(PromptStream(problems_of(4), 2, seed=0)).texts("rephrased")


def test_stream_rejects_impossible_configurations():
    with pytest.raises(DataError, match="prompts per step"):
        PromptStream(problems_of(3), 4, seed=0)
    with pytest.raises(DataError, match="not unique"):
        PromptStream(problems_of(3) + problems_of(1), 2, seed=0)


# --------------------------------------------------------------------------------------------- arithmetic world

BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
SPOKEN = [("divided by", "/"), ("plus", "+"), ("minus", "-"), ("times", "*")]
WORD_ANSWERS = {  # each template's answer, written from its meaning, independently of the generator's steps
    "shopping": lambda p: p["paid"] - (p["count1"] * p["price1"] + p["count2"] * p["price2"]),
    "sharing": lambda p: Fraction(p["morning"] + p["afternoon"], p["friends"]),
    "ages": lambda p: p["age"] + p["gap"] + p["years"],
    "production": lambda p: p["rate"] * p["hours"] * p["days"],
    "boxes": lambda p: p["boxes"] * p["per_box"] - p["broken"],
    "savings": lambda p: p["weekly"] * p["weeks"] + p["gift"] - p["spent"],
    "travel": lambda p: p["speed1"] * p["hours1"] + p["speed2"] * p["hours2"],
}


def evaluate(expression: str) -> Fraction:
    """Exact value of an arithmetic expression of whole numbers (parsed, never eval'd)."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
            return BINARY[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"unexpected syntax in {expression!r}")
    return value(ast.parse(expression, mode="eval").body)


def spoken_expression(rephrased: str) -> str:
    expression = re.sub(r"^(What is|Find the value of|Work out) ", "", rephrased).rstrip("?.")
    for words, symbol in SPOKEN:
        expression = expression.replace(words, symbol)
    return expression


@pytest.fixture(scope="module")
def world():
    return {split: arithmetic.generate_items(split, 300, seed=1) for split in arithmetic.SPLITS}


def test_arithmetic_answers_are_correct(world):
    kinds = set()
    for item in (item for items in world.values() for item in items):
        kinds.add(item.kind)
        if item.kind == "expression":
            assert item.expression in item.text
            assert evaluate(item.expression) == item.answer
            assert evaluate(spoken_expression(item.rephrased)) == item.answer
            assert sum(item.expression.count(op) for op in "+-*/") == item.level
        else:
            assert WORD_ANSWERS[item.kind](item.params) == item.answer
            for number in item.params.values():  # both surfaces state every number of the problem
                assert re.search(rf"\b{number}\b", item.text) and re.search(rf"\b{number}\b", item.rephrased)
        assert item.rephrased != item.text and item.answer >= 0
    assert kinds == {"expression", *WORD_ANSWERS}
    assert {item.level for item in world["rl"]} == set(arithmetic.LEVELS)


def test_symbolic_rephrasing_commutes_the_same_problems_under_another_verb():
    """rephrasing="symbols" (Different family+ on bases that never saw words) leaves the problems and their text
    unchanged and restates each expression with + and * operands swapped: the same value, only symbols."""
    words = arithmetic.generate_items("rl", 200, seed=2, levels=(2, 3), word_fraction=0, max_value=60)
    symbols = arithmetic.generate_items("rl", 200, seed=2, levels=(2, 3), word_fraction=0, max_value=60,
                                        rephrasing="symbols")
    assert [(i.text, i.answer, i.canonical) for i in words] == [(i.text, i.answer, i.canonical) for i in symbols]
    for item in symbols:
        verb, _, expression = item.rephrased.rstrip(".").partition(" ")
        assert verb in arithmetic.VERBS and not item.text.startswith(verb)
        assert evaluate(expression) == item.answer
        assert sorted(re.findall(r"\d+", expression)) == sorted(re.findall(r"\d+", item.expression))
    assert sum(i.rephrased.partition(" ")[2] != i.text.partition(" ")[2] for i in symbols) > 150  # mostly reordered
    with pytest.raises(ValueError, match="unknown rephrasing 'spoken'"):
        arithmetic.generate_items("rl", 2, rephrasing="spoken")


def test_arithmetic_solutions_check_out(world):
    for item in world["sft"][:100]:
        *lines, last = item.solution.split("\n")
        assert last == f"The answer is \\boxed{{{item.answer}}}."
        for line in lines:
            left, right = line.rstrip(".").split(": ")[-1].split(" = ")
            assert evaluate(left) == int(right)


def test_arithmetic_splits_are_disjoint_and_deterministic(world):
    canonical = {split: [item.canonical for item in items] for split, items in world.items()}
    for split, keys in canonical.items():
        assert len(set(keys)) == len(keys)
        assert all(arithmetic.split_of(key) == split for key in keys)
    sft, rl, test = (set(canonical[s]) for s in arithmetic.SPLITS)
    assert not (sft & rl or sft & test or rl & test)
    texts = {split: {t for item in items for t in (item.text, item.rephrased)} for split, items in world.items()}
    assert not (texts["sft"] & texts["rl"] or texts["sft"] & texts["test"] or texts["rl"] & texts["test"])
    assert arithmetic.generate_items("rl", 300, seed=1) == world["rl"]
    assert arithmetic.generate_items("rl", 300, seed=2) != world["rl"]


def test_arithmetic_rows_through_the_file_loader(tmp_path):
    paths = arithmetic.write_splits(str(tmp_path), sizes={"sft": 20, "test": 10}, seed=3)
    sft, test = load_problems(paths["sft"]), load_problems(paths["test"])
    items = arithmetic.generate_items("sft", 20, seed=3)
    assert [(p.text, p.answer, p.rephrased, p.solution) for p in sft] == [
        (i.text, str(i.answer), i.rephrased, i.solution) for i in items]
    assert all(p.solution is None for p in test)
    direct = load_problems("arithmetic:test")
    assert len(direct) == arithmetic.DEFAULT_SIZES["test"] and direct[0].source == "arithmetic:test"
    spec = arithmetic_source("test", dict(levels=(2, 3), word_fraction=0, max_value=30))
    assert spec == "arithmetic:test?levels=2,3&word_fraction=0&max_value=30"
    assert arithmetic_source("rl") == "arithmetic:rl"
    easy = load_problems(spec)
    items = arithmetic.generate_items("test", len(easy), levels=(2, 3), word_fraction=0, max_value=30)
    assert [p.text for p in easy] == [i.text for i in items]
    assert {i.level for i in items} == {2, 3} and {i.kind for i in items} == {"expression"}
    assert max(max(s.left, s.right, s.value) for i in items for s in i.steps) <= 30
    restated = load_problems(arithmetic_source("test", dict(levels=(2, 3), word_fraction=0, max_value=30,
                                                            rephrasing="symbols")))
    assert [p.text for p in restated] == [p.text for p in easy]
    assert "minus" not in " ".join(p.rephrased for p in restated)
    for bad, problem in [("arithmetic:tset", "unknown arithmetic split"), ("arithmetic:rl?levels=0,2", "subset of"),
                         ("arithmetic:rl?levels=two", "invalid literal"), ("arithmetic?level=2", "unknown setting"),
                         ("arithmetic?max_value=5", r"max_value=5 must lie"), ("arithmetic?levels", "bad query"),
                         ("arithmetic?rephrasing=spoken", "unknown rephrasing")]:
        with pytest.raises(DataError, match=f"{problem}.*Fix: use 'arithmetic"):
            load_problems(bad)


def test_single_operation_world_and_split_size_from_the_source_string():
    """levels=1 (one operation per problem: the easiest world, for SmolLM2) and n (the split's size: the world holds
    only ~630 rl and ~415 test problems at max_value 60, fewer than the default 2,000 / 500)."""
    problems = load_problems("arithmetic:test?levels=1&word_fraction=0&max_value=60&n=150")
    items = arithmetic.generate_items("test", 150, levels=(1,), word_fraction=0, max_value=60)
    assert [p.text for p in problems] == [i.text for i in items] and len(problems) == 150
    for item in items:
        assert item.level == 1 and sum(item.expression.count(op) for op in "+-*/") == 1
        assert evaluate(item.expression) == item.answer
    assert {i.expression[i.expression.index(" ") + 1] for i in items} == set("+-*/")
    with pytest.raises(DataError, match="found only .* distinct 'test' problems.*Fix: use 'arithmetic"):
        load_problems("arithmetic:test?levels=1&word_fraction=0&max_value=10&n=500")


def test_benchmarks_name_the_demo_worlds_test_split():
    from corl_jax.benchmarks import ARITHMETIC_TEST

    assert ARITHMETIC_TEST == arithmetic_source("test", arithmetic.DEMO_WORLD)
