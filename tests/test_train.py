"""End-to-end training: every config's `:tiny` variant, the CLI, resume after SIGKILL, and bad input."""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from config_files import load_config
from corl_jax import grpo
from corl_jax.checkpointing import Checkpointer
from corl_jax.config import validate
from corl_jax.loop import train

REPO = Path(__file__).resolve().parents[1]
CONFIGS = ["ring3", "pair_same_family", "pair_different_family", "different_family_plus", "ttrl", "gt_reward",
           "rent", "intuitor", "code_pair"]


@pytest.fixture(autouse=True)
def _zoo_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("CORL_JAX_CACHE", str(tmp_path_factory.getbasetemp() / "zoo_cache"))


def final_state(workdir) -> dict:
    with Checkpointer(str(workdir)) as c:
        return c.restore(c.latest_step()).state


@pytest.mark.parametrize("name", CONFIGS)
def test_tiny_variant_runs_end_to_end(name, tmp_path):
    config = load_config(name)
    validate(config)
    summary = train(config, str(tmp_path))
    steps = config.train.max_steps
    assert summary["steps"] == steps
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert set(on_disk["agents"]) == set(config.agents.keys())
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    kept = Checkpointer(str(tmp_path)).all_steps()
    for agent, s in on_disk["agents"].items():
        evals = [(r["step"], r[f"{agent}/eval_reward"]) for r in lines if f"{agent}/eval_reward" in r]
        assert [step for step, _ in evals] == [0, 2, 3] and 0.0 <= s["initial_accuracy"] <= 1.0
        best = max(evals, key=lambda e: e[1])  # the first of the greatest accuracies
        assert (s["best_step"], s["best_accuracy"], s["best_is_base"]) == (best[0], best[1], best[0] == 0)
        assert s["best_step"] == 0 or s["best_step"] in kept  # its weights survive keep_last
    train_steps = sorted({row["step"] for row in lines if any(k.endswith("/loss") for k in row)})
    assert train_steps == list(range(1, steps + 1))
    row = next(r for r in lines if r["step"] == 1 and any(k.endswith("/loss") for k in r))
    agent = next(iter(config.agents.keys()))
    for key in ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
                "completions/clipped_ratio", "entropy", "clip_ratio/region_mean", "grad_norm", "learning_rate",
                "time/sampling", "time/update", "num_tokens", "completions/mean_terminated_length",
                "clip_ratio/low_min", "clip_ratio/high_max", "sampling/importance_sampling_ratio/mean",
                "sampling/sampling_logp_difference/max"):
        assert f"{agent}/{key}" in row, key
    reward_name = {"rent": "reward_entropy", "intuitor": "reward_self_certainty"}.get(config.method,
                                                                                     "reward_correctness")
    assert row[f"{agent}/rewards/{reward_name}/mean"] == row[f"{agent}/reward"]
    if config.method in ("rent", "intuitor"):
        kind = "entropy" if config.method == "rent" else "self_certainty"
        assert row[f"{agent}/intrinsic/{kind}/avg"] == pytest.approx(row[f"{agent}/reward"])
    split = ("time/rewards",) if config.method in ("rent", "intuitor") else ("time/answers", "time/vote")
    assert all(f"{agent}/{key}" in row for key in split)
    if config.method == "co_rl":
        assert f"{agent}/co_labeling/labeled_fraction_me" in row
        records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
        assert len(records) == steps * config.rollout.prompts_per_step * len(config.agents)
        if config.task == "code":  # oracle key: the outputs of HumanEval's canonical solution, run in the sandbox
            gt = {r["prompt_id"]: r["gt"] for r in records}
            assert gt[0] == "('True', 'False', 'True', 'False', 'True', 'True', 'False')"
            assert len(gt) == 2 and "'(()(())((())))'" in gt[1]
        if name == "ring3":  # the reference's ring: Qwen2.5 <- Llama <- Qwen3 <- Qwen2.5, in the file's order
            names = list(config.agents.keys())
            assert names == ["qwen25", "llama32", "qwen3"]
            label = {(r["step"], r["prompt_id"], r["agent"]): r["label"] for r in records}
            for r in records:
                teacher = names[(names.index(r["agent"]) + 1) % len(names)]
                assert r["teacher_label"] == label[r["step"], r["prompt_id"], teacher]
    assert (tmp_path / "tensorboard").is_dir() and any((tmp_path / "tensorboard").iterdir())
    assert Checkpointer(str(tmp_path)).latest_step() == steps


def test_parameters_change_and_stay_finite(tmp_path):
    # RENT's entropy reward differs between any two completions, so every group has a learning signal even with
    # random tiny models (whose vote-based rewards are mostly all-zero groups, hence zero gradients).
    config = load_config("rent")
    config.optim.learning_rate = 1e-2
    config.optim.warmup_ratio = 0.0
    train(config, str(tmp_path / "run"))
    from corl_jax.cohort import load_agents

    initial = {a.name: a.params for a in load_agents(config, config.train.max_steps)}
    final = final_state(tmp_path / "run")
    for name, params in initial.items():
        diffs = [float(np.abs(np.asarray(a) - np.asarray(b)).max())
                 for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(final[name]["params"]), strict=True)]
        assert max(diffs) > 0, f"agent {name} did not move"
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(final[name]["params"]))


def _cli(workdir, *overrides, **kwargs):
    """The trainer CLI on ring3:tiny (its programs go to, and come from, the session's compilation cache)."""
    cmd = [sys.executable, "-m", "corl_jax.train", "--config=configs/ring3.py:tiny", f"--workdir={workdir}",
           *overrides]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)


def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path):
    steps = ("--config.train.max_steps=5", "--config.train.save_every=1", "--config.train.eval_every=100",
             "--config.train.eval_on_start=False")
    reference = _cli(tmp_path / "straight", *steps)
    out, _ = reference.communicate(timeout=900)
    assert reference.returncode == 0, out

    interrupted = _cli(tmp_path / "killed", *steps)
    checkpoints = tmp_path / "killed" / "checkpoints"
    deadline = time.time() + 600
    while not (checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir())):
        assert interrupted.poll() is None and time.time() < deadline, interrupted.communicate()[0]
        time.sleep(0.2)
    time.sleep(random.Random(0).uniform(0.0, 3.0))  # somewhere inside a later step or save
    interrupted.send_signal(signal.SIGKILL)
    assert interrupted.wait() == -signal.SIGKILL, "the run ended before the kill: it tests no resume"
    assert Checkpointer(str(tmp_path / "killed")).latest_step() < 5
    resumed = _cli(tmp_path / "killed", *steps)
    out, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, out

    a, b = final_state(tmp_path / "straight"), final_state(tmp_path / "killed")
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    rows = [json.loads(line) for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in rows if any(k.endswith("/loss") for k in r)) == [1, 2, 3, 4, 5]


def test_unknown_config_key_is_named(tmp_path):
    proc = _cli(tmp_path, "--config.rollout.num_generationz=4")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2
    assert out.startswith("error: config.rollout.num_generationz is not a key of this config (did you mean "
                          "config.rollout.num_generations?). Fix: use a key of config.rollout: ")
    assert "top_p" in out and "corl_jax/config.py" in out and len(out.strip().splitlines()) == 1


@pytest.mark.parametrize("key, message", [
    ("rollout.top_p", None),
    ("agents.llama32.family", None),
    ("rollout.topp", r"config\.rollout\.topp is not a key .*\(did you mean config\.rollout\.top_p or "
                     r"config\.rollout\.top_k\?\)\. Fix: use a key of config\.rollout: .*min_p.*; "
                     r"base_config\(\) in corl_jax/config\.py"),
    ("agents.llama3.family", r"config\.agents\.llama3 is not .*did you mean config\.agents\.llama32\?.*"
                             r"config\.agents: qwen25, llama32, qwen3;"),
    ("nosection.x", r"^config\.nosection is not a key of this config\. Fix: use a key of config: agents, code,"),
    ("seed.x", r"config\.seed is a value, not a section.*override config\.seed itself"),
])
def test_unknown_override_key_names_nearest_and_valid_keys(key, message):
    from corl_jax.config import unknown_key_error

    error = unknown_key_error(load_config("ring3"), key)
    assert error is None if message is None else re.search(message, error), error


@pytest.mark.parametrize("override, message", [
    (dict(num_generations=1), "rollout.num_generations"),
    (dict(prompts_per_step=0), "rollout.prompts_per_step"),
])
def test_bad_rollout_settings(override, message):
    config = load_config("ring3")
    config.rollout.update(override)
    with pytest.raises(ValueError, match=message):
        validate(config)


@pytest.mark.parametrize("override, message", [
    (dict(remat="all"), "grpo.remat: unknown policy .all.*dots_no_batch"),
    (dict(attention="flash"), "grpo.attention: unknown implementation 'flash'.*cudnn"),
])
def test_bad_grpo_settings(override, message):
    config = load_config("ring3")
    config.grpo.update(override)
    with pytest.raises(ValueError, match=message):
        validate(config)


def test_co_rl_needs_two_agents():
    config = load_config("ring3")
    for name in list(config.agents.keys())[1:]:
        del config.agents[name]
    with pytest.raises(ValueError, match="at least 2 agents"):
        validate(config)


def test_rows_lacking_fields_are_named(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n" + json.dumps({"answer": "3"}) + "\n")
    config = load_config("ring3")
    config.data.train_path = str(data)
    config.data.holdout_size = 0
    with pytest.raises(ValueError, match=r"row 1"):
        train(config, str(tmp_path / "run"))


def test_nonfinite_updates_are_skipped_then_abort(tmp_path, monkeypatch):
    real = grpo.grpo_loss

    def poisoned(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        return loss * np.float32("nan"), metrics

    monkeypatch.setattr(grpo, "grpo_loss", poisoned)
    config = load_config("pair_same_family")
    config.grpo.eps_low = 0.19  # a fresh compilation that traces the poisoned loss
    config.train.update(max_nonfinite_updates=1, save_every=1, eval_on_start=False, eval_every=100)
    with pytest.raises(FloatingPointError, match="max_nonfinite_updates"):
        train(config, str(tmp_path))
    from corl_jax.cohort import load_agents

    initial = {a.name: a.params for a in load_agents(config, config.train.max_steps)}
    saved = final_state(tmp_path)  # the step-1 checkpoint survives the abort
    for name, params in initial.items():
        for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(saved[name]["params"])):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("placement, mesh", [("partitioned", dict(data=-1, fsdp=1, tensor=1)),
                                             ("shared", dict(data=2, fsdp=2, tensor=2))])
def test_placements_on_eight_devices(placement, mesh, tmp_path):
    assert jax.device_count() == 8  # tests/conftest.py fakes 8 CPU devices
    config = load_config("pair_different_family")
    config.placement = placement
    config.mesh.update(mesh)
    config.train.update(max_steps=2, eval_every=100, eval_on_start=False)
    from corl_jax.cohort import load_agents

    agents = load_agents(config, config.train.max_steps)
    device_sets = [set(a.mesh.devices.flat) for a in agents]
    if placement == "partitioned":
        assert device_sets[0].isdisjoint(device_sets[1]) and all(len(d) == 4 for d in device_sets)
    else:
        assert device_sets[0] == device_sets[1] and len(device_sets[0]) == 8
    for agent in agents:  # AdamW's moments placed like their parameters
        mu = agent.opt_state[1][0].mu
        assert [x.sharding for x in jax.tree.leaves(mu)] == [x.sharding for x in jax.tree.leaves(agent.params)]
    summary = train(config, str(tmp_path))
    assert summary["steps"] == 2
    for name, state in final_state(tmp_path).items():
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state["params"])), name


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_truncated_completions_masked_on_request(mask_truncated):
    from corl_jax.cohort import Cohort, Rollouts, load_agents
    from corl_jax.sampling import Completions

    config = load_config("ttrl")
    config.grpo.mask_truncated_completions = mask_truncated
    agent = load_agents(config, 1)[0]
    cohort = Cohort(config, [agent])
    g, t = config.rollout.num_generations, 5
    truncated = np.array([True, False] * (g // 2) * config.rollout.prompts_per_step)
    rows = truncated.size
    completions = Completions(tokens=jnp.ones((rows, t), jnp.int32), mask=jnp.ones((rows, t), bool),
                              logprobs=jnp.zeros((rows, t)), lengths=jnp.full((rows,), t),
                              truncated=jnp.asarray(truncated))
    prompts = np.ones((config.rollout.prompts_per_step, 3), np.int32)
    batch = cohort._batch(agent, Rollouts(prompts, prompts.astype(bool), completions))
    loss_rows = np.asarray(batch["completion_mask"]).sum(axis=1)
    expected = np.where(truncated & mask_truncated, 0, t)
    np.testing.assert_array_equal(loss_rows, expected)
    assert np.asarray(batch["attention"]).all()  # masking the loss never hides tokens from attention


@pytest.mark.parametrize("samples_per_prompt", [1, 3])
def test_eval_accuracy_is_the_mean_over_samples_of_each_prompt(samples_per_prompt, monkeypatch):
    """Rows come back prompt-major (row p*k + j). Every row answers its own prompt's gold except the first sample of
    each even-numbered problem, so accuracy = 1 - 3 / (6 * k) for 6 problems."""
    from corl_jax.cohort import Cohort, load_agents
    from corl_jax.demo import arithmetic
    from corl_jax.loop import evaluate

    k = samples_per_prompt
    config = load_config("gt_reward")
    config.train.update(eval_samples_per_prompt=k, eval_batch_prompts=4)  # two chunks: 4 + 2 prompts
    cohort = Cohort(config, load_agents(config, 1))
    problems = arithmetic.generate("test", 6)
    index = {p.text: n for n, p in enumerate(problems)}
    prompts = []
    real_sample, real_finish = Cohort.sample, Cohort.finish

    def sample(self, agent, texts, key, **kwargs):
        prompts[:] = texts
        return real_sample(self, agent, texts, key, **kwargs)

    def finish(self, agent, rollouts):
        rollouts = real_finish(self, agent, rollouts)
        owners = [index[prompts[row // k]] for row in range(len(rollouts.texts))]
        rollouts.texts = ["no answer" if row % k == 0 and n % 2 == 0 else f"\\boxed{{{problems[n].answer}}}"
                          for row, n in enumerate(owners)]
        return rollouts

    monkeypatch.setattr(Cohort, "sample", sample)
    monkeypatch.setattr(Cohort, "finish", finish)
    assert evaluate(cohort, problems, 0)["qwen25"] == pytest.approx(1 - 3 / (6 * k))
