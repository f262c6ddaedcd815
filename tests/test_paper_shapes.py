"""`random:<hub id>` stand-ins and experiments/bench/paper_shape_run.py end to end at CPU size (train, resume, eval)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from corl_jax import compile_check
from corl_jax.models.paper_shapes import PAPER_MODELS
from corl_jax.registry import resolve_model_path
from corl_jax.stand_ins import load_policy
from corl_jax.tokenization import decode_completions
from cpu_flags import xla_flags_with_devices

REPO = Path(__file__).resolve().parents[1]
SMALL = "@num_hidden_layers=1,hidden_size=64,intermediate_size=128,num_attention_heads=4,num_key_value_heads=2"


def test_compile_check_reads_the_shared_table():
    assert compile_check.PAPER_MODELS is PAPER_MODELS


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    """Every `random:` path is built here, not found in a warm cache (building is cheap: a config and a tokenizer)."""
    monkeypatch.setenv("CORL_JAX_CACHE", str(tmp_path / "cache"))


def test_random_path_has_the_hub_shape_and_no_weights_on_disk():
    directory = Path(resolve_model_path("random:Qwen/Qwen2.5-3B"))
    hf = json.loads((directory / "config.json").read_text())
    assert {k: hf[k] for k in PAPER_MODELS["Qwen/Qwen2.5-3B"]} == PAPER_MODELS["Qwen/Qwen2.5-3B"]
    assert not list(directory.glob("*.safetensors"))


def test_random_init_is_deterministic_in_the_param_dtype_and_decodes_unknown_ids_to_nothing():
    path = resolve_model_path("random:Qwen/Qwen3-1.7B-Base" + SMALL + ",head_dim=16,vocab_size=1024")
    a, b = (load_policy(path, dtype=jnp.bfloat16) for _ in range(2))
    leaves_a, leaves_b = jax.tree.leaves(nnx.state(a.model)), jax.tree.leaves(nnx.state(b.model))
    assert {x.dtype for x in leaves_a} == {jnp.dtype(jnp.bfloat16)}
    assert all(np.array_equal(x, y) for x, y in zip(leaves_a, leaves_b))
    assert a.config.vocab_size == 1024 and len(a.tokenizer) < 1024
    known = a.tokenizer.encode("12", add_special_tokens=False)
    ids = np.array([[known[0], 1000, 700, known[1]]])
    assert decode_completions(a.tokenizer, ids, np.ones_like(ids, bool)) == ["12"]


@pytest.mark.parametrize("path, fix", [("random:org/unknown", "Qwen/Qwen2.5-3B"),
                                       ("random:Qwen/Qwen2.5-3B@depth=2", "num_hidden_layers")])
def test_bad_random_path_names_the_fix(path, fix):
    with pytest.raises(ValueError, match=fix):
        resolve_model_path(path)


def test_paper_shape_run_tiny_end_to_end(tmp_path):
    """On one device, as the paper-scale run is (the resume reads the session cache's programs)."""
    out = tmp_path / "result.json"
    subprocess.run([sys.executable, "experiments/bench/paper_shape_run.py", "--size=tiny", "--steps=1",
                    f"--workdir={tmp_path / 'run'}", f"--out={out}"], cwd=REPO, check=True,
                   env=dict(os.environ, XLA_FLAGS=xla_flags_with_devices(1)))
    result = json.loads(out.read_text())
    assert [p for p in result["phases"]] == ["build", "first", "resume", "eval"]
    assert [row["step"] for row in result["steps"]] == [1, 2]  # the resume continued at step 2
    assert all("memory/peak_bytes_in_use" not in row for row in result["steps"])  # CPU reports no memory stats
    cells = result["eval"]["cells"]  # base (random init rebuilt from the random: path) and the resumed step 2
    agents = ("qwen25", "llama32", "qwen3")
    assert sorted(cells) == sorted(f"{a}@{s}" for a in agents for s in ("base", "step 2 (latest)"))
    assert all(cell["arithmetic"]["problems"] == 4 for cell in cells.values())
