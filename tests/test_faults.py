"""Faults and resume (issue 20): corrupted checkpoints, used workdirs, changed configs, bad input, SIGINT/SIGTERM.

Most runs are in-process `corl_jax.train.run` calls (the CLI's own path after flag parsing) on the one-agent `ttrl`
`:tiny` config, sharing one uninterrupted reference run; only the SIGTERM test and the flag errors need a process.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from config_files import load_config
from corl_jax import workdir as run_dir
from corl_jax.checkpointing import Checkpointer, fingerprint
from corl_jax.cohort import Cohort, check_prompt_lengths, load_agents
from corl_jax.config import ConfigError, validate
from corl_jax.data import load_problems
from corl_jax.registry import resolve_model_path
from corl_jax.train import run
from test_train import REPO, final_state

STEPS = 4


@pytest.fixture(autouse=True)
def _zoo_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("CORL_JAX_CACHE", str(tmp_path_factory.getbasetemp() / "zoo_cache"))


def tiny(**train):
    config = load_config("ttrl")
    config.train.update(dict(max_steps=STEPS, eval_on_start=False, eval_every=100, save_every=1), **train)
    return config


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted run that saves every step (its compiled programs go to the session's persistent cache, where
    the SIGTERM test's trainer subprocess, same devices and config, reads them)."""
    workdir = tmp_path_factory.mktemp("straight")
    with pytest.MonkeyPatch.context() as m:
        m.setenv("CORL_JAX_CACHE", str(tmp_path_factory.getbasetemp() / "zoo_cache"))
        assert run(tiny(), str(workdir)) == 0
    return workdir


def assert_same_final_state(a, b):
    for x, y in zip(jax.tree.leaves(final_state(a)), jax.tree.leaves(final_state(b)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def flip_bytes(step_dir, count=400):
    """The issue's damage: `count` flipped bytes in the largest array-data file of a step."""
    files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(step_dir, "state")) for f in fs]
    target = max(files, key=os.path.getsize)
    data = bytearray(open(target, "rb").read())
    for i in random.Random(0).sample(range(len(data) // 4, len(data)), count):
        data[i] ^= 0xFF
    open(target, "wb").write(data)


# ------------------------------------------------------------------------------------------------------ item 1


def test_damaged_latest_checkpoint_is_set_aside_and_the_run_redone_exactly(straight, tmp_path, capsys):
    workdir = tmp_path / "run"
    shutil.copytree(straight, workdir)
    flip_bytes(workdir / "checkpoints" / str(STEPS))
    assert run(tiny(), str(workdir)) == 3  # finished, but not silently
    err = capsys.readouterr().err
    assert f"checkpoint step {STEPS} was damaged" in err and "resumed from step 3" in err
    assert "Traceback" not in err and "Event loop is closed" not in err and "TensorStore({" not in err
    (moved,) = os.listdir(workdir / "rejected_checkpoints")  # never deleted
    assert moved.startswith(f"{STEPS}-")
    assert_same_final_state(straight, workdir)  # redone from step 3: the same weights as the uninterrupted run
    summary = json.loads((workdir / "summary.json").read_text())
    assert len(summary["faults"]) == 1
    assert summary["agents"] == json.loads((straight / "summary.json").read_text())["agents"]  # bests included
    history = [json.loads(line) for line in (workdir / "config_history.jsonl").read_text().splitlines()]
    assert [h["start_step"] for h in history] == [0, 3]


def test_damaged_checkpoint_without_fallback_is_one_clear_line(straight, tmp_path, capsys):
    workdir = tmp_path / "run"
    shutil.copytree(straight, workdir)
    for step in os.listdir(workdir / "checkpoints"):
        flip_bytes(workdir / "checkpoints" / step)
    assert run(tiny(fallback_to_previous=False), str(workdir)) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: cannot restore") and f"checkpoints/{STEPS}: " in line and "restart=True" in line
    assert sorted(os.listdir(workdir / "checkpoints")) == sorted(os.listdir(straight / "checkpoints"))


# ------------------------------------------------------------------------------------------------- items 2, 3


def test_used_workdir_is_refused_unless_restarted_and_then_moved_aside(straight, tmp_path, capsys):
    workdir = tmp_path / "run"
    shutil.copytree(straight, workdir)
    before = sorted(os.listdir(workdir))
    assert run(tiny(resume=False), str(workdir)) == 2
    assert "already holds a run" in capsys.readouterr().err and sorted(os.listdir(workdir)) == before
    assert run_dir.prepare(tiny(restart=True), str(workdir)) == {}
    (previous,) = os.listdir(workdir)
    assert previous.startswith("previous-") and sorted(os.listdir(workdir / previous)) == before


def test_config_changes_on_resume_are_listed_allowed_or_refused(straight, tmp_path, capsys):
    workdir = tmp_path / "run"
    shutil.copytree(straight, workdir)
    changed = tiny()
    changed.optim.learning_rate = 5e-4
    changed.agents.qwen25.model_path = "tiny:llama"
    changed.agents.qwen25.family = "llama"
    assert run(changed, str(workdir)) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "optim.learning_rate 0.001 -> 0.0005" in line and "agents.qwen25.model_path" in line
    assert "new --workdir" in line and "restart=True" in line and "delete" not in line
    safe = tiny(max_steps=6, eval_every=3, keep_last=1)
    assert run_dir.prepare(safe, str(workdir)) == {
        "train.eval_every": (100, 3), "train.keep_last": (2, 1), "train.max_steps": (STEPS, 6)}
    saved = json.loads(tiny().to_json_best_effort())
    del saved["train"]["restart"], saved["train"]["fallback_to_previous"]  # written before those keys existed
    assert run_dir.config_changes(saved, json.loads(tiny().to_json_best_effort())) == {}


# ------------------------------------------------------------------------------------------------------ item 5


@pytest.mark.parametrize("key, value", [
    ("train.save_every", 0), ("train.eval_every", 0), ("grpo.micro_batch_size", 0), ("grpo.micro_batch_size", -2),
    ("rollout.max_new_tokens", 0), ("train.eval_batch_prompts", 0), ("grpo.logprob_chunk_size", 0),
    ("train.eval_max_new_tokens", 0), ("train.keep_last", 0), ("agents.qwen25.family", "llama"),
    ("agents.qwen25.family", "gpt2"), ("agents.qwen25.param_dtype", "float16"), ("optim.learning_rate", 0.0),
])
def test_bad_settings_are_named_before_any_model_loads(key, value):
    config = tiny()
    section, *rest = key.split(".")
    node = config[section]
    for part in rest[:-1]:
        node = node[part]
    node[rest[-1]] = value
    with pytest.raises(ConfigError, match=rf"config\.{key}: "):
        validate(config)


def test_over_long_prompt_is_named_by_its_file_row_then_skipped_on_request(tmp_path, capsys, caplog):
    rows = [{"problem": "What is 1+1?", "answer": "2"}, {"problem": "Add " + "1+" * 300 + "1.", "answer": "301"},
            {"problem": "What is 2+2?", "answer": "4"}]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tiny()
    config.data.update(train_path=str(data), holdout_size=0)
    assert run(config, str(tmp_path / "run")) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"{data}: row 1: its prompt has" in line and "rollout.max_prompt_len=384" in line
    assert "skip_bad_rows" in line and not (tmp_path / "run" / "checkpoints").exists()  # before the first step
    agents = load_agents(config, 1)
    problems = load_problems(str(data))
    kept = check_prompt_lengths(agents, problems, max_prompt_len=384, skip_bad_rows=True)
    assert [p.id for p in kept] == [0, 2] and "dropped 1 such rows of 3" in caplog.text


def test_tokenizer_larger_than_the_model_vocabulary_is_named(tmp_path):
    from corl_jax.tokenization import load_tokenizer

    model_dir = tmp_path / "model"
    shutil.copytree(resolve_model_path("tiny:qwen2"), model_dir)
    tokenizer = load_tokenizer(model_dir)
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(400)])
    tokenizer.save_pretrained(model_dir)
    config = tiny()
    config.agents.qwen25.model_path = str(model_dir)
    with pytest.raises(ConfigError, match=r"agents\.qwen25\.model_path: the tokenizer in .* has \d+ tokens but the "
                                          r"model's vocab_size is 320"):
        load_agents(config, 1)


def test_cli_input_errors_are_one_line_and_exit_2(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    cases = [("--config=configs/nosuch.py", "config file configs/nosuch.py does not exist"),
             ("--config=configs/ttrl.py:huge", "unknown config variant 'huge'"),
             ("--config=configs/ttrl.py:tiny --config.nosection.x=1", "config.nosection is not a key of this config"),
             (f"--config=configs/ttrl.py:tiny --workdir={a_file}", "is a file, not a directory")]
    procs = [subprocess.Popen([sys.executable, "-m", "corl_jax.train", f"--workdir={tmp_path / 'run'}", *args.split()],
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for args, _ in cases]  # side by side: each is mostly start-up
    for proc, (args, message) in zip(procs, cases, strict=True):
        stderr = proc.communicate(timeout=300)[1]
        assert proc.returncode == 2, (args, stderr)
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (args, stderr)


# ------------------------------------------------------------------------------------------------------ item 6


def test_sigint_finishes_the_step_saves_it_and_stops(tmp_path, monkeypatch, capsys):
    real_step = Cohort.step

    def step_then_ctrl_c(self, block, step):
        out = real_step(self, block, step)
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # arrives while the step is still being logged
        return out

    monkeypatch.setattr(Cohort, "step", step_then_ctrl_c)
    inherited = signal.getsignal(signal.SIGINT)  # SIG_IGN where the suite runs as a background job
    assert run(tiny(save_every=100), str(tmp_path)) == 130  # step 2 is saved only because of the signal
    assert "stopped by SIGINT after step 2; its checkpoint is saved" in capsys.readouterr().err
    assert Checkpointer(str(tmp_path)).all_steps() == [2]
    assert signal.getsignal(signal.SIGINT) is inherited  # handlers given back
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # and no evaluation was started after the signal


def test_sigterm_saves_then_exits_143_and_resumes_exactly(straight, tmp_path):
    overrides = [f"--config.train.max_steps={STEPS}", "--config.train.eval_on_start=False",
                 "--config.train.eval_every=100", "--config.train.save_every=100"]
    cmd = [sys.executable, "-m", "corl_jax.train", "--config=configs/ttrl.py:tiny", f"--workdir={tmp_path}",
           *overrides]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics, deadline = tmp_path / "metrics.jsonl", time.time() + 600
    while not (metrics.exists() and metrics.read_text().strip()):  # the first step is logged
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 143, out
    (step,) = Checkpointer(str(tmp_path)).all_steps()
    assert 1 <= step < STEPS and f"stopped by SIGTERM after step {step}; its checkpoint is saved" in out
    assert run(tiny(save_every=100), str(tmp_path)) == 0
    assert_same_final_state(straight, tmp_path)


def test_resume_frees_the_initial_state_before_reading_the_checkpoint(straight):
    """At paper sizes the fresh state and the restored one do not fit a device together (an H100 ran out of memory
    restoring the 8.3B-parameter ring3): the resume releases the initial buffers first, and restores exactly."""
    from corl_jax.data import PromptStream, load_train_and_eval
    from corl_jax.loop import _restore

    config = tiny()
    cohort = Cohort(config, load_agents(config, STEPS))
    initial = jax.tree.leaves([(a.params, a.opt_state) for a in cohort.agents])
    stream = PromptStream(load_train_and_eval(config.data)[0], config.rollout.prompts_per_step, config.data_seed)
    with Checkpointer(str(straight)) as checkpointer:
        step, *_ = _restore(checkpointer, cohort, stream, fallback=False)
    assert step == STEPS and initial and all(x.is_deleted() for x in initial)
    restored = {a.name: {"params": a.params, "opt_state": a.opt_state} for a in cohort.agents}
    assert fingerprint(restored) == fingerprint(final_state(straight))  # by array path: every bit equal
