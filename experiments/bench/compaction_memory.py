"""Decode compaction's memory: the sampler program's temporary bytes per chip with `rollout.decode_compaction` 0, 1, 2,
compiled by libtpu on this (CPU) host for a v6e slice (32 GiB a chip) (no TPU and no weights needed; `pip install 'libtpu==0.0.42.*'`).

The KV cache is created inside the sampling program, so it is part of the temporaries; the ratios temp / cache and
peak / cache say what compaction adds on top of the cache. temp is the buffer assignment's total, which can count
buffers that are never live together (on a mesh it does); peak is the most bytes live at once, the weights included,
which is what must fit a chip. (The GPU and TPU compilers assign buffers the same way; the CPU backend's memory
analysis does not show in-place reuse, so it is not used here.)

    python experiments/bench/compaction_memory.py --out experiments/results/compaction_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from corl_jax.compile_check import _compiled_memory, _is_variable, topology_devices  # noqa: E402
from corl_jax.models import Decoder, ModelConfig  # noqa: E402
from corl_jax.models.sharding import batch_sharding, state_shardings  # noqa: E402
from corl_jax.sampling.controls import SamplingParams  # noqa: E402
from corl_jax.sampling.engine import CACHE_BLOCK, Buckets, Sampler, round_up  # noqa: E402
from shapes import SHAPES  # noqa: E402


def sampler_temp(shape: str, chips: int, attention: str, compaction: int, prompts: int, samples: int,
                 prompt_width: int, new_tokens: int) -> dict:
    """Temp bytes per chip of the sampler's program and the KV cache's share of them."""
    model_type, fields = SHAPES[shape]
    config = ModelConfig.from_hf_dict(dict(fields, model_type=model_type), param_dtype=jnp.bfloat16)
    devices, _ = topology_devices("v6e-4")
    mesh = Mesh(np.array(devices[:chips]).reshape(chips, 1, 1), ("data", "fsdp", "tensor"))
    model = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    for variable, sharding in zip(jax.tree.leaves(state, is_leaf=_is_variable),
                                  jax.tree.leaves(state_shardings(state, mesh))):
        variable.set_value(jax.ShapeDtypeStruct(variable.shape, variable.dtype, sharding=sharding))
    key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype,
                               sharding=NamedSharding(mesh, PartitionSpec()))
    ids = jax.ShapeDtypeStruct((prompts, prompt_width), jnp.int32, sharding=batch_sharding((prompts, prompt_width), mesh))
    mask = jax.ShapeDtypeStruct((prompts, prompt_width), bool, sharding=batch_sharding((prompts, prompt_width), mesh))
    sampler = Sampler(model, stop_ids=(0,), mesh=mesh, buckets=Buckets(), attention=attention, compaction=compaction)
    start = time.perf_counter()
    memory = _compiled_memory(lambda: sampler.program(graphdef, state, ids, mask, key, samples, new_tokens,
                                                      SamplingParams(temperature=1.0), sampler.stages(prompts * samples)))
    seconds = time.perf_counter() - start
    slots = round_up(prompt_width + new_tokens, CACHE_BLOCK)
    cache = 2 * config.num_layers * prompts * samples * config.num_kv_heads * slots * config.head_dim * 2 // chips
    temp = memory["temp"]  # (a program over the chip's HBM: the temporaries libtpu asked for, and "oom")
    peak = memory.get("live_peak")  # the most bytes live at once (weights included); absent for an "oom" program
    return dict(shape=shape, chips=chips, attention=attention, compaction=compaction, temp_bytes=temp,
                cache_bytes=cache, temp_over_cache=round(temp / cache, 4), peak_bytes=peak,
                peak_over_cache=peak and round(peak / cache, 4), oom="oom" in memory, compile_seconds=round(seconds, 1))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="experiments/results/compaction_memory.json")
    parser.add_argument("--shapes", type=lambda v: v.split(","), default=["qwen3-0.6b"])
    parser.add_argument("--chips", type=lambda v: [int(x) for x in v.split(",")], default=[1, 4])
    parser.add_argument("--attention", type=lambda v: v.split(","), default=["pallas"],
                        help="pallas (the TPU default at head_dim 128) and/or xla (slow to compile at real shapes)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-width", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--label", default="", help="recorded with the rows (e.g. 'before' on an older commit)")
    args = parser.parse_args(argv)
    from importlib.metadata import version

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = dict(command=" ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]), commit=commit,
                  device="compile-only TPU v6e (libtpu on a CPU host)", python=platform.python_version(),
                  versions={p: version(p) for p in ("jax", "flax", "libtpu")},
                  settings=dict(prompts=args.prompts, samples=args.samples, prompt_width=args.prompt_width,
                                new_tokens=args.new_tokens), rows=[])
    for shape in args.shapes:
        for chips in args.chips:
            for attention in args.attention:
                for compaction in (0, 1, 2):
                    row = sampler_temp(shape, chips, attention, compaction, args.prompts, args.samples,
                                       args.prompt_width, args.new_tokens)
                    result["rows"].append(dict(row, label=args.label))
                    print(json.dumps(result["rows"][-1]), flush=True)
                    with open(args.out, "w") as f:  # after every row: a long run keeps what it measured
                        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
