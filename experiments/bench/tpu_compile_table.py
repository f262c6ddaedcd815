"""The compile-only TPU table of docs/tpu.md: the paper's ring3 and pair configs on v5e-8/16, v5p-8 and v6e-8, shared
and partitioned placement, compiled by libtpu on this (CPU) host without weights (`corl_jax.compile_check`).

    python experiments/bench/tpu_compile_table.py [--topologies=v5e-8,v5e-16,v5p-8,v6e-8]
        [--configs=ring3,pair_different_family,pair_same_family] [--prompt_len=512]
        [--out=experiments/results/tpu_compile_check.json] [--verify]

Every agent's mesh is fully sharded (fsdp over all of its chips: the paper models' fp32 weights and AdamW moments do
not fit a v5e/v6e chip replicated). A row that does not fit is tried again with the next smaller micro-batch (only
the update recompiles). Each program is compiled once per `compile_check.program_key` (model shape, slice, mesh
shape, shapes and settings): pair_same_family's agents reuse pair_different_family's Qwen2.5-1.5B programs.
Partitioned placement on a multi-host slice is not compiled: libtpu aborts the process (`MULTI_HOST_ABORT`).
`--out` is rewritten after every program and row; a rerun skips the rows it holds and reuses its programs' figures.
`--verify` compiles a tiny pair both ways (reused and fresh) and records whether the figures agree.
"""

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

CONFIGS = ("ring3", "pair_different_family", "pair_same_family")
# libtpu 0.0.42's fatal check on an 8-chip agent mesh of v5e-16 (partitioned pair; device ids span the 4 hosts)
MULTI_HOST_ABORT = "Unexpected device_id 11 [0:4] in replica group (0,1,2,3,4,5,6,7) :: target has 8 device_id"
GIB = 2 ** 30


def load(name, variant=""):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(__file__), "..", "..", "configs",
                                                                     f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(variant)


class Results:
    """The JSON at `path`: finished rows, every compiled program's figures (the reuse cache) and each run's command
    and wall time. Written whole after every change, so an interrupted run keeps what it computed."""

    def __init__(self, path, prompt_len):
        self.path = path
        self.data = {"prompt_len": prompt_len, "runs": [], "rows": [], "programs": {}}
        if os.path.exists(path):
            with open(path) as f:
                self.data = json.load(f)
            if self.data["prompt_len"] != prompt_len:
                sys.exit(f"error: {path} holds prompt_len={self.data['prompt_len']}; pass that or another --out")
        self.programs = self.data["programs"]
        self.run = {"command": " ".join([sys.executable, *sys.argv]), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                    time.gmtime()), "seconds": 0, "compiled": 0, "rows": 0}
        self.data["runs"].append(self.run)
        self.start = time.time()

    def row(self, config, topology, placement, micro):
        return next((r for r in self.data["rows"] if (r["config"], r["topology"], r["placement"],
                                                       r["micro_batch_size"]) == (config, topology, placement, micro)),
                    None)

    def save(self, row=None):
        if row is not None:
            self.data["rows"].append(row)
            self.run["rows"] += 1
        self.run["seconds"] = round(time.time() - self.start)
        self.data["table"] = table(self.data["rows"])
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(self.path + ".tmp", self.path)


class SavingCache(dict):
    """A `compile_check` program cache that saves the results after every new program."""

    def __init__(self, results):
        super().__init__(results.programs)
        self.results = results

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.results.programs[key] = value
        self.results.run["compiled"] += 1
        self.results.save()


def table(rows):
    lines = ["| config | slice | placement | mesh per agent | micro-batch | peak GiB per chip (resident) | fits |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "report" not in r:
            lines.append(f"| {r['config']} | {r['topology']} | {r['placement']} | – | – | – | {r['note']} |")
            continue
        agents = r["report"]["agents"]
        mesh = ",".join(f"{k}={v}" for k, v in next(iter(agents.values()))["mesh"].items() if v > 1)
        peaks = ", ".join(f"{a}: {x['peak_per_chip'] / GIB:.1f} ({x['resident'] / GIB:.1f})" for a, x in agents.items())
        fits = "yes" if r["fits"] else "**no**"
        lines.append(f"| {r['config']} | {r['topology']} | {r['placement']} | {mesh} | {r['micro_batch_size']} | "
                     f"{peaks} | {fits} ({r['report']['hbm_gib_per_chip']} GiB) |")
    return lines


def smaller_micro_batch(config):
    """The next smaller micro-batch dividing a step's completions (reference micro-batch lowered to match), or None."""
    batch = config.rollout.prompts_per_step * config.rollout.num_generations
    smaller = [m for m in range(config.grpo.micro_batch_size - 1, 0, -1) if batch % m == 0]
    return smaller[0] if smaller else None


def run_row(results, cache, name, topology, placement, prompt_len, micro=None):
    """Compile (or reuse) one row; returns it (None when the row is impossible on this slice)."""
    from corl_jax import compile_check

    config = load(name)
    if micro is not None:
        config.grpo.update(micro_batch_size=micro, reference_micro_batch_size=min(micro,
                                                                                 config.grpo.reference_micro_batch_size))
    micro = config.grpo.micro_batch_size
    done = results.row(name, topology, placement, micro)
    if done is not None:
        print(f"{name} {topology} {placement} micro-batch {micro}: in {results.path}", flush=True)
        return done
    chips, agents = compile_check.TOPOLOGIES[topology].chips, len(config.agents)
    if placement == "partitioned" and chips % agents:
        row = {"config": name, "topology": topology, "placement": placement, "micro_batch_size": micro,
               "note": f"not possible: {chips} chips do not split among {agents} agents"}
        results.save(row)
        return row
    if placement == "partitioned" and compile_check.TOPOLOGIES[topology].hosts > 1:
        row = {"config": name, "topology": topology, "placement": placement, "micro_batch_size": micro,
               "note": f"not compiled: libtpu aborts the process compiling for a sub-mesh of a multi-host slice "
                       f"({MULTI_HOST_ABORT})"}
        results.save(row)
        return row
    config.mesh.update(data=1, fsdp=chips if placement == "shared" else chips // agents, tensor=1)
    t0 = time.time()
    report = compile_check.check(config, topology, placement, prompt_len, cache)
    print(compile_check.format_report(report), f"({time.time() - t0:.0f} s)", flush=True)
    row = {"config": name, "topology": topology, "placement": placement, "micro_batch_size": micro,
           "fits": all(a["fits"] for a in report["agents"].values()), "seconds": round(time.time() - t0),
           "report": report}
    results.save(row)
    return row


def verify(results):
    """Compile tiny pair_different_family on v5e-8 (shared and partitioned) into the cache, then tiny pair_same_family
    (two agents of pair_different_family's first shape; partitioned: one on the other half of the slice) from the
    cache and fresh; record whether the figures agree."""
    from corl_jax import compile_check

    def tiny(name, fsdp):  # 8 prompts x G=2, micro-batch 8
        config = load(name, "tiny")
        config.rollout.update(prompts_per_step=8, num_generations=2)
        config.grpo.micro_batch_size = 8
        config.mesh.update(data=1, fsdp=fsdp, tensor=1)
        return config

    checks, cache = [], {}
    for placement, fsdp in (("shared", 8), ("partitioned", 4)):
        compile_check.check(tiny("pair_different_family", fsdp), "v5e-8", placement, 64, cache)
        name, topology = "pair_same_family", "v5e-8"
        reused = compile_check.check(tiny(name, fsdp), topology, placement, 64, cache)
        fresh = compile_check.check(tiny(name, fsdp), topology, placement, 64, {})
        for agent in reused["agents"]:
            for program, mem in reused["agents"][agent]["programs"].items():
                other = fresh["agents"][agent]["programs"][program]
                keys = ("argument", "output", "alias", "temp", "transient")
                checks.append({"config": name, "topology": topology, "placement": placement, "agent": agent,
                               "program": program, "reused": {k: mem[k] for k in keys},
                               "fresh": {k: other[k] for k in keys},
                               "equal": all(mem[k] == other[k] for k in keys)})
    results.data["verification"] = {
        "what": "tiny pair_same_family on v5e-8 (8 prompts x G=2, 64 prompt + 16 new tokens, fsdp over each agent's "
                "chips): figures read from the cache filled by tiny pair_different_family vs a fresh compile",
        "programs_compiled_into_cache": len(cache), "all_equal": all(c["equal"] for c in checks), "checks": checks}
    results.save()
    print(f"verification: {len(checks)} program figures, all equal: {results.data['verification']['all_equal']}, "
          f"{len(cache)} programs in the cache", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topologies", default="v5e-8,v5e-16,v5p-8,v6e-8")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--placements", default="shared,partitioned")
    parser.add_argument("--prompt_len", type=int, default=512)
    parser.add_argument("--out", default="experiments/results/tpu_compile_check.json")
    parser.add_argument("--no_smaller_micro_batch", action="store_true",
                        help="do not retry a row that does not fit with the next smaller micro-batch")
    parser.add_argument("--verify", action="store_true", help="only the reuse-vs-fresh check (tiny models)")
    args = parser.parse_args()

    import jax

    from corl_jax import compile_check

    for topology in args.topologies.split(","):
        if topology not in compile_check.TOPOLOGIES:
            sys.exit(f"error: unknown topology {topology!r}; use some of {', '.join(compile_check.TOPOLOGIES)}")
    for name in args.configs.split(","):
        if name not in CONFIGS:
            sys.exit(f"error: unknown config {name!r}; use some of {', '.join(CONFIGS)}")
    results = Results(args.out, args.prompt_len)
    results.data.update(device="compile-only TPU devices (libtpu) on " + platform.node(),
                        versions={"jax": jax.__version__, "libtpu": _libtpu_version()})
    if args.verify:
        return verify(results)
    cache = SavingCache(results)
    for topology in args.topologies.split(","):
        for name in args.configs.split(","):
            for placement in args.placements.split(","):
                row = run_row(results, cache, name, topology, placement, args.prompt_len)
                micro = smaller_micro_batch(load(name))
                if "report" in row and not row["fits"] and micro and not args.no_smaller_micro_batch:
                    run_row(results, cache, name, topology, placement, args.prompt_len, micro)
    results.save()
    print("\n".join(results.data["table"]))


def _libtpu_version():
    from importlib import metadata

    try:
        return metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        return os.environ.get("TPU_LIBRARY_PATH", "unknown")


if __name__ == "__main__":
    main()
