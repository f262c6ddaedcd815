"""The controlled diversity test's pieces (docs/diversity.md): the arithmetic slips against naive oracles, the
slipped SFT data, the `SLIP_BASES` recipes, and that the default world and recipes are unchanged."""

import ast
import dataclasses
import hashlib
import json
import re
import sys
from pathlib import Path

import pytest

from corl_jax.demo import arithmetic, checkpoints
from corl_jax.demo import bases as demo_bases

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments" / "evidence"))
import diversity_sweep  # noqa: E402

ITEMS = arithmetic.generate_items("test", 500, **arithmetic.DEMO_WORLD)


def _whole_division(a: int, b: int) -> int:
    if b == 0 or a % b:
        raise ArithmeticError(f"{a} / {b}")
    return a // b


def _left_to_right(text: str) -> int:
    """A naive evaluator: every operator applied as soon as its right operand is known, parentheses kept."""
    apply = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__, "/": _whole_division}
    stack = [[None, None]]  # per open parenthesis: [value so far, pending operator]
    for token in re.findall(r"\d+|[-+*/()]", text):
        if token == "(":
            stack.append([None, None])
            continue
        if token in apply:
            stack[-1][1] = token
            continue
        value = int(token) if token != ")" else stack.pop()[0]
        frame = stack[-1]
        frame[0] = value if frame[0] is None else apply[frame[1]](frame[0], value)
    return stack[0][0]


def _evaluate(text: str, add=int.__add__) -> int:
    """`text` evaluated with Python's own precedence, `add` for +, whole divisions only."""
    ops = {ast.Add: add, ast.Sub: int.__sub__, ast.Mult: int.__mul__, ast.Div: _whole_division}

    def walk(node):
        if isinstance(node, ast.Constant):
            return node.value
        return ops[type(node.op)](walk(node.left), walk(node.right))

    return walk(ast.parse(text, mode="eval").body)


def _add_digits_without_carry(a: int, b: int) -> int:
    if a < 0 or b < 0:
        raise ArithmeticError("negative")
    width = max(len(str(a)), len(str(b)))
    return int("".join(str((int(x) + int(y)) % 10) for x, y in zip(str(a).zfill(width), str(b).zfill(width))))


def _fully_parenthesised(tree) -> str:
    if isinstance(tree, int):
        return str(tree)
    op, left, right = tree
    return f"({_fully_parenthesised(left)} {op} {_fully_parenthesised(right)})"


def _drop_parentheses_after_minus(text: str) -> str:
    """Remove the outermost parentheses that open right after '- ' and are not a factor of * or /, until none."""
    while True:
        for start in (m.end() - 1 for m in re.finditer(r"- \(", text)):
            depth, end = 0, start
            for end in range(start, len(text)):
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                if depth == 0:
                    break
            if not re.match(r"\s*[*/]", text[end + 1:]):
                text = text[:start] + text[start + 1:end] + text[end + 1:]
                break
        else:
            return text


def _expected(item, value_of) -> int | None:
    try:
        value = value_of(item)
    except ArithmeticError:
        return None
    return None if value == item.answer else value


ORACLES = {
    "precedence": lambda item: _left_to_right(item.expression),
    "carry": lambda item: _evaluate(_fully_parenthesised(item.tree), _add_digits_without_carry),
    "sign": lambda item: _evaluate(_drop_parentheses_after_minus(item.expression)),
}


@pytest.mark.parametrize("slip", arithmetic.SLIPS)
def test_slips_match_naive_oracles(slip):
    got = [diversity_sweep.slipped_answer(item, slip) for item in ITEMS]
    assert got == [_expected(item, ORACLES[slip]) for item in ITEMS]
    assert 0.05 < sum(g is not None for g in got) / len(got) < 0.4  # the slip applies to a minority


def test_slip_examples_and_solution_format():
    item = arithmetic.Item(kind="expression", text="Compute 5 + 3 * 2.", rephrased="", canonical="",
                           steps=(arithmetic.Step(3, "*", 2), arithmetic.Step(5, "+", 6)), expression="5 + 3 * 2",
                           tree=("+", 5, ("*", 3, 2)))
    assert arithmetic.slipped_solution(item, "precedence") == "5 + 3 = 8.\n8 * 2 = 16.\nThe answer is \\boxed{16}."
    assert arithmetic.slipped_solution(item, "carry") == "3 * 2 = 6.\n5 + 6 = 1.\nThe answer is \\boxed{1}."
    assert arithmetic.slipped_solution(item, "sign") is None  # no minus
    assert arithmetic._add_without_carry(57, 48) == 95
    carry = next(i for i in ITEMS if arithmetic.slipped_solution(i, "carry"))
    lines = arithmetic.slipped_solution(carry, "carry").splitlines()
    assert len(lines) == len(carry.solution.splitlines())  # the same steps, other values
    assert arithmetic.slipped_solution(carry, "carry") != carry.solution
    words = arithmetic.generate_items("test", 50, levels=(2, 3, 4), word_fraction=1.0)
    assert all(arithmetic.slipped_solution(i, s) is None for i in words for s in arithmetic.SLIPS)
    with pytest.raises(ValueError, match="unknown slip 'carries'; use one of"):
        arithmetic.slipped_solution(carry, "carries")


def test_slips_barely_overlap():
    applies = {s: {i for i, item in enumerate(ITEMS) if arithmetic.slipped_solution(item, s)} for s in arithmetic.SLIPS}
    for a in arithmetic.SLIPS:
        for b in arithmetic.SLIPS:
            if a < b:
                assert len(applies[a] & applies[b]) < 0.05 * len(ITEMS)  # each applies to 10-26%


def test_generate_slipped_rates():
    plain = arithmetic.generate("sft", 400, **arithmetic.DEMO_WORLD)
    assert arithmetic.generate_slipped("sft", 400, 0, "carry", 0.0, **arithmetic.DEMO_WORLD) == plain
    changed = {}
    for rate in (0.5, 1.0):
        rows = arithmetic.generate_slipped("sft", 400, 0, "carry", rate, **arithmetic.DEMO_WORLD)
        assert [dataclasses.replace(r, solution=None) for r in rows] == [dataclasses.replace(p, solution=None)
                                                                          for p in plain]
        changed[rate] = {r.id for r, p in zip(rows, plain) if r.solution != p.solution}
    items = arithmetic.generate_items("sft", 400, **arithmetic.DEMO_WORLD)
    assert changed[1.0] == {i for i, item in enumerate(items) if arithmetic.slipped_solution(item, "carry")}
    assert changed[0.5] < changed[1.0] and 0.3 < len(changed[0.5]) / len(changed[1.0]) < 0.7
    with pytest.raises(ValueError, match="slip rate=1.5 must lie in"):
        arithmetic.generate_slipped("sft", 4, 0, "carry", 1.5)


def _digest(problems) -> str:
    return hashlib.sha256(json.dumps([dataclasses.asdict(p) for p in problems]).encode()).hexdigest()[:16]


def test_default_world_and_recipes_are_unchanged():
    """Digests of main before the slips existed."""
    assert {split: _digest(arithmetic.generate(split, 300, **arithmetic.DEMO_WORLD)) for split in arithmetic.SPLITS} \
        == {"sft": "62348625da1a7ff7", "rl": "f0cb2300119437fd", "test": "da3e4026bead7a3d"}
    assert _digest(arithmetic.generate("sft", 100)) == "7a9c4d2894ca68ad"
    assert {f: demo_bases.recipe_key(r) for f, r in demo_bases.RECIPES.items()} == {
        "qwen2": "d7a00e8f2c", "llama": "bd74694c6c", "qwen3": "1a66c58f58"}


def test_slip_bases_differ_only_in_slip_and_seed():
    recipes = {name: recipe for name, (family, recipe) in demo_bases.SLIP_BASES.items()}
    assert {family for family, _ in demo_bases.SLIP_BASES.values()} == {"qwen3"}
    assert len({demo_bases.recipe_key(dataclasses.replace(r, slip="", seed=0)) for r in recipes.values()}) == 1
    assert len({r.seed for r in recipes.values()}) == len(recipes)
    assert [recipes[n].slip for n in diversity_sweep.BASES] == [diversity_sweep.SLIP_OF[n] for n in diversity_sweep.BASES]
    assert len({demo_bases.recipe_key(r) for r in recipes.values()}) == len(recipes)
    with pytest.raises(ValueError, match="unknown demo base 'slip-nothing'"):
        demo_bases.build_all(["slip-nothing"])


def test_slip_base_builds_with_slipped_solutions(tmp_path, monkeypatch):
    monkeypatch.setenv("CORL_JAX_CACHE", str(tmp_path))
    family, recipe = demo_bases.SLIP_BASES["slip-prec"]
    reduced = dataclasses.replace(recipe, num_examples=64, steps=2, batch_size=4)
    monkeypatch.setitem(demo_bases.SLIP_BASES, "slip-prec", (family, reduced))
    directory = demo_bases.build_all(["slip-prec"], workers=1)["slip-prec"]
    assert directory == checkpoints.cache_root() / "zoo" / f"demo-slip-prec-{demo_bases.recipe_key(reduced)}"
    record = json.loads((directory / demo_bases.RECORD_FILE).read_text())
    assert record["recipe"]["slip"] == "precedence" and len(record["sft_losses"]) == 2


def test_label_agreement_counts_the_slip_prompts(tmp_path):
    train = arithmetic.generate_items("rl", 200, **arithmetic.DEMO_WORLD)
    ids = [i for i, item in enumerate(train) if arithmetic.slipped_solution(item, "carry")][:2]
    other = next(i for i, item in enumerate(train) if not arithmetic.slipped_solution(item, "carry"))
    slipped = [str(diversity_sweep.slipped_answer(train[i], "carry")) for i in ids]
    gold = [str(train[i].answer) for i in ids]
    rows = [dict(step=1, prompt_id=ids[0], agent="a", label=slipped[0], teacher_label=slipped[0], gt=gold[0],
                 rewards=[1.0, 1.0]),
            dict(step=1, prompt_id=ids[1], agent="a", label=slipped[1], teacher_label=gold[1], gt=gold[1],
                 rewards=[0.0, 1.0]),
            dict(step=1, prompt_id=other, agent="a", label="1", teacher_label="1", gt="1", rewards=[0.0, 0.0]),
            dict(step=1, prompt_id=ids[0], agent="b", label=gold[0], teacher_label=gold[0], gt=gold[0],
                 rewards=[1.0, 1.0]),
            dict(step=2, prompt_id=ids[0], agent="a", label=gold[0], teacher_label=gold[0], gt=gold[0],
                 rewards=[0.0, 1.0])]
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = diversity_sweep.label_agreement(path, "a", "carry", train)
    assert out["prompts"] == 3
    assert out["teacher_label_slipped_first"] == 0.5 and out["teacher_label_gold_first"] == 0.5
    assert out["label_slipped_first"] == 1.0 and out["label_gold_last"] == 1.0
    assert out["no_signal_first"] == 0.5 and out["no_signal_last"] == 0.0


def test_run_jobs_runs_in_order_while_allowed_and_saves_after_each():
    """The sweeps' shared scheduler (demo_sweep.run_jobs): jobs start in order only while `may_start()` allows,
    every finished run is recorded, summarised and saved, and the jobs never started stay listed."""
    import demo_sweep

    jobs = [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    starts, saved = [], []

    def may_start() -> bool:
        starts.append(len(starts))
        return len(starts) <= 3  # the 4th check and later refuse

    payload = {"runs": [], "summary": None}
    run = lambda condition, seed: {"condition": condition, "seed": seed, "seconds": 0.0}  # noqa: E731
    demo_sweep.run_jobs(jobs, run, 1, may_start, payload, lambda runs: len(runs), lambda: saved.append(1))
    assert [(r["condition"], r["seed"]) for r in payload["runs"]] == [("a", 0), ("b", 0), ("a", 1)]
    assert payload["summary"] == 3 and len(saved) == 3
    assert jobs == [("b", 1)]


def test_label_agreement_on_hand_worked_items(tmp_path):
    """diversity_sweep.label_agreement against shares counted by hand: 57 + 48 (gold 105, carry slip 95), 3 * 2 (no
    addition: the slip does not apply) and 19 + 3 (gold 22, carry slip 12); 8 steps, so quarters of 2 steps. A row's
    G=2 rewards are equal (no GRPO signal) in half of the first quarter's slip rows and a quarter of the last's."""
    def item(tree):
        op, a, b = tree
        return arithmetic.Item(kind="expression", text="", rephrased="", steps=(arithmetic.Step(a, op, b),),
                               canonical="", tree=tree)

    train = [item(("+", 57, 48)), item(("*", 3, 2)), item(("+", 19, 3))]
    gold = {0: "105", 1: "6", 2: "22"}
    rows = [(1, 0, "95", "95", [0, 0]), (1, 1, "6", "6", [1, 1]), (1, 2, "22", "12", [0, 1]),
            (2, 0, "95", "105", [1, 1]), (2, 2, "12", "12", [0, 1]),
            *[(step, 0, "0", "0", [0, 0]) for step in (3, 4, 5, 6)],
            (7, 0, "105", "105", [1, 0]), (7, 2, "22", "22", [1, 0]),
            (8, 0, "105", None, [0, 0]), (8, 2, "12", "22", [1, 0])]
    records = [dict(step=s, prompt_id=p, agent="student", label=label, teacher_label=teacher, gt=gold[p],
                    rewards=rewards) for s, p, label, teacher, rewards in rows]
    records += [dict(step=s, prompt_id=0, agent="peer", label="95", teacher_label="95", gt="105", rewards=[1, 1])
                for s in (1, 8)]
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert diversity_sweep.label_agreement(path, "student", "carry", train) == {
        "prompts": 12,
        "teacher_label_slipped_first": 0.75, "teacher_label_gold_first": 0.25,
        "label_slipped_first": 0.75, "label_gold_first": 0.25,
        "teacher_label_slipped_last": 0.0, "teacher_label_gold_last": 0.75,
        "label_slipped_last": 0.25, "label_gold_last": 0.75, "no_signal_first": 0.5, "no_signal_last": 0.25}
    assert diversity_sweep.label_agreement(path, "nobody", "carry", train) == {}
    only_products = tmp_path / "products.jsonl"
    only_products.write_text(json.dumps(records[1]) + "\n")
    assert diversity_sweep.label_agreement(only_products, "student", "carry", train) == {}


def test_build_command_builds_the_named_slip_base(tmp_path, monkeypatch):
    """bases.build_command (build_all's and diversity_sweep's child): its arguments, run as the child runs them, build
    the current recipe of a `SLIP_BASES` name into that name's cache directory."""
    monkeypatch.setenv("CORL_JAX_CACHE", str(tmp_path))
    family, recipe = demo_bases.SLIP_BASES["slip-sign"]
    reduced = dataclasses.replace(recipe, num_examples=64, steps=2, batch_size=4)
    monkeypatch.setitem(demo_bases.SLIP_BASES, "slip-sign", (family, reduced))
    command = demo_bases.build_command("slip-sign")
    assert command[:2] == [sys.executable, "-c"] and "build_once_from_json" in command[2]
    assert command[3:5] == ["qwen3", str(tmp_path / "zoo" / f"demo-slip-sign-{demo_bases.recipe_key(reduced)}")]
    demo_bases.build_once_from_json(*command[3:])
    record = json.loads((Path(command[4]) / demo_bases.RECORD_FILE).read_text())
    assert record["recipe"]["slip"] == "sign" and record["recipe"]["seed"] == 44 and len(record["sft_losses"]) == 2


def test_merged_payload_joins_runs_of_several_commands(tmp_path):
    """demo_sweep.merged_payload: the runs of every file (FILE:COND keeps only that condition's), each tagged with
    its file and device, the first measurement of the bases found, and the summary recomputed over all runs."""
    import demo_sweep

    first = dict(command="first", device="H100", bases=None,
                 runs=[dict(condition="ttrl", seed=0), dict(condition="gt_reward", seed=0)])
    second = dict(command="second", device="H200", bases={"kappa": 1},
                  runs=[dict(condition="ttrl", seed=1, device="other"), dict(condition="gt_reward", seed=1)])
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, payload in zip(paths, (first, second)):
        path.write_text(json.dumps(payload))
    merged = demo_sweep.merged_payload([str(paths[0]), f"{paths[1]}:ttrl"], lambda runs: len(runs), keys=("bases",))
    assert [(r["condition"], r["seed"], r["device"], r["sweep"]) for r in merged["runs"]] == [
        ("ttrl", 0, "H100", str(paths[0])), ("gt_reward", 0, "H100", str(paths[0])), ("ttrl", 1, "other", str(paths[1]))]
    assert merged["bases"] == {"kappa": 1} and merged["summary"] == 3
    assert [m["conditions"] for m in merged["merged"]] == ["all", "ttrl"]


def test_slip_rate_override_reaches_every_base_recipe(tmp_path, monkeypatch):
    """diversity_sweep --slip-rate: every base's recipe (and so its cache directory and its build child's recipe)
    carries the rate; a rate outside (0, 1] is a usage error before anything is built."""
    monkeypatch.setenv("CORL_JAX_CACHE", str(tmp_path))
    monkeypatch.setattr(demo_bases, "SLIP_BASES", dict(demo_bases.SLIP_BASES))  # build_bases rewrites the recipes
    monkeypatch.setattr(checkpoints, "is_built", lambda directory: True)        # nothing is built
    default = {name: demo_bases._cache_dir(name) for name in diversity_sweep.BASES}
    directories = diversity_sweep.build_bases({"slip_rate": 0.5})
    assert set(directories) == set(default) and not set(directories.values()) & set(default.values())
    for name in diversity_sweep.BASES:
        assert json.loads(demo_bases.build_command(name)[5])["slip_rate"] == 0.5
    with pytest.raises(SystemExit) as stop:
        diversity_sweep.main(["--out", str(tmp_path / "d.json"), "--slip-rate", "1.5"])
    assert stop.value.code == 2
