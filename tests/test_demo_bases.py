"""demo bases: reduced builds (a few SFT steps) of each family into a temporary cache.

Checks that each is an HF checkpoint transformers loads with our logits, that the families' tokenizers
differ, that SFT lowers the loss, that the SFT rows put the loss on the solution only, and that the build
is cached and atomic. The full build (minutes) is not run here.
"""

import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import corl_jax.models as models
from config_files import load_config
from corl_jax import registry
from corl_jax.config import validate
from corl_jax.demo import arithmetic, checkpoints
from corl_jax.demo import bases as demo_bases
from corl_jax.loop import train
from corl_jax.tokenization import chat_prompt, encode_prompts
from hf_tiny import hf_logits

FAMILIES = registry.FAMILIES
REDUCED = dict(num_examples=64, steps=10, batch_size=8)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A temporary CORL_JAX_CACHE with reduced recipes; yields family -> built directory."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CORL_JAX_CACHE", str(tmp_path_factory.mktemp("cache")))
        for family in FAMILIES:
            mp.setitem(demo_bases.RECIPES, family, dataclasses.replace(demo_bases.RECIPES[family], **REDUCED))
        yield demo_bases.build_all()


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_loads_in_transformers_with_our_logits(cache, family):
    directory = cache[family]
    assert directory == checkpoints.cache_root() / "zoo" / f"demo-{family}-{demo_bases.recipe_key(demo_bases.RECIPES[family])}"
    assert registry.resolve_model_path(f"demo:{family}") == str(directory)
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (directory / name).is_file(), name
    policy = models.from_pretrained(directory, dtype=jnp.float32)
    problems = arithmetic.generate("test", 2)
    ids, mask = encode_prompts(policy.tokenizer, [p.text for p in problems], bucket=8)
    ours = np.asarray(models.logits(policy, ids, mask))
    theirs = hf_logits(directory, ids, mask)
    assert np.abs(ours - theirs)[mask].max() <= 1e-4


def test_families_differ_in_tokenizer_architecture_and_parameter_count(cache):
    policies = {f: models.from_pretrained(d, dtype=jnp.float32) for f, d in cache.items()}
    text = arithmetic.generate("test", 1)[0].text
    prompts = {f: p.tokenizer(chat_prompt(p.tokenizer, text), add_special_tokens=False)["input_ids"]
               for f, p in policies.items()}
    assert len({r.vocab_size for r in demo_bases.RECIPES.values()}) == len(FAMILIES)  # (the reduced corpus saturates)
    first_number_piece = {f: p.tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str("1234")[0][0]
                          for f, p in policies.items()}  # Qwen: single digits; Llama 3: groups of up to three
    assert first_number_piece == {"qwen2": "1", "llama": "123", "qwen3": "1"}
    assert policies["qwen2"].tokenizer.decode(prompts["qwen2"]) == chat_prompt(policies["qwen2"].tokenizer, text)
    sizes = {sum(x.size for x in jax.tree.leaves(nnx.state(p.model, nnx.Param))) for p in policies.values()}
    assert len(sizes) == len(FAMILIES)  # qkv biases (qwen2), q/k norms (qwen3), untied unembedding (llama)
    assert {f: p.config.num_layers for f, p in policies.items()} == {"qwen2": 4, "llama": 4, "qwen3": 3}
    assert {f: p.config.model_type for f, p in policies.items()} == {"qwen2": "qwen2", "llama": "llama",
                                                                     "qwen3": "qwen3"}


@pytest.mark.parametrize("family", FAMILIES)
def test_sft_lowered_the_loss(cache, family):
    record = json.loads((cache[family] / demo_bases.RECORD_FILE).read_text())
    losses = record["sft_losses"]
    assert len(losses) == REDUCED["steps"] and np.isfinite(losses).all()
    assert np.mean(losses[-3:]) < losses[0] - 0.5


def test_sft_rows_put_the_loss_on_solution_and_eos_only(cache):
    policy = models.from_pretrained(cache["llama"], dtype=jnp.float32)
    tokenizer = policy.tokenizer
    problems = arithmetic.generate("sft", 3, seed=5)
    ids, loss_mask = demo_bases.sft_examples(tokenizer, problems)
    for row, keep, problem in zip(ids, loss_mask, problems):
        answer = row[keep].tolist()
        assert answer[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(answer[:-1]) == problem.solution
        start = int(np.argmax(keep))
        assert tokenizer.decode(row[:start].tolist()) == chat_prompt(tokenizer, problem.text)
        assert not keep[start + len(answer):].any()
    with pytest.raises(ValueError, match="worked solutions"):
        demo_bases.sft_examples(tokenizer, arithmetic.generate("test", 1))


def test_a_changed_recipe_gets_its_own_cache_directory(cache, monkeypatch):
    family = "llama"
    monkeypatch.setitem(demo_bases.RECIPES, family, dataclasses.replace(demo_bases.RECIPES[family], steps=11))
    monkeypatch.setattr(demo_bases, "build_demo_base", lambda directory, family: (directory / "config.json").touch())
    rebuilt = demo_bases.demo_base_dir(family)
    assert rebuilt != cache[family] and rebuilt.name.startswith(f"demo-{family}-")
    assert (cache[family] / "model.safetensors").is_file()  # the other recipe's base is left as it was


def test_build_is_cached_and_atomic(cache, monkeypatch, tmp_path):

    def fail(directory, family, **overrides):
        (directory / "config.json").write_text("{}")  # a half-written checkpoint
        raise RuntimeError("build interrupted")

    monkeypatch.setattr(demo_bases, "build_demo_base", fail)
    assert demo_bases.demo_base_dir("qwen3") == cache["qwen3"]  # cached: no rebuild
    monkeypatch.setenv("CORL_JAX_CACHE", str(tmp_path))
    with pytest.raises(RuntimeError, match="interrupted"):
        demo_bases.demo_base_dir("qwen3")
    assert not any((checkpoints.cache_root() / "zoo").iterdir())  # no directory, complete or partial, was left
    with pytest.raises(ValueError, match="unknown family"):
        demo_bases.demo_base_dir("gpt2")


@pytest.mark.parametrize("family", FAMILIES)
def test_side_by_side_builds_match_an_in_process_build_bit_for_bit(cache, monkeypatch, tmp_path, family):
    """build_all builds missing bases in single-threaded child processes; the same recipe built here, in this
    multi-threaded process, writes the same weights."""
    demo_bases.build_demo_base(tmp_path / "here", family)
    monkeypatch.setenv("CORL_JAX_CACHE", str(tmp_path / "cache"))
    demo_bases._build_in_subprocess(family, slot=0)
    child = demo_bases.demo_base_dir(family)
    assert child.parent == tmp_path / "cache" / "zoo"
    assert (child / "model.safetensors").read_bytes() == (tmp_path / "here" / "model.safetensors").read_bytes()


def test_a_failed_side_by_side_build_names_the_base_and_caches_nothing(cache, monkeypatch, tmp_path):
    monkeypatch.setenv("CORL_JAX_CACHE", str(tmp_path))
    monkeypatch.setitem(demo_bases.RECIPES, "qwen2", dataclasses.replace(demo_bases.RECIPES["qwen2"], tokenizer="?"))
    with pytest.raises(RuntimeError, match="building the demo:qwen2 base failed .* builds it again"):
        demo_bases.build_all(["qwen2", "qwen3"], workers=2)
    assert [p.name for p in (tmp_path / "zoo").iterdir()] == [demo_bases._cache_dir("qwen3").name]  # the other worker's


def test_side_by_side_builds_give_the_next_base_to_the_first_free_worker(monkeypatch, tmp_path):
    """Longest recipe first; the third base goes to whichever worker finishes first, not to a lane fixed up front."""
    monkeypatch.setenv("CORL_JAX_CACHE", str(tmp_path))
    # qwen2 and qwen3 tie on cost (steps x batch), as in the default; lanes fixed up front by cost would put llama
    # behind qwen2
    for family, steps in (("qwen2", 20), ("qwen3", 20), ("llama", 10)):
        monkeypatch.setitem(demo_bases.RECIPES, family, dataclasses.replace(demo_bases.RECIPES[family], steps=steps))
    seconds = {"qwen2": 1.0, "qwen3": 0.1, "llama": 0.1}  # qwen3 finishes long before qwen2
    events = []

    def fake_build(family, slot):
        events.append(("start", family, slot))
        time.sleep(seconds[family])
        directory = demo_bases._cache_dir(family)
        directory.mkdir(parents=True)
        (directory / "config.json").write_text("{}")
        events.append(("end", family, slot))

    monkeypatch.setattr(demo_bases, "_build_in_subprocess", fake_build)
    built = demo_bases.build_all(["qwen2", "llama", "qwen3"], workers=2)
    assert sorted(built) == ["llama", "qwen2", "qwen3"]
    (_, first, slot_a), (_, second, slot_b) = events[:2]  # the two threads may start in either order
    assert {first, second} == {"qwen2", "qwen3"} and {slot_a, slot_b} == {0, 1}
    qwen3_slot = slot_a if first == "qwen3" else slot_b
    assert events.index(("start", "llama", qwen3_slot)) == events.index(("end", "qwen3", qwen3_slot)) + 1
    assert events[-1] == ("end", "qwen2", 1 - qwen3_slot)


def test_report_measures_each_family_on_the_same_problems(cache, capsys):
    correct = demo_bases.report(FAMILIES, num_test=3)
    assert sorted(correct) == sorted((f, t) for f in FAMILIES for t in (0.6, 0.0))
    assert all(c.dtype == bool and c.shape == (3,) for c in correct.values())
    out = capsys.readouterr().out
    assert all(f"demo:{f}: built in" in out for f in FAMILIES) and "Cohen's kappa" in out


def test_ring3_demo_variant_trains_on_the_bases(cache, tmp_path):
    """A short version of the embedded default: configs/ring3.py:demo on the (reduced) demo bases, 2 steps."""
    config = load_config("ring3", "demo")
    assert sorted(a.model_path for a in config.agents.values()) == sorted(f"demo:{f}" for f in FAMILIES)
    config.rollout.update(prompts_per_step=2, num_generations=4, max_new_tokens=24)
    config.grpo.micro_batch_size = 8
    config.train.update(max_steps=2, eval_every=2, eval_max_new_tokens=24, save_every=2)
    config.data.max_eval_samples = 8
    validate(config)
    summary = train(config, str(tmp_path))
    assert summary["steps"] == 2 and set(summary["agents"]) == set(config.agents.keys())
    assert all(0.0 <= s["final_accuracy"] <= 1.0 for s in summary["agents"].values())


def test_majority_correct_follows_the_reference_vote():
    """Plurality of the parseable answers, ties to the first seen, unparseable completions ignored."""
    from corl_jax.data import Problem

    problems = [Problem(i, "q", answer, "t") for i, answer in enumerate(["3", "4", "5", "6"])]
    texts = [
        ["\\boxed{3}", "\\boxed{4}", "so \\boxed{3}"],    # plurality right
        ["\\boxed{7}", "\\boxed{4}", "no idea"],          # tie 7/4: the first seen (7) wins, wrong
        ["no idea", "nothing", "\\boxed{5}"],            # one parseable, right
        ["no idea", "still none", "hmm"],                 # nothing parseable
    ]
    np.testing.assert_array_equal(demo_bases.majority_correct(texts, problems), [True, False, True, False])
