"""Issue 22 part 1: configs/smollm2.py resolves for every variant, and the carry-sized SmolLM2 parts dequantise as
gguf-py and transformers do."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from corl_jax.config import validate
from corl_jax.data import load_problems
from corl_jax.models import smollm2

REPO = Path(__file__).resolve().parents[1]


def _config_module():
    spec = importlib.util.spec_from_file_location("smollm2_config", REPO / "configs" / "smollm2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("variant", ["gt_reward", "ttrl", "pair_demo", "pair_same"])
def test_smollm2_config_variants_validate(variant):
    c = _config_module().get_config(variant)
    validate(c)
    assert c.agents.smollm2.model_path == str(smollm2.DEFAULT_CACHE_DIR)
    assert len(c.agents) == (2 if variant.startswith("pair") else 1)
    eval_problems = load_problems(c.data.eval_path)[:c.data.max_eval_samples]
    assert len(eval_problems) == c.data.max_eval_samples
    train = {p.text for p in load_problems(c.data.train_path)}
    # held out: the splits are disjoint in canonical form, so at most a rare text repeats across them
    assert sum(p.text in train for p in eval_problems) <= len(eval_problems) // 100


def test_smollm2_config_unknown_variant_names_the_variants():
    with pytest.raises(ValueError, match="gt_reward"):
        _config_module().get_config("demo")


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_dequantize_matches_gguf_py(kind):
    gguf_quants = pytest.importorskip("gguf.quants")
    import gguf

    rng = np.random.default_rng(0)
    block = {"Q4_1": 20, "Q8_0": 34}[kind]
    raw = rng.integers(0, 256, (6 * 4, block), dtype=np.uint8)  # 6 rows of 128 values = 4 blocks each
    scales = rng.normal(0, 0.05, (raw.shape[0], 2 if kind == "Q4_1" else 1)).astype(np.float16)  # d (and m)
    raw[:, :scales.shape[1] * 2] = scales.view(np.uint8)  # finite f16 scale (and min)
    ours = smollm2._dequantize(kind, raw.reshape(-1), [6, 128], "blk.0.ffn_up.weight", {})
    expected = gguf_quants.dequantize(raw.reshape(6, -1), getattr(gguf.GGMLQuantizationType, kind))
    np.testing.assert_array_equal(ours, expected)


@pytest.mark.parametrize("name,heads", [("blk.3.attn_q.weight", 9), ("blk.3.attn_k.weight", 3)])
def test_qk_rows_reordered_as_transformers(name, heads):
    pytest.importorskip("gguf")
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    weights = np.arange(heads * 64 * 8, dtype=np.float32).reshape(heads * 64, 8)
    config = {"num_attention_heads": 9, "num_key_value_heads": 3}
    ours = smollm2._dequantize("F32", weights.view(np.uint8).reshape(-1), list(weights.shape), name, config)
    expected = LlamaTensorProcessor(config=config).process(weights, name).weights
    np.testing.assert_array_equal(ours, expected)


def test_unpack_parts_names_missing_parts(tmp_path):
    part = tmp_path / "part0.npz"
    np.savez(part, **{"F32|4|output_norm.weight": np.zeros(16, np.uint8)})
    with pytest.raises(FileNotFoundError, match="pass every part"):
        smollm2.unpack_parts([part], tmp_path / "out")


def test_pick_world_prefers_symbolic_worlds_in_range_then_nearest_035():
    spec = importlib.util.spec_from_file_location("smollm2_sweep", REPO / "experiments" / "evidence" / "smollm2_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    worlds = ["levels=2&word_fraction=0.0&max_value=20", "levels=2,3&word_fraction=0.0&max_value=60",
              "levels=2&word_fraction=1.0&max_value=20"]
    measured = lambda *accs: {f"arithmetic:test?{w}": {"t1_mean": a} for w, a in zip(worlds, accs)}  # noqa: E731
    assert sweep.pick_world(measured(0.2, 0.4, 0.35), worlds, "default") == worlds[1]
    assert sweep.pick_world(measured(0.05, 0.7, 0.3), worlds, "default") == worlds[2]  # only the word world fits
    assert sweep.pick_world(measured(0.05, 0.7, 0.9), worlds, "default") == worlds[2]  # none fits: the best
    assert sweep.pick_world({}, worlds, "default") == "default"
