"""Compile a config's sampler and GRPO update for a TPU slice without a TPU and without weights, and report per
chip what the compiled programs hold in memory and whether every agent fits.

    python -m corl_jax.compile_check --config=configs/ring3.py --topology=v5e-16 [--placement=both]
        [--config.mesh.fsdp=4 ...] [--prompt_len=N] [--json=out.json]

`--topology` names a Cloud TPU slice (`v5e-16`, `v5p-8`, `v6e-8`, ...: see `TOPOLOGIES`): the programs are compiled
by libtpu for that slice's devices on this host (`jax.experimental.topologies`, as MaxText's train_compile does;
`pip install libtpu`, or point `TPU_LIBRARY_PATH` at libtpu.so). `--topology=cpu` compiles for this host's CPU
devices instead (fake them with `--xla_force_host_platform_device_count`): XLA:CPU's buffer assignment, labelled a
CPU estimate. Parameters are abstract (`jax.ShapeDtypeStruct`s from the model's config: a local checkpoint's
config.json, the built-in `PAPER_MODELS` shapes for the paper's hub ids, or the `tiny:` stand-ins), so no
checkpoint is read.

Per agent and program the report gives XLA's per-chip argument, output, alias and temp bytes
(`compiled.memory_analysis()`). The fit adds, per chip, every resident agent's parameters and optimiser state
(shared placement: all agents on every chip; partitioned: the agent alone on its slice) to the largest transient
of one program (its temp buffers plus whatever of its arguments and outputs is not the resident state).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import numpy as np

from corl_jax.models.paper_shapes import PAPER_MODELS

# A Cloud TPU slice: how `jax.experimental.topologies` names its device layout, chips, hosts and HBM per chip.


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str                     # jax/libtpu topology name, e.g. "v5e:4x4"
    chip_config: str              # "default" (one TensorCore per chip) or "megacore" (v4/v5p: two fused cores)
    chips_per_host_bounds: tuple  # chips of one host along each axis
    chips: int
    hosts: int
    hbm_gib: float                # HBM per chip (Cloud TPU system architecture pages)


def _slices(generation, hbm, table, chip_config="default", host=(2, 2, 1)):
    return {f"{generation}-{n}": Topology(name, chip_config, (2, 4, 1) if chips == 8 and hosts == 1 else host,
                                          chips, hosts, hbm)
            for n, (name, chips, hosts) in table.items()}


# accelerator type -> topology. v5e/v6e count chips, v4/v5p count TensorCores (two per chip).
TOPOLOGIES: dict[str, Topology] = {
    **_slices("v5e", 16, {4: ("v5e:2x2", 4, 1), 8: ("v5e:2x4", 8, 1), 16: ("v5e:4x4", 16, 4),
                          32: ("v5e:4x8", 32, 8), 64: ("v5e:8x8", 64, 16)}),
    **_slices("v6e", 32, {4: ("v6e:2x2", 4, 1), 8: ("v6e:2x4", 8, 1), 16: ("v6e:4x4", 16, 4),
                          32: ("v6e:4x8", 32, 8), 64: ("v6e:8x8", 64, 16)}),
    **_slices("v5p", 95, {8: ("v5:2x2x1", 4, 1), 16: ("v5:2x2x2", 8, 2), 32: ("v5:2x2x4", 16, 4),
                          64: ("v5:2x4x4", 32, 8)}, chip_config="megacore"),
    **_slices("v4", 32, {8: ("v4:2x2x1", 4, 1), 16: ("v4:2x2x2", 8, 2), 32: ("v4:2x2x4", 16, 4),
                         64: ("v4:2x4x4", 32, 8)}, chip_config="megacore"),
}

_GIB = 2 ** 30


def topology_devices(topology: str) -> tuple[list, float | None]:
    """(devices, HBM GiB per chip) of a slice name from `TOPOLOGIES` (compile-only TPU devices) or "cpu"."""
    import jax

    if topology == "cpu":
        return jax.devices("cpu"), None
    if topology not in TOPOLOGIES:
        raise ValueError(f"unknown topology {topology!r}; use one of {', '.join(TOPOLOGIES)} or 'cpu'")
    from jax.experimental import topologies

    t = TOPOLOGIES[topology]
    # compiling touches no TPU: let several processes load libtpu (else the second one fails on its lockfile)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        desc = topologies.get_topology_desc(t.name, "tpu", chip_config_name=t.chip_config,
                                            chips_per_host_bounds=t.chips_per_host_bounds, num_slices=1)
    except RuntimeError as e:
        fix = ("`pip install 'libtpu==0.0.42.*'` (the pin of jax[tpu] 0.10.2) or set TPU_LIBRARY_PATH to its "
               "libtpu.so; or use --topology=cpu for CPU estimates") if "not installed" in str(e) else "see above"
        raise RuntimeError(f"cannot compile for {topology}: {str(e).splitlines()[0]}. Fix: {fix}") from None
    return list(desc.devices), t.hbm_gib


def model_config(model_path: str, spec, remat: str, attention: str = "xla", platform: str = "cpu"):
    """The agent's `ModelConfig`: from a local checkpoint's config.json, the paper table or the tiny stand-ins, with
    the update attention `attention` resolved for `platform` (`attention_impl`)."""
    from pathlib import Path

    import jax.numpy as jnp

    from corl_jax.demo.checkpoints import TINY_ARCHITECTURES
    from corl_jax.models import ModelConfig
    from corl_jax.models.config import attention_impl

    if (Path(model_path).expanduser() / "config.json").is_file():
        hf = json.loads((Path(model_path).expanduser() / "config.json").read_text())
    elif model_path in PAPER_MODELS:
        hf = PAPER_MODELS[model_path]
    elif model_path.startswith("tiny:") and model_path[5:] in TINY_ARCHITECTURES:
        hf = dict(TINY_ARCHITECTURES[model_path[5:]], vocab_size=512)
    else:
        raise ValueError(f"no model shape for {model_path!r}: point model_path at a local checkpoint directory "
                         f"(its config.json is read) or use one of {', '.join(PAPER_MODELS)} or tiny:<family>")
    dtypes = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    attention = attention_impl(attention, platform, dtypes[spec.compute_dtype], head_dim)
    return ModelConfig.from_hf_dict(hf, param_dtype=dtypes[spec.param_dtype], dtype=dtypes[spec.compute_dtype],
                                    remat=remat, attention=attention)


def _is_variable(x) -> bool:
    from flax import nnx

    return isinstance(x, nnx.Variable)


def _compiled_memory(compile) -> dict:
    """Per-chip argument/output/alias/temp bytes of `compile()`'s program, and its live_peak (the most bytes live at once,
    arguments included: temp alone counts some buffers that are never live together). libtpu refuses to compile a
    program whose temporaries exceed the chip's HBM: that is a result ("oom", with the temp bytes it asked for), not
    an error."""
    import re

    import jax

    try:
        m = compile().memory_analysis()
    except jax.errors.JaxRuntimeError as e:
        need = re.search(r"RESOURCE_EXHAUSTED: .*?temporaries \(([\d.]+)([KMGT])\)", str(e))
        if need is None:
            raise
        temp = float(need.group(1)) * 1024 ** " KMGT".index(need.group(2))
        return {"argument": 0, "output": 0, "alias": 0, "temp": int(temp), "oom": str(e).splitlines()[0][:200]}
    return {k: int(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp")} | {
        "live_peak": int(m.peak_memory_in_bytes)}


def program_key(config, name: str, program: str, topology: str, mesh_shape: dict, prompt_len: int) -> str:
    """Everything one agent's `program` ("sampler" or "update") is compiled from, as a JSON string: its model shape
    and dtypes, the slice, the mesh shape, the prompt width and the rollout settings; the update adds the GRPO,
    optimiser and schedule settings. Agents of any config with equal keys compile the same program (on a sub-mesh
    of the same shape, e.g. either half of a slice with partitioned placement)."""
    spec, g = config.agents[name], config.grpo
    key = {"program": program, "model_path": spec.model_path, "param_dtype": spec.param_dtype,
           "compute_dtype": spec.compute_dtype, "topology": topology, "mesh": dict(mesh_shape),
           "prompt_len": prompt_len, "rollout": config.rollout.to_dict(), "remat": g.remat, "attention": g.attention}
    if program == "update":
        key.update(grpo=g.to_dict(), optim=config.optim.to_dict(), max_steps=config.train.max_steps)
    return json.dumps(key, sort_keys=True, default=str)


def compile_agent(config, name: str, mesh, prompt_len: int, cache: dict | None = None, topology: str = "") -> dict:
    """Compile one agent's sampler (prefill + decode) and GRPO update on `mesh` (of slice `topology`); their memory
    per chip. `cache` (a dict, `program_key` -> memory) skips the programs it holds and receives those compiled."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from corl_jax import cohort
    from corl_jax.models import Decoder
    from corl_jax.models.sharding import batch_sharding, state_shardings
    from corl_jax.optim import make_optimizer, opt_state_shardings
    from corl_jax.sampling.controls import SamplingParams
    from corl_jax.sampling.engine import Buckets, Sampler, round_up

    spec, r, g, o = config.agents[name], config.rollout, config.grpo, config.optim
    model_cfg = model_config(spec.model_path, spec, g.remat, g.attention, mesh.devices.flat[0].platform)
    model = nnx.eval_shape(lambda: Decoder(model_cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    for variable, sharding in zip(jax.tree.leaves(state, is_leaf=_is_variable),
                                  jax.tree.leaves(state_shardings(state, mesh))):
        variable.set_value(jax.ShapeDtypeStruct(variable.shape, variable.dtype, sharding=sharding))
    params = state

    def sds(shape, dtype, sharding=None):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding or batch_sharding(shape, mesh))

    replicated = NamedSharding(mesh, PartitionSpec())
    buckets = Buckets()
    width = round_up(prompt_len, buckets.prompt)
    P, G = r.prompts_per_step, r.num_generations
    sampler = Sampler(model, stop_ids=(0,), mesh=mesh, buckets=buckets, attention=r.decode_attention,
                      compaction=r.decode_compaction)
    key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=replicated)
    sample = SamplingParams(temperature=r.temperature or 1.0, top_p=r.top_p, top_k=r.top_k, min_p=r.min_p,
                            greedy=r.temperature == 0)
    cache = {} if cache is None else cache

    def memory(program, compile):
        key = program_key(config, name, program, topology, mesh.shape, prompt_len)
        if key not in cache:
            start = time.perf_counter()
            cache[key] = dict(_compiled_memory(compile), seconds=round(time.perf_counter() - start, 1))
        return dict(cache[key])

    sampler_memory = memory("sampler", lambda: sampler.program(
        graphdef, params, sds((P, width), jnp.int32), sds((P, width), bool), key, G,
        round_up(r.max_new_tokens, buckets.new_tokens), sample, sampler.stages(P * G)))

    batch = P * G
    optimizer = make_optimizer(o.learning_rate, config.train.max_steps, warmup_ratio=o.warmup_ratio,
                               min_lr_rate=o.min_lr_rate, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                               max_grad_norm=o.max_grad_norm)
    opt_state = jax.tree.map(lambda a, sharding: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                             jax.eval_shape(optimizer.init, params), opt_state_shardings(optimizer, params, mesh))
    T = width + r.max_new_tokens
    update_batch = {"tokens": sds((batch, T), jnp.int32), "attention": sds((batch, T), bool),
                    "completion_mask": sds((batch, r.max_new_tokens), jnp.float32),
                    "advantages": sds((batch,), jnp.float32)}
    settings = cohort.UpdateSettings(loss_type=g.loss_type, eps_low=g.eps_low, eps_high=g.eps_high, beta=g.beta,
                                     num_micro=batch // g.micro_batch_size, chunk_size=g.logprob_chunk_size,
                                     temperature=r.temperature if r.temperature > 0 else 1.0)
    def compile_update():  # under the mesh: the splash kernel runs per shard
        with jax.set_mesh(mesh):
            return cohort.update.lower(graphdef, optimizer, params, opt_state, update_batch, settings).compile()

    update_memory = memory("update", compile_update)

    def per_chip(tree) -> int:  # bytes of one chip's shard of every leaf
        return int(sum(np.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
                       for x in jax.tree.leaves(tree)))

    resident = per_chip(params) * (2 if g.beta > 0 else 1) + per_chip(opt_state)  # + frozen reference when beta > 0
    programs = {"sampler": sampler_memory, "update": update_memory}
    resident_arguments = {"sampler": per_chip(params), "update": per_chip(params) + per_chip(opt_state)}
    for program, mem in programs.items():  # (an "oom" program's arguments hold its resident state: its temp counts)
        mem["transient"] = mem["temp"] if "oom" in mem else max(
            0, mem["argument"] + mem["output"] - mem["alias"] + mem["temp"] - resident_arguments[program])
    return {"model_path": spec.model_path, "decode_attention": sampler.attention,
            "update_attention": model_cfg.attention, "resident": resident,
            "programs": programs}


def check(config, topology: str, placement: str, prompt_len: int, cache: dict | None = None) -> dict:
    """Compile every agent for `topology` with `placement`; per-chip memory and the fit. `cache` (a dict,
    `program_key` -> memory) reuses a program's figures wherever its key recurs on this slice: agents of the same
    shape in any config, on any sub-mesh of the same shape."""
    from corl_jax import cohort

    devices, hbm_gib = topology_devices(topology)
    meshes = cohort.agent_meshes(config, devices, placement)
    cache = {} if cache is None else cache
    agents = {name: dict(compile_agent(config, name, mesh, prompt_len, cache, topology), mesh=dict(mesh.shape))
              for name, mesh in zip(config.agents, meshes)}
    peak_transient = lambda a: max(p["transient"] for p in a["programs"].values())  # noqa: E731
    if placement == "shared":  # every agent's state lives on every chip; the programs run one at a time
        peaks = {name: sum(a["resident"] for a in agents.values()) + peak_transient(agents[name])
                 for name in agents}
    else:
        peaks = {name: a["resident"] + peak_transient(a) for name, a in agents.items()}
    for name, a in agents.items():
        a["peak_per_chip"] = peaks[name]
        oom = any("oom" in p for p in a["programs"].values())
        a["fits"] = None if hbm_gib is None else (not oom and peaks[name] <= hbm_gib * _GIB)
    return {"topology": topology, "platform": devices[0].platform, "device_kind": devices[0].device_kind,
            "chips": len(devices), "hbm_gib_per_chip": hbm_gib, "placement": placement, "prompt_len": prompt_len,
            "max_new_tokens": config.rollout.max_new_tokens, "micro_batch_size": config.grpo.micro_batch_size,
            "remat": config.grpo.remat, "estimate": "TPU (libtpu)" if hbm_gib else "CPU estimate (XLA:CPU)",
            "agents": agents}


def format_report(report: dict) -> str:
    gib = lambda b: f"{b / _GIB:6.2f}"  # noqa: E731
    lines = [f"{report['topology']} ({report['chips']} x {report['device_kind']}, "
             f"{report['hbm_gib_per_chip'] or '?'} GiB HBM per chip), {report['placement']} placement, "
             f"prompt {report['prompt_len']} + {report['max_new_tokens']} new tokens, micro-batch "
             f"{report['micro_batch_size']}, remat {report['remat']} [{report['estimate']}]",
             f"  {'agent':<10} {'mesh':<28} {'program':<8} {'arg GiB':>7} {'out GiB':>7} {'temp GiB':>8} "
             f"{'resident':>8} {'peak GiB':>8}  fits"]
    for name, a in report["agents"].items():
        mesh = ",".join(f"{k}={v}" for k, v in a["mesh"].items())
        for prog, m in a["programs"].items():
            fits = {True: "yes", False: "NO", None: "?"}[a["fits"]] + (" (libtpu: out of HBM)" if "oom" in m else "")
            lines.append(f"  {name:<10} {mesh:<28} {prog:<8} {gib(m['argument'])}  {gib(m['output'])}   "
                         f"{gib(m['temp'])}   {gib(a['resident'])}   {gib(a['peak_per_chip'])}  {fits}")
        lines.append(f"  {name:<10} attention: decode {a['decode_attention']}, update {a['update_attention']}")
    return "\n".join(lines)


def main(argv):
    from absl import flags

    from corl_jax.config import validate

    f = flags.FLAGS
    if len(argv) > 1:
        sys.exit(f"error: unexpected arguments {argv[1:]}")
    if f.config is None or not f.topology:
        sys.exit("error: --config=configs/<name>.py[:variant] and --topology=<slice, e.g. v5e-16, or cpu> are required")
    config = f.config
    try:
        validate(config)
        topology_devices(f.topology)  # an unknown slice or a missing libtpu fails here, once
    except (ValueError, RuntimeError) as e:
        sys.exit(f"error: {e}")
    reports, failed = [], False
    for placement in ("shared", "partitioned") if f.placement == "both" else (f.placement,):
        try:
            reports.append(check(config, f.topology, placement, f.prompt_len or config.rollout.max_prompt_len))
            print(format_report(reports[-1]), flush=True)
        except ValueError as e:  # e.g. partitioned placement on a chip count the agents do not divide
            print(f"error: {e}", flush=True)
            failed = True
    if f.json:
        from etils import epath

        epath.Path(f.json).write_text(json.dumps(reports, indent=1))
    if failed:
        sys.exit(1)


def _define_flags():
    from absl import flags

    from corl_jax.train import define_flags

    define_flags()  # --config with its overrides, exactly as the trainer reads it
    flags.DEFINE_string("topology", None, f"TPU slice ({', '.join(TOPOLOGIES)}) or 'cpu'.")
    flags.DEFINE_enum("placement", "both", ["shared", "partitioned", "both"], "Agent placement(s) to check.")
    flags.DEFINE_integer("prompt_len", 0, "Prompt width in tokens (0: the config's rollout.max_prompt_len).")
    flags.DEFINE_string("json", "", "Also write the reports to this JSON file.")


if __name__ == "__main__":
    from absl import app

    from corl_jax.train import _parse_flags

    _define_flags()
    app.run(main, flags_parser=_parse_flags)
