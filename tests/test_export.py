"""Reading runs back (corl_jax.runs) and exporting agents (corl_jax.export): each agent's own best step survives
keep_last and resolves per agent, exported checkpoints match transformers' logits for all three families, exports
are byte-deterministic, and bad input is one clear line."""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from config_files import load_config
from corl_jax import loop
from corl_jax.checkpointing import Checkpointer
from corl_jax.cohort import Cohort
from corl_jax.export import export
from corl_jax.models import logits
from corl_jax.runs import RunError, load_agent, open_run
from hf_tiny import hf_logits

REPO = Path(__file__).resolve().parents[1]
# Scripted eval accuracy per step (qwen25, llama32, qwen3): qwen25 peaks at step 1 (an off-schedule save; its tie at
# step 3 keeps step 1), llama32 at step 3, qwen3 never beats step 0 (its tie at step 4 keeps the base).
SCRIPT = {0: (0.3, 0.3, 0.5), 1: (0.5, 0.2, 0.4), 2: (0.4, 0.4, 0.4), 3: (0.5, 0.6, 0.1), 4: (0.2, 0.6, 0.5)}


def scripted_step(self, block, step):
    """Stands in for Cohort.step: every agent's weights move by a distinct amount each step (no sampling, no
    compiled update: this file tests what the loop keeps and how runs are read back, not GRPO)."""
    for agent in self.agents:
        agent.params = jax.tree.map(lambda x, i=agent.index: x + 0.01 * step * (i + 1), agent.params)
    return {a.name: {"reward": 0.0, "skipped": 0.0} for a in self.agents}, []


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """The three-family ring (configs/ring3.py:tiny) through the training loop for 4 steps with the scripted eval,
    saving every 2 steps and keeping only the last."""
    workdir = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CORL_JAX_CACHE", str(tmp_path_factory.getbasetemp() / "zoo_cache"))
        config = load_config("ring3")
        config.train.update(max_steps=4, eval_every=1, save_every=2, keep_last=1)
        names = list(config.agents.keys())
        mp.setattr(loop, "evaluate", lambda cohort, problems, step: dict(zip(names, SCRIPT[step])))
        mp.setattr(Cohort, "step", scripted_step)
        loop.train(config, str(workdir))
        yield workdir


@pytest.fixture(autouse=True)
def _zoo_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("CORL_JAX_CACHE", str(tmp_path_factory.getbasetemp() / "zoo_cache"))


def checkpoint_params(workdir, step, agent):
    with Checkpointer(str(workdir)) as c:
        return c.restore(step).state[agent]["params"]


def test_each_agents_best_step_is_kept_reported_and_resolved(run_dir):
    summary = json.loads((run_dir / "summary.json").read_text())["agents"]
    assert {n: (s["best_step"], s["best_is_base"]) for n, s in summary.items()} == {
        "qwen25": (1, False), "llama32": (3, False), "qwen3": (0, True)}
    run = open_run(run_dir)
    assert run.agents == ("qwen25", "llama32", "qwen3")
    assert run.steps == (1, 3, 4)  # keep_last=1 keeps 4; 1 and 3 are bests; scheduled step 2 is gone
    assert [run.resolve_step(a, "best") for a in run.agents] == [1, 3, 0]
    assert run.resolve_step("qwen3", "latest") == 4 and run.resolve_step("qwen3", "3") == 3
    # the weights differ between steps, so "best" really selects step 1's
    best, latest = checkpoint_params(run_dir, 1, "qwen25"), checkpoint_params(run_dir, 4, "qwen25")
    assert any(np.abs(np.asarray(a) - np.asarray(b)).max() > 0
               for a, b in zip(jax.tree.leaves(best), jax.tree.leaves(latest)))
    policy, step = load_agent(run_dir, "qwen25")  # default: best, float32
    assert step == 1
    for got, want in zip(jax.tree.leaves(nnx.state(policy.model, nnx.Param)), jax.tree.leaves(best), strict=True):
        np.testing.assert_array_equal(got, want)


def test_export_matches_transformers_for_every_family_and_is_deterministic(run_dir, tmp_path):
    written = export(str(run_dir), str(tmp_path / "a"), dtype="float32")
    assert {a: s for a, (_, s) in written.items()} == {"qwen25": 1, "llama32": 3, "qwen3": 0}
    ids = np.array([[0, 0, 70, 71, 72, 73], [74, 75, 76, 77, 78, 79]])
    mask = np.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], bool)
    for agent, (directory, step) in written.items():
        assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= set(
            os.listdir(directory))
        ours, _ = load_agent(run_dir, agent, step)
        np.testing.assert_allclose(np.asarray(logits(ours, ids, mask))[mask], hf_logits(directory, ids, mask)[mask],
                                   atol=1e-4, rtol=1e-4)
    again = export(str(run_dir), str(tmp_path / "b"), dtype="float32")
    for agent, (directory, _) in written.items():
        files = sorted(os.listdir(directory))
        assert files == sorted(os.listdir(again[agent][0]))
        match, mismatch, errors = filecmp.cmpfiles(directory, again[agent][0], files, shallow=False)
        assert not mismatch and not errors, (agent, mismatch, errors)
    bf16 = export(str(run_dir), str(tmp_path / "c"), agents=["llama32"], step="latest")  # default dtype: bf16
    assert bf16["llama32"][1] == 4
    exported = load_file(str(bf16["llama32"][0] / "model.safetensors"))
    reference = load_file(str(export(str(run_dir), str(tmp_path / "d"), agents=["llama32"], step=4,
                                     dtype="float32")["llama32"][0] / "model.safetensors"))
    for name, tensor in exported.items():
        assert tensor.dtype == jnp.bfloat16
        np.testing.assert_array_equal(tensor, reference[name].astype(jnp.bfloat16))


def test_bad_input_is_one_clear_line(run_dir, tmp_path):
    with pytest.raises(RunError, match=r"agent 'gpt' is not in the run .* \(its agents: qwen25, llama32, qwen3\)"):
        export(str(run_dir), str(tmp_path / "o"), agents=["qwen25", "gpt"])
    with pytest.raises(RunError, match=r"no checkpoint of step 2 .*\(steps there: \[1, 3, 4\]\)"):
        load_agent(run_dir, "qwen25", 2)
    with pytest.raises(RunError, match="use best, latest or a step number"):
        load_agent(run_dir, "qwen25", "final")
    assert not (tmp_path / "o").exists()  # checked before anything was written
    with pytest.raises(RunError, match="no config.json"):
        open_run(tmp_path)
    (tmp_path / "fresh").mkdir()
    shutil.copy(run_dir / "config.json", tmp_path / "fresh")
    with pytest.raises(RunError, match="has no checkpoints yet"):
        load_agent(tmp_path / "fresh", "qwen25", "latest")
    other = tmp_path / "other"  # checkpoints with a config.json of another run
    shutil.copytree(run_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["agents"]["qwen25"]["model_path"] = "tiny:llama"
    config["agents"]["mistral"] = config["agents"].pop("qwen3")
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(RunError, match=r"parameter .* has shape .*: the checkpoints come from another config"):
        load_agent(other, "qwen25", "latest")
    with pytest.raises(RunError, match="holds no parameters of agent 'mistral'"):
        load_agent(other, "mistral", "latest")
    (tmp_path / "exists" / "qwen3").mkdir(parents=True)
    with pytest.raises(RunError, match="already exists"):
        export(str(run_dir), str(tmp_path / "exists"))
    result = subprocess.run([sys.executable, "-m", "corl_jax.export", f"--workdir={run_dir}",
                             f"--out={tmp_path / 'cli'}", "--step=7"], cwd=REPO, capture_output=True, text=True,
                            env=dict(os.environ))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines()[-1].startswith("error: no checkpoint of step 7 for agent 'qwen25'")
