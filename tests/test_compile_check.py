"""corl_jax.compile_check: deviceless compilation for a TPU slice (libtpu) and its one-line errors."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from config_files import load_config
from corl_jax import cohort, compile_check

ROOT = Path(__file__).resolve().parents[1]
HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None or os.path.isfile(os.environ.get("TPU_LIBRARY_PATH", ""))
# a Qwen3-shaped model with the paper families' head_dim 128 (so the TPU decode kernel is in the sampler)
QWEN3_128 = dict(model_type="qwen3", vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=128, tie_word_embeddings=True)


# Not in the `test` extra: with libtpu installed, every CPU run of JAX would probe for a TPU and print errors.
NO_LIBTPU = ("needs libtpu: pip install --target DIR 'libtpu==0.0.42.*' and set TPU_LIBRARY_PATH=DIR/libtpu/libtpu.so "
             "(.ci/run does)")


@pytest.mark.skipif(not HAVE_LIBTPU, reason=NO_LIBTPU)
def test_compiles_sampler_and_update_for_a_tpu_slice_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_128))  # no weights: only the shapes are read
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "corl_jax.compile_check", "--config=configs/ttrl.py:tiny", "--topology=v5e-4",
           f"--config.agents.qwen25.model_path={tmp_path}", "--config.mesh.data=-1", "--placement=shared",
           "--prompt_len=64", f"--json={out}"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-2000:]
    [report] = json.loads(out.read_text())
    assert "v5e-4 (4 x TPU v5 lite, 16 GiB HBM per chip), shared placement, prompt 64 + 16 new" in run.stdout
    assert report["platform"] == "tpu" and report["estimate"] == "TPU (libtpu)"
    agent = report["agents"]["qwen25"]
    assert agent["mesh"] == {"data": 4, "fsdp": 1, "tensor": 1}
    assert agent["decode_attention"] == "pallas"  # the Mosaic kernel lowered for TPU inside the sampler
    assert agent["update_attention"] == "splash"  # grpo.attention=auto: the splash kernel inside the update
    assert "qwen25     attention: decode pallas, update splash" in run.stdout
    # data parallel: every chip holds all fp32 parameters and AdamW's two moments (+ scalar counts)
    n = sum(_param_counts(QWEN3_128))
    assert 12 * n <= agent["resident"] < 12 * n + 1024
    update = agent["programs"]["update"]  # donated parameters and optimiser state come back in place
    assert update["alias"] >= 12 * n and update["argument"] >= agent["resident"]
    assert agent["peak_per_chip"] >= agent["resident"] and agent["fits"]


def _param_counts(hf):
    V, D, F, L = hf["vocab_size"], hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]
    H, K, hd = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    yield V * D + D  # tied embedding, final norm
    yield L * (2 * D + D * H * hd + 2 * D * K * hd + H * hd * D + 3 * D * F + 2 * hd)  # norms, attention, MLP, q/k norm


@pytest.mark.parametrize("topology, placement, mesh, message", [
    ("v5e-7", "shared", {}, "unknown topology 'v5e-7'; use one of v5e-4, v5e-8"),
    ("cpu", "partitioned", {}, "splits 8 chips among 3 agents: needs a multiple of the agent count"),
    ("cpu", "shared", {"fsdp": 3}, r"mesh data=-1 fsdp=3 tensor=1 does not fit the 8 chips.*Fix: --config.mesh"),
])
def test_bad_slices_and_meshes_are_one_line_errors(topology, placement, mesh, message):
    config = load_config("ring3")
    config.mesh.update(data=-1, **mesh)
    with pytest.raises(ValueError, match=message) as error:
        cohort.agent_meshes(config, compile_check.topology_devices(topology)[0], placement)
    assert "\n" not in str(error.value)


def test_the_paper_models_have_the_shapes_of_their_checkpoints():
    """Parameter counts of the built-in shapes against the published sizes (embedding included)."""
    from corl_jax.models import ModelConfig

    published = {"Qwen/Qwen2.5-1.5B": 1.54e9, "Qwen/Qwen2.5-3B": 3.09e9, "Qwen/Qwen3-1.7B-Base": 1.72e9,
                 "meta-llama/Llama-3.2-1B-Instruct": 1.24e9, "meta-llama/Llama-3.2-3B-Instruct": 3.21e9}
    for path, size in published.items():
        c = ModelConfig.from_hf_dict(compile_check.PAPER_MODELS[path])
        hd, D, L = c.head_dim, c.hidden_size, c.num_layers
        n = (c.vocab_size * D * (1 if c.tie_word_embeddings else 2) + L * (
            D * (c.num_heads + 2 * c.num_kv_heads) * hd + c.num_heads * hd * D + 3 * D * c.intermediate_size))
        assert abs(n - size) / size < 0.01, (path, n)


def test_the_sampler_is_compiled_with_the_configs_decode_compaction(tmp_path):
    """compile_check compiles the sampler the trainer runs: its `rollout.decode_compaction` stages (whose smallest
    batch must still divide the mesh's batch shards) are part of the compiled program."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_128))
    config = load_config("ttrl")  # 2 prompts x 4 samples = 8 rows
    config.agents.qwen25.model_path = str(tmp_path)
    config.mesh.update(data=-1)
    config.rollout.update(decode_compaction=2, max_new_tokens=16)
    devices = compile_check.topology_devices("cpu")[0]
    [one] = cohort.agent_meshes(config, devices[:1], "shared")
    sampler = compile_check.compile_agent(config, "qwen25", one, prompt_len=8)["programs"]["sampler"]
    assert sampler["temp"] > 0 and "oom" not in sampler
    [eight] = cohort.agent_meshes(config, devices, "shared")  # stages 8, 4, 2 rows over 8 batch shards
    with pytest.raises(ValueError, match=r"decode compaction 2 halves the batch of 8 rows .* 8 batch shard.*"
                                         r"lower rollout.decode_compaction"):
        compile_check.compile_agent(config, "qwen25", eight, prompt_len=8)


@pytest.mark.skipif(not HAVE_LIBTPU, reason=NO_LIBTPU)
def test_decode_compaction_adds_no_cache_sized_buffer_on_a_tpu(tmp_path):
    """Compaction moves the live rows inside the one KV cache (per layer, in place): libtpu's buffer assignment of
    the sampler with 2 halvings needs less than 15% of the cache more than without (gathering the live rows into a
    new cache needed 1.2x more with this kernel, 0.8x more with XLA attention, at this shape). XLA:CPU's memory
    analysis does not show in-place reuse, hence TPU. (The move is the same for both decode attentions; the TPU's
    own kernel is the one compiled here, the XLA path's compile takes twice as long.)"""
    attention = "pallas"
    (tmp_path / "config.json").write_text(json.dumps(dict(QWEN3_128, num_hidden_layers=8)))
    config = load_config("ttrl")
    config.agents.qwen25.update(model_path=str(tmp_path), param_dtype="bfloat16", compute_dtype="bfloat16")
    config.mesh.update(data=-1)
    config.rollout.update(prompts_per_step=16, num_generations=8, max_new_tokens=512, decode_attention=attention)
    [mesh] = cohort.agent_meshes(config, compile_check.topology_devices("v5e-4")[0][:1], "shared")
    temp = {}
    for compaction in (0, 2):
        config.rollout.decode_compaction = compaction
        agent = compile_check.compile_agent(config, "qwen25", mesh, prompt_len=64)
        assert agent["decode_attention"] == attention
        temp[compaction] = agent["programs"]["sampler"]["temp"]
    cache = 2 * 8 * 128 * 2 * (64 + 512) * 128 * 2  # k and v: layers x rows x kv heads x slots x head_dim, bf16
    assert cache <= temp[0] < 1.15 * cache, (temp, cache)
    assert temp[2] - temp[0] < 0.15 * cache, (temp, cache)


def _program_keys(config, topology="v5e-8", mesh=None, prompt_len=64):
    mesh = mesh or {"data": 2, "fsdp": 1, "tensor": 1}
    return {(name, program): compile_check.program_key(config, name, program, topology, mesh, prompt_len)
            for name in config.agents for program in ("sampler", "update")}


def test_program_key_is_shared_by_equal_agents_and_splits_on_their_settings():
    config = load_config("pair_different_family")
    config.agents.llama32.update(model_path=config.agents.qwen25.model_path, family="qwen2")
    keys = _program_keys(config)
    for program in ("sampler", "update"):  # two agents of one shape and settings compile one program
        assert keys["qwen25", program] == keys["llama32", program]
    assert keys["qwen25", "sampler"] != keys["qwen25", "update"]
    assert "grpo" in json.loads(keys["qwen25", "update"]) and "optim" in json.loads(keys["qwen25", "update"])
    assert "grpo" not in json.loads(keys["qwen25", "sampler"]) and "optim" not in json.loads(keys["qwen25", "sampler"])

    def changed(edit, **where):  # which of qwen25's programs get another key after `edit`
        other = load_config("pair_different_family")
        edit(other)
        new = _program_keys(other, **where)
        return {program for program in ("sampler", "update") if new["qwen25", program] != keys["qwen25", program]}

    both, update = {"sampler", "update"}, {"update"}
    assert changed(lambda c: None) == set()
    assert changed(lambda c: c.rollout.update(max_new_tokens=c.rollout.max_new_tokens * 2)) == both
    assert changed(lambda c: c.rollout.update(decode_compaction=2)) == both
    assert changed(lambda c: c.grpo.update(micro_batch_size=c.grpo.micro_batch_size * 2)) == update
    assert changed(lambda c: c.grpo.update(beta=0.5)) == update
    assert changed(lambda c: c.optim.update(weight_decay=0.5)) == update
    assert changed(lambda c: c.train.update(max_steps=c.train.max_steps + 1)) == update  # the schedule's length
    assert changed(lambda c: c.grpo.update(remat="full" if c.grpo.remat != "full" else "none")) == both
    assert changed(lambda c: c.agents.qwen25.update(compute_dtype="bfloat16")) == both
    assert changed(lambda c: c.agents.qwen25.update(model_path="meta-llama/Llama-3.2-1B-Instruct")) == both
    assert changed(lambda c: None, topology="v5e-16") == both
    assert changed(lambda c: None, mesh={"data": 1, "fsdp": 2, "tensor": 1}) == both
    assert changed(lambda c: None, prompt_len=128) == both


def test_compile_agent_takes_cached_programs_by_key(tmp_path):
    """compile_agent looks each program up under its `program_key` and compiles nothing it finds: a second agent of
    the same shape on a mesh of the same shape reuses the first one's figures."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_128))
    config = load_config("pair_same_family")
    for agent in config.agents.values():
        agent.model_path = str(tmp_path)
    config.mesh.update(data=-1)
    devices = compile_check.topology_devices("cpu")[0]
    [mesh] = cohort.agent_meshes(config, devices[:1], "shared")[:1]
    names = list(config.agents)
    figures = {"sampler": dict(argument=10, output=20, alias=0, temp=7, seconds=0.0),
               "update": dict(argument=30, output=40, alias=5, temp=9, seconds=0.0)}
    cache = {compile_check.program_key(config, names[0], p, "cpu", mesh.shape, 8): dict(f) for p, f in figures.items()}
    for name in names:
        programs = compile_check.compile_agent(config, name, mesh, prompt_len=8, cache=cache, topology="cpu")["programs"]
        assert {p: {k: programs[p][k] for k in figures[p]} for p in programs} == figures
    assert len(cache) == 2  # nothing compiled, nothing added
