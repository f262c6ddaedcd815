"""Warm-started tiny bases of the arithmetic world: the `demo:<family>` checkpoints.

Each family gets its own architecture, size, tokenizer and seed (`RECIPES`), and is made by a short supervised
fine-tuning (SFT) of a random init on the `sft` split of `corl_jax.demo.arithmetic`: the chat prompt exactly as RL will
present it (`chat_prompt(tokenizer, problem.text)`), then the worked solution and the EOS token, with the loss on
the solution tokens only. The result is an ordinary HF checkpoint directory, built once into
`<cache_root()>/zoo/demo-<family>-<recipe hash>` and loaded by `from_pretrained` like any real model;
`demo_base.json` in it records the recipe, the SFT loss curve and the build time.

`python -m corl_jax.demo.bases [--families=qwen2,llama --num_test=500]` builds the bases and prints each one's
held-out accuracy and the Cohen's kappa of their per-problem correctness (their error overlap).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import queue
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from corl_jax import registry
from corl_jax.demo import arithmetic, checkpoints
from corl_jax.optim import make_optimizer
from corl_jax.tokenization import bucket_length, build_prompt_text, chat_prompt, stop_token_ids

RECORD_FILE = "demo_base.json"


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How one family's base is made.

    architecture: HF config.json fields overriding `checkpoints.TINY_ARCHITECTURES[family]`.
    tokenizer: "char" (one token per byte) or "bpe" (trained on the SFT corpus up to `vocab_size` tokens);
        `digit_group` digits at most per number token (1 like Qwen, 3 like Llama 3, 0: numbers not split, like GPT-2).
    num_examples / levels / word_fraction / max_value: how many `sft` problems, from which arithmetic world
        (`arithmetic.generate_items`), drawn with `seed`.
    steps, batch_size, learning_rate: the AdamW run (HF cosine schedule with 3% warmup, clip 1.0).
    seed: problems, initialisation and batch order.
    slip / slip_rate: a designed error mode of the worked solutions (`arithmetic.SLIPS`; "" for none) on a
        `slip_rate` share of the problems it applies to (`arithmetic.generate_slipped`).
    """

    architecture: dict
    tokenizer: str
    vocab_size: int = 512
    digit_group: int = 1
    num_examples: int = 20000
    levels: tuple[int, ...] = arithmetic.DEMO_WORLD["levels"]
    word_fraction: float = arithmetic.DEMO_WORLD["word_fraction"]
    max_value: int = arithmetic.DEMO_WORLD["max_value"]
    steps: int = 3000
    batch_size: int = 32
    learning_rate: float = 3e-3
    seed: int = 0
    slip: str = ""
    slip_rate: float = 1.0

    @property
    def world(self) -> dict:
        """The arithmetic world's settings (`arithmetic.generate` keywords) of the SFT problems."""
        return dict(levels=self.levels, word_fraction=self.word_fraction, max_value=self.max_value)


# Sized for a 2-core CPU on the demo world (`arithmetic.DEMO_WORLD`). A ring teaches well only when every teacher's
# vote is mostly right. Qwen2- and Llama-style bases are 4 layers x 64 wide, the Qwen3-style one 3 layers (222k / 255k /
# 171k parameters), each with its own seed and tokenizer recipe (Qwen-style single digits, Llama-3-style groups of up
# to three digits). The BPE budgets saturate on this corpus: both Qwen-style bases end with the same 369-token
# vocabulary (+ specials), as the real Qwen2.5 and Qwen3 share theirs; the Llama-style one ends with 448 tokens.
# Accuracy after 1500 SFT steps jumps between seeds (experiments/results/demo_recipes/grid4_device_cpu.json: 26-75%
# for the 4-layer recipes); the 3-layer Qwen3-style recipe at 2000 steps reaches 66-86% over ten seeds
# (grid7_device_cpu.json, grid7_local_cpu.json). Smaller bases at 1500 steps reached 15-47% (grid5_device_cpu.json).
# A Qwen3-style base with a GPT-2-style BPE (3 x 96, `digit_group=0`; grid6_device_cpu.json, 56%) gained +0.4 +- 1.0
# points in the ring over 5 seeds (experiments/results/demo_sweep/qwen3_gpt2bpe/).
_D64L4 = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16)
RECIPES = {
    "qwen2": Recipe(architecture=_D64L4, tokenizer="bpe", vocab_size=384, steps=2000, seed=1),
    "llama": Recipe(architecture=_D64L4, tokenizer="bpe", vocab_size=1024, digit_group=3, steps=1500, seed=21),
    "qwen3": Recipe(architecture=dict(_D64L4, num_hidden_layers=3), tokenizer="bpe", vocab_size=640, steps=2000,
                    seed=31),
}
# The controlled diversity test (docs/diversity.md): bases of one shape and tokenizer recipe (the Qwen3-style one)
# that differ only in seed and in the error mode of their SFT solutions, so a pair shares its error mode or does not.
# The carry slip applies to the most demo-world problems (about 26% of test problems, against 12% for the precedence
# slip and 11% for the sign slip; the three barely overlap), so it is the mode two bases share.
_SLIP_BASE = dataclasses.replace(RECIPES["qwen3"], steps=1800)
SLIP_BASES = {
    "slip-carry-a": ("qwen3", dataclasses.replace(_SLIP_BASE, slip="carry", seed=41)),
    "slip-carry-b": ("qwen3", dataclasses.replace(_SLIP_BASE, slip="carry", seed=42)),
    "slip-prec": ("qwen3", dataclasses.replace(_SLIP_BASE, slip="precedence", seed=43)),
    "slip-sign": ("qwen3", dataclasses.replace(_SLIP_BASE, slip="sign", seed=44)),
}


def recipe_key(recipe: Recipe) -> str:
    """A short hash of a recipe: the cache directory changes whenever the recipe does. The slip fields enter it
    only when a slip is set, so a recipe without one keeps its key."""
    fields = dataclasses.asdict(recipe)
    if not recipe.slip:
        del fields["slip"], fields["slip_rate"]
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:10]


def demo_base_dir(family: str) -> Path:
    """The cached checkpoint directory of `family`'s base, built (atomically) on first use."""
    registry.check_family(f"demo:{family}", family)
    directory = _cache_dir(family)
    return checkpoints.build_once(directory, lambda d: build_demo_base(d, family))


def slip_base_dir(name: str) -> Path:
    """The cached checkpoint directory of the `SLIP_BASES[name]` base, built (atomically) on first use."""
    family, recipe = _recipe(name)
    return checkpoints.build_once(_cache_dir(name), lambda d: build_demo_base(d, family, **dataclasses.asdict(recipe)))


def _recipe(name: str) -> tuple[str, Recipe]:
    """(architecture family, recipe) of a family's base or of a `SLIP_BASES` name."""
    if name in SLIP_BASES:
        return SLIP_BASES[name]
    if name not in RECIPES:
        raise ValueError(f"unknown demo base {name!r}; use a family of {tuple(RECIPES)} or one of {tuple(SLIP_BASES)}")
    return name, RECIPES[name]


def _cache_dir(name: str) -> Path:
    return checkpoints.cache_root() / "zoo" / f"demo-{name}-{recipe_key(_recipe(name)[1])}"


def build_all(families: Sequence[str] = registry.FAMILIES, workers: int | None = None) -> dict[str, Path]:
    """Build (or find cached) the bases of `families` (or `SLIP_BASES` names); returns name -> directory.

    On a CPU backend, missing bases are built side by side, one single-threaded process each, `workers` at once
    (default: one per core this process may use), longest recipe first, each worker taking the next base when it
    is free. On this project's 2-core VM the three take ~540 s this way, against ~940 s one after another in one
    process (experiments/results/demo_timing.json); the weights are bit-identical (tests/test_demo_bases.py). On an
    accelerator they are built here, one after another (fast there, and child processes could not share its
    memory)."""
    missing = [f for f in dict.fromkeys(families) if not checkpoints.is_built(_cache_dir(f))]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = min(len(missing), workers or cores)
    if workers > 1 and jax.default_backend() == "cpu":
        slots = queue.SimpleQueue()  # progress-bar lines of the free workers
        for slot in range(workers):
            slots.put(slot)

        def build(family):
            slot = slots.get()
            try:
                _build_in_subprocess(family, slot)
            finally:
                slots.put(slot)

        cost = {f: _recipe(f)[1].steps * _recipe(f)[1].batch_size for f in missing}
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(build, sorted(missing, key=cost.get, reverse=True)))
    return {name: slip_base_dir(name) if name in SLIP_BASES else demo_base_dir(name) for name in families}


def _build_in_subprocess(name: str, slot: int) -> None:
    """Build `name`'s base (its current recipe) into the cache in a single-threaded CPU child process whose
    progress bar is on terminal line `slot`."""
    env = dict(single_threaded_cpu_env(), TQDM_POSITION=str(slot))
    result = subprocess.run(build_command(name), env=env)
    if result.returncode:
        raise RuntimeError(f"building the demo:{name} base failed (exit status {result.returncode}, see its "
                           "output above); nothing of it was cached, so the next run builds it again")


def build_command(name: str) -> list[str]:
    """The command of a child process that builds `name`'s base (a family or a `SLIP_BASES` name, with its current
    recipe) into its cache directory (`build_once_from_json`)."""
    code = "import sys; from corl_jax.demo import bases; bases.build_once_from_json(*sys.argv[1:])"
    family, recipe = _recipe(name)
    return [sys.executable, "-c", code, family, str(_cache_dir(name)), json.dumps(dataclasses.asdict(recipe))]


def single_threaded_cpu_env() -> dict:
    """This process's environment for a child that runs JAX on one CPU thread. Its builds are bit-identical to
    one in a whole-machine process; a multi-threaded process pinned to one core (taskset) builds other bytes."""
    return dict(os.environ, JAX_PLATFORMS="cpu",
                XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_multi_thread_eigen=false".strip())


def build_once_from_json(family: str, directory: str, recipe_json: str) -> None:
    """Build `family`'s base with the recipe fields of `recipe_json` into `directory` (the child of `build_all`)."""
    fields = json.loads(recipe_json)
    fields["levels"] = tuple(fields["levels"])
    checkpoints.build_once(Path(directory), lambda d: build_demo_base(d, family, **fields))


def build_demo_base(directory, family: str, **overrides) -> dict:
    """Write `family`'s warm-started base to `directory` (recipe fields overridable, e.g. steps=5).

    Returns the record also written to `<directory>/demo_base.json` (recipe, SFT losses, seconds)."""
    from corl_jax.models import from_pretrained, save_pretrained

    recipe = dataclasses.replace(RECIPES[family], **overrides)
    start = time.time()
    tqdm.write(f"demo:{family}: building the base once ({recipe.steps} SFT steps, {recipe.tokenizer} tokenizer, "
               f"{recipe.architecture}) into {directory}")
    if recipe.slip:
        problems = arithmetic.generate_slipped("sft", recipe.num_examples, recipe.seed, recipe.slip, recipe.slip_rate,
                                               **recipe.world)
    else:
        problems = arithmetic.generate("sft", recipe.num_examples, seed=recipe.seed, **recipe.world)
    corpus = [text for p in problems for text in (build_prompt_text(p.text), p.rephrased, p.solution)]
    checkpoints.build_random_checkpoint(directory, family, seed=recipe.seed, tokenizer_kind=recipe.tokenizer,
                                corpus=corpus, vocab_size=recipe.vocab_size, digit_group=recipe.digit_group,
                                **recipe.architecture)
    policy = from_pretrained(directory, dtype=jnp.float32)
    ids, loss_mask = sft_examples(policy.tokenizer, problems)
    losses = train_sft(policy.model, ids, loss_mask, recipe, log_prefix=f"demo:{family}")
    save_pretrained(policy, directory)
    record = dict(family=family, recipe=dataclasses.asdict(recipe), max_example_tokens=int(ids.shape[1]),
                  sft_losses=losses, build_seconds=round(time.time() - start, 1))
    (Path(directory) / RECORD_FILE).write_text(json.dumps(record, indent=1) + "\n")
    tqdm.write(f"demo:{family}: SFT loss {losses[0]:.3f} -> {losses[-1]:.3f} in {record['build_seconds']:.0f} s")
    return record


def sft_examples(tokenizer, problems) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded SFT rows: ids int32 [N, T] = chat prompt + solution + EOS (then padding), and the bool
    loss mask [N, T] marking the solution and EOS tokens. The prompt is tokenized on its own, exactly as
    sampling will see it; the solution continues from there."""
    if any(p.solution is None for p in problems):
        raise ValueError("SFT needs worked solutions: use problems of the arithmetic 'sft' split")
    prompts = tokenizer([chat_prompt(tokenizer, p.text) for p in problems], add_special_tokens=False)["input_ids"]
    answers = tokenizer([p.solution for p in problems], add_special_tokens=False)["input_ids"]
    rows = [(prompt, answer + [tokenizer.eos_token_id]) for prompt, answer in zip(prompts, answers)]
    width = max(len(prompt) + len(answer) for prompt, answer in rows)
    ids = np.full((len(rows), width), tokenizer.pad_token_id, np.int32)
    loss_mask = np.zeros((len(rows), width), bool)
    for i, (prompt, answer) in enumerate(rows):
        ids[i, :len(prompt) + len(answer)] = prompt + answer
        loss_mask[i, len(prompt):len(prompt) + len(answer)] = True
    return ids, loss_mask


def train_sft(model, ids: np.ndarray, loss_mask: np.ndarray, recipe: Recipe, *,
              log_prefix: str = "sft") -> list[float]:
    """Fine-tune `model` in place on (ids, loss_mask) rows (see `sft_examples`); returns the loss of each step."""
    optimizer = make_optimizer(recipe.learning_rate, recipe.steps, weight_decay=0.01)
    graphdef, params = nnx.split(model, nnx.Param)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, batch_ids, batch_loss_mask):
        def loss_fn(params):
            model = nnx.merge(graphdef, params)
            mask = batch_ids >= 0  # right padding is causal-invisible to the real tokens: attend everywhere
            positions = jnp.broadcast_to(jnp.arange(batch_ids.shape[1]), batch_ids.shape)
            hidden = model(batch_ids[:, :-1], positions[:, :-1], mask[:, :-1], unroll_layers=True)  # faster on CPU
            logits = model.logits(hidden)
            token_loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch_ids[:, 1:])
            weights = batch_loss_mask[:, 1:]
            return jnp.sum(token_loss * weights) / jnp.maximum(jnp.sum(weights), 1)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    lengths = loss_mask.shape[1] - np.argmax(loss_mask[:, ::-1], axis=1)  # one past each row's EOS
    rng = np.random.default_rng(recipe.seed)
    losses = []  # device scalars, read back once at the end (a read per step would stall the dispatch queue)
    with tqdm(total=recipe.steps, desc=f"{log_prefix}: SFT", mininterval=2.0) as bar:
        for i in range(recipe.steps):
            rows = rng.choice(len(ids), size=min(recipe.batch_size, len(ids)), replace=False)
            width = bucket_length(int(lengths[rows].max()), 32)  # a few shapes compile; short batches cost less
            params, opt_state, loss = step(params, opt_state, ids[rows, :width], loss_mask[rows, :width])
            losses.append(loss)
            bar.update()
            if i % 50 == 0:
                bar.set_postfix(loss=f"{float(loss):.3f}", refresh=False)
    nnx.update(model, params)
    return [float(x) for x in jax.device_get(losses)]


def measure_accuracy(directory, problems, *, temperature: float = 0.6, max_new_tokens: int = 192, seed: int = 0,
                     batch_prompts: int = 128) -> np.ndarray:
    """Per-problem correctness (bool [N]) of the checkpoint at `directory`: one sample per problem at
    `temperature` (0: greedy) with the sampling engine, graded against the gold answer like the in-loop eval."""
    from corl_jax.answers.math import extract_answer, grade_answer

    texts = sample_texts(directory, problems, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed,
                         batch_prompts=batch_prompts, num_samples=1)
    return np.array([grade_answer(extract_answer(row[0]), p.answer) for row, p in zip(texts, problems)], bool)


def majority_correct(texts, problems) -> np.ndarray:
    """bool [N]: is the majority vote of each problem's sampled completions (`sample_texts`) right? The vote is
    the reference's: the most frequent `vote_key` among the parseable completions (ties: the first seen)."""
    from collections import Counter

    from corl_jax.answers.math import extract_answer, grade_answer, vote_key

    out = []
    for row, problem in zip(texts, problems):
        keyed = [(key, text) for key, text in ((vote_key(t), t) for t in row) if key is not None]
        top = Counter(key for key, _ in keyed).most_common(1)[0][0] if keyed else None
        out.append(top is not None and grade_answer(extract_answer(next(t for k, t in keyed if k == top)),
                                                    problem.answer))
    return np.array(out, bool)


def sample_texts(directory, problems, *, temperature: float, num_samples: int, max_new_tokens: int = 192,
                 seed: int = 0, batch_prompts: int = 128) -> list[list[str]]:
    """`num_samples` completions per problem (`texts[n][g]`) of the checkpoint at `directory`."""
    from corl_jax.models import from_pretrained
    from corl_jax.sampling import Sampler, SamplingParams
    from corl_jax.sampling.text import generate_texts

    policy = from_pretrained(directory, dtype=jnp.float32)
    sampler = Sampler.from_policy(policy, stop_ids=stop_token_ids(policy.tokenizer, directory))
    params = SamplingParams(greedy=True) if temperature == 0 else SamplingParams(temperature=temperature)
    texts = []
    for start in range(0, len(problems), batch_prompts):
        chunk = problems[start:start + batch_prompts]
        chunk_texts, _ = generate_texts(sampler, policy.tokenizer, [p.text for p in chunk], num_samples=num_samples,
                                        max_new_tokens=max_new_tokens, params=params,
                                        key=jax.random.fold_in(jax.random.key(seed), start))
        texts += chunk_texts
    return texts


def report(families: Sequence[str] = registry.FAMILIES, num_test: int = arithmetic.DEFAULT_SIZES["test"]) -> dict:
    """Build (or find) the bases, print each one's test accuracy (T=0.6 and greedy) and the Cohen's kappa of
    their per-problem correctness at T=0.6; returns {(family, temperature): correctness [num_test]}."""
    from corl_jax.voting import cohens_kappa

    test = arithmetic.generate("test", num_test, **arithmetic.DEMO_WORLD)
    correct = {}
    for family, directory in build_all(families).items():
        record = json.loads((directory / RECORD_FILE).read_text())
        for temperature in (0.6, 0.0):
            correct[family, temperature] = measure_accuracy(directory, test, temperature=temperature)
        print(f"demo:{family}: built in {record['build_seconds']} s, SFT loss {record['sft_losses'][0]:.3f} -> "
              f"{record['sft_losses'][-1]:.3f}; test accuracy T=0.6 {correct[family, 0.6].mean():.3f}, "
              f"greedy {correct[family, 0.0].mean():.3f} ({len(test)} problems)", flush=True)
    print("Cohen's kappa of per-problem correctness at T=0.6 (lower = more different errors):")
    print("        " + "".join(f"{f:>8}" for f in families))
    for a in families:
        print(f"{a:>8}" + "".join(f"{cohens_kappa(correct[a, 0.6], correct[b, 0.6]):8.3f}" for b in families))
    return correct


if __name__ == "__main__":
    from absl import app, flags

    _FAMILIES = flags.DEFINE_list("families", list(registry.FAMILIES), "families to build and measure")
    _NUM_TEST = flags.DEFINE_integer("num_test", arithmetic.DEFAULT_SIZES["test"], "test problems to measure on")

    def _main(argv):
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments {argv[1:]}; use --families and --num_test")
        report(_FAMILIES.value, _NUM_TEST.value)

    app.run(_main)
