"""Issue 22 part 1: configs/smollm2.py resolves for every variant, and the carry-sized SmolLM2 parts dequantise as
gguf-py and transformers do."""

import importlib.util
import json
from pathlib import Path
from urllib.parse import parse_qsl

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


def _sweep_module():
    spec = importlib.util.spec_from_file_location("smollm2_sweep", REPO / "experiments" / "evidence" / "smollm2_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    return sweep


@pytest.mark.parametrize("split", ["rl", "test"])
def test_every_candidate_world_holds_the_runs_splits(split):
    """A world the sweep may pick must hold the split the run reads (the H100 sweep failed on a world too small)."""
    c = _config_module().get_config("gt_reward")
    needed = {"rl": c.rollout.prompts_per_step * c.train.max_steps, "test": c.data.max_eval_samples}[split]
    for world in _sweep_module().WORLDS:
        size = dict(parse_qsl(world)).get("n", {"rl": 2000, "test": 500}[split])
        assert len(load_problems(f"arithmetic:{split}?{world}")) == int(size) >= needed


def test_pick_world_prefers_symbolic_worlds_in_range_then_nearest_035():
    sweep = _sweep_module()
    worlds = ["levels=2&word_fraction=0.0&max_value=20", "levels=2,3&word_fraction=0.0&max_value=60",
              "levels=2&word_fraction=1.0&max_value=20"]
    measured = lambda *accs: {f"arithmetic:test?{w}": {"t1_mean": a} for w, a in zip(worlds, accs)}  # noqa: E731
    assert sweep.pick_world(measured(0.2, 0.4, 0.35), worlds, "default") == worlds[1]
    assert sweep.pick_world(measured(0.05, 0.7, 0.3), worlds, "default") == worlds[2]  # only the word world fits
    assert sweep.pick_world(measured(0.05, 0.7, 0.9), worlds, "default") == worlds[2]  # none fits: the best
    assert sweep.pick_world({}, worlds, "default") == "default"


def test_unpack_parts_builds_the_checkpoint_from_synthetic_parts(tmp_path):
    """unpack_parts end to end on a one-layer model written in pack_parts' format (`kind|shape|gguf name` raw blocks,
    `file|name` small files, over two parts), against values worked out here: a Q8_0 embedding (x = d * q), a Q4_1
    matrix (x = d * q + m, low nibbles first), q/k stored in llama.cpp's rotary order (convert_hf_to_gguf's
    `permute`) and back in HF's, the rest F32."""
    from safetensors.numpy import load_file

    rng = np.random.default_rng(0)
    config = {"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 64}
    parts, expected = [{}, {}], {}

    def put(part, kind, gguf_name, hf_name, raw, hf_value):
        parts[part][f"{kind}|{'x'.join(map(str, hf_value.shape))}|{gguf_name}"] = raw.reshape(-1).view(np.uint8)
        expected[hf_name] = hf_value

    # Q8_0 embedding [32, 64]: per block of 32, an f16 scale then 32 int8
    q8 = rng.integers(-128, 128, (64, 32)).astype(np.int8)
    d8 = np.full((64, 1), 0.5, np.float16)
    put(0, "Q8_0", "token_embd.weight", "model.embed_tokens.weight",
        np.concatenate([d8.view(np.uint8), q8.view(np.uint8)], axis=1), (0.5 * q8.astype(np.float32)).reshape(32, 64))
    # Q4_1 up projection [64, 64]: per block f16 d, f16 m, 16 bytes holding 32 nibbles
    nibbles = rng.integers(0, 16, (128, 32)).astype(np.uint8)
    d4, m4 = np.full((128, 1), 0.25, np.float16), np.full((128, 1), -1.0, np.float16)
    packed = nibbles[:, :16] | (nibbles[:, 16:] << 4)
    value = np.array([[0.25 * nibbles[b, j] - 1.0 for j in range(32)] for b in range(128)], np.float32)
    put(0, "Q4_1", "blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj.weight",
        np.concatenate([d4.view(np.uint8), m4.view(np.uint8), packed], axis=1), value.reshape(64, 64))

    def rotary_order(w, heads):  # llama.cpp convert_hf_to_gguf.py's LlamaModel.permute
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    for gguf_kind, hf_kind, shape, heads in [("attn_q", "self_attn.q_proj", (64, 64), 2),
                                             ("attn_k", "self_attn.k_proj", (32, 64), 1),
                                             ("attn_v", "self_attn.v_proj", (32, 64), None),
                                             ("attn_output", "self_attn.o_proj", (64, 64), None),
                                             ("ffn_gate", "mlp.gate_proj", (64, 64), None),
                                             ("ffn_down", "mlp.down_proj", (64, 64), None),
                                             ("attn_norm", "input_layernorm", (64,), None),
                                             ("ffn_norm", "post_attention_layernorm", (64,), None)]:
        hf = rng.normal(size=shape).astype(np.float32)
        stored = rotary_order(hf, heads) if heads else hf
        put(1, "F32", f"blk.0.{gguf_kind}.weight", f"model.layers.0.{hf_kind}.weight", stored, hf)
    norm = rng.normal(size=64).astype(np.float32)
    put(1, "F32", "output_norm.weight", "model.norm.weight", norm, norm)
    files = {name: f"contents of {name}".encode() for name in smollm2.SMALL_FILES}
    files["config.json"] = json.dumps(config).encode()
    parts[1].update({f"file|{name}": np.frombuffer(data, np.uint8) for name, data in files.items()})
    paths = [tmp_path / f"part{i}.npz" for i in range(2)]
    for path, arrays in zip(paths, parts):
        np.savez_compressed(path, **arrays)

    target = smollm2.unpack_parts(paths, tmp_path / "hf")
    assert target == tmp_path / "hf"
    weights = load_file(str(target / "model.safetensors"))
    assert sorted(weights) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(weights[name], value, err_msg=name)
        assert weights[name].dtype == np.float32
    assert {p.name: p.read_bytes() for p in target.iterdir() if p.name != "model.safetensors"} == files
    assert smollm2.unpack_parts(paths[:1], target) == target  # already built: the parts are not read again


def test_unpack_parts_refuses_a_target_without_a_checkpoint(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(FileExistsError, match="holds no converted SmolLM2 checkpoint; delete it"):
        smollm2.unpack_parts([tmp_path / "part0.npz"], tmp_path / "hf")
