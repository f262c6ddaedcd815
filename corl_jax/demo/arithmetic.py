"""The synthetic arithmetic world: integer-answer problems a laptop-sized model can learn.

Two kinds of problem, each a chain of integer operations (its `level`: 2-5 by default; 1, a single operation, makes
the easiest world):
  * expressions such as "(17 + 5) * 3 - 8": a random tree whose every intermediate value is a whole number in
    [1, max_value] (MAX_VALUE by default; a smaller bound makes an easier world);
  * word problems from templates (shopping, sharing, ages, rates, ...).
Every problem has a second surface form with the same answer for Different family+ (`rephrasing`: "words", the
operations spoken in other words and operand order; or "symbols", an expression's operands of + and * swapped under
another instruction verb, which a base trained on symbolic problems can read), and a worked solution ending in
\\boxed{answer}.

Splits: `sft` (labeled, for warm-starting base models), `rl` (prompts for label-free training; answers only for
diagnostics), `test` (held out). A problem's split is a hash of its canonical form, a key that ignores surface
choices (names, operand order of + and *), so no problem and no rephrasing of it can sit in two splits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from urllib.parse import parse_qsl

import numpy as np

from corl_jax.problems import DataError, Problem

SPLITS = ("sft", "rl", "test")
SPLIT_SHARES = (0.5, 0.3, 0.2)  # share of the canonical problem space that belongs to each split
DEFAULT_SIZES = {"sft": 4000, "rl": 2000, "test": 500}
ALL_LEVELS = (1, 2, 3, 4, 5)  # operations per problem; word problems exist for 2-5
LEVELS = ALL_LEVELS[1:]  # the default
MAX_VALUE = 200  # bound on every number in an expression, leaves and intermediate values alike
# The easier world of the embedded CPU demo (`configs/*.py:demo`): short expressions with small numbers, which
# bases of ~100k parameters learn in about two CPU minutes (experiments/results/demo_recipes/).
REPHRASINGS = ("words", "symbols")
VERBS = ("Compute", "Evaluate", "Calculate")  # the instruction of an expression problem
DEMO_WORLD = dict(levels=(2, 3), word_fraction=0.0, max_value=60)
WORD_FRACTION = 0.5
OPS: dict[str, Callable[[int, int], int]] = {
    "+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a // b}
WORDS = {"+": "plus", "-": "minus", "*": "times", "/": "divided by"}
PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


@dataclasses.dataclass(frozen=True)
class Step:
    """One operation of a worked solution: `left op right`."""

    left: int
    op: str
    right: int
    label: str = ""

    @property
    def value(self) -> int:
        if self.op == "/" and self.left % self.right:
            raise ValueError(f"{self.left} / {self.right} is not a whole number")
        return OPS[self.op](self.left, self.right)


@dataclasses.dataclass(frozen=True)
class Item:
    """A generated problem with its structure: `params` (word problems) or `expression` (expressions)."""

    kind: str          # "expression" or a template name
    text: str
    rephrased: str
    steps: tuple[Step, ...]
    canonical: str     # the surface-free key that decides the split
    params: Mapping[str, int] = dataclasses.field(default_factory=dict)
    expression: str = ""
    tree: tuple | int | None = None  # expressions: (op, left, right) with int leaves

    @property
    def level(self) -> int:
        return len(self.steps)

    @property
    def answer(self) -> int:
        return self.steps[-1].value

    @property
    def solution(self) -> str:
        lines = [(f"{s.label}: " if s.label else "") + _step_line(s.left, s.op, s.right, s.value) for s in self.steps]
        return _solution_text(lines, self.answer)

    def problem(self, index: int, split: str) -> Problem:
        return Problem(id=index, text=self.text, answer=str(self.answer), source=f"arithmetic:{split}",
                       rephrased=self.rephrased, solution=self.solution if split == "sft" else None)


def split_of(canonical: str) -> str:
    """The split a canonical problem belongs to: a fixed hash, so independent of seeds and sizes."""
    return SPLITS[int(np.searchsorted(np.cumsum(SPLIT_SHARES), _unit_hash(canonical), side="right"))]


def _unit_hash(key: str) -> float:
    """A fixed number in [0, 1) for `key` (the split of a canonical form, whether a slip is drawn for a problem)."""
    return int(hashlib.sha256(key.encode()).hexdigest()[:12], 16) / 16**12


def generate_items(split: str, n: int, seed: int = 0, levels: Sequence[int] = LEVELS,
                   word_fraction: float = WORD_FRACTION, max_value: int = MAX_VALUE,
                   rephrasing: str = "words") -> list[Item]:
    """`n` distinct problems of `split`, the same for the same arguments (`rephrasing` changes only the
    rephrased text of expressions)."""
    if split not in SPLITS:
        raise ValueError(f"unknown arithmetic split {split!r}; use one of {SPLITS}")
    if not levels or not set(levels) <= set(ALL_LEVELS):
        raise ValueError(f"levels {tuple(levels)} must be a non-empty subset of {ALL_LEVELS}")
    if not 10 <= max_value <= MAX_VALUE:
        raise ValueError(f"max_value={max_value} must lie in [10, {MAX_VALUE}]")
    if not 0 <= word_fraction <= 1:
        raise ValueError(f"word_fraction={word_fraction} must lie in [0, 1]")
    if rephrasing not in REPHRASINGS:
        raise ValueError(f"unknown rephrasing {rephrasing!r}; use one of {REPHRASINGS}")
    rng = np.random.default_rng([seed, SPLITS.index(split)])
    items: list[Item] = []
    seen: set[str] = set()
    for _ in range(200 * n + 1000):
        if len(items) == n:
            return items
        level = int(rng.choice(levels))
        templates = [t for t, steps in TEMPLATES if steps == level]
        if templates and rng.random() < word_fraction:
            item = templates[int(rng.integers(len(templates)))](rng)
        else:
            item = _expression_item(rng, level, max_value, rephrasing)
        if split_of(item.canonical) == split and item.canonical not in seen:
            seen.add(item.canonical)
            items.append(item)
    raise ValueError(f"found only {len(items)} distinct {split!r} problems at levels {tuple(levels)}, wanted {n}; "
                     "ask for fewer or allow more levels")


def generate(split: str = "rl", n: int | None = None, seed: int = 0, levels: Sequence[int] = LEVELS,
             word_fraction: float = WORD_FRACTION, max_value: int = MAX_VALUE,
             rephrasing: str = "words") -> list[Problem]:
    """The split as Problem rows (ids 0..n-1); `n` defaults to DEFAULT_SIZES[split]."""
    n = DEFAULT_SIZES.get(split, 0) if n is None else n
    items = generate_items(split, n, seed, levels, word_fraction, max_value, rephrasing)
    return [item.problem(i, split) for i, item in enumerate(items)]


def write_splits(out_dir: str, sizes: Mapping[str, int] = DEFAULT_SIZES, seed: int = 0, **world) -> dict[str, str]:
    """Write each split to `<out_dir>/<split>.jsonl` (fields prompt, answer, rephrased, solution, kind, level);
    `world`: `generate_items`' levels / word_fraction / max_value."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for split, n in sizes.items():
        paths[split] = os.path.join(out_dir, f"{split}.jsonl")
        with open(paths[split], "w", encoding="utf-8") as f:
            for item in generate_items(split, n, seed, **world):
                row = {"prompt": item.text, "answer": str(item.answer), "rephrased": item.rephrased,
                       "kind": item.kind, "level": item.level}
                if split == "sft":
                    row["solution"] = item.solution
                f.write(json.dumps(row) + "\n")
    return paths


# ------------------------------------------------------------------------------------------------------ expressions
# A tree is an int (a leaf) or a tuple (op, left, right).


def problems_from_spec(spec: str) -> list[Problem]:
    """The problems of a source string `arithmetic[:split][?setting=value&...]` (split `rl` by default; settings are
    `generate` keywords; `corl_jax.data.arithmetic_source` writes such strings), resolved through corl_jax.registry."""
    source, _, query = spec.partition("?")
    split = source.partition(":")[2] or "rl"
    types = {"levels": lambda v: tuple(int(x) for x in v.split(",")), "word_fraction": float, "max_value": int,
             "rephrasing": str, "n": int}
    fix = (f"Fix: use 'arithmetic[:split][?setting=value&...]' with a split of {SPLITS} and settings "
           f"{sorted(types)} (n: the split's size), e.g. 'arithmetic:test?levels=2,3&max_value=60'")
    try:
        settings = {key: types[key](value) for key, value in parse_qsl(query, strict_parsing=bool(query))}
        return generate(split, **settings)
    except KeyError as e:
        raise DataError(f"{spec}: unknown setting {e}. {fix}") from e
    except ValueError as e:
        raise DataError(f"{spec}: {e}. {fix}") from e


def _expression_item(rng: np.random.Generator, n_ops: int, max_value: int, rephrasing: str) -> Item:
    tree = _int(rng, 2, min(99, max_value))
    for _ in range(n_ops):
        paths = list(_leaf_paths(tree))
        path = paths[int(rng.integers(len(paths)))]
        tree = _replace(tree, path, _split_value(rng, _subtree(tree, path), max_value))
    expression = _render(tree, symbols=True)
    verb, other = int(rng.integers(3)), int(rng.integers(3))  # both drawn in either rephrasing: same problems
    text = f"{VERBS[verb]} {expression}."
    if rephrasing == "symbols":
        rephrased = f"{VERBS[(verb + 1 + other % 2) % 3]} {_render(_commuted(tree), symbols=True)}."
    else:
        spoken = _render(_commuted(tree), symbols=False)
        rephrased = [f"What is {spoken}?", f"Find the value of {spoken}.", f"Work out {spoken}."][other]
    return Item(kind="expression", text=text, rephrased=rephrased, steps=tuple(_steps(tree)),
                canonical=f"expression:{_canonical(tree)}", expression=expression, tree=tree)


def _split_value(rng: np.random.Generator, value: int, max_value: int):
    """An operation whose result is `value`, with whole operands in [1, max_value]."""
    choices = []
    if value >= 2:
        a = _int(rng, 1, value - 1)
        choices.append(("+", a, value - a))
    b = _int(rng, 1, 20)
    if value + b <= max_value:
        choices.append(("-", value + b, b))
    divisors = [d for d in range(2, value // 2 + 1) if value % d == 0]
    if divisors:
        d = divisors[int(rng.integers(len(divisors)))]
        choices.append(("*", d, value // d))
    b = _int(rng, 2, 9)
    if value * b <= max_value:
        choices.append(("/", value * b, b))
    return choices[int(rng.integers(len(choices)))]


def _leaf_paths(tree, path=()):
    if isinstance(tree, int):
        yield path
    else:
        yield from _leaf_paths(tree[1], path + (1,))
        yield from _leaf_paths(tree[2], path + (2,))


def _subtree(tree, path):
    for i in path:
        tree = tree[i]
    return tree


def _replace(tree, path, new):
    if not path:
        return new
    parts = list(tree)
    parts[path[0]] = _replace(tree[path[0]], path[1:], new)
    return tuple(parts)


def _render(tree, symbols: bool) -> str:
    """Infix text with only the parentheses that precedence and left associativity need."""
    if isinstance(tree, int):
        return str(tree)
    op, left, right = tree

    def operand(child, is_right: bool) -> str:
        text = _render(child, symbols)
        if isinstance(child, tuple) and (PRECEDENCE[child[0]] < PRECEDENCE[op] or (
                is_right and PRECEDENCE[child[0]] == PRECEDENCE[op] and op in "-/")):
            return f"({text})"
        return text

    return f"{operand(left, False)} {op if symbols else WORDS[op]} {operand(right, True)}"


def _commuted(tree):
    """The same value with the operands of every + and * swapped (the rephrased operand order)."""
    if isinstance(tree, int):
        return tree
    op, left, right = tree
    if op in "+*":
        left, right = right, left
    return op, _commuted(left), _commuted(right)


def _canonical(tree) -> str:
    if isinstance(tree, int):
        return str(tree)
    op, left, right = tree
    operands = [_canonical(left), _canonical(right)]
    if op in "+*":
        operands.sort()
    return f"({operands[0]}{op}{operands[1]})"


def _steps(tree) -> list[Step]:
    """Post-order: innermost operations first, as one would work them out."""
    if isinstance(tree, int):
        return []
    op, left, right = tree
    left_steps, right_steps = _steps(left), _steps(right)

    def value(child, child_steps) -> int:  # a leaf's number, or the value of the subtree's last step
        return child_steps[-1].value if child_steps else child

    return left_steps + right_steps + [Step(value(left, left_steps), op, value(right, right_steps))]


# ----------------------------------------------------------------------------------------------------------- slips
# Systematic mistakes for warm-start data with a designed error mode (docs/diversity.md): a base trained on slipped
# worked solutions makes that mistake wherever it applies, so two bases share an error mode or do not, by design.
SLIPS = ("precedence", "carry", "sign")


def slipped_solution(item: Item, slip: str) -> str | None:
    """`item`'s worked solution made with `slip`, or None where it does not apply (word problems; a slipped working
    that divides unevenly, by zero or adds a negative number; or one that ends at the right answer anyway):
      precedence: the expression worked left to right as written, as if * and / did not bind before + and -
        (parentheses kept): 5 + 3 * 2 = 16;
      carry: every addition drops its carries, digit by digit: 57 + 48 = 95;
      sign: a minus before a parenthesised sum or difference negates only its first term: 9 - (4 + 2) = 7."""
    if slip not in SLIPS:
        raise ValueError(f"unknown slip {slip!r}; use one of {SLIPS}")
    if item.tree is None:
        return None
    tree = {"precedence": lambda t: _parse_left_to_right(_render(t, symbols=True)), "carry": lambda t: t,
            "sign": _sign_slipped}[slip](item.tree)
    try:
        lines, answer = _worked(tree, _add_without_carry if slip == "carry" else OPS["+"])
    except (ValueError, ZeroDivisionError):
        return None
    if answer == item.answer:
        return None
    return _solution_text(lines, answer)


def generate_slipped(split: str, n: int, seed: int, slip: str, rate: float, **world) -> list[Problem]:
    """`generate`'s problems whose worked solutions carry `slip` on a `rate` share of the problems it applies to,
    chosen by a hash of each problem (so the same problems in every recipe); `world`: `generate_items` settings."""
    if not 0 <= rate <= 1:
        raise ValueError(f"slip rate={rate} must lie in [0, 1]")
    problems = []
    for i, item in enumerate(generate_items(split, n, seed, **world)):
        problem = item.problem(i, split)
        solution = slipped_solution(item, slip) if _unit_hash(f"slip:{item.canonical}") < rate else None
        problems.append(dataclasses.replace(problem, solution=solution) if solution and problem.solution else problem)
    return problems


def _worked(tree, add: Callable[[int, int], int]) -> tuple[list[str], int]:
    """Solution lines (post-order, as `Item.solution` writes them) and the value of `tree`, with `add` for +."""
    if isinstance(tree, int):
        return [], tree
    op, left, right = tree
    left_lines, a = _worked(left, add)
    right_lines, b = _worked(right, add)
    if op == "/" and a % b:
        raise ValueError(f"{a} / {b} is not a whole number")
    value = add(a, b) if op == "+" else OPS[op](a, b)
    return left_lines + right_lines + [_step_line(a, op, b, value)], value


def _step_line(left: int, op: str, right: int, value: int) -> str:
    return f"{left} {op} {right} = {value}."


def _solution_text(lines: list[str], answer: int) -> str:
    """A worked solution: its step lines, then the boxed answer."""
    return "\n".join(lines + [f"The answer is \\boxed{{{answer}}}."])


def _add_without_carry(a: int, b: int) -> int:
    if a < 0 or b < 0:
        raise ValueError("the carry slip adds whole numbers only")
    out, place = 0, 1
    while a or b:
        out += (a % 10 + b % 10) % 10 * place
        a, b, place = a // 10, b // 10, place * 10
    return out


def _parse_left_to_right(text: str):
    """The tree of infix `text` with every operator of equal precedence, left associative (parentheses kept)."""
    tokens = text.replace("(", " ( ").replace(")", " ) ").split()

    def expression(i: int):
        tree, i = operand(i)
        while i < len(tokens) and tokens[i] in OPS:
            right, j = operand(i + 1)
            tree, i = (tokens[i], tree, right), j
        return tree, i

    def operand(i: int):
        if tokens[i] == "(":
            tree, i = expression(i + 1)
            return tree, i + 1  # past ")"
        return int(tokens[i]), i + 1

    return expression(0)[0]


def _sign_slipped(tree):
    """`tree` with every a - (b +/- c) read as (a - b) +/- c, outermost first."""
    if isinstance(tree, int):
        return tree
    op, left, right = tree
    if op == "-" and isinstance(right, tuple) and right[0] in "+-":
        return _sign_slipped((right[0], ("-", left, right[1]), right[2]))
    return op, _sign_slipped(left), _sign_slipped(right)


# --------------------------------------------------------------------------------------------------- word problems

NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jade", "Kofi", "Lena")
GOODS = ("pens", "notebooks", "apples", "stickers", "candles", "mugs", "books", "balloons")


def _shopping(rng) -> Item:
    name, (goods1, goods2) = _name(rng), rng.choice(GOODS, size=2, replace=False)
    n1, p1, n2, p2 = _int(rng, 2, 6), _int(rng, 2, 15), _int(rng, 2, 6), _int(rng, 2, 15)
    cost1, cost2 = n1 * p1, n2 * p2
    paid = next(bill for bill in (20, 50, 100, 200) if bill > cost1 + cost2)
    return _word_item(
        "shopping", dict(count1=n1, price1=p1, count2=n2, price2=p2, paid=paid),
        canonical=(sorted([(n1, p1), (n2, p2)]), paid),
        steps=[Step(n1, "*", p1, f"Cost of the {goods1}"), Step(n2, "*", p2, f"Cost of the {goods2}"),
               Step(cost1, "+", cost2, "Total cost"), Step(paid, "-", cost1 + cost2, "Change")],
        text=f"{name} buys {n1} {goods1} at {p1} dollars each and {n2} {goods2} at {p2} dollars each, and pays "
             f"with a {paid}-dollar bill. How many dollars of change does {name} get?",
        rephrased=f"How much change, in dollars, does {name} receive after paying {paid} dollars for {n2} {goods2} "
                  f"costing {p2} dollars apiece and {n1} {goods1} costing {p1} dollars apiece?")


def _sharing(rng) -> Item:
    name, goods = _name(rng), rng.choice(GOODS)
    friends, each = _int(rng, 2, 9), _int(rng, 2, 12)
    morning = _int(rng, 1, friends * each - 1)
    afternoon = friends * each - morning
    return _word_item(
        "sharing", dict(morning=morning, afternoon=afternoon, friends=friends),
        canonical=(sorted([morning, afternoon]), friends),
        steps=[Step(morning, "+", afternoon, f"{goods.capitalize()} in all"),
               Step(morning + afternoon, "/", friends, "Each friend gets")],
        text=f"{name} collects {morning} {goods} in the morning and {afternoon} {goods} in the afternoon, then "
             f"shares all of them equally among {friends} friends. How many {goods} does each friend get?",
        rephrased=f"{friends} friends share equally the {goods} that {name} collected: {afternoon} in the afternoon "
                  f"and {morning} in the morning. How many {goods} does each friend receive?")


def _ages(rng) -> Item:
    name = _name(rng)
    age, gap, years = _int(rng, 3, 40), _int(rng, 1, 15), _int(rng, 1, 30)
    return _word_item(
        "ages", dict(age=age, gap=gap, years=years), canonical=(age, gap, years),
        steps=[Step(age, "+", gap, "Sister's age now"), Step(age + gap, "+", years, f"Her age in {years} years")],
        text=f"{name} is {age} years old. {name}'s sister is {gap} years older than {name}. How old will "
             f"{name}'s sister be in {years} years?",
        rephrased=f"In {years} years, how old will {name}'s sister be, if she is {gap} years older than {name} "
                  f"and {name} is {age} years old now?")


def _production(rng) -> Item:
    goods = rng.choice(GOODS)
    rate, hours, days = _int(rng, 2, 20), _int(rng, 2, 12), _int(rng, 2, 7)
    return _word_item(
        "production", dict(rate=rate, hours=hours, days=days), canonical=(rate, hours, days),
        steps=[Step(rate, "*", hours, "Made per day"), Step(rate * hours, "*", days, f"Made in {days} days")],
        text=f"A machine makes {rate} {goods} per hour. It runs {hours} hours each day. How many {goods} does it "
             f"make in {days} days?",
        rephrased=f"How many {goods} does a machine make over {days} days if it runs {hours} hours a day and makes "
                  f"{rate} {goods} every hour?")


def _boxes(rng) -> Item:
    goods = rng.choice(GOODS)
    boxes, per_box = _int(rng, 2, 12), _int(rng, 2, 12)
    broken = _int(rng, 1, boxes * per_box - 1)
    return _word_item(
        "boxes", dict(boxes=boxes, per_box=per_box, broken=broken),
        canonical=(sorted([boxes, per_box]), broken),
        steps=[Step(boxes, "*", per_box, f"{goods.capitalize()} in all"),
               Step(boxes * per_box, "-", broken, "Not broken")],
        text=f"There are {boxes} boxes with {per_box} {goods} in each box. {broken} of the {goods} are broken. "
             f"How many {goods} are not broken?",
        rephrased=f"{broken} of the {goods} in {boxes} boxes of {per_box} {goods} each are broken. How many "
                  f"unbroken {goods} are there?")


def _savings(rng) -> Item:
    name = _name(rng)
    weekly, weeks, gift = _int(rng, 2, 20), _int(rng, 2, 10), _int(rng, 1, 50)
    spent = _int(rng, 1, weekly * weeks + gift - 1)
    return _word_item(
        "savings", dict(weekly=weekly, weeks=weeks, gift=gift, spent=spent),
        canonical=(weekly, weeks, gift, spent),
        steps=[Step(weekly, "*", weeks, "Saved"), Step(weekly * weeks, "+", gift, "With the gift"),
               Step(weekly * weeks + gift, "-", spent, "Left")],
        text=f"{name} saves {weekly} dollars every week for {weeks} weeks. Then {name}'s aunt gives {name} {gift} "
             f"dollars, and {name} spends {spent} dollars on a game. How many dollars does {name} have now?",
        rephrased=f"After spending {spent} dollars on a game, how many dollars does {name} have left, having saved "
                  f"{weekly} dollars a week for {weeks} weeks and received {gift} dollars from an aunt?")


def _travel(rng) -> Item:
    speed1, hours1, speed2, hours2 = _int(rng, 20, 90), _int(rng, 1, 5), _int(rng, 20, 90), _int(rng, 1, 5)
    return _word_item(
        "travel", dict(speed1=speed1, hours1=hours1, speed2=speed2, hours2=hours2),
        canonical=sorted([(speed1, hours1), (speed2, hours2)]),
        steps=[Step(speed1, "*", hours1, "First part"), Step(speed2, "*", hours2, "Second part"),
               Step(speed1 * hours1, "+", speed2 * hours2, "Total distance")],
        text=f"A car drives at {speed1} km per hour for {hours1} hours, then at {speed2} km per hour for {hours2} "
             "hours. How many km does it travel in total?",
        rephrased=f"What total distance in km does a car cover driving {hours2} hours at {speed2} km per hour "
                  f"after {hours1} hours at {speed1} km per hour?")


def _word_item(kind: str, params: dict[str, int], canonical, steps: list[Step], text: str, rephrased: str) -> Item:
    return Item(kind=kind, text=text, rephrased=rephrased, steps=tuple(steps), params=params,
                canonical=f"{kind}:{json.dumps(canonical)}")


TEMPLATES: tuple[tuple[Callable[[np.random.Generator], Item], int], ...] = (
    (_sharing, 2), (_ages, 2), (_production, 2), (_boxes, 2), (_savings, 3), (_travel, 3), (_shopping, 4))


def _int(rng: np.random.Generator, low: int, high: int) -> int:
    """A uniform whole number in [low, high]."""
    return int(rng.integers(low, high + 1))


def _name(rng: np.random.Generator) -> str:
    return NAMES[int(rng.integers(len(NAMES)))]
